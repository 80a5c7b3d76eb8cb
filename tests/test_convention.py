"""Every factory in `fo.algorithms` follows the factory convention of docs/algorithms.md.

    name(loss_fn, <the paper's hyper-parameters, by symbol>, *, <everything else>) -> FederatedAlgorithm

The test walks `fo.algorithms`: every public function must be listed either as a
factory (with a small example call) or as a helper, so a new family cannot
arrive without being checked. For every factory it checks the parameter kinds
and names, that it returns a `FederatedAlgorithm`, that `step` keeps the state's
structure and dtypes (so it drops into `lax.scan`), and that
`fo.personalized_params` reads the per-client models of exactly the states
that keep them. The execution policy's keywords (`client_map=`, and
`storage_dtype=` where a factory keeps per-client tables) come to every
factory from one decorator, `core.execution.accepts_policy_keywords`, never
from the factory's own signature, and give the step the policy gives. The
same decorator holds each factory's declaration of how it treats
`aggregator=` (`factory.aggregation`): every factory either takes one, its
documented default giving the same round as no keyword, or names why it
takes none and refuses any in one line that says so.
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from algorithm_examples import EXAMPLES, N, example_inputs
from conftest import fedavg_lsq_np, make_clients, pack

SHARED_KEYWORDS = {
    "num_clients", "local_steps", "client_optimizer", "server_optimizer", "aggregator", "client_map",
    "storage_dtype", "graph",
}
"""One name per concept (docs/algorithms.md, "The factory convention")."""

POLICY_KEYWORDS = ("client_map", "storage_dtype")
"""The execution policy's keywords: `core.execution.accepts_policy_keywords` gives them to factories, which never
declare them themselves."""

HOST_DRIVEN = {"fedma"}
"""Helpers that build an algorithm (not a `FederatedAlgorithm`) and take the policy's keywords too."""

SYNONYMS = {
    "local_optimizer": "client_optimizer", "optimizer": "client_optimizer", "client_opt": "client_optimizer",
    "inner_optimizer": "client_optimizer", "server_opt": "server_optimizer", "n_clients": "num_clients",
    "num_workers": "num_clients", "num_nodes": "num_clients", "clients": "num_clients", "agg": "aggregator",
    "aggregation": "aggregator", "mode": "client_map", "dtype": "storage_dtype", "table_dtype": "storage_dtype",
    "steps": "local_steps", "num_local_steps": "local_steps", "num_steps": "local_steps",
    "unroll": "a flag of the client_map mode (e.g. 'sequential:unroll')",
    "client_lr": "the paper's symbol (eta, eta_l ...)", "server_lr": "the paper's symbol (eta_g ...)",
    "lr": "the paper's symbol (eta ...)", "step_size": "the paper's symbol (alpha, eta ...)",
    "learning_rate": "the paper's symbol (eta ...)",
    "mixing": "graph", "edge_weights": "graph", "mixing_matrix": "graph", "topology": "graph",
}
"""Names that must not appear: the concept already has a name."""

PAPER_SYMBOLS = {"mu", "alpha", "beta", "lam", "rho", "eta", "eta_l", "eta_g", "p", "delta", "tau0", "xi", "gamma",
                 "eps"}
"""The positional hyper-parameters: a paper's symbols spelled in ASCII."""

NO_LOSS_FN = {"admm_sharing", "cocoa"}
"""Factories whose loss is built in (named by `loss=`): sharing ADMM solves its loss's prox at the server, CoCoA+
needs its loss's convex conjugate."""

HELPERS = {
    "hessian_vector_product", "meta_gradient", "l2gd_max_step_size", "l2sgd_plus_step_size", "optimal_p",
    "laplacian_penalty", "prox_least_squares", "prox_quadratic", "stochastic_quantize", "personalized_params",
    "consensus_distance", "fedem_client_params", "fedem_mixture_model", "fedem_responsibilities",
    "fedmd_client_params", "cocoa_model", "hinge_optimum",
    # matched averaging: host-driven, growing widths, not FederatedAlgorithm factories
    "fedma", "pfnm", "bbp_map", "fedma_model",
}
"""Public functions of `fo.algorithms` that are not factories."""

WITH_LOCAL_MODELS = {"ditto", "pfedme", "easgd", "fedu", "l2gd", "l2sgd", "l2sgd_plus", "mixture_admm",
                     "admm_consensus", "gadmm", "cq_ggadmm", "gossip", "dpsgd", "gradient_tracking", "p2p_bayes",
                     "d_fedem", "fedmd", "ifca", "clustered_fl"}
