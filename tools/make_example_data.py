"""Writes the small LibSVM file the package ships, `fedjax_opt/data/examples/two_class.svm`.

It is what `fo.data.example_path("libsvm")` returns, for trying
`fo.data.read_svmlight` and `fedjax-opt run --dataset libsvm:PATH` without a
file of one's own. The recipe, fixed by its seed:

* scikit-learn's `make_classification(n_samples=300, n_features=10,
  n_informative=5, n_redundant=2, n_classes=2, flip_y=0.03, class_sep=1.5,
  random_state=0)`: two classes of Gaussian clusters at the vertices of a
  hypercube, two features linear combinations of the informative ones, three
  of noise, 3 % of the labels flipped;
* each feature scaled linearly to [−1, 1] (its minimum to −1, its maximum to
  +1, as LibSVM's `svm-scale` does by default), rounded to 6 decimals;
* labels −1 / +1, written by `sklearn.datasets.dump_svmlight_file` with
  one-based indices (zeros are left out, as LibSVM does).

    python tools/make_example_data.py           # rewrites the file
    python tools/make_example_data.py --check   # exit 1 if the file does not hold the recipe's values

Needs scikit-learn (the `data` extra). `tests/test_example_data.py` checks
that the shipped file holds the recipe's values.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATH = ROOT / "fedjax_opt" / "data" / "examples" / "two_class.svm"
RECIPE = dict(n_samples=300, n_features=10, n_informative=5, n_redundant=2, n_classes=2, flip_y=0.03, class_sep=1.5,
              random_state=0)
"""`make_classification`'s arguments."""


def example_arrays() -> tuple[np.ndarray, np.ndarray]:
  """(x `[300, 10]` float64 in [−1, 1], rounded to 6 decimals; y `[300]` in {−1, +1}) by the recipe."""
  from sklearn.datasets import make_classification  # pylint: disable=import-outside-toplevel

  x, y = make_classification(**RECIPE)
  low, high = x.min(axis=0), x.max(axis=0)
  x = 2 * (x - low) / (high - low) - 1
  x = np.array([[float(f"{v:.6f}") for v in row] for row in x])  # the doubles nearest to 6-decimal numbers
  return x, 2 * y - 1


def write(path: pathlib.Path = PATH) -> None:
  from sklearn.datasets import dump_svmlight_file  # pylint: disable=import-outside-toplevel

  x, y = example_arrays()
  args = ", ".join(f"{k}={v}" for k, v in RECIPE.items())
  comment = (f"A two-class example for fedjax_opt (tools/make_example_data.py): make_classification({args}), "
             "each feature scaled to [-1, 1] and rounded to 6 decimals, labels -1/+1.")
  path.parent.mkdir(parents=True, exist_ok=True)
  dump_svmlight_file(x, y, str(path), zero_based=False, comment=comment)


def matches(path: pathlib.Path = PATH) -> bool:
  """Whether the file at `path` holds the recipe's values (as `fo.data.read_svmlight` reads them)."""
  from fedjax_opt import data  # pylint: disable=import-outside-toplevel

  x, y = example_arrays()
  read = data.read_svmlight(path, num_features=x.shape[1], labels="raw")
  return bool(np.array_equal(read["x"], x.astype(np.float32)) and np.array_equal(read["y"], y))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--check", action="store_true", help="compare the file with the recipe instead of writing it")
  args = parser.parse_args(argv)
  if args.check:
    ok = matches()
    print(f"{PATH}: {'holds' if ok else 'does not hold'} the recipe's values")
    return 0 if ok else 1
  write()
  print(f"wrote {PATH}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
