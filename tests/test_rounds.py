"""The one client round (`fedjax_opt.core.rounds.client_round`) and its rules, against NumPy.

* No step, no part: a client with weight > 0 whose batches are all empty has
  weight 0, is not counted, and writes nothing; the aggregate is the weighted
  mean of the other clients.
* Non-finite: a client whose update is NaN is dropped, counted, and writes nothing.
* Rows that are the client's own (`rows_follow_round=False`) are written
  whatever happens to the aggregate, under the client's own condition.
* Without an aggregator, finiteness is judged on the new rows.
The same rules, seen through three algorithms built on it (FedAvg, SCAFFOLD, EASGD).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.core import per_client
from fedjax_opt.core.local import local_train
from fedjax_opt.core.rounds import ClientOutput, client_round

C, S, B, D, N = 4, 2, 3, 2, 6
LR = 0.1


def _loss(params, batch):
  return 0.5 * jnp.square(batch["x"] @ params["w"] - batch["y"])


def _batches(rng, *, empty=(), nan=()):
  x = rng.normal(size=(C, S, B, D)).astype(np.float32)
  y = rng.normal(size=(C, S, B)).astype(np.float32)
  mask = np.ones((C, S, B), bool)
  for c in empty:
    mask[c] = False
  for c in nan:
    x[c, 0, 0, 0] = np.nan
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray([3.0, 5.0, 7.0, 11.0]), client_id=jnp.asarray([4, 0, 2, 5], jnp.int32))


def _numpy_delta(w, x, y, mask):
  """S steps of SGD on the masked mean of ½(xᵀw − y)², float64; 0 for an all-empty client."""
  w = w.astype(np.float64)
  w0 = w.copy()
  for s in range(S):
    m = mask[s]
    if m.any():
      r = x[s][m] @ w - y[s][m]
      w = w - LR * x[s][m].T @ r / m.sum()
  return w - w0


def _client_update(shared, data, mask, row):
  result = local_train(_loss, optax.sgd(LR), shared, data, mask)
  return ClientOutput(result, rows=(jax.tree.map(lambda r, d: r + d, row, result.delta),), extras=result.num_steps)


@pytest.mark.parametrize("rows_follow_round", [True, False])
def test_no_step_and_nonfinite_clients_take_no_part(rng, rows_follow_round):
  batches = _batches(rng, empty=(1,), nan=(2,))
  params = {"w": jnp.asarray(rng.normal(size=(D,)), jnp.float32)}
  table = per_client.init(params, N, fill=1.0)
  table = {"w": table["w"].at[5].set(jnp.nan)}  # client 3's stored row is broken: its update is fine, its row is not
  out = client_round("sequential", _client_update, params, batches, tables=(table,), like=params,
                     aggregator=fo.aggregators.weighted_mean(), aggregator_state=(), key=jax.random.key(0),
                     rows_follow_round=rows_follow_round)
  x, y, mask = (np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64),
                np.asarray(batches.mask))
  w = np.asarray(params["w"], np.float64)
  deltas = {c: _numpy_delta(w, x[c], y[c], mask[c]) for c in (0, 3)}
  n = {0: 3.0, 3: 11.0}
  expected = sum(n[c] * deltas[c] for c in deltas) / sum(n.values())
  np.testing.assert_allclose(out.agg.update["w"], expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out.weights, [3.0, 0.0, 7.0, 11.0])  # no step: weight 0
  np.testing.assert_array_equal(out.agg.finite, [True, True, False, True])
  assert int(out.agg.num_nonfinite) == 1
  metrics = out.metrics()
  assert int(metrics["num_clients"]) == 2 and float(metrics["num_examples"]) == 2 * S * B
  # Rows: only client 0 (id 4) writes; the empty client (id 0) and the NaN client (id 2) keep theirs, and
  # client 3 (id 5), aggregated, does not write its non-finite row. With rows_follow_round=False the empty
  # client writes too (its own row, unchanged by zero steps): its weight is > 0.
  written = np.asarray(out.write)
  np.testing.assert_array_equal(written, [True, not rows_follow_round, False, False])
  new = np.asarray(out.stored[0].table["w"])
  np.testing.assert_allclose(new[4], 1.0 + deltas[0], rtol=1e-5, atol=1e-6)
  for row in (0, 1, 2, 3):
    np.testing.assert_array_equal(new[row], np.ones(D))
  assert np.all(np.isnan(new[5]))


def test_without_an_aggregator_finiteness_is_judged_on_the_rows(rng):
  batches = _batches(rng, nan=(3,))
  params = {"w": jnp.zeros((D,), jnp.float32)}
  table = per_client.init(params, N)
  out = client_round("vmap", _client_update, params, batches, tables=(table,), like=params)
  np.testing.assert_array_equal(out.agg.finite, [True, True, True, False])
  assert out.agg.update is None and bool(out.agg.accepted) and int(out.agg.num_nonfinite) == 1
  np.testing.assert_array_equal(out.write, [True, True, True, False])


def test_without_an_aggregator_what_a_client_computed_beside_its_rows_is_judged_too(rng):
  """`ClientOutput.checked`: a client whose rows are finite but whose loss is not (a value the algorithm reads) is
  dropped and counted, and writes nothing; `every_client` makes every client take part, with data or not (weight
  1, one step each with `full_participation_output`)."""
  from fedjax_opt.core.rounds import every_client, full_participation_output
  batches = _batches(rng, empty=(1,)).replace(weight=jnp.zeros((C,), jnp.float32))
  params = {"w": jnp.zeros((D,), jnp.float32)}
  table = per_client.init(params, N)

  def update(shared, data, mask, row):
    loss = jnp.where(jnp.sum(data["x"][0, 0]) > 0, jnp.inf, 0.0)  # not finite for some clients, by their data
    return full_participation_output(row, (jax.tree.map(lambda r: r + 1.0, row),), loss, mask, checked=loss)

  out = client_round("vmap", update, params, every_client(batches), tables=(table,), like=params)
  x = np.asarray(batches.data["x"])
  bad = np.sum(x[:, 0, 0], axis=-1) > 0
  np.testing.assert_array_equal(np.asarray(out.agg.finite), ~bad)
  assert int(out.agg.num_nonfinite) == int(bad.sum()) and bool(out.agg.accepted) == bool((~bad).any())
  np.testing.assert_array_equal(np.asarray(out.write), ~bad)  # client 1, without data, took part and wrote if finite
  np.testing.assert_array_equal(np.asarray(out.weights), np.ones(C))
  stored = np.asarray(out.stored[0].table["w"])[np.asarray(batches.client_id)]
  np.testing.assert_array_equal(stored, np.where(bad[:, None], 0.0, np.ones((C, D))))


def test_fedavg_gives_a_client_without_steps_no_weight(rng):
  """FedAvg's new model is the weighted mean of the clients that stepped, not diluted by an empty one."""
  batches = _batches(rng, empty=(2,))
  params = {"w": jnp.asarray(rng.normal(size=(D,)), jnp.float32)}
  algorithm = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(LR))
  state = algorithm.step(algorithm.init(params, jax.random.key(0)), batches)
  x, y, mask = (np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64),
                np.asarray(batches.mask))
  w = np.asarray(params["w"], np.float64)
  n = {0: 3.0, 1: 5.0, 3: 11.0}
  expected = w + sum(n[c] * _numpy_delta(w, x[c], y[c], mask[c]) for c in n) / sum(n.values())
  np.testing.assert_allclose(state.params["w"], expected, rtol=1e-5, atol=1e-6)
  assert int(state.metrics["num_clients"]) == 3


