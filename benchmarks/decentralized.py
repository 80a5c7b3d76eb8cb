"""Decentralized optimization on five graphs: gossip with local steps, D-PSGD and gradient tracking.

Problem (float64, deterministic: every node's full local data every round, zero initial model):
  ridge:     regularized least squares on ±1 labels, f_i(θ) = mean ½(xᵀw + b − y)² + (λ/2)‖w‖²;
  logistic:  binary logistic regression, f_i(θ) = mean [log(1 + e^s) − y s] + (λ/2)‖w‖², y ∈ {0, 1};
on FedProx's Synthetic(1, 1) recipe (Li et al., MLSys 2020, arXiv:1812.06127;
`fedjax_opt.data.generate_synthetic`): N = 32 nodes, each with its own teacher model and input
distribution (lognormal sizes 50-889), 20 features, 2 classes, λ = 0.01. Each node standardizes its
own features (a local step, no pooled statistics; with pooled ones the nodes' shifted inputs make
L/μ ≈ 900, and even exact gradient descent with η = 1/(2L) would need about 30,000 rounds to 1e-8), so
the nodes differ mostly in how their labels depend on the features: each has its own teacher. The
nodes minimise F(θ) = (1/N) Σ_i f_i(θ); θ* comes from the normal equations (ridge) or from L-BFGS
polished by Newton steps (logistic) in float64 NumPy, independently of the library, to a gradient
norm below 1e-12.

Graphs (Metropolis–Hastings weights, `fedjax_opt.graphs`): ring(32), torus(4, 8), exponential(32)
(i ~ i ± 2^k), complete(32) (W = 11ᵀ/N), and a time-varying sequence of random perfect matchings of
K_32 (`random_matchings(32, 16)`: each node averages with one random peer per round; period 16). A
graph's spectral gap is 1 − max(|λ₂|, |λ_N|) of W (`graphs.spectral_gap`, `numpy.linalg.eigvalsh`);
for the matchings, the per-round equivalent 1 − (1 − gap_T)^{1/T} of the gap of one period,
1 − ‖W_{T−1} ⋯ W_0 − 11ᵀ/N‖₂ with T = 16 (a worst-case bound; the measured contraction is faster).

Methods, each with a constant step η = c / L, c ∈ {1/2, 1/4, 1/8, 1/16, 1/32} (L = max_i of the
nodes' smoothness constants); per graph and method the step that settles below 1e-8 in the fewest rounds
(else 1e-4, else 1e-2, else the smallest final gap) is reported:
  gossip + local steps  `gossip(eta, local_steps=5)`: x ← W(x + Δ), Δ five local gradient steps
                        (decentralized FedAvg);
  D-PSGD                `dpsgd(eta)`: x ← W x − η ∇f(x) (one full-batch gradient per round);
  gradient tracking     `gradient_tracking(eta)` (DIGing): also gossips y, the tracked average gradient.
Each (task, method) is one compiled program: a `jax.vmap` over the five graphs' mixing matrices (the
static ones tiled into period-16 sequences: the same W every round) of a `jax.vmap` over η of a
`lax.scan` over rounds. Pure gossip averaging (η = 0) from independent N(0, 1) node models measures
each graph's consensus contraction per round, to set against (1 − gap)².

Recorded every round: the relative objective gap (F(x̄) − F*) / F* of the nodes' average x̄, the
consensus distance (1/N) Σ_i ‖x_i − x̄‖² and the bytes each node sends (`metrics["bytes_sent"]`:
#neighbours × model bytes, two vectors for gradient tracking; 8-byte floats, 21 parameters); every
5th round the worst node's max_i (F(x_i) − F*) / F* (it evaluates F at all N models).

    python benchmarks/decentralized.py            # full run: N = 32, 1,500 rounds, both tasks: ~6 min
    python benchmarks/decentralized.py --quick    # N = 16 (torus 4 x 4), ridge only, 300 rounds

Writes benchmarks/results/decentralized.json (settings; per graph its degree, spectral gap and
measured gossip contraction; per task / graph / method and step size the rounds and bytes per node
until the relative gap stays below 1e-2, 1e-4, 1e-8, the final gaps and consensus distance; the chosen step's
curves, subsampled) and, in docs/img, decentralized.png (gaps and consensus distance vs rounds) and
decentralized_graphs.png (pure gossip against (1 − gap)^{2k}; final gap vs step size; gap vs bytes
per node); `--quick` writes *_quick.* files.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

import fedjax_opt as fo
from fedjax_opt.algorithms.decentralized import dpsgd, gossip, gradient_tracking
from fedjax_opt.data import generate_synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_FEATURES, L2 = 20, 0.01
ETA_FACTORS = (0.5, 0.25, 0.125, 0.0625, 0.03125)  # the step-size grid, η = factor / L
WORST_EVERY = 5  # rounds between evaluations of F at every node (the worst node's gap)
LOCAL_STEPS = 5
PERIOD = 16  # period of the random matchings; the static graphs are tiled to it
TARGETS = (1e-2, 1e-4, 1e-8)
NUM_CURVE_POINTS = 200
FULL = {"nodes": 32, "torus": (4, 8), "rounds": 1500, "tasks": ("ridge", "logistic")}
QUICK = {"nodes": 16, "torus": (4, 4), "rounds": 300, "tasks": ("ridge",)}


class Task(NamedTuple):
  name: str
  loss_fn: Callable
  clients: list[tuple[np.ndarray, np.ndarray]]
  batches: fo.ClientBatches  # [N, 1, n_max, d]: one full batch per node
  optimum: np.ndarray  # (w, b), float64
  objective_star: float
  smoothness: float  # L = max_i λ_max(∇²f_i) (a bound for logistic)


class GraphSpec(NamedTuple):
  name: str
  mixing: np.ndarray  # [N, N] or [T, N, N]
  degree: float  # mean number of neighbours a node sends to per round
  spectral_gap: float  # per round (the per-round equivalent for a sequence)


# ----------------------------------------------------------------------------- the problem


def _ridge_loss(params, batch):
  r = batch["x"] @ params["w"] + params["b"] - batch["y"]
  return 0.5 * jnp.square(r) + 0.5 * L2 * jnp.sum(jnp.square(params["w"]))


def _logistic_loss(params, batch):
  s = batch["x"] @ params["w"] + params["b"]
  return jax.nn.softplus(s) - batch["y"] * s + 0.5 * L2 * jnp.sum(jnp.square(params["w"]))


def _design(x: np.ndarray) -> np.ndarray:
  return np.hstack([x, np.ones((len(x), 1))])


def _node_objective(kind: str, v: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
  """f_i(v), its gradient and Hessian, float64 NumPy (the reference, written independently of the library)."""
  a = _design(x)
  s = a @ v
  reg = np.diag([L2] * NUM_FEATURES + [0.0])
  if kind == "ridge":
    value, residual, curvature = np.mean(0.5 * (s - y) ** 2), s - y, np.ones_like(s)
  else:
    p = 1.0 / (1.0 + np.exp(-s))
    value, residual, curvature = np.mean(np.logaddexp(0.0, s) - y * s), p - y, p * (1.0 - p)
  value += 0.5 * v @ reg @ v
  grad = a.T @ residual / len(y) + reg @ v
  hess = (a * curvature[:, None]).T @ a / len(y) + reg
  return value, grad, hess


def _objective(kind: str, v: np.ndarray, clients) -> tuple[float, np.ndarray, np.ndarray]:
  """F(v) = (1/N) Σ_i f_i(v), its gradient and Hessian."""
  parts = [_node_objective(kind, v, x, y) for x, y in clients]
  return tuple(sum(p[k] for p in parts) / len(parts) for k in range(3))


def _minimise(kind: str, clients) -> np.ndarray:
  """argmin F in float64: the normal equations (ridge), L-BFGS then Newton steps (logistic)."""
  start = np.zeros(NUM_FEATURES + 1)
  if kind == "ridge":
    _, grad, hess = _objective(kind, start, clients)
    return np.linalg.solve(hess, -grad)
  v = scipy.optimize.minimize(lambda u: _objective(kind, u, clients)[:2], start, jac=True, method="L-BFGS-B",
                              options={"gtol": 1e-10, "ftol": 1e-16, "maxiter": 10000}).x
  for _ in range(5):  # Newton converges quadratically from here
    _, grad, hess = _objective(kind, v, clients)
    v = v - np.linalg.solve(hess, grad)
  return v


def _pack(clients) -> fo.ClientBatches:
  n_max = max(len(x) for x, _ in clients)
  x = np.zeros((len(clients), 1, n_max, NUM_FEATURES))
  y = np.zeros((len(clients), 1, n_max))
  mask = np.zeros((len(clients), 1, n_max), bool)
  for k, (xk, yk) in enumerate(clients):
    x[k, 0, :len(xk)], y[k, 0, :len(yk)], mask[k, 0, :len(xk)] = xk, yk, True
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.ones(len(clients)), client_id=jnp.arange(len(clients), dtype=jnp.int32))


def load_tasks(num_nodes: int, names: tuple[str, ...], seed: int = 0) -> list[Task]:
  """Synthetic(1, 1) with `num_nodes` nodes, standardized features; one Task per name in `names`."""
  data = generate_synthetic(1.0, 1.0, num_clients=num_nodes, num_features=NUM_FEATURES, num_classes=2, seed=seed)
  features = []
  for c in data.clients:  # each node standardizes its own features (a local step: no pooled statistics)
    x = c["x"].astype(np.float64)
    features.append((x - x.mean(0)) / x.std(0))
  labels = [c["y"].astype(np.float64) for c in data.clients]
  tasks = []
  for name in names:
    loss_fn = {"ridge": _ridge_loss, "logistic": _logistic_loss}[name]
    clients = list(zip(features, [2 * y - 1 for y in labels] if name == "ridge" else labels))
    optimum = _minimise(name, clients)
    star, grad, _ = _objective(name, optimum, clients)
    assert np.linalg.norm(grad) < 1e-12, (name, np.linalg.norm(grad))
    curvature = 1.0 if name == "ridge" else 0.25
    smoothness = max(curvature * np.linalg.eigvalsh(_design(x).T @ _design(x) / len(x))[-1] + L2 for x in features)
    tasks.append(Task(name, loss_fn, clients, _pack(clients), optimum, float(star), float(smoothness)))
  return tasks


# ----------------------------------------------------------------------------- graphs


def make_graphs(num_nodes: int, torus_shape: tuple[int, int], seed: int = 0) -> list[GraphSpec]:
  """Ring, torus, exponential and complete graphs (Metropolis–Hastings) and random matchings of K_N."""
  graphs = fo.graphs
  specs = []
  for name, graph in (("ring", graphs.ring(num_nodes)), (f"torus {torus_shape[0]}x{torus_shape[1]}",
                                                         graphs.torus(*torus_shape)),
                      ("exponential", graphs.exponential(num_nodes)), ("complete", graphs.complete(num_nodes))):
    w = graphs.check_mixing_matrix(graphs.metropolis_hastings(graph), name)
    specs.append(GraphSpec(name, w, float(graphs.degrees(graph).mean()), graphs.spectral_gap(w)))
  seq = graphs.check_mixing_matrix(graphs.random_matchings(num_nodes, PERIOD, seed=seed), "random matchings")
  per_round = 1.0 - (1.0 - graphs.spectral_gap(seq)) ** (1.0 / PERIOD)
  matched = np.mean([np.sum((wt != 0) & ~np.eye(num_nodes, dtype=bool)) / num_nodes for wt in seq])
  specs.append(GraphSpec("random matchings", seq, float(matched), float(per_round)))
  return specs


def _as_sequences(specs: list[GraphSpec]) -> jax.Array:
  """`[G, T, N, N]`: every graph's mixing as a period-T sequence (a static W repeated)."""
  return jnp.asarray(np.stack([s.mixing if s.mixing.ndim == 3 else np.broadcast_to(s.mixing, (PERIOD,) +
                                                                                   s.mixing.shape)
                               for s in specs]))


