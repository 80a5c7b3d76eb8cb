"""SCAFFOLD against a float64 NumPy transcription of Algorithm 1, and its claim: no client drift."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.algorithms.fedavg import fedavg
from fedjax_opt.algorithms.scaffold import scaffold
from conftest import lsq_grad_np, lsq_loss, make_clients, pack

D, N = 3, 5


def _vec(params):
  return np.append(np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64))


def _tree(z):
  return {"w": jnp.asarray(z[:-1]), "b": jnp.asarray(z[-1])}


def _grad(z, x, y):
  gw, gb = lsq_grad_np(z[:-1], z[-1], x, y)
  return np.append(gw, gb)


def _numpy_scaffold_round(z, c, table, clients, ids, lr, server_lr, steps, batch, option):
  """Algorithm 1 of Karimireddy et al. on flat parameter vectors; K counts the client's non-empty steps."""
  table = table.copy()
  dys, dcs = [], []
  for (x, y), i in zip(clients, ids):
    yk, k = z.copy(), 0
    for s in range(steps):
      xs, ys = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
      if len(ys):
        yk, k = yk - lr * (_grad(yk, xs, ys) - table[i] + c), k + 1
    new_ci = _grad(z, x, y) if option == "I" else table[i] - c + (z - yk) / (k * lr)
    dys.append(yk - z)
    dcs.append(new_ci - table[i])
    table[i] = new_ci
  return z + server_lr * np.mean(dys, axis=0), c + np.sum(dcs, axis=0) / N, table


def _round_setup(rng, dtype):
  """Three sampled clients of five (ids 3, 0, 4; 2, 3 and 1 non-empty steps) plus a padding client with id 0."""
  clients = make_clients(rng, [5, 6, 2], D)
  batches = pack(clients, 3, 2, extra_clients=1, dtype=dtype)
  ids = [3, 0, 4]
  batches = batches.replace(client_id=jnp.array(ids + [0], jnp.int32))
  table = 0.3 * rng.normal(size=(N, D + 1))
  z = rng.normal(size=D + 1)
  return clients, batches, ids, table, z


def _with_state(state, z, table):
  return state.replace(
      params=_tree(z),
      client_control_variates={"w": jnp.asarray(table[:, :-1]), "b": jnp.asarray(table[:, -1])},
      control_variate=_tree(table.mean(0)))


@pytest.mark.parametrize("option", ["I", "II"])
def test_one_round_matches_numpy_and_only_sampled_clients_change(rng, option):
  """Partial participation (3 of 5), unequal K, a zero-weight padding client sharing id 0, both options."""
  lr, server_lr = 0.1, 0.8
  with jax.enable_x64(True):
    clients, batches, ids, table, z = _round_setup(rng, np.float64)
    algo = scaffold(lsq_loss, lr, server_lr, num_clients=N, control_update=option)
    state = _with_state(algo.init(_tree(z), jax.random.key(0)), z, table)
    out = jax.jit(algo.step)(state, batches)
    ref_z, ref_c, ref_table = _numpy_scaffold_round(z, table.mean(0), table, clients, ids, lr, server_lr, 3, 2, option)
    np.testing.assert_allclose(_vec(out.params), ref_z, rtol=1e-10)
    np.testing.assert_allclose(_vec(out.control_variate), ref_c, rtol=1e-10)
    got_table = np.column_stack([out.client_control_variates["w"], out.client_control_variates["b"]])
    np.testing.assert_allclose(got_table, ref_table, rtol=1e-10)
    for i in (1, 2):  # not sampled: exactly as before
      np.testing.assert_array_equal(got_table[i], table[i])
    np.testing.assert_allclose(_vec(out.control_variate), got_table.mean(0), rtol=1e-10)  # c = mean c_i
    assert int(out.metrics["num_clients"]) == 3


def test_client_map_modes_agree_with_numpy(rng):
  clients, batches, ids, table, z = _round_setup(rng, np.float32)
  ref_z, ref_c, _ = _numpy_scaffold_round(z, table.mean(0), table, clients, ids, 0.1, 1.0, 3, 2, "II")
  for mode in ["vmap", "sequential", "chunked:2"]:
    algo = scaffold(lsq_loss, 0.1, 1.0, num_clients=N, client_map=mode)
    state = _with_state(algo.init(_tree(z.astype(np.float32)), jax.random.key(0)),
                        z.astype(np.float32), table.astype(np.float32))
    out = jax.jit(algo.step)(state, batches)
    np.testing.assert_allclose(_vec(out.params), ref_z, rtol=1e-5, err_msg=mode)
    np.testing.assert_allclose(_vec(out.control_variate), ref_c, rtol=1e-5, atol=1e-6, err_msg=mode)


