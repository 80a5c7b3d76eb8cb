"""FedEM (Marfoq et al. 2021) against float64 NumPy transcriptions of its E-step, M-step and round, and on a
planted mixture: the mixture weights are recovered and the personalized mixtures beat FedAvg."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo

D, K = 4, 3  # features, classes


def ce_loss(params, batch):
  """Per-example softmax cross-entropy of logistic regression: −log p_θ(y | x)."""
  logits = batch["x"] @ params["w"] + params["b"]
  return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, batch["y"][:, None], axis=-1)[:, 0]


def np_ce(w, b, x, y):
  logits = x @ w + b
  top = logits.max(-1, keepdims=True)
  lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
  return lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]


def np_ce_grad(w, b, x, y, weight):
  """Gradient of (1/B) Σ_b weight_b CE_b for one batch."""
  logits = x @ w + b
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  p[np.arange(len(y)), y] -= 1.0
  g = p * weight[:, None] / len(y)
  return x.T @ g, g.sum(0)


def np_estep(comps, pi, x, y):
  """q [..., M] and the mean NLL, float64."""
  log_joint = np.stack([np.log(pi[m]) - np_ce(c["w"], c["b"], x, y) for m, c in enumerate(comps)], -1)
  top = log_joint.max(-1, keepdims=True)
  q = np.exp(log_joint - top)
  q /= q.sum(-1, keepdims=True)
  return q


def np_client_step(comps, pi, x, y, real, eta):
  """FedEM's client step in float64: ([(Δw_m, Δb_m) for each m], new π)."""
  q = np_estep(comps, pi, x, y)  # [S, B, M]
  delta = []
  for j in range(len(comps)):
    w, bias = comps[j]["w"].copy(), comps[j]["b"].copy()
    for step in range(x.shape[0]):
      keep = real[step]
      gw, gb = np_ce_grad(w, bias, x[step][keep], y[step][keep], q[step][keep][:, j])
      w, bias = w - eta * gw, bias - eta * gb
    delta.append((w - comps[j]["w"], bias - comps[j]["b"]))
  return delta, q[real].mean(0)


def _random_problem(rng, m, clients, s, b):
  comps = [{"w": rng.normal(size=(D, K)), "b": rng.normal(size=K) * 0.3} for _ in range(m)]
  x = rng.normal(size=(clients, s, b, D))
  y = rng.integers(0, K, size=(clients, s, b))
  pis = rng.dirichlet(np.ones(m), size=clients)
  return comps, x, y, pis


def _stack(comps):
  return {k: jnp.asarray(np.stack([c[k] for c in comps]), jnp.float32) for k in ("w", "b")}


