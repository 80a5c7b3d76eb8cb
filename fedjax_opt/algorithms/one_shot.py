"""One-shot averaging: every client solves its own problem, the server averages the solutions once.

Zhang, Duchi, Wainwright. "Divide and Conquer Kernel Ridge Regression: A
Distributed Algorithm with Minimax Optimal Rates." JMLR 16, 2015.
arXiv:1305.5029. (The same estimator for general M-estimation: Zhang, Duchi,
Wainwright, "Communication-Efficient Algorithms for Statistical
Optimization", JMLR 14, 2013, its "average mixture" AVGM.)

Each client k solves its own empirical risk minimisation and the server
averages the solutions, one exchange in all:

    ŵ_k = argmin_w f_k(w)          (f_k the mean loss over client k's real examples of the round)
    w̄   = Σ_k n_k ŵ_k / Σ_k n_k      (n_k = `batches.weight`; the paper's uniform 1/m with equal sizes)

For ridge regression (least squares plus (λ/2)‖w‖² in the per-example loss),
ŵ_k = (X_kᵀX_k/n_k + λI)⁻¹ X_kᵀy_k/n_k in closed form, and w̄ is Zhang et
al.'s divide-and-conquer estimator with the linear kernel (tests/test_one_shot.py
checks it against that closed form in float64 NumPy). The average is
unbiased only to the extent that each ŵ_k is: with IID splits w̄ has the
centralized estimator's rate when each client still has enough data, with
non-IID splits it is the average of different problems' answers and not the
minimiser of the pooled risk.

Local solvers: by default `local_steps` Newton steps from the received model
(`core.newton.newton_solve`; one step with `cg_iters=None` is exact for
least squares and ridge, a few solve logistic regression), or, with
`client_optimizer=`, `local_steps` optax steps of local training
(`core.local.local_train`, step s on batch s mod S) from the received model.

As a `FederatedAlgorithm`, the first round that is accepted is the one
exchange: it sets the model to w̄; every later `step` leaves the model as it
is and sends nothing (bits 0, `metrics["communicated"]` False). A rejected
round (no finite client) leaves the exchange to the next one. The round runs
`core.rounds.client_round` with the n_k-weighted mean, under its rules for
taking part and for non-finite clients (docs/architecture.md, "The round").

Aggregator. The average is `aggregator=` (default `aggregators.weighted_mean()`,
the estimator above): what a client sends, its solution as the difference
ŵ_k − w_0 from the model w_0 it received, passes the library's seam as
FedAvg's Δ_k does (a client stage, DP, secure summation, a robust rule such
as `aggregators.trimmed_mean(β)`), and w̄ = w_0 + Aggregate(ŵ_k − w_0).
Nothing else leaves a client, so every piece composes. The aggregator's
state (`state.aggregator_state`, with a client stage its tables) moves in
the exchange only: later steps send nothing and leave it as it is. With
`fo.privacy.dp_mean`, only the exchange releases anything, but `fo.train`'s
accountant counts every round it runs as a release: train one round (the
exchange) for the ε of the release itself; over more rounds the ε reported
is an upper bound.

Communication (`metrics["bits_up"]`, `["bits_down"]`, per client, float32):
in the exchange a client receives the initial model (32 P) and sends ŵ_k
(32 P); afterwards nothing.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import newton
from fedjax_opt.core.local import LocalResult, cycle_steps, local_train, masked_mean_loss
from fedjax_opt.core.rounds import ClientOutput, client_round, init_aggregator_state
from fedjax_opt.core.server import initial_round_metrics
from fedjax_opt.core.tree import select_tree
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_key, check_loss_fn, check_optimizer,
                                        check_optional_int)

_DEFAULT_AGGREGATOR = aggregators_lib.weighted_mean
"""The rule `one_shot_average` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["OneShotState", "one_shot_average"]


