"""ADMM for federated learning: global-variable consensus and sharing (vertical FL).

Boyd, Parikh, Chu, Peleato, Eckstein. "Distributed Optimization and
Statistical Learning via the Alternating Direction Method of Multipliers."
Foundations and Trends in Machine Learning 3(1), 2011. §3.3–3.4 (stopping
criterion, over-relaxation, varying penalty), §7.1 (consensus), §7.3 (sharing).

Consensus (`admm_consensus`, horizontal FL). N clients, client i's objective
f_i(x) = mean loss over its real examples of the round:

    minimize (1/N) Σ_i f_i(x_i)   subject to   x_i = z,  i = 1 … N.

One `step` is one ADMM iteration k (one communication round), with duals λ_i
(unscaled; the scaled dual is u_i = λ_i / ρ):

    client:  x_i^{k+1} = argmin_x f_i(x) + ⟨λ_i^k, x − z^k⟩ + (ρ/2)‖x − z^k‖²
                       = prox_{f_i/ρ}(z^k − λ_i^k / ρ)
             x̂_i = α x_i^{k+1} + (1 − α) z^k                      (over-relaxation, α ∈ (0, 2))
    server:  z^{k+1} = (1/N) Σ_i (x̂_i + λ_i^k / ρ)
    client:  λ_i^{k+1} = λ_i^k + ρ (x̂_i − z^{k+1})

The x-update is exact when a proximal operator `prox(v, rho, data, mask)` is
given (`prox_least_squares`, `prox_quadratic` are closed forms), otherwise it
is inexact: K optax steps from the client's previous x_i on f_i with the
augmented-Lagrangian gradient λ_i + ρ(x − z) added (`core.local.local_train`'s
`gradient_correction`). Any fixed point of the inexact iteration satisfies
x_i = z, Σ_i λ_i = 0 and ∇f_i(z) + λ_i = 0, i.e. Σ_i ∇f_i(z) = 0: the exact
optimum, however few inner steps are taken.

Residuals and stopping (Boyd §3.3, stacked x = (x_1 … x_N), P parameters):

    ‖r‖ = sqrt(Σ_i ‖x_i − z‖²),          ‖s‖ = ρ √N ‖z^{k+1} − z^k‖,
    ε_pri  = √(NP) ε_abs + ε_rel max(sqrt(Σ_i ‖x_i‖²), √N ‖z‖),
    ε_dual = √(NP) ε_abs + ε_rel sqrt(Σ_i ‖λ_i‖²),
    converged = ‖r‖ ≤ ε_pri and ‖s‖ ≤ ε_dual.

Varying penalty by residual balancing (§3.4.1): ρ ← τρ when ‖r‖ > μ‖s‖,
ρ ← ρ/τ when ‖s‖ > μ‖r‖. The duals are stored unscaled, so the scaled dual
u = λ/ρ is rescaled (u ← u ρ_old/ρ_new) by construction.

Partial participation: clients not in the round (or with weight 0, or with a
non-finite x_i) keep x_i and λ_i; z averages the stored x_i + λ_i/ρ of every
client with the fresh x̂_i + λ_i/ρ of the round's clients. With full
participation this is exactly the iteration above.

Sharing (`admm_sharing`, vertical FL of linear models, §7.3 and §8.3). The
m samples' features are split by column over the N clients, A = (A_1 … A_N),
and, with ℓ the data loss of the m predictions w = Σ_i A_i x_i,

    minimize ℓ(Σ_i A_i x_i) + Σ_i (λ₁ ‖x_i‖₁ + (λ₂/2) ‖x_i‖²),
    squared:  ℓ(w) = (1/(2m)) ‖w − b‖²,
    logistic: ℓ(w) = (1/m) Σ_j [log(1 + e^{w_j}) − b_j w_j],   labels b_j ∈ {0, 1}.

Sharing form: copies z_i = A_i x_i `[m]`, minimize Σ_i r_i(x_i) + ℓ(Σ_i z_i)
s.t. A_i x_i − z_i = 0, scaled dual u. Over-relaxation (§3.4.3) replaces
A_i x_i^{k+1} by h_i = α A_i x_i^{k+1} + (1 − α) z_i^k in the z- and u-updates.
The z-update decouples as in §7.3: with h̄ = (1/N) Σ_i h_i, the mean
\\bar{z} = (1/N) Σ_i z_i solves a problem in \\bar{z} alone, z_i = h_i + \\bar{z} − h̄,
and every u_i equals one u. One iteration:

    client:  x_i^{k+1} = argmin_x λ₁‖x‖₁ + (λ₂/2)‖x‖² + (ρ/2)‖A_i x − z_i^k + u^k‖²
             h_i = α A_i x_i^{k+1} + (1 − α) z_i^k
    server:  \\bar{z}^{k+1} = argmin_t ℓ(N t) + (Nρ/2)‖t − u^k − h̄‖²
             u^{k+1} = u^k + h̄ − \\bar{z}^{k+1},    z_i^{k+1} = h_i + \\bar{z}^{k+1} − h̄.

With α = 1, z_i^k = A_i x_i^k + \\bar{z}^k − \\bar{Ax}^k (Boyd's form: the client
target is A_i x_i^k + \\bar{z}^k − \\bar{Ax}^k − u^k). The state keeps the
offsets d_i = z_i − A_i x_i `[N, m]` (0 at init, the same for every client when
α = 1), so clients send only A_i x_i (and h_i when α ≠ 1) `[m]`.

The \\bar{z}-update is separable over the samples. Squared loss, closed form:
\\bar{z} = (b + mρ v)/(N + mρ), v = u + h̄. Logistic loss, one scalar equation
per real sample j (padding samples: \\bar{z}_j = v_j), the stationarity of
(1/m) ℓ_j(N t) + (Nρ/2)(t − v_j)²:

    φ_j(t) = (σ(N t) − b_j)/m + ρ (t − v_j) = 0,     φ_j'(t) = N σ'(N t)/m + ρ > 0.

Since |σ − b_j| ≤ 1, the root lies in [v_j − 1/(mρ), v_j + 1/(mρ)]: `newton_steps`
safeguarded Newton steps (bisection whenever a Newton step leaves the current
bracket), vectorised over the samples and warm-started from the previous
\\bar{z}, solve it to machine precision near convergence.

The client's problem is solved inexactly by `inner_steps` proximal-gradient
(ISTA) steps from x_i^k with step 1/L, L = ρ‖A_i‖₂² + λ₂; ISTA's fixed point is
the exact minimiser, so the iteration's fixed point is the exact lasso /
ridge / elastic-net (or ℓ1/ℓ2-regularised logistic regression) solution.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import prox as prox_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.local import as_single_step, cycle_steps, local_train, masked_mean_loss
from fedjax_opt.core.server import client_is_finite
from fedjax_opt.core.tree import global_norm
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_client_batches, check_key, check_loss_fn, check_positive, is_concrete

__all__ = [
    "ADMMConsensusState", "ADMMSharingState", "admm_consensus", "admm_sharing", "prox_least_squares",
    "prox_quadratic",
]

ProxFn = prox_lib.ProxFn
"""`prox(v, rho, data, mask) -> argmin_x f_i(x) + (ρ/2)‖x − v‖²` on one client's data `[S, B, ...]`, mask `[S, B]`."""

