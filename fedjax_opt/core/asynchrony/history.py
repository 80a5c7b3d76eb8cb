"""The ring buffer of the last H server models, which stale clients train from.

Versions and the ring buffer. The server model x_v carries a version v, the
number of server updates applied so far (x_0 is the initial model). The
state keeps the last H server models in a ring buffer (`ModelHistory`,
leaves `[H, ...]`): slot v mod H holds x_v, and `versions[slot]` says which
version it holds. A client that pulled version p trains from x_p, read from
the buffer when its update arrives. Its *staleness* when the server uses its
update at version v is v − p, the number of server updates between its pull
and that use (0: nothing happened in between). An update whose model x_p is
no longer in the buffer (v − p ≥ H when the event starts) cannot be computed:
it is discarded and counted in `metrics["num_too_stale"]` (`events.py`); its
client is dispatched again as if it had delivered.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_opt.core.types import PyTree

__all__ = ["ModelHistory", "history_init", "history_push", "history_read"]


class ModelHistory(NamedTuple):
  """The last H server models.

  Attributes:
    models: pytree like the model, leaves `[H, ...]`; slot v mod H holds x_v.
    versions: `[H]` int32, the version each slot holds (−1: empty).
  """

  models: PyTree
  versions: jax.Array


def history_init(params: PyTree, size: int) -> ModelHistory:
  """A buffer of `size` slots holding x_0 in slot 0."""
  models = jax.tree.map(lambda p: jnp.zeros((size,) + jnp.shape(p), jnp.result_type(p)).at[0].set(p), params)
  versions = jnp.full((size,), -1, jnp.int32).at[0].set(0)
  return ModelHistory(models, versions)


def history_read(history: ModelHistory, versions: jax.Array) -> tuple[PyTree, jax.Array]:
  """`(models [A, ...], held [A])`: x_p for each version p, and whether the buffer still holds it.

  Where `held` is False the model read is another version's (or zeros) and must not be used.
  """
  size = history.versions.shape[0]
  slots = jnp.mod(versions, size)
  held = (history.versions[slots] == versions) & (versions >= 0)
  return jax.tree.map(lambda m: m[slots], history.models), held


def history_push(history: ModelHistory, params: PyTree, version: jax.Array, push: jax.Array) -> ModelHistory:
  """Stores x_version in slot version mod H when `push` is True (the oldest version there is forgotten)."""
  slot = jnp.mod(version, history.versions.shape[0])
  models = jax.tree.map(lambda m, p: m.at[slot].set(jnp.where(push, p.astype(m.dtype), m[slot])),
                        history.models, params)
  versions = history.versions.at[slot].set(jnp.where(push, version, history.versions[slot]))
  return ModelHistory(models, versions)
