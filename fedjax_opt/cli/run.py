"""`fedjax-opt run`: every chosen algorithm on one federated dataset, from one initial model."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import time
import warnings
from typing import Any, Callable, NamedTuple

from fedjax_opt.cli import config as config_lib
from fedjax_opt.cli import files, network, privacy, registry, report, robust, trust
from fedjax_opt.cli.config import UsageError

__all__ = ["DEGRADED_ACCURACY_DROP", "DEGRADED_LOSS_FACTOR", "Wrappers", "bits_per_round", "build_algorithm",
           "build_model", "command_run", "compile_cache_dir", "load_dataset", "network_context", "outcome",
           "pooled_sample", "prepared_context", "sampling", "start_jax", "train_and_report"]

FLOAT_BITS = 32
"""Bits per parameter of a model-sized message (float32)."""


def load_dataset(config: dict[str, Any]):
  """The federated dataset the config names (with `--planted`, its clients' examples mapped per group)."""
  return load_dataset_and_groups(config)[0]


def load_dataset_and_groups(config: dict[str, Any]):
  """(the federated dataset, the planted group of each client `[N]` or None)."""
  from fedjax_opt import data

  dataset = _load_split(config)
  if config.get("planted") is None:
    return dataset, None
  kind, _, count = config["planted"].partition(":")
  try:
    return data.plant_groups(dataset, int(count), kind=kind, seed=config["seed"])
  except ValueError as e:
    raise UsageError(f"--planted {config['planted']}: {str(e).splitlines()[0].removeprefix('plant_groups: ')}") from None


def _load_split(config: dict[str, Any]):
  from fedjax_opt import data

  name = config["dataset"]
  if files.is_file_dataset(name):
    return files.load(config)
  try:
    if name.startswith("synthetic"):
      options = {} if config["num_clients"] is None else {"num_clients": config["num_clients"]}
      return data.load(name, seed=config["seed"], **options)
    if name == "shakespeare":
      return data.load(name, sample_roles=config["num_clients"], seed=config["seed"])
    options = dict(partition=config["partition"], num_clients=config["num_clients"], seed=config["seed"])
    if config["partition"] == "dirichlet":
      options["alpha"] = config["alpha"]
    return data.load(name, **options)
  except ValueError as e:
    raise UsageError(f"cannot split {name!r} as asked: {config_lib.flag_names(str(e).splitlines()[0])}") from None


def model_choice(config: dict[str, Any], dataset) -> str:
  """The model name: `--model`, or by dataset (`config_lib.AUTO_MODEL`: rnn for text; logreg for the ADMM family,
  feature vectors and images under `MLP_MIN_PIXELS` pixels; mlp for larger images and whenever FedMA runs)."""
  import math as _math

  names = config["algorithms"].split(",")
  convex = [n for n in names if registry.REGISTRY[n].convex]
  matched = [n for n in names if registry.REGISTRY[n].family == "matched"]
  choice = config["model"]
  text = dataset.sequence_length > 0  # windows of a token stream (Shakespeare)
  if choice == "auto":
    if text:
      choice = "rnn"
    elif convex:
      choice = "logreg"
    elif matched:  # hidden units to match
      choice = "mlp"
    else:
      shape = tuple(dataset.examples["x"].shape[2:])
      choice = "mlp" if len(shape) >= 2 and _math.prod(shape) >= config_lib.MLP_MIN_PIXELS else "logreg"
  if text and convex:
    raise UsageError(f"{', '.join(convex)} need(s) a convex model, and {config['dataset']!r} holds character "
                     f"sequences (a recurrent model): choose a dataset of images or feature vectors")
  if convex and choice != "logreg":
    raise UsageError(f"{', '.join(convex)} need(s) a convex model: use --model logreg (got {choice}), "
                     f"or run the convex-only algorithms separately")
  if text and choice != "rnn":
    raise UsageError(f"dataset {config['dataset']!r} holds character sequences: use --model rnn (got {choice})")
  if not text and choice == "rnn":
    raise UsageError(f"model 'rnn' needs character sequences; dataset {config['dataset']!r} holds features")
  return choice


def build_model(config: dict[str, Any], dataset):
  """The model the config names."""
  from fedjax_opt import models

  choice = model_choice(config, dataset)
  k = dataset.num_classes
  if choice == "rnn":
    return models.char_rnn(vocab_size=k, sequence_length=dataset.sequence_length)
  shape = _example_shape(dataset)
  if choice == "cnn" and len(shape) < 2:
    raise UsageError(f"model 'cnn' needs image data; dataset {config['dataset']!r} has feature shape {shape}")
  return registry.architecture_model(choice, shape, k)


def sampling(spec: registry.Spec, hyper: dict[str, Any], config: dict[str, Any], dataset) -> dict[str, Any]:
  """The fields of `fo.Sampling` for `spec` (`sample_round`'s keywords): sampled clients, or every client's whole
  train split."""
  if spec.sampling == "clients":
    steps = config["local_steps"] if spec.data_steps is None else spec.data_steps(hyper, config["local_steps"])
    out = dict(clients_per_round=config["clients_per_round"], local_steps=steps, batch_size=config["batch_size"])
    if privacy.enabled(config):  # the sampling the accountant is given (fixed: the same as without DP)
      out.update(privacy.train_kwargs(privacy.sampling(config, dataset.num_clients)))
    return out
  if spec.sampling in ("nodes", "all", "events"):  # every client's S batches of B: every node, or whoever arrives
    return dict(clients_per_round=dataset.num_clients, client_sampling="all", local_steps=config["local_steps"],
                batch_size=config["batch_size"])
  out = dict(clients_per_round=dataset.num_clients, client_sampling="all", local_epochs=1,
             batch_size=dataset.max_train)
  if spec.sampling == "full_fixed":
    out["example_order"] = "fixed"
  return out


def clients_taking_part(spec: registry.Spec, config: dict[str, Any], dataset) -> int:
  """Clients that send per round (per server event, asynchronous: the one arrival)."""
  if spec.sampling == "events":
    return 1
  return config["clients_per_round"] if spec.sampling == "clients" else dataset.num_clients


def steps_per_round(spec: registry.Spec, config: dict[str, Any]) -> int:
  """`fo.train` steps per --rounds round: an asynchronous run's R rounds are R × C one-arrival server events."""
  return config["clients_per_round"] if spec.sampling == "events" else 1


def bits_per_round(spec: registry.Spec, round_metrics: dict, num_params: int, clients: int,
                   num_clients: int, communication: str | None = None) -> Any:
  """`[R]` bits sent in each round: every message counted once, when sent (a broadcast is one message).

  `communication` overrides `spec.communication` (the factory's declaration): "metrics" for a run whose client
  stage or secure sum makes the round's `bits_up` what the clients send."""
  import numpy as np

  member0 = _member0
  communication = spec.communication if communication is None else communication
  scalar = min(round_metrics.values(), key=np.ndim)  # [R], or [K, R] for a sweep (vector metrics have one more)
  rounds = len(member0(scalar))
  if communication == "bits":
    return member0(round_metrics["bits"])
  if communication == "metrics":
    return member0(round_metrics["bits_up"]) * clients + member0(round_metrics["bits_down"])  # one broadcast
  if communication == "bytes":
    return member0(round_metrics["bytes_sent"]) * 8 * num_clients
  uploads, broadcasts = spec.messages
  return np.full(rounds, (clients * uploads + broadcasts) * FLOAT_BITS * num_params, np.float64)


def _member0(values) -> Any:
  """A round metric `[R]` as float64, sweep member 0's for `[K, R]`."""
  import numpy as np

  values = np.asarray(values, np.float64)
  return values[0] if values.ndim == 2 else values


def _initial_state(algo, model, config: dict[str, Any]):
  """(algorithm, initial state, data seed(s)): one run, or a sweep over `--seeds` seeds."""
  import jax
  import jax.numpy as jnp

  from fedjax_opt import sweep

  seed, n = config["seed"], config["seeds"]
  if n == 1:
    return algo, algo.init(model.init(jax.random.key(seed)), jax.random.key(seed + 1)), seed
  seeds = [seed + i for i in range(n)]
  swept = sweep.seeds(algo, n)
  params = sweep.stack([model.init(jax.random.key(s)) for s in seeds])
  keys = jnp.stack([jax.random.key(s + 1) for s in seeds])
  return swept, swept.init(params, keys, params_axis=0), seeds


def _members(state, n: int) -> list:
  """The K members of a swept state (the state itself for a single run)."""
  import jax

  if n == 1:
    return [state]
  return [jax.tree.map(lambda x, i=i: x[i], state) for i in range(n)]


def personalized_per_client(spec: registry.Spec, algo, state, dataset, metric_fns,
                            size: int, table_fn: Callable | None = None) -> list[list[float | None]]:
  """Each client's personalized test accuracy (None: no test example), per sweep member."""
  import jax
  import numpy as np

  import fedjax_opt as fo
  from fedjax_opt import evaluate

  out = []
  for member in _members(state, size):
    if spec.evaluation == "table":
      table = (table_fn or fo.personalized_params)(member)
      result = jax.jit(lambda t, d: evaluate.personalized(t, d, metric_fns))(table, dataset)
    else:
      result = jax.jit(lambda p, d, adapt=algo.personalize: evaluate.adapted(p, adapt, d, metric_fns))(
          member.params, dataset)
    values = np.asarray(result.per_client["accuracy"], np.float64)
    evaluated = np.asarray(result.evaluated)
    out.append([float(v) if e else None for v, e in zip(values, evaluated)])
  return out


def training_objective(spec: registry.Spec, hyper: dict, model) -> Callable:
  """`objective(x, batches) -> F` that `spec`'s algorithm minimises, scored by `model`: the pooled ridge-regularised
  risk of one model, or the mixture objective of the table of personalized models (`spec.objective == "mixture"`)."""
  from fedjax_opt import objectives

  loss = registry._ridge(model.loss_fn, hyper.get("l2", 0.0))  # pylint: disable=protected-access
  return objectives.mixture(loss, hyper["lam"]) if spec.objective == "mixture" else objectives.pooled(loss)


def objective_during_training(spec: registry.Spec, hyper: dict, model) -> Callable | None:
  """`Evaluation.objective` for `spec` (None for an algorithm without an objective): F at every evaluation, in the
  program's dtype, on every client's train split, for the objective-gap curve (objective_gap.png)."""
  if spec.objective is None:
    return None
  from fedjax_opt.data import client_batches

  objective = training_objective(spec, hyper, model)
  mixture = spec.objective == "mixture"

  def during(params, table, dataset):
    return objective(table if mixture else params, client_batches(dataset, dataset.max_train, split="train"))

  return during


def objective_gap(spec: registry.Spec, hyper: dict, model, state, dataset, size: int,
                  solved: dict | None = None, row: dict | None = None,
                  say: Callable[[str], None] | None = None) -> dict[str, Any]:
  """F at the final model(s), the reference F*, and the relative gap (F − F*)/|F*| ≥ 0, all in float64.

  `model` is the model that scores the algorithm's parameters (`Spec.scoring_model`: the run's, or CoCoA+'s
  linear model and loss). F is evaluated in float64: the final parameters and the data cast to float64, JAX's
  64-bit mode on for the evaluation (a float32 evaluation is off by about 1e-7 relative, the size of the gaps of
  the Newton-type methods). The reference solve is the algorithm's `Spec.reference` where it gives one (a
  non-smooth loss), else a float64 L-BFGS solve (`objectives.minimize`). A solve stops at a tolerance, so a
  trained model may score below it: F* is the least of the solve's value and the final F of every algorithm (every
  sweep member) of the run that minimises the same objective, the finite ones. Each F is then ≥ F* exactly, so no
  gap is negative by construction; the gap is clamped at 0 besides, and stays NaN for a NaN F.

  `solved` (a dict kept for one run: one dataset) holds, per objective, the solve and the final F of the algorithms
  scored so far, so algorithms that minimise the same objective (consensus ADMM, GADMM, CQ-GGADMM, DANE, ... with
  the same model and l2) share one solve and one F*. `row` is the results row these keys go into: they are written
  there too, and with `solved` the rows of the objective's earlier algorithms are restated whenever a later
  algorithm lowers F*, so that every row of an objective ends with the same F*, the least of the whole run.
  `say`, when given, is told (one line) before a reference solve starts: it takes seconds on a larger dataset.

  Returns:
    `objective` (F; a list per seed for a sweep), `objective_reference` (the solve's value), `objective_star`
    (F*) and `objective_gap` ((F − F*)/|F*|; a list per seed for a sweep).
  """
  import jax
  import numpy as np

  import fedjax_opt as fo
  from fedjax_opt import objectives
  from fedjax_opt.data import client_batches

  def to64(a):
    a = np.asarray(a)
    return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a

  objective = training_objective(spec, hyper, model)
  batches = client_batches(dataset, dataset.max_train, split="train")
  params0 = model.init(jax.random.key(0))
  if spec.objective == "mixture":
    start = fo.core.per_client.broadcast(params0, dataset.num_clients)
    finals = [fo.personalized_params(m) for m in _members(state, size)]
  else:
    start = params0
    finals = [m.params for m in _members(state, size)]
  with jax.enable_x64(True):
    batches64 = jax.tree.map(to64, batches)
    values = [float(objective(jax.tree.map(to64, p), batches64)) for p in finals]
  key = (spec.objective, model.name, float(hyper.get("l2", 0.0)),
         float(hyper["lam"]) if spec.objective == "mixture" else None)
  record = None if solved is None else solved.get(key)
  if record is None:
    reference = spec.reference(hyper, batches) if spec.reference is not None else None
    if reference is None:
      if say is not None:
        say(f"solving the centralized objective in float64 (L-BFGS) for the objective gap's reference F* "
            f"({dataset.num_clients} clients' data pooled)")
      reference = objectives.minimize(objective, start, batches)[1]
    record = {"reference": float(reference), "values": [], "rows": []}
    if solved is not None:
      solved[key] = record
  record["values"].extend(values)
  candidates = [v for v in [record["reference"], *record["values"]] if math.isfinite(v)]
  f_star = min(candidates) if candidates else math.nan

  def gap(v: float) -> float:
    g = (v - f_star) / max(abs(f_star), 1e-12)
    return g if math.isnan(g) else max(0.0, g)

  def restate(objective_values) -> dict[str, Any]:
    gaps = [gap(v) for v in objective_values] if isinstance(objective_values, list) else gap(objective_values)
    return {"objective_reference": record["reference"], "objective_star": f_star, "objective_gap": gaps}

  out = {"objective": values[0] if size == 1 else values, **restate(values[0] if size == 1 else values)}
  for earlier in record["rows"]:
    earlier.update(restate(earlier["objective"]))
  if row is not None:
    row.update(out)
    record["rows"].append(row)
  return out


def _summarize(last: dict[str, Any], key: str) -> dict[str, Any]:
  """`{key: value}`, or for a sweep `{key: mean, key_std: std, key_per_seed: [...]}`; `{}` when not reported."""
  import numpy as np

  if key not in last:  # e.g. no train loss: L2GD, the ADMM family
    return {}
  value = last[key]
  if not isinstance(value, list):
    return {key: value}
  values = np.asarray(value, np.float64)
  return {key: float(values.mean()), key + "_std": float(values.std()), key + "_per_seed": value}


def _last(values: Any) -> Any:
  """The last round's value of a round metric `[R]` (a float), or per seed `[K, R]` (a list)."""
  import numpy as np

  values = np.asarray(values, np.float64)
  return float(values[-1]) if values.ndim == 1 else values[:, -1].tolist()


def cluster_recovery(state, groups, size: int) -> dict[str, Any]:
  """The clients' clustering against the planted groups ({} without either): `ari`, `num_clusters` (clusters with
  a client assigned), `unassigned_clients` (clients without a cluster, −1: IFCA's never sampled), `cluster_of`
  (each client's cluster; per seed for a sweep) and `planted_groups`."""
  import numpy as np

  from fedjax_opt.core import clusters

  found = [clusters.assignment(m) for m in _members(state, size)]
  if groups is None or found[0] is None:
    return {}
  ari = [clusters.adjusted_rand_index(groups, f) for f in found]
  used = [int(np.unique(f[f >= 0]).size) for f in found]
  unassigned = [int(np.sum(f < 0)) for f in found]
  out = {"planted_groups": groups.tolist(), "cluster_of": [f.tolist() for f in found]}
  if size == 1:
    return {**out, "ari": ari[0], "num_clusters": used[0], "unassigned_clients": unassigned[0],
            "cluster_of": found[0].tolist()}
  return {**out, "ari": float(np.mean(ari)), "ari_per_seed": ari, "num_clusters": used,
          "unassigned_clients": unassigned}


def _example_shape(dataset) -> tuple:
  """The shape of one example's features x, or () for a dataset without them (text: token windows)."""
  x = dataset.examples.get("x") if isinstance(dataset.examples, dict) else None
  return () if x is None else tuple(x.shape[2:])


def _prepared(config: dict[str, Any], say: Callable[..., None] = print):
  """(dataset, model, [(name, spec, hyper, algorithm)], planted groups or None): built and checked before running."""
  dataset, model, ctx, wrappers, groups = prepared_context(config, say)
  built = []
  for name in config["algorithms"].split(","):
    spec = registry.REGISTRY[name]
    hyper = config_lib.hyper_parameters(config, name)
    used: dict = {}
    algo = build_algorithm(name, hyper, config, ctx, wrappers, used)
    built.append((name, spec, dict(hyper, **wrappers.robust_used, **used), algo))
  return dataset, model, built, groups


class Wrappers(NamedTuple):
  """What the run puts around every algorithm: `--attack label_flip`'s poisoning (or None), the aggregator and
  attack settings recorded with its hyper-parameters, the aggregation rule (`--aggregator`'s or the DP mean; None:
  the factory's own) and an update attack's `corrupt` wrapper (or None) that `fedjax_opt.cli.trust` assembles with
  `--secure-aggregation` and `--compression`, the initial model (None without those) and `slots(spec, hyper)`, the
  clients a round of that algorithm holds."""

  poison: Any
  robust_used: dict
  rule: Any
  corrupt: Any
  params: Any
  slots: Callable


def prepared_context(config: dict[str, Any], say: Callable[..., None] = print):
  """(dataset, model, `registry.Context`, `Wrappers`, planted groups or None): what every algorithm of the run is
  built from (`build_algorithm`), checked before anything runs."""
  dataset, groups = load_dataset_and_groups(config)
  names = config["algorithms"].split(",")
  config_lib.check_clients_per_round(config, names, dataset.num_clients,
                                     given_num_clients=config["num_clients"] == dataset.num_clients)
  model = build_model(config, dataset)
  try:
    robust.check_rows(config, names, registry, dataset.num_clients)
    rule, corrupt, poison, robust_used = robust.build(config, config["clients_per_round"], dataset.num_classes)
  except robust.RobustError as e:
    raise UsageError(str(e)) from None
  if privacy.enabled(config):
    try:
      rule, _ = privacy.build(config, dataset.num_clients, say)
    except privacy.PrivacyError as e:
      raise UsageError(str(e)) from None
  try:
    ctx = registry.Context(loss_fn=model.loss_fn, num_clients=dataset.num_clients, max_train=dataset.max_train,
                           local_steps=config["local_steps"], rounds=config["rounds"],
                           client_map=effective_client_map(config), aggregator=None,
                           clients_per_round=config["clients_per_round"], apply_fn=model.apply, model=model,
                           pooled=pooled_sample(dataset, config["seed"]), seed=config["seed"],
                           example_shape=_example_shape(dataset), **network_context(config, dataset))
  except network.NetworkError as e:
    raise UsageError(str(e)) from None
  params = None
  if trust.enabled(config):  # the compression stage's residual table is shaped like the model
    import jax

    params = model.init(jax.random.key(config["seed"]))
  slots = lambda spec, hyper: sampling(spec, hyper, config, dataset)["clients_per_round"]  # noqa: E731
  return dataset, model, ctx, Wrappers(poison, robust_used, rule, corrupt, params, slots), groups


def build_algorithm(name: str, hyper: dict[str, Any], config: dict[str, Any], ctx, wrappers: Wrappers,
                    used: dict | None = None):
  """Algorithm `name` with the resolved `hyper` as the run trains it: the registry's factory with the run's
  aggregator (`--aggregator` or the DP mean, inside `--secure-aggregation`, behind `--compression`, under an
  update `--attack`: `fedjax_opt.cli.trust`), poisoned (`--attack label_flip`), on the simulated clock
  (`--async`). The values of `hyper` may be traced (`fedjax-opt tune` differentiates through them); a bad value
  is one line. `used`, if given, receives the compression and secure-aggregation settings."""
  spec = registry.REGISTRY[name]
  try:
    aggregator, trust_used = trust.assemble(name, config, wrappers.rule, wrappers.corrupt, params=wrappers.params,
                                            num_clients=ctx.num_clients, max_train=ctx.max_train,
                                            slots=wrappers.slots(spec, hyper))
  except trust.TrustError as e:
    raise UsageError(str(e)) from None
  if used is not None:
    used.update(trust_used)
  try:
    algo = registry.build(name, dataclasses.replace(ctx, aggregator=aggregator), hyper)
    if wrappers.poison is not None:
      algo = wrappers.poison(algo, ctx.num_clients)
    if config["asynchronous"] and spec.sampling != "events":  # the synchronous baseline on the same clock
      from fedjax_opt.core import asynchrony

      algo = asynchrony.synchronous_clock(algo, network.compute_time(config["delay"]), seed=config["seed"])
  except registry.HyperParameterError as e:
    if not trust_used:
      raise UsageError(str(e)) from None
    message = trust.shorten(str(e).removeprefix(f"{name}: ").removeprefix(f"{name}: "))
    raise UsageError(f"{name} with {trust.describe(config).lstrip(', ')}: {message}") from None
  except ValueError as e:  # the attack's own checks
    raise UsageError(f"{name}: {str(e).splitlines()[0]}") from None
  return algo


def network_context(config: dict[str, Any], dataset) -> dict[str, Any]:
  """The `registry.Context` fields of --topology and --async: the graph, the clock, Zeno++'s batch."""
  out: dict[str, Any] = {}
  if config["topology"] is not None:
    out["graph"] = network.graph(config["topology"], dataset.num_clients, config["seed"])
  if config["asynchronous"]:
    from fedjax_opt.core import asynchrony

    out["schedule"] = asynchrony.wall_clock(network.compute_time(config["delay"]),
                                            concurrency=min(config["clients_per_round"], dataset.num_clients))
    out["validation"] = pooled_sample(dataset, config["seed"])(ZENO_VALIDATION)
  return out


def pooled_sample(dataset, seed: int) -> Callable[[int], dict]:
  """`sample(n)`: n of the pooled train examples (all of them if fewer), drawn without replacement by `seed`."""

  def sample(n: int) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from fedjax_opt import data as data_lib

    train = data_lib.unpack(dataset, "train")
    pooled = {k: np.concatenate([c[k] for c in train]) for k in train[0]}
    size = len(next(iter(pooled.values())))
    pick = np.random.default_rng(seed).choice(size, min(n, size), replace=False)
    return {k: jnp.asarray(v[pick]) for k, v in pooled.items()}

  return sample


ZENO_VALIDATION = 64
"""Pooled train examples Zeno++'s server holds as its validation batch (at random, the run's seed)."""


def _notes(built, config) -> list[str]:
  notes = []
  for name, spec, _, _ in built:
    if spec.sampling == "nodes":
      notes.append(f"{name}: every client is a node of the {config['topology']} graph and trains every round "
                   f"(--clients-per-round does not apply)")
    elif spec.sampling == "all":
      notes.append(f"{name}: every client takes part in every round (--clients-per-round does not apply)")
    elif spec.sampling == "events":
      notes.append(f"{name}: {config['clients_per_round']} clients in flight, one server event per arrival; "
                   f"--rounds {config['rounds']} runs {config['rounds'] * config['clients_per_round']} events")
    elif spec.sampling != "clients":
      notes.append(f"{name}: every client, its whole train split, every round "
                   f"(--clients-per-round, --local-steps and --batch-size do not apply)")
  return notes


def compile_cache_dir(setting: str | None) -> str | None:
  """The folder of JAX's persistent compilation cache for `--compile-cache` (None: off)."""
  if setting == "off":
    return None
  if setting:
    return os.path.expanduser(setting)
  if os.environ.get("FEDJAX_OPT_COMPILE_CACHE"):
    return os.path.expanduser(os.environ["FEDJAX_OPT_COMPILE_CACHE"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "fedjax_opt", "xla")


def enable_compile_cache(setting: str | None) -> str | None:
  """Turns on JAX's persistent compilation cache in the folder `--compile-cache` names; returns it (None: off).

  A folder that cannot be made is one warning line, and the run goes on compiling as usual.
  """
  import jax

  path = compile_cache_dir(setting)
  if path is None:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    print(f"warning: no compilation cache ({path}: {e.strerror}); pass --compile-cache DIR or off", file=sys.stderr)
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def available_cores() -> int:
  """The CPU cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


def use_cpu_devices(devices: int | str) -> None:
  """`--devices N|auto`: the CPU as N devices (JAX's `jax_num_cpu_devices`, before its first computation).

  `auto` takes one device per available core, and does nothing when JAX has
  already started in this process (`main` called from a program that
  computed); an explicit N then is an error.
  """
  n = available_cores() if devices == "auto" else devices
  if n > 1:
    import jax

    try:
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # the backend already started (main called from a program that computed)
      if devices == "auto":
        return
      raise UsageError(f"--devices {n}: JAX has already started in this process; pass it on a fresh start "
                       f"({str(e).splitlines()[0]})") from None


def effective_client_map(config: dict[str, Any]) -> str:
  """--client-map, except that `auto` with an explicit --devices N > 1 shards the clients over the N devices.

  With --devices auto the client map stays `auto`, which shards over the
  devices only the models measured to gain from it (docs/scaling.md).
  """
  if config["devices"] not in ("auto", 1) and config["client_map"] == "auto":
    return "sharded"
  return config["client_map"]


def command_run(config: dict[str, Any], out: str, resume: bool, overwrite: bool) -> int:
  start_jax(config)
  return train_and_report(config, out, resume, overwrite)


def start_jax(config: dict[str, Any]) -> None:
  """`--compile-cache` and `--devices`: set before JAX's first computation."""
  enable_compile_cache(config.get("compile_cache"))
  use_cpu_devices(config["devices"])


def train_and_report(config: dict[str, Any], out: str, resume: bool, overwrite: bool) -> int:
  """`fedjax-opt run` once JAX has started (`start_jax`): trains, prints the table, writes the run folder."""
  import jax
  import numpy as np

  train_lib = _train_module()
  say: Callable[..., None] = (lambda *a: None) if config["quiet"] else print
  dataset, model, built, groups = _prepared(config, say)
  if overwrite and not resume:
    config_lib.clear_previous(out)
  created = not os.path.exists(out)
  try:
    os.makedirs(out, exist_ok=True)
    config_lib.write_json(os.path.join(out, "config.json"), config, indent=1)
  except OSError as e:  # checked before (config.check_writable); the folder may have changed since
    raise UsageError(f"--out {out}: cannot write there ({e.strerror})") from None
  say(dataset.summary())
  if groups is not None:
    kind = config["planted"].partition(":")[0]
    say(f"planted groups: {len(set(groups.tolist()))} groups of clients, "
        + ("each group's labels permuted" if kind == "labels" else "each group's images rotated by g·90°")
        + "; clusterings scored by their adjusted Rand index (ARI) against them")
  say(f"model {model.name}; {len(built)} algorithm(s), {config['rounds']} rounds"
      + (f"; {config['seeds']} seeds per algorithm (one vmapped program)" if config["seeds"] > 1 else ""))
  if privacy.enabled(config):
    plan = privacy.sampling(config, dataset.num_clients)
    say(f"differential privacy: noise multiplier {config['dp_noise_multiplier']:.4g}"
        + (f" (solved for ε = {config['dp_epsilon']:g})" if config["dp_epsilon"] is not None else "")
        + f", clip {config['dp_clip']:g}{' (adaptive)' if config['dp_quantile'] is not None else ''}, "
        f"{plan.describe()}, {config['dp_accountant'].upper()} accountant, δ = {config['dp_delta']:g}")
  if config["topology"] is not None:
    say(network.describe(config, dataset.num_clients))
  if config["asynchronous"]:
    say(f"simulated clock: compute time {config['delay']} per client update, {config['clients_per_round']} clients "
        f"in flight (asynchronous) or per round (synchronous, waiting for the slowest)")
  for note in _notes(built, config):
    print(note)  # even with --quiet: it says which flags an algorithm does not use
  num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model.init(jax.random.key(0))))
  rows, histories, extras = [], {}, {}
  solved: dict = {}  # F* per centralized objective, shared by the algorithms that minimise the same one
  try:
    for name, spec, hyper, algo in built:
      algo_run, init_state, data_seed = _initial_state(algo, model, config)
      scored = spec.scoring_model(model, hyper, dataset)  # FedEM: its mixtures; FedMD: each client's architecture
      metric_fns = {"loss": scored.loss_fn, "accuracy": scored.accuracy_fn}
      hooks = {}
      if spec.evaluation == "table":
        hooks["personalized_params"] = spec.personalized_params(hyper)
      elif spec.evaluation == "adapt":
        hooks["personalize"] = algo.personalize
      t0 = time.perf_counter()
      per_round = steps_per_round(spec, config)
      try:
        with _divergence_noticed(train_lib) as noticed:
          state, history = train_lib.train(
              algo_run, init_state, dataset, config["rounds"] * per_round,
              train_lib.Sampling(**sampling(spec, hyper, config, dataset)),
              evaluation=train_lib.Evaluation(every=config["eval_every"] * per_round, metric_fns=metric_fns,
                                             objective=objective_during_training(spec, hyper, scored), **hooks),
              checkpointing=train_lib.Checkpointing(os.path.join(out, "checkpoints", name),
                                                    every=config["checkpoint_every"], resume=resume),
              seed=data_seed, progress=not config["quiet"],
              label=name if per_round == 1 else f"{name} (server events)", accounting=_accounting(config, dataset))
      except KeyboardInterrupt:
        raise report.Interrupted(name) from None
      except tuple(_train_errors()) as e:
        raise UsageError(f"{name}: {str(e).splitlines()[0]}") from None
      histories[name] = history
      last = history.last_eval
      diverged = getattr(history, "diverged_at_round", None)
      row = dict(algorithm=name, family=spec.family, model=model.name, **outcome(history, per_round),
                 rounds=train_lib.current_round(state))
      if isinstance(hyper.get("loss"), str) and scored.name != model.name:  # CoCoA+: its own model's loss
        row["loss_of"] = f"{name}'s {hyper['loss']} loss ({scored.name})"
      if diverged is not None and noticed:  # the driver's warning, with the rounds it could have happened in
        warnings.warn(f"{name} {row['status']}: {row['diverged_reason']}; training stopped there",
                      train_lib.DivergenceWarning, stacklevel=1)
      for key in ("test_accuracy", "test_loss", "train_loss"):
        row.update(_summarize(last, key))
      if per_round > 1:
        row["server_events"] = row["rounds"]
        row["rounds"] = row["rounds"] // per_round  # in client updates of C synchronous clients
      for key in ("consensus_distance", "simulated_time"):
        if key in history.round_metrics:
          row.update(_summarize({key: _last(history.round_metrics[key])}, key))
      if spec.evaluation != "global":
        for key, short in (("personalized_test_accuracy", "personalized_accuracy"),
                           ("personalized_test_accuracy_p10", "personalized_accuracy_p10"),
                           ("personalized_test_accuracy_weighted", "personalized_accuracy_weighted")):
          row.update({k.replace(key, short): v for k, v in _summarize(last, key).items()})
        if diverged is None:
          row["personalized_accuracy_per_client"] = personalized_per_client(
              spec, algo, state, dataset, {"accuracy": scored.accuracy_fn}, config["seeds"],
              spec.personalized_params(hyper))
      row.update(cluster_recovery(state, groups, config["seeds"]))
      if spec.summary is not None:  # P2P Bayes: the beliefs on the fit
        row.update(spec.summary(history.round_metrics, hyper, config["seeds"]))
      if spec.objective is not None and diverged is None:
        row.update(objective_gap(spec, hyper, scored, state, dataset, config["seeds"], solved, row=row,
                                 say=lambda text, name=name: say(f"[{name}] {text}")))
      counted = spec.communication  # with a client stage or a secure sum, what the clients send is bits_up
      if trust.enabled(config) and counted == "rounds":
        counted = "metrics"
      bits = bits_per_round(spec, history.round_metrics, num_params, clients_taking_part(spec, config, dataset),
                            dataset.num_clients, communication=counted)
      if trust.enabled(config):
        row["bits_up"] = float(np.mean(_member0(history.round_metrics["bits_up"])))
        row.update(trust.secure_report(state, config["seeds"]))
      extras[name] = {"megabytes_sent": (bits.cumsum() / 8e6).tolist(), "steps_per_round": per_round}
      if "simulated_time" in history.round_metrics:
        times = np.asarray(history.round_metrics["simulated_time"], np.float64)
        extras[name]["simulated_time"] = (times if times.ndim == 1 else times[0]).tolist()
      row["megabytes_sent"] = float(bits.sum() / 8e6)
      row["hyper_parameters"] = hyper
      if privacy.enabled(config):
        row["privacy"] = privacy.report(config, privacy.sampling(config, dataset.num_clients),
                                        [e["round"] for e in history.evals], state, config["seeds"])
        row["dp_epsilon"] = row["privacy"]["epsilon"]
        extras[name]["dp_epsilon"] = row["privacy"]["epsilon_at_rounds"]
      rows.append(dict(row, wall_seconds=time.perf_counter() - t0, compile_seconds=history.compile_seconds,
                       rounds_per_second=history.rounds_per_second, devices=jax.device_count()))
  except report.Interrupted:
    raise
  except Exception:  # a failure before any round was saved: leave no half-made run behind (a rerun starts anew)
    if not resume:
      _remove_unstarted(out, created)
    raise
  config_lib.write_json(os.path.join(out, "history.json"),
                        {name: dict(h.to_dict(), **extras[name]) for name, h in histories.items()})
  config_lib.write_json(os.path.join(out, "results.json"), rows, indent=1, default=_json_default)
  plots = report.plot_all(histories, extras, rows, config, dataset, out)
  print()
  print(report.results_table(rows))
  print(f"\nwrote {out}/: config.json, history.json, results.json, {', '.join(os.path.basename(p) for p in plots)}")
  return 0


DEGRADED_LOSS_FACTOR = 10.0
"""A finished run is `degraded` when its final test loss exceeds this many times the initial model's."""

DEGRADED_ACCURACY_DROP = 0.1
"""... or when its final test accuracy is more than this below that of its first evaluation."""


def outcome(history, per_round: int = 1) -> dict[str, Any]:
  """The result row's `status` and, when it is not "finished", why: `diverged_reason` or `degraded_reason`.

  * "diverged between rounds a and b (seen at the evaluation of round b)" (or "diverged at round b" when a = b):
    `fo.train` stopped the run at the evaluation of round b, and the evaluation before it (round a − 1; 0, the
    start) had not: it went wrong in one of the rounds a … b. `diverged_between` holds [a, b].
  * "degraded": the run finished, but its final test loss is over `DEGRADED_LOSS_FACTOR` (10) times the initial
    model's (the evaluation before round 1; the first evaluation's when there is none), or its final test
    accuracy is more than `DEGRADED_ACCURACY_DROP` (0.1) below that of its first evaluation (round --eval-every).
    For `--seeds N`, the means over the seeds are compared.
  * "finished" otherwise.

  `per_round`: training steps per round (an asynchronous run's server events per round of C client updates),
  by which `fo.train`'s rounds are divided.
  """
  import numpy as np

  evals = history.evals
  diverged = history.diverged_at_round
  if diverged is not None:
    seen = diverged // per_round
    first = (evals[-2]["round"] // per_round if len(evals) >= 2 else 0) + 1
    first = min(first, seen)
    status = (f"diverged at round {seen}" if first == seen else
              f"diverged between rounds {first} and {seen} (seen at the evaluation of round {seen})")
    return {"status": status, "diverged_reason": history.diverged_reason, "diverged_between": [first, seen]}
  mean = lambda value: None if value is None else float(np.mean(np.asarray(value, np.float64)))  # noqa: E731
  losses = [mean(e.get("test_loss")) for e in evals]
  accuracies = [mean(e.get("test_accuracy")) for e in evals]
  start = mean(history.initial_loss) if history.initial_loss is not None else (losses[0] if losses else None)
  reasons = []
  if losses and start is not None and losses[-1] is not None and start > 0 and \
      losses[-1] > DEGRADED_LOSS_FACTOR * start:
    reasons.append(f"the test loss grew {losses[-1] / start:,.0f}× ({start:.4g} → {losses[-1]:.4g}), over "
                   f"{DEGRADED_LOSS_FACTOR:g}× the initial model's")
  if len(accuracies) >= 2 and None not in (accuracies[0], accuracies[-1]) and \
      accuracies[-1] < accuracies[0] - DEGRADED_ACCURACY_DROP:
    reasons.append(f"the test accuracy fell from {accuracies[0]:.4f} at round {evals[0]['round'] // per_round} to "
                   f"{accuracies[-1]:.4f}, over {DEGRADED_ACCURACY_DROP:g} below its first evaluation")
  if reasons:
    return {"status": "degraded", "degraded_reason": "; ".join(reasons)}
  return {"status": "finished"}


DRIVER_DIVERGED = r"[^:]* diverged at round \d+: "
"""The start of `fo.train`'s warning for a run that diverged in this call (the round it was seen at); a restored run
that had diverged warns "NAME: the restored run diverged ...", which is kept."""


@contextlib.contextmanager
def _divergence_noticed(train_lib):
  """Holds back `fo.train`'s warning of a run that diverged in this call (the run warns with `outcome`'s rounds
  instead); yields a list that is not empty once it was held back."""
  import re

  held: list = []
  show = warnings.showwarning

  def showwarning(message, category, *args, **kwargs):
    if issubclass(category, train_lib.DivergenceWarning) and re.match(DRIVER_DIVERGED, str(message)):
      held.append(message)
      return
    show(message, category, *args, **kwargs)

  with warnings.catch_warnings():
    warnings.showwarning = showwarning
    yield held


def _remove_unstarted(out: str, created: bool) -> None:
  """After a failure before any checkpoint was saved: removes what this run wrote into `out`, config.json and the
  empty checkpoint folders (and `out` itself when this run made it and nothing else is there), so that the same
  command can be given again; a folder with a saved checkpoint is kept for `--resume`, and other files (a tuning's
  tune.json) stay."""
  checkpoints = os.path.join(out, "checkpoints")
  if any(files_ for _, _, files_ in os.walk(checkpoints)):
    return
  if os.path.isdir(checkpoints):
    shutil.rmtree(checkpoints)
  if os.path.isfile(os.path.join(out, "config.json")):
    os.remove(os.path.join(out, "config.json"))
  if created and os.path.isdir(out) and not os.listdir(out):
    os.rmdir(out)


def _json_default(value: Any) -> Any:
  import numpy as np

  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"not JSON-serializable: {type(value).__name__}")


def _accounting(config: dict[str, Any], dataset) -> Any:
  """`fo.train`'s `accounting` of a DP run (None without DP): σ, δ, the accountant and the sampling ε is reported for."""
  if not privacy.enabled(config):
    return None
  return _train_module().Accounting(config["dp_noise_multiplier"], config["dp_delta"], config["dp_accountant"],
                                    sampling=privacy.sampling(config, dataset.num_clients))


def _train_errors() -> list[type]:
  """Errors of `fo.train` that are the user's input (too big a round, no test data, no valid checkpoint)."""
  train_lib = _train_module()
  return [getattr(train_lib, n) for n in ("RoundTooLargeError", "CheckpointError") if hasattr(train_lib, n)]


def _train_module():
  """The package `fedjax_opt.train` (the attribute of that name of `fedjax_opt` is the function)."""
  import importlib

  return importlib.import_module("fedjax_opt.train")
