"""Compressed client-to-server updates (`fo.compression`): each claim against an independent reference.

The compressors against closed forms and NumPy (QSGD's unbiasedness and
Alistarh et al.'s Lemma 3.1 variance bound, rand-k's unbiasedness, top-k
against argsort, sign's scale, every bit formula counted by hand); error
feedback's telescoping identity Σ_t sent_t + e_T = Σ_t Δ_t; the integration
in `core.rounds.client_round` as the client stage of a chained aggregator
(identity is FedAvg bit for bit, the stacked
and streamed paths agree, one FedAvg round against a float64 NumPy
transcription, a NaN client is dropped and its residual row not written);
signSGD's majority vote against NumPy; bad arguments.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from algorithm_examples import N, example_inputs, loss_fn
from conftest import diagonal, lsq_grad_np

import fedjax_opt as fo
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.types import StagedState

C = fo.compression


def _chain(stage, aggregator=None):
  """`aggregator` (default FedAvg's weighted mean) with the client stage `stage` in front (none when None)."""
  aggregator = fo.aggregators.weighted_mean() if aggregator is None else aggregator
  return aggregator if stage is None else fo.aggregators.chain(stage, aggregator)


def _vector(p, seed=0):
  return np.random.default_rng(seed).normal(size=p).astype(np.float32)


def _draws(compressor, x, m, seed=0):
  """m independent compressions of x, [m, P] float64."""
  keys = jax.random.split(jax.random.key(seed), m)
  out, _ = jax.jit(jax.vmap(compressor.compress, in_axes=(0, None)))(keys, jnp.asarray(x))
  return np.asarray(out, np.float64)


# ----------------------------------------------------------------------------- the compressors


@pytest.mark.parametrize("levels", [1, 2, 7])
def test_qsgd_is_unbiased_with_the_closed_form_variance_within_lemma_3_1(levels):
  p, m = 64, 20_000
  x = _vector(p)
  draws = _draws(C.qsgd(levels), x, m)
  x64 = x.astype(np.float64)
  norm = np.linalg.norm(x64)
  # Each x̂_i / (‖x‖/s) is an integer, ⌊r_i s⌋ or ⌈r_i s⌉, with the sign of x_i.
  r = np.abs(x64) / norm * levels
  units = np.abs(draws) / norm * levels
  np.testing.assert_allclose(units, np.round(units), atol=1e-3)
  assert np.all((np.round(units) == np.floor(r)) | (np.round(units) == np.ceil(r)))
  assert np.all((draws == 0) | (np.sign(draws) == np.sign(x64)))
  # Unbiased: Var x̂_i = (‖x‖/s)² f_i (1 − f_i) ≤ ‖x‖²/(4 s²); the mean of m draws lies within 5 standard errors.
  frac = r - np.floor(r)
  coord_var = (norm / levels) ** 2 * frac * (1 - frac)
  bound = 5 * np.sqrt(np.maximum(coord_var, 1e-12) / m) + 1e-6 * norm
  assert np.all(np.abs(draws.mean(0) - x64) <= bound)
  # E‖x̂ − x‖² has the closed form Σ_i Var x̂_i, and it lies within Lemma 3.1's min(P/s², √P/s) ‖x‖².
  exact = coord_var.sum()
  empirical = np.mean(np.sum((draws - x64) ** 2, axis=1))
  assert abs(empirical - exact) <= 0.03 * exact
  assert exact <= min(p / levels ** 2, math.sqrt(p) / levels) * norm ** 2


def test_qsgd_bits_sets_the_levels_and_zero_stays_zero():
  assert C.qsgd(bits=2).name == "qsgd(s=1)" and C.qsgd(bits=4).name == "qsgd(s=7)"
  assert C.qsgd(bits=8).name == "qsgd(s=127)"
  out, _ = jax.jit(C.qsgd(bits=4).compress)(jax.random.key(0), np.zeros(5, np.float32))
  np.testing.assert_array_equal(out, np.zeros(5))


def test_qsgd_holds_its_levels_exactly_up_to_24_bits_and_2_to_the_23_levels():
  """float32 holds integers up to 2^24 exactly: the largest codes are 24 bits (s = 2^23 − 1) or s = 2^23 levels."""
  assert C.qsgd(bits=24).name == f"qsgd(s={2 ** 23 - 1})" and C.qsgd(bits=24).bits(jnp.zeros(3)) == 32 + 3 * 24
  assert C.qsgd(2 ** 23).name == f"qsgd(s={2 ** 23})"
  with pytest.raises(ValueError, match="bits must be <= 24"):
    C.qsgd(bits=25)
  with pytest.raises(ValueError, match=r"levels must be <= 2\*\*23"):
    C.qsgd(2 ** 23 + 1)


def test_under_x64_a_float64_update_sends_its_norm_and_scale_as_float32():
  """QSGD's ‖x‖₂ and sign's ‖x‖₁/P travel as one float32 each (their bit counts charge 32): a float64 update is
  rebuilt from the float32-rounded value, against a float64 NumPy transcription with the same uniform draws."""
  rng = np.random.default_rng(9)
  x = rng.normal(size=50) * (1 + 1e-3 * rng.random(50))
  key = jax.random.key(4)
  with jax.enable_x64(True):
    x64 = jnp.asarray(x, jnp.float64)
    got_q, _ = jax.jit(C.qsgd(5).compress)(key, x64)
    got_s, _ = jax.jit(C.sign().compress)(key, x64)
    u = np.asarray(jax.random.uniform(key, (50,), jnp.float64))
  assert got_q.dtype == jnp.float64 and got_s.dtype == jnp.float64
  norm = float(np.float32(np.linalg.norm(x)))
  scaled = np.abs(x) / norm * 5
  xi = np.floor(scaled) + (u < scaled - np.floor(scaled))
  np.testing.assert_allclose(got_q, norm * np.sign(x) * xi / 5, rtol=1e-14, atol=0)
  scale = float(np.float32(np.abs(x).mean()))
  np.testing.assert_allclose(got_s, scale * np.where(x >= 0, 1.0, -1.0), rtol=1e-14, atol=0)
  assert abs(norm - np.linalg.norm(x)) > 1e-12 * norm  # the float32 rounding is visible at this tolerance


def test_qsgd_sends_zero_for_a_zero_coordinate_of_a_nonzero_update():
  x = np.array([0.0, 1.5, 0.0, -2.0, 0.25], np.float32)
  for compressor in (C.qsgd(1), C.qsgd(bits=8)):
    out, _ = jax.jit(compressor.compress)(jax.random.key(2), jnp.asarray(x))
    assert np.all(np.isfinite(out)) and np.all(np.asarray(out)[x == 0] == 0.0)
    assert np.all(np.sign(out)[x != 0] * np.sign(x[x != 0]) >= 0)  # ξ ≥ 0 keeps each sign


def test_a_float32_update_gets_the_same_message_with_x64_on():
  """The draws follow the update's dtype, not JAX's default: a float32 model compresses the same either way."""
  x = jnp.asarray(_vector(30, seed=5))
  key = jax.random.key(6)
  for compressor in (C.qsgd(3), C.rand_k(k=4), C.sign(), C.top_k(k=2)):
    off, bits_off = compressor.compress(key, x)
    with jax.enable_x64(True):
      on, bits_on = compressor.compress(key, x)
    assert on.dtype == jnp.float32 and float(bits_on) == float(bits_off), compressor.name
    np.testing.assert_array_equal(on, off, err_msg=compressor.name)


def test_the_unbiased_flag_is_a_bool_true_exactly_for_the_unbiased_compressors():
  """E[C(x)] = x for identity, QSGD and rand-k (tested above); top-k and sign are biased."""
  flags = {name: c.unbiased for name, c in COMPRESSORS.items()}
  assert all(type(flag) is bool for flag in flags.values()), flags
  assert flags == {"identity": True, "qsgd7": True, "qsgd5": True, "top_k3": False, "rand_k3": True,
                   "sign": False, "sign_plain": False}


def test_rand_k_is_unbiased_and_keeps_k_coordinates_scaled_by_p_over_k():
  p, k, m = 40, 4, 40_000
  x = _vector(p, seed=1)
  draws = _draws(C.rand_k(k=k), x, m)
  kept = draws != 0
  assert np.all(kept.sum(1) == k)
  np.testing.assert_allclose(draws[kept], (np.broadcast_to(x, draws.shape)[kept] * p / k), rtol=1e-6)
  # Var x̂_i = x_i² (P/k − 1): the mean of m draws within 5 standard errors of x.
  se = np.abs(x.astype(np.float64)) * np.sqrt((p / k - 1) / m)
  assert np.all(np.abs(draws.mean(0) - x) <= 5 * se + 1e-7)
  assert np.allclose(kept.mean(0), k / p, atol=5 * np.sqrt(k / p * (1 - k / p) / m))
  assert jax.eval_shape(C.rand_k(0.1).compress, jax.random.key(0), x)[0].shape == (p,)


def test_top_k_keeps_exactly_the_k_largest_magnitudes_of_the_whole_pytree():
  rng = np.random.default_rng(2)
  tree = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
  flat = np.concatenate([tree["a"].reshape(-1), tree["b"]])
  ks = (1, 4, 22)
  # Every k and the fraction in one program.
  outs, fraction_out = jax.jit(lambda key, tree, flat: ([C.top_k(k=k).compress(key, tree)[0] for k in ks],
                                                        C.top_k(0.1).compress(key, flat)[0]))(
      jax.random.key(0), tree, flat)
  for k, out in zip(ks, outs):
    got = np.concatenate([np.asarray(out["a"]).reshape(-1), np.asarray(out["b"])])
    want = np.zeros_like(flat)
    keep = np.argsort(-np.abs(flat))[:k]
    want[keep] = flat[keep]
    np.testing.assert_array_equal(got, want)
  assert int(np.sum(np.asarray(fraction_out) != 0)) == math.ceil(0.1 * flat.size)


def test_a_vector_compressor_puts_each_leaf_back_in_place_at_its_dtype_and_computes_in_float32():
  """The update is one vector of every leaf's entries in order (three leaves of other sizes and dtypes), computed
  in at least float32, and each leaf comes back at its own place, shape and dtype."""
  rng = np.random.default_rng(12)
  tree = {"a": rng.normal(size=(2,)).astype(np.float32), "b": rng.normal(size=(5,)).astype(jnp.bfloat16),
          "c": rng.normal(size=(1, 3)).astype(np.float32)}
  flat = np.concatenate([np.asarray(tree[k], np.float64).reshape(-1) for k in "abc"])
  key = jax.random.key(1)
  same, _ = C.top_k(fraction=1.0).compress(key, tree)
  signs, _ = C.sign().compress(key, tree)
  scale = np.float32(np.abs(flat).mean())
  for name in "abc":
    assert same[name].dtype == tree[name].dtype and same[name].shape == tree[name].shape, name
    np.testing.assert_array_equal(np.asarray(same[name], np.float64), np.asarray(tree[name], np.float64))
    want = scale * np.where(np.asarray(tree[name], np.float64) >= 0, 1.0, -1.0)
    assert signs[name].dtype == tree[name].dtype, name
    np.testing.assert_allclose(np.asarray(signs[name], np.float64), want,
                               rtol=1e-6 if tree[name].dtype == np.float32 else 8e-3)
  # A bfloat16-only update is quantized from float32 values: the float32 copy's message, rounded per entry.
  low = {"w": jnp.asarray(rng.normal(size=40), jnp.bfloat16)}
  got, _ = C.qsgd(3).compress(key, low)
  want, _ = C.qsgd(3).compress(key, {"w": low["w"].astype(jnp.float32)})
  assert got["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got["w"], np.float32), np.asarray(want["w"].astype(jnp.bfloat16), np.float32))


def test_top_k_of_one_entry_charges_no_index_bits_and_a_small_fraction_keeps_one_coordinate():
  assert C.top_k(k=1).bits(jnp.zeros(1)) == 32 and float(C.top_k(k=1).compress(jax.random.key(0), jnp.ones(1))[1]) == 32
  out, bits = C.top_k(0.05).compress(jax.random.key(0), jnp.arange(1.0, 11.0))
  np.testing.assert_array_equal(out, [0.0] * 9 + [10.0])
  assert float(bits) == 32 + 4  # ⌈0.05 · 10⌉ = 1 value and its 4-bit index


def test_sign_sends_the_mean_magnitude_times_a_one_bit_sign():
  x = np.array([1.5, -0.25, 0.0, -3.0, 2.0], np.float32)
  out, _ = C.sign().compress(jax.random.key(0), jnp.asarray(x))
  sgn = np.where(x >= 0, 1.0, -1.0)  # a 1-bit code has no zero
  np.testing.assert_allclose(out, np.abs(x.astype(np.float64)).sum() / x.size * sgn, rtol=1e-6)
  out, _ = C.sign(scaled=False).compress(jax.random.key(0), jnp.asarray(x))
  np.testing.assert_array_equal(out, sgn)


def _expected_bits(name, p):
  """Each compressor's charge, counted from its message layout (not from the library's formulas)."""
  index_bits = math.ceil(math.log2(p)) if p > 1 else 0
  return {
      "identity": 32 * p,
      "qsgd7": 32 + p * (1 + 3),  # the norm, then a sign bit and ⌈log₂ 8⌉ = 3 bits for ξ ∈ {0..7}
      "qsgd5": 32 + p * (1 + math.ceil(math.log2(6))),
      "top_k3": 3 * (32 + index_bits),
      "rand_k3": 32 * 3 + 32,
      "sign": p + 32,
      "sign_plain": p,
  }[name]


# Module-level instances: `_fedavg_step` caches FedAvg's compiled step by compressor, so tests that use the same
# instance with the same choices share one program.
COMPRESSORS = {"identity": C.identity(), "qsgd7": C.qsgd(bits=4), "qsgd5": C.qsgd(5), "top_k3": C.top_k(k=3),
               "rand_k3": C.rand_k(k=3), "sign": C.sign(), "sign_plain": C.sign(scaled=False)}
TOP_1 = C.top_k(k=1)


@functools.cache
def _fedavg_step(compressor=None, error_feedback=False, aggregator="weighted_mean", mode="vmap"):
  """`(algo, jitted step)` of FedAvg (client SGD at lr 0.05) with the client stage `compress(compressor,
  error_feedback)` (none when `compressor` is None) in front of `fo.aggregators.<aggregator>()`.

  Built once per choice: the tests that make the same choice share one compiled program.
  """
  stage = None if compressor is None else C.compress(compressor, error_feedback=error_feedback,
                                                     num_clients=N if error_feedback else None)
  algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.05),
                              aggregator=_chain(stage, getattr(fo.aggregators, aggregator)()), client_map=mode)
  return algo, jax.jit(algo.step)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_each_bit_count_matches_its_message_layout_in_the_compressor_and_the_round_metrics(name):
  compressor = COMPRESSORS[name]
  sizes = (3, 8, 1000, 7850)
  xs = [_vector(p) for p in sizes]
  charged = jax.jit(lambda key, xs: [compressor.compress(key, x)[1] for x in xs])(jax.random.key(0), xs)  # one program
  for p, x, bits in zip(sizes, xs, charged):
    want = _expected_bits(name, p)
    assert compressor.bits(jnp.asarray(x)) == want
    assert float(bits) == want
  # In a round: FedAvg on the examples' model (P = 4), clients 2 and 3 without weight take no part.
  params, batches = example_inputs("fedavg")
  weight = np.asarray(batches.weight).copy()
  weight[2:] = 0.0
  batches = batches.replace(weight=jnp.asarray(weight))
  algo, step = _fedavg_step(compressor)
  state = step(algo.init(params, jax.random.key(0)), batches)
  assert float(state.metrics["bits_up"]) == _expected_bits(name, 4)
  assert float(state.metrics["bits_down"]) == 32 * 4


