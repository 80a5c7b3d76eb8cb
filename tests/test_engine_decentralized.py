"""The decentralized families' local work through `core.rounds.client_round`: the round engine's rules in their form.

Gossip, D-PSGD, gradient tracking, P2P Bayes and D-FedEM run every node's local step as one `client_round`
without an aggregator and then mix over the graph (x ← W x, `core.mixing`). Checked here: the client maps give the
same states; a NaN node is dropped, counted and keeps its rows under every map; every node takes part whatever its
batch weight (a weight-0 node still steps, as before the port); a node whose loss alone is not finite (its update
finite) is dropped too (the modules' rule: "Δ_i, ∇f_i or its loss"); a node without data keeps its last gradient
(gradient tracking) and is not counted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm_examples import EXAMPLES, example_inputs, loss_fn

import fedjax_opt as fo
from conftest import run_rounds

NODES = ("gossip", "dpsgd", "gradient_tracking", "p2p_bayes", "d_fedem")
BAD = 1


def _run(algo, params, batches, rounds=2):
  return run_rounds(algo.step, algo.init(params, jax.random.key(0)), batches, rounds)[0]


def _floats(state):
  return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(state)
          if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]


def _assert_close(a, b, atol):
  for (path, x), (_, y) in zip(_floats(a), _floats(b)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=atol, err_msg=path)


@pytest.mark.parametrize("name", NODES)
@pytest.mark.parametrize("poisoned", [pytest.param(None, marks=pytest.mark.slow), BAD])  # clean: slow tier
def test_sequential_and_chunked_maps_give_the_vmap_state(name, poisoned):
  params, batches = example_inputs(name, poisoned=poisoned)
  runs = {mode: _run(EXAMPLES[name](client_map=mode), params, batches) for mode in ("vmap", "sequential", "chunked:3")}
  for mode in ("sequential", "chunked:3"):
    _assert_close(runs[mode], runs["vmap"], atol=1e-6)
    assert int(runs[mode].metrics["num_nonfinite"]) == (poisoned is not None)
  if poisoned is not None:  # the dropped node kept its rows, bit for bit, under every map
    start = EXAMPLES[name]().init(params, jax.random.key(0))
    for state in runs.values():
      rows = state.log_beliefs if name == "p2p_bayes" else state.local_params
      old = start.log_beliefs if name == "p2p_bayes" else start.local_params
      for new, was in zip(jax.tree.leaves(rows), jax.tree.leaves(old)):
        np.testing.assert_array_equal(np.asarray(new)[BAD], np.asarray(was)[BAD])


@pytest.mark.parametrize("name", NODES)
def test_every_node_takes_part_whatever_its_batch_weight(name):
  """The nodes' batch weights are not read (every node steps every round): a weight-0 node changes nothing."""
  params, batches = example_inputs(name)
  algo = EXAMPLES[name]()
  zero = batches.replace(weight=batches.weight.at[BAD].set(0.0))
  for (path, a), (_, b) in zip(_floats(_run(algo, params, batches)), _floats(_run(algo, params, zero))):
    np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.parametrize("name", ["gossip", "dpsgd", "gradient_tracking"])
def test_a_node_whose_loss_alone_is_not_finite_is_dropped(name):
  """Node 1's loss is +Inf while its gradient stays finite (the Inf is outside the gradient): it is counted and
  keeps its rows, as a node whose update is not finite."""
  factory = {"gossip": fo.algorithms.gossip, "dpsgd": fo.algorithms.dpsgd,
             "gradient_tracking": fo.algorithms.gradient_tracking}[name]
  flagged = lambda p, batch: loss_fn(p, batch) + jax.lax.stop_gradient(batch["flag"])  # noqa: E731
  algo = factory(flagged, 0.01, graph=fo.graphs.metropolis_hastings(fo.graphs.ring(4)))
  params, batches = example_inputs(name)
  flag = jnp.zeros(batches.mask.shape).at[BAD].set(jnp.inf)
  state0 = algo.init(params, jax.random.key(0))
  state = jax.jit(algo.step)(state0, batches.replace(data={**batches.data, "flag": flag}))
  assert int(state.metrics["num_nonfinite"]) == 1
  for new, old in zip(jax.tree.leaves(state.local_params), jax.tree.leaves(state0.local_params)):
    np.testing.assert_array_equal(np.asarray(new)[BAD], np.asarray(old)[BAD])
  assert all(np.all(np.isfinite(leaf)) for _, leaf in _floats(state))


def test_gradient_tracking_a_node_without_data_keeps_its_last_gradient():
  params, batches = example_inputs("gradient_tracking")
  algo = EXAMPLES["gradient_tracking"]()
  step = jax.jit(algo.step)
  first = step(algo.init(params, jax.random.key(0)), batches)
  second = step(first, batches.replace(mask=batches.mask.at[BAD].set(False)))
  assert int(second.metrics["num_nonfinite"]) == 0
  for new, old in zip(jax.tree.leaves(second.gradients), jax.tree.leaves(first.gradients)):
    np.testing.assert_array_equal(np.asarray(new)[BAD], np.asarray(old)[BAD])
    assert not np.array_equal(np.asarray(new)[BAD - 1], np.asarray(old)[BAD - 1])  # the others moved on
