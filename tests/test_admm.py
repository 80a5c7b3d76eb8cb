"""Consensus and sharing ADMM reach the centralized optimum (closed forms, scipy L-BFGS, scikit-learn).

Compiling is most of these tests' time: the algorithms are built inside cached jitted programs (`_consensus`,
`_sharing`) with their hyper-parameters (ρ, α, λ₁, λ₂, the tolerances) traced, so one program serves every test
and every value that shares the static choices and the data's shapes.
"""

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize
from sklearn.linear_model import Lasso, LogisticRegression, Ridge

import fedjax_opt as fo
from fedjax_opt.algorithms.admm_consensus import admm_consensus
from fedjax_opt.algorithms.admm_sharing import admm_sharing
from fedjax_opt.core.prox import prox_least_squares, prox_quadratic
from conftest import (logistic_clients, lsq_loss, make_clients, pack, ridge_logistic_loss, ridge_logistic_objective,
                      ridge_logistic_optimum)

D, N = 3, 4
L2 = 0.1


def _vec(params):
  return np.append(np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64))


def _tree(v):
  return {"w": jnp.asarray(v[:-1]), "b": jnp.asarray(v[-1])}


def _ridge_loss(params, batch):
  return lsq_loss(params, batch) + 0.5 * L2 * jnp.sum(jnp.square(params["w"]))


def _ridge_loss_with(l2):
  """Least squares plus (l2/2)‖w‖² per example; l2 may be traced (0: exactly `lsq_loss`'s values)."""
  return lambda params, batch: lsq_loss(params, batch) + 0.5 * l2 * jnp.sum(jnp.square(params["w"]))


def _centralized_ridge(clients, l2):
  """argmin Σ_i [(1/n_i) Σ ½(xᵀw + b − y)² + (l2/2)‖w‖²] from the normal equations, float64."""
  a = [np.hstack([x, np.ones((len(x), 1))]) for x, _ in clients]
  penalty = np.diag([l2] * D + [0.0])
  lhs = sum(ai.T @ ai / len(ai) + penalty for ai in a)
  rhs = sum(ai.T @ y / len(y) for ai, (_, y) in zip(a, clients))
  return np.linalg.solve(lhs, rhs)


def _np(tree):
  """Every array leaf as NumPy (PRNG keys kept): the tests then index and compare without compiling eager ops."""
  return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else np.asarray(a), tree)


def _scan(algo, state, batches, iterations):
  """`iterations` steps as one `lax.scan`; returns the final state and the metrics history."""

  def body(state, _):
    state = algo.step(state, batches)
    return state, state.metrics

  return jax.lax.scan(body, state, None, length=iterations)


def _run(algo, params, batches, iterations):
  """The whole solve as one jitted `lax.scan` over ADMM iterations; also returns the metrics history (NumPy)."""
  return _np(jax.jit(lambda s: _scan(algo, s, batches, iterations))(algo.init(params, jax.random.key(0))))


def _rel_err(got, want):
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _hyper(rho=1.0, alpha=1.0, l2=L2, abs_tol=1e-6, rel_tol=1e-4):
  """The traced hyper-parameters of `_consensus`'s programs (always the same pytree, so they never retrace)."""
  return dict(rho=rho, alpha=alpha, l2=l2, abs_tol=abs_tol, rel_tol=rel_tol)


@functools.cache
def _consensus(objective="clients", balancing=False, prox="least_squares", iterations=100):
  """Exact consensus ADMM (prox_least_squares(λ₂) or prox_quadratic of the ridge loss), built inside jitted programs
  from the traced `_hyper(...)` dict `h`, once per static choice: `init(params, h)`, `step(state, batches, h)` and
  `run(params, batches, h) -> (state, metrics history)` of `iterations` iterations from `init`."""

  def algo(h):
    loss = _ridge_loss_with(h["l2"])
    x_update = prox_least_squares(h["l2"]) if prox == "least_squares" else prox_quadratic(loss)
    return admm_consensus(loss, h["rho"], num_clients=N, prox=x_update, relaxation=h["alpha"],
                          residual_balancing=balancing, abs_tol=h["abs_tol"], rel_tol=h["rel_tol"],
                          objective=objective)

  init = jax.jit(lambda params, h: algo(h).init(params, jax.random.key(0)))
  step = jax.jit(lambda state, batches, h: algo(h).step(state, batches))
  run = jax.jit(lambda params, batches, h: _scan(algo(h), algo(h).init(params, jax.random.key(0)), batches,
                                                 iterations))
  return init, step, run


def _solve(params, batches, h, **static):
  """`_consensus(**static)`'s run as NumPy (state, history)."""
  return _np(_consensus(**static)[2](params, batches, h))


@pytest.fixture
def lsq_clients(rng):
  """Heterogeneous least squares: unequal sizes, shifted inputs, a different target model per client.

  Packed into 5 steps (the last ones all padding) so that these batches share their shape, and so the compiled
  programs, with the examples-objective test's."""
  clients = make_clients(rng, [8, 10, 6, 12], D)
  with jax.enable_x64(True):  # float64 device arrays (outside the context they would be float32)
    return clients, pack(clients, 5, 6, extra_slots=1, dtype=np.float64)


@pytest.mark.parametrize("l2, prox_name", [(0.0, "least_squares"), (L2, "least_squares"), (L2, "quadratic")])
def test_exact_consensus_reaches_centralized_least_squares_and_ridge(lsq_clients, l2, prox_name):
  """100 iterations of ρ = 1 (λ₂ = 0 is least squares: the ridge loss and prox with a traced λ₂ = 0)."""
  clients, batches = lsq_clients
  with jax.enable_x64(True):
    state, history = _solve(_tree(np.zeros(D + 1)), batches, _hyper(l2=l2), prox=prox_name)
    z_star = _centralized_ridge(clients, l2)
    assert _rel_err(_vec(state.params), z_star) < 1e-6
    for i in range(N):  # every x_i agrees with z
      assert _rel_err(_vec(jax.tree.map(lambda t: t[i], state.local_params)), z_star) < 1e-6
    np.testing.assert_allclose(np.asarray(state.duals["w"]).sum(0), 0, atol=1e-10)  # Σ λ_i = 0
    assert history["primal_residual"][-1] < 1e-7 and history["dual_residual"][-1] < 1e-7
    assert bool(history["converged"][-1]) and not bool(history["converged"][0])
    assert int(state.metrics["num_clients"]) == N and int(state.round) == 100
    objective = np.mean([np.mean(0.5 * (x @ z_star[:-1] + z_star[-1] - y) ** 2) + 0.5 * l2 * z_star[:-1] @ z_star[:-1]
                         for x, y in clients])
    np.testing.assert_allclose(float(history["objective"][-1]), objective, rtol=1e-5)


def _two_of_four(rng):
  """Clients 2 and 0 of 4 in the round (float64), then a zero-weight padding client as client 1; random z, x_i, λ_i."""
  all_clients = make_clients(rng, [5, 6, 4, 7], D)
  batches = pack([all_clients[2], all_clients[0]], 2, 4, extra_clients=1, dtype=np.float64)
  batches = batches.replace(client_id=jnp.asarray(np.array([2, 0, 1], np.int32)))
  z, xs, lams = rng.normal(size=D + 1), rng.normal(size=(N, D + 1)), rng.normal(size=(N, D + 1))
  return all_clients, batches, z, xs, lams


def _start(z, xs, lams, objective="clients", rho=1.0, weights=None):
  """The jitted `init` of `_consensus(objective)` at ρ with z, the x_i and the λ_i (rows `[N, D + 1]`) set, and the
  client weights w_i when given."""
  state = _consensus(objective)[0](_tree(z), _hyper(rho=rho)).replace(
      local_params={"w": jnp.asarray(xs[:, :-1]), "b": jnp.asarray(xs[:, -1])},
      duals={"w": jnp.asarray(lams[:, :-1]), "b": jnp.asarray(lams[:, -1])})
  return state if weights is None else state.replace(client_weights=jnp.asarray(weights))


def _step(state, batches, objective="clients", **hyper):
  """One iteration of `_consensus(objective)`'s jitted step (ρ is the state's), as NumPy."""
  return _np(_consensus(objective)[1](state, batches, _hyper(**hyper)))


