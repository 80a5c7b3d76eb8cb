"""`aggregator=` reaches every factory that combines what its clients send, and the others say why not.

* The declaration (`core.execution.accepts_policy_keywords`): a factory without `aggregator` must give a one-line
  reason, a factory with it must not; a declared factory refuses any aggregator in one line naming itself and the
  reason, takes `aggregator=None` as nothing, and exposes the reason as `factory.aggregation`
  (tests/test_convention.py walks every factory of `fo.algorithms` with it).
* One-shot averaging, which now takes `aggregator=`: the uniform mean, the trimmed mean and a compressing client
  stage with error feedback change its one exchange exactly as float64 NumPy predicts from the clients' exact
  local solutions; the aggregator's state moves in the exchange only.
* One `core.rounds.init_aggregator_state` (`slots=True` for the clustered algorithms' K stacked models).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lsq_loss, make_clients, pack, run_rounds

import fedjax_opt as fo
from fedjax_opt.core import clusters, execution, rounds

D = 3
SIZES = [5, 9, 7, 8]  # unequal: the weighted and the uniform mean differ
STEPS, BATCH = 3, 3


# ---- the declaration ---------------------------------------------------------------------------------------


def _plain(loss_fn, *, num_clients=None):
  return loss_fn, num_clients


def test_a_factory_without_aggregator_must_declare_why_and_one_with_it_must_not():
  with pytest.raises(TypeError, match="_plain takes no aggregator=; declare why"):
    execution.accepts_policy_keywords(_plain)

  def taking(loss_fn, *, aggregator=None):
    return loss_fn, aggregator

  with pytest.raises(TypeError, match="taking takes aggregator= .* cannot declare refuses_aggregator="):
    execution.accepts_policy_keywords(taking, refuses_aggregator="it needs the exact mean",
                                      default_aggregator=fo.aggregators.mean)
  declared = execution.accepts_policy_keywords(taking, default_aggregator=fo.aggregators.mean)
  assert declared.aggregation == execution.TAKES_AGGREGATOR
  assert declared.default_aggregator is fo.aggregators.mean
  assert execution.accepts_policy_keywords(_plain, refuses_aggregator="why").default_aggregator is None
  for bad in ("", "  ", "two\nlines", 3):
    with pytest.raises(TypeError, match="refuses_aggregator must be a non-empty one-line str"):
      execution.accepts_policy_keywords(_plain, refuses_aggregator=bad)


def test_the_default_aggregator_is_declared_exactly_when_the_factory_takes_one():
  """`default_aggregator=`: required with `aggregator=` in the signature, refused without, a zero-argument
  constructor; all checked when the decorator is applied."""
  def taking(loss_fn, *, aggregator=None):
    return loss_fn, aggregator

  with pytest.raises(TypeError, match="taking takes aggregator=; declare the rule it uses when given none"):
    execution.accepts_policy_keywords(taking)
  with pytest.raises(TypeError, match="_plain takes no aggregator=, so it cannot declare default_aggregator=mean"):
    execution.accepts_policy_keywords(_plain, refuses_aggregator="why", default_aggregator=fo.aggregators.mean)
  for bad in (fo.aggregators.mean(), fo.aggregators.trimmed_mean, "mean"):
    with pytest.raises(TypeError, match="default_aggregator of .*taking must be a zero-argument constructor"):
      execution.accepts_policy_keywords(taking, default_aggregator=bad)


def test_a_declared_factory_refuses_any_aggregator_in_one_line_and_takes_none_as_nothing():
  reason = "its server step needs the exact mean of the clients' models"
  built = []

  def exact(loss_fn, *, num_clients=None):
    built.append((loss_fn, num_clients))
    return fo.FederatedAlgorithm(lambda params, key: params, lambda state, batches: state)

  factory = execution.accepts_policy_keywords(exact, refuses_aggregator=reason)
  assert factory.aggregation == reason
  assert "aggregator" not in inspect.signature(factory).parameters
  assert reason in factory.__doc__ and "takes no `aggregator=`" in factory.__doc__
  stage = fo.compression.compress(fo.compression.top_k(k=1))
  for aggregator, label in ((fo.aggregators.trimmed_mean(0.1), "trimmed_mean"), (stage, stage.name),
                            (fo.aggregators.chain(stage, fo.aggregators.mean()), "mean"), ("mean", "str")):
    with pytest.raises(ValueError) as caught:
      factory("loss", num_clients=3, aggregator=aggregator)
    assert str(caught.value) == f"exact takes no aggregator= (got {label}): {reason}"
  assert not built  # refused before the factory ran
  assert type(factory("loss", num_clients=3, aggregator=None)) is fo.FederatedAlgorithm
  assert built == [("loss", 3)]
  assert hasattr(factory("loss", aggregator=None, client_map="vmap").step, "__wrapped__")  # with a policy keyword


# ---- one-shot averaging takes aggregator= ---------------------------------------------------------------------


def _problem():
  rng = np.random.default_rng(3)
  clients = make_clients(rng, SIZES, D)
  batches = pack(clients, STEPS, BATCH)
  params = {"w": jnp.asarray(rng.normal(size=D), jnp.float32), "b": jnp.asarray(0.3, jnp.float32)}
  return clients, batches, params


def _local_solutions(clients):
  """float64 least-squares solutions ŵ_k = (w_k, b_k) of each client's own data, `[C, D + 1]`."""
  out = []
  for x, y in clients:
    design = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    out.append(np.linalg.lstsq(design, y, rcond=None)[0])
  return np.stack(out)


