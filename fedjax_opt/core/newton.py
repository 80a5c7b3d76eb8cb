"""The second-order pieces of the Newton-type distributed methods (DANE, FedDANE, FADL, GIANT, one-shot averaging).

On client k's data of the round, f_k(w) is the masked mean loss over its
real examples, all S·B slots at once (`core.local.as_single_step`); the
global objective is f(w) = Σ_k n_k f_k(w) / Σ_k n_k, the pooled empirical
risk (n_k = `batches.weight`, the library's example counts).

* `hessian_vector_product`: ∇²f_k(w) v by forward-over-reverse
  differentiation (`jax.jvp` of `jax.grad`), without the P × P matrix.
* `conjugate_gradient(matvec, b, iters)`: CG for A x = b (A symmetric
  positive semi-definite) from x = 0: r = b − Ax, p = r;
  α = rᵀr / pᵀAp, x += αp, r −= αAp, p = r + (r'ᵀr' / rᵀr) p. An iteration
  with no positive curvature left (pᵀAp ≤ 0, e.g. once r = 0) changes nothing,
  so extra iterations are harmless. In exact arithmetic P iterations solve a
  P × P positive definite system.
* `newton_solve`: argmin_w F(w), F(w) = f_k(w) + ⟨ℓ, w⟩ + (c/2)‖w − v‖², by K
  Newton steps from a start, w ← w − (∇²f_k(w) + cI)⁻¹ ∇F(w), each system
  solved directly (the `[P, P]` Hessian of the flattened params, small models)
  or by CG with Hessian-vector products. For quadratic f_k one direct step is
  the exact minimiser (the argument of `core.prox.prox_quadratic`, with the
  linear term added). An ill-posed system (c = 0 and a singular ∇²f_k) gives a
  non-finite solution under the direct solve: the client is then dropped by the
  round's guard.
* `armijo_step`: backtracking on the global objective. From the values
  f(w + α_j d) at α_j = 2^{−j}, j = 0 … J−1, and f(w), the largest α_j with
  f(w + α_j d) ≤ f(w) + β α_j ⟨∇f(w), d⟩ (Armijo's condition); 0 (no step)
  when none holds.
* `gradient_round`, `line_search_round`: the two exchanges these methods
  share, on `core.rounds.client_round` (its rules for taking part and for
  non-finite clients): every client sends ∇f_k(w_t) (and f_k(w_t)) and the
  server forms their n_k-weighted mean; every client sends f_k(w_t + α_j d)
  for the J candidate steps and the server forms the same mean, from which
  `armijo_step` picks the step.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.differentiation import refuse_derivative
from fedjax_opt.core.local import LocalResult, as_single_step, masked_mean_loss
from fedjax_opt.core.rounds import ClientOutput, Round, client_round
from fedjax_opt.core.server import ROUND_METRICS
from fedjax_opt.core.tree import global_norm
from fedjax_opt.core.types import Aggregator, ClientBatches, LossFn, PyTree
from fedjax_opt.core.validation import check_int, check_key, check_probability

__all__ = ["LINE_SEARCH_OVERFLOW", "NEWTON_METRICS", "NewtonState", "armijo_step", "check_line_search", "client_data",
           "conjugate_gradient", "gradient_round", "gradient_then_local_round", "hessian_vector_product",
           "initial_newton_state", "line_search_round", "newton_metrics", "newton_solve", "step_sizes",
           "taking_part_after"]

LINE_SEARCH_OVERFLOW = 1e30
"""What a client reports for a candidate step at which its loss is not finite (an overflow far along d): a value
that fails Armijo's test without making the server's average non-finite."""


def client_data(data: PyTree, mask: jax.Array) -> tuple[PyTree, jax.Array]:
  """A client's `[S, B, ...]` batches as one batch of its S·B slots, `[S·B, ...]`, and its mask `[S·B]`."""
  folded, folded_mask = as_single_step(data, mask)
  return jax.tree.map(lambda a: a[0], folded), folded_mask[0]


