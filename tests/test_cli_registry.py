"""The command line's algorithm registry, in process: every entry builds, hyper-parameters resolve as documented."""

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_opt as fo
from fedjax_opt.cli import config as config_lib
from fedjax_opt.cli import registry
from fedjax_opt.cli import run as run_lib


def test_the_registry_names_only_factory_parameters():
  registry.check_registry()


def _refusal(check, given, names):
  """The one-line refusal of a flag-level check with `given` for algorithms `names` (None: accepted)."""
  config = dict(config_lib.DEFAULTS, hyper={}, **given)
  try:
    check(config, names)
  except ValueError as e:
    assert "\n" not in str(e), str(e)
    return str(e)
  return None


def test_the_aggregator_flags_apply_exactly_where_the_factory_declares_it_takes_aggregator():
  """`--aggregator`, an update `--attack`, `--compression`, `--secure-aggregation` and `--dp-*` are accepted or
  refused by the factory's declaration (`factory.aggregation`), for every algorithm of the command line; a refusal is
  one line naming the flag as given and quoting the factory's declared reason."""
  from fedjax_opt.cli import privacy, robust, trust
  from fedjax_opt.core.execution import TAKES_AGGREGATOR

  flags = {
      "--aggregator krum": (lambda c, n: robust.check(c, n, registry), {"aggregator": "krum"}),
      "--attack gaussian": (lambda c, n: robust.check(c, n, registry), {"attack": "gaussian"}),
      "--compression top_k:0.1": (lambda c, n: trust.check(c, n, registry), {"compression": "top_k:0.1"}),
      "--secure-aggregation": (lambda c, n: trust.check(c, n, registry), {"secure_aggregation": ""}),
      "--dp-noise 1": (privacy.check, {"dp_noise": 1.0, "dp_clip": 1.0}),
  }
  takers = set()
  for name, spec in registry.REGISTRY.items():
    declared = spec.factory.aggregation
    assert declared == getattr(fo.algorithms, spec.factory.__name__).aggregation, name  # the CLI's cocoa too
    assert spec.takes_aggregator == (declared == TAKES_AGGREGATOR), name
    takers |= {name} if spec.takes_aggregator else set()
    for flag, (check, given) in flags.items():
      refusal = _refusal(check, given, [name])
      if not spec.takes_aggregator:
        assert refusal == (f"{flag} needs algorithms whose factory takes aggregator=; {name} takes none: {declared}"
                           + (" (--attack label_flip needs none)" if flag.startswith("--attack") else ""))
      elif flag.startswith("--dp-"):  # DP covers a subset of them (privacy.DP_ALGORITHMS), refused otherwise
        assert (refusal is None) == (name in privacy.DP_ALGORITHMS), (name, refusal)
        assert refusal is None or "takes none" not in refusal
      else:
        assert refusal is None, (name, flag, refusal)
    assert _refusal(lambda c, n: robust.check(c, n, registry), {"attack": "label_flip"}, [name]) is None, name
  assert {"fedavg", "scaffold", "ifca", "one_shot_average"} <= takers
  assert not {"l2gd", "dane", "gossip", "cocoa", "fedma", "fedbuff"} & takers


def test_a_refusal_of_several_algorithms_quotes_each_declared_reason():
  from fedjax_opt.cli import robust

  refusal = _refusal(lambda c, n: robust.check(c, n, registry), {"attack": "omniscient"}, ["fedavg", "dane", "gossip"])
  assert refusal == (f"--attack omniscient needs algorithms whose factory takes aggregator=; dane takes none: "
                     f"{fo.algorithms.dane.aggregation}; gossip takes none: {fo.algorithms.gossip.aggregation} "
                     f"(--attack label_flip needs none)")


def test_every_factory_of_fo_algorithms_is_on_the_command_line_or_named_here():
  on_cli = {spec.factory.__name__ for spec in registry.REGISTRY.values()}
  factories = {name for name in fo.algorithms.__all__ if inspect.isfunction(getattr(fo.algorithms, name))
               and inspect.signature(getattr(fo.algorithms, name)).return_annotation == "FederatedAlgorithm"}
  # admm_sharing is vertical FL (clients hold feature blocks of the same samples); l2sgd is L2SGD+ without its
  # variance reduction, a building block for tests.
  assert factories - on_cli == {"admm_sharing", "l2sgd"}


@pytest.fixture(scope="module")
def digits():
  return fo.data.load("digits", num_clients=6, seed=0)


