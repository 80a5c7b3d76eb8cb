"""Asynchronous aggregation, simulated exactly: a ring buffer of past models and an event-driven clock.

No threads: an asynchronous run is a sequence of server *events*, each a pure
function of the state, so a whole run is one `lax.scan` and is reproducible
bit for bit from its seed. The pieces every asynchronous algorithm of
`fedjax_opt.algorithms.asynchronous` shares live here.

Versions and the ring buffer. The server model x_v carries a version v, the
number of server updates applied so far (x_0 is the initial model). The
state keeps the last H server models in a ring buffer (`ModelHistory`,
leaves `[H, ...]`): slot v mod H holds x_v, and `versions[slot]` says which
version it holds. A client that pulled version p trains from x_p, read from
the buffer when its update arrives. Its *staleness* when the server uses its
update at version v is v − p, the number of server updates between its pull
and that use (0: nothing happened in between). An update whose model x_p is
no longer in the buffer (v − p ≥ H when the event starts) cannot be computed:
it is discarded and counted in `metrics["num_too_stale"]`; its client is
dispatched again as if it had delivered.

One `step` is one server event (`run_event`):

    1. the schedule names the event's A arrivals, in time order, with the
       version each pulled and the time it arrives;
    2. each arriving client's data is its row of the step's `ClientBatches`;
       it trains from x_p (read from the buffer) through the library's client
       map (`core.client_map`), all A clients at once;
    3. the server takes the A updates one by one in arrival order (a
       `lax.scan`): the algorithm's rule may change the model and bump the
       version (the new model is then pushed into the buffer);
    4. the arrived clients are replaced (the schedule dispatches A clients,
       which pull the model at the end of the event) and the clock advances
       to the event's time.

Rules, as in `core.rounds.client_round`: a client that took no local step (no
real example in its rows, or weight 0) sends nothing and is not counted; a
client whose update (or resulting model) is not finite is dropped and counted
in `num_nonfinite`, and the model never becomes non-finite.

Schedules (`Schedule`): how arrivals, staleness and the clock come about.

* `wall_clock(compute_time, ...)`: an exact event simulation over the N
  clients. M = `concurrency` clients are in flight at any time, each with its
  finish time and the version it pulled (`Clock.finish_time`, `Clock.pulled`,
  `[N]`). A dispatched client i needs d_i = speed_i · c + l, with c drawn
  from `compute_time` and l from `latency`, so it arrives at (dispatch time +
  d_i). Each event takes the A = `arrivals_per_step` in-flight clients that
  finish first (ties: lower client id first); the event happens at the
  latest of their finish times (the server waits until A updates are in,
  then handles them; with A = 1 every arrival is its own event). The A
  replacements are drawn uniformly among the clients not in flight (the
  arrived ones included), pull the model at the end of the event and start at
  the event's time. With M = N (the default) the arrived clients restart
  themselves. The batches must hold every arriving client: row c of the
  batches is client `batches.client_id[c]`, found by id (`client_sampling="all"`
  of `fo.data.sample_round` gives every client every step; rows of
  clients that do not arrive are not used).
* `drawn_staleness(staleness)`: no clock of clients: every row of the batches
  with weight > 0 arrives, in row order, and its pulled version is
  p = max(v − τ, 0) with τ drawn from `staleness` (v the version at the
  event's start). The clock advances by one per event. This is the
  simulation of Xie et al.'s FedAsync experiments (staleness drawn at random).

Distributions are plain functions `sample(key, shape) -> array`: `constant`,
`exponential`, `lognormal` for times (non-negative floats), `uniform_staleness`
for staleness (non-negative ints), or any function of that form.

What is not modelled: network contention, clients that go offline while in
flight, the server's own compute time (events take no time), and, with A > 1,
the wait of the earlier arrivals of an event (they are handled and restarted
at the event's time).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.server import client_is_finite
from fedjax_opt.core.tree import global_norm, select_tree, tree_bits
from fedjax_opt.core.types import ClientBatches, DeferredData, PyTree
from fedjax_opt.core.validation import check_choice, check_int, check_positive, check_scalar, is_concrete

__all__ = [
    "STALENESS_WEIGHTS", "SYNCHRONOUS_CLOCK_METRICS", "Arrivals", "Clock", "ModelHistory", "Schedule", "constant",
    "drawn_staleness", "event_metric_names", "exponential", "history_init", "history_push", "history_read",
    "lognormal", "run_event", "staleness_weight", "synchronous_clock", "uniform_staleness", "wall_clock",
]

Sampler = Callable[[jax.Array, tuple], jax.Array]
"""A distribution: `sample(key, shape) -> array of draws`."""

STALENESS_WEIGHTS = ("constant", "polynomial", "hinge")


# ----------------------------------------------------------------------------------------------------------------
# Distributions.


def constant(value: float) -> Sampler:
  """Always `value` (a deterministic compute time or latency)."""
  check_positive(value, "value", allow_zero=True)
  return lambda key, shape: jnp.full(shape, value, jnp.result_type(float))


def exponential(mean: float) -> Sampler:
  """Exponential times with the given mean."""
  check_positive(mean, "mean")
  return lambda key, shape: mean * jax.random.exponential(key, shape, jnp.result_type(float))


def lognormal(mu: float, sigma: float) -> Sampler:
  """exp(mu + sigma·Z), Z standard normal: heavy-tailed times with median e^mu."""
  check_positive(sigma, "sigma", allow_zero=True)
  return lambda key, shape: jnp.exp(mu + sigma * jax.random.normal(key, shape, jnp.result_type(float)))


def uniform_staleness(max_staleness: int) -> Sampler:
  """Staleness τ uniform on {0, 1, …, max_staleness} (for `drawn_staleness`)."""
  max_staleness = check_int(max_staleness, "max_staleness", 0)
  return lambda key, shape: jax.random.randint(key, shape, 0, max_staleness + 1, jnp.int32)


def _check_sampler(sample: Any, name: str) -> Sampler:
  if not callable(sample):
    raise TypeError(f"{name} must be a distribution sample(key, shape) -> array (e.g. "
                    f"fedjax_opt.core.asynchrony.exponential(1.0)); got {type(sample).__name__}.")
  return sample


# ----------------------------------------------------------------------------------------------------------------
# Staleness weights.


def staleness_weight(kind: str, staleness: jax.Array, a: Any = 0.5, b: Any = 4) -> jax.Array:
  """s(t − τ), the weight of an update of staleness t − τ (Xie, Koyejo, Gupta 2019, Section 5.2).

      constant:    s = 1
      polynomial:  s = (t − τ + 1)^(−a)
      hinge:       s = 1 if t − τ ≤ b, else 1 / (a (t − τ − b) + 1)

  Args:
    kind: "constant", "polynomial" or "hinge".
    staleness: t − τ ≥ 0 (any shape, integer or float).
    a, b: the function's parameters (a > 0; b ≥ 0 for "hinge").

  Returns:
    The weights, float, shaped like `staleness`.
  """
  check_choice(kind, "staleness_weight", STALENESS_WEIGHTS)
  s = jnp.asarray(staleness).astype(jnp.result_type(float))
  if kind == "constant":
    return jnp.ones_like(s)
  if kind == "polynomial":
    return jnp.power(s + 1, -jnp.asarray(a, s.dtype))
  return jnp.where(s <= b, jnp.ones_like(s), 1 / (a * jnp.maximum(s - b, 0) + 1))


def check_staleness_weight(kind: Any, a: Any, b: Any) -> None:
  """Clear errors for a staleness function and its parameters (used by the factories)."""
  check_choice(kind, "staleness_weight", STALENESS_WEIGHTS)
  if kind != "constant":
    check_scalar(a, "a")
    check_positive(a, "a")
  if kind == "hinge":
    check_scalar(b, "b")
    check_positive(b, "b", allow_zero=True)


# ----------------------------------------------------------------------------------------------------------------
# The ring buffer of server models.


class ModelHistory(NamedTuple):
  """The last H server models.

  Attributes:
    models: pytree like the model, leaves `[H, ...]`; slot v mod H holds x_v.
    versions: `[H]` int32, the version each slot holds (−1: empty).
  """

  models: PyTree
  versions: jax.Array


def history_init(params: PyTree, size: int) -> ModelHistory:
  """A buffer of `size` slots holding x_0 in slot 0."""
  models = jax.tree.map(lambda p: jnp.zeros((size,) + jnp.shape(p), jnp.result_type(p)).at[0].set(p), params)
  versions = jnp.full((size,), -1, jnp.int32).at[0].set(0)
  return ModelHistory(models, versions)


def history_read(history: ModelHistory, versions: jax.Array) -> tuple[PyTree, jax.Array]:
  """`(models [A, ...], held [A])`: x_p for each version p, and whether the buffer still holds it.

  Where `held` is False the model read is another version's (or zeros) and must not be used.
  """
  size = history.versions.shape[0]
  slots = jnp.mod(versions, size)
  held = (history.versions[slots] == versions) & (versions >= 0)
  return jax.tree.map(lambda m: m[slots], history.models), held


def history_push(history: ModelHistory, params: PyTree, version: jax.Array, push: jax.Array) -> ModelHistory:
  """Stores x_version in slot version mod H when `push` is True (the oldest version there is forgotten)."""
  slot = jnp.mod(version, history.versions.shape[0])
  models = jax.tree.map(lambda m, p: m.at[slot].set(jnp.where(push, p.astype(m.dtype), m[slot])),
                        history.models, params)
  versions = history.versions.at[slot].set(jnp.where(push, version, history.versions[slot]))
  return ModelHistory(models, versions)


# ----------------------------------------------------------------------------------------------------------------
# Schedules.


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


def _time_dtype() -> Any:
  return jnp.result_type(float)


def _client_times(compute_time: Sampler | None, latency: Sampler | None, speed: Any) -> tuple[Callable, Callable]:
  """(durations, speeds_for): `durations(key, ids, speeds)` draws speed_i · c + l for the clients `ids`
  (c ~ `compute_time`, default `exponential(1.0)`; l ~ `latency`, default none); `speeds_for(N)` is the
  `[N]` speed factors (checked against N)."""
  compute_time = exponential(1.0) if compute_time is None else _check_sampler(compute_time, "compute_time")
  latency = None if latency is None else _check_sampler(latency, "latency")
  if speed is not None:
    if jnp.ndim(speed) != 1:
      raise ValueError(f"speed must be a [num_clients] array of per-client factors; got shape "
                       f"{tuple(jnp.shape(speed))}.")
    check_positive(speed, "speed")

  def durations(key, ids, speeds):
    compute_key, latency_key = jax.random.split(key)
    d = speeds[ids] * compute_time(compute_key, ids.shape).astype(_time_dtype())
    if latency is not None:
      d = d + latency(latency_key, ids.shape).astype(_time_dtype())
    return d

  def speeds_for(num_clients):
    if speed is None:
      return jnp.ones((num_clients,), _time_dtype())
    if jnp.shape(speed)[0] != num_clients:
      raise ValueError(f"speed must have one factor per client, shape [num_clients] = ({num_clients},); got "
                       f"shape {tuple(jnp.shape(speed))}.")
    return jnp.asarray(speed, _time_dtype())

  return durations, speeds_for


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
  durations, speeds_for = _client_times(compute_time, latency, speed)
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
    finish = jnp.full((num_clients,), jnp.inf, _time_dtype())
    finish = finish.at[first].set(durations(time_key, first, speeds_for(num_clients)))
    return Clock(time=jnp.zeros((), _time_dtype()), finish_time=finish,
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
  staleness = uniform_staleness(4) if staleness is None else _check_sampler(staleness, "staleness")

  def init(num_clients, key):
    del num_clients, key
    return Clock(time=jnp.zeros((), _time_dtype()), finish_time=jnp.zeros((0,), _time_dtype()),
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


SYNCHRONOUS_CLOCK_METRICS = ("simulated_time", "round_duration")
"""The metrics `synchronous_clock` adds to a synchronous algorithm's (the default float dtype)."""


