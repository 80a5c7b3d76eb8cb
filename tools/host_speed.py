"""One figure of a host's speed, printed beside test and run times so that times from different hosts compare.

    python tools/host_speed.py        # host speed: 1024² float32 matmul (NumPy) 11.2 ms, median of 9, 2 cores

The figure is the median wall time of a fixed NumPy matmul (1024 × 1024, float32) over 9 tries after one
warm-up; NumPy only, so it runs before anything of the project is installed. A host that takes twice as long
for it will take about twice as long for the test tiers.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

SIZE = 1024
TRIES = 9


def matmul_milliseconds(size: int = SIZE, tries: int = TRIES) -> float:
  """Median wall time in ms of `a @ b` for fixed float32 [size, size] matrices."""
  import numpy as np

  rng = np.random.default_rng(0)
  a = rng.standard_normal((size, size), dtype=np.float32)
  b = rng.standard_normal((size, size), dtype=np.float32)
  a @ b  # warm-up: thread pool and caches
  times = []
  for _ in range(tries):
    start = time.perf_counter()
    a @ b
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main() -> int:
  print(f"host speed: {SIZE}² float32 matmul (NumPy) {matmul_milliseconds():.1f} ms, median of {TRIES}, "
        f"{os.cpu_count()} cores")
  return 0


if __name__ == "__main__":
  sys.exit(main())
