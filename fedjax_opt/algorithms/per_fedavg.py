"""Per-FedAvg: federated meta-learning of a model that adapts in one gradient step.

Fallah, Mokhtari, Ozdaglar. "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach." NeurIPS 2020.
arXiv:2002.07948.

The global model w minimises the average loss *after* one step of local
adaptation, F(w) = (1/n) Σ_i f_i(w − α∇f_i(w)). One round with sampled clients S:

    client i, local steps k = 0 … K−1, three batches D, D', D'' per step:
        w̃     = w − α ∇f_i(w; D)                                  (temporary adapted model)
        g_k   = "maml": ∇_w [f_i(w − α∇f_i(w; D); D')]            (exact, autodiff through w̃)
                "hf":   (I − α ∇²f_i(w; D'')) ∇f_i(w̃; D')         (Hessian-free, exact HVP)
                "fo":   ∇f_i(w̃; D')                                (first order)
        w     ← w − β g_k
    server: w ← w + ServerOpt(−(1/|S|) Σ_{i∈S} (w_i − w))      (default sgd(1.0): the plain mean)

Where the batches come from. The client's `[S, B, ...]` batches are cut into
K = `local_steps` groups of m consecutive batches, m = 2 ("fo", "maml") or
3 ("hf"), so S must equal m·K: local step k uses D = batch m·k,
D' = batch m·k + 1 and (for "hf") D'' = batch m·k + 2. Each is a fresh
mini-batch as in the paper, and a batch never serves two roles.

The Hessian-vector product. The paper estimates ∇²f(w; D'') v by the finite
difference [∇f(w + δv; D'') − ∇f(w − δv; D'')]/(2δ). Here it is exact: the
forward-mode derivative of the gradient, `jax.jvp(∇f(·; D''), (w,), (v,))`,
which costs about one more gradient and has no δ to tune. `delta` is kept as
an option: `hessian="finite_difference"` uses the paper's estimate with it.

How it runs. Each variant is written as a per-example *meta-loss* whose
gradient at w is g_k (a straight-through w̃ for "fo", an added linear term
carrying the HVP for "hf"), so the local loop is `core.local.local_train`
with `optax.sgd(β)`: masking, empty-step skipping and the scan come from it.
A step whose D' is empty is skipped; an empty D gives w̃ = w. The reported
client loss is the post-adaptation loss f_i(w̃; D') before each step.

Evaluation. Per-FedAvg has no stored personalized models: client i's model is
one adaptation step from the global model on its own data,
`algorithm.personalize(state.params, data, mask)` = w − α∇f_i(w), with the α
the algorithm was built with (the `personalize` field of `fo.Evaluation`, the
`adapt_fn` of `fo.evaluate.adapted`; map it over clients with
`fo.client_map.map_clients` or `jax.vmap` for a stack).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.averaging import AveragingState, averaging_algorithm
from fedjax_opt.core.differentiation import refuse_derivative
from fedjax_opt.core.local import as_single_step, local_train, masked_mean_loss
from fedjax_opt.core.types import Aggregator, ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_choice, check_int, check_loss_fn, check_optimizer, check_positive

_DEFAULT_AGGREGATOR = aggregators_lib.mean
"""The rule `per_fedavg` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["HESSIANS", "VARIANTS", "hessian_vector_product", "meta_gradient", "per_fedavg"]

VARIANTS = ("fo", "hf", "maml")
HESSIANS = ("exact", "finite_difference")
STRAIGHT_THROUGH = ("Per-FedAvg's 'fo' and 'hf' updates are built with stop_gradient (a surrogate whose gradient is "
                    "the update; only variant='maml' is an honest function of w and α)")

ROLES = {"fo": "D, D'", "maml": "D, D'", "hf": "D, D', D''"}


def _grad(loss_fn: LossFn, w: PyTree, batch: PyTree, mask: jax.Array) -> PyTree:
  """∇f(w; batch), the gradient of the masked mean loss (0 on an empty batch)."""
  return jax.grad(lambda p: masked_mean_loss(loss_fn, p, batch, mask)[0])(w)


def _axpy(a: Any, x: PyTree, y: PyTree) -> PyTree:
  """y + a·x leaf-wise."""
  return jax.tree.map(lambda xi, yi: yi + a * xi, x, y)


