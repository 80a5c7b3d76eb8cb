"""The training driver: rounds as compiled chunks, with evaluation, progress, history and checkpoints between them.

`train(algorithm, state, dataset, rounds, sampling, ...)` runs any `FederatedAlgorithm`:

* Rounds run in chunks of `evaluation.every`: one jitted `lax.scan` per
  chunk, whose body draws the round's clients and batches with
  `fedjax_opt.data.sample_round` and applies `algorithm.step`. Nothing
  returns to Python inside a chunk. The batches are drawn `deferred`: a
  round whose clients run in a loop gathers each chunk's examples from the
  packed dataset inside the loop, so its memory does not grow with the
  clients per round (`core.rounds`). Chunks end on multiples of
  `evaluation.every` (counted from round 0), so a resumed run executes
  exactly the same chunks as an uninterrupted one.
* The data of round r are drawn with the key `fold_in(key(seed), r)`, and the
  algorithm's own randomness lives in `state.key`, so a run is a deterministic
  function of (state, dataset, seed) whatever the chunking: resuming from a
  checkpoint gives the bit-for-bit final state of an uninterrupted run.
* Compilation. Each program (a chunk of a given length, the evaluation, the
  host-driven sampler) is a `jax.jit` function whose static arguments are
  the algorithm's `step`, the `Sampling`, the seed and the chunk length, so
  JAX's own caches (and its persistent compilation cache, when configured)
  reuse it across `train` calls. It is compiled ahead of time once per
  distinct argument signature within a call (`lower(...).compile()`), which
  is when its memory is checked and its compile time goes to
  `History.compile_seconds`.
* Between chunks: evaluation (`fedjax_opt.train.evaluation`: the served
  model on every split, and each client's own model for personalized
  algorithms), a progress line or bar (`progress`), the `History`, and,
  every `checkpointing.every` chunks and at the end, an orbax checkpoint of
  the state and the history (`checkpoint`).
* Safety (`safety`): the first chunk's memory is checked before it runs
  (`RoundTooLargeError`); after each chunk the run is checked for divergence
  and stops there (`History.diverged_at_round`, and a `DivergenceWarning`
  with the round and the cause; a resumed run that had diverged warns too).
  A batch size above every client's train examples warns once
  (`BatchSizeWarning`). Ctrl-C checkpoints the last completed chunk.
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
* Privacy accounting (`accounting`): a state that holds a
  `fo.privacy.dp_mean` needs `accounting=fo.Accounting(delta=δ, ...)`; the
  sampling it declares must be the run's own draw (refused otherwise, before
  anything is compiled), and every evaluation point records `dp_epsilon`, the
  ε(δ) of the clients the run drew, computed on the host at the end of the run.
  The accounting is part of the history (`History.privacy["segments"]`: the
  draw and σ of every stretch of rounds), checkpointed with it and carried by
  it: a resumed or continued run composes its rounds on top of the earlier
  ones, whose ε never change (docs/privacy.md, "The run and its accounting").
* Host-driven algorithms (`is_host_driven`: `init` and `run`, FedMA) run
  under the same driver, their rounds a Python loop
  (`fedjax_opt.algorithms.matched_averaging.host_loop`, which says what differs).
* Sweeps: a `fedjax_opt.sweep.SweptAlgorithm` (K runs vmapped into one
  program) runs the same way. Its state, the round metrics and every
  evaluated value carry a leading sweep axis `[K]`; `seed` may then be K
  seeds, one data stream per member (K separate runs in one program), or one
  seed shared by all members.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import per_client
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, StagedState, materialize
from fedjax_opt.core.validation import check_int
from fedjax_opt.data.dataset import FederatedDataset
from fedjax_opt.data.sampling import sample_round
from fedjax_opt.sweep import SweptAlgorithm
from fedjax_opt.train import accounting as accounting_lib
from fedjax_opt.train.checkpoint import Checkpointer, current_round
from fedjax_opt.train.config import Accounting, Checkpointing, Evaluation, Sampling
from fedjax_opt.train.evaluation import EvalProgram, evaluate
from fedjax_opt.train.history import History
from fedjax_opt.train.progress import Progress, format_point, host_value
from fedjax_opt.train.safety import BatchSizeWarning, DivergenceWarning, check_fits, divergence, padded_batch

__all__ = ["is_host_driven", "proportional_weights", "train"]

PyTree = Any
Seed = int | tuple[int, ...]


def is_host_driven(algorithm: Any) -> bool:
  """True for an algorithm `train` runs round by round on the host: `init` and `run(state, batches)`, no `step`."""
  return (not isinstance(algorithm, (FederatedAlgorithm, SweptAlgorithm)) and callable(getattr(algorithm, "init", None))
          and callable(getattr(algorithm, "run", None)))


def proportional_weights(batches: ClientBatches) -> ClientBatches:
  """The weights `train` gives the algorithm under `client_sampling="proportional"`: 1 per draw (0 where n_k = 0).

  The draws already carry P(k) ∝ n_k, so their uniform mean is unbiased for Σ_k n_k Δ_k / Σ_k n_k (module
  docstring); n_k weights on top would count n_k twice.
  """
  weight = jnp.where(batches.weight > 0, jnp.ones_like(batches.weight), jnp.zeros_like(batches.weight))
  return batches.replace(weight=weight)


# ---- the compiled programs -------------------------------------------------------------------------------------


def _sample(key: jax.Array, dataset: FederatedDataset, sampling: Sampling) -> ClientBatches:
  batches = sample_round(key, dataset, deferred=True, **sampling.kwargs())
  return proportional_weights(batches) if sampling.client_sampling == "proportional" else batches


def _draw(state: PyTree, dataset: FederatedDataset, sampling: Sampling, seed: Seed, swept: bool) -> ClientBatches:
  """The batches of round `state.round`, drawn with `fold_in(key(seed), round)`."""
  if isinstance(seed, tuple):  # a sweep with one data stream per member
    keys = jnp.stack([jax.random.key(k) for k in seed])
    # Each member's data gathered inside the vmap: a deferred member would carry the whole store along the new axis.
    def member(k, r):
      batches = _sample(jax.random.fold_in(k, r), dataset, sampling)
      return batches.replace(data=materialize(batches.data))

    return jax.vmap(member)(keys, state.round)
  r = state.round[0] if swept else state.round
  return _sample(jax.random.fold_in(jax.random.key(seed), r), dataset, sampling)


@functools.partial(jax.jit, static_argnames=("step", "swept", "sampling", "seed", "length"))
def _run_chunk(state: PyTree, dataset: FederatedDataset, *, step: Callable, swept: bool, sampling: Sampling,
               seed: Seed, length: int) -> tuple[PyTree, PyTree]:
  """`length` rounds of `step` as one scan; returns (state, metrics `[R, ...]`, or `[K, R, ...]` for a sweep)."""

  def body(s, _):
    s = step(s, _draw(s, dataset, sampling, seed, swept))
    return s, s.metrics

  state, metrics = per_client.scan_rounds(body, state, None, length=length)  # 16-bit tables in place
  if swept:  # [R, K, ...] -> [K, R, ...]: the sweep axis leads
    metrics = jax.tree.map(lambda m: jnp.moveaxis(m, 0, 1), metrics)
  return state, metrics


@functools.partial(jax.jit, static_argnames=("sampling", "seed"))
def _sample_for_round(r: jax.Array, dataset: FederatedDataset, *, sampling: Sampling, seed: int) -> ClientBatches:
  """The batches of round `r` for a host-driven algorithm (the same keys as a compiled chunk's)."""
  return _sample(jax.random.fold_in(jax.random.key(seed), r), dataset, sampling)


def _signature(tree: PyTree) -> tuple:
  """Hashable abstract signature: tree structure (static fields included), shapes, dtypes and shardings.

  The sharding is part of it because a program compiled ahead of time accepts only the placements it was
  compiled for: a state that comes back from a sharded round spread over a mesh gets its own program.
  """
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "sharding", None)) for x in leaves)


