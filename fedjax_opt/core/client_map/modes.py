"""The modes: how `map_clients` runs `fn(shared, per_client[c])` over the C clients, and their names.

* `VMap` (`vmap()`): all clients at once with `jax.vmap`.
* `Chunked` (`chunked(k)`, `sequential()` = `chunked(1)`): a compiled loop
  (`lax.map`) over chunks of k clients, vmapped inside a chunk; `chunked()`
  picks k from the memory budget (`default_chunk_size`).
* `Sharded` (`sharded(mesh, inner)`): `jax.shard_map` over the mesh axis
  `"clients"`, any single-device mode inside each device; C is padded to a
  multiple of the devices with all-zero clients whose outputs are dropped.
* `Auto` (`auto()`, the default): the mode measured fastest for the backend,
  the model and C (`autotune`), or the rule `choose` decides when measuring
  is off.
* `FromPolicy` (what None resolves to): the execution policy's client map
  (`core.execution`), looked up when the step is traced; "auto" unless a
  policy sets another.

`resolve` turns a mode, its name ("vmap", "sequential:canonical_convs",
"chunked:64:unroll", "sharded:chunked:8", ...) or None (the policy's) into a
mode; `concrete` follows `FromPolicy` to the mode it stands for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from fedjax_opt.core import execution
from fedjax_opt.core.client_map import autotune
from fedjax_opt.core.client_map.heuristics import choose
from fedjax_opt.core.client_map.memory import default_chunk_size
from fedjax_opt.core.client_map.rewrites import rewrite_client_fn
from fedjax_opt.core.client_map.tracing import num_clients
from fedjax_opt.core.types import PyTree
from fedjax_opt.core.validation import check_optional_int

__all__ = ["Auto", "CLIENTS_AXIS", "Chunked", "ClientMap", "FromPolicy", "Sharded", "VMap", "auto", "chunked",
           "client_mesh", "concrete", "map_clients", "pad_clients", "resolve", "sequential", "sharded", "vmap"]

CLIENTS_AXIS = "clients"
"""The name of the device-mesh axis that clients are sharded on."""


def _check_flag(value: Any, name: str) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be a bool; got {type(value).__name__}.")


def _repr(mode: Any) -> str:
  """The dataclass repr, with `fuse_small_dots` shown only when set."""
  fields = [f"{f.name}={getattr(mode, f.name)!r}" for f in dataclasses.fields(mode)
            if f.name != "fuse_small_dots" or mode.fuse_small_dots]
  return f"{type(mode).__name__}({', '.join(fields)})"


def _map_rewritten(mapped: Callable, shared: PyTree, per_client: PyTree, fuse_small_dots: bool) -> PyTree:
  """`mapped(shared, per_client)`, its small batched dots fused when `fuse_small_dots` (vmap makes them)."""
  return rewrite_client_fn(mapped, fuse_small_dots=fuse_small_dots)(shared, per_client)


@dataclasses.dataclass(frozen=True)
class VMap:
  """All clients at once with `jax.vmap`.

  Attributes:
    unroll: unroll every `lax.scan` inside the per-client function.
    canonical_convs: run its convolutions in XLA:CPU's fast layout (`canonical_conv`).
    fuse_small_dots: after vmapping, run every batched dot_general that
      contracts at most `FUSED_DOT_MAX_CONTRACTION` entries as a fused sum of
      products (`sum_of_products`).
  """

  unroll: bool = False
  canonical_convs: bool = False
  fuse_small_dots: bool = False

  def __post_init__(self):
    _check_flag(self.unroll, "unroll")
    _check_flag(self.canonical_convs, "canonical_convs")
    _check_flag(self.fuse_small_dots, "fuse_small_dots")

  __repr__ = _repr

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    fn = rewrite_client_fn(fn, unroll=self.unroll, canonical_convs=self.canonical_convs)
    return _map_rewritten(jax.vmap(fn, in_axes=(None, 0)), shared, per_client, self.fuse_small_dots)


@dataclasses.dataclass(frozen=True)
class Chunked:
  """Clients `chunk_size` at a time: a compiled loop over chunks, vmapped inside a chunk.

  A client count that `chunk_size` does not divide is handled by `lax.map`
  (the remainder runs as one smaller vmapped batch). `chunk_size=1` is a plain
  compiled loop over clients; `chunk_size=None` picks it from `memory_budget`
  (`default_chunk_size`).

  Attributes:
    chunk_size: clients per chunk (None: from the memory rule).
    unroll: unroll every `lax.scan` inside the per-client function, and the
      loop over chunks (each chunk traced once: compile time grows with
      C / chunk_size, and XLA:CPU then keeps every chunk's buffers, so memory
      is no longer bounded by the chunk size).
    canonical_convs: run convolutions in XLA:CPU's fast layout (`canonical_conv`).
    memory_budget: bytes for `chunk_size=None` (default `default_memory_budget()`).
    fuse_small_dots: run the batched dot_generals of the map (a chunk's
      vmap) that contract at most `FUSED_DOT_MAX_CONTRACTION` entries as
      fused sums of products (`sum_of_products`).
  """

  chunk_size: int | None = None
  unroll: bool = False
  canonical_convs: bool = False
  memory_budget: int | None = None
  fuse_small_dots: bool = False

  def __post_init__(self):
    check_optional_int(self.chunk_size, "chunk_size")
    _check_flag(self.unroll, "unroll")
    _check_flag(self.canonical_convs, "canonical_convs")
    check_optional_int(self.memory_budget, "memory_budget")
    _check_flag(self.fuse_small_dots, "fuse_small_dots")

  __repr__ = _repr

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    c = num_clients(per_client)
    k = self.chunk_size or default_chunk_size(fn, shared, per_client, self.memory_budget)
    if k >= c:
      return VMap(self.unroll, self.canonical_convs, self.fuse_small_dots)(fn, shared, per_client)
    fn = rewrite_client_fn(fn, unroll=self.unroll, canonical_convs=self.canonical_convs)
    if self.unroll:
      mapped = lambda s, pc: _unrolled_chunks(fn, s, pc, c, k)
    else:
      batch_size = None if k == 1 else k
      mapped = lambda s, pc: jax.lax.map(lambda one: fn(s, one), pc, batch_size=batch_size)
    return _map_rewritten(mapped, shared, per_client, self.fuse_small_dots)


def _unrolled_chunks(fn: Callable, shared: PyTree, per_client: PyTree, c: int, k: int) -> PyTree:
  """`vmap(fn)` over consecutive slices of k clients, traced one after another (no loop), concatenated."""
  outs = []
  for start in range(0, c, k):
    chunk = jax.tree.map(lambda a, s=start: a[s:s + k], per_client)
    outs.append(jax.vmap(fn, in_axes=(None, 0))(shared, chunk))
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)


@dataclasses.dataclass(frozen=True)
class Auto:
  """The default: the fastest mode measured on this machine (`autotune.decide`), or, with measuring off, the
  mode the measured rule `choose` (fedjax_opt/core/client_map/heuristics.py) decides for the backend, model and C.

  Decided when the step is traced; never more than `memory_budget` bytes of
  clients at once (`client_footprint`). Splitting clients over several
  devices is the rule's decision; each device's share is then measured.

  Attributes:
    memory_budget: bytes a map may use at once (default `default_memory_budget()`).
    shard: allow splitting clients across several devices (False inside `sharded`).
    measure: time the candidate modes (`autotune`); None: unless env `FEDJAX_OPT_AUTOTUNE=off`.
    cache_dir: the folder of measured decisions (None: `autotune.cache_dir()`; "off": memory only).
    timer: `timer(name, run) -> seconds` for the measurement (None: wall time; tests pass a fake).
  """

  memory_budget: int | None = None
  shard: bool = True
  measure: bool | None = None
  cache_dir: str | None = None
  timer: Callable | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    check_optional_int(self.memory_budget, "memory_budget")
    _check_flag(self.shard, "shard")
    if self.measure is not None:
      _check_flag(self.measure, "measure")

  def resolve(self, fn: Callable | None = None, shared: PyTree = None, per_client: PyTree = None) -> ClientMap:
    """The concrete mode for this call; without arguments, the default for the backend alone."""
    choice = choose(fn, shared, per_client, self.memory_budget, self.shard)
    if choice.shard:
      return Sharded(inner=dataclasses.replace(self, shard=False))
    if fn is not None and autotune.measuring(self.measure):
      choice = autotune.decide(fn, shared, per_client, self.memory_budget, folder=self.cache_dir, timer=self.timer)
    if choice.chunk_size is None:
      return VMap(canonical_convs=choice.canonical_convs, fuse_small_dots=choice.fuse_small_dots)
    return Chunked(choice.chunk_size, canonical_convs=choice.canonical_convs, fuse_small_dots=choice.fuse_small_dots)

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    return self.resolve(fn, shared, per_client)(fn, shared, per_client)


def client_mesh(devices: Any = None, axis_name: str = CLIENTS_AXIS) -> Mesh:
  """A one-axis `Mesh` named `axis_name` over `devices` (default: every device of every process)."""
  devices = np.asarray(jax.devices() if devices is None else devices, dtype=object).reshape(-1)
  return Mesh(devices, (axis_name,), axis_types=(AxisType.Auto,))


def _auto_axes(mesh: Mesh) -> Mesh:
  """`mesh` with every axis of type Auto.

  `jax.make_mesh` gives Explicit axes by default, under which `shard_map`
  demands inputs already sharded as its `in_specs` say. The round's arrays are
  built inside the step with no sharding of their own, so the client map lets
  the compiler place them (Auto axes), as on the library's `client_mesh()`:
  the same devices, the same axis names, the same program.
  """
  types = getattr(mesh, "axis_types", None)
  if types is None or all(t == AxisType.Auto for t in types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def pad_clients(per_client: PyTree, multiple: int) -> tuple[PyTree, int]:
  """Appends all-zero clients (False masks, zero data) so that C is a multiple of `multiple`.

  Returns:
    (padded pytree with leading axis ⌈C / multiple⌉ · multiple, the original C).
  """
  c = num_clients(per_client)
  pad = -c % multiple
  if not pad:
    return per_client, c

  def leaf(a):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      filler = jnp.repeat(a[:1], pad, axis=0)
    else:
      filler = jnp.zeros((pad,) + a.shape[1:], a.dtype)
    return jnp.concatenate([a, filler], axis=0)

  return jax.tree.map(leaf, per_client), c


@dataclasses.dataclass(frozen=True)
class Sharded:
  """Clients split across the devices of `mesh` (axis `axis_name`) with `jax.shard_map`; `inner` on each device.

  `shared` is replicated (`PartitionSpec()`), every per-client leaf is split
  on its leading axis (`PartitionSpec(axis_name)`), and so are the outputs.
  C is padded to a multiple of the axis size with all-zero clients whose
  outputs are dropped. What the caller does with the stacked `[C]` outputs
  (the weighted sums of the aggregators) is partitioned by the compiler into
  per-device partial sums and one all-reduce (docs/scaling.md).

  Attributes:
    mesh: a `jax.sharding.Mesh` with an axis named `axis_name`; None: all
      devices (`client_mesh()`), built when the step is traced.
    inner: the mode run on each device's block of clients (a mode or its name;
      "auto" decides from the per-device C).
    axis_name: the mesh axis clients are split on.
  """

  mesh: Mesh | None = None
  inner: Any = "auto"
  axis_name: str = CLIENTS_AXIS

  def __post_init__(self):
    if self.mesh is not None:
      if not isinstance(self.mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(self.mesh).__name__}.")
      if self.axis_name not in self.mesh.axis_names:
        raise ValueError(f"mesh has no axis named {self.axis_name!r} (axis_name); its axes are {self.mesh.axis_names}.")
    inner = resolve(self.inner)
    if isinstance(inner, Sharded):
      raise ValueError("inner must be a single-device mode (vmap, sequential, chunked, auto); got a sharded mode.")
    if isinstance(inner, Auto) and inner.shard:  # inside a device: decide among the single-device modes
      inner = dataclasses.replace(inner, shard=False)
    object.__setattr__(self, "inner", inner)

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    mesh = self.mesh if self.mesh is not None else client_mesh(axis_name=self.axis_name)
    mesh = _auto_axes(mesh)
    padded, c = pad_clients(per_client, mesh.shape[self.axis_name])
    inner = self.inner
    mapped = jax.shard_map(lambda s, pc: inner(fn, s, pc), mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(
        self.axis_name)), out_specs=PartitionSpec(self.axis_name), check_vma=False)
    out = mapped(shared, padded)
    if num_clients(padded) == c:
      return out
    return jax.tree.map(lambda a: a[:c], out)


@dataclasses.dataclass(frozen=True)
class FromPolicy:
  """The client map of the execution policy in force when the step is traced (`core.execution`; "auto" by
  default). What a factory's `client_map=None` means."""

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    return concrete(self)(fn, shared, per_client)


