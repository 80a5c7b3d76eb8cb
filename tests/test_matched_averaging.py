"""PFNM and FedMA (fedjax_opt/algorithms/matched_averaging/) against independent references.

* Permutation invariance (both papers' argument): J copies of one network whose
  hidden units were randomly permuted are matched back to that network exactly
  (up to a permutation, undone here by nearest-neuron search), for an MLP and
  for the EMNIST CNN's conv channels; the coordinate-wise average of the
  copies computes another function. One client: its own model comes back.
* The BBP-MAP assignment of one client equals a brute-force NumPy search: over
  permutations (squared distance, the flat-prior equal-count case) and over all
  assignments with new neurons (the log posterior evaluated term by term).
* Growth: with a flat prior, J = 2 and one global neuron u, a client neuron v
  opens a new neuron exactly when ‖u − v‖² > 4σ² log(2/γ₀) (closed form).
* Moving a layer's units and the next layer's inputs (dense, conv → conv,
  conv → flatten → dense) leaves the network's outputs unchanged (flax apply of
  the original as reference).
* FedMA's restart (the authors' `reconstruct_local_net`): each client starts
  a round from the global model cut to its last assignment, against a NumPy
  transcription; σ in each layer's own units (a closed-form threshold), per
  layer values, the width cap.
* End to end (slow): FedMA on digits, Dirichlet(0.5), an MLP, against FedAvg
  with the same upload.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedjax_opt as fo
from fedjax_opt.algorithms import matched_averaging as ma
from fedjax_opt.algorithms.matched_averaging import neurons as ma_neurons

MLP_LAYERS = ("hidden_0", "hidden_1", "output")
CNN_LAYERS = ("conv_0", "conv_1", "dense", "output")


def _random_params(shapes, seed):
  """Parameters of the given kernel shapes drawn in NumPy (no flax init to compile), biases nonzero."""
  rng = np.random.default_rng(seed)
  return {name: {"kernel": (rng.normal(size=shape) / math.sqrt(math.prod(shape[:-1]))).astype(np.float32),
                 "bias": (0.1 * rng.normal(size=shape[-1])).astype(np.float32)} for name, shape in shapes.items()}


def _mlp(input_dim=6, hidden=(5, 4), classes=3, seed=0):
  """`fo.models.MLP` (the flax module: the reference apply) and random params of its shapes."""
  model = fo.models.from_flax(fo.models.MLP(input_dim, hidden, classes), (input_dim,))
  dims = (input_dim, *hidden, classes)
  names = [f"hidden_{i}" for i in range(len(hidden))] + ["output"]
  return model, _random_params({n: (dims[i], dims[i + 1]) for i, n in enumerate(names)}, seed)


def _cnn(seed=0):
  """`fo.models.emnist_cnn` on 8×8 images, 4 classes, and random params of its shapes."""
  model = fo.models.emnist_cnn(4, image_shape=(8, 8))
  return model, _random_params({"conv_0": (3, 3, 1, 32), "conv_1": (3, 3, 32, 64), "dense": (256, 128),
                                "output": (128, 4)}, seed)


def _permuted(params, layers, rng):
  """The same network with every hidden layer's units in a random order."""
  for n, name in enumerate(layers[:-1]):
    width = np.shape(params[name]["bias"])[0]
    params = ma.apply_assignment(params, layers, n, rng.permutation(width), width)
  return params


def _unpermute(candidate, reference, layers):
  """`candidate` with each hidden layer's units moved to the position of the nearest unit of `reference`."""
  for n, name in enumerate(layers[:-1]):
    got, want = ma_neurons.as_neurons(candidate[name]), ma_neurons.as_neurons(reference[name])
    order = np.argmin(((got[:, None] - want[None]) ** 2).sum(-1), axis=1)
    assert sorted(order) == list(range(len(want))), "matched units are not a permutation of the reference's"
    candidate = ma.apply_assignment(jax.tree.map(np.asarray, candidate), layers, n, order, len(want))
  return candidate


def _assert_same_params(a, b, atol=1e-6):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


# ---- permutation invariance ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, layers, x_shape", [(_mlp, MLP_LAYERS, (7, 6)), (_cnn, CNN_LAYERS, (5, 8, 8, 1))])
def test_permuted_copies_are_matched_back_to_the_network_and_coordinate_averaging_is_not(make, layers, x_shape):
  model, params = make()
  rng = np.random.default_rng(1)
  copies = [_permuted(params, layers, rng) for _ in range(4)]
  x = rng.normal(size=x_shape).astype(np.float32)
  reference = np.asarray(model.apply(params, x))
  for c in copies:  # the copies compute the reference function (the invariance itself)
    np.testing.assert_allclose(model.apply(c, x), reference, atol=1e-5)
  matched = fo.algorithms.pfnm(copies, layers=layers)
  _assert_same_params(_unpermute(matched, params, layers), params)
  apply = ma.mlp_apply if layers == MLP_LAYERS else ma.emnist_cnn_apply
  np.testing.assert_allclose(apply(matched, x), reference, atol=1e-5)
  averaged = jax.tree.map(lambda *a: np.mean(a, axis=0), *copies)
  assert np.abs(np.asarray(model.apply(averaged, x)) - reference).max() > 1e-2


