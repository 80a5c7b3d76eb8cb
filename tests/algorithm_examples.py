"""One small example call of every factory in `fo.algorithms`, and inputs it runs on.

Shared by tests/test_convention.py (the factory convention) and
tests/test_every_algorithm.py (a poisoned client never spreads, deferred data). A new factory is
added here once, and both check it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

import fedjax_opt as fo

N = 4  # clients (= nodes, = the round's clients: every example runs with all of them)
S, B, D = 2, 3, 3  # local steps, batch size, features


def loss_fn(params, batch):
  """Per-example least squares ½(xᵀw + b − y)²."""
  return 0.5 * jnp.square(batch["x"] @ params["w"] + params["b"] - batch["y"])


def _sgd():
  return optax.sgd(0.01)


def _every_client_arrives():
  return fo.core.asynchrony.wall_clock(fo.core.asynchrony.exponential(1.0), arrivals_per_step=N)


EXAMPLES = {
    "fedavg": lambda **kw: fo.algorithms.fedavg(loss_fn, client_optimizer=_sgd(), **kw),
    "fedsgd": lambda **kw: fo.algorithms.fedsgd(loss_fn, server_optimizer=_sgd(), **kw),
    "fedprox": lambda **kw: fo.algorithms.fedprox(loss_fn, 0.1, client_optimizer=_sgd(), **kw),
    "scaffold": lambda **kw: fo.algorithms.scaffold(loss_fn, 0.01, 1.0, num_clients=N, **kw),
    "fednova": lambda **kw: fo.algorithms.fednova(loss_fn, 0.01, 0.5, **kw),
    "feddyn": lambda **kw: fo.algorithms.feddyn(loss_fn, 0.1, num_clients=N, client_optimizer=_sgd(), **kw),
    "ditto": lambda **kw: fo.algorithms.ditto(loss_fn, 0.1, 0.01, num_clients=N, personal_steps=2,
                                              client_optimizer=_sgd(), **kw),
    "pfedme": lambda **kw: fo.algorithms.pfedme(loss_fn, 1.0, 0.01, 1.0, num_clients=N, local_steps=S,
                                                inner_steps=2, inner_lr=0.01, **kw),
    "easgd": lambda **kw: fo.algorithms.easgd(loss_fn, 0.1, num_clients=N, client_optimizer=_sgd(), **kw),
    "fedu": lambda **kw: fo.algorithms.fedu(loss_fn, 0.1, 0.01, graph=fo.graphs.ring(N), num_clients=N,
                                            local_steps=S, **kw),
    "per_fedavg": lambda **kw: fo.algorithms.per_fedavg(loss_fn, 0.01, 0.01, local_steps=S // 2, **kw),
    "fedavg_finetune": lambda **kw: fo.algorithms.fedavg_finetune(
        loss_fn, switch_round=1, personalize_steps=1, client_optimizer=_sgd(), finetune_client_optimizer=_sgd(),
        **kw),
    "ifca": lambda **kw: fo.algorithms.ifca(loss_fn, num_clusters=2, num_clients=N, client_optimizer=_sgd(), **kw),
    "clustered_fl": lambda **kw: fo.algorithms.clustered_fl(loss_fn, eps_1=10.0, eps_2=0.0, max_clusters=3,
                                                            num_clients=N, client_optimizer=_sgd(), **kw),
    # e_step="round": under the default "auto", deferred data from a packed dataset gives FedEM each client's
    # whole train split, more than the eager batches hold (tests/test_fedem.py checks that path).
    "fedem": lambda **kw: fo.algorithms.fedem(loss_fn, num_components=2, num_clients=N, client_optimizer=_sgd(),
                                              e_step="round", **kw),
    "d_fedem": lambda **kw: fo.algorithms.d_fedem(loss_fn, num_components=2,
                                                  graph=fo.graphs.metropolis_hastings(fo.graphs.ring(N)),
                                                  client_optimizer=_sgd(), e_step="round", **kw),
    "fedmd": lambda **kw: fo.algorithms.fedmd(
        loss_fn, apply_fn=lambda p, x: (x @ p["w"] + p["b"])[:, None], num_clients=N,
        public_data={"x": jnp.asarray(np.linspace(-1, 1, 4 * D).reshape(4, D), jnp.float32)}, public_per_round=4,
        digest_steps=2, digest_batch_size=2, client_optimizer=_sgd(), **kw),
    "l2gd": lambda **kw: fo.algorithms.l2gd(loss_fn, 0.1, 0.1, 0.5, num_clients=N, **kw),
    "l2sgd": lambda **kw: fo.algorithms.l2sgd(loss_fn, 0.1, 0.1, 0.5, num_clients=N, **kw),
    "l2sgd_plus": lambda **kw: fo.algorithms.l2sgd_plus(loss_fn, 0.1, 0.1, 0.5, num_clients=N, num_examples=S * B,
                                                        **kw),
    # classical distributed baselines (every client every round except FedDANE and one-shot averaging)
    "dane": lambda **kw: fo.algorithms.dane(loss_fn, 1.0, 0.5, num_clients=N, **kw),
    "feddane": lambda **kw: fo.algorithms.feddane(loss_fn, 0.5, client_optimizer=_sgd(), **kw),
    "fadl": lambda **kw: fo.algorithms.fadl(loss_fn, 0.5, num_clients=N, line_search_steps=3, **kw),
    "giant": lambda **kw: fo.algorithms.giant(loss_fn, num_clients=N, cg_iters=2, line_search_steps=3, **kw),
    "cocoa": lambda **kw: fo.algorithms.cocoa(0.1, num_clients=N, num_examples=S * B, **kw),
    "one_shot_average": lambda **kw: fo.algorithms.one_shot_average(loss_fn, **kw),
    "admm_consensus": lambda **kw: fo.algorithms.admm_consensus(loss_fn, 1.0, num_clients=N,
                                                                client_optimizer=_sgd(), **kw),
    "admm_sharing": lambda **kw: fo.algorithms.admm_sharing(1.0, num_samples=B, **kw),
    "gadmm": lambda **kw: fo.algorithms.gadmm(loss_fn, 1.0, graph=fo.graphs.chain(N), client_optimizer=_sgd(),
                                              **kw),
    "cq_ggadmm": lambda **kw: fo.algorithms.cq_ggadmm(loss_fn, 1.0, 0.1, graph=fo.graphs.chain(N), bits=8,
                                                      client_optimizer=_sgd(), **kw),
    "mixture_admm": lambda **kw: fo.algorithms.mixture_admm(loss_fn, 0.1, 1.0, num_clients=N,
                                                       client_optimizer=_sgd(), **kw),
    "gossip": lambda **kw: fo.algorithms.gossip(loss_fn, 0.01, graph=fo.graphs.metropolis_hastings(fo.graphs.ring(N)),
                                                **kw),
    "dpsgd": lambda **kw: fo.algorithms.dpsgd(loss_fn, 0.01, graph=fo.graphs.metropolis_hastings(fo.graphs.ring(N)),
                                              **kw),
    "gradient_tracking": lambda **kw: fo.algorithms.gradient_tracking(
        loss_fn, 0.01, graph=fo.graphs.random_matchings(fo.graphs.complete(N), 6, seed=0), **kw),
    "p2p_bayes": lambda **kw: fo.algorithms.p2p_bayes(
        loss_fn, hypotheses={"w": jnp.asarray(np.arange(3 * D).reshape(3, D) / 10.0, jnp.float32),
                             "b": jnp.zeros(3, jnp.float32)},
        graph=fo.graphs.metropolis_hastings(fo.graphs.ring(N)), **kw),
    # asynchronous: every event handles all N in-flight clients (each arrives once), so every client computes
    "fedbuff": lambda **kw: fo.algorithms.fedbuff(loss_fn, buffer_size=2, num_clients=N, client_optimizer=_sgd(),
                                                  schedule=_every_client_arrives(), **kw),
    "fedasync": lambda **kw: fo.algorithms.fedasync(loss_fn, 0.5, num_clients=N, client_optimizer=_sgd(),
                                                    staleness_weight="polynomial", schedule=_every_client_arrives(),
                                                    **kw),
    "co_op": lambda **kw: fo.algorithms.co_op(loss_fn, 0.5, max_age=2, num_clients=N, client_optimizer=_sgd(),
                                              schedule=_every_client_arrives(), **kw),
    "zeno_plus_plus": lambda **kw: fo.algorithms.zeno_plus_plus(
        loss_fn, 0.01, 0.001, 0.1, validation_data={"x": jnp.ones((B, D), jnp.float32), "y": jnp.zeros(B, jnp.float32)},
        num_clients=N, schedule=_every_client_arrives(), **kw),
}
"""Factory name → a call building it (small hyper-parameters, every step stable); keywords are passed on."""


def example_inputs(name: str, *, poisoned: int | None = None, seed: int = 0):
  """`(initial params, ClientBatches)` for `EXAMPLES[name]`: all N clients, every slot real.

  With `poisoned=c`, client c's data holds a NaN (its update cannot be finite).
  """
  rng = np.random.default_rng(seed)
  if name == "admm_sharing":  # vertical FL: client c holds feature block c of the same B samples
    x = rng.normal(size=(N, 1, B, D)).astype(np.float32)
    y = np.tile(rng.normal(size=(1, 1, B)), (N, 1, 1)).astype(np.float32)
    params = jnp.zeros((N, D), jnp.float32)
    shape = (N, 1, B)
  else:
    x = rng.normal(size=(N, S, B, D)).astype(np.float32)
    y = rng.normal(size=(N, S, B)).astype(np.float32)
    params = {"w": jnp.asarray(rng.normal(size=(D,)), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    shape = (N, S, B)
  if poisoned is not None:
    x[poisoned, ..., 0] = np.nan
  batches = fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.ones(shape, bool),
                             weight=jnp.full((N,), float(np.prod(shape[1:]))),
                             client_id=jnp.arange(N, dtype=jnp.int32))
  return params, batches


# ----------------------------------------------------------------------------- float64 NumPy views of the model


def flat_params(params):
  """The examples' model {"b": [], "w": [D]} as one float64 vector, in leaf order: b, then w."""
  return np.append(np.asarray(params["b"], np.float64), np.asarray(params["w"], np.float64))


def flat_table(table):
  """A per-client table {"b": [N], "w": [N, D]} as [N, 1 + D] float64 rows."""
  return np.column_stack([np.asarray(table["b"], np.float64), np.asarray(table["w"], np.float64)])


def lsq_gradient(z, x, y):
  """∇ of the mean of ½(xᵀw + b − y)² over a batch, at z = (b, w), in float64 NumPy."""
  r = x @ z[1:] + z[0] - y
  return np.append(r.mean(), x.T @ r / len(y))
