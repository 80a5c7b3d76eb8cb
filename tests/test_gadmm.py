"""GADMM and CQ-GGADMM reach the centralized optimum (normal equations, scipy L-BFGS) and save bits.

Compiling is most of these tests' time: results come back as NumPy (`_np`), states start from a jitted `init`
(`_init`), and hyper-parameter families run through one program with the values traced.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.core.prox import prox_least_squares
from fedjax_opt.algorithms.gadmm import cq_ggadmm, gadmm, stochastic_quantize
from conftest import (logistic_clients, lsq_loss, make_clients, pack, ridge_logistic_loss, ridge_logistic_objective,
                      ridge_logistic_optimum)

D = 3
L2 = 0.1


def _vec(params):
  return np.append(np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64))


def _rows(table):
  """A table {"w": [N, D], "b": [N]} as `[N, D + 1]`."""
  return np.column_stack([np.asarray(table["w"], np.float64), np.asarray(table["b"], np.float64)])


def _table(rows):
  return {"w": jnp.asarray(rows[:, :-1]), "b": jnp.asarray(rows[:, -1])}


def _zeros():
  return {"w": jnp.zeros(D), "b": jnp.zeros(())}


def _ridge_loss(params, batch):
  return lsq_loss(params, batch) + 0.5 * L2 * jnp.sum(jnp.square(params["w"]))


def _design(x):
  return np.hstack([x, np.ones((len(x), 1))])


def _centralized(clients, l2=0.0):
  """argmin Σ_n [(1/n_n) Σ ½(xᵀw + b − y)² + (l2/2)‖w‖²] from the normal equations, float64."""
  penalty = np.diag([l2] * D + [0.0])
  lhs = sum(_design(x).T @ _design(x) / len(x) + penalty for x, _ in clients)
  rhs = sum(_design(x).T @ y / len(y) for x, y in clients)
  return np.linalg.solve(lhs, rhs)


def _np(tree):
  """Every array leaf as NumPy (PRNG keys kept): the tests then index and compare without compiling eager ops."""
  return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else np.asarray(a), tree)


def _init(algo, key=0):
  """`algo.init` from zero params as one jitted program (eagerly, each of its ops would compile on its own)."""
  return jax.jit(lambda: algo.init(_zeros(), jax.random.key(key)))()


def _scan(algo, batches, iterations, key=0):
  """`iterations` steps from `algo.init` as one `lax.scan`: (final state, (metrics history, params history))."""

  def body(state, _):
    state = algo.step(state, batches)
    return state, (state.metrics, state.params)

  return jax.lax.scan(body, algo.init(_zeros(), jax.random.key(key)), None, length=iterations)


def _run(algo, batches, iterations, key=0):
  """The whole run (init included) as one jitted `lax.scan` over iterations; returns the final state and the
  metrics history, as NumPy."""
  return _np(jax.jit(lambda: _scan(algo, batches, iterations, key))())


@functools.cache
def _chain_solver(method, iterations=200):
  """Exact GADMM (`method="gadmm"`) or uncompressed, uncensored CQ-GGADMM (τ₀ = 0) on the chain of 6 workers
  (prox_least_squares, client_map="vmap") as one jitted `run(batches, rho)` with ρ traced, shared by the tests on
  `chain_clients`: (final state, (metrics history, params history))."""

  def run(batches, rho):
    if method == "gadmm":
      algo = gadmm(lsq_loss, rho, graph=fo.graphs.chain(6), prox=prox_least_squares(), client_map="vmap")
    else:
      algo = cq_ggadmm(lsq_loss, rho, 0.0, graph=fo.graphs.chain(6), bits=None, prox=prox_least_squares(),
                       client_map="vmap")
    return _scan(algo, batches, iterations)

  return jax.jit(run)


def _rel_err(got, want):
  return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want)


@pytest.fixture
def chain_clients(rng):
  """Six heterogeneous least-squares workers (unequal sizes, shifted inputs, own target models), padded."""
  clients = make_clients(rng, [8, 10, 6, 12, 9, 7], D)
  with jax.enable_x64(True):  # float64 device arrays (made outside the context they would be float32)
    return clients, pack(clients, 2, 6, extra_slots=1, dtype=np.float64)


def test_gadmm_on_a_chain_reaches_the_centralized_least_squares_solution(chain_clients):
  """Exact prox: every worker reaches argmin Σ_n f_n, and the duals satisfy the KKT condition ∇f_n = −(Bᵀλ)_n."""
  clients, batches = chain_clients
  n = len(clients)
  with jax.enable_x64(True):
    state, (history, _) = _np(_chain_solver("gadmm")(batches, 3.0))  # 200 iterations
    z_star = _centralized(clients)
    assert _rel_err(_vec(state.params), z_star) < 1e-6
    assert np.all(_rel_err(_rows(state.local_params), z_star) < 1e-6)  # all workers agree
    # KKT on the chain: (Bᵀλ)_n = λ_n − λ_{n−1} (λ_{−1} = λ_{N−1} = 0) equals −∇f_n(θ*).
    lam = np.vstack([np.zeros(D + 1), _rows(state.duals), np.zeros(D + 1)])
    for k, (x, y) in enumerate(clients):
      grad = _design(x).T @ (_design(x) @ z_star - y) / len(y)
      np.testing.assert_allclose(lam[k + 1] - lam[k], -grad, atol=1e-8)
    objective = sum(np.mean(0.5 * (_design(x) @ z_star - y) ** 2) for x, y in clients)
    np.testing.assert_allclose(float(history["objective"][-1]), objective, rtol=1e-6)
    assert history["primal_residual"][-1] < 1e-8 < history["primal_residual"][0]
    assert int(state.round) == 200 and state.transmitted is None
    # Every worker sends its float32 model once per iteration: N · 32 · P bits.
    np.testing.assert_array_equal(history["transmissions"], n)
    np.testing.assert_allclose(history["bits_cumulative"][-1], 200 * n * 32 * (D + 1))


def _numpy_gadmm_chain(thetas, lams, clients, rho, l2):
  """One GADMM iteration written from the paper's chain equations (Elgabli et al., JMLR 2020), float64.

  Head / tail n solves ∇f_n(θ) − λ_{n−1} + λ_n + ρ(θ − θ_{n−1}) + ρ(θ − θ_{n+1}) = 0 (terms of a missing
  neighbour dropped), heads (even n) first, then tails with the heads' new models; then λ_n += ρ(θ_n − θ_{n+1}).
  """
  thetas, lams = thetas.copy(), lams.copy()
  n = len(clients)
  penalty = np.diag([l2] * D + [0.0])
  for parity in (0, 1):
    new = {}
    for k in range(parity, n, 2):
      x, y = clients[k]
      a = _design(x)
      lhs, rhs = a.T @ a / len(a) + penalty, a.T @ y / len(y)
      if k > 0:
        lhs, rhs = lhs + rho * np.eye(D + 1), rhs + lams[k - 1] + rho * thetas[k - 1]
      if k < n - 1:
        lhs, rhs = lhs + rho * np.eye(D + 1), rhs - lams[k] + rho * thetas[k + 1]
      new[k] = np.linalg.solve(lhs, rhs)
    for k, v in new.items():
      thetas[k] = v
  for k in range(n - 1):
    lams[k] = lams[k] + rho * (thetas[k] - thetas[k + 1])
  return thetas, lams


def test_iterations_match_the_papers_chain_equations_in_numpy(chain_clients, rng):
  """Three iterations from a random state (models, duals) agree with a float64 NumPy transcription of the paper."""
  clients, batches = chain_clients
  n, rho = len(clients), 0.7
  thetas, lams = rng.normal(size=(n, D + 1)), rng.normal(size=(n - 1, D + 1))
  with jax.enable_x64(True):
    algo = gadmm(_ridge_loss, rho, graph=fo.graphs.chain(n), prox=prox_least_squares(L2), client_map="vmap")
    state = _init(algo).replace(local_params=_table(thetas), duals=_table(lams))
    step = jax.jit(algo.step)
    for _ in range(3):
      state = step(state, batches)
      thetas, lams = _numpy_gadmm_chain(thetas, lams, clients, rho, L2)
      np.testing.assert_allclose(_rows(state.local_params), thetas, rtol=1e-10, atol=1e-12)
      np.testing.assert_allclose(_rows(state.duals), lams, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_vec(state.params), thetas.mean(0), rtol=1e-10)
    diffs = np.array([thetas[k] - thetas[k + 1] for k in range(n - 1)])
    np.testing.assert_allclose(float(state.metrics["primal_residual"]), np.linalg.norm(diffs), rtol=1e-6)


def _numpy_censored_iteration(graph, thetas, sent, lams, clients, rho, threshold, *, scale=None, frozen=(),
                              quantize=None, disagreements=None):
  """One censored GGADMM iteration on a bipartite graph, float64, from Issaid et al. 2020.

  Worker n solves c_n ∇f_n(θ) + Σ_{e=(n,j)} λ_e − Σ_{e=(i,n)} λ_e + ρ Σ_{m∈N(n)} (θ − θ̂_m) = 0 with the
  neighbours' transmitted θ̂_m (group 0 first; c_n = `scale[n]`, 1 when None), forms Q_n = θ̂_n + q(θ_n − θ̂_n, n)
  (q = `quantize`, the identity when None) and transmits (θ̂_n ← Q_n) iff ‖Q_n − θ̂_n‖ ≥ threshold;
  λ_e += ρ(θ̂_i − θ̂_j).
  Workers in `frozen` (a non-finite update) keep θ_n and θ̂_n, and their edges keep λ_e. `disagreements`: a list
  to which the number of workers whose decision on the unquantized ‖θ_n − θ̂_n‖ would differ is appended.
  """
  thetas, sent, lams = thetas.copy(), sent.copy(), lams.copy()
  colour = fo.graphs.two_coloring(graph)
  sent_count, differ = 0, 0
  for group in (0, 1):
    for k in np.flatnonzero(colour == group):
      if k in frozen:
        continue
      x, y = clients[k]
      a = _design(x)
      c = 1.0 if scale is None else scale[k]
      lhs, rhs = c * a.T @ a / len(a), c * a.T @ y / len(y)
      for e, (i, j) in enumerate(graph.edges):
        if k in (i, j):
          other = j if k == i else i
          lhs = lhs + rho * np.eye(D + 1)
          rhs = rhs + rho * sent[other] - (lams[e] if k == i else -lams[e])
      thetas[k] = np.linalg.solve(lhs, rhs)
      change = thetas[k] - sent[k] if quantize is None else quantize(thetas[k] - sent[k], k)
      differ += (np.linalg.norm(change) >= threshold) != (np.linalg.norm(thetas[k] - sent[k]) >= threshold)
      if np.linalg.norm(change) >= threshold:
        sent[k], sent_count = thetas[k] if quantize is None else sent[k] + change, sent_count + 1
  for e, (i, j) in enumerate(graph.edges):
    if i not in frozen and j not in frozen:
      lams[e] = lams[e] + rho * (sent[i] - sent[j])
  if disagreements is not None:
    disagreements.append(differ)
  return thetas, sent, lams, sent_count


def _random_bipartite_start(rng):
  """The random bipartite graph of the censoring tests, its workers' data and a random start θ, θ̂, λ."""
  graph = fo.graphs.random_bipartite(3, 4, 0.4, seed=3)
  clients = make_clients(rng, list(rng.integers(5, 12, graph.num_nodes)), D)
  thetas = rng.normal(size=(graph.num_nodes, D + 1))
  sent = thetas + 0.5 * rng.normal(size=(graph.num_nodes, D + 1))
  return graph, clients, thetas, sent, rng.normal(size=(graph.num_edges, D + 1))


