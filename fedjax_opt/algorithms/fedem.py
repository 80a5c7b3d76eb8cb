"""FedEM: federated multi-task learning under a mixture of distributions.

Marfoq, Neglia, Bellet, Kameni, Vidal. "Federated Multi-Task Learning under a
Mixture of Distributions." NeurIPS 2021. arXiv:2108.10252.

Model. Each client t's data is drawn from a mixture of M underlying
distributions shared by the whole federation, with its own mixture weights
π_t ∈ Δ^M: p_t(x, y) = Σ_m π_tm p_m(x, y). Component m is learned by a shared
model θ_m (any model with a per-example loss ℓ(θ_m; s) = −log p_θm(y | x),
e.g. softmax cross-entropy), and client t predicts with its own mixture

    p_t(y | x) = Σ_m π_tm p_θm(y | x).

Round k (Algorithm 1 of the paper):

    E-step (client t, each of its n_t train examples s_i):
        q_t(z_i = m) = π_tm exp(−ℓ(θ_m; s_i)) / Σ_m' π_tm' exp(−ℓ(θ_m'; s_i))
    M-step (client t):
        π_tm ← (1/n_t) Σ_{i ≤ n_t} q_t(z_i = m)
        θ_m^t ← LocalSolver(θ_m; Σ_i q_t(z_i = m) ℓ(·; s_i)/n_t),  for every m
                 (S masked steps of the client optimizer on the q-weighted loss of the round's
                 mini-batches, from θ_m; each slot's example weighted by its own q)
    server:
        θ_m ← θ_m + ServerOpt(−Σ_t w_t (θ_m^t − θ_m) / Σ_t w_t),  w_t = n_t  (every m at once)

Which examples the E-step reads (`e_step`): "local", all n_t train examples
of the client, as Algorithm 1 and the authors' code do; the round's program
then reads them from the packed dataset (the round's data must be the
`DeferredData` of `sample_round(..., deferred=True)`, which `fo.train` and
the command line pass). "round": the round's S·B slots stand for the
client's data (π is the mean of q over the slots' real examples; past a
partial epoch an example the round repeats counts twice). "auto" (the
default): "local" when the round's data holds the train splits
(`core.types.has_local_split`), "round" otherwise, e.g. for `[C, S, B, ...]`
arrays built by hand. Both compute q with the round's starting θ and π, so
the local training's weights are the same in both; only the new π differs.

With one component (M = 1), q ≡ 1, π ≡ 1 and the round is FedAvg's exactly.
The E-step is computed in log space (a softmax of log π_tm − ℓ(θ_m; s_i) over
m), so a component with a huge loss gets responsibility 0, never NaN.

State (`FedEMState`): `params` = {"components": θ (leaves `[M, ...]`),
"weights": π̄ `[M]`}, a mixture model readable by `mixture_model(model)` (π̄ is
the mean of the π_t of every client, the population's mixture: what a new
client uses before it has any data); `mixture_weights` = the π_t table
`[N, M]` (uniform 1/M before a client is first sampled). A client's own
model is `{"components": θ, "weights": π_t}`: `personalize(params, data,
mask)` computes π for a client from its data by EM with the components
fixed (the paper's treatment of clients unseen at training), and
`client_params(state, t)` returns the stored π_t with the components.

Non-finite clients follow the library's rule (docs/architecture.md, "The
round"); here a client's responsibilities count as part of its update, and
its π_t row keeps its last finite value.

Metrics: `core.server.ROUND_METRICS` plus `component_share` `[M]`, the mean
of the round's aggregated clients' new π_t (how the round's data splits
between the components).

D-FedEM (`d_fedem`), the paper's fully decentralized variant: no server,
every node keeps its own components and averages them with its neighbours
through the graph's mixing matrix after its local EM step (see `d_fedem`): the
local steps are one `core.rounds.client_round` without an aggregator (a node's
Θ_t and π_t are its rows of per-node tables), and the exchange is an
aggregation over the graph, Θ ← W (Θ + Δ) (`core.mixing.mix`). Its metrics
(`DFedEMState`) count what a node sends as in `gossip`, its M components per
message: `bytes_sent` = (1/N) Σ_j #{i ≠ j : W̃_ij ≠ 0} × 4 M P (P the
parameters of one component, float32), `bits_up` = 8 × `bytes_sent`, and
`bits_down` = (1/N) Σ_i #{j ≠ i : W̃_ij ≠ 0} × 32 M P, the components a node
receives from its neighbours (the π_t never leave their node).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import clusters
from fedjax_opt.core import execution
from fedjax_opt.core import mixing as mixing_lib
from fedjax_opt.core.averaging import initial_fields
from fedjax_opt.core.local import LocalResult, local_train
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.server import apply_server_update, finite_mean, keep_rows
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree, has_local_split, with_local_split
from fedjax_opt.core.validation import (check_choice, check_client_batches, check_full_participation, check_int,
                                        check_key, check_loss_fn, check_num_clients, check_optimizer, check_positive)

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `fedem` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["DFedEMState", "FedEMState", "client_params", "d_fedem", "fedem", "mixture_model", "responsibilities"]

_WEIGHT_KEY = "__fedem_q"
E_STEPS = ("auto", "local", "round")


def _round_data(name: str, e_step: str, data: Any) -> tuple[Any, bool]:
  """The round's data for the client step and whether its E-step reads the train splits (`e_step`)."""
  if e_step == "round" or (e_step == "auto" and not has_local_split(data)):
    return data, False
  if not has_local_split(data):
    raise ValueError(f"{name}: e_step='local' reads every client's train split, so the round's data must be "
                     "sample_round(..., deferred=True)'s DeferredData over plain examples (fo.train passes it); "
                     "got data that does not hold the splits. Use e_step='round' for hand-built batches.")
  return with_local_split(data), True


