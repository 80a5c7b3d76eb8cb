"""The classical distributed baselines on the command line (DANE, FedDANE, FADL, GIANT, CoCoA+, one-shot averaging),
and `--dataset libsvm:PATH`: refusals in one line, F* against independent solves, runs against `fo.train`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import fedjax_opt as fo
from fedjax_opt.cli import config as config_lib
from fedjax_opt.cli import registry
from fedjax_opt.cli import run as run_lib

DISTRIBUTED = ("dane", "feddane", "fadl", "giant", "cocoa", "one_shot_average")


@pytest.fixture(scope="module")
def svm_file(tmp_path_factory):
  """scikit-learn's breast cancer data (569 × 30, two classes), features scaled to [−1, 1] as LibSVM's examples
  are, written by scikit-learn's own svmlight writer with labels −1/+1."""
  from sklearn.datasets import dump_svmlight_file, load_breast_cancer

  x, y = load_breast_cancer(return_X_y=True)
  x = 2 * (x - x.min(0)) / (x.max(0) - x.min(0)) - 1
  path = tmp_path_factory.mktemp("libsvm") / "cancer.svm"
  dump_svmlight_file(x, 2 * y - 1, str(path), zero_based=False)
  return path


def one_line(result, needle):
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr
  assert "Traceback" not in result.stderr


def test_refusals_are_one_line_and_create_nothing(cli, tmp_path, svm_file):
  out = tmp_path / "never"
  bad = tmp_path / "bad.svm"
  bad.write_text("1 1:0.5 2:0.25\n-1 1:0.5 2:x\n")
  empty = tmp_path / "empty.svm"
  empty.write_text("# nothing\n")
  cases = [
      (["--algorithms", "dane", "--model", "mlp"], "dane need(s) a convex model: use --model logreg (got mlp)"),
      (["--algorithms", "giant,fedavg", "--model", "cnn"], "giant need(s) a convex model"),
      (["--algorithms", "cocoa"], "cocoa: CoCoA+ solves a two-class problem (labels ±1, squared loss on a linear "
                                  "model) and this dataset has 10 classes: give a two-class LibSVM file"),
      (["--algorithms", "cocoa", "--dataset", f"libsvm:{svm_file}", "--set", "cocoa.loss=logistic"],
       "cocoa: loss must be one of ('squared', 'hinge'); got 'logistic'"),
      (["--algorithms", "cocoa", "--dataset", f"libsvm:{svm_file}", "--set", "cocoa.lam=1"],
       "cocoa has no hyper-parameter 'lam'; settable: gamma, l2,"),
      (["--algorithms", "dane", "--server-lr", "0.5"], "--server-lr does not apply to dane"),
      (["--algorithms", "giant", "--dataset", f"libsvm:{tmp_path / 'missing.svm'}"],
       f"--dataset libsvm:{tmp_path / 'missing.svm'}: {tmp_path / 'missing.svm'}: no such file"),
      (["--algorithms", "giant", "--dataset", f"libsvm:{tmp_path}"], "is a folder, not a file"),
      (["--algorithms", "giant", "--dataset", "libsvm:"], "--dataset libsvm:: give the file"),
      (["--algorithms", "giant", "--dataset", f"libsvm:{bad}"],
       f"--dataset libsvm:{bad}: {bad}: line 2: '2:x' is not index:value with an integer index."),
      (["--algorithms", "giant", "--dataset", f"libsvm:{empty}"], f"{empty}: holds no examples."),
      (["--algorithms", "giant", "--dataset", f"libsvm:{svm_file}", "--num-clients", "600"],
       "--num-clients 600 exceeds the 569 train examples of 'cancer.svm'"),
      (["--dataset", "cifar10"], "or libsvm:PATH for a LibSVM file"),
  ]
  for args, needle in cases:
    one_line(cli("run", *args, "--rounds", "2", "--out", str(out)), needle)
    assert not out.exists(), args


def test_list_shows_the_family_and_the_file_dataset(cli):
  listed = cli("list").stdout
  assert "algorithms, distributed family" in listed and "libsvm:PATH" in listed
  for name in DISTRIBUTED:
    assert f"\n  {name} " in listed
  assert "eta=1.0 mu=0.1 local_steps=3 cg_iters=None l2=0.001" in listed  # DANE's defaults
  assert "gamma=1.0 loss='squared' l2=0.001" in listed  # CoCoA+'s


