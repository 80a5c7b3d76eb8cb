"""L2GD, L2SGD and L2SGD+: loopless local methods for a mixture of global and local models.

Hanzely, Richtárik. "Federated Learning of a Mixture of Global and Local
Models." arXiv:2002.05516, 2020.

n clients each keep a personalized model x_i; the algorithms minimise

    F(x) = f(x) + λ ψ(x),   f(x) = (1/n) Σ_i f_i(x_i),
    ψ(x) = (1/(2n)) Σ_i ‖x_i − x̄‖²,   x̄ = (1/n) Σ_i x_i.

λ = 0 gives purely local models, λ → ∞ the global model argmin Σ_i f_i. The
optimum satisfies x_i* = x̄* − (1/λ) ∇f_i(x_i*).

Every iteration k flips one coin ξ_k ~ Bernoulli(p) (the same for all clients):

L2GD (Algorithm 1, full local gradients):

    ξ_k = 0:  x_i ← x_i − α/(n(1−p)) ∇f_i(x_i)              (local step, every client)
    ξ_k = 1:  x_i ← x_i − αλ/(np) (x_i − x̄)                 (step towards the average)

L2SGD (the paper's local SGD variant, Appendix): the same with ∇f_i replaced
by ∇f_ij(x_i), one example j drawn uniformly from client i's m_i examples.

L2SGD+ (Algorithm 2, SAGA-style control variates; f_i = (1/m_i) Σ_j f_ij).
Client i keeps a table J_i = (J_i1, …, J_im) of the last gradient seen for
each of its examples and Ψ_i, the last value of λ(x_i − x̄); J̄_i = (1/m_i) Σ_j J_ij:

    ξ_k = 0:  g_i = (1/n) [ (∇f_ij(x_i) − J_ij)/(1−p) + J̄_i + Ψ_i ],   J_ij ← ∇f_ij(x_i)
    ξ_k = 1:  g_i = (1/n) [ (λ(x_i − x̄) − Ψ_i)/p + J̄_i + Ψ_i ],       Ψ_i ← λ(x_i − x̄)
              x_i ← x_i − α g_i

(both J and Ψ start at 0; g_i is an unbiased estimate of ∂F/∂x_i whose
variance vanishes at the optimum, so L2SGD+ converges linearly to x(λ) while
L2GD and L2SGD converge linearly only to a neighbourhood of it.) This is the
plain Algorithm 2 with the full per-example table J_i, `[n, m, ...]` entries;
an iteration writes only the n sampled rows J_ij (O(n·d)).

Communication: the devices send their models to the master only when the coin
turns from local (ξ_{k−1} = 0) to aggregate (ξ_k = 1); during a run of
aggregation steps the master can update x̄ itself (for L2GD x̄ does not move).
Over k iterations this happens p(1−p)·k times in expectation (Lemma 4.2;
exactly (k−1)p(1−p) here, because the run starts synchronized: ξ_{−1} = 1).
For L2SGD+ as written, x̄ drifts during aggregation steps by −(α/n)(mean J̄_i −
(1/p − 1) mean Ψ_i), so those rounds also carry J̄_i and Ψ_i (three vectors per
device, not one). Since every Ψ_i is overwritten at the same iterations with
λ(x_i − x̄), mean Ψ_i = 0 and the drift is −(α/n) mean J̄_i, constant during
a run of aggregation steps: `l2sgd_plus(..., variant="efficient")` uses this
to upload models only (at the first two aggregation steps of a run; see
`l2sgd_plus`). The counters count communication *rounds*;
`num_vectors_sent` counts the vectors each device sent.

Bits (`metrics["bits_up"]`, `metrics["bits_down"]`, float32, per client:
every client takes part in every iteration). In an iteration with
`communicated` set, each device uploads v model-sized vectors and the master
sends v back, 32 P each for a float32 model of P entries; 0 in every other
iteration: bits_up = bits_down = 32 P v · communicated. L2GD and L2SGD: v = 1
(x_i up, x̄ down; x̄ does not move during the run, so the devices take its
aggregation steps themselves). L2SGD+ "plain": v = 3 (x_i, J̄_i, Ψ_i up; x̄,
mean J̄_i and mean Ψ_i down, what a device needs to follow x̄'s drift through
the run). "efficient": v = 1 at the first two aggregation steps of a run
(x_i up, x̄ down; the second x̄ minus the first is the drift).

Data layout (all three): one `step` is one iteration with all n clients.
`ClientBatches` carries every client's full data set, `C = n` (full
participation), `client_id` a permutation of `arange(n)` (normally
`arange(n)`); client i's examples are its S·B slots `[S, B]` with `mask`
marking the real ones. `weight` is ignored: the objective weights clients
uniformly. `state.params` is the average model x̄ (what a global evaluation
sees); the personalized models are `state.local_params` (leaves `[n, ...]`),
read with `fo.personalized_params(state, client_id)`.

The round (all three) is `core.rounds.client_round` without an aggregator
(the server averages no update: x̄ is the exact mean of the table), every
client taking part every iteration whatever its data or `weight`
(`core.rounds.every_client`, `full_participation_output`). Non-finite clients (the library's rule,
docs/architecture.md "The round", in these algorithms' terms): every
iteration each client computes its gradient (∇f_i(x_i), or ∇f_ij(x_i)) and
its candidate new x_i (L2SGD+: also its new Ψ_i = λ(x_i − x̄), and its new
J_ij is the gradient). A client for which any of these holds a NaN or Inf
sits the iteration out, whatever the coin: the round's rule without an
aggregator (a client is finite when its new rows and what else it computed,
`ClientOutput.checked`, are) drops it, counts it in `num_nonfinite` and
keeps its last finite x_i and Ψ_i rows (a local step hands Ψ_i back unchanged: the round
writes x_i and Ψ_i under one mask); its J_ij is not written either (L2SGD+
writes the one sampled row J_ij after the round, under the round's mask).
Its stored x_i, finite, still counts in
x̄ = (1/n) Σ_i x_i: it is the client's last finite model. So the tables, x̄ and
`state.params` never hold a non-finite value and no other client's model is
touched. With every client finite, the iterates are unchanged bit for bit.

Step size: all three take the paper's α, a bare step size rather than an
optax optimizer, because the method is defined by α-scaled plain gradient
steps whose scalings α/(n(1−p)) and αλ/(np) make the coin-driven step an
unbiased estimate of −α∇F (and the convergence theorems bound α itself).
"""

