"""BBP-MAP: match one layer's neurons across clients (host, float64, Hungarian).

Yurochkin, Agarwal, Ghosh, Greenewald, Hoang, Khazaeni. "Bayesian Nonparametric
Federated Learning of Neural Networks." ICML 2019. arXiv:1905.12022. (PFNM: the
Beta-Bernoulli-process model of neurons and its MAP matching, BBP-MAP, Section 3;
the cost FedMA's Algorithm 1 calls.)

The model. Global neurons θ_i ~ N(μ₀, σ₀²I); a client neuron (`neurons.py`:
a unit's incoming weights and bias, a vector in ℝ^D) matched to θ_i is
v_jl ~ N(θ_i, σ²I); which global neurons client j uses follows a
Beta-Bernoulli process with mass γ₀. Clients are matched one at a time against
the global neurons of the others (L₋ⱼ of them; m_i = m_i^{−j} the number of
other clients using neuron i, and s_i the sum of their matched neurons). With
natural parameters a_i = μ₀/σ₀² + s_i/σ² and precision p_i = 1/σ₀² + m_i/σ²,
the gain of giving client neuron l to global neuron i (twice the increase of
the log posterior at its maximum over θ) is

    G_il = ‖a_i + v_jl/σ²‖² / (p_i + 1/σ²) − ‖a_i‖² / p_i + 2 log(m_i / (J − m_i)),      i ≤ L₋ⱼ,
    G_il = ‖μ₀/σ₀² + v_jl/σ²‖² / (1/σ₀² + 1/σ²) − ‖μ₀‖²/σ₀² + 2 log(γ₀/J) − 2 log k,   i = L₋ⱼ + k,

k = 1 … L_j (the k-th new neuron; −2 log k is the 1/k! of the Poisson number of
new neurons). The assignment B^j (each client neuron to one column, each column
at most once) maximizes Σ B_il G_il: `scipy.optimize.linear_sum_assignment` on
the L_j × (L₋ⱼ + L_j) matrix −G (Hungarian). A client neuron that matches no
global neuron well enough opens a new one: the global layer grows. With
σ₀ → ∞ and a single global neuron u used by m = 1 of J = 2 clients, the
difference is G_match − G_new = −‖u − v‖²/(2σ²) + 2 log(2/γ₀): a new neuron is
opened exactly when ‖u − v‖² > 4σ² log(2/γ₀) (tests/test_matched_averaging.py).
The first pass matches clients in order of decreasing width, the first one
founding the global layer; `iterations` more passes (PFNM's and FedMA's
code) take each client out in random order and match it again.

A deviation from the papers' code, on purpose: the log-prior term of a match
is 2 log(m_i/(J − m_i)), as in PFNM's objective; the authors' code adds
log(min(m_i, 10)/(J − m_i)), half the weight of the new-neuron term. With the
consistent factor, J identical copies always match when γ₀ ≤ 1 (the defaults
here: σ = σ₀ = γ₀ = 1; FedMA's code uses γ₀ = 7 with its own weighting). The
prior enters the matching only: how matched neurons are averaged is
`layerwise.py`'s.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Sequence

import numpy as np

__all__ = ["LayerMatching", "LayerPrior", "bbp_map", "check_prior", "match_client"]


def check_prior(sigma: float, sigma0: float, gamma: float) -> None:
  """Clear errors for the prior's σ, σ₀ and γ₀ (used by `bbp_map` and `fedma`)."""
  for value, name in ((sigma, "sigma"), (gamma, "gamma")):
    if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value) and value > 0):
      raise ValueError(f"{name} must be a finite Python float > 0; got {value!r}.")
  if not (isinstance(sigma0, (int, float, np.floating)) and sigma0 > 0):
    raise ValueError(f"sigma0 must be a Python float > 0 (math.inf for a flat prior); got {sigma0!r}.")