def _numpy_mlp(params, x):
  """The ReLU MLP of `MLP_LAYERS` evaluated in float64 NumPy: the reference function."""
  h = np.asarray(x, np.float64)
  for name in MLP_LAYERS[:-1]:
    h = np.maximum(h @ np.asarray(params[name]["kernel"], np.float64) + np.asarray(params[name]["bias"], np.float64),
                   0)
  return h @ np.asarray(params["output"]["kernel"], np.float64) + np.asarray(params["output"]["bias"], np.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pfnm_matches_noisy_permuted_copies_without_spurious_units_in_the_authors_units(seed):
  """Four copies of an 8-10-8-3 MLP (weights of RMS ≈ 0.3), each with N(0, 0.01²) noise on every weight and its hidden
  units permuted, through `pfnm(sigma=0.1, sigma0=10, gamma=1)` with the default (absolute) prior: the original
  widths 10 and 8 (no spurious unit), the matched model is exactly the mean of the noisy copies with their units
  put back in order, and its function (float64 NumPy on random inputs) is closer to the original's than a single
  noisy copy's is (averaging four copies shrinks the noise). The scale-free `prior_scale="layer"` reads σ = 0.1 as
  0.1 of each layer's RMS coordinate, far stricter: with seed 0 it opens 3 spurious units in the second layer
  and the function is off by more than the outputs' own RMS."""
  params = _random_params({"hidden_0": (8, 10), "hidden_1": (10, 8), "output": (8, 3)}, seed)
  rng = np.random.default_rng(100 + seed)
  noisy = [jax.tree.map(lambda a: (a + 0.01 * rng.normal(size=a.shape)).astype(np.float32), params)
           for _ in range(4)]
  copies = [_permuted(c, MLP_LAYERS, rng) for c in noisy]
  x = rng.normal(size=(256, 8))
  reference = _numpy_mlp(params, x)
  prior = dict(layers=MLP_LAYERS, sigma=0.1, sigma0=10.0, gamma=1.0)
  matched = fo.algorithms.pfnm(copies, **prior)
  assert [np.shape(matched[n]["bias"])[0] for n in MLP_LAYERS[:-1]] == [10, 8]
  mean = jax.tree.map(lambda *a: np.mean(np.asarray(a, np.float64), axis=0), *noisy)
  _assert_same_params(_unpermute(matched, params, MLP_LAYERS), mean, atol=1e-6)
  rms = lambda p: float(np.sqrt(np.mean((_numpy_mlp(p, x) - reference)**2)))  # noqa: E731
  single = np.mean([rms(c) for c in noisy])
  assert rms(matched) < 0.7 * single and rms(matched) < 0.05 * np.sqrt(np.mean(reference**2))
  if seed == 0:
    layer = fo.algorithms.pfnm(copies, **prior, prior_scale="layer")
    assert [np.shape(layer[n]["bias"])[0] for n in MLP_LAYERS[:-1]] == [10, 11]
    assert rms(layer) > np.sqrt(np.mean(reference**2))


@pytest.fixture(scope="module")
def frozen():
  """FedMA without local training (lr 0) on the MLP 6-5-4-3, layers at most as wide as the clients', no refinement
  passes, the classifier averaged with the clients' weights: one set of compiled programs (3 clients of widths
  5, 4) for the tests that use it."""
  return fo.algorithms.fedma(fo.models.classification_loss(ma.mlp_apply), layers=MLP_LAYERS,
                             client_optimizer=optax.sgd(0.0), num_clients=4, client_map="vmap", iterations=0,
                             max_growth=1.0, class_weighted=False)


def test_fedma_match_without_training_returns_permuted_copies_as_one_network(frozen):
  model, params = _mlp()
  rng = np.random.default_rng(2)
  copies = [_permuted(params, MLP_LAYERS, rng) for _ in range(3)]
  batches = _batches(rng, num_clients=3, input_dim=6, classes=3)
  matched, info = frozen.match(jax.tree.map(lambda *a: np.stack(a), *copies), batches)
  assert info["widths"] == [5, 4] and info["num_clients"] == 3
  _assert_same_params(_unpermute(matched, params, MLP_LAYERS), params)


def test_a_single_client_gets_its_own_model_back():
  _, params = _mlp()
  _assert_same_params(fo.algorithms.pfnm([params], layers=MLP_LAYERS), params, atol=0)
  _, cnn = _cnn()
  _assert_same_params(fo.algorithms.pfnm([cnn], layers=CNN_LAYERS), cnn, atol=0)
  fedma = fo.algorithms.fedma(fo.models.classification_loss(ma.mlp_apply), layers=MLP_LAYERS,
                              client_optimizer=optax.sgd(0.0), num_clients=1, client_map="vmap")
  batches = _batches(np.random.default_rng(0), num_clients=1, input_dim=6, classes=3)
  matched, _ = fedma.match(jax.tree.map(lambda a: a[None], params), batches)
  _assert_same_params(matched, params, atol=0)


def test_the_classifier_is_the_class_weighted_average_of_the_clients_classifiers():
  """Permuted copies of one network's hidden layers (matched back exactly), each client with its own classifier W_j.
  Column k of the global classifier (and its bias) is Σ_j n_jk W_j[:, k] / Σ_j n_jk (FedMA, Algorithm 1), and
  Σ_j n_j W_j[:, k] / Σ_j n_j for a class no client holds; NumPy in the network's own unit order. Classes 0 and 2
  are each held by one client (their columns are that client's), class 1 by two, class 3 by none; n_j weights
  everywhere would give other columns. `class_counts` as nested lists (any array-like)."""
  _, base = _mlp(classes=4, seed=3)
  rng = np.random.default_rng(4)
  heads = [_random_params({"output": (4, 4)}, seed=10 + j)["output"] for j in range(3)]
  clients = [_permuted(dict(base, output=head), MLP_LAYERS, rng) for head in heads]
  counts = [[6, 2, 0, 0], [0, 5, 0, 0], [0, 0, 9, 0]]  # n_jk; n_j = 8, 5, 9
  n_j = np.asarray(counts, np.float64).sum(1)
  matched = fo.algorithms.pfnm(clients, layers=MLP_LAYERS, client_weights=n_j.tolist(), class_counts=counts)
  got = _unpermute(matched, base, MLP_LAYERS)
  _assert_same_params({k: got[k] for k in MLP_LAYERS[:-1]}, {k: base[k] for k in MLP_LAYERS[:-1]})
  stacked = {leaf: np.stack([np.asarray(h[leaf], np.float64) for h in heads]) for leaf in ("kernel", "bias")}
  weights = np.asarray(counts, np.float64)
  weights[:, 3] = n_j  # class 3: held by no client, the n_j fallback
  for leaf, values in stacked.items():  # values [J, ..., K]; the class axis is the last
    expected = np.einsum("jk,j...k->...k", weights, values) / weights.sum(0)
    np.testing.assert_allclose(np.asarray(got["output"][leaf]), expected, atol=1e-6, rtol=0)
  np.testing.assert_allclose(np.asarray(got["output"]["kernel"][:, 0]), stacked["kernel"][0, :, 0], atol=1e-6)
  np.testing.assert_allclose(np.asarray(got["output"]["kernel"][:, 2]), stacked["kernel"][2, :, 2], atol=1e-6)


def test_without_class_weights_fedma_averages_the_classifier_with_the_clients_weights(frozen):
  """`class_weighted=False`: W_N = Σ_j n_j W_{j,N} / Σ_j n_j (FedAvg's weights), whatever the round's labels;
  NumPy in the network's own unit order (the hidden layers, permuted copies, come back exactly)."""
  _, base = _mlp(seed=3)
  rng = np.random.default_rng(5)
  heads = [_random_params({"output": (4, 3)}, seed=40 + j)["output"] for j in range(3)]
  clients = [_permuted(dict(base, output=head), MLP_LAYERS, rng) for head in heads]
  weights = np.array([2.0, 5.0, 9.0])
  batches = _batches(rng, num_clients=3, input_dim=6, classes=3).replace(weight=jnp.asarray(weights, jnp.float32))
  matched, _ = frozen.match(jax.tree.map(lambda *a: np.stack(a), *clients), batches)
  got = _unpermute(matched, base, MLP_LAYERS)
  for leaf in ("kernel", "bias"):
    expected = sum(w * np.asarray(h[leaf], np.float64) for w, h in zip(weights, heads)) / weights.sum()
    np.testing.assert_allclose(np.asarray(got["output"][leaf]), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("counts, message", [
    ([[1, 2, 3], [4, 5, 6]], r"class_counts must be \[J, K\] = \(2, 4\)"),
    ([[1, 2, 3, 4]], r"class_counts must be \[J, K\] = \(2, 4\)"),
    ([[1, -2, 3, 4], [0, 0, 0, 1]], "class_counts must be finite and >= 0"),
    ([[1, 2, np.nan, 4], [0, 0, 0, 1]], "class_counts must be finite and >= 0"),
    ("many", "class_counts must be"),
])
def test_pfnm_refuses_bad_class_counts_in_one_line(counts, message):
  _, params = _mlp(classes=4)
  with pytest.raises(ValueError, match=message) as info:
    fo.algorithms.pfnm([params, params], layers=MLP_LAYERS, class_counts=counts)
  assert "\n" not in str(info.value)


# ---- one layer's matching against brute force --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_assignment_with_equal_counts_and_a_flat_prior_is_the_nearest_permutation(seed):
  """σ₀ = ∞, every m_i = m: G_il = −m‖ū_i − v_l‖²/((m+1)σ²) + const(l), so BBP-MAP minimizes Σ‖ū_π(l) − v_l‖²."""
  rng = np.random.default_rng(seed)
  m, width, dim = 2, 5, 4
  means = rng.normal(size=(width, dim))
  neurons = rng.normal(size=(width, dim))
  got = ma.match_client(m * means, np.full(width, m), neurons, num_clients=4, sigma=0.7, sigma0=math.inf,
                        gamma=1e-6)
  best = min(itertools.permutations(range(width)),
             key=lambda p: sum(np.sum((means[p[l]] - neurons[l]) ** 2) for l in range(width)))
  np.testing.assert_array_equal(got, best)


def _log_posterior_x2(atoms, num_clients, sigma, sigma0, gamma, mu0, new_count):
  """2 × the log posterior (at the MAP θ, up to constants) of one client's assignment, term by term.

  `atoms`: per global neuron, the list of its matched vectors (the client's included) and m_i^{−j} (−1: new).
  """
  total = 0.0
  for vectors, m_other in atoms:
    vectors = np.asarray(vectors)
    precision = 1 / sigma0**2 + len(vectors) / sigma**2
    theta = (mu0 / sigma0**2 + vectors.sum(0) / sigma**2) / precision
    total += 2 * (-np.sum((theta - mu0) ** 2) / (2 * sigma0**2) - np.sum((vectors - theta) ** 2) / (2 * sigma**2))
    if m_other > 0 and len(vectors) > m_other:  # the client uses an existing neuron
      total += 2 * np.log(m_other / (num_clients - m_other))
  # new neurons: Poisson(γ₀/J) many, in any order: (γ₀/J)^k / k!
  total += 2 * (new_count * np.log(gamma / num_clients) - math.lgamma(new_count + 1))
  return total


@pytest.mark.parametrize("seed", range(6))
def test_assignment_with_growth_maximizes_the_log_posterior_by_brute_force(seed):
  rng = np.random.default_rng(seed)
  num_clients, sigma, sigma0, gamma, mu0 = 5, 0.6, 1.5, 1.0, 0.1
  counts = np.array([1, 2, 3])
  atoms = [rng.normal(size=(m, 3)) for m in counts]
  # client neurons: one near atom 1, one near atom 0, one far from all
  neurons = np.stack([atoms[1].mean(0) + 0.1 * rng.normal(size=3), atoms[0][0] + 0.2 * rng.normal(size=3),
                      4.0 * rng.normal(size=3) + 3.0])
  got = ma.match_client(np.stack([a.sum(0) for a in atoms]), counts, neurons, num_clients=num_clients, sigma=sigma,
                        sigma0=sigma0, gamma=gamma, mu0=mu0)
  best, best_value = None, -np.inf
  choices = list(range(len(atoms))) + ["new"]
  for choice in itertools.product(choices, repeat=len(neurons)):
    used = [c for c in choice if c != "new"]
    if len(used) != len(set(used)):
      continue
    groups = [(list(a) + [neurons[l] for l, c in enumerate(choice) if c == i], m) for i, (a, m) in
              enumerate(zip(atoms, counts))]
    groups += [([neurons[l]], -1) for l, c in enumerate(choice) if c == "new"]
    value = _log_posterior_x2(groups, num_clients, sigma, sigma0, gamma, mu0, choice.count("new"))
    if value > best_value:
      best, best_value = choice, value
  as_choice = tuple(int(i) if i < len(atoms) else "new" for i in got)
  assert as_choice == best, (as_choice, best)


@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_a_new_neuron_opens_exactly_beyond_the_closed_form_distance(gamma):
  """σ₀ = ∞, J = 2, one global neuron u (m = 1): new iff ‖u − v‖² > 4σ² log(2/γ₀)."""
  sigma, rng = 0.3, np.random.default_rng(0)
  u = rng.normal(size=6)
  direction = rng.normal(size=6)
  direction /= np.linalg.norm(direction)
  threshold = math.sqrt(4 * sigma**2 * math.log(2 / gamma))
  for scale, opens in ((0.99, False), (1.01, True)):
    v = u + scale * threshold * direction
    got = ma.match_client(u[None], np.ones(1), v[None], num_clients=2, sigma=sigma, sigma0=math.inf, gamma=gamma)
    assert (got[0] == 1) == opens
    matching = fo.algorithms.bbp_map([u[None], v[None]], sigma=sigma, sigma0=math.inf, gamma=gamma, iterations=2)
    assert matching.width == (2 if opens else 1)


def test_the_global_layer_grows_for_a_client_unit_far_from_every_global_unit():
  _, params = _mlp()
  other = jax.tree.map(np.copy, params)
  other["hidden_0"]["kernel"][:, 2] = 50.0  # unit 2 of the second client is far from every unit
  matched = fo.algorithms.pfnm([params, other], layers=MLP_LAYERS, sigma=0.5, prior_scale="absolute")
  assert matched["hidden_0"]["kernel"].shape == (6, 6) and matched["hidden_1"]["kernel"].shape == (6, 4)
  # the new unit holds the far unit alone; its outgoing row is the second client's (the first has none)
  new = int(np.argmax(np.asarray(matched["hidden_0"]["kernel"])[0]))
  np.testing.assert_allclose(matched["hidden_0"]["kernel"][:, new], other["hidden_0"]["kernel"][:, 2], atol=1e-6)
  np.testing.assert_allclose(matched["hidden_1"]["kernel"][new], other["hidden_1"]["kernel"][2], atol=1e-6)


# ---- moving units keeps the network's function ------------------------------------------------------------------


@pytest.mark.parametrize("make, layers, x_shape", [(_mlp, MLP_LAYERS, (7, 6)), (_cnn, CNN_LAYERS, (5, 8, 8, 1))])
def test_moving_units_into_a_wider_layer_and_the_next_inputs_keeps_the_outputs(make, layers, x_shape):
  model, params = make()
  rng = np.random.default_rng(3)
  x = rng.normal(size=x_shape).astype(np.float32)
  apply = ma.mlp_apply if layers == MLP_LAYERS else ma.emnist_cnn_apply
  np.testing.assert_allclose(apply(params, x), model.apply(params, x), atol=1e-5)  # the width-agnostic apply
  moved = params
  for n, name in enumerate(layers[:-1]):  # conv -> conv, conv -> flatten -> dense, dense -> dense
    width = np.shape(params[name]["bias"])[0]
    assignment = rng.permutation(width + 3)[:width]
    moved = ma.apply_assignment(moved, layers, n, assignment, width + 3)
    assert np.shape(moved[name]["bias"]) == (width + 3,)
  np.testing.assert_allclose(apply(moved, x), model.apply(params, x), atol=1e-5)


# ---- FedMA rounds ------------------------------------------------------------------------------------------------


def _batches(rng, num_clients, input_dim, classes, steps=3, batch=4):
  x = rng.normal(size=(num_clients, steps, batch, input_dim)).astype(np.float32)
  y = rng.integers(0, classes, size=(num_clients, steps, batch)).astype(np.int32)
  return fo.ClientBatches(data={"x": jnp.asarray(x), "y": jnp.asarray(y)},
                          mask=jnp.ones((num_clients, steps, batch), bool),
                          weight=jnp.full((num_clients,), float(steps * batch)),
                          client_id=jnp.arange(num_clients, dtype=jnp.int32))


def _poisoned_client_setup(seed):
  """(params, 3 clients' batches with a NaN in client 1's first example, FedMA on the MLP) of the next tests."""
  _, params = _mlp()
  batches = _batches(np.random.default_rng(seed), num_clients=3, input_dim=6, classes=3)
  x = np.array(batches.data["x"])
  x[1, 0, 0, 0] = np.nan
  batches = batches.replace(data={"x": jnp.asarray(x), "y": batches.data["y"]})
  fedma = fo.algorithms.fedma(fo.models.classification_loss(ma.mlp_apply), layers=MLP_LAYERS,
                              client_optimizer=optax.sgd(0.1), num_clients=3, client_map="vmap")
  return params, batches, fedma


def test_fedma_round_reports_its_communication_and_leaves_out_a_poisoned_client():
  params, batches, fedma = _poisoned_client_setup(4)
  state = fedma.init(params, jax.random.key(0))
  state = fedma.run(state, batches)
  assert int(state.round) == 1
  assert float(state.metrics["num_nonfinite"]) == 1 and float(state.metrics["num_clients"]) == 2
  assert float(state.metrics["communication_rounds"]) == 3
  widths = [int(w) for w in state.metrics["widths"]]
  assert widths == [np.shape(state.params[n]["bias"])[0] for n in MLP_LAYERS[:-1]]
  # each of the 2 clients uploads each layer once, its inputs in the global widths of the layer below
  expected = 2 * ((6 + 1) * 5 + (widths[0] + 1) * 4 + (widths[1] + 1) * 3)
  assert float(state.metrics["uploaded_floats"]) == expected
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(state.params))


def test_a_client_whose_retraining_diverges_is_left_out_of_the_later_layers():
  """`match` on finite client models whose data make the retraining above layer 1 NaN for client 1."""
  params, batches, fedma = _poisoned_client_setup(5)
  clients = jax.tree.map(lambda a: jnp.stack([a, a * 1.01, a * 0.99]), params)  # finite: the first check passes
  merged, info = fedma.match(clients, batches)
  assert info["num_nonfinite"] == 1 and info["num_clients"] == 2 and info["uploaders"] == 3
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(merged))


