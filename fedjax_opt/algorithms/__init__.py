"""Federated algorithms: one family per module, each factory returns a `FederatedAlgorithm`.

Every factory follows the convention of docs/algorithms.md ("The factory
convention"): `name(loss_fn, <the paper's hyper-parameters by symbol>, *,
num_clients=..., client_optimizer=..., server_optimizer=..., aggregator=...)`,
plus the execution policy's keywords `client_map=` (and, where it keeps
per-client tables, `storage_dtype=`), which one decorator,
`core.execution.accepts_policy_keywords`, gives every factory. The same
decorator holds each factory's declaration, as data, of how it treats
`aggregator=` (`factory.aggregation`: `core.execution.TAKES_AGGREGATOR`, or
the reason it takes none, with which it refuses any aggregator in one line);
tests/test_convention.py checks both.

A family's module is imported the first time one of its names is used
(`fedjax_opt.core.lazy`), so `from fedjax_opt.algorithms import fedavg` loads
FedAvg alone.
"""

from typing import TYPE_CHECKING

from fedjax_opt.core import lazy as _lazy

__getattr__, __dir__, __all__ = _lazy.attach(__name__, names={
    # averaging: FedSGD, FedAvg / FedOpt, FedProx, FedNova, SCAFFOLD, FedDyn
    ".fedavg": ("fedsgd", "fedavg", "FedAvgState"),
    ".fedprox": ("fedprox",),
    ".fednova": ("fednova",),
    ".scaffold": ("scaffold", "ScaffoldState"),
    ".feddyn": ("feddyn", "FedDynState"),
    # classical distributed baselines: Newton-type (DANE, FedDANE, FADL, GIANT), primal-dual (CoCoA+), one-shot
    ".dane": ("dane", "feddane", "fadl"),
    ".giant": ("giant",),
    ".cocoa": ("cocoa", "CoCoAState", "cocoa_model", "hinge_optimum"),
    ".one_shot": ("one_shot_average", "OneShotState"),
    "fedjax_opt.core.newton": ("NewtonState",),
    # personalization
    ".mixture": ("l2gd", "l2sgd", "l2sgd_plus", "L2GDState", "L2SGDPlusState", "l2gd_max_step_size",
                 "l2sgd_plus_step_size", "optimal_p"),
    ".per_fedavg": ("per_fedavg", "meta_gradient", "hessian_vector_product"),
    ".pfedme": ("pfedme", "PFedMeState"),
    ".ditto": ("ditto", "DittoState"),
    ".easgd": ("easgd", "EASGDState"),
    ".fedu": ("fedu", "FedUState", "laplacian_penalty"),
    ".fedavg_finetune": ("fedavg_finetune", "FineTuningState"),
    "fedjax_opt.core.per_client": ("personalized_params",),
    # clustered: K cluster models, each client served by one
    ".ifca": ("ifca", "IFCAState"),
    ".clustered_fl": ("clustered_fl", "ClusteredFLState"),
    # mixtures: M shared component models, per-client mixture weights
    ".fedem": ("fedem", "FedEMState", "d_fedem", "DFedEMState", ("fedem_client_params", "client_params"),
               ("fedem_mixture_model", "mixture_model"), ("fedem_responsibilities", "responsibilities")),
    # distillation: clients of different architectures share class scores on public data
    ".fedmd": ("fedmd", "FedMDState", ("fedmd_client_params", "client_params")),
    # ADMM
    ".admm_consensus": ("admm_consensus", "ADMMConsensusState"),
    ".admm_sharing": ("admm_sharing", "ADMMSharingState"),
    ".gadmm": ("gadmm", "cq_ggadmm", "GADMMState", "stochastic_quantize"),
    ".mixture_admm": ("mixture_admm", "MixtureADMMState"),
    "fedjax_opt.core.prox": ("prox_least_squares", "prox_quadratic"),
    # decentralized (a mixing matrix over the nodes, no server)
    ".decentralized": ("gossip", "dpsgd", "gradient_tracking", "DecentralizedState", "consensus_distance"),
    ".p2p_bayes": ("p2p_bayes", "P2PBayesState"),
    # asynchronous aggregation (simulated exactly: fedjax_opt.core.asynchrony)
    ".asynchronous": ("fedbuff", "fedasync", "co_op", "zeno_plus_plus", "AsyncState"),
    # matched averaging (host-driven, growing widths: not FederatedAlgorithms; fo.train runs them on the host)
    ".matched_averaging": ("fedma", "FedMAState", "MatchedAveraging", "pfnm", "bbp_map",
                           ("fedma_model", "matchable")),
})

