"""Decentralized optimization over a graph: gossip averaging, D-PSGD and gradient tracking (DIGing).

Lian, Zhang, Zhang, Hsieh, Zhang, Liu. "Can Decentralized Algorithms
Outperform Centralized Algorithms? A Case Study for Decentralized Parallel
Stochastic Gradient Descent." NeurIPS 2017. arXiv:1705.09056.

Nedić, Olshevsky, Shi. "Achieving Geometric Convergence for Distributed
Optimization over Time-Varying Graphs." SIAM J. Optim. 27(4), 2017.
arXiv:1607.03218 (DIGing).

Boyd, Ghosh, Prabhakar, Shah. "Randomized Gossip Algorithms." IEEE Trans.
Inf. Theory 52(6), 2006 (gossip averaging x ← W x and its rate, the
spectral gap of W).

Problem. N nodes, node i holding f_i (the mean loss over its real examples of
the round), sit on a connected graph and cooperate to minimise
(1/N) Σ_i f_i(x) without a server: node i keeps its own model x_i and talks
only to its neighbours, through a mixing matrix W `[N, N]` (symmetric,
nonnegative, doubly stochastic, W_ij > 0 only on edges and the diagonal), or
a time-varying sequence `[T, N, N]` used as W^(k) = W[k mod T] in round k.
The factories take it as `graph=` (see `gossip`). Nodes are the client axis: `step`
takes every node's data (C = N, `client_id = arange(N)`) and runs the local
work of all nodes as one `core.rounds.client_round` without an aggregator
(each node's model x_i, and for gradient tracking its last gradient, is its
row of a per-node table; the nodes are mapped by the execution policy, so they
shard over devices like every other algorithm). There is no server: the
exchange is an aggregation over the graph, x ← W x, one matmul over the node
axis (`core.mixing.mix`). Writing x `[N, ...]` for the stacked models, one round k:

* `gossip` (adapt, then combine; decentralized FedAvg):
  x^{k+1} = W^(k) (x^k + Δ^k), Δ_i^k = the change of R local SGD(η) steps of
  node i from x_i^k. With η = 0, Δ = 0 and x^k = W^(k−1) ⋯ W^(0) x^0 (W^k x^0
  for one W): pure gossip averaging, the loss-free consensus baseline, whose
  disagreement contracts by (1 − gap) per round, the consensus distance by
  (1 − gap)² (`fedjax_opt.graphs.spectral_gap`).
* `dpsgd` (D-PSGD, Lian et al. 2017; combine and adapt from the same point):
  x_i^{k+1} = Σ_j W_ij^(k) x_j^k + Δ_i^k; with R = 1, Δ_i^k = −η ∇f_i(x_i^k; ξ_i^k),
  the paper's update. R > 1 local steps between gossip rounds run from x_i^k,
  in parallel with the gossip. With a constant η and heterogeneous f_i its
  fixed point is biased: at a consensus x the update is −η ∇f_i(x), which
  vanishes for every node only when every ∇f_i(x) = 0, so the nodes settle
  O(η) away from the minimiser of Σ_i f_i (and from each other).
* `gradient_tracking` (DIGing, Nedić et al. 2017): each node also tracks the
  network's average gradient in y_i,

      y^k     = W^(k−1) y^{k−1} + ∇f(x^k) − ∇f(x^{k−1}),     y^{−1} = ∇f(x^{−1}) = 0,
      x^{k+1} = W^(k) x^k − η y^k,

  with ∇f(x^k) `[N, ...]` the nodes' gradients ∇f_i(x_i^k) on their round's
  data (all S·B examples as one batch). This is the paper's iteration
  x^{k+1} = W(k) x^k − α y^k, y^{k+1} = W(k) y^k + ∇f(x^{k+1}) − ∇f(x^k),
  y^0 = ∇f(x^0), written with one gradient per round: round k computes
  ∇f(x^k), finishes y^k, and takes the x-step. Since 1ᵀW = 1ᵀ, Σ_i y_i^k =
  Σ_i ∇f_i(x_i^k) every round, so at a fixed point every x_i is equal and
  Σ_i ∇f_i(x) = 0: with a small enough constant η the nodes reach the exact
  minimiser of Σ_i f_i, also under heterogeneous data. A node with no real
  example in a round keeps its previous gradient (no new information).

A node whose local work is not finite (Δ_i, ∇f_i(x_i^k) or its loss) follows
the library's rule (docs/architecture.md, "The round"), in the form
`core/rounds.py` states for a round without an aggregator: every node takes
part every round, with data or not (`core.rounds.every_client`: its batch
weight is not read), a node is finite when its new rows (x_i + Δ_i, or x_i and
∇f_i(x_i^k)) and its loss are (`ClientOutput.checked`), and a node that is not
is counted in `num_nonfinite` and keeps its rows (x_i, and y_i and its last
gradient for gradient tracking). Our form of it
for a graph (the papers do not treat it): the node is cut out of the graph
for the round (`core.mixing.exclude`), its edges' weight moved onto the
diagonal of its neighbours' rows, W̃_ii = W_ii + Σ_{j failed} W_ij. W̃ is
still symmetric and doubly stochastic, so the finite nodes average among
themselves and nothing of the failed node spreads; for gradient tracking the
invariant Σ_i y_i = Σ_i ∇f_i(x_i) still holds.

State (`DecentralizedState`): `params` = x̄ = (1/N) Σ_i x_i (what `fo.train`
and evaluation read), `local_params` = the x_i (`[N, ...]`,
`fo.personalized_params(state, i)`), `tracker` = y (`[N, ...]`, gradient
tracking; None otherwise), `gradients` = ∇f(x^{k−1}) (`[N, ...]`, gradient
tracking; None otherwise). Metrics (`DECENTRALIZED_METRICS`): `client_loss`
(the mean over finite nodes with data of f_i(x_i^k) on the round's data,
before the round's update; for R local steps the mean loss along the
steps), `consensus_distance` ((1/N) Σ_i ‖x_i − x̄‖² after the round),
`bytes_sent` (per node, averaged over the nodes: the models a node sends to
its neighbours, #{i ≠ j : W̃_ij ≠ 0} × the model's bytes; gradient tracking
sends two vectors, x through W^(k) and y through W^(k−1)), `bits_up` (the
same in bits, 8 × `bytes_sent`: 32 P per neighbour for a float32 model of P
entries), `bits_down` (per node, averaged: what a node receives from its
neighbours, (1/N) Σ_i #{j ≠ i : W̃_ij ≠ 0} × 32 P, the row counts of W̃; for
gradient tracking the rows of W̃^(k) and W̃^(k−1)), `num_nonfinite`. Every
entry W̃_ij ≠ 0 off the diagonal is one message, from j to i, so the two
means agree (2|E| × 32 P / N per vector gossiped over |E| edges); a node cut
out of the graph sends and receives nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import mixing as mixing_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.local import LocalResult, cycle_steps, local_train, masked_mean_loss
from fedjax_opt.core.rounds import ClientOutput, Round, client_round, every_client
from fedjax_opt.core.server import finite_mean, keep_rows, zero_rows
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_full_participation, check_key, check_loss_fn, check_optional_int,
                                        check_positive, check_scalar)

__all__ = ["DecentralizedState", "DECENTRALIZED_METRICS", "consensus_distance", "dpsgd", "gossip",
           "gradient_tracking"]

DECENTRALIZED_METRICS = {
    "client_loss": jnp.float32,
    "consensus_distance": jnp.float32,
    "bytes_sent": jnp.float32,
    "bits_up": jnp.float32,
    "bits_down": jnp.float32,
    "num_nonfinite": jnp.int32,
}
"""The diagnostics of a decentralized round (module docstring)."""


@flax.struct.dataclass
class DecentralizedState:
  """State of `gossip`, `dpsgd` and `gradient_tracking`.

  Attributes:
    params: x̄ = (1/N) Σ_i x_i, the nodes' average model.
    local_params: the x_i, a per-node table (leaves `[N, ...]`).
    tracker: y_i, the gradient trackers `[N, ...]` (gradient tracking; None otherwise).
    gradients: ∇f_i(x_i) of the previous round `[N, ...]` (gradient tracking; None otherwise).
    round: k, rounds applied, int32 (indexes a time-varying mixing sequence).
    key: PRNG key (nothing is drawn; kept for the common state contract).
    metrics: `DECENTRALIZED_METRICS`.
  """

  params: PyTree
  local_params: PyTree
  tracker: PyTree | None
  gradients: PyTree | None
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def consensus_distance(table: PyTree) -> jax.Array:
  """(1/N) Σ_i ‖x_i − x̄‖² of a per-node table (leaves `[N, ...]`), a scalar."""
  return mixing_lib.consensus_distance(table)


def _metrics(out: Round, table: PyTree, sent: jax.Array, received: jax.Array,
             message_bytes: int) -> dict[str, jax.Array]:
  """The round's `DECENTRALIZED_METRICS` after the nodes' `client_round` `out`; `sent` / `received` `[N]` count each
  node's messages of `message_bytes`."""
  used = out.agg.finite & (out.results.num_examples > 0)
  mean_sent = jnp.mean(sent.astype(jnp.float32))
  values = {
      "client_loss": finite_mean(out.results.loss, used),
      "consensus_distance": mixing_lib.consensus_distance(table),
      "bytes_sent": mean_sent * message_bytes,
      "bits_up": mean_sent * (8 * message_bytes),
      "bits_down": jnp.mean(received.astype(jnp.float32)) * (8 * message_bytes),
      "num_nonfinite": out.agg.num_nonfinite,
  }
  return {name: jnp.asarray(values[name]).astype(dtype) for name, dtype in DECENTRALIZED_METRICS.items()}


