"""Sharded client maps on 8 simulated CPU devices agree with a Python loop over clients, vmap and chunked maps.

XLA must be told to simulate 8 host devices before JAX starts
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), and the rest of the
suite must keep seeing one device. So the checks run once in a subprocess
(this file run as a script), which prints its measurements as JSON; the
tests below assert on them.
"""

import json
import os
import subprocess
import sys

import chex
import numpy as np
import pytest

NUM_DEVICES = 8
C, S, B, D, K = 13, 3, 4, 5, 3  # 13 clients: not a multiple of 8 devices
ROUNDS = 2
CLIENT_LR, SERVER_LR = 0.1, 0.01


@pytest.fixture(scope="module")
def worker():
  """The 8-device subprocess (slow tier), started by the first test that needs its report."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_DEVICES}", JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
  yield proc
  if proc.poll() is None:
    proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def report(worker):
  try:
    out, err = worker.communicate(timeout=900)
  except subprocess.TimeoutExpired:
    worker.kill()
    pytest.fail("the 8-device subprocess did not finish within 900 s")
  assert worker.returncode == 0, err[-4000:]
  return json.loads(out.strip().splitlines()[-1])


# ---- on this process's single device: mode choice, unrolling, the memory rule -------------------------------


def _conv_setup(c=4):
  import jax
  import jax.numpy as jnp
  import optax

  from fedjax_opt.core.local import local_train

  def loss_fn(params, batch):
    h = jax.lax.conv_general_dilated(batch["x"], params["k"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO",
                                                                                                   "NHWC"))
    logits = jnp.mean(jax.nn.relu(h), axis=(1, 2)) @ params["w"]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]

  rng = np.random.default_rng(1)
  params = {"k": jnp.asarray(0.3 * rng.normal(size=(3, 3, 1, 4)), jnp.float32),
            "w": jnp.asarray(0.3 * rng.normal(size=(4, 3)), jnp.float32)}
  per_client = ({"x": jnp.asarray(rng.normal(size=(c, S, B, 6, 6, 1)), jnp.float32),
                 "y": jnp.asarray(rng.integers(0, 3, (c, S, B)), jnp.int32)}, jnp.ones((c, S, B), bool))
  fn = lambda p, client: local_train(loss_fn, optax.sgd(0.1), p, *client).delta
  return fn, params, per_client


@pytest.mark.slow  # compiles for several seconds from a cold cache: the second tier
def test_rewritten_client_functions_give_the_same_values_and_gradients():
  """Unrolled scans and convolutions moved to the canonical layout change nothing but speed."""
  import jax
  import jax.numpy as jnp

  from fedjax_opt.core import client_map as cm
  from fedjax_opt.core.client_map.rewrites import is_canonical_conv
  from fedjax_opt.core.client_map.tracing import equations

  fn, params, per_client = _conv_setup()
  mapped = jax.jit(lambda p, mode: cm.map_clients(mode, fn, p, per_client), static_argnums=1)
  ref = mapped(params, "vmap")
  for mode in ("chunked:3:unroll", "sequential:canonical_convs"):
    chex.assert_trees_all_close(mapped(params, mode), ref, rtol=1e-5, atol=1e-6)
  grad = jax.jit(jax.grad(lambda p, mode: sum(jnp.sum(d ** 2) for d in jax.tree.leaves(mapped(p, mode)))),
                 static_argnums=1)
  chex.assert_trees_all_close(grad(params, "vmap:unroll:canonical_convs"), grad(params, "vmap"), rtol=1e-4, atol=1e-6)
  one_client = jax.tree.map(lambda a: a[0], per_client)
  jaxpr = jax.make_jaxpr(cm.rewrite_client_fn(fn, unroll=True, canonical_convs=True))(params, one_client)
  scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  assert scans and all(e.params["unroll"] == 0 for e in scans)  # 0: no while loop left, even for one step
  convs = [e for e in equations(jaxpr) if e.primitive.name == "conv_general_dilated"]
  assert len(convs) == 2 and all(is_canonical_conv(e.params) for e in convs)  # forward, weight gradient


@pytest.mark.parametrize("dimension_numbers,lhs_shape,rhs_shape", [
    (("NHWC", "HWIO", "NHWC"), (2, 7, 6, 3), (3, 2, 3, 4)),
    (("NCHW", "OIHW", "NCHW"), (2, 3, 7, 6), (4, 3, 3, 2)),
    (("NHWC", "OIHW", "NCHW"), (2, 7, 6, 3), (4, 3, 3, 2)),
])
def test_canonical_conv_is_bit_identical(dimension_numbers, lhs_shape, rhs_shape):
  import jax

  from fedjax_opt.core import client_map as cm

  rng = np.random.default_rng(0)
  lhs, rhs = rng.normal(size=lhs_shape).astype(np.float32), rng.normal(size=rhs_shape).astype(np.float32)
  conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 1), ((1, 0), (2, 1)), (1, 1), (1, 2), dimension_numbers)
  eqn = jax.make_jaxpr(conv)(lhs, rhs).eqns[0]
  np.testing.assert_array_equal(cm.canonical_conv(lhs, rhs, **eqn.params), conv(lhs, rhs))


def test_auto_choice_on_cpu():
  """Convolutions: a loop over clients in the canonical layout; a big dense model: a loop; a small one: vmap."""
  import jax.numpy as jnp

  from fedjax_opt.core import client_map as cm

  fn, params, per_client = _conv_setup()
  assert cm.auto().resolve(fn, params, per_client) == cm.sequential(canonical_convs=True)
  dense = lambda p, x: jnp.tanh(x @ p)
  x = jnp.ones((6, 4, 300))
  assert cm.auto().resolve(dense, jnp.ones((300, 300)), x) == cm.sequential()
  assert cm.auto().resolve(dense, jnp.ones((300, 10)), x) == cm.vmap()
  footprint = cm.client_footprint(dense, jnp.ones((300, 10)), x)
  assert cm.auto(memory_budget=2 * footprint).resolve(dense, jnp.ones((300, 10)), x) == cm.chunked(2)
  assert cm.auto().resolve() == cm.sequential()  # no function to look at: the backend's default


def test_memory_rule_picks_balanced_chunks():
  from fedjax_opt.core import client_map as cm

  fn, params, per_client = _conv_setup(c=10)
  one = cm.client_footprint(fn, params, per_client)
  data_bytes = S * B * 6 * 6 * 4
  assert one > data_bytes  # at least its own data, plus model copies and activations
  assert cm.default_chunk_size(fn, params, per_client, memory_budget=100 * one) == 10
  assert cm.default_chunk_size(fn, params, per_client, memory_budget=4 * one) == 4  # chunks 4, 4, 2 -> ceil(10/3)
  assert cm.default_chunk_size(fn, params, per_client, memory_budget=3 * one) == 3  # 4 chunks: 3, 3, 3, 1 -> 3
  assert cm.default_chunk_size(fn, params, per_client, memory_budget=1) == 1
  assert cm.default_memory_budget() > 0


@pytest.mark.parametrize("name,expected", [
    ("vmap:unroll", "VMap(unroll=True, canonical_convs=False)"),
    ("chunked", "Chunked(chunk_size=None, unroll=False, canonical_convs=False, memory_budget=None)"),
    ("chunked:4:unroll", "Chunked(chunk_size=4, unroll=True, canonical_convs=False, memory_budget=None)"),
    ("sequential:canonical_convs", "Chunked(chunk_size=1, unroll=False, canonical_convs=True, memory_budget=None)"),
    ("sharded:chunked:8", "Sharded(mesh=None, inner=Chunked(chunk_size=8, unroll=False, canonical_convs=False, "
                          "memory_budget=None), axis_name='clients')"),
])
def test_mode_names(name, expected):
  from fedjax_opt.core import client_map as cm

  assert repr(cm.resolve(name)) == expected


def test_bad_modes_name_the_argument():
  import jax
  from jax.sharding import Mesh

  from fedjax_opt.core import client_map as cm

  for bad in ("pmap", "chunked:4:roll", "sharded:pmap", "vmap:2", "chunked:0", "vmap:unroll:unroll",
              "sharded:sharded"):
    with pytest.raises(ValueError, match="client_map must be one of"):
      cm.resolve(bad)
  with pytest.raises(ValueError, match="no axis named 'clients'"):
    cm.sharded(Mesh(np.asarray(jax.devices()), ("data",)))
  with pytest.raises(ValueError, match="single-device mode"):
    cm.sharded(inner=cm.sharded())
  with pytest.raises(ValueError, match="memory_budget must be a Python int >= 1"):
    cm.auto(memory_budget=0)
  with pytest.raises(TypeError, match="unroll must be a bool"):
    cm.vmap(unroll=1)
  with pytest.raises(ValueError, match="chunk_size must be a Python int >= 1"):
    cm.chunked(0)


def test_sharded_on_one_device_is_the_inner_mode():
  import jax
  import jax.numpy as jnp

  from fedjax_opt.core import client_map as cm

  fn = lambda w, c: jnp.tanh(c @ w).sum(0)
  w, clients = jnp.ones((D, 2)), jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, D)), jnp.float32)
  out = jax.jit(lambda w, c: cm.map_clients("sharded:vmap", fn, w, c))(w, clients)
  np.testing.assert_allclose(out, np.stack([fn(w, c) for c in clients]), rtol=1e-6)


# ---- the 8-device subprocess's results -----------------------------------------------------------------


@pytest.mark.slow  # the 8-device subprocess
def test_subprocess_sees_8_devices_and_this_process_one(report):
  import jax

  assert report["device_count"] == NUM_DEVICES
  assert jax.device_count() == 1


@pytest.mark.parametrize("server", ["fedavg", "fedadam"])
@pytest.mark.slow  # the 8-device subprocess
def test_every_mode_matches_a_python_loop_over_clients(report, server):
  """Reference loop, vmap, sequential, chunked and sharded (8 devices, C = 13; the library's mesh and one from
  `jax.make_mesh`) give the same new server state."""
  diffs = report["modes"][server]
  assert set(diffs) == {"vmap", "chunked:4", "sharded:vmap", "sharded:chunked:2", "sharded:auto", "sharded:make_mesh"}
  for mode, diff in diffs.items():
    assert diff < 2e-6, (mode, diff)


@pytest.mark.slow  # the 8-device subprocess
def test_sharded_map_returns_one_row_per_client(report):
  """Padding clients (13 -> 16) are sliced off: the caller sees [C] rows equal to a loop's."""
  assert report["map_shape"] == [C, D]
  assert report["map_diff"] < 1e-6


