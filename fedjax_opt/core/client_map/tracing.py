"""The per-client computation seen abstractly: the client count, one client's shapes, its jaxpr, and a walk over it.

Nothing here computes: `trace_client` and `trace_mapped` trace with shape/dtype
structs, and `equations` walks a jaxpr with the jaxprs nested in it (scan
bodies, jit calls, custom derivatives ...). The rewrites, the memory rule and
`auto`'s decision all read the per-client function through these.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from fedjax_opt.core.types import PyTree

__all__ = ["abstract", "equations", "num_clients", "trace_client", "trace_mapped"]


def num_clients(per_client: PyTree) -> int:
  """C, the leading axis that every leaf of `per_client` shares (a clear error otherwise)."""
  leaves = jax.tree.leaves(per_client)
  if not leaves:
    raise ValueError("map_clients needs at least one per-client array with a leading [C] axis.")
  sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"every per-client array must share the leading client axis [C]; got leading sizes {sizes}.")
  return sizes.pop()


def abstract(tree: PyTree, drop_leading: bool = False) -> PyTree:
  """Shape/dtype structs of `tree`'s leaves (without the leading axis when `drop_leading`)."""

  def leaf(x):
    shape = tuple(jnp.shape(x))
    return jax.ShapeDtypeStruct(shape[1:] if drop_leading else shape, jnp.result_type(x))

  return jax.tree.map(leaf, tree)


def trace_client(fn: Callable, shared: PyTree, per_client: PyTree) -> jex_core.ClosedJaxpr:
  """The jaxpr of `fn(shared, per_client[c])` for one client (abstract: nothing is computed)."""
  return jax.make_jaxpr(fn)(abstract(shared), abstract(per_client, drop_leading=True))


def trace_mapped(fn: Callable, shared: PyTree, per_client: PyTree, k: int) -> jex_core.ClosedJaxpr:
  """The jaxpr of `fn` vmapped over k clients (abstract: nothing is computed)."""
  chunk = jax.tree.map(lambda s: jax.ShapeDtypeStruct((k,) + s.shape, s.dtype), abstract(per_client, True))
  return jax.make_jaxpr(jax.vmap(fn, in_axes=(None, 0)))(abstract(shared), chunk)


def _sub_jaxprs(value: Any) -> Iterator[jex_core.Jaxpr]:
  if isinstance(value, jex_core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jex_core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def equations(jaxpr: jex_core.ClosedJaxpr | jex_core.Jaxpr) -> Iterator[jex_core.JaxprEqn]:
  """Every equation of `jaxpr` and of the jaxprs nested in its equations (scan bodies, jit calls ...)."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        yield from equations(sub)
