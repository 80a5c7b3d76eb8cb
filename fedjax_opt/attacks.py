"""Simulated Byzantine clients: attacks on the round's stacked updates, and data poisoning.

Two seams, so an attack composes with any aggregator and any algorithm:

* Update attacks (`gaussian`, `omniscient`, `sign_flip`, `generalized_byzantine`,
  `alie`, `ipm`) are `Attack`s. `corrupt(aggregator, attack, attackers=...)`
  returns an `Aggregator` whose `aggregate` first replaces the attackers'
  rows of the stacked updates `[C, ...]` and then calls `aggregator`; pass it
  as `aggregator=` to any averaging algorithm, and the attack runs inside the
  same jitted round, between two passes of the non-finite guard
  (`core.server.Received`): the attackers read the updates the guard let
  through, and the server judges what they send as it judges any client. A
  row an attack makes non-finite (`omniscient(1e40)` overflows float32) is
  dropped before the rule sees it and counted in `metrics["num_nonfinite"]`;
  a round with no finite row left is rejected:

      agg = fo.attacks.corrupt(fo.aggregators.marginal_median(), fo.attacks.omniscient(1e4), attackers=0.2)
      algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.1), aggregator=agg)

* Data poisoning (`label_flip`) is a `DataAttack` on the clients' batches.
  `poison(algorithm, data_attack, attackers=..., num_clients=N)` returns a
  `FederatedAlgorithm` whose `step` poisons the attackers' data, then runs
  the algorithm's own `step`; it works with any algorithm and with
  `fedjax_opt.train` as is (train calls `algorithm.step`):

      algo = fo.attacks.poison(algo, fo.attacks.label_flip(10), attackers=0.2, num_clients=dataset.num_clients)
      state, history = fo.train(algo, algo.init(params, key), dataset, rounds, fo.Sampling(...))

Who the attackers are. `corrupt` sees rows, not client identities: the rows
are the round's clients in the order the algorithm stacks them, and
`attackers` picks among the rows that take part (weight > 0):

* a float f in [0, 1]: ⌊f · n⌋ of the n clients taking part;
* an int k: k of them (all of them if fewer take part);
* a sequence of row indices: exactly those rows (when they take part).

For a count, the rows are ranked by a random priority: fixed for the run
(from `seed`, kept in the aggregator state) by default, so with the same
rows taking part every round the same rows attack; or drawn afresh each
round from the round's key with `per_round=True`. Under client sampling a
row is a different client each round: a fixed row set is "the first
clients of every round", which for uniformly sampled rounds is a random
f-fraction of the round, as in the papers' simulations. `poison` does see
identities (`batches.client_id`): its attackers are a fixed set of the
dataset's clients.

Statistics an attacker reads ("honest" below) are over the clients taking
part that are not attackers, uniform (each one vote), except inside
`generalized_byzantine`, where every client is honest on most coordinates
and the values are computed from every participating client's own update.
Rows with weight 0 are never attacked: they take no part, and a robust rule
ignores them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_opt.aggregators.base import broadcast_rows as _rows
from fedjax_opt.core.ordering import row_positions, sort_rows
from fedjax_opt.core.server import (Received, check_aggregator, refuse_client_stage, refuse_downlink,
                                    zero_nonfinite)
from fedjax_opt.core.types import Aggregator, ClientBatches, DeferredData, FederatedAlgorithm, Traits

PyTree = Any

__all__ = [
    "Attack", "CorruptState", "DataAttack", "alie", "alie_z", "corrupt", "gaussian", "generalized_byzantine", "ipm",
    "label_flip", "omniscient", "poison", "sign_flip",
]


class Attack(NamedTuple):
  """An attack on the stacked client updates.

  Attributes:
    apply: `apply(updates [C, ...], weights [C], attackers [C] bool, key) -> updates`,
      pure and jittable; rows where `attackers` is False come back unchanged.
    sent: what an attacker sends, from the updates it knows:
      `sent(updates [C, ...], weights [C], known [C] bool, num_attackers, key) -> values`,
      the statistics read over the rows of `known`, `num_attackers` the
      count of attackers the attack presumes (ALIE's f); leaves `[C, ...]`
      (row i: what attacker i sends) or `[...]` (the same for all). The
      built-in attacks have one, and their `apply` puts these values in the
      attackers' rows with `known` the honest rows; `generalized_byzantine`
      calls it with every participating row known. None: an attack with
      only `apply` (it cannot give `generalized_byzantine` its values).
  """

  apply: Callable[[PyTree, jax.Array, jax.Array, jax.Array], PyTree]
  sent: Callable[[PyTree, jax.Array, jax.Array, jax.Array, jax.Array], PyTree] | None = None


class DataAttack(NamedTuple):
  """A data-poisoning attack on one round's client data.

  Attributes:
    apply: `apply(data [C, S, B, ...], attackers [C] bool) -> data`, pure and
      jittable; rows where `attackers` is False come back unchanged.
  """

  apply: Callable[[PyTree, jax.Array], PyTree]


class CorruptState(NamedTuple):
  """State of a `corrupt` aggregator.

  Attributes:
    aggregator: the wrapped aggregator's state.
    key: the PRNG key of the attackers' fixed priority order (unused with `per_round=True`).
    num_attackers: int32, the attacked rows of the last round.
  """

  aggregator: Any
  key: jax.Array
  num_attackers: jax.Array


# ---- shared pieces -----------------------------------------------------------------------------------------


def _check_number(value: Any, name: str, *, positive: bool = False) -> None:
  """A finite Python number (> 0 when `positive`); arrays (possibly traced, for sweeps) pass unchecked."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
      positive and not value > 0):
    raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}; got {value!r}.")