CONSENSUS_METRICS = {
    "objective": jnp.float32,
    "primal_residual": jnp.float32,
    "dual_residual": jnp.float32,
    "eps_primal": jnp.float32,
    "eps_dual": jnp.float32,
    "converged": jnp.bool_,
    "rho": jnp.float32,
    "num_clients": jnp.int32,
}
"""`state.metrics` of `admm_consensus` after an iteration.

* objective: (1/C) Σ_i f_i(z^k) over the round's C clients, at the z they received;
* primal_residual ‖r‖, dual_residual ‖s‖, and their tolerances ε_pri, ε_dual;
* converged: Boyd's stopping test ‖r‖ ≤ ε_pri and ‖s‖ ≤ ε_dual;
* rho: the penalty used in this iteration;
* num_clients: clients whose x_i, λ_i were updated.
"""


# ----------------------------------------------------------------------------- checks


def _check_rho(rho: Any) -> None:
  if rho is None:
    raise ValueError("rho (ρ, the ADMM penalty) must be given and > 0.")
  check_positive(rho, "rho (ρ, the ADMM penalty)")


def _check_relaxation(relaxation: Any) -> None:
  if not is_concrete(relaxation):
    return
  a = np.asarray(relaxation)
  if not (np.all(np.isfinite(a)) and np.all(a > 0) and np.all(a < 2)):
    raise ValueError(f"relaxation (α, over-relaxation) must lie in the open interval (0, 2); got {relaxation}.")


