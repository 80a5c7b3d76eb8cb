"""One server event of an asynchronous run: arrivals, training from stale models, the rule, dispatch.

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

The library's rules for clients that take no step or send a non-finite
update (docs/architecture.md, "The round") apply to each arrival; here an
update whose resulting model is not finite counts as non-finite too, so the
model never becomes non-finite. An update whose pulled model has left the
ring buffer (`history.py`) is discarded and counted in `num_too_stale`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core.asynchrony.history import ModelHistory, history_push, history_read
from fedjax_opt.core.asynchrony.schedules import Clock, Schedule
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.server import client_is_finite
from fedjax_opt.core.tree import global_norm, select_tree, tree_bits
from fedjax_opt.core.types import ClientBatches, DeferredData, PyTree

__all__ = ["Arrival", "Decision", "Event", "Rule", "event_metric_names", "initial_event_metrics", "run_event"]


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
