"""fo.hyper: hyper-gradients through a whole run against float64 central differences, refusals, tuning.

Every gradient is checked against central differences of the forward run in float64, in the unconstrained
coordinates u (h = exp u, or sigmoid u): (J(u + ε e_i) − J(u − ε e_i)) / 2ε, ε = 1e-5, whose error (ε² J''' and
rounding 1e-16 / ε) is far below the 1e-4 relative tolerance. Each check is one jitted program that computes the
hyper-gradient and the 2P perturbed runs together (one compilation per algorithm); the models are least squares on
three features, the runs 20 rounds or more.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from algorithm_examples import N, example_inputs, loss_fn

ROUNDS = 20
EPS = 1e-5


def _float64(tree):
  return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _inputs(seed=0):
  """Float64 initial model and round batches (all N clients, the same every round), validation = client data."""
  params, batches = example_inputs("fedavg", seed=seed)
  params, batches = _float64(params), batches.replace(data=_float64(batches.data))
  _, validation = example_inputs("fedavg", seed=seed + 1)
  return params, batches, validation.replace(data=_float64(validation.data))


def _perturbed(u, eps):
  """[2P] dicts: u ± eps along each coordinate, in sorted-name order (+ first)."""
  names = sorted(u)
  rows = []
  for name in names:
    for sign in (1.0, -1.0):
      rows.append({k: u[k] + (sign * eps if k == name else 0.0) for k in names})
  return jax.tree.map(lambda *xs: jnp.stack(xs), *rows)


def _central_differences(values, u):
  names = sorted(u)
  return {name: (values[2 * i] - values[2 * i + 1]) / (2 * EPS) for i, name in enumerate(names)}


@functools.lru_cache(maxsize=None)
def _checker(name):
  """One jitted program: (J, ∇_u J) by fo.hyper, and the forward J at u ± ε e_i, for the case `name`."""
  make, objective, kwargs, modes = CASES[name]
  f = fo.hyper.objective_fn(make, objective, rounds=ROUNDS, **kwargs)
  hypergradients = {mode: fo.hyper.value_and_grad(make, objective, rounds=ROUNDS, mode=mode, **kwargs)
                    for mode in modes}

  @jax.jit
  def check(u, params, key, data, validation):
    results = {mode: hg(u, params, key, data, validation) for mode, hg in hypergradients.items()}
    values = jax.vmap(lambda v: f(v, params, key, data, validation)[0])(_perturbed(u, EPS))
    return results, values

  return check


def _fedavgm(h):
  return fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(h["client_lr"]),
                              server_optimizer=optax.sgd(h["server_lr"], momentum=h["momentum"]))


def _fedadam(h):
  return fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(h["client_lr"]),
                              server_optimizer=fo.server_optimizers.fedadam(h["server_lr"]))


def _fedprox(h):
  return fo.algorithms.fedprox(loss_fn, h["mu"], client_optimizer=optax.sgd(0.1))


def _ditto(h):
  return fo.algorithms.ditto(loss_fn, h["lam"], h["eta"], num_clients=N, personal_steps=2,
                             client_optimizer=optax.sgd(0.05))


def _admm(h):
  return fo.algorithms.admm_consensus(loss_fn, h["rho"], num_clients=N, client_optimizer=optax.sgd(0.05))


def _l2gd(h):
  return fo.algorithms.l2gd(loss_fn, h["lam"], h["alpha"], 0.3, num_clients=N)


GLOBAL = fo.hyper.validation_loss(loss_fn)
PERSONAL = fo.hyper.validation_loss(loss_fn, personalized=True)
CASES = {
    # name: (make_algorithm, objective, objective_fn keywords, modes)
    "fedavgm": (_fedavgm, GLOBAL, {"parametrization": {"momentum": "logit"}}, ("reverse",)),
    "fedadam": (_fedadam, GLOBAL, {"checkpoint": "cbrt", "checkpoint_local_steps": True}, ("reverse",)),
    "fedprox": (_fedprox, GLOBAL, {}, ("reverse", "forward")),
    "ditto": (_ditto, PERSONAL, {"checkpoint": "sqrt"}, ("reverse",)),
    "admm_consensus": (_admm, GLOBAL, {"checkpoint": None}, ("reverse",)),
    "l2gd": (_l2gd, PERSONAL, {"checkpoint": 3}, ("reverse",)),
}
START = {
    "fedavgm": {"client_lr": 0.05, "server_lr": 0.5, "momentum": 0.5},
    "fedadam": {"client_lr": 0.05, "server_lr": 0.01},
    "fedprox": {"mu": 0.3},
    "ditto": {"lam": 0.5, "eta": 0.05},
    "admm_consensus": {"rho": 2.0},
    "l2gd": {"lam": 0.5, "alpha": 0.05},
}


DEFAULT_TIER = {"fedadam", "fedprox"}
"""The cases of the default tier; the others (a few seconds of compilation each) run in the slow tier."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT_TIER else pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_hyper_gradient_matches_float64_central_differences(name):
  """The issue's list: FedAvg(M) (client lr, server lr, logit momentum), FedAdam (client and server lr),
  FedProx (μ, reverse and forward mode), Ditto (λ, η), consensus ADMM (ρ), L2GD (λ, α); 20 rounds, 1e-4. The
  checkpoint settings are spread over the cases (FedAdam: nested blocks and every local step checkpointed)."""
  with jax.enable_x64(True):
    params, batches, validation = _inputs()
    u = fo.hyper.unconstrain(START[name], CASES[name][2].get("parametrization"))
    results, values = _checker(name)(u, params, jax.random.key(3), batches, validation)
    reference = _central_differences(np.asarray(values, np.float64), u)
    for mode, (value, grad) in results.items():
      assert np.isfinite(float(value))
      for hp in u:
        expected = float(reference[hp])
        assert abs(expected) > 1e-6, f"{name}: the check is void, ∂J/∂u[{hp}] = {expected}"
        np.testing.assert_allclose(float(grad[hp]), expected, rtol=1e-4, err_msg=f"{name} {mode} {hp}")


