"""Hyper-gradients through a whole federated run, and tuning the hyper-parameters by them.

A run is one pure program: `init`, then `step` scanned over rounds, and the
factories take traced hyper-parameters (`fedjax_opt.sweep` vmaps over them).
So the validation objective after R rounds is a differentiable function of
the hyper-parameters h (step sizes, FedProx's μ, Ditto's λ, ADMM's ρ, ...):

    s_0 = init_h(x_0, k),   s_{r+1} = step_h(s_r, b_r)  (r < R),   J(h) = V(s_R, D_val)

where b_r are round r's batches (drawn inside the program by
`fedjax_opt.data.sample_round` from `fold_in(data_key, r)`, so the sampled
clients are part of it) and V a validation objective, e.g.
`validation_loss(loss_fn)`. `value_and_grad` returns J and its gradient;
`tune` runs optax on the hyper-parameters.

Unconstrained parametrization. The gradient is taken with respect to u,
h = φ(u), one kind per hyper-parameter (`parametrization={"name": kind}`,
"log" by default):

    "log":      h = exp(u)            h > 0: step sizes, λ, μ, ρ     ∂J/∂u = h ∂J/∂h
    "logit":    h = 1 / (1 + e^{−u})  h ∈ (0, 1): probabilities,      ∂J/∂u = h (1 − h) ∂J/∂h
                                      mixing weights
    "identity": h = u

so a step of the outer optimizer on u is a multiplicative step on a step size
(Adam on log η moves η by a factor, whatever its scale) and never leaves the
domain. `constrain(u, parametrization)` and `unconstrain(h, parametrization)`
convert.

Three ways to differentiate, and what each costs (S: the size of the state:
the model, the server optimizer's moments, the per-client tables; A: the
residuals of one round, the activations of every local step of its clients;
P: the number of hyper-parameters):

* reverse mode (`mode="reverse"`, the default): `jax.value_and_grad` through
  the scan over rounds. With `checkpoint=1`, each round is a `jax.checkpoint`:
  the backward pass stores the R states the rounds start from and recomputes
  one round at a time, memory ≈ R·S + A, compute ≈ 3 forward runs (the
  forward, the recomputation, the backward). With `checkpoint=b > 1`, blocks
  of b rounds are checkpointed and so is each round inside them: memory ≈
  (⌈R/b⌉ + b)·S + A, minimal at b ≈ √R (`checkpoint="sqrt"`: ≈ 2√R·S + A),
  compute ≈ 4 forward runs; `checkpoint="cbrt"` nests blocks of ≈ R^(2/3)
  and ≈ R^(1/3) rounds: ≈ 3·R^(1/3)·S + A, compute ≈ 5 forward runs.
  `checkpoint=None` stores every round's
  residuals, memory ≈ R·(S + A). The cost of all P hyper-parameters' gradient
  is that of one. With `checkpoint_local_steps=True` each local step of
  `core.local.local_train` (FedAvg, FedOpt, FedProx, SCAFFOLD, Ditto, ... all
  built on it) is checkpointed too: one round's residuals A (every client's
  activations and gradient intermediates at every step) become A' ≈
  C·K·(x + the client optimizer's state), C clients, K local steps, plus one
  step's residuals; compute ≈ one more forward run.
* truncated (`truncate=K`): only the last K rounds are differentiated; the
  state they start from is held constant (computed at h, but its dependence on
  h is dropped). Memory and backward cost of K rounds; the gradient is biased
  (short-horizon bias, Wu, Ren, Liao, Grosse, "Understanding Short-Horizon
  Bias in Stochastic Meta-Optimization", ICLR 2018): it sees how h acts over
  K rounds, not how it shaped the state they start from. `tune`'s online
  schedule is this with the state carried on.
* forward mode (`mode="forward"`): `jax.jvp` along each of the P coordinate
  directions of u (the P tangents batched in one run): exact, memory of a
  forward run whatever R is (≈ P·(S + A') for the tangents, A' one round's
  live values), compute ≈ P·(1 to 2) forward runs. Better than reverse mode
  when P is small and R·S large (Franceschi, Donini, Frasconi, Pontil,
  "Forward and Reverse Gradient-Based Hyperparameter Optimization", ICML
  2017, compare the two).

Where a step is not differentiable. A step that takes a discrete decision on
values that depend on h (IFCA's argmin over cluster losses, CFL's split test,
CQ-GGADMM's censoring, Zeno++'s acceptance test, L2GD's coin of
probability p) is piecewise constant in it, and automatic differentiation
would return the derivative of one piece. Such steps mark the decision
(`fedjax_opt.core.differentiation.refuse_derivative`), and differentiating
through it raises `NotDifferentiableError` with one line naming it, when the
program is traced, before anything runs; docs/algorithms.md lists the
factories. Host-driven algorithms (FedMA, PFNM: Hungarian matching on the
host) are not a `FederatedAlgorithm` and are refused with a TypeError.
Decisions that hold almost everywhere (a robust aggregator's sort, the
clipping of an update) are differentiated as JAX does: the derivative of the
piece the run is in. A `lax.while_loop` (the geometric median) has no
reverse-mode derivative: use `mode="forward"` there.

Tuning (`tune`): optax on u (Adam by default), either

* "offline": every outer step reruns the R rounds from the same start
  (params, key) and takes one optax step on u with ∇_u J (Maclaurin, Duvenaud,
  Adams, "Gradient-based Hyperparameter Optimization through Reversible
  Learning", ICML 2015); or
* "online": one run; every `rounds` rounds (a window) the hyper-gradient of
  the objective after the window, from the state the run has reached, updates
  u, and the run goes on from the window's end (hypergradient descent:
  Baydin, Cornish, Martínez Rubio, Schmidt, Wood, "Online Learning Rate
  Adaptation with Hypergradient Descent", ICLR 2018, whose one-step
  hyper-gradient is the window of one round).

With a constant outer step size the hyper-iterates do not settle: Adam's
steps on u stay about as long as its learning rate, and the online
schedule's short windows see a different best value early and late in the
run. `average=n` returns φ of the mean of the last n iterates u instead of
the last one (Polyak–Ruppert tail averaging: Polyak, Juditsky, "Acceleration
of Stochastic Approximation by Averaging", SIAM J. Control Optim. 1992; for
"log", the geometric mean of the last n values).

`select=score` (offline) returns, of the settings whose runs the tuning
trained (h_0, …, h_{T−1}, each run once for its hyper-gradient, and the
tuned value's final run), the one with the least `score(state,
validation)`, with its state: the rule a grid search reports its best point
by (e.g. the negative validation accuracy), applied to the tuner's own runs,
at no extra round (the scores are read from states the tuning computes
anyway; the best state so far is carried, one state more in memory).

Several starting settings `[M]` run as one vmapped program, as `fo.sweep`
runs a grid.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_opt.core import per_client
from fedjax_opt.core.differentiation import NotDifferentiableError
from fedjax_opt.core.local import checkpointed_local_steps
from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, materialize
from fedjax_opt.core.validation import TracedIntegerError, check_int, check_loss_fn
from fedjax_opt.data.dataset import FederatedDataset
from fedjax_opt.data.sampling import sample_round
from fedjax_opt.train.config import Sampling
from fedjax_opt.train.driver import proportional_weights

__all__ = ["KINDS", "NotDifferentiableError", "TuneResult", "UnknownHyperParameterError", "constrain", "objective_fn",
           "tune", "unconstrain", "validation_loss", "value_and_grad"]

PyTree = Any
KINDS = ("log", "logit", "identity")
MODES = ("reverse", "forward")
SCHEDULES = ("offline", "online")


# ---- parametrization --------------------------------------------------------------------------------------------


def _kinds(names, parametrization: Mapping[str, str] | None) -> dict[str, str]:
  parametrization = dict(parametrization or {})
  unknown = set(parametrization) - set(names)
  if unknown:
    raise ValueError(f"parametrization names {sorted(unknown)}, which are not among the hyper-parameters "
                     f"{sorted(names)}.")
  for name, kind in parametrization.items():
    if kind not in KINDS:
      raise ValueError(f"parametrization[{name!r}] must be one of {KINDS}; got {kind!r}.")
  return {name: parametrization.get(name, "log") for name in names}


def _check_hyper(hyper: Any, what: str) -> dict:
  if not isinstance(hyper, Mapping) or not hyper:
    raise TypeError(f"{what} must be a non-empty dict {{name: value}} of the hyper-parameters; got "
                    f"{type(hyper).__name__}.")
  for name in hyper:
    if not isinstance(name, str):
      raise TypeError(f"{what} keys must be str (the names make_algorithm reads); got {name!r}.")
  return dict(hyper)


def constrain(u: Mapping[str, Any], parametrization: Mapping[str, str] | None = None) -> dict[str, jax.Array]:
  """h = φ(u) per hyper-parameter: exp ("log", the default), sigmoid ("logit") or the identity."""
  u = _check_hyper(u, "u")
  kinds = _kinds(u, parametrization)
  forward = {"log": jnp.exp, "logit": jax.nn.sigmoid, "identity": lambda x: x}
  return {name: forward[kinds[name]](jnp.asarray(value)) for name, value in u.items()}


def unconstrain(h: Mapping[str, Any], parametrization: Mapping[str, str] | None = None) -> dict[str, jax.Array]:
  """u = φ⁻¹(h): log ("log"), logit ("logit") or the identity; h outside the kind's domain is a ValueError."""
  h = _check_hyper(h, "hyper_params")
  kinds = _kinds(h, parametrization)
  out = {}
  for name, value in h.items():
    kind = kinds[name]
    if kind != "identity" and not isinstance(value, jax.core.Tracer):
      v = np.asarray(value, np.float64)
      if kind == "log" and np.any(v <= 0):
        raise ValueError(f"{name} is parametrized by its log and must be > 0; got {value!r} (give "
                         f"parametrization={{{name!r}: 'identity'}} for a signed hyper-parameter).")
      if kind == "logit" and np.any((v <= 0) | (v >= 1)):
        raise ValueError(f"{name} is parametrized by its logit and must lie in (0, 1); got {value!r}.")
    x = jnp.asarray(value)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      x = x.astype(jnp.result_type(float))
    out[name] = {"log": jnp.log, "logit": jax.scipy.special.logit, "identity": lambda t: t}[kind](x)
  return out


