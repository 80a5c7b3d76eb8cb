"""FedBuff, FedAsync, Co-op and Zeno++ against float64 NumPy transcriptions of their rules and a plain event loop.

The reference (`_reference_run`) is written independently of `fedjax_opt.core.asynchrony`: a Python loop over
arrivals in time order (ties to the lower client id), a dict of every past model standing for the ring buffer, and
each algorithm's server rule in NumPy.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from conftest import lsq_grad_np, lsq_loss
from fedjax_opt.core import asynchrony as asy

D, S, B = 3, 2, 2
LR = 0.1


def _clients(rng, n):
  return [(rng.normal(loc=0.4 * k, size=(S * B, D)), rng.normal(size=S * B)) for k in range(n)]


def _batches(clients, dtype=np.float64):
  x = np.stack([c[0].reshape(S, B, D) for c in clients]).astype(dtype)
  y = np.stack([c[1].reshape(S, B) for c in clients]).astype(dtype)
  n = len(clients)
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.ones((n, S, B), bool),
                          weight=jnp.full((n,), float(S * B)), client_id=jnp.arange(n, dtype=jnp.int32))


def _local_sgd(w, b, client, rho=0.0):
  """S steps of SGD(LR) on batches of B examples in order, with the gradient of (ρ/2)‖x − x_start‖² added."""
  x, y = client
  w0, b0 = w.copy(), b
  for s in range(S):
    gw, gb = lsq_grad_np(w, b, x[s * B:(s + 1) * B], y[s * B:(s + 1) * B])
    w, b = w - LR * (gw + rho * (w - w0)), b - LR * (gb + rho * (b - b0))
  return w, b


def _reference_run(clients, speeds, events, x0, rule, *, history_size=16, rho=0.0):
  """All clients in flight, unit compute time times the client's speed, one arrival per event.

  `rule(x, server, staleness, start, new) -> (x, server, accepted, bumped)` on (w, b) tuples.
  Returns the model and the metrics (staleness of the arrival, too stale, accepted) after every event.
  """
  n = len(clients)
  finish, pulled = [float(s) for s in speeds], [0] * n
  history, version, x, server, out = {0: x0}, 0, x0, None, []
  for _ in range(events):
    i = min(range(n), key=lambda k: (finish[k], k))
    t, p = finish[i], pulled[i]
    too_stale = version - p >= history_size
    accepted = False
    if not too_stale:
      start = history[p]
      new = _local_sgd(start[0], start[1], clients[i], rho)
      x, server, accepted, bumped = rule(x, server, version - p, start, new)
      if bumped:
        version += 1
        history[version] = x
    out.append(dict(params=x, staleness=version - p, too_stale=too_stale, accepted=accepted, time=t, client=i))
    finish[i], pulled[i] = t + speeds[i], version
  return out


def _params(x):
  return {"w": jnp.asarray(x[0]), "b": jnp.asarray(x[1])}


def _assert_params(state, x, rtol=1e-12):
  np.testing.assert_allclose(state.params["w"], x[0], rtol=rtol, atol=1e-14)
  np.testing.assert_allclose(state.params["b"], x[1], rtol=rtol, atol=1e-14)


def _scan_events(algo, params, batches, events, seed=0):
  """(params, metrics, version) after each of `events` steps from `algo.init(params, key(seed))`, stacked (version
  None for a synchronous algorithm); traceable."""

  def body(state, _):
    state = algo.step(state, batches)
    return state, (state.params, state.metrics, getattr(state, "version", None))

  return jax.lax.scan(body, algo.init(params, jax.random.key(seed)), None, length=events)[1]


def _unstack(stacked, events):
  """The stacked output of `_scan_events` as a list of `.params` / `.metrics` / `.version` namespaces, indexed in
  NumPy (an eager slice would compile a program per shape and index)."""
  stacked = jax.tree.map(np.asarray, stacked)
  return [types.SimpleNamespace(**dict(zip(("params", "metrics", "version"),
                                           jax.tree.map(lambda leaf, i=i: leaf[i], stacked))))
          for i in range(events)]


def _run(algo, params, batches, events, seed=0):
  """The params and metrics after each of `events` events: one program (a scan over the events, init included)."""
  return _unstack(jax.jit(lambda p, b: _scan_events(algo, p, b, events, seed))(params, batches), events)


SPEEDS = [1.0, 2.0, 3.0]  # arrivals (test_asynchrony.py): clients 0,0,1,0,2,0,1 at times 1,2,2,3,3,4,4


def _schedule(speeds=SPEEDS, **kw):
  return asy.wall_clock(asy.constant(1.0), speed=jnp.asarray(speeds), **kw)


def test_fedbuff_with_zero_staleness_and_k_equal_to_the_event_is_fedavg(rng):
  """Every client in flight with the same compute time: each event brings all C, K = C, staleness 0."""
  clients = _clients(rng, 4)
  with jax.enable_x64(True):
    batches = _batches(clients)
    params = _params((rng.normal(size=D), 0.2))
    server = lambda: optax.sgd(0.7, momentum=0.5)
    buff = fo.algorithms.fedbuff(lsq_loss, buffer_size=4, num_clients=4, client_optimizer=optax.sgd(LR),
                                 server_optimizer=server(), schedule=asy.wall_clock(asy.constant(1.0),
                                                                                    arrivals_per_step=4))
    avg = fo.algorithms.fedavg(lsq_loss, client_optimizer=optax.sgd(LR), server_optimizer=server(),
                               aggregator=fo.aggregators.mean())
    both = jax.jit(lambda p, b: (_scan_events(buff, p, b, 3), _scan_events(avg, p, b, 3)))  # one program
    for event, (s_buff, s_avg) in enumerate(zip(*(_unstack(run, 3) for run in both(params, batches)))):
      for k in params:
        np.testing.assert_allclose(s_buff.params[k], s_avg.params[k], rtol=1e-12)
      assert int(s_buff.metrics["staleness_max"]) == 0 and int(s_buff.version) == event + 1
      assert float(s_buff.metrics["simulated_time"]) == event + 1
      assert int(s_buff.metrics["num_clients"]) == 4


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
def test_fedbuff_matches_numpy_with_stale_buffered_updates(rng, kind):
  clients = _clients(rng, 3)
  k_buf, eta, a, b = 2, 0.5, 0.5, 1
  weight = {"constant": lambda s: 1.0, "polynomial": lambda s: (s + 1.0) ** -a,
            "hinge": lambda s: 1.0 if s <= b else 1 / (a * (s - b) + 1)}[kind]

  def rule(x, server, staleness, start, new):
    total, count = server or ((np.zeros(D), 0.0), 0)
    s = weight(staleness)
    total = (total[0] + s * (new[0] - start[0]), total[1] + s * (new[1] - start[1]))
    count += 1
    if count == k_buf:
      return (x[0] + eta * total[0] / k_buf, x[1] + eta * total[1] / k_buf), None, True, True
    return x, (total, count), True, False

  x0 = (rng.normal(size=D), 0.1)
  ref = _reference_run(clients, SPEEDS, 9, x0, rule)
  with jax.enable_x64(True):
    algo = fo.algorithms.fedbuff(lsq_loss, buffer_size=k_buf, num_clients=3, client_optimizer=optax.sgd(LR),
                                 server_optimizer=optax.sgd(eta), staleness_weight=kind, a=a, b=b,
                                 schedule=_schedule())
    states = _run(algo, _params(x0), _batches(clients), 9)
  for state, r in zip(states, ref):
    _assert_params(state, r["params"])
    assert float(state.metrics["simulated_time"]) == r["time"]
  assert max(r["staleness"] for r in ref) >= 2  # the run does exercise stale updates


def test_fedasync_alpha_one_zero_staleness_takes_the_client_model(rng):
  """One client in flight at a time (concurrency 1): every update has staleness 0; α = 1 returns its model."""
  clients = _clients(rng, 3)
  with jax.enable_x64(True):
    algo = fo.algorithms.fedasync(lsq_loss, 1.0, num_clients=3, client_optimizer=optax.sgd(LR),
                                  schedule=asy.wall_clock(asy.exponential(1.0), concurrency=1))

    @jax.jit
    def run(params, batches):  # five events in one program: the clock before each, the state after it
      def body(state, _):
        new = algo.step(state, batches)
        return new, (state.clock.finish_time, new.params, new.metrics["staleness_max"])

      return jax.lax.scan(body, algo.init(params, jax.random.key(0)), None, length=5)[1]

    x0 = _params((rng.normal(size=D), 0.0))
    finish, params, staleness = jax.tree.map(np.asarray, run(x0, _batches(clients)))
  w, b = np.asarray(x0["w"]), float(x0["b"])
  for event in range(5):
    arriving = int(np.flatnonzero(np.isfinite(finish[event]))[0])
    expected = _local_sgd(w, b, clients[arriving])
    w, b = params["w"][event], float(params["b"][event])
    _assert_params(types.SimpleNamespace(params={"w": w, "b": b}), expected)
    assert int(staleness[event]) == 0


@functools.cache
def _fedasync_events(kind, events):
  """`run(alpha, rho, a, b, params, batches)`: after each of `events` FedAsync events (on `_schedule()`, from key 0),
  the state's params and metrics (NumPy, as `.params` / `.metrics`), as a list. α, ρ, a and b are traced
  arguments, so each staleness kind is one program (the two hinge cases share it); call it under
  `jax.enable_x64(True)`."""

  @jax.jit
  def run(alpha, rho, a, b, params, batches):
    algo = fo.algorithms.fedasync(lsq_loss, alpha, rho, num_clients=3, client_optimizer=optax.sgd(LR),
                                  staleness_weight=kind, a=a, b=b, schedule=_schedule())

    return _scan_events(algo, params, batches, events)

  return lambda *args: _unstack(run(*args), events)


@pytest.mark.parametrize("kind,a,b", [("constant", 0.5, 0), ("polynomial", 0.7, 0), ("hinge", 0.5, 2),
                                      ("hinge", 2.0, 0)])
def test_fedasync_matches_numpy_for_each_staleness_function(rng, kind, a, b):
  clients = _clients(rng, 3)
  alpha, rho = 0.6, 0.3

  def s_fn(t):
    return {"constant": 1.0, "polynomial": (t + 1.0) ** -a, "hinge": 1.0 if t <= b else 1 / (a * (t - b) + 1)}[kind]

  def rule(x, server, staleness, start, new):
    w = alpha * s_fn(staleness)
    return ((1 - w) * x[0] + w * new[0], (1 - w) * x[1] + w * new[1]), server, True, True

  x0 = (rng.normal(size=D), -0.3)
  ref = _reference_run(clients, SPEEDS, 7, x0, rule, rho=rho)
  assert [r["staleness"] - 1 for r in ref] == [0, 0, 2, 1, 4, 1, 3]  # t − τ before the update's own bump
  with jax.enable_x64(True):
    states = _fedasync_events(kind, 7)(alpha, rho, a, b, _params(x0), _batches(clients))
  for state, r in zip(states, ref):
    _assert_params(state, r["params"])
    assert int(state.metrics["staleness_max"]) == r["staleness"] - 1


def test_co_op_merges_by_age_and_discards_updates_older_than_the_bound(rng):
  clients = _clients(rng, 3)
  alpha, max_age = 0.8, 1

  def rule(x, server, age, start, new):
    if age > max_age:
      return x, server, False, False
    w = alpha / (age + 1)
    return ((1 - w) * x[0] + w * new[0], (1 - w) * x[1] + w * new[1]), server, True, True

  x0 = (rng.normal(size=D), 0.0)
  ref = _reference_run(clients, SPEEDS, 10, x0, rule)
  with jax.enable_x64(True):
    algo = fo.algorithms.co_op(lsq_loss, alpha, max_age=max_age, num_clients=3, client_optimizer=optax.sgd(LR),
                               schedule=_schedule())
    states = _run(algo, _params(x0), _batches(clients), 10)
  rejected = [int(s.metrics["num_rejected"]) for s in states]
  assert rejected == [int(not r["accepted"]) for r in ref] and sum(rejected) >= 2
  for state, r in zip(states, ref):
    _assert_params(state, r["params"])


def test_updates_staler_than_the_ring_buffer_are_discarded_and_counted(rng):
  """H = 3: client 2 pulled version 0 and arrives at version 4 (event 5): its model is gone, it is discarded."""
  clients = _clients(rng, 3)
  alpha = 0.5

  def rule(x, server, staleness, start, new):
    return ((1 - alpha) * x[0] + alpha * new[0], (1 - alpha) * x[1] + alpha * new[1]), server, True, True

  x0 = (rng.normal(size=D), 0.0)
  ref = _reference_run(clients, SPEEDS, 12, x0, rule, history_size=3)
  with jax.enable_x64(True):
    algo = fo.algorithms.fedasync(lsq_loss, alpha, num_clients=3, client_optimizer=optax.sgd(LR),
                                  schedule=_schedule(), history_size=3)
    states = _run(algo, _params(x0), _batches(clients), 12)
  too_stale = [int(s.metrics["num_too_stale"]) for s in states]
  assert too_stale == [int(r["too_stale"]) for r in ref] and too_stale[4] == 1
  assert int(states[4].metrics["num_clients"]) == 0 and not bool(states[4].metrics["round_accepted"])
  for state, r in zip(states, ref):
    _assert_params(state, r["params"])


def _linear(params, batch):
  return batch["x"] @ params["w"]


@jax.jit
def _zeno_linear_event(rho, eps):
  """One Zeno++ event (γ = ½; ρ, ε traced: one program for every case) on `_linear`, from w = 0.25 with x = 2
  everywhere and validation x = 1, with the paper's rescaling and without: (state, state); call it under
  `jax.enable_x64(True)`."""
  batches = fo.ClientBatches(data={"x": jnp.full((1, S, B, 1), 2.0)}, mask=jnp.ones((1, S, B), bool),
                             weight=jnp.ones((1,)), client_id=jnp.zeros((1,), jnp.int32))
  out = []
  for rescale in (True, False):
    algo = fo.algorithms.zeno_plus_plus(_linear, 0.5, rho, eps, validation_data={"x": jnp.ones((3, 1))},
                                        num_clients=1, schedule=asy.wall_clock(asy.constant(1.0)),
                                        **({} if rescale else {"rescale": False}))  # the default is the paper's
    out.append(algo.step(algo.init({"w": jnp.array([0.25])}, jax.random.key(0)), batches))
  return tuple(out)


@pytest.mark.parametrize("rho,eps,paper,unscaled", [
    (0.5, 2.0, True, True), (0.5, 2.0 - 2.0 ** -20, True, False), (0.5, 3.0, True, True), (0.5, 0.0, True, False),
    (0.5 + 2.0 ** -20, 0.0, False, False)])
def test_zeno_plus_plus_accepts_exactly_on_the_boundary(rho, eps, paper, unscaled):
  """Linear loss: v = 1 and g = 2 exactly; γ = 1/2. Paper (rescaled, g̃ = ‖v‖/‖g‖ g = 1): score γ − ρ, accepted iff
  ½ − ρ ≥ −ε/2, step γ g̃ = ½. Unscaled (`rescale=False`): score γ·2 − 4ρ, accepted iff 1 − 4ρ ≥ −ε/2, step 1."""
  with jax.enable_x64(True):
    rescaled, raw = _zeno_linear_event(rho, eps)
  for state, accepted, step in ((rescaled, paper, 0.5), (raw, unscaled, 1.0)):
    np.testing.assert_array_equal(state.validation.gradient["w"], [1.0])
    assert int(state.metrics["num_rejected"]) == int(not accepted)
    assert float(state.params["w"][0]) == (0.25 - step if accepted else 0.25)
    assert int(state.version) == int(accepted)


def _scaled_lsq(params, batch):
  """½ scale·(xᵀw + b − y)²: scale −1 flips the gradient's sign, scale 50 multiplies it, 0 zeroes it (Byzantine
  clients)."""
  return batch["scale"] * lsq_loss(params, batch)


@jax.jit
def _zeno_all_arrive(gamma, rho, eps, params, batches, validation):
  """One Zeno++ event of `_scaled_lsq` in which every row of `batches` arrives with staleness 0, in row order, with
  the paper's rescaling and without: (state, state). γ, ρ, ε are traced: one program."""
  no_staleness = asy.drawn_staleness(lambda key, shape: jnp.zeros(shape, jnp.int32))
  out = []
  for rescale in (True, False):
    algo = fo.algorithms.zeno_plus_plus(_scaled_lsq, gamma, rho, eps, validation_data=validation,
                                        num_clients=batches.weight.shape[0], schedule=no_staleness,
                                        **({} if rescale else {"rescale": False}))  # the default is the paper's
    out.append(algo.step(algo.init(params, jax.random.key(0)), batches))
  return tuple(out)


