"""`--aggregator`, `--attack` and `--attackers`: robust aggregation and simulated attacks on the command line.

Both are named like their library functions (`fo.aggregators.*`, `fo.attacks.*`)
and take their parameters from `--set aggregator.NAME=VALUE` and
`--set attack.NAME=VALUE` (or `[aggregator]` / `[attack]` TOML sections),
checked against the function's signature like an algorithm's.

* `--aggregator NAME` replaces the aggregator of every chosen algorithm; an
  algorithm whose factory takes no `aggregator` (L2GD, the ADMM family, ...)
  is an error.
* `--attack NAME --attackers F`: a model-update attack wraps the aggregator
  (`fo.attacks.corrupt`: the attackers' rows of the round's stacked updates are
  replaced before aggregation; with no `--aggregator`, the weighted mean), and
  needs the same `aggregator` keyword; `label_flip` poisons the data of a fixed
  fraction F of the dataset's clients (`fo.attacks.poison`) and works with every
  algorithm.

Defaults that depend on the run: `num_byzantine` (MeaMed, Krum, Bulyan) is
the number of attackers per round, ⌊F · C⌋ (at least 1), and `trimmed_mean`'s
`beta` is F, when an attack is simulated; 1 and 0.1 otherwise.

The rules that need enough clients in the round for their f = `num_byzantine`
(`ROW_RULES`: Krum and Multi-Krum n ≥ 2f + 3, Bulyan n ≥ 4f + 3, MeaMed
n ≥ f + 1; Multi-Krum's m ≤ n) and the trimmed mean's β < 1/2 are checked
with the flags (`check_rows`), before anything is written: n is the clients
whose updates one round aggregates, `--clients-per-round` for the algorithms
that sample clients and `--num-clients` for those that take every client
(CFL). A refusal is one line naming the flags that set f and n, and what
would satisfy the rule.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

__all__ = ["ROW_RULES", "RobustError", "build", "check", "check_rows", "describe"]


class _FromRun:
  """A default filled in from the run (`num_byzantine`, `beta`)."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


BYZANTINE = _FromRun("⌊attackers × clients per round⌋")
FRACTION = _FromRun("--attackers")


def _aggregators() -> dict[str, tuple[Any, dict[str, Any]]]:
  from fedjax_opt import aggregators as a

  return {
      "weighted_mean": (a.weighted_mean, {}),
      "mean": (a.mean, {}),
      "marginal_median": (a.marginal_median, {}),
      "mean_around_median": (a.mean_around_median, {"num_byzantine": BYZANTINE}),
      "geometric_median": (a.geometric_median, {}),
      "trimmed_mean": (a.trimmed_mean, {"beta": FRACTION}),
      "krum": (a.krum, {"num_byzantine": BYZANTINE}),
      "multi_krum": (a.multi_krum, {"num_byzantine": BYZANTINE}),
      "bulyan": (a.bulyan, {"num_byzantine": BYZANTINE}),
      "centered_clipping": (a.centered_clipping, {"tau": 1.0}),
  }


def _attacks() -> dict[str, tuple[Any, dict[str, Any]]]:
  from fedjax_opt import attacks as t

  return {
      "gaussian": (t.gaussian, {"scale": 10.0}),
      "omniscient": (t.omniscient, {"factor": 10.0}),
      "sign_flip": (t.sign_flip, {"scale": 1.0}),
      "ipm": (t.ipm, {"epsilon": 0.5}),
      "alie": (t.alie, {"z": None}),
      "generalized_byzantine": (t.generalized_byzantine, {"fraction": 0.3, "values": 100.0}),
      "label_flip": (t.label_flip, {}),
  }


AGGREGATOR_NAMES = ("weighted_mean", "mean", "marginal_median", "mean_around_median", "geometric_median",
                    "trimmed_mean", "krum", "multi_krum", "bulyan", "centered_clipping")
ATTACK_NAMES = ("gaussian", "omniscient", "sign_flip", "ipm", "alie", "generalized_byzantine", "label_flip")


class RobustError(ValueError):
  """A bad --aggregator / --attack setting (one line)."""


def describe() -> dict[str, str]:
  """`name: defaults` for `fedjax-opt list aggregators` / `attacks`."""
  out = {}
  for kind, table in (("aggregator", _aggregators()), ("attack", _attacks())):
    for name, (fn, defaults) in table.items():
      params = {k: p.default for k, p in inspect.signature(fn).parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
      params.update(defaults)
      params.pop("num_classes", None)
      params.pop("field", None)
      shown = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in params.items())
      out[f"{kind} {name}"] = (inspect.getdoc(fn) or "").splitlines()[0] + (f"\n    {shown}" if shown else "")
  return out


