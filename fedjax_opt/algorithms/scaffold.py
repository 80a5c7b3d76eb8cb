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

The round is `core.rounds.client_round` with the c_i table, under the
library's rules for taking part and writing rows (docs/architecture.md, "The
round"): Δy_i is the update and c_i⁺ the row, so a client that does not write
keeps its c_i. The average of Δy_i goes through the aggregator seam (default:
the uniform mean of the paper), and the server step is `apply_server_update`
with `optax.sgd(η_g)`.

Both uploads are messages and both pass the aggregator's client stage
(`core.rounds.client_round`): Δy_i as the update, Δc_i as a second upload
(`ClientOutput.uploads`), each with its own key stream and, with a stage that
keeps rows, its own table in `aggregator_state`. With a compressing stage C
(`aggregator=fo.aggregators.chain(fo.compression.compress(C, ...), ...)`):

    Δ̂y_i = C(Δy_i + e^y_i),  e^y_i ← Δy_i + e^y_i − Δ̂y_i      (e ≡ 0 without error feedback)
    Δ̂c_i = C(Δc_i + e^c_i),  e^c_i ← Δc_i + e^c_i − Δ̂c_i
    server:  x ← x + η_g Agg_{i∈S}(Δ̂y_i),   c ← c + (1/N) Σ_{i∈S} Δ̂c_i
    client:  c_i ← c_i⁺                                          (its exact control variate)

so with error feedback c = (1/N) Σ_i (c_i − e^c_i) at every round (what c
has not received yet is the residuals), and without it c drifts from the
mean of the c_i by the accumulated compression errors (zero-mean for an
unbiased C). Without a stage Δ̂ = Δ and c stays the mean of the stored c_i.
The server counts the Δ̂c_i of the clients whose c_i was written (the last
copy of a duplicated id) and whose message is finite. Δc_i is the change of
the *stored* c_i (after rounding to `storage_dtype`), so
`compress(identity())` is the uncompressed round bit for bit. `bits_up` is
the bits of Δy_i plus those of Δc_i. Δc_i is compressed too because under
option II it is −c − Δy_i / (K η_l): sent in full it would hand the server
Δy_i exactly.

What the aggregator cannot cover, it refuses (`scaffold` raises one line
saying why). The server adds the Δc_i to c as the plain sum
(1/N) Σ_{i∈S} Δ̂c_i, whatever the aggregator does to the Δy_i, so a piece
that protects the Δy_i would leave the Δc_i unprotected:

* `fo.privacy.dp_mean` (directly, chained behind a stage, or inside another
  piece): the Δc_i would reach c unclipped and un-noised, and under option II
  Δc_i = −c − Δy_i / (K η_l) is the client's update itself, so the run would
  not be differentially private. Clipping and noising Δc_i as a second
  release would change c from the mean of the c_i into a noisy estimate and
  cost a second Gaussian mechanism per round; use FedAvg or FedProx with
  `dp_mean` instead.
* `fo.privacy.secure_aggregation`: the server would see every Δc_i in the
  clear, hence every Δy_i.
* A robust rule (`fo.aggregators.krum`, the medians, ...): one attacker moves
  c freely through its Δc_i, and c corrects every client's local steps.
* `fo.attacks.corrupt`: it replaces the Δy_i the server receives but not the
  Δc_i, so the simulated attackers would send honest control variates; attack
  the clients' data with `fo.attacks.poison` instead.

