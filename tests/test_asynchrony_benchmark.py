"""benchmarks/asynchrony.py --quick: it runs, writes its files, and its numbers hold up when recomputed.

The synchronous FedAvg baseline's clock is recomputed here with NumPy from the
documented recipe (per-round draws of numpy.random.default_rng((seed, r)),
speeds from default_rng(seed)), and its clients from `fo.data.sample_round`
with `fo.train`'s round keys, independently of the script's own code.
"""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

import fedjax_opt as fo

pytestmark = pytest.mark.slow  # runs the benchmark's --quick mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["co_op", "fedasync_constant", "fedasync_hinge", "fedasync_polynomial", "fedavg", "fedbuff"]
ROBUST = ["fedasync_attacked", "fedasync_clean", "zeno_attacked", "zeno_clean"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  spec = importlib.util.spec_from_file_location("asynchrony", os.path.join(ROOT, "benchmarks", "asynchrony.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out_dir = tmp_path_factory.mktemp("asynchrony")
  module.main(["--quick", "--out-dir", str(out_dir), "--img-dir", str(out_dir)])
  with open(out_dir / "asynchrony_quick.json") as f:
    result = json.load(f)
  return module, out_dir, result


def test_writes_the_json_and_the_figure_with_every_method(quick):
  _, out_dir, result = quick
  assert sorted(os.listdir(out_dir)) == ["asynchrony_quick.json", "asynchrony_quick.png"]
  assert list(result["tasks"]) == ["synthetic_1_1"]
  task = result["tasks"]["synthetic_1_1"]
  assert sorted(task["methods"]) == METHODS and sorted(task["robustness"]) == ROBUST
  horizon = task["setting"]["horizon"]
  assert task["grid"][0] == 0.0 and task["grid"][-1] == horizon
  for name, r in {**task["methods"], **task["robustness"]}.items():
    times = np.asarray(r["eval_time"])
    assert times[0] == 0.0 and np.all(np.diff(times) > 0) and times[-1] <= horizon, name
    assert len(r["eval_accuracy"]) == len(times) and len(r["accuracy_at"]) == len(task["grid"]), name
    assert r["final_accuracy"] == r["eval_accuracy"][-1] == r["accuracy_at"][-1], name
    assert r["final_accuracy"] > task["initial_accuracy"] + 0.1 or name == "fedasync_attacked", name


def test_sync_fedavg_rounds_last_as_long_as_their_slowest_client(quick):
  """Durations recomputed with NumPy; the charged clients are the ones `fo.train` sampled in that round."""
  _, _, result = quick
  settings, task = result["settings"], result["tasks"]["synthetic_1_1"]
  n, seed = task["num_clients"], settings["seed"]
  rng = np.random.default_rng(seed)
  speed = np.exp(settings["speed_sigma"] * rng.standard_normal(n))
  slow = rng.permutation(n)[:round(settings["stragglers"]["fraction"] * n)]
  speed[slow] *= settings["stragglers"]["factor"]
  np.testing.assert_allclose(task["speed"], speed, rtol=1e-12)
  assert sorted(task["stragglers"]) == sorted(slow.tolist())

  fedavg = task["methods"]["fedavg"]
  clients = np.asarray(fedavg["round_clients"])
  rounds = len(clients)
  assert rounds >= 2 and clients.shape[1] == settings["clients_per_round"]
  dataset = fo.data.load("synthetic_1_1", seed=seed)
  expected = []
  for r in range(rounds):
    batches = fo.data.sample_round(jax.random.fold_in(jax.random.key(seed), r), dataset,
                                   clients_per_round=settings["clients_per_round"],
                                   local_steps=settings["local_steps"], batch_size=settings["batch_size"])
    np.testing.assert_array_equal(clients[r], np.asarray(batches.client_id))
    draws = np.random.default_rng((seed, r))
    c = draws.lognormal(settings["compute_time"]["lognormal_mu"], settings["compute_time"]["lognormal_sigma"], n)
    latency = draws.exponential(settings["latency"]["exponential_mean"], n)
    expected.append(np.max(speed[clients[r]] * c[clients[r]] + latency[clients[r]]))
  np.testing.assert_allclose(fedavg["round_duration"], expected, rtol=1e-5)
  np.testing.assert_allclose(fedavg["round_time"], np.cumsum(expected), rtol=1e-5)
  assert fedavg["round_time"][-1] <= task["setting"]["horizon"]
  assert fedavg["eval_time"][1:] == fedavg["round_time"]  # evaluated after every round
  assert fedavg["updates_used"] == settings["clients_per_round"] * rounds and fedavg["staleness_max"] == 0
  # Most rounds wait for a straggler: the mean round is far longer than a typical client's time.
  assert np.mean(expected) > 2 * np.median(speed)


def test_async_runs_use_more_updates_and_report_their_staleness(quick):
  _, _, result = quick
  task = result["tasks"]["synthetic_1_1"]
  m = task["methods"]
  for name in ("fedbuff", "fedasync_constant", "fedasync_polynomial", "fedasync_hinge", "co_op"):
    r = m[name]
    assert r["updates_used"] > 3 * m["fedavg"]["updates_used"], name
    assert 0 < r["staleness_mean"] <= r["staleness_max"] < result["settings"]["history_size"], name
  assert m["fedbuff"]["versions"] == m["fedbuff"]["updates_used"] // result["settings"]["buffer_size"]
  for name in ("fedasync_constant", "fedasync_polynomial", "fedasync_hinge"):  # every arrival is a version
    assert m[name]["versions"] == m[name]["updates_used"] == m[name]["arrivals"] and m[name]["rejected"] == 0
  # Co-op discards what is older than max_age: its largest used staleness is within the bound.
  assert m["co_op"]["staleness_max"] <= result["settings"]["co_op_max_age"]
  assert m["co_op"]["rejected"] + m["co_op"]["updates_used"] == m["co_op"]["arrivals"]
  # The same clock for every asynchronous run (its draws do not depend on the model).
  assert len({m[name]["arrivals"] for name in m if name != "fedavg"}) == 1


def test_zeno_rejects_the_byzantine_updates_that_break_fedasync(quick):
  _, _, result = quick
  task = result["tasks"]["synthetic_1_1"]
  rob = task["robustness"]
  # With no attacker the robustness panel's FedAsync is the table's FedAsync (constant), run for run.
  assert rob["fedasync_clean"]["eval_accuracy"] == task["methods"]["fedasync_constant"]["eval_accuracy"]
  for run, r in rob.items():
    assert r["attacker_arrivals"] + r["honest_arrivals"] == r["arrivals"], run
    assert r["attacker_rejected"] + r["honest_rejected"] == r["rejected"], run
  assert rob["fedasync_attacked"]["rejected"] == 0
  assert rob["fedasync_attacked"]["attacker_used"] == rob["fedasync_attacked"]["attacker_arrivals"] > 0
  zeno = rob["zeno_attacked"]
  assert zeno["attacker_arrivals"] > 10
  assert zeno["attacker_rejected"] >= 0.9 * zeno["attacker_arrivals"]
  assert zeno["honest_rejected"] / zeno["honest_arrivals"] < zeno["attacker_rejected"] / zeno["attacker_arrivals"]
  assert rob["fedasync_attacked"]["final_accuracy"] < 0.2  # ten classes
  assert zeno["final_accuracy"] > rob["fedasync_attacked"]["final_accuracy"] + 0.3
  # On the honest clients' own test data (what the attackers' rejection does not take away), Zeno++ under
  # attack is close to its attack-free run.
  for run, r in rob.items():
    assert len(r["eval_accuracy_honest"]) == len(r["eval_accuracy"]), run
  assert zeno["final_accuracy_honest"] > rob["zeno_clean"]["final_accuracy_honest"] - 0.1


def test_unknown_task_is_one_clear_line(quick):
  module, _, _ = quick
  with pytest.raises(SystemExit, match=r"unknown task \['cifar'\]; choose from synthetic_1_1, mnist5k"):
    module.main(["--quick", "--tasks", "cifar"])
