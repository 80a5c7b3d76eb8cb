"""Mixing matrices and the new graph builders: hand-computed matrices, closed-form spectra, numpy.linalg as reference."""

import numpy as np
import pytest

from fedjax_opt import graphs


def _star_plus_edge():
  """Node 0 joined to 1, 2, 3, and the edge (2, 3): degrees 3, 1, 2, 2."""
  return graphs.from_edges([[0, 1], [0, 2], [0, 3], [2, 3]])


def test_metropolis_hastings_weights_by_hand():
  w = graphs.metropolis_hastings(_star_plus_edge())
  # W_ij = 1/(1 + max(d_i, d_j)): edges at node 0 weigh 1/4, the edge (2, 3) 1/3; the diagonal fills each row.
  want = np.array([[1 / 4, 1 / 4, 1 / 4, 1 / 4],
                   [1 / 4, 3 / 4, 0, 0],
                   [1 / 4, 0, 5 / 12, 1 / 3],
                   [1 / 4, 0, 1 / 3, 5 / 12]])
  np.testing.assert_allclose(w, want, atol=1e-15)
  np.testing.assert_allclose(graphs.metropolis_hastings(_star_plus_edge(), lazy=True), (np.eye(4) + want) / 2,
                             atol=1e-15)


def test_uniform_degree_weights_by_hand():
  w = graphs.uniform_degree(_star_plus_edge())
  # d_max = 3: every edge weighs 1/4, W_ii = 1 − d_i/4.
  want = np.array([[1 / 4, 1 / 4, 1 / 4, 1 / 4],
                   [1 / 4, 3 / 4, 0, 0],
                   [1 / 4, 0, 1 / 2, 1 / 4],
                   [1 / 4, 0, 1 / 4, 1 / 2]])
  np.testing.assert_allclose(w, want, atol=1e-15)
  np.testing.assert_allclose(graphs.uniform_degree(_star_plus_edge(), lazy=True), (np.eye(4) + want) / 2, atol=1e-15)
  # The complete graph: W = I − (nI − J)/n = J/n, exact averaging in one round.
  np.testing.assert_allclose(graphs.uniform_degree(graphs.complete(5)), np.full((5, 5), 0.2), atol=1e-15)
  assert graphs.spectral_gap(graphs.uniform_degree(graphs.complete(5))) == pytest.approx(1.0)


def test_a_graph_carries_its_mixing_rule_and_its_edge_weights():
  """`mixing_matrix` applies the graph's rule (Metropolis–Hastings by default, the by-hand matrices above); the
  rules ignore edge weights, which only the Laplacian reads; an explicit matrix passes through."""
  g = _star_plus_edge()
  assert g.mixing_rule == "metropolis_hastings" and g.weights is None
  np.testing.assert_array_equal(graphs.mixing_matrix(g), graphs.metropolis_hastings(g))
  for rule, want in (("uniform_degree", graphs.uniform_degree(g)),
                     ("lazy_metropolis_hastings", graphs.metropolis_hastings(g, lazy=True)),
                     ("lazy_uniform_degree", graphs.uniform_degree(g, lazy=True))):
    np.testing.assert_array_equal(graphs.mixing_matrix(graphs.with_mixing_rule(g, rule)), want)
  weighted = graphs.with_weights(graphs.with_mixing_rule(g, "uniform_degree"), [1.0, 2.0, 3.0, 4.0])
  np.testing.assert_array_equal(graphs.mixing_matrix(weighted), graphs.uniform_degree(g))
  assert graphs.laplacian(weighted)[2, 3] == -4.0
  w = graphs.random_matchings(g, 3)
  np.testing.assert_array_equal(graphs.mixing_matrix(w), w)
  with pytest.raises(ValueError, match="mixing_rule must be one of"):
    graphs.with_mixing_rule(g, "max_degree")
  with pytest.raises(ValueError, match="mixing_rule must be one of"):
    graphs.mixing_matrix(g._replace(mixing_rule="max_degree"))
  with pytest.raises(ValueError, match=r"weights must have shape \[E\] = \(4,\)"):
    graphs.with_weights(g, [1.0, 2.0])
  with pytest.raises(ValueError, match="finite and >= 0"):
    graphs.with_weights(g, [1.0, np.nan, 1.0, 1.0])
  with pytest.raises(TypeError, match="Graph"):
    graphs.with_mixing_rule(np.eye(4), "uniform_degree")