def test_traced_learning_rates_sweep_in_one_program(rng):
  """jax.vmap over (η_l, η_g): each entry equals the NumPy round for those step sizes."""
  clients, batches, ids, table, z = _round_setup(rng, np.float32)
  lrs = [(0.1, 1.0), (0.05, 0.5)]

  def run(client_lr, server_lr):
    algo = scaffold(lsq_loss, client_lr, server_lr, num_clients=N)
    state = _with_state(algo.init(_tree(z.astype(np.float32)), jax.random.key(0)),
                        z.astype(np.float32), table.astype(np.float32))
    return algo.step(state, batches).params

  out = jax.jit(jax.vmap(run))(*map(jnp.asarray, zip(*lrs)))
  for i, (lr, glr) in enumerate(lrs):
    ref_z, _, _ = _numpy_scaffold_round(z, table.mean(0), table, clients, ids, lr, glr, 3, 2, "II")
    np.testing.assert_allclose(_vec(jax.tree.map(lambda a: a[i], out)), ref_z, rtol=1e-5)


def test_out_of_range_client_id_under_jit_is_dropped_and_counted(rng):
  """Inside jit the ids are traced: client 9 of 5 reads NaN control variates, its update is excluded, nothing written."""
  clients, batches, ids, table, z = _round_setup(rng, np.float32)
  algo = scaffold(lsq_loss, 0.1, 1.0, num_clients=N)
  state = _with_state(algo.init(_tree(z.astype(np.float32)), jax.random.key(0)),
                      z.astype(np.float32), table.astype(np.float32))
  out = jax.jit(algo.step)(state, batches.replace(client_id=jnp.array([3, 9, 4, 0], jnp.int32)))
  ref_z, _, _ = _numpy_scaffold_round(z, table.mean(0), table, [clients[0], clients[2]], [3, 4], 0.1, 1.0, 3, 2, "II")
  np.testing.assert_allclose(_vec(out.params), ref_z, rtol=1e-5)
  assert int(out.metrics["num_nonfinite"]) == 1 and int(out.metrics["num_clients"]) == 2
  assert np.all(np.isfinite(out.client_control_variates["w"]))
  np.testing.assert_array_equal(out.client_control_variates["w"][0], table[0, :-1].astype(np.float32))


def _full_batch(clients, steps):
  """Every local step sees the client's whole data set (deterministic local gradient descent)."""
  one = pack(clients, 1, max(len(y) for _, y in clients), dtype=np.float64)
  return one.replace(data=jax.tree.map(lambda a: jnp.repeat(a, steps, axis=1), one.data),
                     mask=jnp.repeat(one.mask, steps, axis=1))


def _run(algo, params, batches, rounds):
  def body(state, _):
    return algo.step(state, batches), None

  return jax.jit(lambda s: jax.lax.scan(body, s, None, length=rounds)[0])(algo.init(params, jax.random.key(0)))


def test_scaffold_reaches_the_global_minimizer_where_fedavg_drifts(rng):
  """Heterogeneous least squares, 5 local steps: SCAFFOLD converges to argmin (1/N) Σ f_i; FedAvg stalls away from it."""
  n = 4
  clients = make_clients(rng, [10] * n, D)
  lr, steps, rounds = 0.1, 5, 150
  a = [np.hstack([x, np.ones((len(x), 1))]) for x, _ in clients]
  lhs = sum(ai.T @ ai / len(ai) for ai in a)
  rhs = sum(ai.T @ y / len(y) for ai, (_, y) in zip(a, clients))
  z_star = np.linalg.solve(lhs, rhs)
  with jax.enable_x64(True):
    batches = _full_batch(clients, steps)
    params = _tree(np.zeros(D + 1))
    ours = _run(scaffold(lsq_loss, lr, 1.0, num_clients=n), params, batches, rounds)
    drift = _run(fedavg(lsq_loss, client_optimizer=optax.sgd(lr), aggregator=fo.aggregators.mean()),
                 params, batches, rounds)
    err = lambda s: np.linalg.norm(_vec(s.params) - z_star) / np.linalg.norm(z_star)
    assert err(ours) < 1e-5, err(ours)
    assert err(drift) > 1e-2, err(drift)
    # FedAvg has converged too, to its own (biased) fixed point: another round barely moves it.
    assert float(drift.metrics["update_norm"]) < 1e-8


