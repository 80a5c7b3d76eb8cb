"""`chain`: a client stage, an aggregator and a server stage composed into one `Aggregator`, in the order of the seam.

A round's client updates pass, in order: the client stage (compression with
error feedback, on each client, with per-client state) → clipping and DP
noise → secure summation → aggregation → server optimizer. The pieces after
the client stage are aggregators that wrap one another
(`fo.privacy.secure_aggregation(fo.privacy.dp_mean(...))`); the client
stage runs elsewhere (inside the client map, on what each client sends), so
it is attached to the aggregator rather than wrapped around it:

    fo.aggregators.chain(fo.compression.compress(fo.compression.top_k(0.1), error_feedback=True, num_clients=N),
                         fo.privacy.dp_mean(1.0, 1.1, expected_clients=m))

is an `Aggregator` whose `client` is the compression stage and whose server
side is `dp_mean`'s. Every factory that takes `aggregator=` takes it; the
stage's tables (one per kind of message a client sends) live in the
algorithm's `aggregator_state` (`core.types.StagedState`).

The server's broadcast is the seam's last piece: a `Downlink`
(`fo.compression.downlink(compressor, error_feedback=...)`) chained after the
aggregator compresses what the server sends back (its step, with the server's
error feedback),

    fo.aggregators.chain(fo.compression.compress(fo.compression.top_k(0.1)), fo.privacy.dp_mean(1.0, 1.1, m),
                         fo.compression.downlink(fo.compression.top_k(0.1)))

and is attached as `Aggregator.downlink` (traits: `Traits.downlink`). It acts
after the aggregate is released, so it composes with every rule (DP is
post-processing-safe; a secure sum, a robust rule and an attack act on the
uplink before it). The algorithms whose server step moves one broadcast model
apply it; the others declare why they cannot (`factory.downlink`) and refuse
it in one line.

A combination that cannot work is refused here, in one line naming both
pieces: a downlink anywhere but last, or two of them; a client stage after an aggregator (compression after DP noise or a
secure sum would change what was clipped, noised or masked), two client
stages (a client sends one message per upload; compose the compressors into
one), two aggregators side by side (only the last piece aggregates; wrap
instead). Pieces that wrap an aggregator (`secure_aggregation`,
`fo.attacks.corrupt`) refuse one that already has a client stage: chain the
stage around the wrapper instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_opt.core.server import aggregator_name, check_aggregator
from fedjax_opt.core.types import Aggregator, ClientStage, Downlink

__all__ = ["chain"]


def _name(piece: Any) -> str:
  """A label for a piece in an error message: a stage's name, or the factory that built an aggregator (its traits)."""
  if isinstance(piece, (ClientStage, Downlink)):
    return piece.name
  if isinstance(piece, Aggregator):
    return aggregator_name(piece)
  return getattr(piece, "name", type(piece).__name__)


def _check_piece(piece: Any, position: int) -> None:
  if isinstance(piece, (ClientStage, Aggregator, Downlink)):
    return
  if callable(getattr(piece, "compress", None)) and hasattr(piece, "unbiased"):
    raise TypeError(f"chain: piece {position} is a compressor; wrap the compressor, "
                    f"fo.compression.compress({piece.name}, error_feedback=...).")
  raise TypeError(f"chain: piece {position} must be a client stage (fo.compression.compress(...)), an Aggregator "
                  f"(fo.aggregators.mean(), fo.privacy.dp_mean(...), ...) or, last, a downlink "
                  f"(fo.compression.downlink(...)); got {type(piece).__name__}.")