class _Programs:
  """The programs one `train` call runs, each compiled ahead of time once per argument signature.

  Arguments that differ from a compiled program's only in where they are placed (a state that comes back from
  a round sharded over the devices, replicated on a mesh, where the first chunk's state sat on one device) are
  moved to the placements the program was compiled for, not compiled for again: a run compiles its chunk once.
  The compile time goes to `history.compile_seconds` (JAX's caches make a program compiled by an earlier call
  cost almost nothing here).
  """

  def __init__(self):
    self._compiled: dict[Any, Any] = {}

  def get(self, jitted: Any, args: tuple, history: History, **static: Any) -> Any:
    program = (jitted, tuple(sorted(static.items())))
    signature = _signature(args)
    if (program, signature) in self._compiled:
      return self._compiled[(program, signature)]
    for (other, other_signature), compiled in self._compiled.items():
      if other == program and _same_but_placement(signature, other_signature):
        return functools.partial(_placed, compiled)
    t0 = time.perf_counter()
    self._compiled[(program, signature)] = jitted.lower(*args, **static).compile()
    history.compile_seconds += time.perf_counter() - t0
    return self._compiled[(program, signature)]


def _same_but_placement(a: tuple, b: tuple) -> bool:
  """Two `_signature`s with the same tree, shapes and dtypes."""
  return a[0] == b[0] and [leaf[:2] for leaf in a[1]] == [leaf[:2] for leaf in b[1]]


