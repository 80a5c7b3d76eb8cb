"""Clustered federated learning: K models in the state, each client served by one, averaged per cluster.

IFCA (`fedjax_opt.algorithms.ifca`) and CFL (`fedjax_opt.algorithms.clustered_fl`)
keep K cluster models θ_1 … θ_K stacked as one pytree with leaves `[K, ...]`
and a per-client table `cluster_of` `[N]` int32. A round runs the clients on
their cluster's model (`core.rounds.client_round`) and then averages per cluster:

    S_j     = {k in the round : c(k) = j, w_k > 0, Δ_k finite}
    Δ̄_j     = Aggregator({Δ_k}_{k∈S_j}, {w_k}_{k∈S_j})           (the guard of `core.server`, once per cluster)
    θ_j     ← θ_j + ServerOpt_j(−Δ̄_j)         if S_j ≠ ∅, else θ_j unchanged (model and optimizer state)

The per-cluster average is the library's guarded aggregation
(`core.server.aggregate_updates`) vmapped over the K clusters, each with the
weights of its own clients (w_k 1[c(k) = j]): the library's non-finite rule
(docs/architecture.md, "The round") per cluster, a non-finite client counted
once in `num_nonfinite`, and a cluster that no finite client chose
"rejected", keeping its model; no cluster model ever takes a non-finite
value. The aggregator and server-optimizer states are
stacked `[K, ...]` too. The average is taken over the stacked `[C, ...]`
updates (CFL needs them all for its similarity matrix), so these rounds do
not stream.

A client stage (compression, `fo.aggregators.chain`) runs on each client
inside the round, before the per-cluster average
(`core.rounds.client_round(..., aggregate=...)`). The aggregator's state is
`core.rounds.init_aggregator_state(aggregator, cluster_params, slots=True)`,
the one every algorithm uses: `aggregator.init` per cluster (leaves
`[K, ...]`), and a stage table with a row per client *and cluster* (leaves
`[N, K, ...]`). A client's message touches the entry of the cluster it is
sent to (`ClientOutput.slot`): error feedback delays what a client did not
send to cluster j into its next update to cluster j, never into another
cluster's model.

Also here: the loss of every cluster model on a client's data (IFCA's cluster
choice), the cosine-similarity matrix of the clients' updates and the exact
minimax bipartition of it (CFL's split), and `client_models`, each client's
cluster model as a `[N, ...]` table.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_opt.core.differentiation import refuse_derivative
from fedjax_opt.core.local import as_single_step, masked_mean_loss
from fedjax_opt.core.server import Aggregated, aggregate_updates, apply_server_update
from fedjax_opt.core.types import Aggregator, LossFn, PyTree

__all__ = [
    "adjusted_rand_index", "assignment",
    "ClusterAggregated", "Bipartition", "select", "stack", "perturbed", "cluster_losses", "lowest_loss",
    "aggregate_per_cluster", "apply_per_cluster", "cluster_counts", "most_populated", "client_models",
    "cosine_similarity", "minimax_bipartition", "round_aggregated",
]


def select(cluster_params: PyTree, j: jax.Array) -> PyTree:
  """θ_j: model `j` of the stacked cluster models (leaves `[K, ...]` → `[...]`); `j` may be traced."""
  return jax.tree.map(lambda t: t[j], cluster_params)


def stack(params: PyTree, num_clusters: int) -> PyTree:
  """K copies of `params`, leaves `[K, ...]`."""
  return jax.tree.map(lambda p: jnp.broadcast_to(p, (num_clusters,) + jnp.shape(p)), params)


def perturbed(params: PyTree, key: jax.Array, num_clusters: int, init_noise: Any) -> PyTree:
  """θ_j = params + init_noise · max(std(leaf), 0.01) · ξ_j, ξ_j ~ N(0, I) from `key`: K distinct models, leaves
  `[K, ...]`, the noise scaled to each leaf's spread (FedEM's rule, `fedjax_opt.algorithms.fedem`)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, max(len(leaves), 1))

  def one(leaf, k):
    leaf = jnp.asarray(leaf)
    scale = init_noise * jnp.maximum(jnp.std(leaf), 0.01).astype(leaf.dtype)
    return leaf[None] + scale * jax.random.normal(k, (num_clusters,) + jnp.shape(leaf), leaf.dtype)

  return jax.tree.unflatten(treedef, [one(leaf, k) for leaf, k in zip(leaves, keys)])


