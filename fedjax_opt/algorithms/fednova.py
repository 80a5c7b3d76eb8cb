"""FedNova: normalized averaging for clients that run different numbers of local steps.

Wang, Liu, Liang, Joshi, Poor. "Tackling the Objective Inconsistency Problem
in Heterogeneous Federated Optimization." NeurIPS 2020. arXiv:2007.07481.

When client i runs τ_i local steps, FedAvg's average Σ p_i Δ_i weights each
client by how far it walked, so it converges to a stationary point of the
surrogate Σ_i (p_i τ_i / Σ_j p_j τ_j) f_i instead of F = Σ_i p_i f_i
(objective inconsistency). FedNova writes each client's change as
Δ_i = −η G_i a_i (G_i: the τ_i stochastic gradients, a_i: how the local
solver combines them), averages the *normalized* directions and rescales:

    d_i   = Δ_i / ‖a_i‖₁
    Δ_t   = τ_eff Σ_i p_i d_i,        τ_eff = Σ_i p_i ‖a_i‖₁
    x_{t+1} = x_t + ServerOpt(−Δ_t)   (optax.sgd(1.0): x_t + Δ_t)

with p_i = n_i / Σ_{j∈S} n_j over the clients that take part. Local solvers:

    plain SGD (momentum ρ = 0):   a_i = (1, …, 1),  ‖a_i‖₁ = τ_i
    heavy-ball SGD, u ← ρ u + g, y ← y − η u:
        a_{i,k} = (1 − ρ^{τ_i − k}) / (1 − ρ),   ‖a_i‖₁ = [τ_i − ρ (1 − ρ^{τ_i}) / (1 − ρ)] / (1 − ρ)

τ_i is each client's *actual* number of non-empty local steps (padding
steps, a straggler's cut steps or a small client's missing steps do not
count), so stragglers (`fedjax_opt.data.stragglers`) are normalized by the
work they did. With equal τ_i, τ_eff = τ and FedNova is FedAvg. A client with
τ_i = 0 took no step (docs/architecture.md, "The round").

The round is FedAvg's (`core.averaging` on `core.rounds.client_round`): the
clients send d_i (and ‖a_i‖₁ beside it), the aggregate is rescaled by τ_eff
before the server step. The state is `core.averaging.AveragingState`
(`FedAvgState`), whose metrics add `tau_eff`.

A compressing client stage (`aggregator=fo.aggregators.chain(fo.compression.compress(C, ...), ...)`)
acts on the message d_i, as for FedAvg: client i sends d̂_i = C(d_i) (with error feedback C(d_i + e_i),
e_i ← d_i + e_i − d̂_i, the residual kept in units of the normalized
direction), and Δ_t = τ_eff Σ_i p_i d̂_i. The scalar ‖a_i‖₁ (a function of
τ_i) is sent as it is; `bits_up` counts the message d_i only, with or
without compression.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.aggregators.base import normalized_sum
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.averaging import averaging_algorithm
from fedjax_opt.core.local import local_train
from fedjax_opt.core.rounds import ClientOutput, Round
from fedjax_opt.core.types import FederatedAlgorithm, LossFn
from fedjax_opt.core.validation import check_in_range, check_loss_fn, check_positive

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `fednova` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["fednova", "local_solver_norm"]


def local_solver_norm(num_steps: jax.Array, rho: Any = 0.0) -> jax.Array:
  """‖a_i‖₁ of local SGD with heavy-ball momentum ρ after τ = `num_steps` steps (τ for ρ = 0).

  ‖a‖₁ = Σ_{k=0}^{τ−1} (1 − ρ^{τ−k}) / (1 − ρ) = [τ − ρ (1 − ρ^τ) / (1 − ρ)] / (1 − ρ).
  """
  tau = jnp.asarray(num_steps, jnp.result_type(float))
  rho = jnp.asarray(rho, tau.dtype)
  return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


def fednova(
    loss_fn: LossFn,
    eta: Any,
    rho: Any = 0.0,
    *,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: aggregators_lib.Aggregator | None = None,
) -> FederatedAlgorithm:
  """FedNova (Wang et al. 2020): local (momentum) SGD, updates normalized by ‖a_i‖₁ and rescaled by τ_eff.

  The local solver is the paper's (momentum) SGD with a bare step size η:
  the normalization ‖a_i‖₁ is the sum of that solver's gradient coefficients
  (τ_i for SGD, `local_solver_norm` with momentum ρ), which another optax
  optimizer would not have.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    eta: η > 0, the local step size (may be traced).
    rho: ρ ∈ [0, 1), heavy-ball momentum of the local solver
      (`optax.sgd(η, momentum=ρ)`); 0 is plain SGD. May be traced.
    server_optimizer: optax optimizer fed −Δ_t; default `optax.sgd(1.0)`
      (x_{t+1} = x_t + Δ_t); any optax rule, e.g. `server_optimizers.fedavgm`,
      applies to the normalized Δ_t.
    aggregator: how the normalized d_i are combined; default
      `aggregators.weighted_mean()` (p_i ∝ n_i). τ_eff always uses p_i ∝ n_i
      over the clients taking part.

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedAvgState` (`core.averaging.AveragingState`);
    its metrics are `core.server.ROUND_METRICS` (update_norm = ‖Δ_t‖) plus `tau_eff`.
  """
  check_loss_fn(loss_fn)
  check_positive(eta, "eta")
  check_in_range(rho, "rho", 0.0, 1.0)
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else server_optimizer
  plain = isinstance(rho, (int, float)) and rho == 0
  client_optimizer = optax.sgd(eta) if plain else optax.sgd(eta, momentum=rho)

  def client_update(x, data, mask):
    result = local_train(loss_fn, client_optimizer, x, data, mask)
    norm_a = local_solver_norm(result.num_steps, rho)
    scale = 1 / jnp.maximum(norm_a, 1e-30)  # τ_i = 0: Δ_i = 0 and d_i = 0 (the client takes no part)
    direction = jax.tree.map(lambda d: (d * scale).astype(d.dtype), result.delta)
    return ClientOutput(result, update=direction, extras=norm_a)

  def rescale(out: Round):
    used = jnp.where(out.agg.finite, out.weights, jnp.zeros_like(out.weights))
    tau_eff = normalized_sum(out.extras, used)
    delta = jax.tree.map(lambda d: (tau_eff * d).astype(d.dtype), out.agg.update)
    return delta, {"tau_eff": tau_eff.astype(jnp.float32)}

  return averaging_algorithm(client_update, server_optimizer,
                             aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR),
                             client_map_lib.FromPolicy(),
                             server_delta=rescale, extra_metrics=("tau_eff",))


fednova = execution.accepts_policy_keywords(fednova, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="global", exchanges=(1, 1), hyperparameters={"eta": execution.CLIENT_STEP_SIZE,
        "rho": execution.MOMENTUM, "server_optimizer": execution.SERVER_OPTIMIZER})
