"""Adaptive DP clipping inside secure aggregation: the ring's grid follows the clip norm C_t.

On a fixed grid of f fractional bits, `secure_aggregation(dp_mean(..., adaptive=...))` re-clips each client to
C_t − √P·2^−f, which is 0 once the adaptive C_t falls to √P·2^−f: every update was zeroed and the round accepted,
so training stopped silently. Now a round encodes the update coordinates with f + k_t bits, k_t the largest k ≥ 0
with C_t·2^k ≤ T = max(C_0, 2√P·2^−f) (`fo.privacy.secure.grid_extra_bits`). Checked here: the sums below the
old threshold against an independent float64 NumPy transcription of the quantized sum (the same rounding
uniforms), bit for bit; decoded clients stay within C_t; rounds with k_t = 0 are those of the fixed grid, bit for
bit; a round whose room still reaches 0 is rejected, never accepted; and the shape checks of `dp_mean` and
`secure_aggregation` name the leaf and the axis in one line.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.privacy import secure as S

P = fo.privacy

# P = 10⁴ coordinates at f = 8: √P·2^−f = 100/256 = 0.390625, the clip norm at which the fixed grid left nothing.
SIZE, F, C0, CLIENTS, M = 10_000, 8, 1.0, 4, 4.0
SLACK = math.sqrt(SIZE) * 2.0**-F


def _adaptive(eta=2.0, sigma=0.0):
  """secure_aggregation(dp_mean(C_0 = 1, σ, m = 4, adaptive γ = ½, η, σ_b = 10⁻⁶)), f = 8, B = 1."""
  dp = P.dp_mean(C0, sigma, expected_clients=M, adaptive=P.AdaptiveClipping(0.5, eta, 1e-6))
  return P.secure_aggregation(dp, frac_bits=F, bound=1.0)


@functools.cache
def _aggregate(eta=2.0):
  return jax.jit(_adaptive(eta).aggregate)


def _with_clip(state, clip):
  return state.replace(inner=state.inner.replace(clip_norm=jnp.float32(clip)))


def _reference_bits(clip_t: float, clip_0: float, size: int, f: int) -> int:
  """k_t in Python floats: the largest k >= 0 with C_t·2^k <= max(C_0, 2√P·2^−f), by counting up."""
  top = max(clip_0, 2 * math.sqrt(size) * 2.0**-f)
  k = 0
  while clip_t * 2.0**(k + 1) <= top:
    k += 1
  return k


def _reference_mean(x: np.ndarray, weights: np.ndarray, clip_t: float, key: jax.Array) -> tuple[np.ndarray, int]:
  """The secure dp_mean of updates `x` [C, P] that neither clip touches, in float64 NumPy: each member's
  coordinates q = ⌊x 2^(f+k)⌋ + 1[U < frac(x 2^(f+k))] with the uniforms U the encoder draws from the round key
  (the only thing taken from JAX), summed as integers, times 2^−(f+k), over m (σ = 0: no noise)."""
  k = _reference_bits(clip_t, C0, x.shape[1], F)
  room = clip_t - math.sqrt(x.shape[1]) * 2.0**-(F + k)
  member = weights > 0
  assert np.all(np.linalg.norm(x.astype(np.float64), axis=1)[member] < room)  # neither clip acts: exact inputs
  k_round = jax.random.split(jax.random.fold_in(key, S._DOMAIN), 3)[1]  # pylint: disable=protected-access
  uniforms = np.asarray(jax.random.uniform(k_round, (x.shape[0], x.shape[1] + 1), jnp.float32), np.float64)
  scaled = x.astype(np.float64) * 2.0**(F + k)
  low = np.floor(scaled)
  q = (low + (uniforms[:, :-1] < scaled - low)).astype(np.int64)
  total = np.sum(q[member], axis=0)
  return total * 2.0**-(F + k) / M, k


def test_the_grid_s_extra_bits_are_the_largest_k_with_c_t_times_2_to_the_k_within_t():
  """`grid_extra_bits` against counting up in Python floats, at powers of two (the edges), just around them, far
  below (10⁻³⁰: 99 bits; 10⁻³⁷: capped at 126 − f) and above C_0; 0 for a NaN. T = max(C_0, 2√P·2^−f): C_0 = 1 here."""
  cases = [2.0, 1.0, 0.75, 0.5 + 1e-7, 0.5, 0.5 - 1e-7, 0.390625, 0.25, 0.2, 2.0**-10, 3 * 2.0**-20, 1e-30, 1e-37]
  got = jax.jit(lambda c: S.grid_extra_bits(c, C0, SIZE, F))(jnp.asarray(cases, jnp.float32))
  want = [min(_reference_bits(float(np.float32(c)), C0, SIZE, F), 126 - F) for c in cases]
  np.testing.assert_array_equal(got, want)
  assert want[:5] == [0, 0, 0, 0, 1] and want[-2:] == [99, 126 - F]
  assert int(S.grid_extra_bits(jnp.float32(np.nan), C0, SIZE, F)) == 0
  # √P·2^−f ≥ C_0/2: T = 2√P·2^−f = 1.5625 > C_0 = 1 (C_0 = 1 at P = 10⁴, f = 7: √P·2^−f = 0.78).
  assert int(S.grid_extra_bits(jnp.float32(1.0), 1.0, SIZE, 7)) == 0
  assert int(S.grid_extra_bits(jnp.float32(0.7), 1.0, SIZE, 7)) == 1  # 1.4 <= 1.5625
  # The room C_t − √P·2^−(f+k) is > 0 and at least C_t·(1 − 2√P·2^−f / C_0) for every C_t down to the cap.
  clips = np.float32(C0) * np.exp(-np.linspace(0, 60, 400)).astype(np.float32)
  bits = np.asarray(jax.jit(lambda c: S.grid_extra_bits(c, C0, SIZE, F))(jnp.asarray(clips)))
  room = np.asarray(S.rounding_room(jnp.asarray(clips), SIZE, F + jnp.asarray(bits)), np.float64)
  assert np.all(room >= clips * (1 - 2 * SLACK / C0) * (1 - 1e-6)) and np.all(room > 0)


def test_adaptive_clipping_below_the_fixed_grid_s_threshold_keeps_the_updates_exact_against_numpy():
  """The reproduction: η = 2 and every client unclipped drive C_t down by e^−1 a round, past √P·2^−f = 0.39 (the
  fixed grid's room C_t − √P·2^−f is then 0, and every update came back 0). Each round's mean equals the float64
  NumPy transcription of the quantized sum exactly, with k_t extra bits once C_t ≤ C_0/2."""
  agg, aggregate = _adaptive(), _aggregate()
  rng = np.random.default_rng(0)
  state = agg.init({"w": jnp.zeros(SIZE)})
  assert int(state.frac_bits) == F and float(state.initial_clip_norm) == C0
  weights = np.array([1.0, 1.0, 0.0, 1.0, 1.0])  # a padding slot: not a member
  below = 0
  for r in range(8):
    clip_t = float(state.inner.clip_norm)
    # Updates well inside the room (no clip acts), of norm ~C_t/4, so each round's values sit on a different grid.
    x = rng.normal(size=(len(weights), SIZE)).astype(np.float32)
    x *= np.float32(clip_t / 4 / np.sqrt(SIZE))
    key = jax.random.key(r)
    out, new_state = aggregate({"w": jnp.asarray(x)}, jnp.asarray(weights), state, key)
    want, k = _reference_mean(x, weights, clip_t, key)
    np.testing.assert_array_equal(np.asarray(out["w"], np.float64), want.astype(np.float32))
    assert int(new_state.frac_bits) == F + k and int(new_state.num_clipped) == 0
    assert (k > 0) == (clip_t <= C0 / 2)
    if clip_t <= SLACK:  # the fixed grid would have clipped every update to 0 here
      below += 1
      assert float(S.rounding_room(clip_t, SIZE, F)) == 0.0
      assert np.abs(want).max() > 0 and np.max(np.abs(want - x[weights > 0].mean(0))) < 2.0**-(F + k)
    # The adaptive rule still sees every client unclipped: C_{t+1} = C_t·e^−(η(1 − ½)) (σ_b = 10⁻⁶).
    np.testing.assert_allclose(float(new_state.inner.clip_norm), clip_t * math.exp(-1.0), rtol=1e-5)
    state = new_state
  assert below == 7 and float(state.inner.clip_norm) < 1e-3  # C_8 = e^−8: 7 rounds below 0.39, 11 extra bits


def test_a_client_far_outside_a_tiny_clip_decodes_within_it():
  """DP's sensitivity at C_t = 10⁻³ (f = 8 alone would leave nothing): one client, 16 draws of a vector far
  outside C_t, decoded in float64, is on the grid of f + k_t bits, within C_t, within 2^−(f+k) per coordinate of
  the float64 transcription clipped to C_t − √P·2^−(f+k); the outward-rounded worst case too; nothing clipped
  by B = C_0."""
  clip_t = 1e-3
  dp = P.dp_mean(C0, 0.0, expected_clients=1.0, adaptive=P.AdaptiveClipping(0.5, 0.2, 1.0))
  agg = P.secure_aggregation(dp, frac_bits=F, bound=1.0)
  state = _with_clip(agg.init({"w": jnp.zeros(SIZE)}), clip_t)
  clip_t = float(np.float32(clip_t))
  k = _reference_bits(clip_t, C0, SIZE, F)
  assert k == 9  # 10⁻³·2⁹ = 0.512 <= 1 < 1.024: f_t = 17
  direction = np.random.default_rng(3).normal(size=SIZE)
  x = (3.0 * direction / np.linalg.norm(direction)).astype(np.float32)
  keys = jax.random.split(jax.random.key(5), 16)
  run = jax.jit(jax.vmap(lambda key: agg.aggregate({"w": jnp.asarray(x)[None]}, jnp.ones(1), state, key)))
  out, new_state = run(keys)
  decoded = np.asarray(out["w"], np.float64)
  np.testing.assert_array_equal(new_state.frac_bits, F + k)
  np.testing.assert_array_equal(new_state.num_clipped, 0)
  grid = decoded * 2.0**(F + k)
  assert np.all(grid == np.round(grid))
  assert np.linalg.norm(decoded, axis=1).max() <= clip_t
  room = clip_t - math.sqrt(SIZE) * 2.0**-(F + k)
  clipped = x.astype(np.float64) * room / np.linalg.norm(x.astype(np.float64))
  assert np.max(np.abs(decoded - clipped)) < 2.0**-(F + k) * (1 + 1e-3)
  worst = np.sign(clipped) * np.ceil(np.abs(clipped) * 2**(F + k)) * 2.0**-(F + k)
  assert np.linalg.norm(worst) <= clip_t
  # Not rounded away: the room is C_t − 0.39/2⁹ = 0.24 C_t, at least C_t·(1 − 2·0.39) for any C_t.
  assert np.linalg.norm(decoded, axis=1).min() > 0.2 * clip_t


def test_above_half_the_initial_clip_the_round_is_the_fixed_grid_s_bit_for_bit():
  """While C_t > C_0/2 (k_t = 0) the adaptive aggregator's round is, bit for bit, the one `dp_mean` with the fixed
  clip norm C_t gives (σ = 0; a fixed clip norm never refines its grid); at C_t ≤ C_0/2 the adaptive one encodes
  with f + 1 bits, and each is within its own grid's rounding of the float64 clipped mean."""
  rng = np.random.default_rng(1)
  x = {"w": jnp.asarray(rng.normal(size=(CLIENTS, SIZE)) * 0.02, jnp.float32)}  # norms ~2: all clipped
  weights = jnp.ones(CLIENTS)
  adaptive = _adaptive()
  base = adaptive.init({"w": jnp.zeros(SIZE)})
  for clip_t, same in [(C0, True), (0.75, True), (0.5 + 1e-3, True), (0.5, False), (0.45, False)]:
    fixed = P.secure_aggregation(P.dp_mean(clip_t, 0.0, expected_clients=M), frac_bits=F, bound=1.0)
    key = jax.random.key(7)
    got, got_state = _aggregate()(x, weights, _with_clip(base, clip_t), key)
    want, want_state = jax.jit(fixed.aggregate)(x, weights, fixed.init({"w": jnp.zeros(SIZE)}), key)
    assert int(want_state.frac_bits) == F
    if same:
      np.testing.assert_array_equal(got["w"], want["w"])
      assert int(got_state.frac_bits) == F
    else:
      assert int(got_state.frac_bits) == F + 1 and not np.array_equal(got["w"], want["w"])
      # Both are the clipped mean up to their grids: the finer one is closer to the float64 transcription.
      flat = np.asarray(x["w"], np.float64)
      norms = np.linalg.norm(flat, axis=1, keepdims=True)
      for bits, out in [(F + 1, got), (F, want)]:
        room = clip_t - math.sqrt(SIZE) * 2.0**-bits
        mean = np.sum(flat * room / norms, axis=0) / M
        assert np.max(np.abs(np.asarray(out["w"], np.float64) - mean)) <= CLIENTS * 2.0**-bits / M + 1e-7


def test_a_round_whose_room_would_still_be_0_is_rejected_not_accepted():
  """Past the cap of k_t (C_t = 10⁻³⁸ < T·2^−(126 − f)), or C_t = 0: the aggregate is NaN and the inner state
  unchanged, and FedAvg's non-finite guard rejects the round (`round_accepted` False, the model kept)."""
  agg, aggregate = _adaptive(), _aggregate()
  x = {"w": jnp.full((CLIENTS, SIZE), 1e-40, jnp.float32)}
  for clip_t in [0.0, 1e-38]:
    state = _with_clip(agg.init({"w": jnp.zeros(SIZE)}), clip_t)
    out, new_state = aggregate(x, jnp.ones(CLIENTS), state, jax.random.key(0))
    assert np.all(np.isnan(np.asarray(out["w"])))
    assert int(new_state.frac_bits) == 126
    for a, b in zip(jax.tree.leaves(new_state.inner), jax.tree.leaves(state.inner)):
      np.testing.assert_array_equal(a, b)
  # Through FedAvg: 2 parameters at f = 1 (√P·2^−f = 0.71 < C_0 = 1), C_t = 0.
  small = P.secure_aggregation(P.dp_mean(1.0, 0.0, expected_clients=2.0, adaptive=P.AdaptiveClipping(0.5, 0.2, 1.0)),
                               frac_bits=1, bound=1.0)
  loss = lambda params, batch: 0.5 * jnp.square(batch["x"] * params["w"] + params["b"] - batch["y"])
  algo = fo.algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1), aggregator=small)
  params = {"w": jnp.zeros(()), "b": jnp.zeros(())}
  state = algo.init(params, jax.random.key(0))
  state = state.replace(aggregator_state=_with_clip(state.aggregator_state, 0.0))
  batches = fo.ClientBatches(data={"x": jnp.ones((2, 1, 2)), "y": jnp.ones((2, 1, 2))}, mask=jnp.ones((2, 1, 2), bool),
                             weight=jnp.ones(2), client_id=jnp.arange(2, dtype=jnp.int32))
  new = jax.jit(algo.step)(state, batches)
  assert not bool(new.metrics["round_accepted"])
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)


