"""The privacy accounting of a `train` run: the ε it reports is the ε of the clients it draws.

A `fo.privacy.dp_mean` round is a subsampled Gaussian mechanism, and its ε
depends on how the clients are drawn: at N = 1000, m = 10, σ = 1, T = 1000
and δ = 10⁻⁵, uniform fixed-size sampling (`fo.Sampling`'s default) gives
ε = 20.99 and Poisson sampling with q = m/N gives 2.10. An ε computed for one
while the run does the other is wrong by 10×, silently. So `train` ties the
two together:

* Whenever the state holds a `dp_mean` (a `fo.privacy.DPMeanState` anywhere
  in it: the aggregator itself, behind a client stage, inside
  `secure_aggregation` or `corrupt`, for every member of a sweep), `train`
  needs `accounting=fo.Accounting(delta=δ, ...)`, and
  refuses to run without one; given without a `dp_mean`, it is refused too
  (there would be no noise to account).
* The run's draw, in the accountant's terms (`run_sampling`):
  `client_sampling="uniform"` with C clients per round is
  `Sampling.fixed(N, C)`, `"all"` is `Sampling.fixed(N, N)`, `"poisson"` with
  probability q in C slots is `Sampling.poisson(N, q, cap=C)`;
  `"proportional"` (with replacement, by size) has no accountant event and
  is refused.
* `Accounting.sampling`, when given (the `fo.privacy.Sampling` σ was planned
  for), must be that draw: `fo.privacy.check_sampling` refuses a mismatch in
  one line naming both. The accountant must support the draw
  (`fo.privacy.round_event`: fixed-size sampling is RDP only, truncated
  Poisson PLD only), checked before anything is compiled.
* At the end of the run (and before its last checkpoint), every evaluation
  point gets `"dp_epsilon"`: ε(δ) after that point's round for the run's own
  draw, computed by `fo.privacy.epsilons` (a list of K values for a sweep),
  and `History.privacy` says what was accounted (σ, δ, the accountant, the
  sampling, the event). ε is a function of (σ, δ, the sampling, the rounds)
  only, so it is computed on the host once, for every point at a time.

* σ is the `dp_mean`'s own: its state keeps σ and m (`DPMeanState.noise_multiplier`,
  `.expected_clients`; one per member of a sweep). `Accounting.noise_multiplier`
  may be left out (None: the state's σ is accounted); when given it must be
  the state's σ (to float32 rounding), or the run is refused, so the
  accounted σ is the σ of the noise added. m must be the draw's
  `Sampling.expected_clients` (C for a fixed-size draw, qN for Poisson).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from fedjax_opt.privacy import accounting as accounting_lib
from fedjax_opt.privacy.dp import DPMeanState
from fedjax_opt.train.config import Accounting, Sampling
from fedjax_opt.train.history import History

__all__ = ["Plan", "holds_dp_mean", "plan", "run_sampling"]


def dp_mean_states(state: Any) -> list[DPMeanState]:
  """Every `DPMeanState` (the state of `fo.privacy.dp_mean`) in `state`."""
  is_dp = lambda x: isinstance(x, DPMeanState)
  return [x for x in jax.tree.leaves(state, is_leaf=is_dp) if is_dp(x)]


def holds_dp_mean(state: Any) -> bool:
  """True when a `DPMeanState` (the state of `fo.privacy.dp_mean`) is anywhere in `state`."""
  return bool(dp_mean_states(state))


def _per_member(states: list[DPMeanState], field: str, size: int) -> np.ndarray:
  """`field` of the dp_mean states as float64 `[size]` (one per sweep member; size 1 without a sweep); refuses
  dp_means that disagree."""
  values = [np.broadcast_to(np.asarray(getattr(s, field), np.float64).reshape(-1), (size,)) for s in states]
  for other in values[1:]:
    if not np.allclose(other, values[0], rtol=1e-6):
      raise ValueError(f"train: the state holds dp_means with different {field} ({values[0].tolist()} and "
                       f"{other.tolist()}): one run is accounted with one σ and one m.")
  return values[0]


def run_sampling(sampling: Sampling, num_clients: int) -> accounting_lib.Sampling:
  """The accountant's `fo.privacy.Sampling` of the clients `train` draws with `sampling` from N clients.

  Raises:
    ValueError: a draw no accountant event describes ("proportional").
  """
  kind, c = sampling.client_sampling, sampling.clients_per_round
  if kind == "uniform":
    return accounting_lib.Sampling.fixed(num_clients, c)
  if kind == "all":
    return accounting_lib.Sampling.fixed(num_clients, num_clients)
  if kind == "poisson":
    return accounting_lib.Sampling.poisson(num_clients, sampling.sampling_probability, cap=c)
  raise ValueError(f"train: client_sampling={kind!r} has no privacy accounting (draws with replacement in "
                   f"proportion to the clients' sizes): a dp_mean run samples 'uniform', 'all' or 'poisson'.")


@functools.lru_cache(maxsize=16)
def _epsilons(sigma: float, delta: float, sampling: accounting_lib.Sampling, accountant: str,
              rounds: tuple[int, ...]) -> tuple[float, ...]:
  """ε after `rounds`, computed once per process for runs accounted alike (the algorithms of one command line run,
  a run and its resumption)."""
  if not rounds:
    return ()
  return tuple(float(e) for e in accounting_lib.epsilons(sigma, at=list(rounds), delta=delta, sampling=sampling,
                                                         accountant=accountant))


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a run is accounted as: `accounting`, and the accountant's view of the run's own draw."""

  accounting: Accounting
  sampling: accounting_lib.Sampling
  sweep_size: int | None

  def info(self) -> dict[str, Any]:
    """`History.privacy`: what the recorded ε are the ε of."""
    a = self.accounting
    event, relation = accounting_lib.round_event(a.noise_multipliers[0], self.sampling, a.accountant)
    sigma = list(a.noise_multipliers) if len(a.noise_multipliers) > 1 else a.noise_multipliers[0]
    return {"noise_multiplier": sigma, "delta": a.delta, "accountant": a.accountant,
            "sampling": self.sampling.describe(), "expected_clients": self.sampling.expected_clients,
            "event": repr(event), "neighboring_relation": relation.name}

  def recorded(self, history: History) -> History:
    """`history` with `dp_epsilon` at every evaluation point and `privacy` set (unchanged if already so)."""
    info = self.info()
    rounds = sorted({int(e["round"]) for e in history.evals if int(e["round"]) >= 1})
    if history.privacy == info and all("dp_epsilon" in e for e in history.evals if int(e["round"]) >= 1):
      return history
    a = self.accounting
    by_sigma = {sigma: dict(zip(rounds, _epsilons(float(sigma), a.delta, self.sampling, a.accountant,
                                                  tuple(rounds))))
                for sigma in set(a.noise_multipliers)}
    sigmas = a.noise_multipliers
    if self.sweep_size is not None and len(sigmas) == 1:
      sigmas = sigmas * self.sweep_size
    evals = []
    for e in history.evals:
      e = dict(e)
      r = int(e["round"])
      if r >= 1:
        values = [by_sigma[s][r] for s in sigmas]
        e["dp_epsilon"] = values if self.sweep_size is not None else values[0]
      evals.append(e)
    return dataclasses.replace(history, evals=evals, privacy=info)


