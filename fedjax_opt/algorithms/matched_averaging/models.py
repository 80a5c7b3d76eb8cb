"""The library's MLP and CNN applied for any widths: the models FedMA's grown layers run in.

Matching grows the hidden layers (`matching.py`), and a flax module checks its
parameter shapes, so a grown model is applied with a width-agnostic function:
`mlp_apply` and `emnist_cnn_apply` compute exactly `fo.models.MLP` /
`fo.models.EmnistCNN` for any widths, and `matchable` (exported as
`fo.algorithms.fedma_model`) turns such a `fo.models.Model` into one built on
them, with its layers in forward order.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_opt.core.types import PyTree

__all__ = ["CNN_LAYERS", "emnist_cnn_apply", "matchable", "mlp_apply"]


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

  params = jax.eval_shape(model.init, jax.random.key(0))  # the layer names only: nothing is computed or compiled
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
