"""FedSGD / FedAvg / FedOpt against float64 NumPy references, padding, purity and the non-finite guard."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import fedjax_opt as fo
from conftest import lsq_grad_np, lsq_loss, make_clients, pack, softmax_grad_np, softmax_loss

D, K = 5, 3  # features, classes


def _softmax_params(rng):
  return {"w": jnp.asarray(0.1 * rng.normal(size=(D, K))), "b": jnp.asarray(0.1 * rng.normal(size=K))}


def _np(params):
  return {k: np.asarray(v, np.float64) for k, v in params.items()}


def test_fedavg_one_full_batch_step_equals_centralized_gradient_descent(rng):
  """Equal client sizes, one full-batch local step, server sgd(1.0): one GD step on the pooled data."""
  clients = make_clients(rng, [8, 8, 8, 8], D, kind="softmax", num_classes=K)
  lr = 0.3
  with jax.enable_x64(True):
    params = _softmax_params(rng)
    batches = pack(clients, steps=1, batch=8, dtype=np.float64)
    algo = fo.algorithms.fedavg(softmax_loss, client_optimizer=optax.sgd(lr), server_optimizer=optax.sgd(1.0))
    state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
    x = np.concatenate([c[0] for c in clients])
    y = np.concatenate([c[1] for c in clients])
    p = _np(params)
    gw, gb = softmax_grad_np(p["w"], p["b"], x, y)
    np.testing.assert_allclose(state.params["w"], p["w"] - lr * gw, rtol=1e-10)
    np.testing.assert_allclose(state.params["b"], p["b"] - lr * gb, rtol=1e-10)


def test_fedsgd_equals_centralized_gradient_descent_on_pooled_data(rng):
  """FedSGD with unequal sizes and several steps' worth of data: x − η ∇F(pooled), F the pooled mean."""
  clients = make_clients(rng, [3, 11, 7], D, kind="softmax", num_classes=K)
  lr = 0.5
  with jax.enable_x64(True):
    params = _softmax_params(rng)
    batches = pack(clients, steps=3, batch=4, dtype=np.float64)
    algo = fo.algorithms.fedsgd(softmax_loss, server_optimizer=optax.sgd(lr))
    state = algo.init(params, jax.random.key(0))
    step = jax.jit(algo.step)  # one program for both rounds (eager rounds compile every op: see test_step_is_pure)
    for _ in range(2):
      p = _np(state.params)
      state = step(state, batches)
      gw, gb = softmax_grad_np(p["w"], p["b"], np.concatenate([c[0] for c in clients]),
                               np.concatenate([c[1] for c in clients]))
      np.testing.assert_allclose(state.params["w"], p["w"] - lr * gw, rtol=1e-10)
      np.testing.assert_allclose(state.params["b"], p["b"] - lr * gb, rtol=1e-10)


def _numpy_fedavg_round(w, b, clients, lr, steps, batch, weights):
  """float64 reference: each client runs local SGD over its examples in order, then a weighted average."""
  deltas = []
  for x, y in clients:
    wk, bk = w.copy(), b
    for s in range(steps):
      xs, ys = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
      if len(ys):
        gw, gb = lsq_grad_np(wk, bk, xs, ys)
        wk, bk = wk - lr * gw, bk - lr * gb
    deltas.append((wk - w, bk - b))
  a = np.asarray(weights, np.float64) / np.sum(weights)
  return w + sum(ai * dw for ai, (dw, _) in zip(a, deltas)), b + sum(ai * db for ai, (_, db) in zip(a, deltas))


def test_fedavg_unequal_sizes_matches_numpy_weighted_average(rng):
  """Several local steps, unequal n_k: Σ n_k Δ_k / Σ n_k, against a NumPy transcription."""
  sizes = [2, 9, 5, 12]
  clients = make_clients(rng, sizes, D)
  lr, steps, batch = 0.05, 3, 4
  w, b = rng.normal(size=D), 0.3
  ref_w, ref_b = _numpy_fedavg_round(w, b, clients, lr, steps, batch, sizes)
  with jax.enable_x64(True):
    algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(lr))
    state = algo.init({"w": jnp.asarray(w), "b": jnp.asarray(b)}, jax.random.key(0))
    state = jax.jit(algo.step)(state, pack(clients, steps, batch, dtype=np.float64))
    np.testing.assert_allclose(state.params["w"], ref_w, rtol=1e-10)
    np.testing.assert_allclose(state.params["b"], ref_b, rtol=1e-10)
    assert int(state.metrics["num_clients"]) == 4
    assert float(state.metrics["num_examples"]) == sum(sizes)


