"""Attacks on the stacked client updates and data poisoning, against NumPy transcriptions of the papers' formulas."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats
from conftest import lsq_loss, pack

import fedjax_opt as fo
from fedjax_opt import attacks

A = fo.aggregators
C, D = 9, 6
ZERO = (2, 6)  # zero-weight rows
KEY = jax.random.key(3)

# An aggregator that hands back what it was given: the stacked updates after the attack.
IDENTITY = A.Aggregator(lambda params: (), lambda updates, weights, state, key: (updates, state))


def setup(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(C, D)) + 1.0
  w = rng.uniform(1, 5, size=C)
  w[list(ZERO)] = 0
  return x, w


def attacked(attack, x, w, attackers, key=KEY, x64=True, **kwargs):
  """The rows the wrapped aggregator receives, as float64 NumPy, and the wrapper's state.

  x64=False runs the round in float32 (x must then hold float32 values): random draws compile several times
  faster there than under x64, for tests whose checks are exact equalities either way."""
  agg = attacks.corrupt(IDENTITY, attack, attackers=attackers, **kwargs)
  with jax.enable_x64(x64):
    out, state = jax.jit(agg.aggregate)({"p": jnp.asarray(x[:, :2]), "q": jnp.asarray(x[:, 2:])}, jnp.asarray(w),
                                        agg.init(None), key)
  return np.concatenate([np.asarray(out["p"]), np.asarray(out["q"])], axis=1), state


ROWS = (0, 3, 6)  # explicit attacker rows; row 6 has weight 0, so it does not attack


def _check_rows(got, x, expected_bad):
  """Honest and zero-weight rows untouched; the attackers' rows (0 and 3) equal `expected_bad`."""
  keep = np.ones(C, bool)
  keep[[0, 3]] = False
  np.testing.assert_array_equal(got[keep], x[keep])
  np.testing.assert_allclose(got[[0, 3]], np.broadcast_to(expected_bad, (2, D)), rtol=1e-12, atol=1e-12)


def honest_rows(w):
  mask = w > 0
  mask[[0, 3]] = False
  return mask


def test_omniscient_sends_minus_factor_times_the_honest_sum():
  x, w = setup()
  got, state = attacked(attacks.omniscient(1e4), x, w, ROWS)
  _check_rows(got, x, -1e4 * x[honest_rows(w)].sum(0))
  assert int(state.num_attackers) == 2


def test_sign_flip_and_ipm():
  x, w = setup()
  got, _ = attacked(attacks.sign_flip(3.0), x, w, ROWS)
  np.testing.assert_allclose(got[[0, 3]], -3.0 * x[[0, 3]], rtol=1e-12)
  _check_rows(got, x, got[[0, 3]])
  got, _ = attacked(attacks.ipm(0.5), x, w, ROWS)
  _check_rows(got, x, -0.5 * x[honest_rows(w)].mean(0))


def test_ipm_with_one_honest_client_is_minus_epsilon_times_its_update():
  x, w = setup()
  one = np.zeros(C)
  one[[0, 3, 5]] = 1.0  # rows 0 and 3 attack; row 5 alone is honest
  got, _ = attacked(attacks.ipm(0.5), x, one, ROWS)
  np.testing.assert_allclose(got[[0, 3]], np.broadcast_to(-0.5 * x[5], (2, D)), rtol=1e-12)


def test_gaussian_draws_in_each_leaf_s_dtype_whatever_x64():
  """A float32 model's attackers send the same noise with or without x64 (a float64 draw from the same key would
  be other numbers), and a float64 model's is drawn in float64."""
  x, w = setup()
  x = x.astype(np.float32)
  with_x64, _ = attacked(attacks.gaussian(7.0), x, w, ROWS, x64=True)
  without, _ = attacked(attacks.gaussian(7.0), x, w, ROWS, x64=False)
  np.testing.assert_array_equal(with_x64, without)
  wide, _ = attacked(attacks.gaussian(7.0), x.astype(np.float64), w, ROWS, x64=True)
  assert not np.array_equal(wide[[0, 3]], with_x64[[0, 3]])


