"""A DP run resumed from its checkpoint, or continued from a state and its history, accounts its new rounds on top of
the earlier ones: ε after a round never changes, and a change of σ or of the draw is composed with the earlier
rounds' events (dp-accounting's own composition, checked here), or refused in one line when no accountant composes
them. A state whose rounds come without their accounting is refused rather than under-reported."""

import functools

import dp_accounting
import jax
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt.train import accounting as train_accounting
from fedjax_opt.train.checkpoint import Checkpointer
from test_train_privacy import DELTA, M, N, POISSON, Q, UNIFORM, _algo, _dataset, _one_line, _params

P = fo.privacy
REPLACE = dp_accounting.NeighboringRelation.REPLACE_ONE
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
POISSON_20 = fo.Sampling(local_steps=1, batch_size=2, **P.Sampling.poisson(N, 2 * Q, cap=N).train_kwargs())


@functools.cache
def _algorithm(sigma, m=M):
  """One algorithm per (σ, m), so that the runs of these tests share its compiled round programs."""
  return _algo(P.dp_mean(1.0, sigma, expected_clients=m))


def _train(sigma, sampling, rounds, *, m=M, state=None, **kw):
  algo = _algorithm(sigma, m)
  state = algo.init(_params(), jax.random.key(0)) if state is None else state
  return fo.train(algo, state, _dataset(), rounds, sampling, evaluation=fo.Evaluation(every=2), progress=False,
                  check_memory=False, accounting=kw.pop("accounting", fo.Accounting(delta=DELTA)), **kw)


def _fixed(sigma, m=M):
  """One round of the uniform draw: m of N without replacement, replace-one neighbours, noise σ/2 (sensitivity 2C)."""
  return dp_accounting.SampledWithoutReplacementDpEvent(N, m, dp_accounting.GaussianDpEvent(sigma / 2))


def _poisson(q, sigma):
  return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


def _rdp(relation, *segments):
  """dp-accounting's ε(δ) of the segments (event, rounds) composed in order, by its RDP accountant directly."""
  accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  accountant.compose(dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(e, k) for e, k in segments]))
  return accountant.get_epsilon(DELTA)


def test_resuming_with_another_sigma_composes_the_new_rounds_on_top_of_the_checkpointed_ones(tmp_path):
  """The issue's σ 1 → 3: ε after round 2 stays the ε of two σ = 1 rounds; after round 4 it is theirs composed
  with two σ = 3 rounds, and the restored state's σ is the σ the resumed aggregator adds noise with."""
  _, first = _train(1.0, UNIFORM, 2, checkpointing=fo.Checkpointing(str(tmp_path)))
  state, history = _train(3.0, UNIFORM, 4, checkpointing=fo.Checkpointing(str(tmp_path), resume=True))
  rounds, eps = history.eval_series("dp_epsilon")
  np.testing.assert_array_equal(rounds, [2, 4])
  assert eps[0] == first.eval_series("dp_epsilon")[1][0]  # kept, not recomputed under σ = 3
  np.testing.assert_allclose(eps, [_rdp(REPLACE, (_fixed(1.0), 2)),
                                   _rdp(REPLACE, (_fixed(1.0), 2), (_fixed(3.0), 2))], rtol=1e-9)
  assert eps[1] > eps[0]
  assert float(state.aggregator_state.noise_multiplier) == 3.0
  segments = history.privacy["segments"]
  assert [(s["rounds"], s["noise_multiplier"]) for s in segments] == [([1, 2], 1.0), ([3, 4], 3.0)]
  assert history.privacy["noise_multiplier"] == 3.0  # the last rounds'
  again = fo.History.from_dict(history.to_dict())  # the segments survive the JSON (and so the checkpoint)
  assert train_accounting.Segment.from_dict(again.privacy["segments"][1]) == train_accounting.Segment(
      3, 4, P.Sampling.fixed(N, M), (3.0,))


