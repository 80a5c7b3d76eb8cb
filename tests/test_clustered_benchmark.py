"""benchmarks/clustered.py --quick: it runs, writes its files, and its numbers hold up.

`--quick` is digits with label-permuted planted groups (G = 2, 3; FedEM at G = 2; 40 rounds),
one FedMA round of an MLP and FedMD with two architectures, all with fixed
seeds. Checked with the margins it shows: IFCA and CFL recover the planted
groups exactly (the adjusted Rand index recomputed here with scikit-learn
from the stored assignments) and serve the clients far better than FedAvg's
one model; FedMD's distillation beats independent local training on the ten
classes when every client holds two; FedMA's upload is the sum of its layers'
sizes in the widths it reports. Derived numbers (ARI, means, uploads) are
recomputed from the stored raw values, not read back.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

pytestmark = pytest.mark.slow  # runs the benchmark's --quick mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  spec = importlib.util.spec_from_file_location("clustered_benchmark", os.path.join(ROOT, "benchmarks", "clustered.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out_dir = tmp_path_factory.mktemp("clustered")
  module.main(["--quick", "--out-dir", str(out_dir), "--img-dir", str(out_dir)])
  with open(out_dir / "clustered_quick.json") as f:
    result = json.load(f)
  return module, out_dir, result


def _cases(result):
  for name, variants in result["clustered"].items():
    for variant, by_g in variants.items():
      for g, row in by_g.items():
        yield name, variant, int(g), row


def test_writes_the_json_and_the_figure(quick):
  _, out_dir, result = quick
  assert sorted(os.listdir(out_dir)) == ["clustered_fedma_quick.png", "clustered_quick.json", "clustered_quick.png"]
  assert (out_dir / "clustered_quick.png").stat().st_size > 10_000
  assert (out_dir / "clustered_fedma_quick.png").stat().st_size > 10_000
  assert result["settings"]["quick"] and result["settings"]["jax"]
  cases = list(_cases(result))
  assert [(n, v, g) for n, v, g, _ in cases] == [("digits", "labels", 2), ("digits", "labels", 3)]
  assert set(cases[0][3]["methods"]) == {"fedavg", "ifca", "cfl", "fedem"}  # FedEM at G = 2 only (compile time)
  assert set(cases[1][3]["methods"]) == {"fedavg", "ifca", "cfl"}


def test_the_planted_groups_are_equal_sized_and_the_permutations_real(quick):
  n = quick[2]["settings"]["clustered"]["num_clients"]
  for _, _, g, row in _cases(quick[2]):
    group = np.asarray(row["planted"]["group"])
    assert group.shape == (n,) and np.array_equal(np.bincount(group), [n // g] * g)
    perms = np.asarray(row["planted"]["label_permutations"])
    assert perms.shape == (g, 10) and np.array_equal(perms[0], np.arange(10))
    assert all(np.array_equal(np.sort(p), np.arange(10)) for p in perms)
    assert len({tuple(p) for p in perms}) == g


def test_ifca_and_cfl_recover_the_planted_groups_exactly(quick):
  for _, _, g, row in _cases(quick[2]):
    group = row["planted"]["group"]
    for m in ("ifca", "cfl", "fedem"):
      if m not in row["methods"]:
        continue
      res = row["methods"][m]
      ari = adjusted_rand_score(group, res["assignment"])
      assert ari == pytest.approx(res["ari"], abs=1e-12), (g, m)
      assert res["ari_curve"][-1] == res["ari"] and res["num_clusters"] == len(set(res["assignment"]))
      if m != "fedem":
        assert ari == 1.0, (g, m)
        assert res["first_exact_round"] is not None and 1 <= res["first_exact_round"] <= res["rounds"]
      assert len(res["restart_ari"]) == res["restarts"]
      assert res["chosen_restart"] == int(np.argmin(res["restart_train_loss"]))  # chosen by training loss only
    assert row["methods"]["cfl"]["num_clusters"] == g  # CFL found G by itself (at most 6 allowed)


def test_clustered_methods_serve_the_clients_far_better_than_fedavg(quick):
  for _, _, g, row in _cases(quick[2]):
    acc = {m: float(np.mean(res["per_client_accuracy"])) for m, res in row["methods"].items()}
    for m, res in row["methods"].items():
      assert acc[m] == pytest.approx(res["accuracy"], abs=1e-6)
    # One model answers one label per image class; the best it can do is, for each class c, the largest share of
    # clients whose groups agree on π_g(c) (classes about equally frequent, IID split): an upper bound for FedAvg.
    perms, group = np.asarray(row["planted"]["label_permutations"]), np.asarray(row["planted"]["group"])
    share = np.bincount(group, minlength=g) / len(group)
    bound = np.mean([max(share[perms[:, c] == label].sum() for label in range(10)) for c in range(10)])
    assert acc["fedavg"] < bound + 0.05, (acc, bound)
    for m in ("ifca", "cfl"):
      assert acc[m] > 0.8 and acc[m] > bound + 0.15 and acc[m] > acc["fedavg"] + 0.25, (g, acc, bound)
    if "fedem" in acc:
      assert acc["fedem"] > acc["fedavg"] + 0.2 and row["methods"]["fedem"]["mean_max_weight"] > 0.9, (g, acc)


def test_fedmd_beats_local_training_and_its_consensus_is_a_good_classifier(quick):
  md = quick[2]["fedmd"]
  arch_of = np.asarray(md["architecture_of"])
  assert md["architectures"] == ["logistic_regression", "mlp_32"]
  assert all(len(c) == 2 for c in md["client_classes"])
  for label in ("local", "fedmd"):
    run = md["runs"][label]
    per_client = np.asarray(run["per_client_accuracy"])
    assert run["mean_accuracy"] == pytest.approx(per_client.mean(), abs=1e-12)
    for i, a in enumerate(md["architectures"]):
      assert run["architecture_accuracy"][a] == pytest.approx(per_client[arch_of == i].mean(), abs=1e-12)
  local, fedmd = md["runs"]["local"], md["runs"]["fedmd"]
  assert max(local["per_client_accuracy"]) < 0.25  # two classes of ten: about a fifth of the test set at best
  for a in md["architectures"]:
    assert fedmd["architecture_accuracy"][a] > local["architecture_accuracy"][a] + 0.03, a
  assert fedmd["consensus_accuracy"] > 0.8 and fedmd["consensus_accuracy"] > local["consensus_accuracy"] + 0.15
  assert fedmd["consensus_accuracy"] > fedmd["mean_accuracy"]
  assert 0.0 <= fedmd["public_consensus_accuracy"] <= 1.0 and local["public_consensus_accuracy"] == -1.0


def test_fedma_uploads_are_its_layer_sizes_and_fedavg_uploads_n_times_p(quick):
  assert list(quick[2]["fedma"]) == ["digits_mlp"]
  res = quick[2]["fedma"]["digits_mlp"]
  assert list(res["variants"]) == ["fedma"]
  n = quick[2]["settings"]["fedma"]["num_clients"]
  dims = [64] + res["initial_widths"] + [10]
  assert res["num_params"] == sum((a + 1) * b for a, b in itertools.pairwise(dims))
  for run in res["runs"]:
    total, rows = 0.0, run["fedma"]["fedma"]
    assert run["fedma_failure"]["fedma"] is None and len(rows) == res["fedma_rounds"]
    for row in rows:
      # every client keeps its width (it restarts from its cut of the global model) and uploads each layer once:
      # its own units over the matched global inputs below
      assert all(w0 <= w <= 2 * w0 for w, w0 in zip(row["widths"], res["initial_widths"]))  # max_growth = 2
      inputs = [64] + row["widths"]
      units = res["initial_widths"] + [10]
      expected = n * sum((i + 1) * u for i, u in zip(inputs, units))
      assert row["round_uploaded_floats"] == expected
      total += expected
      assert row["uploaded_floats"] == total and row["communications"] == row["round"] * len(res["layers"])
      assert row["uploaded_mb"] == pytest.approx(4 * total / 1e6)
    for row in run["fedavg"]:
      assert row["uploaded_floats"] == row["round"] * n * res["num_params"]
    # FedAvg "at the same upload" is its first round that has uploaded at least as much as FedMA
    same = next(r for r in run["fedavg"] if r["uploaded_floats"] >= rows[-1]["uploaded_floats"])
    assert res["summary"]["fedma"]["fedavg_same_upload_rounds"] == [same["round"]]
    assert res["summary"]["fedma"]["fedma_minus_fedavg"]["mean"] == pytest.approx(
        rows[-1]["accuracy"] - same["accuracy"])
    one = run["one_shot"]
    # from a common start the units stay at their own indices: pfnm is the plain mean, the average of equal clients
    assert abs(one["pfnm"]["accuracy"] - one["average"]["accuracy"]) <= 0.01
    assert one["pfnm"]["widths"] == res["initial_widths"]


def test_the_fair_comparison_gives_fedavg_fedmas_upload_and_local_steps_and_each_its_validated_step_size(quick):
  """Part (d), recomputed from the stored per-seed rows: FedMA's local steps are R·L·S; FedAvg runs the whole number
  of N·P-float rounds nearest FedMA's mean upload with FedMA's steps spread over them; each method's step size is
  the grid's best mean validation accuracy; the test accuracies and differences are those of the chosen rows; the
  train, validation and test examples are the whole of digits (1,797)."""
  module, _, result = quick
  assert list(result["fedma_fair"]) == ["digits_mlp"]
  res = result["fedma_fair"]["digits_mlp"]
  settings = result["settings"]
  n, config = settings["fedma"]["num_clients"], settings["fedma"]["configs"]["digits_mlp"]
  assert res["lrs"] == list(settings["fair_lrs"]) and len(res["seeds"]) >= 2
  assert res["train_examples"] + res["validation_examples"] + res["test_examples"] == 1797
  assert res["validation_examples"] > 0.15 * (res["train_examples"] + res["validation_examples"])
  fedma, fedavg = res["fedma"], res["fedavg"]
  steps = settings["fair_rounds"]["digits_mlp"] * len(res["layers"]) * config["local_steps"]
  assert fedma["local_steps_per_client"] == steps
  chosen = {}
  for name, method in (("fedma", fedma), ("fedavg", fedavg)):
    assert list(method["per_lr"]) == [str(lr) for lr in res["lrs"]]
    validation = {lr: np.mean([row["validation"] for row in rows]) for lr, rows in method["per_lr"].items()}
    best = max(validation.values())
    assert float(next(lr for lr in validation if validation[lr] == best)) == method["chosen_lr"]
    rows = method["per_lr"][str(method["chosen_lr"])]
    assert [row["seed"] for row in rows] == res["seeds"]
    chosen[name] = np.array([row["test"] for row in rows])
    assert method["test"]["mean"] == pytest.approx(chosen[name].mean())
  upload = np.mean([row["uploaded_floats"] for row in fedma["per_lr"][str(fedma["chosen_lr"])]])
  assert fedavg["rounds"] == max(1, round(upload / (n * res["num_params"])))
  assert fedavg["local_steps_per_round"] == max(1, round(steps / fedavg["rounds"]))
  assert abs(fedavg["local_steps_per_client"] - steps) <= fedavg["rounds"] / 2
  assert fedavg["uploaded_mb"]["mean"] == pytest.approx(4 * fedavg["rounds"] * n * res["num_params"] / 1e6)
  assert abs(fedavg["uploaded_mb"]["mean"] - fedma["uploaded_mb"]["mean"]) <= 2 * n * res["num_params"] / 1e6
  assert res["fedma_minus_fedavg"]["mean"] == pytest.approx(np.mean(chosen["fedma"] - chosen["fedavg"]))
  table = "\n".join(module.fair_tables(result))
  assert "(d) FedMA against FedAvg at the same upload and the same local steps" in table
  assert f"{fedavg['rounds']} of {fedavg['local_steps_per_round']} steps" in table
