"""FedAvg with a fine-tuning stage, then per-client personalization by local steps.

Jiang, Konečný, Rush, Kannan. "Improving Federated Learning Personalization
via Model Agnostic Meta Learning." NeurIPS 2019 Workshop on Federated
Learning. arXiv:1909.12488.

The paper reads FedAvg as a meta-learning (Reptile-like) algorithm and
proposes three consecutive stages:

1. FedAvg with momentum SGD on the server (FedAvgM) and relatively many local
   steps, for rounds t < T₁ (`switch_round`):
       x_{t+1} = x_t + ServerOpt₁(−Δ_t),   Δ_t = mean_k (ClientOpt₁^S(x_t; D_k) − x_t)
2. fine-tuning the resulting initial model with the same round structure but
   a second pair of optimizers, for rounds t ≥ T₁ (the paper switches the
   server to Adam and uses few local steps; the default here is server Adam,
   `server_optimizers.fedadam()`; any client optimizer, server optimizer and,
   optionally, only the first M of the S local steps may be given):
       x_{t+1} = x_t + ServerOpt₂(−Δ_t),   Δ_t from ClientOpt₂ on M ≤ S steps
3. personalization, not a round: client k takes K local steps of a client
   optimizer (the paper: the one used in training; default here the
   fine-tuning stage's) from the final model on its own training data and
   is evaluated on its own test data:
       x_k = PersonalOpt^K(x_T; D_k^train),   evaluated on D_k^test

Design. `fedavg_finetune(...)` returns `FederatedAlgorithm(init, step, personalize)`:

* `init` / `step`: stages 1 and 2. Both stages are FedAvg's round
  (`core.averaging.averaging_algorithm`: the aggregator seam and the round's
  rules, docs/architecture.md "The round", unchanged) with their own optimizers; `step` picks the
  stage with `lax.cond(state.round < switch_round, ...)`, so a whole run is
  one `lax.scan` and `fedjax_opt.train.train` drives it like any algorithm.
  Each stage keeps its own server optimizer state (the FedAvgM trace,
  Adam's moments); the aggregator state is shared. `switch_round` may be
  traced (a sweep over it needs no recompilation).
* `personalize(params, data [S, B, ...], mask [S, B]) -> params`: stage 3 for
  one client, pure and jittable; step k uses the client's batch k mod S
  (S = 1 with every example in the batch: K steps of full-batch descent).
  `personalize_steps = 0` returns `params` unchanged. It is the `personalize`
  field of `fo.Evaluation` (for `fo.train`) and the `adapt_fn` of `fo.evaluate.adapted` (each
  client's test metrics after personalization); map it over a round's
  clients with `fo.client_map.map_clients` for a stack `[C, ...]`.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt import server_optimizers
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.averaging import AveragingState, averaging_algorithm
from fedjax_opt.core.local import cycle_steps, local_train
from fedjax_opt.core.server import initial_round_metrics
from fedjax_opt.core.types import Aggregator, ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_int, check_key, check_loss_fn, check_optimizer,
                                        check_optional_int, check_positive, is_concrete)

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `fedavg_finetune` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["FineTuningState", "fedavg_finetune"]


@flax.struct.dataclass
class FineTuningState:
  """Server state of FedAvg + fine-tuning.

  Attributes:
    params: the global model x_t (the initial model for personalization).
    server_opt_state: stage 1's server optimizer state (FedAvgM's momentum).
    finetune_opt_state: stage 2's server optimizer state.
    aggregator_state: the aggregator's state (shared by both stages).
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` plus `finetuning` (bool: the round
      was a stage-2 round).
    downlink_error: as `core.averaging.AveragingState.downlink_error` (shared by both stages).
  """

  params: PyTree
  server_opt_state: Any
  finetune_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]
  downlink_error: Any = None


def fedavg_finetune(
    loss_fn: LossFn,
    *,
    switch_round: Any,
    personalize_steps: int,
    client_optimizer: optax.GradientTransformation,
    finetune_client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    finetune_server_optimizer: optax.GradientTransformation | None = None,
    finetune_local_steps: int | None = None,
    personalize_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
) -> FederatedAlgorithm:
  """FedAvg(M), a fine-tuning stage, and K-step personalization (Jiang et al. 2019).

  The paper has no update-rule hyper-parameter of its own (its stages are
  FedAvg with chosen optimizers), so every argument is keyword-only.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    switch_round: T₁ ≥ 0: rounds t < T₁ are stage 1, the rest stage 2 (may be
      traced; 0 = fine-tuning only).
    personalize_steps: K ≥ 0 local steps of stage 3 (Python int).
    client_optimizer: stage 1's client optimizer (e.g. `optax.sgd(η)`).
    finetune_client_optimizer: stage 2's client optimizer (e.g. a smaller
      `optax.sgd` or `optax.adam`).
    server_optimizer: stage 1's server optimizer; default
      `server_optimizers.fedavgm()` (η = 1, momentum 0.9).
    finetune_server_optimizer: stage 2's server optimizer; default
      `server_optimizers.fedadam()`, Adam on the server as in the paper's
      fine-tuning stage, with Reddi et al.'s FedAdam defaults (η = 0.01,
      β₁ = 0.9, β₂ = 0.99, τ = 1e-3: the paper's own Adam values are not
      restated here). `server_optimizers.fedavg()` is plain averaging.
    finetune_local_steps: M, local steps per client in stage 2 (the first M
      of the round's S batches; the rest are masked out); None: all S.
    personalize_optimizer: stage 3's optimizer; default
      `finetune_client_optimizer`.
    aggregator: shared by both stages; default `aggregators.weighted_mean()`.

  Returns:
    `FederatedAlgorithm(init, step, personalize)` with state `FineTuningState`.
  """
  check_loss_fn(loss_fn)
  check_positive(switch_round, "switch_round", allow_zero=True)
  if is_concrete(switch_round) and not jnp.issubdtype(jnp.result_type(switch_round), jnp.integer):
    raise TypeError(f"switch_round must be an integer round index; got {switch_round!r}.")
  personalize_steps = check_int(personalize_steps, "personalize_steps", 0)
  check_optimizer(client_optimizer, "client_optimizer")
  check_optimizer(finetune_client_optimizer, "finetune_client_optimizer")
  finetune_local_steps = check_optional_int(finetune_local_steps, "finetune_local_steps")
  server_optimizer = server_optimizers.fedavgm() if server_optimizer is None else server_optimizer
  finetune_server_optimizer = (server_optimizers.fedadam() if finetune_server_optimizer is None else
                               finetune_server_optimizer)
  check_optimizer(server_optimizer, "server_optimizer")
  check_optimizer(finetune_server_optimizer, "finetune_server_optimizer")
  personalize_optimizer = check_optimizer(
      finetune_client_optimizer if personalize_optimizer is None else personalize_optimizer,
      "personalize_optimizer")
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)
  mode = client_map_lib.FromPolicy()

  def stage(client_optimizer, server_optimizer):  # FedAvg / FedOpt with these optimizers
    client_update = lambda p, data, mask: local_train(loss_fn, client_optimizer, p, data, mask)
    return averaging_algorithm(client_update, server_optimizer, aggregator, mode)

  stage1 = stage(client_optimizer, server_optimizer)
  stage2 = stage(finetune_client_optimizer, finetune_server_optimizer)

  def init(params: PyTree, key: jax.Array) -> FineTuningState:
    check_key(key)
    first = stage1.init(params, key)
    return FineTuningState(
        params=params,
        server_opt_state=first.server_opt_state,
        finetune_opt_state=finetune_server_optimizer.init(params),
        aggregator_state=first.aggregator_state,
        round=first.round,
        key=key,
        metrics={**initial_round_metrics(), "finetuning": jnp.zeros((), bool)},
        downlink_error=first.downlink_error,
    )

  def run(stage: FederatedAlgorithm, field: str, batches: ClientBatches):
    def branch(state: FineTuningState) -> FineTuningState:
      inner = AveragingState(params=state.params, server_opt_state=getattr(state, field),
                             aggregator_state=state.aggregator_state, round=state.round, key=state.key,
                             metrics=initial_round_metrics(), downlink_error=state.downlink_error)
      out = stage.step(inner, batches)
      return state.replace(params=out.params, aggregator_state=out.aggregator_state, round=out.round, key=out.key,
                           metrics=out.metrics, downlink_error=out.downlink_error, **{field: out.server_opt_state})

    return branch

  def step(state: FineTuningState, batches: ClientBatches) -> FineTuningState:
    check_client_batches(batches)
    tuning_batches = batches
    if finetune_local_steps is not None:
      used = jnp.arange(batches.local_steps) < finetune_local_steps
      tuning_batches = batches.replace(mask=batches.mask & used[None, :, None])
    finetuning = state.round >= switch_round
    out = jax.lax.cond(finetuning, run(stage2, "finetune_opt_state", tuning_batches),
                       run(stage1, "server_opt_state", batches), state)
    return out.replace(metrics={**out.metrics, "finetuning": finetuning})

  def personalize(params: PyTree, data: PyTree, mask: jax.Array) -> PyTree:
    if jnp.ndim(mask) != 2:
      raise ValueError(f"personalize: mask must be one client's [S, B]; got shape {tuple(jnp.shape(mask))}.")
    cycled = cycle_steps(data, mask, personalize_steps)  # step k uses batch k mod S
    result = local_train(loss_fn, personalize_optimizer, params, *cycled)
    return jax.tree.map(jnp.add, params, result.delta)

  return FederatedAlgorithm(init, step, personalize)


fedavg_finetune = execution.accepts_policy_keywords(fedavg_finetune, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="adapt", exchanges=(1, 1), hyperparameters={"switch_round": execution.COUNT,
        "personalize_steps": execution.COUNT, "client_optimizer": execution.CLIENT_OPTIMIZER,
        "finetune_client_optimizer": execution.CLIENT_OPTIMIZER, "server_optimizer": execution.SERVER_OPTIMIZER,
        "finetune_server_optimizer": execution.SERVER_OPTIMIZER, "finetune_local_steps": execution.COUNT,
        "personalize_optimizer": execution.CLIENT_OPTIMIZER})
