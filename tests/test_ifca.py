"""IFCA (Ghosh et al. 2020) against its paper.

* One round, both forms (model averaging: local SGD steps, per-cluster average
  of the models; gradient averaging: θ_j − (γ/Σw) Σ_{S_j} w_i g_i), against a
  float64 NumPy transcription of Algorithm 1: each client takes the cluster of
  lowest loss on its data; a cluster nobody chose keeps its model.
* With one cluster and no perturbation IFCA is FedAvg.
* It recovers 2, 3 and 4 planted groups exactly (adjusted Rand index 1) with
  random restarts (the paper's practice; the restart of lowest training loss
  is kept, all restarts one vmapped program), and beats FedAvg's accuracy by
  a wide margin there.
* A NaN client is dropped from every average, counted, and keeps cluster_of = −1.
* jit, reproducibility from the key, the initialization options, the errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clustered_problems import (fedavg_accuracy, label_shift_problem, least_squares_inputs, np_gradient, np_local_sgd,
                                np_mean_loss, personal_accuracy, run_rounds, softmax_loss, squares_loss, zeros_model)
from sklearn.metrics import adjusted_rand_score

import fedjax_opt as fo

K = 3


def _initial(dim=3):
  rng = np.random.default_rng(7)
  return {"w": rng.normal(size=(K, dim)) * 2, "b": rng.normal(size=(K,))}


def _numpy_round(form, x, y, mask, weight, init, lr):
  """Algorithm 1 of the paper in float64: cluster choice, local update, per-cluster average."""
  n = x.shape[0]
  losses = np.array([[np_mean_loss(init["w"][j], init["b"][j], x[i], y[i], mask[i]) for j in range(K)]
                     for i in range(n)])
  chosen = np.argmin(losses, axis=1)
  new_w, new_b = init["w"].copy(), init["b"].copy()
  if form == "model":
    models = [np_local_sgd(init["w"][c], init["b"][c], x[i], y[i], mask[i], lr) for i, c in enumerate(chosen)]
    for j in range(K):
      s = chosen == j
      if s.any():
        new_w[j] = sum(weight[i] * models[i][0] for i in np.flatnonzero(s)) / weight[s].sum()
        new_b[j] = sum(weight[i] * models[i][1] for i in np.flatnonzero(s)) / weight[s].sum()
  else:
    grads = [np_gradient(init["w"][c], init["b"][c], x[i], y[i], mask[i]) for i, c in enumerate(chosen)]
    for j in range(K):
      s = np.flatnonzero(chosen == j)
      new_w[j] = init["w"][j] - lr * sum(weight[i] * grads[i][0] for i in s) / weight.sum()
      new_b[j] = init["b"][j] - lr * sum(weight[i] * grads[i][1] for i in s) / weight.sum()
  return chosen, new_w, new_b


@pytest.mark.parametrize("form", ["model", "gradient"])
def test_one_round_is_algorithm_1_in_numpy(form):
  init = _initial()
  # Clients 0-2 near cluster 0's model, 3-5 near cluster 2's: cluster 1 is chosen by nobody.
  centers = np.stack([init["w"][0]] * 3 + [init["w"][2]] * 3) + 0.05
  x, y, mask, weight, batches = least_squares_inputs(centers=centers)
  y = y + np.where(np.arange(6) < 3, init["b"][0], init["b"][2])[:, None, None]
  batches = batches.replace(data={"x": batches.data["x"], "y": jnp.asarray(y, jnp.float32)})
  lr = 0.1
  kw = dict(client_optimizer=optax.sgd(lr)) if form == "model" else dict(server_optimizer=optax.sgd(lr))
  algo = fo.algorithms.ifca(squares_loss, num_clusters=K, num_clients=6, averaging=form,
                            initial_models=jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init), **kw)
  state = algo.init({"w": jnp.zeros(3), "b": jnp.zeros(())}, jax.random.key(0))
  state = jax.jit(algo.step)(state, batches)
  chosen, want_w, want_b = _numpy_round(form, x, y, mask, weight, init, lr)
  assert set(chosen) == {0, 2}
  np.testing.assert_array_equal(np.asarray(state.cluster_of), chosen)
  np.testing.assert_allclose(np.asarray(state.cluster_params["w"]), want_w, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.cluster_params["b"]), want_b, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(state.cluster_params["w"][1]), np.float32(init["w"][1]))  # nobody chose 1
  np.testing.assert_array_equal(np.asarray(state.metrics["cluster_counts"]), np.bincount(chosen, minlength=K))
  assert int(state.metrics["num_clients"]) == 6 and int(state.metrics["num_nonfinite"]) == 0
  # params: the most populated cluster (3 clients each: the lowest index, 0).
  np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(state.cluster_params["w"][0]))


def test_one_cluster_without_perturbation_is_fedavg():
  _, _, _, _, batches = least_squares_inputs()
  params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  ifca = fo.algorithms.ifca(squares_loss, num_clusters=1, num_clients=6, client_optimizer=optax.sgd(0.1),
                            init_noise=0.0)
  fedavg = fo.algorithms.fedavg(squares_loss, client_optimizer=optax.sgd(0.1))
  a = run_rounds(ifca, params, batches, 3, jax.random.key(0))
  b = run_rounds(fedavg, params, batches, 3, jax.random.key(0))
  for got, want in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


RESTARTS = 6


SLOW = pytest.mark.slow


# A convergence run (60 rounds × 6 restarts): the slow tier.
@pytest.mark.parametrize("groups", [pytest.param(g, marks=SLOW) for g in (2, 3, 4)])
def test_recovers_planted_groups_and_beats_fedavg(groups):
  batches, test, group = label_shift_problem(groups)
  algo = fo.algorithms.ifca(softmax_loss, num_clusters=groups, num_clients=len(group), client_optimizer=optax.sgd(0.5))
  keys = jax.random.split(jax.random.key(0), RESTARTS)
  states = jax.jit(jax.vmap(lambda k: run_rounds(algo, zeros_model(), batches, 60, k)))(keys)
  best = int(jnp.argmin(states.metrics["client_loss"]))  # the restart of lowest training loss
  state = jax.tree.map(lambda a: a[best], states)
  assert adjusted_rand_score(group, np.asarray(state.cluster_of)) == 1.0
  ours, fedavg = personal_accuracy(state, test), fedavg_accuracy(batches, test)
  assert ours > 0.9 and fedavg < 0.5 and ours - fedavg > 0.4, (ours, fedavg)
  np.testing.assert_array_equal(np.sort(np.asarray(state.metrics["cluster_counts"])), [4] * groups)


def test_adjusted_rand_index_is_the_textbook_one():
  # A hand-computed example: contingency [[2, 1], [0, 3]]; Σ C(n_ij,2) = 1 + 3 = 4, rows 3, 3 → 6, cols 2, 4 → 7,
  # C(6,2) = 15: expected 6·7/15 = 2.8, max (6 + 7)/2 = 6.5, ARI = (4 − 2.8) / (6.5 − 2.8) = 0.3243...
  assert adjusted_rand_score([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]) == pytest.approx(1.2 / 3.7)
  assert adjusted_rand_score([0, 0, 1, 1], [5, 5, 2, 2]) == 1.0  # label names do not matter


def test_a_nan_client_is_dropped_counted_and_never_assigned():
  x, y, mask, weight, batches = least_squares_inputs()
  poisoned = batches.replace(data={"x": batches.data["x"].at[1, 0, 0, 0].set(jnp.nan), "y": batches.data["y"]})
  absent = batches.replace(weight=batches.weight.at[1].set(0.0))
  algo = fo.algorithms.ifca(squares_loss, num_clusters=K, num_clients=6, client_optimizer=optax.sgd(0.1),
                            initial_models=jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _initial()))
  params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  got = run_rounds(algo, params, poisoned, 3, jax.random.key(0))
  want = run_rounds(algo, params, absent, 3, jax.random.key(0))
  assert int(got.metrics["num_nonfinite"]) == 1 and int(got.metrics["num_clients"]) == 5
  assert int(got.cluster_of[1]) == -1
  for a, b in zip(jax.tree.leaves(got.cluster_params), jax.tree.leaves(want.cluster_params)):
    assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  # Every client poisoned: no cluster changes.
  all_bad = batches.replace(data={"x": batches.data["x"] * jnp.nan, "y": batches.data["y"]})
  state = algo.init(params, jax.random.key(0))
  after = jax.jit(algo.step)(state, all_bad)
  assert int(after.metrics["num_nonfinite"]) == 6 and not bool(after.metrics["round_accepted"])
  for a, b in zip(jax.tree.leaves(after.cluster_params), jax.tree.leaves(state.cluster_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jit_reproducibility_and_initialization():
  _, _, _, _, batches = least_squares_inputs()
  params = {"w": jnp.ones(3), "b": jnp.zeros(())}
  algo = fo.algorithms.ifca(squares_loss, num_clusters=K, num_clients=6, client_optimizer=optax.sgd(0.1),
                            init_noise=0.5)
  s0 = algo.init(params, jax.random.key(1))
  # θ_j = params + σ max(std(leaf), 0.01) ξ_j: K distinct models around params (std 0 here: σ 0.01 = 0.005).
  spread = np.asarray(s0.cluster_params["w"]) - 1.0
  assert spread.shape == (K, 3) and 0.001 < spread.std() < 0.02 and len({tuple(r) for r in spread}) == K
  again = algo.init(params, jax.random.key(1))
  other = algo.init(params, jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(again.cluster_params["w"]), np.asarray(s0.cluster_params["w"]))
  assert not np.array_equal(np.asarray(other.cluster_params["w"]), np.asarray(s0.cluster_params["w"]))
  jitted = jax.jit(algo.step)(s0, batches)
  assert np.all(np.asarray(s0.cluster_of) == -1)
  # A client's model: its cluster's, or params (most populated) while unseen.
  table = fo.core.clusters.client_models(jitted)
  for i in range(6):
    np.testing.assert_array_equal(np.asarray(table["w"][i]),
                                  np.asarray(jitted.cluster_params["w"][int(jitted.cluster_of[i])]))
  one = fo.core.clusters.client_models(jitted, 2)
  np.testing.assert_array_equal(np.asarray(one["w"]), np.asarray(table["w"][2]))
  np.testing.assert_array_equal(np.asarray(fo.core.clusters.client_models(s0, 3)["w"]), np.asarray(s0.params["w"]))


def test_bad_arguments_are_named():
  with pytest.raises(TypeError, match="client_optimizer"):
    fo.algorithms.ifca(squares_loss, num_clusters=2, num_clients=4)
  with pytest.raises(ValueError, match="leave client_optimizer None"):
    fo.algorithms.ifca(squares_loss, num_clusters=2, num_clients=4, averaging="gradient",
                       client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(0.1))
  with pytest.raises(TypeError, match="server_optimizer"):
    fo.algorithms.ifca(squares_loss, num_clusters=2, num_clients=4, averaging="gradient")
  with pytest.raises(ValueError, match="averaging"):
    fo.algorithms.ifca(squares_loss, num_clusters=2, num_clients=4, averaging="both", client_optimizer=optax.sgd(1))
  with pytest.raises(ValueError, match="num_clusters"):
    fo.algorithms.ifca(squares_loss, num_clusters=0, num_clients=4, client_optimizer=optax.sgd(0.1))
  algo = fo.algorithms.ifca(squares_loss, num_clusters=2, num_clients=4, client_optimizer=optax.sgd(0.1),
                            initial_models={"w": jnp.zeros((3, 3)), "b": jnp.zeros((2,))})
  with pytest.raises(ValueError, match="initial_models"):
    algo.init({"w": jnp.zeros(3), "b": jnp.zeros(())}, jax.random.key(0))
