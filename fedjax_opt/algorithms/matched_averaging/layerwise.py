"""Layer-wise matched averaging: FedMA's Algorithm 1, bottom layer to top, shared by `pfnm` and `fedma`.

Wang, Yurochkin, Sun, Papailiopoulos, Khazaeni. "Federated Learning with
Matched Averaging." ICLR 2020. arXiv:2002.06440. (FedMA: layer-wise matching,
each matching followed by local retraining of the layers above, Algorithm 1.)

For each hidden layer n = 1 … N−1 in forward order: BBP-MAP (`matching.py`)
matches the J clients' neurons (`neurons.py`), the global layer n is the mean
of the neurons matched to each global neuron, every client takes the global
layer and moves its next layer's inputs to the global positions, and (FedMA
only) the clients retrain layers n+1 … N with layers 1 … n frozen. Without
the retraining (`pfnm`) an input coordinate of the next layer is averaged
over the matched clients that have that input neuron only.

The last layer (the classifier, K classes) is not matched: W_N[:, k] =
Σ_j p_jk W_{j,N}[:, k] with p_jk = n_jk / Σ_j' n_j'k, the share of class k's
examples held by client j (FedMA, Algorithm 1); a class no client holds falls
back to the n_j weights.

Deviations from the papers' code, on purpose. (1) A global neuron is the
plain mean of the client neurons matched to it (FedMA, Algorithm 1:
W_n = (1/J) Σ_j W_{j,n} Π_jᵀ with every client matched), not the posterior
mean (a_i / p_i) of the papers' code, which shrinks toward μ₀: so a single
client, or J permuted copies of one network, are returned exactly. (2) PFNM
matches a one-hidden-layer net on [incoming weights, bias, outgoing weights];
here every layer is matched on its incoming weights and bias (FedMA's
layer-wise rule, also for one-shot `pfnm`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.algorithms.matched_averaging.matching import LayerPrior, bbp_map
from fedjax_opt.algorithms.matched_averaging.neurons import apply_assignment, as_neurons, expand_inputs, from_neurons

__all__ = ["Matched", "match_layers"]


def _average(vectors: list[np.ndarray], assignments: list[np.ndarray], owned: list[np.ndarray],
             weights: list[np.ndarray], width: int) -> np.ndarray:
  """Global neuron g, coordinate d: Σ_j w_jl own_j[d] v_jl[d] / Σ_j w_jl own_j[d] over the j, l with π_j(l) = g."""
  dim = vectors[0].shape[1]
  num, den = np.zeros((width, dim)), np.zeros((width, dim))
  for v, a, own, w in zip(vectors, assignments, owned, weights):
    np.add.at(num, a, w[:, None] * own[None] * v)
    np.add.at(den, a, w[:, None] * own[None] * np.ones_like(v))
  return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def _class_weights(class_counts: np.ndarray | None, client_weights: np.ndarray, num_classes: int) -> list[np.ndarray]:
  """p_jk = n_jk / Σ_j n_jk per class; n_j where no client holds class k (or no counts are given)."""
  fallback = np.tile(client_weights[:, None], (1, num_classes))
  if class_counts is None:
    return list(fallback)
  counts = np.asarray(class_counts, np.float64)
  if counts.shape != fallback.shape:
    raise ValueError(f"class_counts must be [J, K] = {fallback.shape}; got shape {counts.shape}.")
  held = counts.sum(axis=0) > 0
  return list(np.where(held[None], counts, fallback))


class _Layerwise(NamedTuple):
  """The state of a layer-wise matching: each client's params (host), and which input coordinates it owns."""

  params: list[dict]
  owned: list[np.ndarray]


class Matched(NamedTuple):
  """What `match_layers` returns.

  Attributes:
    params: the global params (jnp arrays), None when every client's retraining diverged.
    widths: the global hidden widths, one per matched layer.
    uploaded: the floats the clients uploaded (each layer once per client).
    diverged: the clients left out after a retraining diverged.
    assignments: per hidden layer, per client (in the order given) its units' global indices `[L_j,n]`, or None
      for a client left out before that layer was matched.
  """

  params: dict | None
  widths: list[int]
  uploaded: int
  diverged: int
  assignments: list[list[np.ndarray | None]]


