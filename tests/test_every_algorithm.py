"""Every algorithm of `fo.algorithms` on an awkward round, under every client map.

For every factory (tests/algorithm_examples.py lists them all), under
`vmap`, `sequential` and `chunked:3` (the diagonal in the default tier, every
cell in the slow one), a few rounds in which client 1's data holds a NaN (so
whatever it computes is non-finite) and client 2 has no example. One jitted
program runs each round twice, from the `[C, S, B, ...]` arrays and from
`DeferredData` over a store in another client and slot order, and one test
checks what these rounds must show:

* a non-finite client never spreads: every floating-point entry of the state
  stays finite (the server model, the other clients' models, duals, control
  variates, optimizer and aggregator states); the poisoned client's own
  per-client state (`local_params`, or its row of sharing ADMM's feature
  blocks) stays at its last finite value, here its initial one; the event is
  counted: `metrics["num_nonfinite"]` is 1 in every round in which the
  poisoned client computed something; the round counter counts every round;
* the bits a client sends and receives are reported (`bits_up`,
  `bits_down`), finite, non-negative float32 scalars, after `init` and after
  the rounds (tests/test_bits_metrics.py checks their values family by family);
* deferred data is the same data: the deferred rounds reach the eager rounds'
  state (the `DeferredData` is an argument of the jitted program, so the
  deferred path is what runs inside; the eager round is the reference, checked
  against NumPy in the algorithms' own tests).

In the default tier the deferred comparison runs on one factory per way a
round reads its data (`DEFERRED_DEFAULT_TIER`); the other factories' cells
run the eager rounds alone, one step compiled instead of two, and check the
rest. The slow tier compares every cell.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm_examples import EXAMPLES, example_inputs
from conftest import diagonal

import fedjax_opt as fo
from fedjax_opt.core import DeferredData
from fedjax_opt.data.sampling import deferred_gather

POISONED, EMPTY = 1, 2
ROUNDS = 3
MODES = ["vmap", "sequential", "chunked:3"]
DEFERRED_DEFAULT_TIER = {
    "fedavg", "scaffold", "pfedme", "per_fedavg", "l2sgd_plus", "admm_consensus", "admm_sharing", "fedmd", "fedbuff",
    "gossip", "ifca", "dane", "cocoa"}
"""The factories whose deferred rounds the default tier compares with the eager ones: one per way a round reads
its data (local steps, a per-client table, inner loops, D and D' batches, fixed example slots, a whole-split local
problem, feature blocks, public data, arrivals, every node, every cluster's loss, several exchanges, per-example
dual steps). The slow tier compares every factory; the other factories' default cells run the eager rounds alone
(a program of one step instead of two), with every other check."""


def _cells(with_deferred: bool):
  """The (factory, client map) cells of one of the two tests below, each `pytest.param` marked as its tier."""
  cells = []
  for p in diagonal(sorted(EXAMPLES), MODES):
    name, _ = p.values
    on_diagonal = not p.marks
    if with_deferred:  # every cell; by default only the diagonal of DEFERRED_DEFAULT_TIER
      cells.append(p if on_diagonal and name in DEFERRED_DEFAULT_TIER else pytest.param(*p.values,
                                                                                         marks=pytest.mark.slow))
    elif on_diagonal and name not in DEFERRED_DEFAULT_TIER:  # the rest of the diagonal, eager rounds only
      cells.append(p)
  return cells


def _stored(batches):
  """The batches' data as a packed store of one more client, in another order, and a `DeferredData` reading it.

  Client c's examples sit in store row `rows[c]` (row 0 is a client of
  constant junk no one reads), its S·B examples in shuffled slots, so a
  gather that reads the wrong row or slot, or a map that runs over the store
  as if it were per-client data, gives other numbers or fails. The `take` is
  the sampler's own (`deferred_gather`), every slot read as stored (the mask
  is the batches' business).
  """
  c, s, b = batches.mask.shape
  rng = np.random.default_rng(7)
  rows = 1 + rng.permutation(c)
  slots = np.stack([rng.permutation(s * b) for _ in range(c)]).reshape(c, s, b)

  def store(leaf):
    leaf = np.asarray(leaf)
    out = np.full((c + 1, s * b + 1) + leaf.shape[3:], 100.0, leaf.dtype)
    out[:, -1] = 0  # the zero slot
    for k in range(c):
      out[rows[k], slots[k].reshape(-1)] = leaf[k].reshape((s * b,) + leaf.shape[3:])
    return jnp.asarray(out)

  zeros = jnp.zeros(c + 1, jnp.int32)
  dataset = fo.data.FederatedDataset(examples=jax.tree.map(store, batches.data), train_count=zeros, test_start=zeros,
                                     test_count=zeros, max_train=s * b, zero_index=s * b)
  return deferred_gather(dataset, jnp.asarray(rows, jnp.int32), jnp.asarray(slots, jnp.int32),
                         jnp.ones((c, s, b), bool))


def _float_leaves(tree):
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
          if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]


def _own_rows(name, state):
  """The poisoned client's own per-client state, or None where the algorithm keeps none."""
  if name == "admm_sharing":
    return state.params[POISONED]
  if name == "cocoa":  # the client's block of dual variables
    return state.duals[POISONED]
  if hasattr(state, "local_params"):
    return jax.tree.map(lambda t: t[POISONED], state.local_params)
  return None


