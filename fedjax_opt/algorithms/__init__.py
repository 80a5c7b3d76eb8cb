"""Federated algorithms: one family per module, each factory returns a FederatedAlgorithm."""

from fedjax_opt.algorithms.fedavg import FedAvgState, fedavg, fedsgd