@pytest.fixture(scope="module")
def two_digits():
  """Digits 0 and 1 over 6 clients: the two-class problem CoCoA+ needs."""
  arrays = fo.data.digits_arrays().train
  keep = arrays["y"] < 2
  return fo.data.federate(fo.data.CentralizedData({k: v[keep] for k, v in arrays.items()}, None, 2),
                          name="digits01", partition="iid", num_clients=6, seed=0)


@pytest.mark.parametrize("name", list(registry.REGISTRY))
def test_every_entry_builds_and_steps_with_its_defaults(name, digits, two_digits):
  """Traced (not compiled) for speed: init and one step of each algorithm on the data the run would give it."""
  spec = registry.REGISTRY[name]
  if name == "cocoa":  # two classes only (a 10-class dataset is refused: tests/test_cli_distributed.py)
    digits = two_digits
  config = config_lib.finish({"algorithms": name, "dataset": "digits", "num_clients": 6, "clients_per_round": 3,
                              "local_steps": 4, "batch_size": 5, "rounds": 10,
                              "asynchronous": spec.family == "asynchronous"})
  model = run_lib.build_model(config, digits)
  hyper = config_lib.hyper_parameters(config, name)
  ctx = registry.Context(loss_fn=model.loss_fn, num_clients=6, max_train=digits.max_train, local_steps=4,
                         rounds=10, client_map="auto", clients_per_round=3, apply_fn=model.apply, model=model,
                         pooled=run_lib.pooled_sample(digits, 0), **run_lib.network_context(config, digits))
  algo = registry.build(name, ctx, hyper)
  if spec.family == "matched":  # host-driven: its round is a Python loop (tests/test_cli_models.py runs it)
    from fedjax_opt.train import is_host_driven

    assert is_host_driven(algo) and not isinstance(algo, fo.FederatedAlgorithm)
    return
  state = jax.eval_shape(algo.init, model.init(jax.random.key(0)), jax.random.key(1))
  kwargs = run_lib.sampling(spec, hyper, config, digits)
  batches = jax.eval_shape(lambda k: fo.data.sample_round(k, digits, **kwargs), jax.random.key(2))
  after = jax.eval_shape(algo.step, state, batches)
  assert jax.tree.structure(after) == jax.tree.structure(state)


def test_client_lr_fills_every_client_step_size_and_an_explicit_one_wins():
  default = registry.resolve("ditto", {}, None)
  assert default["eta"] == default["client_lr"] == registry.DEFAULT_CLIENT_LR
  assert registry.resolve("admm_consensus", {}, None)["client_lr"] == 0.2  # its own default
  assert registry.resolve("admm_consensus", {}, 0.01)["client_lr"] == 0.01  # an explicit --client-lr is not ignored
  assert registry.resolve("scaffold", {}, 0.3)["eta_l"] == 0.3
  assert registry.resolve("scaffold", {"eta_l": 0.1}, 0.3)["eta_l"] == 0.1  # --set wins over --client-lr
  assert registry.resolve("ditto", {"personal_steps": 3.0}, None)["personal_steps"] == 3
  with pytest.raises(registry.HyperParameterError, match="must be an integer; got 2.5"):
    registry.resolve("ditto", {"personal_steps": 2.5}, None)
  with pytest.raises(registry.HyperParameterError, match="must be true or false"):
    registry.resolve("admm_consensus", {"residual_balancing": 1}, None)


def test_server_lr_goes_to_each_algorithm_s_own_server_step_size():
  config = config_lib.finish({"algorithms": "fedadam,scaffold,fednova", "dataset": "digits", "server_lr": 0.7})
  assert config_lib.hyper_parameters(config, "fedadam")["server_lr"] == 0.7
  assert config_lib.hyper_parameters(config, "scaffold")["eta_g"] == 0.7
  assert config_lib.hyper_parameters(config, "fednova")["server_lr"] == 0.7
  config = config_lib.finish({"algorithms": "fedavg", "dataset": "digits"})
  assert config_lib.hyper_parameters(config, "fedavg")["server_lr"] == 1.0