def _sampled_dataset():
  rng = np.random.default_rng(7)
  clients = []
  for k in range(6):
    n = 4 + k
    x = rng.normal(size=(n, 3))
    clients.append({"x": x, "y": x @ np.array([1.0, -2.0, 0.5]) + 0.3 * k + 0.1 * rng.normal(size=n)})
  return fo.data.pack(clients, test_fraction=0.25)


SAMPLING = fo.Sampling(clients_per_round=3, batch_size=2, local_steps=2)
TRUNCATE = 5


def _fedavg_sgd(h):
  return fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(h["client_lr"]),
                              server_optimizer=optax.sgd(h["server_lr"]))


@functools.lru_cache(maxsize=None)
def _truncated_checker():
  """fo.hyper's truncated hyper-gradient on rounds drawn in the program, and a reference written out here: the
  first R − K rounds at h, the last K at φ(u ± ε e_i), round r drawn by sample_round from fold_in(data key, r)."""
  hg = fo.hyper.value_and_grad(_fedavg_sgd, GLOBAL, rounds=ROUNDS, sampling=SAMPLING, truncate=TRUNCATE)

  def reference(u_start, u_end, params, key, dataset, validation):
    init_key, data_key = jax.random.split(key)

    def rounds(algorithm, state, n):
      def body(s, _):
        return algorithm.step(s, fo.data.sample_round(jax.random.fold_in(data_key, s.round), dataset,
                                                      **SAMPLING.kwargs())), None
      return jax.lax.scan(body, state, None, length=n)[0]

    first = _fedavg_sgd(fo.hyper.constrain(u_start))
    state = rounds(first, first.init(params, init_key), ROUNDS - TRUNCATE)
    state = rounds(_fedavg_sgd(fo.hyper.constrain(u_end)), state, TRUNCATE)
    return GLOBAL(state, validation)

  @jax.jit
  def check(u, params, key, dataset, validation):
    values = jax.vmap(lambda v: reference(u, v, params, key, dataset, validation))(_perturbed(u, EPS))
    return hg(u, params, key, dataset, validation), values

  return check


