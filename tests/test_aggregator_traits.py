"""Declared traits: every piece of the library says what it does (`Aggregator.traits`), and nothing is recognised by
where its code lives.

SCAFFOLD and FedDyn move server state by a plain sum outside the aggregator, so they refuse private, secure, robust
and attacking pieces; before traits they recognised them by `aggregate.__module__`, and `dp_mean`'s aggregate
wrapped in a lambda or a `functools.partial` passed: the Δc_i went out unclipped and un-noised. An aggregator
without traits is now unknown, and refused.
"""

import ast
import dataclasses
import functools
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.core.server import aggregate_updates, check_aggregator, protecting_piece
from conftest import lsq_loss, make_clients, pack

A, Traits = fo.aggregators, fo.aggregators.Traits
D, N = 3, 4
KEY = jax.random.key(0)
STAGE = fo.compression.compress(fo.compression.top_k(k=1))


def _scaffold(aggregator):
  return fo.algorithms.scaffold(lsq_loss, 0.1, 1.0, num_clients=N, aggregator=aggregator)


def _feddyn(aggregator):
  return fo.algorithms.feddyn(lsq_loss, 0.1, num_clients=N, client_optimizer=optax.sgd(0.1), aggregator=aggregator)


def _refusal(factory, aggregator):
  with pytest.raises(ValueError) as raised:
    factory(aggregator)
  message = str(raised.value)
  assert "\n" not in message, message
  return message


# ---- (a) the reproduction: a library piece behind a lambda or a partial is unknown, and refused -----------------


def _disguised_dp():
  """`dp_mean`'s functions behind a lambda and a partial: the `__module__` of neither is fedjax_opt.privacy.dp."""
  dp = fo.privacy.dp_mean(1.0, 1.1, expected_clients=3)
  by_lambda = A.Aggregator(dp.init, lambda *a, **k: dp.aggregate(*a, **k), dp.streaming, True)
  by_partial = A.Aggregator(dp.init, functools.partial(dp.aggregate), dp.streaming, True)
  return dp, {"lambda": by_lambda, "partial": by_partial}


@pytest.mark.parametrize("factory,who,side", [(_scaffold, "scaffold", "control variate c"),
                                              (_feddyn, "feddyn", "correction h")])
def test_dp_mean_behind_a_lambda_or_a_partial_is_refused_as_undeclared(factory, who, side):
  _, disguised = _disguised_dp()
  for how, aggregator in disguised.items():
    assert aggregator.traits is None and protecting_piece(aggregator) == "unknown"
    message = _refusal(factory, aggregator)
    assert message.startswith(f"{who}: an aggregator without traits ("), (how, message)
    assert "declares no traits" in message and side in message, (how, message)
    assert 'traits=fo.aggregators.Traits(name="my_mean", linear=True)' in message, (how, message)


@pytest.mark.parametrize("factory", [_scaffold, _feddyn])
def test_the_same_pieces_declared_are_judged_by_their_traits(factory):
  """Declared private (by the user, or with dp_mean's own traits), the disguised dp_mean is refused as DP, naming
  the declared name; a user's plain weighted mean behind a lambda, declared linear, is taken."""
  needle = "not be differentially private"
  dp, disguised = _disguised_dp()
  declared = disguised["lambda"]._replace(traits=Traits(name="my_dp", private=True, noise_multiplier=1.1,
                                                        clip_norm=1.0))
  message = _refusal(factory, declared)
  assert needle in message and "my_dp" in message, message
  message = _refusal(factory, disguised["partial"]._replace(traits=dp.traits))  # dp_mean's own traits
  assert needle in message and "dp_mean" in message, message
  wm = A.weighted_mean()
  mine = A.Aggregator(wm.init, lambda *a: wm.aggregate(*a), traits=Traits(name="my_mean", linear=True))
  assert protecting_piece(mine) is None
  factory(mine)  # taken
  if factory is _scaffold:  # SCAFFOLD takes a stage in front of it (FedDyn refuses any stage)
    factory(A.chain(STAGE, mine))