from __future__ import annotations

import warnings
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core import per_client
from fedjax_opt.core.differentiation import refuse_derivative
from fedjax_opt.core.local import as_single_step, local_train, masked_mean_loss
from fedjax_opt.core.rounds import client_round, every_client, full_participation_output
from fedjax_opt.core.server import finite_mean
from fedjax_opt.core.tree import select_tree, tree_bits
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree
from fedjax_opt.core.validation import (check_choice, check_full_participation, check_int, check_key, check_loss_fn,
                                        check_num_clients, check_positive, check_probability, is_concrete)
from fedjax_opt.objectives import average, consensus_penalty

__all__ = [
    "L2GDState", "L2SGDPlusState", "L2SGD_PLUS_VARIANTS", "l2gd", "l2sgd", "l2sgd_plus", "l2gd_max_step_size",
    "l2sgd_plus_step_size", "optimal_p",
]


@flax.struct.dataclass
class L2GDState:
  """State of L2GD and L2SGD.

  Attributes:
    params: x̄, the average of the personalized models (a pytree like the model).
    local_params: the personalized models x_i, a per-client table (leaves `[n, ...]`).
    previous_coin: ξ_{k−1}, bool (True at the start: every x_i = x̄, in sync).
    round: k, iterations applied, int32.
    key: PRNG key, split once per iteration (coin, example sampling).
    metrics: `aggregated` (ξ_k, bool), `communicated` (ξ_{k−1} = 0 and ξ_k = 1),
      `num_communications` (int32, since init), `num_nonfinite` (int32, the
      clients that sat this iteration out because what they computed was not
      finite), `bits_up` = `bits_down` = 32 P · communicated (float32, per
      client; module docstring); L2GD adds `objective`, F(x^k) at the iterate
      the step started from (over the clients whose loss is finite).
  """

  params: PyTree
  local_params: PyTree
  previous_coin: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


