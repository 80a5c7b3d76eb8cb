"""Every headline figure of the README is the committed benchmark JSON, printed the way the README prints it.

`FIGURES` is the table: each record locates one figure in README.md (a regular expression that matches exactly
once; its group 1 is the figure as printed), reads the value from a file of `benchmarks/results/`, prints it the
way the README does (3 decimals, a percentage with 1 decimal, a ratio with 2 decimals, a range, ...) and names the
benchmark command that writes that file. The tests:

* `test_readme_figure_is_the_json`: the README's figure equals the JSON's value so printed;
* `test_benchmark_commands_parse`: every command named runs a script of `benchmarks/` whose own argparse
  arguments (read from its source, nothing imported) accept the command's flags and choices;
* `test_every_figure_in_scope_is_checked`: every figure-like number in the scope below (a decimal such as
  0.912 or 2.9, a number in scientific notation such as 1.8e-2, a percentage, a ratio such as 6×) lies inside a
  figure of `FIGURES`, of `SETTINGS` (inputs of a benchmark, thresholds, not results) or of `UNCHECKED` (results
  with no committed JSON), so a new figure written into that scope without a check fails here;
* `test_exemptions_are_current`: every `SETTINGS` and `UNCHECKED` entry still matches the README.

Scope of the coverage test: the sections "Which algorithm should I use?" (prose and tables) and "Benchmarks",
and in "The main job" the sentences that name a script of `benchmarks/` (the start-up times of
`driver_overhead.py --part startup`, the compute-fair FedMA comparison of `clustered.py --part d`). Not in scope:
"Set up" (test-suite and install times, not benchmark results), the main job's results table and the figures of
its `(That run shared ...)` paragraph and of the `fedjax-opt run` / `fedjax-opt tune` examples, which come from
runs of the command line whose `results.json` is not committed (listed in `UNCHECKED` where they share a sentence
with a benchmark), and integers (round counts, client counts: checked where they are results, e.g. the rounds
to 1e-4, but not required to be). Pure file reading: no JAX, nothing imported from the benchmarks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import pathlib
import re
import shlex
import statistics
from typing import Any, Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"

# ---- the benchmark commands -----------------------------------------------------------------------------------

HETEROGENEITY = "python benchmarks/heterogeneity.py"
PERSONALIZATION = "python benchmarks/personalization.py"
ADMM = "python benchmarks/admm.py"
BASELINES = "python benchmarks/distributed_baselines.py --datasets heart_scale,synthetic"
BASELINES_MNIST = "python benchmarks/distributed_baselines.py --datasets mnist5k"
HYPERGRAD = "python benchmarks/hypergrad.py"  # memory (compiled for the machine it runs on) and tuning
HYPERGRAD_TUNING = "python benchmarks/hypergrad.py --part tuning"
HYPERGRAD_MEMORY = "python benchmarks/hypergrad.py --part memory"  # writes hypergrad_memory.json
ROBUSTNESS = "python benchmarks/robustness.py --fresh"
ACCELERATOR_OVERHEAD = "python benchmarks/accelerator.py --part overhead"
STARTUP = "python benchmarks/driver_overhead.py --part startup"
FEDMA_FAIR = "python benchmarks/clustered.py --part d"


# ---- how figures are printed ----------------------------------------------------------------------------------

def dec(n: int) -> Callable[[float], str]:
  """A decimal with n places: 0.912."""
  return lambda v: f"{v:.{n}f}"


def pct(n: int) -> Callable[[float], str]:
  """A fraction as a percentage with n decimals: 0.887 -> 88.7%."""
  return lambda v: f"{100 * v:.{n}f}%"


def pct_bare(n: int) -> Callable[[float], str]:
  """A fraction in percent with n decimals, no sign: 0.887 -> 88.7 (the first end of a range, 86–89%)."""
  return lambda v: f"{100 * v:.{n}f}"


def times(n: int) -> Callable[[float], str]:
  """A ratio with n decimals and ×: 1.02×."""
  return lambda v: f"{v:.{n}f}×"


def sci(n: int) -> Callable[[float], str]:
  """Scientific notation, n decimals, the exponent unpadded: 0.0127 -> 1.3e-2."""
  def fmt(v: float) -> str:
    mantissa, exponent = f"{v:.{n}e}".split("e")
    return f"{mantissa}e{int(exponent)}"
  return fmt


def sci_padded(v: float) -> str:
  """The baselines table's cells: one significant figure, the exponent as Python pads it: (7e-03)."""
  return f"{v:.0e}"


def sig2(v: float) -> str:
  """Two significant figures, no trailing zeros but 1.0: 0.31623 -> 0.32, 0.0094868 -> 0.0095, 1.0 -> 1.0."""
  return repr(float(f"{v:.2g}"))


def sig1_int(v: float) -> str:
  """One significant figure of a number >= 1, as an integer: 2.45 -> 2, 429.8 -> 400."""
  return str(int(float(f"{v:.1g}")))


def integer(v: float) -> str:
  """Rounded to an integer, thousands separated: 1,300."""
  return f"{round(v):,}"


def points(v: float) -> str:
  """A difference in points, 1 decimal, a typographic minus: −0.2."""
  s = f"{v:.1f}"
  return "−" + s[1:] if s.startswith("-") else s


def span(fmt: Callable[[Any], str], sep: str = "–", lo_fmt: Callable[[Any], str] | None = None
         ) -> Callable[[tuple], str]:
  """A range (lo, hi) as `lo–hi`, or one figure when both ends print alike."""
  def out(v: tuple) -> str:
    lo, hi = (lo_fmt or fmt)(v[0]), fmt(v[1])
    return lo if lo == hi else f"{lo}{sep}{hi}"
  return out


def pair(fmt: Callable[[Any], str], sep: str = " and ") -> Callable[[tuple], str]:
  return lambda v: sep.join(fmt(x) for x in v)


WORDS = {3: "three", 4: "four", 6: "six"}


def count_of(v: tuple[int, int]) -> str:
  """(4, 6) -> 'four of six'; (6, 6) -> 'all six'."""
  k, n = v
  return f"all {WORDS[n]}" if k == n else f"{WORDS[k]} of {WORDS[n]}"


def text(v: str) -> str:
  return v


def one(values) -> Any:
  """The one value that several JSON entries share (a setting of every task or seed, a figure the README prints
  once for several runs)."""
  distinct = set(values)
  assert len(distinct) == 1, f"the README prints one figure for {sorted(distinct)}"
  return distinct.pop()


# ---- the table ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Figure:
  name: str                      # what the figure is
  where: str                     # a regex over README.md that matches once; group 1: the figure as printed
  json: str                      # the file under benchmarks/results/
  value: Callable[[Any], Any]    # the value, from the loaded JSON
  fmt: Callable[[Any], str]      # how the README prints it
  command: str                   # the benchmark command that (re)writes that file
  note: str = ""


def prose(pattern: str) -> str:
  """A pattern written with single spaces that also matches the README's line breaks and indentation."""
  return pattern.replace(" ", r"\s+")


@functools.lru_cache(maxsize=None)
def load(name: str) -> Any:
  with open(RESULTS / name, encoding="utf-8") as f:
    return json.load(f)


@functools.lru_cache(maxsize=None)
def readme() -> str:
  return README.read_text(encoding="utf-8")


# heterogeneity.json: tasks[task].final = [{method, results: [{stragglers, test_accuracy, ...}]}]
def het(task: str, method: str, stragglers: float) -> Callable[[dict], float]:
  def value(d):
    (row,) = [r for r in d["tasks"][task]["final"] if r["method"] == method]
    (cell,) = [c for c in row["results"] if c["stragglers"] == stragglers]
    return cell["test_accuracy"]
  return value


# personalization.json: tasks[task].table = [{method, personalized_accuracy, ..._p10, global_accuracy}]
def pers(task: str, method: str, key: str = "personalized_accuracy") -> Callable[[dict], float]:
  def value(d):
    (row,) = [r for r in d["tasks"][task]["table"] if r["method"] == method]
    return row[key]
  return value


