"""The host loop of a host-driven algorithm (FedMA): a chunk of rounds as a Python loop, for `fo.train`.

An algorithm whose round cannot be one compiled program (FedMA: a Hungarian
matching per layer on the host, hidden widths that grow) is an object with
`init(params, key)` and `run(state, batches) -> state`
(`fo.algorithms.fedma`; `fedjax_opt.train.is_host_driven` recognises it).
`fo.train` runs it under the same driver as a `FederatedAlgorithm`: the
rounds of a chunk are the Python loop of `run_chunk`, each drawing its
batches with the driver's jitted sampler and the key `fold_in(key(seed), r)`,
so sampling, seeds, evaluation, progress, history, checkpoints, resume (bit
for bit), Ctrl-C and divergence behave as for a `FederatedAlgorithm`. Its
checkpoints are restored in the shapes they were saved in (a grown model),
not the template's. The memory check does not apply (nothing is compiled as
one program); the metric functions must accept every width the model
reaches.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from fedjax_opt.core.types import ClientBatches

__all__ = ["run_chunk"]

PyTree = Any


def run_chunk(algorithm: Any, state: PyTree, dataset: Any, length: int,
              sample: Callable[[Any, Any], ClientBatches]) -> tuple[PyTree, dict[str, np.ndarray]]:
  """`length` rounds of `algorithm.run`, each on `sample(state.round, dataset)`.

  Args:
    algorithm: a host-driven algorithm (`init`, `run(state, batches) -> state`).
    state: its state; `state.round` counts the rounds run.
    dataset: the packed `FederatedDataset` the rounds are drawn from.
    length: rounds to run.
    sample: `(round, dataset) -> ClientBatches`, the round's clients and batches.

  Returns:
    (the state after `length` rounds, `{name: [length, ...]}` its metrics after each round, on the host).
  """
  rows = []
  for _ in range(length):
    state = algorithm.run(state, sample(state.round, dataset))
    rows.append(jax.device_get(state.metrics))
  return state, {k: np.stack([np.asarray(row[k]) for row in rows]) for k in rows[0]}
