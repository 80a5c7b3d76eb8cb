"""`client_map`: the one place that maps a per-client function over the client axis.

Every algorithm runs its clients through `map_clients(mode, fn, shared, per_client)`,
which computes `fn(shared, per_client[c])` for every client c and stacks the
results on a leading `[C]` axis. `shared` (the server model, control variates
...) is broadcast; every leaf of `per_client` has a leading `[C]` axis. All
modes give the same numbers, to float tolerance:

* `vmap()`: all clients at once with `jax.vmap`.
* `sequential()`: a compiled loop over clients (`lax.map`), one client at a
  time inside the same jitted program.
* `chunked(k)`: a compiled loop over chunks of k clients, vmapped inside a
  chunk, so k clients' buffers live at once; `chunked()` picks k from the
  memory budget (`client_footprint`, `default_chunk_size`).
* `sharded(mesh, inner=...)`: `jax.shard_map` over the mesh axis named
  `"clients"`, any of the modes above inside each device; a client count the
  devices do not divide is padded with all-zero clients whose outputs are
  dropped.
* `auto()` (the default): the fastest mode measured for the backend, the
  model and C, within the memory budget.

Flags of `vmap`, `sequential` and `chunked` rewrite the per-client function
for XLA:CPU without changing its values: `canonical_convs`, `unroll`,
`fuse_small_dots` (`rewrite_client_fn`). A mode is a small frozen object or
its name ("auto", "vmap", "chunked:64", "sequential:canonical_convs",
"vmap:unroll", "sharded:chunked:8", ...), accepted by every algorithm factory
as `client_map=`.

The package, one idea a module: `modes` (the modes, their names, `map_clients`),
`streaming` (`map_clients_and_sum`),
`heuristics` (what `auto` picks), `rewrites` (the jaxpr rewrites), `memory`
(the memory rule), `tracing` (the per-client function as a jaxpr). What
`auto` picks and why, timings, the memory rule's numbers and why there is no
`pmap` mode: docs/scaling.md. `streaming`: loop modes that add up one part
of the clients' outputs as they go (`map_clients_and_sum`), so a round with a
sum-type aggregator never stacks the C updates.
"""

from fedjax_opt.core.client_map.heuristics import CPU_VMAP_MAX_BYTES, CPU_VMAP_MAX_PARAMS
from fedjax_opt.core.client_map.memory import client_footprint, default_chunk_size, default_memory_budget
from fedjax_opt.core.client_map.modes import (CLIENTS_AXIS, Auto, Chunked, ClientMap, FromPolicy, Sharded, VMap, auto,
                                              chunked, client_mesh, concrete, map_clients, pad_clients, resolve,
                                              sequential, sharded, vmap)
from fedjax_opt.core.client_map.rewrites import (FUSED_DOT_MAX_CONTRACTION, canonical_conv, has_convolution,
                                                 has_small_batched_dot, rewrite_client_fn, sum_of_products)
from fedjax_opt.core.client_map.streaming import loop_chunk, map_clients_and_sum
from fedjax_opt.core.client_map.tracing import trace_client

__all__ = [
    # modes and their names
    "ClientMap", "VMap", "Chunked", "Auto", "Sharded", "FromPolicy", "vmap", "sequential", "chunked", "auto",
    "sharded", "resolve", "concrete", "map_clients",
    # loops that sum as they go
    "loop_chunk", "map_clients_and_sum",
    # devices
    "CLIENTS_AXIS", "client_mesh", "pad_clients",
    # what auto decides with
    "CPU_VMAP_MAX_PARAMS", "CPU_VMAP_MAX_BYTES", "has_convolution", "has_small_batched_dot", "trace_client",
    # the memory rule
    "client_footprint", "default_memory_budget", "default_chunk_size",
    # the rewrites
    "FUSED_DOT_MAX_CONTRACTION", "rewrite_client_fn", "canonical_conv", "sum_of_products",
]
