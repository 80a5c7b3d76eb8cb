"""pFedMe: personalized models regularized by Moreau envelopes.

Dinh, Tran, Nguyen. "Personalized Federated Learning with Moreau Envelopes."
NeurIPS 2020. arXiv:2006.08848.

Client i's personalized model θ_i solves the proximal problem around its
local copy w_i of the global model; the global model minimises the average
Moreau envelope F_i(w) = min_θ f_i(θ) + λ/2 ‖θ − w‖². One round t (Algorithm 1):

    client i:  w_{i,0} = w_t
               for r = 0 … R−1, with the client's r-th batch D_r:
                 θ_i ≈ argmin_θ f_i(θ; D_r) + λ/2 ‖θ − w_{i,r}‖²      (K gradient steps, step size ν)
                 w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ_i)
    server:    w_{t+1} = (1 − β) w_t + β (1/|S|) Σ_{i∈S} w_{i,R}

The inner solve is `core.local.local_train` with `optax.sgd(ν)` on K copies
of D_r and the proximal gradient λ(θ − w_{i,r}) as its `gradient_correction`.
θ starts at w_t each round and is warm-started across the R local steps (as
in the authors' code). A local step whose batch is empty is skipped. The
round is `core.rounds.client_round` (its rules: docs/architecture.md, "The
round"; the aggregator seam, default `aggregators.mean()`, the paper's uniform mean),
then `optax.sgd(β)` on the pseudo-gradient:
w_t + β Δ̄ = (1 − β) w_t + β mean w_{i,R}.

Personalized models: the last θ_i of every client is kept in a per-client
table `state.local_params` (initialized to the initial global model).
Evaluate client i with `fo.personalized_params(state, i)`.

Who solves its personal problem (`personalize_all`). In the paper's
Algorithm 1 *every* client i = 1 … N runs the R local steps each round
(updating θ_i and its local w_i), and the server aggregates the w_{i,R} of a
sampled subset S_t only. `personalize_all=True` is that form: the round's
batches hold the clients that compute (all N for the paper's form, each
client once) and `batches.weight` marks the sampled ones — weight > 0:
sampled, aggregated and its θ_i written; weight 0 with data: not sampled, its
θ_i still written (its w_{i,R} is discarded). A row writes its θ_i when it
took at least one local step and its w_{i,R} and θ_i are finite,
independently of whether the round was accepted (a departure from the
library's rule, docs/architecture.md "The round"); a padding row must
therefore carry an empty mask (zero weight alone does not make it padding). With `fo.train` use
`fo.Sampling(client_sampling="all", ...)` and zero the weights of the rows outside S_t, e.g.
`batches.replace(weight=jnp.where(sampled, batches.weight, 0))`.
`personalize_all=False` (the default, the behaviour kept from earlier
versions) lets only the sampled clients compute: weight-0 rows do nothing,
and θ_i is written as any per-client row under the library's rules.

Fixed point: with exact inner solves θ_i(w) = (A_i + λI)⁻¹(b_i + λw) on
quadratics f_i(θ) = ½θᵀA_iθ − b_iᵀθ, one local step and full participation,
w is stationary iff Σ_i λ(w − θ_i(w)) = 0 (tested in tests/test_pfedme.py).
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
from fedjax_opt.core import per_client
from fedjax_opt.core.local import LocalResult, local_train
from fedjax_opt.core.averaging import aggregated_round, initial_downlink_error, initial_fields, server_step
from fedjax_opt.core.rounds import ClientOutput
from fedjax_opt.core.server import finite_clients
from fedjax_opt.core.tree import select_tree
from fedjax_opt.core.types import Aggregator, ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_choice, check_int, check_loss_fn, check_num_clients, check_positive

_DEFAULT_AGGREGATOR = aggregators_lib.mean
"""The rule `pfedme` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["PFedMeState", "pfedme"]


@flax.struct.dataclass
class PFedMeState:
  """Server state of pFedMe.

  Attributes:
    params: the global model w_t.
    local_params: the θ_i, a per-client table (leaves `[N, ...]`).
    server_opt_state: state of `optax.sgd(β)`.
    aggregator_state: the aggregator's state.
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` (client_loss: the personal objective's
      data term f_i(θ; D_r) averaged over the inner steps).
    downlink_error: as `core.averaging.AveragingState.downlink_error`.
  """

  params: PyTree
  local_params: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]
  downlink_error: Any = None


