"""FedDyn: dynamic regularization that aligns the clients' stationary points with the global one.

Acar, Zhao, Matas Navarro, Mattina, Whatmough, Saligrama. "Federated Learning Based
on Dynamic Regularization." ICLR 2021. arXiv:2111.04263.

Each client k keeps g_k = ∇L_k(θ_k) (the gradient of its loss at its last
local model; 0 at the start), the server keeps h (0 at the start). One round
t with active clients P_t out of m (Algorithm 1):

    client k:  θ_k = argmin_θ  L_k(θ) − ⟨g_k, θ⟩ + (α/2) ‖θ − θ^{t−1}‖²
                   (inexactly: S masked local steps of the client optimizer from
                    θ^{t−1} along ∇L_{k,s}(θ) − g_k + α (θ − θ^{t−1}))
               g_k ← g_k − α (θ_k − θ^{t−1})
    server:    h   ← h − (α/m) Σ_{k∈P_t} (θ_k − θ^{t−1})
               θ^t = (1/|P_t|) Σ_{k∈P_t} θ_k − h/α

Inactive clients keep g_k exactly. Since h changes by the same amount as
(1/m) Σ_k g_k, h = (1/m) Σ_k g_k at every round, and at a fixed point
θ_k = θ^t for all k, h = 0, so Σ_k ∇L_k(θ) = 0: the global stationary point,
even when the local problems are solved inexactly.

The g_k live in a per-client table (`fedjax_opt.core.per_client`;
num_clients × model size entries, `storage_dtype` to store them in
bfloat16); h is updated by the change actually stored, keeping
h = (1/m) Σ_k g_k for the stored values. A client takes part when its weight
is > 0, it made at least one local step, and its update is finite. The
average of the θ_k − θ^{t−1} goes through the aggregator seam (default: the
paper's uniform mean, with the non-finite guard).
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
from fedjax_opt.core.server import aggregate_updates, initial_round_metrics, round_metrics
from fedjax_opt.core.tree import global_norm, select_tree
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_client_batches, check_key, check_loss_fn, check_optimizer, check_positive

__all__ = ["FedDynState", "feddyn"]


@flax.struct.dataclass
class FedDynState:
  """Server state of FedDyn.

  Attributes:
    params: the global model θ^t.
    h: the server's correction, (1/m) Σ_k g_k (a pytree like params).
    client_gradients: the g_k = ∇L_k(θ_k), a per-client table (leaves
      `[m, ...]`, in `storage_dtype`).
    aggregator_state: the aggregator's state.
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` (update_norm = ‖mean_k θ_k − θ^{t−1}‖)
      plus `h_norm` = ‖h‖₂.
  """

  params: PyTree
  h: PyTree
  client_gradients: PyTree
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def dynamic_correction(alpha: Any, g_k: PyTree, anchor: PyTree):
  """x ↦ −g_k + α (x − θ^{t−1}): the gradient of FedDyn's linear and quadratic terms."""

  def correction(x: PyTree) -> PyTree:
    return jax.tree.map(lambda a, g, a0: (alpha * (a - a0) - g).astype(jnp.result_type(a)), x, g_k, anchor)

  return correction


def feddyn(
    loss_fn: LossFn,
    alpha: Any,
    client_optimizer: optax.GradientTransformation,
    num_clients: int,
    aggregator: aggregators_lib.Aggregator | None = None,
    *,
    storage_dtype: Any = None,
    client_map: client_map_lib.ClientMap | str | None = None,
    unroll: int | bool = 1,
) -> FederatedAlgorithm:
  """FedDyn (Acar et al. 2021): local objectives with a dynamic linear term, server correction h.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    alpha: α > 0, the dynamic regularization coefficient (paper grid
      {0.1, 0.01, 0.001}); may be traced.
    client_optimizer: optax optimizer of the local steps (e.g. `optax.sgd(lr)`),
      re-initialized on every client every round.
    num_clients: m, the total number of clients (rows of the g_k table; every
      `batches.client_id` must be < m).
    aggregator: how the θ_k − θ^{t−1} are averaged; default
      `aggregators.mean()`, the paper's (1/|P_t|) Σ.
    storage_dtype: dtype of the stored g_k (e.g. `jnp.bfloat16`); None keeps the
      model's dtype.
    client_map: how clients are mapped (see `fedjax_opt.core.client_map`).
    unroll: `lax.scan` unroll of the local steps.

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedDynState`.
  """
  check_loss_fn(loss_fn)
  check_positive(alpha, "alpha")
  if jnp.ndim(alpha) != 0:
    raise ValueError(f"alpha must be a scalar; got shape {tuple(jnp.shape(alpha))}.")
  check_optimizer(client_optimizer, "client_optimizer")
  num_clients = per_client.check_num_clients(num_clients)
  aggregator = aggregators_lib.resolve(aggregator, aggregators_lib.mean)
  mode = client_map_lib.resolve(client_map)

  def client_update(x, client):
    data, mask, g_k = client
    result = local_train(loss_fn, client_optimizer, x, data, mask,
                         gradient_correction=dynamic_correction(alpha, g_k, x), unroll=unroll)
    new_g_k = jax.tree.map(lambda g, d: (g - alpha * d).astype(g.dtype), g_k, result.delta)
    return result, new_g_k

  def init(params: PyTree, key: jax.Array) -> FedDynState:
    check_key(key)
    return FedDynState(
        params=params,
        h=jax.tree.map(jnp.zeros_like, params),
        client_gradients=per_client.init(params, num_clients, storage_dtype=storage_dtype),
        aggregator_state=aggregator.init(params),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={**initial_round_metrics(), "h_norm": jnp.zeros((), jnp.float32)},
    )

  def step(state: FedDynState, batches: ClientBatches) -> FedDynState:
    check_client_batches(batches)
    key, agg_key = jax.random.split(state.key)
    g_k = per_client.gather(state.client_gradients, batches.client_id, like=state.params)
    results, new_g_k = client_map_lib.map_clients(mode, client_update, state.params,
                                                  (batches.data, batches.mask, g_k))
    weights = jnp.where(results.num_steps > 0, batches.weight, jnp.zeros_like(batches.weight))
    agg = aggregate_updates(aggregator, results.delta, weights, state.aggregator_state, agg_key)
    stored = per_client.scatter(state.client_gradients, batches.client_id, new_g_k,
                                (weights > 0) & agg.finite & agg.accepted)
    h = jax.tree.map(lambda hh, dg: hh + dg / num_clients, state.h, stored.change)
    moved = jax.tree.map(lambda p, u, hh: (p + u - hh / alpha).astype(p.dtype), state.params, agg.update, h)
    params = select_tree(agg.accepted, moved, state.params)
    metrics = round_metrics(results.loss, results.num_examples, weights, agg)
    return FedDynState(
        params=params,
        h=h,
        client_gradients=stored.table,
        aggregator_state=agg.state,
        round=state.round + 1,
        key=key,
        metrics={**metrics, "h_norm": global_norm(h).astype(jnp.float32)},
    )

  return FederatedAlgorithm(init, step)
