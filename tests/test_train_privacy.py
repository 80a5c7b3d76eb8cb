"""`fo.train` with a `dp_mean` aggregator: the ε it records is dp-accounting's for the clients the run draws, and a
run that draws other clients than the accounted ones, or is not accounted at all, is refused in one line."""

import functools

import dp_accounting
import jax
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from conftest import lsq_loss

P = fo.privacy
N, M, SIGMA, DELTA = 1000, 10, 1.0, 1e-5
Q = M / N


@functools.cache
def _dataset():
  """N = 1000 clients of two examples each (the issue's N and m: the fixed-size and Poisson ε differ 10×)."""
  rng = np.random.default_rng(0)
  return fo.data.pack([{"x": rng.normal(size=(2, 2)).astype(np.float32), "y": rng.normal(size=2).astype(np.float32)}
                       for _ in range(N)])


def _params():
  return {"w": np.zeros(2, np.float32), "b": np.zeros((), np.float32)}


def _algo(aggregator):
  return fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), aggregator=aggregator)


def _dp():
  return P.dp_mean(1.0, SIGMA, expected_clients=M)


def _train(aggregator, sampling, rounds=4, **kw):
  algo = _algo(aggregator)
  return fo.train(algo, algo.init(_params(), jax.random.key(0)), _dataset(), rounds, sampling,
                  evaluation=fo.Evaluation(every=2), progress=False, check_memory=False, **kw)


UNIFORM = fo.Sampling(clients_per_round=M, local_steps=1, batch_size=2)   # fo.Sampling's default draw
POISSON = fo.Sampling(local_steps=1, batch_size=2, **P.Sampling.poisson(N, Q, cap=N).train_kwargs())


def _one_line(raised):
  message = str(raised.value)
  assert "\n" not in message and message.startswith("train: "), message
  return message


def test_a_dp_mean_run_without_accounting_is_refused_wherever_the_dp_mean_sits():
  stage = fo.compression.compress(fo.compression.top_k(k=1))
  for aggregator in (_dp(), fo.aggregators.chain(stage, _dp()), P.secure_aggregation(_dp(), bound=1.0),
                     fo.attacks.corrupt(_dp(), fo.attacks.gaussian(1.0), attackers=0.1)):
    with pytest.raises(ValueError) as raised:
      _train(aggregator, UNIFORM)
    assert "the aggregator is a fo.privacy.dp_mean: give accounting=fo.Accounting(" in _one_line(raised)


def test_an_accounted_sampling_the_run_does_not_draw_is_refused_naming_both():
  """The issue's case: trained with the default uniform draw, accounted as Poisson (ε 2.10 instead of 20.99)."""
  with pytest.raises(P.SamplingMismatchError) as raised:
    _train(_dp(), UNIFORM, accounting=fo.Accounting(SIGMA, DELTA, sampling=P.Sampling.poisson(N, Q, cap=N)))
  message = _one_line(raised)
  assert "client_sampling='uniform', clients_per_round=10 over 1000 clients" in message
  assert "Poisson, q=0.01 of N=1000" in message
  with pytest.raises(P.SamplingMismatchError) as raised:  # and the other way round
    _train(_dp(), POISSON, accounting=fo.Accounting(SIGMA, DELTA, sampling=P.Sampling.fixed(N, M)))
  message = _one_line(raised)
  assert "client_sampling='poisson'" in message and "fixed-size, m=10 of N=1000" in message