def _client_update(loss_fn: LossFn, lam: Any, eta: Any, inner_steps: int, inner_lr: Any):
  """`client_update(w_t, data [R, B, ...], mask [R, B])` of `client_round`: Δ_i = w_{i,R} − w_t, new θ_i (extras)."""
  inner_optimizer = optax.sgd(inner_lr)

  def one_local_step(carry, inputs):
    w_i, theta, loss_sum = carry
    batch, mask = inputs
    repeat = lambda a: jnp.broadcast_to(a, (inner_steps,) + a.shape)
    prox = lambda th: jax.tree.map(lambda a, b: lam * (a - b), th, w_i)  # ∇ of λ/2 ‖θ − w_i‖²
    solve = local_train(loss_fn, inner_optimizer, theta, jax.tree.map(repeat, batch), repeat(mask),
                        gradient_correction=prox)
    new_theta = jax.tree.map(jnp.add, theta, solve.delta)
    new_w = jax.tree.map(lambda w, th: w - eta * lam * (w - th), w_i, new_theta)
    has_data = jnp.any(mask)
    count = jnp.sum(mask, dtype=solve.loss.dtype)
    return (select_tree(has_data, new_w, w_i), select_tree(has_data, new_theta, theta),
            loss_sum + solve.loss * count), has_data

  def update(w, data, mask):  # θ_i restarts from w_t: the stored row is only written (`step` scatters θ_i)
    init = (w, w, jnp.zeros((), jnp.result_type(float)))
    (w_i, theta, loss_sum), used = jax.lax.scan(one_local_step, init, (data, mask))
    n = jnp.sum(mask, dtype=loss_sum.dtype)
    result = LocalResult(delta=jax.tree.map(jnp.subtract, w_i, w), loss=loss_sum / jnp.maximum(n, 1),
                         num_examples=n, num_steps=jnp.sum(used, dtype=jnp.int32))
    return ClientOutput(result, extras=theta)

  return update


def pfedme(
    loss_fn: LossFn,
    lam: Any,
    eta: Any,
    beta: Any,
    *,
    num_clients: int,
    local_steps: int,
    inner_steps: int,
    inner_lr: Any,
    personalize_all: bool = False,
    aggregator: Aggregator | None = None,
) -> FederatedAlgorithm:
  """pFedMe (Dinh et al. 2020): proximal personalized models θ_i, local steps on w_i, β-mixed averaging.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    lam: λ > 0, the Moreau-envelope regularization (may be traced).
    eta: η > 0, the local step size of w_i (may be traced). A bare step
      size: the paper's local update w ← w − ηλ(w − θ_i) is a gradient step
      on the Moreau envelope, whose gradient λ(w − θ_i) is known in closed
      form, not an optimizer's step.
    beta: β > 0, the server mixing (β = 1: plain averaging; the paper uses β ≥ 1).
    num_clients: N, rows of the θ_i table.
    local_steps: R ≥ 1 (Python int); `batches` must have S = R local steps.
    inner_steps: K ≥ 1, gradient steps of the inner solve (Python int).
    inner_lr: ν > 0, the step size of the inner solve (plain gradient descent
      on the proximal problem, as in the paper; K and ν decide how accurately
      θ_i is found, ν(L + λ) < 2 for convergence).
    personalize_all: False (default): only the rows with weight > 0 compute
      and write θ_i. True (the paper's Algorithm 1): every row that takes a
      local step updates its θ_i; only the rows with weight > 0 (the sampled
      S_t) are aggregated (module docstring: how to give the batches).
    aggregator: default `aggregators.mean()`.

  Returns:
    `FederatedAlgorithm(init, step)` with state `PFedMeState`.
  """
  check_loss_fn(loss_fn)
  for value, name in ((lam, "lam"), (eta, "eta"), (beta, "beta"), (inner_lr, "inner_lr")):
    check_positive(value, name)
  num_clients = check_num_clients(num_clients)
  check_choice(personalize_all, "personalize_all", (False, True))
  local_steps = check_int(local_steps, "local_steps")
  inner_steps = check_int(inner_steps, "inner_steps")
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)
  mode = client_map_lib.FromPolicy()
  server_optimizer = optax.sgd(beta)
  client_update = _client_update(loss_fn, lam, eta, inner_steps, inner_lr)

  def init(params: PyTree, key: jax.Array) -> PFedMeState:
    return PFedMeState(**initial_fields(params, key, aggregator),
                       local_params=per_client.broadcast(params, num_clients),
                       server_opt_state=server_optimizer.init(params),
                      downlink_error=initial_downlink_error(aggregator, params))

  def step(state: PFedMeState, batches: ClientBatches) -> PFedMeState:
    if isinstance(batches, ClientBatches) and jnp.ndim(batches.mask) == 3 and batches.local_steps != local_steps:
      raise ValueError(f"pfedme(local_steps={local_steps}) needs batches with S = local_steps; "
                       f"got S = {batches.local_steps}.")
    key, out = aggregated_round(mode, client_update, state.params, state, batches, aggregator)
    theta = out.extras
    # personalize_all: stepped with a finite w_{i,R}, sampled or not; else out.write (took part, round accepted).
    computed = (out.results.num_steps > 0) & out.agg.finite if personalize_all else out.write
    stored = per_client.scatter(state.local_params, batches.client_id, theta, finite_clients(theta, ok=computed)[0])
    params, server_opt_state, downlink_error, out = server_step(aggregator, server_optimizer, state, out.agg.update,
                                                                out)
    return PFedMeState(params=params, local_params=stored.table, server_opt_state=server_opt_state,
                       aggregator_state=out.agg.state, round=state.round + 1, key=key, metrics=out.metrics(),
                       downlink_error=downlink_error)

  return FederatedAlgorithm(init, step)


pfedme = execution.accepts_policy_keywords(pfedme, storage_dtype=True, default_aggregator=_DEFAULT_AGGREGATOR,
    evaluation="table", exchanges=(1, 1), hyperparameters={"lam": execution.REGULARIZER,
        "eta": execution.CLIENT_STEP_SIZE, "beta": execution.MIXING_WEIGHT, "local_steps": execution.COUNT,
        "inner_steps": execution.COUNT, "inner_lr": execution.CLIENT_STEP_SIZE})
