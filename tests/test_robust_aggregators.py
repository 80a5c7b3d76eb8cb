"""Robust aggregators against float64 NumPy / scipy transcriptions of the papers, with hypothesis properties,
inside FedAvg, and the claims of Xie, Koyejo & Gupta (2018) on synthetic vectors and a least-squares problem."""

import functools
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize
from conftest import lsq_grad_np, lsq_loss, pack
from hypothesis import given, settings
from hypothesis import strategies as st

import fedjax_opt as fo
from fedjax_opt import attacks

A = fo.aggregators
KEY = jax.random.key(0)
C, N_ZERO = 11, 2  # 11 rows, 2 of them zero-weight: n = 9 clients take part
SHAPES = {"a": (3, 2), "b": (4,)}  # d = 10, two leaves


# ---- helpers: stacked pytrees <-> [C, d] matrices ------------------------------------------------------


def to_tree(x):
  """[C, 10] -> {"a": [C, 3, 2], "b": [C, 4]}."""
  return {"a": jnp.asarray(x[:, :6].reshape(-1, 3, 2)), "b": jnp.asarray(x[:, 6:])}


def to_vec(tree):
  return np.concatenate([np.asarray(tree["a"]).reshape(-1), np.asarray(tree["b"]).reshape(-1)])


_COMPILED = {}


def aggregate(agg, x, w, state=None):
  """The aggregate of rows x [C, 10] with weights w [C], jitted (once per aggregator), in float64; (vector, state)."""
  with jax.enable_x64(True):
    tree = to_tree(np.asarray(x, np.float64))
    if state is None:
      state = agg.init(jax.tree.map(lambda u: u[0], tree))
    fn = _COMPILED.setdefault(agg, jax.jit(agg.aggregate))
    out, new_state = fn(tree, jnp.asarray(w, jnp.float64), state, KEY)
    return to_vec(out), new_state