def _assert_tables(state, thetas, lams, sent=None):
  """θ, λ (and θ̂ when `sent` is given) of `state` equal the NumPy reference's to 1e-9."""
  np.testing.assert_allclose(_rows(state.local_params), thetas, rtol=1e-9, atol=1e-11)
  np.testing.assert_allclose(_rows(state.duals), lams, rtol=1e-9, atol=1e-11)
  if sent is not None:
    np.testing.assert_allclose(_rows(state.transmitted), sent, rtol=1e-9, atol=1e-11)


def test_censored_iteration_on_a_bipartite_graph_matches_numpy(rng):
  """Censoring without quantization (deterministic): workers below τ₀ξ^k keep their old θ̂ and send nothing."""
  graph, clients, thetas, sent, lams = _random_bipartite_start(rng)
  n, rho, tau0, xi = graph.num_nodes, 0.8, 2.0, 0.5
  with jax.enable_x64(True):
    batches = pack(clients, 2, 6, dtype=np.float64)
    algo = cq_ggadmm(lsq_loss, rho, tau0, xi, graph=graph, bits=None, prox=prox_least_squares(),
                     client_map="vmap")
    state = _init(algo).replace(
        local_params=_table(thetas), transmitted=_table(sent), duals=_table(lams))
    step = jax.jit(algo.step)
    counts = []
    for k in range(3):
      state = step(state, batches)
      thetas, sent, lams, count = _numpy_censored_iteration(graph, thetas, sent, lams, clients, rho, tau0 * xi**k)
      counts.append(count)
      _assert_tables(state, thetas, lams, sent)
      assert int(state.metrics["transmissions"]) == count
      np.testing.assert_allclose(float(state.metrics["censor_threshold"]), tau0 * xi**k, rtol=1e-6)
    assert 0 < min(counts) and max(counts[:2]) < n  # censoring really silenced some workers, not all
    assert int(state.metrics["transmissions_cumulative"]) == sum(counts)
    np.testing.assert_allclose(float(state.metrics["bits_cumulative"]), sum(counts) * 32 * (D + 1))