def cluster_losses(loss_fn: LossFn, cluster_params: PyTree, data: PyTree, mask: jax.Array) -> jax.Array:
  """F_k(θ_j) for j = 1..K: the mean loss of each cluster model over all the client's real examples `[K]`.

  Args:
    loss_fn: per-example loss.
    cluster_params: leaves `[K, ...]`.
    data: one client's batches, leaves `[S, B, ...]`.
    mask: `[S, B]`.
  """
  folded, folded_mask = as_single_step(data, mask)
  batch = jax.tree.map(lambda a: a[0], folded)
  return jax.vmap(lambda p: masked_mean_loss(loss_fn, p, batch, folded_mask[0])[0])(cluster_params)


def lowest_loss(losses: jax.Array) -> jax.Array:
  """ĵ = argmin_j F_k(θ_j) (int32; ties: the lowest j). A non-finite loss never wins; all non-finite: 0.

  Not differentiable: a derivative reaching `losses` raises (`core.differentiation`).
  """
  losses = refuse_derivative(losses, "the client is assigned to its lowest-loss cluster (an argmin: a run is "
                             "piecewise constant in it)")
  return jnp.argmin(jnp.where(jnp.isfinite(losses), losses, jnp.inf)).astype(jnp.int32)


class ClusterAggregated(NamedTuple):
  """Result of `aggregate_per_cluster`.

  Attributes:
    update: Δ̄_j per cluster, leaves `[K, ...]` (zeros for a rejected cluster).
    state: the aggregator's states, `[K, ...]`.
    finite: `[C]` bool, the clients whose update was finite.
    num_nonfinite: scalar int32, clients taking part whose update was dropped.
    accepted: `[K]` bool, the clusters whose average was applied.
    used: `[C]` bool, the clients aggregated (weight > 0, finite, their cluster accepted).
    counts: `[K]` int32, the clients aggregated into each cluster.
    share: `[K]` float32, Σ_{k∈S_j} w_k / Σ_k w_k over the used clients (0 when none).
  """

  update: PyTree
  state: Any
  finite: jax.Array
  num_nonfinite: jax.Array
  accepted: jax.Array
  used: jax.Array
  counts: jax.Array
  share: jax.Array


def aggregate_per_cluster(aggregator: Aggregator, updates: PyTree, weights: jax.Array, cluster: jax.Array,
                          num_clusters: int, states: Any, key: jax.Array) -> ClusterAggregated:
  """The guarded aggregation of each cluster's clients (module docstring).

  Args:
    aggregator: any `Aggregator`; it is vmapped over the K clusters.
    updates: stacked client updates, leaves `[C, ...]`.
    weights: `[C]` aggregation weights (0: takes no part).
    cluster: `[C]` int, each client's cluster this round, in [0, K).
    num_clusters: K (static).
    states: the aggregator's states stacked `[K, ...]`.
    key: split into one key per cluster.
  """
  member = cluster[None, :] == jnp.arange(num_clusters, dtype=cluster.dtype)[:, None]  # [K, C]
  w = jnp.where(member, weights[None, :], jnp.zeros_like(weights)[None, :])
  keys = jax.random.split(key, num_clusters)
  agg = jax.vmap(lambda wj, sj, kj: aggregate_updates(aggregator, updates, wj, sj, kj))(w, states, keys)
  finite = jnp.all(agg.finite, axis=0)  # as sent, the same in every cluster; as received, judged in its own cluster
  used = (weights > 0) & finite & jnp.any(member & agg.accepted[:, None], axis=0)
  counts = jnp.sum(member & used[None, :], axis=1, dtype=jnp.int32)
  used_w = jnp.where(used, weights, jnp.zeros_like(weights)).astype(jnp.float32)
  share = jnp.sum(jnp.where(member, used_w[None, :], 0.0), axis=1) / jnp.maximum(jnp.sum(used_w), 1e-30)
  return ClusterAggregated(update=agg.update, state=agg.state, finite=finite,
                           num_nonfinite=jnp.sum(agg.num_nonfinite, dtype=jnp.int32), accepted=agg.accepted,
                           used=used, counts=counts, share=share)