def test_resuming_with_another_draw_composes_it_or_is_refused_naming_both(tmp_path):
  """Uniform → Poisson (the issue's ε 12.67 → 3.45): the two draws have different neighbouring relations, so no
  accountant composes them: refused in one line, and the checkpoint still resumes as it was run. Poisson q → 2q
  (the same relation) composes."""
  uniform_dir, poisson_dir = str(tmp_path / "uniform"), str(tmp_path / "poisson")
  _train(1.0, UNIFORM, 2, checkpointing=fo.Checkpointing(uniform_dir))
  with pytest.raises(P.UnsupportedAccountingError) as raised:
    _train(1.0, POISSON, 4, checkpointing=fo.Checkpointing(uniform_dir, resume=True))
  message = _one_line(raised)
  assert ("rounds 1–2 drew fixed-size, m=10 of N=1000 without replacement (replace-one neighbours) and this run "
          "draws Poisson, q=0.01 of N=1000") in message
  _, history = _train(1.0, UNIFORM, 4, checkpointing=fo.Checkpointing(uniform_dir, resume=True))
  np.testing.assert_allclose(history.eval_series("dp_epsilon")[1], [_rdp(REPLACE, (_fixed(1.0), 2)),
                                                                    _rdp(REPLACE, (_fixed(1.0), 4))], rtol=1e-9)

  _train(1.0, POISSON, 2, checkpointing=fo.Checkpointing(poisson_dir))
  _, history = _train(1.0, POISSON_20, 4, m=2 * M, checkpointing=fo.Checkpointing(poisson_dir, resume=True))
  want = [_rdp(ADD_REMOVE, (_poisson(Q, 1.0), 2)), _rdp(ADD_REMOVE, (_poisson(Q, 1.0), 2), (_poisson(2 * Q, 1.0), 2))]
  np.testing.assert_allclose(history.eval_series("dp_epsilon")[1], want, rtol=1e-9)
  assert [s["sampling_probability"] for s in history.privacy["segments"]] == [Q, 2 * Q]


def test_a_continued_state_needs_its_history_and_keeps_it():
  """A round-2 state passed to a new fo.train call: without its history, refused (the issue's Poisson continuation
  reported ε below what its first rounds had spent); with it, its rounds are composed with the new ones, with the σ
  of the continuing algorithm's dp_mean."""
  state, first = _train(1.0, UNIFORM, 2)
  with pytest.raises(ValueError) as raised:
    _train(1.0, POISSON, 4, state=state)
  assert "the state is at round 2 and holds a dp_mean, but no accounting of its 2 round(s) comes with it: pass " \
         "history=" in _one_line(raised)
  with pytest.raises(P.UnsupportedAccountingError) as raised:  # the continuation, with its history
    _train(1.0, POISSON, 4, state=state, history=first)
  assert "rounds 1–2 drew fixed-size" in _one_line(raised)
  continued, history = _train(1.0, UNIFORM, 4, state=state, history=first)
  uninterrupted, whole = _train(1.0, UNIFORM, 4)
  rounds, eps = history.eval_series("dp_epsilon")
  np.testing.assert_array_equal(rounds, [2, 4])
  assert eps.tolist() == whole.eval_series("dp_epsilon")[1].tolist()
  np.testing.assert_allclose(eps[1], _rdp(REPLACE, (_fixed(1.0), 4)), rtol=1e-9)
  assert history.num_rounds == 4 and history.privacy["segments"][0]["rounds"] == [1, 4]
  assert first.num_rounds == 2 and len(first.evals) == 1  # the given history is not changed
  np.testing.assert_array_equal(np.asarray(continued.params["w"]), np.asarray(uninterrupted.params["w"]))
  # Continued by an algorithm whose dp_mean has σ = 3: the state read σ = 1, the noise is drawn with 3; its rounds
  # are accounted with 3, on top of the first two.
  continued, history = _train(3.0, UNIFORM, 4, state=state, history=first)
  assert float(continued.aggregator_state.noise_multiplier) == 3.0
  np.testing.assert_allclose(history.eval_series("dp_epsilon")[1],
                             [eps[0], _rdp(REPLACE, (_fixed(1.0), 2), (_fixed(3.0), 2))], rtol=1e-9)
  _, given = _train(3.0, UNIFORM, 4, state=state, history=first, accounting=fo.Accounting(3.0, DELTA))
  assert given.eval_series("dp_epsilon")[1].tolist() == history.eval_series("dp_epsilon")[1].tolist()  # accepted
  with pytest.raises(ValueError) as raised:
    _train(3.0, UNIFORM, 4, state=state, history=first, accounting=fo.Accounting(1.0, DELTA))
  assert "Accounting.noise_multiplier is 1 but the dp_mean adds noise with σ = 3" in _one_line(raised)


