"""The skeleton shared by algorithms that train clients locally and average their deltas.

FedAvg, FedSGD, FedOpt, FedProx and their kin differ only in what a client
computes from the global model x_t; the round around it is the same:

    results_k = client_update(x_t, data_k, mask_k)          (client_map over k)
    Δ_t, ok   = aggregate_updates(aggregator, Δ_k, n_k)     (non-finite guard)
    x_{t+1}   = x_t + ServerOpt(−Δ_t)                       (unchanged if not ok)

FedNova sends a normalized direction instead of Δ_k and rescales the
aggregate before the server step (`server_delta`).

`averaging_algorithm(client_update, ...)` builds that round once, on
`core.rounds.client_round` (so the no-step and non-finite rules are those of
every other algorithm). Its state, `AveragingState`, is what FedAvg calls
`FedAvgState` (`fedjax_opt.algorithms.fedavg`). Algorithms that aggregate
their clients the same way but keep more state (SCAFFOLD, FedDyn, Ditto)
build their `init` and `step` from the same two pieces: `initial_fields` and
`aggregated_round`.

Compression (`compression=fo.compression.compressed(...)`): each client
sends C(Δ_k) (or, with error feedback, C(Δ_k + e_k) and keeps
e_k ← Δ_k + e_k − C(Δ_k + e_k)) in place of Δ_k, before the aggregator
(`core.rounds.client_round`); the residual table e `[N, ...]` is
`AveragingState.residuals` (None without error feedback). The bits each
client sends and receives are in `state.metrics` (`bits_up`, `bits_down`)
with or without compression.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.rounds import ClientOutput, Round, client_round
from fedjax_opt.core.server import apply_server_update, check_aggregator, initial_round_metrics
from fedjax_opt.core.types import Aggregator, ClientBatches, FederatedAlgorithm, PyTree
from fedjax_opt.core.validation import check_client_batches, check_key, check_optimizer

__all__ = ["AveragingState", "aggregated_round", "averaging_algorithm", "initial_fields", "initial_residuals"]


@flax.struct.dataclass
class AveragingState:
  """Server state of the averaging algorithms (FedSGD / FedAvg / FedOpt, FedProx, FedNova, Per-FedAvg).

  Attributes:
    params: the global model x_t.
    server_opt_state: the server optimizer's state (momentum, v_t, ...).
    aggregator_state: the aggregator's state (e.g. error-feedback residuals).
    round: t, the number of rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: diagnostics of the last round, `core.server.ROUND_METRICS` (plus
      `extra_metrics`, e.g. FedNova's `tau_eff`).
    residuals: the error-feedback residuals e_i, a per-client table like the
      model with leaves `[N, ...]` (`fedjax_opt.compression`); None unless the
      algorithm compresses with error feedback.
  """

  params: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]
  residuals: PyTree = None


def initial_fields(params: PyTree, key: jax.Array, aggregator: Aggregator,
                   extra_metrics: tuple[str, ...] = ()) -> dict[str, Any]:
  """The fields every aggregating algorithm's state starts with, for its `init`.

  Returns:
    `params`, `aggregator_state` = `aggregator.init(params)`, `round` = 0,
    `key` (checked), `metrics` = `core.server.ROUND_METRICS` zeros plus a
    float32 zero for each name in `extra_metrics`.
  """
  check_key(key)
  return dict(params=params, aggregator_state=aggregator.init(params), round=jnp.zeros((), jnp.int32), key=key,
              metrics={**initial_round_metrics(), **{name: jnp.zeros((), jnp.float32) for name in extra_metrics}})


def aggregated_round(mode: client_map_lib.ClientMap | str | None, client_update: Callable[..., ClientOutput],
                     shared: PyTree, state: Any, batches: ClientBatches, aggregator: Aggregator, *,
                     tables: tuple = (), rows_follow_round: bool = True, compression: Any = None,
                     uploads: int = 1) -> tuple[jax.Array, Round]:
  """The start of every aggregating algorithm's `step`: check the batches, split the key, run the clients.

  Args:
    mode, client_update, shared, tables, rows_follow_round, compression, uploads: as in
      `core.rounds.client_round` (rows are read in the dtypes of `state.params`; the residual
      table, with error feedback, is `state.residuals`).
    state: the algorithm's state (`params`, `aggregator_state`, `key`).
    batches: the round's `ClientBatches` (checked).
    aggregator: the aggregator of the clients' updates.

  Returns:
    `(key, round)`: the state's next key and the `core.rounds.Round`.
  """
  check_client_batches(batches)
  key, agg_key = jax.random.split(state.key)
  residuals = getattr(state, "residuals", None) if compression is not None else None
  return key, client_round(mode, client_update, shared, batches, tables=tables, like=state.params,
                           aggregator=aggregator, aggregator_state=state.aggregator_state, key=agg_key,
                           rows_follow_round=rows_follow_round, compression=compression, residuals=residuals,
                           uploads=uploads)


def initial_residuals(params: PyTree, compression: Any) -> PyTree:
  """The error-feedback residual table e = 0 `[N, ...]` for `init`; None without error feedback."""
  if compression is None or not compression.error_feedback:
    return None
  return per_client.init(params, compression.num_clients, storage_dtype=compression.storage_dtype)


def averaging_algorithm(
    client_update: Callable[[PyTree, PyTree, jax.Array], LocalResult | ClientOutput],
    server_optimizer: optax.GradientTransformation,
    aggregator: Aggregator,
    client_map: client_map_lib.ClientMap | str | None,
    *,
    personalize: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None,
    server_delta: Callable[[Round], tuple[PyTree, dict[str, jax.Array]]] | None = None,
    extra_metrics: tuple[str, ...] = (),
    compression: Any = None,
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
    compression: None, or `fedjax_opt.compression.compressed(compressor, error_feedback=...,
      num_clients=N)`: what each client sends in place of its update (module docstring).

  Returns:
    `FederatedAlgorithm(init, step, personalize)` with state `AveragingState`.
  """
  check_optimizer(server_optimizer, "server_optimizer")
  check_aggregator(aggregator)
  from fedjax_opt.compression import check_compression  # pylint: disable=import-outside-toplevel
  compression = check_compression(compression)
  mode = client_map_lib.resolve(client_map)

  def one_client(params, data, mask):
    out = client_update(params, data, mask)
    return out if isinstance(out, ClientOutput) else ClientOutput(out)

  def init(params: PyTree, key: jax.Array) -> AveragingState:
    return AveragingState(**initial_fields(params, key, aggregator, extra_metrics),
                          server_opt_state=server_optimizer.init(params),
                          residuals=initial_residuals(params, compression))

  def step(state: AveragingState, batches: ClientBatches) -> AveragingState:
    key, out = aggregated_round(mode, one_client, state.params, state, batches, aggregator,
                                compression=compression)
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
        residuals=None if out.residuals is None else out.residuals.table,
    )

  return FederatedAlgorithm(init, step, personalize)
