"""A federated dataset packed once into padded device arrays.

Clients' examples are stacked into arrays shaped `[N, n_max + 1, ...]`
(clients, example slots) with per-client counts, so that a whole training run can draw
its rounds inside `jax.jit` (see `sampling.py`) without returning to Python.
The layout follows the "data resident on device" design of the FedJAX paper
(Ro, Suresh, Wu: "FedJAX: Federated learning simulation with JAX",
arXiv:2108.02117), with the client loop replaced by array axes.

Layout of one client's row (index k), in both layouts below:

* train examples occupy slots `[0, train_count[k])`;
* test examples occupy slots `[test_start[k], test_start[k] + test_count[k])`;
* the remaining slots are zero padding, and every row ends with at least one
  zero slot (`zero_index`) that masked batch slots point at.

Two layouts share that row structure:

* plain examples (`sequence_length == 0`): `examples` is a dict of arrays
  `[N, n_max + 1, ...]`, one slot per example;
* next-token windows (`sequence_length == L > 0`): `examples` is
  `{"tokens": [N, T_max + L + 1]}` and slot `i` of client k stands for the example
  `x = tokens[k, i:i+L]`, `y = tokens[k, i+L]` (LEAF's Shakespeare task). The
  text is stored once instead of L times: an 80x memory saving.

Memory rule: padding costs `N * n_max` slots for `sum_k n_k` real examples.
`pack` refuses (ValueError) when that padding factor exceeds
`max_padding_factor`, naming the largest client, since one huge client among
tiny ones multiplies device memory by up to N.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import flax.struct
import jax
import numpy as np

__all__ = ["DEFAULT_MAX_PADDING_FACTOR", "FederatedDataset", "num_test_examples", "pack", "pack_sequences",
           "sequence_split", "unpack"]

Arrays = dict[str, np.ndarray]

DEFAULT_MAX_PADDING_FACTOR = 10.0
"""Default bound on `N * n_max / sum_k n_k` accepted by `pack`."""


@flax.struct.dataclass
class FederatedDataset:
  """Clients' examples in padded device arrays (a pytree; pass it into jit).

  Attributes:
    examples: dict of arrays `[N, n_max + 1, ...]` (or `{"tokens": [N, T_max + L + 1]}`
      when `sequence_length = L > 0`); zero on padding.
    train_count: `[N]` int32, number of train examples of each client (n_k).
    test_start: `[N]` int32, first test slot of each client.
    test_count: `[N]` int32, number of test examples of each client.
    central_test: optional centralized test set, dict of arrays `[M, ...]`
      (e.g. an official test split), or None.
    num_classes: number of labels (static), or None when unknown.
    client_names: one name per client (static).
    name: dataset name (static).
    max_train: `max_k train_count[k]` (static; sizes epoch-based sampling).
    max_test: `max_k test_count[k]` (static).
    sequence_length: 0 for plain examples, L > 0 for next-token windows (static).
    zero_index: a slot whose example is all zeros in every row (static): n_max
      for examples, T_max for token windows. Masked batch slots point at it, so
      sampled padding is zero without a masking pass over the data.
  """

  examples: dict[str, jax.Array]
  train_count: jax.Array
  test_start: jax.Array
  test_count: jax.Array
  central_test: Any = None
  num_classes: int | None = flax.struct.field(pytree_node=False, default=None)
  client_names: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
  name: str = flax.struct.field(pytree_node=False, default="custom")
  max_train: int = flax.struct.field(pytree_node=False, default=0)
  max_test: int = flax.struct.field(pytree_node=False, default=0)
  sequence_length: int = flax.struct.field(pytree_node=False, default=0)
  zero_index: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def num_clients(self) -> int:
    """N, the number of clients (static)."""
    return self.train_count.shape[0]

  @property
  def n_max(self) -> int:
    """Largest client row: n_max examples (or T_max tokens for token windows) (static)."""
    return self.zero_index

  @property
  def has_test_examples(self) -> bool:
    """Whether any client holds a test example (static: `max_test > 0`; works inside jit).

    False for `test_fraction=0` without `test_clients`: evaluate on the train
    split or on `central_test` then.
    """
    return self.max_test > 0

  @property
  def num_train_examples(self) -> int:
    """`sum_k train_count[k]` (host only)."""
    return int(np.asarray(self.train_count, np.int64).sum())

  @property
  def num_test_examples(self) -> int:
    """`sum_k test_count[k]` (host only); 0 exactly when `has_test_examples` is False."""
    return int(np.asarray(self.test_count, np.int64).sum())

  @property
  def nbytes(self) -> int:
    """Bytes the dataset holds on device (examples, counts and central test)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(self))

  @property
  def padding_factor(self) -> float:
    """`N * n_max / (real slots)`: device slots per real example (host only)."""
    used = _row_lengths(self)
    return self.num_clients * self.n_max / max(1, int(used.sum()))

  def summary(self) -> str:
    """A few lines describing the dataset: clients, sizes, memory."""
    train = np.asarray(self.train_count)
    test = np.asarray(self.test_count)
    total = f"{int(train.sum()) + int(test.sum()):,}"
    layout = (f"{total} next-token windows of length {self.sequence_length}"
              if self.sequence_length else f"{total} examples")
    features = ", ".join(f"{k}: {tuple(v.shape[2:])} {v.dtype}" for k, v in self.examples.items())
    lines = [
        f"FederatedDataset '{self.name}': {self.num_clients} clients, {layout}",
        f"  features        {features}",
        f"  train examples  {int(train.sum())} (per client min {train.min()}, "
        f"median {int(np.median(train))}, max {train.max()})",
        f"  test examples   {int(test.sum())}",
        f"  num_classes     {self.num_classes}",
        f"  device memory   {self.nbytes / 2**20:.2f} MiB (padding factor {self.padding_factor:.2f})",
    ]
    if self.central_test is not None:
      m = len(next(iter(self.central_test.values())))
      lines.append(f"  central test    {m} examples")
    return "\n".join(lines)


