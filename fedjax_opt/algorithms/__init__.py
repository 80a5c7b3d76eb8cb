"""Federated algorithms: one family per module, each factory returns a FederatedAlgorithm."""

from fedjax_opt.algorithms.fedavg import FedAvgState, fedavg, fedsgd
from fedjax_opt.algorithms.feddyn import FedDynState, feddyn
from fedjax_opt.algorithms.fednova import fednova
from fedjax_opt.algorithms.fedprox import fedprox
from fedjax_opt.algorithms.scaffold import ScaffoldState, scaffold
from fedjax_opt.algorithms.admm import (ADMMConsensusState, ADMMSharingState, admm_consensus, admm_sharing,
                                        prox_least_squares, prox_quadratic)
from fedjax_opt.algorithms.mixture import (L2GDState, L2SGDPlusState, l2gd, l2gd_max_step_size, l2sgd, l2sgd_plus,
                                           l2sgd_plus_step_size, optimal_p, personalized_params)
from fedjax_opt.algorithms.ditto import DittoState, ditto
from fedjax_opt.algorithms.per_fedavg import per_fedavg, personalize
from fedjax_opt.algorithms.pfedme import PFedMeState, pfedme
from fedjax_opt.algorithms.easgd import EASGDState, easgd
from fedjax_opt.algorithms.fedu import FedUState, fedu, laplacian_penalty
from fedjax_opt.algorithms.fedavg_finetune import FineTuning, FineTuningState, fedavg_finetune
from fedjax_opt.algorithms.mixture_admm import MixtureADMMState, mixture_admm
from fedjax_opt.algorithms.gadmm import GADMMState, cq_ggadmm, gadmm, stochastic_quantize
