"""What `train` is told, in small frozen records: how rounds are sampled, evaluated, checkpointed and accounted.

    sampling = fo.Sampling(clients_per_round=10, batch_size=20, local_steps=5)
    evaluation = fo.Evaluation(every=10, metric_fns={"loss": model.loss_fn, "accuracy": model.accuracy_fn})
    state, history = fo.train(algo, state, dataset, 300, sampling, evaluation=evaluation,
                              checkpointing=fo.Checkpointing("ckpt", resume=True))

Each record checks its own fields when it is made; what needs the dataset
(`clients_per_round` against the dataset's clients, test examples for
`metric_fns`) or the state (`Accounting` against a `dp_mean` aggregator) is
checked by `train`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from fedjax_opt.core.validation import check_int
from fedjax_opt.privacy import accounting as accounting_lib

__all__ = ["Accounting", "Checkpointing", "Evaluation", "Sampling"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each round's clients and mini-batches are drawn: the keywords of `fedjax_opt.data.sample_round`.

  Not to be confused with `fo.privacy.Sampling`, the accountant's description
  of the client draw; its `train_kwargs()` are keywords of this record.

  Attributes:
    clients_per_round: C, the clients drawn per round (the round's slots
      under `client_sampling="poisson"`).
    batch_size: B, examples per local step.
    local_steps: S, local steps per client (give this or `local_epochs`).
    local_epochs: passes over each client's train split instead of `local_steps`.
    client_sampling: "uniform" (C distinct clients), "all", "poisson" (each
      client with probability `sampling_probability`, in C slots) or
      "proportional" (C draws with replacement, P(k) = n_k / n; `train` then
      gives each draw weight 1: `proportional_weights`).
    sampling_probability: q, for `client_sampling="poisson"`.
    example_order: "shuffled" or "fixed" (each client's examples in stored order).
  """

  clients_per_round: int
  batch_size: int
  local_steps: int | None = None
  local_epochs: int | None = None
  client_sampling: str = "uniform"
  sampling_probability: float | None = None
  example_order: str = "shuffled"

  def __post_init__(self):
    check_int(self.clients_per_round, "clients_per_round")

  def kwargs(self) -> dict[str, Any]:
    """The keywords of `fedjax_opt.data.sample_round` that draw rounds this way."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """What `train` evaluates between chunks of rounds, and how often.

  Attributes:
    every: rounds per compiled chunk; evaluation and progress between chunks
      (chunks end on multiples of `every`, counted from round 0).
    metric_fns: `{name: fn(params, batch) -> [B]}`, e.g. `{"loss":
      model.loss_fn, "accuracy": model.accuracy_fn}`; recorded as
      `test_<name>` (clients' test splits, example-weighted),
      `test_<name>_client_mean`, `central_<name>` (the dataset's centralized
      test set, if any) and `holdout_<name>` (all examples of `holdout`).
      None: no evaluation (progress and round metrics only).
    eval_params: `state -> params` to evaluate (default `state.params`); for
      algorithms whose served model is not `state.params`.
    personalized_params: `state -> [N, ...]` personalized models, row i for
      client i of the dataset, e.g. `fo.personalized_params`; adds the
      `personalized_test_*` metrics. Needs `metric_fns`.
    personalize: `(params, data [S, B, ...], mask [S, B]) -> params`, a model
      adapted on each client's train split from `eval_params(state)`, e.g.
      `algorithm.personalize`; the alternative to `personalized_params`
      (give at most one).
    personalized_client_map: how clients are mapped in the personalized
      evaluation (see `fedjax_opt.core.client_map`; default auto).
    holdout: a `FederatedDataset` of clients that never train, evaluated on
      all their examples.
    batch_size: example slots per evaluation step.
    objective: `objective(params, table, dataset) -> scalar`, recorded as
      `objective` at every evaluation, e.g. the training objective F of the
      ADMM and distributed families (a curve of their gap to F*); `table` is
      `personalized_params(state)` (None without it). Computed in the
      program's dtype.
  """

  every: int = 10
  metric_fns: Mapping[str, Callable[[PyTree, PyTree], jax.Array]] | None = None
  eval_params: Callable[[PyTree], PyTree] | None = None
  personalized_params: Callable[[PyTree], PyTree] | None = None
  personalize: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None
  personalized_client_map: Any = None
  holdout: Any = None
  batch_size: int = 256
  objective: Callable[[PyTree, PyTree, Any], jax.Array] | None = None

  def __post_init__(self):
    check_int(self.every, "Evaluation.every")
    check_int(self.batch_size, "Evaluation.batch_size")
    for name, fn in (("personalized_params", self.personalized_params), ("personalize", self.personalize),
                     ("objective", self.objective)):
      if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable; got {type(fn).__name__}.")
    if self.personalized_params is not None and self.personalize is not None:
      raise ValueError("give personalized_params (stored per-client models) or personalize (models adapted on "
                       "each client), not both.")
    if self.personalized and not self.metric_fns:
      raise ValueError("personalized metrics need metric_fns, e.g. {'accuracy': model.accuracy_fn}.")

  @property
  def personalized(self) -> bool:
    """True when each client's own model is evaluated too (`personalized_params` or `personalize`)."""
    return self.personalized_params is not None or self.personalize is not None


@dataclasses.dataclass(frozen=True)
class Checkpointing:
  """Where and how often `train` saves (state, history) with orbax, and whether it resumes from there.

  Attributes:
    directory: where the checkpoints go.
    every: chunks between checkpoints (one is also saved at the end, when the
      run diverges, and on Ctrl-C for the last completed chunk).
    resume: continue from the latest checkpoint in `directory` (from the
      given state when there is none). An unreadable latest checkpoint falls
      back to the previous one (`CheckpointWarning`); none readable raises
      `CheckpointError`.
  """

  directory: str | os.PathLike | None = None
  every: int = 1
  resume: bool = False

  def __post_init__(self):
    if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
      raise TypeError(f"Checkpointing.directory must be a path; got {type(self.directory).__name__}.")
    check_int(self.every, "Checkpointing.every")
    if not isinstance(self.resume, bool):
      raise TypeError(f"Checkpointing.resume must be True or False; got {self.resume!r}.")
    if self.resume and self.directory is None:
      raise ValueError("resume=True needs checkpoint_dir, the directory to resume from: "
                       "Checkpointing(directory, resume=True).")


@dataclasses.dataclass(frozen=True)
class Accounting:
  """The privacy accounting of a run whose aggregator is a `fo.privacy.dp_mean`: `train` records ε(δ) in its history.

      fo.train(algo, state, dataset, 300, fo.Sampling(clients_per_round=10, ...),
               accounting=fo.Accounting(delta=1e-5))
      history.eval_series("dp_epsilon")   # ε after each evaluated round, for the clients the run drew

  `train` requires it whenever the state holds a `dp_mean` (directly, behind
  a client stage, or inside `secure_aggregation` / `corrupt`), and refuses it
  otherwise, so that every reported ε is the ε of the run's own client
  sampling (`fedjax_opt.train.accounting`; docs/privacy.md).

  Attributes:
    noise_multiplier: None (the default): the σ the `dp_mean` in the state was
      built with (`DPMeanState.noise_multiplier`, one per sweep member).
      Given (a number, or K values for a sweep whose members differ in σ), it
      must be that σ: `train` refuses a run whose noise is not the accounted
      one.
    delta: δ ∈ (0, 1), required.
    accountant: "rdp" or "pld" (`fo.privacy.epsilons`).
    sampling: the `fo.privacy.Sampling` the ε was planned for (e.g. the one σ
      was solved with by `fo.privacy.noise_multiplier_for`): `train` refuses
      a run whose `fo.Sampling` draws clients otherwise
      (`fo.privacy.SamplingMismatchError`, naming both). None: the run's own
      draw, whatever it is.
  """

  noise_multiplier: float | Sequence[float] | None = None
  delta: float | None = None
  accountant: str = "rdp"
  sampling: accounting_lib.Sampling | None = None

  def __post_init__(self):
    if self.delta is None:
      raise ValueError("Accounting needs delta=δ, the δ of the (ε, δ) guarantee (e.g. 1e-5, below 1/N).")
    sigmas = self.noise_multipliers
    if self.noise_multiplier is not None and (not sigmas or any(isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating))
                         or not math.isfinite(s) or s < 0 for s in sigmas)):
      raise ValueError(f"Accounting.noise_multiplier must be a finite number >= 0 (or a sequence of them, one per "
                       f"sweep member); got {self.noise_multiplier!r}.")
    if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not 0 < self.delta < 1:
      raise ValueError(f"Accounting.delta must be in (0, 1); got {self.delta!r}.")
    if self.accountant not in accounting_lib.ACCOUNTANTS:
      raise ValueError(f"Accounting.accountant must be one of {accounting_lib.ACCOUNTANTS}; got {self.accountant!r}.")
    if self.sampling is not None and not isinstance(self.sampling, accounting_lib.Sampling):
      raise TypeError(f"Accounting.sampling must be None or a fo.privacy.Sampling (Sampling.fixed(N, m) or "
                      f"Sampling.poisson(N, q)); got {type(self.sampling).__name__}.")

  @property
  def noise_multipliers(self) -> tuple[float, ...]:
    """σ as a tuple: one value, or one per sweep member; () when left to the dp_mean's state."""
    value = self.noise_multiplier
    if value is None:
      return ()
    return tuple(value) if isinstance(value, (list, tuple, np.ndarray)) else (value,)