def _row_lengths(dataset: FederatedDataset) -> np.ndarray:
  """Slots of each row holding real data (host numpy)."""
  train = np.asarray(dataset.train_count, np.int64)
  end = np.asarray(dataset.test_start, np.int64) + np.asarray(dataset.test_count, np.int64)
  used = np.maximum(train, end)
  if dataset.sequence_length:
    used = np.where(used > 0, used + dataset.sequence_length, 0)
  return used


# ----------------------------------------------------------------------------
# Validation and dtype normalisation of host arrays.
# ----------------------------------------------------------------------------


def _normalise(array: Any, where: str) -> np.ndarray:
  """Converts to a numpy array with a device-friendly dtype (float32, int32, ...)."""
  try:
    a = np.asarray(array)
  except ValueError as err:  # ragged nested lists
    raise ValueError(f"{where} is ragged (rows of different lengths): {err}") from None
  if a.dtype == object or a.dtype.kind in "USV":
    raise TypeError(f"{where} must hold numbers; got dtype {a.dtype}.")
  if a.ndim == 0:
    raise ValueError(f"{where} must have a leading example axis; got a scalar.")
  if a.dtype.kind == "f" and a.dtype.itemsize > 4:
    return a.astype(np.float32)
  if a.dtype.kind in "iu" and a.dtype.itemsize > 4:
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
      raise ValueError(f"{where} has values outside the int32 range.")
    return a.astype(np.int32)
  if a.dtype.kind == "c":
    raise TypeError(f"{where} must be real-valued; got dtype {a.dtype}.")
  return a


