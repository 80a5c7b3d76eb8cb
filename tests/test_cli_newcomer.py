"""`fedjax-opt run` on a newcomer's paths: one clear line for a setting that cannot work, nothing lost.

The refusals run in this process (the `cli` fixture) and stop before any training; the rules and the report are
checked on made-up histories and rows; the few real runs are in the slow tier.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import types
import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from fedjax_opt.cli import config as config_lib  # pylint: disable=wrong-import-position
from fedjax_opt.cli import registry, report, robust  # pylint: disable=wrong-import-position
from fedjax_opt.cli import run as run_lib  # pylint: disable=wrong-import-position
from fedjax_opt.train.history import History  # pylint: disable=wrong-import-position

DIGITS = ["--dataset", "digits", "--rounds", "2", "--quiet"]


def one_line(result) -> str:
  assert result.returncode == 2, (result.stdout, result.stderr)
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
  return lines[0]


# ---- 1. a robust rule's condition on the clients of a round, checked with the flags ----------------------------


@pytest.mark.parametrize("args,needles", [
    (["--attack", "omniscient", "--attackers", "0.5", "--aggregator", "krum"],
     ["--aggregator krum needs n > 2f + 2", "--attackers 0.5 of --clients-per-round 10 give f = ⌊0.5 × 10⌋ = 5",
      "n ≥ 13", "--clients-per-round gives n = 10", "lower --attackers below 0.4 (at most 3 of 10 clients)"]),
    (["--aggregator", "bulyan", "--attack", "gaussian", "--attackers", "0.2"],
     ["--aggregator bulyan needs n ≥ 4f + 3", "f = ⌊0.2 × 10⌋ = 2", "n ≥ 11",
      "raise --clients-per-round to 11 or lower --attackers below 0.2 (at most 1 of 10 clients)"]),
    (["--aggregator", "krum", "--clients-per-round", "4"],
     ["without --attack, f = 1", "n ≥ 5, but --clients-per-round gives n = 4", "raise --clients-per-round to 5"]),
    (["--aggregator", "multi_krum", "--set", "aggregator.num_byzantine=4"],
     ["--set aggregator.num_byzantine=4 gives f = 4", "n ≥ 11", "give --set aggregator.num_byzantine=3"]),
    (["--aggregator", "multi_krum", "--set", "aggregator.m=12"],
     ["multi_krum averages m = 12 updates", "(--clients-per-round 10)"]),
    (["--aggregator", "mean_around_median", "--attack", "sign_flip", "--attackers", "1"],
     ["--aggregator mean_around_median needs n > f", "n ≥ 11"]),
    (["--aggregator", "trimmed_mean", "--attack", "gaussian", "--attackers", "0.5"],
     ["--aggregator trimmed_mean", "needs β < 0.5", "β is --attackers 0.5 unless given", "--set aggregator.beta=B"]),
    (["--algorithms", "clustered_fl", "--num-clients", "10", "--aggregator", "bulyan",
      "--set", "aggregator.num_byzantine=2"],
     ["--num-clients gives n = 10 (clustered_fl aggregate(s) every client's update)", "n ≥ 11"]),
])
def test_a_robust_rule_without_enough_clients_is_one_line_naming_the_flags_and_writes_nothing(cli, tmp_path, args,
                                                                                            needles):
  out = tmp_path / "run"
  algorithms = [] if "--algorithms" in args else ["--algorithms", "fedavg"]
  line = one_line(cli("run", *DIGITS, *algorithms, *args, "--out", out))
  for needle in needles:
    assert needle in line, line
  assert not out.exists()
  # --resume of a folder left by an older version answers the same line, not a traceback.
  out.mkdir()
  (out / "config.json").write_text(json.dumps(config_lib.finish(config_lib.given_settings(
      config_lib.build_parser().parse_args(["run", *DIGITS, "--algorithms", "fedavg"])))))
  saved = json.loads((out / "config.json").read_text())
  given = config_lib.given_settings(config_lib.build_parser().parse_args(["run", *DIGITS, *algorithms, *args]))
  saved.update({k: v for k, v in given.items() if k != "quiet"})
  (out / "config.json").write_text(json.dumps(saved))
  assert needles[0] in one_line(cli("run", "--out", out, "--resume"))


def test_settings_that_meet_the_rules_pass_the_check():
  config = dict(aggregator="krum", attack="omniscient", attackers=0.2, clients_per_round=10, num_clients=20,
                hyper={})
  robust.check_rows(config, ["fedavg", "ditto", "l2gd"], registry, 20)  # f = 2: n ≥ 7
  robust.check_rows(dict(config, aggregator="bulyan", attackers=0.1), ["fedavg"], registry, 20)  # f = 1: n ≥ 7
  robust.check_rows(dict(config, aggregator="trimmed_mean", attackers=0.45), ["fedavg"], registry, 20)
  robust.check_rows(dict(config, aggregator="krum", attack=None, attackers=None, clients_per_round=5), ["fedavg"],
                    registry, 20)


@pytest.mark.parametrize("name", sorted(robust.ROW_RULES))
def test_the_command_line_s_conditions_are_those_the_library_checks(name):
  """`ROW_RULES` says the least n for each f: the library's rule aggregates n rows and refuses n − 1."""
  import jax
  import jax.numpy as jnp

  from fedjax_opt import aggregators

  for f in range(3):
    least = robust.ROW_RULES[name][1](f)
    rule = getattr(aggregators, name)(num_byzantine=f)
    for n, ok in ((least, True), (least - 1, False)):
      if n < 1:
        continue
      updates, weights = {"w": jnp.arange(n, dtype=jnp.float32)[:, None]}, jnp.ones(n)
      state = rule.init({"w": jnp.zeros(1)})
      if ok:
        rule.aggregate(updates, weights, state, jax.random.key(0))
      else:
        with pytest.raises(ValueError, match="num_byzantine"):
          rule.aggregate(updates, weights, state, jax.random.key(0))


