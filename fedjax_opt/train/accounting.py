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
  (there would be no noise to account). The state is found by its type, but
  it is never taken on trust: the aggregator that keeps it must declare
  itself private (`Traits.private`, with the state's σ), which every
  algorithm checks when it makes the state (`core.server.check_declared_privacy`):
  `dp_mean`'s state under a hand-made aggregate that declares nothing (a
  lambda, a `functools.partial`) is refused before any round, not accounted.
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

* The accounting is part of the history, checkpointed and carried with it:
  `History.privacy["segments"]` lists every stretch of rounds run alike
  (`Segment`: its rounds, σ and draw), noted after every chunk (ε itself is
  computed at the end). `plan` is built from the state that runs (restored,
  if resumed) and the history it continues, and accounts this run's rounds on
  top of the earlier segments (`fo.privacy.accounting.composed_epsilons`: the
  segments' events composed in one accountant); the ε already recorded at
  earlier points is kept. A draw whose neighbouring relation differs from
  the earlier rounds' (fixed-size vs Poisson), another δ or accountant, and a
  state at round > 0 whose rounds come without their accounting (no
  checkpoint, no `history=`) are refused in one line.
* A resumed or continued state's σ and m are those of the `dp_mean` that
  runs now: restored from a checkpoint, the template's
  (`with_aggregator_constants`); continued from an earlier call, the
  algorithm's own (`with_algorithm_constants`, from `algorithm.init`).
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
import jax.numpy as jnp
import numpy as np

from fedjax_opt.privacy import accounting as accounting_lib
from fedjax_opt.privacy.dp import DPMeanState
from fedjax_opt.train.config import Accounting, Sampling
from fedjax_opt.train.history import History

__all__ = ["Plan", "Segment", "holds_dp_mean", "plan", "run_sampling", "with_aggregator_constants",
           "with_algorithm_constants"]


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


@dataclasses.dataclass(frozen=True)
class Segment:
  """Rounds `first`–`last` of a run, accounted alike: the draw (`sampling`) and σ (one, or one per sweep member)."""

  first: int
  last: int
  sampling: accounting_lib.Sampling
  noise_multipliers: tuple[float, ...]

  @property
  def rounds(self) -> int:
    return self.last - self.first + 1

  def continues(self, other: "Segment") -> bool:
    """`other` starts where this one ends, with the same draw and σ (one segment then)."""
    return (other.first == self.last + 1 and other.sampling == self.sampling
            and other.noise_multipliers == self.noise_multipliers)

  def sigma(self, member: int) -> float:
    return self.noise_multipliers[member if len(self.noise_multipliers) > 1 else 0]

  def to_dict(self, accountant: str) -> dict[str, Any]:
    """JSON: what `History.privacy["segments"]` holds (read back by `from_dict`)."""
    s = self.sampling
    event, relation = accounting_lib.round_event(self.noise_multipliers[0], s, accountant)
    sigma = list(self.noise_multipliers) if len(self.noise_multipliers) > 1 else self.noise_multipliers[0]
    return {"rounds": [self.first, self.last], "noise_multiplier": sigma, "kind": s.kind,
            "num_clients": s.num_clients, "clients_per_round": s.clients_per_round,
            "sampling_probability": s.sampling_probability, "sampling": s.describe(),
            "event": repr(event), "neighboring_relation": relation.name}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Segment":
    sigma = d["noise_multiplier"]
    sampling = accounting_lib.Sampling(d["kind"], int(d["num_clients"]), int(d["clients_per_round"]),
                                       float(d["sampling_probability"]))
    return cls(int(d["rounds"][0]), int(d["rounds"][1]), sampling,
               tuple(float(v) for v in sigma) if isinstance(sigma, list) else (float(sigma),))


@functools.lru_cache(maxsize=16)
def _epsilons(segments: tuple[tuple[float, accounting_lib.Sampling, int], ...], delta: float, accountant: str,
              rounds: tuple[int, ...]) -> tuple[float, ...]:
  """ε after `rounds` of a run made of `segments` (σ, sampling, rounds), computed once per process for runs
  accounted alike (the algorithms of one command line run, a run and its resumption)."""
  if not rounds:
    return ()
  return tuple(float(e) for e in accounting_lib.composed_epsilons(list(segments), delta=delta, accountant=accountant,
                                                                  at=list(rounds)))


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a run is accounted as: `accounting` (δ, the accountant, this run's σ), the accountant's view of the
  run's own draw, and the rounds accounted before this run (`earlier`, from the history it continues), on top of
  which this run's rounds, from `start + 1` on, are composed."""

  accounting: Accounting
  sampling: accounting_lib.Sampling
  sweep_size: int | None
  earlier: tuple[Segment, ...] = ()
  start: int = 0

  def segments(self, through: int) -> tuple[Segment, ...]:
    """Every segment of the run up to round `through` (this run's rounds merged into the last earlier segment when
    they continue it)."""
    if through <= self.start:
      return self.earlier
    own = Segment(self.start + 1, through, self.sampling, tuple(float(v) for v in self.accounting.noise_multipliers))
    if self.earlier and self.earlier[-1].continues(own):
      return self.earlier[:-1] + (dataclasses.replace(self.earlier[-1], last=through),)
    return self.earlier + (own,)

  def info(self, through: int | None = None) -> dict[str, Any]:
    """`History.privacy` after round `through`: what the recorded ε are the ε of. σ, the sampling and the event are
    the last segment's (this run's, once it has run a round); `segments` lists every one, with its rounds."""
    a = self.accounting
    segments = self.segments(self.start if through is None else through)
    last = segments[-1] if segments else Segment(self.start + 1, self.start, self.sampling, a.noise_multipliers)
    event, relation = accounting_lib.round_event(last.noise_multipliers[0], last.sampling, a.accountant)
    sigma = list(last.noise_multipliers) if len(last.noise_multipliers) > 1 else last.noise_multipliers[0]
    return {"noise_multiplier": sigma, "delta": a.delta, "accountant": a.accountant,
            "sampling": last.sampling.describe(), "expected_clients": last.sampling.expected_clients,
            "event": repr(event), "neighboring_relation": relation.name,
            "segments": [segment.to_dict(a.accountant) for segment in segments]}

  def noted(self, history: History, through: int) -> History:
    """`history` with `privacy` saying how rounds 1 … `through` are accounted (no ε computed: what a checkpoint
    between chunks keeps, so that a resumed run composes its rounds on top of these)."""
    info = self.info(through)
    return history if history.privacy == info else dataclasses.replace(history, privacy=info)

  def recorded(self, history: History, through: int | None = None) -> History:
    """`history` with `dp_epsilon` at every evaluation point that has none, and `privacy` set (`noted`).

    A point that already records ε (restored from a checkpoint, or carried by a continued history) keeps it: ε
    after a round does not change when later rounds are accounted otherwise.
    """
    rounds = sorted({int(e["round"]) for e in history.evals if int(e["round"]) >= 1 and "dp_epsilon" not in e})
    if through is None:
      through = max([self.start, *rounds])
    history = self.noted(history, through)
    if not rounds:
      return history
    if rounds[-1] > through:
      raise ValueError(f"train: the history has an evaluation point at round {rounds[-1]}, but its accounting "
                       f"covers rounds 1–{through}.")
    segments = self.segments(through)
    members = self.sweep_size if self.sweep_size is not None else 1
    eps = [_epsilons(tuple((seg.sigma(k), seg.sampling, seg.rounds) for seg in segments), self.accounting.delta,
                     self.accounting.accountant, tuple(rounds)) for k in range(members)]
    at = {r: [member[i] for member in eps] for i, r in enumerate(rounds)}
    evals = []
    for e in history.evals:
      r = int(e["round"])
      if r in at and "dp_epsilon" not in e:
        e = dict(e, dp_epsilon=at[r] if self.sweep_size is not None else at[r][0])
      evals.append(e)
    return dataclasses.replace(history, evals=evals)


def with_aggregator_constants(restored: Any, template: Any) -> Any:
  """`restored` (a state read back from a checkpoint) with the σ and m of `template`'s `dp_mean` states.

  `DPMeanState.noise_multiplier` and `.expected_clients` are constants of the aggregator: the noise is drawn with
  the σ the `dp_mean` was built with, and the sum divided by its m. A checkpoint restores the values of the run
  that wrote it; the resumed run's aggregator is the template's, so its σ and m are the template's (and so is
  what this run's rounds are accounted with).
  """
  if not holds_dp_mean(template):
    return restored
  is_dp = lambda x: isinstance(x, DPMeanState)

  def refresh(r, t):
    if is_dp(r) and is_dp(t):
      return r.replace(noise_multiplier=t.noise_multiplier, expected_clients=t.expected_clients)
    return r

  try:
    return jax.tree.map(refresh, restored, template, is_leaf=is_dp)
  except (ValueError, TypeError):  # a state restored in its saved shapes (FedMA's): left as saved
    return restored


def with_algorithm_constants(state: Any, algorithm: Any, swept: bool) -> Any:
  """`state` (continued from an earlier `train` call) with the σ and m of `algorithm`'s own `dp_mean`.

  The state keeps the σ and m of the `dp_mean` it was made with; the noise of the rounds this call runs is drawn with
  the σ of `algorithm`'s. They are read from `algorithm.init(state.params, key)` (only the `DPMeanState` constants
  of it are computed: one small compiled program). An `init` that cannot be called so, or whose `dp_mean` pieces
  do not match the state's, is refused in one line: the rounds' σ would be unknown to the accountant.
  """
  is_dp = lambda x: isinstance(x, DPMeanState)

  def constants(params, key):
    fresh = algorithm.init(params, key, params_axis=0) if swept else algorithm.init(params, key)
    return [(s.noise_multiplier, s.expected_clients) for s in dp_mean_states(fresh)]

  try:
    found = jax.jit(constants)(state.params, jax.random.key(0))
  except Exception as e:  # pylint: disable=broad-except  (any failure: σ unknown, so refused, never guessed)
    raise ValueError(f"train: the state continues a DP run, and this call's σ could not be read from "
                     f"algorithm.init(params, key) ({type(e).__name__}): resume from a checkpoint instead.") from e
  if len(found) != len(dp_mean_states(state)):
    raise ValueError(f"train: the state holds {len(dp_mean_states(state))} dp_mean piece(s) and this call's algorithm "
                     f"{len(found)}: continue a state with the algorithm it was made by.")
  found = iter(found)

  def refresh(x):
    if not is_dp(x):
      return x
    sigma, m = next(found)
    return x.replace(noise_multiplier=jnp.asarray(sigma, x.noise_multiplier.dtype).reshape(x.noise_multiplier.shape),
                     expected_clients=jnp.asarray(m, x.expected_clients.dtype).reshape(x.expected_clients.shape))

  return jax.tree.map(refresh, state, is_leaf=is_dp)


def _earlier(history: History | None, start: int, current: Segment, accounting: Accounting,
             restored: bool) -> tuple[Segment, ...]:
  """The segments that account rounds 1 … `start` of the state this run continues, read from `history`.

  Refuses (one line) a state at round > 0 whose rounds have no accounting (nothing says under what they ran, and
  this run's rounds alone would under-report ε), and one accounted with another δ or accountant (its earlier ε
  would change).
  """
  if start <= 0:
    return ()
  privacy = history.privacy if history is not None else None
  if not privacy and restored:
    raise ValueError(f"train: the checkpoint restored is at round {start} and holds a dp_mean, but its history holds "
                     f"no accounting of those rounds (a checkpoint written between chunks before fo.train recorded "
                     f"accounting segments): ε of this run's rounds alone would under-report it; start from round 0.")
  if not privacy:
    where = ("pass history= (the History the fo.train call that made this state returned)" if history is None
             else "the history given holds none: pass the History the fo.train call that made this state returned")
    raise ValueError(f"train: the state is at round {start} and holds a dp_mean, but no accounting of its {start} "
                     f"round(s) comes with it: {where}, or resume from the run's checkpoint, so that ε composes those "
                     f"rounds with this run's (this run's rounds alone would under-report ε).")
  if privacy.get("delta") != accounting.delta or privacy.get("accountant") != accounting.accountant:
    was = privacy.get("delta")
    was = f"{was:g}" if isinstance(was, (int, float)) else repr(was)
    raise ValueError(f"train: rounds 1–{start} were accounted with δ={was} by the "
                     f"{str(privacy.get('accountant')).upper()} accountant, and this run asks "
                     f"δ={accounting.delta:g} by the {accounting.accountant.upper()} accountant: one run is accounted "
                     f"with one δ and one accountant (its earlier ε would change).")
  if "segments" not in privacy:  # a history written before segments were recorded: one sampling and σ throughout
    sigma = privacy.get("noise_multiplier")
    sigmas = tuple(float(v) for v in sigma) if isinstance(sigma, list) else (float(sigma),)
    if privacy.get("sampling") != current.sampling.describe() or sigmas != current.noise_multipliers:
      raise ValueError(f"train: rounds 1–{start} were accounted as {privacy.get('sampling')}, σ={sigma} (a history "
                       f"without accounting segments), and this run is {current.sampling.describe()}, "
                       f"σ={_values(np.asarray(current.noise_multipliers))}: continue it as it was run.")
    return (dataclasses.replace(current, first=1, last=start),)
  segments = tuple(Segment.from_dict(d) for d in privacy["segments"])
  covered = segments[-1].last if segments else 0
  if covered != start:
    raise ValueError(f"train: the history accounts rounds 1–{covered}, but the state is at round {start}: give "
                     f"the History that came with this state.")
  return segments


def _check_continues(earlier: tuple[Segment, ...], current: Segment, accounting: Accounting,
                     size: int | None) -> None:
  """Refuses (one line) this run's rounds when they cannot be composed with the earlier ones in one accountant."""
  if not earlier:
    return
  last = earlier[-1]
  if len(last.noise_multipliers) > 1 and len(last.noise_multipliers) != (size or 1):
    raise ValueError(f"train: rounds 1–{last.last} were accounted for a sweep of {len(last.noise_multipliers)} "
                     f"members, and this run has {size or 1}: continue it with the same members.")
  _, was = accounting_lib.round_event(last.noise_multipliers[0], last.sampling, accounting.accountant)
  _, now = accounting_lib.round_event(current.noise_multipliers[0], current.sampling, accounting.accountant)
  if was != now:
    name = lambda r: "replace-one" if r.name == "REPLACE_ONE" else "add/remove-one"
    raise accounting_lib.UnsupportedAccountingError(
        f"train: rounds {last.first}–{last.last} drew {last.sampling.describe()} ({name(was)} neighbours) and this "
        f"run draws {current.sampling.describe()} ({name(now)} neighbours): no dp-accounting accountant composes "
        f"the two, so the whole run's ε cannot be computed; continue with fo.Sampling(..., "
        f"**{last.sampling.train_kwargs()}), or another draw of the same kind.")


def plan(accounting: Accounting | None, state: Any, sampling: Sampling, num_clients: int,
         sweep_size: int | None, *, history: History | None = None, start: int = 0,
         until: int | None = None, restored: bool = False) -> Plan | None:
  """The run's `Plan` (None: no `dp_mean`, nothing to account), or one line saying why the run is refused.

  Args:
    accounting, state, sampling, num_clients, sweep_size: the run's (`state` as it will run: restored, if resumed).
    history: the history the run continues (restored from its checkpoint, or given to `train`): its
      `privacy["segments"]` account rounds 1 … `start`, and this run's rounds are composed on top of them.
    start: the state's round (0: a new run; no history needed).
    until: the round the run stops at (this run's draw is checked against the earlier rounds' only when it runs
      a round; None: always).
    restored: `history` comes from a checkpoint (for the message of a refusal).

  Raises:
    TypeError: `accounting` is not an `Accounting`.
    ValueError: a `dp_mean` without `accounting`, `accounting` without a `dp_mean`, a draw with no accountant
      event, an accountant that does not support the draw, σ for a different number of sweep members, a state at
      round > 0 whose rounds have no accounting (no history with it), or a history accounted with another δ or
      accountant.
    SamplingMismatchError: `accounting.sampling` is not the run's draw.
    UnsupportedAccountingError: this run's draw cannot be composed with the earlier rounds' (fixed-size and Poisson
      sampling have different neighbouring relations).
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
  current = Segment(start + 1, start, drawn, tuple(float(v) for v in accounting.noise_multipliers))
  earlier = _earlier(history, start, current, accounting, restored)
  if until is None or until > start:
    _check_continues(earlier, current, accounting, sweep_size)
  return Plan(accounting, drawn, sweep_size, earlier, start)


def _values(values: np.ndarray) -> str:
  """One value, or the distinct values of a sweep, for a message."""
  distinct = sorted(set(float(v) for v in np.ravel(values)))
  return f"{distinct[0]:.6g}" if len(distinct) == 1 else "[" + ", ".join(f"{v:.6g}" for v in distinct) + "]"
