"""Prints docs/privacy.md's composition matrix, generated from `fo.aggregators.composition` (the pieces' traits).

    python tools/composition_matrix.py            # the Markdown table, on stdout
    python tools/composition_matrix.py --write    # replace the block between the markers in docs/privacy.md
    python tools/composition_matrix.py --check    # exit 1 when docs/privacy.md's block is not the table

The block lies between `<!-- composition-matrix:start -->` and
`<!-- composition-matrix:end -->`; tests/test_composition_matrix.py checks
that it is exactly this table, so the docs cannot drift from the code.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

START, END = "<!-- composition-matrix:start -->", "<!-- composition-matrix:end -->"
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "privacy.md"


def table() -> str:
  from fedjax_opt.aggregators import composition  # pylint: disable=import-outside-toplevel
  return composition.markdown()


def replaced(text: str, block: str) -> str:
  if text.count(START) != 1 or text.count(END) != 1:
    raise SystemExit(f"{DOC}: expected one {START} and one {END}.")
  head, rest = text.split(START, 1)
  _, tail = rest.split(END, 1)
  return f"{head}{START}\n{block}{END}{tail}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--write", action="store_true", help="rewrite the block in docs/privacy.md")
  group.add_argument("--check", action="store_true", help="exit 1 when docs/privacy.md's block is stale")
  args = parser.parse_args(argv)
  block = table()
  if not (args.write or args.check):
    sys.stdout.write(block)
    return 0
  text = DOC.read_text()
  new = replaced(text, block)
  if args.check:
    if new != text:
      print(f"{DOC} is stale: run python tools/composition_matrix.py --write", file=sys.stderr)
      return 1
    return 0
  DOC.write_text(new)
  return 0


if __name__ == "__main__":
  sys.exit(main())
