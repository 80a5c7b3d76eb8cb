"""Tests for fedjax_opt.models against independent references.

References: the papers' parameter arithmetic, float64 NumPy/scipy
cross-entropy and argmax, and `x @ W + b` in NumPy. The python blocks of
docs/models.md are executed, so the documentation cannot rot.
"""

from __future__ import annotations

import functools
import math
import pathlib
import re

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from fedjax_opt import models

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "models.md"
B = 8  # one batch size throughout, so each model's jitted functions compile once


# ----------------------------------------------------------------------------- helpers

_SHAPES: dict = {}


def _param_shapes(model: models.Model):
  """`jax.eval_shape(model.init)`, traced once per model (no compile, no RNG)."""
  if id(model) not in _SHAPES:
    _SHAPES[id(model)] = (model, jax.eval_shape(model.init, jax.random.key(0)))
  return _SHAPES[id(model)][1]


def _random_params(model: models.Model, seed: int, scale: float = 0.1):
  """Params with every entry drawn N(0, scale²), so logits are far from uniform."""
  leaves, treedef = jax.tree_util.tree_flatten(_param_shapes(model))
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_unflatten(
      treedef, [jnp.asarray(scale * rng.standard_normal(l.shape), jnp.float32) for l in leaves])


def _batch(model: models.Model, batch_size: int, seed: int):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, *model.input_shape)).astype(np.float32)
  y = rng.integers(0, model.num_classes, batch_size).astype(np.int32)
  return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def _reference_cross_entropy(logits, labels):
  """-log softmax(z)[y] per example, float64 scipy."""
  log_probs = scipy.special.log_softmax(np.asarray(logits, np.float64), axis=-1)
  return -log_probs[np.arange(len(labels)), np.asarray(labels)]


def _masked_mean(loss_fn, params, batch, mask):
  losses = loss_fn(params, batch)
  return jnp.sum(jnp.where(mask, losses, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _count_by_shapes(params) -> int:
  return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))


# Built once: each Model's jitted functions then compile once per shape for the whole file.
MODELS = {
    "logistic_regression": models.logistic_regression(20, 5),
    "mlp_2nn": models.mlp_2nn(),
    "emnist_cnn": models.emnist_cnn(),
}
SMALL_MLP = models.mlp_2nn(num_classes=4, hidden=8, input_dim=5)


@pytest.fixture(params=sorted(MODELS))
def model(request) -> models.Model:
  return MODELS[request.param]


# ----------------------------------------------------------------------------- parameter counts

def test_2nn_has_199210_parameters_as_in_mcmahan_et_al():
  shapes = jax.eval_shape(models.mlp_2nn().init, jax.random.key(0))
  expected = 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10
  assert expected == 199_210
  assert _count_by_shapes(shapes) == expected
  assert models.count_params(shapes) == expected


def test_emnist_cnn_has_1206590_parameters_as_in_reddi_et_al():
  shapes = jax.eval_shape(models.emnist_cnn(62).init, jax.random.key(0))
  conv1 = 3 * 3 * 1 * 32 + 32
  conv2 = 3 * 3 * 32 * 64 + 64
  features = 12 * 12 * 64  # 28 -> 26 -> 24 (valid 3x3 twice) -> 12 (2x2 pool)
  dense = features * 128 + 128
  output = 128 * 62 + 62
  assert conv1 + conv2 + dense + output == 1_206_590
  assert _count_by_shapes(shapes) == 1_206_590
  assert models.count_params(shapes) == 1_206_590
  assert shapes["conv_0"]["kernel"].shape == (3, 3, 1, 32)
  assert shapes["conv_1"]["kernel"].shape == (3, 3, 32, 64)
  assert shapes["dense"]["kernel"].shape == (9216, 128)
  assert shapes["output"]["kernel"].shape == (128, 62)


@pytest.mark.parametrize("d,k", [(1, 2), (30, 2), (784, 10), (123, 7)])
def test_logistic_regression_has_dk_plus_k_parameters(d, k):
  shapes = jax.eval_shape(models.logistic_regression(d, k).init, jax.random.key(0))
  assert _count_by_shapes(shapes) == d * k + k


def test_model_metadata():
  cnn = models.emnist_cnn()
  assert (cnn.name, cnn.input_shape, cnn.num_classes) == ("emnist_cnn", (28, 28, 1), 62)
  mlp = models.mlp_2nn()
  assert (mlp.name, mlp.input_shape, mlp.num_classes) == ("mlp_2nn", (784,), 10)
  lr = models.logistic_regression(13, 3)
  assert (lr.name, lr.input_shape, lr.num_classes) == ("logistic_regression", (13,), 3)


# ----------------------------------------------------------------------------- loss and accuracy

