"""docs/scaling.md stays true: its single-process python blocks run (on this process's one device).

The multi-host block needs several processes; tests/test_multihost.py runs that
pattern for real.
"""

import os
import re

import numpy as np
import pytest

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "scaling.md")

PRELUDE = """
import jax
import optax
import fedjax_opt as fo

dataset = fo.data.load("synthetic_1_1")
model = fo.models.logistic_regression(num_features=60, num_classes=10)
params = model.init(jax.random.key(0))
"""


def _blocks():
  with open(DOC, encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_single_process_blocks_run():
  blocks = [b for b in _blocks() if "fo.distributed.initialize" not in b]
  assert len(blocks) == 3
  namespace = {}
  exec(compile(PRELUDE, "prelude", "exec"), namespace)  # pylint: disable=exec-used
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"docs/scaling.md block {i}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as err:  # pylint: disable=broad-except
      pytest.fail(f"docs/scaling.md python block {i} failed: {type(err).__name__}: {err}")
  # The last block's seed sweep: 8 members, 100 rounds each, and they differ (different seeds).
  history = namespace["history"]
  assert history.sweep_size == 8
  losses = np.asarray(history.round_metrics["client_loss"])
  assert losses.shape == (8, 100)
  assert np.all(np.isfinite(losses)) and np.std(losses[:, -1]) > 0
  assert np.all(losses[:, -10:].mean(1) < losses[:, :10].mean(1))  # every member trains