def test_alie_is_mean_minus_z_std_with_the_papers_z():
  """Baruch et al.: s = ⌊n/2 + 1⌋ − f, z = Φ⁻¹((n − s)/n); here n = 7 taking part, f = 2: s = 2, z = Φ⁻¹(5/7)."""
  x, w = setup()
  honest = x[honest_rows(w)]
  z = scipy.stats.norm.ppf((7 - (math.floor(7 / 2 + 1) - 2)) / 7)
  got, _ = attacked(attacks.alie(), x, w, ROWS)
  _check_rows(got, x, honest.mean(0) - z * honest.std(0, ddof=1))
  got, _ = attacked(attacks.alie(1.5), x, w, ROWS)
  _check_rows(got, x, honest.mean(0) - 1.5 * honest.std(0, ddof=1))
  for n, f in ((10, 2), (50, 12), (100, 20)):
    s = math.floor(n / 2 + 1) - f
    np.testing.assert_allclose(attacks.alie_z(n, f), scipy.stats.norm.ppf((n - s) / n), rtol=1e-5)
  # (n − s)/n is clipped into [10⁻⁶, 1 − 10⁻⁶], so z stays finite: 0 for one client and no attacker (s = 1), 1 for
  # one client attacking (s = 0, n counted as itself) or six of ten (s = 0).
  for n, f, p in ((1, 0, 1e-6), (1, 1, 1 - 1e-6), (10, 6, 1 - 1e-6)):
    np.testing.assert_allclose(attacks.alie_z(n, f), scipy.stats.norm.ppf(np.float32(p)), rtol=1e-4)  # float32's p
  # Two honest clients: σ divides by n_h − 1 = 1.
  two = np.zeros(C)
  two[[0, 1, 3, 4]] = 1.0  # rows 0 and 3 attack; rows 1 and 4 are the honest pair
  got, _ = attacked(attacks.alie(1.5), x, two, ROWS)
  pair = x[[1, 4]]
  np.testing.assert_allclose(got[[0, 3]], np.broadcast_to(pair.mean(0) - 1.5 * pair.std(0, ddof=1), (2, D)),
                             rtol=1e-12)


def test_gaussian_replaces_attackers_with_noise_of_the_given_scale():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 5000))
  w = np.ones(4)
  agg = attacks.corrupt(IDENTITY, attacks.gaussian(7.0), attackers=[1, 2])
  out = lambda key: np.asarray(agg.aggregate({"p": jnp.asarray(x, jnp.float32)}, jnp.asarray(w, jnp.float32),
                                             agg.init(None), key)[0]["p"], np.float64)
  got = out(KEY)
  np.testing.assert_array_equal(got[[0, 3]], x[[0, 3]].astype(np.float32))
  for row in (1, 2):
    assert abs(got[row].mean()) < 0.5 and abs(got[row].std() - 7.0) < 0.3
  assert np.corrcoef(got[1], got[2])[0, 1] < 0.05
  assert not np.array_equal(out(jax.random.key(4))[1], got[1])  # fresh noise each round


def _attacked_together(pairs, x, w):
  """The rows each `corrupt(identity, attack, attackers=...)` of `pairs` receives, float32, all in one program."""
  aggs = [attacks.corrupt(IDENTITY, attack, attackers=who) for attack, who in pairs]
  tree = {"p": jnp.asarray(x[:, :2], jnp.float32), "q": jnp.asarray(x[:, 2:], jnp.float32)}
  outs = jax.jit(lambda t, ww: [a.aggregate(t, ww, a.init(None), KEY)[0] for a in aggs])(tree, jnp.asarray(w))
  return [np.concatenate([np.asarray(o["p"], np.float64), np.asarray(o["q"], np.float64)], axis=1) for o in outs]