def _failing_train(monkeypatch, save: bool):
  """`fo.train` replaced by one that makes its checkpoint folder (and, with `save`, a checkpoint file) and fails."""
  train_lib = importlib.import_module("fedjax_opt.train")

  def train(*args, checkpointing=None, **kwargs):
    del args, kwargs
    os.makedirs(checkpointing.directory, exist_ok=True)
    if save:
      with open(os.path.join(checkpointing.directory, "saved"), "w") as f:
        f.write("a chunk")
    raise RuntimeError("a failure while tracing the first round")

  monkeypatch.setattr(train_lib, "train", train)


def test_a_failure_before_any_round_is_saved_leaves_the_folder_as_it_was(cli, tmp_path, monkeypatch):
  _failing_train(monkeypatch, save=False)
  made = tmp_path / "made"
  with pytest.raises(RuntimeError, match="a failure while tracing"):
    cli("run", *DIGITS, "--algorithms", "fedavg", "--out", made)
  assert not made.exists()  # made by the run: removed
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("mine")
  with pytest.raises(RuntimeError):
    cli("run", *DIGITS, "--algorithms", "fedavg", "--out", mine)
  assert sorted(os.listdir(mine)) == ["notes.txt"]  # the user's file stays; the run's files are gone
  config_lib.prepare_new(str(mine), False)  # a rerun is not told that the folder "already holds a run"
  # `fedjax-opt tune` trains its run into the folder of its tune.json: a failure there keeps the tuning.
  tuned = tmp_path / "tuned"
  (tuned / "checkpoints" / "fedavg").mkdir(parents=True)
  (tuned / "tune.json").write_text("{}")
  (tuned / "config.json").write_text("{}")
  run_lib._remove_unstarted(str(tuned), created=False)  # pylint: disable=protected-access
  assert sorted(os.listdir(tuned)) == ["tune.json"]


def test_a_failure_after_a_checkpoint_is_saved_keeps_the_run_for_resume(cli, tmp_path, monkeypatch):
  _failing_train(monkeypatch, save=True)
  out = tmp_path / "run"
  with pytest.raises(RuntimeError):
    cli("run", *DIGITS, "--algorithms", "fedavg", "--out", out)
  assert (out / "config.json").is_file() and (out / "checkpoints" / "fedavg" / "saved").is_file()


# ---- 2. --set step sizes are checked as their flags are --------------------------------------------------------


