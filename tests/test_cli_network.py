"""The command line's decentralized (`--topology`) and asynchronous (`--async`, `--delay`) runs, and the
synchronous clock they are compared on (`core.asynchrony.synchronous_clock`)."""

import json
import math
import pathlib

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy.special import logsumexp

import fedjax_opt as fo
from fedjax_opt.cli import config as config_lib
from fedjax_opt.cli import network
from fedjax_opt.core import asynchrony as asy
from tests.test_cli import run_cli
from tests.test_cli_runs import SMALL, without_timings


# ---- the synchronous clock -------------------------------------------------------------------------------------


@flax.struct.dataclass
class _Counter:
  params: jax.Array
  round: jax.Array
  key: jax.Array
  metrics: dict


_COUNTER = fo.FederatedAlgorithm(
    init=lambda params, key: _Counter(params, jnp.zeros((), jnp.int32), key, {"seen": jnp.zeros(())}),
    step=lambda s, b: s.replace(params=s.params + 1, round=s.round + 1, metrics={"seen": jnp.sum(b.weight)}))


def _batches(ids, weights):
  c = len(ids)
  return fo.ClientBatches(data={"x": jnp.zeros((c, 1, 1))}, mask=jnp.ones((c, 1, 1), bool),
                          weight=jnp.asarray(weights, jnp.float32), client_id=jnp.asarray(ids, jnp.int32))


def test_synchronous_clock_waits_for_the_slowest_client_that_takes_part():
  """Constant compute time c and speeds s_i: a round lasts c · max s_i over its clients with weight > 0."""
  speed = np.array([1.0, 3.0, 2.0, 5.0, 0.5])
  algo = asy.synchronous_clock(_COUNTER, asy.constant(2.0), speed=speed, latency=asy.constant(0.25))
  state = algo.init(jnp.zeros(()), jax.random.key(0))
  assert float(state.metrics["simulated_time"]) == 0.0
  rounds = [([0, 2, 4], [1, 1, 1]), ([3, 1, 0], [0, 4, 1]), ([4, 3, 2], [0, 0, 0])]
  expected_time = 0.0
  for ids, weights in rounds:
    state = jax.jit(algo.step)(state, _batches(ids, weights))
    taking_part = [i for i, w in zip(ids, weights) if w > 0]
    duration = 2.0 * max(speed[taking_part]) + 0.25 if taking_part else 0.0  # client 3 (speed 5) has weight 0
    expected_time += duration
    assert float(state.metrics["round_duration"]) == pytest.approx(duration, rel=1e-6)
    assert float(state.metrics["simulated_time"]) == pytest.approx(expected_time, rel=1e-6)
  assert float(state.params) == 3.0 and "seen" in state.metrics  # the wrapped algorithm's own state and metrics


def test_synchronous_clock_round_time_is_the_expected_maximum_of_exponential_draws():
  """E[max of C iid Exp(mean μ)] = μ H_C (H_C the harmonic number), Var = μ² Σ_{k≤C} 1/k²."""
  mean, c, rounds = 2.0, 5, 4000
  algo = asy.synchronous_clock(_COUNTER, asy.exponential(mean), seed=7)
  batches = _batches(list(range(c)), [1.0] * c)
  state = algo.init(jnp.zeros(()), jax.random.key(0))
  _, durations = jax.lax.scan(lambda s, _: (lambda n: (n, n.metrics["round_duration"]))(algo.step(s, batches)),
                              state, None, length=rounds)
  harmonic = sum(1 / k for k in range(1, c + 1))
  sd = mean * math.sqrt(sum(1 / k ** 2 for k in range(1, c + 1)))
  assert abs(float(np.mean(durations)) - mean * harmonic) < 4 * sd / math.sqrt(rounds)
  assert len(np.unique(np.asarray(durations))) > rounds * 0.99  # fresh draws every round


