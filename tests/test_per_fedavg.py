"""Per-FedAvg against closed forms on quadratics and a float64 NumPy transcription of one round."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt.algorithms.per_fedavg import meta_gradient, per_fedavg

D = 3


def quad_loss(w, batch):
  """Per-example ½(xᵀw − y)²: the masked mean is f(w) = ½wᵀAw − bᵀw + c, A = XᵀX/n, b = Xᵀy/n."""
  return 0.5 * jnp.square(batch["x"] @ w - batch["y"])


def _ab(x, y, m=None):
  m = np.ones(len(y), bool) if m is None else m
  n = max(m.sum(), 1)
  return x[m].T @ x[m] / n, x[m].T @ y[m] / n


def _grad_np(w, x, y, m):
  a, b = _ab(x, y, m)
  return a @ w - b


def _batch(rng, n=4):
  x, y = rng.normal(size=(n, D)), rng.normal(size=n)
  return x, y


def _as_jax(x, y):
  return ({"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.ones(len(y), bool))


def test_maml_meta_gradient_is_the_closed_form_on_quadratics(rng):
  """f(w) = ½wᵀAw − bᵀw: ∇_w f_{D'}(w − α∇f_D(w)) = (I − αA_D)(A_{D'}(w − α(A_D w − b_D)) − b_{D'})."""
  alpha = 0.3
  with jax.enable_x64(True):
    d1, d2 = _batch(rng), _batch(rng)
    w = rng.normal(size=D)
    for inner, outer in [(d1, d1), (d1, d2)]:  # the one-batch formula, then D ≠ D'
      a1, b1 = _ab(*inner)
      a2, b2 = _ab(*outer)
      expected = (np.eye(D) - alpha * a1) @ (a2 @ (w - alpha * (a1 @ w - b1)) - b2)
      got = meta_gradient(quad_loss, alpha, jnp.asarray(w), _as_jax(*inner), _as_jax(*outer), variant="maml")
      np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12)


def test_hessian_free_equals_maml_and_first_order_misses_exactly_the_hessian_term(rng):
  """With D'' = D: HF (exact jvp HVP, and the paper's finite difference) = MAML; MAML − FO = −α A_D ∇f_{D'}(w̃)."""
  alpha = 0.2
  with jax.enable_x64(True):
    d1, d2 = _batch(rng), _batch(rng)
    w = rng.normal(size=D)
    args = (quad_loss, alpha, jnp.asarray(w), _as_jax(*d1), _as_jax(*d2), _as_jax(*d1))
    maml = np.asarray(meta_gradient(*args, variant="maml"))
    hf = np.asarray(meta_gradient(*args, variant="hf"))
    hf_fd = np.asarray(meta_gradient(*args, variant="hf", hessian="finite_difference", delta=1e-3))
    fo_ = np.asarray(meta_gradient(*args, variant="fo"))
    np.testing.assert_allclose(hf, maml, rtol=1e-12)
    np.testing.assert_allclose(hf_fd, maml, rtol=1e-8)  # a central difference is exact on a quadratic
    a1, b1 = _ab(*d1)
    adapted = w - alpha * (a1 @ w - b1)
    g_outer = _grad_np(adapted, *d2, np.ones(len(d2[1]), bool))
    np.testing.assert_allclose(fo_, g_outer, rtol=1e-12)
    np.testing.assert_allclose(maml - fo_, -alpha * a1 @ g_outer, rtol=1e-10, atol=1e-14)


def logistic_loss(w, batch):
  """Per-example binary logistic loss log(1 + e^s) − y s, s = xᵀw: not quadratic, so ∇²f depends on where it is taken."""
  s = batch["x"] @ w
  return jax.nn.softplus(s) - batch["y"] * s


def _logistic_grad_hess_np(w, x, y):
  """float64 gradient Xᵀ(σ(Xw) − y)/n and Hessian Xᵀ diag(σ(1 − σ)) X/n of the mean logistic loss."""
  p = 1 / (1 + np.exp(-(x @ w)))
  return x.T @ (p - y) / len(y), (x.T * (p * (1 - p))) @ x / len(y)


def _logistic_batch(rng, n=6):
  x = rng.normal(size=(n, D))
  return x, (rng.uniform(size=n) < 0.5).astype(np.float64)


