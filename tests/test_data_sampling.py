"""Round sampling inside jit: client rates, client-pure batches, exact masks, epochs without repeats."""

import functools
import math
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from fedjax_opt import data
from fedjax_opt.core import validation
from fedjax_opt.data import sampling

STATIC = ("clients_per_round", "local_steps", "batch_size", "local_epochs", "client_sampling", "example_order")
sample = jax.jit(data.sample_round, static_argnames=STATIC)


def _id_dataset(sizes, test_fraction=0.0):
  """Clients whose examples carry a unique global id (starting at 1; 0 marks padding)."""
  clients, owner, start = [], {}, 1
  for k, n in enumerate(sizes):
    ids = np.arange(start, start + n)
    owner.update({int(i): k for i in ids})
    clients.append({"id": ids, "x": ids[:, None] * np.ones((1, 2), np.float32), "y": ids % 10})
    start += n
  ds = data.pack(clients, test_fraction=test_fraction, max_padding_factor=None)
  return ds, owner


def _expected_real(n, step, batch):
  """Real examples in a client's step under epoch semantics (last batch of an epoch partial)."""
  if n == 0:
    return 0
  per_epoch = math.ceil(n / batch)
  return min(batch, n - (step % per_epoch) * batch)


def _check_round(ds, owner, batches, *, local_epochs=None):
  """Every claim about one round that does not need many rounds."""
  validation.check_client_batches(batches)
  train_ids = [set(c["id"].tolist()) for c in data.unpack(ds, "train")]
  ids = np.asarray(batches.data["id"])
  mask = np.asarray(batches.mask)
  counts = np.asarray(ds.train_count)
  for c, k in enumerate(np.asarray(batches.client_id)):
    n = int(counts[k])
    assert batches.weight[c] == n
    # Only this client's train examples, and zeros on padding.
    assert all(owner[int(i)] == k and int(i) in train_ids[k] for i in ids[c][mask[c]])
    assert np.all(ids[c][~mask[c]] == 0)
    assert np.all(np.asarray(batches.data["x"])[c][~mask[c]] == 0)
    per_epoch = max(1, math.ceil(n / batches.batch_size))
    for s in range(batches.local_steps):
      real = _expected_real(n, s, batches.batch_size)
      if local_epochs is not None and s // per_epoch >= local_epochs:
        real = 0
      np.testing.assert_array_equal(mask[c, s], np.arange(batches.batch_size) < real)
    # Each complete epoch is a permutation of the client's train set; a partial one has no repeats.
    if n:
      for e in range(0, batches.local_steps, per_epoch):
        seen = ids[c, e:e + per_epoch][mask[c, e:e + per_epoch]]
        assert len(set(seen.tolist())) == len(seen)
        if e + per_epoch <= batches.local_steps and (local_epochs is None or e // per_epoch < local_epochs):
          assert set(seen.tolist()) == train_ids[k]


def test_round_shapes_weights_and_client_purity_under_jit():
  ds, owner = _id_dataset([1, 3, 20, 25, 50, 7, 0, 13], test_fraction=0.2)
  for seed in range(5):
    batches = sample(jax.random.key(seed), ds, 5, 6, 8)
    assert batches.mask.shape == (5, 6, 8) and batches.data["x"].shape == (5, 6, 8, 2)
    assert batches.weight.dtype == jnp.float32 and batches.client_id.dtype == jnp.int32
    assert len(set(np.asarray(batches.client_id).tolist())) == 5  # without replacement
    _check_round(ds, owner, batches)


@pytest.mark.slow  # eager dispatch compiles every primitive once: ~5 s on 2 cores
def test_jit_and_eager_draw_the_same_round():
  ds, _ = _id_dataset([4, 9, 16, 2])
  key = jax.random.key(7)
  eager = data.sample_round(key, ds, 3, 4, 5)
  jitted = sample(key, ds, 3, 4, 5)
  for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
    np.testing.assert_array_equal(a, b)


def test_epochs_mode_makes_exactly_e_passes_over_every_client():
  sizes = [1, 5, 9, 16, 23]
  ds, owner = _id_dataset(sizes)
  batches = sample(jax.random.key(0), ds, 5, batch_size=4, local_epochs=3, client_sampling="all")
  assert batches.local_steps == 3 * math.ceil(23 / 4)
  _check_round(ds, owner, batches, local_epochs=3)
  ids = np.asarray(batches.data["id"])
  for c, n in enumerate(sizes):
    seen = ids[c][np.asarray(batches.mask[c])]
    values, counts = np.unique(seen, return_counts=True)
    assert len(values) == n and np.all(counts == 3)


def test_fixed_order_puts_every_example_in_its_stored_slot_every_round():
  """example_order="fixed": each epoch in stored order, the same slots in every round (keys do not matter)."""
  sizes = [1, 5, 9, 16, 23]
  ds, owner = _id_dataset(sizes)
  train = [c["id"] for c in data.unpack(ds, "train")]
  rounds = [sample(jax.random.key(k), ds, 5, batch_size=4, local_epochs=2, client_sampling="all",
                   example_order="fixed") for k in range(2)]
  _check_round(ds, owner, rounds[0], local_epochs=2)
  for batches in rounds:
    ids = np.asarray(batches.data["id"])
    for c, n in enumerate(sizes):
      per_epoch = math.ceil(n / 4)  # this client's epoch: its steps, then the next epoch starts
      for e in range(2):
        flat = ids[c, e * per_epoch:(e + 1) * per_epoch].reshape(-1)
        np.testing.assert_array_equal(flat[:n], train[c])  # slot p of the epoch holds example p
        assert np.all(flat[n:] == 0)
      assert np.all(ids[c, 2 * per_epoch:] == 0)  # nothing after the two epochs
  np.testing.assert_array_equal(np.asarray(rounds[0].data["id"]), np.asarray(rounds[1].data["id"]))
  with pytest.raises(ValueError, match="example_order must be one of"):
    data.sample_round(jax.random.key(0), ds, 5, batch_size=4, local_epochs=1, client_sampling="all",
                      example_order="sorted")


def test_more_steps_than_an_epoch_start_a_fresh_permutation():
  ds, owner = _id_dataset([6])
  batches = sample(jax.random.key(3), ds, 1, 30, 6)  # 30 epochs of one full batch each
  _check_round(ds, owner, batches)
  orders = {tuple(row) for row in np.asarray(batches.data["id"][0])}
  assert len(orders) > 20  # fresh permutations, not one repeated


@pytest.mark.parametrize("large_population", [False, True], ids=["top_k", "permutation"])
def test_uniform_sampling_visits_clients_and_pairs_at_their_rates(monkeypatch, large_population):
  """Each client at rate C/N and each pair of clients at rate C(C-1)/(N(N-1)), with C distinct clients a round.

  `large_population` lowers the population size above which sampling switches from `top_k` over N random
  words to C positions of a keyed permutation, so that path runs on the same 40 clients.
  """
  if large_population:
    monkeypatch.setattr(sampling, "_TOP_K_MAX_CLIENTS", 16)
  n = 40
  ds, _ = _id_dataset([3] * n)
  rounds, c = 2000, 5
  keys = jax.random.split(jax.random.key(0), rounds)
  ids = jax.jit(jax.vmap(lambda k: data.sample_round(k, ds, c, 1, 1).client_id))(keys)
  ids = np.asarray(ids)
  assert all(len(set(row)) == c for row in ids)
  counts = np.bincount(ids.ravel(), minlength=n)
  # Without replacement the counts are slightly negatively correlated: chi-square is conservative.
  assert stats.chisquare(counts).pvalue > 1e-3
  lo, hi = stats.binom.ppf([1e-4, 1 - 1e-4], rounds, c / n)
  assert np.all((counts >= lo) & (counts <= hi))
  pairs = np.zeros((n, n), int)
  for row in ids:
    for i in range(c):
      for j in range(i + 1, c):
        pairs[min(row[i], row[j]), max(row[i], row[j])] += 1
  assert stats.chisquare(pairs[np.triu_indices(n, 1)]).pvalue > 1e-3


def test_uniform_sampling_from_a_large_population_costs_o_of_c():
  """Above `_TOP_K_MAX_CLIENTS` clients a round draws C distinct clients from C positions of a permutation: the
  program holds no [N] array of random words or sort."""
  n = sampling._TOP_K_MAX_CLIENTS + 4_465
  ds = data.pack([{"x": np.full((1, 1), k, np.float32), "y": np.zeros(1, np.int32)} for k in range(n)],
                 max_padding_factor=None)
  draw = jax.jit(lambda k, d: data.sample_round(k, d, 300, 1, 1))
  batches = draw(jax.random.key(3), ds)
  ids = np.asarray(batches.client_id)
  assert len(set(ids.tolist())) == 300 and ids.min() >= 0 and ids.max() < n
  np.testing.assert_array_equal(np.asarray(batches.data["x"])[:, 0, 0, 0], ids)  # each client's own example
  text = draw.lower(jax.random.key(3), ds).as_text().lower()
  assert "topk" not in text and "top_k" not in text
  random_words = [int(d) for d in re.findall(r"tensor<(\d+)xui32>", text)]
  assert random_words and max(random_words) < n  # no [N] array of random words


def test_proportional_sampling_matches_size_proportional_rates():
  sizes = [1, 2, 4, 8, 16, 32, 64, 3]
  ds, _ = _id_dataset(sizes)
  keys = jax.random.split(jax.random.key(1), 3000)
  ids = jax.jit(jax.vmap(lambda k: data.sample_round(k, ds, 4, 1, 1, client_sampling="proportional").client_id))(keys)
  counts = np.bincount(np.asarray(ids).ravel(), minlength=len(sizes))
  expected = np.asarray(sizes) / sum(sizes) * counts.sum()
  assert stats.chisquare(counts, expected).pvalue > 1e-3


def test_positions_within_an_epoch_are_uniform():
  ds, _ = _id_dataset([7])
  keys = jax.random.split(jax.random.key(2), 3500)
  first = jax.jit(jax.vmap(lambda k: data.sample_round(k, ds, 1, 1, 7).data["id"][0, 0, 0]))(keys)
  counts = np.bincount(np.asarray(first), minlength=8)[1:]
  assert stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("n, length", [(1, 1), (1, 64), (5, 37), (64, 64), (100, 2048), (700, 2100), (3000, 5000)])
def test_epoch_stream_is_a_concatenation_of_permutations(n, length):
  # Lengths above 2048 take the exact two-key sort; shorter ones the packed-key sort.
  bits = jax.random.bits(jax.random.key(n), (length + 1,), jnp.uint32)
  stream = np.asarray(jax.jit(sampling._epoch_stream, static_argnums=2)(bits, jnp.int32(n), length))
  for start in range(0, length - n + 1, n):
    np.testing.assert_array_equal(np.sort(stream[start:start + n]), np.arange(n))


def test_clients_beyond_the_sort_cap_use_a_bijective_index_shuffle():
  # One client above the exact-sort cap (1,024 examples) switches its shuffle to a keyed
  # pseudorandom permutation; the epoch guarantees must hold all the same.
  sizes = [3000, 1500, 40, 5]
  ds, owner = _id_dataset(sizes)
  assert ds.max_train > sampling._SORT_CAP
  batches = sample(jax.random.key(0), ds, 4, 6, 50, client_sampling="all")
  _check_round(ds, owner, batches)
  epochs = sample(jax.random.key(1), ds, 4, batch_size=500, local_epochs=2, client_sampling="all")
  _check_round(ds, owner, epochs, local_epochs=2)
  ids = np.asarray(epochs.data["id"])
  for c, n in enumerate(sizes):
    _, counts = np.unique(ids[c][np.asarray(epochs.mask[c])], return_counts=True)
    assert len(counts) == n and np.all(counts == 2)


@pytest.mark.parametrize("n", [1025, 4000, 50000])
def test_index_shuffle_is_a_bijection_with_uniform_positions(n):
  keys = jax.random.bits(jax.random.key(n), (4000, sampling._FEISTEL_ROUNDS), jnp.uint32)
  one = jax.jit(lambda k: sampling._index_shuffle(k, jnp.arange(n, dtype=jnp.uint32), jnp.int32(n)))
  np.testing.assert_array_equal(np.sort(np.asarray(one(keys[0]))), np.arange(n))
  first = jax.jit(jax.vmap(lambda k: sampling._index_shuffle(k, jnp.uint32(7), jnp.int32(n))))(keys)
  bins = np.bincount(np.asarray(first) % 16, minlength=16)  # residues mod 16: near-equal class sizes
  expected = np.bincount(np.arange(n) % 16, minlength=16) / n * len(keys)
  assert stats.chisquare(bins, expected).pvalue > 1e-3


def test_client_batches_cover_each_test_example_once_in_order():
  ds, owner = _id_dataset([10, 3, 0, 21], test_fraction=0.3)
  batches = jax.jit(functools.partial(data.client_batches, batch_size=4))(ds)
  tests = data.unpack(ds, "test")
  ids = np.asarray(batches.data["id"])
  for k in range(4):
    np.testing.assert_array_equal(ids[k][np.asarray(batches.mask[k])], tests[k]["id"])
  np.testing.assert_array_equal(batches.weight, ds.test_count)
  some = data.client_batches(ds, 5, client_ids=jnp.array([3]), split="train")
  np.testing.assert_array_equal(np.asarray(some.data["id"][0])[np.asarray(some.mask[0])],
                                data.unpack(ds, "train")[3]["id"])


def test_token_windows_are_cut_on_the_fly_from_train_text():
  bases = [1000, 2000, 3000]
  streams = [b + np.arange(n) for b, n in zip(bases, (50, 120, 90))]
  length = 10
  ds = data.pack_sequences(streams, length, test_fraction=0.2)
  batches = sample(jax.random.key(0), ds, 3, 5, 4)
  x, y, mask = map(np.asarray, (batches.data["x"], batches.data["y"], batches.mask))
  assert x.shape == (3, 5, 4, length) and x.dtype == np.int32
  train = np.asarray(ds.train_count)
  for c, k in enumerate(np.asarray(batches.client_id)):
    for window, target in zip(x[c][mask[c]], y[c][mask[c]]):
      start = window[0] - bases[k]
      assert 0 <= start < train[k]
      np.testing.assert_array_equal(window, bases[k] + start + np.arange(length))
      assert target == bases[k] + start + length
    assert np.all(x[c][~mask[c]] == 0) and np.all(y[c][~mask[c]] == 0)


def test_a_thousand_rounds_run_as_one_scan():
  ds, _ = _id_dataset([20] * 10)

  @jax.jit
  def run(key, ds):
    def body(total, k):
      b = data.sample_round(k, ds, 3, 2, 5)
      return total + jnp.sum(b.mask), None
    return jax.lax.scan(body, 0, jax.random.split(key, 1000))[0]

  assert int(run(jax.random.key(0), ds)) == 1000 * 3 * 2 * 5


def test_bad_arguments_are_named():
  ds, _ = _id_dataset([4, 5])
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="clients_per_round=3"):
    data.sample_round(key, ds, 3, 1, 1)
  with pytest.raises(ValueError, match="exactly one of local_steps"):
    data.sample_round(key, ds, 1, 2, 2, local_epochs=1)
  with pytest.raises(TypeError, match="batch_size"):
    data.sample_round(key, ds, 1, 2, None)
  with pytest.raises(TypeError, match="local_steps must be a Python int"):
    data.sample_round(key, ds, 1, 2.0, 2)
  with pytest.raises(ValueError, match="client_sampling"):
    data.sample_round(key, ds, 1, 1, 1, client_sampling="greedy")
  with pytest.raises(ValueError, match="'all'"):
    data.sample_round(key, ds, 1, 1, 1, client_sampling="all")
  with pytest.raises(TypeError, match="FederatedDataset"):
    data.sample_round(key, {"x": 1}, 1, 1, 1)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(
    sizes=st.lists(st.integers(0, 12), min_size=5, max_size=5),
    steps=st.sampled_from([1, 3]),
    batch=st.sampled_from([2, 5]),
    seed=st.integers(0, 2**16),
)
def test_packing_and_sampling_never_mix_clients(sizes, steps, batch, seed):
  # A sixth client of the largest size keeps the shapes (and so the compilations) few
  # while the other clients' sizes vary freely, empty and smaller-than-a-batch included.
  ds, owner = _id_dataset(sizes + [12])
  _check_round(ds, owner, sample(jax.random.key(seed), ds, 3, steps, batch))
