"""FedSGD, FedAvg and FedOpt: local training, averaging, and a server optax step.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas. "Communication-Efficient
Learning of Deep Networks from Decentralized Data." AISTATS 2017.
arXiv:1602.05629. (FedSGD and FedAvg.)

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan. "Adaptive
Federated Optimization." ICLR 2021. arXiv:2003.00295. (FedOpt: any server
optimizer on the pseudo-gradient.)

One round t with participating clients S_t:

    client k:  x_k^0 = x_t;  x_k^{s+1} = ClientOpt(x_k^s, ∇f_{k,s}(x_k^s)),  s < S
               Δ_k = x_k^S − x_t
    server:    Δ_t = Σ_k n_k Δ_k / Σ_k n_k          (default; `aggregators.mean()` for 1/|S_t|)
               x_{t+1} = x_t + ServerOpt(−Δ_t)

With `server_optimizer=optax.sgd(1.0)` this is FedAvg; with the optimizers of
`fedjax_opt.server_optimizers` it is FedAvgM / FedAdagrad / FedAdam / FedYogi.
FedSGD is the case of one full-batch gradient per client: Δ_k = −∇f_k(x_t),
so the server step is SGD (or any optax rule) on the weighted mean gradient.

Clients whose update is non-finite are dropped and counted (see
`fedjax_opt.core.server`); `state.metrics` holds `core.server.ROUND_METRICS`.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.local import LocalResult, as_single_step, local_train
from fedjax_opt.core.server import aggregate_updates, apply_server_update, initial_round_metrics, round_metrics
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_client_batches


@flax.struct.dataclass
class FedAvgState:
  """Server state of FedSGD / FedAvg / FedOpt.

  Attributes:
    params: the global model x_t.
    server_opt_state: the server optimizer's state (momentum, v_t, ...).
    aggregator_state: the aggregator's state (e.g. error-feedback residuals).
    round: t, the number of rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: diagnostics of the last round, `core.server.ROUND_METRICS`.
  """

  params: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _check_optimizer(opt: Any, name: str) -> None:
  if not (hasattr(opt, "init") and hasattr(opt, "update")):
    raise TypeError(f"{name} must be an optax.GradientTransformation (with init and update); got {type(opt).__name__}.")


def _check_key(key: Any) -> None:
  if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
    return
  if tuple(jnp.shape(key)) != (2,) or jnp.result_type(key) != jnp.uint32:
    raise TypeError(f"key must be a PRNG key (jax.random.key(0) or jax.random.PRNGKey(0)); got shape "
                    f"{tuple(jnp.shape(key))} dtype {jnp.result_type(key)}.")


def _averaging_algorithm(
    client_update: Callable[[PyTree, PyTree, jax.Array], LocalResult],
    server_optimizer: optax.GradientTransformation,
    aggregator: aggregators_lib.Aggregator | None,
    client_map: client_map_lib.ClientMap | str | None,
) -> FederatedAlgorithm:
  """Builds init/step around `client_update(params, data [S,B,...], mask [S,B]) -> LocalResult`."""
  _check_optimizer(server_optimizer, "server_optimizer")
  aggregator = aggregators_lib.weighted_mean() if aggregator is None else aggregator
  if not isinstance(aggregator, aggregators_lib.Aggregator):
    raise TypeError(f"aggregator must be a fedjax_opt.aggregators.Aggregator; got {type(aggregator).__name__}.")
  mode = client_map_lib.resolve(client_map)

  def init(params: PyTree, key: jax.Array) -> FedAvgState:
    _check_key(key)
    return FedAvgState(
        params=params,
        server_opt_state=server_optimizer.init(params),
        aggregator_state=aggregator.init(params),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics=initial_round_metrics(),
    )

  def step(state: FedAvgState, batches: ClientBatches) -> FedAvgState:
    check_client_batches(batches)
    key, agg_key = jax.random.split(state.key)
    results = client_map_lib.map_clients(
        mode, lambda params, client: client_update(params, *client), state.params, (batches.data, batches.mask))
    agg = aggregate_updates(aggregator, results.delta, batches.weight, state.aggregator_state, agg_key)
    params, server_opt_state = apply_server_update(
        server_optimizer, state.params, state.server_opt_state, agg.update, agg.accepted)
    return FedAvgState(
        params=params,
        server_opt_state=server_opt_state,
        aggregator_state=agg.state,
        round=state.round + 1,
        key=key,
        metrics=round_metrics(results.loss, results.num_examples, batches.weight, agg),
    )

  return FederatedAlgorithm(init, step)


def fedavg(
    loss_fn: LossFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: aggregators_lib.Aggregator | None = None,
    *,
    client_map: client_map_lib.ClientMap | str | None = None,
    unroll: int | bool = 1,
) -> FederatedAlgorithm:
  """Federated Averaging / FedOpt: S masked local steps per client, then a server optax step on −Δ.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    client_optimizer: optax optimizer for local steps (e.g. `optax.sgd(client_lr)`),
      re-initialized on every client every round.
    server_optimizer: optax optimizer fed the pseudo-gradient −Δ_t. Default
      `optax.sgd(1.0)` (FedAvg); see `fedjax_opt.server_optimizers` for
      FedAvgM / FedAdagrad / FedAdam / FedYogi.
    aggregator: how client deltas are combined. Default
      `aggregators.weighted_mean()` (by `batches.weight`, n_k); `aggregators.mean()`
      for the uniform 1/|S_t| average of Reddi et al.
    client_map: how clients are mapped ("auto", "vmap", "sequential", "chunked:K"
      or a mode from `fedjax_opt.core.client_map`).
    unroll: `lax.scan` unroll of the local steps.

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedAvgState`.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable loss_fn(params, batch) -> [B]; got {type(loss_fn).__name__}.")
  _check_optimizer(client_optimizer, "client_optimizer")
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer

  def client_update(params, data, mask):
    return local_train(loss_fn, client_optimizer, params, data, mask, unroll=unroll)

  return _averaging_algorithm(client_update, server_optimizer, aggregator, client_map)


def fedsgd(
    loss_fn: LossFn,
    *,
    server_optimizer: optax.GradientTransformation,
    aggregator: aggregators_lib.Aggregator | None = None,
    client_map: client_map_lib.ClientMap | str | None = None,
) -> FederatedAlgorithm:
  """FedSGD: each client sends the gradient of its mean loss over all its examples in the round.

  Δ_k = −∇f_k(x_t) over all S·B slots of the client's batches (mask applied),
  then x_{t+1} = x_t + ServerOpt(−Δ_t): with `optax.sgd(η)` and the weighted
  mean, x_{t+1} = x_t − η Σ_k n_k ∇f_k(x_t) / Σ_k n_k, one step of gradient
  descent on the pooled data of the round.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    server_optimizer: optax optimizer fed the mean gradient (e.g. `optax.sgd(lr)`).
    aggregator: default `aggregators.weighted_mean()`.
    client_map: how clients are mapped (see `fedavg`).

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedAvgState`.
  """
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable loss_fn(params, batch) -> [B]; got {type(loss_fn).__name__}.")
  one_gradient = optax.sgd(1.0)

  def client_update(params, data, mask):
    return local_train(loss_fn, one_gradient, params, *as_single_step(data, mask))

  return _averaging_algorithm(client_update, server_optimizer, aggregator, client_map)
