"""FedU: federated multi-task learning with Laplacian regularization.

Dinh, Vu, Tran, Dao, Zhang. "FedU: A Unified Framework for Federated
Multi-Task Learning with Laplacian Regularization." arXiv:2102.07148, 2021;
journal version: "A New Look and Convergence Rate of Federated Multi-Task
Learning with Laplacian Regularization", IEEE TNNLS.

Client i keeps its own model x_i; neighbouring clients on a graph with edge
weights a_ij ≥ 0 (the graph's `weights`, `fedjax_opt.graphs.with_weights`;
default 1) are pulled together:

    min_{x_1 … x_N}  F(x) = Σ_i f_i(x_i) + (λ/2) Σ_{(i,j)∈E} a_ij ‖x_i − x_j‖²,

    ∂F/∂x_i = ∇f_i(x_i) + λ Σ_{j∈N(i)} a_ij (x_i − x_j) = ∇f_i(x_i) + λ ((L ⊗ I) x)_i,

with L = D − A the weighted graph Laplacian. The penalty counts each undirected
edge once; a formulation that sums over ordered pairs (i, j ∈ N(i)) counts
every edge twice, so its λ is half of the λ here. One round t (Algorithm 1 of the
paper), with the sampled clients S_t:

    client i ∈ S_t:  y_i = R local SGD steps x ← x − η ∇f_i(x; D_r) from x_i      (`core.local.local_train`)
    server:          x_i ← y_i − η λ R Σ_{j∈N(i)} a_ij (z_i − z_j),   i ∈ S_t

The Laplacian step has the size η λ R of R regularizer steps, because the
regularizer is applied once per R data steps. Where it is evaluated
(`regularizer_at`):

* "local" (default, the paper's Algorithm 1): z = the models after the local
  steps, z_i = y_i. A neighbour that did not take part contributes its stored
  model x_j (the last one it sent); the authors' code sums over sampled
  neighbours only, which is the same under full participation.
* "start": z = the models at the start of the round, z_j = x_j (a Jacobi
  step). With R = 1 full-batch step and full participation a round is then
  exactly one gradient step x ← x − η ∇F(x), so its fixed points are the
  stationary points of F: ∇f_i(x_i) + λ Σ_j a_ij (x_i − x_j) = 0.

With "local" and R = 1 full-batch steps the fixed point of a round is not F's
stationary point but satisfies (I − ηλL ⊗ I) ∇f(x) + λ (L ⊗ I) x = 0 (on
quadratics, one block linear solve; tests/test_fedu.py): the gap to F's
stationarity is ηλ (L ⊗ I) ∇f(x) = O(η). λ = 0 gives purely local training;
on a connected graph λ → ∞ drives every x_i to the consensus minimiser of
Σ_i f_i.

Stability of the Laplacian step alone needs η λ R ‖L‖ < 2, i.e.
η λ R · λ_max(L) < 2 (λ_max(L) ≤ 2 max_i Σ_j a_ij).

State: `state.local_params` is the table of the x_i (leaves `[N, ...]`,
read with `fo.personalized_params(state, client_id)`); `state.params` is their
uniform average (1/N) Σ_i x_i, for a global evaluation. The local steps are
`core.rounds.client_round` without an aggregator (the server does not
average updates), on the model-dtype view of the table so that the Laplacian
sees unrounded rows: a client that takes no part under the library's rules
(docs/architecture.md, "The round") is not updated and does not enter the
Laplacian with a new model. `metrics`
holds `core.server.ROUND_METRICS` (update_norm: the change of the average
model) and `laplacian_penalty`, (λ/2) Σ_E a_ij ‖x_i − x_j‖² after the round.
"""

from __future__ import annotations

import warnings
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt import graphs as graphs_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import per_client
from fedjax_opt.core.local import local_train
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.server import initial_round_metrics
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_choice, check_client_batches, check_int, check_key, check_loss_fn,
                                        check_num_clients, check_positive, is_concrete)
from fedjax_opt.objectives import average

__all__ = ["FedUState", "REGULARIZER_POINTS", "fedu", "laplacian_penalty", "laplacian_step_bound"]

REGULARIZER_POINTS = ("local", "start")