def synchronous_clock(
    algorithm: Any,
    compute_time: Sampler | None = None,
    *,
    latency: Sampler | None = None,
    speed: Any = None,
    seed: int = 0,
) -> Any:
  """A synchronous algorithm on the simulated clock of `wall_clock`: each round waits for its slowest client.

  The baseline an asynchronous run is drawn against: round r's participating
  clients (weight > 0) need d_k = speed_k · c_k + l_k, with c and l drawn as
  in `wall_clock`, and the server waits for the last of them, so

      round_duration_r = max_{k : w_k > 0} d_k,     simulated_time_r = Σ_{r' ≤ r} round_duration_r'.

  (0 for a round in which no client takes part.) The draws of round r come
  from `fold_in(key(seed), r)`, independent of the training's own keys, so
  the wrapped algorithm's states are the unwrapped one's bit for bit; only
  `state.metrics` gains `simulated_time` and `round_duration`.

  Args:
    algorithm: a `FederatedAlgorithm` whose state is a dataclass with `round`
      and `metrics` (every round-based algorithm of `fedjax_opt.algorithms`).
    compute_time, latency, speed: as in `wall_clock` (default compute time
      `exponential(1.0)`, no latency, speed 1); `speed` is indexed by
      `batches.client_id`.
    seed: int seed of the clock's draws.

  Returns:
    The `FederatedAlgorithm` with the clock in its metrics.
  """
  durations, speeds_for = _client_times(compute_time, latency, speed)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(f"seed must be a Python int; got {type(seed).__name__}.")

  def init(params, key):
    state = algorithm.init(params, key)
    zeros = {name: jnp.zeros((), _time_dtype()) for name in SYNCHRONOUS_CLOCK_METRICS}
    return state.replace(metrics={**state.metrics, **zeros})

  def step(state, batches):
    new = algorithm.step(state, batches)
    ids = jnp.asarray(batches.client_id, jnp.int32)
    slot_speeds = jnp.ones(ids.shape, _time_dtype()) if speed is None else speeds_for(jnp.shape(speed)[0])[ids]
    draws = durations(jax.random.fold_in(jax.random.key(int(seed)), state.round), jnp.arange(ids.shape[0]),
                      slot_speeds)
    duration = jnp.max(jnp.where(batches.weight > 0, draws, jnp.zeros_like(draws)))
    return new.replace(metrics={**new.metrics, "simulated_time": state.metrics["simulated_time"] + duration,
                                "round_duration": duration})

  return algorithm._replace(init=init, step=step)


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


