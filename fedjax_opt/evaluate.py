"""Evaluation of a model on a packed federated dataset, inside jit.

`global_model(params, dataset, metric_fns)` evaluates one model on every
client's examples of a split and returns, for each per-example metric
`fn(params, batch) -> [B]`:

* `name`: the mean over all examples of the split (each example counts once,
  so large clients count more: the federated objective's weighting);
* `name + "_client_mean"`: the mean over clients of each client's own mean
  (every client counts once, the view of personalization papers), over the
  clients that hold at least one example of the split.

Clients are evaluated `chunk_clients` at a time (a compiled loop over chunks),
so memory stays bounded on datasets with many clients.

Personalized models. `personalized(per_client_params, dataset, metric_fns)`
evaluates client i with its own model (row i of a `[N, ...]` table, the
`state.local_params` of any algorithm that keeps per-client models, read
with `fo.personalized_params(state)`) on its own examples, and
`adapted(params, adapt_fn, dataset, metric_fns)` with a model made on the
client from its train split (`algorithm.personalize` of Per-FedAvg's
one-step adaptation or FedAvg + fine-tuning's local steps).
Both map clients through `fedjax_opt.core.client_map.map_clients` and return
a `PersonalizedEvaluation`: each client's value, and over the clients holding
at least one example of the split (the others are excluded and counted) the
mean over clients, the example-weighted mean, a low percentile (the 10th by
default: how the worst-served clients fare) and a fixed-bin histogram.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.types import PyTree
from fedjax_opt.core.validation import check_choice, check_int, is_concrete
from fedjax_opt.data.dataset import FederatedDataset
from fedjax_opt.data.sampling import client_batches

__all__ = ["MetricFn", "PersonalizedEvaluation", "adapted", "centralized", "global_model", "histogram",
           "percentile_suffix", "personalized", "summarize"]

MetricFn = Callable[[PyTree, Any], jax.Array]


def _check_metric_fns(metric_fns: Mapping[str, MetricFn]) -> None:
  if not isinstance(metric_fns, Mapping) or not metric_fns:
    raise TypeError("metric_fns must be a non-empty dict name -> fn(params, batch) -> [B], "
                    "e.g. {'loss': model.loss_fn, 'accuracy': model.accuracy_fn}.")
  for name, fn in metric_fns.items():
    if not callable(fn):
      raise TypeError(f"metric_fns[{name!r}] must be callable fn(params, batch) -> [B]; got {type(fn).__name__}.")


def per_client_sums(params: PyTree, data: PyTree, mask: jax.Array, metric_fns: Mapping[str, MetricFn]) -> dict:
  """Σ over each client's real examples of each metric: `{name: [C]}`, plus `"count": [C]`.

  Args:
    data: pytree of `[C, S, B, ...]` arrays; mask `[C, S, B]` bool.
  """
  c, s, b = mask.shape
  flat = jax.tree.map(lambda a: a.reshape((c * s * b,) + a.shape[3:]), data)
  flat_mask = mask.reshape(-1)
  sums = {}
  for name, fn in metric_fns.items():
    values = fn(params, flat)
    if values.shape != flat_mask.shape:
      raise ValueError(f"metric_fns[{name!r}] must return one value per example [B]; got shape {values.shape}.")
    sums[name] = jnp.sum(jnp.where(flat_mask, values, 0).reshape(c, s * b), axis=1)
  sums["count"] = jnp.sum(mask.reshape(c, -1), axis=1, dtype=jnp.float32)
  return sums


def summarize(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Example-weighted and client-mean summaries of `per_client_sums` output.

  NaN when no client has an example of the split (never a misleading 0).
  """
  count = sums["count"]
  has = count > 0
  out = {}
  for name, total in sums.items():
    if name == "count":
      continue
    weighted = jnp.sum(total) / jnp.maximum(jnp.sum(count), 1)
    out[name] = jnp.where(jnp.any(has), weighted, jnp.nan)
    per_client = total / jnp.maximum(count, 1)
    client_mean = jnp.sum(jnp.where(has, per_client, 0)) / jnp.maximum(jnp.sum(has), 1)
    out[name + "_client_mean"] = jnp.where(jnp.any(has), client_mean, jnp.nan)
  return out


