"""What a run shows: the results table and the plots."""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["Interrupted", "curve_styles", "epsilon_text", "figures", "integer_axis", "legend_label", "plain_formatter",
           "plain_log_axis", "plain_number", "plot_all", "results_table", "running_mean", "significant",
           "tick_labels", "title"]


class Interrupted(Exception):
  """Ctrl-C while `algorithm` trained; its last completed chunk is checkpointed."""

  def __init__(self, algorithm: str):
    super().__init__(algorithm)
    self.algorithm = algorithm


def _cell(row: dict[str, Any], key: str, spec: str = ".4f") -> str:
  """`0.8123`, `0.8123 ± 0.0040` for a sweep, `–` when the row has no such value (the progress lines' format)."""
  # Imported here: fedjax_opt.train starts JAX, which `--help` and the usage errors do without.
  from fedjax_opt.train.progress import format_value  # pylint: disable=import-outside-toplevel

  value = row.get(key)
  if isinstance(value, list):
    value = sum(value) / len(value)
  return format_value(value, row.get(key + "_std"), spec)


def _missing() -> str:
  from fedjax_opt.train.progress import MISSING  # pylint: disable=import-outside-toplevel

  return MISSING


def _count(row: dict[str, Any], key: str) -> str:
  """A count, the largest over seeds for a sweep; `–` when the row has none."""
  value = row.get(key)
  if value is None:
    return _missing()
  return str(value if isinstance(value, int) else max(value))


def _spread(row: dict[str, Any], key: str, spec: str) -> str:
  """`min/median/max` of `key_min`, `key_median`, `key_max` (`-` for a missing or None value)."""
  if key + "_median" not in row:
    return "-"
  return "/".join("-" if row.get(f"{key}_{s}") is None else f"{row[f'{key}_{s}']:{spec}}"
                  for s in ("min", "median", "max"))


EPSILON_DIGITS = 4
"""Significant digits of the table's ε (more where the value is not its target but would print as it)."""


def significant(value: float, digits: int) -> str:
  """`value` to `digits` significant digits, trailing zeros kept (`8.000`, `0.5000`, `12.35`, `1,235`)."""
  import math

  if not math.isfinite(value) or value == 0:
    return f"{value:g}"
  decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
  text = f"{value:,.{decimals}f}"
  if float(text.replace(",", "")) != 0 and math.floor(math.log10(abs(float(text.replace(",", ""))))) > \
      math.floor(math.log10(abs(value))):  # rounded up to the next power of ten (9.9996 → 10.000): one less decimal
    text = f"{value:,.{max(0, decimals - 1)}f}"
  return text


def epsilon_text(epsilon: float, target: float | None = None) -> str:
  """ε to `EPSILON_DIGITS` significant digits; with a target ε (`--dp-epsilon`) that ε is not, as many more as it
  takes not to print it as the target (7.9998 → `7.9998`, not `8.000`), up to 10."""
  text = significant(epsilon, EPSILON_DIGITS)
  if target is not None and epsilon != target:
    for digits in range(EPSILON_DIGITS, 11):
      text = significant(epsilon, digits)
      if text != significant(target, digits):
        break
  return text