def _placed(compiled: Any, *args: Any) -> Any:
  """`compiled(*args)`, the arguments first moved to the placements `compiled` takes."""
  return compiled(*jax.device_put(args, compiled.input_shardings[0]))


# ---- checks ----------------------------------------------------------------------------------------------------


def _check_args(algorithm: Any, dataset: Any, rounds: Any, sampling: Any, evaluation: Any, checkpointing: Any):
  if not isinstance(algorithm, (FederatedAlgorithm, SweptAlgorithm)) and not is_host_driven(algorithm):
    raise TypeError(f"algorithm must be a fedjax_opt.FederatedAlgorithm (or a fedjax_opt.sweep.SweptAlgorithm, or "
                    f"a host-driven algorithm with init and run, like fo.algorithms.fedma); "
                    f"got {type(algorithm).__name__}.")
  if not isinstance(dataset, FederatedDataset):
    raise TypeError(f"dataset must be a fedjax_opt.data.FederatedDataset; got {type(dataset).__name__}.")
  check_int(rounds, "rounds")
  for name, value, cls in (("sampling", sampling, Sampling), ("evaluation", evaluation, Evaluation),
                           ("checkpointing", checkpointing, Checkpointing)):
    if not isinstance(value, cls) and not (name == "checkpointing" and value is None):
      raise TypeError(f"{name} must be a fedjax_opt.{cls.__name__}(...); got {type(value).__name__}.")
  if sampling.clients_per_round > dataset.num_clients:
    raise ValueError(f"clients_per_round={sampling.clients_per_round} exceeds the dataset's {dataset.num_clients} "
                     f"clients.")
  if evaluation.metric_fns and not dataset.has_test_examples:
    raise ValueError("metric_fns are evaluated on the clients' test examples, and this dataset has none: load it "
                     "with test_fraction > 0, or pass metric_fns=None.")


def _check_client_tables(state: PyTree, dataset: FederatedDataset, swept: bool) -> None:
  """Refuses a client stage's per-client table (error feedback's residuals, `StagedState.rows`) with fewer rows
  than the dataset has clients: the clients past its end would be dropped from every round they are drawn in (and
  only counted in `num_nonfinite`)."""
  is_staged = lambda x: isinstance(x, StagedState)
  for staged in (x for x in jax.tree.leaves(state, is_leaf=is_staged) if is_staged(x)):
    for table in staged.rows:
      leaves = jax.tree.leaves(table)
      if not leaves:
        continue
      shape = jnp.shape(leaves[0])
      rows = shape[1 if swept else 0] if len(shape) > (1 if swept else 0) else None
      if rows is not None and rows < dataset.num_clients:
        n = dataset.num_clients
        dropped = f"client {rows}" if rows == n - 1 else f"clients {rows}–{n - 1}"
        raise ValueError(f"train: the aggregator's client stage keeps a table of {rows} rows (one per client, e.g. "
                         f"compress(..., error_feedback=True, num_clients={rows})) but the dataset has {n} clients: "
                         f"{dropped} would be dropped from every round they are drawn in; build it with "
                         f"num_clients={n}.")