@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_synchronous_clock_leaves_the_training_bit_for_bit_unchanged():
  ds = fo.data.load("digits", num_clients=6, seed=0)
  model = fo.models.logistic_regression(64, 10)
  plain = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.1))
  timed = asy.synchronous_clock(plain, asy.lognormal(0.0, 1.0))
  params = model.init(jax.random.key(0))
  a, b = plain.init(params, jax.random.key(1)), timed.init(params, jax.random.key(1))
  for r in range(3):
    batches = fo.data.sample_round(jax.random.key(r), ds, clients_per_round=3, local_steps=2, batch_size=5)
    a, b = jax.jit(plain.step)(a, batches), jax.jit(timed.step)(b, batches)
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
  assert float(b.metrics["simulated_time"]) > 0


def test_synchronous_clock_checks_its_arguments():
  with pytest.raises(TypeError, match="compute_time must be a distribution"):
    asy.synchronous_clock(_COUNTER, 2.0)
  with pytest.raises(TypeError, match="seed must be a Python int"):
    asy.synchronous_clock(_COUNTER, seed=1.5)
  with pytest.raises(ValueError, match="speed must be a \\[num_clients\\] array"):
    asy.synchronous_clock(_COUNTER, speed=np.ones((2, 2)))


# ---- flags -----------------------------------------------------------------------------------------------------


def _finish(**given):
  return config_lib.finish(dict({"dataset": "digits"}, **given))


@pytest.mark.parametrize("given,needle", [
    ({"algorithms": "fedavg", "topology": "ring"}, "--topology applies to the decentralized algorithms"),
    ({"algorithms": "dpsgd", "topology": "hypercube"}, "unknown topology 'hypercube'; choose from ring, torus"),
    ({"algorithms": "fedavg,fedbuff"}, "fedbuff is asynchronous: add --async"),
    ({"algorithms": "fedavg", "delay": "exp:2"}, "--delay is the clients' compute time on the simulated clock"),
    ({"asynchronous": True, "delay": "weibull:2"}, "--delay must be one of exp:MEAN, const:VALUE, lognormal:MU,SIGMA"),
    ({"asynchronous": True, "delay": "exp:-1"}, "a mean must be > 0"),
    ({"asynchronous": True, "delay": "lognormal:0"}, "--delay must be one of"),
    ({"asynchronous": True, "delay": "exp:two"}, "--delay must be one of"),
    ({"algorithms": "fedbuff", "asynchronous": True, "aggregator": "krum"}, "fedbuff"),
])
def test_bad_network_flags_are_one_line(given, needle):
  with pytest.raises(config_lib.UsageError, match=needle.replace("(", "\\(").replace("[", "\\[")) as e:
    _finish(**given)
  assert "\n" not in str(e.value)


def test_graph_is_an_alias_of_topology():
  """`--graph` (the factories' `graph=`) is `--topology` (docs/cli.md): the same configuration key, one flag listed."""
  from fedjax_opt.cli import flag_reference

  parse = lambda *argv: config_lib.given_settings(config_lib.build_parser().parse_args(["run", *argv]))
  assert parse("--graph", "torus")["topology"] == parse("--topology", "torus")["topology"] == "torus"
  assert "graph" not in parse("--graph", "torus")
  assert "`--topology NAME`" in flag_reference() and "--graph" not in flag_reference()
  docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
  assert "`--graph NAME` is the same flag under the library's name" in docs


def test_flag_defaults_ring_exp1_and_the_async_comparison():
  assert _finish(algorithms="dpsgd")["topology"] == "ring"
  assert _finish(algorithms="fedavg")["topology"] is None
  config = _finish(asynchronous=True)
  assert config["algorithms"] == "fedavg,fedbuff,fedasync" and config["delay"] == "exp:1"
  assert _finish(asynchronous=True, algorithms="co_op")["algorithms"] == "co_op"


def test_the_toml_key_async_is_read(tmp_path):
  path = tmp_path / "run.toml"
  path.write_text('algorithms = ["fedasync"]\nasync = true\ndelay = "const:1"\n')
  given = config_lib.given_settings(config_lib.build_parser().parse_args(["run", "--config", str(path)]))
  config = config_lib.finish(dict(given, dataset="digits"))
  assert config["asynchronous"] is True and config["delay"] == "const:1"


