"""The run's configuration: flags, the TOML file, `--set` overrides, checks, and the run folder.

A configuration is resolved once, as defaults ← TOML file ← flags, checked,
and saved as `config.json` in the run folder. `--resume` reads the saved one
back: the run continues with its own configuration (`RESUME_RULE`: `--rounds`
may grow, the flags of `MAY_CHANGE_ON_RESUME` may change); any other flag
that differs from the saved value is an error, and the folder is left
untouched.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import tomllib
from typing import Any

from fedjax_opt.cli import files, registry

__all__ = ["AUTO_MODEL", "DEFAULTS", "MAY_CHANGE_ON_RESUME", "MLP_MIN_PIXELS", "MODELS", "PARTITIONS", "RESUME_RULE",
           "SAMPLING_CLIENTS", "SHAKESPEARE_ROLES", "UsageError", "build_parser", "check_clients_per_round",
           "check_writable", "clear_previous", "finish", "flag_names", "for_resume", "given_settings",
           "hyper_parameters", "prepare_new", "step_sizes", "write_json"]

PARTITIONS = ("iid", "dirichlet", "shards", "labels", "power_law")
MODELS = ("auto", "logreg", "mlp", "cnn", "rnn")

MLP_MIN_PIXELS = 256
"""`--model auto` trains the MLP on images of at least this many pixels (28×28), logistic regression below (8×8)."""

AUTO_MODEL = (f"rnn for text; logreg for the ADMM family, feature vectors and images of fewer than "
              f"{MLP_MIN_PIXELS} pixels (digits, 8×8); mlp for larger images (mnist5k, fashion_mnist, 28×28) and "
              f"whenever fedma runs")
"""The rule of `--model auto` in words (`fedjax-opt list models`; `run.model_choice` applies it)."""

DEFAULTS: dict[str, Any] = dict(
    algorithms="fedavg,fedadam", dataset="mnist5k", partition=None, alpha=None, num_clients=None,
    clients_per_round=10, local_steps=10, batch_size=20, client_lr=None, server_lr=None, rounds=300,
    eval_every=25, seed=0, seeds=1, model="auto", client_map="auto", checkpoint_every=4, quiet=False, hyper={},
    aggregator=None, attack=None, attackers=None, compile_cache=None, devices="auto",
    dp_noise=None, dp_clip=None, dp_delta=None, dp_epsilon=None, dp_accountant=None, dp_sampling=None,
    dp_quantile=None, dp_clip_lr=None, dp_count_noise=None, dp_noise_multiplier=None,
    compression=None, secure_aggregation=None, downlink=None,
    topology=None, asynchronous=False, delay=None, planted=None,
)
"""The keys of `config.json` and their defaults (None: chosen from the dataset, see `finish`)."""

MAY_CHANGE_ON_RESUME = ("rounds", "checkpoint_every", "quiet", "compile_cache", "devices")
"""The settings `--resume` lets differ from the saved run (`--rounds` only upwards)."""

RESUME_RULE = ("--rounds may grow; " + ", ".join(f"--{k.replace('_', '-')}" for k in MAY_CHANGE_ON_RESUME[1:-1])
               + f" and --{MAY_CHANGE_ON_RESUME[-1]} may change; no other flag")
"""What `--resume` accepts, in words (the --help text, the errors and docs/cli.md say it)."""

OUTPUT_NAMES = ("config.json", "history.json", "results.json", "accuracy.png", "loss.png",
                "personalized_accuracy.png", "accuracy_time.png", "checkpoints", "tune.json", "tune.png")
"""What a run (and `fedjax-opt tune`: tune.json, tune.png) writes into its folder (and `--overwrite` removes)."""

SHAKESPEARE_ROLES = 100
"""Roles (clients) the command line samples from Shakespeare's ~1,070 unless --num-clients says otherwise."""

SYNTHETIC_VARIANTS = ("FedProx Synthetic(α, β) is chosen by name: synthetic_0_0, synthetic_0.5_0.5, synthetic_1_1 "
                      "(synthetic is α = β = 1 here; --alpha is the image splits' Dirichlet α); any α, β from "
                      "Python: fo.data.load(\"synthetic\", alpha=, beta=)")
"""How Synthetic(α, β) is chosen on the command line (`list datasets`, the refusal of --alpha)."""

REMOVED_FLAGS = {"--prox-mu": "--set fedprox.mu=VALUE", "--feddyn-alpha": "--set feddyn.alpha=VALUE"}