def data(seed, zero_rows=(3, 8)):
  """Random rows, weights in [1, 10], and the given rows zero-weight holding garbage (NaN and 1e30)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(C, 10)) * rng.uniform(0.5, 2, size=10)
  w = rng.uniform(1, 10, size=C)
  w[list(zero_rows)] = 0
  for i, row in enumerate(zero_rows):
    x[row] = np.nan if i % 2 == 0 else 1e30
  return x, w


# ---- NumPy float64 transcriptions of the papers ----------------------------------------------------------


def np_trimmed_mean(x, beta):
  n = len(x)
  b = int(np.floor(beta * n))
  return np.sort(x, axis=0)[b:n - b].mean(0)


def np_mean_around_median(x, q):
  """Xie et al.: ρ_j = (1/(n − q)) Σ of the n − q values (v_i)_j closest to μ_j = median_i (v_i)_j (ties: by value)."""
  n, d = x.shape
  rho = np.empty(d)
  for j in range(d):
    col = x[:, j]
    mu = np.median(col)
    closest = np.lexsort((col, np.abs(col - mu)))[:n - q]
    rho[j] = col[closest].mean()
  return rho


def np_krum_order(x, f):
  """Blanchard et al.: s(i) = Σ of ‖v_i − v_j‖² over the n − f − 2 nearest j ≠ i (clipped into [1, n − 1]);
  by increasing score, equal scores by the (k+1)-th nearest squared distance."""
  n = len(x)
  k = min(max(n - f - 2, 1), n - 1)
  d2 = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
  nearest = [np.sort(np.delete(d2[i], i)) for i in range(n)]
  scores = np.array([row[:k].sum() for row in nearest])
  next_nearest = np.array([row[k] if k < n - 1 else 0.0 for row in nearest])
  return np.lexsort((next_nearest, scores))


def np_krum(x, f):
  return x[np_krum_order(x, f)[0]]


def np_multi_krum(x, f, m):
  return x[np_krum_order(x, f)[:m]].mean(0)


def np_bulyan(x, f):
  """El Mhamdi et al.: θ = n − 2f recursive Krum picks, then per coordinate the β = θ − 2f closest to the median."""
  remaining, chosen = list(range(len(x))), []
  theta = len(x) - 2 * f
  for _ in range(theta):
    pick = np_krum_order(x[remaining], f)[0]
    chosen.append(remaining.pop(pick))
  return np_mean_around_median(x[chosen], 2 * f)


def np_geometric_median(x):
  """argmin_v Σ_i ‖v − v_i‖ by scipy BFGS from the mean, with the gradient Σ_i (v − v_i)/‖v − v_i‖."""

  def objective(v):
    diff = v - x
    norms = np.linalg.norm(diff, axis=1)
    return norms.sum(), (diff / norms[:, None]).sum(0)

  res = scipy.optimize.minimize(objective, x.mean(0), jac=True, method="BFGS", options={"gtol": 1e-12,
                                                                                         "maxiter": 10000})
  return res.x, res.fun


def np_centered_clipping(x, center, tau, iterations):
  v = center.copy()
  for _ in range(iterations):
    diff = x - v
    norms = np.linalg.norm(diff, axis=1)
    v = v + (diff * np.minimum(1, tau / norms)[:, None]).mean(0)
  return v


KRUM = {f: A.krum(f) for f in (1, 3)}
MULTI_KRUM = {f: A.multi_krum(f) for f in (1, 3)}
BULYAN = {f: A.bulyan(f) for f in (1, 2)}
TRIMMED = {beta: A.trimmed_mean(beta) for beta in (0.1, 0.25, 0.45)}
MEAMED = {q: A.mean_around_median(q) for q in (0, 2, 4)}
MARMED = A.marginal_median()
MULTI_KRUM_2_4 = A.multi_krum(2, 4)
GEOMED_TIGHT = A.geometric_median(tol=1e-12, max_iterations=1000, smoothing=1e-12)
GEOMED_DEFAULT = A.geometric_median()


# ---- against the references --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coordinate_wise_rules_match_numpy(seed):
  x, w = data(seed)
  real = x[w > 0]
  np.testing.assert_allclose(aggregate(MARMED, x, w)[0], np.median(real, 0), rtol=1e-12, atol=1e-12)
  for beta in (0.1, 0.25, 0.45):
    np.testing.assert_allclose(aggregate(TRIMMED[beta], x, w)[0], np_trimmed_mean(real, beta), rtol=1e-12,
                               atol=1e-12)
  for q in (0, 2, 4):
    np.testing.assert_allclose(aggregate(MEAMED[q], x, w)[0], np_mean_around_median(real, q),
                               rtol=1e-12, atol=1e-12)


def test_marginal_median_of_an_even_count_is_the_mean_of_the_middle_two():
  x, w = data(3, zero_rows=(0, 5, 9))  # n = 8
  np.testing.assert_allclose(aggregate(MARMED, x, w)[0], np.median(x[w > 0], 0), rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_geometric_median_matches_scipy(seed):
  x, w = data(seed)
  ref, best = np_geometric_median(x[w > 0])
  got, _ = aggregate(GEOMED_TIGHT, x, w)
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-4
  assert np.linalg.norm(got - x[w > 0], axis=1).sum() <= best * (1 + 1e-9)
  # The defaults (float32 budget: tol 1e-6, 100 iterations) are within the same relative error.
  with jax.enable_x64(False):
    tree = to_tree(x.astype(np.float32))
    out, _ = jax.jit(GEOMED_DEFAULT.aggregate)(tree, jnp.asarray(w, jnp.float32), (), KEY)
  assert np.linalg.norm(to_vec(out) - ref) / np.linalg.norm(ref) <= 1e-4


def test_weighted_geometric_median_matches_scipy_with_repeated_points():
  """Integer weights α_i = repetitions: the weighted GeoMed is the GeoMed of the points repeated α_i times."""
  x, _ = data(4)
  w = np.array([1, 3, 2, 0, 1, 2, 1, 4, 0, 2, 1], np.float64)
  x[3], x[8] = 5.0, -7.0  # zero-weight: finite garbage
  repeated = np.repeat(x, w.astype(int), axis=0)
  ref, _ = np_geometric_median(repeated)
  got, _ = aggregate(A.geometric_median(tol=1e-12, max_iterations=2000, smoothing=1e-12, weighted=True), x, w)
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-4


def np_weiszfeld(x, alpha, tol, iterations, smoothing):
  """The smoothed Weiszfeld loop as `geometric_median` documents it, in float64: the start, the step, the stopping
  rule ‖vᵗ⁺¹ − vᵗ‖ ≤ tol · F(vᵗ⁺¹) with F(v) = Σ_i α_i ‖v − v_i‖, Σ α_i = 1, and the cap; (v, iterations run)."""
  alpha = alpha / alpha.sum()
  v = np.median(x, 0)
  dist = np.linalg.norm(x - v, axis=1)
  objective, step, i = (alpha * dist).sum(), np.inf, 0
  while i < iterations and not (np.isfinite(objective) and step <= tol * objective):
    beta = alpha / np.maximum(dist, smoothing)
    new = beta @ x / beta.sum()
    step, dist = np.linalg.norm(new - v), np.linalg.norm(x - new, axis=1)
    objective, v, i = (alpha * dist).sum(), new, i + 1
  return v, i


def test_geometric_median_stops_where_its_rule_says():
  """The iterate the loop returns is the float64 transcription's, iteration for iteration: stopped by the relative
  step (tol 10⁻³, which the objective's normalization Σ α_i = 1 scales, also for weights summing to 0.12), or by
  the cap (tol 0, 3 iterations); consecutive iterates differ by far more than the tolerance compared at."""
  x, w = data(14)
  real = x[w > 0]
  for agg, alpha, tol, cap in ((A.geometric_median(tol=1e-3, max_iterations=1000), np.ones(9), 1e-3, 1000),
                               (A.geometric_median(tol=0.0, max_iterations=3), np.ones(9), 0.0, 3)):
    want, ran = np_weiszfeld(real, alpha, tol, cap, 1e-6)
    assert 2 < ran < 1000
    np.testing.assert_allclose(aggregate(agg, x, w)[0], want, rtol=1e-10)
  small = np.where(w > 0, np.linspace(0.005, 0.02, C), 0.0)  # Σ = 0.12 over the 9 taking part
  want, ran = np_weiszfeld(real, small[w > 0], 1e-3, 1000, 1e-6)
  assert 2 < ran < 1000
  got, _ = aggregate(A.geometric_median(tol=1e-3, max_iterations=1000, weighted=True), x, small)
  np.testing.assert_allclose(got, want, rtol=1e-10)
  earlier, _ = np_weiszfeld(real, small[w > 0], 1e-3, ran - 1, 1e-6)
  assert np.linalg.norm(earlier - want) > 1e-6 * np.linalg.norm(want)


def test_geometric_median_defaults_are_the_documented_ones():
  """tol 10⁻⁶, 100 iterations, ν = 10⁻⁶, one client one vote: the default rule is the rule with those arguments,
  to the last bit, on float32 rows with unequal weights and distances below 1."""
  defaults = inspect.signature(A.geometric_median).parameters
  assert {k: v.default for k, v in defaults.items()} == {"tol": 1e-6, "max_iterations": 100, "smoothing": 1e-6,
                                                          "weighted": False}
  x, w = data(15)
  x = np.where(w[:, None] > 0, 0.05 * x, x)  # distances of order 0.1: a smoothing of 1 would change the weights
  tree, weights = to_tree(x.astype(np.float32)), jnp.asarray(w, jnp.float32)
  got, _ = jax.jit(GEOMED_DEFAULT.aggregate)(tree, weights, (), KEY)
  want, _ = jax.jit(A.geometric_median(1e-6, 100, 1e-6, weighted=False).aggregate)(tree, weights, (), KEY)
  np.testing.assert_array_equal(to_vec(got), to_vec(want))
  ref, _ = np_weiszfeld(x[w > 0], np.ones(9), 1e-6, 100, 1e-6)
  np.testing.assert_allclose(to_vec(got), ref, rtol=1e-4, atol=1e-6)
  # A median next to a client, (0.3, −0.2), which Weiszfeld approaches slowly: the default stops at its cap of 100
  # iterations (the 101st would still move it by 10⁻⁴ of its norm), in float64 as the transcription does.
  rng = np.random.default_rng(32)
  angle, radius = rng.uniform(0, 2 * np.pi, 8), rng.uniform(1, 3, 8)
  x = np.zeros((C, 10))
  x[:9, :2] = np.vstack([[0.3, -0.2], np.c_[radius * np.cos(angle), radius * np.sin(angle)]])
  w = np.where(np.arange(C) < 9, 1.0, 0.0)
  want, ran = np_weiszfeld(x[:9], np.ones(9), 1e-6, 100, 1e-6)
  assert ran == 100
  assert np.linalg.norm(np_weiszfeld(x[:9], np.ones(9), 1e-6, 101, 1e-6)[0] - want) > 1e-5 * np.linalg.norm(want)
  np.testing.assert_allclose(aggregate(GEOMED_DEFAULT, x, w)[0], want, rtol=1e-9)


def test_multi_krum_counts_its_m():
  """m = 1 is Krum; m = C is accepted and, with n ≤ C taking part, is their mean; the default m = n − f with only
  f + 1 clients taking part averages max(n − f, 1) = 1 of them (the Krum choice with the neighbour count at 1)."""
  x, w = data(16)
  real = x[w > 0]
  np.testing.assert_allclose(aggregate(A.multi_krum(2, 1), x, w)[0], np_krum(real, 2), rtol=1e-12)
  np.testing.assert_allclose(aggregate(A.multi_krum(1, C), x, w)[0], real.mean(0), rtol=1e-12)
  few = np.where(np.arange(C) < 4, 1.0, 0.0)  # n = 4 = f + 1 with f = 3 (C = 11 ≥ 2f + 3)
  np.testing.assert_allclose(aggregate(MULTI_KRUM[3], x, few)[0], np_multi_krum(x[:4], 3, 1), rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_krum_multi_krum_and_bulyan_match_numpy(seed):
  x, w = data(seed)
  real = x[w > 0]  # n = 9
  for f in (1, 3):
    np.testing.assert_allclose(aggregate(KRUM[f], x, w)[0], np_krum(real, f), rtol=1e-12)
    np.testing.assert_allclose(aggregate(MULTI_KRUM[f], x, w)[0], np_multi_krum(real, f, 9 - f), rtol=1e-12)
  np.testing.assert_allclose(aggregate(MULTI_KRUM_2_4, x, w)[0], np_multi_krum(real, 2, 4), rtol=1e-12)
  for f in (1, 2):  # n = 9 >= 4f + 3 for f = 1; f = 2 (C = 11 rows) has n < 4f + 3: θ = 5, β = 1
    np.testing.assert_allclose(aggregate(BULYAN[f], x, w)[0], np_bulyan(real, f), rtol=1e-12, atol=1e-12)


def test_krum_in_float32_resolves_small_distances_far_from_the_origin():
  """Correct clients 10³ from the origin with a spread of 10⁻², attackers 10⁶ away: float32 Krum, Multi-Krum and
  Bulyan make the float64 choice (distances come from a Gram matrix centered at the coordinate-wise median)."""
  rng = np.random.default_rng(11)
  x = 1e3 * np.ones(10) + 1e-2 * rng.normal(size=(C, 10))
  x[[1, 7]] = -1e6 * rng.normal(size=(2, 10))
  x = x.astype(np.float32).astype(np.float64)  # the float32 inputs, exactly
  for agg, ref in ((A.krum(2), np_krum(x, 2)), (A.multi_krum(2, 4), np_multi_krum(x, 2, 4)),
                   (A.bulyan(2), np_bulyan(x, 2))):
    out, _ = jax.jit(agg.aggregate)(to_tree(x.astype(np.float32)), jnp.ones(C, jnp.float32), (), KEY)
    np.testing.assert_allclose(to_vec(out), ref, rtol=1e-6)


def test_krum_picks_the_paper_choice_on_a_hand_example():
  """Three clustered points and two outliers, f = 1: each cluster point's 2 nearest are in the cluster."""
  x = np.zeros((C, 10))
  x[0, 0], x[1, 0], x[2, 0] = 0.0, 0.1, 0.3
  x[4, 0], x[5, 0] = 10.0, -20.0
  w = np.zeros(C)
  w[[0, 1, 2, 4, 5]] = 1
  # n = 5, f = 1: k = 2; s(0) = .01 + .09, s(1) = .01 + .04, s(2) = .04 + .09: row 1.
  np.testing.assert_array_equal(aggregate(A.krum(1), x, w)[0], x[1])


def test_krum_scores_by_one_neighbour_when_n_is_f_plus_3_and_resolves_float64_distances():
  """n = f + 3 taking part: k = n − f − 2 = 1, each client scored by its nearest neighbour alone, so the tight pair
  {0, 0.1} beats the trio {5, 6, 7} (with k = 2 the trio's middle would win). In float64, scores 1 and (1 − 10⁻⁹)²
  are told apart (float32 distances would tie them and take the first row)."""
  x = np.zeros((C, 10))
  w = np.zeros(C)
  w[:5] = 1
  x[:5, 0] = [0.0, 0.1, 5.0, 6.0, 7.0]
  # s(0) = s(0.1) = 0.01; the tie goes to the smaller distance to the 2nd nearest: 0.1 (4.9²) over 0 (5²).
  np.testing.assert_array_equal(aggregate(A.krum(2), x, w)[0], x[1])
  x[:5, 0] = [0.0, 1.0, 10.0, 11.0 - 1e-9, 100.0]  # s(10) = s(11 − 10⁻⁹) = (1 − 10⁻⁹)² < s(0) = s(1) = 1
  np.testing.assert_array_equal(aggregate(A.krum(2), x, w)[0], x[2])


def test_krum_rules_with_one_client_give_its_update_and_bulyan_with_f_0_the_mean():
  """One client taking part is every rule's choice (its Krum score runs over no neighbour); Bulyan with f = 0 picks
  all n (the last pick from a single remaining candidate) and averages them: the mean."""
  x, w = data(20)
  for row in (6, C - 1):  # the last row too: the pick is read at index C − 1
    one = np.where(np.arange(C) == row, 1.0, 0.0)
    for agg in (KRUM[1], MULTI_KRUM[1], A.bulyan(0)):
      np.testing.assert_array_equal(aggregate(agg, x, one)[0], x[row])
  np.testing.assert_allclose(aggregate(A.bulyan(0), x, w)[0], x[w > 0].mean(0), rtol=1e-12)


def test_centered_clipping_matches_numpy_and_keeps_its_center():
  x, w = data(5)
  real = x[w > 0]
  agg = A.centered_clipping(0.8, iterations=3)
  got, state = aggregate(agg, x, w)
  ref = np_centered_clipping(real, np.zeros(10), 0.8, 3)
  np.testing.assert_allclose(got, ref, rtol=1e-12)
  np.testing.assert_allclose(to_vec(state.center), ref, rtol=1e-12)
  # Round 2 starts from the last aggregate; with momentum 0.5 the center is the average of old and new.
  x2, _ = data(6)
  x2[[3, 8]] = x[[3, 8]]
  got2, _ = aggregate(agg, x2, w, state)
  np.testing.assert_allclose(got2, np_centered_clipping(x2[w > 0], ref, 0.8, 3), rtol=1e-12)
  with_momentum = A.centered_clipping(0.8, iterations=3, momentum=0.5)
  _, state_m = aggregate(with_momentum, x, w)
  np.testing.assert_allclose(to_vec(state_m.center), 0.5 * ref, rtol=1e-12)


def test_centered_clipping_walks_toward_agreeing_clients_tau_per_iteration():
  """All clients at v, center 0: each iteration moves min(τ, remaining distance) toward v."""
  v = np.linspace(-1, 1, 10)  # ‖v‖ ≈ 2.02
  x = np.tile(v, (C, 1))
  w = np.ones(C)
  for iterations, expected in ((1, 0.5 * v / np.linalg.norm(v)), (4, 2.0 * v / np.linalg.norm(v)), (5, v)):
    np.testing.assert_allclose(aggregate(A.centered_clipping(0.5, iterations), x, w)[0], expected, rtol=1e-12)


def test_centered_clipping_defaults_one_client_and_the_derivative_in_tau():
  """The defaults are L = 1 and m = 0 (the center is the aggregate); one client alone is clipped by itself,
  v = v_1 · min(1, τ/‖v_1‖); and ∂v/∂τ = (1/n) Σ_{‖d_i‖ > τ} d_i/‖d_i‖ stays finite when a row's difference is 0 (an
  absent row in the first round, where the center is 0): the guard that divides by 1 there keeps NaN out of the
  derivative JAX takes through the unused branch."""
  x, w = data(5)
  got, state = aggregate(A.centered_clipping(0.8), x, w)
  ref = np_centered_clipping(x[w > 0], np.zeros(10), 0.8, 1)
  np.testing.assert_allclose(got, ref, rtol=1e-12)
  np.testing.assert_allclose(to_vec(state.center), ref, rtol=1e-12)
  one = np.random.default_rng(12).normal(size=(1, 10))
  got, _ = aggregate(A.centered_clipping(0.8), one, np.ones(1))
  np.testing.assert_allclose(got, one[0] * 0.8 / np.linalg.norm(one[0]), rtol=1e-12)
  with jax.enable_x64(True):
    tree = to_tree(x)
    tree = jax.tree.map(lambda u: jnp.where(jnp.isfinite(u), u, 0.0), tree)
    zero = jnp.asarray(w > 0, jnp.float64)  # rows 3 and 8 absent: their difference to the center 0 is 0

    def total(tau):
      agg = A.centered_clipping(tau)
      out, _ = agg.aggregate(tree, zero, agg.init(jax.tree.map(lambda u: u[0], tree)), KEY)
      return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(out))

    grad = float(jax.grad(total)(jnp.asarray(0.8, jnp.float64)))
  real = x[w > 0]
  norms = np.linalg.norm(real, axis=1)
  want = (real[norms > 0.8] / norms[norms > 0.8, None]).sum() / len(real)
  np.testing.assert_allclose(grad, want, rtol=1e-12)


