"""`fedjax-opt tune`: one algorithm's continuous hyper-parameters tuned by hyper-gradients, then a run with them.

    fedjax-opt tune --algorithms fedadam --tune server_lr,client_lr --rounds 100 --outer-steps 20

The algorithm is built exactly as `fedjax-opt run` builds it (`run.prepared_context`, `run.build_algorithm`), with
the hyper-parameters that `--tune` names as traced values, and `fo.hyper.tune` runs Adam (`--outer-lr`) on their
logarithms (the logit for those in (0, 1), `UNIT_INTERVAL`) for `--outer-steps` steps. The objective is
`fo.hyper.validation_loss` on every client's test split (each client's own model, `personalized=True`, for the
algorithms that `fedjax-opt run` scores by `fo.personalized_params`), the loss the run reports as test loss. The
tuning starts where a run starts and draws the rounds a run draws: the initial model `model.init(key(seed))`, the
algorithm's init key `key(seed + 1)`, round r's clients and batches from `fold_in(key(seed), r)`. So offline, the
validation loss at h is the test loss that `fedjax-opt run --rounds R` with h reports (to float rounding).

Before anything is trained the gradient is traced once (`jax.eval_shape`): an algorithm whose step `fo.hyper`
refuses (IFCA, CFL, CQ-GGADMM, Zeno++, Per-FedAvg, L2GD's p; FedMA, host-driven) is one line, at once. The
tuning writes `tune.json` and `tune.png`; then the run with the tuned values is `fedjax-opt run` itself
(`run.train_and_report`) with `--set ALGO.NAME=VALUE` for each tuned value, so its `config.json` holds them and
`fedjax-opt run --out DIR --resume` continues it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, NamedTuple

from fedjax_opt.cli import config as config_lib
from fedjax_opt.cli import privacy, registry
from fedjax_opt.cli.config import UsageError

__all__ = ["HOST_SIDE", "Options", "UNIT_INTERVAL", "command_tune", "options", "tunable"]

UNIT_INTERVAL = {("fednova", "rho"), ("easgd", "alpha"), ("fedasync", "alpha"), ("co_op", "alpha"), ("l2gd", "p"),
                 ("l2sgd_plus", "p"), ("cq_ggadmm", "xi")}
"""Hyper-parameters that lie in (0, 1) (the factories check it): tuned in the logit, h = 1 / (1 + e^{−u})."""

HOST_SIDE = {"spread", "fit_l2", "concentration"}
"""Continuous settings used once on the host, before training (P2P Bayes' candidates and its report): no step
depends on them, so nothing differentiates them."""


class Options(NamedTuple):
  """`fedjax-opt tune`'s own flags."""

  names: tuple[str, ...]
  outer_steps: int
  schedule: str
  outer_lr: float
  train_rounds: int | None
  average: int = 1


def options(args, given: dict[str, Any]) -> Options:
  """The tune flags, and the checks that need no JAX: one algorithm, a list of names."""
  algorithms = given.get("algorithms")
  if algorithms is None:
    raise UsageError("fedjax-opt tune needs --algorithms NAME, the one algorithm to tune")
  names = [a.strip() for a in str(algorithms).split(",") if a.strip()]
  if len(names) != 1:
    raise UsageError(f"fedjax-opt tune tunes one algorithm; got --algorithms {algorithms} (tune each into its own "
                     f"--out)")
  tuned = [n.strip() for n in str(args.tune).split(",")]
  if not all(tuned):
    raise UsageError(f"--tune takes hyper-parameter names separated by commas, e.g. server_lr,client_lr; got "
                     f"{args.tune!r}")
  twice = sorted({n for n in tuned if tuned.count(n) > 1})
  if twice:
    raise UsageError(f"--tune lists {twice[0]} twice")
  if args.average > args.outer_steps + 1:
    raise UsageError(f"--average {args.average} exceeds the {args.outer_steps + 1} values a tuning of --outer-steps "
                     f"{args.outer_steps} goes through (the start and one after each step)")
  return Options(tuple(tuned), args.outer_steps, args.schedule, args.outer_lr, args.train_rounds, args.average)


def tunable(name: str, hyper: dict[str, Any]) -> dict[str, float]:
  """The continuous hyper-parameters of algorithm `name` with their starting values: every settable one whose
  value (resolved `hyper`, else the factory's default) is a float, but for `HOST_SIDE`."""
  settable = registry.REGISTRY[name].settable()
  out = {}
  for key, default in settable.items():
    value = hyper.get(key, default)
    if isinstance(value, float) and key not in HOST_SIDE:
      out[key] = value
  return out


def _parametrization(name: str, tuned: tuple[str, ...]) -> dict[str, str]:
  return {k: "logit" if (name, k) in UNIT_INTERVAL else "log" for k in tuned}


def _check(config: dict[str, Any], opts: Options) -> tuple[str, dict[str, Any], dict[str, float], dict[str, str]]:
  """(algorithm, its resolved hyper-parameters, the starting values of the tuned ones, their parametrization)."""
  name = config["algorithms"]
  if privacy.enabled(config):
    raise UsageError("fedjax-opt tune does not take differential privacy: tuning reads every client's test split "
                     "outside the accountant; tune without the --dp-* flags, then train with them: fedjax-opt run "
                     "--set ALGO.NAME=VALUE ...")
  hyper = config_lib.hyper_parameters(config, name)
  candidates = tunable(name, hyper)
  settable = registry.REGISTRY[name].settable()
  if not candidates:
    raise UsageError(f"{name} has no continuous hyper-parameter that its rounds use: nothing to tune")
  listed = ", ".join(candidates)
  for key in opts.names:
    if key not in settable:
      raise UsageError(f"{name} has no hyper-parameter {key!r}; tunable (continuous): {listed}")
    if key not in candidates:
      value = hyper.get(key, settable[key])
      why = ("is set on the host before training" if key in HOST_SIDE else
             f"is not continuous (its value is {value!r})" if value is not None else
             "has no value to start from (give one with --set)")
      raise UsageError(f"{name}.{key} {why}; tunable (continuous): {listed}")
  kinds = _parametrization(name, opts.names)
  start = {key: candidates[key] for key in opts.names}
  for key, value in start.items():
    if kinds[key] == "log" and not value > 0:
      raise UsageError(f"{name}.{key} starts at {value:g}, and tuning moves its logarithm: give a start > 0 with "
                       f"--set {name}.{key}=VALUE")
    if kinds[key] == "logit" and not 0 < value < 1:
      raise UsageError(f"{name}.{key} starts at {value:g}, and tuning moves its logit: give a start in (0, 1) with "
                       f"--set {name}.{key}=VALUE")
  return name, hyper, start, kinds


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def _floats(values) -> list[float]:
  """float32 values as the shortest decimals that read back as the same float32 (0.05, not 0.04999999701976776):
  a tuned value passed as `--set NAME=VALUE` is the float32 the tuning ended on."""
  import numpy as np

  return [float(str(x)) for x in np.asarray(values, np.float32).ravel()]


def _fmt(value: float) -> str:
  return f"{value:.4g}"


def command_tune(config: dict[str, Any], opts: Options, out: str, overwrite: bool) -> int:
  """Tunes, writes tune.json and tune.png, then trains and reports the run with the tuned values."""
  name, hyper, start, kinds = _check(config, opts)
  from fedjax_opt.cli import run

  run.start_jax(config)
  import jax
  import jax.numpy as jnp
  import optax

  from fedjax_opt import data
  from fedjax_opt import hyper as hyper_lib
  from fedjax_opt.train.config import Sampling
  from fedjax_opt.train.progress import format_value

  quiet = config["quiet"]
  say = (lambda *a: None) if quiet else print
  dataset, model, ctx, wrappers, _ = run.prepared_context(config, say)
  if not dataset.has_test_examples:
    raise UsageError(f"dataset {config['dataset']!r} has no test split here: the validation loss needs one")
  spec = registry.REGISTRY[name]
  per_round = run.steps_per_round(spec, config)
  rounds = config["rounds"] * per_round  # asynchronous: R × C server events, as `run` counts them
  fixed = dict(hyper)
  fixed.update({k: v for k, v in start.items() if k not in fixed})  # a factory default tuned: passed by name

  def make_algorithm(h):
    return run.build_algorithm(name, dict(fixed, **h), config, ctx, wrappers)

  personalized = spec.evaluation == "table"
  objective = hyper_lib.validation_loss(spec.scoring_model(model, hyper, dataset).loss_fn, personalized=personalized)
  sampling = Sampling(**run.sampling(spec, hyper, config, dataset))
  validation = data.client_batches(dataset, max(1, dataset.max_test), split="test")
  params = model.init(jax.random.key(config["seed"]))
  key = jnp.stack([jax.random.key(config["seed"] + 1), jax.random.key(config["seed"])])  # as `run` draws
  u0 = hyper_lib.unconstrain(start, kinds)
  gradient = hyper_lib.value_and_grad(make_algorithm, objective, rounds=rounds, sampling=sampling,
                                      parametrization=kinds)
  try:  # traces the step's derivative, so a refusal comes before anything runs
    jax.eval_shape(gradient, u0, params, key, dataset, validation)
  except (ValueError, TypeError) as e:  # fo.hyper.NotDifferentiableError is a ValueError
    raise UsageError(f"{name}: cannot tune {', '.join(opts.names)}: {_first_line(e)}") from None

  total = rounds * opts.outer_steps if opts.schedule == "online" else rounds
  train_rounds = opts.train_rounds or (config["rounds"] * opts.outer_steps if opts.schedule == "online"
                                       else config["rounds"])
  say(f"model {model.name}; tuning {name}'s {', '.join(opts.names)} by hyper-gradients of the validation loss "
      f"(mean {'personalized ' if personalized else ''}test loss over every client), Adam {opts.outer_lr:g} on "
      f"{' and '.join(sorted({'log' if k == 'log' else 'logit' for k in kinds.values()}))} h; "
      + (f"online: one run of {opts.outer_steps} windows of {config['rounds']} rounds" if opts.schedule == "online"
         else f"offline: {opts.outer_steps} runs of {config['rounds']} rounds from the start"))
  say(f"[{name}] compiling the tuning program (all {opts.outer_steps} outer steps are one program: their lines "
      "follow as it runs)")
  started = time.perf_counter()

  def progress(setting, step, h, value, grad):
    del setting, grad
    print(f"[{name}] outer step {step + 1}/{opts.outer_steps}: "
          + " ".join(f"{k}={_fmt(h[k])}" for k in opts.names)
          + f"  validation loss {format_value(value)}  ({time.perf_counter() - started:.1f} s)", flush=True)

  result = hyper_lib.tune(make_algorithm, objective, start, params, key, dataset, validation, rounds=rounds,
                          outer_steps=opts.outer_steps, schedule=opts.schedule, optimizer=optax.adam(opts.outer_lr),
                          sampling=sampling, parametrization=kinds, callback=None if quiet else progress,
                          average=opts.average)
  seconds = time.perf_counter() - started
  at_tuned = None
  if opts.schedule == "offline":  # the state after R rounds from the start at the tuned values
    at_tuned = _floats(jax.jit(objective)(jax.tree.map(lambda a: a[0], result.state), validation))[0]
  trajectory = {k: _floats(result.trajectory[k][0]) for k in opts.names}
  values = _floats(result.values[0])
  tuned = {k: _floats(result.hyper_params[k])[0] for k in opts.names}  # the last value, or the tail average
  bad = [k for k, v in tuned.items() if not math.isfinite(v)] + ([] if all(map(math.isfinite, values)) else ["J"])
  record = {
      "algorithm": name, "tuned": list(opts.names), "start": start, "tuned_values": tuned,
      "parametrization": kinds, "schedule": opts.schedule, "rounds": config["rounds"], "server_events_per_round":
      per_round, "outer_steps": opts.outer_steps, "rounds_tuned_along": total // per_round,
      "outer_optimizer": {"name": "adam", "learning_rate": opts.outer_lr, "b1": 0.9, "b2": 0.999, "eps": 1e-8},
      "average": opts.average,
      "objective": ("mean loss over every test example of every client, of the client's own model" if personalized
                    else "mean loss over every test example of every client, of the global model"),
      "seed": config["seed"], "initial_model": "model.init(jax.random.key(seed))",
      "init_key": "jax.random.key(seed + 1)", "data_key": "jax.random.key(seed): round r is drawn with "
      "fold_in(data_key, r), as fedjax-opt run draws it",
      "hyper_parameters": trajectory,
      "validation_loss": values,
      "validation_loss_at_tuned": at_tuned,
      "gradient": {k: _floats(result.gradients[k][0]) for k in opts.names},
      "gradient_of": "the validation loss, with respect to u = log h (logit h where parametrization says logit)",
      "seconds": seconds, "train_rounds": train_rounds,
  }
  if overwrite:
    config_lib.clear_previous(out)
  try:
    os.makedirs(out, exist_ok=True)
    config_lib.write_json(os.path.join(out, "tune.json"), record, indent=1)
  except OSError as e:  # checked before (config.check_writable); the folder may have changed since
    raise UsageError(f"--out {out}: cannot write there ({e.strerror})") from None
  _plot(record, config, dataset, os.path.join(out, "tune.png"))
  say(f"tuned {name} in {seconds:.1f} s: " + ", ".join(f"{k} {_fmt(start[k])} → {_fmt(tuned[k])}" for k in opts.names)
      + f"; validation loss {format_value(values[0])} at the first step, {format_value(values[-1])} at the last")
  if bad:  # tune.json and tune.png show where; nothing is trained
    raise UsageError(f"{name}: the tuning diverged ({', '.join(bad)} not finite, see {out}/tune.json); nothing "
                     f"trained: lower --outer-lr or --rounds, and rerun with --overwrite")
  say(f"wrote {out}/: tune.json, tune.png")
  settings = " ".join(f"--set {name}.{k}={v!r}" for k, v in tuned.items())
  say(f"training {name} with the tuned values for {train_rounds} rounds, as fedjax-opt run {settings} would")
  tuned_config = dict(config, rounds=train_rounds,
                      hyper=dict(config["hyper"], **{name: dict(config["hyper"].get(name, {}), **tuned)}))
  return run.train_and_report(tuned_config, out, False, False)


def _plot(record: dict[str, Any], config: dict[str, Any], dataset, path: str) -> None:
  """tune.png: each tuned hyper-parameter (log scale) and the validation loss against the outer step."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  import numpy as np

  from fedjax_opt.cli import report

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
  average = record.get("average", 1)
  for i, (key, values) in enumerate(record["hyper_parameters"].items()):
    tuned = record["tuned_values"][key]
    axes[0].plot(np.arange(len(values)), values, marker="o", ms=3, color=f"C{i % 10}",
                 label=f"{key}: {values[0]:.4g} → {tuned:.4g}")
    if average > 1:  # the tail average over the steps it spans
      axes[0].hlines(tuned, len(values) - average, len(values) - 1, colors=f"C{i % 10}", linestyles="--")
  axes[0].set_yscale("log")
  axes[0].set_ylabel("value")
  axes[0].set_title("hyper-parameters, before each outer step and after the last" + (
      f"; tuned (dashed): the mean of the last {average}" if average > 1 else " (tuned)"), fontsize=9)
  axes[0].legend(fontsize=7)
  loss = record["validation_loss"]
  axes[1].plot(np.arange(len(loss)), loss, marker="o", ms=3, color="C3")
  axes[1].set_ylabel("validation loss")
  axes[1].set_title("mean test loss over every client, " + ("at the end of each window" if record["schedule"] ==
                                                            "online" else f"after {record['rounds']} rounds"),
                    fontsize=9)
  for ax in axes:
    ax.set_xlabel("outer step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  fig.suptitle(f"{record['algorithm']}, {record['schedule']} tuning, R = {record['rounds']} rounds, Adam "
               f"{record['outer_optimizer']['learning_rate']:g}; {report.title(config, dataset)}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

