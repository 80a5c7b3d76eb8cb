"""Server optimizers of the FedOpt family as optax transformations.

Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan.
"Adaptive Federated Optimization." ICLR 2021. arXiv:2003.00295.

The server treats the aggregated client change Δ_t = aggregate(x_{i,t}^K − x_t)
as a pseudo-gradient: it is fed to the optimizer as g_t = −Δ_t, so any optax
transformation is a server optimizer, and x_{t+1} = x_t + u_t with
u_t = ServerOpt(g_t). In Δ's terms, Algorithm 2 of the paper reads

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t
    v_t = v_{t−1} + Δ_t²                                 (FedAdagrad)
    v_t = β₂ v_{t−1} + (1 − β₂) Δ_t²                     (FedAdam)
    v_t = v_{t−1} − (1 − β₂) Δ_t² sign(v_{t−1} − Δ_t²)   (FedYogi)
    x_{t+1} = x_t + η m_t / (√v_t + τ)

with m_{−1} = 0, v_{−1} = τ² (the paper asks v_{−1} ≥ τ²; a smaller
`initial_accumulator` is rejected), τ outside the square root (it bounds the
adaptivity, it is not a small ε), and no bias correction.
Since v is built from the raw Δ_t while the numerator is the momentum m_t,
both moments live in one transformation, `scale_by_server_adaptivity`, just
as optax's `scale_by_adam` holds both of Adam's; the learning rate is chained
after it. Note that some slide transcriptions of this algorithm square the
momentum instead of Δ_t; we follow the published Algorithm 2.

FedAvg is `optax.sgd(1.0)` (x_{t+1} = x_t + Δ_t); FedAvgM is server SGD with
heavy-ball momentum (Hsu, Qi, Brown 2019, arXiv:1909.06335).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core.validation import check_in_range, check_positive, is_concrete

__all__ = ["ServerAdaptivityState", "available", "fedadagrad", "fedadam", "fedavg", "fedavgm", "fedyogi", "get",
           "scale_by_server_adaptivity"]

Rule = Literal["adagrad", "adam", "yogi"]
ScalarOrSchedule = float | jax.Array | optax.Schedule


class ServerAdaptivityState(NamedTuple):
  """State of `scale_by_server_adaptivity`.

  Attributes:
    count: rounds seen, int32 (used only for optional bias correction).
    mu: m_t, the momentum of the pseudo-gradient (same tree as params).
    nu: v_t, the second-moment accumulator (same tree as params).
  """

  count: jax.Array
  mu: Any
  nu: Any


def _second_moment(rule: Rule, nu: jax.Array, g2: jax.Array, b2: float) -> jax.Array:
  if rule == "adagrad":
    return nu + g2
  if rule == "adam":
    return b2 * nu + (1 - b2) * g2
  return nu - (1 - b2) * g2 * jnp.sign(nu - g2)


def _check_initial_accumulator(initial_accumulator: Any, tau: Any) -> None:
  """v_{−1} ≥ τ² (Reddi et al., Algorithm 2), when both are concrete (up to a relative 1e-6 of rounding: τ = 0.1
  with v_{−1} = 0.01 passes)."""
  if initial_accumulator is None or not (is_concrete(initial_accumulator) and is_concrete(tau)):
    return
  v0, tau2 = np.asarray(initial_accumulator, np.float64), np.square(np.asarray(tau, np.float64))
  if np.any(v0 < tau2 * (1 - 1e-6)):
    raise ValueError(f"initial_accumulator must be >= tau**2 (Reddi et al. initialise v_{{-1}} >= tau^2); "
                     f"got initial_accumulator={initial_accumulator} with tau={tau}, tau**2={float(np.max(tau2)):.6g}.")


def scale_by_server_adaptivity(
    rule: Rule,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
    bias_correction: bool = False,
) -> optax.GradientTransformation:
  """Rescales the pseudo-gradient g = −Δ by Reddi et al.'s adaptive rule (without the learning rate).

  With g_t the incoming update:

      m_t = β₁ m_{t−1} + (1 − β₁) g_t
      v_t = rule(v_{t−1}, g_t²)        (adagrad | adam | yogi, see the module docstring)
      out = m_t / (√v_t + τ)

  Args:
    rule: "adagrad", "adam" or "yogi".
    b1: β₁ ∈ [0, 1), momentum of the numerator (0 = none).
    b2: β₂ ∈ [0, 1), decay of v (unused by adagrad).
    tau: τ > 0, the adaptivity bound, added outside the square root.
    initial_accumulator: v_{−1} ≥ τ² (Reddi et al. initialise v_{−1} ≥ τ²; a
      smaller concrete value raises a ValueError naming both); defaults to τ².
    bias_correction: divide m_t by 1 − β₁^t and v_t by 1 − β₂^t (adam, yogi) as
      in centralized Adam. Off in Reddi et al.'s algorithm.

  Returns:
    An `optax.GradientTransformation`.
  """
  if rule not in ("adagrad", "adam", "yogi"):
    raise ValueError(f"rule must be 'adagrad', 'adam' or 'yogi'; got {rule!r}.")
  check_in_range(b1, "b1", 0.0, 1.0)
  check_in_range(b2, "b2", 0.0, 1.0)
  check_positive(tau, "tau")
  check_positive(initial_accumulator, "initial_accumulator", allow_zero=True)
  _check_initial_accumulator(initial_accumulator, tau)

  def init(params):
    v0 = jnp.square(tau) if initial_accumulator is None else initial_accumulator
    return ServerAdaptivityState(
        count=jnp.zeros((), jnp.int32),
        mu=jax.tree.map(jnp.zeros_like, params),
        nu=jax.tree.map(lambda p: jnp.full_like(p, v0), params),
    )

  def update(updates, state, params=None):
    del params
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: _second_moment(rule, v, jnp.square(g), b2), state.nu, updates)
    mu_hat, nu_hat = mu, nu
    if bias_correction:
      mu_hat = jax.tree.map(lambda m: m / (1 - b1**count.astype(m.dtype)), mu)
      if rule != "adagrad":
        nu_hat = jax.tree.map(lambda v: v / (1 - b2**count.astype(v.dtype)), nu)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), mu_hat, nu_hat)
    return out, ServerAdaptivityState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def _check_lr(learning_rate: ScalarOrSchedule) -> None:
  if not callable(learning_rate):
    check_positive(learning_rate, "learning_rate")


def fedavg(learning_rate: ScalarOrSchedule = 1.0) -> optax.GradientTransformation:
  """FedAvg's server: x_{t+1} = x_t + η Δ_t (η = 1 is McMahan et al.'s plain average)."""
  _check_lr(learning_rate)
  return optax.sgd(learning_rate)


def fedavgm(learning_rate: ScalarOrSchedule = 1.0, momentum: float = 0.9) -> optax.GradientTransformation:
  """FedAvgM: server heavy-ball momentum, v_t = β v_{t−1} + Δ_t, x_{t+1} = x_t + η v_t.

  Hsu, Qi, Brown. "Measuring the Effects of Non-Identical Data Distribution for
  Federated Visual Classification." arXiv:1909.06335, 2019.
  """
  _check_lr(learning_rate)
  check_in_range(momentum, "momentum", 0.0, 1.0)
  return optax.sgd(learning_rate, momentum=momentum)


def fedadagrad(learning_rate: ScalarOrSchedule = 0.1, tau: float = 1e-3, initial_accumulator: float | None = None,
               b1: float = 0.0) -> optax.GradientTransformation:
  """FedAdagrad (Reddi et al. 2021, Alg. 2): v_t = v_{t−1} + Δ_t², x_{t+1} = x_t + η m_t / (√v_t + τ).

  Args:
    learning_rate: η, the server learning rate (a float or an optax schedule).
    tau: τ > 0, the adaptivity bound.
    initial_accumulator: v_{−1} ≥ τ² (default τ²; smaller raises a ValueError).
    b1: β₁; 0 (the default) makes m_t = Δ_t, Adagrad without momentum.
  """
  _check_lr(learning_rate)
  return optax.chain(
      scale_by_server_adaptivity("adagrad", b1=b1, tau=tau, initial_accumulator=initial_accumulator),
      optax.scale_by_learning_rate(learning_rate))


def _adaptive(kind: str, learning_rate: ScalarOrSchedule, b1: float, b2: float, tau: float,
              initial_accumulator: float | None, bias_correction: bool) -> optax.GradientTransformation:
  """FedAdam / FedYogi: the server adaptivity of `kind`, then the learning rate."""
  _check_lr(learning_rate)
  return optax.chain(
      scale_by_server_adaptivity(kind, b1=b1, b2=b2, tau=tau, initial_accumulator=initial_accumulator,
                                 bias_correction=bias_correction),
      optax.scale_by_learning_rate(learning_rate))


def fedadam(learning_rate: ScalarOrSchedule = 0.01, b1: float = 0.9, b2: float = 0.99, tau: float = 1e-3,
            initial_accumulator: float | None = None, bias_correction: bool = False) -> optax.GradientTransformation:
  """FedAdam (Reddi et al. 2021, Alg. 2): v_t = β₂ v_{t−1} + (1 − β₂) Δ_t², x_{t+1} = x_t + η m_t / (√v_t + τ).

  Args:
    learning_rate: η, the server learning rate (a float or an optax schedule).
    b1: β₁, momentum (paper: 0.9).
    b2: β₂ (paper: 0.99).
    tau: τ > 0, the adaptivity bound (paper grid 1e-1 … 1e-5).
    initial_accumulator: v_{−1} ≥ τ² (default τ²; smaller raises a ValueError).
    bias_correction: Adam's bias correction; off in the paper.
  """
  return _adaptive("adam", learning_rate, b1, b2, tau, initial_accumulator, bias_correction)


def fedyogi(learning_rate: ScalarOrSchedule = 0.01, b1: float = 0.9, b2: float = 0.99, tau: float = 1e-3,
            initial_accumulator: float | None = None, bias_correction: bool = False) -> optax.GradientTransformation:
  """FedYogi (Reddi et al. 2021, Alg. 2): v_t = v_{t−1} − (1 − β₂) Δ_t² sign(v_{t−1} − Δ_t²), then as FedAdam.

  Args:
    learning_rate: η, the server learning rate (a float or an optax schedule).
    b1: β₁, momentum (paper: 0.9).
    b2: β₂ (paper: 0.99).
    tau: τ > 0, the adaptivity bound.
    initial_accumulator: v_{−1} ≥ τ² (default τ²; smaller raises a ValueError).
    bias_correction: Adam's bias correction; off in the paper.
  """
  return _adaptive("yogi", learning_rate, b1, b2, tau, initial_accumulator, bias_correction)


_REGISTRY: dict[str, tuple[Callable[..., optax.GradientTransformation], str]] = {
    "fedavg": (fedavg, "plain average, x += η Δ (McMahan et al. 2017)"),
    "fedavgm": (fedavgm, "server heavy-ball momentum (Hsu et al. 2019)"),
    "fedadagrad": (fedadagrad, "v += Δ², x += η m / (√v + τ) (Reddi et al. 2021)"),
    "fedadam": (fedadam, "v = β₂v + (1−β₂)Δ², x += η m / (√v + τ) (Reddi et al. 2021)"),
    "fedyogi": (fedyogi, "v −= (1−β₂)Δ² sign(v − Δ²), x += η m / (√v + τ) (Reddi et al. 2021)"),
}


def available() -> dict[str, str]:
  """Server optimizer names with a one-line description each."""
  return {name: doc for name, (_, doc) in _REGISTRY.items()}


def get(name: str, **kwargs) -> optax.GradientTransformation:
  """Builds a server optimizer by name, e.g. `get("fedadam", learning_rate=0.01)`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown server optimizer {name!r}; choose one of {sorted(_REGISTRY)}.")
  return _REGISTRY[name][0](**kwargs)
