"""GIANT: the average of the clients' local Newton directions, with a line search on the global objective.

Wang, Roosta-Khorasani, Xu, Mahoney. "GIANT: Globally Improved Approximate
Newton Method for Distributed Optimization." NeurIPS 2018. arXiv:1709.03528.

The objective is the pooled empirical risk f(w) = Σ_k n_k f_k(w) / Σ_k n_k
(f_k the mean loss over client k's real examples of the round, its S·B
slots at once; include the ridge term (γ/2)‖w‖² of the paper in the loss).
One `step` is one GIANT iteration t, three exchanges:

    1. every client sends ∇f_k(w_t);   the server averages   g_t = ∇f(w_t)
    2. every client computes its local Newton direction  p_k = ∇²f_k(w_t)⁻¹ g_t  and sends it;
       the server averages   p_t = Σ_k n_k p_k / Σ_k n_k
    3. every client sends f_k(w_t − α_j p_t) for α_j = 2^{−j}, j < J (and f_k(w_t)); the server takes the
       largest α_j with f(w_t − α_j p_t) ≤ f(w_t) − β α_j ⟨g_t, p_t⟩ (Armijo's condition, the paper's
       backtracking, `core.newton.armijo_step`; α = 0 when none holds)
       w_{t+1} = w_t − α p_t

p_t is a harmonic-mean approximation of the Newton direction: with the local
Hessians H_k, p_t = (Σ_k p_k H_k⁻¹) g_t instead of (Σ_k p_k H_k)⁻¹ g_t, close to
it when the clients' Hessians are alike (the IID setting of the paper, where
n_k ≫ d gives H_k ≈ H). The paper averages uniformly over m workers of equal
size; the n_k-weighted mean is the same there.

The local direction solves ∇²f_k(w_t) p = g_t by `cg_iters` iterations of
conjugate gradient with Hessian-vector products (forward-over-reverse
differentiation: no P × P matrix, as in the paper), or, with
`cg_iters=None`, directly from the `[P, P]` Hessian (small models;
tests/test_giant.py checks both against NumPy's `solve`).

Every exchange runs `core.rounds.client_round` with the n_k-weighted mean and
its rules (docs/architecture.md, "The round"): a client whose gradient,
direction or line-search loss at w_t is not finite is dropped from that
exchange and the later ones and counted in `num_nonfinite` (a candidate step
at which its loss overflows is reported as a value that fails the test,
`core.newton.LINE_SEARCH_OVERFLOW`); a round in which an exchange has no
finite client is rejected (w unchanged). GIANT needs every client in every
round and refuses anything else. There is no `aggregator=`: the method
needs the exact averages.

Communication (`metrics["bits_up"]`, `["bits_down"]`, per client, float32):
a client receives w_t, g_t and p_t (32 P each) and sends ∇f_k(w_t), p_k
(32 P each) and J + 1 loss values (32 (J + 1) bits). The step size is a
scalar and is not counted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import newton
from fedjax_opt.core.local import LocalResult, masked_mean_loss
from fedjax_opt.core.rounds import ClientOutput
from fedjax_opt.core.tree import tree_bits
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn
from fedjax_opt.core.validation import check_full_participation, check_loss_fn, check_num_clients, check_optional_int

__all__ = ["giant", "local_newton_direction"]


def local_newton_direction(loss_fn: LossFn, params, gradient, data, mask, cg_iters: int | None):
  """p_k = ∇²f_k(w)⁻¹ g for f_k the masked mean loss over the client's `[S, B, ...]` data (`cg_iters`: see `giant`)."""
  batch, m = newton.client_data(data, mask)
  flat_w, unravel = ravel_pytree(params)
  flat_g = ravel_pytree(gradient)[0].astype(flat_w.dtype)

  def f(theta):
    return masked_mean_loss(loss_fn, unravel(theta), batch, m)[0]

  if cg_iters is None:
    p = jnp.linalg.solve(jax.hessian(f)(flat_w), flat_g)
  else:
    grad_f = jax.grad(f)
    p = newton.conjugate_gradient(lambda v: jax.jvp(grad_f, (flat_w,), (v,))[1], flat_g, cg_iters)
  return jax.tree.map(lambda a, w: a.astype(jnp.result_type(w)), unravel(p), params)


