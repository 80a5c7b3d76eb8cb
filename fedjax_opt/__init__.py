"""fedjax_opt: federated optimization algorithms in JAX.

    import fedjax_opt as fo
    algo = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(0.1),
                                server_optimizer=fo.server_optimizers.fedadam(0.01))
    state = algo.init(params, jax.random.key(0))
    state = jax.jit(algo.step)(state, batches)

The subpackages and names below are imported on first use, so `import
fedjax_opt` is quick and loads no JAX until something is used.
"""

from typing import TYPE_CHECKING

from fedjax_opt.core import lazy as _lazy

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = _lazy.attach(
    __name__,
    submodules=("aggregators", "algorithms", "attacks", "compression", "core", "data", "distributed", "evaluate",
                "graphs", "hyper", "models", "objectives", "privacy", "server_optimizers", "sweep"),
    names={
        ".core.types": ("ClientBatches", "FederatedAlgorithm"),
        ".core": ("client_map",),
        ".core.per_client": ("personalized_params",),
        ".core.execution": ("execution", "with_execution"),
        ".train": ("Accounting", "Checkpointing", "Evaluation", "History", "Sampling", "train"),
    })

if TYPE_CHECKING:
  from fedjax_opt import (aggregators, algorithms, attacks, compression, core, data, distributed, evaluate, graphs,
                          hyper, models, objectives, privacy, server_optimizers, sweep)
  from fedjax_opt.core import client_map
  from fedjax_opt.core.execution import execution, with_execution
  from fedjax_opt.core.per_client import personalized_params
  from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm
  from fedjax_opt.train import Accounting, Checkpointing, Evaluation, History, Sampling, train
