"""Rounds per second of `fo.train` against a bare jitted `lax.scan(step)` on the same workload.

Workload: FedAvg with the 2NN MLP on MNIST 5k (100 clients, Dirichlet(0.5)),
10 clients per round, 10 local steps, batch 20; or multinomial logistic
regression on Synthetic(1,1) with `--workload lr`. Both sides draw each
round's clients and batches with `fo.data.sample_round` inside the compiled
program, so the difference is the driver's own cost: chunking, host
transfers of the per-round metrics, history and progress (and evaluation
in the rows that say so). Compilation is excluded on both sides, and the
runs are timed in turn within each repeat, so that load on a shared
machine drifts across all of them alike.

    python benchmarks/driver_overhead.py              # prints a table, writes JSON
    python benchmarks/driver_overhead.py --workload lr --rounds 2000

`--part startup`: what a newcomer waits for. The command line's default run
(`fedjax-opt run`: FedAvg and FedAdam, 2NN MLP, MNIST 5k, 300 rounds) and the
ADMM family (`--algorithms admm_consensus,gadmm,cq_ggadmm,mixture_admm
--dataset digits --rounds 5`), each started as a fresh process with JAX's
persistent compilation cache off (a first run on a new machine): seconds to
the first line printed, to the first progress line, and to the end, and each
algorithm's compile and wall seconds from its `results.json`. `--tree
LABEL=PATH` (repeatable) runs the commands with the package from PATH, in turn
within each repeat (a checkout before and after a change, on the same load):

    python benchmarks/driver_overhead.py --part startup --tree before=/tmp/old --tree after=.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import optax

import fedjax_opt as fo


def workload(name):
  if name == "mlp":
    dataset = fo.data.load("mnist5k", partition="dirichlet", alpha=0.5, num_clients=100, seed=0)
    model = fo.models.mlp_2nn()
    return dataset, model, dict(clients_per_round=10, local_steps=10, batch_size=20)
  dataset = fo.data.load("synthetic_1_1", seed=0)
  model = fo.models.logistic_regression(60, 10)
  return dataset, model, dict(clients_per_round=10, local_steps=20, batch_size=10)


def bare_scan(algo, state, dataset, rounds, kw):
  """A compiled function running `rounds` rounds in one `lax.scan`, sampling inside."""
  key = jax.random.key(0)

  def run(state, dataset):
    def body(s, _):
      return algo.step(s, fo.data.sample_round(jax.random.fold_in(key, s.round), dataset, **kw)), s.metrics
    return jax.lax.scan(body, state, None, length=rounds)

  compiled = jax.jit(run).lower(state, dataset).compile()
  return lambda: jax.block_until_ready(compiled(state, dataset))


def driver(algo, state, dataset, rounds, kw, eval_every, metric_fns):
  sampling, evaluation = fo.Sampling(**kw), fo.Evaluation(every=eval_every, metric_fns=metric_fns)
  run = lambda: jax.block_until_ready(fo.train(algo, state, dataset, rounds, sampling, evaluation=evaluation,
                                               progress=False)[0])
  run()  # compiles once (jax.jit keeps the compiled chunks for the next calls)
  return run


def interleaved_medians(runs, repeats):
  """Median seconds of each run, timed in turn within every repeat so that load drift hits all alike."""
  times = [[] for _ in runs]
  for fn in runs:
    fn()
  for _ in range(repeats):
    for i, fn in enumerate(runs):
      t0 = time.perf_counter()
      fn()
      times[i].append(time.perf_counter() - t0)
  return [statistics.median(t) for t in times]


STARTUP_COMMANDS = {
    "default run": [],
    "ADMM family, digits, 5 rounds": ["--algorithms", "admm_consensus,gadmm,cq_ggadmm,mixture_admm", "--dataset",
                                      "digits", "--rounds", "5"],
}
PROGRESS = re.compile(r"^\[\w+\] round \d+/\d+")


def startup_run(tree: str, args: list[str]) -> dict:
  """One fresh `fedjax-opt run` with the package of `tree`, no compile cache: when its lines came, and its rows."""
  with tempfile.TemporaryDirectory() as out:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "fedjax_opt.cli", "run", *args, "--out", os.path.join(out, "run"),
               "--compile-cache", "off"]
    t0 = time.perf_counter()
    first_line = first_progress = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=out) as proc:
      for line in proc.stdout:
        now = time.perf_counter() - t0
        first_line = now if first_line is None else first_line
        if first_progress is None and PROGRESS.match(line):
          first_progress = now
    total = time.perf_counter() - t0
    if proc.returncode != 0:
      raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}")
    with open(os.path.join(out, "run", "results.json")) as f:
      rows = json.load(f)
  return {"first_line_seconds": first_line, "first_progress_seconds": first_progress, "total_seconds": total,
          "algorithms": {r["algorithm"]: {"compile_seconds": r["compile_seconds"], "wall_seconds": r["wall_seconds"]}
                         for r in rows}}


def startup(trees: dict[str, str], repeats: int, out_path: str) -> None:
  results = {label: {name: [] for name in STARTUP_COMMANDS} for label in trees}
  for _ in range(repeats):
    for name, args in STARTUP_COMMANDS.items():
      for label, tree in trees.items():  # in turn, so that load drift hits every tree alike
        results[label][name].append(startup_run(tree, args))
  print(f"{'command':32} {'tree':8} {'first line':>10} {'first progress':>15} {'total':>8}  compile s per algorithm")
  summary = {}
  for name in STARTUP_COMMANDS:
    for label in trees:
      runs = results[label][name]
      med = {k: statistics.median(r[k] for r in runs) for k in ("first_line_seconds", "first_progress_seconds",
                                                                 "total_seconds")}
      compiles = {a: statistics.median(r["algorithms"][a]["compile_seconds"] for r in runs)
                  for a in runs[0]["algorithms"]}
      summary.setdefault(name, {})[label] = {**med, "compile_seconds": compiles, "runs": runs}
      print(f"{name:32} {label:8} {med['first_line_seconds']:10.1f} {med['first_progress_seconds']:15.1f} "
            f"{med['total_seconds']:8.1f}  " + ", ".join(f"{a} {c:.1f}" for a, c in compiles.items()))
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  with open(out_path, "w") as f:
    json.dump({"part": "startup", "repeats": repeats, "trees": trees, "commands": STARTUP_COMMANDS,
               "results": summary}, f, indent=1)
  print(f"wrote {out_path}")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", choices=("driver", "startup"), default="driver")
  parser.add_argument("--workload", choices=("mlp", "lr"), default="mlp")
  parser.add_argument("--rounds", type=int, default=500)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--tree", action="append", metavar="LABEL=PATH",
                      help="--part startup: a checkout to run the commands with (default: this one)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  results_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  if args.part == "startup":
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {
        "this": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")}
    startup(trees, args.repeats, args.out or os.path.join(results_dir, "driver_startup.json"))
    return
  args.out = args.out or os.path.join(results_dir, "driver_overhead.json")

  dataset, model, kw = workload(args.workload)
  algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05))
  state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
  fns = {"loss": model.loss_fn, "accuracy": model.accuracy_fn}
  labels = ["bare jitted lax.scan(step)"]
  runs = [bare_scan(algo, state, dataset, args.rounds, kw)]
  for eval_every, with_eval in ((args.rounds // 10, False), (args.rounds // 10, True), (args.rounds // 50, False)):
    labels.append(f"fo.train, chunks of {eval_every}" + (", eval each chunk" if with_eval else ""))
    runs.append(driver(algo, state, dataset, args.rounds, kw, eval_every, fns if with_eval else None))
  rows = list(zip(labels, interleaved_medians(runs, args.repeats)))
  bare = rows[0][1]
  print(f"workload={args.workload} rounds={args.rounds} backend={jax.default_backend()} {kw}")
  print(f"{'run':45} {'seconds':>9} {'rounds/s':>10} {'vs bare':>8}")
  for label, seconds in rows:
    print(f"{label:45} {seconds:9.3f} {args.rounds / seconds:10.1f} {bare / seconds:8.3f}")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"workload": args.workload, "rounds": args.rounds, "backend": jax.default_backend(),
               "rows": [{"run": label, "seconds": s, "rounds_per_second": args.rounds / s, "ratio_vs_bare": bare / s}
                        for label, s in rows]}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