def test_scaffold_and_easgd_leave_a_client_without_steps_untouched(rng):
  batches = _batches(rng, empty=(0,))
  params = {"w": jnp.asarray(rng.normal(size=(D,)), jnp.float32)}
  scaffold = fo.algorithms.scaffold(_loss, LR, 1.0, num_clients=N)
  state = scaffold.step(scaffold.init(params, jax.random.key(0)), batches)
  c_i = np.asarray(state.client_control_variates["w"])
  np.testing.assert_array_equal(c_i[4], np.zeros(D))  # client 0 (id 4) took no step: c_i stays 0
  assert np.all(np.abs(c_i[[0, 2, 5]]) > 0)
  easgd = fo.algorithms.easgd(_loss, 0.1, num_clients=N, client_optimizer=optax.sgd(LR))
  start = easgd.init(params, jax.random.key(0))
  start = start.replace(local_params=jax.tree.map(lambda t: t + jnp.arange(N, dtype=t.dtype)[:, None],
                                                  start.local_params))
  after = easgd.step(start, batches)
  np.testing.assert_array_equal(fo.personalized_params(after, 4)["w"], fo.personalized_params(start, 4)["w"])
  # The center moves by α Σ (x_i − x̃) over the three clients that stepped only.
  x_i = np.asarray(start.local_params["w"], np.float64)
  center = np.asarray(params["w"], np.float64)
  expected = center + 0.1 * sum(x_i[i] - center for i in (0, 2, 5))
  np.testing.assert_allclose(after.params["w"], expected, rtol=1e-5, atol=1e-6)
