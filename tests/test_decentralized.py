"""Gossip, D-PSGD and gradient tracking against float64 NumPy transcriptions and closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt.algorithms.decentralized import dpsgd, gossip, gradient_tracking
from conftest import lsq_loss, make_clients, pack

D = 3
N = 6


def _rows(table):
  """A table {"w": [N, D], "b": [N]} as `[N, D + 1]` float64."""
  return np.column_stack([np.asarray(table["w"], np.float64), np.asarray(table["b"], np.float64)])


def _table(rows, dtype=jnp.float32):
  return {"w": jnp.asarray(rows[:, :-1], dtype), "b": jnp.asarray(rows[:, -1], dtype)}


def _zeros(dtype=jnp.float32):
  return {"w": jnp.zeros(D, dtype), "b": jnp.zeros((), dtype)}


def _start(algo, x0, dtype=jnp.float32):
  """The initial state with node i at row i of `x0` `[N, D + 1]` (params = their mean)."""
  state = algo.init(_zeros(dtype), jax.random.key(0))
  table = _table(x0, dtype)
  return state.replace(local_params=table, params=jax.tree.map(lambda t: jnp.mean(t, 0), table))


def _arrays(batches):
  """(x `[N, S, B, D + 1]` with a ones column, y `[N, S, B]`, mask `[N, S, B]`) as float64 NumPy."""
  x = np.asarray(batches.data["x"], np.float64)
  x = np.concatenate([x, np.ones(x.shape[:-1] + (1,))], axis=-1)
  return x, np.asarray(batches.data["y"], np.float64), np.asarray(batches.mask)


def _grad(v, x, y, m):
  """Gradient of the mean ½(xᵀv − y)² over the real examples (mask m), float64; 0 without any."""
  r = np.where(m, x @ v - y, 0.0)
  return x.T @ r / max(m.sum(), 1)


def _node_grads(v, x, y, mask):
  """`[N, D + 1]`: every node's gradient on all its S·B examples folded into one batch."""
  return np.stack([_grad(v[i], x[i].reshape(-1, D + 1), y[i].reshape(-1), mask[i].reshape(-1))
                   for i in range(len(v))])


def _local_sgd(v, x, y, mask, eta, steps):
  """Δ `[N, D + 1]` of `steps` SGD steps per node, step r on batch r mod S (empty batches skipped)."""
  out = []
  for i in range(len(v)):
    u = v[i].copy()
    for r in range(steps):
      s = r % x.shape[1]
      if mask[i, s].any():
        u = u - eta * _grad(u, x[i, s], y[i, s], mask[i, s])
    out.append(u - v[i])
  return np.stack(out)


@pytest.fixture
def problem(rng):
  """Six heterogeneous least-squares nodes (unequal sizes, padded), packed in S = 2 steps of 5 slots."""
  clients = make_clients(rng, [6, 9, 4, 10, 7, 8], D)
  return clients, pack(clients, 2, 5)


def _ring_w():
  return fo.graphs.metropolis_hastings(fo.graphs.ring(N))


@pytest.mark.parametrize("time_varying", [False, True])
def test_pure_gossip_is_the_matrix_power_and_contracts_by_the_spectral_gap(problem, rng, time_varying):
  """η = 0: x^t = W^(t−1) ⋯ W^(0) x^0 (W^t x^0 for one W); the mean is kept; the consensus distance shrinks by
  (1 − gap)² or more per round, with the gap of `graphs.spectral_gap` (for one W)."""
  _, batches = problem
  mixing = fo.graphs.random_matchings(fo.graphs.ring(N), 4, seed=1) if time_varying else _ring_w()
  algo = gossip(lsq_loss, graph=mixing)
  x0 = rng.normal(size=(N, D + 1))
  state = _start(algo, x0)
  step = jax.jit(algo.step)
  want = x0
  gap = fo.graphs.spectral_gap(mixing)
  for t in range(8):
    previous = _rows(state.local_params)
    state = step(state, batches)
    w = mixing[t % 4] if time_varying else mixing
    want = w @ want
    got = _rows(state.local_params)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(np.append(state.params["w"], state.params["b"]), x0.mean(0), atol=1e-5)
    distance = np.mean(np.sum((want - want.mean(0))**2, axis=1))
    assert float(state.metrics["consensus_distance"]) == pytest.approx(distance, rel=1e-4)
    if not time_varying:
      before = np.mean(np.sum((previous - previous.mean(0))**2, axis=1))
      assert distance <= (1 - gap)**2 * before * (1 + 1e-5)
  if not time_varying:
    np.testing.assert_allclose(_rows(state.local_params), np.linalg.matrix_power(mixing, 8) @ x0, atol=1e-5)
    assert float(state.metrics["bytes_sent"]) == 2 * (D + 1) * 4  # two neighbours on a ring, one float32 model
  assert int(state.metrics["num_nonfinite"]) == 0


