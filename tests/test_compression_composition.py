"""Compression composed with SCAFFOLD, FedNova, FedAdam, DP, a robust aggregator and secure aggregation.

Each claim is checked against an independent reference:

* SCAFFOLD (option II) with top-k, with and without error feedback, stacked
  and streamed, over two rounds of partial participation: a float64 NumPy
  transcription of Algorithm 1 with top-k applied to both uploads (Δy_i,
  Δc_i) and e ← e + Δ − C(e + Δ); bits counted by hand.
* SCAFFOLD with `compress(identity())` is SCAFFOLD without compression,
  bit for bit (float32 and bfloat16 control variates).
* SCAFFOLD with QSGD: the mean over keys of the server's two updates lies
  within 5 standard errors (from QSGD's closed-form variance) of the
  uncompressed ones; the two uploads use different keys.
* FedNova with top-k and unequal step counts: NumPy (normalize, compress,
  rescale by τ_eff).
* FedAdam on the mean of top-k messages with error feedback: NumPy Adam.
* DP: `dp_mean` after compression is compressed FedAvg with σ = 0 and a huge
  clip; with a finite clip each decoded message is clipped to C before the
  fixed-denominator mean (NumPy); with σ > 0 the noise's standard deviation
  over many keys is σC/m within a tolerance derived from the χ² variance.
* Coordinate-wise median of the compressed updates: NumPy's median.
* Secure summation of the compressed updates: their mean within the
  fixed-point resolution.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from algorithm_examples import S, example_inputs, loss_fn
from algorithm_examples import flat_params as _vec, flat_table as _rows, lsq_gradient as _grad

import fedjax_opt as fo

C = fo.compression


def _chain(stage, aggregator):
  """`aggregator` with the client stage `stage` in front (none when None)."""
  return aggregator if stage is None else fo.aggregators.chain(stage, aggregator)
P = 4  # the examples' model {"b": [], "w": [3]}, flattened in leaf order: b, then w
INDEX_BITS = 2  # ⌈log₂ 4⌉


# ----------------------------------------------------------------------------- NumPy references


def _local_sgd(z, x, y, lr, correction=0.0, steps=S):
  for s in range(steps):
    z = z - lr * (_grad(z, x[s], y[s]) + correction)
  return z


def _np_top_k(k):
  def compress(v):
    out = np.zeros_like(v)
    keep = np.argsort(-np.abs(v))[:k]
    out[keep] = v[keep]
    return out
  return compress


def _data(batches):
  return np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64)


def _numpy_scaffold_round(z, c, table, ey, ec, xs, ys, ids, eta_l, eta_g, n, compress):
  """Algorithm 1 (option II) with C applied to Δy_i + e^y_i and Δc_i + e^c_i; residual tables None: no feedback."""
  table = table.copy()
  ey = None if ey is None else ey.copy()
  ec = None if ec is None else ec.copy()
  sent_y, sent_c = [], []
  for k, i in enumerate(ids):
    y = _local_sgd(z, xs[k], ys[k], eta_l, correction=c - table[i])
    new_ci = table[i] - c + (z - y) / (S * eta_l)
    dy, dc = y - z, new_ci - table[i]
    vy = dy + (0 if ey is None else ey[i])
    vc = dc + (0 if ec is None else ec[i])
    sent_y.append(compress(vy))
    sent_c.append(compress(vc))
    if ey is not None:
      ey[i], ec[i] = vy - sent_y[-1], vc - sent_c[-1]
    table[i] = new_ci
  return z + eta_g * np.mean(sent_y, axis=0), c + np.sum(sent_c, axis=0) / n, table, ey, ec


def _numpy_fedavg_messages(z, xs, ys, lr, compress, residuals=None):
  """Each client's compressed message C(Δ_k + e_k) after S local SGD steps, and the new residuals."""
  sent, new = [], []
  for k in range(xs.shape[0]):
    v = _local_sgd(z, xs[k], ys[k], lr) - z + (0 if residuals is None else residuals[k])
    sent.append(compress(v))
    new.append(v - sent[-1])
  return np.stack(sent), np.stack(new)


# ----------------------------------------------------------------------------- SCAFFOLD

N_TOTAL = 6
ROUND_IDS = ([4, 1, 3, 0], [2, 4, 5, 1])  # 4 of 6 clients a round; 4 and 1 come back


