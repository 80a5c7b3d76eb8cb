"""Asynchronous aggregation: FedBuff, FedAsync, Co-op and Zeno++, simulated exactly (no threads).

Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba. "Federated Learning with
Buffered Asynchronous Aggregation." AISTATS 2022. arXiv:2106.06639. (FedBuff.)

Xie, Koyejo, Gupta. "Asynchronous Federated Optimization." OPT workshop,
NeurIPS 2020. arXiv:1903.03934. (FedAsync and its staleness functions.)

Wang. "CO-OP: Cooperative Machine Learning from Mobile Devices." MSc thesis,
University of Alberta, 2017. doi:10.7939/R32805C45. (Co-op; see `co_op` for
what is reconstructed.)

Xie, Koyejo, Gupta. "Zeno++: Robust Fully Asynchronous SGD." ICML 2020.
arXiv:1903.07020. (Zeno++.)

The simulation is `fedjax_opt.core.asynchrony`; read its module docstring
first. In short:

* one `step` is one server event: the schedule names the event's A arrivals
  (in time order, each with the version p it pulled); each arriving client's
  data is its row of the step's `ClientBatches` (found by `client_id` under
  the default `wall_clock` schedule, so sample every client every step,
  `client_sampling="all"`; every row with weight > 0, in order, under
  `drawn_staleness`); the arriving clients train from x_p, read from the ring
  buffer of the last H = `history_size` server models, through the client
  map; the server applies their updates one by one in arrival order with the
  algorithm's rule below; the arrived clients are replaced and the clock moves;
* staleness t − τ is the number of server updates between a client's pull
  (τ = p) and the moment the server uses its update (t = the version then);
* an update whose x_p has left the ring buffer (staler than H − 1 when its
  event starts) is discarded and counted (`num_too_stale`);
* clients that take no step or send a non-finite update follow the
  library's rules (docs/architecture.md, "The round"), applied per arrival.

State: `AsyncState` (one dataclass for the four; the fields an algorithm does
not use are None). Metrics: `core.asynchrony.event_metric_names()`
(`simulated_time`, `staleness_mean`, `staleness_max`, `num_rejected`, ...,
plus `core.server.ROUND_METRICS`), so curves can be drawn against
simulated time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from fedjax_opt.core import asynchrony
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.differentiation import refuse_derivative
from fedjax_opt.core.local import as_single_step, local_train, masked_mean_loss
from fedjax_opt.core.server import apply_server_update
from fedjax_opt.core.tree import global_norm, select_tree
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_client_batches, check_in_range, check_int, check_key, check_loss_fn,
                                        check_num_clients, check_optimizer, check_positive, check_scalar)

__all__ = ["AsyncState", "BufferState", "ValidationState", "co_op", "fedasync", "fedbuff", "zeno_plus_plus"]

DEFAULT_HISTORY_SIZE = 16


class BufferState(NamedTuple):
  """FedBuff's buffer of client updates.

  Attributes:
    total: Σ s(t − τ_k) Δ_k over the buffered updates, a pytree like the model.
    count: scalar int32, the number of updates buffered (< K between events).
  """

  total: PyTree
  count: jax.Array


class ValidationState(NamedTuple):
  """Zeno++'s server-side validation batch and its gradient.

  Attributes:
    data: pytree of `[B_v, ...]` arrays (the factory's `validation_data`), the server's small batch.
    mask: `[B_v]` bool, True on real examples.
    gradient: v = ∇f_r(x) at the model of the last event's start, a pytree like the model.
  """

  data: PyTree
  mask: jax.Array
  gradient: PyTree


@flax.struct.dataclass
class AsyncState:
  """Server state of the asynchronous algorithms.

  Attributes:
    params: the server model x_t.
    version: t, the number of server updates applied (int32).
    history: `core.asynchrony.ModelHistory`, the last H server models (`[H, ...]`) and their versions.
    clock: `core.asynchrony.Clock`: simulated time, and each in-flight client's finish time and pulled version.
    server_opt_state: FedBuff's server optimizer state (None otherwise).
    buffer: FedBuff's `BufferState` (None otherwise).
    validation: Zeno++'s `ValidationState` (None otherwise).
    round: the number of `step`s (server events), int32.
    key: PRNG key, split once per event (arrival times, dispatch).
    metrics: `core.asynchrony.event_metric_names()` of the last event.
  """

  params: PyTree
  version: jax.Array
  history: asynchrony.ModelHistory
  clock: asynchrony.Clock
  server_opt_state: Any
  buffer: Any
  validation: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _common_checks(loss_fn: Any, num_clients: Any, schedule: Any, history_size: Any) -> tuple[
    int, asynchrony.Schedule, int]:
  check_loss_fn(loss_fn)
  num_clients = check_num_clients(num_clients)
  schedule = asynchrony.wall_clock() if schedule is None else asynchrony.check_schedule(schedule)
  history_size = check_int(history_size, "history_size", 1)
  return num_clients, schedule, history_size


def _algorithm(schedule: asynchrony.Schedule, num_clients: int, history_size: int, mode: Any, client_update: Any,
               rule: asynchrony.Rule, server_fields: Any, prepare: Any = None) -> FederatedAlgorithm:
  """init/step around `core.asynchrony.run_event`; `server_fields(params)` gives the algorithm's own fields,
  `prepare(state) -> state` runs at the start of every event (Zeno++'s validation gradient)."""

  def init(params: PyTree, key: jax.Array) -> AsyncState:
    check_key(key)
    clock_key = jax.random.fold_in(key, 0)
    fields = dict(server_opt_state=None, buffer=None, validation=None)
    fields.update(server_fields(params))
    return AsyncState(params=params, version=jnp.zeros((), jnp.int32),
                      history=asynchrony.history_init(params, history_size),
                      clock=schedule.init(num_clients, clock_key), round=jnp.zeros((), jnp.int32), key=key,
                      metrics=asynchrony.initial_event_metrics(), **fields)

  def step(state: AsyncState, batches: ClientBatches) -> AsyncState:
    check_client_batches(batches)
    if prepare is not None:
      state = prepare(state)
    key, event_key = jax.random.split(state.key)
    server = (state.server_opt_state, state.buffer, state.validation)
    event = asynchrony.run_event(schedule, mode, client_update, rule, params=state.params, version=state.version,
                                 history=state.history, server=server, clock=state.clock, batches=batches,
                                 key=event_key)
    server_opt_state, buffer, validation = event.server
    return state.replace(params=event.params, version=event.version, history=event.history, clock=event.clock,
                         server_opt_state=server_opt_state, buffer=buffer, validation=validation,
                         round=state.round + 1, key=key, metrics=event.metrics)

  return FederatedAlgorithm(init, step)


def _check_mixing_weight(alpha: Any) -> None:
  """α ∈ (0, 1], the weight of an arriving model in a convex merge (FedAsync, Co-op); may be traced."""
  check_scalar(alpha, "alpha")
  check_positive(alpha, "alpha")
  check_in_range(alpha, "alpha", 0.0, 1.0, closed_high=True)


def _mix(params: PyTree, model: PyTree, weight: jax.Array) -> PyTree:
  """(1 − w) x + w x_new, in the model's dtypes."""
  return jax.tree.map(lambda x, m: ((1 - weight) * x + weight * m).astype(jnp.result_type(x)), params, model)


def fedbuff(
    loss_fn: LossFn,
    *,
    buffer_size: int,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    staleness_weight: str = "constant",
    a: Any = 0.5,
    b: Any = 4,
    schedule: asynchrony.Schedule | None = None,
    history_size: int = DEFAULT_HISTORY_SIZE,
) -> FederatedAlgorithm:
  """FedBuff (Nguyen et al. 2022): buffer K client deltas, then one server optax step on their mean.

      client k (pulled x_τ):   Δ_k = ClientOpt^S(x_τ) − x_τ               (S masked local steps)
      server, on arrival:      Δ̄ ← Δ̄ + s(t − τ_k) Δ_k;  n ← n + 1
                               if n = K:  x ← x + ServerOpt(−Δ̄ / K);  t ← t + 1;  Δ̄ ← 0;  n ← 0

  t − τ_k is the number of server updates since client k's pull, taken when
  its delta enters the buffer. With `staleness_weight="constant"` (default)
  every delta counts 1; the paper's experiments weight by 1/√(1 + t − τ)
  (`"polynomial"`, a = 0.5). With zero staleness and K equal to the clients
  of an event, one event is one round of FedAvg with the uniform mean
  (`aggregators.mean()`).

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    buffer_size: K ≥ 1, deltas per server update (a Python int).
    num_clients: N, the clients of the simulation (rows of the schedule's per-client tables).
    client_optimizer: ClientOpt, re-initialized at every pull.
    server_optimizer: ServerOpt fed −Δ̄/K (default `optax.sgd(1.0)`: x ← x + Δ̄/K).
    staleness_weight, a, b: s(t − τ), see `core.asynchrony.staleness_weight`.
    schedule: the arrivals (default `core.asynchrony.wall_clock()`).
    history_size: H, server models kept; staler updates are discarded.

  Returns:
    `FederatedAlgorithm(init, step)` with state `AsyncState` (`server_opt_state`, `buffer`).
  """
  num_clients, schedule, history_size = _common_checks(loss_fn, num_clients, schedule, history_size)
  buffer_size = check_int(buffer_size, "buffer_size", 1)
  check_optimizer(client_optimizer, "client_optimizer")
  server_optimizer = optax.sgd(1.0) if server_optimizer is None else check_optimizer(server_optimizer,
                                                                                      "server_optimizer")
  asynchrony.check_staleness_weight(staleness_weight, a, b)
  mode = client_map_lib.FromPolicy()

  def client_update(start, data, mask):
    return local_train(loss_fn, client_optimizer, start, data, mask)

  def rule(params, server, version, arrival):
    del version
    opt_state, buffer, validation = server
    s = asynchrony.staleness_weight(staleness_weight, arrival.staleness, a, b)
    total = jax.tree.map(lambda t, d: t + (s * d).astype(t.dtype), buffer.total, arrival.delta)
    count = buffer.count + 1
    full = count >= buffer_size
    mean = jax.tree.map(lambda t: t / buffer_size, total)
    new_params, new_opt_state = apply_server_update(server_optimizer, params, opt_state, mean, full)
    total = jax.tree.map(lambda t: jnp.where(full, jnp.zeros_like(t), t), total)
    buffer = BufferState(total, jnp.where(full, 0, count).astype(jnp.int32))
    return asynchrony.Decision(new_params, (new_opt_state, buffer, validation), jnp.ones((), bool), full)

  def server_fields(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return dict(server_opt_state=server_optimizer.init(params), buffer=BufferState(zeros, jnp.zeros((), jnp.int32)))

  return _algorithm(schedule, num_clients, history_size, mode, client_update, rule, server_fields)


fedbuff = execution.accepts_policy_keywords(fedbuff, refuses_aggregator=(
    "FedBuff adds each arriving delta, weighted by its staleness, to a running buffer sum as it arrives, "
    "across events; the K buffered deltas are never held together for a rule to combine"),
    evaluation="global", exchanges=(1, 1), hyperparameters={"buffer_size": execution.COUNT,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "server_optimizer": execution.SERVER_OPTIMIZER,
        "a": execution.STALENESS, "b": execution.STALENESS, "history_size": execution.COUNT})


def fedasync(
    loss_fn: LossFn,
    alpha: Any,
    rho: Any = 0.0,
    *,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    staleness_weight: str = "constant",
    a: Any = 0.5,
    b: Any = 4,
    schedule: asynchrony.Schedule | None = None,
    history_size: int = DEFAULT_HISTORY_SIZE,
) -> FederatedAlgorithm:
  """FedAsync (Xie, Koyejo, Gupta 2019): mix each arriving model into the server model by a staleness weight.

      client k (pulled x_τ):  x_new = S masked local steps of ClientOpt on f_k(x) + (ρ/2)‖x − x_τ‖² from x_τ
      server, on arrival:     α_t = α · s(t − τ)
                              x_t = (1 − α_t) x_{t−1} + α_t x_new;   t ← t + 1

      s constant:    1
      s polynomial:  (t − τ + 1)^(−a)
      s hinge:       1 if t − τ ≤ b, else 1 / (a (t − τ − b) + 1)

  Every arrival is a server update (the version counts them); t − τ is the
  number of server updates since the client's pull. α = 1 with zero
  staleness takes the client's model.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    alpha: α ∈ (0, 1], the mixing hyper-parameter (may be traced).
    rho: ρ ≥ 0, the weight of the proximal term of the clients' objective (0: plain local training).
    num_clients: N, the clients of the simulation.
    client_optimizer: ClientOpt, re-initialized at every pull.
    staleness_weight: "constant" (default), "polynomial" or "hinge".
    a, b: the staleness function's parameters (a > 0; b ≥ 0 for hinge).
    schedule: the arrivals (default `core.asynchrony.wall_clock()`).
    history_size: H, server models kept; staler updates are discarded.

  Returns:
    `FederatedAlgorithm(init, step)` with state `AsyncState`.
  """
  num_clients, schedule, history_size = _common_checks(loss_fn, num_clients, schedule, history_size)
  _check_mixing_weight(alpha)
  check_scalar(rho, "rho")
  check_positive(rho, "rho", allow_zero=True)
  check_optimizer(client_optimizer, "client_optimizer")
  asynchrony.check_staleness_weight(staleness_weight, a, b)
  mode = client_map_lib.FromPolicy()

  def client_update(start, data, mask):
    prox = lambda x: jax.tree.map(lambda xi, si: (rho * (xi - si)).astype(xi.dtype), x, start)
    return local_train(loss_fn, client_optimizer, start, data, mask, gradient_correction=prox)

  def rule(params, server, version, arrival):
    del version
    weight = alpha * asynchrony.staleness_weight(staleness_weight, arrival.staleness, a, b)
    return asynchrony.Decision(_mix(params, arrival.model, weight), server, jnp.ones((), bool), jnp.ones((), bool))

  return _algorithm(schedule, num_clients, history_size, mode, client_update, rule, lambda params: {})


fedasync = execution.accepts_policy_keywords(fedasync, refuses_aggregator=(
    "FedAsync combines no clients: the server mixes each arriving model into its own, one arrival at a time, "
    "by a staleness weight"),
    evaluation="global", exchanges=(1, 1), hyperparameters={"alpha": execution.MIXING_WEIGHT,
        "rho": execution.REGULARIZER, "client_optimizer": execution.CLIENT_OPTIMIZER, "a": execution.STALENESS,
        "b": execution.STALENESS, "history_size": execution.COUNT})


def co_op(
    loss_fn: LossFn,
    alpha: Any,
    *,
    max_age: int,
    num_clients: int,
    client_optimizer: optax.GradientTransformation,
    schedule: asynchrony.Schedule | None = None,
    history_size: int = DEFAULT_HISTORY_SIZE,
) -> FederatedAlgorithm:
  """Co-op (Wang 2017), as reconstructed here: merge each arriving model by its age; discard the too old.

      client k (pulled x_τ, the global model of age τ):  x_new = S masked local steps of ClientOpt from x_τ
      server, on arrival, with the age difference d = t − τ:
          d > b  (b = max_age):  discard the model (counted in num_rejected)
          d ≤ b:                 β_d = α / (d + 1);   x_t = (1 − β_d) x_{t−1} + β_d x_new;   t ← t + 1

  What is the source's and what is ours. The thesis' text, and with it its
  merge formula and its age thresholds, could not be read: searches of
  public web pages, documentation and code found only its library record
  (ERA, University of Alberta, doi:10.7939/R32805C45), no later paper by
  the author and no implementation. The record's abstract says that Co-op
  is an asynchronous protocol in which each mobile client trains a local
  model on a small amount of newly generated data and the server merges
  these local models into a global model "judiciously, balancing the model
  accuracy and communication overhead"; it names no rule. That the merge
  depends on the age difference between the client's model and the global
  model, and that models too far behind are not merged, is the protocol as
  later descriptions summarise it, not checked against the thesis. So:

  * from those descriptions: the age d = t − τ, counted in server versions
    (merges) since the client pulled; a bound b above which an update is
    discarded; a merge that is a convex combination of the global and the
    client's model;
  * ours: the weight β_d = α/(d + 1) (an update d versions old counts as one
    of d + 1 models) and the names α and b. The thesis' own weights and
    intervals of d may differ; we do not implement any other interval (e.g.
    holding back a client whose model is too recent) or any rule for devices
    that go offline.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    alpha: α ∈ (0, 1], the merge weight of a fresh model (may be traced).
    max_age: b ≥ 0, the largest age difference merged (a Python int; should be < `history_size`,
      older updates are discarded by the ring buffer anyway and counted in `num_too_stale`).
    num_clients: N, the clients of the simulation.
    client_optimizer: ClientOpt, re-initialized at every pull.
    schedule: the arrivals (default `core.asynchrony.wall_clock()`).
    history_size: H, server models kept.

  Returns:
    `FederatedAlgorithm(init, step)` with state `AsyncState`.
  """
  num_clients, schedule, history_size = _common_checks(loss_fn, num_clients, schedule, history_size)
  _check_mixing_weight(alpha)
  max_age = check_int(max_age, "max_age", 0)
  check_optimizer(client_optimizer, "client_optimizer")
  mode = client_map_lib.FromPolicy()

  def client_update(start, data, mask):
    return local_train(loss_fn, client_optimizer, start, data, mask)

  def rule(params, server, version, arrival):
    del version
    young = arrival.staleness <= max_age
    weight = alpha / (arrival.staleness.astype(jnp.result_type(float)) + 1)
    merged = select_tree(young, _mix(params, arrival.model, weight), params)
    return asynchrony.Decision(merged, server, young, young)

  return _algorithm(schedule, num_clients, history_size, mode, client_update, rule, lambda params: {})


co_op = execution.accepts_policy_keywords(co_op, refuses_aggregator=(
    "Co-op combines no clients: the server merges each arriving model into its own, one arrival at a time, by "
    "its age"),
    evaluation="global", exchanges=(1, 1), hyperparameters={"alpha": execution.MIXING_WEIGHT,
        "max_age": execution.THRESHOLD, "client_optimizer": execution.CLIENT_OPTIMIZER,
        "history_size": execution.COUNT})


def _rescale_to(tree: PyTree, length: jax.Array) -> PyTree:
  """(length / ‖tree‖) · tree, and 0 for a zero tree; ‖tree‖ is taken on tree / max|tree| (no overflow)."""
  leaves = jax.tree.leaves(tree)
  largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0) for x in leaves]))
  safe = jnp.where(largest > 0, largest, jnp.ones_like(largest))
  unit = jax.tree.map(lambda x: x / safe, tree)  # entries in [−1, 1], the largest ±1 (all 0 for a zero tree)
  norm = global_norm(unit)
  factor = jnp.where(norm > 0, length / jnp.where(norm > 0, norm, jnp.ones_like(norm)), jnp.zeros_like(norm))
  return jax.tree.map(lambda x: (factor * x).astype(x.dtype), unit)