def validate_clients(clients: Any, name: str = "clients") -> list[Arrays]:
  """Checks a list of per-client dicts of arrays and normalises dtypes.

  Every client must have the same keys, every feature of a client the same
  number of examples (leading axis), and every feature the same trailing shape
  and dtype kind across clients.

  Args:
    clients: sequence of mappings `{feature: array [n_k, ...]}`.
    name: argument name used in error messages.

  Returns:
    A list of dicts of numpy arrays.

  Raises:
    TypeError, ValueError: naming the client and feature at fault.
  """
  if isinstance(clients, Mapping) or not isinstance(clients, Sequence) or isinstance(clients, str):
    raise TypeError(f"{name} must be a list of per-client dicts of arrays; got {type(clients).__name__}.")
  if not clients:
    raise ValueError(f"{name} is empty: a federated dataset needs at least one client.")
  out = []
  keys = None
  for k, client in enumerate(clients):
    if not isinstance(client, Mapping):
      raise TypeError(f"{name}[{k}] must be a dict of arrays; got {type(client).__name__}.")
    if not client:
      raise ValueError(f"{name}[{k}] has no features.")
    if keys is None:
      keys = sorted(client)
    elif sorted(client) != keys:
      raise ValueError(f"{name}[{k}] has keys {sorted(client)}; {name}[0] has {keys}.")
    arrays = {key: _normalise(client[key], f"{name}[{k}][{key!r}]") for key in keys}
    lengths = {key: a.shape[0] for key, a in arrays.items()}
    if len(set(lengths.values())) != 1:
      raise ValueError(f"{name}[{k}] features have different numbers of examples: {lengths}.")
    out.append(arrays)
  for key in keys:
    ref = out[0][key]
    for k, arrays in enumerate(out):
      a = arrays[key]
      if a.shape[1:] != ref.shape[1:]:
        raise ValueError(
            f"{name}[{k}][{key!r}] has example shape {a.shape[1:]}; {name}[0][{key!r}] has {ref.shape[1:]}.")
  for key in keys:
    dtype = np.result_type(*[arrays[key].dtype for arrays in out])
    for arrays in out:
      arrays[key] = arrays[key].astype(dtype, copy=False)
  return out


def _check_fraction(test_fraction: float) -> None:
  if not isinstance(test_fraction, (int, float)) or not 0.0 <= test_fraction < 1.0:
    raise ValueError(f"test_fraction must be a number in [0, 1); got {test_fraction!r}.")


def num_test_examples(n: int, test_fraction: float) -> int:
  """Test examples of a client of size n: LEAF's rule `n - int((1 - f) n)`, keeping >= 1 train."""
  if n <= 1 or test_fraction <= 0:
    return 0
  n_train = max(1, int(math.floor((1.0 - test_fraction) * n + 1e-9)))
  return n - n_train


def _check_padding(sizes: np.ndarray, names: Sequence[str], max_padding_factor: float | None,
                   bytes_per_slot: int) -> None:
  total = int(sizes.sum())
  if total == 0:
    raise ValueError("clients hold no examples at all.")
  if max_padding_factor is None:
    return
  if not isinstance(max_padding_factor, (int, float)) or max_padding_factor < 1:
    raise ValueError(f"max_padding_factor must be a number >= 1 or None; got {max_padding_factor!r}.")
  n_max = int(sizes.max())
  factor = len(sizes) * n_max / total
  if factor > max_padding_factor:
    k = int(np.argmax(sizes))
    padded_mib = len(sizes) * n_max * bytes_per_slot / 2**20
    raise ValueError(
        f"max_padding_factor={max_padding_factor:g} exceeded: padding every client to the largest one "
        f"needs {factor:.1f}x the real data ({len(sizes)} clients x {n_max} slots = {padded_mib:.1f} MiB "
        f"for {total} examples); the largest client is '{names[k]}' (index {k}) with {n_max} examples "
        f"against a median of {int(np.median(sizes))}. Raise max_padding_factor (e.g. "
        f"max_padding_factor={math.ceil(factor)}, or None to disable) or split that client into smaller ones.")


