"""benchmarks/hypergrad.py --quick: it runs, writes its JSON, and its numbers are consistent.

The memory rows' ratios are recomputed from their byte counts; checkpointing per round must hold less than the
forward run's residuals kept for every round would (that is what it is for); the tuning row's grid is 25 points and
its best point is the arg-max of the grid's accuracies.
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
  accuracy = np.asarray(task["grid_accuracy"])
  assert accuracy.shape == (25,) and np.all((accuracy >= 0) & (accuracy <= 1))
  assert task["grid_best"]["accuracy"] == pytest.approx(accuracy.max())
  assert task["tune_rounds_trained"] == 4 * task["rounds"] < task["grid_rounds_trained"]
  # The fresh run at a grid point is that grid member's run.
  assert task["grid_best_rerun_accuracy"] == pytest.approx(task["grid_best"]["accuracy"], abs=2e-3)
  assert len(task["tune_validation_loss"]) == task["rounds"] // task["window"]
  assert len(task["offline_validation_loss"]) == task["offline_outer_steps"]
  assert task["offline_rounds_trained"] == (3 * task["offline_outer_steps"] + 1) * task["rounds"]
  assert np.all(np.isfinite(task["tune_validation_loss"]))