def test_hessian_free_evaluates_the_hessian_at_w_on_a_non_quadratic_loss(rng):
  """Logistic regression, float64. D = D' = D'': HF (exact HVP) = the exact MAML gradient ∇_w f(w − α∇f(w)),
  taken by `jax.grad` through the adapted step, to 1e-12. D, D', D'' all different: HF =
  (I − α∇²f(w; D''))∇f(w̃; D') with the Hessian at w (NumPy), which differs from the Hessian at w̃."""
  alpha = 0.7
  with jax.enable_x64(True):
    w = rng.normal(size=D)
    d1, d2, d3 = _logistic_batch(rng), _logistic_batch(rng), _logistic_batch(rng)
    mean_loss = lambda p, b: jnp.mean(logistic_loss(p, {"x": jnp.asarray(b[0]), "y": jnp.asarray(b[1])}))
    exact = jax.grad(lambda p: mean_loss(p - alpha * jax.grad(mean_loss)(p, d1), d1))(jnp.asarray(w))
    one = (logistic_loss, alpha, jnp.asarray(w), _as_jax(*d1), _as_jax(*d1), _as_jax(*d1))
    np.testing.assert_allclose(np.asarray(meta_gradient(*one, variant="hf")), np.asarray(exact), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(meta_gradient(*one, variant="maml")), np.asarray(exact), rtol=1e-12)
    got = np.asarray(meta_gradient(logistic_loss, alpha, jnp.asarray(w), _as_jax(*d1), _as_jax(*d2), _as_jax(*d3),
                                   variant="hf"))
    adapted = w - alpha * _logistic_grad_hess_np(w, *d1)[0]
    g_outer = _logistic_grad_hess_np(adapted, *d2)[0]
    hess_at_w, hess_at_adapted = _logistic_grad_hess_np(w, *d3)[1], _logistic_grad_hess_np(adapted, *d3)[1]
    np.testing.assert_allclose(got, g_outer - alpha * hess_at_w @ g_outer, rtol=1e-12)
    # The evaluation point matters here: the Hessian at w̃ gives a visibly different meta-gradient.
    assert np.linalg.norm(alpha * (hess_at_w - hess_at_adapted) @ g_outer) > 1e-3 * np.linalg.norm(got)


def _numpy_round(w, x, y, mask, weight, alpha, beta, variant):
  """Algorithm 1 of Fallah et al. on flat vectors: groups of m consecutive batches, uniform mean over clients."""
  m = 3 if variant == "hf" else 2
  deltas = []
  for c in range(x.shape[0]):
    if weight[c] == 0:
      continue
    wc = w.copy()
    for k in range(x.shape[1] // m):
      bd, bo = (x[c, m * k], y[c, m * k], mask[c, m * k]), (x[c, m * k + 1], y[c, m * k + 1], mask[c, m * k + 1])
      if not bo[2].any():
        continue
      adapted = wc - alpha * _grad_np(wc, *bd)
      g = _grad_np(adapted, *bo)
      if variant == "maml":
        g = g - alpha * _ab(bd[0], bd[1], bd[2])[0] @ g
      elif variant == "hf":
        g = g - alpha * _ab(x[c, m * k + 2], y[c, m * k + 2], mask[c, m * k + 2])[0] @ g
      wc = wc - beta * g
    deltas.append(wc - w)
  return w + np.mean(deltas, axis=0)


def _round_batches(rng, steps):
  """Three clients with `steps` batches of 4 (client 1: its last step is padding) plus a zero-weight client."""
  c, b = 4, 4
  x, y = rng.normal(size=(c, steps, b, D)), rng.normal(size=(c, steps, b))
  mask = np.ones((c, steps, b), bool)
  mask[1, -1] = False
  mask[2, 0, :2] = False
  weight = np.array([4.0, 3.0, 5.0, 0.0])
  batches = fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                             weight=jnp.asarray(weight, jnp.float32), client_id=jnp.arange(c, dtype=jnp.int32))
  return batches, x, y, mask, weight


@pytest.mark.parametrize("variant", ["fo", "hf", "maml"])
def test_one_round_matches_numpy(rng, variant):
  """Two local meta-steps per client, partial last group, empty slots, a zero-weight padding client."""
  alpha, beta, local_steps = 0.1, 0.2, 2
  m = 3 if variant == "hf" else 2
  with jax.enable_x64(True):
    batches, x, y, mask, weight = _round_batches(rng, m * local_steps)
    w = rng.normal(size=D)
    algo = per_fedavg(quad_loss, alpha, beta, local_steps=local_steps, variant=variant)
    out = jax.jit(algo.step)(algo.init(jnp.asarray(w), jax.random.key(0)), batches)
    np.testing.assert_allclose(np.asarray(out.params), _numpy_round(w, x, y, mask, weight, alpha, beta, variant),
                               rtol=1e-12)
    assert int(out.metrics["num_clients"]) == 3


def test_personalized_model_is_one_adaptation_step(rng):
  alpha = 0.25
  with jax.enable_x64(True):
    batches, x, y, mask, _ = _round_batches(rng, 2)
    w = rng.normal(size=D)
    algo = per_fedavg(quad_loss, alpha, 0.1, local_steps=1)
    got = algo.personalize(jnp.asarray(w), jax.tree.map(lambda a: a[1], batches.data), batches.mask[1])
    expected = w - alpha * _grad_np(w, x[1].reshape(-1, D), y[1].reshape(-1), mask[1].reshape(-1))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12)
    state = algo.init(jnp.asarray(w), jax.random.key(0))
    stacked = fo.client_map.map_clients(None, lambda p, client: algo.personalize(p, *client), state.params,
                                        (batches.data, batches.mask))
    np.testing.assert_allclose(np.asarray(stacked[1]), expected, rtol=1e-12)