def test_what_cannot_be_accounted_is_refused_before_anything_is_compiled():
  with pytest.raises(ValueError) as raised:  # nothing to account
    _train(fo.aggregators.mean(), UNIFORM, accounting=fo.Accounting(SIGMA, DELTA))
  assert "holds no fo.privacy.dp_mean" in _one_line(raised)
  proportional = fo.Sampling(clients_per_round=M, local_steps=1, batch_size=2, client_sampling="proportional")
  with pytest.raises(ValueError) as raised:  # draws with replacement: no accountant event
    _train(_dp(), proportional, accounting=fo.Accounting(SIGMA, DELTA))
  assert "client_sampling='proportional' has no privacy accounting" in _one_line(raised)
  with pytest.raises(P.UnsupportedAccountingError) as raised:  # fixed-size sampling: RDP only
    _train(_dp(), UNIFORM, accounting=fo.Accounting(SIGMA, DELTA, accountant="pld"))
  assert "use accountant='rdp'" in _one_line(raised)
  truncated = fo.Sampling(local_steps=1, batch_size=2, **P.Sampling.poisson(N, Q).train_kwargs())
  with pytest.raises(P.UnsupportedAccountingError) as raised:  # truncated Poisson: PLD only
    _train(_dp(), truncated, accounting=fo.Accounting(SIGMA, DELTA))
  assert "use accountant='pld'" in _one_line(raised)
  with pytest.raises(ValueError, match=r"Accounting.delta must be in \(0, 1\)"):
    fo.Accounting(SIGMA, 0.0)
  with pytest.raises(ValueError, match="Accounting.noise_multiplier must be a finite number >= 0"):
    fo.Accounting(-1.0, DELTA)
  with pytest.raises(TypeError, match="Accounting.sampling must be None or a fo.privacy.Sampling"):
    fo.Accounting(SIGMA, DELTA, sampling=UNIFORM)


def _direct(event, relation, rounds):
  """ε(δ) after each of `rounds` from dp-accounting's RDP accountant, composed round by round."""
  out = []
  for r in rounds:
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, int(r))
    out.append(accountant.get_epsilon(DELTA))
  return np.array(out)


def test_the_history_records_dp_accountings_epsilon_for_the_uniform_draw():
  """m = 10 of N = 1000 without replacement: N public, replace-one neighbours, sensitivity 2C (noise σ/2)."""
  want = None
  for declared in (None, P.Sampling.fixed(N, M)):  # the run's own draw, and the same draw declared
    _, history = _train(_dp(), UNIFORM, accounting=fo.Accounting(SIGMA, DELTA, sampling=declared))
    rounds, eps = history.eval_series("dp_epsilon")
    np.testing.assert_array_equal(rounds, [2, 4])
    if want is None:
      want = _direct(dp_accounting.SampledWithoutReplacementDpEvent(N, M, dp_accounting.GaussianDpEvent(SIGMA / 2)),
                     dp_accounting.NeighboringRelation.REPLACE_ONE, rounds)
    np.testing.assert_allclose(eps, want, rtol=1e-9)
    assert history.privacy["sampling"] == "fixed-size, m=10 of N=1000 without replacement"
    assert history.privacy["neighboring_relation"] == "REPLACE_ONE"
    assert history.privacy["noise_multiplier"] == SIGMA and history.privacy["delta"] == DELTA


def test_the_history_records_dp_accountings_epsilon_for_the_poisson_draw():
  """Each client with probability q in N slots (never truncated): add/remove neighbours, sensitivity C."""
  _, history = _train(_dp(), POISSON, accounting=fo.Accounting(SIGMA, DELTA, sampling=P.Sampling.poisson(N, Q, cap=N)))
  rounds, eps = history.eval_series("dp_epsilon")
  want = _direct(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)),
                 dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, rounds)
  np.testing.assert_allclose(eps, want, rtol=1e-9)
  assert history.privacy["neighboring_relation"] == "ADD_OR_REMOVE_ONE"
  assert fo.History.from_dict(history.to_dict()).evals == history.evals  # ε and what it is of survive the JSON
  assert fo.History.from_dict(history.to_dict()).privacy == history.privacy


