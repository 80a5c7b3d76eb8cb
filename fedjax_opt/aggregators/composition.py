"""The composition matrix: which stacks of trust pieces compose, decided from their declared traits alone.

A round's pieces, outermost (what the client does first) to innermost (the rule):

    C   fo.compression.compress(top_k(k=2))        a client stage: `fo.aggregators.chain(C, inner)`
    A   fo.attacks.corrupt(inner, sign_flip(2))    an attack on what the server receives
    SA  fo.privacy.secure_aggregation(inner, B)    a secure sum around a sum rule
    M   fo.aggregators.mean()                      the rule: a plain mean,
    DP  fo.privacy.dp_mean(C, σ, m)                or clipped-and-noised mean,
    R   fo.aggregators.marginal_median()           or a robust rule
    D   fo.compression.downlink(top_k(k=2))        the server's broadcast, compressed: `chain(inner, D)`

A *stack* is a tuple of symbols, outermost first, with exactly one rule
(M, DP or R) and each of C, A, SA, D at most once; A and SA wrap the rule
(they come before it), C may stand anywhere, also after the rule
(`chain(rule, C)`: compression after the aggregator), and D, compression
down, stands last when present (it acts on the broadcast, after the whole
uplink). `expression(stack)` writes it as the constructors' nesting:
("C", "A", "SA", "DP") is `chain(C, A(SA(DP)))`, ("A", "C", "M") is
`A(chain(C, M))`, ("M", "C") is `chain(M, C)`, ("C", "DP", "D") is
`chain(chain(C, DP), D)`. `stacks()` lists all 126 (21 orderings of the
uplink wrappers × 3 rules, each without and with D), `ALGORITHMS` the four
algorithms they are given to (FedAvg, and the stateful Ditto, SCAFFOLD,
FedDyn), and `cells()` all 504 (stack, algorithm) pairs with their `Verdict`.

`verdict(stack, algorithm)` decides from `Traits` only, never by building
the pieces: it computes each piece's traits inside out (`PIECES[s].traits`),
refuses where a constructor or the algorithm would, and names the two pieces
that do not compose in a one-line reason. The rules it applies, in the order
the constructors apply them (the first refusal wins):

* `chain(rule, C)`: a client stage after an aggregator (`chain`); a stack
  with D is refused where the same stack without D is.
* `corrupt(X)` with X carrying a client stage (`corrupt`).
* `secure_aggregation(X)` with X not a sum over clients (`secure_aggregation`:
  `Traits.sums`, the piece has a streaming form),
  then with X carrying a client stage.
* the algorithm: a downlink, where the factory declares it takes none
  (`factory.downlink`, read from the factory: SCAFFOLD and FedDyn; checked
  before the factory runs, so first); FedDyn refuses a client stage; SCAFFOLD
  and FedDyn refuse an unknown piece (traits None) and a piece that is an
  attack, secure, private or robust (`core.server.protecting_piece`'s order),
  naming the outermost piece.

tests/test_composition_matrix.py checks, cell by cell, that the constructors
and the factories do exactly what `verdict` says (and that a composing
stack's built `Aggregator.traits` equal the traits computed here), and that
every composing cell's round equals a float64 NumPy transcription;
tools/composition_matrix.py prints `markdown()`, the table of
docs/privacy.md, which a test keeps equal to it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, NamedTuple, Sequence

from fedjax_opt.core.types import Traits

__all__ = ["ALGORITHMS", "Algorithm", "Cell", "PIECES", "Piece", "RULES", "Settings", "Verdict", "build", "cells",
           "expression", "markdown", "stacks", "verdict"]


@dataclasses.dataclass(frozen=True)
class Settings:
  """The parameters the matrix builds its pieces with (small, deterministic: σ = 0, top-k, a sign flip)."""

  top_k: int = 2
  attackers: tuple[int, ...] = (3,)
  attack_scale: float = 2.0
  clip_norm: float = 0.05
  noise_multiplier: float = 0.0
  expected_clients: float = 5.0
  bound: float = 1.0
  frac_bits: int = 16

  @property
  def stage_name(self) -> str:
    """The compression stage's name, as `fo.compression.compress(top_k(k=k))` calls itself."""
    return f"compress(top_k(k={self.top_k}))"

  @property
  def downlink_name(self) -> str:
    """The downlink's name, as `fo.compression.downlink(top_k(k=k))` (with error feedback) calls itself."""
    return f"downlink(top_k(k={self.top_k}), error_feedback)"


@dataclasses.dataclass(frozen=True)
class Piece:
  """One kind of piece: its symbol, role ("stage", "wrapper", "rule" or "downlink"), how to build it around an inner piece
  (`build(inner, settings)`; a rule ignores `inner`) and its traits around the inner piece's traits
  (`traits(inner, settings)`; a stage's are the inner's with `client_stage` set)."""

  symbol: str
  role: str
  constructor: str
  build: Callable[[Any, Settings], Any]
  traits: Callable[[Traits | None, Settings], Traits | None]


