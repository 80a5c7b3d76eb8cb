"""Vectorised sweeps: one compiled program runs an algorithm over a batch of seeds and hyper-parameters.

`init` and `step` are pure functions of arrays, and the factories accept
hyper-parameters that may be traced (a client learning rate, a server
learning rate, FedProx's μ ...). So `jax.vmap` over a batch of K settings
turns K runs into one program, compiled once, whose arrays carry a leading
sweep axis `[K, ...]`:

    swept = fo.sweep.vmap_algorithm(
        lambda client_lr, server_lr: fo.algorithms.fedavg(
            loss_fn, client_optimizer=optax.sgd(client_lr),
            server_optimizer=fo.server_optimizers.fedadam(server_lr)),
        fo.sweep.grid(client_lr=[0.01, 0.03, 0.1], server_lr=[1e-3, 1e-2]))     # K = 6
    state = swept.init(params, jax.random.key(0))          # leaves [6, ...]
    state = jax.jit(swept.step)(state, batches)            # same batches for all 6
    state, history = fo.train(swept, state, dataset, 100, sampling, seed=0)   # history [6, R]

Seeds: `fo.sweep.seeds(algorithm, K)` (no hyper-parameter) with per-member
initial models (`init(stacked_params, keys, params_axis=0)`) and, in
`fo.train`, one data seed per member (`seed=[0, 1, ...]`), equals K separate
runs. With one data seed, every member sees the same client samples and
mini-batches (common random numbers: differences between members are then
due to the hyper-parameters alone).

How the work is laid out: `jax.vmap` adds the sweep axis to every array of
the round, so the K members' clients are batched together (a vmapped
client map over C clients runs K·C client computations in one batched op).
The client map's `auto` mode sees one member's shapes, so its memory budget
is per member; with large K pass `client_map=fo.client_map.chunked(k)`.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm

__all__ = ["SweptAlgorithm", "grid", "member", "seeds", "stack", "vmap_algorithm"]

PyTree = Any


class SweptAlgorithm(NamedTuple):
  """K runs of one algorithm as one: state leaves carry a leading `[K]` sweep axis.

  Attributes:
    init: `init(params, key, params_axis=None) -> state [K, ...]`. `key` is
      one PRNG key (split into K) or K keys `[K]`; `params` is one model for
      all members (`params_axis=None`) or K models stacked on `params_axis`.
    step: `step(state [K, ...], batches) -> state [K, ...]`. `batches` is one
      `ClientBatches` shared by all members (mask `[C, S, B]`) or one per
      member stacked on a leading axis (mask `[K, C, S, B]`).
    size: K.
    hyper_params: `{name: [K] array}`, member k's keyword arguments to the factory.
  """

  init: Callable[..., Any]
  step: Callable[[Any, ClientBatches], Any]
  size: int
  hyper_params: dict[str, jax.Array]


def grid(**axes: Sequence[Any]) -> dict[str, np.ndarray]:
  """The Cartesian product of hyper-parameter values, flattened to `{name: [K]}` (last name varies fastest).

  `grid(client_lr=[0.01, 0.1], server_lr=[1.0, 0.5, 0.1])` has K = 6.
  """
  if not axes:
    raise ValueError("grid needs at least one hyper-parameter, e.g. grid(client_lr=[0.01, 0.1]).")
  for name, values in axes.items():
    if np.ndim(values) != 1 or len(values) == 0:
      raise ValueError(f"grid: {name} must be a non-empty 1-D sequence of values; got {values!r}.")
  names = list(axes)
  points = list(itertools.product(*(list(axes[n]) for n in names)))
  return {n: np.asarray([p[i] for p in points]) for i, n in enumerate(names)}


def _check_hyper_params(hyper_params: Mapping[str, Any] | None, size: int | None) -> tuple[dict[str, jax.Array], int]:
  hyper_params = dict(hyper_params or {})
  sizes = {}
  for name, values in hyper_params.items():
    if not isinstance(name, str):
      raise TypeError(f"hyper_params keys must be the factory's keyword names (str); got {name!r}.")
    if np.ndim(values) < 1:
      raise ValueError(f"hyper_params[{name!r}] must have a leading sweep axis [K]; got a scalar {values!r}.")
    sizes[name] = np.shape(values)[0]
  if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
    raise ValueError(f"size must be a positive int; got {size!r}.")
  found = set(sizes.values()) | ({size} if size is not None else set())
  if len(found) != 1:
    detail = f"sizes {sizes}" + (f" and size={size}" if size is not None else "")
    raise ValueError(f"every hyper-parameter must have the same leading sweep size K; got {detail}." if found else
                     "give hyper_params with a leading [K] axis, or size=K for a sweep over seeds only.")
  return {k: jnp.asarray(v) for k, v in hyper_params.items()}, found.pop()


def _member_keys(key: jax.Array, size: int) -> jax.Array:
  """K keys from one key (split) or K keys given (checked)."""
  typed = jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key)
  single_ndim = 0 if typed else 1
  if jnp.ndim(key) == single_ndim:
    return jax.random.split(key, size)
  if jnp.ndim(key) == single_ndim + 1 and jnp.shape(key)[0] == size:
    return key
  raise ValueError(f"key must be one PRNG key or K={size} keys stacked on a leading axis; got shape "
                   f"{tuple(jnp.shape(key))}.")


def vmap_algorithm(make_algorithm: Callable[..., FederatedAlgorithm], hyper_params: Mapping[str, Any] | None = None,
                   *, size: int | None = None) -> SweptAlgorithm:
  """K copies of `make_algorithm(**hyper_params[k])` run as one vmapped algorithm.

  Args:
    make_algorithm: a factory `make_algorithm(**kwargs) -> FederatedAlgorithm`
      whose keyword arguments may be traced scalars (every factory of
      `fedjax_opt.algorithms` accepts traced learning rates and μ's).
    hyper_params: `{name: [K] values}`, e.g. from `grid(...)`; None or {} for
      a sweep over seeds only (then give `size`).
    size: K, required without hyper-parameters; checked against them otherwise.

  Returns:
    A `SweptAlgorithm`; `fo.train` accepts it (history with a leading [K] axis).
  """
  if not callable(make_algorithm):
    raise TypeError(f"make_algorithm must be a callable returning a FederatedAlgorithm; got "
                    f"{type(make_algorithm).__name__}.")
  hyper_params, k = _check_hyper_params(hyper_params, size)

  def member(hp: Mapping[str, jax.Array]) -> FederatedAlgorithm:
    algorithm = make_algorithm(**hp)
    if not isinstance(algorithm, FederatedAlgorithm):
      raise TypeError(f"make_algorithm must return a fedjax_opt.FederatedAlgorithm; got {type(algorithm).__name__}.")
    return algorithm

  def init(params: PyTree, key: jax.Array, params_axis: int | None = None) -> PyTree:
    keys = _member_keys(key, k)
    if params_axis is not None:
      sizes = {jnp.shape(x)[params_axis] for x in jax.tree.leaves(params)}
      if sizes != {k}:
        raise ValueError(f"params stacked on axis {params_axis} must have K={k} members; got sizes {sizes}.")
    return jax.vmap(lambda hp, p, kk: member(hp).init(p, kk), in_axes=(0, params_axis, 0))(hyper_params, params, keys)

  def step(state: PyTree, batches: ClientBatches) -> PyTree:
    if not isinstance(batches, ClientBatches):
      raise TypeError(f"batches must be a fedjax_opt.ClientBatches; got {type(batches).__name__}.")
    rank = jnp.ndim(batches.mask)
    if rank not in (3, 4):
      raise ValueError(f"batches.mask must be [C, S, B] (shared by all members) or [K, C, S, B] (one per member); "
                       f"got shape {tuple(jnp.shape(batches.mask))}.")
    if rank == 4 and jnp.shape(batches.mask)[0] != k:
      raise ValueError(f"per-member batches must have K={k} members on their leading axis; got "
                       f"{jnp.shape(batches.mask)[0]}.")
    batch_axis = 0 if rank == 4 else None
    return jax.vmap(lambda hp, s, b: member(hp).step(s, b), in_axes=(0, 0, batch_axis))(hyper_params, state, batches)

  return SweptAlgorithm(init=init, step=step, size=k, hyper_params=hyper_params)


def seeds(algorithm: FederatedAlgorithm, size: int) -> SweptAlgorithm:
  """K runs of `algorithm` that differ only in their keys, initial models and data seeds."""
  if not isinstance(algorithm, FederatedAlgorithm):
    raise TypeError(f"algorithm must be a fedjax_opt.FederatedAlgorithm; got {type(algorithm).__name__}.")
  return vmap_algorithm(lambda: algorithm, size=size)


def member(tree: PyTree, k: int) -> PyTree:
  """Member k of a swept pytree (state, params, metrics): every leaf indexed `[k]`."""
  return jax.tree.map(lambda x: x[k], tree)


def stack(trees: Sequence[PyTree]) -> PyTree:
  """K pytrees of one structure stacked on a new leading sweep axis (e.g. K initial models)."""
  trees = list(trees)
  if not trees:
    raise ValueError("stack needs at least one pytree.")
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