WITH_PERSONALIZE = {"per_fedavg", "fedavg_finetune", "fedem"}
TABLES = {"scaffold": "client_control_variates", "feddyn": "client_gradients", "ditto": "local_params",
          "pfedme": "local_params", "easgd": "local_params", "fedu": "local_params"}
"""The per-client tables that `storage_dtype` sets, for every factory that takes it."""


def _public_functions():
  members = {name: getattr(fo.algorithms, name) for name in dir(fo.algorithms)}  # loads the lazy names too
  return {name: obj for name, obj in members.items() if not name.startswith("_") and inspect.isfunction(obj)}


def test_every_public_function_is_a_listed_factory_or_helper():
  names = set(_public_functions())
  unlisted = names - set(EXAMPLES) - HELPERS
  assert not unlisted, (f"{sorted(unlisted)}: add each new factory to EXAMPLES (it is then checked against the "
                        "convention) or, if it is not a factory, to HELPERS")
  assert not (set(EXAMPLES) | HELPERS) - names, "listed names that fo.algorithms no longer has"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_signature_follows_the_convention(name):
  params = inspect.signature(getattr(fo.algorithms, name)).parameters
  kinds = {p.kind for p in params.values()}
  assert inspect.Parameter.VAR_POSITIONAL not in kinds and inspect.Parameter.VAR_KEYWORD not in kinds
  positional = [p.name for p in params.values() if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
  keyword_only = [p.name for p in params.values() if p.kind == inspect.Parameter.KEYWORD_ONLY]
  if name not in NO_LOSS_FN:
    assert positional[:1] == ["loss_fn"], f"{name}: the first parameter must be loss_fn"
    positional = positional[1:]
  assert set(positional) <= PAPER_SYMBOLS, (
      f"{name}: positional parameters must be the paper's symbols {sorted(PAPER_SYMBOLS)}; "
      f"make {sorted(set(positional) - PAPER_SYMBOLS)} keyword-only")
  for kw in params:
    assert kw not in SYNONYMS, f"{name}: parameter {kw!r} is spelled {SYNONYMS[kw]!r} in this library"
  assert not set(positional) & SHARED_KEYWORDS
  if "num_clients" in params:
    assert params["num_clients"].kind == inspect.Parameter.KEYWORD_ONLY


def test_the_communication_graph_is_named_graph_everywhere():
  """Factories and helpers alike: the graph (with its mixing rule and edge weights) is one `graph=` argument."""
  for name, fn in _public_functions().items():
    old = {p for p, v in SYNONYMS.items() if v == "graph"} & set(inspect.signature(fn).parameters)
    assert not old, f"{name}: {sorted(old)} is spelled 'graph' in this library (fo.graphs.Graph or a mixing matrix)"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_factory_returns_a_federated_algorithm_whose_step_keeps_the_state_shape(name):
  algorithm = EXAMPLES[name]()
  assert type(algorithm) is fo.FederatedAlgorithm  # pylint: disable=unidiomatic-typecheck
  assert (algorithm.personalize is not None) == (name in WITH_PERSONALIZE)
  params, batches = example_inputs(name)
  key = jax.random.key(0)
  state = algorithm.init(params, key)
  # The state contract: `round` an int32 counter from 0, `key` the PRNG key given to `init`.
  assert state.round.dtype == jnp.int32 and int(state.round) == 0
  assert jnp.array_equal(jax.random.key_data(state.key), jax.random.key_data(key))
  after = jax.eval_shape(algorithm.step, state, batches)
  before = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), state)
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype), name
  assert isinstance(state.metrics, dict) and set(state.metrics) == set(after.metrics)
  if name in WITH_LOCAL_MODELS:
    table = fo.personalized_params(state)
    assert all(leaf.shape[0] == N for leaf in jax.tree.leaves(table))
    one = fo.personalized_params(state, 1)
    assert jax.tree.structure(one) == jax.tree.structure(state.params)  # a client's model is like the global one
  else:
    with pytest.raises(TypeError, match="keeps no per-client models"):
      fo.personalized_params(state)
  if name in WITH_PERSONALIZE:
    adapted = algorithm.personalize(state.params, jax.tree.map(lambda a: a[0], batches.data), batches.mask[0])
    assert jax.tree.structure(adapted) == jax.tree.structure(state.params)


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) | HOST_DRIVEN))
def test_the_policy_keywords_come_from_the_one_decorator_not_the_factory(name):
  """`inspect.signature` shows the factory's own parameters, then the policy's keywords (keyword-only, None);
  the function the decorator wraps declares none of them, and is applied by a call after the definition, not
  with `@` (mutmut leaves decorated functions unmutated: tools/mutation.py would find no mutant in the update
  rule)."""
  factory = getattr(fo.algorithms, name)
  assert inspect.getsource(factory.__wrapped__).startswith("def "), (
      f"{name}: apply the decorator as `{name} = execution.accepts_policy_keywords({name})`, not with @")
  expected = POLICY_KEYWORDS if name in TABLES else POLICY_KEYWORDS[:1]
  own = inspect.signature(factory.__wrapped__).parameters
  assert not set(POLICY_KEYWORDS) & set(own), f"{name} declares {sorted(set(POLICY_KEYWORDS) & set(own))} itself"
  assert factory.__wrapped__.__module__ == factory.__module__ and not hasattr(factory.__wrapped__, "__wrapped__")
  params = inspect.signature(factory).parameters
  assert list(params) == [*own, *expected]
  for keyword in expected:
    assert params[keyword].kind == inspect.Parameter.KEYWORD_ONLY and params[keyword].default is None
    assert f"    {keyword}: " in factory.__doc__  # the decorator documents what it adds


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_policy_keyword_gives_the_step_and_state_the_policy_gives(name):
  """`factory(client_map=m, storage_dtype=d)` traced inside a contrary policy is the factory's plain algorithm
  traced inside `fo.execution(client_map=m, storage_dtype=d)`: the same initial state's shapes and dtypes, and the
  same program (jaxpr) for the step, so bit-identical rounds."""
  tables = {"storage_dtype": jnp.bfloat16} if name in TABLES else {}
  keyworded, plain = EXAMPLES[name](client_map="sequential", **tables), EXAMPLES[name]()
  assert type(keyworded) is type(plain)  # pylint: disable=unidiomatic-typecheck
  assert (keyworded.personalize is None) == (plain.personalize is None)
  params, batches = example_inputs(name)
  key = jax.random.key(0)
  with fo.execution(client_map="vmap", storage_dtype=jnp.float32 if tables else None):  # overridden
    state = jax.eval_shape(keyworded.init, params, key)
    program = jax.make_jaxpr(keyworded.step)(state, batches)
  with fo.execution(client_map="sequential", **tables):
    want_state = jax.eval_shape(plain.init, params, key)
    want = jax.make_jaxpr(plain.step)(want_state, batches)
  assert state == want_state
  assert str(program) == str(want)
  if tables:
    assert {leaf.dtype for leaf in jax.tree.leaves(getattr(state, TABLES[name]))} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_storage_dtype_sets_the_per_client_table_and_nothing_else(name):
  assert "storage_dtype" in inspect.signature(getattr(fo.algorithms, name)).parameters
  algorithm = EXAMPLES[name](storage_dtype=jnp.bfloat16)
  params, batches = example_inputs(name)
  state = algorithm.init(params, jax.random.key(0))
  for s in (state, jax.eval_shape(algorithm.step, state, batches)):
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(getattr(s, TABLES[name])))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(s.params))