def test_low_precision_control_variates_keep_c_equal_to_their_mean(rng):
  """bfloat16 storage of c_i, several rounds of partial participation: c stays (1/N) Σ stored c_i."""
  clients = make_clients(rng, [6, 6, 6], D)
  batches = pack(clients, 3, 2)
  algo = scaffold(lsq_loss, 0.05, 1.0, num_clients=N, storage_dtype=jnp.bfloat16)
  state = algo.init(_tree(np.zeros(D + 1, np.float32)), jax.random.key(0))
  step = jax.jit(algo.step)
  for ids in ([0, 1, 2], [2, 3, 4], [4, 0, 3]):
    state = step(state, batches.replace(client_id=jnp.array(ids, jnp.int32)))
  table = state.client_control_variates
  assert table["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(state.control_variate["w"], np.asarray(table["w"], np.float64).mean(0), atol=1e-6)
  assert state.control_variate["w"].dtype == jnp.float32


def test_bad_arguments(rng):
  with pytest.raises(ValueError, match=r"control_update must be one of \('I', 'II'\); got 'III'"):
    scaffold(lsq_loss, 0.1, 1.0, num_clients=N, control_update="III")
  with pytest.raises(ValueError, match=r"eta_l must be finite and > 0"):
    scaffold(lsq_loss, -0.1, 1.0, num_clients=N)
  with pytest.raises(ValueError, match=r"eta_g must be finite and > 0"):
    scaffold(lsq_loss, 0.1, 0.0, num_clients=N)
  with pytest.raises(TypeError, match=r"num_clients must be a Python int >= 1"):
    scaffold(lsq_loss, 0.1, 1.0, num_clients=None)
  algo = scaffold(lsq_loss, 0.1, 1.0, num_clients=2)
  batches = pack(make_clients(rng, [4, 4, 4], D), 2, 2)  # client ids 0, 1, 2
  with pytest.raises(ValueError, match=r"client_id holds id 2 but the per-client state has num_clients=2"):
    algo.step(algo.init(_tree(np.zeros(D + 1, np.float32)), jax.random.key(0)), batches)


def _refusal(aggregator):
  with pytest.raises(ValueError) as raised:
    scaffold(lsq_loss, 0.1, 1.0, num_clients=N, aggregator=aggregator)
  message = str(raised.value)
  assert "\n" not in message and message.startswith("scaffold: ")
  return message


def test_dp_mean_is_refused_directly_chained_and_inside_secure_aggregation():
  """c ← c + (1/N) Σ Δc_i adds each Δc_i unclipped and un-noised, and under option II Δc_i = −c − Δy_i/(K η_l) is
  the client's update itself: DP of the Δy_i alone would not be DP of the run."""
  dp = fo.privacy.dp_mean(1.0, 1.0, expected_clients=3)
  stage = fo.compression.compress(fo.compression.top_k(k=1))
  for aggregator in (dp, fo.aggregators.chain(stage, dp)):
    message = _refusal(aggregator)
    assert "dp_mean" in message and "unclipped" in message and "not be differentially private" in message
    assert "use fo.algorithms.fedavg or fedprox" in message
  for inner in (dp, fo.aggregators.mean()):  # the Δc_i would be sent in the clear beside a secure sum of the Δy_i
    message = _refusal(fo.privacy.secure_aggregation(inner, bound=1.0))
    assert "secure_aggregation" in message and "in the clear" in message and "use fo.algorithms.fedavg" in message


ROBUST = {"marginal_median": lambda: fo.aggregators.marginal_median(),
          "mean_around_median": lambda: fo.aggregators.mean_around_median(1),
          "trimmed_mean": lambda: fo.aggregators.trimmed_mean(0.1),
          "geometric_median": lambda: fo.aggregators.geometric_median(),
          "krum": lambda: fo.aggregators.krum(1), "multi_krum": lambda: fo.aggregators.multi_krum(1),
          "bulyan": lambda: fo.aggregators.bulyan(1), "centered_clipping": lambda: fo.aggregators.centered_clipping(1.0)}


def test_robust_rules_and_simulated_attacks_are_refused():
  """A robust rule protects x from the Δy_i, while c stays the plain sum (1/N) Σ Δc_i that one attacker moves
  freely; `corrupt` replaces the Δy_i only, so its attackers would send honest Δc_i."""
  stage = fo.compression.compress(fo.compression.top_k(k=1))
  for name, rule in ROBUST.items():
    for aggregator in (rule(), fo.aggregators.chain(stage, rule())):
      message = _refusal(aggregator)
      assert f"{name} is a robust rule" in message and "moves freely" in message, message
      assert f"use fo.algorithms.fedavg with {name}" in message
  for inner in (fo.aggregators.mean(), fo.aggregators.krum(1)):
    message = _refusal(fo.attacks.corrupt(inner, fo.attacks.omniscient(1e4), attackers=0.25))
    assert "corrupt" in message and "honest" in message and "fo.attacks.poison" in message


def test_sum_form_aggregators_are_not_refused():
  """The mean, the weighted mean and a compression stage in front of one (their rounds: tests/test_streaming.py,
  tests/test_compression_composition.py)."""
  stage = fo.compression.compress(fo.compression.top_k(k=1))
  for aggregator in (fo.aggregators.mean(), fo.aggregators.weighted_mean(),
                     fo.aggregators.chain(stage, fo.aggregators.mean())):
    scaffold(lsq_loss, 0.1, 1.0, num_clients=N, aggregator=aggregator)