@pytest.mark.parametrize("local_steps", [None, 3])
def test_dpsgd_and_gossip_match_numpy_transcriptions(problem, rng, local_steps):
  """D-PSGD x ← W x + Δ(x) and gossip x ← W(x + Δ(x)), Δ = R masked SGD steps, for three rounds."""
  _, batches = problem
  x, y, mask = _arrays(batches)
  eta = 0.05
  steps = local_steps or x.shape[1]
  w = fo.graphs.metropolis_hastings(fo.graphs.erdos_renyi(N, 0.5, seed=0))
  x0 = rng.normal(size=(N, D + 1))
  for factory, adapt_first in ((dpsgd, False), (gossip, True)):
    algo = factory(lsq_loss, eta, graph=w, local_steps=local_steps)
    state = _start(algo, x0)
    want = x0
    for _ in range(3):
      state = jax.jit(algo.step)(state, batches)
      delta = _local_sgd(want, x, y, mask, eta, steps)
      want = w @ (want + delta) if adapt_first else w @ want + delta
    np.testing.assert_allclose(_rows(state.local_params), want, atol=2e-5, err_msg=factory.__name__)


def test_gradient_tracking_matches_the_diging_iteration_in_numpy(problem, rng):
  """y^k = W^(k−1) y^{k−1} + ∇f(x^k) − ∇f(x^{k−1}), x^{k+1} = W^(k) x^k − η y^k, from y^{−1} = ∇f(x^{−1}) = 0,
  with a time-varying sequence of lazy Metropolis matrices of random graphs."""
  _, batches = problem
  x, y, mask = _arrays(batches)
  eta = 0.05
  seq = np.stack([fo.graphs.metropolis_hastings(fo.graphs.erdos_renyi(N, 0.4, seed=s), lazy=True) for s in range(3)])
  algo = gradient_tracking(lsq_loss, eta, graph=seq)
  x0 = rng.normal(size=(N, D + 1))
  state = _start(algo, x0)
  xs, ys, g_old = x0, np.zeros_like(x0), np.zeros_like(x0)
  step = jax.jit(algo.step)
  for k in range(5):
    state = step(state, batches)
    g = _node_grads(xs, x, y, mask)
    ys = seq[(k - 1) % 3] @ ys + g - g_old
    xs = seq[k % 3] @ xs - eta * ys
    g_old = g
    np.testing.assert_allclose(_rows(state.local_params), xs, atol=2e-5)
    np.testing.assert_allclose(_rows(state.tracker), ys, atol=2e-5)
    np.testing.assert_allclose(_rows(state.tracker).sum(0), g.sum(0), atol=2e-5)  # Σ y_i = Σ ∇f_i(x_i)
  assert float(state.metrics["bytes_sent"]) > 0


def _minimiser(clients, skip=()):
  """argmin Σ_i f_i (f_i the mean least squares of node i) by the normal equations, float64."""
  design = lambda a: np.hstack([a, np.ones((len(a), 1))])
  keep = [c for i, c in enumerate(clients) if i not in skip]
  lhs = sum(design(a).T @ design(a) / len(a) for a, _ in keep)
  rhs = sum(design(a).T @ b / len(b) for a, b in keep)
  return np.linalg.solve(lhs, rhs)


def _run(algo, batches, rounds, dtype):
  def body(state, _):
    return algo.step(state, batches), None

  return jax.jit(lambda s: jax.lax.scan(body, s, None, length=rounds)[0])(algo.init(_zeros(dtype), jax.random.key(0)))