def test_generalized_byzantine_corrupts_at_most_the_fraction_per_coordinate():
  """Every row attacks; per coordinate exactly ⌊0.3 · 7⌋ = 2 of the 7 clients taking part are corrupted.

  In float32 (the random draws compile faster than under x64), the four cases in one program: the inputs are
  float32 values, so every check below is still an exact equality."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(C, 400)).astype(np.float32).astype(np.float64)
  w = np.ones(C)
  w[list(ZERO)] = 0
  constant, flipped, three, one = _attacked_together([
      (attacks.generalized_byzantine(0.3, 1e6), 1.0), (attacks.generalized_byzantine(0.3, attacks.sign_flip()), 1.0),
      (attacks.generalized_byzantine(0.3, 1e6), [0, 1, 4]),
      (attacks.generalized_byzantine(0.15, attacks.gaussian(100.0)), 1.0)], x, w)
  bad = constant == 1e6
  np.testing.assert_array_equal(constant[~bad], x[~bad])
  np.testing.assert_array_equal(bad.sum(0), 2)
  assert not bad[list(ZERO)].any()
  assert bad[w > 0].any(1).all()  # over 400 coordinates every client is hit somewhere
  # Values from an attack: the corrupted coordinates hold that attack's vector, here −v (sign flip).
  hit = flipped != x
  np.testing.assert_array_equal(hit.sum(0), 2)
  np.testing.assert_array_equal(flipped[hit], -x[hit])
  # Only attacker rows are corrupted: with 3 attacker rows, per coordinate min(2, 3) of them.
  bad = three == 1e6
  assert not bad[[2, 3, 5, 6, 7, 8]].any()
  np.testing.assert_array_equal(bad.sum(0), 2)
  # One per coordinate (⌊0.15 · 7⌋ = 1), holding a random attack's values: N(0, 100²) draws.
  hit = one != x
  np.testing.assert_array_equal(hit.sum(0), 1)
  assert not hit[list(ZERO)].any() and 50 < np.std(one[hit]) < 200


def test_generalized_byzantine_values_come_from_every_participating_update():
  """Every row an attacker (the paper's dimensional model): the value attack reads the n = 7 participating clients'
  own updates, since each is honest on most coordinates. omniscient(1e4) puts −1e4 Σ_i v_i, ipm(0.5) −0.5 · their
  mean, ALIE their mean − z · std with f = ⌊0.3 · 7⌋ = 2 corrupted per coordinate (float64 NumPy over the 7 rows)."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(C, 40)).astype(np.float32).astype(np.float64)
  w = np.ones(C)
  w[list(ZERO)] = 0
  real = x[w > 0]
  n, f = 7, 2
  z = scipy.stats.norm.ppf((n - (math.floor(n / 2 + 1) - f)) / n)
  cases = ((attacks.omniscient(1e4), -1e4 * real.sum(0)), (attacks.ipm(0.5), -0.5 * real.mean(0)),
           (attacks.alie(), real.mean(0) - z * real.std(0, ddof=1)),
           (attacks.alie(1.5), real.mean(0) - 1.5 * real.std(0, ddof=1)))
  # One program for the four (their corrupted coordinates are drawn from the same key: one draw, shared).
  outs = _attacked_together([(attacks.generalized_byzantine(0.3, attack), 1.0) for attack, _ in cases], x, w)
  for (attack, value), got in zip(cases, outs):
    bad = got != x
    np.testing.assert_array_equal(bad.sum(0), 2)
    assert not bad[list(ZERO)].any()
    np.testing.assert_allclose(got, np.where(bad, value[None, :], x), rtol=1e-5, atol=1e-5)


def test_attacker_counts_from_a_fraction_or_a_count():
  x, w = setup()  # 7 clients take part
  for attackers, expected in ((0.0, 0), (0.3, 2), (0.5, 3), (1.0, 7), (0, 0), (2, 2), (20, 7)):
    got, state = attacked(attacks.sign_flip(), x, w, attackers)
    changed = np.any(got != x, axis=1)
    assert changed.sum() == expected == int(state.num_attackers), attackers
    assert not changed[list(ZERO)].any()


def test_fixed_attackers_stay_put_across_rounds_and_per_round_ones_move():
  x, w = setup()
  tree, weights = {"p": jnp.asarray(x, jnp.float32)}, jnp.asarray(w, jnp.float32)

  def rows_of(agg, **kw):
    run = jax.jit(agg.aggregate)
    return lambda key, state=None: tuple(np.flatnonzero(np.any(
        np.asarray(run(tree, weights, agg.init(None) if state is None else state, key)[0]["p"]) != x.astype(
            np.float32), axis=1)))

  keys = [jax.random.key(i) for i in range(6)]
  fixed = attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=3)
  fixed_rows = rows_of(fixed)
  assert len({fixed_rows(k) for k in keys}) == 1
  # The set lives in the state: states seeded differently pick different rows through the same compiled round.
  seeded = {fixed_rows(KEY, attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=3, seed=s).init(None))
            for s in range(6)}
  assert len(seeded) > 1 and all(len(r) == 3 for r in seeded)
  moving = rows_of(attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=3, per_round=True))
  assert len({moving(k) for k in keys}) > 1


def test_corrupt_composes_with_an_aggregator():
  """corrupt(mean, sign_flip) on rows 0 and 3 is the mean of the rows with those two negated."""
  x, w = setup()
  agg = attacks.corrupt(A.weighted_mean(), attacks.sign_flip(), attackers=[0, 3])
  with jax.enable_x64(True):
    out, _ = agg.aggregate({"p": jnp.asarray(x)}, jnp.asarray(w), agg.init({"p": jnp.zeros(D)}), KEY)
  y = x.copy()
  y[[0, 3]] *= -1
  np.testing.assert_allclose(out["p"], w @ y / w.sum(), rtol=1e-12)