def _scaffold_batches(r):
  _, batches = example_inputs("fedavg", seed=r)
  return batches.replace(client_id=jnp.asarray(ROUND_IDS[r], jnp.int32))


ETA_L, ETA_G = 0.05, 0.8  # SCAFFOLD's local and global learning rates in every test
TOP_2, IDENTITY = C.top_k(k=2), C.identity()  # one instance each: `_scaffold_step` caches by instance


@functools.cache
def _scaffold_step(compressor=None, error_feedback=False, mode="vmap", storage_dtype=None):
  """`(algo, jitted step)` of SCAFFOLD (η_l, η_g = ETA_L, ETA_G; N_TOTAL clients) with `compress(compressor,
  error_feedback)` (none when None) in front of the mean; built once per choice, so tests share its program."""
  stage = None if compressor is None else C.compress(compressor, error_feedback=error_feedback,
                                                     num_clients=N_TOTAL if error_feedback else None)
  algo = fo.algorithms.scaffold(loss_fn, ETA_L, ETA_G, num_clients=N_TOTAL,
                                aggregator=_chain(stage, fo.aggregators.mean()), client_map=mode,
                                storage_dtype=storage_dtype)
  return algo, jax.jit(algo.step)


def _run_scaffold(compressor=None, error_feedback=False, rounds=2, mode="vmap", storage_dtype=None):
  """`(initial params, [state after each round])` of `_scaffold_step(...)` on `_scaffold_batches(r)`."""
  params, _ = example_inputs("fedavg")
  algo, step = _scaffold_step(compressor, error_feedback, mode, storage_dtype)
  state = algo.init(params, jax.random.key(3))
  states = []
  for r in range(rounds):
    state = step(state, _scaffold_batches(r))
    states.append(state)
  return params, states


