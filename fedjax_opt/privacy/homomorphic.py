"""Homomorphic aggregation with CKKS (TenSEAL): the server adds encrypted updates and never holds the secret key.

Cheon, Kim, Kim, Song: "Homomorphic Encryption for Arithmetic of Approximate
Numbers" (ASIACRYPT 2017, https://eprint.iacr.org/2016/421), through
TenSEAL (Benaissa et al. 2021, https://github.com/OpenMined/TenSEAL) on
Microsoft SEAL. An optional extra: `pip install "fedjax_opt[he]"`; TenSEAL is
imported when a function here is first called, so `import fedjax_opt` does
not need it.

The weighted mean of C client updates, m = Σ_c w_c Δ_c / Σ_c w_c, in three roles:

1. The key holder (a party trusted to decrypt only the aggregate) makes the
   keys, `ckks_context(...)`: a `CKKSContext` with the secret key
   (`.secret`) and a copy without it (`.public`: the public and
   relinearization keys only) that it hands to the clients and the server.
2. Client c flattens its update (the pytree's leaves in order, P numbers),
   multiplies by its weight and appends the weight: the vector
   v_c = (w_c Δ_c, w_c) of P + 1 numbers, cut into ⌈(P + 1)/S⌉ chunks of at
   most S = poly_modulus_degree/2 slots, each encrypted under the public key
   (`encrypt_update`). The weight travels encrypted too, so the server learns
   neither the updates nor the weights.
3. The server deserializes the uploads in the public context and adds them,
   chunk by chunk, ciphertext to ciphertext (`add_encrypted`): no
   multiplication, so no level is consumed and no relinearization is needed.
   It refuses a context that holds the secret key.
4. The key holder decrypts the sum (`decrypt_mean`): (Σ w_c Δ_c, Σ w_c), and
   divides. It sees only the aggregate.

`homomorphic_mean(updates, weights, context)` runs the three roles in one
process on the host — NumPy in, NumPy out, the updates stacked `[C, ...]`
like an `Aggregator`'s — and returns the mean and a `HomomorphicStats`: bytes
uploaded per client (the serialized ciphertexts), seconds spent encrypting,
adding and decrypting, and the error bound below. It is not a jit-able
`Aggregator`: TenSEAL runs on the host, outside XLA, so it cannot sit inside
a compiled `step` or `fo.train`'s compiled chunks. Use it in a host-side
loop: train the clients with a jitted program, bring their deltas to the
host, aggregate here, apply the server optimizer (docs/privacy.md,
"Homomorphic aggregation", has the loop). A client with weight 0 takes no
part; a client whose update holds a NaN or an Inf is excluded before it
encrypts (the server could not see it inside a ciphertext) and counted in
`num_nonfinite`; with no client left the mean is NaN, as for a rejected
round, and `num_clients` is 0.

Parameters (`ckks_context`): N = `poly_modulus_degree` (a power of two in
[1024, 32768]; S = N/2 slots per ciphertext), `coeff_mod_bit_sizes` (the bit
sizes of the primes q_0 … q_L: all but the last hold the data, the last is
SEAL's special prime for key switching) and Δ = 2^`scale_bits`, the global
scale. They are checked before TenSEAL sees them: N a power of two, at least
two primes of 1 … 60 bits adding up to at most what N allows at 128-bit
security (`MAX_COEFF_MODULUS_BITS`, the HomomorphicEncryption.org standard
that SEAL enforces), and `scale_bits` at most the data primes' bits minus 2.

Capacity. A decrypted slot is exact modulo Q = q_0 ⋯ q_{L−1}: a sum whose
magnitude reaches Q/(2Δ) wraps around silently. `homomorphic_mean` refuses,
before encrypting, a round in which Σ_c |w_c Δ_{c,j}| or Σ_c w_c reaches
`CKKSContext.capacity` = 2^(data bits − scale_bits − 2) (a factor of 2 below
the limit, since each q_i is just under 2^bits).

Error bound. Encoding rounds the polynomial's coefficients to integers (at
most N/2 in each slot), and a fresh public-key encryption decrypts with an
error whose canonical-embedding norm — hence each slot's error — is at most
B_clean = 8√2 σN + 6σ√N + 16σ√(hN) (Cheon et al. 2017, Lemma 1; σ = 3.2,
SEAL's error width; taken with h = N, which bounds the weight of SEAL's
ternary secret), a high-probability bound of six standard deviations. So
each slot of one client's ciphertext decrypts within

    ε = (B_clean + N/2) / Δ                      (`CKKSContext.fresh_error`)

of its value, and a sum of C ciphertexts within Cε (additions add errors and
nothing else). Both the weighted sum s_j and the total weight W decrypt
within Cε, so the mean's coordinate j is within

    |m̂_j − m_j| ≤ Cε (1 + |m_j|) / (W − Cε)           (`HomomorphicStats.error_bound`, max over j)

plus float64 rounding. At N = 8192 and Δ = 2^40, ε = 6.6e-7: the error of
the mean is about 1e-6 relative to 1 + |m_j| for C = W = 10 (uniform weights)
and smaller with example-count weights; measured errors are about two orders
of magnitude below the bound.

Cost. Each client uploads ⌈(P + 1)/S⌉ ciphertexts of two polynomials with N
coefficients modulo each data prime (SEAL serializes them compressed),
about 235 kB per ciphertext at N = 8192 with two data primes: about 58 bytes
per coordinate (32 with one data prime), where the plain mean uploads 4. `benchmarks/privacy_compression.py`
measures bytes, seconds and errors next to `secure_aggregation` and the plain mean.

Trust model. The server sees ciphertexts only; the key holder sees the sum
only (it must not also be the server, or must not see individual uploads).
Clients are honest-but-curious and the key holder does not collude with the
server; nothing here defends against an active adversary (no proofs that a
ciphertext encrypts a bounded vector). Unlike secure aggregation, dropouts
cost nothing: the server adds whatever arrived. With `dp_mean`-style clipping
and noise the clipping happens on the client before encryption and the noise
after decryption, by the key holder; this module does not do either.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

__all__ = ["MAX_COEFF_MODULUS_BITS", "CKKSContext", "EncryptedUpdate", "HomomorphicStats", "add_encrypted",
           "ckks_context", "decrypt_mean", "encrypt_update", "homomorphic_mean"]

PyTree = Any

MAX_COEFF_MODULUS_BITS = {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}
"""poly_modulus_degree → the largest total of coeff_mod_bit_sizes at 128-bit security (SEAL's default limit)."""

SIGMA = 3.2
"""The standard deviation of SEAL's error distribution (its default noise width)."""


def _tenseal():
  try:
    import tenseal  # pylint: disable=import-outside-toplevel  # an optional extra: imported where used
  except ImportError as e:
    raise ImportError('homomorphic aggregation needs TenSEAL: pip install "fedjax_opt[he]" '
                      '(or pip install "tenseal>=0.3.18").') from e
  return tenseal


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, eq=False)
class CKKSContext:
  """The key holder's CKKS keys and parameters (`ckks_context` makes one).

  Attributes:
    poly_modulus_degree: N; a ciphertext holds N/2 slots.
    coeff_mod_bit_sizes: the bit sizes of the primes q_0 … q_L (the last is the special prime).
    scale_bits: log₂ Δ, the global scale.
    secret: the TenSEAL context with the secret key: the key holder's, for decryption only.
    public: the same context without the secret key: what the clients encrypt with and the server adds in.
  """

  poly_modulus_degree: int
  coeff_mod_bit_sizes: tuple[int, ...]
  scale_bits: int
  secret: Any = dataclasses.field(repr=False)
  public: Any = dataclasses.field(repr=False)

  @property
  def slots(self) -> int:
    """S = N/2, the numbers one ciphertext holds."""
    return self.poly_modulus_degree // 2

  @property
  def data_bits(self) -> int:
    """The bits of the data primes q_0 … q_{L−1} (all but the special prime)."""
    return sum(self.coeff_mod_bit_sizes[:-1])

  @property
  def capacity(self) -> float:
    """2^(data bits − scale_bits − 2): the largest magnitude a slot of a sum may reach without wrapping around."""
    return 2.0 ** (self.data_bits - self.scale_bits - 2)

  @property
  def fresh_error(self) -> float:
    """ε = (B_clean + N/2)/Δ: the bound on one slot's error after encoding, public-key encryption and decryption."""
    n = self.poly_modulus_degree
    clean = 8 * math.sqrt(2) * SIGMA * n + 6 * SIGMA * math.sqrt(n) + 16 * SIGMA * math.sqrt(n * n)
    return (clean + n / 2) / 2.0 ** self.scale_bits


