"""`client_map`: the one place that maps a per-client function over the client axis.

Every algorithm runs its clients through `map_clients(mode, fn, shared, per_client)`,
which computes `fn(shared, per_client[c])` for every client c and stacks the
results on a leading `[C]` axis. `shared` (the server model, control variates
...) is broadcast; every leaf of `per_client` has a leading `[C]` axis.

Modes (all give the same numbers, to float tolerance):

* `vmap()`: `jax.vmap` over clients. Fills an accelerator; on CPU per-client
  weights turn matmuls into batched matmuls and convolutions into grouped
  convolutions.
* `sequential()`: a compiled loop over clients (`lax.map`), one client at a
  time inside the same jitted program.
* `chunked(k)`: `lax.map` over chunks of k clients, vmapped inside a chunk:
  bounds memory when C is large (k clients' activations and optimizer states
  live at once). `chunked()` picks k from a memory budget (below).
* `sharded(mesh, inner=...)`: `jax.shard_map` over the mesh axis named
  `"clients"`: client data split across devices, `shared` replicated, any of
  the modes above inside each device. A client count the devices do not
  divide is padded with all-zero clients (mask all False) whose outputs are
  sliced off, so the caller always sees `[C]`.
* `auto()` (the default): the fastest mode measured for the backend, the
  model and C (below), never more than the memory budget at once.

Two rewrites of the per-client function, flags of `vmap`, `sequential` and
`chunked` (and string suffixes ":canonical_convs", ":unroll"), both made on
its jaxpr (`rewrite_client_fn`):

* `canonical_convs=True` runs every convolution in the layout of XLA:CPU's
  fast convolution kernel ([N, *spatial, C] × [*kernel, I, O]), with explicit
  transposes around it (`canonical_conv`; results are bit-identical).
* `unroll=True` fully unrolls every `lax.scan` in it (a chunked map then
  also unrolls its loop over chunks).

Why, and what `auto` picks. Measured with jax 0.10.2 on a 2-core x86 CPU
(`benchmarks/throughput.py`; numbers in docs/scaling.md):

* Convolutions in loops. XLA:CPU moves a convolution whose operands are not
  in the canonical layout into it (transposes, then its Eigen kernel) only
  outside loops. A gradient step's weight- and input-gradient convolutions
  are not canonical, so inside a rolled loop (`lax.scan` over local steps,
  `lax.map` over clients) they ran as plain loop nests: the EMNIST CNN's
  weight gradient took 383 ms instead of 7 ms, a whole local step ~12× its
  time as a jitted call of its own. With `canonical_convs` the loop body
  holds canonical convolutions and a compiled loop over clients runs a CNN
  step as fast as one jitted call per step (25 vs 26 ms), while vmapped
  (grouped) convolutions stay ~3× slower. So on CPU a per-client function
  that convolves gets `sequential(canonical_convs=True)`. (Unrolling is the
  other cure, but no loop means no buffer reuse: XLA:CPU kept every
  unrolled chunk's buffers, ~94 MB per CNN client, so it does not bound memory.)
* Dense models: per-client weights turn matmuls into batched matmuls, which
  XLA:CPU runs as a loop of small products. The 2NN MLP (199k parameters)
  runs faster as a compiled loop over clients (`sequential`); multinomial
  logistic regression (610 parameters) runs faster vmapped. The switch is at
  `CPU_VMAP_MAX_PARAMS` parameters in `shared`.
* GPU/TPU: `vmap`, `chunked(k)` when C clients exceed the memory budget.

Memory rule of thumb. One client needs about

    inputs (its [S, B, ...] data) + outputs (Δ, ...) + every intermediate value
    of its computation (model copy, gradient, optimizer state, activations of
    one local step: a local step's scan body is counted once, not S times)

bytes, counted from the jaxpr of the per-client function (`client_footprint`)
with no liveness analysis, so it is an upper bound (101 MB for an EMNIST CNN
client with S=5, B=20, whose chunks XLA ran in 27-94 MB per client). A map over
C clients needs C times that at once under `vmap`, k times that under
`chunked(k)`, one client's under `sequential`; the stacked outputs `[C, ...]`
come on top. The default budget (`default_memory_budget`) is half of an
accelerator's memory, or a quarter of the host's physical memory on CPU;
`chunked()` and `auto()` use k = ⌊budget / per-client bytes⌋, balanced so
that chunks are of equal size.

A mode is a small frozen object, so it can be passed to any algorithm
factory (`fo.algorithms.fedavg(..., client_map=fo.client_map.chunked(64))`)
or named by a string ("auto", "vmap", "sequential", "chunked", "chunked:64",
"sequential:canonical_convs", "vmap:unroll", "sharded", "sharded:vmap",
"sharded:chunked:8").

Why there is no `pmap` mode: `jax.shard_map` over a one-axis mesh does what
`pmap` does (one program per device, explicit per-device blocks), composes
with `jit` and the rest of the program (the aggregation outside the map is
partitioned by the compiler), works unchanged across hosts, and is what the
JAX documentation recommends in place of `pmap` ("Migrating to jax.shard_map"
in the JAX docs). See docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives
from jax.sharding import AxisType, Mesh, PartitionSpec

PyTree = Any

CLIENTS_AXIS = "clients"
"""The name of the device-mesh axis that clients are sharded on."""

CPU_VMAP_MAX_PARAMS = 16_384
"""On CPU, `auto` vmaps dense per-client functions whose `shared` inputs hold at most this many scalars."""

_ACCELERATORS = ("gpu", "tpu")
_CONVOLUTION = "conv_general_dilated"


def _num_clients(per_client: PyTree) -> int:
  leaves = jax.tree.leaves(per_client)
  if not leaves:
    raise ValueError("map_clients needs at least one per-client array with a leading [C] axis.")
  sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"every per-client array must share the leading client axis [C]; got leading sizes {sizes}.")
  return sizes.pop()


# ---- the per-client computation, seen as a jaxpr ------------------------------------------------------------


def _abstract(tree: PyTree, drop_leading: bool = False) -> PyTree:
  """Shape/dtype structs of `tree`'s leaves (without the leading axis when `drop_leading`)."""

  def leaf(x):
    shape = tuple(jnp.shape(x))
    return jax.ShapeDtypeStruct(shape[1:] if drop_leading else shape, jnp.result_type(x))

  return jax.tree.map(leaf, tree)


