"""Readers for the dataset files users already have; nothing is downloaded.

Federated layouts (one entry per client), returned as `ClientData`:

* LEAF JSON (Caldas et al., "LEAF: A Benchmark for Federated Settings",
  arXiv:1812.01097): `{"users": [...], "num_samples": [...], "user_data":
  {user: {"x": [...], "y": [...]}}}`, as for FEMNIST, Shakespeare, Sent140
  and FedProx's synthetic sets. Shakespeare's strings are encoded with LEAF's
  vocabulary; other non-numeric data (Sent140's raw tweets) need a
  `transform`.
* TFF / FedJAX HDF5: `examples/<client>/<feature>` datasets (h5py imported
  inside the reader; `pip install "fedjax_opt[hdf5]"`).
* NumPy `.npz` with keys `"<client>/<feature>"` (`write_npz` writes it).

Centralized layouts, returned as dicts of arrays (partition them with
`fedjax_opt.data.partition`):

* LibSVM / svmlight text (`label [qid:q] index:value ...`), parsed here;
* IDX (LeCun et al.'s MNIST format, also EMNIST and Fashion-MNIST), raw or gzip.

Every reader rejects a malformed file with a one-line ValueError that starts
with the file name and says what is wrong. A feature value that is NaN or
±Inf, or too large for float32 (which it would become), is such a problem:
text files name the line (LibSVM) or the client and example (LEAF JSON),
binary files the client and example (HDF5, `.npz`) or the example (IDX).
Only `load_leaf(..., drop_nonfinite=True)` drops such examples instead.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from fedjax_opt.data.dataset import FederatedDataset, check_labels, check_num_classes, pack
from fedjax_opt.data.shakespeare import LEAF_VOCAB, encode

__all__ = ["ClientData", "EXAMPLES", "example_path", "load_leaf", "load_tff_hdf5", "read_idx", "read_idx_images",
           "read_leaf_json", "read_npz", "read_svmlight", "read_tff_hdf5", "write_npz"]

Transform = Callable[[dict[str, Any]], Mapping[str, Any]]


class ClientData(NamedTuple):
  """Per-client arrays read from a federated file.

  Attributes:
    clients: one dict `{feature: array [n_k, ...]}` per client.
    client_names: the clients' ids in the file.
  """

  clients: list[dict[str, np.ndarray]]
  client_names: tuple[str, ...]


def _fail(path: Any, problem: str) -> ValueError:
  return ValueError(f"{os.fspath(path)}: {' '.join(str(problem).split())}")


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _first_nonfinite(a: np.ndarray) -> tuple[int, Any, float] | None:
  """(example, index within the example, value) of the first NaN or ±Inf of `a` `[n, ...]`; None when every value is
  finite (integer and boolean arrays always are). The index is an int for `[n, d]`, a tuple for more axes."""
  a = np.asarray(a)
  if a.dtype.kind not in "fc" or a.ndim == 0 or a.size == 0:
    return None
  flat = a.reshape(len(a), -1)
  finite = np.isfinite(flat)
  if finite.all():
    return None
  i = int(np.argmin(finite.all(axis=1)))
  j = int(np.argmin(finite[i]))
  index = j if a.ndim <= 2 else tuple(int(t) for t in np.unravel_index(j, a.shape[1:]))
  return i, index, flat[i, j].item()


def _nonfinite_place(key: str | None, a: np.ndarray, index: Any, value: float) -> str:
  """`'x' holds nan at feature index 3` (`'y' is inf` for a 1-D array; without a key, `holds ...` / `is ...`)."""
  name = "" if key is None else f"'{key}' "
  return f"{name}is {value}" if a.ndim == 1 else f"{name}holds {value} at feature index {index}"


def _check_finite_clients(clients: Sequence[Mapping[str, np.ndarray]], names: Sequence[str], path: Any) -> None:
  """Refuses the first NaN or ±Inf of any client's float arrays, naming the client, the example and the index."""
  for arrays, name in zip(clients, names):
    for key, a in arrays.items():
      found = _first_nonfinite(a)
      if found is not None:
        i, index, value = found
        raise _fail(path, f"client '{name}' example {i}: {_nonfinite_place(key, a, index, value)}; every value must "
                          f"be a finite number (a value beyond float32's range becomes inf): clean the data.")


