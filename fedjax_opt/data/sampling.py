"""Round sampling inside jit: clients and local mini-batches from packed arrays.

`sample_round(key, dataset, C, S, B)` returns the `ClientBatches` of one
communication round, drawn entirely with `jax.random` and array indexing, so a
training loop can run as one `lax.scan` over rounds.

Client sampling follows the two schemes analysed by Li, Huang, Yang, Wang,
Zhang: "On the Convergence of FedAvg on Non-IID Data" (ICLR 2020,
arXiv:1907.02189):

* "uniform": C distinct clients, uniformly without replacement (their
  Scheme II; McMahan et al. 2017, arXiv:1602.05629). Up to 65,536 clients
  the C largest of N random words (`top_k`: exactly uniform, O(N) per
  round); beyond, the first C positions of a keyed pseudorandom permutation
  of the N clients (the Feistel network below), O(C) per round, so a round
  drawn from a million clients costs what one drawn from a thousand does;
* "proportional": C draws with replacement, client k with probability
  n_k / n (their Scheme I; FedProx, Li et al. 2020, arXiv:1812.06127). The
  plain mean of the sampled clients' updates is then unbiased for the
  n_k-weighted objective; `weight` still carries n_k, so average uniformly
  (e.g. with a uniform-weight aggregator) when using this scheme (`fo.train`
  does: it hands the algorithm weight 1 per draw). A client may appear twice
  in one round;
* "all": every client, in index order (full participation; C = N);
* "poisson": every client independently with probability q
  (`sampling_probability`), the sampling of DP-FedAvg's accounting
  (McMahan et al. 2018, arXiv:1710.06963; `fedjax_opt.privacy`). The
  round has C slots (`clients_per_round`, the cap, C <= N): the drawn
  clients fill them in random order, unused slots hold distinct undrawn
  clients with weight 0 and an all-False mask (they take no step and no
  part). When more than C clients are drawn, a uniformly random C of them
  take part (a truncated Poisson sample; `fedjax_opt.privacy.poisson_cap`
  picks C so that this happens with probability <= 1e-6, and the privacy
  accountant is told about the truncation). Client k is drawn when its
  32-bit random word is below round(q·2³²), so q is exact to 2⁻³². O(N) per
  round.

Local mini-batches follow epoch semantics (a per-client random permutation,
fresh at every epoch, as a `DataLoader(shuffle=True, drop_last=False)` would):

* an epoch of client k is `ceil(n_k / B)` steps; its last batch holds the
  `n_k mod B` remaining examples and is padded by the mask, so a client smaller
  than one batch takes full steps of `n_k` real examples, never dropped;
* no example repeats within an epoch, and a batch never spans two epochs, so
  no example repeats within a batch;
* fixed-step mode (`local_steps=S`): when S steps need more than one epoch
  (S*B > n_k), the next epoch starts with a fresh permutation;
* epochs mode (`local_epochs=E`): S = E * ceil(max_k n_k / B) (static), and
  client k's steps after its own E epochs are fully masked, so every client
  makes exactly E passes over its data (McMahan et al.'s u_k = E n_k / B).

Masked slots hold zeros.

How the permutations are made, inside jit, for a client of traced size n:

* n <= 1,024 (`_SORT_CAP`): exactly uniform. The client's stream of epochs
  (concatenated permutations) comes from one sort of
  `M = (S - 1) * B + min(n_max, 1024)` keys `(epoch, random bits)`, which
  places the items of epoch e at stream positions `[e n, (e + 1) n)` in random
  order. Cost: a `[C, M]` sort per round.
* n > 1,024: a keyed pseudorandom permutation (a Feistel network with cycle
  walking, as in TensorFlow's `index_shuffle`), evaluated only at the S*B
  positions the round uses, so a 50,000-example client costs no more than a
  small one. Still a bijection: each epoch visits every example exactly once.

All randomness of a round comes from one `jax.random.bits` call on `key`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core.types import ClientBatches, DeferredData
from fedjax_opt.data.dataset import FederatedDataset

__all__ = ["CLIENT_SAMPLING", "EXAMPLE_ORDERS", "client_batches", "sample_round", "steps_for_epochs"]

CLIENT_SAMPLING = ("uniform", "proportional", "all", "poisson")
EXAMPLE_ORDERS = ("shuffled", "fixed")


def _check_static_int(value, name: str, *, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int (mark it static under jax.jit); got {type(value).__name__}.")
  if value < 1:
    raise ValueError(f"{name} must be >= 1; got {value}.")


def steps_for_epochs(dataset: FederatedDataset, local_epochs: int, batch_size: int) -> int:
  """S for epochs mode: `local_epochs * ceil(max_k n_k / B)` (static)."""
  return local_epochs * max(1, math.ceil(dataset.max_train / batch_size))


_TOP_K_MAX_CLIENTS = 1 << 16
"""Uniform sampling from at most this many clients takes the C largest of N random words (exact, O(N));
from more, C positions of a keyed pseudorandom permutation of the N clients (`_index_shuffle`, O(C))."""


def _poisson_clients(bits: jax.Array, n: int, slots: int, probability: float) -> tuple[jax.Array, jax.Array]:
  """`([C] client indices, [C] bool drawn)` of a Poisson round from `[2N]` random words (module docstring).

  Words `[:N]` decide who is drawn (word < round(q·2³²)), words `[N:]` order them: the C slots take the drawn
  clients of largest order word (all of them when at most C are drawn, else a uniformly random C), then undrawn
  clients, which are marked not drawn.
  """
  threshold = min(round(probability * 2.0 ** 32), 2 ** 32)
  drawn = jnp.ones((n,), bool) if threshold >= 2 ** 32 else bits[:n] < jnp.uint32(threshold)
  order = (bits[n:2 * n] >> 1).astype(jnp.int32)  # >= 0
  score = jnp.where(drawn, order, -1)
  top, ids = jax.lax.top_k(score, slots)
  return ids.astype(jnp.int32), top >= 0


def _choose_clients(bits: jax.Array, dataset: FederatedDataset, clients_per_round: int,
                    client_sampling: str) -> jax.Array:
  """`[C]` client indices from random words (`[N]` for uniform, `[C]` for proportional)."""
  n = dataset.num_clients
  if client_sampling == "all":
    return jnp.arange(n, dtype=jnp.int32)
  if client_sampling == "uniform" and n <= _TOP_K_MAX_CLIENTS:
    # The C largest of N random words: a uniformly random C-subset, in random order.
    return jax.lax.top_k(bits[:n], clients_per_round)[1].astype(jnp.int32)
  if client_sampling == "uniform":
    # Positions 0 … C-1 of a keyed pseudorandom permutation of the N clients: C distinct clients in O(C).
    positions = jnp.arange(clients_per_round, dtype=jnp.uint32)
    return _index_shuffle(bits[:_FEISTEL_ROUNDS], positions, jnp.int32(n))
  # Inverse-CDF draws with replacement, P(k) = n_k / n (24-bit uniforms).
  cumulative = jnp.cumsum(dataset.train_count.astype(jnp.float32))
  u = (bits[:clients_per_round] >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
  picked = jnp.searchsorted(cumulative, u * cumulative[-1], side="right")
  return jnp.minimum(picked, n - 1).astype(jnp.int32)


_FAST_SORT_MIN_RANDOM_BITS = 20


def _bit_length(v: jax.Array) -> jax.Array:
  """Number of bits of a non-negative uint32 value (0 for 0)."""
  return 32 - jax.lax.clz(v)


def _epoch_stream(bits: jax.Array, n: jax.Array, length: int) -> jax.Array:
  """`[length]` concatenated uniformly random permutations of range(n) (n traced, >= 1).

  Position m belongs to epoch `m // n` and item `m % n`; sorting by
  (epoch, random word) shuffles each epoch's items in place. A single uint32
  sort key is about 4x faster than a multi-operand sort on CPU, so when it
  leaves at least 20 random bits the key packs `epoch | random | item`; the
  item bits are XOR-ed with a random mask so that the rare ties among the
  random bits fall either way with probability 1/2. Longer streams use an
  exact two-key sort.

  Args:
    bits: `[length + 1]` random uint32 words.
    n: the client's number of examples (traced scalar, >= 1).
    length: stream length (static).
  """
  m = jnp.arange(length, dtype=jnp.uint32)
  nu = n.astype(jnp.uint32)
  epoch = m // nu
  item = m % nu
  words = bits[:length]
  if 31 - max(length - 1, 0).bit_length() < _FAST_SORT_MIN_RANDOM_BITS:
    _, _, stream = jax.lax.sort((epoch, words, item), num_keys=2)
    return stream.astype(jnp.int32)
  item_bits = _bit_length(nu - 1)
  random_bits = 32 - _bit_length(jnp.uint32(length - 1) // nu) - item_bits
  low = (jnp.uint32(1) << item_bits) - 1
  flip = bits[length] & low
  sort_key = ((epoch << (random_bits + item_bits))
              | ((words >> (32 - random_bits)) << item_bits)
              | (item ^ flip))
  return ((jax.lax.sort(sort_key) & low) ^ flip).astype(jnp.int32)


_SORT_CAP = 1024
"""Clients with at most this many train examples are shuffled by the exact sort;
larger ones by a keyed pseudorandom permutation (`_index_shuffle`)."""

_FEISTEL_ROUNDS = 4


def _mix32(x: jax.Array) -> jax.Array:
  """A 32-bit avalanche hash (xor-shift-multiply, constants from Wellons' hash prospector)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _index_shuffle(round_keys: jax.Array, pos: jax.Array, n: jax.Array) -> jax.Array:
  """`perm(pos)` for a keyed pseudorandom permutation of range(n), any n >= 1 (traced).

  A Feistel network on the smallest power of two >= n (Luby and Rackoff,
  "How to construct pseudorandom permutations from pseudorandom functions",
  SIAM J. Comput. 1988), with cycle walking back into [0, n) (Black and
  Rogaway, "Ciphers with arbitrary finite domains", CT-RSA 2002) -- the idea of
  TensorFlow's `index_shuffle` and Grain's global shuffle. It is a bijection,
  so an epoch still visits every example exactly once, at O(1) cost per
  position instead of a sort over the whole client.

  Args:
    round_keys: `[..., R]` uint32 keys, broadcast against `pos`.
    pos: uint32 positions in [0, n).
    n: traced int, >= 1.
  """
  nu = n.astype(jnp.uint32)
  width = _bit_length(nu - 1)
  first_high = width // 2

  def encrypt(v):
    high, low = first_high, width - first_high
    for i in range(_FEISTEL_ROUNDS):
      hi, lo = v >> low, v & ((jnp.uint32(1) << low) - 1)
      f = _mix32(lo ^ round_keys[..., i]) & ((jnp.uint32(1) << high) - 1)
      v = (lo << high) | (hi ^ f)
      high, low = low, high
    return v

  out = jax.lax.while_loop(lambda v: jnp.any(v >= nu), lambda v: jnp.where(v >= nu, encrypt(v), v), encrypt(pos))
  return out.astype(jnp.int32)


def _client_indices(bits: jax.Array, n: jax.Array, local_steps: int, batch_size: int, stream_length: int,
                    sort_cap: int, feistel: bool, local_epochs: int | None,
                    fixed: bool = False) -> tuple[jax.Array, jax.Array]:
  """Slot -> example index `[S, B]` and mask `[S, B]` for one client with n_k = n.

  Clients with n <= sort_cap read their indices from a sorted epoch stream;
  when `feistel` (some client is bigger than sort_cap), bigger clients use
  `_index_shuffle` keyed by epoch. With `fixed`, every epoch visits the
  examples in stored order (slot p of an epoch holds example p).
  """
  n1 = jnp.maximum(n, 1)
  per_epoch = (n1 + batch_size - 1) // batch_size
  step = jnp.arange(local_steps, dtype=jnp.int32)[:, None]
  slot = jnp.arange(batch_size, dtype=jnp.int32)[None, :]
  epoch = step // per_epoch
  pos = (step % per_epoch) * batch_size + slot
  valid = (pos < n) & (n > 0)
  if local_epochs is not None:
    valid = valid & (epoch < local_epochs)
  if fixed:
    return jnp.where(valid, pos, 0), valid
  stream = _epoch_stream(bits[:stream_length + 1], jnp.minimum(n1, sort_cap), stream_length)
  index = stream[jnp.clip(epoch * n1 + pos, 0, stream_length - 1)]
  if feistel:
    rounds = jnp.arange(_FEISTEL_ROUNDS, dtype=jnp.uint32)
    keys = _mix32(bits[stream_length + 1] ^ _mix32(epoch.astype(jnp.uint32)[..., None] * _FEISTEL_ROUNDS + rounds
                                                    + jnp.uint32(0x9E3779B9)))
    safe = jnp.where(valid, pos, 0).astype(jnp.uint32)
    index = jnp.where(n1 <= sort_cap, index, _index_shuffle(keys, safe, n1))
  return jnp.where(valid, index, 0), valid


def _take(examples: dict, refs: tuple[jax.Array, ...], sequence_length: int) -> dict:
  """Examples of clients `refs[0] [...]` at slots `refs[1] [..., S, B]` (any leading axes, masked slots already
  pointing at the all-zero slot)."""
  client_ids, index = refs[0], refs[1]
  rows = client_ids[..., None, None]
  if sequence_length:
    tokens = examples["tokens"]
    offsets = jnp.arange(sequence_length, dtype=jnp.int32)
    x = tokens[rows[..., None], index[..., None] + offsets]
    y = tokens[rows, index + sequence_length]
    return {"x": x.astype(jnp.int32), "y": y.astype(jnp.int32)}

  def take(leaf):
    # A gather of flat rows is faster on CPU than one with several trailing axes.
    flat = leaf.reshape(leaf.shape[:2] + (-1,))
    return flat[rows, index].reshape(index.shape + leaf.shape[2:])

  return {k: take(v) for k, v in examples.items()}


@dataclasses.dataclass(frozen=True)
class _Take:
  """The `take` of a deferred round: `_take(examples, refs, sequence_length)`.

  A value (equal for an equal dataset layout), so a jitted
  step that receives the `DeferredData` compiles once, not once per round.
  Its refs are `(client_ids [C], index [C, S, B], train_count [C])`.

  It also gives each client's whole train split (`local_split`, the optional
  part of `DeferredData`'s protocol, `core.types.with_local_split`): methods
  whose client step reads every local example, not only the round's
  mini-batches (FedEM's E-step), read it there.
  """

  sequence_length: int
  max_train: int = 0
  zero_index: int = 0

  def __call__(self, examples: dict, refs: tuple[jax.Array, ...]) -> dict:
    return _take(examples, refs, self.sequence_length)

  @property
  def has_local_split(self) -> bool:
    """Whether `local_split` can read the clients' train splits (plain examples: yes; token windows: no)."""
    return self.sequence_length == 0

  def local_split(self, examples: dict, refs: tuple[jax.Array, ...]) -> tuple[dict, jax.Array]:
    """Each client's train examples as one batch: `(data [..., 1, n, ...], mask [..., 1, n])`, n = `max_train`.

    Slot i of client k holds its i-th stored train example, real while i < n_k; the other slots read the
    all-zero slot (never a test example), so the batch is finite wherever the client's data is.
    """
    if not self.has_local_split:
      raise ValueError("local_split: a token-window dataset has no per-example train split to read; read the "
                       "round's windows instead.")
    client_ids, _, count = refs
    n = max(self.max_train, 1)
    slots = jnp.arange(n, dtype=jnp.int32)
    mask = slots < count[..., None]
    local = jnp.where(mask, slots, self.zero_index)[..., None, :]
    return _take(examples, (client_ids, local), 0), mask[..., None, :]


def _refs(dataset: FederatedDataset, client_ids: jax.Array, index: jax.Array,
          mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(client_ids, index, train_count[client_ids])` with masked slots reading the dataset's all-zero slot."""
  return client_ids, jnp.where(mask, index, dataset.zero_index), dataset.train_count[client_ids]


def gather(dataset: FederatedDataset, client_ids: jax.Array, index: jax.Array, mask: jax.Array) -> dict:
  """Examples at slots `index [C, S, B]` of clients `client_ids [C]`, zero where `mask` is False.

  Masked slots read the dataset's all-zero slot (`zero_index`) rather than
  being zeroed afterwards, which saves a pass over the batch.

  Returns:
    dict of arrays `[C, S, B, ...]`; for token windows `{"x": [C, S, B, L], "y": [C, S, B]}` int32.
  """
  return _take(dataset.examples, _refs(dataset, client_ids, index, mask), dataset.sequence_length)


def deferred_gather(dataset: FederatedDataset, client_ids: jax.Array, index: jax.Array,
                    mask: jax.Array) -> DeferredData:
  """`gather(dataset, client_ids, index, mask)` as a `DeferredData`: nothing is gathered until the data is used."""
  return DeferredData(dataset.examples, _refs(dataset, client_ids, index, mask),
                      _Take(dataset.sequence_length, dataset.max_train, dataset.zero_index))


def sample_round(
    key: jax.Array,
    dataset: FederatedDataset,
    clients_per_round: int,
    local_steps: int | None = None,
    batch_size: int | None = None,
    *,
    local_epochs: int | None = None,
    client_sampling: str = "uniform",
    sampling_probability: float | None = None,
    example_order: str = "shuffled",
    deferred: bool = False,
) -> ClientBatches:
  """Draws one round's clients and local mini-batches (jit-able; sizes static).

  Give exactly one of `local_steps` (fixed-step mode) or `local_epochs`
  (epochs mode, S = E * ceil(max_k n_k / B)). When S * B exceeds a client's
  train size n_k, its batches continue into the next epoch, drawn from a
  fresh random permutation; a batch never spans two epochs, so the last batch
  of every epoch holds the `n_k mod B` leftover examples and is completed by
  the mask (see the module docstring).

  Under `jax.jit`, mark `clients_per_round`, `local_steps`, `batch_size`,
  `local_epochs` and `client_sampling` static (they are shapes), and pass the
  dataset as an argument (not a closure) so its arrays are not baked into the
  program as constants.

  Args:
    key: a PRNG key; the round is a deterministic function of it.
    dataset: a packed `FederatedDataset` (train split is sampled).
    clients_per_round: C (ignored-but-checked for "all": must equal N).
    local_steps: S, local steps per client (fixed-step mode).
    batch_size: B, example slots per step.
    local_epochs: E, passes over each client's data (epochs mode).
    client_sampling: "uniform" (without replacement), "proportional"
      (to train size, with replacement), "all", or "poisson" (each client
      with probability `sampling_probability`, in `clients_per_round` slots).
    sampling_probability: q in (0, 1], a Python float: "poisson" only.
    example_order: "shuffled" (a fresh permutation per client and epoch) or
      "fixed" (every epoch in stored order: slot s·B + b of the first epoch
      holds example s·B + b). "fixed" with `client_sampling="all"` and
      `local_epochs=1` gives every client's whole train split in the same
      slots every round, which methods that keep per-example state need
      (L2SGD+'s gradient table).
    deferred: return the data as a `DeferredData` (`fedjax_opt.core.types`):
      the same values, gathered only where they are used, so that a round
      whose clients run in a loop gathers one chunk of clients at a time
      instead of the whole `[C, S, B, ...]` batch. `fedjax_opt.train` samples
      this way.

  Returns:
    `ClientBatches` with data `[C, S, B, ...]`, mask `[C, S, B]` (True on real
    examples, zeros elsewhere), weight `[C]` = n_k (train count, float32; 0
    in the unused slots of a Poisson round) and client_id `[C]` int32.
  """
  if not isinstance(dataset, FederatedDataset):
    raise TypeError(f"dataset must be a FederatedDataset (see fo.data.pack); got {type(dataset).__name__}.")
  if client_sampling not in CLIENT_SAMPLING:
    raise ValueError(f"client_sampling must be one of {CLIENT_SAMPLING}; got {client_sampling!r}.")
  if example_order not in EXAMPLE_ORDERS:
    raise ValueError(f"example_order must be one of {EXAMPLE_ORDERS}; got {example_order!r}.")
  if not isinstance(deferred, bool):
    raise TypeError(f"deferred must be a bool; got {type(deferred).__name__}.")
  _check_static_int(clients_per_round, "clients_per_round")
  _check_static_int(batch_size, "batch_size")
  if (local_steps is None) == (local_epochs is None):
    raise ValueError("give exactly one of local_steps (fixed-step mode) or local_epochs (epochs mode); "
                     f"got local_steps={local_steps!r}, local_epochs={local_epochs!r}.")
  _check_static_int(local_steps, "local_steps", allow_none=True)
  _check_static_int(local_epochs, "local_epochs", allow_none=True)
  clients_per_round, batch_size = int(clients_per_round), int(batch_size)
  local_steps = None if local_steps is None else int(local_steps)
  local_epochs = None if local_epochs is None else int(local_epochs)
  n = dataset.num_clients
  if client_sampling == "uniform" and clients_per_round > n:
    raise ValueError(f"clients_per_round={clients_per_round} exceeds the {n} clients of the dataset "
                     "(uniform sampling is without replacement).")
  if client_sampling == "all" and clients_per_round != n:
    raise ValueError(f"client_sampling='all' takes every client: clients_per_round must be {n}; "
                     f"got {clients_per_round}.")
  if client_sampling == "poisson":
    q = sampling_probability
    if isinstance(q, bool) or not isinstance(q, (int, float, np.floating)) or not 0 < q <= 1:
      raise ValueError(f"client_sampling='poisson' needs sampling_probability, a Python float in (0, 1]; got {q!r}.")
    if clients_per_round > n:
      raise ValueError(f"clients_per_round={clients_per_round} (the slots of a Poisson round) exceeds the {n} "
                       "clients of the dataset.")
  elif sampling_probability is not None:
    raise ValueError(f"sampling_probability applies to client_sampling='poisson' only; got client_sampling="
                     f"{client_sampling!r}.")
  sort_cap = max(1, min(dataset.max_train, _SORT_CAP))
  if local_epochs is not None:
    local_steps = steps_for_epochs(dataset, local_epochs, batch_size)
    stream_length = local_epochs * sort_cap
  else:
    stream_length = (local_steps - 1) * batch_size + sort_cap
  c = n if client_sampling == "all" else clients_per_round
  # One PRNG call for the whole round (every threefry call adds compile time):
  # words for choosing clients, then stream_length + 2 words per client.
  head = {"uniform": n if n <= _TOP_K_MAX_CLIENTS else _FEISTEL_ROUNDS, "proportional": c, "all": 0,
          "poisson": 2 * n}[client_sampling]
  words = jax.random.bits(key, (head + c * (stream_length + 2),), jnp.uint32)
  if client_sampling == "poisson":
    client_ids, drawn = _poisson_clients(words[:head], n, c, float(sampling_probability))
    counts = jnp.where(drawn, dataset.train_count[client_ids], 0)
  else:
    client_ids = _choose_clients(words[:head], dataset, clients_per_round, client_sampling)
    counts = dataset.train_count[client_ids]
  per_client = functools.partial(
      _client_indices, local_steps=local_steps, batch_size=batch_size, stream_length=stream_length,
      sort_cap=sort_cap, feistel=dataset.max_train > sort_cap, local_epochs=local_epochs,
      fixed=example_order == "fixed")
  index, mask = jax.vmap(per_client)(words[head:].reshape(c, stream_length + 2), counts)
  return ClientBatches(
      data=(deferred_gather if deferred else gather)(dataset, client_ids, index, mask),
      mask=mask,
      weight=counts.astype(jnp.float32),
      client_id=client_ids,
  )


def client_batches(
    dataset: FederatedDataset,
    batch_size: int,
    *,
    client_ids: jax.Array | None = None,
    split: str = "test",
    num_steps: int | None = None,
) -> ClientBatches:
  """Every example of the given clients in order, for evaluation (jit-able).

  Args:
    dataset: a packed `FederatedDataset`.
    batch_size: B.
    client_ids: `[C]` int indices (may be traced); all N clients when None.
    split: "train" or "test".
    num_steps: S (static); `ceil(max count / B)` of the split when None, which
      covers every client. Chunk `client_ids` to bound memory on big datasets.

  Returns:
    `ClientBatches` `[C, S, B, ...]` whose mask is True on the first n_k slots
    in order; weight = the client's count in that split.
  """
  if not isinstance(dataset, FederatedDataset):
    raise TypeError(f"dataset must be a FederatedDataset; got {type(dataset).__name__}.")
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test'; got {split!r}.")
  _check_static_int(batch_size, "batch_size")
  _check_static_int(num_steps, "num_steps", allow_none=True)
  if client_ids is None:
    client_ids = jnp.arange(dataset.num_clients, dtype=jnp.int32)
  client_ids = jnp.asarray(client_ids, jnp.int32)
  if client_ids.ndim != 1:
    raise ValueError(f"client_ids must be a 1-D array [C]; got shape {client_ids.shape}.")
  biggest = dataset.max_train if split == "train" else dataset.max_test
  if num_steps is None:
    num_steps = max(1, math.ceil(biggest / batch_size))
  if split == "train":
    start = jnp.zeros_like(client_ids)
    count = dataset.train_count[client_ids]
  else:
    start = dataset.test_start[client_ids]
    count = dataset.test_count[client_ids]
  pos = jnp.arange(num_steps * batch_size, dtype=jnp.int32).reshape(num_steps, batch_size)
  mask = pos[None] < count[:, None, None]
  index = jnp.where(mask, start[:, None, None] + pos[None], 0)
  return ClientBatches(
      data=gather(dataset, client_ids, index, mask),
      mask=mask,
      weight=count.astype(jnp.float32),
      client_id=client_ids,
  )