def test_corrupt_s_state_inner_init_default_seed_and_inner_key():
  """corrupt's `init` hands the params to the wrapped aggregator's (centered clipping's center is shaped like the
  model) and keeps `num_attackers` in the dtype the round returns, with and without x64 (a scan carries the state);
  the default seed is 0; the wrapped rule gets key' = split(key, 3)[2] (the attackers' draw and the attack take the
  first two)."""
  x, w = setup()
  for x64 in (False, True):
    with jax.enable_x64(x64):
      agg = attacks.corrupt(A.centered_clipping(1.0), attacks.sign_flip(), attackers=2)
      params = {"p": jnp.zeros(D, jnp.float32)}
      state = agg.init(params)
      assert state.aggregator.center["p"].shape == (D,)
      _, after = jax.jit(agg.aggregate)({"p": jnp.asarray(x, jnp.float32)}, jnp.asarray(w, jnp.float32), state, KEY)
      jax.tree.map(lambda a, b: np.testing.assert_equal(a.dtype, b.dtype), state, after)
  default = np.any(attacked(attacks.sign_flip(), x, w, 3)[0] != x, axis=1)
  for seed, same in ((0, True), (1, False)):
    rows = np.any(attacked(attacks.sign_flip(), x, w, 3, seed=seed)[0] != x, axis=1)
    assert np.array_equal(rows, default) == same
  seen = []
  spy = A.Aggregator(lambda p: (), lambda updates, weights, state, key: (seen.append(key) or updates, state))
  agg = attacks.corrupt(spy, attacks.sign_flip(), attackers=1)
  agg.aggregate({"p": jnp.asarray(x, jnp.float32)}, jnp.asarray(w, jnp.float32), agg.init(None), KEY)
  np.testing.assert_array_equal(jax.random.key_data(seen[0]), jax.random.key_data(jax.random.split(KEY, 3)[2]))


def test_attacked_rows_keep_each_leaf_s_dtype_over_three_leaves():
  """A bfloat16, a float32 and a float16 leaf: the attackers' rows come back in each leaf's dtype (with and without
  x64), and each leaf gets its own noise key (three leaves, three keys)."""
  rng = np.random.default_rng(6)
  tree = {"a": jnp.asarray(rng.normal(size=(C, 2)), jnp.bfloat16), "b": jnp.asarray(rng.normal(size=(C, 3)),
          jnp.float32), "c": jnp.asarray(rng.normal(size=(C, 2)), jnp.float16)}
  w = jnp.asarray(setup()[1], jnp.float32)
  for x64 in (False, True):
    with jax.enable_x64(x64):
      for attack in (attacks.omniscient(2.0), attacks.gaussian(1.0)):
        agg = attacks.corrupt(IDENTITY, attack, attackers=[0, 3])
        out, _ = jax.jit(agg.aggregate)(tree, w, agg.init(None), KEY)
        assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in tree.items()}
        assert all(not np.array_equal(np.asarray(out[k][0], np.float32), np.asarray(tree[k][0], np.float32))
                   for k in tree)


def test_alie_counts_the_attackers_taking_part_whatever_their_weights():
  """f in z = Φ⁻¹((n − s)/n) is the number of attackers taking part: weights in (0, 1) count as much as weights
  above 1, and, called directly with a mask that also names zero-weight rows, those do not count."""
  x, w = setup()
  small, _ = attacked(attacks.alie(), x, w / 10, ROWS)  # weights in (0.1, 0.5]
  large, _ = attacked(attacks.alie(), x, w, ROWS)
  np.testing.assert_allclose(small, large, rtol=1e-12)
  mask = np.zeros(C, bool)
  mask[[0, 3, *ZERO]] = True
  with jax.enable_x64(True):
    direct = attacks.alie().apply({"p": jnp.asarray(x)}, jnp.asarray(w), jnp.asarray(mask), KEY)
  honest = x[honest_rows(w)]
  z = scipy.stats.norm.ppf((7 - (math.floor(7 / 2 + 1) - 2)) / 7)  # n = 7 taking part, f = 2 (rows 0 and 3)
  np.testing.assert_allclose(np.asarray(direct["p"])[[0, 3]],
                             np.broadcast_to(honest.mean(0) - z * honest.std(0, ddof=1), (2, D)), rtol=1e-12)


# ---- what the server receives passes the non-finite guard --------------------------------------------------

_GUARDED = {}


def guarded(agg, x, w):
  """`core.aggregate_updates` (the round's non-finite guard around `agg`) on float32 rows x [C, D], jitted once per
  aggregator: the `Aggregated` result."""
  fn = _GUARDED.setdefault(agg, jax.jit(functools.partial(fo.core.aggregate_updates, agg)))
  return fn({"p": jnp.asarray(x, jnp.float32)}, jnp.asarray(w, jnp.float32), agg.init({"p": jnp.zeros(D)}), KEY)


