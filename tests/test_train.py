"""The driver: chunked scans equal round-by-round steps, bit-for-bit resume, evaluation against NumPy."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.train import Checkpointer, Checkpointing, Evaluation, History, Sampling, train
from fedjax_opt.train.checkpoint import to_raw


@pytest.fixture(scope="module")
def setup():
  dataset = fo.data.load("synthetic_1_1", seed=0)
  model = fo.models.logistic_regression(60, 10)
  algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05),
                              server_optimizer=fo.server_optimizers.fedadam(0.01))
  params = jax.tree.map(lambda p: p + 0.01, model.init(jax.random.key(0)))
  return dataset, model, algo, params


KW = dict(clients_per_round=5, local_steps=4, batch_size=10)
SAMPLING = Sampling(**KW)
# The setup algorithm's round programs are compiled once per (sampling, seed, chunk length): the tests that train it
# share one seed (not the default, so the first test also checks that `seed` picks the data) and chunks of 3 rounds
# (the last chunk 1 or 2), so they reuse three programs.
SEED = 3


def _fns(model):
  """The metrics every evaluation of the setup model reports (one evaluation program for all the tests)."""
  return {"loss": model.loss_fn, "accuracy": model.accuracy_fn}


def _assert_same_state(a, b):
  chex.assert_trees_all_equal(to_raw(a), to_raw(b))


def test_chunked_scan_equals_round_by_round_steps(setup):
  dataset, _, algo, params = setup
  state, history = train(algo, algo.init(params, jax.random.key(1)), dataset, 14, SAMPLING,
                         evaluation=Evaluation(every=3), progress=False, seed=SEED)
  # One round: the data drawn with fold_in(key(seed), r), then one step (one program for all the rounds).
  one_round = jax.jit(lambda s, r: algo.step(s, fo.data.sample_round(jax.random.fold_in(jax.random.key(SEED), r),
                                                                     dataset, **KW)))
  ref = algo.init(params, jax.random.key(1))
  losses = []
  for r in range(14):
    ref = one_round(ref, r)
    losses.append(float(ref.metrics["client_loss"]))
  chex.assert_trees_all_close(state.params, ref.params, rtol=1e-6, atol=1e-7)
  assert int(state.round) == 14
  np.testing.assert_allclose(history.round_metrics["client_loss"], losses, rtol=1e-5)
  assert [e["round"] for e in history.evals] == [3, 6, 9, 12, 14]


def test_resume_is_bit_for_bit(setup, tmp_path):
  """2k rounds in one go == k rounds, stop, resume from the checkpoint, k more."""
  dataset, model, algo, params = setup
  init = algo.init(params, jax.random.key(1))
  evaluation = Evaluation(every=3, metric_fns=_fns(model))
  full, full_history = train(algo, init, dataset, 14, SAMPLING, evaluation=evaluation, progress=False, seed=SEED)
  train(algo, init, dataset, 7, SAMPLING, evaluation=evaluation, progress=False, seed=SEED,
        checkpointing=Checkpointing(str(tmp_path)))
  assert Checkpointer(str(tmp_path)).latest_round() == 7
  resumed, history = train(algo, algo.init(params, jax.random.key(99)), dataset, 14, SAMPLING,
                           evaluation=evaluation, progress=False, seed=SEED,
                           checkpointing=Checkpointing(str(tmp_path), resume=True))
  _assert_same_state(full, resumed)
  np.testing.assert_array_equal(history.round_metrics["client_loss"], full_history.round_metrics["client_loss"])
  # The resumed history also holds the evaluation made where the first run stopped (round 7).
  assert [e["round"] for e in history.evals] == [3, 6, 7, 9, 12, 14]
  by_round = {e["round"]: e for e in history.evals}
  for e in full_history.evals:
    assert by_round[e["round"]]["test_accuracy"] == e["test_accuracy"]


def test_resume_without_checkpoint_starts_fresh(setup, tmp_path):
  dataset, _, algo, params = setup
  state, history = train(algo, algo.init(params, jax.random.key(1)), dataset, 3, SAMPLING, progress=False, seed=SEED,
                         checkpointing=Checkpointing(str(tmp_path), resume=True))
  assert int(state.round) == 3 and history.num_rounds == 3


def test_evaluation_matches_numpy(setup):
  """test_accuracy / test_loss equal a NumPy evaluation of the final model on every client's test examples."""
  dataset, model, algo, params = setup
  state, history = train(algo, algo.init(params, jax.random.key(1)), dataset, 10, SAMPLING, progress=False,
                         seed=SEED, evaluation=Evaluation(every=3, metric_fns=_fns(model)))
  leaves = jax.tree.leaves(state.params)
  kernel = np.asarray([l for l in leaves if l.ndim == 2][0], np.float64)
  bias = np.asarray([l for l in leaves if l.ndim == 1][0], np.float64)
  per_client = fo.data.unpack(dataset, "test")
  accs, losses, client_accs = [], [], []
  for c in per_client:
    if len(c["y"]) == 0:
      continue
    logits = c["x"].reshape(len(c["y"]), -1) @ kernel + bias
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    loss = logz - logits[np.arange(len(c["y"])), c["y"]]
    acc = (logits.argmax(1) == c["y"]).astype(float)
    accs.append(acc)
    losses.append(loss)
    client_accs.append(acc.mean())
  last = history.last_eval
  np.testing.assert_allclose(last["test_accuracy"], np.concatenate(accs).mean(), rtol=1e-6)
  np.testing.assert_allclose(last["test_loss"], np.concatenate(losses).mean(), rtol=1e-4)
  np.testing.assert_allclose(last["test_accuracy_client_mean"], np.mean(client_accs), rtol=1e-5)


