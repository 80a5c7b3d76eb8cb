"""docs/data.md stays true: its python blocks run, in order, in one namespace."""

import os
import re

import pytest

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "data.md")


def _blocks():
  with open(DOC, encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_docs_have_code():
  assert len(_blocks()) >= 5


@pytest.mark.skipif(__import__("importlib").util.find_spec("sklearn") is None,
                    reason="the examples use the digits dataset: scikit-learn (the `data` extra) is not installed")
@pytest.mark.slow  # executes the documents
def test_every_python_block_in_docs_data_md_runs(capsys):
  namespace = {}
  for i, block in enumerate(_blocks()):
    try:
      exec(compile(block, f"docs/data.md block {i}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as err:  # pylint: disable=broad-except
      pytest.fail(f"docs/data.md python block {i} failed: {type(err).__name__}: {err}")
  out = capsys.readouterr().out
  assert "FederatedDataset 'synthetic_1_1'" in out
  assert str(100 * 5 * 3 * 8) in out
