"""The EMNIST character-recognition CNN of Adaptive Federated Optimization.

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, "Adaptive
Federated Optimization", ICLR 2021, arXiv:2003.00295, appendix table of
model architectures (EMNIST CR):

    Conv2d 3×3, 32 channels, stride 1, ReLU    28×28×1 -> 26×26×32     320
    Conv2d 3×3, 64 channels, stride 1, ReLU            -> 24×24×64  18,496
    MaxPool 2×2                                        -> 12×12×64
    Dropout 0.25, Flatten                              -> 9,216
    Dense 128, ReLU                                    -> 128    1,179,776
    Dropout 0.5, Dense 62                              -> 62         7,998
                                                        total   1,206,590

The convolutions use 'VALID' padding, which is what that parameter count
implies.

Dropout needs a random key, which the library's per-example loss
`loss_fn(params, batch) -> [B]` does not carry. So the `Model` returned by
`emnist_cnn` is deterministic: its `apply`, `loss_fn` and `accuracy_fn` run
the network with dropout off, and algorithms train it without dropout. A
training-mode call is available from the module itself:
`model.module.apply({"params": params}, x, train=True, rngs={"dropout": key})`.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_opt.models.base import Model, from_flax

__all__ = ["EmnistCNN", "emnist_cnn"]


def _as_images(x: jax.Array, height: int, width: int) -> jax.Array:
  """Reshapes `[B, H, W]`, `[B, H, W, 1]` or `[B, H·W]` to `[B, H, W, 1]`."""
  shape = tuple(jnp.shape(x))
  accepted = {(height, width), (height, width, 1), (height * width,)}
  if len(shape) < 2 or shape[1:] not in accepted:
    raise ValueError(
        f"EmnistCNN expects x shaped [B, {height}, {width}], [B, {height}, {width}, 1] or "
        f"[B, {height * width}]; got shape {shape}.")
  return jnp.reshape(x, (shape[0], height, width, 1))


class EmnistCNN(nn.Module):
  """`x [B, H, W] | [B, H, W, 1] | [B, H·W] -> logits [B, K]`, Reddi et al. (2021).

  Parameters: `{"conv_0", "conv_1", "dense", "output"}`, each `{"kernel", "bias"}`.

  Attributes:
    num_classes: K (62 for EMNIST: digits, upper and lower case letters).
    image_shape: (H, W) of the single-channel input images.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: parameter dtype.
  """

  num_classes: int = 62
  image_shape: Sequence[int] = (28, 28)
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    """Logits `[B, K]`; `train=True` turns dropout on and needs a `"dropout"` rng."""
    layer = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    h = _as_images(x, *self.image_shape)
    h = nn.relu(nn.Conv(32, (3, 3), padding="VALID", name="conv_0", **layer)(h))
    h = nn.relu(nn.Conv(64, (3, 3), padding="VALID", name="conv_1", **layer)(h))
    h = nn.max_pool(h, (2, 2), strides=(2, 2))
    h = nn.Dropout(0.25, deterministic=not train)(h)
    h = jnp.reshape(h, (h.shape[0], -1))
    h = nn.relu(nn.Dense(128, name="dense", **layer)(h))
    h = nn.Dropout(0.5, deterministic=not train)(h)
    return nn.Dense(self.num_classes, name="output", **layer)(h)


def emnist_cnn(num_classes: int = 62, *, image_shape: Sequence[int] = (28, 28), dtype: Any = None,
               param_dtype: Any = jnp.float32) -> Model:
  """The EMNIST CNN of Reddi et al. (2021) as a deterministic `Model` (dropout off).

  1,206,590 parameters with 62 classes and 28×28 images. Inputs may be
  `[B, 28, 28]`, `[B, 28, 28, 1]` or `[B, 784]`; all give the same logits.

  Args:
    num_classes: K.
    image_shape: (H, W) of the single-channel images, e.g. (8, 8) for
      scikit-learn's digits. Each side must be at least 6.
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.

  Returns:
    `Model` named `"emnist_cnn"` with input shape `(H, W, 1)`. Its `loss_fn`
    is without dropout; see the module docstring for training-mode calls.
  """
  height, width = (int(s) for s in image_shape)
  if min(height, width) < 6:
    raise ValueError(f"image_shape must be at least (6, 6) for two 3×3 convolutions and a 2×2 pool; "
                     f"got {tuple(image_shape)}.")
  module = EmnistCNN(num_classes, (height, width), dtype=dtype, param_dtype=param_dtype)
  return from_flax(module, (height, width, 1), name="emnist_cnn")
