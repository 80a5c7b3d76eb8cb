"""L2GD / L2SGD / L2SGD+ (Hanzely & Richtárik 2020) against float64 NumPy closed forms on quadratic clients.

f_i(x) = ½‖A_i x − b_i‖² / m_i. The mixture optimum x(λ) solves the linear
stationarity system H_i x_i − g_i + λ(x_i − x̄) = 0 for all i, with
H_i = A_iᵀA_i/m_i and g_i = A_iᵀb_i/m_i: one NumPy solve.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import mixture_objective, mixture_optimum, quadratic_grads, quadratic_hessians

import fedjax_opt as fo
from fedjax_opt import objectives
from fedjax_opt.algorithms import mixture as mx

N, D, M = 4, 3, 6
MAP = "vmap"  # tiny models: one vmapped program is the fastest on CPU


def quad_loss(w, batch):
  """Per-example ½(aᵀw − b)²."""
  return 0.5 * jnp.square(batch["a"] @ w - batch["b"])


def _problem(seed=0, n=N, m=M):
  rng = np.random.default_rng(seed)
  a = np.stack([rng.normal(loc=0.3 * i, size=(m, D)) for i in range(n)])
  b = np.stack([ai @ rng.normal(size=D) + 0.1 * rng.normal(size=m) for ai in a])
  return a, b


def _batches(a, b, steps=2):
  """Every client's m examples as S = `steps` steps of m/S slots, full participation."""
  n, m = b.shape
  return fo.ClientBatches(
      data={"a": jnp.asarray(a.reshape(n, steps, m // steps, D)), "b": jnp.asarray(b.reshape(n, steps, m // steps))},
      mask=jnp.ones((n, steps, m // steps), bool),
      weight=jnp.full((n,), float(m)),
      client_id=jnp.arange(n, dtype=jnp.int32))


_hessians = quadratic_hessians


_optimum = mixture_optimum


_grads = quadratic_grads


_objective = mixture_objective


def _constants(a, b):
  """(L of f_i, L of f_ij, μ of f_i)."""
  h, _ = _hessians(a, b)
  eig = np.linalg.eigvalsh(h)
  return eig.max(), np.max(np.sum(a**2, -1)), eig.min()


def _run(algo, batches, steps, key=0, reference=None):
  """One jitted lax.scan over `steps` iterations; also returns ‖x^k − reference‖² per iteration."""
  ref = jnp.zeros((N, D)) if reference is None else jnp.asarray(reference)

  def body(state, _):
    state = algo.step(state, batches)
    return state, jnp.sum(jnp.square(state.local_params - ref))

  init = algo.init(jnp.zeros(D), jax.random.key(key))
  state, gaps = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(init)
  return state, np.asarray(gaps)


def test_l2gd_iterations_match_numpy_in_both_branches():
  """Algorithm 1 line by line from a random start; the coin read back from metrics['aggregated']."""
  lam, alpha, p = 0.7, 0.3, 0.5
  with jax.enable_x64(True):
    a, b = _problem()
    batches = _batches(a, b)
    algo = mx.l2gd(quad_loss, lam, alpha, p, num_clients=N)
    x = np.random.default_rng(1).normal(size=(N, D))
    state = algo.init(jnp.zeros(D), jax.random.key(3)).replace(local_params=jnp.asarray(x))
    step = jax.jit(algo.step)
    seen = set()
    for _ in range(8):
      state = step(state, batches)
      coin = bool(state.metrics["aggregated"])
      seen.add(coin)
      np.testing.assert_allclose(float(state.metrics["objective"]), _objective(a, b, x, lam), rtol=1e-12)
      if coin:
        x = x - alpha * lam / (N * p) * (x - x.mean(0))
      else:
        x = x - alpha / (N * (1 - p)) * _grads(a, b, x)
      np.testing.assert_allclose(np.asarray(state.local_params), x, rtol=1e-12, atol=1e-14)
      np.testing.assert_allclose(np.asarray(state.params), x.mean(0), rtol=1e-12, atol=1e-14)
    assert seen == {True, False}
    np.testing.assert_allclose(fo.personalized_params(state, 2), x[2], rtol=1e-12)


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_l2sgd_plus_reaches_the_optimum_where_l2sgd_stalls():
  """Figure 3 of the paper: same α and p, L2SGD+ converges linearly to x(λ), L2SGD only to a neighbourhood."""
  lam = 1.0
  with jax.enable_x64(True):
    a, b = _problem()
    batches = _batches(a, b)
    x_star = _optimum(a, b, lam)
    _, l_example, mu = _constants(a, b)
    p = mx.optimal_p(lam, l_example)
    alpha = mx.l2sgd_plus_step_size(lam, l_example, mu, p, N, M)
    plus_algo = mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, smoothness=l_example, mu=mu,
                              client_map=MAP)
    plus, gaps = _run(plus_algo, batches, 3000, reference=x_star)
    plain, plain_gaps = _run(mx.l2sgd(quad_loss, lam, alpha, p, num_clients=N, client_map=MAP), batches, 3000,
                             reference=x_star)
    assert gaps[-1] < 1e-8 * np.sum(x_star**2), gaps[-1]
    assert gaps[1999] < 1e-3 * gaps[499] and gaps[-1] < 1e-3 * gaps[1499]  # linear: a fixed factor per block
    assert plain_gaps[-1000:].min() > 1e-4, plain_gaps[-1000:].min()
    # The SAGA table holds per-example gradients and Ψ_i = λ(x_i − x̄) at the optimum.
    table = np.asarray(plus.gradient_table).reshape(N, M, D)
    np.testing.assert_allclose(table.mean(1), _grads(a, b, x_star), atol=1e-5)
    np.testing.assert_allclose(np.asarray(plus.aggregation_control), lam * (x_star - x_star.mean(0)), atol=1e-5)


def test_l2gd_stalls_in_a_neighbourhood_that_shrinks_with_the_step_size():
  """Theorem 4.4: exact gradients, yet the coin's noise leaves E‖x^k − x(λ)‖² = O(α) away from 0."""
  lam = 1.0
  with jax.enable_x64(True):
    a, b = _problem()
    batches = _batches(a, b)
    x_star = _optimum(a, b, lam)
    l_f, _, _ = _constants(a, b)
    p = mx.optimal_p(lam, l_f)
    alpha = mx.l2gd_max_step_size(lam, l_f, p, N)
    floors = []
    for scale in (1.0, 0.05):
      _, gaps = _run(mx.l2gd(quad_loss, lam, scale * alpha, p, num_clients=N, client_map=MAP), batches, 4000,
                     reference=x_star)
      floors.append(gaps[-2000:].mean())
      assert gaps[-2000:].min() > 1e-9, gaps[-2000:].min()
    assert floors[1] < 0.2 * floors[0], floors


def test_optimum_identity_and_the_objective():
  """x_i* = x̄* − ∇f_i(x_i*)/λ on L2SGD+'s limit; ∇F(x(λ)) = 0 (autodiff of objectives.mixture); F = NumPy."""
  lam = 2.0
  with jax.enable_x64(True):
    a, b = _problem(seed=1)
    batches = _batches(a, b)
    _, l_example, mu = _constants(a, b)
    p = mx.optimal_p(lam, l_example)
    alpha = mx.l2sgd_plus_step_size(lam, l_example, mu, p, N, M)
    state, _ = _run(mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, client_map=MAP), batches,
                    3000)
    x = np.asarray(state.local_params)
    np.testing.assert_allclose(x, x.mean(0) - _grads(a, b, x) / lam, atol=1e-9)
    np.testing.assert_allclose(np.asarray(state.params), x.mean(0), rtol=1e-12)
    objective = objectives.mixture(quad_loss, lam)
    grad = jax.grad(objective)(jnp.asarray(_optimum(a, b, lam)), batches)
    np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-12)
    y = np.random.default_rng(2).normal(size=(N, D))
    np.testing.assert_allclose(float(jax.jit(objective)(jnp.asarray(y), batches)), _objective(a, b, y, lam),
                               rtol=1e-12)


def test_lambda_zero_gives_purely_local_models():
  """λ = 0: aggregation steps do nothing and each x_i converges to argmin f_i (least squares on client i)."""
  with jax.enable_x64(True):
    a, b = _problem()
    l_f, _, _ = _constants(a, b)
    p = 0.1  # mostly local steps; each is then x_i ← x_i − (0.95/L) ∇f_i(x_i)
    state, _ = _run(mx.l2gd(quad_loss, 0.0, 0.95 * N * (1 - p) / l_f, p, num_clients=N, client_map=MAP),
                    _batches(a, b), 4000)
    local = np.stack([np.linalg.lstsq(ai, bi, rcond=None)[0] for ai, bi in zip(a, b)])
    np.testing.assert_allclose(np.asarray(state.local_params), local, atol=1e-8)


def test_large_lambda_drives_every_model_to_the_global_optimum():
  """‖x_i(λ) − argmin Σ f_i‖ = O(1/λ); L2SGD+ at λ = 10 reaches x(λ)."""
  with jax.enable_x64(True):
    a, b = _problem()
    h, g = _hessians(a, b)
    x_global = np.linalg.solve(h.sum(0), g.sum(0))
    dist = [np.abs(_optimum(a, b, lam) - x_global).max() for lam in (1e1, 1e3, 1e5)]
    assert dist[0] > 50 * dist[1] > 2500 * dist[2], dist
    lam = 10.0
    _, l_example, mu = _constants(a, b)
    p = mx.optimal_p(lam, l_example)
    alpha = mx.l2sgd_plus_step_size(lam, l_example, mu, p, N, M)
    _, gaps = _run(mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, client_map=MAP),
                   _batches(a, b), 4000, reference=_optimum(a, b, lam))
    assert gaps[-1] < 1e-10, gaps[-1]


def test_expected_number_of_communications():
  """Lemma 4.2: communications (coin 0 → 1) over k steps average p(1−p) per step; 4000 seeds, vmap over keys."""
  p, k, seeds = 0.3, 100, 4000
  a, b = _problem(n=2, m=2)
  batches = _batches(a.astype(np.float32), b.astype(np.float32), steps=1)
  algo = mx.l2gd(quad_loss, 1.0, 0.1, p, num_clients=2, client_map="vmap")

  def count(key):
    state = algo.init(jnp.zeros(D), key)
    state, _ = jax.lax.scan(lambda s, _: (algo.step(s, batches), None), state, None, length=k)
    return state.metrics["num_communications"]

  counts = np.asarray(jax.jit(jax.vmap(count))(jax.random.split(jax.random.key(0), seeds)), np.float64)
  expected = (k - 1) * p * (1 - p)  # the run starts in sync (ξ_{−1} = 1): k − 1 possible 0 → 1 transitions
  assert abs(counts.mean() - expected) < 4 * counts.std() / np.sqrt(seeds), (counts.mean(), expected)


def test_bad_input():
  with pytest.raises(ValueError, match=r"lam must be finite and >= 0"):
    mx.l2gd(quad_loss, -1.0, 0.1, 0.5, num_clients=N)
  for p in (0.0, 1.0, 1.5, -0.1):
    with pytest.raises(ValueError, match=r"p must lie in the open interval \(0, 1\)"):
      mx.l2sgd_plus(quad_loss, 1.0, 0.1, p, num_clients=N, num_examples=M)
  with pytest.raises(ValueError, match=r"alpha must be finite and > 0"):
    mx.l2sgd(quad_loss, 1.0, 0.0, 0.5, num_clients=N)
  bound = mx.l2gd_max_step_size(1.0, 2.0, 0.5, N)
  assert bound == pytest.approx(0.5 * N * min(0.5 / 2.0, 0.5 / 1.0))
  with pytest.warns(UserWarning, match=r"exceeds the theoretical bound .*Theorem 4.4\) = 0.5"):
    mx.l2gd(quad_loss, 1.0, 0.6, 0.5, num_clients=N, smoothness=2.0)
  with pytest.warns(UserWarning, match=r"Theorem 5.2"):
    mx.l2sgd_plus(quad_loss, 1.0, 10.0, 0.5, num_clients=N, num_examples=M, smoothness=2.0, mu=0.1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    mx.l2gd(quad_loss, 1.0, 0.5, 0.5, num_clients=N, smoothness=2.0)  # at the bound: no warning
  a, b = _problem()
  algo = mx.l2sgd_plus(quad_loss, 1.0, 0.1, 0.5, num_clients=N, num_examples=M + 1)
  with pytest.raises(ValueError, match=r"S·B = num_examples = 7"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), _batches(a, b))
  algo = mx.l2gd(quad_loss, 1.0, 0.1, 0.5, num_clients=N + 1)
  with pytest.raises(ValueError, match=r"every one of the num_clients = 5 clients"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), _batches(a, b))