def _flat_objective(loss_fn: LossFn, params: PyTree, batch: PyTree, mask: jax.Array):
  flat, unravel = ravel_pytree(params)
  return flat, unravel, lambda theta: masked_mean_loss(loss_fn, unravel(theta), batch, mask)[0]


def hessian_vector_product(loss_fn: LossFn, params: PyTree, batch: PyTree, mask: jax.Array, v: PyTree) -> PyTree:
  """∇²f(w) v for f the masked mean loss over `batch` `[n, ...]` (mask `[n]`), w = `params`; no P × P matrix."""
  grad = jax.grad(lambda p: masked_mean_loss(loss_fn, p, batch, mask)[0])
  return jax.jvp(grad, (params,), (v,))[1]


def conjugate_gradient(matvec: Callable[[jax.Array], jax.Array], b: jax.Array, iters: int) -> jax.Array:
  """`iters` CG iterations for A x = b from x = 0 (module docstring); `matvec(p) = A p`, b a vector."""
  def body(_, carry):
    x, r, p, rr = carry
    ap = matvec(p)
    curvature = jnp.vdot(p, ap)
    ok = curvature > 0
    alpha = jnp.where(ok, rr / jnp.where(ok, curvature, 1), 0)
    x = x + alpha * p
    r = r - alpha * ap
    new_rr = jnp.vdot(r, r)
    beta = jnp.where(ok & (rr > 0), new_rr / jnp.where(rr > 0, rr, 1), 0)
    return x, r, jnp.where(ok, r + beta * p, p), jnp.where(ok, new_rr, rr)

  x0 = jnp.zeros_like(b)
  return jax.lax.fori_loop(0, iters, body, (x0, b, b, jnp.vdot(b, b)))[0]


def newton_solve(loss_fn: LossFn, start: PyTree, data: PyTree, mask: jax.Array, *, steps: int,
                 cg_iters: int | None, penalty: Any = 0.0, centre: PyTree = None, linear: PyTree = None) -> PyTree:
  """argmin_w f(w) + ⟨ℓ, w⟩ + (c/2)‖w − v‖² by `steps` Newton steps from `start` (module docstring).

  Args:
    loss_fn: per-example loss; f is its masked mean over the client's S·B slots.
    start: the first iterate (a pytree like the model).
    data, mask: the client's batches `[S, B, ...]`, `[S, B]`.
    steps: K Newton steps (Python int >= 1).
    cg_iters: None (solve each Newton system directly, with the `[P, P]` Hessian) or the CG iterations (Python
      int, Hessian-vector products only).
    penalty: c >= 0 (may be traced).
    centre: v (None: no proximal term's centre needed when c = 0; taken as `start`).
    linear: ℓ, a pytree like the model (None: 0).

  Returns:
    The last iterate, in `start`'s dtypes.
  """
  batch, m = client_data(data, mask)
  flat_start, unravel, f = _flat_objective(loss_fn, start, batch, m)
  flat_centre = flat_start if centre is None else ravel_pytree(centre)[0].astype(flat_start.dtype)
  flat_linear = jnp.zeros_like(flat_start) if linear is None else ravel_pytree(linear)[0].astype(flat_start.dtype)
  c = jnp.asarray(penalty, flat_start.dtype)
  grad_f = jax.grad(f)

  def one(_, theta):
    g = grad_f(theta) + flat_linear + c * (theta - flat_centre)
    if cg_iters is None:
      h = jax.hessian(f)(theta)
      d = jnp.linalg.solve(h + c * jnp.eye(theta.size, dtype=h.dtype), g)
    else:
      d = conjugate_gradient(lambda v: jax.jvp(grad_f, (theta,), (v,))[1] + c * v, g, cg_iters)
    return theta - d

  flat = jax.lax.fori_loop(0, steps, one, flat_start)
  return jax.tree.map(lambda a, s: a.astype(jnp.result_type(s)), unravel(flat), start)


def step_sizes(num: int) -> np.ndarray:
  """The line search's candidates α_j = 2^{−j}, j = 0 … J−1 (float32)."""
  return np.power(2.0, -np.arange(num)).astype(np.float32)


