"""FedU against a float64 NumPy transcription and closed-form fixed points (block solves with L ⊗ I)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt import graphs
from fedjax_opt.algorithms.fedu import fedu, laplacian_penalty

D = 3


def quad_loss(w, batch):
  """Per-example ½(xᵀw − y)²: the masked mean is ½wᵀAw − bᵀw + c, A = XᵀX/n, b = Xᵀy/n."""
  return 0.5 * jnp.square(batch["x"] @ w - batch["y"])


def _grad_np(w, x, y, m):
  return x[m].T @ (x[m] @ w - y[m]) / max(m.sum(), 1)


def _weighted_laplacian(graph, weights):
  a = np.zeros((graph.num_nodes, graph.num_nodes))
  for (i, j), w in zip(graph.edges, weights):
    a[i, j] = a[j, i] = w
  return np.diag(a.sum(1)) - a


def _numpy_round(table, x, y, mask, weight, ids, lam, lr, lap, at):
  """Algorithm 1 of Dinh et al.: R local SGD steps, then x_i ← y_i − ηλR (L z)_i for the clients taking part."""
  steps = x.shape[1]
  local = table.copy()
  took_part = np.zeros(len(table), bool)
  for c in range(x.shape[0]):
    if weight[c] == 0:
      continue
    w = table[ids[c]].copy()
    for s in range(steps):
      if mask[c, s].any():
        w = w - lr * _grad_np(w, x[c, s], y[c, s], mask[c, s])
    local[ids[c]] = w
    took_part[ids[c]] = True
  z = local if at == "local" else table
  new = table.copy()
  new[took_part] = (local - lr * lam * steps * lap @ z)[took_part]
  return new


@pytest.mark.parametrize("at, client_map", [("local", "vmap"), ("start", "sequential")])
def test_rounds_match_numpy_with_weighted_edges_and_partial_participation(rng, at, client_map):
  """Two rounds on a weighted ring of 6, 3 clients (plus a zero-weight slot) each, R = 2 mini-batch steps."""
  n, lam, lr, steps, b = 6, 0.8, 0.1, 2, 4
  graph = graphs.ring(n)
  weights = rng.uniform(0.5, 2.0, size=graph.num_edges)
  lap = _weighted_laplacian(graph, weights)
  with jax.enable_x64(True):
    algo = fedu(quad_loss, lam, lr, graph=graphs.with_weights(graph, weights), num_clients=n, local_steps=steps,
                regularizer_at=at, client_map=client_map)
    table = rng.normal(size=(n, D))
    state = algo.init(jnp.zeros(D), jax.random.key(0)).replace(local_params=jnp.asarray(table))
    step = jax.jit(algo.step)
    for ids, weight in (([4, 0, 1, 3], [2.0, 3.0, 1.0, 0.0]), ([2, 5, 3, 1], [1.0, 1.0, 4.0, 2.0])):
      x, y = rng.normal(size=(4, steps, b, D)), rng.normal(size=(4, steps, b))
      mask = np.ones((4, steps, b), bool)
      mask[0, 1] = False
      mask[1, 0, :3] = False
      batches = fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                                 weight=jnp.asarray(np.asarray(weight)), client_id=jnp.asarray(ids, jnp.int32))
      state = step(state, batches)
      table = _numpy_round(table, x, y, mask, np.asarray(weight), ids, lam, lr, lap, at)
      np.testing.assert_allclose(np.asarray(state.local_params), table, rtol=1e-12, atol=1e-14)
      np.testing.assert_allclose(np.asarray(state.params), table.mean(0), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(fo.personalized_params(state, 5)), table[5], rtol=1e-12)
    penalty = 0.5 * lam * sum(w * np.sum((table[i] - table[j])**2) for (i, j), w in zip(graph.edges, weights))
    np.testing.assert_allclose(float(state.metrics["laplacian_penalty"]), penalty, rtol=1e-6)
    weighted = graphs.with_weights(graph, weights)
    np.testing.assert_allclose(float(laplacian_penalty(state.local_params, weighted, lam)), penalty, rtol=1e-12)


def _problem(rng, n_clients, n=8):
  xs = rng.normal(loc=0.3 * np.arange(n_clients)[:, None, None], size=(n_clients, n, D))
  ys = np.einsum("cnd,cd->cn", xs, rng.normal(size=(n_clients, D))) + 0.1 * rng.normal(size=(n_clients, n))
  a = [x.T @ x / n for x in xs]
  b = [x.T @ y / n for x, y in zip(xs, ys)]
  batches = fo.ClientBatches(data={"x": jnp.asarray(xs[:, None]), "y": jnp.asarray(ys[:, None])},
                             mask=jnp.ones((n_clients, 1, n), bool), weight=jnp.full((n_clients,), float(n)),
                             client_id=jnp.arange(n_clients, dtype=jnp.int32))
  return batches, a, b


def _run(algo, batches, rounds):
  def body(s, _):
    return algo.step(s, batches), None

  init = algo.init(jnp.zeros(D), jax.random.key(0))
  return jax.jit(lambda s: jax.lax.scan(body, s, None, length=rounds)[0])(init)


def _block(a, lap):
  """A = blockdiag(A_i) and L ⊗ I."""
  n = len(a)
  big = np.zeros((n * D, n * D))
  for i, ai in enumerate(a):
    big[i * D:(i + 1) * D, i * D:(i + 1) * D] = ai
  return big, np.kron(lap, np.eye(D))


@pytest.mark.parametrize("at", ["start", "local"])
def test_fixed_point_on_quadratics(rng, at):
  """R = 1 full-batch GD, full participation, a chain of 5 with weighted edges.

  "start": the fixed point is F's stationary point, (A + λ L⊗I) x = b.
  "local": it is (I − ηλ L⊗I)(A x − b) + λ (L⊗I) x = 0,
  off F's stationarity by exactly ηλ (L⊗I)(A x − b).
  """
  n_clients, lam = 5, 0.7
  with jax.enable_x64(True):
    batches, a, b = _problem(rng, n_clients)
  graph = graphs.chain(n_clients)
  weights = np.array([1.0, 0.5, 2.0, 1.5])
  lap = _weighted_laplacian(graph, weights)
  big_a, big_l = _block(a, lap)
  rhs = np.concatenate(b)
  lr = 0.5 / np.linalg.eigvalsh(big_a + lam * big_l).max()
  if at == "start":
    expected = np.linalg.solve(big_a + lam * big_l, rhs)
  else:
    shrink = np.eye(n_clients * D) - lr * lam * big_l
    expected = np.linalg.solve(shrink @ big_a + lam * big_l, shrink @ rhs)
  with jax.enable_x64(True):
    algo = fedu(quad_loss, lam, lr, graph=graphs.with_weights(graph, jnp.asarray(weights)), num_clients=n_clients,
                local_steps=1, regularizer_at=at)
    x = np.asarray(_run(algo, batches, 4000).local_params).reshape(-1)
  np.testing.assert_allclose(x, expected, rtol=1e-9, atol=1e-10)
  stationarity = big_a @ x - rhs + lam * big_l @ x  # ∇f_i(x_i) + λ Σ_j a_ij (x_i − x_j), stacked
  if at == "start":
    assert np.abs(stationarity).max() < 1e-9
  else:
    np.testing.assert_allclose(stationarity, lr * lam * big_l @ (big_a @ x - rhs), atol=1e-10)
    assert np.abs(stationarity).max() > 1e-6


def test_lam_zero_gives_local_solutions_and_large_lam_the_pooled_consensus(rng):
  """λ = 0: x_i = A_i⁻¹ b_i. Complete graph, λ = 40: every x_i within O(1/λ) of (Σ A_i)⁻¹ Σ b_i."""
  n_clients = 4
  with jax.enable_x64(True):
    batches, a, b = _problem(rng, n_clients)
  graph = graphs.from_adjacency(1 - np.eye(n_clients))
  local = np.stack([np.linalg.solve(ai, bi) for ai, bi in zip(a, b)])
  pooled = np.linalg.solve(sum(a), sum(b))
  smoothness = max(np.linalg.eigvalsh(ai).max() for ai in a)
  with jax.enable_x64(True):
    algo = fedu(quad_loss, 0.0, 0.5 / smoothness, graph=graph, num_clients=n_clients, local_steps=1)
    x0 = np.asarray(_run(algo, batches, 3000).local_params)
    np.testing.assert_allclose(x0, local, rtol=1e-8, atol=1e-9)
    lam = 40.0
    lr = 1.0 / (lam * n_clients + smoothness)  # λ_max(L) = n on the complete graph
    algo = fedu(quad_loss, lam, lr, graph=graph, num_clients=n_clients, local_steps=1, regularizer_at="start")
    x = np.asarray(_run(algo, batches, 20000).local_params)
  big_a, big_l = _block(a, graphs.laplacian(graph))
  np.testing.assert_allclose(x.reshape(-1), np.linalg.solve(big_a + lam * big_l, np.concatenate(b)), rtol=1e-7,
                             atol=1e-8)
  gap, spread = np.abs(x - pooled).max(), np.abs(local - pooled).max()
  assert gap < 5.0 / lam * spread
  assert spread > 0.1


def test_sweep_over_lam_with_vmap(rng):
  """λ may be traced: a vmapped sweep of one round equals separate rounds."""
  graph = graphs.ring(5)
  with jax.enable_x64(True):
    batches, _, _ = _problem(rng, 5)

    def one(lam):
      algo = fedu(quad_loss, lam, 0.1, graph=graph, num_clients=5, local_steps=1)
      return algo.step(algo.init(jnp.ones(D), jax.random.key(0)), batches).local_params

    lams = jnp.array([0.0, 0.5, 2.0])
    swept = jax.jit(jax.vmap(one))(lams)
    single = jax.jit(one)
    for k in range(3):
      np.testing.assert_allclose(np.asarray(swept[k]), np.asarray(single(lams[k])), rtol=1e-12)
    assert not np.allclose(np.asarray(swept[0]), np.asarray(swept[2]))


def test_bad_arguments(rng):
  graph = graphs.ring(5)
  kw = dict(graph=graph, local_steps=1)
  with pytest.raises(ValueError, match="num_nodes"):
    fedu(quad_loss, 1.0, 0.1, num_clients=6, **kw)
  with pytest.raises(ValueError, match="lam"):
    fedu(quad_loss, -1.0, 0.1, num_clients=5, **kw)
  with pytest.raises(ValueError, match="eta"):
    fedu(quad_loss, 1.0, 0.0, num_clients=5, **kw)
  with pytest.raises(ValueError, match="local_steps"):
    fedu(quad_loss, 1.0, 0.1, graph=graph, num_clients=5, local_steps=0)
  with pytest.raises(ValueError, match="weights"):
    graphs.with_weights(graph, np.ones(4))
  with pytest.raises(ValueError, match="weights"):
    graphs.with_weights(graph, -np.ones(5))
  with pytest.raises(ValueError, match="graph.weights"):  # a Graph built directly is checked by the factory
    fedu(quad_loss, 1.0, 0.1, graph=graph._replace(weights=-np.ones(5)), num_clients=5, local_steps=1)
  with pytest.raises(ValueError, match="regularizer_at"):
    fedu(quad_loss, 1.0, 0.1, num_clients=5, regularizer_at="middle", **kw)
  with pytest.raises(TypeError, match="graph"):
    fedu(quad_loss, 1.0, 0.1, graph=np.ones((5, 5)), num_clients=5, local_steps=1)
  batches, _, _ = _problem(rng, 5)
  algo = fedu(quad_loss, 1.0, 0.1, graph=graph, num_clients=5, local_steps=2)
  with pytest.raises(ValueError, match="local_steps"):
    algo.step(algo.init(jnp.zeros(D), jax.random.key(0)), batches)


def test_laplacian_step_above_its_stability_bound_warns_and_diverges():
  """2/λ_max(L) is the bound (ring of 6: λ_max = 4, bound 0.5): below it the Laplacian step contracts the clients'
  disagreement, above it the step alone amplifies it, and the factory warns naming the bound."""
  from fedjax_opt.algorithms.fedu import laplacian_step_bound

  graph = graphs.ring(6)
  lap = graphs.laplacian(graph)
  assert laplacian_step_bound(graph) == pytest.approx(2 / np.linalg.eigvalsh(lap)[-1])
  assert laplacian_step_bound(graph) == pytest.approx(0.5)
  x = np.array([1.0, -1, 1, -1, 1, -1])  # the top eigenvector of the ring's Laplacian
  for step, grows in ((0.45, False), (0.55, True)):
    y = x.copy()
    for _ in range(50):
      y = y - step * lap @ y
    assert (np.abs(y).max() > 1) == grows
  with pytest.warns(UserWarning, match=r"exceeds 2/λ_max\(L\) = 0.5"):
    fedu(quad_loss, 5.5, 0.1, graph=graph, num_clients=6, local_steps=1)
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fedu(quad_loss, 4.5, 0.1, graph=graph, num_clients=6, local_steps=1)


def test_the_step_bound_uses_the_edge_weights_and_the_bound_itself_is_allowed():
  """2/λ_max of the *weighted* Laplacian (a chain of 3 with a_01 = 1, a_12 = 3: λ_max = 4 + √7), the factory
  warns only strictly above it (at ηλR = 2/λ_max the top mode is reflected, not amplified), and a graph without
  edges has no bound."""
  import warnings

  from fedjax_opt.algorithms.fedu import laplacian_step_bound

  graph = graphs.chain(3)
  weights = np.array([1.0, 3.0])
  top = np.linalg.eigvalsh(_weighted_laplacian(graph, weights))[-1]
  assert laplacian_step_bound(graphs.with_weights(graph, weights)) == pytest.approx(2 / top, rel=1e-14)
  assert top == pytest.approx(4 + np.sqrt(7), rel=1e-14)
  assert laplacian_step_bound(graph) == pytest.approx(2 / 3, rel=1e-14)  # unweighted chain of 3: λ_max = 3
  # 2/3 > ηλR = 0.5 > 2/(4 + √7) ≈ 0.30: only the weighted bound is exceeded.
  with pytest.warns(UserWarning, match="exceeds"):
    fedu(quad_loss, 5.0, 0.1, graph=graphs.with_weights(graph, weights), num_clients=3, local_steps=1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fedu(quad_loss, 5.0, 0.1, graph=graph, num_clients=3, local_steps=1)
    # chain of 2: λ_max = 2 exactly, bound 1.0, and ηλR = 0.5 · 2 · 1 = 1.0 sits on it.
    assert laplacian_step_bound(graphs.chain(2)) == 1.0
    fedu(quad_loss, 2.0, 0.5, graph=graphs.chain(2), num_clients=2, local_steps=1)
  with pytest.warns(UserWarning, match="exceeds"):
    fedu(quad_loss, 2.0001, 0.5, graph=graphs.chain(2), num_clients=2, local_steps=1)
  assert laplacian_step_bound(graphs.from_edges(np.zeros((0, 2), int), num_nodes=3)) == float("inf")
  assert laplacian_step_bound(graphs.Graph(0, np.zeros((0, 2), np.int64))) == float("inf")


def test_a_zero_edge_weight_is_the_graph_without_that_edge(rng):
  """a_ij = 0 is allowed (a_ij ≥ 0) and removes the edge: the round equals FedU on the ring with that edge dropped."""
  n = 5
  ring = graphs.ring(n)
  weights = np.ones(ring.num_edges)
  weights[2] = 0.0
  cut = graphs.from_edges(np.delete(ring.edges, 2, axis=0), num_nodes=n)
  batches, _, _ = _problem(rng, n)
  table = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
  states = []
  for graph in (graphs.with_weights(ring, weights), cut):
    algo = fedu(quad_loss, 0.7, 0.1, graph=graph, num_clients=n, local_steps=1)
    state = algo.init(jnp.zeros(D), jax.random.key(0)).replace(local_params=table)
    states.append(algo.step(state, batches))
  np.testing.assert_allclose(np.asarray(states[0].local_params), np.asarray(states[1].local_params), rtol=1e-6)
  np.testing.assert_allclose(float(states[0].metrics["laplacian_penalty"]),
                             float(states[1].metrics["laplacian_penalty"]), rtol=1e-6)


def test_update_norm_is_the_change_of_the_average_model_and_state_keeps_its_dtypes(rng):
  """metrics["update_norm"] = ‖(1/N) Σ_i x_i⁺ − (1/N) Σ_i x_i‖ (the server does not aggregate updates, so the
  metric is the average model's move); with a bfloat16 model the state stays bfloat16."""
  n = 4
  batches, _, _ = _problem(rng, n)
  for dtype in (jnp.float32, jnp.bfloat16):
    algo = fedu(quad_loss, 0.5, 0.1, graph=graphs.complete(n), num_clients=n, local_steps=1)
    table = jnp.asarray(rng.normal(size=(n, D)), dtype)
    state = algo.init(jnp.zeros(D, dtype), jax.random.key(0))
    state = state.replace(local_params=table, params=jnp.mean(table.astype(jnp.float32), 0).astype(dtype))
    new = jax.jit(algo.step)(state, batches)
    assert new.params.dtype == dtype and new.local_params.dtype == dtype
    move = np.asarray(new.params, np.float64) - np.asarray(state.params, np.float64)
    assert np.linalg.norm(move) > 1e-2
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(float(new.metrics["update_norm"]), np.linalg.norm(move), rtol=tol)
