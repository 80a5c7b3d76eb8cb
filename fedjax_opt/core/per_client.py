"""Per-client state: a stacked `[num_clients, ...]` pytree, gathered and scattered by client id.

Algorithms that remember something about every client between rounds
(SCAFFOLD's control variates c_i, FedDyn's linear terms ∇L_i, ADMM duals,
personalized models) keep it in the server state as one *table*: a pytree
shaped like the model with a leading `[N]` axis, N = `num_clients`. A round
touches only its participating clients:

    old   = gather(table, batches.client_id)              [C, ...]
    new   = ... computed per client (client_map) ...       [C, ...]
    table = scatter(table, batches.client_id, new, write).table

`write` `[C]` says which clients may write back: the algorithm passes
`weight > 0` (zero-weight padding clients never write) together with whatever
else disqualifies a client (for `core.rounds.client_round`, the round's rules:
docs/architecture.md, "The round"). The gather and scatter act on the stacked `[C]` axis outside the
client map, so the result is the same under every `client_map` mode.

Duplicates: a client drawn twice in one round (sampling with replacement)
reads the same row twice; of its writing copies the *last* one in the round's
order wins, deterministically. `Scattered.written` marks exactly the copies
that landed, so server-side sums over "changed rows" (SCAFFOLD's
c ← c + (1/N) Σ Δc_i, FedDyn's h) count each row once and stay equal to the
mean of the table.

Out-of-range ids: when `client_id` is concrete (eager calls), an id
≥ `num_clients` (or < 0) raises a ValueError. Inside jit the ids are traced and no
Python error can be raised; then the gather reads NaN for such a client (so
an algorithm that uses the row produces a non-finite update, which the
non-finite guard drops and counts in `metrics["num_nonfinite"]`) and its
write is discarded. The table is never corrupted.

Memory: the table costs `num_clients × (number of model parameters) ×
bytes per entry` — for a 1.2 M-parameter CNN and 3,400 clients in float32,
about 16 GiB per table. `storage_dtype=jnp.bfloat16` halves that; values are
rounded when stored and read back in the model's dtype (a control variate
needs far less precision than the model). `nbytes(params, num_clients,
storage_dtype)` gives the cost before allocating. Run rounds over a 16-bit
table with `scan_rounds` (as `fo.train` does): XLA:CPU updates such a table
in place only when the scan carries it as its uint16 bits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_opt.core import execution
from fedjax_opt.core.validation import check_num_clients, is_concrete

__all__ = ["Scattered", "broadcast", "gather", "init", "last_writers", "nbytes", "num_rows", "personalized_params",
           "scan_rounds", "scatter"]

PyTree = Any


def num_rows(table: PyTree) -> int:
  """N, the leading axis shared by every leaf of a table (static)."""
  leaves = jax.tree.leaves(table)
  if not leaves:
    raise ValueError("a per-client table needs at least one array.")
  sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"every leaf of a per-client table must share the leading [num_clients] axis; got {sizes}.")
  return sizes.pop()


def check_client_ids(client_id: jax.Array, num_clients: int, name: str = "batches.client_id") -> None:
  """Raises ValueError when a concrete `client_id` `[C]` holds an id outside [0, num_clients)."""
  if jnp.ndim(client_id) != 1:
    raise ValueError(f"{name} must have shape [C]; got shape {tuple(jnp.shape(client_id))}.")
  if not jnp.issubdtype(jnp.result_type(client_id), jnp.integer):
    raise TypeError(f"{name} must be an integer array; got dtype {jnp.result_type(client_id)}.")
  if not is_concrete(client_id):
    return
  ids = np.asarray(client_id)
  if np.any(ids < 0):
    raise ValueError(f"{name} must be non-negative row indices; got {int(ids.min())}.")
  bad = ids[ids >= num_clients]
  if bad.size:
    raise ValueError(
        f"{name} holds id {int(bad[0])} but the per-client state has num_clients={num_clients} rows "
        f"(ids must lie in [0, {num_clients})): build the algorithm with num_clients >= {int(ids.max()) + 1}.")


def init(params: PyTree, num_clients: int, *, storage_dtype: Any = None, fill: float = 0.0) -> PyTree:
  """A table `[num_clients, *leaf.shape]` per leaf of `params`, every row equal to `fill`.

  Args:
    params: the model (or any pytree) whose shapes each row takes.
    num_clients: N, the number of rows (static Python int).
    storage_dtype: dtype of the stored entries (e.g. `jnp.bfloat16`); None: the
      execution policy's (`core.execution`) for floating leaves, which keeps
      each leaf's dtype unless a policy sets one.
    fill: the initial value of every entry (0 for control variates).

  Returns:
    The table, a pytree like `params` with leaves `[N, ...]`.
  """
  n = check_num_clients(num_clients)
  policy_dtype = execution.current().storage_dtype if storage_dtype is None else None

  def leaf(p):
    dtype = jnp.result_type(p) if storage_dtype is None else storage_dtype
    if policy_dtype is not None and jnp.issubdtype(dtype, jnp.floating):  # the policy's: floating leaves only
      dtype = policy_dtype
    return jnp.full((n,) + jnp.shape(p), fill, dtype)

  return jax.tree.map(leaf, params)


def nbytes(params: PyTree, num_clients: int, storage_dtype: Any = None) -> int:
  """Bytes a table for `params` would take: N × Σ_leaves size × itemsize (works on shape structs)."""
  n = check_num_clients(num_clients)
  total = 0
  for p in jax.tree.leaves(params):
    dtype = jnp.result_type(p) if storage_dtype is None else storage_dtype
    total += int(np.prod(jnp.shape(p), dtype=np.int64)) * jnp.dtype(dtype).itemsize
  return n * total


def _row_or_out_of_range(client_id: jax.Array, num_clients: int) -> jax.Array:
  """The row of each id; `num_clients` (out of range: NaN reads, dropped writes) for ids < 0 or ≥ N.

  jnp indexing wraps negative indices, which would silently address row N − 1.
  """
  return jnp.where((client_id >= 0) & (client_id < num_clients), client_id, num_clients)


_HALF_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _bits(t: jax.Array) -> jax.Array:
  """A 16-bit float table viewed as uint16 (a free bitcast), other tables as they are.

  XLA:CPU has no 16-bit float scatter: it converts the whole `[N, ...]` table to
  float32 and back around one, O(N) per round. On the bit view the gather and
  the scatter move the C rows only.
  """
  return jax.lax.bitcast_convert_type(t, jnp.uint16) if t.dtype in _HALF_FLOATS else t


def _unbits(b: jax.Array, dtype: Any) -> jax.Array:
  return jax.lax.bitcast_convert_type(b, dtype) if jnp.dtype(dtype) in _HALF_FLOATS else b


def _is_half(x: Any) -> bool:
  return hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) and x.dtype in _HALF_FLOATS


def to_bits(tree: PyTree) -> PyTree:
  """Every 16-bit float leaf of `tree` as its uint16 bit pattern; other leaves as they are.

  For the carry of a `lax.scan` over rounds: XLA:CPU cannot update a 16-bit
  float table in place (every view or scatter of it copies all N rows), but it
  updates a uint16 one in place. Converting the state once before the scan
  and back once after it (`from_bits`), with `from_bits`/`to_bits` around the
  step inside the body (they cancel there), makes each round O(C) instead of
  O(N); the two conversions cost one pass over the table per scan. `fo.train`
  does this for every chunk of rounds.
  """
  return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16) if _is_half(x) else x, tree)


def from_bits(bits: PyTree, like: PyTree) -> PyTree:
  """Inverse of `to_bits`: the leaves whose `like` leaf is a 16-bit float read back in that dtype."""
  return jax.tree.map(lambda b, l: jax.lax.bitcast_convert_type(b, l.dtype) if _is_half(l) else b, bits, like)


def scan_rounds(body: Any, state: PyTree, xs: Any = None, length: int | None = None) -> tuple[PyTree, Any]:
  """`jax.lax.scan(body, state, xs, length)` with 16-bit float leaves of the carry kept as bits.

  Same result as the plain scan, bit for bit; per-client tables stored in
  bfloat16/float16 are then updated in place on every backend (see `to_bits`).
  """
  def bits_body(carry, x):
    new, out = body(from_bits(carry, state), x)
    return to_bits(new), out

  carry, out = jax.lax.scan(bits_body, to_bits(state), xs, length=length)
  return from_bits(carry, state), out


def _take_rows(t: jax.Array, row: jax.Array) -> jax.Array:
  """`t[row]` along the leading axis, NaN rows where `row` is out of range, in `t`'s dtype."""
  if t.dtype in _HALF_FLOATS:
    nan_bits = int(np.asarray(np.nan, dtype=t.dtype).view(np.uint16))
    return _unbits(jnp.take(_bits(t), row, axis=0, mode="fill", fill_value=nan_bits), t.dtype)
  return jnp.take(t, row, axis=0, mode="fill")