@flax.struct.dataclass
class L2SGDPlusState:
  """State of L2SGD+.

  Attributes:
    params: x̄, the average of the personalized models.
    local_params: the x_i, leaves `[n, ...]`.
    gradient_table: J, leaves `[n, m, ...]` (m = S·B example slots per client):
      J_ij is the last ∇f_ij computed for example j of client i (0 until then).
    aggregation_control: Ψ, leaves `[n, ...]`: the last λ(x_i − x̄).
    previous_coin, round, key: as in `L2GDState`.
    metrics: `aggregated`, `communicated`, `num_communications`,
      `num_nonfinite` as in `L2GDState` (no `objective`), and
      `num_vectors_sent`: d-dimensional vectors each device has sent since
      init (3 per communication for "plain": x_i, J̄_i, Ψ_i; 1 for
      "efficient": x_i); `bits_up` = `bits_down` = 32 P v · communicated
      (v = 3 "plain", 1 "efficient"; module docstring).
    master_average: `variant="efficient"` only (None otherwise): the master's
      copy of x̄, used by the aggregation steps.
    master_drift: "efficient" only: the master's estimate of x̄'s change per
      aggregation step, −(α/n)·mean_i J̄_i, learnt from two uploads.
    average_known, drift_known: "efficient" only, bool: whether the master's
      x̄ (and drift) are current, i.e. no local step and no non-finite client
      happened since they were learnt.
    control_centered: "efficient" only, bool: mean_i Ψ_i = 0, i.e. no
      aggregation step since the last complete one left a Ψ_i unwritten (a
      non-finite client); only then does the first step of a run move x̄ by
      the drift.
  """

  params: PyTree
  local_params: PyTree
  gradient_table: PyTree
  aggregation_control: PyTree
  previous_coin: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]
  master_average: PyTree = None
  master_drift: PyTree = None
  average_known: jax.Array | None = None
  drift_known: jax.Array | None = None
  control_centered: jax.Array | None = None


# ----------------------------------------------------------------------------- theory


def optimal_p(lam: Any, smoothness: Any) -> Any:
  """p* = λ / (λ + L), the coin probability minimising L2GD's iteration bound (Section 4 of the paper).

  With p*, the expected number of local steps between two aggregations is
  1/p* = 1 + L/λ. λ = 0 gives p* = 0, which no method accepts (no
  communication is needed: solve the local problems).
  """
  return lam / (lam + smoothness)


def l2gd_max_step_size(lam: Any, smoothness: Any, p: Any, num_clients: int) -> Any:
  """Largest α allowed by the L2GD convergence theorem (Theorem 4.4 of arXiv:2002.05516).

  f_i L-smooth and μ-strongly convex; G the coin-driven estimate of ∇F has
  expected smoothness ℒ = (1/n) max{L/(1−p), λ/p}, and the theorem takes
  α ≤ 1/(2ℒ), i.e.

      α_max = (n/2) · min{(1 − p)/L, p/λ}       (p/λ read as +∞ when λ = 0).

  Then E‖x^k − x(λ)‖² ≤ (1 − αμ/n)^k ‖x^0 − x(λ)‖² + 2nασ²/μ: linear
  convergence to a neighbourhood only (μ enters the rate, not the bound).
  With p = p* this is α_max = n / (2(L + λ)); it implies αλ/(np) ≤ 1/2.
  """
  if _all_python(lam, smoothness, p):
    aggregate = p / lam if lam > 0 else float("inf")
    return 0.5 * num_clients * min((1.0 - p) / smoothness, aggregate)
  lam = jnp.asarray(lam)
  aggregate = jnp.where(lam > 0, p / jnp.where(lam > 0, lam, 1.0), jnp.inf)
  return 0.5 * num_clients * jnp.minimum((1.0 - p) / smoothness, aggregate)


def l2sgd_plus_step_size(lam: Any, smoothness: Any, mu: Any, p: Any, num_clients: int, num_examples: int) -> Any:
  """The step size of the L2SGD+ convergence theorem (Theorem 5.2 of arXiv:2002.05516, reconstructed; see below).

  f_ij convex and L-smooth (per example), f_i μ-strongly convex, m examples per client:

      α = min{ n(1 − p) / (4L + μm),  np / (4λ + μ) },

  the SAGA bound for F with the f-terms sampled with probability (1 − p)/m
  and the ψ-term with probability p; then E[Φ^k] ≤ (1 − αμ/n)^k Φ^0 for a
  Lyapunov function Φ including ‖x^k − x(λ)‖².

  Where each term comes from: F = Σ_{i,j} (1/(nm)) f_ij(x_i) + λψ(x) is
  (μ/n)-strongly convex in x = (x_1, …, x_n); the term (1/(nm)) f_ij is
  (L/(nm))-smooth and drawn with probability q = (1 − p)/m, λψ is
  (λ/n)-smooth and drawn with probability p. The SAGA step-size rule for
  such non-uniform sampling, α ≤ min_terms q_term / (4 L_term + μ_F),
  gives (1 − p)/m / (4L/(nm) + μ/n) = n(1 − p)/(4L + μm) and
  p / (4λ/n + μ/n) = np/(4λ + μ): the two terms above.

  Not checked against the printed theorem: the statement of Theorem 5.2
  could not be reached. The stored copies of arXiv:2002.05516 we could search
  (the arXiv v3 text on docslib.org, its ICLR 2021 submission, a summary page)
  give the abstract and introduction only, and a secondary summary of the
  paper shows the theorem as an image; so this formula is our reconstruction,
  neither confirmed nor corrected, and a difference in the constants (the 4,
  the μm) cannot be excluded. Tested: linear convergence to x(λ) at this α
  and divergence at 30α (tests/test_mixture.py).
  """
  a = num_clients * (1.0 - p) / (4.0 * smoothness + mu * num_examples)
  b = num_clients * p / (4.0 * lam + mu)
  return min(a, b) if _all_python(a, b) else jnp.minimum(a, b)