def test_uniform_mean_aggregator_matches_numpy(rng):
  """aggregators.mean(): (1/|S|) Σ Δ_k whatever the sizes (Reddi et al.'s Algorithm 2)."""
  sizes = [2, 9, 5]
  clients = make_clients(rng, sizes, D)
  w, b = rng.normal(size=D), 0.0
  ref_w, _ = _numpy_fedavg_round(w, b, clients, 0.1, 3, 4, [1, 1, 1])
  with jax.enable_x64(True):
    algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), aggregator=fo.aggregators.mean())
    state = jax.jit(algo.step)(algo.init({"w": jnp.asarray(w), "b": jnp.asarray(b)}, jax.random.key(0)),
                               pack(clients, 3, 4, dtype=np.float64, extra_clients=2))
    np.testing.assert_allclose(state.params["w"], ref_w, rtol=1e-10)


@functools.cache
def _padding_setup():
  """The clients, parameters, jitted FedAdam step and unpadded round shared by every example of the padding
  property: the unpadded round compiles once, each padded shape once."""
  rng = np.random.default_rng(1)
  clients = make_clients(rng, [3, 7, 5], D)
  params = {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.05, momentum=0.9),
                              server_optimizer=fo.server_optimizers.fedadam(0.1))
  step = jax.jit(algo.step)
  base = step(algo.init(params, jax.random.key(0)), pack(clients, 2, 4))
  return clients, params, algo, step, base


@settings(max_examples=6, deadline=None)
@given(extra_steps=st.integers(0, 3), extra_slots=st.integers(0, 3), extra_clients=st.integers(0, 3))
def test_padding_changes_nothing(extra_steps, extra_slots, extra_clients):
  """The same clients packed with more padding (steps, slots, zero-weight clients) give the same round."""
  clients, params, algo, step, base = _padding_setup()
  padded = step(algo.init(params, jax.random.key(0)),
                pack(clients, 2, 4, extra_steps=extra_steps, extra_slots=extra_slots, extra_clients=extra_clients))
  for k in params:
    np.testing.assert_allclose(padded.params[k], base.params[k], rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(padded.metrics["client_loss"], base.metrics["client_loss"], rtol=1e-6)
  assert int(padded.metrics["num_clients"]) == 3


@functools.cache
def _fedyogi_algo(client_map=None):
  """One FedAvg + FedYogi algorithm per client map, so the tests below share its compiled steps."""
  return fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.05),
                              server_optimizer=fo.server_optimizers.fedyogi(0.05), client_map=client_map)


def _setup(rng, client_map=None):
  """Five clients of sizes 4–7 packed [5, 2, 4] (the same shapes whatever rng), random params, `_fedyogi_algo`."""
  clients = make_clients(rng, [4, 6, 5, 3, 7], D)
  batches = pack(clients, 2, 4)
  params = {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  return _fedyogi_algo(client_map), params, batches


def test_step_is_pure_jitted_or_not(rng):
  algo, params, batches = _setup(rng)
  s0 = algo.init(params, jax.random.key(3))
  a, b, c = algo.step(s0, batches), algo.step(s0, batches), jax.jit(algo.step)(s0, batches)
  for k in params:
    np.testing.assert_array_equal(a.params[k], b.params[k])
    np.testing.assert_allclose(c.params[k], a.params[k], rtol=1e-6)
  np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(c.key))
  assert int(a.round) == 1


def test_scan_over_rounds_equals_repeated_calls(rng):
  algo, params, batches = _setup(rng)
  rounds = 6
  stacked = jax.tree.map(lambda a: jnp.stack([a] * rounds), batches)
  s0 = algo.init(params, jax.random.key(0))
  scanned, _ = jax.jit(lambda s, bs: jax.lax.scan(lambda c, b: (algo.step(c, b), None), s, bs))(s0, stacked)
  step = jax.jit(algo.step)
  looped = s0
  for _ in range(rounds):
    looped = step(looped, batches)
  for k in params:
    np.testing.assert_allclose(scanned.params[k], looped.params[k], rtol=1e-6)
  assert int(scanned.round) == rounds


