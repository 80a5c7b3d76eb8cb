"""benchmarks/accelerator.py: the HLO byte count it compares rounds with, and its --quick run (slow tier)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  spec = importlib.util.spec_from_file_location("accelerator", ROOT / "benchmarks" / "accelerator.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_hlo_bytes_counts_a_loop_body_once_per_trip():
  accelerator = _module()
  n = 1 << 18  # float32 entries: 1 MiB

  def looped(x, trips):
    return jax.lax.fori_loop(0, trips, lambda i, a: jnp.sin(a) * 1.5, x)

  x = jnp.ones((n,), jnp.float32)
  counts = {}
  for trips in (3, 12):
    text = jax.jit(looped, static_argnums=1).lower(x, trips).compile().as_text()
    counts[trips] = accelerator.hlo_bytes(text)
  # each trip reads and writes the array once (1 MiB each way); the ratio of the two counts fixes the per-trip bytes
  per_trip = (counts[12]["bytes"] - counts[3]["bytes"]) / 9
  np.testing.assert_allclose(per_trip, 2 * 4 * n, rtol=0.05)
  assert counts[12]["kernels"] > counts[3]["kernels"]
  # XLA's own count sees the body once, whatever the trip count
  cost = jax.jit(looped, static_argnums=1).lower(x, 12).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert cost["bytes accessed"] < 0.5 * counts[12]["bytes"]


def test_our_round_and_the_plain_vmap_have_the_same_traffic_to_a_few_percent():
  accelerator = _module()
  row = accelerator.overhead(accelerator.tp.WORKLOADS["W-LR"], 10)
  assert row["plain_bytes"] > 0 and 1.0 <= row["bytes_ratio"] <= 1.1


@pytest.mark.slow
def test_the_quick_run_writes_every_cell_and_its_summary(tmp_path):
  accelerator = _module()
  result = accelerator.main(accelerator._parse_args(["--quick", "--workloads", "W-LR", "--repeats", "2",
                                                     "--cell-seconds", "1", "--out", str(tmp_path)]))
  stored = json.loads((tmp_path / "accelerator_cpu_quick.json").read_text())
  assert stored["backend"] == "cpu" and stored["memory_bandwidth"] > 0 and stored["matmul_peak_flops"] > 0
  summaries = [r for r in stored["cells"] if r["method"] == "summary"]
  assert [s["C"] for s in summaries] == [10, 100]
  for s in summaries:
    methods = {r["method"] for r in stored["cells"] if r["C"] == s["C"] and r["method"] != "summary"}
    assert {"auto", "auto+bf16", "vmap", "sequential", "plain vmap", "loop/client", "central"} <= methods
    assert s["auto_over_best"] > 0 and s["auto_choice"]
  assert result["overhead"] and all(0.9 < r["bytes_ratio"] < 1.2 for r in result["overhead"])
