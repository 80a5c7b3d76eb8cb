"""benchmarks/privacy_compression.py --quick: it runs, writes its files, and its numbers hold up.

The properties checked are the ones `--quick` shows with a wide margin
(40 rounds, Dirichlet(0.5) MNIST 5k, fixed seeds): error feedback lifts
top-k 1 % by several points (Stich et al. 2018, Karimireddy et al. 2019),
8-bit QSGD is within a point of uncompressed FedAvg at a quarter of the bits,
and every reported bit count is the compressor's formula. ε is recomputed
from the accountant; the run is deterministic, so the margins are not luck
of one draw per CI run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

import fedjax_opt as fo

pytestmark = pytest.mark.slow  # runs the benchmark's --quick mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  spec = importlib.util.spec_from_file_location("privacy_compression",
                                                os.path.join(ROOT, "benchmarks", "privacy_compression.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out_dir = tmp_path_factory.mktemp("privacy_compression")
  module.main(["--quick", "--out-dir", str(out_dir), "--img-dir", str(out_dir)])
  with open(out_dir / "privacy_compression_quick.json") as f:
    result = json.load(f)
  return module, out_dir, result


def test_writes_the_json_and_the_figure(quick):
  _, out_dir, result = quick
  assert sorted(os.listdir(out_dir)) == ["privacy_compression_quick.json", "privacy_compression_quick.png"]
  assert set(result["compression"]["runs"]["dirichlet"]) == {"identity", "qsgd8", "top_k1%", "top_k1%+EF",
                                                             "sign+EF"}


def test_error_feedback_lifts_top_k_and_8_bit_qsgd_matches_uncompressed(quick):
  runs = quick[2]["compression"]["runs"]["dirichlet"]
  assert runs["top_k1%+EF"]["final_accuracy"] >= runs["top_k1%"]["final_accuracy"] + 0.03
  assert abs(runs["qsgd8"]["final_accuracy"] - runs["identity"]["final_accuracy"]) <= 0.01
  assert runs["identity"]["final_accuracy"] >= 0.8


def test_the_reported_bits_are_the_compressors_formulas(quick):
  result = quick[2]
  p = result["compression"]["num_params"]
  assert p == 784 * 10 + 10
  runs = result["compression"]["runs"]["dirichlet"]
  k = math.ceil(0.01 * p)
  want = {"identity": 32 * p, "qsgd8": 32 + 8 * p, "top_k1%": k * (32 + math.ceil(math.log2(p))),
          "top_k1%+EF": k * (32 + math.ceil(math.log2(p))), "sign+EF": p + 32}
  for name, bits in want.items():
    assert runs[name]["bits_up_per_client_round"] == bits, name
    assert runs[name]["bits_down_per_client_round"] == 32 * p
    rounds = result["settings"]["rounds"]
    assert math.isclose(runs[name]["megabytes_up"][-1], bits * 10 * rounds / 8e6, rel_tol=1e-9)


def test_epsilons_are_the_accountants_and_noise_costs_accuracy(quick):
  result = quick[2]
  dp = result["dp"]["logistic_regression"]
  s = result["settings"]["dp"]
  sampling = fo.privacy.Sampling.fixed(num_clients=s["num_clients"], clients_per_round=s["clients_per_round"])
  run = dp["1"]
  want = fo.privacy.epsilons(1.0, delta=s["delta"], sampling=sampling, at=run["rounds"])
  assert [round(e, 6) for e in run["epsilon"]] == [round(float(e), 6) for e in want]
  assert dp["0"]["final_epsilon"] is None
  assert dp["1"]["final_accuracy"] < dp["0"]["final_accuracy"]
  timing = result["timing"]["logistic_regression"]
  assert set(timing) == set(quick[0].QUICK_PIECES) and all(row["ms"] > 0 for row in timing.values())