def test_a_setting_overrides_the_wiring_and_none_keeps_it(digits):
  """`--set l2gd.alpha=…` replaces the α derived from local_lr; unset, α = local_lr · n · (1 − p)."""
  ctx = registry.Context(loss_fn=lambda p, b: 0.0, num_clients=6, max_train=10, local_steps=4, rounds=10,
                         client_map="auto")
  hyper = registry.resolve("l2gd", {}, None)
  assert registry.REGISTRY["l2gd"].wire(ctx, hyper)["alpha"] == pytest.approx(0.05 * 6 * 0.8)
  captured = {}
  spec = registry.REGISTRY["l2gd"]
  original = spec.factory
  try:
    stub = lambda loss_fn, **kw: captured.update(kw)  # noqa: E731  (the factory's declarations, its call recorded)
    stub.hyperparameters = original.hyperparameters
    object.__setattr__(spec, "factory", stub)
    registry.build("l2gd", ctx, registry.resolve("l2gd", {"alpha": 0.7}, None))
  finally:
    object.__setattr__(spec, "factory", original)
  assert captured["alpha"] == 0.7


def test_bits_per_round_counts_each_message_once():
  p = 100
  metrics = {"client_loss": np.zeros(3), "bits": np.array([5.0, 0.0, 7.0]),
             "communicated": np.array([0.0, 1.0, 1.0])}
  r = registry.REGISTRY
  np.testing.assert_array_equal(run_lib.bits_per_round(r["fedavg"], metrics, p, 10, 50), [11 * 32 * p] * 3)
  np.testing.assert_array_equal(run_lib.bits_per_round(r["scaffold"], metrics, p, 10, 50), [22 * 32 * p] * 3)
  np.testing.assert_array_equal(run_lib.bits_per_round(r["fedu"], metrics, p, 10, 50), [10 * 32 * p] * 3)
  np.testing.assert_array_equal(run_lib.bits_per_round(r["cq_ggadmm"], metrics, p, 50, 50), [5.0, 0.0, 7.0])
  l2 = {"client_loss": np.zeros(3), "bits_up": np.array([0.0, 32.0 * p, 32.0 * p]),
        "bits_down": np.array([0.0, 32.0 * p, 32.0 * p])}  # L2GD: a model each way when it communicates
  np.testing.assert_array_equal(run_lib.bits_per_round(r["l2gd"], l2, p, 50, 50), [0, 51 * 32 * p, 51 * 32 * p])


ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_readme_lists_every_flag_as_the_parser_has_it():
  from fedjax_opt.cli import flag_reference

  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  listed = re.search(r"<!-- flags:start -->\n(.*?)\n<!-- flags:end -->", readme, flags=re.S).group(1)
  assert listed == flag_reference()


def test_the_toml_example_of_docs_cli_is_a_valid_configuration(tmp_path):
  block = re.search(r"```toml\n(.*?)```", (ROOT / "docs" / "cli.md").read_text(encoding="utf-8"), flags=re.S).group(1)
  path = tmp_path / "exp.toml"
  path.write_text(block)
  config = config_lib.finish(config_lib._read_toml(str(path)))  # pylint: disable=protected-access
  assert config["algorithms"] == "ditto,fedprox" and config["rounds"] == 200
  assert config_lib.hyper_parameters(config, "ditto")["lam"] == 0.5
  assert config_lib.hyper_parameters(config, "fedprox")["mu"] == 0.1


@pytest.mark.parametrize("name", ["digits", "mnist5k", "synthetic_1_1"])
def test_a_run_uses_the_client_count_that_list_shows(name):
  info = {i.name: i for i in fo.data.available()}[name]
  config = config_lib.finish({"dataset": name})
  dataset = run_lib.load_dataset(config)
  assert dataset.num_clients == info.default_num_clients
  assert f"{info.default_num_clients} " in info.clients  # the words `fedjax-opt list datasets` prints