def test_every_compressor_charges_a_float32_count_and_identity_each_leaf_at_its_own_width():
  tree = {"w": jnp.ones((3, 4), jnp.float32), "h": jnp.ones((5,), jnp.bfloat16)}
  for name, compressor in {**COMPRESSORS, "identity_fresh": C.identity()}.items():
    _, bits = jax.jit(compressor.compress)(jax.random.key(0), tree)
    assert bits.dtype == jnp.float32 and bits.shape == (), name
  _, bits = C.identity().compress(jax.random.key(0), tree)
  assert float(bits) == 32 * 12 + 16 * 5 == C.identity().bits(tree)


def test_uncompressed_algorithms_report_every_bit_of_each_message():
  params, batches = example_inputs("fedavg")
  p = 4
  for algo, step, up, down in [
      (*_fedavg_step(None), 32 * p, 32 * p),  # FedAvg's default aggregator, the weighted mean
      (fo.algorithms.fedsgd(loss_fn, server_optimizer=optax.sgd(0.01)), None, 32 * p, 32 * p),
      (fo.algorithms.scaffold(loss_fn, 0.01, 1.0, num_clients=N), None, 2 * 32 * p, 2 * 32 * p),  # (Δy, Δc), (x, c)
  ]:
    state = (step or jax.jit(algo.step))(algo.init(params, jax.random.key(0)), batches)
    assert (float(state.metrics["bits_up"]), float(state.metrics["bits_down"])) == (up, down)
  bf16 = jax.tree.map(lambda a: np.asarray(a).astype(jnp.bfloat16), params)
  assert fo.compression.tree_bits(bf16) == 16 * p


