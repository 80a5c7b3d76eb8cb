"""Hyper-gradients through a run (`fo.hyper`): memory against R, and tuning against a 5×5 grid.

Memory. The 2NN MLP (199,210 parameters) trained by FedAdam on MNIST 5k (Dirichlet 0.5, 100 clients, C = 10,
S = 10, B = 20). For R rounds, XLA's account of the compiled program (`memory_analysis`: arguments, outputs and
temporaries, the peak the program holds on the device) for

* `forward`: the validation loss after R rounds (one forward run);
* `reverse, none`: its hyper-gradient without checkpointing (every round's residuals kept: ≈ R·(S + A));
* `reverse, round`: a `jax.checkpoint` per round (≈ R·S + A);
* `reverse, sqrt`: blocks of ≈ √R rounds, rounds checkpointed inside (≈ 2√R·S + A);
* `forward mode`: `jax.jvp` along the 2 hyper-parameters (≈ 2× a forward run's state, independent of R);
* `reverse, round + local steps`, `reverse, sqrt + local steps`: as above, and each client's local training and
  each of its local steps checkpointed too (`checkpoint_local_steps=True`): under a sequential client map (the
  default on a CPU) one round's residuals A become ≈ (C + K)·x, C clients' inputs and one client's K local
  starting points; under vmap ≈ C·K·x;
* `reverse, cbrt + local steps`: blocks of ≈ R^(2/3) rounds made of blocks of ≈ R^(1/3) (≈ 3·R^(1/3)·S + A).

S: the state (model, FedAdam's two moments), A: one round's residuals. Only compiled, not run.
`--part memory` alone writes `hypergrad_memory.json` (the platform it was compiled for in it), leaving the tuning
results of `hypergrad.json` as they are.

Tuning. FedAdam's client and server learning rates on MNIST 5k (Dirichlet 0.5), and Ditto's λ and personal step
size η on label-sorted MNIST 5k (2 shards of one label each per client), both with the 2NN MLP:

* the grid: 5×5 log-spaced points, run as one `fo.sweep` program for R rounds; its best validation accuracy;
* the hyper-gradient: `fo.hyper.tune(schedule="online")` from a start 10× below the grid's centre in every
  hyper-parameter (the grid's smallest corner), windows of K rounds of one run of R rounds, Adam (0.3) on the log
  hyper-parameters; then a fresh run of R rounds at the tuned values, from the same start and data stream as the
  grid's runs. Reported: the validation accuracy of that fresh run (Ditto: of each client's personal model), and
  of the tuning run itself;
* offline: `fo.hyper.tune(schedule="offline")` from the same start, T = 6 outer steps (Adam 0.5), each
  differentiating the whole R-round run (no short horizon), then the fresh run at the tuned values: 3R·T + R
  rounds.

Compute is counted in rounds trained, a backward round as two (the recomputed forward and the backward itself):
the grid 25·R, the online tuning R + 2R = 3R, and the fresh run R: 4R in all. The validation data is the
clients' test split (the grid's best point is chosen on it too).

    python benchmarks/hypergrad.py            # R = 25 … 200 (memory), R = 100 (tuning); a GPU is advised
    python benchmarks/hypergrad.py --quick    # a 784-16-16-10 MLP, R = 4, FedAdam only: a smoke test

Writes benchmarks/results/hypergrad.json (`hypergrad_quick.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fedjax_opt as fo  # noqa: E402  pylint: disable=wrong-import-position

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SAMPLING = fo.Sampling(clients_per_round=10, batch_size=20, local_steps=10)


def _data(partition: str, **options):
  dataset = fo.data.load("mnist5k", partition=partition, num_clients=100, seed=0, test_fraction=0.2, flatten=True,
                         **options)
  validation = fo.data.client_batches(dataset, 50, split="test")
  return dataset, validation


def _fedadam(model):
  return lambda h: fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(h["client_lr"]),
                                        server_optimizer=fo.server_optimizers.fedadam(h["server_lr"]))


def _ditto(model, num_clients):
  return lambda h: fo.algorithms.ditto(model.loss_fn, h["lam"], h["eta"], num_clients=num_clients,
                                       personal_steps=10, client_optimizer=optax.sgd(0.05))


def _accuracy(model, personalized: bool):
  """Mean accuracy over every validation example (each client's own model with `personalized`)."""

  def accuracy(state, batches):
    c = batches.mask.shape[0]
    data = fo.core.materialize(batches.data)
    x = data["x"].reshape((c, -1) + data["x"].shape[3:])
    y = data["y"].reshape(c, -1)
    mask = batches.mask.reshape(c, -1)
    if personalized:
      models = fo.personalized_params(state, batches.client_id)
      logits = jax.vmap(model.apply)(models, x)
    else:
      logits = jax.vmap(model.apply, in_axes=(None, 0))(state.params, x)
    right = (jnp.argmax(logits, -1) == y) & mask
    return jnp.sum(right) / jnp.sum(mask)

  return accuracy


def _nbytes(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
         "temporaries": int(m.temp_size_in_bytes)}
  out["total"] = sum(out.values())
  return out


def _model(quick: bool):
  """The 2NN MLP; `--quick` narrows its hidden layers to 16 (compilation is most of a quick run)."""
  return fo.models.mlp_2nn(hidden=16 if quick else 200)


def memory(rounds_list, quick: bool) -> list[dict]:
  model = _model(quick)
  dataset, validation = _data("dirichlet", alpha=0.5)
  params = model.init(jax.random.key(0))
  make = _fedadam(model)
  objective = fo.hyper.validation_loss(model.loss_fn)
  u = fo.hyper.unconstrain({"client_lr": 0.03, "server_lr": 1e-3})
  rows = []
  for rounds in rounds_list:
    programs = {
        "forward": jax.jit(lambda *a, f=fo.hyper.objective_fn(make, objective, rounds=rounds, sampling=SAMPLING):
                           f(*a)[0]),
        "reverse, none": fo.hyper.value_and_grad(make, objective, rounds=rounds, sampling=SAMPLING, checkpoint=None),
        "reverse, round": fo.hyper.value_and_grad(make, objective, rounds=rounds, sampling=SAMPLING, checkpoint=1),
        "reverse, sqrt": fo.hyper.value_and_grad(make, objective, rounds=rounds, sampling=SAMPLING,
                                                 checkpoint="sqrt"),
        "forward mode": fo.hyper.value_and_grad(make, objective, rounds=rounds, sampling=SAMPLING, mode="forward"),
        "reverse, round + local steps": fo.hyper.value_and_grad(make, objective, rounds=rounds, sampling=SAMPLING,
                                                                checkpoint=1, checkpoint_local_steps=True),
        "reverse, sqrt + local steps": fo.hyper.value_and_grad(make, objective, rounds=rounds, sampling=SAMPLING,
                                                               checkpoint="sqrt", checkpoint_local_steps=True),
        "reverse, cbrt + local steps": fo.hyper.value_and_grad(make, objective, rounds=rounds, sampling=SAMPLING,
                                                               checkpoint="cbrt", checkpoint_local_steps=True),
    }
    if quick:
      programs = {k: programs[k] for k in ("forward", "reverse, round")}
    for name, program in programs.items():
      start = time.perf_counter()
      compiled = program.lower(u, params, jax.random.key(1), dataset, validation).compile()
      row = {"rounds": rounds, "program": name, **_nbytes(compiled),
             "compile_seconds": round(time.perf_counter() - start, 2)}
      rows.append(row)
      print(f"R={rounds:4d}  {name:29s} total {row['total'] / 2**20:9.1f} MiB  temporaries "
            f"{row['temporaries'] / 2**20:9.1f} MiB", flush=True)
  for row in rows:
    forward = next(r["total"] for r in rows if r["rounds"] == row["rounds"] and r["program"] == "forward")
    row["vs_forward"] = round(row["total"] / forward, 3)
  return rows


def _grid_and_tune(name, make, dataset, validation, params, objective, accuracy, grid_axes, start, rounds, window,
                   quick) -> dict:
  grid = fo.sweep.grid(**grid_axes)
  swept = fo.sweep.vmap_algorithm(lambda **h: make(h), grid)

  @jax.jit
  def run_grid(params, key, dataset, validation):
    init_key, data_key = jax.random.split(key)
    state = swept.init(params, init_key)

    def body(s, _):
      r = s.round[0]
      batches = fo.data.sample_round(jax.random.fold_in(data_key, r), dataset, deferred=True, **SAMPLING.kwargs())
      return swept.step(s, batches), None

    state = jax.lax.scan(body, state, None, length=rounds)[0]
    return jax.vmap(lambda s: accuracy(s, validation))(state)

  t0 = time.perf_counter()
  grid_accuracy = np.asarray(jax.block_until_ready(run_grid(params, jax.random.key(1), dataset, validation)))
  grid_seconds = time.perf_counter() - t0
  best = int(np.argmax(grid_accuracy))
  @jax.jit
  def run_at(h, params, key, dataset, validation):
    """R rounds of `make(h)` from the grid's start and data stream: the run the grid's member at h would be."""
    algorithm = make(h)
    init_key, data_key = jax.random.split(key)

    def body(s, _):
      batches = fo.data.sample_round(jax.random.fold_in(data_key, s.round), dataset, deferred=True,
                                     **SAMPLING.kwargs())
      return algorithm.step(s, batches), None

    state = jax.lax.scan(body, algorithm.init(params, init_key), None, length=rounds)[0]
    return accuracy(state, validation)

  t0 = time.perf_counter()
  result = fo.hyper.tune(make, objective, start, params, jax.random.key(1), dataset, validation, rounds=window,
                         outer_steps=rounds // window, schedule="online", optimizer=optax.adam(0.3),
                         sampling=SAMPLING)
  online_accuracy = float(jax.jit(accuracy)(fo.sweep.member(result.state, 0), validation))
  tuned = {k: v[0] for k, v in result.hyper_params.items()}
  tuned_accuracy = float(run_at(tuned, params, jax.random.key(1), dataset, validation))
  tune_seconds = time.perf_counter() - t0
  # The check that run_at is the grid's run: at the grid's best point it gives the grid's accuracy.
  at_best = float(run_at({k: jnp.asarray(v[best], jnp.float32) for k, v in grid.items()}, params,
                         jax.random.key(1), dataset, validation))
  out = {
      "task": name, "rounds": rounds, "window": window,
      "grid": {k: [float(v) for v in vals] for k, vals in grid_axes.items()},
      "grid_accuracy": [float(a) for a in grid_accuracy],
      "grid_best": {**{k: float(v[best]) for k, v in grid.items()}, "accuracy": float(grid_accuracy[best])},
      "grid_rounds_trained": 25 * rounds, "grid_seconds": round(grid_seconds, 2),
      "tune_start": {k: float(v) for k, v in start.items()},
      "tune_trajectory": {k: [float(x) for x in np.asarray(v[0])] for k, v in result.trajectory.items()},
      "tune_validation_loss": [float(x) for x in np.asarray(result.values[0])],
      "tune_online_accuracy": online_accuracy, "tune_accuracy": tuned_accuracy,
      "tune_rounds_trained": 4 * rounds, "tune_seconds": round(tune_seconds, 2),
      "grid_best_rerun_accuracy": at_best,
  }
  out["gap_points"] = round(100 * (out["grid_best"]["accuracy"] - tuned_accuracy), 2)
  # Offline: every outer step differentiates the whole R-round run from the same start (no short-horizon bias),
  # 3R rounds a step; T steps and the fresh run stay under the grid's 25R.
  outer = 2 if quick else 6
  t0 = time.perf_counter()
  offline = fo.hyper.tune(make, objective, start, params, jax.random.key(1), dataset, validation, rounds=rounds,
                          outer_steps=outer, schedule="offline", optimizer=optax.adam(0.5), sampling=SAMPLING)
  tuned_offline = {k: v[0] for k, v in offline.hyper_params.items()}
  offline_accuracy = float(run_at(tuned_offline, params, jax.random.key(1), dataset, validation))
  out.update({
      "offline_outer_steps": outer, "offline_accuracy": offline_accuracy,
      "offline_trajectory": {k: [float(x) for x in np.asarray(v[0])] for k, v in offline.trajectory.items()},
      "offline_validation_loss": [float(x) for x in np.asarray(offline.values[0])],
      "offline_rounds_trained": 3 * rounds * outer + rounds,
      "offline_seconds": round(time.perf_counter() - t0, 2),
      "offline_gap_points": round(100 * (out["grid_best"]["accuracy"] - offline_accuracy), 2),
  })
  print(f"{name}: offline hyper-gradient ({outer} steps of the whole run) {100 * offline_accuracy:.2f}% at "
        f"{ {k: round(float(v), 5) for k, v in tuned_offline.items()} } ({out['offline_rounds_trained']} rounds)",
        flush=True)
  print(f"{name}: grid best {100 * out['grid_best']['accuracy']:.2f}% at {out['grid_best']}  ({25 * rounds} rounds, "
        f"{grid_seconds:.1f} s); hyper-gradient {100 * tuned_accuracy:.2f}% ending at "
        f"{ {k: round(v[-1], 5) for k, v in out['tune_trajectory'].items()} } (tuning run "
        f"{100 * online_accuracy:.2f}%; {4 * rounds} rounds, "
        f"{tune_seconds:.1f} s)", flush=True)
  return out


def tuning(rounds: int, window: int, quick: bool) -> list[dict]:
  model = _model(quick)
  params = model.init(jax.random.key(0))
  out = []
  dataset, validation = _data("dirichlet", alpha=0.5)
  out.append(_grid_and_tune(
      "FedAdam, MNIST 5k Dirichlet(0.5)", _fedadam(model), dataset, validation, params,
      fo.hyper.validation_loss(model.loss_fn), _accuracy(model, False),
      {"client_lr": np.geomspace(0.01, 1.0, 5), "server_lr": np.geomspace(3e-4, 3e-2, 5)},
      {"client_lr": 0.01, "server_lr": 3e-4}, rounds, window, quick))
  if quick:  # one task is enough for a smoke test
    return out
  dataset, validation = _data("shards", shards_per_client=2)
  out.append(_grid_and_tune(
      "Ditto, label-sorted MNIST 5k", _ditto(model, dataset.num_clients), dataset, validation, params,
      fo.hyper.validation_loss(model.loss_fn, personalized=True), _accuracy(model, True),
      {"lam": np.geomspace(0.01, 1.0, 5), "eta": np.geomspace(0.003, 0.3, 5)}, {"lam": 0.01, "eta": 0.003},
      rounds, window, quick))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small R: a smoke test")
  parser.add_argument("--part", choices=("all", "memory", "tuning"), default="all")
  parser.add_argument("--out-dir", default=RESULTS)
  args = parser.parse_args(argv)
  report = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
            "platform": platform.platform(), "jax": jax.__version__, "quick": args.quick}
  if args.part in ("all", "memory"):
    report["memory"] = memory((4,) if args.quick else (25, 50, 100, 200), args.quick)
  if args.part in ("all", "tuning"):
    report["tuning"] = tuning(4 if args.quick else 100, 2 if args.quick else 5, args.quick)
  os.makedirs(args.out_dir, exist_ok=True)
  name = "hypergrad_memory" if args.part == "memory" else "hypergrad"
  path = os.path.join(args.out_dir, f"{name}_quick.json" if args.quick else f"{name}.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {path}")
  return report


if __name__ == "__main__":
  main()
