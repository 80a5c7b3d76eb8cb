"""Two processes on localhost train FedAvg together and match one process training alone.

Each process is this file run as a script: it joins the other through
`fedjax_opt.distributed.initialize` (coordinator on 127.0.0.1, a free port,
CPU collectives), simulates 2 CPU devices, feeds its own half of the round's
clients with `distributed.global_batches`, and runs `jax.jit(algo.step)` with
a sharded client map over the 4 global devices. The test compares the final
models with FedAvg / FedAdam run on one device in this process. Every wait is
bounded (connection timeout, subprocess timeout), so a broken setup fails
instead of hanging CI.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # multi-device workers run as subprocesses

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
C_PER_PROCESS, S, B, D, K = 5, 3, 4, 6, 3  # 5 clients per process: padded to 6 (2 devices) with a zero-weight client
ROUNDS = 3
CLIENT_LR, SERVER_LR = 0.1, 0.01
TIMEOUT_S = 150


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _problem():
  """The same clients on every process (NumPy, seeded): rounds of `[C_total, ...]` arrays and the initial model."""
  rng = np.random.default_rng(0)
  c = C_PER_PROCESS * NUM_PROCESSES
  rounds = [dict(x=rng.normal(size=(c, S, B, D)).astype(np.float32), y=rng.integers(0, K, (c, S, B)).astype(np.int32),
                 mask=rng.random((c, S, B)) < 0.8, weight=rng.integers(1, 12, c).astype(np.float32))
            for _ in range(ROUNDS)]
  params = {"w": (0.1 * rng.normal(size=(D, K))).astype(np.float32), "b": np.zeros(K, np.float32)}
  return rounds, params


def _loss_fn(params, batch):
  import jax
  import jax.numpy as jnp

  logits = batch["x"] @ params["w"] + params["b"]
  return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]


def _algorithms(client_map):
  import optax

  import fedjax_opt as fo

  return {"fedavg": fo.algorithms.fedavg(_loss_fn, client_optimizer=optax.sgd(CLIENT_LR), client_map=client_map),
          "fedadam": fo.algorithms.fedavg(_loss_fn, client_optimizer=optax.sgd(CLIENT_LR),
                                          server_optimizer=fo.server_optimizers.fedadam(SERVER_LR),
                                          client_map=client_map)}


def _batches(r, rows):
  import fedjax_opt as fo

  return fo.ClientBatches(data={"x": r["x"][rows], "y": r["y"][rows]}, mask=r["mask"][rows], weight=r["weight"][rows],
                          client_id=np.arange(len(r["weight"]), dtype=np.int32)[rows])


def test_two_processes_match_one(tmp_path):
  import jax

  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(i), str(port), str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(NUM_PROCESSES)]
  logs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=TIMEOUT_S)
      logs.append(out)
  except subprocess.TimeoutExpired:
    pytest.fail(f"the {NUM_PROCESSES} processes did not finish within {TIMEOUT_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"

  results = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(NUM_PROCESSES)]
  assert all(r["device_count"] == NUM_PROCESSES * DEVICES_PER_PROCESS for r in results)
  assert all(r["num_clients"] == NUM_PROCESSES * (C_PER_PROCESS + 1) for r in results)  # one padding client each

  rounds, params = _problem()
  for name, algo in _algorithms("vmap").items():
    state = algo.init(params, jax.random.key(0))
    for r in rounds:
      state = jax.jit(algo.step)(state, _batches(r, slice(None)))
    for result in results:
      for k in params:
        np.testing.assert_allclose(result[name][k], np.asarray(state.params[k]), rtol=2e-5, atol=1e-6)
    assert results[0][name]["num_clients"] == C_PER_PROCESS * NUM_PROCESSES  # padding never counted


def _worker(process_id: int, port: int, out_dir: str) -> None:
  from fedjax_opt import distributed

  distributed.initialize(f"127.0.0.1:{port}", NUM_PROCESSES, process_id, initialization_timeout=60,
                         heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  import jax

  from fedjax_opt.core import client_map as cm

  mesh = distributed.client_mesh()
  rounds, params = _problem()
  mine = slice(process_id * C_PER_PROCESS, (process_id + 1) * C_PER_PROCESS)
  result = {"device_count": jax.device_count()}
  for name, algo in _algorithms(cm.sharded(mesh, "vmap")).items():
    state = distributed.replicate(algo.init(params, jax.random.key(0)), mesh)
    step = jax.jit(algo.step)
    for r in rounds:
      batches = distributed.global_batches(_batches(r, mine), mesh)
      result["num_clients"] = int(batches.num_clients)
      state = step(state, batches)
    host = distributed.to_host(state)
    result[name] = {k: v.tolist() for k, v in host.params.items()}
    result[name]["num_clients"] = int(host.metrics["num_clients"])
  with open(os.path.join(out_dir, f"process_{process_id}.json"), "w") as f:
    json.dump(result, f)
  distributed.shutdown()


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
