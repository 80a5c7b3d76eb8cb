"""DP-FedAvg's aggregator (`fo.privacy.dp_mean`) against NumPy, chi-square bounds and the adaptive-clipping paper."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from conftest import diagonal

import fedjax_opt as fo
from fedjax_opt.core import aggregate_updates

P = fo.privacy
KEY = jax.random.key(0)


def _updates(rng, c=5):
  """A two-leaf pytree of C client updates with norms on both sides of C = 1."""
  u = {"w": rng.normal(size=(c, 3, 2)), "b": rng.normal(size=(c, 2))}
  scale = np.array([0.1, 0.5, 2.0, 5.0, 0.9, 3.0, 0.2, 1.5][:c])
  return {k: v / np.sqrt(np.sum(u["w"] ** 2, axis=(1, 2)) + np.sum(u["b"] ** 2, axis=1)).reshape(
      (-1,) + (1,) * (v.ndim - 1)) * scale.reshape((-1,) + (1,) * (v.ndim - 1)) for k, v in u.items()}


def _numpy_clipped_sum(u, w, clip):
  """Σ_{w_k > 0} u_k min(1, C/‖u_k‖) in float64, the norm over both leaves."""
  norms = np.sqrt(np.sum(u["w"] ** 2, axis=(1, 2)) + np.sum(u["b"] ** 2, axis=1))
  scale = np.minimum(1.0, clip / norms) * (w > 0)
  return {"w": np.einsum("c,cij->ij", scale, u["w"]), "b": np.einsum("c,ci->i", scale, u["b"])}, norms


def test_clipping_equals_a_float64_reference_and_leaves_small_updates_untouched():
  u = _updates(np.random.default_rng(0))
  for k in range(5):
    one = {name: jnp.asarray(v[k], jnp.float32) for name, v in u.items()}
    got, norm = P.clip_by_global_norm(one, jnp.float32(1.0))
    n = np.sqrt(np.sum(u["w"][k] ** 2) + np.sum(u["b"][k] ** 2))
    np.testing.assert_allclose(norm, n, rtol=1e-6)
    for name in u:
      want = u[name][k] * min(1.0, 1.0 / n)
      np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-7)
      if n <= 1.0:  # below C: exactly the update (scale 1, no rounding)
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(one[name]))
    assert np.sqrt(sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(got))) <= 1.0 + 1e-6


def test_clipping_computes_in_the_update_dtype_promoted_to_float32_also_under_x64():
  """Δ · min(1, C / ‖Δ‖₂) and ‖Δ‖₂ in promote(dtype, float32): bfloat16 → float32, float32 stays float32 with x64 on
  (not float64), float64 stays float64; the values against a float64 NumPy transcription."""
  x = np.array([[3.0, -4.0], [0.0, 12.0]])  # ‖x‖ = 13 > C = 6.5: scale ½ (exact in bfloat16 too)
  with jax.enable_x64(True):
    for dtype, want in ((jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32), (jnp.float64, jnp.float64)):
      got, norm = P.clip_by_global_norm({"a": jnp.asarray(x[0], dtype), "b": jnp.asarray(x[1], dtype)}, 6.5)
      assert norm.dtype == want and got["a"].dtype == want and got["b"].dtype == want, dtype
      np.testing.assert_allclose(float(norm), 13.0, rtol=1e-6)
      np.testing.assert_allclose(np.concatenate([got["a"], got["b"]]), x.reshape(-1) / 2, rtol=1e-6)


def test_without_noise_the_aggregate_is_the_clipped_uniform_mean_over_m():
  u = _updates(np.random.default_rng(1))
  w = np.array([3.0, 0.0, 1.0, 7.0, 2.0])  # n_k weights are ignored; client 1 takes no part
  agg = P.dp_mean(1.0, 0.0, expected_clients=4)
  with jax.enable_x64(True):  # one program, not op-by-op dispatch
    got, state = jax.jit(agg.aggregate)({k: jnp.asarray(v) for k, v in u.items()}, jnp.asarray(w), agg.init(None), KEY)
  want, _ = _numpy_clipped_sum(u, w, 1.0)
  for name in u:
    np.testing.assert_allclose(got[name], want[name] / 4, rtol=1e-6)
  assert float(state.clip_norm) == 1.0 and np.isnan(float(state.noisy_fraction))


def _noise_samples(sigma, clip, m, keys, c=4, d=6):
  agg = P.dp_mean(clip, sigma, expected_clients=m)
  u = {"p": jnp.asarray(np.random.default_rng(2).normal(size=(c, d)), jnp.float32)}
  w = jnp.ones(c)
  quiet = P.dp_mean(clip, 0.0, expected_clients=m)
  clean, _ = quiet.aggregate(u, w, quiet.init(None), KEY)
  noisy = jax.jit(jax.vmap(lambda k: agg.aggregate(u, w, agg.init(None), k)[0]["p"]))(keys)
  return np.asarray(noisy, np.float64) - np.asarray(clean["p"], np.float64)


def test_noise_has_std_sigma_c_over_m_per_coordinate():
  sigma, clip, m, n = 1.3, 0.5, 4.0, 4000
  noise = _noise_samples(sigma, clip, m, jax.random.split(jax.random.key(7), n))
  target = sigma * clip / m
  # (n − 1) s² / σ² ~ χ²(n − 1) for each coordinate; 6 coordinates, two-sided 1e-4 each.
  lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], n - 1) / (n - 1)
  var = noise.var(axis=0, ddof=1) / target ** 2
  assert np.all((lo < var) & (var < hi)), (var, lo, hi)
  # Pooled over the 6 coordinates (independent): a tighter check of the same scale.
  pooled = noise.var(ddof=1) / target ** 2
  lo6, hi6 = stats.chi2.ppf([1e-4, 1 - 1e-4], 6 * (n - 1)) / (6 * (n - 1))
  assert lo6 < pooled < hi6
  # Mean zero: |mean| below 4 standard errors.
  assert np.all(np.abs(noise.mean(axis=0)) < 4 * target / np.sqrt(n))


def test_under_x64_a_float32_model_gets_float32_draws_per_leaf_and_keeps_a_float32_state():
  """One adaptive round transcribed from the round key: leaf i's noise z_i ~ N(0, I) is drawn from key i of the
  update key's split into one key per leaf, in the leaf's dtype (float32 under x64 too: a float64 draw would be
  other numbers), Δ = (Σ Δ̃_k + σ_Δ C z) / m; a client at norm exactly C is left as it is and counted as
  unclipped (b_k = 1[‖Δ_k‖ ≤ C]); C ← C exp(−η (b̄ − γ)). Every field of `DPMeanState` stays float32, starting
  from σ and m (what `fo.train` gives the accountant), C_0 twice and no fraction yet."""
  sigma, sigma_b, clip, m, eta, gamma = 2.0, 3.0, 5.0, 4.0, 0.2, 0.4
  shapes = {"a": (3,), "b": (2, 2), "c": ()}
  updates = {name: np.zeros((2,) + shape, np.float32) for name, shape in shapes.items()}  # C = 2 clients
  updates["a"][1] = [3.0, 4.0, 0.0]  # ‖Δ_1‖ = 5 = C exactly (in float32 too); client 0 sends zeros
  agg = P.dp_mean(clip, sigma, expected_clients=m, adaptive=P.AdaptiveClipping(gamma, eta, sigma_b))
  key = jax.random.key(13)
  update_key, count_key = jax.random.split(key)
  leaf_keys = jax.random.split(update_key, 3)  # leaves in pytree order: a, b, c
  aggregate = jax.jit(agg.aggregate)
  with jax.enable_x64(True):
    state = agg.init(None)
    out, new = aggregate(updates, jnp.ones(2, jnp.float32), state, key)
    _, newer = aggregate(updates, jnp.ones(2, jnp.float32), new, key)  # the next round used C_1
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves((state, new, newer)))
  assert (float(state.noise_multiplier), float(state.expected_clients)) == (sigma, m)
  assert float(state.clip_norm) == float(state.last_clip_norm) == clip and np.isnan(float(state.noisy_fraction))
  sigma_delta = (sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5
  for k, (name, shape) in zip(leaf_keys, shapes.items()):
    z = np.asarray(jax.random.normal(k, shape, jnp.float32), np.float64)
    assert out[name].dtype == jnp.float32 and out[name].shape == shape
    want = (updates[name].astype(np.float64).sum(0) + sigma_delta * clip * z) / m
    np.testing.assert_allclose(np.asarray(out[name], np.float64), want, rtol=1e-6, atol=1e-6)
  z_b = float(jax.random.normal(count_key, (), jnp.float32))
  noisy = (2 * (1 - 0.5) + sigma_b * z_b) / m + 0.5  # both clients unclipped
  np.testing.assert_allclose(float(new.noisy_fraction), noisy, rtol=1e-6)
  np.testing.assert_allclose(float(new.clip_norm), clip * np.exp(-eta * (noisy - gamma)), rtol=1e-6)
  assert float(new.last_clip_norm) == clip and float(newer.last_clip_norm) == float(new.clip_norm) != clip


def test_the_noise_is_a_function_of_the_round_key():
  keys = jnp.stack([jax.random.key(3), jax.random.key(3), jax.random.key(4)])
  noise = _noise_samples(1.0, 1.0, 2.0, keys)
  np.testing.assert_array_equal(noise[0], noise[1])
  assert np.all(noise[0] != noise[2])
  # Through an algorithm: two rounds of the same state differ only by the round key the state carries.
  algo = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1), aggregator=P.dp_mean(1.0, 1.0,
                                                                                        expected_clients=2))
  params, batches = _inputs(np.random.default_rng(0))
  s0 = algo.init(params, jax.random.key(0))
  a, b = jax.jit(algo.step)(s0, batches), jax.jit(algo.step)(s0, batches)
  np.testing.assert_array_equal(a.params["w"], b.params["w"])
  c = jax.jit(algo.step)(algo.init(params, jax.random.key(1)), batches)
  assert np.all(np.asarray(c.params["w"]) != np.asarray(a.params["w"]))


def _loss(params, batch):
  return 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])


def _inputs(rng, c=5, s=2, b=3, d=3):
  x = rng.normal(size=(c, s, b, d)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5]) * 3 + rng.normal(size=(c, s, b))).astype(np.float32)
  batches = fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.ones((c, s, b), bool),
                             weight=jnp.asarray(rng.integers(1, 20, size=c), jnp.float32),
                             client_id=jnp.arange(c, dtype=jnp.int32))
  return {"w": jnp.zeros(d), "b": jnp.zeros(())}, batches


# (fixed clip, adaptive clipping) × loop modes: the diagonal in the default tier, every cell in the slow tier.
@pytest.mark.parametrize("adaptive,loop", diagonal([None, P.AdaptiveClipping(0.5, 0.3, 2.0)], ["sequential", "chunked:3"]),
                         ids=lambda v: v if isinstance(v, str) else ("fixed" if v is None else "adaptive"))
def test_streaming_equals_the_stacked_round_through_fedavg(adaptive, loop):
  params, batches = _inputs(np.random.default_rng(3))
  x = batches.data["x"].at[1, 0, 0, 0].set(jnp.nan)  # client 1: a non-finite update (dropped, not counted)
  mask = batches.mask.at[3].set(False)  # client 3: no data this round (no step, no part)
  batches = batches.replace(data={**batches.data, "x": x}, mask=mask)
  states = {}
  for mode in ("vmap", loop):
    algo = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.05), client_map=mode,
                                aggregator=P.dp_mean(0.3, 0.8, expected_clients=3, adaptive=adaptive))
    state = algo.init(params, jax.random.key(5))
    step = jax.jit(algo.step)
    for _ in range(3):
      state = step(state, batches)
    states[mode] = state
  assert int(states["vmap"].metrics["num_clients"]) == 3 and int(states["vmap"].metrics["num_nonfinite"]) == 1
  for name in ("w", "b"):
    np.testing.assert_allclose(states[loop].params[name], states["vmap"].params[name], rtol=2e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(states[loop].aggregator_state), jax.tree.leaves(states["vmap"].aggregator_state)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_zero_weight_and_nonfinite_clients_contribute_nothing_and_are_not_counted():
  rng = np.random.default_rng(4)
  u = _updates(rng)
  w = np.array([1.0, 1.0, 0.0, 1.0, 1.0])
  bad = {k: v.copy() for k, v in u.items()}
  bad["w"][3, 0, 0] = np.inf
  agg = P.dp_mean(1.0, 0.0, expected_clients=10, adaptive=P.AdaptiveClipping(0.5, 0.2, 1e-6))
  out = jax.jit(functools.partial(aggregate_updates, agg))(  # one program, not op-by-op dispatch
      {k: jnp.asarray(v, jnp.float32) for k, v in bad.items()}, jnp.asarray(w), agg.init(None), KEY)
  want, norms = _numpy_clipped_sum(u, np.array([1.0, 1.0, 0.0, 0.0, 1.0]), 1.0)
  for name in u:
    np.testing.assert_allclose(out.update[name], want[name] / 10, rtol=1e-5, atol=1e-7)
  assert int(out.num_nonfinite) == 1 and bool(out.accepted)
  # The bits of the three clients that count: (Σ (b_k − ½)) / m + ½ with σ_b ≈ 0.
  bits = (norms[[0, 1, 4]] <= 1.0).astype(float)
  np.testing.assert_allclose(out.state.noisy_fraction, np.sum(bits - 0.5) / 10 + 0.5, atol=1e-5)


def test_a_round_without_clients_still_releases_its_noise():
  agg = P.dp_mean(1.0, 1.0, expected_clients=2)
  out = aggregate_updates(agg, {"p": jnp.ones((3, 4))}, jnp.zeros(3), agg.init(None), KEY)
  assert bool(out.accepted) and np.all(np.asarray(out.update["p"]) != 0)
  plain = aggregate_updates(fo.aggregators.mean(), {"p": jnp.ones((3, 4))}, jnp.zeros(3), (), KEY)
  assert not bool(plain.accepted)  # the non-private rule is unchanged


def _numpy_adaptive(clip, bits, part, z, eta, gamma, sigma_b, m):
  """Andrew et al.'s update, transcribed: b̄ = (Σ part (b − ½) + σ_b z) / m + ½, C ← C exp(−η (b̄ − γ))."""
  noisy = (np.sum(part * (bits - 0.5)) + sigma_b * z) / m + 0.5
  return clip * np.exp(-eta * (noisy - gamma)), noisy


