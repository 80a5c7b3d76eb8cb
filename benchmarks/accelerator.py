"""One command for the machine a user runs on (a GPU, a TPU, or the CPU): where a FedAvg round's time goes.

For each workload and C (the models and data of benchmarks/throughput.py: W-MLP the 2NN MLP, S = 10, B = 20;
W-LR logistic regression on Synthetic(1,1), S = 20, B = 10; W-CNN the EMNIST CNN, S = 5, B = 20), the seconds of
one round (median of interleaved repeats after compilation, benchmarks/throughput.py's `time_cell`) of:

  auto                    `fo.algorithms.fedavg(...)` with the default client map, measured on this machine
                          from an empty decision cache (`fedjax_opt.core.client_map.autotune`): its choice and
                          the seconds its first compilation took, measurement included, are reported
  auto+bf16               the same under `fo.with_execution(..., precision="bfloat16")` (client passes in
                          bfloat16, parameters and state float32)
  vmap, chunked:K, sequential ...   every candidate mode, named
  plain vmap              `jax.vmap` of a bare local-SGD scan, then the weighted mean: no guard, no metrics
  loop/client             one jitted call per client, then one averaging call (fedjax's per-client loop)
  central                 the same S steps of one model on the C clients' batches merged (batch C·B): the floor
  torch loop              a PyTorch per-client loop on the same device, when torch can use it (skipped otherwise)

and, per machine: the float32 matmul peak (n³ matmul), the memory bandwidth (a copy of 1 GiB, 256 MiB on CPU)
and from it the memory bound of a round with per-client models, 2 × model bytes × C × S / bandwidth (each
local step reads and writes every client's weights at least once).

The overhead part (`--part overhead`, also in every full run): the optimized HLO of our FedAvg round under
`vmap` against the plain vmap's, on this backend: bytes accessed with every loop body counted once per trip
(`hlo_bytes`; XLA's own `cost_analysis()` counts a body once), their ratio, and the number of kernels
(fusions, dots, custom calls) a round launches.

    python benchmarks/accelerator.py                 # every cell (≈ 5–8 min on one GPU); table and JSON
    python benchmarks/accelerator.py --quick         # small C, a few seconds a cell (the slow test tier runs it)
    python benchmarks/accelerator.py --part overhead # only the HLO comparison (compiles, runs nothing)

Writes `benchmarks/results/accelerator_<platform>.json` (`_quick` added for --quick).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fedjax_opt as fo  # noqa: E402
import throughput as tp  # noqa: E402

SIZES = {"W-MLP": [128, 512, 2048], "W-LR": [100, 1000], "W-CNN": [32, 128, 512]}
QUICK_SIZES = {"W-MLP": [8, 32], "W-LR": [10, 100], "W-CNN": [8]}
CHUNKS = (8, 32, 64, 256)


def _parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="small client counts (CPU-sized)")
  parser.add_argument("--part", choices=("all", "overhead"), default="all")
  parser.add_argument("--workloads", default="W-MLP,W-LR,W-CNN")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--cell-seconds", type=float, default=8.0, help="time budget per method and C")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  return parser.parse_args(argv)


# ---- the overhead part: bytes of the optimized HLO, loops counted per trip -----------------------------------

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(.*)$")
_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "partition-id", "replica-id",
         "copy-start", "copy-done"}
_KERNELS = {"fusion", "dot", "convolution", "custom-call", "copy", "reduce", "scatter", "gather", "sort"}


def _shape_bytes(text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _BYTES[t] for t, dims in _SHAPE.findall(text))


def hlo_bytes(hlo_text: str) -> dict[str, float]:
  """Bytes accessed and kernels launched by one run of an optimized HLO module (its text).

  Each instruction of the entry computation counts the bytes of its operands and its result (a fusion as one
  instruction: what it reads and writes, not its inside); a `while` counts its body's total times its known
  trip count (XLA's `known_trip_count`, 1 when unknown), a call or conditional its callee's. Parameters,
  tuples, bitcasts and constants cost nothing. Kernels: fusions, dots, convolutions, custom calls, copies and
  other non-free instructions outside fusions, counted the same way.
  """
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header and not line.startswith(" "):
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and "=" in line:
      computations[current].append(line.strip())
  shapes = {}
  for lines in computations.values():
    for line in lines:
      match = _INSTRUCTION.match(line)
      if match:
        shapes[match.group(1)] = match.group(2)
  memo: dict[str, tuple[float, float]] = {}

  def cost(name: str) -> tuple[float, float]:
    if name in memo:
      return memo[name]
    total = kernels = 0.0
    for line in computations.get(name, []):
      match = _INSTRUCTION.match(line)
      if not match or match.group(3) in _FREE:
        continue
      _, shape, op, args, rest = match.groups()
      if op == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        b, k = cost(body)
        n = int(trips.group(1)) if trips else 1
        total, kernels = total + n * b, kernels + n * k
        continue
      callee = re.search(r"(?:to_apply|calls|true_computation|branch_computations)=\{?%?([\w.\-]+)", rest)
      if op in ("call", "conditional", "async-start") and callee:
        b, k = cost(callee.group(1))
        total, kernels = total + b, kernels + k
        continue
      total += _shape_bytes(shape) + sum(_shape_bytes(shapes.get(o, "")) for o in re.findall(r"%([\w.\-]+)", args))
      kernels += 1
    memo[name] = (total, kernels)
    return memo[name]

  total, kernels = cost(entry)
  return {"bytes": total, "kernels": kernels}


def plain_vmap_round(workload, params, batches) -> Callable[[], Any]:
  """`jax.vmap` of bare local SGD (a scan of masked-mean gradient steps), then x + Σ w_c Δ_c / Σ w_c."""
  compiled = _plain_program(workload, params, batches).compile()
  return lambda: compiled(params, batches.data, batches.mask, batches.weight)


def _plain_program(workload, params, batches):
  sgd_step = tp._sgd_step(workload.model.loss_fn)  # one masked SGD step, as every method of throughput.py takes

  def client(p, data, mask):
    final, _ = jax.lax.scan(lambda x, inputs: (sgd_step(x, *inputs), None), p, (data, mask))
    return jax.tree.map(jnp.subtract, final, p)

  def round_(p, data, mask, weight):
    deltas = jax.vmap(client, in_axes=(None, 0, 0))(p, data, mask)
    w = weight / jnp.sum(weight)
    return jax.tree.map(lambda x, d: x + jnp.tensordot(w, d, axes=1), p, deltas)

  return jax.jit(round_).lower(params, batches.data, batches.mask, batches.weight)


def _ours_program(workload, params, batches, client_map: Any = None, precision: str | None = None):
  algorithm = fo.algorithms.fedavg(workload.model.loss_fn, client_optimizer=optax.sgd(tp.CLIENT_LR))
  algorithm = fo.with_execution(algorithm, client_map=client_map, precision=precision)
  state = algorithm.init(params, jax.random.key(0))
  return jax.jit(algorithm.step).lower(state, batches), state


def overhead(workload, c: int) -> dict[str, Any]:
  """The HLO comparison of ours (vmap) and the plain vmap for one cell."""
  params = workload.model.init(jax.random.key(0))
  batches = tp._batches(workload, c)
  ours = hlo_bytes(_ours_program(workload, params, batches, "vmap")[0].compile().as_text())
  plain = hlo_bytes(_plain_program(workload, params, batches).compile().as_text())
  return {"workload": workload.name, "C": c, "ours_bytes": ours["bytes"], "plain_bytes": plain["bytes"],
          "bytes_ratio": ours["bytes"] / plain["bytes"], "ours_kernels": ours["kernels"],
          "plain_kernels": plain["kernels"]}


# ---- the machine ---------------------------------------------------------------------------------------------


def memory_bandwidth(nbytes: int, repeats: int = 7) -> float:
  """Bytes per second of y = 2x over `nbytes` of float32 (read once, written once)."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 2.0).lower(x).compile()
  jax.block_until_ready(f(x))
  best = min(tp._timed(lambda: f(x)) for _ in range(repeats))
  return 2 * nbytes / best


def torch_loop(workload, params, batches) -> Callable[[], Any] | str:
  """A PyTorch per-client loop of the same local SGD on this device, or why it is skipped."""
  if importlib.util.find_spec("torch") is None:
    return "torch not installed"
  import torch  # pylint: disable=import-outside-toplevel

  device = {"gpu": "cuda", "cpu": "cpu"}.get(jax.default_backend())
  if device is None or (device == "cuda" and not torch.cuda.is_available()):
    return f"torch cannot use this {jax.default_backend()}"
  if workload.name == "W-MLP":
    make = lambda: torch.nn.Sequential(torch.nn.Linear(784, 200), torch.nn.ReLU(), torch.nn.Linear(200, 200),
                                       torch.nn.ReLU(), torch.nn.Linear(200, 10))
  elif workload.name == "W-CNN":
    make = lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3),
                                       torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                       torch.nn.Linear(9216, 128), torch.nn.ReLU(), torch.nn.Linear(128, 62))
  else:
    make = lambda: torch.nn.Linear(60, 10)
  x = torch.as_tensor(np.asarray(batches.data["x"]), device=device)
  if workload.name == "W-CNN":
    x = x.reshape(x.shape[:3] + (1, 28, 28))
  y = torch.as_tensor(np.asarray(batches.data["y"]), dtype=torch.long, device=device)
  server = make().to(device)
  start = [p.detach().clone() for p in server.parameters()]

  def run():
    total = [torch.zeros_like(p) for p in start]
    for k in range(x.shape[0]):
      model = make().to(device)
      with torch.no_grad():
        for p, s in zip(model.parameters(), start):
          p.copy_(s)
      opt = torch.optim.SGD(model.parameters(), lr=tp.CLIENT_LR)
      for s in range(x.shape[1]):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[k, s]), y[k, s]).backward()
        opt.step()
      with torch.no_grad():
        for t, p, s0 in zip(total, model.parameters(), start):
          t += (p - s0) / x.shape[0]
    if device == "cuda":
      torch.cuda.synchronize()
    return None

  return run


