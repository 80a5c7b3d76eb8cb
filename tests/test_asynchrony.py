"""The asynchronous simulation of `fedjax_opt.core.asynchrony`: schedules, the ring buffer, staleness weights.

References are hand-computed event lists and a plain-Python event simulation (a heap of finish times), never the
code under test.
"""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt.core import asynchrony as asy


def _batches(n):
  """Every one of n clients, one step of one example (the schedule tests only read ids and weights)."""
  return fo.ClientBatches(data={"x": jnp.zeros((n, 1, 1, 1))}, mask=jnp.ones((n, 1, 1), bool),
                          weight=jnp.ones((n,)), client_id=jnp.arange(n, dtype=jnp.int32))


def _drive(schedule, num_clients, events, *, bumps=lambda i: True, seed=0):
  """Runs the schedule alone for `events` events; the version goes up by one when `bumps(event)`.

  Returns per event: (arriving ids, arrival times, staleness v − p at the event's start, clock after).
  """
  key = jax.random.key(seed)
  clock = schedule.init(num_clients, key)
  batches, version, out = _batches(num_clients), 0, []
  for e in range(events):
    key, k1, k2 = jax.random.split(key, 3)
    arr = schedule.arrivals(clock, jnp.int32(version), batches, k1)
    staleness = version - np.asarray(arr.pulled)
    version += int(bumps(e)) * len(np.asarray(arr.client_id))
    clock = schedule.dispatch(clock, arr, jnp.int32(version), k2)
    out.append((np.asarray(arr.client_id).tolist(), np.asarray(arr.time).tolist(), staleness.tolist(),
                float(clock.time)))
  return out


def test_wall_clock_matches_a_hand_computed_schedule():
  """Speeds 1, 2, 3 and unit compute time: client i arrives every i+1 time units; ties go to the lower id."""
  schedule = asy.wall_clock(asy.constant(1.0), speed=jnp.array([1.0, 2.0, 3.0]))
  events = _drive(schedule, 3, 7)
  assert [e[0][0] for e in events] == [0, 0, 1, 0, 2, 0, 1]
  assert [e[1][0] for e in events] == [1, 2, 2, 3, 3, 4, 4]
  # Every arrival is a server update: client 1 pulled version 0 at time 0 and arrives after 2 updates, etc.
  assert [e[2][0] for e in events] == [0, 0, 2, 1, 4, 1, 3]
  assert [e[3] for e in events] == [1, 2, 2, 3, 3, 4, 4]


def _heap_reference(durations, events, latency=0.0):
  """A plain event simulation: all clients in flight, one arrival per event, a server update per arrival."""
  heap = [(d + latency, i) for i, d in enumerate(durations)]
  heapq.heapify(heap)
  pulled, version, out = [0] * len(durations), 0, []
  for _ in range(events):
    t, i = heapq.heappop(heap)
    out.append((i, t, version - pulled[i]))
    version += 1
    pulled[i] = version
    heapq.heappush(heap, (t + durations[i] + latency, i))
  return out


def test_wall_clock_agrees_with_a_heap_event_simulation():
  rng = np.random.default_rng(3)
  speeds = rng.uniform(0.5, 3.0, size=6)
  with jax.enable_x64(True):
    schedule = asy.wall_clock(asy.constant(0.7), latency=asy.constant(0.25), speed=jnp.asarray(speeds))
    events = _drive(schedule, 6, 40)
  ref = _heap_reference(list(0.7 * speeds), 40, latency=0.25)
  assert [e[0][0] for e in events] == [r[0] for r in ref]
  np.testing.assert_allclose([e[1][0] for e in events], [r[1] for r in ref], rtol=1e-12)
  assert [e[2][0] for e in events] == [r[2] for r in ref]


def test_an_event_of_several_arrivals_happens_at_the_latest_and_restarts_them_there():
  schedule = asy.wall_clock(asy.constant(1.0), speed=jnp.array([1.0, 2.0, 5.0]), arrivals_per_step=2)
  events = _drive(schedule, 3, 3, bumps=lambda e: False)
  # time 0: finish (1, 2, 5). Event 1: clients 0 and 1 at time 2; restart at 2 -> (3, 4, 5).
  assert events[0][:2] == ([0, 1], [1.0, 2.0]) and events[0][3] == 2.0
  assert events[1][:2] == ([0, 1], [3.0, 4.0]) and events[1][3] == 4.0
  assert events[2][:2] == ([0, 2], [5.0, 5.0]) and events[2][3] == 5.0


def test_limited_concurrency_keeps_m_clients_in_flight_and_dispatches_idle_ones():
  n, m = 6, 2
  schedule = asy.wall_clock(asy.exponential(1.0), concurrency=m)
  key = jax.random.key(1)
  clock = schedule.init(n, key)
  batches, seen = _batches(n), set()
  for version in range(60):
    in_flight = np.isfinite(np.asarray(clock.finish_time))
    assert in_flight.sum() == m
    seen |= set(np.flatnonzero(in_flight).tolist())
    key, k1, k2 = jax.random.split(key, 3)
    arr = schedule.arrivals(clock, jnp.int32(version), batches, k1)
    new = schedule.dispatch(clock, arr, jnp.int32(version + 1), k2)
    started = np.flatnonzero(np.isfinite(np.asarray(new.finish_time)) & ~in_flight)
    started = started if started.size else np.asarray(arr.client_id)  # the arrived client drew itself again
    assert started.size == 1 and int(np.asarray(new.pulled)[started[0]]) == version + 1
    assert float(np.asarray(new.finish_time)[started[0]]) >= float(new.time) == float(arr.event_time)
    clock = new
  assert seen == set(range(n))