def _check_above_one(value: Any, name: str) -> None:
  if is_concrete(value) and not np.all(np.asarray(value) > 1):
    raise ValueError(f"{name} must be > 1; got {value}.")


# ----------------------------------------------------------------------------- proximal operators


def _flat_client_data(data: PyTree, mask: jax.Array) -> tuple[PyTree, jax.Array]:
  """A client's `[S, B, ...]` batches as one batch of S·B examples, `[S·B, ...]`, mask `[S·B]`."""
  folded, folded_mask = as_single_step(data, mask)
  return jax.tree.map(lambda a: a[0], folded), folded_mask[0]


def prox_least_squares(l2: Any = 0.0, *, features: str = "x", targets: str = "y") -> ProxFn:
  """Closed-form prox of (regularized) least squares for params `{"w": [d], "b": []}`.

  With A = [X, 1] `[n, d+1]` the client's real examples (rows of padding
  dropped through the mask M), θ = (w, b) and f_i(θ) = (1/n) Σ ½(aᵀθ − y)²
  + (λ₂/2)‖w‖² (the intercept is not penalised), the prox solves

      (AᵀMA / n + λ₂ D + ρ I) θ = AᵀMy / n + ρ v,     D = diag(1, …, 1, 0).

  Args:
    l2: λ₂ >= 0, the ridge penalty inside each f_i (may be traced).
    features, targets: keys of `data` holding X `[S, B, d]` and y `[S, B]`.

  Returns:
    `prox(v, rho, data, mask) -> {"w", "b"}`.
  """
  check_positive(l2, "l2", allow_zero=True)

  def prox(v, rho, data, mask):
    batch, m = _flat_client_data(data, mask)
    x, y = batch[features], batch[targets]
    a = jnp.concatenate([x, jnp.ones(x.shape[:1] + (1,), x.dtype)], axis=1)
    mf = m.astype(a.dtype)
    n = jnp.maximum(jnp.sum(mf), 1)
    d = x.shape[1]
    penalty = jnp.concatenate([jnp.full((d,), l2, a.dtype), jnp.zeros((1,), a.dtype)])
    lhs = (a.T * mf) @ a / n + jnp.diag(penalty + rho)
    theta_v = jnp.concatenate([v["w"], jnp.reshape(v["b"], (1,))])
    rhs = (a.T * mf) @ y.astype(a.dtype) / n + rho * theta_v
    theta = jnp.linalg.solve(lhs, rhs)
    return {"w": theta[:d].astype(v["w"].dtype), "b": theta[d].astype(jnp.result_type(v["b"]))}

  return prox