# ---- one cell ------------------------------------------------------------------------------------------------


def _newest_choice(folder: str) -> str | None:
  files = sorted((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".json")), key=os.path.getmtime)
  if not files:
    return None
  with open(files[-1], encoding="utf-8") as f:
    return json.load(f)["choice"]


def cell(workload, c: int, args, cache: str) -> list[dict]:
  params = workload.model.init(jax.random.key(0))
  batches = tp._batches(workload, c)
  rows, runs = [], {}
  before = set(os.listdir(cache))
  t0 = time.perf_counter()
  program, state = _ours_program(workload, params, batches)
  compiled = program.compile()
  auto_compile = time.perf_counter() - t0
  new = [f for f in os.listdir(cache) if f not in before]
  choice = _newest_choice(cache) if new else "(rule: nothing to measure)"
  runs["auto"] = lambda compiled=compiled, state=state: compiled(state, batches)
  compiled16 = _ours_program(workload, params, batches, precision="bfloat16")
  c16 = compiled16[0].compile()
  runs["auto+bf16"] = lambda c16=c16, s=compiled16[1]: c16(s, batches)
  cpu = jax.default_backend() == "cpu"
  convs = workload.name == "W-CNN"
  modes = (["sequential:canonical_convs", "sequential"] if cpu and convs else
           ["vmap"] + [f"chunked:{k}" for k in CHUNKS if k < c] + ["sequential"])
  for mode in modes:
    prog, st = _ours_program(workload, params, batches, mode)
    comp = prog.compile()
    runs[mode] = lambda comp=comp, st=st: comp(st, batches)
  runs["plain vmap"] = plain_vmap_round(workload, params, batches)
  runs["loop/client"] = tp.loop_per_client(workload, params, batches)
  runs["central"] = tp.central(workload, params, batches)
  torch_run = torch_loop(workload, params, batches)
  if callable(torch_run) and c <= 128:
    runs["torch loop"] = torch_run
  seconds = tp.time_cell(runs, args.repeats, args.cell_seconds)
  model_bytes = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(params))
  for method, s in seconds.items():
    rows.append({"workload": workload.name, "C": c, "method": method, "seconds": s})
  best_mode = min(modes, key=seconds.get)
  rows.append({"workload": workload.name, "C": c, "method": "summary", "auto_choice": choice,
               "auto_first_compile_seconds": auto_compile, "best_mode": best_mode,
               "auto_over_best": seconds["auto"] / seconds[best_mode],
               "vmap_over_plain": seconds.get("vmap", float("nan")) / seconds["plain vmap"],
               "auto_over_plain": seconds["auto"] / seconds["plain vmap"],
               "loop_over_auto": seconds["loop/client"] / seconds["auto"],
               "bf16_speedup": seconds["auto"] / seconds["auto+bf16"],
               "model_bytes": model_bytes, "torch": None if callable(torch_run) else torch_run})
  return rows