def test_compressors_are_jittable_and_vmappable():
  """The batched compression (jit of vmap) against one client at a time (jit alone)."""
  xs = np.random.default_rng(3).normal(size=(5, 30)).astype(np.float32)
  keys = jax.random.split(jax.random.key(1), 5)
  for compressor in COMPRESSORS.values():
    batched, bits = jax.jit(jax.vmap(compressor.compress))(keys, xs)
    one_client = jax.jit(compressor.compress)
    for i in range(5):
      one, one_bits = one_client(keys[i], xs[i])
      np.testing.assert_allclose(batched[i], one, rtol=1e-6, atol=1e-7)
      assert float(bits[i]) == float(one_bits)


# ----------------------------------------------------------------------------- error feedback in the round


def _recording_round(stage):
  """`round(deltas, ids, residuals) -> (what arrived [C, P], new residuals)`, jitted: one `client_round` whose
  clients (ids `[C]`) send the given Δ `[C, P]` and whose aggregator records what arrived."""

  def client_update(shared, data, mask):
    del shared, mask
    return ClientOutput(LocalResult(delta=data["delta"][0, 0], loss=jnp.float32(0), num_examples=jnp.float32(1),
                                    num_steps=jnp.int32(1)))

  @jax.jit
  def one_round(deltas, ids, residuals):
    c, p = deltas.shape
    record = fo.aggregators.Aggregator(lambda p: jnp.zeros((c,) + p.shape, p.dtype),
                                       lambda u, w, s, k: (jnp.mean(u, 0), u))
    batches = fo.ClientBatches(data={"delta": deltas[:, None, None]}, mask=jnp.ones((c, 1, 1), bool),
                               weight=jnp.ones(c), client_id=ids.astype(jnp.int32))
    aggregator = fo.aggregators.chain(stage, record)
    state = StagedState(rows=(residuals,), server=record.init(jnp.zeros(p)))
    out = client_round("vmap", client_update, jnp.zeros(p), batches, aggregator=aggregator,
                       aggregator_state=state, key=jax.random.key(c))
    return out.agg.state.server, C.residuals(out.agg.state)

  def run(deltas, ids, residuals):
    sent, residuals = one_round(np.asarray(deltas), np.asarray(ids), residuals)
    return np.asarray(sent), residuals

  return run