def test_centered_clipping_keeps_each_leaf_s_dtype_and_the_state_s():
  """A bfloat16 leaf beside a float32 one comes back in bfloat16 (the clipping loop carries each leaf's dtype);
  under x64, float64 updates against a float32 state give a float64 aggregate and a float32 state (the state is
  carried by the run's scan), both at the float64 reference."""
  rng = np.random.default_rng(13)
  x = rng.normal(size=(5, 6))
  agg = A.centered_clipping(0.5, iterations=2)
  tree = {"a": jnp.asarray(x[:, :2], jnp.bfloat16), "b": jnp.asarray(x[:, 2:], jnp.float32)}
  params = jax.tree.map(lambda u: u[0], tree)
  out, state = jax.jit(agg.aggregate)(tree, jnp.ones(5, jnp.float32), agg.init(params), KEY)
  assert out["a"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float32
  assert state.center["a"].dtype == jnp.bfloat16 and state.center["b"].dtype == jnp.float32
  rows = np.concatenate([np.asarray(tree["a"], np.float64), x[:, 2:]], axis=1)
  ref = np_centered_clipping(rows, np.zeros(6), 0.5, 2)
  np.testing.assert_allclose(np.asarray(out["a"], np.float64), ref[:2], rtol=2e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(out["b"], np.float64), ref[2:], rtol=2e-2, atol=1e-2)
  with jax.enable_x64(True):
    state = agg.init({"p": jnp.zeros(6, jnp.float32)})
    out, state = jax.jit(agg.aggregate)({"p": jnp.asarray(x)}, jnp.ones(5), state, KEY)
    assert out["p"].dtype == jnp.float64 and state.center["p"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out["p"]), np_centered_clipping(x, np.zeros(6), 0.5, 2), rtol=1e-12)
  np.testing.assert_allclose(np.asarray(state.center["p"]), np.asarray(out["p"], np.float32), rtol=1e-7)


