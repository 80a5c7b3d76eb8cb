"""Seconds per FedAvg round: fedjax_opt's client maps against per-client loops and a centralized floor.

Workloads (local SGD, one FedAvg round = C clients × S local steps × B examples):
  W-LR:  multinomial logistic regression on Synthetic(1,1) (60 features, 10 classes), S=20, B=10,
         C in {10, 100, 1000} (each client's first S·B examples, cycled when it has fewer).
  W-MLP: the 2NN MLP of McMahan et al. (784-200-200-10), S=10, B=20, C in {8, 32, 128, 512}.
  W-CNN: the EMNIST CNN of Reddi et al. (28×28, 62 classes), S=5, B=20, C in {8, 32, 128}.
  (MLP and CNN inputs are random arrays of the right shapes: the numbers measure compute.)

Methods (the median of interleaved repeats after compilation; all jitted):
  auto, vmap, sequential, chunked:K ...  `fo.algorithms.fedavg(..., client_map=mode).step`, one program
  sharded                                the same over every device (with --devices N > 1), and
  sharded+psum                           a FedAvg round that reduces inside shard_map (psum)
  loop/client                            one jitted call per client (`local_train`: a scan over its steps),
                                         then one jitted call averaging the deltas (fedjax's per-client loop)
  loop/step                              one jitted call per client per local step (how fedjax's
                                         `for_each_client` and PyTorch simulators run clients)
  central                                the same S steps on one model with the C clients' batches merged
                                         (batch C·B): the same examples and depth without per-client
                                         models, the floor for that compute
  flower                                 Flower's simulation with PyTorch, when installed (skipped otherwise)

FLOP/s: XLA's count for the centralized program (the same arithmetic as a round) divided by each method's
time, against the best of a 2048×2048 float32 matmul measured on the same device.

    python benchmarks/throughput.py               # all sizes (~10 min on a 2-core CPU); table, JSON, PNG
    python benchmarks/throughput.py --quick       # smaller sizes (~2 min)
    python benchmarks/throughput.py --devices 8   # simulate 8 CPU devices: adds the sharded columns
    python benchmarks/throughput.py --memory      # + peak RSS of one C=1024 W-CNN round (subprocesses)
    python benchmarks/throughput.py --memory-only # just that
    python benchmarks/throughput.py --workloads W-LR --out /tmp/lr  # a subset, written to another folder

A run of a subset of the workloads writes `throughput_<workloads>.json` (e.g. `throughput_W-LR.json`), so it
never replaces the full run's `throughput.json`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple


def _parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="smaller client counts")
  parser.add_argument("--workloads", default="W-LR,W-MLP,W-CNN", help="comma-separated subset")
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds per method (fewer for slow ones)")
  parser.add_argument("--cell-seconds", type=float, default=30.0,
                      help="time budget per method and C: repeats are cut to fit")
  parser.add_argument("--max-round-seconds", type=float, default=45.0,
                      help="skip a method whose round is predicted slower than this (from the previous C)")
  parser.add_argument("--devices", type=int, default=None, help="simulate this many CPU devices (XLA flag)")
  parser.add_argument("--memory", action="store_true", help="also measure peak RSS of C=1024 W-CNN rounds")
  parser.add_argument("--memory-only", action="store_true", help="only the memory measurement")
  parser.add_argument("--memory-clients", type=int, default=1024)
  parser.add_argument("--memory-child", nargs=2, metavar=("MODE", "C"), help=argparse.SUPPRESS)
  parser.add_argument("--no-run", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                      help="folder for the JSON and PNG (a subset of --workloads adds its names to the file name)")
  return parser.parse_args(argv)


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

import fedjax_opt as fo  # noqa: E402
from fedjax_opt import distributed  # noqa: E402
from fedjax_opt.core import client_map as cm  # noqa: E402
from fedjax_opt.core.local import local_train  # noqa: E402

CLIENT_LR = 0.05


class Workload(NamedTuple):
  name: str
  model: Any
  sizes: list[int]
  quick_sizes: list[int]
  local_steps: int
  batch_size: int
  modes: list[str]  # fedjax_opt client maps timed at every C ("chunked:C/4" -> k = C // 4)
  first_only: list[str]  # modes timed at the smallest C only (to show a cost)
  unroll_central: bool


WORKLOADS = {
    "W-LR": Workload("W-LR", fo.models.logistic_regression(60, 10), [10, 100, 1000], [10, 100], 20, 10,
                     ["auto", "vmap", "vmap:fuse_small_dots", "sequential", "chunked:C/4"], [], False),
    "W-MLP": Workload("W-MLP", fo.models.mlp_2nn(num_classes=10, input_dim=784), [8, 32, 128, 512], [8, 32], 10, 20,
                      ["auto", "vmap", "sequential", "chunked:C/4"], [], False),
    "W-CNN": Workload("W-CNN", fo.models.emnist_cnn(), [8, 32, 128], [8], 5, 20,
                      ["auto"], ["vmap:unroll", "chunked:C/4:canonical_convs", "sequential"], True),
}

# ---- data ------------------------------------------------------------------------------------------------------


def _batches(workload: Workload, c: int, seed: int = 0) -> fo.ClientBatches:
  s, b = workload.local_steps, workload.batch_size
  rng = np.random.default_rng(seed)
  if workload.name == "W-LR":
    from fedjax_opt.data.synthetic import generate_synthetic

    clients = generate_synthetic(1.0, 1.0, num_clients=c, seed=seed).clients
    take = [np.arange(s * b) % len(cl["y"]) for cl in clients]
    x = np.stack([cl["x"][i] for cl, i in zip(clients, take)]).reshape(c, s, b, 60)
    y = np.stack([cl["y"][i] for cl, i in zip(clients, take)]).reshape(c, s, b)
  else:
    shape = workload.model.input_shape
    x = rng.normal(size=(c, s, b) + tuple(d for d in shape if d != 1)).astype(np.float32)
    y = rng.integers(0, workload.model.num_classes, (c, s, b))
  return fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.int32)},
                          mask=jnp.ones((c, s, b), bool), weight=jnp.full((c,), float(s * b)),
                          client_id=jnp.arange(c, dtype=jnp.int32))


# ---- the methods: each returns a no-argument callable running one round ----------------------------------------


def _mode(name: str, c: int) -> Any:
  if "C/4" in name:
    name = name.replace("C/4", str(max(1, c // 4)))
  return cm.resolve(name)


COLLECTIVES: dict[str, str] = {}  # method -> the collectives in its compiled program (sharded runs)


def collectives(compiled: Any) -> str:
  """The cross-device collectives of a compiled program and the bytes each moves, e.g. 'all-reduce 1×796 kB'."""
  found: dict[str, list[int]] = {}
  for line in compiled.as_text().splitlines():
    match = re.search(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                      r"(?:-start)?\(", line)
    if not match:
      continue
    size = 0
    for dtype, dims in re.findall(r"(f32|f16|bf16|s32|u32|pred|f64|s64)\[([0-9,]*)\]", match.group(1)):
      count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
      size += count * {"f64": 8, "s64": 8, "f16": 2, "bf16": 2, "pred": 1}.get(dtype, 4)
    found.setdefault(match.group(2), []).append(size)
  return ", ".join(f"{op} {len(sizes)}×, {sum(sizes) / 1e3:.0f} kB" for op, sizes in sorted(found.items())) or "none"


def fedjax_round(workload: Workload, mode: Any, params, batches, name: str | None = None) -> Callable[[], Any]:
  algo = fo.algorithms.fedavg(workload.model.loss_fn, client_optimizer=optax.sgd(CLIENT_LR), client_map=mode)
  state = algo.init(params, jax.random.key(0))
  compiled = jax.jit(algo.step).lower(state, batches).compile()
  if name is not None:
    COLLECTIVES[name] = collectives(compiled)
  return lambda: compiled(state, batches)


def _server_average():
  """x + Σ w_c (x_c − x) / Σ w_c over a list of client models (or deltas when `deltas`)."""

  @functools.partial(jax.jit, static_argnums=3)
  def average(params, results, weights, deltas):
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *results)
    w = weights / jnp.sum(weights)
    return jax.tree.map(lambda p, r: p + jnp.tensordot(w, r - (0 if deltas else p[None]), axes=1), params, stacked)

  return average


def loop_per_client(workload: Workload, params, batches) -> Callable[[], Any]:
  loss = workload.model.loss_fn
  c = batches.num_clients
  data = [(jax.tree.map(lambda a, i=i: a[i], batches.data), batches.mask[i]) for i in range(c)]
  client = jax.jit(lambda p, d, m: local_train(loss, optax.sgd(CLIENT_LR), p, d, m).delta).lower(
      params, *data[0]).compile()
  average = _server_average().lower(params, [params] * c, batches.weight, True).compile()
  jax.block_until_ready(data)

  def run():
    deltas = [client(params, d, m) for d, m in data]
    return average(params, deltas, batches.weight)

  return run


def loop_per_step(workload: Workload, params, batches) -> Callable[[], Any]:
  c, s = batches.num_clients, batches.local_steps
  steps = [[(jax.tree.map(lambda a, i=i, j=j: a[i, j], batches.data), batches.mask[i, j]) for j in range(s)]
           for i in range(c)]
  sgd_step = jax.jit(_sgd_step(workload.model.loss_fn)).lower(params, *steps[0][0]).compile()
  average = _server_average().lower(params, [params] * c, batches.weight, False).compile()
  jax.block_until_ready(steps)

  def run():
    finals = []
    for client_steps in steps:
      x = params
      for batch, mask in client_steps:
        x = sgd_step(x, batch, mask)
      finals.append(x)
    return average(params, finals, batches.weight)

  return run


def _central_program(workload: Workload, params, batches):
  c, s, b = batches.mask.shape
  merged = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape((s, c * b) + a.shape[3:]), batches.data)
  mask = jnp.swapaxes(batches.mask, 0, 1).reshape(s, c * b)
  fn = jax.jit(lambda p, d, m: local_train(workload.model.loss_fn, optax.sgd(CLIENT_LR), p, d, m,
                                           unroll=workload.unroll_central).delta)
  return fn.lower(params, merged, mask).compile(), (params, merged, mask)


def _sgd_step(loss):
  """One masked SGD step of a model on a batch: what every method repeats S times per client."""
  optimizer = optax.sgd(CLIENT_LR)

  def step(p, batch, mask):
    grad = jax.grad(lambda q: jnp.sum(jnp.where(mask, loss(q, batch), 0)) / jnp.maximum(jnp.sum(mask), 1))(p)
    updates, _ = optimizer.update(grad, optimizer.init(p), p)
    return optax.apply_updates(p, updates)

  return step


def round_flops(workload: Workload, params, batches) -> float:
  """XLA's FLOP count of one round's arithmetic: S × one step on the C·B merged examples.

  (Counted on a loop-free program: XLA's cost analysis counts a loop body once, not per trip.)
  """
  c, s, b = batches.mask.shape
  batch = jax.tree.map(lambda a: a[:, 0].reshape((c * b,) + a.shape[3:]), batches.data)
  compiled = jax.jit(_sgd_step(workload.model.loss_fn)).lower(params, batch, batches.mask[:, 0].reshape(-1)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return s * float(cost.get("flops", float("nan")))


def central(workload: Workload, params, batches) -> Callable[[], Any]:
  """The floor: S steps of one model on the C clients' batches merged (batch C·B)."""
  compiled, args = _central_program(workload, params, batches)
  return lambda: compiled(*args)


def sharded_psum_round(workload: Workload, params, batches) -> Callable[[], Any]:
  """FedAvg whose weighted sum is reduced inside shard_map with psum (no non-finite guard: a comparison only)."""
  mesh = cm.client_mesh()
  loss = workload.model.loss_fn

  def per_device(p, data, mask, weight):
    deltas = cm.map_clients("auto", lambda q, cl: local_train(loss, optax.sgd(CLIENT_LR), q, *cl).delta, p,
                            (data, mask))
    partial = jax.tree.map(lambda d: jnp.tensordot(weight, d, axes=1), deltas)
    return jax.lax.psum((partial, jnp.sum(weight)), "clients")

  @jax.jit
  def step(p, batches):
    (total, weight) = jax.shard_map(per_device, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("clients"),
                                                                     PartitionSpec("clients"),
                                                                     PartitionSpec("clients")),
                                    out_specs=PartitionSpec(), check_vma=False)(p, batches.data, batches.mask,
                                                                                batches.weight)
    return jax.tree.map(lambda x, t: x + t / weight, p, total)

  padded = distributed.pad_batches(batches, mesh.shape["clients"])
  compiled = step.lower(params, padded).compile()
  COLLECTIVES["sharded+psum"] = collectives(compiled)
  return lambda: compiled(params, padded)


