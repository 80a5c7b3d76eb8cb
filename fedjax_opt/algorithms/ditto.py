"""Ditto: a FedAvg global model plus personal models pulled towards it.

Li, Hu, Beirami, Smith. "Ditto: Fair and Robust Federated Learning Through
Personalization." ICML 2021. arXiv:2012.04221.

Client i's personal model v_i minimises h_i(v; w) = f_i(v) + λ/2 ‖v − w*‖²
around the global model w* = argmin (1/N) Σ_i f_i. One round t (Algorithm 1):

    client i:  global:   S masked local steps of ClientOpt from w_t;  Δ_i = w_i − w_t
               personal: v_i ← v_i − η_p (∇f_i(v_i; D_s) + λ (v_i − w_t)),  s = 0 … P−1
    server:    w_{t+1} = w_t + ServerOpt(−Aggregate(Δ_i))              (FedAvg by default)

The global part is FedAvg exactly (`core.local.local_train` with the client
optimizer, the non-finite guard, the aggregator seam, the server optimizer).
The personal part is `local_train` with `optax.sgd(η_p)` and the proximal
gradient λ(v − w_t) as its `gradient_correction`, started from the client's
stored v_i. Its P = `personal_steps` steps cycle through the round's S batches
(step s uses batch s mod S). λ = 0: purely local training; λ → ∞: v_i → w_t.
For fixed w the personal steps converge to argmin h_i, which on a quadratic
f_i(v) = ½vᵀA_iv − b_iᵀv is (A_i + λI)⁻¹(b_i + λw).

Personalized models: `state.personal_params`, a per-client table initialized
to the initial global model. v_i is written for every client with weight > 0
whose new v_i is finite and that made at least one personal step, whether or
not the global round was accepted (v_i is the client's own). Evaluate client i
with `personalized_params(state, i)`; the global model is `state.params`.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.local import cycle_steps, local_train
from fedjax_opt.core.server import (aggregate_updates, apply_server_update, client_is_finite, initial_round_metrics,
                                    round_metrics)
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_key, check_loss_fn, check_optimizer,
                                        check_positive)

personalized_params = per_client.personalized_params

__all__ = ["DittoState", "ditto", "personalized_params"]


@flax.struct.dataclass
class DittoState:
  """Server state of Ditto.

  Attributes:
    params: the global model w_t.
    personal_params: the v_i, a per-client table (leaves `[N, ...]`).
    server_opt_state: the server optimizer's state.
    aggregator_state: the aggregator's state.
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` (of the global model) plus
      `personal_loss`, the mean f_i(v_i; D_s) over the personal steps of the
      clients taking part.
  """

  params: PyTree
  personal_params: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def ditto(
    loss_fn: LossFn,
    lam: Any,
    client_optimizer: optax.GradientTransformation,
    personal_lr: Any,
    personal_steps: int,
    server_optimizer: optax.GradientTransformation | None = None,
    *,
    num_clients: int,
    aggregator: aggregators_lib.Aggregator | None = None,
    storage_dtype: Any = None,
    client_map: client_map_lib.ClientMap | str | None = None,
    unroll: int | bool = 1,
) -> FederatedAlgorithm:
  """Ditto (Li et al. 2021): FedAvg for w, proximal local SGD for each client's v_i.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    lam: λ ≥ 0, the pull of v_i towards the global model (may be traced).
    client_optimizer: optax optimizer of the global model's local steps.
    personal_lr: η_p > 0, the personal SGD step size (η_p (L + λ) < 2 for
      convergence).
    personal_steps: P ≥ 1 personal steps per round (Python int), cycling
      through the round's S batches.
    server_optimizer: fed −Δ; default `optax.sgd(1.0)` (FedAvg).
    num_clients: N, rows of the v_i table.
    aggregator: default `aggregators.weighted_mean()` (FedAvg's n_k weights).
    storage_dtype: dtype of the stored v_i (None: the model's).
    client_map: how clients are mapped (see `fedjax_opt.core.client_map`).
    unroll: `lax.scan` unroll of the local steps.

  Returns:
    `FederatedAlgorithm(init, step)` with state `DittoState`.
  """
  check_loss_fn(loss_fn)
  check_positive(lam, "lam", allow_zero=True)
  check_optimizer(client_optimizer, "client_optimizer")
  check_positive(personal_lr, "personal_lr")
  if isinstance(personal_steps, bool) or not isinstance(personal_steps, int) or personal_steps < 1:
    raise ValueError(f"personal_steps must be a Python int >= 1; got {personal_steps!r}.")
  num_clients = per_client.check_num_clients(num_clients)
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer
  check_optimizer(server_optimizer, "server_optimizer")
  aggregator = aggregators_lib.resolve(aggregator, aggregators_lib.weighted_mean)
  mode = client_map_lib.resolve(client_map)
  personal_optimizer = optax.sgd(personal_lr)

  def client_update(w, client):
    data, mask, v = client
    global_result = local_train(loss_fn, client_optimizer, w, data, mask, unroll=unroll)
    prox = lambda x: jax.tree.map(lambda a, b: lam * (a - b), x, w)  # ∇ of λ/2 ‖v − w_t‖²
    s = mask.shape[0]
    personal = local_train(loss_fn, personal_optimizer, v, *cycle_steps(data, mask, personal_steps),
                           gradient_correction=prox, unroll=unroll)
    return global_result, jax.tree.map(jnp.add, v, personal.delta), personal

  def init(params: PyTree, key: jax.Array) -> DittoState:
    check_key(key)
    return DittoState(
        params=params,
        personal_params=per_client.broadcast(params, num_clients, storage_dtype=storage_dtype),
        server_opt_state=server_optimizer.init(params),
        aggregator_state=aggregator.init(params),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={**initial_round_metrics(), "personal_loss": jnp.zeros((), jnp.float32)},
    )

  def step(state: DittoState, batches: ClientBatches) -> DittoState:
    check_client_batches(batches)
    key, agg_key = jax.random.split(state.key)
    v = per_client.gather(state.personal_params, batches.client_id, like=state.params)
    results, new_v, personal = client_map_lib.map_clients(
        mode, client_update, state.params, (batches.data, batches.mask, v))
    agg = aggregate_updates(aggregator, results.delta, batches.weight, state.aggregator_state, agg_key)
    params, server_opt_state = apply_server_update(
        server_optimizer, state.params, state.server_opt_state, agg.update, agg.accepted)
    write = (batches.weight > 0) & (personal.num_steps > 0) & client_is_finite(new_v)
    stored = per_client.scatter(state.personal_params, batches.client_id, new_v, write)
    n = jnp.where(write, personal.num_examples, 0)
    personal_loss = jnp.sum(n * jnp.where(write, personal.loss, 0)) / jnp.maximum(jnp.sum(n), 1)
    return DittoState(
        params=params,
        personal_params=stored.table,
        server_opt_state=server_opt_state,
        aggregator_state=agg.state,
        round=state.round + 1,
        key=key,
        metrics={**round_metrics(results.loss, results.num_examples, batches.weight, agg),
                 "personal_loss": personal_loss.astype(jnp.float32)},
    )

  return FederatedAlgorithm(init, step)
