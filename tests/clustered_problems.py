"""Planted-group problems shared by tests/test_ifca.py and tests/test_clustered_fl.py.

`label_shift_problem(groups)`: 4 clients per group, the same linear 4-class
rule per client, but group g sees the labels shifted by g (y = (y₀ + g) mod 4):
one softmax-linear model per group fits perfectly, one model for all cannot.
`least_squares_round(...)`: small least-squares inputs for the float64 NumPy
transcriptions of one round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjax_opt as fo

D, LABELS = 8, 4
PER_GROUP = 4


def softmax_loss(params, batch):
  logits = batch["x"] @ params["w"] + params["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def accuracy(params, x, y):
  return jnp.mean(jnp.argmax(x @ params["w"] + params["b"], -1) == y, axis=-1)


def zeros_model():
  return {"w": jnp.zeros((D, LABELS), jnp.float32), "b": jnp.zeros((LABELS,), jnp.float32)}


def label_shift_problem(groups: int, steps: int = 5, batch: int = 20, seed: int = 0):
  """(train `ClientBatches` of every client, test (x `[N, 200, D]`, y `[N, 200]`), planted group `[N]`)."""
  rng = np.random.default_rng(seed)
  w_true = rng.normal(size=(D, LABELS))
  n = groups * PER_GROUP
  group = np.repeat(np.arange(groups), PER_GROUP)

  def draw(m):
    x = rng.normal(size=(n, m, D)).astype(np.float32)
    y = (np.argmax(x @ w_true, -1) + group[:, None]) % LABELS
    return x, y.astype(np.int32)

  x, y = draw(steps * batch)
  xt, yt = draw(200)
  batches = fo.ClientBatches(
      data={"x": jnp.asarray(x.reshape(n, steps, batch, D)), "y": jnp.asarray(y.reshape(n, steps, batch))},
      mask=jnp.asarray(np.ones((n, steps, batch), bool)),
      weight=jnp.asarray(np.full((n,), float(steps * batch), np.float32)),
      client_id=jnp.asarray(np.arange(n, dtype=np.int32)))
  return batches, (jnp.asarray(xt), jnp.asarray(yt)), group


def run_rounds(algorithm, params, batches, rounds, key):
  """`rounds` steps on the same batches, one compiled scan."""
  body = lambda s, _: (algorithm.step(s, batches), None)
  state = algorithm.init(params, key)
  return jax.lax.scan(body, state, None, length=rounds)[0]


@functools.cache
def _fedavg_run(rounds):
  """FedAvg's `rounds` rounds from zeros, the client step size traced: one program per round count (and shapes)."""

  def run(batches, lr):
    algo = fo.algorithms.fedavg(softmax_loss, client_optimizer=optax.sgd(lr))
    return run_rounds(algo, zeros_model(), batches, rounds, jax.random.key(0)).params

  return jax.jit(run)


@jax.jit
def _mean_accuracy(models, x, y):
  """Mean over clients of each client's model's accuracy on its examples (models stacked `[N, ...]`)."""
  return jnp.mean(jax.vmap(accuracy)(models, x, y))


@jax.jit
def _global_accuracy(params, x, y):
  """Mean over clients of one model's accuracy on each client's examples."""
  return jnp.mean(jax.vmap(lambda xc, yc: accuracy(params, xc, yc))(x, y))


def fedavg_accuracy(batches, test, rounds=60, lr=0.5):
  return float(_global_accuracy(_fedavg_run(rounds)(batches, lr), *test))


def personal_accuracy(state, test):
  """Mean over clients of the accuracy of the client's cluster model on its test examples."""
  return float(_mean_accuracy(fo.core.clusters.client_models(state), *test))


def squares_loss(params, batch):
  return 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])


def least_squares_inputs(num_clients=6, steps=3, batch=4, dim=3, seed=0, centers=None):
  """float64 NumPy data `x [N, S, B, D]`, `y [N, S, B]`, a mask with some padding, weights n_k, and the batches."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_clients, steps, batch, dim))
  if centers is None:
    centers = rng.normal(size=(num_clients, dim)) * 2
  y = np.einsum("nsbd,nd->nsb", x, centers) + 0.1 * rng.normal(size=(num_clients, steps, batch))
  mask = np.ones((num_clients, steps, batch), bool)
  mask[0, -1, 1:] = False
  mask[2, 0, :] = False  # an empty step
  weight = mask.reshape(num_clients, -1).sum(1).astype(np.float64)
  batches = fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)},
                             mask=jnp.asarray(mask), weight=jnp.asarray(weight, jnp.float32),
                             client_id=jnp.arange(num_clients, dtype=jnp.int32))
  return x, y, mask, weight, batches


def np_mean_loss(w, b, x, y, m):
  r = x @ w + b - y
  return np.sum(np.where(m, 0.5 * r * r, 0)) / max(m.sum(), 1)


def np_local_sgd(w, b, x, y, m, lr):
  """S masked SGD steps on the mean least-squares loss of each batch (an empty batch is skipped)."""
  for s in range(x.shape[0]):
    ms = m[s]
    if not ms.any():
      continue
    r = np.where(ms, x[s] @ w + b - y[s], 0)
    n = ms.sum()
    w, b = w - lr * (x[s].T @ r) / n, b - lr * r.sum() / n
  return w, b


def np_gradient(w, b, x, y, m):
  """∇ of the mean loss over all the client's real examples."""
  xf, yf, mf = x.reshape(-1, x.shape[-1]), y.reshape(-1), m.reshape(-1)
  r = np.where(mf, xf @ w + b - yf, 0)
  n = max(mf.sum(), 1)
  return (xf.T @ r) / n, r.sum() / n
