"""Global-variable consensus ADMM for horizontal federated learning.

Boyd, Parikh, Chu, Peleato, Eckstein. "Distributed Optimization and
Statistical Learning via the Alternating Direction Method of Multipliers."
Foundations and Trends in Machine Learning 3(1), 2011. §3.3–3.4 (stopping
criterion, over-relaxation, varying penalty), §7.1 (consensus).

N clients, client i's objective f_i(x) = mean loss over its real examples of
the round (n_i of them):

    objective="clients"  (default):  minimize Σ_i f_i(x_i)          subject to  x_i = z,  i = 1 … N,
    objective="examples":            minimize Σ_i n_i f_i(x_i) / n,  n = Σ_i n_i,

the second being the pooled empirical risk (the mean loss over every real
example of every client), the first giving every client one vote whatever its
size. Both are written with client weights w_i (w_i = 1, or w_i = n_i) as
minimize Σ_i w_i f_i(x_i) s.t. x_i = z, with the augmented Lagrangian weighted
the same way (per-constraint dual w_i λ_i and penalty w_i ρ):

    L = Σ_i w_i [f_i(x_i) + ⟨λ_i, x_i − z⟩ + (ρ/2)‖x_i − z‖²].

One `step` is one ADMM iteration k (one communication round), with duals λ_i
(unscaled; the scaled dual is u_i = λ_i / ρ):

    client:  x_i^{k+1} = argmin_x f_i(x) + ⟨λ_i^k, x − z^k⟩ + (ρ/2)‖x − z^k‖²
                       = prox_{f_i/ρ}(z^k − λ_i^k / ρ)
             x̂_i = α x_i^{k+1} + (1 − α) z^k                      (over-relaxation, α ∈ (0, 2))
    server:  z^{k+1} = Σ_i w_i (x̂_i + λ_i^k / ρ) / Σ_i w_i      ("clients": the plain mean (1/N) Σ_i)
    client:  λ_i^{k+1} = λ_i^k + ρ (x̂_i − z^{k+1})

Derivation: w_i multiplies every term of client i in L, so the x_i-update
(L minimised over x_i alone) is the same for both objectives; minimising L
over z gives Σ_i w_i (λ_i + ρ(z − x̂_i)) = 0, the weighted mean; the dual
ascent on the constraint's dual w_i λ_i with step w_i ρ is λ_i += ρ(x̂_i − z).
A fixed point has x_i = z, Σ_i w_i λ_i = 0 (z-update) and ∇f_i(z) + λ_i = 0
(x-update), so Σ_i w_i ∇f_i(z) = 0: the minimiser of Σ_i w_i f_i, i.e. of the
pooled risk when w_i = n_i. Only the ratios of the w_i enter, so n is never
needed. For "examples", w_i is the number of real examples client i had the
last time it took part (`state.client_weights`, 0 before that: a client never
seen holds no known example); `batches.weight` is not used for it (it only
decides, as everywhere, whether a client takes part), so f_i and n_i always
describe the same examples. The stopping test and residual balancing below
use the unweighted residuals.

The x-update is exact when a proximal operator `prox(v, rho, data, mask)` is
given (`fedjax_opt.core.prox.prox_least_squares`, `prox_quadratic` are closed
forms), otherwise it is inexact (`core.prox.prox_update`): K optax steps from
the client's previous x_i, step k on its batch k mod S, on f_i with the
augmented-Lagrangian gradient λ_i + ρ(x − z) added. Any
fixed point of the inexact iteration satisfies x_i = z, Σ_i λ_i = 0 and
∇f_i(z) + λ_i = 0, i.e. Σ_i ∇f_i(z) = 0: the exact optimum, however few inner
steps are taken.

Residuals and stopping (Boyd §3.3, stacked x = (x_1 … x_N), P parameters):

    ‖r‖ = sqrt(Σ_i ‖x_i − z‖²),          ‖s‖ = ρ √N ‖z^{k+1} − z^k‖,
    ε_pri  = √(NP) ε_abs + ε_rel max(sqrt(Σ_i ‖x_i‖²), √N ‖z‖),
    ε_dual = √(NP) ε_abs + ε_rel sqrt(Σ_i ‖λ_i‖²),
    converged = ‖r‖ ≤ ε_pri and ‖s‖ ≤ ε_dual.

Varying penalty by residual balancing (§3.4.1): ρ ← τρ when ‖r‖ > μ‖s‖,
ρ ← ρ/τ when ‖s‖ > μ‖r‖. The duals are stored unscaled, so the scaled dual
u = λ/ρ is rescaled (u ← u ρ_old/ρ_new) by construction.

Partial participation follows the library's rules (docs/architecture.md,
"The round"; the round is `core.rounds.client_round`): a client that takes
no part (not in the round, weight 0, no real example this round, or a
non-finite update) keeps x_i, λ_i and w_i at their last values, and its x̂_i
enters neither z nor its λ_i update; z averages the stored x_i + λ_i/ρ of
every client with the fresh x̂_i + λ_i/ρ of the round's clients. With full
participation this is exactly the iteration above.

Communication (`metrics["bits_up"]`, `metrics["bits_down"]`, float32, per
client). A client taking part receives z^k and sends one model-sized vector,
its term of the z-average, x̂_i + λ_i^k/ρ (Boyd's x_i + u_i), and applies its
dual update itself when z^{k+1} arrives (the code applies it in `step`, with
the same result). So bits_down = 32 P (the broadcast, P the model's
parameters in float32) and bits_up = 32 P per client taking part (0 in an
iteration no client took part in), as for FedAvg. Scalars (ρ, the client's
example count, its objective) are not counted. With every client in every
iteration z^{k+1} is the next broadcast; with partial participation a
client needs it once more at the end of its round, 32 P not counted here.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import per_client
from fedjax_opt.core import prox as prox_lib
from fedjax_opt.core.local import LocalResult, masked_mean_loss
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.tree import global_norm, tree_bits
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_key, check_loss_fn, check_num_clients,
                                        check_positive, is_concrete)

__all__ = ["ADMMConsensusState", "CONSENSUS_METRICS", "admm_consensus"]

CONSENSUS_METRICS = {
    "objective": jnp.float32,
    "primal_residual": jnp.float32,
    "dual_residual": jnp.float32,
    "eps_primal": jnp.float32,
    "eps_dual": jnp.float32,
    "converged": jnp.bool_,
    "rho": jnp.float32,
    "num_clients": jnp.int32,
    "num_nonfinite": jnp.int32,
    "bits_up": jnp.float32,
    "bits_down": jnp.float32,
}
"""`state.metrics` of `admm_consensus` after an iteration.