def _numeric(values: Any, path: Any, where: str, *, labels: bool = False) -> np.ndarray:
  """Converts to a numeric array or raises a one-line error naming file and place."""
  try:
    a = np.asarray(values)
  except ValueError:
    raise _fail(path, f"{where} is ragged (rows of different lengths).") from None
  if a.dtype == object:
    first = next(iter(a.flat), None)
    if not isinstance(first, (str, bytes)):
      raise _fail(path, f"{where} is ragged or mixes types.")
  if a.dtype == object or a.dtype.kind not in "biuf":
    what = "labels" if labels else "values"
    raise _fail(path, f"{where} has non-numeric {what} (dtype {a.dtype}); pass transform= to convert them.")
  if a.dtype.kind == "f":
    if labels and a.size and np.all(np.isfinite(a)) and np.all(a == np.round(a)):
      return a.astype(np.int32)
    with np.errstate(over="ignore"):  # a value beyond float32's range becomes inf, which the readers refuse
      return a.astype(np.float32)
  if a.dtype.kind == "b":
    return a
  return a.astype(np.int32)


def _check_client(arrays: Mapping[str, np.ndarray], path: Any, where: str) -> dict[str, np.ndarray]:
  lengths = {k: (v.shape[0] if v.ndim else None) for k, v in arrays.items()}
  if None in lengths.values() or len(set(lengths.values())) > 1:
    raise _fail(path, f"{where} features have different numbers of examples: {lengths}.")
  return dict(arrays)


def _check_consistent(clients: Sequence[Mapping[str, np.ndarray]], names: Sequence[str], path: Any) -> None:
  if not clients:
    raise _fail(path, "holds no clients.")
  ref_keys = sorted(clients[0])
  for arrays, name in zip(clients, names):
    if sorted(arrays) != ref_keys:
      raise _fail(path, f"client '{name}' has features {sorted(arrays)}; client '{names[0]}' has {ref_keys}.")
    for key in ref_keys:
      if arrays[key].shape[1:] != clients[0][key].shape[1:]:
        raise _fail(path, f"client '{name}' feature '{key}' has example shape {arrays[key].shape[1:]}; "
                    f"client '{names[0]}' has {clients[0][key].shape[1:]}.")


# ----------------------------------------------------------------------------
# LEAF JSON.
# ----------------------------------------------------------------------------


def _leaf_strings(values: list[Any], path: Any, where: str, *, labels: bool) -> np.ndarray | None:
  """Shakespeare's layout: strings of characters -> LEAF vocabulary indices."""
  if not values or not all(isinstance(v, str) for v in values):
    return None
  if labels and not all(len(v) == 1 for v in values):
    return None
  lengths = {len(v) for v in values}
  if len(lengths) != 1:
    raise _fail(path, f"{where} is ragged (strings of lengths {sorted(lengths)[:5]}).")
  if any(c not in LEAF_VOCAB for v in values for c in v):
    return None
  codes = np.stack([encode(v) for v in values]).astype(np.int32)
  return codes[:, 0] if labels else codes


def _leaf_user(raw: Any, user: str, path: Any, transform: Transform | None) -> dict[str, np.ndarray]:
  if not isinstance(raw, Mapping) or "x" not in raw or "y" not in raw:
    found = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
    raise _fail(path, f"user_data['{user}'] must have keys 'x' and 'y'; found {found}.")
  if transform is not None:
    arrays = {k: _numeric(v, path, f"user_data['{user}']['{k}'] after transform", labels=(k == "y"))
              for k, v in transform(dict(raw)).items()}
    return _check_client(arrays, path, f"user_data['{user}']")
  xs, ys = raw["x"], raw["y"]
  if not isinstance(xs, list) or not isinstance(ys, list):
    raise _fail(path, f"user_data['{user}'] 'x' and 'y' must be lists.")
  if len(xs) != len(ys):
    raise _fail(path, f"user_data['{user}'] has {len(xs)} x but {len(ys)} y.")
  x = _leaf_strings(xs, path, f"user_data['{user}']['x']", labels=False)
  if x is None:
    x = _numeric(xs, path, f"user_data['{user}']['x']")
  y = _leaf_strings(ys, path, f"user_data['{user}']['y']", labels=True)
  if y is None:
    y = _numeric(ys, path, f"user_data['{user}']['y']", labels=True)
  return {"x": x, "y": y}


