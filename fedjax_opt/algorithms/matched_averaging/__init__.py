"""PFNM and FedMA: average neural networks neuron by neuron after matching their hidden units.

Yurochkin, Agarwal, Ghosh, Greenewald, Hoang, Khazaeni. "Bayesian Nonparametric
Federated Learning of Neural Networks." ICML 2019. arXiv:1905.12022. (PFNM: the
Beta-Bernoulli-process model of neurons and its MAP matching, BBP-MAP.)

Wang, Yurochkin, Sun, Papailiopoulos, Khazaeni. "Federated Learning with
Matched Averaging." ICLR 2020. arXiv:2002.06440. (FedMA: layer-wise matching,
each matching followed by local retraining of the layers above, Algorithm 1.)

Why match. A hidden layer is invariant to a permutation Π of its units:
σ(x W₁) W₂ = σ(x W₁ Π) Πᵀ W₂. Two clients that learn the same features learn
them in different orders, {W₁Π_j, Π_jᵀW₂} and {W₁Π_j', Π_j'ᵀW₂}, and the
coordinate-wise average (W₁Π_j + W₁Π_j')/2 is in general no W₁Π at all. Matched
averaging undoes the permutations first: (W₁Π_jΠ_jᵀ + W₁Π_j'Π_j'ᵀ)/2 = W₁.

The package, one idea a module:

* `neurons`: a layer's units as vectors (incoming weights and bias), moving
  them to their global positions with the next layer's inputs
  (`apply_assignment`), cutting a client's units back out of the global
  model (`select_units`, FedMA's restart), and which models are supported.
* `matching`: BBP-MAP, the matching of one layer's neurons across clients
  (`bbp_map`, `match_client`: the cost and the Hungarian assignment), and
  its settings for every layer (`LayerPrior`: σ per layer, as given, the
  authors' convention and `pfnm`'s default, or in units of the layer's
  weight scale, `fedma`'s default; the width cap).
* `layerwise`: FedMA's Algorithm 1, layer by layer (match, average, move,
  retrain the layers above), and the class-weighted classifier.
* `one_shot`: `pfnm`, Algorithm 1 without retraining.
* `fedma_rounds`: `fedma`, FedMA's rounds of local training and matching, a
  host-driven `(init, run)` rather than a `FederatedAlgorithm`.
* `models`: `fo.models`' MLP and CNN applied for any widths (`matchable`).

    model, layers = fo.algorithms.fedma_model(fo.models.mlp_2nn())   # any widths; ("hidden_0", "hidden_1", "output")
    fedma = fo.algorithms.fedma(model.loss_fn, layers=layers, client_optimizer=optax.sgd(0.05),
                                num_clients=ds.num_clients)
    state = fedma.init(model.init(key), key)
    state, history = fo.train(fedma, state, ds, rounds,
                              fo.Sampling(clients_per_round=10, local_steps=20, batch_size=20),
                              evaluation=fo.Evaluation(metric_fns={"accuracy": model.accuracy_fn}))
                              # one FedMA round = N communications
    global_params = fo.algorithms.pfnm([p_1, ..., p_J], layers=...)   # one-shot, no retraining
"""

from fedjax_opt.algorithms.matched_averaging.fedma_rounds import METRICS, FedMAState, MatchedAveraging, fedma
from fedjax_opt.algorithms.matched_averaging.matching import LayerMatching, LayerPrior, bbp_map, match_client
from fedjax_opt.algorithms.matched_averaging.models import CNN_LAYERS, emnist_cnn_apply, matchable, mlp_apply
from fedjax_opt.algorithms.matched_averaging.neurons import apply_assignment, select_units
from fedjax_opt.algorithms.matched_averaging.one_shot import pfnm

__all__ = ["CNN_LAYERS", "METRICS", "FedMAState", "LayerMatching", "LayerPrior", "MatchedAveraging", "apply_assignment",
           "bbp_map", "emnist_cnn_apply", "fedma", "match_client", "matchable", "mlp_apply", "pfnm", "select_units"]
