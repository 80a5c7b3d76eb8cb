"""The composition matrix (`fo.aggregators.composition`), cell by cell, against the library and float64 NumPy.

The cells: every stack of `composition.stacks()` — each ordering of a subset
of {C (top-k compression stage), A (sign-flip attack on row 3), SA (secure
aggregation)} around exactly one rule M (mean), DP (`dp_mean`, σ = 0) or R
(marginal median), C also after the rule — 21 orderings × 3 rules = 63
uplinks, each without and with D (the server's broadcast compressed by
top-k with error feedback, chained last) = 126 stacks, under each of fedavg,
ditto, scaffold, feddyn: 504 cells, 83 of which compose (fedavg 40, ditto
40, scaffold 2, feddyn 1) and 421 are refused (SCAFFOLD and FedDyn declare
why they take no downlink).

* Every cell's verdict, decided from traits alone, is what the constructors
  (`chain`, `corrupt`, `secure_aggregation`, `dp_mean`) and the factories do:
  a composing stack builds, with exactly the traits the composition module
  computed, and its algorithm accepts it; a refused one raises one line that
  names both pieces the module names.
* Every composing cell (all 43 uplink cells and four of their 40 downlink twins
  in the default tier, the other 36 twins in the slow tier) runs one jitted round on the tiny least-squares problem
  of tests/algorithm_examples.py (4 clients, 2 local SGD steps) and is
  compared with a float64 NumPy transcription of its pipeline: local SGD (with
  Ditto's personal steps, SCAFFOLD's control variates, FedDyn's correction
  where it applies) → top-k of each message → the attacker's row replaced by
  −2 × its own → the rule (mean; dp_mean's clip to C and fixed denominator m;
  the coordinate-wise median) → with D, the broadcast x̂ = x + top-k(u) and the
  server's error u − top-k(u) (u the server's step); inside secure aggregation each term clipped to
  [−B, B] (and a DP term clipped again to C − √P·2^−f) and the sum compared
  within the fixed-point resolution, 2^−f per term over the denominator.
  DP runs with σ = 0 so that clipping is what is checked; the noise is
  covered by tests/test_privacy.py and by
  test_compression_composition.py::test_dp_mean_noise_after_compression_has_std_sigma_clip_over_m.
* docs/privacy.md's generated block is exactly `composition.markdown()`
  (tools/composition_matrix.py prints it).
"""

from __future__ import annotations

import math
import pathlib

import jax
import numpy as np
import optax
import pytest
from algorithm_examples import S, example_inputs, loss_fn
from algorithm_examples import flat_params as _vec, flat_table as _rows, lsq_gradient as _grad

import fedjax_opt as fo

co = fo.aggregators.composition
SETTINGS = co.Settings()
LR, LAM, ETA, ALPHA = 0.05, 0.1, 0.05, 0.1
P = 4  # b, then w[3]
ROOT = pathlib.Path(__file__).resolve().parents[1]
CELLS = co.cells()
START, END = "<!-- composition-matrix:start -->", "<!-- composition-matrix:end -->"


def _algorithm(name, aggregator):
  n = 4
  if name == "fedavg":
    return fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(LR), aggregator=aggregator)
  if name == "ditto":
    return fo.algorithms.ditto(loss_fn, LAM, ETA, num_clients=n, personal_steps=2, client_optimizer=optax.sgd(LR),
                               aggregator=aggregator)
  if name == "scaffold":
    return fo.algorithms.scaffold(loss_fn, LR, 1.0, num_clients=n, aggregator=aggregator)
  if name == "feddyn":
    return fo.algorithms.feddyn(loss_fn, ALPHA, num_clients=n, client_optimizer=optax.sgd(LR), aggregator=aggregator)
  raise AssertionError(name)


# ----------------------------------------------------------------------------- the enumeration


