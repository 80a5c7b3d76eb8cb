"""What `auto` runs, measured: the fastest candidate mode timed on the backend itself, cached per machine.

A rule written from one machine's timings is wrong on another (docs/scaling.md:
on one GPU, `vmap` of a CNN over 512 clients was 5.6× slower than chunks of
64). So, as XLA's and Triton's autotuners do, `auto` times the candidates on
the machine that runs them, once, and remembers the winner:

1. The key. Backend, device kind, JAX and fedjax_opt versions, the jaxpr of
   the per-client function (its text: shapes, dtypes and operations, not the
   values it closes over), the shapes of `shared` and of the C clients'
   inputs (so C, S and B), and the memory budget. A hash of these names a
   file in the cache folder.
2. The candidates (`candidates`): the measured rule's choice
   (`heuristics.choose`) first, then `vmap`, `chunked(k)` for k in
   `CHUNK_SIZES` below C (largest first), `sequential()`, and on CPU the
   rewrites that apply (`fuse_small_dots` when vmapping makes small batched
   dots; for a function with convolutions only `sequential()` with and
   without `canonical_convs`: XLA:CPU runs a vmapped convolution as a
   grouped one, about 100× slower, too slow even to time). A candidate
   whose clients at once (C or k times `client_footprint`) exceed the memory
   budget is not tried; `sequential()` always is.
3. The measurement (`measure`): the per-client function's jaxpr, with any
   value it closes over from the user's trace replaced by an array of the
   same shape and dtype, is mapped by each candidate in its own jitted
   program on inputs of the real shapes (floats small normal values,
   integers 0, masks True), outside the user's program. Each is compiled, run
   once to warm up, then timed; the median of `REPEATS` runs counts (the
   warm-up run alone when it took over `SLOW_FACTOR` times the best so far,
   or when the budget leaves no time to repeat it). A
   candidate that fails to compile or run (out of memory) is dropped. The
   measurement stops taking new candidates after `budget_seconds` (default
   `DEFAULT_BUDGET_SECONDS`, env `FEDJAX_OPT_AUTOTUNE_SECONDS`); the rule's
   choice is always timed.
   Inputs that alone take more than a quarter of `default_memory_budget()`
   are not made up: the rule decides, unmeasured and uncached.
4. The cache: the fastest candidate's name and every time, as JSON, one
   file per key in `cache_dir()` (`~/.cache/fedjax_opt/autotune`, env
   `FEDJAX_OPT_AUTOTUNE_CACHE`; "off" keeps decisions in memory only),
   written to a temporary file and renamed into place, so processes that
   measure at once each leave a whole file and a reader never sees half of
   one. Decisions are also kept in memory for the process.

Measuring is on unless turned off: `auto(measure=False)`, or the environment
variable `FEDJAX_OPT_AUTOTUNE=off` (then `auto` is the measured rule,
`heuristics.choose`). Every mode computes the same numbers to float
tolerance (tests/test_client_map.py), so the choice changes speed and
memory, not results beyond float rounding; a cached decision makes the
choice, and so the run, repeatable on that machine.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from fedjax_opt.core.client_map.heuristics import Choice, choose
from fedjax_opt.core.client_map.memory import (ACCELERATOR_PLATFORMS, array_nbytes, client_footprint,
                                               default_memory_budget)
from fedjax_opt.core.client_map.rewrites import has_convolution, has_small_batched_dot
from fedjax_opt.core.client_map.tracing import abstract, num_clients, trace_client, trace_mapped
from fedjax_opt.core.types import PyTree

__all__ = ["CHUNK_SIZES", "DEFAULT_BUDGET_SECONDS", "REPEATS", "SLOW_FACTOR", "cache_dir", "candidates", "choice_name",
           "clear_memory", "decide", "decision_key", "measure", "measuring", "parse_choice"]

CHUNK_SIZES = (8, 32, 64, 128, 256, 512)
"""Clients per chunk that `candidates` tries (those below C)."""

DEFAULT_BUDGET_SECONDS = 30.0
"""Seconds of measuring after which no further candidate is started (env `FEDJAX_OPT_AUTOTUNE_SECONDS`)."""

REPEATS = 3
"""Timed runs per candidate after its warm-up run; their median counts."""

SLOW_FACTOR = 3.0
"""A candidate whose warm-up run takes more than this times the best median so far is not repeated."""

Timer = Callable[[str, Callable[[], Any]], float]
"""`timer(candidate name, run) -> seconds of one run`: how `measure` times a candidate (a test passes a fake)."""

_MEMORY: dict[str, str] = {}
_LOCK = threading.Lock()


def measuring(measure: bool | None = None) -> bool:
  """Whether `auto` measures: `measure` when given, else not when env `FEDJAX_OPT_AUTOTUNE` is off/0/false."""
  if measure is not None:
    return bool(measure)
  return os.environ.get("FEDJAX_OPT_AUTOTUNE", "on").strip().lower() not in ("off", "0", "false", "no")


def cache_dir(override: str | os.PathLike | None = None) -> str | None:
  """The folder of measured decisions: `override`, env `FEDJAX_OPT_AUTOTUNE_CACHE`, or ~/.cache/fedjax_opt/autotune;
  None when it is "off" (decisions kept in memory only)."""
  folder = override if override is not None else os.environ.get("FEDJAX_OPT_AUTOTUNE_CACHE")
  if folder is None:
    folder = os.path.join(os.path.expanduser("~"), ".cache", "fedjax_opt", "autotune")
  folder = os.fspath(folder)
  return None if folder == "off" else folder


def clear_memory() -> None:
  """Forgets the decisions this process keeps in memory (the cache folder is left alone)."""
  with _LOCK:
    _MEMORY.clear()


def choice_name(choice: Choice) -> str:
  """The client-map name of a single-device `Choice` ("vmap", "chunked:64:canonical_convs", "sequential" ...)."""
  if choice.chunk_size is None:
    name = "vmap"
  elif choice.chunk_size == 1:
    name = "sequential"
  else:
    name = f"chunked:{choice.chunk_size}"
  flags = [flag for flag in ("canonical_convs", "fuse_small_dots") if getattr(choice, flag)]
  return ":".join([name] + flags)


def parse_choice(name: str) -> Choice:
  """The `Choice` a `choice_name` spells (the inverse of `choice_name`)."""
  head, *rest = name.split(":")
  chunk = None
  if head == "sequential":
    chunk = 1
  elif head == "chunked":
    chunk = int(rest.pop(0))
  elif head != "vmap":
    raise ValueError(f"not a measured choice: {name!r}")
  return Choice(chunk_size=chunk, canonical_convs="canonical_convs" in rest, fuse_small_dots="fuse_small_dots" in rest)


def _device() -> jax.Device:
  return jax.local_devices()[0]


def _version() -> str:
  try:
    return importlib.metadata.version("fedjax_opt")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def decision_key(jaxpr: jex_core.ClosedJaxpr, shared: PyTree, per_client: PyTree, memory_budget: int) -> str:
  """The hash that names a decision: backend, device kind, versions, the per-client jaxpr, shapes and budget."""
  device = _device()
  parts = [device.platform, getattr(device, "device_kind", ""), jax.__version__, _version(), str(jaxpr.jaxpr),
           str(jax.tree.map(lambda s: (s.shape, str(s.dtype)), abstract(shared))),
           str(jax.tree.map(lambda s: (s.shape, str(s.dtype)), abstract(per_client))), str(int(memory_budget))]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def candidates(fn: Callable, shared: PyTree, per_client: PyTree, memory_budget: int,
               jaxpr: jex_core.ClosedJaxpr | None = None) -> list[Choice]:
  """The single-device modes `measure` times (module docstring, 2.), the measured rule's choice first."""
  jaxpr = trace_client(fn, shared, per_client) if jaxpr is None else jaxpr
  c = num_clients(per_client)
  footprint = max(client_footprint(fn, shared, per_client, jaxpr), 1)
  cpu = _device().platform not in ACCELERATOR_PLATFORMS
  convs = cpu and has_convolution(jaxpr)
  rule = choose(fn, shared, per_client, memory_budget, shard=False)
  # Larger batches of clients first (vmap, then chunks from the largest): on accelerators they are the
  # likely winners, and a budget that runs out then cuts the unlikely ones. On CPU a vmapped convolution
  # becomes a grouped one, which XLA:CPU ran about 100× slower (16 EMNIST-CNN clients: 160 s a map against
  # 1.6 s in a loop): too slow even to time, so a convolutional function runs one client at a time there.
  sizes = [1] if convs else [None] + sorted((k for k in CHUNK_SIZES if 1 < k < c), reverse=True) + [1]
  found = [rule]
  for k in sizes:
    if k != 1 and (c if k is None else k) * footprint > memory_budget:
      continue
    if convs:
      found.append(Choice(chunk_size=k, canonical_convs=True))
    found.append(Choice(chunk_size=k))
    if cpu and not convs and k != 1 and has_small_batched_dot(trace_mapped(fn, shared, per_client, min(k or c, c))):
      found.append(Choice(chunk_size=k, fuse_small_dots=True))
  unique = []
  for choice in found:
    if choice not in unique:
      unique.append(choice)
  return unique


