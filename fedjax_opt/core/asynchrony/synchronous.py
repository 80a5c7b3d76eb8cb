"""A synchronous algorithm on the simulated clock: the baseline an asynchronous run is drawn against.

`synchronous_clock` wraps any round-based `FederatedAlgorithm`: each round
waits for its slowest participating client, whose duration is drawn as in the
`wall_clock` schedule (`distributions.client_times`), and the simulated time
is added to the metrics without touching the training itself.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.asynchrony.distributions import Sampler, client_times, time_dtype

__all__ = ["SYNCHRONOUS_CLOCK_METRICS", "synchronous_clock"]


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
  durations, speeds_for = client_times(compute_time, latency, speed)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(f"seed must be a Python int; got {type(seed).__name__}.")

  def init(params, key):
    state = algorithm.init(params, key)
    zeros = {name: jnp.zeros((), time_dtype()) for name in SYNCHRONOUS_CLOCK_METRICS}
    return state.replace(metrics={**state.metrics, **zeros})

  def step(state, batches):
    new = algorithm.step(state, batches)
    ids = jnp.asarray(batches.client_id, jnp.int32)
    slot_speeds = jnp.ones(ids.shape, time_dtype()) if speed is None else speeds_for(jnp.shape(speed)[0])[ids]
    draws = durations(jax.random.fold_in(jax.random.key(int(seed)), state.round), jnp.arange(ids.shape[0]),
                      slot_speeds)
    duration = jnp.max(jnp.where(batches.weight > 0, draws, jnp.zeros_like(draws)))
    return new.replace(metrics={**new.metrics, "simulated_time": state.metrics["simulated_time"] + duration,
                                "round_duration": duration})

  return algorithm._replace(init=init, step=step)
