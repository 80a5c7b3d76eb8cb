"""Mixture ADMM against float64 NumPy closed forms on quadratic clients.

f_i(x) = ½‖A_i x − b_i‖² / m_i. The mixture optimum x(λ) of
F = (1/n) Σ f_i(x_i) + λ/(2n) Σ ‖x_i − x̄‖² (equivalently of n·F) solves the
block linear system H_i x_i − g_i + λ(x_i − x̄) = 0 for all i, with
H_i = A_iᵀA_i/m_i, g_i = A_iᵀb_i/m_i: one NumPy solve in n·d unknowns.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import mixture_objective, mixture_optimum, quadratic_grads, quadratic_hessians

import fedjax_opt as fo
from fedjax_opt.core.prox import prox_least_squares, prox_quadratic
from fedjax_opt.algorithms.mixture_admm import mixture_admm

N, D, M = 4, 3, 6
MAP = "vmap"


def quad_loss(w, batch):
  """Per-example ½(aᵀw − b)²."""
  return 0.5 * jnp.square(batch["a"] @ w - batch["b"])


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  a = np.stack([rng.normal(loc=0.3 * i, size=(M, D)) for i in range(N)])
  b = np.stack([ai @ rng.normal(size=D) + 0.1 * rng.normal(size=M) for ai in a])
  return a, b


def _batches(a, b, steps=2):
  return fo.ClientBatches(
      data={"a": jnp.asarray(a.reshape(N, steps, M // steps, D)), "b": jnp.asarray(b.reshape(N, steps, M // steps))},
      mask=jnp.ones((N, steps, M // steps), bool),
      weight=jnp.full((N,), float(M)),
      client_id=jnp.arange(N, dtype=jnp.int32))


_hessians = quadratic_hessians


_optimum = mixture_optimum


_grads = quadratic_grads


_objective = mixture_objective


def _run(algo, batches, iterations, init=None):
  """One jitted `lax.scan` over iterations; returns the final state and the metrics history."""

  def body(state, _):
    state = algo.step(state, batches)
    return state, state.metrics

  start = algo.init(jnp.zeros(D) if init is None else init, jax.random.key(0))
  return jax.jit(lambda s: jax.lax.scan(body, s, None, length=iterations))(start)


@pytest.mark.parametrize("variant, rho", [("split", 2.0), ("jacobi", 1.0)])
def test_reaches_the_closed_form_mixture_optimum(variant, rho):
  """λ = 1, exact prox: x_i → x(λ) to 1e-8, x_i = x̄ − ∇f_i(x_i)/λ, z = x̄, y = −λz, objective = F(x(λ))."""
  lam = 1.0
  with jax.enable_x64(True):
    a, b = _problem()
    algo = mixture_admm(quad_loss, lam, rho, num_clients=N, prox=prox_quadratic(quad_loss), variant=variant,
                        client_map=MAP)
    state, history = _run(algo, _batches(a, b), 300)
    x_star = _optimum(a, b, lam)
    x = np.asarray(state.local_params)
    np.testing.assert_allclose(x, x_star, atol=1e-8, rtol=0)
    np.testing.assert_allclose(x, x.mean(0) - _grads(a, b, x) / lam, atol=1e-8, rtol=0)
    np.testing.assert_allclose(np.asarray(state.params), x.mean(0), atol=1e-10)
    np.testing.assert_allclose(np.asarray(state.dual), -lam * np.asarray(state.params), atol=1e-10)
    np.testing.assert_allclose(float(history["objective"][-1]), _objective(a, b, x_star, lam), rtol=1e-10)
    assert float(history["stationarity"][-1]) < 1e-8 < float(history["stationarity"][0])
    assert float(history["gradient_residual"][-1]) < 1e-8
    assert float(history["primal_residual"][-1]) < 1e-9 and float(history["dual_residual"][-1]) < 1e-9
    assert int(state.round) == 300


def _numpy_split(a, b, lam, rho, iterations, frozen=(), z0=None):
  """Boyd's sharing ADMM with explicit copies x_i' and duals u_i (no reduction), float64.

  x_i = argmin f_i(x) + (λ/2)‖x‖² + (ρ/2)‖x − x_i' + u_i‖²;
  x' = argmin −(λ/(2n))‖Σ x_i'‖² + (ρ/2) Σ ‖x_i' − x_i − u_i‖² (one nd×nd solve); u_i += x_i − x_i'.
  Clients in `frozen` skip their x-update (keep x_i). Start: x_i = x_i' = z0 (default 0), ρu_i = −λ z0.
  """
  h, g = _hessians(a, b)
  z0 = np.zeros(D) if z0 is None else z0
  x, xp, u = np.tile(z0, (N, 1)), np.tile(z0, (N, 1)), np.tile(-lam * z0 / rho, (N, 1))
  coupling = rho * np.eye(N * D) - lam / N * np.kron(np.ones((N, N)), np.eye(D))
  for _ in range(iterations):
    x = np.stack([x[i] if i in frozen else
                  np.linalg.solve(h[i] + (lam + rho) * np.eye(D), g[i] + rho * (xp[i] - u[i])) for i in range(N)])
    xp = np.linalg.solve(coupling, rho * (x + u).reshape(-1)).reshape(N, D)
    u = u + x - xp
  return x, xp.mean(0), rho * u


def _numpy_jacobi(a, b, lam, rho, iterations, frozen=(), z0=None):
  """Hong et al.'s Eq. 3.2 form, s = Σ x_i, all x_i from the previous iterate (Jacobi), float64.

  x_i = argmin f_i(x) + (λ/2)‖x‖² + ⟨y, x⟩ + (ρ/2)‖x + Σ_{j≠i} x_j − s‖²;
  s = argmin −(λ/(2n))‖s‖² − ⟨y, s⟩ + (ρ/2)‖Σ x_i − s‖²; y += ρ(Σ x_i − s). Clients in `frozen` keep x_i.
  Start: x_i = z0 (default 0), s = n z0, y = −λ z0.
  """
  h, g = _hessians(a, b)
  z0 = np.zeros(D) if z0 is None else z0
  x, s, y = np.tile(z0, (N, 1)), N * z0, -lam * z0
  for _ in range(iterations):
    others = x.sum(0) - x
    x = np.stack([x[i] if i in frozen else
                  np.linalg.solve(h[i] + (lam + rho) * np.eye(D), g[i] - y + rho * (s - others[i])) for i in range(N)])
    s = np.linalg.solve((rho - lam / N) * np.eye(D), y + rho * x.sum(0))
    y = y + rho * (x.sum(0) - s)
  return x, s / N, y


@pytest.mark.parametrize("variant", ["split", "jacobi"])
def test_iterates_equal_the_unreduced_admm_in_numpy(variant):
  """The reduced updates (one broadcast vector per round) equal ADMM on the unreduced sharing problem, 5 iterations."""
  lam, rho = 1.3, 2.9
  with jax.enable_x64(True):
    a, b = _problem(seed=3)
    algo = mixture_admm(quad_loss, lam, rho, num_clients=N, prox=prox_quadratic(quad_loss), variant=variant,
                        client_map=MAP)
    # Both NumPy versions start from y = 0 at x = z = 0, which is the y^0 = −λ z^0 of init.
    state, _ = _run(algo, _batches(a, b), 5)
    x, z, y = (_numpy_split if variant == "split" else _numpy_jacobi)(a, b, lam, rho, 5)
    np.testing.assert_allclose(np.asarray(state.local_params), x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(state.params), z, rtol=1e-10, atol=1e-12)
    # "split": the n duals ρu_i are all equal (Boyd §7.3), and equal to the one stored dual.
    np.testing.assert_allclose(np.broadcast_to(np.asarray(state.dual), np.shape(y)), y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", ["split", "jacobi"])
def test_init_pins_the_dual_to_minus_lambda_z_and_the_iterates_follow_numpy_from_there(variant):
  """From params z⁰ ≠ 0: init sets x_i = z⁰ and y⁰ = −λz⁰ (= ∇ℓ at the aggregate, the identity the module's
  derivation keeps); three iterations then equal the unreduced NumPy ADMM started at x_i = x_i' = z⁰ with
  ρu_i = −λz⁰ ("split") or s = n z⁰, y = −λz⁰ ("jacobi")."""
  lam, rho = 1.3, 2.9
  z0 = np.array([0.7, -1.1, 0.4])
  with jax.enable_x64(True):
    a, b = _problem(seed=5)
    algo = mixture_admm(quad_loss, lam, rho, num_clients=N, prox=prox_quadratic(quad_loss), variant=variant,
                        client_map=MAP)
    start = algo.init(jnp.asarray(z0), jax.random.key(0))
    np.testing.assert_allclose(np.asarray(start.dual), -lam * z0, rtol=1e-15)
    np.testing.assert_array_equal(np.asarray(start.local_params), np.tile(z0, (N, 1)))
    # METRICS: the model's dtype, except num_nonfinite (int32) and the bit counts (float32).
    want = {"num_nonfinite": jnp.int32, "bits_up": jnp.float32, "bits_down": jnp.float32}
    assert {k: v.dtype for k, v in start.metrics.items()} == {k: jnp.dtype(want.get(k, jnp.float64))
                                                             for k in start.metrics}
    state, _ = _run(algo, _batches(a, b), 3, init=jnp.asarray(z0))
    x, z, y = (_numpy_split if variant == "split" else _numpy_jacobi)(a, b, lam, rho, 3, z0=z0)
    np.testing.assert_allclose(np.asarray(state.local_params), x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(state.params), z, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.broadcast_to(np.asarray(state.dual), np.shape(y)), y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", ["split", "jacobi"])
def test_inexact_x_update_is_k_full_batch_steps_toward_v(variant):
  """prox=None, K = 3 (≠ S = 2): x_i ← x_i − η(∇f_i(x_i) + (λ+ρ)(x_i − v_i)) three times on all of the client's
  examples, v_i = (ρ(x_i + κ(z − x̄)) − y)/(λ+ρ); then z = (y/κ + ρx̄)/(ρ − λ/κ), y ← y + κρ(x̄ − z). Two
  iterations from a z⁰ ≠ 0, float64 NumPy."""
  lam, rho, eta, k_steps = 0.8, 2.5, 0.05, 3
  kappa = N if variant == "jacobi" else 1
  z0 = np.array([0.3, -0.2, 0.5])
  with jax.enable_x64(True):
    a, b = _problem(seed=2)
    algo = mixture_admm(quad_loss, lam, rho, num_clients=N, client_optimizer=optax.sgd(eta), local_steps=k_steps,
                        variant=variant, client_map=MAP)
    state, _ = _run(algo, _batches(a, b), 2, init=jnp.asarray(z0))
    h, g = _hessians(a, b)
    x, z, y = np.tile(z0, (N, 1)), z0, -lam * z0
    for _ in range(2):
      v = (rho * (x + kappa * (z - x.mean(0))) - y) / (lam + rho)
      for _ in range(k_steps):
        x = x - eta * (np.einsum("ide,ie->id", h, x) - g + (lam + rho) * (x - v))
      z = (y / kappa + rho * x.mean(0)) / (rho - lam / kappa)
      y = y + kappa * rho * (x.mean(0) - z)
    np.testing.assert_allclose(np.asarray(state.local_params), x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(state.params), z, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(state.dual), y, rtol=1e-10, atol=1e-12)


def test_gradient_residual_and_stationarity_skip_the_non_finite_client():
  """λ = 0.5 (≠ 1), client 1 poisoned, 60 iterations: gradient_residual = max over the finite clients of
  ‖∇f_i(x_i) + λ(x_i − x̄)‖ (x̄ over all n rows, the frozen one included), which is by then far below 1, so a
  non-finite client counted as anything would show; stationarity = gradient_residual / λ."""
  lam, rho, bad = 0.5, 2.0, 1
  with jax.enable_x64(True):
    a, b = _problem(seed=4)
    batches = _batches(a, b)
    batches = batches.replace(data={**batches.data, "a": batches.data["a"].at[bad, 0, 0, 0].set(jnp.nan)})
    algo = mixture_admm(quad_loss, lam, rho, num_clients=N, prox=prox_quadratic(quad_loss), variant="split",
                        client_map=MAP)
    state, history = _run(algo, batches, 60)
    x = np.asarray(state.local_params)
    residual = _grads(a, b, x) + lam * (x - x.mean(0))
    want = max(np.linalg.norm(residual[i]) for i in range(N) if i != bad)
    assert 0 < want < 1e-3
    np.testing.assert_allclose(float(history["gradient_residual"][-1]), want, rtol=1e-6, atol=1e-14)
    np.testing.assert_allclose(float(history["stationarity"][-1]), want / lam, rtol=1e-6, atol=1e-14)


@pytest.mark.parametrize("variant", ["split", "jacobi"])
def test_a_client_with_nan_data_never_spreads(variant):
  """Client 1's data holds a NaN, every round: it keeps x_1 (its start, 0), is counted in num_nonfinite, and the
  others, z and y follow the unreduced NumPy ADMM in which client 1 skips its x-update (its x_1 still in Σ x_i);
  every state entry and metric stays finite. Before, all of them were NaN within a few iterations."""
  lam, rho, bad = 1.3, 2.9, 1
  with jax.enable_x64(True):
    a, b = _problem(seed=3)
    batches = _batches(a, b)
    batches = batches.replace(data={**batches.data, "a": batches.data["a"].at[bad, 1, 0, 2].set(jnp.nan)})
    algo = mixture_admm(quad_loss, lam, rho, num_clients=N, prox=prox_quadratic(quad_loss), variant=variant,
                        client_map=MAP)
    state, history = _run(algo, batches, 5)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      if jnp.issubdtype(leaf.dtype, jnp.inexact):
        assert np.all(np.isfinite(np.asarray(leaf))), jax.tree_util.keystr(path)
    np.testing.assert_array_equal(history["num_nonfinite"], 1)
    np.testing.assert_array_equal(np.asarray(state.local_params[bad]), 0)
    x, z, y = (_numpy_split if variant == "split" else _numpy_jacobi)(a, b, lam, rho, 5, frozen=(bad,))
    np.testing.assert_allclose(np.asarray(state.local_params), x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(state.params), z, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.broadcast_to(np.asarray(state.dual), np.shape(y)), y, rtol=1e-10, atol=1e-12)
    others = [i for i in range(N) if i != bad]
    losses = [0.5 * np.mean((a[i] @ x[i] - b[i]) ** 2) for i in others]
    np.testing.assert_allclose(float(history["objective"][-1]),
                               np.mean(losses) + lam / (2 * N) * np.sum((x - x.mean(0)) ** 2), rtol=1e-10)


def test_lambda_zero_gives_the_local_least_squares_solutions():
  with jax.enable_x64(True):
    a, b = _problem()
    local = np.stack([np.linalg.lstsq(ai, bi, rcond=None)[0] for ai, bi in zip(a, b)])
    for variant in ("split", "jacobi"):
      algo = mixture_admm(quad_loss, 0.0, 0.2, num_clients=N, prox=prox_quadratic(quad_loss), variant=variant,
                          client_map=MAP)
      state, history = _run(algo, _batches(a, b), 400)
      np.testing.assert_allclose(np.asarray(state.local_params), local, atol=1e-8)
      assert np.isinf(float(history["stationarity"][-1])) and float(history["gradient_residual"][-1]) < 1e-8


def test_large_lambda_gives_the_pooled_solution():
  """‖x(λ) − argmin Σ f_i‖ = O(1/λ) (closed form); ADMM at λ = 100 reaches x(λ) and so the pooled model."""
  with jax.enable_x64(True):
    a, b = _problem()
    h, g = _hessians(a, b)
    pooled = np.linalg.solve(h.sum(0), g.sum(0))
    dist = [np.abs(_optimum(a, b, lam) - pooled).max() for lam in (1e2, 1e3, 1e4)]
    assert 8 * dist[2] < dist[1] < dist[0] / 8, dist
    lam = 100.0
    algo = mixture_admm(quad_loss, lam, lam, num_clients=N, prox=prox_quadratic(quad_loss), variant="jacobi",
                        client_map=MAP)
    state, _ = _run(algo, _batches(a, b), 3000)
    x = np.asarray(state.local_params)
    np.testing.assert_allclose(x, _optimum(a, b, lam), atol=1e-8)
    assert np.abs(x - pooled).max() < 0.03


def test_vmap_over_rho_maps_where_each_variant_converges_or_diverges():
  """ρ in units of L, the Lipschitz constant of ∇ℓ (λ for "split", λ/n for "jacobi"):
  ρ = 1.05 L diverges, ρ = 2 L, 3 L converge, on this problem, λ = 1, one vmapped program per variant."""
  lam = 1.0
  with jax.enable_x64(True):
    a, b = _problem()
    x_star = jnp.asarray(_optimum(a, b, lam))
    batches = _batches(a, b)
    for variant, lipschitz in (("split", lam), ("jacobi", lam / N)):

      def gap(rho):
        algo = mixture_admm(quad_loss, lam, rho, num_clients=N, prox=prox_quadratic(quad_loss), variant=variant,
                            client_map=MAP)
        state, history = _run(algo, batches, 400)
        return jnp.max(jnp.abs(state.local_params - x_star)), history["primal_residual"]

      gaps, residuals = jax.jit(jax.vmap(gap))(jnp.array([1.05, 2.0, 3.0]) * lipschitz)
      gaps = np.asarray(gaps)
      assert not np.isfinite(gaps[0]) or gaps[0] > 1e3, (variant, gaps)
      assert gaps[1] < 1e-8 and gaps[2] < 1e-8, (variant, gaps)
      assert not np.allclose(residuals[1, :5], residuals[2, :5])


def test_inexact_local_steps_reach_the_same_optimum():
  """No prox: K = 5 full-batch gradient steps per x-update; the fixed point is still x(λ)."""
  lam, rho = 1.0, 2.0
  with jax.enable_x64(True):
    a, b = _problem()
    h, _ = _hessians(a, b)
    lr = 1.0 / (np.linalg.eigvalsh(h).max() + lam + rho)
    algo = mixture_admm(quad_loss, lam, rho, num_clients=N, client_optimizer=optax.sgd(lr), local_steps=5,
                        variant="split", client_map=MAP)
    state, _ = _run(algo, _batches(a, b), 1500)
    np.testing.assert_allclose(np.asarray(state.local_params), _optimum(a, b, lam), atol=1e-8)


def test_pytree_params_with_prox_least_squares_and_client_map_modes():
  """{"w", "b"} models with the closed-form least-squares prox (intercept): optimum of the intercept model."""
  lam, rho = 0.5, 1.0
  with jax.enable_x64(True):
    a, b = _problem(seed=1)
    batches = fo.ClientBatches(data={"x": jnp.asarray(a.reshape(N, 2, 3, D)), "y": jnp.asarray(b.reshape(N, 2, 3))},
                               mask=jnp.ones((N, 2, 3), bool), weight=jnp.ones(N),
                               client_id=jnp.asarray([2, 0, 3, 1], jnp.int32))
    batches = batches.replace(data=jax.tree.map(lambda t: t[jnp.asarray([2, 0, 3, 1])], batches.data))
    with_ones = np.concatenate([a, np.ones((N, M, 1))], axis=2)  # θ = (w, b)
    h, g = np.einsum("imd,ime->ide", with_ones, with_ones) / M, np.einsum("imd,im->id", with_ones, b) / M
    system = np.kron(np.eye(N) - np.ones((N, N)) / N, lam * np.eye(D + 1))
    for i in range(N):
      system[i * (D + 1):(i + 1) * (D + 1), i * (D + 1):(i + 1) * (D + 1)] += h[i]
    theta = np.linalg.solve(system, g.reshape(-1)).reshape(N, D + 1)

    def loss(params, batch):
      return 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])

    outs = []
    for mode in ("vmap", "sequential"):
      algo = mixture_admm(loss, lam, rho, num_clients=N, prox=prox_least_squares(), variant="split", client_map=mode)
      state, _ = _run(algo, batches, 300, init={"w": jnp.zeros(D), "b": jnp.zeros(())})
      got = np.column_stack([state.local_params["w"], state.local_params["b"]])
      np.testing.assert_allclose(got, theta, atol=1e-8)
      outs.append(got)
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-12)


def test_bad_input():
  prox = prox_quadratic(quad_loss)
  with pytest.raises(ValueError, match=r"lam \(λ, the pull towards the average\) must be finite and >= 0"):
    mixture_admm(quad_loss, -0.1, 1.0, num_clients=N, prox=prox)
  for rho in (0.0, -1.0, None):
    with pytest.raises(ValueError, match=r"rho \(ρ, the ADMM penalty\) must be"):
      mixture_admm(quad_loss, 1.0, rho, num_clients=N, prox=prox)
  with pytest.raises(ValueError, match=r"variant must be one of \('jacobi', 'split'\); got 'gauss'"):
    mixture_admm(quad_loss, 1.0, 2.0, num_clients=N, prox=prox, variant="gauss")
  with pytest.raises(ValueError, match=r"rho \(ρ\) must exceed lam = 1.0 for variant 'split'"):
    mixture_admm(quad_loss, 1.0, 0.9, num_clients=N, prox=prox, variant="split")
  with pytest.raises(ValueError, match=r"rho \(ρ\) must exceed lam / num_clients = 0.25 for variant 'jacobi'"):
    mixture_admm(quad_loss, 1.0, 0.25, num_clients=N, prox=prox, variant="jacobi")
  mixture_admm(quad_loss, 1.0, 0.3, num_clients=N, prox=prox, variant="jacobi")  # above λ/n: accepted
  with pytest.raises(ValueError, match=r"needs prox .* or client_optimizer"):
    mixture_admm(quad_loss, 1.0, 2.0, num_clients=N)
  with pytest.raises(ValueError, match=r"local_steps must be a Python int >= 1; got 0"):
    mixture_admm(quad_loss, 1.0, 2.0, num_clients=N, client_optimizer=optax.sgd(0.1), local_steps=0)
  with pytest.raises(TypeError, match=r"num_clients must be a Python int >= 1"):
    mixture_admm(quad_loss, 1.0, 2.0, num_clients=4.0, prox=prox)
  a, b = _problem()
  batches = _batches(a, b)
  algo = mixture_admm(quad_loss, 1.0, 2.0, num_clients=N + 1, prox=prox)
  with pytest.raises(ValueError, match=r"num_clients = 5 clients \(full participation\); got C = 4"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), batches)
  algo = mixture_admm(quad_loss, 1.0, 2.0, num_clients=N, prox=prox)
  with pytest.raises(ValueError, match=r"client_id must be a permutation of arange\(4\) \(every client once\)"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), batches.replace(client_id=jnp.array([0, 1, 1, 2])))