def _pad_rows(rows: list[np.ndarray], n_max: int) -> np.ndarray:
  """Stacks `[n_k, ...]` arrays into a zero-padded `[N, n_max, ...]` array."""
  ref = rows[0]
  out = np.zeros((len(rows), n_max) + ref.shape[1:], dtype=ref.dtype)
  for k, row in enumerate(rows):
    out[k, :len(row)] = row
  return out


def _client_names(client_names: Sequence[str] | None, n: int) -> tuple[str, ...]:
  if client_names is None:
    return tuple(f"client_{k}" for k in range(n))
  names = tuple(str(c) for c in client_names)
  if len(names) != n:
    raise ValueError(f"client_names has {len(names)} names for {n} clients.")
  return names


def check_num_classes(num_classes: Any) -> int | None:
  """`num_classes` checked: a positive int, or None."""
  if num_classes is None:
    return None
  if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
    raise ValueError(f"num_classes must be a positive int or None; got {num_classes!r}.")
  return int(num_classes)


def check_labels(labels: np.ndarray, num_classes: int | None, where: str) -> None:
  """Raises ValueError unless every label is a class index in `[0, num_classes)`.

  Integer labels are always checked for negatives, and against `num_classes`
  when it is known. Float labels are checked only when `num_classes` is given
  (they are then class indices and must be whole numbers); otherwise they are
  taken for regression targets. A label outside the range would otherwise
  reach the loss as a silent NaN (or a wrong one-hot), so it is caught here,
  at load time.

  Args:
    labels: an array of labels (any shape).
    num_classes: K, or None when unknown.
    where: what the labels are, for the message (e.g. "clients[3] ('f_0003') 'y'").
  """
  y = np.asarray(labels)
  if y.size == 0 or y.dtype.kind not in "iuf" or (y.dtype.kind == "f" and num_classes is None):
    return
  if y.dtype.kind == "f":
    bad = ~np.isfinite(y) | (y != np.round(y))
    if bad.any():
      raise ValueError(f"{where} holds label {y[bad].flat[0]!r}, not a class index, while num_classes={num_classes} "
                       "was given: class labels must be whole numbers in [0, num_classes).")
  low, high = y.min(), y.max()
  if low < 0:
    raise ValueError(
        f"{where} holds label {low.item()!r}, which is negative: class labels must be indices 0..K-1"
        + (f" with num_classes={num_classes}" if num_classes is not None else "")
        + ". Remap them first, e.g. np.unique(y, return_inverse=True)[1] (read_svmlight does so with "
        "labels='index').")
  if num_classes is not None and high >= num_classes:
    raise ValueError(
        f"{where} holds label {high.item()!r}, outside [0, num_classes) with num_classes={num_classes}: "
        f"pass num_classes={int(high) + 1} or more if the data have that many classes, or remap the labels to "
        f"0..{num_classes - 1}.")


def _check_part_labels(parts: Sequence[Arrays], names: Sequence[str], num_classes: int | None, what: str) -> None:
  for k, part in enumerate(parts):
    if "y" in part:
      check_labels(part["y"], num_classes, f"{what}[{k}] ('{names[k]}') 'y'")


def _infer_num_classes(parts: list[Arrays], num_classes: int | None) -> int | None:
  if num_classes is not None:
    return int(num_classes)
  ys = [p["y"] for p in parts if "y" in p and p["y"].size]
  if not ys or ys[0].dtype.kind not in "iu":
    return None
  return int(max(int(y.max()) for y in ys)) + 1


def _to_device(tree: Any, device: Any) -> Any:
  return jax.device_put(tree, device) if device is not None else jax.device_put(tree)