@pytest.mark.slow  # the 8-device subprocess
def test_global_batches_pad_with_zero_weight_clients(report):
  """distributed.global_batches on one process: 13 clients padded to 16 zero-weight ones, same FedAdam state."""
  assert report["global_batches"]["num_clients"] == 16
  assert report["global_batches"]["padding_weights"] == [0.0, 0.0, 0.0]
  assert report["global_batches"]["diff"] < 2e-6


@pytest.mark.slow  # the 8-device subprocess
def test_per_client_state_split_across_devices(report):
  """SCAFFOLD's per-client table split on the clients axis gives the same round as a replicated one."""
  assert report["scaffold"]["table_sharding"] == "P('clients',)"
  assert report["scaffold"]["diff"] < 1e-6


STATEFUL = ("fedprox", "scaffold", "fednova", "feddyn", "ditto", "pfedme", "per_fedavg_hf", "admm_consensus")


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.slow  # the 8-device subprocess
def test_stateful_algorithms_agree_across_modes(report, name):
  """Every algorithm with server or per-client state: vmap, chunked and sharded (8 devices, C = 13 of N = 16
  clients) give the state of a compiled loop over clients (`sequential`) after two rounds, tables included."""
  diffs = report["stateful"][name]
  assert set(diffs) == {"vmap", "chunked:4", "sharded:vmap", "sharded:chunked:2"}
  for mode, diff in diffs.items():
    assert diff < 5e-6, (mode, diff)


