"""Packing clients into padded device arrays: round trips, splits, the memory rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_opt import data
from fedjax_opt.data import dataset as dataset_lib


def _clients(sizes, seed=0, dim=3):
  rng = np.random.default_rng(seed)
  out, start = [], 0
  for n in sizes:
    out.append({
        "x": rng.normal(size=(n, dim)),  # float64 on purpose
        "y": rng.integers(0, 7, n).astype(np.int64),
        "id": np.arange(start, start + n),
    })
    start += n
  return out


def _leaf_test_count(n, f):
  # LEAF / FedProx: train_len = int((1 - f) * n); we also keep one train example.
  if n <= 1 or f == 0:
    return 0
  return n - max(1, int((1 - f) * n + 1e-9))


def test_pack_then_unpack_returns_every_example_once():
  sizes = [5, 1, 12, 0, 7]
  clients = _clients(sizes)
  ds = data.pack(clients, test_fraction=0.25, seed=3)
  train, test = data.unpack(ds, "train"), data.unpack(ds, "test")
  for k, client in enumerate(clients):
    got = np.concatenate([train[k]["id"], test[k]["id"]])
    np.testing.assert_array_equal(np.sort(got), client["id"])
    assert len(test[k]["id"]) == _leaf_test_count(sizes[k], 0.25)
    order = np.argsort(client["id"])
    rows = np.concatenate([train[k]["x"], test[k]["x"]])[np.argsort(got)]
    np.testing.assert_allclose(rows, client["x"][order].astype(np.float32))


def test_counts_padding_and_dtypes():
  clients = _clients([3, 8, 2])
  ds = data.pack(clients)
  assert ds.num_clients == 3 and ds.n_max == 8 and ds.max_train == 8
  np.testing.assert_array_equal(ds.train_count, [3, 8, 2])
  assert ds.examples["x"].shape == (3, 9, 3)  # n_max + 1: a trailing zero slot in every row
  assert ds.examples["x"].dtype == jnp.float32 and ds.examples["y"].dtype == jnp.int32
  x = np.asarray(ds.examples["x"])
  assert np.all(x[0, 3:] == 0) and np.all(x[2, 2:] == 0) and np.all(x[:, ds.zero_index] == 0)
  assert ds.num_classes == max(int(c["y"].max()) for c in clients) + 1
  assert ds.padding_factor == pytest.approx(3 * 8 / 13)


def test_nbytes_counts_every_device_array():
  ds = data.pack(_clients([4, 6]), central_test={"x": np.zeros((5, 3)), "y": np.zeros(5, int), "id": np.arange(5)})
  expected = sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(ds))
  assert ds.nbytes == expected
  assert ds.nbytes >= 2 * 7 * (3 * 4 + 4 + 4)
  assert "MiB" in ds.summary()


def test_the_summary_header_counts_the_examples():
  """It read "2 clients, examples", the number missing."""
  sizes = [400, 1200]
  ds = data.pack(_clients(sizes), test_fraction=0.25, name="two")
  assert ds.summary().splitlines()[0] == f"FederatedDataset 'two': 2 clients, {sum(sizes):,} examples"
  streams = [np.arange(30) % 5, np.arange(25) % 5]
  windows = sum(len(s) - 8 for s in streams) - 2 * 8  # each stream's L windows before its test set are dropped
  text = data.pack_sequences(streams, 8, test_fraction=0.25, name="text")
  assert text.summary().splitlines()[0] == (f"FederatedDataset 'text': 2 clients, {windows} next-token windows of "
                                            f"length 8")


def test_dataset_is_a_pytree_that_passes_through_jit():
  ds = data.pack(_clients([4, 6]), client_names=["alice", "bob"], name="toy")
  total = jax.jit(lambda d: d.train_count.sum() + d.examples["id"].sum())(ds)
  assert int(total) == 10 + sum(range(10))
  out = jax.jit(lambda d: d)(ds)
  assert out.client_names == ("alice", "bob") and out.name == "toy" and out.max_train == 6
  # Static metadata is not a leaf.
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(ds))


def test_random_split_is_seeded_and_ordered_split_takes_the_last_examples():
  clients = _clients([20, 30])
  a = data.unpack(data.pack(clients, test_fraction=0.3, seed=1), "test")
  b = data.unpack(data.pack(clients, test_fraction=0.3, seed=1), "test")
  c = data.unpack(data.pack(clients, test_fraction=0.3, seed=2), "test")
  np.testing.assert_array_equal(a[1]["id"], b[1]["id"])
  assert not np.array_equal(a[1]["id"], c[1]["id"])
  ordered = data.unpack(data.pack(clients, test_fraction=0.3, split="ordered"), "test")
  np.testing.assert_array_equal(ordered[0]["id"], clients[0]["id"][-6:])


def test_given_test_clients_are_kept_apart():
  train, test = _clients([4, 5], seed=0), _clients([2, 0], seed=1)
  ds = data.pack(train, test_clients=test)
  np.testing.assert_array_equal(ds.test_count, [2, 0])
  np.testing.assert_array_equal(data.unpack(ds, "test")[0]["id"], test[0]["id"])
  with pytest.raises(ValueError, match="not both"):
    data.pack(train, test_clients=test, test_fraction=0.1)


def test_padding_beyond_the_factor_is_refused_naming_the_largest_client():
  clients = _clients([1000] + [2] * 49)
  names = ["whale"] + [f"minnow{i}" for i in range(49)]
  with pytest.raises(ValueError) as err:
    data.pack(clients, client_names=names, max_padding_factor=4.0)
  message = str(err.value)
  assert "whale" in message and "max_padding_factor" in message and "split" in message
  assert f"{50 * 1000 / 1098:.1f}x" in message and "\n" not in message
  ds = data.pack(clients, client_names=names, max_padding_factor=None)
  assert ds.padding_factor == pytest.approx(50 * 1000 / 1098)


@pytest.mark.parametrize("clients, match", [
    ({"x": np.zeros(3)}, "list of per-client dicts"),
    ([], "empty"),
    ([{"x": np.zeros(3)}, {"z": np.zeros(3)}], r"keys \['z'\]"),
    ([{"x": np.zeros(3), "y": np.zeros(2)}], "different numbers of examples"),
    ([{"x": np.zeros((3, 2))}, {"x": np.zeros((3, 4))}], "example shape"),
    ([{"x": np.array(["a", "b"])}], "must hold numbers"),
])
def test_malformed_clients_are_rejected(clients, match):
  with pytest.raises((TypeError, ValueError), match=match):
    data.pack(clients)


def test_bad_options_are_rejected():
  clients = _clients([3, 4])
  with pytest.raises(ValueError, match="test_fraction"):
    data.pack(clients, test_fraction=1.0)
  with pytest.raises(ValueError, match="split"):
    data.pack(clients, split="sideways")
  with pytest.raises(ValueError, match="client_names"):
    data.pack(clients, client_names=["one"])
  with pytest.raises(ValueError, match="max_padding_factor"):
    data.pack(clients, max_padding_factor=0.5)
  with pytest.raises(ValueError, match="no examples"):
    data.pack([{"x": np.zeros((0, 2))}])


def test_token_streams_are_stored_once_and_cut_into_windows():
  rng = np.random.default_rng(0)
  streams = [rng.integers(0, 50, n).astype(np.uint8) for n in (40, 25, 61)]
  length = 8
  ds = data.pack_sequences(streams, length, test_fraction=0.25, num_classes=50)
  assert ds.examples["tokens"].dtype == jnp.uint8
  assert ds.examples["tokens"].shape == (3, 61 + length + 1)
  train, test = data.unpack(ds, "train"), data.unpack(ds, "test")
  for k, s in enumerate(streams):
    windows = np.lib.stride_tricks.sliding_window_view(s, length + 1)[: len(s) - length]
    n = len(windows)
    n_test = _leaf_test_count(n, 0.25)
    n_train = n - n_test - length  # the L windows before the test set are dropped
    np.testing.assert_array_equal(train[k]["x"], windows[:n_train, :length])
    np.testing.assert_array_equal(train[k]["y"], windows[:n_train, length])
    np.testing.assert_array_equal(test[k]["x"], windows[n - n_test:, :length])
    np.testing.assert_array_equal(test[k]["y"], windows[n - n_test:, length])
    # No test character sits inside a train window.
    last_train_char = n_train - 1 + length
    assert last_train_char < n - n_test


def test_too_short_token_stream_is_named():
  with pytest.raises(ValueError, match=r"token_streams\[1\]"):
    data.pack_sequences([np.arange(30), np.arange(5)], 8)


def test_num_test_examples_matches_leaf_rule():
  for n in range(0, 60):
    for f in (0.0, 0.1, 0.2, 0.5, 0.9):
      assert dataset_lib.num_test_examples(n, f) == _leaf_test_count(n, f)
