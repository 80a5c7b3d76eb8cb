"""How long a client takes, and how stale an update is: the simulation's distributions.

Distributions are plain functions `sample(key, shape) -> array`: `constant`,
`exponential`, `lognormal` for times (non-negative floats), `uniform_staleness`
for staleness (non-negative ints), or any function of that form.

A client's duration. A dispatched client i needs d_i = speed_i · c + l, with
c drawn from `compute_time` (default `exponential(1.0)`) and l from `latency`
(default none) (`client_times`, used by the `wall_clock` schedule and by
`synchronous_clock`). Times are in the default float dtype (`time_dtype`),
float64 under x64.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_opt.core.validation import check_int, check_positive

__all__ = ["Sampler", "check_sampler", "client_times", "constant", "exponential", "lognormal", "time_dtype",
           "uniform_staleness"]


Sampler = Callable[[jax.Array, tuple], jax.Array]
"""A distribution: `sample(key, shape) -> array of draws`."""


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


def check_sampler(sample: Any, name: str) -> Sampler:
  """Raises TypeError unless `sample` is callable (a distribution); returns it."""
  if not callable(sample):
    raise TypeError(f"{name} must be a distribution sample(key, shape) -> array (e.g. "
                    f"fedjax_opt.core.asynchrony.exponential(1.0)); got {type(sample).__name__}.")
  return sample


def time_dtype() -> Any:
  """The dtype of simulated times: the default float (float64 under x64)."""
  return jnp.result_type(float)


def client_times(compute_time: Sampler | None, latency: Sampler | None, speed: Any) -> tuple[Callable, Callable]:
  """A client's duration d_i = speed_i · c + l, as two functions `(durations, speeds_for)`.

  `durations(key, ids, speeds)` draws speed_i · c + l for the clients `ids` (c ~ `compute_time`, default
  `exponential(1.0)`; l ~ `latency`, default none); `speeds_for(N)` is the `[N]` speed factors (checked against
  N).
  """
  compute_time = exponential(1.0) if compute_time is None else check_sampler(compute_time, "compute_time")
  latency = None if latency is None else check_sampler(latency, "latency")
  if speed is not None:
    if jnp.ndim(speed) != 1:
      raise ValueError(f"speed must be a [num_clients] array of per-client factors; got shape "
                       f"{tuple(jnp.shape(speed))}.")
    check_positive(speed, "speed")

  def durations(key, ids, speeds):
    compute_key, latency_key = jax.random.split(key)
    d = speeds[ids] * compute_time(compute_key, ids.shape).astype(time_dtype())
    if latency is not None:
      d = d + latency(latency_key, ids.shape).astype(time_dtype())
    return d

  def speeds_for(num_clients):
    if speed is None:
      return jnp.ones((num_clients,), time_dtype())
    if jnp.shape(speed)[0] != num_clients:
      raise ValueError(f"speed must have one factor per client, shape [num_clients] = ({num_clients},); got "
                       f"shape {tuple(jnp.shape(speed))}.")
    return jnp.asarray(speed, time_dtype())

  return durations, speeds_for
