"""`fedjax-opt run` with the algorithms that share no single model: FedMD (scores on public data)."""

import json

import numpy as np
import pytest

from fedjax_opt.cli import registry
from tests.test_cli import run_cli

SMALL = ["--dataset", "digits", "--num-clients", "8", "--clients-per-round", "4", "--local-steps", "3",
         "--batch-size", "16", "--quiet"]


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


def test_fedmd_settings_it_cannot_use_are_one_line_errors(tmp_path):
  result = run_cli("run", *SMALL, "--algorithms", "fedmd", "--rounds", "2", "--out", str(tmp_path / "x"),
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
