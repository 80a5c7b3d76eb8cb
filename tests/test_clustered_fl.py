"""Clustered FL (Sattler et al. 2020) against its paper.

* The bipartition is the paper's optimum argmin_{c₁∪c₂} max_{i∈c₁,j∈c₂} α_{i,j}:
  against a brute-force NumPy search over every bipartition of small random
  similarity matrices (value and partition), and the certificate (α_max^cross,
  α_min^intra, the separation gap) against NumPy on the found partition.
* One split round against a float64 NumPy transcription: local SGD, cosine
  similarities of the updates, brute-force bipartition, each half averaged
  separately from the parent's model.
* With one group CFL never splits and is FedAvg; with 2, 3 and 4 planted groups
  it splits recursively into exactly them (adjusted Rand index 1) and beats
  FedAvg's accuracy by a wide margin.
* A NaN client is dropped, counted, kept out of the split; max_clusters bounds
  the splits; jit and reproducibility.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clustered_problems import (fedavg_accuracy, label_shift_problem, least_squares_inputs, np_local_sgd,
                                personal_accuracy, run_rounds, softmax_loss, squares_loss, zeros_model)
from sklearn.metrics import adjusted_rand_score

import fedjax_opt as fo
from fedjax_opt.core import clusters


def _brute_force(a, members):
  """Every bipartition of the members: (the minimal largest cross similarity, the set of one optimal side)."""
  idx = np.flatnonzero(members)
  best, side = np.inf, None
  for r in range(1, len(idx)):
    for sub in itertools.combinations(idx[1:], r):  # sides not holding the first member
      two = set(sub)
      one = set(idx) - two
      value = max(a[i, j] for i in one for j in two)
      if value < best:
        best, side = value, two
  return best, side


def _certificate(a, one, two):
  cross = max(a[i, j] for i in one for j in two)
  pairs = [a[i, j] for s in (one, two) for i in s for j in s if i != j]
  intra = min(pairs) if pairs else 1.0
  return cross, intra, intra - cross


def test_bipartition_is_the_brute_force_optimum_and_its_certificate():
  rng = np.random.default_rng(0)
  split = jax.jit(clusters.minimax_bipartition)
  for _ in range(60):
    c = int(rng.integers(2, 9))
    vectors = rng.normal(size=(c, 4))
    a = vectors @ vectors.T / np.outer(np.linalg.norm(vectors, axis=1), np.linalg.norm(vectors, axis=1))
    members = rng.random(c) < 0.85
    got = split(jnp.asarray(a, jnp.float32), jnp.asarray(members))
    if members.sum() < 2:
      assert not bool(got.valid) and not np.any(np.asarray(got.side))
      continue
    best, two = _brute_force(a, members)
    side = set(np.flatnonzero(np.asarray(got.side)).tolist())
    assert side == two  # distinct similarities: the optimum is unique
    one = set(np.flatnonzero(members).tolist()) - side
    cross, intra, gap = _certificate(a, one, side)
    assert cross == pytest.approx(best, abs=1e-6)
    np.testing.assert_allclose([float(got.alpha_cross_max), float(got.alpha_intra_min), float(got.gap)],
                               [cross, intra, gap], atol=1e-5)


def test_cosine_similarity_against_numpy():
  rng = np.random.default_rng(1)
  u = {"w": rng.normal(size=(5, 3, 2)), "b": rng.normal(size=(5,))}
  u["w"][3] = 0.0
  u["b"][3] = 0.0  # a zero update: similarity 0
  flat = np.concatenate([u["w"].reshape(5, -1), u["b"][:, None]], axis=1)
  norms = np.linalg.norm(flat, axis=1)
  want = np.where(np.outer(norms, norms) > 0, flat @ flat.T / np.maximum(np.outer(norms, norms), 1e-300), 0)
  got = clusters.cosine_similarity(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), u))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def _two_group_inputs():
  rng = np.random.default_rng(3)
  centers = np.concatenate([np.tile(rng.normal(size=(1, 3)) * 2, (3, 1)), np.tile(rng.normal(size=(1, 3)) * 2, (3, 1))])
  return least_squares_inputs(centers=centers + 0.05 * rng.normal(size=(6, 3)), seed=3)


@functools.cache
def _squares_cfl(eps_2=0.0, max_clusters=3):
  """The least-squares CFL of the six two-group clients (ε₁ = 100, client sgd(0.1)), one object per (ε₂,
  max_clusters): the tests below share its compiled steps and rounds."""
  return fo.algorithms.clustered_fl(squares_loss, eps_1=100.0, eps_2=eps_2, max_clusters=max_clusters, num_clients=6,
                                    client_optimizer=optax.sgd(0.1))


@functools.cache
def _rounds(algo, rounds):
  """`run_rounds(algo, params, batches, rounds, key)` as one jitted program of (params, batches, key)."""
  return jax.jit(lambda params, batches, key: run_rounds(algo, params, batches, rounds, key))


def test_one_split_round_is_the_paper_in_numpy():
  x, y, mask, weight, batches = _two_group_inputs()
  lr = 0.1
  algo = _squares_cfl()
  w0, b0 = np.zeros(3), 0.0
  state = algo.init({"w": jnp.zeros(3), "b": jnp.zeros(())}, jax.random.key(0))
  state = jax.jit(algo.step)(state, batches)
  # NumPy: every client in cluster 0 trains from θ_0; the split is the brute-force optimum of the cosines.
  models = [np_local_sgd(w0, b0, x[i], y[i], mask[i], lr) for i in range(6)]
  updates = np.array([np.concatenate([m[0] - w0, [m[1] - b0]]) for m in models])
  norms = np.linalg.norm(updates, axis=1)
  a = updates @ updates.T / np.outer(norms, norms)
  _, two = _brute_force(a, np.ones(6, bool))
  one = set(range(6)) - two
  want_of = np.array([1 if i in two else 0 for i in range(6)])
  np.testing.assert_array_equal(np.asarray(state.cluster_of), want_of)
  assert adjusted_rand_score(want_of, [0, 0, 0, 1, 1, 1]) == 1.0  # the planted groups
  assert int(state.num_clusters) == 2 and np.asarray(state.metrics["split"]).tolist() == [True, False, False]
  for j, side in ((0, one), (1, two)):
    s = np.array(sorted(side))
    want = sum(weight[i] * updates[i] for i in s) / weight[s].sum()
    got = np.concatenate([np.asarray(state.cluster_params["w"][j]), [float(state.cluster_params["b"][j])]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  cross, intra, gap = _certificate(a, one, two)
  np.testing.assert_allclose([float(state.metrics[k][0]) for k in ("alpha_cross_max", "alpha_intra_min",
                                                                   "separation_gap")], [cross, intra, gap], atol=1e-5)
  assert gap > 0
  mean = weight @ updates / weight.sum()
  assert float(state.metrics["mean_update_norm"][0]) == pytest.approx(np.linalg.norm(mean), rel=1e-5)
  assert float(state.metrics["max_update_norm"][0]) == pytest.approx(norms.max(), rel=1e-5)
  np.testing.assert_array_equal(np.asarray(state.metrics["cluster_counts"]), [3, 3, 0])


def test_the_split_criterion_and_max_clusters():
  _, _, _, _, batches = _two_group_inputs()
  params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  # ε₂ above every update norm: never splits, and is FedAvg.
  never = _squares_cfl(eps_2=1e6)
  fedavg = fo.algorithms.fedavg(squares_loss, client_optimizer=optax.sgd(0.1))
  a = _rounds(never, 3)(params, batches, jax.random.key(0))
  b = _rounds(fedavg, 3)(params, batches, jax.random.key(0))
  assert int(a.num_clusters) == 1 and np.all(np.asarray(a.cluster_of) == 0)
  np.testing.assert_allclose(np.asarray(a.params["w"]), np.asarray(b.params["w"]), rtol=1e-6, atol=1e-7)
  # Splitting whenever possible: never more than max_clusters, each client in a used slot.
  state = _rounds(_squares_cfl(max_clusters=4), 5)(params, batches, jax.random.key(0))
  assert int(state.num_clusters) == 4 and int(np.max(np.asarray(state.cluster_of))) == 3
  assert np.sum(np.asarray(state.metrics["cluster_counts"])) == 6


def test_one_group_never_splits():
  batches, test, group = label_shift_problem(1)
  algo = fo.algorithms.clustered_fl(softmax_loss, eps_1=0.1, eps_2=0.3, max_clusters=4, num_clients=len(group),
                                    client_optimizer=optax.sgd(0.5))
  state = jax.jit(lambda b: run_rounds(algo, zeros_model(), b, 150, jax.random.key(0)))(batches)
  assert int(state.num_clusters) == 1 and np.all(np.asarray(state.cluster_of) == 0)
  assert float(state.metrics["mean_update_norm"][0]) < 0.1  # it did reach the stationarity test (ε₁)
  assert personal_accuracy(state, test) > 0.9


SLOW = pytest.mark.slow


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
@pytest.mark.parametrize("groups", [2, pytest.param(3, marks=SLOW), pytest.param(4, marks=SLOW)])
def test_recovers_planted_groups_and_beats_fedavg(groups):
  batches, test, group = label_shift_problem(groups)
  algo = fo.algorithms.clustered_fl(softmax_loss, eps_1=0.1, eps_2=0.3, max_clusters=6, num_clients=len(group),
                                    client_optimizer=optax.sgd(0.5))
  state = jax.jit(lambda b: run_rounds(algo, zeros_model(), b, 150, jax.random.key(0)))(batches)
  assert int(state.num_clusters) == groups
  assert adjusted_rand_score(group, np.asarray(state.cluster_of)) == 1.0
  ours, fedavg = personal_accuracy(state, test), fedavg_accuracy(batches, test)
  assert ours > 0.9 and fedavg < 0.5 and ours - fedavg > 0.4, (ours, fedavg)


def test_a_nan_client_is_dropped_counted_and_kept_out_of_the_split():
  _, _, _, _, batches = _two_group_inputs()
  poisoned = batches.replace(data={"x": batches.data["x"].at[4, 1, 0, 0].set(jnp.nan), "y": batches.data["y"]})
  absent = batches.replace(weight=batches.weight.at[4].set(0.0))
  params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  got = _rounds(_squares_cfl(), 2)(params, poisoned, jax.random.key(0))
  want = _rounds(_squares_cfl(), 2)(params, absent, jax.random.key(0))
  assert int(got.metrics["num_nonfinite"]) == 1
  assert int(got.cluster_of[4]) == 0  # it stays where it was
  np.testing.assert_array_equal(np.asarray(got.cluster_of), np.asarray(want.cluster_of))
  for a, b in zip(jax.tree.leaves(got.cluster_params), jax.tree.leaves(want.cluster_params)):
    assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_jit_and_reproducibility():
  _, _, _, _, batches = _two_group_inputs()
  algo = _squares_cfl()
  state = algo.init({"w": jnp.zeros(3), "b": jnp.zeros(())}, jax.random.key(0))
  step = jax.jit(algo.step)
  stepped = step(step(state, batches), batches)
  scanned = _rounds(algo, 2)({"w": jnp.zeros(3), "b": jnp.zeros(())}, batches, jax.random.key(0))
  again = step(step(state, batches), batches)
  for a, b, c in zip(jax.tree.leaves(stepped), jax.tree.leaves(scanned), jax.tree.leaves(again)):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      continue
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="eps_1"):
    fo.algorithms.clustered_fl(squares_loss, eps_1=0.0, eps_2=0.1, max_clusters=2, num_clients=4,
                               client_optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match="max_clusters"):
    fo.algorithms.clustered_fl(squares_loss, eps_1=0.1, eps_2=0.1, max_clusters=0, num_clients=4,
                               client_optimizer=optax.sgd(0.1))