def apply_per_cluster(server_optimizer: optax.GradientTransformation, cluster_params: PyTree, opt_states: Any,
                      deltas: PyTree, accepted: jax.Array) -> tuple[PyTree, Any]:
  """θ_j ← θ_j + ServerOpt_j(−Δ̄_j) for every cluster (vmapped `core.server.apply_server_update`); a cluster
  that is not `accepted` keeps its model and optimizer state."""
  return jax.vmap(lambda p, s, d, a: apply_server_update(server_optimizer, p, s, d, a))(
      cluster_params, opt_states, deltas, accepted)


def cluster_counts(cluster_of: jax.Array, num_clusters: int) -> jax.Array:
  """`[K]` int32: how many clients of the table `cluster_of` `[N]` are in each cluster (−1, unassigned, in none)."""
  index = jnp.where(cluster_of >= 0, cluster_of, num_clusters)
  return jnp.zeros((num_clusters,), jnp.int32).at[index].add(1, mode="drop")


def most_populated(cluster_of: jax.Array, num_clusters: int) -> jax.Array:
  """The cluster holding the most clients of `cluster_of` (ties, and no client assigned: the lowest index)."""
  return jnp.argmax(cluster_counts(cluster_of, num_clusters)).astype(jnp.int32)


def client_models(state: Any, client_id: Any = None) -> PyTree:
  """Each client's cluster model: `cluster_params[cluster_of[i]]`, or `state.params` while i is unassigned.

  The per-client view of a clustered state (`state.cluster_params` `[K, ...]`,
  `state.cluster_of` `[N]`), as `fo.personalized_params` gives it for
  algorithms that store per-client models: the whole `[N, ...]` table
  (`client_id` None), one model (an int) or a stack `[C, ...]` (`[C]` ids).
  A client never seen (cluster_of = −1) is served `state.params`, the model
  of the most populated cluster.
  """
  table = client_id is None
  ids = jnp.arange(state.cluster_of.shape[0]) if table else jnp.asarray(client_id, jnp.int32)
  flat = jnp.atleast_1d(ids)
  assigned = state.cluster_of[flat]
  default = jnp.asarray(most_populated(state.cluster_of, jax.tree.leaves(state.cluster_params)[0].shape[0]))
  rows = jax.tree.map(lambda t: t[jnp.where(assigned >= 0, assigned, default)], state.cluster_params)
  return jax.tree.map(lambda r: r[0], rows) if (not table and ids.ndim == 0) else rows


def cosine_similarity(updates: PyTree) -> jax.Array:
  """α_{i,j} = ⟨Δ_i, Δ_j⟩ / (‖Δ_i‖ ‖Δ_j‖) over all leaves, `[C, C]` float32 (0 where a norm is 0)."""
  gram = sum(jnp.einsum("ip,jp->ij", u.reshape(u.shape[0], -1).astype(jnp.float32),
                        u.reshape(u.shape[0], -1).astype(jnp.float32)) for u in jax.tree.leaves(updates))
  norm = jnp.sqrt(jnp.maximum(jnp.diag(gram), 0.0))
  denom = norm[:, None] * norm[None, :]
  return jnp.where(denom > 0, gram / jnp.where(denom > 0, denom, 1.0), 0.0)