def _build_stage(inner, s):
  from fedjax_opt import compression  # pylint: disable=import-outside-toplevel
  from fedjax_opt.aggregators.chain import chain  # pylint: disable=import-outside-toplevel
  stage = compression.compress(compression.top_k(k=s.top_k))
  return chain(stage, inner)


def _build_attack(inner, s):
  from fedjax_opt import attacks  # pylint: disable=import-outside-toplevel
  return attacks.corrupt(inner, attacks.sign_flip(s.attack_scale), attackers=list(s.attackers))


def _build_secure(inner, s):
  from fedjax_opt import privacy  # pylint: disable=import-outside-toplevel
  return privacy.secure_aggregation(inner, bound=s.bound, frac_bits=s.frac_bits)


def _build_mean(inner, s):
  del inner, s
  from fedjax_opt.aggregators.base import mean  # pylint: disable=import-outside-toplevel
  return mean()


def _build_dp(inner, s):
  del inner
  from fedjax_opt import privacy  # pylint: disable=import-outside-toplevel
  return privacy.dp_mean(s.clip_norm, s.noise_multiplier, expected_clients=s.expected_clients)


def _build_downlink(inner, s):
  from fedjax_opt import compression  # pylint: disable=import-outside-toplevel
  from fedjax_opt.aggregators.chain import chain  # pylint: disable=import-outside-toplevel
  return chain(inner, compression.downlink(compression.top_k(k=s.top_k)))


def _build_robust(inner, s):
  del inner, s
  from fedjax_opt.aggregators.robust import marginal_median  # pylint: disable=import-outside-toplevel
  return marginal_median()


PIECES: dict[str, Piece] = {
    "C": Piece("C", "stage", "fo.compression.compress(fo.compression.top_k(k=2))", _build_stage,
               lambda inner, s: None if inner is None else dataclasses.replace(inner, client_stage=s.stage_name)),
    "A": Piece("A", "wrapper", "fo.attacks.corrupt(inner, fo.attacks.sign_flip(2.0), attackers=[3])", _build_attack,
               lambda inner, s: Traits.wrap(inner, name="corrupt", attack=True, linear=False)),
    "SA": Piece("SA", "wrapper", "fo.privacy.secure_aggregation(inner, bound=1.0, frac_bits=16)", _build_secure,
                lambda inner, s: Traits.wrap(inner, name="secure_aggregation", secure=True)),
    "M": Piece("M", "rule", "fo.aggregators.mean()", _build_mean,
               lambda inner, s: Traits(name="mean", linear=True, sums=True)),
    "DP": Piece("DP", "rule", "fo.privacy.dp_mean(0.05, 0.0, expected_clients=5)", _build_dp,
                lambda inner, s: Traits(name="dp_mean", sums=True, private=True, noise_multiplier=s.noise_multiplier,
                                        clip_norm=s.clip_norm)),
    "R": Piece("R", "rule", "fo.aggregators.marginal_median()", _build_robust,
               lambda inner, s: Traits(name="marginal_median", robust=True)),
    "D": Piece("D", "downlink", "fo.compression.downlink(fo.compression.top_k(k=2))", _build_downlink,
               lambda inner, s: None if inner is None else dataclasses.replace(inner, downlink=s.downlink_name)),
}
RULES = ("M", "DP", "R")
WRAPPERS = ("A", "SA")

# The flags that make a piece protect (or corrupt) the updates, in `core.server.protecting_piece`'s order, and
# what each does, for the reasons.
_PROTECTING = (("attack", "replaces the updates the server receives"),
               ("secure", "hides each update behind a secure sum"),
               ("private", "clips and noises the updates"),
               ("robust", "is a robust rule over the updates"))


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """An algorithm of the matrix: whether it refuses a client stage, whether it refuses protecting pieces (and
  unknown ones), and the side channel that makes it refuse them."""

  name: str
  refuses_stage: bool = False
  refuses_protecting: bool = False
  side_channel: str = ""


ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm("fedavg"),
    "ditto": Algorithm("ditto"),
    "scaffold": Algorithm("scaffold", refuses_protecting=True,
                          side_channel="its control variate c moves by the plain sum of the exact Δc_i"),
    "feddyn": Algorithm("feddyn", refuses_stage=True, refuses_protecting=True,
                        side_channel="its correction h moves by the plain sum of the exact g_k changes"),
}


class Verdict(NamedTuple):
  """Whether a stack composes under an algorithm.

  composes: True when every constructor and the algorithm accept it.
  traits: the stack's traits (None when a constructor refuses it).
  refused_by: the constructor or factory that refuses ("chain", "corrupt", "secure_aggregation", an algorithm).
  pieces: the two pieces that do not compose, as the library's messages name them.
  reason: one line naming both.
  """

  composes: bool
  traits: Traits | None = None
  refused_by: str | None = None
  pieces: tuple[str, str] | None = None
  reason: str | None = None


