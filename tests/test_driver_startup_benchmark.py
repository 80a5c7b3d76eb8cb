"""benchmarks/driver_overhead.py --part startup: one fresh command-line run, timed line by line."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.slow  # a whole command-line run in a subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_startup_run_times_its_lines_and_reads_each_algorithms_compile_seconds():
  spec = importlib.util.spec_from_file_location("driver_overhead", ROOT / "benchmarks" / "driver_overhead.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  run = module.startup_run(str(ROOT), ["--algorithms", "fedavg,fedadam", "--dataset", "digits", "--rounds", "2",
                                       "--eval-every", "1", "--num-clients", "6", "--clients-per-round", "3"])
  assert 0 < run["first_line_seconds"] <= run["first_progress_seconds"] <= run["total_seconds"]
  assert set(run["algorithms"]) == {"fedavg", "fedadam"}
  for row in run["algorithms"].values():
    assert 0 < row["compile_seconds"] <= row["wall_seconds"] < run["total_seconds"]
