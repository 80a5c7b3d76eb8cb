"""The execution policy (fedjax_opt/core/execution.py): how clients run, set once, read when a step is traced.

Claims: a context or `fo.with_execution` sets the client map, the per-client storage dtype and the compute
precision of algorithms built without those keywords; a factory keyword overrides the policy; inner settings win
field by field; bfloat16 client compute keeps parameters and state in float32 and matches a float64 NumPy
transcription of the same bfloat16-rounded computation; bad values are refused in one line. The factory keywords
(`execution.accepts_policy_keywords`, the one decorator every factory has) are `with_execution`: they override the
surrounding policy field by field, set the tables' dtype at `init`, give bit-identical rounds, run every function
of the algorithm (`personalize`, FedMA's `run` and `match`) under the policy, and are refused in one line when bad.
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


from conftest import fedavg_lsq_np, lsq_loss as _loss, run_rounds


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
    # the factory keyword is the same policy: the same bits
    keyword = fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1), client_map=mode)
    for got, want in zip(jax.tree.leaves(jax.jit(keyword.step)(state, batches).params), jax.tree.leaves(end)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=mode)


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


def _scaffold(**kw):
  return fo.algorithms.scaffold(_loss, 0.1, 1.0, num_clients=6, **kw)


def _table_dtypes(state):
  return {a.dtype for a in jax.tree.leaves(state.client_control_variates)}


def test_a_factory_keyword_overrides_the_surrounding_policy_field_by_field():
  params, batches = _problem()
  key = jax.random.key(0)
  looped = _scaffold(client_map="sequential")  # sets the client map, not the storage dtype
  with fo.execution(client_map="vmap", storage_dtype=jnp.bfloat16):
    state = looped.init(params, key)
    vmapped = _loops(_scaffold().step, state, batches)
    assert _loops(looped.step, state, batches) == vmapped + 1  # the keyword's client map
  assert _table_dtypes(state) == {jnp.dtype(jnp.bfloat16)}  # the context's storage dtype
  kept = _scaffold(storage_dtype=jnp.float32)  # sets the storage dtype, not the client map
  with fo.execution(client_map="sequential", storage_dtype=jnp.bfloat16):
    state = kept.init(params, key)
    assert _loops(kept.step, state, batches) == vmapped + 1  # the context's client map
  assert _table_dtypes(state) == {jnp.dtype(jnp.float32)}  # the keyword's storage dtype
  both = _scaffold(client_map="vmap", storage_dtype=jnp.float32)
  with fo.execution(client_map="sequential", storage_dtype=jnp.bfloat16):
    state = both.init(params, key)
    assert _loops(both.step, state, batches) == vmapped
  assert _table_dtypes(state) == {jnp.dtype(jnp.float32)}
  assert execution.current() == execution.Policy("auto", "float32", None)  # nothing leaks out


def test_a_storage_dtype_keyword_sets_the_table_at_init_and_rounds_as_with_execution_bit_for_bit():
  params, batches = _problem()
  keyword = _scaffold(storage_dtype=jnp.bfloat16)
  state = keyword.init(params, jax.random.key(0))  # no context: the keyword alone
  assert _table_dtypes(state) == {jnp.dtype(jnp.bfloat16)}
  assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  wrapped = fo.with_execution(_scaffold(), storage_dtype=jnp.bfloat16)
  got, _ = run_rounds(keyword.step, state, batches, 3)
  want, _ = run_rounds(wrapped.step, wrapped.init(params, jax.random.key(0)), batches, 3)
  assert _table_dtypes(got) == {jnp.dtype(jnp.bfloat16)}
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bad_factory_keyword_is_refused_in_one_line_when_the_factory_is_called():
  fedavg = lambda **kw: fo.algorithms.fedavg(_loss, client_optimizer=optax.sgd(0.1), **kw)
  cases = [
      (ValueError, "client_map must be one of", lambda: fedavg(client_map="vmapp")),
      (ValueError, "client_map must be one of", lambda: fedavg(client_map=3)),
      (TypeError, "storage_dtype must be a floating dtype such as jnp.bfloat16; got int32",
       lambda: _scaffold(storage_dtype=jnp.int32)),
      (TypeError, "storage_dtype must be a floating dtype such as jnp.bfloat16; got 'no_such_dtype'",
       lambda: _scaffold(storage_dtype="no_such_dtype")),
      (TypeError, "unexpected keyword argument 'storage_dtype'", lambda: fedavg(storage_dtype=jnp.bfloat16)),
  ]
  for error, message, call in cases:
    with pytest.raises(error, match=message) as caught:
      call()
    assert "\n" not in str(caught.value), str(caught.value)
  # FromPolicy is what None means: the plain algorithm, which follows the context
  params, batches = _problem()
  follows = fedavg(client_map=fo.client_map.FromPolicy())
  state = follows.init(params, jax.random.key(0))
  with fo.execution(client_map="vmap"):
    vmapped = _loops(follows.step, state, batches)
  with fo.execution(client_map="sequential"):
    assert _loops(follows.step, state, batches) == vmapped + 1


def test_the_decorator_refuses_a_factory_that_declares_a_policy_keyword_itself():
  def factory(loss_fn, *, client_map=None):
    return loss_fn, client_map

  with pytest.raises(TypeError, match="factory must not declare \\['client_map'\\] itself"):
    execution.accepts_policy_keywords(factory)


def test_every_function_of_a_personalized_or_host_driven_algorithm_runs_under_the_keyword():
  """Per-FedAvg's `personalize` and FedMA's `init`/`run`/`match` are wrapped too: each runs under the
  algorithm's policy (the loss sees it when traced), and gives what the plain algorithm gives."""
  seen = []

  def loss(params, batch):
    seen.append(execution.current().client_map)
    return _loss(params, batch)

  params, batches = _problem(s=2)  # Per-FedAvg's two batches (D, D') per local step
  build = lambda **kw: fo.algorithms.per_fedavg(loss, 0.01, 0.01, local_steps=1, **kw)
  keyword, plain = build(client_map="sequential"), build()
  data, mask = jax.tree.map(lambda a: a[0], batches.data), batches.mask[0]
  with fo.execution(client_map="vmap"):
    adapted = keyword.personalize(params, data, mask)
    assert seen[-1] == fo.client_map.sequential()
    state = keyword.init(params, jax.random.key(0))
    jax.eval_shape(keyword.step, state, batches)
    assert seen[-1] == fo.client_map.sequential()
  want = plain.personalize(params, data, mask)
  assert seen[-1] == "auto"  # the default policy
  for a, b in zip(jax.tree.leaves(adapted), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  matched = fo.algorithms.fedma(loss, layers=("hidden_0", "output"), client_optimizer=optax.sgd(0.1),
                                num_clients=2, client_map="vmap")
  assert type(matched).__name__ == "MatchedAveraging"
  assert all(hasattr(getattr(matched, name), "__wrapped__") for name in matched._fields)
  again = fo.with_execution(matched, client_map="sequential")  # any NamedTuple of functions
  assert type(again) is type(matched) and again.init.__wrapped__ is matched.init


def test_a_jitted_step_is_traced_again_under_another_policy_and_a_keyword_holds_in_every_one():
  traced = []

  def loss(params, batch):
    traced.append(execution.current().client_map)
    return _loss(params, batch)

  params, batches = _problem()
  plain = fo.algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1))
  state = plain.init(params, jax.random.key(0))
  step = jax.jit(plain.step)
  with fo.execution(client_map="vmap"):
    step(state, batches)
    count = len(traced)
    step(state, batches)
    assert len(traced) == count  # the cached trace
  with fo.execution(client_map="sequential"):
    step(state, batches)
  assert len(traced) > count and traced[-1] == fo.client_map.sequential()  # traced again, not reused
  keyword = jax.jit(fo.algorithms.fedavg(loss, client_optimizer=optax.sgd(0.1), client_map="sequential").step)
  for outer in ("vmap", "chunked:2"):
    with fo.execution(client_map=outer):
      keyword(state, batches)
      assert traced[-1] == fo.client_map.sequential(), outer