def test_every_factory_with_a_per_client_table_takes_storage_dtype():
  takes = {name for name in EXAMPLES if "storage_dtype" in inspect.signature(getattr(fo.algorithms, name)).parameters}
  assert takes == set(TABLES)


DEFAULT_FLOAT_STATE = {
    ".clock.": "the simulated wall clock (core.asynchrony) keeps event times in the default float, float64 under "
               "x64, so that a long simulation's times stay exact",
    ".log_beliefs": "P2P Bayes's beliefs over its K hypotheses are in the default float, not the model's",
}
"""State that is deliberately in JAX's default float, not the model's dtype: path fragment -> why."""


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_float32_model_keeps_a_float32_state_under_x64(name):
  """With `jax_enable_x64` on (as a user may set it for other work), a float32 model with Python-float
  hyper-parameters gets no 64-bit leaf in its state (outside `DEFAULT_FLOAT_STATE`), at `init` or after a
  `step`: no silent doubling of the memory, no float64 arithmetic (slow on accelerators) in the round."""
  with jax.enable_x64(True):
    algorithm = EXAMPLES[name]()
    params, batches = example_inputs(name)
    # Traced, not run: the dtypes are the same (JAX's promotion rules do not depend on tracing), and op-by-op
    # `init`s under x64 would compile a program per operation and shape.
    state = jax.eval_shape(algorithm.init, params, jax.random.key(0))
    after = jax.eval_shape(algorithm.step, state, batches)
    for label, tree in (("init", state), ("step", after)):
      wide = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
              if jnp.result_type(leaf) in (jnp.float64, jnp.int64, jnp.complex128)
              and not any(part in jax.tree_util.keystr(path) + "." for part in DEFAULT_FLOAT_STATE)]
      assert not wide, f"{name} {label}: 64-bit leaves {wide}"