def test_invalid_inputs_raise_clear_errors():
  _, params = _mlp()
  with pytest.raises(ValueError, match="exactly the layers"):
    fo.algorithms.pfnm([params], layers=("hidden_0", "output"))
  with pytest.raises(ValueError, match="gamma"):
    fo.algorithms.pfnm([params], layers=MLP_LAYERS, gamma=0.0)
  with pytest.raises(ValueError, match="counts"):
    ma.match_client(np.zeros((2, 3)), np.array([1, 4]), np.zeros((2, 3)), num_clients=4)


# ---- σ per layer and the width cap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_in_layer_units_a_new_neuron_opens_beyond_the_closed_form_distance_scaled_by_the_layers_rms(gamma):
  """prior_scale="layer": σ is in units of r, the root-mean-square coordinate of the units being matched,
  r² = (‖u‖² + ‖v‖²)/(2D); so with σ₀ = ∞, J = 2, one unit u: new iff ‖u − v‖² > 4σ²r² log(2/γ₀). The same
  distance at another weight scale (the layer times 1000) gives the same decision; absolute units do not."""
  sigma, rng = 0.3, np.random.default_rng(1)
  u = rng.normal(size=6)
  direction = rng.normal(size=6)
  direction /= np.linalg.norm(direction)
  prior = ma.LayerPrior.make(1, sigma=sigma, sigma0=math.inf, gamma=gamma)
  for scale, opens in ((0.99, False), (1.01, True)):
    # v = u + t·d with ‖u − v‖² = 4σ²r²log(2/γ₀), r² = (‖u‖² + ‖u + t d‖²)/12: a quadratic in t, solved here
    k = 4 * sigma**2 * math.log(2 / gamma) / 12
    a, b, c = 1 - k, -2 * k * (u @ direction), -2 * k * (u @ u)
    t = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    v = u + scale * t * direction
    r = math.sqrt((u @ u + v @ v) / 12)
    for factor in (1.0, 1000.0):
      options = prior.for_layer(0, [factor * u[None], factor * v[None]])
      assert options["sigma"] == pytest.approx(sigma * factor * r, rel=1e-12)
      matching = fo.algorithms.bbp_map([factor * u[None], factor * v[None]], **options)
      assert matching.width == (2 if opens else 1)
  absolute = ma.LayerPrior.make(1, sigma=sigma, sigma0=math.inf, gamma=gamma, scale="absolute")
  far = fo.algorithms.bbp_map([1000 * u[None], 1000 * (u + 0.5 * t * direction)[None]], **absolute.for_layer(0, []))
  assert far.width == 2  # half the threshold distance in layer units, far beyond σ = 0.3 in absolute ones


