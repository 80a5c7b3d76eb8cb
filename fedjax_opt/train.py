"""The training driver: rounds as compiled chunks, evaluation, progress, history, checkpoints.

`train(algorithm, state, dataset, rounds, ...)` runs any `FederatedAlgorithm`:

* Rounds run in chunks of `eval_every`: one jitted `lax.scan` per chunk, whose
  body draws the round's clients and batches with `fedjax_opt.data.sample_round`
  and applies `algorithm.step`. Nothing returns to Python inside a chunk. The
  batches are drawn `deferred`: a round whose clients run in a loop gathers
  each chunk's examples from the packed dataset inside the loop, so its memory
  does not grow with the clients per round (`core.rounds`).
  Chunks end on multiples of `eval_every` (counted from round 0), so a resumed
  run executes exactly the same chunks as an uninterrupted one.
* The data of round r are drawn with the key `fold_in(key(seed), r)`, and the
  algorithm's own randomness lives in `state.key`, so a run is a deterministic
  function of (state, dataset, seed) whatever the chunking: resuming from a
  checkpoint gives the bit-for-bit final state of an uninterrupted run.
* Between chunks: evaluation of the model (`eval_params(state)`, default
  `state.params`) on every client's test split, on a centralized test set when
  the dataset has one, and on held-out clients when given; for personalized
  algorithms, of each client's own model on its own test examples
  (`personalized_params` or `personalize`, below); a progress line or bar;
  the `History`; and, every `checkpoint_every` chunks and at the end, an
  orbax checkpoint of the state and the history.
* Personalized metrics. `personalized_params(state) -> [N, ...]` (a table
  with one model per dataset client: `fo.personalized_params`, which reads
  the `state.local_params` of Ditto, pFedMe, EASGD, FedU, L2GD / L2SGD+ and
  the ADMM family) or `personalize(params, data, mask) -> params` (a model
  adapted on each client's train split from `eval_params(state)`:
  `algorithm.personalize` of Per-FedAvg and FedAvg + fine-tuning) adds, per
  metric, `personalized_test_<name>` (mean over the clients with test
  examples), `personalized_test_<name>_weighted` (example-weighted mean),
  `personalized_test_<name>_p10` (10th percentile over clients) and
  `personalized_num_excluded` (clients without test examples), exactly the
  summary of `fedjax_opt.evaluate.personalized` / `adapted`.
* Safety. Before the first chunk runs, its memory (from the compiled
  program's `memory_analysis`) is checked against what the device has
  (`RoundTooLargeError`, nothing allocated). After each chunk the run is
  checked for divergence (a non-finite model or client loss, every update
  non-finite for a whole chunk, or a client loss `divergence_factor` times
  round 1's): training stops there and `History.diverged_at_round` says when
  and why. Ctrl-C checkpoints the last completed chunk. The latest checkpoint
  unreadable (truncated, corrupt): `resume` falls back to the previous one.
* Proportional sampling. With `client_sampling="proportional"` (C draws
  with replacement, P(k) = n_k / n: Scheme I of Li et al., ICLR 2020,
  arXiv:1907.02189) the expectation of the *plain* mean of the drawn clients'
  updates is already the n_k-weighted full-participation mean
  Σ_k n_k Δ_k / Σ_k n_k; weighting the draws by n_k again would count n_k
  twice. So under this scheme the driver hands the algorithm uniform
  weights, `batches.weight` = 1 for every draw (0 for a client without train
  examples, which is never drawn), and every aggregator — the default
  `weighted_mean()` included — averages the draws uniformly, a client drawn
  twice counting twice (`proportional_weights`).
* Host-driven algorithms. An algorithm whose round cannot be one compiled
  program (FedMA: a Hungarian matching per layer on the host, hidden widths
  that grow) is an object with `init(params, key)` and `run(state, batches)
  -> state` (`fo.algorithms.fedma`, `is_host_driven`). It runs under the same
  driver: the rounds of a chunk are a Python loop, each drawing its batches
  with the same jitted `sample_round` and key as above, so sampling, seeds,
  evaluation, progress, history, checkpoints, resume (bit for bit), Ctrl-C
  and divergence behave as for a `FederatedAlgorithm`. Its checkpoints are
  restored in the shapes they were saved in (a grown model), not the
  template's. The memory check does not apply (nothing is compiled as one
  program); the metric functions must accept every width the model reaches.
* Sweeps: a `fedjax_opt.sweep.SweptAlgorithm` (K runs vmapped into one
  program) runs the same way. Its state, the round metrics and every
  evaluated value carry a leading sweep axis `[K]`; `seed` may then be K
  seeds, one data stream per member (K separate runs in one program), or one
  seed shared by all members.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt import evaluate as evaluate_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm
from fedjax_opt.core.validation import check_int
from fedjax_opt.data.dataset import FederatedDataset
from fedjax_opt.data.sampling import sample_round
from fedjax_opt.sweep import SweptAlgorithm

PyTree = Any


@dataclasses.dataclass
class History:
  """What happened during a run, as host arrays (JSON-serializable through `to_dict`).

  Attributes:
    round_metrics: `{name: [R, ...]}`, `state.metrics` after each round 1 … R
      (`[K, R, ...]` for a sweep of K members; a metric that is a vector
      keeps its own axes after the round axis).
    evals: one dict per evaluation: `{"round": r, "seconds": training time so far, metric: value, ...}`
      (for a sweep, each metric's value is a list of K floats).
    train_seconds: seconds spent running rounds (compilation excluded).
    compile_seconds: seconds spent compiling chunks and evaluation.
    sweep_size: K for a sweep (`fedjax_opt.sweep`), None for a single run.
    diverged_at_round: the round after which training stopped because the
      run diverged (see `train`'s `divergence_factor`), None if it did not.
    diverged_reason: one line saying why.
    initial_loss: the initial model's `test_loss` (a list for a sweep), the
      baseline of the divergence rule; None when not evaluated.
  """

  round_metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  train_seconds: float = 0.0
  compile_seconds: float = 0.0
  sweep_size: int | None = None
  diverged_at_round: int | None = None
  diverged_reason: str | None = None
  initial_loss: float | list[float] | None = None

  @property
  def num_rounds(self) -> int:
    return np.shape(next(iter(self.round_metrics.values())))[self._round_axis] if self.round_metrics else 0

  @property
  def _round_axis(self) -> int:
    return 0 if self.sweep_size is None else 1

  @property
  def rounds_per_second(self) -> float:
    return self.num_rounds / self.train_seconds if self.train_seconds > 0 else float("nan")

  def eval_series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(rounds [E], values [E] or [K, E] for a sweep) of an evaluated metric, e.g. `eval_series("test_accuracy")`."""
    points = [(e["round"], e[name]) for e in self.evals if name in e]
    if not points:
      raise KeyError(f"no evaluation recorded {name!r}; recorded: {sorted(self.last_eval)}.")
    r, v = zip(*points)
    values = np.asarray(v)
    return np.asarray(r), values.T if values.ndim == 2 else values

  @property
  def last_eval(self) -> dict[str, float]:
    return self.evals[-1] if self.evals else {}

  def append_rounds(self, metrics: Mapping[str, np.ndarray]) -> None:
    for name, values in metrics.items():
      values = np.asarray(values)
      old = self.round_metrics.get(name)
      self.round_metrics[name] = values if old is None else np.concatenate([old, values], axis=self._round_axis)

  def extended(self, metrics: Mapping[str, np.ndarray], point: dict[str, Any], seconds: float) -> "History":
    """A new History with one more chunk (its round metrics, its evaluation point, its training time)."""
    new = dataclasses.replace(self, round_metrics=dict(self.round_metrics), evals=[*self.evals, point],
                              train_seconds=self.train_seconds + seconds)
    new.append_rounds(metrics)
    return new

  def to_dict(self) -> dict:
    return {
        "round_metrics": {k: v.tolist() for k, v in self.round_metrics.items()},
        "evals": self.evals,
        "train_seconds": self.train_seconds,
        "compile_seconds": self.compile_seconds,
        "sweep_size": self.sweep_size,
        "diverged_at_round": self.diverged_at_round,
        "diverged_reason": self.diverged_reason,
        "initial_loss": self.initial_loss,
    }

  @classmethod
  def from_dict(cls, d: Mapping) -> "History":
    return cls(
        round_metrics={k: np.asarray(v) for k, v in d["round_metrics"].items()},
        evals=[dict(e) for e in d["evals"]],
        train_seconds=float(d["train_seconds"]),
        compile_seconds=float(d["compile_seconds"]),
        sweep_size=d.get("sweep_size"),
        diverged_at_round=d.get("diverged_at_round"),
        diverged_reason=d.get("diverged_reason"),
        initial_loss=d.get("initial_loss"),
    )

  def save_json(self, path: str) -> None:
    with open(path, "w") as f:
      json.dump(self.to_dict(), f)


# ---- checkpoints -----------------------------------------------------------------------------------------------


def current_round(state: PyTree) -> int:
  """`state.round` as an int (a sweep's members all share it: member 0's)."""
  return int(np.asarray(state.round).reshape(-1)[0])


def _is_typed_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_raw(state: PyTree) -> PyTree:
  """Typed PRNG keys -> their uint32 data (what a checkpoint can store)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, state)


def _placed_like(restored: Any, template: Any) -> Any:
  """A restored array placed as its template: uncommitted when the template is (a fresh `init`), so that the
  first chunk may place it (one device, or a mesh for a sharded client map); as restored otherwise."""
  if isinstance(restored, jax.Array) and isinstance(template, jax.Array) and not template.committed:
    return jax.device_put(np.asarray(restored))
  return restored


def _saved_like(restored: Any, template: PyTree) -> PyTree:
  """`template`'s structure with the arrays of `restored` (orbax's nested dicts), found by each leaf's path."""

  def find(path, _):
    node = restored
    for entry in path:
      name = getattr(entry, "name", getattr(entry, "key", getattr(entry, "idx", None)))
      node = node[name] if name in node or not isinstance(node, dict) else node[str(name)]
    return node

  return jax.tree_util.tree_map_with_path(find, template)


def is_host_driven(algorithm: Any) -> bool:
  """True for an algorithm `train` runs round by round on the host: `init` and `run(state, batches)`, no `step`."""
  return (not isinstance(algorithm, (FederatedAlgorithm, SweptAlgorithm)) and callable(getattr(algorithm, "init", None))
          and callable(getattr(algorithm, "run", None)))


def _from_raw(raw: PyTree, template: PyTree) -> PyTree:
  return jax.tree.map(
      lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_typed_key(t) else r, raw, template)


class CheckpointError(RuntimeError):
  """No checkpoint in the directory can be restored."""


class CheckpointWarning(UserWarning):
  """The latest checkpoint was unreadable; an older one was restored."""


class Checkpointer:
  """Saves and restores (state, history) with orbax, keeping the last `max_to_keep` checkpoints.

  Steps are round numbers. `restore` falls back to an older checkpoint when
  the latest cannot be read (a truncated or corrupt file: a warning, and the
  unreadable steps are deleted so that the run can save them again), and
  raises `CheckpointError` when none can. Used by `train`; usable on its own.
  """

  def __init__(self, directory: str, max_to_keep: int = 2, saved_shapes: bool = False):
    import orbax.checkpoint as ocp  # a dependency of the driver only, not of `import fedjax_opt`

    self._ocp = ocp
    self._saved_shapes = saved_shapes  # restore arrays in the shapes saved (a grown model), not the template's
    self.directory = os.path.abspath(directory)
    self._max_to_keep = max_to_keep
    self._manager = self._open()

  def _open(self):
    ocp = self._ocp
    return ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=self._max_to_keep, create=True))

  def latest_round(self) -> int | None:
    return self._manager.latest_step()

  def save(self, state: PyTree, history: History) -> None:
    ocp = self._ocp
    step = current_round(state)
    if step in self._manager.all_steps():
      return
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_to_raw(state)), history=ocp.args.JsonSave(history.to_dict())))
    self._manager.wait_until_finished()

  def _restore_step(self, step: int, template: PyTree) -> tuple[PyTree, History]:
    ocp = self._ocp
    if self._saved_shapes:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(), history=ocp.args.JsonRestore()))
      restored = dict(restored, state=_saved_like(restored["state"], _to_raw(template)))
    else:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_to_raw(template)), history=ocp.args.JsonRestore()))
    raw = jax.tree.map(_placed_like, restored["state"], _to_raw(template))
    state = _from_raw(raw, template)
    history = History.from_dict(restored["history"])
    if current_round(state) != step or history.num_rounds not in (0, step):
      raise ValueError(f"the checkpoint holds round {current_round(state)} and a history of {history.num_rounds} "
                       f"rounds, not round {step}")
    return state, history

  def restore(self, template: PyTree) -> tuple[PyTree, History] | None:
    """The latest readable (state, history), with `template`'s structure (e.g. `algorithm.init(...)`).

    None if the directory holds no checkpoint; `CheckpointError` if it holds
    some and none can be read.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    broken = []
    for step in steps:
      try:
        restored = self._restore_step(step, template)
      except Exception as e:  # pylint: disable=broad-except  (orbax raises many types for a damaged file)
        broken.append((step, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
        continue
      if broken:
        rounds = ", ".join(str(b) for b, _ in broken)
        warnings.warn(f"checkpoint of round(s) {rounds} in {self.directory} unreadable ({broken[0][1][:200]}); "
                      f"resuming from round {step}", CheckpointWarning, stacklevel=2)
        self._discard([b for b, _ in broken])
      return restored
    if broken:
      rounds = ", ".join(str(b) for b, _ in broken)
      raise CheckpointError(f"no valid checkpoint in {self.directory} (round(s) {rounds} unreadable: "
                            f"{broken[0][1][:200]})")
    return None

  def _discard(self, steps: list[int]) -> None:
    """Deletes unreadable steps (so later saves of those rounds succeed) and reopens the manager."""
    for step in steps:
      try:
        self._manager.delete(step)
      except Exception:  # pylint: disable=broad-except
        path = os.path.join(self.directory, str(step))
        if os.path.isdir(path):
          shutil.rmtree(path)
    self._manager.close()
    self._manager = self._open()


# ---- progress --------------------------------------------------------------------------------------------------


class _Progress:
  """A rich progress bar on a terminal, one line per chunk elsewhere (logs, CI, notebooks)."""

  def __init__(self, enabled: bool, total: int, start: int, label: str):
    self.enabled, self.total, self.label = enabled, total, label
    self._bar = None
    if enabled and sys.stdout.isatty():
      try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
      except ImportError:
        pass
      else:
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self._bar.start()
        self._task = self._bar.add_task(label, total=total, completed=start, info="")

  def update(self, round_: int, info: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.update(self._task, completed=round_, info=info)
    else:
      print(f"[{self.label}] round {round_}/{self.total} | {info}", flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()


def _format(metrics: Mapping[str, Any], rate: float) -> str:
  parts = [f"{rate:,.1f} rounds/s"]
  for key in ("train_loss", "test_loss", "test_accuracy", "central_accuracy", "personalized_test_accuracy"):
    if key in metrics:
      value = np.asarray(metrics[key], np.float64)
      if value.ndim:  # a sweep: mean ± std over members
        parts.append(f"{key} {np.mean(value):.4f} ± {np.std(value):.4f}")
      else:
        parts.append(f"{key} {float(value):.4f}")
  return " | ".join(parts)


def _host_value(value: Any) -> Any:
  """A float, or a list of K floats for a swept value."""
  value = np.asarray(value, np.float64)
  return value.tolist() if value.ndim else float(value)


# ---- the driver ------------------------------------------------------------------------------------------------


def proportional_weights(batches: ClientBatches) -> ClientBatches:
  """The weights `train` gives the algorithm under `client_sampling="proportional"`: 1 per draw (0 where n_k = 0).

  The draws already carry P(k) ∝ n_k, so their uniform mean is unbiased for Σ_k n_k Δ_k / Σ_k n_k (module
  docstring); n_k weights on top would count n_k twice.
  """
  weight = jnp.where(batches.weight > 0, jnp.ones_like(batches.weight), jnp.zeros_like(batches.weight))
  return batches.replace(weight=weight)


_COMPILED: dict[Any, Any] = {}
_COMPILED_MAX = 32


def _signature(tree: PyTree) -> tuple:
  """Hashable abstract signature: tree structure (static fields included), shapes, dtypes and shardings.

  The sharding is part of it because a program compiled ahead of time accepts only the placements it was
  compiled for: a state that comes back from a sharded round spread over a mesh gets its own program.
  """
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves)


def _compiled(key: Any, fn: Callable, args: tuple, history: "History", static_argnums=()) -> Any:
  """AOT-compiles `fn` for `args` once per process and key; compile time goes to the history."""
  if key not in _COMPILED:
    t0 = time.perf_counter()
    if len(_COMPILED) >= _COMPILED_MAX:
      _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = jax.jit(fn, static_argnums=static_argnums).lower(*args).compile()
    history.compile_seconds += time.perf_counter() - t0
  return _COMPILED[key]


def _default_eval_params(state: PyTree) -> PyTree:
  return state.params


def _no_table(state: PyTree) -> None:
  del state
  return None


PERSONALIZED_PERCENTILE = 10.0
"""The percentile over clients reported as `personalized_test_<name>_p10`."""


def _check_personalized(personalized_params: Any, personalize: Any, metric_fns: Any) -> None:
  for name, fn in (("personalized_params", personalized_params), ("personalize", personalize)):
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be callable; got {type(fn).__name__}.")
  if personalized_params is not None and personalize is not None:
    raise ValueError("give personalized_params (stored per-client models) or personalize (models adapted on "
                     "each client), not both.")
  if (personalized_params is not None or personalize is not None) and not metric_fns:
    raise ValueError("personalized metrics need metric_fns, e.g. {'accuracy': model.accuracy_fn}.")


def _personalized_summary(params, table, personalize, dataset, metric_fns, batch_size, client_map) -> dict:
  """`personalized_test_*` scalars of `evaluate.personalized` (table) or `evaluate.adapted` (personalize)."""
  kwargs = dict(split="test", batch_size=batch_size, client_map=client_map, percentile=PERSONALIZED_PERCENTILE)
  if personalize is not None:
    result = evaluate_lib.adapted(params, personalize, dataset, metric_fns, **kwargs)
  else:
    result = evaluate_lib.personalized(table, dataset, metric_fns, **kwargs)
  suffixes = ("", "_weighted", evaluate_lib.percentile_suffix(PERSONALIZED_PERCENTILE))
  out = {f"personalized_test_{name}{suffix}": result.summary[name + suffix]
         for name in metric_fns for suffix in suffixes}
  out["personalized_num_excluded"] = result.summary["num_excluded"]
  return out


def _check_args(algorithm, dataset, rounds, clients_per_round, eval_every, checkpoint_every):
  if not isinstance(algorithm, (FederatedAlgorithm, SweptAlgorithm)) and not is_host_driven(algorithm):
    raise TypeError(f"algorithm must be a fedjax_opt.FederatedAlgorithm (or a fedjax_opt.sweep.SweptAlgorithm, or "
                    f"a host-driven algorithm with init and run, like fo.algorithms.fedma); "
                    f"got {type(algorithm).__name__}.")
  if not isinstance(dataset, FederatedDataset):
    raise TypeError(f"dataset must be a fedjax_opt.data.FederatedDataset; got {type(dataset).__name__}.")
  for name, v in (("rounds", rounds), ("clients_per_round", clients_per_round), ("eval_every", eval_every),
                  ("checkpoint_every", checkpoint_every)):
    check_int(v, name)
  if clients_per_round > dataset.num_clients:
    raise ValueError(f"clients_per_round={clients_per_round} exceeds the dataset's {dataset.num_clients} clients.")


def _check_seed(seed: Any, algorithm: Any) -> int | tuple[int, ...]:
  """One int seed, or K int seeds for a sweep of K members."""
  if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
    return int(seed)
  seeds = tuple(seed) if isinstance(seed, (list, tuple, np.ndarray)) else None
  if seeds is None or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in seeds):
    raise TypeError(f"seed must be an int, or a sequence of K ints for a sweep; got {seed!r}.")
  if not isinstance(algorithm, SweptAlgorithm):
    raise ValueError("a sequence of seeds needs a sweep (fedjax_opt.sweep.SweptAlgorithm); got a single algorithm.")
  if len(seeds) != algorithm.size:
    raise ValueError(f"seed must hold one seed per sweep member: K={algorithm.size}; got {len(seeds)} seeds.")
  return tuple(int(s) for s in seeds)


class RoundTooLargeError(MemoryError):
  """A compiled chunk would need more memory than the device has (raised before it runs)."""


def _available_bytes() -> int | None:
  """Memory the default device can still give: the accelerator's limit, or the host's available RAM (None: unknown)."""
  device = jax.devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def compiled_bytes(compiled: Any) -> int | None:
  """New memory a compiled program allocates when it runs: temporaries and outputs (its inputs exist already)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend reports it)
    return None
  if stats is None:
    return None
  return int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes) - int(getattr(stats, "alias_size_in_bytes", 0))


