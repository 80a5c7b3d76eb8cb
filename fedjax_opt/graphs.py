"""Communication graphs for decentralized and ADMM methods: plain NumPy on the host.

A graph is static structure (it fixes who talks to whom, hence shapes and
index arrays inside jit), so it is built and checked once in Python, before
tracing. `Graph` holds an undirected simple graph on nodes 0 … n−1:

* `edges` `[E, 2]` int64, each undirected edge once as (i, j) with i < j,
  sorted lexicographically;
* `adjacency` `[n, n]` bool, symmetric, False on the diagonal.

Builders: `chain(n)` (0 − 1 − … − n−1, the GADMM topology), `ring(n)`,
`random_bipartite(num_left, num_right, edge_prob, seed)` (connected by
construction), `from_edges`, `from_adjacency`.

Checks used by the graph-based algorithms (GADMM splits the workers into a
head and a tail group, which needs a connected bipartite graph):

* degree d_i = Σ_j A_ij and the Laplacian L = D − A;
* `connected_components` / `is_connected` / `check_connected`;
* `two_coloring`: colours c_i ∈ {0, 1} with c_i ≠ c_j on every edge, found by
  breadth-first search; it raises a ValueError naming an edge that closes an
  odd cycle when the graph is not bipartite. `is_bipartite` is its boolean form.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Graph", "chain", "ring", "random_bipartite", "from_edges", "from_adjacency", "degrees", "laplacian",
    "connected_components", "is_connected", "check_connected", "two_coloring", "is_bipartite",
]


class Graph(NamedTuple):
  """An undirected simple graph on nodes 0 … num_nodes − 1.

  Attributes:
    num_nodes: n.
    edges: `[E, 2]` int64, each edge once as (i, j) with i < j, sorted.
  """

  num_nodes: int
  edges: np.ndarray

  @property
  def num_edges(self) -> int:
    """E."""
    return int(self.edges.shape[0])

  @property
  def adjacency(self) -> np.ndarray:
    """`[n, n]` bool adjacency matrix A (symmetric, zero diagonal)."""
    a = np.zeros((self.num_nodes, self.num_nodes), bool)
    a[self.edges[:, 0], self.edges[:, 1]] = True
    a[self.edges[:, 1], self.edges[:, 0]] = True
    return a

  def neighbors(self, node: int) -> np.ndarray:
    """Sorted neighbours of `node`."""
    return np.flatnonzero(self.adjacency[node])


def _check_num_nodes(num_nodes: Any, minimum: int = 1) -> int:
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)):
    raise TypeError(f"num_nodes must be a Python int; got {type(num_nodes).__name__}.")
  if num_nodes < minimum:
    raise ValueError(f"num_nodes must be >= {minimum}; got {num_nodes}.")
  return int(num_nodes)


def from_edges(edges: Any, num_nodes: int | None = None) -> Graph:
  """A graph from an edge list `[E, 2]` of node ids (either orientation; duplicates merged).

  Args:
    edges: `[E, 2]` integer node ids; (i, j) and (j, i) are the same edge.
    num_nodes: n; None takes max id + 1 (isolated trailing nodes need it given).

  Raises:
    ValueError: wrong shape, a self-loop, or an id outside [0, num_nodes).
  """
  e = np.asarray(edges)
  if e.size == 0:
    e = e.reshape(0, 2)
  if e.ndim != 2 or e.shape[1] != 2:
    raise ValueError(f"edges must have shape [E, 2]; got {e.shape}.")
  if e.size and not np.issubdtype(e.dtype, np.integer):
    raise TypeError(f"edges must hold integer node ids; got dtype {e.dtype}.")
  e = e.astype(np.int64)
  if num_nodes is None:
    if not e.size:
      raise ValueError("num_nodes must be given for a graph with no edges.")
    num_nodes = int(e.max()) + 1
  n = _check_num_nodes(num_nodes)
  if e.size and (e.min() < 0 or e.max() >= n):
    raise ValueError(f"edges hold node ids outside [0, {n}): min {e.min()}, max {e.max()}.")
  loops = e[:, 0] == e[:, 1]
  if np.any(loops):
    raise ValueError(f"edges hold a self-loop at node {int(e[loops][0, 0])}; graphs here are simple.")
  e = np.unique(np.sort(e, axis=1), axis=0).reshape(-1, 2)
  return Graph(n, e)


def from_adjacency(adjacency: Any) -> Graph:
  """A graph from a symmetric `[n, n]` adjacency matrix (nonzero = edge, zero diagonal).

  Raises:
    ValueError: not square, not symmetric, or a nonzero diagonal entry.
  """
  a = np.asarray(adjacency)
  if a.ndim != 2 or a.shape[0] != a.shape[1]:
    raise ValueError(f"adjacency must be a square [n, n] matrix; got shape {a.shape}.")
  a = a != 0
  if not np.array_equal(a, a.T):
    i, j = np.argwhere(a != a.T)[0]
    raise ValueError(f"adjacency must be symmetric (undirected graph); A[{i}, {j}] != A[{j}, {i}].")
  if np.any(np.diag(a)):
    raise ValueError(f"adjacency must have a zero diagonal (no self-loops); node {int(np.flatnonzero(np.diag(a))[0])}.")
  return Graph(a.shape[0], np.argwhere(np.triu(a, 1)).astype(np.int64).reshape(-1, 2))


def chain(num_nodes: int) -> Graph:
  """The path 0 − 1 − … − (n−1): n − 1 edges (GADMM's chain of workers)."""
  n = _check_num_nodes(num_nodes)
  i = np.arange(n - 1, dtype=np.int64)
  return Graph(n, np.stack([i, i + 1], axis=1).reshape(-1, 2))


def ring(num_nodes: int) -> Graph:
  """The cycle 0 − 1 − … − (n−1) − 0 (n ≥ 3); bipartite exactly when n is even."""
  n = _check_num_nodes(num_nodes, minimum=3)
  i = np.arange(n, dtype=np.int64)
  return from_edges(np.stack([i, (i + 1) % n], axis=1), n)


def random_bipartite(num_left: int, num_right: int, edge_prob: float, seed: int | np.random.Generator = 0) -> Graph:
  """A random connected bipartite graph: left nodes 0 … num_left−1, right nodes after them.

  A random spanning tree whose every edge joins the two sides makes the graph
  connected; each other left–right pair is then an edge with probability
  `edge_prob`. No edge ever joins two nodes of the same side.

  Args:
    num_left, num_right: sizes of the two colour classes (both >= 1).
    edge_prob: p ∈ [0, 1], probability of each extra cross edge.
    seed: int seed or a NumPy Generator.
  """
  num_left = _check_num_nodes(num_left)
  num_right = _check_num_nodes(num_right)
  if not 0.0 <= edge_prob <= 1.0:
    raise ValueError(f"edge_prob must lie in [0, 1]; got {edge_prob}.")
  rng = np.random.default_rng(seed)
  n = num_left + num_right
  side = np.arange(n) >= num_left
  left, right = rng.permutation(num_left), num_left + rng.permutation(num_right)
  tree = [(left[0], right[0])]
  in_tree = {False: [int(left[0])], True: [int(right[0])]}
  for v in rng.permutation(np.concatenate([left[1:], right[1:]])):
    others = in_tree[not side[v]]
    tree.append((int(v), others[rng.integers(len(others))]))
    in_tree[bool(side[v])].append(int(v))
  extra = rng.random((num_left, num_right)) < edge_prob
  cross = np.argwhere(extra) + np.array([0, num_left])
  return from_edges(np.concatenate([np.array(tree, np.int64).reshape(-1, 2), cross.astype(np.int64)]), n)


def degrees(graph: Graph) -> np.ndarray:
  """`[n]` int64 node degrees d_i = Σ_j A_ij."""
  return np.bincount(graph.edges.reshape(-1), minlength=graph.num_nodes).astype(np.int64)


def laplacian(graph: Graph, weights: Any = None) -> np.ndarray:
  """`[n, n]` float64 graph Laplacian L = D − A (symmetric, PSD, L·1 = 0).

  `weights` `[E]` (in the order of `graph.edges`) gives the weighted
  Laplacian, L_ij = −a_ij and L_ii = Σ_j a_ij; None: every edge weighs 1.
  """
  if weights is None:
    return np.diag(degrees(graph).astype(np.float64)) - graph.adjacency.astype(np.float64)
  edges = np.asarray(graph.edges).reshape(-1, 2)
  w = np.asarray(weights, np.float64)
  lap = np.zeros((graph.num_nodes, graph.num_nodes))
  np.add.at(lap, (edges[:, 0], edges[:, 1]), -w)
  np.add.at(lap, (edges[:, 1], edges[:, 0]), -w)
  lap[np.diag_indices_from(lap)] = -lap.sum(1)
  return lap


def connected_components(graph: Graph) -> tuple[int, np.ndarray]:
  """(number of components, `[n]` int64 component label of each node, labelled 0, 1, … in order of first node)."""
  labels = np.full(graph.num_nodes, -1, np.int64)
  neighbors = _neighbor_lists(graph)
  count = 0
  for start in range(graph.num_nodes):
    if labels[start] >= 0:
      continue
    labels[start] = count
    queue = collections.deque([start])
    while queue:
      u = queue.popleft()
      for v in neighbors[u]:
        if labels[v] < 0:
          labels[v] = count
          queue.append(v)
    count += 1
  return count, labels


def is_connected(graph: Graph) -> bool:
  """True when every node reaches every other (a single node is connected)."""
  return connected_components(graph)[0] == 1


def check_connected(graph: Graph, name: str = "graph") -> None:
  """Raises ValueError naming two nodes that cannot reach each other when `graph` is disconnected."""
  count, labels = connected_components(graph)
  if count > 1:
    other = int(np.flatnonzero(labels != 0)[0])
    raise ValueError(
        f"{name} must be connected (consensus needs every node to reach every other); it has {count} components, "
        f"e.g. node 0 cannot reach node {other}.")


def two_coloring(graph: Graph, name: str = "graph") -> np.ndarray:
  """Colours `[n]` int64 in {0, 1} with different colours at the two ends of every edge.

  Each connected component is coloured by breadth-first search from its
  smallest node, which gets colour 0 (so node 0 is always colour 0).

  Raises:
    ValueError: the graph is not bipartite; the message names an edge whose
      two ends got the same colour (it closes an odd cycle).
  """
  colour = np.full(graph.num_nodes, -1, np.int64)
  neighbors = _neighbor_lists(graph)
  for start in range(graph.num_nodes):
    if colour[start] >= 0:
      continue
    colour[start] = 0
    queue = collections.deque([start])
    while queue:
      u = queue.popleft()
      for v in neighbors[u]:
        if colour[v] < 0:
          colour[v] = 1 - colour[u]
          queue.append(v)
        elif colour[v] == colour[u]:
          raise ValueError(
              f"{name} must be bipartite (two groups with edges only between them), but edge ({u}, {v}) "
              f"closes an odd cycle.")
  return colour


def is_bipartite(graph: Graph) -> bool:
  """True when `two_coloring` succeeds."""
  try:
    two_coloring(graph)
  except ValueError:
    return False
  return True


def _neighbor_lists(graph: Graph) -> list[list[int]]:
  lists: list[list[int]] = [[] for _ in range(graph.num_nodes)]
  for i, j in graph.edges.tolist():
    lists[i].append(j)
    lists[j].append(i)
  return lists