@pytest.mark.parametrize("error_feedback,mode", [(False, "vmap"), (True, "vmap"), (True, "chunked:3")])
def test_scaffold_with_top_k_matches_a_float64_numpy_transcription(error_feedback, mode):
  """Two rounds, both uploads top-2 of P = 4; chunked:3 streams the mean of the Δy_i and still matches."""
  k, eta_l, eta_g = 2, ETA_L, ETA_G
  params, states = _run_scaffold(TOP_2, error_feedback, mode=mode)
  z, c, table = _vec(params), np.zeros(P), np.zeros((N_TOTAL, P))
  ey = np.zeros((N_TOTAL, P)) if error_feedback else None
  ec = np.zeros((N_TOTAL, P)) if error_feedback else None
  for r, state in enumerate(states):
    xs, ys = _data(_scaffold_batches(r))
    z, c, table, ey, ec = _numpy_scaffold_round(z, c, table, ey, ec, xs, ys, ROUND_IDS[r], eta_l, eta_g, N_TOTAL,
                                                _np_top_k(k))
    np.testing.assert_allclose(_vec(state.params), z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_vec(state.control_variate), c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_rows(state.client_control_variates), table, rtol=1e-5, atol=1e-6)
    residuals, control_residuals = (C.residuals(state.aggregator_state, j) for j in (0, 1))
    if error_feedback:
      np.testing.assert_allclose(_rows(residuals), ey, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(_rows(control_residuals), ec, rtol=1e-5, atol=1e-6)
      # What c has not received is the residuals: c = (1/N) Σ_i (c_i − e^c_i).
      np.testing.assert_allclose(_vec(state.control_variate),
                                 (_rows(state.client_control_variates) - _rows(control_residuals)).mean(0),
                                 rtol=1e-5, atol=1e-6)
      assert np.abs(ec).sum() > 0 and np.abs(ey).sum() > 0  # top-2 of 4 leaves something behind
    else:
      assert residuals is None and control_residuals is None
    # Both uploads counted: 2 messages of k (32-bit value + ⌈log₂ 4⌉-bit index); the broadcast (x, c) is 2 · 32 P.
    assert float(state.metrics["bits_up"]) == 2 * k * (32 + INDEX_BITS)
    assert float(state.metrics["bits_down"]) == 2 * 32 * P


def test_scaffold_counts_no_compressed_control_delta_of_a_zero_weight_client():
  """A client of weight 0 with real data computes a finite, nonzero Δc_i but takes no part: the server counts
  only the other clients' messages and its residual rows stay 0 (NumPy over the three others)."""
  k, eta_l, eta_g = 2, ETA_L, ETA_G
  params, _ = example_inputs("fedavg")
  batches = _scaffold_batches(0)
  weight = np.asarray(batches.weight).copy()
  weight[1] = 0.0  # client id 1 (slot 1) sits the round out
  batches = batches.replace(weight=jnp.asarray(weight))
  algo, step = _scaffold_step(TOP_2, True)  # the program of the top-k test's error-feedback case
  state = step(algo.init(params, jax.random.key(3)), batches)
  xs, ys = _data(batches)
  keep = [0, 2, 3]
  zeros = np.zeros((N_TOTAL, P))
  z, c, table, ey, ec = _numpy_scaffold_round(_vec(params), np.zeros(P), zeros, zeros, zeros, xs[keep], ys[keep],
                                              [ROUND_IDS[0][s] for s in keep], eta_l, eta_g, N_TOTAL,
                                              _np_top_k(k))
  np.testing.assert_allclose(_vec(state.params), z, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_vec(state.control_variate), c, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_rows(state.client_control_variates), table, rtol=1e-5, atol=1e-6)
  control_residuals = C.residuals(state.aggregator_state, 1)
  np.testing.assert_allclose(_rows(control_residuals), ec, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(_rows(control_residuals)[1], 0.0)
  assert np.abs(ec).sum() > 0


@pytest.mark.parametrize("storage_dtype", [None, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_scaffold_with_identity_compression_is_scaffold_bit_for_bit(storage_dtype):
  """With error feedback, so both residual tables are used (and stay exactly 0)."""
  _, want = _run_scaffold(None, storage_dtype=storage_dtype)
  _, got = _run_scaffold(IDENTITY, True, storage_dtype=storage_dtype)
  fields = lambda s: (s.params, s.control_variate, s.client_control_variates, s.server_opt_state, s.metrics)
  for a, b in zip(got, want):
    for x, y in zip(jax.tree.leaves(fields(a)), jax.tree.leaves(fields(b))):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(a.metrics["bits_up"]) == 2 * 32 * P  # identity charges every bit of both uploads
  assert all(not np.any(np.asarray(t)) for t in jax.tree.leaves(got[-1].aggregator_state.rows))


def _qsgd_moments(u, s, scale):
  """Per-coordinate variance and fourth cumulant of scale · QSGD(u) with s levels.

  x̂_j = (‖u‖/s) sgn(u_j) (⌊s r_j⌋ + B_j), r_j = |u_j|/‖u‖, B_j ~ Bernoulli(f_j) with f_j = s r_j − ⌊s r_j⌋: the
  error is a scaled centred Bernoulli, with variance a² f (1 − f) and fourth cumulant a⁴ f (1 − f) (1 − 6 f (1 − f)),
  a = scale ‖u‖/s.
  """
  norm = np.linalg.norm(u)
  scaled = s * np.abs(u) / norm
  frac = scaled - np.floor(scaled)
  a2, q = (scale * norm / s) ** 2, frac * (1 - frac)
  return a2 * q, a2 ** 2 * q * (1 - 6 * q)


def test_scaffold_with_qsgd_is_unbiased_over_keys():
  """E[x⁺ − x] = η_g mean_i Δy_i and E[c⁺ − c] = (1/N) Σ_i Δc_i over the compression keys (one round, M keys).

  Every coordinate of an aggregate is a sum of independent scaled Bernoulli errors (`_qsgd_moments`), one per
  client: its variance σ² and fourth cumulant κ₄ are sums over the clients. Tolerances, each 5 standard errors
  (a false failure has probability below 10⁻⁵ per check): the mean of M draws within 5 √(σ²/M) of the
  uncompressed update; the sample variance within 5 √((κ₄ + 2σ⁴)/M) of σ² (the variance of a sample variance
  is (μ₄ − σ⁴)/M, μ₄ = κ₄ + 3σ⁴); the correlation of the two aggregates' errors within 5/√M of 0.
  """
  s, m, eta_l, eta_g = 2, 4000, 0.05, 0.8
  rng = np.random.default_rng(11)
  params, _ = example_inputs("fedavg")
  batches = _scaffold_batches(0)
  ids = ROUND_IDS[0]
  # A start with c_i ≠ 0 and c = their mean, so the drift term is exercised.
  table = 0.3 * rng.normal(size=(N_TOTAL, P))
  algo = fo.algorithms.scaffold(loss_fn, eta_l, eta_g, num_clients=N_TOTAL,
                                aggregator=_chain(C.compress(C.qsgd(levels=s)), fo.aggregators.mean()))
  as_tree = lambda a: {"b": jnp.asarray(a[..., 0], jnp.float32), "w": jnp.asarray(a[..., 1:], jnp.float32)}
  start = algo.init(params, jax.random.key(0)).replace(client_control_variates=as_tree(table),
                                                       control_variate=as_tree(table.mean(0)))
  z, c, table32 = _vec(params), _vec(start.control_variate), _rows(start.client_control_variates)

  def one(key):
    out = algo.step(start.replace(key=key), batches)
    return _flat_jnp(out.params), _flat_jnp(out.control_variate), out.metrics["bits_up"]

  # lax.map (a loop over the keys) compiles the step once, a quarter of what vmap's batched step costs.
  xs_new, cs_new, bits = jax.jit(lambda keys: jax.lax.map(one, keys))(jax.random.split(jax.random.key(5), m))
  dx = np.asarray(xs_new, np.float64) - z
  dc = np.asarray(cs_new, np.float64) - c
  xs, ys = _data(batches)
  dys, dcs = [], []
  for k, i in enumerate(ids):
    y = _local_sgd(z, xs[k], ys[k], eta_l, correction=c - table32[i])
    dys.append(y - z)
    dcs.append(-c + (z - y) / (S * eta_l))  # Δc_i = c_i⁺ − c_i (option II)
  for got, messages, scale, want in [(dx, dys, eta_g / len(ids), eta_g * np.mean(dys, axis=0)),
                                     (dc, dcs, 1 / N_TOTAL, np.sum(dcs, axis=0) / N_TOTAL)]:
    var, kappa4 = (sum(parts) for parts in zip(*(_qsgd_moments(u, s, scale) for u in messages)))
    assert np.all(var > 0)  # every coordinate is random: the test has something to average
    assert np.all(np.abs(got.mean(0) - want) <= 5 * np.sqrt(var / m) + 1e-6 * np.abs(want).max())
    assert np.all(np.abs(got.var(0, ddof=1) - var) <= 5 * np.sqrt((kappa4 + 2 * var ** 2) / m))
  # Separate keys: the Δy and Δc quantization errors are uncorrelated (with one key shared by both uploads this
  # fails: under option II Δc_i is an affine function of Δy_i, so their quantizations move together).
  want_x, want_c = eta_g * np.mean(dys, axis=0), np.sum(dcs, axis=0) / N_TOTAL
  corr = np.corrcoef(dx[:, 1] - want_x[1], dc[:, 1] - want_c[1])[0, 1]
  assert abs(corr) <= 5 / math.sqrt(m), corr
  # Both uploads: 2 (32 + P (1 + ⌈log₂ 3⌉)) bits.
  assert np.all(np.asarray(bits) == 2 * (32 + P * (1 + 2)))


def _flat_jnp(params):
  return jnp.concatenate([jnp.reshape(params["b"], (1,)), params["w"]])


def test_scaffold_error_feedback_needs_the_same_number_of_clients():
  with pytest.raises(ValueError, match="num_clients=5 rows but SCAFFOLD has num_clients=6"):
    fo.algorithms.scaffold(loss_fn, 0.1, 1.0, num_clients=6,
                           aggregator=_chain(C.compress(C.top_k(k=1), error_feedback=True, num_clients=5),
                                             fo.aggregators.mean()))
  with pytest.raises(TypeError, match="wrap the compressor"):
    fo.algorithms.scaffold(loss_fn, 0.1, 1.0, num_clients=6, aggregator=_chain(C.top_k(k=1), fo.aggregators.mean()))


# ----------------------------------------------------------------------------- FedNova


def test_fednova_with_top_k_compresses_the_normalized_direction():
  """Client 0 runs 1 step, the others 2: Δ_t = τ_eff Σ p_i C(d_i), d_i = Δ_i/τ_i, τ_eff = Σ p_i τ_i (NumPy)."""
  eta, k = 0.05, 1
  params, batches = example_inputs("fedavg")
  mask = np.ones(batches.mask.shape, bool)
  mask[0, 1] = False
  weights = np.array([3.0, 6.0, 6.0, 6.0])
  batches = batches.replace(mask=jnp.asarray(mask), weight=jnp.asarray(weights, jnp.float32))
  algo = fo.algorithms.fednova(loss_fn, eta,
                               aggregator=_chain(C.compress(C.top_k(k=k)), fo.aggregators.weighted_mean()))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  z = _vec(params)
  xs, ys = _data(batches)
  taus = np.array([1, 2, 2, 2])
  d = [(_local_sgd(z, xs[i], ys[i], eta, steps=taus[i]) - z) / taus[i] for i in range(4)]
  p = weights / weights.sum()
  want = z + (p @ taus) * (p @ np.stack([_np_top_k(k)(v) for v in d]))
  np.testing.assert_allclose(_vec(state.params), want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(state.metrics["tau_eff"]), p @ taus, rtol=1e-6)
  assert float(state.metrics["bits_up"]) == k * (32 + INDEX_BITS)


# ----------------------------------------------------------------------------- FedAdam


def test_fedadam_on_compressed_deltas_matches_numpy_adam():
  """Two rounds of FedAdam (Reddi et al., no bias correction) on the weighted mean of top-2 messages with error
  feedback: g = −Δ, m = β₁m + (1−β₁)g, v = β₂v + (1−β₂)g² (v₋₁ = τ²), x ← x − η m/(√v + τ)."""
  lr_client, eta, b1, b2, tau, k = 0.05, 0.1, 0.9, 0.99, 1e-2, 2
  params, batches = example_inputs("fedavg")
  weights = np.array([6.0, 2.0, 5.0, 1.0])
  batches = batches.replace(weight=jnp.asarray(weights, jnp.float32))
  algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(lr_client),
                              server_optimizer=fo.server_optimizers.get("fedadam", learning_rate=eta, b1=b1, b2=b2,
                                                                        tau=tau),
                              aggregator=_chain(C.compress(C.top_k(k=k), error_feedback=True, num_clients=4),
                                                fo.aggregators.weighted_mean()))
  state = algo.init(params, jax.random.key(0))
  step = jax.jit(algo.step)
  z, mom, v, res = _vec(params), np.zeros(P), np.full(P, tau ** 2), np.zeros((4, P))
  xs, ys = _data(batches)
  for _ in range(2):
    state = step(state, batches)
    sent, res = _numpy_fedavg_messages(z, xs, ys, lr_client, _np_top_k(k), res)
    g = -(weights / weights.sum()) @ sent
    mom = b1 * mom + (1 - b1) * g
    v = b2 * v + (1 - b2) * g ** 2
    z = z - eta * mom / (np.sqrt(v) + tau)
    np.testing.assert_allclose(_vec(state.params), z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_rows(C.residuals(state.aggregator_state)), res, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- DP after compression


def _fedavg(aggregator, stage, lr=0.05):
  return fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(lr), aggregator=_chain(stage, aggregator))


def test_dp_mean_with_no_noise_and_a_huge_clip_is_compressed_fedavg():
  """σ = 0, C = 10⁶ ≫ every update, m = the 4 clients: the uniform mean of the messages, residuals included."""
  params, batches = example_inputs("fedavg")
  comp = C.compress(C.top_k(k=2), error_feedback=True, num_clients=4)
  finals = []
  for aggregator in (fo.privacy.dp_mean(1e6, 0.0, expected_clients=4), fo.aggregators.mean()):
    algo = _fedavg(aggregator, comp)
    state = algo.init(params, jax.random.key(0))
    step = jax.jit(algo.step)
    for _ in range(2):
      state = step(state, batches)
    finals.append(state)
  for a, b in zip(jax.tree.leaves((finals[0].params, C.residuals(finals[0].aggregator_state))),
                  jax.tree.leaves((finals[1].params, C.residuals(finals[1].aggregator_state)))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _recording(aggregator, c):
  """`aggregator` that also keeps, in its state, the updates it received and `dp_mean`'s clipped terms of them."""

  def init(params):
    rows = jax.tree.map(lambda p: jnp.zeros((c,) + jnp.shape(p), jnp.result_type(p)), params)
    return aggregator.init(params), rows, rows

  def aggregate(updates, weights, state, key):
    terms = jax.vmap(lambda u, w: aggregator.streaming.term(u, w, state[0])[0])(updates, weights)
    out, inner = aggregator.aggregate(updates, weights, state[0], key)
    return out, (inner, updates, terms)

  # the same piece plus a record: it declares the wrapped piece's traits (a dp_mean state needs a private declaration)
  return fo.aggregators.Aggregator(init, aggregate, always_releases=aggregator.always_releases,
                                   traits=aggregator.traits)


CLIP, M_DENOMINATOR = 0.05, 5.0


def _clipped_reference(params, batches, lr=0.05, k=2):
  """NumPy: compress (top-k, no feedback), clip each message to CLIP, sum, divide by the fixed m; and the messages."""
  xs, ys = _data(batches)
  sent, _ = _numpy_fedavg_messages(_vec(params), xs, ys, lr, _np_top_k(k))
  norms = np.linalg.norm(sent, axis=1)
  clipped = sent * np.minimum(1.0, CLIP / norms)[:, None]
  return sent, clipped, clipped.sum(0) / M_DENOMINATOR


def test_dp_mean_clips_each_compressed_message_before_the_fixed_denominator_mean():
  params, batches = example_inputs("fedavg")
  sent, clipped, want = _clipped_reference(params, batches)
  assert np.sum(np.linalg.norm(sent, axis=1) > CLIP) >= 2 and np.any(np.linalg.norm(sent, axis=1) < CLIP)
  algo = _fedavg(_recording(fo.privacy.dp_mean(CLIP, 0.0, expected_clients=M_DENOMINATOR), 4),
                 C.compress(C.top_k(k=2)))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  _, received, terms = state.aggregator_state.server
  np.testing.assert_allclose(_rows(received), sent, rtol=1e-5, atol=1e-7)  # the aggregator sees the messages
  got_terms = _rows(terms)
  assert np.all(np.linalg.norm(got_terms, axis=1) <= CLIP * (1 + 1e-6))  # each contribution within the clip
  np.testing.assert_allclose(got_terms, clipped, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_vec(state.params) - _vec(params), want, rtol=1e-5, atol=1e-7)


def test_dp_mean_noise_after_compression_has_std_sigma_clip_over_m():
  """σ = 1: x⁺ − x − (noiseless NumPy aggregate) over M keys and P coordinates has variance (σC/m)².

  With n = M P independent normal deviations, the sample variance s² has sd (σC/m)² √(2/n): 5 of them is the
  tolerance on s² / (σC/m)²; the mean must lie within 5 (σC/m)/√n of 0. top-k does not use its key, so only
  the noise changes with the key.
  """
  sigma, m_keys = 1.0, 2000
  params, batches = example_inputs("fedavg")
  _, _, noiseless = _clipped_reference(params, batches)
  algo = _fedavg(fo.privacy.dp_mean(CLIP, sigma, expected_clients=M_DENOMINATOR), C.compress(C.top_k(k=2)))
  start = algo.init(params, jax.random.key(0))
  moved = jax.jit(lambda keys: jax.lax.map(lambda key: _flat_jnp(algo.step(start.replace(key=key), batches).params),
                                            keys))(jax.random.split(jax.random.key(9), m_keys))
  dev = (np.asarray(moved, np.float64) - _vec(params) - noiseless).reshape(-1)
  std = sigma * CLIP / M_DENOMINATOR
  n = dev.size
  assert abs(dev.mean()) <= 5 * std / math.sqrt(n)
  assert abs(dev.var() / std ** 2 - 1) <= 5 * math.sqrt(2 / n)


# ----------------------------------------------------------------------------- a robust aggregator


def test_marginal_median_of_compressed_updates_matches_numpy():
  params, batches = example_inputs("fedavg")
  xs, ys = _data(batches)
  sent, res = _numpy_fedavg_messages(_vec(params), xs, ys, 0.05, _np_top_k(2))
  algo = _fedavg(fo.aggregators.marginal_median(), C.compress(C.top_k(k=2), error_feedback=True, num_clients=4))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  np.testing.assert_allclose(_vec(state.params), _vec(params) + np.median(sent, axis=0), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_rows(C.residuals(state.aggregator_state)), res, rtol=1e-5, atol=1e-7)


def _omniscient_row(sent, attacker, factor=1e4):
  """The omniscient attacker's row: −factor × the sum of the other (honest) clients' rows, float64."""
  return -factor * np.delete(sent, attacker, axis=0).sum(0)


def test_an_attack_after_compression_reaches_the_median_as_the_server_receives_it():
  """The triple robust rule + attack + compression: `chain(compress(top-2, feedback), corrupt(median, omniscient))`.
  The clients compress (residuals as without the attack), the attacker's row is replaced by −10⁴ × the sum of the
  honest compressed messages (the attacker is not held to the compressor's budget), the median ranks what the
  server receives (NumPy)."""
  params, batches = example_inputs("fedavg")
  xs, ys = _data(batches)
  sent, res = _numpy_fedavg_messages(_vec(params), xs, ys, 0.05, _np_top_k(2))
  received = sent.copy()
  received[1] = _omniscient_row(sent, 1)
  attacked = fo.attacks.corrupt(fo.aggregators.marginal_median(), fo.attacks.omniscient(1e4), attackers=[1])
  algo = _fedavg(attacked, C.compress(C.top_k(k=2), error_feedback=True, num_clients=4))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  np.testing.assert_allclose(_vec(state.params), _vec(params) + np.median(received, axis=0), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_rows(C.residuals(state.aggregator_state)), res, rtol=1e-5, atol=1e-7)
  assert int(state.aggregator_state.server.num_attackers) == 1


def test_dp_mean_clips_an_attackers_row_like_any_other():
  """`corrupt(dp_mean)`: the attack acts on what the server receives and dp_mean clips it to C like every row, so
  the attacker moves the mean by at most C/m (σ = 0; NumPy: replace, clip each row, sum, divide by m)."""
  params, batches = example_inputs("fedavg")
  xs, ys = _data(batches)
  sent, _ = _numpy_fedavg_messages(_vec(params), xs, ys, 0.05, lambda v: v)
  received = sent.copy()
  received[2] = _omniscient_row(sent, 2)
  clipped = received * np.minimum(1.0, CLIP / np.linalg.norm(received, axis=1))[:, None]
  attacked = fo.attacks.corrupt(fo.privacy.dp_mean(CLIP, 0.0, expected_clients=M_DENOMINATOR),
                                fo.attacks.omniscient(1e4), attackers=[2])
  state = jax.jit(_fedavg(attacked, None).step)(_fedavg(attacked, None).init(params, jax.random.key(0)), batches)
  moved = _vec(state.params) - _vec(params)
  np.testing.assert_allclose(moved, clipped.sum(0) / M_DENOMINATOR, rtol=1e-5, atol=1e-7)
  assert np.linalg.norm(clipped[2]) == pytest.approx(CLIP)


# ----------------------------------------------------------------------------- secure summation after compression


def test_secure_aggregation_of_compressed_updates_is_their_mean_up_to_the_fixed_point():
  """`secure_aggregation(mean())` sums the top-2 messages in Z_{2³²} with f = 16 fractional bits: the decoded sum
  is within C · 2⁻¹⁶ of the float sum per coordinate, so the mean of the 4 messages is within 2⁻¹⁶ (NumPy)."""
  params, batches = example_inputs("fedavg")
  xs, ys = _data(batches)
  sent, _ = _numpy_fedavg_messages(_vec(params), xs, ys, 0.05, _np_top_k(2))
  secure = fo.privacy.secure_aggregation(fo.aggregators.mean(), bound=1.0, frac_bits=16)
  algo = _fedavg(secure, C.compress(C.top_k(k=2)))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  assert int(state.aggregator_state.server.num_clipped) == 0 and bool(state.metrics["round_accepted"])
  np.testing.assert_allclose(_vec(state.params) - _vec(params), sent.mean(0), rtol=0, atol=2.0 ** -16 + 1e-6)
  # bits_up is the compressor's charge; the masked upload the protocol sends is dense whatever the compressor:
  # 32 (P + 1) for the contribution, 2 · 32 for the public keys, 3 · 32 (n − 1) for the shares (n = 4 members).
  assert float(state.metrics["bits_up"]) == 2 * (32 + INDEX_BITS)
  assert float(state.aggregator_state.server.upload_bits) == 32 * (P + 1) + 2 * 32 + 3 * 32 * 3


# ----------------------------------------------------------------------------- triples: DP inside secure summation

def test_dp_mean_inside_secure_aggregation_after_compression_is_the_clipped_mean_of_the_messages():
  """The triple users run: `chain(compress(top-2), secure_aggregation(dp_mean(C, σ = 0, m), f = 16))`. Each decoded
  top-2 message is clipped to C, then to C' = C − √P·2⁻¹⁶ (room for the ring's rounding, so the decoded update
  stays within C), summed in the ring and divided by m: NumPy's clipped mean within 4 · 2⁻¹⁶ / m."""
  params, batches = example_inputs("fedavg")
  xs, ys = _data(batches)
  sent, _ = _numpy_fedavg_messages(_vec(params), xs, ys, 0.05, _np_top_k(2))
  room = CLIP - math.sqrt(P) * 2.0 ** -16
  clipped = sent * np.minimum(1.0, CLIP / np.linalg.norm(sent, axis=1))[:, None]
  clipped = clipped * np.minimum(1.0, room / np.linalg.norm(clipped, axis=1))[:, None]
  secure = fo.privacy.secure_aggregation(fo.privacy.dp_mean(CLIP, 0.0, expected_clients=M_DENOMINATOR), bound=1.0,
                                         frac_bits=16)
  algo = _fedavg(secure, C.compress(C.top_k(k=2)))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  assert bool(state.metrics["round_accepted"])
  np.testing.assert_allclose(_vec(state.params) - _vec(params), clipped.sum(0) / M_DENOMINATOR, rtol=0,
                             atol=4 * 2.0 ** -16 / M_DENOMINATOR + 1e-7)
  assert float(state.metrics["bits_up"]) == 2 * (32 + INDEX_BITS)


def test_an_attackers_row_is_bounded_by_the_secure_encoding():
  """`corrupt(secure_aggregation(mean), omniscient)`: the attacker's row (−10⁴ × the honest sum) is encoded like
  every client's, so each of its coordinates is clipped to the bound B before the ring sum: the mean is NumPy's
  mean of the rows clipped to [−B, B], within 2⁻¹⁶, and the clipped row is counted."""
  params, batches = example_inputs("fedavg")
  xs, ys = _data(batches)
  sent, _ = _numpy_fedavg_messages(_vec(params), xs, ys, 0.05, lambda v: v)
  received = sent.copy()
  received[3] = _omniscient_row(sent, 3)
  bound = 1.0
  assert np.abs(sent).max() < bound < np.abs(received[3]).max()
  secure = fo.privacy.secure_aggregation(fo.aggregators.mean(), bound=bound, frac_bits=16)
  attacked = fo.attacks.corrupt(secure, fo.attacks.omniscient(1e4), attackers=[3])
  state = jax.jit(_fedavg(attacked, None).step)(_fedavg(attacked, None).init(params, jax.random.key(0)), batches)
  np.testing.assert_allclose(_vec(state.params) - _vec(params), np.clip(received, -bound, bound).mean(0), rtol=0,
                             atol=2.0 ** -16 + 1e-6)
  assert int(state.aggregator_state.aggregator.num_clipped) >= 1


def test_a_downlink_compresses_the_server_step_of_a_dp_mean_over_compressed_uploads():
  """Both directions and DP: uploads top-2, `dp_mean` (C, σ = 0, m) on them, the server step u (sgd(1.0): the
  aggregate), broadcast top-1 with the server's error feedback: x̂₁ = x̂₀ + top-1(u), e₁ = u − top-1(u) (NumPy);
  the aggregate is released before the downlink touches it, so DP's clipped mean is unchanged."""
  params, batches = example_inputs("fedavg")
  _, _, mean = _clipped_reference(params, batches)
  sent = _np_top_k(1)(mean)
  algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.05), downlink=C.top_k(k=1),
                              aggregator=_chain(C.compress(C.top_k(k=2)),
                                                fo.privacy.dp_mean(CLIP, 0.0, expected_clients=M_DENOMINATOR)))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  np.testing.assert_allclose(_vec(state.params) - _vec(params), sent, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_vec(state.downlink_error), mean - sent, rtol=1e-5, atol=1e-7)
  assert float(state.metrics["bits_down"]) == 32 + INDEX_BITS and float(state.metrics["bits_up"]) == 2 * (
      32 + INDEX_BITS)