@pytest.mark.parametrize("n", [5, 6, 9])
def test_spectral_gap_of_a_ring_matches_its_closed_form(n):
  """Metropolis on a ring is I/3 + A/3, eigenvalues 1/3 + (2/3) cos(2πk/n); the gap also agrees with eigvalsh."""
  w = graphs.metropolis_hastings(graphs.ring(n))
  np.testing.assert_allclose(w, np.eye(n) / 3 + graphs.ring(n).adjacency / 3, atol=1e-15)
  moduli = np.abs(1 / 3 + 2 / 3 * np.cos(2 * np.pi * np.arange(1, n) / n))
  assert graphs.spectral_gap(w) == pytest.approx(1 - moduli.max(), abs=1e-12)
  eig = np.sort(np.abs(np.linalg.eigvalsh(w)))
  assert graphs.spectral_gap(w) == pytest.approx(1 - eig[-2], abs=1e-12)


def test_builders_by_hand():
  t = graphs.torus(3, 4)
  assert t.num_nodes == 12 and t.num_edges == 24
  np.testing.assert_array_equal(graphs.degrees(t), [4] * 12)
  np.testing.assert_array_equal(t.neighbors(0), [1, 3, 4, 8])  # right, left (wrap), down, up (wrap)
  np.testing.assert_array_equal(graphs.torus(1, 5).edges, graphs.ring(5).edges)
  np.testing.assert_array_equal(graphs.degrees(graphs.torus(2, 3)), [3] * 6)  # the two vertical neighbours coincide
  e = graphs.exponential(8)
  np.testing.assert_array_equal(e.neighbors(0), [1, 2, 4, 6, 7])  # 0 ± 1, ± 2, ± 4 mod 8
  np.testing.assert_array_equal(graphs.degrees(e), [5] * 8)
  assert graphs.exponential(5).num_edges == 10  # ±1, ±2, ±4 ≡ ∓1 mod 5: complete
  c = graphs.complete(5)
  assert c.num_edges == 10 and np.all(graphs.degrees(c) == 4)
  np.testing.assert_array_equal(graphs.complete(1).edges.shape, (0, 2))


def test_erdos_renyi_is_connected_reproducible_and_errors_when_it_cannot_be():
  g = graphs.erdos_renyi(20, 0.25, seed=3)
  assert graphs.is_connected(g) and g.num_nodes == 20
  np.testing.assert_array_equal(g.edges, graphs.erdos_renyi(20, 0.25, seed=3).edges)
  assert not np.array_equal(g.adjacency, graphs.erdos_renyi(20, 0.25, seed=4).adjacency)
  np.testing.assert_array_equal(graphs.erdos_renyi(6, 1.0).edges, graphs.complete(6).edges)
  with pytest.raises(ValueError, match="no connected graph in 5 tries"):
    graphs.erdos_renyi(10, 0.0, max_tries=5)
  with pytest.raises(ValueError, match="edge_prob"):
    graphs.erdos_renyi(10, 1.5)


@pytest.mark.parametrize("graph", [graphs.chain(5), graphs.ring(6), graphs.torus(3, 4), graphs.exponential(8),
                                   graphs.complete(5), graphs.erdos_renyi(12, 0.3, seed=1), _star_plus_edge()])
def test_every_builder_gives_valid_mixing_matrices(graph):
  for build in (graphs.metropolis_hastings, graphs.uniform_degree):
    for lazy in (False, True):
      w = graphs.check_mixing_matrix(build(graph, lazy=lazy))
      np.testing.assert_allclose(w, w.T, atol=1e-15)
      np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)
      off = ~np.eye(graph.num_nodes, dtype=bool)
      np.testing.assert_array_equal((w > 0) & off, graph.adjacency)  # weights exactly on the edges
      eig = np.linalg.eigvalsh(w)
      assert graphs.spectral_gap(w) == pytest.approx(1 - np.sort(np.abs(eig))[-2], abs=1e-12)
      if lazy:
        assert eig.min() >= -1e-12  # (I + W)/2 has eigenvalues in [0, 1]


