"""Group ADMM: decentralized learning on a chain or a bipartite graph, with censoring and quantization.

Elgabli, Park, Bedi, Bennis, Aggarwal. "GADMM: Fast and Communication
Efficient Framework for Distributed Machine Learning." JMLR 21(76), 2020.
arXiv:1909.00047.

Issaid, Elgabli, Park, Bennis, Debbah. "Communication Efficient Distributed
Learning with Censored, Quantized, and Generalized Group ADMM."
arXiv:2009.06459, 2020.

Problem. N workers, worker n holding f_n (the mean loss over its real
examples), sit on the nodes of a connected bipartite graph G (GADMM: the
chain 0 − 1 − … − N−1, `fedjax_opt.graphs.chain`). With one model θ_n per
worker and one constraint per edge e = (i, j), i < j (`graph.edges`):

    minimize Σ_n f_n(θ_n)   subject to   θ_i = θ_j  for every edge (i, j)

(`objective="clients"`, the default: every worker one vote), or, with
`objective="examples"`, the pooled empirical risk Σ_n n_n f_n(θ_n) / n
(n_n the worker's real examples of the iteration, from `batches.mask`;
n = Σ_n n_n). Both are Σ_n c_n f_n(θ_n) with c_n = 1, or c_n = N n_n / n
(a positive multiple, N, of the pooled risk: the minimiser is the same, and
Σ_n c_n = N as for "clients", so ρ keeps its scale). Only f_n is scaled, so
the derivation below holds with f_n replaced by c_n f_n, and

    argmin_θ c_n f_n(θ) + (ρ d_n/2)‖θ − v_n‖² = prox_{f_n/(ρ d_n/c_n)}(v_n)

is the worker update with the penalty ρ d_n / c_n (θ_n = v_n when c_n = 0:
a worker with no example this iteration has no term in the objective). A
fixed point then has Σ_n c_n ∇f_n(θ) = 0, i.e. Σ_n n_n ∇f_n(θ) = 0 for
"examples": the pooled optimum. `batches.weight` is not used.

There is no server: each worker talks only to its neighbours. The graph's
two colour classes (`fedjax_opt.graphs.two_coloring`; node 0 is a head) are
the head group H and the tail group T; on a chain the heads are the even
positions and the tails the odd ones, as in the GADMM paper.

Derivation of the worker update. With one unscaled dual λ_e per edge the
augmented Lagrangian is

    L_ρ(θ, λ) = Σ_n f_n(θ_n) + Σ_{e=(i,j)} [⟨λ_e, θ_i − θ_j⟩ + (ρ/2)‖θ_i − θ_j‖²].

Write B `[E, N]` for the signed incidence matrix, B_{e,i} = +1 and
B_{e,j} = −1 for e = (i, j), i < j, so that the linear terms are
Σ_e ⟨λ_e, θ_i − θ_j⟩ = Σ_n ⟨(Bᵀλ)_n, θ_n⟩, where
(Bᵀλ)_n = Σ_{e=(n,j)} λ_e − Σ_{e=(i,n)} λ_e (plus for the edges where n is
the smaller end, minus where it is the larger end). The terms of L_ρ that
hold θ_n are

    f_n(θ) + ⟨(Bᵀλ)_n, θ⟩ + (ρ/2) Σ_{m ∈ N(n)} ‖θ − θ_m‖².

With d_n = |N(n)| (the degree) and s_n = Σ_{m ∈ N(n)} θ_m,
(ρ/2) Σ_m ‖θ − θ_m‖² = (ρ d_n/2)‖θ − s_n/d_n‖² + const, and completing the
square with the linear term,

    θ_n ← argmin_θ f_n(θ) + (ρ d_n/2) ‖θ − v_n‖²  = prox_{f_n / (ρ d_n)}(v_n),
    v_n = (s_n − (Bᵀλ)_n / ρ) / d_n.

On a chain (edges (n−1, n) and (n, n+1)) this is the paper's update
θ_n ← argmin f_n(θ) + ⟨λ_{n−1}, θ_{n−1} − θ⟩ + ⟨λ_n, θ − θ_{n+1}⟩
+ (ρ/2)‖θ_{n−1} − θ‖² + (ρ/2)‖θ − θ_{n+1}‖², v_n = (θ_{n−1} + θ_{n+1}
+ (λ_{n−1} − λ_n)/ρ) / 2 (one neighbour and one λ at the two ends).

One `step` is one iteration k (heads, then tails, then duals):

    heads n ∈ H (in parallel):  θ_n^{k+1} = prox_{f_n/(ρ d_n)}(v_n), v_n from the tails' θ_m^k and λ^k
    tails n ∈ T (in parallel):  θ_n^{k+1} = prox_{f_n/(ρ d_n)}(v_n), v_n from the heads' θ_m^{k+1} and λ^k
    every edge e = (i, j):      λ_e^{k+1} = λ_e^k + ρ (θ_i^{k+1} − θ_j^{k+1})

Every node of a group only needs the other group's models, so a group runs
in parallel (one `core.rounds.client_round` over its workers, below). The worker update
is exact when `prox(v, rho, data, mask)` is given (e.g.
`fedjax_opt.core.prox.prox_least_squares` or `prox_quadratic`, called with the
penalty ρ d_n); otherwise it is inexact (`core.prox.prox_update`): K optax
steps (`core.local.local_train`) from the worker's previous θ_n, each on its
full local data, with the gradient correction ρ d_n (θ − v_n). The inexact
iteration has the same fixed points as the exact one (the fixed point of the
inner steps is the prox), hence the same limit: at a fixed point all θ_n
agree (the dual update stops) and Σ_n ∇f_n(θ) = −Σ_n (Bᵀλ)_n = 0 (every
column of Bᵀ sums to zero), the centralized optimum.

CQ-GGADMM (`cq_ggadmm`, Issaid et al. 2020). Each worker also keeps θ̂_n,
the last model it transmitted; its neighbours only know θ̂_n, so the
updates above use s_n = Σ_{m ∈ N(n)} θ̂_m and the duals use transmitted
values, λ_e ← λ_e + ρ(θ̂_i − θ̂_j) (both ends know both θ̂, so they agree on
λ_e without sending it). After its update worker n

* compresses the change: Q_n = θ̂_n + C(θ_n − θ̂_n), C the `compressor=`, a
  `fo.compression.Compressor` that must be unbiased (E[C(x)] = x); `bits=b`
  is the paper's quantizer, `fo.compression.range_quantize(b)` (b bits per
  coordinate over [−R, R], R = ‖θ_n − θ̂_n‖_∞); with `bits=None` (and no
  compressor) Q_n = θ_n (no compression);
* transmits only if ‖Q_n − θ̂_n‖ ≥ τ₀ ξ^k (censoring, ξ ∈ (0, 1), k the
  iteration from 0); if it transmits, θ̂_n ← Q_n, else θ̂_n stays.

With `bits=None` and `tau0=0` every worker transmits θ_n exactly:
generalized GADMM (GGADMM), and on a chain exactly `gadmm`.

A biased compressor (`top_k`, `sign`: `Compressor.unbiased` False) is
refused. Issaid et al.'s analysis takes the quantization error of Q_n as
zero-mean noise of bounded variance (what `range_quantize`, `qsgd` and
`rand_k` give); a biased C makes the neighbours' θ̂_n a systematically
distorted copy of θ_n, which that analysis does not cover, and with the
plain sign (no scale) θ̂_n moves by ±1 per coordinate at every transmission
and cannot settle.

Communication accounting (`state.metrics`): an uncompressed transmission is
32 P bits (P model parameters sent as float32); a compressed one the
compressor's own count, `compressor.bits(params)` (b P + 32 for
`range_quantize(b)`: b bits per coordinate and R as one float32). Duals are
never sent. A transmission is one broadcast to the worker's neighbours,
counted once in `bits` (the iteration's total). Per worker, averaged over the N workers:
`bits_up` = `bits` / N = (1/N) Σ_n t_n q, what a worker sends, and
`bits_down` = (1/N) Σ_n t_n d_n q, what a worker receives (each of its
neighbours' transmissions), with t_n = 1 if worker n transmitted, d_n its
degree and q the bits of one message. On a chain with every worker
transmitting, bits_up = q and bits_down = 2(N − 1) q / N.

Data. GADMM is decentralized and every worker computes every iteration, so
`step` takes a `ClientBatches` with every worker's data: C = N rows, row n
for worker n (`client_id` = arange(N), checked when concrete by
`core.validation.check_full_participation`). `weight` is not used (the
objective's weighting is `objective=`, with n_n counted from the mask).

State. The per-worker models θ_n (and θ̂_n) are `[N, ...]` tables
(`core.per_client`), the duals an `[E, ...]` table; `state.params` is the
workers' average (1/N) Σ_n θ_n, for evaluation only.

Each group's update is `core.rounds.client_round` over the group's workers
without an aggregator, every worker taking part (`weight` is ignored; each
worker counts one step, with or without examples): its rows are θ_n and, for
`cq_ggadmm`, θ̂_n after the censoring test (Q_n if it transmits, else θ̂_n),
and, by that round's rule, a worker is finite when both are (a transmitted
Q_n that overflows drops the worker as a non-finite θ_n does).

A worker whose update is not finite (a NaN in its data, say) follows the
library's rule (docs/architecture.md, "The round") and changes nothing: it
keeps θ_n, transmits nothing (θ̂_n stays), and the duals λ_e of its edges
stay as they are. Its
neighbours have nothing newer than its last finite transmitted model —
θ_n itself for `gadmm`, θ̂_n for `cq_ggadmm`, exactly what they hold when it
is censored — and use it in their v_m (the other group, later in the same
iteration, included). The duals are frozen rather than updated with that
stale model: for a worker that stays broken, λ_e ← λ_e + ρ(θ̂_i − θ̂_j) would
keep integrating the residual of its edges until it vanishes, i.e. until its
neighbours' models, and so (the graph being connected) every model, equal its
frozen one; frozen, its edges act on each neighbour as the fixed term
⟨±λ_e, θ⟩ + (ρ/2)‖θ − θ̂_j‖², and the rest of the network runs GADMM on that
problem. Nothing non-finite ever leaves the worker, and
once its updates are finite again the iteration simply goes on.
`metrics["objective"]` sums over the workers whose update was finite.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt import compression as compression_lib
from fedjax_opt import graphs as graphs_lib
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import prox as prox_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.differentiation import refuse_derivative
from fedjax_opt.core.local import LocalResult, masked_mean_loss
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.server import keep_rows
from fedjax_opt.core.tree import global_norm
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree, materialize
from fedjax_opt.core.validation import (check_full_participation, check_in_range, check_int, check_key, check_loss_fn,
                                        check_positive, check_probability)

__all__ = ["GADMMState", "gadmm", "cq_ggadmm", "stochastic_quantize", "GADMM_METRICS"]

FLOAT_BITS = 32
"""Bits of one float on the wire (an uncompressed coordinate)."""

GADMM_METRICS = {
    "objective": jnp.float32,
    "primal_residual": jnp.float32,
    "transmissions": jnp.int32,
    "transmissions_cumulative": jnp.int32,
    "bits": jnp.float32,
    "bits_cumulative": jnp.float32,
    "censor_threshold": jnp.float32,
    "num_nonfinite": jnp.int32,
    "bits_up": jnp.float32,
    "bits_down": jnp.float32,
}
"""`state.metrics` of `gadmm` and `cq_ggadmm` after an iteration.

