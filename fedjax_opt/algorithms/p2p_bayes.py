"""Peer-to-peer federated learning on graphs: Bayesian updates and geometric averaging of beliefs.

Lalitha, Kilinc, Javidi, Koushanfar. "Peer-to-peer Federated Learning on
Graphs." arXiv:1901.11173, 2019. The finite-hypothesis rule and its rate of
learning are those of Lalitha, Javidi, Sarwate, "Social Learning and
Distributed Hypothesis Testing", IEEE Trans. Inf. Theory 64(9), 2018
(arXiv:1410.4307), on which the P2P paper builds.

Problem. N nodes on a connected graph with a mixing matrix W (the factory's
`graph=`: symmetric, nonnegative, doubly stochastic, spectral gap > 0; or a
time-varying sequence `[T, N, N]`, W[k mod T] in round k) and a
finite set of K hypotheses θ_1 … θ_K (candidate models, a stacked pytree
`[K, ...]`). Node i observes examples z ~ f_i(· | θ*) of an unknown true θ*,
and each node keeps a belief b_i `[K]` over the hypotheses (as
log-probabilities). One round k, with node i's real examples Z_i^k of the round:

    local Bayesian update:  log b̃_i(θ) = log b_i^k(θ) + Σ_{z ∈ Z_i^k} log f_i(z | θ) − log c_i
    geometric averaging:    log b_i^{k+1}(θ) = Σ_j W_ij log b̃_j(θ) − log c'_i

(c_i, c'_i normalize, by logsumexp over θ). The likelihood is the loss:
log f_i(z | θ) = −`loss_fn`(θ, z) up to a term independent of θ, so
`loss_fn` must be a negative log-likelihood (softmax cross-entropy for a
classifier; ½(y − ŷ)²/σ² for Gaussian noise of known σ). A user
log-likelihood indexed by hypothesis works too: pass `hypotheses =
jnp.arange(K)` and `loss_fn = lambda k, batch: -log_lik(k, batch)`.

What is learned. No node needs to identify θ* alone: it suffices that for
every θ ≠ θ* some node j has D_j(θ) = KL(f_j(·|θ*) ‖ f_j(·|θ)) > 0 (θ* is
globally identifiable). With r_i^k(θ) = log b_i^k(θ) − log b_i^k(θ*) and
λ_j^k(θ) = Σ_{z ∈ Z_j^k} [log f_j(z|θ) − log f_j(z|θ*)] the log-likelihood
ratios, the rule is linear, r^{k+1} = W (r^k + λ^k), so (1ᵀW = 1ᵀ) the
network average is exact bookkeeping, r̄^{k+1} = r̄^k + λ̄^k, and every node
follows it up to a bounded disagreement. Hence, for every node i,

    (1/k) log (b_i^k(θ) / b_i^k(θ*))  →  −(B/N) Σ_j D_j(θ)     (almost surely)

with B examples per node and round (the stationary distribution of a
doubly stochastic W is uniform; Lalitha et al. 2018, Theorem 1, with
v_j = 1/N): the belief on every wrong hypothesis decays exponentially, at
the network-average KL rate, at every node.

The local update is one `core.rounds.client_round` without an aggregator
(node i's log b_i is its row of the per-node table of beliefs; its new row is
log b̃_i), and there is no server: the geometric averaging is the exchange,
an aggregation over the graph, log b ← W log b̃ (`core.mixing.mix`), then
normalized. A node whose log-likelihoods of the round are not all finite
follows the library's rule (docs/architecture.md, "The round"), in the form
`core/rounds.py` states for a round without an aggregator (every node takes
part every round, with data or not, its batch weight not read; it is finite
when its new row log b̃_i = log b_i + log-likelihoods, normalized, is): it is
counted in `num_nonfinite`, keeps its belief, and
(our form for a graph; the paper does not treat it) is cut out of the graph
for the round as in `gossip` (`core.mixing.exclude`), so nothing of it
spreads. A likelihood of exactly 0 (log = −∞) counts as non-finite: give
`loss_fn` a finite ceiling if a hypothesis can rule an example out.

State (`P2PBayesState`): `log_beliefs` `[N, K]` (normalized log b_i),
`local_params` each node's most probable hypothesis (`[N, ...]`,
`fo.personalized_params(state, i)`), `params` the hypothesis of the largest
network-average log-belief (Σ_i log b_i). Metrics: `belief_entropy` (mean over
nodes of −Σ_θ b_i log b_i), `map_agreement` (fraction of nodes whose most
probable hypothesis is `params`), `bytes_sent` (per node, averaged: K log-beliefs
to each neighbour), `bits_up` (the same in bits: (1/N) Σ_j #{i ≠ j : W̃_ij ≠ 0}
× 32 K for float32 beliefs), `bits_down` (per node, averaged: the K
log-beliefs of each neighbour it averages, (1/N) Σ_i #{j ≠ i : W̃_ij ≠ 0} × 32 K),
`num_nonfinite`; with `true_hypothesis=t` also `true_belief` `[N]`, each node's
belief b_i(θ_t) after the round (the curve of the paper's figures: it tends to 1
when θ_t is the truth). No model is sent: the hypotheses are known to every node.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import mixing as mixing_lib
from fedjax_opt.core.local import LocalResult
from fedjax_opt.core.rounds import ClientOutput, client_round
from fedjax_opt.core.server import keep_rows
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_full_participation, check_int, check_key, check_loss_fn,
                                        check_per_example_loss, is_concrete)

__all__ = ["P2PBayesState", "P2P_BAYES_METRICS", "p2p_bayes"]

P2P_BAYES_METRICS = {
    "belief_entropy": jnp.float32,
    "map_agreement": jnp.float32,
    "bytes_sent": jnp.float32,
    "bits_up": jnp.float32,
    "bits_down": jnp.float32,
    "num_nonfinite": jnp.int32,
}
"""The diagnostics of a P2P Bayesian round (module docstring); `true_hypothesis=t` adds `true_belief` `[N]`."""


@flax.struct.dataclass
class P2PBayesState:
  """State of `p2p_bayes`.

  Attributes:
    params: the hypothesis of the largest network-average log-belief (a pytree like one hypothesis).
    local_params: each node's most probable hypothesis, a per-node table (leaves `[N, ...]`).
    log_beliefs: `[N, K]`, log b_i(θ_k), each row normalized (logsumexp = 0).
    round: k, rounds applied, int32.
    key: PRNG key (nothing is drawn; kept for the common state contract).
    metrics: `P2P_BAYES_METRICS` (and `true_belief` `[N]` with `true_hypothesis`).
  """

  params: PyTree
  local_params: PyTree
  log_beliefs: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _num_hypotheses(hypotheses: Any) -> int:
  leaves = jax.tree.leaves(hypotheses)
  if not leaves:
    raise ValueError("hypotheses must be a pytree of arrays with a leading [K] axis (K candidate models).")
  sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"every leaf of hypotheses must share the leading [K] axis (one row per candidate model); "
                     f"got leading sizes {sizes}.")
  k = sizes.pop()
  if k < 1:
    raise ValueError("hypotheses must hold at least one candidate model (K >= 1).")
  return int(k)


def _log_prior(prior: Any, n: int, k: int) -> jax.Array:
  """`[N, K]` normalized log prior (uniform by default), checked when concrete."""
  if prior is None:
    return jnp.full((n, k), -np.log(k))
  shape = tuple(np.shape(prior))  # a list too (a TOML value)
  if shape not in ((k,), (n, k)):
    raise ValueError(f"prior must have shape [K] = ({k},) or [N, K] = ({n}, {k}); got shape {shape}.")
  if is_concrete(prior):
    p = np.asarray(prior, np.float64)
    if not np.all(np.isfinite(p)) or np.any(p <= 0):
      raise ValueError("prior must be finite and > 0 on every hypothesis (a hypothesis of prior 0 can never be "
                       f"learned: leave it out of hypotheses instead); got {p}.")
    if not np.allclose(p.sum(axis=-1), 1.0, atol=1e-6):
      raise ValueError(f"prior must sum to 1 (over the hypotheses, per node); sums {p.sum(axis=-1)}.")
  log_p = jnp.log(jnp.asarray(prior))
  return jnp.broadcast_to(log_p, (n, k))


def _pick(hypotheses: PyTree, index: jax.Array, like: PyTree) -> PyTree:
  return jax.tree.map(lambda h, p: jnp.take(h, index, axis=0).astype(jnp.result_type(p)), hypotheses, like)


def p2p_bayes(
    loss_fn: LossFn,
    *,
    hypotheses: PyTree,
    graph: Any,
    prior: Any = None,
    true_hypothesis: int | None = None,
) -> FederatedAlgorithm:
  """P2P federated learning on graphs (Lalitha et al. 2019): Bayesian update, then geometric averaging of beliefs.

      log b̃_i = log b_i − Σ_{z ∈ Z_i} loss_fn(θ, z) − logsumexp(·)           (local posterior)
      log b_i ← Σ_j W_ij log b̃_j − logsumexp(·)                              (neighbours' geometric mean)

  over the K hypotheses θ; see the module docstring for the rate at which
  wrong hypotheses die out, (1/k) log(b_i(θ)/b_i(θ*)) → −(B/N) Σ_j KL_j(θ*‖θ).

  Args:
    loss_fn: the per-example negative log-likelihood `loss_fn(θ, batch) -> [B]`,
      −log f_i(z | θ) up to a term independent of θ.
    hypotheses: the K candidate models θ_1 … θ_K, a pytree whose leaves have a
      leading `[K]` axis (stacked models, or `jnp.arange(K)` for a
      log-likelihood indexed by hypothesis).
    graph: a `fedjax_opt.graphs.Graph` (mixed by its `mixing_rule`, default
      Metropolis–Hastings) or a mixing matrix W `[N, N]` / sequence
      `[T, N, N]` (W[k mod T] in round k), as in `gossip`. Node i is row i
      of the batches.
    prior: b_i^0, probabilities `[K]` (every node) or `[N, K]`, > 0 and summing
      to 1; None: uniform.
    true_hypothesis: None, or t in [0, K): the metrics then hold `true_belief`
      `[N]`, each node's belief b_i(θ_t) after the round (when θ_t is the truth,
      how close each node is to having learnt it). It changes nothing else.

  Returns:
    `FederatedAlgorithm(init, step)` with state `P2PBayesState`. `init(params,
    key)` takes a pytree like one hypothesis (its structure and shapes are
    checked; the models of the state are hypotheses: the most probable ones
    under the prior). `step(state, batches)` takes every node's data, C = N,
    client_id = arange(N); all S·B real examples of a node enter its update.

  Raises:
    TypeError: `graph` missing or not a Graph / matrix; `loss_fn` not callable;
      (at `init`) params not shaped like one hypothesis.
    ValueError: hypotheses without a common leading axis; a bad prior; a bad
      mixing matrix; `true_hypothesis` not in [0, K); (at `step`) C != N or
      client_id != arange(N).
  """
  check_loss_fn(loss_fn)
  k = _num_hypotheses(hypotheses)
  mix = mixing_lib.prepare(graph)
  n = mix.num_nodes
  log_prior = _log_prior(prior, n, k)
  if true_hypothesis is not None:
    true_hypothesis = check_int(true_hypothesis, "true_hypothesis", 0)
    if true_hypothesis >= k:
      raise ValueError(f"p2p_bayes: true_hypothesis must index one of the K = {k} hypotheses, in [0, {k}); got "
                       f"{true_hypothesis}.")
  metric_types = dict(P2P_BAYES_METRICS, **({} if true_hypothesis is None else {"true_belief": jnp.float32}))
  mode = client_map_lib.FromPolicy()
  one = jax.tree.map(lambda h: jax.ShapeDtypeStruct(jnp.shape(h)[1:], jnp.result_type(h)), hypotheses)

  def node_update(thetas, data, mask, old):
    batch = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), data)
    m = mask.reshape(-1)

    def one_hypothesis(theta):
      losses = loss_fn(theta, batch)
      check_per_example_loss(losses, m.shape[0])
      return -jnp.sum(jnp.where(m, losses, jnp.zeros_like(losses)))

    log_lik = jax.vmap(one_hypothesis)(thetas).astype(old.dtype)  # over the K hypotheses, inside one node
    local = old + log_lik  # the local posterior log b̃_i: not finite where a log-likelihood is not
    result = LocalResult(delta=log_lik, loss=jnp.zeros(()), num_examples=jnp.sum(m, dtype=old.dtype),
                         num_steps=jnp.ones((), jnp.int32))  # every node takes part (no example: b̃_i = b_i)
    return ClientOutput(result, rows=(local - jax.scipy.special.logsumexp(local),))

  def summarize(log_beliefs, like):
    node_map = jnp.argmax(log_beliefs, axis=1)
    network_map = jnp.argmax(jnp.sum(log_beliefs, axis=0))
    return _pick(hypotheses, network_map, like), _pick(hypotheses, node_map, like), node_map == network_map

  def init(params: PyTree, key: jax.Array) -> P2PBayesState:
    check_key(key)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
    if jax.tree.structure(shapes) != jax.tree.structure(one) or any(
        a.shape != b.shape for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(one))):
      raise TypeError(f"p2p_bayes: init's params must be shaped like one hypothesis {one}; got {shapes}.")
    log_beliefs = log_prior.astype(jnp.result_type(float))
    log_beliefs = log_beliefs - jax.scipy.special.logsumexp(log_beliefs, axis=1, keepdims=True)
    best, table, _ = summarize(log_beliefs, params)
    return P2PBayesState(
        params=best,
        local_params=table,
        log_beliefs=log_beliefs,
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={m: jnp.zeros((n,) if m == "true_belief" else (), dt) for m, dt in metric_types.items()},
    )

  def step(state: P2PBayesState, batches: ClientBatches) -> P2PBayesState:
    if isinstance(batches, ClientBatches) and batches.mask.ndim == 3 and batches.num_clients != n:
      raise ValueError(f"p2p_bayes: the mixing matrix has N = {n} nodes, so batches must hold every node's data, "
                       f"C = N = {n} (row i = node i); got C = {batches.num_clients}.")
    check_full_participation(batches, n, ordered=True)
    old = state.log_beliefs
    out = client_round(mode, node_update, hypotheses, batches.replace(weight=jnp.ones_like(batches.weight)),
                       tables=(old,))
    ok, num_nonfinite = out.agg.finite, out.agg.num_nonfinite
    w = mixing_lib.exclude(mixing_lib.at_round(mix, state.round, old.dtype), ok)
    mixed = mixing_lib.mix(w, out.stored[0].table)  # b̃_i written where finite; a dropped node's b_i is cut out
    mixed = mixed - jax.scipy.special.logsumexp(mixed, axis=1, keepdims=True)
    log_beliefs = keep_rows(ok, mixed, old)
    best, table, agree = summarize(log_beliefs, state.params)
    beliefs = jnp.exp(log_beliefs)
    itemsize = jnp.dtype(old.dtype).itemsize  # a message is K log-beliefs
    sent = jnp.mean(mixing_lib.messages_sent(w).astype(jnp.float32)) * k * itemsize
    received = jnp.mean(mixing_lib.messages_received(w).astype(jnp.float32)) * k * itemsize
    values = {
        "belief_entropy": jnp.mean(-jnp.sum(beliefs * log_beliefs, axis=1)),
        "map_agreement": jnp.mean(agree.astype(jnp.float32)),
        "bytes_sent": sent,
        "bits_up": 8 * sent,
        "bits_down": 8 * received,
        "num_nonfinite": num_nonfinite,
    }
    if true_hypothesis is not None:
      values["true_belief"] = beliefs[:, true_hypothesis]
    return state.replace(params=best, local_params=table, log_beliefs=log_beliefs, round=state.round + 1,
                         metrics={m: jnp.asarray(values[m]).astype(dt) for m, dt in metric_types.items()})

  return FederatedAlgorithm(init, step)


p2p_bayes = execution.accepts_policy_keywords(p2p_bayes, refuses_aggregator=(
    "P2P Bayes has no server: every node combines its neighbours' log-beliefs by the graph's mixing matrix, "
    "which is its aggregation"),
    evaluation="table", exchanges="bytes", hyperparameters={})
