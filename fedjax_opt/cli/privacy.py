"""`--dp-noise`, `--dp-epsilon` and friends: DP-FedAvg on the command line, with ε in the results.

* `--dp-noise σ --dp-clip C` gives every chosen algorithm the aggregator
  `fo.privacy.dp_mean(C, σ, expected_clients=m)`; `--dp-epsilon ε` instead
  solves σ for ε after the run's `--rounds` (stored in `config.json` as
  `dp_noise_multiplier`, so `--resume` keeps it; a resumed run given more
  rounds keeps σ and reports the larger ε it then has).
* `--dp-sampling fixed` (default): the run samples its `--clients-per-round`
  clients as always, m = C without replacement, and the accountant is given
  `SampledWithoutReplacementDpEvent` (RDP only). `--dp-sampling poisson`:
  each client with probability q = C/N in `fo.privacy.poisson_cap(N, q)`
  slots, and the accountant is given the (truncated) Poisson event; its
  default accountant is PLD.
* `--dp-quantile γ` turns on adaptive clipping (`--dp-clip` is then the
  initial clip norm; `--dp-clip-lr`, `--dp-count-noise` its η_C and σ_b).
* ε(δ) is computed on the host after training, at every evaluation round, and
  written to `results.json` (`dp_epsilon`, `privacy`) and `history.json`
  (`dp_epsilon`); the table shows the final ε.

Differential privacy here covers algorithms whose model sees the clients only
through the aggregate (`DP_ALGORITHMS`); it does not combine with a robust
`--aggregator` or an update `--attack` (both replace the aggregation).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PrivacyError", "build", "check", "describe", "enabled", "report", "sampling", "train_kwargs"]

DP_ALGORITHMS = ("fedsgd", "fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "fedprox")
"""Algorithms whose model depends on the clients only through the aggregated update (so DP of the aggregate
covers the model). SCAFFOLD and FedDyn keep per-client state on the server, FedNova rescales by the clients' step
counts, the personalized methods store or release per-client models: not covered. A subset of the algorithms whose
factory takes `aggregator=` (`factory.aggregation`); one that takes none is refused first, with its declared reason."""

SAMPLINGS = ("fixed", "poisson")
DEFAULT_DELTA = 1e-5
DEFAULT_CLIP_LR = 0.2

KEYS = ("dp_noise", "dp_clip", "dp_delta", "dp_epsilon", "dp_accountant", "dp_sampling", "dp_quantile", "dp_clip_lr",
        "dp_count_noise", "dp_noise_multiplier")
"""The run configuration's privacy keys (`dp_noise_multiplier`: the σ in use, given or solved)."""


class PrivacyError(ValueError):
  """A bad --dp-* setting (one line)."""


def enabled(config: dict[str, Any]) -> bool:
  return config.get("dp_noise") is not None or config.get("dp_epsilon") is not None


def _flag(key: str) -> str:
  return "--" + key.replace("_", "-")


def _number(config: dict, key: str, low: float, high: float = math.inf, *, low_open: bool = True,
                high_open: bool = True) -> None:
  value = config[key]
  if value is None:
    return
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if ok:
    ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
  if not ok:
    bounds = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    raise PrivacyError(f"{_flag(key)} must be a number in {bounds}; got {value!r}")