@pytest.mark.parametrize("algorithm,setting,needle", [
    ("fedavg", "fedavg.client_lr=-0.1", "fedavg.client_lr must be a positive number (a step size, as --client-lr "
                                        "must); got -0.1"),
    ("fedavg", "fedavg.client_lr=0", "fedavg.client_lr must be a positive number"),
    ("fedavg", "fedavg.server_lr=0", "fedavg.server_lr must be a positive number (a step size, as --server-lr"),
    ("scaffold", "scaffold.eta_l=-1", "scaffold.eta_l must be a positive number (a step size, as --client-lr"),
    ("scaffold", "scaffold.eta_g=0", "scaffold.eta_g must be a positive number (a step size, as --server-lr"),
    ("fedavg_ft", "fedavg_ft.finetune_lr=-0.5", "fedavg_ft.finetune_lr must be a positive number (a step size)"),
])
def test_a_step_size_set_with_set_is_refused_as_its_flag_is(cli, tmp_path, algorithm, setting, needle):
  out = tmp_path / "run"
  assert needle in one_line(cli("run", *DIGITS, "--algorithms", algorithm, "--set", setting, "--out", out))
  assert not out.exists()


def test_a_step_size_in_a_toml_section_is_refused_and_a_good_one_is_kept(cli, tmp_path):
  toml = tmp_path / "exp.toml"
  toml.write_text('algorithms = "fedavg"\ndataset = "digits"\n[fedavg]\nclient_lr = -0.1\n')
  assert "fedavg.client_lr must be a positive number" in one_line(cli("run", "--config", toml))
  given = config_lib.given_settings(config_lib.build_parser().parse_args(
      ["run", *DIGITS, "--algorithms", "fedavg", "--set", "fedavg.client_lr=0.1"]))
  assert config_lib.hyper_parameters(config_lib.finish(given), "fedavg")["client_lr"] == 0.1


# ---- 3. a run that ends far worse than it started says so ----------------------------------------------------


def _history(losses, accuracies, initial=2.3, diverged=None, rounds=None):
  rounds = rounds or [5 * (i + 1) for i in range(len(losses))]
  evals = [{"round": r, "test_loss": l, "test_accuracy": a} for r, l, a in zip(rounds, losses, accuracies)]
  return History(evals=evals, initial_loss=initial, diverged_at_round=diverged,
                 diverged_reason=None if diverged is None else "the test loss is NaN or Inf")


@pytest.mark.parametrize("losses,accuracies,initial,status,says", [
    ([1.0, 176.0], [0.6, 0.415], 2.3, "degraded", "the test loss grew 77× (2.3 → 176), over 10× the initial"),
    ([1.0, 22.9], [0.6, 0.6], 2.3, "finished", None),  # 9.96×: not over 10×
    ([1.0, 23.1], [0.6, 0.6], 2.3, "degraded", "grew 10×"),
    ([0.8, 0.9], [0.8, 0.65], 2.3, "degraded", "the test accuracy fell from 0.8000 at round 5 to 0.6500"),
    ([0.8, 0.9], [0.8, 0.71], 2.3, "finished", None),  # 0.09 below the first evaluation: not over 0.1
    ([3.0, 31.0], [0.2, 0.2], None, "degraded", "grew 10× (3 → 31)"),  # no initial evaluation: the first one
    ([[1.0, 1.0], [40.0, 60.0]], [[0.6, 0.6], [0.6, 0.6]], [2.0, 3.0], "degraded", "grew 20× (2.5 → 50)"),  # seeds
])
def test_the_degraded_rule(losses, accuracies, initial, status, says):
  result = run_lib.outcome(_history(losses, accuracies, initial))
  assert result["status"] == status
  if says:
    assert says in result["degraded_reason"], result["degraded_reason"]
  else:
    assert "degraded_reason" not in result


def test_divergence_is_reported_with_the_rounds_it_could_have_happened_in():
  seen_late = run_lib.outcome(_history([1.0, float("nan")], [0.5, 0.1], diverged=20, rounds=[10, 20]))
  assert seen_late["status"] == "diverged between rounds 11 and 20 (seen at the evaluation of round 20)"
  assert seen_late["diverged_between"] == [11, 20] and seen_late["diverged_reason"]
  first = run_lib.outcome(_history([float("nan")], [0.1], diverged=10, rounds=[10]))
  assert first["status"] == "diverged between rounds 1 and 10 (seen at the evaluation of round 10)"
  every_round = run_lib.outcome(_history([1.0, float("nan")], [0.5, 0.1], diverged=4, rounds=[3, 4]))
  assert every_round["status"] == "diverged at round 4" and every_round["diverged_between"] == [4, 4]
  events = run_lib.outcome(_history([1.0, float("nan")], [0.5, 0.1], diverged=200, rounds=[100, 200]), per_round=10)
  assert events["status"] == "diverged between rounds 11 and 20 (seen at the evaluation of round 20)"


