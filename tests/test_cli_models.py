"""`fedjax-opt run` with the algorithms that share no single model: FedMD (scores on public data)."""

import json

import numpy as np
import pytest

from fedjax_opt.cli import registry
from tests.test_cli import run_cli

SMALL = ["--dataset", "digits", "--num-clients", "8", "--clients-per-round", "4", "--local-steps", "3",
         "--batch-size", "16", "--quiet"]


@pytest.mark.slow  # subprocess runs
def test_fedmd_runs_sends_scores_not_models_and_its_public_set_is_reproducible(tmp_path):
  out = tmp_path / "run"
  result = run_cli("run", *SMALL, "--algorithms", "fedmd", "--rounds", "4", "--eval-every", "2", "--out", str(out),
                   "--set", "fedmd.public_size=300", "--set", "fedmd.public_per_round=120",
                   "--set", "fedmd.digest_batch_size=40", "--set", "fedmd.digest_steps=3")
  assert result.returncode == 0, result.stderr
  assert "fedmd: every client takes part in every round" in result.stdout
  (row,) = json.loads((out / "results.json").read_text())
  assert row["status"] == "finished" and row["rounds"] == 4
  # Each round: 8 clients upload 120 × 10 float32 scores, one consensus of 120 × 10 goes down; no model travels.
  assert row["megabytes_sent"] == pytest.approx(4 * (8 + 1) * 32 * 120 * 10 / 8e6)
  per_client = np.array(row["personalized_accuracy_per_client"][0], np.float64)
  assert per_client.shape == (8,) and row["personalized_accuracy"] == pytest.approx(per_client.mean(), abs=1e-6)
  history = json.loads((out / "history.json").read_text())["fedmd"]
  consensus = np.asarray(history["round_metrics"]["consensus_accuracy"])
  assert consensus.shape == (4,) and np.all((consensus > 0) & (consensus <= 1))  # D₀ carries labels: scored
  # The same command again: the same public set and the same training, bit for bit.
  again = tmp_path / "again"
  result = run_cli("run", *SMALL, "--algorithms", "fedmd", "--rounds", "4", "--eval-every", "2", "--out", str(again),
                   "--set", "fedmd.public_size=300", "--set", "fedmd.public_per_round=120",
                   "--set", "fedmd.digest_batch_size=40", "--set", "fedmd.digest_steps=3")
  assert result.returncode == 0, result.stderr
  assert json.loads((again / "history.json").read_text())["fedmd"]["round_metrics"] == history["round_metrics"]


def test_fedmd_settings_it_cannot_use_are_one_line_errors(cli, tmp_path):
  result = cli("run", *SMALL, "--algorithms", "fedmd", "--rounds", "2", "--out", str(tmp_path / "x"),
                   "--set", "fedmd.public_size=100", "--set", "fedmd.public_per_round=500")
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].endswith(
      "fedmd: public_per_round = 500 exceeds the 100 public examples.")
  assert not (tmp_path / "x").exists()


def test_fedmd_public_set_is_drawn_from_the_pooled_train_split():
  import fedjax_opt as fo
  from fedjax_opt.cli import run as run_lib

  dataset = fo.data.load("digits", num_clients=8, seed=0)
  public = run_lib.pooled_sample(dataset, 0)(300)
  train = fo.data.unpack(dataset, "train")
  pooled_x = np.concatenate([c["x"] for c in train]).reshape(-1, 64)
  pooled_y = np.concatenate([c["y"] for c in train])
  rows = {tuple(x): y for x, y in zip(pooled_x.tolist(), pooled_y.tolist())}
  x = np.asarray(public["x"]).reshape(300, -1)
  assert len({tuple(v) for v in x.tolist()}) == 300  # drawn without replacement (digits has no duplicate image)
  assert all(rows[tuple(v)] == int(y) for v, y in zip(x.tolist(), np.asarray(public["y"])))  # pairs kept
  assert "public_size" in registry.REGISTRY["fedmd"].settable()