def chain(*pieces: ClientStage | Aggregator | Downlink) -> Aggregator:
  """The client stage, then the aggregator, then the downlink: `chain(stage, aggregator, downlink)` (module docstring).

  Args:
    *pieces: in the order of the seam: at most one `ClientStage`
      (`fo.compression.compress(...)`), then the `Aggregator` (a rule, `dp_mean`,
      `secure_aggregation(...)`, ...), then at most one `Downlink`
      (`fo.compression.downlink(...)`). `chain(aggregator)` is `aggregator`.

  Returns:
    The aggregator with `client` set to the stage and `downlink` to the
    downlink: its `init`, `aggregate`, `streaming` and `always_releases` are
    the aggregator's own, and its `traits` the aggregator's with
    `client_stage` and `downlink` the stages' names (None, unknown, when the
    aggregator declares none).

  Raises:
    TypeError: a piece that is neither a client stage nor an aggregator, or no aggregator.
    ValueError: pieces that do not compose (module docstring), naming both.
  """
  if not pieces:
    raise TypeError("chain: give a client stage and an aggregator, e.g. "
                    "fo.aggregators.chain(fo.compression.compress(...), fo.aggregators.mean()).")
  for position, piece in enumerate(pieces):
    _check_piece(piece, position)
  downlinks = [piece for piece in pieces if isinstance(piece, Downlink)]
  if len(downlinks) > 1:
    raise ValueError(f"chain: {_name(downlinks[0])} and {_name(downlinks[1])} are both downlinks: the server "
                     f"broadcasts one message a round; compose the compressors into one.")
  if downlinks and not isinstance(pieces[-1], Downlink):
    raise ValueError(f"chain: {_name(downlinks[0])} comes before {_name(pieces[-1])}: a downlink compresses what the "
                     f"server broadcasts after the aggregate is released; put it last.")
  if downlinks:
    *pieces, downlink = pieces
    if not pieces:
      raise TypeError(f"chain: {_name(downlink)} needs an aggregator before it, e.g. "
                      f"fo.aggregators.chain(fo.aggregators.mean(), {_name(downlink)}).")
    return _with_downlink(chain(*pieces), downlink)
  for before, after in zip(pieces, pieces[1:]):
    if isinstance(before, Aggregator) and isinstance(after, ClientStage):
      raise ValueError(f"chain: {_name(after)} comes after {_name(before)}: a client stage acts on what each client "
                       f"sends, before clipping, noise and secure summation; put it first.")
    if isinstance(before, Aggregator):
      raise ValueError(f"chain: {_name(before)} and {_name(after)} are both aggregators: only the last piece "
                       f"aggregates (secure summation wraps its rule: fo.privacy.secure_aggregation(inner, ...)).")
    if isinstance(after, ClientStage):
      raise ValueError(f"chain: {_name(before)} and {_name(after)} are both client stages: a client sends one "
                       f"message per upload; compose them into one stage.")
  *stages, last = pieces
  if not isinstance(last, Aggregator):
    raise TypeError(f"chain: the last piece must be the aggregator (e.g. fo.aggregators.mean()); got {_name(last)}.")
  aggregator = check_aggregator(last)
  if not stages:
    return aggregator
  stage, = stages
  if aggregator.client is not None:
    raise ValueError(f"chain: {_name(stage)} and {aggregator.client.name} are both client stages: a client sends "
                     f"one message per upload; compose them into one stage.")
  traits = None if aggregator.traits is None else dataclasses.replace(aggregator.traits, client_stage=stage.name)
  return aggregator._replace(client=stage, traits=traits)


def _with_downlink(aggregator: Aggregator, downlink: Downlink) -> Aggregator:
  """`aggregator` with `downlink` attached (and named in its traits); refuses a second one."""
  if aggregator.downlink is not None:
    raise ValueError(f"chain: {_name(aggregator)} already has the downlink {aggregator.downlink.name}, and "
                     f"{downlink.name} is another: the server broadcasts one message a round; keep one.")
  traits = None if aggregator.traits is None else dataclasses.replace(aggregator.traits, downlink=downlink.name)
  return aggregator._replace(downlink=downlink, traits=traits)


def attach_downlink(aggregator: Aggregator, downlink: Downlink | None, who: str) -> Aggregator:
  """A factory's `downlink=` shorthand: `chain(aggregator, downlink)` (the aggregator as it is for None); refuses a
  downlink given both ways, naming `who`."""
  if downlink is None:
    return aggregator
  if aggregator.downlink is not None:
    raise ValueError(f"{who}: the downlink is given twice, downlink={downlink.name} and chained in aggregator= "
                     f"({aggregator.downlink.name}); give it once (fo.aggregators.chain(..., aggregator, downlink) "
                     f"is the same as downlink=).")
  return _with_downlink(aggregator, downlink)