def _cells(table: str) -> list[dict[str, str]]:
  header, _, *lines = table.splitlines()
  names = re.split(r"\s{2,}", header.strip())
  return [dict(zip(names, re.split(r"\s{2,}", line.strip()))) for line in lines if line.strip() and
          len(re.split(r"\s{2,}", line.strip())) == len(names)]


BASE_ROW = dict(rounds=300, megabytes_sent=1234.5, wall_seconds=1.0, compile_seconds=0.5, status="finished",
                test_accuracy=0.5, test_loss=1.0)


def test_the_table_shows_a_degraded_run_and_why():
  rows = [dict(BASE_ROW, algorithm="fedavg", **run_lib.outcome(_history([1.0, 176.0], [0.6, 0.415])))]
  table = report.results_table(rows)
  assert _cells(table)[0]["status"] == "degraded"
  assert "fedavg degraded: the test loss grew 77× (2.3 → 176), over 10× the initial model's" in table


# ---- 4. messages name the flags ----------------------------------------------------------------------------------


def _libsvm(tmp_path) -> str:
  rng = np.random.default_rng(0)
  lines = []
  for _ in range(40):
    x = rng.normal(size=3)
    lines.append(f"{'+1' if x[0] + 0.5 * x[1] > 0 else '-1'} " + " ".join(f"{j + 1}:{v:.3f}" for j, v in enumerate(x)))
  path = tmp_path / "tiny.svm"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_clients_per_round_is_checked_only_for_the_algorithms_that_draw_clients_and_names_the_flags(cli, tmp_path):
  data = "libsvm:" + _libsvm(tmp_path)
  given = config_lib.given_settings(config_lib.build_parser().parse_args(
      ["run", "--dataset", data, "--num-clients", "2", "--algorithms", "dane,giant,cocoa"]))
  assert config_lib.finish(given)["clients_per_round"] == 10  # not used by them: no refusal
  line = one_line(cli("run", "--dataset", data, "--num-clients", "2", "--algorithms", "dane,fedavg",
                      "--out", tmp_path / "run"))
  assert ("--clients-per-round 10 (the default) exceeds --num-clients 2: fedavg draw(s) that many clients a round; "
          "lower --clients-per-round to at most 2 or raise --num-clients") in line
  line = one_line(cli("run", "--dataset", data, "--num-clients", "60", "--algorithms", "dane", "--out", tmp_path / "x"))
  assert "cannot split" in line and "--num-clients 60 exceeds the 40 train examples" in line
  line = one_line(cli("run", "--dataset", "digits", "--clients-per-round", "30", "--algorithms", "fedavg"))
  assert "--clients-per-round 30 exceeds the 20 clients of 'digits' (--num-clients)" in line
  toml = tmp_path / "exp.toml"
  toml.write_text('dataset = "digits"\nclients_per_round = 0\n')
  assert "--clients-per-round must be a positive integer; got 0" in one_line(cli("run", "--config", toml))


# ---- 5. the table's numbers ----------------------------------------------------------------------------------------


def test_epsilon_is_not_printed_as_its_target_unless_it_is_and_times_have_thousands_separators():
  privacy = {"target_epsilon": 8.0, "delta": 1e-5, "accountant": "pld", "sampling": "Poisson",
             "noise_multiplier": 1.8, "neighboring_relation": "ADD_OR_REMOVE_ONE"}
  rows = [dict(BASE_ROW, algorithm="fedavg", dp_epsilon=7.9998, privacy=privacy, simulated_time=12345.67),
          dict(BASE_ROW, algorithm="fedprox", dp_epsilon=8.0, privacy=privacy, simulated_time=987.65),
          dict(BASE_ROW, algorithm="fedadam", dp_epsilon=3.14159, privacy=dict(privacy, target_epsilon=None),
               simulated_time=1.0)]
  cells = _cells(report.results_table(rows))
  assert [c["ε"] for c in cells] == ["7.9998", "8.000", "3.142"]
  assert [c["sim. time"] for c in cells] == ["12,345.7", "987.6", "1.0"]
  assert cells[0]["MB sent"] == "1,234.5"
  assert report.epsilon_text(7.99999, 8.0) == "7.99999" and report.epsilon_text(8.00004, 8.0) == "8.00004"
  assert report.epsilon_text(0.123456) == "0.1235" and report.epsilon_text(1234.4) == "1,234"


# ---- 6. the plots ----------------------------------------------------------------------------------------------