def check_fits(compiled: Any, what: str, advice: str) -> None:
  """Raises `RoundTooLargeError` when `compiled` needs more memory than `_available_bytes()`."""
  need, have = compiled_bytes(compiled), _available_bytes()
  if need is None or have is None or need <= have:
    return
  raise RoundTooLargeError(f"{what} needs about {need / 2**30:.1f} GiB of memory but the device has "
                           f"{have / 2**30:.1f} GiB available; {advice}")


def divergence(history: History, params: PyTree, length: int, factor: float, swept: bool) -> str | None:
  """Why the run diverged in its last chunk of `length` rounds, or None (for a sweep: only if every member did).

  Diverged: the model holds NaN/Inf; the chunk's client losses are not
  finite; every client of every round of the chunk sent a non-finite update;
  or a loss (the chunk's mean client loss, the last `test_loss`) exceeds
  `factor` × the baseline, the initial model's test loss
  (`history.initial_loss`), else round 1's client loss.
  """
  metrics = {k: np.asarray(v) for k, v in history.round_metrics.items()}
  members = 1 if not swept else np.shape(next(iter(metrics.values())))[0]
  last = history.last_eval

  def member(values, i):
    values = np.asarray(values, np.float64) if not isinstance(values, np.ndarray) else values
    return values if not swept else values[i]

  reasons = []
  for i in range(members):
    leaves = [np.asarray(x if not swept else x[i]) for x in jax.tree.leaves(params)]
    loss = member(metrics["client_loss"], i).astype(np.float64) if "client_loss" in metrics else None
    if history.initial_loss is not None:
      baseline = float(member(history.initial_loss, i))
    else:
      baseline = float(loss[0]) if loss is not None and len(loss) else float("nan")
    test_loss = float(member(last["test_loss"], i)) if "test_loss" in last else None
    reason = None
    if not all(np.all(np.isfinite(x)) for x in leaves if np.issubdtype(x.dtype, np.inexact)):
      reason = "the model holds NaN or Inf"
    elif loss is not None and not np.all(np.isfinite(loss[-length:])):
      reason = "the clients' training loss is NaN or Inf"
    elif test_loss is not None and not np.isfinite(test_loss):
      reason = "the test loss is NaN or Inf"
    elif np.isfinite(baseline) and baseline > 0:
      for what, value in (("clients' training loss", None if loss is None else float(np.mean(loss[-length:]))),
                          ("test loss", test_loss)):
        if value is not None and value > factor * baseline:
          reason = f"the {what} grew to {value:.3g}, over {factor:g}× the initial {baseline:.3g}"
          break
    if reason is None and "round_accepted" in metrics and "num_nonfinite" in metrics:
      accepted = member(metrics["round_accepted"], i)[-length:]
      dropped = member(metrics["num_nonfinite"], i)[-length:]
      if not np.any(accepted) and np.all(dropped > 0):
        reason = "every client's update was NaN or Inf in every round of the last chunk"
    reasons.append(reason)
  if any(r is None for r in reasons):
    return None
  return reasons[0] if not swept else f"every member: {reasons[0]}"