def _vdot(x: PyTree, y: PyTree) -> jax.Array:
  return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def hessian_vector_product(loss_fn: LossFn, w: PyTree, batch: PyTree, mask: jax.Array, v: PyTree,
                           hessian: str = "exact", delta: Any = 1e-3) -> PyTree:
  """∇²f(w; batch) v: exact (forward-over-reverse) or the paper's central difference with δ."""
  grad = lambda p: _grad(loss_fn, p, batch, mask)
  if hessian == "exact":
    return jax.jvp(grad, (w,), (v,))[1]
  plus, minus = grad(_axpy(delta, v, w)), grad(_axpy(-delta, v, w))
  return jax.tree.map(lambda a, b: (a - b) / (2 * delta), plus, minus)


def _meta_loss(loss_fn: LossFn, alpha: Any, variant: str, hessian: str, delta: Any):
  """Per-example meta-loss `[B]` on D' whose masked-mean gradient at w is the variant's g_k.

  The batch is `{"inner", "inner_mask", "outer", "outer_mask"[, "hessian", "hessian_mask"]}`.
  """

  def loss(w, batch):
    adapted = _axpy(-alpha, _grad(loss_fn, w, batch["inner"], batch["inner_mask"]), w)
    if variant == "maml":
      return loss_fn(adapted, batch["outer"])
    # Straight-through: the value at w̃, the derivative of the identity (no second-order term).
    straight = jax.tree.map(lambda a, p: jax.lax.stop_gradient(a - p) + p, adapted, w)
    losses = loss_fn(straight, batch["outer"])
    if variant == "fo":
      return losses
    g_outer = jax.lax.stop_gradient(_grad(loss_fn, adapted, batch["outer"], batch["outer_mask"]))
    hvp = jax.lax.stop_gradient(hessian_vector_product(
        loss_fn, jax.lax.stop_gradient(w), batch["hessian"], batch["hessian_mask"], g_outer, hessian, delta))
    # −α⟨HVP, w − sg(w)⟩ is 0 in value and adds −α ∇²f(w; D'') ∇f(w̃; D') to every example's gradient.
    correction = -alpha * _vdot(hvp, jax.tree.map(lambda p: p - jax.lax.stop_gradient(p), w))
    return losses + correction

  return loss


def _group(data: PyTree, mask: jax.Array, variant: str) -> tuple[PyTree, jax.Array]:
  """`[m·K, B, ...]` batches → the meta-batch dict with leaves `[K, B, ...]` and the D' mask `[K, B]`."""
  m = 3 if variant == "hf" else 2
  split = lambda a: a.reshape((-1, m) + a.shape[1:])
  d, mk = jax.tree.map(split, data), split(mask)
  pick = lambda j: jax.tree.map(lambda a: a[:, j], d)
  batch = {"inner": pick(0), "inner_mask": mk[:, 0], "outer": pick(1), "outer_mask": mk[:, 1]}
  if variant == "hf":
    batch.update(hessian=pick(2), hessian_mask=mk[:, 2])
  return batch, mk[:, 1]


def meta_gradient(loss_fn: LossFn, alpha: Any, params: PyTree, inner: tuple[PyTree, jax.Array],
                  outer: tuple[PyTree, jax.Array], hessian_batch: tuple[PyTree, jax.Array] | None = None,
                  variant: str = "maml", *, hessian: str = "exact", delta: Any = 1e-3) -> PyTree:
  """One local step's meta-gradient g (see the module docstring) at `params`.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    alpha: α, the adaptation step size.
    params: w.
    inner, outer, hessian_batch: `(batch [B, ...], mask [B])` for D, D' and D''
      (D'' only for "hf").
    variant: "fo", "hf" or "maml".
    hessian, delta: the HVP of "hf" ("exact" or "finite_difference" with δ).

  Returns:
    g, a pytree like `params`.
  """
  _check_variant(variant, hessian)
  batch = {"inner": inner[0], "inner_mask": inner[1], "outer": outer[0], "outer_mask": outer[1]}
  if variant == "hf":
    if hessian_batch is None:
      raise ValueError("hessian_batch (D'') is required for variant='hf'.")
    batch.update(hessian=hessian_batch[0], hessian_mask=hessian_batch[1])
  meta = _meta_loss(loss_fn, alpha, variant, hessian, delta)
  return jax.grad(lambda p: masked_mean_loss(meta, p, batch, outer[1])[0])(params)


