"""fedjax_opt: federated optimization algorithms in JAX.

    import fedjax_opt as fo
    algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.1),
                                server_optimizer=fo.server_optimizers.fedadam(0.01))
    state = algo.init(params, jax.random.key(0))
    state = jax.jit(algo.step)(state, batches)
"""

from fedjax_opt import (aggregators, algorithms, attacks, compression, core, data, distributed, evaluate, graphs,
                        models, objectives, privacy, server_optimizers, sweep)
from fedjax_opt.core import ClientBatches, FederatedAlgorithm
from fedjax_opt.core import client_map
from fedjax_opt.core.per_client import personalized_params
from fedjax_opt.train import Checkpointing, Evaluation, History, Sampling, train

__version__ = "0.1.0"
