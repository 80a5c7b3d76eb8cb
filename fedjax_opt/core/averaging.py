"""The skeleton shared by algorithms that train clients locally and average their deltas.

FedAvg, FedSGD, FedOpt, FedProx and their kin differ only in what a client
computes from the global model x_t; the round around it is the same:

    results_k = client_update(x_t, data_k, mask_k)          (client_map over k)
    Δ_t, ok   = aggregate_updates(aggregator, Δ_k, n_k)     (non-finite guard)
    x_{t+1}   = x_t + ServerOpt(−Δ_t)                       (unchanged if not ok)

`averaging_algorithm(client_update, ...)` builds that round once.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.server import aggregate_updates, apply_server_update, initial_round_metrics, round_metrics
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, PyTree
from fedjax_opt.core.validation import check_client_batches, check_key, check_optimizer


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


def averaging_algorithm(
    client_update: Callable[[PyTree, PyTree, jax.Array], LocalResult],
    server_optimizer: optax.GradientTransformation,
    aggregator: aggregators_lib.Aggregator | None,
    client_map: client_map_lib.ClientMap | str | None,
) -> FederatedAlgorithm:
  """Builds init/step of an algorithm that trains clients locally and averages their deltas.

  Args:
    client_update: `client_update(params, data [S, B, ...], mask [S, B]) -> LocalResult`,
      where `params` is the global model x_t at the start of the round.
    server_optimizer: optax optimizer fed the pseudo-gradient −Δ_t.
    aggregator: default `aggregators.weighted_mean()`.
    client_map: how clients are mapped (`core.client_map.resolve`).

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedAvgState`.
  """
  check_optimizer(server_optimizer, "server_optimizer")
  aggregator = aggregators_lib.resolve(aggregator, aggregators_lib.weighted_mean)
  mode = client_map_lib.resolve(client_map)

  def init(params: PyTree, key: jax.Array) -> FedAvgState:
    check_key(key)
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