def giant(
    loss_fn: LossFn,
    *,
    num_clients: int,
    cg_iters: int | None = 20,
    line_search_steps: int = 10,
    armijo: Any = 1e-4,
) -> FederatedAlgorithm:
  """GIANT (Wang et al. 2018): averaged local Newton directions and a backtracking line search (module docstring).

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`, smooth and strongly convex on every client (a
      ridge term per example; a local Hessian must be invertible).
    num_clients: N; every step must hold every client.
    cg_iters: conjugate-gradient iterations for each local system (a Python int; the paper's inexact solve), or
      None to solve it directly from the `[P, P]` Hessian (small models).
    line_search_steps: J, the candidate steps 2^{−j}, j < J (Python int >= 1).
    armijo: β ∈ (0, 1) of Armijo's condition.

  Returns:
    `FederatedAlgorithm(init, step)` with state `core.newton.NewtonState` (`metrics["step_size"]` is α).

  Raises:
    TypeError: `num_clients`, `cg_iters` or `line_search_steps` not a Python int.
    ValueError: β outside (0, 1), or a step without every client.
  """
  check_loss_fn(loss_fn)
  num_clients = check_num_clients(num_clients)
  check_optional_int(cg_iters, "cg_iters")
  newton.check_line_search(line_search_steps, armijo)
  mode = client_map_lib.FromPolicy()
  aggregator = aggregators_lib.weighted_mean()

  def direction_update(shared, data, mask):
    w, g = shared
    batch, m = newton.client_data(data, mask)
    loss, count = masked_mean_loss(loss_fn, w, batch, m)
    p = local_newton_direction(loss_fn, w, g, data, mask, cg_iters)
    return ClientOutput(LocalResult(delta=p, loss=loss, num_examples=count, num_steps=(count > 0).astype(jnp.int32)))

  def step(state: newton.NewtonState, batches: ClientBatches) -> newton.NewtonState:
    check_full_participation(batches, num_clients)
    key, gradient_key, direction_key, search_key = jax.random.split(state.key, 4)
    w = state.params
    gradient, directions, solving = newton.gradient_then_local_round(mode, loss_fn, direction_update, w, batches,
                                                                     aggregator, gradient_key, direction_key)
    g = gradient.agg.update
    descent = jax.tree.map(jnp.negative, directions.agg.update)  # d_t = −p_t
    search = newton.line_search_round(mode, loss_fn, w, descent, line_search_steps,
                                      newton.taking_part_after(directions, solving), aggregator, search_key)
    slope = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(descent)))
    step_size = newton.armijo_step(search.agg.update, slope, armijo)
    accepted = gradient.agg.accepted & directions.agg.accepted & search.agg.accepted
    update = jax.tree.map(lambda d: jnp.where(accepted, step_size.astype(d.dtype) * d, jnp.zeros_like(d)), descent)
    return newton.NewtonState(
        params=jax.tree.map(lambda p, u: (p + u).astype(p.dtype), w, update),
        round=state.round + 1,
        key=key,
        metrics=newton.newton_metrics(gradient, (gradient, directions, search), update, step_size, accepted,
                                      3 * float(tree_bits(w))),
    )

  return FederatedAlgorithm(newton.initial_newton_state, step)


giant = execution.accepts_policy_keywords(giant, refuses_aggregator=(
    "GIANT's step needs the exact n_k-weighted means of the clients' gradients, Newton directions and "
    "line-search losses (a robust, compressed or noised mean is another method)"),
    evaluation="global", exchanges="metrics", hyperparameters={"cg_iters": execution.COUNT,
        "line_search_steps": execution.COUNT, "armijo": execution.THRESHOLD})
