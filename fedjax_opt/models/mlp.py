"""Fully connected ReLU networks, among them the "2NN" of FedAvg.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", AISTATS 2017,
arXiv:1602.05629, Section 3: for MNIST, a multilayer perceptron with two
hidden layers of 200 ReLU units each and 199,210 parameters, which the paper
calls the "2NN":

784·200 + 200 + 200·200 + 200 + 200·10 + 10 = 199,210.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_opt.models.base import Model, flatten_examples, from_flax

__all__ = ["MLP", "mlp_2nn"]


class MLP(nn.Module):
  """`x [B, ...] -> logits [B, K]`: dense layers with ReLU, then a linear output.

  Parameters: `{"hidden_0": {...}, ..., "output": {"kernel": [h, K], "bias": [K]}}`.

  Attributes:
    input_dim: features per example (trailing axes of `x` are flattened).
    hidden_sizes: widths of the hidden layers.
    num_classes: K.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: parameter dtype.
  """

  input_dim: int
  hidden_sizes: Sequence[int]
  num_classes: int
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = flatten_examples(x, self.input_dim, "MLP")
    for i, width in enumerate(self.hidden_sizes):
      h = nn.relu(nn.Dense(width, dtype=self.dtype, param_dtype=self.param_dtype, name=f"hidden_{i}")(h))
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="output")(h)


def mlp_2nn(num_classes: int = 10, hidden: int = 200, input_dim: int = 784, *, dtype: Any = None,
            param_dtype: Any = jnp.float32) -> Model:
  """The MNIST "2NN" of McMahan et al. (2017): input_dim-200-200-K with ReLU.

  199,210 parameters with the defaults. Inputs `[B, 784]` or `[B, 28, 28]`.

  Args:
    num_classes: K.
    hidden: width of each of the two hidden layers.
    input_dim: features per example.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.

  Returns:
    `Model` named `"mlp_2nn"` with input shape `(input_dim,)`.
  """
  module = MLP(input_dim, (hidden, hidden), num_classes, dtype=dtype, param_dtype=param_dtype)
  return from_flax(module, (input_dim,), name="mlp_2nn")
