"""Marking the places where a step is not differentiable in its hyper-parameters.

A federated run is one pure program, so `jax.grad` of a validation loss
through R rounds with respect to the hyper-parameters (`fedjax_opt.hyper`) is
exact wherever the run is a smooth function of them. Some steps make discrete
decisions that depend on the trained models or directly on a hyper-parameter:
IFCA's argmin over cluster losses, CFL's split test and bipartition,
CQ-GGADMM's censoring test, Zeno++'s acceptance test, L2GD's coin with
probability p. There the run is piecewise constant in the decision, and
automatic differentiation silently returns the derivative of one piece (the
jumps between pieces, which are what changes with the hyper-parameter, are
missed). A step that builds its update with `stop_gradient` (Per-FedAvg's
straight-through surrogates) computes a derivative that is not the
derivative of its value. So a step passes the value that decides (or that
the surrogate is built on) through
`refuse_derivative(x, what)`: an identity for every computation that does not
differentiate `x`, and a `NotDifferentiableError` with one line naming `what`
when a derivative (forward or reverse mode, any transformation) reaches it.
The error is raised when the program is traced, before anything runs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

__all__ = ["NotDifferentiableError", "refuse_derivative"]


class NotDifferentiableError(ValueError):
  """A derivative reached a decision of a step it cannot pass (`refuse_derivative`)."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def refuse_derivative(x: Any, what: str) -> Any:
  """`x` unchanged; differentiating through it raises `NotDifferentiableError` naming `what`.

  Args:
    x: the array (or pytree) a discrete decision is taken on.
    what: the decision and why it breaks differentiation, one clause, e.g.
      "the client is assigned to its lowest-loss cluster (an argmin: a run is piecewise constant in it)".
  """
  return x


@refuse_derivative.defjvp
def _refuse_jvp(what: str, primals: Any, tangents: Any) -> Any:
  del primals, tangents
  raise NotDifferentiableError(
      f"not differentiable: {what}, so a run has no usable hyper-gradient through it (fo.hyper refuses it); tune "
      "these hyper-parameters by grid search instead (fo.sweep).")