def ckks_context(poly_modulus_degree: int = 8192, coeff_mod_bit_sizes: Sequence[int] = (60, 40, 60),
                 scale_bits: int = 40) -> CKKSContext:
  """The key holder's CKKS keys: a `CKKSContext` with a secret and a public TenSEAL context.

  Args:
    poly_modulus_degree: N, a power of two in [1024, 32768]; a ciphertext holds N/2 numbers.
    coeff_mod_bit_sizes: bit sizes of the primes q_0 … q_L, each 1 … 60, at least two, adding up to at most
      `MAX_COEFF_MODULUS_BITS[N]`; the last is SEAL's special prime. Aggregation only adds, so it needs no
      level for multiplications: the data primes (all but the last) only set the capacity
      2^(Σ data bits − scale_bits − 2) and the ciphertext size.
    scale_bits: the global scale Δ = 2^scale_bits, at most Σ data bits − 2; the error is about N·2^−scale_bits.

  Returns:
    A `CKKSContext`.

  Raises:
    TypeError, ValueError: a parameter out of range, in one line naming it (before TenSEAL sees it).
  """
  n = poly_modulus_degree
  if not _is_int(n) or n not in MAX_COEFF_MODULUS_BITS:
    raise ValueError(f"ckks_context: poly_modulus_degree must be a power of two in [1024, 32768] "
                     f"(a ciphertext holds half as many numbers); got {n!r}.")
  n = int(n)
  if isinstance(coeff_mod_bit_sizes, (str, bytes)) or not isinstance(coeff_mod_bit_sizes, Sequence):
    raise TypeError(f"ckks_context: coeff_mod_bit_sizes must be a sequence of ints; got {coeff_mod_bit_sizes!r}.")
  sizes = tuple(coeff_mod_bit_sizes)
  if not all(_is_int(b) and 1 <= b <= 60 for b in sizes):
    raise ValueError(f"ckks_context: coeff_mod_bit_sizes must be ints in [1, 60] (SEAL's primes are at most "
                     f"60 bits); got {sizes!r}.")
  sizes = tuple(int(b) for b in sizes)
  if len(sizes) < 2:
    raise ValueError(f"ckks_context: coeff_mod_bit_sizes needs at least two primes, the data primes and the last "
                     f"(SEAL's special prime for key switching); got {sizes!r}.")
  if sum(sizes) > MAX_COEFF_MODULUS_BITS[n]:
    raise ValueError(f"ckks_context: coeff_mod_bit_sizes add up to {sum(sizes)} bits, over the "
                     f"{MAX_COEFF_MODULUS_BITS[n]} that poly_modulus_degree={n} allows at 128-bit security; use "
                     f"fewer or smaller primes, or a larger poly_modulus_degree.")
  data_bits = sum(sizes[:-1])
  if not _is_int(scale_bits) or not 1 <= scale_bits <= data_bits - 2:
    raise ValueError(f"ckks_context: scale_bits must be an int in [1, {data_bits - 2}] (the data primes "
                     f"{sizes[:-1]} hold {data_bits} bits, 2 of them kept for the values' magnitude); "
                     f"got {scale_bits!r}.")
  ts = _tenseal()
  try:
    secret = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=n, coeff_mod_bit_sizes=list(sizes))
  except (RuntimeError, ValueError) as e:  # SEAL found no primes ≡ 1 mod 2N of these sizes
    raise ValueError(f"ckks_context: SEAL cannot make primes of {sizes} bits for poly_modulus_degree={n} (they "
                     f"must be ≡ 1 mod {2 * n}): use larger bit sizes, 20 to 60 ({e}).") from None
  secret.global_scale = 2.0 ** int(scale_bits)
  public = secret.copy()
  public.make_context_public()
  return CKKSContext(n, sizes, int(scale_bits), secret, public)


