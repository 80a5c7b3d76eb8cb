"""The skeleton shared by algorithms that train clients locally and average their deltas.

FedAvg, FedSGD, FedOpt, FedProx and their kin differ only in what a client
computes from the global model x_t; the round around it is the same:

    results_k = client_update(x_t, data_k, mask_k)          (client_map over k)
    Δ_t, ok   = aggregate_updates(aggregator, Δ_k, n_k)     (non-finite guard)
    x_{t+1}   = x_t + ServerOpt(−Δ_t)                       (unchanged if not ok)

FedNova sends a normalized direction instead of Δ_k and rescales the
aggregate before the server step (`server_delta`).

`averaging_algorithm(client_update, ...)` builds that round once, on
`core.rounds.client_round` (so the round's rules, docs/architecture.md "The
round", are those of every other algorithm). Its state, `AveragingState`, is what FedAvg calls
`FedAvgState` (`fedjax_opt.algorithms.fedavg`). Algorithms that aggregate
their clients the same way but keep more state (SCAFFOLD, FedDyn, Ditto)
build their `init` and `step` from the same two pieces: `initial_fields` and
`aggregated_round`.

What the clients send passes the aggregator whole: a client stage chained
before it (`fo.aggregators.chain(fo.compression.compress(...), ...)`) runs on
each client inside `core.rounds.client_round`, with its per-client tables in
`aggregator_state`. The bits each client sends and receives are in
`state.metrics` (`bits_up`, `bits_down`).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.rounds import ClientOutput, Round, client_round, init_aggregator_state
from fedjax_opt.core.server import apply_server_update, check_aggregator, initial_round_metrics
from fedjax_opt.core.types import Aggregator, ClientBatches, FederatedAlgorithm, PyTree
from fedjax_opt.core.validation import check_client_batches, check_key, check_optimizer

__all__ = ["AveragingState", "aggregated_round", "averaging_algorithm", "initial_fields"]


@flax.struct.dataclass
class AveragingState:
  """Server state of the averaging algorithms (FedSGD / FedAvg / FedOpt, FedProx, FedNova, Per-FedAvg).

  Attributes:
    params: the global model x_t.
    server_opt_state: the server optimizer's state (momentum, v_t, ...).
    aggregator_state: the aggregator's state (`core.rounds.init_aggregator_state`: with a
      client stage, its per-client tables too, e.g. error-feedback residuals).
    round: t, the number of rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: diagnostics of the last round, `core.server.ROUND_METRICS` (plus
      `extra_metrics`, e.g. FedNova's `tau_eff`).
  """

  params: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def initial_fields(params: PyTree, key: jax.Array, aggregator: Aggregator,
                   extra_metrics: tuple[str, ...] = (), messages: int = 1) -> dict[str, Any]:
  """The fields every aggregating algorithm's state starts with, for its `init`.

  `messages` is the number of kinds of message each client sends (2 for SCAFFOLD's Δy_i and Δc_i), the
  client stage's tables `core.rounds.init_aggregator_state` makes.

  Returns:
    `params`, `aggregator_state` = `init_aggregator_state(aggregator, params, messages)`, `round` = 0,
    `key` (checked), `metrics` = `core.server.ROUND_METRICS` zeros plus a
    float32 zero for each name in `extra_metrics`.
  """
  check_key(key)
  return dict(params=params, aggregator_state=init_aggregator_state(aggregator, params, messages), round=jnp.zeros((), jnp.int32), key=key,
              metrics={**initial_round_metrics(), **{name: jnp.zeros((), jnp.float32) for name in extra_metrics}})


def aggregated_round(mode: client_map_lib.ClientMap | str | None, client_update: Callable[..., ClientOutput],
                     shared: PyTree, state: Any, batches: ClientBatches, aggregator: Aggregator, *,
                     tables: tuple = (), rows_follow_round: bool = True) -> tuple[jax.Array, Round]:
  """The start of every aggregating algorithm's `step`: check the batches, split the key, run the clients.

  Args:
    mode, client_update, shared, tables, rows_follow_round: as in `core.rounds.client_round`
      (rows are read in the dtypes of `state.params`).
    state: the algorithm's state (`params`, `aggregator_state`, `key`).
    batches: the round's `ClientBatches` (checked).
    aggregator: the aggregator of the clients' updates.

  Returns:
    `(key, round)`: the state's next key and the `core.rounds.Round`.
  """
  check_client_batches(batches)
  key, agg_key = jax.random.split(state.key)
  return key, client_round(mode, client_update, shared, batches, tables=tables, like=state.params,
                           aggregator=aggregator, aggregator_state=state.aggregator_state, key=agg_key,
                           rows_follow_round=rows_follow_round)


def averaging_algorithm(
    client_update: Callable[[PyTree, PyTree, jax.Array], LocalResult | ClientOutput],
    server_optimizer: optax.GradientTransformation,
    aggregator: Aggregator,
    client_map: client_map_lib.ClientMap | str | None,
    *,
    personalize: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None,
    server_delta: Callable[[Round], tuple[PyTree, dict[str, jax.Array]]] | None = None,
    extra_metrics: tuple[str, ...] = (),
) -> FederatedAlgorithm:
  """Builds init/step of an algorithm that trains clients locally and averages their deltas.

  Args:
    client_update: `client_update(params, data [S, B, ...], mask [S, B]) -> LocalResult`,
      where `params` is the global model x_t at the start of the round; or
      `-> core.rounds.ClientOutput` to aggregate something other than the
      client's delta (`update`) or to hand `extras` to `server_delta`.
    server_optimizer: optax optimizer fed the pseudo-gradient −Δ_t.
    aggregator: an `Aggregator` (the algorithm picks its default).
    client_map: how clients are mapped (`core.client_map.resolve`).
    personalize: passed through to the `FederatedAlgorithm`.
    server_delta: None (Δ_t is the aggregate), or `server_delta(round) ->
      (Δ_t, metrics)`: the Δ_t fed to the server step, made from the
      `core.rounds.Round` (FedNova's τ_eff rescaling), and the metrics it adds.
    extra_metrics: the names of the metrics `server_delta` adds (float32 zeros
      in the initial state).

  Returns:
    `FederatedAlgorithm(init, step, personalize)` with state `AveragingState`.
  """
  check_optimizer(server_optimizer, "server_optimizer")
  check_aggregator(aggregator)
  mode = client_map_lib.resolve(client_map)

  def one_client(params, data, mask):
    out = client_update(params, data, mask)
    return out if isinstance(out, ClientOutput) else ClientOutput(out)

  def init(params: PyTree, key: jax.Array) -> AveragingState:
    return AveragingState(**initial_fields(params, key, aggregator, extra_metrics),
                          server_opt_state=server_optimizer.init(params))

  def step(state: AveragingState, batches: ClientBatches) -> AveragingState:
    key, out = aggregated_round(mode, one_client, state.params, state, batches, aggregator)
    delta, extra = (out.agg.update, {}) if server_delta is None else server_delta(out)
    params, server_opt_state = apply_server_update(
        server_optimizer, state.params, state.server_opt_state, delta, out.agg.accepted)
    return AveragingState(
        params=params,
        server_opt_state=server_opt_state,
        aggregator_state=out.agg.state,
        round=state.round + 1,
        key=key,
        metrics={**out.metrics(delta), **extra},
    )

  return FederatedAlgorithm(init, step, personalize)
