"""The algorithms of the command line: one `Spec` per name, hyper-parameters checked against the factory.

A `Spec` says how to build an algorithm from a `fo.algorithms` factory, which
of its hyper-parameters a user may set (`--set ditto.lam=0.1`, or a `[ditto]`
section in the TOML file) and their defaults, how `fo.train` feeds it data,
how it is evaluated and how its communication is counted. Adding a `Spec` to
`REGISTRY` is all it takes to put an algorithm on the command line: the run,
the table, `results.json`, the plots and `fedjax-opt list algorithms` read
everything from here.

Hyper-parameter names are the factory's own parameter names (`lam`, `eta`,
`mu`, `rho`, `eta_l`, ... the paper's symbols, see `docs/algorithms.md`),
plus the few that build an object the factory takes (`PSEUDO`):
`client_lr` (the client optimizer `optax.sgd(client_lr)`), `server_lr` and
`server_optimizer` (`fo.server_optimizers.get(server_optimizer,
learning_rate=server_lr)`), `finetune_lr` and `personalize_lr` (FedAvg +
fine-tuning), `local_lr` and `example_lr` (L2GD / L2SGD+'s local step, from
which α is derived unless α is given), `l2` (a ridge term (l2/2)‖θ‖² added
to every example's loss, for the convex family), FedMD's `public_size` and
`architectures`, and P2P Bayes' candidate models (`num_hypotheses`, `spread`,
`fit_l2`) and its report (`concentration`). A default of `CLIENT_LR`
means "the run's `--client-lr`". Any other keyword of the factory whose
default is a plain value (`scaffold.control_update`, `per_fedavg.variant`,
`admm_consensus.relaxation`, ...) may be set too; the factory's own checks
then apply, reported as one line.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Mapping, NamedTuple

__all__ = ["ARCHITECTURES", "Architectures", "CLIENT_LR", "Context", "DEFAULT_CLIENT_LR", "FAMILIES",
           "HyperParameterError", "NEWTON_CG_ITERS", "NEWTON_DIRECT_MAX", "PSEUDO", "REGISTRY", "Spec", "WIRED",
           "architecture_model", "build", "candidates_fit", "check_registry",
           "declared_wiring", "describe_defaults", "refuse_aggregation", "refuse_downlink", "resolve"]


class _RunClientLR:
  """The default "the run's --client-lr"."""

  def __repr__(self) -> str:
    return "--client-lr"


CLIENT_LR = _RunClientLR()

PSEUDO = {
    "client_lr": "client SGD step size: client_optimizer = optax.sgd(client_lr)",
    "server_lr": "server step size: server_optimizer = server_optimizers.get(server_optimizer, learning_rate=...)",
    "server_optimizer": "a fedjax_opt.server_optimizers name (fedavg, fedavgm, fedadagrad, fedadam, fedyogi)",
    "finetune_lr": "FedAvg + fine-tuning: client SGD step size of stage 2",
    "personalize_lr": "FedAvg + fine-tuning: SGD step size of the on-client fine-tuning",
    "local_lr": "L2GD: the local step α/(n(1 − p)); α is derived from it unless alpha is set",
    "example_lr": "L2SGD+: the per-example step α/n; α is derived from it unless alpha is set",
    "l2": "ridge (l2/2)‖θ‖² added to every example's loss (the convex family: a unique minimiser)",
    "public_size": "FedMD: |D₀|, the public examples, drawn once from the pooled train split (the run's seed)",
    "architectures": "FedMD: the clients' models, e.g. mlp,logreg (from logreg, mlp, cnn): client k has the "
                     "(k mod A)-th; none: every client has the run's --model",
    "num_hypotheses": "P2P Bayes: K candidate models, the fit and K − 1 others (the fit at a random index)",
    "spread": "P2P Bayes: each other candidate is the fit moved by spread · ‖fit‖ in a random direction",
    "fit_l2": "P2P Bayes: the ridge (fit_l2/2)‖θ‖² of the fit, a float64 L-BFGS solve on the pooled train split",
    "concentration": "P2P Bayes: a node has concentrated once its belief on the fit stays above this (report only)",
}
"""Hyper-parameters that are not factory parameters: each builds what the factory takes."""

WIRED = ("loss_fn", "num_clients", "num_examples", "client_map", "client_optimizer", "server_optimizer", "graph",
         "aggregator", "storage_dtype", "prox", "finetune_client_optimizer", "finetune_server_optimizer",
         "personalize_optimizer", "schedule", "validation_data", "validation_mask", "apply_fn", "public_data",
         "digest_optimizer", "architecture_of", "layers", "hypotheses", "true_hypothesis", "compressor")
"""Factory parameters the command line fills itself, or leaves to the library's default (CQ-GGADMM's `compressor=`,
set on the command line through its `bits`): never `--set`."""

FAMILIES = {
    "averaging": "one global model; evaluated on every client's test split",
    "personalized": "a model per client; also evaluated per client on its own test split (mean, 10th percentile)",
    "admm": "convex models (logistic regression, ridge l2); every client every round on its whole train split; "
            "objective gap to a centralized solve",
    "distributed": "the classical distributed baselines, convex models (logistic regression with the ridge l2; "
                   "CoCoA+: a linear model on two classes): every client every round on its whole train split "
                   "(FedDANE: --clients-per-round clients, --local-steps × --batch-size examples each); objective "
                   "gap to a centralized solve",
    "decentralized": "no server: every client is a node of --topology and trains every round; evaluated on the "
                     "nodes' average and per node; consensus distance (p2p_bayes: the network's most believed "
                     "candidate and each node's; each node's belief on the fit)",
    "matched": "matched averaging on the host (an MLP or CNN): C sampled clients train, then their hidden units are "
               "matched layer by layer and the global layers grow; one round uploads each layer once per client",
    "asynchronous": "--async: clients arrive on a simulated clock, one server event per arrival; --rounds R runs "
                    "R × --clients-per-round events; history_size (past models kept) default max(16, 4C)",
}


@dataclasses.dataclass(frozen=True)
class Context:
  """What a builder knows about the run: the loss and the shapes of the data."""

  loss_fn: Callable
  num_clients: int  # N, the dataset's clients
  max_train: int  # the largest client's number of train examples
  local_steps: int  # the run's --local-steps
  rounds: int  # the run's --rounds
  client_map: str
  aggregator: Any = None  # --aggregator / --attack: replaces the factory's default aggregator
  clients_per_round: int = 1  # the run's --clients-per-round (clients in flight under --async)
  graph: Any = None  # --topology's graph (`network.graph`: a `fo.graphs.Graph`, or matchings' `[T, N, N]`)
  schedule: Any = None  # --async: the `core.asynchrony.wall_clock` of the asynchronous algorithms
  validation: Any = None  # --async: Zeno++'s server-side validation batch (pooled train examples)
  apply_fn: Any = None  # the model's `apply(params, x) -> scores` (FedMD's public scores)
  pooled: Any = None  # `pooled(n) -> {"x", "y"}`: n pooled train examples at random (the run's seed)
  model: Any = None  # the run's `fo.models.Model` (FedMA applies it for any widths)
  seed: int = 0  # the run's --seed (P2P Bayes' candidates)
  example_shape: tuple = ()  # the shape of one example x (FedMD's architectures)


@dataclasses.dataclass(frozen=True)
class Spec:
  """A named algorithm of the command line.

  Attributes:
    family: a key of `FAMILIES`.
    description: one line for `fedjax-opt list`.
    factory: the `fo.algorithms` factory; hyper-parameters are checked against its signature.
    defaults: settable hyper-parameters and their defaults (factory parameters or `PSEUDO` names).
    wire: `wire(context, hyper) -> {factory keyword: value}` for what the defaults do not give directly
      (optimizers, derived step sizes); the rest of `hyper` is passed by name.
    graph: the factory's `graph=`: None (it takes none), "topology" (the run's `--topology`, `Context.graph`)
      or the name of a `fo.graphs` builder called with the run's N (e.g. "chain", "ring").
    sampling: "clients" (C sampled clients, S steps of B examples), "full" (every client, its whole train
      split as one batch, every round), "full_fixed" (the same, examples in slot order: per-example tables),
      "nodes" (every client every round, S steps of B examples: decentralized), "all" (the same, for a
      server-based algorithm that needs every client: CFL's splits) or "events" (every client's
      S steps of B examples every server event, of which the arriving client's are used: asynchronous).
    objective: None, "pooled" (the example-weighted pooled risk of state.params) or "mixture" (the mixture
      objective of the per-client table, `fo.objectives.mixture`), for the objective gap.
    data_steps: `data_steps(hyper, S) -> S'`, the batches per client and round the algorithm needs when the
      run asks for S local steps (None: S itself).
    eval_model: None, or `eval_model(model) -> Model` whose loss and accuracy score the algorithm's
      `state.params` and personalized models (FedEM's mixtures of components).
    train_model: None, or `train_model(model) -> Model` whose loss the factory is given instead of the
      run's model's (FedMA: the same network applied for any widths); ValueError: the model does not fit.
      `wire` may also return `loss_fn` (FedMD's losses, one per architecture), which then wins.
    convex: the algorithm needs a convex model (`--model logreg`; `auto` picks it).
    wrap: None, or `wrap(algorithm, context, hyper) -> algorithm`, applied to what the factory built (FedMD's
      architectures: an `init` that starts each architecture from its own model).
    scorer: None, or `scorer(model, hyper, dataset) -> Model` scoring `state.params` and the personalized
      models when it depends on the hyper-parameters (FedMD's architectures); wins over `eval_model`.
    tables: None, or `tables(hyper) -> (state -> per-client table)` for evaluation "table" when
      `fo.personalized_params` does not give one table of N rows (FedMD with several architectures).
    summary: None, or `summary(round_metrics, hyper, seeds) -> {results key: value}`, more of the result
      row (P2P Bayes' beliefs on the fit).
    reference: None, or `reference(hyper, batches) -> F*` (or None), the minimum of the pooled objective when
      L-BFGS on it does not apply (CoCoA+'s hinge loss, which is not smooth: the maximum of its dual).

  Read from the factory's declarations (`core.execution.accepts_policy_keywords`), not repeated here:
  `evaluation`, `messages` and `communication` (`factory.exchanges`), `server_lr` (`factory.hyperparameters`),
  `aggregation`.
  """

  family: str
  description: str
  factory: Callable
  defaults: Mapping[str, Any]
  wire: Callable[[Context, dict], dict] = lambda ctx, hyper: {}
  graph: str | None = None
  sampling: str = "clients"
  objective: str | None = None
  data_steps: Callable[[dict, int], int] | None = None
  eval_model: Callable[[Any], Any] | None = None
  train_model: Callable[[Any], Any] | None = None
  convex: bool = False
  wrap: Callable[[Any, Context, dict], Any] | None = None
  scorer: Callable[[Any, dict, Any], Any] | None = None
  tables: Callable[[dict], Callable[[Any], Any]] | None = None
  summary: Callable[[Mapping[str, Any], dict, int], dict] | None = None
  reference: Callable[[dict, Any], float | None] | None = None

  def scoring_model(self, model: Any, hyper: dict, dataset: Any) -> Any:
    """The `fo.models.Model` whose loss and accuracy score this algorithm's models (the run's `model` by default)."""
    if self.scorer is not None:
      return self.scorer(model, hyper, dataset)
    return model if self.eval_model is None else self.eval_model(model)

  def personalized_params(self, hyper: dict) -> Callable[[Any], Any]:
    """`state -> [N, ...]`: each client's own model, the table evaluation "table" scores."""
    if self.tables is not None:
      table = self.tables(hyper)
      if table is not None:
        return table
    from fedjax_opt.core.per_client import personalized_params

    return personalized_params

  @property
  def evaluation(self) -> str:
    """"global" (state.params on every client's test split), "table" (also each client's stored model:
    `fo.personalized_params`) or "adapt" (also the global model adapted on each client: `algorithm.personalize`):
    the factory's declaration, `factory.evaluation`."""
    return self.factory.evaluation

  @property
  def communication(self) -> str:
    """How a round's bits are counted, from the factory's `exchanges`: "rounds" (`messages` model-sized vectors);
    "bits": the algorithm's `bits` metric; "bytes": its `bytes_sent` per node (decentralized); "metrics": the
    round's `bits_up` per client taking part and `bits_down` once, as one broadcast (IFCA's K models, FedMD's
    scores, FedMA's layers, L2GD / L2SGD+ only in the iterations that communicate)."""
    exchanges = self.factory.exchanges
    return "rounds" if isinstance(exchanges, tuple) else exchanges

  @property
  def messages(self) -> tuple[int, int]:
    """(model-sized uploads per client taking part, broadcasts) per round, the factory's `exchanges`, counted when
    `communication` is "rounds" ((1, 1) otherwise, unused)."""
    exchanges = self.factory.exchanges
    return exchanges if isinstance(exchanges, tuple) else (1, 1)

  @property
  def server_lr(self) -> str | None:
    """The hyper-parameter `--server-lr` sets (None: the algorithm has no server step size): the factory's parameter
    declared the server step size (SCAFFOLD's `eta_g`), else the `PSEUDO` `server_lr` where this entry sets it (it
    builds the factory's declared server optimizer)."""
    from fedjax_opt.core import execution

    roles = self.factory.hyperparameters
    named = [name for name, role in roles.items() if role == execution.SERVER_STEP_SIZE]
    if named:
      return named[0]
    if "server_lr" in self.defaults and execution.SERVER_OPTIMIZER in roles.values():
      return "server_lr"
    return None

  @property
  def aggregation(self) -> str:
    """What the factory declares about `aggregator=` (`factory.aggregation`, `core.execution.accepts_policy_keywords`):
    `TAKES_AGGREGATOR`, or the one-line reason it takes none."""
    return self.factory.aggregation

  @property
  def takes_aggregator(self) -> bool:
    """The factory takes `aggregator=` (its declaration), so `--aggregator`, an update `--attack`, `--dp-*`,
    `--secure-aggregation` and `--compression` may apply to it."""
    from fedjax_opt.core.execution import TAKES_AGGREGATOR

    return self.aggregation == TAKES_AGGREGATOR

  def settable(self) -> dict[str, Any]:
    """Every hyper-parameter a user may set, with its default (`inspect.Parameter.empty`: none)."""
    out = dict(self.defaults)
    for name, p in inspect.signature(self.factory).parameters.items():
      if name in out or name in WIRED or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
        continue
      if p.default is None or isinstance(p.default, (bool, int, float, str)):
        out[name] = p.default
    return out


def _sgd(rate):
  import optax

  return optax.sgd(rate)


def _server(hyper: dict):
  from fedjax_opt import server_optimizers

  return server_optimizers.get(hyper["server_optimizer"], learning_rate=hyper["server_lr"])


def _ridge(loss_fn: Callable, l2: float) -> Callable:
  """loss(θ, batch) + (l2/2)‖θ‖² per example (the loss itself when l2 is the number 0; l2 may be traced)."""
  if isinstance(l2, (int, float)) and not l2:
    return loss_fn
  import jax
  import jax.numpy as jnp

  def loss(params, batch):
    return loss_fn(params, batch) + 0.5 * l2 * sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(params))

  return loss


def declared_wiring(spec: "Spec", hyper: dict) -> dict:
  """The optimizers the factory's declared roles ask for (`factory.hyperparameters`), built from the run's step
  sizes: a parameter `client_optimizer` declared `CLIENT_OPTIMIZER` is `optax.sgd(client_lr)`; one
  `server_optimizer` declared `SERVER_OPTIMIZER` is the named server optimizer at `server_lr`
  (`server_optimizers.get`) when the entry has `server_optimizer`, else `optax.sgd(server_lr)` when it has
  `server_lr`. An entry's `wire` wins over these (it may give None: the factory's own default)."""
  from fedjax_opt.core import execution

  roles = spec.factory.hyperparameters
  out = {}
  if roles.get("client_optimizer") == execution.CLIENT_OPTIMIZER and "client_lr" in hyper:
    out["client_optimizer"] = _sgd(hyper["client_lr"])
  if roles.get("server_optimizer") == execution.SERVER_OPTIMIZER:
    if "server_optimizer" in hyper:
      out["server_optimizer"] = _server(hyper)
    elif "server_lr" in hyper:
      out["server_optimizer"] = _sgd(hyper["server_lr"])
  return out


def _local(ctx, hyper):
  return {"local_steps": ctx.local_steps}


def _fedopt(optimizer: str, server_lr: float, description: str) -> Spec:
  from fedjax_opt import algorithms

  return Spec("averaging", description, algorithms.fedavg,
              {"client_lr": CLIENT_LR, "server_optimizer": optimizer, "server_lr": server_lr})


def _fedavg_finetune_wire(ctx, hyper):
  return {"finetune_client_optimizer": _sgd(hyper["finetune_lr"]), "personalize_optimizer": _sgd(hyper["personalize_lr"]),
          "switch_round": hyper["switch_round"] if hyper["switch_round"] is not None else ctx.rounds // 2}


def _l2gd_wire(ctx, hyper):
  alpha = hyper["alpha"] if hyper["alpha"] is not None else hyper["local_lr"] * ctx.num_clients * (1 - hyper["p"])
  return {"alpha": alpha}


def _l2sgd_plus_wire(ctx, hyper):
  alpha = hyper["alpha"] if hyper["alpha"] is not None else hyper["example_lr"] * ctx.num_clients
  return {"alpha": alpha, "num_examples": ctx.max_train}


def _per_fedavg_batches(hyper: dict) -> int:
  """Batches per Per-FedAvg meta-step: D, D' (first order, MAML) or D, D', D'' (Hessian-free)."""
  return 3 if hyper.get("variant") == "hf" else 2


def _async_wire(ctx, hyper):
  out = {"num_clients": ctx.num_clients, "schedule": ctx.schedule}
  if hyper.get("history_size") is None:  # about 4 × the clients in flight: an update is rarely too stale to use
    out["history_size"] = max(16, 4 * ctx.clients_per_round)
  return out


def _fedbuff_wire(ctx, hyper):
  return {**_async_wire(ctx, hyper), "buffer_size": hyper["buffer_size"] or max(1, ctx.clients_per_round // 2)}


def _co_op_wire(ctx, hyper):
  return {**_async_wire(ctx, hyper), "max_age": hyper["max_age"] or 4 * ctx.clients_per_round}


def _zeno_wire(ctx, hyper):
  return {**_async_wire(ctx, hyper), "validation_data": ctx.validation}


ARCHITECTURES = ("logreg", "mlp", "cnn")
"""FedMD's `architectures`: `fo.models` for the dataset's examples (logistic regression, the 2NN MLP, the EMNIST
CNN)."""


def _architecture_names(hyper: dict) -> list[str] | None:
  """`fedmd.architectures` as names (None: not set), or a ValueError naming the bad value."""
  value = hyper.get("architectures")
  if value is None:
    return None
  names = value.split(",") if isinstance(value, str) else value
  if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
    names = None
  else:
    names = [n.strip() for n in names]
  if names is None or not all(n in ARCHITECTURES for n in names):
    raise ValueError(f"architectures must be model names separated by commas, from {', '.join(ARCHITECTURES)} "
                     f"(e.g. mlp,logreg); got {value!r}")
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ValueError(f"architectures lists {', '.join(twice)} twice; each architecture is one group of clients")
  return names


def architecture_model(name: str, example_shape: tuple, num_classes: int, text: bool = False):
  """The `fo.models.Model` of FedMD architecture `name` for examples of `example_shape` and `num_classes`."""
  from fedjax_opt import models

  shape = tuple(example_shape)
  if text:
    raise ValueError("architectures apply to datasets of images or feature vectors; this one holds character "
                     "sequences")
  features = math.prod(shape)
  if name == "logreg":
    return models.logistic_regression(features, num_classes)
  if name == "mlp":
    return models.mlp_2nn(num_classes=num_classes, input_dim=features)
  if len(shape) < 2:
    raise ValueError(f"architecture 'cnn' needs image data; the dataset's examples have shape {shape}")
  return models.emnist_cnn(num_classes=num_classes, image_shape=shape[:2])


def _fedmd_models(ctx, hyper) -> list | None:
  names = _architecture_names(hyper)
  if names is None:
    return None
  if len(names) > ctx.num_clients:
    raise ValueError(f"architectures names {len(names)} architectures for {ctx.num_clients} clients: each "
                     f"architecture needs a client (client k has the (k mod A)-th)")
  text = getattr(ctx.model, "name", None) == "char_rnn"
  return [architecture_model(n, ctx.example_shape, ctx.model.num_classes, text) for n in names]


def _fedmd_wire(ctx, hyper):
  out = {"apply_fn": ctx.apply_fn, "public_data": ctx.pooled(hyper["public_size"])}
  models = _fedmd_models(ctx, hyper)
  if models is not None:  # client k has architecture k mod A
    import numpy as np

    many = len(models) > 1
    out.update(loss_fn=tuple(m.loss_fn for m in models) if many else models[0].loss_fn,
               apply_fn=tuple(m.apply for m in models) if many else models[0].apply,
               architecture_of=np.arange(ctx.num_clients) % len(models) if many else None)
  return out


def _fedmd_wrap(algo, ctx, hyper):
  """With `architectures`, architecture a starts from `models[a].init(fold_in(key, a))`, key = init's key."""
  models = _fedmd_models(ctx, hyper)
  if models is None:
    return algo
  import jax

  def init(params, key):
    del params  # the run's model is not one of the clients' (each architecture starts from its own model)
    starts = tuple(m.init(jax.random.fold_in(key, a)) for a, m in enumerate(models))
    return algo.init(starts if len(starts) > 1 else starts[0], key)

  return algo._replace(init=init)


class Architectures(NamedTuple):
  """One row per client of FedMD with several architectures: `models[a]` is a table `[N, ...]` of architecture
  a's models, whose row k is client k's model when `architecture[k] == a` (row 0 of a's clients otherwise)."""

  architecture: Any
  models: tuple


def _fedmd_scorer(model, hyper, dataset):
  """Client 0's model (architecture 0) for `state.params`; each client's own architecture for `Architectures`."""
  names = _architecture_names(hyper)
  if names is None:
    return model
  models = [architecture_model(n, dataset.examples["x"].shape[2:], dataset.num_classes,
                               dataset.sequence_length > 0) for n in names]
  if len(models) == 1:
    return models[0]

  def per_architecture(fns):
    def fn(params, batch):
      if not isinstance(params, Architectures):  # state.params: client 0's model, of architecture 0
        return fns[0](params, batch)
      import jax.numpy as jnp

      values = jnp.stack([f(p, batch) for f, p in zip(fns, params.models)])  # [A, B]
      return values[params.architecture]

    return fn

  return models[0]._replace(loss_fn=per_architecture([m.loss_fn for m in models]),
                            accuracy_fn=per_architecture([m.accuracy_fn for m in models]),
                            name="+".join(m.name for m in models))


def _fedmd_tables(hyper):
  """FedMD's tuple of A tables `[n_a, ...]` as one `Architectures` table of N rows (None: one architecture)."""
  names = _architecture_names(hyper)
  if names is None or len(names) == 1:
    return None
  count = len(names)

  def table(state):
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = sum(jax.tree.leaves(t)[0].shape[0] for t in state.local_params)
    arch = np.arange(n) % count
    row = np.arange(n) // count  # client k is row k // A of its architecture's clients (a, a + A, a + 2A, ...)
    models = tuple(jax.tree.map(lambda t, a=a: t[np.where(arch == a, row, 0)], state.local_params[a])
                   for a in range(count))
    return Architectures(jnp.asarray(arch, jnp.int32), models)

  return table


def _p2p_wire(ctx, hyper):
  """The K candidates: the fit θ̂ (float64 L-BFGS of the pooled ridge risk) at a random index t, and K − 1
  others θ̂ + spread · ‖θ̂‖ · u_k, u_k uniform on the unit sphere; t, then the u_k, from
  `numpy.random.default_rng(seed)` (docs/cli.md)."""
  import jax
  import jax.flatten_util
  import jax.numpy as jnp
  import numpy as np

  k, spread, fit_l2 = hyper["num_hypotheses"], hyper["spread"], hyper["fit_l2"]
  if k < 2:
    raise ValueError(f"num_hypotheses must be an integer >= 2 (the fit and at least one other); got {k}")
  if spread <= 0:
    raise ValueError(f"spread must be > 0 (how far the other candidates are from the fit); got {spread}")
  if fit_l2 < 0:
    raise ValueError(f"fit_l2 must be >= 0; got {fit_l2}")
  if not 0 < hyper["concentration"] < 1:
    raise ValueError(f"concentration must lie in (0, 1); got {hyper['concentration']}")
  fit, _ = candidates_fit(ctx.model, ctx.pooled(2**62), fit_l2, ctx.seed)
  flat32, unravel = jax.flatten_util.ravel_pytree(fit)
  flat = np.asarray(flat32, np.float64)
  rng = np.random.default_rng(ctx.seed)
  truth = int(rng.integers(k))
  directions = rng.normal(size=(k, flat.size))
  thetas = flat + spread * np.linalg.norm(flat) * directions / np.linalg.norm(directions, axis=1, keepdims=True)
  thetas[truth] = flat
  rows = [unravel(jnp.asarray(t, flat32.dtype)) for t in thetas]
  return {"hypotheses": jax.tree.map(lambda *r: jnp.stack(r), *rows), "true_hypothesis": truth}


def candidates_fit(model, pooled: dict, fit_l2: float, seed: int):
  """(θ̂, F(θ̂)): the minimiser of the mean of `model.loss_fn` + (fit_l2/2)‖θ‖² over `pooled`, float64 L-BFGS
  from `model.init(jax.random.key(seed))` (`fo.objectives.minimize`)."""
  import jax
  import jax.numpy as jnp

  from fedjax_opt import objectives

  loss = _ridge(model.loss_fn, fit_l2)
  return objectives.minimize(lambda p, data: jnp.mean(loss(p, data)), model.init(jax.random.key(seed)), pooled)


def _p2p_summary(round_metrics, hyper, seeds):
  """Each node's belief on the fit after the last round and the round from which it stays above `concentration`
  (None: not by the end), per seed, and min / median / max over every node (None counts as never)."""
  import numpy as np

  beliefs = np.asarray(round_metrics["true_belief"], np.float64)  # [R, N], or [K, R, N] for K seeds
  members = [beliefs] if seeds == 1 else list(beliefs)
  last, first = [], []
  for b in members:
    stays = np.flip(np.logical_and.accumulate(np.flip(b > hyper["concentration"], 0), axis=0), 0)  # above to the end
    last.append(b[-1].tolist())
    first.append([int(np.argmax(s)) + 1 if s[-1] else None for s in stays.T])
  every_last = np.concatenate([np.asarray(v) for v in last])
  every_first = np.array([np.inf if r is None else r for v in first for r in v], np.float64)

  def number(x):  # a round (an int), a median between two (a float), or None for never
    return None if not np.isfinite(x) else int(x) if float(x).is_integer() else float(x)

  out = {"true_belief_per_node": last, "rounds_to_concentrate_per_node": first}
  for name, fn in (("min", np.min), ("median", np.median), ("max", np.max)):
    out[f"true_belief_{name}"] = float(fn(every_last))
    out[f"rounds_to_concentrate_{name}"] = number(fn(every_first))
  return out


def _fedma_model(model):
  from fedjax_opt import algorithms

  return algorithms.fedma_model(model)[0]


def _fedma_wire(ctx, hyper):
  from fedjax_opt import algorithms

  return {"layers": algorithms.fedma_model(ctx.model)[1]}


NEWTON_DIRECT_MAX = 2000
"""The Newton solvers of the distributed family (DANE, FedDANE, FADL, one-shot) solve their systems directly from
the `[P, P]` Hessian up to this many parameters, by `NEWTON_CG_ITERS` conjugate-gradient iterations above it
(unless `cg_iters` is set)."""

NEWTON_CG_ITERS = 50


def _num_params(model) -> int:
  if model is None:
    return 0
  import jax

  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))


def _newton_wire(ctx, hyper):
  """`cg_iters` None: direct solves for small models, `NEWTON_CG_ITERS` CG iterations for large ones."""
  if "cg_iters" in hyper and hyper["cg_iters"] is None and _num_params(ctx.model) > NEWTON_DIRECT_MAX:
    return {"cg_iters": NEWTON_CG_ITERS}
  return {}


def _cocoa_wire(ctx, hyper):
  classes = getattr(ctx.model, "num_classes", 2)
  if classes != 2:
    raise ValueError(f"CoCoA+ solves a two-class problem (labels ±1, {hyper['loss']} loss on a linear model) and "
                     f"this dataset has {classes} classes: give a two-class LibSVM file with --dataset libsvm:PATH")
  return {"lam": hyper["l2"], "num_examples": ctx.max_train}


def _cocoa_wrap(algo, ctx, hyper):
  """CoCoA+ on the run's data: the primal starts at 0 in `fo.algorithms.cocoa_model`'s parameters (whatever the run's
  model), and every round's labels y ∈ {0, 1} are given to it as t = 2y − 1, its features flattened."""
  import jax.numpy as jnp

  from fedjax_opt.core.types import FederatedAlgorithm, materialize

  from fedjax_opt.algorithms import cocoa_model

  model = cocoa_model(math.prod(ctx.model.input_shape), hyper["loss"])

  def init(params, key):
    del params  # w(α₀) = 0: CoCoA+'s primal is its duals' image
    return algo.init(model.init(key), key)

  def step(state, batches):
    data = materialize(batches.data)
    x = jnp.reshape(data["x"], data["x"].shape[:3] + (-1,)).astype(jnp.float32)
    return algo.step(state, batches.replace(data={"x": x, "y": 2.0 * data["y"].astype(jnp.float32) - 1.0}))

  return FederatedAlgorithm(init, step)


def _one_shot_wrap(algo, ctx, hyper):
  """One-shot averaging without its `client_loss` metric, which is the loss at the initial model in the exchange and
  0 in every later round: no training loss to report (the table shows `–`)."""
  del ctx, hyper
  from fedjax_opt.core.types import FederatedAlgorithm

  def drop(state):
    return state.replace(metrics={k: v for k, v in state.metrics.items() if k != "client_loss"})

  return FederatedAlgorithm(lambda params, key: drop(algo.init(params, key)),
                            lambda state, batches: drop(algo.step(state, batches)))


def _cocoa_scorer(model, hyper, dataset):
  del dataset
  from fedjax_opt.algorithms import cocoa_model

  return cocoa_model(math.prod(model.input_shape), hyper["loss"])


def _cocoa_reference(hyper, batches) -> float | None:
  """F* of CoCoA+'s hinge loss on the round's pooled examples (`fo.algorithms.hinge_optimum`); None for the squared
  loss (smooth: L-BFGS on the primal)."""
  if hyper["loss"] != "hinge":
    return None
  import numpy as np

  from fedjax_opt.algorithms import hinge_optimum
  from fedjax_opt.core.types import materialize

  data, mask = materialize(batches.data), np.asarray(batches.mask, bool)
  x = np.asarray(data["x"], np.float64)[mask].reshape(int(mask.sum()), -1)
  return hinge_optimum(x, 2.0 * np.asarray(data["y"], np.float64)[mask] - 1.0, hyper["l2"])


def _builder_graph(builder: str, num_nodes: int):
  from fedjax_opt import graphs

  return getattr(graphs, builder)(num_nodes)


def _builders() -> dict[str, Callable[[Any], Spec]]:
  """Name → `builder(fo.algorithms) -> Spec`."""
  admm_local = {"client_lr": 0.2, "l2": 1e-3}
  distributed = {"l2": 1e-3}
  return {
      # ---- averaging -------------------------------------------------------------------------------------------
      "fedsgd": lambda a: Spec(
          "averaging", "one full-batch gradient per client, server SGD (McMahan et al. 2017)", a.fedsgd,
          {"server_lr": 0.5}),
      "fedavg": lambda a: _fedopt("fedavg", 1.0, "local SGD, weighted average of deltas (McMahan et al. 2017)"),
      "fedavgm": lambda a: _fedopt("fedavgm", 0.3, "FedAvg with server momentum 0.9 (Hsu et al. 2019)"),
      "fedadagrad": lambda a: _fedopt("fedadagrad", 0.03, "FedOpt with server Adagrad (Reddi et al. 2021)"),
      "fedadam": lambda a: _fedopt("fedadam", 0.003, "FedOpt with server Adam (Reddi et al. 2021)"),
      "fedyogi": lambda a: _fedopt("fedyogi", 0.003, "FedOpt with server Yogi (Reddi et al. 2021)"),
      "fedprox": lambda a: Spec(
          "averaging", "local steps on f_k + (μ/2)‖x − x_t‖² (Li et al. 2020)", a.fedprox,
          {"mu": 0.01, "client_lr": CLIENT_LR, "server_optimizer": "fedavg", "server_lr": 1.0}),
      "scaffold": lambda a: Spec(
          "averaging", "control variates correct client drift (Karimireddy et al. 2020)", a.scaffold,
          {"eta_l": CLIENT_LR, "eta_g": 1.0}),
      "fednova": lambda a: Spec(
          "averaging", "normalized averaging of heterogeneous local work (Wang et al. 2020)", a.fednova,
          {"eta": CLIENT_LR, "rho": 0.0, "server_lr": 1.0}),
      "feddyn": lambda a: Spec(
          "averaging", "dynamic regularization (Acar et al. 2021); no server step size", a.feddyn,
          {"alpha": 0.01, "client_lr": CLIENT_LR}),
      # ---- personalized ----------------------------------------------------------------------------------------
      "ditto": lambda a: Spec(
          "personalized", "FedAvg for w, proximal personal models v_k (Li et al. 2021)", a.ditto,
          {"lam": 0.1, "eta": CLIENT_LR, "personal_steps": 5, "client_lr": CLIENT_LR,
           "server_optimizer": "fedavg", "server_lr": 1.0}),
      "pfedme": lambda a: Spec(
          "personalized", "Moreau-envelope personal models (Dinh et al. 2020)", a.pfedme,
          {"lam": 15.0, "eta": CLIENT_LR, "beta": 1.0, "inner_steps": 5, "inner_lr": 0.03},
          lambda ctx, h: {"local_steps": ctx.local_steps}),
      "per_fedavg": lambda a: Spec(
          "personalized", "MAML-style meta-learning, first-order (Fallah et al. 2020)", a.per_fedavg,
          {"alpha": 0.1, "beta": CLIENT_LR},
          lambda ctx, h: {"local_steps": max(1, ctx.local_steps // _per_fedavg_batches(h))},
          data_steps=lambda h, s: _per_fedavg_batches(h) * max(1, s // _per_fedavg_batches(h))),
      "fedavg_ft": lambda a: Spec(
          "personalized", "FedAvgM, then FedAvg, then local fine-tuning (Jiang et al. 2019)",
          a.fedavg_finetune,
          {"client_lr": CLIENT_LR, "server_optimizer": "fedavgm", "server_lr": 0.3,
           "switch_round": None, "personalize_steps": 10, "finetune_lr": 0.025,
           "personalize_lr": CLIENT_LR},
          _fedavg_finetune_wire),
      "fedem": lambda a: Spec(
          "personalized", "M shared component models, per-client mixture weights by EM (Marfoq et al. "
          "2021)", a.fedem, {"num_components": 3, "client_lr": CLIENT_LR, "server_optimizer": "fedavg",
                             "server_lr": 1.0}, eval_model=a.fedem_mixture_model),
      "ifca": lambda a: Spec(
          "personalized", "K cluster models, each client trains the one of lowest loss (Ghosh et al. 2020)",
          a.ifca, {"num_clusters": 4, "client_lr": CLIENT_LR, "averaging": "model", "server_lr": 1.0},
          lambda ctx, h: {} if h["averaging"] == "gradient" else {"server_optimizer": None}),
      "clustered_fl": lambda a: Spec(
          "personalized", "FedAvg per cluster, split by the cosine similarity of updates at a "
          "stationary point (Sattler et al. 2020)", a.clustered_fl,
          {"eps_1": 0.4, "eps_2": 1.6, "max_clusters": 8, "client_lr": CLIENT_LR}, sampling="all"),
      "fedmd": lambda a: Spec(
          "personalized", "no model is shared: clients distil towards the mean of their scores on "
          "public examples, then train on their own (Li & Wang 2019); test acc is client 0's model", a.fedmd,
          {"public_size": 1000, "public_per_round": 500, "digest_steps": 10, "digest_batch_size": 50,
           "client_lr": CLIENT_LR, "architectures": None}, _fedmd_wire, sampling="all", wrap=_fedmd_wrap,
          scorer=_fedmd_scorer, tables=_fedmd_tables),
      "l2gd": lambda a: Spec(
          "personalized", "mixture of global and local models, full gradients (Hanzely & Richtárik 2020)",
          a.l2gd, {"lam": 0.1, "alpha": None, "p": 0.2, "local_lr": CLIENT_LR}, _l2gd_wire, sampling="full"),
      "l2sgd_plus": lambda a: Spec(
          "personalized", "L2GD with per-example variance reduction (Hanzely & Richtárik 2020)",
          a.l2sgd_plus, {"lam": 0.1, "alpha": None, "p": 0.2, "example_lr": 0.003},
          _l2sgd_plus_wire, sampling="full_fixed"),
      "fedu": lambda a: Spec(
          "personalized", "decentralized Laplacian-regularized personal models on a ring (Dinh et al. 2021)",
          a.fedu, {"lam": 0.1, "eta": CLIENT_LR}, lambda ctx, h: {"local_steps": ctx.local_steps},
          graph="ring"),
      "easgd": lambda a: Spec(
          "personalized", "elastic averaging of local models and a center (Zhang et al. 2015)", a.easgd,
          {"alpha": 0.1, "client_lr": CLIENT_LR}),
      # ---- ADMM (convex) ---------------------------------------------------------------------------------------
      "admm_consensus": lambda a: Spec(
          "admm", "consensus ADMM, inexact local steps, pooled-risk objective (Boyd et al. 2011)",
          a.admm_consensus, {"rho": 0.1, "objective": "examples", **admm_local}, _local,
          sampling="full", objective="pooled", convex=True),
      "gadmm": lambda a: Spec(
          "admm", "group ADMM on a chain of workers, no server (Elgabli et al. 2020)", a.gadmm,
          {"rho": 0.1, "objective": "examples", **admm_local}, _local, graph="chain",
          sampling="full", objective="pooled", convex=True),
      "cq_ggadmm": lambda a: Spec(
          "admm", "censored and quantized GADMM on a chain (Issaid et al. 2020)", a.cq_ggadmm,
          {"rho": 0.1, "tau0": 0.5, "xi": 0.9, "bits": 8, "objective": "examples", **admm_local},
          _local, graph="chain", sampling="full", objective="pooled", convex=True),
      "mixture_admm": lambda a: Spec(
          "admm", "ADMM on the mixture of global and local models (personalized)", a.mixture_admm,
          {"lam": 0.1, "rho": 0.1, **admm_local}, _local, sampling="full", objective="mixture",
          convex=True),
      # ---- classical distributed baselines (convex) -------------------------------------------------------------
      "dane": lambda a: Spec(
          "distributed", "each client minimises its loss corrected to first order towards the global one, the "
          "solutions averaged (Shamir et al. 2014); Newton local solver", a.dane,
          {"eta": 1.0, "mu": 0.1, "local_steps": 3, "cg_iters": None, **distributed}, _newton_wire,
          sampling="full", objective="pooled", convex=True),
      "feddane": lambda a: Spec(
          "distributed", "DANE with η = 1 on the round's sampled clients (Li et al. 2019); Newton local solver "
          "on each client's --local-steps × --batch-size examples", a.feddane,
          {"mu": 0.1, "local_steps": 3, "cg_iters": None, **distributed}, _newton_wire, objective="pooled",
          convex=True),
      "fadl": lambda a: Spec(
          "distributed", "DANE's local problem (η = 1), then Armijo's line search along the averaged direction "
          "(Mahajan et al. 2013)", a.fadl,
          {"mu": 0.01, "local_steps": 3, "cg_iters": None, "line_search_steps": 10, "armijo": 1e-4,
           **distributed}, _newton_wire, sampling="full", objective="pooled", convex=True),
      "giant": lambda a: Spec(
          "distributed", "the average of the clients' Newton directions (conjugate gradient), Armijo's line search "
          "(Wang et al. 2018)", a.giant,
          {"cg_iters": 20, "line_search_steps": 10, "armijo": 1e-4, **distributed},
          sampling="full", objective="pooled", convex=True),
      "cocoa": lambda a: Spec(
          "distributed", "CoCoA+: local SDCA on each client's dual block, the updates added (Ma et al. 2015); two "
          "classes, a linear model with the squared (ridge) or hinge (SVM) loss, λ = l2", a.cocoa,
          {"gamma": 1.0, "loss": "squared", **distributed}, _cocoa_wire, sampling="full_fixed", objective="pooled",
          convex=True, wrap=_cocoa_wrap, scorer=_cocoa_scorer, reference=_cocoa_reference),
      "one_shot_average": lambda a: Spec(
          "distributed", "every client solves its own problem (Newton), the server averages the solutions once "
          "(Zhang et al. 2013)", a.one_shot_average, {"local_steps": 5, "cg_iters": None, **distributed},
          _newton_wire, sampling="full", objective="pooled", convex=True, wrap=_one_shot_wrap),
      # ---- decentralized (--topology) -------------------------------------------------------------------------
      "gossip": lambda a: Spec(
          "decentralized", "local SGD, then averaging with the neighbours: x ← W(x + Δ) (decentralized "
          "FedAvg)", a.gossip, {"eta": CLIENT_LR}, graph="topology", sampling="nodes"),
      "dpsgd": lambda a: Spec(
          "decentralized", "D-PSGD: x_i ← Σ_j W_ij x_j − η ∇f_i(x_i), one step per batch "
          "(Lian et al. 2017)", a.dpsgd, {"eta": CLIENT_LR}, graph="topology", sampling="nodes"),
      "gradient_tracking": lambda a: Spec(
          "decentralized", "DIGing: tracks the average gradient, exact under heterogeneity "
          "(Nedić et al. 2017)", a.gradient_tracking, {"eta": CLIENT_LR}, graph="topology", sampling="nodes"),
      "d_fedem": lambda a: Spec(
          "decentralized", "FedEM without a server: each node's components averaged with its "
          "neighbours (Marfoq et al. 2021)", a.d_fedem, {"num_components": 3, "client_lr": CLIENT_LR},
          graph="topology", sampling="nodes", eval_model=a.fedem_mixture_model),
      "p2p_bayes": lambda a: Spec(
          "decentralized", "beliefs over K candidate models (the fit and K − 1 moved away from it): Bayes' "
          "rule on each node's batches, then geometric averaging with the neighbours (Lalitha et al. 2019)",
          a.p2p_bayes, {"num_hypotheses": 8, "spread": 0.5, "fit_l2": 1e-3, "concentration": 0.99}, _p2p_wire,
          graph="topology", sampling="nodes", convex=True, summary=_p2p_summary),
      # ---- matched averaging (host-driven) --------------------------------------------------------------------
      "fedma": lambda a: Spec(
          "matched", "match hidden units layer by layer (BBP-MAP, Hungarian), average, retrain the layers "
          "above; each client restarts from its matched units (Wang et al. 2020); widths follow the matching",
          a.fedma,
          {"client_lr": CLIENT_LR, "sigma": 1.0, "sigma0": 1.0, "gamma": 1.0, "iterations": 3},
          _fedma_wire, eval_model=_fedma_model, train_model=_fedma_model),
      # ---- asynchronous (--async) ------------------------------------------------------------------------------
      "fedbuff": lambda a: Spec(
          "asynchronous", "buffer K stale deltas, then a server step (Nguyen et al. 2022); K default C/2",
          a.fedbuff, {"client_lr": CLIENT_LR, "buffer_size": None, "staleness_weight": "polynomial",
                      "server_optimizer": "fedavg", "server_lr": 1.0, "history_size": None},
          _fedbuff_wire, sampling="events"),
      "fedasync": lambda a: Spec(
          "asynchronous", "mix each arriving model in by a staleness weight (Xie et al. 2019)",
          a.fedasync, {"alpha": 0.6, "client_lr": CLIENT_LR, "staleness_weight": "polynomial",
                      "history_size": None},
          _async_wire, sampling="events"),
      "co_op": lambda a: Spec(
          "asynchronous", "merge each arriving model by its age, drop the too old (Wang 2017); "
          "max_age default 4C", a.co_op,
          {"alpha": 0.6, "max_age": None, "client_lr": CLIENT_LR, "history_size": None},
          _co_op_wire, sampling="events"),
      "zeno_plus_plus": lambda a: Spec(
          "asynchronous", "apply a stale gradient only if it passes a validation test (Xie et "
          "al. 2020); 64 pooled train examples on the server", a.zeno_plus_plus,
          {"gamma": 0.2, "rho": 0.01, "eps": 0.2, "history_size": None}, _zeno_wire, sampling="events"),
  }


class _Registry(Mapping[str, Spec]):
  """Name → `Spec`, each built the first time it is read.

  The names are known at once, so checking `--algorithms` imports no JAX; a
  `Spec` holds its factory, so building one imports that algorithm's family.
  """

  def __init__(self, builders: dict[str, Callable[[Any], Spec]]):
    self._builders = builders
    self._specs: dict[str, Spec] = {}

  def __getitem__(self, name: str) -> Spec:
    if name not in self._specs:
      builder = self._builders[name]
      from fedjax_opt import algorithms

      self._specs[name] = builder(algorithms)
    return self._specs[name]

  def __contains__(self, name: object) -> bool:
    return name in self._builders

  def __iter__(self):
    return iter(self._builders)

  def __len__(self) -> int:
    return len(self._builders)


REGISTRY: Mapping[str, Spec] = _Registry(_builders())
"""Every algorithm of the command line, by name."""


class HyperParameterError(ValueError):
  """A bad `--set` key or value (reported as one line)."""


def refuse_aggregation(flag: str, names) -> str | None:
  """None when every algorithm of `names` takes `aggregator=` (`Spec.takes_aggregator`); otherwise the refusal of
  `flag` (as the user typed it: "--aggregator krum", "--compression sign"), one line quoting each refusing
  factory's declared reason (`factory.aggregation`)."""
  refused = [name for name in names if not REGISTRY[name].takes_aggregator]
  if not refused:
    return None
  return f"{flag} needs algorithms whose factory takes aggregator=; " + "; ".join(
      f"{name} takes none: {REGISTRY[name].aggregation}" for name in refused)


def refuse_downlink(flag: str, names) -> str | None:
  """None when every algorithm of `names` applies a downlink chained in its aggregator (`factory.downlink`);
  otherwise the refusal of `flag`, one line quoting each refusing factory's declared reason."""
  from fedjax_opt.core.execution import TAKES_DOWNLINK

  refused = [name for name in names if REGISTRY[name].factory.downlink != TAKES_DOWNLINK]
  if not refused:
    return None
  return f"{flag} needs algorithms whose server compresses one broadcast model; " + "; ".join(
      f"{name} takes no downlink: {REGISTRY[name].factory.downlink}" for name in refused)


def check_registry() -> None:
  """Every default names a factory parameter or a `PSEUDO` one; `server_lr` names a default; every factory declares
  how it treats `aggregator=`, its evaluation and its exchanges."""
  from fedjax_opt.core import execution

  for name, spec in REGISTRY.items():
    params = inspect.signature(spec.factory).parameters
    declared = getattr(spec.factory, "aggregation", None)
    if not isinstance(declared, str) or "\n" in declared or not declared.strip():
      raise AssertionError(f"{name}: {spec.factory.__name__} declares no aggregation (core.execution."
                           f"accepts_policy_keywords: factory.aggregation); got {declared!r}")
    for what in ("evaluation", "exchanges"):
      if getattr(spec.factory, what, None) is None:
        raise AssertionError(f"{name}: {spec.factory.__name__} declares no {what} (core.execution."
                             f"accepts_policy_keywords(..., {what}=...))")
    if "server_lr" in spec.defaults and spec.server_lr != "server_lr" and (
        execution.SERVER_OPTIMIZER not in spec.factory.hyperparameters.values()):
      raise AssertionError(f"{name}: the default server_lr builds a server optimizer, but "
                           f"{spec.factory.__name__} declares none (hyperparameters: {execution.SERVER_OPTIMIZER!r})")
    for key in spec.defaults:
      if key not in params and key not in PSEUDO:
        raise AssertionError(f"{name}: default {key!r} is neither a parameter of {spec.factory.__name__} "
                             f"nor one of {sorted(PSEUDO)}")
      if key in WIRED and key not in PSEUDO:
        raise AssertionError(f"{name}: {key!r} is filled by the command line and cannot have a default")
    if spec.server_lr is not None and spec.server_lr not in spec.defaults:
      raise AssertionError(f"{name}: server_lr={spec.server_lr!r} is not one of its defaults")
    if spec.family not in FAMILIES:
      raise AssertionError(f"{name}: unknown family {spec.family!r}")
    if ("graph" in params) != (spec.graph is not None):
      raise AssertionError(f"{name}: {spec.factory.__name__} {'takes' if 'graph' in params else 'takes no'} graph=, "
                           f"but its Spec has graph={spec.graph!r}")
    if (spec.graph == "topology") != (spec.family == "decentralized"):
      raise AssertionError(f"{name}: the run's --topology graph is for the decentralized family exactly")
    if spec.graph is not None and spec.graph != "topology":
      from fedjax_opt import graphs

      if not callable(getattr(graphs, spec.graph, None)):
        raise AssertionError(f"{name}: graph={spec.graph!r} is neither 'topology' nor a fo.graphs builder")


def _coerce(name: str, key: str, value: Any, default: Any) -> Any:
  """`value` in the type of `default` (ints widen to floats; None/CLIENT_LR defaults take numbers or strings)."""
  where = f"{name}.{key}"
  if isinstance(default, bool):
    if not isinstance(value, bool):
      raise HyperParameterError(f"{where} must be true or false; got {value!r}")
    return value
  if isinstance(default, (int, float)) or default is CLIENT_LR:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value):
      raise HyperParameterError(f"{where} must be a finite number; got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool) and default is not CLIENT_LR:
      if isinstance(default, int) and not float(value).is_integer():
        raise HyperParameterError(f"{where} must be an integer; got {value!r}")
      return int(value) if isinstance(default, int) else float(value)
    return float(value)
  if isinstance(default, str):
    if not isinstance(value, str):
      raise HyperParameterError(f"{where} must be a string; got {value!r}")
    return value
  return value  # default None: the factory checks it


DEFAULT_CLIENT_LR = 0.05
"""What `CLIENT_LR` defaults are when `--client-lr` is not given."""


def resolve(name: str, overrides: Mapping[str, Any], client_lr: float | None) -> dict[str, Any]:
  """The hyper-parameters of `name`: its defaults, then `overrides`, checked; `CLIENT_LR` filled in.

  `client_lr` is the run's `--client-lr`: when given (not None) it is every `CLIENT_LR` default and the
  algorithm's own `client_lr` default too (an explicit `--client-lr` is never ignored); when None, `CLIENT_LR`
  defaults are `DEFAULT_CLIENT_LR` and numeric defaults stay.
  """
  spec = REGISTRY[name]
  settable = spec.settable()
  out = {}
  for key, value in overrides.items():
    if key not in settable:
      known = ", ".join(sorted(settable))
      raise HyperParameterError(f"{name} has no hyper-parameter {key!r}; settable: {known}")
    default = settable[key]
    out[key] = _coerce(name, key, value, default) if default is not inspect.Parameter.empty else value
  hyper = {k: v for k, v in spec.defaults.items()}
  if client_lr is not None and "client_lr" in hyper:
    hyper["client_lr"] = client_lr
  hyper.update(out)
  fill = DEFAULT_CLIENT_LR if client_lr is None else client_lr
  return {k: (fill if v is CLIENT_LR else v) for k, v in hyper.items()}


def build(name: str, ctx: Context, hyper: Mapping[str, Any]):
  """The `FederatedAlgorithm` `name` with `hyper` (from `resolve`); a factory's ValueError/TypeError as one line."""
  spec = REGISTRY[name]
  hyper = dict(hyper)
  params = inspect.signature(spec.factory).parameters
  try:
    loss_fn = _ridge(ctx.loss_fn if spec.train_model is None else spec.train_model(ctx.model).loss_fn,
                     hyper.get("l2", 0.0))
    kwargs = {**declared_wiring(spec, hyper), **spec.wire(ctx, hyper)}
    loss_fn = kwargs.pop("loss_fn", loss_fn)
    if spec.graph is not None:
      kwargs["graph"] = ctx.graph if spec.graph == "topology" else _builder_graph(spec.graph, ctx.num_clients)
    for key, value in hyper.items():  # a value set by the user wins over the wiring; None leaves the wiring
      if key not in PSEUDO and (value is not None or key not in kwargs):
        kwargs[key] = value
    if "num_clients" in params:
      kwargs["num_clients"] = ctx.num_clients
    if "client_map" in params:
      kwargs["client_map"] = ctx.client_map
    if ctx.aggregator is not None and spec.takes_aggregator:
      kwargs["aggregator"] = ctx.aggregator
    # A factory whose signature has no loss_fn (CoCoA+: its own losses on a linear model) is called without it.
    takes_loss = "loss_fn" in params
    algo = spec.factory(loss_fn, **kwargs) if takes_loss else spec.factory(**kwargs)
    return algo if spec.wrap is None else spec.wrap(algo, ctx, hyper)
  except (ValueError, TypeError) as e:
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise HyperParameterError(f"{name}: {message}") from None


def describe_defaults(name: str) -> str:
  """`lam=0.1 eta=--client-lr ...; also: ...` for `fedjax-opt list algorithms`."""
  spec = REGISTRY[name]
  show = lambda k, v: f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
  text = " ".join(show(k, v) for k, v in spec.defaults.items())
  also = {k: v for k, v in spec.settable().items() if k not in spec.defaults}
  if also:
    text += "; also " + " ".join(show(k, v) for k, v in also.items())
  return text
