"""PFNM: one-shot matched averaging of J trained networks into one global network, without retraining.

Yurochkin, Agarwal, Ghosh, Greenewald, Hoang, Khazaeni. "Bayesian Nonparametric
Federated Learning of Neural Networks." ICML 2019. arXiv:1905.12022.

One communication: each client uploads its trained network once, and the
server matches and averages it layer by layer (`layerwise.py` without the
retraining; the matching of each layer is BBP-MAP, `matching.py`). The
global layers grow where a client's neurons match no other client's.

    global_params = fo.algorithms.pfnm([p_1, ..., p_J], layers=...)
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from fedjax_opt.algorithms.matched_averaging.layerwise import match_layers
from fedjax_opt.algorithms.matched_averaging.matching import LayerPrior
from fedjax_opt.algorithms.matched_averaging.neurons import check_layers
from fedjax_opt.core.types import PyTree
from fedjax_opt.core.validation import check_int

__all__ = ["pfnm"]


def _check_class_counts(class_counts: Any, num: int, num_classes: int) -> np.ndarray | None:
  """None, or any array-like n_jk as a float64 `[J, K]` array of finite values >= 0 (one-line ValueError else)."""
  if class_counts is None:
    return None
  try:
    counts = np.asarray(class_counts, np.float64)
  except (TypeError, ValueError):
    counts = None
  if counts is None or counts.shape != (num, num_classes):
    shape = "not numeric" if counts is None else f"shape {counts.shape}"
    raise ValueError(f"class_counts must be [J, K] = ({num}, {num_classes}) (clients, classes of the last layer); "
                     f"got {shape}.")
  bad = ~np.isfinite(counts) | (counts < 0)
  if np.any(bad):
    j, k = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"class_counts must be finite and >= 0 (n_jk, client j's examples of class k); got "
                     f"n_jk = {counts[j, k]} at j = {j}, k = {k}.")
  return counts


def pfnm(client_params: Sequence[PyTree], *, layers: Sequence[str], sigma: Any = 1.0, sigma0: Any = 1.0,
         gamma: Any = 1.0, mu0: Any = 0.0, iterations: int = 3, max_width: Any = None,
         max_growth: float | None = None, prior_scale: str = "absolute",
         client_weights: Sequence[float] | None = None, class_counts: Any = None, seed: int = 0) -> PyTree:
  """One-shot matched averaging (PFNM, with FedMA's layer-wise rule): J trained networks -> one global network.

  Layer by layer, bottom up: BBP-MAP matches the J clients' neurons
  (`bbp_map`), the global layer is the mean of the matched neurons, and each
  client's next layer has its inputs moved to the global positions. The last
  layer is the class-weighted average Σ_j p_jk W_{j,N}[:, k]. No retraining:
  that is `fedma`.

  Args:
    client_params: J params dicts (widths may differ), each `{layer: {"kernel", "bias"}}`.
    layers: the layer names in forward order, the last one the classifier.
    sigma: σ (std of a client neuron around its global neuron).
    sigma0: σ₀ (prior std of a global neuron; `math.inf`: flat prior).
    gamma: γ₀ (Beta-Bernoulli mass: the propensity to open new neurons).
    mu0: μ₀ (prior mean).
    iterations: BBP-MAP refinement passes per layer.
    max_width: None, or a cap on each global layer's width.
    max_growth: None, or a cap on each global layer's width relative to the widest client's layer
      (`int(max_growth · max_j L_j)`; the smaller cap applies when both are set).
      Each of sigma, sigma0, gamma, mu0, max_width: one value for every hidden layer or a sequence of one per
      hidden layer (`LayerPrior`).
    prior_scale: "absolute" (default): σ, σ₀, μ₀ as given, in the units of the weights, the convention of
      Yurochkin et al. 2019 and their code (and of `pfnm` before `prior_scale` existed); "layer": the
      scale-free variant, σ, σ₀, μ₀ in units of r_n, each layer's root-mean-square unit coordinate measured on
      the clients' units being matched (`LayerPrior`), so one value means the same in every layer and at every
      weight scale (`fedma`'s default). The two read the same numbers differently: σ = 0.1 is a tenth of a
      weight in absolute units but a tenth of r_n ≈ 1/√fan-in in layer units, a far stricter match, and copies
      of one network with a little noise then open spurious units (tests/test_matched_averaging.py).
    client_weights: n_j for the classifier average when `class_counts` is None or a class is held
      by no client; default uniform.
    class_counts: None, or `[J, K]` n_jk, client j's examples of class k (any array-like, finite, >= 0): the
      classifier's column k is Σ_j n_jk W_j[:, k] / Σ_j n_jk.
    seed: seeds the refinement order.

  Returns:
    The global params (jnp arrays), with the grown widths.
  """
  client_params = [jax.tree.map(np.asarray, p) for p in client_params]
  if not client_params:
    raise ValueError("client_params must hold at least one client's params.")
  layers = tuple(check_layers(p, layers) for p in client_params)[0]
  num = len(client_params)
  weights = np.ones(num) if client_weights is None else np.asarray(client_weights, np.float64)
  if weights.shape != (num,) or np.any(weights < 0) or not np.all(np.isfinite(weights)):
    raise ValueError(f"client_weights must be J = {num} finite values >= 0; got {client_weights}.")
  check_int(iterations, "iterations", 0)
  num_classes = int(np.shape(client_params[0][layers[-1]]["bias"])[0])
  class_counts = _check_class_counts(class_counts, num, num_classes)
  prior = LayerPrior.make(len(layers) - 1, sigma=sigma, sigma0=sigma0, gamma=gamma, mu0=mu0, max_width=max_width,
                          max_growth=max_growth, iterations=iterations, scale=prior_scale)
  return match_layers(client_params, layers, weights, class_counts, None, seed, prior).params
