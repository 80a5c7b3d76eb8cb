"""The mixture families (L2GD, L2SGD, L2SGD+, mixture ADMM) through `core.rounds.client_round`.

Their round is the library's one round without an aggregator, with every client taking part every iteration
(full participation: `weight` and an empty data set do not take a client out). These tests pin what the port
must keep: the client map does not change the states; a client whose gradient is not finite sits the iteration
out even when its new x_i would be finite (an aggregation step of L2GD does not read the gradient) and is
counted; `weight` is ignored; deferred data (gathered per chunk inside a client loop) gives the same states.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.algorithms.mixture import l2gd, l2sgd, l2sgd_plus
from fedjax_opt.algorithms.mixture_admm import mixture_admm
from fedjax_opt.core.types import DeferredData

C, S, B, D = 5, 2, 3, 4
STEPS = 8


def quad_loss(w, batch):
  return 0.5 * jnp.square(batch["x"] @ w["w"] + w["b"] - batch["y"])


FACTORIES = {
    "l2gd": lambda m: l2gd(quad_loss, 1.0, 0.5, 0.5, num_clients=C, client_map=m),
    "l2sgd": lambda m: l2sgd(quad_loss, 1.0, 0.5, 0.5, num_clients=C, client_map=m),
    "l2sgd_plus": lambda m: l2sgd_plus(quad_loss, 1.0, 0.5, 0.5, num_clients=C, num_examples=S * B, client_map=m),
    "l2sgd_plus_efficient": lambda m: l2sgd_plus(quad_loss, 1.0, 0.5, 0.5, num_clients=C, num_examples=S * B,
                                                 variant="efficient", client_map=m),
    "mixture_admm": lambda m: mixture_admm(quad_loss, 0.5, 2.0, num_clients=C, client_optimizer=optax.sgd(0.1),
                                           local_steps=3, client_map=m),
}


def _batches(nan_client=None, weight=None):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(C, S, B, D)).astype(np.float32)
  y = rng.normal(size=(C, S, B)).astype(np.float32)
  mask = np.ones((C, S, B), bool)
  mask[1, -1] = False  # client 1's last step is padding
  mask[3] = False  # client 3 has no data this iteration
  if nan_client is not None:
    x[nan_client] = np.nan
  w = np.full(C, 6.0, np.float32) if weight is None else np.asarray(weight, np.float32)
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray(w), client_id=jnp.asarray([4, 0, 2, 1, 3], jnp.int32))


def _params():
  return {"w": jnp.asarray(np.linspace(-0.5, 0.5, D), jnp.float32), "b": jnp.asarray(0.1, jnp.float32)}


def _path(algo, batches, steps=STEPS):
  """Every state of a jitted scan of `steps` iterations (leaves `[steps, ...]`)."""
  body = lambda s, _: (lambda t: (t, t))(algo.step(s, batches))
  return jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps)[1])(algo.init(_params(), jax.random.key(3)))


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # the maps compile each family twice; the NaN test below runs the round in the default tier
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_sequential_and_vmap_give_the_same_states(name):
  _close(_path(FACTORIES[name]("sequential"), _batches()), _path(FACTORIES[name]("vmap"), _batches()))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_nan_client_is_dropped_and_counted_whatever_the_coin(name):
  """Client 2 (slot 2) has NaN in every example: at every iteration, local or aggregation step, it keeps its
  initial row, is counted once in num_nonfinite, and every state stays finite."""
  path = _path(FACTORIES[name]("vmap"), _batches(nan_client=2))
  np.testing.assert_array_equal(np.asarray(path.metrics["num_nonfinite"]), np.ones(STEPS, np.int32))
  if "aggregated" in path.metrics:
    coins = np.asarray(path.metrics["aggregated"])
    assert coins.any() and not coins.all(), coins  # both kinds of step were taken
  for leaf in jax.tree.leaves(path.local_params):
    assert np.isfinite(np.asarray(leaf)).all()
    np.testing.assert_array_equal(np.asarray(leaf)[:, 2], np.broadcast_to(np.asarray(leaf)[0, 2], leaf[:, 2].shape))
  np.testing.assert_array_equal(np.asarray(path.local_params["b"])[:, 2], np.float32(0.1))  # its start


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_weight_is_ignored_and_a_client_without_data_takes_part(name):
  """A zero weight (and, for client 3, no data at all) does not take a client out of a full-participation round:
  the states equal those with every weight 1, and client 3 (slot 4) still moves (towards x̄)."""
  zero = _path(FACTORIES[name]("vmap"), _batches(weight=[6.0, 0.0, 6.0, 6.0, 0.0]))
  _close(zero, _path(FACTORIES[name]("vmap"), _batches(weight=np.ones(C))))
  moved = np.abs(np.asarray(zero.local_params["w"])[-1, 3] - np.asarray(_params()["w"])).max()
  assert moved > 1e-4, moved


def _take(source, refs):
  return jax.tree.map(lambda a: a[refs], source)


@pytest.mark.parametrize("name", ["l2gd", "mixture_admm"])
def test_deferred_data_gives_the_same_states(name):
  """L2GD and mixture ADMM keep the round's data deferred: a client loop gathers each client's examples itself."""
  batches = _batches()
  deferred = batches.replace(data=DeferredData(batches.data, jnp.arange(C), _take))
  _close(_path(FACTORIES[name]("sequential"), deferred), _path(FACTORIES[name]("vmap"), batches))