def global_model(params: PyTree, dataset: Any, metric_fns: Mapping[str, MetricFn], *, split: str = "test",
                 batch_size: int = 256, chunk_clients: int = 64) -> dict[str, jax.Array]:
  """Evaluates `params` on every client's `split` examples (jit-able; sizes static).

  Args:
    params: the model evaluated on every client.
    dataset: a `fedjax_opt.data.FederatedDataset`.
    metric_fns: `{name: fn(params, batch) -> [B]}`, e.g. the model's loss and accuracy.
    split: "test" (each client's held-back examples) or "train".
    batch_size: example slots per evaluation step (capped at the largest
      client's count in the split, so small clients are not padded to it).
    chunk_clients: clients evaluated at once.

  Returns:
    `{name: scalar, name + "_client_mean": scalar}` for each metric.
  """
  _check_metric_fns(metric_fns)
  # No client needs more slots than the largest client's count in this split.
  largest = dataset.max_test if split == "test" else dataset.max_train
  batch_size = max(1, min(batch_size, largest))
  n = dataset.num_clients
  chunk = min(chunk_clients, n)
  num_chunks = math.ceil(n / chunk)
  ids = jnp.arange(num_chunks * chunk, dtype=jnp.int32).reshape(num_chunks, chunk)

  def one_chunk(chunk_ids):
    valid = chunk_ids < n
    batches = client_batches(dataset, batch_size, client_ids=jnp.minimum(chunk_ids, n - 1), split=split)
    mask = batches.mask & valid[:, None, None]
    return per_client_sums(params, batches.data, mask, metric_fns)

  sums = jax.lax.map(one_chunk, ids)
  return summarize(jax.tree.map(lambda a: a.reshape(-1), sums))


def centralized(params: PyTree, examples: Mapping[str, jax.Array], metric_fns: Mapping[str, MetricFn], *,
                batch_size: int = 1024) -> dict[str, jax.Array]:
  """Evaluates `params` on a centralized test set `{"x": [M, ...], "y": [M]}` (jit-able).

  Returns:
    `{name: scalar}`, the mean of each metric over the M examples.
  """
  _check_metric_fns(metric_fns)
  m = jax.tree.leaves(examples)[0].shape[0]
  steps = math.ceil(m / batch_size)
  pad = steps * batch_size - m
  data = jax.tree.map(lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
      (1, steps, batch_size) + a.shape[1:]), dict(examples))
  mask = (jnp.arange(steps * batch_size) < m).reshape(1, steps, batch_size)
  sums = per_client_sums(params, data, mask, metric_fns)
  return {name: sums[name][0] / m for name in metric_fns}


# ---- personalized models ---------------------------------------------------------------------------------------


@flax.struct.dataclass
class PersonalizedEvaluation:
  """Result of `personalized` (a pytree: it can be returned from jit).

  Attributes:
    client_id: `[C]` int32, the clients evaluated, in order.
    per_client: `{name: [C]}`, each client's mean of each metric over its
      examples of the split; NaN for a client with no example there.
    count: `[C]` float, each client's number of examples in the split.
    evaluated: `[C]` bool, `count > 0`: the clients the summary is over.
    summary: for each metric `name`:
      `name` (mean over evaluated clients, each counting once),
      `name + "_weighted"` (example-weighted mean: Σ sums / Σ counts),
      `name + "_p<q>"` (the q-th percentile over evaluated clients, NumPy's
      "linear" method, i.e. `np.percentile(values, q)`),
      `name + "_histogram"` (`[bins]` int32 client counts over `histogram_edges`);
      plus `num_evaluated` and `num_excluded` (clients with no example).
      Every statistic is NaN when no client is evaluated.
    histogram_edges: `[bins + 1]`, equal-width edges over the histogram range.
  """

  client_id: jax.Array
  per_client: dict[str, jax.Array]
  count: jax.Array
  evaluated: jax.Array
  summary: dict[str, jax.Array]
  histogram_edges: jax.Array


def _check_percentile(percentile: Any) -> None:
  if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 <= percentile <= 100:
    raise ValueError(f"percentile must be a Python number in [0, 100]; got {percentile!r}.")


def _check_histogram(histogram_bins: Any, histogram_range: Any) -> tuple[int, float, float]:
  histogram_bins = check_int(histogram_bins, "histogram_bins")
  try:
    low, high = (float(v) for v in histogram_range)
  except (TypeError, ValueError):
    raise ValueError(f"histogram_range must be a pair (low, high) of numbers; got {histogram_range!r}.") from None
  if not (np.isfinite(low) and np.isfinite(high) and low < high):
    raise ValueError(f"histogram_range must be finite with low < high; got {histogram_range!r}.")
  return histogram_bins, low, high


def percentile_suffix(percentile: float) -> str:
  """The summary key suffix of a percentile: 10 -> "_p10", 2.5 -> "_p2_5"."""
  return f"_p{percentile:g}".replace(".", "_")