def _check_history(history: Any, state: PyTree, swept_size: int | None) -> History:
  """A copy of the `history=` a continued run extends (the run mutates its own), or one line saying why not."""
  if not isinstance(history, History):
    raise TypeError(f"history must be None or the fedjax_opt.History of the run the state comes from; "
                    f"got {type(history).__name__}.")
  if history.sweep_size != swept_size:
    kind = lambda k: f"a sweep of {k} members" if k else "a single run"
    raise ValueError(f"train: history= is the history of {kind(history.sweep_size)}, and this run is "
                     f"{kind(swept_size)}.")
  start = current_round(state)
  last_eval = max((int(e["round"]) for e in history.evals), default=0)
  if history.num_rounds not in (0, start) or last_eval > start:
    raise ValueError(f"train: history= records {max(history.num_rounds, last_eval)} rounds, but the state is at round "
                     f"{start}: give the History that came with this state.")
  return dataclasses.replace(history, round_metrics=dict(history.round_metrics), evals=list(history.evals))


def _check_seed(seed: Any, algorithm: Any) -> Seed:
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


def _default_eval_params(state: PyTree) -> PyTree:
  return state.params


def _no_table(state: PyTree) -> None:
  del state
  return None


# ---- the driver ------------------------------------------------------------------------------------------------