def _leaf_files(path: Any) -> list[str]:
  path = os.fspath(path)
  if os.path.isdir(path):
    files = sorted(glob.glob(os.path.join(path, "*.json")))
    if not files:
      raise FileNotFoundError(f"{path}: no *.json files in this folder.")
    return files
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such file.")
  return [path]


def _read_leaf_file(path: str, transform: Transform | None,
                    skip_empty: bool = False) -> tuple[list[str], list[dict[str, np.ndarray]]]:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except json.JSONDecodeError as err:
    raise _fail(path, f"not valid JSON ({err.msg} at line {err.lineno}).") from None
  if not isinstance(data, Mapping) or "users" not in data or "user_data" not in data:
    found = sorted(data) if isinstance(data, Mapping) else type(data).__name__
    raise _fail(path, f"not LEAF JSON: needs keys 'users', 'num_samples', 'user_data'; found {found}.")
  users = data["users"]
  user_data = data["user_data"]
  if not isinstance(users, list) or not isinstance(user_data, Mapping):
    raise _fail(path, "'users' must be a list and 'user_data' a mapping.")
  num_samples = data.get("num_samples")
  if num_samples is not None and (not isinstance(num_samples, list) or len(num_samples) != len(users)):
    raise _fail(path, f"'num_samples' must list one count per user ({len(users)} users).")
  names, clients = [], []
  for i, user in enumerate(users):
    user = str(user)
    if user not in user_data:
      raise _fail(path, f"user '{user}' is listed in 'users' but missing from 'user_data'.")
    arrays = _leaf_user(user_data[user], user, path, transform)
    n = len(next(iter(arrays.values())))
    if num_samples is not None and int(num_samples[i]) != n:
      raise _fail(path, f"num_samples says user '{user}' has {num_samples[i]} examples; user_data has {n}.")
    if n == 0:
      if skip_empty:
        continue
      raise _fail(path, f"client '{user}' has no examples; remove it from 'users' and 'user_data'.")
    names.append(user)
    clients.append(arrays)
  return names, clients


def read_leaf_json(path: Any, *, transform: Transform | None = None) -> ClientData:
  """Reads a LEAF JSON file, or every `*.json` in a folder (users merged).

  Args:
    path: a LEAF `.json` file or a folder of them (e.g. `data/train`).
    transform: optional function applied to each user's raw `{"x": list, "y": list}`
      that returns numeric arrays, e.g. to tokenize Sent140's tweets.

  Returns:
    `ClientData`, clients `{"x": [n_k, ...], "y": [n_k]}` in file order; integral
    labels become int32, floats float32, Shakespeare strings LEAF indices.

  Raises:
    ValueError: `"<file>: <problem>"` for wrong keys, counts that disagree,
      ragged or non-numeric data, a user listed twice, a user without
      examples (`client 'u9' has no examples`), or a value that is NaN or
      ±Inf (`client 'u1' example 1: 'x' holds nan at feature index 1`;
      `load_leaf(..., drop_nonfinite=True)` drops such examples instead).
  """
  return _read_leaf(path, transform, drop_nonfinite=None)[0]


def _read_leaf(path: Any, transform: Transform | None, skip_empty: bool = False,
               drop_nonfinite: bool | None = False) -> tuple[ClientData, dict[str, int]]:
  """`read_leaf_json` and the examples dropped per client.

  `skip_empty` leaves out the users without examples (a test file's) instead of refusing them. Examples that hold
  NaN or ±Inf are dropped (`drop_nonfinite` True; see `_nonfinite`) or refused, naming the file they are in and
  what drops them: `load_leaf`'s argument (False) or `load_leaf` itself (None, for `read_leaf_json`).
  """
  names, clients, files = [], [], []
  for file in _leaf_files(path):
    file_names, file_clients = _read_leaf_file(file, transform, skip_empty)
    for name in file_names:
      if name in names:
        raise _fail(file, f"user '{name}' appears twice (also in an earlier file or entry).")
      names.append(name)
    clients.extend(file_clients)
    files.extend([file] * len(file_names))
  _check_consistent(clients, names, path)
  kept, kept_names, dropped = [], [], {}
  for file in dict.fromkeys(files):
    mine = [k for k, f in enumerate(files) if f == file]
    part, lost = _nonfinite(ClientData([clients[k] for k in mine], tuple(names[k] for k in mine)), file,
                            bool(drop_nonfinite), skip_empty, from_load_leaf=drop_nonfinite is not None)
    kept.extend(part.clients)
    kept_names.extend(part.client_names)
    dropped.update(lost)
  return ClientData(kept, tuple(kept_names)), dropped