def test_vmap_over_lambda_of_the_scanned_solver():
  """jax.vmap over traced (λ, α, p) of a jitted lax.scan: each lane reaches its own x(λ) and equals the lone run."""
  with jax.enable_x64(True):
    a, b = _problem()
    batches = _batches(a, b)
    _, l_example, mu = _constants(a, b)
    lams = jnp.array([0.5, 2.0, 4.0])
    ps = mx.optimal_p(lams, l_example)
    alphas = mx.l2sgd_plus_step_size(lams, l_example, mu, ps, N, M)

    def solve(lam, alpha, p):
      algo = mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, client_map=MAP)
      state = algo.init(jnp.zeros(D), jax.random.key(0))
      return jax.lax.scan(lambda s, _: (algo.step(s, batches), None), state, None, length=3000)[0].local_params

    swept = np.asarray(jax.jit(jax.vmap(solve))(lams, alphas, ps))
    for i, lam in enumerate(np.asarray(lams)):
      np.testing.assert_allclose(swept[i], _optimum(a, b, lam), atol=1e-7)
    lone = jax.jit(solve)(lams[1], alphas[1], ps[1])
    np.testing.assert_allclose(swept[1], np.asarray(lone), rtol=1e-10, atol=1e-12)


def _uploads_from_coins(coins):
  """Independent count for the efficient L2SGD+: an aggregation step uploads iff it is the 1st or 2nd of its run
  of consecutive ξ = 1 and some local step (ξ = 0) came before it (at the start the master knows x̄ and drift 0)."""
  uploads, run, seen_local = [], 0, False
  for c in coins:
    if c:
      run += 1
      uploads.append(seen_local and run <= 2)
    else:
      run, seen_local = 0, True
      uploads.append(False)
  return np.asarray(uploads)