def prox_quadratic(loss_fn: LossFn) -> ProxFn:
  """Exact prox for any `loss_fn` that is quadratic in the params (least squares, ridge, any pytree).

  For quadratic f_i one Newton step from v is exact:
  prox_{f_i/ρ}(v) = v − (∇²f_i + ρI)⁻¹ ∇f_i(v), with the gradient and the
  `[P, P]` Hessian of the client's masked mean loss taken by autodiff on the
  flattened params. For a non-quadratic loss it is one damped Newton step.
  """
  check_loss_fn(loss_fn)

  def prox(v, rho, data, mask):
    batch, m = _flat_client_data(data, mask)
    flat_v, unravel = ravel_pytree(v)

    def f(theta):
      return masked_mean_loss(loss_fn, unravel(theta), batch, m)[0]

    g, h = jax.grad(f)(flat_v), jax.hessian(f)(flat_v)
    return unravel(flat_v - jnp.linalg.solve(h + rho * jnp.eye(flat_v.size, dtype=h.dtype), g))

  return prox


# ----------------------------------------------------------------------------- consensus


@flax.struct.dataclass
class ADMMConsensusState:
  """State of consensus ADMM.

  Attributes:
    params: z, the consensus (server) model.
    local_params: the x_i, a per-client table (leaves `[N, ...]`).
    duals: the unscaled duals λ_i, a per-client table (leaves `[N, ...]`).
    rho: ρ, the current penalty (scalar; changes only with residual balancing).
    round: k, iterations applied, int32.
    key: PRNG key (unused by the deterministic iteration; carried for the contract).
    metrics: `CONSENSUS_METRICS`.
  """

  params: PyTree
  local_params: PyTree
  duals: PyTree
  rho: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _broadcast_rows(row_tree: PyTree, like_table: PyTree) -> PyTree:
  return jax.tree.map(lambda r, t: jnp.broadcast_to(r, t.shape), row_tree, like_table)


