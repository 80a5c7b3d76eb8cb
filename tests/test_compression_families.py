"""Compression in every factory that uploads: each family against a float64 NumPy transcription.

One client stage, `compress(top_k(k=2), error_feedback=True)` chained before the
factory's default rule, on the least-squares problem of tests/algorithm_examples.py
(P = 4 entries, flattened b then w; one client holds a padded example, so the
weights differ). Two rounds on fresh data each, so the second round sends
C(Δ + e) with the residual e kept from the first. Each family's NumPy
transcription follows its paper's round with C applied to what the client
sends; every test checks the model(s), the per-client state, the residual
table and the bits charged (top-2 of P entries: 2 (32 + ⌈log₂ P⌉) bits).

* Ditto, pFedMe, Per-FedAvg ("fo"), FedAvg + fine-tuning (one round of each
  stage: FedAvgM, then FedAdam on the first local step only) and FedEM
  (M = 2 components, compressed as one vector of 2P entries).
* IFCA: the residual is kept per client and cluster; two clients change
  cluster between the rounds, and their first cluster's residual stays where
  it was while the second cluster's fills.
* FedDyn and CFL refuse a client stage in one line that says why.

One jitted `step` per family, built once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from algorithm_examples import B, N, S, example_inputs, loss_fn

import fedjax_opt as fo

C = fo.compression
K_TOP = 2
LR = 0.05
ROUNDS = 2


def _stage():
  return C.compress(C.top_k(k=K_TOP), error_feedback=True, num_clients=N)


# ----------------------------------------------------------------------------- inputs


def _batches(r, planted=None):
  """Round r's batches: the examples' data (seed r), client 2's last example of batch 1 padding.

  `planted` `[N, P]`: client k's labels are its row's model on x (plus small noise) instead of random.
  """
  _, batches = example_inputs("fedavg", seed=10 + r)
  mask = np.ones((N, S, B), bool)
  mask[2, 1, B - 1] = False
  x = np.asarray(batches.data["x"])
  y = np.asarray(batches.data["y"])
  if planted is not None:
    rng = np.random.default_rng(100 + r)
    y = (np.einsum("ksbd,kd->ksb", x, planted[:, 1:]) + planted[:, :1, None]
         + 0.01 * rng.normal(size=y.shape)).astype(np.float32)
  return batches.replace(data={"x": batches.data["x"], "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                         weight=jnp.asarray(mask.sum(axis=(1, 2)), jnp.float32))


def _np_data(batches):
  return (np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64),
          np.asarray(batches.mask), np.asarray(batches.weight, np.float64))


def _initial():
  params, _ = example_inputs("fedavg")
  return params


def _vec(params):
  """{"b": [...], "w": [..., D]} → [..., P] float64 (leaf order: b, then w)."""
  b = np.asarray(params["b"], np.float64)
  return np.concatenate([b[..., None], np.asarray(params["w"], np.float64)], axis=-1)


def _tree(z):
  return {"b": jnp.asarray(z[..., 0], jnp.float32), "w": jnp.asarray(z[..., 1:], jnp.float32)}


# ----------------------------------------------------------------------------- NumPy pieces


def _resid(x, y, z):
  return x @ z[1:] + z[0] - y


def _grad(z, x, y, m, weight=None):
  """Gradient of the masked mean of weight · ½(xᵀw + b − y)² over one batch (0 with no real example)."""
  q = np.ones(len(y)) if weight is None else weight
  r = np.where(m, q * _resid(x, y, z), 0.0)
  n = max(m.sum(), 1)
  return np.append(r.sum(), x.T @ r) / n


def _sgd(z, x, y, m, lr=LR, steps=S):
  for s in range(steps):
    if m[s].any():
      z = z - lr * _grad(z, x[s], y[s], m[s])
  return z


def _top_k(v):
  """Top-k of a vector (ties never happen with this data)."""
  flat = v.reshape(-1)
  out = np.zeros_like(flat)
  keep = np.argsort(-np.abs(flat))[:K_TOP]
  out[keep] = flat[keep]
  return out.reshape(v.shape)


def _send(delta, e):
  """Error feedback: (sent, new residual) = (C(Δ + e), Δ + e − C(Δ + e))."""
  v = delta + e
  sent = _top_k(v)
  return sent, v - sent


def _weighted(sent, w):
  return np.tensordot(w, sent, axes=1) / w.sum()


def _close(got, want, atol=2e-6):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=atol)


# ----------------------------------------------------------------------------- the run of each family

CHAIN = {"mean": lambda: fo.aggregators.chain(_stage(), fo.aggregators.mean()),
         "weighted": lambda: fo.aggregators.chain(_stage(), fo.aggregators.weighted_mean())}

LAM, ETA, BETA = 0.5, 0.05, 1.5
FEDEM_START = np.array([[0.1, 0.5, -0.3, 0.2], [-0.2, -0.4, 0.6, 0.1]])  # two components (b, w)
IFCA_PLANTED = np.array([[0.5, 1.0, -1.0, 0.5], [-0.5, -1.0, 1.0, -0.5]])  # two cluster optima (b, w)
IFCA_START = IFCA_PLANTED + np.array([[0.1, -0.1, 0.2, 0.0], [0.0, 0.1, -0.1, 0.2]])
IFCA_GROUPS = ([0, 0, 1, 1], [1, 0, 1, 0])  # each client's planted cluster in rounds 1 and 2: 0 and 3 move

FAMILIES = {
    "ditto": lambda: fo.algorithms.ditto(loss_fn, LAM, ETA, num_clients=N, personal_steps=3,
                                         client_optimizer=optax.sgd(LR), aggregator=CHAIN["weighted"]()),
    "pfedme": lambda: fo.algorithms.pfedme(loss_fn, LAM, ETA, BETA, num_clients=N, local_steps=S, inner_steps=2,
                                           inner_lr=LR, aggregator=CHAIN["mean"]()),
    "per_fedavg": lambda: fo.algorithms.per_fedavg(loss_fn, ETA, LR, local_steps=S // 2, variant="fo",
                                                   aggregator=CHAIN["mean"]()),
    "fedavg_finetune": lambda: fo.algorithms.fedavg_finetune(
        loss_fn, switch_round=1, personalize_steps=1, client_optimizer=optax.sgd(LR),
        finetune_client_optimizer=optax.sgd(2 * LR), finetune_local_steps=1, aggregator=CHAIN["weighted"]()),
    "fedem": lambda: fo.algorithms.fedem(loss_fn, num_components=2, num_clients=N, client_optimizer=optax.sgd(LR),
                                         aggregator=CHAIN["weighted"]()),
    "ifca": lambda: fo.algorithms.ifca(loss_fn, num_clusters=2, num_clients=N, client_optimizer=optax.sgd(LR),
                                       initial_models=_tree(IFCA_START), aggregator=CHAIN["weighted"]()),
}


def _family_batches(name, r):
  return _batches(r, IFCA_PLANTED[list(IFCA_GROUPS[r])] if name == "ifca" else None)


@functools.cache
def _run(name):
  """`(initial params, [state after each round], [batches])` of FAMILIES[name]: one jitted step, ROUNDS rounds."""
  algo = FAMILIES[name]()
  params = {"components": _tree(FEDEM_START), "weights": jnp.full((2,), 0.5)} if name == "fedem" else _initial()
  state = algo.init(params, jax.random.key(0))
  step = jax.jit(algo.step)
  states, rounds = [], [_family_batches(name, r) for r in range(ROUNDS)]
  for batches in rounds:
    state = step(state, batches)
    states.append(state)
  return params, states, rounds


def _check_round_bits(states, p=4):
  """Each client sent top-2 of P entries: a float32 value and a ⌈log₂ P⌉-bit index each."""
  for state in states:
    assert float(state.metrics["bits_up"]) == K_TOP * (32 + int(np.ceil(np.log2(p))))
    assert bool(state.metrics["round_accepted"])


# ----------------------------------------------------------------------------- tests


def test_ditto_with_top_k_matches_numpy():
  """Global: FedAvg of C(Δ + e) weighted by n_k; personal: v ← v − η(∇f(v; D_{s mod S}) + λ(v − w_t)), 3 steps."""
  params, states, rounds = _run("ditto")
  w = _vec(params)
  v = np.tile(w, (N, 1))
  e = np.zeros((N, 4))
  for state, batches in zip(states, rounds):
    x, y, m, n = _np_data(batches)
    sent = []
    for k in range(N):
      s_k, e[k] = _send(_sgd(w, x[k], y[k], m[k]) - w, e[k])
      sent.append(s_k)
      for s in range(3):
        v[k] = v[k] - ETA * (_grad(v[k], x[k, s % S], y[k, s % S], m[k, s % S]) + LAM * (v[k] - w))
    w = w + _weighted(np.stack(sent), n)
    _close(_vec(state.params), w)
    _close(_vec(state.local_params), v)
    _close(_vec(C.residuals(state.aggregator_state)), e)
  _check_round_bits(states)


def test_pfedme_with_top_k_matches_numpy():
  """Client: θ ← K prox steps on f(θ; D_r) + λ/2‖θ − w_i‖², w_i ← w_i − ηλ(w_i − θ); server w + β mean C(Δ + e)."""
  params, states, rounds = _run("pfedme")
  w = _vec(params)
  e = np.zeros((N, 4))
  for state, batches in zip(states, rounds):
    x, y, m, _ = _np_data(batches)
    sent, thetas = [], []
    for k in range(N):
      w_i, theta = w.copy(), w.copy()
      for r in range(S):
        for _ in range(2):
          theta = theta - LR * (_grad(theta, x[k, r], y[k, r], m[k, r]) + LAM * (theta - w_i))
        w_i = w_i - ETA * LAM * (w_i - theta)
      s_k, e[k] = _send(w_i - w, e[k])
      sent.append(s_k)
      thetas.append(theta)
    w = w + BETA * np.mean(sent, axis=0)
    _close(_vec(state.params), w)
    _close(_vec(state.local_params), np.stack(thetas))
    _close(_vec(C.residuals(state.aggregator_state)), e)
  _check_round_bits(states)


def test_per_fedavg_with_top_k_matches_numpy():
  """First order: w̃ = w − α∇f(w; D), w ← w − β∇f(w̃; D'); server: the mean of C(Δ + e)."""
  params, states, rounds = _run("per_fedavg")
  w = _vec(params)
  e = np.zeros((N, 4))
  for state, batches in zip(states, rounds):
    x, y, m, _ = _np_data(batches)
    sent = []
    for k in range(N):
      adapted = w - ETA * _grad(w, x[k, 0], y[k, 0], m[k, 0])
      local = w - LR * _grad(adapted, x[k, 1], y[k, 1], m[k, 1])
      s_k, e[k] = _send(local - w, e[k])
      sent.append(s_k)
    w = w + np.mean(sent, axis=0)
    _close(_vec(state.params), w)
    _close(_vec(C.residuals(state.aggregator_state)), e)
  _check_round_bits(states)


def test_fedavg_finetune_with_top_k_matches_numpy():
  """Round 1: FedAvgM (η = 1, μ = 0.9) on C(Δ + e); round 2: FedAdam (η = 0.01, β₁ = 0.9, β₂ = 0.99, τ = 1e-3,
  v₋₁ = τ²) on the messages of one local step; the residuals carry over from stage 1 to stage 2."""
  params, states, rounds = _run("fedavg_finetune")
  w = _vec(params)
  e = np.zeros((N, 4))
  tau = 1e-3
  mu, nu = np.zeros(4), np.full(4, tau**2)
  for t, (state, batches) in enumerate(zip(states, rounds)):
    x, y, m, n = _np_data(batches)
    sent = []
    for k in range(N):
      local = _sgd(w, x[k], y[k], m[k]) if t == 0 else _sgd(w, x[k], y[k], m[k], lr=2 * LR, steps=1)
      s_k, e[k] = _send(local - w, e[k])
      sent.append(s_k)
    delta = _weighted(np.stack(sent), n)
    if t == 0:
      w = w + delta  # momentum trace 0.9 · 0 + Δ̄
    else:
      g = -delta
      mu, nu = 0.9 * mu + 0.1 * g, 0.99 * nu + 0.01 * g**2
      w = w - 0.01 * mu / (np.sqrt(nu) + tau)
    _close(_vec(state.params), w)
    _close(_vec(C.residuals(state.aggregator_state)), e)
    assert bool(state.metrics["finetuning"]) == (t == 1)
  _check_round_bits(states)


def test_fedem_with_top_k_matches_numpy():
  """E-step q ∝ π_m exp(−ℓ_m), π ← mean q over the real examples, S steps on the q-weighted loss per component;
  the 2 × P stacked component deltas are one message, top-2 of its 8 entries; server: the n_t-weighted mean."""
  params, states, rounds = _run("fedem")
  theta = FEDEM_START.copy()
  pi = np.full((N, 2), 0.5)
  e = np.zeros((N, 2, 4))
  for state, batches in zip(states, rounds):
    x, y, m, n = _np_data(batches)
    sent = []
    for k in range(N):
      losses = np.stack([0.5 * _resid(x[k], y[k], theta[j]) ** 2 for j in range(2)], axis=-1)  # [S, B, M]
      log_joint = np.log(pi[k]) - losses
      q = np.exp(log_joint - log_joint.max(axis=-1, keepdims=True))
      q /= q.sum(axis=-1, keepdims=True)
      new_pi = q[m[k]].sum(axis=0) / m[k].sum()
      local = theta.copy()
      for j in range(2):
        for s in range(S):
          local[j] = local[j] - LR * _grad(local[j], x[k, s], y[k, s], m[k, s], weight=q[s, :, j])
      # the message flattens {"b": [2], "w": [2, 3]} leaf by leaf: b₁ b₂ w₁ w₂
      def flat(a):
        return np.concatenate([a[:, 0], a[:, 1:].reshape(-1)])

      def unflat(v):
        return np.column_stack([v[:2], v[2:].reshape(2, 3)])

      v_sent, v_e = _send(flat(local - theta), flat(e[k]))
      sent.append(unflat(v_sent))
      e[k] = unflat(v_e)
      pi[k] = new_pi
    theta = theta + _weighted(np.stack(sent), n)
    _close(_vec(state.params["components"]), theta)
    _close(state.mixture_weights, pi, atol=1e-6)
    _close(state.params["weights"], pi.mean(axis=0), atol=1e-6)
    _close(_vec(C.residuals(state.aggregator_state)), e)
  _check_round_bits(states, p=8)


def test_ifca_with_top_k_keeps_a_residual_per_cluster_and_matches_numpy():
  """ĵ = argmin_j F_k(θ_j) on the exact broadcast models; e_kĵ ← Δ + e_kĵ − C(Δ + e_kĵ) for the chosen ĵ only;
  θ_j ← θ_j + Σ_{S_j} n_k C(Δ_k + e_kj) / Σ_{S_j} n_k."""
  _, states, rounds = _run("ifca")
  theta = IFCA_START.copy()
  e = np.zeros((N, 2, 4))
  choices = []
  for state, batches in zip(states, rounds):
    x, y, m, n = _np_data(batches)
    sent, chosen = np.zeros((N, 4)), np.zeros(N, int)
    for k in range(N):
      losses = [np.mean(0.5 * _resid(x[k], y[k], theta[j])[m[k]] ** 2) for j in range(2)]
      j = int(np.argmin(losses))
      sent[k], e[k, j] = _send(_sgd(theta[j], x[k], y[k], m[k]) - theta[j], e[k, j])
      chosen[k] = j
    for j in range(2):
      if np.any(chosen == j):
        theta[j] = theta[j] + _weighted(sent[chosen == j], n[chosen == j])
    choices.append(chosen)
    np.testing.assert_array_equal(np.asarray(state.cluster_of), chosen)
    _close(_vec(state.cluster_params), theta)
    _close(_vec(C.residuals(state.aggregator_state)), e)
  np.testing.assert_array_equal(choices, IFCA_GROUPS)  # the clients follow their planted clusters
  moved = choices[0] != choices[1]
  assert moved.any()
  # a client that moved holds a residual for both clusters: the first stayed as round 1 left it
  assert np.all(np.abs(e[moved]).sum(axis=-1) > 0)
  _check_round_bits(states)


@pytest.mark.parametrize("name,why", [
    ("feddyn", r"h = \(1/m\) Σ_k g_k"),
    ("clustered_fl", r"split on the compression error"),
])
def test_factories_whose_maths_needs_the_exact_upload_refuse_compression_saying_why(name, why):
  make = {"feddyn": lambda agg: fo.algorithms.feddyn(loss_fn, 0.1, num_clients=N, client_optimizer=optax.sgd(LR),
                                                     aggregator=agg),
          "clustered_fl": lambda agg: fo.algorithms.clustered_fl(loss_fn, eps_1=1.0, eps_2=0.0, max_clusters=2,
                                                                 num_clients=N, client_optimizer=optax.sgd(LR),
                                                                 aggregator=agg)}[name]
  with pytest.raises(ValueError, match=rf"^{name} cannot compose with the aggregator's client stage "
                                       rf"compress\(top_k\(k=2\), error_feedback\): .*{why}") as info:
    make(CHAIN["mean"]())
  assert "\n" not in str(info.value)