class Cell(NamedTuple):
  stack: tuple[str, ...]
  algorithm: str
  verdict: Verdict

  @property
  def id(self) -> str:
    return f"{self.algorithm}:{'-'.join(self.stack)}"


def _check_stack(stack: Sequence[str]) -> tuple[str, ...]:
  stack = tuple(stack)
  if "D" in stack[:-1]:
    raise ValueError(f"composition: the downlink D stands last (it acts on the broadcast); got {'-'.join(stack)}.")
  unknown = [s for s in stack if s not in PIECES]
  if unknown:
    raise ValueError(f"composition: unknown piece {unknown[0]!r}; the pieces are {', '.join(PIECES)}.")
  rules = [s for s in stack if s in RULES]
  if len(rules) != 1:
    raise ValueError(f"composition: a stack has exactly one rule ({', '.join(RULES)}); got {'-'.join(stack)}.")
  if len(set(stack)) != len(stack):
    raise ValueError(f"composition: each piece at most once; got {'-'.join(stack)}.")
  after = stack[stack.index(rules[0]) + 1:]
  if any(s not in ("C", "D") for s in after):
    raise ValueError(f"composition: only a client stage can stand after the rule; got {'-'.join(stack)}.")
  return stack


def stacks() -> list[tuple[str, ...]]:
  """Every stack: for each rule, each ordering of a subset of {A, SA} around it, without C and with C at every
  position (outermost … after the rule): 21 per rule, 63 uplinks; each without and with D last: 126 in all."""
  uplinks = []
  for rule in RULES:
    for size in range(len(WRAPPERS) + 1):
      for wrappers in itertools.permutations(WRAPPERS, size):
        base = wrappers + (rule,)
        uplinks.append(base)
        uplinks.extend(base[:i] + ("C",) + base[i:] for i in range(len(base) + 1))
  return uplinks + [stack + ("D",) for stack in uplinks]


def expression(stack: Sequence[str]) -> str:
  """The stack as the constructors nest it: `chain(C, A(SA(DP)))`, `A(chain(C, M))`, `chain(M, C)`."""
  stack = _check_stack(stack)
  if stack[-1] == "D":
    return f"chain({expression(stack[:-1])}, D)"
  head, rest = stack[0], stack[1:]
  if head in RULES:
    return head if not rest else f"chain({head}, C)"
  if head == "C":
    return f"chain(C, {expression(rest)})"
  return f"{head}({expression(rest)})"


def _is_sum(traits: Traits) -> bool:
  """A sum over clients (a `StreamingSum`), read from the declared `Traits.sums` (a secure sum, an attack and a
  robust rule declare none: they have no streaming form)."""
  return traits.sums


def _stack_traits(stack: tuple[str, ...], s: Settings) -> Verdict:
  """The aggregator the stack builds, inside out, from traits: its traits, or the first constructor's refusal."""
  if stack[-1] == "D":  # chain(uplink, D): the uplink's refusal, or its traits with the downlink named
    uplink = _stack_traits(stack[:-1], s)
    return uplink if not uplink.composes else Verdict(True, PIECES["D"].traits(uplink.traits, s))
  rule_at = next(i for i, p in enumerate(stack) if p in RULES)
  rule = stack[rule_at]
  traits = PIECES[rule].traits(None, s)
  if rule_at + 1 < len(stack):  # chain(rule, C)
    return Verdict(False, None, "chain", (s.stage_name, traits.name),
                   f"chain: {s.stage_name} comes after {traits.name}: a client stage acts on what each client sends, "
                   f"before clipping, noise and secure summation; put it first.")
  for symbol in reversed(stack[:rule_at]):
    if symbol == "C":
      if traits.client_stage is not None:
        return Verdict(False, None, "chain", (s.stage_name, traits.client_stage),
                       f"chain: {s.stage_name} and {traits.client_stage} are both client stages.")
    elif symbol == "A":
      if traits.client_stage is not None:
        return Verdict(False, None, "corrupt", ("corrupt", traits.client_stage),
                       f"corrupt cannot compose with the client stage {traits.client_stage}: the attack acts on what "
                       f"the server receives; chain the stage in front of the attack.")
    elif symbol == "SA":
      if not _is_sum(traits):
        return Verdict(False, None, "secure_aggregation", ("secure_aggregation", traits.name),
                       f"secure_aggregation cannot wrap {traits.name}: it is not a sum over clients, and a secure "
                       f"sum reveals only the sum.")
      if traits.client_stage is not None:
        return Verdict(False, None, "secure_aggregation", ("secure_aggregation", traits.client_stage),
                       f"secure_aggregation cannot compose with the client stage {traits.client_stage}: the stage "
                       f"runs on the clients, before the secure sum; chain it in front of the wrapper.")
    traits = PIECES[symbol].traits(traits, s)
  return Verdict(True, traits)