def test_sigma_gamma_and_the_cap_may_be_set_per_layer():
  """Two unrelated MLPs: with σ tiny in layer 0 and huge in layer 1 (absolute), layer 0 keeps every unit of both
  (5 + 5) and layer 1 matches all (4); the reverse sequence the reverse; a sequence of the wrong length is refused."""
  _, a = _mlp(seed=20)
  _, b = _mlp(seed=21)
  grow_then_match = fo.algorithms.pfnm([a, b], layers=MLP_LAYERS, sigma=(1e-3, 1e3), sigma0=1e3,
                                       prior_scale="absolute")
  assert [np.shape(grow_then_match[n]["bias"])[0] for n in MLP_LAYERS[:-1]] == [10, 4]
  match_then_grow = fo.algorithms.pfnm([a, b], layers=MLP_LAYERS, sigma=[1e3, 1e-3], sigma0=1e3,
                                       prior_scale="absolute")
  assert [np.shape(match_then_grow[n]["bias"])[0] for n in MLP_LAYERS[:-1]] == [5, 8]
  capped = fo.algorithms.pfnm([a, b], layers=MLP_LAYERS, sigma=1e-3, sigma0=1e3, prior_scale="absolute",
                              max_width=(7, 6))
  assert [np.shape(capped[n]["bias"])[0] for n in MLP_LAYERS[:-1]] == [7, 6]
  with pytest.raises(ValueError, match=r"sigma must be one value for every layer or one per hidden layer \(2\)"):
    fo.algorithms.pfnm([a, b], layers=MLP_LAYERS, sigma=(1.0, 1.0, 1.0))
  with pytest.raises(ValueError, match="prior_scale must be one of"):
    fo.algorithms.pfnm([a, b], layers=MLP_LAYERS, prior_scale="relative")