@pytest.mark.parametrize("name", ["marginal_median", "mean_around_median", "geometric_median", "trimmed_mean",
                                  "krum", "multi_krum", "bulyan", "centered_clipping"])
def test_every_rule_returns_each_leaf_in_its_dtype(name):
  """A bfloat16 leaf beside a float32 one: each comes back in its own dtype, at the rule's float32 result on the
  same values (the bfloat16 inputs exactly) within bfloat16's rounding."""
  agg = RULES[name]
  rng = np.random.default_rng(17)
  x = rng.normal(size=(C, 10))
  w = np.where(np.arange(C) % 4 == 3, 0.0, 1.0)
  tree = {"a": jnp.asarray(x[:, :6].reshape(-1, 3, 2), jnp.bfloat16), "b": jnp.asarray(x[:, 6:], jnp.float32)}
  as_f32 = jax.tree.map(lambda u: u.astype(jnp.float32), tree)
  state = agg.init(jax.tree.map(lambda u: u[0], tree))
  out, _ = jax.jit(agg.aggregate)(tree, jnp.asarray(w, jnp.float32), state, KEY)
  assert out["a"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float32
  want, _ = jax.jit(agg.aggregate)(as_f32, jnp.asarray(w, jnp.float32), agg.init(jax.tree.map(lambda u: u[0], as_f32)),
                                   KEY)
  np.testing.assert_allclose(to_vec(out), to_vec(want), rtol=2e-2, atol=2e-2)


def test_centered_clipping_norms_are_scaled_float32_over_every_leaf():
  """‖v_i − v‖ is taken over all leaves in float32 at least (a float32 leaf beside a bfloat16 one is clipped to
  float32 precision), scaled by the row's largest entry: rows of 10³⁰ (whose squares overflow float32) and of
  10⁻³⁰ (whose squares underflow) are clipped at the float64 reference's τ/‖v_i‖; a zero-size leaf is fine."""
  rng = np.random.default_rng(18)
  x = rng.normal(size=(5, 6))
  agg = A.centered_clipping(0.5)
  tree = {"a": jnp.asarray(x[:, :2], jnp.bfloat16), "b": jnp.asarray(x[:, 2:], jnp.float32)}
  out, _ = jax.jit(agg.aggregate)(tree, jnp.ones(5, jnp.float32), agg.init(jax.tree.map(lambda u: u[0], tree)), KEY)
  rows = np.concatenate([np.asarray(tree["a"], np.float64), x[:, 2:]], axis=1)
  np.testing.assert_allclose(np.asarray(out["b"]), np_centered_clipping(rows, np.zeros(6), 0.5, 1)[2:], rtol=1e-6)
  for scale in (1e30, 1e-30):
    rows = (scale * x).astype(np.float32)
    agg = A.centered_clipping(0.1 * scale)
    tree = {"p": jnp.asarray(rows), "empty": jnp.zeros((5, 0), jnp.float32)}
    out, _ = jax.jit(agg.aggregate)(tree, jnp.ones(5, jnp.float32), agg.init(jax.tree.map(lambda u: u[0], tree)),
                                    KEY)
    want = np_centered_clipping(rows.astype(np.float64), np.zeros(6), np.float32(0.1 * scale), 1)
    np.testing.assert_allclose(np.asarray(out["p"], np.float64) / scale, want / scale, rtol=1e-5)
    assert out["empty"].shape == (0,)


def test_norms_and_distances_of_bfloat16_rows_are_float32():
  """The rules measure bfloat16 models in float32 (at least the float32 of `jnp.result_type`): the row norms of
  centered clipping and GeoMed, and Krum's pairwise squared distances, are float32 and within float32 rounding of
  the float64 values of the same (bfloat16) inputs; computed in bfloat16 they would be off by 2⁻⁹ relative."""
  from fedjax_opt.aggregators import robust  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(21)
  x = rng.normal(size=(7, 40)) * np.linspace(0.1, 30, 40)
  tree = {"a": jnp.asarray(x[:, :25], jnp.bfloat16), "b": jnp.asarray(x[:, 25:], jnp.bfloat16)}
  rows = np.concatenate([np.asarray(tree["a"], np.float64), np.asarray(tree["b"], np.float64)], axis=1)
  norms = robust._norms(tree)
  assert norms.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(norms), np.linalg.norm(rows, axis=1), rtol=1e-6)
  mask = jnp.ones(7, bool)
  sq = robust._pairwise_sq_distances(tree, mask, jnp.sum(mask))
  assert sq.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(sq), ((rows[:, None] - rows[None]) ** 2).sum(-1), rtol=1e-5)