def _honest(weights: jax.Array, attackers: jax.Array) -> jax.Array:
  return (weights > 0) & ~attackers


def _known_mean(updates: PyTree, known: jax.Array) -> PyTree:
  """Uniform mean of the known rows (zeros if none), per leaf."""
  count = jnp.maximum(jnp.sum(known), 1)
  return jax.tree.map(lambda u: jnp.sum(jnp.where(_rows(known, u), u, 0), axis=0) / count.astype(u.dtype), updates)


def _from_sent(sent: Callable[..., PyTree]) -> Attack:
  """The `Attack` whose attackers send `sent(updates, weights, honest rows, number of attackers, key)`."""

  def apply(updates, weights, attackers, key):
    honest = _honest(weights, attackers)
    values = sent(updates, weights, honest, jnp.sum(attackers & (weights > 0)), key)
    return _replace_rows(updates, attackers, values)

  return Attack(apply, sent)


def _replace_rows(updates: PyTree, attackers: jax.Array, malicious: PyTree) -> PyTree:
  """Rows of `attackers` replaced by `malicious` (leaves `[C, ...]` or `[...]`, broadcast over rows)."""
  return jax.tree.map(lambda u, m: jnp.where(_rows(attackers, u), jnp.broadcast_to(m, u.shape).astype(u.dtype), u),
                      updates, malicious)


def _leaf_keys(key: jax.Array, tree: PyTree) -> PyTree:
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(jax.random.split(key, max(len(leaves), 1))[:len(leaves)]))


# ---- update attacks ----------------------------------------------------------------------------------------


def gaussian(scale: float) -> Attack:
  """Each attacker sends a random vector, every entry N(0, scale²) (the Gaussian attack of Xie et al. 2018).

  Args:
    scale: σ > 0, the standard deviation of each entry.
  """
  _check_number(scale, "gaussian: scale", positive=True)

  def sent(updates, weights, known, num_attackers, key):
    del weights, known, num_attackers
    return jax.tree.map(lambda u, k: scale * jax.random.normal(k, u.shape, u.dtype), updates,
                        _leaf_keys(key, updates))

  return _from_sent(sent)


def omniscient(factor: float) -> Attack:
  """The omniscient attack of Xie, Koyejo & Gupta (2018): −factor × the sum of the honest updates.

      ṽ_i = −factor · Σ_{j honest} v_j   for every attacker i.

  An attacker that sees every update sends their sum scaled by a large
  negative number, to move the model far against the descent direction.

  Args:
    factor: the scale (e.g. 1e4 … 1e20); any finite number, the sign is the formula's.
  """
  _check_number(factor, "omniscient: factor")

  def sent(updates, weights, known, num_attackers, key):
    del weights, num_attackers, key
    return jax.tree.map(lambda u: -factor * jnp.sum(jnp.where(_rows(known, u), u, 0), axis=0), updates)

  return _from_sent(sent)