def verdict(stack: Sequence[str], algorithm: str = "fedavg", settings: Settings = Settings()) -> Verdict:
  """Whether `stack` (module docstring) composes under `algorithm` (a key of `ALGORITHMS`), from traits only."""
  stack = _check_stack(stack)
  if algorithm not in ALGORITHMS:
    raise ValueError(f"composition: unknown algorithm {algorithm!r}; the algorithms are {', '.join(ALGORITHMS)}.")
  built = _stack_traits(stack, settings)
  if not built.composes:
    return built
  algo, traits = ALGORITHMS[algorithm], built.traits
  refuses_downlink = _refuses_downlink(algo.name)
  if traits.downlink is not None and refuses_downlink is not None:
    return Verdict(False, traits, algo.name, (algo.name, traits.downlink),
                   f"{algo.name} takes no downlink (got {traits.downlink} chained in aggregator=): "
                   f"{refuses_downlink}")
  if algo.refuses_stage and traits.client_stage is not None:
    return Verdict(False, traits, algo.name, (algo.name, traits.client_stage),
                   f"{algo.name} cannot compose with the client stage {traits.client_stage}: it needs the exact "
                   f"uploads ({algo.side_channel}).")
  if algo.refuses_protecting:
    for flag, what in _PROTECTING:
      if getattr(traits, flag):
        return Verdict(False, traits, algo.name, (algo.name, traits.name),
                       f"{algo.name} refuses {traits.name}: it {what}, but {algo.side_channel} outside the "
                       f"aggregator.")
  return Verdict(True, traits)


def _refuses_downlink(name: str) -> str | None:
  """The factory's declared reason for taking no downlink (`factory.downlink`), None when it takes one: read from
  the factory, the one place it is declared."""
  from fedjax_opt import algorithms  # pylint: disable=import-outside-toplevel
  from fedjax_opt.core.execution import TAKES_DOWNLINK  # pylint: disable=import-outside-toplevel
  declared = getattr(algorithms, name).downlink
  return None if declared == TAKES_DOWNLINK else declared


def cells(settings: Settings = Settings()) -> list[Cell]:
  """Every cell of the matrix: each stack of `stacks()` under each algorithm of `ALGORITHMS`, with its verdict."""
  return [Cell(stack, name, verdict(stack, name, settings)) for stack in stacks() for name in ALGORITHMS]


def build(stack: Sequence[str], settings: Settings = Settings()):
  """The stack built with the library's constructors (`PIECES[s].build`), inside out: raises what they raise.

  `chain(rule, C)` is built as the library would be asked for it: `chain(rule, stage)`.
  """
  from fedjax_opt import compression  # pylint: disable=import-outside-toplevel
  from fedjax_opt.aggregators.chain import chain  # pylint: disable=import-outside-toplevel
  stack = _check_stack(stack)
  if stack[-1] == "D":
    return PIECES["D"].build(build(stack[:-1], settings), settings)
  rule_at = next(i for i, p in enumerate(stack) if p in RULES)
  piece = PIECES[stack[rule_at]].build(None, settings)
  if rule_at + 1 < len(stack):
    return chain(piece, compression.compress(compression.top_k(k=settings.top_k)))
  for symbol in reversed(stack[:rule_at]):
    piece = PIECES[symbol].build(piece, settings)
  return piece


def _short(v: Verdict) -> str:
  return "exact" if v.composes else f"refused: {v.pieces[0]} × {v.pieces[1]}"


def markdown(settings: Settings = Settings()) -> str:
  """The matrix as docs/privacy.md shows it: one row per stack, its aggregator's verdict, then one column per
  algorithm ("exact": its round is checked against float64 NumPy; "refused: a × b": building it raises one line
  naming a and b)."""
  names = list(ALGORITHMS)
  lines = ["| # | stack | the aggregator | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
  for number, stack in enumerate(stacks(), 1):
    alone = _stack_traits(stack, settings)
    if alone.composes:
      described = f"`{alone.traits.describe()}`"
      columns = [_short(verdict(stack, name, settings)) for name in names]
    else:
      described = f"refused ({alone.refused_by}): {alone.reason}"
      columns = ["–"] * len(names)
    lines.append(f"| {number} | `{expression(stack)}` | {described} | " + " | ".join(columns) + " |")
  every = cells(settings)
  composing = sum(c.verdict.composes for c in every)
  lines.append("")
  lines.append(f"{len(every)} cells ({len(stacks())} stacks × {len(names)} algorithms): {composing} compose, "
               f"{len(every) - composing} are refused.")
  return "\n".join(lines) + "\n"