TAKES_AGGREGATOR = {"fedavg", "fedsgd", "fedprox", "fednova", "scaffold", "feddyn", "ditto", "pfedme", "per_fedavg",
                    "fedavg_finetune", "fedem", "ifca", "clustered_fl", "one_shot_average"}
"""The factories that take `aggregator=`; every other one declares why it takes none (`refuses_aggregator=`)."""


def _documented_default(factory) -> str:
  """The default aggregator a factory's docstring names ("aggregator: ... default `aggregators.X()`")."""
  found = re.search(r"\n\s*aggregator:.*?[Dd]efault\s+`aggregators\.(\w+)\(\)`", inspect.getdoc(factory), flags=re.S)
  assert found, "the aggregator's paragraph must name its default, `aggregators.X()`"
  return found.group(1)


def _same_round(built, plain, name):
  """`built` and `plain` give the same initial state and trace the same step program (so bit-identical rounds)."""
  params, batches = example_inputs(name)
  key = jax.random.key(0)
  state, want = built.init(params, key), plain.init(params, key)
  assert jax.tree.structure(state) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert str(jax.make_jaxpr(built.step)(state, batches)) == str(jax.make_jaxpr(plain.step)(want, batches))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_factory_takes_an_aggregator_or_declares_why_it_takes_none(name):
  """All factories: `factory.aggregation` is `TAKES_AGGREGATOR` exactly when the signature has `aggregator` (keyword-
  only, default None, and the documented default given explicitly is the same algorithm), or else a one-line
  reason, in the docstring, with which `aggregator=fo.aggregators.mean()` is refused in one line naming the
  factory (and `aggregator=None` is the factory as it is)."""
  factory = getattr(fo.algorithms, name)
  params = inspect.signature(factory).parameters
  if name in TAKES_AGGREGATOR:
    assert factory.aggregation == fo.core.execution.TAKES_AGGREGATOR
    assert params["aggregator"].kind == inspect.Parameter.KEYWORD_ONLY and params["aggregator"].default is None
    default = getattr(fo.aggregators, _documented_default(factory))()
    _same_round(EXAMPLES[name](aggregator=default), EXAMPLES[name](), name)
    return
  assert factory.default_aggregator is None
  reason = factory.aggregation
  assert isinstance(reason, str) and reason.strip() and "\n" not in reason
  assert reason != fo.core.execution.TAKES_AGGREGATOR and "aggregator" not in params
  assert reason in factory.__doc__
  with pytest.raises(ValueError) as caught:
    EXAMPLES[name](aggregator=fo.aggregators.mean())
  message = str(caught.value)
  assert "\n" not in message and message == f"{name} takes no aggregator= (got mean): {reason}"
  _same_round(EXAMPLES[name](aggregator=None), EXAMPLES[name](), name)


@pytest.mark.parametrize("name", sorted(TAKES_AGGREGATOR))
def test_the_default_aggregator_is_declared_data_and_is_the_factory_s_default(name):
  """`factory.default_aggregator` (`core.execution.accepts_policy_keywords(..., default_aggregator=...)`), the one
  source of the default: it builds the rule the docstring names, and given explicitly it is the factory's default
  algorithm (the same initial state and step program)."""
  factory = getattr(fo.algorithms, name)
  assert callable(factory.default_aggregator)
  built = factory.default_aggregator()
  assert built.traits.name == _documented_default(factory)
  _same_round(EXAMPLES[name](aggregator=factory.default_aggregator()), EXAMPLES[name](), name)


def test_the_aggregation_of_every_factory_is_declared():
  """The 39 factories of EXAMPLES and the host-driven ones: each declares, as data, how it treats `aggregator=`."""
  declared = {name: getattr(fo.algorithms, name).aggregation for name in sorted(set(EXAMPLES) | HOST_DRIVEN)}
  takes = {name for name, value in declared.items() if value == fo.core.execution.TAKES_AGGREGATOR}
  assert takes == TAKES_AGGREGATOR
  assert all(isinstance(value, str) and value for value in declared.values())
  with pytest.raises(ValueError, match="^fedma takes no aggregator= \\(got weighted_mean\\): FedMA matches"):
    fo.algorithms.fedma(lambda p, b: b, layers=("hidden_0", "output"), client_optimizer=optax.sgd(0.1),
                        num_clients=2, aggregator=fo.aggregators.weighted_mean())


