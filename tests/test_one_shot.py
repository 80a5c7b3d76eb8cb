"""One-shot averaging against float64 NumPy.

* With exact local solves of ridge regression the model is Σ_k p_k ŵ_k, ŵ_k = (A_kᵀA_k/n_k + λD)⁻¹ A_kᵀy_k/n_k,
  Zhang, Duchi and Wainwright's divide-and-conquer estimator with the linear kernel, after one exchange; later
  steps change nothing and send nothing.
* With local training the model is the average of the clients' NumPy SGD runs from the initial model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_clients, pack

import fedjax_opt as fo

S, B, D = 2, 5, 3
L2 = 0.2


def _ridge_loss(params, batch):
  r = batch["x"] @ params["w"] + params["b"] - batch["y"]
  return 0.5 * jnp.square(r) + 0.5 * L2 * jnp.sum(jnp.square(params["w"]))


def _design(x):
  return np.concatenate([x, np.ones((len(x), 1))], axis=1)


@functools.lru_cache(maxsize=None)
def _run(local):
  if local == "exact":
    algorithm = fo.algorithms.one_shot_average(_ridge_loss)
  else:
    algorithm = fo.algorithms.one_shot_average(_ridge_loss, client_optimizer=optax.sgd(0.05), local_steps=3)

  @jax.jit
  def run(params, batches):
    first = algorithm.step(algorithm.init(params, jax.random.key(0)), batches)
    return first, algorithm.step(first, batches)

  return run


def test_one_shot_average_of_exact_ridge_solutions_is_the_divide_and_conquer_estimator(rng):
  clients = make_clients(rng, [6, 9, 8, 10], D)
  batches = pack(clients, S, B)
  params = {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.asarray(1.0, jnp.float32)}
  first, second = _run("exact")(params, batches)
  penalty = np.diag(np.r_[np.full(D, L2), 0.0])
  n = np.array([len(y) for _, y in clients], float)
  local = [np.linalg.solve(_design(x).T @ _design(x) / len(y) + penalty, _design(x).T @ y / len(y))
           for x, y in clients]
  want = sum(nk / n.sum() * wk for nk, wk in zip(n, local))
  got = np.r_[np.asarray(first.params["w"]), float(first.params["b"])]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert bool(first.metrics["communicated"]) and float(first.metrics["bits_up"]) == 32 * (D + 1)
  for a, b in zip(jax.tree.leaves(second.params), jax.tree.leaves(first.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not bool(second.metrics["communicated"])
  assert float(second.metrics["bits_up"]) == 0 and float(second.metrics["bits_down"]) == 0


@pytest.mark.slow
def test_one_shot_average_of_local_training_runs(rng):
  clients = make_clients(rng, [6, 9, 8, 10], D)
  batches = pack(clients, S, B)
  params = {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.asarray(0.0, jnp.float32)}
  first, _ = _run("sgd")(params, batches)
  x_all, y_all, mask = (np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64),
                        np.asarray(batches.mask))
  theta0 = np.r_[np.asarray(params["w"], np.float64), 0.0]
  runs = []
  for k in range(len(clients)):
    theta = theta0.copy()
    for s in range(3):
      m = mask[k, s % S]
      a, y = _design(x_all[k, s % S][m]), y_all[k, s % S][m]
      theta = theta - 0.05 * (a.T @ (a @ theta - y) / len(y) + np.r_[L2 * theta[:D], 0.0])
    runs.append(theta)
  n = np.array([len(y) for _, y in clients], float)
  want = sum(nk / n.sum() * t for nk, t in zip(n, runs))
  np.testing.assert_allclose(np.r_[np.asarray(first.params["w"]), float(first.params["b"])], want, rtol=1e-5,
                             atol=1e-6)


def test_one_shot_average_takes_one_local_solver():
  with pytest.raises(ValueError, match="give one of them"):
    fo.algorithms.one_shot_average(_ridge_loss, client_optimizer=optax.sgd(0.1), cg_iters=2)
  with pytest.raises(TypeError, match="local_steps"):
    fo.algorithms.one_shot_average(_ridge_loss, local_steps=1.5)