# ----------------------------------------------------------------------------- runs


METHODS = {
    "gossip + local steps": lambda loss_fn, eta, w: gossip(loss_fn, eta, graph=w, local_steps=LOCAL_STEPS,
                                                           client_map="vmap"),
    "D-PSGD": lambda loss_fn, eta, w: dpsgd(loss_fn, eta, graph=w, client_map="vmap"),
    "gradient tracking": lambda loss_fn, eta, w: gradient_tracking(loss_fn, eta, graph=w, client_map="vmap"),
}


def _pooled_objective(task: Task) -> Callable[[Any], jax.Array]:
  """F(θ) = (1/N) Σ_i f_i(θ) on the unpadded pooled examples (each weighs 1 / (N n_i)), in JAX."""
  x = jnp.asarray(np.concatenate([c[0] for c in task.clients]))
  y = jnp.asarray(np.concatenate([c[1] for c in task.clients]))
  weight = jnp.asarray(np.concatenate([np.full(len(c[1]), 1.0 / (len(task.clients) * len(c[1])))
                                       for c in task.clients]))
  return lambda params: jnp.sum(weight * task.loss_fn(params, {"x": x, "y": y}))


def _zeros() -> dict[str, jax.Array]:
  return {"w": jnp.zeros(NUM_FEATURES), "b": jnp.zeros(())}