def test_error_feedback_telescopes_and_each_step_is_top_k_of_delta_plus_residual():
  """Σ_t sent_{i,t} + e_{i,T} = Σ_t Δ_{i,t} per client; each sent = top_k(Δ + e) and e' = Δ + e − sent (NumPy)."""
  n, p, k, rounds = 6, 10, 2, 8
  comp = C.compress(C.top_k(k=k), error_feedback=True, num_clients=n)
  residuals = fo.core.per_client.init(jnp.zeros(p), n)
  one_round = _recording_round(comp)
  rng = np.random.default_rng(4)
  sent_total, delta_total = np.zeros((n, p)), np.zeros((n, p))
  e_ref = np.zeros((n, p))
  for _ in range(rounds):
    ids = np.sort(rng.choice(n, size=3, replace=False))
    deltas = rng.normal(size=(3, p)).astype(np.float32)
    sent, residuals = one_round(deltas, ids, residuals)
    for row, i in enumerate(ids):
      v = deltas[row].astype(np.float64) + e_ref[i]
      want = np.zeros(p)
      keep = np.argsort(-np.abs(v))[:k]
      want[keep] = v[keep]
      np.testing.assert_allclose(sent[row], want, rtol=1e-6, atol=1e-6)
      e_ref[i] = v - want
    np.testing.assert_allclose(np.asarray(residuals), e_ref, rtol=1e-5, atol=1e-6)  # others' rows untouched
    sent_total[ids] += sent
    delta_total[ids] += deltas
  np.testing.assert_allclose(sent_total + np.asarray(residuals, np.float64), delta_total, rtol=1e-5, atol=1e-5)