def _align(test: ClientData, names: Sequence[str], ref: Mapping[str, np.ndarray], path: Any) -> list[dict]:
  by_name = dict(zip(test.client_names, test.clients))
  extra = set(by_name) - set(names)
  if extra:
    raise _fail(path, f"test users {sorted(extra)[:3]} have no train data.")
  empty = {k: np.zeros((0,) + v.shape[1:], v.dtype) for k, v in ref.items()}
  return [by_name.get(name, empty) for name in names]


def _nonfinite(read: ClientData, path: Any, drop: bool, skip_empty: bool,
               from_load_leaf: bool = True) -> tuple[ClientData, dict[str, int]]:
  """Refuses (or, with `drop`, removes) the examples that hold NaN or Inf; returns (clients, dropped per client).

  A client left without examples is refused, or with `skip_empty` (a test file's) left out. The refusal says how to
  drop them instead: `drop_nonfinite=True` (`from_load_leaf`), else `load_leaf(..., drop_nonfinite=True)`.
  """
  how = "pass drop_nonfinite=True" if from_load_leaf else "read it with load_leaf(..., drop_nonfinite=True)"
  out, kept_names, dropped = [], [], {}
  for arrays, name in zip(read.clients, read.client_names):
    n = len(next(iter(arrays.values())))
    keep = np.ones(n, bool)
    for key, a in arrays.items():
      if a.dtype.kind != "f":
        continue
      found = _first_nonfinite(a)
      if found is not None and not drop:
        i, index, value = found
        raise _fail(path, f"client '{name}' example {i}: {_nonfinite_place(key, a, index, value)}; clean the data, "
                          f"or {how} to drop the examples that hold NaN or Inf.")
      keep &= np.isfinite(a.reshape(n, -1)).all(axis=1)
    if not keep.all():
      dropped[name] = int(n - keep.sum())
      if not keep.any():
        if skip_empty:
          continue
        raise _fail(path, f"client '{name}' has no examples left after dropping those that hold NaN or Inf.")
      arrays = {k: a[keep] for k, a in arrays.items()}
    out.append(arrays)
    kept_names.append(name)
  return ClientData(out, tuple(kept_names)), dropped


def _check_leaf_labels(clients: list[dict[str, np.ndarray]], names: Sequence[str], num_classes: int | None,
                       path: Any) -> None:
  for arrays, name in zip(clients, names):
    if "y" in arrays:
      try:
        check_labels(arrays["y"], num_classes, f"client '{name}'")
      except ValueError as err:
        raise _fail(path, str(err)) from None


