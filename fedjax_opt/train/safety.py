"""Safety checks of a run: the memory a compiled chunk needs, and divergence after each chunk.

* Before the first chunk runs, its memory (from the compiled program's
  `memory_analysis`) is checked against what the device has
  (`check_fits`, `RoundTooLargeError`: nothing allocated).
* After each chunk, `divergence` says whether the run diverged (a
  non-finite model or client loss, every update non-finite for a whole
  chunk, or a loss `factor` times the initial one); `train` then stops and
  `History.diverged_at_round` says when and why.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from fedjax_opt.train.history import History

__all__ = ["BatchSizeWarning", "DivergenceWarning", "RoundTooLargeError", "check_fits", "compiled_bytes", "divergence",
           "padded_batch"]

PyTree = Any


class RoundTooLargeError(MemoryError):
  """A compiled chunk would need more memory than the device has (raised before it runs)."""


class DivergenceWarning(RuntimeWarning):
  """`train` stopped a run that diverged: the round and the cause (also in `History.diverged_at_round`, `_reason`)."""


class BatchSizeWarning(UserWarning):
  """The batch size exceeds every client's train split: each step is mostly padding, and slower for it."""


def padded_batch(batch_size: int | None, max_train: int) -> str | None:
  """Why `batch_size` only adds padding (it exceeds `max_train`, the largest client's train examples), or None."""
  if batch_size is None or max_train < 1 or batch_size <= max_train:
    return None
  return (f"batch_size={batch_size} exceeds every client's train examples (the largest client holds {max_train}): "
          f"each step pads every client's batch to {batch_size} slots, which costs time and memory; "
          f"batch_size={max_train} takes the same examples per step")


def _available_bytes() -> int | None:
  """Memory the default device can still give: the accelerator's limit, or the host's available RAM (None: unknown)."""
  device = jax.devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def compiled_bytes(compiled: Any) -> int | None:
  """New memory a compiled program allocates when it runs: temporaries and outputs (its inputs exist already)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend reports it)
    return None
  if stats is None:
    return None
  return int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes) - int(getattr(stats, "alias_size_in_bytes", 0))


def check_fits(compiled: Any, what: str, advice: str) -> None:
  """Raises `RoundTooLargeError` when `compiled` needs more memory than `_available_bytes()`."""
  need, have = compiled_bytes(compiled), _available_bytes()
  if need is None or have is None or need <= have:
    return
  raise RoundTooLargeError(f"{what} needs about {need / 2**30:.1f} GiB of memory but the device has "
                           f"{have / 2**30:.1f} GiB available; {advice}")


def divergence(history: History, params: PyTree, length: int, factor: float, swept: bool) -> str | None:
  """Why the run diverged in its last chunk of `length` rounds, or None (for a sweep: only if every member did).

  Diverged: the model holds NaN/Inf; the chunk's client losses are not
  finite; every client of every round of the chunk sent a non-finite update;
  or a loss (the chunk's mean client loss, the last `test_loss`) exceeds
  `factor` × the baseline, the initial model's test loss
  (`history.initial_loss`), else round 1's client loss.
  """
  metrics = {k: np.asarray(v) for k, v in history.round_metrics.items()}
  members = 1 if not swept else np.shape(next(iter(metrics.values())))[0]
  last = history.last_eval

  def member(values, i):
    values = np.asarray(values, np.float64) if not isinstance(values, np.ndarray) else values
    return values if not swept else values[i]

  reasons = []
  for i in range(members):
    leaves = [np.asarray(x if not swept else x[i]) for x in jax.tree.leaves(params)]
    loss = member(metrics["client_loss"], i).astype(np.float64) if "client_loss" in metrics else None
    if history.initial_loss is not None:
      baseline = float(member(history.initial_loss, i))
    else:
      baseline = float(loss[0]) if loss is not None and len(loss) else float("nan")
    test_loss = float(member(last["test_loss"], i)) if "test_loss" in last else None
    reason = None
    if not all(np.all(np.isfinite(x)) for x in leaves if np.issubdtype(x.dtype, np.inexact)):
      reason = "the model holds NaN or Inf"
    elif loss is not None and not np.all(np.isfinite(loss[-length:])):
      reason = "the clients' training loss is NaN or Inf"
    elif test_loss is not None and not np.isfinite(test_loss):
      reason = "the test loss is NaN or Inf"
    elif np.isfinite(baseline) and baseline > 0:
      for what, value in (("clients' training loss", None if loss is None else float(np.mean(loss[-length:]))),
                          ("test loss", test_loss)):
        if value is not None and value > factor * baseline:
          reason = f"the {what} grew to {value:.3g}, over {factor:g}× the initial {baseline:.3g}"
          break
    if reason is None and "round_accepted" in metrics and "num_nonfinite" in metrics:
      accepted = member(metrics["round_accepted"], i)[-length:]
      dropped = member(metrics["num_nonfinite"], i)[-length:]
      if not np.any(accepted) and np.all(dropped > 0):
        reason = "every client's update was NaN or Inf in every round of the last chunk"
    reasons.append(reason)
  if any(r is None for r in reasons):
    return None
  return reasons[0] if not swept else f"every member: {reasons[0]}"