def _resolve(kind: str, name: str, table: dict, overrides: dict[str, Any], fill: dict[str, Any]) -> tuple[Any, dict]:
  fn, defaults = table[name]
  params = inspect.signature(fn).parameters
  settable = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  settable -= {"num_classes", "field"}
  for key in overrides:
    if key not in settable:
      raise RobustError(f"{kind} {name} has no parameter {key!r}; settable: {', '.join(sorted(settable)) or 'none'}")
  values = {k: fill.get(k, v) if isinstance(v, _FromRun) else v for k, v in defaults.items()}
  values.update(overrides)
  return fn, values


def build(config: dict[str, Any], clients_per_round: int, num_classes: int) -> tuple[Any, Any, Any, dict[str, Any]]:
  """(rule or None, corrupt or None, data attack (a function of the algorithm) or None, what was used).

  `corrupt(inner)` wraps an aggregator in the update attack (`fo.attacks.corrupt`); the run gives it the rule, the
  weighted mean when no `--aggregator` is given, with secure aggregation in between (`fedjax_opt.cli.trust`).
  """
  from fedjax_opt import aggregators, attacks

  name, attack, fraction = config["aggregator"], config["attack"], config["attackers"]
  hyper = config["hyper"]
  per_round = math.floor(fraction * clients_per_round) if attack else 0
  fill = {"num_byzantine": max(1, per_round), "beta": fraction if attack else 0.1}
  used: dict[str, Any] = {}
  rule = None
  if name is not None:
    fn, values = _resolve("aggregator", name, _aggregators(), hyper.get("aggregator", {}), fill)
    try:
      rule = fn(**values)
    except (ValueError, TypeError) as e:
      raise RobustError(f"aggregator {name}: {str(e).splitlines()[0]}") from None
    used["aggregator"] = {"name": name, **values}
  poison = corrupt = None
  if attack is not None:
    fn, values = _resolve("attack", attack, _attacks(), hyper.get("attack", {}), fill)
    try:
      if attack == "label_flip":
        flip = fn(num_classes, **values)
        seed = config["seed"]
        poison = lambda algo, n: attacks.poison(algo, flip, attackers=fraction, num_clients=n, seed=seed)
      else:
        if attack == "generalized_byzantine" and isinstance(values.get("values"), str):
          raise RobustError("attack generalized_byzantine: values must be a number")
        made = fn(**values)
        corrupt = lambda inner: attacks.corrupt(inner, made, attackers=fraction, seed=config["seed"])
        corrupt(rule or aggregators.weighted_mean())  # the attack's own checks, now
    except (ValueError, TypeError) as e:
      raise RobustError(f"attack {attack}: {str(e).splitlines()[0]}") from None
    used["attack"] = {"name": attack, "attackers": fraction, **values}
  return rule, corrupt, poison, used


ROW_RULES = {
    "krum": ("n > 2f + 2", lambda f: 2 * f + 3),
    "multi_krum": ("n > 2f + 2", lambda f: 2 * f + 3),
    "bulyan": ("n ≥ 4f + 3", lambda f: 4 * f + 3),
    "mean_around_median": ("n > f", lambda f: f + 1),
}
"""`--aggregator NAME`: (its condition on the n clients of a round, in words; the least n for f = num_byzantine),
the conditions `fo.aggregators` checks when it traces a round."""


def _byzantine(config: dict[str, Any], clients: int) -> int:
  """`num_byzantine` as `build` fills it for rounds of `clients` clients (the run's --clients-per-round)."""
  per_round = math.floor(config["attackers"] * clients) if config["attack"] else 0
  return max(1, per_round)


