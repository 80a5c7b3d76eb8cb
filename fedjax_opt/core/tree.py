"""Small pytree helpers used across core and the algorithms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["global_norm", "select_rows", "select_tree", "tree_bits"]

PyTree = Any


def select_tree(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
  """Leaf-wise `jnp.where(pred, a, b)` over two pytrees of the same structure."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def select_rows(ok: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """Row i of `new` where `ok[i]`, else row i of `old` (bit for bit, cast to `new`'s dtype), for leaves `[N, ...]`."""
  return jax.tree.map(lambda a, b: jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, b.astype(a.dtype)), new, old)


def global_norm(tree: PyTree) -> jax.Array:
  """‖tree‖₂ over all leaves."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros(())
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in leaves))


def tree_bits(tree: PyTree) -> int:
  """Bits to send every entry of `tree` as it is: Σ_leaves size · itemsize · 8 (32 P in float32); static.

  Works on arrays and on `jax.ShapeDtypeStruct`s; 0 for a tree without leaves.
  """
  total = 0
  for leaf in jax.tree.leaves(tree):
    size = 1
    for d in jnp.shape(leaf):
      size *= int(d)
    total += size * jnp.dtype(jnp.result_type(leaf)).itemsize * 8
  return total