def check(config: dict[str, Any], names: list[str]) -> None:
  """Flag-level checks (before anything is built); fills the defaults of a DP run."""
  given = [k for k in KEYS if k != "dp_noise_multiplier" and config.get(k) is not None]
  if not enabled(config):
    if given:
      raise PrivacyError(f"{_flag(given[0])} needs --dp-noise SIGMA or --dp-epsilon EPS (differential privacy is off)")
    config["dp_noise_multiplier"] = None
    return
  if config["dp_noise"] is not None and config["dp_epsilon"] is not None:
    raise PrivacyError("give --dp-noise (the noise multiplier) or --dp-epsilon (a target ε that the noise multiplier "
                       "is solved for), not both")
  if config["dp_clip"] is None:
    raise PrivacyError("differential privacy needs --dp-clip C, the L2 bound of a client's update")
  _number(config, "dp_noise", 0, low_open=False)
  _number(config, "dp_clip", 0)
  _number(config, "dp_epsilon", 0)
  config["dp_delta"] = DEFAULT_DELTA if config["dp_delta"] is None else config["dp_delta"]
  _number(config, "dp_delta", 0, 1)
  config["dp_sampling"] = config["dp_sampling"] or "fixed"
  if config["dp_sampling"] not in SAMPLINGS:
    raise PrivacyError(f"--dp-sampling must be one of {', '.join(SAMPLINGS)}; got {config['dp_sampling']!r}")
  config["dp_accountant"] = config["dp_accountant"] or ("rdp" if config["dp_sampling"] == "fixed" else "pld")
  if config["dp_accountant"] not in ("rdp", "pld"):
    raise PrivacyError(f"--dp-accountant must be rdp or pld; got {config['dp_accountant']!r}")
  if config["dp_sampling"] == "fixed" and config["dp_accountant"] == "pld":
    raise PrivacyError("--dp-accountant pld has no event for fixed-size sampling without replacement: use "
                       "--dp-accountant rdp, or --dp-sampling poisson")
  if config["dp_quantile"] is None:
    for key in ("dp_clip_lr", "dp_count_noise"):
      if config[key] is not None:
        raise PrivacyError(f"{_flag(key)} applies to adaptive clipping: give --dp-quantile GAMMA too")
  else:
    _number(config, "dp_quantile", 0, 1)
    _number(config, "dp_clip_lr", 0)
    _number(config, "dp_count_noise", 0)
  from fedjax_opt.cli import registry

  flag = (f"--dp-noise {config['dp_noise']:g}" if config["dp_noise"] is not None else
          f"--dp-epsilon {config['dp_epsilon']:g}")
  refusal = registry.refuse_aggregation(flag, names)  # the DP mean is an aggregator= (factory.aggregation)
  if refusal:
    raise PrivacyError(refusal)
  without = [n for n in names if n not in DP_ALGORITHMS]
  if without:
    raise PrivacyError(f"differential privacy (--dp-noise / --dp-epsilon) covers algorithms whose model sees the "
                       f"clients only through the aggregate ({', '.join(DP_ALGORITHMS)}), not {', '.join(without)}")
  if config["aggregator"] is not None:
    raise PrivacyError(f"--dp-noise / --dp-epsilon replace the aggregator with the DP mean, so --aggregator "
                       f"{config['aggregator']} cannot be used with them")
  if config["attack"] not in (None, "label_flip"):
    raise PrivacyError(f"--attack {config['attack']} corrupts the aggregation, which differential privacy replaces; "
                       f"use --attack label_flip, or run without --dp-*")
  if config["dp_noise"] is not None:
    config["dp_noise_multiplier"] = config["dp_noise"]
  elif config.get("dp_noise_multiplier") is not None:  # a resumed --dp-epsilon run: the σ it was solved to
    _number(config, "dp_noise_multiplier", 0, low_open=False)


def sampling(config: dict[str, Any], num_clients: int):
  """The run's `fo.privacy.Sampling`."""
  from fedjax_opt import privacy

  m = config["clients_per_round"]
  if config["dp_sampling"] == "fixed":
    return privacy.Sampling.fixed(num_clients, m)
  return privacy.Sampling.poisson(num_clients, m / num_clients)