class UsageError(Exception):
  """Bad input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, no usage dump
    for flag, replacement in REMOVED_FLAGS.items():
      if flag in message:
        raise UsageError(f"{flag} was replaced by {replacement}")
    raise UsageError(message)


def _positive(name: str, convert, what: str):
  """An argparse type: `convert(text)`, a finite number > 0, or one line naming `--name`."""
  def parse(text):
    try:
      value = convert(text)
    except ValueError:
      value = None
    if value is None or not 0 < value < float("inf"):
      raise argparse.ArgumentTypeError(f"--{name} must be a positive {what}; got {text!r}")
    return value
  return parse


SEED_LIMIT = 2**31
"""Seeds are integers in [0, SEED_LIMIT): every consumer (NumPy, `jax.random.key`, the samplers) takes them."""


def _seed(text: str) -> int:
  """An argparse type for --seed: an integer in [0, SEED_LIMIT), or one line naming --seed."""
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or not 0 <= value < SEED_LIMIT:
    raise argparse.ArgumentTypeError(f"--seed must be an integer from 0 to {SEED_LIMIT - 1}; got {text!r}")
  return value


def _devices(text: str) -> int | str:
  """An argparse type for --devices: "auto" or a positive integer."""
  if text == "auto":
    return text
  return _positive("devices", int, "integer or auto")(text)


def _setting(text: str) -> tuple[str, str, Any]:
  """`ALGO.KEY=VALUE` → (algo, key, value); VALUE read as a TOML value (1e-3, true, "x"), else as a string."""
  head, sep, raw = text.partition("=")
  algo, dot, key = head.strip().partition(".")
  if not sep or not dot or not algo or not key:
    raise argparse.ArgumentTypeError(f"--set takes ALGORITHM.NAME=VALUE, e.g. ditto.lam=0.1; got {text!r}")
  try:
    value = tomllib.loads(f"v = {raw.strip()}")["v"]
  except tomllib.TOMLDecodeError:
    value = raw.strip()
  return algo, key.strip(), value


TUNE_SCHEDULES = ("online", "offline")
TUNE_DEFAULTS = {"outer_steps": 10, "schedule": "online", "outer_lr": 0.1, "average": 1}
"""`fedjax-opt tune`'s own settings (flags only, not TOML keys) and their defaults."""

TUNE_DESCRIPTION = (
    "Tunes the continuous hyper-parameters that --tune names, of the one algorithm of --algorithms, by gradient "
    "descent on the validation loss (the mean loss on every client's test split; each client's own model for "
    "algorithms that keep one) differentiated through --rounds rounds of training (fo.hyper), Adam on their "
    "logarithms, --outer-steps times; writes tune.json and tune.png into --out, then trains a run with the tuned "
    "values exactly as `fedjax-opt run --set ALGO.NAME=VALUE ...` would, into the same folder. The tune flags are "
    "not TOML keys; --config gives the others.")

TUNE_SKIPS = ("--resume", "--dp-noise", "--dp-clip", "--dp-delta", "--dp-epsilon", "--dp-accountant", "--dp-sampling",
              "--dp-quantile", "--dp-clip-lr", "--dp-count-noise")
"""Flags of `run` that `tune` does not take: a tuned run is resumed with `fedjax-opt run --out DIR --resume`, and
tuning reads every client's test split outside any privacy accountant (train with DP afterwards, `run --set`)."""

TUNE_HELP = {
    "--algorithms": "the one algorithm to tune, a name from `fedjax-opt list algorithms`",
    "--rounds": "R, the rounds each outer step differentiates through: the whole run from the start (offline) or "
                "one window of the one run (online) (default 300)",
    "--seeds": "runs of the final run with the tuned values, seeds seed … seed+N-1 (tuning uses --seed; default 1)",
    "--out": "the folder of tune.json, tune.png and the tuned run (default runs/<dataset>-<time>)",
    "--overwrite": "replace the run (or tuning) already in --out",
}
"""`run`'s flags whose help says something else under `tune`."""


def _adder(parser: argparse.ArgumentParser, skip: tuple[str, ...], helps: dict[str, str]):
  """`parser.add_argument`, leaving out the flags in `skip` and with the help of `helps` where it has one."""
  def add(flag, *args, **kwargs):
    if flag in skip:
      return
    if flag in helps:
      kwargs["help"] = helps[flag]
    parser.add_argument(flag, *args, **kwargs)
  return add