@flax.struct.dataclass
class FedEMState:
  """Server state of FedEM.

  Attributes:
    params: {"components": θ_1..θ_M stacked (leaves `[M, ...]`), "weights": π̄ `[M]`}.
    mixture_weights: the per-client π_t, `[N, M]` float32.
    server_opt_state: the server optimizer's state (over the stacked components).
    aggregator_state: the aggregator's state.
    round: rounds applied, int32.
    key: PRNG key, split once per round.
    metrics: `core.server.ROUND_METRICS` plus `component_share` `[M]`.
  """

  params: PyTree
  mixture_weights: jax.Array
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _log_joint(loss_fn: LossFn, components: PyTree, weights: jax.Array, batch: PyTree) -> jax.Array:
  """log π_m − ℓ(θ_m; s_i) = log π_m p_θm(y_i | x_i), `[B, M]`."""
  losses = jax.vmap(lambda theta: loss_fn(theta, batch))(components)  # [M, B]
  return (jnp.log(jnp.asarray(weights, losses.dtype))[:, None] - losses).T


def responsibilities(loss_fn: LossFn, components: PyTree, weights: jax.Array, batch: PyTree) -> jax.Array:
  """The E-step: q(z = m | s_i) ∝ π_m exp(−ℓ(θ_m; s_i)) for each example of `batch`, `[B, M]` (rows sum to 1).

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]` (−log p_θ(y | x)).
    components: θ, leaves `[M, ...]`.
    weights: π `[M]` (zeros allowed: that component gets responsibility 0).
    batch: one batch of B examples.
  """
  return jax.nn.softmax(_log_joint(loss_fn, components, weights, batch), axis=-1)


