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
* Without an aggregator (EASGD, FedU: the server does not average updates)
  a client is finite when its new rows are, and the round is accepted when
  at least one client wrote.
* Compression (`compression=`, a `fedjax_opt.compression.Compression`): the
  client-side stage of DESIGN.md's seam, before the aggregator (and so before
  DP clipping and secure summation). Each client's update u_k (what the
  aggregator would receive) is replaced inside the client map, so in the
  stacked and the streamed path alike, by

      sent_k = C(u_k + e_k),   e_k ← u_k + e_k − sent_k      (error feedback; e_k a row of `residuals`)
      sent_k = C(u_k)                                         (without)

  with the key fold_in(fold_in(key, COMPRESSION_STREAM), client_id_k): the
  aggregator's key is left as it is, so an uncompressed round draws exactly
  what it drew before. The residual row follows the round: it is written
  when the client took part, its update was aggregated, the round was
  accepted and the new residual is finite (`Round.residuals`).
* Bits. `Round.bits_up` `[C]` is what each client sent: the compressor's
  count, or, uncompressed, every bit of its update (32 P for a float32 model
  of P entries), times `uploads` for algorithms whose clients send more than
  one update-sized message (SCAFFOLD's Δc_i; with compression the extra
  messages are counted uncompressed). `Round.bits_down` is what each client
  received: every bit of `shared` (the broadcast; SCAFFOLD's (x, c) is two
  models), or, when nothing is shared (FedU), one row of the first table.
  `Round.metrics` reports their means as `bits_up` / `bits_down`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.server import (Aggregated, aggregate_updates, client_is_finite, finish_aggregation, round_metrics,
                                    zero_nonfinite)
from fedjax_opt.core.tree import tree_bits
from fedjax_opt.core.types import Aggregator, ClientBatches, DeferredData, PyTree

__all__ = ["ClientOutput", "Round", "client_round"]

COMPRESSION_STREAM = 0x636F6D70
"""Folded into the round's aggregator key to make the compression key (ASCII "comp"): a separate stream."""


class ClientOutput(NamedTuple):
  """What `client_update` returns for one client.

  Attributes:
    result: the client's `LocalResult` (its `num_steps` decides whether it
      took part; its loss and example count feed the metrics).
    update: what the aggregator receives; None: `result.delta`.
    rows: the client's new rows, one per table given to `client_round`, in order.
    extras: anything else the algorithm wants back, stacked `[C, ...]`.
    writes: optional scalar bool, the client's own condition for writing its rows.
  """

  result: LocalResult
  update: PyTree = None
  rows: tuple = ()
  extras: Any = None
  writes: jax.Array | None = None