def _add_tune_flags(add) -> None:
  """The flags of `fedjax-opt tune` that `run` does not have."""
  add("--tune", metavar="NAME,...", required=True,
      help="the algorithm's continuous hyper-parameters to tune, named as `fedjax-opt list algorithms` shows them "
           "(e.g. server_lr,client_lr); each starts from its default or its --set value")
  add("--outer-steps", metavar="T", type=_positive("outer-steps", int, "integer"),
      default=TUNE_DEFAULTS["outer_steps"], help=f"T, hyper-gradient steps (default {TUNE_DEFAULTS['outer_steps']})")
  add("--schedule", metavar="online|offline", choices=TUNE_SCHEDULES, default=TUNE_DEFAULTS["schedule"],
      help="online (the default, the cheaper): one run of T windows of R rounds, the hyper-parameters updated after "
           "each window by the hyper-gradient of the loss at its end, from the state the run has reached: tuning "
           "along a run of T × R rounds costs about that one run, forward and backward, and the backward pass holds R "
           "rounds (greedy: a window's gradient ignores how the earlier values shaped the state it starts from); "
           "offline: each outer step reruns R rounds from the start and differentiates all of them, the exact "
           "gradient of the loss after R rounds, T runs in all")
  add("--average", metavar="N", type=_positive("average", int, "integer"), default=TUNE_DEFAULTS["average"],
      help="the tuned values are the geometric mean of the last N of the T + 1 values (the start and one after each "
           "outer step; the mean of the last N logits for one in (0, 1)): tail averaging, since with Adam's constant "
           "step the values keep moving (default 1: the last value)")
  add("--train-rounds", metavar="N", type=_positive("train-rounds", int, "integer"),
      help="rounds of the run trained with the tuned values (default: the horizon they were tuned for, R offline, "
           "T × R online)")
  add("--outer-lr", metavar="X", type=_positive("outer-lr", float, "number"), default=TUNE_DEFAULTS["outer_lr"],
      help="Adam's step size on the log of each hyper-parameter (the logit for one in (0, 1)): 0.1 moves a "
           f"step size by about 10 %% per outer step (default {TUNE_DEFAULTS['outer_lr']})")


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="fedjax-opt", description="Federated optimization experiments in JAX.")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  run = sub.add_parser("run", help="train and compare algorithms on an embedded dataset")
  _add_run_flags(run.add_argument)
  tune = sub.add_parser("tune", help="tune one algorithm's continuous hyper-parameters by hyper-gradients, then "
                                     "train a run with them", description=TUNE_DESCRIPTION)
  _add_tune_flags(tune.add_argument)
  _add_run_flags(_adder(tune, skip=TUNE_SKIPS, helps=TUNE_HELP))
  listing = sub.add_parser("list", help="list algorithms (with their hyper-parameters), datasets, partitions, models")
  listing.add_argument("what", nargs="?", choices=("algorithms", "aggregators", "attacks", "datasets", "partitions",
                                                   "models", "server-optimizers"), help="one section only")
  return parser