def test_efficient_l2sgd_plus_has_the_plain_iterates_and_uploads_models_only():
  """variant="efficient": the same x^k as Algorithm 2 (float64, same coins), x(λ) reached, uploads counted exactly."""
  lam, p, k = 1.0, 0.5, 3000  # p = 1/2: many runs of 3+ aggregation steps, where the master extrapolates x̄
  with jax.enable_x64(True):
    a, b = _problem()
    batches = _batches(a, b)
    x_star = _optimum(a, b, lam)
    _, l_example, mu = _constants(a, b)
    alpha = mx.l2sgd_plus_step_size(lam, l_example, mu, p, N, M)
    runs = {}
    for variant in ("plain", "efficient"):
      algo = mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, variant=variant, client_map=MAP)
      body = lambda s, _, algo=algo: (algo.step(s, batches),) * 2
      init = algo.init(jnp.zeros(D), jax.random.key(4))
      runs[variant] = jax.jit(lambda s, body=body: jax.lax.scan(body, s, None, length=k))(init)
    (plain, plain_path), (eff, eff_path) = runs["plain"], runs["efficient"]
    np.testing.assert_allclose(np.asarray(eff_path.local_params), np.asarray(plain_path.local_params),
                               rtol=1e-9, atol=1e-12)
    assert np.sum((np.asarray(eff.local_params) - x_star)**2) < 1e-8 * np.sum(x_star**2)
    # The fact the variant rests on: mean_i Ψ_i = 0 at every iteration.
    np.testing.assert_allclose(np.asarray(eff_path.aggregation_control).mean(1), 0.0, atol=1e-12)
    coins = np.asarray(eff_path.metrics["aggregated"])
    np.testing.assert_array_equal(coins, np.asarray(plain_path.metrics["aggregated"]))
    uploads = _uploads_from_coins(coins)
    np.testing.assert_array_equal(np.asarray(eff_path.metrics["communicated"]), uploads)
    assert int(eff.metrics["num_communications"]) == int(eff.metrics["num_vectors_sent"]) == uploads.sum()
    transitions = int(np.sum(coins[1:] & ~coins[:-1]))
    assert int(plain.metrics["num_communications"]) == transitions
    assert int(plain.metrics["num_vectors_sent"]) == 3 * transitions
    assert sum(run >= 3 for run in map(len, "".join("1" if c else "0" for c in coins).split("0"))) > 50
    # Expected uploads per iteration p(1−p)(1+p): 0.375 here (a ±4σ band of a Bernoulli-ish count).
    assert abs(uploads.sum() / k - p * (1 - p) * (1 + p)) < 4 * np.sqrt(0.375 / k)
    assert uploads.sum() < 3 * transitions  # fewer vectors than the plain variant


