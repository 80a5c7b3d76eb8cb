"""Lazy package attributes (PEP 562): a package lists what it re-exports, and each is imported on first use.

    __getattr__, __dir__, __all__ = lazy.attach(__name__, submodules=("data",), names={
        ".core.types": ("ClientBatches",),
        ".train": ("History", "train"),
    })

`fo.data` then imports `fedjax_opt.data` the first time it is read, and
`fo.ClientBatches` imports `fedjax_opt.core.types`; the value is stored in the
package, so later reads cost a dictionary look-up. `__all__` is the exported
names in the order given, and `__dir__` adds them to `dir(package)`.

A package may export a function under the name of one of its submodules
(`fedjax_opt.train` is the training function, `fedjax_opt.algorithms.fedavg`
the FedAvg factory). The import system binds a submodule, once imported, as an
attribute of its package, which would replace such an export by the module;
`attach` makes the package keep the export instead (the module stays in
`sys.modules` under its full name, for `importlib.import_module`).

This module imports only the standard library, so a lazy package costs
nothing until one of its names is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any, Callable, Mapping, Sequence

__all__ = ["attach"]


class _LazyPackage(types.ModuleType):
  """A package module that does not let a submodule's binding overwrite a name it exports from a module."""

  def __setattr__(self, name: str, value: Any) -> None:
    if isinstance(value, types.ModuleType) and name in self.__dict__.get("_lazy_exported_attributes", ()):
      return
    super().__setattr__(name, value)


def attach(package: str, *, submodules: Sequence[str] = (),
           names: Mapping[str, Sequence[str | tuple[str, str]]] | None = None
           ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
  """`(__getattr__, __dir__, __all__)` for `package`, loading its exports on first use.

  Args:
    package: the package's `__name__`.
    submodules: names of modules under `package` exported as themselves
      (`"data"` exports `package.data`).
    names: module → the names exported from it. A module name starting with
      "." is relative to `package`. An entry `(alias, name)` exports
      `module.name` as `alias`.

  Returns:
    The package's `__getattr__` and `__dir__`, and `__all__`: the submodules,
    then the names, in the order given.

  Raises:
    ValueError: a name is exported twice.
  """
  targets: dict[str, tuple[str, str | None]] = {}

  def add(alias: str, module: str, attribute: str | None) -> None:
    if alias in targets:
      raise ValueError(f"{package} exports {alias!r} twice.")
    targets[alias] = (importlib.util.resolve_name(module, package), attribute)

  for name in submodules:
    add(name, "." + name, None)
  for module, exported in (names or {}).items():
    for entry in exported:
      alias, attribute = entry if isinstance(entry, tuple) else (entry, entry)
      add(alias, module, attribute)

  module_object = sys.modules[package]
  module_object.__dict__["_lazy_exported_attributes"] = frozenset(
      alias for alias, (_, attribute) in targets.items() if attribute is not None)
  module_object.__class__ = _LazyPackage
  exported_names = list(targets)

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    try:
      module, attribute = targets[name]
    except KeyError:
      raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attribute is not None:
      value = getattr(value, attribute)
    module_object.__dict__[name] = value
    return value

  def __dir__() -> list[str]:  # pylint: disable=invalid-name
    return sorted(set(module_object.__dict__) | set(exported_names))

  return __getattr__, __dir__, exported_names
