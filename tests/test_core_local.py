"""local_train: masked local SGD against a float64 NumPy loop; padding steps are no-ops."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_opt.core import as_single_step, local_train, masked_mean_loss
from conftest import lsq_grad_np, lsq_loss


def _client(rng, steps, batch, counts, d=4):
  """One client's [S, B, ...] data with `counts[s]` real examples in step s."""
  x = rng.normal(size=(steps, batch, d))
  y = rng.normal(size=(steps, batch))
  mask = np.zeros((steps, batch), bool)
  for s, c in enumerate(counts):
    mask[s, :c] = True
  return x, y, mask


def test_local_sgd_matches_numpy_loop(rng):
  """S masked SGD steps equal the float64 loop x ← x − η ∇f_s(x) over each step's real examples."""
  x, y, mask = _client(rng, steps=5, batch=6, counts=[6, 3, 1, 6, 2])
  w0, b0, lr = rng.normal(size=4), 0.5, 0.1
  w, b, losses = w0.copy(), b0, []
  for s in range(5):
    xs, ys = x[s][mask[s]], y[s][mask[s]]
    losses.append(0.5 * (xs @ w + b - ys) ** 2)
    gw, gb = lsq_grad_np(w, b, xs, ys)
    w, b = w - lr * gw, b - lr * gb
  with jax.enable_x64(True):
    out = local_train(lsq_loss, optax.sgd(lr), {"w": jnp.asarray(w0), "b": jnp.asarray(b0)},
                      {"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.asarray(mask))
    np.testing.assert_allclose(out.delta["w"], w - w0, rtol=1e-12)
    np.testing.assert_allclose(out.delta["b"], b - b0, rtol=1e-12)
    np.testing.assert_allclose(out.loss, np.mean(np.concatenate(losses)), rtol=1e-12)
    assert float(out.num_examples) == mask.sum()
    assert int(out.num_steps) == 5


def test_empty_steps_change_neither_params_nor_optimizer_state(rng):
  """Momentum SGD with all-padding steps interleaved equals momentum SGD on the real steps only."""
  x, y, mask = _client(rng, steps=3, batch=4, counts=[4, 2, 3])
  lr, beta = 0.05, 0.9
  w0 = rng.normal(size=4)
  w, b, m_w, m_b = w0.copy(), 0.0, np.zeros(4), 0.0
  for s in range(3):
    gw, gb = lsq_grad_np(w, b, x[s][mask[s]], y[s][mask[s]])
    m_w, m_b = gw + beta * m_w, gb + beta * m_b
    w, b = w - lr * m_w, b - lr * m_b
  # Same data with empty steps before, between and after the real ones.
  order = [None, 0, None, None, 1, 2, None]
  xp = np.stack([np.full((4, 4), 7.0) if s is None else x[s] for s in order])
  yp = np.stack([np.full(4, -3.0) if s is None else y[s] for s in order])
  mp = np.stack([np.zeros(4, bool) if s is None else mask[s] for s in order])
  with jax.enable_x64(True):
    out = local_train(lsq_loss, optax.sgd(lr, momentum=beta), {"w": jnp.asarray(w0), "b": jnp.asarray(0.0)},
                      {"x": jnp.asarray(xp), "y": jnp.asarray(yp)}, jnp.asarray(mp))
    np.testing.assert_allclose(out.delta["w"], w - w0, rtol=1e-12)
    np.testing.assert_allclose(out.delta["b"], b, rtol=1e-12)
    assert int(out.num_steps) == 3


def test_gradient_correction_is_added_to_every_step(rng):
  """x ← x − η (∇f_s(x) + h(x)) with h(x) = μ (x − x0): FedProx's proximal pull, in NumPy."""
  x, y, mask = _client(rng, steps=4, batch=5, counts=[5, 5, 5, 5])
  lr, mu = 0.1, 0.7
  w0 = rng.normal(size=4)
  w, b = w0.copy(), 0.0
  for s in range(4):
    gw, gb = lsq_grad_np(w, b, x[s], y[s])
    w, b = w - lr * (gw + mu * (w - w0)), b - lr * (gb + mu * b)
  with jax.enable_x64(True):
    p0 = {"w": jnp.asarray(w0), "b": jnp.asarray(0.0)}
    correction = lambda p: jax.tree.map(lambda a, a0: mu * (a - a0), p, p0)
    out = local_train(lsq_loss, optax.sgd(lr), p0, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.asarray(mask),
                      gradient_correction=correction)
    np.testing.assert_allclose(out.delta["w"], w - w0, rtol=1e-12)


def test_single_step_fold_gives_full_batch_gradient(rng):
  """One sgd(1.0) step on the folded [1, S·B] batch returns −∇ of the mean over all real examples."""
  x, y, mask = _client(rng, steps=3, batch=4, counts=[4, 1, 2])
  w0 = rng.normal(size=4)
  gw, gb = lsq_grad_np(w0, 0.2, x[mask], y[mask])
  with jax.enable_x64(True):
    data, m = as_single_step({"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.asarray(mask))
    assert m.shape == (1, 12) and data["x"].shape == (1, 12, 4)
    out = local_train(lsq_loss, optax.sgd(1.0), {"w": jnp.asarray(w0), "b": jnp.asarray(0.2)}, data, m)
    np.testing.assert_allclose(out.delta["w"], -gw, rtol=1e-12)
    np.testing.assert_allclose(out.delta["b"], -gb, rtol=1e-12)


def test_unroll_gives_the_same_result(rng):
  x, y, mask = _client(rng, steps=6, batch=3, counts=[3, 2, 0, 3, 1, 3])
  args = ({"w": jnp.ones(4), "b": jnp.zeros(())}, {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)},
          jnp.asarray(mask))
  a = local_train(lsq_loss, optax.adam(0.01), *args)
  b = local_train(lsq_loss, optax.adam(0.01), *args, unroll=6)
  np.testing.assert_allclose(a.delta["w"], b.delta["w"], rtol=1e-6)


def test_masked_mean_loss_rejects_scalar_loss():
  scalar_loss = lambda p, batch: jnp.mean(batch["x"] @ p)
  with pytest.raises(ValueError, match=r"loss_fn must return per-example losses shaped \[B\] = \(3,\); got shape \(\)"):
    masked_mean_loss(scalar_loss, jnp.ones(2), {"x": jnp.ones((3, 2))}, jnp.ones(3, bool))


def test_local_train_rejects_wrong_mask_rank():
  with pytest.raises(ValueError, match=r"mask must be \[S, B\]"):
    local_train(lsq_loss, optax.sgd(0.1), {"w": jnp.ones(2), "b": jnp.zeros(())},
                {"x": jnp.ones((2, 3, 2)), "y": jnp.ones((2, 3))}, jnp.ones((2, 3, 1), bool))
