"""Mixture ADMM (experimental): the mixture of global and local models as a nonconvex sharing problem.

Problem. n clients keep personalized models x_i; with x̄ = (1/n) Σ_i x_i,

    minimize  Φ(x) = Σ_i f_i(x_i) + (λ/2) Σ_i ‖x_i − x̄‖².

Φ = n·F for the mixture objective of Hanzely & Richtárik ("Federated Learning
of a Mixture of Global and Local Models", arXiv:2002.05516, 2020), the one
`fedjax_opt.objectives.mixture` and `algorithms/mixture.py` (L2GD, L2SGD+)
use, F(x) = (1/n) Σ_i f_i(x_i) + λ/(2n) Σ_i ‖x_i − x̄‖², with the same λ and
the same f_i (client i's mean loss). Same minimiser x(λ), same stationarity
condition ∇f_i(x_i) + λ(x_i − x̄) = 0, i.e. x_i = x̄ − (1/λ)∇f_i(x_i); the
`objective` metric reports F, so the two families are compared on one scale.

Rewriting as a sharing problem. Σ_i ‖x_i − x̄‖² = Σ_i ‖x_i‖² − n‖x̄‖², so with
g_i(x) = f_i(x) + (λ/2)‖x‖² and s = Σ_i x_i,

    Φ(x) = Σ_i g_i(x_i) + ℓ(Σ_i x_i),        ℓ(s) = −(λ/(2n)) ‖s‖²,

the sharing problem of Hong, Luo, Razaviyayn ("Convergence analysis of
alternating direction method of multipliers for a family of nonconvex
problems", SIAM J. Optim. 26(1), 2016, Eq. 3.2): minimize Σ_i g_i(x_i) + ℓ(x_0)
s.t. Σ_i A_i x_i = x_0. The coupling ℓ is concave (a difference-of-convex
split of a convex Φ): ∇ℓ is Lipschitz with constant L = λ/n in s (L = λ for the
stacked copies below). Two ways to apply ADMM to it, selected by `variant`:

* "jacobi": Hong et al.'s form with A_i = I, x_0 = s ∈ R^P (one aggregate),
  augmented Lagrangian Σ g_i(x_i) + ℓ(s) + ⟨y, Σ x_i − s⟩ + (ρ/2)‖Σ x_i − s‖².
  The x_i-blocks are updated in parallel (Jacobi, every client from the
  previous x_j), then s, then y.
* "split": Boyd et al.'s sharing form ("Distributed Optimization and
  Statistical Learning via the Alternating Direction Method of Multipliers",
  FnT ML 3(1), 2011, §7.3) with extra copies x_i' of the x_i: minimize
  Σ g_i(x_i) + ℓ(Σ x_i') s.t. x_i = x_i', penalty (ρ/2) Σ ‖x_i − x_i' + u_i‖².
  This is Hong et al.'s Eq. 3.2 again, with x_0 = (x_1', …, x_n') stacked and
  A_i the embedding of block i; since the A_i have orthogonal ranges, the
  x_i-blocks do not interact in the augmented Lagrangian, so updating them in
  parallel *is* the Gauss-Seidel sweep their analysis covers: the copies
  decouple the clients.

Derivation (writing z = s/n for the "jacobi" variant and z = (1/n) Σ x_i' for
"split", both on the scale of x̄, and κ = n for "jacobi", κ = 1 for "split").

x-update. "jacobi": client i minimises g_i(x) + ⟨y, x⟩ + (ρ/2)‖x + Σ_{j≠i} x_j^k − s^k‖²,
whose quadratic part is ((λ+ρ)/2)‖x − v_i‖² + const with
v_i = (ρ(x_i^k + n(z^k − x̄^k)) − y^k)/(λ+ρ). "split": Boyd's reduction of the
x'-update gives x_i'^k = x_i^k + z^k − x̄^k and u_i^k = y^k/ρ equal for all i
(after the first iteration, and from the start with equal initial duals), so
client i minimises g_i(x) + (ρ/2)‖x − x_i'^k + y^k/ρ‖², the same with
v_i = (ρ(x_i^k + (z^k − x̄^k)) − y^k)/(λ+ρ). In both,

    x_i^{k+1} = argmin_x f_i(x) + ((λ+ρ)/2)‖x − v_i‖² = prox_{f_i/(λ+ρ)}(v_i),
    v_i = (ρ(x_i^k + κ(z^k − x̄^k)) − y^k) / (λ + ρ).

z-update. "jacobi": s minimises −(λ/(2n))‖s‖² − ⟨y, s⟩ + (ρ/2)‖Σ x_i^{k+1} − s‖²,
strongly convex iff ρ > λ/n, with s = (y + ρ Σ x_i^{k+1})/(ρ − λ/n). "split":
the copies reduce to their mean z (Boyd §7.3), which minimises
−(nλ/2)‖z‖² + (nρ/2)‖z − x̄^{k+1} − y^k/ρ‖², strongly convex iff ρ > λ. Both:

    z^{k+1} = (y^k/κ + ρ x̄^{k+1}) / (ρ − λ/κ),           needs ρ > λ/κ,
    y^{k+1} = y^k + κρ (x̄^{k+1} − z^{k+1})               (dual update).

Substituting the first line into the second gives y^{k+1} = −λ z^{k+1} = ∇ℓ at
the new aggregate: the dual is pinned to the gradient of the concave part
(the identity Hong et al.'s analysis rests on); `init` starts from it,
y^0 = −λ z^0. A fixed point has x̄ = z and ∇f_i(x_i) + λx_i + y + ρ(x_i − x_i) = 0,
i.e. ∇f_i(x_i) + λ(x_i − x̄) = 0: exactly the stationarity of Φ (and of F).

Per round every client receives one vector, ρκ(z − x̄) − y (with its own
x_i^k it forms v_i), and sends x_i^{k+1}; the x_i' of "split" are never stored.
So `metrics["bits_up"]` = `metrics["bits_down"]` = 32 P per client (P the
model's parameters, sent as float32), every client taking part every round.

Exact or inexact x-update (`core.prox.prox_update`). With
`prox(v, rho, data, mask)` (e.g. `core.prox.prox_least_squares`,
`prox_quadratic`) the x-update is exact: `prox(v_i, λ + ρ, data, mask)`.
Otherwise it is K full-batch optax steps (`core.local.local_train` on the
client's S·B examples folded into one batch) from x_i^k with gradient
correction (λ+ρ)(x − v_i); the iteration is then deterministic and its fixed
points are still the stationary points above.

What is and is not guaranteed (experimental).
* "split" is an instance of Hong et al.'s nonconvex sharing problem with the
  smooth nonconvex block ℓ updated last and an identity coupling for it; their
  analysis says that for ρ large enough relative to L, the Lipschitz constant
  of ∇ℓ in the last block (L = λ here; ρ > L is what makes the z-subproblem
  convex, their sufficient condition asks for more, a constant multiple of
  L), and exact subproblem solutions, the augmented Lagrangian decreases and
  every limit point is a stationary point of Φ. For convex f_i, Φ is convex,
  so stationary points are minimisers. No rate is claimed, and nothing for
  the inexact x-update, stochastic losses or partial participation (not
  supported: every step needs every client).
* "jacobi" updates all x_i in parallel in the one-aggregate form (L = λ/n).
  Hong et al.'s sharing analysis is for Gauss-Seidel sweeps, and multi-block
  Jacobi ADMM can diverge even for convex problems (Deng, Lai, Peng, Yin,
  "Parallel multi-block ADMM with o(1/k) convergence", J. Sci. Comput. 71,
  2017): no guarantee at all.
* Measured, not proved (exact prox, quadratic f_i, n = 4, 10 and 16, λ from
  0.01 to 100; tests/test_mixture_admm.py, benchmarks/mixture_admm.py), with
  L = λ ("split") or λ/n ("jacobi"): both diverged for ρ just above L (always
  at 1.05 L, in several cases at 1.5-1.6 L); "split" converged in every case
  with ρ ≥ 2L; "jacobi" converged with ρ ≥ 2L for n = 4 and 16 but diverged
  at ρ = 2L for n = 10 with λ ≥ 1, and converged there from ρ = 4L. So
  "jacobi" accepts a smaller ρ (about n/2 times) but with no guarantee. The
  iteration count grows like (λ + ρ)/μ (μ the curvature of the f_i), so with
  ρ tied to λ, large λ (≥ 10³ on the test problem) converges very slowly.
* λ = 0 decouples the clients: both variants are then proximal-point
  iterations x_i ← prox_{f_i/ρ}(x_i) on each f_i, converging to the local
  minimisers (slowly when ρ is large).
* With a traced ρ (`jax.vmap` over ρ) the check ρ > λ/κ cannot run; an
  invalid ρ then gives a meaningless z-update (it maximises instead).

Metrics (`state.metrics`, after the step): `objective` F(x^{k+1}) (the
mixture objective, library scale), `primal_residual` √n ‖x̄^{k+1} − z^{k+1}‖,
`dual_residual` ρ√n ‖z^{k+1} − z^k‖, `stationarity`
max_i ‖x_i − x̄ + (1/λ)∇f_i(x_i)‖ at x^{k+1} (+inf when λ = 0) and
`gradient_residual` max_i ‖∇f_i(x_i) + λ(x_i − x̄)‖ (= n max_i ‖∂F/∂x_i‖, also
defined at λ = 0), `bits_up` and `bits_down` (32 P each, float32; above).
The residuals cost one extra gradient per client per round.

The clients' round is `core.rounds.client_round` without an aggregator (the
z-update reads the exact mean x̄ of the table), every client taking part every
round whatever its data or `weight`, as in `algorithms/mixture.py`.
Non-finite clients (the library's rule, docs/architecture.md "The round", in
ADMM terms, applied by the round: a client is finite when its new x_i, its
loss and its gradient are, `ClientOutput.checked`). A
client whose x_i^{k+1}, loss or gradient holds a NaN or Inf (a NaN in its
data, say) makes no step: its x_i stays at its last finite value (in
the table, and so in x̄ = (1/n) Σ_i x_i, where the block of a
client that did not move belongs: x_i is a variable of Φ whichever value it
holds, and ADMM with one block's update replaced by "keep x_i" is still the
exact ADMM of Φ restricted to x_i fixed), its non-finite x_i^{k+1} enters no
average, and z and y stay finite.
The metrics are then taken over the clients whose update was finite
(`objective` uses the mean loss over them, `stationarity` and
`gradient_residual` the max over them).

Data layout (as `algorithms/mixture.py`): one `step` is one iteration with all
n clients; `ClientBatches` holds every client's full data, `C = n`,
`client_id` a permutation of `arange(n)`; `weight` is ignored (uniform
weights). `state.params` is z (the server's aggregate, = x̄ at a fixed point),
`state.local_params` the personalized models x_i (leaves `[n, ...]`).
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
from fedjax_opt.core.local import masked_mean_loss
from fedjax_opt.core.rounds import client_round, every_client, full_participation_output
from fedjax_opt.core.server import finite_mean
from fedjax_opt.core.tree import global_norm, tree_bits
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_choice, check_full_participation, check_key, check_loss_fn,
                                        check_num_clients, check_positive, is_concrete)
from fedjax_opt.objectives import average, consensus_penalty

__all__ = ["MixtureADMMState", "mixture_admm", "VARIANTS"]

VARIANTS = ("jacobi", "split")
"""The two ADMM forms of the mixture problem (see the module docstring)."""

METRICS = ("objective", "primal_residual", "dual_residual", "stationarity", "gradient_residual", "num_nonfinite",
           "bits_up", "bits_down")
"""Names of `state.metrics` (scalars in the model's dtype; `num_nonfinite`, the clients whose update was not
finite and which kept their x_i, int32; `bits_up`, `bits_down`, float32); see the module docstring."""

_METRIC_DTYPES = {"num_nonfinite": jnp.int32, "bits_up": jnp.float32, "bits_down": jnp.float32}
"""The metrics not in the model's dtype."""


