"""Every algorithm reports the bits a client sends (`bits_up`) and receives (`bits_down`) in its round metrics.

That every factory of `tests/algorithm_examples.py` reports both, finite,
non-negative float32 scalars, is checked in tests/test_every_algorithm.py. For
the families with their own exchange (the loopless mixture methods, ADMM,
GADMM, the decentralized ones, D-FedEM, P2P Bayes) the value equals a count
by hand from the examples' model (w `[D]` and b, so P = D + 1 parameters,
32 P bits per float32 model-sized message) and what the algorithm sends: a
ring where every node has two neighbours, a chain whose end nodes have one,
a coin that decides when L2GD communicates.

Each run is one jitted call that returns only the metrics the test reads, so
XLA leaves out what they do not depend on and the file stays fast. The runs
are not shared between tests: a test that reused another's compiled run would
not execute the algorithm's Python code, and mutation testing
(tools/mutation.py), which runs only the tests that reach a mutated function,
would never run it on the mutants of the bits it checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from algorithm_examples import B, D, EXAMPLES, N, example_inputs, loss_fn

P = D + 1
"""Parameters of the examples' model: w `[D]` and the scalar b."""

MODEL = 32 * P
"""Bits of one float32 model-sized message."""

RING_DEGREE = 2
"""Neighbours of every node of a ring (N = 4)."""

CHAIN_DEGREES = np.array([1, 2, 2, 1])
"""Neighbours of each node of the chain 0 − 1 − 2 − 3."""

READ = ("bits_up", "bits_down", "bytes_sent", "bits", "transmissions", "communicated")
"""The metrics a run returns (those an algorithm has): the counts of what was sent, nothing else."""


def _gossip_on_a_chain():
  return fo.algorithms.gossip(loss_fn, 0.01, graph=fo.graphs.metropolis_hastings(fo.graphs.chain(N)))


def _cq_ggadmm_uncensored():
  return fo.algorithms.cq_ggadmm(loss_fn, 1.0, 0.0, graph=fo.graphs.chain(N), bits=8, client_optimizer=optax.sgd(0.01))


def _runner(name, steps, factory=None, **options):
  """(algorithm, jitted run): `run(state, batches)` takes `steps` steps and returns the `READ` metrics of each."""
  algorithm = factory() if factory is not None else EXAMPLES[name](**options)

  def run(state, batches):
    history = []
    for _ in range(steps):
      state = algorithm.step(state, batches)
      history.append({key: value for key, value in state.metrics.items() if key in READ})
    return history

  return algorithm, jax.jit(run)


def _history(name, steps=1, *, factory=None, batches=None, seed=0, **options):
  """The `READ` metrics after each of `steps` steps from `init` on the example's inputs (or `batches`)."""
  algorithm, run = _runner(name, steps, factory, **options)
  params, example_batches = example_inputs(name)
  state = algorithm.init(params, jax.random.key(seed))
  return [{key: float(value) for key, value in metrics.items()}
          for metrics in run(state, example_batches if batches is None else batches)]


def _bits(metrics):
  return metrics["bits_up"], metrics["bits_down"]


def test_the_examples_model_has_p_float32_parameters():
  params, _ = example_inputs("fedavg")
  assert sum(np.size(leaf) for leaf in jax.tree.leaves(params)) == P
  assert all(jnp.result_type(leaf) == jnp.float32 for leaf in jax.tree.leaves(params))


# ----------------------------------------------------------------------------- decentralized: gossip through W


@pytest.mark.parametrize("name", ["gossip", "dpsgd"])
def test_gossip_and_dpsgd_send_and_receive_one_model_per_neighbour(name):
  (metrics,) = _history(name)
  assert _bits(metrics) == (RING_DEGREE * MODEL, RING_DEGREE * MODEL)
  assert metrics["bytes_sent"] * 8 == metrics["bits_up"]


def test_gossip_on_a_chain_averages_the_degrees():
  (metrics,) = _history("gossip", factory=_gossip_on_a_chain)
  assert _bits(metrics) == (CHAIN_DEGREES.mean() * MODEL, CHAIN_DEGREES.mean() * MODEL)  # 1.5 · 32 P