def _zeno_numpy(v, candidates, gamma, rho, eps, rescale):
  """Float64 transcription of the server's Zeno++ loop from x = 0 (every candidate taken at x = 0, v fixed).

  A candidate is (c, u), the gradient g = c·u. For each in order: a non-finite c is dropped (the guard); g̃ =
  sign(c) ‖v‖ u/‖u‖ = (‖v‖/‖g‖) g (0 when c = 0; g̃ = g without rescaling); accepted iff γ⟨v, g̃⟩ − ρ‖g̃‖² ≥ −γε;
  accepted: x ← x − γ g̃. Returns (x, verdicts: True / False / None for dropped, the steps x_before − x_after).
  """
  point, verdicts, steps = np.zeros_like(v), [], []
  for c, u in candidates:
    if not np.isfinite(c):
      verdicts.append(None)
      steps.append(np.zeros_like(v))
      continue
    g = np.sign(c) * np.sqrt(v @ v) * u / np.sqrt(u @ u) if rescale else c * u
    with np.errstate(over="ignore"):
      ok = gamma * (v @ g) - rho * (g @ g) >= -gamma * eps
    verdicts.append(bool(ok))
    steps.append(gamma * g if ok else np.zeros_like(g))
    point = point - steps[-1]
  return point, verdicts, steps