def test_bulyan_with_few_clients_taking_part_keeps_one_krum_choice():
  """n ≤ 2f + 1 taking part (rows dropped this round): θ = max(n − 2f, 1) = 1 pick, β = 1, so Bulyan is the Krum
  choice among them (neighbour count clipped to 1)."""
  x, _ = data(19)
  few = np.where(np.arange(C) < 5, 1.0, 0.0)  # n = 5 = 2f + 1 with f = 2 (C = 11 ≥ 4f + 3)
  np.testing.assert_allclose(aggregate(BULYAN[2], x, few)[0], np_krum(x[:5], 2), rtol=1e-12)


# ---- properties --------------------------------------------------------------------------------------------

# The same aggregator objects as above where the rule is the same, so `aggregate` compiles each once.
RULES = {
    "marginal_median": MARMED,
    "mean_around_median": MEAMED[2],
    "geometric_median": A.geometric_median(tol=1e-12, max_iterations=500, smoothing=1e-12),
    "geometric_median_weighted": A.geometric_median(tol=1e-12, max_iterations=500, smoothing=1e-12, weighted=True),
    "trimmed_mean": A.trimmed_mean(0.2),
    "krum": A.krum(2),
    "multi_krum": A.multi_krum(2, 3),
    "bulyan": BULYAN[2],
    "centered_clipping": A.centered_clipping(100.0, 2),
}


