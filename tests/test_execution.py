"""The execution policy (fedjax_opt/core/execution.py): how clients run, set once, read when a step is traced.

Claims: a context or `fo.with_execution` sets the client map, the per-client storage dtype and the compute
precision of algorithms built without those keywords; a factory keyword overrides the policy; inner settings win
field by field; bfloat16 client compute keeps parameters and state in float32 and matches a float64 NumPy
transcription of the same bfloat16-rounded computation; bad values are refused in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.core import execution
from fedjax_opt.core.client_map import tracing
from fedjax_opt.core.local import masked_mean_loss


from conftest import fedavg_lsq_np, lsq_loss as _loss


def _problem(c=6, s=3, b=5, d=4, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=d), jnp.float32), "b": jnp.asarray(0.3, jnp.float32)}
  batches = fo.ClientBatches(
      data={"x": jnp.asarray(rng.normal(size=(c, s, b, d)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(c, s, b)), jnp.float32)},
      mask=jnp.ones((c, s, b), bool), weight=jnp.arange(1.0, c + 1.0), client_id=jnp.arange(c, dtype=jnp.int32))
  return params, batches


def _loops(fn, *args):
  """How many loops (scan/while) the traced function holds, nested ones included."""
  return sum(e.primitive.name in ("scan", "while") for e in tracing.equations(jax.make_jaxpr(fn)(*args)))


def test_the_context_and_the_wrapper_set_the_client_map_of_an_algorithm_built_without_one():
  params, batches = _problem()
  algorithm = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1))
  state = algorithm.init(params, jax.random.key(0))
  with fo.execution(client_map="vmap"):
    vmapped = _loops(algorithm.step, state, batches)
  with fo.execution(client_map="sequential"):
    looped = _loops(algorithm.step, state, batches)
  assert looped == vmapped + 1  # the loop over clients
  assert _loops(fo.with_execution(algorithm, client_map="sequential").step, state, batches) == looped
  with fo.execution(client_map="vmap"):  # the wrapper's setting is the inner one
    assert _loops(fo.with_execution(algorithm, client_map="sequential").step, state, batches) == looped
  explicit = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1), client_map="vmap")
  with fo.execution(client_map="sequential"):  # a factory keyword overrides the policy
    assert _loops(explicit.step, state, batches) == vmapped
  with fo.execution(client_map="sequential"), fo.execution(precision="bfloat16"):  # fields nest one by one
    assert execution.current().client_map == fo.client_map.sequential()
    assert execution.current().precision == "bfloat16"
  assert execution.current() == execution.Policy("auto", "float32", None)


def test_every_client_map_of_the_policy_gives_fedavg_the_same_round():
  params, batches = _problem()
  algorithm = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1))
  state = algorithm.init(params, jax.random.key(0))
  w, b = fedavg_lsq_np(params["w"], params["b"], batches.data["x"], batches.data["y"], batches.mask,
                       batches.weight, 0.1)
  for mode in ("vmap", "sequential", "chunked:4"):
    end = jax.jit(fo.with_execution(algorithm, client_map=mode).step)(state, batches).params
    np.testing.assert_allclose(np.asarray(end["w"]), w, rtol=1e-5, atol=1e-6, err_msg=mode)
    np.testing.assert_allclose(float(end["b"]), b, rtol=1e-5, atol=1e-6, err_msg=mode)


def test_the_policy_storage_dtype_sets_per_client_tables_and_a_keyword_overrides_it():
  params, batches = _problem()
  build = lambda **kw: fo.algorithms.scaffold(_loss, 0.1, 1.0, num_clients=6, **kw)
  with fo.execution(storage_dtype=jnp.bfloat16):
    state = build().init(params, jax.random.key(0))
    kept = build(storage_dtype=jnp.float32).init(params, jax.random.key(0))
  assert {a.dtype for a in jax.tree.leaves(state.client_control_variates)} == {jnp.dtype(jnp.bfloat16)}
  assert {a.dtype for a in jax.tree.leaves(kept.client_control_variates)} == {jnp.dtype(jnp.float32)}
  assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  wrapped = fo.with_execution(build(), storage_dtype=jnp.bfloat16)
  after = jax.jit(wrapped.step)(wrapped.init(params, jax.random.key(0)), batches)
  table = after.client_control_variates
  assert table["w"].dtype == jnp.bfloat16
  # SCAFFOLD's c moves by (1/N) Σ Δc_i with Δc_i the change of the *stored* (bfloat16-rounded) row
  np.testing.assert_allclose(np.asarray(after.control_variate["w"], np.float64),
                             np.asarray(table["w"], np.float64).sum(axis=0) / 6, rtol=1e-6, atol=1e-7)
  # integer tables stay integer under a floating storage policy
  with fo.execution(storage_dtype=jnp.bfloat16):
    counts = fo.core.per_client.init({"n": jnp.zeros((), jnp.int32), "x": jnp.zeros(2)}, 3)
  assert counts["n"].dtype == jnp.int32 and counts["x"].dtype == jnp.bfloat16


def test_bfloat16_compute_matches_a_numpy_transcription_of_the_rounded_pass_and_keeps_float32_state():
  params, batches = _problem()
  batch = jax.tree.map(lambda a: a[0, 0], batches.data)
  mask = batches.mask[0, 0]
  grad = jax.grad(lambda p: masked_mean_loss(_loss, p, batch, mask)[0])
  with fo.execution(precision="bfloat16"):
    loss16, _ = masked_mean_loss(_loss, params, batch, mask)
    g16 = grad(params)
  assert loss16.dtype == jnp.float32 and g16["w"].dtype == jnp.float32
  bf = lambda a: np.asarray(np.asarray(a, np.float32).astype(ml_dtypes.bfloat16), np.float64)
  x, y, w, b = bf(batch["x"]), bf(batch["y"]), bf(params["w"]), bf(params["b"])
  residual = x @ w + b - y
  np.testing.assert_allclose(float(loss16), np.mean(0.5 * residual ** 2), rtol=2e-2)
  np.testing.assert_allclose(np.asarray(g16["w"]), x.T @ residual / len(y), rtol=3e-2, atol=2e-2)
  loss32, _ = masked_mean_loss(_loss, params, batch, mask)
  assert float(loss32) != float(loss16)  # the pass did run in bfloat16


def test_a_bfloat16_fedavg_round_stays_close_to_float32_with_float32_parameters():
  params, batches = _problem(c=8, s=4, b=16, d=8)
  algorithm = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.05))
  state = algorithm.init(params, jax.random.key(0))
  full = jax.jit(algorithm.step)(state, batches)
  half = jax.jit(fo.with_execution(algorithm, precision="bfloat16").step)(state, batches)
  assert {a.dtype for a in jax.tree.leaves(half.params)} == {jnp.dtype(jnp.float32)}
  d32 = np.asarray(full.params["w"]) - np.asarray(params["w"])
  d16 = np.asarray(half.params["w"]) - np.asarray(params["w"])
  relative = np.linalg.norm(d16 - d32) / np.linalg.norm(d32)
  assert 0 < relative < 5e-2  # bfloat16 keeps 8 bits of mantissa: about 0.4 % an operation
  np.testing.assert_allclose(float(half.metrics["client_loss"]), float(full.metrics["client_loss"]), rtol=2e-2)


def test_bad_policies_are_refused_in_one_line():
  with pytest.raises(ValueError, match="precision must be one of 'float32', 'bfloat16'; got 'float16'"):
    with fo.execution(precision="float16"):
      pass
  with pytest.raises(TypeError, match="storage_dtype must be a floating dtype"):
    with fo.execution(storage_dtype=jnp.int32):
      pass
  with pytest.raises(ValueError, match="client_map must be one of"):
    fo.with_execution(fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1)), client_map="vmapp")
  with pytest.raises(TypeError, match="with_execution: algorithm must be a FederatedAlgorithm"):
    fo.with_execution(lambda s, b: s, client_map="vmap")