def test_gradient_tracking_reaches_the_minimiser_where_dpsgd_keeps_a_bias(problem):
  """Same constant η, heterogeneous nodes: DIGing's every node reaches argmin Σ_i f_i (numpy.linalg.solve) to 1e-8;
  D-PSGD's average stays measurably away from it and its nodes disagree."""
  clients, _ = problem
  with jax.enable_x64(True):
    batches = pack(clients, 1, 10, dtype=np.float64)  # one full batch per node: deterministic gradients
    star = _minimiser(clients)
    eta = 0.03  # the nodes' smoothness constants are 2 … 8.6; DIGing diverges at 0.05 on this ring
    w = _ring_w()
    tracked = _run(gradient_tracking(lsq_loss, eta, graph=w), batches, 2000, jnp.float64)
    plain = _run(dpsgd(lsq_loss, eta, graph=w), batches, 2000, jnp.float64)
    np.testing.assert_allclose(_rows(tracked.local_params), np.tile(star, (N, 1)), atol=1e-8)
    assert float(tracked.metrics["consensus_distance"]) < 1e-16
    bias = np.linalg.norm(np.append(plain.params["w"], plain.params["b"]) - star)
    assert bias > 1e-2, bias
    assert float(plain.metrics["consensus_distance"]) > 1e-4
    # D-PSGD's limit is a fixed point: x = W x − η ∇f(x), not the minimiser.
    xp = _rows(plain.local_params)
    x, y, mask = _arrays(batches)
    np.testing.assert_allclose(w @ xp - eta * _node_grads(xp, x, y, mask), xp, atol=1e-10)


@pytest.mark.parametrize("name", ["gossip", "dpsgd", "gradient_tracking"])
def test_a_node_with_nan_data_is_cut_out_of_the_graph(problem, rng, name):
  """Node 2's data holds a NaN: its rows stay bit for bit, it is counted, and the others follow the NumPy iteration
  with W̃ (node 2's edges removed, their weight on the diagonal); every state entry stays finite."""
  _, batches = problem
  bad = 2
  data = dict(batches.data)
  data["x"] = data["x"].at[bad, 0, 0, 0].set(jnp.nan)
  batches = batches.replace(data=data)
  x, y, mask = _arrays(batches)
  w = _ring_w()
  cut = w.copy()
  cut[bad, :], cut[:, bad] = 0.0, 0.0
  cut[np.diag_indices(N)] += 1.0 - cut.sum(1)
  eta = 0.05
  algo = {"gossip": gossip(lsq_loss, 0.0, graph=w), "dpsgd": dpsgd(lsq_loss, eta, graph=w, local_steps=1),
          "gradient_tracking": gradient_tracking(lsq_loss, eta, graph=w)}[name]
  x0 = rng.normal(size=(N, D + 1))
  state = _start(algo, x0)
  xs, ys, g_old = x0.copy(), np.zeros_like(x0), np.zeros_like(x0)
  ok = np.arange(N) != bad
  for _ in range(4):
    state = jax.jit(algo.step)(state, batches)
    if name == "gossip":
      xs = cut @ xs
    elif name == "dpsgd":
      delta = np.where(ok[:, None], _local_sgd(np.nan_to_num(xs), x, y, mask, eta, 1), 0.0)
      xs = cut @ xs + delta
    else:
      g = np.where(ok[:, None], _node_grads(xs, np.nan_to_num(x), y, mask), g_old)
      ys = cut @ ys + g - g_old
      xs = cut @ xs - eta * ys
      g_old = g
    assert int(state.metrics["num_nonfinite"]) == 1
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.inexact))
    np.testing.assert_array_equal(_rows(state.local_params)[bad], x0[bad].astype(np.float32))
    np.testing.assert_allclose(_rows(state.local_params), xs, atol=2e-5)
  if name == "gossip":  # the finite nodes average among themselves: their mean is kept
    np.testing.assert_allclose(_rows(state.local_params)[ok].mean(0), x0[ok].mean(0), atol=1e-5)
  assert float(state.metrics["bytes_sent"]) == pytest.approx((2 * N - 4) / N * (D + 1) * 4
                                                              * (2 if name == "gradient_tracking" else 1))


def test_client_map_modes_agree_and_a_vmap_over_eta_is_separate_runs(problem):
  _, batches = problem
  w = _ring_w()
  runs = {}
  for mode in ("vmap", "sequential", "chunked:4"):
    algo = gradient_tracking(lsq_loss, 0.05, graph=w, client_map=mode)
    state = algo.init(_zeros(), jax.random.key(0))
    for _ in range(3):
      state = jax.jit(algo.step)(state, batches)
    runs[mode] = _rows(state.local_params)
  np.testing.assert_allclose(runs["sequential"], runs["vmap"], atol=1e-6)
  np.testing.assert_allclose(runs["chunked:4"], runs["vmap"], atol=1e-6)

  def final(eta):
    algo = dpsgd(lsq_loss, eta, graph=w)
    state = algo.init(_zeros(), jax.random.key(0))
    for _ in range(3):
      state = algo.step(state, batches)
    return state.local_params

  etas = jnp.array([0.01, 0.05])
  swept = jax.jit(jax.vmap(final))(etas)
  alone = jax.jit(final)  # one program for both step sizes (not op by op)
  for i, eta in enumerate([0.01, 0.05]):
    np.testing.assert_allclose(_rows(jax.tree.map(lambda t: t[i], swept)), _rows(alone(eta)), atol=1e-6)