def _average(table: PyTree, like: PyTree) -> PyTree:
  return jax.tree.map(lambda t, p: jnp.mean(t, axis=0).astype(jnp.result_type(p)), table, like)


def _initial_state(params: PyTree, key: jax.Array, n: int, tracking: bool) -> DecentralizedState:
  """Every node at `params`; the tracker y and the last gradients zero when `tracking` (None otherwise)."""
  check_key(key)
  zeros = per_client.init(params, n) if tracking else None
  return DecentralizedState(
      params=params,
      local_params=per_client.broadcast(params, n),
      tracker=zeros,
      gradients=zeros,
      round=jnp.zeros((), jnp.int32),
      key=key,
      metrics={m: jnp.zeros((), dt) for m, dt in DECENTRALIZED_METRICS.items()},
  )


def _check_step(name: str, batches: ClientBatches, n: int) -> None:
  if isinstance(batches, ClientBatches) and batches.mask.ndim == 3 and batches.num_clients != n:
    raise ValueError(f"{name}: the mixing matrix has N = {n} nodes, so batches must hold every node's data, "
                     f"C = N = {n} (row i = node i); got C = {batches.num_clients}.")
  check_full_participation(batches, n, ordered=True)


def _node_round(mode: Any, node_update: Callable[..., ClientOutput], batches: ClientBatches, tables: tuple) -> Round:
  """`core.rounds.client_round` of every node's local work (module docstring): every node takes part
  (`every_client`, a step even without data) and its loss is judged with its new rows (`ClientOutput.checked`);
  `node_update(data, mask, *rows) -> ClientOutput`."""

  def update(_, data, mask, *rows):
    out = node_update(data, mask, *rows)
    return out._replace(result=out.result._replace(num_steps=jnp.ones((), jnp.int32)), checked=out.result.loss)

  return client_round(mode, update, None, every_client(batches), tables=tables)