ClientMap = VMap | Chunked | Auto | Sharded | FromPolicy


def vmap(*, unroll: bool = False, canonical_convs: bool = False, fuse_small_dots: bool = False) -> VMap:
  """All clients at once with `jax.vmap`."""
  return VMap(unroll, canonical_convs, fuse_small_dots)


def sequential(*, unroll: bool = False, canonical_convs: bool = False, fuse_small_dots: bool = False) -> Chunked:
  """One client at a time, as a compiled loop (`lax.map`) inside the jitted round."""
  return Chunked(1, unroll, canonical_convs, None, fuse_small_dots)


def chunked(chunk_size: int | None = None, *, unroll: bool = False, canonical_convs: bool = False,
            memory_budget: int | None = None, fuse_small_dots: bool = False) -> Chunked:
  """`chunk_size` clients at a time (vmapped), chunks in a compiled loop; None: from the memory budget."""
  return Chunked(chunk_size, unroll, canonical_convs, memory_budget, fuse_small_dots)


def auto(memory_budget: int | None = None, *, shard: bool = True, measure: bool | None = None,
         cache_dir: str | None = None) -> Auto:
  """The mode measured fastest on this machine for the model and C (`autotune`); never more than
  `memory_budget` at once. `measure=False` (or env `FEDJAX_OPT_AUTOTUNE=off`): the measured rule instead."""
  return Auto(memory_budget, shard, measure, cache_dir)


