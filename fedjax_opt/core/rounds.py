"""One round of the participating clients: gather → client update → guard → scatter → aggregate.

Every algorithm that trains its clients on the server model and sends
something back runs the same skeleton; `client_round` is that skeleton, once:

    rows_k   = gather(table, client_id_k)                   for each per-client table
    out_k    = client_update(shared, data_k, mask_k, *rows_k)          (client_map over k)
    w_k      = n_k if client k took a local step, else 0             (the no-step rule)
    Δ, ok_k  = aggregate_updates(aggregator, update_k, w_k)        (the non-finite guard)
    table    = scatter(table, client_id_k, new_rows_k, write_k)

and hands back everything the algorithm needs for its server step (the
aggregate, the stacked client outputs, the scattered tables, the round's
metrics). What stays in the algorithm is only what is its own: SCAFFOLD's
c ← c + (1/N) Σ Δc_i, FedDyn's h, FedNova's τ_eff, EASGD's elastic center,
FedU's Laplacian step, the server optimizer.

The rules, the same for every algorithm:

* No step, no part. A client whose local training took no step (every batch
  of the round empty: a straggler cut to zero steps, a client with no data
  this round, a zero-weight padding client) sends nothing: its weight is 0,
  it is not counted in `num_clients`, its rows are not written.
* Non-finite. A client whose update holds a NaN or Inf is dropped by the
  guard (`core.server.aggregate_updates`) and counted in `num_nonfinite`;
  a round in which no finite client is left is rejected (the model and the
  aggregator state stay as they were). A client writes its rows only when it
  took part, its update was aggregated, the round was accepted and the new
  rows are finite themselves.
* Rows that are the client's own (Ditto's personal model) may be written
  independently of the round (`rows_follow_round=False`): then a client
  writes when its weight is > 0, its rows are finite and its own condition
  (`ClientOutput.writes`, e.g. "made a personal step") holds.
* Streaming. When the aggregator is a sum (`Aggregator.streaming`: the mean,
  the weighted mean) and the client map runs the clients in a loop
  (sequential, chunked with fewer than C clients per chunk, or `auto`
  choosing one of them), each client's update is checked, weighted and
  added to one running sum inside the loop (`client_map.map_clients_and_sum`)
  instead of being stacked `[C, ...]`: the same rules, the same result to
  float tolerance, and memory that does not grow with C. `Round.results.delta`
  is then None (nothing downstream reads it); per-client rows are still
  stacked for the scatter. `vmap` and `sharded` keep the stacked form.
* Data where it is used. When `batches.data` is a `DeferredData` (as
  `fedjax_opt.train` samples it) and the clients run in a loop, each chunk
  gathers its own clients' examples from the shared store inside the loop,
  so the round never holds the `[C, S, B, ...]` batch; otherwise the data is
  gathered once, before the map, as any other data.
* Without an aggregator (EASGD, FedU, the mixtures, the decentralized nodes:
  the server does not average updates) a client is finite when its new rows
  are, and whatever else it computed that the algorithm reads
  (`ClientOutput.checked`), and the round is accepted when at least one
  client wrote. A family in which every client takes part every round
  whatever its data (the mixtures, a graph's nodes) gives the round
  `every_client(batches)` and has each client report one step
  (`full_participation_output`).
* The client stage (`Aggregator.client`, e.g. `fedjax_opt.compression.compress`
  chained before the aggregator by `fedjax_opt.aggregators.chain`): the
  first piece of the seam, before the aggregator (and so before DP clipping
  and secure summation). Each message m_k a client sends — its update u_k
  (what the aggregator receives), then its further uploads
  (`ClientOutput.uploads`, SCAFFOLD's Δc_k) — is replaced inside the client
  map, so in the stacked and the streamed path alike, by

      (sent_k, r_k', bits_k) = stage.apply(key_k, m_k, r_k)      (compression: sent_k = C(m_k + e_k), e_k' = m_k + e_k − sent_k)

  where r_k is client k's row of that message's table (`StagedState.rows`,
  None for a stage that keeps none) and key_k = fold_in(fold_in(key,
  MESSAGE_STREAMS[j]), client_id_k) for the j-th kind of message, `key` the
  aggregator's key: the aggregator's key is left as it is, so a round without
  a stage draws exactly what it drew before. A client whose messages belong
  to one of K slots (IFCA's cluster choice, `ClientOutput.slot`) keeps a
  row per slot (a table made from stacked `[K, ...]` parameters): r_k is
  then entry slot_k of its row, and only that entry is replaced. The
  update's row is written when the client took part, its update was
  aggregated, the round was accepted and the new row is finite. A further upload is *received* (`Round.received`)
  from a client that took part in an accepted round with its update
  aggregated, its own rows finite and its own condition holding, when the
  message is finite; its row is written when it was received and the new row
  is finite. The stage's tables come back in `Round.agg.state`, a
  `StagedState` (`init_aggregator_state` makes the first one).
* An aggregation of the algorithm's own (`aggregate=`: IFCA's per-cluster
  means, `core.clusters`) replaces the guarded aggregation of all the
  stacked updates. It returns a `core.server.Aggregated` whose `finite`
  marks the clients it aggregated and whose `accepted` is the round's;
  everything else (the client stage, its tables, the rows, the bits) is as
  above. Such a round does not stream.
* Bits. `Round.bits_up` `[C]` is what each client sent, summed over its
  messages: the stage's count, or, without a stage, every bit of the message
  (32 P for a float32 model of P entries; SCAFFOLD's Δy_k and Δc_k are two).
  `Round.bits_down` is what each client received: every bit of `shared` (the
  broadcast; SCAFFOLD's (x, c) is two models), or, when nothing is shared
  (FedU), one row of the first table. `Round.metrics` reports their means as
  `bits_up` / `bits_down`. An algorithm that compresses its broadcast
  (`core.averaging`'s downlink) sends it after the round and replaces
  `bits_down` with the compressor's count (`Round._replace(bits_down=...)`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.server import (Aggregated, aggregate_updates, check_declared_privacy, client_is_finite,
                                    finish_aggregation, finite_clients, round_metrics, zero_nonfinite)
from fedjax_opt.core.tree import tree_bits
from fedjax_opt.core.types import (Aggregator, ClientBatches, ClientStage, DeferredData, PyTree, StagedState,
                                   materialize)

__all__ = ["ClientOutput", "Round", "client_round", "every_client", "full_participation_output",
           "init_aggregator_state"]

MESSAGE_STREAMS = (0x636F6D70, 0x6374726C)
"""Folded into the round's aggregator key to make the client stage's keys, one per kind of message: the
update's (ASCII "comp") and a second upload's (ASCII "ctrl", SCAFFOLD's Δc_i). Separate streams."""


class ClientOutput(NamedTuple):
  """What `client_update` returns for one client.

  Attributes:
    result: the client's `LocalResult` (its `num_steps` decides whether it
      took part; its loss and example count feed the metrics).
    update: what the aggregator receives; None: `result.delta`.
    rows: the client's new rows, one per table given to `client_round`, in order.
    extras: anything else the algorithm wants back, stacked `[C, ...]`.
    writes: optional scalar bool, the client's own condition for writing its rows.
    uploads: further messages the client sends beside its update (SCAFFOLD's
      Δc_i), each a pytree: they pass the aggregator's client stage as the
      update does but not the aggregator, and come back in `Round.uploads`.
    slot: optional scalar int, the slot its messages belong to (IFCA's cluster
      choice), for a client stage whose rows are `[K, ...]` (module docstring);
      None: each row is shaped like its message.
    checked: what else the client computed that must be finite for it to
      count, without an aggregator (a gradient or a loss the algorithm reads
      beside its new rows: a mixture's ∇f_i at an aggregation step); None:
      its rows alone.
  """

  result: LocalResult
  update: PyTree = None
  rows: tuple = ()
  extras: Any = None
  writes: jax.Array | None = None
  uploads: tuple = ()
  slot: jax.Array | None = None
  checked: PyTree = None


class Round(NamedTuple):
  """What `client_round` hands back (leaves stacked `[C, ...]` where per client).

  Attributes:
    results: the clients' `LocalResult`s.
    weights: `[C]` aggregation weights: `batches.weight`, 0 for clients that took no step.
    agg: the guarded aggregation (`core.server.Aggregated`); without an
      aggregator its `update` and `state` are None. With a client stage its
      `state` is the new `StagedState` (tables and server state).
    write: `[C]` bool, the clients allowed to write their rows.
    stored: one `per_client.Scattered` per table (new table, rows written, change of the row sum).
    extras: the clients' `ClientOutput.extras`.
    bits_up: `[C]` float32, the bits each client sent (module docstring).
    bits_down: scalar float32, the bits each client received.
    uploads: the clients' `ClientOutput.uploads` as the server receives them
      (after the client stage), each stacked `[C, ...]`.
    received: one `[C]` bool per upload, the clients whose message the
      server counts (module docstring).
  """

  results: LocalResult
  weights: jax.Array
  agg: Aggregated
  write: jax.Array
  stored: tuple
  extras: Any
  bits_up: jax.Array
  bits_down: jax.Array
  uploads: tuple = ()
  received: tuple = ()

  def metrics(self, update: PyTree = None) -> dict[str, jax.Array]:
    """`core.server.ROUND_METRICS` of the round; `update` replaces the aggregate in `update_norm`."""
    agg = self.agg if update is None else self.agg._replace(update=update)
    return round_metrics(self.results.loss, self.results.num_examples, self.weights, agg,
                         bits_up=self.bits_up, bits_down=self.bits_down)


def every_client(batches: ClientBatches, *inputs: PyTree) -> ClientBatches:
  """`batches` for a family whose every client takes part every round whatever its data (a mixture's clients, a
  graph's nodes): weight 1 each (such objectives weight clients uniformly; the clients report a step with
  `full_participation_output`), and `inputs` (leaves `[C, ...]`, row c for slot c: per-client keys, rows of a
  table the client only reads) riding with each client's data, `(data, *inputs)`, materialized."""
  data = (materialize(batches.data),) + inputs if inputs else batches.data
  return batches.replace(data=data, weight=jnp.ones_like(batches.weight))


def full_participation_output(model: PyTree, rows: tuple, loss: jax.Array, mask: jax.Array, *,
                              checked: PyTree = None, extras: Any = None) -> ClientOutput:
  """One client's `ClientOutput` in a round of `every_client`: it takes part (one step, whatever its data), its
  delta is `rows[0] − model`, and it counts when `rows` and `checked` are finite (the non-finite rule)."""
  result = LocalResult(delta=jax.tree.map(jnp.subtract, rows[0], model), loss=loss,
                       num_examples=jnp.sum(mask).astype(jnp.float32), num_steps=jnp.ones((), jnp.int32))
  return ClientOutput(result, rows=tuple(rows), extras=extras, checked=checked)


def init_aggregator_state(aggregator: Aggregator, params: PyTree, messages: int = 1, *, slots: bool = False) -> Any:
  """The state an algorithm keeps for `aggregator` (the one function every algorithm calls for it).

  `aggregator.init(params)`, or, with a client stage, `StagedState(rows, server)` with one stage table per kind of
  message its clients send (`messages`: 1 for the update alone, 2 for SCAFFOLD's Δy_i and Δc_i).

  The piece's declared privacy must be its state's (`core.server.check_declared_privacy`): a `dp_mean` state
  under a piece that does not declare itself private, or the converse, is refused here, before any round runs.

  With `slots=True`, `params` holds K models stacked on axis 0 (leaves `[K, ...]`: a clustered algorithm's cluster
  models, `core.clusters`) and the aggregator runs once per slot: the server state is `aggregator.init` of each
  model, stacked `[K, ...]`, and a stage's table keeps a row per client and slot (leaves `[N, K, ...]`; a client's
  message touches the entry of its slot, `ClientOutput.slot`).
  """
  server = jax.vmap(aggregator.init)(params) if slots else aggregator.init(params)
  check_declared_privacy(aggregator, server)
  if aggregator.client is None:
    return server
  if not 1 <= messages <= len(MESSAGE_STREAMS):
    raise ValueError(f"init_aggregator_state: messages must be in [1, {len(MESSAGE_STREAMS)}]; got {messages}.")
  return StagedState(rows=tuple(aggregator.client.init(params) for _ in range(messages)), server=server)


def client_round(
    mode: client_map_lib.ClientMap | str | None,
    client_update: Callable[..., ClientOutput],
    shared: PyTree,
    batches: ClientBatches,
    *,
    tables: tuple = (),
    like: PyTree = None,
    aggregator: Aggregator | None = None,
    aggregator_state: Any = None,
    key: jax.Array | None = None,
    rows_follow_round: bool = True,
    aggregate: Callable[[PyTree, jax.Array, Any, jax.Array, Any], Aggregated] | None = None,
) -> Round:
  """Runs the round's clients with their per-client rows and aggregates what they send (module docstring).

  Args:
    mode: the client map (`core.client_map.resolve`).
    client_update: `client_update(shared, data [S, B, ...], mask [S, B], *rows) -> ClientOutput`
      for one client; `rows` are its rows of `tables`, cast to the dtypes of `like`.
    shared: what every client receives (the server model, control variates ...).
    batches: the round's `ClientBatches`.
    tables: per-client tables (leaves `[N, ...]`) to gather rows from and scatter new rows to.
    like: pytree whose leaf dtypes the gathered rows take (the model); None keeps the storage dtype.
    aggregator: the aggregator of `ClientOutput.update`; None: nothing is aggregated.
    aggregator_state, key: the aggregator's state and key (with `aggregator`); with a
      client stage the state is a `StagedState` (`init_aggregator_state`).
    rows_follow_round: False when the rows are the client's own and are written
      whether or not its update was aggregated (module docstring).
    aggregate: None (the guarded `core.server.aggregate_updates(aggregator, ...)`), or
      `aggregate(updates [C, ...], weights [C], server state, key, extras) -> core.server.Aggregated`,
      an aggregation of the algorithm's own (module docstring); needs `aggregator`.

  Returns:
    A `Round`.
  """
  stage = None if aggregator is None else aggregator.client
  if aggregate is not None and aggregator is None:
    raise ValueError("client_round: aggregate= replaces the aggregation of an aggregator; give aggregator= too.")
  server_state = aggregator_state
  if stage is not None:
    _check_staged(aggregator_state, key)
    server_state = aggregator_state.server
  bits_down = _bits_down(shared, tables)
  stored_rows = tuple(per_client.gather(table, batches.client_id) for table in tables)
  rows = stored_rows if like is None else tuple(
      jax.tree.map(lambda r, p: r.astype(jnp.result_type(p)), r, like) for r in stored_rows)
  if stage is not None:
    stage_rows = tuple(None if t is None else per_client.gather(t, batches.client_id) for t in aggregator_state.rows)
    client_update = _staged(client_update, stage, key, len(stage_rows))
    rows = rows + ((batches.client_id, stage_rows),)
  fn = lambda s, client: client_update(s, *client)
  data = batches.data
  deferred = isinstance(data, DeferredData)
  # The loop decision is the one the materialized data would get (the same footprint, the same `auto` choice).
  inputs = ((jax.eval_shape(data.materialize) if deferred else data), batches.mask) + rows
  loop = None
  can_stream = aggregator is not None and aggregator.streaming is not None and aggregate is None
  if deferred or can_stream:
    loop = client_map_lib.loop_chunk(mode, fn, shared, inputs)
  streams = loop is not None and can_stream
  if loop is not None and deferred:  # gather each chunk's examples inside the loop
    fn = lambda s, client: client_update(s[0], data.take(s[1], client[0]), *client[1:])
    shared = (shared, data.source)
    inputs = (data.refs,) + inputs[1:]
  elif deferred:
    inputs = (data.materialize(),) + inputs[1:]
  if streams:
    out, weights, agg, one_update = _streamed(loop, fn, shared, inputs, batches.weight, aggregator,
                                              server_state, key)
    results = out.result
  else:
    if loop is not None and deferred:
      out, _ = client_map_lib.map_clients_and_sum(loop, lambda s, c: (fn(s, c), ()), shared, inputs)
    else:
      out = client_map_lib.map_clients(mode, fn, shared, inputs)
    results = out.result
    weights = jnp.where(results.num_steps > 0, batches.weight, jnp.zeros_like(batches.weight))
  if stage is not None:
    extras, new_stage_rows, stage_bits = out.extras
    out = out._replace(extras=extras)
  rows_finite = client_is_finite(out.rows) if tables else jnp.ones(weights.shape, bool)
  if streams:
    round_ok = agg.finite & agg.accepted
  elif aggregator is not None:
    update = results.delta if out.update is None else out.update
    one_update = jax.tree.map(lambda u: jax.ShapeDtypeStruct(u.shape[1:], u.dtype), update)
    if aggregate is None:
      agg = aggregate_updates(aggregator, update, weights, server_state, key)
    else:
      agg = aggregate(update, weights, server_state, key, out.extras)
    round_ok = agg.finite & agg.accepted
  else:
    one_update = jax.tree.map(lambda u: jax.ShapeDtypeStruct(u.shape[1:], u.dtype), results.delta)
    taking_part = weights > 0
    finite, num_nonfinite = finite_clients(out.rows if tables else results.delta, out.checked,
                                           taking_part=taking_part)
    agg = Aggregated(update=None, state=None, finite=finite, num_nonfinite=num_nonfinite,
                     accepted=jnp.any(taking_part & finite))
    round_ok = finite
  own = jnp.ones(weights.shape, bool) if out.writes is None else out.writes
  aggregated = (weights > 0) & round_ok
  if rows_follow_round:
    write = aggregated & rows_finite & own
  else:
    write = (batches.weight > 0) & rows_finite & own
  stored = tuple(per_client.scatter(table, batches.client_id, new, write, old_rows=old)
                 for table, new, old in zip(tables, out.rows, stored_rows))
  uploads = tuple(out.uploads)
  received = tuple(aggregated & rows_finite & own & client_is_finite(u) for u in uploads)
  if stage is None:
    messages = (one_update,) + tuple(jax.tree.map(lambda u: jax.ShapeDtypeStruct(u.shape[1:], u.dtype), u)
                                     for u in uploads)
    bits_up = jnp.full(weights.shape, float(sum(tree_bits(m) for m in messages)), jnp.float32)
  else:
    bits_up = stage_bits.astype(jnp.float32)
    sends = (aggregated,) + received  # the clients whose message of each kind the server counts
    new_tables = tuple(
        table if table is None else per_client.scatter(
            table, batches.client_id, new, counted & client_is_finite(new), old_rows=old).table
        for table, new, old, counted in zip(aggregator_state.rows, new_stage_rows, stage_rows, sends))
    agg = agg._replace(state=StagedState(rows=new_tables, server=agg.state))
  return Round(results=results, weights=weights, agg=agg, write=write, stored=stored, extras=out.extras,
               bits_up=bits_up, bits_down=jnp.asarray(bits_down, jnp.float32), uploads=uploads,
               received=received)


def _check_staged(aggregator_state: Any, key: jax.Array | None) -> None:
  if not isinstance(aggregator_state, StagedState):
    raise TypeError(f"client_round: an aggregator with a client stage keeps a core.types.StagedState (make it with "
                    f"core.rounds.init_aggregator_state); got {type(aggregator_state).__name__}.")
  if key is None:
    raise ValueError("client_round: an aggregator with a client stage needs the round's key (each client's stage "
                     "key is drawn from it).")


def _bits_down(shared: PyTree, tables: tuple) -> int:
  """Bits each client receives: all of `shared`, or one row of the first table when nothing is shared."""
  if jax.tree.leaves(shared) or not tables:
    return tree_bits(shared)
  return tree_bits(jax.tree.map(lambda t: jax.ShapeDtypeStruct(jnp.shape(t)[1:], jnp.result_type(t)), tables[0]))


def _staged(client_update: Callable[..., ClientOutput], stage: ClientStage, key: jax.Array,
            num_tables: int) -> Callable[..., ClientOutput]:
  """`client_update` whose last argument is `(client_id, stage rows)` and whose messages pass `stage`.

  The returned `ClientOutput` carries the sent update as `update`, the sent further messages as `uploads`,
  and `(extras, new stage rows, bits summed over the messages)` as `extras` (unpacked after the map).
  """
  streams = [jax.random.fold_in(key, stream) for stream in MESSAGE_STREAMS]

  def staged(shared, data, mask, *rest):
    *rows, (client_id, stage_rows) = rest
    out = client_update(shared, data, mask, *rows)
    messages = (out.result.delta if out.update is None else out.update,) + tuple(out.uploads)
    if len(messages) != num_tables:
      raise ValueError(f"client_round: each client sends {len(messages)} kind(s) of message but the aggregator "
                       f"state has {num_tables} table(s) for the client stage {stage.name}: make it with "
                       f"core.rounds.init_aggregator_state(aggregator, params, messages={len(messages)}).")
    sent, new_rows, bits = zip(*(_apply_in_slot(stage, jax.random.fold_in(stream, client_id), message, row, out.slot)
                                 for stream, message, row in zip(streams, messages, stage_rows)))
    total_bits = sum(bits[1:], bits[0])
    return out._replace(update=sent[0], uploads=tuple(sent[1:]), extras=(out.extras, tuple(new_rows), total_bits))

  return staged


def _apply_in_slot(stage: ClientStage, key: jax.Array, message: PyTree, row: PyTree,
                   slot: jax.Array | None) -> tuple[PyTree, PyTree, jax.Array]:
  """`stage.apply(key, message, row)`; with a `slot`, on entry `slot` of the client's `[K, ...]` row alone."""
  if slot is None or row is None:
    return stage.apply(key, message, row)
  sent, new, bits = stage.apply(key, message, jax.tree.map(lambda r: r[slot], row))
  return sent, jax.tree.map(lambda r, n: r.at[slot].set(n.astype(r.dtype)), row, new), bits


def _streamed(loop: tuple, fn: Callable[..., ClientOutput], shared: PyTree, inputs: tuple, weight: jax.Array,
              aggregator: Aggregator, aggregator_state: Any,
              key: jax.Array) -> tuple[ClientOutput, jax.Array, Aggregated, PyTree]:
  """The clients in a loop, their updates summed as they go (`aggregator.streaming`): the same rules as the
  stacked path (no step, no part; a non-finite update is dropped), applied per client inside the loop.

  Returns the clients' outputs without their updates (`result.delta` and `update` are None), the weights
  after the no-step rule, the guarded aggregation and the shapes of one client's update.
  """
  streaming = aggregator.streaming

  def one(s, client_and_weight):
    client, w = client_and_weight
    out = fn(s, client)
    w = jnp.where(out.result.num_steps > 0, w, jnp.zeros_like(w))
    update = out.result.delta if out.update is None else out.update
    clean, used, finite = zero_nonfinite(jax.tree.map(lambda u: u[None], update), w[None])
    term, count = streaming.term(jax.tree.map(lambda u: u[0], clean), used[0], aggregator_state)
    small = out._replace(result=out.result._replace(delta=None), update=None)
    return (small, w, used[0], finite[0]), (term, count)

  (out, weights, used, finite), (total, count) = client_map_lib.map_clients_and_sum(
      loop, one, shared, (inputs, weight))
  one_update = jax.eval_shape(lambda s, c: (lambda o: o.result.delta if o.update is None else o.update)(fn(s, c)),
                              shared, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), inputs))
  update, new_state = streaming.finalize(total, count, aggregator_state, key)
  update = jax.tree.map(lambda u, like: u.astype(like.dtype), update, one_update)
  return out, weights, finish_aggregation(update, new_state, aggregator_state, used, weights, finite,
                                         aggregator.always_releases), one_update
