"""FedMD: heterogeneous federated learning through model distillation on public data.

Li, Wang. "FedMD: Heterogenous Federated Learning via Model Distillation."
NeurIPS 2019 Workshop on Federated Learning. arXiv:1910.03581.

Clients keep their own models, possibly of *different architectures*, and
never send parameters: they exchange class scores on a shared public
dataset D₀. Round k (the paper's Algorithm 1; every client takes part):

    Communicate: client k computes its class scores f_k(x) on the round's public subset
                 X_k ⊂ D₀ (`public_per_round` examples drawn from the round's key)
    Aggregate:   f̃(x) = (1/m) Σ_k f_k(x), x ∈ X_k (the m finite clients' mean)
    Digest:      client k takes `digest_steps` steps of the digest optimizer on
                 (1/B) Σ_x d(f_k(x), f̃(x)) over batches of B public examples (cycling X_k)
    Revisit:     client k takes S masked steps of the client optimizer on its private data

Scores are the model's outputs (logits). The distance d is `digest_loss`:
"l1" (default), the mean absolute difference over the classes (a regression
of the client's scores onto the consensus), or "kl", T² · KL(softmax(f̃/T) ‖
softmax(f_k/T)) at temperature T (Hinton et al.'s distillation). The paper's
optional transfer-learning start (training on D₀'s labels, then on the
private data) is what the user's initial models are: the factory starts
from the models it is given.

Architectures. `architecture_of[k]` (static, length N) names client k's
architecture a ∈ {0, …, A−1}; architecture a has its own `loss_fn[a]` and
`apply_fn[a]` (pass one function for A = 1). Clients of one architecture
are stacked and mapped together with `client_map`; the consensus mixes every
architecture's scores. State (`FedMDState`): `local_params` = the clients'
models: one table `[N, ...]` when A = 1 (so `fo.personalized_params` reads it),
a tuple of A tables `[n_a, ...]` (clients of architecture a in id order)
otherwise; `fedmd_client_params(state, k)` reads one client either way.
`params` is the model of client 0 (the state contract asks for one model; a
FedMD federation has no global model).

With `digest_steps=0` no public data is used and each client trains alone:
FedMD is then independent local training (to float rounding: the clients
are mapped together).

Non-finite clients follow the library's rule (docs/architecture.md, "The
round"): here a client whose scores or new model are not finite is left out
of the consensus and keeps its model, so a NaN never reaches another client.

Metrics: `client_loss` (the private revisit loss over finite clients),
`digest_loss` (mean d before each digest step, over finite clients),
`consensus_accuracy` (accuracy of argmax f̃ on the round's public subset when
D₀ has labels "y"; −1 otherwise), `num_nonfinite`, `num_clients`, and what
travels: `bits_up` = 32·|X_k|·K per client (its float32 scores) and
`bits_down` = 32·|X_k|·K per client (the consensus; which examples form X_k
follows from the shared round key, so no index is sent). No model ever
travels; with `digest_steps=0` nothing does (both 0).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.local import cycle_steps, local_train
from fedjax_opt.core.server import finite_clients, keep_rows, zero_rows
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, PyTree, materialize
from fedjax_opt.core.validation import (check_choice, check_full_participation, check_int, check_key,
                                        check_optimizer, check_positive)

__all__ = ["DIGEST_LOSSES", "FedMDState", "client_params", "fedmd"]

DIGEST_LOSSES = ("l1", "kl")


@flax.struct.dataclass
class FedMDState:
  """State of FedMD.

  Attributes:
    params: client 0's model (FedMD has no global model).
    local_params: the clients' models: a table `[N, ...]` (one architecture) or a tuple of A tables `[n_a, ...]`.
    round: rounds applied, int32.
    key: PRNG key, split once per round (the public subset).
    metrics: `client_loss`, `digest_loss`, `consensus_accuracy`, `num_nonfinite`, `num_clients`.
  """

  params: PyTree
  local_params: Any
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


def _as_tuple(fn: Any, name: str) -> tuple:
  fns = tuple(fn) if isinstance(fn, (tuple, list)) else (fn,)
  for f in fns:
    if not callable(f):
      raise TypeError(f"fedmd: {name} must be a function or a sequence of functions (one per architecture); got "
                      f"{type(f).__name__}.")
  return fns


def _groups(architecture_of: Any, num_clients: int, num_architectures: int) -> list[np.ndarray]:
  arch = np.zeros(num_clients, np.int64) if architecture_of is None else np.asarray(architecture_of)
  if arch.shape != (num_clients,) or not np.issubdtype(arch.dtype, np.integer):
    raise ValueError(f"fedmd: architecture_of must be {num_clients} integers (one per client); got {arch!r}.")
  if arch.min() < 0 or arch.max() >= num_architectures:
    raise ValueError(f"fedmd: architecture_of must lie in [0, {num_architectures}) (one loss_fn / apply_fn per "
                     f"architecture); got values {sorted(set(arch.tolist()))}.")
  groups = [np.flatnonzero(arch == a) for a in range(num_architectures)]
  empty = [a for a, g in enumerate(groups) if g.size == 0]
  if empty:
    raise ValueError(f"fedmd: architecture(s) {empty} have no client.")
  return groups


def client_params(state: FedMDState, client_id: int, architecture_of: Any = None) -> PyTree:
  """Client k's model (`architecture_of` as given to `fedmd`; not needed with one architecture)."""
  if not isinstance(state.local_params, tuple):
    return jax.tree.map(lambda t: t[client_id], state.local_params)
  arch = np.asarray(architecture_of)
  a = int(arch[client_id])
  row = int(np.sum(arch[:client_id] == a))
  return jax.tree.map(lambda t: t[row], state.local_params[a])