def sign_flip(scale: float = 1.0) -> Attack:
  """Each attacker sends its own update negated and scaled: ṽ_i = −scale · v_i.

  Args:
    scale: how far the negation goes (1.0: plain sign flip).
  """
  _check_number(scale, "sign_flip: scale")

  def sent(updates, weights, known, num_attackers, key):
    del weights, known, num_attackers, key
    return jax.tree.map(lambda u: -scale * u, updates)

  return _from_sent(sent)


def ipm(epsilon: float) -> Attack:
  """Inner-product manipulation (Xie, Koyejo & Gupta, UAI 2019, arXiv:1903.03936): ṽ_i = −ε · mean of the honest.

  Small ε keeps the attackers close to the honest cluster (hard to filter)
  while turning the aggregate's inner product with the true gradient
  negative once the attackers' weight in the rule is large enough.

  Args:
    epsilon: ε > 0.
  """
  _check_number(epsilon, "ipm: epsilon", positive=True)

  def sent(updates, weights, known, num_attackers, key):
    del weights, num_attackers, key
    return jax.tree.map(lambda m: -epsilon * m, _known_mean(updates, known))

  return _from_sent(sent)


def alie_z(n: jax.Array, f: jax.Array) -> jax.Array:
  """Baruch, Baruch & Goldberg's z_max for n workers of which f attack: s = ⌊n/2 + 1⌋ − f, z = Φ⁻¹((n − s)/n).

  Traced n and f are fine. The probability is clipped into (0, 1) so z stays finite.
  """
  n = jnp.asarray(n, jnp.result_type(float))
  s = jnp.floor(n / 2 + 1) - f
  p = jnp.clip((n - s) / jnp.maximum(n, 1), 1e-6, 1 - 1e-6)
  return jax.scipy.special.ndtri(p)


def alie(z: float | None = None) -> Attack:
  """ALIE, "a little is enough" (Baruch, Baruch & Goldberg, NeurIPS 2019, arXiv:1902.06156).

      ṽ_i = μ − z · σ   (coordinate-wise) for every attacker i,

  where μ and σ are the coordinate-wise mean and standard deviation (n_h − 1
  in the denominator; 0 with one honest client) of the n_h honest updates.
  The attackers stay within the honest spread, so medians and
  distance-based rules keep them, but every attacker pushes the same way.

  Args:
    z: how many standard deviations to shift; None (the default): the
      paper's z_max from the n clients taking part and the f attackers of
      the round, s = ⌊n/2 + 1⌋ − f, z = Φ⁻¹((n − s)/n) (`alie_z`). Inside
      `generalized_byzantine`, μ and σ are those of every participating
      update and f is the number of clients corrupted per coordinate.
  """
  if z is not None:
    _check_number(z, "alie: z")

  def sent(updates, weights, known, num_attackers, key):
    del key
    count = jnp.sum(known)
    mean = _known_mean(updates, known)

    def std(u, m):
      sq = jnp.sum(jnp.where(_rows(known, u), jnp.square(u - m), 0), axis=0)
      return jnp.sqrt(sq / jnp.maximum(count - 1, 1).astype(u.dtype))

    shift = alie_z(jnp.sum(weights > 0), num_attackers) if z is None else z
    return jax.tree.map(lambda u, m: m - jnp.asarray(shift, u.dtype) * std(u, m), updates, mean)

  return _from_sent(sent)


