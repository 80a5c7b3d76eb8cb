"""The proximal x-update shared by the ADMM family: exact by a user prox, or inexact by local steps.

ADMM-type methods (consensus ADMM, GADMM / CQ-GGADMM, mixture ADMM) update a
client's model by

    x⁺ = argmin_x f(x) + (c/2) ‖x − v‖²  =  prox_{f/c}(v)

for a penalty c > 0 and a point v that the method builds from its duals and
neighbours. `prox_update` computes it exactly when the caller has a proximal
operator `prox(v, c, data, mask)` (closed forms: `prox_least_squares`,
`prox_quadratic` in `fedjax_opt.algorithms.admm`), or inexactly with K optax
steps of `local_train` on f over the client's whole data (every step sees all
of its examples), with the gradient of the penalty, c (x − v), added to each
step and warm-started from the client's previous model.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from fedjax_opt.core.local import as_single_step, local_train
from fedjax_opt.core.types import LossFn, PyTree
from fedjax_opt.core.validation import check_optimizer

ProxFn = Callable[[PyTree, Any, PyTree, jax.Array], PyTree]


def check_solver(name: str, prox: ProxFn | None, local_optimizer: optax.GradientTransformation | None,
                 local_steps: Any) -> None:
  """Either a callable `prox`, or a `local_optimizer` (with an optional positive int `local_steps`)."""
  if prox is None:
    if local_optimizer is None:
      raise ValueError(f"{name} needs prox (exact x-update) or local_optimizer (inexact x-update by local_train); "
                       "got neither.")
    check_optimizer(local_optimizer, "local_optimizer")
  elif not callable(prox):
    raise TypeError(f"prox must be callable prox(v, rho, data, mask); got {type(prox).__name__}.")
  if local_steps is not None and (isinstance(local_steps, bool) or not isinstance(local_steps, int)
                                  or local_steps < 1):
    raise ValueError(f"local_steps must be a positive int or None; got {local_steps!r}.")


def prox_update(loss_fn: LossFn, prox: ProxFn | None, local_optimizer: optax.GradientTransformation | None,
                local_steps: int | None, v: PyTree, penalty: Any, start: PyTree, data: PyTree, mask: jax.Array,
                unroll: int | bool = 1) -> PyTree:
  """argmin_x f(x) + (penalty/2)‖x − v‖², f = the masked mean loss over the client's data.

  Args:
    loss_fn: per-example loss.
    prox: exact proximal operator `prox(v, penalty, data, mask)`, or None.
    local_optimizer: the optax optimizer of the inexact update (when `prox` is None).
    local_steps: K inexact steps (None: S, the client's number of batches).
    v: the prox centre.
    penalty: c > 0 (may be traced, per client).
    start: the model the inexact steps start from (the client's previous x).
    data: the client's batches, leaves `[S, B, ...]`.
    mask: `[S, B]`.
    unroll: `lax.scan` unroll of the inexact steps.

  Returns:
    x⁺, a pytree like `v`.
  """
  if prox is not None:
    return prox(v, penalty, data, mask)
  folded, folded_mask = as_single_step(data, mask)
  steps = mask.shape[0] if local_steps is None else local_steps
  repeated = jax.tree.map(lambda a: jnp.broadcast_to(a, (steps,) + a.shape[1:]), folded)
  repeated_mask = jnp.broadcast_to(folded_mask, (steps,) + folded_mask.shape[1:])

  def penalty_gradient(x):
    return jax.tree.map(lambda xx, vv: penalty * (xx - vv), x, v)

  result = local_train(loss_fn, local_optimizer, start, repeated, repeated_mask,
                       gradient_correction=penalty_gradient, unroll=unroll)
  return jax.tree.map(jnp.add, start, result.delta)