OVERFLOW = attacks.omniscient(1e40)  # −1e40 × the honest sum: ±inf (NaN where the sum is 0) in float32


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e40 as float32: the point
def test_attackers_nonfinite_rows_are_dropped_and_counted_by_the_guard():
  """omniscient(1e40) overflows float32, so rows 0 and 3 arrive as ±inf: the guard judges them as it judges any
  client (counted in num_nonfinite, excluded), and the rule aggregates the five finite rows (float64 NumPy: the
  weighted mean, the coordinate-wise median)."""
  x, w = setup()
  x = x.astype(np.float32).astype(np.float64)
  honest = honest_rows(w)
  for rule, want in ((A.weighted_mean(), w[honest] @ x[honest] / w[honest].sum()),
                     (A.marginal_median(), np.median(x[honest], 0))):
    out = guarded(attacks.corrupt(rule, OVERFLOW, attackers=[0, 3]), x, w)
    assert int(out.num_nonfinite) == 2 and bool(out.accepted)
    np.testing.assert_array_equal(np.asarray(out.finite), ~np.isin(np.arange(C), [0, 3]))
    np.testing.assert_allclose(out.update["p"], want, rtol=1e-5, atol=1e-6)
    assert int(out.state.num_attackers) == 2


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e40 as float32: the point
def test_a_round_whose_every_row_overflows_is_rejected():
  """Every client taking part attacks with a non-finite value: no finite client is left, so the round is rejected
  (update 0, the aggregator state kept), as a round of broken clients is."""
  x, w = setup()
  agg = attacks.corrupt(A.marginal_median(), attacks.gaussian(1e39), attackers=1.0)  # 1e39 · N(0, 1): ±inf
  out = guarded(agg, x, w)
  assert int(out.num_nonfinite) == 7 and not bool(out.accepted)
  np.testing.assert_array_equal(out.update["p"], np.zeros(D))
  assert int(out.state.num_attackers) == 0  # the state before the round


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e40 as float32: the point
def test_nested_attacks_each_reach_the_guard():
  """corrupt(corrupt(mean, sign_flip, rows [3]), omniscient(1e40), rows [0]): the outer attack runs first, then the
  inner one; the overflowing row 0 is dropped and counted, row 3 arrives negated (float64 NumPy mean)."""
  x, w = setup()
  x = x.astype(np.float32).astype(np.float64)
  inner = attacks.corrupt(A.weighted_mean(), attacks.sign_flip(), attackers=[3])
  out = guarded(attacks.corrupt(inner, OVERFLOW, attackers=[0]), x, w)
  y, v = x.copy(), w.copy()
  y[3] *= -1
  v[0] = 0
  assert int(out.num_nonfinite) == 1 and bool(out.accepted)
  np.testing.assert_allclose(out.update["p"], v @ y / v.sum(), rtol=1e-5, atol=1e-6)
  # The other way round: the wrapped attack's overflowing row is judged (and counted) by the round's guard too,
  # not dropped silently inside the wrapped aggregator.
  inner = attacks.corrupt(A.weighted_mean(), OVERFLOW, attackers=[3])
  out = guarded(attacks.corrupt(inner, attacks.sign_flip(), attackers=[0]), x, w)
  y, v = x.copy(), w.copy()
  y[0] *= -1
  v[3] = 0
  assert int(out.num_nonfinite) == 1 and bool(out.accepted)
  np.testing.assert_allclose(out.update["p"], v @ y / v.sum(), rtol=1e-5, atol=1e-6)
  assert int(out.state.num_attackers) == 1 and int(out.state.aggregator.num_attackers) == 1


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e40 as float32: the point
def test_per_cluster_aggregation_counts_each_clusters_dropped_attackers():
  """Clustered rounds guard each cluster's rows: an overflowing attacker in cluster 1 is counted, not used, and
  does not count in cluster 0 (where it takes no part)."""
  x, w = setup()
  x = x.astype(np.float32).astype(np.float64)
  cluster = np.array([0, 0, 0, 1, 1, 1, 1, 0, 1])
  agg = attacks.corrupt(A.weighted_mean(), OVERFLOW, attackers=[3])  # row 3: in cluster 1
  states = jax.tree.map(lambda s: jnp.stack([s, s]), agg.init({"p": jnp.zeros(D)}))
  out = jax.jit(lambda u, v, c, s: fo.core.clusters.aggregate_per_cluster(agg, u, v, c, 2, s, KEY))(
      {"p": jnp.asarray(x, jnp.float32)}, jnp.asarray(w, jnp.float32), jnp.asarray(cluster), states)
  assert int(out.num_nonfinite) == 1
  used = (w > 0) & (np.arange(C) != 3)
  np.testing.assert_array_equal(np.asarray(out.used), used)
  for j in (0, 1):
    member = used & (cluster == j)
    np.testing.assert_allclose(out.update["p"][j], w[member] @ x[member] / w[member].sum(), rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match=r"corrupt: attackers as a fraction must be in \[0, 1\]; got 1.5"):
    attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=1.5)
  with pytest.raises(ValueError, match="corrupt: attackers as a count must be >= 0; got -1"):
    attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=-1)
  with pytest.raises(TypeError, match="corrupt: attackers must be a fraction"):
    attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=True)
  with pytest.raises(TypeError, match="attack must be a fedjax_opt.attacks.Attack"):
    attacks.corrupt(IDENTITY, lambda u: u, attackers=0.1)
  with pytest.raises(TypeError, match="aggregator must be a fedjax_opt.aggregators.Aggregator"):
    attacks.corrupt(lambda u: u, attacks.sign_flip(), attackers=0.1)
  with pytest.raises(ValueError, match=r"generalized_byzantine: fraction must be a float in \(0, 1\]"):
    attacks.generalized_byzantine(0.0, 1.0)
  with pytest.raises(ValueError, match="generalized_byzantine: values is an Attack without `sent`"):
    attacks.generalized_byzantine(0.3, attacks.Attack(lambda updates, weights, rows, key: updates))
  with pytest.raises(ValueError, match="gaussian: scale must be a finite number > 0; got -1.0"):
    attacks.gaussian(-1.0)
  with pytest.raises(ValueError, match="omniscient: factor must be a finite number; got inf"):
    attacks.omniscient(float("inf"))
  with pytest.raises(ValueError, match="label_flip: num_classes must be a Python int >= 2; got 1"):
    attacks.label_flip(1)
  flip = attacks.label_flip(3)
  with pytest.raises(ValueError, match=r"labels under 'y'; got \['labels', 'x'\]\. Pass field="):
    flip.apply({"x": jnp.zeros((2, 1)), "labels": jnp.zeros(2, jnp.int32)}, jnp.ones(2, bool))
  with pytest.raises(ValueError, match=r"labels under 'y'; got tuple\. Pass field="):
    flip.apply((jnp.zeros((2, 1)),), jnp.ones(2, bool))
  x, w = setup()
  with pytest.raises(ValueError, match=r"corrupt: attacker rows \(0, 9\) must be < C = 9"):
    attacked(attacks.sign_flip(), x, w, [0, 9])
  for bad in ([[0, 1]], [-1, 2], [0.0, 3.0]):  # not flat, negative, not integers
    with pytest.raises(ValueError, match="corrupt: attackers as indices must be a flat sequence of ints >= 0"):
      attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=bad)
  with pytest.raises(TypeError, match="corrupt: attackers must be a fraction"):  # a 0-d integer array is no fraction
    attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=jnp.asarray(1))
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match="poison: a fraction or a count of attackers needs num_clients"):
    attacks.poison(algo, attacks.label_flip(3), attackers=0.2)


