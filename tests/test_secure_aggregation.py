"""Simulated secure aggregation (`fo.privacy.secure_aggregation`) against Python integers and NumPy uint64 sums.

The claims of Bonawitz et al. (CCS 2017) as the simulation should meet them:
each masked upload alone is uniform noise, the survivors' uploads unmask to
exactly the sum of their encodings in Z_(2^32), dropped clients' masks are
recovered from any t Shamir shares while t − 1 shares say nothing, too few
survivors abort the round, and the decoded sum is the inner aggregator's up to
the fixed-point rounding.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.privacy import secure as S

P = fo.privacy
A = fo.aggregators
PRIME = 2**31 - 1
RING = 2**32


def _ring_sum(rows: np.ndarray) -> np.ndarray:
  """Σ over axis 0 mod 2³² in uint64 (no wrap-around before the reduction)."""
  return (np.asarray(rows, np.uint64).sum(axis=0, dtype=np.uint64) % RING).astype(np.uint64)


def _lagrange_reference(points: list[tuple[int, int]], at: int = 0) -> int:
  """f(at) mod p of the polynomial of degree < len(points) through `points`, in Python integers."""
  total = 0
  for i, (xi, yi) in enumerate(points):
    num, den = 1, 1
    for j, (xj, _) in enumerate(points):
      if j != i:
        num = num * (at - xj) % PRIME
        den = den * (xi - xj) % PRIME
    total = (total + yi * num * pow(den, PRIME - 2, PRIME)) % PRIME
  return total


def test_field_arithmetic_and_key_agreement_match_python_integers():
  rng = np.random.default_rng(0)
  a = np.concatenate([[PRIME - 1, PRIME - 1, 0, 1, 65535, 65536], rng.integers(0, PRIME, 20_000)])
  b = np.concatenate([[PRIME - 1, 1, PRIME - 1, 0, 65535, 65536], rng.integers(0, PRIME, 20_000)])
  got = np.asarray(S._mul_mod(jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32)))
  np.testing.assert_array_equal(got.astype(np.int64), (a.astype(object) * b.astype(object)) % PRIME)
  e = rng.integers(0, PRIME, 200)
  got = np.asarray(S._pow_mod(jnp.asarray(a[:200], jnp.uint32), jnp.asarray(e, jnp.uint32)))
  assert [int(g) for g in got] == [pow(int(x), int(y), PRIME) for x, y in zip(a[:200], e)]
  # g = 7 generates Z_p^*: g^((p−1)/q) ≠ 1 for every prime q | p − 1 = 2·3²·7·11·31·151·331.
  assert 2 * 9 * 7 * 11 * 31 * 151 * 331 == PRIME - 1
  assert all(pow(P.secure.GENERATOR, (PRIME - 1) // q, PRIME) != 1 for q in (2, 3, 7, 11, 31, 151, 331))
  # Diffie–Hellman: pk_b^sk_a = pk_a^sk_b.
  sk = jnp.asarray(rng.integers(1, PRIME - 1, (2, 50)), jnp.uint32)
  pk = S._pow_mod(jnp.uint32(7), sk)
  np.testing.assert_array_equal(S._pow_mod(pk[1], sk[0]), S._pow_mod(pk[0], sk[1]))


def test_any_t_of_n_shamir_shares_give_the_secret_and_t_minus_1_do_not_determine_it():
  n, t = 7, 4
  secrets = np.array([0, 1, 123_456_789, PRIME - 1], np.int64)
  xs = np.arange(1, n + 1)
  shares = np.asarray(P.shamir_share(jax.random.key(0), jnp.asarray(secrets, jnp.uint32), t, jnp.asarray(xs)))
  assert shares.shape == (4, n) and shares.max() < PRIME
  reconstruct = jax.jit(P.shamir_reconstruct)
  for subset in itertools.combinations(range(n), t):  # all 35 subsets of t holders
    cols = list(subset)
    got = np.asarray(reconstruct(jnp.asarray(shares[:, cols]), jnp.asarray(xs[cols], jnp.uint32)))
    want = [_lagrange_reference([(int(xs[j]), int(shares[s, j])) for j in cols]) for s in range(4)]
    np.testing.assert_array_equal(got, secrets)
    assert want == list(secrets)
  # t − 1 shares: for every candidate secret s' there is a polynomial of degree t − 1 through (0, s') and
  # the shares, and exactly one: the shares are consistent with any secret, each equally (t − 1 points plus
  # the secret fix the polynomial, whose other coefficients are uniform).
  few = [(int(xs[j]), int(shares[2, j])) for j in (0, 3, 5)]
  for candidate in (0, 42, secrets[2], PRIME - 1):
    through = few + [(0, int(candidate))]
    assert all(_lagrange_reference(through, at=x) == y for x, y in few)
    assert _lagrange_reference(through, at=0) == candidate
  wrong = np.asarray(reconstruct(jnp.asarray(shares[:, [0, 3, 5]]), jnp.asarray(xs[[0, 3, 5]], jnp.uint32)))
  assert not np.array_equal(wrong, secrets)
  # Through a mask over all n shares (as when t is traced): any t of them, and t − 1 do not suffice.
  masked = jax.jit(P.shamir_reconstruct)
  for subset in ((0, 1, 2, 3), (1, 3, 5, 6), (0, 2, 4, 6)):
    used = jnp.asarray(np.isin(np.arange(n), subset))
    np.testing.assert_array_equal(masked(jnp.asarray(shares), jnp.asarray(xs, jnp.uint32), used), secrets)
  few_used = jnp.asarray(np.isin(np.arange(n), (0, 3, 5)))
  np.testing.assert_array_equal(masked(jnp.asarray(shares), jnp.asarray(xs, jnp.uint32), few_used), wrong)
  # One share of a threshold-2 sharing is uniform whatever the secret: a chi-square over 8 bins.
  keys = jax.random.split(jax.random.key(1), 4000)
  share = jax.jit(jax.vmap(lambda k, s: P.shamir_share(k, s[None], 2, jnp.asarray([3]))[0, 0], in_axes=(0, None)))
  for secret in (0, PRIME - 1):
    one = share(keys, jnp.uint32(secret))
    counts = np.bincount(np.asarray(one, np.int64) * 8 // PRIME, minlength=8)
    assert np.sum((counts - 500) ** 2 / 500) < 24.3  # χ²(7) at 1 − 1e-3


def test_shamir_shares_are_field_elements_whatever_the_secrets_type_and_the_x64_flag():
  """Secrets given as Python integers, and a run with x64 on, give the uint32 shares of the same polynomial: the
  coefficients come from 32-bit words whatever JAX's default widths."""
  secrets, xs, key = [PRIME - 1, 0, 5, 2**30 + 7], np.arange(1, 6), jax.random.key(3)
  want = P.shamir_share(key, jnp.asarray(secrets, jnp.uint32), 3, jnp.asarray(xs, jnp.uint32))
  from_ints = P.shamir_share(key, secrets, 3, jnp.asarray(xs, jnp.uint32))
  with jax.enable_x64(True):
    wide = P.shamir_share(key, jnp.asarray(secrets, jnp.uint32), 3, jnp.asarray(xs, jnp.uint32))
  for got in (from_ints, wide):
    assert got.dtype == jnp.uint32
    np.testing.assert_array_equal(got, want)
  shares = np.asarray(want, np.int64)
  assert [_lagrange_reference([(int(xs[j]), int(shares[k, j])) for j in (0, 2, 4)]) for k in range(4)] == secrets


def _round(c=9, length=3000, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(c, length)).astype(np.float32) * 0.1
  encoded, _ = P.fixed_point_encode(jnp.asarray(x), jax.random.key(seed), frac_bits=16, bound=1.0)
  return x, encoded


# One program for every `_round()` ([9, 3000]) in this file.
_secure_sum = jax.jit(lambda e, m, d, k: P.secure_sum(e, m, d, k, threshold=3))