def results_table(rows: list[dict[str, Any]]) -> str:
  """The table printed at the end of a run (columns for personalized and objective values when present)."""
  columns = [("algorithm", lambda r: r["algorithm"]), ("rounds", lambda r: str(r["rounds"])),
             ("test acc", lambda r: _cell(r, "test_accuracy")), ("test loss", lambda r: _cell(r, "test_loss")),
             ("train loss", lambda r: _cell(r, "train_loss"))]
  if any("personalized_accuracy" in r for r in rows):
    columns += [("pers. acc", lambda r: _cell(r, "personalized_accuracy")),
                ("pers. p10", lambda r: _cell(r, "personalized_accuracy_p10"))]
  if any("ari" in r for r in rows):
    columns.append(("clusters", lambda r: _count(r, "num_clusters")))
    if any(_count(r, "unassigned_clients") not in (_missing(), "0") for r in rows):  # IFCA: clients never sampled
      columns.append(("unassigned", lambda r: _count(r, "unassigned_clients")))
    columns.append(("ARI", lambda r: _cell(r, "ari", ".3f")))
  if any("objective_gap" in r for r in rows):
    columns.append(("obj. gap", lambda r: _cell(r, "objective_gap", ".2e")))
  if any("dp_epsilon" in r for r in rows):
    columns.append(("ε", lambda r: _missing() if r.get("dp_epsilon") is None else
                    epsilon_text(r["dp_epsilon"], (r.get("privacy") or {}).get("target_epsilon"))))
  if any("consensus_distance" in r for r in rows):
    columns.append(("consensus", lambda r: _cell(r, "consensus_distance", ".2e")))
  if any("simulated_time" in r for r in rows):
    columns.append(("sim. time", lambda r: _cell(r, "simulated_time", ",.1f")))
  if any("true_belief_median" in r for r in rows):
    columns += [("θ* belief", lambda r: _spread(r, "true_belief", ".3f")),
                ("rounds to θ*", lambda r: _spread(r, "rounds_to_concentrate", "g"))]
  if any("bits_up" in r for r in rows):
    columns.append(("bits up", lambda r: _missing() if r.get("bits_up") is None else f"{r['bits_up']:,.0f}"))
  columns += [("MB sent", lambda r: f"{r['megabytes_sent']:,.3f}" if r["megabytes_sent"] < 1 else f"{r['megabytes_sent']:,.1f}"), ("compile s", lambda r: f"{r.get('compile_seconds', float('nan')):.1f}"),
              ("wall s", lambda r: f"{r['wall_seconds']:.1f}"),
              ("status", lambda r: r["status"])]
  header = tuple(c[0] for c in columns)
  lines = [header] + [tuple(fn(r) for _, fn in columns) for r in rows]
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

  def fmt(line):
    return "  ".join(cell.ljust(w) if i in (0, len(line) - 1) else cell.rjust(w)
                     for i, (cell, w) in enumerate(zip(line, widths))).rstrip()

  rule = "-" * len(fmt(header))
  notes = [f"{r['algorithm']} {r['status']}: {r.get('diverged_reason') or r['degraded_reason']}" for r in rows
           if r.get("diverged_reason") or r.get("degraded_reason")]
  if any("true_belief_median" in r for r in rows):
    notes.append("θ* belief: each node's belief on the true candidate (p2p_bayes: the fit) after the last round; "
                 "rounds to θ*: the round from which it stays above p2p_bayes.concentration (default 0.99; - never); "
                 "min/median/max over nodes")
  private = [r for r in rows if r.get("privacy")]
  if private:
    p = private[0]["privacy"]
    notes.append(f"ε: client-level (ε, δ={p['delta']:g})-DP after {private[0]['rounds']} rounds, {p['accountant']} "
                 f"accountant, {p['sampling']}, noise multiplier {p['noise_multiplier']:.4g} "
                 f"({p['neighboring_relation']}); see docs/privacy.md for what it covers")
  if any("bits_up" in r for r in rows):
    notes.append("bits up: the bits one client uploads a round (the run's bits_up metric, the compressor's count; "
                 "mean over rounds); MB sent counts them and each round's broadcast")
  secure = [r for r in rows if r.get("secure_upload_bits") is not None]
  if secure:
    notes.append(f"secure aggregation: each client uploaded {secure[0]['secure_upload_bits']:,.0f} bits in the last "
                 f"round with the protocol's masked words, keys and shares (secure_upload_bits in results.json)")
  return "\n".join([fmt(header), rule] + [fmt(line) for line in lines[1:]] + ([""] + notes if notes else []))


def _local_work(name: str, config: dict[str, Any]) -> str:
  """What algorithm `name` does per round with the run's flags: `5/round, 10 steps × batch 20`, or for the
  families that ignore some of them, what they do instead."""
  from fedjax_opt.cli import registry

  sampling = registry.REGISTRY[name].sampling if name in registry.REGISTRY else "clients"
  steps = f"{config['local_steps']} steps × batch {config['batch_size']}"
  if sampling == "clients":
    return f"{config['clients_per_round']}/round, {steps}"
  if sampling == "events":
    return f"{config['clients_per_round']} in flight, {steps}"
  if sampling in ("nodes", "all"):
    return f"every client, {steps}"
  return "every client, full batch"  # "full", "full_fixed": the whole train split every round


