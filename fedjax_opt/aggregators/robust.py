"""Byzantine-robust aggregators: medians, trimmed mean, Krum, Multi-Krum, Bulyan, centered clipping.

Each factory returns an `Aggregator` (`init`, `aggregate(updates [C, ...],
weights [C], state, key) -> (update, state)`), pure and jittable, that works
behind every averaging algorithm's `aggregator=` and under any `client_map`
(with `sharded`, the stacked updates are gathered for the rule). The rules
read the n clients that take part in the round, v_1 … v_n, of which up to q
(`num_byzantine`) may be arbitrary:

| rule | output | tolerates |
|---|---|---|
| `marginal_median()` | μ_j = median_i (v_i)_j | < n/2 bad values per coordinate |
| `mean_around_median(q)` | ρ_j = mean of the n − q values (v_i)_j closest to μ_j | q < n/2 bad values per coordinate |
| `geometric_median()` | argmin_v Σ_i α_i ‖v − v_i‖ (Weiszfeld) | < n/2 bad clients (whole vectors) |
| `trimmed_mean(β)` | per coordinate, the mean without the ⌊βn⌋ largest and smallest | ⌊βn⌋ bad values per coordinate |
| `krum(q)` | the v_i with the least Σ of squared distances to its n − q − 2 nearest | q bad clients, n > 2q + 2 |
| `multi_krum(q, m)` | mean of the m v_i with the least Krum scores | q bad clients, n > 2q + 2 |
| `bulyan(q)` | recursive Krum picks n − 2q, then MeaMed of those keeping n − 4q | q bad clients, n ≥ 4q + 3 |
| `centered_clipping(τ)` | v ← v + (1/n) Σ_i clip_τ(v_i − v), from the last aggregate | a minority of bad clients |

The three medians are those of Xie, Koyejo and Gupta, "Generalized
Byzantine-tolerant SGD" (arXiv:1802.10116, 2018): a classic Byzantine client
corrupts its whole vector; a generalized (dimensional) Byzantine failure
corrupts any coordinates of any client, fewer than half of the clients per
coordinate. Coordinate-wise rules (MarMed, MeaMed, trimmed mean) survive the
generalized model; vector rules (GeoMed, Krum) do not, since every client
can be corrupted somewhere.

Clients that take no part (weight 0: padding, not sampled, or excluded by
the round's rules, docs/architecture.md "The round") never count as votes;
their rows may hold anything (huge values, NaN) without changing the
result. A row that takes part but holds a NaN or ±inf is no vote either:
every rule gives its result over the finite rows, as if that row had
weight 0. In a round the non-finite guard (`core.server.aggregate_updates`)
drops such rows before the rule sees them, an attacker's as received
included (`fedjax_opt.attacks.corrupt`), and counts them in
`num_nonfinite`; called directly, the rules drop them the same way. Shapes stay static: rows are sorted with +inf in the
absent rows' places and indexed with the number n of clients taking part,
a traced count, so the same compiled round serves any n. Every rule
returns zeros when no client takes part (the guard then rejects the
round). Except `geometric_median(weighted=True)`, every client taking part
counts once whatever its weight n_k: an attacker could claim any n_k.

Costs, for n clients (C rows) and d parameters: the coordinate-wise rules
sort each coordinate's C values with a bitonic network of elementwise
min/max (C padded to a power of two P), O(d P log² P) work in ½log²P
passes, O(d C) memory. That is not the O(dn) average of the paper's
selection algorithms, which have no fast vectorized form; the network
beats XLA's comparison sort along the client axis 2.5–10× on CPU.
Krum-type rules compute the C² pairwise distances from one Gram matrix,
O(d C²) time in a matmul, O(C² + d C) memory. All of them hold the C
updates at once, unlike the mean.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_opt.aggregators.base import stateless_init
from fedjax_opt.aggregators.base import broadcast_rows as _rows
from fedjax_opt.core.ordering import row_positions, sort_rows
from fedjax_opt.core.server import check_stacked_updates, client_is_finite
from fedjax_opt.core.types import Aggregator, Traits
from fedjax_opt.core.validation import check_int

PyTree = Any

__all__ = [
    "CenteredClippingState", "bulyan", "centered_clipping", "geometric_median", "krum", "marginal_median",
    "mean_around_median", "multi_krum", "trimmed_mean",
]


# ---- shared pieces -----------------------------------------------------------------------------------------


def _voters(updates: PyTree, weights: jax.Array) -> jax.Array:
  """`[C]` bool: the rows that vote, those taking part (weight > 0) whose update is finite (module docstring)."""
  return (weights > 0) & client_is_finite(updates)


def _present(updates: PyTree, mask: jax.Array) -> PyTree:
  """The updates with absent rows set to 0, so their values (NaN, 1e30 ...) never reach arithmetic."""
  return jax.tree.map(lambda u: jnp.where(_rows(mask, u), u, jnp.zeros_like(u)), updates)


def _zeros_if_none(n: jax.Array, tree: PyTree) -> PyTree:
  return jax.tree.map(lambda u: jnp.where(n > 0, u, jnp.zeros_like(u)), tree)


def _index(a: jax.Array, i: jax.Array) -> jax.Array:
  """`a[i]` along the leading axis for a traced scalar `i` (clipped into range)."""
  return lax.dynamic_index_in_dim(a, jnp.clip(i, 0, a.shape[0] - 1), axis=0, keepdims=False)


def _float_dtype(tree: PyTree) -> Any:
  return jnp.result_type(*[leaf.dtype for leaf in jax.tree.leaves(tree)], jnp.float32)


def _norms(diffs: PyTree) -> jax.Array:
  """`[C]` ‖row_c‖₂ over all leaves, scaled by the largest entry so entries up to the float maximum do not overflow."""
  leaves = jax.tree.leaves(diffs)
  dtype = _float_dtype(diffs)
  flat = [leaf.reshape(leaf.shape[0], -1).astype(dtype) for leaf in leaves]
  top = jnp.max(jnp.stack([jnp.max(jnp.abs(f), axis=1, initial=0) for f in flat]), axis=0)
  safe = jnp.where(top > 0, top, 1)
  total = sum(jnp.sum(jnp.square(f / safe[:, None]), axis=1) for f in flat)
  return top * jnp.sqrt(total)


def _pairwise_sq_distances(updates: PyTree, mask: jax.Array, n: jax.Array) -> jax.Array:
  """`[C, C]` ‖u_i − u_j‖² over all leaves, from one Gram matrix: O(d C²) time in a matmul, O(C² + d C) memory.

  The rows are first centered at their coordinate-wise median, a point inside
  the correct clients' cluster whatever the attackers send, so
  ‖a_i‖² + ‖a_j‖² − 2 a_i·a_j does not lose the small distances between
  correct clients to cancellation against a far-away center.
  """
  dtype = _float_dtype(updates)
  # Centered in `dtype` (float32 at least): a bfloat16 difference would round each entry to 2⁻⁹ of itself.
  centered = [jnp.where(_rows(mask, u), u.astype(dtype) - _median_of_sorted(_sorted(u, mask), n).astype(dtype), 0)
              .reshape(u.shape[0], -1) for u in jax.tree.leaves(updates)]
  gram = sum(jnp.matmul(a, a.T, precision=lax.Precision.HIGHEST) for a in centered)
  gram = 0.5 * (gram + gram.T)
  sq_norms = jnp.diagonal(gram)
  sq_dist = jnp.maximum(sq_norms[:, None] + sq_norms[None, :] - 2 * gram, 0)
  sq_dist = jnp.where(jnp.isnan(sq_dist), jnp.inf, sq_dist)  # inf − inf between two overflowing attackers
  return jnp.where(jnp.eye(gram.shape[0], dtype=bool), 0, sq_dist)


# ---- coordinate-wise rules ---------------------------------------------------------------------------------


def _sorted(u: jax.Array, mask: jax.Array) -> jax.Array:
  """Each coordinate's values sorted over the client axis, absent rows as +inf (after the n present ones)."""
  return sort_rows(jnp.where(_rows(mask, u), u, jnp.asarray(jnp.inf, u.dtype)))