def test_fedavg_keeps_training_once_the_adaptive_clip_falls_below_the_fixed_grid_s_room():
  """End to end: FedAvg on 4 clients of a 4,096-parameter linear model, f = 8 (√P·2^−f = 0.25), C_0 = 1, with
  small client steps so every update is unclipped and η = 2 shrinks C_t by e^−1 a round. Every round is
  accepted and moves the model, including the 6 rounds with C_t < 0.25, where the fixed grid zeroed every update."""
  d = 4095
  rng = np.random.default_rng(2)
  loss = lambda params, batch: 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])
  dp = P.dp_mean(C0, 0.0, expected_clients=4.0, adaptive=P.AdaptiveClipping(0.5, 2.0, 1e-6))
  agg = P.secure_aggregation(dp, frac_bits=F, bound=1.0)
  algo = fo.algorithms.fedavg(loss, client_optimizer=optax.sgd(1e-7), aggregator=agg)
  state = algo.init({"w": jnp.zeros(d), "b": jnp.zeros(())}, jax.random.key(0))
  x = rng.normal(size=(4, 1, 8, d)).astype(np.float32)
  y = (x @ rng.normal(size=d)).astype(np.float32)
  batches = fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.ones((4, 1, 8), bool),
                             weight=jnp.ones(4), client_id=jnp.arange(4, dtype=jnp.int32))
  step = jax.jit(algo.step)
  slack = math.sqrt(d + 1) * 2.0**-F
  below = 0
  for _ in range(8):
    clip_t = float(state.aggregator_state.inner.clip_norm)
    new = step(state, batches)
    assert bool(new.metrics["round_accepted"])
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)))
    assert moved > 0, clip_t
    below += clip_t < slack
    state = new
  assert below == 6 and int(state.aggregator_state.frac_bits) > F


