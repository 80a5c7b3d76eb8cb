"""Secure aggregation, simulated inside jit: the server learns only the sum of the clients' contributions.

Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal, Seth:
"Practical Secure Aggregation for Privacy-Preserving Machine Learning"
(CCS 2017, https://eprint.iacr.org/2017/281).

`secure_aggregation(inner, frac_bits=f, bound=B, threshold=t, dropout=q)`
wraps an aggregator that is a sum over clients (one with a `StreamingSum`:
`mean`, `weighted_mean`, `fo.privacy.dp_mean`). In a round of C client slots
(the members are the slots with weight > 0):

1. Key exchange. Member c draws a key-agreement secret sk_c ∈ [1, p − 2] and
   publishes pk_c = g^{sk_c} mod p (Diffie–Hellman in Z_p^*, p = 2³¹ − 1,
   g = 7, a primitive root); every pair agrees on a_{cc'} = pk_{c'}^{sk_c} =
   pk_c^{sk_{c'}}. It also draws a self-mask seed b_c ∈ F_p, and sends a
   Shamir share of sk_c and one of b_c (threshold t, over F_p, evaluated at
   x = c' + 1) to every other slot c'.
2. Dropout. Members listed by `dropout` drop now: their uploads never arrive.
3. Upload. Member c encodes its contribution — inner's `term(update, weight)`,
   a tree and a scalar, P + 1 numbers — to fixed point in the ring Z_{2³²}
   (`fixed_point_encode`), and uploads

       y_c = e_c + PRG(b_c) + Σ_{c' > c} PRG(s_{cc'}) − Σ_{c' < c} PRG(s_{cc'})   (mod 2³²)

   over the other members c', where s_{cc'} is the PRG key made from a_{cc'}
   and the pair's two indices.
4. Unmasking. The server adds the survivors' uploads; pair masks between
   survivors cancel. From the shares of the first t survivors it
   reconstructs (Lagrange interpolation at 0) b_u of every survivor and sk_d
   of every dropped member — never both for one client — and subtracts the
   survivors' self masks and, for each dropped d, the masks
   Σ_u ±PRG(s_{ud}) it left in the survivors' uploads (recomputed from
   sk_d and the public pk_u). What remains is Σ_{survivors} e_u exactly, in
   the ring; it is decoded and handed to inner's `finalize` (for `dp_mean`:
   the Gaussian noise is added to the securely summed clipped updates).

The threshold t counts members, not slots: by default t = ⌊m/2⌋ + 1 for the
round's m members, a majority of the users who take part, as Bonawitz et al.
fix t as a fraction of the n users of a round (a padded round, such as Poisson
sampling's, has m < C). A fixed t can be given instead. Fewer than t
survivors: nothing can be unmasked; the aggregate is NaN and the inner state
is unchanged, so the non-finite guard (`core.server.aggregate_updates`)
rejects the round: model, server optimizer and aggregator state stay as they
were, and `metrics["round_accepted"]` is False. With the default, that is
when ⌈m/2⌉ or more of the m members drop. A round without members has
nothing to unmask: its sum is 0, handed to `finalize` like any other (so a
`dp_mean` releases its noise, as it does alone in a round without clients).

Encoding. x ↦ ⌊x̄ 2^f⌋ + Bernoulli(frac(x̄ 2^f)) with x̄ = clip(x, −B, B): stochastic
rounding, unbiased for |x| ≤ B, error < 2^−f per client and coordinate;
coordinates outside [−B, B] are clipped (counted in the state's
`num_clipped`). The integer is stored as its two's complement in uint32, so
addition in Z_{2³²} is uint32 addition. The decoded sum is exact when the true
integer sum lies in [−2³¹, 2³¹); this is guaranteed at trace time by requiring
C·(⌈B 2^f⌉ + 1) < 2³¹ (a ValueError names f, B and C otherwise). The decoded sum
(an int32 converted to float) is within C·2^−f of the plain float sum of the
clipped terms, plus float32 rounding of the result.

DP through the ring. The rounding moves each coordinate by less than 2^−f, so
a client's decoded contribution q·2^−f can be longer than what it encoded, by
‖q·2^−f − x̄‖₂ < √P·2^−f over its P coordinates: with P = 10⁵ and f = 12 an
update clipped to norm C = 1 decodes to norm about 1.0005. `dp_mean`'s noise
is calibrated for sensitivity C, so when `inner` is a `dp_mean` (its state a
`DPMeanState`) each client's term is clipped once more, after `term`, to

    C' = max(C − √P·2^−f, 0)                      (`rounding_room`; C = C_t with adaptive clipping)

(f is the round's grid: f + k_t under adaptive clipping, "The grid follows
C_t" below) so that for every draw of the rounding, ‖q·2^−f‖₂ ≤ ‖x̄‖₂ +
‖q·2^−f − x̄‖₂ < C' + √P·2^−f = C (clipping coordinates to [−B, B] only shortens x̄). The noise
stays N(0, (σ_Δ C)²), so the accountant's σ holds as given, and the adaptive
clipping bit is `dp_mean`'s own, 1[‖Δ_k‖ ≤ C]. The cost is a clip norm
smaller by √P·2^−f: 0.5% of C = 1 at P = 10⁵ and f = 16. (The bound holds in
real arithmetic; the float32 clip itself is exact to a few ulps, as for
`dp_mean` alone.) A grid with √P·2^−f ≥ C, where nothing would be left, is
refused when the state is initialised, and so is f = 0, which cannot encode
`dp_mean`'s centred count bit ±½. Conditional randomized rounding (Kairouz,
Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for Federated
Learning with Secure Aggregation", ICML 2021: re-draw the rounding until the
rounded norm is within a bound) is not used: the rounding adds
Σ_i p_i(1 − p_i)·2^−2f (p_i the fractional parts) to the expected squared
norm of a vector at norm C, so a draw within C itself gets rare once P·2^−f is
several times C (about 3·10⁻⁷ per draw at P = 10⁵, f = 12), and that paper
accepts an inflated bound and calibrates the noise to it instead; clipping to
C' bounds every draw, without a loop, at the σ that was given.

The grid follows C_t. Adaptive clipping's C_t has no floor (the quantile rule
shrinks it geometrically while most updates fit), and on a fixed grid C' = 0
once C_t ≤ √P·2^−f: every update would be zeroed and the round accepted, so
training would stop silently (C_t ≈ 6.8·10⁻³ for P = 2·10⁵, f = 16). So each
round encodes the update coordinates with f_t = f + k_t fractional bits,
k_t = `grid_extra_bits(C_t, C_0, P, f)`, the largest k ≥ 0 with

    C_t·2^k ≤ T = max(C_0, 2√P·2^−f)              (C_0: the clip norm at `init`, kept in the state)

capped at 126 − f, and clips to C'_t = C_t − √P·2^−f_t: the coordinates are
multiplied by 2^k_t (exactly) and encoded as on round 0's grid, with the same
B and the same integers (so the ring check holds as it is), and the decoded
sum is multiplied by 2^−k_t; the scalar (±½) is encoded as before. Then
C_t·2^k_t > T/2 ≥ √P·2^−f, so C'_t > 0 in every round, and the room is
relative: the rounding takes under 2√P·2^−f / C_0 of C_t (under 1.4% at
P = 2·10⁵, f = 16 and C_0 = 1, however small C_t gets). A scaled coordinate
stays below max(C_0 − √P·2^−f, √P·2^−f) < C_0, so B ≥ C_0 still clips
nothing. While C_t > T/2 — always for a fixed clip norm; for an adaptive one
until C_t falls to T/2, which is C_0/2 unless √P·2^−f > C_0/2 — k_t = 0 and
the round is bit for bit what it was on the fixed grid. `state.frac_bits`
records each round's f_t. Should the room still be 0 (C_t = 0, NaN, or below
T·2^−(126 − f), past the cap), the round is not accepted: its aggregate is
NaN, so the non-finite guard rejects it (`metrics["round_accepted"]` False,
model and states unchanged), never a silent zero update.

What is simulated and what is not. The arithmetic is the protocol's: the ring,
the masks, their cancellation, the Shamir sharing and the reconstruction of
exactly the secrets the server may learn; the recovered sum is bit-exact. The
cryptography is not: a 31-bit Diffie–Hellman group and 31-bit seeds are
trivially breakable, the PRG is JAX's threefry keyed from them (not a
cryptographic PRG for production), there are no authenticated or encrypted
channels, signatures or consistency checks (so no protection against an
actively malicious server), and every party's randomness comes from the
round's aggregator key, which the simulation knows. It shows what the protocol
computes and costs, not that it is secure.

Trust model. The server sees only the survivors' sum (and who dropped). With
`dp_mean` the central noise is still added by the server, after the sum: the
server learns the noiseless sum of clipped updates; those who see the model
get the DP guarantee. Noise that protects against the server too would have
to be added by the clients, inside the ring (distributed DP), which this does
not do.

Cost. Each member expands C − 1 pair masks of P + 1 words: O(C²·P) PRG
output per round, inherent to the protocol (each pair's mask is expanded once
here, where both clients expand it in a deployment). Recovery adds one
expansion per (dropped, survivor) pair, O(|D|·C·P), and the self masks O(C·P).
The sharing is O(C·t²) field multiplications (every client's polynomial at
the t holders' points; with the default threshold, whose t is traced, at
⌊C/2⌋ + 1 points with the coefficients past t − 1 zero) plus O(t²) for the
Lagrange coefficients. The stacked form is used in every client map: the
masks need each client's index and the round key, which a
`StreamingSum.term` does not receive.

Bits per client (`SecureAggregationState.upload_bits`), for n members:
32·(P + 1) for the masked contribution (P coordinates and the scalar), plus
32·2 for two public keys (the paper's channel key and masking key), 32·2·(n − 1)
for the shares of sk_c and b_c sent (through the server) to the other members,
and 32·(n − 1) for the shares revealed at unmasking — field elements counted
at 32 bits, without ciphertext or signature overhead. The plain mean uploads
32·P.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry_2x32

from fedjax_opt.core.server import aggregator_name, check_stacked_updates, refuse_client_stage, refuse_downlink
from fedjax_opt.core.tree import select_tree
from fedjax_opt.core.types import Aggregator, PyTree, Traits
from fedjax_opt.core.validation import is_concrete
from fedjax_opt.privacy.dp import DPMeanState, clip_by_global_norm

__all__ = ["PRIME", "GENERATOR", "SecureAggregationState", "SecureSum", "fixed_point_decode", "fixed_point_encode",
           "grid_extra_bits", "rounding_room", "secure_aggregation", "secure_sum", "shamir_reconstruct", "shamir_share",
           "upload_bits"]

PRIME = 2**31 - 1
"""p, the Mersenne prime of the field F_p (Shamir shares) and the group Z_p^* (key agreement)."""

GENERATOR = 7
"""g, a primitive root mod p: the Diffie–Hellman generator."""

_P = np.uint32(PRIME)
_DOMAIN = 0x5EC_A66  # separates the protocol's randomness from the inner aggregator's use of the same key


# --- arithmetic mod p = 2³¹ − 1 on uint32 (no 64-bit integers needed) ------------------------------------------

def _reduce(x: jax.Array) -> jax.Array:
  """Any uint32 to [0, p): 2³¹ ≡ 1, so x ≡ (x mod 2³¹) + ⌊x / 2³¹⌋ ≤ p + 1."""
  x = (x & _P) + (x >> 31)
  return jnp.where(x >= _P, x - _P, x)


def _add_mod(a: jax.Array, b: jax.Array) -> jax.Array:
  return _reduce(a + b)  # a, b < p: no uint32 overflow


def _sub_mod(a: jax.Array, b: jax.Array) -> jax.Array:
  return _reduce(a + (_P - b))


def _mul_mod(a: jax.Array, b: jax.Array) -> jax.Array:
  """a·b mod p for a, b < p, from 16-bit limbs: every partial product fits in uint32."""
  a0, a1 = a & 0xFFFF, a >> 16  # a1 < 2¹⁵
  b0, b1 = b & 0xFFFF, b >> 16
  high = a1 * b1  # < 2³⁰, weight 2³² ≡ 2
  mid = a1 * b0 + a0 * b1  # < 2³², weight 2¹⁶: mid·2¹⁶ = m1·2³¹ + m0·2¹⁶ ≡ m1 + m0·2¹⁶
  low = a0 * b0  # < 2³²
  m0, m1 = mid & 0x7FFF, mid >> 15
  u = _reduce((high << 1) + (m0 << 16))
  return _reduce(_add_mod(u, _reduce(low)) + m1)


def _pow_mod(base: jax.Array, exponent: jax.Array) -> jax.Array:
  """base^exponent mod p, elementwise, exponents < 2³¹ (square and multiply)."""
  base = jnp.asarray(base, jnp.uint32)
  exponent = jnp.asarray(exponent, jnp.uint32)

  def body(i, carry):
    result, power = carry
    bit = ((exponent >> i.astype(jnp.uint32)) & 1) == 1
    return jnp.where(bit, _mul_mod(result, power), result), _mul_mod(power, power)

  shape = jnp.broadcast_shapes(base.shape, exponent.shape)
  init = (jnp.ones(shape, jnp.uint32), jnp.broadcast_to(base, shape))
  return lax.fori_loop(0, 31, body, init)[0]


def _fold_mod(x: jax.Array, op: Callable, identity: int) -> jax.Array:
  """op-reduction of the last axis by halving (log₂ n steps), padded with `identity`."""
  n = x.shape[-1]
  size = 1 << max(n - 1, 0).bit_length()
  x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (size - n,), identity, jnp.uint32)], axis=-1)
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = op(x[..., :half], x[..., half:])
  return x[..., 0]


# --- Shamir secret sharing over F_p ---------------------------------------------------------------------------

def _field_from_words(words: jax.Array) -> jax.Array:
  """`[..., 2]` uniform uint32 words (hi, lo) -> (2³² hi + lo) mod p = (2 hi + lo) mod p, within 2^−33 of uniform."""
  return _add_mod(_mul_mod(_reduce(words[..., 0]), jnp.uint32(2)), _reduce(words[..., 1]))


def _random_field(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform elements of F_p (integers in [0, p)) as uint32, from one draw of random bits."""
  return _field_from_words(jax.random.bits(key, shape + (2,), jnp.uint32))