def test_each_masked_upload_looks_uniform_and_the_uploads_unmask_to_exactly_the_sum_of_encodings():
  x, encoded = _round()
  c, length = x.shape
  result = _secure_sum(encoded, jnp.ones(c, bool), jnp.zeros(c, bool), jax.random.key(5))
  uploads = np.asarray(result.uploads, np.float64)
  for k in range(c):
    u = uploads[k] / RING
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / length)  # uniform on [0, 1): mean ½, sd 1/√12
    assert abs(u.var() - 1 / 12) < 0.01
    assert abs(np.corrcoef(uploads[k], x[k])[0, 1]) < 5 / np.sqrt(length)
    decoded = np.asarray(P.fixed_point_decode(result.uploads[k], frac_bits=16))
    assert np.median(np.abs(decoded - x[k])) > 1_000  # one upload decodes to garbage (|x| ≤ 1 here)
  np.testing.assert_array_equal(np.asarray(result.total, np.uint64), _ring_sum(encoded))
  assert bool(result.ok) and int(result.num_dropped) == 0
  # The pairwise masks alone cancel exactly in the ring; the self masks do not (the server removes them).
  sk = jnp.asarray(np.random.default_rng(1).integers(1, PRIME - 1, c), jnp.uint32)
  nonce = jnp.asarray([12345, 678], jnp.uint32)
  masks, _ = S._masks(nonce, sk, S._pow_mod(jnp.uint32(7), sk), jnp.ones(c, bool), 64)  # pair masks only
  np.testing.assert_array_equal(_ring_sum(masks), np.zeros(64, np.uint64))
  assert np.all(np.asarray(masks) != 0)
  assert not np.array_equal(_ring_sum(result.uploads), _ring_sum(encoded))


def test_dropout_recovery_gives_exactly_the_survivors_sum():
  x, encoded = _round(seed=3)
  rng = np.random.default_rng(4)
  member = np.ones(9, bool)
  member[7] = False  # a slot with weight 0: not in the key exchange at all
  for trial in range(6):
    dropped = rng.random(9) < 0.4
    survivors = member & ~dropped
    result = _secure_sum(encoded, jnp.asarray(member), jnp.asarray(dropped), jax.random.key(10 + trial))
    assert int(result.num_dropped) == int(np.sum(dropped & member))
    if survivors.sum() >= 3:
      assert bool(result.ok)
      np.testing.assert_array_equal(np.asarray(result.total, np.uint64), _ring_sum(np.asarray(encoded)[survivors]))
    else:
      assert not bool(result.ok)


def test_a_member_s_masked_upload_does_not_depend_on_whether_it_drops_later():
  """Dropping comes after the key exchange and the masking: a dropped member's upload (had it arrived) is the one
  it would have sent, its self mask PRG(b_d) included, so the sk_d that the server reconstructs does not unmask it.
  Same key, with and without drops: every member's upload is the same."""
  _, encoded = _round(seed=5)
  member = jnp.ones(9, bool).at[7].set(False)
  kept = _secure_sum(encoded, member, jnp.zeros(9, bool), jax.random.key(3))
  dropped = jnp.zeros(9, bool).at[jnp.asarray([2, 5])].set(True)
  late = _secure_sum(encoded, member, dropped, jax.random.key(3))
  assert bool(late.ok) and int(late.num_dropped) == 2
  np.testing.assert_array_equal(np.asarray(late.uploads), np.asarray(kept.uploads))
  assert not np.any(np.asarray(late.uploads)[7])  # the non-member sends nothing


def test_fixed_point_decoding_is_within_c_times_2_to_the_minus_f_and_exact_on_dyadic_values():
  rng = np.random.default_rng(6)
  c, f = 12, 10
  x = rng.normal(size=(c, 500)).astype(np.float32) * 0.3
  encoded, clipped = P.fixed_point_encode(jnp.asarray(x), jax.random.key(0), frac_bits=f, bound=1.0)
  total = P.fixed_point_decode(jnp.sum(encoded, axis=0, dtype=jnp.uint32), frac_bits=f)
  want = np.clip(x.astype(np.float64), -1, 1).sum(0)  # coordinates outside [−B, B] = [−1, 1] are clipped
  assert np.max(np.abs(np.asarray(total, np.float64) - want)) <= c * 2.0**-f
  assert int(clipped) == int(np.sum(np.abs(x) > 1)) > 0
  # Multiples of 2^−f are encoded exactly: the ring sum is the integer sum.
  ints = rng.integers(-2**f, 2**f, size=(c, 500))
  exact, _ = P.fixed_point_encode(jnp.asarray(ints * 2.0**-f, jnp.float32), jax.random.key(1), frac_bits=f, bound=1.0)
  np.testing.assert_array_equal(np.asarray(exact).view(np.int32), ints)


def test_stochastic_rounding_is_unbiased():
  x = jnp.asarray([0.3, -0.7, 1e-4, 0.123456, -0.99999], jnp.float32)
  f = 4  # coarse grid 1/16, so a biased rounding would show
  keys = jax.random.split(jax.random.key(0), 20_000)
  q = jax.vmap(lambda k: P.fixed_point_encode(x, k, frac_bits=f, bound=1.0)[0])(keys)
  values = np.asarray(q).view(np.int32).astype(np.float64)
  scaled = np.asarray(x, np.float64) * 2**f
  assert np.all(np.abs(values - scaled) < 1)
  se = np.sqrt(np.maximum(values.var(axis=0), 1e-12) / len(keys))
  assert np.all(np.abs(values.mean(axis=0) - scaled) < 4 * se + 1e-9)


def _updates(c=10, seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(c, 4, 3)) * 0.2, jnp.float32),
          "b": jnp.asarray(rng.normal(size=(c, 3)) * 0.2, jnp.float32)}


# mean() counts weight > 0 only, so the weight can carry the drop set: 2 = drops (a traced input). One secure mean,
# one jitted aggregate for the [10]-client `_updates()` of every test below.
_SECURE_MEAN = P.secure_aggregation(A.mean(), frac_bits=16, bound=1.0, threshold=4, dropout=lambda key, w: w > 1.5)
_secure_mean_aggregate = jax.jit(_SECURE_MEAN.aggregate)


def test_the_aggregate_is_the_inner_aggregate_up_to_fixed_point_rounding_with_and_without_dropouts():
  c, f = 10, 16
  u = _updates(c)
  agg, aggregate = _SECURE_MEAN, _secure_mean_aggregate
  inner = A.mean()
  rng = np.random.default_rng(1)
  for trial in range(4):
    drops = rng.random(c) < 0.35 if trial else np.zeros(c, bool)
    weights = np.where(drops, 2.0, 1.0)
    weights[3] = 0.0  # not taking part
    out, state = aggregate(u, jnp.asarray(weights), agg.init(None), jax.random.key(trial))
    taking_part = (weights == 1.0)
    want, _ = inner.aggregate(u, jnp.asarray(taking_part, jnp.float32), inner.init(None), jax.random.key(0))
    n = taking_part.sum()
    assert n >= 4  # t = 4 survivors needed (this seed's drop sets leave enough)
    for name in u:  # Σ over n survivors is within n·2^−f; the mean divides by n
      np.testing.assert_allclose(out[name], want[name], atol=2.0**-f + 1e-6, rtol=0)
    assert int(state.num_dropped) == int(np.sum(drops & (weights > 0))) == int(np.sum(drops)) - int(drops[3])
    assert int(state.num_survivors) == n and bool(state.recovered) == (int(state.num_dropped) > 0)
    assert float(state.upload_bits) == 32 * (15 + 1) + 64 + 96 * (np.sum(weights > 0) - 1)