class EncryptedUpdate(NamedTuple):
  """One client's upload, or the server's sum: serialized CKKS ciphertexts.

  Attributes:
    chunks: one serialized ciphertext per chunk of at most N/2 numbers.
    length: the numbers encrypted in all (P + 1: the weighted update and the weight).
  """

  chunks: tuple[bytes, ...]
  length: int

  @property
  def nbytes(self) -> int:
    """The bytes of the serialized ciphertexts: what this upload costs."""
    return sum(len(c) for c in self.chunks)


class HomomorphicStats(NamedTuple):
  """What a `homomorphic_mean` round cost, and its error bound.

  Attributes:
    num_clients: clients whose ciphertexts were added (weight > 0, finite update).
    num_nonfinite: clients with weight > 0 excluded for a NaN or Inf in their update.
    ciphertexts_per_client: ⌈(P + 1)/(N/2)⌉.
    bytes_per_client: mean bytes of a client's serialized ciphertexts (the plain mean's float32 upload is 4·P).
    encrypt_seconds: all clients' encryption and serialization, one after the other (in a deployment they
      run in parallel: divide by `num_clients`).
    add_seconds: the server's deserialization and additions.
    decrypt_seconds: the key holder's decryption and division.
    error_bound: max over coordinates of Cε(1 + |m_j|)/(W − Cε) (module docstring), with the exact m_j that the
      simulation knows; inf when W ≤ Cε.
  """

  num_clients: int
  num_nonfinite: int
  ciphertexts_per_client: int
  bytes_per_client: float
  encrypt_seconds: float
  add_seconds: float
  decrypt_seconds: float
  error_bound: float

  @property
  def seconds(self) -> float:
    """The round's seconds: encrypt + add + decrypt."""
    return self.encrypt_seconds + self.add_seconds + self.decrypt_seconds