@flax.struct.dataclass
class MixtureADMMState:
  """State of mixture ADMM.

  Attributes:
    params: z, the server's aggregate variable (on the scale of x̄; = x̄ at a fixed point).
    local_params: the personalized models x_i, a per-client table (leaves `[n, ...]`).
    dual: y, the (unscaled) dual of the sharing constraint, a pytree like the model;
      y = −λ z after every iteration.
    round: k, iterations applied, int32.
    key: PRNG key (unused by the deterministic iteration; carried for the contract).
    metrics: `METRICS`.
  """

  params: PyTree
  local_params: PyTree
  dual: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _check_variant_rho(variant: str, lam: Any, rho: Any, num_clients: int) -> None:
  """ρ > λ/κ: the z-subproblem is strongly convex only then (κ = n for "jacobi", 1 for "split")."""
  if not (is_concrete(lam) and is_concrete(rho)):
    return
  kappa = num_clients if variant == "jacobi" else 1
  if not np.all(np.asarray(rho) > np.asarray(lam) / kappa):
    bound = "lam / num_clients" if variant == "jacobi" else "lam"
    raise ValueError(f"rho (ρ) must exceed {bound} = {np.asarray(lam) / kappa} for variant {variant!r} (otherwise "
                     f"the z-subproblem, whose coupling term −(λ/2n)‖Σx_i‖² is concave, has no minimiser); "
                     f"got rho = {rho}.")


