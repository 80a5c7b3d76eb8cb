"""The `Model` bundle and per-example classification losses built from any `apply`.

Algorithms see a model only through two things: a per-example loss
`loss_fn(params, batch) -> [B]` and the initial `params` (any pytree). This
module builds those from whatever the user has:

* `classification_loss(apply_fn)` / `classification_accuracy(apply_fn)` turn a
  plain `apply_fn(params, x) -> logits [B, K]` into per-example softmax
  cross-entropy and 0/1 accuracy. Plain-jnp functions and flax nnx modules
  (through `nnx.split` / `nnx.merge`) plug in here.
* `from_flax(module, input_shape)` wraps a flax linen module mapping
  `x -> logits` into a `Model`.

Batches are dicts `{"x": [B, ...] float, "y": [B] int}`. Losses are never
averaged here: the library masks padding and averages, so padding, client
weighting and per-example clipping stay exact.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Mapping, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["Model", "classification_accuracy", "classification_loss", "count_params", "from_flax"]

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]
"""`apply_fn(params, x [B, ...]) -> logits [B, K]`."""
BatchFn = Callable[[PyTree, Mapping[str, jax.Array]], jax.Array]
"""`fn(params, batch) -> [B]`, one value per example."""


class Model(NamedTuple):
  """What examples, benchmarks and the command line need to know about a model.

  Attributes:
    init: `init(key) -> params`, a pytree of arrays.
    apply: `apply(params, x [B, *input_shape]) -> logits [B, num_classes]`,
      deterministic (evaluation mode: dropout off).
    loss_fn: `loss_fn(params, batch) -> [B]` softmax cross-entropy per example,
      with `batch = {"x": [B, ...], "y": [B] int}`. Not averaged.
    accuracy_fn: `accuracy_fn(params, batch) -> [B]`, 1.0 where
      `argmax(logits) == y`, else 0.0. Not averaged.
    name: a short identifier, e.g. `"mlp_2nn"`.
    input_shape: the shape of one example `x` (without the batch axis).
    num_classes: K, the number of logits.
    module: the flax linen module behind `apply`, or None. Use it for what the
      bundle leaves out, e.g. training-mode calls with dropout.
  """

  init: Callable[[jax.Array], PyTree]
  apply: ApplyFn
  loss_fn: BatchFn
  accuracy_fn: BatchFn
  name: str
  input_shape: tuple[int, ...]
  num_classes: int
  module: Optional[nn.Module] = None


def _logits_and_labels(apply_fn: ApplyFn, params: PyTree,
                       batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Runs `apply_fn` on `batch["x"]` and checks shapes at trace time.

  Returns:
    `(logits [B, K], labels [B])`, logits in at least float32 so that a
    low-precision model still gets a float32 loss.
  """
  if not isinstance(batch, Mapping) or "x" not in batch or "y" not in batch:
    got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
    raise TypeError(f'batch must be a dict with keys "x" [B, ...] and "y" [B]; got {got}.')
  labels = batch["y"]
  if jnp.ndim(labels) != 1:
    raise ValueError(f'batch["y"] must have shape [B] (integer labels); got shape {jnp.shape(labels)}.')
  if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
    raise TypeError(f'batch["y"] must hold integer class labels; got dtype {jnp.result_type(labels)}.')
  logits = apply_fn(params, batch["x"])
  b = jnp.shape(labels)[0]
  if jnp.ndim(logits) != 2 or jnp.shape(logits)[0] != b:
    raise ValueError(
        f"apply_fn must return logits shaped [B, K] with B = {b} (the length of batch['y']); "
        f"got shape {jnp.shape(logits)}.")
  dtype = jnp.promote_types(jnp.result_type(logits), jnp.float32)
  return jnp.asarray(logits, dtype), labels


def classification_loss(apply_fn: ApplyFn) -> BatchFn:
  """Per-example softmax cross-entropy from a function returning logits.

  `loss_i = logsumexp(z_i) - z_i[y_i]` with `z_i = apply_fn(params, x)_i`,
  computed stably by `optax.losses.softmax_cross_entropy_with_integer_labels`.

  Args:
    apply_fn: `apply_fn(params, x [B, ...]) -> logits [B, K]`.

  Returns:
    `loss_fn(params, batch) -> [B]` with `batch = {"x": [B, ...], "y": [B] int}`
    and labels in `[0, K)`. The losses are not averaged.
  """

  def loss_fn(params: PyTree, batch: Mapping[str, jax.Array]) -> jax.Array:
    logits, labels = _logits_and_labels(apply_fn, params, batch)
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)

  return loss_fn