def load_leaf(train_path: Any, test_path: Any = None, *, num_classes: int | None, transform: Transform | None = None,
              drop_nonfinite: bool = False, name: str = "leaf", **pack_options: Any) -> FederatedDataset:
  """Reads LEAF train (and test) JSON and packs them; test users are matched by id.

  Every check runs here, at load time, with a one-line ValueError that starts
  with the file and names the client: a label outside `[0, num_classes)`
  (negative labels always), an example holding NaN or Inf (its feature
  index), a user without examples (`client 'u9' has no examples`; in the
  test file such a user just has no test examples).

  Args:
    train_path: LEAF train file or folder.
    test_path: LEAF test file or folder (its users must appear in train), or None
      to split each client with `test_fraction=f` (a `pack` option). One of the
      two is required: without either, the dataset would have no test split
      (`test_fraction=0` asks for none).
    num_classes: K, the number of classes (required): every integer label
      must lie in `[0, K)`. None infers K from the labels (the largest label
      + 1) and warns when some of those classes never occur (one stray label
      42 in a 3-class file would make 43 classes).
    transform: see `read_leaf_json`.
    drop_nonfinite: drop the examples that hold NaN or Inf (a warning says how
      many, per client) instead of refusing the file.
    name: dataset name.
    **pack_options: passed to `pack` (test_fraction, max_padding_factor, ...).
  """
  if test_path is None and "test_fraction" not in pack_options:
    raise _fail(train_path, "load_leaf needs a test split: pass test_path= (LEAF's test file or folder, e.g. "
                            "data/test, which LEAF's split step writes) or test_fraction=f to hold out that share "
                            "of each client's examples (test_fraction=0: no test split).")
  num_classes = check_num_classes(num_classes)
  if not isinstance(drop_nonfinite, bool):
    raise TypeError(f"drop_nonfinite must be True or False; got {drop_nonfinite!r}.")
  parts = [(train_path, _read_leaf(train_path, transform, drop_nonfinite=drop_nonfinite))]
  if test_path is not None:
    parts.append((test_path, _read_leaf(test_path, transform, skip_empty=True, drop_nonfinite=drop_nonfinite)))
  read = []
  for path, (part, dropped) in parts:
    if dropped:
      listed = ", ".join(f"'{k}' ({v})" for k, v in list(dropped.items())[:5]) + (", ..." if len(dropped) > 5 else "")
      warnings.warn(f"{os.fspath(path)}: dropped {sum(dropped.values())} example(s) that hold NaN or Inf, of "
                    f"{len(dropped)} client(s): {listed}.", stacklevel=2)
    _check_leaf_labels(part.clients, part.client_names, num_classes, path)
    read.append(part)
  train = read[0]
  test_clients = None
  if test_path is not None:
    test_clients = _align(read[1], train.client_names, train.clients[0], test_path)
  if num_classes is None:
    labels = [c["y"] for c in train.clients + (test_clients or []) if "y" in c and c["y"].dtype.kind in "iu"]
    if labels:
      present = np.unique(np.concatenate(labels))
      inferred = int(present.max()) + 1 if present.size else 0
      if present.size < inferred:
        warnings.warn(f"{os.fspath(train_path)}: num_classes=None infers {inferred} classes from the largest label "
                      f"{inferred - 1}, but only {present.size} of them occur; pass num_classes=K to have every "
                      f"label checked against it.", stacklevel=2)
  return pack(train.clients, test_clients=test_clients, client_names=train.client_names, name=name,
              num_classes=num_classes, **pack_options)


# ----------------------------------------------------------------------------
# LibSVM / svmlight.
# ----------------------------------------------------------------------------


def _parse_svmlight_line(line: str, path: Any, lineno: int,
                         raw_labels: bool = False) -> tuple[float, int | None, list[tuple[int, float]]]:
  """(label, qid or None, [(index, value)]) of one line; refuses a value that is not a finite float32 number."""
  tokens = line.split()
  try:
    label = float(tokens[0])
  except ValueError:
    raise _fail(path, f"line {lineno}: label {tokens[0]!r} is not a number.") from None
  if not math.isfinite(label) or (raw_labels and abs(label) > _FLOAT32_MAX):
    raise _fail(path, f"line {lineno}: label {tokens[0]!r} is not a finite number"
                      + (" in float32." if math.isfinite(label) else "."))
  qid = None
  features = []
  for token in tokens[1:]:
    head, sep, value = token.partition(":")
    if not sep:
      raise _fail(path, f"line {lineno}: {token!r} is not index:value.")
    if head == "qid":
      try:
        qid = int(value)
      except ValueError:
        raise _fail(path, f"line {lineno}: qid {value!r} is not an integer.") from None
      continue
    try:
      index, val = int(head), float(value)
    except ValueError:
      raise _fail(path, f"line {lineno}: {token!r} is not index:value with an integer index.") from None
    if index < 0:
      raise _fail(path, f"line {lineno}: negative feature index {index}.")
    if not math.isfinite(val):
      raise _fail(path, f"line {lineno}: {token!r} is not a finite number (NaN and Inf are refused).")
    if abs(val) > _FLOAT32_MAX:
      raise _fail(path, f"line {lineno}: {token!r} is beyond float32's range (±{_FLOAT32_MAX:.7g}), in which the "
                        f"features are stored.")
    features.append((index, val))
  return label, qid, features


