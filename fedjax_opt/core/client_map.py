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
  model and C (below), never more than the memory budget at once (on CPU,
  for small dense models, nor more than `CPU_VMAP_MAX_BYTES`); with several
  devices, `sharded` over all of them where that was measured faster (`Auto`).

Three rewrites, flags of `vmap`, `sequential` and `chunked` (and string
suffixes ":canonical_convs", ":unroll", ":fuse_small_dots"), all made on a
jaxpr (`rewrite_client_fn`): the first two on the per-client function's, the
third on the mapped function's (vmap is what makes the dots it rewrites):

* `canonical_convs=True` runs every convolution in the layout of XLA:CPU's
  fast convolution kernel ([N, *spatial, C] × [*kernel, I, O]), with explicit
  transposes around it (`canonical_conv`; results are bit-identical).
* `unroll=True` fully unrolls every `lax.scan` in it (a chunked map then
  also unrolls its loop over chunks).
* `fuse_small_dots=True` runs every dot_general with batch dimensions that
  contracts at most `FUSED_DOT_MAX_CONTRACTION` (16) entries per output entry
  as an unrolled sum of broadcast products (`sum_of_products`), which XLA
  fuses into one elementwise loop. Same values up to the float rounding of
  the sum.

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
* Small contractions. Vmapped, a client's weight gradient xᵀg (contracted
  over its B examples) is a batched dot whose contracted axis is not the
  minor one of x. XLA:CPU hands canonical batched matmuls (the forward x·W)
  to its YNNPACK fusions, but runs this one as a generic batched dot
  (explicit transposes do not help: XLA folds them back into the dot). For
  W-LR (60 features, 10 classes, S=20, B=10, C=100) that dot took ~370 µs a
  step against ~155 µs as a fused sum of B=10 products. On its own the
  rewritten dot won 1.3–5.7× for contractions of 10–20 entries with up to
  200×200 outputs per client, but lost at 50 (0.5–0.8×) and by ~7% at 20
  examples with a 784×200 output; hence the bound of 16. A whole FedAvg
  round (`python benchmarks/throughput.py --workloads W-LR --repeats 30`,
  medians of interleaved rounds): C=100, `vmap` 11.6 ms, with
  `fuse_small_dots` 7.7 ms (1.5×), central floor 3.6 ms, one jitted call per
  client 19.6 ms; quick interleaved runs on the shared machine gave
  1.3–1.6×. Rewriting the forward x·W too (contracted over 60 features, as
  one broadcast-multiply-reduce) did not help, nor did unrolling the local
  steps on top. So on CPU `auto` sets `fuse_small_dots` when it vmaps (a
  small dense model, k > 1 clients at once) and the vmapped function holds
  such a dot (`has_small_batched_dot`).
* Clients at once on CPU. Vmapping more clients than the cache holds is
  slower than a loop over cache-sized chunks: for W-LR at C=1000
  (81 kB per client by `client_footprint`), with `fuse_small_dots`, one
  vmap of 1000 clients took 161–201 ms a round, chunks of 500 or 334
  clients 166–191 ms, chunks of 250, 200 or 125 clients 116–124 ms
  (1.3–1.6×), against 51–64 ms central (interleaved runs; this machine has
  a 32 MiB last-level cache). So on CPU `auto` also caps the clients at once
  at `CPU_VMAP_MAX_BYTES` (16 MiB) of footprint: k = 200 at C=1000, no
  chunks at C=100. In the benchmark run above, C=1000: `vmap` 174 ms,
  `vmap:fuse_small_dots` 137 ms, `auto` (`chunked(200, fuse_small_dots=True)`)
  84 ms, central 37 ms.
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
from typing import Any, Callable, Iterator, NamedTuple

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

CPU_VMAP_MAX_BYTES = 16 << 20
"""On CPU, `auto` vmaps at most this many bytes of clients (C × `client_footprint`) at once, chunks beyond."""

