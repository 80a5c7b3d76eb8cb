"""Planted groups (`fo.data.plant_groups`), the adjusted Rand index, and `fedjax-opt run --planted`."""

import json
import re

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

import fedjax_opt as fo
from fedjax_opt.core import clusters
from tests.test_cli import run_cli


@pytest.mark.parametrize("seed", range(6))
def test_adjusted_rand_index_is_scikit_learn_s(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 40))
  a, b = rng.integers(0, 4, n), rng.integers(0, 5, n)
  assert clusters.adjusted_rand_index(a, b) == pytest.approx(adjusted_rand_score(a, b), abs=1e-12)
  renamed = (7 * a + 3) % 29  # the same partition under other names
  assert clusters.adjusted_rand_index(a, renamed) == pytest.approx(1.0)
  near = a.copy()
  near[0] = (near[0] + 1) % 4
  assert clusters.adjusted_rand_index(a, near) == pytest.approx(adjusted_rand_score(a, near), abs=1e-12)


def test_adjusted_rand_index_edge_cases_are_scikit_learn_s():
  for a, b in (([0, 0, 0], [1, 1, 1]), ([0, 1, 2], [5, 6, 7]), ([0, 0, 1, 1], [0, 0, 0, 0]), ([3], [4])):
    assert clusters.adjusted_rand_index(a, b) == pytest.approx(adjusted_rand_score(a, b))
  with pytest.raises(ValueError, match="same length"):
    clusters.adjusted_rand_index([0, 1], [0])


@pytest.fixture(scope="module")
def digits():
  return fo.data.load("digits", partition="iid", num_clients=9, seed=0)


def _real_slots(ds):
  slot = np.arange(ds.examples["y"].shape[1])[None, :]
  train, start, test = (np.asarray(a)[:, None] for a in (ds.train_count, ds.test_start, ds.test_count))
  return (slot < train) | ((slot >= start) & (slot < start + test))


def test_labels_are_permuted_per_group_and_nothing_else_moves(digits):
  planted, groups = fo.data.plant_groups(digits, 3, seed=4)
  assert sorted(np.bincount(groups).tolist()) == [3, 3, 3]
  y0, y1 = np.asarray(digits.examples["y"]), np.asarray(planted.examples["y"])
  real = _real_slots(digits)
  np.testing.assert_array_equal(np.asarray(planted.examples["x"]), np.asarray(digits.examples["x"]))
  np.testing.assert_array_equal(y1[~real], y0[~real])  # padding keeps its zeros
  maps = []
  for g in range(3):
    members = np.flatnonzero(groups == g)
    pairs = {(int(a), int(b)) for c in members for a, b in zip(y0[c][real[c]], y1[c][real[c]])}
    mapping = dict(pairs)
    assert len(mapping) == len(pairs) == 10 and sorted(mapping.values()) == list(range(10))  # a permutation
    maps.append(tuple(mapping[k] for k in range(10)))
  assert maps[0] == tuple(range(10)) and len(set(maps)) == 3  # group 0 unchanged, three different maps
  again, groups_again = fo.data.plant_groups(digits, 3, seed=4)
  np.testing.assert_array_equal(groups_again, groups)
  np.testing.assert_array_equal(np.asarray(again.examples["y"]), y1)


def test_rotate_turns_each_group_s_images_by_a_quarter_per_group(digits):
  planted, groups = fo.data.plant_groups(digits, 4, kind="rotate", seed=1)
  x0, x1 = np.asarray(digits.examples["x"]), np.asarray(planted.examples["x"])
  for c in range(digits.num_clients):
    np.testing.assert_array_equal(x1[c], np.rot90(x0[c], k=int(groups[c]), axes=(1, 2)))
  np.testing.assert_array_equal(np.asarray(planted.examples["y"]), np.asarray(digits.examples["y"]))