def _run(name, x, w):
  """RULES[name]'s aggregate of x [C, 10] with weights w, in float64 (through `aggregate`'s compiled rounds)."""
  return aggregate(RULES[name], x, w)[0]


cases = st.tuples(st.integers(0, 2**31 - 1), st.lists(st.booleans(), min_size=C, max_size=C).filter(
    lambda m: sum(m) >= 3), st.permutations(list(range(C))))


@pytest.mark.parametrize("name", sorted(RULES))
@settings(max_examples=6, deadline=None)
@given(case=cases)
def test_invariant_to_client_order_and_blind_to_absent_rows(name, case):
  """The same clients in any order give the same aggregate; rows of weight 0 may hold anything (1e30, NaN)."""
  seed, present, perm = case
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(C, 10))
  w = np.where(present, rng.uniform(1, 10, size=C), 0.0)
  got = _run(name, x, w)
  np.testing.assert_allclose(_run(name, x[perm], w[perm]), got, rtol=1e-9, atol=1e-12)
  garbage = x.copy()
  garbage[~np.asarray(present)] = rng.choice([1e30, -1e30, np.nan, np.inf], size=(C - sum(present), 10))
  np.testing.assert_array_equal(_run(name, garbage, w), got)


@pytest.mark.parametrize("name", sorted(RULES))
def test_clients_that_agree_give_their_update(name):
  v = np.random.default_rng(7).normal(size=10)
  x = np.tile(v, (C, 1))
  w = np.ones(C)
  w[[2, 5]] = 0
  x[2], x[5] = 1e30, np.nan
  np.testing.assert_allclose(_run(name, x, w), v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(RULES))
def test_no_client_taking_part_gives_zeros(name):
  x = np.random.default_rng(8).normal(size=(C, 10))
  np.testing.assert_array_equal(_run(name, x, np.zeros(C)), np.zeros(10))


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_nonfinite_row_taking_part_counts_as_absent(name):
  """Called directly, with NaN or ±inf in rows that take part, every rule gives its result over the finite rows:
  the same as with those rows at weight 0 (in a round the guard drops them first and counts them)."""
  x, w = data(9)
  bad = x.copy()
  bad[0, 4], bad[7, 0] = np.inf, -np.inf
  bad[5] = np.nan
  dropped = w.copy()
  dropped[[0, 5, 7]] = 0
  got = _run(name, bad, w)
  assert np.all(np.isfinite(got))
  np.testing.assert_array_equal(got, _run(name, x, dropped))


def test_mean_around_median_breaks_distance_ties_toward_the_smaller_value():
  """On a grid of small integers the values tie in distance to the median all the time: the n − q kept are the
  closest, equal distances going to the smaller value (the NumPy reference's lexsort). By hand, one column of the
  n = 9 values {−2, −1, −1, 0, 0, 0, 1, 1, 2} with q = 4 keeps 0, 0, 0 and then two of ±1 (a tie): −1 and −1."""
  rng = np.random.default_rng(10)
  for seed in range(3):
    x, w = data(seed)
    x[w > 0] = rng.integers(-3, 4, size=(int(np.sum(w > 0)), 10))
    for q in (0, 2, 4):
      np.testing.assert_allclose(aggregate(MEAMED[q], x, w)[0], np_mean_around_median(x[w > 0], q), rtol=1e-12,
                                 atol=1e-12)
  x, w = data(0)
  x[w > 0, 0] = [1, -1, 0, 2, 0, -1, 0, -2, 1]
  assert aggregate(MEAMED[4], x, w)[0][0] == -2 / 5
  # Two clients taking part, equally far from their median 1.5: q = 0 keeps both (the mean, 1.5); q = 4 ≥ n
  # keeps one, max(n − q, 1) = 1 value, the closer-or-smaller 0.
  w = np.where(np.arange(len(w)) < 2, 1.0, 0.0)
  x[:2, 0] = [0.0, 3.0]
  assert aggregate(MEAMED[0], x, w)[0][0] == 1.5
  assert aggregate(MEAMED[4], x, w)[0][0] == 0.0
  x[:3, 0], w[2] = [0.0, 1.0, 5.0], 1.0  # three: the median 1 itself
  assert aggregate(MEAMED[4], x, w)[0][0] == 1.0


# ---- arguments ---------------------------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match=r"trimmed_mean: beta must be a float in \[0, 0.5\).*got 0.5"):
    A.trimmed_mean(0.5)
  with pytest.raises(ValueError, match="mean_around_median: num_byzantine must be a Python int >= 0; got -1"):
    A.mean_around_median(-1)
  with pytest.raises(TypeError, match="krum: num_byzantine must be a Python int >= 0; got float 1.5"):
    A.krum(1.5)
  with pytest.raises(ValueError, match="multi_krum: m must be a Python int >= 1; got 0"):
    A.multi_krum(1, 0)
  with pytest.raises(ValueError, match="geometric_median: smoothing must be a float > 0"):
    A.geometric_median(smoothing=0.0)
  with pytest.raises(ValueError, match="geometric_median: max_iterations must be a Python int >= 1; got 0"):
    A.geometric_median(max_iterations=0)
  with pytest.raises(ValueError, match="centered_clipping: tau must be > 0"):
    A.centered_clipping(0.0)
  with pytest.raises(ValueError, match=r"centered_clipping: momentum must be a float in \[0, 1\); got 1.0"):
    A.centered_clipping(1.0, momentum=1.0)
  x, w = data(0)
  # Static row counts too small for the number of Byzantine clients, found when the round is traced.
  with pytest.raises(ValueError, match=r"krum: num_byzantine = 5 needs n > 2·num_byzantine \+ 2 clients, at least "
                                       r"13; the round has C = 11 rows"):
    aggregate(A.krum(5), x, w)
  with pytest.raises(ValueError, match=r"bulyan: num_byzantine = 3 needs n ≥ 4·num_byzantine \+ 3 clients, at least "
                                       r"15; the round has C = 11 rows"):
    aggregate(A.bulyan(3), x, w)
  with pytest.raises(ValueError, match="mean_around_median: num_byzantine = 11 must be smaller than the number of "
                                       "clients in the round, C = 11"):
    aggregate(A.mean_around_median(11), x, w)
  with pytest.raises(ValueError, match="multi_krum: m = 12 must be at most the number of clients in the round, C = 11"):
    aggregate(A.multi_krum(1, 12), x, w)
  for name, agg in RULES.items():  # every rule checks the stacking of every leaf
    with pytest.raises(ValueError, match=r"every leaf of updates must be stacked \[C, ...\] with C = 11"):
      agg.aggregate({"a": jnp.ones((11, 2)), "b": jnp.ones((10, 2))}, jnp.ones(11), agg.init(None), KEY)


