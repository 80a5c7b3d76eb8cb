"""FedAvg + fine-tuning + personalization (Jiang et al. 2019): stages against manual runs and NumPy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt import server_optimizers
from fedjax_opt.algorithms.fedavg import fedavg
from fedjax_opt.algorithms.fedavg_finetune import fedavg_finetune
from fedjax_opt.train import Evaluation, Sampling, train

from conftest import lsq_grad_np, lsq_loss, make_clients, pack

D = 3


def _params():
  return {"w": jnp.asarray(np.linspace(-0.5, 0.5, D)), "b": jnp.asarray(0.1)}


def _random_batches(rng, c=4, steps=2, b=3):
  x, y = rng.normal(size=(c, steps, b, D)), rng.normal(size=(c, steps, b))
  mask = np.ones((c, steps, b), bool)
  mask[1, 1, 1:] = False
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray(np.array([3.0, 2.0, 4.0, 1.0])), client_id=jnp.arange(c, dtype=jnp.int32))


def _test_losses(algorithm, params, train, test):
  """Each client's mean test loss with `params` and with its personalized model (stage 3 on its train data)."""

  def mean_loss(p, data, mask):
    folded, folded_mask = fo.core.as_single_step(data, mask)
    return fo.core.masked_mean_loss(lsq_loss, p, jax.tree.map(lambda a: a[0], folded), folded_mask[0])[0]

  def client(p, c):
    train_data, train_mask, test_data, test_mask = c
    personal = algorithm.personalize(p, train_data, train_mask)
    return mean_loss(p, test_data, test_mask), mean_loss(personal, test_data, test_mask)

  return fo.client_map.map_clients(None, client, params, (train.data, train.mask, test.data, test.mask))


def _assert_equal(a, b):
  chex.assert_trees_all_equal(a, b)


@pytest.fixture()  # per test: mutation testing attributes the factory call to every test that uses it
def two_stage_run():
  """Four rounds with switch_round = 2: FedAvgM, then Adam clients (first M = 1 of S = 2 steps) and FedAdam."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    rounds = [_random_batches(rng) for _ in range(4)]
    ft = fedavg_finetune(lsq_loss, switch_round=2, personalize_steps=1, client_optimizer=optax.sgd(0.1),
                         finetune_client_optimizer=optax.adam(0.05),
                         server_optimizer=server_optimizers.fedavgm(0.7, 0.8),
                         finetune_server_optimizer=server_optimizers.fedadam(0.1), finetune_local_steps=1)
    step = jax.jit(ft.step)
    states = [ft.init(_params(), jax.random.key(0))]
    for batches in rounds:
      states.append(step(states[-1], batches))
  return rounds, states


def test_stage_one_is_fedavg_with_server_momentum(two_stage_run):
  """Rounds t < switch_round equal plain FedAvg + FedAvgM, bit for bit; stage 2's optimizer state is untouched."""
  rounds, states = two_stage_run
  with jax.enable_x64(True):
    ref = fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), server_optimizer=server_optimizers.fedavgm(0.7, 0.8))
    ref_state = ref.init(_params(), jax.random.key(0))
    for batches, state in zip(rounds[:2], states[1:3]):
      ref_state = jax.jit(ref.step)(ref_state, batches)
      _assert_equal(state.params, ref_state.params)
      _assert_equal(state.server_opt_state, ref_state.server_opt_state)
      np.testing.assert_array_equal(state.metrics["client_loss"], ref_state.metrics["client_loss"])
      np.testing.assert_array_equal(jax.random.key_data(state.key), jax.random.key_data(ref_state.key))
      assert not bool(state.metrics["finetuning"])
    _assert_equal(states[2].finetune_opt_state, server_optimizers.fedadam(0.1).init(_params()))


def test_stage_two_uses_the_second_optimizers_from_the_stage_one_model(two_stage_run):
  """Rounds t ≥ switch_round equal FedAvg with Adam clients on the first local step and a fresh FedAdam server,
  started from the stage-1 model; stage 1's momentum is then frozen."""
  rounds, states = two_stage_run
  with jax.enable_x64(True):
    second = fedavg(lsq_loss, client_optimizer=optax.adam(0.05), server_optimizer=server_optimizers.fedadam(0.1))
    ref = second.init(states[2].params, jax.random.key(0)).replace(round=states[2].round, key=states[2].key)
    for batches, state in zip(rounds[2:], states[3:]):
      one_step = batches.replace(mask=batches.mask.at[:, 1].set(False))  # M = 1: only the first local step
      ref = jax.jit(second.step)(ref, one_step)
      _assert_equal(state.params, ref.params)
      _assert_equal(state.finetune_opt_state, ref.server_opt_state)
      np.testing.assert_array_equal(jax.random.key_data(state.key), jax.random.key_data(ref.key))
      assert bool(state.metrics["finetuning"])
    _assert_equal(states[4].server_opt_state, states[2].server_opt_state)
    assert int(states[4].round) == 4