def test_l2sgd_plus_step_size_is_the_theorem_bound_and_sits_below_divergence():
  """α = min{n(1−p)/(4L+μm), np/(4λ+μ)}: linear convergence at the bound, divergence at 30× the bound."""
  lam = 1.0
  with jax.enable_x64(True):
    a, b = _problem(seed=3)
    batches = _batches(a, b)
    x_star = _optimum(a, b, lam)
    _, l_example, mu = _constants(a, b)
    p = 0.3
    alpha = mx.l2sgd_plus_step_size(lam, l_example, mu, p, N, M)
    assert alpha == pytest.approx(min(N * (1 - p) / (4 * l_example + mu * M), N * p / (4 * lam + mu)), rel=1e-15)
    _, gaps = _run(mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, client_map=MAP), batches,
                   3000, reference=x_star)
    assert gaps[1999] < 1e-3 * gaps[499] and gaps[-1] < 1e-3 * gaps[1499], gaps[[499, 1499, 1999, -1]]
    with pytest.warns(UserWarning, match="Theorem 5.2"):
      algo = mx.l2sgd_plus(quad_loss, lam, 30 * alpha, p, num_clients=N, num_examples=M, smoothness=l_example,
                           mu=mu, client_map=MAP)
    _, gaps = _run(algo, batches, 500, reference=x_star)
    assert not np.isfinite(gaps[-1]) or gaps[-1] > 1e10, gaps[-1]


def test_bad_variant():
  with pytest.raises(ValueError, match=r"variant must be one of \('plain', 'efficient'\); got 'fast'"):
    mx.l2sgd_plus(quad_loss, 1.0, 0.1, 0.5, num_clients=N, num_examples=M, variant="fast")


# ----------------------------------------------------------------------------- non-finite clients

POISONED = 1


def _factory(name, lam, alpha, p):
  """"l2gd", "l2sgd" or "l2sgd_plus:<variant>"."""
  if name in ("l2gd", "l2sgd"):
    return getattr(mx, name)(quad_loss, lam, alpha, p, num_clients=N, client_map=MAP)
  return mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, variant=name.split(":")[1],
                       client_map=MAP)


def _trajectory(algo, batches, steps, key, params):
  body = lambda s, _: (algo.step(s, batches),) * 2
  return jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(algo.init(params, jax.random.key(key)))


@pytest.mark.parametrize("name", ["l2gd", "l2sgd", "l2sgd_plus:plain", "l2sgd_plus:efficient"])
def test_a_poisoned_client_never_spreads(name):
  """NaN in every example of one client: it sits every iteration out (both coins), keeps its initial x_i, J_i, Ψ_i;
  every other x_i, x̄ and the metrics stay finite; num_nonfinite = 1 per iteration. L2GD: the other clients follow
  a float64 NumPy transcription of Algorithm 1 in which the poisoned client's stored x_i still counts in x̄."""
  lam, alpha, p, steps = 0.7, 0.3, 0.5, 16
  with jax.enable_x64(True):
    a, b = _problem()
    a[POISONED, :, 0] = np.nan
    batches = _batches(a, b)
    x0 = np.random.default_rng(5).normal(size=D)
    final, path = _trajectory(_factory(name, lam, alpha, p), batches, steps, 2, jnp.asarray(x0))
    coins = np.asarray(path.metrics["aggregated"])
    assert coins.any() and not coins.all() and (coins[1:] & ~coins[:-1]).any(), coins  # aggregation after a local step
    x = np.asarray(path.local_params)
    others = np.arange(N) != POISONED
    assert np.isfinite(x).all() and np.isfinite(np.asarray(path.params)).all()
    np.testing.assert_array_equal(x[:, POISONED], np.broadcast_to(x0, (steps, D)))
    assert np.abs(x[-1, others] - x0).min() > 1e-3  # the others did move
    np.testing.assert_allclose(np.asarray(path.params), x.mean(1), rtol=1e-12)  # x̄ counts the stored x_i
    np.testing.assert_array_equal(np.asarray(path.metrics["num_nonfinite"]), np.ones(steps, np.int32))
    assert path.metrics["num_nonfinite"].dtype == jnp.int32
    for leaf in jax.tree.leaves(final):
      if jnp.issubdtype(leaf.dtype, jnp.inexact):
        assert np.isfinite(np.asarray(leaf)).all()
    if name.startswith("l2sgd_plus"):
      np.testing.assert_array_equal(np.asarray(final.gradient_table)[POISONED], 0.0)
      np.testing.assert_array_equal(np.asarray(final.aggregation_control)[POISONED], 0.0)
    if name == "l2gd":
      ref = np.tile(x0, (N, 1))
      clean_a = np.where(np.isnan(a), 0.0, a)  # any finite data: the poisoned row is never moved
      for k, coin in enumerate(coins):
        # objective: F at the iterate the step started from, f_i averaged over the clients whose loss is finite
        losses = [0.5 * np.mean((a[i] @ ref[i] - b[i])**2) for i in np.flatnonzero(others)]
        penalty = lam / (2 * N) * np.sum((ref - ref.mean(0))**2)
        np.testing.assert_allclose(float(path.metrics["objective"][k]), np.mean(losses) + penalty, rtol=1e-12)
        new = ref - (alpha * lam / (N * p) * (ref - ref.mean(0)) if coin else
                     alpha / (N * (1 - p)) * _grads(clean_a, b, ref))
        ref[others] = new[others]
        np.testing.assert_allclose(x[k], ref, rtol=1e-12, atol=1e-14)


