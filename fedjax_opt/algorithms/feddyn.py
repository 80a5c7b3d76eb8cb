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
h = (1/m) Σ_k g_k for the stored values. The round is
`core.rounds.client_round` with the g_k table, under the library's rules for
taking part and writing rows (docs/architecture.md, "The round"). The average
of the θ_k − θ^{t−1} goes through the aggregator seam (default: the paper's
uniform mean).

No compression. An aggregator with a client stage
(`fo.aggregators.chain(fo.compression.compress(...), ...)`) is refused: the
server's h and the clients' g_k must change by the same exact θ_k − θ^{t−1}.
With C(θ_k − θ^{t−1}) on the server and g_k = ∇L_k(θ_k) on the client,
h ≠ (1/m) Σ_k g_k after the first round, and the argument above (a fixed
point is the global stationary point) no longer holds; updating g_k by the
compressed difference instead keeps the identity but breaks g_k = ∇L_k(θ_k),
with the same consequence.

No DP, secure aggregation, robust rule or simulated attack either, for the
same reason as SCAFFOLD's c: h moves by the plain sum of the exact changes
of the g_k, outside the aggregator, so `dp_mean` would leave that sum
un-noised (not differentially private), `secure_aggregation` would need it
in the clear, a robust rule would leave it to one attacker, and
`fo.attacks.corrupt` would leave the attackers honest in it. `feddyn`
refuses them in one line, recognised by their declared traits
(`Aggregator.traits`), and refuses an aggregator without traits (unknown)
the same way, saying how to declare them.
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
from fedjax_opt.core.averaging import aggregated_round, initial_fields
from fedjax_opt.core.local import local_train
from fedjax_opt.core.rounds import ClientOutput
from fedjax_opt.core.server import protecting_piece, refuse_client_stage, refuse_unknown_traits
from fedjax_opt.core.tree import global_norm, select_tree
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_loss_fn, check_num_clients, check_optimizer, check_positive, check_scalar

_DEFAULT_AGGREGATOR = aggregators_lib.mean
"""The rule `feddyn` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

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
    *,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    aggregator: aggregators_lib.Aggregator | None = None,
) -> FederatedAlgorithm:
  """FedDyn (Acar et al. 2021): local objectives with a dynamic linear term, server correction h.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    alpha: α > 0, the dynamic regularization coefficient (paper grid
      {0.1, 0.01, 0.001}); may be traced.
    num_clients: m, the total number of clients (rows of the g_k table; every
      `batches.client_id` must be < m).
    client_optimizer: the optax optimizer of the local steps (e.g. `optax.sgd(η)`),
      re-initialized on every client every round.
    aggregator: how the θ_k − θ^{t−1} are averaged; default
      `aggregators.mean()`, the paper's (1/|P_t|) Σ. One with a client stage
      (compression) is refused: h needs the exact θ_k − θ^{t−1}. So are
      `fo.privacy.dp_mean`, `fo.privacy.secure_aggregation`, the robust rules
      and `fo.attacks.corrupt` (their declared `Aggregator.traits`, read by
      `core.server.protecting_piece`): h moves by the plain sum of the exact
      changes of the g_k, outside the aggregator, which none of them would
      cover (the module docstring); so is an aggregator without declared traits.

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedDynState`.
  """
  check_loss_fn(loss_fn)
  check_positive(alpha, "alpha")
  check_scalar(alpha, "alpha")
  check_optimizer(client_optimizer, "client_optimizer")
  num_clients = check_num_clients(num_clients)
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)
  refuse_client_stage(aggregator, "feddyn", "its h must move by the exact θ_k − θ^{t−1} that moves each g_k = "
                      "∇L_k(θ_k), so that h = (1/m) Σ_k g_k (what makes the fixed point stationary); a server that "
                      "receives compressed messages drifts from it every round. Use FedAvg or SCAFFOLD to compress.")
  refuse_unknown_traits(aggregator, "feddyn", "its correction h")
  piece = protecting_piece(aggregator)
  if piece is not None:
    name = aggregator.traits.name
    why = {"dp_mean": "clips and noises the θ_k − θ^{t−1} for the model, but h adds their exact, un-noised sum, so "
                      "the run would not be differentially private",
           "secure_aggregation": "hides each θ_k − θ^{t−1}, but h needs their exact sum from the clients' g_k tables",
           "robust": "is a robust rule for the model's average, but h moves by the plain sum of the g_k changes, "
                     "which one attacker moves freely (and h corrects the model every round)",
           "attack": "replaces the θ_k − θ^{t−1} the server receives but not the g_k changes h adds, so its attackers "
                     "would be honest in h"}[piece]
    raise ValueError(f"feddyn: {name} {why}; use fo.algorithms.fedavg or fedprox with {name}.")
  mode = client_map_lib.FromPolicy()

  def client_update(x, data, mask, g_k):
    result = local_train(loss_fn, client_optimizer, x, data, mask,
                         gradient_correction=dynamic_correction(alpha, g_k, x))
    new_g_k = jax.tree.map(lambda g, d: (g - alpha * d).astype(g.dtype), g_k, result.delta)
    return ClientOutput(result, rows=(new_g_k,))

  def init(params: PyTree, key: jax.Array) -> FedDynState:
    return FedDynState(
        **initial_fields(params, key, aggregator, ("h_norm",)),
        h=jax.tree.map(jnp.zeros_like, params),
        client_gradients=per_client.init(params, num_clients),
    )

  def step(state: FedDynState, batches: ClientBatches) -> FedDynState:
    key, out = aggregated_round(mode, client_update, state.params, state, batches, aggregator,
                                tables=(state.client_gradients,))
    stored, = out.stored
    h = jax.tree.map(lambda hh, dg: hh + dg / num_clients, state.h, stored.change)
    moved = jax.tree.map(lambda p, u, hh: (p + u - hh / alpha).astype(p.dtype), state.params, out.agg.update, h)
    return FedDynState(
        params=select_tree(out.agg.accepted, moved, state.params),
        h=h,
        client_gradients=stored.table,
        aggregator_state=out.agg.state,
        round=state.round + 1,
        key=key,
        metrics={**out.metrics(), "h_norm": global_norm(h).astype(jnp.float32)},
    )

  return FederatedAlgorithm(init, step)


feddyn = execution.accepts_policy_keywords(feddyn, storage_dtype=True, default_aggregator=_DEFAULT_AGGREGATOR,
    refuses_downlink=(
        "FedDyn's server takes no optimizer step to compress: it sets x to the clients' mean model less h/α, and h "
        "moves by models trained from that exact x"),
    evaluation="global", exchanges=(1, 1), hyperparameters={"alpha": execution.REGULARIZER,
        "client_optimizer": execution.CLIENT_OPTIMIZER})
