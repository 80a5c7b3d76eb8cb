"""The driver under everyday accidents: damaged checkpoints, Ctrl-C, divergence, rounds too big, no test data."""

import importlib
import os
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo

train_lib = importlib.import_module("fedjax_opt.train")  # `fedjax_opt.train`, the package attribute, is the function
SAMPLING = fo.Sampling(clients_per_round=5, local_steps=4, batch_size=10)


@pytest.fixture(scope="module")
def setup():
  dataset = fo.data.load("synthetic_1_1", seed=0)
  model = fo.models.logistic_regression(60, 10)
  algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05),
                              server_optimizer=fo.server_optimizers.fedadam(0.01))
  params = jax.tree.map(lambda p: p + 0.01, model.init(jax.random.key(0)))
  fns = {"loss": model.loss_fn, "accuracy": model.accuracy_fn}
  return dataset, algo, params, fns


def _run(setup, rounds, checkpointing=None):
  dataset, algo, params, fns = setup
  return train_lib.train(algo, algo.init(params, jax.random.key(1)), dataset, rounds, SAMPLING,
                         evaluation=fo.Evaluation(every=5, metric_fns=fns), progress=False, checkpointing=checkpointing)


def _same(a, b):
  chex.assert_trees_all_equal(train_lib.checkpoint.to_raw(a), train_lib.checkpoint.to_raw(b))


def _damage(step_dir):
  """Truncates every file of a checkpoint step to zero bytes."""
  for root, _, files in os.walk(step_dir):
    for name in files:
      open(os.path.join(root, name), "wb").close()


def test_a_truncated_latest_checkpoint_resumes_from_the_previous_one(setup, tmp_path):
  whole, whole_history = _run(setup, 15)
  _run(setup, 10, fo.Checkpointing(str(tmp_path)))  # checkpoints at rounds 5 and 10
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [5, 10]
  _damage(tmp_path / "10")
  with pytest.warns(train_lib.CheckpointWarning, match=r"round\(s\) 10 .* unreadable .*resuming from round 5"):
    resumed, history = _run(setup, 15, fo.Checkpointing(str(tmp_path), resume=True))
  _same(whole, resumed)
  np.testing.assert_array_equal(history.round_metrics["client_loss"], whole_history.round_metrics["client_loss"])
  # The broken step was replaced by a good one: the folder resumes cleanly again.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    again, _ = _run(setup, 15, fo.Checkpointing(str(tmp_path), resume=True))
  _same(whole, again)


def test_no_readable_checkpoint_is_one_clear_error(setup, tmp_path):
  _run(setup, 10, fo.Checkpointing(str(tmp_path)))
  for step in ("5", "10"):
    _damage(tmp_path / step)
  with pytest.raises(train_lib.CheckpointError, match=r"^no valid checkpoint in .* \(round\(s\) 10, 5 unreadable"):
    _run(setup, 15, fo.Checkpointing(str(tmp_path), resume=True))


def test_a_checkpoint_without_a_field_the_state_now_has_names_the_field(setup, tmp_path):
  """A state that gained a field (here the server's downlink error, when the aggregator gains a downlink; likewise
  a state saved by an older version of an algorithm) cannot be filled from the checkpoint: the one line says which
  field is missing, and nothing is deleted."""
  _run(setup, 10, fo.Checkpointing(str(tmp_path)))
  dataset, algo, params, fns = setup
  down = fo.aggregators.chain(fo.aggregators.weighted_mean(), fo.compression.downlink(fo.compression.top_k(k=5)))
  other = fo.algorithms.fedavg(fns["loss"], client_optimizer=optax.sgd(0.05),
                               server_optimizer=fo.server_optimizers.fedadam(0.01), aggregator=down)
  with pytest.raises(train_lib.CheckpointError) as raised:
    train_lib.train(other, other.init(params, jax.random.key(1)), dataset, 15, SAMPLING,
                    evaluation=fo.Evaluation(every=5, metric_fns=fns), progress=False,
                    checkpointing=fo.Checkpointing(str(tmp_path), resume=True))
  message = str(raised.value)
  assert "\n" not in message and "the checkpoint holds no state.downlink_error" in message, message
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [5, 10]


def _interrupt(original, n):
  """`original`, except that its n-th call raises KeyboardInterrupt (a plain function: binds as a method)."""
  calls = []

  def replacement(*args, **kwargs):
    calls.append(1)
    if len(calls) == n:
      raise KeyboardInterrupt
    return original(*args, **kwargs)

  return replacement