def generalized_byzantine(fraction: float, values: Attack | float) -> Attack:
  """A dimensional (generalized) Byzantine failure (Xie, Koyejo & Gupta 2018).

      (ṽ_i)_j = arbitrary  if coordinate j of client i is corrupted,  (v_i)_j  otherwise,

  where, independently for every coordinate j, ⌊fraction · n⌋ of the
  attacker rows (n: clients taking part; all attacker rows if fewer) are
  drawn uniformly from the round's key to be corrupted. So at most
  ⌊fraction · n⌋ clients are wrong in any coordinate, while, over many
  coordinates, every attacker is wrong somewhere. With every row an
  attacker (`attackers=1.0` in `corrupt`) and fraction < 1/2 this is the
  paper's generalized Byzantine model, which coordinate-wise medians
  survive and the geometric median does not.

  An attack's values are computed from every participating client's own
  update (`Attack.sent` with all n rows known): each client is honest on
  most coordinates, and the omniscient adversary knows the updates. So
  `omniscient(1e4)` puts −10⁴ Σ_i v_i, `ipm(ε)` −ε · the mean of the v_i,
  and `alie()` their mean − z · std with z from n and f = ⌊fraction · n⌋
  (the clients corrupted per coordinate); `sign_flip` and `gaussian` are
  per row as ever.

  Args:
    fraction: the largest fraction of the n clients corrupted per coordinate,
      in (0, 1] (dimensional resilience needs < 1/2); a 0-d float array may
      be traced (a swept hyper-parameter; 0 then corrupts nothing).
    values: what a corrupted coordinate holds: a number (every corrupted
      entry is set to it), or an `Attack` with `sent` whose values are used
      at the corrupted coordinates (e.g. `gaussian(100.0)`, `omniscient(1e4)`).
  """
  if _is_array_fraction(fraction):
    fraction = _check_fraction_array(fraction, "generalized_byzantine: fraction")
  elif isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
    raise ValueError(f"generalized_byzantine: fraction must be a float in (0, 1] (the largest share of clients "
                     f"corrupted in one coordinate); got {fraction!r}.")
  else:
    fraction = float(fraction)
  if not isinstance(values, Attack):
    _check_number(values, "generalized_byzantine: values (a number or an Attack)")
  elif values.sent is None:
    raise ValueError("generalized_byzantine: values is an Attack without `sent`: a corrupted coordinate's value is "
                     "computed from every participating client's update, which needs Attack.sent (the built-in "
                     "attacks have one); give a number or an Attack with sent.")

  def apply(updates, weights, attackers, key):
    value_key, choice_key = jax.random.split(key)
    eligible = attackers & (weights > 0)
    taking_part = weights > 0
    per_coordinate = jnp.minimum(_count(fraction, jnp.sum(taking_part)), jnp.sum(eligible, dtype=jnp.int32))
    if isinstance(values, Attack):
      sent = values.sent(updates, weights, taking_part, per_coordinate, value_key)
    else:
      sent = jax.tree.map(lambda u: jnp.full_like(u, values), updates)

    def leaf(u, s, k):
      c = u.shape[0]
      # Per coordinate, the eligible rows with the ⌊fraction · n⌋ smallest random keys are corrupted. A key is
      # (24 − b random bits, then the row in the low b bits): unique within a coordinate and exact in float32,
      # so the count-th smallest, from a sorting network over the rows, is a sharp threshold.
      b = max(c - 1, 1).bit_length()
      if b > 23:
        raise ValueError(f"generalized_byzantine: at most 2**23 clients per round; got C = {c}.")
      bits = jax.random.randint(k, u.shape, 0, 1 << (24 - b))
      keys = (bits * (1 << b) + row_positions(u)).astype(jnp.float32)
      keys = jnp.where(_rows(eligible, u), keys, jnp.inf)
      kth = lax.dynamic_index_in_dim(sort_rows(keys), jnp.clip(per_coordinate - 1, 0, c - 1), keepdims=False)
      chosen = _rows(eligible, u) & (keys <= kth) & (per_coordinate > 0)
      return jnp.where(chosen, jnp.asarray(s, u.dtype), u)

    return jax.tree.map(leaf, updates, sent, _leaf_keys(choice_key, updates))

  return Attack(apply)


# ---- who attacks -------------------------------------------------------------------------------------------


def _is_array_fraction(value: Any) -> bool:
  """A 0-d floating array, possibly traced: a fraction given as an array (e.g. a swept hyper-parameter)."""
  return (isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.ndim(value) == 0
          and jnp.issubdtype(jnp.result_type(value), jnp.floating))


def _check_fraction_array(value: Any, name: str) -> Any:
  """A 0-d float array fraction: checked to be in [0, 1] when concrete; a traced one passes unchecked."""
  if not isinstance(value, jax.core.Tracer):
    v = float(value)
    if not 0 <= v <= 1:
      raise ValueError(f"{name} as a fraction must be in [0, 1]; got {v!r}.")
  return value