def _local_sgd(name: str, loss_fn: LossFn, eta: Any, graph: Any, local_steps: int | None, adapt_then_combine: bool,
               allow_zero_eta: bool) -> FederatedAlgorithm:
  """`gossip` (adapt, then combine) and `dpsgd` (combine and adapt from x^k)."""
  check_loss_fn(loss_fn)
  check_scalar(eta, "eta (η, the local step size)")
  check_positive(eta, "eta (η, the local step size)", allow_zero=allow_zero_eta)
  local_steps = check_optional_int(local_steps, "local_steps")
  mix = mixing_lib.prepare(graph)
  n = mix.num_nodes
  mode = client_map_lib.FromPolicy()
  optimizer = optax.sgd(eta)

  def node_update(data, mask, x):
    if local_steps is not None:
      data, mask = cycle_steps(data, mask, local_steps)
    result = local_train(loss_fn, optimizer, x, data, mask)
    return ClientOutput(result, rows=(jax.tree.map(jnp.add, x, result.delta),), extras=result.delta)

  def init(params: PyTree, key: jax.Array) -> DecentralizedState:
    return _initial_state(params, key, n, tracking=False)

  def step(state: DecentralizedState, batches: ClientBatches) -> DecentralizedState:
    _check_step(name, batches, n)
    x = state.local_params
    dtype = jnp.result_type(*jax.tree.leaves(x))
    out = _node_round(mode, node_update, batches, (x,))
    ok = out.agg.finite
    w = mixing_lib.exclude(mixing_lib.at_round(mix, state.round, dtype), ok)
    if adapt_then_combine:  # x + Δ, written by the round where finite (x kept elsewhere)
      new = mixing_lib.mix(w, out.stored[0].table)
    else:  # a NaN times a zero weight is still NaN: a dropped node's Δ is zeroed
      new = jax.tree.map(jnp.add, mixing_lib.mix(w, x), zero_rows(ok, out.extras))
    table = keep_rows(ok, new, x)
    metrics = _metrics(out, table, mixing_lib.messages_sent(w), mixing_lib.messages_received(w),
                       mixing_lib.model_bytes(state.params))
    return state.replace(params=_average(table, state.params), local_params=table, round=state.round + 1,
                         metrics=metrics)

  return FederatedAlgorithm(init, step)


