"""Personalized evaluation (`evaluate.personalized`, `evaluate.adapted`) against a float64 NumPy loop over clients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt import evaluate
from fedjax_opt.algorithms.per_fedavg import per_fedavg
from fedjax_opt.data.dataset import pack

D, K = 4, 3
# Test-set sizes coprime with 10, so no accuracy k/n falls on an inner edge of the 10 bins; client 3 has none.
TRAIN = [9, 5, 12, 7, 6, 8]
TEST = [7, 13, 3, 0, 11, 9]


def softmax_loss(params, batch):
  logits = batch["x"] @ params["w"] + params["b"]
  return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]


def accuracy(params, batch):
  logits = batch["x"] @ params["w"] + params["b"]
  return (jnp.argmax(logits, -1) == batch["y"]).astype(logits.dtype)


FNS = {"loss": softmax_loss, "accuracy": accuracy}


def _clients(rng, sizes):
  out = []
  for n in sizes:
    x = rng.normal(size=(n, D))
    out.append({"x": x, "y": rng.integers(0, K, size=n).astype(np.int32)})
  return out


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  train, test = _clients(rng, TRAIN), _clients(rng, TEST)
  dataset = pack(train, test_clients=test, num_classes=K)
  n = len(TRAIN)
  table = {"w": rng.normal(size=(n, D, K)).astype(np.float32), "b": rng.normal(size=(n, K)).astype(np.float32)}
  return dataset, train, test, table


@functools.cache
def _jit_personalized(client_map="vmap", **kwargs):
  """`evaluate.personalized(table, dataset, FNS, client_map=..., **kwargs)` as one jitted program (`client_ids`
  traced), built once per static choice: tests that evaluate the same shapes share its compilation, where an
  eager call compiles each of its dozens of small ops."""
  return jax.jit(lambda table, dataset, client_ids=None: evaluate.personalized(
      table, dataset, FNS, client_ids=client_ids, client_map=client_map, **kwargs))


def _np_metrics(w, b, x, y):
  """float64 per-example loss and accuracy of one client."""
  logits = x.astype(np.float32).astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)
  top = logits.max(1, keepdims=True)
  logz = np.log(np.exp(logits - top).sum(1)) + top[:, 0]
  return logz - logits[np.arange(len(y)), y], (logits.argmax(1) == y).astype(np.float64)


def _np_reference(tables, test, ids):
  """Per-client means, then mean / weighted mean / 10th percentile (np 'linear') / histogram over clients with data."""
  per = {"loss": [], "accuracy": []}
  sums = {"loss": 0.0, "accuracy": 0.0}
  counts = []
  for i in ids:
    x, y = test[i]["x"], test[i]["y"]
    counts.append(len(y))
    if not len(y):
      continue
    loss, acc = _np_metrics(tables["w"][i], tables["b"][i], x, y)
    for name, v in (("loss", loss), ("accuracy", acc)):
      per[name].append(v.mean())
      sums[name] += v.sum()
  out = {}
  for name, values in per.items():
    values = np.asarray(values)
    out[name] = values
    out[name + "_mean"] = values.mean()
    out[name + "_weighted"] = sums[name] / sum(counts)
    out[name + "_p10"] = np.percentile(values, 10, method="linear")
  out["histogram"] = np.histogram(per["accuracy"], bins=10, range=(0.0, 1.0))[0]
  return out, np.asarray(counts)


def test_each_client_is_evaluated_with_its_own_model(data):
  """Per-client loss/accuracy, their mean, weighted mean, 10th percentile and histogram equal a NumPy loop."""
  dataset, _, test, table = data
  result = _jit_personalized("vmap", batch_size=4)(table, dataset)
  ref, counts = _np_reference(table, test, range(len(TEST)))
  has = counts > 0
  np.testing.assert_array_equal(np.asarray(result.evaluated), has)
  np.testing.assert_array_equal(np.asarray(result.count), counts)
  assert np.isnan(np.asarray(result.per_client["accuracy"])[3])
  s = result.summary
  assert int(s["num_evaluated"]) == 5 and int(s["num_excluded"]) == 1
  for name in ("loss", "accuracy"):
    np.testing.assert_allclose(np.asarray(result.per_client[name])[has], ref[name], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(s[name]), ref[name + "_mean"], rtol=2e-5)
    np.testing.assert_allclose(float(s[name + "_weighted"]), ref[name + "_weighted"], rtol=2e-5)
    np.testing.assert_allclose(float(s[name + "_p10"]), ref[name + "_p10"], rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(s["accuracy_histogram"]), ref["histogram"])
  assert int(np.sum(np.asarray(s["accuracy_histogram"]))) == 5
  np.testing.assert_allclose(np.asarray(result.histogram_edges), np.linspace(0, 1, 11), atol=1e-7)


def test_the_same_model_in_every_row_equals_the_global_evaluation(data):
  """With every row equal to one model the personalized weighted mean is `global_model`'s test metric."""
  dataset, _, test, table = data
  one = jax.tree.map(lambda t: t[2], table)
  tiled = jax.tree.map(lambda t: np.broadcast_to(t, (len(TEST),) + t.shape), one)
  result = _jit_personalized("sequential")(tiled, dataset)
  glob = jax.jit(lambda p, d: evaluate.global_model(p, d, FNS))(one, dataset)
  np.testing.assert_allclose(float(result.summary["accuracy_weighted"]), float(glob["accuracy"]), rtol=1e-6)
  np.testing.assert_allclose(float(result.summary["loss"]), float(glob["loss_client_mean"]), rtol=1e-5)