# admm.json: tasks[task].methods[m] = {hyper_name, results: [{<hyper>: v, reach, final_gap}], best: v}
def admm_best(d: dict, task: str, method: str) -> dict:
  m = d["tasks"][task]["methods"][method]
  (row,) = [r for r in m["results"] if r[m["hyper_name"]] == m["best"]]
  return row


# distributed_baselines.json: tasks["<data> <loss>"].methods[m].splits[split] = {hypers: [row], best: i}
SPLITS = ("iid", "dirichlet0.1", "label-sorted")
NON_IID = SPLITS[1:]
HS = ("heart_scale ridge", "heart_scale logistic", "synthetic(1,1) ridge", "synthetic(1,1) logistic")


def db_row(d: dict, task: str, method: str, split: str, hyper: float | None = None) -> dict | None:
  methods = d["tasks"][task]["methods"]
  if method not in methods:
    return None
  s = methods[method]["splits"][split]
  if hyper is None:
    return s["hypers"][s["best"]]
  (row,) = [r for r in s["hypers"] if r[methods[method]["hyper_name"]] == hyper]
  return row


def db_cell(row: dict | None) -> str:
  """A cell of the README's baselines table: rounds to 1e-4, else (final gap), div. or n/a."""
  if row is None:
    return "n/a"
  if row["reach"]["0.0001"]["round"] is not None:
    return str(row["reach"]["0.0001"]["round"])
  return "div." if row["diverged"] else f"({sci_padded(row['final_gap'])})"


def db_table_row(method: str, hyper: float | None = None) -> Callable[[dict], str]:
  def value(d):
    return " | ".join(", ".join(db_cell(db_row(d, t, method, s, hyper)) for t in HS) for s in SPLITS)
  return value


def db_rounds(tasks, methods, splits) -> Callable[[dict], tuple[int, int]]:
  def value(d):
    rounds = [db_row(d, t, m, s)["reach"]["0.0001"]["round"] for t in tasks for m in methods for s in splits]
    assert None not in rounds, "a method the README says reached 1e-4 did not"
    return min(rounds), max(rounds)
  return value


def db_final(tasks, methods, splits) -> Callable[[dict], tuple[float, float]]:
  def value(d):
    gaps = [db_row(d, t, m, s)["final_gap"] for t in tasks for m in methods for s in splits
            if m in d["tasks"][t]["methods"]]
    return min(gaps), max(gaps)
  return value


def db_hyper(tasks, method, splits) -> Callable[[dict], float]:
  def value(d):
    name = d["tasks"][tasks[0]]["methods"][method]["hyper_name"]
    (hyper,) = {db_row(d, t, method, s)[name] for t in tasks for s in splits}
    return hyper
  return value


def db_one_shot_ratio(d: dict) -> tuple[float, float]:
  """How much further from the optimum one-shot averaging ends on a non-IID split than on IID (heart, synthetic)."""
  ratios = [db_row(d, t, "one-shot average", s)["final_gap"] / db_row(d, t, "one-shot average", "iid")["final_gap"]
            for t in HS for s in NON_IID]
  return min(ratios), max(ratios)


def db_run_seconds(datasets: str) -> Callable[[dict], float]:
  def value(d):
    (run,) = [r for r in d["runs"] if r["datasets"] == datasets]
    return run["seconds"]
  return value


# hypergrad.json: tuning = [{task, grid, seeds: [{seed, grid_best, tuned, tune_accuracy, ...}], summary}]
FEDADAM, DITTO = "FedAdam, MNIST 5k Dirichlet(0.5)", "Ditto, label-sorted MNIST 5k"


def tuning(d: dict, task: str) -> dict:
  (t,) = [t for t in d["tuning"] if t["task"] == task]
  return t


def seed_of(d: dict, task: str, seed: int) -> dict:
  (s,) = [s for s in tuning(d, task)["seeds"] if s["seed"] == seed]
  return s


def tuning_row(task: str, seed: int) -> Callable[[dict], str]:
  """A row of the README's tuning table, from the grid's best to the online schedule's last iterate."""
  def value(d):
    s = seed_of(d, task, seed)
    if task == FEDADAM:
      g, t = s["grid_best"], s["tuned"]
      labels = ("client lr ", "server lr ") if seed == 0 else ("", "")
      grid = f"({labels[0]}{sig2(g['client_lr'])}, {labels[1]}{sig2(g['server_lr'])})"
      tuned = f"({sig2(t['client_lr'])}, {sig2(t['server_lr'])})"
    else:
      g, t = s["grid_best"], s["tuned"]
      grid = f"(λ {sig2(g['lam'])}, η {sig2(g['eta'])})"
      tuned = f"(λ {sig2(t['lam'])}, η {sig2(t['eta'])})"
    return " | ".join([f"{pct(1)(g['accuracy'])} {grid}", f"{pct(1)(s['tune_accuracy'])} {tuned}",
                       points(s["gap_points"]), pct(1)(s["refine_last"]["accuracy"]),
                       pct(1)(s["online_last"]["accuracy"])])
  return value


def gap_points(a: float, b: float) -> float:
  return round(100 * (a - b), 2)  # as hypergrad.py rounds its gaps


def last_step_mean_gap(task: str) -> Callable[[dict], float]:
  """The mean gap of the grid's best to the last whole-run step, in points (the selection's effect)."""
  def value(d):
    return statistics.mean(gap_points(s["grid_best"]["accuracy"], s["refine_last"]["accuracy"])
                           for s in tuning(d, task)["seeds"])
  return value


def by_loss_gaps(task: str) -> Callable[[dict], tuple]:
  """Seeds where picking the grid's point by validation loss lands 0.5 points or more below its best."""
  def value(d):
    gaps = [gap_points(s["grid_best"]["accuracy"], s["grid_best_by_loss"]["accuracy"])
            for s in tuning(d, task)["seeds"]]
    big = [g for g in gaps if g >= 0.5]
    return (min(big), max(big)), len(big)
  return value


def seconds_range(task: str, key: str) -> Callable[[dict], tuple[float, float]]:
  def value(d):
    v = [s[key] for s in tuning(d, task)["seeds"]]
    return min(v), max(v)
  return value


def missed_seeds(task: str) -> Callable[[dict], list]:
  def value(d):
    return [(s["seed"], s["gap_points"]) for s in tuning(d, task)["seeds"] if s["gap_points"] > 0.5]
  return value


def earlier_h100(task: str, key: str) -> Callable[[dict], list[float]]:
  """The earlier protocol's two H100 runs, in the README's order (the JSON's second run first)."""
  def value(d):
    runs = [next(r for r in run if r["task"] == task) for run in d["earlier_tuning_nvidia_h100"]["runs"]]
    values = [r["grid_best"]["accuracy"] if key == "grid" else r[key] for r in runs]
    return values[::-1]
  return value


# hypergrad.json / hypergrad_memory.json: memory = [{rounds, program, total (bytes), vs_forward}]
def mem(program: str, rounds: int, key: str = "total") -> Callable[[dict], float]:
  def value(d):
    (row,) = [r for r in d["memory"] if r["program"] == program and r["rounds"] == rounds]
    return row[key]
  return value


def mem_all(program: str, key: str) -> Callable[[dict], tuple]:
  def value(d):
    v = [r[key] for r in d["memory"] if r["program"] == program]
    return min(v), max(v)
  return value


def mib(n: int) -> Callable[[float], str]:
  return lambda v: f"{v / 2**20:.{n}f}"


def gib(n: int) -> Callable[[float], str]:
  return lambda v: f"{v / 2**30:.{n}f}"


# robustness.json: accuracy[task][algorithm][rule][attack] = {fractions, accuracy: [per fraction]}
def rob(d: dict, rule: str, attack: str) -> dict:
  """FedAvg on MNIST 5k IID (the README's robustness figures)."""
  return d["accuracy"]["mnist5k_iid"]["fedavg"][rule][attack]


