"""Communication graphs for decentralized and ADMM methods: plain NumPy on the host.

A graph is static structure (it fixes who talks to whom, hence shapes and
index arrays inside jit), so it is built and checked once in Python, before
tracing. `Graph` holds an undirected simple graph on nodes 0 … n−1:

* `edges` `[E, 2]` int64, each undirected edge once as (i, j) with i < j,
  sorted lexicographically;
* `adjacency` `[n, n]` bool, symmetric, False on the diagonal;
* `weights` `[E]` (optional), a_ij ≥ 0 for each row of `edges` (FedU's
  Laplacian penalty, `laplacian`); None: every edge weighs 1. Set it with
  `with_weights(graph, weights)`;
* `mixing_rule`, how the gossip algorithms turn the graph into a mixing
  matrix (`mixing_matrix`): one of `MIXING_RULES`, default
  "metropolis_hastings". Set it with `with_mixing_rule(graph, rule)`.

A graph is what every graph-based factory of `fedjax_opt.algorithms` takes
as `graph=`.

Builders: `chain(n)` (0 − 1 − … − n−1, the GADMM topology), `ring(n)`,
`complete(n)`, `torus(rows, cols)` (the 2-D grid with wrap-around),
`exponential(n)` (i ~ i ± 2^k mod n), `erdos_renyi(n, p, seed)` (G(n, p),
re-drawn until connected), `random_bipartite(num_left, num_right, edge_prob,
seed)` (connected by construction), `from_edges`, `from_adjacency`.

Checks used by the graph-based algorithms (GADMM splits the workers into a
head and a tail group, which needs a connected bipartite graph):

* degree d_i = Σ_j A_ij and the Laplacian L = D − A;
* `connected_components` / `is_connected` / `check_connected`;
* `two_coloring`: colours c_i ∈ {0, 1} with c_i ≠ c_j on every edge, found by
  breadth-first search; it raises a ValueError naming an edge that closes an
  odd cycle when the graph is not bipartite. `is_bipartite` is its boolean form.

Mixing matrices for gossip and decentralized optimization
(`fedjax_opt.algorithms.decentralized`). A mixing matrix W `[n, n]` is
symmetric, nonnegative and doubly stochastic (W 1 = 1, 1ᵀW = 1ᵀ), with
W_ij > 0 only on edges and the diagonal; one gossip round is x ← W x. Its
spectral gap 1 − max(|λ₂|, |λ_n|) (eigenvalues 1 = λ₁ ≥ λ₂ ≥ … ≥ λ_n) sets the
speed of consensus: ‖W x − x̄1‖ ≤ (1 − gap) ‖x − x̄1‖, and the gap is 0 when the
graph is disconnected (λ₂ = 1) or W is periodic (λ_n = −1, e.g. a bipartite
graph with a zero diagonal).

* `mixing_matrix(graph)`: W by the graph's `mixing_rule` (what the gossip
  algorithms use; an explicit W or sequence may be passed as `graph=` instead,
  and `mixing_matrix` returns it as it is);
* `metropolis_hastings(graph)`: W_ij = 1 / (1 + max(d_i, d_j)) on every edge,
  W_ii = 1 − Σ_{j≠i} W_ij (needs only the two degrees of an edge: local);
* `uniform_degree(graph)`: W = I − L / (d_max + 1), every edge weighs 1 / (d_max + 1);
* `lazy=True` on either: (I + W) / 2, eigenvalues in [0, 1] (never periodic);
* `random_matchings(graph_or_n, num_rounds, seed)`: a time-varying sequence
  `[T, n, n]`, each W_t a random maximal matching of the graph's edges whose
  matched pairs average, W_t = I − ½ Σ_{(i,j)∈M_t} (e_i − e_j)(e_i − e_j)ᵀ;
* `spectral_gap(W)`: 1 − max(|λ₂|, |λ_n|) for `[n, n]`; for a sequence
  `[T, n, n]`, the gap of one period, 1 − ‖W_{T−1} ⋯ W_0 − 11ᵀ/n‖₂ (the
  contraction of the disagreement over T rounds; for one symmetric W the two agree);
* `check_mixing_matrix(W)`: a ValueError naming the entry or the node when W
  (or a W_t) is not square, not finite, negative, not symmetric, not doubly
  stochastic, or has spectral gap 0 (disconnected, or periodic).
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Graph", "chain", "ring", "complete", "torus", "exponential", "erdos_renyi", "random_bipartite", "from_edges",
    "from_adjacency", "degrees", "laplacian", "connected_components", "is_connected", "check_connected",
    "two_coloring", "is_bipartite", "metropolis_hastings", "uniform_degree", "random_matchings", "spectral_gap",
    "check_mixing_matrix", "MIXING_RULES", "mixing_matrix", "with_mixing_rule", "with_weights",
]

MIXING_RULES = ("metropolis_hastings", "uniform_degree", "lazy_metropolis_hastings", "lazy_uniform_degree")
"""The names of `Graph.mixing_rule`: `metropolis_hastings(graph)`, `uniform_degree(graph)`, and their `lazy=True`
forms (I + W) / 2."""


class Graph(NamedTuple):
  """An undirected simple graph on nodes 0 … num_nodes − 1.

  Attributes:
    num_nodes: n.
    edges: `[E, 2]` int64, each edge once as (i, j) with i < j, sorted.
    weights: `[E]` a_ij ≥ 0, one per row of `edges` (FedU, `laplacian`), or None: every edge weighs 1.
      Set by `with_weights`, which checks it.
    mixing_rule: the rule `mixing_matrix` applies (the gossip algorithms), one of `MIXING_RULES`; default
      "metropolis_hastings". Set by `with_mixing_rule`.
  """

  num_nodes: int
  edges: np.ndarray
  weights: Any = None
  mixing_rule: str = "metropolis_hastings"

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


def complete(num_nodes: int) -> Graph:
  """The complete graph K_n: every pair of the n nodes is an edge (n(n − 1)/2 edges)."""
  n = _check_num_nodes(num_nodes)
  i, j = np.triu_indices(n, 1)
  return Graph(n, np.stack([i, j], axis=1).astype(np.int64).reshape(-1, 2))


def torus(rows: int, cols: int) -> Graph:
  """The rows × cols grid with wrap-around: node r·cols + c joins (r ± 1 mod rows, c) and (r, c ± 1 mod cols).

  With both sides ≥ 3 every node has degree 4. A side of 2 makes the two
  wrap-around neighbours along it the same node (one edge), and a side of 1
  has no edge along it (it would be a self-loop): `torus(1, n)` is `ring(n)`.
  """
  rows = _check_num_nodes(rows)
  cols = _check_num_nodes(cols)
  r, c = np.divmod(np.arange(rows * cols, dtype=np.int64), cols)
  down = ((r + 1) % rows) * cols + c
  right = r * cols + (c + 1) % cols
  node = r * cols + c
  edges = np.concatenate([np.stack([node, down], axis=1), np.stack([node, right], axis=1)])
  return from_edges(edges[edges[:, 0] != edges[:, 1]].reshape(-1, 2), rows * cols)


def exponential(num_nodes: int) -> Graph:
  """The exponential graph: node i joins i ± 2^k mod n for every k with 2^k < n (n ≥ 2).

  Degree about 2 log₂ n and a spectral gap that shrinks only like 1 / log n,
  a common topology for decentralized deep learning.
  """
  n = _check_num_nodes(num_nodes, minimum=2)
  i = np.arange(n, dtype=np.int64)
  hops = [1 << k for k in range(n.bit_length()) if (1 << k) < n]
  return from_edges(np.concatenate([np.stack([i, (i + h) % n], axis=1) for h in hops]), n)


def erdos_renyi(num_nodes: int, edge_prob: float, seed: int | np.random.Generator = 0, *,
                max_tries: int = 100) -> Graph:
  """A connected Erdős–Rényi graph G(n, p): each pair is an edge with probability p, re-drawn until connected.

  Draws from one generator, so the result is a function of `seed`. The
  result is G(n, p) conditioned on being connected.

  Args:
    num_nodes: n ≥ 1.
    edge_prob: p ∈ [0, 1].
    seed: int seed or a NumPy Generator.
    max_tries: draws before giving up.

  Raises:
    ValueError: p outside [0, 1], or no connected draw in `max_tries` tries
      (p too small for n: G(n, p) is connected with high probability only
      for p above about ln(n) / n).
  """
  n = _check_num_nodes(num_nodes)
  if not 0.0 <= edge_prob <= 1.0:
    raise ValueError(f"edge_prob must lie in [0, 1]; got {edge_prob}.")
  if isinstance(max_tries, bool) or not isinstance(max_tries, (int, np.integer)) or max_tries < 1:
    raise ValueError(f"max_tries must be a Python int >= 1; got {max_tries!r}.")
  rng = np.random.default_rng(seed)
  i, j = np.triu_indices(n, 1)
  for _ in range(int(max_tries)):
    keep = rng.random(i.shape[0]) < edge_prob
    graph = Graph(n, np.stack([i[keep], j[keep]], axis=1).astype(np.int64).reshape(-1, 2))
    if is_connected(graph):
      return graph
  raise ValueError(
      f"erdos_renyi({n}, {edge_prob}) drew no connected graph in {max_tries} tries; raise edge_prob (G(n, p) "
      f"is connected with high probability for p above about ln(n)/n = {np.log(max(n, 2)) / n:.3g}).")


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


def with_weights(graph: Graph, weights: Any) -> Graph:
  """`graph` with per-edge weights a_ij `[E]`, one per row of `graph.edges` (None: every edge weighs 1 again).

  The weights are kept as given (a JAX array, even a traced one, stays one);
  their shape is always checked, their values when they are concrete.

  Raises:
    TypeError: `graph` is not a `Graph`.
    ValueError: the shape is not `[E]`, or a concrete weight is negative or not finite.
  """
  graph = _check_graph(graph)
  if weights is None:
    return graph._replace(weights=None)
  if tuple(np.shape(weights)) != (graph.num_edges,):
    raise ValueError(f"weights must have shape [E] = ({graph.num_edges},), one weight per row of graph.edges; "
                     f"got shape {tuple(np.shape(weights))}.")
  try:
    w = np.asarray(weights)
  except Exception:  # pylint: disable=broad-except  (a traced array: checked by shape only)
    w = None
  if w is not None and (not np.issubdtype(w.dtype, np.number) or not np.all(np.isfinite(w)) or np.any(w < 0)):
    raise ValueError(f"weights must be finite and >= 0; got {w}.")
  return graph._replace(weights=weights)


def laplacian(graph: Graph) -> np.ndarray:
  """`[n, n]` float64 graph Laplacian L = D − A (symmetric, PSD, L·1 = 0).

  With `graph.weights` a_ij (`with_weights`) it is the weighted Laplacian,
  L_ij = −a_ij and L_ii = Σ_j a_ij; without, every edge weighs 1.
  """
  weights = graph.weights
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


# ----------------------------------------------------------------------------- mixing matrices


def _lazy(w: np.ndarray, lazy: bool) -> np.ndarray:
  return 0.5 * (np.eye(w.shape[0]) + w) if lazy else w


def _check_graph(graph: Any) -> Graph:
  if not isinstance(graph, Graph):
    raise TypeError(f"graph must be a fedjax_opt.graphs.Graph (e.g. graphs.ring(n)); got {type(graph).__name__}.")
  return graph


def with_mixing_rule(graph: Graph, rule: str) -> Graph:
  """`graph` mixed by `rule` (one of `MIXING_RULES`) when a gossip algorithm is given it as `graph=`.

  Raises:
    TypeError: `graph` is not a `Graph`.
    ValueError: `rule` is not one of `MIXING_RULES`.
  """
  graph = _check_graph(graph)
  if rule not in MIXING_RULES:
    raise ValueError(f"mixing_rule must be one of {', '.join(MIXING_RULES)}; got {rule!r}.")
  return graph._replace(mixing_rule=rule)


def mixing_matrix(graph: Graph | Any) -> np.ndarray:
  """The mixing matrix W `[n, n]` float64 of `graph` by its `mixing_rule` (default Metropolis–Hastings).

  Anything a gossip algorithm takes as `graph=` works: an explicit matrix `[n, n]` or sequence `[T, n, n]` is
  returned as float64, unchecked (`check_mixing_matrix` checks it).

  Raises:
    ValueError: `graph.mixing_rule` is not one of `MIXING_RULES`.
  """
  if not isinstance(graph, Graph):
    return np.asarray(graph, np.float64)
  rule = graph.mixing_rule
  if rule not in MIXING_RULES:
    raise ValueError(f"mixing_rule must be one of {', '.join(MIXING_RULES)}; got {rule!r}.")
  lazy = rule.startswith("lazy_")
  build = metropolis_hastings if rule.removeprefix("lazy_") == "metropolis_hastings" else uniform_degree
  return build(graph, lazy=lazy)


def metropolis_hastings(graph: Graph, lazy: bool = False) -> np.ndarray:
  """Metropolis–Hastings weights `[n, n]` float64: W_ij = 1/(1 + max(d_i, d_j)) on edges, W_ii = 1 − Σ_{j≠i} W_ij.

  Symmetric and doubly stochastic on any graph, with W_ii ≥ 1 / (1 + d_i) > 0
  (so never periodic); each node needs only its neighbours' degrees.

  Args:
    graph: the communication graph.
    lazy: return (I + W) / 2 instead.
  """
  graph = _check_graph(graph)
  d = degrees(graph).astype(np.float64)
  w = np.zeros((graph.num_nodes, graph.num_nodes))
  i, j = graph.edges[:, 0], graph.edges[:, 1]
  weight = 1.0 / (1.0 + np.maximum(d[i], d[j]))
  w[i, j] = weight
  w[j, i] = weight
  w[np.diag_indices_from(w)] = 1.0 - w.sum(axis=1)
  return _lazy(w, lazy)


def uniform_degree(graph: Graph, lazy: bool = False) -> np.ndarray:
  """W = I − L / (d_max + 1) `[n, n]` float64: every edge weighs 1 / (d_max + 1), the diagonal fills the row.

  Args:
    graph: the communication graph (L its Laplacian, d_max its largest degree).
    lazy: return (I + W) / 2 instead.
  """
  graph = _check_graph(graph)
  d_max = int(degrees(graph).max()) if graph.num_nodes else 0
  return _lazy(np.eye(graph.num_nodes) - laplacian(graph._replace(weights=None)) / (d_max + 1.0), lazy)


def random_matchings(graph_or_n: Graph | int, num_rounds: int, seed: int | np.random.Generator = 0) -> np.ndarray:
  """A time-varying sequence `[T, n, n]` of gossip matrices, one random maximal matching per round.

  Round t takes the edges in a random order and keeps each one whose two
  ends are still free (a random maximal matching M_t); the matched pairs
  average, W_t = I − ½ Σ_{(i,j)∈M_t} (e_i − e_j)(e_i − e_j)ᵀ: W_t[i, i] =
  W_t[i, j] = ½ for (i, j) ∈ M_t, unmatched nodes keep their value. Every W_t
  is symmetric and doubly stochastic, but one matching never connects the
  graph: only a run of rounds does (`spectral_gap` of the sequence).

  Args:
    graph_or_n: the graph whose edges may be matched, or n for the complete graph K_n.
    num_rounds: T ≥ 1.
    seed: int seed or a NumPy Generator.
  """
  graph = complete(graph_or_n) if not isinstance(graph_or_n, Graph) else graph_or_n
  if isinstance(num_rounds, bool) or not isinstance(num_rounds, (int, np.integer)) or num_rounds < 1:
    raise ValueError(f"num_rounds must be a Python int >= 1; got {num_rounds!r}.")
  rng = np.random.default_rng(seed)
  n = graph.num_nodes
  out = np.zeros((int(num_rounds), n, n))
  for t in range(int(num_rounds)):
    free = np.ones(n, bool)
    w = out[t]
    w[np.diag_indices(n)] = 1.0
    for i, j in graph.edges[rng.permutation(graph.num_edges)].tolist():
      if free[i] and free[j]:
        free[i] = free[j] = False
        w[i, i] = w[j, j] = w[i, j] = w[j, i] = 0.5
  return out


def spectral_gap(mixing: Any) -> float:
  """1 − max(|λ₂|, |λ_n|) of a mixing matrix `[n, n]`; for a sequence `[T, n, n]`, of one period.

  For one matrix the eigenvalues are those of `numpy.linalg.eigvalsh` when W
  is symmetric (general eigenvalues otherwise), sorted by modulus; the gap is
  1 minus the second largest modulus. For a sequence it is
  1 − ‖W_{T−1} ⋯ W_1 W_0 − 11ᵀ/n‖₂, the guaranteed contraction of the
  disagreement x − x̄1 over one period (equal to the former for T = 1 and a
  symmetric doubly stochastic W). A single node has gap 1.
  """
  w = np.asarray(mixing, np.float64)
  if w.ndim == 3:
    n = w.shape[-1]
    product = np.eye(n)
    for wt in w:
      product = wt @ product
    return float(1.0 - np.linalg.norm(product - np.full((n, n), 1.0 / n), 2)) if n > 1 else 1.0
  if w.ndim != 2 or w.shape[0] != w.shape[1]:
    raise ValueError(f"mixing must be a square [n, n] matrix or a sequence [T, n, n]; got shape {w.shape}.")
  if w.shape[0] == 1:
    return 1.0
  eig = np.linalg.eigvalsh(w) if np.allclose(w, w.T) else np.linalg.eigvals(w)
  return float(1.0 - np.sort(np.abs(eig))[-2])


def check_mixing_matrix(mixing: Any, name: str = "mixing", *, atol: float = 1e-6) -> np.ndarray:
  """Checks a gossip matrix `[n, n]` (or a sequence `[T, n, n]`); returns it as float64.

  Every W (every W_t) must be square, finite, nonnegative, symmetric and
  doubly stochastic (rows sum to 1 within `atol`), and the spectral gap
  (`spectral_gap`, over one period for a sequence) must exceed `atol`.

  Raises:
    ValueError: naming the first offending entry, row or node: a negative
      entry, an asymmetric pair, a row that does not sum to 1, or a gap of 0,
      which means the graph of W (its nonzero off-diagonal entries, over the
      period) is disconnected — the message names two nodes that never
      exchange anything — or, if it is connected, that W is periodic (an
      eigenvalue −1, as on a bipartite graph with a zero diagonal: use
      lazy weights (I + W) / 2).
  """
  w = np.asarray(mixing)
  if w.ndim not in (2, 3) or w.shape[-1] != w.shape[-2] or w.shape[-1] == 0:
    raise ValueError(f"{name} must be a square [n, n] mixing matrix or a sequence [T, n, n]; got shape {w.shape}.")
  if w.ndim == 3 and w.shape[0] == 0:
    raise ValueError(f"{name} must hold at least one mixing matrix; got shape {w.shape}.")
  if not np.issubdtype(w.dtype, np.number) or np.issubdtype(w.dtype, np.complexfloating):
    raise TypeError(f"{name} must hold real numbers; got dtype {w.dtype}.")
  w = w.astype(np.float64)
  seq = w if w.ndim == 3 else w[None]
  for t, wt in enumerate(seq):
    where = f"{name}[{t}]" if w.ndim == 3 else name
    if not np.all(np.isfinite(wt)):
      i, j = np.argwhere(~np.isfinite(wt))[0]
      raise ValueError(f"{where} must be finite; entry ({i}, {j}) is {wt[i, j]}.")
    if np.any(wt < -atol):
      i, j = np.argwhere(wt < -atol)[0]
      raise ValueError(f"{where} must be nonnegative (weights of a convex combination); entry ({i}, {j}) is "
                       f"{wt[i, j]:.6g}.")
    if not np.allclose(wt, wt.T, rtol=0.0, atol=atol):
      i, j = np.unravel_index(np.argmax(np.abs(wt - wt.T)), wt.shape)
      raise ValueError(f"{where} must be symmetric (W_ij = W_ji: each edge weighs the same both ways); entry "
                       f"({i}, {j}) is {wt[i, j]:.6g} but ({j}, {i}) is {wt[j, i]:.6g}.")
    rows = wt.sum(axis=1)
    if not np.allclose(rows, 1.0, rtol=0.0, atol=atol):
      i = int(np.argmax(np.abs(rows - 1.0)))
      raise ValueError(f"{where} must be doubly stochastic (every row and column sums to 1, so gossip keeps the "
                       f"average); row {i} sums to {rows[i]:.6g}.")
  if spectral_gap(w) <= atol:
    support = np.any(np.abs(seq) > atol, axis=0)
    support[np.diag_indices_from(support)] = False
    count, labels = connected_components(from_adjacency(support | support.T))
    if count > 1:
      other = int(np.flatnonzero(labels != 0)[0])
      raise ValueError(f"{name} has spectral gap 0: its graph is disconnected ({count} components; node 0 never "
                       f"exchanges anything with node {other}), so the nodes cannot reach consensus.")
    raise ValueError(f"{name} has spectral gap 0 although its graph is connected: it is periodic (an eigenvalue "
                     f"-1, e.g. a bipartite graph with a zero diagonal); use lazy weights (I + W) / 2.")
  return w


def _neighbor_lists(graph: Graph) -> list[list[int]]:
  lists: list[list[int]] = [[] for _ in range(graph.num_nodes)]
  for i, j in graph.edges.tolist():
    lists[i].append(j)
    lists[j].append(i)
  return lists