@flax.struct.dataclass
class FedUState:
  """Server state of FedU.

  Attributes:
    params: (1/N) Σ_i x_i, the average of the personalized models.
    local_params: the x_i, a per-client table (leaves `[N, ...]`).
    round: t, rounds applied, int32.
    key: PRNG key (FedU draws nothing; kept for the common state contract).
    metrics: `core.server.ROUND_METRICS` plus `laplacian_penalty`.
  """

  params: PyTree
  local_params: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _check_graph(graph: Any) -> graphs_lib.Graph:
  if not isinstance(graph, graphs_lib.Graph):
    raise TypeError(f"graph must be a fedjax_opt.graphs.Graph (e.g. graphs.ring(n)); got {type(graph).__name__}.")
  return graph


def _edge_weights(graph: graphs_lib.Graph) -> jax.Array:
  """a_ij `[E]`: `graph.weights` in the order of `graph.edges` (ones when None), checked when concrete."""
  weights = _check_graph(graph).weights
  if weights is None:
    return jnp.ones((graph.num_edges,))
  if tuple(jnp.shape(weights)) != (graph.num_edges,):
    raise ValueError(f"graph.weights must have shape [E] = ({graph.num_edges},), one weight per row of "
                     f"graph.edges; got shape {tuple(jnp.shape(weights))}.")
  if is_concrete(weights):
    w = np.asarray(weights)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
      raise ValueError(f"graph.weights must be finite and >= 0; got {w}.")
  return jnp.asarray(weights)


def laplacian_step_bound(graph: graphs_lib.Graph) -> float:
  """2 / λ_max(L) for the Laplacian L of `graph` (weighted by `graph.weights`): the step ηλR must stay below it.

  The Laplacian step x ← x − ηλR (L ⊗ I) x alone is stable (non-expansive on
  the disagreement between clients) iff ηλR·λ_max(L) ≤ 2.
  """
  _edge_weights(graph)  # the shape and values, checked
  lap = graphs_lib.laplacian(graph)
  top = float(np.max(np.linalg.eigvalsh(lap), initial=0.0))  # 0 for a graph without edges (or nodes)
  return float("inf") if top <= 0 else 2.0 / top


def _laplacian_times(table: PyTree, edges: np.ndarray, weights: jax.Array) -> PyTree:
  """(L ⊗ I) z per leaf: row i = Σ_{j∈N(i)} a_ij (z_i − z_j), with L the weighted Laplacian of `edges`."""
  n = per_client.num_rows(table)
  head, tail = jnp.asarray(edges[:, 0]), jnp.asarray(edges[:, 1])

  def leaf(z):
    w = weights.astype(z.dtype).reshape((-1,) + (1,) * (z.ndim - 1))
    diff = w * (z[head] - z[tail])
    return jax.ops.segment_sum(diff, head, n) - jax.ops.segment_sum(diff, tail, n)

  return jax.tree.map(leaf, table)


def laplacian_penalty(table: PyTree, graph: graphs_lib.Graph, lam: Any) -> jax.Array:
  """(λ/2) Σ_{(i,j)∈E} a_ij ‖x_i − x_j‖² (a_ij = `graph.weights`) for a table with leaves `[N, ...]`."""
  weights = _edge_weights(graph)
  head, tail = jnp.asarray(graph.edges[:, 0]), jnp.asarray(graph.edges[:, 1])
  squares = [jnp.sum(jnp.square(z[head] - z[tail]).reshape(graph.num_edges, -1), axis=1)
             for z in jax.tree.leaves(table)]
  return 0.5 * lam * jnp.sum(weights * sum(squares))