def _all_python(*values: Any) -> bool:
  return all(isinstance(v, (int, float, np.floating, np.integer)) for v in values)


def _concrete_float(value: Any) -> float | None:
  if value is None or not is_concrete(value) or np.ndim(value) != 0:
    return None
  return float(value)


def _check_hyperparameters(loss_fn: LossFn, lam: Any, alpha: Any, p: Any, num_clients: Any) -> int:
  """Checks the arguments every method shares; returns n."""
  check_loss_fn(loss_fn)
  check_positive(lam, "lam", allow_zero=True)
  check_positive(alpha, "alpha")
  check_probability(p, "p")  # the probability of an aggregation step
  return check_num_clients(num_clients)


def _warn_above(alpha: Any, bound: Any, name: str) -> None:
  value, limit = _concrete_float(alpha), _concrete_float(bound)
  if value is not None and limit is not None and value > limit:
    warnings.warn(f"alpha={value:g} exceeds the theoretical bound {name} = {limit:g}; "
                  "convergence is not guaranteed.", stacklevel=3)


# ----------------------------------------------------------------------------- shared mechanics


def _flip_coin(state: Any, p: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(next key, ξ_k, key for this iteration's sampling)."""
  key, coin_key, sample_key = jax.random.split(state.key, 3)
  p = refuse_derivative(p, "the coin ξ ~ Bernoulli(p) (a comparison with p decides which step is taken)")
  return key, jax.random.bernoulli(coin_key, p), sample_key


def _communication_metrics(state: Any, coin: jax.Array) -> dict[str, jax.Array]:
  communicated = coin & ~state.previous_coin
  total = state.metrics["num_communications"] + communicated.astype(jnp.int32)
  return {"aggregated": coin, "communicated": communicated, "num_communications": total}


def _bits_metrics(communicated: jax.Array, vectors: int, model: PyTree) -> dict[str, jax.Array]:
  """`bits_up` = `bits_down` = `vectors` model-sized messages each way per client when `communicated`, else 0."""
  bits = communicated.astype(jnp.float32) * float(vectors * tree_bits(model))
  return {"bits_up": bits, "bits_down": bits}


def _initial_communication_metrics() -> dict[str, jax.Array]:
  return {"aggregated": jnp.ones((), bool), "communicated": jnp.zeros((), bool),
          "num_communications": jnp.zeros((), jnp.int32), "num_nonfinite": jnp.zeros((), jnp.int32),
          "bits_up": jnp.zeros((), jnp.float32), "bits_down": jnp.zeros((), jnp.float32)}


def _flatten_examples(data: PyTree, mask: jax.Array) -> tuple[PyTree, jax.Array]:
  """A client's `[S, B, ...]` slots as `[m, ...]` examples, m = S·B."""
  folded, folded_mask = as_single_step(data, mask)
  return jax.tree.map(lambda a: a[0], folded), folded_mask[0]


def _sampled_gradient(loss_fn: LossFn, x: PyTree, data: PyTree, mask: jax.Array,
                      key: jax.Array) -> tuple[jax.Array, PyTree, jax.Array]:
  """(j, ∇f_ij(x), m): j uniform over the client's real examples (0 when there is none, and then ∇ = 0),
  m `[S·B]` the mask of its example slots."""
  examples, m = _flatten_examples(data, mask)
  j = jax.random.categorical(key, jnp.where(m | ~jnp.any(m), 0.0, -jnp.inf))
  one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=True), examples)
  grad = jax.grad(lambda w: masked_mean_loss(loss_fn, w, one, jnp.ones((1,), bool))[0])(x)
  return j, jax.tree.map(lambda g: jnp.where(jnp.any(m), g, jnp.zeros_like(g)), grad), m


def _move(x: PyTree, direction: PyTree, scale: Any) -> PyTree:
  """x − scale · direction, in x's dtype (so the state keeps its dtypes under scan)."""
  return jax.tree.map(lambda a, d: (a - scale * d).astype(a.dtype), x, direction)


# ----------------------------------------------------------------------------- L2GD and L2SGD