def test_efficient_l2sgd_plus_matches_plain_with_an_intermittently_non_finite_client():
  """One NaN example of one client: the client fails only when it samples it (at local and aggregation steps), so
  some aggregation steps leave its Ψ_i unwritten (mean Ψ_i ≠ 0) and the efficient master must relearn x̄ and the
  drift; its iterates equal the plain ones (float64, 600 steps at p = ½) and it never extrapolates across a failure."""
  lam, p, k = 1.0, 0.5, 600
  with jax.enable_x64(True):
    a, b = _problem()
    _, l_example, mu = _constants(a, b)
    a[POISONED, 2, 0] = np.nan
    batches = _batches(a, b)
    alpha = mx.l2sgd_plus_step_size(lam, l_example, mu, p, N, M)
    paths = {v: _trajectory(mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=M, variant=v,
                                          client_map=MAP), batches, k, 4, jnp.zeros(D))[1]
             for v in ("plain", "efficient")}
    plain, eff = paths["plain"], paths["efficient"]
    failed = np.asarray(eff.metrics["num_nonfinite"]) > 0
    coins = np.asarray(eff.metrics["aggregated"])
    assert 20 < failed.sum() < k - 20 and (failed & coins).sum() > 10, (failed.sum(), (failed & coins).sum())
    np.testing.assert_array_equal(np.asarray(plain.metrics["num_nonfinite"]), failed.astype(np.int32))
    assert np.isfinite(np.asarray(eff.local_params)).all()
    np.testing.assert_allclose(np.asarray(eff.local_params), np.asarray(plain.local_params), rtol=1e-9, atol=1e-12)
    uploads = np.asarray(eff.metrics["communicated"])
    extrapolated = coins & ~uploads
    assert extrapolated.sum() > 20
    assert not (extrapolated[1:] & failed[:-1]).any()  # after a failure the master uploads
    assert uploads.sum() < 3 * np.sum(coins[1:] & ~coins[:-1])  # still fewer vectors than the plain variant


# ----------------------------------------------------------------------------- L2SGD+: unbiased step


def _l2sgd_plus_steps_from(lam, alpha, p, m, batches, x, table, psi, *, seed, num_keys):
  """One L2SGD+ step from the state (x, J = `table`, Ψ = `psi`) under each of `num_keys` keys (`jax.vmap`)."""
  algo = mx.l2sgd_plus(quad_loss, lam, alpha, p, num_clients=N, num_examples=m, client_map=MAP)
  state = algo.init(jnp.zeros(D), jax.random.key(0)).replace(
      local_params=jnp.asarray(x), params=jnp.asarray(x.mean(0)), gradient_table=jnp.asarray(table),
      aggregation_control=jnp.asarray(psi))
  keys = jax.random.split(jax.random.key(seed), num_keys)
  return jax.jit(jax.vmap(lambda key: algo.step(state.replace(key=key), batches)))(keys)