def test_the_compression_key_is_the_round_key_folded_with_the_client_id():
  """rand-k's indices (which the server must regenerate) depend on the client id, not on its position."""
  p = 20
  comp = C.compress(C.rand_k(k=3), error_feedback=True, num_clients=6)
  delta = np.ones((2, p), np.float32)
  one_round = _recording_round(comp)
  sent_a, _ = one_round(delta, [3, 5], fo.core.per_client.init(jnp.zeros(p), 6))
  sent_b, _ = one_round(delta, [5, 3], fo.core.per_client.init(jnp.zeros(p), 6))
  np.testing.assert_array_equal(sent_a, sent_b[::-1])
  assert not np.array_equal(sent_a[0] != 0, sent_a[1] != 0)


def _run(compressor, error_feedback=False, mode="vmap", rounds=2, poisoned=None, aggregator="weighted_mean"):
  """`rounds` rounds of `_fedavg_step(compressor, error_feedback, aggregator, mode)` on the examples' data,
  client weights 6, 2, 5, 1 (client `poisoned` holds a NaN); the final state."""
  params, batches = example_inputs("fedavg", poisoned=poisoned)
  batches = batches.replace(weight=jnp.asarray([6.0, 2.0, 5.0, 1.0]))
  algo, step = _fedavg_step(compressor, error_feedback, aggregator, mode)
  state = algo.init(params, jax.random.key(7))
  for _ in range(rounds):
    state = step(state, batches)
  return state