# ----------------------------------------------------------------------------------------------------------------
# One server event.


class Arrival(NamedTuple):
  """One arriving update, as the algorithm's rule sees it (inside the scan over the event's arrivals).

  Attributes:
    delta: Δ = x_new − x_p, the client's update.
    model: x_new = x_p + Δ, the client's trained model.
    result: the client's `LocalResult` (its loss and example count).
    staleness: scalar int32, v − p at the moment the server takes the update.
    client_id: scalar int32.
  """

  delta: PyTree
  model: PyTree
  result: LocalResult
  staleness: jax.Array
  client_id: jax.Array


class Decision(NamedTuple):
  """What an algorithm's rule returns for one arrival.

  Attributes:
    params: the server model after the update.
    server: the algorithm's own server state after it.
    accepted: scalar bool: the update was used (FedBuff: buffered; Zeno++: passed the test).
    bumped: scalar bool: the server model changed version (it is pushed into the buffer).
  """

  params: PyTree
  server: Any
  accepted: jax.Array
  bumped: jax.Array


Rule = Callable[[PyTree, Any, jax.Array, Arrival], Decision]
"""`rule(params, server, version, arrival) -> Decision`: an algorithm's server rule for one arrival."""

_EVENT_METRICS = {
    "simulated_time": jnp.float32,
    "staleness_mean": jnp.float32,
    "staleness_max": jnp.int32,
    "num_arrivals": jnp.int32,
    "num_too_stale": jnp.int32,
    "num_missing": jnp.int32,
    "num_rejected": jnp.int32,
    "version": jnp.int32,
}
"""What every asynchronous algorithm reports besides `core.server.ROUND_METRICS` (`event_metric_names`)."""