MD = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--local-steps", "2", "--batch-size",
      "8", "--rounds", "4", "--eval-every", "2", "--quiet", "--algorithms", "fedmd", "--set", "fedmd.public_size=200",
      "--set", "fedmd.public_per_round=100", "--set", "fedmd.digest_batch_size=50", "--set", "fedmd.digest_steps=2"]


@pytest.mark.slow  # a whole command-line run
def test_fedmd_with_two_architectures_is_the_run_built_in_python(cli, tmp_path):
  """In process. `fedmd.architectures=mlp,logreg`: client k has architecture k mod 2, architecture a starts from
  its model's init(fold_in(key, a)), key = key(seed + 1); test acc is client 0's MLP; each client is scored with
  its own architecture on its own test split (against NumPy's argmax of its model's scores)."""
  import jax
  import optax

  import fedjax_opt as fo
  from fedjax_opt.cli import run as run_lib

  out = tmp_path / "run"
  result = cli("run", *MD, "--set", "fedmd.architectures=mlp,logreg", "--out", out)
  assert result.returncode == 0, result.stderr
  (row,) = json.loads((out / "results.json").read_text())
  saved = json.loads((out / "history.json").read_text())["fedmd"]
  assert row["hyper_parameters"]["architectures"] == "mlp,logreg"

  dataset = fo.data.load("digits", partition="dirichlet", alpha=0.5, num_clients=6, seed=0)
  mlp, logreg = fo.models.mlp_2nn(num_classes=10, input_dim=64), fo.models.logistic_regression(64, 10)
  architecture_of = np.arange(6) % 2
  algo = fo.algorithms.fedmd((mlp.loss_fn, logreg.loss_fn), apply_fn=(mlp.apply, logreg.apply), num_clients=6,
                             public_data=run_lib.pooled_sample(dataset, 0)(200), public_per_round=100,
                             digest_steps=2, digest_batch_size=50, client_optimizer=optax.sgd(0.05),
                             architecture_of=architecture_of)
  key = jax.random.key(1)
  state = algo.init((mlp.init(jax.random.fold_in(key, 0)), logreg.init(jax.random.fold_in(key, 1))), key)
  state, history = fo.train(algo, state, dataset, 4, fo.Sampling(clients_per_round=6, client_sampling="all",
                                                                  local_steps=2, batch_size=8),
                            evaluation=fo.Evaluation(every=2, metric_fns={"loss": mlp.loss_fn,
                                                                          "accuracy": mlp.accuracy_fn}),
                            seed=0, progress=False)
  assert saved["round_metrics"] == {k: np.asarray(v).tolist() for k, v in history.round_metrics.items()}
  assert [e["test_accuracy"] for e in saved["evals"]] == [e["test_accuracy"] for e in history.evals]
  test = fo.data.unpack(dataset, "test")
  want = []
  for k in range(6):
    model = (mlp, logreg)[architecture_of[k]]
    scores = np.asarray(model.apply(fo.algorithms.fedmd_client_params(state, k, architecture_of), test[k]["x"]))
    want.append(float(np.mean(np.argmax(scores, axis=1) == test[k]["y"])))
  np.testing.assert_allclose(row["personalized_accuracy_per_client"][0], want, atol=1e-6)
  assert row["personalized_accuracy"] == pytest.approx(np.mean(want), abs=1e-6)
  everyone = {key: np.concatenate([c[key] for c in test]) for key in ("x", "y")}
  client0 = fo.algorithms.fedmd_client_params(state, 0, architecture_of)
  client0 = np.argmax(np.asarray(mlp.apply(client0, everyone["x"])), axis=1)
  assert row["test_accuracy"] == pytest.approx(np.mean(client0 == everyone["y"]), abs=1e-6)
  # Scores, not models: 6 clients upload 100 × 10 float32 scores, one consensus comes down, every round.
  assert row["megabytes_sent"] == pytest.approx(4 * (6 + 1) * 32 * 100 * 10 / 8e6)


