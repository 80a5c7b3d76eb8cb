"""Privacy accounting for `dp_mean` with Google's `dp-accounting` library: ε after each round, σ for a target ε.

One round of DP-FedAvg is a subsampled Gaussian mechanism on the clients'
clipped updates. What the accountant is told must be what the run did:

* Poisson sampling (`Sampling.poisson(N, q, cap)`; in `fo.train`,
  `fo.Sampling(client_sampling="poisson", sampling_probability=q, clients_per_round=cap, ...)`):
  every client independently with probability q; neighbouring datasets add
  or remove one client (`ADD_OR_REMOVE_ONE`), so the clipped sum has
  sensitivity C and the event is `PoissonSampledDpEvent(q,
  GaussianDpEvent(σ))`. When more than `cap` clients are drawn (the round has
  `cap` slots) a uniformly random `cap` of them take part: the event is then
  `TruncatedSubsampledGaussianDpEvent(N, q, cap, σ)`, which only the PLD
  accountant supports; with `cap = N` nothing is ever truncated and both
  accountants apply.
* Fixed-size sampling (`Sampling.fixed(N, m)`, `client_sampling="uniform"`
  with `clients_per_round=m`, `fo.Sampling`'s default): m distinct clients
  uniformly without replacement. N is public, so neighbouring datasets
  *replace* one client (`REPLACE_ONE`), and replacing one clipped update
  moves the sum by up to 2C: the accountant is given noise multiplier σ/2
  (noise std σC over sensitivity 2C) in
  `SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(σ/2))` (Wang,
  Balle, Kasiviswanathan, AISTATS 2019). Only the RDP accountant supports
  it; PLD raises `UnsupportedAccountingError` naming the alternatives.
  Full participation (`client_sampling="all"`) is the fixed case m = N.

The two are different adjacency notions (add/remove vs replace-one), so
their ε are not directly comparable: an (ε, δ) guarantee under add/remove
implies (2ε, ...) under replace-one by group privacy, not the converse.

`epsilons` composes the round's event k times for every requested k (RDP:
the per-round Rényi divergences scaled by k and converted with
dp-accounting's `compute_epsilon`, the improved conversion of Canonne, Kamath,
Steinke 2020 / Asoodeh et al. 2020; PLD: one accountant composed round after
round), `noise_multiplier_for` solves σ for a target ε by Brent's method (coarse PLD
grids first, the answer checked on the accountant's own), and `check_sampling` refuses a
`fo.train` configuration (its `fo.Sampling`) that is not the `Sampling` given to the accountant.
This module's `Sampling` is the accountant's view of the client draw;
`fo.Sampling` is the driver's, and `Sampling.train_kwargs()` are its fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Iterator, Sequence

import numpy as np

__all__ = ["ACCOUNTANTS", "Sampling", "SamplingMismatchError", "UnsupportedAccountingError", "check_sampling",
           "composed_epsilons", "epsilons", "noise_multiplier_for", "poisson_cap", "round_event"]

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("fixed", "poisson")


class UnsupportedAccountingError(ValueError):
  """The accountant has no event for this sampling (the message names what to use instead)."""


class SamplingMismatchError(ValueError):
  """The run samples clients differently from the `Sampling` the accountant is given."""


def _dp():
  try:
    import dp_accounting  # imported where used: the library's import-time dependencies stay jax, optax, flax
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("privacy accounting needs Google's dp-accounting: pip install 'dp-accounting>=0.4' "
                      "(it comes with fedjax_opt[cli] and [dev]).") from e
  return dp_accounting


def poisson_cap(num_clients: int, sampling_probability: float, overflow: float = 1e-6) -> int:
  """The slot count of a Poisson round: the smallest B with P(Binomial(N, q) > B) ≤ `overflow` (at most N).

  Rounds are padded to B slots (weight 0 where unused). More than B clients
  drawn (probability ≤ `overflow` per round) keeps a uniformly random B of
  them; the accountant is told so (`TruncatedSubsampledGaussianDpEvent`),
  so the cap costs utility and memory, never an unaccounted privacy loss.
  """
  from scipy import stats

  _check_count(num_clients, "num_clients")
  _check_probability(sampling_probability)
  if not 0 < overflow < 1:
    raise ValueError(f"poisson_cap: overflow must be in (0, 1); got {overflow!r}.")
  cap = int(stats.binom.isf(overflow, num_clients, sampling_probability))
  while cap < num_clients and stats.binom.sf(cap, num_clients, sampling_probability) > overflow:
    cap += 1
  return max(1, min(num_clients, cap))


def _check_count(value, name: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int; got {value!r}.")


def _check_probability(q) -> None:
  if isinstance(q, bool) or not isinstance(q, (int, float, np.floating)) or not 0 < q <= 1:
    raise ValueError(f"sampling_probability q must be in (0, 1]; got {q!r}.")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a round's clients are drawn, as both `fo.train` and the accountant must see it.

  Attributes:
    kind: "fixed" (m distinct clients, uniformly without replacement) or
      "poisson" (each client independently with probability q).
    num_clients: N, the clients that may be sampled.
    clients_per_round: fixed: m; poisson: the round's slots (the cap).
    sampling_probability: q (poisson); m / N for fixed.
  """

  kind: str
  num_clients: int
  clients_per_round: int
  sampling_probability: float

  def __post_init__(self):
    if self.kind not in SAMPLINGS:
      raise ValueError(f"Sampling.kind must be one of {SAMPLINGS}; got {self.kind!r}.")
    _check_count(self.num_clients, "num_clients")
    _check_count(self.clients_per_round, "clients_per_round")
    if self.clients_per_round > self.num_clients:  # before q: a fixed draw's q = m / N would be the symptom
      raise ValueError(f"Sampling: clients_per_round={self.clients_per_round} exceeds "
                       f"num_clients={self.num_clients}.")
    _check_probability(self.sampling_probability)
    if self.kind == "fixed" and not math.isclose(self.sampling_probability,
                                                 self.clients_per_round / self.num_clients):
      raise ValueError("Sampling.fixed: sampling_probability must be clients_per_round / num_clients; "
                       "build it with Sampling.fixed(num_clients, clients_per_round).")

  @classmethod
  def fixed(cls, num_clients: int, clients_per_round: int) -> "Sampling":
    """m = `clients_per_round` distinct clients out of N, uniformly (fo.Sampling's "uniform"; m = N: "all")."""
    _check_count(num_clients, "num_clients")
    _check_count(clients_per_round, "clients_per_round")
    if clients_per_round > num_clients:
      raise ValueError(f"Sampling.fixed: clients_per_round={clients_per_round} exceeds num_clients={num_clients} "
                       f"(m distinct clients out of N).")
    return cls("fixed", int(num_clients), int(clients_per_round), clients_per_round / num_clients)

  @classmethod
  def poisson(cls, num_clients: int, sampling_probability: float, cap: int | None = None) -> "Sampling":
    """Each of N clients with probability q, in `cap` slots (None: `poisson_cap(N, q)`; N: never truncated)."""
    if cap is None:
      cap = poisson_cap(num_clients, sampling_probability)
    _check_count(num_clients, "num_clients")
    _check_count(cap, "cap")
    if cap > num_clients:
      raise ValueError(f"Sampling.poisson: cap={cap} exceeds num_clients={num_clients} (a round has at most N "
                       f"slots).")
    return cls("poisson", int(num_clients), int(cap), float(sampling_probability))

  @property
  def expected_clients(self) -> float:
    """m, `dp_mean`'s denominator: clients_per_round (fixed) or qN (poisson)."""
    if self.kind == "fixed":
      return float(self.clients_per_round)
    return self.sampling_probability * self.num_clients

  @property
  def truncated(self) -> bool:
    """Poisson with fewer slots than clients: a round may drop some drawn clients."""
    return self.kind == "poisson" and self.clients_per_round < self.num_clients

  def train_kwargs(self) -> dict:
    """The fields of `fo.Sampling` (keywords of `fo.data.sample_round`) that draw clients this way."""
    if self.kind == "poisson":
      return dict(client_sampling="poisson", clients_per_round=self.clients_per_round,
                  sampling_probability=self.sampling_probability)
    if self.clients_per_round == self.num_clients:
      return dict(client_sampling="all", clients_per_round=self.num_clients)
    return dict(client_sampling="uniform", clients_per_round=self.clients_per_round)

  def describe(self) -> str:
    if self.kind == "poisson":
      cap = f", {self.clients_per_round} slots" + ("" if self.truncated else " (never truncated)")
      return f"Poisson, q={self.sampling_probability:g} of N={self.num_clients}{cap}"
    return f"fixed-size, m={self.clients_per_round} of N={self.num_clients} without replacement"