def test_adaptive_clip_norm_update_equals_a_numpy_transcription():
  rng = np.random.default_rng(5)
  u = _updates(rng)
  w = np.array([1.0, 1.0, 1.0, 0.0, 1.0])
  eta, gamma, sigma_b, m = 0.3, 0.7, 0.8, 4.0
  agg = P.dp_mean(1.0, 1.0, expected_clients=m, adaptive=P.AdaptiveClipping(gamma, eta, sigma_b))
  state = agg.init(None)
  key = jax.random.key(11)
  _, new = agg.aggregate({k: jnp.asarray(v, jnp.float32) for k, v in u.items()}, jnp.asarray(w, jnp.float32),
                         state, key)
  z = float(jax.random.normal(jax.random.split(key)[1], (), jnp.float32))  # the count's draw
  _, norms = _numpy_clipped_sum(u, w, 1.0)
  want_clip, want_fraction = _numpy_adaptive(1.0, (norms <= 1.0).astype(float), (w > 0).astype(float), z, eta,
                                             gamma, sigma_b, m)
  np.testing.assert_allclose(new.noisy_fraction, want_fraction, rtol=1e-5)
  np.testing.assert_allclose(new.clip_norm, want_clip, rtol=1e-5)
  assert float(new.last_clip_norm) == 1.0