def check_line_search(line_search_steps: Any, armijo: Any) -> None:
  """J >= 1 candidates (a Python int) and Armijo's β in (0, 1)."""
  check_int(line_search_steps, "line_search_steps (J, the candidate steps 1, 1/2, …, 2^{1−J})")
  check_probability(armijo, "armijo (β of Armijo's condition)")


def armijo_step(values: jax.Array, slope: jax.Array, armijo: Any) -> jax.Array:
  """The largest α_j = 2^{−j} with f(w + α_j d) ≤ f(w) + β α_j slope; 0 when none holds.

  Args:
    values: `[J + 1]`, f(w) then f(w + α_j d) for j = 0 … J−1.
    slope: ⟨∇f(w), d⟩.
    armijo: β.
  """
  values, slope, armijo = refuse_derivative((values, slope, armijo), "the backtracking line search's "
                                            "accepted step (Armijo's test: a run is piecewise constant in it)")
  alphas = jnp.asarray(step_sizes(values.shape[0] - 1), values.dtype)
  ok = jnp.isfinite(values[1:]) & (values[1:] <= values[0] + armijo * alphas * slope)
  first = jnp.argmax(ok)
  return jnp.where(jnp.any(ok), alphas[first], jnp.zeros((), values.dtype))


def gradient_round(mode: client_map_lib.ClientMap | str | None, loss_fn: LossFn, params: PyTree,
                   batches: ClientBatches, aggregator: Aggregator, key: jax.Array) -> Round:
  """Every client of the round sends ∇f_k(w) (its `LocalResult.delta`, the update) and reports f_k(w).

  `aggregator` is the n_k-weighted mean: `Round.agg.update` is then ∇f(w) over the clients that took part
  (a client without a real example takes no part; a non-finite gradient is dropped and counted).
  """
  def client_update(w, data, mask):
    batch, m = client_data(data, mask)
    (loss, count), grad = jax.value_and_grad(masked_mean_loss, argnums=1, has_aux=True)(loss_fn, w, batch, m)
    return ClientOutput(LocalResult(delta=grad, loss=loss, num_examples=count,
                                    num_steps=(count > 0).astype(jnp.int32)))

  return client_round(mode, client_update, params, batches, aggregator=aggregator, aggregator_state=(), key=key)


def gradient_then_local_round(mode: client_map_lib.ClientMap | str | None, loss_fn: LossFn,
                              client_update: Callable, params: PyTree, batches: ClientBatches, aggregator: Aggregator,
                              gradient_key: jax.Array, local_key: jax.Array) -> tuple[Round, Round, ClientBatches]:
  """The two exchanges DANE, FADL and GIANT open a round with: the clients' gradients (`gradient_round`, g its
  mean), then `client_update((w, g), data, mask)` on the clients that took part in the first, averaged the same way.

  Returns (the gradient exchange, the local exchange, the local exchange's clients).
  """
  gradient = gradient_round(mode, loss_fn, params, batches, aggregator, gradient_key)
  taking_part = taking_part_after(gradient, batches)
  local = client_round(mode, client_update, (params, gradient.agg.update), taking_part, aggregator=aggregator,
                       aggregator_state=(), key=local_key)
  return gradient, local, taking_part


def line_search_round(mode: client_map_lib.ClientMap | str | None, loss_fn: LossFn, params: PyTree,
                      direction: PyTree, num_steps: int, batches: ClientBatches, aggregator: Aggregator,
                      key: jax.Array) -> Round:
  """Every client sends [f_k(w), f_k(w + α_j d) for α_j = 2^{−j}, j < J] (`Round.agg.update` is their mean).

  A candidate at which a client's loss is not finite is sent as `LINE_SEARCH_OVERFLOW` (it then fails Armijo's
  test); the client is dropped only when its loss at w itself is not finite.
  """
  alphas = step_sizes(num_steps)

  def client_update(shared, data, mask):
    w, d = shared
    batch, m = client_data(data, mask)

    def at(alpha):
      return masked_mean_loss(loss_fn, jax.tree.map(lambda p, q: p + alpha.astype(p.dtype) * q, w, d), batch, m)[0]

    base, count = masked_mean_loss(loss_fn, w, batch, m)
    moved = jax.vmap(at)(jnp.asarray(alphas))
    moved = jnp.where(jnp.isfinite(moved), moved, jnp.asarray(LINE_SEARCH_OVERFLOW, moved.dtype))
    values = jnp.concatenate([base[None], moved])
    return ClientOutput(LocalResult(delta=values, loss=base, num_examples=count,
                                    num_steps=(count > 0).astype(jnp.int32)))

  return client_round(mode, client_update, (params, direction), batches, aggregator=aggregator,
                      aggregator_state=(), key=key)


