"""Multinomial logistic regression: one dense layer, softmax cross-entropy.

The convex baseline of federated optimization papers, e.g. the FedProx
experiments (Li et al., "Federated Optimization in Heterogeneous Networks",
MLSys 2020, arXiv:1812.06127) and the L2GD paper (Hanzely & Richtárik,
"Federated Learning of a Mixture of Global and Local Models",
arXiv:2002.05516). Logits are `z = x W + b`, with `W [d, K]` and `b [K]`;
d·K + K parameters. Weights start at zero, the usual starting point of a
convex problem, so `init` ignores its key.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_opt.models.base import Model, flatten_examples, from_flax

__all__ = ["LogisticRegression", "logistic_regression"]


class LogisticRegression(nn.Module):
  """`x [B, ...] -> logits [B, K]`, with `prod(x.shape[1:]) == num_features`.

  Parameters: `{"linear": {"kernel": [d, K], "bias": [K]}}`.

  Attributes:
    num_features: d, features per example (trailing axes are flattened).
    num_classes: K.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: parameter dtype.
  """

  num_features: int
  num_classes: int
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = flatten_examples(x, self.num_features, "LogisticRegression")
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                    kernel_init=nn.initializers.zeros, name="linear")(x)


def logistic_regression(num_features: int, num_classes: int, *, dtype: Any = None,
                        param_dtype: Any = jnp.float32) -> Model:
  """Multinomial logistic regression as a `Model` (d·K + K parameters, zero init).

  Args:
    num_features: d, features per example; `x` is `[B, d]` (or any `[B, ...]`
      with d entries per example).
    num_classes: K.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.

  Returns:
    `Model` named `"logistic_regression"` with input shape `(d,)`.
  """
  module = LogisticRegression(num_features, num_classes, dtype=dtype, param_dtype=param_dtype)
  return from_flax(module, (num_features,), name="logistic_regression")