def _ms(s: float | None) -> str:
  return "–" if s is None or not math.isfinite(s) else f"{s * 1e3:,.2f}"


def print_cell(rows: list[dict], bandwidth: float, steps: int) -> None:
  summary = next(r for r in rows if r["method"] == "summary")
  bound = 2 * summary["model_bytes"] * summary["C"] * steps / bandwidth
  print(f"\n{summary['workload']}, C = {summary['C']}: auto chose {summary['auto_choice']} "
        f"(first compilation {summary['auto_first_compile_seconds']:.1f} s, measuring included); "
        f"memory bound {bound * 1e3:,.2f} ms")
  for r in rows:
    if r["method"] != "summary":
      print(f"  {r['method']:<28} {_ms(r['seconds']):>12} ms")
  print(f"  auto ÷ best mode ({summary['best_mode']}) {summary['auto_over_best']:.2f}; vmap ÷ plain vmap "
        f"{summary['vmap_over_plain']:.2f}; loop/client ÷ auto {summary['loop_over_auto']:.2f}; "
        f"bf16 speed-up {summary['bf16_speedup']:.2f}")
  summary["memory_bound_seconds"] = bound


def main(args) -> dict:
  backend = jax.default_backend()
  device = jax.devices()[0]
  print(f"backend {backend}, {getattr(device, 'device_kind', '')}, {jax.device_count()} device(s), "
        f"jax {jax.__version__}")
  names = [w for w in args.workloads.split(",") if w]
  sizes = QUICK_SIZES if args.quick else SIZES
  result: dict[str, Any] = {"backend": backend, "device_kind": getattr(device, "device_kind", ""),
                            "jax": jax.__version__, "python": platform.python_version(), "quick": args.quick,
                            "command": " ".join(["python", "benchmarks/accelerator.py"] + sys.argv[1:])}
  result["overhead"] = []
  print("\nHLO of one round, ours (vmap) against the plain vmap: bytes accessed (loops counted per trip), kernels")
  for name in names:
    if name == "W-CNN":
      continue
    for c in sizes[name]:
      row = overhead(tp.WORKLOADS[name], c)
      result["overhead"].append(row)
      print(f"  {name:<6} C = {c:<5} bytes {row['ours_bytes'] / 1e6:>10,.1f} MB ÷ {row['plain_bytes'] / 1e6:>10,.1f} MB"
            f" = {row['bytes_ratio']:.3f}; kernels {row['ours_kernels']:,.0f} against {row['plain_kernels']:,.0f}")
  if args.part == "all":
    peak = tp.matmul_peak_flops(2048 if backend == "cpu" else 8192)
    bandwidth = memory_bandwidth((256 if backend == "cpu" else 1024) << 20)
    result.update(matmul_peak_flops=peak, memory_bandwidth=bandwidth)
    print(f"\nmatmul peak {peak / 1e12:,.2f} TFLOP/s (float32), memory bandwidth {bandwidth / 1e9:,.1f} GB/s")
    with tempfile.TemporaryDirectory() as cache:
      os.environ["FEDJAX_OPT_AUTOTUNE_CACHE"] = cache  # auto measures from scratch, as on a new machine
      os.environ["FEDJAX_OPT_AUTOTUNE"] = "on"
      fo.core.client_map.autotune.clear_memory()
      result["cells"] = []
      for name in names:
        workload = tp.WORKLOADS[name]
        for c in sizes[name]:
          rows = cell(workload, c, args, cache)
          print_cell(rows, bandwidth, workload.local_steps)
          result["cells"].extend(rows)
  os.makedirs(args.out, exist_ok=True)
  suffix = "_quick" if args.quick else ""
  part = "" if args.part == "all" else f"_{args.part}"
  path = os.path.join(args.out, f"accelerator_{backend}{part}{suffix}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(f"\nwrote {path}")
  return result


if __name__ == "__main__":
  main(_parse_args())