def _nearest_levels(x, bits, xp, radius=None):
  """Deterministic b-bit quantizer for the tests: each coordinate rounded to the nearest of the 2^b levels
  −R + lΔ over [−R, R], R = max|x| (or `radius`), Δ = 2R/(2^b − 1) (the stochastic quantizer's grid, no coin)."""
  radius = xp.max(xp.abs(x)) if radius is None else radius
  spacing = 2 * radius / (2**bits - 1)
  safe = xp.where(radius > 0, spacing, 1.0)
  return xp.where(radius > 0, xp.round((x + radius) / safe) * spacing - radius, 0.0)


def test_cq_ggadmm_censors_the_quantized_change_against_the_decaying_threshold(rng, monkeypatch):
  """Issaid et al. 2020: worker n transmits iff ‖Q_n − θ̂_n‖ ≥ τ₀ξ^k, Q_n = θ̂_n + Q_b(θ_n − θ̂_n), k = 0, 1, ….

  The quantizer is made deterministic (nearest level of the same 2^b grid, patched in for
  `fo.compression.range_quantize`, which `bits=b` builds), so
  six iterations compare (to 1e-9) with a float64 NumPy transcription: θ, θ̂, λ, the transmissions, the threshold. On this run the rule on the unquantized change ‖θ_n − θ̂_n‖ decides differently at least once, so
  censoring the wrong difference fails the test (as does a shifted schedule τ₀ξ^{k+1})."""
  compression = importlib.import_module("fedjax_opt.compression")
  bits = 2

  def nearest(b):  # stands in for range_quantize(b): one R over the whole pytree, the same bit count, no coin
    count = lambda x: b * compression.num_entries(x) + 32

    def compress(key, x):
      radius = jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in jax.tree.leaves(x)]))
      return jax.tree.map(lambda leaf: _nearest_levels(leaf, b, jnp, radius), x), jnp.asarray(count(x), jnp.float32)

    return compression.Compressor(f"nearest(b={b})", compress, False, count)

  monkeypatch.setattr(compression, "range_quantize", nearest)
  graph, clients, thetas, sent, lams = _random_bipartite_start(rng)
  n, rho, tau0, xi = graph.num_nodes, 0.8, 1.5, 0.9
  with jax.enable_x64(True):
    batches = pack(clients, 2, 6, dtype=np.float64)
    algo = cq_ggadmm(lsq_loss, rho, tau0, xi, graph=graph, bits=bits, prox=prox_least_squares(), client_map="vmap")
    state = _init(algo).replace(
        local_params=_table(thetas), transmitted=_table(sent), duals=_table(lams))
    step = jax.jit(algo.step)
    counts, differ = [], []
    for k in range(6):
      state = step(state, batches)
      thetas, sent, lams, count = _numpy_censored_iteration(
          graph, thetas, sent, lams, clients, rho, tau0 * xi**k, quantize=lambda v, _: _nearest_levels(v, bits, np),
          disagreements=differ)
      counts.append(count)
      _assert_tables(state, thetas, lams, sent)
      assert int(state.metrics["transmissions"]) == count, (k, count)
      np.testing.assert_allclose(float(state.metrics["censor_threshold"]), tau0 * xi**k, rtol=1e-6)
    assert sum(differ) >= 1, differ  # the quantized and the unquantized rule really disagree on this run
    assert 0 < sum(counts) < 6 * n, counts  # censoring silenced some messages, not all
    np.testing.assert_allclose(float(state.metrics["bits_cumulative"]), sum(counts) * (bits * (D + 1) + 32))


def _worker_keys(graph, state_key):
  """Worker n's compression key in the iteration that starts from `state.key` = `state_key` (`cq_ggadmm`'s
  docstring): split(k_g, G)[i], k_g = split(split(state_key)[1])[g] for its colour g, i its place in its group of G."""
  colour = fo.graphs.two_coloring(graph)
  group_keys = jax.random.split(jax.random.split(state_key)[1])
  keys = {}
  for g in (0, 1):
    members = np.flatnonzero(colour == g)
    keys.update(zip(members.tolist(), jax.random.split(group_keys[g], len(members))))
  return keys


def _numpy_range_quantize(v, bits, key):
  """`fo.compression.range_quantize(bits)` of the change v = [w, b] (P = D + 1), float64 NumPy from its docstring:
  R = max|v_j|, Δ = 2R/(2^b − 1), t_j = (v_j + R)/Δ, level ⌊t_j⌋ + [u_j < t_j − ⌊t_j⌋], value −R + level·Δ. Only the
  coins u come from JAX: leaf l's from split(key, L)[l], the leaves ("b", "w") in `jax.tree.leaves` order."""
  key_b, key_w = jax.random.split(key)
  u = np.append(np.asarray(jax.random.uniform(key_w, (D,), jnp.float64)),
                np.asarray(jax.random.uniform(key_b, (), jnp.float64)))
  radius, top = np.abs(v).max(), 2**bits - 1
  if radius == 0:
    return np.zeros_like(v)
  spacing = 2 * radius / top
  t = (v + radius) / spacing
  low = np.floor(t)
  return np.clip(low + (u < t - low), 0, top) * spacing - radius


def test_bits_shorthand_matches_numpy_with_the_same_coins(rng):
  """`bits=2` (the paper's quantizer, `range_quantize(2)`) with censoring, four iterations on a bipartite graph:
  θ, θ̂, λ, transmissions and bits equal a float64 NumPy transcription whose quantizer uses the same coins (drawn
  from the documented keys); a message is b·P + 32 bits."""
  graph, clients, thetas, sent, lams = _random_bipartite_start(rng)
  n, p, rho, tau0, xi, bits = graph.num_nodes, D + 1, 0.8, 1.5, 0.9, 2
  with jax.enable_x64(True):
    batches = pack(clients, 2, 6, dtype=np.float64)
    algo = cq_ggadmm(lsq_loss, rho, tau0, xi, graph=graph, bits=bits, prox=prox_least_squares(), client_map="vmap")
    state = _init(algo).replace(local_params=_table(thetas), transmitted=_table(sent), duals=_table(lams))
    step = jax.jit(algo.step)
    counts = []
    for k in range(4):
      keys = _worker_keys(graph, state.key)
      state = step(state, batches)
      thetas, sent, lams, count = _numpy_censored_iteration(
          graph, thetas, sent, lams, clients, rho, tau0 * xi**k,
          quantize=lambda v, worker: _numpy_range_quantize(v, bits, keys[worker]))
      counts.append(count)
      _assert_tables(state, thetas, lams, sent)
      assert int(state.metrics["transmissions"]) == count
      assert float(state.metrics["bits"]) == count * (bits * p + 32)
    assert 0 < sum(counts) < 4 * n, counts  # censoring silenced some messages, not all


def _former_stochastic_quantize(key, x, bits):
  """`gadmm.stochastic_quantize` as it was before the quantizer became `fo.compression.range_quantize` (verbatim)."""
  leaves, treedef = jax.tree.flatten(x)
  radius = jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in leaves]))
  levels = float(2**bits - 1)
  spacing = 2 * radius / levels
  safe = jnp.where(radius > 0, spacing, 1)
  keys = jax.random.split(key, len(leaves))
  out = []
  for leaf, k in zip(leaves, keys):
    position = (leaf + radius) / safe
    low = jnp.floor(position)
    up = jax.random.uniform(k, leaf.shape, position.dtype) < position - low
    level = jnp.clip(low + up, 0, levels)
    out.append(jnp.where(radius > 0, level * spacing - radius, 0).astype(leaf.dtype))
  return jax.tree.unflatten(treedef, out)


