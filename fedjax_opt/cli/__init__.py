"""`fedjax-opt`: the command line.

    fedjax-opt run                                   # FedAvg vs FedAdam, MNIST 5k, 100 clients, Dirichlet(0.5)
    fedjax-opt run --algorithms fedavg,scaffold,ditto --dataset digits --rounds 200
    fedjax-opt run --algorithms ditto,pfedme --set ditto.lam=0.5 --partition shards
    fedjax-opt run --algorithms admm_consensus,gadmm --dataset synthetic_1_1
    fedjax-opt run --algorithms dane,giant,cocoa --dataset libsvm:heart_scale   # a LibSVM file, 10 clients
    fedjax-opt run --config exp.toml                 # keys mirror the flags; [ditto] sections set hyper-parameters
    fedjax-opt run --seeds 5                         # 5 seeds per algorithm as one vmapped program; mean ± std
    fedjax-opt run --out runs/a --resume --rounds 600    # continue a saved run, with its own configuration
    fedjax-opt list algorithms                       # every algorithm, its family and hyper-parameter defaults
    fedjax-opt tune --algorithms fedadam --tune server_lr,client_lr --rounds 100 --outer-steps 20
                                                     # hyper-gradient tuning, then a run with the tuned values

A run trains each algorithm on the same federated dataset from the same
initial model, prints progress and a results table, and writes into `--out`:
`config.json`, `history.json`, `results.json`, `accuracy.png` (against
rounds and against MB sent), `loss.png` (train and test),
`personalized_accuracy.png` (per-client histogram, personalized algorithms)
and orbax checkpoints. The files are described in `docs/cli.md`. Bad input
exits with code 2 and one line naming the flags of the bad value, and leaves
the run folder as it was; so does any other failure before a checkpoint is
saved (the same command may be given again). Ctrl-C saves the last completed
chunk and exits with 130. A run's status is "finished", "degraded" (it ended
far worse than it started: `run.outcome`) or "diverged between rounds a and b".

The algorithms come from `fedjax_opt.cli.registry`: adding a `Spec` there
puts an algorithm on the command line, with its hyper-parameters.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

from fedjax_opt.cli import config as config_lib
from fedjax_opt.cli import files, registry, report
from fedjax_opt.cli.config import DEFAULTS, UsageError, build_parser

__all__ = ["DEFAULTS", "UsageError", "build_parser", "command_list", "flag_reference", "main"]


def command_list(what: str | None = None) -> int:
  from fedjax_opt import data, server_optimizers

  sections = []
  if what in (None, "algorithms"):
    for family, doc in registry.FAMILIES.items():
      entries = {name: f"{spec.description}\n    {registry.describe_defaults(name)}"
                 for name, spec in registry.REGISTRY.items() if spec.family == family}
      sections.append((f"algorithms, {family} family ({doc})", entries))
  if what in (None, "aggregators", "attacks"):
    from fedjax_opt.cli import robust

    entries = robust.describe()
    for kind, flag in (("aggregator", "--aggregator; --set aggregator.NAME=VALUE"),
                       ("attack", "--attack, --attackers F; --set attack.NAME=VALUE")):
      if what in (None, kind + "s"):
        sections.append((f"{kind}s ({flag})", {k.split(" ", 1)[1]: v for k, v in entries.items()
                                                if k.startswith(kind + " ")}))
  if what in (None, "server-optimizers"):
    sections.append(("server optimizers (--set ALGO.server_optimizer=NAME)", server_optimizers.available()))
  if what in (None, "datasets"):
    sections.append(("datasets (--dataset)", {
        i.name: (config_lib.SYNTHETIC_VARIANTS if i.name == "synthetic" else i.description) + f"; clients: {i.clients}"
        + (f"; the command line samples {config_lib.SHAKESPEARE_ROLES} (--num-clients)" if i.name == "shakespeare"
           else "")
        + ("" if i.installed else f" [needs {i.requires}]")
        for i in data.available()} | {
        files.PREFIX + "PATH": f"a LibSVM / svmlight file (labels mapped to 0 … L−1); clients: "
                               f"{files.DEFAULT_NUM_CLIENTS}, Dirichlet(0.5) label skew (--partition, --num-clients)"}))
  if what in (None, "partitions"):
    sections.append(("partitions (--partition, image datasets)", {
        "iid": "uniformly at random, equal sizes", "dirichlet": "label skew, class proportions ~ Dirichlet(α)",
        "shards": "label-sorted shards, 2 per client (McMahan et al. 2017)",
        "labels": "each client holds k classes", "power_law": "power-law client sizes"}))
  if what in (None, "models"):
    sections.append(("models (--model)", {
        "auto": config_lib.AUTO_MODEL,
        "logreg": "multinomial logistic regression", "mlp": "2NN MLP, 200-200 hidden (McMahan et al. 2017)",
        "cnn": "EMNIST CNN (Reddi et al. 2021)", "rnn": "character GRU for next-character prediction"}))
  if what in (None, "algorithms"):
    print(f"--set ALGO.NAME=VALUE sets any name below; '--client-lr' marks the run's --client-lr "
          f"(default {registry.DEFAULT_CLIENT_LR}), which an explicit --client-lr also puts in every client_lr.")
  for title, entries in sections:
    print(title)
    width = max(len(k) for k in entries)
    for key, doc in entries.items():
      print(f"  {key.ljust(width)}  {doc}")
  return 0


def flag_reference() -> str:
  """The flags of `fedjax-opt run` as a Markdown list, generated from the parser (the README holds it)."""
  parser = build_parser()
  run = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]  # pylint: disable=protected-access
  lines = []
  for action in run._actions:  # pylint: disable=protected-access
    if not action.option_strings or action.option_strings == ["-h", "--help"]:
      continue
    value = action.metavar or action.dest.upper()
    flag = action.option_strings[0] + ("" if action.nargs == 0 else f" [{value}]" if action.nargs == "?" else
                                        f" {value}")
    lines.append(f"- `{flag}`: {action.help}")
  return "\n".join(lines)


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
  del filename, lineno, file, line
  return f"fedjax-opt: warning: {message}\n" if category.__module__.startswith("fedjax_opt") else \
      f"{category.__name__}: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
  import warnings

  warnings.formatwarning = _one_line_warning
  out = None
  try:
    args = build_parser().parse_args(argv)
    if args.command == "list":
      return command_list(args.what)
    from fedjax_opt.cli import run

    given = config_lib.given_settings(args)
    if args.command == "tune":
      from fedjax_opt.cli import tune

      opts = tune.options(args, given)
      config = config_lib.finish(given)
      out = args.out if args.out is not None else os.path.join(
          "runs", f"{files.run_name(config['dataset'])}-{time.strftime('%Y%m%d-%H%M%S')}")
      config_lib.prepare_new(out, bool(args.overwrite), resumable=False)
      return tune.command_tune(config, opts, out, bool(args.overwrite))
    if args.resume:
      if args.overwrite:
        raise UsageError("--resume continues the run in --out and --overwrite replaces it: give one of them")
      config = config_lib.finish(config_lib.for_resume(args.out, given))
      out = args.out
    else:
      config = config_lib.finish(given)
      out = args.out if args.out is not None else os.path.join(
          "runs", f"{files.run_name(config['dataset'])}-{time.strftime('%Y%m%d-%H%M%S')}")
      config_lib.prepare_new(out, bool(args.overwrite))
    return run.command_run(config, out, bool(args.resume), bool(args.overwrite))
  except UsageError as e:
    print(f"fedjax-opt: error: {e}", file=sys.stderr)
    return 2
  except report.Interrupted as e:
    print(f"fedjax-opt: interrupted while training {e.algorithm}; its last completed chunk is saved. "
          f"Continue with: fedjax-opt run --out {out} --resume", file=sys.stderr)
    return 130
  except KeyboardInterrupt:
    print("fedjax-opt: interrupted" + (f"; continue with: fedjax-opt run --out {out} --resume"
                                      if out and os.path.isfile(os.path.join(out, "config.json")) else ""),
          file=sys.stderr)
    return 130
