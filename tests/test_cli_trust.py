"""`fedjax-opt run --compression` and `--secure-aggregation`: bad input exits 2 with one line and creates nothing;
a run is the run built in Python from the library's constructions (docs/privacy.md), metric for metric.

Every run here is in process (the `cli` fixture); the default tier has one short run, the others are slow.
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import optax
import pytest

import fedjax_opt as fo

SMALL = ["--dataset", "digits", "--num-clients", "20", "--clients-per-round", "5", "--local-steps", "3",
         "--batch-size", "16", "--quiet"]


@pytest.mark.parametrize("args,needle", [
    (["--compression", "qsgd:0"], "--compression qsgd:0: qsgd: bits must be a Python int >= 2; got 0"),
    (["--compression", "qsgd:4.5"], "qsgd takes qsgd:BITS, an integer number of bits"),
    (["--compression", "top_k:1.5"], "--compression top_k:1.5: top_k: fraction must lie in the open interval (0, 1)"),
    (["--compression", "rand_k:0"], "rand_k: fraction must lie in the open interval (0, 1); got 0.0"),
    (["--compression", "top_k"], "top_k takes top_k:FRACTION[:ef]"),
    (["--compression", "sign:foo"], "--compression sign:foo: sign takes sign[:ef]"),
    (["--compression", "gzip:3"], "unknown compressor 'gzip' in --compression gzip:3; give qsgd:BITS, top_k:"),
    (["--compression", "rand_k:0.1:ef"], "error feedback (:ef) needs a contraction (top_k, sign); rand_k is unbiased"),
    (["--algorithms", "fedavg,l2gd", "--compression", "sign"],
     "--compression sign needs algorithms whose factory takes aggregator=; l2gd takes none: L2GD's aggregation"),
    (["--algorithms", "gossip", "--topology", "ring", "--secure-aggregation"],
     "--secure-aggregation needs algorithms whose factory takes aggregator=; gossip takes none: gossip has no "
     "server"),
    (["--secure-aggregation", "bound=-1"], "secure_aggregation: bound must be a finite number > 0; got -1.0"),
    (["--secure-aggregation", "dropout=2"], "secure_aggregation: dropout must be in [0, 1]; got 2.0"),
    (["--secure-aggregation", "threshold=3"], "--secure-aggregation takes bound=B,frac_bits=F,dropout=Q"),
    (["--secure-aggregation", "frac_bits=x"], "--secure-aggregation frac_bits must be an integer; got 'x'"),
    # Refused by the library, after the dataset is split and before anything is written.
    (["--algorithms", "feddyn", "--compression", "top_k:0.1"],
     "feddyn with compression top_k:0.1: feddyn cannot compose with the aggregator's client stage"),
    (["--algorithms", "clustered_fl", "--compression", "sign"], "clustered_fl cannot compose with the aggregator's"),
    (["--algorithms", "scaffold", "--secure-aggregation"],
     "scaffold with secure aggregation: secure_aggregation hides each Δy_i, but c adds the Δc_i sent in the clear"),
    (["--aggregator", "krum", "--compression", "top_k:0.1", "--secure-aggregation"],
     "--secure-aggregation with krum: secure_aggregation: inner must be an Aggregator that is a sum over clients"),
    (["--aggregator", "mean", "--secure-aggregation", "bound=0.5"], "bound B = 0.5 would clip the scalar each client adds to the sum"),
    (["--secure-aggregation", "bound=8"], "bound=8 is below n_k = 72, the weight the weighted mean's largest client"),
    (["--secure-aggregation", "frac_bits=30"], "the ring Z_(2^32) cannot hold the sum of 5 contributions"),
    (["--dp-noise", "1", "--dp-clip", "0.5", "--secure-aggregation", "frac_bits=0"],
     "frac_bits = 0 cannot encode dp_mean's centred count bit"),
    (["--downlink", "gzip:3"], "unknown compressor 'gzip' in --downlink gzip:3; give qsgd:BITS, top_k:"),
    (["--downlink", "top_k:1.5"], "--downlink top_k:1.5: top_k: fraction must lie in the open interval (0, 1)"),
    (["--algorithms", "fedavg,scaffold", "--downlink", "top_k:0.1:ef"],
     "--downlink top_k:0.1:ef needs algorithms whose server compresses one broadcast model; scaffold takes no "
     "downlink: SCAFFOLD broadcasts the control variate c"),
    (["--algorithms", "gossip", "--topology", "ring", "--downlink", "sign"],
     "--downlink sign needs algorithms whose factory takes aggregator=; gossip takes none: gossip has no server"),
])
def test_bad_trust_flags_exit_2_with_one_line_and_create_nothing(cli, tmp_path, args, needle):
  out = tmp_path / "run"
  result = cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "2", "--out", out, *args)
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr
  assert not out.exists()


def test_the_default_rule_of_each_algorithm_is_its_factory_s_own():
  """`trust.default_rule` is the factory's declared `default_aggregator` (no copy kept in the CLI), and names
  what each factory's docstring does ("aggregator: ... default `aggregators.X()`")."""
  import inspect

  from fedjax_opt.cli import registry, trust

  seen = set()
  for name, spec in registry.REGISTRY.items():
    if not spec.takes_aggregator:  # the factory's declaration (factory.aggregation)
      continue
    doc = inspect.getdoc(spec.factory)
    found = re.search(r"\n\s*aggregator:.*?[Dd]efault\s+`aggregators\.(\w+)\(\)`", doc, flags=re.S)
    assert found, name
    assert trust.default_rule(name).traits.name == found.group(1), name
    assert spec.factory.default_aggregator().traits.name == found.group(1), name
    seen.add(found.group(1))
  assert seen == {"mean", "weighted_mean"}
  assert not hasattr(trust, "MEAN_BY_DEFAULT")


