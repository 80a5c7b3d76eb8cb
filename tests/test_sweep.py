"""Vectorised sweeps: K runs vmapped into one program equal K separate runs; the driver and CLI accept them."""

import functools
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt import sweep
from fedjax_opt.train import Evaluation, Sampling, train

KW = dict(clients_per_round=5, local_steps=3, batch_size=10)
SAMPLING = Sampling(**KW)
SEEDS = list(range(8))


@pytest.fixture(scope="module")
def setup():
  dataset = fo.data.load("synthetic_1_1", seed=0)
  model = fo.models.logistic_regression(60, 10)
  algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05),
                              server_optimizer=fo.server_optimizers.fedadam(0.01))
  return dataset, model, algo


@functools.cache
def _initial_model_fn(model):
  """`_initial_model` for one model as one jitted function of the seed (eagerly, each leaf's draw compiles)."""

  @jax.jit
  def fn(seed):
    params = model.init(jax.random.key(seed))
    noise = jax.random.split(jax.random.key(100 + seed), len(jax.tree.leaves(params)))
    leaves = [p + 0.01 * jax.random.normal(k, p.shape) for p, k in zip(jax.tree.leaves(params), noise)]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)

  return fn


def _initial_model(model, seed):
  """A different starting point per seed (logistic regression starts at zero)."""
  return _initial_model_fn(model)(seed)


def _separate_run(algo, dataset, rounds):
  """One run as `fo.train` makes it (round r's data from fold_in(key(seed), r)), compiled once for every seed."""

  @jax.jit
  def run(params, key, seed):
    def body(state, _):
      batches = fo.data.sample_round(jax.random.fold_in(jax.random.key(seed), state.round), dataset, **KW)
      state = algo.step(state, batches)
      return state, state.metrics["client_loss"]

    return jax.lax.scan(body, algo.init(params, key), None, length=rounds)

  return run


@pytest.fixture(scope="module")
def seed_sweep(setup):
  """fo.train on a sweep of the setup algorithm over seeds 0..7 (initial model, algorithm key, data stream), 6 rounds
  evaluated every 3: (state, history), run once for the tests that check it."""
  dataset, model, algo = setup
  swept = sweep.seeds(algo, len(SEEDS))
  params = sweep.stack([_initial_model(model, s) for s in SEEDS])
  keys = jnp.stack([jax.random.key(1000 + s) for s in SEEDS])
  return train(swept, swept.init(params, keys, params_axis=0), dataset, 6, SAMPLING,
               evaluation=Evaluation(every=3, metric_fns={"accuracy": model.accuracy_fn}), seed=SEEDS, progress=False)


def test_sweep_over_8_seeds_equals_8_separate_runs(setup, seed_sweep):
  """fo.train on a sweep with seeds 0..7 (initial model, algorithm key, data stream) == 8 separate runs."""
  dataset, model, algo = setup
  fns = {"accuracy": model.accuracy_fn}
  state, history = seed_sweep
  assert history.sweep_size == 8 and history.num_rounds == 6
  assert history.round_metrics["client_loss"].shape == (8, 6)
  rounds, accuracy = history.eval_series("test_accuracy")
  assert list(rounds) == [3, 6] and accuracy.shape == (8, 2)
  run = _separate_run(algo, dataset, 6)
  for s in SEEDS:
    ref, losses = run(_initial_model(model, s), jax.random.key(1000 + s), s)
    chex.assert_trees_all_close(sweep.member(state.params, s), ref.params, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(history.round_metrics["client_loss"][s], losses, rtol=2e-5)
  # One member through the driver on its own, evaluation included.
  ref, ref_history = train(algo, algo.init(_initial_model(model, 5), jax.random.key(1005)), dataset, 6, SAMPLING,
                           evaluation=Evaluation(every=3, metric_fns=fns), seed=5, progress=False)
  np.testing.assert_allclose(accuracy[5], ref_history.eval_series("test_accuracy")[1], atol=1e-6)
  # Members really differ: different seeds, different runs.
  assert np.ptp(history.round_metrics["client_loss"][:, -1]) > 0


def test_hyper_parameter_grid_equals_separate_factories(setup):
  """A client-lr × server-lr grid, one shared batch stream: member k == the factory called with member k's values."""
  dataset, model, _ = setup

  def make(client_lr, server_lr):
    return fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(client_lr),
                                server_optimizer=fo.server_optimizers.fedadam(server_lr))

  hp = sweep.grid(client_lr=[0.01, 0.1], server_lr=[0.003, 0.03])
  np.testing.assert_allclose(hp["client_lr"], [0.01, 0.01, 0.1, 0.1])
  np.testing.assert_allclose(hp["server_lr"], [0.003, 0.03, 0.003, 0.03])
  swept = sweep.vmap_algorithm(make, hp)
  assert swept.size == 4
  params = _initial_model(model, 0)
  # The shared stream: 3 rounds drawn with keys 0, 1, 2, stacked on a leading round axis.
  batches = jax.jit(jax.vmap(lambda r: fo.data.sample_round(jax.random.key(r), dataset, **KW)))(jnp.arange(3))

  def rounds(algo, state):
    """`algo.step` over the 3 rounds (a scan: one round compiled, not three)."""
    return jax.lax.scan(lambda s, b: (algo.step(s, b), None), state, batches)[0]

  state = jax.jit(lambda key: rounds(swept, swept.init(params, key)))(jax.random.key(3))
  member_keys = jax.random.split(jax.random.key(3), 4)

  @jax.jit
  def separate(client_lr, server_lr, key):  # one member's run on its own, not vmapped
    algo = make(client_lr, server_lr)
    return rounds(algo, algo.init(params, key)).params

  for k in range(4):
    ref = separate(hp["client_lr"][k], hp["server_lr"][k], member_keys[k])
    chex.assert_trees_all_close(sweep.member(state.params, k), ref, rtol=2e-5, atol=1e-6)