# Chain of 4 (data and start from default_rng(7)), ρ = 0.8, τ₀ = 2, ξ = 0.9, bits=2, key 0: θ̂, θ, λ as [N, D + 1]
# rows after three iterations, from the code before `compressor=` existed (float64, CPU).
_FORMER_SENT = [[-0.7192452532365092, -1.275377153182428, -0.3783002401048494, 0.018487908969754274],
                [-0.3675527806594898, -1.1519433023708707, -0.6178197142561279, -0.3842600112955301],
                [0.2397570420916253, -0.13334802522547873, 0.6132893100501642, -0.8213945299548626],
                [-0.9047921262522984, 0.5026562264992519, 0.9373785229595812, -0.45239360124225436]]
_FORMER_THETA = [[-0.6114909504699354, -1.275377153182428, -0.41225609172134253, 0.2780287031301398],
                 [-0.0965163400165206, -0.7911839139518312, 0.3053435735258554, -0.46116621187611184],
                 [0.2397570420916253, 0.11767371993267414, 0.7246185641814274, -0.4839335581385471],
                 [-0.1327187058699947, -0.2911804613813505, 0.3816625929516742, -0.5318298254562254]]
_FORMER_DUALS = [[0.31440816187333365, -0.09036816770510643, 0.312463779202569, -0.9649634024186066],
                 [0.9075377356117039, -1.1859379913033308, -1.034615343252014, -0.3492346592125287],
                 [0.37838354334345314, -2.2642836017068526, -0.8328902860854673, -1.0445790879655952]]


@pytest.mark.slow  # several quantizer runs and two full CQ-GGADMM runs, compiled
def test_bits_shorthand_is_the_former_quantizer_bit_for_bit():
  """`range_quantize(b)` (and the `stochastic_quantize` alias) equals the former quantizer bit for bit (values and
  dtypes, mixed-dtype pytrees, b = 1 … 32); `bits=2` and `compressor=range_quantize(2)` give the same run bit for bit,
  and it is the run recorded before `compressor=` existed (to 1e-12: equal on the machine that recorded it)."""
  with jax.enable_x64(True):
    x = {"a": jnp.asarray([-2.0, 0.3, 2.0, -1.1]), "b": jnp.asarray([[0.7, -2.0]], jnp.float32),
         "c": jnp.asarray([1.9, -0.2, 0.05])}
    for tree in (x, jax.tree.map(lambda a: a.astype(jnp.float32), x)):
      for bits in (1, 2, 5, 32):
        compress = jax.jit(fo.compression.range_quantize(bits).compress)
        former = jax.jit(_former_stochastic_quantize, static_argnums=2)
        for seed in range(2):
          key = jax.random.key(seed)
          # jitted against jitted (as inside `cq_ggadmm`'s step), eager against eager (XLA may fuse differently)
          for got, want in ((compress(key, tree)[0], former(key, tree, bits)),
                            (stochastic_quantize(key, tree, bits), _former_stochastic_quantize(key, tree, bits))):
            got, want = _np(got), _np(want)
            assert [g.dtype for g in jax.tree.leaves(got)] == [w.dtype for w in jax.tree.leaves(want)]
            jax.tree.map(np.testing.assert_array_equal, got, want)

    rng = np.random.default_rng(7)
    clients = make_clients(rng, [5, 7, 6, 8], D)
    thetas, sent = (lambda t: (t, t + 0.5 * rng.normal(size=(4, D + 1))))(rng.normal(size=(4, D + 1)))
    lams = rng.normal(size=(3, D + 1))
    batches = pack(clients, 2, 4, dtype=np.float64)
    runs = []
    for option in (dict(bits=2), dict(compressor=fo.compression.range_quantize(2))):
      algo = cq_ggadmm(lsq_loss, 0.8, 2.0, 0.9, graph=fo.graphs.chain(4), prox=prox_least_squares(),
                       client_map="vmap", **option)
      state = _init(algo).replace(local_params=_table(thetas), transmitted=_table(sent), duals=_table(lams))
      history = []
      for _ in range(3):
        state = jax.jit(algo.step)(state, batches)
        history.append(state.metrics)
      runs.append(_np((state, history)))
  (state, history), (other, other_history) = runs
  for field in ("params", "local_params", "transmitted", "duals"):
    jax.tree.map(np.testing.assert_array_equal, getattr(state, field), getattr(other, field))
  jax.tree.map(np.testing.assert_array_equal, history, other_history)
  for table, want in ((state.transmitted, _FORMER_SENT), (state.local_params, _FORMER_THETA),
                      (state.duals, _FORMER_DUALS)):
    np.testing.assert_allclose(_rows(table), want, rtol=1e-12, atol=1e-14)
  assert [int(m["transmissions"]) for m in history] == [2, 4, 2]
  assert [float(m["bits"]) for m in history] == [80.0, 160.0, 80.0]  # 2 · 4 + 32 = 40 per message


def test_a_qsgd_compressor_iteration_matches_numpy(rng):
  """`compressor=qsgd(bits=3)` (unbiased): Q_n = θ̂_n + C(θ_n − θ̂_n) with C's output drawn with worker n's key and
  plugged into the float64 NumPy iteration, two iterations (τ₀ = 0: everyone transmits); `bits` is the compressor's
  count per message (32 + 3P), `bits_up` its mean per worker, `bits_down` 2E messages over N workers."""
  graph, clients, thetas, sent, lams = _random_bipartite_start(rng)
  n, rho = graph.num_nodes, 0.8
  compressor = fo.compression.qsgd(bits=3)
  per_message = compressor.bits(_zeros())
  assert per_message == 32 + 3 * (D + 1)
  with jax.enable_x64(True):
    batches = pack(clients, 2, 6, dtype=np.float64)
    algo = cq_ggadmm(lsq_loss, rho, 0.0, graph=graph, compressor=compressor, prox=prox_least_squares(),
                     client_map="vmap")
    state = _init(algo).replace(local_params=_table(thetas), transmitted=_table(sent), duals=_table(lams))
    step, compress = jax.jit(algo.step), jax.jit(compressor.compress)

    def quantize(v, worker):
      out = _np(compress(keys[worker], {"w": jnp.asarray(v[:-1]), "b": jnp.asarray(v[-1])})[0])
      return np.append(out["w"], out["b"])

    for _ in range(2):
      keys = _worker_keys(graph, state.key)
      state = step(state, batches)
      thetas, sent, lams, count = _numpy_censored_iteration(graph, thetas, sent, lams, clients, rho, 0.0,
                                                            quantize=quantize)
      _assert_tables(state, thetas, lams, sent)
      assert count == n == int(state.metrics["transmissions"])
      assert float(state.metrics["bits"]) == n * per_message
      np.testing.assert_allclose(float(state.metrics["bits_up"]), per_message, rtol=1e-7)
      np.testing.assert_allclose(float(state.metrics["bits_down"]), 2 * graph.num_edges * per_message / n, rtol=1e-7)
    assert not np.allclose(sent, thetas)  # the messages really are quantized


