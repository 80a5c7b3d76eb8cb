"""Every Python block of README.md and docs/*.md is executed by a test.

Each document with Python blocks has one test module that runs all of its
blocks, in order, and checks what they produce. This module keeps that true:
a new document with code, or a document whose blocks are not all run, fails
here until its test exists.
"""

import os
import pathlib
import re
import subprocess
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

RUN_BY = {
    "README.md": "tests/test_readme.py",
    "docs/data.md": "tests/test_data_docs.py",
    "docs/models.md": "tests/test_models.py",
    "docs/scaling.md": "tests/test_docs_scaling.py",
    "docs/privacy.md": "tests/test_privacy_cli.py",
}
"""Document → the test module that runs every one of its Python blocks."""


def _python_blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_every_document_with_python_blocks_has_a_test_that_runs_them():
  documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
  with_code = {str(p.relative_to(ROOT)) for p in documents if _python_blocks(p)}
  assert with_code == set(RUN_BY), f"documents with python blocks and no test: {sorted(with_code - set(RUN_BY))}"
  for doc, test in RUN_BY.items():
    source = (ROOT / test).read_text(encoding="utf-8")
    assert pathlib.PurePath(doc).name in source, f"{test} does not read {doc}"
    assert "```python" in source, f"{test} does not extract the python blocks of {doc}"


def test_no_other_code_block_is_python_in_disguise():
  """Blocks fenced without a language would escape the tests: every fence names one."""
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    fences = re.findall(r"^```(\S*)", path.read_text(encoding="utf-8"), flags=re.M)
    openings = fences[0::2]
    assert all(openings), f"{path.name}: a code block opens with a bare ``` (name its language: python, bash, text)"


def test_the_readme_describes_the_notebook_it_ships():
  """It said the notebook "is the same with plots": the notebook runs digits, not the quickstart's MNIST 5k."""
  import json  # pylint: disable=import-outside-toplevel

  notebook = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text(encoding="utf-8"))
  code = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
  dataset = re.search(r'fo\.data\.load\("(\w+)"', code).group(1)
  clients = re.search(r"num_clients=(\d+)", code).group(1)
  rounds = re.search(r"rounds=(\d+)", code).group(1)
  paragraphs = (ROOT / "README.md").read_text(encoding="utf-8").split("\n\n")
  paragraph = " ".join(next(p for p in paragraphs if "`notebooks/quickstart.ipynb`" in p).split())
  sentence = paragraph[paragraph.index("`notebooks/quickstart.ipynb`"):]  # to the end of its paragraph
  assert f"`{dataset}`" in sentence and f"{clients} clients" in sentence and f"{rounds} rounds" in sentence, sentence
  assert ("logistic_regression" in code) == ("logistic regression" in sentence)
  assert "is the same" not in sentence


def _without_code(text: str) -> str:
  """The Markdown text without its fenced blocks and inline code spans (a link written there is not a link)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  return re.sub(r"(`+).+?\1", "", text, flags=re.S)


def relative_links(text: str) -> list[str]:
  """The targets of the links and images of a Markdown text that point into the repository: inline
  (`[text](target)`, `![alt](target "title")`), reference definitions (`[id]: target`) and HTML `src` / `href`;
  not web addresses, `mailto:` or anchors within the document. A target's own anchor is dropped."""
  text = _without_code(text)
  targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
  targets += re.findall(r"^ {0,3}\[[^\]]+\]:\s+<?([^\s>]+)>?", text, flags=re.M)
  targets += re.findall(r"(?:src|href)\s*=\s*\"([^\"]+)\"", text)
  out = []
  for target in targets:
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
      continue
    out.append(urllib.parse.unquote(target.split("#", 1)[0]))
  return out


def broken_links(tracked: set[str]) -> list[str]:
  """`document: target` for every relative link or image of README.md and docs/*.md whose file (or folder) is not
  among `tracked`, the repository paths that git tracks."""
  folders = {str(parent) for p in tracked for parent in pathlib.PurePosixPath(p).parents}
  broken = []
  for document in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    for target in relative_links(document.read_text(encoding="utf-8")):
      resolved = os.path.normpath(os.path.join(os.path.dirname(document.relative_to(ROOT)), target))
      path = pathlib.PurePath(resolved).as_posix()
      if path.startswith("../") or (path not in tracked and path not in folders):
        broken.append(f"{document.relative_to(ROOT)}: {target}")
  return broken


def _tracked() -> set[str]:
  try:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    # CI and every developer run from a git clone, where this runs; an unpacked source archive has no index.
    pytest.skip("not a git checkout: which files are tracked is unknown")
  return set(listed.decode("utf-8").split("\0")) - {""}


def test_every_relative_link_and_image_points_to_a_tracked_file():
  """A link or image into the repository must name a file that is committed: one that is missing, or ignored
  (benchmarks/results/*.png), shows as a broken image to every reader."""
  tracked = _tracked()
  assert "README.md" in tracked and "docs/img/main_job_accuracy.png" in tracked
  assert not broken_links(tracked), broken_links(tracked)


def test_the_link_check_finds_links_images_and_definitions_and_skips_code():
  text = ("See [the CLI](cli.md#run) and ![a plot](img/a%20b.png \"title\"), [ref]: ../README.md\n"
          "[ref]: data.md\n<img src=\"img/c.png\"> [web](https://example.org) [here](#top) `[code](nowhere.md)`\n"
          "```text\n[fenced](nowhere.md)\n```\n")
  assert relative_links(text) == ["cli.md", "img/a b.png", "data.md", "img/c.png"]
  tracked = _tracked()
  untracked = set(broken_links(tracked - {"docs/img/main_job_accuracy.png"})) - set(broken_links(tracked))
  assert untracked == {"README.md: docs/img/main_job_accuracy.png"}