def _python_run(aggregator, rounds, *, sampling=None, accounting=None):
  """The CLI's fedavg run on SMALL, built in Python: its dataset, model, optimizers, initial state and sampling."""
  dataset = fo.data.load("digits", partition="dirichlet", alpha=0.5, num_clients=20, seed=0)
  model = fo.models.logistic_regression(64, 10)
  algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05),
                              server_optimizer=fo.server_optimizers.get("fedavg", learning_rate=1.0),
                              aggregator=aggregator)
  state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
  sampling = sampling or {"clients_per_round": 5}
  return fo.train(algo, state, dataset, rounds, fo.Sampling(local_steps=3, batch_size=16, **sampling),
                  evaluation=fo.Evaluation(every=rounds, metric_fns={"loss": model.loss_fn,
                                                                     "accuracy": model.accuracy_fn}),
                  seed=0, progress=False, accounting=accounting)


def _same_run(out, name, history):
  """The run folder's history and results are `history`'s, exactly."""
  saved = json.loads((out / "history.json").read_text())[name]
  assert saved["round_metrics"] == {k: np.asarray(v).tolist() for k, v in history.round_metrics.items()}
  assert [e["test_loss"] for e in saved["evals"]] == [e["test_loss"] for e in history.evals]
  (row,) = json.loads((out / "results.json").read_text())
  assert row["test_accuracy"] == history.last_eval["test_accuracy"]
  return row


def _table_cell(stdout, column, algorithm):
  header = next(line for line in stdout.splitlines() if line.startswith("algorithm"))
  names = re.split(r"\s{2,}", header.strip())
  cells = re.split(r"\s{2,}", next(line for line in stdout.splitlines() if line.startswith(algorithm + " ")).strip())
  return cells[names.index(column)]


@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_top_k_with_error_feedback_is_the_library_s_chain_and_the_table_shows_its_bits(cli, tmp_path):
  out = tmp_path / "run"
  result = cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "3", "--eval-every", "3",
               "--compression", "top_k:0.1:ef", "--out", out)
  assert result.returncode == 0, result.stderr
  stage = fo.compression.compress(fo.compression.top_k(0.1), error_feedback=True, num_clients=20)
  _, history = _python_run(fo.aggregators.chain(stage, fo.aggregators.weighted_mean()), 3)
  row = _same_run(out, "fedavg", history)
  # P = 650: k = ⌈65⌉ entries of 32 + ⌈log₂ 650⌉ = 42 bits; 5 clients up, one broadcast of 32 P down, 3 rounds.
  bits_up = np.asarray(history.round_metrics["bits_up"])
  assert bits_up.tolist() == [65 * 42] * 3
  assert row["bits_up"] == 65 * 42 and _table_cell(result.stdout, "bits up", "fedavg") == f"{65 * 42:,}"
  assert row["megabytes_sent"] == pytest.approx(3 * (5 * 65 * 42 + 32 * 650) / 8e6, rel=1e-12)
  assert row["hyper_parameters"]["compression"] == {"spec": "top_k:0.1:ef", "compressor": "top_k(0.1)",
                                                    "error_feedback": True}


