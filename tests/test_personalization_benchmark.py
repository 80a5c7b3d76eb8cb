"""The claim of benchmarks/personalization.py on a small label-sorted problem.

scikit-learn's digits split by label, exactly 2 digits per client
(`partition="labels"`; the "shards" split of the benchmark's MNIST would let
a shard straddle two digits here, since digits' classes are not multiples of
the shard size), multinomial logistic regression, full participation. When
every client sees only two digits, a personalized
model only has to tell its own digits apart, while one global model must
separate all ten: Ditto's personal models (Li et al., ICML 2021,
arXiv:2012.04221) beat the global FedAvg model by a wide margin on the
clients' own test examples. Both numbers come from `fo.train`'s evaluation
(Ditto through its `personalized_params=` hook) and are recomputed here with
float64 NumPy from the final models.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.algorithms.ditto import ditto
from fedjax_opt.algorithms.fedavg import fedavg

CLIENTS, ROUNDS, STEPS, BATCH, LR, LAM = 20, 20, 5, 10, 0.1, 0.1
MARGIN = 0.05  # observed over seeds 0, 1, 2: 0.071, 0.087, 0.079


def _dataset(seed: int):
  return fo.data.load("digits", partition="labels", classes_per_client=2, num_clients=CLIENTS, flatten=True,
                      seed=seed)


def _client_split(ds, k: int, split: str) -> tuple[np.ndarray, np.ndarray]:
  """Client k's examples of a split, float64 (the packed layout: train slots first, then test)."""
  if split == "train":
    start, count = 0, int(ds.train_count[k])
  else:
    start, count = int(ds.test_start[k]), int(ds.test_count[k])
  x = np.asarray(ds.examples["x"][k, start:start + count], np.float64)
  y = np.asarray(ds.examples["y"][k, start:start + count])
  return x.reshape(count, -1), y


def _numpy_accuracy(params, x: np.ndarray, y: np.ndarray) -> float:
  """Accuracy of w·x + b (flax Dense: kernel [d, K], bias [K]) in float64."""
  layer = params["linear"]
  logits = x @ np.asarray(layer["kernel"], np.float64) + np.asarray(layer["bias"], np.float64)
  return float(np.mean(np.argmax(logits, axis=1) == y))


def _train(algorithm, ds, model, **hooks):
  state = algorithm.init(model.init(jax.random.key(0)), jax.random.key(1))
  return fo.train(algorithm, state, ds, ROUNDS,
                  fo.Sampling(clients_per_round=CLIENTS, client_sampling="all", local_steps=STEPS, batch_size=BATCH),
                  evaluation=fo.Evaluation(every=ROUNDS, metric_fns={"accuracy": model.accuracy_fn}, **hooks),
                  progress=False)


def test_the_split_is_label_sorted():
  """Every client holds exactly two digits, in its train and its test examples together."""
  ds = _dataset(0)
  for k in range(CLIENTS):
    labels = np.concatenate([_client_split(ds, k, split)[1] for split in ("train", "test")])
    assert len(set(labels.tolist())) == 2


@pytest.mark.slow  # convergence runs of the benchmark's claim
@pytest.mark.parametrize("seed", [0, 1])
def test_ditto_beats_global_fedavg_by_a_clear_margin(seed):
  """Ditto's mean personalized test accuracy ≥ FedAvg's global test accuracy + 0.05, both checked in NumPy.

  Measured with these settings (20 rounds): personalized 0.970 / 0.983 / 0.972
  against global 0.898 / 0.896 / 0.893 for partition seeds 0 / 1 / 2. A global
  logistic regression still reaches about 0.90 here, so the margin is real but
  not large; 0.05 sits below every observed one.
  """
  ds = _dataset(seed)
  model = fo.models.logistic_regression(ds.examples["x"].shape[-1], ds.num_classes)
  global_algo = fedavg(model.loss_fn, client_optimizer=optax.sgd(LR))
  global_state, global_history = _train(global_algo, ds, model)
  personal_algo = ditto(model.loss_fn, LAM, LR, num_clients=CLIENTS, personal_steps=STEPS,
                        client_optimizer=optax.sgd(LR))
  personal_state, personal_history = _train(personal_algo, ds, model, personalized_params=fo.personalized_params)

  # FedAvg's global accuracy: example-weighted over all clients' test examples.
  tests = [_client_split(ds, k, "test") for k in range(CLIENTS)]
  pooled_x = np.concatenate([x for x, _ in tests])
  pooled_y = np.concatenate([y for _, y in tests])
  global_accuracy = _numpy_accuracy(global_state.params, pooled_x, pooled_y)
  np.testing.assert_allclose(global_history.last_eval["test_accuracy"], global_accuracy, atol=1e-6)

  # Ditto's personalized accuracy: client k's own v_k on its own test examples, mean over clients.
  per_client_accuracy = [
      _numpy_accuracy(jax.tree.map(lambda t, k=k: t[k], personal_state.local_params), x, y)
      for k, (x, y) in enumerate(tests)]
  personalized = float(np.mean(per_client_accuracy))
  np.testing.assert_allclose(personal_history.last_eval["personalized_test_accuracy"], personalized, atol=1e-6)
  np.testing.assert_allclose(personal_history.last_eval["personalized_test_accuracy_p10"],
                             np.percentile(per_client_accuracy, 10), atol=1e-6)

  assert personalized >= global_accuracy + MARGIN, (personalized, global_accuracy)