def test_the_cap_is_the_smaller_of_max_width_and_max_growth_times_the_clients_width(frozen):
  """Three unrelated clients (6-5-4-3) whose every unit opens a new global unit (σ tiny): 15 and 12 units uncapped;
  max_growth = 2 caps at 10 and 8, max_width = (7, 12) with it at the smaller: 7 and 8. At σ = 1 in layer units
  (`fedma`'s default) `pfnm` without a cap grows the layers, and `fedma`'s shared `frozen` (max_growth = 1) keeps
  the clients' 5 and 4. Bad caps are refused."""
  clients = [_mlp(seed=30 + j)[1] for j in range(3)]
  tiny = dict(layers=MLP_LAYERS, sigma=1e-3, prior_scale="absolute", iterations=0)
  for options, widths in ((dict(), [15, 12]), (dict(max_growth=2.0), [10, 8]),
                          (dict(max_growth=2, max_width=(7, 12)), [7, 8])):
    merged = fo.algorithms.pfnm(clients, **tiny, **options)
    assert [np.shape(merged[n]["bias"])[0] for n in MLP_LAYERS[:-1]] == widths, options
  uncapped = fo.algorithms.pfnm(clients, layers=MLP_LAYERS, prior_scale="layer")  # fedma's σ units, no cap
  assert [np.shape(uncapped[n]["bias"])[0] for n in MLP_LAYERS[:-1]] > [5, 4]
  batches = _batches(np.random.default_rng(3), num_clients=3, input_dim=6, classes=3)
  assert frozen.match(jax.tree.map(lambda *a: np.stack(a), *clients), batches)[1]["widths"] == [5, 4]
  for bad in (0.5, float("nan"), "2"):
    with pytest.raises(ValueError, match="max_growth must be None or a finite number >= 1"):
      fo.algorithms.fedma(fo.models.classification_loss(ma.mlp_apply), layers=MLP_LAYERS,
                          client_optimizer=optax.sgd(0.0), num_clients=3, max_growth=bad)
  with pytest.raises(ValueError, match="max_width must be None or an int >= 1"):
    fo.algorithms.pfnm(clients, layers=MLP_LAYERS, max_width=(7, 0))