if TYPE_CHECKING:
  from fedjax_opt.algorithms.admm_consensus import ADMMConsensusState, admm_consensus
  from fedjax_opt.algorithms.admm_sharing import ADMMSharingState, admm_sharing
  from fedjax_opt.algorithms.asynchronous import AsyncState, co_op, fedasync, fedbuff, zeno_plus_plus
  from fedjax_opt.algorithms.clustered_fl import ClusteredFLState, clustered_fl
  from fedjax_opt.algorithms.cocoa import CoCoAState, cocoa, cocoa_model, hinge_optimum
  from fedjax_opt.algorithms.dane import dane, fadl, feddane
  from fedjax_opt.algorithms.decentralized import (DecentralizedState, consensus_distance, dpsgd, gossip,
                                                   gradient_tracking)
  from fedjax_opt.algorithms.ditto import DittoState, ditto
  from fedjax_opt.algorithms.easgd import EASGDState, easgd
  from fedjax_opt.algorithms.fedavg import FedAvgState, fedavg, fedsgd
  from fedjax_opt.algorithms.fedavg_finetune import FineTuningState, fedavg_finetune
  from fedjax_opt.algorithms.feddyn import FedDynState, feddyn
  from fedjax_opt.algorithms.fedem import DFedEMState, FedEMState, d_fedem, fedem
  from fedjax_opt.algorithms.fedem import client_params as fedem_client_params
  from fedjax_opt.algorithms.fedem import mixture_model as fedem_mixture_model
  from fedjax_opt.algorithms.fedem import responsibilities as fedem_responsibilities
  from fedjax_opt.algorithms.fedmd import FedMDState, fedmd
  from fedjax_opt.algorithms.fedmd import client_params as fedmd_client_params
  from fedjax_opt.algorithms.fednova import fednova
  from fedjax_opt.algorithms.fedprox import fedprox
  from fedjax_opt.algorithms.fedu import FedUState, fedu, laplacian_penalty
  from fedjax_opt.algorithms.gadmm import GADMMState, cq_ggadmm, gadmm, stochastic_quantize
  from fedjax_opt.algorithms.giant import giant
  from fedjax_opt.algorithms.ifca import IFCAState, ifca
  from fedjax_opt.algorithms.matched_averaging import FedMAState, MatchedAveraging, bbp_map, fedma, pfnm
  from fedjax_opt.algorithms.matched_averaging import matchable as fedma_model
  from fedjax_opt.algorithms.mixture import (L2GDState, L2SGDPlusState, l2gd, l2gd_max_step_size, l2sgd, l2sgd_plus,
                                             l2sgd_plus_step_size, optimal_p)
  from fedjax_opt.algorithms.mixture_admm import MixtureADMMState, mixture_admm
  from fedjax_opt.algorithms.one_shot import OneShotState, one_shot_average
  from fedjax_opt.algorithms.p2p_bayes import P2PBayesState, p2p_bayes
  from fedjax_opt.algorithms.per_fedavg import hessian_vector_product, meta_gradient, per_fedavg
  from fedjax_opt.algorithms.pfedme import PFedMeState, pfedme
  from fedjax_opt.algorithms.scaffold import ScaffoldState, scaffold
  from fedjax_opt.core.newton import NewtonState
  from fedjax_opt.core.per_client import personalized_params
  from fedjax_opt.core.prox import prox_least_squares, prox_quadratic