@pytest.mark.parametrize("topology,n,weight", [("ring", 12, 1 / 3), ("torus", 16, 1 / 5), ("complete", 7, 1 / 7)])
def test_topologies_are_metropolis_hastings_matrices_of_their_graph(topology, n, weight):
  """Regular graphs of degree d: W_ij = 1/(d + 1) on edges and the diagonal, 0 elsewhere."""
  w = fo.graphs.mixing_matrix(network.graph(topology, n, seed=0))
  expected = np.zeros((n, n))
  for i in range(n):
    if topology == "ring":
      neighbours = {(i - 1) % n, (i + 1) % n}
    elif topology == "torus":  # 4 × 4
      r, c = divmod(i, 4)
      neighbours = {((r + 1) % 4) * 4 + c, ((r - 1) % 4) * 4 + c, r * 4 + (c + 1) % 4, r * 4 + (c - 1) % 4}
    else:
      neighbours = set(range(n)) - {i}
    for j in neighbours | {i}:
      expected[i, j] = weight
  np.testing.assert_allclose(w, expected, atol=1e-12)


def test_time_varying_and_random_topologies_are_valid_mixing_matrices():
  seq = np.asarray(network.graph("matchings", 10, seed=0))
  assert seq.shape == (network.MATCHING_PERIOD, 10, 10)
  np.testing.assert_allclose(seq.sum(1), 1.0)
  np.testing.assert_allclose(seq.sum(2), 1.0)
  assert fo.graphs.spectral_gap(seq) > 0
  er = fo.graphs.mixing_matrix(network.graph("erdos_renyi", 30, seed=0))
  assert fo.graphs.spectral_gap(er) > 0
  np.testing.assert_allclose(er, er.T)
  with pytest.raises(network.NetworkError, match="torus needs --num-clients = rows × cols with both >= 3"):
    network.graph("torus", 13, seed=0)


# ---- runs ------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess run
def test_decentralized_run_counts_each_node_s_messages_to_its_neighbours(tmp_path):
  """Ring, Metropolis–Hastings: a node sends its model (and, gradient tracking, its tracker) to 2 neighbours."""
  out = tmp_path / "run"
  result = run_cli("run", *SMALL, "--topology", "ring", "--algorithms", "dpsgd,gradient_tracking", "--rounds", "6",
                   "--out", str(out))
  assert result.returncode == 0, result.stderr
  rows = {r["algorithm"]: r for r in json.loads((out / "results.json").read_text())}
  p, n, rounds = 64 * 10 + 10, 20, 6
  assert rows["dpsgd"]["megabytes_sent"] == pytest.approx(rounds * n * 2 * 4 * p / 1e6)
  assert rows["gradient_tracking"]["megabytes_sent"] == pytest.approx(rounds * n * 2 * 2 * 4 * p / 1e6)
  for row in rows.values():
    assert row["family"] == "decentralized" and row["status"] == "finished" and row["rounds"] == rounds
    assert row["consensus_distance"] > 0 and 0 <= row["personalized_accuracy"] <= 1
  assert (out / "personalized_accuracy.png").stat().st_size > 0


@pytest.mark.slow  # subprocess runs
def test_async_runs_are_reproducible_resume_and_beat_the_synchronous_clock(tmp_path):
  """Heavy-tailed compute times: the asynchronous run needs less simulated time for the same client updates."""
  args = [*SMALL, "--async", "--delay", "lognormal:0,1", "--algorithms", "fedavg,fedbuff,fedasync"]
  a, b = tmp_path / "a", tmp_path / "b"
  first = run_cli("run", *args, "--rounds", "10", "--out", str(a))
  assert first.returncode == 0, first.stderr
  assert run_cli("run", *args, "--rounds", "5", "--out", str(b)).returncode == 0
  refused = run_cli("run", "--out", str(b), "--resume", "--delay", "exp:3")
  assert refused.returncode == 2 and "--delay exp:3 conflicts with the run saved" in refused.stderr
  again = run_cli("run", "--out", str(b), "--resume", "--rounds", "10")
  assert again.returncode == 0, again.stderr
  ha, hb = (json.loads((x / "history.json").read_text()) for x in (a, b))
  assert without_timings(ha) == without_timings(hb)  # bit for bit, also across a resume
  rows = {r["algorithm"]: r for r in json.loads((a / "results.json").read_text())}
  assert rows["fedbuff"]["server_events"] == rows["fedasync"]["server_events"] == 10 * 5
  assert all(r["rounds"] == 10 for r in rows.values())
  assert rows["fedbuff"]["simulated_time"] < rows["fedavg"]["simulated_time"]
  assert rows["fedasync"]["simulated_time"] == rows["fedbuff"]["simulated_time"]  # the same clock, the same draws
  times = np.asarray(ha["fedavg"]["simulated_time"])
  assert np.all(np.diff(times) > 0) and len(times) == 10
  assert (a / "accuracy_time.png").stat().st_size > 0
  assert "sim. time" in first.stdout


