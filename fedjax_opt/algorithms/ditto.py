"""Ditto: a FedAvg global model plus personal models pulled towards it.

Li, Hu, Beirami, Smith. "Ditto: Fair and Robust Federated Learning Through
Personalization." ICML 2021. arXiv:2012.04221.

Client i's personal model v_i minimises h_i(v; w) = f_i(v) + λ/2 ‖v − w*‖²
around the global model w* = argmin (1/N) Σ_i f_i. One round t (Algorithm 1):

    client i:  global:   S masked local steps of ClientOpt from w_t;  Δ_i = w_i − w_t
               personal: v_i ← v_i − η (∇f_i(v_i; D_s) + λ (v_i − w_t)),  s = 0 … P−1
    server:    w_{t+1} = w_t + ServerOpt(−Aggregate(Δ_i))              (FedAvg by default)

The global part is FedAvg exactly (`core.local.local_train` with the client
optimizer, `core.rounds.client_round` and its rules (docs/architecture.md,
"The round"), the aggregator seam, the server optimizer). The personal part is
`local_train` with `optax.sgd(η)` and the proximal gradient λ(v − w_t) as
its `gradient_correction`, started from the client's stored v_i. Its
P = `personal_steps` steps cycle through the round's S batches (step s uses
batch s mod S). λ = 0: purely local training; λ → ∞: v_i → w_t. For fixed w
the personal steps converge to argmin h_i, which on a quadratic
f_i(v) = ½vᵀA_iv − b_iᵀv is (A_i + λI)⁻¹(b_i + λw).

Personalized models: `state.local_params`, a per-client table initialized
to the initial global model. v_i is written for every client with weight > 0
whose new v_i is finite and that made at least one personal step, whether or
not the global round was accepted (v_i is the client's own:
`client_round(..., rows_follow_round=False)`). Evaluate client i with
`fo.personalized_params(state, i)`; the global model is `state.params`.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import per_client
from fedjax_opt.core.local import cycle_steps, local_train
from fedjax_opt.core.averaging import aggregated_round, initial_downlink_error, initial_fields, server_step
from fedjax_opt.core.rounds import ClientOutput
from fedjax_opt.core.types import Aggregator, ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_int, check_loss_fn,
                                        check_num_clients, check_optimizer, check_positive)

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `ditto` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["DittoState", "ditto"]


@flax.struct.dataclass
class DittoState:
  """Server state of Ditto.

  Attributes:
    params: the global model w_t.
    local_params: the v_i, a per-client table (leaves `[N, ...]`).
    server_opt_state: the server optimizer's state.
    aggregator_state: the aggregator's state.
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` (of the global model) plus
      `personal_loss`, the mean f_i(v_i; D_s) over the personal steps of the
      clients that wrote their v_i.
    downlink_error: as `core.averaging.AveragingState.downlink_error`.
  """

  params: PyTree
  local_params: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]
  downlink_error: Any = None


def ditto(
    loss_fn: LossFn,
    lam: Any,
    eta: Any,
    *,
    num_clients: int,
    personal_steps: int,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
) -> FederatedAlgorithm:
  """Ditto (Li et al. 2021): FedAvg for w, proximal local SGD for each client's v_i.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    lam: λ ≥ 0, the pull of v_i towards the global model (may be traced).
    eta: η > 0, the step size of the personal solver (may be traced). A bare
      step size, not an optimizer: the paper's personal update is plain SGD
      on h_i, v ← v − η(∇f_i(v) + λ(v − w_t)) (η (L + λ) < 2 for convergence).
    num_clients: N, rows of the v_i table.
    personal_steps: P ≥ 1 personal steps per round (Python int), cycling
      through the round's S batches.
    client_optimizer: optax optimizer of the global model's local steps
      (the paper's local solver of f_i; any optimizer).
    server_optimizer: fed −Δ; default `optax.sgd(1.0)` (FedAvg).
    aggregator: default `aggregators.weighted_mean()` (FedAvg's n_k weights).

  Returns:
    `FederatedAlgorithm(init, step)` with state `DittoState`.
  """
  check_loss_fn(loss_fn)
  check_positive(lam, "lam", allow_zero=True)
  check_positive(eta, "eta")
  num_clients = check_num_clients(num_clients)
  personal_steps = check_int(personal_steps, "personal_steps")
  check_optimizer(client_optimizer, "client_optimizer")
  server_optimizer = check_optimizer(optax.sgd(1.0) if server_optimizer is None else server_optimizer,
                                     "server_optimizer")
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)
  mode = client_map_lib.FromPolicy()
  personal_optimizer = optax.sgd(eta)

  def client_update(w, data, mask, v):
    global_result = local_train(loss_fn, client_optimizer, w, data, mask)
    prox = lambda x: jax.tree.map(lambda a, b: lam * (a - b), x, w)  # ∇ of λ/2 ‖v − w_t‖²
    personal = local_train(loss_fn, personal_optimizer, v, *cycle_steps(data, mask, personal_steps),
                           gradient_correction=prox)
    return ClientOutput(global_result, rows=(jax.tree.map(jnp.add, v, personal.delta),), extras=personal,
                        writes=personal.num_steps > 0)

  def init(params: PyTree, key: jax.Array) -> DittoState:
    return DittoState(**initial_fields(params, key, aggregator, ("personal_loss",)),
                      local_params=per_client.broadcast(params, num_clients),
                      server_opt_state=server_optimizer.init(params),
                      downlink_error=initial_downlink_error(aggregator, params))

  def step(state: DittoState, batches: ClientBatches) -> DittoState:
    key, out = aggregated_round(mode, client_update, state.params, state, batches, aggregator,
                                tables=(state.local_params,), rows_follow_round=False)
    params, server_opt_state, downlink_error, out = server_step(aggregator, server_optimizer, state, out.agg.update,
                                                                out)
    personal = out.extras
    n = jnp.where(out.write, personal.num_examples, 0)
    personal_loss = jnp.sum(n * jnp.where(out.write, personal.loss, 0)) / jnp.maximum(jnp.sum(n), 1)
    return DittoState(
        params=params,
        local_params=out.stored[0].table,
        server_opt_state=server_opt_state,
        aggregator_state=out.agg.state,
        round=state.round + 1,
        key=key,
        metrics={**out.metrics(), "personal_loss": personal_loss.astype(jnp.float32)},
        downlink_error=downlink_error,
    )

  return FederatedAlgorithm(init, step)


ditto = execution.accepts_policy_keywords(ditto, storage_dtype=True, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="table", exchanges=(1, 1), hyperparameters={"lam": execution.REGULARIZER,
        "eta": execution.CLIENT_STEP_SIZE, "personal_steps": execution.COUNT,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "server_optimizer": execution.SERVER_OPTIMIZER})