def _numpy_admm_iteration(z, xs, lams, clients, ids, rho, alpha, l2, weights=None):
  """One ADMM iteration (Boyd §7.1, over-relaxed) in float64 NumPy; clients not in `ids` keep x_i, λ_i.

  `weights`: the z-average's w_i of objective="examples" (the round's clients get their example count);
  None: the plain mean.
  """
  xs, lams = xs.copy(), lams.copy()
  if weights is not None:
    weights = weights.copy()
    for i in ids:
      weights[i] = len(clients[i][0])
  terms = xs + lams / rho
  penalty = np.diag([l2] * D + [0.0])
  x_hat = {}
  for i in ids:
    x, y = clients[i]
    a = np.hstack([x, np.ones((len(x), 1))])
    xs[i] = np.linalg.solve(a.T @ a / len(a) + penalty + rho * np.eye(D + 1), a.T @ y / len(y) + rho * z - lams[i])
    x_hat[i] = alpha * xs[i] + (1 - alpha) * z
    terms[i] = x_hat[i] + lams[i] / rho
  new_z = terms.mean(0) if weights is None else weights @ terms / weights.sum()
  for i in ids:
    lams[i] = lams[i] + rho * (x_hat[i] - new_z)
  return new_z, xs, lams


def test_one_iteration_with_partial_participation_matches_numpy(rng):
  """Clients 2 and 0 of 4 take part, plus a zero-weight padding client: absent clients keep x_i and λ_i exactly."""
  rho, alpha = 0.7, 1.5
  with jax.enable_x64(True):
    all_clients, batches, z, xs, lams = _two_of_four(rng)
    out = _step(_start(z, xs, lams, rho=rho), batches, alpha=alpha)
    ref_z, ref_xs, ref_lams = _numpy_admm_iteration(z, xs, lams, all_clients, [2, 0], rho, alpha, L2)
    np.testing.assert_allclose(_vec(out.params), ref_z, rtol=1e-10)
    got_xs = np.column_stack([out.local_params["w"], out.local_params["b"]])
    got_lams = np.column_stack([out.duals["w"], out.duals["b"]])
    np.testing.assert_allclose(got_xs, ref_xs, rtol=1e-10)
    np.testing.assert_allclose(got_lams, ref_lams, rtol=1e-10)
    for i in (1, 3):
      np.testing.assert_array_equal(got_xs[i], xs[i])
      np.testing.assert_array_equal(got_lams[i], lams[i])
    np.testing.assert_allclose(float(out.metrics["primal_residual"]), np.linalg.norm(ref_xs - ref_z), rtol=1e-6)
    np.testing.assert_allclose(float(out.metrics["dual_residual"]), rho * np.sqrt(N) * np.linalg.norm(ref_z - z),
                               rtol=1e-6)
    assert int(out.metrics["num_clients"]) == 2


def test_a_client_with_weight_but_no_real_example_takes_no_part(rng):
  """core.rounds' no-step rule: weight > 0 with an all-padding mask keeps x_i, λ_i; z is as if it were absent."""
  rho = 0.7
  with jax.enable_x64(True):
    all_clients, batches, z, xs, lams = _two_of_four(rng)
    batches = batches.replace(weight=jnp.asarray(np.array([4.0, 5.0, 3.0])))
    out = _step(_start(z, xs, lams, rho=rho), batches)
    ref_z, ref_xs, ref_lams = _numpy_admm_iteration(z, xs, lams, all_clients, [2, 0], rho, 1.0, L2)
    np.testing.assert_allclose(_vec(out.params), ref_z, rtol=1e-10)
    np.testing.assert_allclose(np.column_stack([out.local_params["w"], out.local_params["b"]]), ref_xs, rtol=1e-10)
    np.testing.assert_allclose(np.column_stack([out.duals["w"], out.duals["b"]]), ref_lams, rtol=1e-10)
    assert int(out.metrics["num_clients"]) == 2


def _centralized_pooled_ridge(clients, l2):
  """argmin (1/n) Σ_all ½(xᵀw + b − y)² + (l2/2)‖w‖² over the pooled examples (normal equations, float64)."""
  a = np.vstack([np.hstack([x, np.ones((len(x), 1))]) for x, _ in clients])
  y = np.concatenate([y for _, y in clients])
  return np.linalg.solve(a.T @ a / len(y) + np.diag([l2] * D + [0.0]), a.T @ y / len(y))


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_examples_objective_reaches_the_pooled_solution_which_the_clients_objective_misses(rng):
  """Sizes 3, 30, 5, 12: objective="examples" reaches the pooled normal equations to 1e-8 (and its objective metric
  is the pooled risk); the default "clients" reaches Σ_i f_i's minimiser, visibly away from the pooled one."""
  clients = make_clients(rng, [3, 30, 5, 12], D)
  pooled, per_client = _centralized_pooled_ridge(clients, L2), _centralized_ridge(clients, L2)
  assert _rel_err(per_client, pooled) > 0.05  # the two objectives really differ on these clients
  with jax.enable_x64(True):
    batches = pack(clients, 5, 6, extra_slots=1, dtype=np.float64)
    batches = batches.replace(weight=jnp.asarray(np.ones(N)))  # n_i comes from the mask, not from batches.weight
    runs = {objective: _solve(_tree(np.zeros(D + 1)), batches, _hyper(), objective=objective)
            for objective in ("examples", "clients")}
    state, history = runs["examples"]
    assert _rel_err(_vec(state.params), pooled) < 1e-8
    np.testing.assert_array_equal(np.asarray(state.client_weights), [3, 30, 5, 12])
    assert bool(history["converged"][-1])
    risk = np.mean(np.concatenate([0.5 * (x @ pooled[:-1] + pooled[-1] - y) ** 2 for x, y in clients]))
    np.testing.assert_allclose(float(history["objective"][-1]), risk + 0.5 * L2 * pooled[:-1] @ pooled[:-1], rtol=1e-6)
    clients_state, _ = runs["clients"]
    assert _rel_err(_vec(clients_state.params), per_client) < 1e-8
    assert _rel_err(_vec(clients_state.params), pooled) > 0.05
    np.testing.assert_array_equal(np.asarray(clients_state.client_weights), 1)


def test_examples_objective_one_iteration_with_partial_participation_matches_numpy(rng):
  """objective="examples", clients 2 and 0 of 4 take part: z = Σ_i n_i (x̂_i + λ_i/ρ) / Σ_i n_i with the absent
  clients' stored counts (client 3 never seen: 0), the round's clients' fresh counts."""
  rho, alpha = 0.7, 1.3
  with jax.enable_x64(True):
    all_clients, batches, z, xs, lams = _two_of_four(rng)
    weights = np.array([9.0, 11.0, 2.0, 0.0])
    out = _step(_start(z, xs, lams, "examples", rho, weights), batches, "examples", alpha=alpha)
    ref_z, ref_xs, ref_lams = _numpy_admm_iteration(z, xs, lams, all_clients, [2, 0], rho, alpha, L2, weights)
    np.testing.assert_allclose(_vec(out.params), ref_z, rtol=1e-10)
    np.testing.assert_allclose(np.column_stack([out.local_params["w"], out.local_params["b"]]), ref_xs, rtol=1e-10)
    np.testing.assert_allclose(np.column_stack([out.duals["w"], out.duals["b"]]), ref_lams, rtol=1e-10)
    np.testing.assert_array_equal(np.asarray(out.client_weights), [5.0, 11.0, 4.0, 0.0])