def test_default_finetuning_server_is_fedadam_with_reddi_defaults(rng):
  """Stage 2's default server optimizer is Adam (Jiang et al.'s fine-tuning stage), `server_optimizers.fedadam()`:
  the first stage-2 round from x_0 is x_0 + η(1 − β₁)Δ/(√(β₂τ² + (1 − β₂)Δ²) + τ) with η = 0.01, β₁ = 0.9,
  β₂ = 0.99, τ = 1e-3 and Δ = Σ n_k Δ_k / Σ n_k of one full-batch SGD step per client (float64 NumPy)."""
  lr = 0.3
  clients = make_clients(rng, [3, 5, 4], D)
  with jax.enable_x64(True):
    ft = fedavg_finetune(lsq_loss, switch_round=0, personalize_steps=0, client_optimizer=optax.sgd(0.1),
                         finetune_client_optimizer=optax.sgd(lr))
    params = _params()
    out = jax.jit(ft.step)(ft.init(params, jax.random.key(0)), pack(clients, 1, 5, dtype=np.float64))
    x0 = np.append(np.asarray(params["w"]), float(params["b"]))
    deltas = [-lr * np.append(*lsq_grad_np(x0[:-1], x0[-1], x, y)) for x, y in clients]
    delta = np.average(deltas, axis=0, weights=[len(y) for _, y in clients])
    expected = x0 + 0.01 * 0.1 * delta / (np.sqrt(0.99 * 1e-6 + 0.01 * delta**2) + 1e-3)
    np.testing.assert_allclose(np.append(np.asarray(out.params["w"]), float(out.params["b"])), expected, rtol=1e-12)
    assert bool(out.metrics["finetuning"])


def test_personalize_zero_steps_is_identity_and_k_steps_match_numpy(rng):
  """K = 0 returns the model; K full-batch GD steps (and K steps cycling over S = 2 batches) equal NumPy."""
  lr, k = 0.3, 4
  with jax.enable_x64(True):
    x, y = rng.normal(size=(2, 5, D)), rng.normal(size=(2, 5))
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    params = _params()
    ft0 = fedavg_finetune(lsq_loss, switch_round=0, personalize_steps=0, client_optimizer=optax.sgd(0.1),
                          finetune_client_optimizer=optax.sgd(lr))
    _assert_equal(jax.jit(ft0.personalize)(params, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.asarray(mask)),
                  params)
    ft = fedavg_finetune(lsq_loss, switch_round=0, personalize_steps=k, client_optimizer=optax.sgd(0.1),
                         finetune_client_optimizer=optax.sgd(lr))
    full = jax.jit(ft.personalize)(params, {"x": jnp.asarray(x.reshape(1, 10, D)), "y": jnp.asarray(y.reshape(1, 10))},
                                   jnp.asarray(mask.reshape(1, 10)))
    cycled = jax.jit(ft.personalize)(params, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, jnp.asarray(mask))
    w, b = np.asarray(params["w"]), float(params["b"])
    xm, ym = x.reshape(10, D)[mask.reshape(-1)], y.reshape(10)[mask.reshape(-1)]
    wf, bf = w.copy(), b
    wc, bc = w.copy(), b
    for step in range(k):
      gw, gb = lsq_grad_np(wf, bf, xm, ym)
      wf, bf = wf - lr * gw, bf - lr * gb
      s = step % 2
      gw, gb = lsq_grad_np(wc, bc, x[s][mask[s]], y[s][mask[s]])
      wc, bc = wc - lr * gw, bc - lr * gb
    np.testing.assert_allclose(np.asarray(full["w"]), wf, rtol=1e-12)
    np.testing.assert_allclose(float(full["b"]), bf, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(cycled["w"]), wc, rtol=1e-12)
    np.testing.assert_allclose(float(cycled["b"]), bc, rtol=1e-12)


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_train_driver_runs_it_and_personalization_beats_the_global_model(rng):
  """Heterogeneous least squares (own input shift and target per client): 30 rounds through `fo.train`
  (stage 2 from round 20), then K = 10 local steps lower every client's held-out loss."""
  sizes = [40] * 6
  clients = make_clients(rng, sizes, D)
  data = [{"x": x[:30], "y": y[:30]} for x, y in clients]
  dataset = fo.data.pack(data, test_clients=[{"x": x[30:], "y": y[30:]} for x, y in clients])
  ft = fedavg_finetune(lsq_loss, switch_round=20, personalize_steps=10, client_optimizer=optax.sgd(0.05),
                       finetune_client_optimizer=optax.sgd(0.02), finetune_local_steps=2,
                       finetune_server_optimizer=server_optimizers.fedavg(), personalize_optimizer=optax.sgd(0.1))
  params = {"w": jnp.zeros(D), "b": jnp.zeros(())}
  state, history = train(ft, ft.init(params, jax.random.key(0)), dataset, 30,
                         Sampling(clients_per_round=3, batch_size=10, local_steps=5), evaluation=Evaluation(every=10),
                         progress=False)
  assert int(state.round) == 30
  assert list(history.round_metrics["finetuning"]) == [False] * 20 + [True] * 10
  train_batches = pack([(x[:30], y[:30]) for x, y in clients], steps=1, batch=30)
  test_batches = pack([(x[30:], y[30:]) for x, y in clients], steps=1, batch=10)
  evaluate = jax.jit(lambda p, train, test: _test_losses(ft, p, train, test))
  before, after = evaluate(state.params, train_batches, test_batches)
  assert np.mean(before) < np.mean(evaluate(params, train_batches, test_batches)[0])
  before, after = np.asarray(before), np.asarray(after)
  for k, (x, y) in enumerate(clients):
    r = x[30:] @ np.asarray(state.params["w"]) + float(state.params["b"]) - y[30:]
    np.testing.assert_allclose(before[k], 0.5 * np.mean(r**2), rtol=1e-4)
  assert np.all(after < before), (before, after)
  stacked = fo.client_map.map_clients(None, lambda p, client: ft.personalize(p, *client), state.params,
                                      (train_batches.data, train_batches.mask))
  assert stacked["w"].shape == (6, D)


