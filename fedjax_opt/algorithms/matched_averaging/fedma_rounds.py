"""FedMA with communication rounds: local training, then layer-wise matching with retraining (host-driven).

Wang, Yurochkin, Sun, Papailiopoulos, Khazaeni. "Federated Learning with
Matched Averaging." ICLR 2020. arXiv:2002.06440. (FedMA: layer-wise matching,
each matching followed by local retraining of the layers above, Algorithm 1.)

One FedMA round: every client trains the whole model from its start, then
Algorithm 1 (`layerwise.py`) matches layer by layer, each matching followed
by the clients' retraining of the layers above it. A round is N
communications (one per layer).

Where a client starts (the authors' code, `reconstruct_local_net` in
IBM/FedMA's `main.py`, run before every round's local training). The global
model is cut back to the client: in each hidden layer the global units its
own units were matched to in the last matching, in its order (its last
assignment), and the next layer's input rows likewise (`neurons.select_units`).
A client therefore keeps its width (the width of the model `init` was given),
and the global layers, the union of what the clients' units matched, grow
and shrink with the matching instead of only growing. An assignment indexes
the global model of the round that made it, so it is used only in the next
round; a client without one (never sampled, not sampled last round, or left
out of the last matching) starts from the global units that the most clients
of the last matching used, as many as its width (ties: the lower index). The
authors' runs take every client every round, so there every client has one;
the choice here keeps one width for all clients (one compiled local training)
and starts a newcomer from the units most clients agree on.
`client_start="global"` gives every client the whole global model instead
(the layers then only grow, up to `max_width`).

Why host-driven. The matching runs on the host between layers (one small
Hungarian problem per layer) and the global layers grow, so neither the
round's control flow nor the model's shapes are static: FedMA is not a
`FederatedAlgorithm(init, step)` but a host-driven `(init, run)`. `fo.train`
runs it round by round on the host with the same sampling, keys, evaluation,
checkpoints and resume as any algorithm (`host_loop`, beside this module), and so does `fedjax-opt run --algorithms fedma` (the model
applied for any widths: `models.matchable`, exported as
`fo.algorithms.fedma_model`). Each local training in between is one jitted
program over the clients (`core.client_map`, compiled once per set of widths).
The price: a round returns to Python N times, and a model whose width changed
recompiles. A fixed maximum width with a mask of active units would keep the
shapes static, but the growth is decided by the Hungarian solutions of all the
layers below, so the host would be needed anyway.

The package docstring (`fedjax_opt.algorithms.matched_averaging`) shows a run.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.algorithms.matched_averaging.layerwise import match_layers
from fedjax_opt.algorithms.matched_averaging.matching import LayerPrior
from fedjax_opt.algorithms.matched_averaging.neurons import check_layers, select_units
from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import execution
from fedjax_opt.core.local import local_train
from fedjax_opt.core.server import finite_clients
from fedjax_opt.core.types import ClientBatches, LossFn, PyTree, materialize
from fedjax_opt.core.validation import check_client_batches, check_int, check_loss_fn, check_optimizer

__all__ = ["METRICS", "FedMAState", "MatchedAveraging", "fedma"]


METRICS = ("client_loss", "num_clients", "num_nonfinite", "communication_rounds", "uploaded_floats", "bits_up",
           "bits_down", "num_restarted")

CLIENT_STARTS = ("assigned", "global")


@flax.struct.dataclass
class FedMAState:
  """The state of FedMA.

  Attributes:
    params: the global model; its hidden widths grow as matching opens new neurons.
    round: FedMA rounds done (each is N communication rounds, one per layer).
    key: PRNG key (seeds BBP-MAP's refinement order, folded with the round).
    metrics: `client_loss` (mean client loss of the round's first local training),
      `num_clients` (clients matched), `num_nonfinite` (clients left out: a
      non-finite model after training), `communication_rounds` (N: one
      upload and broadcast per layer), `uploaded_floats` (Σ over the layers
      and the matched clients of the layer's parameter count), `bits_up`
      (32 · uploaded_floats / matched clients: float32 bits per client),
      `bits_down` (32 · the new global model's parameter count: each global
      layer is broadcast once, as it is matched; a client cuts its next
      start out of those layers with its own assignment, so the restart
      downloads nothing more), `widths` (`[N − 1]`
      global hidden widths), `num_restarted` (clients that started from
      their own last assignment).
    assignments: `{hidden layer: [num_clients, L_n] int32}`: each client's
      last assignment, the global index of each of its L_n units (L_n: the
      layer's width in the params given to `init`); −1 before its first.
    assigned_round: `[num_clients] int32`: the round whose global model a
      client's assignment indexes (−1: none); it is used while that is
      `round`, i.e. the client took part in the last matching.
  """

  params: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]
  assignments: dict[str, jax.Array]
  assigned_round: jax.Array


class MatchedAveraging(NamedTuple):
  """FedMA as host-driven functions (not a `FederatedAlgorithm`: see the module docstring).

  Attributes:
    init: `init(params, key) -> FedMAState`.
    run: `run(state, batches) -> state`: one FedMA round (N communications):
      every client trains the whole model from its start (the module
      docstring) on its batches, then `match`.
    match: `match(client_params, batches, seed=0) -> (params, info)`:
      Algorithm 1 on given client models (leaves `[J, ...]`, one row per
      client of `batches`; they may start from different initializations):
      for each layer n < N, match, broadcast, retrain layers n+1 … N on the
      batches with layers 1 … n frozen; then the class-weighted classifier.
      `info["assignments"]`: per hidden layer, per row of `batches`, the
      row's units' global indices (None for a row left out).
  """

  init: Callable[[PyTree, jax.Array], FedMAState]
  run: Callable[[FedMAState, ClientBatches], FedMAState]
  match: Callable[..., tuple[PyTree, dict]]


def _stack(params: list[dict]) -> PyTree:
  return jax.tree.map(lambda *a: jnp.stack([jnp.asarray(x) for x in a]), *params)


def _unstack(params: PyTree, num: int) -> list[dict]:
  host = jax.tree.map(np.asarray, params)
  return [jax.tree.map(lambda a, k=k: a[k], host) for k in range(num)]


def _popular_units(table: np.ndarray, valid: np.ndarray, width: int, keep: int) -> np.ndarray:
  """The `keep` global units of `width` used by the most clients of `valid` rows of `table` (ties: lower index)."""
  used = table[valid].reshape(-1)
  counts = np.bincount(used[used >= 0], minlength=width)[:width]
  return np.sort(np.argsort(-counts, kind="stable")[:keep])


def _class_counts(data: PyTree, mask: np.ndarray, num_classes: int) -> np.ndarray | None:
  """n_jk from the round's labels `data["y"]` `[J, S, B]` (real slots; a slot drawn twice counts twice)."""
  if not isinstance(data, dict) or "y" not in data:
    return None
  y = np.asarray(data["y"])
  if y.shape != mask.shape or not np.issubdtype(y.dtype, np.integer):
    return None
  return np.stack([np.bincount(y[j][mask[j]], minlength=num_classes)[:num_classes] for j in range(y.shape[0])])


def fedma(
    loss_fn: LossFn,
    *,
    layers: Sequence[str],
    client_optimizer: optax.GradientTransformation,
    num_clients: int,
    sigma: Any = 1.0,
    sigma0: Any = 1.0,
    gamma: Any = 1.0,
    mu0: Any = 0.0,
    iterations: int = 3,
    max_width: Any = None,
    max_growth: float | None = 2.0,
    prior_scale: str = "layer",
    client_start: str = "assigned",
    class_weighted: bool = True,
) -> MatchedAveraging:
  """Federated Matched Averaging (FedMA, Algorithm 1), with communication rounds.

  One round: each client trains all layers from its start, the global model
  cut back to the units it was last matched to (the module docstring; S
  masked local steps of `client_optimizer` over its batches), then for
  n = 1 … N−1:

      {Π_j} = BBP-MAP({W_{j,n}})                       match layer n (host, Hungarian)
      W_n = mean of the matched neurons                  the global layer n, broadcast
      W_{j,n+1} ← Π_j W_{j,n+1}                          move the next layer's inputs
      train {W_{j,n+1}, …, W_{j,N}} with W_1 … W_n frozen  (the same S steps, jitted over clients)

  and last W_N[:, k] = Σ_j p_jk W_{j,N}[:, k] (p_jk: client j's share of
  class k in the round's labels `batches.data["y"]`; the n_j weights when the
  data has no integer "y"). A round is N communications, each uploading one
  layer per client, so its upload equals one FedAvg round's.

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`, for any hidden
      widths (flax modules check their shapes: use `mlp_apply` /
      `emnist_cnn_apply` with `fo.models.classification_loss`).
    layers: the layer names in forward order, the last one the classifier.
    client_optimizer: ClientOpt, any optax optimizer, fresh for every local training.
    num_clients: N, the clients `batches.client_id` indexes (each keeps its last assignment).
    sigma: σ (std of a client neuron around its global neuron).
    sigma0: σ₀ (prior std of a global neuron; `math.inf`: flat prior).
    gamma: γ₀ (Beta-Bernoulli mass: the propensity to open new neurons).
    mu0: μ₀ (prior mean).
    iterations: BBP-MAP refinement passes per layer.
    max_width: None, or a cap on each global layer's width (BBP-MAP opens at most that many units; the
      authors' code caps every layer at 700).
      Each of sigma, sigma0, gamma, mu0, max_width: one value for every hidden layer or a sequence of one per
      hidden layer.
    max_growth: None, or a cap on each global layer's width relative to the clients' width in that layer
      (the width of the models matched: in `run`, the width of the params given to `init`); the cap is
      `int(max_growth · L_j)`, and the smaller one applies when `max_width` is set too. With the default 2.0 a
      layer is at most twice as wide as the clients' (the upload grows with the widths below each layer).
    prior_scale: "layer" (default): σ, σ₀, μ₀ in units of each layer's root-mean-square unit coordinate,
      measured on the clients' units as they are matched (`LayerPrior`), so σ = σ₀ = 1 means the same in every
      layer and at every weight scale; "absolute": as given (the authors' code, σ = σ₀ = 1 for every layer).
    client_start: "assigned" (default, the authors' code): each client restarts from the global model cut back
      to its last assignment, at its own width; "global": every client starts from the whole global model
      (the layers only grow).

  Returns:
    `MatchedAveraging(init, run, match)`; state `FedMAState`.
  """
  check_loss_fn(loss_fn)
  check_optimizer(client_optimizer, "client_optimizer")
  check_int(iterations, "iterations", 0)
  check_int(num_clients, "num_clients")
  if client_start not in CLIENT_STARTS:
    raise ValueError(f"client_start must be one of {CLIENT_STARTS}; got {client_start!r}.")
  layers = tuple(layers)
  prior = LayerPrior.make(len(layers) - 1, sigma=sigma, sigma0=sigma0, gamma=gamma, mu0=mu0, max_width=max_width,
                          max_growth=max_growth, iterations=iterations, scale=prior_scale)

  @functools.partial(jax.jit, static_argnames="first")
  def train(params, data, mask, first):
    """Every client trains layers[first:] from its own params; leaves `[J, ...]`."""
    labels = {name: jax.tree.map(lambda _, n=n: "train" if n >= first else "frozen", params[name])
              for n, name in enumerate(layers)}
    optimizer = optax.multi_transform({"train": client_optimizer, "frozen": optax.set_to_zero()}, labels)

    def one(_, inputs):
      p, d, m = inputs
      result = local_train(loss_fn, optimizer, p, d, m)
      return jax.tree.map(jnp.add, p, result.delta), result.loss

    return client_map_lib.map_clients(client_map_lib.FromPolicy(), one, None, (params, data, mask))

  def init(params: PyTree, key: jax.Array) -> FedMAState:
    check_layers(params, layers)
    metrics = {name: jnp.zeros((), jnp.float32) for name in METRICS}
    widths = [np.shape(params[n]["bias"])[0] for n in layers[:-1]]
    metrics["widths"] = jnp.asarray(widths, jnp.int32)
    return FedMAState(params=params, round=jnp.zeros((), jnp.int32), key=key, metrics=metrics,
                      assignments={n: jnp.full((num_clients, w), -1, jnp.int32) for n, w in zip(layers, widths)},
                      assigned_round=jnp.full((num_clients,), -1, jnp.int32))

  def starts(state: FedMAState, batches: ClientBatches) -> tuple[PyTree, int]:
    """Each row's start (leaves `[C, ...]`) and how many rows restart from their own last assignment."""
    num = batches.num_clients
    if client_start == "global":
      return jax.tree.map(lambda a: jnp.broadcast_to(a, (num,) + jnp.shape(a)), state.params), 0
    ids = np.asarray(batches.client_id)
    real = np.asarray(batches.weight) > 0
    if np.any(real & ((ids < 0) | (ids >= num_clients))):
      raise ValueError(f"batches.client_id must index the num_clients = {num_clients} clients; got "
                       f"{ids[real].min()} … {ids[real].max()}.")
    hidden = layers[:-1]
    tables = {n: np.asarray(state.assignments[n]) for n in hidden}
    current = np.asarray(state.assigned_round) == int(state.round)  # assignments into state.params
    global_widths = [np.shape(state.params[n]["bias"])[0] for n in hidden]
    popular = [_popular_units(tables[n], current, w, tables[n].shape[1]) for n, w in zip(hidden, global_widths)]
    host = jax.tree.map(np.asarray, state.params)
    rows, restarted = [], 0
    for k in range(num):
      own = real[k] and 0 <= ids[k] < num_clients and current[ids[k]]
      restarted += int(own)
      rows.append(select_units(host, layers, [tables[n][ids[k]] for n in hidden] if own else popular))
    return _stack(rows), restarted

  def match(client_params: PyTree, batches: ClientBatches, seed: int = 0) -> tuple[PyTree, dict]:
    check_client_batches(batches)
    data, mask = materialize(batches.data), np.asarray(batches.mask)
    num = batches.num_clients
    if any(np.shape(leaf)[0] != num for leaf in jax.tree.leaves(client_params)):
      raise ValueError(f"client_params must have a leading axis of the C = {num} clients of batches; got "
                       f"{jax.tree.map(np.shape, client_params)}.")
    taking_part = np.asarray(batches.weight) > 0
    finite, dropped = finite_clients(jax.tree.map(np.asarray, client_params), taking_part=taking_part)
    keep = taking_part & np.asarray(finite)
    num_nonfinite = int(dropped)
    if not keep.any():
      return None, {"num_clients": 0, "num_nonfinite": num_nonfinite}
    rows = np.flatnonzero(keep)
    data = jax.tree.map(lambda a: jnp.asarray(a)[rows], data)
    mask_kept = jnp.asarray(mask[rows])

    def retrain(params_list, first, alive):
      subset = jax.tree.map(lambda a: a[alive], data)
      trained, _ = train(_stack(params_list), subset, mask_kept[alive], first)
      return _unstack(trained, len(params_list))

    clients = _unstack(jax.tree.map(lambda a: np.asarray(a)[rows], client_params), len(rows))
    check_layers(clients[0], layers)
    num_classes = np.shape(clients[0][layers[-1]]["bias"])[0]
    counts = _class_counts(data, mask[rows], num_classes) if class_weighted else None
    result = match_layers(clients, layers, np.asarray(batches.weight)[rows], counts, retrain, seed, prior)
    assignments = []
    for per_client in result.assignments:  # back to the rows of `batches`
      by_row: list[np.ndarray | None] = [None] * num
      for row, a in zip(rows, per_client):
        by_row[row] = a
      assignments.append(by_row)
    return result.params, {"num_clients": len(rows) - result.diverged,
                           "num_nonfinite": num_nonfinite + result.diverged, "widths": result.widths,
                           "uploaded_floats": result.uploaded, "uploaders": len(rows), "assignments": assignments}

  def run(state: FedMAState, batches: ClientBatches) -> FedMAState:
    check_client_batches(batches)
    start, restarted = starts(state, batches)
    trained, losses = train(start, materialize(batches.data), batches.mask, 0)
    weight = np.asarray(batches.weight)
    losses = np.asarray(losses)
    ok = (weight > 0) & np.isfinite(losses)
    seed = int(jax.random.randint(jax.random.fold_in(state.key, state.round), (), 0, 2**31 - 1))
    params, info = match(trained, batches, seed=seed)
    metrics = dict(state.metrics)
    metrics.update(num_nonfinite=jnp.float32(info["num_nonfinite"]), num_clients=jnp.float32(info["num_clients"]),
                   num_restarted=jnp.float32(restarted))
    assigned_round = np.array(state.assigned_round)
    if params is None:  # no finite client: the round is rejected, the model kept, and so are the assignments into it
      assigned_round = np.where(assigned_round == int(state.round), int(state.round) + 1, assigned_round)
      return state.replace(round=state.round + 1, metrics=metrics,
                           assigned_round=jnp.asarray(assigned_round, jnp.int32))
    tables = {n: np.array(a) for n, a in state.assignments.items()}
    if client_start == "assigned":
      ids = np.asarray(batches.client_id)
      for k in range(batches.num_clients):
        mine = [info["assignments"][n][k] for n in range(len(layers) - 1)]
        if all(a is not None for a in mine):  # matched in every layer: its next start
          for name, a in zip(layers, mine):
            tables[name][ids[k]] = a
          assigned_round[ids[k]] = int(state.round) + 1
    metrics.update(
        client_loss=jnp.float32(np.sum(losses[ok] * weight[ok]) / max(np.sum(weight[ok]), 1e-30)),
        communication_rounds=jnp.float32(len(layers)), uploaded_floats=jnp.float32(info["uploaded_floats"]),
        bits_up=jnp.float32(32 * info["uploaded_floats"] / info["uploaders"]),
        bits_down=jnp.float32(32 * sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))),
        widths=jnp.asarray(info["widths"], jnp.int32))
    return state.replace(params=params, round=state.round + 1, metrics=metrics,
                         assignments={n: jnp.asarray(a, jnp.int32) for n, a in tables.items()},
                         assigned_round=jnp.asarray(assigned_round, jnp.int32))

  return MatchedAveraging(init=init, run=run, match=match)


fedma = execution.accepts_policy_keywords(fedma, refuses_aggregator=(
    "FedMA matches the clients' neurons layer by layer (a BBP-MAP assignment) and averages matched neurons, "
    "not stacked updates a rule could combine"),
    evaluation="global", exchanges="metrics", hyperparameters={"client_optimizer": execution.CLIENT_OPTIMIZER,
        "sigma": execution.SCALE, "sigma0": execution.PRIOR, "gamma": execution.PRIOR, "mu0": execution.PRIOR,
        "iterations": execution.COUNT, "max_width": execution.COUNT, "max_growth": execution.THRESHOLD})