def _median_of_sorted(s: jax.Array, n: jax.Array) -> jax.Array:
  """The median of the first n rows of `s` (the mean of the two middle values when n is even)."""
  lo, hi = _index(s, (n - 1) // 2), _index(s, n // 2)
  return 0.5 * lo + 0.5 * hi


def _mean_closest(s: jax.Array, n: jax.Array, center: jax.Array, keep: jax.Array) -> jax.Array:
  """Per coordinate, the mean of the `keep` values among the first n rows of the sorted `s` closest to `center`.

  Closeness is the key k(v) = (|v − center|, v): equal distances go to the
  smaller value, so the kept values do not depend on the order of the
  clients. With k* the keep-th smallest key and v* its value, they are
  every value with a key below k* and keep − #{k(v) < k*} copies of v*.
  Any `keep` consecutive sorted values hold a key ≥ k*, and the keep
  closest are such a window, so k* is the least, over the windows
  [a, a + keep), of the larger key of the window's two ends: O(d C) after
  the sort, no second sort. (The window itself is not used: with repeated
  values two windows can share that key and only one holds the closest.)
  """
  c = s.shape[0]
  pos = row_positions(s)
  padded = jnp.concatenate([s, jnp.full_like(s, jnp.inf)])
  left, right = s, lax.dynamic_slice_in_dim(padded, keep - 1, c, axis=0)  # the window's two ends, per start a
  d_left, d_right = jnp.abs(left - center), jnp.abs(right - center)
  right_farther = d_right >= d_left  # equal distances: the larger value has the larger key
  far_dist = jnp.where(right_farther, d_right, d_left)
  far_value = jnp.where(right_farther, right, left)
  valid = pos <= n - keep
  far_dist = jnp.where(valid, far_dist, jnp.inf)
  best_dist = jnp.min(far_dist, axis=0)
  best_value = jnp.min(jnp.where(valid & (far_dist == best_dist), far_value, jnp.inf), axis=0)
  dist = jnp.abs(s - center)
  below = (pos < n) & ((dist < best_dist) | ((dist == best_dist) & (s < best_value)))
  count = jnp.sum(below, axis=0, dtype=jnp.int32)
  total = jnp.sum(jnp.where(below, s, jnp.zeros_like(s)), axis=0)
  ties = (keep - count).astype(s.dtype)
  return (total + jnp.where(ties > 0, ties * best_value, 0)) / jnp.maximum(keep, 1).astype(s.dtype)


def marginal_median() -> Aggregator:
  """MarMed: the coordinate-wise median of the clients taking part (Xie, Koyejo & Gupta 2018).

      μ_j = median({(v_1)_j, …, (v_n)_j}),   j = 1 … d,

  the mean of the two middle values when n is even. Breakdown point 1/2 per
  coordinate: μ_j stays within the range of the correct values of
  coordinate j while fewer than half of them are corrupted, so it survives
  generalized (dimensional) Byzantine failures. Cost: a sort over the C rows
  per coordinate, O(d C log² C) work, O(d C) memory. Zero-weight rows sort
  after the n present values (as +inf) and are never read; every client
  taking part is one vote, whatever its weight.
  """

  def aggregate(updates, weights, state, key):
    del key
    check_stacked_updates(updates, weights, "marginal_median")
    mask = _voters(updates, weights)
    n = jnp.sum(mask, dtype=jnp.int32)
    out = jax.tree.map(lambda u: _median_of_sorted(_sorted(u, mask), n), updates)
    return _zeros_if_none(n, out), state

  return Aggregator(stateless_init, aggregate, traits=Traits(name="marginal_median", robust=True))


def mean_around_median(num_byzantine: int) -> Aggregator:
  """MeaMed: per coordinate, the mean of the n − q values closest to the median (Xie, Koyejo & Gupta 2018).

      μ_j = median_i (v_i)_j,   ρ_j = (1 / (n − q)) Σ_{i ∈ top-(n−q) closest to μ_j} (v_i)_j.

  With q ≥ the number of corrupted values in every coordinate and q < n/2,
  μ_j lies within the range of the correct values, and, as at least n − q
  values are correct, no kept value is farther from μ_j than the farthest
  correct value: ρ_j stays within [μ_j − r_j, μ_j + r_j], r_j = max over
  the correct i of |(v_i)_j − μ_j|, so it is dimensional-Byzantine
  resilient. A kept value may lie outside the range of the correct values
  (of {−10, 0, 0, 1, 2} with 2 corrupted, q = 1 keeps 2), never farther out
  than that. It averages n − q values where the median uses one or two
  (lower variance: faster convergence under attack). Ties in distance go
  to the smaller value, so the result does not depend on the order of the
  clients. Cost: one sort over the C rows per coordinate,
  O(d C log² C) work (the n − q closest values are a window of the sorted
  ones, found in O(d C)), O(d C) memory.

  Zero-weight rows never count: n is the number of clients taking part (a
  traced count); when n ≤ q only the value closest to the median is kept.

  Args:
    num_byzantine: q, the number of Byzantine values per coordinate to
      discard; a Python int with 0 ≤ q < C (checked when the round is traced).
  """
  q = check_int(num_byzantine, "mean_around_median: num_byzantine", 0)

  def aggregate(updates, weights, state, key):
    del key
    c = check_stacked_updates(updates, weights, "mean_around_median")
    if q >= c:
      raise ValueError(f"mean_around_median: num_byzantine = {q} must be smaller than the number of clients in the "
                       f"round, C = {c}; lower num_byzantine or aggregate more clients.")
    mask = _voters(updates, weights)
    n = jnp.sum(mask, dtype=jnp.int32)
    keep = jnp.maximum(n - q, 1)

    def leaf(u):
      s = _sorted(u, mask)
      return _mean_closest(s, n, _median_of_sorted(s, n), keep)

    return _zeros_if_none(n, jax.tree.map(leaf, updates)), state

  return Aggregator(stateless_init, aggregate, traits=Traits(name="mean_around_median", robust=True))


def _trim_counts(beta: float, c: int) -> jax.Array:
  """`[C + 1]` table b(n) = ⌊βn⌋ for n = 0 … C, computed in Python floats so the count is exact."""
  return jnp.asarray([math.floor(beta * n) for n in range(c + 1)], jnp.int32)


def trimmed_mean(beta: float) -> Aggregator:
  """Coordinate-wise β-trimmed mean (Yin, Chen, Ramchandran & Bartlett, ICML 2018, arXiv:1803.01498).

      b = ⌊βn⌋,   T_j = (1 / (n − 2b)) Σ_{k=b}^{n−b−1} (v_(k))_j,

  where (v_(0))_j ≤ … ≤ (v_(n−1))_j are coordinate j's values sorted: the b
  largest and b smallest are dropped. Tolerates up to b corrupted values per
  coordinate (breakdown point β < 1/2). Cost: a sort over the C rows per
  coordinate, O(d C log² C) work, O(d C) memory. Zero-weight rows sort last
  (+inf) and are never read; n counts only the clients taking part.

  Args:
    beta: β, the fraction trimmed at each end, 0 ≤ β < 1/2 (a Python float).
  """
  if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 0.5:
    raise ValueError(f"trimmed_mean: beta must be a float in [0, 0.5) (the fraction trimmed at each end); "
                     f"got {beta!r}.")
  beta = float(beta)

  def aggregate(updates, weights, state, key):
    del key
    c = check_stacked_updates(updates, weights, "trimmed_mean")
    mask = _voters(updates, weights)
    n = jnp.sum(mask, dtype=jnp.int32)
    b = _trim_counts(beta, c)[n]

    def leaf(u):
      s = _sorted(u, mask)
      pos = row_positions(u)
      kept = jnp.where((pos >= b) & (pos < n - b), s, jnp.zeros_like(s))
      return jnp.sum(kept, axis=0) / jnp.maximum(n - 2 * b, 1).astype(u.dtype)

    return _zeros_if_none(n, jax.tree.map(leaf, updates)), state

  return Aggregator(stateless_init, aggregate, traits=Traits(name="trimmed_mean", robust=True))


# ---- the geometric median ----------------------------------------------------------------------------------


def geometric_median(tol: float = 1e-6, max_iterations: int = 100, smoothing: float = 1e-6, *,
                     weighted: bool = False) -> Aggregator:
  """GeoMed: argmin_v Σ_i α_i ‖v − v_i‖₂, by smoothed Weiszfeld iterations (Xie, Koyejo & Gupta 2018).

      v⁰ = MarMed(v_1 … v_n),
      β_i = α_i / max(‖vᵗ − v_i‖, ν),   vᵗ⁺¹ = Σ_i β_i v_i / Σ_i β_i,

  in a `lax.while_loop` that stops when a step moves the estimate by at most
  `tol` times the mean distance to the clients, ‖vᵗ⁺¹ − vᵗ‖ ≤ tol · F(vᵗ⁺¹)
  with F(v) = Σ_i α_i ‖v − v_i‖ and Σ_i α_i = 1 (a test that does not depend
  on where the origin is), or after `max_iterations`. The smoothing ν keeps
  a client lying exactly at the estimate from dividing by zero (the form of
  Pillutla, Kakade & Harchaoui's RFA, arXiv:1912.13445); it only changes
  the objective within distance ν of a client. The start is the
  coordinate-wise median, not the mean: from a mean dragged 10²⁰ away by
  attackers, Weiszfeld would need hundreds of linearly converging steps.

  Breakdown point 1/2 in whole vectors: while fewer than half of the clients
  (of the weight, when weighted) are Byzantine the estimate stays within a
  bounded distance of the correct ones, so it resists the classic Byzantine
  model. It is not dimensional-Byzantine resilient: corrupt a few coordinates
  of every client and every v_i is far away. Cost: a sort per coordinate for
  the start, O(d C log² C), then O(d C) per iteration (distances and a
  weighted sum), times the iterations; O(d C) memory.

  Zero-weight rows have α_i = 0 and are set to 0 before any arithmetic, so
  their values never count. Distances are computed scaled, so attackers with
  entries up to the float maximum do not overflow to inf.

  Args:
    tol: the step, relative to the mean distance to the clients, at which
      the iterations stop (≥ 0).
    max_iterations: cap on the Weiszfeld iterations (a Python int ≥ 1).
    smoothing: ν > 0, the smallest distance a weight is divided by.
    weighted: if True, α_i = the client's weight n_k; if False (the default),
      α_i = 1 for every client taking part (one client, one vote).
  """
  if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
    raise ValueError(f"geometric_median: tol must be a float >= 0; got {tol!r}.")
  iterations = check_int(max_iterations, "geometric_median: max_iterations", 1)
  if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not smoothing > 0:
    raise ValueError(f"geometric_median: smoothing must be a float > 0 (the ν of the smoothed Weiszfeld step); "
                     f"got {smoothing!r}.")
  if not isinstance(weighted, bool):
    raise TypeError(f"geometric_median: weighted must be a bool; got {weighted!r}.")

  def aggregate(updates, weights, state, key):
    del key
    check_stacked_updates(updates, weights, "geometric_median")
    mask = _voters(updates, weights)
    n = jnp.sum(mask, dtype=jnp.int32)
    x = _present(updates, mask)
    dtype = _float_dtype(x)
    alpha = jnp.where(mask, weights if weighted else 1, 0).astype(dtype)
    alpha = alpha / jnp.where(jnp.sum(alpha) > 0, jnp.sum(alpha), 1)

    def combine(coefficients):
      total = jnp.sum(coefficients)
      return jax.tree.map(
          lambda u: jnp.tensordot(coefficients.astype(u.dtype), u, axes=1) / jnp.where(total > 0, total, 1).astype(
              u.dtype), x)

    def distances(v):
      return _norms(jax.tree.map(lambda u, c: u - c, x, v))

    def cond(carry):
      _, _, objective, step, i = carry
      return (i < iterations) & ~(jnp.isfinite(objective) & (step <= tol * objective))

    def body(carry):
      v, dist, _, _, i = carry
      new = combine(alpha / jnp.maximum(dist, smoothing))
      step = _norms(jax.tree.map(lambda a, b: (a - b)[None], new, v))[0]
      dist = distances(new)
      return new, dist, jnp.sum(alpha * dist), step, i + 1

    v0 = _zeros_if_none(n, jax.tree.map(lambda u: _median_of_sorted(_sorted(u, mask), n), x))
    d0 = distances(v0)
    start = (v0, d0, jnp.sum(alpha * d0), jnp.asarray(jnp.inf, dtype), jnp.zeros((), jnp.int32))
    v, *_ = lax.while_loop(cond, body, start)
    return _zeros_if_none(n, v), state

  return Aggregator(stateless_init, aggregate, traits=Traits(name="geometric_median", robust=True))


# ---- Krum, Multi-Krum, Bulyan ------------------------------------------------------------------------------


def _krum_order(sq_dist: jax.Array, candidates: jax.Array, f: int) -> jax.Array:
  """`[C]` row indices by increasing Krum score among `candidates` (r of them); non-candidates last.

  The score of i is Σ of the squared distances to its k nearest other
  candidates, k = r − f − 2 (Blanchard et al.), clipped into [1, r − 1] so
  small candidate sets (the last steps of Bulyan, rounds with few clients)
  still rank by their nearest neighbours. Equal scores (with one neighbour
  the two closest vectors score alike by construction) are settled by the
  squared distance to the (k+1)-th nearest candidate, a choice that does
  not depend on how the clients are stacked; then by row.
  """
  c = sq_dist.shape[0]
  r = jnp.sum(candidates, dtype=jnp.int32)
  k = jnp.minimum(jnp.maximum(r - f - 2, 1), r - 1)
  others = candidates[None, :] & ~jnp.eye(c, dtype=bool)
  nearest = jnp.sort(jnp.where(others, sq_dist, jnp.inf), axis=1)
  position = jnp.arange(c)[None, :]
  scores = jnp.where(candidates, jnp.sum(jnp.where(position < k, nearest, 0), axis=1), jnp.inf)
  next_nearest = jnp.where(candidates, jnp.sum(jnp.where(position == k, nearest, 0), axis=1), jnp.inf)
  _, _, order = lax.sort((scores, next_nearest, jnp.arange(c)), num_keys=2)
  return order


def _check_krum_rows(name: str, f: int, c: int, minimum: int, condition: str) -> None:
  if c < minimum:
    raise ValueError(f"{name}: num_byzantine = {f} needs {condition} clients, at least {minimum}; the round has "
                     f"C = {c} rows. Lower num_byzantine or aggregate more clients.")


def krum(num_byzantine: int) -> Aggregator:
  """Krum (Blanchard, El Mhamdi, Guerraoui & Stainer, NeurIPS 2017): the client update with the least score.

      s(i) = Σ_{i→j} ‖v_i − v_j‖²,   Krum = v_{i*},  i* = argmin_i s(i),

  where i → j ranges over the n − f − 2 updates closest to v_i (j ≠ i).
  (α, f)-Byzantine resilient for n > 2f + 2: the chosen vector lies near
  the correct ones while at most f clients (whole vectors) are Byzantine.
  Cost: the C² pairwise distances from one Gram matrix, O(d C²) time in a
  matmul (rows centered at their coordinate-wise median first, O(d C log² C),
  so small distances survive float32), O(C² + d C) memory; a sort of each
  row, O(C² log C).

  Zero-weight rows are neither candidates nor neighbours; n counts the
  clients taking part, and when n ≤ 2f + 2 (rows dropped this round) the
  neighbour count is clipped into [1, n − 1]. Equal scores are settled by
  the squared distance to the (k+1)-th nearest client, so the choice does
  not depend on the order of the clients.

  Args:
    num_byzantine: f, a Python int ≥ 0; the round needs C > 2f + 2 rows
      (checked when traced).
  """
  f = check_int(num_byzantine, "krum: num_byzantine", 0)

  def aggregate(updates, weights, state, key):
    del key
    c = check_stacked_updates(updates, weights, "krum")
    _check_krum_rows("krum", f, c, 2 * f + 3, "n > 2·num_byzantine + 2")
    mask = _voters(updates, weights)
    x = _present(updates, mask)
    best = _krum_order(_pairwise_sq_distances(x, mask, jnp.sum(mask)), mask, f)[0]
    out = jax.tree.map(lambda u: _index(u, best), x)
    return _zeros_if_none(jnp.sum(mask), out), state

  return Aggregator(stateless_init, aggregate, traits=Traits(name="krum", robust=True))


def multi_krum(num_byzantine: int, m: int | None = None) -> Aggregator:
  """Multi-Krum (Blanchard et al., NeurIPS 2017): the mean of the m updates with the least Krum scores.

      s(i) = Σ_{i→j} ‖v_i − v_j‖² (as in `krum`),   Multi-Krum = (1/m) Σ_{i ∈ m least s(i)} v_i.

  m = 1 is Krum; m = n is the mean. Same resilience condition as Krum
  (n > 2f + 2) and cost (O(d C²)). Scores are computed once, among the
  clients taking part (ties settled as in `krum`); zero-weight rows are
  never selected nor neighbours.

  Args:
    num_byzantine: f, a Python int ≥ 0; the round needs C > 2f + 2 rows.
    m: how many updates to average, a Python int with 1 ≤ m ≤ C; None
      (the default): m = n − f, the count of clients presumed correct.
      When fewer than m clients take part, all of them are averaged.
  """
  f = check_int(num_byzantine, "multi_krum: num_byzantine", 0)
  if m is not None:
    check_int(m, "multi_krum: m", 1)

  def aggregate(updates, weights, state, key):
    del key
    c = check_stacked_updates(updates, weights, "multi_krum")
    _check_krum_rows("multi_krum", f, c, 2 * f + 3, "n > 2·num_byzantine + 2")
    if m is not None and m > c:
      raise ValueError(f"multi_krum: m = {m} must be at most the number of clients in the round, C = {c}.")
    mask = _voters(updates, weights)
    n = jnp.sum(mask, dtype=jnp.int32)
    x = _present(updates, mask)
    order = _krum_order(_pairwise_sq_distances(x, mask, n), mask, f)
    count = jnp.maximum(n - f, 1) if m is None else jnp.minimum(m, n)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(c))
    chosen = (rank < count) & mask
    coefficients = chosen / jnp.maximum(jnp.sum(chosen), 1)
    out = jax.tree.map(lambda u: jnp.tensordot(coefficients.astype(u.dtype), u, axes=1), x)
    return _zeros_if_none(n, out), state

  return Aggregator(stateless_init, aggregate, traits=Traits(name="multi_krum", robust=True))