def test_truncated_hyper_gradient_on_sampled_rounds_matches_central_differences_of_the_last_k_rounds():
  with jax.enable_x64(True):
    dataset = _sampled_dataset()
    params, _, _ = _inputs()
    validation = fo.data.client_batches(dataset, 2, split="test")
    validation = validation.replace(data=_float64(validation.data))
    u = fo.hyper.unconstrain({"client_lr": 0.05, "server_lr": 0.8})
    (value, grad), values = _truncated_checker()(u, params, jax.random.key(1), dataset, validation)
    reference = _central_differences(np.asarray(values, np.float64), u)
    assert np.isfinite(float(value))
    for hp in u:
      assert abs(float(reference[hp])) > 1e-6
      np.testing.assert_allclose(float(grad[hp]), float(reference[hp]), rtol=1e-4, err_msg=hp)


def test_a_step_with_a_discrete_decision_is_refused_in_one_line_before_it_runs():
  """L2GD's p draws the coin (a comparison with p): differentiating p is refused, the same factory's λ is not."""
  params, batches = example_inputs("l2gd")
  make = lambda h: fo.algorithms.l2gd(loss_fn, 0.5, 0.05, h["p"], num_clients=N)  # noqa: E731
  hg = fo.hyper.value_and_grad(make, PERSONAL, rounds=3, parametrization={"p": "logit"})
  with pytest.raises(fo.hyper.NotDifferentiableError, match=r"Bernoulli\(p\).*fo.hyper refuses") as info:
    jax.eval_shape(hg, fo.hyper.unconstrain({"p": 0.3}, {"p": "logit"}), params, jax.random.key(0), batches,
                   batches)
  assert "\n" not in str(info.value)
  with pytest.raises(fo.hyper.NotDifferentiableError, match="lowest-loss cluster"):
    jax.eval_shape(
        fo.hyper.value_and_grad(
            lambda h: fo.algorithms.ifca(loss_fn, num_clusters=2, num_clients=N, client_optimizer=optax.sgd(h["lr"])),
            GLOBAL, rounds=2, mode="forward"),
        {"lr": jnp.log(0.1)}, params, jax.random.key(0), batches, batches)


def test_parametrization_round_trips_and_refuses_values_outside_its_domain():
  h = {"lr": 0.03, "p": 0.25, "shift": -1.5}
  kinds = {"p": "logit", "shift": "identity"}
  u = fo.hyper.unconstrain(h, kinds)
  np.testing.assert_allclose([float(u["lr"]), float(u["p"]), float(u["shift"])],
                             [np.log(0.03), np.log(0.25 / 0.75), -1.5], rtol=1e-6)
  back = fo.hyper.constrain(u, kinds)
  np.testing.assert_allclose([float(back[k]) for k in h], list(h.values()), rtol=1e-6)
  with pytest.raises(ValueError, match="must be > 0"):
    fo.hyper.unconstrain({"lr": 0.0})
  with pytest.raises(ValueError, match=r"must lie in \(0, 1\)"):
    fo.hyper.unconstrain({"p": 1.0}, {"p": "logit"})
  with pytest.raises(ValueError, match="one of"):
    fo.hyper.constrain({"p": 0.0}, {"p": "probit"})
  with pytest.raises(ValueError, match="not among the hyper-parameters"):
    fo.hyper.constrain({"p": 0.0}, {"q": "log"})


