"""The objective gap (F − F*)/|F*| that `fedjax-opt run` reports for the ADMM and distributed families.

F is evaluated in float64, and F* is the least of the reference solve and every algorithm's final F: a model that
scores below the solve (which stops at a tolerance) defines F*, so no gap is negative. The references are a float64
NumPy transcription of the ridge-regularised softmax objective and scipy's L-BFGS-B on it.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
import scipy.optimize

import fedjax_opt as fo
from fedjax_opt.cli import config as config_lib
from fedjax_opt.cli import registry
from fedjax_opt.cli import run as run_lib

L2 = 1e-3  # the distributed family's default ridge


@pytest.fixture(scope="module")
def problem():
  """The shipped example file split over 4 clients, its model, and the float64 NumPy objective of its train split."""
  config = config_lib.finish({"dataset": f"libsvm:{fo.data.example_path('libsvm')}", "algorithms": "dane",
                              "num_clients": 4, "clients_per_round": 4})
  dataset = run_lib.load_dataset(config)
  model = run_lib.build_model(config, dataset)
  batches = fo.data.client_batches(dataset, dataset.max_train, split="train")
  mask = np.asarray(batches.mask, bool)
  x = np.asarray(fo.core.types.materialize(batches.data)["x"], np.float64)[mask]
  x = x.reshape(len(x), -1)
  y = np.asarray(fo.core.types.materialize(batches.data)["y"])[mask].astype(int)
  a = np.hstack([x, np.ones((len(x), 1))])
  onehot = np.eye(2)[y]

  def objective(theta):
    """(F, ∇F) of mean softmax cross-entropy + (l2/2)‖θ‖², θ = (kernel [d, 2]; bias [2]) flattened."""
    z = a @ theta.reshape(-1, 2)
    log_z = np.logaddexp(z[:, 0], z[:, 1])
    p = np.exp(z - log_z[:, None])
    value = np.mean(log_z - np.sum(onehot * z, 1)) + 0.5 * L2 * theta @ theta
    return value, (a.T @ (p - onehot) / len(y)).ravel() + L2 * theta

  theta = scipy.optimize.minimize(objective, np.zeros(2 * a.shape[1]), jac=True, method="L-BFGS-B",
                                  options={"gtol": 1e-13, "ftol": 1e-16, "maxiter": 10000}).x
  hyper = config_lib.hyper_parameters(config, "dane")
  assert hyper["l2"] == L2
  return dataset, model, hyper, objective, theta


def _params(theta):
  """The model's float32 parameters of θ."""
  w = np.asarray(theta, np.float32).reshape(-1, 2)
  return {"linear": {"kernel": w[:-1], "bias": w[-1]}}


def _f64(objective, params):
  """F in float64 of the float32 parameters, by NumPy."""
  kernel, bias = (np.asarray(params["linear"][k], np.float64) for k in ("kernel", "bias"))
  return objective(np.concatenate([kernel, bias[None]]).ravel())[0]


class _State(NamedTuple):
  """The part of an algorithm's state that the objective reads (a pytree, so a sweep's members can be sliced)."""

  params: Any


def _state(params):
  return _State(params)


def _with_reference(value):
  """DANE's Spec whose reference solve returns `value` (a solve that stopped a little above the minimum)."""
  return dataclasses.replace(registry.REGISTRY["dane"], reference=lambda hyper, batches: value)


def test_a_model_below_the_reference_solve_is_f_star_and_no_gap_is_negative(problem):
  dataset, model, hyper, objective, theta = problem
  minimum = objective(theta)[0]
  reference = minimum * (1 + 1e-5)  # the solve stopped 1e-5 (relative) above the minimum
  near = theta.copy()
  near[-1] += 3e-3  # one bias 3e-3 off the minimiser: F a little above the minimum, still below the solve
  f_near, f_best = _f64(objective, _params(near)), _f64(objective, _params(theta))
  assert f_best < f_near < reference

  alone = run_lib.objective_gap(_with_reference(reference), hyper, model, _state(_params(near)), dataset, 1)
  assert alone["objective"] == pytest.approx(f_near, rel=1e-12, abs=0)  # float64, not float32 (~1e-7 off)
  assert alone["objective_reference"] == reference
  assert alone["objective_star"] == alone["objective"]  # the model beat the solve: it is F*
  assert alone["objective_gap"] == 0.0

  # Three algorithms of one run, one objective: the last one lowers F* again, and the earlier rows are restated.
  solved, rows = {}, {}
  for name, params in (("near", _params(near)), ("zero", model.init(jax.random.key(0))), ("best", _params(theta))):
    rows[name] = {"algorithm": name}
    out = run_lib.objective_gap(_with_reference(reference), hyper, model, _state(params), dataset, 1, solved,
                                row=rows[name])
    assert out["objective_gap"] >= 0 and out["objective_star"] <= min(reference, out["objective"])
  assert rows["zero"]["objective"] == pytest.approx(math.log(2), rel=1e-12)  # the zero model: log 2 per example
  assert rows["best"]["objective"] == pytest.approx(f_best, rel=1e-12, abs=0)
  for name, f in (("near", f_near), ("zero", math.log(2)), ("best", f_best)):
    row = rows[name]
    assert row["objective_star"] == rows["best"]["objective"] and row["objective_reference"] == reference, name
    assert row["objective_gap"] == pytest.approx((f - f_best) / f_best, rel=1e-9, abs=1e-15), name
  assert rows["best"]["objective_gap"] == 0.0 and rows["near"]["objective_gap"] > 0


def test_a_solve_below_every_model_is_f_star_and_a_nan_member_keeps_a_nan_gap(problem):
  """A sweep of two members: the minimiser and a model gone NaN; F* is the solve (below both); the NaN member's gap
  is NaN (not clamped to 0) and does not move F*."""
  dataset, model, hyper, objective, theta = problem
  minimum = objective(theta)[0]
  reference = minimum * (1 - 1e-9)
  members = [_params(theta), jax.tree.map(lambda v: np.full_like(v, np.nan), _params(theta))]
  swept = _state(jax.tree.map(lambda *v: np.stack(v), *members))
  out = run_lib.objective_gap(_with_reference(reference), hyper, model, swept, dataset, 2)
  f_best = _f64(objective, members[0])
  assert out["objective_star"] == reference
  assert out["objective"][0] == pytest.approx(f_best, rel=1e-12, abs=0) and math.isnan(out["objective"][1])
  assert out["objective_gap"][0] == pytest.approx((f_best - reference) / reference, rel=1e-6)
  assert out["objective_gap"][0] > 0 and math.isnan(out["objective_gap"][1])


def test_the_reference_solve_is_announced_once_per_objective_and_reaches_scipy_s_minimum(problem):
  """The float64 L-BFGS solve (no `Spec.reference`) says one line before it starts — it was seconds of silence on a
  larger file — and a second algorithm of the same objective reuses it without a word; its F* is scipy's minimum."""
  dataset, model, hyper, objective, theta = problem
  solving = dataclasses.replace(registry.REGISTRY["dane"], reference=None)
  said, solved = [], {}
  for _ in range(2):
    out = run_lib.objective_gap(solving, hyper, model, _state(_params(theta)), dataset, 1, solved, say=said.append)
  assert len(said) == 1 and said[0].startswith("solving the centralized objective in float64"), said
  assert "4 clients' data pooled" in said[0]
  assert out["objective_reference"] == pytest.approx(objective(theta)[0], rel=1e-9)