# ----------------------------------------------------------------------------- state and metrics


@flax.struct.dataclass
class NewtonState:
  """State of the Newton-type methods (DANE, FedDANE, FADL, GIANT): the model and the round's diagnostics.

  Attributes:
    params: the global model w_t.
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (carried for the contract; the exchanges draw nothing).
    metrics: `NEWTON_METRICS`.
  """

  params: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


NEWTON_METRICS = {**ROUND_METRICS, "gradient_norm": jnp.float32, "step_size": jnp.float32}
"""`state.metrics` of the Newton-type methods after a round.

* client_loss: f(w_t), the n_k-weighted mean of the clients' losses at the model they received;
* gradient_norm: ‖∇f(w_t)‖ of the averaged gradient;
* update_norm: ‖w_{t+1} − w_t‖;
* step_size: the step taken along the averaged direction (1 without a line search; 0 when the line search
  found none or the round was rejected);
* num_clients: clients whose second message (local solution, Newton direction) was averaged;
* num_nonfinite: clients dropped in any exchange of the round because what they sent was not finite;
* num_examples: examples of the clients counted in the gradient;
* round_accepted: False when an exchange had no finite client (the model is unchanged);
* bits_up: mean bits sent per client that took part in the gradient exchange, summed over the exchanges;
* bits_down: bits each client received (each algorithm's docstring lists them).
"""


def initial_newton_state(params: PyTree, key: jax.Array) -> NewtonState:
  """The state before the first round."""
  check_key(key)
  return NewtonState(params=params, round=jnp.zeros((), jnp.int32), key=key,
                     metrics={name: jnp.zeros((), dt) for name, dt in NEWTON_METRICS.items()})


def taking_part_after(exchange: Round, batches: ClientBatches) -> ClientBatches:
  """`batches` with the weight of every client that took no part in `exchange`, or was dropped from it, at 0."""
  keep = (exchange.weights > 0) & exchange.agg.finite
  return batches.replace(weight=jnp.where(keep, batches.weight, jnp.zeros_like(batches.weight)))


def newton_metrics(gradient: Round, exchanges: tuple[Round, ...], update: PyTree, step_size: jax.Array,
                   accepted: jax.Array, bits_down: float) -> dict[str, jax.Array]:
  """`NEWTON_METRICS` of a round: `gradient` the gradient exchange, `exchanges` every exchange (it included), in
  order, the second of them the one whose clients are counted in `num_clients`."""
  first = gradient.metrics()
  second = exchanges[1]
  sent = sum(jnp.where(r.weights > 0, r.bits_up, 0) for r in exchanges)
  taking_part = gradient.weights > 0
  values = {
      "client_loss": first["client_loss"],
      "gradient_norm": global_norm(gradient.agg.update),
      "update_norm": global_norm(update),
      "step_size": jnp.where(accepted, step_size, 0),
      "num_clients": jnp.sum((second.weights > 0) & second.agg.finite & accepted),
      "num_nonfinite": sum(r.agg.num_nonfinite for r in exchanges),
      "num_examples": first["num_examples"],
      "round_accepted": accepted,
      "bits_up": jnp.sum(jnp.where(taking_part, sent, 0)) / jnp.maximum(jnp.sum(taking_part), 1),
      "bits_down": jnp.asarray(bits_down),
  }
  return {name: jnp.asarray(values[name]).astype(dt) for name, dt in NEWTON_METRICS.items()}