@pytest.mark.slow  # three models trained and scored
def test_fedmd_with_three_architectures_steps_and_scores_each_client_with_its_own(digits):
  """`architectures=mlp,logreg,cnn`: client k has architecture k mod 3; the evaluation table has a row per client,
  and the scoring model gives each row its own architecture's loss (state.params: client 0's MLP)."""
  config = config_lib.finish({"algorithms": "fedmd", "dataset": "digits", "num_clients": 6, "clients_per_round": 3,
                              "local_steps": 2, "batch_size": 5, "rounds": 10,
                              "hyper": {"fedmd": {"architectures": "mlp,logreg,cnn", "public_size": 40,
                                                  "public_per_round": 20, "digest_batch_size": 10}}})
  model = run_lib.build_model(config, digits)
  hyper = config_lib.hyper_parameters(config, "fedmd")
  ctx = registry.Context(loss_fn=model.loss_fn, num_clients=6, max_train=digits.max_train, local_steps=2, rounds=10,
                         client_map="auto", apply_fn=model.apply, model=model, pooled=run_lib.pooled_sample(digits, 0),
                         example_shape=tuple(digits.examples["x"].shape[2:]))
  algo = registry.build("fedmd", ctx, hyper)
  state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
  mlp = fo.models.mlp_2nn(num_classes=10, input_dim=64)
  logreg = fo.models.logistic_regression(64, 10)
  cnn = fo.models.emnist_cnn(num_classes=10, image_shape=(8, 8))
  models = (mlp, logreg, cnn)
  key = jax.random.key(1)
  for a, m in enumerate(models):  # two clients each, every one from its architecture's init(fold_in(key, a))
    want = m.init(jax.random.fold_in(key, a))
    for table, leaf in zip(jax.tree.leaves(state.local_params[a]), jax.tree.leaves(want)):
      np.testing.assert_array_equal(table, np.stack([leaf, leaf]))
  kwargs = run_lib.sampling(registry.REGISTRY["fedmd"], hyper, config, digits)
  batches = jax.eval_shape(lambda k: fo.data.sample_round(k, digits, **kwargs), jax.random.key(2))
  after = jax.eval_shape(algo.step, state, batches)
  assert jax.tree.structure(after) == jax.tree.structure(state)
  spec = registry.REGISTRY["fedmd"]
  table = spec.personalized_params(hyper)(state)
  assert isinstance(table, registry.Architectures)
  np.testing.assert_array_equal(table.architecture, np.arange(6) % 3)
  scored = spec.scoring_model(model, hyper, digits)
  batch = {"x": jnp.asarray(digits.examples["x"][0, :4]), "y": jnp.asarray(digits.examples["y"][0, :4])}
  for k in range(6):
    row = jax.tree.map(lambda t, k=k: t[k], table)
    own = models[k % 3]
    params = fo.algorithms.fedmd_client_params(state, k, np.arange(6) % 3)
    np.testing.assert_array_equal(scored.loss_fn(row, batch), own.loss_fn(params, batch))
    np.testing.assert_array_equal(scored.accuracy_fn(row, batch), own.accuracy_fn(params, batch))
  client0 = fo.algorithms.fedmd_client_params(state, 0, np.arange(6) % 3)
  np.testing.assert_array_equal(scored.loss_fn(state.params, batch), mlp.loss_fn(client0, batch))


def _recorded_build(name, hyper, ctx):
  """The keyword arguments `registry.build` hands `name`'s factory (the factory's call recorded, not run)."""
  spec, captured = registry.REGISTRY[name], {}
  original = spec.factory
  stub = lambda *args, **kw: captured.update(kw)  # noqa: E731
  stub.hyperparameters = original.hyperparameters
  try:
    object.__setattr__(spec, "factory", stub)
    registry.build(name, ctx, hyper)
  finally:
    object.__setattr__(spec, "factory", original)
  return captured


@pytest.mark.parametrize("name", [n for n in registry.REGISTRY if n not in ("fedmd", "fedma", "p2p_bayes", "cocoa")])
def test_the_optimizers_a_factory_declares_are_built_from_the_run_s_step_sizes(name):
  """The CLI reads `factory.hyperparameters`: a `client_optimizer` declared a client optimizer is SGD at the run's
  client_lr, a `server_optimizer` declared a server optimizer is the entry's named server optimizer at server_lr
  (or SGD at server_lr): checked by the step each takes on a gradient of ones from zero."""
  import optax
  ctx = registry.Context(loss_fn=lambda p, b: 0.0, num_clients=6, max_train=10, local_steps=4, rounds=10,
                         client_map="vmap", clients_per_round=3)
  hyper = registry.resolve(name, {}, 0.07)
  kwargs = _recorded_build(name, hyper, ctx)
  roles = registry.REGISTRY[name].factory.hyperparameters
  step = lambda opt: float(opt.update({"w": np.ones(1)}, opt.init({"w": np.zeros(1)}), {"w": np.zeros(1)})[0]["w"][0])
  if roles.get("client_optimizer") == "client optimizer" and "client_lr" in hyper:
    assert step(kwargs["client_optimizer"]) == pytest.approx(-0.07)
  if roles.get("server_optimizer") == "server optimizer" and kwargs.get("server_optimizer") is not None:
    if "server_optimizer" in hyper:
      from fedjax_opt import server_optimizers
      want = server_optimizers.get(hyper["server_optimizer"], learning_rate=hyper["server_lr"])
    else:
      want = optax.sgd(hyper["server_lr"])
    assert step(kwargs["server_optimizer"]) == pytest.approx(step(want))
