"""Shared test helpers: NumPy packing of client data and float64 NumPy references."""

from __future__ import annotations

import os
from typing import NamedTuple

# XLA's classic CPU emitters instead of its fusion emitters, and LLVM at -O1 instead of -O3: the tests' programs
# are small and run for milliseconds, while compiling them is most of the suite's time, which the emitters cut
# about 1.8× (measured on the algorithms' steps) and -O1 by about another 5–10 % (two files' compile seconds, in
# alternation). One thread per program, for its code generation and for its run: the suite runs one pytest worker
# per core already, and the extra threads only took CPU from the other worker (five files under two workers,
# cold, alternated twice: 7–12 % less wall time and 10–14 % less CPU time). It changes how XLA generates code,
# not what it computes: the tests' references hold as under the default pipeline, which the slow tier keeps
# (.ci/run). LLVM at -O0 would cut more, but XLA then computes NaN in some batched dot products
# (tests/test_client_map_fast_paths.py fails): not used.
# FEDJAX_OPT_TEST_XLA=default keeps XLA's defaults (read before JAX starts its backend; subprocesses that set
# their own XLA_FLAGS use XLA's defaults).
FAST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1 "
                  "--xla_cpu_parallel_codegen_split_count=1 --xla_cpu_multi_thread_eigen=false")
if os.environ.get("FEDJAX_OPT_TEST_XLA", "fast") == "fast":
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA_FLAGS}".strip()

# `auto` client maps decide by the measured rule in tests, not by timing candidates on a shared machine
# (tests/test_autotune.py measures with a fake timer; FEDJAX_OPT_AUTOTUNE=on turns measuring back on).
os.environ.setdefault("FEDJAX_OPT_AUTOTUNE", "off")

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo

# JAX's persistent compilation cache. Most of a test's time is compiling its programs, and many tests (and xdist
# workers) compile the same ones: a program compiled once is read back everywhere else, in this run and the next.
# Every program is kept, however fast it compiled: most of the suite's programs compile in under 0.2 s, and
# reading one back is still faster than compiling it again (a cold run of six files that build the same
# algorithms' steps: 106.6 s keeping programs of ≥ 0.2 s only, 97.5 s keeping all).
# FEDJAX_OPT_TEST_CACHE names the folder; "off" disables it (to time a cold run without it).
TEST_CACHE = os.environ.get("FEDJAX_OPT_TEST_CACHE",
                            os.path.join(os.path.expanduser("~"), ".cache", "fedjax_opt", "xla-tests"))
if TEST_CACHE != "off":
  jax.config.update("jax_compilation_cache_dir", TEST_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ.get("FEDJAX_OPT_TEST_CACHE_MIN_SECONDS", "0")))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pack(clients, steps, batch, *, extra_steps=0, extra_slots=0, extra_clients=0, dtype=np.float32, weights=None):
  """Packs `[(x_k [n_k, d], y_k [n_k])]` into ClientBatches, examples in order, step by step.

  Client k's examples fill steps of `batch` real slots each (the last step may be
  partial); `extra_steps` all-padding steps, `extra_slots` padding slots per step
  and `extra_clients` zero-weight padding clients are added on top. Padding
  holds arbitrary finite values, which must not matter.
  """
  n_clients = len(clients) + extra_clients
  s_total, b_total = steps + extra_steps, batch + extra_slots
  d = clients[0][0].shape[1]
  rng = np.random.default_rng(12345)
  x = rng.normal(size=(n_clients, s_total, b_total, d)).astype(dtype)
  y_dtype = clients[0][1].dtype
  y = np.zeros((n_clients, s_total, b_total), y_dtype)
  mask = np.zeros((n_clients, s_total, b_total), bool)
  for k, (xk, yk) in enumerate(clients):
    n = len(xk)
    assert n <= steps * batch
    for i in range(n):
      s, b = divmod(i, batch)
      x[k, s, b], y[k, s, b], mask[k, s, b] = xk[i], yk[i], True
  if weights is None:
    weights = [len(xk) for xk, _ in clients]
  w = np.zeros(n_clients, np.float32)
  w[:len(clients)] = weights
  return fo.ClientBatches(
      data={"x": jnp.asarray(x), "y": jnp.asarray(y)},
      mask=jnp.asarray(mask),
      weight=jnp.asarray(w),
      client_id=jnp.arange(n_clients, dtype=jnp.int32),
  )


def run_rounds(step, state, batches, rounds):
  """`rounds` rounds of `step` on the same batches as one jitted `lax.scan`: (final state, metrics stacked [rounds])."""

  def one(s, _):
    s = step(s, batches)
    return s, s.metrics

  return jax.jit(lambda s: jax.lax.scan(one, s, length=rounds))(state)