def _is_count(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_rows(config: dict[str, Any], names: list[str], registry, num_clients: int | None) -> None:
  """`--aggregator`'s conditions on the clients of a round (`ROW_RULES`, the trimmed mean's β < 1/2), checked with
  the flags; `num_clients` is the dataset's N (None: not known yet, the algorithms that take every client are
  checked once it is). A refusal names the flags and what would satisfy the rule."""
  name = config["aggregator"]
  if name is None:
    return
  settings = config["hyper"].get("aggregator", {})
  attackers = config["attackers"] if config["attack"] else None
  if name == "trimmed_mean":
    beta = settings.get("beta", attackers)
    if isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta >= 0.5:
      what = "--aggregator trimmed_mean trims a fraction β of the values at each end and needs β < 0.5"
      if "beta" in settings:
        raise RobustError(f"{what}; --set aggregator.beta={beta:g} gives β = {beta:g}: give a smaller β")
      raise RobustError(f"{what}; β is --attackers {beta:g} unless given: lower --attackers below 0.5, or give β "
                        f"with --set aggregator.beta=B")
  if name not in ROW_RULES:
    return
  condition, least = ROW_RULES[name]
  cpr = config["clients_per_round"]
  groups: dict[tuple[int, str], list[str]] = {}
  for algo in names:
    spec = registry.REGISTRY[algo]
    if not spec.takes_aggregator:
      continue
    if spec.sampling == "clients":
      groups.setdefault((cpr, "--clients-per-round"), []).append(algo)
    elif num_clients is not None:  # CFL: every client's update, every round
      groups.setdefault((num_clients, "--num-clients"), []).append(algo)
  fixed = settings.get("num_byzantine")
  if fixed is not None and not _is_count(fixed):
    return  # the aggregator's own check says what is wrong with it (`build`)
  f = fixed if fixed is not None else _byzantine(config, cpr)
  if fixed is not None:
    source = f"--set aggregator.num_byzantine={f} gives f = {f}"
  elif attackers is not None:
    source = f"--attackers {attackers:g} of --clients-per-round {cpr} give f = ⌊{attackers:g} × {cpr}⌋" + \
        (f" = {f}" if f == math.floor(attackers * cpr) else f", at least 1: {f}")
  else:
    source = f"without --attack, f = {f} (num_byzantine's default)"
  m = settings.get("m")
  for (n, flag), algos in groups.items():
    who = f" ({', '.join(algos)} aggregate(s) every client's update)" if flag == "--num-clients" else ""
    if name == "multi_krum" and _is_count(m) and m > n:
      raise RobustError(f"--aggregator multi_krum averages m = {m} updates (--set aggregator.m={m}), more than "
                        f"the {n} clients of a round ({flag} {n}{who}); lower m to at most {n}")
    if n >= least(f):
      continue
    advice = []
    if flag == "--clients-per-round":
      limit = num_clients if num_clients is not None else config["num_clients"]
      top = limit if limit is not None else max(100, 10 * n)
      if fixed is not None or attackers is None:
        enough = least(f) if least(f) <= top else None
      else:
        enough = next((c for c in range(n + 1, top + 1) if c >= least(_byzantine(config, c))), None)
      if enough is not None:
        advice.append(f"raise --clients-per-round to {enough}")
    most = max((g for g in range(f) if least(g) <= n), default=None)  # the largest f the round allows
    if most is not None and attackers is not None and fixed is None:
      if most >= 1:
        advice.append(f"lower --attackers below {(most + 1) / n:g} (at most {most} of {n} clients)")
    elif most is not None:
      advice.append(f"give --set aggregator.num_byzantine={most}")
    if not advice:
      advice.append("choose an aggregator without this bound (--aggregator mean_around_median, marginal_median, "
                    "geometric_median or trimmed_mean)")
    raise RobustError(f"--aggregator {name} needs {condition} clients in a round (f = num_byzantine); {source}, so "
                      f"n ≥ {least(f)}, but {flag} gives n = {n}{who}: {' or '.join(advice)}")


def check(config: dict[str, Any], names: list[str], registry) -> None:
  """Flag-level checks: known names, attackers in (0, 1], every chosen algorithm takes an aggregator if needed."""
  if config["aggregator"] is not None and config["aggregator"] not in AGGREGATOR_NAMES:
    raise RobustError(f"unknown aggregator {config['aggregator']!r}; choose from {', '.join(AGGREGATOR_NAMES)}")
  if config["attack"] is not None and config["attack"] not in ATTACK_NAMES:
    raise RobustError(f"unknown attack {config['attack']!r}; choose from {', '.join(ATTACK_NAMES)}")
  if config["attack"] is None and config["attackers"] is not None:
    raise RobustError("--attackers needs --attack NAME (the attack they run)")
  if config["attack"] is not None:
    if config["attackers"] is None:
      config["attackers"] = 0.2
    f = config["attackers"]
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
      raise RobustError(f"--attackers is the fraction of attacking clients, in (0, 1]; got {f!r}")
  for section, flag in (("aggregator", "--aggregator"), ("attack", "--attack")):
    if section in config["hyper"] and config[section] is None:
      raise RobustError(f"--set {section}.… is given without {flag} NAME")
  needs = config["aggregator"] is not None or config["attack"] not in (None, "label_flip")
  if needs:
    what = f"--aggregator {config['aggregator']}" if config["aggregator"] else f"--attack {config['attack']}"
    refusal = registry.refuse_aggregation(what, names)
    if refusal:
      raise RobustError(refusal + (" (--attack label_flip needs none)" if config["attack"] else ""))
