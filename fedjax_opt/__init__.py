"""fedjax_opt: federated optimization algorithms in JAX."""

from fedjax_opt import core
from fedjax_opt.core import ClientBatches, FederatedAlgorithm

__version__ = "0.1.0"
