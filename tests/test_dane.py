"""DANE, FedDANE and FADL against float64 NumPy transcriptions of their papers' iterations.

* DANE with exact local solves on least squares (a quadratic) is the closed form of Shamir et al.'s Section 3,
  w_{t+1} = w_t − η (Σ_k p_k (H_k + μI)⁻¹) ∇f(w_t), at η = 1, μ = 0 and at other (η, μ), traced through one program.
* FedDANE on a sample of the clients, with local SGD (minibatch steps) on the local problem, is the NumPy loop of
  Li et al.'s Algorithm 1 over the round's clients only.
* FADL's line search picks the largest 2^{−j} meeting Armijo's condition (computed in NumPy from the DANE
  direction), below 1 where DANE overshoots, and FADL is DANE where the unit step is accepted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import lsq_loss, pack

import fedjax_opt as fo

N, S, B, D = 4, 2, 5, 3
ROUNDS = 3


def _clients(rng, sizes, *, shift=0.7):
  """Least-squares clients with shifted inputs and their own targets (non-IID), or one shared model (shift=0)."""
  truth = rng.normal(size=D)
  out = []
  for k, n in enumerate(sizes):
    x = rng.normal(loc=shift * k, size=(n, D))
    target = truth if shift == 0 else rng.normal(size=D)
    out.append((x, x @ target + 0.3 * rng.normal(size=n)))
  return out


def _design(x):
  return np.concatenate([x, np.ones((len(x), 1))], axis=1)


def _quadratics(clients):
  """(H_k, c_k, p_k) with f_k(θ) = ½ mean (A_k θ − y_k)², ∇f_k = H_k θ − c_k, p_k = n_k / n."""
  hs = [_design(x).T @ _design(x) / len(y) for x, y in clients]
  cs = [_design(x).T @ y / len(y) for x, y in clients]
  n = np.array([len(y) for _, y in clients], float)
  return hs, cs, n / n.sum()


def _objective(clients, theta):
  _, _, p = _quadratics(clients)
  return sum(pk * 0.5 * np.mean((_design(x) @ theta - y)**2) for pk, (x, y) in zip(p, clients))


def _dane_np(clients, theta, eta, mu, rounds):
  hs, cs, p = _quadratics(clients)
  history = []
  for _ in range(rounds):
    g = sum(pk * (h @ theta - c) for pk, h, c in zip(p, hs, cs))
    theta = theta - eta * sum(pk * np.linalg.solve(h + mu * np.eye(D + 1), g) for pk, h in zip(p, hs))
    history.append(theta)
  return np.array(history)


def _flat(params):
  return np.concatenate([np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)[None]], -1)


def _start(rng):
  return {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.asarray(0.5, jnp.float32)}


@functools.lru_cache(maxsize=None)
def _run(name):
  """A jitted `run(params, batches, hyper)` of ROUNDS steps of `name` → (params after each round, last metrics)."""

  def build(hyper):
    if name == "dane":
      return fo.algorithms.dane(lsq_loss, hyper[0], hyper[1], num_clients=N)
    if name == "feddane":
      return fo.algorithms.feddane(lsq_loss, hyper[1], client_optimizer=optax.sgd(hyper[0]), local_steps=3)
    return fo.algorithms.fadl(lsq_loss, hyper[1], num_clients=N)

  @jax.jit
  def run(params, batches, hyper):
    algorithm = build(hyper)

    def one(state, _):
      state = algorithm.step(state, batches)
      return state, (state.params, state.metrics)

    _, (history, metrics) = jax.lax.scan(one, algorithm.init(params, jax.random.key(0)), length=ROUNDS)
    return history, metrics

  return run


def _history(params):
  return np.concatenate([np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)[:, None]], 1)


@pytest.mark.parametrize("eta, mu", [(1.0, 0.0), (0.7, 0.4)])
def test_dane_with_exact_local_solves_on_a_quadratic_is_the_closed_form_iteration(rng, eta, mu):
  clients = _clients(rng, [6, 9, 8, 10])
  params = _start(rng)
  history, metrics = _run("dane")(params, pack(clients, S, B), jnp.asarray([eta, mu], jnp.float32))
  want = _dane_np(clients, _flat(params), eta, mu, ROUNDS)
  np.testing.assert_allclose(_history(history), want, rtol=2e-4, atol=2e-4)
  assert np.all(np.asarray(metrics["step_size"]) == 1) and np.all(np.asarray(metrics["num_clients"]) == N)
  np.testing.assert_allclose(np.asarray(metrics["client_loss"])[0], _objective(clients, _flat(params)), rtol=1e-5)
  model = 32 * (D + 1)
  assert np.all(np.asarray(metrics["bits_up"]) == 2 * model) and np.all(np.asarray(metrics["bits_down"]) == 2 * model)


def test_dane_and_fadl_need_every_client_and_one_local_solver():
  clients = _clients(np.random.default_rng(0), [6, 6, 6])
  batches = pack(clients, S, B)
  params = {"w": jnp.zeros(D), "b": jnp.zeros(())}
  for make in (lambda: fo.algorithms.dane(lsq_loss, 1.0, 0.0, num_clients=N),
               lambda: fo.algorithms.fadl(lsq_loss, 0.0, num_clients=N)):
    algorithm = make()
    with pytest.raises(ValueError, match="full participation"):
      algorithm.step(algorithm.init(params, jax.random.key(0)), batches)
  with pytest.raises(ValueError, match="give one of them"):
    fo.algorithms.dane(lsq_loss, num_clients=N, client_optimizer=optax.sgd(0.1), cg_iters=3)
  with pytest.raises(ValueError, match="eta"):
    fo.algorithms.dane(lsq_loss, 0.0, num_clients=N)
  with pytest.raises(ValueError, match="mu"):
    fo.algorithms.feddane(lsq_loss, -1.0)
  with pytest.raises(ValueError, match="armijo"):
    fo.algorithms.fadl(lsq_loss, num_clients=N, armijo=1.5)


def _feddane_np(clients, batches, theta, lr, mu, steps, rounds):
  """Li et al.'s Algorithm 1 over the clients with weight > 0, local SGD step s on batch s mod S."""
  x_all, y_all = np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64)
  mask, weight = np.asarray(batches.mask), np.asarray(batches.weight, np.float64)
  sampled = [k for k in range(len(weight)) if weight[k] > 0]
  p = weight[sampled] / weight[sampled].sum()

  def grad(theta, x, y):
    a = _design(x)
    return a.T @ (a @ theta - y) / len(y)

  history = []
  for _ in range(rounds):
    full = {k: grad(theta, *clients[k]) for k in sampled}
    g = sum(pk * full[k] for pk, k in zip(p, sampled))
    new = []
    for k in sampled:
      v = theta.copy()
      for s in range(steps):
        m = mask[k, s % S]
        if m.any():
          v = v - lr * (grad(v, x_all[k, s % S][m], y_all[k, s % S][m]) + g - full[k] + mu * (v - theta))
      new.append(v)
    theta = sum(pk * v for pk, v in zip(p, new))
    history.append(theta)
  return np.array(history)


