"""Client-level differential privacy at the aggregator seam: DP-FedAvg's clipped, noised mean.

McMahan, Ramage, Talwar, Zhang: "Learning Differentially Private Recurrent
Language Models" (ICLR 2018, arXiv:1710.06963), with the adaptive clip norm
of Andrew, Thakkar, McMahan, Ramaswamy: "Differentially Private Learning with
Adaptive Clipping" (NeurIPS 2021, arXiv:1905.03871).

`dp_mean(clip_norm, noise_multiplier, expected_clients=m)` is an
`Aggregator`; in a round with client updates Δ_k and weights w_k:

    part_k = 1[w_k > 0]                                  (a client takes part or not; its n_k is not used)
    Δ̃_k    = Δ_k · min(1, C / ‖Δ_k‖₂)                     (‖·‖₂ over the whole pytree)
    Δ      = (Σ_k part_k Δ̃_k + N(0, (σ_Δ C)² I)) / m

* Uniform weights. Every participating client counts once, whatever its
  number of examples, as in DP-FedAvg's "flat" estimator: with n_k weights a
  client's influence on the sum would be n_k C, unbounded by C. Zero-weight
  clients (padding, and those the round's rules exclude: docs/architecture.md,
  "The round") contribute nothing and are not counted.
* Fixed denominator. m is the *expected* number of clients, public and the
  same in every round: C for fixed-size sampling, qN for Poisson sampling
  with probability q (McMahan et al.'s fixed-denominator estimator). Dividing
  by the realised count would make the denominator itself data-dependent.
* The noise comes from the round's aggregator key (`FederatedAlgorithm.step`
  splits `state.key` every round), drawn inside jit: the same key gives the
  same noise, the next round a fresh draw. A round in which no client took
  part still releases its noise (`Aggregator.always_releases`).
* Adaptive clipping (`adaptive=AdaptiveClipping(γ, η_C, σ_b)`): the clip norm
  C_t lives in the state. With each client's bit b_k = 1[‖Δ_k‖ ≤ C_t],

      b̄       = (Σ_k part_k (b_k − ½) + N(0, σ_b²)) / m + ½
      C_{t+1} = C_t · exp(−η_C (b̄ − γ))

  (the geometric update of Andrew et al.; b̄ estimates the fraction of
  clients whose update was not clipped, so C_t tracks the γ-quantile of the
  update norms). The bits are centred (b_k − ½) so that the sum has
  sensitivity ½ under adding or removing a client, as in the paper's
  analysis; with exactly m clients it equals (Σ b_k + N(0, σ_b²)) / m. The
  noise of the update is raised to σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) so that the
  pair (update, count) costs exactly what one Gaussian mechanism with noise
  multiplier σ does (their Theorem 1): give the accountant σ.

The state (`DPMeanState`) exposes the clip norm used in the last round and the
noisy fraction b̄ (NaN without adaptive clipping) for metrics.

Composition along the seam (docs/architecture.md: compression → clipping and DP noise →
secure summation → aggregation → server optimizer): `dp_mean` is a sum of
per-client terms plus one noise draw (`streaming`: `StreamingSum.term`
clips and counts one client, `finalize` adds the noise and divides). A
compression stage goes before it, on the clients: it changes the Δ_k that are
clipped, and clipping after decompression keeps the sensitivity at C. A
secure-summation stage replaces the plain Σ_k of the terms (what the server
learns is then only the sum, not each Δ̃_k); the noise is added once, after
the sum, by `finalize` — or split across clients (distributed noise) by a
secure-sum stage that owns it (`fo.privacy.secure_aggregation` reads C_t
from this state every round and refines its fixed-point grid as C_t shrinks,
so that a small adaptive clip norm is not rounded away: its module
docstring, "DP through the ring"). The server optimizer then sees only the
noised mean, so it is post-processing and costs no privacy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.server import check_stacked_updates
from fedjax_opt.core.types import Aggregator, NoisedState, PyTree, StreamingSum, Traits
from fedjax_opt.core.validation import is_concrete

__all__ = ["AdaptiveClipping", "DPMeanState", "clip_by_global_norm", "dp_mean", "update_noise_multiplier"]


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
  """Quantile-tracking clip norm (Andrew, Thakkar, McMahan, Ramaswamy 2021, arXiv:1905.03871).

  Attributes:
    target_quantile: γ ∈ (0, 1), the fraction of clients whose update should
      be left unclipped (the paper uses 0.5).
    learning_rate: η_C > 0 of the geometric update C ← C·exp(−η_C (b̄ − γ)) (the paper: 0.2).
    count_noise_multiplier: σ_b > 0, the standard deviation of the noise on
      the count of unclipped clients. None: max(m / 20, 2σ) for m expected
      clients and update noise multiplier σ (the paper's m/20, raised where
      needed so that the update noise σ_Δ stays within 4% of σ).
  """

  target_quantile: float = 0.5
  learning_rate: float = 0.2
  count_noise_multiplier: float | None = None


@flax.struct.dataclass
class DPMeanState(NoisedState):
  """State of `dp_mean`.

  Attributes:
    clip_norm: C_t, float32: the clip norm of the next round (constant
      without adaptive clipping).
    last_clip_norm: the clip norm the last round used (C_{t−1}).
    noisy_fraction: b̄ of the last round, the noisy fraction of clients
      whose update norm was ≤ the clip norm (NaN without adaptive clipping,
      and before the first round).
    noise_multiplier: σ as given to `dp_mean`, float32 (the value the
      accountant is given; constant): `fo.train` accounts the run with it.
    expected_clients: m, the fixed denominator, float32 (constant).
  """

  clip_norm: jax.Array
  last_clip_norm: jax.Array
  noisy_fraction: jax.Array
  noise_multiplier: jax.Array
  expected_clients: jax.Array


def _check_nonnegative(value: Any, name: str, *, positive: bool = False) -> None:
  if isinstance(value, bool) or not (isinstance(value, (int, float, np.number)) or hasattr(value, "dtype")):
    raise TypeError(f"dp_mean: {name} must be a number; got {type(value).__name__}.")
  if jnp.ndim(value) != 0:
    raise ValueError(f"dp_mean: {name} must be a scalar; got shape {jnp.shape(value)}.")
  if is_concrete(value):
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
      raise ValueError(f"dp_mean: {name} must be a finite number {'> 0' if positive else '>= 0'}; got {v}.")


def update_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float | None) -> float:
  """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2): the update's noise multiplier when the count costs (2σ_b)⁻² of σ⁻².

  σ itself without adaptive clipping (`count_noise_multiplier` None); 0 when σ = 0.

  Raises:
    ValueError: 2σ_b ≤ σ (the count alone would spend the whole budget).
  """
  sigma = float(noise_multiplier)
  if count_noise_multiplier is None or sigma == 0:
    return sigma
  sigma_b = float(count_noise_multiplier)
  rest = sigma ** -2 - (2 * sigma_b) ** -2
  if rest <= 0:
    raise ValueError(f"dp_mean: adaptive clipping with count_noise_multiplier σ_b={sigma_b:g} spends the whole "
                     f"privacy budget of noise_multiplier σ={sigma:g}: it needs 2σ_b > σ, i.e. σ_b > {sigma / 2:g}.")
  return rest ** -0.5


def _sum_dtype(dtype: Any) -> Any:
  return jnp.promote_types(dtype, jnp.float32)


def _global_norm(tree: PyTree) -> jax.Array:
  """‖tree‖₂ over all leaves, accumulated in at least float32."""
  leaves = jax.tree.leaves(tree)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(_sum_dtype(x.dtype)))) for x in leaves))


def clip_by_global_norm(update: PyTree, clip_norm: jax.Array) -> tuple[PyTree, jax.Array]:
  """(Δ · min(1, C / ‖Δ‖₂), ‖Δ‖₂) for one client's update, the norm over every leaf of the pytree.

  An update of norm ≤ C is returned unchanged (scale exactly 1); the result
  is in at least float32.
  """
  norm = _global_norm(update)
  scale = jnp.where(norm > clip_norm, clip_norm / jnp.where(norm > 0, norm, 1), 1.0)
  return jax.tree.map(lambda u: u.astype(_sum_dtype(u.dtype)) * scale.astype(_sum_dtype(u.dtype)), update), norm


def _gaussian_like(key: jax.Array, tree: PyTree) -> PyTree:
  """Independent standard normal draws shaped like every leaf of `tree` (one key per leaf)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def dp_mean(
    clip_norm: float,
    noise_multiplier: float,
    *,
    expected_clients: float,
    adaptive: AdaptiveClipping | None = None,
) -> Aggregator:
  """DP-FedAvg's aggregator: clip each client's update to norm C, sum, add N(0, (σC)²), divide by m.

      Δ = (Σ_{k: w_k > 0} Δ_k · min(1, C / ‖Δ_k‖₂) + N(0, (σ_Δ C)² I)) / m

  (McMahan et al., ICLR 2018, arXiv:1710.06963; the module docstring gives
  the choices: uniform weights, fixed denominator, noise from the round key,
  adaptive clipping). With σ = 0 it is the uniform mean of the clipped
  updates over m. A sum over clients: under a sequential or chunked client
  map it streams (`Aggregator.streaming`).

  Args:
    clip_norm: C > 0, the L2 bound of a client's update over the whole pytree
      (the initial C_0 with `adaptive`).
    noise_multiplier: σ ≥ 0, the noise standard deviation in units of C; the
      value the privacy accountant is given (`fedjax_opt.privacy.epsilons`).
    expected_clients: m > 0, the public denominator: the clients per round for
      fixed-size sampling, qN for Poisson sampling (`Sampling.expected_clients`).
    adaptive: None (fixed C) or `AdaptiveClipping(target_quantile, learning_rate,
      count_noise_multiplier)`.

  Returns:
    An `Aggregator` with state `DPMeanState`, a `StreamingSum` and
    `always_releases=True`.

  Raises:
    TypeError, ValueError: a non-numeric or out-of-range argument (checked
      when concrete), or adaptive clipping whose count noise would use up σ.
    ValueError: from `aggregate`, weights that are not 1-D `[C]` or an update
      leaf not stacked `[C, ...]` on axis 0 (one line naming the leaf and the axis).
  """
  _check_nonnegative(clip_norm, "clip_norm", positive=True)
  _check_nonnegative(noise_multiplier, "noise_multiplier")
  _check_nonnegative(expected_clients, "expected_clients", positive=True)
  if adaptive is not None and not isinstance(adaptive, AdaptiveClipping):
    raise TypeError(f"dp_mean: adaptive must be None or a fedjax_opt.privacy.AdaptiveClipping; "
                    f"got {type(adaptive).__name__}.")
  sigma_delta = noise_multiplier
  sigma_b = None
  if adaptive is not None:
    gamma, eta = adaptive.target_quantile, adaptive.learning_rate
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma < 1:
      raise ValueError(f"dp_mean: adaptive.target_quantile must be in (0, 1); got {gamma!r}.")
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 < eta < float("inf"):
      raise ValueError(f"dp_mean: adaptive.learning_rate must be a finite number > 0; got {eta!r}.")
    if not (is_concrete(noise_multiplier) and is_concrete(expected_clients)):
      raise TypeError("dp_mean: with adaptive clipping, noise_multiplier and expected_clients must be concrete "
                      "(σ_Δ is derived from them on the host).")
    sigma_b = adaptive.count_noise_multiplier
    if sigma_b is None:
      sigma_b = max(float(expected_clients) / 20, 2 * float(noise_multiplier))
    elif isinstance(sigma_b, bool) or not isinstance(sigma_b, (int, float)) or not 0 < sigma_b < float("inf"):
      raise ValueError(f"dp_mean: adaptive.count_noise_multiplier must be a finite number > 0; got {sigma_b!r}.")
    sigma_delta = update_noise_multiplier(noise_multiplier, sigma_b)

  def init(params: PyTree) -> DPMeanState:
    del params
    c = jnp.asarray(clip_norm, jnp.float32)
    return DPMeanState(clip_norm=c, last_clip_norm=c, noisy_fraction=jnp.full((), jnp.nan, jnp.float32),
                       noise_multiplier=jnp.asarray(noise_multiplier, jnp.float32),
                       expected_clients=jnp.asarray(expected_clients, jnp.float32))

  def term(update: PyTree, weight: jax.Array, state: DPMeanState) -> tuple[PyTree, jax.Array]:
    part = (weight > 0).astype(jnp.float32)
    clipped, norm = clip_by_global_norm(update, state.clip_norm)
    clipped = jax.tree.map(lambda u: part.astype(u.dtype) * u, clipped)
    unclipped = (norm <= state.clip_norm).astype(jnp.float32)
    return clipped, part * (unclipped - 0.5)  # the centred bit b_k − ½ (used by adaptive clipping only)

  def finalize(total: PyTree, centred_count: jax.Array, state: DPMeanState,
               key: jax.Array) -> tuple[PyTree, DPMeanState]:
    update_key, count_key = jax.random.split(key)
    m = jnp.asarray(expected_clients, jnp.float32)
    std = jnp.asarray(sigma_delta, jnp.float32) * state.clip_norm
    noise = _gaussian_like(update_key, total)
    out = jax.tree.map(lambda t, z: (t + std.astype(t.dtype) * z) / m.astype(t.dtype), total, noise)
    if adaptive is None:
      return out, state.replace(last_clip_norm=state.clip_norm)
    noisy = (centred_count + sigma_b * jax.random.normal(count_key, (), jnp.float32)) / m + 0.5
    new_clip = state.clip_norm * jnp.exp(-adaptive.learning_rate * (noisy - adaptive.target_quantile))
    return out, state.replace(clip_norm=new_clip, last_clip_norm=state.clip_norm, noisy_fraction=noisy)

  def aggregate(updates: PyTree, weights: jax.Array, state: DPMeanState,
                key: jax.Array) -> tuple[PyTree, DPMeanState]:
    check_stacked_updates(updates, weights, "dp_mean")
    terms, counts = jax.vmap(term, in_axes=(0, 0, None))(updates, weights, state)
    total = jax.tree.map(lambda t: jnp.sum(t, axis=0), terms)
    out, new_state = finalize(total, jnp.sum(counts), state, key)
    return jax.tree.map(lambda o, u: o.astype(u.dtype), out, updates), new_state

  return Aggregator(init, aggregate, StreamingSum(term, finalize), always_releases=True,
                    traits=Traits(name="dp_mean", sums=True, private=True, noise_multiplier=noise_multiplier,
                                             clip_norm=clip_norm))