def _loopless_local(loss_fn, lam, alpha, p, num_clients, stochastic, smoothness):
  n = _check_hyperparameters(loss_fn, lam, alpha, p, num_clients)
  if smoothness is not None:
    check_positive(smoothness, "smoothness")
    _warn_above(alpha, l2gd_max_step_size(lam, smoothness, p, n), "(n/2)·min{(1−p)/L, p/λ} (Theorem 4.4)")
  mode = client_map_lib.FromPolicy()

  def init(params: PyTree, key: jax.Array) -> L2GDState:
    check_key(key)
    metrics = _initial_communication_metrics()
    if not stochastic:
      metrics["objective"] = jnp.zeros((), jnp.result_type(*jax.tree.leaves(params)))
    return L2GDState(
        params=params,
        local_params=per_client.broadcast(params, n),
        previous_coin=jnp.ones((), bool),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics=metrics,
    )

  def client_update(shared, data, mask, x):
    x_bar, coin = shared
    if stochastic:
      data, key = data
      _, grad, _ = _sampled_gradient(loss_fn, x, data, mask, key)
      loss = jnp.zeros((), jnp.float32)  # unused: L2SGD reports no objective
    else:
      result = local_train(loss_fn, optax.sgd(1.0), x, *as_single_step(data, mask))
      grad, loss = jax.tree.map(jnp.negative, result.delta), result.loss
    local = _move(x, grad, alpha / (n * (1.0 - p)))
    toward = _move(x, jax.tree.map(jnp.subtract, x, x_bar), alpha * lam / (n * p))
    return full_participation_output(x, (select_tree(coin, toward, local),), loss, mask, checked=grad)

  def step(state: L2GDState, batches: ClientBatches) -> L2GDState:
    check_full_participation(batches, n)
    key, coin, sample_key = _flip_coin(state, p)
    keys = (jax.random.split(sample_key, n),) if stochastic else ()
    out = client_round(mode, client_update, (average(state.local_params), coin), every_client(batches, *keys),
                       tables=(state.local_params,))
    table = out.stored[0].table
    metrics = {**_communication_metrics(state, coin), "num_nonfinite": out.agg.num_nonfinite}
    metrics.update(_bits_metrics(metrics["communicated"], 1, state.params))
    if not stochastic:
      objective = finite_mean(out.results.loss) + lam * consensus_penalty(state.local_params)
      metrics["objective"] = objective.astype(state.metrics["objective"].dtype)
    return L2GDState(params=average(table), local_params=table, previous_coin=coin, round=state.round + 1,
                     key=key, metrics=metrics)

  return FederatedAlgorithm(init, step)


def l2gd(loss_fn: LossFn, lam: Any, alpha: Any, p: Any, *, num_clients: int,
         smoothness: Any = None) -> FederatedAlgorithm:
  """L2GD, loopless local gradient descent (Algorithm 1 of Hanzely & Richtárik 2020).

  One `step` = one iteration: a coin ξ ~ Bernoulli(p) from `state.key`; ξ = 0:
  x_i ← x_i − α/(n(1−p)) ∇f_i(x_i) (full-batch gradient over client i's real
  examples); ξ = 1: x_i ← x_i − αλ/(np)(x_i − x̄). Converges linearly to a
  neighbourhood of x(λ) (Theorem 4.4); the coin's randomness alone keeps it
  from reaching x(λ) exactly.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    lam: λ ≥ 0, the personalization penalty (may be traced).
    alpha: α > 0, the step size (may be traced); a bare step size because
      the method is α-scaled plain gradient steps (module docstring).
    p: probability of an aggregation step, in (0, 1) (may be traced);
      `optimal_p(lam, L)` is the paper's choice.
    num_clients: n, all clients (every step sees all of them, `C = n`).
    smoothness: optional L (each f_i L-smooth); when given and everything is
      concrete, a step size above `l2gd_max_step_size` warns.

  Returns:
    `FederatedAlgorithm(init, step)` with state `L2GDState`; `state.params` =
    x̄, `state.local_params` = the x_i `[n, ...]`, `state.metrics["objective"]`
    = F(x^k) before the step (f_i averaged over the clients whose loss is
    finite: F itself when every client is).
  """
  return _loopless_local(loss_fn, lam, alpha, p, num_clients, False, smoothness)


l2gd = execution.accepts_policy_keywords(l2gd, refuses_aggregator=(
    "L2GD's aggregation step pulls each x_i towards the exact average x̄ of the local models (the gradient of "
    "the mixture penalty λ/(2n) Σ_i ‖x_i − x̄‖²); another rule minimises another objective"),
    evaluation="table", exchanges="metrics", hyperparameters={"lam": execution.REGULARIZER,
        "alpha": execution.STEP_SIZE, "p": execution.PROBABILITY, "smoothness": execution.PROBLEM_CONSTANT})


