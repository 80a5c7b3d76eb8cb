"""The two contracts every algorithm shares: `ClientBatches` and `FederatedAlgorithm`.

A round's participating clients are an array axis, not a Python list:

* `ClientBatches.data` is any pytree whose leaves are shaped `[C, S, B, ...]`
  (clients, local steps, examples per step);
* `ClientBatches.mask` `[C, S, B]` is False on padding, so clients with unequal
  amounts of data share one static shape;
* `ClientBatches.weight` `[C]` is the client's weight in the average (its
  sample count n_k for FedAvg); a weight of 0 marks a client that takes no
  part (padding clients added to fill a device mesh, for instance);
* `ClientBatches.client_id` `[C]` indexes per-client state stored stacked as
  `[num_clients, ...]` in the server state.

`FederatedAlgorithm(init, step)` mirrors `optax.GradientTransformation`: two
pure functions, `init(params, key) -> state` and `step(state, batches) -> state`.
Diagnostics of the last round live in `state.metrics`, so `step` drops into
`jax.lax.scan` unchanged. Algorithms whose personal models are made at
evaluation time (Per-FedAvg, FedAvg + fine-tuning) also carry
`personalize(params, data, mask) -> params`; algorithms that store per-client
models keep them in `state.local_params` (read with
`fedjax_opt.personalized_params`).

`ClientBatches.data` may also be a `DeferredData`: the same `[C, S, B, ...]`
arrays described by where they live (per-client slot indices into a shared
example store) instead of as arrays. `fedjax_opt.train` samples rounds this
way, so that a round whose clients run in a loop gathers each chunk's
examples inside the loop (`core.rounds.client_round`) and never holds the
whole `[C, S, B, ...]` batch. It is a pytree of its own (store and slot
indices as leaves, the gather as static data), so it crosses `jax.jit`,
`vmap` and `lax.scan` unchanged; code that wants the arrays calls
`materialize(data)`, which gathers the full batch.

`Aggregator(init, aggregate)` is the seam between stacked client updates and
the server step (`fedjax_opt.aggregators` builds them); it is a contract of
the core, so the core never imports the aggregators. Its optional
`ClientStage` is the part of the seam that runs on each client before the
upload (compression with error feedback, `fedjax_opt.compression.compress`),
with its per-client rows in the aggregator's state (`StagedState`). What a
piece does to the updates is declared on it as data (`Traits`), never
guessed from where its functions were defined.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import flax.struct
import jax

__all__ = ["Aggregator", "ClientBatches", "ClientStage", "DeferredData", "Downlink", "FederatedAlgorithm", "LossFn",
           "NoisedState", "PyTree",
           "ServerState", "StagedState", "StreamingSum", "Traits", "has_local_split", "materialize",
           "with_local_split"]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
"""Per-example loss: `loss_fn(params, batch) -> [B]`. The library masks and averages."""


@flax.struct.dataclass
class DeferredData:
  """A round's client data, `[C, S, B, ...]`, described by where it lives; `materialize` gathers it.

      materialize(DeferredData(source, refs, take)) = take(source, refs)

  `source` is shared by every client (the packed dataset's example arrays),
  `refs` has a leading `[C]` axis (each client's id and slot indices), and
  `take(source, refs)` makes the data. `take` must work for refs with any
  leading axes (all C clients, a chunk of k, one client), so that
  `take(source, refs)[c] == take(source, refs[c])`.

  A pytree whose leaves are `source` and `refs` and whose `take` is static:
  it passes through `jax.jit`, `vmap`, `lax.scan` and `jax.tree.map` as a
  `DeferredData`, and nothing is gathered until someone calls `materialize`.
  A jitted function is compiled once per `take` value, so `take` must be
  hashable and equal from one round to the next: a module-level function or
  a frozen dataclass (`fedjax_opt.data.sampling` and `fedjax_opt.attacks`
  use one), not a lambda or `functools.partial` made anew each round.

  Optionally, `take` also gives each client's whole train split: a `take`
  with `has_local_split` True has `take.local_split(source, refs) ->
  (data [..., 1, n, ...], mask [..., 1, n])`, every train example of each
  client as one batch (the sampler's does, for plain examples;
  `with_local_split` puts it beside the round's data).

  It is not a dict: code that reads the data calls `materialize(data)`.
  Three places look inside instead, to gather less than the whole batch:
  `core.rounds.client_round` (each chunk of a client loop gathers its own
  clients), `core.asynchrony` (an event gathers only the clients that
  arrive) and `fedjax_opt.attacks.poison` (poisoning is folded into `take`,
  so the data stays deferred).

  Attributes:
    source: pytree shared by every client.
    refs: pytree of arrays with a leading `[C]` axis.
    take: `take(source, refs) -> data [..., S, B, ...]`, static.
  """

  source: PyTree
  refs: PyTree
  take: Callable[[PyTree, PyTree], PyTree] = flax.struct.field(pytree_node=False)

  def __post_init__(self):
    if not callable(self.take):
      raise TypeError(f"DeferredData: take must be callable; got {type(self.take).__name__}.")
    try:
      hash(self.take)
    except TypeError as e:
      raise TypeError(f"DeferredData: take must be hashable (it is static under jax.jit); got "
                      f"{type(self.take).__name__}.") from e

  def materialize(self) -> PyTree:
    """The data as arrays `[C, S, B, ...]`: `take(source, refs)`."""
    return self.take(self.source, self.refs)

  def __repr__(self) -> str:
    shapes = jax.tree.map(lambda a: getattr(a, "shape", a), self.refs)
    return f"DeferredData(refs={shapes}, take={self.take!r})"


def has_local_split(data: Any) -> bool:
  """Whether `data` (a round's `ClientBatches.data`) can give each client's whole train split."""
  return isinstance(data, DeferredData) and bool(getattr(data.take, "has_local_split", False))


@dataclasses.dataclass(frozen=True)
class _WithLocalSplit:
  """A `take` giving `{"round": take(source, refs), "local": take.local_split(source, refs)}`."""

  take: Callable[[PyTree, PyTree], PyTree]

  def __call__(self, source: PyTree, refs: PyTree) -> dict:
    return {"round": self.take(source, refs), "local": self.take.local_split(source, refs)}


def with_local_split(data: DeferredData) -> DeferredData:
  """The round's data with each client's whole train split beside it, still deferred.

  Materialized (a chunk of clients at a time in a client loop), it is
  `{"round": data [C, S, B, ...], "local": (train data [C, 1, n, ...], mask [C, 1, n])}`:
  what a client step reads when it needs every local example (FedEM's E-step).

  Raises:
    ValueError: when `data` cannot give it (`has_local_split(data)` is False).
  """
  if not has_local_split(data):
    raise ValueError("with_local_split: the round's data does not hold the clients' train splits; it must be the "
                     "DeferredData of sample_round(..., deferred=True) over plain examples (fo.train samples so).")
  return DeferredData(data.source, data.refs, _WithLocalSplit(data.take))


def materialize(data: PyTree) -> PyTree:
  """`data` as arrays: a `DeferredData` gathered, anything else unchanged."""
  return data.materialize() if isinstance(data, DeferredData) else data


@flax.struct.dataclass
class ClientBatches:
  """One round's participating clients, packed into arrays.

  Attributes:
    data: pytree of arrays shaped `[C, S, B, ...]`, e.g. `{"x": ..., "y": ...}`,
      or a `DeferredData` standing for one.
    mask: `[C, S, B]` bool, True on real examples, False on padding.
    weight: `[C]` float, the client's aggregation weight (n_k); 0 = not taking part.
    client_id: `[C]` int32, index of each client in per-client state.
  """

  data: PyTree
  mask: jax.Array
  weight: jax.Array
  client_id: jax.Array

  @classmethod
  def from_clients(cls, clients: Any, *, batch_size: int, steps: int | None = None, client_ids: Any = None,
                   weights: Any = None) -> ClientBatches:
    """One round's `ClientBatches` from per-client arrays: padding, mask, weights and ids filled in.

        batches = fo.ClientBatches.from_clients([{"x": x0, "y": y0}, {"x": x1, "y": y1}], batch_size=32)

    Client k's examples go in order, step by step: slot (s, b) of client k
    holds its example s·B + b, the mask is True on the slots that hold one,
    and padding holds zeros.

    * S·B > n_k (always for all but the largest client when `steps` is None):
      client k's last step is partly padding and its later steps are all
      padding. A step without a real example is no step (`core.local`), so the
      client simply trains for ceil(n_k / B) steps; a client with n_k = 0
      takes no step and no part.
    * S·B < n_k (an explicit `steps` too small for client k): only its first
      S·B examples are in the round; the others are not used. Its weight stays
      n_k, its data size, as in `fo.data.sample_round`; shuffle the arrays
      first, or call this again with the rest, to use other examples.

    Built on the host with NumPy, from concrete arrays (not inside `jax.jit`);
    `fo.data.pack` and `fo.train` are the path for a dataset sampled round
    after round.

    Args:
      clients: a list of C per-client pytrees (e.g. `{"x": [n_k, ...], "y":
        [n_k]}`), all of one structure; the leaves of client k share their
        leading size n_k (≥ 0), and a leaf has the same trailing shape for
        every client. A leaf's dtype is the common dtype of the clients' (NumPy
        promotion).
      batch_size: B ≥ 1, example slots per step.
      steps: S ≥ 1, steps per client; None: ceil(max_k n_k / B) (at least 1),
        which holds every client's whole data.
      client_ids: `[C]` ints ≥ 0, the rows of the algorithm's per-client
        tables; None: 0 … C−1.
      weights: `[C]` finite numbers ≥ 0 (0: not taking part); None: n_k.

    Returns:
      `ClientBatches` with data `[C, S, B, ...]`, mask `[C, S, B]` bool, weight
      `[C]` float32 and client_id `[C]` int32, as JAX arrays.

    Raises:
      TypeError: `clients` is not a list of pytrees of arrays; a count is not an int.
      ValueError: one line naming the client and leaf at fault: no clients, no
        arrays, different structures, leaves of one client of different
        leading sizes, different trailing shapes across clients; or bad
        `client_ids` / `weights`.
    """
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    from fedjax_opt.core.validation import check_int, check_optional_int  # pylint: disable=import-outside-toplevel

    where = "ClientBatches.from_clients"
    if isinstance(clients, (dict, str)) or not isinstance(clients, (list, tuple)):
      raise TypeError(f"{where}: clients must be a list of per-client pytrees of [n_k, ...] arrays; got "
                      f"{type(clients).__name__}.")
    if not clients:
      raise ValueError(f"{where}: clients is empty; give at least one client.")
    batch_size = check_int(batch_size, "batch_size", 1)
    steps = check_optional_int(steps, "steps", 1)
    structure = jax.tree.structure(clients[0])
    leaves = []
    for k, client in enumerate(clients):
      if jax.tree.structure(client) != structure:
        raise ValueError(f"{where}: clients[{k}] has structure {jax.tree.structure(client)}; clients[0] has "
                         f"{structure}.")
      paths = jax.tree_util.tree_flatten_with_path(client)[0]
      if not paths:
        raise ValueError(f"{where}: clients[{k}] holds no arrays.")
      arrays = []
      for path, leaf in paths:
        name = f"clients[{k}]{jax.tree_util.keystr(path)}"
        a = np.asarray(leaf)
        if a.ndim == 0 or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
          raise ValueError(f"{where}: {name} must be a numeric array [n_k, ...] (examples first); got "
                           f"{'a scalar' if a.ndim == 0 else f'dtype {a.dtype}'}.")
        arrays.append((name, a))
      sizes = {name: a.shape[0] for name, a in arrays}
      if len(set(sizes.values())) != 1:
        raise ValueError(f"{where}: the leaves of clients[{k}] must share their leading size n_k (examples); got "
                         f"{sizes}.")
      leaves.append(arrays)
    for i, (name0, ref) in enumerate(leaves[0]):
      for arrays in leaves[1:]:
        name, a = arrays[i]
        if a.shape[1:] != ref.shape[1:]:
          raise ValueError(f"{where}: {name} has example shape {a.shape[1:]}; {name0} has {ref.shape[1:]}.")
    counts = np.array([arrays[0][1].shape[0] for arrays in leaves], np.int64)
    c = len(clients)
    s = steps if steps is not None else max(1, -(-int(counts.max()) // batch_size))
    used = np.minimum(counts, s * batch_size)
    slot = np.arange(s * batch_size).reshape(s, batch_size)
    mask = slot[None] < used[:, None, None]
    data = []
    for i, (_, ref) in enumerate(leaves[0]):
      dtype = np.result_type(*[arrays[i][1].dtype for arrays in leaves])
      out = np.zeros((c, s * batch_size) + ref.shape[1:], dtype)
      for k, arrays in enumerate(leaves):
        out[k, :used[k]] = arrays[i][1][:used[k]]
      data.append(jnp.asarray(out.reshape((c, s, batch_size) + ref.shape[1:])))
    if client_ids is None:
      ids = np.arange(c)
    else:
      ids = np.asarray(client_ids)
      if ids.shape != (c,) or not np.issubdtype(ids.dtype, np.integer) or np.any(ids < 0):
        raise ValueError(f"{where}: client_ids must be {c} integers >= 0 (one per client); got {client_ids!r}.")
    if weights is None:
      w = counts.astype(np.float64)
    else:
      try:
        w = np.asarray(weights, np.float64)
      except (TypeError, ValueError):
        w = np.full((), np.nan)
      if w.shape != (c,) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"{where}: weights must be {c} finite numbers >= 0 (one per client); got {weights!r}.")
    return cls(data=jax.tree.unflatten(structure, data), mask=jnp.asarray(mask),
               weight=jnp.asarray(w, jnp.float32), client_id=jnp.asarray(ids, jnp.int32))

  @property
  def num_clients(self) -> int:
    """C, the number of clients in the round (static)."""
    return self.mask.shape[0]

  @property
  def local_steps(self) -> int:
    """S, the number of local steps per client (static)."""
    return self.mask.shape[1]

  @property
  def batch_size(self) -> int:
    """B, the number of example slots per local step (static)."""
    return self.mask.shape[2]


class ServerState(Protocol):
  """What every algorithm's state has; each algorithm's dataclass adds its own fields."""

  params: PyTree
  round: jax.Array
  key: jax.Array
  metrics: dict[str, jax.Array]


class FederatedAlgorithm(NamedTuple):
  """A federated algorithm as two pure functions (and, for some, a third).

  Attributes:
    init: `init(params, key) -> state`. Options are given to the factory, not here.
    step: `step(state, batches: ClientBatches) -> state`: one communication round.
    personalize: None, or, for algorithms whose client models are made at
      evaluation time from the global model (Per-FedAvg's adaptation step,
      FedAvg + fine-tuning's local steps), `personalize(params, data [S, B, ...],
      mask [S, B]) -> params` for one client: pure and jittable, the
      `personalize` field of `fedjax_opt.Evaluation` and the `adapt_fn` of
      `fedjax_opt.evaluate.adapted`.
  """

  init: Callable[..., Any]
  step: Callable[[Any, ClientBatches], Any]
  personalize: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None


class StreamingSum(NamedTuple):
  """The form of an aggregator that is a sum over clients, so it can be accumulated one chunk of clients at a time.

      aggregate(updates, weights, state, key)
          = finalize(Σ_c term(updates[c], weights[c], state)[0],
                     Σ_c term(updates[c], weights[c], state)[1], state, key)

  Attributes:
    term: `term(update [...], weight [], state) -> (tree like update, scalar)`:
      one client's contribution (a zero-weight client must contribute zeros).
    finalize: `finalize(sum_tree, sum_scalar, state, key) -> (update, state)`.
      The sums arrive in at least float32.
  """

  term: Callable[[PyTree, jax.Array, Any], tuple[PyTree, jax.Array]]
  finalize: Callable[[PyTree, jax.Array, Any, jax.Array], tuple[PyTree, Any]]


class ClientStage(NamedTuple):
  """What each client does to a message before sending it (the client side of an aggregator).

      (sent, new_row, bits) = apply(key, message, row)

  The first stage of the round's seam (compression with error feedback,
  `fedjax_opt.compression.compress`), run by `core.rounds.client_round`
  inside the client map on every message a client sends, with the client's
  own key and its own row of a per-client table.

  Attributes:
    init: `init(params) -> table`: the stage's rows for one kind of message, a
      per-client table (leaves `[N, ...]`, e.g. error-feedback residuals, zeros),
      or None when the stage keeps nothing per client.
    apply: `apply(key, message, row) -> (sent, new_row, bits)` for one client:
      `message` a pytree (the update), `row` its row of the table in the table's
      dtype (None without a table); `sent` is what the server receives, shaped
      like `message`; `new_row` like `row` (None without a table); `bits` a
      float32 scalar, the bits sent.
    num_clients: N, the rows of the table; None without one.
    name: a short label for messages ("compress(top_k(0.1), error_feedback)").
  """

  init: Callable[[PyTree], PyTree]
  apply: Callable[[jax.Array, PyTree, PyTree], tuple[PyTree, PyTree, jax.Array]]
  num_clients: int | None = None
  name: str = "client stage"


class StagedState(NamedTuple):
  """The state an algorithm keeps for an aggregator with a client stage (`core.rounds.init_aggregator_state`).

  Attributes:
    rows: one table of the client stage (`ClientStage.init(params)`) per kind of
      message a client sends: the update's first, then its further uploads in
      order (SCAFFOLD's Δc_i); None entries for a stage that keeps nothing.
    server: the state of the server side, `Aggregator.init(params)`: what
      `aggregate` and `streaming` receive and return.
  """

  rows: tuple
  server: Any


def _static_number(value: Any, name: str) -> float | None:
  """`value` as a Python float when it is one concrete number; None for None, a traced value (a swept σ) or a grid."""
  if value is None or isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, bool):
    raise TypeError(f"Traits: {name} must be a number or None; got {value!r}.")
  try:
    return float(value)
  except (TypeError, ValueError):
    return None


class NoisedState:
  """A marker base class: the state of a piece that adds calibrated noise an accountant reads (σ and m).

  `fedjax_opt.privacy.DPMeanState` (the state of `dp_mean`) is one. The core checks that a piece whose state is
  one declares itself private (`Traits.private`) and the converse (`core.server.check_declared_privacy`) without
  importing the privacy package, which builds on the core.
  """

  __slots__ = ()


class Downlink(NamedTuple):
  """A server stage: compression of what the server broadcasts, with the server's error (the last piece of the seam).

  `fedjax_opt.compression.downlink(compressor, error_feedback=...)` makes one; `fedjax_opt.aggregators.chain(...,
  aggregator, downlink)` attaches it to an aggregator (`Aggregator.downlink`), after the rule, as the client stage
  is attached before it. The server's step u_t = ServerOpt(−Δ_t) is broadcast as m_t = C(u_t + e_t), e_{t+1} =
  u_t + e_t − m_t, and every client's model moves by m_t (`core.averaging`'s module docstring, "Downlink").

  Attributes:
    init: `init(params) -> error`, e_0: zeros like the model with error feedback, None without.
    apply: `apply(key, update, error) -> (sent, new error, bits)`: with an error, v = update + error,
      sent = C(v), new error v − sent; with `error` None, sent = C(update) and new error None; `bits`
      a float32 scalar, the compressor's count of `sent`.
    name: a short label ("downlink(top_k(0.1), error_feedback)").
  """

  init: Callable[[PyTree], PyTree]
  apply: Callable[[jax.Array, PyTree, PyTree], tuple[PyTree, PyTree, jax.Array]]
  name: str


@dataclasses.dataclass(frozen=True)
class Traits:
  """What an aggregator does to the clients' updates, declared as data on the piece (`Aggregator.traits`).

      Aggregator(init, aggregate, traits=fo.aggregators.Traits(name="my_mean", linear=True))

  Every factory of the library declares its pieces' traits, and code that
  must know what a piece does reads them instead of guessing from where its
  functions were defined: SCAFFOLD and FedDyn, whose servers move state by a
  plain sum outside the aggregator, refuse a piece that is private, secure,
  robust or an attack (`core.server.protecting_piece`). An `Aggregator` whose
  `traits` is None is *unknown* (built by hand, or wrapped in a lambda or a
  `functools.partial`): such code refuses it rather than assume a plain sum.

  Traits combine: a wrapper (`fo.privacy.secure_aggregation(inner)`,
  `fo.attacks.corrupt(inner, ...)`) has its own flags or'd with the inner
  piece's (`Traits.wrap`: a wrapped `dp_mean` stays private), and
  `fo.aggregators.chain(stage, aggregator)` has the aggregator's with
  `client_stage` set. Unknown stays unknown: a wrapper or a chain around a
  piece without traits has none.

  Attributes:
    name: the factory that built the piece ("mean", "krum", "dp_mean",
      "secure_aggregation", "corrupt", ...), for messages.
    linear: the update is a weighted sum or mean of the updates as sent,
      Σ_c a_c Δ_c / Σ_c a_c with a_c from the weights alone (`mean`,
      `weighted_mean`; a secure sum of one): a rule that can be summed
      client by client. Clipping, noise, votes and robust rules are not.
    sums: the update is a function of one sum over clients,
      finalize(Σ_c term(Δ_c, w_c)), and the piece has that form
      (`Aggregator.streaming`): it streams client by client and can run
      inside a secure sum (`mean`, `weighted_mean`, `dp_mean`, and
      `majority_vote`, the sign of a sum of signs, which is not linear).
    private: differentially private: the updates are clipped and noised
      (`dp_mean`), on its own or inside a wrapper.
    noise_multiplier: σ of a private piece (the accountant's), when it was
      known where the piece was built; None otherwise (a traced σ in a sweep).
    clip_norm: its clip norm C (the initial C_0 under adaptive clipping), when known.
    secure: the server sees only a sum, not the individual updates (`secure_aggregation`).
    robust: a Byzantine-robust rule (medians, trimmed mean, Krum, Bulyan, centered clipping).
    attack: a simulated attack replaces rows the server receives (`fo.attacks.corrupt`).
    client_stage: the name of the client stage every message passes before it
      is sent (compression, attached by `fo.aggregators.chain`); None without one.
    inner: the traits of the piece this one wraps; None for a piece that wraps none.
    downlink: the name of the server stage the broadcast passes (downlink
      compression, `fo.compression.downlink`, attached last by `fo.aggregators.chain`); None without one.
  """

  name: str
  linear: bool = False
  sums: bool = False
  private: bool = False
  noise_multiplier: float | None = None
  clip_norm: float | None = None
  secure: bool = False
  robust: bool = False
  attack: bool = False
  client_stage: str | None = None
  inner: Traits | None = None
  downlink: str | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise TypeError(f"Traits: name must be a non-empty string (the factory that built the piece); got {self.name!r}.")
    for field in ("linear", "sums", "private", "secure", "robust", "attack"):
      if not isinstance(getattr(self, field), bool):
        raise TypeError(f"Traits({self.name!r}): {field} must be a bool; got {getattr(self, field)!r}.")
    for field in ("noise_multiplier", "clip_norm"):
      object.__setattr__(self, field, _static_number(getattr(self, field), field))
    if not self.private and (self.noise_multiplier is not None or self.clip_norm is not None):
      raise ValueError(f"Traits({self.name!r}): noise_multiplier and clip_norm describe a private piece; set "
                       f"private=True.")
    if self.client_stage is not None and not isinstance(self.client_stage, str):
      raise TypeError(f"Traits({self.name!r}): client_stage must be the stage's name or None; got "
                      f"{type(self.client_stage).__name__}.")
    if self.downlink is not None and not isinstance(self.downlink, str):
      raise TypeError(f"Traits({self.name!r}): downlink must be the server stage's name or None; got "
                      f"{type(self.downlink).__name__}.")
    if self.inner is not None and not isinstance(self.inner, Traits):
      raise TypeError(f"Traits({self.name!r}): inner must be the wrapped piece's Traits or None; got "
                      f"{type(self.inner).__name__}.")

  @classmethod
  def wrap(cls, inner: Traits | None, *, name: str, linear: bool | None = None, private: bool = False,
           secure: bool = False, robust: bool = False, attack: bool = False) -> Traits | None:
    """The traits of a piece `name` wrapped around a piece with traits `inner`; None when `inner` is None.

    Each flag is the wrapper's own or the inner piece's; `linear` is the
    inner's when not given (a secure sum of a mean is that mean); `sums` is
    the wrapper's own (no wrapper of the library has a streaming form); the
    inner's σ, clip norm, client stage and downlink carry over.
    """
    if inner is None:
      return None
    return cls(name=name, linear=inner.linear if linear is None else linear, private=private or inner.private,
               noise_multiplier=inner.noise_multiplier, clip_norm=inner.clip_norm, secure=secure or inner.secure,
               robust=robust or inner.robust, attack=attack or inner.attack, client_stage=inner.client_stage,
               inner=inner, downlink=inner.downlink)

  def describe(self) -> str:
    """The pieces: the client stage, then the outermost to the innermost, then the downlink,
    "compress(top_k(k=1)) → secure_aggregation(dp_mean) → downlink(top_k(k=1))"."""
    names, inner = [self.name], self.inner
    while inner is not None:
      names.append(inner.name)
      inner = inner.inner
    pieces = "(".join(names) + ")" * (len(names) - 1)
    pieces = pieces if self.client_stage is None else f"{self.client_stage} → {pieces}"
    return pieces if self.downlink is None else f"{pieces} → {self.downlink}"


class Aggregator(NamedTuple):
  """`init(params) -> state`; `aggregate(updates [C, ...], weights [C], state, key) -> (update, state)`.

  A weight of 0 marks a client that takes no part (padding clients, and those
  the round's rules exclude: docs/architecture.md, "The round").

  `streaming` (optional) is the same rule as a `StreamingSum`: when given,
  a round whose clients run in a loop (`client_map` sequential or chunked)
  adds each chunk's contribution to one running sum instead of stacking the
  C updates (`core.rounds.client_round`), so the round's memory does not grow
  with C. It must agree with `aggregate`; a rule that needs all the updates
  at once (medians, Krum, ...) has none.

  `always_releases` (default False): a round in which no client took part is
  normally rejected (model and aggregator state unchanged, see
  `core.server.aggregate_updates`); True accepts it whenever the aggregate is
  finite. A differentially private aggregator needs this: its noise must be
  released whether or not any client was sampled, or an empty round would
  tell who was absent (`fedjax_opt.privacy.dp_mean`).

  `client` (optional) is a `ClientStage` that every message passes on its
  client before it is sent (`fedjax_opt.aggregators.chain` attaches one):
  `init`, `aggregate` and `streaming` are then the server side, unchanged,
  and the state an algorithm keeps is a `StagedState` (the stage's tables
  and the server side's state), made by `core.rounds.init_aggregator_state`
  and updated by `core.rounds.client_round`. Without a client stage the
  state is `init(params)` itself.

  `traits` (optional) declares what the piece does to the updates
  (`Traits`: linear, private, secure, robust, an attack, its client stage).
  Every factory of the library declares them; None means unknown (a piece
  the library did not make), which code that must know refuses (SCAFFOLD,
  FedDyn).

  `downlink` (optional) is a `Downlink`, the server stage: what the server
  broadcasts after the round passes it (downlink compression with the
  server's error; `fedjax_opt.aggregators.chain(..., aggregator, downlink)`
  attaches one). The algorithms whose server step is one broadcast model
  apply it (`core.averaging.server_step`); every other factory that takes
  `aggregator=` declares why it takes no downlink and refuses one
  (`factory.downlink`, `core.execution.accepts_policy_keywords`).
  """

  init: Callable[[PyTree], Any]
  aggregate: Callable[[PyTree, jax.Array, Any, jax.Array], tuple[PyTree, Any]]
  streaming: StreamingSum | None = None
  always_releases: bool = False
  client: ClientStage | None = None
  traits: Traits | None = None
  downlink: Downlink | None = None