The pieces are recognised by the traits they declare (`Aggregator.traits`,
read by `core.server.protecting_piece`: a wrapper's traits combine its own with the
inner piece's, a chain's are its aggregator's), never by where their code
lives. An aggregator without traits (one built by hand, or a library piece
wrapped in a lambda or a `functools.partial`) is unknown and refused too,
in one line saying how to declare them: it could clip, noise or filter the
Δy_i and nothing would say so. FedDyn refuses the same pieces for its h.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt import aggregators as aggregators_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import per_client
from fedjax_opt.core.averaging import aggregated_round, initial_fields
from fedjax_opt.core.local import as_single_step, local_train
from fedjax_opt.core.rounds import ClientOutput
from fedjax_opt.core.server import (apply_server_update, finite_clients, protecting_piece, refuse_unknown_traits,
                                    zero_rows)
from fedjax_opt.core.tree import global_norm
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import check_choice, check_loss_fn, check_num_clients, check_positive

_DEFAULT_AGGREGATOR = aggregators_lib.mean
"""The rule `scaffold` averages with when given no `aggregator=`: declared once, passed to
`execution.accepts_policy_keywords` (`.default_aggregator`) and to `aggregators.resolve` in the body."""

__all__ = ["ScaffoldState", "scaffold"]

CONTROL_UPDATES = ("I", "II")


@flax.struct.dataclass
class ScaffoldState:
  """Server state of SCAFFOLD.

  Attributes:
    params: the global model x.
    control_variate: c, the server control variate (a pytree like params).
    client_control_variates: the c_i's, a per-client table (leaves `[N, ...]`,
      in `storage_dtype`).
    server_opt_state: state of the server step `optax.sgd(η_g)`.
    aggregator_state: the aggregator's state (with a client stage, its tables for
      the Δy_i and the Δc_i messages: `fo.compression.residuals(state.aggregator_state, 0 or 1)`).
    round: t, rounds applied, int32.
    key: PRNG key, split once per round (aggregator randomness).
    metrics: `core.server.ROUND_METRICS` plus `control_variate_norm` = ‖c‖₂.
  """

  params: PyTree
  control_variate: PyTree
  client_control_variates: PyTree
  server_opt_state: Any
  aggregator_state: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _option_i(loss_fn: LossFn, x: PyTree, data: PyTree, mask: jax.Array) -> PyTree:
  """c_i⁺ = ∇f_i(x): one full-batch gradient over the client's real examples of the round."""
  gradient_step = local_train(loss_fn, optax.sgd(1.0), x, *as_single_step(data, mask))
  return jax.tree.map(jnp.negative, gradient_step.delta)


def _option_ii(c_i: PyTree, c: PyTree, delta: PyTree, num_steps: jax.Array, eta_l: Any) -> PyTree:
  """c_i⁺ = c_i − c + (x − y_i) / (K η_l), with K the client's non-empty local steps (≥ 1 guarded)."""
  k = jnp.maximum(num_steps, 1)
  return jax.tree.map(lambda ci, cc, d: (ci - cc - d / (k.astype(d.dtype) * eta_l)).astype(ci.dtype),
                      c_i, c, delta)


def _refuse_uncovered_control_variates(aggregator: aggregators_lib.Aggregator) -> None:
  """Raises ValueError when `aggregator` protects the Δy_i and would leave the plain sum of the Δc_i unprotected, or
  when it does not declare what it does (`traits` None)."""
  refuse_unknown_traits(aggregator, "scaffold", "the control variate c")
  name = aggregator.traits.name
  why = {
      "dp_mean": (
          f"{name} clips and noises the Δy_i, but c adds each Δc_i unclipped and un-noised (under option II "
          f"Δc_i = −c − Δy_i/(K η_l) reveals Δy_i), so the run would not be differentially private; use "
          f"fo.algorithms.fedavg or fedprox with {name}."),
      "secure_aggregation": (
          f"{name} hides each Δy_i, but c adds the Δc_i sent in the clear (under option II "
          f"Δc_i = −c − Δy_i/(K η_l) reveals Δy_i); use fo.algorithms.fedavg or fedprox with {name}."),
      "robust": (
          f"{name} is a robust rule for the Δy_i, but c is the plain sum (1/N) Σ Δc_i, which one attacker moves "
          f"freely (and c corrects every client's local steps); use fo.algorithms.fedavg with {name}, or SCAFFOLD "
          f"with fo.aggregators.mean()."),
      "attack": (
          f"{name} replaces the Δy_i the server receives but not the Δc_i, so its attackers would send honest "
          f"control variates; attack the clients' data with fo.attacks.poison, or use fo.algorithms.fedavg with "
          f"{name}."),
  }.get(protecting_piece(aggregator))
  if why is not None:
    raise ValueError(f"scaffold: {why}")


def scaffold(
    loss_fn: LossFn,
    eta_l: Any,
    eta_g: Any,
    *,
    num_clients: int,
    control_update: str = "II",
    aggregator: aggregators_lib.Aggregator | None = None,
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
      A client stage chained in front of it (compression) acts on both uploads
      (module docstring); one that keeps rows needs N of them. `dp_mean`,
      `secure_aggregation`, robust rules and `corrupt` are refused: c is the
      plain sum of the Δc_i, which they would leave unprotected (module
      docstring); so is an aggregator without declared traits (`Aggregator.traits`).

  Returns:
    `FederatedAlgorithm(init, step)` with state `ScaffoldState`.

  Raises:
    ValueError: a bad argument, or an aggregator that leaves the Δc_i unprotected (module docstring).
  """
  check_loss_fn(loss_fn)
  check_positive(eta_l, "eta_l")
  check_positive(eta_g, "eta_g")
  num_clients = check_num_clients(num_clients)
  check_choice(control_update, "control_update", CONTROL_UPDATES)
  aggregator = aggregators_lib.resolve(aggregator, _DEFAULT_AGGREGATOR)
  _refuse_uncovered_control_variates(aggregator)
  stage = aggregator.client
  if stage is not None and stage.num_clients not in (None, num_clients):
    raise ValueError(f"scaffold: the client stage {stage.name} has a table of num_clients={stage.num_clients} "
                     f"rows but SCAFFOLD has num_clients={num_clients}: give the same N to both.")
  mode = client_map_lib.FromPolicy()
  client_optimizer = optax.sgd(eta_l)
  server_optimizer = optax.sgd(eta_g)

  def client_update(table_dtypes, shared, data, mask, c_i):
    x, c = shared
    drift = jax.tree.map(jnp.subtract, c, c_i)  # the correction c − c_i, constant over the local steps
    result = local_train(loss_fn, client_optimizer, x, data, mask, gradient_correction=lambda _: drift)
    if control_update == "I":
      new_c_i = _option_i(loss_fn, x, data, mask)
    else:
      new_c_i = _option_ii(c_i, c, result.delta, result.num_steps, eta_l)
    # Δc_i, the second message: the change of the stored c_i (rounded to the table's dtype as `per_client.scatter`
    # does), so the sum of the messages is the change of the table.
    stored_c_i = jax.tree.map(lambda n, d: n.astype(d).astype(n.dtype), new_c_i, table_dtypes)
    return ClientOutput(result, rows=(new_c_i,), uploads=(jax.tree.map(jnp.subtract, stored_c_i, c_i),))

  def init(params: PyTree, key: jax.Array) -> ScaffoldState:
    return ScaffoldState(
        **initial_fields(params, key, aggregator, ("control_variate_norm",), messages=2),
        control_variate=jax.tree.map(jnp.zeros_like, params),
        client_control_variates=per_client.init(params, num_clients),
        server_opt_state=server_optimizer.init(params),
    )

  def step(state: ScaffoldState, batches: ClientBatches) -> ScaffoldState:
    table_dtypes = jax.tree.map(lambda t: t.dtype, state.client_control_variates)
    key, out = aggregated_round(mode, functools.partial(client_update, table_dtypes),
                                (state.params, state.control_variate), state, batches,
                                aggregator, tables=(state.client_control_variates,))
    params, server_opt_state = apply_server_update(
        server_optimizer, state.params, state.server_opt_state, out.agg.update, out.agg.accepted)
    stored, = out.stored
    sent, = out.uploads
    counted, _ = finite_clients(sent, ok=stored.written)
    control_change = jax.tree.map(lambda d: jnp.sum(d, axis=0), zero_rows(counted, sent))
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
    )

  return FederatedAlgorithm(init, step)


scaffold = execution.accepts_policy_keywords(scaffold, storage_dtype=True, default_aggregator=_DEFAULT_AGGREGATOR,
    refuses_downlink=(
        "SCAFFOLD broadcasts the control variate c with the model, and each client's correction c − c_i is built on "
        "the exact (x, c) it receives; the downlink compresses one broadcast model"),
    evaluation="global", exchanges=(2, 2), hyperparameters={"eta_l": execution.CLIENT_STEP_SIZE,
        "eta_g": execution.SERVER_STEP_SIZE})

