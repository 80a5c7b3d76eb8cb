"""The LibSVM example shipped with the package: its recipe, its packaging, and the command docs/cli.md runs on it."""

import contextlib
import importlib.util
import io
import json
import os
import pathlib
import re
import shlex
import sys
import tomllib
from fnmatch import fnmatch

import numpy as np
import pytest

import fedjax_opt as fo

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_example_data", ROOT / "tools" / "make_example_data.py")
make_example_data = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = make_example_data
_spec.loader.exec_module(make_example_data)


def test_example_path_is_the_file_inside_the_package():
  path = fo.data.example_path("libsvm")
  assert os.path.isfile(path) and path == fo.data.example_path()
  assert pathlib.Path(path).parent == pathlib.Path(fo.data.__file__).parent / "examples"
  with pytest.raises(ValueError, match=r"^no example file of kind 'csv'; there are: libsvm\.$"):
    fo.data.example_path("csv")


def test_the_example_holds_the_published_recipe_as_scikit_learn_reads_it():
  """The recipe (make_classification, seed 0, scaled, rounded) gives the file's values; scikit-learn's own reader
  and ours read the same."""
  from sklearn.datasets import load_svmlight_file

  path = fo.data.example_path("libsvm")
  x, y = make_example_data.example_arrays()
  ref_x, ref_y = load_svmlight_file(path, n_features=10, zero_based=False)
  np.testing.assert_array_equal(ref_x.toarray(), x)
  np.testing.assert_array_equal(ref_y, y)
  ours = fo.data.read_svmlight(path)
  assert ours["x"].shape == (300, 10) and ours["x"].dtype == np.float32
  np.testing.assert_array_equal(ours["x"], x.astype(np.float32))
  np.testing.assert_array_equal(ours["y"], (y > 0).astype(np.int32))
  assert np.abs(x).max() == 1.0 and sorted(np.unique(y)) == [-1, 1]
  assert make_example_data.matches(pathlib.Path(path))
  header = pathlib.Path(path).read_text(encoding="utf-8").split("\n", 4)[3]
  assert "tools/make_example_data.py" in header and "random_state=0" in header


def test_pyproject_ships_the_examples_as_package_data():
  """Without a package-data entry setuptools leaves the .svm out of the wheel (and fo.data.example_path names a
  file that is not installed)."""
  with open(ROOT / "pyproject.toml", "rb") as f:
    patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["fedjax_opt.data"]
  folder = ROOT / "fedjax_opt" / "data"
  files = [p.relative_to(folder).as_posix() for p in (folder / "examples").iterdir() if p.is_file()]
  assert files and all(any(fnmatch(f, pattern) for pattern in patterns) for f in files), (files, patterns)
  assert set(fo.data.EXAMPLES.values()) <= {pathlib.PurePath(f).name for f in files}


def _documented_commands():
  """The two command lines of docs/cli.md's example run: the path, then `fedjax-opt run` on it."""
  text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
  block = next(b for b in re.findall(r"```text\n(.*?)```", text, flags=re.S) if "libsvm:$EXAMPLE" in b)
  lines = [line[2:] for line in block.splitlines() if line.startswith("$ ")]
  assert len(lines) == 2 and lines[0].startswith("EXAMPLE=$(python -c ") and lines[1].startswith("fedjax-opt run ")
  return lines, block


def test_the_documented_way_to_the_example_gives_its_path():
  (path_line, _), _ = _documented_commands()
  code = shlex.split(path_line[len("EXAMPLE=$("):-1])[2]  # python -c CODE
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(code, {})  # pylint: disable=exec-used
  assert printed.getvalue().strip() == fo.data.example_path("libsvm")


def test_the_documented_command_runs_on_the_example(cli, tmp_path):
  """docs/cli.md's command, in this process, with 1 round: every algorithm it names finishes, in the table's order,
  and no objective gap is negative."""
  (_, run_line), block = _documented_commands()
  args = shlex.split(run_line.replace("$EXAMPLE", fo.data.example_path("libsvm")))[1:]
  for flag, value in (("--rounds", "1"), ("--eval-every", "1")):
    args[args.index(flag) + 1] = value
  out = tmp_path / "run"
  result = cli(*args, "--out", out, "--quiet")
  assert result.returncode == 0, result.stdout + result.stderr
  documented = [line.split()[0] for line in block.split("-----\n", 1)[1].splitlines() if line.strip()]
  rows = json.loads((out / "results.json").read_text())
  assert [r["algorithm"] for r in rows] == documented == args[args.index("--algorithms") + 1].split(",")
  for r in rows:
    assert r["status"] == "finished" and r["objective_gap"] >= 0, r
    assert r["objective_star"] <= min(r["objective"], r["objective_reference"]), r
