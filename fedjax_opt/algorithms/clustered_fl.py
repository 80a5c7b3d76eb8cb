"""Clustered FL (CFL): FedAvg within clusters that split in two when their clients' updates disagree.

Sattler, Müller, Samek. "Clustered Federated Learning: Model-Agnostic
Distributed Multitask Optimization Under Privacy Constraints." IEEE TNNLS
32(8), 2021. arXiv:1910.01991.

All clients start in one cluster. One round with participating clients M
(Algorithm 3 of the paper), for every cluster c with model θ_c:

    client i ∈ c:  Δθ_i = LocalUpdate(θ_c) − θ_c                       (S local steps of the client optimizer)
    server:        Δθ̄_c = Σ_{i∈c} w_i Δθ_i / Σ_{i∈c} w_i                 (FedAvg within c; w_i = n_i by default)
                   if ‖Δθ̄_c‖ < ε₁ and max_{i∈c} ‖Δθ_i‖ > ε₂:               (c is near a stationary point of its
                                                                          mean risk, but not of its clients')
                     α_{i,j} = ⟨Δθ_i, Δθ_j⟩ / (‖Δθ_i‖ ‖Δθ_j‖),  i, j ∈ c
                     c₁, c₂  = argmin_{c₁ ∪ c₂ = c} max_{i∈c₁, j∈c₂} α_{i,j}   (the optimal bipartition)
                     c ← c₁, c' ← c₂ (a new cluster, starting from θ_c)
                   θ_c ← θ_c + ServerOpt(−Δθ̄_c) for every (new) cluster, Δθ̄_c over its own clients

so the two halves of a cluster that splits are averaged separately in the
round of the split already. Splitting is recursive: a cluster made by a
split may split again in a later round. The number of clusters is not
preset; it is bounded by `max_clusters` (a static shape: the cluster models
are stacked `[max_clusters, ...]`, slots not yet used hold a copy of the
first model); a split that would exceed it is not made, and clusters split
in the order of their index. Each side of a split keeps at least one client;
a cluster needs at least 2 participating clients with finite updates to split.

The bipartition. The paper defines it as the argmin above and its reference
code computes it by agglomerative clustering with complete linkage on the
similarity matrix, stopped at two clusters. Here it is the argmin itself,
computed exactly inside jit: the minimax bipartition is the single-linkage
two-cluster cut, i.e. removing the weakest edge of a maximum spanning tree of
α (`fedjax_opt.core.clusters.minimax_bipartition`, checked against a
brute-force search). When the paper's separation gap is positive (every
intra-cluster similarity above every cross one) complete linkage finds the
same two groups; when it is not, the two may differ, and this one is the
optimum of the objective the paper's theorem is about.

The certificate (the paper's Section III): for the bipartition of every
cluster with at least 2 participating clients, every round,

    α_max^cross = max_{i∈c₁, j∈c₂} α_{i,j}      (= min over bipartitions, by construction)
    α_min^intra = min( min_{i≠j∈c₁} α_{i,j}, min_{i≠j∈c₂} α_{i,j} )     (1 when both sides are single clients)
    g(α)        = α_min^intra − α_max^cross     (the separation gap)

The paper's α_min^intra is over the *true* clusters; we take it over the
computed c₁, c₂ (the true ones are unknown). g(α) > 0 says the bipartition
separates the clients into two groups each more similar within than across,
the condition under which the paper's separation theorem guarantees a
correct split. They are reported per cluster in `metrics` (0 for clusters
with fewer than 2 participating clients), together with ‖Δθ̄_c‖, max ‖Δθ_i‖
and which clusters split.

Sampling. The paper uses every client every round: a split sees every
member's update. With partial participation a cluster splits on the members
sampled in that round; the members not sampled stay in c₁ (the cluster keeps
its index), and may only leave it at a later split. Use full participation
(C = N, every client once) for the paper's algorithm; with sampling, a split
is only as good as the sample of that round.

No compression. An aggregator with a client stage
(`fo.aggregators.chain(fo.compression.compress(...), ...)`) is refused: the
split decision reads the exact Δθ_i (their cosine similarities and largest
norm, the quantities of the separation theorem), and the similarities of
compressed updates are those of their compression: two top-k messages
whose supports do not overlap have α = 0 whatever the clients' risks. IFCA
(`fedjax_opt.algorithms.ifca`), whose cluster choice is made by each client
on the models it receives, takes compression.

Non-finite clients follow the library's rule (docs/architecture.md, "The
round"), applied per cluster by `fedjax_opt.core.clusters`; here such a
client is also left out of the split decision and the bipartition (it stays
in its cluster).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import clusters
from fedjax_opt.core import execution
from fedjax_opt.core.differentiation import refuse_derivative
from fedjax_opt.core import per_client
from fedjax_opt.core.local import local_train
from fedjax_opt.core.rounds import ClientOutput, client_round, init_aggregator_state
from fedjax_opt.core.server import (check_aggregator, finite_clients, initial_round_metrics, refuse_client_stage,
                                    round_metrics, zero_rows)
from fedjax_opt.core.tree import tree_bits
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_int, check_key, check_loss_fn, check_num_clients,
                                        check_optimizer, check_positive)

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `clustered_fl` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["ClusteredFLState", "clustered_fl"]

CLUSTER_METRICS = {
    "num_clusters": jnp.int32,
    "cluster_counts": jnp.int32,
    "split": jnp.bool_,
    "mean_update_norm": jnp.float32,
    "max_update_norm": jnp.float32,
    "alpha_cross_max": jnp.float32,
    "alpha_intra_min": jnp.float32,
    "separation_gap": jnp.float32,
}
"""CFL's metrics besides `core.server.ROUND_METRICS`: `num_clusters` (after the round) a scalar, the others `[K]`
per cluster slot: `cluster_counts` the clients aggregated into each cluster (after the round's splits); for each
cluster as it was before the round's splits, whether it split, ‖Δθ̄_c‖, max_{i∈c} ‖Δθ_i‖ and the certificate of
its bipartition (module docstring; 0 for a cluster with fewer than 2 participating clients)."""


@flax.struct.dataclass
class ClusteredFLState:
  """Server state of CFL.

  Attributes:
    params: the model of the most populated cluster (ties: the lowest index); before any split, θ of the one cluster.
    cluster_params: θ_c per cluster slot, leaves `[K, ...]` (K = max_clusters; slots ≥ num_clusters unused).
    cluster_of: `[N]` int32, each client's cluster (all 0 at the start).
    num_clusters: int32, the clusters in use (slots 0 … num_clusters − 1).
    server_opt_state: the server optimizer's state per cluster slot (leaves `[K, ...]`).
    aggregator_state: the aggregator's state per cluster slot (leaves `[K, ...]`).
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` (update_norm: of the averages of all clusters together) and
      `CLUSTER_METRICS`.
  """

  params: PyTree
  cluster_params: PyTree
  cluster_of: jax.Array
  num_clusters: jax.Array
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _norms(updates: PyTree) -> jax.Array:
  """`[C]` ‖Δ_i‖₂ of stacked updates."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(u.reshape(u.shape[0], -1).astype(jnp.float32)), axis=1)
                      for u in jax.tree.leaves(updates)))


def clustered_fl(
    loss_fn: LossFn,
    *,
    eps_1: Any,
    eps_2: Any,
    max_clusters: int,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: aggregators_lib.Aggregator | None = None,
) -> FederatedAlgorithm:
  """CFL (Sattler et al. 2020): FedAvg per cluster; a cluster at a stationary point of its mean splits in two.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    eps_1: ε₁ > 0, a cluster may split only when the norm of its mean update ‖Δθ̄_c‖ < ε₁ (may be traced).
    eps_2: ε₂ ≥ 0, ... and its largest client update max_i ‖Δθ_i‖ > ε₂ (may be traced). Both are in the
      units of a round's update (client step size × local steps × gradient).
    max_clusters: the most clusters there may be (static, ≥ 1; 1 is FedAvg).
    num_clients: N, the rows of `cluster_of` (every `batches.client_id` must be < N).
    client_optimizer: the local steps' optax optimizer, re-initialized on every client every round.
    server_optimizer: fed −Δθ̄_c per cluster; default `optax.sgd(1.0)` (FedAvg within the cluster).
    aggregator: the average within a cluster; default `aggregators.weighted_mean()` (the paper's
      |D_i|/|D_c| weights). Run once per cluster slot.

  Returns:
    `FederatedAlgorithm(init, step)` with state `ClusteredFLState`.
  """
  check_loss_fn(loss_fn)
  check_positive(eps_1, "eps_1")
  check_positive(eps_2, "eps_2", allow_zero=True)
  max_clusters = check_int(max_clusters, "max_clusters", 1)
  num_clients = check_num_clients(num_clients)
  check_optimizer(client_optimizer, "client_optimizer")
  server_optimizer = check_optimizer(optax.sgd(1.0) if server_optimizer is None else server_optimizer,
                                     "server_optimizer")
  aggregator = check_aggregator(aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR))
  refuse_client_stage(aggregator, "clustered_fl", "its split is decided on the clients' exact updates (the "
                      "cosine similarities α_ij and max_i ‖Δθ_i‖ of the separation theorem); compressed updates "
                      "(top-k supports that barely overlap, signs) would split on the compression error.")
  mode = client_map_lib.FromPolicy()
  k = max_clusters

  def client_update(cluster_params, data, mask, c):
    result = local_train(loss_fn, client_optimizer, clusters.select(cluster_params, c), data, mask)
    return ClientOutput(result, rows=(c,), writes=jnp.zeros((), bool))  # the row is read, never written here

  def init(params: PyTree, key: jax.Array) -> ClusteredFLState:
    check_key(key)
    cluster_params = clusters.stack(params, k)
    return ClusteredFLState(
        params=params,
        cluster_params=cluster_params,
        cluster_of=jnp.zeros((num_clients,), jnp.int32),
        num_clusters=jnp.ones((), jnp.int32),
        server_opt_state=jax.vmap(server_optimizer.init)(cluster_params),
        aggregator_state=init_aggregator_state(aggregator, cluster_params, slots=True),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={**initial_round_metrics(),
                 **{name: jnp.zeros(() if name == "num_clusters" else (k,), dt)
                    for name, dt in CLUSTER_METRICS.items()}},
    )

  def step(state: ClusteredFLState, batches: ClientBatches) -> ClusteredFLState:
    check_client_batches(batches)
    key, agg_key = jax.random.split(state.key)
    out = client_round(mode, client_update, state.cluster_params, batches, tables=(state.cluster_of,))
    updates, weights = out.results.delta, out.weights
    cluster = per_client.gather(state.cluster_of, batches.client_id)
    cluster = jnp.clip(cluster, 0, k - 1)
    norms = _norms(updates)
    finite, _ = finite_clients(updates, norms)  # an update whose norm overflows is dropped too
    taking_part = (weights > 0) & finite
    member = (cluster[None, :] == jnp.arange(k)[:, None]) & taking_part[None, :]  # [K, C]

    # Δθ̄_c before any split: the split criterion (the weighted mean of the finite members, as the paper's).
    w = jnp.where(member, weights[None, :], 0.0).astype(jnp.float32)
    clean = zero_rows(finite, updates)
    flat = jnp.concatenate([u.reshape(u.shape[0], -1).astype(jnp.float32) for u in jax.tree.leaves(clean)], axis=1)
    mean_update = (w @ flat) / jnp.maximum(jnp.sum(w, axis=1, keepdims=True), 1e-30)
    mean_norm = jnp.linalg.norm(mean_update, axis=1)
    max_norm = jnp.max(jnp.where(member, jnp.where(finite, norms, 0.0)[None, :], 0.0), axis=1)

    # The split test and the bipartition are discrete decisions on the clients' updates.
    mean_norm, max_norm, clean = refuse_derivative(
        (mean_norm, max_norm, clean),
        "CFL's split test (ε₁, ε₂ thresholds) and minimax bipartition (a run is piecewise constant in them)")
    similarity = clusters.cosine_similarity(clean)
    parts = jax.vmap(lambda m: clusters.minimax_bipartition(similarity, m))(member)  # fields [K, ...]
    in_use = jnp.arange(k) < state.num_clusters
    wants = in_use & parts.valid & (mean_norm < eps_1) & (max_norm > eps_2)
    slot = state.num_clusters + jnp.cumsum(wants.astype(jnp.int32)) - 1
    split = wants & (slot < k)
    new_slot = jnp.where(split, slot, k)  # k: no new cluster (dropped by the scatters below)
    # The new clusters start from their parent's model and optimizer state.
    source = jnp.arange(k).at[new_slot].set(jnp.arange(k), mode="drop")
    cluster_params = jax.tree.map(lambda t: t[source], state.cluster_params)
    opt_state = jax.tree.map(lambda t: t[source], state.server_opt_state)
    agg_state = jax.tree.map(lambda t: t[source], state.aggregator_state)
    moves = split[cluster] & parts.side[cluster, jnp.arange(cluster.shape[0])] & taking_part
    now = jnp.where(moves, new_slot[cluster], cluster).astype(jnp.int32)

    agg = clusters.aggregate_per_cluster(aggregator, updates, weights, now, k, agg_state, agg_key)
    cluster_params, opt_state = clusters.apply_per_cluster(server_optimizer, cluster_params, opt_state, agg.update,
                                                           agg.accepted)
    cluster_of = per_client.scatter(state.cluster_of, batches.client_id, now, moves).table
    num_clusters = state.num_clusters + jnp.sum(split, dtype=jnp.int32)
    metrics = round_metrics(out.results.loss, out.results.num_examples, weights, clusters.round_aggregated(agg),
                            bits_up=out.bits_up, bits_down=jnp.float32(tree_bits(state.params)))
    cluster_metrics = {
        "num_clusters": num_clusters, "cluster_counts": agg.counts, "split": split, "mean_update_norm": mean_norm,
        "max_update_norm": max_norm, "alpha_cross_max": parts.alpha_cross_max,
        "alpha_intra_min": parts.alpha_intra_min, "separation_gap": parts.gap,
    }
    return ClusteredFLState(
        params=clusters.select(cluster_params, clusters.most_populated(cluster_of, k)),
        cluster_params=cluster_params,
        cluster_of=cluster_of,
        num_clusters=num_clusters,
        server_opt_state=opt_state,
        aggregator_state=agg.state,
        round=state.round + 1,
        key=key,
        metrics={**metrics, **{name: jnp.asarray(cluster_metrics[name]).astype(dt)
                               for name, dt in CLUSTER_METRICS.items()}},
    )

  return FederatedAlgorithm(init, step)


clustered_fl = execution.accepts_policy_keywords(clustered_fl, default_aggregator=_DEFAULT_AGGREGATOR,
    refuses_downlink=(
        "CFL broadcasts one model per cluster and splits clusters on the updates from those exact models; the "
        "downlink compresses one broadcast model"),
    evaluation="table", exchanges=(1, 1), hyperparameters={"eps_1": execution.THRESHOLD, "eps_2": execution.THRESHOLD,
        "max_clusters": execution.COUNT, "client_optimizer": execution.CLIENT_OPTIMIZER,
        "server_optimizer": execution.SERVER_OPTIMIZER})
