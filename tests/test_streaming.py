"""Streaming aggregation: loop modes add each client's update to one running sum instead of stacking C updates.

The stacked round (`vmap`) is the reference: every algorithm with an
`aggregator=` gives the same state under `sequential` and `chunked:3` (4
clients: one chunk of 3 and a remainder of 1), with the mean and the
weighted mean (algorithms × (aggregator, loop mode): the diagonal in the
default tier, every cell in the slow tier), including a client whose update is NaN and a
client with no data. Then: the loop really streams (the stacked `aggregate` is never
called), and a streaming round's compiled memory does not grow with C.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from algorithm_examples import EXAMPLES, N, example_inputs, loss_fn
from conftest import diagonal

import fedjax_opt as fo
from fedjax_opt.core import client_map as cm

A = fo.aggregators
WITH_AGGREGATOR = sorted(name for name in EXAMPLES
                         if "aggregator" in inspect.signature(getattr(fo.algorithms, name)).parameters)


def _batches(name):
  """Client 1's data holds a NaN, client 2 has no example this round (it takes no step)."""
  params, batches = example_inputs(name, poisoned=1)
  mask = np.asarray(batches.mask).copy()
  mask[2] = False
  return params, batches.replace(mask=jnp.asarray(mask))


ROUNDS = {"one_shot_average": 1}
"""Rounds per factory: one-shot averaging exchanges in its first round only (a second sends nothing, metrics 0)."""


@functools.cache
def _run(name, mode, aggregator, rounds=2):
  """The state after `rounds` rounds of `EXAMPLES[name]` with `fo.aggregators.<aggregator>()` and client map
  `mode` on `_batches(name)`; cached, so the slow tier's cells share their stacked reference."""
  algo = EXAMPLES[name](aggregator=getattr(A, aggregator)(), client_map=mode)
  params, batches = _batches(name)
  state = algo.init(params, jax.random.key(0))
  step = jax.jit(algo.step)
  for _ in range(rounds):
    state = step(state, batches)
  return state


def test_every_algorithm_with_an_aggregator_is_covered():
  assert {"fedavg", "fedprox", "scaffold", "fednova", "feddyn", "ditto", "pfedme"} <= set(WITH_AGGREGATOR)


# (aggregator, loop mode): every pair, against the stacked round with the same aggregator.
LOOPS = [("mean", "sequential"), ("weighted_mean", "chunked:3"), ("weighted_mean", "sequential"), ("mean", "chunked:3")]


# algorithms × (aggregator, loop mode): the diagonal (each algorithm streams in one loop mode with one aggregator,
# each pair is taken by several algorithms) in the default tier, every cell in the slow tier.
@pytest.mark.parametrize("name,loop", diagonal(WITH_AGGREGATOR, LOOPS),
                         ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_loop_modes_stream_to_the_same_state_as_the_stacked_round(name, loop):
  aggregator, mode = loop
  rounds = ROUNDS.get(name, 2)
  want = _run(name, "vmap", aggregator, rounds)
  assert int(want.metrics["num_nonfinite"]) == 1 and int(want.metrics["num_clients"]) == N - 2
  got = _run(name, mode, aggregator, rounds)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    if jnp.issubdtype(jnp.asarray(a).dtype, jax.dtypes.prng_key):
      continue
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6,
                               err_msg=f"{name} {mode} {jax.tree_util.keystr(path)}")


def _forbidden_stacked(streaming_of):
  """An aggregator whose stacked `aggregate` fails the test if called: only its streaming form may run."""

  def aggregate(updates, weights, state, key):
    raise AssertionError("the stacked aggregate ran")

  return A.Aggregator(lambda params: (), aggregate, streaming_of.streaming)


