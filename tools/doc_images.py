"""Regenerates the images that README.md and docs/*.md show, from the code that makes them.

Every image in docs/img/ has a recipe here (`IMAGES`): the code that draws it
and the command that runs that code. Two are drawn by this script:

* `main_job_accuracy.png`, the README's main job: `fedjax-opt run` at its
  defaults (FedAvg and FedAdam on MNIST 5k, 300 rounds; about a minute on
  two CPU cores), whose `accuracy.png` (drawn by
  `fedjax_opt/cli/report.py`) is copied here;
* `robustness_mnist5k_iid_fedavg.png` (docs/algorithms.md): drawn by
  `benchmarks/robustness.py`'s `plot_task` from the results already in
  `benchmarks/results/robustness.json` (seconds; the benchmark itself runs
  for about 50 minutes and writes the image into benchmarks/results/, which
  is not committed).

The others are written into docs/img/ by their benchmark, which also rewrites
its JSON in benchmarks/results/; this script runs that command when asked
for one of them by name.

    python tools/doc_images.py --list                  # every image, what draws it, the command
    python tools/doc_images.py main_job_accuracy       # one image (several names: several images)
    python tools/doc_images.py --quick                 # the two this script draws itself
    python tools/doc_images.py main_job_accuracy --rounds 2 --img-dir /tmp/img   # a smoke test

`--img-dir` and `--rounds` apply to the images this script draws itself
(`--rounds` to the main job's run only). `tests/test_doc_images.py` checks
that every image of docs/img/ has a recipe and that the quick ones run, and
that the main job's image is current: the full run records its rows and the
hash of the drawing code (`fedjax_opt/cli/report.py`) in
`benchmarks/results/main_job.json`, and the test compares that hash with
today's file and the rows with the README's table (a change to the drawing
code means running `python tools/doc_images.py main_job_accuracy`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How one image of docs/img/ is made.

  Attributes:
    drawn_by: the code that draws it.
    command: the command that regenerates it, run from the repository root.
    duration: about how long the command takes on two CPU cores.
    draw: `draw(img_dir, rounds)` for the images this script draws itself; None for a benchmark's own image
      (the command is run as it is).
  """

  drawn_by: str
  command: str
  duration: str
  draw: Callable[[pathlib.Path, int | None], pathlib.Path] | None = None


DRAWING_CODE = ROOT / "fedjax_opt" / "cli" / "report.py"
"""The module that draws the run's figures: the main job's image is current while its hash is the recorded one."""

MAIN_JOB_RECORD = ROOT / "benchmarks" / "results" / "main_job.json"
"""What the main job's image was drawn from: the run's rows (the README's table) and `DRAWING_CODE`'s hash."""

MAIN_JOB_KEYS = ("algorithm", "rounds", "test_accuracy", "test_loss", "train_loss", "megabytes_sent", "status",
                 "compile_seconds", "wall_seconds")


def drawing_code_hash() -> str:
  """sha256 of `DRAWING_CODE`'s text."""
  return hashlib.sha256(DRAWING_CODE.read_bytes()).hexdigest()


def _main_job(img_dir: pathlib.Path, rounds: int | None) -> pathlib.Path:
  """`fedjax-opt run` at its defaults (README's main job) in a subprocess; its accuracy.png, copied. The full run
  (not a smoke test's `--rounds`) into docs/img/ also writes `MAIN_JOB_RECORD`."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "run"
    command = [sys.executable, "-m", "fedjax_opt.cli", "run", "--out", str(out), "--quiet"]
    if rounds is not None:
      command += ["--rounds", str(rounds), "--eval-every", str(max(1, rounds // 2))]
    subprocess.run(command, cwd=ROOT, check=True)
    target = img_dir / "main_job_accuracy.png"
    shutil.copyfile(out / "accuracy.png", target)
    if rounds is None and img_dir.resolve() == IMG.resolve():
      rows = json.loads((out / "results.json").read_text(encoding="utf-8"))
      record = {"command": "fedjax-opt run", "regenerated_by": IMAGES["main_job_accuracy"].command,
                "drawing_code": str(DRAWING_CODE.relative_to(ROOT)), "drawing_code_sha256": drawing_code_hash(),
                "rows": [{k: row[k] for k in MAIN_JOB_KEYS if k in row} for row in rows]}
      MAIN_JOB_RECORD.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
  return target


def _load_benchmark(name: str):
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _robustness(task: str, algorithm: str) -> Callable[[pathlib.Path, int | None], pathlib.Path]:
  """benchmarks/robustness.py's figure of one task and algorithm, re-drawn from its committed JSON."""

  def draw(img_dir: pathlib.Path, rounds: int | None) -> pathlib.Path:
    del rounds  # the JSON's runs
    robustness = _load_benchmark("robustness")
    with open(ROOT / "benchmarks" / "results" / "robustness.json", encoding="utf-8") as f:
      results = json.load(f)["accuracy"]
    cells = results[task][algorithm]
    rules = [r for r in robustness.RULE_NAMES if r in cells]
    attacks = [a for a in robustness.ATTACKS if all(a in cells[r] for r in rules)]  # as the benchmark's main
    target = img_dir / f"robustness_{task}_{algorithm}.png"
    robustness.plot_task(results, task, algorithm, rules, attacks, str(target))
    return target

  return draw