def _evaluate(secrets: jax.Array, coefficients: jax.Array, xs: jax.Array) -> jax.Array:
  """f_s(x) = s + a_1 x + … + a_{t−1} x^{t−1} mod p by Horner: `[S]`, `[S, t − 1]`, `[n]` -> `[S, n]`."""
  xs = jnp.asarray(xs, jnp.uint32)[None, :]
  acc = jnp.zeros((secrets.shape[0], xs.shape[1]), jnp.uint32)
  acc = lax.scan(lambda a, c: (_add_mod(_mul_mod(a, xs), c[:, None]), None), acc, coefficients.T[::-1])[0]
  return _add_mod(_mul_mod(acc, xs), secrets[:, None])


def shamir_share(key: jax.Array, secrets: jax.Array, threshold: int, xs: jax.Array) -> jax.Array:
  """Shamir shares of each secret: f(x_i) for a random polynomial f of degree t − 1 over F_p with f(0) = secret.

  Any t shares determine the secret (`shamir_reconstruct`); any t − 1 of them
  are uniformly distributed whatever the secret.

  Args:
    key: PRNG key for the coefficients (uniform in F_p).
    secrets: `[S]` integers in [0, p).
    threshold: t ≥ 1 (static).
    xs: `[n]` distinct evaluation points in [1, p) (a holder's index + 1).

  Returns:
    `[S, n]` uint32 shares in [0, p).
  """
  if not isinstance(threshold, int) or threshold < 1:
    raise ValueError(f"shamir_share: threshold must be an int >= 1; got {threshold!r}.")
  secrets = jnp.asarray(secrets, jnp.uint32)
  coefficients = _random_field(key, (secrets.shape[0], threshold - 1))
  return _evaluate(secrets, coefficients, xs)