def title(config: dict[str, Any], dataset, names: list[str] | None = None) -> str:
  """`mnist5k, dirichlet(α=0.5), 100 clients, 10/round, 10 steps × batch 20, client lr 0.05, seed 0`.

  The local work is each algorithm's (`_local_work`): one phrase when every algorithm of `names` (default: the
  run's) does the same, else one per group (`fedavg: 10/round, ...; l2gd: every client, full batch`). A run with
  decentralized algorithms names its topology.
  """
  from fedjax_opt.cli import privacy, registry, trust

  split = ""
  if config.get("partition"):
    split = config["partition"] + (f"(α={config['alpha']:g})" if config["partition"] == "dirichlet" else "")
    split += ", "
  seeds = f"seeds {config['seed']}…{config['seed'] + config['seeds'] - 1}" if config["seeds"] > 1 else \
      f"seed {config['seed']}"
  robust = ""
  if config.get("aggregator"):
    robust += f", aggregator {config['aggregator']}"
  if config.get("attack"):
    robust += f", attack {config['attack']} ({config['attackers']:.0%} of clients)"
  names = names if names is not None else [n for n in str(config.get("algorithms", "")).split(",") if n]
  groups: dict[str, list[str]] = {}
  for name in names:
    groups.setdefault(_local_work(name, config), []).append(name)
  if len(groups) <= 1:
    work = next(iter(groups), _local_work("", config))
  else:
    work = "; ".join(f"{', '.join(group)}: {phrase}" for phrase, group in groups.items())
  topology = ""
  if config.get("topology") and any(registry.REGISTRY[n].family == "decentralized" for n in names
                                    if n in registry.REGISTRY):
    topology = f", {config['topology']} topology"
  return (f"{config['dataset']}, {split}{dataset.num_clients} clients, {work}{topology}"
          + (f", client lr {config['client_lr']:g}" if config["client_lr"] is not None else "") + f", {seeds}"
          + robust + privacy.describe(config) + trust.describe(config))


LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
"""Curve i is drawn with (LINESTYLES[i % 4], MARKERS[i % 7]), hollow markers and a line that thins with i: 28
distinct pairs, and a curve drawn over an earlier one that it coincides with (FedAvg and Ditto's global model)
leaves the earlier one's wider line and other marker in sight."""


def curve_styles(keys: list) -> dict:
  """A distinct (linestyle, marker) pair and a color for each key, in order."""
  return {key: {"ls": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)],
                "color": f"C{i % 10}", "mfc": "none", "lw": max(1.0, 2.4 - 0.4 * i)} for i, key in enumerate(keys)}


