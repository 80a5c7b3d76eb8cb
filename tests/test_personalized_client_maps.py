"""One round of each personalized algorithm gives the same state under every client_map mode.

The client map must not change the math (fedjax_opt.core.client_map): "vmap",
"sequential" (a compiled loop over clients) and "chunked:2" (vmapped chunks
of two, with a remainder chunk for C = 5) agree to float tolerance (each loop
mode against "vmap"; the default tier runs each algorithm in one loop mode) on pFedMe,
Ditto, Per-FedAvg (first-order and Hessian-free), L2GD and L2SGD+. The round uses
padding (a masked-out step, a zero-weight client) so that masking is covered
by every mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import diagonal

import fedjax_opt as fo
from fedjax_opt.algorithms.ditto import ditto
from fedjax_opt.algorithms.mixture import l2gd, l2sgd_plus
from fedjax_opt.algorithms.per_fedavg import per_fedavg
from fedjax_opt.algorithms.pfedme import pfedme

C, S, B, D = 5, 2, 3, 4
LOOPS = ("sequential", "chunked:2")  # each against "vmap"


def quad_loss(w, batch):
  return 0.5 * jnp.square(batch["x"] @ w["w"] + w["b"] - batch["y"])


def _batches(steps=S, full=False):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(C, steps, B, D)).astype(np.float32)
  y = rng.normal(size=(C, steps, B)).astype(np.float32)
  mask = np.ones((C, steps, B), bool)
  weight = np.full(C, 6.0, np.float32)
  if not full:
    mask[1, -1] = False  # client 1's last step is padding
    mask[3, 0, 1:] = False
    weight[4] = 0.0  # a padding client
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)}, mask=jnp.asarray(mask),
                          weight=jnp.asarray(weight), client_id=jnp.asarray([4, 0, 2, 1, 3], jnp.int32))


def _params():
  return {"w": jnp.asarray(np.linspace(-0.5, 0.5, D), jnp.float32), "b": jnp.asarray(0.1, jnp.float32)}


FACTORIES = {
    "pfedme": (lambda m: pfedme(quad_loss, 2.0, 0.1, 1.5, num_clients=C, local_steps=S, inner_steps=3, inner_lr=0.05,
                                client_map=m), S, False),
    "ditto": (lambda m: ditto(quad_loss, 0.5, 0.05, num_clients=C, personal_steps=3, client_optimizer=optax.sgd(0.1),
                              client_map=m), S, False),
    "per_fedavg_fo": (lambda m: per_fedavg(quad_loss, 0.1, 0.05, local_steps=1, variant="fo", client_map=m), 2, False),
    "per_fedavg_hf": (lambda m: per_fedavg(quad_loss, 0.1, 0.05, local_steps=1, variant="hf", client_map=m), 3, False),
    "l2gd": (lambda m: l2gd(quad_loss, 1.0, 0.5, 0.5, num_clients=C, client_map=m), S, True),
    "l2sgd_plus": (lambda m: l2sgd_plus(quad_loss, 1.0, 0.5, 0.5, num_clients=C, num_examples=S * B, client_map=m), S,
                   True),
}


# algorithms × loop modes: the diagonal in the default tier (each algorithm in one loop mode, each mode taken by
# three algorithms), every cell in the slow tier.
@pytest.mark.parametrize("name,loop", diagonal(sorted(FACTORIES), LOOPS))
def test_one_round_is_the_same_under_every_client_map(name, loop):
  factory, steps, full = FACTORIES[name]
  batches = _batches(steps, full)
  if full:  # the mixture methods need every client once, ids a permutation of arange(n)
    batches = batches.replace(client_id=jnp.arange(C, dtype=jnp.int32))
  states = []
  for mode in ("vmap", loop):
    algo = factory(mode)
    state = algo.init(_params(), jax.random.key(7))
    for _ in range(2 if full else 1):  # the mixture methods: two iterations, so both coin outcomes can occur
      state = jax.jit(algo.step)(state, batches)
    states.append(state)
  for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
    if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64), rtol=2e-5, atol=2e-6)
  # The round did something: the model moved.
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), states[0].params, _params())
  assert max(jax.tree.leaves(moved)) > 1e-4, name