def test_bad_arguments_are_refused_with_a_clear_error():
  params, batches = example_inputs("fedavg")
  with pytest.raises(TypeError, match="make_algorithm must be a callable"):
    fo.hyper.value_and_grad(None, GLOBAL, rounds=2)
  with pytest.raises(ValueError, match="truncate=5 exceeds rounds=2"):
    fo.hyper.value_and_grad(_fedavg_sgd, GLOBAL, rounds=2, truncate=5)
  with pytest.raises(ValueError, match="mode must be one of"):
    fo.hyper.value_and_grad(_fedavg_sgd, GLOBAL, rounds=2, mode="backward")
  with pytest.raises(TypeError, match="checkpoint"):
    fo.hyper.value_and_grad(_fedavg_sgd, GLOBAL, rounds=2, checkpoint=1.5)
  with pytest.raises(TypeError, match="checkpoint_local_steps must be a bool"):
    fo.hyper.value_and_grad(_fedavg_sgd, GLOBAL, rounds=2, checkpoint_local_steps="yes")
  u = fo.hyper.unconstrain({"client_lr": 0.1, "server_lr": 1.0})
  hg = fo.hyper.value_and_grad(_fedavg_sgd, GLOBAL, rounds=2)
  with pytest.raises(TypeError, match="needs sampling"):
    jax.eval_shape(hg, u, params, jax.random.key(0), _sampled_dataset(), batches)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), batches)  # [2, C, S, B]: two rounds' batches
  with pytest.raises(ValueError, match="holds the batches of 2 rounds"):
    jax.eval_shape(fo.hyper.value_and_grad(_fedavg_sgd, GLOBAL, rounds=3), u, params, jax.random.key(0), stacked,
                   batches)
  with pytest.raises(ValueError, match=r"key must be one key, or the init key and the data key stacked \[2\]"):
    jax.eval_shape(hg, u, params, jax.random.split(jax.random.key(0), 3), batches, batches)
  with pytest.raises(TypeError, match="must return a fedjax_opt.FederatedAlgorithm"):
    jax.eval_shape(fo.hyper.value_and_grad(lambda h: None, GLOBAL, rounds=2), u, params, jax.random.key(0),
                   batches, batches)
  with pytest.raises(ValueError, match="must all be scalars or all"):
    fo.hyper.tune(_fedavg_sgd, GLOBAL, {"client_lr": [0.1, 0.2], "server_lr": 1.0}, params, jax.random.key(0),
                  batches, batches, rounds=2, outer_steps=1)
  with pytest.raises(ValueError, match="schedule must be one of"):
    fo.hyper.tune(_fedavg_sgd, GLOBAL, {"client_lr": 0.1, "server_lr": 1.0}, params, jax.random.key(0), batches,
                  batches, rounds=2, outer_steps=1, schedule="nightly")


def _one_line_error(call, kind):
  """The message of the `kind` error that `call()` raises, checked to be one line."""
  with pytest.raises(kind) as info:
    call()
  message = str(info.value)
  assert "\n" not in message and "Traced<" not in message, message
  return message


def test_a_misspelled_hyper_parameter_is_one_line_naming_it_and_the_given_names():
  params, batches = example_inputs("fedavg")
  u = fo.hyper.unconstrain({"client_lr": 0.1, "server_lr": 1.0})

  def misspelled(h):
    return fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(h["client_lrr"]),
                                server_optimizer=optax.sgd(h["server_lr"]))

  hg = fo.hyper.value_and_grad(misspelled, GLOBAL, rounds=2)
  message = _one_line_error(lambda: jax.eval_shape(hg, u, params, jax.random.key(0), batches, batches), KeyError)
  assert message == ("fo.hyper: the build function asked for hyper-parameter 'client_lrr', which is not among the "
                     "given hyper-parameters ['client_lr', 'server_lr'] (did you mean 'client_lr'?).")
  # tune reports it the same way (its program is traced on the call); a KeyError still, for code that catches one
  with pytest.raises(fo.hyper.UnknownHyperParameterError, match="hyper-parameter 'client_lrr'") as info:
    fo.hyper.tune(misspelled, GLOBAL, {"client_lr": 0.1, "server_lr": 1.0}, params, jax.random.key(0), batches,
                  batches, rounds=2, outer_steps=1)
  assert isinstance(info.value, KeyError) and info.value.name == "client_lrr"
  # a name far from every given one gets no suggestion; h.get and `in` behave as for a dict
  far = fo.hyper.value_and_grad(lambda h: _fedavg_sgd({**h, "client_lr": h["zeta"]}), GLOBAL, rounds=2)
  message = _one_line_error(lambda: jax.eval_shape(far, u, params, jax.random.key(0), batches, batches), KeyError)
  assert message.endswith("which is not among the given hyper-parameters ['client_lr', 'server_lr'].")
  seen = {}

  def lenient(h):
    seen.update(missing=h.get("momentum", 0.0), has=("momentum" in h, "client_lr" in h), tree=jax.tree.structure(h))
    return _fedavg_sgd(h)

  jax.eval_shape(fo.hyper.value_and_grad(lenient, GLOBAL, rounds=2), u, params, jax.random.key(0), batches, batches)
  assert seen["missing"] == 0.0 and seen["has"] == (False, True) and seen["tree"].num_leaves == 2