class Bipartition(NamedTuple):
  """Result of `minimax_bipartition`.

  Attributes:
    side: `[C]` bool, True on the members split off (c₂), False on the other members (c₁) and on non-members.
    alpha_cross_max: α_max^cross = max_{i∈c₁, j∈c₂} α_{i,j}, the minimum over all bipartitions.
    alpha_intra_min: α_min^intra = min over pairs i ≠ j on the same side of α_{i,j} (1 when no side has a pair).
    gap: the separation gap α_min^intra − α_max^cross.
    valid: scalar bool, the members are at least 2 (else nothing is split and the numbers are 0).
  """

  side: jax.Array
  alpha_cross_max: jax.Array
  alpha_intra_min: jax.Array
  gap: jax.Array
  valid: jax.Array


def minimax_bipartition(similarity: jax.Array, members: jax.Array) -> Bipartition:
  """The bipartition c₁ ∪ c₂ of `members` minimising the largest cross similarity, exactly, inside jit.

      (c₁, c₂) = argmin_{c₁ ∪ c₂ = members} max_{i∈c₁, j∈c₂} α_{i,j}        (Sattler et al., the optimal bipartition)

  The optimum is the single-linkage two-cluster cut: build a maximum spanning
  tree of the members on α (Prim's algorithm, C − 1 steps of O(C) each) and
  remove its weakest edge e. Every bipartition is crossed by some tree edge,
  so its largest cross similarity is ≥ w(e); the cut at e is crossed by no
  edge heavier than w(e) (else the tree would hold that edge instead of e), so
  it attains w(e). With distinct similarities the optimal bipartition is
  unique. c₂ is the subtree below e (the side not holding the first member).

  Args:
    similarity: `[C, C]` symmetric.
    members: `[C]` bool, the clients to split.

  Returns:
    A `Bipartition`.
  """
  c = similarity.shape[0]
  s = similarity.astype(jnp.float32)
  neg = jnp.float32(-jnp.inf)
  root = jnp.argmax(members).astype(jnp.int32)
  in_tree = jnp.zeros((c,), bool).at[root].set(True)
  key = jnp.where(members, s[root], neg).at[root].set(neg)
  parent = jnp.full((c,), root, jnp.int32)
  order = jnp.full((c,), -1, jnp.int32).at[0].set(root)
  edge = jnp.full((c,), jnp.inf, jnp.float32)  # weight of the tree edge (parent[v], v)

  def grow(t, carry):
    in_tree, key, parent, order, edge = carry
    candidates = members & ~in_tree
    v = jnp.argmax(jnp.where(candidates, key, neg)).astype(jnp.int32)
    add = jnp.any(candidates)
    in_tree = in_tree.at[v].set(in_tree[v] | add)
    edge = edge.at[v].set(jnp.where(add, key[v], edge[v]))
    order = order.at[t].set(jnp.where(add, v, -1))
    closer = candidates & (s[v] > key) & add
    closer = closer.at[v].set(False)
    key = jnp.where(closer, s[v], key)
    parent = jnp.where(closer, v, parent)
    return in_tree, key, parent, order, edge

  _, _, parent, order, edge = jax.lax.fori_loop(1, c, grow, (in_tree, key, parent, order, edge))
  tree_edge = members & (jnp.arange(c) != root)
  cut = jnp.argmin(jnp.where(tree_edge, edge, jnp.inf)).astype(jnp.int32)

  def below(t, side):  # nodes in insertion order: a node is below the cut if it is the cut node or its parent is
    v = order[t]
    ok = v >= 0
    vv = jnp.where(ok, v, 0)
    return side.at[vv].set(jnp.where(ok, (vv == cut) | side[parent[vv]], side[vv]))

  side = jax.lax.fori_loop(1, c, below, jnp.zeros((c,), bool))
  valid = jnp.sum(members) >= 2
  side = side & members & valid
  one, two = members & ~side, side
  cross = jnp.max(jnp.where(one[:, None] & two[None, :], s, neg))
  same = ((one[:, None] & one[None, :]) | (two[:, None] & two[None, :])) & ~jnp.eye(c, dtype=bool)
  intra = jnp.where(jnp.any(same), jnp.min(jnp.where(same, s, jnp.inf)), 1.0)
  cross = jnp.where(valid, cross, 0.0)
  intra = jnp.where(valid, intra, 0.0)
  return Bipartition(side=side, alpha_cross_max=cross, alpha_intra_min=intra, gap=intra - cross, valid=valid)