def flower_available() -> str | None:
  """None when Flower's simulation and PyTorch can be imported, else why not."""
  missing = [m for m in ("flwr", "torch") if importlib.util.find_spec(m) is None]
  return None if not missing else f"not installed: {', '.join(missing)} (pip install 'flwr[simulation]' torch)"


# ---- timing ----------------------------------------------------------------------------------------------------


def matmul_peak_flops(n: int = 2048, repeats: int = 7) -> float:
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
  f = jax.jit(lambda x, y: x @ y).lower(a, a).compile()
  jax.block_until_ready(f(a, a))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, a))
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


def _timed(run: Callable[[], Any]) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(run())
  return time.perf_counter() - t0


def time_cell(runs: dict[str, Callable[[], Any]], repeats: int, cell_seconds: float) -> dict[str, float]:
  """Median seconds per round of each method: one warm-up each, then interleaved repeats (fewer for slow ones).

  Each repeat starts at the next method (a rotation): the first method of a repeat ran up to 1.6× slower
  than the same program later in it (W-LR, C=10), so no method is always first.
  """
  samples = {name: [_timed(run)] for name, run in runs.items()}  # warm-up, kept as a sample
  wanted = {name: max(1, min(repeats, int(cell_seconds / max(s[0], 1e-9)))) for name, s in samples.items()}
  names = list(runs)
  for r in range(1, max(wanted.values())):
    for name in names[r % len(names):] + names[:r % len(names)]:
      if r < wanted[name]:
        samples[name].append(_timed(runs[name]))
  return {name: statistics.median(s[1:] if len(s) > 1 else s) for name, s in samples.items()}


