"""`--dataset libsvm:PATH`: a user's LibSVM / svmlight file, split into clients like an embedded image dataset.

The file is read by `fo.data.read_svmlight` (labels mapped to 0 … L−1 in
sorted order, so −1/+1 become 0/1; features dense, one-based indices unless an
index 0 occurs) and split by `fo.data.federate` with the run's `--partition`
(default dirichlet, `--alpha` 0.5), `--num-clients` (default
`DEFAULT_NUM_CLIENTS`) and `--seed`; each client keeps 20 % of its examples
for test. A missing file is refused when the configuration is checked, a
malformed one when the run loads it, before anything is written: one line,
the reader's own message.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["DEFAULT_NUM_CLIENTS", "PREFIX", "dataset_info", "is_file_dataset", "load", "path_of", "run_name"]

PREFIX = "libsvm:"
DEFAULT_NUM_CLIENTS = 10
"""Clients of a LibSVM file when --num-clients is not given."""


def is_file_dataset(name: Any) -> bool:
  """Whether `--dataset` names a file (`libsvm:PATH`) rather than an embedded dataset."""
  return isinstance(name, str) and name.startswith(PREFIX)


def path_of(name: str) -> str:
  """PATH of `libsvm:PATH`, with `~` expanded."""
  return os.path.expanduser(name[len(PREFIX):])


def run_name(name: str) -> str:
  """The dataset's part of the default run folder `runs/<name>-<time>` (a file: its base name)."""
  if not is_file_dataset(name):
    return name
  return os.path.basename(path_of(name).rstrip(os.sep)) or "libsvm"


def dataset_info(name: str) -> dict[str, Any]:
  """`{name: DatasetInfo}` for `libsvm:PATH` once the file is found ({} for any other name); UsageError else."""
  if not is_file_dataset(name):
    return {}
  from fedjax_opt import data
  from fedjax_opt.cli.config import UsageError

  path = path_of(name)
  if not path:
    raise UsageError(f"--dataset {name}: give the file, e.g. --dataset libsvm:data/heart_scale")
  if not os.path.isfile(path):
    what = "is a folder, not a file" if os.path.isdir(path) else "no such file"
    raise UsageError(f"--dataset {name}: {path}: {what}")
  return {name: data.DatasetInfo(name, "a LibSVM / svmlight file", "", True,
                                 f"{DEFAULT_NUM_CLIENTS} clients, Dirichlet(0.5) label skew (--partition, "
                                 f"--num-clients)", DEFAULT_NUM_CLIENTS, "dirichlet")}


def load(config: dict[str, Any]):
  """The `FederatedDataset` of `--dataset libsvm:PATH` as the configuration splits it; UsageError in one line."""
  import numpy as np

  from fedjax_opt import data
  from fedjax_opt.cli.config import UsageError, flag_names

  name = config["dataset"]
  try:
    arrays = data.read_svmlight(path_of(name))
  except (OSError, ValueError) as e:
    raise UsageError(f"--dataset {name}: {str(e).splitlines()[0]}") from None
  classes = int(np.max(arrays["y"])) + 1
  if classes < 2:
    raise UsageError(f"--dataset {name}: every example has the same label; a classifier needs two labels or more")
  options = dict(partition=config["partition"], num_clients=config["num_clients"], seed=config["seed"])
  if config["partition"] == "dirichlet":
    options["alpha"] = config["alpha"]
  try:
    return data.federate(data.CentralizedData({"x": arrays["x"], "y": arrays["y"]}, None, classes),
                         name=run_name(name), **options)
  except ValueError as e:
    raise UsageError(f"cannot split {name!r} as asked: {flag_names(str(e).splitlines()[0])}") from None