def fedmd(
    loss_fn: Callable | Sequence[Callable],
    *,
    apply_fn: Callable | Sequence[Callable],
    num_clients: int,
    public_data: PyTree,
    public_per_round: int,
    digest_steps: int,
    digest_batch_size: int,
    client_optimizer: optax.GradientTransformation,
    digest_optimizer: optax.GradientTransformation | None = None,
    architecture_of: Any = None,
    digest_loss: str = "l1",
    temperature: Any = 1.0,
) -> FederatedAlgorithm:
  """FedMD (Li & Wang 2019): clients of any architectures distil towards the consensus of their public scores.

  Args:
    loss_fn: the private per-example loss `loss_fn(params, batch) -> [B]`, or one per architecture.
    apply_fn: `apply_fn(params, x [B, ...]) -> scores [B, K]`, or one per architecture (every architecture
      gives K scores).
    num_clients: N (every client takes part in every round: `step` takes C = N, client_id = arange(N)).
    public_data: D₀, a dict of `[P, ...]` arrays with "x" (and optionally "y", for `consensus_accuracy`).
    public_per_round: |X_k| ≤ P, public examples drawn (without replacement) for each round's consensus.
    digest_steps: steps of the digest optimizer per round (0: no public step, local training only).
    digest_batch_size: B of a digest step (≤ public_per_round); steps cycle through X_k.
    client_optimizer: the revisit optimizer on private data (S masked steps; fresh state each round).
    digest_optimizer: the digest optimizer (default: `client_optimizer`; fresh state each round).
    architecture_of: `[N]` ints, client k's architecture (default: all 0).
    digest_loss: "l1" or "kl" (module docstring).
    temperature: T > 0 of "kl".

  Returns:
    `FederatedAlgorithm(init, step)` with state `FedMDState`; `init(params, key)` takes one initial model
    (A = 1) or a tuple of A (one per architecture): every client of an architecture starts from its model.
  """
  losses = _as_tuple(loss_fn, "loss_fn")
  applies = _as_tuple(apply_fn, "apply_fn")
  if len(losses) != len(applies):
    raise ValueError(f"fedmd: loss_fn and apply_fn must give one function per architecture each; got "
                     f"{len(losses)} and {len(applies)}.")
  arch_count = len(losses)
  n = check_int(num_clients, "num_clients", 1)
  groups = _groups(architecture_of, n, arch_count)
  if not isinstance(public_data, dict) or "x" not in public_data:
    raise TypeError("fedmd: public_data must be a dict of [P, ...] arrays with key 'x' (and optionally 'y').")
  size = int(jnp.shape(public_data["x"])[0])
  public_per_round = check_int(public_per_round, "public_per_round", 1)
  if public_per_round > size:
    raise ValueError(f"fedmd: public_per_round = {public_per_round} exceeds the {size} public examples.")
  digest_steps = check_int(digest_steps, "digest_steps", 0)
  digest_batch_size = check_int(digest_batch_size, "digest_batch_size", 1)
  if digest_batch_size > public_per_round:
    raise ValueError(f"fedmd: digest_batch_size = {digest_batch_size} exceeds public_per_round = "
                     f"{public_per_round}.")
  check_optimizer(client_optimizer, "client_optimizer")
  digest_optimizer = client_optimizer if digest_optimizer is None else digest_optimizer
  check_optimizer(digest_optimizer, "digest_optimizer")
  check_choice(digest_loss, "digest_loss", DIGEST_LOSSES)
  check_positive(temperature, "temperature")
  mode = client_map_lib.FromPolicy()
  labelled = "y" in public_data
  per_batch = public_per_round // digest_batch_size * digest_batch_size  # whole digest batches of X_k

  def distance(scores, target):
    if digest_loss == "l1":
      return jnp.mean(jnp.abs(scores - target), axis=-1)
    t = jnp.asarray(temperature, scores.dtype)
    p = jax.nn.softmax(target / t, axis=-1)
    return t * t * jnp.sum(p * (jax.nn.log_softmax(target / t, axis=-1) - jax.nn.log_softmax(scores / t, axis=-1)),
                           axis=-1)

  def client_step(a: int):
    apply_a, loss_a = applies[a], losses[a]
    digest_fn = lambda params, batch: distance(apply_a(params, batch["x"]), batch["target"])  # noqa: E731

    def one(public, client):
      x_pub, target = public
      data, mask, params = client
      if digest_steps > 0:
        digest_data = {"x": x_pub[:per_batch].reshape((-1, digest_batch_size) + x_pub.shape[1:]),
                       "target": target[:per_batch].reshape((-1, digest_batch_size) + target.shape[1:])}
        digest_mask = jnp.ones(digest_data["target"].shape[:2], bool)
        digest_data, digest_mask = cycle_steps(digest_data, digest_mask, digest_steps)
        digested = local_train(digest_fn, digest_optimizer, params, digest_data, digest_mask)
        params = jax.tree.map(jnp.add, params, digested.delta)
        digest_value = digested.loss
      else:
        digest_value = jnp.zeros((), jnp.float32)
      revisit = local_train(loss_a, client_optimizer, params, data, mask)
      new = jax.tree.map(jnp.add, params, revisit.delta)
      return new, revisit.loss, revisit.num_examples, digest_value

    return one

  def scores_of(a: int, table, x_pub):
    """Each client's scores on the public batch: a forward pass per client, mapped as the clients' training is."""
    return client_map_lib.map_clients(mode, lambda x, params: applies[a](params, x), x_pub, table)

  def init(params: PyTree, key: jax.Array) -> FedMDState:
    check_key(key)
    starts = params if arch_count > 1 else (params,)
    if arch_count > 1 and (not isinstance(params, tuple) or len(params) != arch_count):
      raise TypeError(f"fedmd: init takes a tuple of {arch_count} initial models, one per architecture.")
    tables = tuple(jax.tree.map(lambda leaf, g=g: jnp.broadcast_to(leaf, (g.size,) + jnp.shape(leaf)), p)
                   for p, g in zip(starts, groups))
    local = tables[0] if arch_count == 1 else tables
    metrics = {"client_loss": jnp.zeros((), jnp.float32), "digest_loss": jnp.zeros((), jnp.float32),
               "consensus_accuracy": jnp.full((), -1.0, jnp.float32), "num_nonfinite": jnp.zeros((), jnp.int32),
               "num_clients": jnp.zeros((), jnp.int32), "bits_up": jnp.zeros((), jnp.float32),
               "bits_down": jnp.zeros((), jnp.float32)}
    first = jax.tree.map(lambda t: t[0], tables[int(np.argmax([0 in g for g in groups]))])
    return FedMDState(params=first, local_params=local, round=jnp.zeros((), jnp.int32), key=key, metrics=metrics)

  def step(state: FedMDState, batches: ClientBatches) -> FedMDState:
    check_full_participation(batches, n, ordered=True)
    key, pick_key = jax.random.split(state.key)
    tables = (state.local_params,) if arch_count == 1 else state.local_params
    if digest_steps > 0:
      pick = jax.random.choice(pick_key, size, (public_per_round,), replace=False)
      x_pub = jnp.take(jnp.asarray(public_data["x"]), pick, axis=0)
      scores = [scores_of(a, tables[a], x_pub) for a in range(arch_count)]  # [n_a, P_r, K]
      finite = [finite_clients(s)[0] for s in scores]
      total = sum(jnp.sum(zero_rows(f, s), axis=0) for s, f in zip(scores, finite))
      count = sum(jnp.sum(f) for f in finite)
      consensus = total / jnp.maximum(count, 1)
      score_bits = 32.0 * consensus.size  # |X_k| · K float32 scores, each way
      if labelled:
        y_pub = jnp.take(jnp.asarray(public_data["y"]), pick, axis=0)
        accuracy = jnp.mean(jnp.argmax(consensus, axis=-1) == y_pub).astype(jnp.float32)
      else:
        accuracy = jnp.full((), -1.0, jnp.float32)
    else:
      x_pub = jnp.zeros((0,) + tuple(jnp.shape(public_data["x"])[1:]), jnp.result_type(public_data["x"]))
      consensus = None
      finite = [jnp.ones((g.size,), bool) for g in groups]
      accuracy = jnp.full((), -1.0, jnp.float32)
      score_bits = 0.0
    new_tables, loss_sum, digest_sum, ok_count, bad = [], 0.0, 0.0, 0, 0
    for a, g in enumerate(groups):
      rows = jnp.asarray(g)
      data = jax.tree.map(lambda d, rows=rows: jnp.take(d, rows, axis=0), materialize(batches.data))
      mask = jnp.take(batches.mask, rows, axis=0)
      new, loss, _, digest_value = client_map_lib.map_clients(
          mode, client_step(a), (x_pub, consensus), (data, mask, tables[a]))
      ok, dropped = finite_clients(new, loss, digest_value, ok=finite[a])
      new_tables.append(keep_rows(ok, new, tables[a]))
      loss_sum = loss_sum + jnp.sum(jnp.where(ok, loss, 0.0))
      digest_sum = digest_sum + jnp.sum(jnp.where(ok, digest_value, 0.0))
      ok_count = ok_count + jnp.sum(ok)
      bad = bad + dropped
    metrics = {"client_loss": (loss_sum / jnp.maximum(ok_count, 1)).astype(jnp.float32),
               "digest_loss": (digest_sum / jnp.maximum(ok_count, 1)).astype(jnp.float32),
               "consensus_accuracy": accuracy, "num_nonfinite": jnp.asarray(bad, jnp.int32),
               "num_clients": jnp.asarray(ok_count, jnp.int32),
               "bits_up": jnp.full((), score_bits, jnp.float32), "bits_down": jnp.full((), score_bits, jnp.float32)}
    local = new_tables[0] if arch_count == 1 else tuple(new_tables)
    holder = int(np.argmax([0 in g for g in groups]))
    return FedMDState(params=jax.tree.map(lambda t: t[0], new_tables[holder]), local_params=local,
                      round=state.round + 1, key=key, metrics=metrics)

  return FederatedAlgorithm(init, step)


fedmd = execution.accepts_policy_keywords(fedmd, refuses_aggregator=(
    "FedMD's clients send class scores on the public data, not model updates, and its consensus is their "
    "plain mean over every architecture, taken in its own loop over the architectures"),
    evaluation="table", exchanges="metrics", hyperparameters={"public_per_round": execution.COUNT,
        "digest_steps": execution.COUNT, "digest_batch_size": execution.COUNT,
        "client_optimizer": execution.CLIENT_OPTIMIZER, "digest_optimizer": execution.CLIENT_OPTIMIZER,
        "temperature": execution.SCALE})