def test_loss_is_per_example_cross_entropy_of_the_logits(model):
  params = _random_params(model, seed=1)
  batch = _batch(model, B, seed=2)
  logits = np.asarray(model.apply(params, batch["x"]))
  losses = model.loss_fn(params, batch)
  assert losses.shape == (B,)
  assert losses.dtype == jnp.float32
  np.testing.assert_allclose(losses, _reference_cross_entropy(logits, batch["y"]), rtol=1e-5, atol=1e-6)


def test_accuracy_is_per_example_argmax_agreement(model):
  params = _random_params(model, seed=3)
  batch = _batch(model, B, seed=4)
  logits = np.asarray(model.apply(params, batch["x"]), np.float64)
  correct = model.accuracy_fn(params, batch)
  assert correct.shape == (B,)
  np.testing.assert_array_equal(correct, (logits.argmax(-1) == np.asarray(batch["y"])).astype(np.float32))
  # Labels set to the argmax: every example is correct.
  right = dict(batch, y=jnp.asarray(logits.argmax(-1), jnp.int32))
  np.testing.assert_array_equal(model.accuracy_fn(params, right), np.ones(B))


def test_loss_is_stable_for_huge_logits():
  model = models.logistic_regression(4, 3)
  params = {"linear": {"kernel": jnp.asarray([[1e4, -1e4, 0.0]] * 4, jnp.float32),
                       "bias": jnp.zeros(3, jnp.float32)}}
  batch = {"x": jnp.asarray([[1.0] * 4, [-1.0] * 4], jnp.float32), "y": jnp.asarray([1, 1], jnp.int32)}
  losses = model.loss_fn(params, batch)
  assert np.all(np.isfinite(losses))
  logits = np.asarray(model.apply(params, batch["x"]))
  np.testing.assert_allclose(losses, _reference_cross_entropy(logits, batch["y"]), rtol=1e-6)


def test_logistic_regression_logits_are_x_w_plus_b():
  model = models.logistic_regression(20, 5)
  params = _random_params(model, seed=5, scale=1.0)
  batch = _batch(model, B, seed=6)
  w = np.asarray(params["linear"]["kernel"], np.float64)
  b = np.asarray(params["linear"]["bias"], np.float64)
  expected = np.asarray(batch["x"], np.float64) @ w + b
  np.testing.assert_allclose(model.apply(params, batch["x"]), expected, rtol=1e-5, atol=1e-5)


def test_logistic_regression_starts_at_zero_with_loss_log_k():
  model = models.logistic_regression(20, 5)
  params = model.init(jax.random.key(7))
  assert all(np.all(leaf == 0) for leaf in jax.tree_util.tree_leaves(params))
  np.testing.assert_allclose(model.loss_fn(params, _batch(model, 3, seed=0)), np.full(3, np.log(5)), rtol=1e-6)


_SMALL_PARAMS = _random_params(SMALL_MLP, seed=8, scale=0.5)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(perm=st.permutations(range(6)), seed=st.integers(0, 2**16))
def test_losses_follow_their_examples_under_permutation(perm, seed):
  # Per-example: reordering the batch reorders the losses, nothing else.
  params, batch, loss = _SMALL_PARAMS, _batch(SMALL_MLP, 6, seed=seed), SMALL_MLP.loss_fn
  perm = np.asarray(perm)
  shuffled = jax.tree.map(lambda a: a[perm], batch)
  np.testing.assert_allclose(loss(params, shuffled), np.asarray(loss(params, batch))[perm], rtol=1e-6)


# ----------------------------------------------------------------------------- inputs

def test_cnn_accepts_three_input_layouts_with_identical_logits():
  model = MODELS["emnist_cnn"]
  params = _random_params(model, seed=10, scale=0.05)
  images = jnp.asarray(np.random.default_rng(11).random((3, 28, 28)), jnp.float32)
  apply = jax.jit(model.apply)
  out = [np.asarray(apply(params, x)) for x in (images, images[..., None], images.reshape(3, 784))]
  assert out[0].shape == (3, 62)
  np.testing.assert_array_equal(out[0], out[1])
  np.testing.assert_array_equal(out[0], out[2])


def test_cnn_on_other_image_sizes():
  model = models.emnist_cnn(10, image_shape=(8, 8))
  params = _random_params(model, seed=0)
  # 8 -> 6 -> 4 -> pooled 2: 2*2*64 features.
  assert params["dense"]["kernel"].shape == (256, 128)
  assert model.apply(params, jnp.zeros((2, 64))).shape == (2, 10)
  with pytest.raises(ValueError, match="image_shape"):
    models.emnist_cnn(image_shape=(5, 28))