def mixture_admm(
    loss_fn: LossFn,
    lam: Any,
    rho: Any,
    *,
    num_clients: int,
    prox: prox_lib.ProxFn | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    local_steps: int | None = None,
    variant: str = "jacobi",
) -> FederatedAlgorithm:
  """ADMM on the mixture problem written as a nonconvex sharing problem (experimental; see the module docstring).

  One `step` = one iteration with all n clients, κ = n ("jacobi") or 1 ("split"):

      v_i = (ρ(x_i + κ(z − x̄)) − y)/(λ + ρ),   x_i ← prox_{f_i/(λ+ρ)}(v_i)   (parallel)
      z ← (y/κ + ρ x̄)/(ρ − λ/κ),               y ← y + κρ(x̄ − z).

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`; f_i is its mean
      over client i's real examples (all S·B slots of the step's batches).
    lam: λ >= 0, the pull towards the average (may be traced).
    rho: ρ > 0, the penalty (may be traced, e.g. `jax.vmap` over ρ); must
      exceed λ/κ (checked when concrete).
    num_clients: n; every step must hold all n clients.
    prox: exact x-update `prox(v, rho, data, mask) = argmin_x f_i(x) + (ρ/2)‖x − v‖²`
      (`fo.algorithms.prox_least_squares`, `prox_quadratic`), called with λ + ρ.
      None: inexact x-update by `client_optimizer`.
    client_optimizer: any optax optimizer of the inexact x-update (required
      when `prox` is None): K full-batch steps from x_i on
      f_i + ((λ+ρ)/2)‖x − v_i‖², re-initialized every round.
    local_steps: K. None: K = S, the batches' local-step axis. Ignored with `prox`.
    variant: "jacobi" (Hong et al.'s one-aggregate form, parallel x_i; no
      guarantee) or "split" (Boyd's sharing form with copies x_i', which
      decouples the clients; covered by Hong et al. for ρ large enough).

  Returns:
    `FederatedAlgorithm(init, step)` with state `MixtureADMMState`.

  Raises:
    ValueError: λ < 0, ρ <= 0, ρ <= λ/κ, unknown `variant`, neither `prox` nor
      `client_optimizer`, `local_steps` < 1; at `step`, batches without exactly
      the n clients.
    TypeError: `num_clients` or `local_steps` not a Python int, `prox` not
      callable, `client_optimizer` not an optax optimizer.
  """
  check_loss_fn(loss_fn)
  check_positive(lam, "lam (λ, the pull towards the average)", allow_zero=True)
  prox_lib.check_rho(rho)
  check_choice(variant, "variant", VARIANTS)
  n = check_num_clients(num_clients)
  _check_variant_rho(variant, lam, rho, n)
  prox_lib.check_solver("mixture_admm", prox, client_optimizer, local_steps)
  kappa = float(n) if variant == "jacobi" else 1.0
  mode = client_map_lib.FromPolicy()
  value_and_grad = jax.value_and_grad(masked_mean_loss, argnums=1, has_aux=True)

  def client_update(shared, data, mask, x_i):
    penalty, broadcast = shared
    v_i = jax.tree.map(lambda xi, b: (rho * xi + b) / penalty, x_i, broadcast)
    new_x = prox_lib.prox_update(loss_fn, prox, client_optimizer, local_steps, v_i, penalty, x_i, data, mask)
    (loss, _), grad = value_and_grad(loss_fn, new_x, *prox_lib.client_examples(data, mask))
    return full_participation_output(x_i, (new_x,), loss, mask, checked=(loss, grad), extras=grad)

  def init(params: PyTree, key: jax.Array) -> MixtureADMMState:
    check_key(key)
    dtype = jnp.result_type(*jax.tree.leaves(params))
    return MixtureADMMState(
        params=params,
        local_params=per_client.broadcast(params, n),
        dual=jax.tree.map(lambda p: (-lam * p).astype(jnp.result_type(p)), params),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={name: jnp.zeros((), _METRIC_DTYPES.get(name, dtype)) for name in METRICS},
    )

  def step(state: MixtureADMMState, batches: ClientBatches) -> MixtureADMMState:
    check_full_participation(batches, n)
    z, y = state.params, state.dual
    # v_i = (ρ(x_i + κ(z − x̄)) − y)/(λ+ρ): the server broadcasts ρκ(z − x̄) − y.
    broadcast = jax.tree.map(lambda zz, xb, yy: rho * kappa * (zz - xb) - yy, z, average(state.local_params), y)
    out = client_round(mode, client_update, (lam + rho, broadcast), every_client(batches),
                       tables=(state.local_params,))
    finite, grads, losses = out.write, out.extras, out.results.loss  # a non-finite client keeps its x_i (docstring)
    local_params = out.stored[0].table
    new_x = per_client.gather(local_params, batches.client_id)  # x_i^{k+1} as stored, in batch order
    new_x_bar = average(local_params)
    new_z = jax.tree.map(lambda yy, xb, zz: ((yy / kappa + rho * xb) / (rho - lam / kappa)).astype(zz.dtype),
                         y, new_x_bar, z)
    new_y = jax.tree.map(lambda yy, xb, zz: (yy + kappa * rho * (xb - zz)).astype(yy.dtype), y, new_x_bar, new_z)

    # Stationarity of Φ at x^{k+1}: ∇f_i(x_i) + λ(x_i − x̄), in batch order (rows of new_x), finite clients only.
    residual = jax.tree.map(lambda g, xi, xb: g + lam * (xi - xb), grads, new_x, new_x_bar)
    per_client_norm = jnp.sqrt(sum(jnp.sum(jnp.square(r.reshape(n, -1)), axis=1)
                                   for r in jax.tree.leaves(residual)))
    gradient_residual = jnp.max(jnp.where(finite, per_client_norm, 0))
    safe_lam = jnp.where(lam > 0, lam, 1.0)
    stationarity = jnp.where(lam > 0, gradient_residual / safe_lam, jnp.inf)
    message = float(tree_bits(z))  # x_i^{k+1} up, ρκ(z − x̄) − y down: one model-sized vector each way
    values = {
        "objective": finite_mean(losses, finite) + lam * consensus_penalty(local_params),
        "primal_residual": np.sqrt(n) * global_norm(jax.tree.map(jnp.subtract, new_x_bar, new_z)),
        "dual_residual": rho * np.sqrt(n) * global_norm(jax.tree.map(jnp.subtract, new_z, z)),
        "stationarity": stationarity,
        "gradient_residual": gradient_residual,
        "num_nonfinite": out.agg.num_nonfinite,
        "bits_up": message,
        "bits_down": message,
    }
    return MixtureADMMState(
        params=new_z,
        local_params=local_params,
        dual=new_y,
        round=state.round + 1,
        key=state.key,
        metrics={name: jnp.asarray(values[name]).astype(state.metrics[name].dtype) for name in METRICS},
    )

  return FederatedAlgorithm(init, step)


mixture_admm = execution.accepts_policy_keywords(mixture_admm, refuses_aggregator=(
    "mixture ADMM's z-update and dual ascent are the exact steps of its augmented Lagrangian, on the exact "
    "mean x̄ of the clients' models; another rule minimises another objective"),
    evaluation="table", exchanges=(1, 1), hyperparameters={"lam": execution.REGULARIZER, "rho": execution.PENALTY,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "local_steps": execution.COUNT})
