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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workload", choices=("mlp", "lr"), default="mlp")
  parser.add_argument("--rounds", type=int, default=500)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "driver_overhead.json"))
  args = parser.parse_args()

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
