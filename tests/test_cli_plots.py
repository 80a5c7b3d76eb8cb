"""The run's plots, checked on the matplotlib Figures of `report.figures` for histories built by hand (no training).

Titles say each family's local work (docs/cli.md's table of what each family does per round); every curve has
its own (linestyle, marker) pair; legends sit outside the axes (or, in the histogram, where matplotlib finds
room); log axes carry plain numbers; the MB axis has at least three ticks.
"""

from __future__ import annotations

import types

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from fedjax_opt.cli import report  # pylint: disable=wrong-import-position
from fedjax_opt.train.history import History  # pylint: disable=wrong-import-position

CONFIG = dict(dataset="digits", partition="dirichlet", alpha=0.5, num_clients=20, clients_per_round=5, local_steps=3,
              batch_size=16, client_lr=None, seed=0, seeds=1, aggregator=None, attack=None, attackers=None,
              topology=None, delay=None, dp_noise=None, dp_epsilon=None, compression=None, secure_aggregation=None)
DATASET = types.SimpleNamespace(num_clients=20)
FAMILY = {"fedavg": "averaging", "ditto": "personalized", "l2gd": "personalized", "admm_consensus": "admm",
          "gadmm": "admm", "gossip": "decentralized", "clustered_fl": "personalized", "fedmd": "personalized",
          "fedbuff": "asynchronous", "scaffold": "averaging", "pfedme": "personalized", "fedem": "personalized"}
PERSONALIZED = ("ditto", "l2gd", "gossip", "clustered_fl", "fedmd", "pfedme", "fedem")
TRAIN_LOSS = ("fedavg", "ditto", "gossip", "clustered_fl", "fedmd", "scaffold", "pfedme", "fedem")


