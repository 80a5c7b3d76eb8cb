"""`fedjax-opt run --dp-*` (ε in results.json, a resumed run keeps its solved noise, bad flags exit 2 with one
line) and the python blocks of docs/privacy.md."""

from __future__ import annotations

import os
import re

import pytest

import fedjax_opt as fo

P = fo.privacy
DELTA = 1e-5



@pytest.mark.slow  # subprocess runs
def test_a_short_dp_run_writes_epsilon_and_resumes_with_its_solved_noise(tmp_path):
  import json

  from tests.test_cli import run_cli
  from tests.test_cli_runs import SMALL

  out = tmp_path / "run"
  result = run_cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "5", "--dp-epsilon", "8", "--dp-clip", "0.5",
                   "--out", str(out))
  assert result.returncode == 0, result.stderr
  assert "ε" in result.stdout and "client-level" in result.stdout
  config = json.loads((out / "config.json").read_text())
  sigma = config["dp_noise_multiplier"]
  row = json.loads((out / "results.json").read_text())[0]
  sampling = P.Sampling.fixed(20, 5)
  assert row["dp_epsilon"] == pytest.approx(P.epsilons(sigma, delta=DELTA, sampling=sampling, at=[5])[0])
  assert row["dp_epsilon"] <= 8 and row["dp_epsilon"] == pytest.approx(8, rel=1e-2)
  assert row["privacy"]["epsilon_at_rounds"] == pytest.approx({"5": row["dp_epsilon"]})
  assert row["privacy"]["neighboring_relation"] == "REPLACE_ONE"
  history = json.loads((out / "history.json").read_text())
  assert history["fedavg"]["dp_epsilon"] == row["privacy"]["epsilon_at_rounds"]
  # --resume needs none of the --dp-* flags again and keeps σ; more rounds spend more ε.
  result = run_cli("run", "--out", str(out), "--resume", "--rounds", "10", "--quiet")
  assert result.returncode == 0, result.stderr
  row = json.loads((out / "results.json").read_text())[0]
  assert row["privacy"]["noise_multiplier"] == sigma and row["rounds"] == 10
  assert row["dp_epsilon"] == pytest.approx(P.epsilons(sigma, delta=DELTA, sampling=sampling, at=[10])[0])
  assert row["dp_epsilon"] > 8


@pytest.mark.parametrize("args,needle", [
    (["--dp-noise", "1", "--dp-epsilon", "3", "--dp-clip", "1"], "give --dp-noise (the noise multiplier) or"),
    (["--dp-noise", "1"], "differential privacy needs --dp-clip C"),
    (["--dp-clip", "1"], "--dp-clip needs --dp-noise SIGMA or --dp-epsilon EPS"),
    (["--dp-noise", "1", "--dp-clip", "1", "--algorithms", "fedavg,scaffold"], "not scaffold"),
    (["--dp-noise", "1", "--dp-clip", "1", "--aggregator", "krum"], "--aggregator krum cannot be used with them"),
    (["--dp-noise", "1", "--dp-clip", "1", "--dp-accountant", "pld"], "use --dp-accountant rdp, or --dp-sampling"),
    (["--dp-noise", "1", "--dp-clip", "1", "--dp-delta", "2"], "--dp-delta must be a number in (0, 1)"),
    (["--dp-noise", "1", "--dp-clip", "1", "--dp-clip-lr", "0.1"], "give --dp-quantile GAMMA too"),
])
def test_bad_dp_flags_exit_2_with_one_line(cli, args, needle):
  result = cli("run", *args)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr


@pytest.mark.slow  # executes the documents
def test_the_python_blocks_of_docs_privacy_md_run(capsys):
  with open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "privacy.md"), encoding="utf-8") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
  assert blocks
  namespace = {}
  for i, block in enumerate(blocks):
    exec(compile(block, f"docs/privacy.md block {i}", "exec"), namespace)  # pylint: disable=exec-used
  eps = namespace["eps"]
  assert eps.shape == (20,) and float(eps[-1]) == pytest.approx(
      P.epsilons(1.0, at=[20], delta=DELTA, sampling=P.Sampling.fixed(20, 5))[0])
  assert "ε(δ = 1e-5) after 20 rounds" in capsys.readouterr().out
  assert int(namespace["state"].round) == 20
