"""Order along the client axis: row positions and a sort of the rows, for rules that rank clients.

Both the robust aggregators (`fedjax_opt.aggregators.robust`: medians,
trimmed mean) and the attacks that read them (`fedjax_opt.attacks`: ALIE's
per-coordinate statistics) sort each coordinate's C client values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["row_positions", "sort_rows"]


def row_positions(u: jax.Array) -> jax.Array:
  """`[C, 1, ...]` row positions 0 … C − 1, broadcastable against the `[C, ...]` leaf `u`."""
  return lax.broadcasted_iota(jnp.int32, (u.shape[0],) + (1,) * (u.ndim - 1), 0)


def sort_rows(x: jax.Array) -> jax.Array:
  """`x` sorted along its leading (client) axis by a bitonic network of elementwise min/max.

  C is padded with +inf rows to the next power of two P; the network's
  log₂P (log₂P + 1)/2 stages run in a `fori_loop` (one compiled stage: row i
  meets row i XOR j and keeps the min or the max), O(d P log² P) work in
  all. On XLA:CPU this is 2.5–10× faster than `jnp.sort` along the client
  axis (C = 11 … 1000, d = 10⁴ … 10⁵). Values must not be NaN (the
  non-finite guard drops such clients before any aggregator).
  """
  c = x.shape[0]
  p = 1 << max(c - 1, 0).bit_length()
  if p > c:
    x = jnp.concatenate([x, jnp.full((p - c,) + x.shape[1:], jnp.inf, x.dtype)])
  stages = [(1 << e, 1 << f) for e in range(1, p.bit_length()) for f in reversed(range(e))]  # (k, j)
  if not stages:
    return x[:c]
  ks, js = (jnp.asarray(v, jnp.int32) for v in zip(*stages))
  i = jnp.arange(p, dtype=jnp.int32)

  def stage(t, x):
    k, j = ks[t], js[t]
    other = jnp.take(x, i ^ j, axis=0)
    keep_min = (((i & j) == 0) == ((i & k) == 0)).reshape((p,) + (1,) * (x.ndim - 1))
    return jnp.where(keep_min, jnp.minimum(x, other), jnp.maximum(x, other))

  return lax.fori_loop(0, len(stages), stage, x)[:c]
