"""Asynchronous aggregation, simulated exactly: a ring buffer of past models and an event-driven clock.

No threads: an asynchronous run is a sequence of server *events*, each a pure
function of the state, so a whole run is one `lax.scan` and is reproducible
bit for bit from its seed. The pieces every asynchronous algorithm of
`fedjax_opt.algorithms.asynchronous` shares live here, one idea a module:

* `history`: versions and the ring buffer of the last H server models
  (`ModelHistory`, `history_init`, `history_read`, `history_push`).
* `distributions`: compute times, latencies and staleness as
  `sample(key, shape)` functions (`constant`, `exponential`, `lognormal`,
  `uniform_staleness`), and a client's duration d_i = speed_i · c + l.
* `schedules`: how arrivals, staleness and the clock come about (`Schedule`,
  `Clock`, `Arrivals`; `wall_clock`, an exact event simulation of N clients,
  and `drawn_staleness`, staleness drawn at random).
* `staleness`: FedAsync's staleness functions s(t − τ) (`staleness_weight`).
* `events`: one server event (`run_event`): arrivals, clients training from
  the models they pulled, the algorithm's rule (`Rule`, `Arrival`,
  `Decision`) in arrival order, dispatch; its metrics
  (`event_metric_names`).
* `synchronous`: `synchronous_clock`, a synchronous algorithm on the same
  simulated clock, each round waiting for its slowest client.

What is not modelled: network contention, clients that go offline while in
flight, the server's own compute time (events take no time), and, with A > 1,
the wait of the earlier arrivals of an event (they are handled and restarted
at the event's time).
"""

from fedjax_opt.core.asynchrony.distributions import Sampler, constant, exponential, lognormal, uniform_staleness
from fedjax_opt.core.asynchrony.events import (Arrival, Decision, Event, Rule, event_metric_names,
                                               initial_event_metrics, run_event)
from fedjax_opt.core.asynchrony.history import ModelHistory, history_init, history_push, history_read
from fedjax_opt.core.asynchrony.schedules import (Arrivals, Clock, Schedule, check_schedule, drawn_staleness,
                                                  wall_clock)
from fedjax_opt.core.asynchrony.staleness import STALENESS_WEIGHTS, check_staleness_weight, staleness_weight
from fedjax_opt.core.asynchrony.synchronous import SYNCHRONOUS_CLOCK_METRICS, synchronous_clock

__all__ = [
    "STALENESS_WEIGHTS", "SYNCHRONOUS_CLOCK_METRICS", "Arrivals", "Clock", "ModelHistory", "Schedule", "constant",
    "drawn_staleness", "event_metric_names", "exponential", "history_init", "history_push", "history_read",
    "lognormal", "run_event", "staleness_weight", "synchronous_clock", "uniform_staleness", "wall_clock",
    # used by the algorithms built on the simulation
    "Arrival", "Decision", "Event", "Rule", "Sampler", "check_schedule", "check_staleness_weight",
    "initial_event_metrics",
]