def _lagrange_at_zero(xs: jax.Array, used: jax.Array | None = None) -> jax.Array:
  """λ_i = Π_{j≠i, j used} x_j / (x_j − x_i) mod p for the used points (0 for the others), so that
  f(0) = Σ_{i used} λ_i f(x_i) for deg f < the number of used points."""
  xs = jnp.asarray(xs, jnp.uint32)
  skip = jnp.eye(xs.shape[0], dtype=bool)
  if used is not None:
    skip = skip | ~jnp.asarray(used, bool)[None, :]
  numerator = _fold_mod(jnp.where(skip, jnp.uint32(1), xs[None, :]), _mul_mod, 1)
  denominator = _fold_mod(jnp.where(skip, jnp.uint32(1), _sub_mod(xs[None, :], xs[:, None])), _mul_mod, 1)
  weights = _mul_mod(numerator, _pow_mod(denominator, PRIME - 2))  # Fermat: d^(p−2) = d⁻¹
  return weights if used is None else jnp.where(used, weights, jnp.uint32(0))


def shamir_reconstruct(shares: jax.Array, xs: jax.Array, used: jax.Array | None = None) -> jax.Array:
  """The secrets f(0) = Σ_i λ_i f(x_i) mod p from t shares per secret (Lagrange interpolation at 0).

  Args:
    shares: `[S, n]` shares in [0, p), column i taken at point x_i.
    xs: `[n]` distinct points in [1, p).
    used: None (all n shares), or `[n]` bool: interpolate through the used shares only (t of them, which may
      be traced), ignoring the others.

  Returns:
    `[S]` uint32: the secrets, when t is at least the sharing threshold.
  """
  weights = _lagrange_at_zero(xs, used)
  return _fold_mod(_mul_mod(jnp.asarray(shares, jnp.uint32), weights[None, :]), _add_mod, 0)


# --- fixed point in Z_{2³²} -----------------------------------------------------------------------------------

