"""tools/doc_images.py: every image the documents show has a recipe that regenerates it from the code that draws it."""

import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("doc_images", ROOT / "tools" / "doc_images.py")
doc_images = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = doc_images  # its dataclass looks its module up there
_spec.loader.exec_module(doc_images)


def _shown() -> set[str]:
  """The names (without .png) of the docs/img/ images that README.md and docs/*.md show or link."""
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  text += "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
  return set(re.findall(r"\(\s*(?:docs/)?img/([\w.-]+)\.png", text))


def test_every_image_of_docs_img_has_a_recipe_and_every_recipe_an_image():
  on_disk = {p.stem for p in (ROOT / "docs" / "img").glob("*.png")}
  assert on_disk == set(doc_images.IMAGES), (on_disk ^ set(doc_images.IMAGES))
  assert _shown() <= on_disk, _shown() - on_disk  # nothing shown without its file
  for name, recipe in doc_images.IMAGES.items():
    script = recipe.command.split()[1]
    assert (ROOT / script).is_file(), (name, recipe.command)
    assert (ROOT / recipe.drawn_by.split()[0]).is_file(), (name, recipe.drawn_by)
  assert set(doc_images.QUICK) == {"main_job_accuracy", "robustness_mnist5k_iid_fedavg"}


def test_the_robustness_figure_is_redrawn_from_the_committed_json(tmp_path):
  """Seconds: benchmarks/robustness.py's plot_task on benchmarks/results/robustness.json, the size of the image the
  documents show."""
  from PIL import Image

  path = doc_images.make("robustness_mnist5k_iid_fedavg", tmp_path)
  assert path == tmp_path / "robustness_mnist5k_iid_fedavg.png"
  with Image.open(path) as drawn, Image.open(ROOT / "docs" / "img" / path.name) as shown:
    assert drawn.size == shown.size


def test_unknown_names_are_refused(capsys):
  with pytest.raises(SystemExit):
    doc_images.main(["no_such_image"])
  assert "unknown image(s) ['no_such_image']" in capsys.readouterr().err


@pytest.mark.slow  # a `fedjax-opt run` subprocess (FedAvg and FedAdam on MNIST 5k, compiled)
def test_the_main_job_figure_is_redrawn_by_a_short_run_of_the_command(tmp_path):
  """The README's main job, 2 rounds instead of 300: `fedjax-opt run`'s accuracy.png lands in --img-dir."""
  from PIL import Image

  assert doc_images.main(["main_job_accuracy", "--rounds", "2", "--img-dir", str(tmp_path)]) == 0
  with Image.open(tmp_path / "main_job_accuracy.png") as drawn:
    width, height = drawn.size
  assert width > height > 300


def test_the_main_job_image_is_current_with_the_drawing_code_and_the_readme_table():
  """The image was drawn by today's fedjax_opt/cli/report.py (its hash is the one recorded when the image was
  made; a change to the drawing code fails here until `python tools/doc_images.py main_job_accuracy` runs again)
  from the run whose rows the README's main-job table prints, digit for digit."""
  import json

  record = json.loads(doc_images.MAIN_JOB_RECORD.read_text(encoding="utf-8"))
  assert record["drawing_code_sha256"] == doc_images.drawing_code_hash(), (
      "fedjax_opt/cli/report.py changed since docs/img/main_job_accuracy.png was drawn: run "
      "`python tools/doc_images.py main_job_accuracy`")
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  table = readme.split("algorithm  rounds  test acc", 1)[1].split("```", 1)[0]
  printed = {line.split()[0]: line.split() for line in table.splitlines()[2:] if line.strip()}
  assert set(printed) == {row["algorithm"] for row in record["rows"]}
  for row in record["rows"]:
    name, rounds, accuracy, loss, train_loss, sent = printed[row["algorithm"]][:6]
    assert (int(rounds), accuracy, loss, train_loss, sent) == (
        row["rounds"], f"{row['test_accuracy']:.4f}", f"{row['test_loss']:.4f}", f"{row['train_loss']:.4f}",
        f"{row['megabytes_sent']:,.1f}"), (name, printed[name])
    assert printed[name][-1] == row["status"] == "finished"


def test_the_drawing_code_hash_sees_a_change(tmp_path, monkeypatch):
  copy = tmp_path / "report.py"
  copy.write_bytes(doc_images.DRAWING_CODE.read_bytes())
  monkeypatch.setattr(doc_images, "DRAWING_CODE", copy)
  before = doc_images.drawing_code_hash()
  copy.write_text(copy.read_text(encoding="utf-8").replace("fontsize=7", "fontsize=8", 1), encoding="utf-8")
  assert doc_images.drawing_code_hash() != before
