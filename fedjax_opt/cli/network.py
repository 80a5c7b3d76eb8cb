"""The command line's decentralized and asynchronous runs: `--topology`, `--async` and `--delay`.

* `--topology NAME` is the graph of the decentralized algorithms (gossip,
  dpsgd, gradient_tracking, d_fedem, p2p_bayes): every client is a node, every
  node trains (p2p_bayes: updates its beliefs) every round on S batches of B
  examples, and talks only to its neighbours through the graph's
  Metropolis–Hastings mixing matrix (`fedjax_opt.graphs`; `matchings` is a
  time-varying sequence of matrices). The default is `ring` whenever a
  decentralized algorithm is named.
* `--async` runs every algorithm on a simulated wall clock
  (`fedjax_opt.core.asynchrony`). The asynchronous algorithms (fedbuff,
  fedasync, co_op, zeno_plus_plus) need it: M = --clients-per-round clients
  are in flight at any time, each server event handles one arrival, and
  `--rounds R` runs R × M events, the client updates of R synchronous rounds
  of M clients. A synchronous algorithm's round waits for its slowest client
  (`core.asynchrony.synchronous_clock`). Results carry the simulated time;
  `accuracy_time.png` draws accuracy against it.
* `--delay DIST` is each client's compute time in the simulation:
  `exp:MEAN` (the default, `exp:1`), `const:VALUE` or `lognormal:MU,SIGMA`
  (heavy-tailed stragglers).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["DEFAULT_DELAY", "DELAYS", "MATCHING_PERIOD", "NetworkError", "TOPOLOGIES", "check", "compute_time",
           "default_algorithms", "describe", "graph"]

TOPOLOGIES = ("ring", "torus", "exponential", "complete", "erdos_renyi", "matchings")
DELAYS = ("exp:MEAN", "const:VALUE", "lognormal:MU,SIGMA")
DEFAULT_DELAY = "exp:1"
MATCHING_PERIOD = 64
"""Rounds of random matchings drawn for `--topology matchings` (round k uses matching k mod 64)."""


class NetworkError(ValueError):
  """A bad --topology / --async / --delay (reported as one line)."""


def _families(names: list[str], registry: Any) -> dict[str, list[str]]:
  out: dict[str, list[str]] = {}
  for name in names:
    out.setdefault(registry.REGISTRY[name].family, []).append(name)
  return out


def parse_delay(text: Any) -> tuple[str, tuple[float, ...]]:
  """`exp:2` → ("exp", (2.0,)); one line naming --delay when the text is not one of `DELAYS`."""
  kinds = {"exp": 1, "const": 1, "lognormal": 2}
  kind, _, rest = str(text).partition(":")
  try:
    values = tuple(float(v) for v in rest.split(",")) if rest else ()
  except ValueError:
    values = None
  if kind not in kinds or values is None or len(values) != kinds[kind] or not all(map(math.isfinite, values)):
    raise NetworkError(f"--delay must be one of {', '.join(DELAYS)}; got {text!r}")
  if kind == "exp" and values[0] <= 0 or kind == "const" and values[0] < 0 or kind == "lognormal" and values[1] < 0:
    raise NetworkError(f"--delay {text}: a mean must be > 0, a constant and a sigma >= 0")
  return kind, values


def compute_time(text: str):
  """The `core.asynchrony` distribution of `--delay`."""
  from fedjax_opt.core import asynchrony

  kind, values = parse_delay(text)
  return {"exp": asynchrony.exponential, "const": asynchrony.constant, "lognormal": asynchrony.lognormal}[kind](
      *values)


def check(config: dict[str, Any], names: list[str], registry: Any) -> None:
  """Flag-level checks; fills the defaults (`topology` ring, `delay` exp:1, the algorithms of `--async`)."""
  families = _families(names, registry)
  decentralized = families.get("decentralized", [])
  if config["topology"] is not None:
    if config["topology"] not in TOPOLOGIES:
      raise NetworkError(f"unknown topology {config['topology']!r}; choose from {', '.join(TOPOLOGIES)}")
    if not decentralized:
      raise NetworkError("--topology applies to the decentralized algorithms (gossip, dpsgd, gradient_tracking, "
                         f"d_fedem, p2p_bayes); none is in --algorithms ({','.join(names)})")
  elif decentralized:
    config["topology"] = "ring"
  if not isinstance(config["asynchronous"], bool):
    raise NetworkError(f"async must be true or false; got {config['asynchronous']!r}")
  if config["delay"] is not None and not config["asynchronous"]:
    raise NetworkError("--delay is the clients' compute time on the simulated clock of --async; add --async")
  asynchronous = families.get("asynchronous", [])
  if asynchronous and not config["asynchronous"]:
    raise NetworkError(f"{asynchronous[0]} is asynchronous: add --async (and --delay DIST for the clients' "
                       f"compute times, default {DEFAULT_DELAY})")
  if config["asynchronous"]:
    config["delay"] = config["delay"] or DEFAULT_DELAY
    parse_delay(config["delay"])


def default_algorithms(given: dict[str, Any]) -> str | None:
  """`--async` without `--algorithms` compares synchronous FedAvg with FedBuff and FedAsync."""
  if given.get("asynchronous") and "algorithms" not in given:
    return "fedavg,fedbuff,fedasync"
  return None


def graph(topology: str, num_nodes: int, seed: int):
  """The `graph=` of `--topology` over `num_nodes` nodes: a `fo.graphs.Graph` (Metropolis–Hastings mixing), or
  for `matchings` its `[T, N, N]` sequence of mixing matrices."""
  from fedjax_opt import graphs

  n = num_nodes
  if topology == "matchings":
    if n < 2:
      raise NetworkError("--topology matchings needs at least 2 clients")
    return graphs.random_matchings(graphs.complete(n), MATCHING_PERIOD, seed=seed)
  if topology == "torus":
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    if rows < 3:
      raise NetworkError(f"--topology torus needs --num-clients = rows × cols with both >= 3 (e.g. 100 = 10 × 10); "
                         f"got {n}")
    return graphs.torus(rows, n // rows)
  if topology == "erdos_renyi":  # about twice the connectivity threshold ln(n)/n
    return graphs.erdos_renyi(n, min(1.0, 2 * math.log(max(n, 2)) / n), seed=seed)
  if topology == "exponential" and n < 2:
    raise NetworkError("--topology exponential needs at least 2 clients")
  return getattr(graphs, topology)(n)


def describe(config: dict[str, Any], num_nodes: int) -> str:
  """One line for the run's header: the topology and its spectral gap."""
  from fedjax_opt import graphs

  gap = graphs.spectral_gap(graphs.mixing_matrix(graph(config["topology"], num_nodes, config["seed"])))
  return f"decentralized: {num_nodes} nodes on a {config['topology']} graph, spectral gap {gap:.3g}"