@pytest.mark.parametrize("objective", ["clients", "examples"])
def test_a_client_with_nan_data_never_spreads(rng, objective):
  """Client 1's data holds a NaN, every round: it keeps x_1, λ_1, w_1; it is counted in num_nonfinite; z and the other
  clients follow the NumPy iteration in which client 1 is absent (its stored x_1 + λ_1/ρ in z), five rounds."""
  rho, bad = 0.8, 1
  clients = make_clients(rng, [5, 6, 4, 7], D)
  with jax.enable_x64(True):
    batches = pack(clients, 2, 4, dtype=np.float64)
    x = np.array(batches.data["x"])
    x[bad, 0, 1, 2] = np.nan
    batches = batches.replace(data={**batches.data, "x": jnp.asarray(x)})
    z, xs, lams = rng.normal(size=D + 1), rng.normal(size=(N, D + 1)), rng.normal(size=(N, D + 1))
    weights = np.array([1.0, 3.0, 1.0, 1.0]) if objective == "examples" else None
    state = _start(z, xs, lams, objective, rho, weights)
    x_bad, lam_bad = xs[bad].copy(), lams[bad].copy()
    for _ in range(5):
      state = _step(state, batches, objective)
      z, xs, lams = _numpy_admm_iteration(z, xs, lams, clients, [0, 2, 3], rho, 1.0, L2, weights)
      if weights is not None:
        weights = np.array([5.0, 3.0, 4.0, 7.0])
      for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
          assert np.all(np.isfinite(np.asarray(leaf))), jax.tree_util.keystr(path)
      assert int(state.metrics["num_nonfinite"]) == 1 and int(state.metrics["num_clients"]) == 3
      np.testing.assert_allclose(_vec(state.params), z, rtol=1e-10)
      got_xs = np.column_stack([state.local_params["w"], state.local_params["b"]])
      np.testing.assert_allclose(got_xs, xs, rtol=1e-10)
      np.testing.assert_array_equal(got_xs[bad], x_bad)
      np.testing.assert_array_equal(np.column_stack([state.duals["w"], state.duals["b"]])[bad], lam_bad)
    assert float(state.client_weights[bad]) == (3.0 if objective == "examples" else 1.0)


@pytest.mark.parametrize("relaxation, balancing, rho", [(1.5, False, 1.0), (1.0, True, 50.0)])
def test_over_relaxation_and_residual_balancing_converge(lsq_clients, relaxation, balancing, rho):
  """α = 1.5, and residual balancing from a badly chosen ρ = 50: ρ moves, residuals go to 0, z = z*."""
  clients, batches = lsq_clients
  with jax.enable_x64(True):
    state, history = _solve(_tree(np.zeros(D + 1)), batches, _hyper(rho=rho, alpha=relaxation), balancing=balancing)
    assert _rel_err(_vec(state.params), _centralized_ridge(clients, L2)) < 1e-6
    assert history["primal_residual"][-1] < 1e-7 and history["dual_residual"][-1] < 1e-7
    assert bool(history["converged"][-1])
    if balancing:
      assert float(state.rho) < rho and len(np.unique(np.asarray(history["rho"]))) > 1
    else:
      np.testing.assert_array_equal(history["rho"], rho)


def _ridge_np(v, x, y, l2=L2):
  """f_i(v) = mean ½(xᵀw + b − y)² + (l2/2)‖w‖² in float64 NumPy."""
  return np.mean(0.5 * (x @ v[:-1] + v[-1] - y) ** 2) + 0.5 * l2 * v[:-1] @ v[:-1]


@pytest.mark.parametrize("objective", ["clients", "examples"])
def test_metrics_are_boyds_residuals_tolerances_and_the_objective_at_z(rng, objective):
  """Boyd §3.3.1 in NumPy over all N rows after one partial iteration (clients 2 and 0, a zero-weight padding
  client): ‖r‖ = ‖X − 1zᵀ‖_F, ‖s‖ = ρ√N‖z⁺ − z‖, ε_pri = √(NP) ε_abs + ε_rel max(‖X‖_F, √N‖z⁺‖),
  ε_dual = √(NP) ε_abs + ε_rel ‖Λ‖_F, converged = both within; objective = the round's w_i-weighted mean of
  f_i(z) at the z the clients received (the padding client is not in it); bits: one model each way."""
  rho, alpha, abs_tol, rel_tol = 0.7, 1.3, 2e-3, 3e-2
  with jax.enable_x64(True):
    all_clients, batches, z, xs, lams = _two_of_four(rng)
    weights = np.array([9.0, 11.0, 2.0, 0.0]) if objective == "examples" else None
    results, larger = {}, set()
    # Duals with a common shift move z⁺ away from the x_i, so that √N‖z⁺‖ is the larger side of ε_pri's max.
    for shift, tols in ((0.0, (abs_tol, rel_tol)), (0.0, (10.0, 0.5)), (6.0, (abs_tol, rel_tol))):
      state = _start(z, xs, lams + shift, objective, rho, weights)
      metrics = results[shift, tols] = _step(state, batches, objective, alpha=alpha, abs_tol=tols[0],
                                             rel_tol=tols[1]).metrics
      new_z, new_xs, new_lams = _numpy_admm_iteration(z, xs, lams + shift, all_clients, [2, 0], rho, alpha, L2,
                                                      weights)
      r = np.linalg.norm(new_xs - new_z)
      s = rho * np.sqrt(N) * np.linalg.norm(new_z - z)
      sides = (np.linalg.norm(new_xs), np.sqrt(N) * np.linalg.norm(new_z))
      larger.add(int(np.argmax(sides)))
      eps_pri = np.sqrt(N * (D + 1)) * tols[0] + tols[1] * max(sides)
      eps_dual = np.sqrt(N * (D + 1)) * tols[0] + tols[1] * np.linalg.norm(new_lams)
      np.testing.assert_allclose(float(metrics["primal_residual"]), r, rtol=1e-6)
      np.testing.assert_allclose(float(metrics["dual_residual"]), s, rtol=1e-6)
      np.testing.assert_allclose(float(metrics["eps_primal"]), eps_pri, rtol=1e-6)
      np.testing.assert_allclose(float(metrics["eps_dual"]), eps_dual, rtol=1e-6)
      assert bool(metrics["converged"]) == (r <= eps_pri and s <= eps_dual)
      assert float(metrics["rho"]) == pytest.approx(rho)
    assert larger == {0, 1}
    assert not bool(results[0.0, (abs_tol, rel_tol)]["converged"]) and bool(results[0.0, (10.0, 0.5)]["converged"])
    results = {tols: metrics for (shift, tols), metrics in results.items() if shift == 0.0}
    n = {2: 4.0, 0: 5.0} if objective == "examples" else {2: 1.0, 0: 1.0}
    want = sum(n[i] * _ridge_np(z, *all_clients[i]) for i in (2, 0)) / sum(n.values())
    np.testing.assert_allclose(float(results[abs_tol, rel_tol]["objective"]), want, rtol=1e-6)
    bits = 64 * (D + 1)  # every bit of one float64 model-sized vector each way
    assert float(results[abs_tol, rel_tol]["bits_up"]) == float(results[abs_tol, rel_tol]["bits_down"]) == bits


def test_residual_balancing_is_boyds_rule_with_the_default_mu_and_tau(lsq_clients):
  """Boyd §3.4.1 with the defaults μ = 10, τ = 2, checked at every iteration of two runs (ρ = 70, too large, and
  ρ = 0.2, too small, so that both branches are taken): ρ_{k+1} = τρ_k if ‖r_k‖ > μ‖s_k‖, ρ_k/τ if
  ‖s_k‖ > μ‖r_k‖, else ρ_k. Some iterations have a residual ratio between 10 and 11, so the default μ itself is
  pinned by what the runs do. Balancing is off by default, and an iteration in which nothing moves (r = s = 0)
  keeps ρ."""
  _, batches = lsq_clients
  defaults = inspect.signature(admm_consensus).parameters
  assert (defaults["balancing_mu"].default, defaults["balancing_tau"].default) == (10.0, 2.0)  # Boyd's suggestion
  with jax.enable_x64(True):
    moves, ratios = set(), []
    for rho in (70.0, 0.2):  # the first 40 of the shared program's 100 iterations
      _, history = _solve(_tree(np.zeros(D + 1)), batches, _hyper(rho=rho), balancing=True)
      r, s, rhos = (np.asarray(history[k][:40]) for k in ("primal_residual", "dual_residual", "rho"))
      assert rhos[0] == rho
      ratios.extend(np.maximum(r / s, s / r)[:-1])
      for k in range(len(rhos) - 1):
        want = rhos[k] * 2 if r[k] > 10 * s[k] else rhos[k] / 2 if s[k] > 10 * r[k] else rhos[k]
        assert rhos[k + 1] == pytest.approx(want, rel=1e-12), k
        moves.add(np.sign(np.log(rhos[k + 1] / rhos[k])))
    assert moves == {-1.0, 0.0, 1.0}
    assert any(10 < ratio < 11 for ratio in ratios)
    state, history = _solve(_tree(np.zeros(D + 1)), batches, _hyper(rho=50.0))  # 100 iterations
    np.testing.assert_array_equal(history["rho"], 50.0)
    assert float(state.rho) == 50.0
    idle = batches.replace(weight=jnp.asarray(np.zeros(N)))
    init, step, _ = _consensus(balancing=True)
    state = _np(step(init(_tree(np.arange(D + 1.0)), _hyper(rho=3.0)), idle, _hyper(rho=3.0)))
    assert float(state.metrics["primal_residual"]) == 0.0 and float(state.metrics["dual_residual"]) == 0.0
    assert float(state.rho) == 3.0


