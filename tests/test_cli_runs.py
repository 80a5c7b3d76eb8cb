"""`fedjax-opt run` end to end (subprocesses): every family, resume, safe run folders, Ctrl-C."""

import hashlib
import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.test_cli import CLI, run_cli

pytestmark = pytest.mark.slow  # every test here runs the command line as a subprocess, end to end

SMALL = ["--dataset", "digits", "--num-clients", "20", "--clients-per-round", "5", "--local-steps", "3",
         "--batch-size", "16", "--eval-every", "5", "--quiet"]


# The CLI as from a terminal: Ctrl-C raises KeyboardInterrupt even when these tests run in a background job, which
# starts with SIGINT ignored (Python then installs no handler). Set in the child itself, so no fork is needed.
INTERRUPTIBLE_CLI = [sys.executable, "-c",
                     "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv[0] = 'fedjax-opt'; runpy.run_module('fedjax_opt.cli', run_name='__main__')"]


def snapshot(folder) -> dict[str, str]:
  """Every file under `folder` (relative path → sha256 of its bytes)."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


def without_timings(history: dict) -> dict:
  """history.json without wall-clock numbers (which differ between two runs of the same computation)."""
  return {name: {"round_metrics": h["round_metrics"],
                 "evals": [{k: v for k, v in e.items() if k != "seconds"} for e in h["evals"]],
                 "megabytes_sent": h["megabytes_sent"]}
          for name, h in history.items()}


def test_one_algorithm_of_every_family_runs_and_reports(tmp_path):
  out = tmp_path / "run"
  cache = tmp_path / "xla"
  result = run_cli("run", *SMALL, "--algorithms", "fedavg,ditto,per_fedavg,admm_consensus,mixture_admm",
                   "--rounds", "10", "--out", str(out), "--compile-cache", str(cache))
  assert result.returncode == 0, result.stderr
  assert len(os.listdir(cache)) > 0  # the compiled programs were kept for the next run
  assert "compile s" in result.stdout
  for name in ("config.json", "history.json", "results.json", "accuracy.png", "loss.png",
               "personalized_accuracy.png"):
    assert (out / name).stat().st_size > 0, name
  assert "pers. acc" in result.stdout and "obj. gap" in result.stdout and "MB sent" in result.stdout
  rows = {r["algorithm"]: r for r in json.loads((out / "results.json").read_text())}
  assert list(rows) == ["fedavg", "ditto", "per_fedavg", "admm_consensus", "mixture_admm"]
  assert all(r["status"] == "finished" and r["rounds"] == 10 for r in rows.values())
  assert all(0 < r["compile_seconds"] < r["wall_seconds"] for r in rows.values())
  # The ADMM family forces logistic regression on everyone: 10 classes × (64 + 1) parameters.
  num_params = 650
  # FedAvg: 5 uploads + 1 broadcast of 650 float32 per round, 10 rounds.
  assert rows["fedavg"]["megabytes_sent"] == pytest.approx(10 * 6 * 32 * num_params / 8e6)
  # Consensus ADMM: every one of the 20 clients uploads, one broadcast.
  assert rows["admm_consensus"]["megabytes_sent"] == pytest.approx(10 * 21 * 32 * num_params / 8e6)
  for name in ("ditto", "per_fedavg", "mixture_admm"):
    per_client = rows[name]["personalized_accuracy_per_client"][0]
    assert len(per_client) == 20
    values = np.array([v for v in per_client if v is not None])
    # The table's mean and 10th percentile are those of the per-client values written beside them.
    assert rows[name]["personalized_accuracy"] == pytest.approx(values.mean(), abs=1e-6)
    assert rows[name]["personalized_accuracy_p10"] == pytest.approx(np.percentile(values, 10), abs=1e-6)
  assert "personalized_accuracy" not in rows["fedavg"] and "objective_gap" not in rows["fedavg"]
  for name in ("admm_consensus", "mixture_admm"):
    r = rows[name]
    assert r["objective"] >= r["objective_star"] - 1e-6  # F* is the minimum
    assert r["objective_gap"] == pytest.approx((r["objective"] - r["objective_star"]) / abs(r["objective_star"]))
  history = json.loads((out / "history.json").read_text())
  assert history["fedavg"]["megabytes_sent"][-1] == pytest.approx(rows["fedavg"]["megabytes_sent"])


def test_resume_with_only_rounds_continues_bit_for_bit(tmp_path):
  """A run of 20 rounds equals 10 rounds then `--resume --rounds 20` with no other flag (the saved config)."""
  whole, split = tmp_path / "whole", tmp_path / "split"
  algorithms = ["--algorithms", "fedavg,ditto"]
  assert run_cli("run", *SMALL, *algorithms, "--rounds", "20", "--out", str(whole)).returncode == 0
  assert run_cli("run", *SMALL, *algorithms, "--rounds", "10", "--out", str(split)).returncode == 0
  again = run_cli("run", "--out", str(split), "--resume", "--rounds", "20")
  assert again.returncode == 0, again.stderr
  assert "Traceback" not in again.stderr
  a = json.loads((whole / "history.json").read_text())
  b = json.loads((split / "history.json").read_text())
  assert without_timings(a) == without_timings(b)
  ra = json.loads((whole / "results.json").read_text())
  rb = json.loads((split / "results.json").read_text())
  for x, y in zip(ra, rb):
    assert x["rounds"] == y["rounds"] == 20
    for key in ("test_accuracy", "test_loss", "personalized_accuracy", "personalized_accuracy_per_client"):
      assert x.get(key) == y.get(key)
  assert json.loads((split / "config.json").read_text())["rounds"] == 20


def test_resume_refusals_leave_every_file_byte_identical(tmp_path):
  out = tmp_path / "run"
  assert run_cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "5", "--out", str(out)).returncode == 0
  before = snapshot(out)
  cases = [
      (["--resume", "--dataset", "mnist5k"], "--dataset mnist5k conflicts with the run saved in"),
      (["--resume", "--client-lr", "0.5"], "--client-lr 0.5 conflicts with the run saved in"),
      (["--resume", "--algorithms", "fedavg,scaffold"], "--algorithms fedavg,scaffold conflicts with the run saved"),
      (["--resume", "--rounds", "3"], "--rounds 3 is fewer than the 5 rounds of the run saved in"),
      (["--rounds", "8"], "already holds a run; continue it with --resume, replace it with --overwrite"),
  ]
  for args, needle in cases:
    result = run_cli("run", "--out", str(out), *args)
    assert result.returncode == 2, (args, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], (args, result.stderr)
    assert snapshot(out) == before, args
  missing = tmp_path / "missing"
  result = run_cli("run", "--out", str(missing), "--resume")
  assert result.returncode == 2 and "holds no run to resume" in result.stderr and "Traceback" not in result.stderr
  assert not missing.exists()
  a_file = tmp_path / "file"
  a_file.write_text("x")
  for args in (["--resume"], []):
    result = run_cli("run", *SMALL, "--out", str(a_file), *args)
    assert result.returncode == 2 and "is a file" in result.stderr
  assert a_file.read_text() == "x"


def test_overwrite_replaces_the_previous_run_and_keeps_other_files(tmp_path):
  out = tmp_path / "run"
  assert run_cli("run", *SMALL, "--algorithms", "fedavg,ditto", "--rounds", "5", "--out", str(out)).returncode == 0
  (out / "notes.txt").write_text("mine")
  result = run_cli("run", *SMALL, "--algorithms", "scaffold", "--rounds", "5", "--out", str(out), "--overwrite")
  assert result.returncode == 0, result.stderr
  assert sorted(os.listdir(out / "checkpoints")) == ["scaffold"]  # nothing of the old run is mixed in
  assert not (out / "personalized_accuracy.png").exists()
  assert [r["algorithm"] for r in json.loads((out / "results.json").read_text())] == ["scaffold"]
  assert (out / "notes.txt").read_text() == "mine"


def test_shakespeare_runs_with_a_character_model(tmp_path):
  out = tmp_path / "run"
  result = run_cli("run", "--dataset", "shakespeare", "--num-clients", "6", "--clients-per-round", "3",
                   "--local-steps", "2", "--batch-size", "4", "--rounds", "2", "--eval-every", "2",
                   "--algorithms", "fedavg", "--quiet", "--out", str(out))
  assert result.returncode == 0, result.stderr
  row = json.loads((out / "results.json").read_text())[0]
  assert row["model"] == "char_rnn" and row["status"] == "finished" and 0 <= row["test_accuracy"] <= 1
  assert json.loads((out / "config.json").read_text())["num_clients"] == 6


def test_ctrl_c_saves_and_resume_finishes_the_same_run(tmp_path):
  out, whole = tmp_path / "run", tmp_path / "whole"
  args = [a for a in SMALL if a != "--quiet"] + ["--algorithms", "fedavg", "--rounds", "4000", "--eval-every", "20",
                                                 "--checkpoint-every", "1000"]
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  proc = subprocess.Popen([*INTERRUPTIBLE_CLI, "run", *args, "--out", str(out)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
  for line in proc.stdout:
    if "round 100/4000" in line:
      break
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=300)
  if proc.returncode == 0:
    pytest.fail("the run finished before it could be interrupted")
  assert proc.returncode == 130, stderr
  assert "Traceback" not in stderr
  assert stderr.strip().splitlines()[-1].startswith("fedjax-opt: interrupted while training fedavg")
  steps = os.listdir(out / "checkpoints" / "fedavg")
  assert steps, "Ctrl-C saved no checkpoint"
  saved = max(int(s) for s in steps if s.isdigit())
  assert saved >= 100 and saved % 20 == 0
  again = run_cli("run", "--out", str(out), "--resume", "--rounds", str(4000))
  assert again.returncode == 0, again.stderr
  assert run_cli("run", *args, "--out", str(whole)).returncode == 0
  a = without_timings(json.loads((whole / "history.json").read_text()))
  b = without_timings(json.loads((out / "history.json").read_text()))
  assert a == b
  assert math.isfinite(json.loads((out / "results.json").read_text())[0]["test_accuracy"])


def test_a_truncated_checkpoint_resumes_from_the_previous_one(tmp_path):
  whole, out = tmp_path / "whole", tmp_path / "run"
  args = [*SMALL, "--algorithms", "fedavg", "--checkpoint-every", "1"]
  assert run_cli("run", *args, "--rounds", "20", "--out", str(whole)).returncode == 0
  assert run_cli("run", *args, "--rounds", "10", "--out", str(out)).returncode == 0
  steps = out / "checkpoints" / "fedavg"
  assert sorted(int(s) for s in os.listdir(steps) if s.isdigit()) == [5, 10]
  for root, _, files in os.walk(steps / "10"):
    for name in files:
      open(os.path.join(root, name), "wb").close()
  result = run_cli("run", "--out", str(out), "--resume", "--rounds", "20")
  assert result.returncode == 0, result.stderr
  warning = [line for line in result.stderr.splitlines() if line.startswith("fedjax-opt: warning:")]
  assert len(warning) == 1 and "resuming from round 5" in warning[0], result.stderr
  a = without_timings(json.loads((whole / "history.json").read_text()))
  b = without_timings(json.loads((out / "history.json").read_text()))
  assert a == b


def test_a_diverging_algorithm_is_stopped_and_marked(tmp_path):
  out = tmp_path / "run"
  result = run_cli("run", *SMALL, "--algorithms", "fedavg", "--client-lr", "1e6", "--rounds", "40", "--out", str(out))
  assert result.returncode == 0, result.stderr
  row = json.loads((out / "results.json").read_text())[0]
  assert row["status"].startswith("diverged ") and row["rounds"] < 40
  first, seen = row["diverged_between"]  # stopped at an evaluation; it went wrong after the one before
  assert seen == row["rounds"] and max(1, seen - 4) <= first <= seen
  assert "over 1000× the initial" in row["diverged_reason"] or "NaN or Inf" in row["diverged_reason"]
  assert f"fedavg {row['status']}: " in result.stdout


def test_a_round_too_big_for_memory_is_refused_and_leaves_no_folder(tmp_path):
  # 10⁷ slots a step: some 2 TiB by XLA's estimate under either CPU pipeline, refused on any test machine. (At 10⁵
  # the estimate under the default tier's fast XLA flags, 18 GiB, was below a 23 GiB machine's free memory, and the
  # run, which needs more than that estimate, was killed by the kernel.)
  out = tmp_path / "run"
  result = run_cli("run", "--batch-size", "10000000", "--rounds", "2", "--algorithms", "fedavg", "--out", str(out),
                   "--quiet")
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "needs about" in lines[0] and "lower batch_size, local_steps or clients_per_round" in lines[0]
  assert not out.exists()


def test_omniscient_attackers_break_the_mean_but_not_mean_around_median(tmp_path):
  """The seed's classic Byzantine case from the command line: 30% omniscient attackers, digits, 30 rounds."""
  attack = ["--attack", "omniscient", "--attackers", "0.3", "--rounds", "30", "--clients-per-round", "10"]
  base = ["--dataset", "digits", "--num-clients", "20", "--local-steps", "3", "--batch-size", "16", "--eval-every",
          "10", "--quiet"]
  plain, robust = tmp_path / "mean", tmp_path / "meamed"
  assert run_cli("run", *base, "--algorithms", "fedavg", *attack, "--out", str(plain)).returncode == 0
  result = run_cli("run", *base, "--algorithms", "fedavg", *attack, "--aggregator", "mean_around_median",
                   "--out", str(robust))
  assert result.returncode == 0, result.stderr
  mean_row = json.loads((plain / "results.json").read_text())[0]
  robust_row = json.loads((robust / "results.json").read_text())[0]
  assert mean_row["status"].startswith("diverged") or mean_row["test_accuracy"] < 0.3
  assert robust_row["status"] == "finished" and robust_row["test_accuracy"] > 0.6
  used = robust_row["hyper_parameters"]
  assert used["aggregator"] == {"name": "mean_around_median", "num_byzantine": 3}  # ⌊0.3 × 10⌋
  assert used["attack"] == {"name": "omniscient", "attackers": 0.3, "factor": 10.0}


def test_devices_splits_the_cpu_and_shards_the_clients_with_the_same_result(tmp_path):
  runs = {}
  for n in (1, 2):
    out = tmp_path / f"devices{n}"
    result = run_cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "10", "--devices", str(n),
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["devices"] == n
    runs[n] = json.loads((out / "history.json").read_text())["fedavg"]
  one, two = runs[1]["round_metrics"]["client_loss"], runs[2]["round_metrics"]["client_loss"]
  np.testing.assert_allclose(two, one, rtol=1e-4)  # the same rounds; sums over two devices round differently
  # The default, --devices auto: one device per available core (os.sched_getaffinity), the same rounds.
  out = tmp_path / "devices_auto"
  result = run_cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "10", "--out", str(out))
  assert result.returncode == 0, result.stderr
  assert json.loads((out / "config.json").read_text())["devices"] == "auto"
  row = json.loads((out / "results.json").read_text())[0]
  assert row["devices"] == len(os.sched_getaffinity(0))
  auto = json.loads((out / "history.json").read_text())["fedavg"]["round_metrics"]["client_loss"]
  np.testing.assert_allclose(auto, one, rtol=1e-4)