def test_history_round_trips_json(setup, tmp_path):
  dataset, model, algo, params = setup
  _, history = train(algo, algo.init(params, jax.random.key(1)), dataset, 4, SAMPLING, progress=False, seed=SEED,
                     evaluation=Evaluation(every=2, metric_fns=_fns(model)))
  path = tmp_path / "h.json"
  history.save_json(str(path))
  import json
  again = History.from_dict(json.loads(path.read_text()))
  np.testing.assert_array_equal(again.round_metrics["client_loss"], history.round_metrics["client_loss"])
  assert again.evals == history.evals
  rounds, values = again.eval_series("test_accuracy")
  assert list(rounds) == [2, 4] and values.shape == (2,)


def test_bad_arguments(setup):
  dataset, _, algo, params = setup
  state = algo.init(params, jax.random.key(1))
  with pytest.raises(ValueError, match="clients_per_round=31 exceeds the dataset's 30 clients"):
    train(algo, state, dataset, 3, Sampling(clients_per_round=31, local_steps=2, batch_size=5), progress=False)
  with pytest.raises(ValueError, match="rounds must be a Python int >= 1"):
    train(algo, state, dataset, 0, SAMPLING, progress=False)
  with pytest.raises(TypeError, match="algorithm must be a fedjax_opt.FederatedAlgorithm"):
    train(algo.step, state, dataset, 3, SAMPLING, progress=False)
  with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
    train(algo, state, dataset, 3, SAMPLING, progress=False, checkpointing=Checkpointing(resume=True))


def _numpy_accuracy(params, x, y):
  leaves = jax.tree.leaves(params)
  kernel = np.asarray([l for l in leaves if l.ndim == 2][0], np.float64)
  bias = np.asarray([l for l in leaves if l.ndim == 1][0], np.float64)
  return float(np.mean((x.reshape(len(y), -1) @ kernel + bias).argmax(1) == y))


def test_central_test_set_and_holdout_clients_are_evaluated(tmp_path):
  """central_<m> covers the dataset's centralized test set; holdout_<m> every example of the held-out clients."""
  rng = np.random.default_rng(0)
  make = lambda n: {"x": rng.normal(size=(n, 6)).astype(np.float32), "y": rng.integers(0, 3, n).astype(np.int32)}
  clients = [make(n) for n in (12, 7, 20, 9)]
  central = make(50)
  held_out = [make(n) for n in (5, 11)]
  dataset = fo.data.pack(clients, test_fraction=0.25, central_test=central, num_classes=3)
  holdout = fo.data.pack(held_out, num_classes=3)
  model = fo.models.logistic_regression(6, 3)
  algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.1))
  state, history = train(algo, algo.init(model.init(jax.random.key(0)), jax.random.key(1)), dataset, 6,
                         Sampling(clients_per_round=2, local_steps=2, batch_size=4), progress=False,
                         evaluation=Evaluation(every=3, metric_fns={"accuracy": model.accuracy_fn}, holdout=holdout))
  last = history.last_eval
  np.testing.assert_allclose(last["central_accuracy"], _numpy_accuracy(state.params, central["x"], central["y"]),
                             rtol=1e-6)
  hx = np.concatenate([c["x"] for c in held_out])
  hy = np.concatenate([c["y"] for c in held_out])
  np.testing.assert_allclose(last["holdout_accuracy"], _numpy_accuracy(state.params, hx, hy), rtol=1e-6)
  assert "test_accuracy" in last and "test_accuracy_client_mean" in last


