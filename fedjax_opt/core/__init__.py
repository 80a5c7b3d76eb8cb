"""Shared mechanics: the contracts, client mapping, local training, server-side aggregation."""

from fedjax_opt.core import asynchrony, client_map, clusters, per_client, validation
from fedjax_opt.core.client_map import map_clients
from fedjax_opt.core.local import LocalResult, as_single_step, local_train, masked_mean_loss
from fedjax_opt.core.server import (Aggregated, aggregate_updates, apply_server_update, check_aggregator,
                                    initial_round_metrics, round_metrics)
from fedjax_opt.core.tree import global_norm, select_tree
from fedjax_opt.core.types import (Aggregator, ClientBatches, DeferredData, FederatedAlgorithm, LossFn, PyTree, ServerState,
                                   materialize)
from fedjax_opt.core.averaging import AveragingState, averaging_algorithm
from fedjax_opt.core.rounds import ClientOutput, Round, client_round