# ---- the paper's claims -------------------------------------------------------------------------------------


def _honest_and_attacked(attack, attackers, seed=0, n=15, d=40):
  """n clients near a common mean; the attack applied by `corrupt` around an aggregator that hands back the
  stacked updates it receives (one jitted program)."""
  rng = np.random.default_rng(seed)
  honest_mean = rng.normal(size=d)
  x = honest_mean + 0.1 * rng.normal(size=(n, d))
  identity = A.Aggregator(lambda p: (), lambda updates, weights, state, key: (updates, state))
  spy = attacks.corrupt(identity, attack, attackers=attackers)
  w = jnp.ones(n, jnp.float32)
  seen, _ = jax.jit(spy.aggregate)({"p": jnp.asarray(x, jnp.float32)}, w, spy.init(None), jax.random.key(seed))
  return x, np.asarray(seen["p"], np.float64), np.ones(n)


@functools.cache
def _rule(make, *args):
  """One aggregator object per rule and arguments, so tests asking for the same rule share its compiled round."""
  return make(*args)


def _rule_output(agg, x, w):
  out, _ = jax.jit(agg.aggregate)({"p": jnp.asarray(x, jnp.float32)}, jnp.asarray(w, jnp.float32),
                         agg.init({"p": jnp.zeros(x.shape[1], jnp.float32)}), KEY)
  return np.asarray(out["p"], np.float64)


def test_classic_byzantine_pulls_the_mean_arbitrarily_far_but_not_the_medians():
  """4 of 15 clients send −1e4 × the sum of the honest updates (omniscient): the mean moves by ~10⁵, the three
  medians (and the other robust rules) stay within the honest spread of the honest mean."""
  x, attacked, w = _honest_and_attacked(attacks.omniscient(1e4), 4)
  rows = np.any(attacked != x.astype(np.float32), axis=1)
  assert rows.sum() == 4
  honest = x[~rows].mean(0)
  assert np.linalg.norm(_rule_output(A.mean(), attacked, w) - honest) > 1e4
  for agg in (_rule(A.geometric_median), _rule(A.marginal_median), _rule(A.mean_around_median, 4),
              A.trimmed_mean(0.3), A.krum(4), A.multi_krum(4), A.bulyan(3)):
    assert np.linalg.norm(_rule_output(agg, attacked, w) - honest) < 0.5, agg  # honest spread: ‖0.1 ξ‖ ≈ 0.63


def test_dimensional_byzantine_pulls_the_geometric_median_far_but_not_the_coordinate_wise_medians():
  """Every client corrupted somewhere, every coordinate on 6 of 15 clients (< half), values 1e3: the geometric
  median (and Krum) move by ~10³; marginal median, mean-around-median (and the trimmed mean) keep every coordinate
  within the range of that coordinate's correct values, and mean-around-median with q = 6 is their mean."""
  attack = attacks.generalized_byzantine(0.4, 1e3)
  x, attacked, w = _honest_and_attacked(attack, 1.0)
  bad = attacked == np.float32(1e3)
  np.testing.assert_array_equal(bad.sum(0), 6)  # per coordinate: 6 of 15
  assert bad.any(1).all()  # every client is wrong somewhere
  correct = np.ma.masked_array(attacked, bad)
  low, high, correct_mean = correct.min(0).data, correct.max(0).data, correct.mean(0).data
  assert np.linalg.norm(_rule_output(_rule(A.geometric_median), attacked, w) - x.mean(0)) > 100
  assert np.linalg.norm(_rule_output(A.krum(6), attacked, w) - x.mean(0)) > 100
  for agg in (_rule(A.marginal_median), _rule(A.mean_around_median, 6), A.trimmed_mean(0.4)):
    out = _rule_output(agg, attacked, w)
    assert np.all((out >= low - 1e-6) & (out <= high + 1e-6)), agg
  np.testing.assert_allclose(_rule_output(_rule(A.mean_around_median, 6), attacked, w), correct_mean, rtol=1e-5,
                             atol=1e-6)


# ---- inside FedAvg -----------------------------------------------------------------------------------------

FEDAVG_RULES = {
    "marginal_median": lambda: A.marginal_median(),
    "mean_around_median": lambda: A.mean_around_median(2),
    "geometric_median": lambda: A.geometric_median(),
    "trimmed_mean": lambda: A.trimmed_mean(0.2),
    "krum": lambda: A.krum(1),
    "multi_krum": lambda: A.multi_krum(1),
    "bulyan": lambda: A.bulyan(1),
    "centered_clipping": lambda: A.centered_clipping(10.0, 2),
}


def _lsq_setup(identical):
  rng = np.random.default_rng(0)
  d = 4
  if identical:
    x = rng.normal(size=(12, d))
    y = x @ rng.normal(size=d)
    clients = [(x, y)] * 7
  else:  # IID clients: one target model, each client its own inputs and noise
    w_star = rng.normal(size=d)
    clients = []
    for _ in range(7):
      x = rng.normal(size=(12, d))
      clients.append((x, x @ w_star + 1.0 + 0.3 * rng.normal(size=12)))
  batches = pack(clients, steps=3, batch=4, extra_clients=1)  # 8 rows: one zero-weight padding client
  params = {"w": jnp.zeros(d, jnp.float32), "b": jnp.zeros((), jnp.float32)}
  return batches, params


