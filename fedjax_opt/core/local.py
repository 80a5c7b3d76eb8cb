"""Local training: the one loop every algorithm runs on a client.

`local_train` is a `lax.scan` over a client's S local steps. Step s takes the
masked mean of the per-example loss over the real examples of batch s,

    f_s(x) = (1 / n_s) Σ_b m_{s,b} ℓ(x; z_{s,b}),     n_s = Σ_b m_{s,b},

adds an optional gradient correction (FedProx's μ(x − x_t), SCAFFOLD's
c − c_i, ...), and applies any optax client optimizer. A step with no real
example (n_s = 0, padding) leaves the parameters *and* the optimizer state
untouched, so padding never changes the result.

It returns the client delta Δ = x_S − x_0, the mean loss over the client's
real examples (each loss taken before the step that used it), and the
number of examples and of non-empty steps.

Precision. The losses of local training are taken by `masked_mean_loss`, so
the execution policy's `precision="bfloat16"` (`core.execution`) runs every
step's forward and backward pass in bfloat16 while x, the optimizer state
and Δ stay in the model's dtype (mixed-precision training).

Differentiating through local training (`fo.hyper`). Inside
`checkpointed_local_steps()`, every `local_train` traced makes each local step
a `jax.checkpoint`: a reverse pass through the round then keeps each step's
starting point (x_s and the optimizer state, per client) instead of the
step's activations and gradient intermediates, and recomputes one step at a
time. Same values and derivatives; less memory, one more forward pass of
each step. The setting is read when a step is traced, so it applies to every
algorithm built on `local_train` without a keyword of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_opt.core import execution
from fedjax_opt.core.tree import select_tree
from fedjax_opt.core.types import LossFn, PyTree
from fedjax_opt.core.validation import check_per_example_loss

__all__ = ["LocalResult", "as_single_step", "checkpointed_local_steps", "cycle_steps", "local_train",
           "masked_mean_loss"]

_CHECKPOINT_STEPS = contextvars.ContextVar("fedjax_opt_checkpoint_local_steps", default=False)


@contextlib.contextmanager
def checkpointed_local_steps(enabled: bool = True) -> Iterator[None]:
  """While tracing inside this context, each step of `local_train` is a `jax.checkpoint` (module docstring)."""
  if not isinstance(enabled, bool):
    raise TypeError(f"enabled must be a bool; got {type(enabled).__name__}.")
  token = _CHECKPOINT_STEPS.set(enabled)
  try:
    yield
  finally:
    _CHECKPOINT_STEPS.reset(token)


class LocalResult(NamedTuple):
  """What a client sends back (and reports) after local training.

  Attributes:
    delta: x_S − x_0, a pytree like params.
    loss: scalar, mean per-example loss over the client's real examples.
    num_examples: scalar float, Σ mask.
    num_steps: scalar int32, local steps that had at least one real example.
  """

  delta: PyTree
  loss: jax.Array
  num_examples: jax.Array
  num_steps: jax.Array


def _cast_floating(tree: PyTree, dtype) -> PyTree:
  """Every floating leaf of `tree` cast to `dtype`; other leaves (labels, masks, keys) as they are."""
  return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a, tree)


def masked_mean_loss(loss_fn: LossFn, params: PyTree, batch: PyTree, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean of `loss_fn(params, batch)` over the examples where `mask` `[B]` is True.

  Under the execution policy's `precision="bfloat16"` (`core.execution`) the
  floating parameters and data are cast to bfloat16 for `loss_fn` and the
  per-example losses back to float32 (the default float: float64 under x64):
  the forward and backward passes run in bfloat16, while the parameters the
  gradient is taken with respect to, and the gradient itself, keep their dtype.

  Returns:
    (mean loss, number of real examples); the mean is 0 when there are none.
  """
  low = execution.compute_dtype()
  if low is None:
    losses = loss_fn(params, batch)
  else:  # mixed precision: the pass in bfloat16, the loss (and so the gradient w.r.t. params) back in their dtype
    losses = loss_fn(_cast_floating(params, low), _cast_floating(batch, low)).astype(jnp.result_type(float))
  check_per_example_loss(losses, mask.shape[0])
  count = jnp.sum(mask, dtype=losses.dtype)
  total = jnp.sum(jnp.where(mask, losses, jnp.zeros_like(losses)))
  return total / jnp.maximum(count, 1), count