def test_training_lowers_the_post_adaptation_loss(rng):
  """A jitted scan of 30 HF rounds lowers the clients' mean loss after one adaptation step (NumPy-evaluated)."""
  alpha, beta = 0.1, 0.1
  batches, x, _, mask, weight = _round_batches(rng, 3)
  y = x @ np.array([1.0, 2.0, -1.0]) + 0.1 * rng.normal(size=x.shape[:3])  # a signal to learn
  batches = batches.replace(data={"x": batches.data["x"], "y": jnp.asarray(y, jnp.float32)})
  algo = per_fedavg(quad_loss, alpha, beta, local_steps=1, variant="hf")

  def post_adaptation_loss(w):
    w = np.asarray(w, np.float64)
    total = 0.0
    for c in range(3):
      xc, yc, mc = x[c].reshape(-1, D), y[c].reshape(-1), mask[c].reshape(-1)
      adapted = w - alpha * _grad_np(w, xc, yc, mc)
      total += np.mean(0.5 * (xc[mc] @ adapted - yc[mc]) ** 2)
    return total / 3

  state = algo.init(jnp.zeros(D, jnp.float32), jax.random.key(0))
  final, _ = jax.lax.scan(lambda s, _: (algo.step(s, batches), None), state, None, length=30)
  assert post_adaptation_loss(final.params) < 0.5 * post_adaptation_loss(state.params)


def test_bad_arguments():
  with pytest.raises(ValueError, match="variant"):
    per_fedavg(quad_loss, 0.1, 0.1, local_steps=1, variant="sgd")
  with pytest.raises(ValueError, match="alpha"):
    per_fedavg(quad_loss, -0.1, 0.1, local_steps=1)
  with pytest.raises(ValueError, match="beta"):
    per_fedavg(quad_loss, 0.1, 0.0, local_steps=1)
  with pytest.raises(ValueError, match="local_steps"):
    per_fedavg(quad_loss, 0.1, 0.1, local_steps=0)
  with pytest.raises(ValueError, match="hessian"):
    per_fedavg(quad_loss, 0.1, 0.1, local_steps=1, hessian="bfgs")
  batches, *_ = _round_batches(np.random.default_rng(1), 3)
  algo = per_fedavg(quad_loss, 0.1, 0.1, local_steps=2, variant="fo")
  with pytest.raises(ValueError, match="local_steps"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), batches)


@pytest.mark.parametrize("hessian, rtol", [("exact", 1e-12), ("finite_difference", 1e-5)])
def test_a_hessian_free_round_on_logistic_regression_is_the_maml_step(rng, hessian, rtol):
  """One client, one meta-step, D = D' = D'' (logistic regression, float64): the round moves w by −β ∇_w f(w − α∇f(w)),
  the MAML gradient taken by `jax.grad` through the adapted step. The exact HVP (the default) matches to 1e-12; the
  paper's central difference at the default δ = 1e-3 to 1e-5 (its error is O(δ²)), and visibly not to 1e-12; the
  round's client_loss is the post-adaptation loss."""
  alpha, beta = 0.7, 0.3
  with jax.enable_x64(True):
    x, y = _logistic_batch(rng)
    x = 4 * x  # large gradients and curvature: a central difference with a large δ would be visibly off
    w = jnp.asarray(rng.normal(size=D))
    mean_loss = lambda p: jnp.mean(logistic_loss(p, {"x": jnp.asarray(x), "y": jnp.asarray(y)}))
    want = w - beta * jax.grad(lambda p: mean_loss(p - alpha * jax.grad(mean_loss)(p)))(w)
    batches = fo.ClientBatches(data={"x": jnp.asarray(np.tile(x, (1, 3, 1, 1))), "y": jnp.asarray(np.tile(y, (1, 3, 1)))},
                               mask=jnp.ones((1, 3, len(y)), bool), weight=jnp.ones(1),
                               client_id=jnp.zeros(1, jnp.int32))
    options = {} if hessian == "exact" else {"hessian": hessian}
    algo = per_fedavg(logistic_loss, alpha, beta, local_steps=1, variant="hf", **options)
    state = jax.jit(algo.step)(algo.init(w, jax.random.key(0)), batches)
    got = np.asarray(state.params)
    np.testing.assert_allclose(got, np.asarray(want), rtol=rtol)
    # The reported client loss is the post-adaptation loss f(w − α∇f(w); D'), not the meta-loss's surrogate terms.
    np.testing.assert_allclose(float(state.metrics["client_loss"]), float(mean_loss(w - alpha * jax.grad(mean_loss)(w))),
                               rtol=1e-6)
    if hessian != "exact":
      assert not np.allclose(got, np.asarray(want), rtol=1e-12, atol=0)