# ---- the run ----------------------------------------------------------------------------------------------------


def _check_data(data: Any, sampling: Sampling | None, total_rounds: int) -> None:
  if isinstance(data, FederatedDataset):
    if not isinstance(sampling, Sampling):
      raise TypeError("a FederatedDataset needs sampling=fo.Sampling(...) (how each round's clients and batches "
                      f"are drawn); got sampling={sampling!r}.")
    return
  if sampling is not None:
    raise ValueError("sampling applies to a FederatedDataset; data is ClientBatches, whose rounds are given.")
  if not isinstance(data, ClientBatches):
    raise TypeError("data must be a FederatedDataset (rounds drawn in the program) or ClientBatches (one round's "
                    f"batches [C, S, B], the same every round, or [R, C, S, B], round r's at r); got "
                    f"{type(data).__name__}.")
  rank = jnp.ndim(data.mask)
  if rank not in (3, 4):
    raise ValueError(f"data.mask must be [C, S, B] or [R, C, S, B]; got shape {tuple(jnp.shape(data.mask))}.")
  if rank == 4 and jnp.shape(data.mask)[0] < total_rounds:
    raise ValueError(f"data holds the batches of {jnp.shape(data.mask)[0]} rounds ([R, C, S, B]); the run needs "
                     f"{total_rounds}.")