def match_client(sums: np.ndarray, counts: np.ndarray, neurons: np.ndarray, *, num_clients: int, sigma: float = 1.0,
                 sigma0: float = 1.0, gamma: float = 1.0, mu0: float = 0.0, max_width: int | None = None) -> np.ndarray:
  """One client's neurons against the global neurons of the others: the BBP-MAP assignment (PFNM, Section 3).

  Maximizes Σ_il B_il G_il over one-to-one assignments B (the gain G_il of the
  module docstring), by `scipy.optimize.linear_sum_assignment` on −G.

  Args:
    sums: `[L, D]` s_i, the sum of the other clients' neurons matched to global neuron i.
    counts: `[L]` m_i ≥ 1, how many other clients use global neuron i (each < J).
    neurons: `[L_j, D]` v_jl, this client's neurons.
    num_clients: J, the number of clients in the matching.
    sigma: σ, the standard deviation of a client neuron around its global neuron.
    sigma0: σ₀, the prior standard deviation of a global neuron around μ₀ (`math.inf`: flat).
    gamma: γ₀, the mass of the Beta-Bernoulli process (larger: more new neurons).
    mu0: μ₀, the prior mean (a scalar, every coordinate).
    max_width: None, or a cap on L plus the new neurons (as the papers' code, which caps at 700);
      never fewer new columns than L_j − L, so every neuron gets one.

  Returns:
    `[L_j]` int: the global index of each client neuron; an index ≥ L is a new
    global neuron, numbered L, L + 1, ... in order of their columns.
  """
  sums, neurons = np.asarray(sums, np.float64), np.asarray(neurons, np.float64)
  counts = np.asarray(counts, np.float64)
  num_global, lj = sums.shape[0], neurons.shape[0]
  if counts.shape != (num_global,) or np.any(counts < 1) or np.any(counts >= num_clients):
    raise ValueError(f"counts must be [L] = ({num_global},) with 1 <= m_i < J = {num_clients} (the other clients); "
                     f"got {counts}.")
  if neurons.ndim != 2 or sums.ndim != 2 or neurons.shape[1] != sums.shape[1]:
    raise ValueError(f"sums [L, D] and neurons [L_j, D] must share D; got {sums.shape} and {neurons.shape}.")
  b = 1.0 / sigma**2
  a0 = 0.0 if math.isinf(sigma0) else 1.0 / sigma0**2
  nat = a0 * mu0 + b * sums  # a_i
  prec = a0 + b * counts  # p_i
  v = b * neurons
  sq_nat = np.sum(nat**2, axis=1)
  matched = ((sq_nat[None] + 2.0 * v @ nat.T + np.sum(v**2, axis=1)[:, None]) / (prec + b)[None]
             - (sq_nat / np.maximum(prec, 1e-300))[None]
             + 2.0 * np.log(counts / (num_clients - counts))[None])
  num_new = lj if max_width is None else max(min(lj, max_width - num_global), lj - num_global, 0)
  prior_new = np.sum((a0 * mu0 + v)**2, axis=1) / (a0 + b) - a0 * mu0**2 * neurons.shape[1]
  new = (prior_new[:, None] + 2.0 * math.log(gamma / num_clients)
         - 2.0 * np.log(np.arange(1, num_new + 1, dtype=np.float64))[None])
  gain = np.concatenate([matched, new], axis=1)
  from scipy.optimize import linear_sum_assignment  # pylint: disable=g-import-not-at-top  (scipy: host only)
  rows, cols = linear_sum_assignment(-gain)
  assignment = np.empty(lj, np.int64)
  assignment[rows] = cols
  opened = np.sort(cols[cols >= num_global])
  assignment[assignment >= num_global] = num_global + np.searchsorted(opened, assignment[assignment >= num_global])
  return assignment


class LayerMatching(NamedTuple):
  """The matching of one layer across J clients.

  Attributes:
    assignments: J arrays `[L_j]` int, the global index of each client neuron.
    width: L, the number of global neurons.
  """

  assignments: list[np.ndarray]
  width: int