def test_client_subset_and_client_maps_agree(data):
  """client_ids picks rows of the table; vmap, sequential and chunked:2 give the same numbers."""
  dataset, _, test, table = data
  ids = np.array([4, 0, 3, 2], np.int32)
  ref, _ = _np_reference(table, test, ids)
  modes = ("vmap", "sequential", "chunked:2")
  # One program evaluates the three maps (three eager evaluations compile each of their ops).
  results = jax.jit(lambda t, d, i: [evaluate.personalized(t, d, FNS, client_ids=i, client_map=mode, percentile=25.0)
                                     for mode in modes])(table, dataset, ids)
  for r in results:
    np.testing.assert_array_equal(np.asarray(r.client_id), ids)
    np.testing.assert_allclose(float(r.summary["accuracy_weighted"]), ref["accuracy_weighted"], rtol=1e-6)
    np.testing.assert_allclose(float(r.summary["loss_p25"]), np.percentile(ref["loss"], 25), rtol=2e-5)
    for name in FNS:
      np.testing.assert_allclose(r.per_client[name], results[0].per_client[name], rtol=1e-6)


def test_float64_models_are_evaluated_in_float64(data):
  dataset, _, test, table = data
  with jax.enable_x64(True):
    t64 = jax.tree.map(lambda t: jnp.asarray(t, jnp.float64), table)
    result = jax.jit(lambda t, d: evaluate.personalized(t, d, FNS, client_map="vmap"))(t64, dataset)
    ref, _ = _np_reference(table, test, range(len(TEST)))
    assert result.per_client["loss"].dtype == jnp.float64
    np.testing.assert_allclose(float(result.summary["loss_weighted"]), ref["loss_weighted"], rtol=1e-6)