def test_bad_arguments():
  kw = dict(switch_round=1, personalize_steps=1, client_optimizer=optax.sgd(0.1),
            finetune_client_optimizer=optax.sgd(0.1))
  with pytest.raises(TypeError, match="finetune_client_optimizer"):
    fedavg_finetune(lsq_loss, **{**kw, "finetune_client_optimizer": "adam"})
  with pytest.raises(ValueError, match="switch_round"):
    fedavg_finetune(lsq_loss, **{**kw, "switch_round": -1})
  with pytest.raises(TypeError, match="switch_round"):
    fedavg_finetune(lsq_loss, **{**kw, "switch_round": 2.5})
  with pytest.raises(ValueError, match="personalize_steps"):
    fedavg_finetune(lsq_loss, **{**kw, "personalize_steps": -1})
  with pytest.raises(ValueError, match="finetune_local_steps"):
    fedavg_finetune(lsq_loss, finetune_local_steps=0, **kw)


def test_a_stateful_aggregator_carries_its_state_across_the_switch():
  """Centered clipping with momentum keeps a center: stage 2 starts from the center stage 1 left, not a fresh one
  (equal, round by round, to FedAvg with the same aggregator handed on by hand); the initial metrics are FedAvg's."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(11)
    rounds = [_random_batches(rng) for _ in range(4)]
    clip = fo.aggregators.centered_clipping(0.05, momentum=0.5)
    ft = fedavg_finetune(lsq_loss, switch_round=2, personalize_steps=1, client_optimizer=optax.sgd(0.1),
                         server_optimizer=optax.sgd(0.8), aggregator=clip, finetune_client_optimizer=optax.sgd(0.2), finetune_server_optimizer=optax.sgd(0.5))
    first = fedavg(lsq_loss, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(0.8), aggregator=clip)
    second = fedavg(lsq_loss, client_optimizer=optax.sgd(0.2), server_optimizer=optax.sgd(0.5), aggregator=clip)
    state = ft.init(_params(), jax.random.key(3))
    ref = first.init(_params(), jax.random.key(3))
    assert set(state.metrics) == set(ref.metrics) | {"finetuning"}
    for name, value in ref.metrics.items():
      np.testing.assert_array_equal(state.metrics[name], value)
    for t, batches in enumerate(rounds):
      if t == 2:
        ref = second.init(ref.params, ref.key).replace(aggregator_state=ref.aggregator_state, round=ref.round)
      state = jax.jit(ft.step)(state, batches)
      ref = jax.jit((first if t < 2 else second).step)(ref, batches)
      _assert_equal(state.aggregator_state, ref.aggregator_state)
      _assert_equal(state.params, ref.params)
    assert np.abs(state.aggregator_state.center["w"]).max() > 1e-3  # a fresh center would be zeros
