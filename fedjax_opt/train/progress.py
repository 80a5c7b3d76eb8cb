"""The progress of a run: a bar on a terminal, one line per chunk elsewhere (logs, CI, notebooks)."""

from __future__ import annotations

import sys
from typing import Any, Mapping

import numpy as np

__all__ = ["Progress", "format_point", "host_value"]


class Progress:
  """A rich progress bar on a terminal, one line per chunk elsewhere (logs, CI, notebooks)."""

  def __init__(self, enabled: bool, total: int, start: int, label: str):
    self.enabled, self.total, self.label = enabled, total, label
    self._bar = None
    if enabled and sys.stdout.isatty():
      try:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress
      except ImportError:
        pass
      else:
        self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self._bar.start()
        self._task = self._bar.add_task(label, total=total, completed=start, info="")

  def update(self, round_: int, info: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.update(self._task, completed=round_, info=info)
    else:
      print(f"[{self.label}] round {round_}/{self.total} | {info}", flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()


def format_point(metrics: Mapping[str, Any], rate: float) -> str:
  """The progress line's text: rounds per second and the point's losses and accuracies (mean ± std for a sweep)."""
  parts = [f"{rate:,.1f} rounds/s"]
  for key in ("train_loss", "test_loss", "test_accuracy", "central_accuracy", "personalized_test_accuracy"):
    if key in metrics:
      value = np.asarray(metrics[key], np.float64)
      if value.ndim:  # a sweep: mean ± std over members
        parts.append(f"{key} {np.mean(value):.4f} ± {np.std(value):.4f}")
      else:
        parts.append(f"{key} {float(value):.4f}")
  return " | ".join(parts)


def host_value(value: Any) -> Any:
  """A float, or a list of K floats for a swept value."""
  value = np.asarray(value, np.float64)
  return value.tolist() if value.ndim else float(value)