def train(
    algorithm: FederatedAlgorithm | SweptAlgorithm,
    state: PyTree,
    dataset: FederatedDataset,
    rounds: int,
    sampling: Sampling,
    *,
    evaluation: Evaluation = Evaluation(),
    checkpointing: Checkpointing | None = None,
    seed: int | Sequence[int] = 0,
    progress: bool = True,
    label: str = "train",
    divergence_factor: float | None = 1e3,
    check_memory: bool = True,
    accounting: Accounting | None = None,
    history: History | None = None,
) -> tuple[PyTree, History]:
  """Runs `algorithm` from `state` until `state.round == rounds` (or until it diverges).

  Args:
    algorithm: any `FederatedAlgorithm`, or a `fedjax_opt.sweep.SweptAlgorithm`
      (K runs in one program; state, metrics and evaluations gain a leading [K]),
      or a host-driven algorithm (`init`, `run`: FedMA;
      `fedjax_opt.algorithms.matched_averaging.host_loop`).
    state: its state, e.g. `algorithm.init(params, key)`; with
      `checkpointing.resume`, the template the checkpoint is restored into.
    dataset: a packed `FederatedDataset` (train split sampled, test split evaluated).
    rounds: the round to stop at (a total, so resuming does not add rounds).
    sampling: how each round's clients and batches are drawn (`Sampling`:
      the keywords of `fedjax_opt.data.sample_round`). Under
      `client_sampling="proportional"` the algorithm receives weight 1 per
      drawn client instead of n_k (`proportional_weights`, module docstring):
      the round's aggregate is the uniform mean over the draws, whose
      expectation is the n_k-weighted mean over all clients.
    evaluation: rounds per compiled chunk and what is evaluated between
      chunks (`Evaluation`; default: chunks of 10 rounds, no metrics).
    checkpointing: where and how often to checkpoint, and whether to resume
      (`Checkpointing`; None: no checkpoints).
    seed: seeds the data sampling; round r uses `fold_in(key(seed), r)`. For a
      sweep, one seed shared by all members or K seeds, one per member.
    progress: print progress (a bar on a terminal, lines otherwise).
    label: the run's name in progress output.
    divergence_factor: stop when the run diverges (`fedjax_opt.train.safety`): the
      served model or a chunk's mean client loss is not finite, every client
      of every round of a chunk sent a non-finite update, or a chunk's mean
      client loss exceeds `divergence_factor` × the initial loss. The history then
      records `diverged_at_round` and `diverged_reason`, the state is
      checkpointed, and a resumed run does not train further. None: never stop.
    check_memory: before running the first chunk, estimate its memory from the
      compiled program and raise `RoundTooLargeError` if it exceeds what the
      device has.
    accounting: required when the state holds a `fo.privacy.dp_mean`
      aggregator (and refused otherwise): σ and δ (`Accounting`), and
      optionally the `fo.privacy.Sampling` they were planned for, which must
      be the run's own draw (`fo.privacy.SamplingMismatchError` otherwise).
      Every evaluation point then records `dp_epsilon`, the ε(δ) of the
      clients this run draws after that round, and `History.privacy` what
      was accounted (`fedjax_opt.train.accounting`). A run resumed from its
      checkpoint, or continued with `history=`, accounts its rounds on top of
      the earlier ones (recorded in the history: `privacy["segments"]`), also
      when σ or the draw changed; the earlier points' ε are kept. A draw that
      cannot be composed with the earlier one (fixed-size after Poisson or the
      converse) is refused, and so is a state at round > 0 holding a
      `dp_mean` with no history of its rounds' accounting.
    history: the `History` of the run `state` comes from (the one returned
      with it by an earlier `train` call), to continue that run without a
      checkpoint: its rounds, evaluation points and privacy accounting are
      carried on. It must record `state`'s rounds; a state at round > 0 that
      holds a `dp_mean` needs it (or a checkpoint to resume from). Not with
      a checkpoint that `checkpointing.resume` restores (that holds its own).

  A `sampling.batch_size` above every client's train examples warns once
  (`BatchSizeWarning`, before the first chunk runs): every step would be
  padded to it for nothing.

  A KeyboardInterrupt (Ctrl-C) checkpoints the last completed chunk (when
  checkpointing) and is raised again.

  A client stage's per-client table (error feedback's residuals) with fewer
  rows than `dataset.num_clients` is refused: the clients past its end would
  be dropped from every round.

  Returns:
    (final state, `History`).
  """
  _check_args(algorithm, dataset, rounds, sampling, evaluation, checkpointing)
  seed = _check_seed(seed, algorithm)
  swept = isinstance(algorithm, SweptAlgorithm)
  size = algorithm.size if swept else None
  given_history = history
  if given_history is not None:
    history = _check_history(given_history, state, size)
  if current_round(state) == 0:  # what a fresh template alone refuses, refused before a checkpoint directory is
    accounting_lib.plan(accounting, state, sampling, dataset.num_clients, size)  # made; the plan is built below
  host = is_host_driven(algorithm)
  checkpointing = checkpointing or Checkpointing()
  checkpointer = (Checkpointer(checkpointing.directory, saved_shapes=host)
                  if checkpointing.directory is not None else None)
  if history is None:
    history = History(sweep_size=size)
  resumed = False
  if checkpointing.resume:
    restored = checkpointer.restore(state)
    if restored is not None:
      resumed = True
      if given_history is not None:
        raise ValueError(f"train: history= continues the given state, but resume=True restored round "
                         f"{current_round(restored[0])} from {checkpointer.directory}, with its own history: give "
                         f"one of them.")
      state, history = accounting_lib.with_aggregator_constants(restored[0], state), restored[1]
  if (not resumed and not is_host_driven(algorithm) and current_round(state) > 0
      and accounting_lib.holds_dp_mean(state)):  # continued: the σ and m of this call's dp_mean, not the state's
    state = accounting_lib.with_algorithm_constants(state, algorithm, swept)
  _check_client_tables(state, dataset, swept)
  privacy = accounting_lib.plan(accounting, state, sampling, dataset.num_clients, size,
                                history=history if resumed or given_history is not None else None,
                                start=current_round(state), until=rounds, restored=resumed)
  eval_params = evaluation.eval_params or _default_eval_params
  table_fn = evaluation.personalized_params or _no_table
  metric_fns = evaluation.metric_fns
  evaluates = bool(metric_fns) or evaluation.objective is not None
  eval_program = EvalProgram.of(evaluation, swept)
  programs = _Programs()

  def evaluated(s: PyTree, history: History) -> dict:
    params_fn = (lambda s: (eval_params(s), table_fn(s)))
    params, table = params_fn(s) if not swept else jax.vmap(params_fn)(s)
    args = (params, table, dataset, evaluation.holdout)
    return programs.get(evaluate, args, history, program=eval_program)(*args)

  def chunk_for(state: PyTree, length: int, history: History) -> Callable:
    if host:
      from fedjax_opt.algorithms.matched_averaging import host_loop  # pylint: disable=import-outside-toplevel

      sample = programs.get(_sample_for_round, (state.round, dataset), history, sampling=sampling, seed=seed)
      return lambda state, dataset: host_loop.run_chunk(algorithm, state, dataset, length, sample)
    return programs.get(_run_chunk, (state, dataset), history, step=algorithm.step, swept=swept, sampling=sampling,
                        seed=seed, length=length)

  start_round = current_round(state)
  if history.diverged_at_round is not None:
    warnings.warn(f"{label}: the restored run diverged at round {history.diverged_at_round} "
                  f"({history.diverged_reason}); it is not trained further", DivergenceWarning, stacklevel=2)
  padding = padded_batch(sampling.batch_size, dataset.max_train)
  bar = Progress(progress, rounds, start_round, label)
  if start_round > 0:
    source = f"checkpoint in {checkpointing.directory}" if resumed else "the state given"
    bar.note(f"resuming from round {start_round} of {rounds} ({source})"
             if start_round < rounds else f"restored at round {start_round}: no round left to train")
  if start_round < rounds and history.diverged_at_round is None:  # compiled (or loaded from the cache) first
    first = min(rounds, (start_round // evaluation.every + 1) * evaluation.every)
    bar.note(f"compiling round{'s' if first - start_round > 1 else ''} {start_round + 1}"
             + (f"–{first}" if first - start_round > 1 else "") + (" and the evaluation" if evaluates else "")
             + ("; then a progress line as they end" if first >= rounds else
                f"; then a progress line every {evaluation.every} round{'s' if evaluation.every > 1 else ''}"))
  chunks_done = 0
  committed = (state, history)  # (state, history) of the last completed chunk: replaced in one assignment
  checked_memory = not check_memory or host  # nothing of a host-driven algorithm is compiled as one program
  try:
    if (divergence_factor is not None and metric_fns and "loss" in metric_fns and history.initial_loss is None
        and current_round(state) == 0 and rounds > 0):
      history.initial_loss = host_value(evaluated(state, history)["test_loss"])
      committed = (state, history)
    while current_round(state) < rounds and history.diverged_at_round is None:
      current = current_round(state)
      length = min(rounds, (current // evaluation.every + 1) * evaluation.every) - current
      chunk = chunk_for(state, length, history)
      if not checked_memory:
        steps = sampling.local_steps or sampling.local_epochs
        check_fits(chunk, f"a chunk of {length} round(s) ({sampling.clients_per_round} clients × {steps} "
                          f"{'steps' if sampling.local_steps else 'epochs'} × batch {sampling.batch_size})",
                   "lower batch_size, local_steps or clients_per_round")
        checked_memory = True
      if padding is not None:
        warnings.warn(padding, BatchSizeWarning, stacklevel=2)
        padding = None
      t0 = time.perf_counter()
      new_state, metrics = chunk(state, dataset)
      metrics = jax.device_get(metrics)
      elapsed = time.perf_counter() - t0
      point = {"round": current_round(new_state), "seconds": history.train_seconds + elapsed}
      if "client_loss" in metrics:  # absent for algorithms that report no train loss (L2GD, the ADMM family, ...)
        point["train_loss"] = host_value(np.mean(metrics["client_loss"], axis=-1))
      if evaluates:
        point.update({k: host_value(v) for k, v in evaluated(new_state, history).items()})
      new_history = history.extended(metrics, point, elapsed)
      if divergence_factor is not None:
        reason = divergence(new_history, eval_params(new_state) if not swept else jax.vmap(eval_params)(new_state),
                            length, divergence_factor, swept)
        if reason is not None:
          new_history.diverged_at_round, new_history.diverged_reason = current_round(new_state), reason
      finished = current_round(new_state) >= rounds or new_history.diverged_at_round is not None
      if privacy is not None:  # every history kept says how its rounds are accounted; ε is computed at the end
        new_history = (privacy.recorded(new_history, current_round(new_state)) if finished
                       else privacy.noted(new_history, current_round(new_state)))
      committed = (new_state, new_history)
      state, history = committed
      bar.update(current_round(state), format_point(point, length / max(elapsed, 1e-9)))
      chunks_done += 1
      if checkpointer is not None and (chunks_done % checkpointing.every == 0 or finished):
        checkpointer.save(state, history)
  except KeyboardInterrupt:
    state, history = committed
    if checkpointer is not None and current_round(state) > start_round:
      checkpointer.save(state, history)
    raise
  finally:
    bar.close()
  if history.diverged_at_round is not None and history.diverged_at_round > start_round:  # it diverged in this call
    warnings.warn(f"{label} diverged at round {history.diverged_at_round}: {history.diverged_reason}; training "
                  f"stopped there (History.diverged_at_round)", DivergenceWarning, stacklevel=2)
  if privacy is not None:  # a resumed run with no round left to train: its restored points
    history = privacy.recorded(history, current_round(state))
  return state, history
