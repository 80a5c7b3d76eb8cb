"""Federated algorithms: one family per module, each factory returns a FederatedAlgorithm."""

from fedjax_opt.algorithms.fedavg import FedAvgState, fedavg, fedsgd
from fedjax_opt.algorithms.feddyn import FedDynState, feddyn
from fedjax_opt.algorithms.fednova import fednova
from fedjax_opt.algorithms.fedprox import fedprox
from fedjax_opt.algorithms.scaffold import ScaffoldState, scaffold
