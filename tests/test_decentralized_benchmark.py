"""benchmarks/decentralized.py --quick: it runs, writes its files, and its numbers hold what the docs read off them.

Sixteen Synthetic(1, 1) nodes, ridge regression, 300 rounds, five graphs (ring, 4 × 4 torus, exponential,
complete, random matchings of K_16): gradient tracking ends below D-PSGD on every graph, D-PSGD's floor
shrinks with η, the reported spectral gaps are those of NumPy's eigenvalues of the Metropolis matrices and
order both the pure-gossip contraction and gradient tracking's rounds to 1e-8, and the bytes each node sends
are its degree times the model's bytes.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # runs the benchmark's --quick mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 16
STATIC = ("ring", "torus 4x4", "exponential", "complete")
GRAPHS = STATIC + ("random matchings",)
METHODS = ("gossip + local steps", "D-PSGD", "gradient tracking")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  spec = importlib.util.spec_from_file_location("decentralized_benchmark",
                                                os.path.join(ROOT, "benchmarks", "decentralized.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out_dir = tmp_path_factory.mktemp("decentralized")
  returned = module.main(["--quick", "--out-dir", str(out_dir / "results"), "--img-dir", str(out_dir / "img")])
  with open(out_dir / "results" / "decentralized_quick.json") as f:
    report = json.load(f)
  return module, out_dir, report, returned


def _adjacency(name: str) -> np.ndarray:
  """The graphs' adjacency matrices written out by hand."""
  a = np.zeros((N, N), bool)
  i = np.arange(N)
  if name == "ring":
    hops = [1]
  elif name == "exponential":
    hops = [1, 2, 4, 8]
  elif name == "complete":
    hops = list(range(1, N))
  else:  # 4 x 4 torus: node 4r + c joins 4((r ± 1) mod 4) + c and 4r + (c ± 1) mod 4
    r, c = np.divmod(i, 4)
    for j in (((r + 1) % 4) * 4 + c, r * 4 + (c + 1) % 4):
      a[i, j] = a[j, i] = True
    return a
  for h in hops:
    a[i, (i + h) % N] = a[(i + h) % N, i] = True
  return a


def _metropolis(a: np.ndarray) -> np.ndarray:
  d = a.sum(1)
  w = np.where(a, 1.0 / (1.0 + np.maximum(d[:, None], d[None, :])), 0.0)
  return w + np.diag(1.0 - w.sum(1))