def _centralized_pooled(clients):
  """argmin (1/n) Σ_all ½(xᵀw + b − y)² over the pooled examples (normal equations, float64)."""
  a = np.vstack([_design(x) for x, _ in clients])
  y = np.concatenate([y for _, y in clients])
  return np.linalg.solve(a.T @ a, a.T @ y)


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_examples_objective_reaches_the_pooled_solution_which_the_clients_objective_misses(rng):
  """Chain of 6, sizes 3 … 30: objective="examples" reaches the pooled normal equations to 1e-8 (objective metric =
  the pooled risk); the default "clients" reaches argmin Σ_n f_n, visibly away from it."""
  clients = make_clients(rng, [3, 30, 5, 22, 4, 12], D)
  pooled, per_worker = _centralized_pooled(clients), _centralized(clients)
  assert _rel_err(per_worker, pooled) > 0.05  # the two objectives really differ on these workers
  with jax.enable_x64(True):
    batches = pack(clients, 5, 6, extra_slots=1, dtype=np.float64)
    runs = {objective: _run(gadmm(lsq_loss, 2.0, graph=fo.graphs.chain(6), prox=prox_least_squares(),
                                  objective=objective, client_map="vmap"), batches, 300)
            for objective in ("examples", "clients")}
    state, (history, _) = runs["examples"]
    assert np.all(_rel_err(_rows(state.local_params), pooled) < 1e-8)
    risk = np.mean(np.concatenate([0.5 * (_design(x) @ pooled - y) ** 2 for x, y in clients]))
    np.testing.assert_allclose(float(history["objective"][-1]), risk, rtol=1e-6)
    clients_state, _ = runs["clients"]
    assert np.all(_rel_err(_rows(clients_state.local_params), per_worker) < 1e-8)
    assert np.all(_rel_err(_rows(clients_state.local_params), pooled) > 0.05)


def test_examples_objective_iterations_match_numpy_on_a_bipartite_graph(rng):
  """GGADMM with objective="examples": worker n's update is argmin c_n f_n + (ρ d_n/2)‖θ − v_n‖², c_n = N n_n / n
  (n_n counted from the mask, `batches.weight` ignored), three iterations against the NumPy transcription."""
  graph = fo.graphs.random_bipartite(3, 4, 0.4, seed=3)
  sizes = rng.integers(3, 25, graph.num_nodes)
  clients = make_clients(rng, list(sizes), D)
  n, rho = graph.num_nodes, 0.8
  scale = n * sizes / sizes.sum()
  thetas, lams = rng.normal(size=(n, D + 1)), rng.normal(size=(graph.num_edges, D + 1))
  with jax.enable_x64(True):
    batches = pack(clients, 5, 5, extra_slots=1, dtype=np.float64).replace(weight=jnp.asarray(np.ones(n)))
    algo = cq_ggadmm(lsq_loss, rho, 0.0, graph=graph, bits=None, prox=prox_least_squares(), objective="examples",
                     client_map="vmap")
    state = _init(algo).replace(
        local_params=_table(thetas), transmitted=_table(thetas), duals=_table(lams))
    step = jax.jit(algo.step)
    sent = thetas
    for _ in range(3):
      state = step(state, batches)
      thetas, sent, lams, _ = _numpy_censored_iteration(graph, thetas, sent, lams, clients, rho, 0.0, scale=scale)
      _assert_tables(state, thetas, lams)


@pytest.mark.parametrize("method", ["gadmm", "cq_ggadmm"])
def test_a_worker_with_nan_data_never_spreads(rng, method):
  """Worker 2's data holds a NaN, every iteration: it keeps θ_2 (and θ̂_2), its edges keep their duals, it is
  counted; its neighbours use its last finite transmitted model; everything else follows the NumPy iteration with
  worker 2 frozen (gadmm on a chain; censored GGADMM on a bipartite graph), and every state entry stays finite."""
  bad = 2
  if method == "gadmm":
    graph, tau0, xi = fo.graphs.chain(6), 0.0, 0.5
  else:
    graph, tau0, xi = fo.graphs.random_bipartite(3, 4, 0.4, seed=3), 1.0, 0.5
  n, rho = graph.num_nodes, 0.8
  clients = make_clients(rng, list(rng.integers(5, 12, n)), D)
  thetas = rng.normal(size=(n, D + 1))
  sent = thetas if method == "gadmm" else thetas + 0.5 * rng.normal(size=(n, D + 1))
  lams = rng.normal(size=(graph.num_edges, D + 1))
  incident = [e for e, (i, j) in enumerate(graph.edges) if bad in (i, j)]
  with jax.enable_x64(True):
    batches = pack(clients, 2, 6, dtype=np.float64)
    x = np.array(batches.data["x"])
    x[bad, 1, 0, 1] = np.nan
    batches = batches.replace(data={**batches.data, "x": jnp.asarray(x)})
    if method == "gadmm":
      algo = gadmm(lsq_loss, rho, graph=graph, prox=prox_least_squares(), client_map="vmap")
      state = _init(algo).replace(local_params=_table(thetas), duals=_table(lams))
    else:
      algo = cq_ggadmm(lsq_loss, rho, tau0, xi, graph=graph, bits=None, prox=prox_least_squares(), client_map="vmap")
      state = _init(algo).replace(
          local_params=_table(thetas), transmitted=_table(sent), duals=_table(lams))
    step = jax.jit(algo.step)
    before = (thetas[bad].copy(), sent[bad].copy(), lams[incident].copy())
    for k in range(4):
      state = step(state, batches)
      thetas, sent, lams, count = _numpy_censored_iteration(graph, thetas, sent, lams, clients, rho, tau0 * xi**k,
                                                            frozen=(bad,))
      for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
          assert np.all(np.isfinite(np.asarray(leaf))), jax.tree_util.keystr(path)
      assert int(state.metrics["num_nonfinite"]) == 1 and int(state.metrics["transmissions"]) == count
      _assert_tables(state, thetas, lams, sent if method == "cq_ggadmm" else None)
    np.testing.assert_array_equal(_rows(state.local_params)[bad], before[0])
    if method == "cq_ggadmm":
      np.testing.assert_array_equal(_rows(state.transmitted)[bad], before[1])
    np.testing.assert_array_equal(_rows(state.duals)[incident], before[2])
    objective = sum(np.mean(0.5 * (_design(x) @ thetas[k] - y) ** 2) for k, (x, y) in enumerate(clients) if k != bad)
    np.testing.assert_allclose(float(state.metrics["objective"]), objective, rtol=1e-6)


_logistic_loss = ridge_logistic_loss(L2)