@pytest.mark.parametrize("shape", [(2, 27, 28), (2, 28, 28, 3), (2, 783), (784,)])
def test_cnn_rejects_wrong_input_shapes(shape):
  model = MODELS["emnist_cnn"]
  params = jax.eval_shape(model.init, jax.random.key(0))
  with pytest.raises(ValueError, match="EmnistCNN expects x shaped"):
    jax.eval_shape(model.apply, params, jax.ShapeDtypeStruct(shape, jnp.float32))


def test_dense_models_flatten_images_and_reject_wrong_sizes():
  model = MODELS["mlp_2nn"]
  params = _random_params(model, seed=12)
  x = jnp.asarray(np.random.default_rng(13).random((2, 28, 28)), jnp.float32)
  np.testing.assert_array_equal(model.apply(params, x), model.apply(params, x.reshape(2, 784)))
  with pytest.raises(ValueError, match="784 features per example"):
    model.apply(params, jnp.zeros((2, 783)))
  lr = models.logistic_regression(6, 2)
  with pytest.raises(ValueError, match="6 features per example"):
    lr.apply(_random_params(lr, seed=0), jnp.zeros((2, 7)))


def test_bad_batches_get_clear_errors():
  model = models.logistic_regression(3, 2)
  params = _random_params(model, seed=0)
  x = jnp.zeros((4, 3))
  with pytest.raises(TypeError, match='"x"'):
    model.loss_fn(params, (x, jnp.zeros(4, jnp.int32)))
  with pytest.raises(TypeError, match="integer"):
    model.loss_fn(params, {"x": x, "y": jnp.zeros(4)})
  with pytest.raises(ValueError, match=r"\[B\]"):
    model.loss_fn(params, {"x": x, "y": jnp.zeros((4, 1), jnp.int32)})
  with pytest.raises(ValueError, match=r"\[B, K\]"):
    models.classification_loss(lambda p, x: x[:, 0])(params, {"x": x, "y": jnp.zeros(4, jnp.int32)})


# ----------------------------------------------------------------------------- transformations

def test_grad_of_masked_mean_loss_is_finite(model):
  params = _random_params(model, seed=14, scale=0.05)
  batch = _batch(model, B, seed=15)
  mask = jnp.arange(B) < 5
  value, grads = jax.jit(jax.value_and_grad(lambda p: _masked_mean(model.loss_fn, p, batch, mask)))(params)
  assert np.isfinite(value)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
  assert any(np.any(g != 0) for g in jax.tree_util.tree_leaves(grads))


def test_padding_examples_get_zero_weight_in_the_gradient():
  # The masked mean over 3 real + 2 padding examples equals the plain mean over the 3.
  model = SMALL_MLP
  params = _random_params(model, seed=16, scale=0.5)
  batch = _batch(model, 5, seed=17)
  mask = jnp.asarray([True, True, True, False, False])
  real = jax.tree.map(lambda a: a[:3], batch)

  @jax.jit
  def both(params):
    return (jax.grad(lambda p: _masked_mean(model.loss_fn, p, batch, mask))(params),
            jax.grad(lambda p: jnp.mean(model.loss_fn(p, real)))(params))

  g_masked, g_real = both(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_masked, g_real)


def test_vmap_over_client_params_and_batches_matches_a_loop(model):
  num_clients = 2
  params = jax.tree.map(lambda *a: jnp.stack(a), *[_random_params(model, seed=18 + c) for c in range(num_clients)])
  batches = [_batch(model, B, seed=19 + c) for c in range(num_clients)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *batches)
  losses = jax.jit(jax.vmap(model.loss_fn))(params, stacked)
  assert losses.shape == (num_clients, B)
  for c in range(num_clients):
    client = jax.tree.map(lambda a: a[c], params)
    np.testing.assert_allclose(losses[c], model.loss_fn(client, batches[c]), rtol=1e-5, atol=1e-6)


def test_init_is_a_function_of_the_key():
  a, b = SMALL_MLP.init(jax.random.key(0)), SMALL_MLP.init(jax.random.key(1))
  assert not np.allclose(a["hidden_0"]["kernel"], b["hidden_0"]["kernel"])
  jax.tree.map(np.testing.assert_array_equal, a, SMALL_MLP.init(jax.random.key(0)))
  assert jax.tree.map(jnp.shape, a) == jax.tree.map(jnp.shape, _SMALL_PARAMS)


def test_low_precision_params_still_give_float32_losses():
  model = models.mlp_2nn(num_classes=3, hidden=6, input_dim=4, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(shapes))
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _random_params(model, seed=19))
  losses = model.loss_fn(params, _batch(model, 4, seed=20))
  assert losses.dtype == jnp.float32 and np.all(np.isfinite(losses))