def gossip(
    loss_fn: LossFn,
    eta: Any = 0.0,
    *,
    graph: Any,
    local_steps: int | None = None,
) -> FederatedAlgorithm:
  """Local SGD, then gossip averaging of the models: x^{k+1} = W^(k) (x^k + Δ^k).

  Δ_i^k is the change of node i's R local SGD(η) steps from x_i^k; η = 0 (the
  default) is pure gossip averaging, x^k = W^k x^0, the loss-free consensus
  baseline (the local steps then change nothing; the loss is still reported).
  With local steps it is decentralized FedAvg (local training, then each node
  averages its neighbours' new models); see the module docstring.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    eta: η ≥ 0, the local SGD step size (may be traced). A bare step size,
      not an optimizer, as in `dpsgd`.
    graph: the communication graph, node i = row i of the batches: a
      `fedjax_opt.graphs.Graph`, mixed by its `mixing_rule` (default
      Metropolis–Hastings; `fedjax_opt.graphs.mixing_matrix`), or, for
      research use, an explicit mixing matrix W `[N, N]` (symmetric,
      nonnegative, doubly stochastic, spectral gap > 0) or a time-varying
      sequence `[T, N, N]` (W[k mod T] in round k; e.g.
      `fedjax_opt.graphs.random_matchings`).
    local_steps: R, local SGD steps per round (a Python int), step r on the
      round's batch r mod S. None: R = S, one step per batch.

  Returns:
    `FederatedAlgorithm(init, step)` with state `DecentralizedState`;
    `step(state, batches)` takes every node's data, C = N, client_id = arange(N).

  Raises:
    TypeError: `graph` missing or not a Graph / matrix; `local_steps` not a Python int.
    ValueError: η < 0; the mixing matrix not square, negative, asymmetric, not doubly
      stochastic or with spectral gap 0 (`fedjax_opt.graphs.check_mixing_matrix`);
      (at `step`) C != N or client_id != arange(N).
  """
  return _local_sgd("gossip", loss_fn, eta, graph, local_steps, adapt_then_combine=True, allow_zero_eta=True)


gossip = execution.accepts_policy_keywords(gossip, refuses_aggregator=(
    "gossip has no server: every node combines its neighbours' models by the graph's mixing matrix, x ← W(x + "
    "Δ), which is its aggregation"),
    evaluation="table", exchanges="bytes", hyperparameters={"eta": execution.CLIENT_STEP_SIZE,
        "local_steps": execution.COUNT})


def dpsgd(
    loss_fn: LossFn,
    eta: Any,
    *,
    graph: Any,
    local_steps: int | None = None,
) -> FederatedAlgorithm:
  """D-PSGD (Lian et al., NeurIPS 2017): x_i^{k+1} = Σ_j W_ij^(k) x_j^k − η ∇f_i(x_i^k; ξ_i^k).

  With R local steps, x_i^{k+1} = Σ_j W_ij^(k) x_j^k + Δ_i^k, Δ_i^k the change
  of R SGD(η) steps of node i from x_i^k (R = 1, one batch: the paper's
  update). With a constant η and heterogeneous nodes the iterates keep an
  O(η) bias from the minimiser of Σ_i f_i (module docstring); use
  `gradient_tracking` for the exact minimiser.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    eta: η > 0, the SGD step size (may be traced). A bare step size, as in the paper.
    graph: a `Graph` or a mixing matrix / sequence, as in `gossip`.
    local_steps: R (a Python int), step r on the round's batch r mod S. None:
      R = S, one step per batch (S = 1: the paper's one stochastic gradient per round).

  Returns:
    `FederatedAlgorithm(init, step)` with state `DecentralizedState` (`tracker`, `gradients` None).

  Raises:
    TypeError, ValueError: as `gossip`, and η <= 0.
  """
  return _local_sgd("dpsgd", loss_fn, eta, graph, local_steps, adapt_then_combine=False, allow_zero_eta=False)


dpsgd = execution.accepts_policy_keywords(dpsgd, refuses_aggregator=(
    "D-PSGD has no server: every node combines its neighbours' models by the graph's mixing matrix, x_i ← Σ_j "
    "W_ij x_j + Δ_i, which is its aggregation"),
    evaluation="table", exchanges="bytes", hyperparameters={"eta": execution.CLIENT_STEP_SIZE,
        "local_steps": execution.COUNT})


