"""The non-finite rule (`fedjax_opt.core.server.finite_clients`), walked over every algorithm that exchanges messages.

One round from the same state, three times in one jitted program, with client 1 (`POISONED`):

* poisoned with NaN in its data (tests/algorithm_examples.py), so whatever it sends is not finite;
* poisoned with +Inf in all of its features instead: a different non-finite message;
* absent: clean data at weight 0 (the reference for the algorithms where weight 0 means "takes no part").

For every factory the poisoned round must show the rule: `metrics["num_nonfinite"]` counts the client (1); no
floating-point entry of the state (the server model, every client's model, duals, trackers, optimizer states) holds
a NaN or an Inf; and what the dropped client sent reaches nobody: the NaN round and the Inf round end in the same
state bit for bit, so nothing another client or the server holds depends on the dropped message. Where a client at
weight 0 takes no part (`ABSENT_AT_WEIGHT_ZERO`, every family but those whose nodes all step every round), the
server model after the poisoned round is the one of the round without the client.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm_examples import EXAMPLES, example_inputs

POISONED = 1

EVERY_NODE_STEPS = {"d_fedem", "gadmm", "cq_ggadmm", "mixture_admm", "gossip", "dpsgd", "gradient_tracking"}
"""Factories whose nodes all take part every round whatever their weight (decentralized mixing, GADMM, mixture
ADMM): a dropped node keeps its previous rows (`core.server.keep_rows`) and its kept row still counts in the average
of the nodes' models, so "the round without the client" is not a weight-0 round there; the Inf/NaN comparison and the
finiteness checks cover them."""

ABSENT_AT_WEIGHT_ZERO = sorted(set(EXAMPLES) - EVERY_NODE_STEPS)

DEFAULT_TIER = {"fedavg", "scaffold", "pfedme", "fedem", "d_fedem", "fedmd", "l2gd", "l2sgd_plus", "dane", "giant",
                "cocoa", "admm_consensus", "admm_sharing", "gadmm", "mixture_admm", "gossip", "gradient_tracking",
                "p2p_bayes", "fedbuff", "clustered_fl"}
"""One factory per family that states the rule itself (and the round engine's own users, fedavg and scaffold);
the other factories run in the slow tier."""


def _cells():
  return [pytest.param(name, marks=() if name in DEFAULT_TIER else pytest.mark.slow) for name in EXAMPLES]


def _float_leaves(tree):
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
          if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]


def _with_inf(batches):
  x = batches.data["x"]
  return batches.replace(data={**batches.data, "x": x.at[POISONED].set(jnp.inf)})


@pytest.mark.parametrize("name", _cells())
def test_a_nonfinite_client_is_dropped_counted_and_reaches_nobody(name):
  algo = EXAMPLES[name]()
  params, poisoned = example_inputs(name, poisoned=POISONED)
  _, clean = example_inputs(name)
  absent = clean.replace(weight=clean.weight.at[POISONED].set(0.0))
  state = algo.init(params, jax.random.key(0))

  @jax.jit
  def rounds(state, nan_batches, inf_batches, absent_batches):
    return algo.step(state, nan_batches), algo.step(state, inf_batches), algo.step(state, absent_batches)

  with_nan, with_inf, without = rounds(state, poisoned, _with_inf(poisoned), absent)

  for label, got in (("NaN", with_nan), ("Inf", with_inf)):
    assert int(got.metrics["num_nonfinite"]) == 1, f"{name}: the {label} client is not counted"
    bad = [path for path, leaf in _float_leaves(got) if not np.all(np.isfinite(np.asarray(leaf)))]
    assert not bad, f"{name}: the {label} client made {bad} non-finite"

  # What the dropped client sent reaches nobody: a different non-finite message, the same round.
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(with_nan), jax.tree.leaves(with_inf)):
    if jnp.issubdtype(jnp.asarray(a).dtype, jax.dtypes.prng_key):
      continue
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {jax.tree_util.keystr(path)}")

  if name in ABSENT_AT_WEIGHT_ZERO:  # the server's step is the step of the round without the client
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(with_nan.params), jax.tree.leaves(without.params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                 err_msg=f"{name}: params{jax.tree_util.keystr(path)}")