def _check_context(context: Any, name: str) -> CKKSContext:
  if not isinstance(context, CKKSContext):
    raise TypeError(f"{name}: context must be a CKKSContext from fo.privacy.homomorphic.ckks_context(...); got "
                    f"{type(context).__name__}.")
  return context


def _flatten(update: PyTree, name: str) -> np.ndarray:
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(update)]
  if not leaves or not all(np.issubdtype(leaf.dtype, np.floating) for leaf in leaves):
    raise TypeError(f"{name}: the update must be a pytree of floating-point arrays; got dtypes "
                    f"{[str(leaf.dtype) for leaf in leaves]}.")
  return np.concatenate([leaf.reshape(-1).astype(np.float64) for leaf in leaves])


def _encrypt_vector(vector: np.ndarray, context: CKKSContext) -> EncryptedUpdate:
  ts = _tenseal()
  s = context.slots
  chunks = tuple(ts.ckks_vector(context.public, vector[i:i + s].tolist()).serialize()
                 for i in range(0, vector.size, s))
  return EncryptedUpdate(chunks, int(vector.size))


def encrypt_update(update: PyTree, weight: float, context: CKKSContext) -> EncryptedUpdate:
  """A client's upload: (w·Δ, w) flattened, chunked to N/2 slots and encrypted under the public key.

  Args:
    update: one client's update, a pytree of float arrays (P numbers in all).
    weight: w ≥ 0, its weight in the mean.
    context: the `CKKSContext`; only its public context is used (a client holds no secret key).

  Returns:
    An `EncryptedUpdate` of ⌈(P + 1)/(N/2)⌉ ciphertexts.
  """
  context = _check_context(context, "encrypt_update")
  vector = _flatten(update, "encrypt_update")
  w = float(weight)
  if not math.isfinite(w) or w < 0:
    raise ValueError(f"encrypt_update: weight must be a finite number >= 0; got {weight!r}.")
  vector = np.append(w * vector, w)
  if not np.all(np.isfinite(vector)):
    raise ValueError("encrypt_update: the update holds a NaN or an Inf; such a client takes no part (it cannot "
                     "be seen once encrypted).")
  peak = float(np.max(np.abs(vector)))
  if peak >= context.capacity:
    raise ValueError(f"encrypt_update: |w·Δ| reaches {peak:.3g}, over the capacity {context.capacity:.3g} of these "
                     f"CKKS parameters; lower scale_bits, add a data prime, or scale the weights down.")
  return _encrypt_vector(vector, context)


