"""FedDyn against a float64 NumPy transcription of Algorithm 1, and its claim: the global optimum, exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo

from fedjax_opt.algorithms.feddyn import feddyn
from conftest import lsq_grad_np, lsq_loss, make_clients, pack

D, M = 3, 5


def _vec(params):
  return np.append(np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64))


def _tree(z):
  return {"w": jnp.asarray(z[:-1]), "b": jnp.asarray(z[-1])}


def _grad(z, x, y):
  return np.append(*lsq_grad_np(z[:-1], z[-1], x, y))


def _numpy_feddyn_round(theta, h, table, clients, ids, alpha, lr, steps, batch):
  """Acar et al.'s round on flat vectors: local SGD on L_k − ⟨g_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖², then g_k, h, θ."""
  table = table.copy()
  deltas = []
  for (x, y), k in zip(clients, ids):
    z = theta.copy()
    for s in range(steps):
      xs, ys = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
      if len(ys):
        z = z - lr * (_grad(z, xs, ys) - table[k] + alpha * (z - theta))
    deltas.append(z - theta)
    table[k] = table[k] - alpha * (z - theta)
  h = h - alpha / M * np.sum(deltas, axis=0)
  return theta + np.mean(deltas, axis=0) - h / alpha, h, table


def _round_setup(rng, dtype):
  """Three active clients of five (ids 4, 1, 2) and a zero-weight padding client that also says id 1."""
  clients = make_clients(rng, [5, 6, 3], D)
  batches = pack(clients, 3, 2, extra_clients=1, dtype=dtype)
  ids = [4, 1, 2]
  batches = batches.replace(client_id=jnp.array(ids + [1], jnp.int32))
  return clients, batches, ids, 0.3 * rng.normal(size=(M, D + 1)), rng.normal(size=D + 1)


def _with_state(state, theta, table):
  return state.replace(params=_tree(theta), h=_tree(table.mean(0)),
                       client_gradients={"w": jnp.asarray(table[:, :-1]), "b": jnp.asarray(table[:, -1])})


def test_one_round_matches_numpy_inactive_clients_keep_their_state(rng):
  alpha, lr = 0.5, 0.1
  with jax.enable_x64(True):
    clients, batches, ids, table, theta = _round_setup(rng, np.float64)
    algo = feddyn(lsq_loss, alpha, client_optimizer=optax.sgd(lr), num_clients=M)
    out = jax.jit(algo.step)(_with_state(algo.init(_tree(theta), jax.random.key(0)), theta, table), batches)
    ref_theta, ref_h, ref_table = _numpy_feddyn_round(theta, table.mean(0), table, clients, ids, alpha, lr, 3, 2)
    got_table = np.column_stack([out.client_gradients["w"], out.client_gradients["b"]])
    np.testing.assert_allclose(_vec(out.params), ref_theta, rtol=1e-10)
    np.testing.assert_allclose(_vec(out.h), ref_h, rtol=1e-10)
    np.testing.assert_allclose(got_table, ref_table, rtol=1e-10)
    for k in (0, 3):  # inactive: exactly as before
      np.testing.assert_array_equal(got_table[k], table[k])
    np.testing.assert_allclose(_vec(out.h), got_table.mean(0), rtol=1e-10)  # h = (1/m) Σ g_k


def test_two_rounds_from_init_match_algorithm_1(rng):
  """From `init` (g_k = 0, h = 0): round 1 makes g_k ≠ 0, and round 2's local objectives of the clients seen again
  (ids 1 and 4) carry it, so the sign of −⟨g_k, θ⟩, of g_k ← g_k − α(θ_k − θ^{t−1}) and of h are all exercised
  against the NumPy transcription of Acar et al.'s Algorithm 1 with nothing injected into the state."""
  alpha, lr = 0.3, 0.1
  with jax.enable_x64(True):
    theta = rng.normal(size=D + 1)
    h, table = np.zeros(D + 1), np.zeros((M, D + 1))
    algo = feddyn(lsq_loss, alpha, client_optimizer=optax.sgd(lr), num_clients=M)
    state = algo.init(_tree(theta), jax.random.key(0))
    step = jax.jit(algo.step)
    for ids in ([4, 1, 2], [1, 0, 4]):
      clients = make_clients(rng, [5, 6, 3], D)
      state = step(state, pack(clients, 3, 2, dtype=np.float64).replace(client_id=jnp.array(ids, jnp.int32)))
      assert ids == [4, 1, 2] or np.abs(table[[1, 4]]).min() > 1e-3  # round 2 starts from g_k ≠ 0
      theta, h, table = _numpy_feddyn_round(theta, h, table, clients, ids, alpha, lr, 3, 2)
      np.testing.assert_allclose(_vec(state.params), theta, rtol=1e-10)
      np.testing.assert_allclose(_vec(state.h), h, rtol=1e-10)
      np.testing.assert_allclose(np.column_stack([state.client_gradients["w"], state.client_gradients["b"]]), table,
                                 rtol=1e-10, atol=1e-14)