def test_identity_compression_leaves_fedavg_unchanged_bit_for_bit():
  want = _run(None, rounds=3)
  for error_feedback in (False, True):
    got = _run(COMPRESSORS["identity"], error_feedback, rounds=3)
    for a, b in zip(jax.tree.leaves((got.params, got.server_opt_state, got.metrics)),
                    jax.tree.leaves((want.params, want.server_opt_state, want.metrics))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got_residuals = C.residuals(got.aggregator_state)
    assert got_residuals is None or all(not np.any(np.asarray(t)) for t in jax.tree.leaves(got_residuals))
  assert C.residuals(want.aggregator_state) is None


# compressors × (aggregator, loop mode): the diagonal (top_k and sign with the weighted mean, whose programs the NumPy
# and NaN tests below reuse; qsgd and rand_k with the mean; each loop mode twice) in the default tier, every cell in
# the slow tier.
STREAMS = [("weighted_mean", "sequential"), ("mean", "chunked:3"), ("weighted_mean", "chunked:3"), ("mean", "sequential")]


@pytest.mark.parametrize("compressor,stream", diagonal([TOP_1, C.qsgd(bits=3), COMPRESSORS["sign"], C.rand_k(k=2)],
                                                       STREAMS),
                         ids=lambda v: "-".join(v) if v in STREAMS else getattr(v, "name", v))
def test_compression_gives_the_same_state_stacked_and_streamed(compressor, stream):
  """vmap stacks the updates; sequential and chunked:3 (4 clients) stream them: the same state, residuals and bits."""
  aggregator, mode = stream
  want = _run(compressor, True, "vmap", aggregator=aggregator)
  got = _run(compressor, True, mode, aggregator=aggregator)
  for a, b in zip(jax.tree.leaves((got.params, C.residuals(got.aggregator_state), got.metrics)),
                  jax.tree.leaves((want.params, C.residuals(want.aggregator_state), want.metrics))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6, err_msg=mode)


def _numpy_fedavg_round(params, data, weights, lr, compress, residuals):
  """One FedAvg round in float64: S SGD steps of ½(xᵀw + b − y)² per client, compress Δ + e, weighted mean."""
  w0, b0 = np.asarray(params["w"], np.float64), float(params["b"])
  sent, new_res = [], []
  for c in range(len(weights)):
    w, b = w0.copy(), b0
    for s in range(data["x"].shape[1]):
      x, y = data["x"][c, s].astype(np.float64), data["y"][c, s].astype(np.float64)
      r = x @ w + b - y
      w, b = w - lr * x.T @ r / len(y), b - lr * r.mean()
    v = np.concatenate([np.array([b - b0]), w - w0]) + residuals[c]  # the pytree's leaf order: b, then w
    out = compress(v)
    sent.append(out)
    new_res.append(v - out)
  mean = np.tensordot(weights / weights.sum(), np.stack(sent), axes=1)
  return {"b": b0 + mean[0], "w": w0 + mean[1:]}, np.stack(new_res)


def _np_top_1(v):
  out = np.zeros_like(v)
  i = int(np.argmax(np.abs(v)))
  out[i] = v[i]
  return out


@pytest.mark.parametrize("compressor,reference", [
    (TOP_1, _np_top_1),
    (COMPRESSORS["sign"], lambda v: np.abs(v).mean() * np.where(v >= 0, 1.0, -1.0)),
], ids=["top_k1", "sign"])
def test_two_fedavg_rounds_with_error_feedback_match_a_float64_numpy_transcription(compressor, reference):
  params, batches = example_inputs("fedavg")
  weights = np.array([6.0, 2.0, 5.0, 1.0])
  data = {k: np.asarray(v) for k, v in batches.data.items()}
  state = _run(compressor, True, rounds=1)
  want, res = _numpy_fedavg_round(params, data, weights, 0.05, reference, np.zeros((N, 4)))
  np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state.params["b"], want["b"], rtol=1e-5, atol=1e-6)
  residuals = C.residuals(state.aggregator_state)
  got_res = np.concatenate([np.asarray(residuals["b"])[:, None], np.asarray(residuals["w"])], axis=1)
  np.testing.assert_allclose(got_res, res, rtol=1e-5, atol=1e-6)
  state = _run(compressor, True, rounds=2)
  want, res = _numpy_fedavg_round(want, data, weights, 0.05, reference, res)
  np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state.params["b"], want["b"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["vmap", "chunked:3"])