def test_a_declared_plain_mean_behind_a_lambda_runs_scaffold_as_the_library_mean():
  """Taken and equal: the user's mean (through a lambda, declared linear) gives SCAFFOLD's round bit for bit."""
  rng = np.random.default_rng(0)
  batches = pack(make_clients(rng, [4, 3, 2], D), 2, 2)
  params = {"w": jnp.zeros(D, jnp.float32), "b": jnp.zeros((), jnp.float32)}
  m = A.mean()
  mine = A.Aggregator(m.init, lambda *a: m.aggregate(*a), traits=Traits(name="my_mean", linear=True))
  states = []
  for aggregator in (A.mean()._replace(streaming=None), mine):
    algo = _scaffold(aggregator)
    states.append(algo.step(algo.init(params, KEY), batches))
  for a, b in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- (b) every factory of the library declares its traits ------------------------------------------------------

# Minimal arguments for every public function of the piece modules that returns an `Aggregator`, except the
# combinators (`chain`, `resolve`), whose traits are their pieces' (below).
BUILD = {
    "mean": lambda: A.mean(),
    "weighted_mean": lambda: A.weighted_mean(),
    "marginal_median": lambda: A.marginal_median(),
    "mean_around_median": lambda: A.mean_around_median(1),
    "trimmed_mean": lambda: A.trimmed_mean(0.1),
    "geometric_median": lambda: A.geometric_median(),
    "krum": lambda: A.krum(1),
    "multi_krum": lambda: A.multi_krum(1),
    "bulyan": lambda: A.bulyan(1),
    "centered_clipping": lambda: A.centered_clipping(1.0),
    "majority_vote": lambda: A.majority_vote(),
    "dp_mean": lambda: fo.privacy.dp_mean(0.5, 1.3, expected_clients=4),
    "secure_aggregation": lambda: fo.privacy.secure_aggregation(A.mean(), bound=1.0),
    "corrupt": lambda: fo.attacks.corrupt(A.mean(), fo.attacks.omniscient(1e4), attackers=0.25),
}
COMBINATORS = {"chain", "resolve"}
WANT = {  # (linear, private, secure, robust, attack)
    "mean": (True, False, False, False, False), "weighted_mean": (True, False, False, False, False),
    "majority_vote": (False, False, False, False, False), "dp_mean": (False, True, False, False, False),
    "secure_aggregation": (True, False, True, False, False), "corrupt": (False, False, False, False, True),
    **{rule: (False, False, False, True, False) for rule in ("marginal_median", "mean_around_median", "trimmed_mean",
                                                              "geometric_median", "krum", "multi_krum", "bulyan",
                                                              "centered_clipping")},
}


def _aggregator_factories():
  found = {}
  for module in (fo.aggregators, fo.privacy, fo.attacks, fo.compression):
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isfunction(obj) and "Aggregator" in str(inspect.signature(obj).return_annotation):
        found[name] = obj
  return found


def test_every_aggregator_factory_declares_its_traits():
  factories = _aggregator_factories()
  assert set(factories) - COMBINATORS == set(BUILD), "a new factory needs a row in BUILD and WANT"
  for name, build in BUILD.items():
    aggregator = build()
    traits = aggregator.traits
    assert isinstance(traits, Traits) and traits.name == name, (name, traits)
    got = (traits.linear, traits.private, traits.secure, traits.robust, traits.attack)
    assert got == WANT[name], (name, got)
    assert traits.client_stage is None, name
    # The trait that says "a sum over clients" is the form that sums client by client, declared.
    assert traits.sums == (aggregator.streaming is not None), name


