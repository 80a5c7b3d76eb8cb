"""Shared mechanics: the contracts, client mapping, local training, server-side aggregation.

The ground floor of the package: `fedjax_opt.core` imports nothing from
`fedjax_opt` outside itself, and what two algorithm families (or an
aggregator and an attack) share lives here, since families do not import
each other (tests/test_layering.py checks both).

The names below are imported on first use (`fedjax_opt.core.lazy`), so
importing one module of `fedjax_opt.core` does not load the others.
"""

from typing import TYPE_CHECKING

from fedjax_opt.core import lazy as _lazy

__getattr__, __dir__, __all__ = _lazy.attach(
    __name__,
    submodules=("asynchrony", "client_map", "clusters", "execution", "per_client", "validation"),
    names={
        ".types": ("Aggregator", "ClientBatches", "ClientStage", "DeferredData", "FederatedAlgorithm", "LossFn",
                   "PyTree", "ServerState", "StagedState", "has_local_split", "materialize", "with_local_split"),
        ".client_map": ("map_clients",),
        ".local": ("LocalResult", "as_single_step", "local_train", "masked_mean_loss"),
        ".server": ("Aggregated", "aggregate_updates", "apply_server_update", "check_aggregator",
                    "initial_round_metrics", "round_metrics"),
        ".tree": ("global_norm", "select_tree"),
        ".rounds": ("ClientOutput", "Round", "client_round", "init_aggregator_state"),
        ".averaging": ("AveragingState", "Downlink", "averaging_algorithm"),
    })

if TYPE_CHECKING:
  from fedjax_opt.core import asynchrony, client_map, clusters, execution, per_client, validation
  from fedjax_opt.core.averaging import AveragingState, Downlink, averaging_algorithm
  from fedjax_opt.core.client_map import map_clients
  from fedjax_opt.core.local import LocalResult, as_single_step, local_train, masked_mean_loss
  from fedjax_opt.core.rounds import ClientOutput, Round, client_round, init_aggregator_state
  from fedjax_opt.core.server import (Aggregated, aggregate_updates, apply_server_update, check_aggregator,
                                      initial_round_metrics, round_metrics)
  from fedjax_opt.core.tree import global_norm, select_tree
  from fedjax_opt.core.types import (Aggregator, ClientBatches, ClientStage, DeferredData, FederatedAlgorithm, LossFn,
                                     PyTree, ServerState, StagedState, has_local_split, materialize,
                                     with_local_split)
