"""FedProx: local training on a proximal objective that keeps clients near the global model.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "Federated Optimization in
Heterogeneous Networks." MLSys 2020. arXiv:1812.06127.

One round t with participating clients S_t: client k (inexactly) minimizes

    h_k(x; x_t) = f_k(x) + (μ/2) ‖x − x_t‖²

by S masked local steps of its optimizer along ∇f_{k,s}(x) + μ (x − x_t),
starting at x_t; Δ_k = x_k^S − x_t; then, as in FedAvg,

    Δ_t = Σ_k n_k Δ_k / Σ_k n_k,     x_{t+1} = x_t + ServerOpt(−Δ_t).

μ = `mu` ≥ 0; μ = 0 is FedAvg exactly (the correction adds zeros). The
paper lets each device solve its subproblem γ-inexactly; here the amount of
work is the client's real (unmasked) local steps, so a straggler that did
only part of its steps (`fedjax_opt.data.stragglers`) contributes its partial
solution, which is the behaviour the paper argues for. The paper's FedAvg
baseline instead drops stragglers: `fedjax_opt.data.drop_stragglers` with
`fedavg` (or `fedprox` with μ = 0).

The state is FedAvg's (`core.averaging.AveragingState`, `FedAvgState`); `mu`
may be a traced array, so `jax.vmap` over a grid of μ runs as one program.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.aggregators.chain import attach_downlink
from fedjax_opt import compression as compression_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.averaging import averaging_algorithm
from fedjax_opt.core.local import local_train
from fedjax_opt.core.types import FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_loss_fn, check_optimizer, check_positive, check_scalar

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `fedprox` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["fedprox", "proximal_correction"]


def proximal_correction(mu: Any, anchor: PyTree):
  """h(x) = μ (x − x_t): the gradient of (μ/2)‖x − x_t‖², for `local_train`'s `gradient_correction`."""

  def correction(x: PyTree) -> PyTree:
    return jax.tree.map(lambda a, a0: (mu * (a - a0)).astype(jnp.result_type(a)), x, anchor)

  return correction


def fedprox(
    loss_fn: LossFn,
    mu: Any,
    *,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: aggregators_lib.Aggregator | None = None,
    downlink: compression_lib.Compressor | compression_lib.Downlink | None = None,
) -> FederatedAlgorithm:
  """FedProx: S masked local steps on f_k(x) + (μ/2)‖x − x_t‖², then FedAvg's aggregation and server step.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    mu: μ ≥ 0, the proximal coefficient (a float or a traced scalar).
      The paper's grid is {0.001, 0.01, 0.1, 1}.
    client_optimizer: the optax optimizer of the local steps (the paper uses
      `optax.sgd(η)`), re-initialized on every client every round.
    server_optimizer: optax optimizer fed −Δ_t; default `optax.sgd(1.0)`.
    aggregator: default `aggregators.weighted_mean()` (n_k weights).
    downlink: server-to-client compression with error feedback (see `fedavg`);
      the proximal anchor x_t is then the model the client holds, x̂_t.

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedAvgState` (`core.averaging.AveragingState`).
  """
  check_loss_fn(loss_fn)
  check_positive(mu, "mu", allow_zero=True)
  check_scalar(mu, "mu")
  check_optimizer(client_optimizer, "client_optimizer")
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer

  def client_update(params, data, mask):
    return local_train(loss_fn, client_optimizer, params, data, mask,
                       gradient_correction=proximal_correction(mu, params))

  aggregator = attach_downlink(aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR),
                               compression_lib.as_downlink(downlink, "fedprox"), "fedprox")
  return averaging_algorithm(client_update, server_optimizer, aggregator, client_map_lib.FromPolicy())


fedprox = execution.accepts_policy_keywords(fedprox, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="global", exchanges=(1, 1), hyperparameters={"mu": execution.REGULARIZER,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "server_optimizer": execution.SERVER_OPTIMIZER})
