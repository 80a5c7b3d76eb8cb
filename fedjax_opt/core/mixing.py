"""Gossip with a mixing matrix over the node axis: the mechanics every decentralized algorithm shares.

Decentralized algorithms keep one row per node in a per-node table (leaves
`[N, ...]`, the client axis) and replace the server by a mixing matrix W
`[N, N]` (`fedjax_opt.graphs`: symmetric, nonnegative, doubly stochastic;
a factory's `graph=` is a `Graph`, mixed by its `mixing_rule`, or W itself):
one gossip round is the matmul x ← W x over the node axis. A time-varying
sequence `[T, N, N]` is indexed by the round, W^(t) = W[t mod T] (a period of
T rounds repeats).

Nodes whose local computation failed (a NaN or Inf) are cut out of the graph
for the round (`exclude`): every edge touching them is removed and its weight
moved onto the diagonal of the two rows, W̃_ii = W_ii + Σ_{j failed} W_ij.
W̃ stays symmetric and doubly stochastic, so the finite nodes still average
among themselves (their mean is kept), and a failed node's row is e_i: the
caller keeps its stored value, bit for bit. With every node finite, W̃ = W
exactly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import graphs as graphs_lib
from fedjax_opt.core.types import PyTree
from fedjax_opt.core.validation import is_concrete

__all__ = ["Mixing", "prepare", "at_round", "exclude", "mix", "messages_sent", "messages_received",
           "consensus_distance", "model_bytes"]


class Mixing(NamedTuple):
  """A checked mixing matrix.

  Attributes:
    matrix: `[N, N]` or `[T, N, N]` (float64 NumPy when given concretely; cast
      to the model's dtype when used).
    num_nodes: N.
    period: T for a sequence, None for one matrix.
  """

  matrix: Any
  num_nodes: int
  period: int | None


def prepare(graph: Any, name: str = "graph") -> Mixing:
  """A `Mixing` from a `Graph` (W by its `mixing_rule`), a matrix `[N, N]` or a sequence `[T, N, N]`.

  A `Graph` is mixed by `fedjax_opt.graphs.mixing_matrix` (Metropolis–Hastings
  unless its `mixing_rule` says otherwise). A concrete matrix is checked by
  `fedjax_opt.graphs.check_mixing_matrix` (symmetric, nonnegative, doubly
  stochastic, spectral gap > 0, over one period for a sequence); a traced one
  (a `jax.vmap` over matrices) only by shape.

  Raises:
    TypeError: `graph` is None or not a Graph or array-like.
    ValueError: a bad shape, or a check of `check_mixing_matrix` fails.
  """
  if graph is None:
    raise TypeError(f"{name} must be given: a fedjax_opt.graphs.Graph (mixed by its mixing_rule, default "
                    "Metropolis–Hastings) or a mixing matrix [N, N] or sequence [T, N, N] (fedjax_opt.graphs."
                    "uniform_degree(graph), random_matchings(...)).")
  if isinstance(graph, graphs_lib.Graph):
    graph = graphs_lib.mixing_matrix(graph)
  if is_concrete(graph):
    matrix = graphs_lib.check_mixing_matrix(np.asarray(graph), name)
  else:
    matrix = graph
    shape = tuple(jnp.shape(graph))
    if len(shape) not in (2, 3) or shape[-1] != shape[-2]:
      raise ValueError(f"{name} must be a square [N, N] mixing matrix or a sequence [T, N, N]; got shape {shape}.")
  shape = tuple(jnp.shape(matrix))
  return Mixing(matrix, int(shape[-1]), int(shape[0]) if len(shape) == 3 else None)


def at_round(mixing: Mixing, round_index: jax.Array, dtype: Any) -> jax.Array:
  """W^(t) `[N, N]` in `dtype`: the matrix, or `matrix[t mod T]` for a sequence (t may be traced)."""
  matrix = jnp.asarray(mixing.matrix, dtype)
  if mixing.period is None:
    return matrix
  return jnp.take(matrix, jnp.mod(round_index, mixing.period), axis=0)


def exclude(w: jax.Array, ok: jax.Array) -> jax.Array:
  """W̃ `[N, N]`: the edges of the nodes with `ok` False removed, their weight moved onto the diagonal.

  W̃_ij = W_ij when i = j or both ends are ok, else 0 (i ≠ j); each row's
  removed weight is added to W̃_ii. With every node ok, W̃ = W bit for bit.
  """
  n = w.shape[0]
  keep = (ok[:, None] & ok[None, :]) | jnp.eye(n, dtype=bool)
  kept = jnp.where(keep, w, jnp.zeros_like(w))
  return kept + jnp.diag(jnp.sum(w - kept, axis=1))


def mix(w: jax.Array, table: PyTree) -> PyTree:
  """W x for every leaf `[N, ...]` of a per-node table: row i = Σ_j W_ij x_j (a matmul at full precision)."""
  return jax.tree.map(
      lambda t: jnp.einsum("ij,j...->i...", w.astype(t.dtype), t, precision=jax.lax.Precision.HIGHEST), table)


def messages_sent(w: jax.Array) -> jax.Array:
  """`[N]` int32: how many neighbours node j sends to in a gossip round, #{i ≠ j : W_ij ≠ 0}."""
  n = w.shape[0]
  return jnp.sum((w != 0) & ~jnp.eye(n, dtype=bool), axis=0, dtype=jnp.int32)


def messages_received(w: jax.Array) -> jax.Array:
  """`[N]` int32: how many neighbours node i receives from in a gossip round, #{j ≠ i : W_ij ≠ 0}."""
  n = w.shape[0]
  return jnp.sum((w != 0) & ~jnp.eye(n, dtype=bool), axis=1, dtype=jnp.int32)


def model_bytes(params: PyTree) -> int:
  """Bytes of one model: Σ over leaves of size × item size (static)."""
  return sum(int(np.prod(jnp.shape(p))) * jnp.dtype(jnp.result_type(p)).itemsize for p in jax.tree.leaves(params))


def consensus_distance(table: PyTree) -> jax.Array:
  """(1/N) Σ_i ‖x_i − x̄‖² over the leaves of a per-node table `[N, ...]` (x̄ the mean row), at least float32."""
  total = jnp.zeros((), jnp.float32)
  for t in jax.tree.leaves(table):
    t = t.astype(jnp.promote_types(t.dtype, jnp.float32))
    total = total + jnp.sum(jnp.square(t - jnp.mean(t, axis=0))) / t.shape[0]
  return total