def test_a_hyper_parameter_used_as_an_integer_is_one_line_naming_it():
  params, batches = example_inputs("fedavg")
  u = fo.hyper.unconstrain({"lam": 0.5, "steps": 2.0})

  def ditto(h, steps):
    return fo.algorithms.ditto(loss_fn, h["lam"], 0.05, num_clients=N, personal_steps=steps,
                               client_optimizer=optax.sgd(0.05))

  for make, want in (
      (lambda h: ditto(h, h["steps"]),
       "fo.hyper: hyper-parameter 'steps' is used where an integer (a Python int) is needed (personal_steps must be "
       "one); it cannot be differentiated or swept as a traced value: give it to the build function as a constant."),
      (lambda h: ditto(h, 2 * h["steps"]),
       "fo.hyper: personal_steps is given a value computed from the traced hyper-parameters ['lam', 'steps'], where "
       "an integer (a Python int) is needed; an integer cannot be differentiated or swept as a traced value: give "
       "it to the build function as a constant.")):
    for mode in ("reverse", "forward"):
      hg = fo.hyper.value_and_grad(make, PERSONAL, rounds=2, mode=mode)
      assert _one_line_error(lambda: jax.eval_shape(hg, u, params, jax.random.key(0), batches, batches),
                             TypeError) == want
  # outside fo.hyper, a traced integer argument is still one line, naming the argument
  message = _one_line_error(lambda: jax.jit(lambda s: ditto({"lam": 0.5}, s))(2), TypeError)
  assert re.fullmatch(r"personal_steps must be a Python int >= 1 \(it fixes a shape or a loop length\); got a traced "
                      r"int(32|64)\[\] value, which cannot be one\.", message), message


# ---- tune: closed-form optima ----------------------------------------------------------------------------------

C_TRAIN, C_VAL, X0, TUNE_ROUNDS = 1.0, 0.5, 0.0, 5


def _scalar_loss(params, batch):
  return 0.5 * jnp.square(params["w"] - batch["y"])


def _scalar_fedavg(h):
  return fo.algorithms.fedavg(_scalar_loss, client_optimizer=optax.sgd(h["lr"]))


def _scalar_batches(c):
  """Two clients, one step of one example y = c each: a round is x ← x − η (x − c)."""
  return fo.ClientBatches(data={"y": jnp.full((2, 1, 1), c, jnp.float64)}, mask=jnp.ones((2, 1, 1), bool),
                          weight=jnp.ones((2,)), client_id=jnp.arange(2, dtype=jnp.int32))


SCALAR_OBJECTIVE = fo.hyper.validation_loss(_scalar_loss)