def test_a_libsvm_file_is_split_as_asked(svm_file):
  config = config_lib.finish({"dataset": f"libsvm:{svm_file}", "algorithms": "dane", "partition": "iid",
                              "num_clients": 7,
                              "clients_per_round": 3})
  dataset = run_lib.load_dataset(config)
  assert dataset.num_clients == 7 and dataset.num_classes == 2 and dataset.name == "cancer.svm"
  assert dataset.num_train_examples + dataset.num_test_examples == 569
  default = config_lib.finish({"dataset": f"libsvm:{svm_file}", "algorithms": "giant"})
  assert (default["num_clients"], default["partition"], default["alpha"]) == (10, "dirichlet", 0.5)


def _numpy_problem(dataset):
  """Every real train example of `dataset` as float64 arrays (x [n, d], y [n] in {0, 1})."""
  batches = fo.data.client_batches(dataset, dataset.max_train, split="train")
  mask = np.asarray(batches.mask, bool)
  x = np.asarray(fo.core.types.materialize(batches.data)["x"], np.float64)[mask]
  return x.reshape(len(x), -1), np.asarray(batches.data["y"])[mask].astype(np.float64), batches


@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_objective_star_equals_independent_solves(svm_file):
  """F* of the table: the ridge-regularised softmax regression by scipy on NumPy's objective; CoCoA+'s squared loss
  by the normal equations; its hinge loss by liblinear (scikit-learn's LinearSVC, whose intercept is a regularised
  constant feature as in CoCoA+)."""
  from sklearn.svm import LinearSVC

  config = config_lib.finish({"dataset": f"libsvm:{svm_file}", "algorithms": "dane,cocoa", "num_clients": 5,
                              "clients_per_round": 3})
  dataset = run_lib.load_dataset(config)
  model = run_lib.build_model(config, dataset)
  x, y, batches = _numpy_problem(dataset)
  n, d = x.shape
  l2 = 1e-3
  a = np.hstack([x, np.ones((n, 1))])
  onehot = np.eye(2)[y.astype(int)]

  def softmax_objective(theta):
    w = theta.reshape(d + 1, 2)
    z = a @ w
    log_z = np.logaddexp(z[:, 0], z[:, 1])
    p = np.exp(z - log_z[:, None])
    value = np.mean(log_z - np.sum(onehot * z, 1)) + 0.5 * l2 * theta @ theta
    return value, (a.T @ (p - onehot) / n).ravel() + l2 * theta

  star = scipy.optimize.minimize(softmax_objective, np.zeros(2 * (d + 1)), jac=True, method="L-BFGS-B",
                                 options={"gtol": 1e-12, "ftol": 1e-16, "maxiter": 10000}).fun
  state = type("State", (), {"params": model.init(jax.random.key(0))})
  hyper = config_lib.hyper_parameters(config, "dane")
  gap = run_lib.objective_gap(registry.REGISTRY["dane"], hyper, model, state, dataset, 1)
  assert gap["objective_star"] == pytest.approx(star, rel=1e-7)
  assert gap["objective"] == pytest.approx(np.log(2), rel=1e-6)  # the zero model: log 2 per example

  t = 2 * y - 1
  w_ridge = np.linalg.solve(a.T @ a / n + l2 * np.eye(d + 1), a.T @ t / n)
  ridge_star = np.mean(0.5 * (a @ w_ridge - t) ** 2) + 0.5 * l2 * w_ridge @ w_ridge
  cocoa = registry.REGISTRY["cocoa"]
  squared = config_lib.hyper_parameters(config, "cocoa")
  scored = cocoa.scoring_model(model, squared, dataset)
  zero = type("State", (), {"params": scored.init(jax.random.key(0))})
  gap = run_lib.objective_gap(cocoa, squared, scored, zero, dataset, 1)
  assert gap["objective_star"] == pytest.approx(ridge_star, rel=1e-7)
  assert gap["objective"] == pytest.approx(0.5, rel=1e-6)  # ½(0 − t)²

  svm = LinearSVC(loss="hinge", C=1 / (l2 * n), intercept_scaling=1.0, tol=1e-10, max_iter=200000).fit(a[:, :-1], t)
  w_svm = np.append(svm.coef_.ravel(), svm.intercept_)
  svm_star = np.mean(np.maximum(0, 1 - t * (a @ w_svm))) + 0.5 * l2 * w_svm @ w_svm
  hinge = dict(squared, loss="hinge")
  assert registry.REGISTRY["cocoa"].reference(hinge, batches) == pytest.approx(svm_star, rel=1e-5)


