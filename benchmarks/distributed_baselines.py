"""The classical distributed baselines against FL methods on IID and non-IID splits: does heterogeneity break them?

The claim checked (the FL optimization survey of the source material, its opening): approximate Newton methods
(DANE, GIANT, FADL) and one-shot averaging assume IID data and do not carry over to federated data; CoCoA does not
assume IID data (but needs a dual).

Tasks (float64; every client's whole data every round; zero initial model), on the pooled data split over
N = 10 clients three ways, all with equal client sizes:
  iid            a random permutation cut into N parts (`fo.data.iid_partition`);
  dirichlet0.1   each client's class proportions ~ Dir(0.1) (`dirichlet_partition`, Hsu et al.'s equal sizes);
  label-sorted   examples sorted by label, cut into N contiguous shards (`shard_partition`, one shard each);
and two losses, both with the L2 term (λ/2)(‖w‖² + b²) on every example (the intercept regularised, so that
CoCoA+'s primal is the same problem):
  ridge     ½(xᵀw + b − y)², y ∈ {−1, 1};
  logistic  log(1 + e^s) − y s, y ∈ {0, 1};
on three data sets: LibSVM's heart_scale (Debian's liblinear-tools example, read with `fo.data.read_svmlight`;
270 × 13), Synthetic(1, 1) (`fo.data.generate_synthetic`, 2 classes, 20 features, pooled), and MNIST 5k
(`fo.data.mnist5k_arrays`, digits < 5 against the rest, 784 pixels in [0, 1]; the split uses the digit).
The objective is the pooled risk F(θ) = (1/n) Σ_i ℓ_i(θ); F* comes from the normal equations (ridge) or scipy's
L-BFGS (logistic) in float64 NumPy, independently of the library.

Methods (each one compiled program per data set and loss: a `jax.vmap` over its hyper-parameter grid of a
`lax.scan` over rounds, the split's data an argument; the best value reaches a relative gap of 1e-4 in the fewest
rounds, or else has the smallest final gap):
  DANE        exact local solves (Newton; CG with 50 iterations for MNIST), μ ∈ {0, 0.01, 0.1, 1}, η = 1;
  FedDANE     half of the clients each round (drawn once per round, the same draws for every μ), local GD
              (20 steps of 1/(L + μ)), μ ∈ {0, 0.1, 1};
  GIANT       CG (P iterations, at most 50) and Armijo backtracking;
  FADL        DANE's local problem, exact, μ ∈ {0, 0.01, 0.1, 1}, and Armijo backtracking;
  CoCoA+      ridge only (SDCA has no closed-form step for the logistic loss here), γ = 1, σ′ = N, 2 local
              passes of SDCA;
  one-shot    exact local solves, averaged once;
  FedAvg      20 local full-batch GD steps of c/L, c ∈ {0.1, 0.3, 1}, weighted mean;
  SCAFFOLD    20 local steps of c/L, η_g = 1, c ∈ {0.1, 0.3, 1};
  ADMM        consensus ADMM, pooled-risk objective, exact prox (ridge) or 20 GD steps of 1/(L + ρ)
              (logistic), ρ ∈ {0.1, 1, 10}.
L is the largest local smoothness constant.

Communication: the bits one client sends plus receives, summed over rounds, from each algorithm's own
`bits_up` / `bits_down` metrics (32 per float).

    python benchmarks/distributed_baselines.py            # 100 rounds, the three data sets: MNIST 5k takes long
    python benchmarks/distributed_baselines.py --datasets heart_scale,synthetic   # about 4 minutes on 2 cores
    python benchmarks/distributed_baselines.py --quick    # heart_scale ridge alone, 12 rounds: a smoke test

Writes benchmarks/results/distributed_baselines.json (settings, per task and method: the hyper-parameter grid,
rounds and bits to 1e-2 / 1e-4, final gap, the best value's gap curve); `--quick` writes *_quick.json.
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
import optax
import scipy.optimize

import fedjax_opt as fo
from fedjax_opt import data as data_lib

NUM_CLIENTS, L2, LOCAL_STEPS = 10, 1e-2, 20
HEART_SCALE = "/usr/share/doc/liblinear-tools/examples/heart_scale"
TOLERANCES = (1e-2, 1e-4)
SPLITS = ("iid", "dirichlet0.1", "label-sorted")
DIVERGED = 1e6  # a relative gap above this (or not finite) is reported as diverged


class Problem(NamedTuple):
  """One data set and loss: the pooled arrays, the labels that drive the splits, the reference optimum."""

  dataset: str
  loss: str
  x: np.ndarray
  y: np.ndarray
  split_labels: np.ndarray
  optimum: np.ndarray
  objective_star: float
  smoothness: float


def _design(x):
  return np.hstack([x, np.ones((len(x), 1))])


def _objective_np(loss, theta, x, y):
  a = _design(x)
  s = a @ theta
  if loss == "ridge":
    value, grad_s = 0.5 * (s - y)**2, s - y
  else:
    value, grad_s = np.logaddexp(0, s) - y * s, 1 / (1 + np.exp(-s)) - y
  return np.mean(value) + 0.5 * L2 * theta @ theta, a.T @ grad_s / len(y) + L2 * theta


def loss_fn(loss):
  def ridge(params, batch):
    r = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return 0.5 * jnp.square(r) + 0.5 * L2 * (jnp.sum(jnp.square(params["w"])) + jnp.square(params["b"]))

  def logistic(params, batch):
    s = batch["x"] @ params["w"] + params["b"]
    penalty = 0.5 * L2 * (jnp.sum(jnp.square(params["w"])) + jnp.square(params["b"]))
    return jax.nn.softplus(s) - batch["y"] * s + penalty

  return ridge if loss == "ridge" else logistic


DATASETS = ("heart_scale", "synthetic", "mnist5k")


def datasets(quick: bool, names: tuple[str, ...] = DATASETS) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """name → (features, binary label in {0, 1}, label that drives the split), for the data sets in `names`."""
  out = {}
  if quick or "heart_scale" in names:
    heart = data_lib.read_svmlight(HEART_SCALE, labels="raw")
    y = (np.asarray(heart["y"]) > 0).astype(np.int64)
    out["heart_scale"] = (np.asarray(heart["x"], np.float64), y, y)
  if quick:
    return out
  if "synthetic" in names:
    _synthetic(out)
  if "mnist5k" in names:
    _mnist(out)
  return {name: value for name, value in out.items() if name.split("(")[0] in names}


def _synthetic(out: dict) -> None:
  syn = data_lib.generate_synthetic(1.0, 1.0, num_clients=NUM_CLIENTS, num_features=20, num_classes=2, seed=0)
  x = np.concatenate([c["x"] for c in syn.clients]).astype(np.float64)
  y = np.concatenate([c["y"] for c in syn.clients]).astype(np.int64)
  out["synthetic(1,1)"] = ((x - x.mean(0)) / x.std(0), y, y)


def _mnist(out: dict) -> None:
  try:
    mnist = data_lib.mnist5k_arrays(flatten=True).train
  except ImportError as err:
    print(f"MNIST 5k skipped: {err}")
  else:
    digits = np.asarray(mnist["y"], np.int64)
    out["mnist5k"] = (np.asarray(mnist["x"], np.float64).reshape(len(digits), -1), (digits < 5).astype(np.int64),
                      digits)


def problem(name: str, x: np.ndarray, y01: np.ndarray, split_labels: np.ndarray, loss: str) -> Problem:
  y = 2.0 * y01 - 1 if loss == "ridge" else y01.astype(np.float64)
  p = x.shape[1] + 1
  a = _design(x)
  if loss == "ridge":
    optimum = np.linalg.solve(a.T @ a / len(y) + L2 * np.eye(p), a.T @ y / len(y))
  else:
    optimum = scipy.optimize.minimize(lambda t: _objective_np(loss, t, x, y), np.zeros(p), jac=True,
                                      method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-16, "maxiter": 50000}).x
  star, grad = _objective_np(loss, optimum, x, y)
  assert np.linalg.norm(grad) < 1e-6, (name, loss, np.linalg.norm(grad))
  return Problem(name, loss, x, y, split_labels, optimum, star, 0.0)


def local_smoothness(prob: Problem, parts: dict[str, list[np.ndarray]]) -> float:
  """L = the largest λ_max(∇²f_k) over the clients of every split (an upper bound for the logistic loss)."""
  curvature = 1.0 if prob.loss == "ridge" else 0.25
  top = max(np.linalg.eigvalsh(_design(prob.x[i]).T @ _design(prob.x[i]) / len(i))[-1]
            for idx in parts.values() for i in idx)
  return curvature * top + L2


def split(prob: Problem, how: str) -> list[np.ndarray]:
  if how == "iid":
    part = data_lib.iid_partition(prob.split_labels, NUM_CLIENTS, seed=0)
  elif how == "dirichlet0.1":
    part = data_lib.dirichlet_partition(prob.split_labels, NUM_CLIENTS, 0.1, seed=0)
  else:
    part = data_lib.shard_partition(prob.split_labels, NUM_CLIENTS, 1, seed=0)
  return list(part.client_indices)


def pack(prob: Problem, indices: list[np.ndarray], n_max: int) -> fo.ClientBatches:
  d = prob.x.shape[1]
  x = np.zeros((NUM_CLIENTS, 1, n_max, d))
  y = np.zeros((NUM_CLIENTS, 1, n_max))
  mask = np.zeros((NUM_CLIENTS, 1, n_max), bool)
  for k, idx in enumerate(indices):
    x[k, 0, :len(idx)], y[k, 0, :len(idx)], mask[k, 0, :len(idx)] = prob.x[idx], prob.y[idx], True
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray([float(len(i)) for i in indices]),
                          client_id=jnp.arange(NUM_CLIENTS, dtype=jnp.int32))


class Method(NamedTuple):
  """`make(problem, hyper) -> FederatedAlgorithm`, run for every value of `hypers`; `local` repeats the step axis
  LOCAL_STEPS times (local GD on the full batch); `sampled` zeroes half of the weights each round."""

  name: str
  make: Callable[[Problem, jax.Array], Any]
  hypers: tuple[float, ...]
  hyper_name: str
  local: bool = False
  sampled: bool = False
  losses: tuple[str, ...] = ("ridge", "logistic")
  rounds: int | None = None


def methods(p: int) -> list[Method]:
  cg = None if p <= 100 else 50
  newton_steps = lambda prob: 1 if prob.loss == "ridge" else 4
  exact = lambda prob: fo.algorithms.prox_quadratic(loss_fn(prob.loss))
  return [
      Method("DANE", lambda prob, mu: fo.algorithms.dane(loss_fn(prob.loss), 1.0, mu, num_clients=NUM_CLIENTS,
                                                         local_steps=newton_steps(prob), cg_iters=cg),
             (0.0, 0.01, 0.1, 1.0), "mu"),
      Method("FedDANE (half the clients)",
             lambda prob, mu: fo.algorithms.feddane(loss_fn(prob.loss), mu, local_steps=LOCAL_STEPS,
                                                    client_optimizer=optax.sgd(1.0 / (prob.smoothness + mu))),
             (0.0, 0.1, 1.0), "mu", sampled=True),
      Method("GIANT", lambda prob, _: fo.algorithms.giant(loss_fn(prob.loss), num_clients=NUM_CLIENTS,
                                                          cg_iters=min(p, 50)), (0.0,), "-"),
      Method("FADL", lambda prob, mu: fo.algorithms.fadl(loss_fn(prob.loss), mu, num_clients=NUM_CLIENTS,
                                                         local_steps=newton_steps(prob), cg_iters=cg),
             (0.0, 0.01, 0.1, 1.0), "mu"),
      Method("CoCoA+", lambda prob, _: None, (0.0,), "-", losses=("ridge",)),  # built in run_method (needs n_max)
      Method("one-shot average", lambda prob, _: fo.algorithms.one_shot_average(
          loss_fn(prob.loss), local_steps=newton_steps(prob), cg_iters=cg), (0.0,), "-", rounds=1),
      Method("FedAvg", lambda prob, c: fo.algorithms.fedavg(loss_fn(prob.loss),
                                                            client_optimizer=optax.sgd(c / prob.smoothness)),
             (0.1, 0.3, 1.0), "lr·L", local=True),
      Method("SCAFFOLD", lambda prob, c: fo.algorithms.scaffold(loss_fn(prob.loss), c / prob.smoothness, 1.0,
                                                                num_clients=NUM_CLIENTS),
             (0.1, 0.3, 1.0), "lr·L", local=True),
      Method("consensus ADMM", lambda prob, rho: fo.algorithms.admm_consensus(
          loss_fn(prob.loss), rho, num_clients=NUM_CLIENTS, objective="examples",
          **({"prox": exact(prob)} if prob.loss == "ridge" and p <= 100 else
             {"client_optimizer": optax.sgd(1.0 / (prob.smoothness + rho)), "local_steps": LOCAL_STEPS})),
             (0.1, 1.0, 10.0), "rho"),
  ]


def run_method(prob: Problem, method: Method, splits: dict[str, fo.ClientBatches], rounds: int) -> dict:
  """Relative gap and cumulative bits per client `[split][len(hypers), rounds + 1]`, one compiled program."""
  n_max = splits[SPLITS[0]].mask.shape[-1]
  d = prob.x.shape[1]
  loss = loss_fn(prob.loss)
  rng = np.random.default_rng(0)
  draws = np.stack([rng.permutation(NUM_CLIENTS) < NUM_CLIENTS // 2 for _ in range(rounds)])

  def objective(params, batches):
    losses = jax.vmap(lambda data: loss(params, jax.tree.map(lambda a: a[0], data)))(batches.data)
    return jnp.sum(jnp.where(batches.mask[:, 0], losses, 0)) / jnp.sum(batches.mask)

  def one_run(hyper, batches, draws):
    if method.name == "CoCoA+":
      algorithm = fo.algorithms.cocoa(L2, num_clients=NUM_CLIENTS, num_examples=n_max, local_steps=2 * n_max)
    else:
      algorithm = method.make(prob, hyper)
    run_batches = batches
    if method.local:
      run_batches = batches.replace(data=jax.tree.map(lambda a: jnp.repeat(a, LOCAL_STEPS, axis=1), batches.data),
                                    mask=jnp.repeat(batches.mask, LOCAL_STEPS, axis=1))
    params = {"w": jnp.zeros(d), "b": jnp.zeros(())}

    def round_(state, sampled):
      b = run_batches
      if method.sampled:
        b = b.replace(weight=jnp.where(sampled, b.weight, 0.0))
      state = algorithm.step(state, b)
      bits = state.metrics["bits_up"] + state.metrics["bits_down"]
      return state, (objective(state.params, batches), bits.astype(jnp.float64))

    _, (f, bits) = jax.lax.scan(round_, algorithm.init(params, jax.random.key(0)), jnp.asarray(draws))
    return jnp.concatenate([objective(params, batches)[None], f]), jnp.concatenate([jnp.zeros(1), jnp.cumsum(bits)])

  program = jax.jit(jax.vmap(one_run, in_axes=(0, None, None)))
  hypers = jnp.asarray(method.hypers, jnp.float64)
  out = {}
  for how, batches in splits.items():
    f, bits = program(hypers, batches, draws)
    out[how] = {"gap": (np.asarray(f) - prob.objective_star) / prob.objective_star, "bits": np.asarray(bits)}
  return out


def summarize(method: Method, gap: np.ndarray, bits: np.ndarray) -> dict:
  rows = []
  for i, hyper in enumerate(method.hypers):
    g = np.where(np.isfinite(gap[i]), gap[i], np.inf)
    reach = {}
    for tol in TOLERANCES:
      hit = np.flatnonzero(g <= tol)
      reach[f"{tol:g}"] = {"round": int(hit[0]) if hit.size else None,
                           "bits": float(bits[i, hit[0]]) if hit.size else None}
    final = float(g[-1])
    rows.append({method.hyper_name: hyper, "reach": reach, "final_gap": final,
                 "diverged": bool(not np.isfinite(final) or final > DIVERGED), "min_gap": float(np.min(g))})

  def cost(row):
    r = row["reach"]["0.0001"]["round"]
    return (0, r) if r is not None else (1, row["final_gap"] if np.isfinite(row["final_gap"]) else np.inf)

  best = min(range(len(rows)), key=lambda i: cost(rows[i]))
  return {"hypers": rows, "best": best}


def _fmt(value: Any, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _final(row: dict) -> str:
  return "diverged" if row["diverged"] else f"{row['final_gap']:.1e}"


def main(argv: list[str] | None = None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="heart_scale ridge alone, 12 rounds: a smoke test")
  parser.add_argument("--rounds", type=int, default=None, help="override the number of rounds")
  parser.add_argument("--datasets", default=",".join(DATASETS),
                      help=f"comma-separated subset of {','.join(DATASETS)} (MNIST 5k, P = 785, is the slow one)")
  parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args(argv)
  with jax.enable_x64(True):
    run(args)


def run(args: argparse.Namespace) -> None:
  start = time.perf_counter()
  rounds = args.rounds or (12 if args.quick else 100)
  results = {}
  for name, (x, y01, split_labels) in datasets(args.quick, tuple(args.datasets.split(","))).items():
    for loss in ("ridge",) if args.quick else ("ridge", "logistic"):
      prob = problem(name, x, y01, split_labels, loss)
      parts = {how: split(prob, how) for how in SPLITS}
      prob = prob._replace(smoothness=local_smoothness(prob, parts))
      n_max = max(len(i) for idx in parts.values() for i in idx)
      splits = {how: pack(prob, idx, n_max) for how, idx in parts.items()}
      task = f"{name} {loss}"
      print(f"\n{task}: n={len(prob.y)}, P={x.shape[1] + 1}, N={NUM_CLIENTS}, F*={prob.objective_star:.6f}, "
            f"{rounds} rounds; per split: rounds to 1e-4 (best hyper-parameter) / final relative gap")
      print(f"{'method':28}" + "".join(f"{how:>34}" for how in SPLITS))
      task_results = {}
      for method in methods(x.shape[1] + 1):
        if loss not in method.losses:
          continue
        t0 = time.perf_counter()
        out = run_method(prob, method, splits, method.rounds or rounds)
        cells, per_split = [], {}
        for how in SPLITS:
          summary = summarize(method, out[how]["gap"], out[how]["bits"])
          row = summary["hypers"][summary["best"]]
          hyper = "" if method.hyper_name == "-" else f" ({method.hyper_name}={method.hypers[summary['best']]:g})"
          cells.append(f"{_fmt(row['reach']['0.0001']['round'], 'd')}{hyper} / {_final(row)}")
          per_split[how] = {**summary, "best_gap_curve": [float(f"{v:.6g}") if np.isfinite(v) else None
                                                          for v in out[how]["gap"][summary["best"]]]}
        print(f"{method.name:28}" + "".join(f"{c:>34}" for c in cells) + f"   ({time.perf_counter() - t0:.0f} s)")
        task_results[method.name] = {"hyper_name": method.hyper_name, "hypers": list(method.hypers),
                                     "splits": per_split}
      results[task] = {"objective_star": prob.objective_star, "n": len(prob.y), "params": x.shape[1] + 1,
                       "client_sizes": {how: [len(i) for i in idx] for how, idx in parts.items()},
                       "methods": task_results}
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f"distributed_baselines{'_quick' if args.quick else ''}.json")
  with open(path, "w") as f:
    json.dump({"backend": jax.default_backend(), "jax": jax.__version__, "seconds": time.perf_counter() - start,
               "settings": {"clients": NUM_CLIENTS, "l2": L2, "local_steps": LOCAL_STEPS, "rounds": rounds,
                            "splits": SPLITS, "tolerances": TOLERANCES, "datasets": args.datasets},
               "tasks": results}, f, indent=1)
  print(f"\nwrote {path} ({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
  main()