@pytest.mark.parametrize("storage_dtype", [None, jnp.bfloat16])
def test_stateful_algorithm_trains_and_resumes_bit_for_bit(setup, tmp_path, storage_dtype):
  """SCAFFOLD's state (server and per-client control variates, float32 or bfloat16, which the chunks carry as
  bits) goes through chunks and checkpoints intact."""
  dataset, model, _, params = setup
  algo = fo.algorithms.scaffold(model.loss_fn, 0.05, 1.0, num_clients=dataset.num_clients,
                                storage_dtype=storage_dtype)
  init = algo.init(params, jax.random.key(1))
  every4 = Evaluation(every=4)
  full, _ = train(algo, init, dataset, 8, SAMPLING, evaluation=every4, progress=False)
  train(algo, init, dataset, 4, SAMPLING, evaluation=every4, progress=False, checkpointing=Checkpointing(str(tmp_path)))
  resumed, _ = train(algo, init, dataset, 8, SAMPLING, evaluation=every4, progress=False,
                     checkpointing=Checkpointing(str(tmp_path), resume=True))
  _assert_same_state(full, resumed)
  # Only the sampled clients' control variates moved: 5 clients per round, 8 rounds, 30 clients.
  table = full.client_control_variates["linear"]["kernel"]
  assert table.dtype == (storage_dtype or jnp.float32)
  moved = np.any(np.asarray(table, np.float32) != 0, axis=(1, 2))
  assert 5 <= moved.sum() <= min(30, 5 * 8)


