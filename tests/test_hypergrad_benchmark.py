"""benchmarks/hypergrad.py --quick: it runs, writes its JSON, and its numbers are consistent.

The memory rows' ratios are recomputed from their byte counts; checkpointing per round must hold less than the
forward run's residuals kept for every round would (that is what it is for); the tuning row's grid is 25 points and
its best point is the arg-max of the grid's accuracies; the tuned values are the protocol's (the tail average of the
online iterates, the whole-run steps from it, and the best of their runs by validation accuracy), and the fresh runs
reproduce the grid's and the tuning's runs.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # runs the benchmark's --quick mode


def test_quick_run(tmp_path):
  path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "hypergrad.py"
  spec = importlib.util.spec_from_file_location("hypergrad_benchmark", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.main(["--quick", "--out-dir", str(tmp_path)])
  with open(tmp_path / "hypergrad_quick.json") as f:
    report = json.load(f)
  rows = {(r["rounds"], r["program"]): r for r in report["memory"]}
  for (rounds, _), row in rows.items():
    assert row["total"] == row["arguments"] + row["outputs"] + row["temporaries"]
    assert row["vs_forward"] == pytest.approx(row["total"] / rows[(rounds, "forward")]["total"], abs=1e-3)
  assert rows[(4, "reverse, round")]["total"] > rows[(4, "forward")]["total"]
  (task,) = report["tuning"]
  (record,) = task["seeds"]
  accuracy = np.asarray(record["grid_accuracy"])
  assert accuracy.shape == (25,) and np.all((accuracy >= 0) & (accuracy <= 1))
  assert record["grid_best"]["accuracy"] == pytest.approx(accuracy.max())
  assert record["grid_best_by_loss"]["validation_loss"] == pytest.approx(min(record["grid_validation_loss"]))
  rounds = task["rounds"]
  assert record["tune_rounds_trained"] == (3 + 3 * task["refine_steps"] + 1) * rounds < record["grid_rounds_trained"]
  # The fresh run at a grid point is that grid member's run, and the tuned run is the offline schedule's state.
  assert record["grid_best_rerun_accuracy"] == pytest.approx(record["grid_best"]["accuracy"], abs=2e-3)
  assert record["tuned_rerun_accuracy"] == pytest.approx(record["tune_accuracy"], abs=2e-3)
  assert len(record["online_validation_loss"]) == rounds // task["window"]
  assert np.all(np.isfinite(record["online_validation_loss"]))
  # The online result is the geometric mean of the last iterates, and the whole-run steps start from it.
  n = task["online_average_last"]
  for name, values in record["online_trajectory"].items():
    assert record["online_average"][name] == pytest.approx(np.exp(np.mean(np.log(values[-n:]))), rel=1e-5)
    assert record["refine_trajectory"][name][0] == pytest.approx(record["online_average"][name], rel=1e-5)
    assert record["refine_last"][name] == pytest.approx(record["refine_trajectory"][name][-1], rel=1e-6)
  # The result is the whole-run steps' run of best validation accuracy (the grid's rule), and is that run.
  refine_accuracy = record["refine_accuracy"]
  assert len(refine_accuracy) == task["refine_steps"] + 1
  assert record["selected"] == int(np.argmax(refine_accuracy))
  assert record["tune_accuracy"] == pytest.approx(max(refine_accuracy), abs=1e-6)
  assert record["refine_last"]["accuracy"] == pytest.approx(refine_accuracy[-1], abs=1e-6)
  for name, values in record["refine_trajectory"].items():
    assert record["tuned"][name] == pytest.approx(values[record["selected"]], rel=1e-6)
  assert len(record["refine_validation_loss"]) == task["refine_steps"]
  offline = record["offline_from_start"]
  assert len(offline["validation_loss"]) == offline["outer_steps"]
  assert offline["rounds_trained"] == (3 * offline["outer_steps"] + 1) * rounds