def rob_at(rule: str, attack: str, fraction: float) -> Callable[[dict], float]:
  def value(d):
    cell = rob(d, rule, attack)
    return cell["accuracy"][cell["fractions"].index(fraction)]
  return value


def rob_to_chance(rule: str, attack: str, chance: float = 0.15) -> Callable[[dict], float]:
  """The smallest attackers' fraction that brings the rule below `chance` (ten classes: 0.1)."""
  def value(d):
    cell = rob(d, rule, attack)
    return min(f for f, a in zip(cell["fractions"], cell["accuracy"]) if a < chance)
  return value


def rob_range(rule: str, attack: str) -> Callable[[dict], tuple[float, float]]:
  """The accuracy's range over the attacked fractions (not 0)."""
  def value(d):
    attacked = rob(d, rule, attack)["accuracy"][1:]
    return min(attacked), max(attacked)
  return value


# accelerator_cpu_overhead.json: overhead = [{workload, C, bytes_ratio, ours_kernels, plain_kernels}]
def overhead(workload: str | None, key: str) -> Callable[[dict], tuple]:
  def value(d):
    rows = [r for r in d["overhead"] if workload is None or r["workload"] == workload]
    v = [r["ours_kernels"] / r["plain_kernels"] if key == "kernels" else r[key] for r in rows]
    return min(v), max(v)
  return value


# driver_startup.json: results[command][tree] = {first_line_seconds, ..., compile_seconds: {algorithm: s}}
def startup(key: str, algorithm: str | None = None) -> Callable[[dict], float]:
  def value(d):
    trees = d["results"]["default run"]
    tree = trees["after"] if "after" in trees else next(iter(trees.values()))  # a before/after run, or one tree
    return tree[key][algorithm] if algorithm else tree[key]
  return value


def fair(config: str) -> Callable[[dict], float]:
  return lambda d: d["fedma_fair"][config]["fedma_minus_fedavg"]["mean"]


H100_NOTE = ("earlier_tuning_nvidia_h100 is kept history (the protocol before tail averaging); hypergrad.py "
             "carries it over but no current command recomputes it")

