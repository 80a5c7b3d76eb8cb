"""`fedjax-opt` as a user runs it: exit codes, one-line errors, files written.

Usage errors run in this process (the `cli` fixture: `cli.main(argv)`); a
real run from a config file and its resume run as a subprocess, in the slow tier.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

CLI = [sys.executable, "-m", "fedjax_opt.cli"]


def run_cli(*args, cwd=None):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


@pytest.mark.parametrize("args,needle", [
    (["run", "--algorithms", "fedfoo"], "unknown algorithm 'fedfoo'; choose from fedsgd, fedavg"),
    (["run", "--algorithms", "fedavg,fedavg"], "fedavg is listed twice in --algorithms"),
    (["run", "--dataset", "cifar10"], "unknown dataset 'cifar10'; choose from digits, mnist5k"),
    (["run", "--clients-per-round", "200"],
     "--clients-per-round 200 exceeds the 100 clients of 'mnist5k' (--num-clients): fedavg, fedadam draw(s)"),
    (["run", "--client-lr", "0"], "--client-lr must be a positive number; got '0'"),
    (["run", "--server-lr", "-1"], "--server-lr must be a positive number; got '-1'"),
    (["run", "--algorithms", "feddyn,fedavg", "--server-lr", "0.5"], "--server-lr does not apply to feddyn"),
    (["run", "--alpha", "0"], "--alpha must be a positive number; got '0'"),
    (["run", "--prox-mu", "0.1"], "--prox-mu was replaced by --set fedprox.mu=VALUE"),
    (["run", "--set", "ditto.lam=0.1"], "--set ditto.… is given but ditto is not in --algorithms (fedavg,fedadam)"),
    (["run", "--algorithms", "ditto", "--set", "ditto.lamb=0.1"], "ditto has no hyper-parameter 'lamb'; settable:"),
    (["run", "--algorithms", "ditto", "--set", "ditto.lam=abc"], "ditto.lam must be a finite number; got 'abc'"),
    (["run", "--algorithms", "ditto", "--set", "ditto.personal_steps=2.5"],
     "ditto.personal_steps must be an integer; got 2.5"),
    (["run", "--set", "fedavg"], "--set takes ALGORITHM.NAME=VALUE, e.g. ditto.lam=0.1; got 'fedavg'"),
    (["run", "--dataset", "synthetic_1_1", "--partition", "iid"], "--partition does not apply to 'synthetic_1_1'"),
    (["run", "--partition", "iid", "--alpha", "0.3"], "--alpha applies to --partition dirichlet only"),
    (["run", "--dataset", "shakespeare", "--partition", "iid"], "--partition does not apply to 'shakespeare'"),
    (["run", "--algorithms", "admm_consensus", "--model", "mlp"], "admm_consensus need(s) a convex model"),
    (["run", "--partition", "zipf"], "unknown partition 'zipf'; choose from iid, dirichlet"),
    (["run", "--rounds", "ten"], "--rounds must be a positive integer; got 'ten'"),
    (["run", "--seed", "-1"], "--seed must be an integer from 0 to 2147483647; got '-1'"),
    (["run", "--seed", "2147483648"], "--seed must be an integer from 0 to 2147483647; got '2147483648'"),
    (["run", "--config", "/nonexistent/exp.toml"], "cannot read config '/nonexistent/exp.toml'"),
    (["run", "--client-map", "chunked:0"], "bad --client-map 'chunked:0': client_map must be one of"),
    (["run", "--devices", "2", "--client-map", "vmap"],
     "--devices 2 shards the clients over 2 devices, but --client-map vmap runs them on one; use --client-map auto "
     "or sharded:vmap"),
    (["run", "--devices", "0"], "--devices must be a positive integer or auto; got '0'"),
    (["run", "--resume"], "--resume needs --out DIR"),
    (["run", "--resume", "--overwrite", "--out", "x"], "--resume continues the run in --out and --overwrite"),
    (["run", "--aggregator", "median"], "unknown aggregator 'median'; choose from weighted_mean, mean"),
    (["run", "--attack", "poison"], "unknown attack 'poison'; choose from gaussian, omniscient"),
    (["run", "--attackers", "0.2"], "--attackers needs --attack NAME"),
    (["run", "--attack", "omniscient", "--attackers", "1.5"], "--attackers is the fraction of attacking clients"),
    (["run", "--algorithms", "fedavg,l2gd", "--aggregator", "krum"],
     "--aggregator krum needs algorithms whose factory takes aggregator=; l2gd takes none: L2GD's aggregation step "
     "pulls each x_i towards the exact average"),
    (["run", "--set", "attack.factor=3"], "--set attack.… is given without --attack NAME"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_input_exits_2_with_one_line(cli, args, needle):
  result = cli(*args)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert needle in lines[0]
  assert "Traceback" not in result.stderr


def test_bad_config_values_exit_2(cli, tmp_path):
  bad_toml = tmp_path / "bad.toml"
  bad_toml.write_text("rounds = [\n")
  assert "is not valid TOML" in cli("run", "--config", str(bad_toml)).stderr
  unknown = tmp_path / "unknown.toml"
  unknown.write_text("learning_rate = 0.1\n")
  result = cli("run", "--config", str(unknown))
  assert result.returncode == 2 and "unknown key(s) ['learning_rate']" in result.stderr
  negative = tmp_path / "neg.toml"
  negative.write_text("alpha = -0.5\n")
  result = cli("run", "--config", str(negative))
  assert result.returncode == 2 and "alpha must be a positive number; got -0.5" in result.stderr
  negative_seed = tmp_path / "seed.toml"
  negative_seed.write_text("seed = -1\n")
  result = cli("run", "--config", str(negative_seed))
  assert result.returncode == 2 and "seed must be an integer from 0 to 2147483647; got -1" in result.stderr
  negative_seed.write_text("seed = 2147483647\nseeds = 2\n")
  result = cli("run", "--config", str(negative_seed))
  assert result.returncode == 2 and "seed must be an integer from 0 to 2147483646 (with --seeds 2" in result.stderr
  for value, shown in (("0", "0"), ('"many"', "'many'")):
    devices = tmp_path / "devices.toml"
    devices.write_text(f"devices = {value}\n")
    result = cli("run", "--config", str(devices), "--out", str(tmp_path / "never"))
    assert result.returncode == 2 and f"devices must be a positive integer or auto; got {shown}" in result.stderr
    assert not (tmp_path / "never").exists()


def test_list_names_every_choice(cli):
  result = cli("list")
  assert result.returncode == 0
  for name in ("fedavg", "fedadam", "fedyogi", "fedprox", "scaffold", "fednova", "feddyn", "mnist5k", "digits",
               "synthetic_1_1", "dirichlet", "shards", "cnn"):
    assert name in result.stdout


@pytest.mark.slow
def test_small_run_from_a_config_file_writes_results(tmp_path):
  """A short run on digits from TOML: progress, a results table, history, config and two PNG plots."""
  config = tmp_path / "exp.toml"
  config.write_text('algorithms = ["fedavg", "fedyogi"]\ndataset = "digits"\nnum_clients = 20\nrounds = 30\n'
                    'eval_every = 10\nclients_per_round = 5\nlocal_steps = 5\nbatch_size = 16\nclient_lr = 0.1\n'
                    'client_map = "chunked:4"\n')
  out = tmp_path / "out"
  result = run_cli("run", "--config", str(config), "--out", str(out), "--rounds", "20")  # the flag wins over the file
  assert result.returncode == 0, result.stderr
  assert "[fedyogi] round 20/20" in result.stdout
  assert "algorithm" in result.stdout and "rounds/s" in result.stdout
  for name in ("config.json", "history.json", "results.json", "accuracy.png", "loss.png"):
    assert (out / name).stat().st_size > 0
  results = json.loads((out / "results.json").read_text())
  assert [r["algorithm"] for r in results] == ["fedavg", "fedyogi"]
  assert all(r["rounds"] == 20 for r in results)
  # Digits with 20 rounds of FedAvg is well above chance (10%).
  assert results[0]["test_accuracy"] > 0.5
  history = json.loads((out / "history.json").read_text())
  assert len(history["fedavg"]["round_metrics"]["client_loss"]) == 20
  assert json.loads((out / "config.json").read_text())["rounds"] == 20

  # --resume with a larger budget continues from the checkpoints instead of starting over.
  again = run_cli("run", "--config", str(config), "--out", str(out), "--rounds", "30", "--resume", "--quiet")
  assert again.returncode == 0, again.stderr
  history = json.loads((out / "history.json").read_text())
  assert len(history["fedavg"]["round_metrics"]["client_loss"]) == 30


def test_a_reused_out_folder_is_refused_and_left_untouched(cli, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "config.json").write_text('{"rounds": 7}')
  result = cli("run", "--dataset", "digits", "--rounds", "2", "--out", str(out))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      f"fedjax-opt: error: --out {out} already holds a run; continue it with --resume, replace it with "
      f"--overwrite, or choose another folder"]
  assert sorted(p.name for p in out.iterdir()) == ["config.json"]
  assert (out / "config.json").read_text() == '{"rounds": 7}'


def _unwritable_folder(tmp_path):
  """A folder in which nothing can be made: read-only permission bits, or (for root, whom they do not stop) /sys."""
  locked = tmp_path / "locked"
  locked.mkdir()
  locked.chmod(0o555)
  for folder in (str(locked), "/sys"):
    try:
      os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError:
      return folder
  raise AssertionError("no unwritable folder to test with")


def test_an_out_folder_that_cannot_be_made_is_one_line_and_nothing_is_created(cli, tmp_path, monkeypatch):
  (tmp_path / "notes.txt").write_text("mine")
  before = sorted(p.name for p in tmp_path.iterdir())
  under_a_file = tmp_path / "notes.txt" / "run"
  result = cli("run", "--dataset", "digits", "--rounds", "1", "--out", str(under_a_file))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      f"fedjax-opt: error: --out {under_a_file}: {tmp_path / 'notes.txt'} is a file, not a folder"]
  unwritable = _unwritable_folder(tmp_path)
  result = cli("run", "--dataset", "digits", "--rounds", "1", "--out", os.path.join(unwritable, "run"))
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"fedjax-opt: error: --out {unwritable}/run: cannot write in {unwritable} ("), result.stderr
  assert not os.path.exists(os.path.join(unwritable, "run"))
  monkeypatch.chdir(tmp_path)  # where the default folder, runs/<dataset>-<time>, would go
  result = cli("run", "--dataset", "digits", "--rounds", "1", "--out", "")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "fedjax-opt: error: --out is empty: give the run folder, or leave --out out for runs/<dataset>-<time>"]
  (tmp_path / "locked").chmod(0o755)
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["locked"])
  assert not os.listdir(tmp_path / "locked")


def test_a_bad_hyper_parameter_value_is_the_factory_s_one_line(cli, tmp_path):
  result = cli("run", "--dataset", "digits", "--algorithms", "ditto", "--set", "ditto.lam=-1", "--out",
                   str(tmp_path / "out"))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == ["fedjax-opt: error: ditto: lam must be finite and >= 0; got -1.0."]
  assert not (tmp_path / "out").exists()  # nothing is written before every algorithm is built


def test_a_bad_aggregator_parameter_is_one_line(cli, tmp_path):
  result = cli("run", "--dataset", "digits", "--aggregator", "krum", "--set", "aggregator.f=2", "--out",
                   str(tmp_path / "out"))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "fedjax-opt: error: aggregator krum has no parameter 'f'; settable: num_byzantine"]


def test_toml_sections_set_hyper_parameters_and_are_checked(cli, tmp_path):
  bad = tmp_path / "bad.toml"
  bad.write_text('algorithms = "ditto"\n[dito]\nlam = 0.5\n')
  result = cli("run", "--config", str(bad))
  assert result.returncode == 2 and "section [dito] is not an algorithm" in result.stderr
  bad.write_text('algorithms = "ditto"\ndataset = "digits"\n[ditto]\nlam = "big"\n')
  result = cli("run", "--config", str(bad))
  assert result.returncode == 2 and "ditto.lam must be a finite number; got 'big'" in result.stderr


def test_the_compile_cache_folder_from_the_flag_the_environment_or_the_home(monkeypatch, tmp_path):
  from fedjax_opt.cli.run import compile_cache_dir  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("FEDJAX_OPT_COMPILE_CACHE", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache_dir(None) == str(tmp_path / "xdg" / "fedjax_opt" / "xla")
  monkeypatch.setenv("FEDJAX_OPT_COMPILE_CACHE", str(tmp_path / "env"))
  assert compile_cache_dir(None) == str(tmp_path / "env")
  assert compile_cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")
  assert compile_cache_dir("off") is None


def test_the_results_table_writes_values_as_the_progress_lines_do():
  """No train loss (L2GD, the ADMM family): `–`, as in the progress lines; a diverged loss in scientific notation."""
  import re  # pylint: disable=import-outside-toplevel

  from fedjax_opt.cli import report  # pylint: disable=import-outside-toplevel

  base = dict(rounds=3, megabytes_sent=1.0, wall_seconds=1.0, compile_seconds=0.5, status="finished")
  rows = [dict(base, algorithm="l2gd", test_accuracy=0.5, test_loss=0.75),  # no train_loss: not reported
          dict(base, algorithm="fedavg", test_accuracy=0.25, test_loss=2.5e33, train_loss=float("nan"),
               status="diverged at round 3")]
  header, _, l2gd, fedavg = report.results_table(rows).splitlines()[:4]
  cells = [dict(zip(re.split(r"\s{2,}", header.strip()), re.split(r"\s{2,}", line.strip()))) for line in (l2gd, fedavg)]
  assert cells[0]["train loss"] == "–" and cells[0]["test loss"] == "0.7500"
  assert cells[1]["test loss"] == "2.500e+33" and cells[1]["train loss"] == "nan"  # reported, and not a number


def test_resume_help_docs_and_code_agree_on_what_may_change(tmp_path):
  """--help said only --rounds may grow; docs/cli.md named two more; the code accepts five."""
  from fedjax_opt.cli import config as config_lib  # pylint: disable=import-outside-toplevel

  out = tmp_path / "run"
  out.mkdir()
  saved = dict(config_lib.DEFAULTS, dataset="digits", num_clients=20, partition="dirichlet", alpha=0.5)
  (out / "config.json").write_text(json.dumps(saved))
  changed = {"rounds": 400, "checkpoint_every": 9, "quiet": True, "compile_cache": "off", "devices": 1}
  resumed = config_lib.for_resume(str(out), changed)  # what the code accepts
  assert {k: resumed[k] for k in changed} == changed
  for key, value in (("eval_every", 5), ("batch_size", 7), ("seed", 3)):
    with pytest.raises(config_lib.UsageError, match="conflicts with the run saved"):
      config_lib.for_resume(str(out), {key: value})
  flags = [f"--{k.replace('_', '-')}" for k in changed]
  parser = config_lib.build_parser()
  run = parser._subparsers._group_actions[0].choices["run"]  # pylint: disable=protected-access
  help_text = next(a.help for a in run._actions if "--resume" in a.option_strings)  # pylint: disable=protected-access
  docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
  row = next(line for line in docs.splitlines() if line.startswith("| `run --out DIR --resume [--rounds R]`"))
  for text in (help_text, row):
    assert all(flag in text for flag in flags), text
    assert "only --rounds" not in text


def test_list_says_the_rule_auto_applies_and_how_synthetic_alpha_beta_are_chosen(cli):
  """`list models` said "mlp for images" while digits got logistic regression; `list datasets` offered alpha=, beta=
  for synthetic, which the command line refuses."""
  import re  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel

  import numpy as np  # pylint: disable=import-outside-toplevel

  from fedjax_opt.cli import config as config_lib  # pylint: disable=import-outside-toplevel
  from fedjax_opt.cli import run as run_lib  # pylint: disable=import-outside-toplevel

  auto = next(line for line in cli("list", "models").stdout.splitlines() if line.strip().startswith("auto"))
  pixels = int(re.search(r"images of fewer than (\d+) pixels \(digits, 8×8\)", auto).group(1))
  config = dict(config_lib.DEFAULTS, algorithms="fedavg", dataset="custom")

  def images(*shape):
    return types.SimpleNamespace(sequence_length=0, examples={"x": np.zeros((2, 3, *shape), np.float32)})

  assert run_lib.model_choice(config, images(8, 8)) == "logreg"  # digits
  assert run_lib.model_choice(config, images(28, 28)) == "mlp"  # mnist5k, fashion_mnist
  assert run_lib.model_choice(config, images(pixels - 1, 1)) == "logreg"
  assert run_lib.model_choice(config, images(pixels, 1)) == "mlp"
  assert run_lib.model_choice(config, images(pixels)) == "logreg"  # a feature vector, however long
  assert run_lib.model_choice(dict(config, algorithms="fedma"), images(8, 8)) == "mlp"
  assert "whenever fedma runs" in auto
  listing = cli("list", "datasets").stdout.splitlines()
  synthetic = next(line for line in listing if line.strip().startswith("synthetic "))
  assert "pass alpha=" not in synthetic and "synthetic_0.5_0.5" in synthetic and "fo.data.load" in synthetic
  result = cli("run", "--dataset", "synthetic", "--alpha", "0.5")
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "--alpha does not apply to 'synthetic'" in lines[0]
  assert "chosen by name: synthetic_0_0, synthetic_0.5_0.5, synthetic_1_1" in lines[0]