def event_metric_names() -> dict[str, Any]:
  """The metrics of `run_event` and their dtypes: `ROUND_METRICS` plus the event's own (module docstring).

  * client_loss, num_examples: over the updates the server used;
  * update_norm: ‖x after − x before‖ over the event;
  * num_clients: updates used (accepted by the rule); round_accepted: at least one was;
  * num_nonfinite: arriving clients dropped for a non-finite update or model;
  * bits_up / bits_down: the bits of one arrival's update / of the model it pulled (every bit of each);
  * simulated_time: the clock after the event; version: the server version after it;
  * staleness_mean / staleness_max: over the updates used (0 when none);
  * num_arrivals: arrivals handled (A, less the absent rows of `drawn_staleness`);
  * num_too_stale: arrivals whose pulled model had left the ring buffer (discarded);
  * num_missing: arrivals whose client was not in the batches (lost; only under jit);
  * num_rejected: finite arrivals the rule refused (Zeno++'s test, Co-op's age bound).
  """
  from fedjax_opt.core.server import ROUND_METRICS  # pylint: disable=import-outside-toplevel
  return {**ROUND_METRICS, **_EVENT_METRICS}


def initial_event_metrics() -> dict[str, jax.Array]:
  """Zeros with the structure and dtypes of `run_event`'s metrics, for `init`."""
  return {name: jnp.zeros((), dtype) for name, dtype in event_metric_names().items()}


class Event(NamedTuple):
  """What `run_event` hands back."""

  params: PyTree
  version: jax.Array
  history: ModelHistory
  server: Any
  clock: Clock
  metrics: dict[str, jax.Array]


def _take_rows(data: PyTree, rows: jax.Array) -> PyTree:
  """The batches' data at `rows` as arrays `[A, S, B, ...]`; a `DeferredData` gathers only those rows."""
  if isinstance(data, DeferredData):
    return DeferredData(data.source, jax.tree.map(lambda r: r[rows], data.refs), data.take).materialize()
  return jax.tree.map(lambda d: d[rows], data)