def _rounds(name, mode, deferred=True):
  """`(initial state, [(eager state, deferred state)] after each of ROUNDS rounds)` of `name` under `mode`
  (without `deferred`: the eager state twice, one step compiled)."""
  algo = EXAMPLES[name](client_map=mode)
  params, batches = example_inputs(name, poisoned=POISONED)
  batches = batches.replace(mask=batches.mask.at[EMPTY].set(False))
  lazy = _stored(batches)
  state = algo.init(params, jax.random.key(0))

  @jax.jit
  def both(want, got, batches, lazy):
    assert isinstance(lazy, DeferredData)
    if not deferred:
      eager = algo.step(want, batches)
      return eager, eager
    return algo.step(want, batches), algo.step(got, batches.replace(data=lazy))

  states, want, got = [], state, state
  for _ in range(ROUNDS):
    want, got = both(want, got, batches, lazy)
    states.append((want, got))
  assert both._cache_size() == 1  # every round reuses the program
  return state, states


def _check_a_nan_client_never_spreads(name, initial, states):
  counted = []
  for r, (state, _) in enumerate(states):
    bad = [path for path, leaf in _float_leaves(state) if not np.all(np.isfinite(np.asarray(leaf)))]
    assert not bad, f"{name}: round {r} made {bad} non-finite"
    assert "num_nonfinite" in state.metrics, f"{name}: the round metrics do not count non-finite clients"
    counted.append(int(state.metrics["num_nonfinite"]))
  assert set(counted) <= {0, 1} and sum(counted) >= 1, f"{name}: num_nonfinite per round {counted}"
  assert int(states[-1][0].round) == ROUNDS  # the round counter counts every round, a poisoned one included
  own_before = _own_rows(name, initial)
  if own_before is not None:
    for a, b in zip(jax.tree.leaves(_own_rows(name, states[-1][0])), jax.tree.leaves(own_before)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _check_bits_up_and_down(name, initial, states):
  for label, metrics in (("init", initial.metrics), ("round", states[-1][0].metrics)):
    for key in ("bits_up", "bits_down"):
      assert key in metrics, f"{name}: no {key} in the metrics after {label}"
      value = metrics[key]
      assert jnp.shape(value) == () and jnp.result_type(value) == jnp.float32, (name, label, key)
      assert np.isfinite(float(value)) and float(value) >= 0, (name, label, key, value)


def _check_deferred_is_eager(name, mode, states):
  for r, (want, got) in enumerate(states):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      if jnp.issubdtype(jnp.asarray(a).dtype, jax.dtypes.prng_key):
        continue
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                 err_msg=f"{name} {mode} round {r} {jax.tree_util.keystr(path)}")


# One test, not three sharing a cache: a test that read another's results would not run the algorithm's code
# itself, and mutation testing (tools/mutation.py) runs only the tests that reach a mutated function.
@pytest.mark.parametrize("name,mode", _cells(with_deferred=True))
def test_every_algorithm_steps_the_same_on_deferred_data_and_a_nan_client_never_spreads(name, mode):
  initial, states = _rounds(name, mode)
  _check_a_nan_client_never_spreads(name, initial, states)
  _check_bits_up_and_down(name, initial, states)
  _check_deferred_is_eager(name, mode, states)


@pytest.mark.parametrize("name,mode", _cells(with_deferred=False))
def test_every_algorithm_keeps_a_nan_client_from_spreading_and_reports_its_bits(name, mode):
  initial, states = _rounds(name, mode, deferred=False)
  _check_a_nan_client_never_spreads(name, initial, states)
  _check_bits_up_and_down(name, initial, states)
