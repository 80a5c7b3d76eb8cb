"""`fo.train` with a host-driven algorithm (FedMA): the same rounds as a hand loop, resume across grown widths."""

import jax
import numpy as np
import optax
import pytest

import fedjax_opt as fo


@pytest.fixture(scope="module")
def setup():
  dataset = fo.data.load("digits", num_clients=6, seed=0)
  model = fo.models.mlp_2nn(num_classes=10, hidden=8, input_dim=64)
  agnostic, layers = fo.algorithms.fedma_model(model)
  # σ small: client neurons rarely match, so the global layers grow over the rounds.
  algo = fo.algorithms.fedma(agnostic.loss_fn, layers=layers, client_optimizer=optax.sgd(0.1),
                             num_clients=dataset.num_clients, sigma=0.05, iterations=1)
  state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
  kwargs = dict(seed=5, progress=False)
  return dataset, agnostic, algo, state, kwargs


SAMPLING = fo.Sampling(clients_per_round=3, local_steps=2, batch_size=8)


def _evaluation(agnostic, every):
  """Accuracy every `every` rounds (no "loss" metric, so no extra evaluation of the initial model: each set of
  widths FedMA grows compiles its own evaluation program)."""
  return fo.Evaluation(every=every, metric_fns={"accuracy": agnostic.accuracy_fn})


@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_the_rounds_are_those_of_a_hand_loop_with_the_documented_keys(setup):
  dataset, agnostic, algo, state, kwargs = setup
  trained, history = fo.train(algo, state, dataset, 3, SAMPLING, evaluation=_evaluation(agnostic, 2), **kwargs)
  # The round's data drawn in one jitted program (eagerly, each op of the sampler compiles); algo.run then reuses
  # the client-training programs fo.train compiled for the same widths.
  sample = jax.jit(lambda r: fo.data.sample_round(jax.random.fold_in(jax.random.key(5), r), dataset,
                                                  clients_per_round=3, local_steps=2, batch_size=8))
  expected = state
  for r in range(3):
    expected = algo.run(expected, sample(r))
  jax.tree.map(np.testing.assert_array_equal, trained.params, expected.params)
  assert history.num_rounds == 3 and [e["round"] for e in history.evals] == [2, 3]
  np.testing.assert_array_equal(history.round_metrics["widths"][-1], expected.metrics["widths"])
  assert np.asarray(history.round_metrics["client_loss"]).shape == (3,)


def test_resume_restores_a_grown_model_and_finishes_bit_for_bit(setup, tmp_path):
  """3 rounds in one go == 2 rounds, stop, resume into the template's (narrower) widths, 1 more: the rounds of the
  first test, whose programs (one per set of widths) are reused."""
  dataset, agnostic, algo, state, kwargs = setup
  every2 = _evaluation(agnostic, 2)
  whole, whole_history = fo.train(algo, state, dataset, 3, SAMPLING, evaluation=every2, **kwargs)
  half, _ = fo.train(algo, state, dataset, 2, SAMPLING, evaluation=every2,
                     checkpointing=fo.Checkpointing(str(tmp_path)), **kwargs)
  grown = [int(np.shape(half.params[name]["bias"])[0]) for name in ("hidden_0", "hidden_1")]
  assert max(grown) > 8  # the checkpoint holds wider layers than the template `state`
  resumed, history = fo.train(algo, state, dataset, 3, SAMPLING, evaluation=every2,
                              checkpointing=fo.Checkpointing(str(tmp_path), resume=True), **kwargs)
  jax.tree.map(np.testing.assert_array_equal, resumed.params, whole.params)
  # The clients' last assignments travel with the checkpoint: round 3 restarts clients of round 2 from them.
  jax.tree.map(np.testing.assert_array_equal, (resumed.assignments, resumed.assigned_round),
               (whole.assignments, whole.assigned_round))
  assert history.round_metrics["num_restarted"][-1] > 0
  assert history.evals[-1]["test_accuracy"] == whole_history.evals[-1]["test_accuracy"]


def test_bits_count_each_layer_once_per_client_and_the_new_model_once(setup):
  dataset, agnostic, algo, state, kwargs = setup
  # No metric_fns: the round metrics are what is checked (an evaluation would compile for this round's widths).
  trained, history = fo.train(algo, state, dataset, 1, SAMPLING, evaluation=fo.Evaluation(every=1), **kwargs)
  metrics = history.round_metrics
  clients = float(metrics["num_clients"][0])
  assert float(metrics["bits_up"][0]) * clients == pytest.approx(32 * float(metrics["uploaded_floats"][0]))
  # Every client uploads every layer once, in the widths the layers below were matched to (input rows moved).
  assert float(metrics["bits_down"][0]) == 32 * sum(np.size(x) for x in jax.tree.leaves(trained.params))


def test_what_is_not_an_algorithm_is_refused(setup):
  dataset, _, _, state, kwargs = setup
  with pytest.raises(TypeError, match="host-driven algorithm with init and run"):
    fo.train(object(), state, dataset, 1, SAMPLING, **kwargs)


def test_fedma_model_refuses_a_model_without_hidden_units():
  with pytest.raises(ValueError, match="FedMA matches the hidden units"):
    fo.algorithms.fedma_model(fo.models.logistic_regression(64, 10))
  cnn = fo.models.emnist_cnn(num_classes=10, image_shape=(8, 8))
  agnostic, layers = fo.algorithms.fedma_model(cnn)
  assert layers == ("conv_0", "conv_1", "dense", "output")
  params = cnn.init(jax.random.key(0))
  x = np.random.default_rng(1).normal(size=(4, 8, 8, 1)).astype(np.float32)
  ours, theirs = jax.jit(lambda p, x: (agnostic.apply(p, x), cnn.apply(p, x)))(params, x)  # one program, not eager ops
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
