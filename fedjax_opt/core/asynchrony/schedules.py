"""Schedules: how arrivals, staleness and the clock come about.

A `Schedule` names each event's arrivals (`Arrivals`: which clients, the
version each pulled, when each arrives) and replaces the arrived clients
afterwards; its state is a `Clock`.

* `wall_clock(compute_time, ...)`: an exact event simulation over the N
  clients. M = `concurrency` clients are in flight at any time, each with its
  finish time and the version it pulled (`Clock.finish_time`, `Clock.pulled`,
  `[N]`). A dispatched client i needs d_i = speed_i · c + l, with c drawn
  from `compute_time` and l from `latency` (`distributions.py`), so it
  arrives at (dispatch time + d_i). Each event takes the A =
  `arrivals_per_step` in-flight clients that finish first (ties: lower client
  id first); the event happens at the latest of their finish times (the
  server waits until A updates are in, then handles them; with A = 1 every
  arrival is its own event). The A replacements are drawn uniformly among the
  clients not in flight (the arrived ones included), pull the model at the
  end of the event and start at the event's time. With M = N (the default)
  the arrived clients restart themselves. The batches must hold every
  arriving client: row c of the batches is client `batches.client_id[c]`,
  found by id (`client_sampling="all"` of `fo.data.sample_round` gives every
  client every step; rows of clients that do not arrive are not used).
* `drawn_staleness(staleness)`: no clock of clients: every row of the batches
  with weight > 0 arrives, in row order, and its pulled version is
  p = max(v − τ, 0) with τ drawn from `staleness` (v the version at the
  event's start). The clock advances by one per event. This is the
  simulation of Xie et al.'s FedAsync experiments (staleness drawn at random).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.asynchrony.distributions import (Sampler, check_sampler, client_times, time_dtype,
                                                      uniform_staleness)
from fedjax_opt.core.types import ClientBatches
from fedjax_opt.core.validation import check_int, is_concrete

__all__ = ["Arrivals", "Clock", "Schedule", "check_schedule", "drawn_staleness", "wall_clock"]


class Clock(NamedTuple):
  """The schedule's state.

  Attributes:
    time: scalar float, the simulated time of the last event (0 at the start).
    finish_time: `[N]` float, when each in-flight client's update arrives; +inf for a client not in flight
      (`wall_clock`; empty for `drawn_staleness`).
    pulled: `[N]` int32, the version each in-flight client pulled (`wall_clock`; empty otherwise).
  """

  time: jax.Array
  finish_time: jax.Array
  pulled: jax.Array


class Arrivals(NamedTuple):
  """The arrivals of one event, in the order the server handles them (leaves `[A]`).

  Attributes:
    client_id: the arriving clients.
    rows: each one's row in the step's `ClientBatches`.
    present: False where the batches do not hold the client (its update is lost, counted in `num_missing`).
    pulled: the version each one pulled.
    time: when each one arrives.
    event_time: scalar, the time of the event (the latest arrival).
  """

  client_id: jax.Array
  rows: jax.Array
  present: jax.Array
  pulled: jax.Array
  time: jax.Array
  event_time: jax.Array


class Schedule(NamedTuple):
  """How clients arrive. Built by `wall_clock` or `drawn_staleness`.

  Attributes:
    init: `init(num_clients, key) -> Clock`: clients dispatched at time 0 with version 0.
    arrivals: `arrivals(clock, version, batches, key) -> Arrivals`: the next event's arrivals.
    dispatch: `dispatch(clock, arrivals, version, key) -> Clock`: replaces the arrived clients, who pull
      `version`, and moves the clock to the event's time.
    name: "wall_clock" or "drawn_staleness".
  """

  init: Callable[[int, jax.Array], Clock]
  arrivals: Callable[[Clock, jax.Array, ClientBatches, jax.Array], Arrivals]
  dispatch: Callable[[Clock, Arrivals, jax.Array, jax.Array], Clock]
  name: str


def wall_clock(
    compute_time: Sampler | None = None,
    *,
    latency: Sampler | None = None,
    speed: Any = None,
    concurrency: int | None = None,
    arrivals_per_step: int = 1,
) -> Schedule:
  """An exact event simulation of N clients training concurrently (module docstring).

  A client dispatched at time T arrives at T + speed_i · c + l, c ~ `compute_time`, l ~ `latency`.

  Args:
    compute_time: distribution of a client's compute time at speed 1 (default `exponential(1.0)`).
    latency: distribution of the communication time added to it (default: none).
    speed: `[N]` per-client factors on the compute time (default: 1 for every client); checked against
      `num_clients` when the algorithm's state is made.
    concurrency: M, clients in flight at any time, 1 ≤ M ≤ N (default N).
    arrivals_per_step: A, arrivals handled by one event (one `step`), 1 ≤ A ≤ M.

  Returns:
    A `Schedule`.
  """
  durations, speeds_for = client_times(compute_time, latency, speed)
  arrivals_per_step = check_int(arrivals_per_step, "arrivals_per_step", 1)
  concurrency = None if concurrency is None else check_int(concurrency, "concurrency", 1)
  if concurrency is not None and arrivals_per_step > concurrency:
    raise ValueError(f"arrivals_per_step must be <= concurrency (an event handles clients in flight); got "
                     f"arrivals_per_step={arrivals_per_step}, concurrency={concurrency}.")

  def init(num_clients, key):
    m = num_clients if concurrency is None else concurrency
    if m > num_clients or arrivals_per_step > m:
      raise ValueError(f"wall_clock needs arrivals_per_step <= concurrency <= num_clients; got "
                       f"arrivals_per_step={arrivals_per_step}, concurrency={m}, num_clients={num_clients}.")
    pick_key, time_key = jax.random.split(key)
    first = jnp.arange(num_clients) if m == num_clients else jax.random.permutation(pick_key, num_clients)[:m]
    finish = jnp.full((num_clients,), jnp.inf, time_dtype())
    finish = finish.at[first].set(durations(time_key, first, speeds_for(num_clients)))
    return Clock(time=jnp.zeros((), time_dtype()), finish_time=finish,
                 pulled=jnp.zeros((num_clients,), jnp.int32))

  def arrivals(clock, version, batches, key):
    del version, key
    ids = jnp.argsort(clock.finish_time, stable=True)[:arrivals_per_step].astype(jnp.int32)
    rows, present = _rows_of(ids, batches)
    times = clock.finish_time[ids]
    return Arrivals(client_id=ids, rows=rows, present=present, pulled=clock.pulled[ids], time=times,
                    event_time=jnp.max(times))

  def dispatch(clock, arrived, version, key):
    num_clients = clock.finish_time.shape[0]
    pick_key, time_key = jax.random.split(key)
    idle = ~jnp.isfinite(clock.finish_time)
    idle = idle.at[arrived.client_id].set(True)
    score = jnp.where(idle, jax.random.uniform(pick_key, (num_clients,)), -1.0)
    _, new = jax.lax.top_k(score, arrivals_per_step)
    finish = clock.finish_time.at[arrived.client_id].set(jnp.inf)
    start = arrived.event_time
    finish = finish.at[new].set(start + durations(time_key, new, speeds_for(num_clients)))
    pulled = clock.pulled.at[new].set(version)
    return Clock(time=start, finish_time=finish, pulled=pulled)

  return Schedule(init, arrivals, dispatch, "wall_clock")


def drawn_staleness(staleness: Sampler | None = None) -> Schedule:
  """Every client of the step arrives, with a staleness τ drawn from `staleness` (module docstring).

  Args:
    staleness: distribution of τ, non-negative integers (default `uniform_staleness(4)`).

  Returns:
    A `Schedule`; one event per step, one time unit per event.
  """
  staleness = uniform_staleness(4) if staleness is None else check_sampler(staleness, "staleness")

  def init(num_clients, key):
    del num_clients, key
    return Clock(time=jnp.zeros((), time_dtype()), finish_time=jnp.zeros((0,), time_dtype()),
                 pulled=jnp.zeros((0,), jnp.int32))

  def arrivals(clock, version, batches, key):
    c = batches.num_clients
    tau = jnp.asarray(staleness(key, (c,))).astype(jnp.int32)
    event_time = clock.time + 1
    return Arrivals(client_id=batches.client_id.astype(jnp.int32), rows=jnp.arange(c, dtype=jnp.int32),
                    present=batches.weight > 0, pulled=jnp.maximum(version - jnp.maximum(tau, 0), 0),
                    time=jnp.full((c,), event_time), event_time=event_time)

  def dispatch(clock, arrived, version, key):
    del version, key
    return clock._replace(time=arrived.event_time)

  return Schedule(init, arrivals, dispatch, "drawn_staleness")


def _rows_of(ids: jax.Array, batches: ClientBatches) -> tuple[jax.Array, jax.Array]:
  """Each arriving client's row in the batches (the first one with its id) and whether it is there."""
  match = batches.client_id[None, :] == ids[:, None]
  present = jnp.any(match, axis=1)
  if is_concrete(present) and is_concrete(ids) and not bool(np.all(np.asarray(present))):
    missing = np.asarray(ids)[~np.asarray(present)]
    raise ValueError(f"batches must hold every arriving client (row c is client batches.client_id[c]); clients "
                     f"{missing.tolist()} arrive in this event and are not in batches.client_id = "
                     f"{np.asarray(batches.client_id).tolist()}. Sample every client each step "
                     "(client_sampling='all'), or use the drawn_staleness schedule.")
  return jnp.argmax(match, axis=1).astype(jnp.int32), present


def check_schedule(schedule: Any) -> Schedule:
  """Raises TypeError unless `schedule` is a `Schedule`; returns it."""
  if not isinstance(schedule, Schedule):
    raise TypeError(f"schedule must be a fedjax_opt.core.asynchrony.Schedule (wall_clock(...) or "
                    f"drawn_staleness(...)); got {type(schedule).__name__}.")
  return schedule
