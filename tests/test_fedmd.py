"""FedMD (Li & Wang 2019): without the public step it is local training (to float rounding); one round against a float64
NumPy transcription; clients of two architectures on a label-skewed split learn classes they never saw."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo

D, K = 5, 3


def logreg_apply(params, x):
  return x.reshape(x.shape[0], -1) @ params["w"] + params["b"]


def ce(apply_fn):
  def loss(params, batch):
    scores = apply_fn(params, batch["x"])
    return jax.nn.logsumexp(scores, axis=-1) - jnp.take_along_axis(scores, batch["y"][:, None], axis=-1)[:, 0]
  return loss


def mlp_apply(params, x):
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def _batches(x, y, mask=None):
  n = x.shape[0]
  mask = np.ones(y.shape, bool) if mask is None else mask
  return fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.int32)},
                          mask=jnp.asarray(mask), weight=jnp.asarray(mask.sum((1, 2)), jnp.float32),
                          client_id=jnp.arange(n, dtype=jnp.int32))


def test_without_the_public_step_fedmd_is_independent_local_training():
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(4, 3, 6, D)), rng.integers(0, K, size=(4, 3, 6))
  mask = np.ones((4, 3, 6), bool)
  mask[2, 2] = False
  params = {"w": jnp.asarray(rng.normal(size=(D, K)), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
  algo = fo.algorithms.fedmd(ce(logreg_apply), apply_fn=logreg_apply, num_clients=4,
                             public_data={"x": jnp.ones((8, D))}, public_per_round=8, digest_steps=0,
                             digest_batch_size=4, client_optimizer=optax.sgd(0.3))
  state = algo.init(params, jax.random.key(0))
  batches = _batches(x, y, mask)
  for _ in range(2):
    state = jax.jit(algo.step)(state, batches)
  for k in range(4):
    alone = params
    for _ in range(2):
      result = fo.core.local_train(ce(logreg_apply), optax.sgd(0.3), alone, jax.tree.map(lambda a: a[k], batches.data),
                                   batches.mask[k])
      alone = jax.tree.map(jnp.add, alone, result.delta)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), fo.personalized_params(state, k),
                 alone)


def _np_softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_digest(s, target, kind, temperature):
  """Per-example distance d(s, t) and ∂d/∂s, float64: "l1" mean_c |s − t|; "kl" T² Σ_c p_c (log p_c − log q_c) with
  p = softmax(t/T), q = softmax(s/T), whose gradient is T² · (q − p) / T (chain rule through s/T)."""
  if kind == "l1":
    return np.mean(np.abs(s - target), -1), np.sign(s - target) / s.shape[1]
  t = temperature
  p, q = _np_softmax(target / t), _np_softmax(s / t)
  return t ** 2 * np.sum(p * (np.log(p) - np.log(q)), -1), t ** 2 * (q - p) / t


def _np_logreg_grad(w, b, x, target_or_y, kind, temperature=1.0):
  """Gradient of the batch mean of the digest distance (`kind` "l1" / "kl") or of the cross-entropy ("ce")."""
  s = x @ w + b
  if kind == "ce":
    g = _np_softmax(s)
    g[np.arange(len(target_or_y)), target_or_y] -= 1
  else:
    g = _np_digest(s, target_or_y, kind, temperature)[1]
  g = g / s.shape[0]
  return x.T @ g, g.sum(0)


@pytest.mark.parametrize("digest_loss, temperature", [("l1", 1.0), ("kl", 2.0)])
def test_one_round_is_the_numpy_transcription(digest_loss, temperature):
  """Consensus = mean of the clients' scores on the round's public subset; digest steps on the L1 distance, or on
  T² KL(softmax(f̃/T) ‖ softmax(f_k/T)) with T = 2 (so T² → T or T → 1 changes the numbers); CE revisit steps. The
  `digest_loss` metric is the distance before each digest step, averaged over the steps and the clients."""
  rng = np.random.default_rng(1)
  n, s, b, p, pr, bd, steps, eta = 3, 2, 4, 12, 6, 3, 3, 0.2
  x, y = rng.normal(size=(n, s, b, D)), rng.integers(0, K, size=(n, s, b))
  public = rng.normal(size=(p, D)).astype(np.float32)
  starts = [{"w": rng.normal(size=(D, K)), "b": rng.normal(size=K) * 0.1} for _ in range(n)]
  algo = fo.algorithms.fedmd(ce(logreg_apply), apply_fn=logreg_apply, num_clients=n,
                             public_data={"x": jnp.asarray(public)}, public_per_round=pr, digest_steps=steps,
                             digest_batch_size=bd, client_optimizer=optax.sgd(eta), digest_loss=digest_loss,
                             temperature=temperature)
  state = algo.init({"w": jnp.zeros((D, K)), "b": jnp.zeros(K)}, jax.random.key(3))
  state = state.replace(local_params={k: jnp.asarray(np.stack([c[k] for c in starts]), jnp.float32)
                                      for k in ("w", "b")})
  new = jax.jit(algo.step)(state, _batches(x, y))
  _, pick_key = jax.random.split(jax.random.key(3))  # the round's public subset: the documented draw
  pick = np.asarray(jax.random.choice(pick_key, p, (pr,), replace=False))
  xp = public[pick].astype(np.float64)
  consensus = np.mean([xp @ c["w"] + c["b"] for c in starts], axis=0)
  distances = []
  for k in range(n):
    w, bias = starts[k]["w"].copy(), starts[k]["b"].copy()
    for step in range(steps):  # digest: batches of bd public examples, cycling
      rows = slice((step % (pr // bd)) * bd, (step % (pr // bd) + 1) * bd)
      distances.append(_np_digest(xp[rows] @ w + bias, consensus[rows], digest_loss, temperature)[0].mean())
      gw, gb = _np_logreg_grad(w, bias, xp[rows], consensus[rows], digest_loss, temperature)
      w, bias = w - eta * gw, bias - eta * gb
    for step in range(s):  # revisit: the private batches
      gw, gb = _np_logreg_grad(w, bias, x[k, step], y[k, step], "ce")
      w, bias = w - eta * gw, bias - eta * gb
    np.testing.assert_allclose(new.local_params["w"][k], w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.local_params["b"][k], bias, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(new.metrics["digest_loss"]), np.mean(distances), rtol=1e-4)


def _label_skewed_digits():
  """10 clients with two digits each (private), a quarter of every client's examples pooled as public data."""
  ds = fo.data.load("digits", num_clients=10, partition="labels", seed=0)
  train, test = fo.data.unpack(ds, "train"), fo.data.unpack(ds, "test")
  rng = np.random.default_rng(0)
  private, public_x, public_y = [], [], []
  for c in train:
    order = rng.permutation(len(c["y"]))
    cut = len(order) // 4
    public_x.append(c["x"][order[:cut]])
    public_y.append(c["y"][order[:cut]])
    private.append({k: v[order[cut:]] for k, v in c.items()})
  m = min(len(c["y"]) for c in private) // 8 * 8
  x = np.stack([c["x"][:m].reshape(8, m // 8, -1) for c in private])
  y = np.stack([c["y"][:m].reshape(8, m // 8) for c in private])
  public = {"x": jnp.asarray(np.concatenate(public_x).reshape(-1, 64)), "y": jnp.asarray(np.concatenate(public_y))}
  test_x = np.concatenate([c["x"] for c in test]).reshape(-1, 64)
  test_y = np.concatenate([c["y"] for c in test])
  return _batches(x, y), public, test_x, test_y


@pytest.mark.slow  # a convergence run
def test_two_architectures_learn_the_classes_they_never_saw_from_the_consensus():
  batches, public, test_x, test_y = _label_skewed_digits()
  arch = np.arange(10) % 2  # even clients: logistic regression; odd: a tanh MLP
  kw = dict(apply_fn=(logreg_apply, mlp_apply), num_clients=10, public_data=public, public_per_round=200,
            digest_batch_size=50, client_optimizer=optax.sgd(0.05), digest_optimizer=optax.sgd(0.2),
            architecture_of=arch)
  key = jax.random.key(0)
  k1, k2 = jax.random.split(key)
  starts = ({"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)},
            {"w1": jax.random.normal(k1, (64, 32)) * 0.1, "b1": jnp.zeros(32),
             "w2": jax.random.normal(k2, (32, 10)) * 0.1, "b2": jnp.zeros(10)})
  losses = (ce(logreg_apply), ce(mlp_apply))

  def accuracy(state):
    out = []
    for k in range(10):
      params = fo.algorithms.fedmd_client_params(state, k, arch)
      apply_fn = (logreg_apply, mlp_apply)[arch[k]]
      out.append(float(np.mean(np.argmax(apply_fn(params, jnp.asarray(test_x)), -1) == test_y)))
    return np.asarray(out)

  results = {}
  for steps in (0, 20):
    algo = fo.algorithms.fedmd(losses, digest_steps=steps, **kw)
    state = algo.init(starts, jax.random.key(1))
    run = jax.jit(lambda st, algo=algo: jax.lax.scan(lambda z, _: (algo.step(z, batches), None), st, None,
                                                     length=40)[0])
    state = run(state)
    results[steps] = (accuracy(state), float(state.metrics["consensus_accuracy"]))
  local, fedmd = results[0][0], results[20][0]
  assert local.max() < 0.3  # two digits each: at most about 20 % of the test set
  assert fedmd.mean() > local.mean() + 0.3, (fedmd, local)
  assert fedmd[arch == 0].mean() > 0.5 and fedmd[arch == 1].mean() > 0.5  # both architectures learn
  assert results[20][1] > 0.8 and results[0][1] == -1.0  # the consensus itself is a good classifier


def test_a_non_finite_client_is_left_out_of_the_consensus():
  rng = np.random.default_rng(2)
  x, y = rng.normal(size=(3, 2, 4, D)), rng.integers(0, K, size=(3, 2, 4))
  x[1, 0, 0, 0] = np.nan
  algo = fo.algorithms.fedmd(ce(logreg_apply), apply_fn=logreg_apply, num_clients=3,
                             public_data={"x": jnp.asarray(rng.normal(size=(6, D)), jnp.float32)}, public_per_round=6,
                             digest_steps=2, digest_batch_size=3, client_optimizer=optax.sgd(0.1))
  state = algo.init({"w": jnp.ones((D, K)) * 0.1, "b": jnp.zeros(K)}, jax.random.key(0))
  new = jax.jit(algo.step)(state, _batches(x, y))
  assert int(new.metrics["num_nonfinite"]) == 1 and int(new.metrics["num_clients"]) == 2
  jax.tree.map(np.testing.assert_array_equal, fo.personalized_params(new, 1), fo.personalized_params(state, 1))
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(new.local_params))
  # the NaN client's scores never entered the consensus: a second round from its kept model stays finite too
  poisoned = jax.jit(algo.step)(new, _batches(x, y))
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(poisoned.local_params))


def test_bad_arguments_are_clear():
  common = dict(apply_fn=logreg_apply, num_clients=2, public_data={"x": jnp.ones((4, D))}, public_per_round=4,
                digest_steps=1, digest_batch_size=2, client_optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match="public_per_round = 5 exceeds the 4 public examples"):
    fo.algorithms.fedmd(ce(logreg_apply), **dict(common, public_per_round=5))
  with pytest.raises(ValueError, match="architecture_of must lie in \\[0, 1\\)"):
    fo.algorithms.fedmd(ce(logreg_apply), **dict(common, architecture_of=[0, 1]))
  with pytest.raises(ValueError, match="one function per architecture"):
    fo.algorithms.fedmd((ce(logreg_apply), ce(mlp_apply)), **common)
  with pytest.raises(ValueError, match="digest_loss"):
    fo.algorithms.fedmd(ce(logreg_apply), **dict(common, digest_loss="mse"))
  with pytest.raises(TypeError, match="public_data must be a dict"):
    fo.algorithms.fedmd(ce(logreg_apply), **dict(common, public_data=jnp.ones((4, D))))