def fedu(
    loss_fn: LossFn,
    lam: Any,
    eta: Any,
    *,
    graph: graphs_lib.Graph,
    num_clients: int,
    local_steps: int,
    regularizer_at: str = "local",
) -> FederatedAlgorithm:
  """FedU (Dinh et al. 2021): R local SGD steps per sampled client, then a Laplacian step over the graph.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    lam: λ ≥ 0, the strength of the Laplacian regularization (may be traced).
    eta: η > 0, the local SGD step size (may be traced). A bare step size,
      not an optimizer: the paper's local steps are plain SGD and the same η
      scales the server's Laplacian step ηλR (L ⊗ I) z.
    graph: `fedjax_opt.graphs.Graph` on the N clients (node i = client id i);
      its `weights` are the a_ij ≥ 0, one per row of `graph.edges`
      (`fedjax_opt.graphs.with_weights`; may be traced), None: every a_ij = 1.
      Its `mixing_rule` is not used.
    num_clients: N, rows of the x_i table; must equal `graph.num_nodes`.
    local_steps: R ≥ 1 (Python int); `batches` must have S = R local steps.
    regularizer_at: "local" (the paper: the Laplacian at the models after the
      local steps) or "start" (at the round's starting models; see the module
      docstring).

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedUState`.
  """
  check_loss_fn(loss_fn)
  check_positive(lam, "lam", allow_zero=True)
  check_positive(eta, "eta")
  _check_graph(graph)
  num_clients = check_num_clients(num_clients)
  if graph.num_nodes != num_clients:
    raise ValueError(f"graph must have one node per client: graph.num_nodes = {graph.num_nodes} but "
                     f"num_clients = {num_clients}.")
  local_steps = check_int(local_steps, "local_steps")
  check_choice(regularizer_at, "regularizer_at", REGULARIZER_POINTS)
  weights = _edge_weights(graph)
  edges = np.asarray(graph.edges)
  mode = client_map_lib.FromPolicy()
  client_optimizer = optax.sgd(eta)
  laplacian_lr = eta * lam * local_steps
  if all(is_concrete(v) for v in (eta, lam)) and (graph.weights is None or is_concrete(graph.weights)):
    bound = laplacian_step_bound(graph)
    if float(laplacian_lr) > bound:
      warnings.warn(f"fedu: the Laplacian step eta·lam·local_steps = {float(laplacian_lr):.4g} exceeds "
                    f"2/λ_max(L) = {bound:.4g} for this graph; the regularization step diverges. Lower "
                    "eta, lam or local_steps.", stacklevel=2)

  def client_update(_, data, mask, x):
    result = local_train(loss_fn, client_optimizer, x, data, mask)
    return ClientOutput(result, rows=(jax.tree.map(jnp.add, x, result.delta),))

  def init(params: PyTree, key: jax.Array) -> FedUState:
    check_key(key)
    return FedUState(
        params=params,
        local_params=per_client.broadcast(params, num_clients),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={**initial_round_metrics(), "laplacian_penalty": jnp.zeros((), jnp.float32)},
    )

  def step(state: FedUState, batches: ClientBatches) -> FedUState:
    check_client_batches(batches)
    if batches.local_steps != local_steps:
      raise ValueError(f"fedu(local_steps={local_steps}) needs batches with S = local_steps; "
                       f"got S = {batches.local_steps}.")
    as_model = lambda table: jax.tree.map(lambda t, p: t.astype(jnp.result_type(p)), table, state.params)
    old = as_model(state.local_params)
    out = client_round(mode, client_update, None, batches, tables=(old,))
    local = out.stored[0]  # y_i written into the model-dtype view of the table
    rows = jnp.zeros((num_clients,), bool).at[batches.client_id].max(local.written, mode="drop")
    z = local.table if regularizer_at == "local" else old
    pull = _laplacian_times(z, edges, weights)
    keep = lambda t: rows.reshape((-1,) + (1,) * (t.ndim - 1))
    new = jax.tree.map(lambda o, yt, g: jnp.where(keep(o), yt - laplacian_lr * g, o), old, local.table, pull)
    table = jax.tree.map(lambda t, v: v.astype(t.dtype), state.local_params, new)
    params = jax.tree.map(lambda p, m: m.astype(jnp.result_type(p)), state.params, average(as_model(table)))
    change = jax.tree.map(jnp.subtract, params, state.params)
    penalty = laplacian_penalty(as_model(table), graph, lam)
    metrics = {**out.metrics(update=change), "laplacian_penalty": penalty.astype(jnp.float32)}
    return state.replace(params=params, local_params=table, round=state.round + 1, metrics=metrics)

  return FederatedAlgorithm(init, step)


fedu = execution.accepts_policy_keywords(fedu, storage_dtype=True, refuses_aggregator=(
    "FedU's server combines no updates: each client's model moves by the graph Laplacian, ηλR Σ_j a_ij (z_i − "
    "z_j) over its neighbours, of the exact models"),
    evaluation="table", exchanges=(1, 0), hyperparameters={"lam": execution.REGULARIZER,
        "eta": execution.CLIENT_STEP_SIZE, "local_steps": execution.COUNT})