@pytest.mark.parametrize("name", ["fedavg", "fedsgd"])
def test_an_explicit_weighted_mean_is_the_float64_fedavg_round(name):
  """`aggregator=fo.aggregators.weighted_mean()` given explicitly: the first round is the float64 NumPy FedAvg round
  (FedSGD: one full-batch step of size η), on clients of unequal sizes (so the weights matter)."""
  rng = np.random.default_rng(7)
  steps, batch = 2, 3
  clients = make_clients(rng, [3, 5, 6, 2], 3)
  batches = pack(clients, steps, batch)
  params = {"w": jnp.asarray(rng.normal(size=3), jnp.float32), "b": jnp.asarray(0.5, jnp.float32)}
  algorithm = EXAMPLES[name](aggregator=fo.aggregators.weighted_mean())
  state = jax.jit(algorithm.step)(algorithm.init(params, jax.random.key(0)), batches)
  x, y, mask = (np.asarray(batches.data["x"]), np.asarray(batches.data["y"]), np.asarray(batches.mask))
  if name == "fedsgd":  # every example of the round in one step
    x, y, mask = x.reshape(4, 1, -1, 3), y.reshape(4, 1, -1), mask.reshape(4, 1, -1)
  w, b = fedavg_lsq_np(params["w"], params["b"], x, y, mask, np.asarray(batches.weight), 0.01)
  np.testing.assert_allclose(np.asarray(state.params["w"]), w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(state.params["b"]), b, rtol=1e-5, atol=1e-6)


TAKES_DOWNLINK = {"fedavg", "fedsgd", "fedprox", "fednova", "ditto", "pfedme", "per_fedavg", "fedavg_finetune"}
"""The factories whose server step applies a downlink chained in `aggregator=` (one broadcast model moved by an
optimizer step: `core.averaging.server_step`); every other factory that takes `aggregator=` declares why not."""


def _with_downlink(name, k=1):
  factory = getattr(fo.algorithms, name)
  down = fo.compression.downlink(fo.compression.top_k(k=k), error_feedback=True)
  return fo.aggregators.chain(factory.default_aggregator(), down), down


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_factory_applies_a_chained_downlink_or_declares_why_not(name):
  """`factory.downlink` is declared data. A factory that takes it compresses its broadcast with the chained
  downlink, checked on one round against the same factory without it: the clients train from the same x_0, so
  the uncompressed step u_0 is the same, and with top-1 and error feedback the model every client holds moves by
  one coordinate of u_0 (x̂_1 − x_0 = m_0, one entry, the largest |u_0|), the error keeps the rest (x̂_1 + e_1 =
  x_0 + u_0, the plain run's model) and `bits_down` is the compressor's count, not 32 P. A factory that takes
  an aggregator but cannot apply a downlink refuses it in one line naming the factory and its declared reason;
  a factory that takes no aggregator declares its aggregation reason (nothing to chain a downlink to)."""
  factory = getattr(fo.algorithms, name)
  if name not in TAKES_AGGREGATOR:
    assert factory.downlink == factory.aggregation
    return
  aggregator, down = _with_downlink(name)
  if name not in TAKES_DOWNLINK:
    reason = factory.downlink
    assert reason != fo.core.execution.TAKES_DOWNLINK and "\n" not in reason and reason in factory.__doc__
    with pytest.raises(ValueError) as caught:
      EXAMPLES[name](aggregator=aggregator)
    assert str(caught.value) == f"{name} takes no downlink (got {down.name} chained in aggregator=): {reason}"
    return
  assert factory.downlink == fo.core.execution.TAKES_DOWNLINK
  params, batches = example_inputs(name)
  key = jax.random.key(0)
  compressed, plain = EXAMPLES[name](aggregator=aggregator), EXAMPLES[name]()
  start = compressed.init(params, key)
  x0 = np.concatenate([np.ravel(v) for v in jax.tree.leaves(start.params)]).astype(np.float64)
  assert np.all(np.concatenate([np.ravel(e) for e in jax.tree.leaves(start.downlink_error)]) == 0)
  one, want = jax.jit(compressed.step)(start, batches), jax.jit(plain.step)(plain.init(params, key), batches)
  flat = lambda tree: np.concatenate([np.ravel(v) for v in jax.tree.leaves(tree)]).astype(np.float64)
  x1, e1, u0 = flat(one.params), flat(one.downlink_error), flat(want.params) - x0
  moved = np.flatnonzero(x1 != x0)
  assert moved.size == 1 and moved[0] == np.argmax(np.abs(u0)), (moved, u0)
  np.testing.assert_allclose(x1 + e1, x0 + u0, rtol=1e-6, atol=1e-6)
  _, bits = fo.compression.top_k(k=1).compress(key, start.params)
  assert float(one.metrics["bits_down"]) == float(bits) < 32 * x0.size