def test_fewer_than_t_survivors_reject_the_round_and_change_nothing():
  c = 10
  u = _updates(c)
  agg = _SECURE_MEAN
  drops = jnp.asarray([2.0] * 7 + [1.0] * 3)  # weight 2: drops (`_SECURE_MEAN`)
  out, state = _secure_mean_aggregate(u, drops, agg.init(None), jax.random.key(0))  # 3 survivors < t = 4
  assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree.leaves(out))  # nothing decodable is released
  assert int(state.num_survivors) == 3 and not bool(state.recovered)
  # Through FedAvg (the non-finite guard): the round is rejected, model and aggregator state unchanged.
  params, batches = _fedavg_inputs(np.random.default_rng(0))
  batches = batches.replace(weight=jnp.asarray([2.0] * 5 + [1.0] * 3))  # weight 2: drops; 3 survivors < t = 4
  s0 = _fedavg(_SECURE_FEDAVG, momentum=0.9).init(params, jax.random.key(0))
  s1 = _secure_fedavg_step("vmap")(0.9, s0, batches)
  assert not bool(s1.metrics["round_accepted"]) and int(s1.round) == 1 and int(s1.metrics["num_clients"]) == 0
  for a, b in zip(jax.tree.leaves((s1.params, s1.server_opt_state, s1.aggregator_state)),
                  jax.tree.leaves((s0.params, s0.server_opt_state, s0.aggregator_state))):
    np.testing.assert_array_equal(a, b)


def test_with_dp_mean_the_same_key_gives_dp_mean_alone_with_room_left_for_the_rounding():
  """The same noise as `dp_mean` alone (same key), added to the securely summed updates clipped to C − √P·2^−f
  (a float64 transcription) up to the fixed-point rounding; the adaptive clip norm's count is `dp_mean`'s own."""
  c, f, m, clip = 10, 16, 10.0, 0.5
  u = _updates(c, seed=2)
  weights = jnp.ones(c).at[4].set(0.0)
  dp = P.dp_mean(clip, 1.0, expected_clients=m, adaptive=P.AdaptiveClipping(0.5, 0.2, 3.0))
  agg = P.secure_aggregation(dp, frac_bits=f, bound=0.5)
  assert agg.always_releases
  key = jax.random.key(3)
  got, state = jax.jit(agg.aggregate)(u, weights, agg.init(None), key)
  dp_aggregate = jax.jit(dp.aggregate)
  want, want_state = dp_aggregate(u, weights, dp.init(None), key)
  noise, _ = dp_aggregate(jax.tree.map(jnp.zeros_like, u), weights, dp.init(None), key)  # N(0, (σ_Δ C)²) / m alone
  flat = np.concatenate([np.asarray(u[name], np.float64).reshape(c, -1) for name in u], axis=1)  # [C, P = 15]
  norms = np.linalg.norm(flat, axis=1, keepdims=True)
  taking_part = np.asarray(weights)[:, None] > 0
  room = clip - np.sqrt(flat.shape[1]) * 2.0**-f
  assert np.sum(norms[taking_part[:, 0]] > clip) == 8  # 8 of the 9 members are clipped
  secure_sum_ = np.sum(np.where(taking_part, flat * np.minimum(1, room / norms), 0), axis=0)
  plain_sum = np.sum(np.where(taking_part, flat * np.minimum(1, clip / norms), 0), axis=0)
  got_flat = np.concatenate([np.asarray(got[name], np.float64).reshape(-1) for name in u])
  want_flat = np.concatenate([np.asarray(want[name], np.float64).reshape(-1) for name in u])
  noise_flat = np.concatenate([np.asarray(noise[name], np.float64).reshape(-1) for name in u])
  np.testing.assert_allclose(want_flat - noise_flat, plain_sum / m, atol=1e-6, rtol=0)  # the same noise draw
  # The sum of 9 encodings is within 9·2^−f of the clipped sum before dividing by m.
  np.testing.assert_allclose(got_flat - noise_flat, secure_sum_ / m, atol=c * 2.0**-f / m + 1e-6, rtol=0)
  # Clipping to C itself is farther away (in L2: the rounding errors are independent, the room is not).
  off = np.linalg.norm(got_flat - noise_flat - secure_sum_ / m)
  assert 2 * off < np.linalg.norm(got_flat - noise_flat - plain_sum / m)  # 5.5e-6 against 1.4e-5
  np.testing.assert_allclose(state.inner.noisy_fraction, want_state.noisy_fraction, atol=1e-6)
  np.testing.assert_allclose(state.inner.clip_norm, want_state.clip_norm, rtol=1e-6)
  # A round without members still releases dp_mean's noise (always_releases), as dp_mean alone does.
  nobody = jnp.zeros(c)
  got, state = jax.jit(agg.aggregate)(u, nobody, agg.init(None), key)
  want, want_state = dp_aggregate(u, nobody, dp.init(None), key)
  for name in u:
    np.testing.assert_allclose(got[name], want[name], atol=1e-7, rtol=0)
  assert np.all(np.isfinite(np.asarray(got["w"]))) and float(np.abs(np.asarray(got["w"])).max()) > 0
  np.testing.assert_allclose(state.inner.clip_norm, want_state.clip_norm, rtol=1e-6)


def _loss(params, batch):
  return 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])


# FedAvg's secure mean (8 clients): weight 2 drops (as `_SECURE_MEAN`); t = 4.
_SECURE_FEDAVG = P.secure_aggregation(A.mean(), frac_bits=20, bound=4.0, threshold=4, dropout=lambda key, w: w > 1.5)


def _fedavg(aggregator, client_map="vmap", momentum=0.0):
  """FedAvg with local SGD(0.05) and server SGD(1) with `momentum` (may be traced; 0 is plain SGD, exactly)."""
  return fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.05), aggregator=aggregator, client_map=client_map,
                              server_optimizer=optax.sgd(1.0, momentum=momentum))


@functools.cache
def _secure_fedavg_step(client_map):
  """`step(momentum, state, batches)` of `_fedavg(_SECURE_FEDAVG, client_map)`, jitted once per client map for the
  tests below (the server momentum a traced argument)."""
  return jax.jit(lambda momentum, state, batches: _fedavg(_SECURE_FEDAVG, client_map, momentum).step(state, batches))


def _fedavg_inputs(rng, c=8, s=2, b=4, d=3):
  x = rng.normal(size=(c, s, b, d)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=(c, s, b))).astype(np.float32)
  batches = fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.ones((c, s, b), bool),
                             weight=jnp.ones(c), client_id=jnp.arange(c, dtype=jnp.int32))
  return {"w": jnp.zeros(d), "b": jnp.zeros(())}, batches


def test_fedavg_with_a_secure_mean_trains_like_the_plain_mean_in_stacked_and_loop_modes():
  params, batches = _fedavg_inputs(np.random.default_rng(7))  # weight 1 everywhere: nobody drops
  assert _SECURE_FEDAVG.streaming is None  # the masks need each client's index and the round key: stacked form only
  finals = {}
  for name, mode in (("plain", "vmap"), ("secure", "vmap"), ("secure-loop", "sequential")):
    if name == "plain":
      step = jax.jit(lambda momentum, state, b: _fedavg(A.mean(), momentum=momentum).step(state, b))
    else:
      step = _secure_fedavg_step(mode)
    state = _fedavg(A.mean() if name == "plain" else _SECURE_FEDAVG, mode).init(params, jax.random.key(1))
    for _ in range(4):
      state = step(0.0, state, batches)  # server SGD(1), momentum 0: plain SGD
    finals[name] = state
  assert bool(finals["secure"].metrics["round_accepted"]) and int(finals["secure"].metrics["num_clients"]) == 8
  for name in ("w", "b"):
    np.testing.assert_allclose(finals["secure"].params[name], finals["plain"].params[name], atol=4 * 8 * 2.0**-20)
    np.testing.assert_allclose(finals["secure-loop"].params[name], finals["secure"].params[name], atol=1e-5)
  assert float(finals["secure"].aggregator_state.upload_bits) == 32 * 5 + 64 + 96 * 7


