"""What `train` evaluates between chunks: the served model on every split, and each client's own model.

* The model `eval_params(state)` (default `state.params`) on every client's
  test split (`test_<name>`, example-weighted, and `test_<name>_client_mean`),
  on the dataset's centralized test set when it has one (`central_<name>`),
  and on every example of the held-out clients when given (`holdout_<name>`).
* Personalized metrics. `personalized_params(state) -> [N, ...]` (a table
  with one model per dataset client: `fo.personalized_params`, which reads
  the `state.local_params` of Ditto, pFedMe, EASGD, FedU, L2GD / L2SGD+ and
  the ADMM family) or `personalize(params, data, mask) -> params` (a model
  adapted on each client's train split from `eval_params(state)`:
  `algorithm.personalize` of Per-FedAvg and FedAvg + fine-tuning) adds, per
  metric, `personalized_test_<name>` (mean over the clients with test
  examples), `personalized_test_<name>_weighted` (example-weighted mean),
  `personalized_test_<name>_p10` (10th percentile over clients) and
  `personalized_num_excluded` (clients without test examples), exactly the
  summary of `fedjax_opt.evaluate.personalized` / `adapted`.
* `objective(params, table, dataset)` when given: `objective`, e.g. the
  training objective whose gap the ADMM and distributed families plot.

`EvalProgram` is the hashable description of one such evaluation, so that
`evaluate` is one `jax.jit` program per description and argument shapes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax

from fedjax_opt import evaluate as evaluate_lib
from fedjax_opt.train.config import Evaluation

__all__ = ["EvalProgram", "PERSONALIZED_PERCENTILE", "evaluate"]

PyTree = Any

PERSONALIZED_PERCENTILE = 10.0
"""The percentile over clients reported as `personalized_test_<name>_p10`."""


class EvalProgram(NamedTuple):
  """The static part of an evaluation (`Evaluation`'s functions and sizes), hashable for `jax.jit`."""

  metric_fns: tuple[tuple[str, Callable], ...]
  batch_size: int
  personalized: bool
  personalize: Callable | None
  client_map: Any
  swept: bool
  objective: Callable | None = None

  @classmethod
  def of(cls, evaluation: Evaluation, swept: bool) -> "EvalProgram":
    return cls(tuple(sorted((evaluation.metric_fns or {}).items())), evaluation.batch_size,
               evaluation.personalized, evaluation.personalize, evaluation.personalized_client_map, swept,
               evaluation.objective)


def _personalized_summary(params, table, personalize, dataset, metric_fns, batch_size, client_map) -> dict:
  """`personalized_test_*` scalars of `evaluate.personalized` (table) or `evaluate.adapted` (personalize)."""
  kwargs = dict(split="test", batch_size=batch_size, client_map=client_map, percentile=PERSONALIZED_PERCENTILE)
  if personalize is not None:
    result = evaluate_lib.adapted(params, personalize, dataset, metric_fns, **kwargs)
  else:
    result = evaluate_lib.personalized(table, dataset, metric_fns, **kwargs)
  suffixes = ("", "_weighted", evaluate_lib.percentile_suffix(PERSONALIZED_PERCENTILE))
  out = {f"personalized_test_{name}{suffix}": result.summary[name + suffix]
         for name in metric_fns for suffix in suffixes}
  out["personalized_num_excluded"] = result.summary["num_excluded"]
  return out


def _evaluate_one(program: EvalProgram, params: PyTree, table: PyTree, dataset: Any, holdout: Any) -> dict:
  metric_fns = dict(program.metric_fns)
  out = {}
  if metric_fns:
    if program.personalized:
      out.update(_personalized_summary(params, table, program.personalize, dataset, metric_fns, program.batch_size,
                                       program.client_map))
    out.update({f"test_{k}": v for k, v in evaluate_lib.global_model(
        params, dataset, metric_fns, split="test", batch_size=program.batch_size).items()})
    if dataset.central_test is not None:
      out.update({f"central_{k}": v for k, v in evaluate_lib.centralized(
          params, dataset.central_test, metric_fns).items()})
    if holdout is not None:
      out.update({f"holdout_{k}": v for k, v in evaluate_lib.global_model(
          params, holdout, metric_fns, split="train", batch_size=program.batch_size).items()})
  if program.objective is not None:
    out["objective"] = program.objective(params, table, dataset)
  return out


@functools.partial(jax.jit, static_argnames="program")
def evaluate(params: PyTree, table: PyTree, dataset: Any, holdout: Any, *, program: EvalProgram) -> dict:
  """`{metric: value}` of the model `params` (and the personalized `table`, or `program.personalize`).

  For a sweep (`program.swept`), `params` and `table` carry a leading `[K]` and so does every value.
  """
  if program.swept:
    return jax.vmap(functools.partial(_evaluate_one, program), in_axes=(0, 0, None, None))(
        params, table, dataset, holdout)
  return _evaluate_one(program, params, table, dataset, holdout)
