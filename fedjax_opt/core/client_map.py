"""`client_map`: the one place that maps a per-client function over the client axis.

Every algorithm runs its clients through `map_clients(mode, fn, shared, per_client)`,
which computes `fn(shared, per_client[c])` for every client c and stacks the
results on a leading `[C]` axis. `shared` (the server model, control variates
...) is broadcast; every leaf of `per_client` has a leading `[C]` axis.

Modes (all give the same numbers, to float tolerance):

* `vmap()`: `jax.vmap` over clients. Fills an accelerator; on CPU per-client
  weights turn matmuls into batched matmuls and convolutions into grouped
  convolutions, which XLA:CPU runs slower than a loop.
* `sequential()`: a compiled loop over clients (`lax.map`), one client at a
  time inside the same jitted program.
* `chunked(k)`: `lax.map` over chunks of k clients, vmapped inside a chunk:
  bounds memory when C is large (k clients' activations and optimizer states
  live at once).
* `auto()` (the default): `vmap` on GPU/TPU, `sequential` on CPU.

Why `sequential` on CPU: `benchmarks/client_map_modes.py` on a 2-core
x86 CPU (jax 0.10.2) timed a FedAvg round of the 2NN MLP (S=10, B=20) at
C = 8 / 32 / 128 clients at 44 / 214 / 731 ms with `vmap` against
36 / 149 / 529 ms with `sequential` (about 1.4× faster), and found the two
within noise for multinomial logistic regression (C = 10 … 1000).

A mode is a small frozen object, so it can be passed to any algorithm
factory (`fo.algorithms.fedavg(..., client_map=fo.core.client_map.chunked(64))`)
or named by a string ("auto", "vmap", "sequential", "chunked:64").
Sharded execution over a device mesh plugs in here as one more mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

PyTree = Any


def _num_clients(per_client: PyTree) -> int:
  leaves = jax.tree.leaves(per_client)
  if not leaves:
    raise ValueError("map_clients needs at least one per-client array with a leading [C] axis.")
  sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"every per-client array must share the leading client axis [C]; got leading sizes {sizes}.")
  return sizes.pop()


@dataclasses.dataclass(frozen=True)
class VMap:
  """All clients at once with `jax.vmap`."""

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    return jax.vmap(fn, in_axes=(None, 0))(shared, per_client)


@dataclasses.dataclass(frozen=True)
class Chunked:
  """Clients `chunk_size` at a time: a compiled loop over chunks, vmapped inside a chunk.

  A client count that `chunk_size` does not divide is handled by `lax.map`
  (the remainder runs as one smaller vmapped batch). `chunk_size=1` is a plain
  compiled loop over clients.
  """

  chunk_size: int

  def __post_init__(self):
    if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
      raise ValueError(f"chunk_size must be a positive int; got {self.chunk_size!r}.")

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    c = _num_clients(per_client)
    if self.chunk_size >= c:
      return VMap()(fn, shared, per_client)
    batch_size = None if self.chunk_size == 1 else self.chunk_size
    return jax.lax.map(lambda pc: fn(shared, pc), per_client, batch_size=batch_size)


@dataclasses.dataclass(frozen=True)
class Auto:
  """The default: `vmap` on accelerators, a compiled loop over clients on CPU.

  The backend is read when the step is traced, so the same algorithm object
  picks the right formulation wherever it is jitted.
  """

  def resolve(self) -> VMap | Chunked:
    return VMap() if jax.default_backend() in ("gpu", "tpu") else Chunked(1)

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    return self.resolve()(fn, shared, per_client)


ClientMap = VMap | Chunked | Auto


def vmap() -> VMap:
  """All clients at once with `jax.vmap`."""
  return VMap()


def sequential() -> Chunked:
  """One client at a time, as a compiled loop (`lax.map`) inside the jitted round."""
  return Chunked(1)


def chunked(chunk_size: int) -> Chunked:
  """`chunk_size` clients at a time (vmapped), chunks in a compiled loop."""
  return Chunked(chunk_size)


def auto() -> Auto:
  """`vmap` on GPU/TPU, `sequential` on CPU."""
  return Auto()


def resolve(mode: ClientMap | str | None) -> ClientMap:
  """Turns a mode object, a name ("auto", "vmap", "sequential", "chunked:K") or None into a mode."""
  if mode is None:
    return Auto()
  if isinstance(mode, (VMap, Chunked, Auto)):
    return mode
  if isinstance(mode, str):
    if mode == "auto":
      return Auto()
    if mode == "vmap":
      return VMap()
    if mode == "sequential":
      return Chunked(1)
    if mode.startswith("chunked:"):
      try:
        return Chunked(int(mode.split(":", 1)[1]))
      except ValueError:
        pass
  raise ValueError(
      f"client_map must be one of 'auto', 'vmap', 'sequential', 'chunked:K' or a mode from "
      f"fedjax_opt.core.client_map; got {mode!r}.")


def map_clients(mode: ClientMap | str | None, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
  """Computes `fn(shared, per_client[c])` for every client c, stacked on a leading [C] axis."""
  return resolve(mode)(fn, shared, per_client)