@pytest.mark.parametrize("args,needle", [
    (["--set", "fedmd.architectures=mlp,resnet"], "fedmd: architectures must be model names separated by commas, "
                                                  "from logreg, mlp, cnn (e.g. mlp,logreg); got 'mlp,resnet'"),
    (["--set", "fedmd.architectures=3"], "fedmd: architectures must be model names separated by commas"),
    (["--set", "fedmd.architectures=mlp,logreg,mlp"], "fedmd: architectures lists mlp twice"),
    (["--num-clients", "2", "--clients-per-round", "2", "--set", "fedmd.architectures=mlp,logreg,cnn"],
     "fedmd: architectures names 3 architectures for 2 clients"),
    (["--dataset", "synthetic_1_1", "--num-clients", "6", "--set", "fedmd.architectures=cnn,logreg"],
     "fedmd: architecture 'cnn' needs image data; the dataset's examples have shape (60,)"),
])
def test_fedmd_bad_architectures_are_one_line(cli, tmp_path, args, needle):
  result = cli("run", *MD, *args, "--out", tmp_path / "x")
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr
  assert not (tmp_path / "x").exists()


FEDMA = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--local-steps", "2",
         "--batch-size", "16", "--eval-every", "1", "--quiet", "--algorithms", "fedma", "--set", "fedma.sigma=0.001",
         "--set", "fedma.iterations=1", "--set", "fedma.max_width=260"]


@pytest.mark.slow  # subprocess runs
def test_fedma_runs_grows_counts_its_messages_and_resumes_bit_for_bit(tmp_path):
  whole, half = tmp_path / "whole", tmp_path / "half"
  result = run_cli("run", *FEDMA, "--rounds", "2", "--out", str(whole))
  assert result.returncode == 0, result.stderr
  (row,) = json.loads((whole / "results.json").read_text())
  assert row["status"] == "finished" and row["rounds"] == 2 and row["family"] == "matched"
  metrics = json.loads((whole / "history.json").read_text())["fedma"]["round_metrics"]
  widths = np.asarray(metrics["widths"])  # [R, 2]: the global hidden widths after each round
  assert widths.shape == (2, 2) and widths.max() > 200 and widths.max() <= 260  # σ tiny: new neurons, capped
  # Down: the new global model once per round, 64 → w₁ → w₂ → 10.
  params = [(64 + 1) * w1 + (w1 + 1) * w2 + (w2 + 1) * 10 for w1, w2 in widths]
  np.testing.assert_array_equal(metrics["bits_down"], [32 * p for p in params])
  # Up: each of the 3 clients uploads every layer once (`uploaded_floats` floats in all).
  np.testing.assert_allclose(np.asarray(metrics["bits_up"]) * 3, 32 * np.asarray(metrics["uploaded_floats"]))
  sent = (np.asarray(metrics["bits_up"]) * 3 + np.asarray(metrics["bits_down"])).sum() / 8e6
  assert row["megabytes_sent"] == pytest.approx(sent)
  # Stopped after round 1, resumed with only --rounds: the same run as the whole one, grown model restored.
  assert run_cli("run", *FEDMA, "--rounds", "1", "--out", str(half)).returncode == 0
  result = run_cli("run", "--resume", "--rounds", "2", "--out", str(half), "--quiet")
  assert result.returncode == 0, result.stderr
  resumed = json.loads((half / "history.json").read_text())["fedma"]
  assert resumed["round_metrics"] == metrics
  assert [e["test_accuracy"] for e in resumed["evals"]] == [
      e["test_accuracy"] for e in json.loads((whole / "history.json").read_text())["fedma"]["evals"]]


@pytest.mark.parametrize("args,needle", [
    (["--model", "logreg"], "fedma: FedMA matches the hidden units of fo.models' MLP"),
    (["--seeds", "2"], "fedma runs round by round on the host (its layers grow): --seeds 2 needs one vmapped program"),
    (["--aggregator", "marginal_median"], "--aggregator marginal_median needs algorithms whose factory takes "
                                          "aggregator=; fedma takes none: FedMA matches"),
])
def test_fedma_refusals_are_one_line(cli, args, needle, tmp_path):
  result = cli("run", *FEDMA, "--rounds", "1", "--out", str(tmp_path / "x"), *args)
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr
  assert not (tmp_path / "x").exists()
