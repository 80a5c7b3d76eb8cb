"""Shared mechanics: the contracts, client mapping, local training, server-side aggregation."""

from fedjax_opt.core.types import ClientBatches, FederatedAlgorithm, LossFn, PyTree, ServerState
from fedjax_opt.core import validation