def fixed_point_encode(x: jax.Array, key: jax.Array, *, frac_bits: int, bound: float) -> tuple[jax.Array, jax.Array]:
  """Encodes reals as integers of the ring Z_{2³²} with f fractional bits and stochastic rounding.

      q = ⌊x̄ 2^f⌋ + 1[U < x̄ 2^f − ⌊x̄ 2^f⌋],   x̄ = clip(x, −B, B),  U ~ Uniform[0, 1)

  so E[q] = x̄ 2^f (unbiased) and |q − x̄ 2^f| < 1; q is stored as its two's
  complement in uint32.

  Returns:
    (`uint32` like `x`, the number of entries outside [−B, B] that were clipped).
  """
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  clipped = jnp.clip(x, -bound, bound)
  scaled = clipped * (2.0 ** frac_bits)
  low = jnp.floor(scaled)
  up = jax.random.uniform(key, x.shape, x.dtype) < scaled - low
  q = low.astype(jnp.int32) + up.astype(jnp.int32)
  return lax.bitcast_convert_type(q, jnp.uint32), jnp.sum(jnp.abs(x) > bound, dtype=jnp.int32)


def fixed_point_decode(q: jax.Array, *, frac_bits: int, dtype: Any = jnp.float32) -> jax.Array:
  """uint32 ring elements read as two's-complement int32, times 2^−f, in `dtype`."""
  return lax.bitcast_convert_type(jnp.asarray(q, jnp.uint32), jnp.int32).astype(dtype) * (2.0 ** -frac_bits)


# --- the protocol -------------------------------------------------------------------------------------------

class SecureSum(NamedTuple):
  """One round of the simulated protocol (`secure_sum`).

  Attributes:
    uploads: `[C, L]` uint32, each member's masked upload y_c (zeros for non-members;
      a dropped member's row is what it would have sent).
    total: `[L]` uint32, Σ_{survivors} e_u mod 2³² as the server unmasks it (zeros when not `ok`).
    ok: bool, at least t survivors (the sum could be unmasked), or no members at all (the sum is 0).
    num_survivors: int32, members that did not drop.
    num_dropped: int32, members that dropped after the key exchange.
    threshold: int32, the round's t.
  """

  uploads: jax.Array
  total: jax.Array
  ok: jax.Array
  num_survivors: jax.Array
  num_dropped: jax.Array
  threshold: jax.Array


def _mask_keys(nonce: jax.Array, secrets: jax.Array, low: jax.Array, high: jax.Array) -> jax.Array:
  """The PRG key of each mask, s = threefry_(n₀ ⊕ a, n₁ ⊕ a)(i, j): `[K]` secrets a, `[K]` pairs i ≤ j -> `[K]` keys.

  a is a pair's agreed key a_{ij} (i < j) or a member's self-mask seed b_i (i = j), so no pair's key is a self
  mask's; (n₀, n₁) is the round's nonce.
  """
  # Both key words depend on the nonce and a alike: under vmap, threefry's CPU lowering needs them batched alike.
  words = threefry_2x32((nonce[0] ^ secrets, nonce[1] ^ secrets),
                        jnp.concatenate([low, high]).astype(jnp.uint32))  # the K pairs (i, j), hashed side by side
  return jax.random.wrap_key_data(words.reshape(2, -1).T, impl="threefry2x32")


def _expand(keys: jax.Array, length: int) -> jax.Array:
  """PRG(key) for a batch of keys: `[K]` keys -> `[K, length]` uint32 (threefry)."""
  return jax.vmap(lambda k: jax.random.bits(k, (length,), jnp.uint32))(keys)


