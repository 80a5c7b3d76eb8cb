"""tools/mutation.py's bookkeeping: mutants named by their change, and the selection by function and by change.

Pure Python on a small file written the way mutmut 3 writes a mutated module (one `x_<function>__mutmut_orig`
and one `x_<function>__mutmut_<k>` per mutant); mutmut itself is not needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
from unittest import mock

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "tools" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutation)

MUTATED = '''\
import jax.numpy as jnp

def x_scale__mutmut_orig(x, a):
    y = a * x
    return y + 1

def x_scale__mutmut_1(x, a):
    y = a / x
    return y + 1

def x_scale__mutmut_2(x, a):
    y = a * x
    return y + 2

def x_clip__mutmut_orig(x):
    return jnp.clip(x, 0, 1)

def x_clip__mutmut_1(x):
    return jnp.clip(x, 1, 1)
x_scale__mutmut_mutants = {}
'''


def _changes(tmp_path):
  path = tmp_path / "fedavg.py"
  path.write_text(MUTATED)
  return mutation._changes(path, "fedavg")


def test_each_mutant_is_named_by_its_function_and_changed_lines(tmp_path):
  changes = _changes(tmp_path)
  prefix = "fedjax_opt.algorithms.fedavg."
  assert set(changes) == {prefix + "x_scale__mutmut_1", prefix + "x_scale__mutmut_2", prefix + "x_clip__mutmut_1"}
  assert changes[prefix + "x_scale__mutmut_1"] == "x_scale\n-     y = a * x\n+     y = a / x"
  assert changes[prefix + "x_scale__mutmut_2"] == "x_scale\n-     return y + 1\n+     return y + 2"
  # The top-level statement after the last function is not part of its body.
  assert changes[prefix + "x_clip__mutmut_1"] == "x_clip\n-     return jnp.clip(x, 0, 1)\n+     return jnp.clip(x, 1, 1)"


def test_selection_by_function_and_by_change(tmp_path):
  changes = _changes(tmp_path)
  prefix = "fedjax_opt.algorithms.fedavg."
  assert mutation._select(changes, None, None) == list(changes)
  assert mutation._select(changes, ["clip"], None) == [prefix + "x_clip__mutmut_1"]
  survivor = changes[prefix + "x_scale__mutmut_2"]
  assert mutation._select(changes, None, {survivor}) == [prefix + "x_scale__mutmut_2"]
  assert mutation._select(changes, ["clip"], {survivor}) == []
  assert mutation._select(changes, ["scale", "clip"], {survivor}) == [prefix + "x_scale__mutmut_2"]


def test_every_module_the_tool_knows_is_a_file_with_tests():
  """A module moved into a package (or renamed) is not silently dropped from mutation testing."""
  for module, tests in mutation.TESTS_OF.items():
    assert (ROOT / mutation._path(module)).is_file(), module
    assert tests and all((ROOT / t).is_file() for t in tests), module
  assert mutation._path("matched_averaging.matching") == "fedjax_opt/algorithms/matched_averaging/matching.py"
  assert mutation._path("asynchrony.events") == "fedjax_opt/core/asynchrony/events.py"
  every_module = {str(p.relative_to(ROOT)) for package in ("algorithms/matched_averaging", "core/asynchrony")
                  for p in (ROOT / "fedjax_opt" / package).glob("*.py") if p.name != "__init__.py"}
  assert {mutation._path(m) for m in mutation._modules(["matched_averaging", "asynchrony"])} == every_module
  assert mutation._modules(["fedavg", "matched_averaging.models", "matched_averaging"])[:2] == [
      "fedavg", "matched_averaging.models"]
  assert mutation._module_of("fedjax_opt.algorithms.matched_averaging.matching.x_bbp_map__mutmut_3") == (
      "matched_averaging.matching")


def test_the_privacy_and_compression_modules_are_targets_by_their_own_names():
  """The maths outside fedjax_opt/algorithms/ (clipping and noise, masks and shares, accountant events,
  quantizers and error feedback) is reachable by a short name, and a mutant's name maps back to it."""
  paths = {m: mutation._path(m) for m in ("dp", "secure", "accounting", "compression")}
  assert paths == {"dp": "fedjax_opt/privacy/dp.py", "secure": "fedjax_opt/privacy/secure.py",
                   "accounting": "fedjax_opt/privacy/accounting.py", "compression": "fedjax_opt/compression.py"}
  assert mutation.TESTS_OF["accounting"][0] == "tests/test_accounting.py"
  assert mutation._module_of("fedjax_opt.privacy.accounting.x_round_event__mutmut_7") == "accounting"
  assert mutation._module_of("fedjax_opt.privacy.secure.x__masks__mutmut_12") == "secure"