def _batches_at(data: Any, sampling: Sampling | None, data_key: jax.Array, r: jax.Array) -> ClientBatches:
  """Round r's batches: drawn from `fold_in(data_key, r)` (a dataset) or read from the given ClientBatches."""
  if isinstance(data, FederatedDataset):
    batches = sample_round(jax.random.fold_in(data_key, r), data, deferred=True, **sampling.kwargs())
    return proportional_weights(batches) if sampling.client_sampling == "proportional" else batches
  if jnp.ndim(data.mask) == 4:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False), data)
  return data


def _keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(init key, data key): `key` split in two, or a `[2]` stack of the two given as they are."""
  one = () if jax.dtypes.issubdtype(jnp.result_type(key), jax.dtypes.prng_key) else (2,)  # typed, or raw uint32
  if jnp.shape(key) == (2,) + one:
    return key[0], key[1]
  if jnp.shape(key) != one:
    raise ValueError(f"key must be one key, or the init key and the data key stacked [2]; got shape "
                     f"{tuple(jnp.shape(key))}.")
  init_key, data_key = jax.random.split(key)
  return init_key, data_key


def _block_size(checkpoint: Any, rounds: int) -> tuple[int, ...] | None:
  """The rounds per checkpointed block at each level, outermost first (`()`: every round checkpointed alone);
  None: no checkpointing."""
  if checkpoint is None:
    return None
  if checkpoint == "sqrt":
    sizes = (round(math.sqrt(rounds)),)
  elif checkpoint == "cbrt":
    c = round(rounds ** (1 / 3))
    sizes = (c * c, c)
  else:
    sizes = (check_int(checkpoint, "checkpoint (rounds per checkpointed block; None: no checkpointing; 'sqrt', "
                                   "'cbrt')"),)
  return tuple(b for b in sizes if b > 1)


def _run_rounds(step: Callable, state: PyTree, length: int, batches_at: Callable, block: tuple[int, ...] | None,
                local_steps: bool = False) -> PyTree:
  """`length` rounds of `step` as a scan: with `block` sizes, each round a `jax.checkpoint` and so is each block
  of `block[i]` rounds at level i; with `local_steps` each local step of `core.local.local_train` too."""
  with checkpointed_local_steps(local_steps):
    if block is None:
      return jax.lax.scan(lambda s, _: (step(s, batches_at(s.round)), None), state, None, length=length)[0]
    one = jax.checkpoint(lambda s: step(s, batches_at(s.round)))
    return _blocks_of(one, state, length, block)


def _blocks_of(one: Callable, state: PyTree, length: int, sizes: tuple[int, ...]) -> PyTree:
  """`length` rounds of `one`, grouped in checkpointed blocks of `sizes[0]` rounds, themselves of `sizes[1]`..."""
  if length == 0:
    return state
  if not sizes:
    return jax.lax.scan(lambda c, _: (one(c), None), state, None, length=length)[0]
  blocks, rest = divmod(length, sizes[0])
  if blocks:
    block = jax.checkpoint(lambda s: _blocks_of(one, s, sizes[0], sizes[1:]))
    state = jax.lax.scan(lambda s, _: (block(s), None), state, None, length=blocks)[0]
  return _blocks_of(one, state, rest, sizes[1:])


def _check_make_algorithm(make_algorithm: Any) -> None:
  if not callable(make_algorithm):
    raise TypeError("make_algorithm must be a callable hyper_params -> FederatedAlgorithm, e.g. lambda h: "
                    f"fo.algorithms.fedprox(loss_fn, h['mu'], ...); got {type(make_algorithm).__name__}.")


class UnknownHyperParameterError(KeyError):
  """The build function asked for a hyper-parameter by a name that is not among those given (a `KeyError`).

  Attributes:
    name: the name asked for.
    given: the names of the given hyper-parameters, sorted.
  """

  def __init__(self, name: Any, given: list[str]):
    close = difflib.get_close_matches(name, given, n=1) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    super().__init__(f"fo.hyper: the build function asked for hyper-parameter {name!r}, which is not among the "
                     f"given hyper-parameters {given}{hint}.")
    self.name, self.given = name, given

  def __str__(self) -> str:  # the message as it is, not KeyError's quoted repr of it
    return str(self.args[0])


class _Hyper(dict):
  """The dict of traced hyper-parameters the build function receives: a missing name is one clear line."""

  def __missing__(self, name: Any) -> Any:
    raise UnknownHyperParameterError(name, sorted(self))


jax.tree_util.register_pytree_with_keys(
    _Hyper, lambda h: ([(jax.tree_util.DictKey(k), h[k]) for k in sorted(h)], tuple(sorted(h))),
    lambda names, values: _Hyper(zip(names, values)))


def _build(make_algorithm: Callable, h: dict) -> FederatedAlgorithm:
  """`make_algorithm(h)`, with h's missing names and integers taken from h refused in one line naming them."""
  h = _Hyper(h)
  try:
    algorithm = make_algorithm(h)
  except TracedIntegerError as e:
    names = [name for name, value in h.items() if value is e.value]
    if names:
      raise TypeError(f"fo.hyper: hyper-parameter {names[0]!r} is used where an integer (a Python int) is needed "
                      f"({e.name} must be one); it cannot be differentiated or swept as a traced value: give it to "
                      "the build function as a constant.") from None
    raise TypeError(f"fo.hyper: {e.name} is given a value computed from the traced hyper-parameters "
                    f"{sorted(h)}, where an integer (a Python int) is needed; an integer cannot be differentiated "
                    "or swept as a traced value: give it to the build function as a constant.") from None
  if not isinstance(algorithm, FederatedAlgorithm):
    if callable(getattr(algorithm, "run", None)):
      raise TypeError(f"{type(algorithm).__name__} is host-driven (its rounds run on the host, e.g. FedMA's and "
                      "PFNM's Hungarian matching): fo.hyper differentiates one compiled run and cannot take it.")
    raise TypeError(f"make_algorithm must return a fedjax_opt.FederatedAlgorithm; got {type(algorithm).__name__}.")
  return algorithm


