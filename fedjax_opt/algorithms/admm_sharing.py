"""Sharing ADMM for vertical federated learning of linear models (features split by column).

Boyd, Parikh, Chu, Peleato, Eckstein. "Distributed Optimization and
Statistical Learning via the Alternating Direction Method of Multipliers."
Foundations and Trends in Machine Learning 3(1), 2011. §3.3 (residuals),
§3.4.3 (over-relaxation), §7.3 (sharing), §8.3 (splitting by features).

The m samples' features are split by column over the N clients,
A = (A_1 … A_N), and, with ℓ the data loss of the m predictions
w = Σ_i A_i x_i,

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
safeguarded Newton steps, vectorised over the samples and warm-started from
the previous \\bar{z}, solve it to machine precision near convergence. Each
step shrinks the bracket to the sign change of φ_j and bisects it instead of
taking the Newton point when that point leaves the bracket or would move more
than half the move before the last one (the rule of Numerical Recipes'
`rtsafe`; a move within rounding of t is always taken, since the steps run
on after convergence). Without the second test, a steep σ(N t) (many
clients, small ρ) can trap plain bracket-checked Newton in a 2-cycle between
the bracket's two ends, far from the root.

The client's problem is solved inexactly by `inner_steps` proximal-gradient
(ISTA) steps from x_i^k with step 1/L, L = ρ‖A_i‖₂² + λ₂; ISTA's fixed point is
the exact minimiser, so the iteration's fixed point is the exact lasso /
ridge / elastic-net (or ℓ1/ℓ2-regularised logistic regression) solution.

Residuals (§3.3): ‖r‖ = √N ‖h̄ − \\bar{z}‖ (h̄ = \\bar{Ax} when α = 1) and
‖s‖ = ρ √N ‖\\bar{z}^{k+1} − \\bar{z}^k‖.

Non-finite clients (the library's rule, docs/architecture.md "The round", in
sharing-ADMM terms). A client whose x_i, A_i x_i or h_i holds a NaN or Inf
(NaN/Inf in its feature block, say) is frozen for the iteration: its x_i,
its offset d_i and its stored share p_i = A_i x_i (`predictions`, its last
finite value; 0 until its first finite iteration) stay, and the iteration is
the exact sharing ADMM of the other clients F (N_F = |F|) with the frozen
shares as a constant c = Σ_{j∉F} p_j inside the loss, ℓ(Σ_{i∈F} z_i + c):

    h̄ = (1/N_F) Σ_{i∈F} h_i,   t = argmin_t ℓ(N_F t + c) + (N_F ρ/2)‖t − u − h̄‖²
    (squared: t = (b − c + mρ(u + h̄))/(N_F + mρ); logistic: the scalar equations
    (σ(N_F t_j + c_j) − b_j)/m + ρ(t_j − v_j) = 0, same bracket),
    u ← u + h̄ − t,   z_i = h_i + t − h̄ (i ∈ F),   \\bar{z} = (N_F t + c)/N,

so no frozen value enters h̄, t or u and nothing non-finite reaches the
server. With every client finite (c = 0 exactly, N_F = N) this is the
iteration above (equal up to floating-point rounding). The residuals are then ‖r‖ = √N_F ‖h̄ − t‖ and
‖s‖ = ρ √N ‖\\bar{z}^{k+1} − \\bar{z}^k‖. An iteration with no finite client
changes nothing. The labels are the server's (client 0's `targets`) and are
not guarded. The clients' part of an iteration is `core.rounds.client_round`
without an aggregator, every client taking part (`weight` is ignored; each
client counts one step): its rows are x_i, h_i (written into its offset row,
which the server then turns into d_i = h_i + t − h̄ − p_i) and p_i = A_i x_i,
and, by that round's rule, a client is finite, and writes them, when all three are.

Communication (`metrics["bits_up"]`, `metrics["bits_down"]`, float32, per
client; every client takes part in every iteration). Messages are vectors
over the static sample axis of m_max = `num_samples` entries, never the
coefficients: a client sends A_i x_i, and h_i as well when α ≠ 1, so
bits_up = 32 m_max (α = 1) or 64 m_max (α ≠ 1); it receives one vector,
\\bar{z} − h̄ − u (with its own h_i, its next target is z_i − u = h_i +
\\bar{z} − h̄ − u; Boyd §8.3), bits_down = 32 m_max (float32).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import prox as prox_lib
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.rounds import ClientOutput, client_round, every_client
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, materialize
from fedjax_opt.core.validation import (check_choice, check_client_batches, check_int, check_key, check_positive,
                                        is_concrete)

__all__ = ["ADMMSharingState", "SHARING_LOSSES", "SHARING_METRICS", "admm_sharing"]

SHARING_METRICS = {
    "objective": jnp.float32,
    "primal_residual": jnp.float32,
    "dual_residual": jnp.float32,
    "num_nonfinite": jnp.int32,
    "bits_up": jnp.float32,
    "bits_down": jnp.float32,
}
"""`state.metrics` of `admm_sharing`: the objective at the new x, ‖r‖ = √N_F ‖h̄ − t‖
(= √N ‖h̄ − \\bar{z}‖ when every client is finite; h̄ = \\bar{Ax} when α = 1),
‖s‖ = ρ √N ‖\\bar{z}^{k+1} − \\bar{z}^k‖, the clients frozen because their update was not finite, and the
bits each client sent (32 m_max, 64 m_max when α ≠ 1) and received (32 m_max) (module docstring)."""

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
      share minus its share (every row = \\bar{z} − \\bar{Ax} when α = 1 and no client was frozen).
    predictions: p_i = A_i x_i, `[N, m]`, each client's share at its last finite iteration
      (0 before its first): what a frozen client contributes to the prediction.
    round: k, iterations applied, int32.
    key: PRNG key, carried for the `FederatedAlgorithm` contract (the iteration draws no randomness).
    metrics: `SHARING_METRICS`.
  """

  params: jax.Array
  z_bar: jax.Array
  scaled_dual: jax.Array
  mean_prediction: jax.Array
  share_offsets: jax.Array
  predictions: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _soft_threshold(v: jax.Array, t: jax.Array) -> jax.Array:
  return jnp.sign(v) * jnp.maximum(jnp.abs(v) - t, 0)


