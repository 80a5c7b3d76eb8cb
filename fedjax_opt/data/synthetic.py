"""The FedProx Synthetic(alpha, beta) benchmark, generated from its published recipe.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith: "Federated Optimization in
Heterogeneous Networks" (MLSys 2020, arXiv:1812.06127), Section 5.1, after
Shamir, Srebro, Zhang (ICML 2014). For device k of 30:

    n_k = floor(LogNormal(4, 2)) + 50          (power-law-like sizes)
    u_k ~ N(0, alpha),  B_k ~ N(0, beta)
    W_k ~ N(u_k, 1) [60 x 10],  b_k ~ N(u_k, 1) [10]
    v_k ~ N(B_k, 1) [60],       x ~ N(v_k, Sigma),  Sigma_jj = j^-1.2 (diagonal)
    y = argmax softmax(W_k^T x + b_k)

alpha controls how much local models differ, beta how much local features
differ. As in the authors' generator, alpha and beta are the *standard
deviations* of the normals (numpy's `scale`). The IID variant shares one
W, b ~ N(0, 1) and v = 0 across devices. The authors hold out 10% of each
device at random for test.

Draws come from one `numpy.random.Generator(PCG64(seed))` in a fixed order
(sizes, u, B, v, then per device W_k, b_k, x_k), so a seed gives the same data
on every machine; `generate_synthetic` returns the per-device parameters
so that the labels can be checked against the model that made them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedjax_opt.data.dataset import FederatedDataset, pack

__all__ = ["SyntheticData", "SyntheticParams", "fedprox_client_sizes", "generate_synthetic", "load_synthetic"]


class SyntheticParams(NamedTuple):
  """Per-device parameters of the generator (K devices, d features, L classes).

  Attributes:
    u: `[K]` mean of device k's model weights (0 for IID).
    B: `[K]` mean of device k's feature means (0 for IID).
    v: `[K, d]` feature mean of device k.
    W: `[K, d, L]` model weights of device k.
    b: `[K, L]` model bias of device k.
    cov_diag: `[d]` diagonal of Sigma, j^-1.2 for j = 1..d.
  """

  u: np.ndarray
  B: np.ndarray
  v: np.ndarray
  W: np.ndarray
  b: np.ndarray
  cov_diag: np.ndarray


class SyntheticData(NamedTuple):
  """Generated devices: `clients[k] = {"x": [n_k, d] float32, "y": [n_k] int32}`."""

  clients: list[dict[str, np.ndarray]]
  params: SyntheticParams
  sizes: np.ndarray


def fedprox_client_sizes(num_clients: int, rng: np.random.Generator) -> np.ndarray:
  """Device sizes of the FedProx generator: `floor(LogNormal(mean=4, sigma=2)) + 50`."""
  return np.floor(rng.lognormal(4.0, 2.0, num_clients)).astype(np.int64) + 50


def feature_covariance_diag(num_features: int) -> np.ndarray:
  """Sigma_jj = j^-1.2, j = 1..d."""
  return np.arange(1, num_features + 1, dtype=np.float64) ** -1.2


def _check(alpha: float, beta: float, num_clients: int, num_features: int, num_classes: int) -> None:
  for name, value in (("alpha", alpha), ("beta", beta)):
    if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
      raise ValueError(f"{name} must be a finite number >= 0; got {value!r}.")
  for name, value, low in (("num_clients", num_clients, 1), ("num_features", num_features, 1),
                           ("num_classes", num_classes, 2)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
      raise ValueError(f"{name} must be an int >= {low}; got {value!r}.")


def generate_synthetic(alpha: float = 1.0, beta: float = 1.0, *, iid: bool = False, num_clients: int = 30,
                       num_features: int = 60, num_classes: int = 10, seed: int = 0) -> SyntheticData:
  """Generates Synthetic(alpha, beta) (or the IID variant) as per-device arrays.

  Args:
    alpha: std of u_k (model heterogeneity); ignored when `iid`.
    beta: std of B_k (feature heterogeneity); ignored when `iid`.
    iid: the Synthetic-IID variant (shared W, b; v = 0).
    num_clients: K devices (30 in the paper).
    num_features: d (60).
    num_classes: L (10).
    seed: seed of the numpy Generator.

  Returns:
    `SyntheticData(clients, params, sizes)`.
  """
  _check(alpha, beta, num_clients, num_features, num_classes)
  rng = np.random.default_rng(seed)
  k, d, num_labels = int(num_clients), int(num_features), int(num_classes)
  sizes = fedprox_client_sizes(k, rng)
  cov = feature_covariance_diag(d)
  if iid:
    u = np.zeros(k)
    big_b = np.zeros(k)
    v = np.zeros((k, d))
    w_shared = rng.normal(0.0, 1.0, (d, num_labels))
    b_shared = rng.normal(0.0, 1.0, num_labels)
  else:
    u = rng.normal(0.0, alpha, k)
    big_b = rng.normal(0.0, beta, k)
    v = rng.normal(big_b[:, None], 1.0, (k, d))
  weights = np.zeros((k, d, num_labels))
  biases = np.zeros((k, num_labels))
  clients = []
  for i in range(k):
    if iid:
      weights[i], biases[i] = w_shared, b_shared
    else:
      weights[i] = rng.normal(u[i], 1.0, (d, num_labels))
      biases[i] = rng.normal(u[i], 1.0, num_labels)
    x = v[i] + rng.standard_normal((int(sizes[i]), d)) * np.sqrt(cov)
    y = np.argmax(x @ weights[i] + biases[i], axis=1)  # softmax is monotone
    clients.append({"x": x.astype(np.float32), "y": y.astype(np.int32)})
  return SyntheticData(clients, SyntheticParams(u, big_b, v, weights, biases, cov), sizes)


def load_synthetic(alpha: float = 1.0, beta: float = 1.0, *, iid: bool = False, num_clients: int = 30,
                   num_features: int = 60, num_classes: int = 10, seed: int = 0, test_fraction: float = 0.1,
                   max_padding_factor: float | None = None, device=None) -> FederatedDataset:
  """Synthetic(alpha, beta) packed as a `FederatedDataset` (natural devices, 10% test).

  The lognormal sizes make one device hold a large share of the data for
  some seeds (padding factors near 10-20 with 30 devices), which the recipe
  calls for; the data are small (60 floats per example), so the padding
  check is off by default (`max_padding_factor=None`).

  Args:
    alpha, beta, iid, num_clients, num_features, num_classes, seed: see
      `generate_synthetic`.
    test_fraction: share of each device held out at random (0.1 as in FedProx).
    max_padding_factor: see `pack`.
    device: optional device or sharding.
  """
  data = generate_synthetic(alpha, beta, iid=iid, num_clients=num_clients, num_features=num_features,
                            num_classes=num_classes, seed=seed)
  name = "synthetic_iid" if iid else f"synthetic_{alpha:g}_{beta:g}"
  return pack(data.clients, test_fraction=test_fraction, seed=seed, num_classes=num_classes,
              client_names=[f"f_{i:05d}" for i in range(len(data.clients))], name=name,
              max_padding_factor=max_padding_factor, device=device)