# ---- P2P Bayes (`--algorithms p2p_bayes`) ----------------------------------------------------------------------

P2P = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--local-steps", "2", "--batch-size",
       "8", "--rounds", "4", "--eval-every", "2", "--quiet", "--algorithms", "p2p_bayes",
       "--set", "p2p_bayes.num_hypotheses=4", "--set", "p2p_bayes.spread=0.2", "--set", "p2p_bayes.fit_l2=0.01"]


@pytest.mark.slow  # a whole command-line run
def test_p2p_bayes_run_is_the_run_built_in_python_and_reports_each_node_s_belief_on_the_fit(cli, tmp_path):
  """In process. The candidates as docs/cli.md says: the float64 L-BFGS fit of the pooled ridge risk at index t,
  the others moved by spread · ‖fit‖ in directions drawn with `numpy.random.default_rng(seed)`; on a ring."""
  import jax.flatten_util

  from fedjax_opt.cli import run as run_lib

  out = tmp_path / "run"
  result = cli("run", *P2P, "--out", out)
  assert result.returncode == 0, result.stderr
  (row,) = json.loads((out / "results.json").read_text())
  saved = json.loads((out / "history.json").read_text())["p2p_bayes"]
  assert row["family"] == "decentralized" and row["model"] == "logistic_regression" and row["rounds"] == 4

  dataset = fo.data.load("digits", partition="dirichlet", alpha=0.5, num_clients=6, seed=0)
  model = fo.models.logistic_regression(64, 10)
  ridge = lambda p, b: model.loss_fn(p, b) + 0.5 * 0.01 * sum(jnp.sum(x**2) for x in jax.tree.leaves(p))
  fit, _ = fo.objectives.minimize(lambda p, d: jnp.mean(ridge(p, d)), model.init(jax.random.key(0)),
                                  run_lib.pooled_sample(dataset, 0)(dataset.num_train_examples))
  flat, unravel = jax.flatten_util.ravel_pytree(fit)
  rng = np.random.default_rng(0)
  truth = int(rng.integers(4))
  u = rng.normal(size=(4, flat.size))
  thetas = np.asarray(flat, np.float64) + 0.2 * np.linalg.norm(np.asarray(flat, np.float64)) * (
      u / np.linalg.norm(u, axis=1, keepdims=True))
  thetas[truth] = np.asarray(flat, np.float64)
  hypotheses = jax.tree.map(lambda *r: jnp.stack(r), *[unravel(jnp.asarray(t, jnp.float32)) for t in thetas])
  algo = fo.algorithms.p2p_bayes(model.loss_fn, hypotheses=hypotheses, graph=fo.graphs.ring(6), true_hypothesis=truth)
  state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
  state, history = fo.train(algo, state, dataset, 4, fo.Sampling(clients_per_round=6, client_sampling="all",
                                                                  local_steps=2, batch_size=8),
                            evaluation=fo.Evaluation(every=2, metric_fns={"loss": model.loss_fn,
                                                                          "accuracy": model.accuracy_fn},
                                                     personalized_params=fo.personalized_params),
                            seed=0, progress=False)
  assert saved["round_metrics"] == {k: np.asarray(v).tolist() for k, v in history.round_metrics.items()}
  assert [e["test_accuracy"] for e in saved["evals"]] == [e["test_accuracy"] for e in history.evals]
  assert row["test_accuracy"] == history.last_eval["test_accuracy"]
  assert row["personalized_accuracy"] == history.last_eval["personalized_test_accuracy"]
  # Each node's belief on the fit after the last round, and the round from which it stays above 0.99 (NumPy).
  beliefs = np.asarray(history.round_metrics["true_belief"], np.float64)  # [R, N]
  want = []
  for node in beliefs.T:
    above = [r for r in range(1, 5) if all(node[r - 1:] > 0.99)]
    want.append(above[0] if above else None)
  assert row["rounds_to_concentrate_per_node"] == [want] and row["true_belief_per_node"] == [beliefs[-1].tolist()]
  assert row["true_belief_min"] == beliefs[-1].min() and row["true_belief_max"] == beliefs[-1].max()
  assert row["true_belief_median"] == pytest.approx(np.median(beliefs[-1]), rel=1e-12)
  finite = sorted(np.inf if r is None else r for r in want)
  assert row["rounds_to_concentrate_min"] == (None if finite[0] == np.inf else finite[0])
  assert row["rounds_to_concentrate_max"] == (None if finite[-1] == np.inf else finite[-1])
  # The fit has the lowest mean train loss of the candidates (float64 NumPy softmax cross-entropy), and every node's
  # belief in it has grown from the uniform prior 1/4.
  train = fo.data.unpack(dataset, "train")
  x = np.concatenate([c["x"] for c in train]).reshape(-1, 64).astype(np.float64)
  y = np.concatenate([c["y"] for c in train])
  hyp = jax.tree.map(lambda a: np.asarray(a, np.float64), hypotheses)["linear"]
  logits = np.einsum("pd,kdc->kpc", x, hyp["kernel"]) + hyp["bias"][:, None]
  nll = (logsumexp(logits, axis=2) - np.take_along_axis(logits, y[None, :, None], axis=2)[..., 0]).mean(1)
  assert np.argmin(nll) == truth
  assert beliefs[-1].min() > 0.25
  # Messages: K = 4 float32 log-beliefs to each of 2 ring neighbours, per node and round.
  assert row["megabytes_sent"] == pytest.approx(4 * 6 * 2 * 4 * 4 / 1e6)
  assert "θ* belief" in result.stdout and "rounds to θ*" in result.stdout