def test_state_reads_like_every_algorithm_with_per_client_models(problem):
  _, batches = problem
  algo = dpsgd(lsq_loss, 0.05, graph=fo.graphs.ring(N))  # a Graph: its Metropolis–Hastings weights
  state = jax.jit(algo.step)(algo.init(_zeros(), jax.random.key(0)), batches)
  np.testing.assert_allclose(np.append(state.params["w"], state.params["b"]), _rows(state.local_params).mean(0),
                             atol=1e-7)
  one = fo.personalized_params(state, 3)
  np.testing.assert_array_equal(one["w"], state.local_params["w"][3])
  reference = dpsgd(lsq_loss, 0.05, graph=_ring_w())
  again = jax.jit(reference.step)(reference.init(_zeros(), jax.random.key(0)), batches)
  np.testing.assert_array_equal(_rows(again.local_params), _rows(state.local_params))
  assert float(state.metrics["client_loss"]) > 0


def test_bad_arguments(problem):
  _, batches = problem
  w = _ring_w()
  with pytest.raises(ValueError, match="symmetric"):
    dpsgd(lsq_loss, 0.1, graph=np.array([[0.5, 0.5, 0], [0.3, 0.4, 0.3], [0.2, 0.1, 0.7]]))
  with pytest.raises(ValueError, match="disconnected"):
    gradient_tracking(lsq_loss, 0.1, graph=np.eye(N))
  with pytest.raises(TypeError, match="graph must be given"):
    gossip(lsq_loss, graph=None)
  with pytest.raises(ValueError, match="eta"):
    dpsgd(lsq_loss, 0.0, graph=w)
  with pytest.raises(ValueError, match="eta"):
    gossip(lsq_loss, -0.1, graph=w)
  with pytest.raises(ValueError, match="eta"):
    gradient_tracking(lsq_loss, -1.0, graph=w)
  with pytest.raises(ValueError, match="local_steps"):
    dpsgd(lsq_loss, 0.1, graph=w, local_steps=0)
  with pytest.raises(TypeError, match="loss_fn"):
    dpsgd(None, 0.1, graph=w)
  algo = dpsgd(lsq_loss, 0.1, graph=fo.graphs.metropolis_hastings(fo.graphs.ring(5)))
  with pytest.raises(ValueError, match="N = 5 nodes.*got C = 6"):
    algo.step(algo.init(_zeros(), jax.random.key(0)), batches)
  algo = gradient_tracking(lsq_loss, 0.1, graph=w)
  with pytest.raises(ValueError, match="arange"):
    algo.step(algo.init(_zeros(), jax.random.key(0)), batches.replace(client_id=batches.client_id[::-1]))


def test_gradient_tracking_on_the_complete_graph_is_stable_only_for_eta_h_below_one_half(rng):
  """W = 11ᵀ/N (Metropolis weights of K_N) and nodes sharing one Hessian H: in each eigendirection h of H the
  disagreement follows e_x ← −η e_y, e_y ← h(e_x⁺ − e_x), whose roots λ² + ηhλ − ηh = 0 lie inside the unit disc
  only for ηh < 1/2. So even the best-connected graph needs η < 1/(2L), not 1/L (centralized gradient descent's
  bound is 2/L): η = 0.45/h reaches argmin Σ_i f_i, η = 0.55/h blows up."""
  x = rng.normal(size=(10, D))
  clients = [(x, rng.normal(loc=i, size=10)) for i in range(N)]  # one design: one Hessian; different targets
  design = np.hstack([x, np.ones((10, 1))])
  h = np.linalg.eigvalsh(design.T @ design / 10)[-1]
  w = fo.graphs.metropolis_hastings(fo.graphs.complete(N))
  np.testing.assert_allclose(w, np.full((N, N), 1.0 / N), atol=1e-15)
  with jax.enable_x64(True):
    batches = pack(clients, 1, 10, dtype=np.float64)
    stable = _run(gradient_tracking(lsq_loss, 0.45 / h, graph=w), batches, 2000, jnp.float64)
    unstable = _run(gradient_tracking(lsq_loss, 0.55 / h, graph=w), batches, 400, jnp.float64)
  np.testing.assert_allclose(_rows(stable.local_params), np.tile(_minimiser(clients), (N, 1)), atol=1e-8)
  assert float(unstable.metrics["consensus_distance"]) > 1e6