def _masks(nonce: jax.Array, sk: jax.Array, pk: jax.Array, member: jax.Array, length: int, *,
           seeds: jax.Array | None = None, removal: tuple[jax.Array, ...] | None = None) -> tuple[jax.Array, jax.Array]:
  """Every mask of a round, C masks of `length` words per step of one loop: (the members' rows, the server's part).

  Steps 1 … ⌊C/2⌋, the pair masks: at offset k the pairs (c, c + k mod C) (at k = C/2 for even C, only
  c < C/2), so that each pair's mask, from a_{cc'} = pk_{c'}^{sk_c}, is expanded once and added to one member's
  row and subtracted from the other's: row c holds Σ_{c' > c} PRG(s_{cc'}) − Σ_{c' < c} PRG(s_{cc'}) over the
  other members c'. With `seeds` (b_c), one step adds each member's self mask PRG(b_c) to its row. With
  `removal = (survivors, recovered, dropped, num_dropped)`, what the server subtracts from the survivors' sum:
  one step for the survivors' self masks PRG(b_u) (b_u = recovered[u]), then one per dropped member d =
  dropped[r], r < num_dropped, for the masks Σ_u ±PRG(s_{ud}) it left in the survivors' uploads, from
  a_{ud} = pk_u^{sk_d} (sk_d = recovered[d]).

  One loop body holds the key agreement, the key derivation and the expansion (threefry, a large program) once,
  so they are compiled once for every kind of mask.

  Returns:
    (`[C, length]` uint32 rows, `[length]` uint32 to add to Σ_{survivors} y_u: zeros without `removal`).
  """
  c = sk.shape[0]
  index = jnp.arange(c)
  pair_steps = c // 2
  self_step = pair_steps if seeds is not None else -1  # -1: no such step
  row_steps = pair_steps + (seeds is not None)
  if removal is None:
    survivors, recovered, dropped, num_dropped = member, sk, index, 0
    recover_step, num_steps = -1, row_steps
  else:
    survivors, recovered, dropped, num_dropped = removal
    recover_step = row_steps
    num_steps = row_steps + 1 + num_dropped
  seeds = recovered if seeds is None else seeds

  def body(step, carry):
    rows, server = carry
    is_pair, is_drop = step < pair_steps, (recover_step >= 0) & (step > recover_step)
    k = step + 1
    other = (index + k) % c
    d = dropped[jnp.clip(step - recover_step - 1, 0, c - 1)]
    agreed = _pow_mod(jnp.where(is_pair, pk[other], pk), jnp.where(is_pair, sk, recovered[d]))
    partner = jnp.where(is_pair, other, jnp.where(is_drop, d, index))
    secret = jnp.where(is_pair | is_drop, agreed, jnp.where(step == self_step, seeds, recovered))
    g = _expand(_mask_keys(nonce, secret, jnp.minimum(index, partner), jnp.maximum(index, partner)), length)
    live = member & member[other] & ~((2 * k == c) & (index >= c // 2))
    plus = jnp.where(is_pair, live & (index < other),
                     jnp.where(step == self_step, member, survivors & (~is_drop | (index < d))))
    minus = jnp.where(is_pair, live & (index > other), is_drop & survivors & (index > d))
    signed = jnp.where(plus[:, None], g, jnp.where(minus[:, None], jnp.uint32(0) - g, jnp.uint32(0)))
    return lax.cond(step < row_steps,
                    lambda: (rows + signed - jnp.where(is_pair, jnp.roll(signed, k, axis=0), jnp.uint32(0)), server),
                    lambda: (rows, server - jnp.sum(signed, axis=0, dtype=jnp.uint32)))

  init = (jnp.zeros((c, length), jnp.uint32), jnp.zeros((length,), jnp.uint32))
  return lax.fori_loop(0, num_steps, body, init)


def _draw_secrets(key: jax.Array, num_slots: int, threshold: int | None,
                  t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Every client's secrets of a round, from one draw of `[2·C·cap + 1, 2]` uint32 words (module docstring).

  The first 2·C·cap pairs of words, as field elements (`_field_from_words`), are C rows of 2·cap: client c's
  sk_c = row[0] mod (p − 2) + 1 ∈ [1, p − 2], its self-mask seed b_c = row[1], and the non-constant coefficients
  of its sharing polynomials of sk_c (row[2 : cap + 1]) and of b_c (row[cap + 1 :]), those of x^t and higher
  powers set to 0 (degree t − 1). The last pair is the round's PRG nonce. `cap` (static) bounds t: the
  threshold, or ⌊C/2⌋ + 1 when t is a majority of the members (traced).

  Returns:
    (sk `[C]`, seeds `[C]`, coefficients of sk `[C, cap − 1]`, of b `[C, cap − 1]`, nonce `[2]`), uint32.
  """
  cap = num_slots // 2 + 1 if threshold is None else threshold
  words = jax.random.bits(key, (num_slots * 2 * cap + 1, 2), jnp.uint32)
  drawn, nonce = _field_from_words(words[:-1]).reshape(num_slots, 2 * cap), words[-1]
  degree = jnp.arange(1, cap) < t  # the coefficients of x¹ … x^(t−1)
  return (drawn[:, 0] % (PRIME - 2) + 1, drawn[:, 1], jnp.where(degree, drawn[:, 2:cap + 1], jnp.uint32(0)),
          jnp.where(degree, drawn[:, cap + 1:], jnp.uint32(0)), nonce)


def secure_sum(encoded: jax.Array, member: jax.Array, dropped: jax.Array, key: jax.Array, *,
               threshold: int | None) -> SecureSum:
  """The protocol of the module docstring on ring elements: masks, uploads, dropout recovery, the unmasked sum.

  Args:
    encoded: `[C, L]` uint32, each client's encoded contribution e_c.
    member: `[C]` bool, the clients taking part in the key exchange.
    dropped: `[C]` bool, members that drop after it (their uploads never arrive).
    key: PRNG key: every party's secrets, polynomials and the PRG nonces.
    threshold: t, the shares needed to reconstruct a secret: an int in [1, C] (static), or None: a majority of
      the round's m members, t = ⌊m/2⌋ + 1 (traced; the sharing polynomials then have degree t − 1 ≤ ⌊C/2⌋).

  Returns:
    A `SecureSum`; `total` equals Σ_{member, not dropped} encoded mod 2³² when `ok`.
  """
  c, length = encoded.shape
  if threshold is not None and not 1 <= threshold <= c:
    raise ValueError(f"secure_sum: threshold must be None or in [1, C = {c}]; got {threshold}.")
  member = jnp.asarray(member, bool)
  dropped = jnp.asarray(dropped, bool) & member
  survivors = member & ~dropped
  t = jnp.sum(member, dtype=jnp.int32) // 2 + 1 if threshold is None else jnp.int32(threshold)

  # Round 0-1: keys and shares (made by the clients).
  sk, seeds, coefficients_sk, coefficients_b, nonce = _draw_secrets(key, c, threshold, t)
  cap = coefficients_sk.shape[1] + 1
  pk = _pow_mod(jnp.uint32(GENERATOR), sk)

  # Round 3, the server's reconstruction (written before round 2 so that every mask is made in one loop): it
  # collects the shares of the first t survivors and interpolates.
  num_survivors = jnp.sum(survivors, dtype=jnp.int32)
  ok = (num_survivors >= t) | ~jnp.any(member)  # no members: the empty sum, 0, with nothing to unmask
  holders = jnp.argsort(~survivors, stable=True)[:cap]  # the survivors first: the first t of them hold shares
  xs = (holders + 1).astype(jnp.uint32)
  # A survivor reveals its share of b_u, never of sk_u; of a dropped member, of sk_d, never of b_d.
  shared = jnp.where(dropped, sk, seeds)
  coefficients = jnp.where(dropped[:, None], coefficients_sk, coefficients_b)
  # A share arrives only from a survivor (one that does not arrive is 0 here); the server interpolates t of them.
  shares = jnp.where(survivors[holders][None, :], _evaluate(shared, coefficients, xs), jnp.uint32(0))
  recovered = shamir_reconstruct(shares, xs, jnp.arange(cap) < t)

  # Round 2, the uploads, and round 3: the server sums those that arrived and removes the survivors' self masks,
  # made again from the reconstructed seeds, and the dropped members' pair masks.
  num_dropped = jnp.sum(dropped, dtype=jnp.int32)
  order = jnp.argsort(~dropped, stable=True)
  rows, removed = _masks(nonce, sk, pk, member, length, seeds=seeds,
                         removal=(survivors, recovered, order, jnp.where(ok, num_dropped, 0)))
  uploads = jnp.where(member[:, None], encoded + rows, jnp.uint32(0))
  total = jnp.sum(jnp.where(survivors[:, None], uploads, jnp.uint32(0)), axis=0, dtype=jnp.uint32) + removed
  total = jnp.where(ok, total, jnp.uint32(0))
  return SecureSum(uploads=uploads, total=total, ok=ok, num_survivors=num_survivors, num_dropped=num_dropped,
                   threshold=t)


def upload_bits(num_parameters: int, members: jax.Array) -> jax.Array:
  """Bits one member uploads in a round with n members: 32·(P + 1) + 32·2 + 3·32·(n − 1) (module docstring)."""
  others = jnp.maximum(jnp.asarray(members, jnp.float32) - 1, 0)
  return jnp.float32(32 * (num_parameters + 1) + 32 * 2) + 3 * 32 * others


# --- the aggregator -----------------------------------------------------------------------------------------

@flax.struct.dataclass
class SecureAggregationState:
  """State of `secure_aggregation`: the inner aggregator's state and the last round's protocol diagnostics.

  A round the guard rejects (fewer than t survivors) leaves the whole state as
  it was; `metrics["round_accepted"]` records it.

  Attributes:
    inner: the wrapped aggregator's state.
    num_dropped: int32, members that dropped after the key exchange.
    num_survivors: int32, members whose upload arrived.
    recovered: bool, dropped members' masks were reconstructed and removed.
    num_clipped: int32, coordinates outside [−B, B] clipped by the encoding (all members).
    upload_bits: float32, bits uploaded by one member (`upload_bits`).
    threshold: int32, the round's Shamir threshold t (survivors needed).
    frac_bits: int32, f_t = f + k_t, the fractional bits the last round's update coordinates were encoded with:
      f, refined by k_t = `grid_extra_bits(...)` ≥ 0 bits as a `dp_mean`'s adaptive clip norm C_t shrinks (module
      docstring, "DP through the ring"); f without a `dp_mean` and before the first round.
    initial_clip_norm: float32, C_0, the `dp_mean`'s clip norm when the state was initialised (the grid of f bits
      was checked against it; constant); 0 without a `dp_mean`.
  """

  inner: Any
  num_dropped: jax.Array
  num_survivors: jax.Array
  recovered: jax.Array
  num_clipped: jax.Array
  upload_bits: jax.Array
  threshold: jax.Array
  frac_bits: jax.Array
  initial_clip_norm: jax.Array


def _pow2(exponent: Any, dtype: Any = jnp.float32) -> jax.Array:
  """2^e exactly, for int32 e in [−126, 127] (possibly traced), built from its float32 bits; in `dtype`."""
  e = jnp.asarray(exponent, jnp.int32)
  return lax.bitcast_convert_type((e + 127) << 23, jnp.float32).astype(dtype)


def rounding_room(clip_norm: Any, num_coordinates: int, frac_bits: Any) -> Any:
  """C' = max(C − √P·2^−f, 0): the norm to clip a client's update to so that its fixed-point encoding decodes
  within C (module docstring, "DP through the ring"). `frac_bits` may be a traced int32 f_t = f + k_t (at most
  126): the same float32 value as for a Python int."""
  if isinstance(frac_bits, (int, np.integer)):
    return jnp.maximum(clip_norm - math.sqrt(num_coordinates) * 2.0**-frac_bits, 0.0)
  return jnp.maximum(clip_norm - jnp.float32(math.sqrt(num_coordinates)) * _pow2(-jnp.asarray(frac_bits)), 0.0)


def grid_extra_bits(clip_norm: Any, initial_clip_norm: Any, num_coordinates: int, frac_bits: int) -> jax.Array:
  """k_t, the bits by which a round with clip norm C_t refines the grid of f bits: int32, the largest k ≥ 0 with

      C_t·2^k ≤ T = max(C_0, 2·√P·2^−f),      capped at 126 − f (float32's normal range)

  so 0 while C_t > T/2 (always for a fixed clip norm C_t = C_0), and otherwise C_t·2^k ∈ (T/2, T]: the round's
  rounding room √P·2^−(f + k) stays under 2·(√P·2^−f / C_0)·C_t and under C_t (module docstring, "DP through the
  ring"). Exact: the float32 estimate ⌊log₂(T / C_t)⌋ is corrected by comparing C_t·2^k with T, both exact
  products. A C_t of 0 gives the cap, a NaN gives 0.
  """
  cap = 126 - frac_bits
  c = jnp.asarray(clip_norm, jnp.float32)
  reference = jnp.maximum(jnp.asarray(initial_clip_norm, jnp.float32),
                          jnp.float32(2 * math.sqrt(num_coordinates) * 2.0**-frac_bits))
  guess = jnp.floor(jnp.log2(reference / c))
  k = jnp.where(jnp.isnan(guess), 0.0, jnp.clip(guess, 0, cap)).astype(jnp.int32)
  k = jnp.where(c * _pow2(k) > reference, k - 1, k)
  k = jnp.where(c * _pow2(k + 1) <= reference, k + 1, k)
  return jnp.clip(k, 0, cap)


def _check_dp_grid(clip_norm: Any, num_coordinates: int, frac_bits: int) -> None:
  """Refuses a grid that cannot carry `dp_mean`'s terms: the centred bit ±½ off the grid (f = 0), or no room
  left for the rounding (C ≤ √P·2^−f; checked when C is concrete)."""
  if frac_bits == 0:
    raise ValueError("secure_aggregation: frac_bits = 0 cannot encode dp_mean's centred count bit ±1/2 exactly "
                     "(its sensitivity would double); use frac_bits >= 1.")
  if not is_concrete(clip_norm) or num_coordinates == 0:
    return
  c, slack = float(clip_norm), math.sqrt(num_coordinates) * 2.0**-frac_bits
  if slack >= c:
    enough = math.ceil(math.log2(100 * math.sqrt(num_coordinates) / c))
    raise ValueError(f"secure_aggregation: frac_bits f = {frac_bits} is too coarse for dp_mean's clip norm "
                     f"C = {c:g} over P = {num_coordinates} coordinates: the stochastic rounding can lengthen an "
                     f"update by up to √P·2^−f = {slack:.3g} >= C, leaving no room to clip to C − √P·2^−f; raise "
                     f"frac_bits (f >= {enough} costs under 1% of C).")


def _check(frac_bits: Any, bound: Any, threshold: Any, dropout: Any) -> None:
  if isinstance(frac_bits, bool) or not isinstance(frac_bits, int) or not 0 <= frac_bits <= 30:
    raise ValueError(f"secure_aggregation: frac_bits must be an int in [0, 30]; got {frac_bits!r}.")
  if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < float("inf"):
    raise ValueError(f"secure_aggregation: bound must be a finite number > 0; got {bound!r}.")
  if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1):
    raise ValueError(f"secure_aggregation: threshold must be None or an int >= 1; got {threshold!r}.")
  if not callable(dropout):
    if isinstance(dropout, bool) or not (isinstance(dropout, (int, float)) or hasattr(dropout, "dtype")):
      raise TypeError(f"secure_aggregation: dropout must be a probability or a callable; got {type(dropout).__name__}.")
    if is_concrete(dropout) and not 0 <= float(dropout) <= 1:
      raise ValueError(f"secure_aggregation: dropout must be in [0, 1]; got {float(dropout)}.")


def secure_aggregation(
    inner: Aggregator,
    *,
    bound: float,
    frac_bits: int = 16,
    threshold: int | None = None,
    dropout: float | Callable[[jax.Array, jax.Array], jax.Array] = 0.0,
) -> Aggregator:
  """`inner`'s sum computed by simulated secure aggregation (Bonawitz et al., CCS 2017), then `inner`'s finalize.

      Δ = finalize(decode(Σ_{u ∈ U} y_u − Σ_{u ∈ U} PRG(b_u) − Σ_{d ∈ D, u ∈ U} ±PRG(s_{ud})))
        = finalize(decode(Σ_{u ∈ U} encode(term(Δ_u, w_u))))                       (exactly, mod 2³²)

  for the survivors U and the dropped members D (the module docstring has
  the protocol, the encoding, the trust model and the costs). A client with
  weight 0 is not a member; a dropped member counts as weight 0 for `inner`.

  Args:
    inner: an aggregator that is a sum over clients (it has a `StreamingSum`):
      `fo.aggregators.mean()`, `weighted_mean()`, `fo.privacy.dp_mean(...)`.
      Its `term` gives each client's contribution, its `finalize` the result;
      `always_releases` is inherited. A `dp_mean`'s clipped terms are clipped
      again to C − √P·2^−f, so that each decoded term stays within C
      (module docstring, "DP through the ring"). With adaptive clipping the
      grid follows the round's C_t: once C_t ≤ C_0/2 (or ≤ √P·2^−f, if
      that is larger) its update coordinates
      are encoded with f + k_t bits (`grid_extra_bits`, `state.frac_bits`),
      so the room C_t − √P·2^−(f + k_t) stays a fraction of C_t and never
      reaches 0 (a round where it would, past float32's range, is rejected).
    frac_bits: f, fractional bits of the fixed-point encoding (resolution 2^−f;
      the grid of round 0, refined per round under adaptive clipping).
    bound: B > 0 (required: no default fits every inner rule): every
      coordinate of a contribution is clipped to [−B, B] (counted in
      `state.num_clipped`). Its scalar (1 for `mean`, n_k for
      `weighted_mean`, ±½ for `dp_mean`) is never clipped: a B below a
      weight-1 client's scalar is refused by `init`, and a round in which a
      member's scalar exceeds B (`weighted_mean` with n_k > B) is rejected
      (NaN: the guard keeps the model) rather than divided by a wrong count.
      Needs C·(⌈B 2^f⌉ + 1) < 2³¹ (checked at trace time). For `weighted_mean`,
      B must cover n_k and n_k·|Δ_k|; for `dp_mean`, B ≥ its clip norm loses nothing
      (B applies to the coordinates times 2^k_t in a round with a refined grid,
      which then stay below C_0).
    threshold: t, the Shamir threshold: shares needed to reconstruct a secret,
      so a round needs t survivors. None: ⌊m/2⌋ + 1 for the round's m members
      (weight > 0; padding slots do not count), a majority of the users who
      take part (`state.threshold` records it). An int: the same t in every
      round, so a round with fewer than t members is rejected.
    dropout: q ∈ [0, 1], the probability that each member drops after the key
      exchange (drawn from the round key), or a callable
      `dropout(key, weights [C]) -> [C] bool` (True: drops).

  Returns:
    An `Aggregator` with state `SecureAggregationState` and no streaming form.

  Raises:
    TypeError: `inner` is not an aggregator with a `StreamingSum`.
    ValueError: `inner` has a client stage (chain the stage in front of the
      secure aggregator instead).
    ValueError: an out-of-range argument; at trace time, a ring too small for
      C clients (see `bound`) or t > C; from `init(params)` with a `dp_mean`,
      f = 0 or a grid with √P·2^−f ≥ C; from `aggregate`, weights that are
      not 1-D `[C]` or an update leaf not stacked `[C, ...]` on axis 0 (one
      line naming the leaf and the axis).
  """
  if not isinstance(inner, Aggregator) or inner.streaming is None:
    raise TypeError("secure_aggregation: inner must be an Aggregator that is a sum over clients (with a "
                    "StreamingSum: mean, weighted_mean, dp_mean); rules that need every update cannot be "
                    f"computed from a secure sum. Got "
                    + (f"{aggregator_name(inner)}, which has no streaming form." if isinstance(inner, Aggregator)
                       else f"{type(inner).__name__}."))
  refuse_client_stage(inner, "secure_aggregation", "the stage runs on the clients, before the secure sum; chain "
                      "it in front of the wrapper: fo.aggregators.chain(stage, fo.privacy.secure_aggregation(...)).")
  refuse_downlink(inner, "secure_aggregation", "the server compresses its broadcast after the secure sum is "
                  "released; chain the downlink after the wrapper: fo.aggregators.chain(fo.privacy.secure_aggregation("
                  "...), downlink).")
  _check(frac_bits, bound, threshold, dropout)
  term, finalize = inner.streaming

  def init(params: PyTree) -> SecureAggregationState:
    zero = jnp.zeros((), jnp.int32)
    inner_state = inner.init(params)
    if isinstance(inner_state, DPMeanState):
      _check_dp_grid(inner_state.clip_norm, sum(int(np.size(x)) for x in jax.tree.leaves(params)), frac_bits)
    # The scalar a client of weight 1 adds (1 for mean, ±1/2 for dp_mean): clipped, every denominator would be off.
    probe = term(np.zeros((), np.float32), np.ones((), np.float32), inner_state)[1]
    if is_concrete(probe) and abs(float(probe)) > bound:
      raise ValueError(f"secure_aggregation: bound B = {bound:g} would clip the scalar each client adds to the sum "
                       f"({float(probe):g} for a client of weight 1: the count or weight the inner rule divides by); "
                       f"use bound >= {abs(float(probe)):g}.")
    initial = (jnp.asarray(inner_state.clip_norm, jnp.float32) if isinstance(inner_state, DPMeanState)
               else jnp.zeros((), jnp.float32))
    return SecureAggregationState(inner=inner_state, num_dropped=zero, num_survivors=zero,
                                  recovered=jnp.zeros((), bool), num_clipped=zero,
                                  upload_bits=jnp.zeros((), jnp.float32), threshold=zero,
                                  frac_bits=jnp.asarray(frac_bits, jnp.int32), initial_clip_norm=initial)

  def aggregate(updates: PyTree, weights: jax.Array, state: SecureAggregationState,
                key: jax.Array) -> tuple[PyTree, SecureAggregationState]:
    c = check_stacked_updates(updates, weights, "secure_aggregation")
    if threshold is not None and threshold > c:
      raise ValueError(f"secure_aggregation: threshold t = {threshold} exceeds the round's C = {c} client slots.")
    largest = math.ceil(bound * 2**frac_bits) + 1
    if c * largest >= 2**31:
      raise ValueError(f"secure_aggregation: the ring Z_(2^32) cannot hold the sum of C = {c} contributions of up to "
                       f"bound B = {bound:g} with frac_bits f = {frac_bits}: needs C·(ceil(B·2^f) + 1) < 2^31; lower "
                       f"frac_bits or bound.")
    k_drop, k_round, k_protocol = jax.random.split(jax.random.fold_in(key, _DOMAIN), 3)
    member = weights > 0
    drops = dropout(k_drop, weights) if callable(dropout) else jax.random.bernoulli(k_drop, dropout, (c,))
    dropped = jnp.asarray(drops, bool).reshape(c) & member
    used = jnp.where(dropped, jnp.zeros_like(weights), weights)

    terms, scalars = jax.vmap(term, in_axes=(0, 0, None))(updates, used, state.inner)
    dp = isinstance(state.inner, DPMeanState)
    extra, room_ok = jnp.zeros((), jnp.int32), jnp.ones((), bool)
    if dp:  # room for the rounding, on a grid refined by k_t bits as C_t shrinks: the decoded update stays within C_t
      num_coordinates = sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(terms))
      extra = grid_extra_bits(state.inner.clip_norm, state.initial_clip_norm, num_coordinates, frac_bits)
      room = rounding_room(state.inner.clip_norm, num_coordinates, frac_bits + extra)
      room_ok = room > 0  # False only past the cap of k_t, or for C_t = 0 or NaN: the round is then rejected
      terms = jax.vmap(lambda t: clip_by_global_norm(t, room)[0])(terms)
    leaves, treedef = jax.tree.flatten(terms)
    columns = [leaf.reshape(c, -1) for leaf in leaves] + [scalars.reshape(c, 1)]
    flat = jnp.concatenate([col.astype(jnp.result_type(*columns)) for col in columns], axis=1)
    if dp:  # the update coordinates times 2^k_t (exact), the scalar as is: the same integers as on round 0's grid
      is_update = jnp.arange(flat.shape[1]) < flat.shape[1] - 1
      flat = flat * jnp.where(is_update, _pow2(extra, flat.dtype), jnp.ones((), flat.dtype))
    encoded, num_clipped = fixed_point_encode(jnp.where(member[:, None], flat, 0), k_round, frac_bits=frac_bits,
                                              bound=bound)
    # A member whose scalar (its weight for weighted_mean) lies outside [−B, B] would shift the denominator: the
    # round is rejected (NaN) instead of aggregated wrong.
    scalar_ok = ~jnp.any(member & (jnp.abs(scalars) > bound))
    result = secure_sum(encoded, member, dropped, k_protocol, threshold=threshold)

    total_flat = fixed_point_decode(result.total, frac_bits=frac_bits, dtype=flat.dtype)
    if dp:  # back from the grid of f + k_t bits: times 2^−k_t (exact)
      total_flat = total_flat * jnp.where(is_update, _pow2(-extra, flat.dtype), jnp.ones((), flat.dtype))
    parts = jnp.split(total_flat, np.cumsum([col.shape[1] for col in columns])[:-1])
    decoded = [part.astype(col.dtype) for part, col in zip(parts, columns)]
    total = jax.tree.unflatten(treedef, [d.reshape(leaf.shape[1:]) for d, leaf in zip(decoded[:-1], leaves)])
    out, inner_state = finalize(total, decoded[-1][0], state.inner, key)
    ok = result.ok & scalar_ok & room_ok
    out = jax.tree.map(lambda o, u: jnp.where(ok, o, jnp.nan).astype(u.dtype), out, updates)
    new_state = SecureAggregationState(
        inner=select_tree(ok, inner_state, state.inner),
        num_dropped=result.num_dropped,
        num_survivors=result.num_survivors,
        recovered=result.ok & (result.num_dropped > 0),
        num_clipped=num_clipped,
        upload_bits=upload_bits(int(sum(col.shape[1] for col in columns[:-1])), jnp.sum(member)),
        threshold=result.threshold,
        frac_bits=jnp.int32(frac_bits) + extra,
        initial_clip_norm=state.initial_clip_norm,
    )
    return out, new_state

  return Aggregator(init, aggregate, None, always_releases=inner.always_releases,
                    traits=Traits.wrap(inner.traits, name="secure_aggregation", secure=True))
