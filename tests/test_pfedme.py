"""pFedMe against its closed-form fixed point on quadratics and a float64 NumPy transcription of Algorithm 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt.algorithms.pfedme import pfedme

D, N = 3, 5


def quad_loss(w, batch):
  """Per-example ½(xᵀw − y)²: the masked mean is ½wᵀAw − bᵀw + c, A = XᵀX/n, b = Xᵀy/n."""
  return 0.5 * jnp.square(batch["x"] @ w - batch["y"])


def _grad_np(w, x, y, m):
  n = max(m.sum(), 1)
  return x[m].T @ (x[m] @ w - y[m]) / n


def _numpy_round(w, thetas, x, y, mask, weight, ids, lam, k, nu, eta, beta, personalize_all=False,
                 with_loss=False):
  """Algorithm 1 of Dinh et al.: θ from w_t, warm across local steps; uniform mean over clients taking part.

  personalize_all: every client with data solves its personal problem (θ_i written), only weight > 0 is averaged.
  with_loss: also the round's `client_loss`: each aggregated client's loss is the example-weighted mean, over its
  local steps, of the mean over the K inner steps of its batch loss at θ before each inner step; the clients'
  losses are then averaged weighted by their examples.
  """
  thetas = thetas.copy()
  finals, losses, counts = [], [], []
  for c in range(x.shape[0]):
    if weight[c] == 0 and not (personalize_all and mask[c].any()):
      continue
    w_i, theta = w.copy(), w.copy()
    loss_sum = 0.0
    for r in range(x.shape[1]):
      if not mask[c, r].any():
        continue
      m = mask[c, r]
      inner = []
      for _ in range(k):
        inner.append(np.mean(0.5 * (x[c, r][m] @ theta - y[c, r][m]) ** 2))
        theta = theta - nu * (_grad_np(theta, x[c, r], y[c, r], mask[c, r]) + lam * (theta - w_i))
      loss_sum += np.mean(inner) * m.sum()
      w_i = w_i - eta * lam * (w_i - theta)
    if weight[c] > 0:
      finals.append(w_i)
      losses.append(loss_sum / max(mask[c].sum(), 1))
      counts.append(mask[c].sum())
    thetas[ids[c]] = theta
  new_w = (1 - beta) * w + beta * np.mean(finals, axis=0)
  if with_loss:
    return new_w, thetas, np.average(losses, weights=counts)
  return new_w, thetas


def _batches(rng, steps):
  """Clients with ids 3, 0, 4 (client 0's last step is padding) and a zero-weight client with id 0."""
  c, b = 4, 4
  x, y = rng.normal(size=(c, steps, b, D)), rng.normal(size=(c, steps, b))
  mask = np.ones((c, steps, b), bool)
  mask[0, -1] = steps == 1
  mask[2, 0, :2] = False
  weight = np.array([4.0, 3.0, 5.0, 0.0])
  ids = np.array([3, 0, 4, 0])
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray(weight, jnp.float32), client_id=jnp.asarray(ids, jnp.int32)), (
                              x, y, mask, weight, ids)


@pytest.mark.parametrize("beta,local_steps", [(1.0, 1), (1.5, 2)])
def test_one_round_matches_numpy_and_only_participants_write(rng, beta, local_steps):
  lam, k, nu, eta = 2.0, 4, 0.1, 0.3
  with jax.enable_x64(True):
    batches, (x, y, mask, weight, ids) = _batches(rng, local_steps)
    w = rng.normal(size=D)
    thetas = rng.normal(size=(N, D))
    algo = pfedme(quad_loss, lam, eta, beta, num_clients=N, local_steps=local_steps, inner_steps=k, inner_lr=nu)
    state = algo.init(jnp.asarray(w), jax.random.key(0)).replace(local_params=jnp.asarray(thetas))
    out = jax.jit(algo.step)(state, batches)
    ref_w, ref_thetas, ref_loss = _numpy_round(w, thetas, x, y, mask, weight, ids, lam, k, nu, eta, beta,
                                               with_loss=True)
    np.testing.assert_allclose(np.asarray(out.params), ref_w, rtol=1e-12)
    np.testing.assert_allclose(float(out.metrics["client_loss"]), ref_loss, rtol=1e-6)  # float32 metric
    np.testing.assert_allclose(np.asarray(out.local_params), ref_thetas, rtol=1e-12)
    for i in (1, 2):  # not sampled: bit for bit
      np.testing.assert_array_equal(np.asarray(out.local_params[i]), thetas[i])
    np.testing.assert_allclose(np.asarray(fo.personalized_params(out, 3)), ref_thetas[3], rtol=1e-12)


