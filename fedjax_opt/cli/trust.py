"""`--compression`, `--secure-aggregation` and `--downlink`: the client stage, the secure sum and the compressed
broadcast on the command line.

Each flag is the library's construction (docs/privacy.md), assembled in the
order of the aggregator seam, for every chosen algorithm:

    rule     = --aggregator NAME | the DP mean (--dp-*) | factory.default_aggregator() (its declared default)
    rule     = fo.privacy.secure_aggregation(rule, bound=B, frac_bits=F, dropout=Q)     --secure-aggregation
    rule     = fo.attacks.corrupt(rule, attack, ...)                                    an update --attack
    aggregator = fo.aggregators.chain(fo.compression.compress(C, error_feedback=EF,     --compression
                                                              num_clients=N), rule)
    aggregator = fo.aggregators.chain(aggregator, fo.compression.downlink(D, error_feedback=EF))   --downlink

* `--compression qsgd:BITS` is `fo.compression.qsgd(bits=BITS)`,
  `top_k:FRACTION[:ef]` `top_k(FRACTION)`, `rand_k:FRACTION` `rand_k(FRACTION)`,
  `sign[:ef]` the scaled `sign()`; `:ef` turns on error feedback (a residual
  per client, N = the dataset's clients). Error feedback is offered for the
  contractions (top-k, the scaled sign) only: with QSGD's or rand-k's
  variance the residual grows without bound (docs/privacy.md, "Error
  feedback"); use them unbiased.
* `--downlink SPEC` (the same grammar) compresses what the server
  broadcasts back, its step, with the server's error feedback when `:ef` is
  given (DoubleSqueeze's server side; docs/privacy.md, "Server to client").
  The algorithms whose factory applies a downlink take it (`factory.downlink`:
  FedAvg and FedOpt, FedSGD, FedProx, FedNova, Per-FedAvg, FedAvg + fine-tuning,
  Ditto, pFedMe); any other is refused in one line quoting its declared reason.
  The table's bits down are then the compressor's count.
* `--secure-aggregation [bound=B,frac_bits=F,dropout=Q]` wraps the rule,
  which must be a sum (the mean, the weighted mean or the DP mean; the
  library refuses a robust rule). B defaults to what the rule's sums need:
  max(C, ½) for the DP mean of clip norm C (a clipped update's coordinates
  lie within C, its count bit is ±½), 4 for the mean (its scalar is 1), and 4
  times the largest client's train examples for the weighted mean (its
  scalar is n_k, its coordinates n_k·Δ_k). F defaults to 16, Q to 0.
* An algorithm whose factory takes no `aggregator=` is refused, as for
  `--aggregator`; a combination the library refuses (FedDyn or CFL with a
  client stage; SCAFFOLD or FedDyn with secure aggregation; a robust rule
  inside secure aggregation; a ring too small for the round) is refused in
  one line, before anything is written, and so is a `bound` below the
  weighted mean's largest n_k, whose rounds the library would reject.

The bits a client sends are then the run's `bits_up` metric (the
compressor's count), which the table shows and "MB sent" counts, with
`bits_down` once per round for the broadcast. Secure aggregation's own
upload (the masked words, keys and shares) is reported as
`secure_upload_bits`, the last round's `SecureAggregationState.upload_bits`,
and the grid it was encoded on as `secure_frac_bits` (`.frac_bits`: f, or
f + k_t once an adaptive DP clip has shrunk and the grid followed it).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["COMPRESSION_GRAMMAR", "SECURE_GRAMMAR", "TrustError", "assemble", "check", "default_rule", "describe",
           "enabled", "secure_report", "shorten"]

COMPRESSION_GRAMMAR = "qsgd:BITS, top_k:FRACTION[:ef], rand_k:FRACTION or sign[:ef]"
SECURE_GRAMMAR = "bound=B,frac_bits=F,dropout=Q (each optional)"
SECURE_KEYS = ("bound", "frac_bits", "dropout")

BOUND_FACTOR = 4
"""Default `bound` of the mean and the weighted mean: this many times the scalar a client adds (module docstring)."""


class TrustError(ValueError):
  """A bad --compression / --secure-aggregation setting (one line)."""


def enabled(config: dict[str, Any]) -> bool:
  return any(config.get(key) is not None for key in ("compression", "secure_aggregation", "downlink"))


def shorten(message: str) -> str:
  """A library refusal in short: its first line, up to the end of its first sentence or a "; " (but "; got X",
  the value refused, is kept)."""
  import re

  text = message.splitlines()[0] if message else ""
  return re.split(r"\. |; (?!got )", text)[0].rstrip(".")


def _first_line(e: Exception) -> str:
  return shorten(str(e)) if str(e) else type(e).__name__


def compressor_of(spec: str, flag: str = "--compression"):
  """(`fo.compression` compressor, error feedback) for a --compression (or --downlink) spec, or a TrustError."""
  from fedjax_opt import compression

  parts = str(spec).strip().split(":")
  kind, args = parts[0], parts[1:]
  ef = bool(args) and args[-1] == "ef"
  if ef:
    args = args[:-1]
    if kind in ("qsgd", "rand_k"):
      raise TrustError(f"{flag} {spec}: error feedback (:ef) needs a contraction (top_k, sign); {kind} is "
                       f"unbiased, its error can exceed the message (few bits, a small fraction) and the residual "
                       f"then grows: drop :ef (fo.compression takes it in Python)")
  what = {"qsgd": "qsgd:BITS", "top_k": "top_k:FRACTION[:ef]", "rand_k": "rand_k:FRACTION", "sign": "sign[:ef]"}
  if kind not in what:
    raise TrustError(f"unknown compressor {kind!r} in {flag} {spec}; give {COMPRESSION_GRAMMAR}")
  if len(args) != (0 if kind == "sign" else 1):
    raise TrustError(f"{flag} {spec}: {kind} takes {what[kind]}")
  try:
    if kind == "sign":
      return compression.sign(), ef
    if kind == "qsgd":
      try:
        bits = int(args[0])
      except ValueError:
        raise TrustError(f"{flag} {spec}: qsgd takes qsgd:BITS, an integer number of bits") from None
      return compression.qsgd(bits=bits), ef
    try:
      fraction = float(args[0])
    except ValueError:
      raise TrustError(f"{flag} {spec}: {what[kind]}, FRACTION a number in (0, 1]") from None
    return getattr(compression, kind)(fraction), ef
  except (ValueError, TypeError) as e:
    if isinstance(e, TrustError):
      raise
    raise TrustError(f"{flag} {spec}: {_first_line(e)}") from None


def secure_options(value: Any) -> dict[str, Any]:
  """The --secure-aggregation options given (`bound`, `frac_bits`, `dropout`), checked by the library."""
  from fedjax_opt import aggregators, privacy

  text = "" if value is True else str(value).strip()
  options: dict[str, Any] = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or key not in SECURE_KEYS:
      raise TrustError(f"--secure-aggregation takes {SECURE_GRAMMAR}; got {item!r}")
    if key in options:
      raise TrustError(f"--secure-aggregation gives {key} twice")
    try:
      options[key] = int(raw) if key == "frac_bits" else float(raw)
    except ValueError:
      raise TrustError(f"--secure-aggregation {key} must be {'an integer' if key == 'frac_bits' else 'a number'}; "
                       f"got {raw.strip()!r}") from None
  try:  # the library's own range checks (bound > 0, 0 <= frac_bits <= 30, dropout in [0, 1])
    privacy.secure_aggregation(aggregators.mean(), **{"bound": 1.0, **options})
  except (ValueError, TypeError) as e:
    raise TrustError(f"--secure-aggregation {text}: {_first_line(e)}") from None
  return options


def check(config: dict[str, Any], names: list[str], registry) -> None:
  """Flag-level checks: the specs parse and the library takes their values; every chosen algorithm has an
  aggregator. Normalizes `config["compression"]` and `config["secure_aggregation"]` (`""`: the defaults)."""
  if config.get("compression") is not None:
    if not isinstance(config["compression"], str):
      raise TrustError(f"--compression takes {COMPRESSION_GRAMMAR}; got {config['compression']!r}")
    config["compression"] = config["compression"].strip()
    compressor_of(config["compression"])
  if config.get("downlink") is not None:
    if not isinstance(config["downlink"], str):
      raise TrustError(f"--downlink takes {COMPRESSION_GRAMMAR}; got {config['downlink']!r}")
    config["downlink"] = config["downlink"].strip()
    compressor_of(config["downlink"], "--downlink")
  secure = config.get("secure_aggregation")
  if secure is False:
    config["secure_aggregation"] = None
  elif secure is not None:
    if not isinstance(secure, (str, bool)):
      raise TrustError(f"--secure-aggregation takes {SECURE_GRAMMAR}; got {secure!r}")
    options = secure_options(secure)
    config["secure_aggregation"] = ",".join(f"{k}={options[k]:g}" for k in SECURE_KEYS if k in options)
  if not enabled(config):
    return
  what = (f"--compression {config['compression']}" if config.get("compression") is not None else
          " ".join(filter(None, ("--secure-aggregation", config["secure_aggregation"])))
          if config.get("secure_aggregation") is not None else f"--downlink {config['downlink']}")
  refusal = registry.refuse_aggregation(what, names)
  if refusal:
    raise TrustError(refusal)
  if config.get("downlink") is not None:
    refusal = registry.refuse_downlink(f"--downlink {config['downlink']}", names)
    if refusal:
      raise TrustError(refusal)


def default_rule(name: str):
  """The aggregator the factory of algorithm `name` uses when given none: the factory's own declaration,
  `factory.default_aggregator()` (`core.execution.accepts_policy_keywords`), the constructor its body resolves
  `aggregator=None` with."""
  from fedjax_opt.cli import registry

  constructor = getattr(registry.REGISTRY[name].factory, "default_aggregator", None)
  if constructor is None:
    raise TrustError(f"{name} declares no default aggregator (its factory takes no aggregator=)")
  return constructor()


def _bound(rule_name: str, config: dict[str, Any], max_train: int) -> float:
  if rule_name == "dp_mean":
    return max(float(config["dp_clip"]), 0.5)
  if rule_name == "mean":
    return float(BOUND_FACTOR)
  return float(BOUND_FACTOR * max_train)


def assemble(name: str, config: dict[str, Any], rule, corrupt, *, params, num_clients: int, max_train: int,
             slots: int) -> tuple[Any, dict[str, Any]]:
  """(the aggregator of algorithm `name`, what was used) from the run's pieces (module docstring).

  `rule` is `--aggregator`'s rule or the DP mean (None: none given), `corrupt` None or `corrupt(inner)` (an update
  attack). Without --compression and --secure-aggregation the result is what the run had before: `rule`, or
  `corrupt(rule or weighted_mean())`, or None (the factory's default). `params` (the initial model), `slots` (the
  round's client slots) and `max_train` let secure aggregation's checks run here, before anything is written.
  """
  from fedjax_opt import aggregators, compression, privacy
  from fedjax_opt.cli import privacy as dp_flags

  used: dict[str, Any] = {}
  if not enabled(config):
    return (corrupt(rule or aggregators.weighted_mean()) if corrupt is not None else rule), used
  if rule is None:
    rule = aggregators.weighted_mean() if corrupt is not None else default_rule(name)  # --attack: the weighted mean
  rule_name = "dp_mean" if dp_flags.enabled(config) else (config.get("aggregator") or rule.traits.name)
  if config.get("secure_aggregation") is not None:
    options = secure_options(config["secure_aggregation"])
    options.setdefault("bound", _bound(rule_name, config, max_train))
    options.setdefault("frac_bits", 16)
    options.setdefault("dropout", 0.0)
    if rule_name == "weighted_mean" and options["bound"] < max_train:  # the library rejects such a client's rounds
      raise TrustError(f"--secure-aggregation bound={options['bound']:g} is below n_k = {max_train}, the weight the "
                       f"weighted mean's largest client adds to the sum, so the rounds it takes part in would be "
                       f"rejected; use bound >= {max_train}, or leave bound out ({BOUND_FACTOR} × {max_train})")
    try:
      rule = privacy.secure_aggregation(rule, **options)
    except (ValueError, TypeError) as e:
      raise TrustError(f"--secure-aggregation with {rule_name}: {_first_line(e)}") from None
    largest = math.ceil(options["bound"] * 2 ** options["frac_bits"]) + 1
    if slots * largest >= 2**31:  # the library's trace-time check, made before anything is written
      raise TrustError(f"--secure-aggregation: the ring Z_(2^32) cannot hold the sum of {slots} contributions of up "
                       f"to bound B = {options['bound']:g} with frac_bits f = {options['frac_bits']}: needs "
                       f"C·(ceil(B·2^f) + 1) < 2^31; lower frac_bits or bound")
    try:
      rule.init(params)  # the library's init checks: a bound below the count, a grid too coarse for the clip norm
    except (ValueError, TypeError) as e:
      raise TrustError(f"--secure-aggregation: {_first_line(e)}") from None
    used["secure_aggregation"] = {"inner": rule_name, **options}
  if corrupt is not None:
    rule = corrupt(rule)
  if config.get("compression") is not None:
    compressor, ef = compressor_of(config["compression"])
    stage = compression.compress(compressor, error_feedback=ef, num_clients=num_clients if ef else None)
    try:
      rule = aggregators.chain(stage, rule)
    except (ValueError, TypeError) as e:
      raise TrustError(f"--compression {config['compression']}: {_first_line(e)}") from None
    used["compression"] = {"spec": config["compression"], "compressor": compressor.name, "error_feedback": ef}
  if config.get("downlink") is not None:
    compressor, ef = compressor_of(config["downlink"], "--downlink")
    try:
      rule = aggregators.chain(rule, compression.downlink(compressor, error_feedback=ef))
    except (ValueError, TypeError) as e:
      raise TrustError(f"--downlink {config['downlink']}: {_first_line(e)}") from None
    used["downlink"] = {"spec": config["downlink"], "compressor": compressor.name, "error_feedback": ef}
  return rule, used


def secure_report(state, seeds: int) -> dict[str, Any]:
  """The last round's secure-aggregation diagnostics found in `state` ({} without secure aggregation)."""
  import jax
  import numpy as np

  from fedjax_opt.privacy import SecureAggregationState

  found = [x for x in jax.tree.leaves(state.aggregator_state, is_leaf=lambda x: isinstance(x, SecureAggregationState))
           if isinstance(x, SecureAggregationState)]
  if not found:
    return {}
  s = found[0]
  first = (lambda v: np.asarray(v).reshape(-1)[0]) if seeds > 1 else np.asarray
  return {"secure_upload_bits": float(first(s.upload_bits)), "secure_num_dropped": int(first(s.num_dropped)),
          "secure_num_clipped": int(first(s.num_clipped)), "secure_frac_bits": int(first(s.frac_bits))}


def describe(config: dict[str, Any]) -> str:
  """`, compression top_k:0.1:ef, secure aggregation, downlink top_k:0.1` for the plots' titles; empty without
  any."""
  out = ""
  if config.get("compression") is not None:
    out += f", compression {config['compression']}"
  if config.get("downlink") is not None:
    out += f", downlink {config['downlink']}"
  if config.get("secure_aggregation") is not None:
    out += ", secure aggregation" + (f" ({config['secure_aggregation']})" if config["secure_aggregation"] else "")
  return out