def objective_fn(make_algorithm: Callable[[dict], FederatedAlgorithm],
                 objective: Callable[[PyTree, Any], jax.Array], *, rounds: int, sampling: Sampling | None = None,
                 parametrization: Mapping[str, str] | None = None, truncate: int | None = None,
                 checkpoint: int | str | None = 1, checkpoint_local_steps: bool = False) -> Callable:
  """The validation objective after R rounds as a pure function of the unconstrained hyper-parameters.

  Args:
    make_algorithm: `h -> FederatedAlgorithm`, h a dict of traced scalars, e.g.
      `lambda h: fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(h["client_lr"]),
      server_optimizer=fo.server_optimizers.fedadam(h["server_lr"]))`. A name not in h is one line naming it
      (`UnknownHyperParameterError`, a KeyError); so is a hyper-parameter given where a Python int is needed
      (a step count: a TypeError; such a value fixes the program's shape and cannot be traced).
    objective: `objective(state, validation) -> scalar`, e.g. `validation_loss(loss_fn)`.
    rounds: R, a Python int >= 1.
    sampling: `fo.Sampling`, how rounds are drawn when the data is a `FederatedDataset`.
    parametrization: `{name: "log" | "logit" | "identity"}` (module docstring); "log" for names not given.
    truncate: K: differentiate the last K rounds only (module docstring); None: all R.
    checkpoint: rounds per checkpointed block (1: every round, the default; "sqrt": blocks of ≈ √R rounds,
      each round checkpointed inside them; "cbrt": blocks of ≈ R^(2/3) rounds made of blocks of ≈ R^(1/3);
      None: no checkpointing). Changes memory and time, never the value.
    checkpoint_local_steps: also checkpoint each local step of the algorithms built on `core.local.local_train`
      (module docstring: A shrinks to the steps' starting points). Changes memory and time, never the value.

  Returns:
    `f(u, params, key, data, validation) -> (J, final state)`, pure (jit, vmap and grad apply). `u` is
    `{name: scalar}` in the unconstrained coordinates; `key` is split into the algorithm's init key and the data
    key (round r drawn from `fold_in(data_key, state.round)`), or is the two stacked, `[2]` (`jnp.stack([init_key,
    data_key])`: with `jax.random.key(s)` as data key the rounds are those `fo.train(..., seed=s)` draws); `data`
    is a `FederatedDataset` (with `sampling`) or `ClientBatches` (`[C, S, B]` every round, or `[R, C, S, B]`);
    `validation` is passed to `objective`.
  """
  _check_make_algorithm(make_algorithm)
  if not callable(objective):
    raise TypeError(f"objective must be a callable (state, validation) -> scalar; got {type(objective).__name__}.")
  rounds = check_int(rounds, "rounds")
  if truncate is not None:
    truncate = check_int(truncate, "truncate (the last K rounds differentiated)")
    if truncate > rounds:
      raise ValueError(f"truncate={truncate} exceeds rounds={rounds}; give K <= R, or None for the whole run.")
  block = _block_size(checkpoint, rounds)
  if not isinstance(checkpoint_local_steps, bool):
    raise TypeError(f"checkpoint_local_steps must be a bool; got {type(checkpoint_local_steps).__name__}.")
  for name, kind in (parametrization or {}).items():
    if kind not in KINDS:
      raise ValueError(f"parametrization[{name!r}] must be one of {KINDS}; got {kind!r}.")
  fixed_rounds = 0 if truncate is None else rounds - truncate

  def f(u, params, key, data, validation):
    _check_data(data, sampling, rounds)
    h = constrain(u, parametrization)
    init_key, data_key = _keys(key)
    batches_at = lambda r: _batches_at(data, sampling, data_key, r)  # pylint: disable=unnecessary-lambda-assignment
    if fixed_rounds:
      held = _build(make_algorithm, jax.lax.stop_gradient(h))
      state = held.init(params, init_key)
      state = jax.lax.stop_gradient(_run_rounds(held.step, state, fixed_rounds, batches_at, block,
                                                checkpoint_local_steps))
      algorithm = _build(make_algorithm, h)
    else:
      algorithm = _build(make_algorithm, h)
      state = algorithm.init(params, init_key)
    state = _run_rounds(algorithm.step, state, rounds - fixed_rounds, batches_at, block, checkpoint_local_steps)
    value = objective(state, validation)
    if jnp.ndim(value) != 0:
      raise ValueError(f"objective must return a scalar; got shape {tuple(jnp.shape(value))}.")
    return value, state

  return f