def _check_attackers(attackers: Any, name: str) -> Any:
  """A float fraction in [0, 1] (a Python float or a 0-d float array, possibly traced), an int count >= 0, or a
  sequence of indices >= 0; returned normalized (a tuple for indices)."""
  if isinstance(attackers, bool):
    raise TypeError(f"{name} must be a fraction (float in [0, 1]), a count (int >= 0) or a sequence of indices; "
                    f"got {attackers!r}.")
  if _is_array_fraction(attackers):
    return _check_fraction_array(attackers, name)
  if isinstance(attackers, float):
    if not 0 <= attackers <= 1:
      raise ValueError(f"{name} as a fraction must be in [0, 1]; got {attackers!r}.")
    return attackers
  if isinstance(attackers, int):
    if attackers < 0:
      raise ValueError(f"{name} as a count must be >= 0; got {attackers!r}.")
    return attackers
  if isinstance(attackers, (Sequence, np.ndarray)) and not isinstance(attackers, str):
    indices = np.asarray(attackers)
    if indices.ndim != 1 or (indices.size and (not np.issubdtype(indices.dtype, np.integer) or indices.min() < 0)):
      raise ValueError(f"{name} as indices must be a flat sequence of ints >= 0; got {attackers!r}.")
    return tuple(int(i) for i in indices)
  raise TypeError(f"{name} must be a fraction (float in [0, 1]), a count (int >= 0) or a sequence of indices; "
                  f"got {type(attackers).__name__}.")


def _count(attackers: Any, n: Any) -> jax.Array:
  """How many of the n clients attack: ⌊f · n⌋ for a fraction f (a float or a float array), min(k, n) for a count k."""
  if isinstance(attackers, int):
    return jnp.minimum(attackers, n).astype(jnp.int32)
  f = jnp.asarray(attackers, jnp.float32)
  return jnp.floor(f * jnp.asarray(n, jnp.float32) + 1e-6).astype(jnp.int32)


def _attacker_rows(attackers: Any, weights: jax.Array, key: jax.Array) -> jax.Array:
  c = weights.shape[0]
  taking_part = weights > 0
  if isinstance(attackers, tuple):
    if attackers and max(attackers) >= c:
      raise ValueError(f"corrupt: attacker rows {attackers} must be < C = {c}, the number of clients in the round.")
    rows = np.zeros(c, bool)
    rows[list(attackers)] = True
    return jnp.asarray(rows) & taking_part
  priority = jnp.where(taking_part, jax.random.uniform(key, (c,)), jnp.inf)
  rank = jnp.argsort(jnp.argsort(priority))
  return taking_part & (rank < _count(attackers, jnp.sum(taking_part)))


