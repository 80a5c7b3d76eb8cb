"""Objectives that personalized algorithms minimise, for monitoring and for tests.

The mixture of global and local models (Hanzely & Richtárik, "Federated
Learning of a Mixture of Global and Local Models", arXiv:2002.05516, 2020):

    F(x) = (1/n) Σ_i f_i(x_i) + λ ψ(x),     ψ(x) = (1/(2n)) Σ_i ‖x_i − x̄‖²,     x̄ = (1/n) Σ_i x_i,

over the n personalized models x = (x_1, …, x_n), stacked as a per-client
table (every leaf `[n, ...]`). f_i is client i's mean loss over its real
(unmasked) examples.

The pooled empirical risk, the objective of FedAvg's example-weighted
aggregation and of the ADMM family with `objective="examples"`:

    F(θ) = Σ_i n_i f_i(θ) / n = (1/n) Σ_i Σ_{j ≤ n_i} ℓ(θ; ξ_ij),     n = Σ_i n_i.

`minimize` solves either centrally in float64 (scipy's L-BFGS-B), the
reference the command line reports objective gaps against.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_opt.core import client_map as client_map_lib
from fedjax_opt.core import per_client
from fedjax_opt.core.local import as_single_step, masked_mean_loss
from fedjax_opt.core.types import ClientBatches, LossFn, PyTree, materialize
from fedjax_opt.core.validation import (
  check_client_batches,
  check_loss_fn,
  check_positive,
)

__all__ = ["average", "consensus_penalty", "minimize", "mixture", "pooled"]


def average(local_params: PyTree) -> PyTree:
  """x̄ = (1/n) Σ_i x_i: the mean over the leading `[n]` axis of every leaf."""
  return jax.tree.map(lambda t: jnp.mean(t, axis=0), local_params)


def consensus_penalty(local_params: PyTree) -> jax.Array:
  """ψ(x) = (1/(2n)) Σ_i ‖x_i − x̄‖² for a table with leaves `[n, ...]` (a scalar)."""
  x_bar = average(local_params)
  n = per_client.num_rows(local_params)
  squares = [jnp.sum(jnp.square(t - m)) for t, m in zip(jax.tree.leaves(local_params), jax.tree.leaves(x_bar))]
  return sum(squares) / (2 * n)


def mixture(loss_fn: LossFn, lam: Any, *,
            client_map: client_map_lib.ClientMap | str | None = None) -> Callable[[PyTree, ClientBatches], jax.Array]:
  """The mixture objective F(x) = (1/n) Σ_i f_i(x_i) + λ/(2n) Σ_i ‖x_i − x̄‖².

  Args:
    loss_fn: per-example loss `loss_fn(params, batch) -> [B]`.
    lam: λ ≥ 0, the strength of the pull towards the average (may be traced).
    client_map: how the clients' losses are mapped (see `core.client_map`).

  Returns:
    `objective(local_params, batches) -> scalar`, where `local_params` is the
    table of personalized models (leaves `[n, ...]`, row i = x_i) and
    `batches` holds every client's full data (`C = n`; row c of the batch is
    client `batches.client_id[c]`). f_i is the masked mean loss over all the
    S·B example slots of client i; the clients are weighted uniformly (1/n),
    as in the paper, whatever `batches.weight` says.
  """
  check_loss_fn(loss_fn)
  check_positive(lam, "lam", allow_zero=True)
  mode = client_map_lib.resolve(client_map)

  def client_loss(_, client):
    x, data, mask = client
    folded, folded_mask = as_single_step(data, mask)
    loss, _ = masked_mean_loss(loss_fn, x, jax.tree.map(lambda a: a[0], folded), folded_mask[0])
    return loss

  def objective(local_params: PyTree, batches: ClientBatches) -> jax.Array:
    check_client_batches(batches)
    n = per_client.num_rows(local_params)
    if batches.num_clients != n:
      raise ValueError(f"batches must hold every client's data: C = num_clients = {n}; got C = {batches.num_clients}.")
    x = per_client.gather(local_params, batches.client_id)
    losses = client_map_lib.map_clients(mode, client_loss, None, (x, materialize(batches.data), batches.mask))
    return jnp.mean(losses) + lam * consensus_penalty(local_params)

  return objective


def pooled(loss_fn: LossFn) -> Callable[[PyTree, ClientBatches], jax.Array]:
  """The pooled empirical risk F(θ) = Σ_i Σ_j mask_ij ℓ(θ; ξ_ij) / Σ_i Σ_j mask_ij of one model θ.

  Returns `objective(params, batches) -> scalar`: the mean loss over every real
  example slot of `batches` (every client's full data, e.g.
  `fedjax_opt.data.client_batches(dataset, dataset.max_train, split="train")`),
  each example counting once, whatever `batches.weight` says.
  """
  check_loss_fn(loss_fn)

  def objective(params: PyTree, batches: ClientBatches) -> jax.Array:
    check_client_batches(batches)
    data = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[3:]), materialize(batches.data))  # [C·S·B, ...]
    mask = batches.mask.reshape(-1)
    losses = loss_fn(params, data)
    return jnp.sum(jnp.where(mask, losses, 0)) / jnp.maximum(jnp.sum(mask), 1)

  return objective


def minimize(objective: Callable[[PyTree, Any], jax.Array], params: PyTree, data: Any, *,
             max_iterations: int = 5000, tolerance: float = 1e-10) -> tuple[PyTree, float]:
  """(argmin, min) of `objective(params, data)` by L-BFGS-B in float64, from `params`.

  A centralized reference solver for small convex problems (logistic or
  least-squares regression, the mixture objective of such models). The
  objective is evaluated and differentiated by JAX with 64-bit floats enabled
  for the solve only; floating-point leaves of `params` and `data` are cast to
  float64. Needs scipy.

  Args:
    objective: `objective(params, data) -> scalar`, e.g. `pooled(loss_fn)` or `mixture(loss_fn, lam)`.
    params: the starting point; its structure is kept.
    data: the objective's data (e.g. `ClientBatches` of every client's train split).
    max_iterations: L-BFGS-B iterations at most.
    tolerance: gradient-norm tolerance (`gtol`).

  Returns:
    (the minimiser, in `params`' dtypes; the minimum as a Python float).
  """
  import jax.flatten_util  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import scipy.optimize  # pylint: disable=g-import-not-at-top

  def to64(a):
    a = np.asarray(a)
    return a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a

  with jax.enable_x64(True):
    start = jax.tree.map(to64, params)
    data64 = jax.tree.map(to64, data)
    flat, unravel = jax.flatten_util.ravel_pytree(start)
    value_and_grad = jax.jit(jax.value_and_grad(lambda v: objective(unravel(v), data64)))

    def fun(v):
      value, grad = value_and_grad(jnp.asarray(v))
      return float(value), np.asarray(grad, np.float64)

    result = scipy.optimize.minimize(fun, np.asarray(flat, np.float64), jac=True, method="L-BFGS-B",
                                     options=dict(maxiter=max_iterations, maxcor=20, gtol=tolerance, ftol=1e-15))
    solution = unravel(jnp.asarray(result.x))
  solution = jax.tree.map(lambda s, p: np.asarray(s).astype(np.asarray(p).dtype), solution, params)
  return solution, float(result.fun)