def run_method(task: Task, method: str, mixings: jax.Array, rounds: int) -> dict[str, np.ndarray]:
  """Curves for every graph and step size of `ETA_FACTORS` from one compiled program.

  A `jax.vmap` over the graphs of a `jax.vmap` over η of a `lax.scan` over blocks of `WORST_EVERY` rounds.
  Returns `gap`, `consensus` and cumulative `bytes` `[G, E, rounds + 1]` (index 0: the initial model) and
  `worst_gap` `[G, E, rounds / WORST_EVERY + 1]` (every WORST_EVERY-th round: it evaluates F at all N nodes).
  """
  objective = _pooled_objective(task)

  def one_run(w, eta):
    algo = METHODS[method](task.loss_fn, eta, w)

    def round_(state, _):
      state = algo.step(state, task.batches)
      return state, (objective(state.params), state.metrics["consensus_distance"], state.metrics["bytes_sent"])

    def block(state, _):
      state, per_round = jax.lax.scan(round_, state, None, length=WORST_EVERY)
      return state, (per_round, jnp.max(jax.vmap(objective)(state.local_params)))

    state = algo.init(_zeros(), jax.random.key(0))
    _, ((avg, consensus, sent), worst) = jax.lax.scan(block, state, None, length=rounds // WORST_EVERY)
    f0 = objective(_zeros())
    return (jnp.concatenate([f0[None], avg.reshape(-1)]), jnp.concatenate([f0[None], worst]),
            jnp.concatenate([jnp.zeros(1), consensus.reshape(-1).astype(jnp.float64)]),
            jnp.concatenate([jnp.zeros(1), jnp.cumsum(sent.reshape(-1).astype(jnp.float64))]))

  etas = jnp.asarray(ETA_FACTORS) / task.smoothness
  per_graph = lambda w: jax.vmap(lambda eta: one_run(w, eta))(etas)
  avg, worst, consensus, sent = jax.jit(jax.vmap(per_graph))(mixings)
  star = task.objective_star
  with np.errstate(invalid="ignore", over="ignore"):
    return {"gap": (np.asarray(avg) - star) / star, "worst_gap": (np.asarray(worst) - star) / star,
            "consensus": np.asarray(consensus), "bytes": np.asarray(sent)}


def pure_gossip(task: Task, mixings: jax.Array, rounds: int, seed: int = 0) -> np.ndarray:
  """Consensus distance `[G, rounds + 1]` of gossip averaging (η = 0) from independent N(0, 1) models per node."""
  x0 = jnp.asarray(np.random.default_rng(seed).normal(size=(len(task.clients), NUM_FEATURES + 1)))
  start = {"w": x0[:, :-1], "b": x0[:, -1]}

  def one_graph(w):
    algo = gossip(task.loss_fn, 0.0, graph=w, client_map="vmap")
    state = algo.init(_zeros(), jax.random.key(0)).replace(local_params=start)

    def round_(s, _):
      s = algo.step(s, task.batches)
      return s, s.metrics["consensus_distance"]

    _, distance = jax.lax.scan(round_, state, None, length=rounds)
    return jnp.concatenate([fo.algorithms.consensus_distance(start)[None], distance.astype(jnp.float64)])

  return np.asarray(jax.jit(jax.vmap(one_graph))(mixings))


def first_reach(gap: np.ndarray, sent: np.ndarray, target: float) -> tuple[int | None, float | None]:
  """(the round from which the gap stays <= target to the end of the run, bytes per node sent until then), or
  (None, None). D-PSGD's average passes close to θ* on its way to its biased fixed point, so the first round
  below a target can come long before the run settles above it."""
  above = np.flatnonzero(~(gap <= target))
  first = 0 if not above.size else int(above[-1]) + 1
  if first >= len(gap):
    return None, None
  return first, float(sent[first])


def best_eta(gap: np.ndarray) -> int:
  """Index of the step size that settles below the smallest target in the fewest rounds; else the smallest final
  gap."""

  def cost(curve):
    for rank, target in enumerate(sorted(TARGETS)):
      first, _ = first_reach(curve, curve, target)
      if first is not None:
        return (rank, first, 0.0)
    return (len(TARGETS), 0, curve[-1] if np.isfinite(curve[-1]) else np.inf)

  return min(range(gap.shape[0]), key=lambda e: cost(gap[e]))


def contraction(distance: np.ndarray) -> float:
  """Measured per-round factor of the consensus distance: exp of the least-squares slope of its log over the
  rounds where it is above 1e-24 of its start (0 when it vanishes after one round, as on the complete graph)."""
  keep = np.flatnonzero(distance > distance[0] * 1e-24)
  if keep.size < 3:
    return 0.0
  keep = keep[1:]
  return float(np.exp(np.polyfit(keep, np.log(distance[keep]), 1)[0]))


# ----------------------------------------------------------------------------- output


def _subsample(rounds: int) -> tuple[np.ndarray, np.ndarray]:
  """Round indices kept in the JSON curves (every round at the start, then spread out), and the indices of the
  worst-node curve kept (spread out; its entry j is round j · WORST_EVERY)."""
  per_round = np.unique(np.concatenate([np.arange(min(rounds + 1, 50)),
                                        np.linspace(0, rounds, NUM_CURVE_POINTS).round().astype(int)]))
  return per_round, np.unique(np.linspace(0, rounds // WORST_EVERY, NUM_CURVE_POINTS).round().astype(int))


def _curve(a: np.ndarray) -> list[float | None]:
  return [None if not np.isfinite(v) else float(f"{v:.6g}") for v in np.asarray(a)]


def plot(results: dict, graphs: list[GraphSpec], gossip_curves: np.ndarray, path_curves: str,
         path_graphs: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  colours = {"gossip + local steps": "tab:green", "D-PSGD": "tab:orange", "gradient tracking": "tab:blue"}
  short = {"gossip + local steps": f"gossip + {LOCAL_STEPS} local", "D-PSGD": "D-PSGD", "gradient tracking": "GT"}
  tasks = list(results)
  fig, axes = plt.subplots(2 * len(tasks), len(graphs), figsize=(3.6 * len(graphs), 5.4 * len(tasks)),
                           squeeze=False, sharex=True)
  for t, task in enumerate(tasks):
    for g, spec in enumerate(graphs):
      top, bottom = axes[2 * t][g], axes[2 * t + 1][g]
      for method, out in results[task]["curves"].items():
        e = results[task]["summary"][spec.name][method]["best_index"]
        label = f"{short[method]}, η·L={ETA_FACTORS[e]:g}"
        top.plot(np.maximum(out["gap"][g, e], 1e-16), color=colours[method], lw=1.2, label=label)
        top.plot(WORST_EVERY * np.arange(out["worst_gap"].shape[-1]), np.maximum(out["worst_gap"][g, e], 1e-16),
                 color=colours[method], lw=0.8, ls="--")
        bottom.plot(np.maximum(out["consensus"][g, e, 1:], 1e-32), color=colours[method], lw=1.2, label=label)
      top.set_title(f"{task}: {spec.name} (gap {spec.spectral_gap:.3g})\nsolid: x̄, dashed: worst node", fontsize=8)
      top.set_yscale("log")
      bottom.set_yscale("log")
      top.legend(fontsize=6)
      if g == 0:
        top.set_ylabel("relative objective gap")
        bottom.set_ylabel("consensus distance")
      bottom.set_xlabel("round")
  fig.tight_layout()
  fig.savefig(path_curves, dpi=90)
  plt.close(fig)

  fig, axes = plt.subplots(1, 1 + 2 * len(tasks), figsize=(4.6 * (1 + 2 * len(tasks)), 4.2), squeeze=False)
  ax = axes[0][0]
  k = np.arange(gossip_curves.shape[1])
  for g, spec in enumerate(graphs):
    ax.plot(np.maximum(gossip_curves[g], 1e-32), color=f"C{g}", lw=1.2,
            label=f"{spec.name} (gap {spec.spectral_gap:.3g})")
    ax.plot(gossip_curves[g][0] * (1 - spec.spectral_gap) ** (2 * k), color=f"C{g}", lw=0.8, ls=":")
  ax.set_yscale("log")
  ax.set_ylim(1e-32, 10 * gossip_curves[:, 0].max())
  ax.set_xlim(0, min(len(k), 300))
  ax.set_xlabel("round")
  ax.set_ylabel("consensus distance")
  ax.set_title("pure gossip (η = 0); dotted: start × (1 − gap)^{2k}", fontsize=9)
  ax.legend(fontsize=7)
  for t, task in enumerate(tasks):
    ax = axes[0][1 + 2 * t]
    for g, spec in enumerate(graphs):
      for method, ls, marker in (("gradient tracking", "-", "o"), ("D-PSGD", "--", "s")):
        gap = results[task]["curves"][method]["gap"][g]
        final = np.where(np.isfinite(gap[:, -1]) & (gap[:, -1] <= gap[:, 0]), np.maximum(gap[:, -1], 1e-16), np.nan)
        ax.plot(ETA_FACTORS, final, ls=ls, marker=marker, ms=3, lw=1.1, color=f"C{g}",
                label=f"{spec.name}: {short[method]}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(ETA_FACTORS, [f"{f:g}" for f in ETA_FACTORS])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("η·L")
    ax.set_ylabel("relative gap of x̄ after the last round")
    ax.set_title(f"{task}: GT (solid) vs D-PSGD (dashed) by step size\n(no point: diverged)", fontsize=9)
    if t == 0:
      ax.legend(fontsize=5)
    ax = axes[0][2 + 2 * t]
    for g, spec in enumerate(graphs):
      for method, ls in (("gradient tracking", "-"), ("D-PSGD", "--")):
        out = results[task]["curves"][method]
        e = results[task]["summary"][spec.name][method]["best_index"]
        ax.plot(out["bytes"][g, e, 1:], np.maximum(out["gap"][g, e, 1:], 1e-16), ls=ls, lw=1.1, color=f"C{g}",
                label=f"{spec.name}: {short[method]}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes sent per node")
    ax.set_ylabel("relative gap of x̄")
    ax.set_title(f"{task}: GT (solid) vs D-PSGD (dashed), each at its best η", fontsize=9)
  fig.tight_layout()
  fig.savefig(path_graphs, dpi=90)
  plt.close(fig)


def _fmt(value: Any, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _gap(value: float | None) -> str:
  """A relative gap for the table: rounding-level values (|gap| < 1e-15, possibly negative) as "<1e-15"."""
  if value is None:
    return "diverged"
  return "<1e-15" if abs(value) < 1e-15 else f"{value:.2e}"


def summarize(out: dict[str, np.ndarray], g: int, rounds: int) -> dict:
  """Per step size of graph g: rounds / bytes to each target, final gaps; the best step's index."""
  rows = []
  for e, factor in enumerate(ETA_FACTORS):
    reach = {f"{tol:g}": dict(zip(("round", "bytes"), first_reach(out["gap"][g, e], out["bytes"][g, e], tol)))
             for tol in TARGETS}
    rows.append({"eta_factor": factor, "reach": reach, "diverged": not out["gap"][g, e, -1] <= out["gap"][g, e, 0],
                 "final_gap": _finite(out["gap"][g, e, -1]),
                 "final_worst_gap": _finite(out["worst_gap"][g, e, -1]),
                 "final_consensus_distance": _finite(out["consensus"][g, e, -1]),
                 "bytes_per_round": float(out["bytes"][g, e, -1] / rounds)})
  best = best_eta(out["gap"][g])
  return {"best_index": best, "best_eta_factor": ETA_FACTORS[best], "best": rows[best], "per_eta": rows}


def _cell(value: float, start: float) -> str:
  if not value <= start:
    return "diverged"
  return "<1e-15" if abs(value) < 1e-15 else f"{value:.1e}"


def _finite(value: float) -> float | None:
  return float(value) if np.isfinite(value) else None


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="N = 16, ridge only, 300 rounds: a smoke test")
  parser.add_argument("--rounds", type=int, default=None, help="override the number of rounds")
  parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"), help="where the JSON goes")
  parser.add_argument("--img-dir", default=os.path.join(ROOT, "docs", "img"), help="where the PNGs go")
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  rounds = args.rounds or settings["rounds"]
  if rounds < WORST_EVERY or rounds % WORST_EVERY:
    parser.error(f"--rounds must be a positive multiple of {WORST_EVERY}; got {rounds}.")
  start = time.perf_counter()
  with jax.enable_x64(True):
    graphs = make_graphs(settings["nodes"], settings["torus"])
    mixings = _as_sequences(graphs)
    tasks = load_tasks(settings["nodes"], settings["tasks"])
    print(f"N = {settings['nodes']} nodes, {rounds} rounds, gossip with {LOCAL_STEPS} local steps, each method at "
          f"its best η·L of {', '.join(f'{f:g}' for f in ETA_FACTORS)}")
    gossip_curves = pure_gossip(tasks[0], mixings, rounds)
    graph_rows = {}
    print(f"\n{'graph':18}{'degree':>8}{'spectral gap':>14}{'(1-gap)^2':>11}{'pure gossip rate':>18}")
    for g, spec in enumerate(graphs):
      rate = contraction(gossip_curves[g])
      graph_rows[spec.name] = {"degree": spec.degree, "spectral_gap": spec.spectral_gap, "gossip_contraction": rate,
                               "time_varying": spec.mixing.ndim == 3}
      print(f"{spec.name:18}{spec.degree:>8.2f}{spec.spectral_gap:>14.4g}{(1 - spec.spectral_gap) ** 2:>11.4f}"
            f"{rate:>18.4f}")
    results = {}
    for task in tasks:
      curves, summary = {}, {}
      for method in METHODS:
        t0 = time.perf_counter()
        curves[method] = run_method(task, method, mixings, rounds)
        print(f"  ({task.name}, {method}: {time.perf_counter() - t0:.1f} s for {len(graphs)} graphs × "
              f"{len(ETA_FACTORS)} step sizes)")
      print(f"\n{task.name}: F* = {task.objective_star:.10f}, L = {task.smoothness:.3f}; relative gap of x̄ and of the "
            f"worst node, consensus distance, rounds and bytes per node until the gap stays below 1e-4 and 1e-8")
      print(f"{'graph':18}{'method':22}{'η·L':>7}{'final gap':>11}{'worst':>10}{'consensus':>11}{'rounds→1e-4':>13}"
            f"{'bytes→1e-4':>12}{'rounds→1e-8':>13}{'bytes→1e-8':>12}")
      for g, spec in enumerate(graphs):
        summary[spec.name] = {}
        for method, out in curves.items():
          row = summarize(out, g, rounds)
          summary[spec.name][method] = row
          best = row["best"]
          r4, r8 = best["reach"]["0.0001"], best["reach"]["1e-08"]
          print(f"{spec.name:18}{method:22}{row['best_eta_factor']:>7g}{_gap(best['final_gap']):>11}"
                f"{_gap(best['final_worst_gap']):>10}{_fmt(best['final_consensus_distance'], '.2e'):>11}"
                f"{_fmt(r4['round'], 'd'):>13}{_fmt(r4['bytes'], '.3g'):>12}{_fmt(r8['round'], 'd'):>13}"
                f"{_fmt(r8['bytes'], '.3g'):>12}")
      print(f"\n{task.name}: final relative gap of x̄ after {rounds} rounds, D-PSGD / gradient tracking, by η·L "
            f"(diverged: above the start)")
      print(f"{'graph':18}" + "".join(f"{f'{f:g}':>22}" for f in ETA_FACTORS))
      for g, spec in enumerate(graphs):
        cells = [" / ".join(_cell(curves[m]["gap"][g, e, -1], curves[m]["gap"][g, e, 0])
                            for m in ("D-PSGD", "gradient tracking"))
                 for e in range(len(ETA_FACTORS))]
        print(f"{spec.name:18}" + "".join(f"{c:>22}" for c in cells))
      results[task.name] = {"curves": curves, "summary": summary, "objective_star": task.objective_star,
                            "smoothness": task.smoothness, "optimum": task.optimum.tolist(),
                            "sizes": [len(c[1]) for c in task.clients]}

  suffix = "_quick" if args.quick else ""
  os.makedirs(args.out_dir, exist_ok=True)
  os.makedirs(args.img_dir, exist_ok=True)
  keep, keep_worst = _subsample(rounds)

  def best_curves(r: dict, g: int) -> dict:
    picked = {}
    for m, out in r["curves"].items():
      e = r["summary"][graphs[g].name][m]["best_index"]
      picked[m] = {k: _curve(v[g, e][keep_worst if k == "worst_gap" else keep]) for k, v in out.items()}
    return picked

  report = {
      "backend": jax.default_backend(), "jax": jax.__version__, "seconds": time.perf_counter() - start,
      "settings": {"nodes": settings["nodes"], "rounds": rounds, "tasks": list(settings["tasks"]),
                   "features": NUM_FEATURES, "l2": L2, "eta_factors": list(ETA_FACTORS), "local_steps": LOCAL_STEPS,
                   "worst_every": WORST_EVERY,
                   "period": PERIOD, "targets": list(TARGETS), "model_bytes": (NUM_FEATURES + 1) * 8,
                   "data": "Synthetic(1, 1), 2 classes, features standardized per node, full local batch every round",
                   "mixing": "Metropolis-Hastings (static graphs); random perfect matchings of K_N (time-varying)"},
      "graphs": graph_rows,
      "gossip_curves": {"rounds": keep.tolist(), **{spec.name: _curve(gossip_curves[g][keep])
                                                    for g, spec in enumerate(graphs)}},
      "tasks": {
          name: {"objective_star": r["objective_star"], "smoothness": r["smoothness"], "optimum": r["optimum"],
                 "sizes": r["sizes"], "summary": r["summary"],
                 "best_curves": {"rounds": keep.tolist(), "worst_rounds": (WORST_EVERY * keep_worst).tolist(),
                                 **{spec.name: best_curves(r, g)
                                                             for g, spec in enumerate(graphs)}}}
          for name, r in results.items()},
  }
  json_path = os.path.join(args.out_dir, f"decentralized{suffix}.json")
  with open(json_path, "w") as f:
    json.dump(report, f, indent=1)
  curves_png = os.path.join(args.img_dir, f"decentralized{suffix}.png")
  graphs_png = os.path.join(args.img_dir, f"decentralized_graphs{suffix}.png")
  plot(results, graphs, gossip_curves, curves_png, graphs_png)
  print(f"\nwrote {json_path}, {curves_png} and {graphs_png} ({time.perf_counter() - start:.0f} s in all)")
  return report


if __name__ == "__main__":
  main()