def _add_run_flags(add) -> None:
  """The flags of `fedjax-opt run` (`fedjax-opt tune` takes them too, but for `TUNE_SKIPS`)."""
  add("--config", metavar="FILE", help="TOML file whose keys mirror these flags, [algorithm] sections for hyper-parameters")
  add("--algorithms", metavar="A,B,...", help="comma-separated names from `fedjax-opt list algorithms` (default fedavg,fedadam)")
  add("--set", action="append", type=_setting, metavar="ALGO.NAME=VALUE",
      help="an algorithm's hyper-parameter, e.g. ditto.lam=0.1 (repeatable; defaults in `fedjax-opt list algorithms`)")
  add("--dataset", metavar="NAME", help="an embedded dataset (`fedjax-opt list datasets`; default mnist5k), or "
                                        "libsvm:PATH, a LibSVM / svmlight file split by --partition and --num-clients")
  add("--partition", metavar="NAME", help=f"image datasets: one of {', '.join(PARTITIONS)} (default dirichlet)")
  add("--planted", metavar="KIND:G",
      help="split the clients into G planted groups that one model cannot serve: labels:G permutes each group's "
           "labels, rotate:G rotates its images by g·90° (G ≤ 4); clustering algorithms report their adjusted Rand "
           "index against the groups")
  add("--alpha", metavar="X", type=_positive("alpha", float, "number"), help="--partition dirichlet: concentration α (default 0.5)")
  add("--num-clients", metavar="N", type=_positive("num-clients", int, "integer"),
      help="clients: an image dataset is split into N, a synthetic one generates N devices, Shakespeare keeps N "
           "random roles (default: the dataset's, see `fedjax-opt list datasets`; Shakespeare 100)")
  add("--clients-per-round", metavar="N", type=_positive("clients-per-round", int, "integer"), help="default 10")
  add("--local-steps", metavar="N", type=_positive("local-steps", int, "integer"), help="local steps per round (default 10)")
  add("--batch-size", metavar="N", type=_positive("batch-size", int, "integer"), help="examples per local step (default 20)")
  add("--client-lr", metavar="X", type=_positive("client-lr", float, "number"), help="every chosen algorithm's client step size (default: each algorithm's own; "
           "0.05 for most, see `fedjax-opt list algorithms`)")
  add("--server-lr", metavar="X", type=_positive("server-lr", float, "number"),
      help="the server step size of every chosen algorithm (default: each algorithm's own; an error for one "
           "without a server step size)")
  add("--aggregator", metavar="NAME",
      help="every chosen algorithm's aggregator: weighted_mean, mean, marginal_median, mean_around_median, "
           "geometric_median, trimmed_mean, krum, multi_krum, bulyan, centered_clipping (--set aggregator.NAME=VALUE "
           "for its parameters)")
  add("--attack", metavar="NAME",
      help="simulated attackers: gaussian, omniscient, sign_flip, ipm, alie, generalized_byzantine (on the updates, "
           "before aggregation) or label_flip (on their data) (--set attack.NAME=VALUE for its parameters)")
  add("--attackers", metavar="F", type=_positive("attackers", float, "number"),
      help="--attack: the fraction of attacking clients, in (0, 1] (default 0.2)")
  add("--dp-noise", metavar="SIGMA", type=float,
      help="differential privacy (DP-FedAvg, docs/privacy.md): noise multiplier σ; each client's update is clipped "
           "to --dp-clip, the sum gets N(0, (σC)²) noise, and ε is reported")
  add("--dp-clip", metavar="C", type=float, help="DP: the L2 bound C of a client's update (the initial one with "
                                                 "--dp-quantile)")
  add("--dp-delta", metavar="DELTA", type=float, help="DP: the δ that ε is reported for (default 1e-5)")
  add("--dp-epsilon", metavar="EPS", type=float,
      help="DP: a target ε after --rounds; the noise multiplier is solved for it (instead of --dp-noise)")
  add("--dp-accountant", metavar="rdp|pld", help="DP: dp-accounting's RDP or PLD accountant (default rdp for "
                                                 "--dp-sampling fixed, pld for poisson)")
  add("--dp-sampling", metavar="fixed|poisson",
      help="DP: fixed (default): --clients-per-round clients without replacement; poisson: each client with "
           "probability clients-per-round / clients")
  add("--dp-quantile", metavar="GAMMA", type=float,
      help="DP: adaptive clipping, the clip norm tracks this quantile of the update norms (Andrew et al. 2021)")
  add("--dp-clip-lr", metavar="X", type=float, help="DP, adaptive clipping: the clip norm's step size η_C "
                                                   "(default 0.2)")
  add("--dp-count-noise", metavar="X", type=float,
      help="DP, adaptive clipping: noise σ_b on the count of unclipped clients (default max(m/20, 2σ))")
  add("--compression", metavar="SPEC",
      help="compress what each client uploads (docs/privacy.md): qsgd:BITS, top_k:FRACTION[:ef], rand_k:FRACTION or "
           "sign[:ef]; :ef keeps a residual per client (error feedback); the table's bits up is the compressor's "
           "count")
  add("--downlink", metavar="SPEC",
      help="compress what the server broadcasts back (its step; docs/privacy.md), with the same SPEC as "
           "--compression; :ef keeps the server's error (error feedback); MB sent counts each broadcast by the "
           "compressor's count")
  add("--secure-aggregation", metavar="bound=B,frac_bits=F,dropout=Q", nargs="?", const="",
      help="the server learns only the sum of the uploads (simulated secure aggregation, Bonawitz et al. 2017), "
           "around the mean, the weighted mean or the DP mean; each option may be left out (bound: see docs/cli.md; "
           "frac_bits 16; dropout 0)")
  add("--topology", "--graph", dest="topology", metavar="NAME",  # --graph: the factories' graph= (docs/cli.md)
      help="decentralized algorithms (gossip, dpsgd, gradient_tracking, d_fedem, p2p_bayes): the graph of the "
           "clients, one of ring (default), torus, exponential, complete, erdos_renyi, matchings (a random matching "
           "per round)")
  add("--async", dest="asynchronous", action="store_true", default=None,
      help="simulate a wall clock: asynchronous algorithms (fedbuff, fedasync, co_op, zeno_plus_plus) with "
           "--clients-per-round clients in flight, synchronous rounds waiting for their slowest client; "
           "default algorithms fedavg,fedbuff,fedasync")
  add("--delay", metavar="DIST",
      help="--async: a client's compute time, exp:MEAN (default exp:1), const:VALUE or lognormal:MU,SIGMA")
  add("--rounds", metavar="N", type=_positive("rounds", int, "integer"), help="rounds to train, in all (default 300)")
  add("--eval-every", metavar="N", type=_positive("eval-every", int, "integer"), help="rounds between evaluations (default 25)")
  add("--seed", metavar="N", type=_seed, help="seeds the split, the models and the sampling (default 0)")
  add("--seeds", metavar="N", type=_positive("seeds", int, "integer"),
      help="runs per algorithm, seeds seed … seed+N-1, vmapped into one program (default 1)")
  add("--client-map", metavar="MODE", help="how clients run: auto (default), vmap, sequential, chunked[:K], sharded[:<inner>]")
  add("--devices", metavar="N|auto", type=_devices,
      help="split the CPU into N devices and shard the clients over them; auto (default): one device per core, "
           "clients sharded where that was measured to help (dense models above 16,384 parameters); accelerators: "
           "all are used")
  add("--model", metavar="NAME", help=f"one of {', '.join(MODELS)} (default auto: by dataset)")
  add("--out", metavar="DIR", help="the run folder (default runs/<dataset>-<time>)")
  add("--resume", action="store_true", default=None,
      help=f"continue the run saved in --out with its saved configuration ({RESUME_RULE})")
  add("--overwrite", action="store_true", default=None, help="replace the run already in --out")
  add("--checkpoint-every", metavar="N", type=_positive("checkpoint-every", int, "integer"),
      help="evaluations between checkpoints (default 4)")
  add("--quiet", action="store_true", default=None, help="no progress lines")
  add("--compile-cache", metavar="DIR|off",
      help="where compiled programs are kept between runs, so a second run starts faster (default "
           "$FEDJAX_OPT_COMPILE_CACHE or ~/.cache/fedjax_opt/xla; off: compile every time)")


