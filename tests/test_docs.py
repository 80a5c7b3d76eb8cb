"""Every Python block of README.md and docs/*.md is executed by a test.

Each document with Python blocks has one test module that runs all of its
blocks, in order, and checks what they produce. This module keeps that true:
a new document with code, or a document whose blocks are not all run, fails
here until its test exists.
"""

import pathlib
import re

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
