"""The README's Python blocks run as written (the quickstart with fewer rounds, to stay fast).

All of them together in the slow tier (the quickstart trains on MNIST 5k); the `lax.scan` example of
`fo.ClientBatches.from_clients`, which takes a second, also on its own in the default tier.
"""

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"


def _blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _check_scan_example(namespace):
  batches, losses = namespace["batches"], np.asarray(namespace["losses"])
  assert (batches.num_clients, batches.local_steps, batches.batch_size) == (3, 3, 4)
  np.testing.assert_array_equal(batches.weight, [7, 12, 3])
  np.testing.assert_array_equal(np.asarray(batches.mask).sum(axis=(1, 2)), [7, 12, 3])
  assert losses.shape == (50,) and np.all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0]
  final = namespace["final"]
  assert int(final.round) == 50
  w, b = (np.asarray(final.params["linear"][k], np.float64) for k in ("kernel", "bias"))
  x = np.concatenate([c["x"] for c in namespace["clients"]])
  y = np.concatenate([c["y"] for c in namespace["clients"]])
  assert np.mean(np.argmax(x @ w + b, axis=1) == y) >= 0.9  # the linear rule is learnt (NumPy's prediction)


def test_readme_scan_example_runs_as_written():
  (block,) = [b for b in _blocks() if "from_clients" in b]
  namespace = {}
  exec(compile(block, str(README), "exec"), namespace)
  _check_scan_example(namespace)


@pytest.mark.slow  # executes the document: the quickstart trains on MNIST 5k
def test_readme_python_blocks_run():
  blocks = _blocks()
  assert len(blocks) >= 2
  namespace = {}
  for block in blocks:
    exec(compile(block.replace("rounds=300", "rounds=25"), str(README), "exec"), namespace)
  _check_scan_example(namespace)
  history = namespace["history"]
  assert history.num_rounds == 25
  assert history.last_eval["test_accuracy"] > 0.5  # 25 rounds of FedAdam on MNIST 5k is far above chance (0.1)
  batch = {"x": np.ones((4, 3), np.float32), "y": np.array([0, 1, 2, 0])}
  params = {"w": np.zeros((3, 3), np.float32), "b": np.zeros(3, np.float32)}
  losses = namespace["loss_fn"](params, batch)
  np.testing.assert_allclose(losses, np.log(3.0) * np.ones(4), rtol=1e-6)