def _value_and_grad_of(f: Callable, mode: str) -> Callable:
  """`(u, *args) -> ((J, aux), ∇_u J)` of `f(u, *args) -> (J, aux)`, by reverse or forward mode."""
  if mode == "reverse":
    return jax.value_and_grad(f, has_aux=True)

  def forward(u, *args):
    leaves, treedef = jax.tree.flatten(u)
    sizes = [int(np.size(x)) for x in leaves]
    if any(s != 1 for s in sizes):
      raise ValueError("mode='forward' takes scalar hyper-parameters.")
    basis = jnp.eye(len(leaves), dtype=jnp.result_type(*leaves))

    def along(e):
      tangent = jax.tree.unflatten(treedef, [e[i].astype(jnp.result_type(x)).reshape(jnp.shape(x))
                                              for i, x in enumerate(leaves)])
      (value, aux), (dvalue, _) = jax.jvp(lambda v: f(v, *args), (u,), (tangent,))
      return value, aux, dvalue

    values, auxes, derivatives = jax.vmap(along)(basis)
    grad = jax.tree.unflatten(treedef, [derivatives[i].astype(jnp.result_type(x)).reshape(jnp.shape(x))
                                        for i, x in enumerate(leaves)])
    return (values[0], jax.tree.map(lambda a: a[0], auxes)), grad

  return forward


def _check_mode(mode: Any) -> None:
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES} (reverse: all hyper-parameters at the cost of one; forward: "
                     f"memory independent of R, cost per hyper-parameter); got {mode!r}.")


