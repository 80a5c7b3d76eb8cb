"""Server-side mechanics shared by every averaging algorithm.

* The non-finite rule, stated once (`finite_clients`, and for the algorithms
  that keep per-client rows or average over clients by hand `keep_rows`,
  `zero_rows`, `finite_mean`): a client whose message holds a NaN or Inf is
  dropped, weight 0, its row never reaching another client's model nor the
  server's, counted in `num_nonfinite`; a round with no finite client makes
  no step. Every family applies it through these helpers (and
  `aggregate_updates` / `core.rounds.client_round`, built on them).
* `aggregate_updates`: the non-finite guard around any aggregator. A client
  whose update holds a NaN or Inf is dropped (its weight set to 0 and its
  update to 0 before the aggregator sees it) and counted; a round where no
  client is left is rejected: the update is 0 and the aggregator state is
  kept. The model is never corrupted by one broken client.
* `Received`: an aggregate function in two steps, what the server receives
  (a simulated attack, `fedjax_opt.attacks.corrupt`) and then the rule. The
  guard judges the rows as received: a row the first step makes non-finite
  is dropped and counted like any non-finite client, before the rule sees it.
* `apply_server_update`: feeds the pseudo-gradient −Δ to an optax server
  optimizer, x ← x + u with u = ServerOpt(−Δ); a rejected round leaves both
  the model and the optimizer state unchanged.
* `protecting_piece`: what an aggregator does beyond a plain sum, read from
  its declared `Aggregator.traits` (None: unknown), for the algorithms whose
  server moves state by a plain sum outside the aggregator.
* `check_stacked_updates`: the trace-time shape check every aggregator runs
  (`weights` `[C]`, every leaf of `updates` `[C, ...]`), naming the leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core.tree import global_norm, select_rows, select_tree, tree_bits
from fedjax_opt.core.types import Aggregator, ClientStage, NoisedState, Traits

__all__ = ["Aggregated", "ROUND_METRICS", "Received", "aggregate_updates", "aggregator_name", "apply_server_update",
           "check_aggregator", "check_stacked_updates", "client_is_finite", "finish_aggregation", "finite_clients",
           "finite_mean", "guarded_aggregate", "initial_round_metrics", "keep_rows", "protecting_piece", "refuse_unknown_traits", "round_metrics", "zero_nonfinite",
           "zero_rows"]

PyTree = Any


class Aggregated(NamedTuple):
  """Result of `aggregate_updates`.

  Attributes:
    update: the aggregate Δ (zeros when the round is rejected).
    state: the aggregator's new state (the old one when rejected).
    finite: `[C]` bool, the clients whose update was finite.
    num_nonfinite: scalar int32, clients taking part whose update was dropped.
    accepted: scalar bool, False when no client with a finite update took part (unless the
      aggregator `always_releases`) or the aggregate is not finite.
    detail: None, or what an aggregation of the algorithm's own hands back beside these fields
      (a clustered round's `core.clusters.ClusterAggregated`: `core.rounds.client_round(..., aggregate=...)`).
  """

  update: PyTree
  state: Any
  finite: jax.Array
  num_nonfinite: jax.Array
  accepted: jax.Array
  detail: Any = None


def client_is_finite(updates: PyTree) -> jax.Array:
  """`[C]` bool: True where every entry of client c's update is finite."""
  per_leaf = [jnp.all(jnp.isfinite(u.reshape(u.shape[0], -1)), axis=1) for u in jax.tree.leaves(updates)]
  return jnp.all(jnp.stack(per_leaf), axis=0)


def finite_clients(*messages: PyTree, ok: jax.Array | None = None,
                   taking_part: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """THE non-finite rule of the library, stated once: which clients count this round, and how many were dropped.

  A client (a row c of every leaf of `messages`, each stacked `[C, ...]`; a scalar per client is `[C]`) whose
  message holds a NaN or an Inf anywhere is dropped: its weight is 0 and its row never reaches another client's
  model nor the server's (the caller keeps that client's previous rows, `keep_rows`, or sends zeros in its place,
  `zero_rows`, or gives it weight 0, `zero_nonfinite`), and it is counted in the round's `num_nonfinite`. A round
  in which no finite client took part makes no step (`finite_mean` is 0 then; `finish_aggregation` rejects the
  round, keeping the model and the aggregator state). Every family applies the rule through this function:
  `aggregate_updates` and `core.rounds.client_round` for the averaging ones, directly for the algorithms that
  keep per-client rows (ADMM's x_i and duals, a node's model and tracker, a mixture's local models).

  Args:
    messages: what each client computed and sends this round, one pytree or several (all judged together).
    ok: optional `[C]` bool, a condition known already (finite in an earlier exchange of the round): a client
      not `ok` is dropped and counted as well.
    taking_part: optional `[C]` bool, the clients that took part; only those are counted (default: all).

  Returns:
    `(finite, num_nonfinite)`: `[C]` bool, True for a client that counts, and the int32 number of the clients
    taking part that were dropped.
  """
  finite = client_is_finite(messages)
  if ok is not None:
    finite = ok & finite
  dropped = ~finite if taking_part is None else taking_part & ~finite
  return finite, jnp.sum(dropped, dtype=jnp.int32)


def keep_rows(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """Row c of `new` where `finite[c]`, else the previous row c of `old`, bit for bit (`core.tree.select_rows`).

  The non-finite rule (`finite_clients`) for state kept per client: a dropped client keeps its previous rows.
  For the ADMM families it is also the rule of their dual variables: a non-finite client keeps its previous x_i
  and its dual u_i / λ_i (an edge with a non-finite end keeps its dual); a decentralized node keeps its model and
  tracker. Leaves are `[C, ...]`.
  """
  return select_rows(finite, new, old)


def zero_rows(finite: jax.Array, rows: PyTree) -> PyTree:
  """`rows` with every row of a dropped client (not `finite`) set to 0: what it sends in place of its message.

  The non-finite rule (`finite_clients`) before a sum or a mixing matrix: a NaN times a zero weight is still NaN.
  """
  return select_rows(finite, rows, jax.tree.map(jnp.zeros_like, rows))


def finite_mean(values: jax.Array, finite: jax.Array | None = None) -> jax.Array:
  """The mean of `values` `[C]` over the clients that count (`finite`, default: the finite entries of `values`);
  0 when none does: a round without a finite client makes no step (`finite_clients`)."""
  if finite is None:
    finite = client_is_finite(values)
  return jnp.sum(jnp.where(finite, values, 0)) / jnp.maximum(jnp.sum(finite), 1).astype(values.dtype)


def check_aggregator(aggregator: Any) -> Aggregator:
  """Raises TypeError unless `aggregator` is an `Aggregator` (`fedjax_opt.aggregators` builds them); returns it."""
  if isinstance(aggregator, ClientStage):
    raise TypeError(f"aggregator: {aggregator.name} is a client stage, not an aggregator: chain it before one, "
                    f"fo.aggregators.chain({aggregator.name}, fo.aggregators.mean()).")
  if not isinstance(aggregator, Aggregator):
    raise TypeError(f"aggregator must be a fedjax_opt.aggregators.Aggregator (e.g. fo.aggregators.mean()); "
                    f"got {type(aggregator).__name__}.")
  if aggregator.traits is not None and not isinstance(aggregator.traits, Traits):
    raise TypeError(f"aggregator.traits must be a fedjax_opt.aggregators.Traits or None; got "
                    f"{type(aggregator.traits).__name__}.")
  return aggregator


def refuse_client_stage(aggregator: Aggregator, who: str, why: str) -> None:
  """Raises ValueError, naming `who` and the stage, when `aggregator` has a client stage that `who` cannot take."""
  if aggregator.client is not None:
    raise ValueError(f"{who} cannot compose with the aggregator's client stage {aggregator.client.name}: {why}")


def refuse_downlink(aggregator: Aggregator, who: str, why: str) -> None:
  """Raises ValueError, naming `who` and the downlink, when `aggregator` has a downlink that `who` cannot take."""
  if aggregator.downlink is not None:
    raise ValueError(f"{who} cannot compose with the aggregator's downlink {aggregator.downlink.name}: {why}")


def aggregator_name(aggregator: Aggregator) -> str:
  """A label for `aggregator` in a message: its declared `traits.name`, or, for a piece without traits, what its
  `aggregate` is called (text only: nothing is recognised by it)."""
  if aggregator.traits is not None:
    return aggregator.traits.name
  fn = aggregator.aggregate
  label = getattr(fn, "__qualname__", None) or type(fn).__name__
  return f"an aggregator without traits ({label})"


def protecting_piece(aggregator: Aggregator) -> str | None:
  """What `aggregator` does to the updates beyond a plain sum, read from its declared `traits`:

  "unknown" when `aggregator.traits` is None (a piece the library did not make: its `aggregate` may clip, noise,
  hide or filter the updates, and nothing says); else "attack" (`fo.attacks.corrupt`), "secure_aggregation" (the
  server sees only a sum), "dp_mean" (private: clipped and noised), "robust" (a robust rule), the first that holds
  in this order (the outermost piece of the library's compositions); None for a piece that does none of these
  (the mean, the weighted mean, a majority vote, a client stage in front of one).

  For algorithms whose server also moves state by a plain sum of the clients' exact messages outside the
  aggregator (SCAFFOLD's c, FedDyn's h): such a piece would protect the update and leave that side channel
  unprotected, so they refuse it, and refuse an unknown one (`refuse_unknown_traits`).
  """
  traits = aggregator.traits
  if traits is None:
    return "unknown"
  for flag, piece in (("attack", "attack"), ("secure", "secure_aggregation"), ("private", "dp_mean"),
                      ("robust", "robust")):
    if getattr(traits, flag):
      return piece
  return None


def refuse_unknown_traits(aggregator: Aggregator, who: str, side_channel: str) -> None:
  """Raises ValueError, in one line naming `who` and how to declare traits, when `aggregator.traits` is None.

  `side_channel` says what the algorithm's server moves by a plain sum outside the aggregator.
  """
  if aggregator.traits is None:
    raise ValueError(
        f"{who}: {aggregator_name(aggregator)} declares no traits, so nothing says whether it clips, noises, hides "
        f"or filters the updates while {side_channel} moves by a plain sum outside it; declare them, e.g. "
        f"Aggregator(init, aggregate, streaming, traits=fo.aggregators.Traits(name=\"my_mean\", linear=True)) for a "
        f"plain weighted mean ({who} refuses private, secure, robust and attack pieces).")


def check_declared_privacy(aggregator: Aggregator, state: Any) -> None:
  """Raises ValueError, in one line, when `aggregator`'s declared traits and its state disagree about privacy.

  The accountant (`fo.train`'s `accounting=`) reads σ and m from a `fo.privacy.DPMeanState` in the state, and
  that state is what `fo.privacy.dp_mean`'s `init` makes. Whether the aggregate really clips and adds that noise
  is what the piece's traits declare (`Traits.private`), so the two must agree; nothing is assumed:

  * a state holding a `DPMeanState` under a piece that does not declare itself private (traits None: built by
    hand, or `dp_mean`'s aggregate wrapped in a lambda or a `functools.partial`; or declared not private) is
    refused: an ε would be reported for noise nothing says is added;
  * a piece declared private whose state holds no `DPMeanState` is refused: no accountant could read its σ;
  * a declared σ (`Traits.noise_multiplier`, when known) must be the state's σ (when concrete).

  Called by `core.rounds.init_aggregator_state`, which every algorithm calls for its aggregator's state.
  """
  is_dp = lambda x: isinstance(x, NoisedState)  # fo.privacy.DPMeanState is one (privacy builds on the core)
  held = [x for x in jax.tree.leaves(state, is_leaf=is_dp) if is_dp(x)]
  traits = aggregator.traits
  name = aggregator_name(aggregator)
  if held and (traits is None or not traits.private):
    why = ("declares no traits (built by hand, or around a lambda or a functools.partial)" if traits is None
           else "declares itself not private (traits.private is False)")
    raise ValueError(f"aggregator: {name} keeps a fo.privacy.dp_mean state (DPMeanState) but {why}, so nothing "
                     f"says its aggregate clips and adds the noise an accountant would count; use the piece "
                     f"fo.privacy.dp_mean builds (alone or inside the library's wrappers) as it is, or declare "
                     f"traits=fo.aggregators.Traits(name=..., private=True, noise_multiplier=σ, clip_norm=C).")
  if traits is not None and traits.private and not held:
    raise ValueError(f"aggregator: {name} declares itself private (traits.private) but its state holds no "
                     f"fo.privacy.DPMeanState, from which an accountant reads σ and m; build the private piece "
                     f"with fo.privacy.dp_mean, or do not declare private=True.")
  if held and traits.noise_multiplier is not None:
    for s in held:
      try:
        sigma = np.asarray(s.noise_multiplier, np.float64)
      except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        continue
      if not np.allclose(sigma, np.float32(traits.noise_multiplier), rtol=1e-6, atol=0):
        raise ValueError(f"aggregator: {name} declares noise_multiplier σ = {traits.noise_multiplier:g} but its "
                         f"state's dp_mean adds σ = {sigma.ravel()[0]:g}: declare the σ of the noise added.")


def check_stacked_updates(updates: PyTree, weights: Any, who: str) -> int:
  """C, the static number of rows, after checking at trace time that `weights` is `[C]` and every leaf of `updates`
  is stacked `[C, ...]` on axis 0; a ValueError otherwise, in one line naming `who`, the leaf and the axis."""
  shape = tuple(jnp.shape(weights))
  if len(shape) != 1:
    raise ValueError(f"{who}: weights must have shape [C] (one weight per client, on axis 0); got shape {shape}.")
  c = shape[0]
  for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]:
    leaf_shape = tuple(jnp.shape(leaf))
    if not leaf_shape or leaf_shape[0] != c:
      found = "no axis 0" if not leaf_shape else f"{leaf_shape[0]} rows on axis 0"
      raise ValueError(f"{who}: every leaf of updates must be stacked [C, ...] with C = {c} (the length of weights) "
                       f"on axis 0; updates{jax.tree_util.keystr(path)} has {found} (shape {leaf_shape}).")
  return c


def zero_nonfinite(updates: PyTree, weights: jax.Array) -> tuple[PyTree, jax.Array, jax.Array]:
  """The guard's first half: `(updates, weights, finite)` with non-finite clients' rows and weights set to 0."""
  finite = client_is_finite(updates)
  w = jnp.where(finite, weights, jnp.zeros_like(weights))
  clean = jax.tree.map(
      lambda u: jnp.where(finite.reshape((-1,) + (1,) * (u.ndim - 1)), u, jnp.zeros_like(u)), updates)
  return clean, w, finite


def finish_aggregation(update: PyTree, new_state: Any, state: Any, used_weights: jax.Array, weights: jax.Array,
                       finite: jax.Array, always_releases: bool = False) -> Aggregated:
  """The guard's second half: accept the round when a finite client took part and the aggregate is finite.

  `used_weights` are the weights after the non-finite clients were zeroed, `weights` those before.
  `always_releases` (the aggregator's `Aggregator.always_releases`) accepts a round without clients too.
  """
  someone = jnp.ones((), bool) if always_releases else jnp.any(used_weights > 0)
  accepted = someone & jnp.all(client_is_finite(jax.tree.map(lambda u: u[None], update)))
  update = jax.tree.map(lambda u: jnp.where(accepted, u, jnp.zeros_like(u)), update)
  return Aggregated(
      update=update,
      state=select_tree(accepted, new_state, state),
      finite=finite,
      num_nonfinite=jnp.sum((weights > 0) & ~finite, dtype=jnp.int32),
      accepted=accepted,
  )


@dataclasses.dataclass(frozen=True)
class Received:
  """An `Aggregator.aggregate` in two steps: what the server receives, then the rule.

      (ṽ, state') = receive(v, w, state, key)      the rows as the server receives them (a simulated attack)
      (Δ, state'') = aggregate(ṽ', w', state', key)

  where (ṽ', w') are ṽ and w after the non-finite guard (`zero_nonfinite`).
  Called as a function it runs `guarded_aggregate`; `aggregate_updates` (the
  round's guard) runs it too, so a row that `receive` makes non-finite is
  dropped and counted in `num_nonfinite` like any non-finite client, and a
  round left without a finite client is rejected. `receive` sees the rows
  after the guard (non-finite clients already at weight 0), may change only
  rows that take part, and returns the rows in their dtypes. It needs the
  stacked rows, so an aggregator built on it has no streaming form.

  Attributes:
    receive: `receive(updates [C, ...], weights [C], state, key) -> (updates, state)`.
    aggregate: `aggregate(updates, weights, state, key) -> (update, state)`, the rule on the received rows.
    name: a label (the factory that built it), for messages.
  """

  receive: Callable[[PyTree, jax.Array, Any, jax.Array], tuple[PyTree, Any]]
  aggregate: Callable[[PyTree, jax.Array, Any, jax.Array], tuple[PyTree, Any]]
  name: str = "received"

  def __post_init__(self):
    object.__setattr__(self, "__name__", self.name)  # as a function's: jit and error messages name the factory
    object.__setattr__(self, "__qualname__", self.name)

  def __call__(self, updates: PyTree, weights: jax.Array, state: Any, key: jax.Array) -> tuple[PyTree, Any]:
    check_stacked_updates(updates, weights, self.name)
    update, new_state, _, _ = guarded_aggregate(self, updates, weights, state, key)
    return update, new_state


def guarded_aggregate(aggregate: Callable[..., tuple[PyTree, Any]], updates: PyTree, weights: jax.Array, state: Any,
                      key: jax.Array) -> tuple[PyTree, Any, jax.Array, jax.Array]:
  """`aggregate` (an `Aggregator.aggregate`) on the rows the non-finite guard lets through.

  Returns `(update, new_state, used_weights, finite)`: `used_weights` `[C]` are the weights with every dropped
  row at 0, `finite` `[C]` is False for a row that was non-finite as sent or, for a `Received`, as received.
  """
  clean, w, finite = zero_nonfinite(updates, weights)
  if isinstance(aggregate, Received):
    received, state = aggregate.receive(clean, w, state, key)
    clean, w, finite_received = zero_nonfinite(received, w)
    finite = finite & finite_received
    aggregate = aggregate.aggregate
  update, new_state = aggregate(clean, w, state, key)
  return update, new_state, w, finite


def aggregate_updates(aggregator: Aggregator, updates: PyTree, weights: jax.Array, state: Any, key: jax.Array) -> Aggregated:
  """Aggregates stacked client updates `[C, ...]` with the non-finite guard (of the rows as received: `Received`)."""
  check_stacked_updates(updates, weights, aggregator_name(aggregator))
  update, new_state, w, finite = guarded_aggregate(aggregator.aggregate, updates, weights, state, key)
  return finish_aggregation(update, new_state, state, w, weights, finite, aggregator.always_releases)


def apply_server_update(optimizer: optax.GradientTransformation, params: PyTree, opt_state: Any, delta: PyTree,
                        accepted: jax.Array) -> tuple[PyTree, Any]:
  """x ← x + ServerOpt(−Δ); unchanged (model and optimizer state) when `accepted` is False."""
  pseudo_gradient = jax.tree.map(jnp.negative, delta)
  updates, new_opt_state = optimizer.update(pseudo_gradient, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  return select_tree(accepted, new_params, params), select_tree(accepted, new_opt_state, opt_state)


ROUND_METRICS = {
    "client_loss": jnp.float32,
    "update_norm": jnp.float32,
    "num_clients": jnp.int32,
    "num_nonfinite": jnp.int32,
    "num_examples": jnp.float32,
    "round_accepted": jnp.bool_,
    "bits_up": jnp.float32,
    "bits_down": jnp.float32,
}
"""The diagnostics every averaging algorithm reports in `state.metrics` after a round.

* client_loss: mean training loss over the examples of the aggregated clients
  (each loss taken before the local step that used it);
* update_norm: ‖Δ‖₂ of the aggregate;
* num_clients: clients aggregated (weight > 0 and a finite update);
* num_nonfinite: clients dropped because their update held NaN/Inf;
* num_examples: examples the aggregated clients trained on;
* round_accepted: False when no finite client took part (model unchanged);
* bits_up: mean bits sent per client that took part (weight > 0, whether or
  not its update was then dropped): the compressor's exact count
  (`fedjax_opt.compression`), or every bit of the update uncompressed (32 P
  per float32 model-sized message); 0 when no client took part;
* bits_down: bits each client received (the broadcast: 32 P per float32
  model-sized message).
"""


def initial_round_metrics() -> dict[str, jax.Array]:
  """Zeros with the structure and dtypes of `round_metrics`, for `init` (so `step` scans)."""
  return {name: jnp.zeros((), dtype) for name, dtype in ROUND_METRICS.items()}


def round_metrics(loss: jax.Array, num_examples: jax.Array, weights: jax.Array, agg: Aggregated, *,
                  bits_up: jax.Array | None = None, bits_down: jax.Array | None = None) -> dict[str, jax.Array]:
  """Builds `ROUND_METRICS` from the clients' `[C]` losses, example counts and bits sent (`bits_up`), the bits
  each received (`bits_down`, a scalar) and the aggregation result.

  `bits_up` / `bits_down` None: one message the size of the aggregate each way (every bit of `agg.update`:
  32 P for a float32 model), the round of an uncompressed algorithm; 0 without an aggregate.
  """
  used = (weights > 0) & agg.finite & agg.accepted
  taking_part = weights > 0
  message = float(tree_bits(agg.update))
  bits_up = jnp.full(weights.shape, message, jnp.float32) if bits_up is None else bits_up
  bits_down = jnp.asarray(message, jnp.float32) if bits_down is None else bits_down
  n = jnp.where(used, num_examples, 0)
  safe_loss = jnp.where(used, loss, 0)
  values = {
      "client_loss": jnp.sum(n * safe_loss) / jnp.maximum(jnp.sum(n), 1),
      "update_norm": global_norm(agg.update),
      "num_clients": jnp.sum(used),
      "num_nonfinite": agg.num_nonfinite,
      "num_examples": jnp.sum(n),
      "round_accepted": agg.accepted,
      "bits_up": jnp.sum(jnp.where(taking_part, bits_up, 0)) / jnp.maximum(jnp.sum(taking_part), 1),
      "bits_down": jnp.asarray(bits_down),
  }
  return {name: values[name].astype(dtype) for name, dtype in ROUND_METRICS.items()}
