"""`fo.objectives.pooled` and `fo.objectives.minimize` against closed forms and scikit-learn."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt import objectives


def _batches(x, y, sizes, slots):
  """ClientBatches [C, 1, slots] of clients holding `sizes` consecutive examples of (x, y)."""
  c = len(sizes)
  data_x = np.zeros((c, 1, slots) + x.shape[1:], x.dtype)
  data_y = np.zeros((c, 1, slots), y.dtype)
  mask = np.zeros((c, 1, slots), bool)
  start = 0
  for i, n in enumerate(sizes):
    data_x[i, 0, :n], data_y[i, 0, :n], mask[i, 0, :n] = x[start:start + n], y[start:start + n], True
    start += n
  return fo.ClientBatches(data={"x": jnp.asarray(data_x), "y": jnp.asarray(data_y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray(sizes, jnp.float32), client_id=jnp.arange(c, dtype=jnp.int32))


def test_pooled_counts_every_example_once_whatever_the_client_sizes():
  rng = np.random.default_rng(0)
  sizes = [2, 7, 1]
  x = rng.normal(size=(10, 3)).astype(np.float32)
  y = rng.normal(size=10).astype(np.float32)
  w = rng.normal(size=3).astype(np.float32)
  loss = lambda p, b: 0.5 * jnp.square(b["x"] @ p - b["y"])
  value = objectives.pooled(loss)(jnp.asarray(w), _batches(x, y, sizes, 8))
  expected = np.mean(0.5 * (x.astype(np.float64) @ w - y) ** 2)  # the mean over the 10 examples, not over clients
  assert float(value) == pytest.approx(expected, rel=1e-6)


def test_minimize_ridge_least_squares_matches_the_normal_equations():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(40, 4))
  y = x @ rng.normal(size=4) + 0.1 * rng.normal(size=40)
  l2 = 0.3
  loss = lambda p, b: 0.5 * jnp.square(b["x"] @ p - b["y"]) + 0.5 * l2 * jnp.sum(jnp.square(p))
  batches = _batches(x.astype(np.float32), y.astype(np.float32), [10, 25, 5], 25)
  solution, f_star = objectives.minimize(objectives.pooled(loss), jnp.zeros(4, jnp.float32), batches)
  # (1/n) Xᵀ(Xw − y) + l2 w = 0.
  n = len(y)
  exact = np.linalg.solve(x.T @ x / n + l2 * np.eye(4), x.T @ y / n)
  assert np.asarray(solution).dtype == np.float32
  np.testing.assert_allclose(solution, exact, atol=1e-5)
  x32, y32 = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
  exact_value = np.mean(0.5 * (x32 @ exact - y32) ** 2) + 0.5 * l2 * exact @ exact
  assert f_star == pytest.approx(exact_value, rel=1e-6)


def test_minimize_multinomial_logistic_regression_matches_scikit_learn():
  # The independent reference; scikit-learn is in the `data` extra (part of `dev`), so CI runs this test.
  sklearn = pytest.importorskip("sklearn.linear_model")
  rng = np.random.default_rng(2)
  n, d, k, l2 = 120, 5, 3, 0.05
  x = rng.normal(size=(n, d))
  y = rng.integers(0, k, size=n)
  loss = lambda p, b: (optax.losses.softmax_cross_entropy_with_integer_labels(b["x"] @ p, b["y"])
                       + 0.5 * l2 * jnp.sum(jnp.square(p)))
  batches = _batches(x.astype(np.float32), y.astype(np.int32), [30, 50, 40], 50)
  solution, f_star = objectives.minimize(objectives.pooled(loss), jnp.zeros((d, k), jnp.float32), batches)
  # scikit-learn minimises ½‖W‖² + C Σ_i ℓ_i; dividing by C n gives (1/n) Σ ℓ_i + (1/(2Cn))‖W‖²: C = 1/(n l2).
  reference = sklearn.LogisticRegression(C=1.0 / (n * l2), fit_intercept=False, tol=1e-12, max_iter=10_000)
  reference.fit(x.astype(np.float32), y)
  # The optimum is flat (small l2), so two good solvers agree on the coefficients to ~1e-4 and on F to ~1e-9.
  np.testing.assert_allclose(np.asarray(solution), reference.coef_.T, atol=1e-3)
  with jax.enable_x64(True):
    at_reference = objectives.pooled(loss)(jnp.asarray(reference.coef_.T), jax.tree.map(
        lambda a: jnp.asarray(np.asarray(a, np.float64)) if np.asarray(a).dtype == np.float32 else a, batches))
  assert f_star == pytest.approx(float(at_reference), rel=1e-7)
  assert f_star <= float(at_reference) * (1 + 1e-9)