def _read_toml(path: str) -> dict[str, Any]:
  try:
    with open(path, "rb") as f:
      raw = tomllib.load(f)
  except OSError as e:
    raise UsageError(f"cannot read config {path!r}: {e.strerror}") from None
  except tomllib.TOMLDecodeError as e:
    raise UsageError(f"config {path!r} is not valid TOML: {e}") from None
  config, hyper = {}, {}
  for key, value in raw.items():
    if isinstance(value, dict):
      if key in ("aggregator", "attack"):
        hyper[key] = dict(value)
        continue
      if key not in registry.REGISTRY:
        raise UsageError(f"config {path!r}: section [{key}] is not an algorithm; "
                         f"choose from {', '.join(registry.REGISTRY)}")
      hyper[key] = dict(value)
      continue
    name = {"async": "asynchronous"}.get(key, key.replace("-", "_"))
    if name not in DEFAULTS or name in ("hyper", "dp_noise_multiplier"):
      raise UsageError(f"unknown key(s) [{key!r}] in config {path!r}; valid keys: {sorted(set(DEFAULTS) - {'hyper', 'dp_noise_multiplier', 'asynchronous'} | {'async'})}"
                       f" and [algorithm] sections")
    config[name] = ",".join(value) if name == "algorithms" and isinstance(value, list) else value
  if hyper:
    config["hyper"] = hyper
  return config


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
  """What the user asked for: the TOML file's keys, then the flags given (not the defaults)."""
  given = _read_toml(args.config) if args.config else {}
  for key, value in vars(args).items():
    if key in DEFAULTS and value is not None:
      given[key] = value
  if args.set:
    hyper = {k: dict(v) for k, v in given.get("hyper", {}).items()}
    for algo, key, value in args.set:
      hyper.setdefault(algo, {})[key] = value
    given["hyper"] = hyper
  return given


def _algorithms(value: Any) -> list[str]:
  names = [a.strip() for a in str(value).split(",") if a.strip()]
  if not names:
    raise UsageError(f"--algorithms is empty; choose from {', '.join(registry.REGISTRY)}")
  for name in names:
    if name not in registry.REGISTRY:
      raise UsageError(f"unknown algorithm {name!r}; choose from {', '.join(registry.REGISTRY)}")
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise UsageError(f"{twice[0]} is listed twice in --algorithms; to compare settings of one algorithm, "
                     f"run them into two --out folders")
  return names


def _flag(key: str) -> str:
  """The flag of a configuration key (`clients_per_round` → `--clients-per-round`), which a TOML key mirrors."""
  return "--async" if key == "asynchronous" else "--" + key.replace("_", "-")


def flag_names(message: str) -> str:
  """A library message with the arguments that are flags named as the flags (`num_clients=500` → `--num-clients
  500`, `alpha` → `--alpha`), so that it names what the user typed."""
  import re

  for argument in ("num_clients", "clients_per_round", "alpha"):
    flag = "--" + argument.replace("_", "-")
    message = re.sub(rf"(?<![\w-]){argument}=(\S+)", rf"{flag} \1", message)
    message = re.sub(rf"(?<![\w-]){argument}\b", flag, message)
  return message


def _check_number(config: dict, key: str, integer: bool) -> None:
  value = config[key]
  if integer:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise UsageError(f"{_flag(key)} must be a positive integer; got {value!r}")
  elif not _positive_number(value):
    raise UsageError(f"{_flag(key)} must be a positive number; got {value!r}")


def _positive_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value and math.isfinite(value)


SAMPLING_CLIENTS = ("clients", "events")
"""`Spec.sampling` of the algorithms that draw --clients-per-round of the --num-clients clients (or keep that many
in flight, asynchronous); the others take every client and ignore --clients-per-round."""


