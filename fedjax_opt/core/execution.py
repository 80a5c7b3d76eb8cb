"""The execution policy: how clients run, set once for every algorithm, read when a step is traced.

How the clients of a round are computed is not a hyper-parameter of any
algorithm: it changes speed and memory, never the method. It is one policy
with three parts,

* `client_map`: the client map (`fedjax_opt.core.client_map`: "auto",
  "vmap", "chunked:64", "sequential", "sharded", a mode object); default "auto";
* `precision`: the dtype of the clients' forward and backward passes,
  "float32" (default: the model's own dtypes) or "bfloat16" (mixed
  precision: parameters, optimizer state, updates and the loss stay float32;
  `core.local.masked_mean_loss` casts the floating parameters and data to
  bfloat16 for the loss and its gradient, and the loss back to float32);
* `storage_dtype`: the dtype of per-client tables (`core.per_client.init`:
  SCAFFOLD's c_i, Ditto's v_i, error-feedback residuals ...); None keeps the
  model's dtype;

set in one of two ways, which nest (an inner setting wins, field by field):

    with fo.execution(client_map="chunked:64", precision="bfloat16"):
      state = jax.jit(algorithm.step)(state, batches)      # traced here: uses the policy

    fast = fo.with_execution(algorithm, client_map="chunked:64")   # init/step/personalize run under it

The policy is read when a function is traced. It is part of jit's cache key
(a JAX configuration state, as `jax.default_matmul_precision` is), so a step
traced under one policy is traced again, not reused, under another.

Every algorithm factory also takes the policy's keywords itself, through one
decorator, `accepts_policy_keywords`: `client_map=` (every factory) and
`storage_dtype=` (the factories that keep per-client tables). A value given
there is `with_execution(factory(...), client_map=..., storage_dtype=...)`:
it overrides the surrounding policy for that algorithm, field by field; None,
their default, leaves the policy's. No factory declares them itself.

The same decorator carries each factory's declaration, as data, of how it
treats `aggregator=` (`factory.aggregation`): `TAKES_AGGREGATOR` when the
factory's own signature has `aggregator`, otherwise the reason it takes none
(`refuses_aggregator=`: an exact mean the method needs, no server ...), for
which `factory(..., aggregator=a)` is refused in one line; None there is the
factory's only aggregation and changes nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import types
from typing import Any, Callable, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

__all__ = ["CLIENT_OPTIMIZER", "CLIENT_STEP_SIZE", "COUNT", "DECLARATIONS", "EVALUATIONS", "HYPERPARAMETER_ROLES",
           "MIXING_WEIGHT", "MOMENTUM", "PENALTY", "POLICY_KEYWORDS", "PRECISIONS", "PRIOR", "PROBABILITY",
           "PROBLEM_CONSTANT", "Policy", "REGULARIZER", "REPORTED_EXCHANGES", "SCALE", "SERVER_OPTIMIZER",
           "SERVER_STEP_SIZE", "STALENESS", "STEP_SIZE", "TAKES_AGGREGATOR", "TAKES_DOWNLINK", "THRESHOLD",
           "accepts_policy_keywords", "compute_dtype", "current", "execution", "with_execution"]

PRECISIONS = ("float32", "bfloat16")
"""The client compute precisions `execution(precision=...)` accepts."""

@dataclasses.dataclass(frozen=True)
class Policy:
  """How clients run (module docstring). None in a field: the enclosing policy's value (or the default).

  Attributes:
    client_map: a client map mode or its name; None: "auto".
    precision: "float32" or "bfloat16"; None: "float32".
    storage_dtype: dtype of per-client tables; None: the model's.
  """

  client_map: Any = None
  precision: str | None = None
  storage_dtype: Any = None

  def over(self, outer: Policy) -> Policy:
    """This policy's fields where set, `outer`'s elsewhere."""
    return Policy(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(outer, f.name)
                     for f in dataclasses.fields(self)})


_POLICY = contextvars.ContextVar("fedjax_opt_execution_policy", default=Policy())


def _jit_key_state():
  """A JAX configuration state in jit's cache key, so a function traced under one policy is traced again under
  another (JAX caches traces by function, and knows nothing of this module's context). None where this JAX has
  no such state; the policy then holds only for functions not traced before (module docstring)."""
  try:
    from jax._src import config as jax_config  # pylint: disable=import-outside-toplevel
    return jax_config.string_or_object_state("fedjax_opt_execution_policy", None,
                                             "fedjax_opt's execution policy (fedjax_opt.core.execution).",
                                             include_in_jit_key=True, include_in_trace_context=True)
  except Exception:  # pylint: disable=broad-except  (a JAX without it)
    return None


_JIT_KEY = _jit_key_state()


@contextlib.contextmanager
def _entered(policy: Policy) -> Iterator[Policy]:
  token = _POLICY.set(policy)
  try:
    if _JIT_KEY is None:
      yield policy
    else:
      with _JIT_KEY(repr(policy)):
        yield policy
  finally:
    _POLICY.reset(token)


def _check(client_map: Any, precision: Any, storage_dtype: Any) -> Policy:
  if client_map is not None:
    from fedjax_opt.core.client_map import modes  # pylint: disable=import-outside-toplevel  (modes reads the policy)
    client_map = modes.resolve(client_map)
    if isinstance(client_map, modes.FromPolicy):
      raise ValueError("client_map: a policy names a client map ('auto', 'vmap', 'chunked:64' ...), not FromPolicy.")
  if precision is not None and precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}.")
  if storage_dtype is not None:
    try:
      dtype = np.dtype(storage_dtype)
    except TypeError as error:
      raise TypeError(f"storage_dtype must be a floating dtype such as jnp.bfloat16; got {storage_dtype!r}.") from error
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"storage_dtype must be a floating dtype such as jnp.bfloat16; got {dtype}.")
  return Policy(client_map, precision, storage_dtype)


def current() -> Policy:
  """The policy in force where this is called (every field filled: the defaults where nothing set one)."""
  policy = _POLICY.get()
  return Policy(policy.client_map if policy.client_map is not None else "auto",
                policy.precision or "float32", policy.storage_dtype)


@contextlib.contextmanager
def execution(*, client_map: Any = None, precision: str | None = None,
              storage_dtype: Any = None) -> Iterator[Policy]:
  """Sets the execution policy for every step traced inside (module docstring); None keeps the enclosing value.

  Args:
    client_map: the client map ("auto", "vmap", "chunked:K", "sequential", "sharded", a mode object).
    precision: "float32" or "bfloat16" (client forward and backward passes; state stays float32).
    storage_dtype: the dtype of per-client tables (e.g. `jnp.bfloat16`).

  Yields:
    The policy now in force.
  """
  with _entered(_check(client_map, precision, storage_dtype).over(_POLICY.get())) as policy:
    yield policy


def compute_dtype() -> Any:
  """The dtype client losses are computed in under the current policy: None (the model's own) or bfloat16."""
  return jnp.bfloat16 if current().precision == "bfloat16" else None


def _under(policy: Policy, fn: Callable) -> Callable:
  """`fn` run under `policy` (its fields where set, the caller's elsewhere)."""

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with _entered(policy.over(_POLICY.get())):
      return fn(*args, **kwargs)

  return run


def with_execution(algorithm: Any, *, client_map: Any = None, precision: str | None = None,
                   storage_dtype: Any = None) -> Any:
  """`algorithm` whose functions (`init`, `step`, `personalize` ...) run under this policy (fields left None:
  the caller's).

  Args:
    algorithm: a `FederatedAlgorithm`, or another NamedTuple of an algorithm's functions (a sweep's, FedMA's
      `MatchedAveraging(init, run, match)`).
    client_map, precision, storage_dtype: as in `execution`.

  Returns:
    The same kind of object, each function field wrapped (other fields kept); calling one enters the policy,
    so a `jax.jit` of the wrapped step traces under it, and `init` builds per-client tables in its storage dtype.
  """
  return _wrapped(algorithm, _check(client_map, precision, storage_dtype))


def _wrapped(algorithm: Any, policy: Policy) -> Any:
  """`algorithm` (a NamedTuple) with every function field run under `policy`; its other fields as they are."""
  fields = getattr(algorithm, "_fields", ())
  if not hasattr(algorithm, "_replace") or not any(callable(getattr(algorithm, name)) for name in fields):
    raise TypeError(f"with_execution: algorithm must be a FederatedAlgorithm (fo.algorithms.fedavg(...)) or "
                    f"another NamedTuple of an algorithm's functions; got {type(algorithm).__name__}.")
  return algorithm._replace(**{name: _under(policy, getattr(algorithm, name)) for name in fields
                               if callable(getattr(algorithm, name))})


POLICY_KEYWORDS = ("client_map", "storage_dtype")
"""The policy fields an algorithm factory takes as keywords (`accepts_policy_keywords`). `precision` is not
one: it is set by `execution` / `with_execution` only."""

_KEYWORD_ANNOTATIONS = {"client_map": "ClientMap | str | None", "storage_dtype": "Any"}

_KEYWORD_DOCS = {
    "client_map": ("client_map: how this algorithm's clients are mapped (\"vmap\", \"chunked:K\", \"sharded\" ...,\n"
                   "      a mode of `fedjax_opt.core.client_map`); None: the policy's (\"auto\" unless one sets it)."),
    "storage_dtype": ("storage_dtype: the dtype of this algorithm's per-client tables (e.g. `jnp.bfloat16`); None:\n"
                      "      the policy's (the model's dtype unless one sets it)."),
}
"""The paragraph each keyword gets in a decorated factory's docstring."""


TAKES_DOWNLINK = "applies the aggregator's downlink"
"""`factory.downlink` of a factory whose server step applies a downlink chained in its `aggregator=`
(`fo.aggregators.chain(..., aggregator, fo.compression.downlink(...))`); any other factory holds the reason it takes
none (`accepts_policy_keywords(..., refuses_downlink=...)`, or, taking no aggregator, its `aggregation` reason)."""

TAKES_AGGREGATOR = "takes aggregator="
"""`factory.aggregation` of a factory that takes `aggregator=` (its own signature has it); a factory that takes none
holds the reason it declared instead (`accepts_policy_keywords(..., refuses_aggregator=...)`)."""


def _aggregator_label(aggregator: Any) -> str:
  """A name for a refused `aggregator=` value in a message: its declared traits' name, a stage's name, its type."""
  traits = getattr(aggregator, "traits", None)
  return getattr(traits, "name", None) or getattr(aggregator, "name", None) or type(aggregator).__name__


def _zero_argument(constructor: Any) -> bool:
  """`constructor` is callable with no arguments (a class or function whose parameters all have defaults)."""
  if not callable(constructor):
    return False
  try:
    inspect.signature(constructor).bind()
  except TypeError:
    return False
  except ValueError:  # no signature to read (a builtin): take it as callable
    return True
  return True


def _constructor_label(constructor: Any) -> str:
  """A short name for a declared `default_aggregator=` in a message: its qualified name, or an object's type."""
  if isinstance(constructor, str):
    return repr(constructor)
  return getattr(constructor, "__qualname__", None) or (
      f"an instance of {type(constructor).__name__} ({_aggregator_label(constructor)}), not a constructor")


def accepts_policy_keywords(factory: Callable, *, storage_dtype: bool = False,
                            refuses_aggregator: str | None = None,
                            default_aggregator: Callable[[], Any] | None = None,
                            refuses_downlink: str | None = None,
                            evaluation: str | None = None, exchanges: tuple[int, int] | str | None = None,
                            hyperparameters: Mapping[str, str] | None = None) -> Callable:
  """`factory` that also takes the execution policy's keywords: `client_map=` (and, with `storage_dtype=True`,
  `storage_dtype=`), keyword-only, default None; and that declares, as data, how it treats `aggregator=`.

  The rule: `factory(..., client_map=m, storage_dtype=d)` is `with_execution(factory(...), client_map=m,
  storage_dtype=d)`. A keyword given (not None) overrides the surrounding policy (`execution`) for this
  algorithm, field by field, exactly as `with_execution` does: its `init`, `step` and any other function
  field run under it, so `init` builds per-client tables in `d` and a step is traced with client map `m`
  whatever context it is traced in; a keyword left None is the policy in force at trace (or init) time. With
  no keyword given the factory's algorithm is returned as it is. A bad value is refused when the factory is
  called, in one line (the checks of `execution`). The factory itself declares neither keyword and reads the
  policy (`client_map.FromPolicy()`, `per_client.init`); `inspect.signature` of the result shows the
  factory's own parameters with the keywords appended, and its docstring gains a paragraph on them.

  Aggregation. A factory whose own signature has `aggregator` takes one (`result.aggregation` is
  `TAKES_AGGREGATOR`); every other factory must say why it takes none, `refuses_aggregator="..."` (one line: the
  exact mean its method needs, the server it does not have ...), and `result.aggregation` is that reason. Such a
  factory refuses `aggregator=a` for any `a` other than None with a ValueError, in one line naming the factory
  and the reason, before it runs; `aggregator=None` changes nothing (the factory's own aggregation, as without
  the keyword). Its signature does not list `aggregator` (it takes none); its docstring gains the reason. A
  declaration that contradicts the signature, or a factory without `aggregator` that declares no reason, is a
  TypeError when the decorator is applied.

  Default aggregator. A factory that takes `aggregator=` declares the rule it uses when given none,
  `default_aggregator=` a zero-argument constructor (`aggregators.weighted_mean`, `aggregators.mean`), exposed as
  `result.default_aggregator` (None for a factory that takes no aggregator). It is the one source of that
  default: the factory's body resolves `aggregator=None` with the same constructor (a module-level name passed
  both here and to `aggregators.resolve`), so `factory(..., aggregator=factory.default_aggregator())` is the
  factory's default algorithm, and the command line reads it from here. Required exactly when the factory takes
  `aggregator=` and refused otherwise: a TypeError when the decorator is applied.

  What the algorithm is, as data (`result.evaluation`, `result.exchanges`, `result.hyperparameters`; the command
  line reads them, `fedjax_opt/cli/registry.py`):

    evaluation: what its state offers to evaluate, a key of `EVALUATIONS`: "global" (`state.params`), "table"
      (a model per client, `fo.personalized_params(state)`, N rows) or "adapt" (the global model adapted on
      each client, `algorithm.personalize`).
    exchanges: what one round sends: `(uploads, broadcasts)`, model-sized uploads per client taking part and
      model-sized broadcasts (FedAvg `(1, 1)`, SCAFFOLD `(2, 2)`), or, for an algorithm whose own metrics count
      its communication, a key of `REPORTED_EXCHANGES` ("metrics": `bits_up` / `bits_down`; "bits"; "bytes":
      `bytes_sent` per node).
    hyperparameters: `{parameter: role}` for the factory's hyper-parameters, each role one of
      `HYPERPARAMETER_ROLES` (`CLIENT_STEP_SIZE`, `SERVER_STEP_SIZE`, `REGULARIZER`, `MIXING_WEIGHT`, `COUNT` ...);
      at most one parameter is the server step size.

  Each is optional here (None: not declared; `result.hyperparameters` is then empty); the convention test requires
  evaluation and exchanges of every factory. A key that is not a parameter of the factory, an unknown role, kind
  of evaluation or exchange is a TypeError in one line when the decorator is applied.

  Downlink. A factory that takes `aggregator=` applies the aggregator's server stage, its downlink
  (`Aggregator.downlink`, chained last: `core.averaging.server_step`), unless it declares why it cannot,
  `refuses_downlink="..."` (one line: it broadcasts more than one model, or its method needs the exact broadcast);
  then an aggregator with a downlink is refused with a ValueError in one line naming the factory and the reason,
  before the factory runs. `result.downlink` is `TAKES_DOWNLINK` or that reason (for a factory that takes no
  aggregator, its aggregation reason: there is nothing to chain a downlink to). The convention test checks that
  every factory declared `TAKES_DOWNLINK` compresses its broadcast with the chained downlink.

  Applied by a call after the definition, `fedavg = execution.accepts_policy_keywords(fedavg,
  default_aggregator=_DEFAULT_AGGREGATOR)` (with `storage_dtype=True` for factories that keep per-client tables,
  `refuses_aggregator="why"` instead of `default_aggregator=` for those that take no aggregator), not as `@`
  syntax: mutmut 3 leaves decorated functions unmutated, and a factory's body is where its update rule is
  (tools/mutation.py).
  """
  names = POLICY_KEYWORDS if storage_dtype else POLICY_KEYWORDS[:1]
  own = inspect.signature(factory)
  declared = [name for name in names if name in own.parameters]
  if declared or any(p.kind == p.VAR_KEYWORD for p in own.parameters.values()):
    raise TypeError(f"accepts_policy_keywords: {factory.__qualname__} must not declare {declared or '**kwargs'} "
                    f"itself; the decorator supplies {', '.join(names)} (module docstring).")
  takes = "aggregator" in own.parameters
  if takes and refuses_aggregator is not None:
    raise TypeError(f"accepts_policy_keywords: {factory.__qualname__} takes aggregator= (its signature has it), so "
                    f"it cannot declare refuses_aggregator={refuses_aggregator!r}.")
  if not takes:
    if refuses_aggregator is None:
      raise TypeError(f"accepts_policy_keywords: {factory.__qualname__} takes no aggregator=; declare why, "
                      f"accepts_policy_keywords({factory.__name__}, refuses_aggregator=\"...\") (module docstring).")
    if not isinstance(refuses_aggregator, str) or not refuses_aggregator.strip() or "\n" in refuses_aggregator:
      raise TypeError(f"accepts_policy_keywords: refuses_aggregator must be a non-empty one-line str (the reason "
                      f"{factory.__qualname__} takes no aggregator=); got {refuses_aggregator!r}.")
    if default_aggregator is not None:
      raise TypeError(f"accepts_policy_keywords: {factory.__qualname__} takes no aggregator=, so it cannot declare "
                      f"default_aggregator={_constructor_label(default_aggregator)}.")
    if refuses_downlink is not None:
      raise TypeError(f"accepts_policy_keywords: {factory.__qualname__} takes no aggregator=, so it has no downlink "
                      f"to refuse (its aggregation reason says why).")
  else:
    if default_aggregator is None:
      raise TypeError(f"accepts_policy_keywords: {factory.__qualname__} takes aggregator=; declare the rule it uses "
                      f"when given none, accepts_policy_keywords({factory.__name__}, default_aggregator="
                      f"aggregators.weighted_mean) (module docstring).")
    if not _zero_argument(default_aggregator):
      raise TypeError(f"accepts_policy_keywords: default_aggregator of {factory.__qualname__} must be a "
                      f"zero-argument constructor of an aggregator (aggregators.weighted_mean); got "
                      f"{_constructor_label(default_aggregator)}.")

  if refuses_downlink is not None and (not isinstance(refuses_downlink, str) or not refuses_downlink.strip()
                                       or "\n" in refuses_downlink):
    raise TypeError(f"accepts_policy_keywords: refuses_downlink must be a non-empty one-line str (the reason "
                    f"{factory.__qualname__} takes no downlink); got {refuses_downlink!r}.")
  declared = _declarations(factory, own, evaluation, exchanges, hyperparameters)

  @functools.wraps(factory)
  def build(*args, **kwargs):
    given = {name: kwargs.pop(name, None) for name in names}
    if not takes:
      aggregator = kwargs.pop("aggregator", None)  # None: the factory's own aggregation, as without the keyword
      if aggregator is not None:
        raise ValueError(f"{factory.__name__} takes no aggregator= (got {_aggregator_label(aggregator)}): "
                         f"{refuses_aggregator}")
    elif refuses_downlink is not None:
      try:
        aggregator = own.bind_partial(*args, **kwargs).arguments.get("aggregator")
      except TypeError:
        aggregator = None  # the factory's own call says what is wrong with the arguments
      downlink = getattr(aggregator, "downlink", None)
      if downlink is not None:
        raise ValueError(f"{factory.__name__} takes no downlink (got {getattr(downlink, 'name', downlink)} chained in "
                         f"aggregator=): {refuses_downlink}")
    if given["client_map"] is not None:
      from fedjax_opt.core.client_map import modes  # pylint: disable=import-outside-toplevel  (modes reads the policy)
      if isinstance(modes.resolve(given["client_map"]), modes.FromPolicy):
        given["client_map"] = None  # the policy's, as None is
    if all(value is None for value in given.values()):
      return factory(*args, **kwargs)
    policy = _check(given["client_map"], None, given.get("storage_dtype"))  # refused before the factory runs
    return _wrapped(factory(*args, **kwargs), policy)

  build.__signature__ = own.replace(parameters=[*own.parameters.values(), *(
      inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_KEYWORD_ANNOTATIONS[name])
      for name in names)])
  build.aggregation = TAKES_AGGREGATOR if takes else refuses_aggregator
  build.default_aggregator = default_aggregator
  build.downlink = (TAKES_DOWNLINK if refuses_downlink is None else refuses_downlink) if takes else refuses_aggregator
  build.evaluation, build.exchanges, build.hyperparameters = declared
  doc = ((factory.__doc__ or "").rstrip() + "\n\n  Execution policy keywords "
         "(`core.execution.accepts_policy_keywords`), each overriding the policy for this algorithm:\n"
         + "".join(f"    {_KEYWORD_DOCS[name]}\n" for name in names))
  if not takes:
    doc += ("\n  Aggregation (`core.execution.accepts_policy_keywords`; `.aggregation` holds it): takes no "
            "`aggregator=`\n  (None changes nothing; any aggregator is refused in one line):\n    "
            + refuses_aggregator + "\n")
  if takes and refuses_downlink is not None:
    doc += ("\n  Downlink (`core.execution.accepts_policy_keywords`; `.downlink` holds it): refuses an aggregator= "
            "with a\n  downlink chained last (in one line):\n    " + refuses_downlink + "\n")
  build.__doc__ = doc
  return build


EVALUATIONS = {
    "global": "state.params, the one global model",
    "table": "a model per client: the state's per-client table, fo.personalized_params(state) (N rows)",
    "adapt": "the global model adapted on each client: algorithm.personalize",
}
"""What a factory's state offers to evaluate (`accepts_policy_keywords(..., evaluation=)`, `factory.evaluation`)."""

REPORTED_EXCHANGES = {
    "metrics": "the round's metrics bits_up (per client taking part) and bits_down (once, as one broadcast)",
    "bits": "the round's metric bits (every bit sent)",
    "bytes": "the round's metric bytes_sent (per node: no server)",
}
"""`factory.exchanges` of an algorithm whose own metrics count its communication (its messages are not a fixed
number of model-sized vectors); any other factory declares `(uploads, broadcasts)`."""

CLIENT_STEP_SIZE = "client step size"
SERVER_STEP_SIZE = "server step size"
STEP_SIZE = "step size"
CLIENT_OPTIMIZER = "client optimizer"
SERVER_OPTIMIZER = "server optimizer"
REGULARIZER = "regularizer"
PENALTY = "penalty"
MIXING_WEIGHT = "mixing weight"
MOMENTUM = "momentum"
PROBABILITY = "probability"
STALENESS = "staleness weighting"
COUNT = "count"
THRESHOLD = "threshold"
SCALE = "scale"
PRIOR = "prior"
PROBLEM_CONSTANT = "problem constant"

HYPERPARAMETER_ROLES = {
    CLIENT_STEP_SIZE: "a step size of the clients' (nodes') local updates",
    SERVER_STEP_SIZE: "the step size of the server's update of the global model (what --server-lr sets)",
    STEP_SIZE: "the step size of a method without a client/server split of its update (L2GD's alpha, DANE's eta)",
    CLIENT_OPTIMIZER: "an optax optimizer of the clients' local steps (its learning rate a client step size)",
    SERVER_OPTIMIZER: "an optax optimizer of the server's update (its learning rate the server step size)",
    REGULARIZER: "the weight of a penalty term (proximal, ridge, elastic, Laplacian, mixture; Zeno++ score's rho)",
    PENALTY: "an augmented Lagrangian's penalty rho (ADMM)",
    MIXING_WEIGHT: "a weight that mixes two models or updates (a convex combination, or one extrapolating past it)",
    MOMENTUM: "a heavy-ball momentum coefficient",
    PROBABILITY: "a probability (of communicating, of a step)",
    STALENESS: "a parameter of the staleness weighting of asynchronous updates",
    COUNT: "a whole number: of steps, iterations, clusters, components, examples, bits, rounds",
    THRESHOLD: "a threshold, tolerance or bound a test compares against (or its schedule)",
    SCALE: "a scale: of an initial noise, a temperature, a finite difference, a factor",
    PRIOR: "a parameter of a prior (its mean, spread or concentration)",
    PROBLEM_CONSTANT: "a constant of the problem the method is tuned to (smoothness L, strong convexity mu)",
}
"""The closed vocabulary of `accepts_policy_keywords(..., hyperparameters={parameter: role})`: role -> meaning."""

DECLARATIONS = ("aggregation", "default_aggregator", "downlink", "evaluation", "exchanges", "hyperparameters")
"""The attributes `accepts_policy_keywords` sets on a factory: what it declares, as data."""


def _declarations(factory: Callable, own: inspect.Signature, evaluation: Any, exchanges: Any,
                  hyperparameters: Any) -> tuple[Any, Any, Mapping[str, str]]:
  """(evaluation, exchanges, hyperparameters) of `factory` checked (a TypeError in one line), the last read-only."""
  where = f"accepts_policy_keywords: {factory.__qualname__}"
  if evaluation is not None and evaluation not in EVALUATIONS:
    raise TypeError(f"{where}: evaluation must be one of {', '.join(map(repr, EVALUATIONS))}; got {evaluation!r}.")
  if exchanges is not None and not (
      (isinstance(exchanges, str) and exchanges in REPORTED_EXCHANGES)
      or (isinstance(exchanges, tuple) and len(exchanges) == 2
          and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in exchanges))):
    raise TypeError(f"{where}: exchanges must be (uploads, broadcasts), two whole numbers >= 0, or one of "
                    f"{', '.join(map(repr, REPORTED_EXCHANGES))}; got {exchanges!r}.")
  if hyperparameters is None:
    hyperparameters = {}
  if not isinstance(hyperparameters, Mapping):
    raise TypeError(f"{where}: hyperparameters must be a mapping {{parameter: role}}; got {hyperparameters!r}.")
  for name, role in hyperparameters.items():
    if name not in own.parameters:
      raise TypeError(f"{where}: hyperparameters names {name!r}, which is not a parameter of the factory "
                      f"({', '.join(own.parameters)}).")
    if role not in HYPERPARAMETER_ROLES:
      raise TypeError(f"{where}: hyperparameters[{name!r}] = {role!r} is not a role; roles: "
                      f"{', '.join(map(repr, HYPERPARAMETER_ROLES))}.")
  servers = [name for name, role in hyperparameters.items() if role == SERVER_STEP_SIZE]
  if len(servers) > 1:
    raise TypeError(f"{where}: {', '.join(servers)} are each declared the {SERVER_STEP_SIZE}; at most one is.")
  return evaluation, exchanges, types.MappingProxyType(dict(hyperparameters))
