"""The package's layering, read from the source: who may import whom, and what each module exports.

The rules:

* `fedjax_opt.core` is the ground floor: it imports nothing from `fedjax_opt`
  outside `fedjax_opt.core`, not even inside a function;
* algorithm families do not import each other: `fedjax_opt.algorithms.X`
  imports no `fedjax_opt.algorithms.Y` (a family split into a package imports
  its own submodules);
* no module imports another module's private (`_name`) names;
* every public module has `__all__`, and every name in it exists.

Imports are read with `ast`, at module level and inside functions alike.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import textwrap

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "fedjax_opt"


LAYOUT_CHANGING = ()
"""Modules (and packages) without `__all__` for now."""


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}
"""Every module of the package, by dotted name."""


def _is_package(name: str) -> bool:
  return MODULES[name].name == "__init__.py"


def _is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_public(name: str) -> bool:
  return not any(part.startswith("_") for part in name.split("."))


def imports(source: str, module: str) -> list[tuple[str, str | None, int]]:
  """(imported module, name imported from it or None, line) for every import in `source`, nested ones too.

  `from P import n` counts as an import of the module `P.n` when `P.n` is a
  module of the package, else as an import of the name `n` from `P`. Relative
  imports are resolved against `module`.
  """
  package = module if _is_package(module) else module.rpartition(".")[0]
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      out.extend((alias.name, None, node.lineno) for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        out.append((submodule, None, node.lineno) if submodule in MODULES else (base, alias.name, node.lineno))
  return out


def _all_imports():
  for module, path in MODULES.items():
    for target, name, line in imports(path.read_text(), module):
      yield module, target, name, f"{path.relative_to(PACKAGE_DIR.parent)}:{line}"


def _within(target: str, package: str) -> bool:
  return target == package or target.startswith(package + ".")


def upward_imports() -> list[tuple[str, str, str]]:
  """(core module, imported fedjax_opt module outside core, where) for every import out of the ground floor."""
  return [(module, target, where) for module, target, _, where in _all_imports()
          if _within(module, "fedjax_opt.core") and _within(target, "fedjax_opt")
          and not _within(target, "fedjax_opt.core")]


def sideways_imports() -> list[str]:
  out = []
  for module, target, _, where in _all_imports():
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["fedjax_opt", "algorithms"]:
      continue  # the package itself (`fedjax_opt.algorithms`) gathers every family
    family = ".".join(parts[:3])
    if _within(target, "fedjax_opt.algorithms") and not _within(target, family):
      out.append(f"{where}: {module} imports {target}")
  return out


def private_imports() -> list[str]:
  out = []
  for module, target, name, where in _all_imports():
    if not _within(target, "fedjax_opt") or target == module:
      continue
    if name is not None and _is_private(name):
      out.append(f"{where}: {module} imports {name} from {target}")
    elif name is None and not _is_public(target) and not _within(target, module.rpartition(".")[0] or module):
      out.append(f"{where}: {module} imports the private module {target}")
  return out


def test_the_import_reader_sees_nested_relative_and_submodule_imports():
  source = textwrap.dedent("""
      import numpy as np
      from fedjax_opt import graphs, core
      from fedjax_opt.core.types import ClientBatches

      def f():
        from fedjax_opt.compression import _private
        from . import tree
        from ..aggregators import robust
  """)
  assert imports(source, "fedjax_opt.core.rounds") == [
      ("numpy", None, 2), ("fedjax_opt.graphs", None, 3), ("fedjax_opt.core", None, 3),
      ("fedjax_opt.core.types", "ClientBatches", 4), ("fedjax_opt.compression", "_private", 7),
      ("fedjax_opt.core.tree", None, 8), ("fedjax_opt.aggregators.robust", None, 9)]


def test_core_imports_nothing_above_it():
  found = [f"{where}: {module} imports {target}" for module, target, where in upward_imports()]
  assert not found, "fedjax_opt.core must not import from the floors above it:\n" + "\n".join(found)


def test_algorithm_families_do_not_import_each_other():
  found = sideways_imports()
  assert not found, "shared mechanics belong in fedjax_opt.core:\n" + "\n".join(found)


def test_no_module_imports_private_names_of_another():
  found = private_imports()
  assert not found, "make the name public (in fedjax_opt.core if it is shared) or keep it in its module:\n" + (
      "\n".join(found))


def _declares_all(tree: ast.Module) -> bool:
  for node in tree.body:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    for target in targets:
      names = target.elts if isinstance(target, ast.Tuple) else [target]
      if any(isinstance(n, ast.Name) and n.id == "__all__" for n in names):
        return True
  return False


PUBLIC = sorted(name for name in MODULES if _is_public(name))


def test_every_public_module_declares_all():
  missing = [name for name in PUBLIC if not _declares_all(ast.parse(MODULES[name].read_text()))
             and not any(_within(name, m) for m in LAYOUT_CHANGING)]
  assert not missing, f"public modules without __all__: {missing}"


def test_every_name_in_all_exists():
  missing = []
  for name in PUBLIC:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", ())
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
    missing += [f"{name}.{n}" for n in exported if not hasattr(module, n)]
  assert not missing, f"listed in __all__ but not defined: {missing}"


LAZY_PACKAGES = ["fedjax_opt", "fedjax_opt.core", "fedjax_opt.algorithms"]


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_lazy_packages_type_checking_imports_are_its_exports(package):
  """The `if TYPE_CHECKING:` imports (what static tools read) bind exactly `__all__`, to the same objects."""
  module = importlib.import_module(package)
  tree = ast.parse(MODULES[package].read_text())
  block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
  bound = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom), ast.unparse(node)
    for alias in node.names:
      submodule = f"{node.module}.{alias.name}"
      bound[alias.asname or alias.name] = (importlib.import_module(submodule) if submodule in MODULES else
                                           getattr(importlib.import_module(node.module), alias.name))
  assert sorted(bound) == sorted(module.__all__)
  differ = [name for name, value in bound.items() if getattr(module, name) is not value]
  assert not differ, f"{package}: the TYPE_CHECKING imports and the lazy exports bind different objects to {differ}"


def test_import_fedjax_opt_and_a_cli_usage_error_load_no_jax_and_one_family_loads_alone():
  script = textwrap.dedent("""
      import contextlib, io, sys
      loaded = lambda prefix: sorted(m for m in sys.modules if m == prefix or m.startswith(prefix + "."))
      import fedjax_opt as fo
      print("jax" in sys.modules, loaded("fedjax_opt.algorithms"), loaded("fedjax_opt.data"))
      from fedjax_opt import cli
      with contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["run", "--algorithms", "nosuch"])
      print(code, "jax" in sys.modules)
      from fedjax_opt.algorithms import fedavg
      print(loaded("fedjax_opt.algorithms"), fo.algorithms.fedavg is fedavg, callable(fo.train))
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          cwd=PACKAGE_DIR.parent)
  lines = result.stdout.splitlines()
  assert lines[0] == "False [] []", "import fedjax_opt loads JAX (True) or subpackages"
  assert lines[1] == "2 False", "a usage error of the command line loads JAX"
  assert lines[2] == "['fedjax_opt.algorithms', 'fedjax_opt.algorithms.fedavg'] True True"