def l2sgd(loss_fn: LossFn, lam: Any, alpha: Any, p: Any, *, num_clients: int,
          smoothness: Any = None) -> FederatedAlgorithm:
  """L2SGD: L2GD with one uniformly sampled example per local step, no variance reduction.

  ξ = 0: x_i ← x_i − α/(n(1−p)) ∇f_ij(x_i), j uniform over client i's real
  examples; ξ = 1 as L2GD. The baseline "L2SGD" of the paper's Figure 3
  (Appendix, local SGD); converges to a neighbourhood of x(λ). Arguments and
  state as `l2gd` (no `objective` metric: use `fedjax_opt.objectives.mixture`).
  """
  return _loopless_local(loss_fn, lam, alpha, p, num_clients, True, smoothness)


l2sgd = execution.accepts_policy_keywords(l2sgd, refuses_aggregator=(
    "L2SGD's aggregation step pulls each x_i towards the exact average x̄ of the local models (the gradient "
    "of the mixture penalty λ/(2n) Σ_i ‖x_i − x̄‖²); another rule minimises another objective"),
    evaluation="table", exchanges="metrics", hyperparameters={"lam": execution.REGULARIZER,
        "alpha": execution.STEP_SIZE, "p": execution.PROBABILITY, "smoothness": execution.PROBLEM_CONSTANT})


# ----------------------------------------------------------------------------- L2SGD+


def _write_sampled_rows(table: PyTree, client_id: jax.Array, example: jax.Array, rows: PyTree,
                        write: jax.Array) -> PyTree:
  """J_{client_id[c], example[c]} ← rows[c] for the clients with `write[c]`: O(n·d), the rest of J untouched.

  The per-client write rule of `per_client.scatter` (`per_client.last_writers`:
  out-of-range ids and non-writing clients are dropped), one example row deep.
  """
  n = per_client.num_rows(table)
  target = jnp.where(per_client.last_writers(client_id, write, n), client_id, n)  # row n: dropped
  return jax.tree.map(lambda t, r: t.at[target, example].set(r.astype(t.dtype), mode="drop"), table, rows)


L2SGD_PLUS_VARIANTS = ("plain", "efficient")


def _master_average(state: L2SGDPlusState, coin: jax.Array, true_average: PyTree):
  """The x̄ the master uses at this iteration, the drift it knows after it, and which kind of step this is.

  `true_average` is mean_i x_i, what an upload of every model gives the
  master. Aggregation step (ξ = 1): first of a run → upload, x̄ learnt;
  second → upload, drift = x̄^k − x̄^{k−1} learnt; later → x̄ ← x̄ + drift, no
  upload. Returns (x̄, drift, first, second).
  """
  first = coin & ~state.average_known
  second = coin & state.average_known & ~state.drift_known
  later = coin & state.average_known & state.drift_known
  average = jax.tree.map(
      lambda old, drift, true: jnp.where(later, old + drift, jnp.where(first | second, true, old)).astype(old.dtype),
      state.master_average, state.master_drift, true_average)
  drift = jax.tree.map(lambda old_avg, old, true: jnp.where(second, true - old_avg, old).astype(old.dtype),
                       state.master_average, state.master_drift, true_average)
  return average, drift, first, second


def _master_knowledge(state: L2SGDPlusState, coin: jax.Array, first: jax.Array, complete: jax.Array):
  """What the master knows after the step: (average_known, drift_known, control_centered).

  A local step makes x̄ and the drift stale; so does a non-finite client
  (`complete` False: it did not move, so x̄ did not move by the drift). x̄
  learnt at the first step of a run is kept only if that step started with
  mean_i Ψ_i = 0: otherwise the change it made, (α/n)(1/p − 1)·mean Ψ_i away
  from the drift, is no drift sample, and the next aggregation step uploads
  afresh (after a complete aggregation step every Ψ_i is new: mean 0 again).
  """
  complete_aggregation = coin & complete
  known = complete_aggregation & (state.control_centered | ~first)
  drift_known = complete_aggregation & state.average_known
  centered = jnp.where(coin, complete, state.control_centered)
  return known, drift_known, centered


