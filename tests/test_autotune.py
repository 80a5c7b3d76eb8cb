"""`auto` by measurement: candidates timed (here by a fake timer), the fastest kept, the decision cached per machine.

The claims of fedjax_opt/core/client_map/autotune.py: the choice is the candidate the timer finds fastest, within
the memory budget; it is stored on disk and in memory and reused, keyed by the per-client function and the shapes
(another C or another model is measured again); measuring can be turned off by argument and by environment, and
then `auto` is the measured rule; the chosen mode computes what that mode computes when named.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.core import client_map as cm
from fedjax_opt.core.client_map import autotune, heuristics
from fedjax_opt.core.local import local_train


from conftest import fedavg_lsq_np, lsq_loss as _loss


def _client(params, client):
  data, mask = client
  return local_train(_loss, optax.sgd(0.1), params, data, mask).delta


def _inputs(c, d=3, s=2, b=4, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=d), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  data = {"x": jnp.asarray(rng.normal(size=(c, s, b, d)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(c, s, b)), jnp.float32)}
  return params, (data, jnp.ones((c, s, b), bool))


class FakeTimer:
  """Seconds by candidate name from a table (default 1.0); records every call and never runs anything."""

  def __init__(self, table=None):
    self.table = table or {}
    self.calls = []

  def __call__(self, name, run):
    self.calls.append(name)
    return self.table.get(name, 1.0)


@pytest.fixture(autouse=True)
def _fresh_memory():
  autotune.clear_memory()
  yield
  autotune.clear_memory()


def test_the_fastest_candidate_by_the_timer_is_chosen_and_stored_with_every_time(tmp_path):
  params, clients = _inputs(16)
  timer = FakeTimer({"chunked:8": 0.25, "vmap": 0.5, "sequential": 2.0})
  choice = autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path, timer=timer)
  assert autotune.choice_name(choice) == "chunked:8"
  files = list(tmp_path.glob("*.json"))
  assert len(files) == 1 and not list(tmp_path.glob("*.tmp"))
  stored = json.loads(files[0].read_text())
  assert stored["choice"] == "chunked:8" and stored["clients"] == 16
  assert stored["times"]["chunked:8"] == 0.25 and stored["times"]["sequential"] == 2.0
  # every candidate was warmed up once and then timed REPEATS times
  assert timer.calls.count("vmap") == 1 + autotune.REPEATS


def test_a_decision_is_reused_from_memory_and_from_disk_without_timing_again(tmp_path):
  params, clients = _inputs(16)
  first = FakeTimer({"sequential": 0.1})
  assert autotune.choice_name(autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path,
                                              timer=first)) == "sequential"
  again = FakeTimer({"vmap": 0.0})  # would choose vmap if it were asked
  assert autotune.choice_name(autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path,
                                              timer=again)) == "sequential"
  autotune.clear_memory()  # a new process: the file decides
  assert autotune.choice_name(autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path,
                                              timer=again)) == "sequential"
  assert again.calls == []


def test_another_client_count_another_model_or_another_budget_is_measured_again(tmp_path):
  params, clients = _inputs(16)
  autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path, timer=FakeTimer())
  for args in [(params, _inputs(12)[1], 1 << 30),                                  # another C
               (_inputs(16, d=5)[0], _inputs(16, d=5)[1], 1 << 30),                # another model's shapes
               (params, clients, 1 << 29)]:                                        # another memory budget
    timer = FakeTimer()
    autotune.decide(_client, *args, folder=tmp_path, timer=timer)
    assert timer.calls, args
  timer = FakeTimer()  # another function of the same shapes
  autotune.decide(lambda p, c: jax.tree.map(lambda d: 2 * d, _client(p, c)), params, clients, 1 << 30,
                  folder=tmp_path, timer=timer)
  assert timer.calls
  assert len(list(tmp_path.glob("*.json"))) == 5


def test_candidates_beyond_the_memory_budget_are_not_tried():
  params, clients = _inputs(64)
  footprint = cm.client_footprint(_client, params, clients)
  timer = FakeTimer({"vmap": 0.01, "chunked:32": 0.02, "chunked:8": 0.5, "sequential": 1.0})
  choice = autotune.decide(_client, params, clients, 10 * footprint, folder="off", timer=timer)
  assert autotune.choice_name(choice) == "chunked:8"
  assert "vmap" not in timer.calls and "chunked:32" not in timer.calls
  names = [autotune.choice_name(c) for c in autotune.candidates(_client, params, clients, 10 * footprint)]
  assert "sequential" in names and "vmap" not in names
  for choice in autotune.candidates(_client, params, clients, 10 * footprint):
    assert choice.chunk_size is not None and choice.chunk_size * footprint <= 10 * footprint


def test_a_candidate_that_fails_to_run_is_dropped(tmp_path):
  params, clients = _inputs(16)

  def timer(name, run):
    if name == "vmap":
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    return {"chunked:8": 3.0}.get(name, 5.0)

  assert autotune.choice_name(autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path,
                                              timer=timer)) == "chunked:8"
  stored = json.loads(next(tmp_path.glob("*.json")).read_text())
  assert "vmap" not in stored["times"]


def test_a_clearly_slower_candidate_is_timed_once():
  params, clients = _inputs(16)
  timer = FakeTimer({"vmap": 0.01, "chunked:8": 10.0})
  autotune.decide(_client, params, clients, 1 << 30, folder="off", timer=timer)
  assert timer.calls.count("chunked:8") == 1 and timer.calls.count("vmap") == 1 + autotune.REPEATS


def test_the_budget_stops_new_candidates_but_the_first_always_runs():
  params, clients = _inputs(16)
  timer = FakeTimer()
  times = autotune.measure(_client, params, clients, autotune.candidates(_client, params, clients, 1 << 30),
                           budget_seconds=0.0, timer=timer)
  assert len(times) == 1


def test_a_damaged_cache_file_is_measured_again(tmp_path):
  params, clients = _inputs(16)
  autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path, timer=FakeTimer({"vmap": 0.1}))
  path = next(tmp_path.glob("*.json"))
  path.write_text('{"choice": "vm')  # half a file, as a crash mid-write would leave without the rename
  autotune.clear_memory()
  timer = FakeTimer({"sequential": 0.1})
  assert autotune.choice_name(autotune.decide(_client, params, clients, 1 << 30, folder=tmp_path,
                                              timer=timer)) == "sequential"
  assert timer.calls and json.loads(path.read_text())["choice"] == "sequential"


def test_turned_off_by_argument_or_environment_auto_is_the_measured_rule(tmp_path, monkeypatch):
  params, clients = _inputs(16)
  rule = heuristics.choose(_client, params, clients, None, shard=False)
  timer = FakeTimer({"sequential": 0.0})
  off = cm.Auto(shard=False, measure=False, cache_dir=str(tmp_path), timer=timer)
  mode = off.resolve(_client, params, clients)
  assert (mode.chunk_size if isinstance(mode, cm.Chunked) else None) == rule.chunk_size
  monkeypatch.setenv("FEDJAX_OPT_AUTOTUNE", "off")
  default = cm.Auto(shard=False, cache_dir=str(tmp_path), timer=timer).resolve(_client, params, clients)
  assert (default.chunk_size if isinstance(default, cm.Chunked) else None) == rule.chunk_size
  assert timer.calls == [] and not list(tmp_path.iterdir())
  monkeypatch.setenv("FEDJAX_OPT_AUTOTUNE", "on")
  measured = cm.Auto(shard=False, cache_dir=str(tmp_path), timer=timer).resolve(_client, params, clients)
  assert isinstance(measured, cm.Chunked) and measured.chunk_size == 1 and timer.calls


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("FEDJAX_OPT_AUTOTUNE_CACHE", str(tmp_path / "here"))
  assert autotune.cache_dir() == str(tmp_path / "here")
  monkeypatch.setenv("FEDJAX_OPT_AUTOTUNE_CACHE", "off")
  assert autotune.cache_dir() is None
  monkeypatch.delenv("FEDJAX_OPT_AUTOTUNE_CACHE")
  assert autotune.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "fedjax_opt", "autotune")


def test_measured_auto_runs_the_chosen_mode_inside_a_jitted_fedavg_round(tmp_path):
  params, (data, mask) = _inputs(16)
  batches = fo.ClientBatches(data=data, mask=mask, weight=jnp.arange(1.0, 17.0),
                             client_id=jnp.arange(16, dtype=jnp.int32))
  timer = FakeTimer({"sequential": 0.001})
  measured = cm.Auto(measure=True, cache_dir=str(tmp_path), timer=timer)
  runs = {}
  for name, mode in [("auto", measured), ("sequential", "sequential"), ("vmap", "vmap")]:
    algorithm = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1), client_map=mode)
    state = algorithm.init(params, jax.random.key(0))
    runs[name] = jax.jit(algorithm.step)(state, batches).params
  assert timer.calls  # measured while tracing the user's jitted step: the values it closes over are tracers there
  # sequential streams the weighted sum in its loop: the measured auto is that program, to the bit
  for leaf_auto, leaf_seq, leaf_vmap in zip(*(jax.tree.leaves(runs[k]) for k in ("auto", "sequential", "vmap"))):
    np.testing.assert_array_equal(np.asarray(leaf_auto), np.asarray(leaf_seq))
    np.testing.assert_allclose(np.asarray(leaf_auto), np.asarray(leaf_vmap), rtol=1e-5, atol=1e-6)
  # the round against a float64 NumPy transcription of weighted FedAvg with 2 local SGD steps
  expect_w, expect_b = fedavg_lsq_np(params["w"], params["b"], data["x"], data["y"], mask, batches.weight, 0.1)
  np.testing.assert_allclose(np.asarray(runs["auto"]["w"]), expect_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(runs["auto"]["b"]), expect_b, rtol=1e-5, atol=1e-6)


def test_choice_names_round_trip():
  for choice in [heuristics.Choice(), heuristics.Choice(chunk_size=1, canonical_convs=True),
                 heuristics.Choice(chunk_size=64, fuse_small_dots=True)]:
    assert autotune.parse_choice(autotune.choice_name(choice)) == choice
    assert cm.resolve(autotune.choice_name(choice)) is not None
  with pytest.raises(ValueError, match="not a measured choice"):
    autotune.parse_choice("sharded")


def test_a_function_closing_over_a_traced_value_is_measured_with_a_stand_in(tmp_path):
  params, clients = _inputs(16)
  timer = FakeTimer({"chunked:8": 0.1})
  mode = cm.Auto(shard=False, measure=True, cache_dir=str(tmp_path), timer=timer)

  @jax.jit
  def mapped(lr, p, c):  # lr is a tracer: the per-client function closes over it
    fn = lambda q, one: local_train(_loss, optax.sgd(lr), q, *one).delta
    return cm.map_clients(mode, fn, p, c)

  out = mapped(jnp.float32(0.1), params, clients)
  assert timer.calls
  expect = jax.vmap(_client, in_axes=(None, 0))(params, clients)
  np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(expect["w"]), rtol=1e-5, atol=1e-6)


def test_decisions_written_at_once_each_leave_a_whole_file(tmp_path):
  import threading

  def write(i):
    for j in range(25):
      autotune._write(str(tmp_path), "samekey", {"choice": "chunked:8" if (i + j) % 2 else "vmap", "pad": "x" * 4096})

  threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert [p.name for p in tmp_path.iterdir()] == ["samekey.json"]
  assert autotune._read(str(tmp_path / "samekey.json")) in ("vmap", "chunked:8")


def test_the_accelerator_rule_chunks_a_convolutional_model_past_a_measured_client_count(monkeypatch):
  model = fo.models.emnist_cnn()
  params = jax.eval_shape(model.init, jax.random.key(0))
  fn = lambda p, one: local_train(model.loss_fn, optax.sgd(0.1), p, *one).delta

  def clients(c):
    return ({"x": jax.ShapeDtypeStruct((c, 2, 4, 28, 28), jnp.float32),
             "y": jax.ShapeDtypeStruct((c, 2, 4), jnp.int32)}, jax.ShapeDtypeStruct((c, 2, 4), jnp.bool_))

  monkeypatch.setattr(heuristics.jax, "default_backend", lambda: "gpu")
  assert heuristics.choose(fn, params, clients(512), 1 << 40, shard=False) == heuristics.Choice(chunk_size=64)
  assert heuristics.choose(fn, params, clients(64), 1 << 40, shard=False) == heuristics.Choice()
  dense = lambda p, one: local_train(_loss, optax.sgd(0.1), p, *one).delta
  assert heuristics.choose(dense, _inputs(512)[0], _inputs(512)[1], 1 << 40, shard=False) == heuristics.Choice()