def value_and_grad(make_algorithm: Callable[[dict], FederatedAlgorithm],
                   objective: Callable[[PyTree, Any], jax.Array], *, rounds: int, sampling: Sampling | None = None,
                   parametrization: Mapping[str, str] | None = None, truncate: int | None = None,
                   checkpoint: int | str | None = 1, checkpoint_local_steps: bool = False,
                   mode: str = "reverse") -> Callable:
  """J after R rounds and ∇_u J, as one jitted program `(u, params, key, data, validation) -> (J, ∇_u J)`.

  The arguments are those of `objective_fn`, plus `mode`: "reverse" (default) or "forward" (module docstring
  states the memory and compute of each). `∇_u J` is a dict like `u`, in the unconstrained coordinates
  (∂J/∂log η = η ∂J/∂η for the default "log"). Compile once, call with any u, params, data of the same shapes.
  A factory whose step is not differentiable in its hyper-parameters raises `NotDifferentiableError` on the
  first call, when the program is traced.
  """
  _check_mode(mode)
  f = objective_fn(make_algorithm, objective, rounds=rounds, sampling=sampling, parametrization=parametrization,
                   truncate=truncate, checkpoint=checkpoint, checkpoint_local_steps=checkpoint_local_steps)
  vg = _value_and_grad_of(f, mode)

  @jax.jit
  def run(u, params, key, data, validation):
    (value, _), grad = vg(_as_float(u), params, key, data, validation)
    return value, grad

  return run


def _as_float(u: Mapping[str, Any]) -> dict:
  u = _check_hyper(u, "u")
  out = {}
  for name, value in u.items():
    x = jnp.asarray(value)
    out[name] = x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.result_type(float))
  return out


# ---- validation objective ---------------------------------------------------------------------------------------


def validation_loss(loss_fn: LossFn, *, personalized: bool = False) -> Callable[[PyTree, ClientBatches], jax.Array]:
  """`objective(state, batches) -> scalar`: the mean of `loss_fn` over every real example of `batches`.

  J = Σ_c Σ_{s,b} mask_{c,s,b} ℓ(x, z_{c,s,b}) / Σ mask, with x = `state.params` or, with `personalized`,
  client c's own model (`fo.personalized_params(state, client_id_c)`: Ditto's v_c, ...). `batches` is a
  `ClientBatches` `[C, S, B]` (e.g. `fo.data.client_batches(dataset, B, split="test")`).
  """
  check_loss_fn(loss_fn)
  if not isinstance(personalized, bool):
    raise TypeError(f"personalized must be a bool; got {type(personalized).__name__}.")

  def objective(state: PyTree, batches: ClientBatches) -> jax.Array:
    if not isinstance(batches, ClientBatches):
      raise TypeError(f"validation must be ClientBatches [C, S, B] for validation_loss; got "
                      f"{type(batches).__name__}.")
    data = materialize(batches.data)
    c = batches.mask.shape[0]
    flat = jax.tree.map(lambda a: a.reshape((c, -1) + a.shape[3:]), data)
    mask = batches.mask.reshape(c, -1)
    if personalized:
      models = per_client.personalized_params(state, batches.client_id)
      losses = jax.vmap(loss_fn)(models, flat)
    else:
      losses = jax.vmap(loss_fn, in_axes=(None, 0))(state.params, flat)
    total = jnp.sum(jnp.where(mask, losses, jnp.zeros_like(losses)))
    return total / jnp.maximum(jnp.sum(mask, dtype=losses.dtype), 1)

  return objective


# ---- tuning -----------------------------------------------------------------------------------------------------


def _reporter(callback: Callable | None, parametrization: Mapping[str, str] | None) -> Callable:
  """`report(setting, step, u, value, grad)` inside the program: `callback` on the host with h = φ(u) (or nothing)."""
  if callback is None:
    return lambda *args: None

  def on_host(setting, step, h, value, grad):
    callback(int(setting), int(step), {k: float(v) for k, v in h.items()}, float(value),
             {k: float(v) for k, v in grad.items()})

  def report(setting, step, u, value, grad):
    jax.debug.callback(on_host, setting, step, constrain(u, parametrization), value, grad, ordered=True)

  return report


class TuneResult(NamedTuple):
  """What `tune` returns; M is the number of starting settings, T the outer steps.

  Attributes:
    hyper_params: `{name: [M]}`, the tuned values h: after the last update, or with `average=n` φ of the mean of
      the last n iterates u (then not `trajectory[:, -1]`).
    trajectory: `{name: [M, T + 1]}`, h before each outer step and after the last.
    values: `[M, T]`, the objective J at each outer step (at the h it started from): offline, after R rounds from
      the start; online, at the end of each window of the one run.
    gradients: `{name: [M, T]}`, ∇_u J at each outer step.
    state: online, the final state of the M runs (leaves `[M, ...]`); offline, the state after R rounds from the
      start at the tuned values `hyper_params` (after the last update, or averaged; `values` stops at the h before
      the last update).
    scores: with `select`, `[M, T + 1]`: the score of the run at each h_t, t < T, then at the last (or averaged)
      value (a NaN score is reported as NaN and chosen as +∞); None without.
    selected: with `select`, `[M]` ints: the index into `scores` of the returned setting (T: the last or averaged
      value); None without.
  """

  hyper_params: dict[str, jax.Array]
  trajectory: dict[str, jax.Array]
  values: jax.Array
  gradients: dict[str, jax.Array]
  state: PyTree
  scores: jax.Array | None = None
  selected: jax.Array | None = None


