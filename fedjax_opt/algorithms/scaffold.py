"""SCAFFOLD: control variates that correct client drift.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh. "SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning." ICML 2020. arXiv:1910.06378.

The server keeps a control variate c and one c_i per client (N clients, all
zero at the start). One round t with sampled clients S (Algorithm 1):

    client i:  y_i ← x;  K masked local steps  y_i ← y_i − η_l (g_i(y_i) − c_i + c)
               option I:   c_i⁺ = ∇f_i(x)                       (full batch over the round's data, at x)
               option II:  c_i⁺ = c_i − c + (x − y_i) / (K η_l)
               Δy_i = y_i − x,  Δc_i = c_i⁺ − c_i,  c_i ← c_i⁺
    server:    x ← x + η_g (1/|S|) Σ_{i∈S} Δy_i
               c ← c + (|S|/N) (1/|S|) Σ_{i∈S} Δc_i  =  c + (1/N) Σ_{i∈S} Δc_i

K is each client's *actual* number of non-empty local steps (a straggler or a
small client that did fewer steps divides by its own K). Clients not sampled
keep their c_i exactly, so c stays the mean of the c_i's. The c_i's live in a
per-client table (`fedjax_opt.core.per_client`): num_clients × model size
entries, optionally stored in bfloat16 (`storage_dtype`); c is updated by the
change actually stored, so c = (1/N) Σ_i c_i holds for the stored values.

The round is `core.rounds.client_round` with the c_i table: a client takes
part only if its weight is > 0, it made at least one local step and its Δy_i
is finite (a non-finite one is dropped and counted by the guard); its c_i is
written only if, in addition, c_i⁺ is finite and the round is accepted.
Otherwise c_i is left as it was (zero-weight padding clients never write).
The average of Δy_i goes through the aggregator seam (default: the uniform
mean of the paper; the non-finite guard of `core.server.aggregate_updates`
around it), and the server step is `apply_server_update` with `optax.sgd(η_g)`.

Compression (`compression=fo.compression.compressed(C, ...)`): both uploads
are messages, and both are compressed with C, each with its own key and,
with error feedback, its own residual table (e^y_i in `residuals`, e^c_i in
`control_residuals`):

    Δ̂y_i = C(Δy_i + e^y_i),  e^y_i ← Δy_i + e^y_i − Δ̂y_i      (e ≡ 0 without error feedback)
    Δ̂c_i = C(Δc_i + e^c_i),  e^c_i ← Δc_i + e^c_i − Δ̂c_i
    server:  x ← x + η_g Agg_{i∈S}(Δ̂y_i),   c ← c + (1/N) Σ_{i∈S} Δ̂c_i
    client:  c_i ← c_i⁺                                          (its exact control variate)

so with error feedback c = (1/N) Σ_i (c_i − e^c_i) at every round (what c
has not received yet is the residuals), and without it c drifts from the
mean of the c_i by the accumulated compression errors (zero-mean for an
unbiased C). Δy_i goes through the seam of `core.rounds.client_round` (inside
the client map, key fold_in(fold_in(k, "comp"), i) with k the round's
aggregator key); Δc_i is compressed after the map, per client, with key
fold_in(fold_in(k, "ctrl"), i). `bits_up` is C's count for Δy_i plus C's
count for Δc_i. Δc_i is compressed too because under option II it is
−c − Δy_i / (K η_l): sent in full it would hand the server Δy_i exactly.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt import compression as compression_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.averaging import aggregated_round, initial_fields, initial_residuals
from fedjax_opt.core.local import as_single_step, local_train
from fedjax_opt.core.rounds import ClientOutput, Round
from fedjax_opt.core.server import apply_server_update, client_is_finite
from fedjax_opt.core.tree import global_norm
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_choice, check_loss_fn, check_num_clients, check_positive

__all__ = ["ScaffoldState", "scaffold"]

CONTROL_UPDATES = ("I", "II")

CONTROL_STREAM = 0x6374726C
"""Folded into the round's aggregator key for the keys that compress Δc_i (ASCII "ctrl"); Δy_i's use "comp"."""


@flax.struct.dataclass
class ScaffoldState:
  """Server state of SCAFFOLD.

  Attributes:
    params: the global model x.
    control_variate: c, the server control variate (a pytree like params).
    client_control_variates: the c_i's, a per-client table (leaves `[N, ...]`,
      in `storage_dtype`).
    server_opt_state: state of the server step `optax.sgd(η_g)`.
    aggregator_state: the aggregator's state.
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` plus `control_variate_norm` = ‖c‖₂.
    residuals: with error-feedback compression, the residuals e^y_i of the
      Δy_i messages (a per-client table like the model, leaves `[N, ...]`); else None.
    control_residuals: with error-feedback compression, the residuals e^c_i
      of the Δc_i messages (leaves `[N, ...]`); else None.
  """

  params: PyTree
  control_variate: PyTree
  client_control_variates: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]
  residuals: PyTree = None
  control_residuals: PyTree = None


def _option_i(loss_fn: LossFn, x: PyTree, data: PyTree, mask: jax.Array) -> PyTree:
  """c_i⁺ = ∇f_i(x): one full-batch gradient over the client's real examples of the round."""
  gradient_step = local_train(loss_fn, optax.sgd(1.0), x, *as_single_step(data, mask))
  return jax.tree.map(jnp.negative, gradient_step.delta)


def _option_ii(c_i: PyTree, c: PyTree, delta: PyTree, num_steps: jax.Array, eta_l: Any) -> PyTree:
  """c_i⁺ = c_i − c + (x − y_i) / (K η_l), with K the client's non-empty local steps (≥ 1 guarded)."""
  k = jnp.maximum(num_steps, 1)
  return jax.tree.map(lambda ci, cc, d: (ci - cc - d / (k.astype(d.dtype) * eta_l)).astype(ci.dtype),
                      c_i, c, delta)


def scaffold(
    loss_fn: LossFn,
    eta_l: Any,
    eta_g: Any,
    *,
    num_clients: int,
    control_update: str = "II",
    aggregator: aggregators_lib.Aggregator | None = None,
    client_map: client_map_lib.ClientMap | str | None = None,
    storage_dtype: Any = None,
    compression: compression_lib.Compression | None = None,
) -> FederatedAlgorithm:
  """SCAFFOLD (Karimireddy et al. 2020): local SGD corrected by c − c_i, control variates updated per round.

  The step sizes are bare numbers, not optax optimizers: the paper's local
  solver is plain SGD y_i ← y_i − η_l (g_i(y_i) − c_i + c), and option II
  recovers the average corrected gradient by dividing x − y_i by K η_l,
  which holds only for that solver; the server step is x ← x + η_g Δx.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    eta_l: η_l > 0, the local SGD step size (may be traced).
    eta_g: η_g > 0, the global step size (η_g = 1: x becomes the mean of the y_i; may be traced).
    num_clients: N, the total number of clients (rows of the c_i table; every
      `batches.client_id` must be < N).
    control_update: "I" (c_i⁺ = ∇f_i(x), an extra pass over the data) or "II"
      (c_i⁺ = c_i − c + (x − y_i)/(K η_l), no extra computation; the default).
    aggregator: how the Δy_i are averaged; default `aggregators.mean()`, the
      paper's uniform (1/|S|) Σ. `aggregators.weighted_mean()` weights by n_k.
    client_map: how clients are mapped (see `fedjax_opt.core.client_map`).
    storage_dtype: dtype of the stored c_i (e.g. `jnp.bfloat16` to halve the
      table's memory); None keeps the model's dtype.
    compression: None (every client sends Δy_i and Δc_i in full, 2 · 32 P
      bits in float32), or `fo.compression.compressed(compressor,
      error_feedback=..., num_clients=N)`: each client sends

          Δ̂y_i = C(Δy_i + e^y_i)   and   Δ̂c_i = C(Δc_i + e^c_i)

      (e ≡ 0 without error feedback; with it e^y_i ← Δy_i + e^y_i − Δ̂y_i and
      e^c_i ← Δc_i + e^c_i − Δ̂c_i, in `state.residuals` and
      `state.control_residuals`), each with its own key; the server steps
      x ← x + η_g Agg(Δ̂y_i) and c ← c + (1/N) Σ_{i∈S} Δ̂c_i, the client keeps
      its exact c_i⁺, so with error feedback c = (1/N) Σ_i (c_i − e^c_i).
      Δc_i is the change of the *stored* c_i (after rounding to
      `storage_dtype`), so `compressed(identity())` is the uncompressed
      round bit for bit. `bits_up` = bits_C(Δy_i) + bits_C(Δc_i). With error
      feedback the compression's `num_clients` must be N.

  Returns:
    `FederatedAlgorithm(init, step)` with state `ScaffoldState`.
  """
  check_loss_fn(loss_fn)
  check_positive(eta_l, "eta_l")
  check_positive(eta_g, "eta_g")
  num_clients = check_num_clients(num_clients)
  check_choice(control_update, "control_update", CONTROL_UPDATES)
  compression = compression_lib.check_compression(compression)
  if compression is not None and compression.error_feedback and compression.num_clients != num_clients:
    raise ValueError(f"scaffold: the compression's error-feedback table has num_clients={compression.num_clients} "
                     f"rows but SCAFFOLD has num_clients={num_clients}: give the same N to both.")
  aggregator = aggregators_lib.resolve(aggregator, aggregators_lib.mean)
  mode = client_map_lib.resolve(client_map)
  client_optimizer = optax.sgd(eta_l)
  server_optimizer = optax.sgd(eta_g)

  def client_update(shared, data, mask, c_i):
    x, c = shared
    drift = jax.tree.map(jnp.subtract, c, c_i)  # the correction c − c_i, constant over the local steps
    result = local_train(loss_fn, client_optimizer, x, data, mask, gradient_correction=lambda _: drift)
    if control_update == "I":
      new_c_i = _option_i(loss_fn, x, data, mask)
    else:
      new_c_i = _option_ii(c_i, c, result.delta, result.num_steps, eta_l)
    if compression is None:
      return ClientOutput(result, rows=(new_c_i,))
    # Δc_i, the message: the change of the stored c_i (rounded to the table's dtype as `per_client.scatter` does).
    stored_c_i = new_c_i if storage_dtype is None else jax.tree.map(
        lambda n: n.astype(storage_dtype).astype(n.dtype), new_c_i)
    return ClientOutput(result, rows=(new_c_i,), extras=jax.tree.map(jnp.subtract, stored_c_i, c_i))

  def init(params: PyTree, key: jax.Array) -> ScaffoldState:
    return ScaffoldState(
        **initial_fields(params, key, aggregator, ("control_variate_norm",)),
        control_variate=jax.tree.map(jnp.zeros_like, params),
        client_control_variates=per_client.init(params, num_clients, storage_dtype=storage_dtype),
        server_opt_state=server_optimizer.init(params),
        residuals=initial_residuals(params, compression),
        control_residuals=initial_residuals(params, compression),
    )

  def step(state: ScaffoldState, batches: ClientBatches) -> ScaffoldState:
    # Uncompressed, Δy_i and Δc_i are two full messages; compressed, Δy_i's bits come from the seam, Δc_i's below.
    key, out = aggregated_round(mode, client_update, (state.params, state.control_variate), state, batches,
                                aggregator, tables=(state.client_control_variates,), compression=compression,
                                uploads=2 if compression is None else 1)
    params, server_opt_state = apply_server_update(
        server_optimizer, state.params, state.server_opt_state, out.agg.update, out.agg.accepted)
    stored, = out.stored
    if compression is None:
      control_change, control_residuals = stored.change, None
    else:
      control_change, control_residuals, control_bits = _send_control_deltas(compression, state, batches, out)
      out = out._replace(bits_up=out.bits_up + control_bits)
    control_variate = jax.tree.map(lambda cc, dc: cc + dc / num_clients, state.control_variate, control_change)
    return ScaffoldState(
        params=params,
        control_variate=control_variate,
        client_control_variates=stored.table,
        server_opt_state=server_opt_state,
        aggregator_state=out.agg.state,
        round=state.round + 1,
        key=key,
        metrics={**out.metrics(), "control_variate_norm": global_norm(control_variate).astype(jnp.float32)},
        residuals=None if out.residuals is None else out.residuals.table,
        control_residuals=control_residuals,
    )

  return FederatedAlgorithm(init, step)


def _send_control_deltas(compression: compression_lib.Compression, state: ScaffoldState, batches: ClientBatches,
                         out: Round) -> tuple[PyTree, PyTree, jax.Array]:
  """The compressed Δc_i messages of a round: `(Σ of those the server counts, new e^c table or None, bits [C])`.

  Client i's key is fold_in(fold_in(k, CONTROL_STREAM), i), k the round's aggregator key. The server counts
  the message of every client whose c_i was written (it took part, its Δy_i was aggregated, the round was
  accepted, c_i⁺ is finite; the last copy of a duplicated id) and whose message is finite; the residual row of
  exactly those clients is written.
  """
  stored, = out.stored
  _, aggregator_key = jax.random.split(state.key)  # the key `aggregated_round` gave the round's aggregator
  base = jax.random.fold_in(aggregator_key, CONTROL_STREAM)
  keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(batches.client_id)
  old_rows = rows = None
  if compression.error_feedback:
    old_rows = per_client.gather(state.control_residuals, batches.client_id)
    rows = jax.tree.map(lambda r, p: r.astype(jnp.result_type(p)), old_rows, state.params)
  sent, new_rows, bits = jax.vmap(lambda k, u, e: compression_lib.send(compression, k, u, e))(keys, out.extras, rows)
  counted = stored.written & client_is_finite(sent)

  def total(s):
    keep = counted.reshape((-1,) + (1,) * (s.ndim - 1))
    return jnp.sum(jnp.where(keep, s, jnp.zeros_like(s)), axis=0)

  table = None
  if compression.error_feedback:
    table = per_client.scatter(state.control_residuals, batches.client_id, new_rows,
                               counted & client_is_finite(new_rows), old_rows=old_rows).table
  return jax.tree.map(total, sent), table, bits.astype(jnp.float32)