def test_zeno_plus_plus_rescales_the_candidate_then_rejects_sign_flips_and_applies_honest_ones(rng):
  """The paper's rule: an honest gradient 50 (or 10²⁰⁰) times too long passes and takes a step of length γ‖v‖; a
  sign-flipped one fails at any scale; a zero gradient stays zero (no NaN); a NaN one is dropped by the guard.
  Without rescaling the long honest ones fail the ρ term. Both against `_zeno_numpy`."""
  # honest, flipped, scaled, honest, flipped and scaled, zero, NaN, ‖g‖² beyond float64 (‖g‖ itself is finite)
  scale = np.array([1.0, -1.0, 50.0, 1.0, -4.0, 0.0, np.nan, 1e200])
  n = len(scale)
  x = rng.normal(size=(n, S * B, D))
  w_true = rng.normal(size=D)
  y = x @ w_true
  with jax.enable_x64(True):
    batches = fo.ClientBatches(
        data={"x": jnp.asarray(x.reshape(n, S, B, D)), "y": jnp.asarray(y.reshape(n, S, B)),
              "scale": jnp.asarray(np.broadcast_to(scale[:, None, None], (n, S, B)))},
        mask=jnp.ones((n, S, B), bool), weight=jnp.ones((n,)), client_id=jnp.arange(n, dtype=jnp.int32))
    xv = rng.normal(size=(64, D))
    validation = {"x": jnp.asarray(xv), "y": jnp.asarray(xv @ w_true), "scale": jnp.ones(64)}
    gamma, rho, eps = 0.05, 0.01, 0.0
    params = {"w": jnp.zeros(D), "b": jnp.zeros(())}
    states = _zeno_all_arrive(gamma, rho, eps, params, batches, validation)
  # NumPy: v at x_0 = 0, each client's full-batch gradient at x_0 (staleness 0), tested and applied in row order.
  v = np.append(*lsq_grad_np(np.zeros(D), 0.0, xv, xv @ w_true))
  candidates = [(scale[k], np.append(*lsq_grad_np(np.zeros(D), 0.0, x[k], y[k]))) for k in range(n)]
  for state, rescale, expected in ((states[0], True, [True, False, True, True, False, True, None, True]),
                                   (states[1], False, [True, False, False, True, False, True, None, False])):
    point, verdicts, steps = _zeno_numpy(v, candidates, gamma, rho, eps, rescale)
    assert verdicts == expected
    assert int(state.metrics["num_rejected"]) == expected.count(False)
    assert int(state.metrics["num_nonfinite"]) == 1
    assert int(state.metrics["num_clients"]) == expected.count(True) and int(state.version) == expected.count(True)
    got = np.append(state.params["w"], state.params["b"])
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, point, rtol=1e-12, atol=1e-15)
    if rescale:  # every accepted non-zero step has length γ‖v‖, the long ones included
      for k in (0, 2, 3, 7):
        np.testing.assert_allclose(np.linalg.norm(steps[k]), gamma * np.linalg.norm(v), rtol=1e-12)