@pytest.mark.slow  # the 8-device subprocess
def test_auto_shards_larger_dense_models_over_several_devices(report):
  """With 8 devices, `auto` shards a dense model above CPU_VMAP_MAX_PARAMS (its inner auto then picks one device's
  mode) and keeps a small model on one device; the sharded default gives the sequential loop's FedAvg state."""
  big = report["auto"]["big"]
  assert big.startswith("Sharded(") and "inner=Auto(memory_budget=None, shard=False" in big, big
  assert report["auto"]["small"].startswith("VMap(")
  assert report["auto"]["diff"] < 2e-6


@pytest.mark.slow  # the 8-device subprocess
def test_auto_inside_a_user_s_shard_map_does_not_shard_again(report):
  """Inside a shard_map the clients are already split: `auto` maps its block on the device (it used to shard
  again and fail on the context mesh) and the psum of the blocks equals the one-device sum."""
  assert not report["auto_inside_shard_map"]["chosen"].startswith("Sharded("), report["auto_inside_shard_map"]
  assert report["auto_inside_shard_map"]["diff"] < 2e-5


@pytest.mark.slow  # the 8-device subprocess
def test_fo_train_runs_every_chunk_of_a_sharded_algorithm(report):
  """The state a sharded round returns lives on the mesh: the driver moves it back to the placement its chunk and
  its evaluation were compiled for, and goes on; each program is compiled once (three chunks of 2 rounds)."""
  assert report["train_chunks"]["rounds"] == 6
  assert report["train_chunks"]["diff"] < 2e-6
  assert report["train_chunks"]["chunk_compiles"] == 1 and report["train_chunks"]["evaluate_compiles"] == 1