# ---- FedMA's restart from the global model (the authors' reconstruct_local_net) ------------------------------------


def _restart_reference(global_params, layers, chosen, flat_positions=None):
  """IBM/FedMA's `reconstruct_local_net`, transcribed in NumPy float64: layer n keeps the global units `chosen[n]`
  (kernel columns / filters, biases) and the rows of the layer above that read them; after the last conv, dense
  input row p·C + c reads channel c at position p (channels-last flatten), so the rows kept are p·C + chosen[n]."""
  out = {k: {leaf: np.asarray(v, np.float64) for leaf, v in global_params[k].items()} for k in layers}
  for n, name in enumerate(layers[:-1]):
    a = np.asarray(chosen[n])
    out[name]["kernel"], out[name]["bias"] = out[name]["kernel"][..., a], out[name]["bias"][a]
    above = out[layers[n + 1]]["kernel"]
    if above.ndim == 4:  # conv -> conv: input channels
      out[layers[n + 1]]["kernel"] = above[:, :, a, :]
    elif flat_positions and name in flat_positions:  # conv -> flatten -> dense
      width = np.shape(global_params[name]["bias"])[0]
      rows = [p * width + c for p in range(flat_positions[name]) for c in a]
      out[layers[n + 1]]["kernel"] = above[rows]
    else:  # dense -> dense
      out[layers[n + 1]]["kernel"] = above[a]
  return out


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_select_units_is_the_authors_client_restart_and_undoes_moving_a_client_into_the_global_model(kind):
  rng = np.random.default_rng(7)
  if kind == "mlp":
    layers, flat = MLP_LAYERS, None
    wide = _random_params({"hidden_0": (6, 9), "hidden_1": (9, 7), "output": (7, 3)}, seed=8)
    client_widths = (5, 4)
  else:
    layers, flat = CNN_LAYERS, {"conv_1": 4}  # 8×8 → 6×6 → 4×4 → pooled 2×2: 4 positions
    wide = _random_params({"conv_0": (3, 3, 1, 40), "conv_1": (3, 3, 40, 70), "dense": (4 * 70, 130),
                           "output": (130, 4)}, seed=8)
    client_widths = (32, 64, 128)
  chosen = [rng.permutation(np.shape(wide[n]["bias"])[0])[:w] for n, w in zip(layers, client_widths)]
  got = ma.select_units(wide, layers, chosen)
  _assert_same_params(got, _restart_reference(wide, layers, chosen, flat), atol=0)
  # A client moved into the global positions (zeros elsewhere) and cut back out is the client again.
  client = jax.tree.map(np.asarray, got)
  moved = client
  for n, name in enumerate(layers[:-1]):
    moved = ma.apply_assignment(moved, layers, n, chosen[n], np.shape(wide[name]["bias"])[0])
  _assert_same_params(ma.select_units(moved, layers, chosen), client, atol=0)