def test_a_nan_client_is_dropped_and_its_residual_row_is_not_written(mode):
  state = _run(TOP_1, True, mode, rounds=2, poisoned=1)
  residuals = C.residuals(state.aggregator_state)
  assert int(state.metrics["num_nonfinite"]) == 1 and int(state.metrics["num_clients"]) == N - 1
  assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves((state.params, residuals)))
  rows = np.concatenate([np.asarray(residuals["b"])[:, None], np.asarray(residuals["w"])], axis=1)
  assert not np.any(rows[1])  # never written: still the initial zeros
  assert np.all(np.abs(rows[[0, 2, 3]]).sum(1) > 0)  # top-1 of 4 entries leaves a residual for the others
  # A rejected round (every client NaN) writes no row.
  params, batches = example_inputs("fedavg")
  nan = batches.replace(data={**batches.data, "x": jnp.asarray(np.full(batches.data["x"].shape, np.nan, np.float32))})
  algo, step = _fedavg_step(TOP_1, True, "weighted_mean", mode)
  s0 = algo.init(params, jax.random.key(0))
  s1 = step(s0, nan)
  assert not bool(s1.metrics["round_accepted"])
  assert all(not np.any(np.asarray(t)) for t in jax.tree.leaves(C.residuals(s1.aggregator_state)))


def test_fedsgd_and_fedprox_take_compression():
  params, batches = example_inputs("fedavg")
  comp = C.compress(C.top_k(k=1), error_feedback=True, num_clients=N)
  for algo in (fo.algorithms.fedsgd(loss_fn, server_optimizer=optax.sgd(0.1), aggregator=_chain(comp)),
               fo.algorithms.fedprox(loss_fn, 0.1, client_optimizer=optax.sgd(0.05), aggregator=_chain(comp))):
    state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
    residuals = C.residuals(state.aggregator_state)
    assert all(np.sum(np.abs(np.asarray(r)), axis=-1).min() > 0 for r in [residuals["w"]])  # kept a residual
    assert float(state.metrics["bits_up"]) == 1 * (32 + 2)  # one float32 value and a ⌈log₂ 4⌉-bit index


# ----------------------------------------------------------------------------- majority vote