def l2sgd_plus(loss_fn: LossFn, lam: Any, alpha: Any, p: Any, *, num_clients: int, num_examples: int,
               smoothness: Any = None, mu: Any = None, variant: str = "plain") -> FederatedAlgorithm:
  """L2SGD+, loopless local SGD with SAGA control variates (Algorithm 2 of Hanzely & Richtárik 2020).

  ξ = 0: g_i = (1/n)[(∇f_ij(x_i) − J_ij)/(1−p) + J̄_i + Ψ_i], J_ij ← ∇f_ij(x_i);
  ξ = 1: g_i = (1/n)[(λ(x_i − x̄) − Ψ_i)/p + J̄_i + Ψ_i], Ψ_i ← λ(x_i − x̄);
  then x_i ← x_i − α g_i. Converges linearly to the exact optimum x(λ).
  Keeps the full per-example table J (`[n, m, ...]`, the paper's Algorithm 2)
  in both variants.

  Unbiasedness (the weights 1/(1−p) and 1/p; tested by exact enumeration of
  the coin and j): E_j[∇f_ij − J_ij] = ∇f_i(x_i) − J̄_i, so
  E[g_i] = (1/n)[∇f_i(x_i) − J̄_i + λ(x_i − x̄) − Ψ_i + J̄_i + Ψ_i]
         = (1/n)[∇f_i(x_i) + λ(x_i − x̄)] = ∂F/∂x_i(x),
  whatever J and Ψ hold: E[x^{k+1}] = x^k − α∇F(x^k).

  Cost per iteration: one example gradient per client and one row J_ij per
  client written (`O(n·d)`, d the model size); J̄_i is read from the whole
  table (`O(n·m·d)` reads, no writes).

  `variant="efficient"`: the same iterates, with control variates that never
  leave the devices; only models are uploaded. Two facts make it possible
  (both exact, and checked by the tests): every Ψ_i is overwritten at the same
  iterations with λ(x_i − x̄), so mean_i Ψ_i = 0 at all times; and J only
  changes in local steps. Averaging the update over i, an aggregation step
  therefore moves x̄ by exactly −(α/n)·mean_i J̄_i, the same vector at every
  aggregation step of a run of consecutive ξ = 1. So the master needs the
  devices' models at the first aggregation step of a run (to learn x̄) and at
  the second (x̄ once more: the difference is the drift); from the third on
  it extrapolates x̄ ← x̄ + drift. At the start everything is known
  (x_i = x̄, J = 0: drift 0). Communications: an upload of one vector per
  device at the first two aggregation steps of every run that follows a
  local step, in expectation p(1−p)(1+p) per iteration (vs p(1−p) rounds of
  three vectors for "plain"; measured in benchmarks/l2sgd_plus.py). The
  iterates equal the plain ones up to the rounding of the extrapolated x̄.
  A non-finite client (module docstring) breaks both facts for a while (it
  moves no x_i and may leave its Ψ_i unwritten): the master then treats x̄
  and the drift as stale, as after a local step, and learns them again from
  uploads (`L2SGDPlusState.control_centered`), so the iterates still equal
  the plain ones. This is our derivation; the paper's appendix describes its
  own efficient implementation (p(1−p) rounds of models only, according to a
  secondary summary of the paper), whose text was not reachable to us, so it
  is not reproduced here.

  Args:
    loss_fn, lam, alpha, p, num_clients: as `l2gd`.
    num_examples: m, example slots per client = S·B of the batches (static;
      the size of each client's J_i). Clients with fewer real examples leave
      the padded rows of J_i at 0 and out of J̄_i.
    smoothness, mu: optional L (every f_ij L-smooth) and μ (every f_i
      μ-strongly convex); when both are given and everything is concrete, a
      step size above `l2sgd_plus_step_size` warns.
    variant: "plain" (Algorithm 2 as written, the master reads x̄ from all
      models every aggregation step) or "efficient" (models only, above).

  Returns:
    `FederatedAlgorithm(init, step)` with state `L2SGDPlusState`.
  """
  n = _check_hyperparameters(loss_fn, lam, alpha, p, num_clients)
  m = check_int(num_examples, "num_examples")
  check_choice(variant, "variant", L2SGD_PLUS_VARIANTS)
  efficient = variant == "efficient"
  vectors_per_communication = 1 if efficient else 3
  if smoothness is not None and mu is not None:
    check_positive(smoothness, "smoothness")
    check_positive(mu, "mu")
    _warn_above(alpha, l2sgd_plus_step_size(lam, smoothness, mu, p, n, m),
                "min{n(1−p)/(4L+μm), np/(4λ+μ)} (Theorem 5.2)")
  mode = client_map_lib.FromPolicy()

  def init(params: PyTree, key: jax.Array) -> L2SGDPlusState:
    check_key(key)
    example_row = jax.tree.map(lambda t: jnp.zeros((m,) + jnp.shape(t), jnp.result_type(t)), params)
    master = {}
    if efficient:
      master = dict(master_average=params, master_drift=jax.tree.map(jnp.zeros_like, params),
                    average_known=jnp.ones((), bool), drift_known=jnp.ones((), bool),
                    control_centered=jnp.ones((), bool))
    return L2SGDPlusState(
        params=params,
        local_params=per_client.broadcast(params, n),
        gradient_table=per_client.init(example_row, n),
        aggregation_control=per_client.init(params, n),
        previous_coin=jnp.ones((), bool),
        round=jnp.zeros((), jnp.int32),
        key=key,
        metrics={**_initial_communication_metrics(), "num_vectors_sent": jnp.zeros((), jnp.int32)},
        **master,
    )

  def client_update(shared, data, mask, x, psi):
    x_bar, coin = shared
    data, key, table = data  # J_i is only read here; its one new row J_ij is written after the round
    j, grad, m = _sampled_gradient(loss_fn, x, data, mask, key)
    old = jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, j, keepdims=False), table)
    count = jnp.maximum(jnp.sum(m), 1)
    mean = jax.tree.map(lambda t: jnp.tensordot(m.astype(t.dtype), t, axes=1) / count.astype(t.dtype), table)
    pull = jax.tree.map(lambda a, b: lam * (a - b), x, x_bar)  # λ(x_i − x̄)
    local = jax.tree.map(lambda g, o, jm, ps: (g - o) / (1.0 - p) + jm + ps, grad, old, mean, psi)
    toward = jax.tree.map(lambda pl, jm, ps: (pl - ps) / p + jm + ps, pull, mean, psi)
    new_x = _move(x, select_tree(coin, toward, local), alpha / n)
    # Ψ_i ← λ(x_i − x̄) at an aggregation step; a local step hands the row back unchanged.
    return full_participation_output(x, (new_x, select_tree(coin, pull, psi)), jnp.zeros((), jnp.float32), mask,
                                     checked=(grad, pull), extras=(j, grad))

  def step(state: L2SGDPlusState, batches: ClientBatches) -> L2SGDPlusState:
    check_full_participation(batches, n)
    if batches.local_steps * batches.batch_size != m:
      raise ValueError(f"batches must have S·B = num_examples = {m} example slots per client; got "
                       f"S·B = {batches.local_steps}·{batches.batch_size}.")
    key, coin, sample_key = _flip_coin(state, p)
    ids = batches.client_id
    x_bar = average(state.local_params)
    metrics = _communication_metrics(state, coin)
    if efficient:
      x_bar, drift, first, second = _master_average(state, coin, x_bar)
      uploaded = first | second
      metrics = {"aggregated": coin, "communicated": uploaded,
                 "num_communications": state.metrics["num_communications"] + uploaded.astype(jnp.int32)}
    metrics["num_vectors_sent"] = state.metrics["num_vectors_sent"] + vectors_per_communication * (
        metrics["communicated"].astype(jnp.int32))
    metrics.update(_bits_metrics(metrics["communicated"], vectors_per_communication, state.params))
    inputs = (jax.random.split(sample_key, n), per_client.gather(state.gradient_table, ids))
    out = client_round(mode, client_update, (x_bar, coin), every_client(batches, *inputs),
                       tables=(state.local_params, state.aggregation_control))
    j, grad = out.extras
    metrics["num_nonfinite"] = out.agg.num_nonfinite
    master = {}
    if efficient:
      known, drift_known, centered = _master_knowledge(state, coin, first, jnp.all(out.write))
      master = dict(master_average=x_bar, master_drift=drift, average_known=known, drift_known=drift_known,
                    control_centered=centered)
    local_params = out.stored[0].table
    return L2SGDPlusState(
        params=average(local_params),
        local_params=local_params,
        gradient_table=_write_sampled_rows(state.gradient_table, ids, j, grad, out.write & ~coin),
        aggregation_control=out.stored[1].table,
        previous_coin=coin,
        round=state.round + 1,
        key=key,
        metrics=metrics,
        **master,
    )

  return FederatedAlgorithm(init, step)


l2sgd_plus = execution.accepts_policy_keywords(l2sgd_plus, refuses_aggregator=(
    "L2SGD+'s aggregation step pulls each x_i towards the exact average x̄ of the local models and its "
    "control variates Ψ_i = λ(x_i − x̄) are built on it (the mixture penalty's gradient); another rule "
    "minimises another objective"),
    evaluation="table", exchanges="metrics", hyperparameters={"lam": execution.REGULARIZER,
        "alpha": execution.STEP_SIZE, "p": execution.PROBABILITY, "smoothness": execution.PROBLEM_CONSTANT,
        "mu": execution.PROBLEM_CONSTANT})
