"""Gossip, D-PSGD, gradient tracking and P2P Bayes with nodes sharded over 8 simulated CPU devices equal one device.

The decentralized algorithms keep one row per node on the client axis, so
`client_map=fo.client_map.sharded(mesh)` splits the nodes' local work over the
devices while the gossip matmul W x runs on the whole table. XLA must be told
to simulate 8 host devices before JAX starts, and the rest of the suite must
keep seeing one device, so the rounds run once in a subprocess (this file run
as a script) that prints its measurements as JSON; the tests below assert on
them (the pattern of tests/test_sharded.py).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # multi-device workers run as subprocesses

NUM_DEVICES = 8
N, S, B, D = 16, 2, 4, 5  # 16 nodes, two per device
ROUNDS = 4
ALGORITHMS = ("gossip", "dpsgd", "dpsgd_time_varying", "gradient_tracking", "gradient_tracking_nan_node", "p2p_bayes")
MODES = ("sharded", "sharded:chunked:1", "sharded:scan")


@pytest.fixture(scope="module")
def report():
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_DEVICES}", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                        check=False, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_subprocess_sees_8_devices(report):
  assert report["device_count"] == NUM_DEVICES
  assert report["mesh_shape"] == {"clients": NUM_DEVICES}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_sharded_rounds_equal_the_one_device_vmap_rounds(report, name):
  """Four rounds with the nodes' local work sharded over the mesh of `jax.make_mesh((8,), ("clients",))` (inner
  mode auto, or chunks of one node; jitted round by round, the state fed back, or one `lax.scan`): every float of
  the state (models, trackers, gradients, beliefs, metrics) equals the `vmap` run on one device, to 1e-6 relative
  to each leaf's largest entry (float32 sums in another order)."""
  result = report["algorithms"][name]
  assert result["moved"] > 1e-2, result  # the rounds did something
  assert set(result["diff"]) == set(MODES)
  for mode, diff in result["diff"].items():
    assert diff <= 1e-6, (mode, result)


def test_the_sharded_state_keeps_the_node_table_and_the_metrics(report):
  """The cut-out NaN node is counted under sharding as on one device, and the table keeps one row per node."""
  assert report["algorithms"]["gradient_tracking_nan_node"]["num_nonfinite"] == 1
  assert report["table_rows"] == N


# ---- the subprocess ------------------------------------------------------------------------------------------


def _worker() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import fedjax_opt as fo
  from fedjax_opt import sweep

  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((NUM_DEVICES,), ("clients",))

  def lsq_loss(params, batch):
    return 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])

  shift = rng.normal(size=(N, 1, 1, D))  # heterogeneous nodes: each its own input shift and target model
  targets = rng.normal(size=(N, D))

  def make_batches(nan_node: int | None = None) -> fo.ClientBatches:
    x = rng.normal(size=(N, S, B, D)) + shift
    y = np.einsum("nsbd,nd->nsb", x, targets) + 0.1 * rng.normal(size=(N, S, B))
    mask = rng.random((N, S, B)) < 0.8
    if nan_node is not None:
      x[nan_node, 0, 0, 0] = np.nan
    return fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)},
                            mask=jnp.asarray(mask), weight=jnp.asarray(mask.sum((1, 2)), jnp.float32),
                            client_id=jnp.arange(N, dtype=jnp.int32))

  rounds = [make_batches() for _ in range(ROUNDS)]
  nan_rounds = [make_batches(nan_node=5) for _ in range(ROUNDS)]
  params = {"w": jnp.asarray(0.1 * rng.normal(size=D), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  graphs = fo.graphs
  ring = graphs.metropolis_hastings(graphs.ring(N))
  exponential = graphs.metropolis_hastings(graphs.exponential(N))
  matchings = graphs.random_matchings(N, 3, seed=1)
  hypotheses = {"w": jnp.asarray(rng.normal(size=(6, D)), jnp.float32), "b": jnp.asarray(rng.normal(size=6),
                                                                                        jnp.float32)}
  factories = {
      "gossip": lambda m: fo.algorithms.gossip(lsq_loss, 0.05, graph=exponential, local_steps=3, client_map=m),
      "dpsgd": lambda m: fo.algorithms.dpsgd(lsq_loss, 0.05, graph=ring, client_map=m),
      "dpsgd_time_varying": lambda m: fo.algorithms.dpsgd(lsq_loss, 0.05, graph=matchings, local_steps=1,
                                                          client_map=m),
      "gradient_tracking": lambda m: fo.algorithms.gradient_tracking(lsq_loss, 0.02, graph=exponential,
                                                                     client_map=m),
      "gradient_tracking_nan_node": lambda m: fo.algorithms.gradient_tracking(lsq_loss, 0.02, graph=ring,
                                                                              client_map=m),
      "p2p_bayes": lambda m: fo.algorithms.p2p_bayes(lsq_loss, hypotheses=hypotheses, graph=ring, client_map=m),
  }

  def floats(state) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(state) if jnp.issubdtype(jnp.result_type(x),
                                                                                          jnp.inexact)]

  def round_by_round(name: str, mode) -> tuple[list[np.ndarray], object]:
    algo = factories[name](mode)
    state = algo.init(params, jax.random.key(0))
    step = jax.jit(algo.step)
    for batches in nan_rounds if name.endswith("nan_node") else rounds:
      state = step(state, batches)  # the state that comes back from a sharded round goes into the next one
    return floats(state), state

  def scanned(name: str, mode) -> list[np.ndarray]:
    algo = factories[name](mode)
    stacked = sweep.stack(nan_rounds if name.endswith("nan_node") else rounds)
    run = jax.jit(lambda s, b: jax.lax.scan(lambda st, r: (algo.step(st, r), None), s, b)[0])
    return floats(run(algo.init(params, jax.random.key(0)), stacked))

  def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest difference of two states' floats, each leaf's relative to max(1, its largest entry in b)."""
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y), initial=0.0) / max(1.0, np.max(np.abs(y), initial=0.0)))
               for x, y in zip(a, b))

  report = {"device_count": jax.device_count(), "mesh_shape": dict(mesh.shape), "algorithms": {}}
  finals = {}
  for name in factories:
    reference, ref_state = round_by_round(name, "vmap")
    if name == "p2p_bayes":
      start = floats(factories[name]("vmap").init(params, jax.random.key(0)).log_beliefs)
      moved = max_diff([np.asarray(ref_state.log_beliefs, np.float64)], start)
    else:
      moved = max_diff(floats(ref_state.local_params), [np.broadcast_to(np.asarray(p, np.float64), (N,) + p.shape)
                                                        for p in jax.tree.leaves(params)])
    finals[name] = ref_state
    sharded, state = round_by_round(name, fo.client_map.sharded(mesh))
    chunked, _ = round_by_round(name, fo.client_map.sharded(mesh, "chunked:1"))
    report["algorithms"][name] = {
        "moved": moved,
        "diff": {"sharded": max_diff(sharded, reference), "sharded:chunked:1": max_diff(chunked, reference),
                 "sharded:scan": max_diff(scanned(name, fo.client_map.sharded(mesh)), reference)},
        "num_nonfinite": int(state.metrics["num_nonfinite"]),
    }
  report["table_rows"] = int(jax.tree.leaves(finals["gossip"].local_params)[0].shape[0])
  return report


if __name__ == "__main__":
  print(json.dumps(_worker()))