def admm_consensus(
    loss_fn: LossFn,
    rho: Any,
    *,
    num_clients: int,
    prox: ProxFn | None = None,
    local_optimizer: optax.GradientTransformation | None = None,
    local_steps: int | None = None,
    relaxation: Any = 1.0,
    residual_balancing: bool = False,
    balancing_mu: float = 10.0,
    balancing_tau: float = 2.0,
    abs_tol: float = 1e-6,
    rel_tol: float = 1e-4,
    client_map: client_map_lib.ClientMap | str | None = None,
    unroll: int | bool = 1,
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
      (`prox_least_squares`, `prox_quadratic`). None: inexact x-update.
    local_optimizer: optax optimizer of the inexact x-update (required when
      `prox` is None): K steps from the previous x_i on f_i + ⟨λ_i, x − z⟩ + (ρ/2)‖x − z‖².
    local_steps: K; step k uses the client's batch k mod S. None: K = S (one
      pass over the round's batches). Ignored with `prox`.
    relaxation: α ∈ (0, 2), over-relaxation (1: plain ADMM; may be traced).
    residual_balancing: vary ρ by residual balancing (§3.4.1).
    balancing_mu, balancing_tau: μ > 1 and τ > 1 of residual balancing.
    abs_tol, rel_tol: ε_abs, ε_rel of the stopping test (`metrics["converged"]`).
    client_map: how clients are mapped (see `fedjax_opt.core.client_map`).
    unroll: `lax.scan` unroll of the inexact local steps.

  Returns:
    `FederatedAlgorithm(init, step)` with state `ADMMConsensusState`.

  Raises:
    ValueError: ρ <= 0, α outside (0, 2), μ or τ <= 1, neither `prox` nor
      `local_optimizer` given, or `local_steps` < 1.
  """
  check_loss_fn(loss_fn)
  _check_rho(rho)
  _check_relaxation(relaxation)
  _check_above_one(balancing_mu, "balancing_mu (μ)")
  _check_above_one(balancing_tau, "balancing_tau (τ)")
  check_positive(abs_tol, "abs_tol", allow_zero=True)
  check_positive(rel_tol, "rel_tol", allow_zero=True)
  num_clients = per_client.check_num_clients(num_clients)
  prox_lib.check_solver("admm_consensus", prox, local_optimizer, local_steps)
  mode = client_map_lib.resolve(client_map)

  def x_update(z, rho_k, data, mask, x_i, lam_i):
    if prox is not None:
      v = jax.tree.map(lambda zz, l: zz - l / rho_k, z, lam_i)
      return prox(v, rho_k, data, mask)
    steps = mask.shape[0] if local_steps is None else local_steps
    cycled_data, cycled_mask = cycle_steps(data, mask, steps)

    def augmented_lagrangian_gradient(x):
      return jax.tree.map(lambda xx, zz, l: l + rho_k * (xx - zz), x, z, lam_i)

    result = local_train(loss_fn, local_optimizer, x_i, cycled_data, cycled_mask,
                         gradient_correction=augmented_lagrangian_gradient, unroll=unroll)
    return jax.tree.map(jnp.add, x_i, result.delta)

  def client_update(shared, client):
    z, rho_k = shared
    data, mask, x_i, lam_i = client
    new_x = x_update(z, rho_k, data, mask, x_i, lam_i)
    new_x = jax.tree.map(lambda n, o: n.astype(o.dtype), new_x, x_i)
    batch, m = _flat_client_data(data, mask)
    objective, _ = masked_mean_loss(loss_fn, z, batch, m)
    return new_x, objective

  def init(params: PyTree, key: jax.Array) -> ADMMConsensusState:
    check_key(key)
    dtype = jnp.result_type(*jax.tree.leaves(params))
    table = per_client.init(params, num_clients)
    return ADMMConsensusState(
        params=params,
        local_params=jax.tree.map(lambda t, p: t + p, table, params),
        duals=table,
        rho=jnp.asarray(rho, dtype),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={name: jnp.zeros((), dt) for name, dt in CONSENSUS_METRICS.items()},
    )

  def step(state: ADMMConsensusState, batches: ClientBatches) -> ADMMConsensusState:
    check_client_batches(batches)
    z, rho_k, ids = state.params, state.rho, batches.client_id
    x_i = per_client.gather(state.local_params, ids)
    lam_i = per_client.gather(state.duals, ids)
    new_x, objective = client_map_lib.map_clients(
        mode, client_update, (z, rho_k), (batches.data, batches.mask, x_i, lam_i))
    write = (batches.weight > 0) & client_is_finite(new_x)
    x_hat = jax.tree.map(lambda x, zz: relaxation * x + (1 - relaxation) * zz, new_x, z)

    # z^{k+1} = (1/N) Σ_i (x̂_i + λ_i/ρ): stored rows for absent clients, fresh rows for the round's.
    stored_terms = jax.tree.map(lambda x, l: x + l / rho_k, state.local_params, state.duals)
    fresh_terms = jax.tree.map(lambda x, l: x + l / rho_k, x_hat, lam_i)
    terms = per_client.scatter(stored_terms, ids, fresh_terms, write)
    new_z = jax.tree.map(lambda t, zz: jnp.mean(t, axis=0).astype(zz.dtype), terms.table, z)

    new_lam = jax.tree.map(lambda l, xh, zz: l + rho_k * (xh - zz), lam_i, x_hat, new_z)
    local_params = per_client.scatter(state.local_params, ids, new_x, write).table
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
    num_written = jnp.sum(terms.written, dtype=jnp.int32)
    mean_objective = jnp.sum(jnp.where(write, objective, 0)) / jnp.maximum(jnp.sum(write), 1)
    values = {
        "objective": mean_objective,
        "primal_residual": primal,
        "dual_residual": dual,
        "eps_primal": eps_primal,
        "eps_dual": eps_dual,
        "converged": (primal <= eps_primal) & (dual <= eps_dual),
        "rho": rho_k,
        "num_clients": num_written,
    }
    return ADMMConsensusState(
        params=new_z,
        local_params=local_params,
        duals=duals,
        rho=next_rho.astype(state.rho.dtype),
        round=state.round + 1,
        key=state.key,
        metrics={name: jnp.asarray(values[name]).astype(dt) for name, dt in CONSENSUS_METRICS.items()},
    )

  return FederatedAlgorithm(init, step)


# ----------------------------------------------------------------------------- sharing

SHARING_METRICS = {
    "objective": jnp.float32,
    "primal_residual": jnp.float32,
    "dual_residual": jnp.float32,
}
"""`state.metrics` of `admm_sharing`: the objective at the new x, ‖r‖ = √N ‖h̄ − \\bar{z}‖
(h̄ = \\bar{Ax} when α = 1) and ‖s‖ = ρ √N ‖\\bar{z}^{k+1} − \\bar{z}^k‖."""

SHARING_LOSSES = ("squared", "logistic")
"""The data losses of `admm_sharing` (see the module docstring)."""


@flax.struct.dataclass
class ADMMSharingState:
  """State of sharing ADMM (vertical FL of a linear model).

  Attributes:
    params: the coefficient blocks x_i, `[N, d_max]` (a client's padding columns stay 0).
    z_bar: \\bar{z}, `[m]`, the server's average-prediction variable.
    scaled_dual: u, `[m]`, the scaled dual.
    mean_prediction: \\bar{Ax} = (1/N) Σ_i A_i x_i, `[m]`, from the last iteration.
    share_offsets: d_i = z_i − A_i x_i, `[N, m]`: each client's copy z_i of its
      share minus its share (every row = \\bar{z} − \\bar{Ax} when α = 1).
    round: k, iterations applied, int32.
    key: PRNG key (unused; carried for the contract).
    metrics: `SHARING_METRICS`.
  """

  params: jax.Array
  z_bar: jax.Array
  scaled_dual: jax.Array
  mean_prediction: jax.Array
  share_offsets: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _soft_threshold(v: jax.Array, t: jax.Array) -> jax.Array:
  return jnp.sign(v) * jnp.maximum(jnp.abs(v) - t, 0)


def _logistic_z_update(v: jax.Array, labels: jax.Array, real: jax.Array, n: int, m: jax.Array, rho: jax.Array,
                       start: jax.Array, steps: int) -> jax.Array:
  """Solves (σ(N t_j) − b_j)/m + ρ(t_j − v_j) = 0 per real sample (t_j = v_j on padding), `[m_max]`.

  Safeguarded Newton: the root is bracketed by v ± 1/(mρ); a Newton step that
  leaves the current bracket is replaced by its midpoint.
  """
  width = 1 / (m * rho)
  lo, hi = v - width, v + width
  t = jnp.clip(start, lo, hi)

  def newton(carry, _):
    t, lo, hi = carry
    sig = jax.nn.sigmoid(n * t)
    phi = jnp.where(real, (sig - labels) / m, 0) + rho * (t - v)
    slope = jnp.where(real, n * sig * (1 - sig) / m, 0) + rho
    lo, hi = jnp.where(phi <= 0, t, lo), jnp.where(phi >= 0, t, hi)
    candidate = t - phi / slope
    inside = (candidate >= lo) & (candidate <= hi)
    return (jnp.where(inside, candidate, 0.5 * (lo + hi)), lo, hi), None

  (t, _, _), _ = jax.lax.scan(newton, (t, lo, hi), None, length=steps)
  return t


def _check_binary_labels(labels: jax.Array, real: jax.Array, name: str) -> None:
  if not (is_concrete(labels) and is_concrete(real)):
    return
  values = np.asarray(labels)[np.asarray(real)]
  bad = values[(values != 0) & (values != 1)]
  if bad.size:
    raise ValueError(f"loss='logistic' needs labels in {{0, 1}} in {name} on the real samples; got {float(bad[0])} "
                     f"(map -1/+1 labels to 0/1 with (b + 1) / 2).")


def admm_sharing(
    rho: Any,
    *,
    num_samples: int,
    l1: Any = 0.0,
    l2: Any = 0.0,
    inner_steps: int = 20,
    loss: str = "squared",
    newton_steps: int = 10,
    relaxation: Any = 1.0,
    features: str = "x",
    targets: str = "y",
    client_map: client_map_lib.ClientMap | str | None = None,
) -> FederatedAlgorithm:
  """Sharing ADMM (Boyd et al. 2011, §7.3) for features split by column: lasso / ridge / elastic net / logistic.

  Minimises ℓ(Σ_i A_i x_i) + Σ_i (λ₁‖x_i‖₁ + (λ₂/2)‖x_i‖²) with
  ℓ(w) = (1/(2m))‖w − b‖² (`loss="squared"`; λ₂ = 0 is scikit-learn's
  `Lasso(alpha=λ₁, fit_intercept=False)`, λ₁ = 0 is `Ridge(alpha=m λ₂,
  fit_intercept=False)`) or ℓ(w) = (1/m) Σ_j [log(1 + e^{w_j}) − b_j w_j] with
  b_j ∈ {0, 1} (`loss="logistic"`; λ₁ = 0, λ₂ = 1/(Cm) is scikit-learn's
  `LogisticRegression(C=C, fit_intercept=False)`, and λ₂ = 0, λ₁ = 1/(Cm) its
  `penalty="l1"`). No intercept: add a column of ones to one client's block.

  `step(state, batches)` takes every client every round (vertical FL): batch
  row c holds client c's feature block A_c as `data[features]` `[N, 1, m, d_max]`
  (unused columns zero), the same m samples in the same order for every client;
  `mask` `[N, 1, m]` marks the real samples; the labels b are read from client
  0's `data[targets]` `[m]` (the label holder). `weight` is ignored.

  Args:
    rho: ρ > 0 (may be traced).
    num_samples: m_max, the static sample axis (the batch size B).
    l1, l2: λ₁ >= 0, λ₂ >= 0 (may be traced).
    inner_steps: proximal-gradient steps of each client's x-update.
    loss: "squared" (closed-form z-update) or "logistic" (labels in {0, 1},
      checked when concrete; z-update by safeguarded Newton).
    newton_steps: Newton steps per logistic z-update (warm-started).
    relaxation: α ∈ (0, 2), over-relaxation (§3.4.3; 1: plain ADMM; may be traced).
    features, targets: keys of `batches.data`.
    client_map: how clients are mapped (see `fedjax_opt.core.client_map`).

  Returns:
    `FederatedAlgorithm(init, step)`; `init(params [N, d_max], key)`.

  Raises:
    ValueError: ρ <= 0, λ₁ or λ₂ < 0, α outside (0, 2), unknown `loss`,
      `inner_steps` or `newton_steps` < 1; at `step`, mis-shaped features or
      (logistic, concrete) labels outside {0, 1}.
  """
  _check_rho(rho)
  check_positive(l1, "l1", allow_zero=True)
  check_positive(l2, "l2", allow_zero=True)
  _check_relaxation(relaxation)
  if loss not in SHARING_LOSSES:
    raise ValueError(f"loss must be one of {SHARING_LOSSES}; got {loss!r}.")
  for name, value in (("inner_steps", inner_steps), ("newton_steps", newton_steps)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int; got {value!r}.")
  m_max = per_client.check_num_clients(num_samples, "num_samples")
  mode = client_map_lib.resolve(client_map)

  def client_update(shared, client):
    u, rho_k = shared
    a, row_mask, x, offset = client
    a = jnp.where(row_mask[:, None], a, 0)
    share = a @ x + offset  # z_i^k
    target = share - u
    lipschitz = rho_k * jnp.square(jnp.linalg.norm(a, 2)) + l2
    step_size = 1 / jnp.maximum(lipschitz, jnp.finfo(a.dtype).tiny)

    def ista(xk, _):
      grad = rho_k * a.T @ (a @ xk - target) + l2 * xk
      return _soft_threshold(xk - step_size * grad, step_size * l1), None

    new_x, _ = jax.lax.scan(ista, x, None, length=inner_steps)
    prediction = a @ new_x
    return new_x, prediction, relaxation * prediction + (1 - relaxation) * share

  def init(params: jax.Array, key: jax.Array) -> ADMMSharingState:
    check_key(key)
    if jnp.ndim(params) != 2:
      raise ValueError(f"params must be the coefficient blocks [N, d_max]; got shape {tuple(jnp.shape(params))}.")
    dtype = jnp.result_type(params)
    zeros = jnp.zeros((m_max,), dtype)
    return ADMMSharingState(params=params, z_bar=zeros, scaled_dual=zeros, mean_prediction=zeros,
                            share_offsets=jnp.zeros((jnp.shape(params)[0], m_max), dtype),
                            round=jnp.zeros((), jnp.int32), key=key,
                            metrics={name: jnp.zeros((), dt) for name, dt in SHARING_METRICS.items()})

  def step(state: ADMMSharingState, batches: ClientBatches) -> ADMMSharingState:
    check_client_batches(batches)
    n, d = state.params.shape
    a = batches.data[features][:, 0]
    if a.shape != (n, m_max, d):
      raise ValueError(f"batches.data[{features!r}] must be [N, 1, m, d_max] = ({n}, 1, {m_max}, {d}); "
                       f"got {tuple(batches.data[features].shape)}.")
    row_mask = batches.mask[:, 0]
    real = row_mask[0]
    labels = batches.data[targets][0, 0]
    if loss == "logistic":
      _check_binary_labels(labels, real, f"batches.data[{targets!r}][0, 0]")
    b = jnp.where(real, labels, 0).astype(state.params.dtype)
    m = jnp.maximum(jnp.sum(real, dtype=b.dtype), 1)
    rho_k = jnp.asarray(rho, b.dtype)
    x = per_client.gather(state.params, batches.client_id)
    offsets = per_client.gather(state.share_offsets, batches.client_id)
    new_x, predictions, relaxed = client_map_lib.map_clients(mode, client_update, (state.scaled_dual, rho_k),
                                                             (a, row_mask, x, offsets))
    mean_prediction = jnp.mean(predictions, axis=0)
    mean_relaxed = jnp.mean(relaxed, axis=0)
    v = state.scaled_dual + mean_relaxed
    if loss == "squared":
      z_bar = (b + m * rho_k * v) / (n + m * rho_k)
    else:
      z_bar = _logistic_z_update(v, b, real, n, m, rho_k, state.z_bar, newton_steps)
    scaled_dual = state.scaled_dual + mean_relaxed - z_bar
    new_offsets = relaxed + (z_bar - mean_relaxed) - predictions
    every = jnp.ones((n,), bool)
    params = per_client.scatter(state.params, batches.client_id, new_x, every).table
    share_offsets = per_client.scatter(state.share_offsets, batches.client_id, new_offsets, every).table
    combined = n * mean_prediction
    if loss == "squared":
      data_loss = jnp.sum(jnp.square(combined - b)) / (2 * m)
    else:
      data_loss = jnp.sum(jnp.where(real, jax.nn.softplus(combined) - b * combined, 0)) / m
    objective = data_loss + l1 * jnp.sum(jnp.abs(params)) + 0.5 * l2 * jnp.sum(jnp.square(params))
    values = {
        "objective": objective,
        "primal_residual": np.sqrt(n) * jnp.linalg.norm(mean_relaxed - z_bar),
        "dual_residual": rho_k * np.sqrt(n) * jnp.linalg.norm(z_bar - state.z_bar),
    }
    return ADMMSharingState(
        params=params, z_bar=z_bar, scaled_dual=scaled_dual, mean_prediction=mean_prediction,
        share_offsets=share_offsets, round=state.round + 1, key=state.key,
        metrics={name: jnp.asarray(values[name]).astype(dt) for name, dt in SHARING_METRICS.items()})

  return FederatedAlgorithm(init, step)
