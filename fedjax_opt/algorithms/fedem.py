"""FedEM: federated multi-task learning under a mixture of distributions.

Marfoq, Neglia, Bellet, Kameni, Vidal. "Federated Multi-Task Learning under a
Mixture of Distributions." NeurIPS 2021. arXiv:2108.10252.

Model. Each client t's data is drawn from a mixture of M underlying
distributions shared by the whole federation, with its own mixture weights
π_t ∈ Δ^M: p_t(x, y) = Σ_m π_tm p_m(x, y). Component m is learned by a shared
model θ_m (any model with a per-example loss ℓ(θ_m; s) = −log p_θm(y | x),
e.g. softmax cross-entropy), and client t predicts with its own mixture

    p_t(y | x) = Σ_m π_tm p_θm(y | x).

Round k (Algorithm 1 of the paper, with the round's S·B examples of a sampled
client standing for its data):

    E-step (client t, each of its examples s_i):
        q_t(z_i = m) = π_tm exp(−ℓ(θ_m; s_i)) / Σ_m' π_tm' exp(−ℓ(θ_m'; s_i))
    M-step (client t):
        π_tm ← (1/n_t) Σ_i q_t(z_i = m)
        θ_m^t ← LocalSolver(θ_m; Σ_i q_t(z_i = m) ℓ(·; s_i)/n_t),  for every m
                 (S masked steps of the client optimizer on the q-weighted loss, from θ_m)
    server:
        θ_m ← θ_m + ServerOpt(−Σ_t w_t (θ_m^t − θ_m) / Σ_t w_t),  w_t = n_t  (every m at once)

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

Non-finite clients (our rule, as everywhere in the library): a client whose
updates or responsibilities hold a NaN/Inf is dropped from the average,
counted in `num_nonfinite`, and its π_t row keeps its last finite value.

Metrics: `core.server.ROUND_METRICS` plus `component_share` `[M]`, the mean
of the round's aggregated clients' new π_t (how the round's data splits
between the components).

What is not here: D-FedEM (the fully decentralized variant, components
averaged with neighbours through a mixing matrix) is described in the paper
and not implemented; the paper's optional re-weighting of the server average
by responsibilities is not used (its Algorithm 1 averages with n_t).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.averaging import initial_fields
from fedjax_opt.core.local import LocalResult, local_train
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.server import apply_server_update
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_int, check_loss_fn, check_num_clients,
                                        check_optimizer, check_positive)

__all__ = ["FedEMState", "client_params", "fedem", "mixture_model", "responsibilities"]

_WEIGHT_KEY = "__fedem_q"


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


def _perturbed_components(params: PyTree, key: jax.Array, m: int, init_noise: Any) -> PyTree:
  """θ_m = params + init_noise · max(std(leaf), 0.01) · ε_m, ε_m ~ N(0, I): M distinct starting points."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))

  def one(leaf, k):
    scale = init_noise * jnp.maximum(jnp.std(leaf), 0.01).astype(leaf.dtype)
    return leaf[None] + scale * jax.random.normal(k, (m,) + jnp.shape(leaf), leaf.dtype)

  return jax.tree.unflatten(treedef, [one(leaf, k) for leaf, k in zip(leaves, keys)])


def fedem(
    loss_fn: LossFn,
    *,
    num_components: int,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    init_noise: Any = 1.0,
    em_iterations: int = 10,
    aggregator: aggregators_lib.Aggregator | None = None,
    client_map: client_map_lib.ClientMap | str | None = None,
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
    aggregator: default `aggregators.weighted_mean()` (w_t = n_t, the paper's average).
    client_map: how clients are mapped (`fedjax_opt.core.client_map`).

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
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer
  check_optimizer(server_optimizer, "server_optimizer")
  aggregator = aggregators_lib.resolve(aggregator, aggregators_lib.weighted_mean)
  mode = client_map_lib.resolve(client_map)

  def weighted_loss(params, batch):
    rest = {k: v for k, v in batch.items() if k != _WEIGHT_KEY}
    return batch[_WEIGHT_KEY] * loss_fn(params, rest)

  def client_update(components, data, mask, pi):
    q, new_pi, nll = _em_step(loss_fn, components, pi, data, mask)

    def train(theta, q_m):
      return local_train(weighted_loss, client_optimizer, theta, {**data, _WEIGHT_KEY: q_m}, mask)

    results = jax.vmap(train, in_axes=(0, 2))(components, q)  # every component from its θ_m, on q_m
    first = jax.tree.map(lambda a: a[0], results)  # the counts are the same for every component
    result = LocalResult(delta=results.delta, loss=nll, num_examples=first.num_examples, num_steps=first.num_steps)
    return ClientOutput(result, rows=(new_pi,))

  def init(params: PyTree, key: jax.Array) -> FedEMState:
    noise_key = jax.random.fold_in(key, 1)  # the state keeps `key` itself (the library's contract)
    if isinstance(params, dict) and set(params) == {"components", "weights"}:
      components = params["components"]
      if jnp.shape(params["weights"]) != (m,):
        raise ValueError(f"fedem: params['weights'] must have shape [{m}]; got {jnp.shape(params['weights'])}.")
    else:
      components = _perturbed_components(params, noise_key, m, init_noise) if m > 1 else jax.tree.map(
          lambda a: a[None], params)
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
    out = client_round(mode, client_update, components, batches, tables=(state.mixture_weights,),
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
