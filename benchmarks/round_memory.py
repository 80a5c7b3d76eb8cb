"""Peak memory of one federated round as `fo.train` runs it, one fresh process per cell.

A cell packs a dataset (random examples of the workload's shapes, seeded),
then measures one FedAvg round exactly as `fo.train`'s compiled chunk body
runs it: `algorithm.step(state, fo.data.sample_round(key, dataset, C, S, B,
deferred=...))` under `jax.jit`, client map `auto`. It reports

* `rss_data`: resident memory once the dataset is on the device (the floor);
* `peak_rss_round`: the process's peak resident memory while the round is
  compiled and run, the dataset included (Linux: the high-water mark is reset
  through /proc/self/clear_refs after the dataset is built, then read from
  VmHWM);
* XLA's own account of the compiled round (`memory_analysis`: temporaries),
  compile and run seconds, and the mode `auto` chose.

Two ways of handing the round its data, for before/after:

* `eager`: `sample_round(deferred=False)` gathers the round's `[C, S, B, ...]`
  batch before the step (every `fo.train` round did until deferred data);
* `deferred`: the step gathers each chunk of clients' examples inside its
  client loop (what `fo.train` does now).

Workloads (as in `benchmarks/throughput.py`):
  W-CNN: the EMNIST CNN of Reddi et al. (28×28×1, 62 classes), S = 5, B = 20; N = C clients of 100 examples.
  W-MLP: the 2NN MLP (784-200-200-10), S = 10, B = 20; N = 10,000 clients of 20 examples (each client's
         10 steps are 10 epochs); C = 100 … 10,000.

    python benchmarks/round_memory.py            # every cell (about 15 min on a 2-core CPU)
    python benchmarks/round_memory.py --quick    # W-MLP at C = 100 and 1,000 only
    python benchmarks/round_memory.py --cells W-MLP:10000:deferred

Writes benchmarks/results/round_memory.json (`round_memory_quick.json`; a run of `--cells`
`round_memory_cells.json`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time

WORKLOADS = {  # name: (local steps S, batch B, examples per client, clients in the dataset (None: C))
    "W-CNN": (5, 20, 100, None),
    "W-MLP": (10, 20, 20, 10_000),
}
FULL = ["W-CNN:1024:eager", "W-CNN:1024:deferred"] + [f"W-MLP:{c}:{d}" for c in (100, 1000, 10_000)
                                                      for d in ("eager", "deferred")]
QUICK = [f"W-MLP:{c}:{d}" for c in (100, 1000) for d in ("eager", "deferred")]


def _status(field: str) -> int:
  """A `/proc/self/status` field in bytes (VmRSS, VmHWM)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def _short(mode) -> str:
  """A mode as its `client_map` name ("sequential:canonical_convs", "chunked:64", "vmap")."""
  name = type(mode).__name__
  if name == "Chunked":
    base = "sequential" if mode.chunk_size == 1 else f"chunked:{mode.chunk_size}"
  else:
    base = name.lower()
  flags = [f for f in ("unroll", "canonical_convs", "fuse_small_dots") if getattr(mode, f, False)]
  return ":".join([base] + flags)


def child(cell: str) -> dict:
  """Runs one cell in this process and returns its measurements."""
  import jax
  import numpy as np
  import optax

  import fedjax_opt as fo
  from fedjax_opt.core import client_map as cm

  name, c, data_mode = cell.split(":")
  c = int(c)
  s, b, per_client, n = WORKLOADS[name]
  n = n or c
  model = fo.models.emnist_cnn() if name == "W-CNN" else fo.models.mlp_2nn(num_classes=10, input_dim=784)
  shape = tuple(model.input_shape)
  rng = np.random.default_rng(0)
  clients = [{"x": rng.standard_normal(size=(per_client,) + shape, dtype=np.float32),
              "y": rng.integers(0, model.num_classes, per_client)} for _ in range(n)]
  dataset = fo.data.pack(clients)
  del clients
  jax.block_until_ready(dataset.examples)
  ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the host copies' freed heap back, so RSS counts what is held
  rss_data = _status("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")

  algo = fo.algorithms.fedavg(model.loss_fn, client_optimizer=optax.sgd(0.05), client_map="auto")
  state = algo.init(model.init(jax.random.key(0)), jax.random.key(1))
  deferred = data_mode == "deferred"
  round_fn = jax.jit(lambda st, key, ds: algo.step(st, fo.data.sample_round(key, ds, c, s, b, deferred=deferred)))
  t0 = time.perf_counter()
  compiled = round_fn.lower(state, jax.random.key(2), dataset).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  new = jax.block_until_ready(compiled(state, jax.random.key(2), dataset))
  run_s = time.perf_counter() - t0
  analysis = compiled.memory_analysis()
  batches = jax.eval_shape(lambda key: fo.data.sample_round(key, dataset, c, s, b), jax.random.key(2))
  fn = lambda p, client: fo.core.local_train(model.loss_fn, optax.sgd(0.05), p, *client)
  chosen = cm.Auto().resolve(fn, state.params, (batches.data, batches.mask))
  return {
      "cell": cell, "workload": name, "C": c, "N": n, "data": data_mode, "S": s, "B": b,
      "auto_chose": _short(chosen),
      "rss_data_bytes": rss_data,
      "peak_rss_round_bytes": _status("VmHWM"),
      "xla_temp_bytes": None if analysis is None else analysis.temp_size_in_bytes,
      "batch_bytes": int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(batches.data))),
      "compile_seconds": compile_s, "run_seconds": run_s,
      "num_clients_trained": int(new.metrics["num_clients"]),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="W-MLP at C = 100 and 1,000 only")
  parser.add_argument("--cells", help="comma-separated WORKLOAD:C:eager|deferred cells")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child)))
    return
  cells = args.cells.split(",") if args.cells else (QUICK if args.quick else FULL)
  for cell in cells:
    name, c, mode = (cell.split(":") + ["", "", ""])[:3]
    if name not in WORKLOADS or not c.isdigit() or mode not in ("eager", "deferred"):
      parser.error(f"a cell is WORKLOAD:C:eager|deferred with WORKLOAD in {sorted(WORKLOADS)}; got {cell!r}")
  rows = []
  print(f"{'cell':<26} {'auto chose':<28} {'batch GiB':>9} {'data RSS':>9} {'round peak':>10} "
        f"{'XLA temp':>9} {'compile s':>9} {'run s':>7}", flush=True)
  for cell in cells:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", cell], capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
      print(f"{cell:<26} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
      rows.append({"cell": cell, "error": proc.stderr[-3000:]})
      continue
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    rows.append(row)
    gib = lambda v: f"{v / 2**30:.2f}" if v is not None else "-"
    print(f"{cell:<26} {row['auto_chose']:<28} {gib(row['batch_bytes']):>9} {gib(row['rss_data_bytes']):>9} "
          f"{gib(row['peak_rss_round_bytes']):>10} {gib(row['xla_temp_bytes']):>9} {row['compile_seconds']:>9.1f} "
          f"{row['run_seconds']:>7.1f}", flush=True)
  import jax
  suffix = "_cells" if args.cells else ("_quick" if args.quick else "")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"round_memory{suffix}.json")
  with open(path, "w") as f:
    json.dump({"jax": jax.__version__, "machine": platform.processor() or platform.machine(),
               "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