* objective: Σ_n f_n(θ_n^{k+1}) ("clients") or Σ_n n_n f_n(θ_n^{k+1}) / n ("examples"),
  at the workers' new models, over the workers whose update was finite;
* primal_residual: sqrt(Σ_{e=(i,j)} ‖θ̂_i − θ̂_j‖²) over the edges, with the
  transmitted models (the models themselves for `gadmm`);
* transmissions, bits: messages and bits sent in this iteration (duals are
  never sent); *_cumulative: since `init`;
* censor_threshold: τ₀ ξ^k used in this iteration (0 for `gadmm`);
* num_nonfinite: workers whose update was not finite (kept their model, sent nothing,
  their edges' duals not updated);
* bits_up, bits_down: per worker, the mean over the N workers of the bits it sent
  (`bits` / N) and received (its neighbours' transmissions; module docstring).
"""


@flax.struct.dataclass
class GADMMState:
  """State of GADMM / CQ-GGADMM.

  Attributes:
    params: (1/N) Σ_n θ_n, the workers' average (for evaluation; no worker uses it).
    local_params: the workers' models θ_n, a table (leaves `[N, ...]`).
    transmitted: θ̂_n, the last model each worker transmitted (leaves `[N, ...]`);
      None for `gadmm`, whose workers always transmit θ_n exactly.
    duals: the unscaled edge duals λ_e, leaves `[E, ...]`, row e for `graph.edges[e]`.
    round: k, iterations applied, int32.
    key: PRNG key, split once per iteration by `cq_ggadmm` (the compressor's noise).
    metrics: `GADMM_METRICS`.
  """

  params: PyTree
  local_params: PyTree
  transmitted: PyTree
  duals: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


# ----------------------------------------------------------------------------- checks


def _check_graph(graph: Any) -> np.ndarray:
  """The two colours of a connected bipartite graph with at least 2 nodes, or a clear error."""
  if not isinstance(graph, graphs_lib.Graph):
    raise TypeError(f"graph must be a fedjax_opt.graphs.Graph (e.g. fo.graphs.chain(n)); got {type(graph).__name__}.")
  if graph.num_nodes < 2:
    raise ValueError(f"graph must have at least 2 workers (nodes); got num_nodes={graph.num_nodes}.")
  graphs_lib.check_connected(graph)
  return graphs_lib.two_coloring(graph)


def _check_bits(bits: Any) -> None:
  """b, bits per quantized coordinate: a Python int in [1, 32]."""
  name = "bits (b, bits per quantized coordinate)"
  check_in_range(check_int(bits, name), name, 1, 32, closed_high=True)


def _check_censoring(tau0: Any, xi: Any) -> None:
  for value, name in ((tau0, "tau0 (τ₀, the censoring threshold)"), (xi, "xi (ξ, the censoring decay)")):
    if value is None:
      raise ValueError(f"{name} must be given (a number, or a traced scalar).")
  check_positive(tau0, "tau0 (τ₀, the censoring threshold)", allow_zero=True)
  check_probability(xi, "xi (ξ, the censoring decay)")


# ----------------------------------------------------------------------------- quantizer


def stochastic_quantize(key: jax.Array, x: PyTree, bits: int) -> PyTree:
  """Q_b(x), CQ-GGADMM's unbiased b-bit quantizer: `fo.compression.range_quantize(bits)`'s decoded output.

  A thin alias kept for existing callers; the quantizer (its levels over
  [−R, R], R = ‖x‖_∞, unbiasedness, b P + 32 bits) is documented and
  implemented in `fedjax_opt.compression.range_quantize`.

  Args:
    key: PRNG key.
    x: pytree of arrays (one vector).
    bits: b, a Python int in [1, 32].

  Returns:
    Q(x), a pytree like `x`.
  """
  _check_bits(bits)
  return compression_lib.range_quantize(bits).compress(key, x)[0]


def _check_compressor(bits: Any, compressor: Any) -> compression_lib.Compressor | None:
  """The compressor of `cq_ggadmm`'s messages (None: exact), from `bits=` or `compressor=`, or a one-line error."""
  if compressor is None:
    if bits is _BITS_NOT_GIVEN:
      raise TypeError("cq_ggadmm: give bits=b (the paper's b-bit quantizer), bits=None (exact transmission) or "
                      "compressor= (a fo.compression.Compressor).")
    if bits is None:
      return None
    _check_bits(bits)
    return compression_lib.range_quantize(bits)
  if bits is not _BITS_NOT_GIVEN:
    raise ValueError(f"cq_ggadmm: give bits= (shorthand for compressor=fo.compression.range_quantize(bits)) or "
                     f"compressor=, not both; got bits={bits!r} and compressor={_compressor_name(compressor)}.")
  if not isinstance(compressor, compression_lib.Compressor):
    raise TypeError(f"cq_ggadmm: compressor must be a fo.compression.Compressor (e.g. "
                    f"fo.compression.range_quantize(4)); got {type(compressor).__name__}.")
  if not compressor.unbiased:
    raise ValueError(f"cq_ggadmm: compressor {compressor.name} is biased; CQ-GGADMM's analysis (Issaid et al. "
                     "2020) needs an unbiased quantizer, E[C(x)] = x (e.g. fo.compression.range_quantize(b), qsgd, "
                     "rand_k).")
  return compressor


def _compressor_name(compressor: Any) -> str:
  return compressor.name if isinstance(compressor, compression_lib.Compressor) else type(compressor).__name__


class _NotGiven:
  """`cq_ggadmm`'s `bits` default: required unless `compressor=` is given."""

  def __repr__(self) -> str:
    return "<required unless compressor= is given>"


_BITS_NOT_GIVEN = _NotGiven()


# ----------------------------------------------------------------------------- the iteration


def _rows(table: PyTree, index: np.ndarray) -> PyTree:
  return jax.tree.map(lambda t: jnp.take(t, index, axis=0), table)


def _edge_difference(table: PyTree, edges: np.ndarray) -> PyTree:
  """θ_i − θ_j for every edge (i, j): leaves `[E, ...]` (B θ)."""
  return jax.tree.map(lambda t: jnp.take(t, edges[:, 0], axis=0) - jnp.take(t, edges[:, 1], axis=0), table)


def _incidence_transpose(duals: PyTree, edges: np.ndarray, num_nodes: int) -> PyTree:
  """(Bᵀλ)_n = Σ_{e=(n,j)} λ_e − Σ_{e=(i,n)} λ_e: leaves `[N, ...]`."""
  ends = np.concatenate([edges[:, 0], edges[:, 1]])
  return jax.tree.map(
      lambda l: jax.ops.segment_sum(jnp.concatenate([l, -l]), ends, num_segments=num_nodes), duals)


def _neighbour_sum(table: PyTree, edges: np.ndarray, num_nodes: int) -> PyTree:
  """s_n = Σ_{m ∈ N(n)} θ_m: leaves `[N, ...]`."""
  source = np.concatenate([edges[:, 1], edges[:, 0]])
  target = np.concatenate([edges[:, 0], edges[:, 1]])
  return jax.tree.map(
      lambda t: jax.ops.segment_sum(jnp.take(t, source, axis=0), target, num_segments=num_nodes), table)


def _group_admm(name: str, loss_fn: LossFn, rho: Any, graph: graphs_lib.Graph, prox: prox_lib.ProxFn | None,
                client_optimizer: optax.GradientTransformation | None, local_steps: int | None, objective: str,
                *, compression: tuple[compression_lib.Compressor | None, Any, Any] | None = None
                ) -> FederatedAlgorithm:
  """GADMM on a connected bipartite graph; with `compression` = (C, τ₀, ξ), CQ-GGADMM (module docstring; C None:
  exact transmission)."""
  check_loss_fn(loss_fn)
  prox_lib.check_rho(rho)
  colour = _check_graph(graph)
  prox_lib.check_solver(name, prox, client_optimizer, local_steps)
  by_examples = prox_lib.check_objective(objective) == "examples"
  mode = client_map_lib.FromPolicy()
  compress = compression is not None
  compressor, tau0, xi = compression or (None, None, None)

  n = graph.num_nodes
  edges = graph.edges
  groups = (np.flatnonzero(colour == 0), np.flatnonzero(colour == 1))  # heads, tails
  degree = graphs_lib.degrees(graph)

  def worker_update(shared, data, mask, theta_old, *sent):
    rho_k, threshold = shared
    examples, v, d, c, *key = data
    # argmin c f_n + (ρ d/2)‖θ − v‖² = prox with penalty ρ d / c; θ = v when c = 0 (no term in the objective).
    has_term = c > 0
    penalty = rho_k * d / jnp.where(has_term, c, 1)
    new = prox_lib.prox_update(loss_fn, prox, client_optimizer, local_steps, v, penalty, theta_old, examples, mask)
    new = jax.tree.map(lambda a, b: jnp.where(has_term, a, b.astype(a.dtype)), new, v)
    objective, count = masked_mean_loss(loss_fn, new, *prox_lib.client_examples(examples, mask))
    # Every worker takes part in every iteration, with or without examples (module docstring).
    result = LocalResult(delta=jax.tree.map(jnp.subtract, new, theta_old), loss=objective, num_examples=count,
                         num_steps=jnp.ones((), jnp.int32))
    if not compress:
      return ClientOutput(result, rows=(new,))
    (sent_old,) = sent
    change = jax.tree.map(jnp.subtract, new, sent_old)
    if compressor is None:
      candidate = new  # Q_n = θ_n, bit for bit
    else:
      change = compressor.compress(key[0], change)[0]
      candidate = jax.tree.map(jnp.add, sent_old, change)
    change, threshold = refuse_derivative((change, threshold), "CQ-GGADMM's censoring test and stochastic "
                                          "compressor (a run is piecewise constant in them)")
    transmit = global_norm(change) >= threshold  # else θ̂_n stays
    return ClientOutput(result, rows=(new, jax.tree.map(lambda q, o: jnp.where(transmit, q, o.astype(q.dtype)),
                                                        candidate, sent_old)), extras=transmit)

  def group_update(group, key, theta, sent, dual_term, rho_k, threshold, batches, scale, weight):
    """One group's parallel update, a `client_round` over its workers; returns the new tables and (objective,
    transmitted `[G]`, finite `[G]`, dropped)."""
    dtype = jnp.result_type(*jax.tree.leaves(theta))
    d = jnp.asarray(degree[group], dtype)
    neighbours = _rows(_neighbour_sum(sent, edges, n), group)
    v = jax.tree.map(lambda s, b: (s - b / rho_k) / d.reshape((-1,) + (1,) * (s.ndim - 1)),
                     neighbours, _rows(dual_term, group))
    inputs = (_rows(materialize(batches.data), group), v, d, jnp.take(scale, group))
    if compressor is not None:  # worker i of the group compresses with split(key, G)[i]
      inputs += (jax.random.split(key, len(group)),)
    workers = ClientBatches(data=inputs, mask=jnp.take(batches.mask, group, axis=0),
                            weight=jnp.ones((len(group),), dtype), client_id=jnp.asarray(group, jnp.int32))
    out = client_round(mode, worker_update, (rho_k, threshold), workers, tables=(theta, sent) if compress else (theta,))
    finite, theta = out.agg.finite, out.stored[0].table
    objective = jnp.sum(jnp.where(finite, jnp.take(weight, group) * out.results.loss, 0))
    if not compress:
      return theta, theta, (objective, finite, finite, out.agg.num_nonfinite)
    return theta, out.stored[1].table, (objective, finite & out.extras, finite, out.agg.num_nonfinite)

  def init(params: PyTree, key: jax.Array) -> GADMMState:
    check_key(key)
    workers = per_client.broadcast(params, n)
    return GADMMState(
        params=params,
        local_params=workers,
        transmitted=workers if compress else None,
        duals=per_client.init(params, graph.num_edges),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={metric: jnp.zeros((), dt) for metric, dt in GADMM_METRICS.items()},
    )

  def step(state: GADMMState, batches: ClientBatches) -> GADMMState:
    check_full_participation(batches, n, ordered=True)
    theta = state.local_params
    dtype = jnp.result_type(*jax.tree.leaves(theta))
    rho_k = jnp.asarray(rho, dtype)
    sent = state.transmitted if compress else theta
    if compress:
      key, round_key = jax.random.split(state.key)
      threshold = jnp.asarray(tau0, dtype) * jnp.asarray(xi, dtype) ** state.round.astype(dtype)
    else:
      key, round_key = state.key, state.key
      threshold = jnp.zeros((), dtype)
    dual_term = _incidence_transpose(state.duals, edges, n)  # λ^k, fixed for both groups
    # The objective's weighting (module docstring): c_n scales f_n in the update, weight_n in the metric.
    if by_examples:
      counts = jnp.sum(batches.mask, axis=(1, 2)).astype(dtype)
      total = jnp.maximum(jnp.sum(counts), 1)
      scale, weight = n * counts / total, counts / total
    else:
      scale = weight = jnp.ones((n,), dtype)
    objective, transmitted, finite, num_nonfinite = 0.0, jnp.zeros((n,), bool), jnp.ones((n,), bool), 0
    for group, group_key in zip(groups, jax.random.split(round_key)):  # heads, then tails: two static phases
      theta, sent, (f, t, ok, dropped) = group_update(group, group_key, theta, sent, dual_term, rho_k, threshold, batches,
                                             scale, weight)
      objective, transmitted, finite = objective + f, transmitted.at[group].set(t), finite.at[group].set(ok)
      num_nonfinite = num_nonfinite + dropped
    transmissions = jnp.sum(transmitted, dtype=jnp.int32)

    residual = _edge_difference(sent, edges)
    # An edge with a non-finite end keeps its dual (module docstring).
    edge_ok = jnp.take(finite, edges[:, 0]) & jnp.take(finite, edges[:, 1])
    duals = keep_rows(edge_ok, jax.tree.map(lambda l, r: (l + rho_k * r).astype(l.dtype), state.duals, residual),
                      state.duals)
    num_params = sum(int(np.prod(jnp.shape(p))) for p in jax.tree.leaves(state.params))
    per_message = FLOAT_BITS * num_params if compressor is None else compressor.bits(state.params)
    round_bits = transmissions.astype(jnp.float32) * per_message
    # Each transmission reaches the worker's d_n neighbours: Σ_n t_n d_n messages received in all.
    receptions = jnp.sum(jnp.where(transmitted, jnp.asarray(degree, jnp.float32), 0))
    values = {
        "objective": objective,
        "primal_residual": global_norm(residual),
        "transmissions": transmissions,
        "transmissions_cumulative": state.metrics["transmissions_cumulative"] + transmissions,
        "bits": round_bits,
        "bits_cumulative": state.metrics["bits_cumulative"] + round_bits,
        "censor_threshold": threshold,
        "num_nonfinite": num_nonfinite,
        "bits_up": round_bits / n,
        "bits_down": receptions * per_message / n,
    }
    average = jax.tree.map(lambda t, p: jnp.mean(t, axis=0).astype(jnp.result_type(p)), theta, state.params)
    return GADMMState(
        params=average,
        local_params=theta,
        transmitted=sent if compress else None,
        duals=duals,
        round=state.round + 1,
        key=key,
        metrics={metric: jnp.asarray(values[metric]).astype(dt) for metric, dt in GADMM_METRICS.items()},
    )

  return FederatedAlgorithm(init, step)


def gadmm(
    loss_fn: LossFn,
    rho: Any,
    *,
    graph: graphs_lib.Graph,
    prox: prox_lib.ProxFn | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    local_steps: int | None = None,
    objective: str = "clients",
) -> FederatedAlgorithm:
  """Group ADMM (Elgabli et al., JMLR 2020): heads, then tails, then edge duals, one iteration per step.

  θ_n ← argmin_θ f_n(θ) + (ρ d_n/2)‖θ − v_n‖², v_n = (Σ_{m∈N(n)} θ_m − (Bᵀλ)_n/ρ)/d_n,
  heads first (from the tails' models), then tails (from the heads' new
  models), then λ_e ← λ_e + ρ(θ_i − θ_j) for every edge e = (i, j), i < j.
  The derivation and the signs are in the module docstring.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`; f_n is its mean
      over worker n's real examples (include any regulariser per example).
    rho: ρ > 0, the penalty (may be traced, e.g. `jax.vmap` over ρ).
    graph: G, the workers' communication graph, connected and bipartite
      (`fedjax_opt.graphs.chain(N)` for the paper's GADMM; any other
      connected bipartite graph gives generalized GADMM). Node n is row n
      of the batches; the graph's `weights` and `mixing_rule` are not used.
    prox: exact update `prox(v, rho, data, mask) = argmin_x f_n(x) + (ρ/2)‖x − v‖²`
      (`fo.algorithms.prox_least_squares`, `prox_quadratic`), called with ρ d_n.
      None: inexact update by `client_optimizer`.
    client_optimizer: any optax optimizer of the inexact update (required
      when `prox` is None): K steps from the previous θ_n on
      f_n + (ρ d_n/2)‖θ − v_n‖², re-initialized every iteration.
    local_steps: K, each step on the worker's full data. None: K = S, the
      number of batches the worker's data is packed in. Ignored with `prox`.
    objective: "clients" (Σ_n f_n, every worker one vote) or "examples"
      (Σ_n n_n f_n / n, the pooled empirical risk, n_n the worker's real
      examples; its update then uses the penalty ρ d_n / c_n, c_n = N n_n / n,
      see the module docstring: with `client_optimizer`, a worker with few
      examples needs a step size small enough for that larger penalty).

  Returns:
    `FederatedAlgorithm(init, step)` with state `GADMMState` (`transmitted` None);
    `step(state, batches)` takes every worker's data, C = N, client_id = arange(N).

  Raises:
    TypeError: `graph` not a `fedjax_opt.graphs.Graph`, `local_steps` not a
      Python int, `prox` not callable, `client_optimizer` not an optax optimizer.
    ValueError: ρ <= 0; the graph is disconnected, not bipartite or has fewer
      than 2 nodes; neither `prox` nor `client_optimizer`; `local_steps` < 1;
      an unknown `objective`; (at `step`) C != N or client_id != arange(N).
  """
  return _group_admm("gadmm", loss_fn, rho, graph, prox, client_optimizer, local_steps, objective)


gadmm = execution.accepts_policy_keywords(gadmm, refuses_aggregator=(
    "GADMM has no server: each worker exchanges its model with its graph neighbours only, and their duals "
    "move by the exact differences of neighbouring models"),
    evaluation="global", exchanges=(1, 0), hyperparameters={"rho": execution.PENALTY,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "local_steps": execution.COUNT})


def cq_ggadmm(
    loss_fn: LossFn,
    rho: Any,
    tau0: Any,
    xi: Any = 0.9,
    *,
    graph: graphs_lib.Graph,
    bits: int | None = _BITS_NOT_GIVEN,
    compressor: compression_lib.Compressor | None = None,
    prox: prox_lib.ProxFn | None = None,
    client_optimizer: optax.GradientTransformation | None = None,
    local_steps: int | None = None,
    objective: str = "clients",
) -> FederatedAlgorithm:
  """Censored, quantized, generalized GADMM (Issaid et al. 2020) on a connected bipartite graph.

  The GADMM iteration with every worker's neighbours using its last
  transmitted model θ̂_n (module docstring): after its update worker n forms
  Q_n = θ̂_n + C(θ_n − θ̂_n), C the compressor (`bits=b`: the paper's
  quantizer `fo.compression.range_quantize(b)`; Q_n = θ_n when `bits=None`)
  and transmits, θ̂_n ← Q_n, only if ‖Q_n − θ̂_n‖ ≥ τ₀ ξ^k; the duals are
  updated with the transmitted models, λ_e ← λ_e + ρ(θ̂_i − θ̂_j).
  `bits=None`, `tau0=0` is generalized GADMM (on a chain, `gadmm` exactly).
  A transmission costs `compressor.bits(params)` bits (b P + 32 for
  `bits=b`), 32 P uncompressed.

  Args:
    loss_fn, rho: as in `gadmm`.
    tau0: τ₀ >= 0, the censoring threshold at k = 0 (0: no censoring; may be traced).
    xi: ξ ∈ (0, 1), the threshold's decay per iteration (may be traced).
    graph, prox, client_optimizer, local_steps, objective: as in `gadmm`.
    bits: b, bits per quantized coordinate (a Python int in [1, 32]):
      shorthand for `compressor=fo.compression.range_quantize(b)`, the same
      run bit for bit; None: no compression (32-bit floats are sent).
      Required unless `compressor` is given (not both), to make the choice explicit.
    compressor: C, an unbiased `fo.compression.Compressor` for what a worker
      sends (`range_quantize(b)`, `qsgd(...)`, `rand_k(...)`, `identity()`);
      a biased one is refused (module docstring). Worker n's C draws its
      coins from split(k_g, G)[i], i its position in its group (of G
      workers) and k_g that group's key of the iteration (heads, tails:
      `split(round key)`, the round key the second half of `split(state.key)`).

  Returns:
    `FederatedAlgorithm(init, step)` with state `GADMMState`; the compressor's
    noise comes from `state.key`, split once per iteration.

  Raises:
    TypeError: `bits` neither None nor a Python int; `compressor` not a
      `Compressor`; neither `bits` nor `compressor` given.
    ValueError: as `gadmm`, and bits outside [1, 32], both `bits` and
      `compressor`, a biased compressor, τ₀ < 0, ξ outside (0, 1).
  """
  compressor = _check_compressor(bits, compressor)
  _check_censoring(tau0, xi)
  return _group_admm("cq_ggadmm", loss_fn, rho, graph, prox, client_optimizer, local_steps, objective,
                     compression=(compressor, tau0, xi))


cq_ggadmm = execution.accepts_policy_keywords(cq_ggadmm, refuses_aggregator=(
    "CQ-GGADMM has no server: each worker exchanges its censored, compressed model (its compressor= is a "
    "fo.compression piece) with its graph neighbours only, and their duals move by the differences of the models "
    "the neighbours hold"),
    evaluation="global", exchanges="bits", hyperparameters={"rho": execution.PENALTY, "tau0": execution.THRESHOLD,
        "xi": execution.THRESHOLD, "bits": execution.COUNT, "client_optimizer": execution.CLIENT_OPTIMIZER,
        "local_steps": execution.COUNT})