def _fedavg_step(aggregator):
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.05), aggregator=aggregator, client_map="vmap")
  return algo, jax.jit(algo.step)


def _fedavg_run(algo_and_step, batches, params, rounds=5):
  algo, step = algo_and_step
  state = algo.init(params, jax.random.key(0))
  losses = []
  for _ in range(rounds):
    state = step(state, batches)
    losses.append(float(state.metrics["client_loss"]))
  return state, losses


@pytest.fixture(scope="module")
def identical_clients_mean_run():
  batches, params = _lsq_setup(identical=True)
  return _fedavg_run(_fedavg_step(A.mean()), batches, params)[0]


@pytest.mark.parametrize("name", sorted(FEDAVG_RULES))
def test_fedavg_with_each_rule(name, identical_clients_mean_run):
  """Identical clients: every rule's rounds equal the mean's; IID clients: the loss falls every round."""
  algo_and_step = _fedavg_step(FEDAVG_RULES[name]())
  batches, params = _lsq_setup(identical=True)
  got, _ = _fedavg_run(algo_and_step, batches, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got.params,
               identical_clients_mean_run.params)
  assert int(got.metrics["num_clients"]) == 7
  batches, params = _lsq_setup(identical=False)
  state, losses = _fedavg_run(algo_and_step, batches, params)
  assert all(b < a for a, b in itertools.pairwise(losses)), losses
  assert bool(state.metrics["round_accepted"])


def _local_deltas(batches, params, lr, steps):
  """Each client's local SGD on the mean least-squares loss of each step's batch, in float64 NumPy: [C, d + 1]."""
  x, y = np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64)
  w0, b0 = np.asarray(params["w"], np.float64), float(params["b"])
  deltas = []
  for k in range(x.shape[0]):
    w, b = w0.copy(), b0
    for s in range(steps):
      gw, gb = lsq_grad_np(w, b, x[k, s], y[k, s])
      w, b = w - lr * gw, b - lr * gb
    deltas.append(np.append(w - w0, b - b0))
  return np.array(deltas)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e40 as float32: the point
@pytest.mark.parametrize("name,reference", [("mean_around_median", lambda v: np_mean_around_median(v, 2)),
                                            ("bulyan", lambda v: np_bulyan(v, 1))])
def test_fedavg_round_drops_attackers_whose_values_overflow(name, reference):
  """FedAvg + corrupt(rule, omniscient(1e40)) in float32: attackers 1 and 4 send ±inf. The round counts them in
  num_nonfinite, aggregates the 5 finite clients with the rule, and the model moves by the rule over their deltas
  (local SGD and the rule in float64 NumPy). Before, MeaMed kept a silent 0 and Bulyan an all-zero update."""
  batches, params = _lsq_setup(identical=False)
  aggregator = attacks.corrupt(FEDAVG_RULES[name](), attacks.omniscient(1e40), attackers=[1, 4])
  algo, step = _fedavg_step(aggregator)
  state = step(algo.init(params, jax.random.key(0)), batches)
  assert int(state.metrics["num_nonfinite"]) == 2 and int(state.metrics["num_clients"]) == 5
  assert bool(state.metrics["round_accepted"])
  deltas = _local_deltas(batches, params, 0.05, 3)
  honest = np.isin(np.arange(8), [0, 2, 3, 5, 6])
  want = reference(deltas[honest])
  got = np.append(np.asarray(state.params["w"]), float(state.params["b"]))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _attacked_lsq(aggregator, attacked=True, rounds=30):
  """10 IID least-squares clients, 4 of them omniscient (−10 × the sum of the honest deltas): ‖w − w*‖ per round."""
  rng = np.random.default_rng(1)
  d = 5
  w_star = rng.normal(size=d)
  clients = []
  for _ in range(10):
    x = rng.normal(size=(16, d))
    clients.append((x, x @ w_star + 0.3 * rng.normal(size=16)))
  batches = pack(clients, steps=4, batch=4)
  if attacked:
    aggregator = attacks.corrupt(aggregator, attacks.omniscient(10.0), attackers=0.4)
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.05), aggregator=aggregator, client_map="vmap")
  state = algo.init({"w": jnp.zeros(d, jnp.float32), "b": jnp.zeros((), jnp.float32)}, jax.random.key(0))

  def one_round(s, _):
    s = algo.step(s, batches)
    return s, s.params["w"]

  state, ws = jax.lax.scan(one_round, state, None, length=rounds)
  if attacked:
    assert int(state.aggregator_state.num_attackers) == 4
  return np.linalg.norm(np.asarray(ws, np.float64) - w_star, axis=1)


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_forty_percent_omniscient_attackers_on_least_squares():
  """Xie et al.'s evaluation on a quadratic: with 4 of 10 clients omniscient, the mean is driven away; the three
  medians converge; mean-around-median keeps the attack-free pace while the marginal median is slower."""
  clean = _attacked_lsq(A.mean(), attacked=False)
  errors = {name: _attacked_lsq(agg) for name, agg in {
      "mean": A.mean(), "geometric_median": A.geometric_median(), "marginal_median": A.marginal_median(),
      "mean_around_median": A.mean_around_median(4)}.items()}
  assert not errors["mean"][-1] < 1e3, errors["mean"]  # far away (or NaN)
  for name in ("geometric_median", "marginal_median", "mean_around_median"):
    assert errors[name][-1] < 0.5 and errors[name][-1] < errors[name][9] < errors[name][0], (name, errors[name])
  assert errors["mean_around_median"][-1] < 2 * clean[-1], (errors["mean_around_median"], clean)
  assert np.all(errors["marginal_median"][9:] > 2 * errors["mean_around_median"][9:]), errors
