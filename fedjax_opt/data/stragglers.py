"""System heterogeneity: stragglers that finish only part of their local work.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "Federated Optimization in
Heterogeneous Networks." MLSys 2020. arXiv:1812.06127. Its experiments
simulate devices that cannot finish a round's work: in every round 0%, 50% or
90% of the selected devices are stragglers, each running a number of local
epochs drawn uniformly between 1 and E instead of E.

Here, for a round's `ClientBatches` with S local steps:

    ⌊fraction · C⌉ of the C clients are stragglers, chosen uniformly without
    replacement (the rest keep all their steps);
    straggler c keeps its first s_c non-empty steps, s_c ~ Uniform{min_steps, …, τ_c},
    where τ_c is the number of steps of client c holding a real example
    (τ_c = S for every client of a fixed-step round of `sample_round`; in an
    epochs-mode round a small client's τ_c is its own E epochs):
        mask[c, s, :] ← mask[c, s, :] ∧ (s is among c's first s_c non-empty steps)

A straggler with s_c = 0 (possible when `min_steps=0`) dropped out: it has no
real example left, and its weight is set to 0, so it contributes nothing and
writes no per-client state. Partial stragglers keep their weight n_k.

What an algorithm does with partial work is the algorithm's business, and the
papers differ:

* FedProx aggregates the partial solutions (`stragglers`);
* FedAvg, as run in the FedProx paper, *drops* the stragglers: use
  `drop_stragglers(key, batches, fraction)`, which sets the same clients' weight
  to 0 (and clears their mask), so any averaging algorithm ignores them. With
  the same key, `stragglers` and `drop_stragglers` pick the same clients, so
  the two treatments can be compared on identical rounds;
* FedNova normalizes each update by the client's own number of steps τ_i;
  SCAFFOLD (option II) divides by each client's actual number of steps K.

Everything is `jax.random` and array masking, so it runs inside a jitted
`lax.scan` over rounds; `fraction` may be traced (e.g. `jax.vmap` over a grid of
straggler fractions), `min_steps` is static.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.types import ClientBatches
from fedjax_opt.core.validation import check_client_batches, check_in_range

__all__ = ["StragglerDraw", "draw_stragglers", "drop_stragglers", "stragglers"]


class StragglerDraw(NamedTuple):
  """Which clients straggle in a round, and how many of their steps each keeps.

  Attributes:
    is_straggler: `[C]` bool, exactly ⌊fraction · C⌉ True (round half to even).
    steps: `[C]` int32, s_c: the non-empty steps client c keeps (all of them,
      τ_c, for non-stragglers).
  """

  is_straggler: jax.Array
  steps: jax.Array


def _check(fraction: Any, min_steps: Any, local_steps: int | None = None) -> None:
  check_in_range(fraction, "fraction", 0.0, 1.0, closed_high=True)
  if jnp.ndim(fraction) != 0:
    raise ValueError(f"fraction must be a scalar; got shape {tuple(jnp.shape(fraction))}.")
  if isinstance(min_steps, bool) or not isinstance(min_steps, (int, np.integer)):
    raise TypeError(f"min_steps must be a Python int; got {type(min_steps).__name__}.")
  if min_steps < 0 or (local_steps is not None and min_steps > local_steps):
    raise ValueError(f"min_steps must lie in [0, S] = [0, {local_steps}] (S = local steps); got {min_steps}.")


def draw_stragglers(key: jax.Array, num_steps: jax.Array, fraction: Any, min_steps: int = 1) -> StragglerDraw:
  """Draws the stragglers of one round and the steps each keeps (jit-able).

  Args:
    key: PRNG key; the draw is a deterministic function of it.
    num_steps: `[C]` int, τ_c, each client's number of non-empty local steps
      (S for every client of a fixed-step round of `sample_round`).
    fraction: share of the C clients that straggle, in [0, 1]; may be traced.
    min_steps: smallest number of steps a straggler keeps (0 allows drop-outs);
      a client with τ_c < min_steps keeps its τ_c steps.

  Returns:
    A `StragglerDraw` with s_c ~ Uniform{min_steps, …, τ_c} for stragglers.
  """
  _check(fraction, min_steps)
  num_steps = jnp.asarray(num_steps, jnp.int32)
  if num_steps.ndim != 1:
    raise ValueError(f"num_steps must be [C], one step count per client; got shape {num_steps.shape}.")
  num_clients = num_steps.shape[0]
  pick_key, steps_key = jax.random.split(key)
  count = jnp.round(jnp.asarray(fraction, jnp.float32) * num_clients).astype(jnp.int32)
  is_straggler = jax.random.permutation(pick_key, num_clients) < count
  choices = jnp.maximum(num_steps - min_steps + 1, 1)
  drawn = min_steps + jnp.floor(jax.random.uniform(steps_key, (num_clients,)) * choices).astype(jnp.int32)
  drawn = jnp.minimum(drawn, num_steps)
  return StragglerDraw(is_straggler, jnp.where(is_straggler, drawn, num_steps))


def _draw_for(key: jax.Array, batches: ClientBatches, fraction: Any, min_steps: int) -> tuple[StragglerDraw, jax.Array]:
  check_client_batches(batches)
  nonempty = jnp.any(batches.mask, axis=2)  # [C, S]
  _check(fraction, min_steps, batches.local_steps)
  return draw_stragglers(key, jnp.sum(nonempty, axis=1, dtype=jnp.int32), fraction, min_steps), nonempty


def stragglers(key: jax.Array, batches: ClientBatches, fraction: Any, min_steps: int = 1) -> ClientBatches:
  """Makes a random `fraction` of the round's clients keep only their first s_c non-empty local steps.

  s_c ~ Uniform{min_steps, …, τ_c}, τ_c the client's number of non-empty steps
  (= S in a fixed-step round); its later steps are masked out (partial work,
  kept by the algorithm, as FedProx does). A client left with no real example
  (s_c = 0) gets weight 0: it dropped out.

  Args:
    key: PRNG key (use a fresh one per round).
    batches: the round's `ClientBatches` `[C, S, B, ...]`.
    fraction: share of clients that straggle, in [0, 1]; may be traced.
    min_steps: smallest number of steps a straggler keeps, in [0, S] (static).

  Returns:
    `ClientBatches` with the same data and client ids, a cut `mask` and the
    weight of drop-outs set to 0.
  """
  draw, nonempty = _draw_for(key, batches, fraction, min_steps)
  rank = jnp.cumsum(nonempty, axis=1, dtype=jnp.int32)  # 1-based index among the non-empty steps
  keep = nonempty & (rank <= draw.steps[:, None])
  mask = batches.mask & keep[:, :, None]
  dropped_out = jnp.any(batches.mask, axis=(1, 2)) & ~jnp.any(mask, axis=(1, 2))
  return batches.replace(mask=mask, weight=jnp.where(dropped_out, jnp.zeros_like(batches.weight), batches.weight))


def drop_stragglers(key: jax.Array, batches: ClientBatches, fraction: Any) -> ClientBatches:
  """Drops the round's stragglers entirely: FedAvg as run in the FedProx paper (Li et al. 2020).

  The same clients as `stragglers(key, batches, fraction)` picks get weight 0
  and an all-False mask, so an averaging algorithm aggregates only the clients
  that finished all their steps.

  Args:
    key: PRNG key (the same key as `stragglers` picks the same clients).
    batches: the round's `ClientBatches`.
    fraction: share of clients dropped, in [0, 1]; may be traced.

  Returns:
    `ClientBatches` with the stragglers' weight 0 and mask False.
  """
  draw, _ = _draw_for(key, batches, fraction, 0)
  kept = ~draw.is_straggler
  return batches.replace(
      mask=batches.mask & kept[:, None, None],
      weight=jnp.where(kept, batches.weight, jnp.zeros_like(batches.weight)),
  )