def read_svmlight(path: Any, *, num_features: int | None = None, zero_based: bool | str = "auto",
                  labels: str = "index") -> dict[str, np.ndarray]:
  """Reads a LibSVM / svmlight file into dense arrays.

  Args:
    path: text file, lines `label [qid:q] index:value ...` (`#` starts a comment).
    num_features: d; the largest index seen when None.
    zero_based: whether indices start at 0; "auto" means zero-based only if an
      index 0 occurs (scikit-learn's rule).
    labels: "index" maps the sorted distinct labels to 0..L-1 (e.g. -1, +1 ->
      0, 1) as int32; "raw" keeps them as float32.

  Returns:
    `{"x": [n, d] float32, "y": [n]}`, plus `"qid": [n] int32` when the file has qids.

  Raises:
    ValueError: `"<file>: line <k>: <problem>"` for a line that is not
      `label [qid:q] index:value ...`, a label or value that is NaN or ±Inf
      (`line 2: '2:nan' is not a finite number`), a value beyond float32's
      range, or a feature index beyond `num_features`.
  """
  if labels not in ("index", "raw"):
    raise ValueError(f"labels must be 'index' or 'raw'; got {labels!r}.")
  if zero_based not in (True, False, "auto"):
    raise ValueError(f"zero_based must be True, False or 'auto'; got {zero_based!r}.")
  if not os.path.exists(os.fspath(path)):
    raise FileNotFoundError(f"{os.fspath(path)}: no such file.")
  rows, ys, qids = [], [], []
  with open(path, encoding="utf-8", errors="replace") as f:
    for lineno, line in enumerate(f, 1):
      line = line.split("#", 1)[0].strip()
      if not line:
        continue
      label, qid, features = _parse_svmlight_line(line, path, lineno, raw_labels=labels == "raw")
      ys.append(label)
      qids.append(qid)
      rows.append(features)
  if not rows:
    raise _fail(path, "holds no examples.")
  if any(q is None for q in qids) and any(q is not None for q in qids):
    raise _fail(path, "some lines have qid and others do not.")
  all_indices = [i for row in rows for i, _ in row]
  offset = 0
  if zero_based is False or (zero_based == "auto" and all_indices and min(all_indices) > 0):
    offset = 1
    if all_indices and min(all_indices) < 1:
      raise _fail(path, "feature index 0 in a file read as one-based (zero_based=False).")
  width = (max(all_indices) + 1 - offset) if all_indices else 0
  if num_features is not None:
    if width > num_features:
      raise _fail(path, f"feature index {width - 1 + offset} exceeds num_features={num_features}.")
    width = num_features
  x = np.zeros((len(rows), width), np.float32)
  for r, row in enumerate(rows):
    for index, val in row:
      x[r, index - offset] = val
  y_raw = np.asarray(ys, np.float64)
  if labels == "index":
    y = np.searchsorted(np.unique(y_raw), y_raw).astype(np.int32)
  else:
    y = y_raw.astype(np.float32)
  out = {"x": x, "y": y}
  if qids[0] is not None:
    out["qid"] = np.asarray(qids, np.int32)
  return out


EXAMPLES = {"libsvm": "two_class.svm"}
"""The example files shipped in `fedjax_opt/data/examples/`, by format."""


def example_path(kind: str = "libsvm") -> str:
  """The path of the small example file of format `kind` that ships with the package.

  `"libsvm"`: `two_class.svm`, 300 examples of 10 features scaled to [−1, 1]
  and labels −1 / +1, made by scikit-learn's `make_classification` with a
  fixed seed (the recipe: `tools/make_example_data.py`, and the file's
  header). Read it with `read_svmlight(example_path())`, or train on it with
  `fedjax-opt run --dataset libsvm:PATH`.
  """
  if kind not in EXAMPLES:
    raise ValueError(f"no example file of kind {kind!r}; there are: {', '.join(sorted(EXAMPLES))}.")
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", EXAMPLES[kind])


# ----------------------------------------------------------------------------
# IDX (MNIST family).
# ----------------------------------------------------------------------------

_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _read_bytes(path: Any) -> bytes:
  with open(path, "rb") as f:
    head = f.read(2)
  opener = gzip.open if head == b"\x1f\x8b" else open
  try:
    with opener(path, "rb") as f:
      return f.read()
  except (OSError, EOFError) as err:
    raise _fail(path, f"cannot be decompressed ({err}).") from None