def test_vmap_over_seeds_and_initial_models_equals_separate_runs(rng):
  """jax.vmap(step) over a batch of states (different keys and initial models): one program, same numbers."""
  algo, params, batches = _setup(rng)
  seeds = 4
  inits = [jax.tree.map(lambda p, i=i: p + 0.1 * i, params) for i in range(seeds)]
  states = [algo.init(p, jax.random.key(i)) for i, p in enumerate(inits)]
  batched = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  out = jax.jit(jax.vmap(algo.step, in_axes=(0, None)))(batched, batches)
  step = jax.jit(algo.step)
  for i, s in enumerate(states):
    ref = step(s, batches)
    for k in params:
      np.testing.assert_allclose(out.params[k][i], ref.params[k], rtol=1e-5, atol=1e-7)


def test_vmap_over_client_learning_rates(rng):
  """A hyper-parameter sweep: the factory called inside vmap with a traced client lr."""
  clients = make_clients(rng, [4, 6], D)
  batches = pack(clients, 2, 4)
  params = {"w": jnp.zeros(D), "b": jnp.zeros(())}
  lrs = jnp.array([0.01, 0.05, 0.1])

  def run(lr):
    algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(lr))
    return algo.step(algo.init(params, jax.random.key(0)), batches).params

  out = jax.jit(jax.vmap(run))(lrs)
  separate = jax.jit(run)  # one run at a time, the lr still traced: one program for the three references
  for i, lr in enumerate([0.01, 0.05, 0.1]):
    ref = separate(jnp.float32(lr))
    np.testing.assert_allclose(out["w"][i], ref["w"], rtol=1e-5)


@functools.cache
def _client_map_reference():
  """The vmap round of `_setup(default_rng(7))`, which every client map must reproduce: computed once."""
  algo_ref, params, batches = _setup(np.random.default_rng(7), client_map="vmap")
  return params, batches, jax.jit(algo_ref.step)(algo_ref.init(params, jax.random.key(0)), batches)


@pytest.mark.parametrize("mode", ["vmap", "sequential", "chunked:2", "chunked:3", "auto"])
def test_client_map_modes_agree(rng, mode):
  params, batches, ref = _client_map_reference()
  algo = _fedyogi_algo(mode)
  out = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  for k in params:
    np.testing.assert_allclose(out.params[k], ref.params[k], rtol=1e-5, atol=1e-7)


def test_nan_client_is_excluded_and_counted(rng):
  """A client whose data drive its update to NaN: the new model is the average of the finite clients."""
  clients = make_clients(rng, [4, 6, 5], D)
  lr = 0.05
  w, b = rng.normal(size=D), 0.0
  bad_x = clients[1][0].copy()
  bad_x[0, 0] = np.nan
  poisoned = [clients[0], (bad_x, clients[1][1]), clients[2]]
  ref_w, ref_b = _numpy_fedavg_round(w, b, [clients[0], clients[2]], lr, 2, 4, [4, 5])
  with jax.enable_x64(True):
    algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(lr))
    state = jax.jit(algo.step)(algo.init({"w": jnp.asarray(w), "b": jnp.asarray(b)}, jax.random.key(0)),
                               pack(poisoned, 2, 4, dtype=np.float64))
    np.testing.assert_allclose(state.params["w"], ref_w, rtol=1e-10)
    np.testing.assert_allclose(state.params["b"], ref_b, rtol=1e-10, atol=1e-14)
    assert int(state.metrics["num_nonfinite"]) == 1
    assert int(state.metrics["num_clients"]) == 2
    assert bool(state.metrics["round_accepted"])