IMAGES: dict[str, Recipe] = {
    "main_job_accuracy": Recipe("fedjax_opt/cli/report.py (figures: accuracy.png) of `fedjax-opt run`",
                                "python tools/doc_images.py main_job_accuracy", "about 1 minute", _main_job),
    "robustness_mnist5k_iid_fedavg": Recipe(
        "benchmarks/robustness.py (plot_task), from benchmarks/results/robustness.json",
        "python tools/doc_images.py robustness_mnist5k_iid_fedavg", "seconds", _robustness("mnist5k_iid", "fedavg")),
    "asynchrony": Recipe("benchmarks/asynchrony.py", "python benchmarks/asynchrony.py", "about 3 minutes"),
    "clustered": Recipe("benchmarks/clustered.py", "python benchmarks/clustered.py", "an hour or more"),
    "clustered_fedma": Recipe("benchmarks/clustered.py (part b)", "python benchmarks/clustered.py", "an hour or more"),
    "decentralized": Recipe("benchmarks/decentralized.py", "python benchmarks/decentralized.py", "about 6 minutes"),
    "decentralized_graphs": Recipe("benchmarks/decentralized.py", "python benchmarks/decentralized.py",
                                   "about 6 minutes"),
    "privacy_compression": Recipe("benchmarks/privacy_compression.py", "python benchmarks/privacy_compression.py",
                                  "about 10 minutes"),
    "hypergrad_tuning": Recipe("benchmarks/hypergrad.py (--part tuning)",
                               "python benchmarks/hypergrad.py --part tuning", "about 2 hours"),
}
"""Every image of docs/img/ (by its name without `.png`) and how it is made."""

QUICK = tuple(name for name, recipe in IMAGES.items() if recipe.draw is not None)
"""The images this script draws itself (`--quick`)."""


def make(name: str, img_dir: pathlib.Path = IMG, rounds: int | None = None) -> pathlib.Path | None:
  """Regenerates image `name`; returns its path (None for a benchmark's image, which goes where the benchmark
  writes it: docs/img/)."""
  recipe = IMAGES[name]
  if recipe.draw is not None:
    img_dir.mkdir(parents=True, exist_ok=True)
    return recipe.draw(img_dir, rounds)
  subprocess.run(recipe.command.split(), cwd=ROOT, check=True)
  return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("names", nargs="*", help="images to regenerate (names in docs/img/ without .png)")
  parser.add_argument("--list", action="store_true", help="list every image, what draws it and its command")
  parser.add_argument("--quick", action="store_true", help="the images this script draws itself: " + ", ".join(QUICK))
  parser.add_argument("--img-dir", type=pathlib.Path, default=IMG, help="where this script's own images go")
  parser.add_argument("--rounds", type=int, default=None, help="the main job's rounds (a smoke test; default: 300)")
  args = parser.parse_args(argv)
  if args.list:
    for name, recipe in IMAGES.items():
      print(f"{name}.png: {recipe.drawn_by}\n    {recipe.command}    # {recipe.duration}")
    return 0
  names = list(args.names) + (list(QUICK) if args.quick else [])
  unknown = [n for n in names if n not in IMAGES]
  if unknown or not names:
    parser.error(f"unknown image(s) {unknown}; choose from {', '.join(IMAGES)}" if unknown else
                 "name an image, or give --quick or --list")
  for name in dict.fromkeys(names):
    path = make(name, args.img_dir, args.rounds)
    print(f"{name}: wrote {path}" if path is not None else f"{name}: {IMAGES[name].command} wrote docs/img/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