def _server_context(server_context: Any) -> Any:
  if isinstance(server_context, CKKSContext):
    raise TypeError("add_encrypted: give the server context.public, not the CKKSContext (it holds the secret key).")
  if not hasattr(server_context, "is_private"):
    raise TypeError(f"add_encrypted: server_context must be a TenSEAL context (CKKSContext.public); got "
                    f"{type(server_context).__name__}.")
  if server_context.is_private():
    raise ValueError("add_encrypted: the server's context holds the secret key; give the server context.public.")
  return server_context


def add_encrypted(uploads: Sequence[EncryptedUpdate], server_context: Any) -> EncryptedUpdate:
  """The server's step: Σ_c of the uploads, ciphertext by ciphertext, in a context without the secret key.

  Args:
    uploads: the clients' `EncryptedUpdate`s, all of one length.
    server_context: a TenSEAL context without the secret key (`CKKSContext.public`); a private one is refused.

  Returns:
    The encrypted sum, an `EncryptedUpdate`.
  """
  ctx = _server_context(server_context)
  uploads = list(uploads)
  if not uploads:
    raise ValueError("add_encrypted: no uploads to add.")
  shapes = {(u.length, len(u.chunks)) for u in uploads}
  if len(shapes) != 1:
    raise ValueError(f"add_encrypted: the uploads differ in length or chunks: {sorted(shapes)}.")
  ts = _tenseal()
  chunks = []
  for j in range(len(uploads[0].chunks)):
    total = ts.ckks_vector_from(ctx, uploads[0].chunks[j])
    for upload in uploads[1:]:
      total.add_(ts.ckks_vector_from(ctx, upload.chunks[j]))
    chunks.append(total.serialize())
  return EncryptedUpdate(tuple(chunks), uploads[0].length)


def _decrypt(total: EncryptedUpdate, context: CKKSContext) -> np.ndarray:
  ts = _tenseal()
  parts = [np.asarray(ts.ckks_vector_from(context.secret, chunk).decrypt(), np.float64) for chunk in total.chunks]
  vector = np.concatenate(parts)
  if vector.size != total.length:
    raise ValueError(f"decrypt_mean: the ciphertexts hold {vector.size} numbers, not the {total.length} announced.")
  return vector


