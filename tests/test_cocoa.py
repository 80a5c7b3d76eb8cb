"""CoCoA+ against independent solvers of the same problems and against weak duality.

* Ridge regression: w reaches scikit-learn's `Ridge` on the pooled data (the intercept a regularised constant
  feature: `Ridge(alpha=λn, fit_intercept=False)` on [X, 1]).
* Linear SVM (hinge loss): w reaches liblinear's dual solver (`LinearSVC(loss="hinge", C=1/(λn))`, which
  regularises its intercept the same way).
* The certificate: the reported gap is P(w) − D(α) recomputed in float64 NumPy from the state, is >= 0 in every
  round, and falls (the dual objective never decreases: σ′ = γK makes every round a dual ascent step).
* The primal-dual link w = Aα/(λn) holds after the rounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import logistic_clients, pack
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


def _gap_np(clients, batches, theta, duals, loss):
  """P(w) − D(α) in float64 from the state's w and α (slots read through the batches' mask)."""
  a, y = _pooled(clients)
  mask = np.asarray(batches.mask).reshape(N, -1)
  alpha = np.concatenate([np.asarray(duals, np.float64)[k][mask[k]] for k in range(N)])
  z = a @ theta
  if loss == "squared":
    primal_terms, conj = 0.5 * (z - y)**2, -alpha * y + 0.5 * alpha**2
  else:
    primal_terms, conj = np.maximum(0, 1 - y * z), -alpha * y
  return np.mean(primal_terms) + np.mean(conj) + LAM * theta @ theta, a.T @ alpha / (LAM * len(y))


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