def _concrete_jaxpr(closed: jex_core.ClosedJaxpr) -> jex_core.ClosedJaxpr:
  """`closed` with every constant that is a tracer of an enclosing trace replaced by zeros of its shape."""
  consts = [np.zeros(c.shape, c.dtype) if isinstance(c, jax.core.Tracer) else c for c in closed.consts]
  return jex_core.ClosedJaxpr(closed.jaxpr, consts)


def _example(aval: Any, rng: np.random.Generator) -> Any:
  """A concrete array of `aval`'s shape and dtype: floats small normal values, integers 0, booleans True."""
  dtype = aval.dtype
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.split(jax.random.key(0), int(np.prod(aval.shape, dtype=np.int64)) or 1)[
        :int(np.prod(aval.shape, dtype=np.int64))].reshape(aval.shape)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.asarray(rng.normal(scale=0.1, size=aval.shape), dtype)
  if dtype == jnp.bool_:
    return jnp.ones(aval.shape, bool)
  return jnp.zeros(aval.shape, dtype)


def _default_timer(_name: str, run: Callable[[], Any]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(run())
  return time.perf_counter() - start


def measure(fn: Callable, shared: PyTree, per_client: PyTree, choices: list[Choice], *,
            budget_seconds: float | None = None, timer: Timer | None = None,
            jaxpr: jex_core.ClosedJaxpr | None = None) -> dict[str, float]:
  """Seconds per map of each candidate (module docstring, 3.), by name; failed candidates are left out.

  Args:
    fn, shared, per_client: the map to time (`shared` and `per_client` may be tracers: only shapes are used).
    choices: the candidates, the one to time first first.
    budget_seconds: no candidate is started after this many seconds (the first always runs).
    timer: `timer(name, run) -> seconds` of one run (default: wall time of `run()` until ready).
  """
  from fedjax_opt.core.client_map import modes  # pylint: disable=import-outside-toplevel  (modes imports this)

  if budget_seconds is None:
    budget_seconds = float(os.environ.get("FEDJAX_OPT_AUTOTUNE_SECONDS", DEFAULT_BUDGET_SECONDS))
  timer = timer or _default_timer
  closed = _concrete_jaxpr(trace_client(fn, shared, per_client) if jaxpr is None else jaxpr)
  out_tree = jax.tree.structure(jax.eval_shape(fn, abstract(shared), abstract(per_client, drop_leading=True)))

  def pure(s, client):
    return jax.tree.unflatten(out_tree, jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves((s, client))))

  rng = np.random.default_rng(0)
  times: dict[str, float] = {}
  start = time.perf_counter()
  with jax.ensure_compile_time_eval():
    try:
      args = jax.tree.map(lambda a: _example(a, rng), (abstract(shared), abstract(per_client)))
    except (MemoryError, RuntimeError, ValueError):  # no room for the inputs: nothing measured, the rule decides
      return times
    for i, choice in enumerate(choices):
      if i and time.perf_counter() - start > budget_seconds:
        break
      name = choice_name(choice)
      mode = modes.resolve(name)
      try:
        compiled = jax.jit(lambda s, pc, mode=mode: mode(pure, s, pc)).lower(*args).compile()
        run = lambda compiled=compiled: compiled(*args)
        first = timer(name, run)  # the warm-up run
      except Exception:  # pylint: disable=broad-except  (out of memory, a mode this function cannot run): not a candidate
        continue
      best = min(times.values(), default=float("inf"))
      if first > SLOW_FACTOR * best or time.perf_counter() - start + REPEATS * first > budget_seconds:
        times[name] = first  # clearly slower, or no time left to repeat it: its one run counts
      else:
        times[name] = statistics.median(timer(name, run) for _ in range(REPEATS))
      del compiled, run
  return times


