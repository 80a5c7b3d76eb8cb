"""The aggregator seam: how stacked client updates become one server update.

An `Aggregator` (the contract is `fedjax_opt.core.types.Aggregator`; this
package builds them) is a NamedTuple of two pure functions, like an optax
transformation:

* `init(params) -> state`
* `aggregate(updates, weights, state, key) -> (update, state)`, where every
  leaf of `updates` is stacked `[C, ...]` and `weights` is `[C]`.

A weight of 0 marks a client that takes no part: padding clients, and the
clients the round's rules exclude (docs/architecture.md, "The round");
`fedjax_opt.core.server.aggregate_updates` zeroes non-finite clients before
the aggregator sees them. Robust rules and differential-privacy noise are further
aggregators behind the same seam; compression with error feedback is its
client stage, put in front of any of them with `fedjax_opt.aggregators.chain`.

Every factory declares what its piece does as data, `Aggregator.traits` (a
`Traits`: linear, private, secure, robust, an attack, its client stage); an
aggregator built by hand has none (unknown) unless it declares them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_opt.core.server import check_aggregator, check_stacked_updates
from fedjax_opt.core.types import Aggregator, StreamingSum, Traits

__all__ = ["mean", "normalized_sum", "resolve", "weighted_mean", "weighted_sum"]

PyTree = Any


def stateless_init(params: PyTree) -> tuple:
  """The `init` of an aggregator without state: `()`."""
  del params
  return ()


def broadcast_rows(mask: jax.Array, leaf: jax.Array) -> jax.Array:
  """A `[C]` per-client mask (or weight) reshaped to broadcast against a `[C, ...]` leaf."""
  return mask.reshape((-1,) + (1,) * (leaf.ndim - 1))


def weighted_sum(updates: PyTree, coefficients: jax.Array) -> PyTree:
  """Σ_c a_c u_c over the leading client axis of every leaf of `updates`."""
  return jax.tree.map(lambda u: jnp.tensordot(coefficients.astype(u.dtype), u, axes=1), updates)


def normalized_sum(updates: PyTree, weights: jax.Array) -> PyTree:
  """Σ_c w_c u_c / Σ_c w_c per leaf, in the leaf's dtype; zeros when Σ w = 0."""

  def leaf(u):
    w = weights.astype(u.dtype)
    total = jnp.sum(w)
    return jnp.where(total > 0, jnp.tensordot(w, u, axes=1) / jnp.where(total > 0, total, 1), jnp.zeros_like(u[0]))

  return jax.tree.map(leaf, updates)


def _sum_dtype(dtype: Any) -> Any:
  """The dtype a running sum of `dtype` values is kept in: at least float32."""
  return jnp.promote_types(dtype, jnp.float32)


def _normalized_streaming(coefficient: Callable[[jax.Array], jax.Array]) -> StreamingSum:
  """Σ_c a_c u_c / Σ_c a_c as a `StreamingSum`, a_c = coefficient(w_c); zeros when Σ a = 0."""

  def term(update, weight, state):
    del state
    a = coefficient(weight)
    return jax.tree.map(lambda u: a.astype(_sum_dtype(u.dtype)) * u.astype(_sum_dtype(u.dtype)), update), a

  def finalize(total, count, state, key):
    del key
    out = jax.tree.map(lambda t: jnp.where(count > 0, t / jnp.where(count > 0, count, 1).astype(t.dtype),
                                           jnp.zeros_like(t)), total)
    return out, state

  return StreamingSum(term, finalize)


def weighted_mean() -> Aggregator:
  """Δ = Σ_k n_k Δ_k / Σ_k n_k: FedAvg's average weighted by client sample counts n_k.

  Returns zeros when every weight is 0. A weighted sum: under a sequential or
  chunked client map it is accumulated client by client (`StreamingSum`).
  """

  def aggregate(updates, weights, state, key):
    del key
    check_stacked_updates(updates, weights, "weighted_mean")
    return normalized_sum(updates, weights), state

  return Aggregator(stateless_init, aggregate, _normalized_streaming(lambda w: w.astype(jnp.float32)),
                    traits=Traits(name="weighted_mean", linear=True, sums=True))


def mean() -> Aggregator:
  """Δ = (1/|S|) Σ_{k∈S} Δ_k: the uniform average over clients taking part (weight > 0).

  This is the form of Reddi et al.'s Algorithm 2 (FedOpt). Returns zeros when
  no client takes part. A sum: under a sequential or chunked client map it is
  accumulated client by client (`StreamingSum`).
  """

  def aggregate(updates, weights, state, key):
    del key
    check_stacked_updates(updates, weights, "mean")
    taking_part = (weights > 0).astype(weights.dtype)
    return normalized_sum(updates, taking_part), state

  return Aggregator(stateless_init, aggregate, _normalized_streaming(lambda w: (w > 0).astype(jnp.float32)),
                    traits=Traits(name="mean", linear=True, sums=True))


def resolve(aggregator: Aggregator | None, default: Callable[[], Aggregator]) -> Aggregator:
  """`aggregator`, or `default()` when None; TypeError for anything that is not an `Aggregator`."""
  return check_aggregator(default() if aggregator is None else aggregator)
