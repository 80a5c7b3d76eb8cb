"""`History`: what a `train` run recorded, as host arrays that round-trip through JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np

__all__ = ["History"]


@dataclasses.dataclass
class History:
  """What happened during a run, as host arrays (JSON-serializable through `to_dict`).

  Attributes:
    round_metrics: `{name: [R, ...]}`, `state.metrics` after each round 1 … R
      (`[K, R, ...]` for a sweep of K members; a metric that is a vector
      keeps its own axes after the round axis).
    evals: one dict per evaluation: `{"round": r, "seconds": training time so far, metric: value, ...}`
      (for a sweep, each metric's value is a list of K floats).
    train_seconds: seconds spent running rounds (compilation excluded).
    compile_seconds: seconds spent compiling chunks and evaluation.
    sweep_size: K for a sweep (`fedjax_opt.sweep`), None for a single run.
    diverged_at_round: the round after which training stopped because the
      run diverged (see `train`'s `divergence_factor`), None if it did not.
    diverged_reason: one line saying why.
    initial_loss: the initial model's `test_loss` (a list for a sweep), the
      baseline of the divergence rule; None when not evaluated.
    privacy: for a run with a `fo.privacy.dp_mean` aggregator, what its
      evaluation points' `dp_epsilon` are the ε(δ) of: noise multiplier, δ,
      accountant, the clients the run drew, the accountant's event (those of
      its last rounds), and `segments`: one dict per stretch of rounds
      accounted alike (`rounds` [first, last], `noise_multiplier`, the draw:
      `kind`, `num_clients`, `clients_per_round`, `sampling_probability`),
      which a resumed or continued run composes its own rounds on top of
      (`fedjax_opt.train.accounting`); None otherwise.
  """

  round_metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  train_seconds: float = 0.0
  compile_seconds: float = 0.0
  sweep_size: int | None = None
  diverged_at_round: int | None = None
  diverged_reason: str | None = None
  initial_loss: float | list[float] | None = None
  privacy: dict[str, Any] | None = None

  @property
  def num_rounds(self) -> int:
    return np.shape(next(iter(self.round_metrics.values())))[self._round_axis] if self.round_metrics else 0

  @property
  def _round_axis(self) -> int:
    return 0 if self.sweep_size is None else 1

  @property
  def rounds_per_second(self) -> float:
    return self.num_rounds / self.train_seconds if self.train_seconds > 0 else float("nan")

  def eval_series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(rounds [E], values [E] or [K, E] for a sweep) of an evaluated metric, e.g. `eval_series("test_accuracy")`."""
    points = [(e["round"], e[name]) for e in self.evals if name in e]
    if not points:
      raise KeyError(f"no evaluation recorded {name!r}; recorded: {sorted(self.last_eval)}.")
    r, v = zip(*points)
    values = np.asarray(v)
    return np.asarray(r), values.T if values.ndim == 2 else values

  @property
  def last_eval(self) -> dict[str, float]:
    return self.evals[-1] if self.evals else {}

  def append_rounds(self, metrics: Mapping[str, np.ndarray]) -> None:
    for name, values in metrics.items():
      values = np.asarray(values)
      old = self.round_metrics.get(name)
      self.round_metrics[name] = values if old is None else np.concatenate([old, values], axis=self._round_axis)

  def extended(self, metrics: Mapping[str, np.ndarray], point: dict[str, Any], seconds: float) -> "History":
    """A new History with one more chunk (its round metrics, its evaluation point, its training time)."""
    new = dataclasses.replace(self, round_metrics=dict(self.round_metrics), evals=[*self.evals, point],
                              train_seconds=self.train_seconds + seconds)
    new.append_rounds(metrics)
    return new

  def to_dict(self) -> dict:
    return {
        "round_metrics": {k: v.tolist() for k, v in self.round_metrics.items()},
        "evals": self.evals,
        "train_seconds": self.train_seconds,
        "compile_seconds": self.compile_seconds,
        "sweep_size": self.sweep_size,
        "diverged_at_round": self.diverged_at_round,
        "diverged_reason": self.diverged_reason,
        "initial_loss": self.initial_loss,
        "privacy": self.privacy,
    }

  @classmethod
  def from_dict(cls, d: Mapping) -> "History":
    return cls(
        round_metrics={k: np.asarray(v) for k, v in d["round_metrics"].items()},
        evals=[dict(e) for e in d["evals"]],
        train_seconds=float(d["train_seconds"]),
        compile_seconds=float(d["compile_seconds"]),
        sweep_size=d.get("sweep_size"),
        diverged_at_round=d.get("diverged_at_round"),
        diverged_reason=d.get("diverged_reason"),
        initial_loss=d.get("initial_loss"),
        privacy=d.get("privacy"),
    )

  def save_json(self, path: str) -> None:
    with open(path, "w") as f:
      json.dump(self.to_dict(), f)
