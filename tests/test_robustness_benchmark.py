"""benchmarks/robustness.py --quick: it runs, writes its files, and shows the seed's three findings.

Xie, Koyejo & Gupta, "Generalized Byzantine-tolerant SGD" (arXiv:1802.10116),
as the source material (`004-modern-fl-methods-slides.txt`, EVALUATION)
summarizes it: the mean is not Byzantine-resilient; the geometric median
survives classic Byzantine attacks but not dimensional (generalized) ones;
the marginal median and mean-around-median survive both. Here on
Synthetic-IID with FedAvg for 10 rounds, 0 / 10 / 20 / 40 % attackers.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # runs the benchmark's --quick mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  spec = importlib.util.spec_from_file_location("robustness", os.path.join(ROOT, "benchmarks", "robustness.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out_dir = tmp_path_factory.mktemp("robustness")
  module.main(["--quick", "--out-dir", str(out_dir)])
  return module, out_dir


def _cells(out_dir):
  with open(out_dir / "robustness_quick.json") as f:
    return json.load(f)


def test_writes_the_table_plots_and_costs(quick):
  _, out_dir = quick
  result = _cells(out_dir)
  assert sorted(os.listdir(out_dir)) == ["robustness_cost_quick.png", "robustness_quick.json",
                                         "robustness_synthetic_iid_fedavg_quick.png"]
  cells = result["accuracy"]["synthetic_iid"]["fedavg"]
  assert sorted(cells) == ["geometric_median", "marginal_median", "mean", "mean_around_median"]
  for rule in cells.values():
    assert sorted(rule) == ["generalized_byzantine", "omniscient"]
    for r in rule.values():
      assert r["fractions"] == [0.0, 0.1, 0.2, 0.4] and len(r["accuracy"]) == 4
      assert len(r["curve_accuracy"]) == 4 and len(r["curve_accuracy"][0]) == len(r["curve_rounds"])
  # The attack-free member of every sweep sees the same clients and batches: identical whatever the attack.
  assert result["clean_member_max_spread"] == 0.0
  timing = result["cost"]["timings"]["rows"][0]
  assert set(timing["ms"]) == set(cells) and all(v > 0 for v in timing["ms"].values())
  memory = result["cost"]["round_memory"][0]["mib"]
  assert all(memory[rule] >= memory["mean"] for rule in memory)  # a robust rule holds all C updates at once


def test_the_seed_s_three_findings(quick):
  """Mean fails under the omniscient attack; GeoMed holds under it but fails under the dimensional attack;
  MarMed and MeaMed hold under both (within 6 points of their attack-free accuracy at every fraction)."""
  module, out_dir = quick
  results = _cells(out_dir)["accuracy"]["synthetic_iid"]
  cells, initial = results["fedavg"], results["initial_loss"]
  clean = {rule: cells[rule]["omniscient"]["accuracy"][0] for rule in cells}
  assert min(clean.values()) > 0.3  # ten classes: chance is 0.1
  mean = cells["mean"]["omniscient"]
  assert max(mean["accuracy"][1:]) < 0.15 and all(module.diverged(x, initial) for x in mean["loss"][1:])
  for rule in ("geometric_median", "marginal_median", "mean_around_median"):
    assert min(cells[rule]["omniscient"]["accuracy"][1:]) > clean[rule] - 0.06, rule
  assert max(cells["geometric_median"]["generalized_byzantine"]["accuracy"][1:]) < clean["geometric_median"] - 0.15
  for rule in ("marginal_median", "mean_around_median"):
    assert min(cells[rule]["generalized_byzantine"]["accuracy"][1:]) > clean[rule] - 0.06, rule


def test_unknown_names_are_one_clear_line(quick):
  module, _ = quick
  with pytest.raises(SystemExit, match=r"unknown rule \['medoid'\]; choose from mean, marginal_median"):
    module.main(["--quick", "--rules", "mean,medoid"])
  with pytest.raises(SystemExit, match="unknown attack"):
    module.main(["--quick", "--attacks", "sybil"])
  assert np.isfinite(module.GB_SCALE)