class Round(NamedTuple):
  """What `client_round` hands back (leaves stacked `[C, ...]` where per client).

  Attributes:
    results: the clients' `LocalResult`s.
    weights: `[C]` aggregation weights: `batches.weight`, 0 for clients that took no step.
    agg: the guarded aggregation (`core.server.Aggregated`); without an
      aggregator its `update` and `state` are None.
    write: `[C]` bool, the clients allowed to write their rows.
    stored: one `per_client.Scattered` per table (new table, rows written, change of the row sum).
    extras: the clients' `ClientOutput.extras`.
    bits_up: `[C]` float32, the bits each client sent (module docstring).
    bits_down: scalar float32, the bits each client received.
    residuals: with error-feedback compression, the `per_client.Scattered` of the residual table; else None.
  """

  results: LocalResult
  weights: jax.Array
  agg: Aggregated
  write: jax.Array
  stored: tuple
  extras: Any
  bits_up: jax.Array
  bits_down: jax.Array
  residuals: per_client.Scattered | None = None

  def metrics(self, update: PyTree = None) -> dict[str, jax.Array]:
    """`core.server.ROUND_METRICS` of the round; `update` replaces the aggregate in `update_norm`."""
    agg = self.agg if update is None else self.agg._replace(update=update)
    return round_metrics(self.results.loss, self.results.num_examples, self.weights, agg,
                         bits_up=self.bits_up, bits_down=self.bits_down)


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
    compression: Any = None,
    residuals: PyTree = None,
    uploads: int = 1,
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
    aggregator_state, key: the aggregator's state and key (with `aggregator`).
    rows_follow_round: False when the rows are the client's own and are written
      whether or not its update was aggregated (module docstring).
    compression: None, or a `fedjax_opt.compression.Compression` applied to each
      client's update before the aggregator (module docstring; needs `aggregator`).
    residuals: the error-feedback residual table (leaves `[N, ...]`, like the
      update) when `compression.error_feedback`; else None.
    uploads: the update-sized messages each client sends (bits; module docstring).

  Returns:
    A `Round`.
  """
  _check_compression_args(compression, residuals, aggregator, key)
  bits_down = _bits_down(shared, tables)
  stored_rows = tuple(per_client.gather(table, batches.client_id) for table in tables)
  rows = stored_rows if like is None else tuple(
      jax.tree.map(lambda r, p: r.astype(jnp.result_type(p)), r, like) for r in stored_rows)
  stored_residuals = None
  if compression is not None:
    if compression.error_feedback:
      stored_residuals = per_client.gather(residuals, batches.client_id)
      residual_rows = stored_residuals if like is None else jax.tree.map(
          lambda r, p: r.astype(jnp.result_type(p)), stored_residuals, like)
    else:
      residual_rows = None
    client_update = _compressing(client_update, compression, jax.random.fold_in(key, COMPRESSION_STREAM))
    rows = rows + ((batches.client_id, residual_rows),)
  fn = lambda s, client: client_update(s, *client)
  data = batches.data
  deferred = isinstance(data, DeferredData)
  # The loop decision is the one the materialized data would get (the same footprint, the same `auto` choice).
  inputs = ((jax.eval_shape(data.materialize) if deferred else data), batches.mask) + rows
  loop = None
  if deferred or (aggregator is not None and aggregator.streaming is not None):
    loop = client_map_lib.loop_chunk(mode, fn, shared, inputs)
  streams = loop is not None and aggregator is not None and aggregator.streaming is not None
  if loop is not None and deferred:  # gather each chunk's examples inside the loop
    fn = lambda s, client: client_update(s[0], data.take(s[1], client[0]), *client[1:])
    shared = (shared, data.source)
    inputs = (data.refs,) + inputs[1:]
  elif deferred:
    inputs = (data.materialize(),) + inputs[1:]
  if streams:
    out, weights, agg, one_update = _streamed(loop, fn, shared, inputs, batches.weight, aggregator,
                                              aggregator_state, key)
    results = out.result
  else:
    if loop is not None and deferred:
      out, _ = client_map_lib.map_clients_and_sum(loop, lambda s, c: (fn(s, c), ()), shared, inputs)
    else:
      out = client_map_lib.map_clients(mode, fn, shared, inputs)
    results = out.result
    weights = jnp.where(results.num_steps > 0, batches.weight, jnp.zeros_like(batches.weight))
  if compression is not None:
    extras, new_residuals, compressed_bits = out.extras
    out = out._replace(extras=extras)
  rows_finite = client_is_finite(out.rows) if tables else jnp.ones(weights.shape, bool)
  if streams:
    round_ok = agg.finite & agg.accepted
  elif aggregator is not None:
    update = results.delta if out.update is None else out.update
    one_update = jax.tree.map(lambda u: jax.ShapeDtypeStruct(u.shape[1:], u.dtype), update)
    agg = aggregate_updates(aggregator, update, weights, aggregator_state, key)
    round_ok = agg.finite & agg.accepted
  else:
    one_update = jax.tree.map(lambda u: jax.ShapeDtypeStruct(u.shape[1:], u.dtype), results.delta)
    taking_part = weights > 0
    finite = rows_finite if tables else client_is_finite(results.delta)
    agg = Aggregated(update=None, state=None, finite=finite,
                     num_nonfinite=jnp.sum(taking_part & ~finite, dtype=jnp.int32),
                     accepted=jnp.any(taking_part & finite))
    round_ok = finite
  own = jnp.ones(weights.shape, bool) if out.writes is None else out.writes
  if rows_follow_round:
    write = (weights > 0) & round_ok & rows_finite & own
  else:
    write = (batches.weight > 0) & rows_finite & own
  stored = tuple(per_client.scatter(table, batches.client_id, new, write, old_rows=old)
                 for table, new, old in zip(tables, out.rows, stored_rows))
  update_bits = float(tree_bits(one_update))
  if compression is None:
    bits_up = jnp.full(weights.shape, uploads * update_bits, jnp.float32)
  else:
    bits_up = compressed_bits.astype(jnp.float32) + jnp.float32((uploads - 1) * update_bits)
  stored_residual = None
  if stored_residuals is not None:
    write_residual = (weights > 0) & round_ok & client_is_finite(new_residuals)
    stored_residual = per_client.scatter(residuals, batches.client_id, new_residuals, write_residual,
                                         old_rows=stored_residuals)
  return Round(results=results, weights=weights, agg=agg, write=write, stored=stored, extras=out.extras,
               bits_up=bits_up, bits_down=jnp.asarray(bits_down, jnp.float32), residuals=stored_residual)


def _check_compression_args(compression: Any, residuals: PyTree, aggregator: Aggregator | None,
                            key: jax.Array | None) -> None:
  if compression is None:
    if residuals is not None:
      raise ValueError("client_round: residuals were given without compression.")
    return
  from fedjax_opt.compression import check_compression  # pylint: disable=import-outside-toplevel
  check_compression(compression)
  if aggregator is None or key is None:
    raise ValueError("client_round: compression needs an aggregator and the round's key (it compresses what the "
                     "aggregator receives).")
  if compression.error_feedback and residuals is None:
    raise ValueError("client_round: compression with error feedback needs the residual table (residuals=).")


def _bits_down(shared: PyTree, tables: tuple) -> int:
  """Bits each client receives: all of `shared`, or one row of the first table when nothing is shared."""
  if jax.tree.leaves(shared) or not tables:
    return tree_bits(shared)
  return tree_bits(jax.tree.map(lambda t: jax.ShapeDtypeStruct(jnp.shape(t)[1:], jnp.result_type(t)), tables[0]))


def _compressing(client_update: Callable[..., ClientOutput], compression: Any,
                 key: jax.Array) -> Callable[..., ClientOutput]:
  """`client_update` whose last argument is `(client_id, residual row or None)` and whose update is compressed.

  The returned `ClientOutput` carries the message as `update` and
  `(extras, new residual row, bits)` as `extras` (unpacked after the map).
  """
  from fedjax_opt.compression import send  # pylint: disable=import-outside-toplevel

  def compressing(shared, data, mask, *rest):
    *rows, (client_id, residual) = rest
    out = client_update(shared, data, mask, *rows)
    update = out.result.delta if out.update is None else out.update
    sent, new_residual, bits = send(compression, jax.random.fold_in(key, client_id), update, residual)
    return out._replace(update=sent, extras=(out.extras, new_residual, bits))

  return compressing


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