def pack(
    clients: Sequence[Mapping[str, Any]],
    *,
    test_clients: Sequence[Mapping[str, Any]] | None = None,
    test_fraction: float = 0.0,
    split: str = "random",
    seed: int = 0,
    num_classes: int | None = None,
    client_names: Sequence[str] | None = None,
    central_test: Mapping[str, Any] | None = None,
    name: str = "custom",
    max_padding_factor: float | None = DEFAULT_MAX_PADDING_FACTOR,
    device: Any = None,
) -> FederatedDataset:
  """Packs per-client arrays into padded device arrays `[N, n_max + 1, ...]`.

  Each client's test examples are either given (`test_clients`, e.g. LEAF's
  separate test files) or split off its own examples: `n_k - int((1 - f) n_k)`
  of them (LEAF's rule; a client keeps at least one train example), chosen at
  random under `seed` (`split="random"`) or as the last ones (`split="ordered"`,
  for data in time order).

  Floating features are stored as float32 and integers wider than 32 bits as
  int32.

  Args:
    clients: N dicts `{feature: array [n_k, ...]}`, e.g. `{"x": ..., "y": ...}`.
    test_clients: optional N dicts with the same features: each client's test set.
    test_fraction: f in [0, 1), the share of each client's examples held out for
      test when `test_clients` is None.
    split: "random" (seeded) or "ordered" (the last examples are the test set).
    seed: seed of the random split.
    num_classes: number of labels; inferred from an integer "y" when None.
      Every integer "y" (train, test and `central_test`) must lie in
      `[0, num_classes)`, and a float "y" too when num_classes is given.
    client_names: N names (default "client_<k>").
    central_test: optional centralized test set `{feature: [M, ...]}`.
    name: dataset name, kept as static metadata.
    max_padding_factor: refuse to pack when `N * n_max / sum_k n_k` exceeds it
      (None disables the check).
    device: optional `jax.Device` or sharding for the arrays.

  Returns:
    A `FederatedDataset`.

  Raises:
    TypeError, ValueError: malformed clients, bad options, padding beyond
      `max_padding_factor` (naming the largest client and how to fix it), a
      label outside `[0, num_classes)` (naming the client and the label), or
      `test_fraction > 0` leaving no client a test example (every client
      holds at most one example).
  """
  train_parts = validate_clients(clients, "clients")
  n = len(train_parts)
  names = _client_names(client_names, n)
  _check_fraction(test_fraction)
  num_classes = check_num_classes(num_classes)
  _check_part_labels(train_parts, names, num_classes, "clients")
  if split not in ("random", "ordered"):
    raise ValueError(f"split must be 'random' or 'ordered'; got {split!r}.")
  if test_clients is not None:
    if test_fraction:
      raise ValueError("give either test_clients or test_fraction > 0, not both.")
    test_parts = validate_clients(test_clients, "test_clients")
    if len(test_parts) != n:
      raise ValueError(f"test_clients has {len(test_parts)} clients; clients has {n}.")
    if sorted(test_parts[0]) != sorted(train_parts[0]):
      raise ValueError(f"test_clients have keys {sorted(test_parts[0])}; clients have {sorted(train_parts[0])}.")
    for key in train_parts[0]:
      if test_parts[0][key].shape[1:] != train_parts[0][key].shape[1:]:
        raise ValueError(f"test_clients[0][{key!r}] has example shape {test_parts[0][key].shape[1:]}; "
                         f"clients[0][{key!r}] has {train_parts[0][key].shape[1:]}.")
    _check_part_labels(test_parts, names, num_classes, "test_clients")
  else:
    train_parts, test_parts = _split_clients(train_parts, test_fraction, split, seed)
  rows = {key: [np.concatenate([tr[key], te[key].astype(tr[key].dtype)]) for tr, te in zip(train_parts, test_parts)]
          for key in train_parts[0]}
  train_count = np.array([len(next(iter(p.values()))) for p in train_parts], np.int32)
  test_count = np.array([len(next(iter(p.values()))) for p in test_parts], np.int32)
  sizes = train_count.astype(np.int64) + test_count
  bytes_per_slot = sum(int(np.prod(r[0].shape[1:], dtype=np.int64)) * r[0].dtype.itemsize for r in rows.values())
  _check_padding(sizes, names, max_padding_factor, bytes_per_slot)
  if int(train_count.sum()) == 0:
    raise ValueError("clients hold no train examples (every example went to the test split).")
  if test_fraction > 0 and int(test_count.sum()) == 0:
    raise ValueError(
        f"test_fraction={test_fraction:g} leaves no client a test example: the largest of the {n} clients holds "
        f"{int(sizes.max())} example(s), and a client of n examples holds out n - floor((1 - test_fraction) n) "
        f"of them while keeping at least one for training. Use fewer, larger clients (at most "
        f"{int(sizes.sum()) // 2} for an equal split of these {int(sizes.sum())} "
        f"examples), or test_fraction=0 to go without per-client test sets.")
  n_max = int(sizes.max())
  examples = {key: _pad_rows(r, n_max + 1) for key, r in rows.items()}
  central = None
  if central_test is not None:
    central = validate_clients([central_test], "central_test")[0]
    if "y" in central:
      check_labels(central["y"], num_classes, "central_test 'y'")
  return FederatedDataset(
      examples=_to_device(examples, device),
      train_count=_to_device(train_count, device),
      test_start=_to_device(train_count.copy(), device),
      test_count=_to_device(test_count, device),
      central_test=None if central is None else _to_device(central, device),
      num_classes=_infer_num_classes(train_parts + test_parts, num_classes),
      client_names=names,
      name=str(name),
      max_train=int(train_count.max()),
      max_test=int(test_count.max()),
      sequence_length=0,
      zero_index=n_max,
  )