def _series(ax, x, values, name: str, **style):
  """One line; for a sweep (values [K, ...]) the mean over seeds with a ± std band. Returns the line."""
  import numpy as np

  values = np.asarray(values, np.float64)
  x = np.asarray(x, np.float64)
  if len(x) > 12 and "marker" in style:  # a marker every few points: dense curves stay readable
    style = dict(style, markevery=max(1, len(x) // 10))
  if values.ndim == 1:
    line, = ax.plot(x, values, label=name, **style)
    return line
  mean, std = values.mean(0), values.std(0)
  line, = ax.plot(x, mean, label=f"{name} (mean ± std, {values.shape[0]} seeds)", **style)
  ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.25, lw=0)
  return line


def legend_label(row: dict[str, Any]) -> str:
  """`ditto (lam=0.1, eta=0.05, ...)`: the algorithm and its numeric hyper-parameters; then, where they apply, the
  run's ε (`; ε = 7.9998`, differential privacy) and a status other than finished (`; diverged at round 3`)."""
  hyper = row.get("hyper_parameters", {})
  shown = [f"{k}={v:g}" for k, v in hyper.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
  label = f"{row['algorithm']} ({', '.join(shown)})" if shown else row["algorithm"]
  if row.get("dp_epsilon") is not None:
    label += f"; ε = {epsilon_text(row['dp_epsilon'], (row.get('privacy') or {}).get('target_epsilon'))}"
  if row.get("status", "finished") != "finished":
    label += f"; {row['status'].split(' (seen')[0]}"
  return label


def _empty_panels(axes, rows: list[dict[str, Any]], what: str) -> None:
  """A note in each panel of `axes` that has no curve: which runs diverged (and when), else that none reported
  `what`."""
  gone = [f"{r['algorithm']} {r['status'].split(' (seen')[0]}" for r in rows
          if str(r.get("status", "")).startswith("diverged")]
  for ax in axes:
    if not ax.get_legend_handles_labels()[0] and not ax.texts:
      _note(ax, "no curve: " + ("; ".join(gone) + " before its first evaluation" if gone else f"no {what}"))


def _eval_points(history, metric: str):
  try:
    return history.eval_series(metric)
  except KeyError:
    return None


def plain_number(value: float, _position=None, digits: int = 3) -> str:
  """A tick label without mathtext powers, to `digits` significant digits, trailing zeros dropped: `2.14`, `0.05`,
  `1,000`, `25,000` (thousands separated as in the table), `1e-05` below 1e-4."""
  import math

  if value == 0 or not math.isfinite(value):
    return f"{value:g}"
  if abs(value) < 1e-4:
    return f"{value:.{digits}g}"
  decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
  text = f"{value:,.{decimals}f}"
  return text.rstrip("0").rstrip(".") if "." in text else text


def tick_labels(values) -> list[str]:
  """Labels for the ticks `values` that tell them apart and say where they are (each within 1 % of the least gap
  between two ticks): `plain_number`'s 3 significant digits where they do (`0.5`, `1`, `2`, `1,000`), else the
  fewest decimals that do, the same for every tick (`2.3000`, `2.3025`, `2.3050`: a tiny range)."""
  import math

  values = [float(v) for v in values]
  finite = sorted({v for v in values if math.isfinite(v)})
  gaps = [b - a for a, b in zip(finite, finite[1:])]
  tolerance = 0.01 * min(gaps) if gaps else math.inf

  def fits(labels):
    return len(set(labels)) == len(set(values)) and all(
        not math.isfinite(v) or abs(float(text.replace(",", "")) - v) <= tolerance for v, text in zip(values, labels))

  labels = [plain_number(v) for v in values]
  if fits(labels):
    return labels
  for decimals in range(0, 13):
    labels = [f"{v:,.{decimals}f}" if math.isfinite(v) else f"{v:g}" for v in values]
    if fits(labels):
      return labels
  return [repr(v) if math.isfinite(v) else f"{v:g}" for v in values]


def plain_formatter():
  """A matplotlib tick formatter of `tick_labels`: plain numbers with thousands separators, enough digits to tell
  the ticks apart."""
  import matplotlib.ticker

  class PlainFormatter(matplotlib.ticker.Formatter):
    """`tick_labels` of the axis's ticks (`set_locs`), each looked up by its value."""

    def __init__(self):
      self.labels: dict[float, str] = {}

    def set_locs(self, locs):
      super().set_locs(locs)
      self.labels = dict(zip((float(v) for v in locs), tick_labels(locs)))

    def __call__(self, x, pos=None):
      return self.labels.get(float(x), plain_number(x))

  return PlainFormatter()


def integer_axis(axis) -> None:
  """An axis of rounds: ticks on whole numbers only (never 2.5 or 1.975), labelled as `tick_labels` does."""
  import matplotlib.ticker

  axis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  axis.set_major_formatter(plain_formatter())


def running_mean(values, window: int):
  """The trailing running mean over `window` points along the last axis (`[R]` or a sweep's `[K, R]`): point i is
  the mean of points max(0, i − window + 1) … i."""
  import numpy as np

  values = np.asarray(values, np.float64)
  if window <= 1:
    return values
  sums = np.cumsum(values, axis=-1)
  shifted = np.concatenate([np.zeros(values.shape[:-1] + (window,)), sums[..., :-window]], axis=-1)
  counts = np.minimum(np.arange(1, values.shape[-1] + 1), window)
  return (sums - shifted[..., :values.shape[-1]]) / counts


def plain_log_axis(axis, minimum_ticks: int = 3) -> None:
  """A log axis with plain labels (`2.14`, not `2.14×10⁰`) and at least `minimum_ticks` ticks in view: 1-2-5
  steps over a decade or more, evenly spaced values within one. Call it once the data are drawn."""
  import matplotlib.ticker
  import numpy as np

  axis.axes.autoscale_view()
  low, high = sorted(axis.get_view_interval())
  if not (np.isfinite(low) and np.isfinite(high)) or low <= 0 or high <= low:
    return
  ticks = []
  for subs in ((1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)):
    if len(ticks) < minimum_ticks:
      ticks = [t for t in matplotlib.ticker.LogLocator(base=10, subs=subs, numticks=100).tick_values(low, high) if low <= t <= high]
  if len(ticks) < minimum_ticks:
    ticks = [t for t in matplotlib.ticker.MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)
             if low <= t <= high and t > 0]
  if len(ticks) < minimum_ticks:
    ticks = np.geomspace(low, high, minimum_ticks).tolist()
  axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
  axis.set_major_formatter(plain_formatter())
  axis.set_minor_locator(matplotlib.ticker.NullLocator())


def _legend_below(fig, axes) -> None:
  """One legend for the figure, outside the axes, below them (every curve once, in drawing order)."""
  handles, labels = [], []
  for ax in axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      if label not in labels:
        handles.append(handle)
        labels.append(label)
  if handles:
    longest = max(len(label) for label in labels)
    fig.legend(handles, labels, loc="outside lower center", fontsize=7, ncols=1 if longest > 60 else 2,
               frameon=False)


def _note(ax, text: str) -> None:
  """`text` in the panel: centred in an empty one, above the curves (the panel's title) otherwise."""
  import textwrap

  if ax.get_legend_handles_labels()[0]:
    ax.set_title(textwrap.fill(text, 80), fontsize=7, color="0.3")
  else:
    ax.text(0.5, 0.5, textwrap.fill(text, 60), transform=ax.transAxes, ha="center", va="center", fontsize=8,
            color="0.3")
    ax.set_xticks([])
    ax.set_yticks([])


OBJECTIVE_GAP_FLOOR = 1e-7
"""objective_gap.png draws a gap below this (float32's relative resolution, the dtype F is tracked in) at it."""


def histogram_bins(values, count: int = 20):
  """`count` equal bins over the accuracies' own range (a 0–1 range squeezed 0.90–0.99 into two bars), widened to
  0.05 around a single value, within [0, 1]."""
  import numpy as np

  low, high = (float(min(values)), float(max(values))) if len(values) else (0.0, 1.0)
  if high - low < 0.05:
    middle = (low + high) / 2
    low, high = middle - 0.025, middle + 0.025
  low, high = max(0.0, low - 0.01 * (high - low)), min(1.0, high + 0.01 * (high - low))
  if high <= low:
    low, high = max(0.0, high - 0.05), min(1.0, low + 0.05)
  return np.linspace(low, high, count + 1)


def figures(histories: dict, extras: dict, rows: list[dict[str, Any]], config: dict[str, Any],
            dataset) -> dict[str, Any]:
  """`{file name: matplotlib Figure}`: accuracy.png (against rounds and MB sent), loss.png (train and test),
  accuracy_time.png (--async), personalized_accuracy.png (personalized algorithms), objective_gap.png (algorithms
  with an objective: the ADMM and distributed families). A panel left without a curve says why."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  heading = title(config, dataset, list(histories))
  out = {}

  def figure(name, *args, **kwargs):
    fig, axes = plt.subplots(*args, layout="constrained", **kwargs)
    fig.suptitle(heading, fontsize=9, wrap=True)
    out[name] = fig
    return fig, axes

  labels = {r["algorithm"]: legend_label(r) for r in rows}
  keys = []
  for name, history in histories.items():
    keys.append((name, "test"))
    if _eval_points(history, "personalized_test_accuracy") is not None:
      keys.append((name, "personalized"))
  styles = curve_styles(keys)
  fig, axes = figure("accuracy.png", 1, 2, figsize=(11, 5.2))
  for name, history in histories.items():
    sent = np.asarray(extras[name]["megabytes_sent"], np.float64)
    for metric, kind in (("test_accuracy", "test"), ("personalized_test_accuracy", "personalized")):
      points = _eval_points(history, metric)
      if points is None:
        continue
      rounds, values = points
      label = labels[name] if kind == "test" else f"{name}, personalized"
      _series(axes[0], np.asarray(rounds) / extras[name].get("steps_per_round", 1), values, label, ms=4,
              **styles[(name, kind)])
      _series(axes[1], sent[np.asarray(rounds) - 1], values, label, ms=4, **styles[(name, kind)])
  round_label = ("round" if all(e.get("steps_per_round", 1) == 1 for e in extras.values()) else
                 "round (asynchronous: server events / clients in flight)")
  axes[0].set_xlabel(round_label)
  integer_axis(axes[0].xaxis)
  axes[1].set_xlabel("MB sent (each message once" + (", uploads compressed" if config.get("compression") else "")
                     + "; log scale)")
  axes[1].set_xscale("log")
  plain_log_axis(axes[1].xaxis)
  for ax in axes:
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
  _empty_panels(axes, rows, "test accuracy")
  _legend_below(fig, axes)

  fig, axes = figure("loss.png", 1, 2, figsize=(11, 5.2))
  silent, smoothed = [], set()
  own_loss = {r["algorithm"]: r["loss_of"] for r in rows if r.get("loss_of")}  # CoCoA+: its linear model's loss
  twins = {}

  def loss_axis(panel: int, name: str):
    """The panel's axis, or for an algorithm scored by its own loss a twin axis on the right, labelled by it."""
    if name not in own_loss:
      return axes[panel]
    if panel not in twins:
      twins[panel] = axes[panel].twinx()
      twins[panel].set_ylabel(f"right axis: {', '.join(sorted(own_loss.values()))}", fontsize=8)
    return twins[panel]

  for name, history in histories.items():
    per_round = extras[name].get("steps_per_round", 1)  # asynchronous: server events per round of C updates
    style = dict(styles[(name, "test")], **({"ls": "--"} if name in own_loss else {}))
    if "client_loss" in history.round_metrics:
      values = history.round_metrics["client_loss"]
      if per_round > 1:  # one arriving client per event: the mean over the last C events, a round's worth
        values = running_mean(values, per_round)
        smoothed.add(per_round)
      _series(loss_axis(0, name), np.arange(1, np.shape(values)[-1] + 1) / per_round, values, labels[name], ms=4,
              **style)
    else:
      silent.append(name)
    points = _eval_points(history, "test_loss")
    if points is not None:
      steps, values = points
      _series(loss_axis(1, name), np.asarray(steps) / per_round, values, labels[name], ms=4, **style)
  axes[0].set_ylabel("train loss (the round's clients, before their steps)" + (
      f";\nasynchronous: running mean over the last {', '.join(map(str, sorted(smoothed)))} server events"
      if smoothed else ""))
  axes[1].set_ylabel("test loss (every client's test split)")
  if silent:
    admm = [r["algorithm"] for r in rows if r.get("family") == "admm" and r["algorithm"] in silent]
    _note(axes[0], f"{', '.join(silent)}: no train loss (the algorithm reports none"
                   + ("; the ADMM family's objective gap is in objective_gap.png" if admm else "") + ")")
  for panel, ax in enumerate(axes):
    ax.set_xlabel(round_label)
    ax.grid(alpha=0.3)
    for drawn in (ax, twins.get(panel)):
      if drawn is not None and drawn.get_legend_handles_labels()[0]:
        integer_axis(drawn.xaxis)
        drawn.set_yscale("log")
        plain_log_axis(drawn.yaxis)
  _empty_panels([ax for panel, ax in enumerate(axes) if panel not in twins], rows, "loss")
  _legend_below(fig, [*axes, *twins.values()])

  gapped = [r for r in rows if r.get("objective_star") is not None and math.isfinite(r["objective_star"])
            and r["algorithm"] in histories and _eval_points(histories[r["algorithm"]], "objective") is not None]
  if gapped:
    fig, axes = figure("objective_gap.png", 1, 2, figsize=(11, 5.2))
    floored = False
    for r in gapped:
      name = r["algorithm"]
      rounds, values = _eval_points(histories[name], "objective")
      f_star = r["objective_star"]
      gaps = (np.asarray(values, np.float64) - f_star) / max(abs(f_star), 1e-12)
      floored |= bool(np.any(gaps < OBJECTIVE_GAP_FLOOR))
      gaps = np.maximum(gaps, OBJECTIVE_GAP_FLOOR)
      per_round = extras[name].get("steps_per_round", 1)
      sent = np.asarray(extras[name]["megabytes_sent"], np.float64)
      _series(axes[0], np.asarray(rounds) / per_round, gaps, labels[name], ms=4, **styles[(name, "test")])
      _series(axes[1], sent[np.asarray(rounds) - 1], gaps, labels[name], ms=4, **styles[(name, "test")])
    axes[0].set_xlabel(round_label)
    integer_axis(axes[0].xaxis)
    axes[1].set_xlabel("MB sent (each message once; log scale)")
    axes[1].set_xscale("log")
    plain_log_axis(axes[1].xaxis)
    for ax in axes:
      ax.set_ylabel("objective gap (F − F*) / |F*| (log scale)")
      ax.set_yscale("log")
      plain_log_axis(ax.yaxis)
      ax.grid(alpha=0.3)
    _note(axes[0], "F on every client's train split at each evaluation, in the run's float32; F* as in the table "
                   "(float64)" + (f"; gaps below {OBJECTIVE_GAP_FLOOR:g}, float32's resolution, drawn at it"
                                  if floored else ""))
    _legend_below(fig, axes)

  timed = [name for name in histories if "simulated_time" in extras[name]]
  if timed:
    fig, ax = figure("accuracy_time.png", figsize=(6.5, 4.8))
    for name in timed:
      points = _eval_points(histories[name], "test_accuracy")
      if points is None:
        continue
      steps, values = points
      clock = np.concatenate([[0.0], np.asarray(extras[name]["simulated_time"], np.float64)])
      _series(ax, clock[np.asarray(steps)], values, labels[name], ms=4, **styles[(name, "test")])
    ax.set_xlabel(f"simulated time (compute time {config.get('delay')} per client update)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    _legend_below(fig, [ax])

  personal = [r for r in rows if r.get("personalized_accuracy_per_client")]
  if personal:
    fig, ax = figure("personalized_accuracy.png", figsize=(6.5, 4.8))
    every = [v for r in personal for member in r["personalized_accuracy_per_client"] for v in member
             if v is not None]
    bins = histogram_bins(every)
    for r in personal:
      values = [v for member in r["personalized_accuracy_per_client"] for v in member if v is not None]
      style = styles.get((r["algorithm"], "personalized"), styles.get((r["algorithm"], "test"), {}))
      ax.hist(values, bins=bins, histtype="step", lw=1.5, color=style.get("color"), ls=style.get("ls", "-"),
              label=f"{r['algorithm']}: mean {r['personalized_accuracy']:.3f}, p10 "
                    f"{r['personalized_accuracy_p10']:.3f}")
    ax.set_xlabel("personalized test accuracy of a client (its own model, its own test split)")
    ax.set_ylabel("clients")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
  return out


def plot_all(histories: dict, extras: dict, rows: list[dict[str, Any]], config: dict[str, Any], dataset,
             out: str) -> list[str]:
  """Writes `figures(...)` into `out` (PNG, 110 dpi); returns their paths."""
  import matplotlib.pyplot as plt

  paths = []
  for name, fig in figures(histories, extras, rows, config, dataset).items():
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths
