"""Staleness functions: how much an update of staleness t − τ counts (FedAsync's s(t − τ)).

Xie, Koyejo, Gupta. "Asynchronous Federated Optimization." OPT workshop,
NeurIPS 2020. arXiv:1903.03934. (Section 5.2: constant, polynomial and hinge.)

Staleness t − τ is the number of server updates between a client's pull
(version τ) and the moment the server uses its update (version t); the
event loop (`events.py`) hands it to the algorithm's rule with each arrival.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_opt.core.validation import check_choice, check_positive, check_scalar

__all__ = ["STALENESS_WEIGHTS", "check_staleness_weight", "staleness_weight"]


STALENESS_WEIGHTS = ("constant", "polynomial", "hinge")


def staleness_weight(kind: str, staleness: jax.Array, a: Any = 0.5, b: Any = 4) -> jax.Array:
  """s(t − τ), the weight of an update of staleness t − τ (Xie, Koyejo, Gupta 2019, Section 5.2).

      constant:    s = 1
      polynomial:  s = (t − τ + 1)^(−a)
      hinge:       s = 1 if t − τ ≤ b, else 1 / (a (t − τ − b) + 1)

  Args:
    kind: "constant", "polynomial" or "hinge".
    staleness: t − τ ≥ 0 (any shape, integer or float).
    a, b: the function's parameters (a > 0; b ≥ 0 for "hinge").

  Returns:
    The weights, float, shaped like `staleness`.
  """
  check_choice(kind, "staleness_weight", STALENESS_WEIGHTS)
  s = jnp.asarray(staleness).astype(jnp.result_type(float))
  if kind == "constant":
    return jnp.ones_like(s)
  if kind == "polynomial":
    return jnp.power(s + 1, -jnp.asarray(a, s.dtype))
  return jnp.where(s <= b, jnp.ones_like(s), 1 / (a * jnp.maximum(s - b, 0) + 1))


def check_staleness_weight(kind: Any, a: Any, b: Any) -> None:
  """Clear errors for a staleness function and its parameters (used by the factories)."""
  check_choice(kind, "staleness_weight", STALENESS_WEIGHTS)
  if kind != "constant":
    check_scalar(a, "a")
    check_positive(a, "a")
  if kind == "hinge":
    check_scalar(b, "b")
    check_positive(b, "b", allow_zero=True)
