"""FedProx Synthetic(alpha, beta) matches its published recipe (Li et al. 2020, Sec. 5.1)."""

import numpy as np
import pytest
from scipy import stats

from fedjax_opt import data
from fedjax_opt.data import synthetic


@pytest.fixture(scope="module")
def synth():
  return data.generate_synthetic(1.0, 1.0, seed=0)


def test_shapes_follow_the_recipe(synth):
  assert len(synth.clients) == 30
  for client, n in zip(synth.clients, synth.sizes):
    assert client["x"].shape == (n, 60) and client["x"].dtype == np.float32
    assert client["y"].shape == (n,) and client["y"].dtype == np.int32
    assert client["y"].min() >= 0 and client["y"].max() < 10
  p = synth.params
  assert p.W.shape == (30, 60, 10) and p.b.shape == (30, 10) and p.v.shape == (30, 60)


def test_client_sizes_are_floor_lognormal_4_2_plus_50():
  sizes = synthetic.fedprox_client_sizes(20000, np.random.default_rng(1))
  assert sizes.min() >= 50
  # P(n - 50 <= m) = P(LogNormal(4, 2) < m + 1) = Phi((ln(m + 1) - 4) / 2).
  m = np.arange(0, 5000)
  empirical = np.searchsorted(np.sort(sizes - 50), m, side="right") / len(sizes)
  exact = stats.norm.cdf((np.log(m + 1) - 4) / 2)
  assert np.abs(empirical - exact).max() < 1.95 / np.sqrt(len(sizes))  # KS 0.1% critical value


def test_generator_draws_the_sizes_first_on_its_seed_path(synth):
  np.testing.assert_array_equal(synth.sizes, synthetic.fedprox_client_sizes(30, np.random.default_rng(0)))


def test_features_have_covariance_diag_j_to_the_minus_1_2(synth):
  centred = np.concatenate([c["x"] - v for c, v in zip(synth.clients, synth.params.v)]).astype(np.float64)
  n = len(centred)
  sigma = np.arange(1, 61) ** -1.2
  variance = centred.var(axis=0)
  assert np.abs(variance / sigma - 1).max() < 5 * np.sqrt(2 / n)
  corr = np.corrcoef(centred, rowvar=False)
  off = corr[~np.eye(60, dtype=bool)]
  assert np.abs(off).max() < 5 / np.sqrt(n)
  assert np.abs(centred.mean(axis=0) / np.sqrt(sigma)).max() < 5 / np.sqrt(n)


def test_labels_are_the_argmax_of_each_clients_softmax_model(synth):
  p = synth.params
  for k, client in enumerate(synth.clients):
    logits = client["x"].astype(np.float64) @ p.W[k] + p.b[k]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    agree = np.mean(np.argmax(probs, axis=1) == client["y"])
    assert agree > 0.999  # float32 storage of x may flip an exact near-tie


def test_parameters_follow_the_hierarchical_prior(synth):
  p = synth.params
  # W_k, b_k ~ N(u_k, 1); v_k ~ N(B_k, 1): pooled residuals are standard normal.
  for residual in (p.W - p.u[:, None, None], p.b - p.u[:, None], p.v - p.B[:, None]):
    r = residual.ravel()
    assert abs(r.mean()) < 4 / np.sqrt(r.size) and abs(r.std() - 1) < 4 * np.sqrt(0.5 / r.size)
  # u_k ~ N(0, alpha), B_k ~ N(0, beta) with alpha = beta = 1: sum of squares ~ chi2(30).
  for prior in (p.u, p.B):
    s = np.sum(prior ** 2)
    assert stats.chi2.ppf(1e-4, 30) < s < stats.chi2.ppf(1 - 1e-4, 30)


def test_alpha_and_beta_scale_the_prior_spread():
  wide = data.generate_synthetic(3.0, 0.1, seed=4).params
  assert 1.5 < wide.u.std() < 5 and wide.B.std() < 0.25
  zero = data.generate_synthetic(0.0, 0.0, seed=4).params
  assert np.all(zero.u == 0) and np.all(zero.B == 0)


def test_iid_variant_shares_one_model_and_zero_feature_mean():
  iid = data.generate_synthetic(iid=True, seed=0)
  p = iid.params
  assert np.all(p.W == p.W[0]) and np.all(p.b == p.b[0]) and np.all(p.v == 0)
  x = np.concatenate([c["x"] for c in iid.clients])
  assert np.abs(x.mean(axis=0) / np.sqrt(p.cov_diag)).max() < 5 / np.sqrt(len(x))


def test_same_seed_same_data_different_seed_different_data():
  a, b, c = (data.generate_synthetic(0.5, 0.5, seed=s) for s in (3, 3, 4))
  for ca, cb in zip(a.clients, b.clients):
    np.testing.assert_array_equal(ca["x"], cb["x"])
    np.testing.assert_array_equal(ca["y"], cb["y"])
  assert not np.array_equal(a.clients[0]["x"][:10], c.clients[0]["x"][:10])


def test_load_synthetic_packs_thirty_devices_with_ten_percent_test():
  ds = data.load_synthetic(0.5, 0.5, seed=0)
  gen = data.generate_synthetic(0.5, 0.5, seed=0)
  total = np.asarray(ds.train_count) + np.asarray(ds.test_count)
  np.testing.assert_array_equal(total, gen.sizes)
  # FedProx: train_len = int(0.9 * n).
  np.testing.assert_array_equal(ds.train_count, (0.9 * gen.sizes + 1e-9).astype(int))
  assert ds.num_classes == 10 and ds.client_names[0] == "f_00000" and ds.name == "synthetic_0.5_0.5"


@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": -1.0}, "alpha"), ({"beta": float("nan")}, "beta"),
    ({"num_clients": 0}, "num_clients"), ({"num_classes": 1}, "num_classes"),
])
def test_bad_parameters_are_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.generate_synthetic(**kwargs)