def test_a_fedma_round_restarts_each_client_from_the_global_model_cut_to_its_last_assignment(frozen):
  """A state after round 1 whose global model (widths 8, 7) was matched from clients 0 and 2 of widths 5, 4 (their
  assignments in the state); client 1's assignment is from round 0 (stale: it indexes another global model),
  client 3 was never matched. The round takes clients 2, 1 and 3 with local training off (lr 0; no refinement
  passes), so it is the matching of its starts: client 2 starts from the global model cut to its assignment (the
  NumPy transcription of the authors' restart), clients 1 and 3 from the 5 and 4 global units that clients 0 and
  2 used most (ties: the lower index). Starting everyone from the whole global model (before) matches other
  models."""
  _, wide = _mlp(hidden=(8, 7), seed=12)
  _, params = _mlp()
  rng = np.random.default_rng(11)
  tables = {"hidden_0": np.stack([rng.permutation(8)[:5] for _ in range(3)] + [np.full(5, -1)]),
            "hidden_1": np.stack([rng.permutation(7)[:4] for _ in range(3)] + [np.full(4, -1)])}
  state = frozen.init(params, jax.random.key(0))
  assert {n: a.shape for n, a in state.assignments.items()} == {"hidden_0": (4, 5), "hidden_1": (4, 4)}
  state = state.replace(params=jax.tree.map(jnp.asarray, wide), round=jnp.ones((), jnp.int32),
                        assignments={n: jnp.asarray(a, jnp.int32) for n, a in tables.items()},
                        assigned_round=jnp.asarray([1, 0, 1, -1], jnp.int32))
  batches = _batches(rng, num_clients=3, input_dim=6, classes=3).replace(client_id=jnp.asarray([2, 1, 3], jnp.int32))
  popular = []
  for name, width in (("hidden_0", 8), ("hidden_1", 7)):
    counts = np.zeros(width, int)
    for j in (0, 2):  # the clients of the last matching
      for i in tables[name][j]:
        counts[i] += 1
    order = sorted(range(width), key=lambda i: (-counts[i], i))
    popular.append(sorted(order[:tables[name].shape[1]]))
  starts = [_restart_reference(wide, MLP_LAYERS, [tables["hidden_0"][2], tables["hidden_1"][2]])]
  starts += [_restart_reference(wide, MLP_LAYERS, popular)] * 2
  expected, info = frozen.match(jax.tree.map(lambda *a: np.stack(a).astype(np.float32), *starts), batches)
  after = frozen.run(state, batches)
  _assert_same_params(after.params, expected, atol=0)
  assert float(after.metrics["num_restarted"]) == 1
  np.testing.assert_array_equal(after.assigned_round, [1, 2, 2, 2])  # client 0 keeps its own, stale from now on
  np.testing.assert_array_equal(after.assignments["hidden_0"][0], tables["hidden_0"][0])
  for n, name in enumerate(MLP_LAYERS[:-1]):  # the new assignments of the round's clients, in their rows' order
    for row, client in enumerate((2, 1, 3)):
      np.testing.assert_array_equal(after.assignments[name][client], info["assignments"][n][row])
  # client_start="global": every client starts from the whole global model, and no assignment is stored.
  whole = fo.algorithms.fedma(fo.models.classification_loss(ma.mlp_apply), layers=MLP_LAYERS,
                              client_optimizer=optax.sgd(0.0), num_clients=4, client_map="vmap", iterations=0,
                              max_growth=1.0, class_weighted=False, client_start="global")
  expected, _ = whole.match(jax.tree.map(lambda a: np.stack([a] * 3).astype(np.float32), wide), batches)
  after = whole.run(state, batches)
  _assert_same_params(after.params, expected, atol=0)
  assert float(after.metrics["num_restarted"]) == 0
  np.testing.assert_array_equal(after.assigned_round, state.assigned_round)


