"""Privacy accounting (`fo.privacy.epsilons`, ...) against closed forms, and Poisson client sampling as accounted."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from scipy import optimize, stats

import fedjax_opt as fo
from fedjax_opt import data

P = fo.privacy
DELTA = 1e-5


def _analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
  """Balle & Wang 2018: the exact ε of the Gaussian mechanism (sensitivity 1, std σ) at δ, by root finding."""

  def delta_of(eps):
    return (stats.norm.cdf(1 / (2 * sigma) - eps * sigma)
            - math.exp(eps) * stats.norm.cdf(-1 / (2 * sigma) - eps * sigma)) - delta

  return optimize.brentq(delta_of, 0.0, 100.0, xtol=1e-12)


FULL = P.Sampling.poisson(50, 1.0, cap=50)  # q = 1: every client, the plain Gaussian mechanism (add/remove)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.5])
def test_pld_of_one_full_round_is_the_analytic_gaussian_mechanism(sigma):
  got = P.epsilons(sigma, 1, delta=DELTA, sampling=FULL, accountant="pld")[0]
  assert got == pytest.approx(_analytic_gaussian_epsilon(sigma, DELTA), abs=2e-3)


@pytest.mark.parametrize("sigma,rounds", [(1.0, 1), (2.0, 10), (5.0, 100)])
def test_rdp_of_full_rounds_is_the_gaussian_closed_form(sigma, rounds):
  """RDP of R Gaussian rounds is R α / (2σ²); dp-accounting converts with the improved bound
  ε = min_α [R α/(2σ²) + log1p(−1/α) − log(δ α)/(α − 1)] (Canonne–Kamath–Steinke 2020), which never exceeds the
  classic min_α [R α/(2σ²) + log(1/δ)/(α − 1)] (Mironov 2017) and is never below the exact ε."""
  import dp_accounting

  got = P.epsilons(sigma, rounds, delta=DELTA, sampling=FULL, accountant="rdp")
  orders = np.asarray(dp_accounting.rdp.RdpAccountant().orders, np.float64)
  orders = orders[orders > 1.01]
  rdp = rounds * orders / (2 * sigma ** 2)
  improved = np.min(rdp + np.log1p(-1 / orders) - np.log(DELTA * orders) / (orders - 1))
  classic = np.min(rdp + np.log(1 / DELTA) / (orders - 1))
  assert got[-1] == pytest.approx(improved, rel=1e-9)
  assert got[-1] <= classic
  exact = _analytic_gaussian_epsilon(sigma / math.sqrt(rounds), DELTA)  # R Gaussians = one with σ/√R
  assert got[-1] >= exact - 1e-9
  if rounds == 1:
    assert got[0] >= P.epsilons(sigma, 1, delta=DELTA, sampling=FULL, accountant="pld")[0]


@pytest.mark.parametrize("sampling,accountant", [
    (P.Sampling.fixed(100, 10), "rdp"),
    (P.Sampling.poisson(100, 0.1, cap=100), "rdp"),
    pytest.param(P.Sampling.poisson(100, 0.1, cap=100), "pld",
                 marks=pytest.mark.slow),  # the PLD accountant's fine discretization: ~20 s of Python
])
def test_epsilon_grows_with_rounds_and_shrinks_with_noise(sampling, accountant):
  at = [1, 5, 20, 60]
  low = P.epsilons(1.0, delta=DELTA, sampling=sampling, accountant=accountant, at=at)
  high = P.epsilons(2.0, delta=DELTA, sampling=sampling, accountant=accountant, at=at)
  assert np.all(np.diff(low) > 0) and np.all(np.diff(high) > 0)
  assert np.all(high < low)
  # The curve at a round equals a fresh accountant composed that many times.
  import dp_accounting

  event, relation = P.round_event(1.0, sampling, accountant)
  fresh = (dp_accounting.rdp.RdpAccountant(neighboring_relation=relation) if accountant == "rdp"
           else dp_accounting.pld.PLDAccountant(neighboring_relation=relation))
  fresh.compose(event, 20)
  assert low[2] == pytest.approx(fresh.get_epsilon(DELTA), rel=1e-6)


def test_subsampling_amplifies_and_noise_zero_is_not_private():
  full = P.epsilons(1.0, 1, delta=DELTA, sampling=P.Sampling.poisson(100, 1.0, cap=100))[0]
  sub = P.epsilons(1.0, 1, delta=DELTA, sampling=P.Sampling.poisson(100, 0.1, cap=100))[0]
  assert sub < full
  assert np.isinf(P.epsilons(0.0, 3, delta=DELTA, sampling=P.Sampling.fixed(100, 10))).all()


def test_fixed_size_accounting_uses_replace_one_with_sensitivity_2c():
  """Fixed size, m = N: one Gaussian with noise multiplier σ/2 (noise σC over the replace-one sensitivity 2C)."""
  got = P.epsilons(2.0, 1, delta=DELTA, sampling=P.Sampling.fixed(30, 30))[0]
  via_half = P.epsilons(1.0, 1, delta=DELTA, sampling=FULL)[0]  # add/remove with σ = 1: the same RDP curve
  assert got == pytest.approx(via_half, rel=1e-9)


@pytest.mark.parametrize("sampling,accountant", [
    (P.Sampling.fixed(100, 10), "rdp"),
    (P.Sampling.poisson(100, 0.1, cap=100), "rdp"),
    # PLD: the search runs on coarse grids and checks its answer once on the accountant's own 1e-4 grid (~2 s).
    (P.Sampling.poisson(100, 0.1, cap=100), "pld"),
    # Truncated at the default cap of 27 slots: its PLD at the fine grid takes seconds to build.
    pytest.param(P.Sampling.poisson(100, 0.1), "pld", marks=pytest.mark.slow),
])
def test_the_solved_noise_multiplier_gives_back_the_target_epsilon(sampling, accountant):
  rounds, target = 50, 4.0
  sigma = P.noise_multiplier_for(target, rounds, delta=DELTA, sampling=sampling, accountant=accountant)
  eps = P.epsilons(sigma, delta=DELTA, sampling=sampling, accountant=accountant, at=[rounds])[0]
  assert eps <= target and eps == pytest.approx(target, rel=2e-3)
  below = P.epsilons(sigma * 0.99, delta=DELTA, sampling=sampling, accountant=accountant, at=[rounds])[0]
  assert below > target  # the smallest such σ, to within 1%


def test_unsupported_pairs_name_the_alternative():
  with pytest.raises(P.UnsupportedAccountingError, match="use accountant='rdp', or Poisson sampling"):
    P.epsilons(1.0, 3, delta=DELTA, sampling=P.Sampling.fixed(100, 10), accountant="pld")
  with pytest.raises(P.UnsupportedAccountingError, match="use accountant='pld', or a cap of N=100"):
    P.epsilons(1.0, 3, delta=DELTA, sampling=P.Sampling.poisson(100, 0.1, cap=30), accountant="rdp")


@pytest.mark.slow  # four PLD accountings at the fine discretization
def test_truncated_poisson_is_accounted_by_pld_and_costs_more_the_more_is_truncated():
  """A tight cap (P(truncation | sampled) ≈ 7%) costs much more ε; the default cap (overflow ≤ 1e-6) almost none."""
  plain = P.epsilons(1.0, delta=DELTA, sampling=P.Sampling.poisson(100, 0.1, cap=100), accountant="pld", at=[3])[0]
  tight = P.Sampling.poisson(100, 0.1, cap=15)
  default = P.Sampling.poisson(100, 0.1)
  assert tight.truncated and default.truncated and default.clients_per_round == 27
  got_tight = P.epsilons(1.0, delta=DELTA, sampling=tight, accountant="pld", at=[3])[0]
  got_default = P.epsilons(1.0, delta=DELTA, sampling=default, accountant="pld", at=[3])[0]
  assert got_tight > 1.5 * plain
  assert plain - 1e-6 <= got_default <= plain * 1.01


def test_the_sampling_check_refuses_a_run_that_samples_otherwise():
  fixed = P.Sampling.fixed(100, 10)
  P.check_sampling(fixed, client_sampling="uniform", clients_per_round=10, num_clients=100, expected_clients=10)
  P.check_sampling(P.Sampling.fixed(20, 20), client_sampling="all", clients_per_round=20, num_clients=20)
  poisson = P.Sampling.poisson(100, 0.1, cap=27)
  P.check_sampling(poisson, client_sampling="poisson", clients_per_round=27, num_clients=100,
                   sampling_probability=0.1, expected_clients=10.0)
  bad = [
      dict(client_sampling="poisson", clients_per_round=10, num_clients=100, sampling_probability=0.1),
      dict(client_sampling="uniform", clients_per_round=12, num_clients=100),
      dict(client_sampling="uniform", clients_per_round=10, num_clients=120),
      dict(client_sampling="proportional", clients_per_round=10, num_clients=100),
  ]
  for kwargs in bad:
    with pytest.raises(P.SamplingMismatchError, match="the accountant is given fixed-size, m=10 of N=100"):
      P.check_sampling(fixed, **kwargs)
  with pytest.raises(P.SamplingMismatchError, match="the accountant is given Poisson, q=0.1"):
    P.check_sampling(poisson, client_sampling="uniform", clients_per_round=27, num_clients=100)
  with pytest.raises(P.SamplingMismatchError, match="expected_clients=27"):
    P.check_sampling(poisson, client_sampling="poisson", clients_per_round=27, num_clients=100,
                     sampling_probability=0.1, expected_clients=27)
  assert fixed.train_kwargs() == dict(client_sampling="uniform", clients_per_round=10)


def test_poisson_cap_keeps_the_overflow_below_its_bound():
  for n, q in [(100, 0.1), (1000, 0.01), (3400, 0.03)]:
    cap = P.poisson_cap(n, q)
    assert stats.binom.sf(cap, n, q) <= 1e-6 < stats.binom.sf(cap - 1, n, q)
  assert P.poisson_cap(10, 0.9) == 10


# ---- Poisson client sampling in fo.data.sample_round, as the accountant assumes it ------------------------------


def _dataset(n=40):
  rng = np.random.default_rng(0)
  clients = [{"x": rng.normal(size=(int(s), 2)).astype(np.float32), "y": np.zeros(int(s), np.int32)}
             for s in rng.integers(1, 6, size=n)]
  return data.pack(clients, test_fraction=0.0, max_padding_factor=None)


def test_poisson_rounds_draw_each_client_with_probability_q_in_padded_slots():
  ds, q, cap, rounds = _dataset(40), 0.15, 40, 4000
  draw = jax.jit(jax.vmap(lambda k: data.sample_round(k, ds, cap, 1, 4, client_sampling="poisson",
                                                      sampling_probability=q)))
  b = draw(jax.random.split(jax.random.key(1), rounds))
  ids, used = np.asarray(b.client_id), np.asarray(b.weight) > 0
  assert ids.shape == (rounds, cap)
  assert all(len(set(row)) == cap for row in ids[:50])  # distinct clients in the slots
  assert not np.asarray(b.mask)[~used].any()  # unused slots: no example, weight 0
  counts = np.zeros(40)
  np.add.at(counts, ids[used], 1)
  # Each client's count ~ Binomial(rounds, q): all within 4.5 standard deviations.
  sd = math.sqrt(rounds * q * (1 - q))
  assert np.all(np.abs(counts - rounds * q) < 4.5 * sd), counts
  # The round sizes are Binomial(N, q) (nothing truncated with cap = N): a chi-square goodness of fit.
  sizes = used.sum(1)
  ks = np.arange(0, 15)
  observed = np.array([np.sum(sizes == k) for k in ks[:-1]] + [np.sum(sizes >= ks[-1])])
  expected = np.append(stats.binom.pmf(ks[:-1], 40, q), stats.binom.sf(ks[-2], 40, q)) * rounds
  assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_an_overfull_poisson_round_keeps_a_uniform_subset_of_the_drawn():
  ds, q, cap, rounds = _dataset(12), 0.5, 3, 3000
  draw = jax.jit(jax.vmap(lambda k: data.sample_round(k, ds, cap, 1, 2, client_sampling="poisson",
                                                      sampling_probability=q)))
  b = draw(jax.random.split(jax.random.key(2), rounds))
  used = np.asarray(b.weight) > 0
  assert used.sum(1).max() == cap
  counts = np.zeros(12)
  np.add.at(counts, np.asarray(b.client_id)[used], 1)
  # By symmetry every client takes part equally often: rounds × E[min(Bin(12, q), 3)] / 12.
  mean = rounds * np.sum(np.minimum(np.arange(13), cap) * stats.binom.pmf(np.arange(13), 12, q)) / 12
  assert np.all(np.abs(counts - mean) < 5 * math.sqrt(mean)), counts


def test_poisson_sampling_arguments_are_checked():
  ds = _dataset(10)
  with pytest.raises(ValueError, match="needs sampling_probability"):
    data.sample_round(jax.random.key(0), ds, 5, 1, 2, client_sampling="poisson")
  with pytest.raises(ValueError, match="applies to client_sampling='poisson' only"):
    data.sample_round(jax.random.key(0), ds, 5, 1, 2, sampling_probability=0.2)
  with pytest.raises(ValueError, match="exceeds the 10 clients"):
    data.sample_round(jax.random.key(0), ds, 11, 1, 2, client_sampling="poisson", sampling_probability=0.2)


def test_a_sampling_with_more_clients_per_round_than_clients_names_its_own_arguments():
  """`Sampling.fixed(100, 200)` said "sampling_probability q must be in (0, 1]; got 2.0", a q it was never given."""
  for build, message in (
      (lambda: P.Sampling.fixed(100, 200), "Sampling.fixed: clients_per_round=200 exceeds num_clients=100"),
      (lambda: P.Sampling.poisson(100, 0.1, cap=200), "Sampling.poisson: cap=200 exceeds num_clients=100"),
      (lambda: P.Sampling("fixed", 100, 200, 2.0), "Sampling: clients_per_round=200 exceeds num_clients=100")):
    with pytest.raises(ValueError) as raised:
      build()
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)