def _run(names, *, rounds=10, every=5, accuracy=None, megabytes=None, **config):
  """(histories, extras, rows, config) as `fedjax-opt run` hands them to the plots, made up."""
  rng = np.random.default_rng(0)
  histories, extras, rows = {}, {}, []
  for i, name in enumerate(names):
    evals = []
    for r in range(every, rounds + 1, every):
      point = {"round": r, "test_accuracy": accuracy[name][r // every - 1] if accuracy else 0.5 + 0.01 * i + 0.02 * r,
               "test_loss": 2.2 - 0.01 * r - 0.005 * i}
      if name in PERSONALIZED:
        point["personalized_test_accuracy"] = point["test_accuracy"] + 0.1
      evals.append(point)
    metrics = {"client_loss": 1.9 - 0.01 * np.arange(rounds) + 0.05 * rng.random(rounds)} if name in TRAIN_LOSS else \
        {"update_norm": np.ones(rounds)}
    histories[name] = History(round_metrics=metrics, evals=evals)
    sent = megabytes[name] if megabytes else 0.02 * (i + 1) * np.arange(1, rounds + 1)
    extras[name] = {"megabytes_sent": list(sent), "steps_per_round": 1}
    row = {"algorithm": name, "family": FAMILY[name], "hyper_parameters": {"client_lr": 0.05}}
    if name in PERSONALIZED:
      row.update(personalized_accuracy=0.7, personalized_accuracy_p10=0.5,
                 personalized_accuracy_per_client=[list(rng.random(20))])
    rows.append(row)
  return histories, extras, rows, dict(CONFIG, algorithms=",".join(names), **config)


@pytest.fixture
def figures():
  made = []

  def make(*args, draw=False, **kwargs):
    out = report.figures(*_run(*args, **kwargs), DATASET)
    made.extend(out.values())
    for fig in out.values() if draw else ():
      fig.canvas.draw()
    return out

  yield make
  for fig in made:
    plt.close(fig)


@pytest.mark.parametrize("names,topology,says,omits", [
    (["fedavg"], None, ["5/round, 3 steps × batch 16"], []),
    (["admm_consensus", "gadmm"], None, ["every client, full batch"], ["/round", "steps ×"]),
    (["l2gd"], None, ["every client, full batch"], ["/round", "steps ×"]),
    (["gossip"], "torus", ["every client, 3 steps × batch 16", "torus topology"], ["/round"]),
    (["clustered_fl", "fedmd"], None, ["every client, 3 steps × batch 16"], ["/round"]),
    (["fedbuff"], None, ["5 in flight, 3 steps × batch 16"], ["/round"]),
    (["fedavg", "l2gd"], None, ["fedavg: 5/round, 3 steps × batch 16", "l2gd: every client, full batch"], []),
])
def test_titles_say_each_family_s_local_work_and_the_topology(names, topology, says, omits):
  heading = report.title(dict(CONFIG, algorithms=",".join(names), topology=topology), DATASET, names)
  assert heading.startswith("digits, dirichlet(α=0.5), 20 clients, ") and heading.endswith("seed 0")
  for text in says:
    assert text in heading, heading
  for text in omits:
    assert text not in heading, heading
  assert ("topology" in heading) == (topology is not None)


def test_every_curve_has_its_own_line_style_and_marker_and_coinciding_curves_stay_visible(figures):
  names = ["fedavg", "ditto", "scaffold", "pfedme", "fedem", "gossip", "clustered_fl", "fedmd"]
  same = [0.2, 0.3]  # FedAvg and Ditto's global model: the same curve
  accuracy = {n: same if n in ("fedavg", "ditto") else [0.4 + 0.01 * i, 0.5] for i, n in enumerate(names)}
  made = figures(names, accuracy=accuracy)
  for ax in made["accuracy.png"].axes:
    lines = ax.get_lines()
    assert len(lines) == len(names) + sum(n in PERSONALIZED for n in names)
    pairs = [(line.get_linestyle(), line.get_marker()) for line in lines]
    assert len(set(pairs)) == len(pairs), pairs
    fedavg, ditto = lines[0], lines[1]
    np.testing.assert_array_equal(fedavg.get_ydata(), ditto.get_ydata())
    assert fedavg.get_linewidth() > ditto.get_linewidth() and fedavg.get_marker() != ditto.get_marker()
    assert all(line.get_markerfacecolor() == "none" for line in lines)
  loss_lines = made["loss.png"].axes[0].get_lines()
  assert len({(line.get_linestyle(), line.get_marker()) for line in loss_lines}) == len(loss_lines)


def _overlaps(a, b) -> bool:
  return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_legends_sit_outside_the_axes_or_where_matplotlib_finds_room_and_the_figures_carry_the_title(figures):
  made = figures(["fedavg", "ditto", "admm_consensus"], draw=True)
  for name in ("accuracy.png", "loss.png"):
    fig = made[name]
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    box = fig.legends[0].get_window_extent()
    assert not any(_overlaps(box, ax.get_window_extent()) for ax in fig.axes)
    assert "fedavg (client_lr=0.05)" in {t.get_text() for t in fig.legends[0].get_texts()}
  assert "ditto, personalized" in {t.get_text() for t in made["accuracy.png"].legends[0].get_texts()}
  (ax,) = made["personalized_accuracy.png"].axes
  assert ax.get_legend()._loc == 0  # "best"  # pylint: disable=protected-access
  names = ["fedavg", "ditto", "admm_consensus"]
  assert {fig.get_suptitle() for fig in made.values()} == {report.title(_run(names)[3], DATASET, names)}
  # A panel whose algorithms report no train loss says so: above the curves of the others.
  assert "admm_consensus: no train loss" in made["loss.png"].axes[0].get_title().replace("\n", " ")


@pytest.mark.parametrize("megabytes", [
    {"fedavg": np.linspace(0.004, 0.009, 10), "ditto": np.linspace(0.005, 0.0088, 10)},  # within one decade
    {"fedavg": np.geomspace(0.01, 3.0, 10), "ditto": np.linspace(0.2, 2.0, 10)},  # across decades
])
def test_log_axes_have_plain_labels_and_the_mb_axis_at_least_three_ticks(figures, megabytes):
  made = figures(["fedavg", "ditto"], megabytes=megabytes, draw=True)
  mb = made["accuracy.png"].axes[1]
  loss = made["loss.png"].axes
  for axis in (mb.xaxis, loss[0].yaxis, loss[1].yaxis):
    assert axis.get_scale() == "log"
    low, high = sorted(axis.get_view_interval())
    shown = [t for t in axis.get_major_ticks() if low <= t.get_loc() <= high and t.label1.get_visible()]
    assert len(shown) >= 3, [t.get_loc() for t in shown]
    for tick in shown:
      text = tick.label1.get_text()
      assert "$" not in text and "times" not in text and "^" not in text, text
      assert float(text) == pytest.approx(tick.get_loc(), rel=5e-3)
    assert not [t for t in axis.get_minor_ticks() if t.label1.get_text()]


def test_a_panel_without_data_says_why(figures):
  train = figures(["admm_consensus", "gadmm"])["loss.png"].axes[0]
  assert not train.get_lines()
  (note,) = train.texts
  assert "admm_consensus, gadmm: no train loss" in note.get_text().replace("\n", " ")


def _texts(ax):
  return " ".join(t.get_text().replace("\n", " ") for t in [*ax.texts, ax.title])


def test_the_admm_family_s_objective_gap_is_plotted_from_f_at_each_evaluation_and_the_run_s_f_star(figures):
  """objective_gap.png: (F − F*)/|F*| per evaluation against rounds and MB sent, F* the row's (the table's); a gap
  below float32's resolution is drawn at the floor and the panel says so. No such figure without an objective."""
  histories, extras, rows, config = _run(["admm_consensus", "gadmm", "fedavg"])
  f_star = 0.5
  objective = {"admm_consensus": [0.6, 0.5 + 1e-9], "gadmm": [0.75, 0.55]}
  for row in rows:
    if row["algorithm"] in objective:
      row["objective_star"] = f_star
      for point, value in zip(histories[row["algorithm"]].evals, objective[row["algorithm"]]):
        point["objective"] = value
  out = report.figures(histories, extras, rows, config, DATASET)
  try:
    rounds_ax, sent_ax = out["objective_gap.png"].axes
    drawn = {line.get_label().split(" (")[0]: line for line in rounds_ax.get_lines()}
    assert set(drawn) == {"admm_consensus", "gadmm"}  # fedavg has no objective
    np.testing.assert_allclose(drawn["gadmm"].get_ydata(), [0.5, 0.1])
    np.testing.assert_allclose(drawn["admm_consensus"].get_ydata(), [0.2, report.OBJECTIVE_GAP_FLOOR])
    np.testing.assert_array_equal(drawn["gadmm"].get_xdata(), [5, 10])
    sent = {line.get_label().split(" (")[0]: line.get_xdata() for line in sent_ax.get_lines()}
    np.testing.assert_allclose(sent["gadmm"], np.asarray(extras["gadmm"]["megabytes_sent"])[[4, 9]])
    assert rounds_ax.get_yscale() == "log" and "drawn at it" in _texts(rounds_ax)
  finally:
    for fig in out.values():
      plt.close(fig)
  assert "objective_gap.png" not in figures(["fedavg"])


def test_a_loss_of_another_model_goes_on_its_own_axis(figures):
  """CoCoA+ scores its own linear model with the squared loss: not on the axis of the others' cross-entropy."""
  histories, extras, rows, config = _run(["fedavg", "admm_consensus"])
  rows[1]["loss_of"] = "admm_consensus's squared loss (linear_ridge)"
  out = report.figures(histories, extras, rows, config, DATASET)
  try:
    fig = out["loss.png"]
    test_ax, twin = fig.axes[1], fig.axes[2]
    assert [l.get_label().split(" (")[0] for l in test_ax.get_lines()] == ["fedavg"]
    assert [l.get_label().split(" (")[0] for l in twin.get_lines()] == ["admm_consensus"]
    assert "squared loss (linear_ridge)" in twin.get_ylabel()
  finally:
    for fig in out.values():
      plt.close(fig)


def test_legends_carry_epsilon_and_a_status_and_an_empty_panel_names_the_divergence():
  row = {"algorithm": "fedavg", "hyper_parameters": {"client_lr": 0.1}, "dp_epsilon": 7.99981,
         "privacy": {"target_epsilon": 8.0}, "status": "diverged between rounds 1 and 5 (seen at the evaluation of "
                                                     "round 5)"}
  assert report.legend_label(row) == "fedavg (client_lr=0.1); ε = 7.9998; diverged between rounds 1 and 5"
  histories, extras, rows, config = _run(["fedavg"])
  histories["fedavg"] = History(round_metrics={}, evals=[])  # stopped before its first evaluation
  rows[0]["status"] = "diverged at round 1"
  out = report.figures(histories, extras, rows, config, DATASET)
  try:
    for ax in out["accuracy.png"].axes:
      assert "no curve: fedavg diverged at round 1 before its first evaluation" in _texts(ax)
  finally:
    for fig in out.values():
      plt.close(fig)


def test_the_personalized_histogram_spans_the_accuracies_not_zero_to_one():
  bins = report.histogram_bins([0.91, 0.95, 0.99])
  assert len(bins) == 21 and 0.9 < bins[0] <= 0.91 and 0.99 <= bins[-1] < 1.0
  np.testing.assert_allclose(np.diff(bins), np.diff(bins)[0])
  single = report.histogram_bins([1.0, 1.0])
  assert single[-1] == 1.0 and single[-1] - single[0] >= 0.025
  histories, extras, rows, config = _run(["ditto"])
  rows[0]["personalized_accuracy_per_client"] = [list(0.9 + 0.1 * np.linspace(0, 1, 20))]
  out = report.figures(histories, extras, rows, config, DATASET)
  try:
    low, high = out["personalized_accuracy.png"].axes[0].get_xlim()
    assert 0.85 < low < 0.9 and 1.0 <= high < 1.01, (low, high)  # the data's range with margins, not 0–1
  finally:
    for fig in out.values():
      plt.close(fig)