def check_clients_per_round(config: dict[str, Any], names: list[str], num_clients: int, *,
                            given_num_clients: bool = True, given_clients_per_round: bool = True) -> None:
  """--clients-per-round is at most the N clients, for the algorithms that use it (one line naming both flags;
  `given_*`: the flag was given, else its value is the default)."""
  users = [n for n in names if registry.REGISTRY[n].sampling in SAMPLING_CLIENTS]
  cpr = config["clients_per_round"]
  if not users or cpr <= num_clients:
    return
  clients = f"--num-clients {num_clients}" if given_num_clients else \
      f"the {num_clients} clients of {config['dataset']!r} (--num-clients)"
  raise UsageError(f"--clients-per-round {cpr}{'' if given_clients_per_round else ' (the default)'} exceeds "
                   f"{clients}: {', '.join(users)} draw(s) that many clients a "
                   f"round; lower --clients-per-round to at most {num_clients}"
                   + (" or raise --num-clients" if config["num_clients"] is not None else ""))


def finish(given: dict[str, Any]) -> dict[str, Any]:
  """Defaults ← `given`, checked, with the dataset-dependent defaults chosen; what `config.json` holds."""
  from fedjax_opt.cli import network

  config = dict(DEFAULTS, hyper={})
  config.update(given)
  config["algorithms"] = network.default_algorithms(given) or config["algorithms"]
  names = _algorithms(config["algorithms"])
  config["algorithms"] = ",".join(names)
  from fedjax_opt import data  # after the checks that need no JAX, so they answer at once

  infos = {info.name: info for info in data.available()}
  infos.update(files.dataset_info(config["dataset"]))  # --dataset libsvm:PATH, once the file is found
  if config["dataset"] not in infos:
    raise UsageError(f"unknown dataset {config['dataset']!r}; choose from {', '.join(infos)}, or libsvm:PATH for a "
                     f"LibSVM file")
  info = infos[config["dataset"]]
  if not info.installed:
    raise UsageError(f"dataset {config['dataset']!r} is not installed here: {info.requires}")
  natural = info.name.startswith("synthetic") or info.name == "shakespeare"
  for key in ("partition", "alpha"):
    if natural and config[key] is not None:
      raise UsageError(f"--{key} does not apply to {info.name!r}, whose clients are natural ({info.clients})"
                       + (f"; {SYNTHETIC_VARIANTS}" if key == "alpha" and info.name.startswith("synthetic") else ""))
  if info.name == "shakespeare" and config["num_clients"] is None:
    config["num_clients"] = SHAKESPEARE_ROLES
  if config["planted"] is not None:
    config["planted"] = _planted(config["planted"])
  if not natural:
    config["partition"] = config["partition"] or "dirichlet"
    if config["partition"] not in PARTITIONS:
      raise UsageError(f"unknown partition {config['partition']!r}; choose from {', '.join(PARTITIONS)}")
    if config["alpha"] is not None and config["partition"] != "dirichlet":
      raise UsageError(f"--alpha applies to --partition dirichlet only; got --partition {config['partition']}")
    if config["partition"] == "dirichlet" and config["alpha"] is None:
      config["alpha"] = 0.5
    if config["num_clients"] is None:
      config["num_clients"] = getattr(info, "default_num_clients", None) or 100
  from fedjax_opt.core import client_map

  try:
    client_map.resolve(config["client_map"])
  except ValueError as e:
    raise UsageError(f"bad --client-map {config['client_map']!r}: {e}") from None
  check_devices(config)
  if config["model"] not in MODELS:
    raise UsageError(f"unknown model {config['model']!r}; choose from {', '.join(MODELS)}")
  for key in [k for k in ("client_lr", "alpha", "server_lr") if config[k] is not None]:
    _check_number(config, key, integer=False)
  for key in ("clients_per_round", "local_steps", "batch_size", "rounds", "eval_every", "checkpoint_every", "seeds") + (
      ("num_clients",) if config["num_clients"] is not None else ()):
    _check_number(config, key, integer=True)
  seed = config["seed"]
  if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_LIMIT - config["seeds"]:
    raise UsageError(f"--seed must be an integer from 0 to {SEED_LIMIT - config['seeds']}"
                     + (f" (with --seeds {config['seeds']}, seeds seed … seed+{config['seeds'] - 1})"
                        if config["seeds"] > 1 else "") + f"; got {seed!r}")
  if config["num_clients"] is not None:
    check_clients_per_round(config, names, config["num_clients"], given_num_clients="num_clients" in given,
                            given_clients_per_round="clients_per_round" in given)
  _check_hyper(config, names)
  from fedjax_opt.cli import robust

  try:
    robust.check(config, names, registry)
    robust.check_rows(config, names, registry, config["num_clients"])
  except robust.RobustError as e:
    raise UsageError(str(e)) from None
  from fedjax_opt.cli import privacy

  try:
    privacy.check(config, names)
  except privacy.PrivacyError as e:
    raise UsageError(str(e)) from None
  from fedjax_opt.cli import trust

  try:
    trust.check(config, names, registry)
  except trust.TrustError as e:
    raise UsageError(str(e)) from None
  try:
    network.check(config, names, registry)
  except network.NetworkError as e:
    raise UsageError(str(e)) from None
  _check_host_driven(config, names)
  return config