def read_idx(path: Any) -> np.ndarray:
  """Reads an IDX file (raw or gzip): magic `00 00 type ndim`, big-endian dims, data.

  Returns:
    The array in native byte order, shaped by the file's dimensions.

  Raises:
    ValueError: `"<file>: <problem>"` for a bad header, a size that does not
      match the dimensions, or a float file holding NaN or ±Inf (the first
      example, along the first dimension, that holds one is named).
  """
  if not os.path.exists(os.fspath(path)):
    raise FileNotFoundError(f"{os.fspath(path)}: no such file.")
  data = _read_bytes(path)
  if len(data) < 4 or data[0] != 0 or data[1] != 0:
    raise _fail(path, "not an IDX file (the magic number must start with two zero bytes).")
  code, ndim = data[2], data[3]
  if code not in _IDX_TYPES:
    raise _fail(path, f"unknown IDX data type 0x{code:02x}.")
  header = 4 + 4 * ndim
  if ndim == 0 or len(data) < header:
    raise _fail(path, f"truncated IDX header ({ndim} dimensions).")
  shape = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
  dtype = np.dtype(_IDX_TYPES[code])
  expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if len(data) - header != expected:
    raise _fail(path, f"holds {len(data) - header} data bytes; dimensions {shape} need {expected}.")
  array = np.frombuffer(data, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))
  _check_finite_examples(array, path)
  return array


def _check_finite_examples(array: np.ndarray, path: Any) -> None:
  """Refuses the first NaN or ±Inf of an array of examples `[n, ...]`, naming the example and the index in it."""
  found = _first_nonfinite(array)
  if found is not None:
    i, index, value = found
    raise _fail(path, f"example {i} {_nonfinite_place(None, array, index, value)}; every value must be a finite "
                      f"number (a value beyond float32's range becomes inf): clean the data.")


def read_idx_images(images_path: Any, labels_path: Any, *, flatten: bool = False) -> dict[str, np.ndarray]:
  """Reads an IDX image/label pair (MNIST, EMNIST, Fashion-MNIST layout).

  Returns:
    `{"x": [n, H, W, 1] float32 in [0, 1] (or [n, H*W] with flatten), "y": [n] int32}`.
  """
  images = read_idx(images_path)
  labels = read_idx(labels_path)
  if images.ndim != 3:
    raise _fail(images_path, f"images must be 3-D [n, H, W]; got shape {images.shape}.")
  if labels.ndim != 1:
    raise _fail(labels_path, f"labels must be 1-D [n]; got shape {labels.shape}.")
  if len(images) != len(labels):
    raise _fail(labels_path, f"holds {len(labels)} labels for the {len(images)} images of {os.fspath(images_path)}.")
  scale = 255.0 if images.dtype == np.uint8 else 1.0
  with np.errstate(over="ignore"):
    x = images.astype(np.float32) / scale
  _check_finite_examples(x, images_path)  # float64 values beyond float32's range
  x = x.reshape(len(x), -1) if flatten else x[..., None]
  return {"x": x, "y": labels.astype(np.int32)}


# ----------------------------------------------------------------------------
# TFF / FedJAX HDF5.
# ----------------------------------------------------------------------------

TFF_RENAME = {"pixels": "x", "label": "y"}
"""Default feature renaming for TFF's EMNIST files (`pixels`, `label`)."""


def read_tff_hdf5(path: Any, *, rename: Mapping[str, str] | None = None, transform: Transform | None = None,
                  client_ids: Sequence[str] | None = None) -> ClientData:
  """Reads a TFF / FedJAX HDF5 file laid out as `examples/<client>/<feature>`.

  Args:
    path: `.h5` / `.hdf5` file (TFF's `fed_emnist_train.h5`, say).
    rename: feature renaming applied to the names present (default
      `TFF_RENAME`: pixels -> x, label -> y); `{}` keeps the file's names.
    transform: optional function on each client's `{feature: array}` (e.g. to
      tokenize TFF Shakespeare's `snippets` strings).
    client_ids: read only these clients (default: all, sorted as in the file).

  Returns:
    `ClientData`.

  Raises:
    ValueError: `"<file>: <problem>"` for a layout that is not TFF's, ragged
      or non-numeric data, or a value that is NaN or ±Inf (`client 'f0001_00'
      example 2: 'x' holds nan at feature index (3, 4)`).
  """
  try:
    import h5py  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise ImportError('reading HDF5 needs h5py: pip install "fedjax_opt[hdf5]".') from err
  if not os.path.exists(os.fspath(path)):
    raise FileNotFoundError(f"{os.fspath(path)}: no such file.")
  rename = TFF_RENAME if rename is None else dict(rename)
  try:
    handle = h5py.File(path, "r")
  except OSError as err:
    raise _fail(path, f"not an HDF5 file ({err}).") from None
  with handle:
    if "examples" not in handle or not isinstance(handle["examples"], h5py.Group):
      raise _fail(path, f"needs a top-level group 'examples' (TFF layout); found {sorted(handle)}.")
    group = handle["examples"]
    ids = list(group) if client_ids is None else [str(c) for c in client_ids]
    clients = []
    for cid in ids:
      if cid not in group or not isinstance(group[cid], h5py.Group):
        raise _fail(path, f"examples/{cid} is not a client group.")
      raw = {rename.get(k, k): group[cid][k][()] for k in group[cid]}
      if transform is not None:
        raw = dict(transform(raw))
      arrays = {k: _numeric(v, path, f"examples/{cid}/{k}", labels=(k == "y")) for k, v in raw.items()}
      clients.append(_check_client(arrays, path, f"examples/{cid}"))
  _check_consistent(clients, ids, path)
  _check_finite_clients(clients, ids, path)
  return ClientData(clients, tuple(ids))