def test_random_matchings_are_maximal_matchings_of_the_graph():
  g = graphs.torus(3, 3)
  seq = graphs.random_matchings(g, 12, seed=0)
  assert seq.shape == (12, 9, 9)
  np.testing.assert_array_equal(seq, graphs.random_matchings(g, 12, seed=0))
  adjacency = g.adjacency
  for w in seq:
    off = w - np.diag(np.diag(w))
    np.testing.assert_allclose(w, w.T)
    np.testing.assert_allclose(w.sum(1), 1)
    assert set(np.unique(w)) <= {0.0, 0.5, 1.0}
    assert np.all(adjacency[off > 0])  # only edges of the graph
    matched = (off > 0).sum(1)
    assert matched.max() <= 1  # a matching: at most one partner each
    np.testing.assert_array_equal(np.diag(w), np.where(matched == 1, 0.5, 1.0))
    free = matched == 0
    assert not np.any(adjacency & free[:, None] & free[None, :])  # maximal: no edge between two free nodes
  # An int n matches on the complete graph.
  assert graphs.random_matchings(4, 3, seed=1).shape == (3, 4, 4)
  assert np.all(graphs.random_matchings(4, 3, seed=1).sum(1) == 1)


def test_spectral_gap_of_a_sequence_is_that_of_one_period():
  seq = graphs.random_matchings(graphs.ring(6), 20, seed=2)
  product = np.linalg.multi_dot(seq[::-1])  # W_19 ⋯ W_0
  want = 1 - np.linalg.svd(product - np.full((6, 6), 1 / 6), compute_uv=False)[0]
  assert graphs.spectral_gap(seq) == pytest.approx(want, abs=1e-12)
  assert graphs.spectral_gap(seq) > 0
  graphs.check_mixing_matrix(seq)
  w = graphs.metropolis_hastings(graphs.ring(7))
  assert graphs.spectral_gap(w[None]) == pytest.approx(graphs.spectral_gap(w), abs=1e-12)
  with pytest.raises(ValueError, match="disconnected"):
    graphs.check_mixing_matrix(seq[:1])  # one matching never connects a ring


def test_check_mixing_matrix_names_what_is_wrong():
  w = graphs.metropolis_hastings(graphs.ring(4))
  with pytest.raises(ValueError, match=r"symmetric.*entry \(0, 1\)"):
    bad = w.copy()
    bad[0, 1], bad[0, 0] = bad[0, 1] + 0.1, bad[0, 0] - 0.1
    graphs.check_mixing_matrix(bad)
  with pytest.raises(ValueError, match="doubly stochastic.*row 0 sums to 0.9"):
    graphs.check_mixing_matrix(w - 0.1 * np.eye(4))
  with pytest.raises(ValueError, match=r"nonnegative.*\(0, 1\) is -0.5"):
    graphs.check_mixing_matrix(np.array([[1.5, -0.5], [-0.5, 1.5]]))
  with pytest.raises(ValueError, match="disconnected.*node 0 never exchanges anything with node 2"):
    graphs.check_mixing_matrix(np.kron(np.eye(2), np.full((2, 2), 0.5)))
  with pytest.raises(ValueError, match="periodic"):
    graphs.check_mixing_matrix(np.array([[0.0, 1.0], [1.0, 0.0]]))
  graphs.check_mixing_matrix(np.array([[0.5, 0.5], [0.5, 0.5]]))
  with pytest.raises(ValueError, match="square"):
    graphs.check_mixing_matrix(np.ones((2, 3)) / 3)
  with pytest.raises(ValueError, match="finite"):
    graphs.check_mixing_matrix(np.full((2, 2), np.nan))
  with pytest.raises(ValueError, match=r"mixing\[1\] must be doubly stochastic"):
    graphs.check_mixing_matrix(np.stack([w, 0.5 * w]))
  with pytest.raises(TypeError, match="Graph"):
    graphs.metropolis_hastings(np.eye(3))