def test_the_enumeration_has_every_cell_once():
  stacks = co.stacks()
  assert len(stacks) == len(set(stacks)) == 126
  assert len(CELLS) == len({c.id for c in CELLS}) == 504
  composing = {}
  for cell in CELLS:
    composing[cell.algorithm] = composing.get(cell.algorithm, 0) + cell.verdict.composes
  assert composing == {"fedavg": 40, "ditto": 40, "scaffold": 2, "feddyn": 1}
  for stack in stacks:  # every stack: one rule, each piece at most once, only C (or D, last) after the rule
    assert sum(s in co.RULES for s in stack) == 1 and len(set(stack)) == len(stack)
    assert "D" not in stack[:-1]
  uplinks = [stack for stack in stacks if "D" not in stack]
  assert sorted(stacks) == sorted(uplinks + [stack + ("D",) for stack in uplinks])


# ----------------------------------------------------------------------------- verdicts against the library


def _raised(fn):
  try:
    fn()
  except (TypeError, ValueError) as e:
    return str(e)
  return None


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_cell_verdict_is_what_the_constructors_and_the_factory_do(cell):
  v = cell.verdict
  built = {}
  error = _raised(lambda: built.setdefault("aggregator", co.build(cell.stack, SETTINGS)))
  if error is None:
    assert built["aggregator"].traits == v.traits  # the traits computed from the table are the built ones
    error = _raised(lambda: _algorithm(cell.algorithm, built["aggregator"]))
  if v.composes:
    assert error is None, f"{cell.id}: the module says it composes, the library refused: {error}"
    return
  assert error is not None, f"{cell.id}: the module says {v.reason!r}, the library accepted it"
  assert "\n" not in error and "\n" not in v.reason
  assert all(piece in v.reason for piece in v.pieces)
  assert all(piece in error for piece in v.pieces), f"{cell.id}: {error!r} does not name {v.pieces}"


# ----------------------------------------------------------------------------- NumPy transcriptions


def _sgd(z, x, y, lr, correction=lambda v: 0.0, steps=S):
  for s in range(steps):
    z = z - lr * (_grad(z, x[s % x.shape[0]], y[s % y.shape[0]]) + correction(z))
  return z


def _top_k(v, k):
  out = np.zeros_like(v)
  keep = np.argsort(-np.abs(v), kind="stable")[:k]  # ties to the lower index
  out[keep] = v[keep]
  return out


def _clip(rows, c):
  return rows * np.minimum(1.0, c / np.linalg.norm(rows, axis=1))[:, None]


def _aggregate(stack, sent):
  """The server's update from the messages as sent (after the client stage): attack, then the rule (in SA or not).
  Returns (update, atol of the fixed point, whether some DP row was clipped)."""
  received = sent.copy()
  if "A" in stack:
    for row in SETTINGS.attackers:
      received[row] = -SETTINGS.attack_scale * sent[row]
  rule = next(s for s in stack if s in co.RULES)
  secure = "SA" in stack
  resolution = 2.0 ** -SETTINGS.frac_bits
  n = received.shape[0]
  clipped = False
  if rule == "R":
    return np.median(received, axis=0), 0.0, clipped
  if rule == "M":
    terms, denominator = received, n
  else:
    terms, denominator = _clip(received, SETTINGS.clip_norm), SETTINGS.expected_clients
    clipped = bool(np.any(np.linalg.norm(received, axis=1) > SETTINGS.clip_norm))
    if secure:
      terms = _clip(terms, SETTINGS.clip_norm - math.sqrt(P) * resolution)
  if secure:
    terms = np.clip(terms, -SETTINGS.bound, SETTINGS.bound)
  return terms.sum(0) / denominator, (n * resolution / denominator if secure else 0.0), clipped


def _compress(stack, v):
  return _top_k(v, SETTINGS.top_k) if "C" in stack else v