def _em_step(loss_fn: LossFn, components: PyTree, weights: jax.Array, data: PyTree,
             mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """On a client's round data `[S, B, ...]`: q `[S, B, M]`, the M-step's new π `[M]` (unchanged without data)
  and the mean −log p(y | x) of the mixture with the old π over the real examples."""
  log_joint = jax.vmap(lambda batch: _log_joint(loss_fn, components, weights, batch))(data)  # [S, B, M]
  q = jax.nn.softmax(log_joint, axis=-1)
  nll = -jax.scipy.special.logsumexp(log_joint, axis=-1)
  count = jnp.sum(mask)
  new = jnp.sum(jnp.where(mask[..., None], q, 0.0), axis=(0, 1)) / jnp.maximum(count, 1)
  mean_nll = jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(count, 1)
  return q, jnp.where(count > 0, new, weights).astype(weights.dtype), mean_nll


def mixture_model(model: Any) -> Any:
  """A `fo.models.Model` whose params are FedEM's {"components", "weights"}: the mixture Σ_m π_m p_θm(y | x).

  `apply` returns log p(y | x) = log Σ_m π_m softmax(apply(θ_m, x)) `[B, K]` (log-probabilities are
  logits of the same distribution), so `loss_fn` is −log p(y | x) and `accuracy_fn` the mixture's
  prediction argmax_y p(y | x). `init(key)` gives M = 1 component (weights [1.0]).
  """
  from fedjax_opt.models import base  # pylint: disable=import-outside-toplevel

  def apply(params, x):
    comps, weights = params["components"], params["weights"]
    log_probs = jax.vmap(lambda theta: jax.nn.log_softmax(model.apply(theta, x).astype(jnp.float32)))(comps)
    return jax.scipy.special.logsumexp(log_probs + jnp.log(weights)[:, None, None], axis=0)

  def init(key):
    return {"components": jax.tree.map(lambda a: a[None], model.init(key)), "weights": jnp.ones((1,), jnp.float32)}

  return model._replace(init=init, apply=apply, loss_fn=base.classification_loss(apply),
                        accuracy_fn=base.classification_accuracy(apply), name=f"{model.name}_mixture", module=None)


def client_params(state: FedEMState, client_id: Any) -> PyTree:
  """Client t's own mixture model {"components": θ, "weights": π_t} (`mixture_model` reads it)."""
  return {"components": state.params["components"], "weights": state.mixture_weights[client_id]}


def _client_em(loss_fn: LossFn, optimizer: optax.GradientTransformation, components: PyTree, data: PyTree,
               mask: jax.Array, pi: jax.Array, local: bool = False) -> tuple[LocalResult, jax.Array]:
  """One client's E-step, π update and q-weighted local training of every component from θ.

  With `local`, `data` is `with_local_split`'s `{"round": ..., "local": (train data, train mask)}` and the
  new π is the mean of q over the client's train split; otherwise over the round's real slots.

  Returns `(LocalResult, new π)`: the result's delta is stacked `[M, ...]`, its loss the mixture's
  −log p(y | x) with the old π over the round's slots, its counts those of the (shared) data.
  """
  if local:
    local_data, local_mask = data["local"]
    data = data["round"]
    new_pi = _em_step(loss_fn, components, pi, local_data, local_mask)[1]
    q, _, nll = _em_step(loss_fn, components, pi, data, mask)
  else:
    q, new_pi, nll = _em_step(loss_fn, components, pi, data, mask)

  def weighted_loss(params, batch):
    rest = {k: v for k, v in batch.items() if k != _WEIGHT_KEY}
    return batch[_WEIGHT_KEY] * loss_fn(params, rest)

  def train(theta, q_m):
    return local_train(weighted_loss, optimizer, theta, {**data, _WEIGHT_KEY: q_m}, mask)

  results = jax.vmap(train, in_axes=(0, 2))(components, q)  # every component from its θ_m, on q_m
  first = jax.tree.map(lambda a: a[0], results)  # the counts are the same for every component
  return LocalResult(delta=results.delta, loss=nll, num_examples=first.num_examples,
                     num_steps=first.num_steps), new_pi


def _initial_components(name: str, params: PyTree, key: jax.Array, m: int, init_noise: Any) -> PyTree:
  """θ `[M, ...]`: given ({"components", "weights"} params) or M perturbed copies of `params` (M = 1: itself).

  The noise comes from `fold_in(key, 1)`: the state keeps `key` itself (the library's state contract).
  """
  if isinstance(params, dict) and set(params) == {"components", "weights"}:
    if jnp.shape(params["weights"]) != (m,):
      raise ValueError(f"{name}: params['weights'] must have shape [{m}]; got {jnp.shape(params['weights'])}.")
    return params["components"]
  if m == 1:
    return jax.tree.map(lambda a: a[None], params)
  return clusters.perturbed(params, jax.random.fold_in(key, 1), m, init_noise)


def fedem(
    loss_fn: LossFn,
    *,
    num_components: int,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    init_noise: Any = 1.0,
    em_iterations: int = 10,
    e_step: str = "auto",
    aggregator: aggregators_lib.Aggregator | None = None,
) -> FederatedAlgorithm:
  """FedEM (Marfoq et al. 2021): M shared component models, per-client mixture weights, EM rounds.

  Args:
    loss_fn: per-example loss ℓ(θ; s) = −log p_θ(y | x) of one component, `loss_fn(params, batch) -> [B]`
      (softmax cross-entropy: `model.loss_fn`).
    num_components: M ≥ 1.
    num_clients: N, rows of the π table (every `batches.client_id` must be < N).
    client_optimizer: the local solver of every component (e.g. `optax.sgd(η)`), S masked steps on the
      q-weighted loss, re-initialized per client, round and component.
    server_optimizer: fed −Δ of the stacked components (default `optax.sgd(1.0)`: θ_m becomes the
      n_t-weighted mean of the clients' θ_m^t).
    init_noise: `init(params, key)` starts θ_m = params + init_noise · max(std(leaf), 0.01) · ε_m, ε_m ~ N(0, I)
      from the key, so the components differ (EM cannot separate identical components). Pass params
      already in FedEM's form ({"components": [M, ...], "weights": [M]}) to start from given components.
    em_iterations: EM iterations of `personalize` (π of a client from its data, components fixed).
    e_step: which examples give the new π (module docstring): "local" (all n_t train examples, Algorithm 1;
      needs the round's data deferred), "round" (the round's slots) or "auto" ("local" when the data allows).
    aggregator: default `aggregators.weighted_mean()` (w_t = n_t, the paper's average).

  Returns:
    `FederatedAlgorithm(init, step, personalize)` with state `FedEMState`; `personalize(params, data, mask)`
    returns a client's {"components", "weights": π} with π fitted to its data.
  """
  check_loss_fn(loss_fn)
  m = check_int(num_components, "num_components", 1)
  num_clients = check_num_clients(num_clients)
  check_optimizer(client_optimizer, "client_optimizer")
  check_positive(init_noise, "init_noise", allow_zero=True)
  em_iterations = check_int(em_iterations, "em_iterations", 1)
  e_step = check_choice(e_step, "e_step", E_STEPS)
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer
  check_optimizer(server_optimizer, "server_optimizer")
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)
  mode = client_map_lib.FromPolicy()

  def client_update(local, components, data, mask, pi):
    result, new_pi = _client_em(loss_fn, client_optimizer, components, data, mask, pi, local)
    return ClientOutput(result, rows=(new_pi,))

  def init(params: PyTree, key: jax.Array) -> FedEMState:
    components = _initial_components("fedem", params, key, m, init_noise)
    table = jnp.full((num_clients, m), 1.0 / m, jnp.float32)
    state_params = {"components": components, "weights": jnp.mean(table, axis=0)}
    fields = initial_fields(components, key, aggregator)
    fields["metrics"]["component_share"] = jnp.full((m,), 1.0 / m, jnp.float32)
    return FedEMState(params=state_params, mixture_weights=table, server_opt_state=server_optimizer.init(components),
                      **{k: v for k, v in fields.items() if k != "params"})

  def step(state: FedEMState, batches: ClientBatches) -> FedEMState:
    check_client_batches(batches)
    key, agg_key = jax.random.split(state.key)
    components = state.params["components"]
    data, local = _round_data("fedem", e_step, batches.data)
    out = client_round(mode, functools.partial(client_update, local), components, batches.replace(data=data),
                       tables=(state.mixture_weights,),
                       aggregator=aggregator, aggregator_state=state.aggregator_state, key=agg_key)
    new_components, server_opt_state = apply_server_update(
        server_optimizer, components, state.server_opt_state, out.agg.update, out.agg.accepted)
    stored, = out.stored
    table = stored.table
    used = out.write
    new_rows = table[batches.client_id]
    n_used = jnp.sum(used)
    component_share = jnp.where(n_used > 0, jnp.sum(jnp.where(used[:, None], new_rows, 0.0), axis=0)
                                / jnp.maximum(n_used, 1), state.metrics["component_share"])
    return FedEMState(
        params={"components": new_components, "weights": jnp.mean(table, axis=0)},
        mixture_weights=table,
        server_opt_state=server_opt_state,
        aggregator_state=out.agg.state,
        round=state.round + 1,
        key=key,
        metrics={**out.metrics(), "component_share": component_share.astype(jnp.float32)},
    )

  def personalize(params: PyTree, data: PyTree, mask: jax.Array) -> PyTree:
    comps = params["components"]

    def em(pi, _):
      return _em_step(loss_fn, comps, pi, data, mask)[1], None

    pi, _ = jax.lax.scan(em, jnp.full((m,), 1.0 / m, jnp.float32), None, length=em_iterations)
    return {"components": comps, "weights": pi}

  return FederatedAlgorithm(init, step, personalize)


