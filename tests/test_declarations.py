"""Every factory describes itself, as data (`core.execution.accepts_policy_keywords`), and the command line reads it.

`factory.evaluation` (what its state offers to evaluate), `factory.exchanges` (what one round sends) and
`factory.hyperparameters` (the role of each hyper-parameter, from `HYPERPARAMETER_ROLES`) are declared by every
factory of `fo.algorithms`; a bad declaration is a one-line TypeError when the decorator is applied; the
command line's `Spec` holds no copy of them (`evaluation`, `messages`, `communication`, `server_lr` are read from
the factory); and each declared evaluation is true of the factory's state.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import pytest

import fedjax_opt as fo
from algorithm_examples import EXAMPLES, N, example_inputs
from fedjax_opt.cli import registry
from fedjax_opt.core import execution

HOST_DRIVEN = {"fedma"}
"""Factories that build an algorithm that is not a `FederatedAlgorithm` (matched averaging), declared all the same."""

FACTORIES = sorted(set(EXAMPLES) | HOST_DRIVEN)

EXCHANGE_METRICS = {"metrics": {"bits_up", "bits_down"}, "bits": {"bits"}, "bytes": {"bytes_sent"}}
"""The round metrics an algorithm that declares `exchanges=` one of `REPORTED_EXCHANGES` reports them in."""


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_every_factory_is_walked():
  declared = {name for name in dir(fo.algorithms) if hasattr(getattr(fo.algorithms, name), "aggregation")}
  assert declared == set(FACTORIES)


@pytest.mark.parametrize("name", FACTORIES)
def test_every_factory_declares_evaluation_exchanges_and_hyperparameter_roles(name):
  factory = getattr(fo.algorithms, name)
  assert factory.evaluation in execution.EVALUATIONS, name
  exchanges = factory.exchanges
  assert exchanges in execution.REPORTED_EXCHANGES or (
      isinstance(exchanges, tuple) and len(exchanges) == 2 and all(_is_number(n) and n >= 0 for n in exchanges)), name
  params = inspect.signature(factory).parameters
  roles = factory.hyperparameters
  assert set(roles) <= set(params) and set(roles.values()) <= set(execution.HYPERPARAMETER_ROLES), name
  # Every parameter whose default is a number is a hyper-parameter with a declared role.
  numeric = {p for p, v in params.items() if _is_number(v.default)}
  assert numeric <= set(roles), f"{name}: declare the role of {sorted(numeric - set(roles))}"
  # The optimizers are named for what they step.
  for p in params:
    if p.endswith("client_optimizer"):
      assert roles.get(p) == execution.CLIENT_OPTIMIZER, (name, p)
    if p.endswith("server_optimizer"):
      assert roles.get(p) == execution.SERVER_OPTIMIZER, (name, p)
  assert sum(role == execution.SERVER_STEP_SIZE for role in roles.values()) <= 1
  with pytest.raises(TypeError):
    roles["x"] = execution.COUNT  # read-only: the declaration is the factory's


def _toy(loss_fn, eta, *, num_clients=2):
  """A toy factory."""
  del loss_fn, eta, num_clients


@pytest.mark.parametrize("keywords, message", [
    (dict(evaluation="personal"), "evaluation must be one of 'global', 'table', 'adapt'; got 'personal'"),
    (dict(exchanges=(1,)), "exchanges must be (uploads, broadcasts)"),
    (dict(exchanges=(1, -1)), "exchanges must be (uploads, broadcasts)"),
    (dict(exchanges=(True, 1)), "exchanges must be (uploads, broadcasts)"),
    (dict(exchanges="packets"), "exchanges must be (uploads, broadcasts)"),
    (dict(hyperparameters={"lr": execution.CLIENT_STEP_SIZE}), "hyperparameters names 'lr', which is not a parameter"),
    (dict(hyperparameters={"eta": "learning rate"}), "hyperparameters['eta'] = 'learning rate' is not a role"),
    (dict(hyperparameters={"eta": execution.SERVER_STEP_SIZE, "num_clients": execution.SERVER_STEP_SIZE}),
     "eta, num_clients are each declared the server step size"),
    (dict(hyperparameters=[("eta", execution.CLIENT_STEP_SIZE)]), "hyperparameters must be a mapping"),
])
def test_a_bad_declaration_is_a_one_line_type_error_at_decoration(keywords, message):
  with pytest.raises(TypeError) as caught:
    execution.accepts_policy_keywords(_toy, refuses_aggregator="a toy", **keywords)
  text = str(caught.value)
  assert "\n" not in text and text.startswith("accepts_policy_keywords: _toy: ") and message in text, text


def test_a_good_declaration_is_data_on_the_factory():
  toy = execution.accepts_policy_keywords(_toy, refuses_aggregator="a toy", evaluation="table", exchanges=(2, 1),
                                          hyperparameters={"eta": execution.CLIENT_STEP_SIZE})
  assert (toy.evaluation, toy.exchanges, dict(toy.hyperparameters)) == ("table", (2, 1), {"eta": "client step size"})
  bare = execution.accepts_policy_keywords(_toy, refuses_aggregator="a toy")  # each declaration optional here
  assert (bare.evaluation, bare.exchanges, dict(bare.hyperparameters)) == (None, None, {})


def test_the_command_line_keeps_no_copy_of_the_declarations():
  fields = {f.name for f in dataclasses.fields(registry.Spec)}
  assert not fields & {"evaluation", "messages", "communication", "server_lr"}


@pytest.mark.parametrize("name", list(registry.REGISTRY))
def test_each_cli_entry_reads_its_factory_s_declarations(name):
  spec = registry.REGISTRY[name]
  library = getattr(fo.algorithms, spec.factory.__name__)  # the library's factory (the CLI's CoCoA+ wraps it)
  for what in execution.DECLARATIONS:
    assert getattr(spec.factory, what) == getattr(library, what), (name, what)
  assert spec.evaluation == library.evaluation
  if isinstance(library.exchanges, tuple):
    assert (spec.communication, spec.messages) == ("rounds", library.exchanges)
  else:
    assert spec.communication == library.exchanges
  roles = library.hyperparameters
  servers = [p for p, role in roles.items() if role == execution.SERVER_STEP_SIZE]
  if servers:
    assert spec.server_lr == servers[0] and spec.server_lr in spec.defaults
  elif "server_lr" in spec.defaults:  # the PSEUDO server_lr builds the declared server optimizer
    assert spec.server_lr == "server_lr" and execution.SERVER_OPTIMIZER in roles.values()
  else:
    assert spec.server_lr is None


def test_the_declarations_the_command_line_shows():
  """A few entries pinned: SCAFFOLD's two vectors each way and η_g, Zeno++'s γ, FedU's uploads without broadcast."""
  got = {name: (registry.REGISTRY[name].evaluation, registry.REGISTRY[name].messages,
                registry.REGISTRY[name].communication, registry.REGISTRY[name].server_lr)
         for name in ("fedavg", "fedadam", "scaffold", "zeno_plus_plus", "fedu", "ditto", "per_fedavg", "gossip",
                      "cq_ggadmm", "ifca", "feddyn", "pfedme")}
  assert got == {
      "fedavg": ("global", (1, 1), "rounds", "server_lr"), "fedadam": ("global", (1, 1), "rounds", "server_lr"),
      "scaffold": ("global", (2, 2), "rounds", "eta_g"), "zeno_plus_plus": ("global", (1, 1), "rounds", "gamma"),
      "fedu": ("table", (1, 0), "rounds", None), "ditto": ("table", (1, 1), "rounds", "server_lr"),
      "per_fedavg": ("adapt", (1, 1), "rounds", None), "gossip": ("table", (1, 1), "bytes", None),
      "cq_ggadmm": ("global", (1, 1), "bits", None), "ifca": ("table", (1, 1), "metrics", "server_lr"),
      "feddyn": ("global", (1, 1), "rounds", None), "pfedme": ("table", (1, 1), "rounds", None),
  }


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_declared_evaluation_and_reported_exchanges_are_true_of_the_state(name):
  """"table": `fo.personalized_params(state)` is a table of N rows, each like `state.params`; "adapt":
  `algorithm.personalize` adapts the global model on a client; "global": `state.params`. An algorithm whose
  exchanges are reported reports them in its metrics."""
  factory = getattr(fo.algorithms, name)
  algorithm = EXAMPLES[name]()
  params, batches = example_inputs(name)
  state = algorithm.init(params, jax.random.key(0))
  assert hasattr(state, "params"), name
  if factory.evaluation == "table":
    table = fo.personalized_params(state)
    assert all(leaf.shape[0] == N for leaf in jax.tree.leaves(table)), name
    assert jax.tree.structure(fo.personalized_params(state, 0)) == jax.tree.structure(state.params)
  elif factory.evaluation == "adapt":
    assert algorithm.personalize is not None, name
    adapted = algorithm.personalize(state.params, jax.tree.map(lambda a: a[0], batches.data), batches.mask[0])
    assert jax.tree.structure(adapted) == jax.tree.structure(state.params)
  if isinstance(factory.exchanges, str):
    assert EXCHANGE_METRICS[factory.exchanges] <= set(state.metrics), (name, sorted(state.metrics))
