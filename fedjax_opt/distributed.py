"""Many hosts: one device mesh over every process, each process feeding its own clients.

JAX runs one Python process per host (its "multi-controller" model: every
process runs the same program on its own devices, and a jitted function
whose arrays span all processes' devices runs as one SPMD program; see the
JAX guide "Multi-host and multi-process environments"). This module is the
thin layer between that and `fedjax_opt`:

* `initialize(...)` wraps `jax.distributed.initialize` (coordinator address,
  number of processes, this process's id). Call it first, before anything
  else touches JAX's backends. On CPU, JAX uses Gloo collectives over TCP.
* `client_mesh()` is the global `Mesh` with one axis, `"clients"`, over the
  devices of every process, grouped by process; `client_map.sharded(mesh)`
  runs clients on it.
* `global_batches(local_batches, mesh)` turns the `ClientBatches` a process
  holds (its own clients, `[C_local, S, B, ...]`) into global arrays
  `[C_local × P, ...]` split on the clients axis, with
  `jax.make_array_from_process_local_data`: process p's clients become rows
  `[p C_local, (p + 1) C_local)`, and no data crosses hosts. Every process
  must hold the same number of clients (`pad_batches` fills with zero-weight
  clients, which every aggregator ignores).
* `replicate(tree, mesh)` puts the server state (the same value on every
  process) on every device; `shard_per_client_state` instead splits
  per-client tables (`[num_clients, ...]`) on the clients axis, so a table
  of N rows costs N / devices rows per device.
* `to_host(tree)` brings results back as NumPy arrays (replicated arrays from
  the local copy, split ones with an all-gather).

With these, `jax.jit(algorithm.step)(state, batches)` is the same call as on
one machine; the aggregation's weighted sums become one all-reduce across
hosts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.types import ClientBatches, materialize

__all__ = ["CLIENTS_AXIS", "client_mesh", "global_batches", "initialize", "pad_batches", "replicate",
           "shard_per_client_state", "shutdown", "to_host"]

PyTree = Any

CLIENTS_AXIS = client_map_lib.CLIENTS_AXIS


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Any = None, initialization_timeout: int = 300,
               **kwargs: Any) -> None:
  """Connects this process to the others: `jax.distributed.initialize` with checked arguments.

  Call once per process, before any other JAX call. With all three arguments
  None, JAX detects them from the cluster environment (SLURM, TPU pods, MPI ...).

  Args:
    coordinator_address: "host:port" of process 0's coordination service,
      e.g. "10.0.0.1:1234" (or "127.0.0.1:<port>" for processes on one machine).
    num_processes: P, the number of processes.
    process_id: this process's id in [0, P).
    local_device_ids: restricts this process to some of its local devices.
    initialization_timeout: seconds to wait for every process to connect.
    **kwargs: passed on to `jax.distributed.initialize` (e.g. `heartbeat_timeout_seconds`).
  """
  given = [coordinator_address is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given):
    raise ValueError("give all of coordinator_address, num_processes and process_id, or none of them (auto-detect); "
                     f"got coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
                     f"process_id={process_id!r}.")
  if coordinator_address is not None:
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
      raise ValueError(f"coordinator_address must be 'host:port'; got {coordinator_address!r}.")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
      raise ValueError(f"num_processes must be a positive int; got {num_processes!r}.")
    if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
      raise ValueError(f"process_id must be an int in [0, num_processes={num_processes}); got {process_id!r}.")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, local_device_ids=local_device_ids,
                             initialization_timeout=initialization_timeout, **kwargs)


def shutdown() -> None:
  """Disconnects this process (`jax.distributed.shutdown`); a no-op when not initialized."""
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()


def client_mesh(axis_name: str = CLIENTS_AXIS) -> Mesh:
  """The global one-axis mesh over every device of every process, grouped by process.

  Process p's devices hold a contiguous block of the clients axis, which is
  what lets each process feed its own clients (`global_batches`).
  """
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return client_map_lib.client_mesh(devices, axis_name)


def _local_rows(mesh: Mesh, axis_name: str) -> int:
  """Devices of this process on the clients axis (its share of each global client block)."""
  local = {d.id for d in jax.local_devices()}
  axis = mesh.axis_names.index(axis_name)
  devices = np.moveaxis(np.asarray(mesh.devices), axis, 0).reshape(mesh.devices.shape[axis], -1)
  return int(sum(any(d.id in local for d in row) for row in devices))


def pad_batches(batches: ClientBatches, multiple: int) -> ClientBatches:
  """Appends zero-weight clients (mask all False, zero data, weight 0, client_id 0) up to a multiple of `multiple`.

  A zero-weight client takes no part: `local_train` leaves it at Δ = 0 (no
  real example), the aggregators give it no weight, and per-client state is
  never written for it.
  """
  if not isinstance(batches, ClientBatches):
    raise TypeError(f"batches must be a fedjax_opt.ClientBatches; got {type(batches).__name__}.")
  if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
    raise ValueError(f"multiple must be a positive int; got {multiple!r}.")
  padded, _ = client_map_lib.pad_clients(
      (materialize(batches.data), batches.mask, batches.weight, batches.client_id), multiple)
  data, mask, weight, client_id = padded
  return ClientBatches(data=data, mask=mask, weight=weight, client_id=client_id)


def global_batches(local_batches: ClientBatches, mesh: Mesh | None = None,
                   axis_name: str = CLIENTS_AXIS) -> ClientBatches:
  """This process's clients `[C_local, ...]` -> global `ClientBatches` split on the mesh's clients axis.

  `C_local` is first padded (`pad_batches`) to a multiple of this process's
  devices on the axis. The global client count is `C_local` × the number of
  processes along the axis; every process must pass the same (padded)
  `C_local`.

  Args:
    local_batches: the round's clients held by this process (host or device arrays).
    mesh: the global mesh (default `client_mesh()`).
    axis_name: the mesh axis clients are split on.

  Returns:
    `ClientBatches` of global `jax.Array`s sharded `PartitionSpec(axis_name)`.
  """
  mesh = client_mesh(axis_name) if mesh is None else mesh
  rows = _local_rows(mesh, axis_name)
  batches = pad_batches(local_batches, rows)
  groups = mesh.shape[axis_name] // rows
  sharding = NamedSharding(mesh, PartitionSpec(axis_name))

  def make(leaf):
    leaf = np.asarray(leaf)
    return jax.make_array_from_process_local_data(sharding, leaf, (leaf.shape[0] * groups,) + leaf.shape[1:])

  return jax.tree.map(make, batches)


def _put(tree: PyTree, sharding_for: Any) -> PyTree:
  """`jax.device_put` of host copies of every leaf (typed PRNG keys through their raw data)."""

  def put(x):
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
      impl = jax.random.key_impl(x)
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding_for(x))
      return jax.random.wrap_key_data(data, impl=impl)
    return jax.device_put(np.asarray(x), sharding_for(x))

  return jax.tree.map(put, tree)


def replicate(tree: PyTree, mesh: Mesh | None = None) -> PyTree:
  """Every leaf on every device of `mesh` (`PartitionSpec()`); each process must pass the same values."""
  mesh = client_mesh() if mesh is None else mesh
  sharding = NamedSharding(mesh, PartitionSpec())
  return _put(tree, lambda x: sharding)


def shard_per_client_state(state: PyTree, num_clients: int, mesh: Mesh | None = None,
                           axis_name: str = CLIENTS_AXIS) -> PyTree:
  """Places `state`: leaves with a leading `[num_clients]` axis split on `axis_name`, the rest replicated.

  Per-client tables (`fedjax_opt.core.per_client`, e.g. SCAFFOLD's c_i) then
  take N / devices rows per device; the algorithms' gathers and scatters by
  client id, which run outside the client map, are partitioned by the
  compiler. `num_clients` must be divisible by the axis size.
  """
  mesh = client_mesh(axis_name) if mesh is None else mesh
  size = mesh.shape[axis_name]
  if num_clients % size:
    raise ValueError(f"num_clients={num_clients} must be divisible by the {size} devices of mesh axis {axis_name!r} "
                     "to split per-client tables; pad the table or replicate the state (replicate()).")
  split = NamedSharding(mesh, PartitionSpec(axis_name))
  whole = NamedSharding(mesh, PartitionSpec())
  return _put(state, lambda x: split if jnp.ndim(x) >= 1 and jnp.shape(x)[0] == num_clients else whole)


def to_host(tree: PyTree) -> PyTree:
  """NumPy copies of global arrays: the local copy of replicated ones, an all-gather of split ones."""

  def get(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return get(jax.random.key_data(x))
    if x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x.addressable_data(0)) if x.is_fully_replicated else np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(get, tree)