def _split_clients(parts: list[Arrays], test_fraction: float, split: str,
                   seed: int) -> tuple[list[Arrays], list[Arrays]]:
  rng = np.random.default_rng(seed)
  train, test = [], []
  for arrays in parts:
    n = len(next(iter(arrays.values())))
    order = rng.permutation(n) if split == "random" else np.arange(n)
    n_train = n - num_test_examples(n, test_fraction)
    train.append({k: a[order[:n_train]] for k, a in arrays.items()})
    test.append({k: a[order[n_train:]] for k, a in arrays.items()})
  return train, test


def sequence_split(num_tokens: int, sequence_length: int, test_fraction: float) -> tuple[int, int, int]:
  """Train/test windows of one client's token stream, without overlap.

  A stream of T tokens has `n = T - L` windows (x = L tokens, y = the next).
  The last `n - int((1 - f) n)` windows are the test set and the L windows
  before them are dropped, so no test character appears in a train window.

  Returns:
    `(train_count, test_start, test_count)`; train_count may be <= 0 for a
    stream too short to split.
  """
  n = num_tokens - sequence_length
  if n <= 0:
    return 0, 0, 0
  n_test = num_test_examples(n, test_fraction)
  if n_test == 0:
    return n, n, 0
  test_start = n - n_test
  return test_start - sequence_length, test_start, n_test


