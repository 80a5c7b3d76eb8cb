"""CoCoA+: primal-dual distributed optimization with local SDCA on each client's dual block, the updates added.

Ma, Smith, Jaggi, Jordan, Richtárik, Takáč. "Adding vs. Averaging in
Distributed Primal-Dual Optimization." ICML 2015. arXiv:1502.03508.
Smith, Forte, Ma, Takáč, Jordan, Jaggi. "CoCoA: A General Framework for
Communication-Efficient Distributed Optimization." JMLR 18(230), 2018.
Local solver: Shalev-Shwartz, Zhang. "Stochastic Dual Coordinate Ascent
Methods for Regularized Loss Minimization." JMLR 14, 2013.

The problem is an L2-regularised generalised linear model over all n real
examples (a_i, y_i) of the K clients,

    primal:  min_w  P(w) = (1/n) Σ_i ℓ_i(a_iᵀw) + (λ/2)‖w‖²
    dual:    max_α  D(α) = −(1/n) Σ_i ℓ_i*(−α_i) − (λ/2)‖Aα/(λn)‖²,      w(α) = Aα/(λn)

with A = [a_1 … a_n] and, for params `{"w": [d], "b": []}`, a_i = (x_i, 1):
the intercept is the weight of a constant feature and is regularised with
the rest (as liblinear does). Losses (`loss=`):

    "squared" (ridge regression):  ℓ_i(z) = ½(z − y_i)²,       ℓ_i*(−α) = −α y_i + α²/2
    "hinge"   (linear SVM, y_i ∈ {−1, 1}):  ℓ_i(z) = max(0, 1 − y_i z),
                                             ℓ_i*(−α) = −α y_i  for α y_i ∈ [0, 1] (else +∞)

Every client k keeps its block α_[k] of dual variables, one per example slot
(a per-client table `[N, S·B]`, like SCAFFOLD's control variates), and the
server keeps w = w(α). One `step` is one outer iteration t (Ma et al.,
Algorithm 1, with the SDCA local solver):

    client k:  H coordinate steps of SDCA on its local subproblem, from Δα_[k] = 0, u = w:
                   δ = argmax_δ −ℓ_i*(−(α_i + Δα_i + δ)) − δ a_iᵀu − (q_i/2) δ²,   q_i = σ′‖a_i‖²/(λn)
                   Δα_i += δ,   u += σ′ δ a_i / (λn)
               closed forms: squared  δ = (y_i − α̃_i − a_iᵀu) / (1 + q_i);
                             hinge    δ = y_i clip(α̃_i y_i + (1 − y_i a_iᵀu) / q_i, 0, 1) − α̃_i
               (α̃_i = α_i + Δα_i); sends Δw_k = A_[k] Δα_[k] / (λn)
    server:    w ← w + γ Σ_k Δw_k,     client k:  α_[k] ← α_[k] + γ Δα_[k]

with γ = 1 and σ′ = γK (CoCoA+, "adding": the safe σ′ for adding the K
updates) by default; γ = 1/K with σ′ = 1 is the original CoCoA ("averaging").
The q_i term is the local subproblem's quadratic, σ′ times the
coordinate's share of ‖AΔα/(λn)‖² (Ma et al., eq. (10)); the updates keep
w = Aα/(λn) exactly. The H coordinates are the client's slots in the order
of a random permutation of the S·B slot indices drawn from the round's key
(the same order on every client; step h visits slot perm[h mod S·B]); a
padded slot is skipped.

The certificate: at w = w(α), P(w) − D(α) = (1/n) Σ_i [ℓ_i(a_iᵀw) + ℓ_i*(−α_i)]
+ λ‖w‖² ≥ 0 (weak duality), 0 exactly at the optimum; since P is λ-strongly
convex, ‖w − w*‖² ≤ 2(P(w) − D(α))/λ. Every client sends its two sums with
its update, so the round reports P, D and the gap at the (w_t, α_t) it
started from (`metrics["duality_gap"]`), in the model's dtype (float64 for a
float64 model under x64, where the gap resolves values far below float32's).

What the theory guarantees (Ma et al. 2015; Smith et al. 2018), and what it
does not. With γ ∈ (0, 1] and σ′ ≥ γK, the local subproblems bound the dual
from below: D(α + γ Σ_k Δα_[k]) ≥ (1 − γ) D(α) + γ Σ_k G_k^σ′(Δα_[k]), with
Σ_k G_k^σ′(0) = D(α). SDCA's exact coordinate steps never decrease a
client's G_k^σ′, so the dual objective D(α_t) is non-decreasing, round by
round. The primal P(w_t), and with it the gap P(w_t) − D(α_t), is not
monotone: it may rise in a round (at λ = 0.05 on tests/test_cocoa.py's ridge
problem, one SDCA pass a round, it rises in about a third of the rounds while
it converges). The rates hold in expectation over the local solver's
randomness, for a local solver of multiplicative accuracy Θ < 1 on its
subproblem: for smooth losses (the squared loss here) with the strongly convex
L2 regulariser, the expected dual suboptimality and the expected duality gap
fall linearly, ≤ ε after O(log(1/ε)) rounds (the constant grows with
1/(γ(1 − Θ)) and with σ′ times the clients' squared data norms over λn); for
Lipschitz losses (the hinge loss) the expected gap of the averaged iterates is
≤ ε after O(1/ε) rounds. tests/test_cocoa.py checks that the reported gap is
non-negative and equals the float64 gap recomputed from the state, that the
dual objective never decreases, that the gap converges (below 1e-9 under x64)
although not monotonically, and that w reaches scikit-learn's Ridge and
liblinear's hinge-loss SVM on the same problem.

What the data must be: every client's whole data set in every round, each
example in the same slot every round (α_i is the dual of the example in slot
i), and every client in every round (n, the certificate and σ′ = γK are those
of the whole problem; `core.validation.check_full_participation`). The
initial params give the model's structure; the primal starts at w(α_0) = 0.

The round is `core.rounds.client_round` with the α table, under its rules
(docs/architecture.md, "The round"): a client whose Δw_k is not finite is
dropped (its α_[k] is not written, so w = Aα/(λn) still holds) and counted
in `num_nonfinite`; a round with no finite client is rejected. The sums of
the certificate count the clients aggregated, so the gap is the problem's
only when every client was. No `aggregator=`: the server adds the exact Δw_k.

Communication (`metrics["bits_up"]`, `["bits_down"]`, per client, float32):
a client receives w (32 P) and sends Δw_k (32 P); the certificate's two sums
are scalars and are not counted.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import per_client
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.tree import global_norm, tree_bits
from fedjax_opt.core.types import Aggregator, ClientBatches, FederatedAlgorithm, PyTree, Traits
from fedjax_opt.core.validation import (check_choice, check_full_participation, check_int, check_key,
                                        check_num_clients, check_optional_int, check_positive)

__all__ = ["COCOA_METRICS", "CoCoAState", "cocoa", "cocoa_model", "hinge_optimum"]

LOSSES = ("squared", "hinge")

COCOA_METRICS = {
    "primal_objective": None,
    "dual_objective": None,
    "duality_gap": None,
    "update_norm": None,
    "num_clients": jnp.int32,
    "num_nonfinite": jnp.int32,
    "round_accepted": jnp.bool_,
    "bits_up": jnp.float32,
    "bits_down": jnp.float32,
}
"""`state.metrics` of `cocoa` after a round: name -> dtype, None for the model's floating dtype (that of
`params["w"]`, at least float32: float64 for a float64 model under x64, so the certificate resolves gaps far
below float32's 1e-7 relative spacing).

