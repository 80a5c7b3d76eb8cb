"""Layers as neurons, and moving neurons to their global positions.

The neurons. The neuron l of client j in layer n is the vector v_jl ∈ ℝ^D of
its incoming weights and bias: for a dense layer (kernel [d_in, L]) the column
kernel[:, l] and bias[l], D = d_in + 1; for a convolution (flax HWIO kernel
[kh, kw, c_in, L]) the filter kernel[..., l] flattened and bias[l],
D = kh·kw·c_in + 1. Conv channels are matched exactly as dense units.

Why moving them is free. A hidden layer is invariant to a permutation Π of its
units: σ(x W₁) W₂ = σ(x W₁ Π) Πᵀ W₂. After layer n is matched into L global
neurons, client j's neuron l sits at global index π_j(l); its next layer's
input rows move there (W_{j,n+1} ← Π_j W_{j,n+1}, Π_j an L × L_j 0/1
injection, zero rows for the global neurons client j does not have), which
leaves the client's network function unchanged (its missing neurons have zero
outgoing weights). Into a dense layer after a convolution, through a
channels-last flatten of an [H', W', C] map (flax/jnp `reshape`), the rows move
in blocks: input row p·C + c follows channel c.

What is supported. Models whose parameters are a dict of layers, each
`{"kernel", "bias"}`, applied in a given order: dense (kernel rank 2) and 2-D
convolution (rank 4, HWIO) layers, with element-wise activations and pooling
between them, and a channels-last flatten from a convolution into a dense
layer (`check_layers`). Left out: recurrent layers (FedMA's LSTM matching
permutes the four gates' hidden units jointly and the recurrent kernel on both
sides), normalization layers with parameters, residual connections (a skip sum
ties the permutations of two layers), attention, and layers without bias.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from fedjax_opt.core.types import PyTree

__all__ = ["apply_assignment", "as_neurons", "check_layers", "expand_inputs", "from_neurons", "select_inputs",
           "select_units"]


def as_neurons(layer: PyTree) -> np.ndarray:
  """`{"kernel": [..., L], "bias": [L]}` -> `[L, D]`: each unit's incoming weights (flattened), then its bias."""
  kernel = np.asarray(layer["kernel"], np.float64)
  return np.concatenate([kernel.reshape(-1, kernel.shape[-1]).T, np.asarray(layer["bias"], np.float64)[:, None]], 1)


def from_neurons(vectors: np.ndarray, kernel_shape: tuple[int, ...], dtype: Any) -> dict[str, np.ndarray]:
  """`[L, D]` -> `{"kernel": [..., L], "bias": [L]}` of `kernel_shape` and `dtype`: the inverse of `as_neurons`."""
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


def expand_inputs(kernel: np.ndarray, assignment: np.ndarray, width: int) -> np.ndarray:
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


def select_inputs(kernel: np.ndarray, chosen: np.ndarray, width: int) -> np.ndarray:
  """The inverse of `expand_inputs`: the input rows (blocks after a flatten) that read the units `chosen` of `width`."""
  kernel = np.asarray(kernel)
  view, axis = _input_axis(kernel, width)
  picked = np.take(kernel.reshape(view), np.asarray(chosen, np.int64), axis=axis)
  if kernel.ndim == 2:
    return picked.reshape(-1, kernel.shape[1])
  return picked


def select_units(params: PyTree, layers: Sequence[str], chosen: Sequence[np.ndarray]) -> dict:
  """A client's network cut out of a wider global one: FedMA's restart from the global model (the authors' code).

  For each hidden layer n, `chosen[n]` (`[L_j,n]` distinct indices into the
  global layer's units, in the client's order: its last assignment) picks the
  layer's units (kernel columns / conv filters and biases) and the next
  layer's input rows (blocks of rows after a channels-last flatten); the
  classifier keeps its classes. The inverse of `apply_assignment` for the
  units the client has: cutting a client out of the model it was moved into
  gives the client back.

  Returns:
    A new params dict of host numpy arrays, hidden widths `len(chosen[n])`.
  """
  out = {name: {k: np.asarray(v) for k, v in params[name].items()} for name in layers}
  for n, name in enumerate(layers[:-1]):
    width = np.shape(out[name]["bias"])[0]
    pick = np.asarray(chosen[n], np.int64)
    if len(np.unique(pick)) != len(pick) or pick.min(initial=0) < 0 or pick.max(initial=-1) >= width:
      raise ValueError(f"the units chosen in layer {name!r} must be distinct indices in [0, {width}); got {pick}.")
    out[name] = {"kernel": out[name]["kernel"][..., pick], "bias": out[name]["bias"][pick]}
    above = layers[n + 1]
    out[above] = dict(out[above], kernel=select_inputs(out[above]["kernel"], pick, width))
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
    vectors = as_neurons(params[name])
    placed = np.zeros((width, vectors.shape[1]))
    placed[assignment] = vectors
    global_layer = from_neurons(placed, np.shape(params[name]["kernel"]), np.asarray(params[name]["kernel"]).dtype)
  out[name] = global_layer
  out[above] = dict(params[above], kernel=expand_inputs(params[above]["kernel"], assignment, width))
  return out


def check_layers(params: PyTree, layers: Sequence[str]) -> tuple[str, ...]:
  """Clear errors unless `params` is exactly the dict of `layers`, each a dense or conv `{"kernel", "bias"}`."""
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