# ------------------------------------------------------------------------------- one-line shape errors (item 6)

@pytest.mark.parametrize("make, prefix", [
    (lambda: P.dp_mean(1.0, 0.0, expected_clients=4.0), "dp_mean: "),
    (lambda: P.secure_aggregation(P.dp_mean(1.0, 0.0, expected_clients=4.0), bound=1.0), "secure_aggregation: "),
    (lambda: P.secure_aggregation(fo.aggregators.mean(), bound=1.0), "secure_aggregation: "),
], ids=["dp_mean", "secure_dp_mean", "secure_mean"])
def test_shapes_that_do_not_stack_on_the_weights_are_refused_in_one_line_naming_the_leaf_and_axis(make, prefix):
  agg = make()
  state = agg.init({"w": jnp.zeros((3,)), "b": jnp.zeros(())})
  good = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((4,))}
  # (updates, weights, what the one line must name): the leaf's path, axis 0, its shape and C; or the weights' shape.
  cases = [
      ({"w": jnp.zeros((4, 3)), "b": jnp.zeros((5,))}, jnp.ones(4), ["updates['b']", "axis 0", "(5,)", "C = 4"]),
      ({"w": jnp.zeros((3, 4)), "b": jnp.zeros((4,))}, jnp.ones(4), ["updates['w']", "axis 0", "(3, 4)", "C = 4"]),
      ({"w": jnp.zeros((4, 3)), "b": jnp.zeros(())}, jnp.ones(4), ["updates['b']", "no axis 0", "()"]),
      (good, jnp.ones((4, 1)), ["weights", "[C]", "(4, 1)"]),
      (good, jnp.ones(()), ["weights", "[C]", "got shape ()"]),
  ]
  for updates, weights, named in cases:
    for run in (agg.aggregate, jax.jit(agg.aggregate)):  # shapes: refused while tracing too
      with pytest.raises(ValueError) as info:
        run(updates, weights, state, jax.random.key(0))
      message = info.value.args[0]  # under jit JAX adds a note about its filtered traceback to str(error)
      assert message.startswith(prefix) and "\n" not in message and all(n in message for n in named), message
  out, _ = agg.aggregate(good, jnp.ones(4), state, jax.random.key(0))  # the right shapes still aggregate
  assert jax.tree.map(jnp.shape, out) == {"w": (3,), "b": ()}
