"""CoCoA+ against independent solvers of the same problems and against weak duality.

* Ridge regression: w reaches scikit-learn's `Ridge` on the pooled data (the intercept a regularised constant
  feature: `Ridge(alpha=λn, fit_intercept=False)` on [X, 1]).
* Linear SVM (hinge loss): w reaches liblinear's dual solver (`LinearSVC(loss="hinge", C=1/(λn))`, which
  regularises its intercept the same way).
* The certificate: the reported gap is P(w) − D(α) recomputed in float64 NumPy from the state, is >= 0 in every
  round, and converges to 0. The dual objective never decreases (σ′ = γK makes every round a dual ascent step:
  Ma et al. 2015's lower bound by the local subproblems); the gap itself need not fall in every round, and at
  λ = 0.05 it rises in many. Under x64 with a float64 model the metrics are float64 and agree with the float64
  NumPy certificate to 1e-12, and the gap falls below 1e-9, where ‖w − w*‖² ≤ 2 gap / λ holds against Ridge's w*.
* The primal-dual link w = Aα/(λn) holds after the rounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import logistic_clients, pack, run_rounds
from sklearn.linear_model import Ridge
from sklearn.svm import LinearSVC

import fedjax_opt as fo

N, S, B, D = 4, 2, 5, 3
LAM = 0.3
ROUNDS = 300


@functools.lru_cache(maxsize=None)
def _run(loss):
  algorithm = fo.algorithms.cocoa(LAM, loss=loss, num_clients=N, num_examples=S * B, local_steps=2 * S * B)

  @jax.jit
  def run(params, batches):
    def one(state, _):
      state = algorithm.step(state, batches)
      return state, state.metrics

    return jax.lax.scan(one, algorithm.init(params, jax.random.key(0)), length=ROUNDS)

  return run


def _pooled(clients):
  x = np.concatenate([c[0] for c in clients])
  return np.concatenate([x, np.ones((len(x), 1))], axis=1), np.concatenate([c[1] for c in clients])


def _data(rng, loss):
  if loss == "squared":
    clients = [(x, x @ rng.normal(size=D) + 0.2 * rng.normal(size=len(x)))
               for x in (rng.normal(loc=0.5 * k, size=(n, D)) for k, n in enumerate([6, 9, 8, 10]))]
  else:
    clients = [(x, 2 * y - 1) for x, y in logistic_clients(rng, [6, 9, 8, 10], D)]
  return clients


def _reference(clients, loss):
  a, y = _pooled(clients)
  n = len(y)
  if loss == "squared":
    return Ridge(alpha=LAM * n, fit_intercept=False, solver="cholesky").fit(a, y).coef_
  svm = LinearSVC(loss="hinge", C=1 / (LAM * n), fit_intercept=False, dual=True, tol=1e-10, max_iter=1_000_000)
  return svm.fit(a, y).coef_[0]


def _gap_np(clients, batches, theta, duals, loss, lam=LAM):
  """P(w) − D(α) in float64 from the state's w and α (slots read through the batches' mask), and Aα/(λn)."""
  a, y = _pooled(clients)
  mask = np.asarray(batches.mask).reshape(N, -1)
  alpha = np.concatenate([np.asarray(duals, np.float64)[k][mask[k]] for k in range(N)])
  z = a @ theta
  if loss == "squared":
    primal_terms, conj = 0.5 * (z - y)**2, -alpha * y + 0.5 * alpha**2
  else:
    primal_terms, conj = np.maximum(0, 1 - y * z), -alpha * y
  return np.mean(primal_terms) + np.mean(conj) + lam * theta @ theta, a.T @ alpha / (lam * len(y))


@pytest.mark.parametrize("loss", ["squared", "hinge"])
def test_cocoa_reaches_the_centralized_solution_with_a_falling_nonnegative_gap(rng, loss):
  clients = _data(rng, loss)
  batches = pack(clients, S, B)
  params = {"w": jnp.ones(D, jnp.float32), "b": jnp.ones((), jnp.float32)}  # the primal starts at w(0) = 0
  state, metrics = _run(loss)(params, batches)
  theta = np.r_[np.asarray(state.params["w"], np.float64), float(state.params["b"])]
  np.testing.assert_allclose(theta, _reference(clients, loss), atol=1e-4)
  gap, primal_of_duals = _gap_np(clients, batches, theta, state.duals, loss)
  np.testing.assert_allclose(theta, primal_of_duals, rtol=1e-4, atol=1e-5)  # w = Aα/(λn)
  gaps, duals = np.asarray(metrics["duality_gap"]), np.asarray(metrics["dual_objective"])
  assert np.all(gaps >= -1e-5)  # float32 rounding of w = Aα/(λn), kept incrementally
  assert np.all(np.diff(duals) >= -1e-5)
  assert gaps[-1] < 1e-3 * gaps[0] and gap < 1e-3 * gaps[0]
  assert np.all(np.asarray(metrics["num_clients"]) == N)
  model = 32 * (D + 1)  # Δw_k up, w down
  assert np.all(np.asarray(metrics["bits_up"]) == model) and np.all(np.asarray(metrics["bits_down"]) == model)
  # the first reported gap is the certificate at (w, α) = (0, 0): (1/n) Σ ℓ_i(0) (the conjugate terms are 0)
  _, y = _pooled(clients)
  np.testing.assert_allclose(gaps[0], np.mean(0.5 * y**2) if loss == "squared" else 1.0, rtol=1e-5)


SMALL_LAM = 0.05
X64_ROUNDS = 2000


def test_cocoa_dual_objective_never_decreases_and_the_gap_converges_though_not_monotonically(rng):
  """Ridge at λ = 0.05 in float64 (x64): D(α_t) is non-decreasing round by round (to float64 rounding), the gap
  P(w_t) − D(α_t) rises in some rounds yet reaches < 1e-9; every metric is float64 and the last one matches the
  float64 NumPy certificate of the state it was reported for; w is within sqrt(2 gap / λ) of scikit-learn's Ridge."""
  clients = _data(rng, "squared")
  with jax.enable_x64(True):
    batches = pack(clients, S, B, dtype=np.float64)
    algorithm = fo.algorithms.cocoa(SMALL_LAM, num_clients=N, num_examples=S * B)
    params = {"w": jnp.zeros(D, jnp.float64), "b": jnp.zeros((), jnp.float64)}

    state, metrics = run_rounds(algorithm.step, algorithm.init(params, jax.random.key(0)), batches, X64_ROUNDS)
    last = jax.jit(algorithm.step)(state, batches).metrics  # the certificate at the final (w, α)
  for name in ("primal_objective", "dual_objective", "duality_gap", "update_norm"):
    assert metrics[name].dtype == jnp.float64 and last[name].dtype == jnp.float64, name
  gaps, duals = np.asarray(metrics["duality_gap"]), np.asarray(metrics["dual_objective"])
  assert np.all(np.diff(duals) >= -1e-13 * np.abs(duals[1:]))  # dual ascent, every round
  assert np.sum(np.diff(gaps) > 1e-13) >= 10  # the gap is not monotone: the primal rises in some rounds
  assert np.all(gaps >= -1e-13)
  theta = np.r_[np.asarray(state.params["w"]), float(state.params["b"])]
  gap, primal_of_duals = _gap_np(clients, batches, theta, state.duals, "squared", SMALL_LAM)
  np.testing.assert_allclose(theta, primal_of_duals, rtol=1e-10, atol=1e-12)  # w = Aα/(λn)
  assert abs(float(last["duality_gap"]) - gap) <= 1e-12
  a, y = _pooled(clients)
  primal = np.mean(0.5 * (a @ theta - y)**2) + 0.5 * SMALL_LAM * theta @ theta
  np.testing.assert_allclose([float(last["primal_objective"]), float(last["dual_objective"])], [primal, primal - gap],
                             rtol=1e-12)  # float32 metrics would be off by ~1e-8 relative
  assert 0 <= gap < 1e-9 < 1e-6 * gaps[0]
  ridge = Ridge(alpha=SMALL_LAM * len(y), fit_intercept=False, solver="cholesky").fit(a, y).coef_
  assert np.sum((theta - ridge)**2) <= 2 * gap / SMALL_LAM * (1 + 1e-6) + 1e-15


