"""Loop modes that sum as they go: per-client outputs stacked, one part of them summed over clients in the loop.

A round whose clients run in a compiled loop (`sequential()`, `chunked(k)`
with k < C, or `auto` choosing one of them) need not stack every client's
model-sized update `[C, P]` only to add the rows up afterwards. With
`map_clients_and_sum`, `fn(shared, client) -> (stacked, summed)` returns the
part kept per client (losses, counts, per-client rows) and the part that is
only ever summed (a weighted update); the loop carries the running sum, so a
round holds one chunk of updates at a time plus one sum, whatever C.

    stacked [C, ...], total = map_clients_and_sum(mode, fn, shared, per_client)
    # total = Σ_c summed_c, accumulated in the dtype `fn` returns it in

`loop_chunk(mode, fn, shared, per_client)` says whether a mode runs the
clients in a loop, and with how many clients per chunk; the round
(`core.rounds.client_round`) streams only then. `vmap()` and `sharded`
(where the compiler already turns the sum of the stacked rows into
per-device partial sums and one all-reduce) keep the stacked form.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_opt.core.client_map.memory import default_chunk_size
from fedjax_opt.core.client_map.modes import Auto, Chunked, ClientMap, concrete
from fedjax_opt.core.client_map.rewrites import rewrite_client_fn
from fedjax_opt.core.client_map.tracing import num_clients
from fedjax_opt.core.types import PyTree


def loop_chunk(mode: ClientMap | str | None, fn: Callable, shared: PyTree,
               per_client: PyTree) -> tuple[Chunked, int] | None:
  """`(the loop mode, clients per chunk k)` when `mode` runs these C clients in a loop (k < C), else None."""
  mode = concrete(mode)
  if isinstance(mode, Auto):
    mode = mode.resolve(fn, shared, per_client)
  if not isinstance(mode, Chunked):
    return None
  c = num_clients(per_client)
  k = mode.chunk_size or default_chunk_size(fn, shared, per_client, mode.memory_budget)
  return (mode, k) if k < c else None


def _chunk_fn(mode: Chunked, k: int, fn: Callable) -> Callable:
  """`fn` over a chunk of k clients (leaves `[k, ...]`), with the mode's rewrites; one client runs unbatched."""
  one = rewrite_client_fn(fn, unroll=mode.unroll, canonical_convs=mode.canonical_convs)
  if k == 1:
    return lambda shared, chunk: jax.tree.map(lambda a: a[None], one(shared, jax.tree.map(lambda a: a[0], chunk)))
  return rewrite_client_fn(jax.vmap(one, in_axes=(None, 0)), fuse_small_dots=mode.fuse_small_dots)


def map_clients_and_sum(loop: tuple[Chunked, int], fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
                        shared: PyTree, per_client: PyTree) -> tuple[PyTree, PyTree]:
  """Runs `fn(shared, per_client[c]) -> (stacked, summed)` over the clients in chunks of k (a `lax.scan`).

  Args:
    loop: `(mode, k)` from `loop_chunk`.
    fn: the per-client function; its `summed` output is added over clients
      in its own dtype (return it in float32 or wider for an accurate sum).
    shared: what every client receives.
    per_client: leaves with a leading `[C]` axis.

  Returns:
    `(stacked [C, ...], Σ_c summed)`. The C clients run as ⌊C/k⌋ chunks of
    k in the loop, then the remaining C mod k clients as one smaller chunk.
  """
  mode, k = loop
  c = num_clients(per_client)
  chunk_fn = _chunk_fn(mode, k, fn)
  one_client = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), per_client)
  _, summed_shape = jax.eval_shape(fn, shared, one_client)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), summed_shape)

  def add_chunk(total, chunk):
    stacked, summed = chunk_fn(shared, chunk)
    return jax.tree.map(lambda t, s: t + jnp.sum(s, axis=0), total, summed), stacked

  full = c // k
  main = jax.tree.map(lambda a: a[:full * k].reshape((full, k) + a.shape[1:]), per_client)
  total, stacked = jax.lax.scan(add_chunk, zeros, main)
  stacked = jax.tree.map(lambda a: a.reshape((full * k,) + a.shape[2:]), stacked)
  if c > full * k:
    total, rest = add_chunk(total, jax.tree.map(lambda a: a[full * k:], per_client))
    stacked = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stacked, rest)
  return stacked, total


__all__ = ["loop_chunk", "map_clients_and_sum"]
