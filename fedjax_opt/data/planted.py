"""Planted groups of clients: populations that one global model cannot serve, with known membership.

`plant_groups(dataset, num_groups, kind=..., seed=...)` splits the N clients
of a federated dataset into G groups of (as nearly as possible) equal size,
at random by `seed`, and transforms every example of a client of group g
(train and test slots alike) by group g's map:

* `"labels"`: the label y becomes π_g(y), with π_0 the identity and π_1 …
  π_{G−1} random permutations of the K classes, each different from the
  identity and from each other (conflicting labels: the same input means a
  different class in each group; clustered FL's and IFCA's setting, Sattler
  et al. 2020 §V, Ghosh et al. 2020 §6).
* `"rotate"`: the image (examples `[H, W]` or `[H, W, C]`, H = W) is rotated
  by g · 90° (so G ≤ 4; IFCA's rotated-MNIST experiment uses 0°, 90°, 180°,
  270°): the same label, a different input distribution.

The returned dataset is otherwise unchanged (client sizes, splits, padding);
its centralized test set, if any, is dropped (it belongs to no group). The
planted membership comes back beside it, `groups` `[N]` int, which is what
a clustering is scored against (`fedjax_opt.core.clusters.adjusted_rand_index`).
"""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import numpy as np

from fedjax_opt.data.dataset import FederatedDataset

__all__ = ["PLANTED_KINDS", "plant_groups"]

PLANTED_KINDS = ("labels", "rotate")


def _permutations(num_groups: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
  """`[G, K]`: the identity, then G − 1 distinct random non-identity permutations of the K classes."""
  if num_groups > math.factorial(num_classes):
    raise ValueError(f"plant_groups: {num_groups} groups need {num_groups} distinct permutations of "
                     f"{num_classes} classes; there are only {math.factorial(num_classes)}.")
  perms = [np.arange(num_classes)]
  seen = {tuple(perms[0])}
  if num_classes <= 6:  # few permutations: draw from all of them without repeats
    pool = [np.asarray(p) for p in itertools.permutations(range(num_classes)) if p not in seen]
    for i in rng.permutation(len(pool))[:num_groups - 1]:
      perms.append(pool[i])
    return np.stack(perms)
  while len(perms) < num_groups:
    p = rng.permutation(num_classes)
    if tuple(p) not in seen:
      seen.add(tuple(p))
      perms.append(p)
  return np.stack(perms)


def plant_groups(dataset: FederatedDataset, num_groups: int, *, kind: str = "labels",
                 seed: int = 0) -> tuple[FederatedDataset, np.ndarray]:
  """(the dataset with each group's map applied to its clients' examples, planted group of each client `[N]`).

  Args:
    dataset: a `FederatedDataset` of examples with "x" and integer labels "y" (not token windows).
    num_groups: G ≥ 1 (≤ N; `"rotate"`: ≤ 4).
    kind: "labels" (group g's labels permuted by π_g) or "rotate" (group g's images rotated by g · 90°).
    seed: seeds the assignment of clients to groups and the permutations.

  Returns:
    `(planted dataset, groups)`; `groups[k]` is client k's group, G groups of sizes ⌊N/G⌋ or ⌈N/G⌉.
  """
  if not isinstance(dataset, FederatedDataset):
    raise TypeError(f"plant_groups: dataset must be a FederatedDataset; got {type(dataset).__name__}.")
  if kind not in PLANTED_KINDS:
    raise ValueError(f"plant_groups: kind must be one of {', '.join(PLANTED_KINDS)}; got {kind!r}.")
  if dataset.sequence_length > 0 or "x" not in dataset.examples or "y" not in dataset.examples:
    raise ValueError("plant_groups: the dataset must hold examples {'x', 'y'} (not token windows).")
  n = dataset.num_clients
  if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or not 1 <= num_groups <= n:
    raise ValueError(f"plant_groups: num_groups must be an integer in [1, {n}] (the clients); got {num_groups!r}.")
  num_groups = int(num_groups)
  rng = np.random.default_rng(seed)
  groups = np.empty(n, np.int64)
  groups[rng.permutation(n)] = np.arange(n) % num_groups
  examples = dict(dataset.examples)
  if kind == "labels":
    k = dataset.num_classes or int(np.asarray(examples["y"]).max()) + 1
    perms = _permutations(num_groups, k, rng)
    y = np.asarray(examples["y"])
    slot = np.arange(y.shape[1])[None, :]
    train, start, test = (np.asarray(a)[:, None] for a in (dataset.train_count, dataset.test_start,
                                                            dataset.test_count))
    real = (slot < train) | ((slot >= start) & (slot < start + test))  # padding keeps its zeros
    mapped = np.take_along_axis(perms[groups], y.reshape(n, -1), axis=1).reshape(y.shape)
    examples["y"] = jnp.asarray(np.where(real.reshape(real.shape + (1,) * (y.ndim - 2)), mapped, y),
                                dtype=examples["y"].dtype)
  else:
    x = np.asarray(examples["x"])
    if x.ndim not in (4, 5) or x.shape[2] != x.shape[3]:
      raise ValueError(f"plant_groups: kind='rotate' needs square images [N, slots, H, W(, C)]; the examples are "
                       f"{x.shape[2:]}.")
    if num_groups > 4:
      raise ValueError(f"plant_groups: kind='rotate' has 4 rotations (0°, 90°, 180°, 270°); got {num_groups} groups.")
    rotated = np.stack([np.rot90(x[c], k=int(groups[c]), axes=(1, 2)) for c in range(n)])
    examples["x"] = jnp.asarray(rotated, dtype=examples["x"].dtype)
  return dataset.replace(examples=examples, central_test=None), groups