def test_every_aggregator_built_in_the_library_states_its_traits():
  """Every `Aggregator(...)` call in fedjax_opt/ passes `traits=` (grep-able: the AST of each module)."""
  root = pathlib.Path(fo.__file__).parent
  missing = []
  for path in sorted(root.rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
      if not isinstance(node, ast.Call):
        continue
      func = node.func
      called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
      if called != "Aggregator":
        continue
      if any(k.arg == "traits" for k in node.keywords) or len(node.args) >= 6:
        continue
      missing.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
  assert not missing, missing


def test_dp_mean_s_traits_carry_its_sigma_and_clip_norm_when_known_and_never_a_tracer():
  traits = fo.privacy.dp_mean(0.5, 1.3, expected_clients=4).traits
  assert (traits.noise_multiplier, traits.clip_norm) == (1.3, 0.5)
  assert isinstance(traits.noise_multiplier, float) and hash(traits) == hash(dataclasses.replace(traits))
  seen = []

  def traced(sigma):  # a σ swept under jit: not a static number, so not recorded
    aggregator = fo.privacy.dp_mean(0.5, sigma, expected_clients=4)
    seen.append(aggregator.traits)
    return aggregator.init({"w": jnp.zeros(2)}).noise_multiplier

  jax.eval_shape(traced, jnp.float32(1.0))
  assert seen[0].private and seen[0].noise_multiplier is None and seen[0].clip_norm == 0.5


# ---- (c) traits combine: chain, corrupt, secure aggregation ------------------------------------------------------


def test_a_chain_has_its_aggregator_s_traits_and_the_stage_s_name():
  for name, build in BUILD.items():
    if name in ("secure_aggregation", "corrupt"):
      continue
    aggregator = build()
    chained = A.chain(STAGE, aggregator)
    assert chained.traits == dataclasses.replace(aggregator.traits, client_stage=STAGE.name), name
    assert protecting_piece(chained) == protecting_piece(aggregator), name
  assert A.chain(A.mean()).traits == A.mean().traits  # no stage: the aggregator itself
  assert A.chain(STAGE, A.mean()).traits.describe() == f"{STAGE.name} → mean"


def test_wrappers_combine_their_own_traits_with_the_inner_piece_s():
  dp = fo.privacy.dp_mean(0.5, 1.3, expected_clients=4)
  secure_dp = fo.privacy.secure_aggregation(dp, bound=1.0)
  t = secure_dp.traits
  assert (t.name, t.secure, t.private, t.linear, t.noise_multiplier, t.clip_norm) == (
      "secure_aggregation", True, True, False, 1.3, 0.5)
  assert t.inner == dp.traits and t.describe() == "secure_aggregation(dp_mean)"
  secure_mean = fo.privacy.secure_aggregation(A.mean(), bound=1.0).traits
  assert secure_mean.linear and secure_mean.secure and not secure_mean.private  # a secure sum of the mean
  attacked = fo.attacks.corrupt(A.krum(1), fo.attacks.omniscient(1e4), attackers=0.25).traits
  assert (attacked.name, attacked.attack, attacked.robust, attacked.linear) == ("corrupt", True, True, False)
  assert attacked.inner == A.krum(1).traits
  attacked_mean = fo.attacks.corrupt(A.mean(), fo.attacks.sign_flip(), attackers=0.25).traits
  assert attacked_mean.attack and not attacked_mean.linear  # an attack is not a weighted mean of what was sent
  nested = fo.attacks.corrupt(fo.privacy.secure_aggregation(A.mean(), bound=1.0), fo.attacks.sign_flip(),
                              attackers=0.25)
  assert nested.traits.describe() == "corrupt(secure_aggregation(mean))"
  assert (nested.traits.attack, nested.traits.secure, nested.traits.linear) == (True, True, False)
  full = A.chain(STAGE, secure_dp).traits
  assert full.client_stage == STAGE.name and full.private and full.secure
  assert full.describe() == f"{STAGE.name} → secure_aggregation(dp_mean)"
  # The piece each algorithm that keeps a plain sum beside the aggregator is told about: the outermost's.
  assert [protecting_piece(a) for a in (secure_dp, A.chain(STAGE, dp), nested, A.chain(STAGE, A.krum(1)))] == [
      "secure_aggregation", "dp_mean", "attack", "robust"]


def test_unknown_stays_unknown_through_every_combinator():
  m = A.mean()
  custom = A.Aggregator(m.init, m.aggregate, m.streaming)  # positional, as before traits: traits None
  assert custom.traits is None
  for wrapped in (A.chain(STAGE, custom), fo.attacks.corrupt(custom, fo.attacks.sign_flip(), attackers=0.25),
                  fo.privacy.secure_aggregation(custom, bound=1.0)):
    assert wrapped.traits is None and protecting_piece(wrapped) == "unknown"
  assert Traits.wrap(None, name="x", secure=True) is None


def test_bad_traits_are_refused_in_one_line():
  with pytest.raises(TypeError, match=r"Traits: name must be a non-empty string"):
    Traits(name="")
  with pytest.raises(TypeError, match=r"Traits\('x'\): linear must be a bool; got 1"):
    Traits(name="x", linear=1)
  with pytest.raises(ValueError, match=r"noise_multiplier and clip_norm describe a private piece"):
    Traits(name="x", noise_multiplier=1.0)
  with pytest.raises(TypeError, match=r"aggregator.traits must be a fedjax_opt.aggregators.Traits or None; got dict"):
    check_aggregator(A.mean()._replace(traits={"name": "mean"}))
  assert A.Traits is Traits is fo.core.types.Traits


def test_error_messages_name_pieces_by_their_traits():
  with pytest.raises(ValueError, match="chain: mean and krum are both aggregators"):
    A.chain(A.mean(), A.krum(1))
  custom = A.Aggregator(lambda p: (), lambda u, w, s, k: (u, s))
  with pytest.raises(ValueError, match=r"chain: an aggregator without traits \(\S*<lambda>\) and mean are both"):
    A.chain(custom, A.mean())


# ---- (d) shapes: one line naming the leaf and the axis ----------------------------------------------------------


def _shape_cases():
  good = {"a": jnp.ones((3, 2)), "b": {"c": jnp.ones((3,))}}
  short = {"a": jnp.ones((3, 2)), "b": {"c": jnp.ones((2,))}}  # C = 2 on axis 0 where weights say 3
  scalar = {"a": jnp.ones((3, 2)), "b": {"c": jnp.ones(())}}
  return good, short, scalar


CHECKED = {
    "mean": lambda: A.mean(), "weighted_mean": lambda: A.weighted_mean(), "majority_vote": lambda: A.majority_vote(),
    "corrupt": lambda: fo.attacks.corrupt(A.mean(), fo.attacks.sign_flip(), attackers=0.25),
    "marginal_median": lambda: A.marginal_median(), "krum": lambda: A.krum(0),
}


@pytest.mark.parametrize("name", CHECKED)
def test_a_misstacked_update_or_weight_is_named_by_leaf_and_axis_in_one_line(name):
  aggregator = CHECKED[name]()
  good, short, scalar = _shape_cases()
  state = aggregator.init(jax.tree.map(lambda u: u[0], good))
  weights = jnp.ones(3)
  cases = [(short, weights, r"updates\['b'\]\['c'\] has 2 rows on axis 0 \(shape \(2,\)\)"),
           (scalar, weights, r"updates\['b'\]\['c'\] has no axis 0 \(shape \(\)\)"),
           (good, jnp.ones((3, 1)), r"weights must have shape \[C\] \(one weight per client, on axis 0\); got shape "
                                    r"\(3, 1\)")]
  for updates, w, pattern in cases:
    for run in (lambda u, w: aggregator.aggregate(u, w, state, KEY),
                jax.jit(lambda u, w: aggregator.aggregate(u, w, state, KEY))):  # at trace time, under jit too
      with pytest.raises(ValueError, match=pattern) as raised:
        run(updates, w)
      message = str(raised.value)
      assert message.startswith(f"{name}: ") and "\n" not in message, message
      if "rows" in pattern or "no axis" in pattern:
        assert "every leaf of updates must be stacked [C, ...] with C = 3 (the length of weights) on axis 0" in message


def test_the_round_s_guard_names_the_aggregator_and_the_leaf():
  _, short, _ = _shape_cases()
  with pytest.raises(ValueError, match=r"^krum: every leaf .* updates\['b'\]\['c'\] has 2 rows on axis 0"):
    aggregate_updates(A.krum(0), short, jnp.ones(3), (), KEY)
  custom = A.Aggregator(lambda p: (), lambda u, w, s, k: (u, s))
  with pytest.raises(ValueError, match=r"^an aggregator without traits \(\S*<lambda>\): every leaf"):
    aggregate_updates(custom, short, jnp.ones(3), (), KEY)


# ---- the accountant never assumes privacy: a dp_mean state needs a piece declared private -------------------------


def _fedavg(aggregator):
  return fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), aggregator=aggregator)