# ---- data poisoning ----------------------------------------------------------------------------------------


def softmax_loss(params, batch):
  logits = batch["x"] @ params["w"] + params["b"]
  return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]


def _classification_clients(rng, n_clients=6, n=20, d=3, k=4):
  return [(rng.normal(size=(n, d)), rng.integers(0, k, n).astype(np.int32)) for _ in range(n_clients)]


def test_label_flip_poisons_only_the_attacking_clients_step():
  """poison(algo, label_flip(K), attackers=[1, 4]).step = algo.step on batches whose clients 1 and 4 have y → K−1−y."""
  rng = np.random.default_rng(0)
  clients = _classification_clients(rng)
  batches = pack(clients, steps=4, batch=5)
  batches = batches.replace(client_id=jnp.asarray([5, 1, 0, 4, 2, 3], jnp.int32))  # rows are not ids
  algo = fo.algorithms.fedavg(softmax_loss, client_optimizer=optax.sgd(0.3), client_map="vmap")
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  poisoned = attacks.poison(algo, attacks.label_flip(4), attackers=[1, 4])
  y = np.asarray(batches.data["y"]).copy()
  y[[1, 3]] = 3 - y[[1, 3]]  # the rows holding clients 1 and 4
  flipped = batches.replace(data={**batches.data, "y": jnp.asarray(y)})
  state = algo.init(params, jax.random.key(0))
  got = jax.jit(poisoned.step)(state, batches)
  want = jax.jit(algo.step)(state, flipped)
  jax.tree.map(np.testing.assert_array_equal, got.params, want.params)
  clean = jax.jit(algo.step)(state, batches)
  assert not np.allclose(clean.params["w"], got.params["w"])