@pytest.mark.parametrize("where,saved_round", [
    ("progress", 10),  # after the 2nd chunk was committed: round 10 is saved
    ("history", 5),  # while the 2nd chunk's history is built: the 1st chunk (round 5) is saved, never half a chunk
])
def test_ctrl_c_saves_the_last_completed_chunk_and_resume_is_exact(setup, tmp_path, monkeypatch, where, saved_round):
  whole, whole_history = _run(setup, 15)
  if where == "progress":
    monkeypatch.setattr(train_lib.progress.Progress, "update", _interrupt(train_lib.progress.Progress.update, 2))
  else:
    monkeypatch.setattr(train_lib.History, "extended", _interrupt(train_lib.History.extended, 2))
  with pytest.raises(KeyboardInterrupt):
    _run(setup, 15, fo.Checkpointing(str(tmp_path), every=100))
  monkeypatch.undo()
  checkpointer = train_lib.Checkpointer(str(tmp_path))
  assert checkpointer.latest_round() == saved_round
  dataset, algo, params, _ = setup
  state, history = checkpointer.restore(algo.init(params, jax.random.key(1)))
  assert int(state.round) == saved_round and history.num_rounds == saved_round
  assert [e["round"] for e in history.evals] == list(range(5, saved_round + 1, 5))
  resumed, resumed_history = _run(setup, 15, fo.Checkpointing(str(tmp_path), resume=True))
  _same(whole, resumed)
  np.testing.assert_array_equal(resumed_history.round_metrics["client_loss"],
                                whole_history.round_metrics["client_loss"])


def _least_squares(client_lr):
  rng = np.random.default_rng(0)
  clients = [{"x": rng.normal(size=(30, 3)).astype(np.float32), "y": rng.normal(size=30).astype(np.float32)}
             for _ in range(6)]
  dataset = fo.data.pack(clients, test_fraction=0.2)
  loss = lambda p, b: 0.5 * jnp.square(b["x"] @ p - b["y"])
  algo = fo.algorithms.fedavg(loss, client_optimizer=optax.sgd(client_lr))
  return dataset, algo, {"loss": loss}


@pytest.mark.parametrize("client_lr", [30.0, 1e6])
def test_a_diverging_run_stops_and_says_when_and_why(client_lr, tmp_path):
  dataset, algo, fns = _least_squares(client_lr)
  sampling = fo.Sampling(clients_per_round=3, local_steps=5, batch_size=4)
  evaluation = fo.Evaluation(every=5, metric_fns=fns)
  with pytest.warns(train_lib.DivergenceWarning) as caught:
    state, history = train_lib.train(algo, algo.init(jnp.zeros(3), jax.random.key(0)), dataset, 200, sampling,
                                     evaluation=evaluation, progress=False, label="lsq",
                                     checkpointing=fo.Checkpointing(str(tmp_path)))
  assert history.diverged_at_round is not None and history.diverged_at_round < 200
  assert int(state.round) == history.diverged_at_round == history.num_rounds
  assert history.diverged_reason
  # Said at once, not only recorded: one warning with the round and the cause.
  assert [str(w.message) for w in caught] == [
      f"lsq diverged at round {history.diverged_at_round}: {history.diverged_reason}; training stopped there "
      f"(History.diverged_at_round)"]
  assert issubclass(train_lib.DivergenceWarning, RuntimeWarning)
  assert train_lib.History.from_dict(history.to_dict()).diverged_at_round == history.diverged_at_round
  # Resuming a diverged run trains no further, and says why.
  with pytest.warns(train_lib.DivergenceWarning, match=rf"restored run diverged at round {history.diverged_at_round} "
                                                       rf"\(.+\); it is not trained further"):
    again, again_history = train_lib.train(algo, algo.init(jnp.zeros(3), jax.random.key(0)), dataset, 300, sampling,
                                           evaluation=evaluation, progress=False,
                                           checkpointing=fo.Checkpointing(str(tmp_path), resume=True))
  assert int(again.round) == history.diverged_at_round and again_history.diverged_at_round == history.diverged_at_round


def test_a_sane_run_is_never_flagged():
  dataset, algo, fns = _least_squares(0.05)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no divergence and no padded batch to warn about
    _, history = train_lib.train(algo, algo.init(jnp.zeros(3), jax.random.key(0)), dataset, 40,
                                 fo.Sampling(clients_per_round=3, local_steps=5, batch_size=4),
                                 evaluation=fo.Evaluation(every=5, metric_fns=fns), progress=False)
  assert history.diverged_at_round is None and history.num_rounds == 40


def test_a_batch_larger_than_every_client_warns_once():
  dataset, algo, fns = _least_squares(0.05)
  assert dataset.max_train == 24  # 30 examples, 6 held out for test
  with pytest.warns(train_lib.BatchSizeWarning) as caught:
    _, history = train_lib.train(algo, algo.init(jnp.zeros(3), jax.random.key(0)), dataset, 4,
                                 fo.Sampling(clients_per_round=3, local_steps=1, batch_size=25),
                                 evaluation=fo.Evaluation(every=2, metric_fns=fns), progress=False)
  assert history.num_rounds == 4  # two chunks, one warning
  assert [str(w.message) for w in caught] == [
      "batch_size=25 exceeds every client's train examples (the largest client holds 24): each step pads every "
      "client's batch to 25 slots, which costs time and memory; batch_size=24 takes the same examples per step"]