def _check_host_driven(config: dict[str, Any], names: list[str]) -> None:
  """The matched family runs round by round on the host: no sweep over seeds, no wrapper around its rounds."""
  matched = [n for n in names if registry.REGISTRY[n].family == "matched"]
  if not matched:
    return
  what = f"{matched[0]} runs round by round on the host (its layers grow)"
  if config["seeds"] > 1:
    raise UsageError(f"{what}: --seeds {config['seeds']} needs one vmapped program; run one seed at a time "
                     f"(--seed N)")
  if config["asynchronous"]:
    raise UsageError(f"{what}: --async does not apply; run it without --async")
  if config["attack"] is not None:
    raise UsageError(f"{what}: --attack {config['attack']} does not apply to it")


def _planted(value: Any) -> str:
  """`KIND:G` checked (`labels:3`, `rotate:4`)."""
  from fedjax_opt.data import PLANTED_KINDS

  kind, _, count = str(value).partition(":")
  if kind not in PLANTED_KINDS or not count.isdigit() or int(count) < 1:
    raise UsageError(f"--planted must be KIND:G with KIND one of {', '.join(PLANTED_KINDS)} and G ≥ 1 groups "
                     f"(e.g. labels:3); got {value!r}")
  return f"{kind}:{int(count)}"


def check_devices(config: dict[str, Any]) -> None:
  """An explicit --devices N > 1 shards the clients: the client map must be `auto` or `sharded[:<inner>]`."""
  devices, mode = config["devices"], config["client_map"]
  if devices == "auto":
    return
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise UsageError(f"--devices must be a positive integer or auto; got {devices!r}")
  if devices > 1 and mode != "auto" and not mode.startswith("sharded"):
    raise UsageError(f"--devices {devices} shards the clients over {devices} devices, but --client-map {mode} runs "
                     f"them on one; use --client-map auto or sharded:{mode}")


def _check_hyper(config: dict[str, Any], names: list[str]) -> None:
  hyper = config["hyper"]
  if not isinstance(hyper, dict):
    raise UsageError(f"hyper must be a table of [algorithm] sections; got {hyper!r}")
  for algo in hyper:
    if algo in ("aggregator", "attack"):
      continue
    if algo not in registry.REGISTRY:
      raise UsageError(f"--set {algo}.…: unknown algorithm {algo!r}; choose from {', '.join(registry.REGISTRY)}")
    if algo not in names:
      raise UsageError(f"--set {algo}.… is given but {algo} is not in --algorithms ({','.join(names)})")
  if config["server_lr"] is not None:
    without = [n for n in names if registry.REGISTRY[n].server_lr is None]
    if without:
      raise UsageError(f"--server-lr does not apply to {', '.join(without)}: no server step size "
                       f"(set the others one by one with --set ALGO.server_lr=VALUE)")
  for name in names:
    try:
      resolved = registry.resolve(name, hyper.get(name, {}), config["client_lr"])
    except registry.HyperParameterError as e:
      raise UsageError(str(e)) from None
    for key, flag in step_sizes(name).items():
      if key in hyper.get(name, {}) and not _positive_number(resolved[key]):
        raise UsageError(f"{name}.{key} must be a positive number (a step size"
                         + (f", as {flag} must" if flag else "") + f"); got {resolved[key]!r}")


def step_sizes(name: str) -> dict[str, str | None]:
  """The step sizes of algorithm `name` a user may set (`--set NAME.KEY=X`, a TOML section), each with the flag
  that sets it for every algorithm (None: none does): `client_lr` and the defaults marked `--client-lr`
  (--client-lr), the server step size (--server-lr), and the other `PSEUDO` step sizes (`finetune_lr`, ...).
  Each is checked as its flag is: a finite number > 0."""
  spec = registry.REGISTRY[name]
  settable = spec.settable()
  out: dict[str, str | None] = {k: None for k in registry.PSEUDO if k.endswith("_lr") and k in settable}
  out.update({k: "--client-lr" for k, v in spec.defaults.items() if v is registry.CLIENT_LR})
  if "client_lr" in settable:
    out["client_lr"] = "--client-lr"
  if spec.server_lr is not None:
    out[spec.server_lr] = "--server-lr"
  return out