def test_a_survivor_is_rechecked_against_every_test_file_of_its_module(tmp_path, monkeypatch):
  """mutmut runs a mutant only against the tests it saw call the mutated function, which misses tests of objects
  built at import time; the recheck runs all of the module's test files with the mutant switched on
  (`MUTANT_UNDER_TEST`), so a mutant they catch is killed, one they pass survives."""
  (tmp_path / "mutants" / "tests").mkdir(parents=True)
  (tmp_path / "mutants" / "tests" / "test_one.py").write_text(
      "import os\n\ndef test_it():\n  assert os.environ['MUTANT_UNDER_TEST'] != 'fedjax_opt.compression.x_qsgd__mutmut_2'\n")
  monkeypatch.setattr(mutation, "_test_files", lambda module: ["tests/test_one.py"])
  env = {"PATH": "/usr/bin:/bin"}
  assert mutation._recheck(tmp_path, "fedjax_opt.compression.x_qsgd__mutmut_2", env, 120) == (
      "killed", "tests/test_one.py::test_it")  # the test that caught it, for the JSON's killed_by_recheck
  assert mutation._recheck(tmp_path, "fedjax_opt.compression.x_qsgd__mutmut_3", env, 120) == ("survived", None)
  assert "tests/test_downlink.py" in mutation.TESTS_OF["compression"]  # the broadcast's compressor is tested there


def test_a_stopped_run_is_read_from_the_results_mutmut_stored(tmp_path):
  meta = tmp_path / "mutants" / "fedjax_opt" / "compression.py.meta"
  meta.parent.mkdir(parents=True)
  codes = {"fedjax_opt.compression.x_sign__mutmut_1": 1, "fedjax_opt.compression.x_sign__mutmut_2": 0,
           "fedjax_opt.compression.x_sign__mutmut_3": None, "fedjax_opt.compression.x_sign__mutmut_4": 36}
  meta.write_text(json.dumps({"exit_code_by_key": codes}))
  statuses = mutation._stored_results(tmp_path, ["compression", "dp"])
  assert statuses == {
      "fedjax_opt.compression.x_sign__mutmut_1": "killed", "fedjax_opt.compression.x_sign__mutmut_2": "survived",
      "fedjax_opt.compression.x_sign__mutmut_3": "not run", "fedjax_opt.compression.x_sign__mutmut_4": "timeout"}
  # The table counts the mutants not reached apart, and never reruns them.
  args = argparse.Namespace(no_recheck=True, timeout=1.0, out=str(tmp_path / "out.json"))
  survivor = {"fedjax_opt.compression.x_sign__mutmut_2": "x_sign\n- a\n+ b"}
  with mock.patch.object(mutation, "_changes", lambda path, module: survivor):
    assert mutation._report(tmp_path, statuses, args, {}) == 0
  assert json.loads((tmp_path / "out.json").read_text())["table"]["compression"] == {
      "mutants": 4, "killed": 1, "timeout": 1, "survived": 1, "other": 0, "rechecked": 0, "not_run": 1,
      "not_rechecked": 1}  # with --no-recheck the survivor is counted as not rechecked (36 is mutmut's timeout)


def test_survivors_and_timeouts_are_rechecked_and_the_table_counts_the_outcome(tmp_path, monkeypatch):
  """mutmut files a crashed test session (exit 255) as a timeout: those are run again as the survivors are."""
  prefix = "fedjax_opt.compression.x_sign__mutmut_"
  outcome = {prefix + "1": "killed", prefix + "2": "survived", prefix + "3": "killed"}
  monkeypatch.setattr(mutation, "_recheck",
                      lambda work, name, env, timeout: (outcome[name], "t.py::k" if outcome[name] == "killed" else None))
  monkeypatch.setattr(mutation, "_changes", lambda path, module: {prefix + "2": "x_sign\n- a\n+ b"})
  args = argparse.Namespace(no_recheck=False, timeout=1.0, out=str(tmp_path / "out.json"), jobs=2)
  statuses = {prefix + "1": "survived", prefix + "2": "survived", prefix + "3": "timeout", prefix + "4": "killed"}
  assert mutation._report(tmp_path, statuses, args, {}) == 0
  written = json.loads((tmp_path / "out.json").read_text())
  assert written["table"]["compression"] == {"mutants": 4, "killed": 3, "timeout": 0, "survived": 1, "other": 0,
                                             "rechecked": 2}
  assert written["survivors"] == {"compression": [prefix + "2"]}
  assert written["killed_by_recheck"] == {prefix + "1": "t.py::k", prefix + "3": "t.py::k"}


