"""Deferred client data: a round gathers its clients' examples where they are used.

`sample_round(..., deferred=True)` (what `fo.train` draws) hands the step a
`DeferredData` instead of the `[C, S, B, ...]` arrays. The checks:

* it is the same data: `materialize` equals the eager gather of the same
  round, for plain examples and token windows, and one client's refs give
  that client's rows;
* it is a pytree of its own: its leaves are the store and the refs, and
  through `jax.jit`, `vmap` and `jax.tree.map` it comes out as a
  `DeferredData` with the same `take`; the take of every round is equal, so
  a jitted step compiles once; it is no dict (reading a key, iterating or
  `len` is a TypeError: code calls `materialize`);
* every algorithm in `fo.algorithms` reaches the same state from deferred
  data as from the arrays (tests/test_every_algorithm.py);
* a loop round really gathers inside the loop: its compiled memory does not
  grow with C, while the same round on eager data grows by the
  `[C, S, B, D]` batch;
* data poisoning stays deferred and poisons the same rows;
* the sampler's data also gives each client's whole train split
  (`with_local_split`, what FedEM's E-step reads): every train example in
  stored order, no test example, the all-zero slot past n_k, the attackers'
  split poisoned; hand-built arrays and token windows are refused in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from algorithm_examples import loss_fn

import fedjax_opt as fo
from fedjax_opt.core import DeferredData, has_local_split, materialize, with_local_split
from fedjax_opt.data.sampling import sample_round


def _dataset(num_clients=12, dim=5, seed=0):
  rng = np.random.default_rng(seed)
  sizes = rng.integers(1, 30, num_clients)
  clients = [{"x": rng.normal(size=(n, dim)).astype(np.float32), "y": rng.integers(0, 3, n)} for n in sizes]
  return fo.data.pack(clients, test_fraction=0.2)


def _assert_trees_equal(a, b, msg=""):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb, msg
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=msg)


def test_deferred_data_is_the_gathered_data():
  dataset = _dataset()
  key = jax.random.key(3)
  eager = sample_round(key, dataset, 6, 4, 5)
  lazy = sample_round(key, dataset, 6, 4, 5, deferred=True)
  assert isinstance(lazy.data, DeferredData) and isinstance(eager.data, dict)
  _assert_trees_equal(materialize(lazy.data), eager.data)
  assert materialize(eager.data) is eager.data
  # Masked slots read zeros, as in the eager gather.
  assert not np.any(np.asarray(materialize(lazy.data)["x"])[~np.asarray(lazy.mask)])
  # One client's refs give that client's data (what a loop gathers).
  one = lazy.data.take(lazy.data.source, jax.tree.map(lambda r: r[2], lazy.data.refs))
  _assert_trees_equal(one, jax.tree.map(lambda a: a[2], eager.data))


def test_deferred_data_crosses_jit_and_vmap_as_itself():
  dataset = _dataset()
  lazy = sample_round(jax.random.key(3), dataset, 6, 4, 5, deferred=True).data
  want = materialize(lazy)
  # Its leaves are the store and the refs, not the gathered batch.
  _assert_trees_equal(jax.tree.leaves(lazy), jax.tree.leaves((dataset.examples, lazy.refs)))
  through = jax.jit(lambda d: d)(lazy)
  assert isinstance(through, DeferredData) and through.take == lazy.take
  _assert_trees_equal(materialize(through), want)
  mapped = jax.tree.map(lambda a: a, lazy)
  assert isinstance(mapped, DeferredData) and mapped.take == lazy.take
  # vmap over the clients' refs, the store shared: each client gathers its own rows.
  per_client = jax.vmap(materialize, in_axes=(DeferredData(None, 0, lazy.take),))(lazy)
  _assert_trees_equal(per_client, want)
  # Another round's take is equal, so a jitted step compiles once for every round.
  other = sample_round(jax.random.key(4), dataset, 6, 4, 5, deferred=True).data
  assert other.take == lazy.take and hash(other.take) == hash(lazy.take)
  total = jax.jit(lambda d: jnp.sum(materialize(d)["x"]))
  total(lazy), total(other)
  assert total._cache_size() == 1


def test_deferred_data_is_no_dict():
  lazy = sample_round(jax.random.key(3), _dataset(), 6, 4, 5, deferred=True).data
  for read in (lambda d: d["x"], len, iter, lambda d: "x" in d):
    with pytest.raises(TypeError):
      read(lazy)
  assert not hasattr(lazy, "keys")
  with pytest.raises(TypeError, match="take must be hashable"):
    DeferredData(lazy.source, lazy.refs, type("Unhashable", (), {"__call__": lambda *a: a, "__hash__": None})())
  with pytest.raises(TypeError, match="take must be callable"):
    DeferredData(lazy.source, lazy.refs, 3)


def test_with_local_split_gives_every_train_example_of_each_sampled_client_and_no_test_example():
  rng = np.random.default_rng(5)
  sizes = [3, 17, 1, 9, 12]
  train = [{"x": rng.normal(size=(n, 4)).astype(np.float32), "y": rng.integers(0, 3, n)} for n in sizes]
  test = [{"x": rng.normal(size=(2, 4)).astype(np.float32) + 50.0, "y": rng.integers(0, 3, 2)} for _ in sizes]
  dataset = fo.data.pack(train, test_clients=test)
  lazy = sample_round(jax.random.key(2), dataset, 3, 2, 4, deferred=True)
  assert has_local_split(lazy.data) and not has_local_split(materialize(lazy.data))
  both = materialize(with_local_split(lazy.data))
  _assert_trees_equal(both["round"], materialize(lazy.data))
  (local, mask), ids = both["local"], np.asarray(lazy.client_id)
  assert mask.shape == (3, 1, max(sizes)) and local["x"].shape == (3, 1, max(sizes), 4)
  for c, k in enumerate(ids):
    np.testing.assert_array_equal(np.asarray(mask)[c, 0], np.arange(max(sizes)) < sizes[k])
    np.testing.assert_array_equal(np.asarray(local["x"])[c, 0, :sizes[k]], train[k]["x"])
    np.testing.assert_array_equal(np.asarray(local["y"])[c, 0, :sizes[k]], train[k]["y"])
    assert not np.any(np.asarray(local["x"])[c, 0, sizes[k]:])  # the zero slot, never a test example
  # One client's refs give that client's split (what a client loop gathers).
  one = with_local_split(lazy.data).take(lazy.data.source, jax.tree.map(lambda r: r[1], lazy.data.refs))
  _assert_trees_equal(one["local"], jax.tree.map(lambda a: a[1], both["local"]))
  # Poisoned deferred data poisons the attackers' splits as it does their rounds.
  flip = fo.attacks.label_flip(3)
  seen = []
  poisoned = fo.attacks.poison(fo.FederatedAlgorithm(lambda p, k: p, lambda s, b: seen.append(b) or s), flip,
                               attackers=[int(ids[0])])
  poisoned.step(None, lazy)
  (bad, bad_mask), = [materialize(with_local_split(seen[0].data))["local"]]
  k = int(ids[0])
  np.testing.assert_array_equal(np.asarray(bad["y"])[0, 0, :sizes[k]], 2 - train[k]["y"])
  np.testing.assert_array_equal(np.asarray(bad["y"])[1:], np.asarray(local["y"])[1:])
  np.testing.assert_array_equal(bad_mask, mask)
  with pytest.raises(ValueError, match="does not hold the clients' train splits"):
    with_local_split(materialize(lazy.data))
  streams = [rng.integers(0, 7, n).astype(np.uint8) for n in (40, 25)]
  windows = sample_round(jax.random.key(0), fo.data.pack_sequences(streams, 6), 2, 1, 2, deferred=True)
  assert not has_local_split(windows.data)
  with pytest.raises(ValueError, match="does not hold the clients' train splits"):
    with_local_split(windows.data)


def test_deferred_token_windows_are_the_gathered_windows():
  rng = np.random.default_rng(1)
  streams = [rng.integers(0, 7, n).astype(np.uint8) for n in (40, 25, 60, 33)]
  dataset = fo.data.pack_sequences(streams, 6, test_fraction=0.2)
  key = jax.random.key(0)
  eager = sample_round(key, dataset, 3, 2, 4)
  lazy = sample_round(key, dataset, 3, 2, 4, deferred=True)
  _assert_trees_equal(materialize(lazy.data), eager.data)


def test_sample_round_checks_deferred():
  with pytest.raises(TypeError, match="deferred must be a bool"):
    sample_round(jax.random.key(0), _dataset(), 2, 1, 2, deferred="yes")


def _round_temp_bytes(c, deferred, aggregator=None, dim=500, steps=2, batch=8):
  """XLA's temporary buffers of one sampled FedAvg round (sequential clients) of C of 600 clients."""
  rng = np.random.default_rng(0)
  clients = [{"x": rng.normal(size=(20, dim)).astype(np.float32), "y": rng.normal(size=20).astype(np.float32)}
             for _ in range(600)]
  dataset = fo.data.pack(clients)
  kw = {} if aggregator is None else {"aggregator": aggregator}
  algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.01), client_map="sequential", **kw)
  params = {"w": jnp.zeros((dim,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  state = algo.init(params, jax.random.key(0))
  round_fn = lambda s, k, d: algo.step(s, sample_round(k, d, c, steps, batch, deferred=deferred))
  compiled = jax.jit(round_fn).lower(state, jax.random.key(1), dataset).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("aggregator", [None, pytest.param(fo.aggregators.marginal_median(), marks=pytest.mark.slow)],
                         ids=["mean", "median"])
@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_a_loop_round_on_deferred_data_does_not_hold_the_batch(aggregator):
  batch_bytes_per_client = 2 * 8 * 500 * 4  # S · B · D float32
  eager = _round_temp_bytes(512, False, aggregator) - _round_temp_bytes(64, False, aggregator)
  lazy = _round_temp_bytes(512, True, aggregator) - _round_temp_bytes(64, True, aggregator)
  assert eager >= 448 * batch_bytes_per_client  # the [C, S, B, D] batch
  # What still grows with C: slot indices, masks, the sampler's sort keys and (for the median) the [C, P] updates.
  assert lazy < 0.2 * 448 * batch_bytes_per_client, (lazy, eager)


def test_label_flip_poisoning_stays_deferred_and_flips_the_same_rows():
  dataset = _dataset(seed=2)
  model = fo.models.logistic_regression(5, 3)
  base = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.1), client_map="sequential")
  seen = []
  recorded = base._replace(step=lambda s, b: seen.append(type(b.data)) or base.step(s, b))
  algo = fo.attacks.poison(recorded, fo.attacks.label_flip(3), attackers=[0, 3, 4, 7], num_clients=12)
  state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
  results = []
  for deferred in (False, True):
    step = jax.jit(lambda s, k: algo.step(s, sample_round(k, dataset, 8, 3, 4, deferred=deferred)))
    results.append(step(step(state, jax.random.key(5)), jax.random.key(6)))
  assert seen == [dict, DeferredData]
  _assert_trees_equal(results[1].params, results[0].params)
  clean = jax.jit(lambda s, k: base.step(s, sample_round(k, dataset, 8, 3, 4)))(state, jax.random.key(5))
  poisoned = jax.jit(lambda s, k: algo.step(s, sample_round(k, dataset, 8, 3, 4, deferred=True)))(
      state, jax.random.key(5))
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(clean.params), jax.tree.leaves(poisoned.params)))


@pytest.mark.slow  # a benchmark's cell, run as the script runs it
def test_the_round_memory_benchmark_measures_a_small_cell(monkeypatch):
  """benchmarks/round_memory.py's cell, shrunk: it trains every client and reports the deferred round leaner."""
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "round_memory.py")
  spec = importlib.util.spec_from_file_location("round_memory", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  monkeypatch.setitem(bench.WORKLOADS, "W-MLP", (2, 4, 5, 300))
  eager, lazy = bench.child("W-MLP:200:eager"), bench.child("W-MLP:200:deferred")
  assert eager["num_clients_trained"] == lazy["num_clients_trained"] == 200
  assert eager["auto_chose"] == lazy["auto_chose"] == "sequential"
  assert eager["batch_bytes"] == 200 * 2 * 4 * (784 * 4 + 4)
  assert lazy["xla_temp_bytes"] < 0.5 * eager["batch_bytes"] <= eager["xla_temp_bytes"]
  assert lazy["peak_rss_round_bytes"] > 0 and lazy["rss_data_bytes"] > 0