def test_poison_draws_a_fixed_fraction_of_the_dataset_clients():
  """attackers=0.3 of N = 10: the ⌊0.3 · 10⌋ = 3 ids of the seeded permutation, whatever the rows' order."""
  seen = {}

  def spy(data, rows):
    seen["rows"] = rows
    return data

  algo = fo.FederatedAlgorithm(lambda params, key: None, lambda state, batches: state)
  batches = pack([(np.ones((2, 2)), np.ones(2))] * 10, steps=1, batch=2)
  batches = batches.replace(client_id=jnp.asarray([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], jnp.int32))
  for seed in (0, 1, None):  # None: the default seed, 0
    kw = {} if seed is None else {"seed": seed}
    attacks.poison(algo, attacks.DataAttack(spy), attackers=0.3, num_clients=10, **kw).step(None, batches)
    ids = 9 - np.flatnonzero(np.asarray(seen["rows"]))
    np.testing.assert_array_equal(np.sort(ids), np.sort(np.random.default_rng(seed or 0).permutation(10)[:3]))
  # A count k: the first k of the same permutation (all N when k > N).
  for count, k in ((3, 3), (20, 10)):
    attacks.poison(algo, attacks.DataAttack(spy), attackers=count, num_clients=10).step(None, batches)
    ids = 9 - np.flatnonzero(np.asarray(seen["rows"]))
    np.testing.assert_array_equal(np.sort(ids), np.sort(np.random.default_rng(0).permutation(10)[:k]))
  # No attacker (an empty list, with or without num_clients) poisons no row; an id of N or more is refused.
  for kw in ({}, {"num_clients": 10}):
    attacks.poison(algo, attacks.DataAttack(spy), attackers=[], **kw).step(None, batches)
    assert not np.any(np.asarray(seen["rows"]))
  with pytest.raises(ValueError, match=r"poison: attacker ids \(3, 10\) must be < num_clients = 10"):
    attacks.poison(algo, attacks.DataAttack(spy), attackers=[3, 10], num_clients=10)


def test_poisoned_algorithm_trains_with_fo_train_as_on_flipped_data():
  """Every client an attacker: fo.train on the poisoned algorithm = fo.train on a dataset with flipped labels."""
  rng = np.random.default_rng(2)
  clients = _classification_clients(rng, n_clients=5)
  data = [{"x": x.astype(np.float32), "y": y} for x, y in clients]
  dataset = fo.data.pack(data, test_fraction=0.2, num_classes=4)
  flipped = fo.data.pack([{"x": c["x"], "y": 3 - c["y"]} for c in data], test_fraction=0.2, num_classes=4)
  algo = fo.algorithms.fedavg(softmax_loss, client_optimizer=optax.sgd(0.3), client_map="vmap")
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  kw = {"evaluation": fo.Evaluation(every=3), "progress": False}
  sampling = fo.Sampling(clients_per_round=3, batch_size=4, local_steps=2)
  poisoned = attacks.poison(algo, attacks.label_flip(4), attackers=1.0, num_clients=dataset.num_clients)
  got, _ = fo.train(poisoned, poisoned.init(params, jax.random.key(0)), dataset, 3, sampling, **kw)
  want, _ = fo.train(algo, algo.init(params, jax.random.key(0)), flipped, 3, sampling, **kw)
  jax.tree.map(np.testing.assert_array_equal, got.params, want.params)


# ---- swept fractions -----------------------------------------------------------------------------------------


def test_a_fraction_array_is_checked_when_concrete():
  with pytest.raises(ValueError, match=r"corrupt: attackers as a fraction must be in \[0, 1\]; got 1.5"):
    attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=jnp.asarray(1.5))
  with pytest.raises(ValueError, match=r"generalized_byzantine: fraction as a fraction must be in \[0, 1\]"):
    attacks.generalized_byzantine(jnp.asarray(-0.1), 1.0)
  with pytest.raises(TypeError, match="corrupt: attackers must be a fraction"):
    attacks.corrupt(IDENTITY, attacks.sign_flip(), attackers=jnp.ones(2))  # not a scalar
  # The closed interval's ends are fractions too: 0 attacks no one, 1 every client taking part.
  x, w = setup()
  for end, count in ((0.0, 0), (1.0, 7)):
    _, state = attacked(attacks.sign_flip(), x, w, jnp.asarray(end))
    assert int(state.num_attackers) == count
    attacks.generalized_byzantine(jnp.asarray(end), 1.0)


def test_generalized_byzantine_takes_up_to_2_to_the_23_clients_per_round():
  """Each coordinate's key, (24 − b) random bits then the row in b = bit_length(C − 1) bits, is exact in float32
  for C ≤ 2²³; C = 2²³ traces (b = 23), C = 2²³ + 1 is refused when traced (shapes only, nothing allocated)."""
  attack = attacks.generalized_byzantine(0.3, 5.0)

  def trace(c):
    return jax.eval_shape(attack.apply, {"p": jax.ShapeDtypeStruct((c, 1), jnp.float32)},
                          jax.ShapeDtypeStruct((c,), jnp.float32), jax.ShapeDtypeStruct((c,), jnp.bool_), KEY)

  assert trace(2**23)["p"].shape == (2**23, 1)
  with pytest.raises(ValueError, match=r"generalized_byzantine: at most 2\*\*23 clients per round; got C = 8388609"):
    trace(2**23 + 1)