def test_personalize_all_updates_every_client_and_aggregates_the_sampled_ones(rng):
  """The paper's Algorithm 1 (`personalize_all=True`): all N = 5 clients run R = 2 local steps and write θ_i; the
  server averages w_{i,R} over the sampled S_t = {3, 0, 2} (weight > 0) only; a padding row (empty mask, id 0)
  writes nothing. Against NumPy; the default form leaves the unsampled θ_1, θ_4 untouched, same global model."""
  lam, k, nu, eta, beta = 2.0, 4, 0.1, 0.3, 1.5
  c, steps, b = 6, 2, 4
  with jax.enable_x64(True):
    x, y = rng.normal(size=(c, steps, b, D)), rng.normal(size=(c, steps, b))
    mask = np.ones((c, steps, b), bool)
    mask[1, -1] = False
    mask[3, 0, :2] = False
    mask[5] = False  # padding
    weight, ids = np.array([4.0, 3.0, 0.0, 0.0, 5.0, 0.0]), np.array([3, 0, 4, 1, 2, 0])
    batches = fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                               weight=jnp.asarray(weight), client_id=jnp.asarray(ids, jnp.int32))
    w, thetas = rng.normal(size=D), rng.normal(size=(N, D))
    runs = {}
    for personalize_all in (True, False):
      algo = pfedme(quad_loss, lam, eta, beta, num_clients=N, local_steps=steps, inner_steps=k, inner_lr=nu,
                    personalize_all=personalize_all)
      state = algo.init(jnp.asarray(w), jax.random.key(0)).replace(local_params=jnp.asarray(thetas))
      runs[personalize_all] = jax.jit(algo.step)(state, batches)
    out = runs[True]
    ref_w, ref_thetas = _numpy_round(w, thetas, x, y, mask, weight, ids, lam, k, nu, eta, beta, personalize_all=True)
    np.testing.assert_allclose(np.asarray(out.params), ref_w, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(out.local_params), ref_thetas, rtol=1e-12)
    assert np.abs(ref_thetas - thetas).min(axis=1).min() > 1e-6  # every θ_i moved, the unsampled 1 and 4 included
    assert int(out.metrics["num_clients"]) == 3
    default = runs[False]
    np.testing.assert_allclose(np.asarray(default.params), ref_w, rtol=1e-12)
    for i in (1, 4):
      np.testing.assert_array_equal(np.asarray(default.local_params[i]), thetas[i])
    np.testing.assert_allclose(np.asarray(default.local_params)[[0, 2, 3]], ref_thetas[[0, 2, 3]], rtol=1e-12)


def test_global_model_reaches_the_moreau_envelope_fixed_point(rng):
  """Exact inner solves give θ_i(w) = (A_i + λI)⁻¹(b_i + λw); the stationary w solves Σ_i λ(w − θ_i(w)) = 0."""
  lam, n_clients, n = 1.0, 4, 8
  with jax.enable_x64(True):
    xs = [rng.normal(loc=0.5 * i, size=(n, D)) for i in range(n_clients)]
    ys = [x @ rng.normal(size=D) + 0.1 * rng.normal(size=n) for x in xs]
    a = [x.T @ x / n for x in xs]
    b = [x.T @ yy / n for x, yy in zip(xs, ys)]
    m = [np.linalg.inv(ai + lam * np.eye(D)) for ai in a]
    # Σ_i (w − M_i(b_i + λw)) = 0  ⇔  (N I − λ Σ M_i) w = Σ M_i b_i
    w_star = np.linalg.solve(n_clients * np.eye(D) - lam * sum(m), sum(mi @ bi for mi, bi in zip(m, b)))
    theta_star = np.stack([mi @ (bi + lam * w_star) for mi, bi in zip(m, b)])
    nu = 1.0 / (max(np.linalg.eigvalsh(ai).max() for ai in a) + lam)
    batches = fo.ClientBatches(
        data={"x": jnp.asarray(np.stack(xs))[:, None], "y": jnp.asarray(np.stack(ys))[:, None]},
        mask=jnp.ones((n_clients, 1, n), bool), weight=jnp.full((n_clients,), float(n)),
        client_id=jnp.arange(n_clients, dtype=jnp.int32))
    algo = pfedme(quad_loss, lam, 0.8, 1.0, num_clients=n_clients, local_steps=1, inner_steps=200, inner_lr=nu)
    state = algo.init(jnp.zeros(D), jax.random.key(0))
    final, _ = jax.jit(lambda s: jax.lax.scan(lambda s, _: (algo.step(s, batches), None), s, None, length=200))(state)
    np.testing.assert_allclose(np.asarray(final.params), w_star, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(np.asarray(final.local_params), theta_star, rtol=1e-8, atol=1e-10)
    global_opt = np.linalg.solve(sum(a), sum(b))
    assert np.linalg.norm(w_star - global_opt) > 1e-2  # the fixed point is not FedAvg's optimum


def test_bad_arguments():
  kw = dict(num_clients=N, local_steps=1, inner_steps=1, inner_lr=0.1)
  with pytest.raises(ValueError, match="lam"):
    pfedme(quad_loss, 0.0, 0.1, 1.0, **kw)
  with pytest.raises(ValueError, match="inner_steps"):
    pfedme(quad_loss, 1.0, 0.1, 1.0, **{**kw, "inner_steps": 0})
  with pytest.raises(ValueError, match="inner_lr"):
    pfedme(quad_loss, 1.0, 0.1, 1.0, **{**kw, "inner_lr": -0.1})
  with pytest.raises(ValueError, match="beta"):
    pfedme(quad_loss, 1.0, 0.1, 0.0, **kw)
  with pytest.raises(ValueError, match="num_clients"):
    pfedme(quad_loss, 1.0, 0.1, 1.0, **{**kw, "num_clients": 0})
  with pytest.raises(ValueError, match="personalize_all must be one of"):
    pfedme(quad_loss, 1.0, 0.1, 1.0, **kw, personalize_all="yes")
  batches, _ = _batches(np.random.default_rng(1), 2)
  algo = pfedme(quad_loss, 1.0, 0.1, 1.0, **kw)
  with pytest.raises(ValueError, match="local_steps"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), batches)
  algo = pfedme(quad_loss, 1.0, 0.1, 1.0, **{**kw, "local_steps": 2, "num_clients": 3})
  with pytest.raises(ValueError, match="num_clients"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), batches)
