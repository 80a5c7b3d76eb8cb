"""What the `auto` mode runs: the fastest mode measured for the backend, the model and C, within a memory budget.

This is the rule `auto` falls back on when measuring is off, and the first
candidate it times when measuring is on (`autotune`). The decision (`choose`)
is made when the step is traced, from the backend, the
device count, the jaxpr of the per-client function (does it convolve? how many
parameters does `shared` hold? does vmapping it make small batched dots?) and
C × `client_footprint` against the memory budget; it is never a guess about
the model class. The measurements behind each rule and each constant are in
docs/scaling.md ("What `auto` picks, and why").
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.client_map.memory import ACCELERATOR_PLATFORMS, default_chunk_size, default_memory_budget
from fedjax_opt.core.client_map.rewrites import has_convolution, has_small_batched_dot
from fedjax_opt.core.client_map.tracing import num_clients, trace_client, trace_mapped
from fedjax_opt.core.types import PyTree

__all__ = ["ACCELERATOR_CONV_CHUNK", "CPU_VMAP_MAX_BYTES", "CPU_VMAP_MAX_PARAMS", "Choice", "choose"]

CPU_VMAP_MAX_PARAMS = 16_384
"""On CPU, `auto` vmaps dense per-client functions whose `shared` inputs hold at most this many scalars."""

CPU_VMAP_MAX_BYTES = 16 << 20
"""On CPU, `auto` vmaps at most this many bytes of clients (C × `client_footprint`) at once, chunks beyond."""

ACCELERATOR_CONV_CHUNK = 64
"""On GPU/TPU, the measured rule runs a convolutional per-client function in chunks of this many clients once C
exceeds it (one H200, the EMNIST CNN: at C = 512 vmap took 1.55 s a round, chunks of 64 0.28 s, of 8 0.37 s)."""


class Choice(NamedTuple):
  """A mode, as `choose` decides it (the `Auto` mode turns it into a mode object).

  Attributes:
    shard: split clients across all devices, deciding again inside each device.
    chunk_size: clients at once (vmapped), chunks in a compiled loop; None: all C at once (`vmap`).
    canonical_convs: run convolutions in XLA:CPU's fast layout.
    fuse_small_dots: run small batched dots as fused sums of products.
  """

  shard: bool = False
  chunk_size: int | None = None
  canonical_convs: bool = False
  fuse_small_dots: bool = False


def _num_params(shared: PyTree) -> int:
  return sum(int(np.prod(jnp.shape(x))) for x in jax.tree.leaves(shared))


def inside_shard_map() -> bool:
  """True while tracing inside a `shard_map` (the context mesh has a manual axis): the clients are already
  split over the devices, and `auto` must not split them again."""
  mesh = jax.sharding.get_abstract_mesh()
  return bool(getattr(mesh, "manual_axes", ()))


def choose(fn: Callable | None, shared: PyTree, per_client: PyTree, memory_budget: int | None,
           shard: bool) -> Choice:
  """The mode `auto` runs `fn` over the clients of `per_client` with.

  * several devices (`shard` allowed, C > 1, not already inside a
    `shard_map`): sharded over all of them, on
    accelerators and, on CPU, for dense models above `CPU_VMAP_MAX_PARAMS`
    parameters (small dense models ran slower sharded on CPU; convolutions
    were not measured sharded on CPU);
  * GPU/TPU, convolutions, C > `ACCELERATOR_CONV_CHUNK`: chunks of that many
    clients (fewer if the budget says so): vmapped convolutions of hundreds of
    clients ran slower than a loop of jitted clients on a GPU;
  * GPU/TPU otherwise: `vmap`, or chunks of k when C clients exceed the budget;
  * CPU, convolutions: a loop over clients with `canonical_convs`;
  * CPU, more than `CPU_VMAP_MAX_PARAMS` parameters: a loop over clients;
  * CPU, smaller dense models: `vmap`, or chunks of k when C clients exceed
    the budget or `CPU_VMAP_MAX_BYTES`, with `fuse_small_dots` when the
    vmapped function holds a batched dot it rewrites (`has_small_batched_dot`).

  Unrolling is never chosen: it did not pay in any measured case
  (docs/scaling.md). Without `fn`, the default for the backend alone:
  `vmap` on accelerators, a loop over clients on CPU.
  """
  accelerator = jax.default_backend() in ACCELERATOR_PLATFORMS
  if fn is None:
    return Choice(chunk_size=None if accelerator else 1)
  c = num_clients(per_client)
  jaxpr = trace_client(fn, shared, per_client)
  convolves = has_convolution(jaxpr)
  big_dense = not convolves and _num_params(shared) > CPU_VMAP_MAX_PARAMS
  if shard and jax.device_count() > 1 and c > 1 and (accelerator or big_dense) and not inside_shard_map():
    return Choice(shard=True)
  if not accelerator and convolves:
    return Choice(chunk_size=1, canonical_convs=True)
  if accelerator and convolves and c > ACCELERATOR_CONV_CHUNK:
    k = default_chunk_size(fn, shared, per_client, memory_budget, jaxpr)
    return Choice(chunk_size=min(k, ACCELERATOR_CONV_CHUNK))
  if not accelerator and big_dense:
    return Choice(chunk_size=1)
  budget = memory_budget
  if not accelerator:  # clients at once: also within the cache
    budget = min(default_memory_budget() if budget is None else budget, CPU_VMAP_MAX_BYTES)
  k = default_chunk_size(fn, shared, per_client, budget, jaxpr)
  fuse = not accelerator and k > 1 and has_small_batched_dot(trace_mapped(fn, shared, per_client, k))
  return Choice(chunk_size=None if k >= c else k, fuse_small_dots=fuse)
