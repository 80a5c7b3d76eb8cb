"""What simulated secure aggregation costs against the plain mean, inside jit.

One `aggregate` call of `fo.privacy.secure_aggregation(fo.aggregators.mean())`
(f = 16 fractional bits, B = 1, threshold ⌊C/2⌋ + 1) on C random float32
client updates of P parameters, against `fo.aggregators.mean()` on the same
updates, for C = 10, 30, 100, 300, 1,000 and P = 10⁴, 10⁵, without dropouts
and with 10% of the clients (⌈0.1 C⌉, a fixed random set) dropping after the
key exchange. Each call is compiled first (compile time reported apart), then
timed: the median of 3 calls, or one call when one takes over 5 s.

The protocol expands C − 1 pairwise masks of P + 1 words per client, O(C²P)
PRG output (threefry): each pair's mask once, about C²(P + 1)/2 words, plus
|D|·C·(P + 1) to remove the masks of |D| dropped clients. Cells above
`--max-words` (default 7·10⁹, one to two minutes of threefry on 2 CPU cores) are
skipped and listed with that estimate; by default that is P = 10⁵ at C = 1,000.

Every secure result is checked against the plain mean over the surviving
clients: within the fixed-point bound 2^−f per coordinate (`exact` in the
JSON: the bound holds and the round was accepted).

    python benchmarks/secure_aggregation.py            # the table of docs/privacy.md: about 6 min on 2 CPU cores
    python benchmarks/secure_aggregation.py --quick    # P = 1,000, C = 10 and 30: seconds

Writes benchmarks/results/secure_aggregation.json (`--quick`: secure_aggregation_quick.json; `--out` to choose):
settings, the environment, one row per (P, C, dropout) with the seconds of both
aggregators, their ratio, the compile time, the bits one client uploads, the
words of PRG output, and the skipped cells.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import fedjax_opt as fo

FRAC_BITS = 16
BOUND = 1.0
FULL = dict(parameters=(10_000, 100_000), clients=(10, 30, 100, 300, 1000), dropouts=(0.0, 0.1))
QUICK = dict(parameters=(1_000,), clients=(10, 30), dropouts=(0.0, 0.1))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _timed(compiled, args: tuple, repeats: int = 3) -> tuple[float, object]:
  times, out = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
    if times[-1] > 5.0:
      break
  return float(np.median(times)), out


def prg_words(c: int, p: int, dropped: int) -> int:
  """Words of PRG output in one round: every pair once, the self masks twice, the dropped clients' pairs."""
  return (c * (c - 1) // 2 + 2 * c + dropped * c) * (p + 1)


def run_cell(c: int, p: int, dropout: float, seed: int = 0) -> dict:
  """Times the secure mean and the plain mean on C updates of P parameters; checks the secure result."""
  rng = np.random.default_rng(seed + c)
  updates = {"w": jnp.asarray(rng.normal(size=(c, p)) * 0.1, jnp.float32)}
  weights = jnp.ones(c)
  num_dropped = math.ceil(dropout * c)
  dropped = np.zeros(c, bool)
  dropped[rng.permutation(c)[:num_dropped]] = True
  secure = fo.privacy.secure_aggregation(fo.aggregators.mean(), frac_bits=FRAC_BITS, bound=BOUND,
                                         dropout=lambda key, w: jnp.asarray(dropped))
  mean = fo.aggregators.mean()
  key = jax.random.key(seed)
  args = (updates, weights, secure.init(None), key)
  start = time.perf_counter()
  compiled = jax.jit(secure.aggregate).lower(*args).compile()
  compile_s = time.perf_counter() - start
  secure_s, (out, state) = _timed(compiled, args)
  mean_args = (updates, weights, mean.init(None), key)
  mean_s, _ = _timed(jax.jit(mean.aggregate).lower(*mean_args).compile(), mean_args, repeats=5)
  survivors = np.asarray(updates["w"], np.float64)[~dropped].mean(axis=0)
  error = float(np.max(np.abs(np.asarray(out["w"], np.float64) - survivors)))
  return {"parameters": p, "clients": c, "dropout": dropout, "dropped": int(state.num_dropped),
          "secure_s": secure_s, "mean_s": mean_s, "overhead": secure_s / mean_s, "compile_s": compile_s,
          "upload_bits": float(state.upload_bits), "plain_bits": 32 * p, "prg_words": prg_words(c, p, num_dropped),
          "max_error": error, "exact": bool(state.recovered == (num_dropped > 0)) and error <= 2.0**-FRAC_BITS + 1e-6}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="P = 1,000, C = 10 and 30")
  parser.add_argument("--clients", default=None, help="comma-separated C values instead of the defaults")
  parser.add_argument("--max-words", type=float, default=7e9, help="skip cells with more PRG output than this")
  parser.add_argument("--out", default=None, help="the JSON file to write")
  args = parser.parse_args(argv)
  settings = dict(QUICK if args.quick else FULL)
  if args.clients:
    settings["clients"] = tuple(int(c) for c in args.clients.split(","))
  out = args.out or os.path.join(RESULTS, "secure_aggregation_quick.json" if args.quick else "secure_aggregation.json")
  start = time.perf_counter()
  rows, skipped = [], []
  header = (f"{'P':>7} {'C':>5} {'drop':>5} {'mean ms':>9} {'secure s':>9} {'overhead':>10} {'compile s':>9} "
            f"{'Gwords':>7} {'bits/client':>12} {'max err':>9}")
  print(header)
  print("-" * len(header))
  for p in settings["parameters"]:
    for c in settings["clients"]:
      for dropout in settings["dropouts"]:
        words = prg_words(c, p, math.ceil(dropout * c))
        if words > args.max_words:
          skipped.append({"parameters": p, "clients": c, "dropout": dropout, "prg_words": words})
          print(f"{p:>7} {c:>5} {dropout:>5.1f}  skipped: {words / 1e9:.0f}e9 PRG words > --max-words")
          continue
        r = run_cell(c, p, dropout)
        rows.append(r)
        print(f"{p:>7} {c:>5} {dropout:>5.1f} {1e3 * r['mean_s']:>9.3f} {r['secure_s']:>9.3f} "
              f"{r['overhead']:>9.0f}x {r['compile_s']:>9.1f} {words / 1e9:>7.2f} {r['upload_bits']:>12,.0f} "
              f"{r['max_error']:>9.1e}")
  report = {
      "settings": {"frac_bits": FRAC_BITS, "bound": BOUND, "threshold": "C // 2 + 1", "quick": args.quick,
                   **{k: list(v) for k, v in settings.items()}, "max_words": args.max_words},
      "environment": {"backend": jax.default_backend(), "devices": jax.device_count(), "jax": jax.__version__,
                      "cpu_count": os.cpu_count(), "machine": platform.machine()},
      "seconds": time.perf_counter() - start,
      "rows": rows,
      "skipped": skipped,
  }
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {out} ({report['seconds']:.0f} s)")
  return report


if __name__ == "__main__":
  main()
