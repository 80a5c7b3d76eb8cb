"""The execution policy: how clients run, set once for every algorithm, read when a step is traced.

How the clients of a round are computed is not a hyper-parameter of any
algorithm: it changes speed and memory, never the method. It is one policy
with three parts,

* `client_map`: the client map (`fedjax_opt.core.client_map`: "auto",
  "vmap", "chunked:64", "sequential", "sharded", a mode object); default "auto";
* `precision`: the dtype of the clients' forward and backward passes,
  "float32" (default: the model's own dtypes) or "bfloat16" (mixed
  precision: parameters, optimizer state, updates and the loss stay float32;
  `core.local.masked_mean_loss` casts the floating parameters and data to
  bfloat16 for the loss and its gradient, and the loss back to float32);
* `storage_dtype`: the dtype of per-client tables (`core.per_client.init`:
  SCAFFOLD's c_i, Ditto's v_i, error-feedback residuals ...); None keeps the
  model's dtype;

set in one of two ways, which nest (an inner setting wins, field by field):

    with fo.execution(client_map="chunked:64", precision="bfloat16"):
      state = jax.jit(algorithm.step)(state, batches)      # traced here: uses the policy

    fast = fo.with_execution(algorithm, client_map="chunked:64")   # init/step/personalize run under it

The policy is read when a function is traced. It is part of jit's cache key
(a JAX configuration state, as `jax.default_matmul_precision` is), so a step
traced under one policy is traced again, not reused, under another.

The factory keywords `client_map=` and `storage_dtype=` still work: a value
given there overrides the policy for that algorithm (as `with_execution`
would), and None, their default, means the policy's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax.numpy as jnp
import numpy as np

__all__ = ["PRECISIONS", "Policy", "compute_dtype", "current", "execution", "with_execution"]

PRECISIONS = ("float32", "bfloat16")
"""The client compute precisions `execution(precision=...)` accepts."""

@dataclasses.dataclass(frozen=True)
class Policy:
  """How clients run (module docstring). None in a field: the enclosing policy's value (or the default).

  Attributes:
    client_map: a client map mode or its name; None: "auto".
    precision: "float32" or "bfloat16"; None: "float32".
    storage_dtype: dtype of per-client tables; None: the model's.
  """

  client_map: Any = None
  precision: str | None = None
  storage_dtype: Any = None

  def over(self, outer: Policy) -> Policy:
    """This policy's fields where set, `outer`'s elsewhere."""
    return Policy(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(outer, f.name)
                     for f in dataclasses.fields(self)})


_POLICY = contextvars.ContextVar("fedjax_opt_execution_policy", default=Policy())


def _jit_key_state():
  """A JAX configuration state in jit's cache key, so a function traced under one policy is traced again under
  another (JAX caches traces by function, and knows nothing of this module's context). None where this JAX has
  no such state; the policy then holds only for functions not traced before (module docstring)."""
  try:
    from jax._src import config as jax_config  # pylint: disable=import-outside-toplevel
    return jax_config.string_or_object_state("fedjax_opt_execution_policy", None,
                                             "fedjax_opt's execution policy (fedjax_opt.core.execution).",
                                             include_in_jit_key=True, include_in_trace_context=True)
  except Exception:  # pylint: disable=broad-except  (a JAX without it)
    return None


_JIT_KEY = _jit_key_state()


@contextlib.contextmanager
def _entered(policy: Policy) -> Iterator[Policy]:
  token = _POLICY.set(policy)
  try:
    if _JIT_KEY is None:
      yield policy
    else:
      with _JIT_KEY(repr(policy)):
        yield policy
  finally:
    _POLICY.reset(token)


def _check(client_map: Any, precision: Any, storage_dtype: Any) -> Policy:
  if client_map is not None:
    from fedjax_opt.core.client_map import modes  # pylint: disable=import-outside-toplevel  (modes reads the policy)
    client_map = modes.resolve(client_map)
    if isinstance(client_map, modes.FromPolicy):
      raise ValueError("client_map: a policy names a client map ('auto', 'vmap', 'chunked:64' ...), not FromPolicy.")
  if precision is not None and precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}.")
  if storage_dtype is not None:
    try:
      dtype = np.dtype(storage_dtype)
    except TypeError as error:
      raise TypeError(f"storage_dtype must be a floating dtype such as jnp.bfloat16; got {storage_dtype!r}.") from error
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"storage_dtype must be a floating dtype such as jnp.bfloat16; got {dtype}.")
  return Policy(client_map, precision, storage_dtype)


def current() -> Policy:
  """The policy in force where this is called (every field filled: the defaults where nothing set one)."""
  policy = _POLICY.get()
  return Policy(policy.client_map if policy.client_map is not None else "auto",
                policy.precision or "float32", policy.storage_dtype)


@contextlib.contextmanager
def execution(*, client_map: Any = None, precision: str | None = None,
              storage_dtype: Any = None) -> Iterator[Policy]:
  """Sets the execution policy for every step traced inside (module docstring); None keeps the enclosing value.

  Args:
    client_map: the client map ("auto", "vmap", "chunked:K", "sequential", "sharded", a mode object).
    precision: "float32" or "bfloat16" (client forward and backward passes; state stays float32).
    storage_dtype: the dtype of per-client tables (e.g. `jnp.bfloat16`).

  Yields:
    The policy now in force.
  """
  with _entered(_check(client_map, precision, storage_dtype).over(_POLICY.get())) as policy:
    yield policy


def compute_dtype() -> Any:
  """The dtype client losses are computed in under the current policy: None (the model's own) or bfloat16."""
  return jnp.bfloat16 if current().precision == "bfloat16" else None


def _under(policy: Policy, fn: Callable | None) -> Callable | None:
  if fn is None:
    return None

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with _entered(policy.over(_POLICY.get())):
      return fn(*args, **kwargs)

  return run


def with_execution(algorithm: Any, *, client_map: Any = None, precision: str | None = None,
                   storage_dtype: Any = None) -> Any:
  """`algorithm` whose `init`, `step` and `personalize` run under this policy (fields left None: the caller's).

  Args:
    algorithm: a `FederatedAlgorithm` (or any NamedTuple of functions, e.g. a sweep's).
    client_map, precision, storage_dtype: as in `execution`.

  Returns:
    The same kind of object, each function field wrapped; calling it enters the policy, so a `jax.jit` of
    the wrapped step traces under it.
  """
  policy = _check(client_map, precision, storage_dtype)
  if not hasattr(algorithm, "_replace") or not hasattr(algorithm, "step"):
    raise TypeError(f"with_execution: algorithm must be a FederatedAlgorithm (fo.algorithms.fedavg(...)); "
                    f"got {type(algorithm).__name__}.")
  fields = {name: _under(policy, getattr(algorithm, name)) for name in algorithm._fields
            if callable(getattr(algorithm, name)) or getattr(algorithm, name) is None}
  return algorithm._replace(**fields)