def test_inexact_gadmm_reaches_the_lbfgs_optimum_of_logistic_regression(rng):
  """K = 10 full-batch SGD steps per worker update (no closed form): every worker reaches scipy's optimum to 1e-4."""
  sizes = [20, 30, 25, 15]
  clients = logistic_clients(rng, sizes, D)
  ref = ridge_logistic_optimum(clients, L2)
  with jax.enable_x64(True):
    batches = pack(clients, 1, max(sizes), dtype=np.float64)
    algo = gadmm(_logistic_loss, 1.0, graph=fo.graphs.chain(len(sizes)), client_optimizer=optax.sgd(0.2),
                 local_steps=10)
    state, (history, _) = _run(algo, batches, 200)
    assert _rel_err(_vec(state.params), ref) < 1e-4, _rel_err(_vec(state.params), ref)
    assert np.all(_rel_err(_rows(state.local_params), ref) < 1e-4)
    np.testing.assert_allclose(float(history["objective"][-1]), ridge_logistic_objective(clients, L2, ref)[0], rtol=1e-6)


def _bits_to_reach(history, params, z_star, tol):
  err = _rel_err(_rows(params), z_star)
  assert np.any(err < tol), err.min()
  first = int(np.argmax(err < tol))
  return float(history["bits_cumulative"][first]), first


@pytest.mark.slow  # a convergence run (the round itself is checked against NumPy above)
def test_cq_ggadmm_reaches_the_optimum_on_a_random_bipartite_graph_with_fewer_bits(rng):
  """4-bit quantization + decaying censoring: same optimum as GGADMM, fewer bits and messages to reach 1e-4."""
  graph = fo.graphs.random_bipartite(4, 4, 0.3, seed=1)
  clients = make_clients(rng, list(rng.integers(6, 14, graph.num_nodes)), D)
  z_star = _centralized(clients)
  p = D + 1
  with jax.enable_x64(True):
    batches = pack(clients, 2, 8, dtype=np.float64)
    exact = dict(prox=prox_least_squares(), client_map="vmap")
    plain, (plain_hist, plain_params) = _run(
        cq_ggadmm(lsq_loss, 1.0, 0.0, graph=graph, bits=None, **exact), batches, 200)
    cq, (cq_hist, cq_params) = _run(
        cq_ggadmm(lsq_loss, 1.0, 1.0, 0.9, graph=graph, bits=4, **exact), batches, 200)
    for state in (plain, cq):
      assert np.all(_rel_err(_rows(state.local_params), z_star) < 1e-6)
    assert np.all(_rel_err(_rows(cq.transmitted), z_star) < 1e-6)  # what the neighbours know converges too
    plain_bits, plain_round = _bits_to_reach(plain_hist, plain_params, z_star, 1e-4)
    cq_bits, cq_round = _bits_to_reach(cq_hist, cq_params, z_star, 1e-4)
    assert cq_bits < 0.5 * plain_bits, (cq_bits, plain_bits)
    assert cq_round < 2 * plain_round  # a few more iterations, far fewer bits
    # Accounting: 32·P bits per plain message, b·P + 32 per quantized one; censoring skipped messages.
    np.testing.assert_allclose(plain_hist["bits"], plain_hist["transmissions"] * 32.0 * p)
    np.testing.assert_allclose(cq_hist["bits"], cq_hist["transmissions"] * (4.0 * p + 32))
    assert int(cq.metrics["transmissions_cumulative"]) < int(plain.metrics["transmissions_cumulative"])
    assert int(plain.metrics["transmissions_cumulative"]) == 200 * graph.num_nodes


@pytest.mark.parametrize("exact", [True, False])
def test_uncompressed_uncensored_cq_ggadmm_on_a_chain_is_gadmm(chain_clients, exact):
  _, batches = chain_clients
  graph = fo.graphs.chain(6)
  if exact:
    options = dict(prox=prox_least_squares(), client_map="vmap")
  else:
    options = dict(client_optimizer=optax.sgd(0.1), local_steps=3)
  with jax.enable_x64(True):
    if exact:  # 200 iterations: the programs of the chain test (ρ traced)
      (a, (a_hist, _)), (b, (b_hist, _)) = (_np(_chain_solver(method)(batches, 1.3)) for method in ("gadmm", "cq"))
    else:
      a, (a_hist, _) = _run(gadmm(lsq_loss, 1.3, graph=graph, **options), batches, 20)
      b, (b_hist, _) = _run(cq_ggadmm(lsq_loss, 1.3, 0.0, graph=graph, bits=None, **options), batches, 20)
    for field in ("params", "local_params", "duals"):
      jax.tree.map(np.testing.assert_array_equal, getattr(a, field), getattr(b, field))
    jax.tree.map(np.testing.assert_array_equal, b.transmitted, b.local_params)
    for metric in ("objective", "primal_residual", "bits_cumulative", "transmissions"):
      np.testing.assert_array_equal(a_hist[metric], b_hist[metric])


def test_stochastic_quantizer_is_unbiased_on_a_grid_of_2_to_the_b_levels(rng):
  """`fo.compression.range_quantize(3)`, checked in NumPy: 5000 copies of one vector share R = max|x|, so one call
  gives 5000 independent roundings of every entry: each on the grid −R + lΔ, one of its two nearest levels, the mean
  within 5 standard errors (Δ √(f(1 − f)/5000), f the entry's fractional level) of the entry; b·P + 32 bits."""
  copies, bits = 5000, 3
  a, b = rng.normal(size=(5,)), rng.normal(size=(2, 2))
  x = {"a": jnp.asarray(np.tile(a, (copies, 1))), "b": jnp.asarray(np.tile(b, (copies, 1, 1)))}
  compressor = fo.compression.range_quantize(bits)
  assert compressor.unbiased and compressor.name == "range_quantize(b=3)"
  quantize = jax.jit(compressor.compress)
  q, count = quantize(jax.random.key(0), x)
  assert float(count) == compressor.bits(x) == bits * copies * 9 + 32
  flat = np.concatenate([a, b.ravel()])
  qs = np.concatenate([np.asarray(q["a"]), np.asarray(q["b"]).reshape(copies, -1)], axis=1).astype(np.float64)
  radius = np.abs(flat).max()
  spacing = 2 * radius / (2**bits - 1)
  levels = (qs + radius) / spacing
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)  # on the grid −R + lΔ, l = 0 … 2^b − 1
  assert levels.min() > -1e-4 and levels.max() < 2**bits - 1 + 1e-4
  assert np.all(np.abs(qs - flat) <= spacing * (1 + 1e-5))  # one of the two nearest levels
  position = (flat + radius) / spacing
  fraction = position - np.floor(position)
  standard_error = spacing * np.sqrt(fraction * (1 - fraction) / copies)
  assert np.all(np.abs(qs.mean(0) - flat) <= 5 * standard_error + 1e-5 * spacing)  # unbiased (float32 slack)
  assert np.std(qs, axis=0).max() > 0.1 * spacing  # the rounding is random, not deterministic
  zero, _ = quantize(jax.random.key(1), jax.tree.map(jnp.zeros_like, x))  # same shapes: no recompile
  assert all(np.all(np.asarray(z) == 0) for z in jax.tree.leaves(zero))