def bulyan(num_byzantine: int) -> Aggregator:
  """Bulyan (El Mhamdi, Guerraoui & Rouault, ICML 2018, arXiv:1802.07927) on top of Krum.

      1. S ← ∅; repeat θ = n − 2f times: add to S the Krum choice among the
         updates not yet in S (each Krum with f, among the r remaining);
      2. per coordinate j, the mean of the β = θ − 2f values of S closest to
         the coordinate-wise median of S (`mean_around_median` on S).

  Strong Byzantine resilience for n ≥ 4f + 3: each coordinate of the result
  is within the range of correct values, and the vector step keeps out
  attackers that hide in high dimension (what Krum alone lets through).
  Cost: θ Krum rounds on the C² distance matrix, O(d C² + C³ log C) time,
  then MeaMed's sort per coordinate over C rows, O(d C log² C); O(C² + d C)
  memory.

  Zero-weight rows are never selected. With n < 4f + 3 clients taking part
  (rows dropped this round), θ = max(n − 2f, 1) and β = max(θ − 2f, 1). The
  Krum neighbour count r − f − 2 of the late selections (r remaining) is
  clipped into [1, r − 1] and ties are settled as in `krum`.

  Args:
    num_byzantine: f, a Python int ≥ 0; the round needs C ≥ 4f + 3 rows.
  """
  f = check_int(num_byzantine, "bulyan: num_byzantine", 0)

  def aggregate(updates, weights, state, key):
    del key
    c = check_stacked_updates(updates, weights, "bulyan")
    _check_krum_rows("bulyan", f, c, 4 * f + 3, "n ≥ 4·num_byzantine + 3")
    mask = _voters(updates, weights)
    n = jnp.sum(mask, dtype=jnp.int32)
    x = _present(updates, mask)
    sq_dist = _pairwise_sq_distances(x, mask, n)
    theta = jnp.maximum(n - 2 * f, 1)

    def select(t, carry):
      remaining, chosen = carry
      best = _krum_order(sq_dist, remaining, f)[0]
      pick = (jnp.arange(c) == best) & remaining & (t < theta)
      return remaining & ~pick, chosen | pick

    _, chosen = lax.fori_loop(0, c - 2 * f, select, (mask, jnp.zeros_like(mask)))
    keep = jnp.maximum(theta - 2 * f, 1)

    def leaf(u):
      s = _sorted(u, chosen)
      return _mean_closest(s, theta, _median_of_sorted(s, theta), keep)

    return _zeros_if_none(n, jax.tree.map(leaf, x)), state

  return Aggregator(stateless_init, aggregate, traits=Traits(name="bulyan", robust=True))


