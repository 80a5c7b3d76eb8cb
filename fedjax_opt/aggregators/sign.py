"""signSGD with majority vote: the server applies the sign of the clients' vote, coordinate by coordinate.

Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed
Optimisation for Non-Convex Problems" (ICML 2018, arXiv:1802.04434), and
Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD with Majority Vote is
Communication Efficient and Fault Tolerant" (ICLR 2019, arXiv:1810.05291).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_opt.core.server import check_stacked_updates
from fedjax_opt.core.types import Aggregator, StreamingSum, Traits

PyTree = Any

__all__ = ["majority_vote"]


def _vote(u: jax.Array) -> jax.Array:
  """A client's one-bit vote per coordinate: +1 for u ≥ 0, −1 for u < 0 (`fo.compression.sign`'s sgn)."""
  return jnp.where(u >= 0, jnp.ones_like(u), -jnp.ones_like(u))


def majority_vote() -> Aggregator:
  """Δ = sgn_0(Σ_{k: w_k > 0} sgn(Δ_k)): the majority vote of signSGD (Bernstein et al., ICLR 2019).

  Every client that takes part (weight > 0) casts one vote per coordinate,
  sgn(Δ_{k,i}) ∈ {−1, +1} (+1 for Δ_{k,i} ≥ 0, the 1-bit code of
  `fo.compression.sign`), whatever its sample count n_k: the paper's
  one-client-one-vote. The server's Δ_i is +1 where the majority votes +1,
  −1 where it votes −1, and 0 on a tie (sgn_0(0) = 0) or when no client takes
  part. With `server_optimizer=optax.sgd(η)` the step is x ← x + η Δ, i.e.
  x ← x − η sgn(Σ_k sgn(g_k)) for FedSGD's Δ_k = −g_k: the server learning
  rate scales the vote. Its message back is one ternary symbol per coordinate.

  The client's vote is computed here from its update, so a client may send
  its raw Δ_k; with the client stage `fo.compression.compress(fo.compression.sign(scaled=False))`
  chained in front (`fo.aggregators.chain`) it sends the vote itself (P bits)
  and the result is the same. A sum of
  per-client votes: under a sequential or chunked client map it streams.

  Returns:
    An `Aggregator` (stateless) with a `StreamingSum`.
  """

  def init(params: PyTree) -> tuple:
    del params
    return ()

  def term(update: PyTree, weight: jax.Array, state: tuple) -> tuple[PyTree, jax.Array]:
    del state
    part = (weight > 0).astype(jnp.float32)
    return jax.tree.map(lambda u: part * _vote(u).astype(jnp.float32), update), part

  def finalize(total: PyTree, count: jax.Array, state: tuple, key: jax.Array) -> tuple[PyTree, tuple]:
    del count, key
    return jax.tree.map(jnp.sign, total), state

  def aggregate(updates: PyTree, weights: jax.Array, state: tuple, key: jax.Array) -> tuple[PyTree, tuple]:
    check_stacked_updates(updates, weights, "majority_vote")
    terms, counts = jax.vmap(term, in_axes=(0, 0, None))(updates, weights, state)
    total = jax.tree.map(lambda t: jnp.sum(t, axis=0), terms)
    out, state = finalize(total, jnp.sum(counts), state, key)
    return jax.tree.map(lambda o, u: o.astype(u.dtype), out, updates), state

  # A sum of the clients' votes, not of their updates: not linear. Not declared robust: its fault tolerance (the
  # paper's, against adversaries that flip their votes) is not a Byzantine rule's bound; SCAFFOLD and FedDyn take it.
  return Aggregator(init, aggregate, StreamingSum(term, finalize), traits=Traits(name="majority_vote", sums=True))