def _train_in_python(algo, params, dataset, rounds, **sampling):
  state, history = fo.train(algo, algo.init(params, jax.random.key(1)), dataset, rounds, fo.Sampling(**sampling),
                            seed=0, progress=False)
  return state, history


@pytest.mark.slow  # six algorithms compiled and trained through the command line
def test_a_run_of_the_family_matches_the_same_run_built_in_python(cli, tmp_path, svm_file):
  out = tmp_path / "run"
  result = cli("run", "--algorithms", ",".join(DISTRIBUTED), "--dataset", f"libsvm:{svm_file}", "--num-clients",
               "6", "--clients-per-round", "3", "--local-steps", "2", "--batch-size", "16", "--rounds", "3",
               "--eval-every", "3", "--out", str(out), "--quiet")
  assert result.returncode == 0, result.stderr
  assert "obj. gap" in result.stdout
  for name in ("dane", "fadl", "giant", "cocoa", "one_shot_average"):
    assert f"{name}: every client, its whole train split, every round" in result.stdout
  rows = {r["algorithm"]: r for r in json.loads((out / "results.json").read_text())}
  history = json.loads((out / "history.json").read_text())
  assert list(rows) == list(DISTRIBUTED)
  for r in rows.values():
    assert r["status"] == "finished" and r["family"] == "distributed" and r["rounds"] == 3
    assert r["objective"] >= r["objective_star"] * (1 - 1e-6)
    assert r["objective_gap"] == pytest.approx((r["objective"] - r["objective_star"]) / abs(r["objective_star"]))
  assert "train_loss" not in rows["one_shot_average"] and "train_loss" not in rows["cocoa"]
  f_star = {rows[n]["objective_star"] for n in ("dane", "feddane", "fadl", "giant", "one_shot_average")}
  assert len(f_star) == 1  # one pooled objective, solved once
  assert rows["cocoa"]["objective_star"] != rows["dane"]["objective_star"]  # CoCoA+'s own (squared loss)

  config = config_lib.finish({"dataset": f"libsvm:{svm_file}", "algorithms": "dane", "num_clients": 6,
                              "clients_per_round": 3})
  dataset = run_lib.load_dataset(config)
  model = fo.models.logistic_regression(30, 2)
  _, _, batches = _numpy_problem(dataset)

  def ridge(loss):
    return lambda p, b: loss(p, b) + 5e-4 * sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(p))

  full = dict(clients_per_round=6, client_sampling="all", local_epochs=1, batch_size=dataset.max_train)
  dane = fo.algorithms.dane(ridge(model.loss_fn), 1.0, 0.1, num_clients=6, local_steps=3)
  state, ours = _train_in_python(dane, model.init(jax.random.key(0)), dataset, 3, **full)
  objective = fo.objectives.pooled(ridge(model.loss_fn))
  assert rows["dane"]["objective"] == pytest.approx(float(objective(state.params, batches)), rel=1e-6)
  np.testing.assert_allclose(history["dane"]["round_metrics"]["gradient_norm"],
                             np.asarray(ours.round_metrics["gradient_norm"]), rtol=1e-5)

  # CoCoA+ by hand: the ±1 labels and the linear model {"w": [d], "b": []} of the squared loss, λ = l2.
  cocoa = fo.algorithms.cocoa(1e-3, num_clients=6, num_examples=dataset.max_train)
  data = fo.core.types.materialize(batches.data)
  signed = batches.replace(data={"x": data["x"], "y": 2.0 * data["y"].astype(jnp.float32) - 1.0})
  state = cocoa.init({"w": jnp.zeros(30), "b": jnp.zeros(())}, jax.random.key(1))
  primal = []
  for _ in range(3):
    state = jax.jit(cocoa.step)(state, signed)
    primal.append(float(state.metrics["primal_objective"]))
  np.testing.assert_allclose(history["cocoa"]["round_metrics"]["primal_objective"], primal, rtol=1e-5)
  x, y, _ = _numpy_problem(dataset)
  w = np.append(np.asarray(state.params["w"], np.float64), float(state.params["b"]))
  a = np.hstack([x, np.ones((len(x), 1))])
  final = np.mean(0.5 * (a @ w - (2 * y - 1)) ** 2) + 0.5e-3 * w @ w
  assert rows["cocoa"]["objective"] == pytest.approx(final, rel=1e-5)