def test_bad_arguments_are_refused_with_the_argument_named():
  with pytest.raises(TypeError, match="sum over clients"):
    P.secure_aggregation(A.marginal_median(), bound=1.0)
  with pytest.raises(ValueError, match="frac_bits"):
    P.secure_aggregation(A.mean(), bound=1.0, frac_bits=31)
  with pytest.raises(ValueError, match="dropout"):
    P.secure_aggregation(A.mean(), bound=1.0, dropout=1.5)
  agg = P.secure_aggregation(A.mean(), frac_bits=24, bound=8.0)  # C·(2^27 + 1) ≥ 2^31 from C = 16 on
  with pytest.raises(ValueError, match="ring"):
    jax.eval_shape(agg.aggregate, {"w": jnp.zeros((16, 2))}, jnp.ones(16), agg.init(None), jax.random.key(0))
  agg = P.secure_aggregation(A.mean(), bound=1.0, threshold=5)
  with pytest.raises(ValueError, match="threshold"):
    jax.eval_shape(agg.aggregate, {"w": jnp.zeros((4, 2))}, jnp.ones(4), agg.init(None), jax.random.key(0))


def test_the_scalar_each_client_adds_is_never_clipped():
  """The count (mean: 1) or weight (weighted_mean: n_k) a client adds is what the sum is divided by: a bound below
  a weight-1 client's scalar is refused, and a round whose weight exceeds the bound is rejected (NaN), never
  divided by a clipped count; with a bound that covers the weights it is NumPy's weighted mean."""
  with pytest.raises(ValueError, match=r"bound B = 0.5 would clip the scalar each client adds .* use bound >= 1"):
    P.secure_aggregation(A.mean(), bound=0.5).init(None)
  rng = np.random.default_rng(3)
  updates = {"w": jnp.asarray(rng.uniform(-0.1, 0.1, (4, 3)), jnp.float32)}
  weights = jnp.asarray([6.0, 2.0, 0.0, 3.0])
  for bound, finite in ((1.0, False), (8.0, True)):
    agg = P.secure_aggregation(A.weighted_mean(), bound=bound, frac_bits=16)
    out, _ = jax.jit(agg.aggregate)(updates, weights, agg.init(None), jax.random.key(1))
    if not finite:
      assert np.all(np.isnan(np.asarray(out["w"])))
      continue
    w = np.asarray(weights, np.float64)
    want = (w[:, None] * np.asarray(updates["w"], np.float64)).sum(0) / w.sum()
    np.testing.assert_allclose(np.asarray(out["w"]), want, rtol=0, atol=4 * 2.0 ** -16)