# ---- centered clipping -------------------------------------------------------------------------------------


class CenteredClippingState(NamedTuple):
  """State of `centered_clipping`.

  Attributes:
    center: the starting point v⁰ of the next round's clipping iterations
      (the last aggregate, or its running average with `momentum`), shaped
      like the model.
  """

  center: PyTree


def centered_clipping(tau: float, iterations: int = 1, momentum: float = 0.0) -> Aggregator:
  """Centered clipping (Karimireddy, He & Jaggi, ICML 2021, arXiv:2012.10333).

      v⁰ = c_t,   vˡ⁺¹ = vˡ + (1/n) Σ_i (v_i − vˡ) · min(1, τ / ‖v_i − vˡ‖),   l = 0 … L − 1,
      Δ = v^L,    c_{t+1} = m · c_t + (1 − m) · v^L,

  where c_t, the center, lives in the aggregator state (zeros at the start).
  With m = 0 (the default) the center is the last aggregate, the paper's
  choice of starting point; m > 0 keeps a running average. A Byzantine
  client moves each iteration by at most τ/n, so with a minority of
  Byzantine clients the error is bounded by the spread of the correct ones
  plus O(τ · fraction Byzantine). Cost: O(d C) per iteration, O(d C) memory.

  Zero-weight rows take no part: n counts the clients with weight > 0, each
  one vote; absent rows are zeroed before any arithmetic.

  Args:
    tau: τ > 0, the clipping radius (a float, or a traced scalar for sweeps).
    iterations: L, clipping iterations per round (a Python int ≥ 1).
    momentum: m in [0, 1), the weight of the old center in the new one.
  """
  if isinstance(tau, (int, float)) and (isinstance(tau, bool) or not tau > 0):
    raise ValueError(f"centered_clipping: tau must be > 0 (the clipping radius); got {tau!r}.")
  steps = check_int(iterations, "centered_clipping: iterations", 1)
  if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
    raise ValueError(f"centered_clipping: momentum must be a float in [0, 1); got {momentum!r}.")

  def init(params):
    return CenteredClippingState(center=jax.tree.map(jnp.zeros_like, params))

  def aggregate(updates, weights, state, key):
    del key
    check_stacked_updates(updates, weights, "centered_clipping")
    mask = _voters(updates, weights)
    n = jnp.sum(mask, dtype=jnp.int32)
    x = _present(updates, mask)
    share = mask.astype(_float_dtype(x)) / jnp.maximum(n, 1)

    def clip_step(_, v):
      diffs = jax.tree.map(lambda u, c: u - c, x, v)
      norms = _norms(diffs)
      scale = share * jnp.where(norms > tau, tau / jnp.where(norms > 0, norms, 1), 1)
      return jax.tree.map(lambda c, d: c + jnp.tensordot(scale.astype(d.dtype), d, axes=1), v, diffs)

    start = jax.tree.map(lambda c, u: c.astype(u.dtype), state.center, jax.tree.map(lambda u: u[0], x))
    v = lax.fori_loop(0, steps, clip_step, start)
    center = jax.tree.map(lambda c, a: (momentum * c + (1 - momentum) * a).astype(c.dtype), state.center, v)
    return _zeros_if_none(n, v), CenteredClippingState(center=center)

  return Aggregator(init, aggregate, traits=Traits(name="centered_clipping", robust=True))