@flax.struct.dataclass
class OneShotState:
  """State of one-shot averaging.

  Attributes:
    params: the model: the initial one until the exchange, w̄ after it.
    aggregator_state: the aggregator's state (`core.rounds.init_aggregator_state`; with a client stage, its
      per-client tables too); changed by the exchange only.
    communicated: scalar bool, True once the exchange has been accepted.
    round: t, steps applied, int32.
    key: PRNG key, carried for the `FederatedAlgorithm` contract (nothing is drawn).
    metrics: `core.server.ROUND_METRICS` of the step (zeros, and no bits, after the exchange) and
      `communicated`, whether this step was the exchange.
  """

  params: PyTree
  aggregator_state: Any
  communicated: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def one_shot_average(
    loss_fn: LossFn,
    *,
    local_steps: int | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    cg_iters: int | None = None,
    aggregator: aggregators_lib.Aggregator | None = None,
) -> FederatedAlgorithm:
  """One-shot averaging of local solutions (Zhang, Duchi, Wainwright 2013, 2015; module docstring).

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]` (include any ridge term per example).
    local_steps: Newton steps (default 1: exact for least squares and ridge) or, with `client_optimizer`, optax
      steps (default S).
    client_optimizer: None (Newton local solver) or any optax optimizer for local training.
    cg_iters: the Newton solver's systems: None directly from the `[P, P]` Hessian, an int by that many CG
      iterations with Hessian-vector products.
    aggregator: how the clients' ŵ_k − w_0 are combined; default `aggregators.weighted_mean()` (by n_k, the
      estimator of the module docstring); `aggregators.mean()` for the paper's uniform 1/m, a robust rule for a
      robust one-shot estimate, any piece of the seam (module docstring, "Aggregator").

  Returns:
    `FederatedAlgorithm(init, step)` with state `OneShotState`.

  Raises:
    TypeError: `local_steps` or `cg_iters` not a Python int, `client_optimizer` not an optax optimizer,
      `aggregator` not an `Aggregator`.
    ValueError: both `client_optimizer` and `cg_iters`.
  """
  check_loss_fn(loss_fn)
  check_optional_int(local_steps, "local_steps")
  check_optional_int(cg_iters, "cg_iters")
  if client_optimizer is not None:
    check_optimizer(client_optimizer, "client_optimizer")
    if cg_iters is not None:
      raise ValueError("one_shot_average: cg_iters sets the Newton solver's CG, but client_optimizer= asks for "
                       "local training instead; give one of them.")
  mode = client_map_lib.FromPolicy()
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)

  def local_solve(w, data, mask):
    if client_optimizer is None:
      batch, m = newton.client_data(data, mask)
      loss, count = masked_mean_loss(loss_fn, w, batch, m)
      new = newton.newton_solve(loss_fn, w, data, mask, steps=1 if local_steps is None else local_steps,
                                cg_iters=cg_iters)
      return LocalResult(delta=jax.tree.map(jnp.subtract, new, w), loss=loss, num_examples=count,
                         num_steps=(count > 0).astype(jnp.int32))
    steps = mask.shape[0] if local_steps is None else local_steps
    return local_train(loss_fn, client_optimizer, w, *cycle_steps(data, mask, steps))

  def init(params: PyTree, key: jax.Array) -> OneShotState:
    check_key(key)
    return OneShotState(params=params, aggregator_state=init_aggregator_state(aggregator, params),
                        communicated=jnp.zeros((), bool), round=jnp.zeros((), jnp.int32), key=key,
                        metrics={**initial_round_metrics(), "communicated": jnp.zeros((), bool)})

  def step(state: OneShotState, batches: ClientBatches) -> OneShotState:
    check_client_batches(batches)
    key, round_key = jax.random.split(state.key)
    w = state.params
    out = client_round(mode, lambda s, d, m: ClientOutput(local_solve(s, d, m)), w, batches, aggregator=aggregator,
                       aggregator_state=state.aggregator_state, key=round_key)
    exchange = ~state.communicated
    accepted = exchange & out.agg.accepted
    params = jax.tree.map(lambda p, d: jnp.where(accepted, p + d, p).astype(p.dtype), w, out.agg.update)
    metrics = out.metrics()
    metrics = {name: jnp.where(exchange, value, jnp.zeros_like(value)) for name, value in metrics.items()}
    return OneShotState(params=params, aggregator_state=select_tree(exchange, out.agg.state, state.aggregator_state),
                        communicated=state.communicated | accepted, round=state.round + 1, key=key,
                        metrics={**metrics, "communicated": exchange})

  return FederatedAlgorithm(init, step)


one_shot_average = execution.accepts_policy_keywords(one_shot_average, default_aggregator=_DEFAULT_AGGREGATOR,
    refuses_downlink=(
        "one-shot averaging takes no server step: the one exchange sets the model to the aggregate, and nothing is "
        "broadcast after it"),
    evaluation="global", exchanges="metrics", hyperparameters={"local_steps": execution.COUNT,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "cg_iters": execution.COUNT})