def zeno_plus_plus(
    loss_fn: LossFn,
    gamma: Any,
    rho: Any,
    eps: Any,
    *,
    validation_data: PyTree,
    num_clients: int,
    validation_mask: jax.Array | None = None,
    rescale: bool = True,
    schedule: asynchrony.Schedule | None = None,
    history_size: int = DEFAULT_HISTORY_SIZE,
) -> FederatedAlgorithm:
  """Zeno++ (Xie, Koyejo, Gupta 2020): asynchronous SGD that applies a stale gradient only if it passes a test.

      client k (pulled x_τ):  g = ∇f_k(x_τ), the gradient of its mean loss over all its examples of the step
      server, each event:     v = ∇f_r(x_t), the gradient of the mean loss on the validation batch
      server, on arrival:     g̃ = (‖v‖ / ‖g‖) g               (g̃ = 0 when g = 0)
                              accept g̃ iff  γ⟨v, g̃⟩ − ρ‖g̃‖² ≥ −γε
                              accepted:  x_{t+1} = x_t − γ g̃;  t ← t + 1
                              rejected:  nothing changes (counted in num_rejected)

  This is the server loop of the paper's Algorithm 1: the candidate is
  first rescaled to the length of the validation gradient, and the test
  and the step both use the rescaled g̃. Since ‖g̃‖ = ‖v‖, the test reads
  ‖v‖²(γ cos∠(v, g) − ρ) ≥ −γε: it judges the direction of g only, and
  every accepted step has length γ‖v‖, however long the candidate was (an
  honest gradient 50 times too long takes the same step as one of the
  right length; without the rescaling it would take a 50 times longer step,
  or fail the ρ term). The score γ⟨v, g̃⟩ − ρ‖g̃‖² is the first-order
  estimate of the descent f_r(x) − f_r(x − γg̃) minus ρ‖g̃‖²; a sign-flipped
  gradient has ⟨v, g̃⟩ < 0 and fails at any scale. The authors' public code
  (AsyncByzGrad) rescales the same way but takes the ρ term from the
  candidate before rescaling, ρ‖g‖²; here both terms use g̃, as the
  algorithm is written. `rescale=False` skips the rescaling (g̃ = g: the
  test and the step on the raw candidate, this library's earlier rule; a
  long honest gradient then takes a long step or fails the ρ term).
  ‖g‖ is computed on g divided by its largest entry, so a huge finite
  candidate does not overflow to a zero g̃; a non-finite candidate is
  dropped before the test by the library's guard (docs/architecture.md).

  v is computed once per event, at the model of the event's start (with one
  arrival per event, the default, that is at every server step; with A
  arrivals it is the paper's lazy v, reused for the event's A tests).

  The validation data reaches `step` through the state: `init` stores
  `validation_data` (and its mask) in `state.validation`, so it is an
  argument of the compiled step (not a constant) and can be replaced with
  `state.replace(validation=state.validation._replace(data=..., mask=...))`.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    gamma: γ > 0, the server's step size (may be traced).
    rho: ρ ≥ 0, the weight of ‖g̃‖² in the score.
    eps: ε ≥ 0, the tolerance of the test.
    validation_data: the server's small batch, a pytree of `[B_v, ...]` arrays as `loss_fn` takes them.
    num_clients: N, the clients of the simulation.
    validation_mask: `[B_v]` bool, True on real examples (default: all True).
    rescale: True (default, the paper's algorithm): test and apply g̃ = (‖v‖/‖g‖) g; False: test and apply g
      as it arrives.
    schedule: the arrivals (default `core.asynchrony.wall_clock()`).
    history_size: H, server models kept; staler gradients are discarded.

  Returns:
    `FederatedAlgorithm(init, step)` with state `AsyncState` (`validation`).
  """
  num_clients, schedule, history_size = _common_checks(loss_fn, num_clients, schedule, history_size)
  for value, name in ((gamma, "gamma"), (rho, "rho"), (eps, "eps")):
    check_scalar(value, name)
  check_positive(gamma, "gamma")
  check_positive(rho, "rho", allow_zero=True)
  check_positive(eps, "eps", allow_zero=True)
  if not isinstance(rescale, bool):
    raise TypeError(f"rescale must be a Python bool (True: the paper's rescaled candidate); got {rescale!r}.")
  validation_data = jax.tree.map(jnp.asarray, validation_data)
  leaves = jax.tree.leaves(validation_data)
  if not leaves or any(jnp.ndim(leaf) < 1 for leaf in leaves):
    raise ValueError("validation_data must be a pytree of [B_v, ...] arrays (the server's validation batch).")
  size = jnp.shape(leaves[0])[0]
  if any(jnp.shape(leaf)[0] != size for leaf in leaves):
    raise ValueError(f"every leaf of validation_data must have the same leading [B_v] axis; got "
                     f"{[tuple(jnp.shape(leaf)) for leaf in leaves]}.")
  mask = jnp.ones((size,), bool) if validation_mask is None else jnp.asarray(validation_mask)
  if mask.shape != (size,) or mask.dtype != jnp.bool_:
    raise ValueError(f"validation_mask must be a [B_v] = ({size},) bool array; got shape {mask.shape} "
                     f"dtype {mask.dtype}.")
  mode = client_map_lib.FromPolicy()
  one_gradient = optax.sgd(1.0)
  grad_fn = jax.grad(lambda p, d, m: masked_mean_loss(loss_fn, p, d, m)[0])

  def client_update(start, data, mask):  # Δ = −g: one full-batch gradient step of size 1
    return local_train(loss_fn, one_gradient, start, *as_single_step(data, mask))

  def rule(params, server, version, arrival):
    del version
    v = server[2].gradient
    g = jax.tree.map(jnp.negative, arrival.delta)
    if rescale:
      g = _rescale_to(g, global_norm(v))
    inner = sum(jnp.vdot(vi, gi) for vi, gi in zip(jax.tree.leaves(v), jax.tree.leaves(g)))
    square = sum(jnp.vdot(gi, gi) for gi in jax.tree.leaves(g))
    score = refuse_derivative(gamma * inner - rho * square + gamma * eps,
                              "Zeno++'s acceptance test (score >= 0: a run is piecewise constant in it)")
    accepted = score >= 0
    stepped = jax.tree.map(lambda x, gi: (x - gamma * gi).astype(jnp.result_type(x)), params, g)
    return asynchrony.Decision(select_tree(accepted, stepped, params), server, accepted, accepted)

  def server_fields(params):
    return dict(validation=ValidationState(validation_data, mask, jax.tree.map(jnp.zeros_like, params)))

  def prepare(state):
    val = state.validation
    v = grad_fn(state.params, val.data, val.mask)
    return state.replace(validation=val._replace(gradient=v))

  return _algorithm(schedule, num_clients, history_size, mode, client_update, rule, server_fields, prepare)


zeno_plus_plus = execution.accepts_policy_keywords(zeno_plus_plus, refuses_aggregator=(
    "Zeno++ combines no clients: the server tests each arriving gradient alone against its validation "
    "gradient and applies it alone (that test is its robustness)"),
    evaluation="global", exchanges=(1, 1), hyperparameters={"gamma": execution.SERVER_STEP_SIZE,
        "rho": execution.REGULARIZER, "eps": execution.THRESHOLD, "history_size": execution.COUNT})
