"""Checkpoints of a run: (state, `History`) saved with orbax, restored bit for bit.

Steps are round numbers. A state's typed PRNG keys are stored as their raw
uint32 data (`to_raw`) and wrapped again on restore (`from_raw`). The latest
checkpoint unreadable (truncated, corrupt): `Checkpointer.restore` falls back
to the previous one (`CheckpointWarning`); none readable raises
`CheckpointError`. A host-driven algorithm's state (FedMA) is restored in the
shapes it was saved in (a grown model), not the template's.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.train.history import History

__all__ = ["CheckpointError", "CheckpointWarning", "Checkpointer", "current_round", "from_raw", "to_raw"]

PyTree = Any


def current_round(state: PyTree) -> int:
  """`state.round` as an int (a sweep's members all share it: member 0's)."""
  return int(np.asarray(state.round).reshape(-1)[0])


def _is_typed_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_raw(state: PyTree) -> PyTree:
  """Typed PRNG keys -> their uint32 data (what a checkpoint can store)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, state)


def _placed_like(restored: Any, template: Any) -> Any:
  """A restored array placed as its template: uncommitted when the template is (a fresh `init`), so that the
  first chunk may place it (one device, or a mesh for a sharded client map); as restored otherwise."""
  if isinstance(restored, jax.Array) and isinstance(template, jax.Array) and not template.committed:
    return jax.device_put(np.asarray(restored))
  return restored


def _saved_like(restored: Any, template: PyTree) -> PyTree:
  """`template`'s structure with the arrays of `restored` (orbax's nested dicts), found by each leaf's path."""

  def find(path, _):
    node = restored
    try:
      for entry in path:
        name = getattr(entry, "name", getattr(entry, "key", getattr(entry, "idx", None)))
        node = node[name] if name in node or not isinstance(node, dict) else node[str(name)]
    except (KeyError, IndexError, TypeError):
      raise ValueError(f"the checkpoint holds no state{jax.tree_util.keystr(path)}, which this algorithm's state has "
                     f"(saved from another algorithm, or by a version whose state lacked it)") from None
    return node

  return jax.tree_util.tree_map_with_path(find, template)


def from_raw(raw: PyTree, template: PyTree) -> PyTree:
  """`to_raw` undone: the uint32 data of `raw` wrapped as typed keys wherever `template` holds one."""
  return jax.tree.map(
      lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_typed_key(t) else r, raw, template)


class CheckpointError(RuntimeError):
  """No checkpoint in the directory can be restored."""


class CheckpointWarning(UserWarning):
  """The latest checkpoint was unreadable; an older one was restored."""


class Checkpointer:
  """Saves and restores (state, history) with orbax, keeping the last `max_to_keep` checkpoints.

  Steps are round numbers. `restore` falls back to an older checkpoint when
  the latest cannot be read (a truncated or corrupt file: a warning, and the
  unreadable steps are deleted so that the run can save them again), and
  raises `CheckpointError` when none can. Used by `train`; usable on its own.
  """

  def __init__(self, directory: str, max_to_keep: int = 2, saved_shapes: bool = False):
    import orbax.checkpoint as ocp  # a dependency of the driver only, not of `import fedjax_opt`

    self._ocp = ocp
    self._saved_shapes = saved_shapes  # restore arrays in the shapes saved (a grown model), not the template's
    self.directory = os.path.abspath(directory)
    self._max_to_keep = max_to_keep
    self._manager = self._open()

  def _open(self):
    ocp = self._ocp
    return ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=self._max_to_keep, create=True))

  def latest_round(self) -> int | None:
    return self._manager.latest_step()

  def save(self, state: PyTree, history: History) -> None:
    ocp = self._ocp
    step = current_round(state)
    if step in self._manager.all_steps():
      return
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(to_raw(state)), history=ocp.args.JsonSave(history.to_dict())))
    self._manager.wait_until_finished()

  def _restore_step(self, step: int, template: PyTree) -> tuple[PyTree, History]:
    ocp = self._ocp
    if self._saved_shapes:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(), history=ocp.args.JsonRestore()))
      restored = dict(restored, state=_saved_like(restored["state"], to_raw(template)))
    else:
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(to_raw(template)), history=ocp.args.JsonRestore()))
      except ValueError as e:
        if "structure" not in str(e):
          raise
        bare = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), history=ocp.args.JsonRestore()))
        _saved_like(bare["state"], to_raw(template))  # names the field the checkpoint lacks, if one is missing
        raise
    raw = jax.tree.map(_placed_like, restored["state"], to_raw(template))
    state = from_raw(raw, template)
    history = History.from_dict(restored["history"])
    if current_round(state) != step or history.num_rounds not in (0, step):
      raise ValueError(f"the checkpoint holds round {current_round(state)} and a history of {history.num_rounds} "
                       f"rounds, not round {step}")
    return state, history

  def restore(self, template: PyTree) -> tuple[PyTree, History] | None:
    """The latest readable (state, history), with `template`'s structure (e.g. `algorithm.init(...)`).

    None if the directory holds no checkpoint; `CheckpointError` if it holds
    some and none can be read.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    broken = []
    for step in steps:
      try:
        restored = self._restore_step(step, template)
      except Exception as e:  # pylint: disable=broad-except  (orbax raises many types for a damaged file)
        broken.append((step, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
        continue
      if broken:
        rounds = ", ".join(str(b) for b, _ in broken)
        warnings.warn(f"checkpoint of round(s) {rounds} in {self.directory} unreadable ({broken[0][1][:200]}); "
                      f"resuming from round {step}", CheckpointWarning, stacklevel=2)
        self._discard([b for b, _ in broken])
      return restored
    if broken:
      rounds = ", ".join(str(b) for b, _ in broken)
      raise CheckpointError(f"no valid checkpoint in {self.directory} (round(s) {rounds} unreadable: "
                            f"{broken[0][1][:200]})")
    return None

  def _discard(self, steps: list[int]) -> None:
    """Deletes unreadable steps (so later saves of those rounds succeed) and reopens the manager."""
    for step in steps:
      try:
        self._manager.delete(step)
      except Exception:  # pylint: disable=broad-except
        path = os.path.join(self.directory, str(step))
        if os.path.isdir(path):
          shutil.rmtree(path)
    self._manager.close()
    self._manager = self._open()