def test_the_same_seed_gives_the_same_run_bit_for_bit(rng):
  clients = _clients(rng, 5)
  batches = _batches(clients, np.float32)
  algo = fo.algorithms.fedbuff(lsq_loss, buffer_size=3, num_clients=5, client_optimizer=optax.sgd(LR),
                               staleness_weight="polynomial",
                               schedule=asy.wall_clock(asy.lognormal(0.0, 0.8), latency=asy.exponential(0.2),
                                                       speed=jnp.array([1.0, 2.0, 0.5, 1.0, 4.0]), concurrency=4))
  params = {"w": jnp.zeros(D, jnp.float32), "b": jnp.zeros((), jnp.float32)}

  @jax.jit
  def run(key):
    def body(s, _):
      s = algo.step(s, batches)
      return s, s.metrics

    return jax.lax.scan(body, algo.init(params, key), None, length=20)

  (final, metrics), (again, metrics_again) = run(jax.random.key(3)), run(jax.random.key(3))
  for a, b in zip(jax.tree.leaves((final, metrics)), jax.tree.leaves((again, metrics_again))):
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if a.dtype == final.key.dtype else a),
                                  np.asarray(jax.random.key_data(b) if b.dtype == final.key.dtype else b))
  assert np.all(np.diff(np.asarray(metrics["simulated_time"])) >= 0)
  assert int(final.version) >= 3 and int(np.max(metrics["staleness_max"])) >= 1
  _, other = run(jax.random.key(4))
  assert not np.array_equal(np.asarray(other["simulated_time"]), np.asarray(metrics["simulated_time"]))


