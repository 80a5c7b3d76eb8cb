"""Communication graphs: hand-made cases and scipy.sparse.csgraph as the independent reference."""

import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.csgraph

from fedjax_opt import graphs


def _scipy_components(g):
  return scipy.sparse.csgraph.connected_components(scipy.sparse.csr_matrix(g.adjacency), directed=False)


def test_chain_and_ring_by_hand():
  c = graphs.chain(4)
  np.testing.assert_array_equal(c.edges, [[0, 1], [1, 2], [2, 3]])
  np.testing.assert_array_equal(graphs.degrees(c), [1, 2, 2, 1])
  np.testing.assert_array_equal(graphs.laplacian(c), [[1, -1, 0, 0], [-1, 2, -1, 0], [0, -1, 2, -1], [0, 0, -1, 1]])
  r = graphs.ring(5)
  np.testing.assert_array_equal(r.edges, [[0, 1], [0, 4], [1, 2], [2, 3], [3, 4]])
  np.testing.assert_array_equal(graphs.degrees(r), [2] * 5)
  assert graphs.chain(1).num_edges == 0 and graphs.is_connected(graphs.chain(1))


def test_edges_and_adjacency_round_trip_and_merge_duplicates():
  g = graphs.from_edges([[2, 0], [0, 2], [1, 3], [3, 1], [0, 1]], num_nodes=5)
  np.testing.assert_array_equal(g.edges, [[0, 1], [0, 2], [1, 3]])
  h = graphs.from_adjacency(g.adjacency.astype(float))
  assert h.num_nodes == 5
  np.testing.assert_array_equal(h.edges, g.edges)
  np.testing.assert_array_equal(g.neighbors(0), [1, 2])
  lap = graphs.laplacian(g)
  np.testing.assert_allclose(lap @ np.ones(5), 0)
  assert np.all(np.linalg.eigvalsh(lap) > -1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_connectivity_agrees_with_scipy_csgraph(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 12))
  upper = np.triu(rng.random((n, n)) < 0.2, 1)
  g = graphs.from_adjacency(upper | upper.T)
  count, labels = graphs.connected_components(g)
  ref_count, ref_labels = _scipy_components(g)
  assert count == ref_count and graphs.is_connected(g) == (ref_count == 1)
  # Same partition (labels may be numbered differently).
  assert np.array_equal(labels[:, None] == labels[None], ref_labels[:, None] == ref_labels[None])


def test_two_coloring_of_bipartite_graphs():
  np.testing.assert_array_equal(graphs.two_coloring(graphs.chain(5)), [0, 1, 0, 1, 0])
  np.testing.assert_array_equal(graphs.two_coloring(graphs.ring(6)), [0, 1, 0, 1, 0, 1])
  assert graphs.is_bipartite(graphs.ring(4)) and not graphs.is_bipartite(graphs.ring(5))


@pytest.mark.parametrize("seed", range(4))
def test_random_bipartite_is_connected_and_bipartite_with_the_given_sides(seed):
  g = graphs.random_bipartite(4, 6, 0.3, seed=seed)
  assert g.num_nodes == 10 and _scipy_components(g)[0] == 1
  colour = graphs.two_coloring(g)
  side = np.arange(10) >= 4
  assert np.all(side[g.edges[:, 0]] != side[g.edges[:, 1]])
  assert np.array_equal(colour == colour[0], side == side[0])  # colour classes are the two sides


def test_invalid_graphs_raise_clear_errors():
  with pytest.raises(ValueError, match=r"must be bipartite .* edge \(\d, \d\) closes an odd cycle"):
    graphs.two_coloring(graphs.ring(5))
  with pytest.raises(ValueError, match=r"graph must be connected .* 2 components, e.g. node 0 cannot reach node 2"):
    graphs.check_connected(graphs.from_edges([[0, 1], [2, 3]]))
  graphs.check_connected(graphs.ring(3))
  with pytest.raises(ValueError, match=r"self-loop at node 1"):
    graphs.from_edges([[1, 1]])
  with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
    graphs.from_edges([[0, 3]], num_nodes=3)
  with pytest.raises(ValueError, match=r"shape \[E, 2\]"):
    graphs.from_edges([[0, 1, 2]])
  with pytest.raises(ValueError, match=r"symmetric"):
    graphs.from_adjacency([[0, 1], [0, 0]])
  with pytest.raises(ValueError, match=r"zero diagonal"):
    graphs.from_adjacency([[1, 0], [0, 0]])
  with pytest.raises(ValueError, match=r"num_nodes must be >= 3"):
    graphs.ring(2)
  with pytest.raises(ValueError, match=r"edge_prob must lie in \[0, 1\]"):
    graphs.random_bipartite(2, 2, 1.5)


def test_weighted_laplacian_matches_scipy():
  """graphs.laplacian of a weighted graph (with_weights) equals scipy.sparse.csgraph.laplacian of its adjacency."""
  graph = graphs.random_bipartite(4, 5, 0.6, seed=3)
  weights = np.random.default_rng(0).uniform(0.1, 2.0, graph.num_edges)
  edges = np.asarray(graph.edges)
  adjacency = scipy.sparse.coo_matrix((weights, (edges[:, 0], edges[:, 1])), shape=(9, 9))
  expected = scipy.sparse.csgraph.laplacian((adjacency + adjacency.T).toarray())
  np.testing.assert_allclose(graphs.laplacian(graphs.with_weights(graph, weights)), expected, atol=1e-12)
  np.testing.assert_allclose(graphs.laplacian(graphs.with_weights(graph, np.ones(graph.num_edges))),
                             graphs.laplacian(graph), atol=0)