def test_feddane_with_local_sgd_averages_the_rounds_clients_only(rng):
  clients = _clients(rng, [7, 9, 10, 8])
  batches = pack(clients, S, B)
  batches = batches.replace(weight=batches.weight.at[2].set(0.0))  # client 2 is not in the round
  params = _start(rng)
  lr, mu = 0.05, 0.3
  history, metrics = _run("feddane")(params, batches, jnp.asarray([lr, mu], jnp.float32))
  want = _feddane_np(clients, batches, _flat(params), lr, mu, 3, ROUNDS)
  np.testing.assert_allclose(_history(history), want, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(metrics["num_clients"]) == N - 1)
  # what the absent client holds changes nothing
  other = batches.replace(data={"x": batches.data["x"].at[2].multiply(5.0), "y": batches.data["y"].at[2].add(3.0)})
  again, _ = _run("feddane")(params, other, jnp.asarray([lr, mu], jnp.float32))
  np.testing.assert_array_equal(_history(again), _history(history))


def _armijo_np(clients, theta, direction, slope, beta=1e-4, num=10):
  f0 = _objective(clients, theta)
  for j in range(num):
    alpha = 2.0**-j
    if _objective(clients, theta + alpha * direction) <= f0 + beta * alpha * slope:
      return alpha
  return 0.0


def _fadl_np(clients, theta, mu, rounds):
  hs, cs, p = _quadratics(clients)
  history, steps = [], []
  for _ in range(rounds):
    g = sum(pk * (h @ theta - c) for pk, h, c in zip(p, hs, cs))
    d = -sum(pk * np.linalg.solve(h + mu * np.eye(D + 1), g) for pk, h in zip(p, hs))
    alpha = _armijo_np(clients, theta, d, g @ d)
    theta = theta + alpha * d
    history.append(theta)
    steps.append(alpha)
  return np.array(history), np.array(steps)


def test_fadl_searches_along_the_dane_direction_and_is_dane_when_the_unit_step_holds(rng):
  params = _start(rng)
  run = _run("fadl")
  # Few examples per client, inputs far apart: DANE's averaged solution overshoots and FADL's step shrinks.
  hard = _clients(rng, [5, 5, 5, 5], shift=1.5)
  history, metrics = run(params, pack(hard, S, B), jnp.asarray([1.0, 0.0], jnp.float32))
  want, steps = _fadl_np(hard, _flat(params), 0.0, ROUNDS)
  assert steps[0] < 1
  np.testing.assert_array_equal(np.asarray(metrics["step_size"]), steps.astype(np.float32))
  np.testing.assert_allclose(_history(history), want, rtol=2e-4, atol=2e-4)
  model = 32 * (D + 1)  # up: ∇f_k, w_k and J + 1 = 11 losses; down: w_t, g_t, d_t
  assert np.all(np.asarray(metrics["bits_up"]) == 2 * model + 32 * 11)
  assert np.all(np.asarray(metrics["bits_down"]) == 3 * model)
  # IID clients with a proximal term: the unit step is accepted in every round, and FADL is DANE (η = 1).
  easy = _clients(rng, [10, 10, 10, 10], shift=0.0)
  history, metrics = run(params, pack(easy, S, B), jnp.asarray([1.0, 0.5], jnp.float32))
  assert np.all(np.asarray(metrics["step_size"]) == 1)
  np.testing.assert_allclose(_history(history), _dane_np(easy, _flat(params), 1.0, 0.5, ROUNDS), rtol=2e-4,
                             atol=2e-4)