def test_bad_plantings_are_clear_errors(digits):
  with pytest.raises(ValueError, match="4 rotations"):
    fo.data.plant_groups(digits, 5, kind="rotate")
  with pytest.raises(ValueError, match=r"num_groups must be an integer in \[1, 9\]"):
    fo.data.plant_groups(digits, 10)
  with pytest.raises(ValueError, match="kind must be one of labels, rotate"):
    fo.data.plant_groups(digits, 2, kind="shuffle")
  synthetic = fo.data.load("synthetic_1_1", num_clients=4, seed=0)  # feature vectors, no image to rotate
  with pytest.raises(ValueError, match="needs square images"):
    fo.data.plant_groups(synthetic, 2, kind="rotate")


@pytest.mark.slow  # a subprocess run
def test_cli_reports_the_ari_of_each_clustering_against_the_planted_groups(tmp_path):
  out = tmp_path / "run"
  result = run_cli("run", "--dataset", "digits", "--partition", "iid", "--num-clients", "9", "--clients-per-round",
                   "9", "--planted", "labels:3", "--algorithms", "fedavg,fedem", "--rounds", "40", "--eval-every",
                   "40", "--local-steps", "5", "--batch-size", "16", "--out", str(out))
  assert result.returncode == 0, result.stderr
  assert "planted groups: 3 groups of clients" in result.stdout and "ARI" in result.stdout
  rows = {r["algorithm"]: r for r in json.loads((out / "results.json").read_text())}
  assert "ari" not in rows["fedavg"]  # one model: no clustering to score
  fedem = rows["fedem"]
  assert fedem["ari"] == pytest.approx(adjusted_rand_score(fedem["planted_groups"], fedem["cluster_of"]))
  assert fedem["num_clusters"] == len(set(fedem["cluster_of"]))
  # The groups written are those fo.data.plant_groups draws with the run's seed.
  _, groups = fo.data.plant_groups(fo.data.load("digits", partition="iid", num_clients=9, seed=0), 3, seed=0)
  assert fedem["planted_groups"] == groups.tolist()


@pytest.mark.parametrize("value,needle", [
    ("labels", "--planted must be KIND:G with KIND one of labels, rotate and G ≥ 1 groups"),
    ("swap:2", "--planted must be KIND:G"),
    ("rotate:5", "--planted rotate:5: kind='rotate' has 4 rotations"),
])
def test_cli_planted_errors_are_one_line(cli, value, needle, tmp_path):
  result = cli("run", "--dataset", "digits", "--num-clients", "9", "--clients-per-round", "3", "--planted", value,
                   "--rounds", "1",
                   "--out", str(tmp_path / "x"))
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr


def test_clusters_count_only_assigned_clients_and_show_the_unassigned_apart():
  """IFCA's clients never sampled hold cluster −1: 4 clusters in use, not 5, and 2 clients without a cluster."""
  from typing import NamedTuple

  from fedjax_opt.cli import report, run

  class IfcaLike(NamedTuple):
    cluster_of: np.ndarray

  cluster_of = np.array([0, 1, 2, 3, -1, 3, -1, 0])
  groups = np.array([0, 1, 2, 3, 0, 3, 1, 0])
  found = run.cluster_recovery(IfcaLike(cluster_of), groups, 1)
  assert found["num_clusters"] == len({0, 1, 2, 3}) and found["unassigned_clients"] == 2
  assert found["ari"] == pytest.approx(adjusted_rand_score(groups, cluster_of))
  sweep = run.cluster_recovery(IfcaLike(np.stack([cluster_of, np.arange(8) % 2])), groups, 2)
  assert sweep["num_clusters"] == [4, 2] and sweep["unassigned_clients"] == [2, 0]
  row = dict(algorithm="ifca", rounds=3, test_accuracy=0.5, test_loss=1.0, megabytes_sent=1.0, wall_seconds=1.0,
             status="finished", **found)
  header, _, line = report.results_table([row]).splitlines()[:3]
  cells = dict(zip(re.split(r"\s{2,}", header.strip()), re.split(r"\s{2,}", line.strip())))
  assert cells["clusters"] == "4" and cells["unassigned"] == "2"
  fedem = dict(row, algorithm="fedem", num_clusters=3, unassigned_clients=0)
  assert "unassigned" not in report.results_table([fedem]).splitlines()[0]  # nobody without a cluster: no column