@pytest.mark.slow  # a short run and its Python twin
def test_downlink_is_the_library_s_chained_downlink_and_counts_its_bits_down(cli, tmp_path):
  """`--downlink top_k:0.1:ef` is `fo.aggregators.chain(weighted_mean(), fo.compression.downlink(top_k(0.1)))`:
  the same history to the last digit, and MB sent counts each round's compressed broadcast once (the round's
  bits_down, the compressor's count: 10% of the 650 coordinates, 32 bits and a 10-bit index each)."""
  out = tmp_path / "run"
  result = cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "2", "--eval-every", "2",
               "--downlink", "top_k:0.1:ef", "--out", out)
  assert result.returncode == 0, result.stderr
  aggregator = fo.aggregators.chain(fo.aggregators.weighted_mean(),
                                    fo.compression.downlink(fo.compression.top_k(0.1), error_feedback=True))
  state, history = _python_run(aggregator, 2)
  row = _same_run(out, "fedavg", history)
  assert row["hyper_parameters"]["downlink"] == {"spec": "top_k:0.1:ef", "compressor": "top_k(0.1)",
                                                 "error_feedback": True}
  bits_down = 65 * (32 + 10)  # k = 65 of P = 650, each a float32 and a ⌈log2 650⌉-bit index
  assert np.asarray(history.round_metrics["bits_down"]).tolist() == [bits_down, bits_down]
  assert row["megabytes_sent"] == pytest.approx(2 * (5 * 32 * 650 + bits_down) / 8e6)


@pytest.mark.slow  # two more short runs
def test_secure_aggregation_is_the_library_s_wrapper_with_the_documented_bound(cli, tmp_path):
  out = tmp_path / "run"
  result = cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "2", "--eval-every", "2",
               "--secure-aggregation", "dropout=0.2", "--out", out)
  assert result.returncode == 0, result.stderr
  dataset = fo.data.load("digits", partition="dirichlet", alpha=0.5, num_clients=20, seed=0)
  bound = 4.0 * max(len(c["y"]) for c in fo.data.unpack(dataset, "train"))  # 4 × the largest n_k (docs/cli.md)
  secure = fo.privacy.secure_aggregation(fo.aggregators.weighted_mean(), bound=bound, frac_bits=16, dropout=0.2)
  state, history = _python_run(secure, 2)
  row = _same_run(out, "fedavg", history)
  assert row["hyper_parameters"]["secure_aggregation"] == {"inner": "weighted_mean", "bound": bound,
                                                           "frac_bits": 16, "dropout": 0.2}
  assert row["secure_upload_bits"] == float(state.aggregator_state.upload_bits)
  assert row["secure_frac_bits"] == int(state.aggregator_state.frac_bits) == 16  # no adaptive clip: the grid's f
  assert row["bits_up"] == 32 * 650  # the update itself: the protocol's extra words are secure_upload_bits


@pytest.mark.slow
def test_compression_with_dp_noise_is_the_chain_in_front_of_the_dp_mean(cli, tmp_path):
  out = tmp_path / "run"
  result = cli("run", *SMALL, "--algorithms", "fedavg", "--rounds", "2", "--eval-every", "2",
               "--compression", "sign:ef", "--dp-noise", "0.7", "--dp-clip", "0.5", "--out", out)
  assert result.returncode == 0, result.stderr
  plan = fo.privacy.Sampling.fixed(20, 5)
  stage = fo.compression.compress(fo.compression.sign(), error_feedback=True, num_clients=20)
  aggregator = fo.aggregators.chain(stage, fo.privacy.dp_mean(0.5, 0.7, expected_clients=plan.expected_clients))
  _, history = _python_run(aggregator, 2, sampling=plan.train_kwargs(),
                           accounting=fo.Accounting(0.7, 1e-5, "rdp", sampling=plan))
  row = _same_run(out, "fedavg", history)
  assert row["bits_up"] == 650 + 32 and row["dp_epsilon"] == history.eval_series("dp_epsilon")[1][-1]