def test_cocoa_checks_its_arguments_and_inputs():
  with pytest.raises(ValueError, match="loss"):
    fo.algorithms.cocoa(LAM, loss="logistic", num_clients=N, num_examples=S * B)
  with pytest.raises(ValueError, match="gamma"):
    fo.algorithms.cocoa(LAM, 2.0, num_clients=N, num_examples=S * B)
  with pytest.raises(ValueError, match="lam"):
    fo.algorithms.cocoa(0.0, num_clients=N, num_examples=S * B)
  algorithm = fo.algorithms.cocoa(LAM, num_clients=N, num_examples=S * B)
  with pytest.raises(TypeError, match="linear model"):
    algorithm.init({"kernel": jnp.zeros((D, 2))}, jax.random.key(0))
  clients = _data(np.random.default_rng(1), "squared")
  state = algorithm.init({"w": jnp.zeros(D), "b": jnp.zeros(())}, jax.random.key(0))
  with pytest.raises(ValueError, match="num_examples"):
    algorithm.step(state, pack(clients, S, B + 1))
  with pytest.raises(ValueError, match="full participation"):
    algorithm.step(state, pack(clients[:3], S, B))


def test_hinge_optimum_is_the_primal_minimum_of_an_independent_qp():
  """`fo.algorithms.hinge_optimum` (the maximum of CoCoA+'s dual) equals min (1/n) Σ ξ_i + (λ/2)‖w‖² subject to
  ξ_i ≥ 0 and ξ_i ≥ 1 − t_i a_iᵀw, a_i = (x_i, 1), solved by scipy's SLSQP on the primal (strong duality)."""
  import scipy.optimize
  rng = np.random.default_rng(3)
  n, d, lam = 12, 2, 0.1
  x = rng.normal(size=(n, d))
  t = np.where(x[:, 0] + 0.3 * rng.normal(size=n) > 0, 1.0, -1.0)
  a = np.hstack([x, np.ones((n, 1))])
  objective = lambda z: z[d + 1:].mean() + 0.5 * lam * z[:d + 1] @ z[:d + 1]
  constraints = [{"type": "ineq", "fun": lambda z: z[d + 1:]},
                 {"type": "ineq", "fun": lambda z: z[d + 1:] - (1.0 - t * (a @ z[:d + 1]))}]
  primal = scipy.optimize.minimize(objective, np.concatenate([np.zeros(d + 1), np.ones(n)]), method="SLSQP",
                                   constraints=constraints, options=dict(ftol=1e-14, maxiter=2000))
  assert primal.success, primal.message
  np.testing.assert_allclose(fo.algorithms.hinge_optimum(x, t, lam), primal.fun, rtol=1e-7)


def test_cocoa_model_scores_and_losses_are_numpy_s():
  rng = np.random.default_rng(4)
  x, y = rng.normal(size=(6, 3)).astype(np.float32), np.array([0, 1, 1, 0, 1, 0], np.float32)
  params = {"w": jnp.asarray(rng.normal(size=3), jnp.float32), "b": jnp.float32(0.2)}
  s = x.astype(np.float64) @ np.asarray(params["w"], np.float64) + 0.2
  t = 2 * y - 1
  for loss, want in (("squared", 0.5 * (s - t) ** 2), ("hinge", np.maximum(0, 1 - t * s))):
    model = fo.algorithms.cocoa_model(3, loss)
    np.testing.assert_allclose(model.loss_fn(params, {"x": x, "y": y}), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(model.accuracy_fn(params, {"x": x, "y": y}), ((s > 0) == (y == 1)).astype(np.float32))
  with pytest.raises(ValueError, match="loss"):
    fo.algorithms.cocoa_model(3, "logistic")