fedem = execution.accepts_policy_keywords(fedem, default_aggregator=_DEFAULT_AGGREGATOR,
    refuses_downlink=(
        "FedEM broadcasts M component models and each client fits its mixture weights on the exact components; the "
        "downlink compresses one broadcast model"),
    evaluation="adapt", exchanges=(1, 1), hyperparameters={"num_components": execution.COUNT,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "server_optimizer": execution.SERVER_OPTIMIZER,
        "init_noise": execution.SCALE, "em_iterations": execution.COUNT})


@flax.struct.dataclass
class DFedEMState:
  """State of D-FedEM.

  Attributes:
    params: the nodes' average {"components": mean_t Θ_t `[M, ...]`, "weights": mean_t π_t `[M]`}.
    local_params: every node's own mixture {"components": Θ_t (leaves `[N, M, ...]`), "weights": π_t
      `[N, M]`}, so `fo.personalized_params(state, t)` is node t's model (read with `mixture_model`).
    round: rounds applied, int32 (indexes a time-varying mixing sequence).
    key: PRNG key (nothing is drawn after `init`; kept for the common state contract).
    metrics: `client_loss`, `consensus_distance` (of the components), `bytes_sent`, `bits_up` and
      `bits_down` (per node, averaged over the nodes; module docstring), `num_nonfinite`,
      `component_share` `[M]`.
  """

  params: PyTree
  local_params: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def d_fedem(
    loss_fn: LossFn,
    *,
    num_components: int,
    graph: Any,
    client_optimizer: optax.GradientTransformation,
    init_noise: Any = 1.0,
    e_step: str = "auto",
) -> FederatedAlgorithm:
  """D-FedEM (Marfoq et al. 2021, the fully decentralized variant): FedEM's client step, then gossip.

  Every node t keeps its own components Θ_t = (θ_t1..θ_tM) and weights π_t. Round k, every node at once:

      π_t, Θ_t + Δ_t  ← FedEM's client step on node t's round data (E-step, π update, q-weighted local
                        training of each θ_tm from Θ_t)
      Θ_t             ← Σ_s W^(k)_ts (Θ_s + Δ_s)            (adapt, then combine: `gossip` for components)

  with W^(k) the mixing matrix of `graph` over the N nodes; π_t never leaves node t. With W = 11ᵀ/N every
  node holds the same components after each round and the round is FedEM's with uniform weights (equal n_t:
  FedEM's own). The client step is `core.rounds.client_round` without an aggregator, under its rules for
  such a round (docs/architecture.md, "The round") with every node taking part every round (with data or
  not; the batch weight is not read): a node is finite when its new rows Θ_t + Δ_t and π_t and its loss
  (`ClientOutput.checked`) are; one that is not is counted in `num_nonfinite`, keeps Θ_t and π_t, and
  is cut out of the graph for the round as in `gossip`.

  Args:
    loss_fn: per-example loss −log p_θ(y | x) of one component.
    num_components: M ≥ 1.
    graph: a `fedjax_opt.graphs.Graph` (mixed by its `mixing_rule`, default Metropolis–Hastings) or a mixing
      matrix `[N, N]` / sequence `[T, N, N]`, as in `gossip`.
    client_optimizer: every component's local solver (S masked steps).
    init_noise: as in `fedem` (every node starts from the same M components).
    e_step: as in `fedem`: "local" (a node's new π from all its train examples), "round" or "auto".

  Returns:
    `FederatedAlgorithm(init, step)` with state `DFedEMState`; `step` takes every node's data
    (C = N, client_id = arange(N)).
  """
  check_loss_fn(loss_fn)
  m = check_int(num_components, "num_components", 1)
  check_optimizer(client_optimizer, "client_optimizer")
  check_positive(init_noise, "init_noise", allow_zero=True)
  e_step = check_choice(e_step, "e_step", E_STEPS)
  mix = mixing_lib.prepare(graph)
  n = mix.num_nodes
  mode = client_map_lib.FromPolicy()

  def node_update(local, _, data, mask, comps, pi):
    result, new_pi = _client_em(loss_fn, client_optimizer, comps, data, mask, pi, local)
    every_node = result._replace(num_steps=jnp.ones((), jnp.int32))  # every node takes part, with data or not
    return ClientOutput(every_node, rows=(jax.tree.map(jnp.add, comps, result.delta), new_pi), checked=result.loss)

  def summary(table):
    return {"components": jax.tree.map(lambda t: jnp.mean(t, axis=0), table["components"]),
            "weights": jnp.mean(table["weights"], axis=0)}

  def init(params: PyTree, key: jax.Array) -> DFedEMState:
    check_key(key)
    components = _initial_components("d_fedem", params, key, m, init_noise)
    table = {"components": jax.tree.map(lambda c: jnp.broadcast_to(c, (n,) + c.shape), components),
             "weights": jnp.full((n, m), 1.0 / m, jnp.float32)}
    metrics = {"client_loss": jnp.zeros((), jnp.float32), "consensus_distance": jnp.zeros((), jnp.float32),
               "bytes_sent": jnp.zeros((), jnp.float32), "bits_up": jnp.zeros((), jnp.float32),
               "bits_down": jnp.zeros((), jnp.float32), "num_nonfinite": jnp.zeros((), jnp.int32),
               "component_share": jnp.full((m,), 1.0 / m, jnp.float32)}
    return DFedEMState(params=summary(table), local_params=table, round=jnp.zeros((), jnp.int32), key=key,
                       metrics=metrics)

  def step(state: DFedEMState, batches: ClientBatches) -> DFedEMState:
    if isinstance(batches, ClientBatches) and batches.mask.ndim == 3 and batches.num_clients != n:
      raise ValueError(f"d_fedem: the mixing matrix has N = {n} nodes, so batches must hold every node's data, "
                       f"C = N = {n} (row i = node i); got C = {batches.num_clients}.")
    check_full_participation(batches, n, ordered=True)
    comps, weights = state.local_params["components"], state.local_params["weights"]
    data, local = _round_data("d_fedem", e_step, batches.data)
    out = client_round(mode, functools.partial(node_update, local), None,
                       batches.replace(data=data, weight=jnp.ones_like(batches.weight)), tables=(comps, weights))
    ok, num_nonfinite, loss = out.agg.finite, out.agg.num_nonfinite, out.results.loss
    w = mixing_lib.exclude(mixing_lib.at_round(mix, state.round, jnp.result_type(*jax.tree.leaves(comps))), ok)
    new_comps = keep_rows(ok, mixing_lib.mix(w, out.stored[0].table), comps)  # Θ + Δ written where finite
    table = {"components": new_comps, "weights": out.stored[1].table}
    used = ok & (out.results.num_examples > 0)
    message_bytes = mixing_lib.model_bytes(jax.tree.map(lambda t: t[0], comps))  # one node's M components
    sent = jnp.mean(mixing_lib.messages_sent(w).astype(jnp.float32)) * message_bytes
    received = jnp.mean(mixing_lib.messages_received(w).astype(jnp.float32)) * message_bytes
    metrics = {
        "client_loss": finite_mean(loss, used).astype(jnp.float32),
        "consensus_distance": jnp.asarray(mixing_lib.consensus_distance(new_comps), jnp.float32),
        "bytes_sent": jnp.asarray(sent, jnp.float32),
        "bits_up": jnp.asarray(8 * sent, jnp.float32),
        "bits_down": jnp.asarray(8 * received, jnp.float32),
        "num_nonfinite": num_nonfinite,
        "component_share": jnp.mean(table["weights"], axis=0).astype(jnp.float32),
    }
    return DFedEMState(params=summary(table), local_params=table, round=state.round + 1, key=state.key,
                       metrics=metrics)

  return FederatedAlgorithm(init, step)


d_fedem = execution.accepts_policy_keywords(d_fedem, refuses_aggregator=(
    "D-FedEM has no server: every node combines its neighbours' components and mixture weights by the graph's "
    "mixing matrix, which is its aggregation"),
    evaluation="table", exchanges="bytes", hyperparameters={"num_components": execution.COUNT,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "init_noise": execution.SCALE})