def load_tff_hdf5(train_path: Any, test_path: Any = None, *, rename: Mapping[str, str] | None = None,
                  transform: Transform | None = None, name: str = "tff", **pack_options: Any) -> FederatedDataset:
  """Reads TFF HDF5 train (and test) files and packs them; test clients matched by id."""
  train = read_tff_hdf5(train_path, rename=rename, transform=transform)
  test_clients = None
  if test_path is not None:
    test = read_tff_hdf5(test_path, rename=rename, transform=transform)
    test_clients = _align(test, train.client_names, train.clients[0], test_path)
  return pack(train.clients, test_clients=test_clients, client_names=train.client_names, name=name,
              **pack_options)


# ----------------------------------------------------------------------------
# NumPy .npz.
# ----------------------------------------------------------------------------


def write_npz(path: Any, clients: Sequence[Mapping[str, Any]], client_names: Sequence[str] | None = None) -> None:
  """Writes per-client arrays as `.npz` with keys `"<client>/<feature>"`."""
  names = [f"client_{k}" for k in range(len(clients))] if client_names is None else [str(c) for c in client_names]
  if len(names) != len(clients):
    raise ValueError(f"client_names has {len(names)} names for {len(clients)} clients.")
  if len(set(names)) != len(names) or any("/" in n for n in names):
    raise ValueError("client_names must be distinct and contain no '/'.")
  np.savez(path, **{f"{name}/{key}": np.asarray(value) for name, client in zip(names, clients)
                    for key, value in client.items()})


def read_npz(path: Any, *, transform: Transform | None = None) -> ClientData:
  """Reads per-client arrays from `.npz` keys `"<client>/<feature>"` (clients in file order).

  Returns:
    `ClientData`.

  Raises:
    ValueError: `"<file>: <problem>"` for keys that are not
      `"<client>/<feature>"`, ragged or non-numeric data, or a value that is
      NaN or ±Inf (`client 'alice' example 3: 'x' holds inf at feature index 0`).
  """
  if not os.path.exists(os.fspath(path)):
    raise FileNotFoundError(f"{os.fspath(path)}: no such file.")
  try:
    archive = np.load(path, allow_pickle=False)
  except (ValueError, OSError) as err:
    raise _fail(path, f"not a readable .npz file ({err}).") from None
  if not hasattr(archive, "files"):
    raise _fail(path, "is a single .npy array, not an .npz archive of per-client arrays.")
  grouped: dict[str, dict[str, Any]] = {}
  with archive:
    for key in archive.files:
      client, sep, feature = key.rpartition("/")
      if not sep or not client or not feature:
        raise _fail(path, f"key {key!r} is not '<client>/<feature>'.")
      try:
        grouped.setdefault(client, {})[feature] = archive[key]
      except ValueError as err:
        raise _fail(path, f"key {key!r}: {err}") from None
  names = list(grouped)
  clients = []
  for name in names:
    raw = grouped[name] if transform is None else dict(transform(grouped[name]))
    arrays = {k: _numeric(v, path, f"{name}/{k}", labels=(k == "y")) for k, v in raw.items()}
    clients.append(_check_client(arrays, path, f"client '{name}'"))
  _check_consistent(clients, names, path)
  _check_finite_clients(clients, names, path)
  return ClientData(clients, tuple(names))