def test_tick_labels_are_plain_with_thousands_separators_and_tell_the_ticks_apart():
  assert report.tick_labels([1000, 2000, 5000]) == ["1,000", "2,000", "5,000"]
  assert report.tick_labels([0.5, 1, 2, 5, 10, 20]) == ["0.5", "1", "2", "5", "10", "20"]
  assert report.tick_labels([2.3, 2.3025, 2.305, 2.3075, 2.31]) == ["2.3000", "2.3025", "2.3050", "2.3075", "2.3100"]
  assert report.tick_labels([2.3, 2.302, 2.304]) == ["2.300", "2.302", "2.304"]
  assert report.tick_labels([1e-5, 1e-3]) == ["1e-05", "0.001"]
  assert report.plain_number(25000.0) == "25,000" and report.plain_number(0.05) == "0.05"


def _async_run(events_per_round=10, rounds=30, loss_scale=1.0, accuracy=None):
  """FedAvg (30 rounds, one training step each) and FedBuff (300 server events, 10 per round) as `fedjax-opt run
  --async` hands them to the plots."""
  rng = np.random.default_rng(0)
  histories, extras, rows = {}, {}, []
  for name, per_round in (("fedavg", 1), ("fedbuff", events_per_round)):
    steps = rounds * per_round
    evals = [{"round": r * per_round, "test_accuracy": 0.5 + 0.01 * r if accuracy is None else accuracy(r),
              "test_loss": loss_scale * (2.0 - 0.01 * r)} for r in range(5, rounds + 1, 5)]
    loss = loss_scale * (1.5 + rng.random(steps))  # one client per server event: a wide band
    histories[name] = History(round_metrics={"client_loss": loss, "simulated_time": np.cumsum(np.ones(steps))},
                              evals=evals)
    extras[name] = {"megabytes_sent": list(0.01 * np.arange(1, steps + 1)), "steps_per_round": per_round,
                    "simulated_time": list(np.cumsum(np.ones(steps)))}
    rows.append({"algorithm": name, "family": "averaging" if per_round == 1 else "asynchronous",
                 "hyper_parameters": {"client_lr": 0.05}})
  config = dict(dataset="digits", partition="dirichlet", alpha=0.5, num_clients=20, clients_per_round=events_per_round,
                local_steps=3, batch_size=16, client_lr=None, seed=0, seeds=1, aggregator=None, attack=None,
                attackers=None, topology=None, delay="exp:1", dp_noise=None, dp_epsilon=None, compression=None,
                secure_aggregation=None, algorithms="fedavg,fedbuff")
  return histories, extras, rows, config


@pytest.fixture
def drawn():
  made = []

  def draw(histories, extras, rows, config):
    out = report.figures(histories, extras, rows, config, types.SimpleNamespace(num_clients=20))
    for fig in out.values():
      fig.canvas.draw()
    made.extend(out.values())
    return out

  yield draw
  for fig in made:
    plt.close(fig)


def _shown_labels(axis) -> list[tuple[float, str]]:
  low, high = sorted(axis.get_view_interval())
  return [(t.get_loc(), t.label1.get_text()) for t in axis.get_major_ticks()
          if low - 1e-9 <= t.get_loc() <= high + 1e-9 and t.label1.get_visible() and t.label1.get_text()]


def test_async_loss_curves_share_the_accuracy_plot_s_axis_and_the_event_train_loss_is_smoothed(drawn):
  histories, extras, rows, config = _async_run()
  made = drawn(histories, extras, rows, config)
  for fig in (made["accuracy.png"], made["loss.png"]):
    ax = fig.axes[0]
    ends = {line.get_label().split(" ")[0]: float(np.max(line.get_xdata())) for line in ax.get_lines()}
    assert ends == {"fedavg": 30.0, "fedbuff": 30.0}, ends  # 300 events of 10 = 30 rounds of 10 client updates
    assert ax.get_xlabel() == "round (asynchronous: server events / clients in flight)"
  train, test = made["loss.png"].axes
  assert {float(np.max(line.get_xdata())) for line in test.get_lines()} == {30.0}
  assert test.get_xlabel() == train.get_xlabel() == made["accuracy.png"].axes[0].get_xlabel()
  fedbuff = next(line for line in train.get_lines() if line.get_label().startswith("fedbuff"))
  raw = np.asarray(histories["fedbuff"].round_metrics["client_loss"])
  np.testing.assert_allclose(fedbuff.get_ydata(), report.running_mean(raw, 10))
  np.testing.assert_allclose(fedbuff.get_ydata()[20], raw[11:21].mean())
  assert np.ptp(fedbuff.get_ydata()[10:]) < 0.6 * np.ptp(raw)  # narrower than the band of single arrivals
  assert "running mean over the last 10 server events" in train.get_ylabel()