def plan(accounting: Accounting | None, state: Any, sampling: Sampling, num_clients: int,
         sweep_size: int | None) -> Plan | None:
  """The run's `Plan` (None: no `dp_mean`, nothing to account), or one line saying why the run is refused.

  Raises:
    TypeError: `accounting` is not an `Accounting`.
    ValueError: a `dp_mean` without `accounting`, `accounting` without a `dp_mean`, a draw with no accountant
      event, an accountant that does not support the draw, or σ for a different number of sweep members.
    SamplingMismatchError: `accounting.sampling` is not the run's draw.
  """
  if accounting is not None and not isinstance(accounting, Accounting):
    raise TypeError(f"accounting must be None or a fedjax_opt.Accounting(delta=δ); "
                    f"got {type(accounting).__name__}.")
  has_dp = holds_dp_mean(state)
  if not has_dp:
    if accounting is not None:
      raise ValueError("train: accounting= is given but the state holds no fo.privacy.dp_mean (no DPMeanState): "
                       "there is no noise to account; use dp_mean as the aggregator, or drop accounting=.")
    return None
  if accounting is None:
    raise ValueError("train: the aggregator is a fo.privacy.dp_mean: give accounting=fo.Accounting("
                     "delta=δ), so that the history records the ε of the clients this run "
                     "draws (an ε computed for another sampling does not describe it).")
  if accounting.sampling is not None:
    try:
      accounting_lib.check_sampling(accounting.sampling, client_sampling=sampling.client_sampling,
                                    clients_per_round=sampling.clients_per_round, num_clients=num_clients,
                                    sampling_probability=sampling.sampling_probability)
    except accounting_lib.SamplingMismatchError as e:
      raise accounting_lib.SamplingMismatchError(f"train: {e} Train with fo.Sampling(..., "
                                                 f"**sampling.train_kwargs()), or drop Accounting.sampling to "
                                                 f"account the run's own draw.") from None
  drawn = run_sampling(sampling, num_clients)
  states = dp_mean_states(state)
  size = sweep_size or 1
  own_sigma = _per_member(states, "noise_multiplier", size)
  own_m = _per_member(states, "expected_clients", size)
  if accounting.noise_multiplier is None:
    sigmas = tuple(float(v) for v in own_sigma)
    sigmas = sigmas[:1] if len(set(sigmas)) == 1 else sigmas
  else:
    sigmas = accounting.noise_multipliers
    if len(sigmas) > 1 and len(sigmas) != size:
      raise ValueError(f"train: Accounting.noise_multiplier holds {len(sigmas)} values: give one, or one per sweep "
                       f"member ({size}).")
    given = np.broadcast_to(np.asarray(sigmas, np.float64), (size,))
    if not np.allclose(given, own_sigma, rtol=1e-6, atol=0):
      raise ValueError(f"train: Accounting.noise_multiplier is {_values(given)} but the dp_mean adds noise with "
                       f"σ = {_values(own_sigma)}: ε would not describe the noise; leave noise_multiplier out "
                       f"(the dp_mean's σ is accounted) or give the same σ.")
  if not np.allclose(own_m, drawn.expected_clients, rtol=1e-6, atol=0):
    raise accounting_lib.SamplingMismatchError(
        f"train: dp_mean divides by expected_clients = {_values(own_m)}, but the run draws "
        f"{drawn.describe()}, {drawn.expected_clients:g} clients per round on average: build "
        f"dp_mean(..., expected_clients={drawn.expected_clients:g}).")
  accounting = dataclasses.replace(accounting, noise_multiplier=sigmas if len(sigmas) > 1 else sigmas[0])
  try:
    accounting_lib.round_event(sigmas[0], drawn, accounting.accountant)
  except accounting_lib.UnsupportedAccountingError as e:
    raise accounting_lib.UnsupportedAccountingError(f"train: {e}") from None
  return Plan(accounting, drawn, sweep_size)


def _values(values: np.ndarray) -> str:
  """One value, or the distinct values of a sweep, for a message."""
  distinct = sorted(set(float(v) for v in np.ravel(values)))
  return f"{distinct[0]:.6g}" if len(distinct) == 1 else "[" + ", ".join(f"{v:.6g}" for v in distinct) + "]"