def gather(table: PyTree, client_id: jax.Array, *, like: PyTree | None = None) -> PyTree:
  """The rows of the round's clients, `[C, ...]` per leaf.

  Args:
    table: a per-client table (leaves `[N, ...]`).
    client_id: `[C]` int ids, `batches.client_id`.
    like: optional pytree (the model) whose leaf dtypes the rows are cast to,
      e.g. float32 rows from a bfloat16 table. None keeps the storage dtype.

  Returns:
    `table[client_id]` leaf-wise; NaN rows for out-of-range ids under jit.
  """
  check_client_ids(client_id, num_rows(table))
  row = _row_or_out_of_range(client_id, num_rows(table))

  rows = jax.tree.map(lambda t: _take_rows(t, row), table)
  if like is None:
    return rows
  return jax.tree.map(lambda r, p: r.astype(jnp.result_type(p)), rows, like)


def last_writers(client_id: jax.Array, write: jax.Array, num_clients: int) -> jax.Array:
  """`[C]` bool: `write[c]` and no later c' with the same id also writes (the copy whose row lands)."""
  position = jnp.arange(client_id.shape[0], dtype=jnp.int32)
  row = _row_or_out_of_range(client_id, num_clients)
  latest = jnp.full((num_clients,), -1, jnp.int32).at[row].max(jnp.where(write, position, -1), mode="drop")
  in_range = row < num_clients
  return write & in_range & (latest[jnp.where(in_range, row, 0)] == position)