def test_a_node_cut_out_of_the_ring_sends_and_receives_nothing():
  # Node 0 fails: its two edges go, leaving the path 1 − 2 − 3 (degrees 0, 1, 2, 1).
  _, batches = example_inputs("gossip", poisoned=0)
  (metrics,) = _history("gossip", batches=batches)
  assert _bits(metrics) == ((0 + 1 + 2 + 1) / N * MODEL, (0 + 1 + 2 + 1) / N * MODEL)


def test_gradient_tracking_sends_x_and_y_to_its_matched_partner():
  # The example gossips over random maximal matchings of K_4, which are perfect: one partner per node and
  # round, two vectors (x through W^(k), y through W^(k−1)) each way.
  (metrics,) = _history("gradient_tracking")
  assert _bits(metrics) == (2 * MODEL, 2 * MODEL)


def test_d_fedem_sends_its_components_to_each_neighbour():
  m = 2  # the example's components
  (metrics,) = _history("d_fedem")
  assert _bits(metrics) == (RING_DEGREE * m * MODEL, RING_DEGREE * m * MODEL)


def test_p2p_bayes_sends_its_log_beliefs_to_each_neighbour():
  k = 3  # the example's hypotheses
  (metrics,) = _history("p2p_bayes")
  assert _bits(metrics) == (RING_DEGREE * 32 * k, RING_DEGREE * 32 * k)


# ----------------------------------------------------------------------------- GADMM and CQ-GGADMM on a chain


def test_gadmm_every_worker_broadcasts_its_model_to_its_neighbours():
  (metrics,) = _history("gadmm")
  assert _bits(metrics) == (MODEL, CHAIN_DEGREES.mean() * MODEL)
  assert metrics["bits"] == N * MODEL


def test_cq_ggadmm_counts_each_quantized_broadcast_and_nothing_when_censored():
  q = 8 * P + 32  # b = 8 bits per coordinate and the range R as a float32
  (uncensored,) = _history("cq_ggadmm", factory=_cq_ggadmm_uncensored)  # τ₀ = 0: every worker transmits
  assert uncensored["transmissions"] == N
  assert _bits(uncensored) == (q, CHAIN_DEGREES.mean() * q)
  (censored,) = _history("cq_ggadmm")  # the example's τ₀ = 0.1 censors every first change
  assert censored["transmissions"] == 0 and _bits(censored) == (0.0, 0.0)


# ----------------------------------------------------------------------------- L2GD, L2SGD, L2SGD+


@pytest.mark.parametrize("name, options, vectors", [("l2gd", {}, 1), ("l2sgd", {}, 1), ("l2sgd_plus", {}, 3),
                                                    ("l2sgd_plus", {"variant": "efficient"}, 1)])
def test_loopless_methods_exchange_models_only_when_they_communicate(name, options, vectors):
  # Seed 4 draws the coins ξ = 0 (a local step), then ξ = 1: the devices communicate at the second step.
  first, second = _history(name, 2, seed=4, **options)
  assert (first["communicated"], second["communicated"]) == (0.0, 1.0)
  assert _bits(first) == (0.0, 0.0)
  assert _bits(second) == (vectors * MODEL, vectors * MODEL)


# ----------------------------------------------------------------------------- ADMM


def test_consensus_admm_sends_one_vector_each_way():
  (metrics,) = _history("admm_consensus")
  assert _bits(metrics) == (MODEL, MODEL)


def test_consensus_admm_with_no_client_taking_part_sends_nothing_up():
  _, batches = example_inputs("admm_consensus")
  (metrics,) = _history("admm_consensus", batches=batches.replace(weight=jnp.zeros_like(batches.weight)))
  assert _bits(metrics) == (0.0, MODEL)


@pytest.mark.parametrize("relaxation, uploads", [(1.0, 1), (1.5, 2)])
def test_sharing_admm_sends_vectors_over_the_samples(relaxation, uploads):
  # B = num_samples entries: A_i x_i (and h_i when α ≠ 1) up, one vector down.
  options = {} if relaxation == 1.0 else {"relaxation": relaxation}
  (metrics,) = _history("admm_sharing", **options)
  assert _bits(metrics) == (uploads * 32 * B, 32 * B)


def test_mixture_admm_sends_one_model_each_way():
  (metrics,) = _history("mixture_admm")
  assert _bits(metrics) == (MODEL, MODEL)
