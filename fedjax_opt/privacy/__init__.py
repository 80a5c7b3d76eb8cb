"""Client-level differential privacy: DP-FedAvg's aggregator and its privacy accounting (docs/privacy.md).

* `dp_mean(clip_norm, noise_multiplier, expected_clients=m, adaptive=None)`:
  an `Aggregator` that clips each client's update, sums, adds Gaussian noise
  from the round key and divides by m; `AdaptiveClipping` makes the clip
  norm track a quantile of the update norms.
* `Sampling.fixed(N, m)` / `Sampling.poisson(N, q)`: how the run draws its
  clients; `epsilons(σ, R, delta=δ, sampling=...)` gives ε after each round
  with dp-accounting's RDP or PLD accountant, `noise_multiplier_for` solves
  σ for a target ε, `check_sampling` refuses a run that samples differently.
* `secure_aggregation(inner, frac_bits=f, bound=B, threshold=t, dropout=q)`:
  an `Aggregator` that computes a sum-form aggregator's (mean, weighted mean,
  `dp_mean`) sum by simulated secure aggregation (Bonawitz et al. 2017):
  fixed point in Z_(2^32), pairwise and self masks, Shamir-shared seeds and
  dropout recovery, inside jit; `secure_sum`, `shamir_share`,
  `shamir_reconstruct` and the fixed-point codec are its pieces.
* `homomorphic` (the optional extra `fedjax_opt[he]`): the weighted mean by
  CKKS homomorphic encryption with TenSEAL, on the host, outside jit:
  `homomorphic.ckks_context(...)`, `homomorphic.homomorphic_mean(updates,
  weights, context)`.

The accounting imports `dp_accounting` when called, and `homomorphic` is
loaded on first use and imports `tenseal` when called, so `import
fedjax_opt` needs neither.
"""

from typing import TYPE_CHECKING

from fedjax_opt.core import lazy as _lazy
from fedjax_opt.privacy.accounting import (ACCOUNTANTS, Sampling, SamplingMismatchError, UnsupportedAccountingError,
                                           check_sampling, epsilons, noise_multiplier_for, poisson_cap, round_event)
from fedjax_opt.privacy.dp import AdaptiveClipping, DPMeanState, clip_by_global_norm, dp_mean, update_noise_multiplier
from fedjax_opt.privacy.secure import (SecureAggregationState, SecureSum, fixed_point_decode, fixed_point_encode,
                                       secure_aggregation, secure_sum, shamir_reconstruct, shamir_share, upload_bits)

__all__ = ["ACCOUNTANTS", "AdaptiveClipping", "DPMeanState", "Sampling", "SamplingMismatchError",
           "UnsupportedAccountingError", "check_sampling", "clip_by_global_norm", "dp_mean", "epsilons",
           "noise_multiplier_for", "poisson_cap", "round_event", "update_noise_multiplier", "SecureAggregationState",
           "SecureSum", "fixed_point_decode", "fixed_point_encode", "secure_aggregation", "secure_sum",
           "shamir_reconstruct", "shamir_share", "upload_bits"]

__getattr__, __dir__, _lazy_all = _lazy.attach(__name__, submodules=("homomorphic",))
__all__ += _lazy_all

if TYPE_CHECKING:
  from fedjax_opt.privacy import homomorphic