def train(
    algorithm: FederatedAlgorithm | SweptAlgorithm,
    state: PyTree,
    dataset: FederatedDataset,
    rounds: int,
    *,
    clients_per_round: int,
    batch_size: int,
    local_steps: int | None = None,
    local_epochs: int | None = None,
    client_sampling: str = "uniform",
    sampling_probability: float | None = None,
    example_order: str = "shuffled",
    eval_every: int = 10,
    metric_fns: Mapping[str, evaluate_lib.MetricFn] | None = None,
    eval_params: Callable[[PyTree], PyTree] | None = None,
    personalized_params: Callable[[PyTree], PyTree] | None = None,
    personalize: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None,
    personalized_client_map: Any = None,
    holdout: FederatedDataset | None = None,
    eval_batch_size: int = 256,
    seed: int | Sequence[int] = 0,
    progress: bool = True,
    label: str = "train",
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 1,
    resume: bool | str = False,
    divergence_factor: float | None = 1e3,
    check_memory: bool = True,
) -> tuple[PyTree, History]:
  """Runs `algorithm` from `state` until `state.round == rounds` (or until it diverges).

  Args:
    algorithm: any `FederatedAlgorithm`, or a `fedjax_opt.sweep.SweptAlgorithm`
      (K runs in one program; state, metrics and evaluations gain a leading [K]),
      or a host-driven algorithm (`init`, `run`: FedMA; module docstring).
    state: its state, e.g. `algorithm.init(params, key)`; with `resume`, the
      template the checkpoint is restored into.
    dataset: a packed `FederatedDataset` (train split sampled, test split evaluated).
    rounds: the round to stop at (a total, so resuming does not add rounds).
    clients_per_round, batch_size, local_steps, local_epochs, client_sampling, sampling_probability,
      example_order: passed to `fedjax_opt.data.sample_round` each round
      (`client_sampling="poisson"`: each client with probability
      `sampling_probability`, in `clients_per_round` slots). Under
      `client_sampling="proportional"` the algorithm receives weight 1 per
      drawn client instead of n_k (`proportional_weights`, module docstring):
      the round's aggregate is the uniform mean over the draws, whose
      expectation is the n_k-weighted mean over all clients.
    eval_every: rounds per compiled chunk; evaluation and progress between chunks.
    metric_fns: `{name: fn(params, batch) -> [B]}` evaluated between chunks,
      e.g. `{"loss": model.loss_fn, "accuracy": model.accuracy_fn}`; recorded as
      `test_<name>` (clients' test splits, example-weighted),
      `test_<name>_client_mean`, `central_<name>` (the dataset's centralized
      test set, if any) and `holdout_<name>` (all examples of `holdout`).
    eval_params: `state -> params` to evaluate (default `state.params`); for
      algorithms whose served model is not `state.params`.
    personalized_params: `state -> [N, ...]` personalized models, row i for
      client i of `dataset`, e.g. `fo.personalized_params` (see the module
      docstring); adds the `personalized_test_*` metrics. Needs `metric_fns`.
    personalize: `(params, data [S, B, ...], mask [S, B]) -> params`, a model
      adapted on each client's train split from `eval_params(state)`, e.g.
      `algorithm.personalize`; the alternative to `personalized_params`
      (give at most one).
    personalized_client_map: how clients are mapped in the personalized
      evaluation (see `fedjax_opt.core.client_map`; default auto).
    holdout: clients that never train, evaluated on all their examples.
    eval_batch_size: example slots per evaluation step.
    seed: seeds the data sampling; round r uses `fold_in(key(seed), r)`. For a
      sweep, one seed shared by all members or K seeds, one per member.
    progress: print progress (a bar on a terminal, lines otherwise).
    label: the run's name in progress output.
    checkpoint_dir: where orbax checkpoints go (None: no checkpoints).
    checkpoint_every: chunks between checkpoints (and one at the end).
    resume: True to continue from the latest checkpoint in `checkpoint_dir`, or
      a directory to resume from (and keep checkpointing to). Starts from
      `state` when no checkpoint exists. An unreadable latest checkpoint falls
      back to the previous one (`CheckpointWarning`); none readable raises
      `CheckpointError`.
    divergence_factor: stop when the run diverges (module docstring): the
      served model or a chunk's mean client loss is not finite, every client
      of every round of a chunk sent a non-finite update, or a chunk's mean
      client loss exceeds `divergence_factor` × round 1's. The history then
      records `diverged_at_round` and `diverged_reason`, the state is
      checkpointed, and a resumed run does not train further. None: never stop.
    check_memory: before running the first chunk, estimate its memory from the
      compiled program and raise `RoundTooLargeError` if it exceeds what the
      device has.

  A KeyboardInterrupt (Ctrl-C) checkpoints the last completed chunk (when
  checkpointing) and is raised again.

  Returns:
    (final state, `History`).
  """
  _check_args(algorithm, dataset, rounds, clients_per_round, eval_every, checkpoint_every)
  _check_personalized(personalized_params, personalize, metric_fns)
  if metric_fns and not dataset.has_test_examples:
    raise ValueError("metric_fns are evaluated on the clients' test examples, and this dataset has none: load it "
                     "with test_fraction > 0, or pass metric_fns=None.")
  seed = _check_seed(seed, algorithm)
  swept = isinstance(algorithm, SweptAlgorithm)
  if isinstance(resume, str):
    checkpoint_dir = checkpoint_dir or resume
  host = is_host_driven(algorithm)
  checkpointer = Checkpointer(checkpoint_dir, saved_shapes=host) if checkpoint_dir else None
  history = History(sweep_size=algorithm.size if swept else None)
  if resume:
    if checkpointer is None:
      raise ValueError("resume=True needs checkpoint_dir (or pass resume=<directory>).")
    restored = checkpointer.restore(state)
    if restored is not None:
      state, history = restored
  eval_params = eval_params or _default_eval_params
  sample_kwargs = dict(clients_per_round=clients_per_round, local_steps=local_steps, batch_size=batch_size,
                       local_epochs=local_epochs, client_sampling=client_sampling, example_order=example_order,
                       sampling_probability=sampling_probability)
  per_member_data = isinstance(seed, tuple)
  reweight = proportional_weights if client_sampling == "proportional" else (lambda batches: batches)

  def sample(key, dataset):
    return reweight(sample_round(key, dataset, deferred=True, **sample_kwargs))

  def draw(s, dataset):
    if per_member_data:  # a sweep with one data stream per member
      keys = jnp.stack([jax.random.key(k) for k in seed])
      return jax.vmap(lambda k, r: sample(jax.random.fold_in(k, r), dataset))(keys, s.round)
    r = s.round[0] if swept else s.round
    return sample(jax.random.fold_in(jax.random.key(seed), r), dataset)

  def run_chunk(state, dataset, length):
    def body(s, _):
      s = algorithm.step(s, draw(s, dataset))
      return s, s.metrics

    state, metrics = per_client.scan_rounds(body, state, None, length=length)  # 16-bit tables in place
    if swept:  # [R, K, ...] -> [K, R, ...]: the sweep axis leads
      metrics = jax.tree.map(lambda m: jnp.moveaxis(m, 0, 1), metrics)
    return state, metrics

  def run_eval(params, table, dataset, holdout):
    out = {}
    if metric_fns:
      if personalized_params is not None or personalize is not None:
        out.update(_personalized_summary(params, table, personalize, dataset, metric_fns, eval_batch_size,
                                         personalized_client_map))
      out.update({f"test_{k}": v for k, v in evaluate_lib.global_model(
          params, dataset, metric_fns, split="test", batch_size=eval_batch_size).items()})
      if dataset.central_test is not None:
        out.update({f"central_{k}": v for k, v in evaluate_lib.centralized(
            params, dataset.central_test, metric_fns).items()})
      if holdout is not None:
        out.update({f"holdout_{k}": v for k, v in evaluate_lib.global_model(
            params, holdout, metric_fns, split="train", batch_size=eval_batch_size).items()})
    return out

  if swept:
    single_eval = run_eval
    run_eval = lambda params, table, dataset, holdout: jax.vmap(single_eval, in_axes=(0, 0, None, None))(
        params, table, dataset, holdout)

  def run_host_chunk(state, dataset, length):
    """The rounds of a chunk of a host-driven algorithm: a Python loop, the batches drawn by the jitted sampler."""
    sampler = _compiled(("sample", tuple(sorted(sample_kwargs.items())), seed, _signature((state.round, dataset))),
                        lambda r, d: sample(jax.random.fold_in(jax.random.key(seed), r), d), (state.round, dataset),
                        history)
    rows = []
    for _ in range(length):
      state = algorithm.run(state, sampler(state.round, dataset))
      rows.append(jax.device_get(state.metrics))
    return state, {k: np.stack([np.asarray(row[k]) for row in rows]) for k in rows[0]}

  run_key = ((algorithm.init, getattr(algorithm, "step", None) or algorithm.run), tuple(sorted(sample_kwargs.items())),
             seed)
  eval_key = (tuple(sorted((metric_fns or {}).items())), eval_params, eval_batch_size, swept, personalized_params,
              personalize, personalized_client_map)
  table_fn = personalized_params or _no_table
  start_round = current_round(state)
  bar = _Progress(progress, rounds, start_round, label)
  chunks_done = 0
  committed = (state, history)  # (state, history) of the last completed chunk: replaced in one assignment
  checked_memory = not check_memory
  try:
    if (divergence_factor is not None and metric_fns and "loss" in metric_fns and history.initial_loss is None
        and current_round(state) == 0 and rounds > 0):
      params_fn = (lambda s: (eval_params(s), table_fn(s)))
      params, table = params_fn(state) if not swept else jax.vmap(params_fn)(state)
      args = (params, table, dataset, holdout)
      evaluator = _compiled(("eval", eval_key, _signature(args)), run_eval, args, history)
      history.initial_loss = _host_value(evaluator(*args)["test_loss"])
      committed = (state, history)
    while current_round(state) < rounds and history.diverged_at_round is None:
      current = current_round(state)
      length = min(rounds, (current // eval_every + 1) * eval_every) - current
      if host:
        chunk = lambda state, dataset, length=length: run_host_chunk(state, dataset, length)  # noqa: E731
        checked_memory = True
      else:
        chunk = _compiled(("chunk", run_key, length, _signature((state, dataset))), run_chunk,
                          (state, dataset, length), history, static_argnums=2)
      if not checked_memory:
        check_fits(chunk, f"a chunk of {length} round(s) ({clients_per_round} clients × "
                          f"{local_steps or local_epochs} {'steps' if local_steps else 'epochs'} × batch {batch_size})",
                   "lower batch_size, local_steps or clients_per_round")
        checked_memory = True
      t0 = time.perf_counter()
      new_state, metrics = chunk(state, dataset)
      metrics = jax.device_get(metrics)
      elapsed = time.perf_counter() - t0
      point = {"round": current_round(new_state), "seconds": history.train_seconds + elapsed,
               "train_loss": (_host_value(np.mean(metrics["client_loss"], axis=-1)) if "client_loss" in metrics
                              else float("nan"))}
      if metric_fns:
        params_fn = (lambda s: (eval_params(s), table_fn(s)))
        params, table = params_fn(new_state) if not swept else jax.vmap(params_fn)(new_state)
        args = (params, table, dataset, holdout)
        evaluator = _compiled(("eval", eval_key, _signature(args)), run_eval, args, history)
        point.update({k: _host_value(v) for k, v in evaluator(*args).items()})
      new_history = history.extended(metrics, point, elapsed)
      if divergence_factor is not None:
        reason = divergence(new_history, eval_params(new_state) if not swept else jax.vmap(eval_params)(new_state),
                            length, divergence_factor, swept)
        if reason is not None:
          new_history.diverged_at_round, new_history.diverged_reason = current_round(new_state), reason
      committed = (new_state, new_history)
      state, history = committed
      bar.update(current_round(state), _format(point, length / max(elapsed, 1e-9)))
      chunks_done += 1
      if checkpointer is not None and (chunks_done % checkpoint_every == 0 or current_round(state) >= rounds
                                       or history.diverged_at_round is not None):
        checkpointer.save(state, history)
  except KeyboardInterrupt:
    state, history = committed
    if checkpointer is not None and current_round(state) > start_round:
      checkpointer.save(state, history)
    raise
  finally:
    bar.close()
  return state, history