FIGURES: list[Figure] = [
    # -- Which algorithm should I use? Non-IID --------------------------------------------------------------------
    Figure("MNIST Dir(0.1): SCAFFOLD", prose(r"SCAFFOLD reached (\d\.\d+) test accuracy and FedDyn"),
           "heterogeneity.json", het("mnist5k_dir0.1", "SCAFFOLD", 0.0), dec(3), HETEROGENEITY),
    Figure("MNIST Dir(0.1): FedDyn", prose(r"test accuracy and FedDyn (\d\.\d+) against FedAvg's"),
           "heterogeneity.json", het("mnist5k_dir0.1", "FedDyn alpha=0.01", 0.0), dec(3), HETEROGENEITY),
    Figure("MNIST Dir(0.1): FedAvg", prose(r"against FedAvg's (\d\.\d+); on Synthetic"),
           "heterogeneity.json", het("mnist5k_dir0.1", "FedAvg (drops stragglers)", 0.0), dec(3), HETEROGENEITY),
    Figure("Synthetic(1,1): SCAFFOLD", prose(r"on Synthetic\(1, 1\), (\d\.\d+) and \d\.\d+ against \d\.\d+ \(`heter"),
           "heterogeneity.json", het("synthetic_1_1", "SCAFFOLD", 0.0), dec(3), HETEROGENEITY),
    Figure("Synthetic(1,1): FedDyn", prose(r"on Synthetic\(1, 1\), \d\.\d+ and (\d\.\d+) against \d\.\d+ \(`heter"),
           "heterogeneity.json", het("synthetic_1_1", "FedDyn alpha=0.01", 0.0), dec(3), HETEROGENEITY),
    Figure("Synthetic(1,1): FedAvg", prose(r"on Synthetic\(1, 1\), \d\.\d+ and \d\.\d+ against (\d\.\d+) \(`heter"),
           "heterogeneity.json", het("synthetic_1_1", "FedAvg (drops stragglers)", 0.0), dec(3), HETEROGENEITY),
    # -- stragglers
    Figure("90% stragglers: FedAvg, MNIST", prose(r"drops stragglers fell to (\d\.\d+) \(MNIST\)"),
           "heterogeneity.json", het("mnist5k_dir0.1", "FedAvg (drops stragglers)", 0.9), dec(3), HETEROGENEITY),
    Figure("90% stragglers: FedAvg, Synthetic", prose(r"\(MNIST\) and (\d\.\d+) \(Synthetic\) with"),
           "heterogeneity.json", het("synthetic_1_1", "FedAvg (drops stragglers)", 0.9), dec(3), HETEROGENEITY),
    Figure("the straggler fraction", prose(r"\(Synthetic\) with (\d+%) stragglers, FedNova"),
           "heterogeneity.json", lambda d: max(d["straggler_fractions"]), pct(0), HETEROGENEITY),
    Figure("90% stragglers: FedNova, MNIST", prose(r"FedNova kept (\d\.\d+) and \d\.\d+ \(`heter"),
           "heterogeneity.json", het("mnist5k_dir0.1", "FedNova", 0.9), dec(3), HETEROGENEITY),
    Figure("90% stragglers: FedNova, Synthetic", prose(r"FedNova kept \d\.\d+ and (\d\.\d+) \(`heter"),
           "heterogeneity.json", het("synthetic_1_1", "FedNova", 0.9), dec(3), HETEROGENEITY),
    # -- personalization
    Figure("label-sorted MNIST: Ditto", prose(r"personalized accuracy was (\d\.\d+) \(Ditto\)"),
           "personalization.json", pers("mnist5k_shards", "Ditto"), dec(3), PERSONALIZATION),
    Figure("label-sorted MNIST: pFedMe", prose(r"\(Ditto\), (\d\.\d+) \(pFedMe\)"),
           "personalization.json", pers("mnist5k_shards", "pFedMe"), dec(3), PERSONALIZATION),
    Figure("label-sorted MNIST: L2GD", prose(r"\(pFedMe\), (\d\.\d+) \(L2GD\) against"),
           "personalization.json", pers("mnist5k_shards", "L2GD"), dec(3), PERSONALIZATION),
    Figure("label-sorted MNIST: FedAvg", prose(r"\(L2GD\) against (\d\.\d+) for FedAvg's global model"),
           "personalization.json", pers("mnist5k_shards", "FedAvg"), dec(3), PERSONALIZATION),
    Figure("Synthetic(1,1): Ditto", prose(r"Synthetic\(1, 1\), (\d\.\d+) \(Ditto\), \d\.\d+ \(L2GD\)"),
           "personalization.json", pers("synthetic_1_1", "Ditto"), dec(3), PERSONALIZATION),
    Figure("Synthetic(1,1): L2GD", prose(r"\(Ditto\), (\d\.\d+) \(L2GD\) against \d\.\d+, with"),
           "personalization.json", pers("synthetic_1_1", "L2GD"), dec(3), PERSONALIZATION),
    Figure("Synthetic(1,1): FedAvg", prose(r"\(L2GD\) against (\d\.\d+), with the worst"),
           "personalization.json", pers("synthetic_1_1", "FedAvg"), dec(3), PERSONALIZATION),
    Figure("Synthetic(1,1): worst 10% of clients, Ditto and L2GD",
           prose(r"10% of clients at (\d\.\d+) against \d\.\d+ \(`pers"), "personalization.json",
           lambda d: {pers("synthetic_1_1", m, "personalized_accuracy_p10")(d) for m in ("Ditto", "L2GD")},
           lambda v: dec(3)(next(iter(v))) if len({dec(3)(x) for x in v}) == 1 else str(sorted(v)),
           PERSONALIZATION),
    Figure("Synthetic(1,1): worst 10% of clients, FedAvg",
           prose(r"10% of clients at \d\.\d+ against (\d\.\d+) \(`pers"),
           "personalization.json", pers("synthetic_1_1", "FedAvg", "personalized_accuracy_p10"), dec(3),
           PERSONALIZATION),
    Figure("FedAvg + fine-tuning, MNIST", prose(r"the cheap baseline to beat \((\d\.\d+) and"),
           "personalization.json", pers("mnist5k_shards", "FedAvg+FT"), dec(3), PERSONALIZATION),
    Figure("FedAvg + fine-tuning, Synthetic", prose(r"the cheap baseline to beat \(\d\.\d+ and (\d\.\d+)\)"),
           "personalization.json", pers("synthetic_1_1", "FedAvg+FT"), dec(3), PERSONALIZATION),
    # -- ADMM
    Figure("logistic: consensus ADMM's rounds to 1e-4", prose(r"relative gap of 1e-4 in (\d+) rounds and GADMM"),
           "admm.json", lambda d: admm_best(d, "logistic", "consensus ADMM")["reach"]["0.0001"]["round"], str, ADMM),
    Figure("logistic: GADMM's rounds to 1e-4", prose(r"rounds and GADMM in (\d+), while FedAvg"),
           "admm.json", lambda d: admm_best(d, "logistic", "GADMM (chain)")["reach"]["0.0001"]["round"], str, ADMM),
    Figure("logistic: FedAvg's final gap", prose(r"with 20 local steps stopped at (\d\.\de-\d+);"),
           "admm.json", lambda d: admm_best(d, "logistic", "FedAvg (K=20)")["final_gap"], sci(1), ADMM),
    Figure("logistic: GADMM's bits to 1e-4 over CQ-GGADMM's (chain)", prose(r"censored\) needed (\d+×) fewer bits"),
           "admm.json",
           lambda d: (admm_best(d, "logistic", "GADMM (chain)")["reach"]["0.0001"]["bits"]
                      / admm_best(d, "logistic", "CQ-GGADMM (chain, 4 bits)")["reach"]["0.0001"]["bits"]),
           times(0), ADMM),
    # -- the classical distributed baselines (heart_scale, Synthetic(1, 1))
    Figure("heart_scale: examples a client", prose(r"on heart_scale even IID, (\d+) examples a client"),
           "distributed_baselines.json",
           lambda d: one(d["tasks"]["heart_scale ridge"]["client_sizes"]["iid"]), str, BASELINES),
    Figure("DANE's μ, ridge, non-IID", prose(r"it needs μ = (\d+(?:\.\d+)?) \(ridge,"), "distributed_baselines.json",
           db_hyper(HS[0::2], "DANE", NON_IID), lambda v: f"{v:g}", BASELINES),
    Figure("DANE's rounds, ridge, non-IID", prose(r"\(ridge, (\d+–\d+) rounds instead of"),
           "distributed_baselines.json", db_rounds(HS[0::2], ["DANE"], NON_IID), span(str), BASELINES),
    Figure("DANE's rounds, ridge, IID", prose(r"rounds instead of (\d+(?:–\d+)?)\) or"),
           "distributed_baselines.json", db_rounds(HS[0::2], ["DANE"], ["iid"]), span(str), BASELINES),
    Figure("DANE's μ, logistic, non-IID", prose(r"\) or μ = (\d+(?:\.\d+)?) \(logistic,"),
           "distributed_baselines.json", db_hyper(HS[1::2], "DANE", NON_IID), lambda v: f"{v:g}", BASELINES),
    Figure("DANE's rounds, logistic, non-IID", prose(r"\(logistic, (\d+(?:–\d+)?) instead of"),
           "distributed_baselines.json", db_rounds(HS[1::2], ["DANE"], NON_IID), span(str), BASELINES),
    Figure("DANE's rounds, logistic, IID", prose(r"\(logistic, \d+(?:–\d+)? instead of (\d+(?:–\d+)?)\)\);"),
           "distributed_baselines.json", db_rounds(HS[1::2], ["DANE"], ["iid"]), span(str), BASELINES),
    Figure("one-shot averaging: non-IID final gap over IID", prose(r"one-shot averaging ends (\d+–\d+×) further"),
           "distributed_baselines.json", db_one_shot_ratio, lambda v: span(sig1_int)(v) + "×", BASELINES),
    Figure("GIANT and FADL: rounds to 1e-4", prose(r"GIANT and FADL reached 1e-4 on every split in (\d+–\d+) rounds"),
           "distributed_baselines.json", db_rounds(HS, ["GIANT", "FADL"], SPLITS), span(str), BASELINES),
    Figure("SCAFFOLD: rounds to 1e-4", prose(r"fewer than SCAFFOLD \((\d+–\d+)\)"),
           "distributed_baselines.json", db_rounds(HS, ["SCAFFOLD"], SPLITS), span(str), BASELINES),
    Figure("consensus ADMM: rounds to 1e-4", prose(r"and consensus ADMM \((\d+–\d+)\), which"),
           "distributed_baselines.json", db_rounds(HS, ["consensus ADMM"], SPLITS), span(str), BASELINES),
    Figure("CoCoA+: final gap, IID", prose(r"it was slow everywhere \(gap (\S+) IID,"),
           "distributed_baselines.json", db_final(HS, ["CoCoA+"], ["iid"]), span(sci(0)), BASELINES),
    Figure("CoCoA+: final gap, non-IID", prose(r"IID, (\S+) non-IID after 100 rounds\)"),
           "distributed_baselines.json", db_final(HS, ["CoCoA+"], NON_IID), span(dec(1)), BASELINES),
    Figure("the run's seconds (heart_scale, Synthetic)", prose(r"`benchmarks/results/distributed_baselines\.json`, "
                                                             r"(\d+) s\)"),
           "distributed_baselines.json", db_run_seconds("heart_scale,synthetic"), integer, BASELINES),
    *[Figure(f"baselines table: {label}", rf"(?m)^ *\| {re.escape(label)} \| (.*) \|$", "distributed_baselines.json",
             db_table_row(method, hyper), text, BASELINES)
      for label, method, hyper in [
          ("DANE", "DANE", None), ("FedDANE (half the clients)", "FedDANE (half the clients)", None),
          ("GIANT", "GIANT", None), ("FADL", "FADL", None), ("CoCoA+", "CoCoA+", None),
          ("one-shot average", "one-shot average", None), ("FedAvg", "FedAvg", None),
          ("SCAFFOLD", "SCAFFOLD", None), ("consensus ADMM", "consensus ADMM", None),
          ("DANE at μ = 0", "DANE", 0.0)]],
    # -- the baselines on MNIST 5k (an H100 run, merged into the same file)
    Figure("MNIST 5k: parameters", prose(r"digits 0–4 against 5–9, P = (\d+),"), "distributed_baselines.json",
           lambda d: d["tasks"]["mnist5k ridge"]["params"], str, BASELINES_MNIST),
    Figure("MNIST 5k: the run's seconds", prose(r"with `--datasets mnist5k`, (\d+) s\)"), "distributed_baselines.json",
           db_run_seconds("mnist5k"), integer, BASELINES_MNIST),
    Figure("MNIST 5k: DANE stalled, logistic, non-IID", prose(r"stalled at (\S+) on logistic;"),
           "distributed_baselines.json", db_final(["mnist5k logistic"], ["DANE"], NON_IID), span(sci(1), " to "),
           BASELINES_MNIST),
    Figure("MNIST 5k: GIANT's rounds, logistic, non-IID", prose(r"on the logistic splits \((\d+ and \d+) rounds\)"),
           "distributed_baselines.json",
           lambda d: [db_row(d, "mnist5k logistic", "GIANT", s)["reach"]["0.0001"]["round"] for s in NON_IID],
           pair(str), BASELINES_MNIST),
    Figure("MNIST 5k: GIANT's final gap, ridge, non-IID", prose(r"but ended at (\S+ and \S+) on ridge;"),
           "distributed_baselines.json",
           lambda d: [db_row(d, "mnist5k ridge", "GIANT", s)["final_gap"] for s in NON_IID], pair(sci(1)),
           BASELINES_MNIST),
    Figure("MNIST 5k: FADL's rounds, ridge, Dirichlet", prose(r"FADL reached it in (\d+) \(ridge, Dirichlet\)"),
           "distributed_baselines.json",
           lambda d: db_row(d, "mnist5k ridge", "FADL", "dirichlet0.1")["reach"]["0.0001"]["round"], str,
           BASELINES_MNIST),
    Figure("MNIST 5k: FADL's rounds, logistic, non-IID",
           prose(r"\(ridge, Dirichlet\) and (\d+–\d+) rounds \(logistic\)"),
           "distributed_baselines.json", db_rounds(["mnist5k logistic"], ["FADL"], NON_IID), span(str),
           BASELINES_MNIST),
    Figure("MNIST 5k: CoCoA+ and one-shot averaging, non-IID final gaps",
           prose(r"CoCoA\+ and one-shot averaging ended far off \((\S+ to \S+)\);"), "distributed_baselines.json",
           db_final(["mnist5k ridge", "mnist5k logistic"], ["CoCoA+", "one-shot average"], NON_IID),
           span(dec(1), " to ", lo_fmt=sci(0)), BASELINES_MNIST),
    Figure("MNIST 5k: SCAFFOLD's final gap, ridge", prose(r"\(SCAFFOLD (\S+(?: to \S+)?) ridge,"),
           "distributed_baselines.json", db_final(["mnist5k ridge"], ["SCAFFOLD"], SPLITS), span(sci(1), " to "),
           BASELINES_MNIST),
    Figure("MNIST 5k: SCAFFOLD's final gap, logistic", prose(r"ridge, (\S+(?: to \S+)?) logistic, split or not\)"),
           "distributed_baselines.json", db_final(["mnist5k logistic"], ["SCAFFOLD"], SPLITS), span(sci(1), " to "),
           BASELINES_MNIST),
    # -- hyper-gradient tuning
    Figure("tuning: the run's minutes", prose(r"\(CPU, two shared cores, (\d+) min;"), "hypergrad.json",
           lambda d: d["tuning_seconds"] / 60, integer, HYPERGRAD_TUNING),
    Figure("tuning: the start below the grid's centre", prose(r"from a start (\d+×) below the grid's centre"),
           "hypergrad.json",
           lambda d: one(round(t["grid"][k][len(t["grid"][k]) // 2] / t["tune_start"][k], 6)
                      for t in d["tuning"] for k in t["grid"]), times(0), HYPERGRAD_TUNING),
    Figure("tuning: the online schedule's Adam step", prose(r"of one 100-round run, Adam (\d\.\d+) on the log"),
           "hypergrad.json", lambda d: one(t["online_adam"] for t in d["tuning"]), lambda v: f"{v:g}",
           HYPERGRAD_TUNING),
    Figure("tuning: the whole-run steps' Adam step", prose(r"then 3 Adam steps of (\d\.\d+) that each"),
           "hypergrad.json", lambda d: one(t["refine_adam"] for t in d["tuning"]), lambda v: f"{v:g}",
           HYPERGRAD_TUNING),
    Figure("tuning: the protocol's rounds", prose(r"at no extra round\)\. ([\d,]+) rounds \(a backward"),
           "hypergrad.json", lambda d: one(s["tune_rounds_trained"] for t in d["tuning"] for s in t["seeds"]),
           integer, HYPERGRAD_TUNING),
    Figure("tuning: the grid's rounds", prose(r"`fo\.sweep` grid's ([\d,]+)\. Validation"),
           "hypergrad.json", lambda d: one(s["grid_rounds_trained"] for t in d["tuning"] for s in t["seeds"]),
           integer, HYPERGRAD_TUNING),
    *[Figure(f"tuning table: {task.split(',')[0]}, seed {seed}",
             (rf"(?m)^ *\| {re.escape(label)} \| 0 \| (.*) \|$" if seed == 0 else
              rf"(?m)^ *\| {re.escape(label)} \|.*\n(?:.*\n){{{seed - 1}}} *\| \| {seed} \| (.*) \|$"),
             "hypergrad.json", tuning_row(task, seed), text, HYPERGRAD_TUNING)
      for task, label in [(FEDADAM, "FedAdam, MNIST 5k Dirichlet(0.5), 2NN MLP"),
                          (DITTO, "Ditto, label-sorted MNIST 5k, 2NN MLP")] for seed in range(6)],
    Figure("Ditto: seeds within half a point", prose(r"within 0\.5 points of the grid's best on (all six) seeds"),
           "hypergrad.json",
           lambda d: (tuning(d, DITTO)["summary"]["seeds_within_half_a_point"], len(tuning(d, DITTO)["seeds"])),
           count_of, HYPERGRAD_TUNING),
    Figure("Ditto: mean gap", prose(r"seeds \(mean gap (\d\.\d+) points, at most"), "hypergrad.json",
           lambda d: tuning(d, DITTO)["summary"]["gap_points"]["mean"], dec(2), HYPERGRAD_TUNING),
    Figure("Ditto: largest gap", prose(r"points, at most (\d\.\d+)\), FedAdam's"), "hypergrad.json",
           lambda d: tuning(d, DITTO)["summary"]["gap_points"]["max"], dec(1), HYPERGRAD_TUNING),
    Figure("FedAdam: seeds within half a point", prose(r"FedAdam's two learning rates on (\w+ of \w+) \(mean"),
           "hypergrad.json",
           lambda d: (tuning(d, FEDADAM)["summary"]["seeds_within_half_a_point"], len(tuning(d, FEDADAM)["seeds"])),
           count_of, HYPERGRAD_TUNING),
    Figure("FedAdam: mean gap", prose(r"on \w+ of \w+ \(mean (\d\.\d+); seeds"), "hypergrad.json",
           lambda d: tuning(d, FEDADAM)["summary"]["gap_points"]["mean"], dec(2), HYPERGRAD_TUNING),
    Figure("FedAdam: the seeds that miss, and by how much",
           prose(r"\(mean \d\.\d+; (seeds \d+ and \d+ miss by \d\.\d+ and \d\.\d+)\)"), "hypergrad.json",
           missed_seeds(FEDADAM),
           lambda v: f"seeds {' and '.join(str(s) for s, _ in v)} miss by {' and '.join(f'{g:.1f}' for _, g in v)}",
           HYPERGRAD_TUNING),
    Figure("FedAdam seed 3: the grid's best point rerun", prose(r"it gave (\d+\.\d%) instead of \d+\.\d% on seed 3"),
           "hypergrad.json", lambda d: seed_of(d, FEDADAM, 3)["grid_best_rerun_accuracy"], pct(1), HYPERGRAD_TUNING),
    Figure("FedAdam seed 3: the grid's best", prose(r"it gave \d+\.\d% instead of (\d+\.\d%) on seed 3"),
           "hypergrad.json", lambda d: seed_of(d, FEDADAM, 3)["grid_best"]["accuracy"], pct(1), HYPERGRAD_TUNING),
    Figure("FedAdam seed 1: the grid's best point rerun",
           prose(r"on seed 3 and (\d+\.\d%) instead of \d+\.\d% on seed 1"),
           "hypergrad.json", lambda d: seed_of(d, FEDADAM, 1)["grid_best_rerun_accuracy"], pct(1), HYPERGRAD_TUNING),
    Figure("FedAdam seed 1: the grid's best", prose(r"on seed 3 and \d+\.\d% instead of (\d+\.\d%) on seed 1"),
           "hypergrad.json", lambda d: seed_of(d, FEDADAM, 1)["grid_best"]["accuracy"], pct(1), HYPERGRAD_TUNING),
    Figure("FedAdam: the grid picked by validation loss, points below", prose(r"landed (\d\.\d–\d\.\d) points below"),
           "hypergrad.json", lambda d: by_loss_gaps(FEDADAM)(d)[0], span(dec(1)), HYPERGRAD_TUNING),
    Figure("FedAdam: the grid picked by validation loss, seeds", prose(r"points below the best on (\w+ of the \w+) "
                                                                      r"FedAdam seeds"),
           "hypergrad.json", lambda d: (by_loss_gaps(FEDADAM)(d)[1], len(tuning(d, FEDADAM)["seeds"])),
           lambda v: count_of(v).replace(" of ", " of the "), HYPERGRAD_TUNING),
    Figure("Ditto: the grid picked by validation loss", prose(r"\(Ditto: (\d\.\d–\d\.\d on \w+)\)"),
           "hypergrad.json", by_loss_gaps(DITTO), lambda v: f"{span(dec(1))(v[0])} on {WORDS[v[1]]}",
           HYPERGRAD_TUNING),
    Figure("FedAdam: the last whole-run step's mean gap", prose(r"mean gaps of (\d\.\d+) \(FedAdam\)"),
           "hypergrad.json", last_step_mean_gap(FEDADAM), dec(2), HYPERGRAD_TUNING),
    Figure("Ditto: the last whole-run step's mean gap", prose(r"\(FedAdam\) and (\d\.\d+) \(Ditto\), and online"),
           "hypergrad.json", last_step_mean_gap(DITTO), dec(2), HYPERGRAD_TUNING),
    Figure("Ditto seed 3: the online last iterate", prose(r"\(Ditto seed 3, (\d+\.\d%); its tail"),
           "hypergrad.json", lambda d: seed_of(d, DITTO, 3)["online_last"]["accuracy"], pct(1), HYPERGRAD_TUNING),
    Figure("Ditto seed 3: the online tail average", prose(r"its tail average (\d+\.\d%), the whole-run"),
           "hypergrad.json", lambda d: seed_of(d, DITTO, 3)["online_average"]["accuracy"], pct(1), HYPERGRAD_TUNING),
    Figure("Ditto seed 3: the tuned result", prose(r"the whole-run steps then (\d+\.\d%)\)\."),
           "hypergrad.json", lambda d: seed_of(d, DITTO, 3)["tune_accuracy"], pct(1), HYPERGRAD_TUNING),
    Figure("the protocol's rounds over the grid's", prose(r"holds in rounds \((\d+%) of the grid\)"),
           "hypergrad.json",
           lambda d: one(s["tune_rounds_trained"] / s["grid_rounds_trained"]
                         for t in d["tuning"] for s in t["seeds"]),
           pct(0), HYPERGRAD_TUNING),
    *[Figure(f"{name}: {what} seconds", prose(pattern), "hypergrad.json", seconds_range(task, key), span(integer),
             HYPERGRAD_TUNING)
      for name, task, what, key, pattern in [
          ("FedAdam", FEDADAM, "tuning", "tune_seconds", r"on the CPU: (\d+–\d+) s against \d+–\d+ s for FedAdam"),
          ("FedAdam", FEDADAM, "grid", "grid_seconds", r"on the CPU: \d+–\d+ s against (\d+–\d+) s for FedAdam"),
          ("Ditto", DITTO, "tuning", "tune_seconds", r"for FedAdam, (\d+–\d+) s against \d+–\d+ s for Ditto"),
          ("Ditto", DITTO, "grid", "grid_seconds", r"for FedAdam, \d+–\d+ s against (\d+–\d+) s for Ditto")]],
    Figure("offline from the start: Adam steps", prose(r"\(seed 0, (\d+) Adam steps of \d\.\d+ through"),
           "hypergrad.json", lambda d: one(t["seeds"][0]["offline_from_start"]["outer_steps"] for t in d["tuning"]),
           str, HYPERGRAD_TUNING),
    Figure("offline from the start: Adam step size", prose(r"\(seed 0, \d+ Adam steps of (\d\.\d+) through"),
           "hypergrad.json", lambda d: one(t["seeds"][0]["offline_from_start"]["adam"] for t in d["tuning"]),
           lambda v: f"{v:g}", HYPERGRAD_TUNING),
    Figure("offline from the start: rounds", prose(r"through the whole run, ([\d,]+) rounds\) reached"),
           "hypergrad.json",
           lambda d: one(t["seeds"][0]["offline_from_start"]["rounds_trained"] for t in d["tuning"]), integer,
           HYPERGRAD_TUNING),
    Figure("offline from the start: accuracies", prose(r"rounds\) reached (\d+\.\d% and \d+\.\d%),"),
           "hypergrad.json",
           lambda d: [seed_of(d, task, 0)["offline_from_start"]["accuracy"] for task in (FEDADAM, DITTO)],
           pair(pct(1)), HYPERGRAD_TUNING),
    Figure("earlier protocol, H100: rounds", prose(r"\(the online last iterate, (\d+) rounds\) on an NVIDIA H100"),
           "hypergrad.json",
           lambda d: one(r["tune_rounds_trained"] for run in d["earlier_tuning_nvidia_h100"]["runs"] for r in run),
           str, HYPERGRAD, H100_NOTE),
    Figure("earlier protocol, H100: FedAdam tuned", prose(r"twice: FedAdam (\d+\.\d% and \d+\.\d%) against"),
           "hypergrad.json", earlier_h100(FEDADAM, "tune_accuracy"), pair(pct(1)), HYPERGRAD, H100_NOTE),
    Figure("earlier protocol, H100: FedAdam's grid", prose(r"against the grid's (\d+\.\d% and \d+\.\d%), Ditto"),
           "hypergrad.json", earlier_h100(FEDADAM, "grid"), pair(pct(1)), HYPERGRAD, H100_NOTE),
    Figure("earlier protocol, H100: Ditto tuned", prose(r"Ditto (\d+\.\d%) twice against"),
           "hypergrad.json", lambda d: set(earlier_h100(DITTO, "tune_accuracy")(d)),
           lambda v: pct(1)(v.pop()) if len({pct(1)(x) for x in v}) == 1 else str(sorted(v)), HYPERGRAD, H100_NOTE),
    Figure("earlier protocol, H100: Ditto's grid", prose(r"twice against (\d+\.\d%)\s+\(`earlier_tuning"),
           "hypergrad.json", lambda d: set(earlier_h100(DITTO, "grid")(d)),
           lambda v: pct(1)(v.pop()) if len({pct(1)(x) for x in v}) == 1 else str(sorted(v)), HYPERGRAD, H100_NOTE),
    # -- hyper-gradient memory, H100 (hypergrad.json) and CPU (hypergrad_memory.json)
    Figure("H100: a forward run", prose(r"a forward run of any R holds (\d+\.\d) MiB;"), "hypergrad.json",
           mem_all("forward", "total"), span(mib(1)), HYPERGRAD),
    Figure("H100: reverse, no checkpointing, R = 25", prose(r"without checkpointing (\d+(?:\.\d)?) GiB at R = 25"),
           "hypergrad.json", mem("reverse, none", 25), gib(1), HYPERGRAD),
    Figure("H100: reverse, no checkpointing, R = 200", prose(r"GiB at R = 25 and (\d+) GiB at R = 200;"),
           "hypergrad.json", mem("reverse, none", 200), gib(0), HYPERGRAD),
    Figure("H100: per-round checkpoints, R = 25", prose(r"per round (\d+) MiB at R = 25 and"), "hypergrad.json",
           mem("reverse, round", 25), mib(0), HYPERGRAD),
    Figure("H100: per-round checkpoints, R = 200", prose(r"MiB at R = 25 and (\d+) MiB at R = 200 \(R states"),
           "hypergrad.json", mem("reverse, round", 200), mib(0), HYPERGRAD),
    Figure("H100: √R blocks, R = 25 and 200", prose(r"\(`checkpoint=\"sqrt\"`\) (\d+ and \d+) MiB,"),
           "hypergrad.json", lambda d: [mem("reverse, sqrt", r)(d) for r in (25, 200)], pair(mib(0)), HYPERGRAD),
    Figure("H100: √R blocks over the forward run", prose(r"MiB, (\d\.\d–\d\.\d×) the forward run;"),
           "hypergrad.json", mem_all("reverse, sqrt", "vs_forward"), span(times(1), lo_fmt=dec(1)), HYPERGRAD),
    Figure("H100: forward mode", prose(r"two hyper-parameters\) (\d+) MiB at any R"), "hypergrad.json",
           mem_all("forward mode", "total"), span(mib(0)), HYPERGRAD),
    Figure("CPU: a forward run", prose(r"where the forward run holds (\d+\.\d) MiB,"), "hypergrad_memory.json",
           mem_all("forward", "total"), span(mib(1)), HYPERGRAD_MEMORY),
    Figure("CPU: per-round checkpoints, R = 200", prose(r"R = 200 takes (\d+) MiB with per-round"),
           "hypergrad_memory.json", mem("reverse, round", 200), mib(0), HYPERGRAD_MEMORY),
    Figure("CPU: per-round checkpoints and local steps, R = 200", prose(r"checkpoints, (\d+) MiB with the local steps"),
           "hypergrad_memory.json", mem("reverse, round + local steps", 200), mib(0), HYPERGRAD_MEMORY),
    Figure("CPU: √R blocks, R = 200", prose(r"(\d+) → \d+ MiB \(\d\.\d×\) with √R blocks"),
           "hypergrad_memory.json", mem("reverse, sqrt", 200), mib(0), HYPERGRAD_MEMORY),
    Figure("CPU: √R blocks and local steps, R = 200", prose(r"\d+ → (\d+) MiB \(\d\.\d×\) with √R blocks"),
           "hypergrad_memory.json", mem("reverse, sqrt + local steps", 200), mib(0), HYPERGRAD_MEMORY),
    Figure("CPU: √R blocks and local steps over the forward run", prose(r"\d+ → \d+ MiB \((\d\.\d×)\) with √R"),
           "hypergrad_memory.json", mem("reverse, sqrt + local steps", 200, "vs_forward"), times(1), HYPERGRAD_MEMORY),
    Figure("CPU: ∛R blocks and local steps, R = 200", prose(r"and (\d+\.\d) MiB \(\d\.\d×\) with "
                                                           r"`checkpoint=\"cbrt\"`"),
           "hypergrad_memory.json", mem("reverse, cbrt + local steps", 200), mib(1), HYPERGRAD_MEMORY),
    Figure("CPU: ∛R blocks over the forward run", prose(r"MiB \((\d\.\d×)\) with `checkpoint=\"cbrt\"`"),
           "hypergrad_memory.json", mem("reverse, cbrt + local steps", 200, "vs_forward"), times(1), HYPERGRAD_MEMORY),
    # -- robustness
    Figure("the mean: the attackers that bring it to chance", prose(r"the mean fell to chance under (\d+%) omniscient"),
           "robustness.json", rob_to_chance("mean", "omniscient"), pct(0), ROBUSTNESS),
    Figure("mean-around-median: 40% omniscient", prose(r"mean-around-median kept (\d+\.\d%) \(attack-free"),
           "robustness.json", rob_at("mean_around_median", "omniscient", 0.4), pct(1), ROBUSTNESS),
    Figure("the mean, attack-free", prose(r"\(attack-free (\d+\.\d%)\) with"), "robustness.json",
           rob_at("mean", "omniscient", 0.0), pct(1), ROBUSTNESS),
    Figure("mean-around-median: the attackers", prose(r"\(attack-free \d+\.\d%\) with (\d+%) of them"),
           "robustness.json", lambda d: max(rob(d, "mean_around_median", "omniscient")["fractions"]), pct(0),
           ROBUSTNESS),
    Figure("mean-around-median: dimensional omniscient", prose(r"of them and (\d+–\d+%) under the dimensional"),
           "robustness.json", rob_range("mean_around_median", "dimensional_omniscient"),
           span(pct(0), lo_fmt=pct_bare(0)), ROBUSTNESS),
    # -- Benchmarks: the accelerator script's overhead part
    Figure("bytes over a plain vmap, 2NN MLP", prose(r"our round accesses (\d\.\d+×) \(2NN MLP"),
           "accelerator_cpu_overhead.json", overhead("W-MLP", "bytes_ratio"), span(times(2)), ACCELERATOR_OVERHEAD),
    Figure("client counts, 2NN MLP", prose(r"\(2NN MLP, C = ([\d,]+–[\d,]+)\)"), "accelerator_cpu_overhead.json",
           overhead("W-MLP", "C"), span(integer), ACCELERATOR_OVERHEAD),
    Figure("bytes over a plain vmap, logistic regression", prose(r"\) and (\d\.\d+×) \(logistic"),
           "accelerator_cpu_overhead.json", overhead("W-LR", "bytes_ratio"), span(times(2)), ACCELERATOR_OVERHEAD),
    Figure("client counts, logistic regression", prose(r"\(logistic regression, C = ([\d,]+, [\d,]+)\)"),
           "accelerator_cpu_overhead.json", overhead("W-LR", "C"), pair(integer, ", "), ACCELERATOR_OVERHEAD),
    Figure("kernels over a plain vmap", prose(r"it launches (\d\.\d–\d\.\d×) the kernels"),
           "accelerator_cpu_overhead.json", overhead(None, "kernels"), span(times(1), lo_fmt=dec(1)),
           ACCELERATOR_OVERHEAD),
    # -- The main job: start-up (driver_overhead.py --part startup)
    Figure("start-up: first line", prose(r"printed its first line after (\d+\.\d) s"), "driver_startup.json",
           startup("first_line_seconds"), dec(1), STARTUP),
    Figure("start-up: first progress line", prose(r"first progress line after (\d+\.\d) s"), "driver_startup.json",
           startup("first_progress_seconds"), dec(1), STARTUP),
    Figure("start-up: compile seconds, FedAvg and FedAdam", prose(r"FedAdam in (\d+\.\d) s each"),
           "driver_startup.json", lambda d: {dec(1)(startup("compile_seconds", a)(d)) for a in ("fedavg", "fedadam")},
           lambda v: v.pop() if len(v) == 1 else str(sorted(v)), STARTUP),
    Figure("start-up: total", prose(r"ended after (\d+\.\d) s \(`python"), "driver_startup.json",
           startup("total_seconds"), dec(1), STARTUP),
    # -- The main job: FedMA against FedAvg, compute-fair (clustered.py --part d)
    Figure("FedMA over FedAvg, MNIST 5k MLP", prose(r"FedMA led FedAvg by (\+\d\.\d+) on MNIST"), "clustered.json",
           fair("mnist5k_mlp"), lambda v: f"{v:+.3f}", FEDMA_FAIR),
    Figure("FedMA under FedAvg, digits", prose(r"trailed it by (\d\.\d+) on digits"), "clustered.json",
           fair("digits_mlp"), lambda v: f"{-v:.3f}", FEDMA_FAIR),
    Figure("FedMA against FedAvg: seeds", prose(r"on digits, means of (\d+) seeds"), "clustered.json",
           lambda d: one(len(d["fedma_fair"][c]["seeds"]) for c in ("mnist5k_mlp", "digits_mlp")), str,
           FEDMA_FAIR),
    Figure("FedMA against FedAvg: minutes", prose(r"`python benchmarks/clustered\.py --part d`, about (\d+) minutes"),
           "clustered.json", lambda d: d["part_seconds"]["d"] / 60, integer, FEDMA_FAIR),
]


# Figure-like numbers of the scope that are not results: a benchmark's settings and thresholds.
SETTINGS: list[tuple[str, str]] = [
    (prose(r"Dirichlet\((0\.[15])\)"), "the split's concentration, a setting"),
    (r"(?<![\d.])(1e-4)(?![\d])", "the target relative gap, a setting"),
    (prose(r"the worst (\d+%) of clients"), "the worst 10%: the 10th percentile that is reported"),
    (prose(r"the (5×)5 `fo\.sweep` grid"), "the grid's size"),
    (prose(r"\| (5×)5 grid, best \|"), "the grid's size, a column heading"),
    (prose(r"land within (0\.5) points"), "the threshold of seeds_within_half_a_point"),
    (prose(r"amplified by FedAdam at client lr (0\.3)\)"), "the grid's client lr 0.316, named"),
    (prose(r"cannot stay within (3×) at R = 200"), "a bound the sentence compares with, not a measurement"),
    (prose(r"No rule held against (40%) inner-product"), "the attackers' fraction, a setting"),
    (prose(r"at 0/10/20/(40%) attackers"), "the attackers' fractions, settings"),
    (prose(r"with 0/50/(90%) stragglers"), "the stragglers' fractions, settings"),
    (prose(r"with (20%) sign-flipping clients"), "the attackers' fraction, a setting"),
]

# Results in the scope with no committed JSON: they come from `fedjax-opt run` (its results.json is written to
# the run folder, not to benchmarks/results/).
UNCHECKED: list[tuple[str, str]] = [
    (prose(r"FedMA reached (0\.\d+) test accuracy"), "fedjax-opt run --algorithms fedma,fedavg --rounds 10"),
    (prose(r"and FedAvg (0\.\d+) for the same"), "fedjax-opt run --algorithms fedma,fedavg --rounds 10"),
    (prose(r"for the same (\d+\.\d) MB sent"), "fedjax-opt run --algorithms fedma,fedavg --rounds 10"),
]


# ---- the tests ------------------------------------------------------------------------------------------------

def _only_match(pattern: str) -> re.Match:
  matches = list(re.finditer(pattern, readme()))
  assert len(matches) == 1, f"{pattern!r} matches the README {len(matches)} times, not once"
  return matches[0]


@pytest.mark.parametrize("figure", FIGURES, ids=[f.name for f in FIGURES])
def test_readme_figure_is_the_json(figure: Figure):
  printed = " ".join(_only_match(figure.where).group(1).split())  # a figure may wrap across lines
  expected = figure.fmt(figure.value(load(figure.json)))
  assert printed == expected, (f"README prints {figure.name} as {printed!r}; benchmarks/results/{figure.json} "
                               f"gives {expected!r} (regenerate with `{figure.command}`"
                               + (f"; {figure.note})" if figure.note else ")"))


def test_figures_are_distinct():
  spans = sorted((_only_match(f.where).span(1), f.name) for f in FIGURES)
  for (a, name_a), (b, name_b) in zip(spans, spans[1:]):
    assert a[1] <= b[0], f"{name_a!r} and {name_b!r} locate overlapping text"


def _literal(node: ast.AST, names: dict[str, Any]) -> Any:
  """A literal of a script's source, following module-level constants and `*NAME` unpacking."""
  if isinstance(node, ast.Name):
    return names[node.id]
  if isinstance(node, (ast.Tuple, ast.List)):
    out = []
    for element in node.elts:
      if isinstance(element, ast.Starred):
        out.extend(_literal(element.value, names))
      else:
        out.append(_literal(element, names))
    return out
  return ast.literal_eval(node)


@functools.lru_cache(maxsize=None)
def script_parser(script: str) -> argparse.ArgumentParser:
  """The script's command line, rebuilt from the `add_argument` calls of its source (nothing is imported)."""
  tree = ast.parse((ROOT / script).read_text(encoding="utf-8"))
  names: dict[str, Any] = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
      try:
        names[node.targets[0].id] = _literal(node.value, names)
      except (ValueError, KeyError, TypeError, SyntaxError):
        pass
  parser = argparse.ArgumentParser(prog=script, add_help=False, exit_on_error=False)
  found = 0
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
      continue
    flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
    kwargs: dict[str, Any] = {}
    for kw in node.keywords:
      if kw.arg in ("action", "nargs"):
        kwargs[kw.arg] = ast.literal_eval(kw.value)
      elif kw.arg == "choices":
        try:
          kwargs["choices"] = list(_literal(kw.value, names))
        except (ValueError, KeyError, TypeError):
          pass  # computed choices: any value is accepted here
      elif kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float"):
        kwargs["type"] = {"int": int, "float": float}[kw.value.id]
    parser.add_argument(*flags, **kwargs)
    found += 1
  assert found, f"{script} has no argparse arguments"
  return parser


COMMANDS = sorted({f.command for f in FIGURES})


@pytest.mark.parametrize("command", COMMANDS)
def test_benchmark_commands_parse(command: str):
  python, script, *argv = shlex.split(command)
  assert python == "python" and script.startswith("benchmarks/") and (ROOT / script).is_file(), command
  try:
    _, unknown = script_parser(script).parse_known_args(argv)
  except (argparse.ArgumentError, SystemExit) as err:
    pytest.fail(f"`{command}`: {err}")
  assert not unknown, f"`{command}`: {script} does not take {unknown}"


def test_the_command_parser_rejects_what_the_script_does():
  """The rebuilt parsers are strict: a misspelt flag or an unknown choice is refused."""
  parser = script_parser("benchmarks/hypergrad.py")
  assert parser.parse_known_args(["--part", "tuning"])[1] == []
  assert parser.parse_known_args(["--parts", "tuning"])[1] == ["--parts", "tuning"]
  with pytest.raises((argparse.ArgumentError, SystemExit)):
    parser.parse_known_args(["--part", "tunning"])
  clustered = script_parser("benchmarks/clustered.py")  # choices=("all", *PARTS), PARTS a module-level dict
  assert clustered.parse_known_args(["--part", "d"])[1] == []
  with pytest.raises((argparse.ArgumentError, SystemExit)):
    clustered.parse_known_args(["--part", "z"])


# A figure-like number: a decimal, scientific notation, a percentage or a ratio (integers are not required).
NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[+-]?\d+)?(?:%|×)?")


def _is_figure(token: str) -> bool:
  return "." in token or "e" in token or token.endswith(("%", "×"))


def scope_spans() -> list[tuple[int, int]]:
  """The README's text checked for unchecked figures (see the module docstring)."""
  text = readme()
  heads = [(m.start(), m.group(1).strip()) for m in re.finditer(r"(?m)^## (.*)$", text)] + [(len(text), "")]
  sections = {title: (start, end) for (start, title), (end, _) in zip(heads, heads[1:])}
  spans = [sections["Which algorithm should I use?"], sections["Benchmarks"]]
  start, end = sections["The main job"]
  job = text[start:end]
  hidden = [m.span() for m in re.finditer(r"(?s)```.*?```|<!-- flags:start -->.*?<!-- flags:end -->", job)]
  cut = 0
  for sentence in re.split(r"(?<=\.)\s+(?=[A-Z(`])", job):
    s = job.index(sentence, cut)
    cut = s + len(sentence)
    prose = sentence.split("```", 1)[0]  # a sentence ends where a code block starts (the block is output)
    if "benchmarks/" in prose and not any(a <= s < b for a, b in hidden):
      spans.append((start + s, start + s + len(prose)))
  return spans


def test_every_figure_in_scope_is_checked():
  covered = [_only_match(f.where).span(1) for f in FIGURES]
  for pattern, _ in SETTINGS + UNCHECKED:
    covered += [m.span(1) for m in re.finditer(pattern, readme())]
  unchecked = []
  for start, end in scope_spans():
    for m in NUMBER.finditer(readme(), start, end):
      if _is_figure(m.group()) and not any(a <= m.start() and m.end() <= b for a, b in covered):
        line = readme().count("\n", 0, m.start()) + 1
        unchecked.append(f"README.md:{line}: {m.group()!r} in …{readme()[max(0, m.start() - 40):m.end() + 20]!r}")
  assert not unchecked, ("figures with no check in tests/test_readme_figures.py (add a Figure reading its "
                         "benchmarks/results JSON, or a SETTINGS / UNCHECKED entry):\n" + "\n".join(unchecked))


def test_the_scope_holds_the_sections_it_names():
  spans = scope_spans()
  assert len(spans) >= 4  # the two sections and the two benchmark sentences of the main job
  scoped = "".join(readme()[a:b] for a, b in spans)
  for marker in ("heterogeneity.py", "benchmarks/driver_overhead.py --part startup",
                 "benchmarks/clustered.py --part d", "accelerator.py --part overhead"):
    assert marker in scoped, marker


@pytest.mark.parametrize("pattern, why", SETTINGS + UNCHECKED)
def test_exemptions_are_current(pattern: str, why: str):
  assert re.search(pattern, readme()), f"{pattern!r} ({why}) no longer matches the README: drop it"