def test_examples_objective_from_init_counts_only_the_clients_seen(rng):
  """objective="examples" from `init` (every w_i = 0: no client seen yet). An iteration with no client keeps z; an
  iteration with client 2 alone, holding one real example, sets z = x̂_2 + λ_2/ρ (its weight is its one example,
  the unseen clients weigh 0), and λ_2 stays 0."""
  rho, alpha = 0.9, 1.4
  clients = make_clients(rng, [3, 2, 1, 4], D)
  z0 = rng.normal(size=D + 1)
  with jax.enable_x64(True):
    # Packed as `_two_of_four`'s batches (two steps of four slots, three rows: the shapes of its compiled step).
    batches = pack([clients[2]], 2, 4, extra_clients=2, dtype=np.float64).replace(
        client_id=jnp.asarray(np.array([2, 0, 1], np.int32)))
    state = _consensus("examples")[0](_tree(z0), _hyper(rho=rho))
    np.testing.assert_array_equal(np.asarray(state.client_weights), 0.0)
    idle = _step(state, batches.replace(weight=jnp.asarray(np.zeros(3))), "examples", alpha=alpha)
    np.testing.assert_array_equal(_vec(idle.params), z0)
    out = _step(state, batches, "examples", alpha=alpha)
    x, y = clients[2]
    a = np.hstack([x, np.ones((1, 1))])
    x2 = np.linalg.solve(a.T @ a + np.diag([L2] * D + [0.0]) + rho * np.eye(D + 1), a.T @ y + rho * z0)
    np.testing.assert_allclose(_vec(out.params), alpha * x2 + (1 - alpha) * z0, rtol=1e-10)
    np.testing.assert_array_equal(np.asarray(out.client_weights), [0.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(np.column_stack([out.duals["w"], out.duals["b"]]), 0.0, atol=1e-12)
    assert int(out.metrics["num_clients"]) == 1


def test_examples_objective_keeps_a_float32_model_float32_under_x64(rng):
  """The weighted z-average (objective="examples") is cast back to the model's dtype, like the plain mean that
  tests/test_convention.py checks for every factory."""
  clients = make_clients(rng, [5, 6, 4, 7], D)
  with jax.enable_x64(True):
    batches = pack(clients, 2, 4, dtype=np.float32)
    algo = admm_consensus(_ridge_loss, 1.0, num_clients=N, prox=prox_least_squares(L2), objective="examples")
    state = algo.init(jax.tree.map(lambda v: v.astype(jnp.float32), _tree(np.zeros(D + 1))), jax.random.key(0))
    after = jax.eval_shape(algo.step, state, batches)
    assert {leaf.dtype for leaf in jax.tree.leaves(after.params)} == {jnp.dtype(jnp.float32)}
    assert after.client_weights.dtype == after.rho.dtype == jnp.float32


def test_inexact_x_update_is_k_optax_steps_cycling_through_the_batches(rng):
  """prox=None: K = 3 SGD(η) steps from the client's previous x_i, step k on its batch k mod S (S = 2), along
  ∇f_{i,k}(x) + λ_i + ρ(x − z) (the augmented Lagrangian's gradient), a batch without real examples taking no step
  (client 2 holds 4 examples: its second batch is empty), in float64 NumPy; then z as usual."""
  rho, eta, k_steps = 0.8, 0.2, 3
  with jax.enable_x64(True):
    all_clients, batches, z, xs, lams = _two_of_four(rng)
    algo = admm_consensus(lsq_loss, rho, num_clients=N, client_optimizer=optax.sgd(eta), local_steps=k_steps)
    out = _np(jax.jit(algo.step)(_start(z, xs, lams, rho=rho), batches))  # init does not depend on the x-update
    data_x, data_y, mask = (np.asarray(a) for a in (batches.data["x"], batches.data["y"], batches.mask))
    new_xs, terms = xs.copy(), xs + lams / rho
    for c, i in enumerate((2, 0)):
      v = xs[i].copy()
      for k in range(k_steps):
        m = mask[c, k % 2]
        if not m.any():
          continue
        a = np.hstack([data_x[c, k % 2][m], np.ones((m.sum(), 1))])
        v = v - eta * (a.T @ (a @ v - data_y[c, k % 2][m]) / m.sum() + lams[i] + rho * (v - z))
      new_xs[i] = v
      terms[i] = v + lams[i] / rho
    np.testing.assert_allclose(np.column_stack([out.local_params["w"], out.local_params["b"]]), new_xs, rtol=1e-10)
    np.testing.assert_allclose(_vec(out.params), terms.mean(0), rtol=1e-10)


def test_vmap_over_rho_runs_a_sweep_in_one_program(lsq_clients):
  clients, batches = lsq_clients
  rhos = np.array([0.7, 1.0, 2.0])
  with jax.enable_x64(True):

    def solve(rho):
      algo = admm_consensus(_ridge_loss, rho, num_clients=N, prox=prox_least_squares(L2))
      state, history = _scan(algo, algo.init(_tree(np.zeros(D + 1)), jax.random.key(0)), batches, 150)
      return state.params, history["primal_residual"]

    params, residuals = _np(jax.jit(jax.vmap(solve))(rhos))
    z_star = _centralized_ridge(clients, L2)
    for i in range(len(rhos)):
      assert _rel_err(_vec(jax.tree.map(lambda a: a[i], params)), z_star) < 1e-6
    assert residuals.shape == (3, 150)
    assert not np.allclose(residuals[0, :5], residuals[2, :5])  # the three ρ really differ


_logistic_loss = ridge_logistic_loss(L2)


def test_inexact_consensus_reaches_the_lbfgs_optimum_of_logistic_regression(rng):
  """K = 10 full-batch SGD steps per x-update (no closed form): z reaches scipy's L-BFGS optimum to 1e-4."""
  sizes = [20, 30, 25, 15]
  clients = logistic_clients(rng, sizes, D)
  ref = ridge_logistic_optimum(clients, L2)
  with jax.enable_x64(True):
    batches = pack(clients, 1, max(sizes), dtype=np.float64)
    algo = admm_consensus(_logistic_loss, 1.0, num_clients=N, client_optimizer=optax.sgd(0.3), local_steps=10)
    state, history = _run(algo, _tree(np.zeros(D + 1)), batches, 150)
    assert _rel_err(_vec(state.params), ref) < 1e-4, _rel_err(_vec(state.params), ref)
    assert history["primal_residual"][-1] < 1e-5 * history["primal_residual"][0]
    np.testing.assert_allclose(float(history["objective"][-1]), ridge_logistic_objective(clients, L2, ref)[0] / N, rtol=1e-6)


def test_client_map_modes_agree(lsq_clients):
  _, batches = lsq_clients
  batches = jax.tree.map(lambda a: a.astype(np.float32) if a.dtype == np.float64 else a, batches)
  outs = []
  for mode in ["vmap", "sequential"]:
    algo = admm_consensus(lsq_loss, 1.0, num_clients=N, client_optimizer=optax.sgd(0.1), local_steps=3,
                          client_map=mode)
    state = algo.init(_tree(np.zeros(D + 1, np.float32)), jax.random.key(0))
    outs.append(_vec(jax.jit(algo.step)(state, batches).params))
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_bad_arguments():
  prox = prox_least_squares()
  for rho in (0.0, -1.0, None):
    with pytest.raises(ValueError, match=r"rho \(ρ, the ADMM penalty\) must be"):
      admm_consensus(lsq_loss, rho, num_clients=N, prox=prox)
  for alpha in (0.0, 2.0, -0.5, 2.5):
    with pytest.raises(ValueError, match=r"relaxation \(α, over-relaxation\) must lie in the open interval \(0, 2\)"):
      admm_consensus(lsq_loss, 1.0, num_clients=N, prox=prox, relaxation=alpha)
  with pytest.raises(ValueError, match=r"needs prox .* or client_optimizer"):
    admm_consensus(lsq_loss, 1.0, num_clients=N)
  with pytest.raises(ValueError, match=r"local_steps must be a Python int >= 1; got 0"):
    admm_consensus(lsq_loss, 1.0, num_clients=N, client_optimizer=optax.sgd(0.1), local_steps=0)
  with pytest.raises(ValueError, match=r"balancing_tau \(τ\) must be > 1"):
    admm_consensus(lsq_loss, 1.0, num_clients=N, prox=prox, residual_balancing=True, balancing_tau=1.0)
  with pytest.raises(TypeError, match=r"num_clients must be a Python int >= 1"):
    admm_consensus(lsq_loss, 1.0, num_clients=None, prox=prox)
  with pytest.raises(ValueError, match=r"objective must be one of \('clients', 'examples'\); got 'pooled'"):
    admm_consensus(lsq_loss, 1.0, num_clients=N, prox=prox, objective="pooled")
  with pytest.raises(ValueError, match=r"l2 must be finite and >= 0"):
    prox_least_squares(-1.0)
  with pytest.raises(ValueError, match=r"rho \(ρ, the ADMM penalty\) must be"):
    admm_sharing(0.0, num_samples=10)
  with pytest.raises(ValueError, match=r"l1 must be finite and >= 0"):
    admm_sharing(1.0, num_samples=10, l1=-0.1)


def _vertical_batches(x, y, blocks, *, nan_client=None, nan_labels_after_client_zero=False, nan_features=False):
  """Column blocks of X as one client each, `[N, 1, m, d_max]`; the last client has one padding sample row.

  Built in NumPy (no eager op to compile): `nan_client`'s real samples' features are NaN; with
  `nan_labels_after_client_zero` every row's labels but client 0's are NaN; with `nan_features` every feature is.
  """
  m = len(y)
  n, d_max = len(blocks), max(blocks)
  starts = np.cumsum([0] + list(blocks))
  a = np.zeros((n, 1, m + 1, d_max))
  for i, d in enumerate(blocks):
    a[i, 0, :m, :d] = x[:, starts[i]:starts[i + 1]]
  a[:, 0, m] = 7.0  # a padding sample with arbitrary values
  if nan_client is not None:
    a[nan_client, 0, :m] = np.nan
  if nan_features:
    a[:] = np.nan
  labels = np.broadcast_to(np.append(y, 3.0), (n, 1, m + 1)).copy()
  if nan_labels_after_client_zero:
    labels[1:] = np.nan
  mask = np.ones((n, 1, m + 1), bool)
  mask[:, 0, m] = False
  return fo.ClientBatches(data={"x": jnp.asarray(a), "y": jnp.asarray(labels)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray(np.ones(n)), client_id=jnp.asarray(np.arange(n, dtype=np.int32)))


def _sharing_hyper(rho, l1=0.0, l2=0.0, alpha=1.0):
  """The traced hyper-parameters of `_sharing`'s programs (always the same pytree)."""
  return dict(rho=rho, l1=l1, l2=l2, alpha=alpha)


@functools.cache
def _sharing(loss="squared", num_samples=61, inner_steps=20, iterations=6):
  """Sharing ADMM built inside jitted programs from the traced `_sharing_hyper(...)` dict `h`, once per static
  choice: `init(x0, h)`, `step(state, batches, h)` and `run(x0, batches, h) -> (state, metrics history)` of
  `iterations` iterations from `init`."""

  def algo(h):
    return admm_sharing(h["rho"], num_samples=num_samples, loss=loss, l1=h["l1"], l2=h["l2"], inner_steps=inner_steps,
                        relaxation=h["alpha"])

  init = jax.jit(lambda x0, h: algo(h).init(x0, jax.random.key(0)))
  step = jax.jit(lambda state, batches, h: algo(h).step(state, batches))
  run = jax.jit(lambda x0, batches, h: _scan(algo(h), algo(h).init(x0, jax.random.key(0)), batches, iterations))
  return init, step, run


@pytest.mark.parametrize("regularizer", ["lasso", "ridge"])
def test_sharing_admm_reaches_the_scikit_learn_solution_with_features_split_by_column(rng, regularizer):
  m, blocks = 40, [3, 2, 4]
  x = rng.normal(size=(m, sum(blocks)))
  true_coef = rng.normal(size=x.shape[1]) * (rng.random(x.shape[1]) < 0.6)
  y = x @ true_coef + 0.1 * rng.normal(size=m)
  if regularizer == "lasso":  # (1/(2m))‖Xw − y‖² + α‖w‖₁
    coef = Lasso(alpha=0.1, fit_intercept=False, tol=1e-14, max_iter=100000).fit(x, y).coef_
    options = dict(l1=0.1)
    assert np.sum(coef == 0) >= 1  # the solution is sparse, so the ℓ1 prox matters
  else:  # ‖Xw − y‖² + α‖w‖² = 2m [(1/(2m))‖Xw − y‖² + (α/m)/2 ‖w‖²]
    coef = Ridge(alpha=0.5, fit_intercept=False).fit(x, y).coef_
    options = dict(l2=0.5 / m)
  with jax.enable_x64(True):
    batches = _vertical_batches(x, y, blocks)
    run = _sharing(num_samples=m + 1, iterations=300)[2]
    state, history = _np(run(np.zeros((len(blocks), max(blocks))), batches, _sharing_hyper(0.05, **options)))
    got = np.concatenate([np.asarray(state.params[i, :d]) for i, d in enumerate(blocks)])
    assert _rel_err(got, coef) < 1e-5, _rel_err(got, coef)
    np.testing.assert_array_equal(np.asarray(state.params[1, 2:]), 0)  # padding columns stay 0
    assert history["primal_residual"][-1] < 1e-8 and history["dual_residual"][-1] < 1e-8
    objective = np.sum((x @ coef - y) ** 2) / (2 * m) + options.get("l1", 0) * np.abs(coef).sum() + \
        0.5 * options.get("l2", 0) * coef @ coef
    np.testing.assert_allclose(float(history["objective"][-1]), objective, rtol=1e-6)


def _logistic_data(rng, m=60, blocks=(3, 2, 4)):
  x = rng.normal(size=(m, sum(blocks)))
  y = (x @ rng.normal(size=x.shape[1]) + 0.5 * rng.normal(size=m) > 0).astype(np.float64)
  return x, y, list(blocks)


def _logistic_objective(w, x, y, l1, l2):
  s = x @ w
  return np.mean(np.logaddexp(0, s) - y * s) + l1 * np.abs(w).sum() + 0.5 * l2 * w @ w


def _l1_logistic_reference(x, y, l1):
  """argmin (1/m) Σ log-loss + l1‖w‖₁ in float64: L-BFGS-B on w = w⁺ − w⁻ with w± >= 0 (smooth, bound-constrained)."""
  m, d = x.shape

  def fun(v):
    w = v[:d] - v[d:]
    s = x @ w
    p = 1 / (1 + np.exp(-s))
    g = x.T @ (p - y) / m
    return np.mean(np.logaddexp(0, s) - y * s) + l1 * v.sum(), np.concatenate([g + l1, -g + l1])

  v = scipy.optimize.minimize(fun, np.zeros(2 * d), jac=True, method="L-BFGS-B", bounds=[(0, None)] * (2 * d),
                              options={"gtol": 1e-14, "ftol": 1e-16, "maxiter": 20000}).x
  return v[:d] - v[d:]


@pytest.mark.parametrize("regularizer", ["l2", "l1"])
def test_sharing_admm_logistic_regression_with_features_split_by_column(rng, regularizer):
  """Vertical logistic regression (labels in {0, 1}) reaches scikit-learn (ℓ2) / scipy (ℓ1) float64 optima to 1e-4.

  400 iterations: the over-relaxation test's compiled program (300 already reach 1e-4)."""
  x, y, blocks = _logistic_data(rng)
  m, c = len(y), 0.5
  if regularizer == "l2":  # C Σ log-loss + ½‖w‖² = Cm [(1/m) Σ log-loss + (1/(Cm))/2 ‖w‖²]
    coef = LogisticRegression(C=c, fit_intercept=False, tol=1e-12, max_iter=10000).fit(x, y).coef_[0]
    options = dict(l2=1 / (c * m))
  else:
    options = dict(l1=0.03)
    coef = _l1_logistic_reference(x, y, options["l1"])
    assert np.sum(np.abs(coef) < 1e-8) >= 1  # sparse: the ℓ1 prox matters
  with jax.enable_x64(True):
    batches = _vertical_batches(x, y, blocks)
    run = _sharing("logistic", m + 1, iterations=400)[2]
    state, history = _np(run(np.zeros((len(blocks), max(blocks))), batches, _sharing_hyper(0.01, **options)))
    got = np.concatenate([np.asarray(state.params[i, :d]) for i, d in enumerate(blocks)])
    assert _rel_err(got, coef) < 1e-4, _rel_err(got, coef)
    np.testing.assert_array_equal(np.asarray(state.params[1, 2:]), 0)
    assert history["primal_residual"][-1] < 1e-7
    want = _logistic_objective(coef, x, y, options.get("l1", 0), options.get("l2", 0))
    np.testing.assert_allclose(float(history["objective"][-1]), want, rtol=1e-6)


@pytest.mark.parametrize("loss", ["squared", "logistic"])
def test_sharing_over_relaxation_reaches_the_same_solution(rng, loss):
  """α = 1.5 (Boyd §3.4.3) converges to the α = 1 solution; the iterates differ on the way."""
  x, y, blocks = _logistic_data(rng)
  m = len(y)
  with jax.enable_x64(True):
    batches = _vertical_batches(x, y, blocks)
    runs = []
    for alpha in (1.0, 1.5):  # one compiled program: α is traced
      h = _sharing_hyper(0.05 if loss == "squared" else 0.01, l2=0.02, alpha=alpha)
      state, history = _np(_sharing(loss, m + 1, iterations=400)[2](np.zeros((len(blocks), max(blocks))), batches, h))
      runs.append((np.asarray(state.params), np.asarray(history["objective"])))
    np.testing.assert_allclose(runs[1][0], runs[0][0], atol=1e-7)
    assert not np.allclose(runs[1][1][:5], runs[0][1][:5])


def test_sharing_bad_loss_labels_and_relaxation(rng):
  with pytest.raises(ValueError, match=r"loss must be one of \('squared', 'logistic'\); got 'hinge'"):
    admm_sharing(1.0, num_samples=10, loss="hinge")
  for alpha in (0.0, 2.0):
    with pytest.raises(ValueError, match=r"relaxation \(α, over-relaxation\) must lie in the open interval \(0, 2\)"):
      admm_sharing(1.0, num_samples=10, relaxation=alpha)
  with pytest.raises(ValueError, match=r"newton_steps must be a Python int >= 1; got 0"):
    admm_sharing(1.0, num_samples=10, loss="logistic", newton_steps=0)
  x, y, blocks = _logistic_data(rng)
  algo = admm_sharing(1.0, num_samples=len(y) + 1, loss="logistic")
  state = algo.init(jnp.zeros((len(blocks), max(blocks))), jax.random.key(0))
  with pytest.raises(ValueError, match=r"needs labels in \{0, 1\} .* got -1.0"):
    algo.step(state, _vertical_batches(x, 2 * y - 1, blocks))
  good = _vertical_batches(x, y, blocks)
  two_steps = good.replace(data=jax.tree.map(lambda a: jnp.concatenate([a, a], axis=1), good.data),
                           mask=jnp.concatenate([good.mask, good.mask], axis=1))
  with pytest.raises(ValueError, match=r"must be \[N, 1, m, d_max\] = \(3, 1, 61, 4\) \(one local step"):
    algo.step(state, two_steps)


def _numpy_sharing_ridge(blocks_a, b, xs, zs, us, rho, alpha, l2):
  """One over-relaxed sharing ADMM iteration in its unreduced form, float64 (Boyd et al. 2011 §7.3 with §3.4.3).

  Every client keeps its own copy z_i `[m]` and scaled dual u_i `[m]`; the joint z-update is one (N·m)² solve:

      x_i = argmin (λ₂/2)‖x‖² + (ρ/2)‖A_i x − z_i + u_i‖²,   h_i = α A_i x_i + (1 − α) z_i,
      z = argmin (1/(2m))‖Σ_i z_i − b‖² + (ρ/2) Σ_i ‖z_i − h_i − u_i‖²,   u_i += h_i − z_i.
  """
  n, m = len(blocks_a), len(b)
  xs = [np.linalg.solve(rho * a.T @ a + l2 * np.eye(a.shape[1]), rho * a.T @ (z - u))
        for a, z, u in zip(blocks_a, zs, us)]
  h = np.stack([alpha * a @ x + (1 - alpha) * z for a, x, z in zip(blocks_a, xs, zs)])
  system = np.kron(np.ones((n, n)), np.eye(m)) / m + rho * np.eye(n * m)
  zs = np.linalg.solve(system, (np.tile(b / m, n) + rho * (h + us).reshape(-1))).reshape(n, m)
  return xs, zs, us + h - zs


@pytest.mark.parametrize("alpha, blocks", [(0.6, (3, 2, 4)), (1.0, (3, 2, 4)), (1.7, (3, 2, 4)), (1.7, (5,))])
def test_sharing_over_relaxation_matches_the_unreduced_iteration_in_numpy(rng, alpha, blocks):
  """Five iterations from a random x^0 equal the per-client form (z_i, u_i) of Boyd §7.3 with h_i = αA_i x_i + (1−α)z_i.

  Pins the over-relaxation coefficient in the z- and u-updates (§3.4.3): 200 ISTA steps solve the ridge
  x-update to machine precision, so the only difference left would be the formula.
  """
  x, y, blocks = _logistic_data(rng, m=30, blocks=blocks)
  y = x @ rng.normal(size=x.shape[1])  # squared loss
  m, n, rho, l2 = len(y), len(blocks), 0.05, 0.02
  starts = np.cumsum([0] + blocks)
  blocks_a = [x[:, starts[i]:starts[i + 1]] for i in range(n)]
  x0 = np.zeros((n, max(blocks)))
  xs = [rng.normal(size=d) for d in blocks]
  for i, d in enumerate(blocks):
    x0[i, :d] = xs[i]
  zs = np.stack([a @ xi for a, xi in zip(blocks_a, xs)])  # z_i^0 = A_i x_i^0 (offsets start at 0)
  us = np.zeros((n, m))
  with jax.enable_x64(True):
    init, step, _ = _sharing(num_samples=m + 1, inner_steps=200)
    h = _sharing_hyper(rho, l2=l2, alpha=alpha)  # traced: the α cases share one program per shape
    state = init(x0, h)
    batches = _vertical_batches(x, y, blocks)
    for _ in range(5):
      z_bar_old = state.z_bar
      state = _np(step(state, batches, h))
      xs, zs, us = _numpy_sharing_ridge(blocks_a, y, xs, zs, us, rho, alpha, l2)
      got = [np.asarray(state.params[i, :d]) for i, d in enumerate(blocks)]
      for g, want in zip(got, xs):
        np.testing.assert_allclose(g, want, rtol=1e-9, atol=1e-12)
      got_zs = np.asarray(state.predictions + state.share_offsets)[:, :m]  # z_i = A_i x_i + d_i
      np.testing.assert_allclose(got_zs, zs, rtol=1e-9, atol=1e-12)
      np.testing.assert_allclose(np.broadcast_to(np.asarray(state.scaled_dual)[:m], us.shape), us, rtol=1e-9,
                                 atol=1e-12)  # the u_i stay equal: one u
      np.testing.assert_allclose(np.asarray(state.z_bar)[:m], zs.mean(0), rtol=1e-9, atol=1e-12)
    h_bar = np.mean([alpha * a @ xi for a, xi in zip(blocks_a, xs)], axis=0) + (1 - alpha) * np.asarray(
        z_bar_old)[:m]
    np.testing.assert_allclose(float(state.metrics["primal_residual"]), np.sqrt(n) * np.linalg.norm(h_bar - zs.mean(0)),
                               rtol=1e-5)
    assert int(state.metrics["num_nonfinite"]) == 0


@pytest.mark.parametrize("loss, alpha, blocks", [("squared", 1.0, (3, 2, 4)), ("squared", 1.5, (3, 2, 4)),
                                                  ("logistic", 1.0, (3, 2, 4)), ("squared", 1.5, (3, 2))])
def test_sharing_a_client_with_nan_features_is_frozen_and_never_spreads(rng, loss, alpha, blocks):
  """Client 1's feature block is NaN: it keeps x_1 (its random start), offset and share; it is counted; the others
  run exactly the sharing ADMM of the finite clients (its share, never finite, counts as 0; with two clients, one is
  left), every state entry and metric stays finite; z̄ = (N_F t + 0)/N with t the finite clients' mean copy."""
  x, y, blocks = _logistic_data(rng, blocks=blocks)
  if loss == "squared":
    y = x @ rng.normal(size=x.shape[1])
  m, bad = len(y), 1
  x0 = np.zeros((len(blocks), max(blocks)))
  for i, d in enumerate(blocks):
    x0[i, :d] = rng.normal(size=d)
  keep = [i for i in range(len(blocks)) if i != bad]
  with jax.enable_x64(True):
    poisoned = _vertical_batches(x, y, blocks, nan_client=bad)
    rest = _vertical_batches(np.delete(x, np.s_[blocks[0]:blocks[0] + blocks[1]], axis=1), y, blocks[:1] + blocks[2:])
    h = _sharing_hyper(0.05 if loss == "squared" else 0.01, l2=0.02, alpha=alpha)
    run = _sharing(loss, m + 1)[2]  # 6 iterations
    state, history = _np(run(x0, poisoned, h))
    reference, ref_history = _np(run(x0[keep], rest, h))
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      if jnp.issubdtype(leaf.dtype, jnp.inexact):
        assert np.all(np.isfinite(np.asarray(leaf))), jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(state.params[bad]), x0[bad])
    np.testing.assert_array_equal(np.asarray(state.share_offsets[bad]), 0)
    np.testing.assert_array_equal(np.asarray(state.predictions[bad]), 0)
    np.testing.assert_array_equal(history["num_nonfinite"], 1)
    np.testing.assert_allclose(np.asarray(state.params[np.asarray(keep)]), np.asarray(reference.params), rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(np.asarray(state.scaled_dual), np.asarray(reference.scaled_dual), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(state.z_bar), len(keep) * np.asarray(reference.z_bar) / len(blocks),
                               rtol=1e-9, atol=1e-12)
    frozen_penalty = 0.5 * 0.02 * x0[bad] @ x0[bad]  # the objective is the whole model's: x_1 is still in it
    np.testing.assert_allclose(history["objective"], ref_history["objective"] + frozen_penalty, rtol=1e-6)


def _numpy_safeguarded_newton(v, labels, real, n, frozen, m, rho, start, steps):
  """The module docstring's z̄-update solver in float64: per sample, φ(t) = (σ(n t + c) − b)/m + ρ(t − v) (only ρ(t − v)
  on padding), bracket [v − 1/(mρ), v + 1/(mρ)], start clipped into it; each step shrinks the bracket to the sign
  change of φ at t and takes the Newton point t − φ/φ' if it lies inside and moves at most half the move before
  the last (both start as the bracket's width) or within rounding of t, else the bracket's midpoint.
  Returns t and how many steps fell back to the midpoint."""
  out, fallbacks = [], 0
  for j in range(len(v)):
    lo, hi = v[j] - 1 / (m * rho), v[j] + 1 / (m * rho)
    t = min(max(start[j], lo), hi)
    last = older = hi - lo
    for _ in range(steps):
      sig = 1 / (1 + np.exp(-(n * t + frozen[j])))
      phi = ((sig - labels[j]) / m if real[j] else 0.0) + rho * (t - v[j])
      slope = (n * sig * (1 - sig) / m if real[j] else 0.0) + rho
      if phi <= 0:
        lo = t
      if phi >= 0:
        hi = t
      candidate = t - phi / slope
      converged = abs(candidate - t) <= 16 * np.finfo(np.float64).eps * (1 + abs(t))
      newton = lo <= candidate <= hi and (abs(candidate - t) <= abs(older) / 2 or converged)
      new = candidate if newton else 0.5 * (lo + hi)
      fallbacks += not newton
      t, last, older = new, new - t, last
    out.append(t)
  return np.array(out), fallbacks


def _z_update(*args):
  """`_logistic_z_update` through one jitted program per `steps` (its last argument): eagerly, each of its ops would
  compile on its own."""
  from fedjax_opt.algorithms.admm_sharing import _logistic_z_update  # pylint: disable=import-outside-toplevel
  return _jitted_z_update(_logistic_z_update)(*args)


@functools.cache
def _jitted_z_update(fn):
  return jax.jit(fn, static_argnums=8)


def test_sharing_logistic_z_update_is_the_safeguarded_newton_of_the_docstring(rng):
  """Each of the first steps equals the NumPy transcription (bracket v ± 1/(mρ), clipped start, bisection fallback,
  frozen shares c inside σ, padding samples t = v); 80 steps solve φ(t) = 0 to rounding."""
  size, n, m, rho = 9, 10.0, 8.0, 0.004  # steep σ(N t), wide bracket: some Newton points leave it
  v = rng.normal(size=size) * 3
  labels = (rng.random(size) < 0.5).astype(np.float64)
  real = np.arange(size) < 8  # the last sample is padding
  frozen = rng.normal(size=size) * 2
  width = 1 / (m * rho)  # the bracket's half-width, 31.25
  # Starts outside the bracket on both sides (clipped into it) and inside it; the last sample is padding.
  start = v + width * np.array([-2.5, 1.7, 0.4, -1.2, 3.0, -0.3, 1.1, -4.0, 2.0])
  with jax.enable_x64(True):
    for steps in (1, 2, 3, 5):
      got = _z_update(jnp.asarray(v), jnp.asarray(labels), jnp.asarray(real), jnp.asarray(n),
                               jnp.asarray(frozen), jnp.asarray(m), jnp.asarray(rho), jnp.asarray(start), steps)
      want, fallbacks = _numpy_safeguarded_newton(v, labels, real, n, frozen, m, rho, start, steps)
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-13)
    assert fallbacks > 0  # the bisection branch was taken
    t = np.asarray(_z_update(jnp.asarray(v), jnp.asarray(labels), jnp.asarray(real), jnp.asarray(n),
                                      jnp.asarray(frozen), jnp.asarray(m), jnp.asarray(rho), jnp.asarray(start), 80))
  phi = np.where(real, (1 / (1 + np.exp(-(n * t + frozen))) - labels) / m, 0) + rho * (t - v)
  np.testing.assert_allclose(phi, 0, atol=1e-15)
  assert t[-1] == v[-1]


def test_sharing_logistic_z_update_in_float32_under_x64_uses_float32_rounding():
  """A float32 solve with x64 on: "within rounding" is float32's (16 eps₃₂ (1 + |t|)), so once converged it keeps
  its root; with float64's eps, rounding-level Newton moves fail the halving test and bisect a bracket left wide
  on one side (max |φ| about 1.6e-5 after 30 steps instead of 1.1e-8). φ is evaluated in float64 NumPy."""
  rng = np.random.default_rng(1)
  size, n, m, rho = 4000, 10.0, 8.0, 0.004
  f32 = np.float32
  v = (rng.normal(size=size) * 3).astype(f32)
  labels = (rng.random(size) < 0.5).astype(f32)
  frozen = (rng.normal(size=size) * 2).astype(f32)
  start = (v + rng.normal(size=size) * 40).astype(f32)
  with jax.enable_x64(True):
    args = [jnp.asarray(a) for a in (v, labels, np.ones(size, bool), f32(n), frozen, f32(m), f32(rho), start)]
    t = _z_update(*args, 30)
    assert t.dtype == jnp.float32
  t = np.asarray(t, np.float64)
  phi = (1 / (1 + np.exp(-(n * t + frozen))) - labels) / m + rho * (t - v)
  assert np.abs(phi).max() < 1e-6


@pytest.mark.parametrize("loss", ["squared", "logistic"])
def test_sharing_x_update_is_ista_with_step_one_over_rho_norm_squared_plus_l2(rng, loss):
  """Two ISTA steps of the client problem, from a random x^0, with step 1/L, L = ρ‖A_i‖₂² + λ₂ (spectral norm), the
  ℓ1 prox and the ℓ2 term, equal NumPy in float64; a float32 model keeps float32 state under x64."""
  x, y, blocks = _logistic_data(rng, m=20)
  m, n, rho, l1, l2 = len(y), len(blocks), 0.3, 0.02, 0.4
  starts = np.cumsum([0] + blocks)
  x0 = np.zeros((n, max(blocks)))
  for i, d in enumerate(blocks):
    x0[i, :d] = rng.normal(size=d)
  want = []
  for i, d in enumerate(blocks):
    a, xk = x[:, starts[i]:starts[i + 1]], x0[i, :d]
    target = a @ xk  # z_i^0 − u^0 = A_i x_i^0 (offsets and u start at 0)
    step = 1 / (rho * np.linalg.norm(a, 2) ** 2 + l2)
    for _ in range(2):
      v = xk - step * (rho * a.T @ (a @ xk - target) + l2 * xk)
      xk = np.sign(v) * np.maximum(np.abs(v) - step * l1, 0)
    want.append(xk)
  with jax.enable_x64(True):
    init, step, _ = _sharing(loss, m + 1, inner_steps=2)
    h = _sharing_hyper(rho, l1=l1, l2=l2)
    state = step(init(x0, h), _vertical_batches(x, y, blocks), h)
    for i, d in enumerate(blocks):
      np.testing.assert_allclose(np.asarray(state.params[i, :d]), want[i], rtol=1e-12, atol=1e-14)
    small = init(x0.astype(np.float32), h)
    small = step(small, _vertical_batches(x, y, blocks), h)  # float64 data, float32 model
    for path, leaf in jax.tree_util.tree_flatten_with_path(small)[0]:
      if jnp.issubdtype(leaf.dtype, jnp.floating) and not jax.tree_util.keystr(path).startswith(".metrics"):
        assert leaf.dtype == jnp.float32, jax.tree_util.keystr(path)


def test_sharing_labels_are_client_zeros(rng):
  """The labels are read from client 0 (the label holder): NaN labels in every other row change nothing."""
  x, y, blocks = _logistic_data(rng, m=20)
  with jax.enable_x64(True):
    for loss in ("squared", "logistic"):  # the no-finite-client test's programs
      init, step, _ = _sharing(loss, len(y) + 1, inner_steps=3)
      h = _sharing_hyper(0.1, l2=0.1)
      state = init(np.zeros((len(blocks), max(blocks))), h)
      batches = _vertical_batches(x, y, blocks)
      others_nan = _vertical_batches(x, y, blocks, nan_labels_after_client_zero=True)
      chex.assert_trees_all_equal(step(state, others_nan, h), step(state, batches, h))


def test_sharing_a_client_frozen_mid_run_leaves_its_last_share_inside_the_loss(rng):
  """Client 1 turns NaN after three finite iterations: the two others then run exactly the sharing ADMM of two clients
  on the labels b − c, c = A_1 x_1³ its last share (squared loss: ℓ(z_0 + z_2 + c) = (1/(2m))‖z_0 + z_2 − (b − c)‖²),
  continued from their own x, offsets and u; z̄ = (2 t + c)/3 with t the two clients' mean copy."""
  x, y, blocks = _logistic_data(rng, m=30)
  y = x @ rng.normal(size=x.shape[1])
  m, bad, keep = len(y), 1, [0, 2]
  with jax.enable_x64(True):
    init, step, _ = _sharing(num_samples=m + 1, inner_steps=5)
    h = _sharing_hyper(0.05, l2=0.02, alpha=1.3)
    batches = _vertical_batches(x, y, blocks)
    poisoned = _vertical_batches(x, y, blocks, nan_client=bad)
    state = init(np.zeros((3, max(blocks))), h)
    for _ in range(3):  # the same step program as the poisoned iterations below
      state = _np(step(state, batches, h))
    c = np.asarray(state.predictions[bad])
    assert np.abs(c[:m]).max() > 1e-3  # the frozen share is not 0
    pick = lambda a: jnp.asarray(np.asarray(a)[keep])
    rest_x = np.delete(x, np.s_[blocks[0]:blocks[0] + blocks[1]], axis=1)
    rest = _vertical_batches(rest_x, y - c[:m], [blocks[0], blocks[2]])
    ref = init(pick(state.params)[:, :max(blocks)], h).replace(
        scaled_dual=state.scaled_dual, share_offsets=pick(state.share_offsets), predictions=pick(state.predictions))
    for _ in range(4):
      state, ref = _np(step(state, poisoned, h)), _np(step(ref, rest, h))
      np.testing.assert_allclose(np.asarray(state.params[np.asarray(keep)]), np.asarray(ref.params), rtol=1e-9,
                                 atol=1e-12)
      np.testing.assert_allclose(np.asarray(state.scaled_dual), np.asarray(ref.scaled_dual), rtol=1e-9, atol=1e-12)
      np.testing.assert_allclose(np.asarray(state.z_bar)[:m], (2 * np.asarray(ref.z_bar)[:m] + c[:m]) / 3,
                                 rtol=1e-9, atol=1e-12)
      np.testing.assert_array_equal(np.asarray(state.predictions[bad]), c)
      assert int(state.metrics["num_nonfinite"]) == 1


@pytest.mark.parametrize("loss", ["squared", "logistic"])
def test_sharing_an_iteration_with_no_finite_client_changes_nothing(rng, loss):
  """Every feature block NaN: x, z̄, u, the offsets and the stored shares stay as they were; all N are counted."""
  x, y, blocks = _logistic_data(rng, m=20)
  with jax.enable_x64(True):
    init, step, _ = _sharing(loss, len(y) + 1, inner_steps=3)  # the labels test's programs
    h = _sharing_hyper(0.1, l2=0.1)
    batches = _vertical_batches(x, y, blocks)
    state = init(np.zeros((len(blocks), max(blocks))), h)
    for _ in range(2):
      state = step(state, batches, h)
    state = _np(state)
    after = _np(step(state, _vertical_batches(x, y, blocks, nan_features=True), h))
    for field in ("params", "z_bar", "scaled_dual", "share_offsets", "predictions"):
      np.testing.assert_array_equal(np.asarray(getattr(after, field)), np.asarray(getattr(state, field)), field)
    assert int(after.metrics["num_nonfinite"]) == len(blocks)
    assert float(after.metrics["primal_residual"]) == 0 and float(after.metrics["dual_residual"]) == 0


def test_sharing_logistic_z_update_escapes_the_two_cycle_of_plain_bracketed_newton():
  """σ(10 t + 1), m = 8, ρ = 0.004, v = 2, b = 0, started at the bracket's end: plain bracket-checked Newton jumps
  between the two ends t = −29.25 and t = 2 forever (φ = ∓1/8); the half-step rule reaches the root (checked
  against scipy's brentq) in 60 steps."""
  n, m, rho, v, b, c = 10.0, 8.0, 0.004, 2.0, 0.0, 1.0
  phi = lambda t: (1 / (1 + np.exp(-(n * t + c))) - b) / m + rho * (t - v)
  root = scipy.optimize.brentq(phi, v - 1 / (m * rho), v + 1 / (m * rho), xtol=1e-15)
  with jax.enable_x64(True):
    args = [np.asarray([x]) for x in (v, b, True, n, c, m, rho, v - 100)]
    got = float(np.asarray(_z_update(*args[:3], args[3][0], args[4], args[5][0], args[6][0], args[7], 60))[0])
  np.testing.assert_allclose(got, root, rtol=1e-12)