def test_a_history_that_does_not_account_the_state_is_refused(tmp_path):
  state, first = _train(1.0, UNIFORM, 2)
  with pytest.raises(ValueError) as raised:  # another δ would change the earlier points' ε
    _train(1.0, UNIFORM, 4, state=state, history=first, accounting=fo.Accounting(delta=DELTA / 10))
  assert ("rounds 1–2 were accounted with δ=1e-05 by the RDP accountant, and this run asks δ=1e-06"
          in _one_line(raised))
  with pytest.raises(ValueError) as raised:  # a history of other rounds
    _train(1.0, UNIFORM, 4, state=_algorithm(1.0).init(_params(), jax.random.key(0)), history=first)
  assert "history= records 2 rounds, but the state is at round 0" in _one_line(raised)
  with pytest.raises(ValueError) as raised:  # a history without accounting
    _train(1.0, UNIFORM, 4, state=state, history=fo.History(round_metrics=first.round_metrics))
  assert "the history given holds none" in _one_line(raised)
  # A checkpoint whose history records no accounting (written between chunks before segments were recorded).
  Checkpointer(str(tmp_path)).save(state, fo.History(round_metrics=first.round_metrics))
  with pytest.raises(ValueError) as raised:
    _train(1.0, UNIFORM, 4, checkpointing=fo.Checkpointing(str(tmp_path), resume=True))
  assert "the checkpoint restored is at round 2 and holds a dp_mean, but its history holds no accounting" in \
      _one_line(raised)
  with pytest.raises(ValueError) as raised:  # a checkpoint restored and a history given: which one is continued?
    _train(1.0, UNIFORM, 4, state=state, history=first, checkpointing=fo.Checkpointing(str(tmp_path), resume=True))
  assert "history= continues the given state, but resume=True restored round 2 from" in _one_line(raised)
  # A history written before segments were recorded (one draw and σ throughout): continued as it was run only.
  legacy = fo.History.from_dict(first.to_dict())
  legacy.privacy = {k: v for k, v in legacy.privacy.items() if k != "segments"}
  _, history = _train(1.0, UNIFORM, 4, state=state, history=legacy)
  np.testing.assert_allclose(history.eval_series("dp_epsilon")[1][1], _rdp(REPLACE, (_fixed(1.0), 4)), rtol=1e-9)
  with pytest.raises(ValueError) as raised:
    _train(3.0, UNIFORM, 4, state=state, history=legacy)
  assert "(a history without accounting segments), and this run is fixed-size" in _one_line(raised)


def test_a_checkpoint_between_chunks_records_how_its_rounds_are_accounted(tmp_path):
  """ε is computed at the end of a run, but every history it checkpoints says under what its rounds ran, so that a
  run interrupted there resumes on top of them."""
  _train(1.0, UNIFORM, 4, checkpointing=fo.Checkpointing(str(tmp_path)))
  template = _algorithm(1.0).init(_params(), jax.random.key(0))
  _, history = Checkpointer(str(tmp_path))._restore_step(2, template)  # pylint: disable=protected-access
  assert "dp_epsilon" not in history.evals[-1]
  assert [s["rounds"] for s in history.privacy["segments"]] == [[1, 2]]


def test_composed_epsilons_is_dp_accountings_composition():
  """`fo.privacy.accounting.composed_epsilons` against dp-accounting's accountants given the ComposedDpEvent: RDP
  (fixed-size m then 2m; Poisson σ then 2σ), PLD (Poisson, then truncated Poisson), at every round."""
  composed = P.accounting.composed_epsilons
  fixed = [(1.0, P.Sampling.fixed(N, M), 2), (2.0, P.Sampling.fixed(N, 2 * M), 3)]
  got = composed(fixed, delta=DELTA, at=[1, 2, 3, 5])
  want = [_rdp(REPLACE, (_fixed(1.0), 1)), _rdp(REPLACE, (_fixed(1.0), 2)),
          _rdp(REPLACE, (_fixed(1.0), 2), (_fixed(2.0, 2 * M), 1)),
          _rdp(REPLACE, (_fixed(1.0), 2), (_fixed(2.0, 2 * M), 3))]
  np.testing.assert_allclose(got, want, rtol=1e-9)
  poisson = [(1.0, P.Sampling.poisson(N, Q, cap=N), 3), (2.0, P.Sampling.poisson(N, Q, cap=N), 1)]
  np.testing.assert_allclose(composed(poisson, delta=DELTA, at=[4]),
                             [_rdp(ADD_REMOVE, (_poisson(Q, 1.0), 3), (_poisson(Q, 2.0), 1))], rtol=1e-9)
  assert composed(fixed[:1], delta=DELTA, at=[1, 2]).tolist() == P.epsilons(
      1.0, 2, delta=DELTA, sampling=P.Sampling.fixed(N, M)).tolist()  # one segment: epsilons
  n, cap = 100, 15
  pld = [(1.5, P.Sampling.poisson(n, 0.1, cap=n), 2), (1.5, P.Sampling.poisson(n, 0.1, cap=cap), 2)]
  accountant = dp_accounting.pld.PLDAccountant(neighboring_relation=ADD_REMOVE)
  accountant.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(_poisson(0.1, 1.5), 2),
      dp_accounting.SelfComposedDpEvent(dp_accounting.TruncatedSubsampledGaussianDpEvent(n, 0.1, cap, 1.5), 2)]))
  np.testing.assert_allclose(composed(pld, delta=DELTA, accountant="pld", at=[4]), [accountant.get_epsilon(DELTA)],
                             rtol=1e-6)
  with pytest.raises(P.UnsupportedAccountingError, match="compose events of one neighbouring relation only"):
    composed([fixed[0], poisson[0]], delta=DELTA, at=[5])
  assert composed([fixed[0], (0.0, P.Sampling.fixed(N, M), 1)], delta=DELTA, at=[2, 3]).tolist()[1] == np.inf