def _ifca(aggregator):  # a clustered algorithm: the aggregator's state is made once per cluster (slots)
  return fo.algorithms.ifca(lsq_loss, num_clusters=2, num_clients=N, client_optimizer=optax.sgd(0.1),
                              aggregator=aggregator)


def _init_refusal(factory, aggregator):
  with pytest.raises(ValueError) as raised:
    factory(aggregator).init({"w": jnp.zeros(D), "b": jnp.zeros(())}, KEY)
  message = str(raised.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("factory", [_fedavg, _ifca])
@pytest.mark.parametrize("disguise", ["lambda", "partial"])
def test_a_dp_mean_state_behind_an_undeclared_aggregate_is_refused_before_anything_is_accounted(factory, disguise):
  """Before: `fo.train` found DP by the state's type and reported ε for a hand-made `Aggregator(dp.init, other)`
  whose aggregate nothing said was private. Now the state and the declared traits must agree at init."""
  _, disguised = _disguised_dp()
  message = _init_refusal(factory, disguised[disguise])
  assert "DPMeanState" in message and "declares no traits" in message and "private=True" in message, message


def test_a_dp_mean_state_under_a_piece_declared_not_private_is_refused():
  dp = fo.privacy.dp_mean(1.0, 1.1, expected_clients=3)
  liar = A.Aggregator(dp.init, dp.aggregate, dp.streaming, True, traits=Traits(name="my_mean", linear=True))
  message = _init_refusal(_fedavg, liar)
  assert "my_mean" in message and "declares itself not private" in message, message


def test_a_piece_declared_private_must_keep_the_state_an_accountant_reads():
  plain = A.mean()
  claims = A.Aggregator(plain.init, plain.aggregate, traits=Traits(name="my_dp", private=True, noise_multiplier=1.0))
  message = _init_refusal(_fedavg, claims)
  assert "my_dp" in message and "holds no fo.privacy.DPMeanState" in message, message


def test_a_declared_sigma_must_be_the_sigma_of_the_noise_added():
  dp = fo.privacy.dp_mean(1.0, 1.1, expected_clients=3)
  wrong = A.Aggregator(dp.init, dp.aggregate, dp.streaming, True,
                       traits=Traits(name="my_dp", private=True, noise_multiplier=2.0, clip_norm=1.0))
  message = _init_refusal(_fedavg, wrong)
  assert "σ = 2" in message and "σ = 1.1" in message, message


def test_a_hand_made_piece_declared_private_is_accounted_by_its_own_sigma():
  """Declared, the same functions run and are accounted: ε from `fo.train` is dp-accounting's RDP ε of m-of-N
  rounds with the state's float32 σ (replace-one neighbours: noise σ/2 per unit sensitivity), computed here directly."""
  import dp_accounting
  n, m, sigma, delta, rounds = 50, 5, 1.3, 1e-5, 3
  dp = fo.privacy.dp_mean(1.0, sigma, expected_clients=m)
  declared = A.Aggregator(dp.init, lambda *a, **k: dp.aggregate(*a, **k), dp.streaming, True,
                          traits=Traits(name="my_dp", private=True, noise_multiplier=sigma, clip_norm=1.0))
  rng = np.random.default_rng(0)
  data = fo.data.pack([{"x": rng.normal(size=(2, D)).astype(np.float32), "y": rng.normal(size=2).astype(np.float32)}
                       for _ in range(n)])
  algo = _fedavg(declared)
  _, history = fo.train(algo, algo.init({"w": jnp.zeros(D), "b": jnp.zeros(())}, KEY), data, rounds,
                        fo.Sampling(clients_per_round=m, local_steps=1, batch_size=2),
                        evaluation=fo.Evaluation(every=rounds), progress=False, check_memory=False,
                        accounting=fo.Accounting(delta=delta))
  accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  noise = float(np.float32(sigma))  # the σ the state keeps and the noise is drawn with, float32
  event = dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(noise / 2))
  accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
  np.testing.assert_allclose(history.eval_series("dp_epsilon")[1], [accountant.get_epsilon(delta)], rtol=1e-9)