def _exchange(aggregator, rounds_run=2):
  clients, batches, params = _problem()
  algorithm = fo.algorithms.one_shot_average(lsq_loss, aggregator=aggregator)
  state0 = algorithm.init(params, jax.random.key(0))
  state, metrics = run_rounds(algorithm.step, state0, batches, rounds_run)
  start = np.r_[np.asarray(params["w"], np.float64), float(params["b"])]
  deltas = _local_solutions(clients) - start  # what each client sends: ŵ_k − w_0
  got = np.r_[np.asarray(state.params["w"], np.float64), float(state.params["b"])]
  return start, deltas, got, state0, state, metrics


def _trimmed(values, beta):
  """NumPy coordinate-wise β-trimmed mean of `[C, P]` rows: drop ⌊βC⌋ smallest and largest of every column."""
  b = int(np.floor(beta * len(values)))
  ordered = np.sort(values, axis=0)
  return ordered[b:len(values) - b].mean(axis=0)


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean"])
def test_one_shot_average_combines_the_local_solutions_by_the_rule_it_is_given(rule):
  aggregator = fo.aggregators.mean() if rule == "mean" else fo.aggregators.trimmed_mean(0.25)
  start, deltas, got, _, _, metrics = _exchange(aggregator)
  n = np.asarray(SIZES, np.float64)
  want = start + (deltas.mean(axis=0) if rule == "mean" else _trimmed(deltas, 0.25))
  weighted = start + n @ deltas / n.sum()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert np.max(np.abs(want - weighted)) > 100 * 1e-4  # the rule changed the step, not rounding
  assert list(np.asarray(metrics["communicated"])) == [True, False]


def test_one_shot_average_with_a_compressing_stage_sends_top_k_and_keeps_its_residuals_after_the_exchange():
  """chain(compress(top_k(k=1), error_feedback), weighted_mean): each client sends its largest entry of ŵ_k − w_0
  (the entries in the order of the flattened model: b, then w), the server averages what it received by n_k, the
  residuals are e_k = Δ_k − C(Δ_k), and the later step (nothing sent) leaves them as they are."""
  stage = fo.compression.compress(fo.compression.top_k(k=1), error_feedback=True, num_clients=len(SIZES))
  start, deltas, got, state0, state, metrics = _exchange(fo.aggregators.chain(stage, fo.aggregators.weighted_mean()))
  flat = np.concatenate([deltas[:, D:], deltas[:, :D]], axis=1)  # ravel order of {"b", "w"}
  sent = np.zeros_like(flat)
  top = np.argmax(np.abs(flat), axis=1)
  sent[np.arange(len(flat)), top] = flat[np.arange(len(flat)), top]
  n = np.asarray(SIZES, np.float64)
  mean = n @ sent / n.sum()
  np.testing.assert_allclose(got, start + np.r_[mean[1:], mean[:1]], rtol=1e-4, atol=1e-5)
  residual = fo.compression.residuals(state.aggregator_state)
  np.testing.assert_allclose(np.c_[np.asarray(residual["b"])[:, None], np.asarray(residual["w"])], flat - sent,
                             rtol=1e-4, atol=1e-4)
  # (after the second step: had it sent Δ_k + e_k again, e_k would be another residual)
  assert isinstance(state0.aggregator_state, fo.core.types.StagedState)
  assert list(np.asarray(metrics["communicated"])) == [True, False] and float(metrics["bits_up"][1]) == 0.0


# ---- one init_aggregator_state -------------------------------------------------------------------------------


def test_one_init_aggregator_state_for_every_algorithm_with_slots_for_stacked_cluster_models():
  assert "def init_aggregator_state" in inspect.getsource(rounds)
  assert "def init_aggregator_state" not in inspect.getsource(clusters)
  assert "init_aggregator_state" not in clusters.__all__
  k, n = 3, 5
  cluster_params = {"w": jnp.arange(k * D, dtype=jnp.float32).reshape(k, D), "b": jnp.zeros((k,), jnp.float32)}
  clipping = fo.aggregators.centered_clipping(1.0, momentum=0.5)  # a stateful rule: its state per cluster
  plain = rounds.init_aggregator_state(clipping, cluster_params, slots=True)
  for leaf, want in zip(jax.tree.leaves(plain), jax.tree.leaves(jax.vmap(clipping.init)(cluster_params))):
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))
  stage = fo.compression.compress(fo.compression.top_k(k=1), error_feedback=True, num_clients=n)
  staged = rounds.init_aggregator_state(fo.aggregators.chain(stage, clipping), cluster_params, slots=True)
  assert isinstance(staged, fo.core.types.StagedState) and len(staged.rows) == 1
  assert {tuple(leaf.shape) for leaf in jax.tree.leaves(staged.rows[0])} == {(n, k, D), (n, k)}
  assert jax.tree.structure(staged.server) == jax.tree.structure(plain)
  single = rounds.init_aggregator_state(fo.aggregators.chain(stage, fo.aggregators.mean()),
                                        jax.tree.map(lambda t: t[0], cluster_params), messages=2)
  assert len(single.rows) == 2 and {tuple(leaf.shape) for leaf in jax.tree.leaves(single.rows)} == {(n, D), (n,)}
