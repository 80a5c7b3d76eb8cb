"""pFedMe: personalized models regularized by Moreau envelopes.

Dinh, Tran, Nguyen. "Personalized Federated Learning with Moreau Envelopes."
NeurIPS 2020. arXiv:2006.08848.

Client i's personalized model θ_i solves the proximal problem around its
local copy w_i of the global model; the global model minimises the average
Moreau envelope F_i(w) = min_θ f_i(θ) + λ/2 ‖θ − w‖². One round t (Algorithm 1):

    client i:  w_{i,0} = w_t
               for r = 0 … R−1, with the client's r-th batch D_r:
                 θ_i ≈ argmin_θ f_i(θ; D_r) + λ/2 ‖θ − w_{i,r}‖²      (K gradient steps, step size ν)
                 w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ_i)
    server:    w_{t+1} = (1 − β) w_t + β (1/|S|) Σ_{i∈S} w_{i,R}

The inner solve is `core.local.local_train` with `optax.sgd(ν)` on K copies
of D_r and the proximal gradient λ(θ − w_{i,r}) as its `gradient_correction`.
θ starts at w_t each round and is warm-started across the R local steps (as
in the authors' code). A local step whose batch is empty is skipped. The
server step is the aggregator seam (default `aggregators.mean()`, the
paper's uniform mean) with the non-finite guard, then `optax.sgd(β)` on the
pseudo-gradient: w_t + β Δ̄ = (1 − β) w_t + β mean w_{i,R}.

Personalized models: the last θ_i of every client is kept in a per-client
table `state.personal_params` (initialized to the initial global model,
written for clients that took part with a finite update in an accepted
round). Evaluate client i with `personalized_params(state, i)`.

Fixed point: with exact inner solves θ_i(w) = (A_i + λI)⁻¹(b_i + λw) on
quadratics f_i(θ) = ½θᵀA_iθ − b_iᵀθ, one local step and full participation,
w is stationary iff Σ_i λ(w − θ_i(w)) = 0 (tested in tests/test_pfedme.py).
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
from fedjax_opt.core.local import local_train
from fedjax_opt.core.server import (aggregate_updates, apply_server_update, client_is_finite, initial_round_metrics,
                                    round_metrics)
from fedjax_opt.core.tree import select_tree
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_client_batches, check_key, check_loss_fn, check_positive

__all__ = ["PFedMeState", "pfedme", "personalized_params"]


@flax.struct.dataclass
class PFedMeState:
  """Server state of pFedMe.

  Attributes:
    params: the global model w_t.
    personal_params: the θ_i, a per-client table (leaves `[N, ...]`).
    server_opt_state: state of `optax.sgd(β)`.
    aggregator_state: the aggregator's state.
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` (client_loss: the personal objective's
      data term f_i(θ; D_r) averaged over the inner steps).
  """

  params: PyTree
  personal_params: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]



def _check_int(value: Any, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a Python int >= 1; got {value!r}.")
  return value


def _client_update(loss_fn: LossFn, lam: Any, inner_steps: int, inner_lr: Any, lr: Any, unroll: int | bool):
  """`(w_t, (data [R, B, ...], mask [R, B])) -> (Δ_i = w_{i,R} − w_t, θ_i, loss, num_examples, num_steps)`."""
  inner_optimizer = optax.sgd(inner_lr)

  def one_local_step(carry, inputs):
    w_i, theta, loss_sum = carry
    batch, mask = inputs
    repeat = lambda a: jnp.broadcast_to(a, (inner_steps,) + a.shape)
    prox = lambda th: jax.tree.map(lambda a, b: lam * (a - b), th, w_i)  # ∇ of λ/2 ‖θ − w_i‖²
    solve = local_train(loss_fn, inner_optimizer, theta, jax.tree.map(repeat, batch), repeat(mask),
                        gradient_correction=prox, unroll=unroll)
    new_theta = jax.tree.map(jnp.add, theta, solve.delta)
    new_w = jax.tree.map(lambda w, th: w - lr * lam * (w - th), w_i, new_theta)
    has_data = jnp.any(mask)
    count = jnp.sum(mask, dtype=solve.loss.dtype)
    return (select_tree(has_data, new_w, w_i), select_tree(has_data, new_theta, theta),
            loss_sum + solve.loss * count), has_data

  def update(w, client):
    data, mask = client
    init = (w, w, jnp.zeros((), jnp.result_type(float)))
    (w_i, theta, loss_sum), used = jax.lax.scan(one_local_step, init, (data, mask), unroll=unroll)
    n = jnp.sum(mask, dtype=loss_sum.dtype)
    return (jax.tree.map(jnp.subtract, w_i, w), theta, loss_sum / jnp.maximum(n, 1), n,
            jnp.sum(used, dtype=jnp.int32))

  return update


def pfedme(
    loss_fn: LossFn,
    lam: Any,
    inner_steps: int,
    inner_lr: Any,
    local_steps: int,
    lr: Any,
    beta: Any,
    num_clients: int,
    aggregator: aggregators_lib.Aggregator | None = None,
    *,
    storage_dtype: Any = None,
    client_map: client_map_lib.ClientMap | str | None = None,
    unroll: int | bool = 1,
) -> FederatedAlgorithm:
  """pFedMe (Dinh et al. 2020): proximal personalized models θ_i, local steps on w_i, β-mixed averaging.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    lam: λ > 0, the Moreau-envelope regularization (may be traced).
    inner_steps: K ≥ 1, gradient steps of the inner solve (Python int).
    inner_lr: ν > 0, the inner solve's step size (K and ν decide how
      accurately θ_i is found; ν(L + λ) < 2 for convergence).
    local_steps: R ≥ 1 (Python int); `batches` must have S = R local steps.
    lr: η > 0, the local step size of w_i.
    beta: β > 0, the server mixing (β = 1: plain averaging; the paper uses β ≥ 1).
    num_clients: N, rows of the θ_i table.
    aggregator: default `aggregators.mean()`.
    storage_dtype: dtype of the stored θ_i (None: the model's).
    client_map: how clients are mapped (see `fedjax_opt.core.client_map`).
    unroll: `lax.scan` unroll of the local and inner steps.

  Returns:
    `FederatedAlgorithm(init, step)` with state `PFedMeState`.
  """
  check_loss_fn(loss_fn)
  for value, name in ((lam, "lam"), (inner_lr, "inner_lr"), (lr, "lr"), (beta, "beta")):
    check_positive(value, name)
  inner_steps = _check_int(inner_steps, "inner_steps")
  local_steps = _check_int(local_steps, "local_steps")
  num_clients = per_client.check_num_clients(num_clients)
  aggregator = aggregators_lib.resolve(aggregator, aggregators_lib.mean)
  mode = client_map_lib.resolve(client_map)
  server_optimizer = optax.sgd(beta)
  client_update = _client_update(loss_fn, lam, inner_steps, inner_lr, lr, unroll)

  def init(params: PyTree, key: jax.Array) -> PFedMeState:
    check_key(key)
    return PFedMeState(
        params=params,
        personal_params=per_client.broadcast(params, num_clients, storage_dtype=storage_dtype),
        server_opt_state=server_optimizer.init(params),
        aggregator_state=aggregator.init(params),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics=initial_round_metrics(),
    )

  def step(state: PFedMeState, batches: ClientBatches) -> PFedMeState:
    check_client_batches(batches)
    if batches.local_steps != local_steps:
      raise ValueError(f"pfedme(local_steps={local_steps}) needs batches with S = local_steps; "
                       f"got S = {batches.local_steps}.")
    per_client.check_client_ids(batches.client_id, num_clients)
    key, agg_key = jax.random.split(state.key)
    delta, theta, loss, num_examples, num_steps = client_map_lib.map_clients(
        mode, client_update, state.params, (batches.data, batches.mask))
    weights = jnp.where(num_steps > 0, batches.weight, jnp.zeros_like(batches.weight))
    agg = aggregate_updates(aggregator, delta, weights, state.aggregator_state, agg_key)
    params, server_opt_state = apply_server_update(
        server_optimizer, state.params, state.server_opt_state, agg.update, agg.accepted)
    write = (weights > 0) & agg.finite & agg.accepted & client_is_finite(theta)
    stored = per_client.scatter(state.personal_params, batches.client_id, theta, write)
    return PFedMeState(
        params=params,
        personal_params=stored.table,
        server_opt_state=server_opt_state,
        aggregator_state=agg.state,
        round=state.round + 1,
        key=key,
        metrics=round_metrics(loss, num_examples, weights, agg),
    )

  return FederatedAlgorithm(init, step)



personalized_params = per_client.personalized_params
"""pFedMe's θ_i table, or rows of it (`fedjax_opt.core.per_client.personalized_params`)."""
