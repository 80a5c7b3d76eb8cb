"""Partitioners: split a centralized dataset into clients, deterministically under a seed.

Each partitioner returns a `Partition`: one index array per client and a
summary (client sizes and, when labels are given, a per-client label
histogram). `Partition.apply(arrays)` cuts the arrays into the per-client
dicts that `pack` takes.

* `iid_partition`: equal shares of a random permutation.
* `dirichlet_partition`: label skew. `method="clients"` (default) follows
  Hsu, Qi, Brown: "Measuring the Effects of Non-Identical Data Distribution for
  Federated Visual Classification" (arXiv:1909.06335): every client gets the
  same number of examples and class proportions q_k ~ Dir(alpha * p), p the
  global label distribution (alpha -> infinity: IID; alpha -> 0: one class per
  client). `method="classes"` follows Yurochkin et al., "Bayesian Nonparametric
  Federated Learning of Neural Networks" (ICML 2019, arXiv:1905.12022) as used
  by Li et al., "Federated Learning on Non-IID Data Silos: An Experimental
  Study" (ICDE 2022, arXiv:2102.02079): each class is split across clients with
  proportions ~ Dir(alpha * 1_N), so client sizes vary too.
* `shard_partition`: McMahan, Moore, Ramage, Hampson, Agüera y Arcas,
  "Communication-Efficient Learning of Deep Networks from Decentralized Data"
  (AISTATS 2017, arXiv:1602.05629): sort by label, cut into
  `num_clients * shards_per_client` equal shards, deal shards at random
  (their pathological non-IID split with 2 shards per client).
* `label_partition`: every client holds exactly k classes, each class split
  evenly among the clients holding it (the "k classes per client" split).
* `power_law_partition`: client sizes n_k proportional to rank^-exponent
  (Zipf), examples assigned at random.
* `natural_partition`: one client per value of a column (writer, speaker, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fedjax_opt.core.validation import check_num_clients

__all__ = ["PARTITIONERS", "Partition", "dirichlet_partition", "iid_partition", "label_partition", "make_partition",
           "natural_partition", "power_law_partition", "shard_partition"]


@dataclasses.dataclass(frozen=True)
class Partition:
  """Client index lists and their summary.

  Attributes:
    client_indices: one int64 array of example indices per client.
    sizes: `[K]` number of examples of each client.
    label_histogram: `[K, L]` count of each label per client, or None without labels.
    method: name of the partitioner.
    client_names: one name per client (natural partitions), or None.
  """

  client_indices: tuple[np.ndarray, ...]
  sizes: np.ndarray
  label_histogram: np.ndarray | None
  method: str
  client_names: tuple[str, ...] | None = None

  @property
  def num_clients(self) -> int:
    return len(self.client_indices)

  def apply(self, arrays: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
    """Cuts `{feature: array [n, ...]}` into per-client dicts `{feature: [n_k, ...]}`."""
    host = {k: np.asarray(v) for k, v in arrays.items()}
    lengths = {k: len(v) for k, v in host.items()}
    if len(set(lengths.values())) != 1:
      raise ValueError(f"arrays have different numbers of examples: {lengths}.")
    n = next(iter(lengths.values()))
    top = max((int(idx.max()) for idx in self.client_indices if idx.size), default=-1)
    if top >= n:
      raise ValueError(f"the partition indexes example {top}, but arrays hold {n} examples.")
    return [{k: v[idx] for k, v in host.items()} for idx in self.client_indices]

  def summary(self) -> str:
    """Sizes and label coverage in a few lines."""
    s = self.sizes
    lines = [f"{self.method} partition: {self.num_clients} clients, {int(s.sum())} examples, "
             f"sizes min {s.min()} / median {int(np.median(s))} / max {s.max()}"]
    if self.label_histogram is not None:
      labels_per_client = (self.label_histogram > 0).sum(axis=1)
      lines.append(f"  labels per client: mean {labels_per_client.mean():.2f}, "
                   f"min {labels_per_client.min()}, max {labels_per_client.max()}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Input checks.
# ----------------------------------------------------------------------------


def _labels(labels: Any, name: str = "labels") -> np.ndarray:
  y = np.asarray(labels)
  if y.ndim != 1:
    raise ValueError(f"{name} must be a 1-D array of class indices [n]; got shape {y.shape}.")
  if y.size == 0:
    raise ValueError(f"{name} is empty.")
  if y.dtype.kind not in "iu":
    if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
      y = y.astype(np.int64)
    else:
      raise ValueError(f"{name} must hold integer class indices; got dtype {y.dtype}.")
  if y.min() < 0:
    raise ValueError(f"{name} must be non-negative class indices; got minimum {y.min()}.")
  return y.astype(np.int64)


def _labels_or_count(labels: Any) -> tuple[int, np.ndarray | None]:
  if isinstance(labels, (int, np.integer)) and not isinstance(labels, bool):
    if labels < 1:
      raise ValueError(f"labels (the number of examples) must be >= 1; got {labels}.")
    return int(labels), None
  y = _labels(labels)
  return len(y), y


def _check_num_clients(num_clients: Any, n: int) -> int:
  num_clients = check_num_clients(num_clients)
  if num_clients > n:
    raise ValueError(f"num_clients={num_clients} exceeds the {n} examples: every client needs at least one.")
  return int(num_clients)


def _check_positive(value: Any, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a number; got {type(value).__name__}.")
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be finite and > 0; got {value}.")
  return float(value)


def _rng(seed: Any) -> np.random.Generator:
  if isinstance(seed, np.random.Generator):
    return seed
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(f"seed must be an int or a numpy Generator; got {type(seed).__name__}.")
  return np.random.default_rng(int(seed))


def _finish(indices: Sequence[np.ndarray], labels: np.ndarray | None, method: str,
            num_classes: int | None = None, names: Sequence[str] | None = None) -> Partition:
  idx = tuple(np.sort(np.asarray(i, np.int64)) for i in indices)
  sizes = np.array([len(i) for i in idx], np.int64)
  hist = None
  if labels is not None:
    width = max(int(labels.max()) + 1, num_classes or 0)
    hist = np.stack([np.bincount(labels[i], minlength=width) for i in idx]).astype(np.int64)
  return Partition(idx, sizes, hist, method, None if names is None else tuple(names))


def _even_sizes(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
  """k sizes summing to n that differ by at most one; the larger ones at random clients."""
  sizes = np.full(k, n // k, np.int64)
  sizes[rng.permutation(k)[: n % k]] += 1
  return sizes


# ----------------------------------------------------------------------------
# Partitioners.
# ----------------------------------------------------------------------------


def iid_partition(labels: Any, num_clients: int, *, seed: Any = 0) -> Partition:
  """IID split: a random permutation cut into `num_clients` near-equal parts.

  Args:
    labels: `[n]` int class indices (for the summary), or the number of examples n.
    num_clients: K.
    seed: int or numpy Generator.

  Returns:
    A `Partition` with sizes differing by at most one.
  """
  n, y = _labels_or_count(labels)
  k = _check_num_clients(num_clients, n)
  rng = _rng(seed)
  order = rng.permutation(n)
  bounds = np.concatenate([[0], np.cumsum(_even_sizes(n, k, rng))])
  return _finish([order[bounds[i]:bounds[i + 1]] for i in range(k)], y, "iid")


def dirichlet_partition(labels: Any, num_clients: int, alpha: float, *, seed: Any = 0,
                        method: str = "clients") -> Partition:
  """Dirichlet label skew (see the module docstring for both methods).

  `method="clients"`: client k has n/K examples with class proportions
  q_k ~ Dir(alpha * p). Clients, in random order, draw their examples from
  those not yet assigned, class c with probability proportional to
  q_kc times the share of class c still unassigned: q_k at the start, and a
  class fades out as it runs dry instead of leaving its shortfall to the last
  clients (with huge alpha this is sampling without replacement from the
  pool, so every client's histogram is close to the global one). If q_k has
  no mass on the classes left, the client draws from what is left. `method="classes"`: for each class c, the
  proportions over clients ~ Dir(alpha * 1_K); clients may end up empty for
  small alpha.

  Args:
    labels: `[n]` int class indices.
    num_clients: K.
    alpha: concentration > 0; large alpha approaches IID.
    seed: int or numpy Generator.
    method: "clients" (Hsu et al. 2019, equal sizes) or "classes" (per-class split).

  Returns:
    A `Partition`; every example lands in exactly one client.
  """
  y = _labels(labels)
  k = _check_num_clients(num_clients, len(y))
  alpha = _check_positive(alpha, "alpha")
  if method not in ("clients", "classes"):
    raise ValueError(f"method must be 'clients' or 'classes'; got {method!r}.")
  rng = _rng(seed)
  num_labels = int(y.max()) + 1
  by_class = [rng.permutation(np.flatnonzero(y == c)) for c in range(num_labels)]
  class_sizes = np.array([len(c) for c in by_class], np.int64)
  if method == "clients":
    counts = _client_dirichlet_counts(class_sizes, k, alpha, rng)
  else:
    counts = _class_dirichlet_counts(class_sizes, k, alpha, rng)
  indices = [[] for _ in range(k)]
  for c, members in enumerate(by_class):
    bounds = np.concatenate([[0], np.cumsum(counts[:, c])])
    for i in range(k):
      indices[i].append(members[bounds[i]:bounds[i + 1]])
  return _finish([np.concatenate(parts) for parts in indices], y, f"dirichlet({method}, alpha={alpha:g})")


def _client_dirichlet_counts(class_sizes: np.ndarray, k: int, alpha: float,
                             rng: np.random.Generator) -> np.ndarray:
  """`[K, L]` counts: rows sum to near-equal sizes, columns to class sizes."""
  n = int(class_sizes.sum())
  prior = class_sizes / n
  present = prior > 0
  q = np.zeros((k, len(class_sizes)))
  q[:, present] = rng.dirichlet(alpha * prior[present], size=k)
  sizes = _even_sizes(n, k, rng)
  left = class_sizes.copy()
  counts = np.zeros((k, len(class_sizes)), np.int64)
  safe_sizes = np.maximum(class_sizes, 1)
  for i in rng.permutation(k):
    need = int(sizes[i])
    while need > 0:
      w = q[i] * left / safe_sizes
      if not np.isfinite(w.sum()) or w.sum() <= 0:
        w = left.astype(np.float64)
      draw = np.minimum(rng.multinomial(need, w / w.sum()), left)
      counts[i] += draw
      left -= draw
      need -= int(draw.sum())
  return counts


def _class_dirichlet_counts(class_sizes: np.ndarray, k: int, alpha: float,
                            rng: np.random.Generator) -> np.ndarray:
  counts = np.zeros((k, len(class_sizes)), np.int64)
  for c, size in enumerate(class_sizes):
    if size:
      p = rng.dirichlet(np.full(k, alpha))
      counts[:, c] = _largest_remainder(p * size, int(size))
  return counts


def _largest_remainder(target: np.ndarray, total: int) -> np.ndarray:
  """Integers summing to `total`, each within one of the real-valued `target`."""
  base = np.floor(target).astype(np.int64)
  short = total - int(base.sum())
  if short > 0:
    base[np.argsort(-(target - base), kind="stable")[:short]] += 1
  return base


def shard_partition(labels: Any, num_clients: int, shards_per_client: int = 2, *,
                    seed: Any = 0) -> Partition:
  """McMahan et al.'s pathological split: label-sorted shards dealt at random.

  Examples are sorted by label (ties in random order), cut into
  `num_clients * shards_per_client` shards of near-equal size, and each client
  receives `shards_per_client` random shards, so it sees at most that many
  labels (2 shards of MNIST: mostly 2 digits).

  Args:
    labels: `[n]` int class indices.
    num_clients: K.
    shards_per_client: shards per client (2 in the paper).
    seed: int or numpy Generator.

  Returns:
    A `Partition`; every example lands in exactly one client.
  """
  y = _labels(labels)
  k = _check_num_clients(num_clients, len(y))
  if isinstance(shards_per_client, bool) or not isinstance(shards_per_client, (int, np.integer)) \
      or shards_per_client < 1:
    raise ValueError(f"shards_per_client must be an int >= 1; got {shards_per_client!r}.")
  num_shards = k * int(shards_per_client)
  if num_shards > len(y):
    raise ValueError(f"num_clients * shards_per_client = {num_shards} shards exceeds the {len(y)} examples.")
  rng = _rng(seed)
  shuffled = rng.permutation(len(y))
  order = shuffled[np.argsort(y[shuffled], kind="stable")]
  shards = np.array_split(order, num_shards)
  deal = rng.permutation(num_shards).reshape(k, int(shards_per_client))
  return _finish([np.concatenate([shards[s] for s in row]) for row in deal], y,
                 f"shards({shards_per_client} per client)")


def label_partition(labels: Any, num_clients: int, classes_per_client: int = 2, *, seed: Any = 0) -> Partition:
  """Every client holds exactly `classes_per_client` distinct classes.

  Classes are laid round-robin over a random class order, client i getting
  classes `order[(i * k + j) mod L]` for j < k, so each class is held by
  about `K k / L` clients; a class's examples are split evenly among them.

  Args:
    labels: `[n]` int class indices.
    num_clients: K.
    classes_per_client: k (default 2), with `1 <= k <= L` and `K k >= L` (every class assigned).
    seed: int or numpy Generator.

  Returns:
    A `Partition`; every example lands in exactly one client.
  """
  y = _labels(labels)
  k = _check_num_clients(num_clients, len(y))
  present = np.unique(y)
  num_labels = len(present)
  if isinstance(classes_per_client, bool) or not isinstance(classes_per_client, (int, np.integer)) \
      or not 1 <= classes_per_client <= num_labels:
    raise ValueError(f"classes_per_client must be an int in [1, {num_labels}] (the labels present); "
                     f"got {classes_per_client!r}.")
  if k * classes_per_client < num_labels:
    raise ValueError(f"num_clients * classes_per_client = {k * classes_per_client} < {num_labels} labels: "
                     "some classes would belong to no client.")
  rng = _rng(seed)
  order = present[rng.permutation(num_labels)]
  holders = {int(c): [] for c in present}
  for i in range(k):
    for j in range(classes_per_client):
      holders[int(order[(i * classes_per_client + j) % num_labels])].append(i)
  indices = [[] for _ in range(k)]
  for c, owners in holders.items():
    members = rng.permutation(np.flatnonzero(y == c))
    if len(members) < len(owners):
      raise ValueError(f"class {c} has {len(members)} examples for {len(owners)} clients holding it; "
                       "lower num_clients or classes_per_client.")
    for owner, part in zip(owners, np.array_split(members, len(owners))):
      indices[owner].append(part)
  return _finish([np.concatenate(p) for p in indices], y, f"labels({classes_per_client} per client)")


def power_law_partition(labels: Any, num_clients: int, exponent: float = 1.0, *, min_size: int = 1,
                        seed: Any = 0) -> Partition:
  """Power-law (Zipf) client sizes, examples assigned at random.

  Sizes are `min_size + (n - K min_size) * r^-exponent / sum_j j^-exponent`
  for ranks r = 1..K (largest-remainder rounding), given to clients in random
  order. The largest client holds about `1 / H_K` of the data for exponent 1,
  so the padding of `pack` grows like K / ln K (19x for K = 100): `pack`'s
  default `max_padding_factor=10` refuses that, while `fo.data.load` /
  `federate` accept it up to 1 GiB of padded data (`max_padding_factor="auto"`).

  Args:
    labels: `[n]` int class indices (for the summary), or the number of examples n.
    num_clients: K.
    exponent: power-law exponent > 0 (0 would be equal sizes).
    min_size: examples every client gets first.
    seed: int or numpy Generator.

  Returns:
    A `Partition`; every example lands in exactly one client.
  """
  n, y = _labels_or_count(labels)
  k = _check_num_clients(num_clients, n)
  exponent = _check_positive(exponent, "exponent")
  if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
    raise ValueError(f"min_size must be an int >= 0; got {min_size!r}.")
  if k * min_size > n:
    raise ValueError(f"num_clients * min_size = {k * min_size} exceeds the {n} examples.")
  rng = _rng(seed)
  weights = np.arange(1, k + 1, dtype=np.float64) ** -exponent
  extra = _largest_remainder(weights / weights.sum() * (n - k * min_size), n - k * min_size)
  sizes = (min_size + extra)[rng.permutation(k)]
  order = rng.permutation(n)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  return _finish([order[bounds[i]:bounds[i + 1]] for i in range(k)], y, f"power_law(exponent={exponent:g})")


def natural_partition(groups: Any, *, labels: Any = None, min_size: int = 1) -> Partition:
  """One client per distinct value of `groups` (writer, speaker, country, ...).

  Clients are ordered by sorted group value and named by it. Groups with
  fewer than `min_size` examples are left out (their examples belong to no
  client).

  Args:
    groups: `[n]` array of group ids (ints or strings).
    labels: optional `[n]` int labels for the summary histogram.
    min_size: smallest group kept.

  Returns:
    A `Partition` with `client_names`.
  """
  g = np.asarray(groups)
  if g.ndim != 1 or g.size == 0:
    raise ValueError(f"groups must be a non-empty 1-D array [n]; got shape {g.shape}.")
  if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 1:
    raise ValueError(f"min_size must be an int >= 1; got {min_size!r}.")
  y = None
  if labels is not None:
    y = _labels(labels)
    if len(y) != len(g):
      raise ValueError(f"labels has {len(y)} entries; groups has {len(g)}.")
  values, inverse = np.unique(g, return_inverse=True)
  members = np.argsort(inverse, kind="stable")
  bounds = np.concatenate([[0], np.cumsum(np.bincount(inverse, minlength=len(values)))])
  keep = [i for i in range(len(values)) if bounds[i + 1] - bounds[i] >= min_size]
  if not keep:
    raise ValueError(f"no group has min_size={min_size} examples.")
  return _finish([members[bounds[i]:bounds[i + 1]] for i in keep], y, "natural",
                 names=[str(values[i]) for i in keep])


PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "iid": iid_partition,
    "dirichlet": dirichlet_partition,
    "shards": shard_partition,
    "labels": label_partition,
    "power_law": power_law_partition,
}


def make_partition(method: str, labels: Any, num_clients: int, *, seed: Any = 0, **options: Any) -> Partition:
  """Partitions by name: "iid", "dirichlet", "shards", "labels" or "power_law".

  Args:
    method: partitioner name.
    labels: `[n]` int labels.
    num_clients: K.
    seed: int or numpy Generator.
    **options: the partitioner's own options (alpha, shards_per_client,
      classes_per_client, exponent, min_size, method).
  """
  if method not in PARTITIONERS:
    raise ValueError(f"partition must be one of {sorted(PARTITIONERS)}; got {method!r}.")
  fn = PARTITIONERS[method]
  try:
    return fn(labels, num_clients, seed=seed, **options)
  except TypeError as err:
    if "unexpected keyword" in str(err) or "missing" in str(err):
      raise TypeError(f"partition '{method}': {err}") from None
    raise