* primal_objective, dual_objective, duality_gap: P(w_t), D(α_t) and P − D at the start of the round, from the
  sums of the clients aggregated (the problem's own when every client was);
* update_norm: ‖w_{t+1} − w_t‖;
* num_clients: clients whose update was added; num_nonfinite: clients dropped (update not finite);
* round_accepted: False when no finite client took part (w, α unchanged);
* bits_up, bits_down: 32 P each (Δw_k up, w down); bits_up 0 when no client took part.
"""


def _metric_dtypes(params: PyTree) -> dict[str, Any]:
  """`COCOA_METRICS` with None resolved to the model's floating dtype (at least float32)."""
  model = jnp.promote_types(jnp.result_type(params["w"]), jnp.float32)
  return {name: model if dt is None else dt for name, dt in COCOA_METRICS.items()}


@flax.struct.dataclass
class CoCoAState:
  """State of CoCoA+.

  Attributes:
    params: the primal model w = Aα/(λn).
    duals: α, a per-client table `[N, S·B]`, one dual variable per example slot.
    round: t, outer iterations applied, int32.
    key: PRNG key, split once per round (the coordinates' order).
    metrics: `COCOA_METRICS`.
  """

  params: PyTree
  duals: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _check_params(params: PyTree) -> bool:
  """True when the model has an intercept "b"; TypeError unless it is `{"w": [d]}` or `{"w": [d], "b": []}`."""
  if not isinstance(params, dict) or set(params) not in ({"w"}, {"w", "b"}):
    raise TypeError(f"cocoa: params must be a linear model {{'w': [d]}} or {{'w': [d], 'b': []}}; got "
                    f"{jax.tree.map(jnp.shape, params)!r}.")
  if jnp.ndim(params["w"]) != 1 or ("b" in params and jnp.ndim(params["b"]) != 0):
    raise TypeError(f"cocoa: params['w'] must be [d] and params['b'] a scalar; got "
                    f"{jax.tree.map(jnp.shape, params)!r}.")
  return "b" in params


def _sum_of_rows() -> Aggregator:
  """Σ_k Δw_k over the clients taking part (weight > 0): CoCoA+ adds the updates."""

  def aggregate(updates, weights, state, key):
    del key
    used = weights > 0
    return jax.tree.map(lambda u: jnp.sum(jnp.where(used.reshape((-1,) + (1,) * (u.ndim - 1)), u, 0), axis=0),
                        updates), state

  return Aggregator(lambda params: (), aggregate, traits=Traits(name="cocoa_sum_of_rows", linear=True))


def cocoa(
    lam: Any,
    gamma: Any = 1.0,
    *,
    loss: str = "squared",
    num_clients: int,
    num_examples: int,
    local_steps: int | None = None,
    sigma_prime: Any = None,
) -> FederatedAlgorithm:
  """CoCoA+ (Ma et al. 2015; Smith et al. 2018) with local SDCA, for ridge regression and the linear SVM.

  Args:
    lam: λ > 0, the L2 regularisation of the primal (may be traced).
    gamma: γ ∈ (0, 1], the aggregation parameter (1: adding, CoCoA+; 1/K with σ′ = 1: averaging, CoCoA).
    loss: "squared" (ridge regression) or "hinge" (linear SVM, labels ±1); the data's keys are "x" `[S, B, d]`
      and "y" `[S, B]`.
    num_clients: K = N; every step must hold every client.
    num_examples: S·B, the example slots of each client (the α table's columns; static).
    local_steps: H, SDCA coordinate steps per round (Python int; default S·B, one pass over the slots).
    sigma_prime: σ′ > 0 of the local subproblem (default γK, the safe value for adding).

  Returns:
    `FederatedAlgorithm(init, step)` with state `CoCoAState`.

  Raises:
    TypeError: `num_clients`, `num_examples` or `local_steps` not a Python int, or params that are not a
      linear model `{"w": [d]}` / `{"w": [d], "b": []}`.
    ValueError: λ <= 0, γ outside (0, 1], σ′ <= 0, an unknown `loss`, a step without every client, or S·B
      other than `num_examples`.
  """
  check_positive(lam, "lam (λ)")
  check_positive(gamma, "gamma (γ)")
  if isinstance(gamma, (int, float)) and gamma > 1:
    raise ValueError(f"gamma (γ) must lie in (0, 1]; got {gamma}.")
  check_choice(loss, "loss", LOSSES)
  num_clients = check_num_clients(num_clients)
  m = check_int(num_examples, "num_examples")
  local_steps = m if check_optional_int(local_steps, "local_steps") is None else local_steps
  sigma = gamma * num_clients if sigma_prime is None else sigma_prime
  check_positive(sigma, "sigma_prime (σ′)")
  mode = client_map_lib.FromPolicy()
  aggregator = _sum_of_rows()

  def features(data, mask, bias):
    x = data["x"].reshape((m,) + data["x"].shape[2:])
    if bias:
      x = jnp.concatenate([x, jnp.ones((m, 1), x.dtype)], axis=1)
    return x, data["y"].reshape(m).astype(x.dtype), mask.reshape(m)

  def flat(params):
    return jnp.concatenate([params["w"], jnp.reshape(params["b"], (1,))]) if "b" in params else params["w"]

  def unflat(theta, like):
    if "b" in like:
      return {"w": theta[:-1].astype(like["w"].dtype), "b": theta[-1].astype(jnp.result_type(like["b"]))}
    return {"w": theta.astype(like["w"].dtype)}

  def primal_loss(z, y):
    return 0.5 * jnp.square(z - y) if loss == "squared" else jnp.maximum(0, 1 - y * z)

  def conjugate(alpha, y):  # ℓ_i*(−α_i) on the dual's domain
    return -alpha * y + 0.5 * jnp.square(alpha) if loss == "squared" else -alpha * y

  def client_update(shared, data, mask, alpha):
    params, n, order = shared
    a, y, real = features(data, mask, "b" in params)
    theta = flat(params).astype(a.dtype)
    lam_n = lam * n
    count = jnp.sum(real, dtype=a.dtype)
    loss_sum = jnp.sum(jnp.where(real, primal_loss(a @ theta, y), 0))
    conj_sum = jnp.sum(jnp.where(real, conjugate(alpha, y), 0))
    q = sigma * jnp.sum(jnp.square(a), axis=1) / lam_n

    def coordinate(h, carry):
      u, dalpha = carry
      i = order[h % m]
      current = alpha[i] + dalpha[i]
      margin = jnp.vdot(a[i], u)
      if loss == "squared":
        delta = (y[i] - current - margin) / (1 + q[i])
      else:
        safe_q = jnp.where(q[i] > 0, q[i], 1)
        beta = jnp.clip(current * y[i] + (1 - y[i] * margin) / safe_q, 0, 1)
        delta = jnp.where(q[i] > 0, y[i] * beta - current, 0)
      delta = jnp.where(real[i], delta, 0)
      return u + sigma * delta * a[i] / lam_n, dalpha.at[i].add(delta)

    _, dalpha = jax.lax.fori_loop(0, local_steps, coordinate, (theta, jnp.zeros_like(alpha)))
    delta_w = unflat(a.T @ dalpha / lam_n, params)
    visits = jnp.sum(jnp.where(real[order[jnp.arange(local_steps) % m]], 1, 0), dtype=jnp.int32)
    result = LocalResult(delta=delta_w, loss=loss_sum / jnp.maximum(count, 1), num_examples=count, num_steps=visits)
    return ClientOutput(result, rows=(alpha + gamma * dalpha,), extras=(loss_sum, conj_sum))

  def init(params: PyTree, key: jax.Array) -> CoCoAState:
    check_key(key)
    _check_params(params)
    dtype = jnp.result_type(params["w"])
    return CoCoAState(params=jax.tree.map(jnp.zeros_like, params), duals=jnp.zeros((num_clients, m), dtype),
                      round=jnp.zeros((), jnp.int32), key=key,
                      metrics={name: jnp.zeros((), dt) for name, dt in _metric_dtypes(params).items()})

  def step(state: CoCoAState, batches: ClientBatches) -> CoCoAState:
    check_full_participation(batches, num_clients)
    if batches.local_steps * batches.batch_size != m:
      raise ValueError(f"cocoa: batches must have S·B = num_examples = {m} example slots per client; got "
                       f"S·B = {batches.local_steps}·{batches.batch_size}.")
    key, order_key, round_key = jax.random.split(state.key, 3)
    w = state.params
    dtype = jnp.result_type(w["w"])
    n = jnp.maximum(jnp.sum(batches.mask, dtype=dtype), 1)
    order = jax.random.permutation(order_key, m)
    out = client_round(mode, client_update, (w, n, order), batches, tables=(state.duals,), aggregator=aggregator,
                       aggregator_state=(), key=round_key)
    loss_sum, conj_sum = out.extras
    used = (out.weights > 0) & out.agg.finite & out.agg.accepted
    norm2 = jnp.square(global_norm(w))
    primal = jnp.sum(jnp.where(used, loss_sum, 0)) / n + 0.5 * lam * norm2
    dual = -jnp.sum(jnp.where(used, conj_sum, 0)) / n - 0.5 * lam * norm2
    update = jax.tree.map(lambda d: gamma * d, out.agg.update)
    taking_part = out.weights > 0
    message = float(tree_bits(w))
    values = {
        "primal_objective": primal,
        "dual_objective": dual,
        "duality_gap": primal - dual,
        "update_norm": global_norm(update),
        "num_clients": jnp.sum(used),
        "num_nonfinite": out.agg.num_nonfinite,
        "round_accepted": out.agg.accepted,
        "bits_up": jnp.where(jnp.any(taking_part), message, 0.0),
        "bits_down": message,
    }
    return CoCoAState(
        params=jax.tree.map(lambda p, u: (p + u).astype(p.dtype), w, update),
        duals=out.stored[0].table,
        round=state.round + 1,
        key=key,
        metrics={name: jnp.asarray(values[name]).astype(dt) for name, dt in _metric_dtypes(w).items()},
    )

  return FederatedAlgorithm(init, step)


cocoa = execution.accepts_policy_keywords(cocoa, refuses_aggregator=(
    "CoCoA+ adds the clients' exact Δw_k = A_[k]Δα_[k]/(λn), so that w stays the image w = Aα/(λn) of the "
    "dual variables on which its local subproblems and its duality-gap certificate rest"),
    evaluation="global", exchanges="metrics", hyperparameters={"lam": execution.REGULARIZER,
        "gamma": execution.MIXING_WEIGHT, "local_steps": execution.COUNT, "sigma_prime": execution.SCALE})


def cocoa_model(num_features: int, loss: str = "squared"):
  """CoCoA+'s primal, the linear score s = xᵀw + b on two classes, as a `fo.models.Model` (`{"w": [d], "b": []}`).

  What `cocoa`'s state holds (`state.params`), made usable by the evaluation code: label y ∈ {0, 1} is
  t = 2y − 1 ∈ {−1, 1}; the loss per example is `loss`'s, ½(s − t)² ("squared") or max(0, 1 − t s) ("hinge");
  an example is classified as 1 where s > 0; `apply` gives the logits (−s/2, s/2), whose softmax is the
  logistic model of the same score. `init` is w = 0, b = 0, the image of the duals α = 0.
  """
  from fedjax_opt.models import Model  # pylint: disable=import-outside-toplevel

  check_choice(loss, "loss", LOSSES)

  def score(params, x):
    return jnp.reshape(x, (x.shape[0], -1)).astype(params["w"].dtype) @ params["w"] + params["b"]

  def loss_fn(params, batch):
    s, t = score(params, batch["x"]), 2.0 * batch["y"] - 1.0
    return 0.5 * jnp.square(s - t) if loss == "squared" else jnp.maximum(0.0, 1.0 - t * s)

  def accuracy_fn(params, batch):
    return ((score(params, batch["x"]) > 0) == (batch["y"] == 1)).astype(jnp.float32)

  def apply(params, x):
    s = score(params, x)
    return jnp.stack([-0.5 * s, 0.5 * s], axis=-1)

  return Model(init=lambda key: {"w": jnp.zeros((num_features,), jnp.float32), "b": jnp.zeros((), jnp.float32)},
               apply=apply, loss_fn=loss_fn, accuracy_fn=accuracy_fn,
               name="linear_" + ("ridge" if loss == "squared" else "svm"), input_shape=(num_features,), num_classes=2)


def hinge_optimum(x: np.ndarray, t: np.ndarray, lam: float) -> float:
  """min_w P(w) of the hinge loss with the ridge, (1/n) Σ max(0, 1 − t_i a_iᵀw) + (λ/2)‖w‖², a_i = (x_i, 1): the
  reference F* of `cocoa(loss="hinge")`, whose primal is not smooth (L-BFGS on it does not apply).

  It is the maximum of the dual (strong duality), a smooth concave quadratic over a box, solved by float64
  L-BFGS-B: with β_i = α_i t_i ∈ [0, 1], D(β) = (1/n) Σ β_i − ‖Σ β_i t_i a_i‖² / (2λn²).

  Args:
    x: `[n, d]` features (float64 is used). t: `[n]` labels in {−1, 1}. lam: λ > 0.
  """
  import scipy.optimize  # pylint: disable=import-outside-toplevel  (host-side, float64)

  x, t = np.asarray(x, np.float64).reshape(len(t), -1), np.asarray(t, np.float64)
  a = np.hstack([x, np.ones((len(x), 1))])
  n, lam = len(t), float(lam)

  def negative_dual(beta):
    v = a.T @ (beta * t)
    return -(beta.sum() / n - v @ v / (2 * lam * n * n)), -(1.0 / n - t * (a @ v) / (lam * n * n))

  result = scipy.optimize.minimize(negative_dual, np.zeros(n), jac=True, method="L-BFGS-B", bounds=[(0, 1)] * n,
                                   options=dict(maxiter=20000, maxcor=20, gtol=1e-12, ftol=1e-15))
  return float(-result.fun)