def test_round_with_only_nonfinite_clients_leaves_model_and_optimizer_unchanged(rng):
  clients = make_clients(rng, [4, 6], D)
  poisoned = [(np.full_like(x, np.inf), y) for x, y in clients]
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.05),
                              server_optimizer=fo.server_optimizers.fedadam(0.1))
  s0 = algo.init({"w": jnp.ones(D), "b": jnp.zeros(())}, jax.random.key(0))
  s1 = jax.jit(algo.step)(s0, pack(clients, 2, 4))  # a normal round first, so the moments are non-zero
  s2 = jax.jit(algo.step)(s1, pack(poisoned, 2, 4))
  chex.assert_trees_all_equal((s1.params, s1.server_opt_state), (s2.params, s2.server_opt_state))
  assert not bool(s2.metrics["round_accepted"])
  assert int(s2.metrics["num_nonfinite"]) == 2
  assert int(s2.round) == 2


# ---- bad input: clear errors at trace time, naming the argument -------------------------------------------------


def _good(rng):
  return make_clients(rng, [4, 6], D), {"w": jnp.zeros(D), "b": jnp.zeros(())}


def _with(batches, **changes):
  return batches.replace(**changes)


@pytest.mark.parametrize("jit", [False, True])
def test_mismatched_data_shape_names_the_field(rng, jit):
  clients, params = _good(rng)
  batches = pack(clients, 2, 4)
  bad = _with(batches, data={"x": batches.data["x"][:, :, :3], "y": batches.data["y"]})
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1))
  step = jax.jit(algo.step) if jit else algo.step
  with pytest.raises(ValueError, match=r"batches.data\['x'\] must be shaped \[C, S, B, \.\.\.\] = \(2, 2, 4, \.\.\.\)"):
    step(algo.init(params, jax.random.key(0)), bad)


@pytest.mark.parametrize("field,value,exc,pattern", [
    ("mask", jnp.ones((2, 8), bool), ValueError, r"mask must have rank 3 \[C, S, B\]"),
    ("mask", jnp.ones((2, 2, 4), jnp.float32), TypeError, r"mask must be bool"),
    ("weight", jnp.ones((3,)), ValueError, r"weight must have shape \[C\] = \(2,\)"),
    ("weight", jnp.array([4.0, -1.0]), ValueError, r"weight must be non-negative"),
    ("weight", jnp.array([4, 6], jnp.int32), TypeError, r"weight must be a float array"),
    ("client_id", jnp.zeros((2, 1), jnp.int32), ValueError, r"client_id must have shape \[C\]"),
    ("client_id", jnp.zeros((2,), jnp.float32), TypeError, r"client_id must be an integer array"),
])
def test_bad_batches_raise_clear_errors(rng, field, value, exc, pattern):
  clients, params = _good(rng)
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1))
  with pytest.raises(exc, match=pattern):
    algo.step(algo.init(params, jax.random.key(0)), _with(pack(clients, 2, 4), **{field: value}))


def test_scalar_loss_is_rejected_at_trace_time(rng):
  clients, params = _good(rng)
  scalar_loss = lambda p, batch: jnp.mean(lsq_loss(p, batch))
  algo = fo.algorithms.fedavg(scalar_loss, client_optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"loss_fn must return per-example losses shaped \[B\] = \(4,\); got shape \(\)"):
    jax.jit(algo.step)(algo.init(params, jax.random.key(0)), pack(clients, 2, 4))


def test_bad_factory_arguments(rng):
  with pytest.raises(TypeError, match="client_optimizer must be an optax.GradientTransformation"):
    fo.algorithms.fedavg(lsq_loss, client_optimizer=0.1)
  with pytest.raises(TypeError, match="server_optimizer must be an optax.GradientTransformation"):
    fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), server_optimizer="adam")
  with pytest.raises(TypeError, match="loss_fn must be callable"):
    fo.algorithms.fedsgd(None, server_optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match="client_map must be one of"):
    fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), client_map="pmap")
  with pytest.raises(TypeError, match="aggregator must be"):
    fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), aggregator=np.mean)
  algo = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1))
  with pytest.raises(TypeError, match="key must be a PRNG key"):
    algo.init({"w": jnp.zeros(D)}, 0)
  with pytest.raises(TypeError, match="batches must be a fedjax_opt.ClientBatches"):
    algo.step(algo.init({"w": jnp.zeros(D), "b": jnp.zeros(())}, jax.random.key(0)), {"x": 1})
