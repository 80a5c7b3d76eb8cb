"""The README's Python blocks run as written (the quickstart with fewer rounds, to stay fast)."""

import pathlib
import re

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # executes the documents

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) >= 2
  namespace = {}
  for block in blocks:
    exec(compile(block.replace("rounds=300", "rounds=25"), str(README), "exec"), namespace)
  history = namespace["history"]
  assert history.num_rounds == 25
  assert history.last_eval["test_accuracy"] > 0.5  # 25 rounds of FedAdam on MNIST 5k is far above chance (0.1)
  batch = {"x": np.ones((4, 3), np.float32), "y": np.array([0, 1, 2, 0])}
  params = {"w": np.zeros((3, 3), np.float32), "b": np.zeros(3, np.float32)}
  losses = namespace["loss_fn"](params, batch)
  np.testing.assert_allclose(losses, np.log(3.0) * np.ones(4), rtol=1e-6)