def _reference(cell, params, batches):
  """float64 NumPy: {field: (want, atol)} after one round, and whether DP's clip was exercised."""
  xs, ys = np.asarray(batches.data["x"], np.float64), np.asarray(batches.data["y"], np.float64)
  z, n = _vec(params), xs.shape[0]
  if cell.algorithm == "feddyn":
    # g_k = 0: local objective + α(x − θ⁰); h = −(α/N) ΣΔ_k; θ¹ = θ⁰ + u − h/α
    ys_local = [_sgd(z, xs[k], ys[k], LR, correction=lambda v: ALPHA * (v - z)) for k in range(n)]
    deltas = np.stack(ys_local) - z
    update, atol, clipped = _aggregate(cell.stack, np.stack([_compress(cell.stack, d) for d in deltas]))
    h = -ALPHA * deltas.sum(0) / n
    return {"params": (z + update - h / ALPHA, atol), "h": (h, 0.0)}, clipped
  deltas = np.stack([_sgd(z, xs[k], ys[k], LR) - z for k in range(n)])  # c = c_i = 0 for SCAFFOLD's first round
  update, atol, clipped = _aggregate(cell.stack, np.stack([_compress(cell.stack, d) for d in deltas]))
  want = {"params": (z + update, atol)}
  if "D" in cell.stack:  # the server's step u = Δ (SGD(1) on −Δ) broadcast as m = top-k(u + e), e = 0 in round 1
    sent = _top_k(update, SETTINGS.top_k)
    want = {"params": (z + sent, atol), "downlink_error": (update - sent, atol)}
  if cell.algorithm == "scaffold":  # option II: c_i⁺ = −Δy_i/(K η_l), c⁺ = (1/N) Σ C(Δc_i), η_g = 1
    new_c = -deltas / (S * LR)
    want["control_variate"] = (np.stack([_compress(cell.stack, d) for d in new_c]).sum(0) / n, 0.0)
    want["client_control_variates"] = (new_c, 0.0)
  if cell.algorithm == "ditto":
    # v_i ← v_i − η(∇f_i(v_i) + λ(v_i − w)), 2 steps from v_i = w, cycling the batches
    want["local_params"] = (np.stack([_sgd(z, xs[k], ys[k], ETA, correction=lambda v: LAM * (v - z), steps=2)
                                      for k in range(n)]), 0.0)
  return want, clipped


def _got(state, field):
  value = getattr(state, field)
  return _rows(value) if field in ("client_control_variates", "local_params") else _vec(value)


COMPOSING = [c for c in CELLS if c.verdict.composes]
D_IN_DEFAULT_TIER = {"fedavg:M-D", "ditto:DP-D", "fedavg:C-A-R-D", "ditto:C-SA-DP-D"}
"""The downlink's twins of the uplink stacks compile a round each (40 of them); these four run in the default tier,
the others in the slow tier (CI runs both). Every uplink stack's own cell runs in the default tier, and every
factory's downlink is checked against its plain run by test_convention.py."""


def _tiered(cell):
  slow = "D" in cell.stack and cell.id not in D_IN_DEFAULT_TIER
  return pytest.param(cell, id=cell.id, marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("cell", [_tiered(c) for c in COMPOSING])
def test_composing_cell_is_one_round_of_its_numpy_transcription(cell):
  params, batches = example_inputs("fedavg")
  algo = _algorithm(cell.algorithm, co.build(cell.stack, SETTINGS))
  state = jax.jit(algo.step)(algo.init(params, jax.random.key(0)), batches)
  assert bool(state.metrics["round_accepted"])
  want, clipped = _reference(cell, params, batches)
  if "DP" in cell.stack:
    assert clipped  # the clip is exercised
  for field, (value, atol) in want.items():
    np.testing.assert_allclose(_got(state, field), value, rtol=1e-5, atol=atol + 1e-6, err_msg=f"{cell.id} {field}")


# ----------------------------------------------------------------------------- the docs


def test_docs_matrix_is_the_generated_table():
  text = (ROOT / "docs" / "privacy.md").read_text()
  assert text.count(START) == 1 and text.count(END) == 1
  block = text.split(START, 1)[1].split(END, 1)[0]
  assert block.strip("\n") == co.markdown(SETTINGS).strip("\n"), "run: python tools/composition_matrix.py --write"