def _compact(assignments: list[np.ndarray], skip: int) -> tuple[list[np.ndarray], int]:
  """Renumbers the global neurons used by the clients other than `skip` as 0 … L−1, in order."""
  used = np.unique(np.concatenate([a for k, a in enumerate(assignments) if k != skip and a is not None]
                                  or [np.zeros(0, np.int64)]))
  remap = np.full(int(used.max(initial=-1)) + 1, -1, np.int64)
  remap[used] = np.arange(len(used))
  out = [a if k == skip or a is None else remap[a] for k, a in enumerate(assignments)]
  return out, len(used)


def _statistics(neurons: list[np.ndarray], assignments: list[np.ndarray], width: int,
                skip: int) -> tuple[np.ndarray, np.ndarray]:
  dim = neurons[0].shape[1]
  sums, counts = np.zeros((width, dim)), np.zeros(width)
  for k, (v, a) in enumerate(zip(neurons, assignments)):
    if k != skip and a is not None:  # None: not matched yet (first pass)
      np.add.at(sums, a, v)
      np.add.at(counts, a, 1.0)
  return sums, counts


def bbp_map(neurons: Sequence[np.ndarray], *, sigma: float = 1.0, sigma0: float = 1.0, gamma: float = 1.0,
            mu0: float = 0.0, iterations: int = 3, max_width: int | None = None, seed: int = 0) -> LayerMatching:
  """BBP-MAP for one layer: matches the neurons of J clients into L ≥ max_j L_j global neurons.

  First pass: clients in order of decreasing width, the first founding the
  global layer, each next one matched (`match_client`) against those before
  it. Then `iterations` passes in random order: take client j out (a global
  neuron no other client uses disappears) and match it again.

  Args:
    neurons: J arrays `[L_j, D]` (same D), the neuron vectors of the module docstring.
    sigma, sigma0, gamma, mu0, max_width: see `match_client`.
    iterations: refinement passes after the first one.
    seed: seeds the order of the refinement passes.

  Returns:
    `LayerMatching(assignments, width)`.
  """
  check_prior(sigma, sigma0, gamma)
  neurons = [np.asarray(v, np.float64) for v in neurons]
  if not neurons or any(v.ndim != 2 or v.shape[1] != neurons[0].shape[1] for v in neurons):
    raise ValueError(f"neurons must be J >= 1 arrays [L_j, D] with one D; got shapes {[np.shape(v) for v in neurons]}.")
  num_clients = len(neurons)
  match = functools.partial(match_client, num_clients=num_clients, sigma=sigma, sigma0=sigma0, gamma=gamma, mu0=mu0,
                            max_width=max_width)
  order = sorted(range(num_clients), key=lambda k: -neurons[k].shape[0])
  assignments: list[np.ndarray | None] = [None] * num_clients
  assignments[order[0]] = np.arange(neurons[order[0]].shape[0])
  width = neurons[order[0]].shape[0]
  for j in order[1:]:
    sums, counts = _statistics(neurons, assignments, width, skip=j)
    assignments[j] = match(sums, counts, neurons[j])
    width = max(width, int(assignments[j].max(initial=-1)) + 1)
  rng = np.random.default_rng(seed)
  for _ in range(iterations if num_clients > 1 else 0):
    for j in rng.permutation(num_clients):
      assignments, width = _compact(assignments, skip=j)
      sums, counts = _statistics(neurons, assignments, width, skip=j)
      assignments[j] = match(sums, counts, neurons[j])
      width = max(width, int(assignments[j].max(initial=-1)) + 1)
  assignments, width = _compact(assignments, skip=-1)
  return LayerMatching(assignments, width)


PRIOR_SCALES = ("layer", "absolute")


def _per_layer(value: Any, name: str, num_hidden: int) -> tuple:
  """A value for every hidden layer: a scalar repeated, or a sequence of exactly `num_hidden` values."""
  if isinstance(value, (list, tuple, np.ndarray)):
    values = tuple(value.tolist() if isinstance(value, np.ndarray) else value)
    if len(values) != num_hidden:
      raise ValueError(f"{name} must be one value for every layer or one per hidden layer ({num_hidden}); "
                       f"got {len(values)} values.")
    return values
  return (value,) * num_hidden


