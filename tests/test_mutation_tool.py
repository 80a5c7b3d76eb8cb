"""tools/mutation.py's bookkeeping: mutants named by their change, and the selection by function and by change.

Pure Python on a small file written the way mutmut 3 writes a mutated module (one `x_<function>__mutmut_orig`
and one `x_<function>__mutmut_<k>` per mutant); mutmut itself is not needed.
"""

from __future__ import annotations

import importlib.util
import pathlib

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