def test_drawn_staleness_pulls_v_minus_tau_clipped_at_zero_and_skips_zero_weight_rows():
  taus = jnp.array([0, 3, 9, 1], jnp.int32)
  schedule = asy.drawn_staleness(lambda key, shape: taus)
  batches = _batches(4).replace(weight=jnp.array([1.0, 1.0, 1.0, 0.0]))
  clock = schedule.init(4, jax.random.key(0))
  arr = schedule.arrivals(clock, jnp.int32(5), batches, jax.random.key(1))
  np.testing.assert_array_equal(arr.pulled, [5, 2, 0, 4])
  np.testing.assert_array_equal(arr.rows, [0, 1, 2, 3])
  np.testing.assert_array_equal(arr.present, [True, True, True, False])
  assert float(schedule.dispatch(clock, arr, jnp.int32(5), jax.random.key(2)).time) == 1.0


def test_ring_buffer_holds_exactly_the_last_h_versions():
  h = 3
  history = asy.history_init({"w": jnp.zeros(2)}, h)
  for v in range(1, 6):
    history = asy.history_push(history, {"w": jnp.full(2, float(v))}, jnp.int32(v), jnp.bool_(True))
  history = asy.history_push(history, {"w": jnp.full(2, 99.0)}, jnp.int32(6), jnp.bool_(False))  # not pushed
  models, held = asy.history_read(history, jnp.arange(7, dtype=jnp.int32))
  np.testing.assert_array_equal(held, [False, False, False, True, True, True, False])
  np.testing.assert_array_equal(np.asarray(models["w"])[3:6, 0], [3.0, 4.0, 5.0])


@pytest.mark.parametrize("a,b", [(0.5, 2), (1.0, 0), (2.0, 4)])
def test_staleness_weights_match_the_formulas(a, b):
  s = np.arange(12)
  with jax.enable_x64(True):
    np.testing.assert_array_equal(asy.staleness_weight("constant", s), np.ones(12))
    np.testing.assert_allclose(asy.staleness_weight("polynomial", s, a), (s + 1.0) ** (-a), rtol=1e-14)
    ref = np.array([1.0 if si <= b else 1.0 / (a * (si - b) + 1.0) for si in s])
    np.testing.assert_allclose(asy.staleness_weight("hinge", s, a, b), ref, rtol=1e-14)
    # the hinge's boundary: weight 1 at t − τ = b exactly, 1/(a + 1) one step later
    assert float(asy.staleness_weight("hinge", jnp.int32(b), a, b)) == 1.0
    assert float(asy.staleness_weight("hinge", jnp.int32(b + 1), a, b)) == pytest.approx(1 / (a + 1), rel=1e-14)


@pytest.mark.parametrize("times", [asy.exponential(2.0), asy.lognormal(0.0, 1.0)])
def test_the_same_seed_gives_the_same_schedule_bit_for_bit(times):
  schedule = asy.wall_clock(times, speed=jnp.array([1.0, 3.0, 0.5, 2.0]), concurrency=3)
  first, again = _drive(schedule, 4, 25, seed=7), _drive(schedule, 4, 25, seed=7)
  assert first == again
  assert first != _drive(schedule, 4, 25, seed=8)
  assert all(t >= 0 for e in first for t in e[1])


def test_bad_schedules_raise_clear_errors():
  with pytest.raises(ValueError, match="arrivals_per_step must be <= concurrency"):
    asy.wall_clock(concurrency=2, arrivals_per_step=3)
  with pytest.raises(TypeError, match="compute_time must be a distribution"):
    asy.wall_clock(1.0)
  with pytest.raises(ValueError, match="speed must be finite and > 0"):
    asy.wall_clock(speed=jnp.array([1.0, -1.0]))
  with pytest.raises(ValueError, match=r"speed must have one factor per client.*\(3,\)"):
    asy.wall_clock(speed=jnp.ones(2)).init(3, jax.random.key(0))
  with pytest.raises(ValueError, match="concurrency <= num_clients"):
    asy.wall_clock(concurrency=5).init(3, jax.random.key(0))
  with pytest.raises(ValueError, match="staleness_weight must be one of"):
    asy.staleness_weight("linear", jnp.int32(1))
  with pytest.raises(ValueError, match="mean must be finite and > 0"):
    asy.exponential(0.0)
  schedule = asy.wall_clock(asy.constant(1.0), speed=jnp.array([1.0, 2.0, 3.0]))
  clock = schedule.init(3, jax.random.key(0))
  with pytest.raises(ValueError, match=r"clients \[0\] arrive in this event and are not in batches"):
    schedule.arrivals(clock, jnp.int32(0), _batches(3).replace(client_id=jnp.array([1, 2, 2], jnp.int32)),
                      jax.random.key(0))