def test_proportional_sampling_averages_the_draws_uniformly_and_is_unbiased():
  """Clients whose update is a fixed vector c_k (loss −c_kᵀw, one SGD(1) step: Δ_k = c_k), n = (1, 2, 5), C = 2
  draws per round with P(k) = n_k/n, FedAvg with its n_k-weighting default aggregator and server sgd(1.0).

  Each round's aggregate is the plain mean of the round's draws (rebuilt with `sample_round` and the driver's
  keys), so the model after R rounds is Σ_r mean_j c_{k_rj}. Enumerating the C-tuples, the expectation of that
  mean is exactly Σ n_k c_k / Σ n_k (full participation's weighted mean) while the n_k-weighted mean of the draws
  (n_k counted twice) is biased; R = 2000 rounds land within 4 standard errors of the former, far from the latter."""
  sizes, c = [1, 2, 5], np.array([[8.0, 0.0], [0.0, 8.0], [-2.0, -2.0]])
  dataset = fo.data.pack([{"c": np.tile(ck, (n, 1)).astype(np.float32)} for ck, n in zip(c, sizes)],
                         max_padding_factor=None)
  algo = fo.algorithms.fedavg(lambda w, batch: -batch["c"] @ w, client_optimizer=optax.sgd(1.0))
  rounds, per_round, kw = 2000, 2, dict(clients_per_round=2, local_steps=1, batch_size=5,
                                       client_sampling="proportional")
  state, history = train(algo, algo.init(jnp.zeros(2), jax.random.key(0)), dataset, rounds, Sampling(**kw),
                         evaluation=Evaluation(every=rounds), progress=False, seed=5)
  draws = np.asarray(jax.jit(jax.vmap(lambda r: fo.data.sample_round(
      jax.random.fold_in(jax.random.key(5), r), dataset, **kw).client_id))(jnp.arange(rounds)))
  np.testing.assert_allclose(np.asarray(state.params), c[draws].mean(axis=1).sum(axis=0), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(history.round_metrics["update_norm"], np.linalg.norm(c[draws].mean(axis=1), axis=1),
                             rtol=1e-6)
  n, p = np.asarray(sizes, float), np.asarray(sizes, float) / sum(sizes)
  full = n @ c / n.sum()
  tuples = list(itertools.product(range(3), repeat=per_round))
  prob = [np.prod(p[list(t)]) for t in tuples]
  uniform = sum(q * c[list(t)].mean(axis=0) for q, t in zip(prob, tuples))
  double = sum(q * n[list(t)] @ c[list(t)] / n[list(t)].sum() for q, t in zip(prob, tuples))
  np.testing.assert_allclose(uniform, full, rtol=1e-12)  # unbiased: E[plain mean of the draws] = Σ n_k c_k / Σ n_k
  se = np.sqrt(sum(q * (c[list(t)].mean(axis=0) - full)**2 for q, t in zip(prob, tuples)) / rounds)
  assert np.all(np.abs(np.asarray(state.params) / rounds - full) < 4 * se)
  assert np.all(np.abs(double - full) > 10 * se)  # the n_k-twice estimator is visibly biased at this R


def _with_vector_metric(algo):
  """The algorithm, its metrics extended by `per_round` = [round, 10·round, 100·round] (a vector per round)."""
  def step(state, batches):
    new = algo.step(state, batches)
    r = new.round.astype(jnp.float32)
    return new.replace(metrics={**new.metrics, "per_round": jnp.stack([r, 10 * r, 100 * r])})

  def init(params, key):
    s = algo.init(params, key)
    return s.replace(metrics={**s.metrics, "per_round": jnp.zeros(3, jnp.float32)})

  return fo.FederatedAlgorithm(init, step)


def test_vector_round_metrics_keep_the_round_axis_across_chunks(setup):
  """A metric that is a vector per round is recorded `[R, V]` (`[K, R, V]` for a sweep), rounds in order over
  several chunks: row r is round r + 1's vector, checked against the values the step wrote."""
  dataset, model, _, params = setup
  algo = _with_vector_metric(fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05)))
  _, history = train(algo, algo.init(params, jax.random.key(1)), dataset, 6, SAMPLING, evaluation=Evaluation(every=2),
                     progress=False)
  want = np.arange(1, 7)[:, None] * np.array([1.0, 10.0, 100.0])
  assert history.num_rounds == 6
  np.testing.assert_array_equal(history.round_metrics["per_round"], want)
  assert history.round_metrics["client_loss"].shape == (6,)

  swept = fo.sweep.seeds(algo, 2)
  _, history = train(swept, swept.init(params, jax.random.key(1)), dataset, 6, SAMPLING,
                     evaluation=Evaluation(every=3), progress=False)
  assert history.num_rounds == 6
  np.testing.assert_array_equal(history.round_metrics["per_round"], np.stack([want, want]))
  assert history.round_metrics["client_loss"].shape == (2, 6)


def test_progress_lines_show_a_dash_for_no_train_loss_and_large_values_in_scientific_notation(setup, capsys):
  """L2GD, L2SGD+, EASGD, FedU report no client loss: the line said `train_loss nan`; a huge loss was 34 digits."""
  dataset, model, algo, params = setup

  def without_loss(state):  # the setup algorithm without a train loss in its metrics
    return state.replace(metrics={k: v for k, v in state.metrics.items() if k != "client_loss"})

  quiet = fo.FederatedAlgorithm(lambda p, k: without_loss(algo.init(p, k)), lambda s, b: without_loss(algo.step(s, b)))
  _, history = train(quiet, quiet.init(params, jax.random.key(1)), dataset, 3, SAMPLING,
                     evaluation=Evaluation(every=3, metric_fns=_fns(model)), seed=SEED, label="no-loss")
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert line.startswith("[no-loss] round 3/3 | ") and "| train_loss – |" in line, line
  assert "train_loss" not in history.evals[-1] and "nan" not in line  # absent, not a NaN
  point = {"train_loss": 2.5e33, "test_loss": 0.00012345, "test_accuracy": 0.5}
  from fedjax_opt.train.progress import format_point, format_value  # pylint: disable=import-outside-toplevel
  assert format_point(point, 2.0).split(" | ") == [
      "2.0 rounds/s", "train_loss 2.500e+33", "test_loss 1.234e-04", "test_accuracy 0.5000"]
  assert format_point({"train_loss": [1.0, 3.0]}, 1.0).endswith("train_loss 2.0000 ± 1.0000")
  assert [format_value(v) for v in (None, 0.0, float("nan"), float("inf"), -12345.0)] == [
      "–", "0.0000", "nan", "inf", "-1.234e+04"]