def test_loop_modes_never_stack_and_vmap_does():
  """Which form runs is decided while the step is traced: `jax.eval_shape` traces it (and compiles nothing)."""
  params, batches = _batches("fedavg")
  for mode in ("sequential", "chunked:2", "chunked:3"):
    algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.01), aggregator=_forbidden_stacked(A.mean()),
                                client_map=mode)
    jax.eval_shape(algo.step, algo.init(params, jax.random.key(0)), batches)  # no AssertionError
  algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.01), aggregator=_forbidden_stacked(A.mean()),
                              client_map="vmap")
  with pytest.raises(AssertionError, match="the stacked aggregate ran"):
    jax.eval_shape(algo.step, algo.init(params, jax.random.key(0)), batches)
  # A rule without a streaming form (it needs every update) keeps the stacked form in a loop mode.
  assert A.marginal_median().streaming is None
  assert cm.loop_chunk("chunked:2", lambda s, c: c, None, jnp.zeros((4, 1))) is not None
  assert cm.loop_chunk("vmap", lambda s, c: c, None, jnp.zeros((4, 1))) is None
  assert cm.loop_chunk("chunked:4", lambda s, c: c, None, jnp.zeros((4, 1))) is None  # one chunk: no loop


def test_map_clients_and_sum_against_numpy():
  """Stacked outputs in client order and the sum over clients, for chunk sizes that do and do not divide C."""
  x = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
  fn = lambda s, row: ({"double": 2 * row, "first": row[0]}, s * row)
  chunk_sizes = (1, 2, 3, 7 - 1)
  # Every chunk size in one program (eagerly, each size's loop would compile on its own).
  every_k = jax.jit(lambda s, xs: [cm.map_clients_and_sum((cm.Chunked(k), k), fn, s, xs) for k in chunk_sizes])
  for stacked, total in every_k(np.float32(1.5), x):
    np.testing.assert_allclose(stacked["double"], 2 * x, rtol=1e-6)
    np.testing.assert_allclose(stacked["first"], x[:, 0], rtol=1e-6)
    np.testing.assert_allclose(total, 1.5 * x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-6)


def _wide_loss(params, batch):
  """Least squares of a [d, m] linear map: P = d·m parameters from d = 10 features (the data stay small)."""
  return 0.5 * jnp.mean(jnp.square(batch["x"] @ params["w"] - batch["y"][:, None]), axis=1)


def _round_temp_bytes(c, aggregator, d=10, m=2_000):
  """XLA's temporary buffers for one FedAvg round of C clients, P = d·m parameters, sequential client map.

  Compiled from shapes alone (`jax.ShapeDtypeStruct`s, the state's from `jax.eval_shape`): nothing runs.
  """
  shape = lambda *dims, dtype=jnp.float32: jax.ShapeDtypeStruct(dims, dtype)
  params = {"w": shape(d, m)}
  batches = fo.ClientBatches(data={"x": shape(c, 2, 3, d), "y": shape(c, 2, 3)}, mask=shape(c, 2, 3, dtype=bool),
                             weight=shape(c), client_id=shape(c, dtype=jnp.int32))
  algo = fo.algorithms.fedavg(_wide_loss, client_optimizer=optax.sgd(0.01), aggregator=aggregator,
                              client_map="sequential")
  state = jax.eval_shape(algo.init, params, jax.random.key(0))
  return jax.jit(algo.step).lower(state, batches).compile().memory_analysis().temp_size_in_bytes


def test_a_streaming_round_does_not_grow_with_the_clients_and_a_stacked_one_does():
  p = 20_000
  stacked = A.Aggregator(A.mean().init, A.mean().aggregate)  # the same rule without its streaming form
  grow_stacked = _round_temp_bytes(256, stacked) - _round_temp_bytes(32, stacked)
  grow_streaming = _round_temp_bytes(256, A.mean()) - _round_temp_bytes(32, A.mean())
  assert grow_stacked >= 224 * p * 4  # at least the [C, P] float32 updates
  assert grow_streaming < 0.05 * 224 * p * 4, grow_streaming