def build(config: dict[str, Any], num_clients: int, say: Callable[..., None] = print):
  """(aggregator, sampling) of a DP run; solves σ for --dp-epsilon (into `config["dp_noise_multiplier"]`, which
  `config.json` keeps: a resumed run reuses it), saying so first (the solve takes seconds)."""
  import time

  from fedjax_opt import privacy

  plan = sampling(config, num_clients)
  try:
    privacy.round_event(1.0, plan, config["dp_accountant"])
  except privacy.UnsupportedAccountingError:
    raise PrivacyError(f"--dp-sampling poisson pads each round to {plan.clients_per_round} of the {num_clients} "
                       f"clients (fo.privacy.poisson_cap), a truncated Poisson sample that only the PLD accountant "
                       f"accounts: use --dp-accountant pld") from None
  try:
    if config["dp_noise_multiplier"] is None:
      say(f"solving the noise multiplier for ε = {config['dp_epsilon']:g} after {config['rounds']} rounds "
          f"({config['dp_accountant'].upper()} accountant, {plan.describe()}) ...")
      sys.stdout.flush()
      start = time.perf_counter()
      config["dp_noise_multiplier"] = privacy.noise_multiplier_for(
          config["dp_epsilon"], config["rounds"], delta=config["dp_delta"], sampling=plan,
          accountant=config["dp_accountant"])
      say(f"  noise multiplier {config['dp_noise_multiplier']:.4f} ({time.perf_counter() - start:.1f} s)")
    adaptive = None
    if config["dp_quantile"] is not None:
      adaptive = privacy.AdaptiveClipping(config["dp_quantile"], config["dp_clip_lr"] or DEFAULT_CLIP_LR,
                                          config["dp_count_noise"])
    aggregator = privacy.dp_mean(config["dp_clip"], config["dp_noise_multiplier"],
                                 expected_clients=plan.expected_clients, adaptive=adaptive)
  except (ValueError, TypeError) as e:
    raise PrivacyError(str(e).splitlines()[0]) from None
  return aggregator, plan


def train_kwargs(plan) -> dict[str, Any]:
  """The fields of `fo.Sampling` that draw clients as `plan` says."""
  return plan.train_kwargs()


def report(config: dict[str, Any], plan, eval_rounds: list[int], state, seeds: int) -> dict[str, Any]:
  """`results.json`'s privacy entries: ε at every evaluation round (host-side accounting), the final clip norm."""
  import jax
  import numpy as np

  from fedjax_opt import privacy

  rounds = tuple(sorted(set(int(r) for r in eval_rounds)))
  eps = _epsilons(config["dp_noise_multiplier"], config["dp_delta"], plan, config["dp_accountant"], rounds)
  event, relation = privacy.round_event(config["dp_noise_multiplier"], plan, config["dp_accountant"])
  dp_state = next(x for x in jax.tree.leaves(state.aggregator_state, is_leaf=lambda x: isinstance(x, privacy.DPMeanState))
                  if isinstance(x, privacy.DPMeanState))  # alone, behind a compression stage or in a secure sum
  clip = np.asarray(dp_state.clip_norm, np.float64)
  info = {
      "epsilon": float(eps[-1]) if len(eps) else None, "delta": config["dp_delta"],
      "noise_multiplier": config["dp_noise_multiplier"], "target_epsilon": config["dp_epsilon"],
      "clip_norm": config["dp_clip"], "final_clip_norm": clip.tolist() if seeds > 1 else float(clip),
      "adaptive_quantile": config["dp_quantile"], "accountant": config["dp_accountant"],
      "sampling": plan.describe(), "expected_clients": plan.expected_clients,
      "event": repr(event), "neighboring_relation": relation.name,
      "epsilon_at_rounds": {str(r): float(e) for r, e in zip(rounds, eps)},
  }
  return info


@functools.lru_cache(maxsize=8)
def _epsilons(sigma: float, delta: float, plan, accountant: str, rounds: tuple[int, ...]):
  """ε at `rounds`, computed once per run (every algorithm of a run shares σ, δ and the sampling)."""
  import numpy as np

  from fedjax_opt import privacy

  if not rounds:
    return np.zeros(0)
  return privacy.epsilons(sigma, delta=delta, sampling=plan, accountant=accountant, at=list(rounds))


def describe(config: dict[str, Any]) -> str:
  """`, DP σ=1, C=0.5 (fixed, rdp)` for the plots' titles; empty without DP."""
  if not enabled(config):
    return ""
  sigma = config.get("dp_noise_multiplier")
  clip = f"C₀={config['dp_clip']:g} adaptive γ={config['dp_quantile']:g}" if config.get("dp_quantile") else \
      f"C={config['dp_clip']:g}"
  return (f", DP σ={sigma:.3g}, {clip}, δ={config['dp_delta']:g} ({config['dp_sampling']}, "
          f"{config['dp_accountant']})") if sigma is not None else ""