def _read(path: str) -> str | None:
  try:
    with open(path, encoding="utf-8") as f:
      stored = json.load(f)
    parse_choice(stored["choice"])
    return stored["choice"]
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _write(folder: str, key: str, decision: dict) -> None:
  """The decision as `folder/key.json`, whole or not at all (a temporary file renamed into place)."""
  try:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(decision, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(folder, f"{key}.json"))
  except OSError:
    pass  # a read-only or full disk: the decision stays in memory


def decide(fn: Callable, shared: PyTree, per_client: PyTree, memory_budget: int | None = None, *,
           folder: str | os.PathLike | None = None, budget_seconds: float | None = None,
           timer: Timer | None = None) -> Choice:
  """The measured single-device choice for this map: from memory, from the cache folder, or measured now.

  Args:
    fn, shared, per_client: the map (`shared`, `per_client` may be tracers).
    memory_budget: bytes the map may use at once (default `default_memory_budget()`).
    folder: the cache folder (default `cache_dir()`); "off": memory only.
    budget_seconds, timer: as in `measure`.
  """
  budget = default_memory_budget() if memory_budget is None else memory_budget
  jaxpr = trace_client(fn, shared, per_client)
  key = decision_key(jaxpr, shared, per_client, budget)
  with _LOCK:
    known = _MEMORY.get(key)
  if known is not None:
    return parse_choice(known)
  directory = cache_dir(folder)
  path = None if directory is None else os.path.join(directory, f"{key}.json")
  name = None if path is None else _read(path)
  if name is None:
    choices = candidates(fn, shared, per_client, budget, jaxpr)
    inputs = sum(array_nbytes(a) for a in jax.tree.leaves(abstract((shared, per_client))))
    # Inputs that alone take over a quarter of the default budget (of the device's memory) are not made up for a
    # measurement: the rule decides (and the round itself will be refused, or fit, as it would unmeasured).
    times = {} if inputs > default_memory_budget() // 4 else measure(fn, shared, per_client, choices, budget_seconds=budget_seconds,
                                                     timer=timer, jaxpr=jaxpr)
    name = min(times, key=times.get) if times else choice_name(choices[0])
    if directory is not None and times:
      device = _device()
      _write(directory, key, {"choice": name, "times": times, "key": key, "backend": device.platform,
                              "device_kind": getattr(device, "device_kind", ""), "jax": jax.__version__,
                              "clients": num_clients(per_client), "memory_budget": int(budget)})
  with _LOCK:
    _MEMORY[key] = name
  return parse_choice(name)
