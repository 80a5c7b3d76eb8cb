"""Sharing ADMM and GADMM / CQ-GGADMM through the round engine (`core.rounds.client_round`).

Their rounds keep their own rules under the engine's: every client (worker) takes part in every iteration whatever
its `weight` (a weight-0 row is not "absent", as it is for the averaging families), a non-finite one is frozen and
counted, and the client map (vmap, a loop, chunks) does not change the states.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from conftest import run_rounds

N, M, D = 4, 7, 3
MODES = ("vmap", "sequential", "chunked:3")


def _lsq(params, batch):
  return 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])


def _sharing_batches(rng, nan_client=None):
  x = rng.normal(size=(N, 1, M, 2)).astype(np.float32)
  if nan_client is not None:
    x[nan_client, 0, 1, 0] = np.nan
  y = np.tile(rng.normal(size=(1, 1, M)).astype(np.float32), (N, 1, 1))
  mask = np.ones((N, 1, M), bool)
  mask[:, :, -1] = False
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.ones(N), client_id=jnp.arange(N, dtype=jnp.int32))


def _worker_batches(rng, n, nan_worker=None):
  x = rng.normal(size=(n, 2, 4, D)).astype(np.float32)
  if nan_worker is not None:
    x[nan_worker, 1, 0, 0] = np.nan
  y = rng.normal(size=(n, 2, 4)).astype(np.float32)
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.ones((n, 2, 4), bool),
                          weight=jnp.ones(n), client_id=jnp.arange(n, dtype=jnp.int32))


def _run(algo, params, batches, steps=3):
  return run_rounds(algo.step, algo.init(params, jax.random.key(1)), batches, steps)[0]


def _assert_states_close(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      continue
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_sharing_admm_client_maps_agree_a_nan_client_is_frozen_and_weight_is_ignored():
  rng = np.random.default_rng(0)
  batches = _sharing_batches(rng, nan_client=2)
  x0 = jnp.asarray(rng.normal(size=(N, 2)), jnp.float32)
  states = [_run(fo.algorithms.admm_sharing(0.5, num_samples=M, l2=0.05, relaxation=1.5, client_map=mode), x0, batches)
            for mode in MODES]
  for state in states[1:]:
    _assert_states_close(states[0], state)
  state = states[0]
  assert int(state.metrics["num_nonfinite"]) == 1
  np.testing.assert_array_equal(np.asarray(state.params[2]), np.asarray(x0[2]))
  np.testing.assert_array_equal(np.asarray(state.share_offsets[2]), 0)
  np.testing.assert_array_equal(np.asarray(state.predictions[2]), 0)
  assert not np.array_equal(np.asarray(state.params[0]), np.asarray(x0[0]))
  # `weight` is ignored: a weight-0 client still takes part.
  unweighted = _run(fo.algorithms.admm_sharing(0.5, num_samples=M, l2=0.05, relaxation=1.5, client_map="vmap"), x0,
                    batches.replace(weight=jnp.zeros(N)))
  _assert_states_close(state, unweighted)


@pytest.mark.parametrize("method", ["gadmm", "cq_ggadmm"])
def test_group_admm_client_maps_agree_a_nan_worker_is_frozen_and_weight_is_ignored(method):
  rng = np.random.default_rng(1)
  graph = fo.graphs.random_bipartite(2, 3, 0.6, seed=2)
  n, bad = graph.num_nodes, 1
  batches = _worker_batches(rng, n, nan_worker=bad)
  params = {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.zeros((), jnp.float32)}

  def make(mode):
    if method == "gadmm":
      return fo.algorithms.gadmm(_lsq, 0.7, graph=graph, client_optimizer=optax.sgd(0.05), local_steps=2,
                                 client_map=mode)
    return fo.algorithms.cq_ggadmm(_lsq, 0.7, 0.05, 0.9, graph=graph, compressor=fo.compression.qsgd(4),
                                   client_optimizer=optax.sgd(0.05), local_steps=2, client_map=mode)

  states = [_run(make(mode), params, batches) for mode in MODES]
  for state in states[1:]:
    _assert_states_close(states[0], state)
  state = states[0]
  assert int(state.metrics["num_nonfinite"]) == 1
  for table in ([state.local_params] + ([state.transmitted] if method == "cq_ggadmm" else [])):
    for leaf, start in zip(jax.tree.leaves(table), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(leaf[bad]), np.asarray(start))
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      assert np.all(np.isfinite(np.asarray(leaf))), jax.tree_util.keystr(path)
  # `weight` is ignored: a weight-0 worker still updates.
  _assert_states_close(state, _run(make("vmap"), params, batches.replace(weight=jnp.zeros(n))))
