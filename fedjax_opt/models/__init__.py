"""Small flax models and per-example classification losses.

A `Model` bundles `init(key) -> params`, `apply(params, x) -> logits [B, K]`
and the per-example `loss_fn(params, batch) -> [B]` / `accuracy_fn` the
algorithms and the driver use. Shipped models:

* `logistic_regression(num_features, num_classes)`: one dense layer.
* `mlp_2nn()`: the MNIST 2NN of McMahan et al. (AISTATS 2017), 199,210 parameters.
* `emnist_cnn()`: the EMNIST CNN of Reddi et al. (ICLR 2021), 1,206,590 parameters.
* `char_rnn(vocab_size)`: a character-level GRU (or LSTM) for next-character
  prediction over token windows (Shakespeare), 63,696 parameters by default.

Bring your own: `from_flax(module, input_shape)` for a flax linen module, or
`classification_loss(apply_fn)` for any `apply_fn(params, x) -> logits`
(plain jnp, flax nnx via `nnx.split` / `nnx.merge`, equinox ...).
See docs/models.md.
"""

from fedjax_opt.models.base import Model
from fedjax_opt.models.base import classification_accuracy
from fedjax_opt.models.base import classification_loss
from fedjax_opt.models.base import count_params
from fedjax_opt.models.base import from_flax
from fedjax_opt.models.cnn import EmnistCNN
from fedjax_opt.models.cnn import emnist_cnn
from fedjax_opt.models.linear import LogisticRegression
from fedjax_opt.models.linear import logistic_regression
from fedjax_opt.models.mlp import MLP
from fedjax_opt.models.mlp import mlp_2nn
from fedjax_opt.models.rnn import CharRNN
from fedjax_opt.models.rnn import char_rnn

__all__ = [
    "CharRNN",
    "EmnistCNN",
    "LogisticRegression",
    "MLP",
    "Model",
    "char_rnn",
    "classification_accuracy",
    "classification_loss",
    "count_params",
    "emnist_cnn",
    "from_flax",
    "logistic_regression",
    "mlp_2nn",
]