def test_adapted_models_equal_a_numpy_gradient_step(data):
  """Per-FedAvg's θ_i = w − α∇f_i(w) on client i's train split, then its test metrics (NumPy float64 loop)."""
  dataset, train, test, table = data
  alpha = 0.5
  w = jax.tree.map(lambda t: t[0], table)
  adapt = per_fedavg(softmax_loss, alpha, 0.1, local_steps=1).personalize
  result = jax.jit(lambda p, d: evaluate.adapted(p, adapt, d, FNS, batch_size=4, client_map="vmap"))(w, dataset)
  rows = {"w": [], "b": []}
  for client in train:
    x, y = client["x"].astype(np.float32).astype(np.float64), client["y"]
    logits = x @ np.asarray(w["w"], np.float64) + np.asarray(w["b"], np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    rows["w"].append(np.asarray(w["w"], np.float64) - alpha * x.T @ p / len(y))
    rows["b"].append(np.asarray(w["b"], np.float64) - alpha * p.mean(0))
  ref, _ = _np_reference({k: np.stack(v) for k, v in rows.items()}, test, range(len(TEST)))
  has = np.asarray(TEST) > 0
  np.testing.assert_allclose(np.asarray(result.per_client["loss"])[has], ref["loss"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(result.summary["accuracy_weighted"]), ref["accuracy_weighted"], rtol=1e-6)


def test_no_client_with_data_gives_nan_statistics():
  rng = np.random.default_rng(1)
  dataset = pack(_clients(rng, [3, 4]), test_clients=_clients(rng, [1, 0]), num_classes=K)
  table = {"w": np.zeros((2, D, K), np.float32), "b": np.zeros((2, K), np.float32)}
  result = _jit_personalized("vmap")(table, dataset, np.array([1], np.int32))
  assert int(result.summary["num_evaluated"]) == 0 and int(result.summary["num_excluded"]) == 1
  for key in ("accuracy", "accuracy_weighted", "accuracy_p10"):
    assert np.isnan(float(result.summary[key])), key
  assert int(np.sum(np.asarray(result.summary["accuracy_histogram"]))) == 0


def test_bad_input(data):
  dataset, _, _, table = data
  short = jax.tree.map(lambda t: t[:3], table)
  with pytest.raises(ValueError, match=r"leading axis \[N\] = 6; got 3"):
    evaluate.personalized(short, dataset, FNS)
  with pytest.raises(ValueError, match=r"client_ids must lie in \[0, 6\)"):
    evaluate.personalized(table, dataset, FNS, client_ids=jnp.array([0, 6]))
  with pytest.raises(ValueError, match=r"percentile must be a Python number in \[0, 100\]"):
    evaluate.personalized(table, dataset, FNS, percentile=120)
  with pytest.raises(ValueError, match=r"histogram_range must be finite with low < high"):
    evaluate.personalized(table, dataset, FNS, histogram_range=(1.0, 0.0))
  with pytest.raises(ValueError, match=r"split must be one of \('train', 'test'\)"):
    evaluate.personalized(table, dataset, FNS, split="val")
  with pytest.raises(TypeError, match=r"metric_fns must be a non-empty dict"):
    evaluate.personalized(table, dataset, {})
  with pytest.raises(TypeError, match=r"adapt_fn must be callable"):
    evaluate.adapted(jax.tree.map(lambda t: t[0], table), None, dataset, FNS)


def _params0():
  return {"w": np.zeros((D, K), np.float32), "b": np.zeros((K,), np.float32)}


def test_train_reports_the_personalized_metrics_of_the_final_state(data):
  """Ditto through `train`: the last personalized_test_* equal `evaluate.personalized` on the final v_i table."""
  import optax

  from fedjax_opt.algorithms.ditto import ditto
  from fedjax_opt.train import Evaluation, Sampling, train

  dataset = data[0]
  algo = ditto(softmax_loss, 0.5, 0.1, num_clients=len(TRAIN), personal_steps=2, client_optimizer=optax.sgd(0.1),
               client_map="vmap")
  state, history = train(algo, algo.init(_params0(), jax.random.key(0)), dataset, 4,
                         Sampling(clients_per_round=3, batch_size=3, local_steps=2), progress=False,
                         evaluation=Evaluation(every=2, metric_fns=FNS, personalized_params=fo.personalized_params,
                                               personalized_client_map="vmap"))
  assert [e["round"] for e in history.evals] == [2, 4]
  ref = _jit_personalized("vmap")(fo.personalized_params(state), dataset).summary
  last = history.last_eval
  for name in FNS:
    for suffix in ("", "_weighted", "_p10"):
      np.testing.assert_allclose(last[f"personalized_test_{name}{suffix}"], float(ref[name + suffix]), rtol=1e-6)
  assert last["personalized_num_excluded"] == 1
  # The personal models moved away from the global model, so the two evaluations differ.
  assert last["personalized_test_loss_weighted"] != pytest.approx(last["test_loss"], rel=1e-3)


def test_train_reports_adapted_metrics_for_per_fedavg(data):
  """Per-FedAvg through `train` with `personalize`: equal to `evaluate.adapted` on the final meta-model."""
  from fedjax_opt.train import Evaluation, Sampling, train

  dataset = data[0]
  algo = per_fedavg(softmax_loss, 0.3, 0.1, local_steps=1, client_map="vmap")
  adapt = algo.personalize
  state, history = train(algo, algo.init(_params0(), jax.random.key(0)), dataset, 3,
                         Sampling(clients_per_round=3, batch_size=3, local_steps=2), progress=False,
                         evaluation=Evaluation(every=3, metric_fns=FNS, personalize=adapt,
                                               personalized_client_map="vmap"))
  ref = jax.jit(lambda p, d: evaluate.adapted(p, adapt, d, FNS, client_map="vmap"))(state.params, dataset).summary
  np.testing.assert_allclose(history.last_eval["personalized_test_accuracy"], float(ref["accuracy"]), rtol=1e-6)
  np.testing.assert_allclose(history.last_eval["personalized_test_loss_p10"], float(ref["loss_p10"]), rtol=1e-6)
  with pytest.raises(ValueError, match=r"not both"):
    Evaluation(metric_fns=FNS, personalize=adapt, personalized_params=lambda s: s.params)
  with pytest.raises(ValueError, match=r"personalized metrics need metric_fns"):
    Evaluation(personalize=adapt)


def test_l2sgd_plus_runs_through_train_with_fixed_example_slots(data):
  """L2SGD+ keeps a gradient per example slot, so the driver must give every client its whole train split in the
  same slots every round (`client_sampling="all"`, `local_epochs=1`, `example_order="fixed"`): then `train` equals
  a scan of `step` over `fo.data.client_batches` of the train split, and reports `evaluate.personalized`."""
  from fedjax_opt import data as data_lib
  from fedjax_opt.algorithms.mixture import l2sgd_plus
  from fedjax_opt.train import Evaluation, Sampling, train

  dataset = data[0]
  n, batch_size = len(TRAIN), 4
  steps = -(-max(TRAIN) // batch_size)
  algo = l2sgd_plus(softmax_loss, 0.5, 0.05, 0.3, num_clients=n, num_examples=steps * batch_size, client_map="vmap")
  init = algo.init(_params0(), jax.random.key(1))
  sampling = Sampling(clients_per_round=n, batch_size=batch_size, local_epochs=1, client_sampling="all",
                      example_order="fixed")
  state, history = train(algo, init, dataset, 12, sampling, progress=False,
                         evaluation=Evaluation(every=6, metric_fns=FNS, personalized_params=fo.personalized_params,
                                               personalized_client_map="vmap"))
  def reference_run(s, dataset):
    fixed = data_lib.client_batches(dataset, batch_size, split="train")
    return jax.lax.scan(lambda s, _: (algo.step(s, fixed), None), s, None, length=12)[0]

  reference = jax.jit(reference_run)(init, dataset)
  chex.assert_trees_all_close(state.local_params, reference.local_params, rtol=1e-6, atol=1e-7)
  assert int(state.metrics["num_communications"]) == int(reference.metrics["num_communications"]) > 0
  ref = _jit_personalized("vmap")(fo.personalized_params(state), dataset).summary
  np.testing.assert_allclose(history.last_eval["personalized_test_accuracy"], float(ref["accuracy"]), rtol=1e-6)


def test_a_split_without_examples_evaluates_to_nan_not_zero():
  ds = fo.data.pack([{"x": np.ones((3, 2), np.float32), "y": np.zeros(3, np.int32)}] * 2, test_fraction=0.0)
  params = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}
  accuracy = lambda p, b: (jnp.argmax(b["x"] @ p["w"] + p["b"], -1) == b["y"]).astype(jnp.float32)
  out, train = jax.jit(lambda p, d: [evaluate.global_model(p, d, {"accuracy": accuracy}, split=split)
                                     for split in ("test", "train")])(params, ds)
  assert np.isnan(out["accuracy"]) and np.isnan(out["accuracy_client_mean"])
  assert float(train["accuracy"]) == 1.0  # argmax of equal logits is class 0, every label is 0