def _check_sampling_object(sampling) -> Sampling:
  if not isinstance(sampling, Sampling):
    raise TypeError(f"sampling must be a fedjax_opt.privacy.Sampling (Sampling.fixed(N, m) or "
                    f"Sampling.poisson(N, q)); got {type(sampling).__name__}.")
  return sampling


def _check_accountant(accountant: str) -> None:
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}; got {accountant!r}.")


def _check_delta(delta) -> None:
  if isinstance(delta, bool) or not isinstance(delta, (int, float, np.floating)) or not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1); got {delta!r}.")


def round_event(noise_multiplier: float, sampling: Sampling, accountant: str = "rdp"):
  """(one round's `dp_accounting.DpEvent`, its `NeighboringRelation`) for `dp_mean` with noise multiplier σ.

  Raises:
    UnsupportedAccountingError: `accountant` has no event for this sampling.
  """
  dpa = _dp()
  sampling = _check_sampling_object(sampling)
  _check_accountant(accountant)
  sigma = float(noise_multiplier)
  if not sigma >= 0 or not math.isfinite(sigma):
    raise ValueError(f"noise_multiplier must be a finite number >= 0; got {noise_multiplier!r}.")
  n, m = sampling.num_clients, sampling.clients_per_round
  if sampling.kind == "fixed":
    relation = dpa.NeighboringRelation.REPLACE_ONE
    gaussian = dpa.GaussianDpEvent(sigma / 2)  # noise σC over the replace-one sensitivity 2C
    if m == n:
      return gaussian, relation
    if accountant == "pld":
      raise UnsupportedAccountingError(
          "the PLD accountant of dp-accounting has no event for fixed-size sampling without replacement "
          "(SampledWithoutReplacementDpEvent): use accountant='rdp', or Poisson sampling "
          "(Sampling.poisson / client_sampling='poisson').")
    return dpa.SampledWithoutReplacementDpEvent(n, m, gaussian), relation
  relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
  q = sampling.sampling_probability
  if not sampling.truncated:
    return (dpa.GaussianDpEvent(sigma) if q == 1 else dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)),
            relation)
  if accountant == "rdp":
    raise UnsupportedAccountingError(
        f"Poisson sampling capped at {m} of {n} clients (TruncatedSubsampledGaussianDpEvent) is supported by the "
        f"PLD accountant only: use accountant='pld', or a cap of N={n} slots (never truncated).")
  truncated = getattr(dpa, "TruncatedSubsampledGaussianDpEvent", None)
  if truncated is None:
    raise UnsupportedAccountingError(
        "this dp-accounting has no TruncatedSubsampledGaussianDpEvent (dp-accounting >= 0.6 has): upgrade it, "
        f"or use a cap of N={n} slots (never truncated).")
  return truncated(n, q, m, sigma), relation