def trace_client(fn: Callable, shared: PyTree, per_client: PyTree) -> jex_core.ClosedJaxpr:
  """The jaxpr of `fn(shared, per_client[c])` for one client (abstract: nothing is computed)."""
  return jax.make_jaxpr(fn)(_abstract(shared), _abstract(per_client, drop_leading=True))


def _sub_jaxprs(value: Any) -> Iterator[jex_core.Jaxpr]:
  if isinstance(value, jex_core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jex_core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def _equations(jaxpr: jex_core.Jaxpr) -> Iterator[jex_core.JaxprEqn]:
  """Every equation of `jaxpr` and of the jaxprs nested in its equations (scan bodies, jit calls ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        yield from _equations(sub)


def has_convolution(jaxpr: jex_core.ClosedJaxpr | jex_core.Jaxpr) -> bool:
  """True when the computation (or anything nested in it) holds a convolution."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr
  return any(eqn.primitive.name == _CONVOLUTION for eqn in _equations(jaxpr))


def _nbytes(aval: Any) -> int:
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  itemsize = getattr(dtype, "itemsize", 8)
  return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def _tree_nbytes(tree: PyTree) -> int:
  return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def client_footprint(fn: Callable, shared: PyTree, per_client: PyTree,
                     jaxpr: jex_core.ClosedJaxpr | None = None) -> int:
  """Bytes one client needs (the memory rule of thumb of the module docstring; an upper bound).

  inputs (one client's slice of `per_client`) + outputs + the bytes of every
  intermediate value in the jaxpr of `fn`, nested computations included and a
  loop body counted once. `jaxpr` (from `trace_client`) saves tracing `fn` again.
  """
  closed = trace_client(fn, shared, per_client) if jaxpr is None else jaxpr
  inputs = _tree_nbytes(_abstract(per_client, drop_leading=True))
  outputs = sum(_nbytes(v.aval) for v in closed.jaxpr.outvars)
  intermediates = sum(_nbytes(v.aval) for eqn in _equations(closed.jaxpr) for v in eqn.outvars)
  return inputs + outputs + intermediates


def default_memory_budget(device: jax.Device | None = None) -> int:
  """Bytes a client map may use at once: half of an accelerator's memory, a quarter of host RAM on CPU."""
  device = device or jax.local_devices()[0]
  if device.platform in _ACCELERATORS:
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
  c = _num_clients(per_client)
  budget = default_memory_budget() if memory_budget is None else memory_budget
  per_client_bytes = max(client_footprint(fn, shared, per_client, jaxpr), 1)
  k = int(min(c, max(1, budget // per_client_bytes)))
  num_chunks = math.ceil(c / k)
  return math.ceil(c / num_chunks)


# ---- rewriting the per-client computation: unrolled scans, convolutions in the canonical layout --------------


def canonical_conv(lhs: jax.Array, rhs: jax.Array, *, window_strides, padding, lhs_dilation, rhs_dilation,
                   dimension_numbers, feature_group_count, batch_group_count, precision=None,
                   preferred_element_type=None, **unused) -> jax.Array:
  """`lax.conv_general_dilated` in the layout of XLA:CPU's fast kernel, with explicit transposes around it.

  The operands are transposed to `[N, *spatial, C]` and `[*kernel, I, O]`, the
  convolution runs with those dimension numbers ("NHWC", "HWIO", "NHWC" in
  2-D), and the result is transposed back to the requested layout. Same
  arguments (the jaxpr parameters of the convolution) and bit-identical
  result. XLA:CPU does this itself outside loops; inside a loop body it
  does not, and the gradient convolutions (whose layouts put the batch or
  the kernel's output features elsewhere) then run as plain loop nests.
  """
  del unused
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  nsp = len(window_strides)
  spatial = tuple(range(1, nsp + 1))
  x = jnp.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
  w = jnp.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
  canonical = jax.lax.ConvDimensionNumbers((0, nsp + 1, *spatial), (nsp + 1, nsp, *range(nsp)),
                                           (0, nsp + 1, *spatial))
  y = jax.lax.conv_general_dilated(x, w, window_strides, padding, lhs_dilation, rhs_dilation, canonical,
                                   feature_group_count, batch_group_count, precision, preferred_element_type)
  perm = [0] * (nsp + 2)
  perm[out_spec[0]], perm[out_spec[1]] = 0, nsp + 1
  for i in range(nsp):
    perm[out_spec[2 + i]] = 1 + i
  return jnp.transpose(y, perm)


def _is_canonical(params: dict) -> bool:
  lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
  nsp = len(params["window_strides"])
  spatial = tuple(range(1, nsp + 1))
  return (tuple(lhs_spec) == (0, nsp + 1, *spatial) and tuple(rhs_spec) == (nsp + 1, nsp, *range(nsp))
          and tuple(out_spec) == (0, nsp + 1, *spatial))


def _conv_call(eqn: jex_core.JaxprEqn) -> jex_core.JaxprEqn:
  """The convolution `eqn` replaced by a call of `canonical_conv` on the same variables."""
  structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
  closed = jax.make_jaxpr(lambda lhs, rhs: canonical_conv(lhs, rhs, **eqn.params))(*structs)
  return jex_core.new_jaxpr_eqn(eqn.invars, eqn.outvars, jex_primitives.closed_call_p, {"call_jaxpr": closed},
                                closed.effects, eqn.source_info)


def _rewrite_value(value: Any, unroll: bool, canonical_convs: bool) -> Any:
  if isinstance(value, jex_core.ClosedJaxpr):
    return value.replace(jaxpr=_rewrite_jaxpr(value.jaxpr, unroll, canonical_convs))
  if isinstance(value, jex_core.Jaxpr):
    return _rewrite_jaxpr(value, unroll, canonical_convs)
  if isinstance(value, tuple) and any(isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr)) for v in value):
    return tuple(_rewrite_value(v, unroll, canonical_convs) for v in value)
  return value


def _rewrite_jaxpr(jaxpr: jex_core.Jaxpr, unroll: bool, canonical_convs: bool) -> jex_core.Jaxpr:
  """`jaxpr` (nested jaxprs included) with scans fully unrolled and/or convolutions in the canonical layout."""
  eqns = []
  for eqn in jaxpr.eqns:
    if canonical_convs and eqn.primitive.name == _CONVOLUTION and not _is_canonical(eqn.params):
      eqns.append(_conv_call(eqn))
      continue
    params = {k: _rewrite_value(v, unroll, canonical_convs) for k, v in eqn.params.items()}
    if unroll and eqn.primitive.name == "scan":
      # 0 = no loop at all. (unroll=length leaves a while loop of one trip when length is 1, and XLA:CPU
      # still runs its body as a loop body: a one-step scan of a convolution ran 12× slower.)
      params["unroll"] = 0
    eqns.append(eqn.replace(params=params))
  return jaxpr.replace(eqns=eqns)


def rewrite_client_fn(fn: Callable, *, unroll: bool = False, canonical_convs: bool = False) -> Callable:
  """`fn(shared, client)` with every `lax.scan` unrolled and/or every convolution in the canonical layout.

  The function is traced to a jaxpr, rewritten, and the jaxpr is evaluated in
  place of `fn`: same values (to float rounding), differentiable, usable under
  jit/vmap. `unroll` sets each scan's `unroll` parameter to 0 (the scan
  primitive's "no loop at all"); `canonical_convs` replaces each convolution
  not already in the canonical layout by `canonical_conv`. Both are for
  XLA:CPU (module docstring).
  """
  if not (unroll or canonical_convs):
    return fn

  def rewritten(shared, client):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(shared, client)
    closed = closed.replace(jaxpr=_rewrite_jaxpr(closed.jaxpr, unroll, canonical_convs))
    out = jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves((shared, client)))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return rewritten


def unroll_scans(fn: Callable) -> Callable:
  """`fn` with every `lax.scan` inside it fully unrolled (`rewrite_client_fn(fn, unroll=True)`)."""
  return rewrite_client_fn(fn, unroll=True)


# ---- the modes -----------------------------------------------------------------------------------------------


def _check_flag(value: Any, name: str) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be a bool; got {type(value).__name__}.")


def _check_budget(memory_budget: Any) -> None:
  if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                    or memory_budget < 1):
    raise ValueError(f"memory_budget must be a positive int (bytes) or None; got {memory_budget!r}.")