def test_responsibilities_are_the_posterior_and_sum_to_one():
  rng = np.random.default_rng(0)
  comps, x, y, pis = _random_problem(rng, 3, 1, 1, 7)
  q = fo.algorithms.fedem_responsibilities(ce_loss, _stack(comps), jnp.asarray(pis[0], jnp.float32),
                                 {"x": jnp.asarray(x[0, 0], jnp.float32), "y": jnp.asarray(y[0, 0])})
  np.testing.assert_allclose(np.asarray(q).sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(q, np_estep(comps, pis[0], x[0, 0], y[0, 0]), rtol=2e-5, atol=1e-6)
  # a component with weight 0 gets responsibility exactly 0, and a huge loss never makes a NaN
  far = [comps[0], {"w": comps[1]["w"] * 1e4, "b": comps[1]["b"]}, comps[2]]
  q = fo.algorithms.fedem_responsibilities(ce_loss, _stack(far), jnp.asarray([0.5, 0.5, 0.0]),
                                 {"x": jnp.asarray(x[0, 0], jnp.float32), "y": jnp.asarray(y[0, 0])})
  assert np.all(np.isfinite(q)) and np.all(np.asarray(q)[:, 2] == 0.0)


def test_one_round_is_the_numpy_transcription_of_algorithm_1():
  """E-step, M-step (π and q-weighted local SGD for every component), n_t-weighted server average."""
  rng = np.random.default_rng(1)
  m, clients, s, b, eta, n = 2, 3, 2, 4, 0.3, 5
  comps, x, y, _ = _random_problem(rng, m, clients, s, b)
  mask = np.ones((clients, s, b), bool)
  mask[2, 1, 1:] = False  # client 2 has 5 real examples
  ids = np.array([4, 0, 2])
  table = rng.dirichlet(np.ones(m), size=n)
  algo = fo.algorithms.fedem(ce_loss, num_components=m, num_clients=n, client_optimizer=optax.sgd(eta))
  state = algo.init({"components": _stack(comps), "weights": jnp.full((m,), 0.5)}, jax.random.key(0))
  state = state.replace(mixture_weights=jnp.asarray(table, jnp.float32))
  batches = fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                             weight=jnp.asarray(mask.sum((1, 2)), jnp.float32), client_id=jnp.asarray(ids, jnp.int32))
  new = jax.jit(algo.step)(state, batches)

  deltas, weights, new_table = [], [], table.copy()
  for c in range(clients):
    delta, new_table[ids[c]] = np_client_step(comps, table[ids[c]], x[c], y[c], mask[c], eta)
    deltas.append(delta)
    weights.append(mask[c].sum())
  weights = np.asarray(weights, np.float64) / np.sum(weights)
  for j in range(m):
    w = comps[j]["w"] + sum(weights[c] * deltas[c][j][0] for c in range(clients))
    bias = comps[j]["b"] + sum(weights[c] * deltas[c][j][1] for c in range(clients))
    np.testing.assert_allclose(new.params["components"]["w"][j], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.params["components"]["b"][j], bias, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.mixture_weights, new_table, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.params["weights"], new_table.mean(0), rtol=1e-5)
  np.testing.assert_allclose(new.metrics["component_share"], new_table[ids].mean(0), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(new.mixture_weights).sum(1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("client_map", ["vmap", "sequential"])
def test_the_e_step_reads_every_train_example_of_a_sampled_client(client_map):
  """Algorithm 1's π over all n_t train examples (not the round's slots), from `sample_round(deferred=True)`."""
  rng = np.random.default_rng(11)
  m, s, b, eta = 2, 2, 3, 0.3
  sizes = [14, 4, 9, 20, 7]  # most larger than the round's S·B = 6 slots
  comps = [{"w": rng.normal(size=(D, K)), "b": rng.normal(size=K) * 0.3} for _ in range(m)]
  train = [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.integers(0, K, n)} for n in sizes]
  test = [{"x": rng.normal(size=(3, D)).astype(np.float32), "y": rng.integers(0, K, 3)} for _ in sizes]
  dataset = fo.data.pack(train, test_clients=test)
  table = rng.dirichlet(np.ones(m), size=len(sizes))
  batches = fo.data.sample_round(jax.random.key(4), dataset, 3, s, b, deferred=True)
  start = {"components": _stack(comps), "weights": jnp.full((m,), 0.5)}

  def one_round(e_step, data):
    algo = fo.algorithms.fedem(ce_loss, num_components=m, num_clients=len(sizes), client_optimizer=optax.sgd(eta),
                               e_step=e_step, client_map=client_map)
    state = algo.init(start, jax.random.key(0)).replace(mixture_weights=jnp.asarray(table, jnp.float32))
    return jax.jit(algo.step)(state, batches.replace(data=data))

  new = one_round("auto", batches.data)
  eager = fo.core.materialize(batches.data)
  x, y = np.asarray(eager["x"], np.float64), np.asarray(eager["y"])
  ids, mask, weight = np.asarray(batches.client_id), np.asarray(batches.mask), np.asarray(batches.weight)
  deltas, want, slots_pi = [], table.copy(), table.copy()
  for c, t in enumerate(ids):
    delta, slots_pi[t] = np_client_step(comps, table[t], x[c], y[c], mask[c], eta)
    deltas.append(delta)
    want[t] = np_estep(comps, table[t], train[t]["x"].astype(np.float64), train[t]["y"]).mean(0)
  share = weight / weight.sum()
  for j in range(m):
    w = comps[j]["w"] + sum(share[c] * deltas[c][j][0] for c in range(len(ids)))
    np.testing.assert_allclose(new.params["components"]["w"][j], w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.mixture_weights, want, rtol=1e-5, atol=1e-6)
  assert np.abs(want[ids] - slots_pi[ids]).max() > 0.01  # the round's slots alone give another π
  local = one_round("local", batches.data)
  np.testing.assert_allclose(local.mixture_weights, new.mixture_weights, rtol=1e-6, atol=1e-7)
  # The minibatch form: on the same deferred data, and what "auto" does with hand-built arrays.
  for form in (one_round("round", batches.data), one_round("auto", eager)):
    np.testing.assert_allclose(form.mixture_weights, slots_pi, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(form.params["components"]["w"], new.params["components"]["w"], rtol=1e-6)
  with pytest.raises(ValueError, match="fedem: e_step='local' reads every client's train split"):
    one_round("local", eager)
  with pytest.raises(ValueError, match="e_step must be one of"):
    fo.algorithms.fedem(ce_loss, num_components=m, num_clients=5, client_optimizer=optax.sgd(eta), e_step="all")


def test_one_component_is_fedavg():
  rng = np.random.default_rng(2)
  _, x, y, _ = _random_problem(rng, 1, 4, 3, 5)
  params = {"w": jnp.asarray(rng.normal(size=(D, K)), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
  batches = fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y)},
                             mask=jnp.ones((4, 3, 5), bool), weight=jnp.full((4,), 15.0),
                             client_id=jnp.arange(4, dtype=jnp.int32))
  em = fo.algorithms.fedem(ce_loss, num_components=1, num_clients=4, client_optimizer=optax.sgd(0.2),
                           server_optimizer=optax.adam(0.05))
  avg = fo.algorithms.fedavg(ce_loss, client_optimizer=optax.sgd(0.2), server_optimizer=optax.adam(0.05))
  a, b = em.init(params, jax.random.key(0)), avg.init(params, jax.random.key(0))
  for _ in range(3):
    a, b = jax.jit(em.step)(a, batches), jax.jit(avg.step)(b, batches)
  for k in ("w", "b"):
    np.testing.assert_allclose(a.params["components"][k][0], b.params[k], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(a.mixture_weights, 1.0)
  assert float(a.metrics["client_loss"]) == pytest.approx(float(b.metrics["client_loss"]), rel=0.2)


def test_personalize_is_em_on_the_mixture_weights_with_fixed_components():
  rng = np.random.default_rng(3)
  comps, x, y, _ = _random_problem(rng, 3, 1, 2, 6)
  algo = fo.algorithms.fedem(ce_loss, num_components=3, num_clients=2, client_optimizer=optax.sgd(0.1), em_iterations=7)
  mask = np.ones((2, 6), bool)
  mask[1, 4:] = False
  out = jax.jit(algo.personalize)({"components": _stack(comps), "weights": jnp.full((3,), 1 / 3)},
                                  {"x": jnp.asarray(x[0], jnp.float32), "y": jnp.asarray(y[0])}, jnp.asarray(mask))
  pi = np.full(3, 1 / 3)
  for _ in range(7):
    pi = np_estep(comps, pi, x[0], y[0])[mask].mean(0)
  np.testing.assert_allclose(out["weights"], pi, rtol=1e-5, atol=1e-6)


def _planted_mixture(seed, clients=8, per_client=200, test_per_client=200):
  """Two teachers that label x differently; client t draws each example from teacher A with probability π_tA."""
  rng = np.random.default_rng(seed)
  teachers = [rng.normal(size=(D, K)) * 3 for _ in range(2)]
  planted = np.array([0.9, 0.1, 0.75, 0.25, 0.6, 0.4, 1.0, 0.0])[:clients]

  def draw(n):
    x = rng.normal(size=(clients, n, D))
    z = rng.random((clients, n)) >= planted[:, None]  # True: teacher B
    y = np.where(z, np.argmax(x @ teachers[1], -1), np.argmax(x @ teachers[0], -1))
    return x.astype(np.float32), y.astype(np.int32)

  train, test = draw(per_client), draw(test_per_client)
  xt, yt = test  # the Bayes-optimal client predicts the label of its more likely teacher
  best = np.where(planted[:, None] >= 0.5, np.argmax(xt @ teachers[0], -1), np.argmax(xt @ teachers[1], -1))
  return planted, train, test, float(np.mean(best == yt))


@pytest.mark.slow  # a convergence run
def test_a_planted_mixture_is_recovered_and_beats_fedavg():
  planted, (x, y), (xt, yt), bayes = _planted_mixture(0)
  clients, s = len(planted), 5
  data = {"x": jnp.asarray(x.reshape(clients, s, -1, D)), "y": jnp.asarray(y.reshape(clients, s, -1))}
  batches = fo.ClientBatches(data=data, mask=jnp.ones(data["y"].shape, bool),
                             weight=jnp.full((clients,), float(y.shape[1])), client_id=jnp.arange(clients))
  model = fo.models.Model(init=None, apply=lambda p, xx: xx @ p["w"] + p["b"], loss_fn=ce_loss, accuracy_fn=None,
                          name="logreg", input_shape=(D,), num_classes=K)
  params = {"w": jnp.zeros((D, K)), "b": jnp.zeros(K)}
  em = fo.algorithms.fedem(ce_loss, num_components=2, num_clients=clients, client_optimizer=optax.sgd(0.5))
  avg = fo.algorithms.fedavg(ce_loss, client_optimizer=optax.sgd(0.5))

  def run(algo):
    state = algo.init(params, jax.random.key(0))
    return jax.lax.scan(lambda st, _: (algo.step(st, batches), None), state, None, length=150)[0]

  em_state, avg_state = jax.jit(lambda: run(em))(), jax.jit(lambda: run(avg))()
  learned = np.asarray(em_state.mixture_weights)[:, 0]
  error = min(np.max(np.abs(learned - planted)), np.max(np.abs(1 - learned - planted)))  # up to relabelling
  assert error < 0.1, (learned, planted)
  mixture = fo.algorithms.fedem_mixture_model(model)
  em_acc = np.mean([np.mean(mixture.accuracy_fn(fo.algorithms.fedem_client_params(em_state, t),
                                                {"x": xt[t], "y": yt[t]})) for t in range(clients)])
  avg_acc = np.mean(fo.models.classification_accuracy(model.apply)(avg_state.params,
                                                                   {"x": xt.reshape(-1, D), "y": yt.reshape(-1)}))
  assert em_acc > avg_acc + 0.15, (em_acc, avg_acc, bayes)
  assert em_acc > bayes - 0.05, (em_acc, bayes)  # close to the best any client can do with its π


def test_a_non_finite_client_keeps_its_weights_and_spreads_nothing():
  rng = np.random.default_rng(4)
  comps, x, y, _ = _random_problem(rng, 2, 3, 2, 4)
  x[1, 0, 0, 0] = np.nan
  algo = fo.algorithms.fedem(ce_loss, num_components=2, num_clients=3, client_optimizer=optax.sgd(0.1))
  state = algo.init({"components": _stack(comps), "weights": jnp.full((2,), 0.5)}, jax.random.key(0))
  batches = fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y)},
                             mask=jnp.ones((3, 2, 4), bool), weight=jnp.full((3,), 8.0),
                             client_id=jnp.arange(3, dtype=jnp.int32))
  new = jax.jit(algo.step)(state, batches)
  assert int(new.metrics["num_nonfinite"]) == 1 and int(new.metrics["num_clients"]) == 2
  np.testing.assert_array_equal(new.mixture_weights[1], [0.5, 0.5])
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(new.params))
  assert not np.allclose(new.mixture_weights[0], 0.5)