def histogram(values: jax.Array, valid: jax.Array, edges: jax.Array) -> jax.Array:
  """Counts `[bins]` of the `valid` values in the bins of `edges` `[bins + 1]` (np.histogram's bins).

  Bin j is [edges[j], edges[j + 1]), the last bin also holds edges[-1].
  Values below the first edge are counted in the first bin and values above
  the last in the last (np.histogram would drop them), so the counts always
  add up to the number of valid values.
  """
  bins = edges.shape[0] - 1
  index = jnp.sum(values[:, None] >= edges[None, 1:-1], axis=1)
  return jnp.zeros((bins,), jnp.int32).at[index].add(valid.astype(jnp.int32))


def _client_sums(metric_fns: Mapping[str, MetricFn], split: str, batch_size: int, adapt_fn: Callable | None,
                 adapt_batch_size: int):
  """Per-client function: the sums of `per_client_sums` for one client with its own (or adapted) model."""

  def fn(dataset, client):
    params, client_id = client
    ids = client_id[None]
    if adapt_fn is not None:
      train = client_batches(dataset, adapt_batch_size, client_ids=ids, split="train")
      params = adapt_fn(params, jax.tree.map(lambda a: a[0], train.data), train.mask[0])
    batches = client_batches(dataset, batch_size, client_ids=ids, split=split)
    sums = per_client_sums(params, batches.data, batches.mask, metric_fns)
    return jax.tree.map(lambda a: a[0], sums)

  return fn


def _summarize_clients(client_id, sums, metric_fns, percentile, edges) -> PersonalizedEvaluation:
  count = sums["count"]
  evaluated = count > 0
  num = jnp.sum(evaluated)
  none = num == 0
  per_client, summary = {}, {}
  for name in metric_fns:
    total = sums[name]
    values = jnp.where(evaluated, total / jnp.where(evaluated, count, 1).astype(total.dtype), jnp.nan)
    per_client[name] = values
    mean = jnp.sum(jnp.where(evaluated, values, 0)) / jnp.maximum(num, 1).astype(values.dtype)
    weighted = jnp.sum(jnp.where(evaluated, total, 0)) / jnp.maximum(jnp.sum(count), 1).astype(total.dtype)
    summary[name] = jnp.where(none, jnp.nan, mean)
    summary[name + "_weighted"] = jnp.where(none, jnp.nan, weighted)
    summary[name + percentile_suffix(percentile)] = jnp.nanpercentile(values, percentile, method="linear")
    summary[name + "_histogram"] = histogram(values, evaluated, edges.astype(values.dtype))
  summary["num_evaluated"] = num.astype(jnp.int32)
  summary["num_excluded"] = (count.shape[0] - num).astype(jnp.int32)
  return PersonalizedEvaluation(client_id=client_id, per_client=per_client, count=count, evaluated=evaluated,
                                summary=summary, histogram_edges=edges)


def _client_ids(dataset: Any, client_ids: Any) -> jax.Array:
  if client_ids is None:
    return jnp.arange(dataset.num_clients, dtype=jnp.int32)
  ids = jnp.asarray(client_ids)
  if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"client_ids must be a 1-D integer array [C]; got shape {ids.shape} dtype {ids.dtype}.")
  if is_concrete(ids) and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= dataset.num_clients):
    raise ValueError(f"client_ids must lie in [0, {dataset.num_clients}) (the dataset's clients); "
                     f"got min {int(ids.min())}, max {int(ids.max())}.")
  return ids.astype(jnp.int32)


def _check_common(dataset, metric_fns, split, batch_size):
  if not isinstance(dataset, FederatedDataset):
    raise TypeError(f"dataset must be a fedjax_opt.data.FederatedDataset; got {type(dataset).__name__}.")
  _check_metric_fns(metric_fns)
  check_choice(split, "split", ("train", "test"))
  check_int(batch_size, "batch_size")


def _evaluate_clients(shared_params, per_client_params, adapt_fn, dataset, metric_fns, split, client_ids,
                      batch_size, client_map, percentile, histogram_bins, histogram_range) -> PersonalizedEvaluation:
  _check_common(dataset, metric_fns, split, batch_size)
  _check_percentile(percentile)
  bins, low, high = _check_histogram(histogram_bins, histogram_range)
  ids = _client_ids(dataset, client_ids)
  largest = dataset.max_test if split == "test" else dataset.max_train
  eval_batch = max(1, min(batch_size, largest))
  adapt_batch = max(1, min(batch_size, dataset.max_train))
  fn = _client_sums(metric_fns, split, eval_batch, adapt_fn, adapt_batch)
  if adapt_fn is None:
    params = per_client.gather(per_client_params, ids)
  else:  # the same model for every client, adapted inside the client function
    params = jax.tree.map(lambda p: jnp.broadcast_to(p, ids.shape + jnp.shape(p)), shared_params)
  sums = client_map_lib.map_clients(client_map, fn, dataset, (params, ids))
  edges = jnp.linspace(low, high, bins + 1)
  return _summarize_clients(ids, sums, metric_fns, percentile, edges)