class LayerPrior(NamedTuple):
  """BBP-MAP's settings for every hidden layer of a layer-wise matching (`layerwise.match_layers`).

  Each of `sigma`, `sigma0`, `gamma`, `mu0`, `max_width` holds one value per
  hidden layer (`LayerPrior.make` accepts a scalar for all). With
  `scale="layer"`, layer n's σ, σ₀ and μ₀ are in units of r_n, the root mean
  square coordinate of the clients' units being matched in that layer
  (r_n² = Σ_jl ‖v_jl‖² / (Σ_j L_j · D_n), read from the data at matching
  time): the matching then depends on the units' directions and relative
  distances, not on the layer's weight scale, which differs between layers
  and changes as training goes on. `scale="absolute"` uses the values as
  given (the authors' code: σ = σ₀ = 1 in every layer). The width cap of
  layer n is the smaller of `max_width[n]` and `max_growth` times the widest
  client's units in that layer (None: that cap off); BBP-MAP never opens
  fewer units than a client has (`match_client`).
  """

  sigma: tuple
  sigma0: tuple
  gamma: tuple
  mu0: tuple
  max_width: tuple
  max_growth: float | None
  iterations: int
  scale: str

  @classmethod
  def make(cls, num_hidden: int, *, sigma: Any = 1.0, sigma0: Any = 1.0, gamma: Any = 1.0, mu0: Any = 0.0,
           max_width: Any = None, max_growth: float | None = None, iterations: int = 3,
           scale: str = "layer") -> "LayerPrior":
    """Checked settings, each a scalar for every hidden layer or a sequence of one per hidden layer."""
    if scale not in PRIOR_SCALES:
      raise ValueError(f"prior_scale must be one of {PRIOR_SCALES}; got {scale!r}.")
    if max_growth is not None and not (isinstance(max_growth, (int, float, np.floating))
                                       and not isinstance(max_growth, bool) and math.isfinite(max_growth)
                                       and max_growth >= 1):
      raise ValueError(f"max_growth must be None or a finite number >= 1; got {max_growth!r}.")
    prior = cls(*(_per_layer(v, k, num_hidden) for k, v in (("sigma", sigma), ("sigma0", sigma0), ("gamma", gamma),
                                                              ("mu0", mu0), ("max_width", max_width))),
                max_growth=max_growth, iterations=iterations, scale=scale)
    for s, s0, g, w in zip(prior.sigma, prior.sigma0, prior.gamma, prior.max_width):
      check_prior(s, s0, g)
      if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1):
        raise ValueError(f"max_width must be None or an int >= 1 (for every layer or one per hidden layer); "
                         f"got {w!r}.")
    return prior

  def for_layer(self, n: int, neurons: Sequence[np.ndarray]) -> dict[str, Any]:
    """`bbp_map`'s keyword arguments for hidden layer n, whose clients' units are `neurons` (J arrays `[L_j, D]`).

    The cap is the smaller of `max_width[n]` and `int(max_growth · max_j L_j)` (None: no cap).
    """
    unit = 1.0
    if self.scale == "layer":
      squares = sum(float(np.sum(np.square(v, dtype=np.float64))) for v in neurons)
      count = sum(np.size(v) for v in neurons)
      unit = math.sqrt(squares / count) if count and squares > 0 else 1.0
    caps = [c for c in (self.max_width[n],
                        None if self.max_growth is None or not neurons else
                        int(self.max_growth * max(np.shape(v)[0] for v in neurons))) if c is not None]
    return dict(sigma=self.sigma[n] * unit, sigma0=self.sigma0[n] * unit, gamma=self.gamma[n],
                mu0=self.mu0[n] * unit, max_width=min(caps) if caps else None, iterations=self.iterations)