def test_round_axes_have_integer_ticks_and_log_axes_plain_numbers_with_separators(drawn):
  # Two rounds, evaluated each: matplotlib's own ticks were 1.0, 1.2, ..., 2.0 on the round axes.
  histories, extras, rows, config = _async_run(events_per_round=1, rounds=2, loss_scale=1000.0)
  histories["fedavg"].evals = [{"round": r, "test_accuracy": 0.5, "test_loss": 2000.0 * r} for r in (1, 2)]
  histories["fedbuff"].evals = [{"round": r, "test_accuracy": 0.6, "test_loss": 1500.0 * r} for r in (1, 2)]
  made = drawn(histories, extras, rows, config)
  for ax in (made["accuracy.png"].axes[0], *made["loss.png"].axes):
    shown = _shown_labels(ax.xaxis)
    assert shown and all(float(loc).is_integer() for loc, _ in shown), shown
    assert all(text == f"{int(loc):,}" for loc, text in shown), shown
  test_loss = made["loss.png"].axes[1].yaxis
  shown = _shown_labels(test_loss)
  assert len(shown) >= 3 and any(loc >= 1000 for loc, _ in shown), shown
  for loc, text in shown:
    assert "e+" not in text and "$" not in text, text
    assert float(text.replace(",", "")) == pytest.approx(loc, rel=5e-3)
    if loc >= 1000:
      assert "," in text, text


def test_a_tiny_loss_range_has_distinct_tick_labels(drawn):
  histories, extras, rows, config = _async_run(events_per_round=1, rounds=10)
  for i, name in enumerate(histories):
    histories[name].evals = [{"round": r, "test_accuracy": 0.5, "test_loss": 2.3 + 0.001 * r + 0.0001 * i}
                             for r in (5, 10)]
  made = drawn(histories, extras, rows, config)
  shown = _shown_labels(made["loss.png"].axes[1].yaxis)
  texts = [text for _, text in shown]
  assert len(shown) >= 3 and len(set(texts)) == len(texts), texts
  for loc, text in shown:
    assert float(text) == pytest.approx(loc, abs=5e-4)


# ---- the same, end to end (real runs, in this process) -------------------------------------------------------


SMALL = ["--dataset", "digits", "--num-clients", "20", "--clients-per-round", "5", "--local-steps", "3",
         "--batch-size", "16", "--quiet"]


@pytest.mark.slow  # trains
def test_runs_that_degrade_or_diverge_say_when_and_how(cli, tmp_path):
  out = tmp_path / "degraded"
  result = cli("run", *SMALL, "--algorithms", "fedavg", "--client-lr", "20", "--rounds", "4", "--eval-every", "2",
               "--out", out)
  assert result.returncode == 0, result.stderr
  (row,) = json.loads((out / "results.json").read_text())
  assert row["status"] == "degraded" and "over 10× the initial model's" in row["degraded_reason"]
  assert f"fedavg degraded: {row['degraded_reason']}" in result.stdout
  out = tmp_path / "diverged"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = cli("run", *SMALL, "--algorithms", "fedavg", "--client-lr", "1e6", "--rounds", "10", "--eval-every",
                 "5", "--out", out)
  assert result.returncode == 0, result.stderr
  (row,) = json.loads((out / "results.json").read_text())
  assert row["status"] == "diverged between rounds 1 and 5 (seen at the evaluation of round 5)"
  assert row["diverged_between"] == [1, 5] and row["rounds"] == 5
  said = [str(w.message) for w in caught if "diverged" in str(w.message)]  # the driver's "at round 5" held back
  assert said == [f"fedavg {row['status']}: {row['diverged_reason']}; training stopped there"], said


@pytest.mark.slow  # trains
def test_dane_runs_on_two_clients_whatever_clients_per_round_says(cli, tmp_path):
  out = tmp_path / "run"
  result = cli("run", "--dataset", "libsvm:" + _libsvm(tmp_path), "--num-clients", "2", "--algorithms", "dane",
               "--rounds", "2", "--quiet", "--out", out)
  assert result.returncode == 0, result.stderr
  (row,) = json.loads((out / "results.json").read_text())
  assert row["status"] == "finished" and row["rounds"] == 2