def _check_variant(variant: str, hessian: str) -> None:
  check_choice(variant, "variant", VARIANTS)  # first order, Hessian-free, exact MAML
  check_choice(hessian, "hessian", HESSIANS)


def per_fedavg(
    loss_fn: LossFn,
    alpha: Any,
    beta: Any,
    delta: Any = 1e-3,
    *,
    local_steps: int,
    variant: str = "fo",
    hessian: str = "exact",
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
) -> FederatedAlgorithm:
  """Per-FedAvg (Fallah et al. 2020): K local meta-steps w ← w − β g per client, then averaging.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    alpha: α > 0, the adaptation (inner) step size (may be traced). A bare
      step size: the personalized model is the one gradient step w − α∇f_i(w)
      that the meta-objective F(w) = (1/n) Σ_i f_i(w − α∇f_i(w)) is built on.
    beta: β > 0, the meta (outer) step size (may be traced); the paper's
      local update is plain SGD w ← w − βg on the meta-gradient.
    delta: δ > 0 of the paper's finite-difference HVP; used only with
      `hessian="finite_difference"`.
    local_steps: K ≥ 1 (Python int). `batches` must have S = m·K local steps,
      m = 2 for "fo"/"maml" and 3 for "hf" (D, D', D'' consecutive).
    variant: "fo" (first order), "hf" (Hessian-free) or "maml" (exact).
    hessian: "exact" (jvp, the default) or "finite_difference" (the paper's).
    server_optimizer: fed the pseudo-gradient −Δ; default `optax.sgd(1.0)`,
      the paper's plain average.
    aggregator: how the clients' Δ are averaged; default `aggregators.mean()`
      (the paper's uniform 1/|S|).

  Returns:
    `FederatedAlgorithm(init, step, personalize)` with state `AveragingState`
    (`fedjax_opt.algorithms.fedavg.FedAvgState`; `params` is the meta-model w).
    `personalize(params, data [S, B, ...], mask [S, B]) -> params` is client
    i's personalized model, one adaptation step w − α∇f_i(w) on all its S·B
    example slots.
  """
  check_loss_fn(loss_fn)
  check_positive(alpha, "alpha")
  check_positive(beta, "beta")
  check_positive(delta, "delta")
  local_steps = check_int(local_steps, "local_steps")
  _check_variant(variant, hessian)
  server_optimizer = check_optimizer(optax.sgd(1.0) if server_optimizer is None else server_optimizer,
                                     "server_optimizer")
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)
  m = 3 if variant == "hf" else 2
  straight_through = variant != "maml"
  if straight_through:  # the surrogate's stop_gradients drop how w and α move w̃ for any outer derivative
    alpha = refuse_derivative(alpha, STRAIGHT_THROUGH)
  meta = _meta_loss(loss_fn, alpha, variant, hessian, delta)
  meta_optimizer = optax.sgd(beta)
  adapt_optimizer = optax.sgd(alpha)

  def client_update(params, data, mask):
    if straight_through:
      params = refuse_derivative(params, STRAIGHT_THROUGH)
    batch, outer_mask = _group(data, mask, variant)
    return local_train(meta, meta_optimizer, params, batch, outer_mask)

  def personalize(params: PyTree, data: PyTree, mask: jax.Array) -> PyTree:
    adapted = local_train(loss_fn, adapt_optimizer, params, *as_single_step(data, mask))
    return jax.tree.map(jnp.add, params, adapted.delta)

  inner = averaging_algorithm(client_update, server_optimizer, aggregator, client_map_lib.FromPolicy())

  def step(state: AveragingState, batches: ClientBatches) -> AveragingState:
    if isinstance(batches, ClientBatches) and batches.mask.ndim == 3 and batches.local_steps != m * local_steps:
      raise ValueError(
          f"per_fedavg(variant={variant!r}, local_steps={local_steps}) needs batches with S = {m} × local_steps = "
          f"{m * local_steps} local steps ({ROLES[variant]} per step); "
          f"got S = {batches.local_steps}.")
    return inner.step(state, batches)

  return FederatedAlgorithm(inner.init, step, personalize)


per_fedavg = execution.accepts_policy_keywords(per_fedavg, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="adapt", exchanges=(1, 1), hyperparameters={"alpha": execution.CLIENT_STEP_SIZE,
        "beta": execution.CLIENT_STEP_SIZE, "delta": execution.SCALE, "local_steps": execution.COUNT,
        "server_optimizer": execution.SERVER_OPTIMIZER})