def corrupt(aggregator: Aggregator, attack: Attack, *, attackers: float | Sequence[int], seed: int = 0,
            per_round: bool = False) -> Aggregator:
  """`aggregator` behind an attack: the attackers' rows of the stacked updates are replaced, then aggregated.

      ṽ = attack(v, w, A, key),   (Δ, state) = aggregator.aggregate(ṽ', w', state, key'),

  with A ⊆ {rows taking part} the round's attackers (module docstring), v
  and w the rows and weights the non-finite guard let through, and (ṽ', w')
  the corrupted rows judged by the same guard (`core.server.Received`): an
  attacker whose row is non-finite takes no part in the rule and counts in
  `metrics["num_nonfinite"]`. Wrapping a `corrupt` aggregator runs both
  attacks, the outer first, before the guard judges the rows.

  Args:
    aggregator: any `Aggregator` (mean, a robust rule, ...) without a client
      stage (chain a stage in front of the corrupted aggregator instead).
    attack: an `Attack` (`gaussian`, `omniscient`, `sign_flip`,
      `generalized_byzantine`, `alie`, `ipm`, or one of your own).
    attackers: a fraction in [0, 1] or a count of the clients taking part,
      or a sequence of row indices. A fraction may be a 0-d float array,
      also a traced one, so `fo.sweep.vmap_algorithm` can sweep it in one
      compiled program (checked only when concrete).
    seed: the seed of the fixed priority order of the rows (a count or a
      fraction without `per_round`).
    per_round: draw the attacker rows afresh every round from the round's key.

  Returns:
    An `Aggregator` with state `CorruptState`, whose traits are an attack
    around the inner rule's (`Traits.wrap`; None when the inner rule's are
    unknown). Called directly, its `aggregate` checks at trace time that
    `weights` is `[C]` and every leaf of the updates `[C, ...]`, naming the leaf.
  """
  check_aggregator(aggregator)
  refuse_client_stage(aggregator, "corrupt", "the attack acts on what the server receives, after the client "
                      "stage; chain the stage in front of the attack: fo.aggregators.chain(stage, "
                      "fo.attacks.corrupt(aggregator, ...)).")
  refuse_downlink(aggregator, "corrupt", "the attack acts on what the server receives, before the broadcast; chain "
                  "the downlink after the attack: fo.aggregators.chain(fo.attacks.corrupt(aggregator, ...), downlink).")
  if not isinstance(attack, Attack):
    raise TypeError(f"attack must be a fedjax_opt.attacks.Attack (e.g. fo.attacks.omniscient(1e4)); "
                    f"got {type(attack).__name__}.")
  who = _check_attackers(attackers, "corrupt: attackers")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f"corrupt: seed must be a Python int; got {seed!r}.")
  if not isinstance(per_round, bool):
    raise TypeError(f"corrupt: per_round must be a bool; got {per_round!r}.")

  def init(params):
    return CorruptState(aggregator=aggregator.init(params), key=jax.random.key(seed),
                        num_attackers=jnp.zeros((), jnp.int32))

  nested = aggregator.aggregate if isinstance(aggregator.aggregate, Received) else None

  def receive(updates, weights, state, key):
    draw_key, attack_key, inner_key = jax.random.split(key, 3)
    rows = _attacker_rows(who, weights, draw_key if per_round else state.key)
    corrupted = attack.apply(updates, weights, rows, attack_key)
    inner = state.aggregator
    if nested is not None:  # the wrapped aggregator's attack, on the rows this one left finite
      clean, w, finite = zero_nonfinite(corrupted, weights)
      received, inner = nested.receive(clean, w, inner, inner_key)
      corrupted = jax.tree.map(lambda r, c: jnp.where(_rows(finite, r), r, c), received, corrupted)
    return corrupted, CorruptState(aggregator=inner, key=state.key, num_attackers=jnp.sum(rows, dtype=jnp.int32))

  def aggregate(updates, weights, state, key):
    inner_key = jax.random.split(key, 3)[2]
    rule = aggregator.aggregate if nested is None else nested.aggregate
    update, inner = rule(updates, weights, state.aggregator, inner_key)
    return update, state._replace(aggregator=inner)

  return Aggregator(init, Received(receive, aggregate, name="corrupt"), always_releases=aggregator.always_releases,
                    traits=Traits.wrap(aggregator.traits, name="corrupt", attack=True, linear=False))


# ---- data poisoning ----------------------------------------------------------------------------------------


def label_flip(num_classes: int, *, field: str = "y") -> DataAttack:
  """Label flipping: an attacker's labels y become num_classes − 1 − y (Biggio et al.; Fang et al. 2020).

  Args:
    num_classes: K, the number of classes (labels in [0, K)).
    field: the key of the labels in the batches' data dict.
  """
  if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
    raise ValueError(f"label_flip: num_classes must be a Python int >= 2; got {num_classes!r}.")

  def apply(data, attackers):
    if not isinstance(data, dict) or field not in data:
      keys = sorted(data) if isinstance(data, dict) else type(data).__name__
      raise ValueError(f"label_flip: the batches' data must be a dict with the labels under {field!r}; got {keys}. "
                       f"Pass field= to name the labels.")
    y = data[field]
    flipped = jnp.where(_rows(attackers, y), (num_classes - 1 - y).astype(y.dtype), y)
    return {**data, field: flipped}

  return DataAttack(apply)


@dataclasses.dataclass(frozen=True)
class _PoisonedTake:
  """The `take` of poisoned deferred data: `take`'s rows, then `data_attack` on the attackers' rows.

  Its refs are `(refs of take, attackers [C] bool)`. A value (equal when
  `take` and `data_attack` are), so a jitted step compiles once, not once
  per round.
  """

  take: Callable[[PyTree, PyTree], PyTree]
  data_attack: DataAttack

  def __call__(self, source: PyTree, refs: tuple[PyTree, jax.Array]) -> PyTree:
    inner, rows = refs
    return self._attacked(self.take(source, inner), rows)

  @property
  def has_local_split(self) -> bool:
    """Whether the clean data gives the clients' train splits (then they are poisoned as the rounds are)."""
    return bool(getattr(self.take, "has_local_split", False))

  def local_split(self, source: PyTree, refs: tuple[PyTree, jax.Array]) -> tuple[PyTree, jax.Array]:
    """The clients' whole train splits, the attackers' poisoned by `data_attack` like their rounds."""
    inner, rows = refs
    data, mask = self.take.local_split(source, inner)
    return self._attacked(data, rows), mask

  def _attacked(self, clean: PyTree, rows: jax.Array) -> PyTree:
    if rows.ndim == 0:  # one client
      one = self.data_attack.apply(jax.tree.map(lambda a: a[None], clean), rows[None])
      return jax.tree.map(lambda a: a[0], one)
    return self.data_attack.apply(clean, rows)