@pytest.mark.parametrize("args,needle", [
    (["--set", "p2p_bayes.num_hypotheses=1"], "p2p_bayes: num_hypotheses must be an integer >= 2 (the fit and at "
                                              "least one other); got 1"),
    (["--set", "p2p_bayes.num_hypotheses=2.5"], "p2p_bayes.num_hypotheses must be an integer; got 2.5"),
    (["--set", "p2p_bayes.spread=0"], "p2p_bayes: spread must be > 0"),
    (["--set", "p2p_bayes.spread=abc"], "p2p_bayes.spread must be a finite number; got 'abc'"),
    (["--set", "p2p_bayes.fit_l2=-1"], "p2p_bayes: fit_l2 must be >= 0; got -1.0"),
    (["--set", "p2p_bayes.concentration=1"], "p2p_bayes: concentration must lie in (0, 1); got 1.0"),
    (["--set", "p2p_bayes.true_hypothesis=0"], "p2p_bayes has no hyper-parameter 'true_hypothesis'"),
    (["--set", "p2p_bayes.prior=[0.5, 0.5]"], "p2p_bayes: prior must have shape [K] = (8,) or [N, K] = (6, 8)"),
    (["--model", "mlp"], "p2p_bayes need(s) a convex model: use --model logreg (got mlp)"),
    (["--dataset", "shakespeare"], "p2p_bayes need(s) a convex model"),
])
def test_p2p_bayes_bad_settings_are_one_line(cli, tmp_path, args, needle):
  base = [a for a in P2P if not a.startswith("p2p_bayes.") and a != "--set"]
  result = cli("run", *base, *args, "--out", tmp_path / "x")
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0], result.stderr
  assert not (tmp_path / "x").exists()
