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
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from fedjax_opt.core.types import PyTree
from fedjax_opt.data.sampling import client_batches

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
  """Example-weighted and client-mean summaries of `per_client_sums` output."""
  count = sums["count"]
  has = count > 0
  out = {}
  for name, total in sums.items():
    if name == "count":
      continue
    out[name] = jnp.sum(total) / jnp.maximum(jnp.sum(count), 1)
    per_client = total / jnp.maximum(count, 1)
    out[name + "_client_mean"] = jnp.sum(jnp.where(has, per_client, 0)) / jnp.maximum(jnp.sum(has), 1)
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