@pytest.mark.slow  # runs the benchmark's --quick mode
def test_the_benchmark_quick_mode_runs_and_writes_its_table(tmp_path):
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "secure_aggregation.py"
  spec = importlib.util.spec_from_file_location("secure_aggregation_benchmark", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "secure.json"
  bench.main(["--quick", "--clients", "12", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert {(r["clients"], r["dropout"], r["dropped"]) for r in rows} == {(12, 0.0, 0), (12, 0.1, 2)}
  for r in rows:
    assert r["secure_s"] > 0 and r["mean_s"] > 0 and r["exact"]
    assert r["upload_bits"] == 32 * (r["parameters"] + 1) + 64 + 96 * (r["clients"] - 1)


# --------------------------------------------------------------------------- the default threshold follows the members

@jax.jit
def _default_threshold_rounds(updates, weights, drops):
  """`secure_aggregation(mean())` with the default threshold, one case per row of `weights` / `drops` `[G, C]`:
  the members are the slots with weight > 0, `drops` those that drop (a traced input, so one program serves every
  case; `lax.map` compiles in a third of vmap's time here)."""

  def one(case):
    w, d = case
    agg = P.secure_aggregation(A.mean(), frac_bits=16, bound=1.0, dropout=lambda key, weights: d)
    return agg.aggregate(updates, w, agg.init(None), jax.random.key(0))

  return jax.lax.map(one, (weights, drops))


def test_the_default_threshold_is_a_majority_of_the_members_present_not_of_the_slots():
  """Bonawitz et al. set t as a fraction of the users taking part: with m members among C slots (the rest padding)
  and d of them dropping, the default t = ⌊m/2⌋ + 1 accepts the round exactly when m − d ≥ ⌊m/2⌋ + 1. A threshold
  counted over the C slots (⌊C/2⌋ + 1) would reject every round with m ≤ C/2 members, as Poisson sampling's padded
  rounds mostly are."""
  c, f = 10, 16
  u = _updates(c, seed=5)
  rng = np.random.default_rng(8)
  cases = [(m, d) for m in range(c + 1) for d in range(m + 1)]
  weights, drops = np.zeros((len(cases), c), np.float32), np.zeros((len(cases), c), bool)
  for g, (m, d) in enumerate(cases):
    slots = rng.permutation(c)[:m]  # members anywhere among the slots; the others are padding (weight 0)
    weights[g, slots] = rng.integers(1, 50, m)
    drops[g, slots[:d]] = True
    padding = rng.permutation(c)[:2]
    drops[g, padding] |= weights[g, padding] == 0  # a padding slot marked as dropping changes nothing
  out, state = _default_threshold_rounds(u, jnp.asarray(weights), jnp.asarray(drops))
  flat_u = {name: np.asarray(v, np.float64).reshape(c, -1) for name, v in u.items()}
  for g, (m, d) in enumerate(cases):
    accepted = m - d >= m // 2 + 1 or m == 0  # no members: the empty sum, nothing to unmask
    assert bool(state.num_survivors[g] == m - d) and bool(state.num_dropped[g] == d), (m, d)
    survivors = (weights[g] > 0) & ~drops[g]
    for name in u:
      got = np.asarray(out[name][g], np.float64).reshape(-1)
      if m == 0:
        np.testing.assert_array_equal(got, 0.0)  # the mean of nobody (the round's guard rejects it)
      elif accepted:  # the mean over the survivors (a float64 NumPy mean), within the fixed-point rounding
        np.testing.assert_allclose(got, flat_u[name][survivors].mean(0), atol=2.0**-f + 1e-6, rtol=0,
                                   err_msg=str((m, d)))
      else:
        assert np.all(np.isnan(got)), (m, d)
  np.testing.assert_array_equal(state.threshold, [m // 2 + 1 for m, _ in cases])
  assert sum(m - d >= m // 2 + 1 for m, d in cases if 2 * m <= c) == 9  # 1 ≤ m ≤ 5 of 10: rejected before


# ------------------------------------------------------------------------ dp_mean's sensitivity survives the rounding

@functools.cache
def _one_client_secure_dp(frac_bits):
  """`lax.map` over (update [1, P], key) of `secure_aggregation(dp_mean(C = 1, σ = 0, m = 1))` with one slot: the
  aggregate is that client's decoded contribution q·2^−f itself (one survivor, no noise, m = 1)."""
  agg = P.secure_aggregation(P.dp_mean(1.0, 0.0, expected_clients=1.0), frac_bits=frac_bits, bound=1.0)

  def one(case):
    update, key = case
    return agg.aggregate({"w": update}, jnp.ones(1), agg.init({"w": update[0]}), key)[0]["w"]

  return jax.jit(lambda updates, keys: jax.lax.map(one, (updates, keys)))


@pytest.mark.parametrize("frac_bits, size", [(12, 100_000), (8, 10_000)])
def test_with_dp_mean_no_decoded_client_update_exceeds_the_clip_norm(frac_bits, size):
  """The stochastic rounding moves each coordinate by less than 2^−f, so a client's decoded vector can be up to
  √P·2^−f longer than what was clipped; σ is calibrated for C, so `secure_aggregation(dp_mean(C))` clips to
  C − √P·2^−f. Checked in float64 on many draws of vectors clipped to exactly C (the worst case), and for the
  rounding that lengthens every coordinate, which no draw is likely to hit."""
  clip, f = 1.0, frac_bits
  room = clip - np.sqrt(size) * 2.0**-f
  rng = np.random.default_rng(frac_bits)
  direction = rng.normal(size=size)
  cases = np.stack([3.0 * direction / np.linalg.norm(direction),  # far outside: clipped to exactly C first
                    np.full(size, clip / np.sqrt(size)) * np.sign(rng.normal(size=size)),  # at norm C, spread evenly
                    direction / np.linalg.norm(direction) * clip,  # at norm C (float32: a few ulps either side)
                    0.5 * direction / np.linalg.norm(direction) * room])  # inside: not clipped, only rounded
  draws = 16
  updates = jnp.asarray(np.repeat(cases, draws, axis=0)[:, None, :], jnp.float32)
  keys = jax.random.split(jax.random.key(frac_bits), len(updates))
  decoded = np.asarray(_one_client_secure_dp(f)(updates, keys), np.float64)
  assert np.all(np.abs(decoded * 2**f - np.round(decoded * 2**f)) == 0)  # on the grid: q·2^−f
  norms = np.linalg.norm(decoded, axis=1)
  assert norms.max() <= clip, norms.max()
  # What was rounded: each update clipped to C − √P·2^−f (a float64 transcription), moved by < 2^−f per coordinate.
  x = np.repeat(cases, draws, axis=0).astype(np.float32).astype(np.float64)
  clipped = x * np.minimum(1.0, room / np.linalg.norm(x, axis=1, keepdims=True))
  assert np.max(np.abs(decoded - clipped)) < 2.0**-f * (1 + 1e-3)
  # The longest vector any draw can give: every coordinate rounded outwards, to the grid point past it.
  worst = np.sign(clipped) * np.ceil(np.abs(clipped) * 2**f) * 2.0**-f
  assert np.linalg.norm(worst, axis=1).max() <= clip


def test_secure_dp_mean_refuses_a_grid_too_coarse_for_its_clip_norm():
  agg = P.secure_aggregation(P.dp_mean(1.0, 1.0, expected_clients=10.0), frac_bits=8, bound=1.0)
  with pytest.raises(ValueError, match=r"frac_bits"):  # √P·2^−f = √(10^5)/256 = 1.24 ≥ C = 1
    agg.init({"w": jnp.zeros(100_000)})
  agg.init({"w": jnp.zeros(10_000)})  # √(10^4)/256 = 0.39 < C: clips to 0.61
  # At the boundary √P·2^−f = C exactly (P = 4, f = 1: 2 · 1/2 = 1) nothing is left: refused, naming the f that
  # costs under 1 % of C, ⌈log₂(100 √P / C)⌉ = ⌈log₂ 200⌉ = 8.
  edge = P.secure_aggregation(P.dp_mean(1.0, 1.0, expected_clients=10.0), frac_bits=1, bound=1.0)
  with pytest.raises(ValueError, match=r"√P·2\^−f = 1 >= C, .*raise frac_bits \(f >= 8 costs under 1% of C\)"):
    edge.init({"w": jnp.zeros(4)})
  # C = 1.57 over P = 64 at f = 2 (√P·2^−f = 2 >= C): the f suggested is the smallest with √P·2^−f under 1% of C,
  # found here by counting up (9: 8/2⁹ = 0.0156 < 0.0157, while 8/2⁸ = 0.031); C ≠ 1 and 100√P/C = 509.6 just
  # below 2⁹ pin the formula's C and its 100.
  clip, size = 1.57, 64
  want = next(f for f in range(31) if np.sqrt(size) * 2.0**-f < 0.01 * clip)
  assert want == 9
  coarse = P.secure_aggregation(P.dp_mean(clip, 1.0, expected_clients=10.0), frac_bits=2, bound=2.0)
  with pytest.raises(ValueError, match=rf"√P·2\^−f = 2 >= C, .*raise frac_bits \(f >= {want} costs under 1% of C\)"):
    coarse.init({"w": jnp.zeros(size)})
  with pytest.raises(ValueError, match=r"frac_bits = 0 cannot encode dp_mean's centred count bit"):
    P.secure_aggregation(P.dp_mean(1.0, 1.0, expected_clients=10.0), frac_bits=0, bound=1.0).init({"w": jnp.zeros(4)})


# --------------------------------------------------------------------------- pieces the mutation run found untested

def _threefry2x32_numpy(key: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
  """Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC
  2011), in Python integers: the block (x₀, x₁) encrypted under the key (k₀, k₁)."""
  mask = 0xFFFFFFFF
  rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
  ks = (key[0], key[1], key[0] ^ key[1] ^ 0x1BD11BDA)
  x0, x1 = (block[0] + ks[0]) & mask, (block[1] + ks[1]) & mask
  for group in range(5):
    for r in rotations[group % 2]:
      x0 = (x0 + x1) & mask
      x1 = (((x1 << r) | (x1 >> (32 - r))) & mask) ^ x0
    x0 = (x0 + ks[(group + 1) % 3]) & mask
    x1 = (x1 + ks[(group + 2) % 3] + group + 1) & mask
  return x0, x1


def test_each_mask_key_is_threefry_of_its_pair_under_the_nonce_xor_the_secret():
  """s = threefry_(n₀ ⊕ a, n₁ ⊕ a)(i, j) for each pair i ≤ j and secret a, against a Python-integer Threefry checked
  on Random123's known answers."""
  assert _threefry2x32_numpy((0, 0), (0, 0)) == (0x6B200159, 0x99BA4EFE)
  assert _threefry2x32_numpy((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 2) == (0x1CB996FC, 0xBB002BE7)
  assert _threefry2x32_numpy((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3)) == (0xC4923A9C, 0x483DF7A0)
  rng = np.random.default_rng(5)
  nonce = rng.integers(0, 2**32, 2, dtype=np.uint64)
  secrets = rng.integers(0, PRIME, 6, dtype=np.uint64)
  low = np.asarray([0, 1, 2, 0, 3, 4])
  high = np.asarray([1, 4, 2, 5, 3, 5])  # two self pairs (i = j)
  keys = S._mask_keys(jnp.asarray(nonce, jnp.uint32), jnp.asarray(secrets, jnp.uint32), jnp.asarray(low),
                      jnp.asarray(high))
  got = np.asarray(jax.random.key_data(keys))
  for k in range(6):
    a = int(secrets[k])
    want = _threefry2x32_numpy((int(nonce[0]) ^ a, int(nonce[1]) ^ a), (int(low[k]), int(high[k])))
    assert tuple(int(v) for v in got[k]) == want, k


_ONE_DROP_MEAN = P.secure_aggregation(A.mean(), bound=1.0, threshold=4, dropout=lambda key, w: w > 1.5)


def test_recovered_the_explicit_threshold_and_a_threshold_of_every_slot():
  """`recovered` is set by one recovered member; an explicit t is the one the protocol uses (4 survivors of 9
  members pass t = 4, where a majority would need 5); t = C is allowed, t = C + 1 refused."""
  c = 10
  u = _updates(c)
  weights = np.ones(c)
  weights[3] = 0.0  # 9 members
  for drops, survivors in (([6], 8), ([0, 1, 2, 4, 5], 4)):
    w = weights.copy()
    w[drops] = 2.0  # weight 2 drops
    out, state = _secure_mean_aggregate(u, jnp.asarray(w), _SECURE_MEAN.init(None), jax.random.key(1))
    assert int(state.num_dropped) == len(drops) and int(state.num_survivors) == survivors
    assert bool(state.recovered) and int(state.threshold) == 4
    want = np.mean(np.asarray(u["b"], np.float64)[w == 1.0], axis=0)
    np.testing.assert_allclose(np.asarray(out["b"]), want, atol=2.0**-16 + 1e-6, rtol=0)
  every = P.secure_aggregation(A.mean(), bound=1.0, threshold=c)
  out, state = jax.jit(every.aggregate)(u, jnp.ones(c), every.init(None), jax.random.key(2))
  assert int(state.threshold) == c and not bool(state.recovered)
  np.testing.assert_allclose(np.asarray(out["b"]), np.mean(np.asarray(u["b"], np.float64), 0), atol=2e-5, rtol=0)
  beyond = P.secure_aggregation(A.mean(), bound=1.0, threshold=c + 1)
  with pytest.raises(ValueError, match=r"threshold t = 11 exceeds the round's C = 10 client slots"):
    jax.eval_shape(beyond.aggregate, u, jnp.ones(c), beyond.init(None), jax.random.key(0))


def test_the_ring_check_is_at_c_times_the_largest_code_plus_one_against_2_to_the_31():
  """C·(⌈B·2^f⌉ + 1) < 2³¹ is accepted and = 2³¹ refused (C = 1, f = 1: B = 2³⁰ − 1 gives 2³¹ − 1, B = 2³⁰ − ½
  gives 2³¹)."""
  for bound, fits in ((2.0**30 - 1, True), (2.0**30 - 0.5, False)):
    agg = P.secure_aggregation(A.mean(), bound=bound, frac_bits=1)
    args = ({"w": jnp.zeros((1, 2))}, jnp.ones(1), agg.init(None), jax.random.key(0))
    if fits:
      jax.eval_shape(agg.aggregate, *args)
    else:
      with pytest.raises(ValueError, match=r"needs C·\(ceil\(B·2\^f\) \+ 1\) < 2\^31"):
        jax.eval_shape(agg.aggregate, *args)


def test_a_dropout_callable_gets_the_round_key_and_the_weights_and_may_return_zeros_and_ones():
  """`dropout(key, weights)`: a random drop set drawn from the key it is given (the same key gives the same set,
  another key another) among the clients it picks by weight; returning 0/1 integers is the same as booleans."""
  c = 10
  u = _updates(c)
  weights = jnp.ones(c).at[3].set(0.0)

  def bools(key, w):
    return jax.random.bernoulli(key, 0.3, w.shape) & (w > 0)

  as_bools = P.secure_aggregation(A.mean(), bound=1.0, threshold=2, dropout=bools)
  as_ints = P.secure_aggregation(A.mean(), bound=1.0, threshold=2,
                                 dropout=lambda key, w: bools(key, w).astype(jnp.int32))
  drop_sets = []
  for seed in (0, 0, 1, 2, 3):
    out, state = jax.jit(as_bools.aggregate)(u, weights, as_bools.init(None), jax.random.key(seed))
    out_i, state_i = jax.jit(as_ints.aggregate)(u, weights, as_ints.init(None), jax.random.key(seed))
    for a, b in zip(jax.tree.leaves((out, state)), jax.tree.leaves((out_i, state_i))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Which members dropped, read back from the mean: the survivors' mean is one subset's mean.
    b = np.asarray(u["b"], np.float64)
    n = int(state.num_survivors)
    assert n + int(state.num_dropped) == 9
    total = np.asarray(out["b"], np.float64) * n
    (kept,) = [s for s in itertools.combinations([i for i in range(c) if i != 3], n)
               if np.abs(b[list(s)].sum(0) - total).max() < 1e-3]
    drop_sets.append(kept)
  assert drop_sets[0] == drop_sets[1] and len(set(drop_sets)) >= 3


def test_padding_slots_are_not_counted_as_clipped():
  """num_clipped counts the members' coordinates that fall outside [−B, B]: with `dp_mean` (scalar ±½) and
  B = ½, the clipped updates fit, and a slot of weight 0 adds nothing (its row is zeros, not encoded)."""
  c = 6
  u = _updates(c, seed=4)
  agg = P.secure_aggregation(P.dp_mean(0.5, 0.0, expected_clients=4), bound=0.5, frac_bits=16)
  for weights in (jnp.ones(c), jnp.asarray([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])):
    _, state = jax.jit(agg.aggregate)(u, weights, agg.init(None), jax.random.key(0))
    assert int(state.num_clipped) == 0
  big = jax.tree.map(lambda x: 3 * x, u)  # no clipping rule applies to mean's terms: outside B, counted
  agg_mean = P.secure_aggregation(A.mean(), bound=1.0, frac_bits=16)
  _, state = jax.jit(agg_mean.aggregate)(big, jnp.asarray([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]), agg_mean.init(None),
                                         jax.random.key(0))
  rows = np.concatenate([np.asarray(big[k]).reshape(c, -1) for k in big], axis=1)[[0, 2, 4, 5]]
  assert int(state.num_clipped) == int(np.sum(np.abs(rows) > 1.0)) > 0


def _state_signature(state):
  return [(np.dtype(x.dtype), np.shape(x)) for x in jax.tree.leaves(state)]


def test_default_resolution_and_the_state_s_dtypes_with_and_without_x64():
  """The default f is 16 (a value 3·2⁻¹⁷ comes back on the 2⁻¹⁶ grid); `init`'s state has the dtypes and shapes
  `aggregate` returns (a scan carries it), also under x64, where float64 updates are decoded in float64: with
  f = 28 the mean is within C·2⁻²⁸ of NumPy's (a float32 decoding is off by about 10⁻⁸), with one member dropped
  and recovered."""
  agg = P.secure_aggregation(A.mean(), bound=1.0)
  updates = {"w": jnp.full((2, 3), 3 * 2.0**-17, jnp.float32)}
  out, state = jax.jit(agg.aggregate)(updates, jnp.asarray([1.0, 0.0]), agg.init(None), jax.random.key(0))
  scaled = np.asarray(out["w"], np.float64) * 2**16
  np.testing.assert_array_equal(scaled, np.round(scaled))
  assert set(np.round(scaled).tolist()) <= {1.0, 2.0}
  assert _state_signature(agg.init(None)) == _state_signature(state)
  assert float(state.upload_bits) == 32 * (3 + 1) + 64  # one member: no pair with anyone
  rng = np.random.default_rng(8)
  with jax.enable_x64(True):
    x = rng.uniform(-0.5, 0.5, (3, 50))
    agg64 = P.secure_aggregation(A.mean(), bound=1.0, frac_bits=28, dropout=lambda key, w: w > 1.5)
    weights = jnp.asarray([1.0, 2.0, 1.0])  # the second member drops
    out, state = jax.jit(agg64.aggregate)({"w": jnp.asarray(x)}, weights, agg64.init(None), jax.random.key(1))
    assert out["w"].dtype == jnp.float64 and bool(state.recovered) and int(state.num_survivors) == 2
    np.testing.assert_allclose(np.asarray(out["w"]), x[[0, 2]].mean(0), atol=2 * 2.0**-28, rtol=0)
    assert _state_signature(agg64.init(None)) == _state_signature(state)
    x32 = {"w": jnp.asarray(x, jnp.float32)}
    out32, state32 = jax.jit(agg64.aggregate)(x32, weights, agg64.init(None), jax.random.key(1))
    assert out32["w"].dtype == jnp.float32  # a float32 model stays float32 under x64
    assert _state_signature(agg64.init(None)) == _state_signature(state32)


_EDGES = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFF, 0x8000, 2**30, PRIME - 2, PRIME - 1, PRIME, PRIME + 1, 2**31 + 5,
          2 * PRIME - 1, 2 * PRIME, 2**32 - 2, 2**32 - 1]


def _u32(values):
  return jnp.asarray(np.asarray(values, np.uint64).astype(np.uint32))


def test_reduction_addition_subtraction_and_folds_mod_p_match_python_integers_on_the_edges():
  """`_reduce` takes any uint32 to x mod p (x = p, p + 1, 2p − 1 … 2³² − 1 included), `_add_mod`/`_sub_mod` every
  pair of field elements near 0, 2¹⁵, 2¹⁶ and p, `_fold_mod` 1 … 9 terms (padded to a power of two with its
  identity), `_field_from_words` (2³² hi + lo) mod p for words at the edges."""
  rng = np.random.default_rng(11)
  words = np.concatenate([_EDGES, rng.integers(0, 2**32, 5000, dtype=np.uint64)]).astype(np.uint64)
  np.testing.assert_array_equal(np.asarray(S._reduce(_u32(words)), np.uint64), words % PRIME)
  field = [v for v in _EDGES if v < PRIME]
  a, b = (np.asarray(v, np.uint64) for v in zip(*itertools.product(field, field)))
  np.testing.assert_array_equal(np.asarray(S._add_mod(_u32(a), _u32(b)), np.uint64), (a + b) % PRIME)
  np.testing.assert_array_equal(np.asarray(S._sub_mod(_u32(a), _u32(b)), np.uint64), (a + PRIME - b) % PRIME)
  np.testing.assert_array_equal(np.asarray(S._mul_mod(_u32(a), _u32(b)), np.uint64),
                                (a.astype(object) * b.astype(object)) % PRIME)
  hi, lo = (np.asarray(v, np.uint64) for v in zip(*itertools.product(_EDGES, _EDGES)))
  got = S._field_from_words(_u32(np.stack([hi, lo], axis=-1)))
  want = (hi.astype(object) * 2**32 + lo.astype(object)) % PRIME
  np.testing.assert_array_equal(np.asarray(got, np.uint64), want.astype(np.uint64))
  for n in range(1, 10):
    x = rng.integers(0, PRIME, (4, n), dtype=np.uint64)
    x[0] = PRIME - 1  # the largest sums and products
    total = S._fold_mod(_u32(x), S._add_mod, 0)
    product = S._fold_mod(_u32(x), S._mul_mod, 1)
    assert total.shape == product.shape == (4,)
    assert [int(v) for v in total] == [sum(int(v) for v in row) % PRIME for row in x], n
    assert [int(v) for v in product] == [functools.reduce(lambda s, v: s * int(v) % PRIME, row, 1) for row in x], n
    stacked = S._fold_mod(_u32(x.reshape(2, 2, n)), S._add_mod, 0)  # the last axis of any shape
    assert stacked.shape == (2, 2) and np.asarray(stacked).ravel().tolist() == [int(v) for v in total], n


def test_polynomial_evaluation_and_lagrange_weights_match_python_integers():
  """`_evaluate` is f(x) = s + a₁x + … + a_{t−1}x^{t−1} mod p (Horner) for t = 1 … 4 at points up to p − 1;
  `_lagrange_at_zero`'s λ_i = Π_{j≠i} x_j / (x_j − x_i) mod p, through all points and through a used subset
  (0 for the unused), so that Σ λ_i f(x_i) = f(0) for the polynomials through them."""
  rng = np.random.default_rng(12)
  xs = np.asarray([1, 2, 3, 0xFFFF, 0x10000, PRIME - 2, PRIME - 1], np.uint64)
  secrets = np.asarray([0, 1, PRIME - 1, 12345], np.uint64)
  for t in range(1, 5):
    coefficients = rng.integers(0, PRIME, (4, t - 1), dtype=np.uint64)
    coefficients[0] = PRIME - 1
    got = np.asarray(S._evaluate(_u32(secrets), _u32(coefficients).reshape(4, t - 1), _u32(xs)))
    for s in range(4):
      poly = [int(secrets[s])] + [int(v) for v in coefficients[s]]
      want = [sum(c * pow(int(x), k, PRIME) for k, c in enumerate(poly)) % PRIME for x in xs]
      assert [int(v) for v in got[s]] == want, (t, s)

  def weights(points):
    out = []
    for i, xi in enumerate(points):
      num, den = 1, 1
      for j, xj in enumerate(points):
        if j != i:
          num, den = num * xj % PRIME, den * (xj - xi) % PRIME
      out.append(num * pow(den, PRIME - 2, PRIME) % PRIME)
    return out

  assert [int(v) for v in S._lagrange_at_zero(_u32(xs))] == weights([int(x) for x in xs])
  used = np.asarray([True, False, True, True, False, False, True])
  got = [int(v) for v in S._lagrange_at_zero(_u32(xs), jnp.asarray(used))]
  want = dict(zip(np.flatnonzero(used), weights([int(x) for x in xs[used]])))
  assert got == [want.get(i, 0) for i in range(len(xs))]
  assert [int(v) for v in S._lagrange_at_zero(_u32([5]))] == [1]  # one point: f(0) = f(x₁) for a constant
  # Points, bases, exponents and shares as Python or int32 integers (the field fits int32) and the used set as
  # 0/1 integers: the same numbers.
  base, exponent = xs[:5].astype(np.int32), np.asarray([PRIME - 2, 2**30 + 3, 65537, 1, 0], np.int32)
  want = [pow(int(b), int(e), PRIME) for b, e in zip(base, exponent)]
  assert [int(v) for v in S._pow_mod(jnp.asarray(base), jnp.asarray(exponent))] == want
  assert [int(v) for v in S._pow_mod([int(b) for b in base], [int(e) for e in exponent])] == want
  shares = rng.integers(0, PRIME, (3, len(xs)), dtype=np.uint64)
  reconstructed = S.shamir_reconstruct(jnp.asarray(shares.astype(np.int32)), _u32(xs), jnp.asarray(used))
  lam = dict(zip(np.flatnonzero(used), weights([int(x) for x in xs[used]])))
  assert [int(v) for v in reconstructed] == [sum(int(row[i]) * w for i, w in lam.items()) % PRIME for row in shares]
  as_ints = S._lagrange_at_zero(jnp.asarray(xs.astype(np.int32)), jnp.asarray(used.astype(np.int32)))
  assert [int(v) for v in as_ints] == got
  assert [int(v) for v in S._lagrange_at_zero([int(x) for x in xs])] == weights([int(x) for x in xs])


def test_fixed_point_codes_are_two_s_complement_of_the_rounded_clipped_value_in_each_input_dtype():
  """q ∈ {⌊x̄2^f⌋, ⌊x̄2^f⌋ + 1} as the uint32 two's complement of an int32 (negative values near 2³²), x̄ = clip(x,
  −B, B); entries at exactly ±B are not counted as clipped, those beyond are; float16/bfloat16 inputs round in
  float32, float64 (x64) in float64; decoding returns the asked dtype."""
  f, bound = 8, 2.0
  x = np.asarray([0.0, 2.0, -2.0, 2.5, -3.0, 1.0 / 3, -1.0 / 3, 1.5 * 2.0**-f, -1e-6], np.float64)
  for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
    xd = jnp.asarray(x, dtype)
    q, clipped = P.fixed_point_encode(xd, jax.random.key(4), frac_bits=f, bound=bound)
    assert q.dtype == jnp.uint32 and clipped.dtype == jnp.int32 and int(clipped) == 2
    value = np.asarray(q).view(np.int32).astype(np.int64)
    low_d = np.floor(np.clip(np.asarray(xd, np.float64), -bound, bound) * 2**f).astype(np.int64)
    assert np.all((value == low_d) | (value == low_d + 1)), dtype
    assert value[1] == 2 * 2**f and value[2] == -2 * 2**f and value[3] == 2 * 2**f and value[4] == -2 * 2**f
    assert np.asarray(q)[2] == 2**32 - 2 * 2**f  # two's complement
    for out in (jnp.float32, jnp.bfloat16):
      decoded = P.fixed_point_decode(q, frac_bits=f, dtype=out)
      assert decoded.dtype == out
      np.testing.assert_array_equal(np.asarray(decoded, np.float64), np.asarray(jnp.asarray(value * 2.0**-f, out),
                                                                                  np.float64))
  with jax.enable_x64(True):  # 2²⁸/3 is 89478485.33 in float64; float32's 1/3 would give 89478488
    q, _ = P.fixed_point_encode(jnp.asarray([1.0 / 3], jnp.float64), jax.random.key(0), frac_bits=28, bound=1.0)
    assert int(np.asarray(q).view(np.int32)[0]) in (89478485, 89478486)


def test_a_round_s_secrets_are_the_documented_fields_of_one_draw_of_words():
  """`_draw_secrets` against the layout its docstring states, in Python integers: one draw of (2·C·cap + 1) × 2
  words, cap = ⌊C/2⌋ + 1 for a majority threshold or t itself; per client sk = w₀ mod (p − 2) + 1, b = w₁ and the
  two polynomials' coefficients, zero past degree t − 1; the nonce the last pair. sk and b are distinct draws."""
  key, c = jax.random.key(21), 5
  for threshold, t in ((None, 2), (None, 3), (4, 4), (1, 1)):
    cap = c // 2 + 1 if threshold is None else threshold
    words = np.asarray(jax.random.bits(key, (c * 2 * cap + 1, 2), jnp.uint32), np.uint64)
    field = [(int(hi) * 2**32 + int(lo)) % PRIME for hi, lo in words[:-1]]
    rows = [field[i * 2 * cap:(i + 1) * 2 * cap] for i in range(c)]
    sk, seeds, coefficients_sk, coefficients_b, nonce = S._draw_secrets(key, c, threshold, jnp.int32(t))
    assert [int(v) for v in sk] == [r[0] % (PRIME - 2) + 1 for r in rows]
    assert [int(v) for v in seeds] == [r[1] for r in rows]
    assert coefficients_sk.shape == coefficients_b.shape == (c, cap - 1)
    for got, start in ((coefficients_sk, 2), (coefficients_b, cap + 1)):
      want = [[r[start + k] if k < t - 1 else 0 for k in range(cap - 1)] for r in rows]
      assert np.asarray(got, np.int64).tolist() == want, (threshold, t)
    assert [int(v) for v in nonce] == [int(v) for v in words[-1]]
    assert all(x.dtype == jnp.uint32 for x in (sk, seeds, coefficients_sk, coefficients_b, nonce))
    assert not np.array_equal(np.asarray(sk), np.asarray(seeds))



def test_each_key_agreement_secret_lies_in_1_to_p_minus_2_at_the_field_s_edges(monkeypatch):
  """sk = w mod (p − 2) + 1 for drawn field elements w at the top of F_p (p − 3, p − 2, p − 1) and 0: words chosen
  through the draw, (hi, lo) = (0, v) giving w = v mod p."""
  edges = [PRIME - 3, PRIME - 2, PRIME - 1, PRIME, 0]

  def words(key, shape, dtype):
    out = np.zeros(shape, np.uint32)
    out[0:10:2, 1] = edges  # each client's first field element (cap = 1: rows of 2)
    return jnp.asarray(out, dtype)

  monkeypatch.setattr(jax.random, "bits", words)
  sk, *_ = S._draw_secrets(jax.random.key(0), 5, 1, jnp.int32(1))
  assert [int(v) for v in sk] == [PRIME - 2, 1, 2, 1, 1]

def test_secure_sum_takes_integer_flags_keeps_uint32_under_x64_and_zeroes_what_it_does_not_send():
  """`secure_sum` directly: members and drops given as integers (nonzero: set) are the same round as booleans;
  under x64 every output keeps its 32-bit dtype and the same values; a non-member's upload and a failed round's
  total are zeros; t = 1 (one survivor unmasks) and t = C are allowed, 0 and C + 1 refused. The round has exactly
  t = 3 survivors of 5 members among ⌊C/2⌋ + 1 = 4 share holders: the fourth holder's share never arrives."""
  c = 6
  rng = np.random.default_rng(13)
  encoded = jnp.asarray(rng.integers(0, 2**32, (c, 40), dtype=np.uint64).astype(np.uint32))
  member = np.asarray([1, 1, 0, 1, 1, 1])
  dropped = np.asarray([0, 1, 1, 0, 0, 1])  # slot 2 is no member: its drop flag is ignored
  survivors = (member == 1) & (dropped == 0)
  want = _ring_sum(np.asarray(encoded, np.uint64)[survivors])
  key = jax.random.key(4)
  as_bools = S.secure_sum(encoded, jnp.asarray(member == 1), jnp.asarray(dropped == 1), key, threshold=None)
  as_ints = S.secure_sum(encoded, jnp.asarray(member * [3, 1, 0, 2, 1, 5]), jnp.asarray(dropped * 4), key,
                         threshold=None)  # any nonzero integer flags, as NumPy reads them
  with jax.enable_x64(True):
    wide = S.secure_sum(encoded, jnp.asarray(member), jnp.asarray(dropped), key, threshold=None)
  for out in (as_bools, as_ints, wide):
    assert bool(out.ok) and int(out.num_survivors) == 3 and int(out.num_dropped) == 2 and int(out.threshold) == 3
    np.testing.assert_array_equal(np.asarray(out.total, np.uint64), want)
    assert out.total.dtype == out.uploads.dtype == jnp.uint32
    assert out.num_survivors.dtype == out.num_dropped.dtype == out.threshold.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out.uploads), np.asarray(as_bools.uploads))
    assert not np.any(np.asarray(out.uploads)[2])
  failed = S.secure_sum(encoded, jnp.asarray(member), jnp.asarray([1, 1, 0, 1, 0, 1]), key, threshold=2)
  assert not bool(failed.ok) and int(failed.num_survivors) == 1 and not np.any(np.asarray(failed.total))
  one = S.secure_sum(encoded, jnp.asarray(member), jnp.asarray([1, 1, 0, 1, 0, 1]), key, threshold=1)
  assert bool(one.ok) and int(one.threshold) == 1
  np.testing.assert_array_equal(np.asarray(one.total, np.uint64), np.asarray(encoded, np.uint64)[4])
  every = S.secure_sum(encoded, jnp.ones(c, bool), jnp.zeros(c, bool), key, threshold=c)
  np.testing.assert_array_equal(np.asarray(every.total, np.uint64), _ring_sum(np.asarray(encoded, np.uint64)))
  for bad in (0, c + 1):
    with pytest.raises(ValueError, match=rf"threshold must be None or in \[1, C = {c}\]; got {bad}"):
      S.secure_sum(encoded, jnp.asarray(member), jnp.asarray(dropped), key, threshold=bad)


def test_the_rounding_draw_follows_the_input_s_float_dtype_and_never_rounds_a_grid_value_up():
  """A float32 input under x64 gets the codes it gets without x64 (the uniform draw stays float32), and codes
  given back as int64 under x64 decode the same; a value on the 2^−f grid is its own code even where the draw
  is exactly U = 0 (round up only when U < x̄2^f − ⌊x̄2^f⌋, never for a zero remainder)."""
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.normal(size=300) * 0.4, jnp.float32)
  q, clipped = P.fixed_point_encode(x, jax.random.key(2), frac_bits=12, bound=1.0)
  with jax.enable_x64(True):
    q64, clipped64 = P.fixed_point_encode(x, jax.random.key(2), frac_bits=12, bound=1.0)
    assert q64.dtype == jnp.uint32 and clipped64.dtype == jnp.int32
    wide_codes = jnp.asarray(np.asarray(q).view(np.int32).astype(np.int64))
    decoded = P.fixed_point_decode(wide_codes, frac_bits=12)
  np.testing.assert_array_equal(np.asarray(q64), np.asarray(q))
  assert int(clipped64) == int(clipped)
  np.testing.assert_array_equal(np.asarray(decoded), np.asarray(P.fixed_point_decode(q, frac_bits=12)))
  grid = jnp.asarray(rng.integers(-2**10, 2**10, 2**22) * 2.0**-10, jnp.float32)
  key = jax.random.key(7)
  assert int(jnp.sum(jax.random.uniform(key, grid.shape, jnp.float32) == 0)) > 0  # the case exists in this draw
  codes, _ = P.fixed_point_encode(grid, key, frac_bits=10, bound=1.0)
  np.testing.assert_array_equal(np.asarray(codes).view(np.int32), np.asarray(grid, np.float64) * 2**10)


def test_an_explicit_threshold_gives_sharing_polynomials_of_degree_t_minus_1(monkeypatch):
  """With t = 5 of C = 6 (above the default's ⌊C/2⌋ + 1 = 4), each client's two sharing polynomials have degree
  t − 1 = 4: their coefficients of x¹ … x⁴ are drawn (none is 0 here), so no 4 shares determine a secret."""
  drawn = []

  def spy(*args):
    drawn.append(original(*args))
    return drawn[-1]

  original = S._draw_secrets
  monkeypatch.setattr(S, "_draw_secrets", spy)
  encoded = jnp.zeros((6, 4), jnp.uint32)
  out = S.secure_sum(encoded, jnp.ones(6, bool), jnp.asarray([0, 0, 0, 0, 0, 1], bool), jax.random.key(5),
                     threshold=5)
  assert bool(out.ok) and int(out.threshold) == 5 and len(drawn) == 1
  _, _, coefficients_sk, coefficients_b, _ = drawn[0]
  assert coefficients_sk.shape == coefficients_b.shape == (6, 4)
  assert np.all(np.asarray(coefficients_sk) > 0) and np.all(np.asarray(coefficients_b) > 0)
