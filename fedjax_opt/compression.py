"""Compression of client-to-server updates, each with its exact bit cost, and error feedback.

A `Compressor` acts on one client's update Δ (a pytree, compressed as one
vector x ∈ R^P: the leaves flattened and concatenated, so a norm or a top-k
is over the whole update, not per leaf) and returns the decoded update x̂
(what the server reconstructs, in the update's shapes and dtypes) and the
number of bits the client sends:

    compress(key, x) -> (x̂, bits)                               (jittable, vmappable)

| compressor              | x̂                                            | E[x̂]  | bits charged            |
|-------------------------|-----------------------------------------------|-------|-------------------------|
| `identity()`            | x                                             | x     | Σ_leaves size · itemsize · 8 (32P in float32) |
| `qsgd(levels=s)`        | ‖x‖₂ · sign(x_i) · ξ_i(x, s) / s              | x     | 32 + P (1 + ⌈log₂(s+1)⌉) |
| `qsgd(bits=b)`          | the same with s = 2^(b−1) − 1                 | x     | 32 + P b                |
| `range_quantize(b)`     | −R + l·2R/(2^b − 1), l rounded at random, R = ‖x‖_∞ | x | 32 + P b          |
| `top_k(k or fraction)`  | x_i on the k largest |x_i|, 0 elsewhere      | biased| k (32 + ⌈log₂ P⌉)       |
| `rand_k(k or fraction)` | (P/k) x_i on k random coordinates, 0 elsewhere| x     | 32 k + 32               |
| `sign()`                | (‖x‖₁ / P) · sgn(x)                           | biased| P + 32                  |
| `sign(scaled=False)`    | sgn(x)                                        | biased| P                       |

* QSGD (Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient
  SGD via Gradient Quantization and Encoding", NeurIPS 2017, arXiv:1610.02132):
  with r_i = |x_i| / ‖x‖₂ ∈ [0, 1] and l = ⌊r_i s⌋, ξ_i = l + 1 with probability
  r_i s − l and l otherwise, so E[ξ_i] = r_i s and E[x̂] = x; Lemma 3.1 bounds
  E‖x̂ − x‖² ≤ min(P/s², √P/s) ‖x‖². The charge is a fixed-length code: the
  norm as a float32, then per coordinate one sign bit and ⌈log₂(s+1)⌉ bits for
  ξ_i ∈ {0, …, s}. The paper's Elias coding of the ξ_i (its Section 3.2) is
  shorter (for s = √P, at most 2.8 P + 32 bits in expectation, against
  32 + P (1 + ⌈log₂(√P + 1)⌉) here); it is not implemented, so the numbers
  here are an upper bound on what QSGD needs. `bits=b` counts b bits per coordinate *including* the sign.
* range_quantize is CQ-GGADMM's quantizer (Issaid, Elgabli, Park, Bennis,
  Debbah, "Communication Efficient Decentralized Learning over Bipartite
  Graphs", 2020): 2^b levels evenly spaced over [−R, R], R = ‖x‖_∞, each
  coordinate rounded to one of its two nearest levels at random so that
  E[x̂] = x; b bits per coordinate (no separate sign) and R as a float32.
* top-k keeps the k entries of largest magnitude (Stich, Cordonnier, Jaggi,
  "Sparsified SGD with Memory", NeurIPS 2018): each is sent as a float32 value
  and a ⌈log₂ P⌉-bit index. Biased: use it with error feedback. Ties are
  broken towards the lower index (`jax.lax.top_k`).
* rand-k keeps k coordinates drawn uniformly without replacement and scales
  them by P/k (unbiased). The indices come from a seed the server shares (the
  client's compression key), so only the k float32 values and a 32-bit seed
  are sent.
* sign is the scaled sign of Karimireddy, Rebjock, Stich, Jaggi, "Error
  Feedback Fixes SignSGD and other Gradient Compression Schemes" (ICML 2019,
  arXiv:1901.09847): one bit per coordinate and the float32 scale ‖x‖₁/P.
  `scaled=False` is signSGD's plain sign (Bernstein, Wang, Azizzadenesheli,
  Anandkumar, ICML 2018, arXiv:1802.04434), for `aggregators.majority_vote`.
  A 1-bit code has no zero: sgn(x) = +1 for x ≥ 0 and −1 for x < 0.

k, s and P are static (Python ints fixed by the update's shapes), so every bit
count is known at trace time; `Compressor.bits(update)` gives it exactly as a
Python int, and `compress` returns it as a float32 scalar (exact below 2²⁴;
a relative error ≤ 6·10⁻⁸ beyond). Arithmetic is in float32 (or the widest
leaf dtype if wider) and x̂ is cast back to each leaf's dtype.

Error feedback (`compress(compressor, error_feedback=True, num_clients=N)`;
Seide et al. 2014, Stich et al. 2018, Karimireddy et al. 2019). Client i keeps
a residual e_i (a per-client table `[N, ...]` in the aggregator's state,
zeros at the start) and in each round it takes part:

    v_i = Δ_i + e_i;    sent_i = C(v_i);    e_i ← v_i − sent_i

so Σ_t sent_{i,t} + e_{i,T} = Σ_t Δ_{i,t}: what was not sent is only delayed.
Without error feedback a client sends C(Δ_i) and keeps nothing.

The stage of a round. `compress(...)` is a `core.types.ClientStage`, the
client side of the aggregator seam: `fo.aggregators.chain(compress(...),
aggregator)` gives any factory's `aggregator=` a compressing client stage, in
front of the mean, a robust rule, `fo.privacy.dp_mean` or
`fo.privacy.secure_aggregation`. `compress` lives here, beside the
compressors it wraps, because it is what turns a compressor into a stage;
`chain` lives in `fedjax_opt.aggregators`, because composing stages with an
aggregator is the aggregator seam's business, whatever the stage. The round
(`core.rounds.client_round`) runs the stage on every message a client sends
and draws client i's key for its j-th kind of message as
fold_in(fold_in(round key, stream_j), i), so a run is reproducible from its
seed and the server can regenerate rand-k's indices; the residual row is
written under the round's rules for per-client rows (docs/architecture.md,
"The round"), like every other. `residuals(state.aggregator_state)` reads
the table.

Downlink (`downlink(compressor, error_feedback=True)`, the seam's last
piece: `fo.aggregators.chain(..., aggregator, downlink(...))`, or FedAvg's,
FedSGD's and FedProx's `downlink=`): the same compressors on what the server
sends back. The server
broadcasts m_t = C(u_t + e_t), u_t its optimizer's step, keeps e_{t+1} =
u_t + e_t − m_t, and every client's model moves by m_t (DoubleSqueeze's server
side; the recursion and its state are `core.averaging`'s module docstring,
"Downlink"). The error feedback is this module's `send` with the server's
error as the residual; `bits_down` is the compressor's count of m_t.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import per_client
from fedjax_opt.core.types import Downlink
from fedjax_opt.core.tree import tree_bits
from fedjax_opt.core.types import ClientStage, StagedState
from fedjax_opt.core.validation import check_int, check_num_clients, check_probability

PyTree = Any

__all__ = ["Compressor", "Downlink", "as_downlink", "compress", "downlink", "identity", "num_entries", "qsgd",
           "rand_k", "range_quantize", "residuals", "send", "sign", "top_k", "tree_bits"]

FLOAT_BITS = 32
"""Bits of one float32 scalar (a norm, a scale, a value, a seed)."""


class Compressor(NamedTuple):
  """A client-to-server compressor (module docstring).

  Attributes:
    name: a short label ("qsgd(s=7)", "top_k(k=79)", ...).
    compress: `compress(key, update) -> (decoded update, bits)` for one client:
      `update` a pytree (an array is one) compressed as one vector; the decoded
      update has its shapes and dtypes; `bits` a float32 scalar.
    unbiased: whether E[compress(key, x)[0]] = x over the key.
    bits: `bits(update) -> int`, the exact bit count for an update shaped like
      `update` (arrays or `jax.ShapeDtypeStruct`s).
  """

  name: str
  compress: Callable[[jax.Array, PyTree], tuple[PyTree, jax.Array]]
  unbiased: bool
  bits: Callable[[PyTree], int]


# ----------------------------------------------------------------------------- one vector from a pytree


def num_entries(update: PyTree) -> int:
  """P, the number of entries over every leaf of `update` (static)."""
  return int(sum(int(np.prod(np.shape(leaf), dtype=np.int64)) for leaf in jax.tree.leaves(update)))


def _flat(update: PyTree) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
  """(x [P] in at least float32, unflatten) for a pytree compressed as one vector."""
  leaves, treedef = jax.tree.flatten(update)
  if not leaves:
    raise ValueError("compress: the update has no arrays to compress.")
  dtype = jnp.result_type(jnp.float32, *[jnp.result_type(leaf) for leaf in leaves])
  shapes = [jnp.shape(leaf) for leaf in leaves]
  dtypes = [jnp.result_type(leaf) for leaf in leaves]
  sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
  x = jnp.concatenate([jnp.reshape(leaf, (-1,)).astype(dtype) for leaf in leaves])

  def unflatten(v: jax.Array) -> PyTree:
    out, start = [], 0
    for shape, dt, size in zip(shapes, dtypes, sizes):
      out.append(v[start:start + size].reshape(shape).astype(dt))
      start += size
    return jax.tree.unflatten(treedef, out)

  return x, unflatten


def _vector_compressor(name: str, rule: Callable[[jax.Array, jax.Array], jax.Array], unbiased: bool,
                       bits: Callable[[int], int]) -> Compressor:
  """A `Compressor` from `rule(key, x [P]) -> x̂ [P]` and the bit count `bits(P)`."""

  def compress(key: jax.Array, update: PyTree) -> tuple[PyTree, jax.Array]:
    x, unflatten = _flat(update)
    return unflatten(rule(key, x)), jnp.asarray(bits(x.shape[0]), jnp.float32)

  return Compressor(name, compress, unbiased, lambda update: bits(num_entries(update)))


def _one_bit_sign(x: jax.Array) -> jax.Array:
  """sgn(x) ∈ {−1, +1}: +1 for x ≥ 0 (a 1-bit code has no zero)."""
  return jnp.where(x >= 0, jnp.ones_like(x), -jnp.ones_like(x))


def _index_bits(p: int) -> int:
  """⌈log₂ P⌉: the bits of one index into P coordinates (0 for P = 1)."""
  return max(p - 1, 0).bit_length()


def _count(k: int | None, fraction: float | None, p: int, who: str) -> int:
  """k itself (at most P), or ⌈fraction · P⌉ (at least 1)."""
  if k is not None:
    if k > p:
      raise ValueError(f"{who}: k={k} is larger than the update's P={p} entries.")
    return k
  return min(p, max(1, math.ceil(fraction * p)))


def _check_k_or_fraction(k: Any, fraction: Any, who: str) -> None:
  if (k is None) == (fraction is None):
    raise ValueError(f"{who}: give exactly one of k (an int >= 1) and fraction (in (0, 1]); got k={k!r}, "
                     f"fraction={fraction!r}.")
  if k is not None:
    check_int(k, f"{who}: k", 1)
    return
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating)):
    raise TypeError(f"{who}: fraction must be a Python float in (0, 1]; got {type(fraction).__name__}.")
  if fraction != 1:
    check_probability(fraction, f"{who}: fraction")


# ----------------------------------------------------------------------------- the compressors


def identity() -> Compressor:
  """x̂ = x, charged every bit of the update: Σ_leaves size · itemsize · 8 (32 P in float32).

  Unbiased; with error feedback the residual stays exactly 0. The round with
  `identity()` is the uncompressed round, bit for bit.
  """

  def compress(key: jax.Array, update: PyTree) -> tuple[PyTree, jax.Array]:
    del key
    return update, jnp.asarray(tree_bits(update), jnp.float32)

  return Compressor("identity", compress, True, tree_bits)


def qsgd(levels: int | None = None, *, bits: int | None = None) -> Compressor:
  """QSGD's unbiased stochastic quantization to s levels (Alistarh et al., NeurIPS 2017, arXiv:1610.02132).

      x̂_i = ‖x‖₂ · sgn(x_i) · ξ_i / s,   ξ_i = ⌊r_i s⌋ + Bernoulli(r_i s − ⌊r_i s⌋),   r_i = |x_i| / ‖x‖₂

  E[x̂] = x and E‖x̂ − x‖² ≤ min(P/s², √P/s) ‖x‖² (their Lemma 3.1); x = 0
  gives x̂ = 0. Bits: 32 + P (1 + ⌈log₂(s+1)⌉) (a fixed-length code; Elias
  coding would need fewer, see the module docstring).

  Args:
    levels: s >= 1, the number of quantization levels of |x_i| / ‖x‖₂.
    bits: b >= 2 instead of `levels`: the bits per coordinate including the
      sign, s = 2^(b−1) − 1, so the charge is exactly 32 + P b.

  Returns:
    A `Compressor` (unbiased).
  """
  if (levels is None) == (bits is None):
    raise ValueError(f"qsgd: give exactly one of levels (s >= 1) and bits (b >= 2); got levels={levels!r}, "
                     f"bits={bits!r}.")
  if bits is not None:
    b = check_int(bits, "qsgd: bits", 2)
    if b > 24:
      raise ValueError(f"qsgd: bits must be <= 24 (float32 holds the levels exactly); got {b}.")
    s = 2 ** (b - 1) - 1
  else:
    s = check_int(levels, "qsgd: levels", 1)
    if s > 2 ** 23:
      raise ValueError(f"qsgd: levels must be <= 2**23 (float32 holds the levels exactly); got {s}.")
  per_coordinate = 1 + _index_bits(s + 1)

  def rule(key: jax.Array, x: jax.Array) -> jax.Array:
    norm = jnp.sqrt(jnp.sum(jnp.square(x))).astype(jnp.float32).astype(x.dtype)  # sent as a float32
    safe = jnp.where(norm > 0, norm, 1)
    scaled = jnp.clip(jnp.abs(x) / safe, 0, 1) * s
    low = jnp.floor(scaled)
    xi = low + (jax.random.uniform(key, x.shape, x.dtype) < scaled - low).astype(x.dtype)
    return jnp.where(norm > 0, norm * jnp.sign(x) * xi / s, jnp.zeros_like(x))

  return _vector_compressor(f"qsgd(s={s})", rule, True, lambda p: FLOAT_BITS + p * per_coordinate)


def range_quantize(bits: int) -> Compressor:
  """Unbiased stochastic b-bit quantization over the range [−R, R], R = ‖x‖_∞ (Issaid et al. 2020).

  Issaid, Elgabli, Park, Bennis, Debbah, "Communication Efficient Distributed
  Learning with Censored, Quantized, and Generalized Group ADMM",
  arXiv:2009.06459, 2020 (the quantizer of CQ-GGADMM,
  `fo.algorithms.cq_ggadmm(..., bits=b)`). With R = max_j |x_j| over every
  coordinate of every leaf, the 2^b levels are

      −R + l Δ,   l = 0 … 2^b − 1,   Δ = 2R / (2^b − 1),

  and each coordinate goes to one of its two nearest levels at random:
  with t_j = (x_j + R)/Δ ∈ [0, 2^b − 1], l_j = ⌊t_j⌋ + Bernoulli(t_j − ⌊t_j⌋)
  and x̂_j = −R + l_j Δ. So E[x̂_j] = x_j (unbiased), |x̂_j − x_j| ≤ Δ and
  E‖x̂ − x‖² ≤ P Δ²/4; x_j = ±R is sent exactly, and x = 0 gives x̂ = 0.
  Bits: b P + 32, the b-bit level index l_j of each of the P coordinates and R
  as one float32.

  Not `qsgd(bits=b)`: QSGD scales by ‖x‖₂ and spends one of the b bits on the
  sign, with levels symmetric about 0 (0 is always one); here the 2^b levels
  span [−R, R] evenly, with no separate sign and (for every b) no level at 0.

  Arithmetic is in float32 or the widest leaf dtype if wider, as for every
  compressor here; unlike the vector compressors, the coins of leaf l (in
  `jax.tree.leaves` order) come from `jax.random.split(key, L)[l]`, one
  uniform per coordinate in that dtype (the stream of CQ-GGADMM's former
  `stochastic_quantize`, so its runs are reproduced bit for bit).

  Args:
    bits: b, the bits per coordinate, a Python int in [1, 32].

  Returns:
    A `Compressor` (unbiased).
  """
  b = check_int(bits, "range_quantize: bits", 1)
  if b > 32:
    raise ValueError(f"range_quantize: bits must be <= 32; got {b}.")
  top = float(2**b - 1)  # the highest level index

  def compress(key: jax.Array, update: PyTree) -> tuple[PyTree, jax.Array]:
    leaves, treedef = jax.tree.flatten(update)
    if not leaves:
      raise ValueError("compress: the update has no arrays to compress.")
    dtype = jnp.result_type(jnp.float32, *[jnp.result_type(leaf) for leaf in leaves])
    radius = jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)).astype(dtype) for leaf in leaves]))
    spacing = 2 * radius / top
    safe = jnp.where(radius > 0, spacing, 1)
    out = []
    for leaf, k in zip(leaves, jax.random.split(key, len(leaves))):
      position = (leaf.astype(dtype) + radius) / safe
      low = jnp.floor(position)
      up = jax.random.uniform(k, jnp.shape(leaf), dtype) < position - low
      level = jnp.clip(low + up, 0, top)
      out.append(jnp.where(radius > 0, level * spacing - radius, 0).astype(jnp.result_type(leaf)))
    count = b * sum(int(np.prod(jnp.shape(leaf), dtype=np.int64)) for leaf in leaves) + FLOAT_BITS
    return jax.tree.unflatten(treedef, out), jnp.asarray(count, jnp.float32)

  return Compressor(f"range_quantize(b={b})", compress, True, lambda update: b * num_entries(update) + FLOAT_BITS)


def top_k(fraction: float | None = None, *, k: int | None = None) -> Compressor:
  """Top-k sparsification: keep the k entries of largest |x_i|, zero the rest (biased).

  k = `k`, or ⌈fraction · P⌉ (at least 1). Bits: k (32 + ⌈log₂ P⌉), a float32
  value and an index per kept entry. Ties go to the lower index. Stich,
  Cordonnier, Jaggi, "Sparsified SGD with Memory" (NeurIPS 2018): use it with
  error feedback.

  Args:
    fraction: k/P in (0, 1].
    k: the number of entries kept, an int >= 1 (<= P, checked at trace time).

  Returns:
    A `Compressor` (biased).
  """
  _check_k_or_fraction(k, fraction, "top_k")

  def rule(key: jax.Array, x: jax.Array) -> jax.Array:
    del key
    kk = _count(k, fraction, x.shape[0], "top_k")
    _, index = jax.lax.top_k(jnp.abs(x), kk)
    return jnp.zeros_like(x).at[index].set(x[index])

  label = f"top_k(k={k})" if k is not None else f"top_k({fraction:g})"
  return _vector_compressor(label, rule, False,
                            lambda p: _count(k, fraction, p, "top_k") * (FLOAT_BITS + _index_bits(p)))


def rand_k(fraction: float | None = None, *, k: int | None = None) -> Compressor:
  """Random-k sparsification: k coordinates drawn uniformly without replacement, scaled by P/k (unbiased).

      x̂_i = (P/k) x_i for i ∈ I,  0 otherwise,   I ~ uniform k-subset of {1 … P}

  E[x̂] = x since P(i ∈ I) = k/P. The indices come from the client's
  compression key, which the server can regenerate: bits = 32 k + 32 (the k
  float32 values and a 32-bit seed).

  Args:
    fraction: k/P in (0, 1].
    k: the number of entries kept, an int >= 1 (<= P, checked at trace time).

  Returns:
    A `Compressor` (unbiased).
  """
  _check_k_or_fraction(k, fraction, "rand_k")

  def rule(key: jax.Array, x: jax.Array) -> jax.Array:
    p = x.shape[0]
    kk = _count(k, fraction, p, "rand_k")
    index = jax.random.choice(key, p, (kk,), replace=False)
    return jnp.zeros_like(x).at[index].set(x[index] * (p / kk))

  label = f"rand_k(k={k})" if k is not None else f"rand_k({fraction:g})"
  return _vector_compressor(label, rule, True, lambda p: FLOAT_BITS * _count(k, fraction, p, "rand_k") + FLOAT_BITS)


def sign(*, scaled: bool = True) -> Compressor:
  """Sign compression: x̂ = (‖x‖₁ / P) · sgn(x) (scaled) or sgn(x), with sgn(x_i) = +1 for x_i ≥ 0, else −1.

  The scaled form is Karimireddy et al.'s (ICML 2019, arXiv:1901.09847) for
  EF-signSGD: bits P + 32 (a bit per coordinate and the float32 scale). The
  plain form is signSGD's (Bernstein et al., ICML 2018, arXiv:1802.04434),
  bits P, for `fedjax_opt.aggregators.majority_vote`. Biased either way.

  Args:
    scaled: whether to send the scale ‖x‖₁ / P.

  Returns:
    A `Compressor` (biased).
  """
  if not isinstance(scaled, bool):
    raise TypeError(f"sign: scaled must be a bool; got {type(scaled).__name__}.")

  def rule(key: jax.Array, x: jax.Array) -> jax.Array:
    del key
    if not scaled:
      return _one_bit_sign(x)
    scale = (jnp.sum(jnp.abs(x)) / x.shape[0]).astype(jnp.float32).astype(x.dtype)
    return scale * _one_bit_sign(x)

  return _vector_compressor("sign" if scaled else "sign(unscaled)", rule, False,
                            lambda p: p + (FLOAT_BITS if scaled else 0))


# ----------------------------------------------------------------------------- the stage of a round


def compress(compressor: Compressor, *, error_feedback: bool = False, num_clients: int | None = None,
             storage_dtype: Any = None) -> ClientStage:
  """A compressor as the client stage of the aggregator seam (module docstring).

      sent_i = C(Δ_i + e_i),   e_i ← Δ_i + e_i − sent_i      (error feedback)
      sent_i = C(Δ_i)                                        (without)

  Chain it before an aggregator: `fo.aggregators.chain(compress(C, ...), fo.aggregators.mean())`.

  Args:
    compressor: a `Compressor` (`identity`, `qsgd`, `top_k`, `rand_k`, `sign`).
    error_feedback: keep each client's residual e_i and send C(Δ_i + e_i).
    num_clients: N, the rows of the residual table; required with error feedback.
    storage_dtype: dtype of the residual table (e.g. `jnp.bfloat16`); None: the model's.

  Returns:
    A `core.types.ClientStage` whose table (with error feedback) is the residuals, zeros at the start.
  """
  if not isinstance(compressor, Compressor):
    raise TypeError(f"compress: compressor must be a fedjax_opt.compression.Compressor (e.g. "
                    f"fo.compression.qsgd(bits=4)); got {type(compressor).__name__}.")
  if not isinstance(error_feedback, bool):
    raise TypeError(f"compress: error_feedback must be a bool; got {type(error_feedback).__name__}.")
  if error_feedback:
    if num_clients is None:
      raise ValueError("compress: error_feedback=True keeps a residual per client: give num_clients=N "
                       "(the number of clients in the federation).")
    num_clients = check_num_clients(num_clients, "compress: num_clients")
  elif num_clients is not None:
    num_clients = check_num_clients(num_clients, "compress: num_clients")

  def init(params: PyTree) -> PyTree:
    return per_client.init(params, num_clients, storage_dtype=storage_dtype) if error_feedback else None

  def apply(key: jax.Array, update: PyTree, row: PyTree) -> tuple[PyTree, PyTree, jax.Array]:
    return send(compressor, key, update, row if error_feedback else None)

  name = f"compress({compressor.name}{', error_feedback' if error_feedback else ''})"
  return ClientStage(init, apply, num_clients if error_feedback else None, name)


def send(compressor: Compressor, key: jax.Array, update: PyTree,
         residual: PyTree | None) -> tuple[PyTree, PyTree | None, jax.Array]:
  """One client's message: `(sent, new residual, bits)`.

  With a residual (error feedback): v = Δ + e, sent = C(v), e' = v − sent. Without
  (`residual` None): sent = C(Δ), e' None.
  """
  if residual is None:
    sent, bits = compressor.compress(key, update)
    return sent, None, bits
  v = jax.tree.map(lambda u, e: u + e.astype(u.dtype), update, residual)
  sent, bits = compressor.compress(key, v)
  return sent, jax.tree.map(jnp.subtract, v, sent), bits


def residuals(aggregator_state: Any, message: int = 0) -> PyTree | None:
  """The error-feedback residual table e `[N, ...]` in an algorithm's `aggregator_state`, or None.

  Args:
    aggregator_state: `state.aggregator_state` of an algorithm whose aggregator has a client stage.
    message: which kind of message: 0 the update, 1 a second upload (SCAFFOLD's Δc_i).

  Returns:
    The table, or None when the stage keeps none (no error feedback) or there is no client stage.
  """
  if not isinstance(aggregator_state, StagedState):
    return None
  return aggregator_state.rows[message]


# ----------------------------------------------------------------------------- server to client


def downlink(compressor: Compressor, *, error_feedback: bool = True) -> Downlink:
  """A compressor on the server's broadcast, with the server's error feedback (DoubleSqueeze's server side).

      m_t = C(u_t + e_t),   e_{t+1} = u_t + e_t − m_t,   x̂_{t+1} = x̂_t + m_t     (error feedback)
      m_t = C(u_t),                                  x̂_{t+1} = x̂_t + m_t     (without)

  u_t is the server optimizer's step at x̂_t, the model every client holds and
  trains from (`core.averaging`'s module docstring, "Downlink"); e_0 = 0. Tang,
  Yu, Lian, Zhang, Liu, "DoubleSqueeze" (ICML 2019, arXiv:1905.05957). It is
  the seam's last piece: chain it after the aggregator,
  `fo.aggregators.chain(aggregator, downlink(C))`, and give that to any factory
  that applies a downlink (`factory.downlink`: FedAvg, FedSGD, FedProx, FedNova,
  Per-FedAvg, FedAvg + fine-tuning, Ditto, pFedMe; the others refuse it in one
  line). `fedavg`, `fedsgd` and `fedprox` also take it (or the compressor alone,
  which means error feedback) as `downlink=`, the same chain. `bits_down` is
  then the compressor's count of m_t.

  Args:
    compressor: a `Compressor` (`identity`, `qsgd`, `top_k`, `rand_k`, `sign()`); `sign(scaled=False)`
      is refused: ±1 per coordinate has no scale, so it is not a model delta.
    error_feedback: keep the server's error e (the model's shapes and dtypes) and send C(u + e).

  Returns:
    A `core.types.Downlink` (also `core.averaging.Downlink`).
  """
  if not isinstance(compressor, Compressor):
    raise TypeError(f"downlink: compressor must be a fedjax_opt.compression.Compressor (e.g. "
                    f"fo.compression.top_k(0.1)); got {type(compressor).__name__}.")
  if not isinstance(error_feedback, bool):
    raise TypeError(f"downlink: error_feedback must be a bool; got {type(error_feedback).__name__}.")
  if compressor.name == "sign(unscaled)":
    raise ValueError("downlink: sign(scaled=False) broadcasts ±1 per coordinate without a scale, which is not a "
                     "model delta; use fo.compression.sign() (scaled by ‖x‖₁/P) or top_k.")

  def init(params: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, params) if error_feedback else None

  def apply(key: jax.Array, update: PyTree, error: PyTree) -> tuple[PyTree, PyTree, jax.Array]:
    return send(compressor, key, update, error if error_feedback else None)

  return Downlink(init, apply, f"downlink({compressor.name}{', error_feedback' if error_feedback else ''})")


def as_downlink(value: Any, who: str) -> Downlink | None:
  """A factory's `downlink=`: None, a `Downlink`, or a `Compressor` (`downlink(value)`, with error feedback).

  Raises TypeError, naming `who`, for anything else (a client stage or an aggregator included).
  """
  if value is None or isinstance(value, Downlink):
    return value
  if isinstance(value, Compressor):
    return downlink(value)
  raise TypeError(f"{who}: downlink must be a fedjax_opt.compression.Compressor (e.g. fo.compression.top_k(0.1)), "
                  f"fo.compression.downlink(compressor, error_feedback=...) or None; got {type(value).__name__}.")