def test_bad_arguments_raise_clear_errors():
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match="buffer_size must be a Python int >= 1"):
    fo.algorithms.fedbuff(lsq_loss, buffer_size=0, num_clients=2, client_optimizer=sgd)
  with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
    fo.algorithms.fedasync(lsq_loss, 1.5, num_clients=2, client_optimizer=sgd)
  with pytest.raises(ValueError, match="staleness_weight must be one of"):
    fo.algorithms.fedasync(lsq_loss, 0.5, num_clients=2, client_optimizer=sgd, staleness_weight="linear")
  with pytest.raises(ValueError, match="a must be finite and > 0"):
    fo.algorithms.fedasync(lsq_loss, 0.5, num_clients=2, client_optimizer=sgd, staleness_weight="hinge", a=0.0)
  with pytest.raises(ValueError, match="max_age must be a Python int >= 0"):
    fo.algorithms.co_op(lsq_loss, 0.5, max_age=-1, num_clients=2, client_optimizer=sgd)
  with pytest.raises(ValueError, match="gamma must be finite and > 0"):
    fo.algorithms.zeno_plus_plus(lsq_loss, 0.0, 0.1, 0.1, validation_data={"x": jnp.ones((2, D))}, num_clients=2)
  with pytest.raises(TypeError, match="rescale must be a Python bool"):
    fo.algorithms.zeno_plus_plus(lsq_loss, 0.1, 0.1, 0.1, validation_data={"x": jnp.ones((2, D))}, num_clients=2,
                                 rescale="paper")
  with pytest.raises(ValueError, match="validation_mask must be a"):
    fo.algorithms.zeno_plus_plus(lsq_loss, 0.1, 0.1, 0.1, validation_data={"x": jnp.ones((2, D))}, num_clients=2,
                                 validation_mask=jnp.ones(3, bool))
  with pytest.raises(TypeError, match="schedule must be a fedjax_opt.core.asynchrony.Schedule"):
    fo.algorithms.fedasync(lsq_loss, 0.5, num_clients=2, client_optimizer=sgd, schedule="wall_clock")
  algo = fo.algorithms.fedasync(lsq_loss, 0.5, num_clients=3, client_optimizer=sgd, schedule=_schedule())
  state = jax.jit(algo.init)({"w": jnp.zeros(D), "b": jnp.zeros(())}, jax.random.key(0))  # one program
  two = fo.ClientBatches(data={"x": jnp.zeros((2, S, B, D)), "y": jnp.zeros((2, S, B))},
                         mask=jnp.ones((2, S, B), bool), weight=jnp.ones((2,)),
                         client_id=jnp.array([1, 2], jnp.int32))
  with pytest.raises(ValueError, match="batches must hold every arriving client"):
    algo.step(state, two)
