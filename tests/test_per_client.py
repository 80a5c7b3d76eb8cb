"""Per-client state: gather/scatter against NumPy indexing, padding never writes, every client_map mode."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import diagonal
from hypothesis import given, settings, strategies as st

import fedjax_opt as fo
from fedjax_opt.core import client_map as cm
from fedjax_opt.core import per_client

N = 7
_scatter = jax.jit(per_client.scatter)  # one compilation for every drawn example (fixed C = 8)


def _table(rng, dtype=np.float32):
  return {"w": jnp.asarray(rng.normal(size=(N, 3, 2)), dtype), "b": jnp.asarray(rng.normal(size=(N,)), dtype)}


def test_init_shapes_dtypes_and_memory_cost():
  params = {"w": jnp.zeros((3, 2), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  table = per_client.init(params, N)
  assert table["w"].shape == (N, 3, 2) and table["b"].shape == (N,)
  assert table["w"].dtype == jnp.float32 and not np.any(np.asarray(table["w"]))
  low = per_client.init(params, N, storage_dtype=jnp.bfloat16, fill=1.5)
  assert low["w"].dtype == jnp.bfloat16 and np.all(np.asarray(low["b"], np.float32) == 1.5)
  assert per_client.nbytes(params, N) == N * 7 * 4 == sum(x.nbytes for x in jax.tree.leaves(table))
  assert per_client.nbytes(params, N, jnp.bfloat16) == N * 7 * 2
  # Works on shape structs, before anything is allocated.
  assert per_client.nbytes(jax.eval_shape(lambda: params), 3400) == 3400 * 7 * 4


def test_gather_equals_numpy_indexing(rng):
  table = _table(rng)
  ids = np.array([3, 0, 6, 3, 1], np.int32)
  rows = jax.jit(per_client.gather)(table, jnp.asarray(ids))
  for k in table:
    np.testing.assert_array_equal(rows[k], np.asarray(table[k])[ids])


def test_gather_casts_to_the_model_dtype(rng):
  table = _table(rng, jnp.bfloat16)
  like = {"w": jnp.zeros((3, 2), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  rows = jax.jit(lambda t, i: per_client.gather(t, i, like=like))(table, np.array([2, 5], np.int32))
  assert rows["w"].dtype == jnp.float32
  np.testing.assert_array_equal(rows["w"], np.asarray(table["w"], np.float32)[[2, 5]])


@settings(max_examples=25, deadline=None)
@given(ids=st.lists(st.integers(0, N - 1), min_size=8, max_size=8), data=st.data())
def test_scatter_equals_numpy_assignment_last_writer_wins(ids, data):
  """For each written id the value of its last writing copy lands; other rows stay bit for bit."""
  write = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
  rng = np.random.default_rng(sum(ids))
  table = _table(rng)
  values = {"w": rng.normal(size=(len(ids), 3, 2)).astype(np.float32),
            "b": rng.normal(size=(len(ids),)).astype(np.float32)}
  out = _scatter(table, jnp.asarray(ids, jnp.int32), values, jnp.asarray(write))
  expected = {k: np.array(v) for k, v in table.items()}
  landed = np.zeros(len(ids), bool)
  change = {k: np.zeros(v.shape[1:], np.float32) for k, v in expected.items()}
  last = {}
  for c, (i, wr) in enumerate(zip(ids, write)):
    if wr:
      last[i] = c
  for i, c in last.items():
    landed[c] = True
    for k in expected:
      change[k] += values[k][c] - expected[k][i]
      expected[k][i] = values[k][c]
  np.testing.assert_array_equal(out.written, landed)
  for k in expected:
    np.testing.assert_array_equal(out.table[k], expected[k])
    np.testing.assert_allclose(out.change[k], change[k], rtol=1e-6, atol=1e-6)


def test_zero_weight_padding_never_writes_even_when_it_shares_a_row(rng):
  """Padding clients carry arbitrary ids (here those of real clients) and garbage values: nothing of theirs lands."""
  table = _table(rng)
  ids = np.array([4, 4, 2, 2], np.int32)
  values = {"w": np.full((4, 3, 2), 9.0, np.float32), "b": np.array([1.0, 2.0, 3.0, np.nan], np.float32)}
  weight = np.array([5.0, 0.0, 3.0, 0.0], np.float32)  # padding after the real client with the same id
  out = _scatter(table, ids, values, weight > 0)
  np.testing.assert_array_equal(out.written, [True, False, True, False])
  assert float(out.table["b"][4]) == 1.0 and float(out.table["b"][2]) == 3.0
  untouched = [0, 1, 3, 5, 6]
  np.testing.assert_array_equal(np.asarray(out.table["b"])[untouched], np.asarray(table["b"])[untouched])


def test_low_precision_storage_change_is_what_was_stored(rng):
  """bfloat16 rows are rounded; `change` is the change of the stored sum, so a mean kept beside it stays exact."""
  params = {"w": jnp.zeros((3, 2), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  table = per_client.init(params, N, storage_dtype=jnp.bfloat16)
  mean = jax.tree.map(np.zeros_like, params)

  @jax.jit  # one program for the four rounds (eagerly, each of their small ops compiles)
  def round_(table, mean, ids, values, write):
    out = per_client.scatter(table, ids, values, write)
    return out.table, jax.tree.map(lambda m, d: m + d / N, mean, out.change)

  for r in range(4):
    ids = rng.choice(N, 3, replace=False).astype(np.int32)
    values = {"w": rng.normal(size=(3, 3, 2)).astype(np.float32) / 3,
              "b": rng.normal(size=(3,)).astype(np.float32) / 3}
    table, mean = round_(table, mean, ids, values, np.array([True, True, r % 2 == 0]))
  assert table["w"].dtype == jnp.bfloat16
  for k in params:
    np.testing.assert_allclose(mean[k], np.asarray(table[k], np.float64).mean(0), rtol=1e-5, atol=1e-6)


def test_client_id_beyond_num_clients_is_a_clear_error(rng):
  table = _table(rng)
  with pytest.raises(ValueError, match=r"client_id holds id 9 but the per-client state has num_clients=7"):
    per_client.gather(table, jnp.array([1, 9], jnp.int32))
  with pytest.raises(ValueError, match=r"num_clients=7"):
    per_client.scatter(table, jnp.array([7], jnp.int32), jax.tree.map(lambda t: t[:1], table), jnp.array([True]))


def test_out_of_range_id_under_jit_reads_nan_and_never_writes(rng):
  """Inside jit no Python error can be raised: the row reads NaN (so the non-finite guard drops the client)."""
  table = _table(rng)
  ids = jnp.array([1, 12, -1], jnp.int32)  # -1 must not wrap around to row N − 1
  rows = jax.jit(per_client.gather)(table, ids)
  assert np.all(np.isnan(rows["w"][1:])) and np.all(np.isfinite(rows["w"][0]))
  values = jax.tree.map(jnp.zeros_like, rows)
  out = jax.jit(per_client.scatter)(table, ids, values, jnp.array([True, True, True]))
  np.testing.assert_array_equal(out.written, [True, False, False])
  np.testing.assert_array_equal(np.delete(np.asarray(out.table["b"]), 1), np.delete(np.asarray(table["b"]), 1))


def test_bad_num_clients():
  with pytest.raises(TypeError, match="num_clients must be a Python int >= 1"):
    per_client.init({"w": jnp.zeros(2)}, 3.0)
  with pytest.raises(ValueError, match="num_clients must be a Python int >= 1"):
    per_client.init({"w": jnp.zeros(2)}, 0)


@pytest.mark.parametrize("mode", ["vmap", "sequential", "chunked:2"])
def test_a_round_of_per_client_state_is_the_same_under_every_client_map_mode(rng, mode):
  """gather -> per-client function through map_clients -> scatter: equal to a NumPy loop, in every mode."""
  table = _table(rng)
  shared = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
  ids = np.array([5, 2, 0, 2, 6], np.int32)
  weight = np.array([1.0, 2.0, 0.0, 3.0, 1.0], np.float32)

  def fn(s, row):
    return {"w": 0.5 * row["w"] + s, "b": row["b"] + jnp.sum(s)}

  @jax.jit
  def round_(table):
    rows = per_client.gather(table, jnp.asarray(ids))
    new = cm.map_clients(mode, fn, shared, rows)
    return per_client.scatter(table, jnp.asarray(ids), new, jnp.asarray(weight) > 0).table

  out = round_(table)
  expected = {k: np.array(v) for k, v in table.items()}
  old = {k: np.array(v) for k, v in table.items()}
  s = np.asarray(shared)
  for i, w in zip(ids, weight):
    if w > 0:
      expected["w"][i] = 0.5 * old["w"][i] + s
      expected["b"][i] = old["b"][i] + s.sum()
  for k in expected:
    np.testing.assert_allclose(out[k], expected[k], rtol=1e-6)


@pytest.mark.parametrize("name, mode", diagonal(["scaffold", "feddyn", "ditto"], ["vmap", "chunked:16"]))
def test_rounds_update_the_table_in_place(name, mode):
  """A compiled run of rounds (a scan, state donated, as fo.train runs them) needs far less temporary memory than
  one copy of the [N, P] table: the round writes its C rows in place, so its cost does not grow with N."""
  n, c, d, k = 20_000, 64, 60, 10

  def loss(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]

  sgd = optax.sgd(0.05)
  algo = {"scaffold": lambda: fo.algorithms.scaffold(loss, 0.05, 1.0, num_clients=n, client_map=mode),
          "feddyn": lambda: fo.algorithms.feddyn(loss, 0.01, num_clients=n, client_optimizer=sgd, client_map=mode),
          "ditto": lambda: fo.algorithms.ditto(loss, 0.1, 0.05, num_clients=n, personal_steps=2, client_optimizer=sgd,
                                               client_map=mode)}[name]()
  state = algo.init({"w": jnp.zeros((d, k)), "b": jnp.zeros(k)}, jax.random.key(0))
  table_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if leaf.ndim and leaf.shape[0] == n)

  def run(state, ids):
    def one(state, round_ids):
      batches = fo.ClientBatches(data={"x": jnp.ones((c, 2, 5, d)), "y": jnp.zeros((c, 2, 5), jnp.int32)},
                                 mask=jnp.ones((c, 2, 5), bool), weight=jnp.full(c, 10.0), client_id=round_ids)
      return algo.step(state, batches), None
    return jax.lax.scan(one, state, ids)[0]

  ids = jnp.arange(3 * c, dtype=jnp.int32).reshape(3, c) * 97 % n
  temp = jax.jit(run, donate_argnums=0).lower(state, ids).compile().memory_analysis().temp_size_in_bytes
  assert temp < 0.25 * table_bytes, (temp, table_bytes)


def _scaffold_rounds(n, c, storage_dtype):
  def loss(params, batch):
    return 0.5 * jnp.sum(jnp.square(batch["x"] @ params["w"] - batch["y"]), -1)

  algo = fo.algorithms.scaffold(loss, 0.05, 1.0, num_clients=n, storage_dtype=storage_dtype)
  state = algo.init({"w": jnp.zeros((3, 2))}, jax.random.key(0))

  def one(state, k):
    kx, ki = jax.random.split(k)
    x = jax.random.normal(kx, (c, 2, 4, 3))
    batches = fo.ClientBatches(data={"x": x, "y": x[..., :2] * 2.0}, mask=jnp.ones((c, 2, 4), bool),
                               weight=jnp.full(c, 8.0), client_id=jax.random.randint(ki, (c,), 0, n))
    return algo.step(state, batches), None

  return state, one


# Table rows of the scan_rounds tests: large enough that a copy of the table shows in the compiled loop body.
N_ROUNDS_TABLE = 12_345


@functools.cache
def _compiled_rounds(scan, n, storage_dtype):
  """4 SCAFFOLD rounds of 8 clients over an [n, ...] table as `scan(one_round, state, keys)`, state donated, compiled
  once and shared by the tests that run it and those that read its compiled text."""
  state, one = _scaffold_rounds(n, 8, storage_dtype)
  keys = jax.random.split(jax.random.key(3), 4)
  return jax.jit(lambda s: scan(one, s, keys)[0], donate_argnums=0).lower(state).compile()


def test_scan_rounds_is_the_plain_scan_bit_for_bit():
  """16-bit leaves of the carry travel as bits: the result (tables, model, typed key, metrics) is unchanged."""
  n, dtype = N_ROUNDS_TABLE, jnp.bfloat16
  # Each run is given its own initial state (the programs donate it).
  want = _compiled_rounds(jax.lax.scan, n, dtype)(_scaffold_rounds(n, 8, dtype)[0])
  got = _compiled_rounds(per_client.scan_rounds, n, dtype)(_scaffold_rounds(n, 8, dtype)[0])
  assert got.client_control_variates["w"].dtype == jnp.bfloat16
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jax.dtypes.issubdtype(w.dtype, jax.dtypes.extended):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  assert not np.all(np.asarray(got.client_control_variates["w"], np.float32) == 0)  # the rounds did write rows


def _table_sized_ops_in_loop_body(scan, n, storage_dtype):
  """Instructions of the compiled while body whose result has the table's [N, ...] shape, other than the
  loop-carried value itself and the scatter that writes the round's rows."""
  text = _compiled_rounds(scan, n, storage_dtype).as_text()
  entry = text[text.index("\nENTRY"):]
  body_name = re.search(r"while\(.*?body=%?([\w.\-]+)", entry).group(1)  # the loop over rounds
  body = re.search(r"\n%?" + re.escape(body_name) + r" .*?\n}", text, re.S).group(0)
  ops = re.compile(r"= \w+\[" + str(n) + r",3,2\]\{[\d,]*\} ([\w-]+)\((.*)")
  found = [(m.group(1), m.group(2)) for m in map(ops.search, body.splitlines()[1:]) if m]
  return [f"{op}({rest[:80]}" for op, rest in found
          if op not in ("get-tuple-element", "parameter") and not re.search(r"calls=%?wrapped_scatter", rest)]


def test_scan_rounds_updates_a_bfloat16_table_in_place():
  """XLA:CPU copies a bfloat16 table every round under a plain scan (a bitcast or float conversion of all N
  rows); under scan_rounds the loop body touches the table only through the scatter of the round's rows."""
  n = N_ROUNDS_TABLE
  assert _table_sized_ops_in_loop_body(per_client.scan_rounds, n, jnp.bfloat16) == []
  assert _table_sized_ops_in_loop_body(per_client.scan_rounds, n, None) == []
  if jax.default_backend() == "cpu":  # the check above can see a copy: the plain scan makes one on XLA:CPU
    assert _table_sized_ops_in_loop_body(jax.lax.scan, n, jnp.bfloat16)