def test_writes_the_json_and_both_figures(quick):
  _, out_dir, report, returned = quick
  assert sorted(os.listdir(out_dir / "results")) == ["decentralized_quick.json"]
  assert sorted(os.listdir(out_dir / "img")) == ["decentralized_graphs_quick.png", "decentralized_quick.png"]
  for name in os.listdir(out_dir / "img"):
    with open(out_dir / "img" / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert report["settings"]["nodes"] == N and report["settings"]["rounds"] == 300
  assert returned["settings"] == report["settings"]
  assert sorted(report["graphs"]) == sorted(GRAPHS)
  summary = report["tasks"]["ridge"]["summary"]
  assert sorted(summary) == sorted(GRAPHS) and all(sorted(summary[g]) == sorted(METHODS) for g in GRAPHS)


def test_spectral_gaps_are_numpy_eigenvalues_of_the_metropolis_matrices(quick):
  """Static graphs: 1 − second largest |eigvalsh| of the hand-built Metropolis matrix; matchings: the per-round
  equivalent 1 − σ^(1/T) of σ = ‖W_{T−1} ⋯ W_0 − 11ᵀ/N‖₂ over the script's period."""
  module, _, report, _ = quick
  import fedjax_opt as fo

  for name in STATIC:
    eig = np.sort(np.abs(np.linalg.eigvalsh(_metropolis(_adjacency(name)))))
    assert report["graphs"][name]["spectral_gap"] == pytest.approx(1.0 - eig[-2], abs=1e-12), name
    assert report["graphs"][name]["degree"] == _adjacency(name).sum(1).mean()
  seq = fo.graphs.random_matchings(N, module.PERIOD, seed=0)
  product = np.linalg.multi_dot(seq[::-1])
  sigma = np.linalg.norm(product - np.full((N, N), 1.0 / N), 2)
  assert report["graphs"]["random matchings"]["spectral_gap"] == pytest.approx(1.0 - sigma ** (1 / module.PERIOD),
                                                                               rel=1e-9)
  assert report["graphs"]["random matchings"]["degree"] == 1.0  # N even: every matching of K_N is perfect


def test_the_spectral_gap_orders_the_graphs(quick):
  """ring < torus < exponential < complete; pure gossip's measured contraction is (1 − gap)² per round (the
  asymptotic rate from a random start); gradient tracking needs fewer rounds to 1e-8 on a graph of larger gap."""
  _, _, report, _ = quick
  graphs = report["graphs"]
  gaps = [graphs[g]["spectral_gap"] for g in STATIC]
  assert gaps == sorted(gaps) and gaps[-1] == pytest.approx(1.0)
  for g in STATIC[:-1]:
    assert graphs[g]["gossip_contraction"] == pytest.approx((1 - graphs[g]["spectral_gap"]) ** 2, abs=0.01), g
  assert graphs["complete"]["gossip_contraction"] == 0.0  # J/N: consensus in one round
  # a time-varying sequence contracts at least as fast as its per-round equivalent gap guarantees
  assert graphs["random matchings"]["gossip_contraction"] <= (1 - graphs["random matchings"]["spectral_gap"]) ** 2
  summary = report["tasks"]["ridge"]["summary"]
  rounds = [summary[g]["gradient tracking"]["best"]["reach"]["1e-08"]["round"] for g in STATIC]
  assert None not in rounds and rounds == sorted(rounds, reverse=True), rounds


def test_gradient_tracking_converges_where_dpsgd_keeps_a_bias_floor(quick):
  """On every graph gradient tracking's final gap (of x̄ and of the worst node) is far below D-PSGD's, and below
  1e-8; D-PSGD never reaches 1e-8 at any step size, and its floor shrinks as η does (η·L from 1/2 to 1/16)."""
  module, _, report, _ = quick
  summary = report["tasks"]["ridge"]["summary"]
  factors = list(module.ETA_FACTORS)
  for g in GRAPHS:
    tracked, plain = summary[g]["gradient tracking"]["best"], summary[g]["D-PSGD"]["best"]
    assert tracked["final_gap"] < 1e-8 and tracked["final_worst_gap"] < 1e-6, (g, tracked)
    assert tracked["final_gap"] < 1e-3 * plain["final_gap"], g
    assert tracked["final_worst_gap"] < 1e-3 * plain["final_worst_gap"], g
    assert all(row["reach"]["1e-08"]["round"] is None for row in summary[g]["D-PSGD"]["per_eta"]), g
    floors = [summary[g]["D-PSGD"]["per_eta"][factors.index(f)]["final_gap"] for f in (0.5, 0.25, 0.125, 0.0625)]
    assert floors == sorted(floors, reverse=True) and floors[-1] > 1e-7, (g, floors)
    # the nodes themselves stay apart under D-PSGD, and agree under gradient tracking
    assert plain["final_consensus_distance"] > 1e-5 > tracked["final_consensus_distance"]


def test_the_worst_node_is_never_better_than_the_average(quick):
  """F is convex, so F(x̄) ≤ max_i F(x_i): the worst node's gap bounds the average's on every recorded round."""
  _, _, report, _ = quick
  curves = report["tasks"]["ridge"]["best_curves"]
  rounds, worst_rounds = curves["rounds"], curves["worst_rounds"]
  shared = sorted(set(rounds) & set(worst_rounds))
  assert len(shared) > 10 and worst_rounds[-1] == rounds[-1] == 300
  for g in GRAPHS:
    for m in METHODS:
      gap = np.asarray([curves[g][m]["gap"][rounds.index(r)] for r in shared], float)
      worst = np.asarray([curves[g][m]["worst_gap"][worst_rounds.index(r)] for r in shared], float)
      assert np.all(worst >= gap - 1e-12 * (1 + np.abs(gap))), (g, m)
      assert curves[g][m]["gap"][0] == curves["ring"]["D-PSGD"]["gap"][0] > 0  # the same zero model to start


def test_bytes_are_degree_times_model_bytes(quick):
  """Per node and round: degree × 21 float64 parameters (gradient tracking sends x and y); the bytes to reach a
  target are that times the round it is reached."""
  _, _, report, _ = quick
  model_bytes = report["settings"]["model_bytes"]
  assert model_bytes == 21 * 8
  summary = report["tasks"]["ridge"]["summary"]
  for g in GRAPHS:
    degree = report["graphs"][g]["degree"]
    for m in METHODS:
      vectors = 2 if m == "gradient tracking" else 1
      for row in summary[g][m]["per_eta"]:
        if row["diverged"]:  # its nodes overflow, are cut out of the graph and send less
          assert m == "gradient tracking" and row["eta_factor"] >= 0.25, (g, m, row)
          continue
        assert row["bytes_per_round"] == pytest.approx(vectors * degree * model_bytes, rel=1e-12), (g, m)
        for reach in row["reach"].values():
          if reach["round"] is not None:
            assert reach["bytes"] == pytest.approx(reach["round"] * row["bytes_per_round"], rel=1e-12)