FUSED_DOT_MAX_CONTRACTION = 16
"""`fuse_small_dots` rewrites batched dot_generals that contract at most this many entries (per output entry)."""

_ACCELERATORS = ("gpu", "tpu")
_CONVOLUTION = "conv_general_dilated"
_DOT = "dot_general"


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


def trace_mapped(fn: Callable, shared: PyTree, per_client: PyTree, k: int) -> jex_core.ClosedJaxpr:
  """The jaxpr of `fn` vmapped over k clients (abstract: nothing is computed)."""
  chunk = jax.tree.map(lambda s: jax.ShapeDtypeStruct((k,) + s.shape, s.dtype), _abstract(per_client, True))
  return jax.make_jaxpr(jax.vmap(fn, in_axes=(None, 0)))(_abstract(shared), chunk)


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


def sum_of_products(lhs: jax.Array, rhs: jax.Array, *, dimension_numbers, preferred_element_type=None,
                    **unused) -> jax.Array:
  """`lax.dot_general` as an unrolled sum of broadcast products, one per contracted index.

  With n the number of contracted index tuples (the product of the
  contracted dimensions),

      out[b, i, j] = Σ_{t=1..n} lhs[b, i, t] · rhs[b, j, t]

  (b: batch dimensions, i / j: the free dimensions of lhs / rhs, in
  dot_general's output order), summed in the order t = 1, 2, ..., n: the
  same values as the dot up to float rounding of the sum. XLA fuses the n
  products and sums into one elementwise loop over the output. Same
  arguments as the jaxpr parameters of the dot (`precision` is ignored:
  products and sums are taken in the output dtype). Meant for a small n
  (`FUSED_DOT_MAX_CONTRACTION`): the expression grows with n.
  """
  del unused
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  lhs_free = [d for d in range(lhs.ndim) if d not in lhs_contract and d not in lhs_batch]
  rhs_free = [d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch]
  dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else preferred_element_type
  n = math.prod(lhs.shape[d] for d in lhs_contract)
  nb, nl, nr = len(lhs_batch), len(lhs_free), len(rhs_free)
  # [batch, lhs free, 1 (× rhs free), n] and [batch, 1 (× lhs free), rhs free, n]: they broadcast to the output.
  x = jnp.transpose(lhs, (*lhs_batch, *lhs_free, *lhs_contract)).astype(dtype)
  x = x.reshape(x.shape[:nb + nl] + (1,) * nr + (n,))
  y = jnp.transpose(rhs, (*rhs_batch, *rhs_free, *rhs_contract)).astype(dtype)
  y = y.reshape(y.shape[:nb] + (1,) * nl + y.shape[nb:nb + nr] + (n,))
  out = x[..., 0] * y[..., 0]
  for t in range(1, n):
    out = out + x[..., t] * y[..., t]
  return out