def test_vmap_over_rho_runs_a_sweep_in_one_program(chain_clients):
  clients, batches = chain_clients
  rhos = np.array([1.0, 3.0, 5.0])
  graph = fo.graphs.chain(6)
  with jax.enable_x64(True):

    def solve(rho):
      algo = cq_ggadmm(lsq_loss, rho, 0.5, 0.9, graph=graph, bits=8, prox=prox_least_squares())
      state, (history, _) = _scan(algo, batches, 250)
      return state.params, history["primal_residual"]

    params, residuals = _np(jax.jit(jax.vmap(solve))(rhos))
    z_star = _centralized(clients)
    for i in range(len(rhos)):
      assert _rel_err(_vec(jax.tree.map(lambda a: a[i], params)), z_star) < 1e-6
    assert residuals.shape == (3, 250)
    assert not np.allclose(residuals[0, :5], residuals[2, :5])  # the three ρ really differ


def test_client_map_modes_agree(chain_clients):
  _, batches = chain_clients
  batches = jax.tree.map(lambda a: a.astype(np.float32) if a.dtype == np.float64 else a, batches)
  outs = []
  for mode in ["vmap", "sequential"]:
    algo = gadmm(lsq_loss, 1.0, graph=fo.graphs.chain(6), client_optimizer=optax.sgd(0.1), local_steps=3,
                 client_map=mode)
    state = algo.init({"w": jnp.zeros(D, jnp.float32), "b": jnp.zeros((), jnp.float32)}, jax.random.key(0))
    outs.append(_rows(jax.jit(algo.step)(state, batches).local_params))
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_bad_arguments(chain_clients):
  _, batches = chain_clients
  prox = prox_least_squares()
  chain = fo.graphs.chain(6)
  for rho in (0.0, -1.0, None):
    with pytest.raises(ValueError, match=r"rho \(ρ, the ADMM penalty\) must be"):
      gadmm(lsq_loss, rho, graph=chain, prox=prox)
  with pytest.raises(ValueError, match=r"graph must be bipartite .* edge \(\d, \d\) closes an odd cycle"):
    gadmm(lsq_loss, 1.0, graph=fo.graphs.ring(5), prox=prox)
  with pytest.raises(ValueError, match=r"graph must be connected .* 2 components"):
    cq_ggadmm(lsq_loss, 1.0, 0.0, graph=fo.graphs.from_edges([[0, 1], [2, 3]]), bits=4, prox=prox)
  with pytest.raises(ValueError, match=r"at least 2 workers"):
    gadmm(lsq_loss, 1.0, graph=fo.graphs.chain(1), prox=prox)
  with pytest.raises(ValueError, match=r"objective must be one of \('clients', 'examples'\); got 'pooled'"):
    cq_ggadmm(lsq_loss, 1.0, 0.0, graph=chain, bits=None, prox=prox, objective="pooled")
  with pytest.raises(TypeError, match=r"graph must be a fedjax_opt.graphs.Graph"):
    gadmm(lsq_loss, 1.0, graph=np.ones((3, 3)), prox=prox)
  with pytest.raises(ValueError, match=r"needs prox .* or client_optimizer"):
    gadmm(lsq_loss, 1.0, graph=chain)
  with pytest.raises(ValueError, match=r"local_steps must be a Python int >= 1; got 0"):
    gadmm(lsq_loss, 1.0, graph=chain, client_optimizer=optax.sgd(0.1), local_steps=0)
  for bits in (0, 33):
    with pytest.raises(ValueError, match=r"bits \(b, bits per quantized coordinate\) must .*; got"):
      cq_ggadmm(lsq_loss, 1.0, 0.0, graph=chain, bits=bits, prox=prox)
  with pytest.raises(TypeError, match=r"bits \(b, bits per quantized coordinate\) must be a Python int"):
    cq_ggadmm(lsq_loss, 1.0, 0.0, graph=chain, bits=2.5, prox=prox)
  refusals = [  # (error, message, keywords): each one line
      (ValueError, r"cq_ggadmm: give bits= \(shorthand for compressor=fo.compression.range_quantize\(bits\)\) or "
       r"compressor=, not both; got bits=4 and compressor=qsgd\(s=3\)\.", dict(bits=4, compressor=fo.compression.qsgd(
           bits=3))),
      (ValueError, r"not both; got bits=None and compressor=identity\.", dict(bits=None,
                                                                             compressor=fo.compression.identity())),
      (ValueError, r"cq_ggadmm: compressor top_k\(k=2\) is biased; CQ-GGADMM's analysis \(Issaid et al\. 2020\) needs "
       r"an unbiased quantizer", dict(compressor=fo.compression.top_k(k=2))),
      (ValueError, r"cq_ggadmm: compressor sign is biased", dict(compressor=fo.compression.sign())),
      (TypeError, r"cq_ggadmm: compressor must be a fo.compression.Compressor .*; got str\.", dict(compressor="qsgd")),
      (TypeError, r"cq_ggadmm: give bits=b .*, bits=None \(exact transmission\) or compressor=", {}),
  ]
  for error, message, keywords in refusals:
    with pytest.raises(error, match=message) as info:
      cq_ggadmm(lsq_loss, 1.0, 0.0, graph=chain, prox=prox, **keywords)
    assert "\n" not in str(info.value)
  for bits, error in ((0, ValueError), (33, ValueError), (2.5, TypeError)):
    with pytest.raises(error, match=r"range_quantize: bits must") as info:
      fo.compression.range_quantize(bits)
    assert "\n" not in str(info.value)
  cq_ggadmm(lsq_loss, 1.0, 0.0, graph=chain, prox=prox, compressor=fo.compression.rand_k(k=2))  # unbiased: taken
  for xi in (0.0, 1.0, 1.5, -0.2):
    with pytest.raises(ValueError, match=r"xi \(ξ, the censoring decay\) must lie in the open interval"):
      cq_ggadmm(lsq_loss, 1.0, 1.0, xi, graph=chain, bits=4, prox=prox)
  with pytest.raises(ValueError, match=r"tau0 \(τ₀, the censoring threshold\) must be finite and >= 0; got -0.1"):
    cq_ggadmm(lsq_loss, 1.0, -0.1, graph=chain, bits=4, prox=prox)
  with jax.enable_x64(True):
    algo = gadmm(lsq_loss, 1.0, graph=fo.graphs.chain(5), prox=prox)
    state = algo.init(_zeros(), jax.random.key(0))
    with pytest.raises(ValueError, match=r"num_clients = 5 clients \(full participation\); got C = 6"):
      algo.step(state, batches)
    algo = gadmm(lsq_loss, 1.0, graph=chain, prox=prox)
    state = algo.init(_zeros(), jax.random.key(0))
    shuffled = batches.replace(client_id=jnp.array([1, 0, 2, 3, 4, 5], jnp.int32))
    with pytest.raises(ValueError, match=r"client_id must be arange\(6\)"):
      algo.step(state, shuffled)