def gradient_tracking(
    loss_fn: LossFn,
    eta: Any,
    *,
    graph: Any,
) -> FederatedAlgorithm:
  """Gradient tracking, DIGing (Nedić, Olshevsky & Shi, SIAM J. Optim. 2017): exact with a constant step.

      y^k     = W^(k−1) y^{k−1} + ∇f(x^k) − ∇f(x^{k−1}),   y^{−1} = ∇f(x^{−1}) = 0
      x^{k+1} = W^(k) x^k − η y^k

  ∇f_i(x_i^k) is node i's gradient on its round's data (its S batches as one
  batch of S·B examples). Σ_i y_i = Σ_i ∇f_i(x_i) every round, so the fixed
  point is the minimiser of Σ_i f_i at every node (module docstring). Each
  round every node sends two vectors (x_i and y_i) to each neighbour.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    eta: η > 0, the constant step size α of the paper (may be traced). Small
      enough for stability: about η < (1 − ‖W − 11ᵀ/N‖)² / L for L-smooth f_i
      in theory. In practice η < 1/(2L) even on the complete graph: with
      W = 11ᵀ/N the nodes' disagreement along a curvature h of the f_i
      follows λ² + ηhλ − ηh = 0, stable only for ηh < 1/2; sparse graphs
      need a smaller step still (benchmarks/decentralized.py).
    graph: a `Graph` or a mixing matrix / sequence, as in `gossip`.

  Returns:
    `FederatedAlgorithm(init, step)` with state `DecentralizedState`.

  Raises:
    TypeError, ValueError: as `dpsgd`.
  """
  check_loss_fn(loss_fn)
  check_scalar(eta, "eta (η, the step size)")
  check_positive(eta, "eta (η, the step size)")
  mix = mixing_lib.prepare(graph)
  n = mix.num_nodes
  mode = client_map_lib.FromPolicy()
  grad_fn = jax.value_and_grad(masked_mean_loss, argnums=1, has_aux=True)

  def node_gradient(data, mask, x, _):
    batch = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), data)
    (loss, count), g = grad_fn(loss_fn, x, batch, mask.reshape(-1))
    result = LocalResult(delta=g, loss=loss, num_examples=count, num_steps=None)
    return ClientOutput(result, rows=(x, g), writes=count > 0)  # no data: the last gradient (no change to y)

  def init(params: PyTree, key: jax.Array) -> DecentralizedState:
    return _initial_state(params, key, n, tracking=True)

  def step(state: DecentralizedState, batches: ClientBatches) -> DecentralizedState:
    _check_step("gradient_tracking", batches, n)
    x, y, g_old = state.local_params, state.tracker, state.gradients
    dtype = jnp.result_type(*jax.tree.leaves(x))
    out = _node_round(mode, node_gradient, batches, (x, g_old))
    ok, g = out.agg.finite, out.stored[1].table  # ∇f_i(x_i) where finite with data, else the last one
    w_x = mixing_lib.exclude(mixing_lib.at_round(mix, state.round, dtype), ok)
    w_y = mixing_lib.exclude(mixing_lib.at_round(mix, state.round - 1, dtype), ok)
    y_new = jax.tree.map(lambda a, b, c: a + b - c, mixing_lib.mix(w_y, y), g, g_old)
    step_size = jnp.asarray(eta, dtype)
    x_new = jax.tree.map(lambda a, b: a - step_size.astype(a.dtype) * b, mixing_lib.mix(w_x, x), y_new)
    table = keep_rows(ok, x_new, x)
    tracker = keep_rows(ok, y_new, y)
    sent = mixing_lib.messages_sent(w_x) + mixing_lib.messages_sent(w_y)
    received = mixing_lib.messages_received(w_x) + mixing_lib.messages_received(w_y)
    metrics = _metrics(out, table, sent, received, mixing_lib.model_bytes(state.params))
    return state.replace(params=_average(table, state.params), local_params=table, tracker=tracker, gradients=g,
                         round=state.round + 1, metrics=metrics)

  return FederatedAlgorithm(init, step)


gradient_tracking = execution.accepts_policy_keywords(gradient_tracking, refuses_aggregator=(
    "gradient tracking has no server: every node combines its neighbours' models and gradient trackers by the "
    "graph's mixing matrix, and the trackers follow the network's mean gradient only under that exact linear "
    "mixing"),
    evaluation="table", exchanges="bytes", hyperparameters={"eta": execution.CLIENT_STEP_SIZE})