def local_train(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: PyTree,
    data: PyTree,
    mask: jax.Array,
    *,
    gradient_correction: Callable[[PyTree], PyTree] | None = None,
    unroll: int | bool = 1,
) -> LocalResult:
  """Runs S masked local steps of `optimizer` on one client.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    optimizer: any optax client optimizer (a fresh state is made from `params`).
    params: the starting point x_0 (usually the server model).
    data: the client's batches, a pytree of `[S, B, ...]` arrays.
    mask: `[S, B]` bool, True on real examples.
    gradient_correction: optional `h(x) -> pytree`; each step descends along
      ∇f_s(x) + h(x) instead of ∇f_s(x).
    unroll: passed to `lax.scan`, for callers of this primitive (the central
      baseline of benchmarks/throughput.py). Algorithms leave it at 1: their
      one unroll knob is the client map's flag (`client_map="sequential:unroll"`).

  Returns:
    A `LocalResult`.
  """
  if jnp.ndim(mask) != 2:
    raise ValueError(f"local_train: mask must be [S, B]; got shape {tuple(jnp.shape(mask))}.")

  grad_fn = jax.value_and_grad(masked_mean_loss, argnums=1, has_aux=True)

  def one_step(carry, inputs):
    x, opt_state, loss_sum = carry
    batch, m = inputs
    (loss, count), grads = grad_fn(loss_fn, x, batch, m)
    if gradient_correction is not None:
      grads = jax.tree.map(jnp.add, grads, gradient_correction(x))
    updates, new_opt_state = optimizer.update(grads, opt_state, x)
    new_x = optax.apply_updates(x, updates)
    has_data = count > 0
    x = select_tree(has_data, new_x, x)
    opt_state = select_tree(has_data, new_opt_state, opt_state)
    return (x, opt_state, loss_sum + loss * count), has_data

  def steps(params, data, mask):
    init = (params, optimizer.init(params), jnp.zeros((), jnp.result_type(float)))
    (final, _, loss_sum), used = jax.lax.scan(one_step, init, (data, mask), unroll=unroll)
    return final, loss_sum, used

  if _CHECKPOINT_STEPS.get():
    one_step = jax.checkpoint(one_step)
    steps = jax.checkpoint(steps)
  final, loss_sum, used = steps(params, data, mask)
  num_examples = jnp.sum(mask, dtype=loss_sum.dtype)
  delta = jax.tree.map(jnp.subtract, final, params)
  return LocalResult(
      delta=delta,
      loss=loss_sum / jnp.maximum(num_examples, 1),
      num_examples=num_examples,
      num_steps=jnp.sum(used, dtype=jnp.int32),
  )


def as_single_step(data: PyTree, mask: jax.Array) -> tuple[PyTree, jax.Array]:
  """Folds a client's `[S, B, ...]` batches into one step of S·B examples, `[1, S·B, ...]`.

  With `optax.sgd(1.0)` and one step, `local_train` on the result returns
  Δ = −∇f_k(x), the gradient of the client's mean loss over all its real
  examples: FedSGD's client computation, with no second training loop.
  """
  folded = jax.tree.map(lambda a: a.reshape((1, -1) + a.shape[2:]), data)
  return folded, mask.reshape(1, -1)


def cycle_steps(data: PyTree, mask: jax.Array, num_steps: int) -> tuple[PyTree, jax.Array]:
  """`num_steps` local steps over a client's S batches, step k using batch k mod S.

  Args:
    data: leaves `[S, B, ...]`.
    mask: `[S, B]`.
    num_steps: K (Python int), the number of steps wanted.

  Returns:
    (data with leaves `[K, B, ...]`, mask `[K, B]`), with static indices.
  """
  index = jnp.arange(num_steps) % mask.shape[0]
  return jax.tree.map(lambda a: jnp.take(a, index, axis=0), data), jnp.take(mask, index, axis=0)
