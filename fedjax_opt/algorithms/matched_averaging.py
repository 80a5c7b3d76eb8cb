"""PFNM and FedMA: average neural networks neuron by neuron after matching their hidden units.

Yurochkin, Agarwal, Ghosh, Greenewald, Hoang, Khazaeni. "Bayesian Nonparametric
Federated Learning of Neural Networks." ICML 2019. arXiv:1905.12022. (PFNM: the
Beta-Bernoulli-process model of neurons and its MAP matching, BBP-MAP.)

Wang, Yurochkin, Sun, Papailiopoulos, Khazaeni. "Federated Learning with
Matched Averaging." ICLR 2020. arXiv:2002.06440. (FedMA: layer-wise matching,
each matching followed by local retraining of the layers above, Algorithm 1.)

Why match. A hidden layer is invariant to a permutation Π of its units:
σ(x W₁) W₂ = σ(x W₁ Π) Πᵀ W₂. Two clients that learn the same features learn
them in different orders, {W₁Π_j, Π_jᵀW₂} and {W₁Π_j', Π_j'ᵀW₂}, and the
coordinate-wise average (W₁Π_j + W₁Π_j')/2 is in general no W₁Π at all. Matched
averaging undoes the permutations first: (W₁Π_jΠ_jᵀ + W₁Π_j'Π_j'ᵀ)/2 = W₁.

The neurons. The neuron l of client j in layer n is the vector v_jl ∈ ℝ^D of
its incoming weights and bias: for a dense layer (kernel [d_in, L]) the column
kernel[:, l] and bias[l], D = d_in + 1; for a convolution (flax HWIO kernel
[kh, kw, c_in, L]) the filter kernel[..., l] flattened and bias[l],
D = kh·kw·c_in + 1. Conv channels are matched exactly as dense units.

BBP-MAP (PFNM, Section 3; the cost FedMA's Algorithm 1 calls). Global neurons
θ_i ~ N(μ₀, σ₀²I); a client neuron matched to θ_i is v_jl ~ N(θ_i, σ²I); which
global neurons client j uses follows a Beta-Bernoulli process with mass γ₀.
Clients are matched one at a time against the global neurons of the others
(L₋ⱼ of them; m_i = m_i^{−j} the number of other clients using neuron i, and
s_i the sum of their matched neurons). With natural parameters
a_i = μ₀/σ₀² + s_i/σ² and precision p_i = 1/σ₀² + m_i/σ², the gain of giving
client neuron l to global neuron i (twice the increase of the log posterior at
its maximum over θ) is

    G_il = ‖a_i + v_jl/σ²‖² / (p_i + 1/σ²) − ‖a_i‖² / p_i + 2 log(m_i / (J − m_i)),      i ≤ L₋ⱼ,
    G_il = ‖μ₀/σ₀² + v_jl/σ²‖² / (1/σ₀² + 1/σ²) − ‖μ₀‖²/σ₀² + 2 log(γ₀/J) − 2 log k,   i = L₋ⱼ + k,

k = 1 … L_j (the k-th new neuron; −2 log k is the 1/k! of the Poisson number of
new neurons). The assignment B^j (each client neuron to one column, each column
at most once) maximizes Σ B_il G_il: `scipy.optimize.linear_sum_assignment` on
the L_j × (L₋ⱼ + L_j) matrix −G (Hungarian). A client neuron that matches no
global neuron well enough opens a new one: the global layer grows. With
σ₀ → ∞ and a single global neuron u used by m = 1 of J = 2 clients, the
difference is G_match − G_new = −‖u − v‖²/(2σ²) + 2 log(2/γ₀): a new neuron is
opened exactly when ‖u − v‖² > 4σ² log(2/γ₀) (tests/test_matched_averaging.py).
The first pass matches clients in order of decreasing width, the first one
founding the global layer; `iterations` more passes (PFNM's and FedMA's
code) take each client out in random order and match it again.

Deviations from the papers' code, on purpose. (1) The log-prior term of a
match is 2 log(m_i/(J − m_i)), as in PFNM's objective; the authors' code adds
log(min(m_i, 10)/(J − m_i)), half the weight of the new-neuron term. With the
consistent factor, J identical copies always match when γ₀ ≤ 1 (the defaults
here: σ = σ₀ = γ₀ = 1; FedMA's code uses γ₀ = 7 with its own weighting). (2) A
global neuron is the plain mean of the client neurons matched to it (FedMA,
Algorithm 1: W_n = (1/J) Σ_j W_{j,n} Π_jᵀ with every client matched), not the
posterior mean (a_i / p_i) of the papers' code, which shrinks toward μ₀: so a
single client, or J permuted copies of one network, are returned exactly. The
prior enters the matching only. (3) PFNM matches a one-hidden-layer net on
[incoming weights, bias, outgoing weights]; here every layer is matched on its
incoming weights and bias (FedMA's layer-wise rule, also for one-shot `pfnm`).

The last layer (the classifier, K classes) is not matched: W_N[:, k] =
Σ_j p_jk W_{j,N}[:, k] with p_jk = n_jk / Σ_j' n_j'k, the share of class k's
examples held by client j (FedMA, Algorithm 1); a class no client holds falls
back to the n_j weights.

Growth and the next layer. After matching layer n into L global neurons, client
j's neuron l sits at global index π_j(l); its next layer's input rows move
there (W_{j,n+1} ← Π_j W_{j,n+1}, Π_j an L × L_j 0/1 injection, zero rows for
the global neurons client j does not have), which leaves the client's network
function unchanged (its missing neurons have zero outgoing weights). Into a
dense layer after a convolution, through a channels-last flatten of an
[H', W', C] map (flax/jnp `reshape`), the rows move in blocks: input row
p·C + c follows channel c. One-shot `pfnm` averages an input coordinate over
the matched clients that have that input neuron only.

What is supported. Models whose parameters are a dict of layers, each
`{"kernel", "bias"}`, applied in a given order: dense (kernel rank 2) and 2-D
convolution (rank 4, HWIO) layers, with element-wise activations and pooling
between them, and a channels-last flatten from a convolution into a dense
layer. `fo.models.MLP` / `mlp_2nn` and `fo.models.EmnistCNN` / `emnist_cnn` are
of this family. Left out: recurrent layers (FedMA's LSTM matching permutes the
four gates' hidden units jointly and the recurrent kernel on both sides),
normalization layers with parameters, residual connections (a skip sum ties
the permutations of two layers), attention, and layers without bias.

How it fits the library. The matching runs on the host between layers
(one small Hungarian problem per layer) and the global layers grow, so
neither the round's control flow nor the model's shapes are static: FedMA is
not a `FederatedAlgorithm(init, step)` but a host-driven `(init, run)`.
`fo.train` runs it round by round on the host with the same sampling, keys,
evaluation, checkpoints and resume as any algorithm (`fedjax_opt.train`,
"Host-driven algorithms"), and so does `fedjax-opt run --algorithms fedma`
(the model applied for any widths: `matchable`, exported as
`fo.algorithms.fedma_model`). Each local training in between is one jitted
program over the clients (`core.client_map`, compiled once per set of widths). The price: a
round returns to Python N times, and a model whose width changed recompiles.
A fixed maximum width with a mask of active units would keep the shapes
static, but the growth is decided by the Hungarian solutions of all the layers
below, so the host would be needed anyway. A flax module checks its parameter
shapes, so a grown model is applied with a width-agnostic function:
`mlp_apply` and `emnist_cnn_apply` below compute exactly `MLP` / `EmnistCNN`
for any widths.

    model, layers = fo.algorithms.fedma_model(fo.models.mlp_2nn())   # any widths; ("hidden_0", "hidden_1", "output")
    fedma = fo.algorithms.fedma(model.loss_fn, layers=layers, client_optimizer=optax.sgd(0.05))
    state = fedma.init(model.init(key), key)
    state, history = fo.train(fedma, state, ds, rounds, clients_per_round=10, local_steps=20, batch_size=20,
                              metric_fns={"accuracy": model.accuracy_fn})   # one FedMA round = N communications
    global_params = fo.algorithms.pfnm([p_1, ..., p_J], layers=...)   # one-shot, no retraining
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.local import local_train
from fedjax_opt.core.types import ClientBatches, LossFn, PyTree, materialize
from fedjax_opt.core.validation import check_client_batches, check_int, check_loss_fn, check_optimizer

__all__ = ["FedMAState", "LayerMatching", "MatchedAveraging", "apply_assignment", "bbp_map", "emnist_cnn_apply",
           "fedma", "match_client", "matchable", "mlp_apply", "pfnm"]


# ---- BBP-MAP: matching one layer's neurons (host, float64) ------------------------------------------------------


def _check_prior(sigma: float, sigma0: float, gamma: float) -> None:
  for value, name in ((sigma, "sigma"), (gamma, "gamma")):
    if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value) and value > 0):
      raise ValueError(f"{name} must be a finite Python float > 0; got {value!r}.")
  if not (isinstance(sigma0, (int, float, np.floating)) and sigma0 > 0):
    raise ValueError(f"sigma0 must be a Python float > 0 (math.inf for a flat prior); got {sigma0!r}.")


def match_client(sums: np.ndarray, counts: np.ndarray, neurons: np.ndarray, *, num_clients: int, sigma: float = 1.0,
                 sigma0: float = 1.0, gamma: float = 1.0, mu0: float = 0.0, max_width: int | None = None) -> np.ndarray:
  """One client's neurons against the global neurons of the others: the BBP-MAP assignment (PFNM, Section 3).

  Maximizes Σ_il B_il G_il over one-to-one assignments B (the gain G_il of the
  module docstring), by `scipy.optimize.linear_sum_assignment` on −G.

  Args:
    sums: `[L, D]` s_i, the sum of the other clients' neurons matched to global neuron i.
    counts: `[L]` m_i ≥ 1, how many other clients use global neuron i (each < J).
    neurons: `[L_j, D]` v_jl, this client's neurons.
    num_clients: J, the number of clients in the matching.
    sigma: σ, the standard deviation of a client neuron around its global neuron.
    sigma0: σ₀, the prior standard deviation of a global neuron around μ₀ (`math.inf`: flat).
    gamma: γ₀, the mass of the Beta-Bernoulli process (larger: more new neurons).
    mu0: μ₀, the prior mean (a scalar, every coordinate).
    max_width: None, or a cap on L plus the new neurons (as the papers' code, which caps at 700);
      never fewer new columns than L_j − L, so every neuron gets one.

  Returns:
    `[L_j]` int: the global index of each client neuron; an index ≥ L is a new
    global neuron, numbered L, L + 1, ... in order of their columns.
  """
  sums, neurons = np.asarray(sums, np.float64), np.asarray(neurons, np.float64)
  counts = np.asarray(counts, np.float64)
  num_global, lj = sums.shape[0], neurons.shape[0]
  if counts.shape != (num_global,) or np.any(counts < 1) or np.any(counts >= num_clients):
    raise ValueError(f"counts must be [L] = ({num_global},) with 1 <= m_i < J = {num_clients} (the other clients); "
                     f"got {counts}.")
  if neurons.ndim != 2 or sums.ndim != 2 or neurons.shape[1] != sums.shape[1]:
    raise ValueError(f"sums [L, D] and neurons [L_j, D] must share D; got {sums.shape} and {neurons.shape}.")
  b = 1.0 / sigma**2
  a0 = 0.0 if math.isinf(sigma0) else 1.0 / sigma0**2
  nat = a0 * mu0 + b * sums  # a_i
  prec = a0 + b * counts  # p_i
  v = b * neurons
  sq_nat = np.sum(nat**2, axis=1)
  matched = ((sq_nat[None] + 2.0 * v @ nat.T + np.sum(v**2, axis=1)[:, None]) / (prec + b)[None]
             - (sq_nat / np.maximum(prec, 1e-300))[None]
             + 2.0 * np.log(counts / (num_clients - counts))[None])
  num_new = lj if max_width is None else max(min(lj, max_width - num_global), lj - num_global, 0)
  prior_new = np.sum((a0 * mu0 + v)**2, axis=1) / (a0 + b) - a0 * mu0**2 * neurons.shape[1]
  new = (prior_new[:, None] + 2.0 * math.log(gamma / num_clients)
         - 2.0 * np.log(np.arange(1, num_new + 1, dtype=np.float64))[None])
  gain = np.concatenate([matched, new], axis=1)
  from scipy.optimize import linear_sum_assignment  # pylint: disable=g-import-not-at-top  (scipy: host only)
  rows, cols = linear_sum_assignment(-gain)
  assignment = np.empty(lj, np.int64)
  assignment[rows] = cols
  opened = np.sort(cols[cols >= num_global])
  assignment[assignment >= num_global] = num_global + np.searchsorted(opened, assignment[assignment >= num_global])
  return assignment


class LayerMatching(NamedTuple):
  """The matching of one layer across J clients.

  Attributes:
    assignments: J arrays `[L_j]` int, the global index of each client neuron.
    width: L, the number of global neurons.
  """

  assignments: list[np.ndarray]
  width: int


def _compact(assignments: list[np.ndarray], skip: int) -> tuple[list[np.ndarray], int]:
  """Renumbers the global neurons used by the clients other than `skip` as 0 … L−1, in order."""
  used = np.unique(np.concatenate([a for k, a in enumerate(assignments) if k != skip and a is not None]
                                  or [np.zeros(0, np.int64)]))
  remap = np.full(int(used.max(initial=-1)) + 1, -1, np.int64)
  remap[used] = np.arange(len(used))
  out = [a if k == skip or a is None else remap[a] for k, a in enumerate(assignments)]
  return out, len(used)


def _statistics(neurons: list[np.ndarray], assignments: list[np.ndarray], width: int,
                skip: int) -> tuple[np.ndarray, np.ndarray]:
  dim = neurons[0].shape[1]
  sums, counts = np.zeros((width, dim)), np.zeros(width)
  for k, (v, a) in enumerate(zip(neurons, assignments)):
    if k != skip and a is not None:  # None: not matched yet (first pass)
      np.add.at(sums, a, v)
      np.add.at(counts, a, 1.0)
  return sums, counts


def bbp_map(neurons: Sequence[np.ndarray], *, sigma: float = 1.0, sigma0: float = 1.0, gamma: float = 1.0,
            mu0: float = 0.0, iterations: int = 3, max_width: int | None = None, seed: int = 0) -> LayerMatching:
  """BBP-MAP for one layer: matches the neurons of J clients into L ≥ max_j L_j global neurons.

  First pass: clients in order of decreasing width, the first founding the
  global layer, each next one matched (`match_client`) against those before
  it. Then `iterations` passes in random order: take client j out (a global
  neuron no other client uses disappears) and match it again.

  Args:
    neurons: J arrays `[L_j, D]` (same D), the neuron vectors of the module docstring.
    sigma, sigma0, gamma, mu0, max_width: see `match_client`.
    iterations: refinement passes after the first one.
    seed: seeds the order of the refinement passes.

  Returns:
    `LayerMatching(assignments, width)`.
  """
  _check_prior(sigma, sigma0, gamma)
  neurons = [np.asarray(v, np.float64) for v in neurons]
  if not neurons or any(v.ndim != 2 or v.shape[1] != neurons[0].shape[1] for v in neurons):
    raise ValueError(f"neurons must be J >= 1 arrays [L_j, D] with one D; got shapes {[np.shape(v) for v in neurons]}.")
  num_clients = len(neurons)
  match = functools.partial(match_client, num_clients=num_clients, sigma=sigma, sigma0=sigma0, gamma=gamma, mu0=mu0,
                            max_width=max_width)
  order = sorted(range(num_clients), key=lambda k: -neurons[k].shape[0])
  assignments: list[np.ndarray | None] = [None] * num_clients
  assignments[order[0]] = np.arange(neurons[order[0]].shape[0])
  width = neurons[order[0]].shape[0]
  for j in order[1:]:
    sums, counts = _statistics(neurons, assignments, width, skip=j)
    assignments[j] = match(sums, counts, neurons[j])
    width = max(width, int(assignments[j].max(initial=-1)) + 1)
  rng = np.random.default_rng(seed)
  for _ in range(iterations if num_clients > 1 else 0):
    for j in rng.permutation(num_clients):
      assignments, width = _compact(assignments, skip=j)
      sums, counts = _statistics(neurons, assignments, width, skip=j)
      assignments[j] = match(sums, counts, neurons[j])
      width = max(width, int(assignments[j].max(initial=-1)) + 1)
  assignments, width = _compact(assignments, skip=-1)
  return LayerMatching(assignments, width)


# ---- layers as neurons, and moving neurons to their global positions ---------------------------------------------


def _as_neurons(layer: PyTree) -> np.ndarray:
  """`{"kernel": [..., L], "bias": [L]}` -> `[L, D]`: each unit's incoming weights (flattened), then its bias."""
  kernel = np.asarray(layer["kernel"], np.float64)
  return np.concatenate([kernel.reshape(-1, kernel.shape[-1]).T, np.asarray(layer["bias"], np.float64)[:, None]], 1)


def _from_neurons(vectors: np.ndarray, kernel_shape: tuple[int, ...], dtype: Any) -> dict[str, np.ndarray]:
  width = vectors.shape[0]
  kernel = vectors[:, :-1].T.reshape(*kernel_shape[:-1], width)
  return {"kernel": kernel.astype(dtype), "bias": vectors[:, -1].astype(dtype)}


def _input_axis(kernel: np.ndarray, num_units: int) -> tuple[tuple[int, ...], int]:
  """How a layer's kernel sees the L units of the layer below: (kernel viewed with a units axis, that axis)."""
  shape = kernel.shape
  if kernel.ndim == 4:
    if shape[2] != num_units:
      raise ValueError(f"a convolution after a layer of {num_units} units must have {num_units} input channels; "
                       f"its kernel is {shape} (HWIO).")
    return shape, 2
  if kernel.ndim == 2:
    if shape[0] % num_units:
      raise ValueError(f"a dense layer after a layer of {num_units} units must have a multiple of {num_units} inputs "
                       f"(a channels-last flatten); its kernel is {shape}.")
    return (shape[0] // num_units, num_units, shape[1]), 1
  raise ValueError(f"kernels must be dense [d_in, d_out] or convolutions [kh, kw, c_in, c_out]; got shape {shape}.")


def _expand_inputs(kernel: np.ndarray, assignment: np.ndarray, width: int) -> np.ndarray:
  """Π_j W_{j,n+1}: input unit l of the kernel moves to global position assignment[l]; zeros elsewhere."""
  kernel = np.asarray(kernel)
  view, axis = _input_axis(kernel, len(assignment))
  blocks = kernel.reshape(view)
  out_shape = list(view)
  out_shape[axis] = width
  out = np.zeros(out_shape, kernel.dtype)
  index = [slice(None)] * len(view)
  index[axis] = assignment
  out[tuple(index)] = blocks
  if kernel.ndim == 2:
    return out.reshape(-1, kernel.shape[1])
  return out


def apply_assignment(params: PyTree, layers: Sequence[str], index: int, assignment: np.ndarray, width: int,
                     global_layer: PyTree | None = None) -> PyTree:
  """Puts layer `layers[index]`'s units at their global positions and moves the next layer's inputs with them.

  Unit l of the layer becomes unit `assignment[l]` of a layer of `width`
  units; the next layer's input rows (blocks of rows after a channels-last
  flatten) follow, with zero rows for the other units. With `global_layer`
  None, the other units get zero weights, so the network computes exactly the
  same function; otherwise the layer is replaced by `global_layer` (FedMA's
  broadcast of the matched layer).

  Returns:
    A new params dict (host numpy arrays for the two layers changed).
  """
  assignment = np.asarray(assignment, np.int64)
  if len(np.unique(assignment)) != len(assignment) or assignment.min(initial=0) < 0 or \
      assignment.max(initial=-1) >= width:
    raise ValueError(f"assignment must send the {len(assignment)} units to distinct positions in [0, {width}); "
                     f"got {assignment}.")
  name, above = layers[index], layers[index + 1]
  out = dict(params)
  if global_layer is None:
    vectors = _as_neurons(params[name])
    placed = np.zeros((width, vectors.shape[1]))
    placed[assignment] = vectors
    global_layer = _from_neurons(placed, np.shape(params[name]["kernel"]), np.asarray(params[name]["kernel"]).dtype)
  out[name] = global_layer
  out[above] = dict(params[above], kernel=_expand_inputs(params[above]["kernel"], assignment, width))
  return out


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


def _check_layers(params: PyTree, layers: Sequence[str]) -> tuple[str, ...]:
  layers = tuple(layers)
  if len(layers) < 2:
    raise ValueError(f"layers must name at least two layers (hidden ..., output) in forward order; got {layers}.")
  if not isinstance(params, dict) or set(params) != set(layers):
    got = sorted(params) if isinstance(params, dict) else type(params).__name__
    raise ValueError(f"params must be a dict of exactly the layers {sorted(layers)} (every parameter in a matched "
                     f"or averaged layer); got {got}.")
  for name in layers:
    layer = params[name]
    if not isinstance(layer, dict) or set(layer) != {"kernel", "bias"} or np.ndim(layer["kernel"]) not in (2, 4):
      raise ValueError(f"layer {name!r} must be {{'kernel': dense [d_in, d_out] or conv [kh, kw, c_in, c_out], "
                       f"'bias': [d_out]}}; got {jax.tree.map(np.shape, layer)}.")
  return layers


class _Layerwise(NamedTuple):
  """The state of a layer-wise matching: each client's params (host), and which input coordinates it owns."""

  params: list[dict]
  owned: list[np.ndarray]


def _matched_averaging(client_params: list[dict], layers: tuple[str, ...], client_weights: np.ndarray,
                       class_counts: np.ndarray | None,
                       retrain: Callable[[list[dict], int, np.ndarray], list[dict]] | None,
                       seed: int, **prior: Any) -> tuple[dict | None, list[int], int, int]:
  """Algorithm 1 of FedMA (PFNM one-shot when `retrain` is None).

  `retrain(params_list, first, rows)` trains layers[first:] of the clients `rows` (indices into
  `client_params`). A client whose retrained model is not finite is left out of every later layer and of the
  classifier (counted in the last return value); if none is left, the params are None.

  Returns:
    (global params, the global hidden widths, the floats the clients uploaded: each layer once per client, the
    clients left out after a retraining diverged).
  """
  state = _Layerwise(params=[dict(p) for p in client_params],
                     owned=[np.ones(_as_neurons(p[layers[0]]).shape[1]) for p in client_params])
  widths, uploaded = [], 0
  alive = np.arange(len(client_params))
  for n, name in enumerate(layers[:-1]):
    vectors = [_as_neurons(p[name]) for p in state.params]
    uploaded += sum(v.size for v in vectors)
    matching = bbp_map(vectors, seed=seed + n, **prior)
    ones = [np.ones(v.shape[0]) for v in vectors]
    merged = _average(vectors, matching.assignments, state.owned, ones, matching.width)
    dtype = np.asarray(state.params[0][name]["kernel"]).dtype
    kernel_shape = np.shape(state.params[0][name]["kernel"])
    global_layer = _from_neurons(merged, kernel_shape, dtype)
    owned = []
    for j, a in enumerate(matching.assignments):
      above = state.params[j][layers[n + 1]]["kernel"]
      owned.append(np.concatenate([_expand_inputs(np.ones(np.shape(above)[:-1] + (1,)), a, matching.width)
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
          return None, widths, uploaded, len(client_params)
        trained, alive = [p for p, ok in zip(trained, finite) if ok], alive[finite]
      state = _Layerwise(params=trained, owned=[np.ones_like(o) for o, ok in zip(owned, finite) if ok])
    widths.append(matching.width)
  name = layers[-1]
  vectors = [_as_neurons(p[name]) for p in state.params]
  uploaded += sum(v.size for v in vectors)
  weights = _class_weights(None if class_counts is None else class_counts[alive], client_weights[alive],
                           vectors[0].shape[0])
  identity = [np.arange(v.shape[0]) for v in vectors]
  merged = _average(vectors, identity, state.owned, weights, vectors[0].shape[0])
  out = dict(state.params[0])
  out[name] = _from_neurons(merged, np.shape(out[name]["kernel"]), np.asarray(out[name]["kernel"]).dtype)
  return ({k: jax.tree.map(jnp.asarray, out[k]) for k in layers}, widths, uploaded,
          len(client_params) - len(alive))


def pfnm(client_params: Sequence[PyTree], *, layers: Sequence[str], sigma: float = 1.0, sigma0: float = 1.0,
         gamma: float = 1.0, mu0: float = 0.0, iterations: int = 3, max_width: int | None = None,
         client_weights: Sequence[float] | None = None, class_counts: Any = None, seed: int = 0) -> PyTree:
  """One-shot matched averaging (PFNM, with FedMA's layer-wise rule): J trained networks -> one global network.

  Layer by layer, bottom up: BBP-MAP matches the J clients' neurons
  (`bbp_map`), the global layer is the mean of the matched neurons, and each
  client's next layer has its inputs moved to the global positions. The last
  layer is the class-weighted average Σ_j p_jk W_{j,N}[:, k]. No retraining:
  that is `fedma`.

  Args:
    client_params: J params dicts (widths may differ), each `{layer: {"kernel", "bias"}}`.
    layers: the layer names in forward order, the last one the classifier.
    sigma: σ (std of a client neuron around its global neuron).
    sigma0: σ₀ (prior std of a global neuron; `math.inf`: flat prior).
    gamma: γ₀ (Beta-Bernoulli mass: the propensity to open new neurons).
    mu0: μ₀ (prior mean).
    iterations: BBP-MAP refinement passes per layer.
    max_width: None, or a cap on each global layer's width.
    client_weights: n_j for the classifier average when `class_counts` is None or a class is held
      by no client; default uniform.
    class_counts: None, or `[J, K]` n_jk, client j's examples of class k.
    seed: seeds the refinement order.

  Returns:
    The global params (jnp arrays), with the grown widths.
  """
  client_params = [jax.tree.map(np.asarray, p) for p in client_params]
  if not client_params:
    raise ValueError("client_params must hold at least one client's params.")
  layers = tuple(_check_layers(p, layers) for p in client_params)[0]
  num = len(client_params)
  weights = np.ones(num) if client_weights is None else np.asarray(client_weights, np.float64)
  if weights.shape != (num,) or np.any(weights < 0) or not np.all(np.isfinite(weights)):
    raise ValueError(f"client_weights must be J = {num} finite values >= 0; got {client_weights}.")
  check_int(iterations, "iterations", 0)
  params, _, _, _ = _matched_averaging(client_params, layers, weights, class_counts, None, seed, sigma=sigma, sigma0=sigma0,
                                 gamma=gamma, mu0=mu0, iterations=iterations, max_width=max_width)
  return params


# ---- FedMA ------------------------------------------------------------------------------------------------------

METRICS = ("client_loss", "num_clients", "num_nonfinite", "communication_rounds", "uploaded_floats", "bits_up",
           "bits_down")


@flax.struct.dataclass
class FedMAState:
  """The state of FedMA.

  Attributes:
    params: the global model; its hidden widths grow as matching opens new neurons.
    round: FedMA rounds done (each is N communication rounds, one per layer).
    key: PRNG key (seeds BBP-MAP's refinement order, folded with the round).
    metrics: `client_loss` (mean client loss of the round's first local training),
      `num_clients` (clients matched), `num_nonfinite` (clients left out: a
      non-finite model after training), `communication_rounds` (N: one
      upload and broadcast per layer), `uploaded_floats` (Σ over the layers
      and the matched clients of the layer's parameter count), `bits_up`
      (32 · uploaded_floats / matched clients: float32 bits per client),
      `bits_down` (32 · the new global model's parameter count: each global
      layer is broadcast once, as it is matched), `widths` (`[N − 1]`
      global hidden widths).
  """

  params: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


class MatchedAveraging(NamedTuple):
  """FedMA as host-driven functions (not a `FederatedAlgorithm`: see the module docstring).

  Attributes:
    init: `init(params, key) -> FedMAState`.
    run: `run(state, batches) -> state`: one FedMA round (N communications):
      every client trains the whole model from `state.params` on its batches,
      then `match`.
    match: `match(client_params, batches, seed=0) -> (params, metrics)`:
      Algorithm 1 on given client models (leaves `[J, ...]`, one row per
      client of `batches`; they may start from different initializations):
      for each layer n < N, match, broadcast, retrain layers n+1 … N on the
      batches with layers 1 … n frozen; then the class-weighted classifier.
  """

  init: Callable[[PyTree, jax.Array], FedMAState]
  run: Callable[[FedMAState, ClientBatches], FedMAState]
  match: Callable[..., tuple[PyTree, dict]]


def _stack(params: list[dict]) -> PyTree:
  return jax.tree.map(lambda *a: jnp.stack([jnp.asarray(x) for x in a]), *params)


def _unstack(params: PyTree, num: int) -> list[dict]:
  host = jax.tree.map(np.asarray, params)
  return [jax.tree.map(lambda a, k=k: a[k], host) for k in range(num)]


def _finite_rows(params: PyTree) -> np.ndarray:
  leaves = [np.asarray(a).reshape(a.shape[0], -1) for a in jax.tree.leaves(params)]
  return np.all(np.concatenate([np.isfinite(a) for a in leaves], axis=1), axis=1)


def _class_counts(data: PyTree, mask: np.ndarray, num_classes: int) -> np.ndarray | None:
  """n_jk from the round's labels `data["y"]` `[J, S, B]` (real slots; a slot drawn twice counts twice)."""
  if not isinstance(data, dict) or "y" not in data:
    return None
  y = np.asarray(data["y"])
  if y.shape != mask.shape or not np.issubdtype(y.dtype, np.integer):
    return None
  return np.stack([np.bincount(y[j][mask[j]], minlength=num_classes)[:num_classes] for j in range(y.shape[0])])


def fedma(
    loss_fn: LossFn,
    *,
    layers: Sequence[str],
    client_optimizer: optax.GradientTransformation,
    sigma: float = 1.0,
    sigma0: float = 1.0,
    gamma: float = 1.0,
    mu0: float = 0.0,
    iterations: int = 3,
    max_width: int | None = None,
    client_map: client_map_lib.ClientMap | str | None = None,
) -> MatchedAveraging:
  """Federated Matched Averaging (FedMA, Algorithm 1), with communication rounds.

  One round: each client trains all layers from the global model (S masked
  local steps of `client_optimizer` over its batches), then for n = 1 … N−1:

      {Π_j} = BBP-MAP({W_{j,n}})                       match layer n (host, Hungarian)
      W_n = mean of the matched neurons                  the global layer n, broadcast
      W_{j,n+1} ← Π_j W_{j,n+1}                          move the next layer's inputs
      train {W_{j,n+1}, …, W_{j,N}} with W_1 … W_n frozen  (the same S steps, jitted over clients)

  and last W_N[:, k] = Σ_j p_jk W_{j,N}[:, k] (p_jk: client j's share of
  class k in the round's labels `batches.data["y"]`; the n_j weights when the
  data has no integer "y"). A round is N communications, each uploading one
  layer per client, so its upload equals one FedAvg round's.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`, for any hidden
      widths (flax modules check their shapes: use `mlp_apply` /
      `emnist_cnn_apply` with `fo.models.classification_loss`).
    layers: the layer names in forward order, the last one the classifier.
    client_optimizer: ClientOpt, any optax optimizer, fresh for every local training.
    sigma: σ (std of a client neuron around its global neuron).
    sigma0: σ₀ (prior std of a global neuron; `math.inf`: flat prior).
    gamma: γ₀ (Beta-Bernoulli mass: the propensity to open new neurons).
    mu0: μ₀ (prior mean).
    iterations: BBP-MAP refinement passes per layer.
    max_width: None, or a cap on each global layer's width.
    client_map: how clients are mapped in local training (see `fo.algorithms.fedavg`).

  Returns:
    `MatchedAveraging(init, run, match)`; state `FedMAState`.
  """
  check_loss_fn(loss_fn)
  check_optimizer(client_optimizer, "client_optimizer")
  _check_prior(sigma, sigma0, gamma)
  check_int(iterations, "iterations", 0)
  layers = tuple(layers)
  prior = dict(sigma=sigma, sigma0=sigma0, gamma=gamma, mu0=mu0, iterations=iterations, max_width=max_width)

  @functools.partial(jax.jit, static_argnames="first")
  def train(params, data, mask, first):
    """Every client trains layers[first:] from its own params; leaves `[J, ...]`."""
    labels = {name: jax.tree.map(lambda _, n=n: "train" if n >= first else "frozen", params[name])
              for n, name in enumerate(layers)}
    optimizer = optax.multi_transform({"train": client_optimizer, "frozen": optax.set_to_zero()}, labels)

    def one(_, inputs):
      p, d, m = inputs
      result = local_train(loss_fn, optimizer, p, d, m)
      return jax.tree.map(jnp.add, p, result.delta), result.loss

    return client_map_lib.map_clients(client_map, one, None, (params, data, mask))

  def init(params: PyTree, key: jax.Array) -> FedMAState:
    _check_layers(params, layers)
    metrics = {name: jnp.zeros((), jnp.float32) for name in METRICS}
    metrics["widths"] = jnp.asarray([np.shape(params[n]["bias"])[0] for n in layers[:-1]], jnp.int32)
    return FedMAState(params=params, round=jnp.zeros((), jnp.int32), key=key, metrics=metrics)

  def match(client_params: PyTree, batches: ClientBatches, seed: int = 0) -> tuple[PyTree, dict]:
    check_client_batches(batches)
    data, mask = materialize(batches.data), np.asarray(batches.mask)
    num = batches.num_clients
    if any(np.shape(leaf)[0] != num for leaf in jax.tree.leaves(client_params)):
      raise ValueError(f"client_params must have a leading axis of the C = {num} clients of batches; got "
                       f"{jax.tree.map(np.shape, client_params)}.")
    keep = (np.asarray(batches.weight) > 0) & _finite_rows(client_params)
    num_nonfinite = int(np.sum((np.asarray(batches.weight) > 0) & ~keep))
    if not keep.any():
      return None, {"num_clients": 0, "num_nonfinite": num_nonfinite}
    rows = np.flatnonzero(keep)
    data = jax.tree.map(lambda a: jnp.asarray(a)[rows], data)
    mask_kept = jnp.asarray(mask[rows])

    def retrain(params_list, first, alive):
      subset = jax.tree.map(lambda a: a[alive], data)
      trained, _ = train(_stack(params_list), subset, mask_kept[alive], first)
      return _unstack(trained, len(params_list))

    clients = _unstack(jax.tree.map(lambda a: np.asarray(a)[rows], client_params), len(rows))
    _check_layers(clients[0], layers)
    num_classes = np.shape(clients[0][layers[-1]]["bias"])[0]
    counts = _class_counts(data, mask[rows], num_classes)
    params, widths, uploaded, diverged = _matched_averaging(clients, layers, np.asarray(batches.weight)[rows],
                                                            counts, retrain, seed, **prior)
    return params, {"num_clients": len(rows) - diverged, "num_nonfinite": num_nonfinite + diverged,
                    "widths": widths, "uploaded_floats": uploaded, "uploaders": len(rows)}

  def run(state: FedMAState, batches: ClientBatches) -> FedMAState:
    check_client_batches(batches)
    num = batches.num_clients
    start = jax.tree.map(lambda a: jnp.broadcast_to(a, (num,) + jnp.shape(a)), state.params)
    trained, losses = train(start, materialize(batches.data), batches.mask, 0)
    weight = np.asarray(batches.weight)
    losses = np.asarray(losses)
    ok = (weight > 0) & np.isfinite(losses)
    seed = int(jax.random.randint(jax.random.fold_in(state.key, state.round), (), 0, 2**31 - 1))
    params, info = match(trained, batches, seed=seed)
    metrics = dict(state.metrics)
    metrics.update(num_nonfinite=jnp.float32(info["num_nonfinite"]), num_clients=jnp.float32(info["num_clients"]))
    if params is None:  # no finite client: the round is rejected, the model kept
      return state.replace(round=state.round + 1, metrics=metrics)
    metrics.update(
        client_loss=jnp.float32(np.sum(losses[ok] * weight[ok]) / max(np.sum(weight[ok]), 1e-30)),
        communication_rounds=jnp.float32(len(layers)), uploaded_floats=jnp.float32(info["uploaded_floats"]),
        bits_up=jnp.float32(32 * info["uploaded_floats"] / info["uploaders"]),
        bits_down=jnp.float32(32 * sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))),
        widths=jnp.asarray(info["widths"], jnp.int32))
    return state.replace(params=params, round=state.round + 1, metrics=metrics)

  return MatchedAveraging(init=init, run=run, match=match)


# ---- width-agnostic applies of the library's models ---------------------------------------------------------------


def mlp_apply(params: PyTree, x: jax.Array) -> jax.Array:
  """`fo.models.MLP` for any widths: `x [B, ...]` flattened, ReLU(x W + b) per `hidden_i`, then `output`.

  Equals `MLP(...).apply({"params": params}, x)` for the params it was built
  with (tests/test_matched_averaging.py); unlike the flax module, accepts the
  grown widths of a matched model.
  """
  h = jnp.reshape(x, (jnp.shape(x)[0], -1))
  num_hidden = len([k for k in params if k.startswith("hidden_")])
  for i in range(num_hidden):
    h = jax.nn.relu(h @ params[f"hidden_{i}"]["kernel"] + params[f"hidden_{i}"]["bias"])
  return h @ params["output"]["kernel"] + params["output"]["bias"]


def _conv(h: jax.Array, layer: PyTree) -> jax.Array:
  out = jax.lax.conv_general_dilated(h, layer["kernel"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return out + layer["bias"]


def emnist_cnn_apply(params: PyTree, x: jax.Array) -> jax.Array:
  """`fo.models.EmnistCNN` for any widths (dropout off): two 3×3 VALID convs, 2×2 max pool, dense, output.

  `x` is `[B, H, W]` or `[B, H, W, 1]`.
  """
  h = x[..., None] if jnp.ndim(x) == 3 else x
  h = jax.nn.relu(_conv(h, params["conv_0"]))
  h = jax.nn.relu(_conv(h, params["conv_1"]))
  b, height, width, c = h.shape
  h = h[:, :height // 2 * 2, :width // 2 * 2].reshape(b, height // 2, 2, width // 2, 2, c).max(axis=(2, 4))
  h = jnp.reshape(h, (b, -1))
  h = jax.nn.relu(h @ params["dense"]["kernel"] + params["dense"]["bias"])
  return h @ params["output"]["kernel"] + params["output"]["bias"]


CNN_LAYERS = ("conv_0", "conv_1", "dense", "output")


def matchable(model: Any) -> tuple[Any, tuple[str, ...]]:
  """(the same network applied for any widths, its layers in forward order) for `fo.models`' MLP and EmnistCNN.

  `model` is a `fo.models.Model` of `fo.models.MLP` (e.g. `mlp_2nn`; layers
  `hidden_0 … hidden_{H−1}, output`) or `emnist_cnn` (`conv_0, conv_1,
  dense, output`). The returned `Model` has the same `init`; its `apply` is
  `mlp_apply` / `emnist_cnn_apply`, and its loss and accuracy are built on
  that apply, so they score FedMA's grown models too. Anything else (e.g.
  logistic regression: no hidden unit to match) raises ValueError.
  """
  from fedjax_opt.models import base  # pylint: disable=import-outside-toplevel

  params = model.init(jax.random.key(0))
  names = set(params) if isinstance(params, dict) else set()
  hidden = sorted((k for k in names if k.startswith("hidden_") and k[7:].isdigit()), key=lambda k: int(k[7:]))
  if hidden and names == set(hidden) | {"output"} and [int(k[7:]) for k in hidden] == list(range(len(hidden))):
    apply, layers = mlp_apply, (*hidden, "output")
  elif names == set(CNN_LAYERS):
    apply, layers = emnist_cnn_apply, CNN_LAYERS
  else:
    raise ValueError(f"FedMA matches the hidden units of fo.models' MLP (hidden_0 …, output) or EmnistCNN "
                     f"({', '.join(CNN_LAYERS)}); model {model.name!r} has layers {sorted(names)}: use an MLP or CNN.")
  agnostic = model._replace(apply=apply, loss_fn=base.classification_loss(apply),
                            accuracy_fn=base.classification_accuracy(apply), module=None)
  return agnostic, layers