def run_workload(workload: Workload, sizes: list[int], args, peak: float) -> list[dict]:
  rows = []
  previous: dict[str, tuple[int, float]] = {}
  params = workload.model.init(jax.random.key(0))
  for c in sizes:
    batches = _batches(workload, c)
    builders: dict[str, Callable[[], Any]] = {}
    modes = workload.modes + (workload.first_only if c == sizes[0] else [])
    for name in modes:
      builders[name] = lambda name=name: fedjax_round(workload, _mode(name, c), params, batches)
    if jax.device_count() > 1:
      builders["sharded"] = lambda: fedjax_round(workload, cm.sharded(), params, batches, "sharded")
      builders["sharded+psum"] = lambda: sharded_psum_round(workload, params, batches)
    builders["loop/client"] = lambda: loop_per_client(workload, params, batches)
    builders["loop/step"] = lambda: loop_per_step(workload, params, batches)
    builders["central"] = lambda: central(workload, params, batches)
    runs, skipped, labels, resolved = {}, {}, {}, {}
    for name, build in builders.items():
      if name in previous:
        prev_c, prev_s = previous[name]
        predicted = prev_s * c / prev_c
        if predicted > args.max_round_seconds:
          skipped[name] = f"predicted {predicted:.0f} s/round from C={prev_c}"
          continue
      t0 = time.perf_counter()
      runs[name] = build()
      if not name.startswith("loop") and name != "central":
        labels[name] = _label(name, c, workload, params, batches)
        if name != "sharded+psum":
          resolved[name] = _resolved(name, c, workload, params, batches)
      print(f"  [{workload.name} C={c}] built {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    flops = round_flops(workload, params, batches)
    seconds = time_cell(runs, args.repeats, args.cell_seconds)
    for name, sec in seconds.items():
      previous[name] = (c, sec)
    for name in builders:
      row = {"workload": workload.name, "C": c, "S": workload.local_steps, "B": workload.batch_size,
             "method": name, "mode": labels.get(name), "resolved": resolved.get(name)}
      if name in seconds:
        row.update(seconds=seconds[name], flops_per_second=flops / seconds[name], peak_fraction=flops /
                   seconds[name] / peak)
      else:
        row["skipped"] = skipped.get(name, "not run")
      rows.append(row)
    reason = flower_available()
    rows.append({"workload": workload.name, "C": c, "method": "flower", "skipped": reason or "not implemented"})
    _print_cell(workload.name, c, rows[-len(builders) - 1:], flops)
  return rows


def _resolved(name: str, c: int, workload: Workload, params, batches) -> str:
  """The mode's program, spelled out: `auto` resolved for this workload and C, `sharded` with its inner mode."""
  mode = cm.sharded() if name == "sharded" else _mode(name, c)
  if isinstance(mode, cm.Auto):
    fn = lambda p, client: local_train(workload.model.loss_fn, optax.sgd(CLIENT_LR), p, *client)
    mode = mode.resolve(fn, params, (batches.data, batches.mask))
  return repr(mode)


def _label(name: str, c: int, workload: Workload, params, batches) -> str:
  """What a mode resolves to for this workload (auto's choice spelled out); sharded ones with their collectives."""
  if name in ("sharded", "sharded+psum"):
    return f"{jax.device_count()} devices; collectives: {COLLECTIVES.get(name, '?')}"
  return _resolved(name, c, workload, params, batches)


def _print_cell(name: str, c: int, rows: list[dict], flops: float) -> None:
  floor = next((r["seconds"] for r in rows if r["method"] == "central" and "seconds" in r), float("nan"))
  print(f"{name} C={c}  ({flops / 1e9:.2f} GFLOP per round)")
  for r in rows:
    if "seconds" in r:
      print(f"    {r['method']:22} {1e3 * r['seconds']:10.1f} ms  {r['seconds'] / floor:6.2f}× floor  "
            f"{r['flops_per_second'] / 1e9:7.1f} GFLOP/s  {r.get('mode') or ''}")
    else:
      print(f"    {r['method']:22} {'skipped':>10}     {r['skipped']}")


# ---- memory ----------------------------------------------------------------------------------------------------


def memory_child(mode_name: str, c: int, run: bool = True) -> None:
  """One W-CNN round of C clients in this process; prints seconds, the chunk size and peak RSS as JSON.

  With `run=False` the round is only compiled, and XLA's own account of the
  buffers it would allocate (`memory_analysis`) is reported instead.
  """
  workload = WORKLOADS["W-CNN"]
  params = workload.model.init(jax.random.key(0))
  batches = _batches(workload, c)
  mode = cm.resolve(mode_name)
  fn = lambda p, client: local_train(workload.model.loss_fn, optax.sgd(CLIENT_LR), p, *client)
  per_client = (batches.data, batches.mask)
  resolved = mode.resolve(fn, params, per_client) if isinstance(mode, cm.Auto) else mode
  chunk = resolved.chunk_size if isinstance(resolved, cm.Chunked) else c
  if isinstance(resolved, cm.Chunked) and resolved.chunk_size is None:
    chunk = cm.default_chunk_size(fn, params, per_client, resolved.memory_budget)
  algo = fo.algorithms.fedavg(workload.model.loss_fn, client_optimizer=optax.sgd(CLIENT_LR), client_map=mode)
  state = algo.init(params, jax.random.key(0))
  t0 = time.perf_counter()
  compiled = jax.jit(algo.step).lower(state, batches).compile()
  result = {"mode": mode_name, "resolved": repr(resolved), "C": c, "chunk_size": chunk,
            "client_footprint_bytes": cm.client_footprint(fn, params, per_client),
            "memory_budget_bytes": cm.default_memory_budget(), "compile_seconds": time.perf_counter() - t0}
  analysis = compiled.memory_analysis()
  if analysis is not None:
    result.update(xla_temp_bytes=analysis.temp_size_in_bytes, xla_argument_bytes=analysis.argument_size_in_bytes,
                  xla_output_bytes=analysis.output_size_in_bytes)
  if run:
    result["seconds"] = _timed(lambda: compiled(state, batches))
  result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(json.dumps(result))


def measure_memory(c: int) -> list[dict]:
  """Peak RSS of one C-client W-CNN round with `auto` (run), and XLA's buffer account of `chunked()` (compiled)."""
  out = []
  for mode, run in (("auto", True), ("chunked:canonical_convs", False), ("vmap:canonical_convs", False)):
    print(f"memory: W-CNN, C={c}, client_map={mode!r}, {'one round' if run else 'compile only'} (subprocess) ...",
          flush=True)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", mode, str(c)]
                          + ([] if run else ["--no-run"]), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
      out.append({"mode": mode, "C": c, "error": proc.stderr[-2000:]})
      print(proc.stderr[-2000:])
      continue
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out.append(result)
    print(f"  {result['resolved']}: chunk {result['chunk_size']}, "
          + (f"{result['seconds']:.0f} s/round, " if "seconds" in result else "")
          + f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB, XLA temp "
          f"{result.get('xla_temp_bytes', float('nan')) / 2**30:.2f} GiB + output "
          f"{result.get('xla_output_bytes', float('nan')) / 2**30:.2f} GiB", flush=True)
  return out


# ---- report ----------------------------------------------------------------------------------------------------


def _seconds(rows, workload, c, method):
  for r in rows:
    if r["workload"] == workload and r["C"] == c and r["method"] == method and "seconds" in r:
      return r["seconds"]
  return None


AUTO_NOISE = 1.10
"""`auto` counts as no slower than the best fixed mode of a cell when within this factor of it (timing noise)."""


def targets(rows: list[dict]) -> list[dict]:
  """The targets, each with the measured ratio and whether it was met.

  Speed-ups against the per-client loop and distance to the centralized floor
  for W-LR C=100 and W-MLP C=128, W-CNN C=32 against one call per step, and,
  in every cell, `auto` against the best fixed mode timed there.
  """
  checks = [("W-LR", 100, "central", "≤", 2.0), ("W-LR", 100, "loop/client", "≥", 3.7),
            ("W-LR", 100, "loop/step", "≥", 10.0), ("W-MLP", 128, "central", "≤", 2.0),
            ("W-MLP", 128, "loop/client", "≥", 1.3), ("W-CNN", 32, "loop/step", "≥", 1.0)]
  out = []
  for workload, c, other, op, bound in checks:
    ours, theirs = _seconds(rows, workload, c, "auto"), _seconds(rows, workload, c, other)
    if ours is None or theirs is None:
      continue
    ratio = ours / theirs if op == "≤" else theirs / ours
    text = (f"{workload} C={c}: auto / {other} = {ratio:.2f} (target ≤ {bound})" if op == "≤" else
            f"{workload} C={c}: {other} / auto = {ratio:.2f} (target ≥ {bound})")
    out.append({"workload": workload, "C": c, "versus": other, "ratio": ratio, "target": f"{op} {bound}",
                "met": ratio <= bound if op == "≤" else ratio >= bound, "text": text})
  for workload, c in sorted({(r["workload"], r["C"]) for r in rows}):
    ours = _seconds(rows, workload, c, "auto")
    fixed = {r["method"]: r["seconds"] for r in rows if r["workload"] == workload and r["C"] == c
             and "seconds" in r and r["method"] not in ("auto", "central", "sharded+psum")
             and not r["method"].startswith("loop")}
    if ours is None or not fixed:
      continue
    best = min(fixed, key=fixed.get)
    ratio = ours / fixed[best]
    programs = {r["method"]: r.get("resolved") for r in rows if r["workload"] == workload and r["C"] == c}
    same = programs.get("auto") is not None and programs.get("auto") == programs.get(best)
    text = f"{workload} C={c}: auto / best fixed mode ({best}) = {ratio:.2f} (target ≤ {AUTO_NOISE})"
    if same:
      text += f"; auto runs the same program as {best}, so the ratio is timing noise"
    out.append({"workload": workload, "C": c, "versus": f"best fixed mode ({best})", "ratio": ratio,
                "target": f"≤ {AUTO_NOISE}", "met": same or ratio <= AUTO_NOISE, "same_program": same,
                "text": text})
  return out


def plot(rows: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
  for ax, workload in zip(axes[0], names):
    methods = sorted({r["method"] for r in rows if r["workload"] == workload and "seconds" in r})
    for method in methods:
      pts = sorted((r["C"], r["seconds"]) for r in rows
                   if r["workload"] == workload and r["method"] == method and "seconds" in r)
      style = dict(ls="--", lw=1) if method.startswith("loop") else dict(ls=":", color="k") if method == "central" \
          else dict(lw=2 if method == "auto" else 1)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients per round C")
    ax.set_ylabel("seconds per round")
    ax.set_title(workload)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(args) -> None:
  if args.memory_child:
    memory_child(args.memory_child[0], int(args.memory_child[1]), run=not args.no_run)
    return
  if args.memory_only:
    os.makedirs(args.out, exist_ok=True)
    memory = measure_memory(args.memory_clients)
    with open(os.path.join(args.out, "throughput_memory.json"), "w") as f:
      json.dump({"jax": jax.__version__, "physical_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf(
          "SC_PHYS_PAGES"), "memory": memory}, f, indent=1)
    return
  device = jax.devices()[0]
  info = {"backend": jax.default_backend(), "device": device.device_kind, "devices": jax.device_count(),
          "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "jax": jax.__version__,
          "quick": args.quick, "load_average": os.getloadavg()}
  print(json.dumps(info))
  peak = matmul_peak_flops()
  print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (2048×2048 float32)")
  reason = flower_available()
  if reason:
    print(f"flower: skipped, {reason}")
  rows = []
  t0 = time.perf_counter()
  names = args.workloads.split(",")
  unknown = [n for n in names if n not in WORKLOADS]
  if unknown:
    raise SystemExit(f"--workloads: unknown {unknown}; expected a comma-separated subset of {list(WORKLOADS)}")
  for name in names:
    workload = WORKLOADS[name]
    rows += run_workload(workload, workload.quick_sizes if args.quick else workload.sizes, args, peak)
  total = time.perf_counter() - t0
  checks = targets(rows)
  print("\ntargets:")
  for check in checks:
    print(f"  [{'met' if check['met'] else 'NOT met'}] {check['text']}")
  memory = measure_memory(args.memory_clients) if args.memory else None
  os.makedirs(args.out, exist_ok=True)
  stem = "throughput_quick" if args.quick else "throughput"
  if args.devices:
    stem += f"_{args.devices}dev"
  if set(names) != set(WORKLOADS):
    stem += "_" + "_".join(names)
  result = dict(info, matmul_peak_flops=peak, seconds_total=total, rows=rows, targets=checks, memory=memory)
  with open(os.path.join(args.out, stem + ".json"), "w") as f:
    json.dump(result, f, indent=1)
  plot(rows, os.path.join(args.out, stem + ".png"))
  print(f"\nwrote {os.path.join(args.out, stem)}.json and .png ({total:.0f} s)")


if __name__ == "__main__":
  main(ARGS)
