"""Rewrites of a per-client function's jaxpr that change its speed on XLA:CPU, not its values.

Three rewrites, flags of the modes `vmap`, `sequential` and `chunked` (and
mode-name suffixes ":canonical_convs", ":unroll", ":fuse_small_dots"), made by
`rewrite_client_fn`: the first two on the per-client function, the third on
the mapped one (vmap is what makes the dots it rewrites):

* `canonical_convs` runs every convolution in the layout of XLA:CPU's fast
  convolution kernel ([N, *spatial, C] × [*kernel, I, O]), with explicit
  transposes around it (`canonical_conv`; bit-identical results).
* `unroll` fully unrolls every `lax.scan` (a chunked map then also unrolls its
  loop over chunks).
* `fuse_small_dots` runs every dot_general with batch dimensions that
  contracts at most `FUSED_DOT_MAX_CONTRACTION` entries per output entry as an
  unrolled sum of broadcast products (`sum_of_products`), which XLA fuses into
  one elementwise loop (same values up to the float rounding of the sum).

Why each helps, and when `auto` sets it: docs/scaling.md.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives

from fedjax_opt.core.client_map.tracing import equations

__all__ = ["FUSED_DOT_MAX_CONTRACTION", "canonical_conv", "has_convolution", "has_small_batched_dot",
           "is_canonical_conv", "rewrite_client_fn", "sum_of_products"]

FUSED_DOT_MAX_CONTRACTION = 16
"""`fuse_small_dots` rewrites batched dot_generals that contract at most this many entries (per output entry)."""

_CONVOLUTION = "conv_general_dilated"
_DOT = "dot_general"


# ---- convolutions in the canonical layout --------------------------------------------------------------------


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


def is_canonical_conv(params: dict) -> bool:
  """True when a convolution's jaxpr parameters already put its operands in `canonical_conv`'s layout."""
  lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
  nsp = len(params["window_strides"])
  spatial = tuple(range(1, nsp + 1))
  return (tuple(lhs_spec) == (0, nsp + 1, *spatial) and tuple(rhs_spec) == (nsp + 1, nsp, *range(nsp))
          and tuple(out_spec) == (0, nsp + 1, *spatial))


def has_convolution(jaxpr: jex_core.ClosedJaxpr | jex_core.Jaxpr) -> bool:
  """True when the computation (or anything nested in it) holds a convolution."""
  return any(eqn.primitive.name == _CONVOLUTION for eqn in equations(jaxpr))


# ---- small batched dots as fused sums of products ------------------------------------------------------------


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
  return any(_is_small_batched_dot(eqn) for eqn in equations(jaxpr))


# ---- the rewrite ---------------------------------------------------------------------------------------------


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
    if rewrites.canonical_convs and eqn.primitive.name == _CONVOLUTION and not is_canonical_conv(eqn.params):
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
  to the mapped function). All are for XLA:CPU (docs/scaling.md).
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