def test_a_resumed_run_records_epsilon_at_every_point_of_its_history(tmp_path):
  """Rounds 1-2, checkpointed; resumed to round 4: both points carry the ε of the whole run's rounds."""
  accounting = fo.Accounting(SIGMA, DELTA)
  _train(_dp(), UNIFORM, rounds=2, accounting=accounting, checkpointing=fo.Checkpointing(str(tmp_path)))
  _, history = _train(_dp(), UNIFORM, rounds=4, accounting=accounting,
                      checkpointing=fo.Checkpointing(str(tmp_path), resume=True))
  rounds, eps = history.eval_series("dp_epsilon")
  np.testing.assert_array_equal(rounds, [2, 4])
  want = _direct(dp_accounting.SampledWithoutReplacementDpEvent(N, M, dp_accounting.GaussianDpEvent(SIGMA / 2)),
                 dp_accounting.NeighboringRelation.REPLACE_ONE, rounds)
  np.testing.assert_allclose(eps, want, rtol=1e-9)


@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_a_sweep_over_sigma_records_one_epsilon_per_member():
  """`Accounting.noise_multiplier` as K values: each member's ε at each point (no training needed: the plan of a
  state holding a DPMeanState, applied to a history of two points)."""
  from fedjax_opt.train import accounting as train_accounting

  state = jax.vmap(lambda sigma: P.dp_mean(1.0, sigma, expected_clients=M).init(_params()))(np.array([0.8, 1.6]))
  relation = dp_accounting.NeighboringRelation.REPLACE_ONE
  evals = fo.History(evals=[{"round": 3}, {"round": 6}], sweep_size=2)
  # σ given (each member's, as built), or read from the members' states (the float32 σ the noise is drawn with).
  for accounting, sigmas in ((fo.Accounting((0.8, 1.6), DELTA), (0.8, 1.6)),
                             (fo.Accounting(delta=DELTA), tuple(float(np.float32(v)) for v in (0.8, 1.6)))):
    plan = train_accounting.plan(accounting, state, UNIFORM, N, sweep_size=2)
    rounds, eps = plan.recorded(evals).eval_series("dp_epsilon")  # [K, E]
    for member, sigma in enumerate(sigmas):
      want = _direct(dp_accounting.SampledWithoutReplacementDpEvent(N, M, dp_accounting.GaussianDpEvent(sigma / 2)),
                     relation, rounds)
      np.testing.assert_allclose(eps[member], want, rtol=1e-7)  # RDP composed k times vs scaled by k
  with pytest.raises(ValueError) as raised:
    train_accounting.plan(fo.Accounting((0.8, 1.6, 2.0), DELTA), state, UNIFORM, N, sweep_size=2)
  assert "holds 3 values: give one, or one per sweep member (2)" in _one_line(raised)
  with pytest.raises(ValueError) as raised:  # the members' σ in the other order
    train_accounting.plan(fo.Accounting((1.6, 0.8), DELTA), state, UNIFORM, N, sweep_size=2)
  assert "Accounting.noise_multiplier is [0.8, 1.6] but the dp_mean adds noise with σ = [0.8, 1.6]" in _one_line(
      raised)


def test_the_accounted_sigma_and_m_are_the_dp_means_own():
  """σ left out is read from the dp_mean's state; a σ or an m other than the dp_mean's is refused in one line."""
  _, given = _train(_dp(), UNIFORM, rounds=2, accounting=fo.Accounting(SIGMA, DELTA))
  _, read = _train(_dp(), UNIFORM, rounds=2, accounting=fo.Accounting(delta=DELTA))
  assert read.eval_series("dp_epsilon")[1].tolist() == given.eval_series("dp_epsilon")[1].tolist()
  assert read.privacy == given.privacy
  with pytest.raises(ValueError) as raised:
    _train(_dp(), UNIFORM, accounting=fo.Accounting(2 * SIGMA, DELTA))
  assert "Accounting.noise_multiplier is 2 but the dp_mean adds noise with σ = 1" in _one_line(raised)
  with pytest.raises(P.SamplingMismatchError) as raised:
    _train(P.dp_mean(1.0, SIGMA, expected_clients=M / 2), UNIFORM, accounting=fo.Accounting(delta=DELTA))
  assert "dp_mean divides by expected_clients = 5, but the run draws fixed-size, m=10" in _one_line(raised)
  with pytest.raises(ValueError, match="Accounting needs delta="):
    fo.Accounting(SIGMA)
