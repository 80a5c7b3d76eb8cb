"""GIANT against NumPy: its direction is the n_k-weighted average of the local Newton directions H_k⁻¹ g
(`numpy.linalg.solve` on the float64 Hessians of a ridge-regularised logistic loss), by CG and by the direct
solve; its step is the largest 2^{−j} meeting Armijo's condition on the global objective; and CG itself solves
a positive definite system as `solve` does."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import logistic_clients, pack, ridge_logistic_loss

import fedjax_opt as fo
from fedjax_opt.core import newton

N, S, B, D = 4, 2, 6, 3
L2 = 0.1
ROUNDS = 2


def _design(x):
  return np.concatenate([x, np.ones((len(x), 1))], axis=1)


def _local(x, y, theta):
  """float64 (loss, gradient, Hessian) of client k's mean ridge-logistic loss at θ = (w, b)."""
  a = _design(x)
  s = a @ theta
  p = 1 / (1 + np.exp(-s))
  penalty = np.diag(np.r_[np.full(D, L2), 0.0])
  loss = np.mean(np.logaddexp(0, s) - y * s) + 0.5 * L2 * theta[:D] @ theta[:D]
  return loss, a.T @ (p - y) / len(y) + penalty @ theta, (a.T * (p * (1 - p))) @ a / len(y) + penalty


def _giant_np(clients, theta, rounds, beta=1e-4, num=10):
  n = np.array([len(y) for _, y in clients], float)
  p = n / n.sum()
  f = lambda t: sum(pk * _local(x, y, t)[0] for pk, (x, y) in zip(p, clients))
  history, steps = [], []
  for _ in range(rounds):
    local = [_local(x, y, theta) for x, y in clients]
    g = sum(pk * lk[1] for pk, lk in zip(p, local))
    direction = sum(pk * np.linalg.solve(lk[2], g) for pk, lk in zip(p, local))
    alphas = [2.0**-j for j in range(num)]
    alpha = next((a for a in alphas if f(theta - a * direction) <= f(theta) - beta * a * g @ direction), 0.0)
    theta = theta - alpha * direction
    history.append(theta)
    steps.append(alpha)
  return np.array(history), np.array(steps)


@functools.lru_cache(maxsize=None)
def _run(cg_iters):
  algorithm = fo.algorithms.giant(ridge_logistic_loss(L2), num_clients=N, cg_iters=cg_iters)

  @jax.jit
  def run(params, batches):
    def one(state, _):
      state = algorithm.step(state, batches)
      return state, (state.params, state.metrics)

    return jax.lax.scan(one, algorithm.init(params, jax.random.key(0)), length=ROUNDS)[1]

  return run


# CG with P iterations against NumPy's solve (default tier); the direct solve of the [P, P] Hessian (slow tier).
@pytest.mark.parametrize("cg_iters", [pytest.param(None, marks=pytest.mark.slow), D + 1])
def test_giant_steps_along_the_average_of_the_local_newton_directions(rng, cg_iters):
  clients = logistic_clients(rng, [8, 12, 10, 9], D)
  params = {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.asarray(-0.3, jnp.float32)}
  history, metrics = _run(cg_iters)(params, pack(clients, S, B))
  theta0 = np.r_[np.asarray(params["w"], np.float64), float(params["b"])]
  want, steps = _giant_np(clients, theta0, ROUNDS)
  got = np.concatenate([np.asarray(history["w"]), np.asarray(history["b"])[:, None]], 1)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(metrics["step_size"]), steps.astype(np.float32))
  assert np.all(np.asarray(metrics["num_clients"]) == N)
  assert np.all(np.asarray(metrics["bits_up"]) == 2 * 32 * (D + 1) + 32 * 11)  # g_k, p_k and J + 1 = 11 losses
  assert np.all(np.asarray(metrics["bits_down"]) == 3 * 32 * (D + 1))  # w_t, g_t, p_t


def test_conjugate_gradient_solves_a_positive_definite_system_as_solve_does(rng):
  m = rng.normal(size=(6, 6))
  a = m @ m.T + 0.5 * np.eye(6)
  b = rng.normal(size=6)
  got = jax.jit(lambda a, b: newton.conjugate_gradient(lambda v: a @ v, b, 6))(jnp.asarray(a, jnp.float32),
                                                                               jnp.asarray(b, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), np.linalg.solve(a, b), rtol=1e-3, atol=1e-4)


def test_giant_checks_its_arguments():
  loss = ridge_logistic_loss(L2)
  with pytest.raises(TypeError, match="cg_iters"):
    fo.algorithms.giant(loss, num_clients=N, cg_iters=2.5)
  with pytest.raises(ValueError, match="line_search_steps"):
    fo.algorithms.giant(loss, num_clients=N, line_search_steps=0)
  with pytest.raises(ValueError, match="armijo"):
    fo.algorithms.giant(loss, num_clients=N, armijo=0.0)