def _is_small_batched_dot(eqn: jex_core.JaxprEqn) -> bool:
  """A dot_general with batch dimensions, floating operands, ≤ `FUSED_DOT_MAX_CONTRACTION` contracted entries."""
  if eqn.primitive.name != _DOT:
    return False
  (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
  lhs, rhs = (v.aval for v in eqn.invars)
  floating = all(jnp.issubdtype(a.dtype, jnp.floating) for a in (lhs, rhs, eqn.outvars[0].aval))
  n = math.prod(lhs.shape[d] for d in lhs_contract)
  return bool(lhs_batch) and floating and 1 <= n <= FUSED_DOT_MAX_CONTRACTION


def has_small_batched_dot(jaxpr: jex_core.ClosedJaxpr | jex_core.Jaxpr) -> bool:
  """True when the computation (or anything nested in it) holds a dot that `fuse_small_dots` rewrites."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr
  return any(_is_small_batched_dot(eqn) for eqn in _equations(jaxpr))


def _call(eqn: jex_core.JaxprEqn, fn: Callable) -> jex_core.JaxprEqn:
  """`eqn` (two operands) replaced by a call of `fn(lhs, rhs, **eqn.params)` on the same variables."""
  structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
  closed = jax.make_jaxpr(lambda lhs, rhs: fn(lhs, rhs, **eqn.params))(*structs)
  return jex_core.new_jaxpr_eqn(eqn.invars, eqn.outvars, jex_primitives.closed_call_p, {"call_jaxpr": closed},
                                closed.effects, eqn.source_info)


class _Rewrites(NamedTuple):
  unroll: bool = False
  canonical_convs: bool = False
  fuse_small_dots: bool = False


def _rewrite_value(value: Any, rewrites: _Rewrites) -> Any:
  if isinstance(value, jex_core.ClosedJaxpr):
    return value.replace(jaxpr=_rewrite_jaxpr(value.jaxpr, rewrites))
  if isinstance(value, jex_core.Jaxpr):
    return _rewrite_jaxpr(value, rewrites)
  if isinstance(value, tuple) and any(isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr)) for v in value):
    items = [_rewrite_value(v, rewrites) for v in value]
    # Keep named tuples (e.g. custom_linear_solve's jaxprs, read by field name) as their own type.
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
  return value


def _rewrite_jaxpr(jaxpr: jex_core.Jaxpr, rewrites: _Rewrites) -> jex_core.Jaxpr:
  """`jaxpr` (nested jaxprs included) with scans unrolled, convolutions canonical, small batched dots fused."""
  eqns = []
  for eqn in jaxpr.eqns:
    if rewrites.canonical_convs and eqn.primitive.name == _CONVOLUTION and not _is_canonical(eqn.params):
      eqns.append(_call(eqn, canonical_conv))
      continue
    if rewrites.fuse_small_dots and _is_small_batched_dot(eqn):
      eqns.append(_call(eqn, sum_of_products))
      continue
    params = {k: _rewrite_value(v, rewrites) for k, v in eqn.params.items()}
    if rewrites.unroll and eqn.primitive.name == "scan":
      # 0 = no loop at all. (unroll=length leaves a while loop of one trip when length is 1, and XLA:CPU
      # still runs its body as a loop body: a one-step scan of a convolution ran 12× slower.)
      params["unroll"] = 0
    eqns.append(eqn.replace(params=params))
  return jaxpr.replace(eqns=eqns)


def rewrite_client_fn(fn: Callable, *, unroll: bool = False, canonical_convs: bool = False,
                      fuse_small_dots: bool = False) -> Callable:
  """`fn(shared, client)` with scans unrolled, convolutions canonical and/or small batched dots fused.

  The function is traced to a jaxpr, rewritten, and the jaxpr is evaluated in
  place of `fn`: same values (to float rounding), differentiable, usable under
  jit/vmap. `unroll` sets each scan's `unroll` parameter to 0 (the scan
  primitive's "no loop at all"); `canonical_convs` replaces each convolution
  not already in the canonical layout by `canonical_conv`; `fuse_small_dots`
  replaces each dot_general with batch dimensions that contracts at most
  `FUSED_DOT_MAX_CONTRACTION` entries by `sum_of_products` (a per-client
  function has such dots only once it is vmapped: the modes apply this one
  to the mapped function). All are for XLA:CPU (module docstring).
  """
  rewrites = _Rewrites(unroll, canonical_convs, fuse_small_dots)
  if not any(rewrites):
    return fn

  def rewritten(shared, client):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(shared, client)
    closed = closed.replace(jaxpr=_rewrite_jaxpr(closed.jaxpr, rewrites))
    out = jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves((shared, client)))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return rewritten


# ---- the modes -----------------------------------------------------------------------------------------------


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
    if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                        or self.chunk_size < 1):
      raise ValueError(f"chunk_size must be a positive int or None (from the memory budget); got {self.chunk_size!r}.")
    _check_flag(self.unroll, "unroll")
    _check_flag(self.canonical_convs, "canonical_convs")
    _check_budget(self.memory_budget)
    _check_flag(self.fuse_small_dots, "fuse_small_dots")

  __repr__ = _repr

  def __call__(self, fn: Callable, shared: PyTree, per_client: PyTree) -> PyTree:
    c = _num_clients(per_client)
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
  * CPU, at most `CPU_VMAP_MAX_PARAMS` parameters: `vmap`, or `chunked(k)`
    when C clients exceed the budget or `CPU_VMAP_MAX_BYTES`, with
    `fuse_small_dots=True` when the vmapped function holds a batched dot it
    rewrites (`has_small_batched_dot`);
  * CPU, larger dense models: `sequential()`.

  With more than one device (several GPUs/TPUs, or CPU cores exposed as XLA
  devices), `sharded(inner=auto(shard=False))` over all of them when the
  backend is an accelerator or, on CPU, for dense models above
  `CPU_VMAP_MAX_PARAMS` parameters (on two cores exposed as 8 devices, the 2NN
  MLP's round ran 1.2× (C=8) and 2.7× (C=32) faster sharded than on one
  device, logistic regression's 1.6× slower at C=100, so small dense models
  stay on one device; convolutions were not measured sharded on CPU).

  Attributes:
    memory_budget: bytes a map may use at once (default `default_memory_budget()`).
    shard: allow the multi-device choice above (False inside `sharded`).
  """

  memory_budget: int | None = None
  shard: bool = True

  def __post_init__(self):
    _check_budget(self.memory_budget)
    _check_flag(self.shard, "shard")

  def resolve(self, fn: Callable | None = None, shared: PyTree = None, per_client: PyTree = None) -> "ClientMap":
    """The concrete mode for this call; without arguments, the default for the backend alone."""
    accelerator = jax.default_backend() in _ACCELERATORS
    if fn is None:
      return VMap() if accelerator else Chunked(1)
    c = _num_clients(per_client)
    jaxpr = trace_client(fn, shared, per_client)
    convolves = has_convolution(jaxpr)
    big_dense = not convolves and _num_params(shared) > CPU_VMAP_MAX_PARAMS
    if self.shard and jax.device_count() > 1 and c > 1 and (accelerator or big_dense):
      return Sharded(inner=Auto(self.memory_budget, shard=False))
    if not accelerator and convolves:
      return Chunked(1, canonical_convs=True)
    if not accelerator and _num_params(shared) > CPU_VMAP_MAX_PARAMS:
      return Chunked(1)
    budget = self.memory_budget
    if not accelerator:  # clients at once: also within the cache (module docstring)
      budget = min(default_memory_budget() if budget is None else budget, CPU_VMAP_MAX_BYTES)
    k = default_chunk_size(fn, shared, per_client, budget, jaxpr)
    fuse = not accelerator and k > 1 and has_small_batched_dot(trace_mapped(fn, shared, per_client, k))
    return VMap(fuse_small_dots=fuse) if k >= c else Chunked(k, fuse_small_dots=fuse)

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
    if isinstance(inner, Auto) and inner.shard:  # inside a device: decide among the single-device modes
      inner = Auto(inner.memory_budget, shard=False)
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


def auto(memory_budget: int | None = None, *, shard: bool = True) -> Auto:
  """The fastest measured mode for the backend, model and C; never more than `memory_budget` at once."""
  return Auto(memory_budget, shard)


def sharded(mesh: Mesh | None = None, inner: Any = "auto", axis_name: str = CLIENTS_AXIS) -> Sharded:
  """Clients split across the devices of `mesh` with `jax.shard_map`, `inner` mode on each device."""
  return Sharded(mesh, inner, axis_name)


_MODE_NAMES = ("'auto', 'vmap', 'sequential', 'chunked', 'chunked:K' (each of the last four optionally followed by "
               "':unroll', ':canonical_convs' and/or ':fuse_small_dots'), 'sharded', 'sharded:<inner mode>'")
_FLAGS = ("unroll", "canonical_convs", "fuse_small_dots")


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