# ---- end to end --------------------------------------------------------------------------------------------------


def _digits_setting(num_clients=10, local_steps=50, batch_size=20):
  """The end-to-end tests' setting: digits under Dirichlet(0.5) over 10 clients all taking part, the MLP
  64-32-32-10, its loss and accuracy, and `sample(r)`, the batches of round r (`fold_in(key(0), r)`)."""
  ds = fo.data.load("digits", partition="dirichlet", alpha=0.5, num_clients=num_clients, seed=0)
  _, params = _mlp(64, (32, 32), 10, 0)
  loss_fn = fo.models.classification_loss(ma.mlp_apply)
  metric = {"accuracy": fo.models.classification_accuracy(ma.mlp_apply)}
  key = jax.random.key(0)
  sample = jax.jit(lambda r: fo.data.sample_round(jax.random.fold_in(key, r), ds, num_clients, local_steps,
                                                  batch_size, client_sampling="all"))
  accuracy = lambda p: float(fo.evaluate.global_model(p, ds, metric)["accuracy"])  # noqa: E731
  return params, loss_fn, key, sample, accuracy


@pytest.mark.slow
def test_fedma_beats_fedavg_at_the_same_upload_on_a_label_skewed_split():
  """The FedMA paper's headline claim on digits, Dirichlet(0.5), 10 clients all taking part, an MLP 64-32-32-10,
  50 local SGD steps of 20 at lr 0.1: after 3 FedMA rounds (each layer uploaded once per client and round) the
  global model is more accurate than FedAvg's after its first round that has uploaded at least as many floats
  (benchmarks/clustered.py part (b) runs it over seeds, data sets and a CNN)."""
  num_clients, eta_l = 10, 0.1
  params, loss_fn, key, sample, accuracy = _digits_setting(num_clients)
  fedma = fo.algorithms.fedma(loss_fn, layers=MLP_LAYERS, client_optimizer=optax.sgd(eta_l), num_clients=num_clients)
  state, uploaded = fedma.init(params, key), 0.0
  for r in range(3):
    state = fedma.run(state, sample(r))
    uploaded += float(state.metrics["uploaded_floats"])
  fedavg = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(eta_l))
  step, avg_state = jax.jit(fedavg.step), fedavg.init(params, key)
  rounds = math.ceil(uploaded / (num_clients * fo.models.count_params(params)) - 1e-9)
  for r in range(rounds):
    avg_state = step(avg_state, sample(r))
  assert rounds >= 3 and accuracy(state.params) > accuracy(avg_state.params) + 0.05, (
      accuracy(state.params), accuracy(avg_state.params), rounds)


@pytest.mark.slow
def test_one_matching_of_local_models_beats_one_more_fedavg_round_from_a_fedavg_model():
  """From a model FedAvg trained for 3 rounds, the clients train locally once more; matched averaging of those
  local models (one `fedma.match`) is more accurate than FedAvg's average of the same local models.

  `fedma.match` on the same local models as FedAvg's round: the matching, the layer-wise retraining and the
  class-weighted classifier against one coordinate-wise average.
  """
  num_clients, eta_l = 10, 0.5
  params, loss_fn, key, sample, accuracy = _digits_setting(num_clients)
  fedavg = fo.algorithms.fedavg(loss_fn, client_optimizer=optax.sgd(eta_l))
  step = jax.jit(fedavg.step)
  state = fedavg.init(params, key)
  for r in range(3):
    state = step(state, sample(r))
  batches = sample(3)
  local = jax.vmap(lambda d, m: jax.tree.map(
      jnp.add, state.params, fo.core.local_train(loss_fn, optax.sgd(eta_l), state.params, d, m).delta))(
          fo.core.materialize(batches.data), batches.mask)
  fedma = fo.algorithms.fedma(loss_fn, layers=MLP_LAYERS, client_optimizer=optax.sgd(eta_l), num_clients=num_clients)
  matched, info = fedma.match(local, batches)
  averaged = step(state, batches).params
  assert info["num_clients"] == num_clients
  assert accuracy(matched) > accuracy(averaged) + 0.05, (accuracy(matched), accuracy(averaged))