def test_l2sgd_plus_expected_step_is_the_gradient_step_from_any_state():
  """E_{ξ, j}[x^{k+1}] = x^k − α∇F(x^k), exactly, from random x (far from x(λ)), random J and Ψ (mean Ψ ≠ 0), with
  padded slots: every (coin, j) outcome of one step is found by running the step over many keys, and weighted by its
  probability (p, (1−p)/m_i). ∇F from a float64 NumPy closed form and from autodiff of `objectives.mixture`.
  Removing either importance weight 1/(1−p) or 1/p breaks the identity. At local steps exactly the sampled row J_ij
  changes (to ∇f_ij(x_i)); at aggregation steps J does not change."""
  lam, alpha, p, m = 0.7, 0.4, 0.3, 6
  with jax.enable_x64(True):
    a, b = _problem(seed=7)
    mask = np.ones((N, m), bool)
    mask[2, 4:] = False  # client 2 holds 4 real examples
    real = mask.sum(1)
    batches = _batches(a, b).replace(mask=jnp.asarray(mask.reshape(N, 2, m // 2)))
    rng = np.random.default_rng(8)
    x = 5.0 * rng.normal(size=(N, D))
    table = rng.normal(size=(N, m, D)) * mask[..., None]
    psi = rng.normal(size=(N, D))
    out = _l2sgd_plus_steps_from(lam, alpha, p, m, batches, x, table, psi, seed=1, num_keys=256)
    coins = np.asarray(out.metrics["aggregated"])
    new_x, new_table = np.asarray(out.local_params), np.asarray(out.gradient_table)
    changed = np.any(new_table != table, axis=-1)  # [keys, n, m]
    np.testing.assert_array_equal(changed[coins], False)
    np.testing.assert_array_equal(changed[~coins].sum(-1), 1)
    sampled = changed.argmax(-1)  # [keys, n]: j of each client at local steps
    assert not (~mask[np.arange(N), sampled])[~coins].any()  # never a padded slot
    # per-example gradients ∇f_ij(x_i) = a_ij (a_ijᵀ x_i − b_ij), examples as laid out by _batches
    a_flat, b_flat = a.reshape(N, m, D), b.reshape(N, m)
    example_grads = a_flat * (np.einsum("imd,id->im", a_flat, x) - b_flat)[..., None]
    expected = np.zeros((N, D))
    for i in range(N):
      aggregate = new_x[coins, i]
      np.testing.assert_allclose(aggregate, np.broadcast_to(aggregate[0], aggregate.shape), rtol=1e-14)
      expected[i] += p * aggregate[0]
      for j in range(m):
        hits = ~coins & (sampled[:, i] == j)
        if not mask[i, j]:
          continue
        assert hits.any(), (i, j)  # every real example of every client was drawn by some key
        np.testing.assert_allclose(new_table[hits, i, j], np.broadcast_to(example_grads[i, j], (hits.sum(), D)),
                                   rtol=1e-13)
        expected[i] += (1 - p) / real[i] * new_x[hits, i][0]
    grad_f = np.stack([example_grads[i, mask[i]].mean(0) for i in range(N)])
    grad_F = (grad_f + lam * (x - x.mean(0))) / N  # ∂F/∂x_i
    np.testing.assert_allclose(expected, x - alpha * grad_F, rtol=1e-12, atol=1e-12)
    autodiff = jax.grad(objectives.mixture(quad_loss, lam))(jnp.asarray(x), batches)
    np.testing.assert_allclose(np.asarray(autodiff), grad_F, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- L2SGD: one example per local step


def _example_grads(a, b, x):
  """∇f_ij(x_i) = a_ij (a_ijᵀ x_i − b_ij) `[n, m, d]`, examples in the order of `_batches`."""
  return a * (np.einsum("imd,id->im", a, x) - b)[..., None]


def test_l2sgd_local_step_is_one_uniformly_drawn_real_example():
  """L2SGD, one step from random x over 400 keys: at a local coin each client moves by −α/(n(1−p)) ∇f_ij(x_i) for one
  of its real examples j (never a padded slot, never the full-batch gradient of L2GD), every real example is drawn,
  about uniformly; at an aggregation coin x_i − αλ/(np)(x_i − x̄). No `objective` metric (unlike L2GD)."""
  lam, alpha, p, m = 0.7, 0.4, 0.3, M
  with jax.enable_x64(True):
    a, b = _problem(seed=9)
    mask = np.ones((N, m), bool)
    mask[2, 4:] = False  # client 2 holds 4 real examples
    batches = _batches(a, b).replace(mask=jnp.asarray(mask.reshape(N, 2, m // 2)))
    x = 3.0 * np.random.default_rng(10).normal(size=(N, D))
    algo = mx.l2sgd(quad_loss, lam, alpha, p, num_clients=N, client_map=MAP)
    state = algo.init(jnp.zeros(D), jax.random.key(0)).replace(local_params=jnp.asarray(x),
                                                                params=jnp.asarray(x.mean(0)))
    assert "objective" not in state.metrics
    keys = jax.random.split(jax.random.key(2), 400)
    out = jax.jit(jax.vmap(lambda key: algo.step(state.replace(key=key), batches)))(keys)
    assert "objective" not in out.metrics
    coins, new_x = np.asarray(out.metrics["aggregated"]), np.asarray(out.local_params)
    candidates = x[:, None] - alpha / (N * (1 - p)) * _example_grads(a, b, x)  # [n, m, d]
    np.testing.assert_allclose(new_x[coins], np.broadcast_to(x - alpha * lam / (N * p) * (x - x.mean(0)),
                                                             new_x[coins].shape), rtol=1e-13)
    local = new_x[~coins]  # [k, n, d]
    distance = np.linalg.norm(local[:, :, None] - candidates[None], axis=-1)  # [k, n, m]
    drawn = distance.argmin(-1)
    assert np.all(distance.min(-1) < 1e-12 * (1 + np.linalg.norm(x)))
    assert mask[np.arange(N), drawn].all()  # never a padded slot
    full = x - alpha / (N * (1 - p)) * np.stack([_example_grads(a, b, x)[i, mask[i]].mean(0) for i in range(N)])
    assert np.all(np.linalg.norm(local - full, axis=-1) > 1e-3)
    for i in range(N):
      counts = np.bincount(drawn[:, i], minlength=m)[mask[i]]
      expected = len(local) / mask[i].sum()
      assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), (i, counts)


def test_l2sgd_warns_above_the_l2gd_step_size_bound():
  """`smoothness=` reaches L2SGD's check too: α above (n/2)·min{(1−p)/L, p/λ} warns, naming Theorem 4.4."""
  bound = mx.l2gd_max_step_size(1.0, 2.0, 0.3, N)
  with pytest.warns(UserWarning, match="Theorem 4.4"):
    mx.l2sgd(quad_loss, 1.0, 1.01 * bound, 0.3, num_clients=N, smoothness=2.0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    mx.l2sgd(quad_loss, 1.0, 0.99 * bound, 0.3, num_clients=N, smoothness=2.0)


def test_step_size_helpers_give_each_side_of_the_min_and_take_traced_arguments():
  """l2gd_max_step_size = (n/2) min{(1−p)/L, p/λ} (p/λ = ∞ at λ = 0) and l2sgd_plus_step_size =
  min{n(1−p)/(4L + μm), np/(4λ + μ)} for λ where each side is the smaller one (λ = 0.5 < 1 on the λ side), from
  Python numbers (a Python float) and with any one argument, or all of them, traced (`jax.vmap` in `jit`)."""
  n, smooth, p, mu, m = 4, 0.5, 0.3, 0.5, 6
  lams = [0.0, 0.1, 0.5, 5.0]
  gd_of = lambda lam, s=smooth, q=p: 0.5 * n * min((1 - q) / s, q / lam if lam > 0 else np.inf)
  plus_of = lambda lam, s=smooth, q=p: min(n * (1 - q) / (4 * s + mu * m), n * q / (4 * lam + mu))
  gd, plus = [gd_of(lam) for lam in lams], [plus_of(lam) for lam in lams]
  assert gd[0] == gd[1] == 0.5 * n * (1 - p) / smooth and gd[2] == 0.5 * n * p / 0.5 and gd[3] == 0.5 * n * p / 5
  assert plus[1] == n * (1 - p) / (4 * smooth + mu * m) and plus[2] == n * p / (4 * 0.5 + mu)
  for lam, want_gd, want_plus in zip(lams, gd, plus):
    got_gd, got_plus = mx.l2gd_max_step_size(lam, smooth, p, n), mx.l2sgd_plus_step_size(lam, smooth, mu, p, n, m)
    assert type(got_gd) is float and type(got_plus) is float  # Python numbers in, a Python float out
    assert got_gd == pytest.approx(want_gd, rel=1e-15) and got_plus == pytest.approx(want_plus, rel=1e-15)
  smooths, ps = [0.5, 2.0, 8.0], [0.1, 0.3, 0.9]
  with jax.enable_x64(True):
    lam_arr, s_arr, p_arr = jnp.asarray(lams), jnp.asarray(smooths), jnp.asarray(ps)
    traced = {
        "gd, all": jax.vmap(lambda lam, s, q: mx.l2gd_max_step_size(lam, s, q, n), in_axes=(0, None, None))(
            lam_arr, jnp.asarray(smooth), jnp.asarray(p)),
        "gd, λ": jax.vmap(lambda lam: mx.l2gd_max_step_size(lam, smooth, p, n))(lam_arr),
        "gd, L": jax.vmap(lambda s: mx.l2gd_max_step_size(0.5, s, p, n))(s_arr),
        "gd, p": jax.vmap(lambda q: mx.l2gd_max_step_size(0.5, smooth, q, n))(p_arr),
        "plus, all": jax.vmap(lambda lam: mx.l2sgd_plus_step_size(lam, jnp.asarray(smooth), jnp.asarray(mu),
                                                                  jnp.asarray(p), n, m))(lam_arr),
        "plus, λ": jax.vmap(lambda lam: mx.l2sgd_plus_step_size(lam, smooth, mu, p, n, m))(lam_arr),
        "plus, L": jax.vmap(lambda s: mx.l2sgd_plus_step_size(0.5, s, mu, p, n, m))(s_arr),
    }
  want = {"gd, all": gd, "gd, λ": gd, "gd, L": [gd_of(0.5, s=v) for v in smooths],
          "gd, p": [gd_of(0.5, q=v) for v in ps], "plus, all": plus, "plus, λ": plus,
          "plus, L": [plus_of(0.5, s=v) for v in smooths]}
  for name, values in traced.items():
    np.testing.assert_allclose(np.asarray(values), want[name], rtol=1e-14, err_msg=name)
  assert len({np.argmin([(1 - q) / smooth, q / 0.5]) for q in ps}) == 2  # traced p reaches both sides
  assert len({np.argmin([(1 - p) / v, p / 0.5]) for v in smooths}) == 2  # traced L too


def test_l2gd_objective_averages_the_finite_clients_even_when_only_one_is_left():
  """Three of four clients poisoned: the `objective` metric is F over the one finite client, f_0(x_0) + λ·penalty,
  at init (x_i = 0, penalty 0) f_0(0) = mean ½ b_0j²."""
  with jax.enable_x64(True):
    a, b = _problem(seed=11)
    a = a.copy()
    a[1:, 0, 0] = np.nan
    algo = mx.l2gd(quad_loss, 0.7, 0.1, 0.3, num_clients=N, client_map=MAP)
    state = jax.jit(algo.step)(algo.init(jnp.zeros(D), jax.random.key(0)), _batches(a, b))
    np.testing.assert_allclose(float(state.metrics["objective"]), np.mean(0.5 * b[0] ** 2), rtol=1e-12)
    assert int(state.metrics["num_nonfinite"]) == 3


def test_l2sgd_plus_client_with_one_real_example_averages_its_table_over_that_row_only():
  """A client with a single real example (its padded rows of J hold arbitrary values): J̄_i is that one row, so its
  local step is x_i − (α/n)[(∇f_i1(x_i) − J_i1)/(1−p) + J_i1 + Ψ_i] (Algorithm 2's g_i with J̄_i = J_i1)."""
  lam, alpha, p, m = 0.7, 0.4, 0.3, M
  with jax.enable_x64(True):
    a, b = _problem(seed=12)
    mask = np.ones((N, m), bool)
    mask[1, 1:] = False  # client 1 holds one real example
    batches = _batches(a, b).replace(mask=jnp.asarray(mask.reshape(N, 2, m // 2)))
    rng = np.random.default_rng(13)
    x = 2.0 * rng.normal(size=(N, D))
    table = rng.normal(size=(N, m, D))
    psi = rng.normal(size=(N, D))
    out = _l2sgd_plus_steps_from(lam, alpha, p, m, batches, x, table, psi, seed=3, num_keys=32)
    local = ~np.asarray(out.metrics["aggregated"])
    assert local.any()
    grad, row = _example_grads(a, b, x)[1, 0], table[1, 0]
    want = x[1] - alpha / N * ((grad - row) / (1 - p) + row + psi[1])
    np.testing.assert_allclose(np.asarray(out.local_params)[local, 1], np.broadcast_to(want, (local.sum(), D)),
                               rtol=1e-13)


def test_l2sgd_plus_checks_its_step_size_only_when_both_l_and_mu_are_given():
  """The Theorem 5.2 bound needs L and μ: with both, α above it warns; with one of them the factory neither warns
  nor fails (the docstring's "when both are given")."""
  bound = mx.l2sgd_plus_step_size(1.0, 2.0, 0.5, 0.3, N, M)
  with pytest.warns(UserWarning, match="Theorem 5.2"):
    mx.l2sgd_plus(quad_loss, 1.0, 1.01 * bound, 0.3, num_clients=N, num_examples=M, smoothness=2.0, mu=0.5)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    mx.l2sgd_plus(quad_loss, 1.0, 0.99 * bound, 0.3, num_clients=N, num_examples=M, smoothness=2.0, mu=0.5)
    mx.l2sgd_plus(quad_loss, 1.0, 100 * bound, 0.3, num_clients=N, num_examples=M, smoothness=2.0)
    mx.l2sgd_plus(quad_loss, 1.0, 100 * bound, 0.3, num_clients=N, num_examples=M, mu=0.5)


@pytest.mark.parametrize("name", ["l2gd", "l2sgd"])
def test_a_client_whose_step_overflows_is_frozen_like_a_non_finite_one(name):
  """float32: client 0 starts at 1e19, so its gradient is finite but its local step α/(n(1−p))·∇f overflows to
  ±inf. Its new model is not finite, so it keeps x_0 and is counted in `num_nonfinite`; the others step."""
  a, b = _problem(seed=14)
  x = np.ones((N, D), np.float32)
  x[0] = 1e19
  algo = getattr(mx, name)(quad_loss, 0.5, 1e22, 1e-3, num_clients=N, client_map=MAP)
  state = algo.init(jnp.zeros(D), jax.random.key(0)).replace(local_params=jnp.asarray(x))
  batches = jax.tree.map(lambda t: t.astype(np.float32) if t.dtype == np.float64 else t, _batches(a, b))
  grads = np.asarray(jax.vmap(jax.grad(lambda w, d: jnp.mean(quad_loss(w, d))))(
      jnp.asarray(x), jax.tree.map(lambda t: t.reshape(N, -1, *t.shape[3:]), batches.data)))
  assert np.all(np.isfinite(grads))
  out = jax.jit(algo.step)(state, batches)
  assert not bool(out.metrics["aggregated"])
  new = np.asarray(out.local_params)
  np.testing.assert_array_equal(new[0], x[0])
  assert np.all(np.isfinite(new)) and np.all(new[1:] != x[1:])
  assert int(out.metrics["num_nonfinite"]) == 1


def test_efficient_l2sgd_plus_keeps_a_float32_state_under_x64():
  """The efficient variant's extra state (the master's x̄ and drift) is cast back to the model's dtype, as
  tests/test_convention.py checks for the plain variant and every other factory."""
  a, b = _problem(seed=15)
  with jax.enable_x64(True):
    batches = jax.tree.map(lambda t: t.astype(np.float32) if t.dtype == np.float64 else t, _batches(a, b))
    algo = mx.l2sgd_plus(quad_loss, 0.7, 0.1, 0.5, num_clients=N, num_examples=M, variant="efficient",
                         client_map=MAP)
    state = algo.init(jnp.zeros(D, jnp.float32), jax.random.key(0))
    after = jax.eval_shape(lambda s: algo.step(algo.step(s, batches), batches), state)
  wide = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(after)[0]
          if jnp.result_type(leaf) == jnp.float64]
  assert not wide, wide