def test_update_noise_is_raised_so_the_pair_costs_sigma():
  sigma, sigma_b = 1.0, 2.0
  sigma_delta = P.update_noise_multiplier(sigma, sigma_b)
  np.testing.assert_allclose(sigma_delta ** -2 + (2 * sigma_b) ** -2, sigma ** -2, rtol=1e-12)
  # The aggregate's noise really has std σ_Δ C / m.
  agg = P.dp_mean(1.0, sigma, expected_clients=1.0, adaptive=P.AdaptiveClipping(0.5, 0.2, sigma_b))
  keys = jax.random.split(jax.random.key(9), 3000)
  noise = jax.jit(jax.vmap(lambda k: agg.aggregate({"p": jnp.zeros((1, 8))}, jnp.ones(1), agg.init(None), k)[0]
                           ["p"]))(keys)
  n = noise.size
  lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], n) / n
  assert lo < float(np.mean(np.asarray(noise, np.float64) ** 2)) / sigma_delta ** 2 < hi


@pytest.mark.parametrize("sigma,m,sigma_b", [(1.0, 10.0, 2.0), (0.1, 100.0, 5.0)])
def test_default_count_noise_is_m_over_20_floored_at_two_sigma(sigma, m, sigma_b):
  """count_noise_multiplier None: σ_b = max(m/20, 2σ): 2σ = 2 for σ = 1, m = 10 (the floor), m/20 = 5 for m = 100.
  The round's draws are transcribed (count: b̄ = (Σ (b_k − ½) + σ_b z_b)/m + ½; update: σ_Δ C z/m with
  σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), within 4% of σ at the floor)."""
  c, clip = 4, 0.5
  agg = P.dp_mean(clip, sigma, expected_clients=m, adaptive=P.AdaptiveClipping(0.5, 0.2))
  key = jax.random.key(21)
  out, new = jax.jit(agg.aggregate)({"p": jnp.zeros((c, 6), jnp.float32)}, jnp.ones(c, jnp.float32),
                                    agg.init(None), key)
  update_key, count_key = jax.random.split(key)
  z = np.asarray(jax.random.normal(jax.random.split(update_key, 1)[0], (6,), jnp.float32), np.float64)
  z_b = float(jax.random.normal(count_key, (), jnp.float32))
  np.testing.assert_allclose(new.noisy_fraction, (c * 0.5 + sigma_b * z_b) / m + 0.5, rtol=1e-5)
  sigma_delta = (sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5
  np.testing.assert_allclose(out["p"], sigma_delta * clip * z / m, rtol=1e-5)
  assert sigma_delta <= 1.04 * sigma


def test_adaptive_clipping_converges_to_the_target_quantile():
  """Updates with norms drawn from a fixed log-normal: C_t approaches the γ-quantile of that distribution."""
  c, gamma = 200, 0.7
  agg = P.dp_mean(0.05, 0.5, expected_clients=c, adaptive=P.AdaptiveClipping(gamma, 0.2, 5.0))
  direction = jnp.ones((c, 4)) / 2.0  # unit rows

  def round_(state, key):
    k1, k2 = jax.random.split(key)
    norms = jnp.exp(jax.random.normal(k1, (c,)))
    _, state = agg.aggregate({"p": direction * norms[:, None]}, jnp.ones(c), state, k2)
    return state, state.clip_norm

  _, clips = jax.jit(lambda s, ks: jax.lax.scan(round_, s, ks))(agg.init(None),
                                                               jax.random.split(jax.random.key(0), 400))
  target = np.exp(stats.norm.ppf(gamma))  # the γ-quantile of the log-normal norms
  np.testing.assert_allclose(np.mean(np.asarray(clips)[-100:]), target, rtol=0.06)


@pytest.mark.parametrize("call,needle", [
    (lambda: P.dp_mean(0.0, 1.0, expected_clients=10), "clip_norm must be a finite number > 0"),
    (lambda: P.dp_mean(1.0, -1.0, expected_clients=10), "noise_multiplier must be a finite number >= 0"),
    (lambda: P.dp_mean(1.0, 1.0, expected_clients=0), "expected_clients must be a finite number > 0"),
    (lambda: P.dp_mean("1", 1.0, expected_clients=1), "clip_norm must be a number"),
    (lambda: P.dp_mean(np.ones(2), 1.0, expected_clients=1), r"clip_norm must be a scalar; got shape \(2,\)"),
    (lambda: P.dp_mean(1.0, 1.0, expected_clients=10, adaptive=0.5), "adaptive must be None or"),
    (lambda: P.dp_mean(1.0, 1.0, expected_clients=10, adaptive=P.AdaptiveClipping(1.5)),
     "target_quantile must be in \\(0, 1\\)"),
    (lambda: P.dp_mean(1.0, 1.0, expected_clients=10, adaptive=P.AdaptiveClipping(0.5, -1.0)),
     "learning_rate must be a finite number > 0"),
    (lambda: P.dp_mean(1.0, 1.0, expected_clients=10, adaptive=P.AdaptiveClipping(0.5, 0.2, 0.5)),
     "needs 2σ_b > σ"),
])
def test_bad_arguments_are_named(call, needle):
  with pytest.raises((ValueError, TypeError), match=needle):
    call()
