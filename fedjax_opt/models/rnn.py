"""A character-level recurrent network for next-character prediction (LEAF's Shakespeare task).

The task of McMahan et al., "Communication-Efficient Learning of Deep Networks
from Decentralized Data" (AISTATS 2017, arXiv:1602.05629), in the layout of
LEAF (Caldas et al., arXiv:1812.01097) and `fo.data.load("shakespeare")`:
each example is a window of L characters `x [L]` (vocabulary indices) and
its target is the one character that follows, `y` (an index in `[0, V)`).
The network reads the window and classifies the next character:

    e_t = E[x_t]                                  embedding, E [V, d]
    h_t = cell(h_{t-1}, e_t), h_0 = 0             num_layers stacked GRU or LSTM cells
    logits = W h_L + b                            W [H, V], b [V]

Only the last state predicts, since the data carry one target per window;
there is no padding inside a window (every window is L real characters),
and padded batch slots are masked by the library, as for any model.

GRU (Cho et al. 2014, flax's `GRUCell`): with x the cell's input,
    r = σ(W_ir x + b_ir + W_hr h),   z = σ(W_iz x + b_iz + W_hz h),
    n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)),   h' = (1 − z) ⊙ n + z ⊙ h;
3 (d H + H H + H) + H parameters for input width d.
LSTM (Hochreiter & Schmidhuber 1997, flax's `LSTMCell`):
    i, f, o = σ(W_i· x + W_h· h + b_h·),  g = tanh(W_ig x + W_hg h + b_hg),
    c' = f ⊙ c + i ⊙ g,  h' = o ⊙ tanh(c');
4 (d H + H H + H) parameters.

LEAF's reference model is an embedding of 8, two LSTM layers of 256 and a
dense output: `char_rnn(embed_dim=8, hidden_size=256, num_layers=2,
cell="lstm")`, 817,872 parameters for V = 80. The default here is one GRU
layer of 128 (63,696 parameters for V = 80), about 13x smaller, so that a
few rounds of 10 clients run in seconds on a CPU.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_opt.models.base import Model, from_flax

__all__ = ["CELLS", "CharRNN", "char_rnn"]

CELLS = ("gru", "lstm")


class CharRNN(nn.Module):
  """`x [B, L] int -> logits [B, V]`: embedding, stacked recurrent layers, dense output of the last state.

  Parameters: `{"embed": {"embedding": [V, d]}, "rnn_0": {...}, ..., "output":
  {"kernel": [H, V], "bias": [V]}}`; `rnn_i` holds the dense layers of flax's
  GRU cell (`ir, iz, in` with biases, `hr, hz` without, `hn` with) or LSTM
  cell (`ii, if, ig, io` without biases, `hi, hf, hg, ho` with). The parameters do not depend on L, so one model reads windows of
  any length.

  Attributes:
    vocab_size: V, the number of symbols (inputs and logits).
    embed_dim: d, the embedding width.
    hidden_size: H, the width of every recurrent layer.
    num_layers: recurrent layers stacked.
    cell: "gru" or "lstm".
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: parameter dtype.
  """

  vocab_size: int = 80
  embed_dim: int = 8
  hidden_size: int = 128
  num_layers: int = 1
  cell: str = "gru"
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if jnp.ndim(x) != 2 or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"CharRNN expects x shaped [B, L] holding integer symbol indices in [0, {self.vocab_size}); "
                       f"got shape {tuple(jnp.shape(x))}, dtype {jnp.result_type(x)}.")
    layer = {"dtype": self.dtype, "param_dtype": self.param_dtype}
    h = nn.Embed(self.vocab_size, self.embed_dim, name="embed", **layer)(x)
    cell_type = nn.GRUCell if self.cell == "gru" else nn.LSTMCell
    for i in range(self.num_layers):
      h = nn.RNN(cell_type(self.hidden_size, name=f"rnn_{i}", **layer))(h)
    return nn.Dense(self.vocab_size, name="output", **layer)(h[:, -1])


def _check_positive_int(value: Any, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int; got {value!r}.")
  return value


def char_rnn(vocab_size: int = 80, *, sequence_length: int = 80, embed_dim: int = 8, hidden_size: int = 128,
             num_layers: int = 1, cell: str = "gru", dtype: Any = None, param_dtype: Any = jnp.float32) -> Model:
  """A character-level GRU/LSTM classifying the next character of a window, as a `Model`.

  Fits `fo.data.load("shakespeare")` (and any `pack_sequences` dataset):
  batches `{"x": [B, L] int32, "y": [B] int32}`, one target per window.
  `loss_fn` is the per-example softmax cross-entropy `logsumexp(z) − z[y]` of
  the logits `z = apply(params, x)` (see the module docstring), `accuracy_fn`
  the 0/1 agreement of `argmax z` with y.

  Args:
    vocab_size: V (80 for LEAF's vocabulary, `fo.data.LEAF_VOCAB`; pass the
      dataset's `num_classes`).
    sequence_length: L, the window length recorded as `input_shape` (80 in
      LEAF); the network itself reads windows of any length.
    embed_dim: d (8 in LEAF).
    hidden_size: H (LEAF: 256).
    num_layers: stacked recurrent layers (LEAF: 2).
    cell: "gru" (default) or "lstm" (LEAF).
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.

  Returns:
    `Model` named `"char_rnn"` with input shape `(sequence_length,)` (int32
    inputs) and `num_classes = vocab_size`.
  """
  vocab_size = _check_positive_int(vocab_size, "vocab_size")
  for name, value in (("sequence_length", sequence_length), ("embed_dim", embed_dim),
                      ("hidden_size", hidden_size), ("num_layers", num_layers)):
    _check_positive_int(value, name)
  if cell not in CELLS:
    raise ValueError(f"cell must be one of {CELLS}; got {cell!r}.")
  module = CharRNN(vocab_size, embed_dim, hidden_size, num_layers, cell, dtype=dtype, param_dtype=param_dtype)
  return from_flax(module, (sequence_length,), name="char_rnn", input_dtype=jnp.int32)
