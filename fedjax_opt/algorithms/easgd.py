"""EASGD: elastic averaging of local models around a moving center.

Zhang, Choromanska, LeCun. "Deep learning with Elastic Averaging SGD."
NeurIPS 2015. arXiv:1412.6651.

Each client i keeps its own model x_i (a per-client table); the server keeps
the center x̃. EASGD solves the consensus problem relaxed by an elastic
(quadratic) link between every x_i and the center,

    min_{x_1 … x_p, x̃}  Σ_i f_i(x_i) + (ρ/2) ‖x_i − x̃‖²,

by the paper's synchronous update (its Section 3), with α = ηρ:

    x_i ← x_i − η ∇f_i(x_i) − α (x_i − x̃)
    x̃  ← x̃ + α Σ_i (x_i − x̃)                       (right-hand sides at the old x_i, x̃)

A round here is that update with τ local steps (communication period τ):

    client i (taking part):  d_i = x_i − x̃_t                       (the elastic difference)
                             x_i^τ = τ steps of ClientOpt from x_i   (`core.local.local_train`)
                             x_i ← x_i^τ − α d_i
    server:                  x̃_{t+1} = x̃_t + α Σ_{i taking part} d_i

With τ = 1 and `optax.sgd(η)` on full batches this is exactly that update: the
elastic force and the gradient are both taken at the round's starting point
x_i. This is `elastic_order="end"` (the default): the elastic move is applied
after the local steps.

The paper's Algorithm 1 (asynchronous EASGD, communication period τ) orders
the period the other way: at the start of a period worker i moves
elastically, then runs its τ steps from the moved point. That is
`elastic_order="start"`:

    client i (taking part):  d_i = x_i − x̃_t
                             x_i ← x_i − α d_i                      (the elastic move first)
                             x_i ← τ steps of ClientOpt from x_i
    server:                  x̃_{t+1} = x̃_t + α Σ_{i taking part} d_i   (the same center update)

Both orders keep the elastic difference of the round's start, so the center
moves identically given the x_i; they differ in where the gradients are taken
(at x_i, or at x_i − α d_i), already at τ = 1. "end" is the default because
its τ = 1 case is the paper's synchronous update (Section 3) exactly.

On quadratic f_i with full-batch gradient descent, "end" and τ = 1, a fixed
point satisfies

    ∇f_i(x_i) + ρ (x_i − x̃) = 0 for every i,    Σ_i (x_i − x̃) = 0,    ρ = α / η,

so the center is the mean of the clients' models.

Parametrization and stability. The factory takes α = ηρ (the client step size
η lives in the optax client optimizer). With β = pα for p clients in a round
(the paper's notation), the center update reads x̃ ← (1 − β) x̃ + β · mean_i x_i:
a moving average of the clients' mean, which the paper's reading needs
0 ≤ β ≤ 1; likewise x_i ← (1 − α) x_i + α x̃ (before the gradient steps) is a
convex pull towards the center only for 0 ≤ α ≤ 1. Without gradients the
elastic step contracts every difference x_i − x̃ orthogonal to their sum by
(1 − α) and the sum Σ_i (x_i − x̃) by (1 − α − β). We require 0 < α ≤ 1
(checked when the factory is called with a concrete α) and β = C·α ≤ 1 for
the C client slots of the round (checked when `step` is traced; C bounds the
number of clients actually taking part).

Partial participation: a client that takes no part (below) neither moves nor
pulls the center; the sum runs over the clients that took part, unweighted as
in the paper (`batches.weight` only marks who takes part). A client drawn
twice in a round counts once (`core.per_client.scatter`).

State: `state.params` is the center x̃ (what a global evaluation sees);
`state.local_params` is the table of the x_i (leaves `[N, ...]`), read with
`fo.personalized_params(state, client_id)`. Every x_i starts at the initial
model. The round is `core.rounds.client_round` without an aggregator (the
server does not average updates: the center moves by the elastic pull), with
the library's rules (docs/architecture.md, "The round") in the form
`core/rounds.py` states for a round without an aggregator: a client is
finite when its new x_i is.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import per_client
from fedjax_opt.core.local import local_train
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.server import initial_round_metrics
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_choice, check_client_batches, check_in_range, check_key, check_loss_fn,
                                        check_num_clients, check_optimizer, check_positive, is_concrete)

__all__ = ["ELASTIC_ORDERS", "EASGDState", "easgd"]

ELASTIC_ORDERS = ("end", "start")


@flax.struct.dataclass
class EASGDState:
  """Server state of synchronous EASGD.

  Attributes:
    params: the center variable x̃.
    local_params: the clients' local variables x_i, a per-client table (leaves `[N, ...]`).
    round: t, rounds applied, int32.
    key: PRNG key (EASGD draws nothing; kept for the common state contract).
    metrics: `core.server.ROUND_METRICS` (update_norm: ‖x̃_{t+1} − x̃_t‖) plus
      `elastic_distance`, the mean ‖x_i − x̃_t‖ over the clients that took part.
  """

  params: PyTree
  local_params: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _check_beta(alpha: Any, num_slots: int) -> None:
  """β = C·α ≤ 1 (the center update is a moving average), when α is concrete."""
  if not is_concrete(alpha):
    return
  beta = float(np.max(np.asarray(alpha))) * num_slots
  if beta > 1.0:
    raise ValueError(
        f"easgd needs beta = C * alpha <= 1 (the center moves to a convex combination of itself and the clients' "
        f"mean); got alpha={alpha} with C={num_slots} client slots, beta={beta:.4g}. "
        f"Use alpha <= {1.0 / num_slots:.4g}.")


def easgd(
    loss_fn: LossFn,
    alpha: Any,
    *,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    elastic_order: str = "end",
) -> FederatedAlgorithm:
  """Synchronous EASGD (Zhang et al. 2015): τ local steps per client, then the elastic update.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    alpha: α = ηρ ∈ (0, 1], the paper's elastic step (may be traced, e.g.
      swept by `jax.vmap`); β = C·α must be ≤ 1 for a round of C client slots.
    num_clients: N, rows of the x_i table.
    client_optimizer: optax optimizer of the τ = S local steps (`optax.sgd(η)`
      in the paper; any optimizer, re-initialized every round).
    elastic_order: where the elastic move x_i ← x_i − α(x_i − x̃_t) goes in a
      round: "end" (default: after the τ local steps, which run from the old
      x_i; τ = 1 is the paper's synchronous update) or "start" (before them,
      the local steps running from the moved point: the paper's Algorithm 1).
      Either way d_i = x_i − x̃_t is taken at the round's start.

  Returns:
    `FederatedAlgorithm(init, step)` with state `EASGDState`.
  """
  check_loss_fn(loss_fn)
  check_positive(alpha, "alpha")
  check_in_range(alpha, "alpha", 0.0, 1.0, closed_high=True)
  num_clients = check_num_clients(num_clients)
  check_optimizer(client_optimizer, "client_optimizer")
  check_choice(elastic_order, "elastic_order", ELASTIC_ORDERS)
  mode = client_map_lib.FromPolicy()

  def client_update(center, data, mask, x):
    diff = jax.tree.map(jnp.subtract, x, center)
    if elastic_order == "start":  # the elastic move, then τ local steps from the moved point
      moved = jax.tree.map(lambda a, d: a - alpha * d, x, diff)
      result = local_train(loss_fn, client_optimizer, moved, data, mask)
      new_x = jax.tree.map(jnp.add, moved, result.delta)
    else:  # τ local steps from x_i, then the elastic move by the round's d_i
      result = local_train(loss_fn, client_optimizer, x, data, mask)
      new_x = jax.tree.map(lambda a, delta, d: a + delta - alpha * d, x, result.delta, diff)
    return ClientOutput(result, rows=(new_x,), extras=diff)

  def init(params: PyTree, key: jax.Array) -> EASGDState:
    check_key(key)
    return EASGDState(
        params=params,
        local_params=per_client.broadcast(params, num_clients),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={**initial_round_metrics(), "elastic_distance": jnp.zeros((), jnp.float32)},
    )

  def step(state: EASGDState, batches: ClientBatches) -> EASGDState:
    check_client_batches(batches)
    _check_beta(alpha, batches.num_clients)
    out = client_round(mode, client_update, state.params, batches, tables=(state.local_params,),
                       like=state.params)
    diff, written = out.extras, out.stored[0].written

    def pull(d):
      keep = written.reshape((-1,) + (1,) * (d.ndim - 1))
      return alpha * jnp.sum(jnp.where(keep, d, jnp.zeros_like(d)), axis=0)

    change = jax.tree.map(pull, diff)
    center = jax.tree.map(lambda c, u: (c + u).astype(jnp.result_type(c)), state.params, change)
    norms = jnp.sqrt(sum(jnp.sum(jnp.square(d.reshape(d.shape[0], -1)), axis=1) for d in jax.tree.leaves(diff)))
    distance = jnp.sum(jnp.where(written, norms, 0)) / jnp.maximum(jnp.sum(written), 1)
    metrics = {**out.metrics(update=change), "elastic_distance": distance.astype(jnp.float32)}
    return state.replace(params=center, local_params=out.stored[0].table, round=state.round + 1, metrics=metrics)

  return FederatedAlgorithm(init, step)


easgd = execution.accepts_policy_keywords(easgd, storage_dtype=True, refuses_aggregator=(
    "EASGD's center moves by the elastic force α Σ_i (x_i − x̃), the plain sum of the same exact differences "
    "that pull each x_i back (the symmetric elastic link of its objective), not by an average a rule could "
    "replace"),
    evaluation="table", exchanges=(1, 1), hyperparameters={"alpha": execution.MIXING_WEIGHT,
        "client_optimizer": execution.CLIENT_OPTIMIZER})