* objective: Σ_i w_i f_i(z^k) / Σ_i w_i over the clients that took part (w_i = 1 or n_i,
  the objective's weighting), at the z they received;
* primal_residual ‖r‖, dual_residual ‖s‖, and their tolerances ε_pri, ε_dual;
* converged: Boyd's stopping test ‖r‖ ≤ ε_pri and ‖s‖ ≤ ε_dual;
* rho: the penalty used in this iteration;
* num_clients: clients whose x_i, λ_i were updated;
* num_nonfinite: clients that took part but whose update was not finite (kept x_i, λ_i);
* bits_up: bits sent per client that took part, 32 P (x̂_i + λ_i/ρ; 0 when none took part);
* bits_down: bits each client received, 32 P (z).
"""


@flax.struct.dataclass
class ADMMConsensusState:
  """State of consensus ADMM.

  Attributes:
    params: z, the consensus (server) model.
    local_params: the x_i, a per-client table (leaves `[N, ...]`).
    duals: the unscaled duals λ_i, a per-client table (leaves `[N, ...]`).
    client_weights: w_i `[N]`, each client's weight in the z-average: 1 (objective="clients"),
      or its number of real examples when it last took part (objective="examples"; 0 before).
    rho: ρ, the current penalty (scalar; changes only with residual balancing).
    round: k, iterations applied, int32.
    key: PRNG key, carried for the `FederatedAlgorithm` contract (the iteration draws no randomness).
    metrics: `CONSENSUS_METRICS`.
  """

  params: PyTree
  local_params: PyTree
  duals: PyTree
  client_weights: jax.Array
  rho: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _check_above_one(value: Any, name: str) -> None:
  if is_concrete(value) and not np.all(np.asarray(value) > 1):
    raise ValueError(f"{name} must be > 1; got {value}.")


def _broadcast_rows(row_tree: PyTree, like_table: PyTree) -> PyTree:
  return jax.tree.map(lambda r, t: jnp.broadcast_to(r, t.shape), row_tree, like_table)


def admm_consensus(
    loss_fn: LossFn,
    rho: Any,
    *,
    num_clients: int,
    prox: prox_lib.ProxFn | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    local_steps: int | None = None,
    relaxation: Any = 1.0,
    residual_balancing: bool = False,
    balancing_mu: float = 10.0,
    balancing_tau: float = 2.0,
    abs_tol: float = 1e-6,
    rel_tol: float = 1e-4,
    objective: str = "clients",
) -> FederatedAlgorithm:
  """Global-variable consensus ADMM (Boyd et al. 2011, §7.1), one iteration per round.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`; f_i is its mean
      over client i's real examples of the round (include any regulariser per
      example). Used for the inexact x-update and the `objective` metric.
    rho: ρ > 0, the penalty (may be traced, e.g. `jax.vmap` over ρ).
    num_clients: N, the total number of clients (rows of the x_i, λ_i tables);
      z averages over all N.
    prox: exact x-update `prox(v, rho, data, mask) = argmin_x f_i(x) + (ρ/2)‖x − v‖²`
      (`fo.algorithms.prox_least_squares`, `prox_quadratic`). None: inexact x-update.
    client_optimizer: any optax optimizer of the inexact x-update (required
      when `prox` is None): K steps from the previous x_i on
      f_i + ⟨λ_i, x − z⟩ + (ρ/2)‖x − z‖², re-initialized every round.
    local_steps: K; step k uses the client's batch k mod S. None: K = S (one
      pass over the round's batches). Ignored with `prox`.
    relaxation: α ∈ (0, 2), over-relaxation (§3.4.3; 1: plain ADMM; may be traced).
    residual_balancing: vary ρ by residual balancing (§3.4.1).
    balancing_mu, balancing_tau: μ > 1 and τ > 1 of residual balancing.
    abs_tol, rel_tol: ε_abs, ε_rel of the stopping test (`metrics["converged"]`).
    objective: "clients" (Σ_i f_i, every client one vote) or "examples"
      (Σ_i n_i f_i / n, the pooled empirical risk, n_i = the client's real
      examples of the round); see the module docstring.

  Returns:
    `FederatedAlgorithm(init, step)` with state `ADMMConsensusState`.

  Raises:
    TypeError: `num_clients` or `local_steps` not a Python int, `prox` not
      callable, `client_optimizer` not an optax optimizer.
    ValueError: ρ <= 0, α outside (0, 2), μ or τ <= 1, neither `prox` nor
      `client_optimizer` given, `local_steps` < 1, or an unknown `objective`.
  """
  check_loss_fn(loss_fn)
  prox_lib.check_rho(rho)
  prox_lib.check_relaxation(relaxation)
  _check_above_one(balancing_mu, "balancing_mu (μ)")
  _check_above_one(balancing_tau, "balancing_tau (τ)")
  check_positive(abs_tol, "abs_tol", allow_zero=True)
  check_positive(rel_tol, "rel_tol", allow_zero=True)
  num_clients = check_num_clients(num_clients)
  prox_lib.check_solver("admm_consensus", prox, client_optimizer, local_steps)
  by_examples = prox_lib.check_objective(objective) == "examples"
  mode = client_map_lib.FromPolicy()

  def client_update(shared, data, mask, x_i, lam_i):
    z, rho_k = shared
    new_x = prox_lib.prox_update(loss_fn, prox, client_optimizer, local_steps, z, rho_k, x_i, data, mask,
                                 dual=lam_i, full_batch=False)
    x_hat = jax.tree.map(lambda x, zz: relaxation * x + (1 - relaxation) * zz, new_x, z)
    objective, count = masked_mean_loss(loss_fn, z, *prox_lib.client_examples(data, mask))
    # A client with no real example this round takes no part (the rule of core.rounds).
    result = LocalResult(delta=jax.tree.map(jnp.subtract, new_x, x_i), loss=objective, num_examples=count,
                         num_steps=(count > 0).astype(jnp.int32))
    # λ_i is rewritten by the server once z^{k+1} is known: the client hands its row back unchanged.
    weight = count.astype(objective.dtype) if by_examples else jnp.ones((), objective.dtype)
    return ClientOutput(result, rows=(new_x, lam_i), extras=(objective, x_hat, lam_i, weight))

  def init(params: PyTree, key: jax.Array) -> ADMMConsensusState:
    check_key(key)
    dtype = jnp.result_type(*jax.tree.leaves(params))
    return ADMMConsensusState(
        params=params,
        local_params=per_client.broadcast(params, num_clients),
        duals=per_client.init(params, num_clients),
        client_weights=jnp.full((num_clients,), 0 if by_examples else 1, dtype),
        rho=jnp.asarray(rho, dtype),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={name: jnp.zeros((), dt) for name, dt in CONSENSUS_METRICS.items()},
    )

  def step(state: ADMMConsensusState, batches: ClientBatches) -> ADMMConsensusState:
    check_client_batches(batches)
    z, rho_k, ids = state.params, state.rho, batches.client_id
    clients = client_round(mode, client_update, (z, rho_k), batches, tables=(state.local_params, state.duals))
    objective, x_hat, lam_i, weight = clients.extras
    write = clients.write

    # z^{k+1} = Σ_i w_i (x̂_i + λ_i/ρ) / Σ_i w_i: stored rows for absent clients, fresh rows for the round's.
    stored_terms = jax.tree.map(lambda x, l: x + l / rho_k, state.local_params, state.duals)
    fresh_terms = jax.tree.map(lambda x, l: x + l / rho_k, x_hat, lam_i)
    terms = per_client.scatter(stored_terms, ids, fresh_terms, write).table
    client_weights = per_client.scatter(state.client_weights, ids, weight, write).table
    if by_examples:
      total = jnp.sum(client_weights)
      new_z = jax.tree.map(
          lambda t, zz: jnp.where(total > 0, jnp.tensordot(client_weights, t, axes=1) / jnp.maximum(total, 1),
                                  zz).astype(zz.dtype), terms, z)
    else:  # the plain mean, (1/N) Σ_i
      new_z = jax.tree.map(lambda t, zz: jnp.mean(t, axis=0).astype(zz.dtype), terms, z)

    new_lam = jax.tree.map(lambda l, xh, zz: l + rho_k * (xh - zz), lam_i, x_hat, new_z)
    local_params = clients.stored[0].table
    duals = per_client.scatter(state.duals, ids, new_lam, write).table

    primal = global_norm(jax.tree.map(jnp.subtract, local_params, _broadcast_rows(new_z, local_params)))
    dual = rho_k * np.sqrt(num_clients) * global_norm(jax.tree.map(jnp.subtract, new_z, z))
    size = sum(int(np.prod(jnp.shape(p))) for p in jax.tree.leaves(z)) * num_clients
    eps_primal = np.sqrt(size) * abs_tol + rel_tol * jnp.maximum(global_norm(local_params),
                                                                 np.sqrt(num_clients) * global_norm(new_z))
    eps_dual = np.sqrt(size) * abs_tol + rel_tol * global_norm(duals)
    if residual_balancing:
      next_rho = jnp.where(primal > balancing_mu * dual, rho_k * balancing_tau,
                           jnp.where(dual > balancing_mu * primal, rho_k / balancing_tau, rho_k))
    else:
      next_rho = rho_k
    metric_weight = jnp.where(write, weight, 0)
    message = float(tree_bits(z))  # one model-sized vector each way (module docstring)
    values = {
        "objective": jnp.sum(jnp.where(write, weight * objective, 0)) / jnp.maximum(jnp.sum(metric_weight), 1),
        "primal_residual": primal,
        "dual_residual": dual,
        "eps_primal": eps_primal,
        "eps_dual": eps_dual,
        "converged": (primal <= eps_primal) & (dual <= eps_dual),
        "rho": rho_k,
        "num_clients": jnp.sum(clients.stored[0].written, dtype=jnp.int32),
        "num_nonfinite": clients.agg.num_nonfinite,
        "bits_up": jnp.where(jnp.any(clients.weights > 0), message, 0.0),
        "bits_down": message,
    }
    return ADMMConsensusState(
        params=new_z,
        local_params=local_params,
        duals=duals,
        client_weights=client_weights,
        rho=next_rho.astype(state.rho.dtype),
        round=state.round + 1,
        key=state.key,
        metrics={name: jnp.asarray(values[name]).astype(dt) for name, dt in CONSENSUS_METRICS.items()},
    )

  return FederatedAlgorithm(init, step)


admm_consensus = execution.accepts_policy_keywords(admm_consensus, refuses_aggregator=(
    "consensus ADMM's z-update is the exact minimiser of its augmented Lagrangian, the weighted mean of the "
    "x̂_i + λ_i/ρ, and its duals move by x̂_i − z; another rule breaks Σ_i w_i λ_i = 0 and with it the fixed "
    "point"),
    evaluation="global", exchanges=(1, 1), hyperparameters={"rho": execution.PENALTY,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "local_steps": execution.COUNT,
        "relaxation": execution.MIXING_WEIGHT, "balancing_mu": execution.THRESHOLD, "balancing_tau": execution.SCALE,
        "abs_tol": execution.THRESHOLD, "rel_tol": execution.THRESHOLD})