def test_init_makes_distinct_components_or_takes_given_ones_and_checks_arguments():
  algo = fo.algorithms.fedem(ce_loss, num_components=3, num_clients=2, client_optimizer=optax.sgd(0.1))
  state = algo.init({"w": jnp.zeros((D, K)), "b": jnp.zeros(K)}, jax.random.key(0))
  w = np.asarray(state.params["components"]["w"])
  assert w.shape == (3, D, K) and all(not np.allclose(w[i], w[j]) for i, j in itertools.combinations(range(3), 2))
  np.testing.assert_allclose(state.params["weights"], 1 / 3)
  with pytest.raises(ValueError, match="must have shape \\[3\\]"):
    algo.init({"components": state.params["components"], "weights": jnp.ones(2)}, jax.random.key(0))
  with pytest.raises(ValueError, match="num_components must be a Python int >= 1"):
    fo.algorithms.fedem(ce_loss, num_components=0, num_clients=2, client_optimizer=optax.sgd(0.1))
  with pytest.raises(TypeError, match="client_optimizer"):
    fo.algorithms.fedem(ce_loss, num_components=2, num_clients=2, client_optimizer=0.1)


# ---- D-FedEM --------------------------------------------------------------------------------------------------


def _node_batches(x, y, mask=None):
  n = x.shape[0]
  mask = np.ones(y.shape, bool) if mask is None else mask
  return fo.ClientBatches(data={"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray(mask.sum((1, 2)), jnp.float32), client_id=jnp.arange(n, dtype=jnp.int32))


def test_d_fedem_round_on_a_ring_is_the_numpy_transcription():
  """Every node: FedEM's client step from its own Θ_t, π_t; then Θ ← W(Θ + Δ), Metropolis–Hastings weights."""
  rng = np.random.default_rng(5)
  m, n, s, b, eta = 2, 5, 2, 3, 0.3
  comps, x, y, _ = _random_problem(rng, m, n, s, b)
  node_comps = [[{k: v + 0.1 * rng.normal(size=v.shape) for k, v in c.items()} for c in comps] for _ in range(n)]
  pis = rng.dirichlet(np.ones(m), size=n)
  w = fo.graphs.metropolis_hastings(fo.graphs.ring(n))
  algo = fo.algorithms.d_fedem(ce_loss, num_components=m, graph=w, client_optimizer=optax.sgd(eta))
  state = algo.init({"components": _stack(comps), "weights": jnp.full((m,), 0.5)}, jax.random.key(0))
  table = {"components": {k: jnp.asarray(np.stack([[c[k] for c in node] for node in node_comps]), jnp.float32)
                          for k in ("w", "b")}, "weights": jnp.asarray(pis, jnp.float32)}
  state = state.replace(local_params=table)
  new = jax.jit(algo.step)(state, _node_batches(x, y))
  adapted, new_pis = [], []
  for t in range(n):
    delta, pi = np_client_step(node_comps[t], pis[t], x[t], y[t], np.ones((s, b), bool), eta)
    adapted.append([(node_comps[t][j]["w"] + delta[j][0], node_comps[t][j]["b"] + delta[j][1]) for j in range(m)])
    new_pis.append(pi)
  for t in range(n):
    for j in range(m):
      expect_w = sum(w[t, u] * adapted[u][j][0] for u in range(n))
      expect_b = sum(w[t, u] * adapted[u][j][1] for u in range(n))
      np.testing.assert_allclose(new.local_params["components"]["w"][t, j], expect_w, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(new.local_params["components"]["b"][t, j], expect_b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.local_params["weights"], np.stack(new_pis), rtol=1e-5, atol=1e-6)
  one = fo.personalized_params(new, 3)
  np.testing.assert_allclose(one["weights"], new_pis[3], rtol=1e-5)
  assert float(new.metrics["bytes_sent"]) == 2 * m * (D * K + K) * 4  # two neighbours, M components each


def test_d_fedem_e_step_reads_every_train_example_of_each_node():
  rng = np.random.default_rng(12)
  m, sizes = 2, [10, 3, 8, 12]
  comps = [{"w": rng.normal(size=(D, K)), "b": rng.normal(size=K) * 0.3} for _ in range(m)]
  train = [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.integers(0, K, n)} for n in sizes]
  dataset = fo.data.pack(train)
  batches = fo.data.sample_round(jax.random.key(1), dataset, 4, 1, 2, client_sampling="all", deferred=True)
  pis = rng.dirichlet(np.ones(m), size=4)
  for e_step, local in (("auto", True), ("round", False)):
    algo = fo.algorithms.d_fedem(ce_loss, num_components=m, graph=fo.graphs.ring(4),
                                 client_optimizer=optax.sgd(0.1), e_step=e_step)
    state = algo.init({"components": _stack(comps), "weights": jnp.full((m,), 0.5)}, jax.random.key(0))
    state = state.replace(local_params={**state.local_params, "weights": jnp.asarray(pis, jnp.float32)})
    new = jax.jit(algo.step)(state, batches)
    eager = fo.core.materialize(batches.data)
    for t in range(4):
      if local:
        x, y = train[t]["x"], train[t]["y"]
      else:
        keep = np.asarray(batches.mask)[t]
        x, y = np.asarray(eager["x"])[t][keep], np.asarray(eager["y"])[t][keep]
      want = np_estep(comps, pis[t], x.astype(np.float64), y).mean(0)
      np.testing.assert_allclose(new.local_params["weights"][t], want, rtol=1e-5, atol=1e-6)


def test_d_fedem_on_the_complete_uniform_graph_is_fedem():
  rng = np.random.default_rng(6)
  comps, x, y, _ = _random_problem(rng, 2, 4, 2, 5)
  start = {"components": _stack(comps), "weights": jnp.full((2,), 0.5)}
  batches = _node_batches(x, y)
  central = fo.algorithms.fedem(ce_loss, num_components=2, num_clients=4, client_optimizer=optax.sgd(0.2))
  decentral = fo.algorithms.d_fedem(ce_loss, num_components=2, graph=np.full((4, 4), 0.25),
                                    client_optimizer=optax.sgd(0.2))
  a, b = central.init(start, jax.random.key(0)), decentral.init(start, jax.random.key(0))
  for _ in range(3):
    a, b = jax.jit(central.step)(a, batches), jax.jit(decentral.step)(b, batches)
  for k in ("w", "b"):
    for t in range(4):
      np.testing.assert_allclose(b.local_params["components"][k][t], a.params["components"][k], rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(b.local_params["weights"], a.mixture_weights, rtol=1e-5, atol=1e-6)
  assert float(b.metrics["consensus_distance"]) < 1e-10


def test_d_fedem_cuts_a_non_finite_node_out_and_keeps_its_rows():
  rng = np.random.default_rng(7)
  comps, x, y, _ = _random_problem(rng, 2, 4, 2, 3)
  x[2, 1, 0, 1] = np.inf
  algo = fo.algorithms.d_fedem(ce_loss, num_components=2, graph=fo.graphs.ring(4), client_optimizer=optax.sgd(0.1))
  state = algo.init({"components": _stack(comps), "weights": jnp.full((2,), 0.5)}, jax.random.key(0))
  new = jax.jit(algo.step)(state, _node_batches(x, y))
  assert int(new.metrics["num_nonfinite"]) == 1
  for k in ("w", "b"):
    np.testing.assert_array_equal(new.local_params["components"][k][2], state.local_params["components"][k][2])
  np.testing.assert_array_equal(new.local_params["weights"][2], [0.5, 0.5])
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves((new.params, new.local_params)))


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_d_fedem_recovers_a_planted_mixture_on_a_ring():
  planted, (x, y), _, _ = _planted_mixture(0)
  n, s = len(planted), 5
  batches = _node_batches(x.reshape(n, s, -1, D), y.reshape(n, s, -1))
  algo = fo.algorithms.d_fedem(ce_loss, num_components=2, graph=fo.graphs.ring(n), client_optimizer=optax.sgd(0.5))
  state = algo.init({"w": jnp.zeros((D, K)), "b": jnp.zeros(K)}, jax.random.key(0))
  state = jax.jit(lambda st: jax.lax.scan(lambda z, _: (algo.step(z, batches), None), st, None, length=150)[0])(state)
  learned = np.asarray(state.local_params["weights"])[:, 0]
  error = min(np.max(np.abs(learned - planted)), np.max(np.abs(1 - learned - planted)))
  assert error < 0.1, (learned, planted)
