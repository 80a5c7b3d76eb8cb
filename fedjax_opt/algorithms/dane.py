"""DANE, FedDANE and FADL: each client minimises its own loss corrected to first order towards the global one.

Shamir, Srebro, Zhang. "Communication-Efficient Distributed Optimization
using an Approximate Newton-type Method." ICML 2014. arXiv:1312.7853.
Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "FedDANE: A Federated
Newton-Type Method." Asilomar 2019. arXiv:2001.01920.
Mahajan, Keerthi, Sundararajan, Bottou. "A Functional Approximation Based
Distributed Learning Algorithm." arXiv:1310.8418, 2013 (FADL).

The objective is the pooled empirical risk f(w) = Σ_k n_k f_k(w) / Σ_k n_k,
f_k the mean loss over client k's real examples of the round (its S·B slots
at once; n_k = `batches.weight`). One `step` is one DANE iteration t, two
exchanges (three with FADL's line search):

    1. every client sends ∇f_k(w_t);  the server averages  g_t = ∇f(w_t) = Σ_k n_k ∇f_k(w_t) / Σ_k n_k
    2. every client solves its local problem
           w_k = argmin_w  f_k(w) − ⟨∇f_k(w_t) − η g_t, w⟩ + (μ/2)‖w − w_t‖²
       and sends it;  the server averages  d_t = Σ_k n_k (w_k − w_t) / Σ_k n_k
    3. (FADL) every client sends f_k(w_t + α_j d_t), α_j = 2^{−j}, j < J; the server takes the largest α_j
       meeting Armijo's condition f(w_t + α d_t) ≤ f(w_t) + β α ⟨g_t, d_t⟩  (`core.newton.armijo_step`)
       w_{t+1} = w_t + α d_t                                          (DANE, FedDANE: α = 1)

The paper averages the w_k uniformly over its m machines of equal size; the
n_k-weighted mean is the same there, and with clients of unequal size it is
the average whose fixed points are the minimisers of the pooled risk: at a
fixed point every w_k = w_t (a strongly convex local problem whose
minimiser is w_t has ∇f_k(w_t) − (∇f_k(w_t) − η g_t) = 0), so g_t = 0.

On a quadratic f_k(w) = ½ wᵀH_k w − b_kᵀw with exact local solves, w_k =
w_t − η (H_k + μI)⁻¹ g_t, so

    w_{t+1} = w_t − η (Σ_k p_k (H_k + μI)⁻¹) ∇f(w_t),     p_k = n_k / Σ n_k,

the closed form of the paper's Section 3 (tests/test_dane.py checks it
against float64 NumPy).

Local solvers (`local_steps`, `cg_iters`, `client_optimizer`):

* exact for quadratics (default, `client_optimizer=None`): `local_steps`
  Newton steps from w_t on the local problem, each system
  (∇²f_k(w) + μI) s = ∇F_k(w) solved directly from the `[P, P]` Hessian
  (`cg_iters=None`, small models) or by `cg_iters` conjugate-gradient
  iterations with Hessian-vector products (`core.newton.newton_solve`). One
  direct step is exact for least squares and ridge; logistic regression
  needs a few (no damping: the local problem is solved by plain Newton);
* inexact (`client_optimizer=`): `local_steps` optax steps from w_t on the
  local problem (`core.prox.prox_update`, the correction −(∇f_k(w_t) − η g_t)
  + μ(w − w_t) added to each gradient): full-batch steps for DANE and FADL,
  minibatch steps (step s on batch s mod S) for FedDANE, whose paper solves
  it by local SGD.

FedDANE is DANE with η = 1 for federated rounds: the round's clients are a
sample, the gradient is their average and the model their average.
Li et al. draw the gradient's clients S_t and the solvers S'_t
independently; here both are the round's clients (one `ClientBatches` a
round), the variant in which the two draws coincide. DANE and FADL need
every client in every round (their g_t is the full gradient) and refuse
anything else (`core.validation.check_full_participation`).

FADL (Mahajan et al.): node k approximates f by its own loss plus a
first-order model of the other nodes' losses and a proximal term; with the
mean-normalised losses used here that approximation is DANE's local problem
with η = 1, and FADL then searches along the averaged direction d_t instead
of stepping to its end. FADL coincides with DANE (η = 1, same μ and local
solver) in every round in which the line search accepts the unit step
α = 1; it differs when the averaged solutions overshoot (non-IID clients),
where DANE can diverge and FADL's step shrinks. Mahajan et al. use a
Wolfe line search with a trust-region safeguard; here it is Armijo's
backtracking, the search GIANT uses.

Every exchange runs `core.rounds.client_round` with the n_k-weighted mean and
its rules (docs/architecture.md, "The round"): a client whose gradient, local
solution or line-search loss is not finite is dropped from that exchange and
the later ones, and counted in `num_nonfinite`; a round in which an exchange
has no finite client is rejected (w unchanged). There is no `aggregator=`:
the method needs the exact average of the gradients and of the solutions (a
robust, compressed or noised g_t is another method).

Communication (`metrics["bits_up"]`, `["bits_down"]`, per client, float32):
a client receives w_t and g_t (32 P each; FADL also d_t) and sends ∇f_k(w_t)
and w_k (32 P each; FADL also J + 1 loss values, 32 (J + 1) bits). The step
size is a scalar and is not counted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import newton
from fedjax_opt.core import prox as prox_lib
from fedjax_opt.core.local import LocalResult, masked_mean_loss
from fedjax_opt.core.rounds import ClientOutput
from fedjax_opt.core.tree import tree_bits
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_full_participation, check_loss_fn,
                                        check_num_clients, check_optimizer, check_optional_int, check_positive)

__all__ = ["dane", "fadl", "feddane"]


def _dane_family(name: str, loss_fn: LossFn, eta: Any, mu: Any, *, num_clients: int | None, local_steps: int | None,
                 client_optimizer: optax.GradientTransformation | None, cg_iters: int | None, full_batch: bool,
                 line_search_steps: int | None, armijo: Any) -> FederatedAlgorithm:
  """The round of the module docstring; `num_clients` None: any clients (FedDANE); `line_search_steps` None: α = 1."""
  check_loss_fn(loss_fn)
  check_positive(eta, "eta (η)")
  check_positive(mu, "mu (μ)", allow_zero=True)
  if num_clients is not None:
    num_clients = check_num_clients(num_clients)
  check_optional_int(local_steps, "local_steps")
  check_optional_int(cg_iters, "cg_iters")
  if client_optimizer is not None:
    check_optimizer(client_optimizer, "client_optimizer")
    if cg_iters is not None:
      raise ValueError(f"{name}: cg_iters sets the Newton solver's CG, but client_optimizer= asks for optax local "
                       f"steps instead; give one of them.")
  if line_search_steps is not None:
    newton.check_line_search(line_search_steps, armijo)
  mode = client_map_lib.FromPolicy()
  aggregator = aggregators_lib.weighted_mean()

  def local_solve(shared, data, mask):
    w, g = shared
    batch, m = newton.client_data(data, mask)
    (loss, count), g_k = jax.value_and_grad(masked_mean_loss, argnums=1, has_aux=True)(loss_fn, w, batch, m)
    # The local problem's linear term: −⟨∇f_k(w_t) − η g_t, w⟩.
    linear = jax.tree.map(lambda gg, gk: (eta * gg - gk).astype(gk.dtype), g, g_k)
    if client_optimizer is None:
      new = newton.newton_solve(loss_fn, w, data, mask, steps=1 if local_steps is None else local_steps,
                                cg_iters=cg_iters, penalty=mu, centre=w, linear=linear)
    else:
      new = prox_lib.prox_update(loss_fn, None, client_optimizer, local_steps, w, mu, w, data, mask, dual=linear,
                                 full_batch=full_batch)
    delta = jax.tree.map(jnp.subtract, new, w)
    return ClientOutput(LocalResult(delta=delta, loss=loss, num_examples=count,
                                    num_steps=(count > 0).astype(jnp.int32)))

  def step(state: newton.NewtonState, batches: ClientBatches) -> newton.NewtonState:
    if num_clients is None:
      check_client_batches(batches)
    else:
      check_full_participation(batches, num_clients)
    key, gradient_key, solve_key, search_key = jax.random.split(state.key, 4)
    w = state.params
    gradient, solved, solving = newton.gradient_then_local_round(mode, loss_fn, local_solve, w, batches, aggregator,
                                                                 gradient_key, solve_key)
    g = gradient.agg.update
    direction = solved.agg.update
    accepted = gradient.agg.accepted & solved.agg.accepted
    exchanges = (gradient, solved)
    model = float(tree_bits(w))
    if line_search_steps is None:
      step_size = jnp.ones((), jnp.float32)
      bits_down = 2 * model
    else:
      search = newton.line_search_round(mode, loss_fn, w, direction, line_search_steps,
                                        newton.taking_part_after(solved, solving), aggregator, search_key)
      slope = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(direction)))
      step_size = newton.armijo_step(search.agg.update, slope, armijo)
      accepted = accepted & search.agg.accepted
      exchanges = exchanges + (search,)
      bits_down = 3 * model
    update = jax.tree.map(lambda d: jnp.where(accepted, step_size.astype(d.dtype) * d, jnp.zeros_like(d)), direction)
    return newton.NewtonState(
        params=jax.tree.map(lambda p, u: (p + u).astype(p.dtype), w, update),
        round=state.round + 1,
        key=key,
        metrics=newton.newton_metrics(gradient, exchanges, update, step_size, accepted, bits_down),
    )

  return FederatedAlgorithm(newton.initial_newton_state, step)


def dane(
    loss_fn: LossFn,
    eta: Any = 1.0,
    mu: Any = 0.0,
    *,
    num_clients: int,
    local_steps: int | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    cg_iters: int | None = None,
) -> FederatedAlgorithm:
  """DANE (Shamir, Srebro, Zhang 2014): average of the clients' gradient-corrected local solutions (module docstring).

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`, a smooth convex loss (include any regulariser per
      example); f_k is its mean over client k's real examples of the round.
    eta: η > 0, the weight of the global gradient in the local problem (the paper's default 1; may be traced).
    mu: μ >= 0, the local problem's proximal weight (0: the paper's plain form; may be traced).
    num_clients: N; every step must hold every client (DANE's gradient is the full one).
    local_steps: Newton steps (exact solver, default 1: exact for quadratics) or optax steps (with
      `client_optimizer`, default S) on the local problem.
    client_optimizer: None (Newton local solver) or any optax optimizer for an inexact local solve by full-batch
      steps, re-initialized every round.
    cg_iters: the Newton solver's linear systems: None solves them directly from the `[P, P]` Hessian (small
      models); an int runs that many conjugate-gradient iterations with Hessian-vector products.

  Returns:
    `FederatedAlgorithm(init, step)` with state `core.newton.NewtonState`.

  Raises:
    TypeError: `num_clients`, `local_steps` or `cg_iters` not a Python int, `client_optimizer` not an optax optimizer.
    ValueError: η <= 0 or μ < 0, both `client_optimizer` and `cg_iters`, or a step without every client.
  """
  return _dane_family("dane", loss_fn, eta, mu, num_clients=num_clients, local_steps=local_steps,
                      client_optimizer=client_optimizer, cg_iters=cg_iters, full_batch=True, line_search_steps=None,
                      armijo=None)


dane = execution.accepts_policy_keywords(dane, refuses_aggregator=(
    "DANE's Newton-type step needs the exact n_k-weighted means of the clients' gradients and of their local "
    "solutions (a robust, compressed or noised mean is another method)"),
    evaluation="global", exchanges="metrics", hyperparameters={"eta": execution.STEP_SIZE, "mu": execution.REGULARIZER,
        "local_steps": execution.COUNT, "client_optimizer": execution.CLIENT_OPTIMIZER, "cg_iters": execution.COUNT})


def feddane(
    loss_fn: LossFn,
    mu: Any = 0.0,
    *,
    local_steps: int | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    cg_iters: int | None = None,
) -> FederatedAlgorithm:
  """FedDANE (Li et al. 2019): DANE with η = 1 on the round's sampled clients (module docstring).

  The round's clients (those with weight > 0) send their gradients, g_t is their n_k-weighted mean, the same
  clients solve f_k(w) + ⟨g_t − ∇f_k(w_t), w⟩ + (μ/2)‖w − w_t‖² and w_{t+1} is the n_k-weighted mean of their
  solutions; clients outside the round take no part in either exchange.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    mu: μ >= 0, the proximal weight of the local problem (may be traced).
    local_steps: Newton steps (default 1) or, with `client_optimizer`, optax minibatch steps (step s on the
      client's batch s mod S; default S).
    client_optimizer: None (Newton local solver, exact for quadratics) or any optax optimizer (the paper's local
      SGD is `optax.sgd(lr)`), re-initialized every round.
    cg_iters: the Newton solver's systems: None directly, an int by that many CG iterations.

  Returns:
    `FederatedAlgorithm(init, step)` with state `core.newton.NewtonState`.

  Raises:
    TypeError, ValueError: as `dane` (any clients may take part).
  """
  return _dane_family("feddane", loss_fn, 1.0, mu, num_clients=None, local_steps=local_steps,
                      client_optimizer=client_optimizer, cg_iters=cg_iters, full_batch=False, line_search_steps=None,
                      armijo=None)


feddane = execution.accepts_policy_keywords(feddane, refuses_aggregator=(
    "FedDANE's Newton-type step needs the exact n_k-weighted means of the round's gradients and of its "
    "clients' local solutions (a robust, compressed or noised mean is another method)"),
    evaluation="global", exchanges="metrics", hyperparameters={"mu": execution.REGULARIZER,
        "local_steps": execution.COUNT, "client_optimizer": execution.CLIENT_OPTIMIZER, "cg_iters": execution.COUNT})


def fadl(
    loss_fn: LossFn,
    mu: Any = 0.0,
    *,
    num_clients: int,
    local_steps: int | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    cg_iters: int | None = None,
    line_search_steps: int = 10,
    armijo: Any = 1e-4,
) -> FederatedAlgorithm:
  """FADL (Mahajan et al. 2013): DANE's local problem with η = 1, then a line search along the averaged direction.

  w_{t+1} = w_t + α d_t with d_t = Σ_k p_k (w_k − w_t) and α the largest of 1, 1/2, …, 2^{1−J} meeting Armijo's
  condition on the global objective (0 when none does); with α = 1 the round is DANE's (module docstring).

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    mu: μ >= 0, the proximal weight of the local approximation (may be traced).
    num_clients: N; every step must hold every client.
    local_steps, client_optimizer, cg_iters: the local solver, as in `dane`.
    line_search_steps: J, the candidate steps 2^{−j}, j < J (Python int >= 1).
    armijo: β ∈ (0, 1) of Armijo's condition.

  Returns:
    `FederatedAlgorithm(init, step)` with state `core.newton.NewtonState` (`metrics["step_size"]` is α).

  Raises:
    TypeError, ValueError: as `dane`, and J not a Python int >= 1 or β outside (0, 1).
  """
  return _dane_family("fadl", loss_fn, 1.0, mu, num_clients=num_clients, local_steps=local_steps,
                      client_optimizer=client_optimizer, cg_iters=cg_iters, full_batch=True,
                      line_search_steps=line_search_steps, armijo=armijo)


fadl = execution.accepts_policy_keywords(fadl, refuses_aggregator=(
    "FADL's local problems and its Armijo line search need the exact n_k-weighted means of the clients' "
    "gradients, local solutions and losses (a robust, compressed or noised mean is another method)"),
    evaluation="global", exchanges="metrics", hyperparameters={"mu": execution.REGULARIZER,
        "local_steps": execution.COUNT, "client_optimizer": execution.CLIENT_OPTIMIZER, "cg_iters": execution.COUNT,
        "line_search_steps": execution.COUNT, "armijo": execution.THRESHOLD})