def test_client_map_modes_agree_with_numpy(rng):
  clients, batches, ids, table, theta = _round_setup(rng, np.float32)
  ref_theta, _, _ = _numpy_feddyn_round(theta, table.mean(0), table, clients, ids, 0.5, 0.1, 3, 2)
  for mode in ["vmap", "chunked:2"]:  # "sequential" (the CPU default) is what the other tests run
    algo = feddyn(lsq_loss, 0.5, client_optimizer=optax.sgd(0.1), num_clients=M, client_map=mode)
    state = _with_state(algo.init(_tree(theta.astype(np.float32)), jax.random.key(0)),
                        theta.astype(np.float32), table.astype(np.float32))
    out = jax.jit(algo.step)(state, batches)
    np.testing.assert_allclose(_vec(out.params), ref_theta, rtol=1e-5, atol=1e-6, err_msg=mode)


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_reaches_the_global_optimum_with_full_and_partial_participation(rng):
  """Heterogeneous least squares, 5 inexact local steps: θ → argmin (1/m) Σ f_k, with all 4 clients per round
  and with 2 of 4 per round in rotation."""
  clients = make_clients(rng, [10] * 4, D)
  a = [np.hstack([x, np.ones((len(x), 1))]) for x, _ in clients]
  z_star = np.linalg.solve(sum(ai.T @ ai / len(ai) for ai in a), sum(ai.T @ y / len(y) for ai, (_, y) in zip(a, clients)))
  with jax.enable_x64(True):
    one = pack(clients, 1, 10, dtype=np.float64)
    full = one.replace(data=jax.tree.map(lambda x: jnp.repeat(x, 5, axis=1), one.data), mask=jnp.repeat(one.mask, 5, 1))
    pairs = [jax.tree.map(lambda x, ids=ids: x[jnp.array(ids)], full) for ids in ([0, 1], [2, 3], [1, 2], [3, 0])]
    rotation = jax.tree.map(lambda *xs: jnp.stack(xs), *pairs)
    algo = feddyn(lsq_loss, 1.0, client_optimizer=optax.sgd(0.1), num_clients=4)

    @jax.jit
    def run(state):
      full_run = jax.lax.scan(lambda s, _: (algo.step(s, full), None), state, None, length=300)[0]
      partial = jax.lax.scan(lambda s, i: (algo.step(s, jax.tree.map(lambda x: x[i % 4], rotation)), None),
                             state, jnp.arange(400))[0]
      return full_run, partial

    full_run, partial = run(algo.init(_tree(np.zeros(D + 1)), jax.random.key(0)))
    for state in (full_run, partial):
      np.testing.assert_allclose(_vec(state.params), z_star, rtol=1e-8)
      np.testing.assert_allclose(_vec(state.h), 0, atol=1e-8)  # h = mean ∇L_k(θ*) = 0


def test_bad_arguments(rng):
  with pytest.raises(ValueError, match=r"alpha must be finite and > 0; got -0.1"):
    feddyn(lsq_loss, -0.1, client_optimizer=optax.sgd(0.1), num_clients=M)
  with pytest.raises(ValueError, match=r"alpha must be finite and > 0; got 0"):
    feddyn(lsq_loss, 0, client_optimizer=optax.sgd(0.1), num_clients=M)
  with pytest.raises(ValueError, match=r"num_clients must be a Python int >= 1"):
    feddyn(lsq_loss, 0.1, client_optimizer=optax.sgd(0.1), num_clients=0)
  with pytest.raises(TypeError, match="client_optimizer must be an optax.GradientTransformation"):
    feddyn(lsq_loss, 0.1, client_optimizer=0.1, num_clients=M)
  algo = feddyn(lsq_loss, 0.1, client_optimizer=optax.sgd(0.1), num_clients=2)
  batches = pack(make_clients(rng, [4, 4, 4], D), 2, 2)
  with pytest.raises(ValueError, match=r"client_id holds id 2 but the per-client state has num_clients=2"):
    algo.step(algo.init(_tree(np.zeros(D + 1, np.float32)), jax.random.key(0)), batches)


def test_pieces_that_would_leave_h_unprotected_are_refused_in_one_line():
  """h moves by the plain sum of the exact g_k changes, outside the aggregator: dp_mean, secure aggregation, a
  robust rule and a simulated attack would cover the model's average and not h."""
  loss = lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2
  dp = fo.privacy.dp_mean(1.0, 1.0, expected_clients=4)
  cases = {
      "dp_mean": (dp, "would not be differentially private"),
      "chained dp_mean": (fo.aggregators.chain(fo.compression.compress(fo.compression.top_k(k=1)), dp), None),
      "secure": (fo.privacy.secure_aggregation(fo.aggregators.mean(), bound=1.0), "needs their exact sum"),
      "median": (fo.aggregators.marginal_median(), "one attacker moves freely"),
      "corrupt": (fo.attacks.corrupt(fo.aggregators.mean(), fo.attacks.omniscient(1e4), attackers=0.2),
                  "its attackers would be honest in h"),
  }
  for name, (aggregator, needle) in cases.items():
    with pytest.raises(ValueError) as raised:
      fo.algorithms.feddyn(loss, 0.1, num_clients=4, client_optimizer=optax.sgd(0.1), aggregator=aggregator)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("feddyn"), (name, message)
    assert needle is None or needle in message, (name, message)
  for aggregator in (fo.aggregators.mean(), fo.aggregators.weighted_mean()):  # sums: h stays exact
    fo.algorithms.feddyn(loss, 0.1, num_clients=4, client_optimizer=optax.sgd(0.1), aggregator=aggregator)

