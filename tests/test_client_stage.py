"""The client stage of the aggregator seam (`fo.aggregators.chain(fo.compression.compress(...), rule)`).

* Every factory that takes `aggregator=` takes a chained one: the server
  receives, from every client, exactly the top-1 of its update (at most one
  nonzero entry, charged 32 + ⌈log₂ P⌉ bits counted by hand), and with the
  identity compressor and error feedback the run is the unchained run bit
  for bit, residuals zero.
* The key: an identity stage in front of `dp_mean` leaves its noise (drawn
  from the aggregator's key) exactly as it was.
* What cannot compose is refused in one line naming both pieces: a stage
  after an aggregator, two stages, two aggregators, a bare compressor,
  `secure_aggregation` or `corrupt` around a chained aggregator, and FedDyn
  and CFL.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm_examples import EXAMPLES, N, example_inputs

import fedjax_opt as fo

C = fo.compression
REFUSING = ("feddyn", "clustered_fl")
TAKING = sorted(name for name, make in EXAMPLES.items()
                if "aggregator" in inspect.signature(getattr(fo.algorithms, name)).parameters
                and name not in REFUSING)


def _recording():
  """The uniform mean, which also keeps the stacked updates it received (`[C, ...]`) in its state."""

  def init(params):
    return jax.tree.map(lambda p: jnp.zeros((N,) + jnp.shape(p), jnp.result_type(p)), params)

  def aggregate(updates, weights, state, key):
    mean, _ = fo.aggregators.mean().aggregate(updates, weights, (), key)
    return mean, updates

  # Declared a plain mean: SCAFFOLD refuses an aggregator without traits (its c is a plain sum beside it).
  return fo.aggregators.Aggregator(init, aggregate, traits=fo.aggregators.Traits(name="recording_mean", linear=True))


def _leaves(state):
  """Every array of `state` but the aggregator's (PRNG keys as their data)."""
  leaves = jax.tree.leaves(state.replace(aggregator_state=None))
  return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x) for x in leaves]


def _rounds(name, aggregator, rounds=2):
  params, batches = example_inputs(name)
  algo = EXAMPLES[name](aggregator=aggregator)
  state = algo.init(params, jax.random.key(0))
  step = jax.jit(algo.step)
  for _ in range(rounds):
    state = step(state, batches)
  return state


@functools.cache
def _unchained(name):
  """`_rounds(name, fo.aggregators.mean())`, run once per factory: the identity and dp_mean tests share it."""
  return _rounds(name, fo.aggregators.mean())


def test_every_factory_with_an_aggregator_takes_a_client_stage():
  assert {"fedavg", "fedsgd", "fedprox", "fednova", "scaffold", "ditto", "pfedme", "per_fedavg", "fedavg_finetune",
          "fedem", "ifca"} <= set(TAKING)


@pytest.mark.parametrize("name", TAKING)
def test_the_server_receives_each_clients_top_1_and_is_charged_its_bits(name):
  state = _rounds(name, fo.aggregators.chain(C.compress(C.top_k(k=1)), _recording()), rounds=1)
  received = state.aggregator_state.server
  if name == "ifca":  # one recording per cluster, each of all C stacked messages
    received = jax.tree.map(lambda r: r[0], received)
  flat = np.concatenate([np.asarray(leaf, np.float64).reshape(N, -1) for leaf in jax.tree.leaves(received)], axis=1)
  p = flat.shape[1]
  assert np.all(np.sum(flat != 0, axis=1) <= 1) and np.any(flat != 0)
  messages = 2 if name == "scaffold" else 1  # SCAFFOLD's Δy_i and Δc_i both pass the stage
  assert float(state.metrics["bits_up"]) == messages * (32 + math.ceil(math.log2(p)))


# Every factory's plumbing of a stage is checked by the top-1 test above; the bit-for-bit identity runs, in the
# default tier, on factories whose rounds differ in how the stage is reached (a plain round, two messages a client,
# one aggregation per cluster, a stateful aggregator across a switch of optimizers), the rest in the slow tier.
IDENTITY_DEFAULT_TIER = ("fedavg", "scaffold", "ifca", "fedavg_finetune")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in IDENTITY_DEFAULT_TIER else pytest.mark.slow)
                                  for n in TAKING])
def test_identity_with_error_feedback_is_the_unchained_run_bit_for_bit(name):
  want = _unchained(name)
  got = _rounds(name, fo.aggregators.chain(C.compress(C.identity(), error_feedback=True, num_clients=N),
                                           fo.aggregators.mean()))
  for a, b in zip(_leaves(got), _leaves(want)):
    np.testing.assert_array_equal(a, b)
  assert all(not np.any(np.asarray(t)) for t in jax.tree.leaves(got.aggregator_state.rows))


def test_a_stage_in_front_of_dp_mean_leaves_its_noise_as_it_was():
  dp = fo.privacy.dp_mean(0.05, 1.0, expected_clients=N)
  want = _rounds("fedavg", dp)
  got = _rounds("fedavg", fo.aggregators.chain(C.compress(C.identity()), dp))
  np.testing.assert_array_equal(np.asarray(got.params["w"]), np.asarray(want.params["w"]))
  np.testing.assert_array_equal(np.asarray(got.params["b"]), np.asarray(want.params["b"]))
  assert not np.allclose(np.asarray(want.params["w"]), np.asarray(_unchained("fedavg").params["w"]))


def test_pieces_that_do_not_compose_are_refused_in_one_line_naming_both():
  stage = C.compress(C.top_k(k=1), error_feedback=True, num_clients=N)
  dp = fo.privacy.dp_mean(1.0, 1.0, expected_clients=N)
  chained = fo.aggregators.chain(stage, fo.aggregators.mean())
  with pytest.raises(ValueError, match=r"chain: compress\(top_k\(k=1\), error_feedback\) comes after dp_mean"):
    fo.aggregators.chain(dp, stage)
  with pytest.raises(ValueError, match=r"compress\(top_k\(k=1\), error_feedback\) and compress\(sign\) are both "
                                       r"client stages"):
    fo.aggregators.chain(stage, C.compress(C.sign()), fo.aggregators.mean())
  with pytest.raises(ValueError, match="mean and krum are both aggregators"):
    fo.aggregators.chain(fo.aggregators.mean(), fo.aggregators.krum(1))
  with pytest.raises(TypeError, match=r"wrap the compressor, fo.compression.compress\(sign"):
    fo.aggregators.chain(C.sign(), fo.aggregators.mean())
  with pytest.raises(TypeError, match="is a client stage, not an aggregator"):
    EXAMPLES["fedavg"](aggregator=stage)
  with pytest.raises(ValueError, match=r"secure_aggregation cannot compose with the aggregator's client stage compress"):
    fo.privacy.secure_aggregation(chained, bound=1.0)
  with pytest.raises(ValueError, match=r"corrupt cannot compose with the aggregator's client stage compress"):
    fo.attacks.corrupt(chained, fo.attacks.omniscient(1e4), attackers=0.25)
  for name in REFUSING:
    with pytest.raises(ValueError, match=rf"{name} cannot compose with the aggregator's client stage compress"):
      EXAMPLES[name](aggregator=chained)
  assert fo.aggregators.chain(dp) is dp