def pack_sequences(
    token_streams: Sequence[Any],
    sequence_length: int,
    *,
    test_fraction: float = 0.0,
    num_classes: int | None = None,
    client_names: Sequence[str] | None = None,
    name: str = "custom",
    max_padding_factor: float | None = DEFAULT_MAX_PADDING_FACTOR,
    device: Any = None,
) -> FederatedDataset:
  """Packs per-client token streams for next-token prediction over windows.

  Client k's example i is `x = tokens[i : i + L]`, `y = tokens[i + L]` for
  every i (stride 1, LEAF's Shakespeare windows). The stream is stored once
  (`[N, T_max]`) and windows are cut inside `sample_round`; its last windows
  form the test set (see `sequence_split`).

  Args:
    token_streams: N integer arrays `[T_k]` (uint8 is kept, saving memory).
    sequence_length: L, the window length (LEAF uses 80).
    test_fraction: f in [0, 1).
    num_classes: vocabulary size; `max token + 1` when None. Tokens must lie in
      `[0, num_classes)`.
    client_names: N names.
    name: dataset name.
    max_padding_factor: bound on `N * T_max / sum_k T_k` (None disables).
    device: optional device or sharding.

  Returns:
    A `FederatedDataset` with `sequence_length = L` and
    `examples = {"tokens": [N, T_max + L + 1]}` (zero beyond each stream).
  """
  if not isinstance(sequence_length, int) or sequence_length < 1:
    raise ValueError(f"sequence_length must be a positive int; got {sequence_length!r}.")
  _check_fraction(test_fraction)
  streams = [_normalise(s, f"token_streams[{k}]") for k, s in enumerate(token_streams)]
  if not streams:
    raise ValueError("token_streams is empty.")
  for k, s in enumerate(streams):
    if s.ndim != 1 or s.dtype.kind not in "iu":
      raise ValueError(f"token_streams[{k}] must be a 1-D integer array; got shape {s.shape}, dtype {s.dtype}.")
  names = _client_names(client_names, len(streams))
  num_classes = check_num_classes(num_classes)
  for k, s in enumerate(streams):
    check_labels(s, num_classes, f"token_streams[{k}] ('{names[k]}')")
  splits = np.array([sequence_split(len(s), sequence_length, test_fraction) for s in streams], np.int64)
  short = np.flatnonzero(splits[:, 0] < 1)
  if short.size:
    k = int(short[0])
    raise ValueError(
        f"token_streams[{k}] ('{names[k]}') has {len(streams[k])} tokens: too short for one train window "
        f"of length {sequence_length} with test_fraction={test_fraction}; drop such clients first.")
  lengths = np.array([len(s) for s in streams], np.int64)
  _check_padding(lengths, names, max_padding_factor, streams[0].dtype.itemsize)
  dtype = np.result_type(*[s.dtype for s in streams])
  t_max = int(lengths.max())
  tokens = _pad_rows([s.astype(dtype) for s in streams], t_max + sequence_length + 1)
  if num_classes is None:
    num_classes = int(max(int(s.max()) for s in streams)) + 1
  return FederatedDataset(
      examples=_to_device({"tokens": tokens}, device),
      train_count=_to_device(splits[:, 0].astype(np.int32), device),
      test_start=_to_device(splits[:, 1].astype(np.int32), device),
      test_count=_to_device(splits[:, 2].astype(np.int32), device),
      central_test=None,
      num_classes=int(num_classes),
      client_names=names,
      name=str(name),
      max_train=int(splits[:, 0].max()),
      max_test=int(splits[:, 2].max()),
      sequence_length=sequence_length,
      zero_index=t_max,
  )


def unpack(dataset: FederatedDataset, split: str = "train") -> list[Arrays]:
  """The examples of every client as host numpy dicts (inverse of `pack`).

  Args:
    dataset: a `FederatedDataset`.
    split: "train" or "test".

  Returns:
    N dicts `{feature: array [n_k, ...]}`; token-window datasets give
    `{"x": [n_k, L], "y": [n_k]}` int32.
  """
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test'; got {split!r}.")
  if split == "train":
    starts = np.zeros(dataset.num_clients, np.int64)
    counts = np.asarray(dataset.train_count, np.int64)
  else:
    starts = np.asarray(dataset.test_start, np.int64)
    counts = np.asarray(dataset.test_count, np.int64)
  host = {k: np.asarray(v) for k, v in dataset.examples.items()}
  out = []
  for k in range(dataset.num_clients):
    lo, hi = int(starts[k]), int(starts[k] + counts[k])
    if dataset.sequence_length:
      out.append(_windows(host["tokens"][k], lo, hi, dataset.sequence_length))
    else:
      out.append({key: v[k, lo:hi] for key, v in host.items()})
  return out


def _windows(tokens: np.ndarray, lo: int, hi: int, length: int) -> Arrays:
  starts = np.arange(lo, hi)
  x = tokens[starts[:, None] + np.arange(length)[None, :]].astype(np.int32)
  y = tokens[starts + length].astype(np.int32)
  return {"x": x.reshape(len(starts), length), "y": y}
