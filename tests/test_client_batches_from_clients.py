"""`fo.ClientBatches.from_clients`: per-client arrays packed into one round, against the NumPy packing of
`tests/conftest.py` (`pack`) and slot-by-slot NumPy reads; its refusals, one line each."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from tests.conftest import pack


def _clients(rng, sizes, d=3):
  return [(rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, 4, n).astype(np.int32)) for n in sizes]


def _same_round(got, want):
  """Equal mask, weight and ids; equal data on every real slot, zeros on padding."""
  np.testing.assert_array_equal(got.mask, want.mask)
  np.testing.assert_array_equal(got.weight, want.weight)
  np.testing.assert_array_equal(got.client_id, want.client_id)
  assert got.weight.dtype == jnp.float32 and got.client_id.dtype == jnp.int32 and got.mask.dtype == jnp.bool_
  mask = np.asarray(want.mask)
  for key in ("x", "y"):
    g, w = np.asarray(got.data[key]), np.asarray(want.data[key])
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(g[mask], w[mask])
    assert not np.any(g[~mask])  # padding holds zeros


def test_from_clients_equals_the_numpy_packing_with_the_default_steps(rng):
  clients = _clients(rng, [7, 12, 1, 0])  # an empty client: no slot, weight 0
  got = fo.ClientBatches.from_clients([{"x": x, "y": y} for x, y in clients], batch_size=5)
  assert (got.num_clients, got.local_steps, got.batch_size) == (4, 3, 5)  # ceil(12 / 5) steps hold everyone
  _same_round(got, pack(clients, 3, 5))
  np.testing.assert_array_equal(got.weight, [7, 12, 1, 0])


def test_more_steps_than_the_data_pad_and_fewer_steps_keep_the_first_examples_and_weight_n_k(rng):
  clients = _clients(rng, [7, 12, 3])
  more = fo.ClientBatches.from_clients([{"x": x, "y": y} for x, y in clients], batch_size=4, steps=5)
  _same_round(more, pack(clients, 5, 4))
  assert not np.any(np.asarray(more.mask)[:, 3:])  # 12 examples fill 3 steps of 4: the last two are padding
  fewer = fo.ClientBatches.from_clients([{"x": x, "y": y} for x, y in clients], batch_size=4, steps=2)
  truncated = [(x[:8], y[:8]) for x, y in clients]  # the first S·B = 8 examples of each client, in order
  _same_round(fewer, pack(truncated, 2, 4, weights=[7, 12, 3]))  # weight: the client's n_k, not the 8 used


def test_any_pytree_of_leaves_with_trailing_shapes_and_given_ids_and_weights(rng):
  images = [rng.normal(size=(n, 2, 3)).astype(np.float32) for n in (3, 5)]
  extra = [rng.integers(0, 9, size=(n, 4)) for n in (3, 5)]
  clients = [(im, {"tag": ex}) for im, ex in zip(images, extra)]
  got = fo.ClientBatches.from_clients(clients, batch_size=2, client_ids=[7, 2], weights=[0.5, 0.0])
  im, rest = got.data
  assert im.shape == (2, 3, 2, 2, 3) and rest["tag"].shape == (2, 3, 2, 4)
  for k in range(2):
    for i in range(len(images[k])):  # example i of client k sits in step i // B, slot i % B
      np.testing.assert_array_equal(im[k, i // 2, i % 2], images[k][i])
      np.testing.assert_array_equal(rest["tag"][k, i // 2, i % 2], extra[k][i])
  np.testing.assert_array_equal(got.client_id, [7, 2])
  np.testing.assert_array_equal(got.weight, [0.5, 0.0])
  fo.core.validation.check_client_batches(got)


def test_a_round_of_fedavg_on_from_clients_is_the_round_on_the_numpy_packing(rng):
  clients = _clients(rng, [6, 2, 9])
  model = fo.models.logistic_regression(3, 4)
  algorithm = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.1))
  state = algorithm.init(model.init(jax.random.key(0)), jax.random.key(1))
  step = jax.jit(algorithm.step)  # one program for both: the packings have the same shapes
  got = step(state, fo.ClientBatches.from_clients([{"x": x, "y": y} for x, y in clients], batch_size=4))
  want = step(state, pack(clients, 3, 4))
  assert step._cache_size() == 1
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("clients,kwargs,error,needle", [
    ({"x": np.zeros((2, 1))}, {}, TypeError, "clients must be a list of per-client pytrees"),
    ([], {}, ValueError, "clients is empty"),
    ([{"x": np.zeros((2, 1))}, {"z": np.zeros((2, 1))}], {}, ValueError, "clients[1] has structure"),
    ([{"x": np.zeros((2, 1)), "y": np.zeros(3)}], {}, ValueError,
     "the leaves of clients[0] must share their leading size n_k (examples); got {\"clients[0]['x']\": 2, "
     "\"clients[0]['y']\": 3}"),
    ([{"x": np.zeros((2, 1))}, {"x": np.zeros((2, 2))}], {}, ValueError,
     "clients[1]['x'] has example shape (2,); clients[0]['x'] has (1,)"),
    ([{"x": np.float32(1.0)}], {}, ValueError, "clients[0]['x'] must be a numeric array [n_k, ...] (examples first); "
                                               "got a scalar"),
    ([{"x": np.array(["a", "b"])}], {}, ValueError, "got dtype <U1"),
    ([{}], {}, ValueError, "clients[0] holds no arrays"),
    ([{"x": np.zeros((2, 1))}], {"batch_size": 0}, ValueError, "batch_size must be a Python int >= 1; got 0"),
    ([{"x": np.zeros((2, 1))}], {"batch_size": 2.0}, TypeError, "batch_size must be a Python int >= 1"),
    ([{"x": np.zeros((2, 1))}], {"steps": 0}, ValueError, "steps must be a Python int >= 1; got 0"),
    ([{"x": np.zeros((2, 1))}], {"client_ids": [0, 1]}, ValueError, "client_ids must be 1 integers >= 0"),
    ([{"x": np.zeros((2, 1))}], {"client_ids": [-1]}, ValueError, "client_ids must be 1 integers >= 0"),
    ([{"x": np.zeros((2, 1))}], {"client_ids": [0.5]}, ValueError, "client_ids must be 1 integers >= 0"),
    ([{"x": np.zeros((2, 1))}], {"weights": [-1.0]}, ValueError, "weights must be 1 finite numbers >= 0"),
    ([{"x": np.zeros((2, 1))}], {"weights": [np.nan]}, ValueError, "weights must be 1 finite numbers >= 0"),
    ([{"x": np.zeros((2, 1))}], {"weights": "all"}, ValueError, "weights must be 1 finite numbers >= 0"),
])
def test_inconsistent_inputs_are_refused_in_one_line(clients, kwargs, error, needle):
  kwargs = {"batch_size": 2, **kwargs}
  with pytest.raises(error) as info:
    fo.ClientBatches.from_clients(clients, **kwargs)
  message = str(info.value)
  assert needle in message and "\n" not in message, message
