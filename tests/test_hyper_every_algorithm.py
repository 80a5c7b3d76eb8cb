"""fo.hyper on every factory: a hyper-gradient that matches float64 central differences, or a one-line refusal.

Every factory of tests/algorithm_examples.py is listed here exactly once: in `SUPPORTED` with its continuous
hyper-parameters (the paper's symbols, or the client optimizer's learning rate for factories that have none of
their own), in `REFUSED` with the decision that makes its step non-differentiable, or in `NOTHING_TO_TUNE`.
For a supported one, one jitted float64 program runs `fo.hyper.value_and_grad` over 4 rounds of the example's
inputs and the 2P runs at u ± ε e_i; the gradient must match their central differences to 1e-4 relative. A
refused one must raise `fo.hyper.NotDifferentiableError` in one line when traced. The refusals run in the
default tier, the gradient checks in the slow one (CI's second tier). docs/algorithms.md ("Hyper-gradients") has
the same table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from algorithm_examples import B, D, EXAMPLES, N, S, example_inputs, loss_fn

import fedjax_opt as fo

ROUNDS = 4
EPS = 1e-5


def _sgd(h, name="lr"):
  return optax.sgd(h[name])


def _every_client_arrives():
  return fo.core.asynchrony.wall_clock(fo.core.asynchrony.exponential(1.0), arrivals_per_step=N)


def _mixing():
  return fo.graphs.metropolis_hastings(fo.graphs.ring(N))


SUPPORTED = {
    # name: (make_algorithm(h), starting h, parametrization)
    "fedavg": (lambda h: fo.algorithms.fedavg(loss_fn, client_optimizer=_sgd(h)), {"lr": 0.05}, {}),
    "fedsgd": (lambda h: fo.algorithms.fedsgd(loss_fn, server_optimizer=_sgd(h)), {"lr": 0.1}, {}),
    "fedprox": (lambda h: fo.algorithms.fedprox(loss_fn, h["mu"], client_optimizer=optax.sgd(0.05)), {"mu": 0.3}, {}),
    "scaffold": (lambda h: fo.algorithms.scaffold(loss_fn, h["eta_l"], h["eta_g"], num_clients=N),
                 {"eta_l": 0.05, "eta_g": 0.8}, {}),
    "fednova": (lambda h: fo.algorithms.fednova(loss_fn, h["eta"], h["rho"]), {"eta": 0.05, "rho": 0.5},
                {"rho": "logit"}),
    "feddyn": (lambda h: fo.algorithms.feddyn(loss_fn, h["alpha"], num_clients=N, client_optimizer=optax.sgd(0.05)),
               {"alpha": 0.1}, {}),
    "ditto": (lambda h: fo.algorithms.ditto(loss_fn, h["lam"], h["eta"], num_clients=N, personal_steps=2,
                                            client_optimizer=optax.sgd(0.05)), {"lam": 0.5, "eta": 0.05}, {}),
    "pfedme": (lambda h: fo.algorithms.pfedme(loss_fn, h["lam"], h["eta"], h["beta"], num_clients=N, local_steps=S,
                                              inner_steps=2, inner_lr=0.05), {"lam": 1.0, "eta": 0.05, "beta": 1.0},
               {}),
    "easgd": (lambda h: fo.algorithms.easgd(loss_fn, h["alpha"], num_clients=N, client_optimizer=optax.sgd(0.05)),
              {"alpha": 0.2}, {"alpha": "logit"}),
    "fedu": (lambda h: fo.algorithms.fedu(loss_fn, h["lam"], h["eta"], graph=fo.graphs.ring(N), num_clients=N,
                                          local_steps=S), {"lam": 0.1, "eta": 0.05}, {}),
    "fedavg_finetune": (lambda h: fo.algorithms.fedavg_finetune(
        loss_fn, switch_round=2, personalize_steps=1, client_optimizer=_sgd(h),
        finetune_client_optimizer=optax.sgd(0.02)), {"lr": 0.05}, {}),
    "fedem": (lambda h: fo.algorithms.fedem(loss_fn, num_components=2, num_clients=N, client_optimizer=_sgd(h)),
              {"lr": 0.05}, {}),
    "d_fedem": (lambda h: fo.algorithms.d_fedem(loss_fn, num_components=2, graph=_mixing(), client_optimizer=_sgd(h)),
                {"lr": 0.05}, {}),
    "fedmd": (lambda h: fo.algorithms.fedmd(
        loss_fn, apply_fn=lambda p, x: (x @ p["w"] + p["b"])[:, None], num_clients=N,
        public_data={"x": jnp.asarray(np.linspace(-1, 1, 4 * D).reshape(4, D))}, public_per_round=4,
        digest_steps=2, digest_batch_size=2, client_optimizer=_sgd(h)), {"lr": 0.05}, {}),
    "l2gd": (lambda h: fo.algorithms.l2gd(loss_fn, h["lam"], h["alpha"], 0.3, num_clients=N),
             {"lam": 0.5, "alpha": 0.05}, {}),
    "l2sgd": (lambda h: fo.algorithms.l2sgd(loss_fn, h["lam"], h["alpha"], 0.3, num_clients=N),
              {"lam": 0.5, "alpha": 0.05}, {}),
    "l2sgd_plus": (lambda h: fo.algorithms.l2sgd_plus(loss_fn, h["lam"], h["alpha"], 0.3, num_clients=N,
                                                      num_examples=S * B), {"lam": 0.5, "alpha": 0.05}, {}),
    "admm_consensus": (lambda h: fo.algorithms.admm_consensus(loss_fn, h["rho"], num_clients=N,
                                                              client_optimizer=optax.sgd(0.05)), {"rho": 2.0}, {}),
    "admm_sharing": (lambda h: fo.algorithms.admm_sharing(h["rho"], num_samples=B), {"rho": 1.0}, {}),
    "gadmm": (lambda h: fo.algorithms.gadmm(loss_fn, h["rho"], graph=fo.graphs.chain(N),
                                            client_optimizer=optax.sgd(0.05)), {"rho": 1.0}, {}),
    "mixture_admm": (lambda h: fo.algorithms.mixture_admm(loss_fn, h["lam"], h["rho"], num_clients=N,
                                                          client_optimizer=optax.sgd(0.05)),
                     {"lam": 0.1, "rho": 1.0}, {}),
    "gossip": (lambda h: fo.algorithms.gossip(loss_fn, h["eta"], graph=_mixing()), {"eta": 0.05}, {}),
    "dpsgd": (lambda h: fo.algorithms.dpsgd(loss_fn, h["eta"], graph=_mixing()), {"eta": 0.05}, {}),
    "gradient_tracking": (lambda h: fo.algorithms.gradient_tracking(
        loss_fn, h["eta"], graph=fo.graphs.random_matchings(fo.graphs.complete(N), 6, seed=0)), {"eta": 0.05}, {}),
    "fedbuff": (lambda h: fo.algorithms.fedbuff(loss_fn, buffer_size=2, num_clients=N, client_optimizer=_sgd(h),
                                                schedule=_every_client_arrives()), {"lr": 0.05}, {}),
    "fedasync": (lambda h: fo.algorithms.fedasync(loss_fn, h["alpha"], num_clients=N, client_optimizer=optax.sgd(0.05),
                                                  staleness_weight="polynomial", schedule=_every_client_arrives()),
                 {"alpha": 0.5}, {"alpha": "logit"}),
    "co_op": (lambda h: fo.algorithms.co_op(loss_fn, h["alpha"], max_age=2, num_clients=N,
                                            client_optimizer=optax.sgd(0.05), schedule=_every_client_arrives()),
              {"alpha": 0.5}, {"alpha": "logit"}),
    "dane": (lambda h: fo.algorithms.dane(loss_fn, h["eta"], h["mu"], num_clients=N), {"eta": 1.0, "mu": 0.5}, {}),
    "feddane": (lambda h: fo.algorithms.feddane(loss_fn, h["mu"], client_optimizer=optax.sgd(0.05)), {"mu": 0.5},
                {}),
    "cocoa": (lambda h: fo.algorithms.cocoa(h["lam"], num_clients=N, num_examples=S * B), {"lam": 0.1}, {}),
    "one_shot_average": (lambda h: fo.algorithms.one_shot_average(loss_fn, local_steps=2, client_optimizer=_sgd(h)),
                         {"lr": 0.05}, {}),
}
"""Factories whose step is differentiable in the listed continuous hyper-parameters."""

REFUSED = {
    "ifca": (lambda h: fo.algorithms.ifca(loss_fn, num_clusters=2, num_clients=N, client_optimizer=_sgd(h)),
             "lowest-loss cluster"),
    "clustered_fl": (lambda h: fo.algorithms.clustered_fl(loss_fn, eps_1=10.0, eps_2=0.0, max_clusters=3,
                                                          num_clients=N, client_optimizer=_sgd(h)),
                     "CFL's split test"),
    "cq_ggadmm": (lambda h: fo.algorithms.cq_ggadmm(loss_fn, h["lr"], 0.1, 0.5, graph=fo.graphs.chain(N), bits=8,
                                                    client_optimizer=optax.sgd(0.05)), "censoring test"),
    "per_fedavg": (lambda h: fo.algorithms.per_fedavg(loss_fn, h["lr"], 0.05, local_steps=S // 2), "stop_gradient"),
    "zeno_plus_plus": (lambda h: fo.algorithms.zeno_plus_plus(
        loss_fn, h["lr"], 0.001, 0.1, validation_data={"x": jnp.ones((B, D)), "y": jnp.zeros(B)}, num_clients=N,
        schedule=_every_client_arrives()), "acceptance test"),
    "fadl": (lambda h: fo.algorithms.fadl(loss_fn, h["lr"], num_clients=N, line_search_steps=3), "line search"),
    "giant": (lambda h: fo.algorithms.giant(loss_fn, num_clients=N, cg_iters=2, line_search_steps=3, armijo=h["lr"]),
              "line search"),
}
"""Factories whose step takes a discrete decision on values that depend on the hyper-parameters (here `lr`)."""

FLOAT32_STATE = {"fedem", "d_fedem"}
"""FedEM keeps its mixture weights π in float32 whatever the model's dtype (by design): their rounding, 1e-7
relative, would dominate a central difference at ε = 1e-5, so these two are checked at ε = 1e-3 (truncation error
≈ ε² = 1e-6) to 1e-3 relative."""

NOTHING_TO_TUNE = {"p2p_bayes": "beliefs over a fixed set of hypotheses; no continuous hyper-parameter"}

DEFAULT_TIER = set()
"""The supported factories checked in the default tier: none, each is a few seconds of compilation; the default
tier's gradient checks are test_hyper.py's (FedAdam, FedProx over 20 rounds, the truncated gradient), and the
refusals below run there too."""


def test_every_factory_is_classified():
  listed = [*SUPPORTED, *REFUSED, *NOTHING_TO_TUNE]
  assert sorted(listed) == sorted(EXAMPLES), "classify each new factory in SUPPORTED, REFUSED or NOTHING_TO_TUNE"


def _float64(tree):
  return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _objective(state, validation):
  """The validation loss of the final model (each client's own where the state keeps one per client); ½‖x‖² of
  the final model where it is not one least-squares model (sharing ADMM's blocks, FedEM's components)."""
  if isinstance(state.params, dict) and "w" in state.params and jnp.shape(state.params["w"]) == (D,):
    return fo.hyper.validation_loss(loss_fn, personalized=hasattr(state, "local_params"))(state, validation)
  return 0.5 * sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(state.params))


def _eps(name):
  return 1e-3 if name in FLOAT32_STATE else EPS


def _check_program(name):
  make, start, kinds = SUPPORTED[name]
  eps = _eps(name)
  f = fo.hyper.objective_fn(make, _objective, rounds=ROUNDS, parametrization=kinds)
  hg = fo.hyper.value_and_grad(make, _objective, rounds=ROUNDS, parametrization=kinds)
  names = sorted(start)
  rows = [{k: (eps * sign if k == n else 0.0) for k in names} for n in names for sign in (1.0, -1.0)]
  shifts = jax.tree.map(lambda *xs: jnp.asarray(xs), *rows)

  @jax.jit
  def check(u, params, key, batches, validation):
    values = jax.vmap(lambda d: f(jax.tree.map(jnp.add, u, d), params, key, batches, validation)[0])(shifts)
    return hg(u, params, key, batches, validation), values

  return check, names


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT_TIER else pytest.mark.slow)
                                  for n in sorted(SUPPORTED)])
def test_hyper_gradient_matches_central_differences(name):
  _, start, kinds = SUPPORTED[name]
  with jax.enable_x64(True):
    params, batches = example_inputs(name)
    _, validation = example_inputs(name, seed=1)
    params, batches = _float64(params), batches.replace(data=_float64(batches.data))
    validation = validation.replace(data=_float64(validation.data))
    check, names = _check_program(name)
    u = fo.hyper.unconstrain(start, kinds)
    (value, grad), values = check(u, params, jax.random.key(2), batches, validation)
    values = np.asarray(values, np.float64)
    assert np.isfinite(float(value)) and np.all(np.isfinite(values))
    for i, hp in enumerate(names):
      expected = (values[2 * i] - values[2 * i + 1]) / (2 * _eps(name))
      assert abs(expected) > 1e-7, f"{name}: the check is void, ∂J/∂u[{hp}] = {expected}"
      rtol = 1e-3 if name in FLOAT32_STATE else 1e-4
      np.testing.assert_allclose(float(grad[hp]), expected, rtol=rtol, err_msg=f"{name} {hp}")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_non_differentiable_step_is_refused_in_one_line(name):
  make, decision = REFUSED[name]
  params, batches = example_inputs(name)
  hg = fo.hyper.value_and_grad(make, _objective, rounds=2)
  with pytest.raises(fo.hyper.NotDifferentiableError, match=decision) as info:
    jax.eval_shape(hg, fo.hyper.unconstrain({"lr": 0.05}), params, jax.random.key(0), batches, batches)
  assert "\n" not in str(info.value) and "fo.hyper refuses" in str(info.value)


def test_host_driven_matching_is_refused():
  """FedMA (Hungarian matching on the host) is not one compiled run."""
  params, batches = example_inputs("fedavg")
  fedma = fo.algorithms.fedma(loss_fn, layers=("w",), client_optimizer=optax.sgd(0.1), num_clients=N)
  hg = fo.hyper.value_and_grad(lambda h: fedma, _objective, rounds=2)
  with pytest.raises(TypeError, match="host-driven"):
    jax.eval_shape(hg, fo.hyper.unconstrain({"lr": 0.05}), params, jax.random.key(0), batches, batches)