def test_generalized_byzantine_never_corrupts_a_row_of_weight_zero():
  """Called directly with a mask that names every row, the attack leaves the zero-weight rows (which take no part)
  as they are and corrupts ⌊fraction · n⌋ of the n = 7 taking part per coordinate."""
  x, w = setup()
  x = x.astype(np.float32)
  out = attacks.generalized_byzantine(1.0, 5.0).apply({"p": jnp.asarray(x)}, jnp.asarray(w), jnp.ones(C, bool), KEY)
  got = np.asarray(out["p"], np.float64)
  np.testing.assert_array_equal(got[list(ZERO)], x[list(ZERO)])
  np.testing.assert_array_equal(np.delete(got, ZERO, axis=0), 5.0)
  # Every row taking part and attacking, fraction 1: all C rows of every coordinate (the C-th smallest key is the
  # threshold); fraction 0.1 of n = 9: ⌊0.9⌋ = 0 rows, none.
  everyone = jnp.ones(C, jnp.float32)
  for fraction, want in ((1.0, np.full_like(x, 5.0)), (0.1, x)):
    out = attacks.generalized_byzantine(fraction, 5.0).apply({"p": jnp.asarray(x)}, everyone, jnp.ones(C, bool), KEY)
    np.testing.assert_array_equal(np.asarray(out["p"]), want)


KEYS = jax.random.split(jax.random.key(0), 4)  # member k of a sweep, and its separate run, start from KEYS[k]


def _swept_fedavg(make_attacked, fractions, batches, params, rounds=3):
  """`rounds` FedAvg rounds of each fraction, all fractions in one vmapped program: params [K, ...]."""
  swept = fo.sweep.vmap_algorithm(make_attacked, {"fraction": np.asarray(fractions, np.float32)})
  state = swept.init(params, KEYS[:len(fractions)])
  step = jax.jit(swept.step)
  for _ in range(rounds):
    state = step(state, batches)
  return state


def _separate_fedavg(make_attacked, fraction, k, batches, params, rounds=3):
  algo = make_attacked(fraction)
  state = algo.init(params, KEYS[k])
  step = jax.jit(algo.step)
  for _ in range(rounds):
    state = step(state, batches)
  return state


@pytest.mark.parametrize("case", ["corrupt", "generalized_byzantine", "poison"])
def test_a_swept_fraction_equals_separate_runs_with_python_floats(case):
  """fo.sweep over the attackers' fraction (traced inside one program) = one run per Python float, and the
  attacker counts are ⌊f · n⌋ for each member.

  Each separate run compiles its own program (the float is baked in: that is the point), so few members are run
  separately: 0.1 and 0.3 (⌊f · 10⌋ from a float32 fraction, where rounding could go wrong) for `corrupt`, 0.3 for
  the others; the sweep holds four,
  and its edge members (0.0: nobody attacks, 0.4) are checked through their counts and by differing."""
  rng = np.random.default_rng(4)
  clients = [(rng.normal(size=(8, 3)), rng.normal(size=8)) for _ in range(10)]
  batches = pack(clients, steps=2, batch=4)
  params = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
  fractions = (0.0, 0.1, 0.3, 0.4)
  # Members run alone too, each with its fraction as a Python float: both for `corrupt`, whose counts ⌊f · 10⌋ are
  # checked; one for the others (every separate run compiles a program of its own).
  separate = (1, 2) if case == "corrupt" else (2,)

  def make(fraction):
    if case == "poison":
      base = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), client_map="vmap")
      scale = attacks.DataAttack(lambda data, rows: {**data, "y": jnp.where(rows[:, None, None], 50.0, data["y"])})
      return attacks.poison(base, scale, attackers=fraction, num_clients=10)
    if case == "corrupt":
      agg = attacks.corrupt(A.marginal_median(), attacks.omniscient(100.0), attackers=fraction)
    else:
      agg = attacks.corrupt(A.mean(), attacks.generalized_byzantine(fraction, -30.0), attackers=1.0)
    return fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), aggregator=agg, client_map="vmap")

  swept = _swept_fedavg(make, fractions, batches, params)
  for k in separate:
    alone = _separate_fedavg(make, fractions[k], k, batches, params)
    jax.tree.map(lambda s, a, k=k: np.testing.assert_allclose(s[k], a, rtol=1e-5, atol=1e-6), swept.params,
                 alone.params)
  if case == "corrupt":
    for k, f in enumerate(fractions):
      assert int(swept.aggregator_state.num_attackers[k]) == math.floor(f * 10 + 1e-6)
  # The members differ: the fraction did reach the attack.
  assert not np.allclose(swept.params["w"][0], swept.params["w"][-1])