def test_a_mutant_stopped_for_its_cpu_time_is_not_rechecked(tmp_path, monkeypatch):
  """A session that crashed (mutmut's exit 255, filed as a timeout) is run again; a mutant mutmut stopped with
  SIGXCPU (exit 24/-24/152: its tests ran far longer than the clean run, e.g. a loop that no longer ends) stays a
  timeout without a second, equally long run."""
  prefix = "fedjax_opt.compression.x_sign__mutmut_"
  meta = tmp_path / "mutants" / "fedjax_opt" / "compression.py.meta"
  meta.parent.mkdir(parents=True)
  meta.write_text(json.dumps({"exit_code_by_key": {prefix + "1": 255, prefix + "2": -24, prefix + "3": 0,
                                                    prefix + "4": 33}}))  # 33: no test selected
  rechecked = []
  monkeypatch.setattr(mutation, "_recheck", lambda work, name, env, timeout: rechecked.append(name) or ("killed", "t.py::k"))
  args = argparse.Namespace(no_recheck=False, timeout=1.0, out=None, jobs=1)
  assert mutation._report(tmp_path, mutation._stored_results(tmp_path, ["compression"]), args, {}) == 0
  assert sorted(rechecked) == [prefix + "1", prefix + "3", prefix + "4"]
  assert "timeout_multiplier = 2.5" in mutation._config(["compression"], 30.0)


def test_a_method_s_mutants_are_named_by_their_change_too(tmp_path):
  """mutmut 3 writes a method's mutants indented in their class as `xǁ<Class>ǁ<method>__mutmut_<k>`; each is read
  up to the next statement at the class's level or the method's."""
  path = tmp_path / "attacks.py"
  path.write_text('''\
class Take:
  def xǁTakeǁ__call____mutmut_orig(self, x):
    return x[0]

  def xǁTakeǁ__call____mutmut_1(self, x):
    return x[1]

  def other(self):
    return 2
xǁTakeǁ__call____mutmut_mutants = {}
''')
  assert mutation._changes(path, "attacks") == {
      "fedjax_opt.attacks.xǁTakeǁ__call____mutmut_1": "xǁTakeǁ__call__\n-     return x[0]\n+     return x[1]"}


def test_a_stopped_recheck_goes_on_from_the_outcomes_it_stored(tmp_path, monkeypatch):
  """Each recheck's outcome is written to WORKDIR/recheck.json as it comes: a second `--collect` reruns only the
  rest, and the outcomes stored count as if run now."""
  prefix = "fedjax_opt.compression.x_sign__mutmut_"
  (tmp_path / "recheck.json").write_text(json.dumps({prefix + "1": ["killed", "t.py::k"]}))
  rechecked = []
  monkeypatch.setattr(mutation, "_recheck", lambda work, name, env, timeout: rechecked.append(name) or ("survived",
                                                                                                       None))
  monkeypatch.setattr(mutation, "_changes", lambda path, module: {prefix + "2": "x_sign\n- a\n+ b"})
  args = argparse.Namespace(no_recheck=False, timeout=1.0, out=str(tmp_path / "out.json"), jobs=1)
  assert mutation._report(tmp_path, {prefix + "1": "survived", prefix + "2": "survived"}, args, {}) == 0
  assert rechecked == [prefix + "2"]
  written = json.loads((tmp_path / "out.json").read_text())
  assert written["table"]["compression"]["killed"] == 1 and written["killed_by_recheck"] == {prefix + "1": "t.py::k"}
  assert json.loads((tmp_path / "recheck.json").read_text())[prefix + "2"] == ["survived", None]