def sharded(mesh: Mesh | None = None, inner: Any = "auto", axis_name: str = CLIENTS_AXIS) -> Sharded:
  """Clients split across the devices of `mesh` with `jax.shard_map`, `inner` mode on each device."""
  return Sharded(mesh, inner, axis_name)


_MODE_NAMES = ("'auto', 'vmap', 'sequential', 'chunked', 'chunked:K' (each of the last four optionally followed by "
               "':unroll', ':canonical_convs' and/or ':fuse_small_dots'), 'sharded', 'sharded:<inner mode>'")
_FLAGS = ("unroll", "canonical_convs", "fuse_small_dots")


def _parse(mode: str) -> ClientMap | None:
  """The mode a name spells (see `_MODE_NAMES`), or None when it spells none."""
  if mode == "auto":
    return Auto()
  if mode == "sharded":
    return Sharded()
  if mode.startswith("sharded:"):
    inner = _parse(mode.split(":", 1)[1])
    return None if inner is None or isinstance(inner, Sharded) else Sharded(inner=inner)
  name, *rest = mode.split(":")
  chunk_size = None
  if name == "chunked" and rest and rest[0] not in _FLAGS:
    try:
      chunk_size = int(rest.pop(0))
    except ValueError:
      return None
    if chunk_size < 1:
      return None
  if name not in ("vmap", "sequential", "chunked") or len(set(rest)) != len(rest) or not set(rest) <= set(_FLAGS):
    return None
  flags = {flag: flag in rest for flag in _FLAGS}
  if name == "vmap":
    return VMap(**flags)
  return Chunked(1 if name == "sequential" else chunk_size, **flags)


def resolve(mode: ClientMap | str | None) -> ClientMap:
  """Turns a mode object, a name ("vmap", "chunked:64:unroll", "sharded:vmap", ...) or None (the execution
  policy's, `FromPolicy`) into a mode."""
  if mode is None:
    return FromPolicy()
  if isinstance(mode, (VMap, Chunked, Auto, Sharded, FromPolicy)):
    return mode
  parsed = _parse(mode) if isinstance(mode, str) else None
  if parsed is None:
    raise ValueError(f"client_map must be one of {_MODE_NAMES} or a mode from fedjax_opt.core.client_map; "
                     f"got {mode!r}.")
  return parsed


def concrete(mode: ClientMap | str | None) -> ClientMap:
  """`resolve(mode)`, with `FromPolicy` replaced by the policy's client map in force now."""
  mode = resolve(mode)
  if isinstance(mode, FromPolicy):
    mode = resolve(execution.current().client_map)
  return mode


def map_clients(mode: ClientMap | str | None, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
  """Computes `fn(shared, per_client[c])` for every client c, stacked on a leading [C] axis."""
  return resolve(mode)(fn, shared, per_client)
