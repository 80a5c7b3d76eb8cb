"""Robust aggregators and attacks under `client_map.sharded` on 8 simulated CPU devices equal the one-device rounds.

XLA must be told to simulate 8 host devices before JAX starts, and the rest
of the suite must keep seeing one device, so the rounds run once in a
subprocess (this file run as a script) that prints its measurements as JSON;
the tests below assert on them (the pattern of tests/test_sharded.py).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # multi-device workers run as subprocesses

NUM_DEVICES = 8
C, S, B, D, K = 13, 2, 4, 5, 3  # 13 rows: not a multiple of 8 devices; the last one a zero-weight client
ROUNDS = 2
RULES = ("marginal_median", "mean_around_median", "geometric_median", "geometric_median_weighted", "trimmed_mean",
         "krum", "multi_krum", "bulyan", "centered_clipping", "mean_around_median+omniscient",
         "geometric_median+generalized_byzantine", "bulyan+alie_per_round")


@pytest.fixture(scope="module")
def report():
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_DEVICES}", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                        check=False, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_subprocess_sees_8_devices(report):
  assert report["device_count"] == NUM_DEVICES


@pytest.mark.parametrize("name", RULES)
def test_sharded_rounds_equal_one_device_rounds(report, name):
  """FedAvg with the rule (and, where named, an attack inside the round), two rounds: the model and the
  aggregator state sharded over 8 devices (C = 13 padded to 16) equal those of vmap on one device."""
  result = report["rules"][name]
  assert result["moved"] > 1e-3  # the rounds did something
  assert result["diff"] <= 1e-6 * max(1.0, result["scale"]), result


# ---- the subprocess ------------------------------------------------------------------------------------------


def _worker() -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import fedjax_opt as fo
  from fedjax_opt import attacks, sweep
  from fedjax_opt.core import client_map as cm

  A = fo.aggregators
  rng = np.random.default_rng(0)
  mesh = cm.client_mesh()

  def loss_fn(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]

  def make_batches():
    weight = rng.integers(1, 12, C).astype(np.float32)
    weight[-1] = 0  # a client that takes no part
    return fo.ClientBatches(
        data={"x": jnp.asarray(rng.normal(size=(C, S, B, D)), jnp.float32),
              "y": jnp.asarray(rng.integers(0, K, (C, S, B)), jnp.int32)},
        mask=jnp.asarray(rng.random((C, S, B)) < 0.8), weight=jnp.asarray(weight),
        client_id=jnp.arange(C, dtype=jnp.int32))

  rounds = sweep.stack([make_batches() for _ in range(ROUNDS)])
  params = {"w": jnp.asarray(0.1 * rng.normal(size=(D, K)), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
  rules = {
      "marginal_median": lambda: A.marginal_median(),
      "mean_around_median": lambda: A.mean_around_median(3),
      "geometric_median": lambda: A.geometric_median(),
      "geometric_median_weighted": lambda: A.geometric_median(weighted=True),
      "trimmed_mean": lambda: A.trimmed_mean(0.2),
      "krum": lambda: A.krum(3),
      "multi_krum": lambda: A.multi_krum(3),
      "bulyan": lambda: A.bulyan(2),
      "centered_clipping": lambda: A.centered_clipping(0.05, 2, momentum=0.5),
      "mean_around_median+omniscient": lambda: attacks.corrupt(A.mean_around_median(3), attacks.omniscient(10.0),
                                                               attackers=0.25),
      "geometric_median+generalized_byzantine": lambda: attacks.corrupt(
          A.geometric_median(), attacks.generalized_byzantine(0.3, attacks.gaussian(1.0)), attackers=1.0),
      "bulyan+alie_per_round": lambda: attacks.corrupt(A.bulyan(2), attacks.alie(), attackers=2, per_round=True),
  }
  assert set(rules) == set(RULES)

  def final_state(aggregator, mode):
    algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.3), aggregator=aggregator, client_map=mode)
    run = lambda stacked: jax.lax.scan(lambda st, b: (algo.step(st, b), None), algo.init(params, jax.random.key(0)),
                                       stacked)[0]
    state = jax.jit(run)(rounds)
    return {"params": state.params, "aggregator_state": state.aggregator_state}

  def leaves(tree):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, np.float64)
            for x in jax.tree.leaves(tree)]

  report = {"device_count": jax.device_count(), "rules": {}}
  for name, make in rules.items():
    one = final_state(make(), "vmap")
    many = final_state(make(), cm.sharded(mesh, "vmap"))
    a, b = leaves(one), leaves(many)
    report["rules"][name] = {
        "diff": max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)),
        "scale": max(float(np.max(np.abs(x))) for x in leaves(one["params"])),
        "moved": max(float(np.max(np.abs(x - np.asarray(p, np.float64))))
                     for x, p in zip(leaves(one["params"]), jax.tree.leaves(params))),
    }
  return report


if __name__ == "__main__":
  print(json.dumps(_worker()))