def test_stochastic_quantizer_keeps_the_extremes_and_each_leaf_dtype():
  """Q(x)_j = x_j exactly where x_j = ±R (the end levels l = 0 and 2^b − 1); three leaves (each gets its own
  rounding), a float32 leaf stays float32 under x64, and the levels stay within 0 … 2^b − 1."""
  with jax.enable_x64(True):
    x = {"a": jnp.asarray([-2.0, 0.3, 2.0, -1.1]), "b": jnp.asarray([[0.7, -2.0]], jnp.float32),
         "c": jnp.asarray([1.9, -0.2, 0.05])}
    quantize = jax.jit(stochastic_quantize, static_argnums=2)  # one program for the 20 seeds
    for seed in range(20):
      q = _np(quantize(jax.random.key(seed), x, 2))
      assert [leaf.dtype for leaf in jax.tree.leaves(q)] == [jnp.float64, jnp.float32, jnp.float64]
      assert float(q["a"][0]) == -2.0 and float(q["b"][0, 1]) == -2.0  # l = 0 exactly
      np.testing.assert_allclose(float(q["a"][2]), 2.0, rtol=1e-12)  # l = 3
      for leaf in jax.tree.leaves(q):
        levels = (np.asarray(leaf, np.float64) + 2.0) / (4.0 / 3)
        np.testing.assert_allclose(levels, np.round(levels), atol=1e-6)
        assert levels.min() > -1e-6 and levels.max() < 3 + 1e-6


def test_two_workers_are_the_smallest_chain_and_match_the_papers_equations(rng):
  """A chain of 2 (one head, one tail, one edge) is accepted and its iterations equal the NumPy chain equations."""
  clients = make_clients(rng, [7, 9], D)
  thetas, lams = rng.normal(size=(2, D + 1)), rng.normal(size=(1, D + 1))
  with jax.enable_x64(True):
    batches = pack(clients, 2, 6, extra_slots=1, dtype=np.float64)
    algo = gadmm(_ridge_loss, 0.7, graph=fo.graphs.chain(2), prox=prox_least_squares(L2), client_map="vmap")
    state = _init(algo).replace(local_params=_table(thetas), duals=_table(lams))
    for _ in range(2):
      state = jax.jit(algo.step)(state, batches)
      thetas, lams = _numpy_gadmm_chain(thetas, lams, clients, 0.7, L2)
      np.testing.assert_allclose(_rows(state.local_params), thetas, rtol=1e-10, atol=1e-12)
      np.testing.assert_allclose(_rows(state.duals), lams, rtol=1e-10, atol=1e-12)


def _examples_iterations_match_numpy(graph, clients, batches, rho, scale, thetas, lams, iterations):
  """Uncensored, unquantized GGADMM with objective="examples" from (θ, λ), each iteration checked against the NumPy
  transcription with weights c_n = `scale`; returns the last state."""
  algo = cq_ggadmm(lsq_loss, rho, 0.0, graph=graph, bits=None, prox=prox_least_squares(), objective="examples",
                   client_map="vmap")
  state = _init(algo).replace(
      local_params=_table(thetas), transmitted=_table(thetas), duals=_table(lams))
  step, sent = jax.jit(algo.step), thetas
  for _ in range(iterations):
    state = step(state, batches)
    thetas, sent, lams, _ = _numpy_censored_iteration(graph, thetas, sent, lams, clients, rho, 0.0, scale=scale)
    _assert_tables(state, thetas, lams)
  return state


def test_examples_objective_a_worker_without_examples_takes_the_neighbours_point(rng):
  """objective="examples" with worker 2's mask all False: c_2 = 0, so its update is θ_2 = v_2 (the argmin of the
  penalty alone), equal to the NumPy transcription with c_2 = 0; the others as before."""
  graph = fo.graphs.random_bipartite(3, 4, 0.4, seed=3)
  sizes = rng.integers(3, 25, graph.num_nodes)
  clients = make_clients(rng, list(sizes), D)
  n, rho, empty = graph.num_nodes, 0.8, 2
  counts = sizes.copy()
  counts[empty] = 0
  scale = n * counts / counts.sum()
  thetas, lams = rng.normal(size=(n, D + 1)), rng.normal(size=(graph.num_edges, D + 1))
  with jax.enable_x64(True):
    batches = pack(clients, 5, 5, extra_slots=1, dtype=np.float64)
    mask = np.array(batches.mask)
    mask[empty] = False
    batches = batches.replace(mask=jnp.asarray(mask))
    state = _examples_iterations_match_numpy(graph, clients, batches, rho, scale, thetas, lams, 2)
    assert int(state.metrics["num_nonfinite"]) == 0


def test_examples_objective_with_a_single_example_in_all_weighs_it_fully(rng):
  """objective="examples" where worker 0 holds the only real example (every other mask all False): n = 1, so
  c_0 = N·1/1 = N and the others 0; two iterations equal the NumPy transcription with those weights."""
  graph = fo.graphs.random_bipartite(3, 4, 0.4, seed=3)
  n, rho = graph.num_nodes, 0.8
  clients = make_clients(rng, [1] + [4] * (n - 1), D)
  scale = np.zeros(n)
  scale[0] = n
  thetas, lams = rng.normal(size=(n, D + 1)), rng.normal(size=(graph.num_edges, D + 1))
  with jax.enable_x64(True):
    batches = pack(clients, 2, 2, dtype=np.float64)
    mask = np.array(batches.mask)
    mask[1:] = False
    batches = batches.replace(mask=jnp.asarray(mask))
    _examples_iterations_match_numpy(graph, clients, batches, rho, scale, thetas, lams, 2)


@pytest.mark.parametrize("bits", [None, 4])
def test_zero_threshold_never_censors_even_an_unchanged_model(bits):
  """τ₀ = 0 is "no censoring" (docstring): a worker whose quantized change is exactly zero still transmits, so
  every worker transmits every iteration. Zero data started at θ = 0 makes every change exactly zero; with
  τ₀ > 0 the same changes are all censored (‖0‖ < τ₀ξᵏ)."""
  graph = fo.graphs.chain(5)
  n, p = graph.num_nodes, D + 1
  clients = [(np.zeros((4, D)), np.zeros(4))] * n
  per_message = 32.0 * p if bits is None else bits * p + 32.0
  with jax.enable_x64(True):
    batches = pack(clients, 2, 2, dtype=np.float64)
    # τ₀ traced: both thresholds run through one program.
    run = jax.jit(lambda tau0: _scan(cq_ggadmm(lsq_loss, 1.0, tau0, graph=graph, bits=bits, prox=prox_least_squares()),
                                     batches, 3))
    for tau0, sent in ((0.0, n), (0.5, 0)):
      state, (hist, _) = _np(run(tau0))
      jax.tree.map(lambda leaf: np.testing.assert_array_equal(leaf, 0.0), state.local_params)
      np.testing.assert_array_equal(hist["transmissions"], [sent] * 3)
      np.testing.assert_array_equal(hist["bits"], [sent * per_message] * 3)
