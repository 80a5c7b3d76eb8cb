"""IFCA: the Iterative Federated Clustering Algorithm, K models and each client trains the one that fits it best.

Ghosh, Chung, Yin, Ramchandran. "An Efficient Framework for Clustered
Federated Learning." NeurIPS 2020. arXiv:2006.04088.

The server keeps K cluster models θ_1 … θ_K. One round t with participating
clients M_t (Algorithm 1):

    client i:  ĵ_i = argmin_j F_i(θ_j)                       (the mean loss over the client's examples of the round)
               option I  (gradient averaging):  g_i = ∇F_i(θ_ĵ),                    sends (ĵ_i, g_i)
               option II (model averaging):     θ̃_i = LocalUpdate(θ_ĵ, τ steps),    sends (ĵ_i, θ̃_i)
    server:    S_j = {i ∈ M_t : ĵ_i = j}
               option I:   θ_j ← θ_j − (γ/m) Σ_{i∈S_j} g_i                       (m = |M_t|)
               option II:  θ_j ← Σ_{i∈S_j} θ̃_i / |S_j|          (θ_j unchanged when S_j = ∅)

Here, with weights w_i (`batches.weight`, n_i by default) and Δ_i the
client's update:

    option II (`averaging="model"`):    Δ_i = θ̃_i − θ_ĵ;  θ_j ← θ_j + ServerOpt(−Δ̄_j),
                                        Δ̄_j = Σ_{S_j} w_i Δ_i / Σ_{S_j} w_i (the aggregator of cluster j);
                                        ServerOpt = optax.sgd(1.0) makes θ_j the weighted mean of the θ̃_i.
    option I  (`averaging="gradient"`): Δ_i = −g_i;  θ_j ← θ_j + ServerOpt(−p_j Δ̄_j),  p_j = Σ_{S_j} w_i / Σ_{M_t} w_i;
                                        with ServerOpt = optax.sgd(γ) and equal weights this is the paper's
                                        θ_j − (γ/m) Σ_{S_j} g_i.

Initialization. IFCA converges from an initialization close enough to the
cluster optima (the paper's theory); in its experiments the K models start
at independent random draws, with restarts. `init(params, key)` makes
θ_j = params + σ · max(std(leaf), 0.01) · ξ_j, ξ_j ~ N(0, I) drawn from
`fold_in(key, 1)` (σ = `init_noise`; FedEM's rule): the K models differ from
the first round, so the first cluster choices already separate clients, and
they stay near the user's initialization (a trained or a sensibly scaled
model), the noise in proportion to each leaf's spread. Whether the choices
settle on the true groups depends on that draw, as in the paper: run
restarts (a `jax.vmap` over keys is one program) and keep the one of lowest
training loss, as tests/test_ifca.py does. `initial_models` (leaves `[K, ...]`, e.g. K
independent `model.init` draws, or K warm starts) replaces that when the
problem needs a better start.

State. `cluster_of` `[N]` int32 records each client's last choice ĵ_i (−1
before it first took part); it is written only for a client that took part
(weight > 0, at least one local step), whose update was finite and whose
cluster average was applied. `params` is the model of the most populated
cluster of `cluster_of` (ties: the lowest index; cluster 0 before any
choice), the one model a driver that evaluates `state.params` sees; a
client's own model is its cluster's, `fo.core.clusters.client_models(state, i)`.

Compression. `aggregator=fo.aggregators.chain(fo.compression.compress(C, ...),
rule)` sends C(Δ_i) (option I: C(−g_i)) in place of Δ_i, compressed on the
client before the average of its cluster; the server applies
θ_j ← θ_j + ServerOpt(−Δ̄_j) to the average of what it received. The cluster
choice ĵ_i needs no exact upload: the client makes it itself, on the K
models it receives. ĵ_i is sent as it is (⌈log₂ K⌉ bits, not counted in
`bits_up`, with or without compression). With error feedback a client keeps
one residual per cluster (`core.rounds.init_aggregator_state(...,
slots=True)`, a table `[N, K, ...]`): e_ij ← Δ_i + e_ij − C(Δ_i + e_ij) for
its chosen j only, so
what it did not send to cluster j reaches cluster j later, never another
cluster's model.

Non-finite clients follow the library's rule (docs/architecture.md, "The
round"), applied per cluster by `fedjax_opt.core.clusters`; here a client
whose every loss is non-finite counts as non-finite too. The averages are
taken over the stacked `[C, ...]` updates (no streaming form).
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
from fedjax_opt.core import per_client
from fedjax_opt.core.local import as_single_step, local_train
from fedjax_opt.core.rounds import ClientOutput, client_round, init_aggregator_state
from fedjax_opt.core.server import check_aggregator, initial_round_metrics, round_metrics
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_choice, check_client_batches, check_int, check_key, check_loss_fn,
                                        check_num_clients, check_optimizer, check_positive)

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `ifca` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["IFCAState", "ifca"]

AVERAGING = ("model", "gradient")


@flax.struct.dataclass
class IFCAState:
  """Server state of IFCA.

  Attributes:
    params: the model of the most populated cluster of `cluster_of` (module docstring).
    cluster_params: θ_1 … θ_K, a pytree like params with leaves `[K, ...]`.
    cluster_of: `[N]` int32, each client's last cluster choice ĵ (−1: never took part).
    server_opt_state: the server optimizer's state per cluster (leaves `[K, ...]`).
    aggregator_state: the aggregator's state per cluster (leaves `[K, ...]`); with a client stage a
      `core.types.StagedState` whose table has a row per client and cluster (`[N, K, ...]`).
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` (update_norm: of the K averages together) plus
      `cluster_counts` `[K]` int32, the clients aggregated into each cluster this round.
  """

  params: PyTree
  cluster_params: PyTree
  cluster_of: jax.Array
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _initial_models(params: PyTree, key: jax.Array, num_clusters: int, init_noise: Any,
                    initial_models: PyTree) -> PyTree:
  if initial_models is not None:
    if jax.tree.structure(initial_models) != jax.tree.structure(params):
      raise ValueError("ifca: initial_models must have the structure of params, with a leading [num_clusters] axis.")
    for leaf, p in zip(jax.tree.leaves(initial_models), jax.tree.leaves(params)):
      if tuple(jnp.shape(leaf)) != (num_clusters,) + tuple(jnp.shape(p)):
        raise ValueError(f"ifca: initial_models leaves must be [num_clusters, ...] = {(num_clusters,) + jnp.shape(p)}"
                         f"; got {tuple(jnp.shape(leaf))}.")
    return jax.tree.map(lambda m, p: jnp.asarray(m).astype(jnp.result_type(p)), initial_models, params)
  return clusters.perturbed(params, jax.random.fold_in(key, 1), num_clusters, init_noise)


def ifca(
    loss_fn: LossFn,
    *,
    num_clusters: int,
    num_clients: int,
    averaging: str = "model",
    client_optimizer: optax.GradientTransformation | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
    init_noise: Any = 1.0,
    initial_models: PyTree = None,
    aggregator: aggregators_lib.Aggregator | None = None,
) -> FederatedAlgorithm:
  """IFCA (Ghosh et al. 2020): K cluster models; each client trains the one with its lowest loss; per-cluster averages.

  The paper's hyper-parameters are the number of clusters k, the step size γ
  and the local steps τ: k is `num_clusters`, γ is the server optimizer's
  learning rate (gradient averaging) or the client optimizer's (model
  averaging), τ is the batches' S.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    num_clusters: k ≥ 1, the number of cluster models (static). k = 1 is FedAvg / FedSGD.
    num_clients: N, the rows of `cluster_of` (every `batches.client_id` must be < N).
    averaging: "model" (option II: S local steps of `client_optimizer`, average of the models) or
      "gradient" (option I: one gradient of the client's mean loss over all its examples of the round,
      a server step of `server_optimizer`, e.g. `optax.sgd(γ)`).
    client_optimizer: LocalUpdate's optax optimizer (required with "model"; must be None with "gradient").
    server_optimizer: fed −Δ̄_j per cluster; default `optax.sgd(1.0)` with "model" (the models' average);
      required with "gradient".
    init_noise: σ ≥ 0 of the keyed perturbation θ_j = params + σ · max(std(leaf), 0.01) · ξ_j (module
      docstring; FedEM's rule and name; may be traced).
    initial_models: None, or the K initial models (leaves `[K, ...]`), replacing the perturbation.
    aggregator: the average within a cluster; default `aggregators.weighted_mean()` (by n_i);
      `aggregators.mean()` for the paper's uniform 1/|S_j|. Any aggregator is run once per cluster; one
      chained after a client stage (`fo.aggregators.chain(fo.compression.compress(...), rule)`) averages
      the compressed updates (module docstring).

  Returns:
    `FederatedAlgorithm(init, step)` with state `IFCAState`.
  """
  check_loss_fn(loss_fn)
  num_clusters = check_int(num_clusters, "num_clusters", 1)
  num_clients = check_num_clients(num_clients)
  check_choice(averaging, "averaging", AVERAGING)
  check_positive(init_noise, "init_noise", allow_zero=True)
  if averaging == "model":
    if client_optimizer is None:
      raise TypeError("ifca: averaging='model' needs client_optimizer (LocalUpdate's optax optimizer).")
    check_optimizer(client_optimizer, "client_optimizer")
    server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer
  else:
    if client_optimizer is not None:
      raise ValueError("ifca: averaging='gradient' sends one gradient per client; its step size γ is the "
                       "server_optimizer's (e.g. optax.sgd(γ)); leave client_optimizer None.")
    if server_optimizer is None:
      raise TypeError("ifca: averaging='gradient' needs server_optimizer (e.g. optax.sgd(γ)).")
  check_optimizer(server_optimizer, "server_optimizer")
  aggregator = check_aggregator(aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR))
  mode = client_map_lib.FromPolicy()
  one_gradient = optax.sgd(1.0)

  def client_update(cluster_params, data, mask):
    losses = clusters.cluster_losses(loss_fn, cluster_params, data, mask)
    j = clusters.lowest_loss(losses)
    theta = clusters.select(cluster_params, j)
    if averaging == "model":
      result = local_train(loss_fn, client_optimizer, theta, data, mask)
    else:
      result = local_train(loss_fn, one_gradient, theta, *as_single_step(data, mask))  # Δ_i = −∇F_i(θ_ĵ)
    return ClientOutput(result, extras=j, slot=j)

  def init(params: PyTree, key: jax.Array) -> IFCAState:
    check_key(key)
    cluster_params = _initial_models(params, key, num_clusters, init_noise, initial_models)
    return IFCAState(
        params=clusters.select(cluster_params, 0),
        cluster_params=cluster_params,
        cluster_of=jnp.full((num_clients,), -1, jnp.int32),
        server_opt_state=jax.vmap(server_optimizer.init)(cluster_params),
        aggregator_state=init_aggregator_state(aggregator, cluster_params, slots=True),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={**initial_round_metrics(), "cluster_counts": jnp.zeros((num_clusters,), jnp.int32)},
    )

  def step(state: IFCAState, batches: ClientBatches) -> IFCAState:
    check_client_batches(batches)
    key, agg_key = jax.random.split(state.key)

    def per_cluster(updates, weights, agg_state, agg_key, chosen):
      return clusters.round_aggregated(clusters.aggregate_per_cluster(aggregator, updates, weights, chosen,
                                                                      num_clusters, agg_state, agg_key))

    out = client_round(mode, client_update, state.cluster_params, batches, aggregator=aggregator,
                       aggregator_state=state.aggregator_state, key=agg_key, aggregate=per_cluster)
    chosen = out.extras
    agg = out.agg.detail
    delta = agg.update
    if averaging == "gradient":  # θ_j − γ Σ_{S_j} w_i g_i / Σ_{M_t} w_i
      delta = jax.tree.map(lambda d: d * agg.share.reshape((-1,) + (1,) * (d.ndim - 1)).astype(d.dtype), delta)
    cluster_params, server_opt_state = clusters.apply_per_cluster(
        server_optimizer, state.cluster_params, state.server_opt_state, delta, agg.accepted)
    cluster_of = per_client.scatter(state.cluster_of, batches.client_id, chosen, agg.used).table
    metrics = round_metrics(out.results.loss, out.results.num_examples, out.weights,
                            clusters.round_aggregated(agg._replace(update=delta)), bits_up=out.bits_up,
                            bits_down=out.bits_down)
    return IFCAState(
        params=clusters.select(cluster_params, clusters.most_populated(cluster_of, num_clusters)),
        cluster_params=cluster_params,
        cluster_of=cluster_of,
        server_opt_state=server_opt_state,
        aggregator_state=out.agg.state,
        round=state.round + 1,
        key=key,
        metrics={**metrics, "cluster_counts": agg.counts},
    )

  return FederatedAlgorithm(init, step)


ifca = execution.accepts_policy_keywords(ifca, default_aggregator=_DEFAULT_AGGREGATOR,
    refuses_downlink=(
        "IFCA broadcasts all K cluster models and each client picks the one of lowest loss on them; the downlink "
        "compresses one broadcast model"),
    evaluation="table", exchanges="metrics", hyperparameters={"num_clusters": execution.COUNT,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "server_optimizer": execution.SERVER_OPTIMIZER,
        "init_noise": execution.SCALE})
