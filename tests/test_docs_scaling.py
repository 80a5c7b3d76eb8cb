"""docs/scaling.md stays true: each single-process python block runs as written, on its own.

Every block is run in a fresh namespace (its imports and definitions are its
own), on this process's one device. The multi-host block needs several
processes; tests/test_multihost.py runs that pattern for real.
"""

import os
import re

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # executes the documents

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "scaling.md")


def _blocks():
  with open(DOC, encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def _run(block: str, name: str) -> dict:
  namespace = {}
  try:
    exec(compile(block, name, "exec"), namespace)  # pylint: disable=exec-used
  except Exception as err:  # pylint: disable=broad-except
    pytest.fail(f"{name} failed: {type(err).__name__}: {err}")
  return namespace


def test_single_process_blocks_run_as_written():
  blocks = [b for b in _blocks() if "fo.distributed.initialize" not in b]
  assert len(blocks) == 4
  for i, block in enumerate(blocks):
    namespace = _run(block, f"docs/scaling.md python block {i}")
  # The last block's seed sweep: 8 members, 100 rounds each, and they differ (different seeds).
  history = namespace["history"]
  assert history.sweep_size == 8
  losses = np.asarray(history.round_metrics["client_loss"])
  assert losses.shape == (8, 100)
  assert np.all(np.isfinite(losses)) and np.std(losses[:, -1]) > 0
  assert np.all(losses[:, -10:].mean(1) < losses[:, :10].mean(1))  # every member trains