@dataclasses.dataclass(frozen=True)
class VMap:
  """All clients at once with `jax.vmap`.

  Attributes:
    unroll: unroll every `lax.scan` inside the per-client function.
    canonical_convs: run its convolutions in XLA:CPU's fast layout (`canonical_conv`).
  """

  unroll: bool = False
  canonical_convs: bool = False

  def __post_init__(self):
    _check_flag(self.unroll, "unroll")
    _check_flag(self.canonical_convs, "canonical_convs")

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    fn = rewrite_client_fn(fn, unroll=self.unroll, canonical_convs=self.canonical_convs)
    return jax.vmap(fn, in_axes=(None, 0))(shared, per_client)


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
  """

  chunk_size: int | None = None
  unroll: bool = False
  canonical_convs: bool = False
  memory_budget: int | None = None

  def __post_init__(self):
    if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                        or self.chunk_size < 1):
      raise ValueError(f"chunk_size must be a positive int or None (from the memory budget); got {self.chunk_size!r}.")
    _check_flag(self.unroll, "unroll")
    _check_flag(self.canonical_convs, "canonical_convs")
    _check_budget(self.memory_budget)

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    c = _num_clients(per_client)
    k = self.chunk_size or default_chunk_size(fn, shared, per_client, self.memory_budget)
    if k >= c:
      return VMap(self.unroll, self.canonical_convs)(fn, shared, per_client)
    fn = rewrite_client_fn(fn, unroll=self.unroll, canonical_convs=self.canonical_convs)
    if self.unroll:
      return _unrolled_chunks(fn, shared, per_client, c, k)
    batch_size = None if k == 1 else k
    return jax.lax.map(lambda pc: fn(shared, pc), per_client, batch_size=batch_size)


def _unrolled_chunks(fn: Callable, shared: PyTree, per_client: PyTree, c: int, k: int) -> PyTree:
  """`vmap(fn)` over consecutive slices of k clients, traced one after another (no loop), concatenated."""
  outs = []
  for start in range(0, c, k):
    chunk = jax.tree.map(lambda a, s=start: a[s:s + k], per_client)
    outs.append(jax.vmap(fn, in_axes=(None, 0))(shared, chunk))
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)


def _num_params(shared: PyTree) -> int:
  return sum(int(np.prod(jnp.shape(x))) for x in jax.tree.leaves(shared))


@dataclasses.dataclass(frozen=True)
class Auto:
  """The default: the fastest mode measured for the backend, the model and C (module docstring).

  Decided when the step is traced, from the backend, the jaxpr of the
  per-client function (does it convolve? how many parameters does `shared`
  hold?) and C × `client_footprint` against `memory_budget`:

  * GPU/TPU: `vmap`, or `chunked(k)` when C clients exceed the budget;
  * CPU, convolutions: `sequential(canonical_convs=True)`;
  * CPU, at most `CPU_VMAP_MAX_PARAMS` parameters: `vmap` (or `chunked(k)`);
  * CPU, larger dense models: `sequential()`.
  """

  memory_budget: int | None = None

  def __post_init__(self):
    _check_budget(self.memory_budget)

  def resolve(self, fn: Callable | None = None, shared: PyTree = None, per_client: PyTree = None) -> "ClientMap":
    """The concrete mode for this call; without arguments, the default for the backend alone."""
    accelerator = jax.default_backend() in _ACCELERATORS
    if fn is None:
      return VMap() if accelerator else Chunked(1)
    c = _num_clients(per_client)
    jaxpr = trace_client(fn, shared, per_client)
    if not accelerator and has_convolution(jaxpr):
      return Chunked(1, canonical_convs=True)
    if not accelerator and _num_params(shared) > CPU_VMAP_MAX_PARAMS:
      return Chunked(1)
    k = default_chunk_size(fn, shared, per_client, self.memory_budget, jaxpr)
    return VMap() if k >= c else Chunked(k)

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    return self.resolve(fn, shared, per_client)(fn, shared, per_client)


def client_mesh(devices: Any = None, axis_name: str = CLIENTS_AXIS) -> Mesh:
  """A one-axis `Mesh` named `axis_name` over `devices` (default: every device of every process)."""
  devices = np.asarray(jax.devices() if devices is None else devices, dtype=object).reshape(-1)
  return Mesh(devices, (axis_name,), axis_types=(AxisType.Auto,))


def pad_clients(per_client: PyTree, multiple: int) -> tuple[PyTree, int]:
  """Appends all-zero clients (False masks, zero data) so that C is a multiple of `multiple`.

  Returns:
    (padded pytree with leading axis ⌈C / multiple⌉ · multiple, the original C).
  """
  c = _num_clients(per_client)
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
    object.__setattr__(self, "inner", inner)

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    mesh = self.mesh if self.mesh is not None else client_mesh(axis_name=self.axis_name)
    padded, c = pad_clients(per_client, mesh.shape[self.axis_name])
    inner = self.inner
    mapped = jax.shard_map(lambda s, pc: inner(fn, s, pc), mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(
        self.axis_name)), out_specs=PartitionSpec(self.axis_name), check_vma=False)
    out = mapped(shared, padded)
    if _num_clients(padded) == c:
      return out
    return jax.tree.map(lambda a: a[:c], out)


ClientMap = VMap | Chunked | Auto | Sharded


def vmap(*, unroll: bool = False, canonical_convs: bool = False) -> VMap:
  """All clients at once with `jax.vmap`."""
  return VMap(unroll, canonical_convs)


def sequential(*, unroll: bool = False, canonical_convs: bool = False) -> Chunked:
  """One client at a time, as a compiled loop (`lax.map`) inside the jitted round."""
  return Chunked(1, unroll, canonical_convs)


def chunked(chunk_size: int | None = None, *, unroll: bool = False, canonical_convs: bool = False,
            memory_budget: int | None = None) -> Chunked:
  """`chunk_size` clients at a time (vmapped), chunks in a compiled loop; None: from the memory budget."""
  return Chunked(chunk_size, unroll, canonical_convs, memory_budget)


def auto(memory_budget: int | None = None) -> Auto:
  """The fastest measured mode for the backend, model and C; never more than `memory_budget` at once."""
  return Auto(memory_budget)


def sharded(mesh: Mesh | None = None, inner: Any = "auto", axis_name: str = CLIENTS_AXIS) -> Sharded:
  """Clients split across the devices of `mesh` with `jax.shard_map`, `inner` mode on each device."""
  return Sharded(mesh, inner, axis_name)


_MODE_NAMES = ("'auto', 'vmap', 'sequential', 'chunked', 'chunked:K' (each of the last four optionally followed by "
               "':unroll' and/or ':canonical_convs'), 'sharded', 'sharded:<inner mode>'")
_FLAGS = ("unroll", "canonical_convs")


def _parse(mode: str) -> ClientMap | None:
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
  """Turns a mode object, a name (see `_MODE_NAMES`) or None (auto) into a mode."""
  if mode is None:
    return Auto()
  if isinstance(mode, (VMap, Chunked, Auto, Sharded)):
    return mode
  parsed = _parse(mode) if isinstance(mode, str) else None
  if parsed is None:
    raise ValueError(f"client_map must be one of {_MODE_NAMES} or a mode from fedjax_opt.core.client_map; "
                     f"got {mode!r}.")
  return parsed


def map_clients(mode: ClientMap | str | None, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
  """Computes `fn(shared, per_client[c])` for every client c, stacked on a leading [C] axis."""
  return resolve(mode)(fn, shared, per_client)