def run_event(
    schedule: Schedule,
    mode: client_map_lib.ClientMap | str | None,
    client_update: Callable[[PyTree, PyTree, jax.Array], LocalResult],
    rule: Rule,
    *,
    params: PyTree,
    version: jax.Array,
    history: ModelHistory,
    server: Any,
    clock: Clock,
    batches: ClientBatches,
    key: jax.Array,
) -> Event:
  """One server event (module docstring): arrivals → clients train from x_p → the rule, in order → dispatch.

  Args:
    schedule: the `Schedule`.
    mode: the client map.
    client_update: `client_update(x_p, data [S, B, ...], mask [S, B]) -> LocalResult` for one client.
    rule: the algorithm's server rule (`Rule`).
    params, version, history, server, clock: the state before the event.
    batches: the step's `ClientBatches`.
    key: this event's PRNG key.

  Returns:
    An `Event` with the state after it and its metrics.
  """
  arrivals_key, dispatch_key = jax.random.split(key)
  arrivals = schedule.arrivals(clock, version, batches, arrivals_key)
  starts, held = history_read(history, arrivals.pulled)
  data = _take_rows(batches.data, arrivals.rows)
  mask = batches.mask[arrivals.rows]
  weight = jnp.where(arrivals.present, batches.weight[arrivals.rows], jnp.zeros_like(batches.weight[arrivals.rows]))
  results = client_map_lib.map_clients(mode, lambda _, c: client_update(*c), None, (starts, data, mask))
  models = jax.tree.map(lambda s, d: (s + d).astype(s.dtype), starts, results.delta)
  takes_part = arrivals.present & (weight > 0) & (results.num_steps > 0)
  finite = client_is_finite(results.delta) & client_is_finite(models)
  usable = takes_part & held & finite

  def one(carry, inputs):
    params, version, history, server = carry
    ok, delta, model, result, pulled, client_id = inputs
    arrival = Arrival(delta, model, result, (version - pulled).astype(jnp.int32), client_id)
    decision = rule(params, server, version, arrival)
    new_finite = client_is_finite(jax.tree.map(lambda p: p[None], decision.params))[0]
    take = ok & new_finite
    accepted = take & decision.accepted
    bumped = take & decision.bumped
    params = select_tree(take, decision.params, params)
    server = select_tree(take, decision.server, server)
    version = version + bumped.astype(version.dtype)
    history = history_push(history, params, version, bumped)
    stats = (accepted, ok & ~new_finite, ok & new_finite & ~decision.accepted, arrival.staleness)
    return (params, version, history, server), stats

  inputs = (usable, results.delta, models, results, arrivals.pulled, arrivals.client_id)
  (new_params, new_version, new_history, new_server), stats = jax.lax.scan(
      one, (params, version, history, server), inputs)
  accepted, late_nonfinite, rejected, staleness = stats
  new_clock = schedule.dispatch(clock, arrivals, new_version, dispatch_key)
  n = jnp.where(accepted, results.num_examples, 0)
  used_staleness = jnp.where(accepted, staleness, 0)
  count = jnp.sum(accepted, dtype=jnp.int32)
  metrics = {
      "client_loss": jnp.sum(n * jnp.where(accepted, results.loss, 0)) / jnp.maximum(jnp.sum(n), 1),
      "update_norm": global_norm(jax.tree.map(lambda a, b: a - b, new_params, params)),
      "num_clients": count,
      "num_nonfinite": jnp.sum(takes_part & held & ~finite) + jnp.sum(late_nonfinite),
      "num_examples": jnp.sum(n),
      "round_accepted": count > 0,
      "bits_up": jnp.asarray(tree_bits(jax.tree.map(lambda d: jax.ShapeDtypeStruct(d.shape[1:], d.dtype),
                                                    results.delta)), jnp.float32),
      "bits_down": jnp.asarray(tree_bits(params), jnp.float32),
      "simulated_time": new_clock.time,
      "staleness_mean": jnp.sum(used_staleness) / jnp.maximum(count, 1),
      "staleness_max": jnp.max(used_staleness, initial=0),
      "num_arrivals": jnp.sum(arrivals.present | (schedule.name == "wall_clock")),
      "num_too_stale": jnp.sum(takes_part & ~held),
      "num_missing": jnp.sum(~arrivals.present) * (schedule.name == "wall_clock"),
      "num_rejected": jnp.sum(rejected),
      "version": new_version,
  }
  metrics = {name: metrics[name].astype(dtype) for name, dtype in event_metric_names().items()}
  return Event(new_params, new_version, new_history, new_server, new_clock, metrics)