def test_history_of_a_sweep_round_trips_json(seed_sweep, tmp_path):
  _, history = seed_sweep
  path = tmp_path / "h.json"
  history.save_json(str(path))
  again = fo.History.from_dict(json.loads(path.read_text()))
  assert again.sweep_size == 8 and again.num_rounds == 6
  np.testing.assert_array_equal(again.round_metrics["client_loss"], history.round_metrics["client_loss"])
  assert again.eval_series("test_accuracy")[1].shape == (8, 2)


def test_bad_sweeps_are_rejected(setup):
  dataset, model, algo = setup
  with pytest.raises(ValueError, match="same leading sweep size"):
    sweep.vmap_algorithm(lambda a, b: algo, {"a": [1.0, 2.0], "b": [1.0, 2.0, 3.0]})
  with pytest.raises(ValueError, match="size=K"):
    sweep.vmap_algorithm(lambda: algo)
  with pytest.raises(ValueError, match="leading sweep axis"):
    sweep.vmap_algorithm(lambda lr: algo, {"lr": 0.1})
  with pytest.raises(TypeError, match="must return a fedjax_opt.FederatedAlgorithm"):
    sweep.vmap_algorithm(lambda: "nope", size=2).init(model.init(jax.random.key(0)), jax.random.key(0))
  swept = sweep.seeds(algo, 2)
  state = swept.init(model.init(jax.random.key(0)), jax.random.key(0))
  with pytest.raises(ValueError, match="one seed per sweep member: K=2; got 3"):
    train(swept, state, dataset, 1, SAMPLING, seed=[0, 1, 2], progress=False)
  with pytest.raises(ValueError, match="needs a sweep"):
    train(algo, algo.init(model.init(jax.random.key(0)), jax.random.key(0)), dataset, 1, SAMPLING, seed=[0, 1],
          progress=False)
  with pytest.raises(ValueError, match="K=2 keys"):
    swept.init(model.init(jax.random.key(0)), jax.random.split(jax.random.key(0), 3))


def test_cli_seeds_zero_is_one_line(cli):
  bad = cli("run", "--seeds", "0")
  assert bad.returncode == 2 and "--seeds must be a positive integer" in bad.stderr


@pytest.mark.slow  # a subprocess run
def test_cli_seeds_reports_mean_and_std(tmp_path):
  """`fedjax-opt run --seeds 3`: one vmapped run per algorithm, results with std, history with a sweep axis."""
  out = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, "-m", "fedjax_opt.cli", "run", "--dataset", "digits", "--num-clients", "20", "--rounds", "6",
       "--eval-every", "3", "--clients-per-round", "4", "--local-steps", "3", "--batch-size", "16", "--seeds", "3",
       "--algorithms", "fedavg", "--out", str(out), "--quiet"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
  assert result.returncode == 0, result.stderr
  assert "±" in result.stdout
  row = json.loads((out / "results.json").read_text())[0]
  assert len(row["test_accuracy_per_seed"]) == 3 and row["test_accuracy_std"] >= 0
  np.testing.assert_allclose(row["test_accuracy"], np.mean(row["test_accuracy_per_seed"]))
  history = json.loads((out / "history.json").read_text())["fedavg"]
  assert history["sweep_size"] == 3 and np.shape(history["round_metrics"]["client_loss"]) == (3, 6)
  assert (out / "accuracy.png").stat().st_size > 0
