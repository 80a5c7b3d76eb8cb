"""Round time against the population size N for algorithms with per-client state.

SCAFFOLD (c_i), FedDyn (h_i's gradient table) and Ditto (personal models)
keep one row per client of the whole population, a table `[N, P]` in the
server state. A round reads and writes only its C sampled rows (gather and
scatter inside jit), so its time should not depend on N. This script
measures that: W-LR (multinomial logistic regression, 60 features, 10
classes: P = 610), C = 1,000 clients per round, S = 5 local steps of B = 10
random examples; the round's client ids are drawn uniformly from the N
clients inside the compiled program. Each cell runs R rounds as one jitted
scan with the state donated (`fo.core.per_client.scan_rounds`, as `fo.train`
runs a chunk of rounds), after one warm-up call, and reports the median over
`--repeats` calls of time per round, with the table's bytes, for N = 10³ …
10⁶ and float32 / bfloat16 storage. Scans of R and 4R rounds, interleaved,
split that time into the cost of one more round inside the scan (the slope,
`ms_per_round_in_scan`) and a fixed cost per call (`ms_per_scan_call`: for
16-bit tables, one pass over the table to and from its uint16 bits).

    python benchmarks/population.py             # N = 1e3, 1e4, 1e5, 1e6
    python benchmarks/population.py --quick     # N = 1e3, 1e5; 3 rounds
    python benchmarks/population.py --devices 2 --algorithms scaffold --storage float32
        # the CPU as 2 devices: clients sharded, each table split on its rows over the devices

Writes benchmarks/results/population.json (`population_quick.json`; with --devices D
`population_<D>dev.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time


def _parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--algorithms", default="scaffold,feddyn,ditto")
  parser.add_argument("--clients", type=int, default=1000, help="C, clients per round")
  parser.add_argument("--storage", default="float32,bfloat16", help="table dtypes to measure")
  parser.add_argument("--devices", type=int, default=None,
                      help="simulate D CPU devices: clients sharded, tables split on their rows")
  parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  return parser.parse_args(argv)


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices:  # before JAX starts: XLA's device count is fixed then
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import fedjax_opt as fo  # noqa: E402
from fedjax_opt import distributed  # noqa: E402

P_FEATURES, K_CLASSES, S, B = 60, 10, 5, 10
LONG = 4  # the long scan runs LONG × rounds rounds: the slope between the two is the cost of a round inside it


def loss_fn(params, batch):
  logits = batch["x"] @ params["w"] + params["b"]
  return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]


def make(name: str, n: int, storage_dtype, client_map=None):
  sgd = optax.sgd(0.05)
  kw = dict(storage_dtype=storage_dtype, client_map=client_map)
  if name == "scaffold":
    return fo.algorithms.scaffold(loss_fn, 0.05, 1.0, num_clients=n, **kw)
  if name == "feddyn":
    return fo.algorithms.feddyn(loss_fn, 0.01, num_clients=n, client_optimizer=sgd, **kw)
  if name == "ditto":
    return fo.algorithms.ditto(loss_fn, 0.1, 0.05, num_clients=n, personal_steps=S, client_optimizer=sgd, **kw)
  raise ValueError(name)


STRIDES = jnp.asarray([7919, 104729, 1299709, 15485863], jnp.int32)  # primes, so coprime with N = 10^k


def round_batches(key, n: int, c: int):
  """C distinct clients of N (C ≤ N) in O(C): a random arithmetic progression mod N, with random examples."""
  k_off, k_stride, k_x, k_y = jax.random.split(key, 4)
  offset = jax.random.randint(k_off, (), 0, n)
  stride = STRIDES[jax.random.randint(k_stride, (), 0, STRIDES.shape[0])] % n
  ids = (offset + jnp.arange(c, dtype=jnp.int32) * stride) % n  # < 1,000 · 10^6: no int32 overflow
  x = jax.random.normal(k_x, (c, S, B, P_FEATURES))
  y = jax.random.randint(k_y, (c, S, B), 0, K_CLASSES)
  return fo.ClientBatches(data={"x": x, "y": y}, mask=jnp.ones((c, S, B), bool), weight=jnp.full(c, float(S * B)),
                          client_id=ids)


def time_cell(name: str, n: int, c: int, rounds: int, repeats: int, storage_dtype) -> dict:
  several = jax.device_count() > 1
  mesh = fo.client_map.client_mesh() if several else None
  algo = make(name, n, storage_dtype, fo.client_map.sharded(mesh) if several else None)
  params = {"w": jnp.zeros((P_FEATURES, K_CLASSES)), "b": jnp.zeros(K_CLASSES)}
  state = algo.init(params, jax.random.key(0))
  if several:  # every [N, ...] table split on its rows over the devices, the rest replicated
    state = distributed.shard_per_client_state(state, n, mesh)
  table_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if leaf.ndim and leaf.shape[0] == n)

  def run(state, key, rounds):
    def one(state, k):
      return algo.step(state, round_batches(k, n, c)), None
    state, _ = fo.core.per_client.scan_rounds(one, state, jax.random.split(key, rounds))
    return state

  step = jax.jit(run, donate_argnums=0, static_argnums=2)
  t0 = time.perf_counter()
  state = jax.block_until_ready(step(state, jax.random.key(1), rounds))
  compile_and_first = time.perf_counter() - t0
  state = jax.block_until_ready(step(state, jax.random.key(1), LONG * rounds))  # compiles the long scan
  short, long = [], []
  for r in range(repeats):  # interleaved: a short and a long scan per repeat
    for length, times in ((rounds, short), (LONG * rounds, long)):
      t0 = time.perf_counter()
      state = jax.block_until_ready(step(state, jax.random.key(2 + r), length))
      times.append(time.perf_counter() - t0)
  t_short, t_long = statistics.median(short), statistics.median(long)
  marginal = (t_long - t_short) / ((LONG - 1) * rounds)  # the slope: one more round inside the scan
  tables = [leaf for leaf in jax.tree.leaves(state) if getattr(leaf, "ndim", 0) and leaf.shape[0] == n]
  return {"algorithm": name, "N": n, "C": c, "storage": jnp.dtype(storage_dtype or jnp.float32).name,
          "devices": jax.device_count(), "table_sharding": str(getattr(tables[0].sharding, "spec", "single device")),
          "table_bytes": int(table_bytes), "ms_per_round": 1e3 * t_short / rounds,
          "ms_per_round_in_scan": 1e3 * marginal, "ms_per_scan_call": 1e3 * (t_short - rounds * marginal),
          "first_call_seconds": compile_and_first}


def main(args: argparse.Namespace) -> dict:
  populations = [1_000, 100_000] if args.quick else [1_000, 10_000, 100_000, 1_000_000]
  rounds, repeats = (3, 2) if args.quick else (10, 3)
  rows = []
  print(f"{'algorithm':<10} {'storage':<9} {'N':>9} {'table MiB':>10} {'ms/round':>9} {'in scan':>8} {'per call':>9}")
  for name in args.algorithms.split(","):
    for storage in [None if d == "float32" else jnp.dtype(d) for d in args.storage.split(",")]:
      for n in populations:
        row = time_cell(name, n, args.clients, rounds, repeats, storage)
        rows.append(row)
        print(f"{name:<10} {row['storage']:<9} {n:>9,} {row['table_bytes'] / 2**20:>10.1f} "
              f"{row['ms_per_round']:>9.1f} {row['ms_per_round_in_scan']:>8.1f} {row['ms_per_scan_call']:>9.1f}  "
              f"{row['table_sharding']}", flush=True)
  out = {"settings": {"P": P_FEATURES * K_CLASSES + K_CLASSES, "S": S, "B": B, "C": args.clients, "rounds": rounds,
                      "repeats": repeats, "jax": jax.__version__, "backend": jax.default_backend(),
                      "machine": platform.machine(), "cpu_count": os.cpu_count()},
         "rows": rows}
  os.makedirs(args.out_dir, exist_ok=True)
  suffix = ("_quick" if args.quick else "") + (f"_{args.devices}dev" if args.devices else "")
  path = os.path.join(args.out_dir, f"population{suffix}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {path}")
  return out


if __name__ == "__main__":
  main(ARGS)