class Scattered(NamedTuple):
  """Result of `scatter`.

  Attributes:
    table: the new table (rows of non-writing clients unchanged, bit for bit).
    written: `[C]` bool, the clients whose row was written (last duplicate wins).
    change: Σ_{c written} (stored new row − stored old row), one row `[...]` per
      leaf in the dtype of `values`: the exact change of Σ_rows table, so a
      server-side mean of the table can be kept in step with it.
  """

  table: PyTree
  written: jax.Array
  change: PyTree


def scatter(table: PyTree, client_id: jax.Array, values: PyTree, write: jax.Array, *,
            old_rows: PyTree | None = None) -> Scattered:
  """Writes `values[c]` into row `client_id[c]` for the clients with `write[c]`.

  Args:
    table: a per-client table (leaves `[N, ...]`).
    client_id: `[C]` int ids.
    values: pytree like the table with leaves `[C, ...]` (any float dtype; cast
      to the storage dtype).
    write: `[C]` bool, which clients may write (e.g. `weight > 0` and finite).
    old_rows: the rows as `gather(table, client_id)` read them (storage
      dtype), when the caller has them: `change` then needs no second read of
      the table, which lets XLA update it in place (a late read of the old
      table makes it copy all N rows every round).

  Returns:
    `Scattered(table, written, change)`.
  """
  n = num_rows(table)
  check_client_ids(client_id, n)
  written = last_writers(client_id, write, n)
  target = jnp.where(written, client_id, n)  # index n is out of range: dropped

  def put(t, v):
    return _unbits(_bits(t).at[target].set(_bits(v.astype(t.dtype)), mode="drop"), t.dtype)

  def change(t, v, o):
    old = (_take_rows(t, jnp.where(written, client_id, 0)) if o is None else o).astype(v.dtype)
    new = v.astype(t.dtype).astype(v.dtype)
    keep = written.reshape((-1,) + (1,) * (v.ndim - 1))
    return jnp.sum(jnp.where(keep, new - old, jnp.zeros_like(v)), axis=0)

  return Scattered(
      table=jax.tree.map(put, table, values),
      written=written,
      change=jax.tree.map(change, table, values, jax.tree.map(lambda _: None, table) if old_rows is None
                          else old_rows, is_leaf=lambda x: x is None),
  )


