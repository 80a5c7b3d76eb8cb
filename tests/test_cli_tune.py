"""`fedjax-opt tune`: one-line refusals, and a small tuning whose files are checked against independent references.

Everything runs in this process (`cli.main(argv)`); the refusals in the default tier, the tuning (about 9 s of
compilation) in the slow one. The end-to-end tuning is FedAdam on digits with logistic regression, 2 outer steps of
2 rounds averaging the last 2 values: its tune.json must start at the registry's defaults, each outer step must be
the Adam step that NumPy computes from the recorded gradients, the tuned values their geometric mean, its first gradient must equal `fo.hyper.value_and_grad`
built here from the factories, and the run trained afterwards must have used the tuned values (its config.json, and
its test loss equal to the validation loss the tuning computed at them).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest

DIGITS = ["--dataset", "digits", "--num-clients", "20", "--clients-per-round", "5", "--local-steps", "5",
          "--batch-size", "16", "--seed", "3"]
FEDADAM = ["tune", "--algorithms", "fedadam", "--tune", "server_lr"]


@pytest.mark.parametrize("args,needle", [
    (["tune", "--algorithms", "fedavg,fedadam", "--tune", "server_lr"],
     "fedjax-opt tune tunes one algorithm; got --algorithms fedavg,fedadam"),
    (["tune", "--tune", "server_lr"], "fedjax-opt tune needs --algorithms NAME"),
    (["tune", "--algorithms", "fedadam"], "the following arguments are required: --tune"),
    (["tune", "--algorithms", "fedadam", "--tune", "server_lrr"],
     "fedadam has no hyper-parameter 'server_lrr'; tunable (continuous): client_lr, server_lr"),
    (["tune", "--algorithms", "fedadam", "--tune", "server_optimizer"],
     "fedadam.server_optimizer is not continuous (its value is 'fedadam'); tunable (continuous): client_lr, server_lr"),
    (["tune", "--algorithms", "ditto", "--tune", "lam,personal_steps"],
     "ditto.personal_steps is not continuous (its value is 5); tunable (continuous): lam, eta, client_lr, server_lr"),
    (["tune", "--algorithms", "fedadam", "--tune", "server_lr,server_lr"], "--tune lists server_lr twice"),
    (["tune", "--algorithms", "fednova", "--tune", "rho"],
     "fednova.rho starts at 0, and tuning moves its logit: give a start in (0, 1) with --set fednova.rho=VALUE"),
    (["tune", "--algorithms", "p2p_bayes", "--topology", "ring", "--tune", "spread"],
     "p2p_bayes has no continuous hyper-parameter that its rounds use: nothing to tune"),
    ([*FEDADAM, "--outer-steps", "0"], "--outer-steps must be a positive integer; got '0'"),
    ([*FEDADAM, "--outer-steps", "2.5"], "--outer-steps must be a positive integer; got '2.5'"),
    ([*FEDADAM, "--outer-lr", "-0.1"], "--outer-lr must be a positive number; got '-0.1'"),
    ([*FEDADAM, "--schedule", "nightly"], "argument --schedule: invalid choice: 'nightly'"),
    ([*FEDADAM, "--average", "0"], "--average must be a positive integer; got '0'"),
    ([*FEDADAM, "--outer-steps", "3", "--average", "5"],
     "--average 5 exceeds the 4 values a tuning of --outer-steps 3 goes through (the start and one after each step)"),
    ([*FEDADAM, "--resume"], "unrecognized arguments: --resume"),
    ([*FEDADAM, "--dp-noise", "1.0"], "unrecognized arguments: --dp-noise"),
])
def test_bad_input_exits_2_with_one_line_and_creates_nothing(cli, tmp_path, args, needle):
  out = tmp_path / "never"
  result = cli(*args, "--out", out)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr
  assert not out.exists()


def test_an_algorithm_whose_step_fo_hyper_refuses_is_one_line_before_anything_trains(cli, tmp_path):
  out = tmp_path / "never"
  result = cli("tune", "--algorithms", "ifca", "--tune", "client_lr", *DIGITS, "--rounds", "2", "--outer-steps", "2",
               "--out", out)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("fedjax-opt: error: ifca: cannot tune client_lr: not differentiable: ")
  assert "lowest-loss cluster" in lines[0] and "fo.hyper refuses" in lines[0]
  assert "outer step" not in result.stdout
  assert not out.exists()


OUTER_LR = 0.2


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
  """`fedjax-opt tune` offline on digits (2 outer steps of 2 rounds), then its run of 2 rounds: (stdout, folder)."""
  from fedjax_opt import cli as cli_lib
  from fedjax_opt.cli import run as run_lib

  out = tmp_path_factory.mktemp("tune") / "run"
  stdout = io.StringIO()
  with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
    patch.setattr(run_lib, "enable_compile_cache", lambda setting: None)  # as the `cli` fixture: no process-wide
    patch.setattr(run_lib, "use_cpu_devices", lambda devices: None)       # settings from an in-process call
    code = cli_lib.main(["tune", "--algorithms", "fedadam", "--tune", "server_lr,client_lr", *DIGITS, "--rounds", "2",
                         "--outer-steps", "2", "--schedule", "offline", "--outer-lr", str(OUTER_LR), "--average", "2",
                         "--out", str(out)])
  assert code == 0, stdout.getvalue()
  return stdout.getvalue(), out


def _adam_steps(grads, lr, b1=0.9, b2=0.999, eps=1e-8):
  """optax.adam's updates written out in float64 NumPy: u_{t+1} − u_t for each recorded gradient."""
  m = v = 0.0
  steps = []
  for t, g in enumerate(grads, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    steps.append(-lr * (m / (1 - b1**t)) / (math.sqrt(v / (1 - b2**t)) + eps))
  return np.asarray(steps)


@pytest.mark.slow  # the tuning and its run compile for about 9 s
def test_tune_writes_the_trajectory_the_optimizer_took_and_trains_with_its_result(tuned):
  from fedjax_opt.cli import registry

  stdout, out = tuned
  record = json.loads((out / "tune.json").read_text())
  defaults = registry.resolve("fedadam", {}, None)
  assert record["tuned"] == ["server_lr", "client_lr"] and record["schedule"] == "offline" and record["average"] == 2
  for name in ("server_lr", "client_lr"):
    h = np.asarray(record["hyper_parameters"][name], np.float64)
    grads = np.asarray(record["gradient"][name], np.float64)
    assert h.shape == (3,) and grads.shape == (2,)
    np.testing.assert_allclose(h[0], defaults[name], rtol=1e-6)  # the registry's default, in float32
    assert np.all(np.abs(grads) > 1e-6), grads  # a real step, not zero
    # Each outer step is Adam's step on u = log h from the recorded gradients (float32 rounding of h: 1e-7).
    np.testing.assert_allclose(np.diff(np.log(h)), _adam_steps(grads, OUTER_LR), rtol=1e-4, atol=1e-6)
    # --average 2: the geometric mean of the last two values (as float32), not the last one.
    assert record["tuned_values"][name] == pytest.approx(np.exp(np.log(h[-2:]).mean()), rel=1e-6)
    assert record["tuned_values"][name] != pytest.approx(h[-1], rel=1e-4)
    assert "outer step 2/2: " in stdout and f"{name}={h[1]:.4g}" in stdout
  assert len(record["validation_loss"]) == 2 and all(math.isfinite(v) for v in record["validation_loss"])
  lines = stdout.splitlines()  # the compilation is announced before the outer steps' lines (they arrive together)
  compiling = lines.index("[fedadam] compiling the tuning program (all 2 outer steps are one program: their lines "
                          "follow as it runs)")
  assert compiling < min(i for i, line in enumerate(lines) if line.startswith("[fedadam] outer step "))
  assert (out / "tune.png").stat().st_size > 0
  # The run afterwards is `fedjax-opt run --set fedadam.server_lr=… --set fedadam.client_lr=… --rounds 2`.
  config = json.loads((out / "config.json").read_text())
  assert config["hyper"] == {"fedadam": record["tuned_values"]} and config["rounds"] == 2
  (result,) = json.loads((out / "results.json").read_text())
  assert {k: result["hyper_parameters"][k] for k in ("server_lr", "client_lr")} == record["tuned_values"]
  assert result["rounds"] == 2 and result["status"] == "finished"
  # It draws the rounds the tuning drew: its test loss after 2 rounds is the tuning's validation loss at the tuned
  # values (two programs, float32: 1e-5).
  np.testing.assert_allclose(result["test_loss"], record["validation_loss_at_tuned"], rtol=1e-5)
  assert (out / "history.json").exists() and (out / "loss.png").exists()


@pytest.mark.slow  # needs the tuning above
def test_the_first_gradient_is_fo_hyper_value_and_grad_of_the_same_setting(tuned):
  """The same FedAdam, dataset, sampling, model and keys built here from the factories, as docs/cli.md states them."""
  import jax
  import jax.numpy as jnp
  import optax

  import fedjax_opt as fo

  _, out = tuned
  record = json.loads((out / "tune.json").read_text())
  seed = 3
  dataset = fo.data.load("digits", partition="dirichlet", alpha=0.5, num_clients=20, seed=seed)
  model = fo.models.logistic_regression(64, 10)

  def make(h):
    return fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(h["client_lr"]),
                                server_optimizer=fo.server_optimizers.fedadam(h["server_lr"]))

  grad_fn = fo.hyper.value_and_grad(make, fo.hyper.validation_loss(model.loss_fn), rounds=2,
                                    sampling=fo.Sampling(clients_per_round=5, local_steps=5, batch_size=16))
  validation = fo.data.client_batches(dataset, dataset.max_test, split="test")
  u = fo.hyper.unconstrain({"server_lr": 0.003, "client_lr": 0.05})
  value, grad = grad_fn(u, model.init(jax.random.key(seed)), jnp.stack([jax.random.key(seed + 1),
                                                                       jax.random.key(seed)]), dataset, validation)
  np.testing.assert_allclose(record["validation_loss"][0], float(value), rtol=1e-6)
  for name in ("server_lr", "client_lr"):
    np.testing.assert_allclose(record["gradient"][name][0], float(grad[name]), rtol=1e-4, err_msg=name)


def test_a_folder_that_holds_a_tuning_is_refused_by_tune_and_run(cli, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "tune.json").write_text("{}")
  for command, resume in ((["tune", "--algorithms", "fedadam", "--tune", "server_lr"], f"fedjax-opt run --out {out} "),
                          (["run"], "")):  # tune has no --resume of its own
    result = cli(*command, *DIGITS, "--out", out)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"fedjax-opt: error: --out {out} already holds a run; continue it with {resume}--resume, replace it with "
        f"--overwrite, or choose another folder"]
    assert sorted(p.name for p in out.iterdir()) == ["tune.json"]