def test_offline_tuning_finds_the_closed_form_best_step_size_from_both_sides():
  """x_R = c + (1 − η)^R (x_0 − c), so the validation loss ½(x_R − c_val)² is 0 at (1 − η*)^R = (c_val − c)/(x_0 − c):
  η* = 1 − 0.5^(1/5) ≈ 0.1294. Two starts, 10× too small and ≈ 4× too large, tuned side by side (one program)."""
  best = 1 - ((C_VAL - C_TRAIN) / (X0 - C_TRAIN)) ** (1 / TUNE_ROUNDS)
  with jax.enable_x64(True):
    steps = 80
    result = fo.hyper.tune(_scalar_fedavg, SCALAR_OBJECTIVE, {"lr": [best / 10, 0.5]}, {"w": jnp.float64(X0)},
                           jax.random.key(0), _scalar_batches(C_TRAIN), _scalar_batches(C_VAL), rounds=TUNE_ROUNDS,
                           outer_steps=steps, optimizer=optax.sgd(4.0))
    np.testing.assert_allclose(np.asarray(result.hyper_params["lr"]), [best, best], rtol=1e-3)
    assert result.trajectory["lr"].shape == (2, steps + 1) and result.values.shape == (2, steps)
    np.testing.assert_allclose(np.asarray(result.trajectory["lr"][:, 0]), [best / 10, 0.5], rtol=1e-12)
    # The values are the closed form's at the trajectory's step sizes.
    lr = np.asarray(result.trajectory["lr"][:, :-1], np.float64)
    expected = 0.5 * (C_TRAIN + (1 - lr) ** TUNE_ROUNDS * (X0 - C_TRAIN) - C_VAL) ** 2
    np.testing.assert_allclose(np.asarray(result.values), expected, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(float(result.state.params["w"][0]), C_VAL, atol=1e-4)


def test_online_tuning_climbs_to_the_one_round_optimum_and_continues_one_run():
  """Online with windows of one round and validation = training data: the window's J(η) = ½ (1 − η)² (x_t − c)²
  is smallest at η = 1 whatever x_t (hypergradient descent's setting). From η = 0.1 the step size climbs past 0.9 and
  the run, carried across windows, reaches c far sooner than at the starting step size."""
  windows = 40
  reported = []
  with jax.enable_x64(True):
    result = fo.hyper.tune(_scalar_fedavg, SCALAR_OBJECTIVE, {"lr": 0.1}, {"w": jnp.float64(X0)}, jax.random.key(0),
                           _scalar_batches(C_TRAIN), _scalar_batches(C_TRAIN), rounds=1, outer_steps=windows,
                           schedule="online", optimizer=optax.adam(0.2),
                           callback=lambda *args: reported.append(args))
    lr = np.asarray(result.trajectory["lr"][0], np.float64)
    # The callback saw every window, in order, with the values the result holds.
    assert [(m, t) for m, t, *_ in reported] == [(0, t) for t in range(windows)]
    np.testing.assert_allclose([h["lr"] for _, _, h, _, _ in reported], lr[:-1], rtol=1e-12)
    np.testing.assert_allclose([v for *_, v, _ in reported], np.asarray(result.values[0]), rtol=1e-12)
    np.testing.assert_allclose([g["lr"] for *_, g in reported], np.asarray(result.gradients["lr"][0]), rtol=1e-12)
    assert np.all(np.diff(lr[:10]) > 0) and lr.max() > 0.9
    assert int(result.state.round[0]) == windows
    # Replay of the run in NumPy: x ← x − η_t (x − c) with the trajectory's η_t, and the values at each window's end.
    x, values = X0, []
    for t in range(windows):
      x = x - lr[t] * (x - C_TRAIN)
      values.append(0.5 * (x - C_TRAIN) ** 2)
    np.testing.assert_allclose(np.asarray(result.values[0]), values, rtol=1e-9, atol=1e-30)
    np.testing.assert_allclose(float(result.state.params["w"][0]), x, rtol=1e-12)
    assert abs(x - C_TRAIN) < 1e-3 * (1 - 0.1) ** windows


def _closed_form_offline_trajectory(kind, lr0, outer_lr, steps):
  """SGD on u for J(η) = ½ (x_R(η) − c_val)², x_R = c + (1 − η)^R (x_0 − c), in float64 NumPy: the T + 1 iterates u."""
  to_u = {"log": np.log, "logit": lambda h: np.log(h / (1 - h))}[kind]
  to_h = {"log": np.exp, "logit": lambda u: 1 / (1 + np.exp(-u))}[kind]
  u, us = to_u(lr0), []
  for _ in range(steps + 1):
    us.append(u)
    eta = to_h(u)
    x = C_TRAIN + (1 - eta) ** TUNE_ROUNDS * (X0 - C_TRAIN)
    dj_deta = (x - C_VAL) * (-TUNE_ROUNDS * (1 - eta) ** (TUNE_ROUNDS - 1) * (X0 - C_TRAIN))
    u = u - outer_lr * dj_deta * (eta if kind == "log" else eta * (1 - eta))
  return np.asarray(us), to_h


@pytest.mark.parametrize("kind", ["log", "logit"])
def test_average_is_the_mean_of_the_last_iterates_in_the_unconstrained_coordinates(kind):
  """average=n: φ of the mean of the last n of the T + 1 iterates u. Against SGD on the closed form replayed in NumPy:
  for "log" the geometric mean of the step sizes, for "logit" the sigmoid of the mean logit (neither is their
  arithmetic mean, which is checked to differ); offline, the state is the closed-form run at the averaged η."""
  steps, n, outer_lr = 6, 4, 4.0
  us, to_h = _closed_form_offline_trajectory(kind, 0.02, outer_lr, steps)
  expected = to_h(us[-n:].mean())
  assert abs(expected - to_h(us[-n:]).mean()) > 1e-3 * expected  # the averages differ on this trajectory
  with jax.enable_x64(True):
    runs = {a: fo.hyper.tune(_scalar_fedavg, SCALAR_OBJECTIVE, {"lr": 0.02}, {"w": jnp.float64(X0)},
                             jax.random.key(0), _scalar_batches(C_TRAIN), _scalar_batches(C_VAL), rounds=TUNE_ROUNDS,
                             outer_steps=steps, optimizer=optax.sgd(outer_lr), parametrization={"lr": kind},
                             average=a)
            for a in (None, 1, n)}
  np.testing.assert_allclose(np.asarray(runs[n].trajectory["lr"][0]), to_h(us), rtol=1e-9)
  np.testing.assert_allclose(float(runs[n].hyper_params["lr"][0]), expected, rtol=1e-9)
  x_at = C_TRAIN + (1 - expected) ** TUNE_ROUNDS * (X0 - C_TRAIN)
  np.testing.assert_allclose(float(runs[n].state.params["w"][0]), x_at, rtol=1e-9)
  # n = 1 and None are the last iterate.
  for a in (None, 1):
    np.testing.assert_allclose(float(runs[a].hyper_params["lr"][0]), to_h(us[-1]), rtol=1e-9)


def test_online_average_of_every_iterate_keeps_the_run_and_refuses_bad_counts():
  """Online, average=T+1: the geometric mean of the whole trajectory (start included); the state is the run's own
  (the same with and without averaging). average outside [1, T + 1] or not an int: one-line errors."""
  windows = 8
  with jax.enable_x64(True):
    args = (_scalar_fedavg, SCALAR_OBJECTIVE, {"lr": 0.1}, {"w": jnp.float64(X0)}, jax.random.key(0),
            _scalar_batches(C_TRAIN), _scalar_batches(C_TRAIN))
    kwargs = dict(rounds=1, outer_steps=windows, schedule="online", optimizer=optax.adam(0.2))
    plain = fo.hyper.tune(*args, **kwargs)
    averaged = fo.hyper.tune(*args, average=windows + 1, **kwargs)
  lr = np.asarray(plain.trajectory["lr"][0], np.float64)
  np.testing.assert_allclose(float(averaged.hyper_params["lr"][0]), np.exp(np.log(lr).mean()), rtol=1e-9)
  np.testing.assert_allclose(float(averaged.state.params["w"][0]), float(plain.state.params["w"][0]), rtol=1e-12)
  with pytest.raises(ValueError, match=r"average=10 exceeds the outer_steps \+ 1 = 9 iterates"):
    fo.hyper.tune(*args, average=windows + 2, **kwargs)
  with pytest.raises(ValueError, match="average .* must be a Python int >= 1"):
    fo.hyper.tune(*args, average=0, **kwargs)
  with pytest.raises(TypeError, match="average .* must be a Python int >= 1"):
    fo.hyper.tune(*args, average=2.0, **kwargs)


def _scalar_run_end(eta):
  """x_R after R rounds of x ← x − η (x − c) from x_0 (the closed form of the scalar problem)."""
  return C_TRAIN + (1 - eta) ** TUNE_ROUNDS * (X0 - C_TRAIN)


@pytest.mark.parametrize("average, nan_first", [(None, False), (4, False), (None, True)])
def test_select_returns_the_trained_run_of_least_score(average, nan_first):
  """select=score, offline: of h_0, …, h_{T−1} and the tuned (last or averaged) value, the one whose run has the
  least score, with that run's state. Against the closed form replayed in float64 NumPy, with a score that is not
  the objective (|x_R − 0.2|): the least is an inner iterate (t = 4 of 6) without averaging and the averaged value
  with average=4; a NaN score counts as +∞ in the choice (here the first run's, which a plain comparison would
  keep) and is reported as NaN."""
  steps, outer_lr, target = 6, 4.0, 0.2
  us, to_h = _closed_form_offline_trajectory("log", 0.02, outer_lr, steps)
  final = to_h(us[-average:].mean()) if average else to_h(us[-1])
  etas = np.append(to_h(us[:-1]), final)
  expected_scores = np.abs(_scalar_run_end(etas) - target)
  if nan_first:
    expected_scores[0] = np.nan
  index = int(np.argmin(np.where(np.isnan(expected_scores), np.inf, expected_scores)))
  assert index == (steps if average else 4)

  def score(state, validation):
    del validation
    x = state.params["w"]
    value = jnp.abs(x - target)
    return jnp.where(x < 0.1, jnp.nan, value) if nan_first else value

  with jax.enable_x64(True):
    result = fo.hyper.tune(_scalar_fedavg, SCALAR_OBJECTIVE, {"lr": [0.02, 0.02]}, {"w": jnp.float64(X0)},
                           jax.random.key(0), _scalar_batches(C_TRAIN), _scalar_batches(C_VAL), rounds=TUNE_ROUNDS,
                           outer_steps=steps, optimizer=optax.sgd(outer_lr), average=average, select=score)
  assert result.scores.shape == (2, steps + 1) and result.selected.shape == (2,)
  for m in range(2):  # both settings of the one program select alike
    np.testing.assert_allclose(np.asarray(result.scores[m]), expected_scores, rtol=1e-9)
    assert int(result.selected[m]) == index
    np.testing.assert_allclose(float(result.hyper_params["lr"][m]), etas[index], rtol=1e-9)
    np.testing.assert_allclose(float(result.state.params["w"][m]), _scalar_run_end(etas[index]), rtol=1e-9)
    np.testing.assert_allclose(np.asarray(result.trajectory["lr"][m]), to_h(us), rtol=1e-9)


def test_select_keeps_the_first_of_equal_scores_and_refuses_bad_uses():
  """Equal scores: the first run (h_0). Online, a non-callable or a non-scalar score: one-line errors."""
  with jax.enable_x64(True):
    args = (_scalar_fedavg, SCALAR_OBJECTIVE, {"lr": 0.1}, {"w": jnp.float64(X0)}, jax.random.key(0),
            _scalar_batches(C_TRAIN), _scalar_batches(C_VAL))
    tie = fo.hyper.tune(*args, rounds=2, outer_steps=3, optimizer=optax.sgd(4.0),
                        select=lambda state, validation: 0.0 * state.params["w"])
    assert int(tie.selected[0]) == 0 and np.all(np.asarray(tie.scores) == 0)
    assert float(tie.hyper_params["lr"][0]) == pytest.approx(0.1, rel=1e-12)
    assert float(tie.trajectory["lr"][0, -1]) != pytest.approx(0.1, rel=1e-3)  # the later runs differ
    score = lambda state, validation: state.params["w"]  # noqa: E731
    with pytest.raises(ValueError, match="select chooses among the offline schedule's runs"):
      fo.hyper.tune(*args, rounds=1, outer_steps=2, schedule="online", select=score)
    with pytest.raises(TypeError, match="select must be None or a callable"):
      fo.hyper.tune(*args, rounds=1, outer_steps=2, select="accuracy")
    with pytest.raises(ValueError, match=r"select must return a scalar; got shape \(2,\)"):
      fo.hyper.tune(*args, rounds=1, outer_steps=2, select=lambda s, v: jnp.stack([s.params["w"]] * 2))
    plain = fo.hyper.tune(*args, rounds=1, outer_steps=2)
  assert plain.scores is None and plain.selected is None