def lsq_loss(params, batch):
  """Per-example least squares ½(xᵀw + b − y)²."""
  pred = batch["x"] @ params["w"] + params["b"]
  return 0.5 * jnp.square(pred - batch["y"])


def lsq_grad_np(w, b, x, y):
  """float64 gradient of the mean least-squares loss."""
  r = x @ w + b - y
  return x.T @ r / len(y), np.mean(r)


def fedavg_lsq_np(w, b, x, y, mask, weight, lr):
  """float64 FedAvg round on least squares: each client's masked local SGD steps from (w, b), then the
  n_k-weighted mean of the deltas added to (w, b). x [C, S, B, d], y and mask [C, S, B], weight [C]."""
  x, y, weight = (np.asarray(a, np.float64) for a in (x, y, weight))
  w, mask = np.asarray(w, np.float64), np.asarray(mask, bool)
  dw, db = np.zeros_like(w), 0.0
  for k in range(len(weight)):
    wk, bk = w.copy(), float(b)
    for s in range(x.shape[1]):
      m = mask[k, s]
      if m.any():
        gw, gb = lsq_grad_np(wk, bk, x[k, s][m], y[k, s][m])
        wk, bk = wk - lr * gw, bk - lr * gb
    dw, db = dw + weight[k] * (wk - w), db + weight[k] * (bk - float(b))
  return w + dw / weight.sum(), float(b) + db / weight.sum()


def softmax_loss(params, batch):
  """Per-example multinomial logistic regression loss."""
  logits = batch["x"] @ params["w"] + params["b"]
  logz = jnp.log(jnp.sum(jnp.exp(logits - jnp.max(logits, -1, keepdims=True)), -1)) + jnp.max(logits, -1)
  return logz - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]


def softmax_grad_np(w, b, x, y):
  """float64 gradient of the mean softmax cross-entropy, written out by hand."""
  logits = x @ w + b
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  p[np.arange(len(y)), y] -= 1.0
  return x.T @ p / len(y), p.mean(0)


def make_clients(rng, sizes, d, kind="lsq", num_classes=3):
  """Heterogeneous clients: each has its own input shift and its own target model."""
  clients = []
  for k, n in enumerate(sizes):
    x = rng.normal(loc=0.3 * k, size=(n, d))
    if kind == "lsq":
      y = x @ rng.normal(size=d) + 0.1 * rng.normal(size=n)
    else:
      y = np.argmax(x @ rng.normal(size=(d, num_classes)), axis=1).astype(np.int32)
    clients.append((x, y))
  return clients


def ridge_logistic_loss(l2):
  """Per-example binary logistic loss with a ridge term (l2/2)‖w‖² on every example."""

  def loss(params, batch):
    s = batch["x"] @ params["w"] + params["b"]
    return jax.nn.softplus(s) - batch["y"] * s + 0.5 * l2 * jnp.sum(jnp.square(params["w"]))

  return loss


def logistic_clients(rng, sizes, d):
  """Heterogeneous binary classification clients: shifted inputs, a different separating direction each."""
  clients = []
  for k, n in enumerate(sizes):
    x = rng.normal(loc=0.5 * k, size=(n, d))
    y = (x @ rng.normal(size=d) + 0.5 * rng.normal(size=n) > 0.5 * k).astype(np.float64)
    clients.append((x, y))
  return clients


def ridge_logistic_objective(clients, l2, v):
  """float64 (value, gradient) at v = (w, b) of Σ_i [mean logistic loss of client i + (l2/2)‖w‖²]."""
  w, b = v[:-1], v[-1]
  total, grad = 0.0, np.zeros_like(v)
  for x, y in clients:
    s = x @ w + b
    p = 1 / (1 + np.exp(-s))
    total += np.mean(np.logaddexp(0, s) - y * s) + 0.5 * l2 * w @ w
    grad += np.append(x.T @ (p - y) / len(y) + l2 * w, np.mean(p - y))
  return total, grad


def ridge_logistic_optimum(clients, l2):
  """The minimiser of `ridge_logistic_objective`, by float64 scipy L-BFGS."""
  import scipy.optimize

  d = clients[0][0].shape[1]
  return scipy.optimize.minimize(lambda v: ridge_logistic_objective(clients, l2, v), np.zeros(d + 1), jac=True,
                                 method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 10000}).x


def quadratic_hessians(a, b):
  """Clients f_i(x) = (1/2m) ‖A_i x − b_i‖² (a `[n, m, d]`, b `[n, m]`): (H_i `[n, d, d]`, g_i `[n, d]`), ∇f_i = H_i x − g_i."""
  m = b.shape[1]
  return np.einsum("imd,ime->ide", a, a) / m, np.einsum("imd,im->id", a, b) / m


