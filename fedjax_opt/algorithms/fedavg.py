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

The round is `core.rounds.client_round` (through `core.averaging`), with the
library's rules for clients that take no step or send a non-finite update
(docs/architecture.md, "The round"); `state.metrics` holds
`core.server.ROUND_METRICS`.
"""

from __future__ import annotations

import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.aggregators.chain import attach_downlink
from fedjax_opt import compression as compression_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.averaging import AveragingState, averaging_algorithm
from fedjax_opt.core.local import as_single_step, local_train
from fedjax_opt.core.types import FederatedAlgorithm, LossFn
from fedjax_opt.core.validation import check_loss_fn, check_optimizer

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `fedavg` and `fedsgd` average with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["FedAvgState", "fedavg", "fedsgd"]

FedAvgState = AveragingState
"""The state of FedAvg and of every algorithm built on `core.averaging` (FedSGD, FedOpt, FedProx, FedNova,
Per-FedAvg): `params`, `server_opt_state`, `aggregator_state`, `round`, `key`, `metrics`."""


def fedavg(
    loss_fn: LossFn,
    *,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: aggregators_lib.Aggregator | None = None,
    downlink: compression_lib.Compressor | compression_lib.Downlink | None = None,
) -> FederatedAlgorithm:
  """Federated Averaging / FedOpt: S masked local steps per client, then a server optax step on −Δ.

  FedAvg has no hyper-parameter of its own beyond its two optimizers, so
  everything after `loss_fn` is keyword-only.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    client_optimizer: ClientOpt, the optax optimizer of the local steps (e.g.
      `optax.sgd(η_l)`), re-initialized on every client every round.
    server_optimizer: ServerOpt, the optax optimizer fed the pseudo-gradient
      −Δ_t. Default `optax.sgd(1.0)` (FedAvg); see `fedjax_opt.server_optimizers`
      for FedAvgM / FedAdagrad / FedAdam / FedYogi.
    aggregator: how client deltas are combined. Default
      `aggregators.weighted_mean()` (by `batches.weight`, n_k); `aggregators.mean()`
      for the uniform 1/|S_t| average of Reddi et al. Compression is a client
      stage chained in front of it: `fo.aggregators.chain(fo.compression.compress(
      fo.compression.top_k(0.01), error_feedback=True, num_clients=N), fo.aggregators.weighted_mean())`.
    downlink: None (the server broadcasts its model), or server-to-client
      compression: a compressor (`fo.compression.top_k(0.01)`: with the
      server's error feedback) or `fo.compression.downlink(compressor,
      error_feedback=False)`. The server broadcasts m_t = C(u_t + e_t), u_t its
      optimizer's step, and keeps e_{t+1} = u_t + e_t − m_t; clients train from
      the model they hold, x̂_{t+1} = x̂_t + m_t (`state.params`);
      `bits_down` is the compressor's count (`core.averaging`, "Downlink").
      The same as chaining it last in `aggregator=`,
      `fo.aggregators.chain(aggregator, fo.compression.downlink(compressor))`,
      the form every factory that compresses its broadcast takes; give it once.

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedAvgState`.
  """
  check_loss_fn(loss_fn)
  check_optimizer(client_optimizer, "client_optimizer")
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer

  def client_update(params, data, mask):
    return local_train(loss_fn, client_optimizer, params, data, mask)

  aggregator = attach_downlink(aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR),
                               compression_lib.as_downlink(downlink, "fedavg"), "fedavg")
  return averaging_algorithm(client_update, server_optimizer, aggregator, client_map_lib.FromPolicy())


fedavg = execution.accepts_policy_keywords(fedavg, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="global", exchanges=(1, 1), hyperparameters={"client_optimizer": execution.CLIENT_OPTIMIZER,
        "server_optimizer": execution.SERVER_OPTIMIZER})


def fedsgd(
    loss_fn: LossFn,
    *,
    server_optimizer: optax.GradientTransformation,
    aggregator: aggregators_lib.Aggregator | None = None,
    downlink: compression_lib.Compressor | compression_lib.Downlink | None = None,
) -> FederatedAlgorithm:
  """FedSGD: each client sends the gradient of its mean loss over all its examples in the round.

  Δ_k = −∇f_k(x_t) over all S·B slots of the client's batches (mask applied),
  then x_{t+1} = x_t + ServerOpt(−Δ_t): with `optax.sgd(η)` and the weighted
  mean, x_{t+1} = x_t − η Σ_k n_k ∇f_k(x_t) / Σ_k n_k, one step of gradient
  descent on the pooled data of the round.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    server_optimizer: ServerOpt, the optax optimizer fed the mean gradient
      (e.g. `optax.sgd(η)`).
    aggregator: default `aggregators.weighted_mean()`.
    downlink: server-to-client compression with error feedback (see `fedavg`).

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedAvgState`.
  """
  check_loss_fn(loss_fn)
  one_gradient = optax.sgd(1.0)

  def client_update(params, data, mask):
    return local_train(loss_fn, one_gradient, params, *as_single_step(data, mask))

  aggregator = attach_downlink(aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR),
                               compression_lib.as_downlink(downlink, "fedsgd"), "fedsgd")
  return averaging_algorithm(client_update, server_optimizer, aggregator, client_map_lib.FromPolicy())


fedsgd = execution.accepts_policy_keywords(fedsgd, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="global", exchanges=(1, 1), hyperparameters={"server_optimizer": execution.SERVER_OPTIMIZER})