def test_majority_vote_matches_numpy_and_streams():
  rng = np.random.default_rng(5)
  updates = rng.normal(size=(5, 9)).astype(np.float32)
  updates[:, 0] = [1, 1, -1, -1, 0]  # 3 votes + (0 counts as +), 2 votes −
  weights = np.array([1.0, 4.0, 0.0, 2.0, 1.0])  # client 2 takes no part; the others one vote each
  agg = fo.aggregators.majority_vote()
  got, _ = jax.jit(agg.aggregate)(updates, weights, (), jax.random.key(0))
  votes = np.where(updates >= 0, 1, -1) * (weights > 0)[:, None]
  np.testing.assert_array_equal(got, np.sign(votes.sum(0)))
  assert float(got[0]) == 1.0
  # FedSGD with majority vote: x ← x + η sgn(Σ_k sgn(−g_k)); the server lr scales the vote; loop modes stream.
  params, batches = example_inputs("fedavg")
  eta = 0.01
  finals = []
  for mode, comp in [("vmap", None), ("chunked:3", None), ("vmap", C.compress(C.sign(scaled=False)))]:
    algo = fo.algorithms.fedsgd(loss_fn, server_optimizer=optax.sgd(eta), aggregator=_chain(comp, agg),
                                client_map=mode)
    finals.append(jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches))
  # Each client's gradient of its mean loss over all its examples, float64 NumPy.
  x, y = (np.asarray(batches.data[k], np.float64) for k in ("x", "y"))
  w0, b0 = np.asarray(params["w"], np.float64), float(params["b"])
  grads = [lsq_grad_np(w0, b0, x[c].reshape(-1, 3), y[c].reshape(-1)) for c in range(N)]
  grads = {"w": np.stack([g_w for g_w, _ in grads]), "b": np.array([g_b for _, g_b in grads])}
  for name in ("w", "b"):
    g = grads[name].reshape(N, -1)
    want = np.asarray(params[name]).reshape(-1) + eta * np.sign(np.where(-g >= 0, 1, -1).sum(0))
    for s in finals:
      np.testing.assert_allclose(np.asarray(s.params[name]).reshape(-1), want, rtol=1e-6)
  assert float(finals[2].metrics["bits_up"]) == 4 and float(finals[0].metrics["bits_up"]) == 128


# ----------------------------------------------------------------------------- bad arguments


def test_a_stage_keeps_a_residual_table_only_with_error_feedback_and_at_its_storage_dtype():
  params = {"w": jnp.ones((3,), jnp.float32)}
  stage = C.compress(C.top_k(k=1), num_clients=5)  # no error feedback: nothing per client, whatever N
  assert stage.num_clients is None and stage.init(params) is None
  fo.algorithms.scaffold(loss_fn, 0.01, 1.0, num_clients=N, aggregator=_chain(stage, fo.aggregators.mean()))
  table = C.compress(C.top_k(k=1), error_feedback=True, num_clients=5, storage_dtype=jnp.bfloat16).init(params)
  assert table["w"].shape == (5, 3) and table["w"].dtype == jnp.bfloat16


def test_under_x64_a_residual_stored_in_bfloat16_is_added_at_the_update_dtype():
  update = {"w": jnp.asarray([0.5, -2.0, 1.0], jnp.float32)}
  residual = {"w": jnp.asarray([1.75, 0.5, -0.25], jnp.bfloat16)}
  with jax.enable_x64(True):
    sent, new, bits = C.send(C.top_k(k=1), jax.random.key(0), update, residual)
  assert sent["w"].dtype == jnp.float32 and new["w"].dtype == jnp.float32
  np.testing.assert_array_equal(sent["w"], [2.25, 0.0, 0.0])
  np.testing.assert_array_equal(new["w"], [0.0, -1.5, 0.75])


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="exactly one of levels"):
    C.qsgd()
  with pytest.raises(ValueError, match="exactly one of levels"):
    C.qsgd(3, bits=4)
  with pytest.raises(ValueError, match="bits must be a Python int >= 2"):
    C.qsgd(bits=1)
  with pytest.raises(ValueError, match="levels must be a Python int >= 1"):
    C.qsgd(0)
  with pytest.raises(TypeError, match="levels must be a Python int"):
    C.qsgd(2.5)
  with pytest.raises(ValueError, match="exactly one of k"):
    C.top_k()
  with pytest.raises(ValueError, match="fraction must lie in the open interval"):
    C.top_k(0.0)
  with pytest.raises(ValueError, match="fraction must lie in the open interval"):
    C.rand_k(1.5)
  with pytest.raises(ValueError, match="k must be a Python int >= 1"):
    C.rand_k(k=0)
  with pytest.raises(ValueError, match="k=10 is larger than the update's P=4"):
    C.top_k(k=10).compress(jax.random.key(0), jnp.zeros(4))
  with pytest.raises(TypeError, match="scaled must be a bool"):
    C.sign(scaled=1)
  with pytest.raises(ValueError, match="give num_clients=N"):
    C.compress(C.top_k(k=1), error_feedback=True)
  with pytest.raises(TypeError, match="compressor must be a fedjax_opt.compression.Compressor"):
    C.compress("qsgd")
  with pytest.raises(TypeError, match=r"wrap the compressor, fo.compression.compress\(qsgd"):
    fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.1),
                         aggregator=fo.aggregators.chain(C.qsgd(bits=4), fo.aggregators.mean()))
  assert C.rand_k(1.0).bits(jnp.zeros(5)) == 32 * 5 + 32  # fraction 1 is allowed