def test_majority_vote_is_declared_a_sum_so_a_secure_sum_of_votes_composes_from_traits():
  """signSGD's vote is the sign of a sum of signs: not linear, but a sum over clients (`Traits.sums`), so the
  composition rules (traits only) let `secure_aggregation` wrap it, as its constructor does; the vote from the
  secure sum equals NumPy's sign(Σ_c sign(Δ_c)) on the weighted clients."""
  vote = A.majority_vote()
  assert vote.traits.sums and not vote.traits.linear
  assert fo.aggregators.composition._is_sum(vote.traits)  # pylint: disable=protected-access
  secure = fo.privacy.secure_aggregation(vote, bound=2.0)
  assert secure.traits.secure and not secure.traits.sums
  rng = np.random.default_rng(0)
  updates = {"w": rng.normal(size=(5, 7)).astype(np.float32)}
  weights = np.array([1.0, 1.0, 0.0, 1.0, 1.0], np.float32)
  out, _ = jax.jit(secure.aggregate)(updates, jnp.asarray(weights), secure.init({"w": jnp.zeros(7)}), KEY)
  votes = np.sign(updates["w"]) + (updates["w"] == 0)  # a 1-bit code has no zero: sgn(0) = +1
  want = np.sign((weights[:, None] * votes).sum(0))
  np.testing.assert_array_equal(np.sign(np.asarray(out["w"])), want)
