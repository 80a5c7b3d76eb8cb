"""P2P federated learning on graphs: every node learns a hypothesis no node can identify alone, at the KL rate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

import fedjax_opt as fo
from fedjax_opt.algorithms.p2p_bayes import p2p_bayes
from conftest import lsq_loss

N = 6
# Four hypotheses w ∈ {0, 1}² (b = 0); the truth is w* = (1, 0). Node i observes only coordinate i mod 2:
# y = w*_c + noise, x = e_c. Gaussian noise of σ = 1, so ½(xᵀw + b − y)² is −log f(y | w) up to a constant.
GRID = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], np.float64)
TRUE = 2
HYPOTHESES = {"w": jnp.asarray(GRID, jnp.float32), "b": jnp.zeros(4, jnp.float32)}
COORD = np.arange(N) % 2


def _ring():
  return fo.graphs.metropolis_hastings(fo.graphs.ring(N))


def _rounds(rng, rounds, batch, noise=1.0):
  """ClientBatches with a leading [R] axis (one round each): node i sees x = e_{c_i}, y = w*_{c_i} + noise."""
  x = np.zeros((rounds, N, 1, batch, 2), np.float32)
  x[:, np.arange(N), :, :, COORD] = 1.0
  y = (GRID[TRUE][COORD][None, :, None, None] + noise * rng.normal(size=(rounds, N, 1, batch))).astype(np.float32)
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.ones((rounds, N, 1, batch), bool),
                          weight=jnp.full((rounds, N), float(batch)),
                          client_id=jnp.tile(jnp.arange(N, dtype=jnp.int32), (rounds, 1)))


def _log_lik(batches):
  """`[R, N, K]` float64 Σ_b log f_i(z | θ_k) (up to the same constant for every θ), from the raw arrays."""
  x = np.asarray(batches.data["x"], np.float64)[:, :, 0]  # [R, N, B, 2]
  y = np.asarray(batches.data["y"], np.float64)[:, :, 0]
  pred = np.einsum("rnbd,kd->rnbk", x, GRID)
  return -0.5 * np.sum((pred - y[..., None])**2, axis=2)


def _run(algo, batches):
  """All rounds as one jitted scan; returns the final state and the log-beliefs after every round `[R, N, K]`."""

  def body(state, round_batches):
    state = algo.step(state, round_batches)
    return state, state.log_beliefs

  init = algo.init({"w": jnp.zeros(2), "b": jnp.zeros(())}, jax.random.key(0))
  return jax.jit(lambda s, b: jax.lax.scan(body, s, b))(init, batches)


def test_every_node_learns_the_truth_that_no_node_can_identify_alone(rng):
  batches = _rounds(rng, 60, 2)
  state, _ = _run(p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=_ring()), batches)
  beliefs = np.exp(np.asarray(state.log_beliefs, np.float64))
  assert np.all(beliefs[:, TRUE] > 0.99), beliefs
  np.testing.assert_array_equal(state.params["w"], GRID[TRUE])
  np.testing.assert_array_equal(np.asarray(state.local_params["w"]), np.tile(GRID[TRUE], (N, 1)))
  assert float(state.metrics["map_agreement"]) == 1.0 and float(state.metrics["belief_entropy"]) < 0.1
  # Alone, a node's likelihood is the same for the truth and its look-alike (the hypothesis that differs only in
  # the coordinate it never sees), so Bayes' rule alone leaves it at most ½ on the truth.
  total = _log_lik(batches).sum(0)  # [N, K]
  look_alike = np.where(COORD == 0, 3, 0)
  np.testing.assert_array_equal(total[np.arange(N), TRUE], total[np.arange(N), look_alike])
  alone = np.exp(total - logsumexp(total, axis=1, keepdims=True))
  assert np.all(alone[:, TRUE] <= 0.5 + 1e-12)


def test_wrong_beliefs_decay_at_the_network_average_kl_rate_in_closed_form():
  """Noise-free data: λ_j(θ) = −B (w_c − w*_c)²/2 every round, so r^k = Σ_{s=1..k} W^s λ exactly; r̄^k = −k B/N Σ_j
  KL_j(θ*‖θ) and every node stays within ‖λ − λ̄‖₂ (1 − gap)/gap of it (Lalitha et al., doubly stochastic W)."""
  b, rounds = 3, 80
  batches = _rounds(np.random.default_rng(0), rounds, b, noise=0.0)
  w = _ring()
  _, history = _run(p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w), batches)
  history = np.asarray(history, np.float64)
  kl = 0.5 * (GRID[:, COORD].T - GRID[TRUE][COORD][:, None])**2  # [N, K]: KL(N(w*_c, 1) ‖ N(w_c, 1))
  lam = -b * kl
  rate = b * kl.mean(0)  # (B/N) Σ_j KL_j(θ*‖θ) per round, one per hypothesis
  np.testing.assert_allclose(rate, [0.75, 1.5, 0.0, 0.75])
  gap = fo.graphs.spectral_gap(w)
  r = np.zeros((N, 4))
  power = np.eye(N)
  for k in range(rounds):
    power = w @ power
    r = r + power @ lam  # Σ_{s=1..k+1} W^s λ
    got = history[k] - history[k][:, TRUE:TRUE + 1]
    np.testing.assert_allclose(got, r, atol=1e-4 * (k + 1))
    offset = np.linalg.norm(lam - lam.mean(0), axis=0) * (1 - gap) / gap
    assert np.all(np.abs(got + (k + 1) * rate) <= offset + 1e-3 * (k + 1))
  np.testing.assert_allclose(-history[-1][:, [0, 1, 3]] / rounds, np.tile(rate[[0, 1, 3]], (N, 1)), rtol=0.02)


def test_with_noise_the_network_average_is_exact_bookkeeping_and_every_node_decays_at_the_kl_rate(rng):
  """r̄^k = Σ_s λ̄^s from the data (exact); (1/k) r_i^k → −(B/N) Σ_j KL_j for every node (statistically, 10 %)."""
  b, rounds = 5, 300
  batches = _rounds(rng, rounds, b)
  _, history = _run(p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=_ring()), batches)
  history = np.asarray(history, np.float64)
  ratio = _log_lik(batches) - _log_lik(batches)[..., TRUE:TRUE + 1]  # λ_j^s(θ)
  for k in (9, 99, rounds - 1):
    got = history[k] - history[k][:, TRUE:TRUE + 1]
    np.testing.assert_allclose(got.mean(0), ratio[:k + 1].mean(1).sum(0), rtol=1e-4, atol=1e-3)
  rate = b * 0.5 * (GRID[:, COORD].T - GRID[TRUE][COORD][:, None])**2
  rate = rate.mean(0)
  got = -(history[-1] - history[-1][:, TRUE:TRUE + 1]) / rounds
  np.testing.assert_allclose(got[:, [0, 1, 3]], np.tile(rate[[0, 1, 3]], (N, 1)), rtol=0.1)


def test_rounds_match_a_numpy_transcription_with_a_log_likelihood_indexed_by_hypothesis(rng):
  """Categorical observations, hypotheses `jnp.arange(K)`, a random prior `[N, K]`, padded examples and a
  time-varying sequence: log b ← normalize(W^(k) · normalize(log b + Σ log f(z | θ)))."""
  n, k, symbols = 5, 3, 4
  table = rng.dirichlet(np.ones(symbols), size=k)  # f(s | θ_k)
  log_table = jnp.asarray(np.log(table), jnp.float32)
  loss = lambda theta, batch: -log_table[theta, batch["s"]]
  prior = rng.dirichlet(np.ones(k), size=n)
  seq = np.stack([fo.graphs.metropolis_hastings(fo.graphs.erdos_renyi(n, 0.5, seed=s), lazy=True) for s in range(2)])
  algo = p2p_bayes(loss, hypotheses=jnp.arange(k), graph=seq, prior=prior)
  state = algo.init(jnp.zeros((), jnp.int32), jax.random.key(0))
  want = np.log(prior)
  for r in range(3):
    s = rng.integers(symbols, size=(n, 2, 3))
    mask = rng.random((n, 2, 3)) < 0.7
    batches = fo.ClientBatches(data={"s": jnp.asarray(s)}, mask=jnp.asarray(mask), weight=jnp.ones(n),
                               client_id=jnp.arange(n, dtype=jnp.int32))
    state = jax.jit(algo.step)(state, batches)
    ll = np.stack([np.sum(np.where(mask[..., None], np.log(table.T)[s], 0.0), axis=(0, 1)) for s, mask in
                   zip(s, mask)])  # [n, k]
    local = want + ll
    local -= logsumexp(local, axis=1, keepdims=True)
    want = seq[r % 2] @ local
    want -= logsumexp(want, axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(state.log_beliefs), want, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(state.local_params), np.argmax(want, axis=1))
  assert int(state.params) == int(np.argmax(want.sum(0)))
  assert float(state.metrics["bytes_sent"]) > 0


def test_a_node_with_nan_data_keeps_its_belief_and_is_cut_out(rng):
  batches = _rounds(rng, 4, 2)
  bad = 3
  x = batches.data["x"].at[:, bad, 0, 0, 0].set(jnp.nan)
  batches = batches.replace(data={"x": x, "y": batches.data["y"]})
  w = _ring()
  cut = w.copy()
  cut[bad, :], cut[:, bad] = 0.0, 0.0
  cut[np.diag_indices(N)] += 1.0 - cut.sum(1)
  algo = p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w)
  state = algo.init({"w": jnp.zeros(2), "b": jnp.zeros(())}, jax.random.key(0))
  ll = np.nan_to_num(_log_lik(batches))
  want = np.full((N, 4), -np.log(4))
  for r in range(4):
    state = jax.jit(algo.step)(state, jax.tree.map(lambda a: a[r], batches))
    local = want + np.where(np.arange(N)[:, None] == bad, 0.0, ll[r])
    local -= logsumexp(local, axis=1, keepdims=True)
    want = cut @ local
    want -= logsumexp(want, axis=1, keepdims=True)
    assert int(state.metrics["num_nonfinite"]) == 1
    np.testing.assert_allclose(np.asarray(state.log_beliefs), want, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state.log_beliefs)[bad], np.full(4, -np.log(4), np.float32))


def test_true_belief_is_each_node_s_belief_on_the_named_hypothesis_after_every_round(rng):
  """`true_hypothesis=t`: metrics["true_belief"] `[N]` = b_i(θ_t), against the float64 NumPy recursion; the rest of
  the round is unchanged, and without it there is no such metric."""
  batches = _rounds(rng, 5, 2)
  ring = _ring()
  plain = p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=ring)
  tracked = p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=ring, true_hypothesis=TRUE)
  start = {"w": jnp.zeros(2), "b": jnp.zeros(())}

  def body(algo):
    return lambda state, b: (lambda s: (s, s.metrics))(algo.step(state, b))

  run = lambda algo: jax.jit(lambda s, b: jax.lax.scan(body(algo), s, b))(algo.init(start, jax.random.key(0)), batches)
  state, metrics = run(tracked)
  plain_state, plain_metrics = run(plain)
  assert "true_belief" not in plain_metrics and set(metrics) == set(plain_metrics) | {"true_belief"}
  np.testing.assert_array_equal(state.log_beliefs, plain_state.log_beliefs)
  want = np.full((N, 4), -np.log(4))
  ll = _log_lik(batches)
  for r in range(5):
    local = want + ll[r]
    local -= logsumexp(local, axis=1, keepdims=True)
    want = ring @ local
    want -= logsumexp(want, axis=1, keepdims=True)
    assert metrics["true_belief"][r].shape == (N,)
    np.testing.assert_allclose(metrics["true_belief"][r], np.exp(want[:, TRUE]), atol=1e-5)
  assert tracked.init(start, jax.random.key(0)).metrics["true_belief"].shape == (N,)


def test_bad_arguments():
  w = _ring()
  with pytest.raises(ValueError, match="leading"):
    p2p_bayes(lsq_loss, hypotheses={"w": jnp.zeros((4, 2)), "b": jnp.zeros(3)}, graph=w)
  with pytest.raises(ValueError, match="prior must be finite and > 0"):
    p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w, prior=np.array([0.5, 0.5, 0.0, 0.0]))
  with pytest.raises(ValueError, match="prior must sum to 1"):
    p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w, prior=np.full(4, 0.3))
  with pytest.raises(ValueError, match="prior must have shape"):
    p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w, prior=np.full(3, 1 / 3))
  with pytest.raises(ValueError, match=r"true_hypothesis must index one of the K = 4 hypotheses, in \[0, 4\); got 4"):
    p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w, true_hypothesis=4)
  with pytest.raises(TypeError, match="true_hypothesis must be a Python int"):
    p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w, true_hypothesis=1.0)
  with pytest.raises(ValueError, match="doubly stochastic"):
    p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=0.5 * w)
  algo = p2p_bayes(lsq_loss, hypotheses=HYPOTHESES, graph=w)
  with pytest.raises(TypeError, match="shaped like one hypothesis"):
    algo.init({"w": jnp.zeros(3), "b": jnp.zeros(())}, jax.random.key(0))
  state = algo.init({"w": jnp.zeros(2), "b": jnp.zeros(())}, jax.random.key(0))
  five = jax.tree.map(lambda a: a[0, :5], _rounds(np.random.default_rng(0), 1, 2))
  with pytest.raises(ValueError, match="N = 6 nodes"):
    algo.step(state, five)