def _make_accountant(accountant: str, relation):
  dpa = _dp()
  if accountant == "rdp":
    return dpa.rdp.RdpAccountant(neighboring_relation=relation)
  return dpa.pld.PLDAccountant(neighboring_relation=relation)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """dp-accounting logs a warning for every fractional RDP order its series does not converge at (the order is
  then skipped, which only loosens the bound); those lines are noise in a run's output."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _rounds(at, rounds: int | None) -> np.ndarray:
  if at is None:
    if rounds is None:
      raise ValueError("give rounds (ε after each of rounds 1..R) or at (the rounds to report).")
    _check_count(rounds, "rounds")
    return np.arange(1, int(rounds) + 1)
  ks = np.asarray(at)
  if ks.ndim != 1 or ks.size == 0 or not np.issubdtype(ks.dtype, np.integer) or np.any(ks < 1) or np.any(
      np.diff(ks) <= 0):
    raise ValueError(f"at must be a non-empty increasing sequence of round numbers >= 1; got {at!r}.")
  return ks


def epsilons(noise_multiplier: float, rounds: int | None = None, *, delta: float, sampling: Sampling,
             accountant: str = "rdp", at: Sequence[int] | None = None) -> np.ndarray:
  """ε(δ) of `dp_mean` with noise multiplier σ after each round k = 1 … R (or each k in `at`).

  Args:
    noise_multiplier: σ, as given to `dp_mean` (with adaptive clipping too:
      the aggregator spends σ between the update and the count).
    rounds: R.
    delta: δ ∈ (0, 1).
    sampling: how the run draws clients (`Sampling.fixed` / `Sampling.poisson`).
    accountant: "rdp" or "pld".
    at: increasing round numbers to report instead of 1 … R.

  Returns:
    float64 `[len(at) or R]`: ε after those rounds (inf when σ = 0).
  """
  _check_delta(delta)
  ks = _rounds(at, rounds)
  return composed_epsilons([(noise_multiplier, sampling, int(ks[-1]))], delta=delta, accountant=accountant, at=ks)


def composed_epsilons(segments: Sequence[tuple[float, Sampling, int]], *, delta: float, accountant: str = "rdp",
                      at: Sequence[int]) -> np.ndarray:
  """ε(δ) after each round in `at` of a run whose rounds are `segments`, in order: the first k₁ rounds with
  noise multiplier σ₁ and sampling S₁, the next k₂ with σ₂ and S₂, and so on.

  The rounds' events are composed in one accountant, as dp-accounting composes
  `ComposedDpEvent([SelfComposedDpEvent(e₁, k₁), SelfComposedDpEvent(e₂, k₂), ...])`
  (RDP: the per-round Rényi divergences, k₁·rdp₁ + k₂·rdp₂ + ..., converted
  once; PLD: the segments' loss distributions composed in order), so a run
  resumed with another σ or sampling is accounted on top of its earlier rounds.
  With one segment this is `epsilons`.

  Args:
    segments: (σ, `Sampling`, rounds ≥ 1) per segment of the run.
    delta: δ ∈ (0, 1).
    accountant: "rdp" or "pld"; it must support every segment's event (`round_event`).
    at: increasing round numbers ≥ 1, at most the segments' total.

  Returns:
    float64 `[len(at)]`: ε after those rounds (inf from the first round with σ = 0 on).

  Raises:
    UnsupportedAccountingError: an event the accountant does not support, or segments whose events have different
      neighbouring relations (fixed-size sampling is accounted under replace-one, Poisson under add/remove: one
      accountant composes events of one relation).
  """
  dpa = _dp()
  _check_delta(delta)
  _check_accountant(accountant)
  if not segments:
    raise ValueError("composed_epsilons: give at least one segment (σ, sampling, rounds).")
  events, ends, done = [], [], 0
  for sigma, sampling, count in segments:
    _check_count(count, "a segment's rounds")
    event, relation = round_event(sigma, sampling, accountant)
    if events and relation != events[0][1]:
      first = segments[0][1]
      raise UnsupportedAccountingError(
          f"rounds 1–{ends[0]} draw {first.describe()} ({events[0][1].name}) and "
          f"rounds {done + 1}–{done + int(count)} draw {sampling.describe()} ({relation.name}): dp-accounting's "
          f"accountants compose events of one neighbouring relation only.")
    events.append((event, relation, float(sigma)))
    done += int(count)
    ends.append(done)
  ks = _rounds(at, None)
  if ks[-1] > done:
    raise ValueError(f"composed_epsilons: at asks for round {int(ks[-1])}, but the segments hold {done} rounds.")
  starts = [end - int(seg[2]) for end, seg in zip(ends, segments)]
  out = np.empty(len(ks))
  zero = next((starts[j] + 1 for j, (_, _, sigma) in enumerate(events) if sigma == 0), None)
  with _quiet():
    if accountant == "rdp":
      per_round, orders = [], None
      for event, relation, sigma in events:
        if sigma == 0:  # ε is inf from its first round on (`zero`): nothing to compose
          per_round.append(None)
          continue
        one = _make_accountant(accountant, relation)
        one.compose(event, 1)
        per_round.append(np.asarray(one.rdp))
        orders = one.orders
      for i, k in enumerate(ks):
        if zero is not None and k >= zero:
          out[i] = np.inf
          continue
        total = None
        for j, start in enumerate(starts):
          n = min(int(k), ends[j]) - start
          if n <= 0:
            break
          total = n * per_round[j] if total is None else total + n * per_round[j]
        out[i] = dpa.rdp.compute_epsilon(orders, total, delta)[0]
      return out
    plds = []
    for event, relation, sigma in events:
      if sigma == 0:
        plds.append(None)
        continue
      if not _make_accountant(accountant, relation).supports(event):
        raise UnsupportedAccountingError(f"the PLD accountant does not support {event}.")
      plds.append(_pld_of(event, relation))
    done, total = 0, None
    for i, k in enumerate(ks):
      if zero is not None and k >= zero:
        out[i:] = np.inf
        break
      while done < k:
        j = next(j for j, end in enumerate(ends) if end > done)
        gap = min(int(k), ends[j]) - done
        piece = plds[j] if gap == 1 else plds[j].self_compose(gap)
        total = piece if total is None else total.compose(piece)
        done += gap
      out[i] = total.get_epsilon_for_delta(delta)
  return out


@functools.lru_cache(maxsize=8)
def _pld_of(event, relation):
  """The privacy loss distribution of one round's event, built once (as `PLDAccountant` builds it, with its
  default discretization 1e-4), so that a curve composes it round after round instead of rebuilding it; kept
  for the next call with the same event (`noise_multiplier_for`'s check, then the run's report)."""
  dpa = _dp()
  pld = dpa.pld.privacy_loss_distribution
  if isinstance(event, dpa.GaussianDpEvent):
    return pld.from_gaussian_mechanism(standard_deviation=event.noise_multiplier, neighboring_relation=relation)
  if isinstance(event, dpa.PoissonSampledDpEvent):
    return pld.from_gaussian_mechanism(standard_deviation=event.event.noise_multiplier,
                                       sampling_prob=event.sampling_probability, neighboring_relation=relation)
  return pld.from_truncated_subsampled_gaussian_mechanism(
      dataset_size=event.dataset_size, sampling_probability=event.sampling_probability,
      truncated_batch_size=event.truncated_batch_size, noise_multiplier=event.noise_multiplier,
      neighboring_relation=relation)


# The PLD grids of `noise_multiplier_for`'s search (value discretization intervals). dp-accounting's PLD is
# pessimistic: a coarser grid bounds ε from above, more loosely. Brent's method runs on the coarse grid
# (milliseconds per ε), then on the medium one inside a narrow bracket (tenths of a second), and the answer is
# checked once on the accountant's own grid (1e-4, seconds): that is the ε `epsilons` reports for the run.
_PLD_SEARCH_GRIDS = (1e-2, 1e-3)


def noise_multiplier_for(target_epsilon: float, rounds: int, *, delta: float, sampling: Sampling,
                         accountant: str = "rdp", tol: float = 1e-4) -> float:
  """The smallest σ (within `tol`) whose ε(δ) after `rounds` rounds is at most `target_epsilon`.

  Solved by Brent's method on σ ↦ ε(σ) − target (as
  `dp_accounting.calibrate_dp_mechanism` does) over the event of
  `round_event` composed `rounds` times.
  With the PLD accountant the search runs on coarser discretizations of the
  privacy loss first (1e-2, then 1e-3 inside a bracket 1% wide just below
  the first answer: each an upper bound on ε, since dp-accounting's PLD is
  pessimistic), and the answer is verified once at the accountant's own 1e-4
  grid, the ε that `epsilons` reports: the returned σ satisfies
  `epsilons(σ, at=[rounds], ...) <= target` (stepped up until it does). A few seconds on a 2-core CPU for 300
  rounds, where a search at the fine grid throughout took about a minute.
  """
  dpa = _dp()
  _check_delta(delta)
  _check_count(rounds, "rounds")
  if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)) or not (
      0 < target_epsilon < float("inf")):
    raise ValueError(f"target_epsilon must be a finite number > 0; got {target_epsilon!r}.")
  _, relation = round_event(1.0, sampling, accountant)  # checks the pair before searching
  target = float(target_epsilon)
  grids = _PLD_SEARCH_GRIDS if accountant == "pld" else (None,)

  def event(sigma: float):
    return dpa.SelfComposedDpEvent(round_event(sigma, sampling, accountant)[0], int(rounds))

  def fresh(grid):
    if grid is None:
      return lambda: _make_accountant(accountant, relation)
    return lambda: dpa.pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=grid)

  @functools.lru_cache(maxsize=None)
  def eps(sigma: float, grid) -> float:
    if grid is None:
      return float(epsilons(sigma, at=[int(rounds)], delta=delta, sampling=sampling, accountant=accountant)[0])
    with _quiet():
      one = fresh(grid)()
      one.compose(event(sigma))
      return float(one.get_epsilon(float(delta)))

  def solve(grid, lo: float, hi: float) -> float:
    """Brent's method on σ ↦ ε(σ) − target in [lo, hi] (ε(lo) > target >= ε(hi)), reusing computed ε."""
    from scipy import optimize  # dp-accounting's own dependency
    return float(optimize.brentq(lambda sigma: eps(float(sigma), grid) - target, lo, hi, xtol=tol))

  # A bracket [lo, hi] with ε(lo) > target >= ε(hi) on the first grid, found by doubling from σ = 1. The PLD of
  # a very small σ needs a huge discretized support, so its search stops at σ = 0.05 (a smaller σ is refused).
  floor = 0.05 if accountant == "pld" else 1e-3
  first = grids[0]
  lo, hi = 1.0, 1.0
  if eps(1.0, first) > target:
    while eps(hi, first) > target:
      lo, hi = hi, 2 * hi
      if hi > 2 ** 20:
        raise ValueError(f"no noise multiplier up to 2^20 reaches ε = {target_epsilon} in {rounds} rounds.")
  else:
    while eps(lo, first) <= target:
      hi, lo = lo, lo / 2
      if lo < floor:
        raise ValueError(f"ε = {target_epsilon} after {rounds} rounds is reached with noise multiplier below "
                         f"{floor:g}; ask for a smaller ε" + (" or use accountant='rdp'." if accountant == "pld"
                                                               else "."))
  sigma = solve(first, lo, hi)
  for grid in grids[1:]:
    # A finer grid's ε is at most about the coarser one's, so its answer lies at or just below the last one:
    # bracket it from there, widening downwards (and upwards, should the finer grid's ε be the larger).
    hi = sigma
    while eps(hi, grid) > target:
      hi *= 1.01
    width = 0.01 * hi
    lo = max(hi - width, floor)
    while eps(lo, grid) <= target:
      if lo == floor:
        raise ValueError(f"ε = {target_epsilon} after {rounds} rounds is reached with noise multiplier below "
                         f"{floor:g}; ask for a smaller ε or use accountant='rdp'.")
      hi, width = lo, 2 * width
      lo = max(lo - width, floor)
    sigma = solve(grid, lo, hi)
  # Brent's method returns a point within tol of the boundary; step to its private side of the ε that
  # `epsilons` reports for the run (for PLD: on the accountant's own grid, checked here once).
  step = tol
  while epsilons(sigma, at=[int(rounds)], delta=delta, sampling=sampling, accountant=accountant)[0] > target:
    sigma, step = sigma + step, 2 * step
  return sigma


