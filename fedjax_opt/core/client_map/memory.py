"""The memory rule: bytes one client needs, bytes a map may use at once, and so clients per chunk.

One client needs about

    inputs (its [S, B, ...] data) + outputs (Δ, ...) + every intermediate value
    of its computation (model copy, gradient, optimizer state, activations of
    one local step: a scan body is counted once, not S times)

bytes, counted from the jaxpr of the per-client function (`client_footprint`,
an upper bound: no liveness analysis). A map over C clients needs C times that
under `vmap`, k times under `chunked(k)`, one client's under `sequential`. The
default budget is half of an accelerator's memory or a quarter of the host's
physical memory (`default_memory_budget`); `chunked()` and `auto()` run
k = ⌊budget / footprint⌋ clients at once, in equal chunks (`default_chunk_size`).
Measured footprints and peaks: docs/scaling.md.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core as jex_core

from fedjax_opt.core.client_map.tracing import abstract, equations, num_clients, trace_client
from fedjax_opt.core.types import PyTree

__all__ = ["ACCELERATOR_PLATFORMS", "array_nbytes", "client_footprint", "default_chunk_size", "default_memory_budget"]

ACCELERATOR_PLATFORMS = ("gpu", "tpu")
"""Platforms whose memory `default_memory_budget` reads from the device (host RAM otherwise)."""


def array_nbytes(aval: Any) -> int:
  """Bytes of an array's shape and dtype (0 for a value without them); `autotune` counts its inputs with it."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  itemsize = getattr(dtype, "itemsize", 8)
  return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def client_footprint(fn: Callable, shared: PyTree, per_client: PyTree,
                     jaxpr: jex_core.ClosedJaxpr | None = None) -> int:
  """Bytes one client needs (the memory rule of this module's docstring; an upper bound).

  inputs (one client's slice of `per_client`) + outputs + the bytes of every
  intermediate value in the jaxpr of `fn`, nested computations included and a
  loop body counted once. `jaxpr` (from `trace_client`) saves tracing `fn` again.
  """
  closed = trace_client(fn, shared, per_client) if jaxpr is None else jaxpr
  inputs = sum(array_nbytes(x) for x in jax.tree.leaves(abstract(per_client, drop_leading=True)))
  outputs = sum(array_nbytes(v.aval) for v in closed.jaxpr.outvars)
  intermediates = sum(array_nbytes(v.aval) for eqn in equations(closed) for v in eqn.outvars)
  return inputs + outputs + intermediates


def default_memory_budget(device: jax.Device | None = None) -> int:
  """Bytes a client map may use at once: half of an accelerator's memory, a quarter of host RAM on CPU."""
  device = device or jax.local_devices()[0]
  if device.platform in ACCELERATOR_PLATFORMS:
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
      return int(stats["bytes_limit"]) // 2
  try:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    physical = 16 << 30
  return int(physical) // 4


def default_chunk_size(fn: Callable, shared: PyTree, per_client: PyTree, memory_budget: int | None = None,
                       jaxpr: jex_core.ClosedJaxpr | None = None) -> int:
  """Clients to run at once within `memory_budget` bytes (default `default_memory_budget()`).

  k = ⌊budget / client_footprint⌋, at least 1, at most C, then balanced: the
  smallest k that keeps the same number of chunks, so all chunks are (nearly)
  equal and none is a small remainder.
  """
  c = num_clients(per_client)
  budget = default_memory_budget() if memory_budget is None else memory_budget
  per_client_bytes = max(client_footprint(fn, shared, per_client, jaxpr), 1)
  k = int(min(c, max(1, budget // per_client_bytes)))
  num_chunks = math.ceil(c / k)
  return math.ceil(c / num_chunks)