def tune(make_algorithm: Callable[[dict], FederatedAlgorithm], objective: Callable[[PyTree, Any], jax.Array],
         hyper_params: Mapping[str, Any], params: PyTree, key: jax.Array, data: Any, validation: Any, *,
         rounds: int, outer_steps: int, schedule: str = "offline",
         optimizer: optax.GradientTransformation | None = None, sampling: Sampling | None = None,
         parametrization: Mapping[str, str] | None = None, truncate: int | None = None,
         checkpoint: int | str | None = 1, checkpoint_local_steps: bool = False, mode: str = "reverse",
         callback: Callable | None = None, average: int | None = None,
         select: Callable[[PyTree, Any], jax.Array] | None = None) -> TuneResult:
  """Tunes the hyper-parameters with optax on u = φ⁻¹(h), by hyper-gradients; M starting settings in one program.

      offline:  u ← u − OuterOpt(∇_u J(u)),  J(u) the objective after R rounds from the same start, T times
      online:   s ← R rounds of step_{φ(u)} from s;  u ← u − OuterOpt(∇_u J_window(u)),  T windows of one run

  Args:
    make_algorithm, objective, sampling, parametrization, truncate, checkpoint, checkpoint_local_steps, mode: as
      in `value_and_grad`.
    hyper_params: the starting h, `{name: scalar}` or `{name: [M]}` (M settings tuned side by side, vmapped as
      `fo.sweep` does; e.g. `fo.sweep.grid(...)`).
    params, key, data, validation: the initial model, the run's key, the round data and the validation data
      (see `objective_fn`); shared by the M settings (common random numbers).
    rounds: R, the rounds differentiated per outer step: the run (offline) or one window (online).
    outer_steps: T >= 1.
    schedule: "offline" (restart every outer step) or "online" (one run of T·R rounds).
    optimizer: the outer optax optimizer on u; default `optax.adam(0.1)` (a step of about 10 % on a log-step-size).
    callback: None, or `callback(setting, step, hyper_params, value, gradients)`, called on the host as the program
      runs (`jax.debug.callback`, in order), once per setting and outer step once its gradient is known: the
      setting's index m < M, the step t < T, h_t `{name: float}`, J(h_t) and ∇_u J `{name: float}` (progress
      lines, `fedjax-opt tune`).
    average: None (the tuned values are the last iterate) or n in [1, T + 1]: φ of the mean of the last n
      iterates u_{T+1−n}, …, u_T in the unconstrained coordinates (tail averaging, module docstring; u_0 is the
      start, u_T the value after the last update, so n = 1 is the last iterate and n = T + 1 every one).
    select: None, or `score(state, validation) -> scalar` (offline only): the tuned values are those, of h_0, …,
      h_{T−1} and the last (or averaged) value, whose run has the least score (NaN counts as +∞; the first of equal
      scores), and `state` is that run (module docstring). E.g. `lambda s, v: -accuracy(s, v)`.

  Returns:
    `TuneResult` (leading axis M; M = 1 when the starting values are scalars).
  """
  _check_make_algorithm(make_algorithm)
  _check_mode(mode)
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES} (offline: restart every outer step; online: update "
                     f"every window of one run); got {schedule!r}.")
  outer_steps = check_int(outer_steps, "outer_steps")
  rounds = check_int(rounds, "rounds")
  if optimizer is None:
    optimizer = optax.adam(0.1)
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(f"optimizer must be an optax.GradientTransformation; got {type(optimizer).__name__}.")
  if callback is not None and not callable(callback):
    raise TypeError(f"callback must be None or a callable (setting, step, hyper_params, value, gradients); got "
                    f"{type(callback).__name__}.")
  if average is not None:
    average = check_int(average, "average (the last n hyper-iterates averaged; None: the last one)")
    if average > outer_steps + 1:
      raise ValueError(f"average={average} exceeds the outer_steps + 1 = {outer_steps + 1} iterates (the start and "
                       "one after each outer step).")
  if select is not None:
    if not callable(select):
      raise TypeError(f"select must be None or a callable (state, validation) -> scalar; got "
                      f"{type(select).__name__}.")
    if schedule != "offline":
      raise ValueError("select chooses among the offline schedule's runs (each R rounds from the same start); the "
                       "online schedule's windows are parts of one run, not runs to choose from.")
  report = _reporter(callback, parametrization)
  hyper_params = _check_hyper(hyper_params, "hyper_params")
  shapes = {name: np.shape(v) for name, v in hyper_params.items()}
  if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) > 1:
    raise ValueError(f"hyper_params must all be scalars or all [M] arrays of one M; got shapes {shapes}.")
  u0 = jax.tree.map(jnp.atleast_1d, unconstrain(hyper_params, parametrization))
  if schedule == "online" and truncate is not None:
    raise ValueError("schedule='online' differentiates each window of `rounds` rounds already; truncate applies "
                     "to the offline schedule.")
  _check_data(data, sampling, rounds * (outer_steps if schedule == "online" else 1))
  f = objective_fn(make_algorithm, objective, rounds=rounds, sampling=sampling, parametrization=parametrization,
                   truncate=truncate, checkpoint=checkpoint, checkpoint_local_steps=checkpoint_local_steps)
  vg = _value_and_grad_of(f, mode)
  block = _block_size(checkpoint, rounds)

  def tuned(us, u_end):
    """The last iterate, or the mean of the last `average` of the T + 1 iterates (`us` [T], then `u_end`)."""
    if average is None:
      return u_end
    return jax.tree.map(lambda a, b: jnp.mean(jnp.concatenate([a, b[None]])[-average:], axis=0), us, u_end)

  def score(state):
    value = jnp.asarray(select(state, validation))
    if jnp.ndim(value) != 0:
      raise ValueError(f"select must return a scalar; got shape {tuple(jnp.shape(value))}.")
    return value

  def better(best, candidate):
    """The candidate `(score, index, u, state)` if its score is below the best one's (NaN as +∞), else the best."""
    key = lambda value: jnp.where(jnp.isnan(value), jnp.inf, value)  # noqa: E731
    take = key(candidate[0]) < key(best[0])
    return jax.tree.map(lambda c, b: jnp.where(take, c, b), candidate, best)

  def offline(u, setting):
    def one_step(u, opt_state, step):
      (value, state), grad = vg(u, params, key, data, validation)
      report(setting, step, u, value, grad)
      updates, opt_state = optimizer.update(grad, opt_state, u)
      return optax.apply_updates(u, updates), opt_state, (u, value, grad), state

    def outer(carry, step):
      u, opt_state = carry
      u, opt_state, out, _ = one_step(u, opt_state, step)
      return (u, opt_state), out

    if select is None:
      (u_end, _), (us, values, grads) = jax.lax.scan(outer, (u, optimizer.init(u)), jnp.arange(outer_steps))
      u_tuned = tuned(us, u_end)
      _, state = f(u_tuned, params, key, data, validation)
      return u_tuned, u_end, us, values, grads, state, None, None

    # The first step outside the scan: its run is the first best (score, index, u, state) carried through.
    steps = jnp.arange(outer_steps)
    u1, opt_state, first, state = one_step(u, optimizer.init(u), steps[0])
    first_score = score(state)
    best = (first_score, steps[0], u, state)

    def outer_selecting(carry, step):
      u, opt_state, best = carry
      u, opt_state, out, state = one_step(u, opt_state, step)
      s = score(state)
      return (u, opt_state, better(best, (s, step, out[0], state))), (out, s)

    (u_end, _, best), (rest, rest_scores) = jax.lax.scan(outer_selecting, (u1, opt_state, best), steps[1:])
    us, values, grads = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)
    u_tuned = tuned(us, u_end)
    _, state = f(u_tuned, params, key, data, validation)
    last = score(state)
    _, selected, u_selected, state = better(best, (last, jnp.asarray(outer_steps, steps.dtype), u_tuned, state))
    scores = jnp.concatenate([first_score[None], rest_scores, last[None]])
    return u_selected, u_end, us, values, grads, state, scores, selected

  def online(u, setting):
    init_key, data_key = _keys(key)
    state0 = _build(make_algorithm, constrain(u, parametrization)).init(params, init_key)

    def window(u, state):
      algorithm = _build(make_algorithm, constrain(u, parametrization))
      state = _run_rounds(algorithm.step, state, rounds, lambda r: _batches_at(data, sampling, data_key, r), block,
                          checkpoint_local_steps)
      return objective(state, validation), state

    window_vg = _value_and_grad_of(window, mode)

    def outer(carry, step):
      u, opt_state, state = carry
      (value, state), grad = window_vg(u, state)
      report(setting, step, u, value, grad)
      updates, opt_state = optimizer.update(grad, opt_state, u)
      return (optax.apply_updates(u, updates), opt_state, state), (u, value, grad)

    (u_end, _, state), (us, values, grads) = jax.lax.scan(outer, (u, optimizer.init(u), state0),
                                                          jnp.arange(outer_steps))
    return tuned(us, u_end), u_end, us, values, grads, state, None, None

  program = jax.jit(jax.vmap(offline if schedule == "offline" else online))
  u0 = _as_float(u0)
  u_tuned, u_end, us, values, grads, state, scores, selected = program(
      u0, jnp.arange(np.shape(next(iter(u0.values())))[0]))
  h_end = constrain(u_end, parametrization)
  h_steps = constrain(us, parametrization)  # [M, T]
  trajectory = {name: jnp.concatenate([h_steps[name], h_end[name][:, None]], axis=1) for name in h_end}
  return TuneResult(hyper_params=constrain(u_tuned, parametrization), trajectory=trajectory, values=values,
                    gradients=grads, state=state, scores=scores, selected=selected)
