"""Trace-time checks with errors that name the argument, the expected and the actual value.

Shape and dtype checks run while tracing, before any compute, jitted or not.
Value checks (a negative weight, say) need concrete values: they run whenever
the values are concrete (eager calls, building batches on the host) and are
skipped for traced values, where no Python error can be raised.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.types import ClientBatches, materialize

__all__ = ["TracedIntegerError", "check_choice", "check_client_batches", "check_full_participation", "check_in_range",
           "check_int", "check_key", "check_loss_fn", "check_num_clients", "check_optimizer", "check_optional_int",
           "check_per_example_loss", "check_positive", "check_probability", "check_scalar", "is_concrete"]


def is_concrete(x: Any) -> bool:
  """True when `x` holds values Python can read (not a tracer inside jit/vmap/grad)."""
  return not isinstance(x, jax.core.Tracer)


def _leaf_paths(tree: Any) -> list[tuple[str, Any]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in leaves]


def check_client_batches(batches: Any, name: str = "batches") -> None:
  """Validates a `ClientBatches` at trace time.

  Raises:
    TypeError: `batches` is not a ClientBatches, or a field has the wrong dtype.
    ValueError: a field has the wrong rank or a shape that disagrees with `mask`
      `[C, S, B]`; or, when concrete, a weight is negative or not finite.
  """
  if not isinstance(batches, ClientBatches):
    raise TypeError(f"{name} must be a fedjax_opt.ClientBatches, got {type(batches).__name__}.")
  mask = batches.mask
  if jnp.ndim(mask) != 3:
    raise ValueError(
        f"{name}.mask must have rank 3 [C, S, B] (clients, local steps, batch); "
        f"got shape {tuple(jnp.shape(mask))}.")
  if jnp.result_type(mask) != jnp.bool_:
    raise TypeError(f"{name}.mask must be bool (True on real examples); got dtype {jnp.result_type(mask)}.")
  c, s, b = jnp.shape(mask)
  leaves = _leaf_paths(jax.eval_shape(materialize, batches.data))  # shapes only: deferred data is not gathered
  if not leaves:
    raise ValueError(f"{name}.data holds no arrays.")
  for path, leaf in leaves:
    shape = tuple(jnp.shape(leaf))
    if len(shape) < 3 or shape[:3] != (c, s, b):
      raise ValueError(
          f"{name}.data{path} must be shaped [C, S, B, ...] = ({c}, {s}, {b}, ...) to match "
          f"{name}.mask; got shape {shape}.")
  if tuple(jnp.shape(batches.weight)) != (c,):
    raise ValueError(f"{name}.weight must have shape [C] = ({c},); got shape {tuple(jnp.shape(batches.weight))}.")
  if not jnp.issubdtype(jnp.result_type(batches.weight), jnp.floating):
    raise TypeError(f"{name}.weight must be a float array; got dtype {jnp.result_type(batches.weight)}.")
  if tuple(jnp.shape(batches.client_id)) != (c,):
    raise ValueError(
        f"{name}.client_id must have shape [C] = ({c},); got shape {tuple(jnp.shape(batches.client_id))}.")
  if not jnp.issubdtype(jnp.result_type(batches.client_id), jnp.integer):
    raise TypeError(f"{name}.client_id must be an integer array; got dtype {jnp.result_type(batches.client_id)}.")
  if is_concrete(batches.weight):
    w = np.asarray(batches.weight)
    if not np.all(np.isfinite(w)):
      raise ValueError(f"{name}.weight must be finite; got {w}.")
    if np.any(w < 0):
      raise ValueError(f"{name}.weight must be non-negative (a client's sample count); got {w}.")
  if is_concrete(batches.client_id):
    ids = np.asarray(batches.client_id)
    if np.any(ids < 0):
      raise ValueError(f"{name}.client_id must be non-negative indices; got {ids}.")


def check_per_example_loss(losses: Any, batch_size: int) -> None:
  """Checks that a loss_fn returned one loss per example, `[B]`."""
  shape = tuple(jnp.shape(losses))
  if shape != (batch_size,):
    hint = " (it returned a scalar: return per-example losses, the library masks and averages)" if not shape else ""
    raise ValueError(
        f"loss_fn must return per-example losses shaped [B] = ({batch_size},); got shape {shape}{hint}.")
  if not jnp.issubdtype(jnp.result_type(losses), jnp.floating):
    raise TypeError(f"loss_fn must return floating-point losses; got dtype {jnp.result_type(losses)}.")


class TracedIntegerError(TypeError):
  """A traced value (inside jit, grad or vmap: a swept or differentiated hyper-parameter) where a Python int is
  needed; `name` is the argument, `value` the tracer (`fedjax_opt.hyper` names the hyper-parameter it came from)."""

  def __init__(self, message: str, name: str, value: Any):
    super().__init__(message)
    self.name, self.value = name, value


def check_int(value: Any, name: str, minimum: int = 1) -> int:
  """`value` as a Python int >= `minimum` (a count that fixes a shape or a loop length), or a clear error."""
  if isinstance(value, jax.core.Tracer):
    raise TracedIntegerError(f"{name} must be a Python int >= {minimum} (it fixes a shape or a loop length); got a "
                             f"traced {jnp.result_type(value)}{list(jnp.shape(value))} value, which cannot be one.",
                             name, value)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int >= {minimum}; got {type(value).__name__} {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be a Python int >= {minimum}; got {value!r}.")
  return int(value)


def check_optional_int(value: Any, name: str, minimum: int = 1) -> int | None:
  """`check_int`, with None allowed (and returned)."""
  return None if value is None else check_int(value, name, minimum)


def check_num_clients(num_clients: Any, name: str = "num_clients") -> int:
  """`num_clients` as a positive Python int (the rows of a per-client table, a shape), or a clear error."""
  return check_int(num_clients, name, 1)


def check_scalar(value: Any, name: str) -> None:
  """Raises ValueError unless `value` is a scalar (a float or a 0-d array, traced or not)."""
  if jnp.ndim(value) != 0:
    raise ValueError(f"{name} must be a scalar; got shape {tuple(jnp.shape(value))}.")


def check_choice(value: Any, name: str, choices: tuple) -> Any:
  """Raises ValueError unless `value` is one of `choices`."""
  if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
    raise ValueError(f"{name} must be one of {choices}; got {value!r}.")
  return value


def check_probability(value: Any, name: str) -> None:
  """Raises ValueError if a concrete `value` is not in the open interval (0, 1)."""
  if value is None or not is_concrete(value):
    return
  v = np.asarray(value)
  if not (np.all(np.isfinite(v)) and np.all(v > 0) and np.all(v < 1)):
    raise ValueError(f"{name} must lie in the open interval (0, 1); got {value}.")


def check_positive(value: Any, name: str, *, allow_zero: bool = False) -> None:
  """Raises ValueError if a concrete hyper-parameter is not > 0 (or >= 0)."""
  if value is None or not is_concrete(value):
    return
  v = np.asarray(value)
  bad = np.any(v < 0) if allow_zero else np.any(v <= 0)
  if bad or not np.all(np.isfinite(v)):
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"{name} must be finite and {bound}; got {value}.")


def check_in_range(value: Any, name: str, low: float, high: float, *, closed_high: bool = False) -> None:
  """Raises ValueError if a concrete hyper-parameter is outside [low, high) (or [low, high])."""
  if value is None or not is_concrete(value):
    return
  v = np.asarray(value)
  ok = np.all(v >= low) and (np.all(v <= high) if closed_high else np.all(v < high))
  if not ok:
    right = "]" if closed_high else ")"
    raise ValueError(f"{name} must lie in [{low}, {high}{right}; got {value}.")


def check_optimizer(opt: Any, name: str) -> Any:
  """Raises TypeError unless `opt` is an optax.GradientTransformation; returns it."""
  if not (hasattr(opt, "init") and hasattr(opt, "update")):
    raise TypeError(f"{name} must be an optax.GradientTransformation (with init and update); got {type(opt).__name__}.")
  return opt


def check_key(key: Any) -> None:
  if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
    return
  if tuple(jnp.shape(key)) != (2,) or jnp.result_type(key) != jnp.uint32:
    raise TypeError(f"key must be a PRNG key (jax.random.key(0) or jax.random.PRNGKey(0)); got shape "
                    f"{tuple(jnp.shape(key))} dtype {jnp.result_type(key)}.")


def check_loss_fn(loss_fn: Any) -> None:
  """Raises TypeError unless `loss_fn` is callable (the per-example loss `loss_fn(params, batch) -> [B]`)."""
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable loss_fn(params, batch) -> [B]; got {type(loss_fn).__name__}.")


def check_full_participation(batches: Any, num_clients: int, *, ordered: bool = False) -> None:
  """`check_client_batches`, and every one of the `num_clients` clients in the step, each once.

  For algorithms whose every step needs every client (the mixture methods,
  GADMM's workers): C = num_clients, and, when concrete, `client_id` a
  permutation of arange(num_clients) (arange itself when `ordered`: row n is client n).
  """
  check_client_batches(batches)
  c = batches.num_clients
  if c != num_clients:
    raise ValueError(f"batches must hold every one of the num_clients = {num_clients} clients (full participation); "
                     f"got C = {c}.")
  if is_concrete(batches.client_id):
    ids = np.asarray(batches.client_id)
    if ordered and not np.array_equal(ids, np.arange(num_clients)):
      raise ValueError(f"batches.client_id must be arange({num_clients}) (row n = client n); got {ids}.")
    if not np.array_equal(np.sort(ids), np.arange(num_clients)):
      raise ValueError(f"batches.client_id must be a permutation of arange({num_clients}) (every client once); "
                       f"got {ids}.")