def _unflatten(flat: np.ndarray, like: PyTree) -> PyTree:
  leaves, treedef = jax.tree.flatten(like)
  out, start = [], 0
  for leaf in leaves:
    leaf = np.asarray(leaf)
    out.append(flat[start:start + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
    start += leaf.size
  return jax.tree.unflatten(treedef, out)


def decrypt_mean(total: EncryptedUpdate, context: CKKSContext, like: PyTree) -> PyTree:
  """The key holder's step: decrypt (Σ w_c Δ_c, Σ w_c) and return the weighted mean shaped like `like`.

  Args:
    total: the server's sum (`add_encrypted`).
    context: the key holder's `CKKSContext` (its secret context decrypts).
    like: a pytree of one client's update's structure, shapes and dtypes (e.g. the model's parameters).

  Returns:
    The mean, NumPy arrays of `like`'s shapes and dtypes.
  """
  context = _check_context(context, "decrypt_mean")
  size = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(like))
  if total.length != size + 1:
    raise ValueError(f"decrypt_mean: the sum holds {total.length} numbers, `like` {size} (+ 1 for the weight).")
  vector = _decrypt(total, context)
  return _unflatten(vector[:-1] / vector[-1], like)


def homomorphic_mean(updates: PyTree, weights: Any, context: CKKSContext) -> tuple[PyTree, HomomorphicStats]:
  """Σ w_c Δ_c / Σ w_c of C updates by CKKS: the clients encrypt, the server adds, the key holder decrypts.

  On the host, outside jit (module docstring): NumPy in, NumPy out.

  Args:
    updates: the clients' updates, a pytree of float arrays `[C, ...]` (JAX or NumPy).
    weights: `[C]`, w_c ≥ 0 (0: the client takes no part).
    context: the key holder's `CKKSContext`; the clients and the server get its `public` context only.

  Returns:
    (the mean, a pytree of `[...]` NumPy arrays in the updates' dtypes — NaN when no client took part —,
    `HomomorphicStats`).

  Raises:
    TypeError, ValueError: bad updates or weights, or a sum the parameters cannot hold (`CKKSContext.capacity`).
  """
  context = _check_context(context, "homomorphic_mean")
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(updates)]
  if not leaves or not all(np.issubdtype(leaf.dtype, np.floating) and leaf.ndim >= 1 for leaf in leaves):
    raise TypeError("homomorphic_mean: updates must be a pytree of float arrays with a leading client axis [C, ...].")
  num = leaves[0].shape[0]
  if any(leaf.shape[0] != num for leaf in leaves):
    raise ValueError(f"homomorphic_mean: the leaves of updates differ in their leading client axis: "
                     f"{[leaf.shape[0] for leaf in leaves]}.")
  w = np.asarray(weights, np.float64)
  if w.shape != (num,) or not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"homomorphic_mean: weights must be [C] = [{num}] finite numbers >= 0; got shape {w.shape} "
                     f"{w if w.size <= 8 else ''}.")
  like = jax.tree.map(lambda leaf: np.zeros(np.shape(leaf)[1:], np.asarray(leaf).dtype), updates)
  flat = np.concatenate([leaf.reshape(num, -1).astype(np.float64) for leaf in leaves], axis=1)
  finite = np.all(np.isfinite(flat), axis=1)
  members = np.flatnonzero((w > 0) & finite)
  num_nonfinite = int(np.sum((w > 0) & ~finite))
  chunks = math.ceil((flat.shape[1] + 1) / context.slots)
  if members.size == 0:
    mean = jax.tree.map(lambda leaf: np.full(leaf.shape, np.nan, leaf.dtype), like)
    return mean, HomomorphicStats(0, num_nonfinite, chunks, 0.0, 0.0, 0.0, 0.0, math.nan)
  vectors = np.concatenate([flat[members] * w[members, None], w[members, None]], axis=1)
  reach = max(float(np.max(np.sum(np.abs(vectors), axis=0))), float(np.max(np.abs(vectors))))
  if reach >= context.capacity:
    raise ValueError(f"homomorphic_mean: Σ_c |w_c Δ_c| reaches {reach:.3g} in some coordinate, over the capacity "
                     f"{context.capacity:.3g} of these CKKS parameters (the decrypted sum would wrap around); lower "
                     f"scale_bits, add a data prime to coeff_mod_bit_sizes, or scale the weights down.")

  start = time.perf_counter()
  uploads = [_encrypt_vector(v, context) for v in vectors]  # each client, with the public key only
  encrypt_s = time.perf_counter() - start
  start = time.perf_counter()
  total = add_encrypted(uploads, context.public)  # the server: ciphertexts and the public context only
  add_s = time.perf_counter() - start
  start = time.perf_counter()
  mean = decrypt_mean(total, context, like)  # the key holder
  decrypt_s = time.perf_counter() - start

  c, eps, total_weight = members.size, context.fresh_error, float(np.sum(w[members]))
  exact = np.sum(vectors[:, :-1], axis=0) / total_weight
  margin = total_weight - c * eps
  bound = c * eps * (1 + float(np.max(np.abs(exact)))) / margin if margin > 0 else math.inf
  stats = HomomorphicStats(int(c), num_nonfinite, chunks, float(np.mean([u.nbytes for u in uploads])), encrypt_s,
                           add_s, decrypt_s, bound)
  return mean, stats