def test_the_divergence_rule_against_hand_made_histories():
  def history(loss, accepted=None, dropped=None):
    metrics = {"client_loss": np.asarray(loss, np.float32)}
    if accepted is not None:
      metrics["round_accepted"], metrics["num_nonfinite"] = np.asarray(accepted), np.asarray(dropped)
    return train_lib.History(round_metrics=metrics)

  finite = {"w": np.ones(2, np.float32)}
  rule = train_lib.divergence
  assert rule(history([1.0, 2.0, 900.0]), finite, 1, 1e3, False) is None
  assert "grew" in rule(history([1.0, 2.0, 1001.0]), finite, 1, 1e3, False)
  assert "NaN or Inf" in rule(history([1.0, np.nan]), finite, 1, 1e3, False)
  assert "model" in rule(history([1.0, 1.0]), {"w": np.array([np.inf, 0], np.float32)}, 1, 1e3, False)
  assert "every client" in rule(history([1.0, 0.0, 0.0], [True, False, False], [0, 3, 2]), finite, 2, 1e3, False)
  assert rule(history([1.0, 0.0, 0.0], [True, True, False], [0, 3, 2]), finite, 2, 1e3, False) is None
  # With the initial model's test loss as the baseline: a first round already far off counts too.
  far = history([5e3, 6e3])
  assert rule(far, finite, 1, 1e3, False) is None  # against round 1 alone it looks steady
  far.initial_loss = 2.3
  assert "over 1000× the initial 2.3" in rule(far, finite, 1, 1e3, False)
  far.evals = [{"round": 2, "test_loss": float("inf")}]
  far.round_metrics["client_loss"] = np.asarray([1.0, 1.0], np.float32)
  assert "test loss is NaN or Inf" in rule(far, finite, 1, 1e3, False)
  # A sweep stops only when every member diverged.
  swept = train_lib.History(round_metrics={"client_loss": np.asarray([[1.0, np.nan], [1.0, 1.0]])})
  params = {"w": np.ones((2, 2), np.float32)}
  assert rule(swept, params, 1, 1e3, True) is None
  swept.round_metrics["client_loss"][1, 1] = np.nan
  assert rule(swept, params, 1, 1e3, True).startswith("every member")


def test_a_round_too_big_for_the_device_is_refused_before_it_runs(setup, monkeypatch):
  monkeypatch.setattr(train_lib.safety, "_available_bytes", lambda: 1000)
  with pytest.raises(train_lib.RoundTooLargeError, match=r"a chunk of 5 round\(s\) \(5 clients × 4 steps × batch 10\) "
                     r"needs about .* GiB of memory but the device has 0.0 GiB available; lower batch_size, local_steps or "
                     r"clients_per_round$"):
    _run(setup, 10)
  monkeypatch.undo()
  _, history = _run(setup, 5)  # the real device has room
  assert history.num_rounds == 5


def test_the_memory_estimate_counts_the_round_s_buffers(setup):
  """The estimate grows with the batch: (C·S·B) examples of 60 float32 features at least, for each chunk."""
  dataset, algo, params, _ = setup
  state = algo.init(params, jax.random.key(1))

  def need(batch_size):
    def chunk(s, d):
      return algo.step(s, fo.data.sample_round(jax.random.key(0), d, clients_per_round=5, local_steps=4,
                                               batch_size=batch_size))
    return train_lib.compiled_bytes(jax.jit(chunk).lower(state, dataset).compile())

  small, large = need(10), need(1000)
  assert large >= 5 * 4 * 1000 * 60 * 4  # the sampled features alone
  assert large > 20 * small


def test_metric_fns_without_test_examples_is_a_clear_error():
  rng = np.random.default_rng(0)
  dataset = fo.data.pack([{"x": rng.normal(size=(8, 3)).astype(np.float32), "y": np.zeros(8, np.float32)}] * 3,
                         test_fraction=0.0)
  loss = lambda p, b: 0.5 * jnp.square(b["x"] @ p - b["y"])
  algo = fo.algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match="this dataset has none: load it with test_fraction > 0, or pass metric_fns=None"):
    train_lib.train(algo, algo.init(jnp.zeros(3), jax.random.key(0)), dataset, 2,
                    fo.Sampling(clients_per_round=2, local_steps=1, batch_size=2),
                    evaluation=fo.Evaluation(metric_fns={"loss": loss}), progress=False)