def personalized(per_client_params: PyTree, dataset: Any, metric_fns: Mapping[str, MetricFn], *,
                 split: str = "test", client_ids: Any = None, batch_size: int = 256,
                 client_map: client_map_lib.ClientMap | str | None = None, percentile: float = 10.0,
                 histogram_bins: int = 10, histogram_range: tuple[float, float] = (0.0, 1.0)
                 ) -> PersonalizedEvaluation:
  """Evaluates each client with its own model on its own examples of a split (jit-able; sizes static).

  Client i's metric is m_i = (1/n_i) Σ_{e ∈ D_i} fn(θ_i, e) over its n_i
  examples of the split, θ_i = row i of `per_client_params`. Over the clients
  with n_i > 0 (the others are excluded and counted in `num_excluded`) the
  summary reports the mean (1/|E|) Σ m_i, the example-weighted mean
  Σ n_i m_i / Σ n_i, the `percentile`-th percentile (NumPy's "linear"
  method) and a histogram of the m_i over `histogram_bins` equal bins of
  `histogram_range` (the default [0, 1] suits accuracies).

  Clients are mapped through `fedjax_opt.core.client_map.map_clients`; each
  client gathers its own examples inside the client function, so a chunked or
  sequential map bounds memory as it does in training.

  Args:
    per_client_params: the personalized models, a per-client table whose
      leaves are `[N, ...]`, row i = client i of `dataset` (e.g.
      `fo.personalized_params(state)`, the `state.local_params` of Ditto,
      pFedMe, EASGD, FedU, L2GD / L2SGD+ ..., or stacked adapted models).
    dataset: a `fedjax_opt.data.FederatedDataset` with N clients.
    metric_fns: `{name: fn(params, batch) -> [B]}`.
    split: "test" (default) or "train".
    client_ids: optional `[C]` ids of the clients to evaluate (default all N).
    batch_size: example slots per evaluation step (capped at the largest
      client's count in the split).
    client_map: how clients are mapped (see `fedjax_opt.core.client_map`).
    percentile: q in [0, 100] of the reported percentile (key suffix
      `_p<q>`, e.g. `_p10`).
    histogram_bins, histogram_range: the fixed histogram bins.

  Returns:
    A `PersonalizedEvaluation` (per-client values, counts and the summary).
  """
  n = dataset.num_clients if isinstance(dataset, FederatedDataset) else None
  if n is not None:
    rows = per_client.num_rows(per_client_params)
    if rows != n:
      raise ValueError(f"per_client_params must have one row per dataset client, leading axis [N] = {n}; "
                       f"got {rows}.")
  return _evaluate_clients(None, per_client_params, None, dataset, metric_fns, split, client_ids, batch_size,
                           client_map, percentile, histogram_bins, histogram_range)


def adapted(params: PyTree, adapt_fn: Callable[[PyTree, PyTree, jax.Array], PyTree], dataset: Any,
            metric_fns: Mapping[str, MetricFn], *, split: str = "test", client_ids: Any = None,
            batch_size: int = 256, client_map: client_map_lib.ClientMap | str | None = None,
            percentile: float = 10.0, histogram_bins: int = 10,
            histogram_range: tuple[float, float] = (0.0, 1.0)) -> PersonalizedEvaluation:
  """`personalized` for models made on the client: θ_i = adapt_fn(params, train data of i, mask).

  For methods that store no personalized models but adapt the served model on
  each client's own data: `algorithm.personalize` of Per-FedAvg (one
  adaptation step with its α) or FedAvg + fine-tuning (K local steps). Client i's
  train split is passed as `[S, B, ...]` batches with a `[S, B]` mask, then
  θ_i is evaluated on its `split` examples; θ_i is computed inside the client
  function, so no `[N, ...]` table is built.

  Args:
    params: the global model every client adapts.
    adapt_fn: `adapt_fn(params, data [S, B, ...], mask [S, B]) -> params`.
    dataset, metric_fns, split, client_ids, batch_size, client_map,
      percentile, histogram_bins, histogram_range: as `personalized`.

  Returns:
    A `PersonalizedEvaluation`.
  """
  if not callable(adapt_fn):
    raise TypeError(f"adapt_fn must be callable adapt_fn(params, data, mask) -> params; "
                    f"got {type(adapt_fn).__name__}.")
  return _evaluate_clients(params, None, adapt_fn, dataset, metric_fns, split, client_ids, batch_size,
                           client_map, percentile, histogram_bins, histogram_range)