def classification_accuracy(apply_fn: ApplyFn) -> BatchFn:
  """Per-example 0/1 accuracy from a function returning logits.

  Args:
    apply_fn: `apply_fn(params, x [B, ...]) -> logits [B, K]`.

  Returns:
    `accuracy_fn(params, batch) -> [B]` float, 1.0 where `argmax_k z_ik == y_i`
    and 0.0 elsewhere (ties go to the lowest index, as in `jnp.argmax`).
  """

  def accuracy_fn(params: PyTree, batch: Mapping[str, jax.Array]) -> jax.Array:
    logits, labels = _logits_and_labels(apply_fn, params, batch)
    return (jnp.argmax(logits, axis=-1) == labels).astype(logits.dtype)

  return accuracy_fn


def from_flax(module: nn.Module, input_shape: tuple[int, ...], *, name: Optional[str] = None,
              input_dtype: Any = jnp.float32) -> Model:
  """Wraps a flax linen module mapping `x [B, *input_shape] -> logits [B, K]` into a `Model`.

  The module must keep all its variables in the `"params"` collection (no
  batch statistics): per-example losses must not depend on the other examples
  in the batch. `params` is the inner `"params"` dict, a plain pytree.
  `apply` calls `module.apply({"params": params}, x)` with the module's default
  arguments, so a module with a `train=False` default is evaluated without
  dropout. K is read from the module's output shape without running it.

  Args:
    module: a flax linen module.
    input_shape: shape of one example, without the batch axis, e.g. `(784,)`.
    name: the model's name; defaults to the module's class name.
    input_dtype: dtype of the dummy input used to initialise the module.

  Returns:
    A `Model` whose loss is softmax cross-entropy with integer labels.

  Raises:
    ValueError: the module's output is not `[B, K]`, or it has variables
      outside the `"params"` collection.
  """
  input_shape = _check_input_shape(input_shape)
  dummy = jnp.zeros((1, *input_shape), input_dtype)

  def shapes() -> tuple[PyTree, jax.Array]:
    variables = module.init(jax.random.key(0), dummy)
    return variables, module.apply(variables, dummy)

  variables, out = jax.eval_shape(shapes)
  extra = sorted(set(variables) - {"params"})
  if extra:
    raise ValueError(
        f"from_flax needs a module whose variables are all in the 'params' collection; "
        f"{type(module).__name__} also has {extra} (batch statistics make an example's loss "
        f"depend on its batch). Use a normalisation without running statistics, e.g. LayerNorm.")
  if len(out.shape) != 2:
    raise ValueError(
        f"from_flax needs a module mapping x [B, *input_shape] -> logits [B, K]; "
        f"{type(module).__name__} returned shape {out.shape} for input shape {dummy.shape}.")

  def init(key: jax.Array) -> PyTree:
    return module.init(key, dummy)["params"]

  def apply(params: PyTree, x: jax.Array) -> jax.Array:
    return module.apply({"params": params}, x)

  # Jitted so that eager use (notebooks, evaluation) compiles once instead of
  # op by op; inside a caller's jit/vmap/grad the inner jit is inlined.
  return Model(
      init=jax.jit(init),
      apply=jax.jit(apply),
      loss_fn=jax.jit(classification_loss(apply)),
      accuracy_fn=jax.jit(classification_accuracy(apply)),
      name=name or type(module).__name__,
      input_shape=input_shape,
      num_classes=int(out.shape[1]),
      module=module,
  )


def _check_input_shape(input_shape: Any) -> tuple[int, ...]:
  """`input_shape` as a tuple of positive Python ints, or a TypeError naming it."""
  try:
    dims = tuple(operator.index(d) for d in input_shape)
  except TypeError:
    dims = None
  if dims is None or not all(d > 0 for d in dims):
    raise TypeError(f"input_shape must be a tuple of positive ints (one example, no batch axis), "
                    f"e.g. (784,); got {input_shape!r}.")
  return dims


def count_params(params: PyTree) -> int:
  """The number of scalars in a pytree of arrays (works on shape structs too)."""
  return sum(math.prod(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(params))


def flatten_examples(x: jax.Array, num_features: int, model_name: str) -> jax.Array:
  """Reshapes `x [B, ...]` to `[B, num_features]`, with a clear error if sizes disagree."""
  if jnp.ndim(x) < 1:
    raise ValueError(f"{model_name} expects x shaped [B, ...]; got a scalar.")
  per_example = math.prod(jnp.shape(x)[1:])
  if per_example != num_features:
    raise ValueError(
        f"{model_name} expects {num_features} features per example; got x of shape "
        f"{jnp.shape(x)} ({per_example} per example).")
  return jnp.reshape(x, (jnp.shape(x)[0], num_features))