def quadratic_grads(a, b, x):
  """∇f_i(x_i) `[n, d]` of the quadratic clients."""
  h, g = quadratic_hessians(a, b)
  return np.einsum("ide,ie->id", h, x) - g


def mixture_optimum(a, b, lam):
  """x(λ) `[n, d]` of F = (1/n) Σ f_i(x_i) + λ/(2n) Σ ‖x_i − x̄‖²: ∇f_i(x_i) + λ(x_i − x̄) = 0, one linear solve."""
  h, g = quadratic_hessians(a, b)
  n, d = g.shape
  system = np.kron(np.eye(n) - np.ones((n, n)) / n, lam * np.eye(d))
  for i in range(n):
    system[i * d:(i + 1) * d, i * d:(i + 1) * d] += h[i]
  return np.linalg.solve(system, g.reshape(-1)).reshape(n, d)


def mixture_objective(a, b, x, lam):
  """F(x) = (1/n) Σ f_i(x_i) + λ/(2n) Σ ‖x_i − x̄‖² in float64."""
  losses = [0.5 * np.mean((ai @ xi - bi)**2) for ai, bi, xi in zip(a, b, x)]
  return np.mean(losses) + lam / (2 * len(x)) * np.sum((x - x.mean(0))**2)


def diagonal(rows, columns):
  """`(row, column)` parameters for a test that crosses every row with every column (algorithms × client maps).

  The default tier runs the diagonal: row i with column i mod len(columns), so every row and every column is
  tested at least once; the other cells are marked `slow` and run in the second tier (`.ci/run` runs both).
  Each cell compiles its own programs, so the whole product would cost the default tier len(columns) times
  as much for the same code paths.
  """
  rows, columns = list(rows), list(columns)
  return [pytest.param(r, c, marks=() if j == i % len(columns) else pytest.mark.slow)
          for i, r in enumerate(rows) for j, c in enumerate(columns)]


@pytest.fixture
def rng():
  return np.random.default_rng(0)


# FEDJAX_OPT_TEST_COMPILE_REPORT=1: per test file, the programs JAX traced, lowered and compiled and their seconds,
# printed at the end of the run (of each xdist worker's files when run with -n: use it without -n to see them all).
# Where the default tier's time goes, and whether a change compiles less.
_COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                   "/jax/core/compile/backend_compile_duration": "compile"}
_compile_report: dict[str, dict[str, list]] = {}
_current_file = [None]


def _record_compile_event(event, duration, **kwargs):
  del kwargs
  kind = _COMPILE_EVENTS.get(event)
  if kind is not None and _current_file[0] is not None:
    entry = _compile_report.setdefault(_current_file[0], {k: [0, 0.0] for k in _COMPILE_EVENTS.values()})
    entry[kind][0] += 1
    entry[kind][1] += duration


if os.environ.get("FEDJAX_OPT_TEST_COMPILE_REPORT"):
  jax.monitoring.register_event_duration_secs_listener(_record_compile_event)

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    del nextitem
    _current_file[0] = item.location[0]
    yield

  def pytest_terminal_summary(terminalreporter):
    rows = sorted(_compile_report.items(), key=lambda kv: -sum(v[1] for v in kv[1].values()))
    terminalreporter.write_line("programs traced / lowered / compiled (seconds) per test file:")
    for path, entry in rows:
      cells = "  ".join(f"{k} {n:4d} {s:6.1f}s" for k, (n, s) in entry.items())
      terminalreporter.write_line(f"  {path:48s} {cells}")


class CliResult(NamedTuple):
  """What `fedjax-opt` returned and printed."""

  returncode: int
  stdout: str
  stderr: str


@pytest.fixture
def cli(capsys, monkeypatch):
  """`cli(*args)`: `fedjax-opt ARGS` in this process (`cli.main(argv)`), for usage errors and other quick answers.

  In-process costs milliseconds where a subprocess costs seconds of interpreter start and imports. The run's
  process-wide settings are left alone: no compilation-cache folder and no CPU device count (both would outlive
  the call in this test process); `warnings.formatwarning` is restored afterwards.
  """
  import warnings

  from fedjax_opt import cli as cli_lib
  from fedjax_opt.cli import run as run_lib

  monkeypatch.setattr(run_lib, "enable_compile_cache", lambda setting: None)
  monkeypatch.setattr(run_lib, "use_cpu_devices", lambda devices: None)
  monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)

  def call(*args):
    capsys.readouterr()
    try:
      code = cli_lib.main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors and --help
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    out, err = capsys.readouterr()
    return CliResult(code, out, err)

  return call