def hyper_parameters(config: dict[str, Any], name: str) -> dict[str, Any]:
  """The resolved hyper-parameters of algorithm `name` in this run (`--server-lr` included)."""
  overrides = dict(config["hyper"].get(name, {}))
  spec = registry.REGISTRY[name]
  if config["server_lr"] is not None and spec.server_lr not in overrides:
    overrides[spec.server_lr] = config["server_lr"]
  return registry.resolve(name, overrides, config["client_lr"])


# ---- the run folder --------------------------------------------------------------------------------------------


def _holds_run(out: str) -> bool:
  return any(os.path.isfile(os.path.join(out, name)) for name in ("config.json", "tune.json")) or \
      os.path.isdir(os.path.join(out, "checkpoints"))


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
    return float(a) == float(b)
  return a == b


def for_resume(out: str | None, given: dict[str, Any]) -> dict[str, Any]:
  """The saved configuration of the run in `out`, with `given` checked against it (only rounds may grow)."""
  if not out:
    raise UsageError("--resume needs --out DIR, the folder of the run to continue")
  if os.path.exists(out) and not os.path.isdir(out):
    raise UsageError(f"--out {out} is a file, not a run folder")
  path = os.path.join(out, "config.json")
  if not os.path.isfile(path):
    raise UsageError(f"--out {out} holds no run to resume (no config.json); start one without --resume")
  check_writable(out)
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise UsageError(f"cannot read {path}: {e}") from None
  unknown = sorted(set(saved) - set(DEFAULTS))
  if unknown:
    raise UsageError(f"{path} is not a fedjax-opt run configuration (unknown keys {unknown})")
  saved = dict(DEFAULTS, **saved)
  given = dict(given)
  if "algorithms" in given:
    given["algorithms"] = ",".join(_algorithms(given["algorithms"]))
  for key, value in given.items():
    if key in MAY_CHANGE_ON_RESUME:
      continue
    if key == "hyper":
      for algo, overrides in value.items():
        for k, v in overrides.items():
          if not _same(saved["hyper"].get(algo, {}).get(k), v):
            raise UsageError(f"--set {algo}.{k}={v} conflicts with the run saved in {out} "
                             f"({algo}.{k}={saved['hyper'].get(algo, {}).get(k, 'default')}); --resume continues "
                             f"the saved configuration ({RESUME_RULE})")
      continue
    if not _same(saved[key], value):
      raise UsageError(f"{_flag(key)} {value} conflicts with the run saved in {out} ({key} = {saved[key]}); --resume "
                       f"continues the saved configuration ({RESUME_RULE})")
  if "rounds" in given and given["rounds"] < saved["rounds"]:
    raise UsageError(f"--rounds {given['rounds']} is fewer than the {saved['rounds']} rounds of the run saved in {out}; "
                     f"--resume can only extend a run")
  config = dict(saved)
  config.update({k: given[k] for k in MAY_CHANGE_ON_RESUME if k in given})
  check_devices(config)
  return config


def check_writable(out: str) -> None:
  """`--out` is a folder this process can make or write in, or one line (nothing is left behind).

  The nearest folder of `out` that exists must be a folder (not a file) in
  which a new entry can be made: a probe folder is made there and removed at
  once, which also catches what permission bits do not say (read-only
  mounts, a root user, /proc).
  """
  if out == "":
    raise UsageError("--out is empty: give the run folder, or leave --out out for runs/<dataset>-<time>")
  path = os.path.abspath(out)
  existing = path
  while not os.path.isdir(existing):
    if os.path.exists(existing):
      raise UsageError(f"--out {out} is a file, not a folder" if existing == path else
                       f"--out {out}: {existing} is a file, not a folder")
    existing = os.path.dirname(existing)
  try:
    probe = tempfile.mkdtemp(prefix=".fedjax-opt-probe-", dir=existing)
  except OSError as e:
    raise UsageError(f"--out {out}: cannot write in {existing} ({e.strerror})") from None
  os.rmdir(probe)


def prepare_new(out: str, overwrite: bool, *, resumable: bool = True) -> None:
  """Checks that a new run may go into `out` (nothing is written yet); `resumable`: the command has --resume."""
  check_writable(out)
  if _holds_run(out) and not overwrite:
    resume = "continue it with --resume, " if resumable else f"continue it with fedjax-opt run --out {out} --resume, "
    raise UsageError(f"--out {out} already holds a run; {resume}replace it with --overwrite, or choose another "
                     f"folder")


def clear_previous(out: str) -> None:
  """Removes a previous run's files from `out` (`--overwrite`); other files are left alone."""
  for name in OUTPUT_NAMES:
    path = os.path.join(out, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif os.path.exists(path):
      os.remove(path)


def write_json(path: str, value: Any, **kwargs) -> None:
  """Writes JSON atomically: a reader (or a crash) never sees half a file."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, **kwargs)
  os.replace(tmp, path)