def check_sampling(sampling: Sampling, *, client_sampling: str, clients_per_round: int, num_clients: int,
                   sampling_probability: float | None = None, expected_clients: float | None = None) -> None:
  """Raises `SamplingMismatchError` unless a `fo.train` run with these `fo.Sampling` fields draws clients as
  `sampling` says.

  Args:
    sampling: what the accountant is given.
    client_sampling, clients_per_round, sampling_probability: the run's `fo.Sampling` fields.
    num_clients: the dataset's N.
    expected_clients: `dp_mean`'s m, when given: must be `sampling.expected_clients`.
  """
  sampling = _check_sampling_object(sampling)
  run = f"client_sampling={client_sampling!r}, clients_per_round={clients_per_round}"
  if sampling_probability is not None:
    run += f", sampling_probability={sampling_probability}"
  run += f" over {num_clients} clients"
  wanted = dict(sampling.train_kwargs(), num_clients=sampling.num_clients)
  got = dict(client_sampling=client_sampling, clients_per_round=clients_per_round, num_clients=num_clients)
  if sampling_probability is not None or client_sampling == "poisson":
    got["sampling_probability"] = sampling_probability
  if client_sampling == "all" and sampling.kind == "fixed":
    got["clients_per_round"] = num_clients
  same = set(got) == set(wanted) and all(
      math.isclose(got[k], wanted[k]) if isinstance(wanted[k], float) else got[k] == wanted[k] for k in wanted)
  if not same:
    raise SamplingMismatchError(
        f"the run draws clients with {run}, but the accountant is given {sampling.describe()} "
        f"(fo.Sampling fields {sampling.train_kwargs()} over {sampling.num_clients} clients); "
        "ε would not describe this run.")
  if expected_clients is not None and not math.isclose(float(expected_clients), sampling.expected_clients):
    raise SamplingMismatchError(
        f"dp_mean divides by expected_clients={expected_clients}, but {sampling.describe()} expects "
        f"{sampling.expected_clients:g} clients per round.")