def broadcast(params: PyTree, num_clients: int, *, storage_dtype: Any = None) -> PyTree:
  """A table whose every row is `params` (leaves `[N, ...]`): personal models that start at the global one."""
  table = init(params, num_clients, storage_dtype=storage_dtype)
  return jax.tree.map(lambda t, p: t + jnp.asarray(p).astype(t.dtype), table, params)


TABLE_FIELD = "local_params"
"""The one name of the per-client model table `[N, ...]` in every state that keeps per-client models."""


def personalized_params(state: Any, client_id: Any = None) -> PyTree:
  """The per-client models of any algorithm that keeps them (`state.local_params`).

  Ditto's v_i, pFedMe's θ_i, EASGD's and FedU's x_i, L2GD / L2SGD / L2SGD+'s
  and mixture ADMM's x_i, consensus ADMM's x_i, GADMM's θ_n: every such state
  stores them as one per-client table named `local_params` (leaves `[N, ...]`).
  The clustered states (IFCA, CFL: `cluster_params` and `cluster_of`) give
  each client its cluster's model (`core.clusters.client_models`).

  Args:
    state: the algorithm's state.
    client_id: None for the whole table `[N, ...]`, an int for one client's
      model, or a `[C]` int array for a stack of rows `[C, ...]`.

  Returns:
    The model(s), in the dtype of the global model `state.params`.

  Raises:
    TypeError: the state keeps no per-client models. Per-FedAvg and FedAvg +
      fine-tuning make a client's model at evaluation time, from the global
      model and the client's data: `algorithm.personalize(params, data, mask)`.
  """
  if hasattr(state, "cluster_of") and hasattr(state, "cluster_params"):  # IFCA, CFL: a client's cluster model
    from fedjax_opt.core.clusters import client_models  # pylint: disable=import-outside-toplevel
    return client_models(state, client_id)
  table = getattr(state, TABLE_FIELD, None)
  if table is None:
    hint = ""
    if hasattr(state, "params"):
      hint = (" Algorithms that make a client's model at evaluation time (Per-FedAvg, FedAvg + fine-tuning) "
              "expose it as algorithm.personalize(params, data, mask).")
    raise TypeError(f"{type(state).__name__} keeps no per-client models (no `{TABLE_FIELD}` table).{hint}")
  if client_id is None:
    return table
  ids = jnp.asarray(client_id, jnp.int32)
  rows = gather(table, jnp.atleast_1d(ids), like=state.params if _same_structure(table, state.params) else None)
  return jax.tree.map(lambda r: r[0], rows) if ids.ndim == 0 else rows


def _same_structure(table: PyTree, params: PyTree) -> bool:
  return jax.tree.structure(table) == jax.tree.structure(params)