def test_silent_phases_print_a_line_compilation_first_and_a_resume_with_its_round(setup, tmp_path, capsys):
  """Before the first chunk runs, one line says what compiles (the first progress line used to be the first word
  after seconds of silence); a resumed run says the round it resumes from, and a finished one that none is left."""
  dataset, model, algo, params = setup
  init = algo.init(params, jax.random.key(1))
  evaluation = Evaluation(every=3, metric_fns=_fns(model))
  ckpt = Checkpointing(str(tmp_path), resume=True)
  train(algo, init, dataset, 4, SAMPLING, evaluation=evaluation, seed=SEED, label="a", checkpointing=ckpt)
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0] == "[a] compiling rounds 1–3 and the evaluation; then a progress line every 3 rounds", lines
  assert [l.split(" | ")[0] for l in lines[1:]] == ["[a] round 3/4", "[a] round 4/4"]
  train(algo, init, dataset, 5, SAMPLING, evaluation=evaluation, seed=SEED, label="a", checkpointing=ckpt)
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[:2] == [f"[a] resuming from round 4 of 5 (checkpoint in {tmp_path})",
                       "[a] compiling round 5 and the evaluation; then a progress line as they end"], lines
  train(algo, init, dataset, 5, SAMPLING, evaluation=evaluation, seed=SEED, label="a", checkpointing=ckpt)
  assert capsys.readouterr().out.strip().splitlines() == ["[a] restored at round 5: no round left to train"]
  train(algo, init, dataset, 3, SAMPLING, evaluation=evaluation, seed=SEED, label="a", progress=False)
  assert capsys.readouterr().out == ""


def test_an_objective_is_recorded_at_every_evaluation_without_metric_fns(setup):
  """`Evaluation.objective(params, table, dataset)` (the ADMM family's F, for its gap curve): one value per
  evaluation, here ‖θ‖² of the evaluated model against NumPy; `table` is None without personalized_params."""
  dataset, _, algo, params = setup
  seen_tables = []

  def squared_norm(p, table, data):
    seen_tables.append(table)
    assert data.num_clients == dataset.num_clients
    return sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(p))

  state, history = train(algo, algo.init(params, jax.random.key(1)), dataset, 4, SAMPLING, progress=False,
                         evaluation=Evaluation(every=2, objective=squared_norm), seed=SEED)
  assert [e["round"] for e in history.evals] == [2, 4] and "test_loss" not in history.evals[-1]
  want = sum(np.sum(np.asarray(leaf, np.float64) ** 2) for leaf in jax.tree.leaves(state.params))
  assert history.evals[-1]["objective"] == pytest.approx(want, rel=1e-6)
  assert seen_tables and all(t is None for t in seen_tables)
  with pytest.raises(TypeError, match="objective must be callable"):
    Evaluation(objective=3.0)


def test_an_error_feedback_table_smaller_than_the_dataset_is_refused(setup):
  """A client stage's residual table of fewer rows than the dataset's clients (30) would drop the clients past its
  end from every round (they only showed in num_nonfinite): refused in one line, before anything is compiled."""
  from fedjax_opt.train import driver

  dataset, model, _, params = setup

  def algo(rows):
    stage = fo.compression.compress(fo.compression.top_k(k=1), error_feedback=True, num_clients=rows)
    return fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05),
                                aggregator=fo.aggregators.chain(stage, fo.aggregators.mean()))

  small = algo(29)
  with pytest.raises(ValueError) as raised:
    train(small, small.init(params, jax.random.key(1)), dataset, 3, SAMPLING, progress=False)
  message = str(raised.value)
  assert "\n" not in message and message.startswith(
      "train: the aggregator's client stage keeps a table of 29 rows"), message
  assert ("but the dataset has 30 clients: client 29 would be dropped from every round they are drawn in; build it "
          "with num_clients=30") in message
  for rows in (30, 31):  # one row per client, or more: accepted (checked without training)
    driver._check_client_tables(algo(rows).init(params, jax.random.key(1)), dataset, swept=False)
  members = jax.vmap(lambda k: small.init(params, k))(jax.random.split(jax.random.key(1), 2))  # a sweep: [K, N, ...]
  with pytest.raises(ValueError, match="keeps a table of 29 rows"):
    driver._check_client_tables(members, dataset, swept=True)