def _poisoned(data_attack: DataAttack, data: Any, attackers: jax.Array) -> Any:
  """`data_attack.apply(data, attackers)`; deferred data stays deferred (each chunk of clients is poisoned as it
  is gathered), and `apply` always receives a leading clients axis."""
  if not isinstance(data, DeferredData):
    return data_attack.apply(data, attackers)
  return DeferredData(data.source, (data.refs, attackers), _PoisonedTake(data.take, data_attack))


def poison(algorithm: FederatedAlgorithm, data_attack: DataAttack, *, attackers: float | Sequence[int],
           num_clients: int | None = None, seed: int = 0) -> FederatedAlgorithm:
  """`algorithm` whose attacking clients train on poisoned data: `step` applies `data_attack` first.

      step'(state, batches) = step(state, batches with data ← data_attack(data, A[client_id]))

  The attackers A are a fixed set of the dataset's clients (by
  `batches.client_id`), so a client attacks in every round it is sampled.
  `init` and `personalize` are the algorithm's own; the state is unchanged,
  so the result drops into `fedjax_opt.train`, `lax.scan` and sweeps.

  Args:
    algorithm: any `FederatedAlgorithm`.
    data_attack: a `DataAttack`, e.g. `label_flip(num_classes)`.
    attackers: a fraction in [0, 1] or a count of the `num_clients` clients
      (drawn with `seed`), or a sequence of client ids. A fraction may be a
      0-d float array, also a traced (swept) one: the first ⌊f · N⌋ clients
      of the same seeded permutation, so nested fractions pick nested sets.
    num_clients: N, the dataset's number of clients (needed for a fraction or
      a count), e.g. `dataset.num_clients`.
    seed: the seed of the draw of a fraction or a count.

  Returns:
    A `FederatedAlgorithm`.
  """
  if not isinstance(algorithm, FederatedAlgorithm):
    raise TypeError(f"poison: algorithm must be a fedjax_opt.FederatedAlgorithm; got {type(algorithm).__name__}.")
  if not isinstance(data_attack, DataAttack):
    raise TypeError(f"poison: data_attack must be a fedjax_opt.attacks.DataAttack (e.g. fo.attacks.label_flip(10)); "
                    f"got {type(data_attack).__name__}.")
  who = _check_attackers(attackers, "poison: attackers")
  if isinstance(who, tuple):
    size = max(who, default=-1) + 1 if num_clients is None else num_clients
    if who and max(who) >= size:
      raise ValueError(f"poison: attacker ids {who} must be < num_clients = {num_clients}.")
    table = np.zeros(size, bool)
    table[list(who)] = True
  else:
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
      raise ValueError(f"poison: a fraction or a count of attackers needs num_clients (a Python int >= 1, e.g. "
                       f"dataset.num_clients); got {num_clients!r}.")
    rank = np.empty(num_clients, np.int32)  # each client's place in the seeded permutation
    rank[np.random.default_rng(seed).permutation(num_clients)] = np.arange(num_clients)
    if isinstance(who, (int, float)):
      k = math.floor(who * num_clients + 1e-6) if isinstance(who, float) else min(who, num_clients)
      table = rank < k
    else:  # a float array, possibly traced: the first ⌊f · N⌋ of the same permutation
      table = jnp.asarray(rank) < _count(who, num_clients)

  def step(state, batches: ClientBatches):
    ids = batches.client_id
    known = (ids >= 0) & (ids < table.size)
    rows = known & jnp.asarray(table)[jnp.clip(ids, 0, max(table.size - 1, 0))] if table.size else known
    return algorithm.step(state, batches.replace(data=_poisoned(data_attack, batches.data, rows)))

  return algorithm._replace(step=step)