def match_layers(client_params: list[dict], layers: tuple[str, ...], client_weights: np.ndarray,
                 class_counts: np.ndarray | None,
                 retrain: Callable[[list[dict], int, np.ndarray], list[dict]] | None,
                 seed: int, prior: LayerPrior) -> Matched:
  """Algorithm 1 of FedMA (PFNM one-shot when `retrain` is None), layer n matched with `prior.for_layer(n, ...)`.

  `retrain(params_list, first, rows)` trains layers[first:] of the clients `rows` (indices into
  `client_params`). A client whose retrained model is not finite is left out of every later layer and of the
  classifier (counted in `diverged`); if none is left, the params are None.
  """
  state = _Layerwise(params=[dict(p) for p in client_params],
                     owned=[np.ones(as_neurons(p[layers[0]]).shape[1]) for p in client_params])
  widths, uploaded, assignments = [], 0, []
  alive = np.arange(len(client_params))
  for n, name in enumerate(layers[:-1]):
    vectors = [as_neurons(p[name]) for p in state.params]
    uploaded += sum(v.size for v in vectors)
    matching = bbp_map(vectors, seed=seed + n, **prior.for_layer(n, vectors))
    per_client: list[np.ndarray | None] = [None] * len(client_params)
    for row, a in zip(alive, matching.assignments):
      per_client[row] = np.asarray(a, np.int64)
    assignments.append(per_client)
    ones = [np.ones(v.shape[0]) for v in vectors]
    merged = _average(vectors, matching.assignments, state.owned, ones, matching.width)
    dtype = np.asarray(state.params[0][name]["kernel"]).dtype
    kernel_shape = np.shape(state.params[0][name]["kernel"])
    global_layer = from_neurons(merged, kernel_shape, dtype)
    owned = []
    for j, a in enumerate(matching.assignments):
      above = state.params[j][layers[n + 1]]["kernel"]
      owned.append(np.concatenate([expand_inputs(np.ones(np.shape(above)[:-1] + (1,)), a, matching.width)
                                   .reshape(-1), [1.0]]))
    state = _Layerwise(
        params=[apply_assignment(p, layers, n, a, matching.width, global_layer)
                for p, a in zip(state.params, matching.assignments)],
        owned=owned)
    if retrain is not None:  # clients train layers n+1 … N with layers 1 … n frozen: every input row is theirs now
      trained = retrain(state.params, n + 1, alive)
      finite = np.asarray([all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(p)) for p in trained])
      if not finite.all():  # a client whose retraining diverged leaves the round: it is not matched any further
        if not finite.any():
          return Matched(None, widths, uploaded, len(client_params), assignments)
        trained, alive = [p for p, ok in zip(trained, finite) if ok], alive[finite]
      state = _Layerwise(params=trained, owned=[np.ones_like(o) for o, ok in zip(owned, finite) if ok])
    widths.append(matching.width)
  name = layers[-1]
  vectors = [as_neurons(p[name]) for p in state.params]
  uploaded += sum(v.size for v in vectors)
  counts = None if class_counts is None else np.asarray(class_counts, np.float64)[alive]
  weights = _class_weights(counts, client_weights[alive], vectors[0].shape[0])
  identity = [np.arange(v.shape[0]) for v in vectors]
  merged = _average(vectors, identity, state.owned, weights, vectors[0].shape[0])
  out = dict(state.params[0])
  out[name] = from_neurons(merged, np.shape(out[name]["kernel"]), np.asarray(out[name]["kernel"]).dtype)
  return Matched({k: jax.tree.map(jnp.asarray, out[k]) for k in layers}, widths, uploaded,
                 len(client_params) - len(alive), assignments)