def round_aggregated(agg: ClusterAggregated) -> Aggregated:
  """`agg` as the `core.server.Aggregated` that `core.server.round_metrics` reads: the used clients count as
  the finite ones (a client of a rejected cluster is not aggregated), `update` is the `[K, ...]` stack, and
  `detail` is `agg` itself (what `core.rounds.client_round(..., aggregate=...)` hands back)."""
  return Aggregated(update=agg.update, state=agg.state, finite=agg.used, num_nonfinite=agg.num_nonfinite,
                    accepted=jnp.any(agg.accepted), detail=agg)


def adjusted_rand_index(labels_true: Any, labels_pred: Any) -> float:
  """The adjusted Rand index of two partitions of the same n items (Hubert & Arabie 1985), on the host, float64.

  With the contingency table n_ij (items in class i of `labels_true` and
  cluster j of `labels_pred`), row sums a_i and column sums b_j,

      ARI = (Σ_ij C(n_ij, 2) − E) / (½ (Σ_i C(a_i, 2) + Σ_j C(b_j, 2)) − E),   E = Σ_i C(a_i, 2) Σ_j C(b_j, 2) / C(n, 2).

  1 when the partitions agree up to renaming the clusters, about 0 for a
  random assignment (negative below chance). Two partitions that are both
  trivial (every item alone, or all in one) give 1, as scikit-learn does.
  Labels are any integers (only equality matters).
  """
  import numpy as np  # pylint: disable=import-outside-toplevel

  a = np.asarray(labels_true).reshape(-1)
  b = np.asarray(labels_pred).reshape(-1)
  if a.shape != b.shape:
    raise ValueError(f"adjusted_rand_index: the two labelings must have the same length; got {a.size} and {b.size}.")
  n = a.size
  _, ia = np.unique(a, return_inverse=True)
  _, ib = np.unique(b, return_inverse=True)
  table = np.zeros((ia.max(initial=-1) + 1, ib.max(initial=-1) + 1), np.float64)
  np.add.at(table, (ia, ib), 1.0)
  pairs = lambda m: m * (m - 1) / 2  # noqa: E731
  index = pairs(table).sum()
  rows, cols = pairs(table.sum(axis=1)).sum(), pairs(table.sum(axis=0)).sum()
  expected = rows * cols / pairs(n) if n > 1 else 0.0
  top = 0.5 * (rows + cols)
  if top == expected:  # both partitions trivial (all singletons or one cluster): identical up to renaming
    return 1.0
  return float((index - expected) / (top - expected))


def assignment(state: Any) -> Any:
  """Each client's cluster `[N]` (host int array), or None when the state has no clustering of the clients.

  IFCA and CFL: `cluster_of`. FedEM: the component of largest mixture weight,
  argmax_m π_km (`mixture_weights`); D-FedEM: the same from each node's
  `local_params["weights"]`. What `adjusted_rand_index` scores against planted
  groups (`fo.data.plant_groups`).
  """
  import numpy as np  # pylint: disable=import-outside-toplevel

  if hasattr(state, "cluster_of"):
    return np.asarray(state.cluster_of)
  if hasattr(state, "mixture_weights"):
    return np.argmax(np.asarray(state.mixture_weights), axis=-1)
  local = getattr(state, "local_params", None)
  if isinstance(local, dict) and "weights" in local and "components" in local:
    return np.argmax(np.asarray(local["weights"]), axis=-1)
  return None