@pytest.mark.slow  # the 8-device subprocess
def test_a_sharded_run_resumes_from_its_checkpoint(report):
  """The restored state is placed as a fresh one (uncommitted), so the sharded chunks and the evaluation after
  a resume run, and the resumed run ends where the uninterrupted one does."""
  assert report["resume_sharded"]["rounds"] == 6
  assert report["resume_sharded"]["diff"] < 1e-6


@pytest.mark.slow  # the 8-device subprocess
def test_sweep_of_a_sharded_algorithm(report):
  """jax.vmap over seeds composes with shard_map: a sweep of sharded FedAvg equals a sweep of vmapped FedAvg."""
  assert report["sweep_diff"] < 2e-6


# ---- the subprocess ------------------------------------------------------------------------------------------


def _worker() -> dict:
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import PartitionSpec

  import fedjax_opt as fo
  from fedjax_opt import distributed, sweep
  from fedjax_opt.core import client_map as cm
  from fedjax_opt.core.local import local_train

  rng = np.random.default_rng(0)
  mesh = cm.client_mesh()

  def loss_fn(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["y"][:, None], -1)[:, 0]

  def make_batches(c):
    return fo.ClientBatches(
        data={"x": jnp.asarray(rng.normal(size=(c, S, B, D)), jnp.float32),
              "y": jnp.asarray(rng.integers(0, K, (c, S, B)), jnp.int32)},
        mask=jnp.asarray(rng.random((c, S, B)) < 0.8), weight=jnp.asarray(rng.integers(1, 12, c), jnp.float32),
        client_id=jnp.arange(c, dtype=jnp.int32))

  rounds = [make_batches(C) for _ in range(ROUNDS)]
  params = {"w": jnp.asarray(0.1 * rng.normal(size=(D, K)), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
  servers = {"fedavg": optax.sgd(1.0), "fedadam": fo.server_optimizers.fedadam(SERVER_LR)}

  def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  # The reference: a Python loop over clients, then the weighted mean and server step in float64 NumPy.
  client = jax.jit(lambda p, data, mask: local_train(loss_fn, optax.sgd(CLIENT_LR), p, data, mask).delta)

  def reference(server):
    x = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v = {k: np.full_like(val, 1e-3 ** 2) for k, val in x.items()}
    for batches in rounds:
      model = {k: jnp.asarray(val, jnp.float32) for k, val in x.items()}
      deltas = [client(model, jax.tree.map(lambda a, c=c: a[c], batches.data), batches.mask[c]) for c in range(C)]
      w = np.asarray(batches.weight, np.float64)
      delta = {k: sum(w[c] * np.asarray(deltas[c][k], np.float64) for c in range(C)) / w.sum() for k in x}
      for k in x:
        if server == "fedavg":
          x[k] = x[k] + delta[k]
        else:  # Reddi et al. Algorithm 2 (FedAdam): m, v on Δ; x + η m / (√v + τ)
          m[k] = 0.9 * m[k] + 0.1 * delta[k]
          v[k] = 0.99 * v[k] + 0.01 * delta[k] ** 2
          x[k] = x[k] + SERVER_LR * m[k] / (np.sqrt(v[k]) + 1e-3)
    return x

  def final_params(mode):
    """FedAvg's and FedAdam's models after the rounds, both in one compiled program (one compile per mode)."""

    def both(stacked_rounds):
      out = {}
      for server, optimizer in servers.items():
        algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(CLIENT_LR), server_optimizer=optimizer,
                                    client_map=mode)
        state, _ = jax.lax.scan(lambda st, b: (algo.step(st, b), None), algo.init(params, jax.random.key(0)),
                                stacked_rounds)
        out[server] = state.params
      return out

    return jax.jit(both)(sweep.stack(rounds))

  report = {"device_count": jax.device_count(), "modes": {}}
  modes = {"vmap": "vmap", "chunked:4": "chunked:4", "sharded:vmap": cm.sharded(mesh, "vmap"),
           "sharded:chunked:2": cm.sharded(mesh, "chunked:2"), "sharded:auto": "sharded",
           # A mesh built the usual way (Explicit axes by default in JAX 0.7+), not the library's client_mesh().
           "sharded:make_mesh": cm.sharded(jax.make_mesh((NUM_DEVICES,), ("clients",)), "vmap")}
  results = {name: final_params(mode) for name, mode in modes.items()}
  for server in servers:
    ref = reference(server)
    report["modes"][server] = {name: max_diff(out[server], ref) for name, out in results.items()}

  fn = lambda shared, c: jnp.tanh(c["a"].sum(0) @ shared)
  per_client = {"a": jnp.asarray(rng.normal(size=(C, 4, D)), jnp.float32)}
  shared = jnp.asarray(rng.normal(size=(D, D)), jnp.float32)
  out = jax.jit(lambda s, pc: cm.map_clients(cm.sharded(mesh), fn, s, pc))(shared, per_client)
  loop = np.stack([np.asarray(fn(shared, {"a": per_client["a"][c]})) for c in range(C)])
  report["map_shape"], report["map_diff"] = list(out.shape), max_diff(out, loop)

  padded = [distributed.global_batches(b, mesh) for b in rounds]
  fedadam = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(CLIENT_LR), server_optimizer=servers["fedadam"],
                                 client_map=cm.sharded(mesh, "vmap"))
  state = distributed.replicate(fedadam.init(params, jax.random.key(0)), mesh)
  for batches in padded:
    state = jax.jit(fedadam.step)(state, batches)
  report["global_batches"] = {"num_clients": int(padded[0].num_clients),
                              "padding_weights": np.asarray(padded[0].weight)[C:].tolist(),
                              "diff": max_diff(distributed.to_host(state.params), reference("fedadam"))}

  scaffold = fo.algorithms.scaffold(loss_fn, CLIENT_LR, 1.0, num_clients=16, client_map=cm.sharded(mesh, "vmap"))
  replicated = distributed.replicate(scaffold.init(params, jax.random.key(0)), mesh)
  split = distributed.shard_per_client_state(scaffold.init(params, jax.random.key(0)), 16, mesh)
  step = jax.jit(scaffold.step)
  for batches in padded:
    replicated, split = step(replicated, batches), step(split, batches)
  report["scaffold"] = {"table_sharding": str(split.client_control_variates["w"].sharding.spec),
                        "diff": max_diff(split.client_control_variates, replicated.client_control_variates)
                        + max_diff(split.params, replicated.params)}

  def sweep_params(mode):
    algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(CLIENT_LR), client_map=mode)
    swept = sweep.seeds(algo, 3)
    state = swept.init(sweep.stack([jax.tree.map(lambda p, i=i: p + 0.1 * i, params) for i in range(3)]),
                       jax.random.key(0), params_axis=0)
    return jax.jit(swept.step)(state, rounds[0]).params

  report["sweep_diff"] = max_diff(sweep_params(cm.sharded(mesh, "vmap")), sweep_params("vmap"))

  # auto with 8 devices: a dense model above CPU_VMAP_MAX_PARAMS is sharded, a small one is not.
  d_big, k_big = 130, 130  # 17,030 parameters
  big_params = {"w": jnp.asarray(0.05 * rng.normal(size=(d_big, k_big)), jnp.float32),
                "b": jnp.zeros(k_big, jnp.float32)}
  big_rounds = [fo.ClientBatches(
      data={"x": jnp.asarray(rng.normal(size=(C, S, B, d_big)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, k_big, (C, S, B)), jnp.int32)},
      mask=jnp.asarray(rng.random((C, S, B)) < 0.8), weight=jnp.asarray(rng.integers(1, 12, C), jnp.float32),
      client_id=jnp.arange(C, dtype=jnp.int32)) for _ in range(ROUNDS)]
  update = lambda p, client: local_train(loss_fn, optax.sgd(CLIENT_LR), p, *client).delta
  per_big = (big_rounds[0].data, big_rounds[0].mask)
  per_small = (rounds[0].data, rounds[0].mask)

  def big_final(mode):
    algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(CLIENT_LR), client_map=mode)
    run = lambda stacked: jax.lax.scan(lambda st, b: (algo.step(st, b), None), algo.init(big_params,
                                                                                        jax.random.key(0)),
                                       stacked)[0].params
    return jax.jit(run)(sweep.stack(big_rounds))

  report["auto"] = {"big": repr(cm.auto().resolve(update, big_params, per_big)),
                    "small": repr(cm.auto().resolve(update, params, per_small)),
                    "diff": max_diff(big_final(None), big_final("sequential"))}

  # `auto` inside a user's own shard_map (each device maps its block of clients, then one psum): the clients are
  # already split, so `auto` picks a one-device mode instead of sharding again. (check_vma=False, as in `sharded`:
  # the local scan starts from the replicated model.)
  user_mesh = jax.make_mesh((NUM_DEVICES,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
  padded_big, _ = cm.pad_clients(per_big, NUM_DEVICES)

  def per_device(p, block):
    chosen.append(repr(cm.auto().resolve(update, p, block)))
    deltas = cm.map_clients("auto", update, p, block)
    return jax.tree.map(lambda d: jax.lax.psum(jnp.sum(d, axis=0), "clients"), deltas)

  chosen = []
  summed = jax.jit(jax.shard_map(per_device, mesh=user_mesh, in_specs=(PartitionSpec(), PartitionSpec("clients")),
                                 out_specs=PartitionSpec(), check_vma=False))(big_params, padded_big)
  looped = jax.tree.map(lambda d: jnp.sum(d, axis=0), cm.map_clients("sequential", update, big_params, per_big))
  report["auto_inside_shard_map"] = {"chosen": chosen[0], "diff": max_diff(summed, looped)}

  # Stateful algorithms: two rounds of each under every mode, one compiled program per mode.
  n = 16
  sgd = optax.sgd(CLIENT_LR)
  factories = {
      "fedprox": lambda m: fo.algorithms.fedprox(loss_fn, 0.1, client_optimizer=sgd, client_map=m),
      "scaffold": lambda m: fo.algorithms.scaffold(loss_fn, CLIENT_LR, 1.0, num_clients=n, client_map=m),
      "fednova": lambda m: fo.algorithms.fednova(loss_fn, CLIENT_LR, 0.5, client_map=m),
      "feddyn": lambda m: fo.algorithms.feddyn(loss_fn, 0.05, num_clients=n, client_optimizer=sgd, client_map=m),
      "ditto": lambda m: fo.algorithms.ditto(loss_fn, 0.3, CLIENT_LR, num_clients=n, personal_steps=2,
                                             client_optimizer=sgd, client_map=m),
      "pfedme": lambda m: fo.algorithms.pfedme(loss_fn, 5.0, CLIENT_LR, 1.0, num_clients=n, local_steps=S,
                                               inner_steps=2, inner_lr=0.05, client_map=m),
      "per_fedavg_hf": lambda m: fo.algorithms.per_fedavg(loss_fn, 0.05, 0.05, local_steps=1, variant="hf",
                                                          client_map=m),
      "admm_consensus": lambda m: fo.algorithms.admm_consensus(loss_fn, 1.0, num_clients=n, client_optimizer=sgd,
                                                               local_steps=S, client_map=m),
  }

  def floats(state):
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    return leaves

  def stateful(mode):
    def run(stacked_rounds):
      out = {}
      for name, make in factories.items():
        algo = make(mode)
        state, _ = jax.lax.scan(lambda st, b: (algo.step(st, b), None), algo.init(params, jax.random.key(0)),
                                stacked_rounds)
        out[name] = floats(state)
      return out

    return jax.jit(run)(sweep.stack(rounds))

  reference_states = stateful("sequential")
  report["stateful"] = {name: {} for name in factories}
  for mode_name, mode in (("vmap", "vmap"), ("chunked:4", "chunked:4"), ("sharded:vmap", cm.sharded(mesh, "vmap")),
                          ("sharded:chunked:2", cm.sharded(mesh, "chunked:2"))):
    out = stateful(mode)
    for name in factories:
      report["stateful"][name][mode_name] = max_diff(out[name], reference_states[name])

  # fo.train over several compiled chunks with a sharded client map: the state that comes back from the first
  # chunk lives on the mesh, and the driver must still evaluate it (its evaluator was first compiled for the
  # initial, single-device model) and run the next chunks, and agree with vmap.
  dataset = fo.data.pack([{"x": rng.normal(size=(20, D)).astype(np.float32), "y": rng.integers(0, K, 20)}
                          for _ in range(C)], test_fraction=0.2, num_classes=K)

  def trained(mode):
    algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(CLIENT_LR), client_map=mode)
    state, history = fo.train(algo, algo.init(params, jax.random.key(0)), dataset, 6,
                              fo.Sampling(clients_per_round=C, batch_size=B, local_steps=S), progress=False,
                              evaluation=fo.Evaluation(every=2, metric_fns={"loss": loss_fn}))
    return state.params, history

  import logging

  class Compiles(logging.Handler):
    """Counts the XLA compilations JAX logs (jax_log_compiles), by program name."""

    def __init__(self):
      super().__init__(logging.DEBUG)
      self.names = []

    def emit(self, record):
      text = record.getMessage()
      if text.startswith("Finished XLA compilation of "):
        self.names.append(text.split("Finished XLA compilation of ")[1].split(" in ")[0])

  compiles = Compiles()
  jax_logger = logging.getLogger("jax")
  jax_logger.addHandler(compiles)
  jax_logger.setLevel(logging.DEBUG)
  with jax.log_compiles(True):
    sharded_params, sharded_history = trained(cm.sharded(mesh, "vmap"))
  jax_logger.removeHandler(compiles)
  vmap_params, _ = trained("vmap")
  report["train_chunks"] = {"rounds": len(sharded_history.round_metrics["client_loss"]),
                            "diff": max_diff(sharded_params, vmap_params),
                            "chunk_compiles": compiles.names.count("jit(_run_chunk)"),
                            "evaluate_compiles": compiles.names.count("jit(evaluate)")}

  # Resume a sharded run from its checkpoint: the restored state comes back on one device, and the next chunk
  # (sharded) and the evaluation must still run and give the uninterrupted run's model.
  import tempfile
  algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(CLIENT_LR), client_map=cm.sharded(mesh, "vmap"))
  kw = dict(evaluation=fo.Evaluation(every=2, metric_fns={"loss": loss_fn}), progress=False)
  sampling = fo.Sampling(clients_per_round=C, batch_size=B, local_steps=S)
  with tempfile.TemporaryDirectory() as folder:
    fo.train(algo, algo.init(params, jax.random.key(0)), dataset, 4, sampling,
             checkpointing=fo.Checkpointing(folder), **kw)
    resumed, resumed_history = fo.train(algo, algo.init(params, jax.random.key(0)), dataset, 6, sampling,
                                        checkpointing=fo.Checkpointing(folder, resume=True), **kw)
  report["resume_sharded"] = {"rounds": len(resumed_history.round_metrics["client_loss"]),
                              "diff": max_diff(resumed.params, sharded_params)}
  return report


if __name__ == "__main__":
  print(json.dumps(_worker()))
