"""The progress of a run: a bar on a terminal, one line per chunk elsewhere (logs, CI, notebooks)."""

from __future__ import annotations

import math
import sys
from typing import Any, Mapping

import numpy as np

__all__ = ["MISSING", "Progress", "format_point", "format_value", "host_value"]

MISSING = "–"
"""What a progress line or the results table shows for a value that was not reported (no train loss: L2GD, ...)."""


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

  def note(self, text: str) -> None:
    """One line about a phase that shows no round (a resume, a compilation): `[label] text`, above a bar."""
    if not self.enabled:
      return
    line = f"[{self.label}] {text}"
    if self._bar is not None:
      self._bar.console.print(line, markup=False, highlight=False)
    else:
      print(line, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()


def format_value(value: Any, std: Any = None, spec: str = ".4f") -> str:
  """`0.8123`, `0.8123 ± 0.0040` (a sweep), `MISSING` for None (a value not reported).

  Under the default spec a magnitude outside [1e-3, 1e4) is written in
  scientific notation (`1.235e+33`, not 34 digits of fixed point); NaN and
  Inf are written as such (a diverged loss).
  """
  if value is None:
    return MISSING
  value = float(value)
  if spec == ".4f" and value != 0 and math.isfinite(value) and not 1e-3 <= abs(value) < 1e4:
    spec = ".3e"
  text = f"{value:{spec}}"
  return text if std is None else f"{text} ± {float(std):{spec}}"


def format_point(metrics: Mapping[str, Any], rate: float) -> str:
  """The progress line's text: rounds per second and the point's losses and accuracies (mean ± std for a sweep).

  `train_loss` is always shown, `MISSING` when the algorithm reports none; the others when evaluated.
  """
  parts = [f"{rate:,.1f} rounds/s"]
  for key in ("train_loss", "test_loss", "test_accuracy", "central_accuracy", "personalized_test_accuracy"):
    if key in metrics or key == "train_loss":
      value = metrics.get(key)
      if value is not None and np.ndim(value):  # a sweep: mean ± std over members
        value = np.asarray(value, np.float64)
        parts.append(f"{key} {format_value(np.mean(value), np.std(value))}")
      else:
        parts.append(f"{key} {format_value(value)}")
  return " | ".join(parts)


def host_value(value: Any) -> Any:
  """A float, or a list of K floats for a swept value."""
  value = np.asarray(value, np.float64)
  return value.tolist() if value.ndim else float(value)
