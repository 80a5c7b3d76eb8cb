"""Client-level differential privacy: DP-FedAvg's aggregator and its privacy accounting (docs/privacy.md).

* `dp_mean(clip_norm, noise_multiplier, expected_clients=m, adaptive=None)`:
  an `Aggregator` that clips each client's update, sums, adds Gaussian noise
  from the round key and divides by m; `AdaptiveClipping` makes the clip
  norm track a quantile of the update norms.
* `Sampling.fixed(N, m)` / `Sampling.poisson(N, q)`: how the run draws its
  clients; `epsilons(σ, R, delta=δ, sampling=...)` gives ε after each round
  with dp-accounting's RDP or PLD accountant, `noise_multiplier_for` solves
  σ for a target ε, `check_sampling` refuses a run that samples differently.

The accounting imports `dp_accounting` when called, so `import fedjax_opt`
does not need it.
"""

from fedjax_opt.privacy.accounting import (ACCOUNTANTS, Sampling, SamplingMismatchError, UnsupportedAccountingError,
                                           check_sampling, epsilons, noise_multiplier_for, poisson_cap, round_event)
from fedjax_opt.privacy.dp import AdaptiveClipping, DPMeanState, clip_by_global_norm, dp_mean, update_noise_multiplier

__all__ = ["ACCOUNTANTS", "AdaptiveClipping", "DPMeanState", "Sampling", "SamplingMismatchError",
           "UnsupportedAccountingError", "check_sampling", "clip_by_global_norm", "dp_mean", "epsilons",
           "noise_multiplier_for", "poisson_cap", "round_event", "update_noise_multiplier"]