def _logistic_z_update(v: jax.Array, labels: jax.Array, real: jax.Array, n: jax.Array, frozen: jax.Array,
                       m: jax.Array, rho: jax.Array, start: jax.Array, steps: int) -> jax.Array:
  """Solves (σ(N_F t_j + c_j) − b_j)/m + ρ(t_j − v_j) = 0 per real sample (t_j = v_j on padding), `[m_max]`.

  `n` is N_F, the clients that moved, and `frozen` the frozen clients' shares c `[m_max]` (module docstring).

  Safeguarded Newton: the root is bracketed by v ± 1/(mρ); a Newton point that
  leaves the current bracket, or that would move more than half the move
  before the last one (unless the move is within rounding, 16 eps (1 + |t|),
  of t), is replaced by the bracket's midpoint (module docstring).
  """
  width = 1 / (m * rho)
  lo, hi = v - width, v + width
  t = jnp.clip(start, lo, hi)

  def newton(carry, _):
    t, lo, hi, step, older = carry  # the last two moves, as in rtsafe
    sig = jax.nn.sigmoid(n * t + frozen)
    phi = jnp.where(real, (sig - labels) / m, 0) + rho * (t - v)
    slope = jnp.where(real, n * sig * (1 - sig) / m, 0) + rho
    lo, hi = jnp.where(phi <= 0, t, lo), jnp.where(phi >= 0, t, hi)
    candidate = t - phi / slope
    converged = jnp.abs(candidate - t) <= tol * (1 + jnp.abs(t))  # rounding noise: never bisect a wide bracket
    halves = (2 * jnp.abs(phi) <= jnp.abs(older * slope)) | converged
    newton_ok = (candidate >= lo) & (candidate <= hi) & halves
    new_t = jnp.where(newton_ok, candidate, 0.5 * (lo + hi))
    return (new_t, lo, hi, new_t - t, step), None

  tol = 16 * jnp.finfo(jnp.result_type(t)).eps
  full = 2 * width * jnp.ones_like(t)
  (t, _, _, _, _), _ = jax.lax.scan(newton, (t, lo, hi, full, full), None, length=steps)
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
) -> FederatedAlgorithm:
  """Sharing ADMM (Boyd et al. 2011, §7.3) for features split by column: lasso / ridge / elastic net / logistic.

  Minimises ℓ(Σ_i A_i x_i) + Σ_i (λ₁‖x_i‖₁ + (λ₂/2)‖x_i‖²) with
  ℓ(w) = (1/(2m))‖w − b‖² (`loss="squared"`; λ₂ = 0 is scikit-learn's
  `Lasso(alpha=λ₁, fit_intercept=False)`, λ₁ = 0 is `Ridge(alpha=m λ₂,
  fit_intercept=False)`) or ℓ(w) = (1/m) Σ_j [log(1 + e^{w_j}) − b_j w_j] with
  b_j ∈ {0, 1} (`loss="logistic"`; λ₁ = 0, λ₂ = 1/(Cm) is scikit-learn's
  `LogisticRegression(C=C, fit_intercept=False)`, and λ₂ = 0, λ₁ = 1/(Cm) its
  `penalty="l1"`). No intercept: add a column of ones to one client's block.
  There is no `loss_fn` argument: the loss is built in (`loss=`), because the
  server step solves that loss's proximal problem in closed form (squared) or
  by Newton's method (logistic).

  `step(state, batches)` takes every client every round (vertical FL): batch
  row c holds client c's feature block A_c as `data[features]` `[N, 1, m, d_max]`
  (unused columns zero), the same m samples in the same order for every client;
  `mask` `[N, 1, m]` marks the real samples; the labels b are read from client
  0's `data[targets]` `[m]` (the label holder). `weight` is ignored.

  Args:
    rho: ρ > 0, the penalty (may be traced).
    num_samples: m_max, the static sample axis (the batch size B).
    l1, l2: λ₁ >= 0, λ₂ >= 0, the ℓ1 and ℓ2 penalties (may be traced).
    inner_steps: proximal-gradient (ISTA) steps of each client's x-update.
    loss: "squared" (closed-form z-update) or "logistic" (labels in {0, 1},
      checked when concrete; z-update by safeguarded Newton).
    newton_steps: Newton steps per logistic z-update (warm-started).
    relaxation: α ∈ (0, 2), over-relaxation (§3.4.3; 1: plain ADMM; may be traced).
    features, targets: keys of `batches.data`.

  Returns:
    `FederatedAlgorithm(init, step)`; `init(params [N, d_max], key)`.

  Raises:
    TypeError: `num_samples`, `inner_steps` or `newton_steps` not a Python int.
    ValueError: ρ <= 0, λ₁ or λ₂ < 0, α outside (0, 2), unknown `loss`,
      `num_samples`, `inner_steps` or `newton_steps` < 1; at `step`,
      mis-shaped features or (logistic, concrete) labels outside {0, 1}.
  """
  prox_lib.check_rho(rho)
  check_positive(l1, "l1", allow_zero=True)
  check_positive(l2, "l2", allow_zero=True)
  prox_lib.check_relaxation(relaxation)
  check_choice(loss, "loss", SHARING_LOSSES)
  check_int(inner_steps, "inner_steps")
  check_int(newton_steps, "newton_steps")
  m_max = check_int(num_samples, "num_samples")
  mode = client_map_lib.FromPolicy()

  def client_update(shared, data, mask, x, offset, stored):
    u, rho_k = shared
    row_mask = mask[0]
    a = jnp.where(row_mask[:, None], data[features][0].astype(x.dtype), 0)
    share = a @ x + offset  # z_i^k
    target = share - u
    lipschitz = rho_k * jnp.square(jnp.linalg.norm(a, 2)) + l2
    step_size = 1 / jnp.maximum(lipschitz, jnp.finfo(a.dtype).tiny)

    def ista(xk, _):
      grad = rho_k * a.T @ (a @ xk - target) + l2 * xk
      return _soft_threshold(xk - step_size * grad, step_size * l1), None

    new_x, _ = jax.lax.scan(ista, x, None, length=inner_steps)
    prediction = a @ new_x
    relaxed = relaxation * prediction + (1 - relaxation) * share
    # Every client takes part in every iteration (one step, whatever its mask); it writes h_i into its offset
    # row, which the server then corrects to d_i = h_i + t − h̄ − A_i x_i (`step`).
    result = LocalResult(delta=new_x - x, loss=jnp.zeros((), x.dtype), num_examples=jnp.sum(row_mask, dtype=x.dtype),
                         num_steps=jnp.ones((), jnp.int32))
    return ClientOutput(result, rows=(new_x, relaxed, prediction), extras=(prediction, relaxed, stored))

  def init(params: jax.Array, key: jax.Array) -> ADMMSharingState:
    check_key(key)
    if jnp.ndim(params) != 2:
      raise ValueError(f"params must be the coefficient blocks [N, d_max]; got shape {tuple(jnp.shape(params))}.")
    dtype = jnp.result_type(params)
    zeros = jnp.zeros((m_max,), dtype)
    return ADMMSharingState(params=params, z_bar=zeros, scaled_dual=zeros, mean_prediction=zeros,
                            share_offsets=jnp.zeros((jnp.shape(params)[0], m_max), dtype),
                            predictions=jnp.zeros((jnp.shape(params)[0], m_max), dtype),
                            round=jnp.zeros((), jnp.int32), key=key,
                            metrics={name: jnp.zeros((), dt) for name, dt in SHARING_METRICS.items()})

  def step(state: ADMMSharingState, batches: ClientBatches) -> ADMMSharingState:
    check_client_batches(batches)
    n, d = state.params.shape
    data = materialize(batches.data)
    if data[features].shape != (n, 1, m_max, d):
      raise ValueError(f"batches.data[{features!r}] must be [N, 1, m, d_max] = ({n}, 1, {m_max}, {d}) (one local "
                       f"step: the whole sample axis); got {tuple(data[features].shape)}.")
    real = batches.mask[0, 0]
    labels = data[targets][0, 0]
    if loss == "logistic":
      _check_binary_labels(labels, real, f"batches.data[{targets!r}][0, 0]")
    b = jnp.where(real, labels, 0).astype(state.params.dtype)
    m = jnp.maximum(jnp.sum(real, dtype=b.dtype), 1)
    rho_k = jnp.asarray(rho, b.dtype)
    # Every client takes part (vertical FL: `weight` is ignored); the rows x_i, h_i, p_i go through the round's rules.
    out = client_round(mode, client_update, (state.scaled_dual, rho_k), every_client(batches.replace(data=data)),
                       tables=(state.params, state.share_offsets, state.predictions))
    predictions, relaxed, stored = out.extras
    # A client whose update is not finite is frozen: the iteration runs on the others, F, with the frozen
    # shares c = Σ_{j∉F} p_j held constant (module docstring). Sums over the frozen clients are written
    # Σ_{j∉F} (p_j − w) so that they are exactly 0 when every client is finite: then this is the plain iteration.
    finite, num_nonfinite = out.agg.finite, out.agg.num_nonfinite
    moved = finite[:, None]
    n_f = jnp.sum(finite, dtype=b.dtype)
    n_safe = jnp.maximum(n_f, 1)

    def frozen_excess(w):  # Σ_{j∉F} (p_j − w) = c − (N − N_F) w
      return jnp.sum(jnp.where(moved, 0, stored - w), axis=0)

    frozen = frozen_excess(0)
    mean_relaxed = jnp.sum(jnp.where(moved, relaxed, 0), axis=0) / n_safe
    v = state.scaled_dual + mean_relaxed
    if loss == "squared":
      t = (b - frozen + m * rho_k * v) / (n_f + m * rho_k)
    else:
      start = state.z_bar - frozen_excess(state.z_bar) / n_safe  # t at the stored \\bar{z} = (N_F t + c)/N
      t = _logistic_z_update(v, b, real, n_f, frozen, m, rho_k, start, newton_steps)
    accepted = n_f > 0
    z_bar = jnp.where(accepted, t + frozen_excess(t) / n, state.z_bar)
    scaled_dual = jnp.where(accepted, state.scaled_dual + mean_relaxed - t, state.scaled_dual)
    params, relaxed_rows, stored_predictions = (s.table for s in out.stored)
    written = jnp.zeros((n,), bool).at[batches.client_id].max(out.stored[1].written, mode="drop")[:, None]
    share_offsets = jnp.where(written, relaxed_rows + (t - mean_relaxed) - stored_predictions, relaxed_rows)
    shares = jnp.where(moved, predictions, stored)
    mean_prediction = jnp.mean(shares, axis=0)
    combined = n * mean_prediction
    if loss == "squared":
      data_loss = jnp.sum(jnp.square(combined - b)) / (2 * m)
    else:
      data_loss = jnp.sum(jnp.where(real, jax.nn.softplus(combined) - b * combined, 0)) / m
    objective = data_loss + l1 * jnp.sum(jnp.abs(params)) + 0.5 * l2 * jnp.sum(jnp.square(params))
    vector_bits = float(8 * m_max * jnp.dtype(b.dtype).itemsize)  # one [m] vector (module docstring)
    values = {
        "objective": objective,
        "primal_residual": jnp.where(accepted, jnp.sqrt(n_f) * jnp.linalg.norm(mean_relaxed - t), 0),
        "dual_residual": rho_k * np.sqrt(n) * jnp.linalg.norm(z_bar - state.z_bar),
        "num_nonfinite": num_nonfinite,
        "bits_up": jnp.where(jnp.asarray(relaxation) == 1, 1.0, 2.0) * vector_bits,
        "bits_down": vector_bits,
    }
    return ADMMSharingState(
        params=params, z_bar=z_bar, scaled_dual=scaled_dual, mean_prediction=mean_prediction,
        share_offsets=share_offsets, predictions=stored_predictions, round=state.round + 1, key=state.key,
        metrics={name: jnp.asarray(values[name]).astype(dt) for name, dt in SHARING_METRICS.items()})

  return FederatedAlgorithm(init, step)


admm_sharing = execution.accepts_policy_keywords(admm_sharing, refuses_aggregator=(
    "sharing ADMM (vertical FL) averages no updates: the server solves its loss's prox at the mean of the "
    "clients' predictions A_i x_i, and the dual and the offsets follow from that exact mean"),
    evaluation="global", exchanges="metrics", hyperparameters={"rho": execution.PENALTY, "l1": execution.REGULARIZER,
        "l2": execution.REGULARIZER, "inner_steps": execution.COUNT, "newton_steps": execution.COUNT,
        "relaxation": execution.MIXING_WEIGHT})