# ----------------------------------------------------------------------------- from_flax

def test_from_flax_wraps_a_user_module():

  class TwoLayer(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(jnp.tanh(nn.Dense(4)(x)))

  model = models.from_flax(TwoLayer(), (5,))
  assert (model.name, model.input_shape, model.num_classes) == ("TwoLayer", (5,), 3)
  assert _count_by_shapes(jax.eval_shape(model.init, jax.random.key(0))) == 5 * 4 + 4 + 4 * 3 + 3
  params = _random_params(model, seed=24, scale=1.0)
  batch = _batch(model, 6, seed=23)
  logits = np.asarray(TwoLayer().apply({"params": params}, batch["x"]))
  np.testing.assert_allclose(model.loss_fn(params, batch), _reference_cross_entropy(logits, batch["y"]),
                             rtol=1e-5, atol=1e-6)


def test_from_flax_rejects_batch_statistics_and_non_logit_outputs():

  class WithBatchNorm(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(nn.BatchNorm(use_running_average=True)(x))

  class Scalar(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(x)[:, 0]

  with pytest.raises(TypeError, match="input_shape"):
    models.from_flax(Scalar(), 3)
  with pytest.raises(ValueError, match="batch_stats"):
    models.from_flax(WithBatchNorm(), (3,))
  with pytest.raises(ValueError, match=r"\[B, K\]"):
    models.from_flax(Scalar(), (3,))


# ----------------------------------------------------------------------------- docs

def _doc_blocks() -> list[tuple[str, str]]:
  """`(section heading, code)` for every python block of docs/models.md, in order."""
  blocks, heading = [], ""
  for match in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```", DOCS.read_text(), flags=re.DOTALL | re.MULTILINE):
    if match.group(1):
      heading = match.group(1).lstrip("# ").strip()
    else:
      blocks.append((heading, match.group(2)))
  return blocks


@functools.lru_cache(maxsize=None)
def _run_doc_block(index: int) -> dict:
  """Runs the setup block, then block `index` in a copy of its namespace (once per block)."""
  blocks = _doc_blocks()
  setup: dict = {}
  exec(compile(blocks[0][1], f"{DOCS.name}[block 0]", "exec"), setup)  # pylint: disable=exec-used
  namespace = dict(setup)
  exec(compile(blocks[index][1], f"{DOCS.name}[block {index}]", "exec"), namespace)  # pylint: disable=exec-used
  return namespace


def test_docs_have_the_bring_your_own_snippets():
  own = [code for heading, code in _doc_blocks() if heading == "Bring your own model"]
  assert len(own) == 3
  assert "from_flax" in own[0]
  assert "nnx.split" in own[1] and "nnx.merge" in own[1]
  assert "classification_loss" in own[2]
  for code in own:
    assert len(code.strip().splitlines()) <= 10


@pytest.mark.slow  # executes the documents
@pytest.mark.parametrize("index", range(1, len(_doc_blocks())))
def test_docs_snippet_runs_and_gives_per_example_losses(index):
  namespace = _run_doc_block(index)
  loss_fn, params, batch = namespace["loss_fn"], namespace["params"], namespace["batch"]
  num_examples = batch["y"].shape[0]
  if _doc_blocks()[index][0] != "Bring your own model":
    assert loss_fn(params, batch).shape == (num_examples,)
    return  # shipped models: gradients and vmap are tested above

  @jax.jit
  def grad_and_per_client_losses(params):
    grads = jax.grad(lambda p: jnp.mean(loss_fn(p, batch)))(params)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)  # clients are a vmapped axis
    return grads, jax.vmap(loss_fn, in_axes=(0, None))(stacked, batch)

  grads, per_client = grad_and_per_client_losses(params)
  assert per_client.shape == (2, num_examples)  # loss_fn(params, batch) is [B]
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
  assert any(np.any(g != 0) for g in jax.tree_util.tree_leaves(grads))


def test_docs_dropout_recipe_turns_dropout_on_while_the_shipped_cnn_stays_deterministic():
  [index] = [i for i, (heading, _) in enumerate(_doc_blocks()) if heading.startswith("Dropout")]
  namespace = _run_doc_block(index)
  model, params, x = namespace["model"], namespace["params"], namespace["batch"]["x"]
  train_logits = namespace["train_logits"]
  evaluation = model.apply(params, x)
  np.testing.assert_array_equal(evaluation, model.apply(params, x))
  draw_1, draw_2 = (train_logits(params, x, k) for k in jax.random.split(jax.random.key(1)))
  assert draw_1.shape == (x.shape[0], model.num_classes)
  assert not np.allclose(draw_1, evaluation)
  assert not np.allclose(draw_1, draw_2)
