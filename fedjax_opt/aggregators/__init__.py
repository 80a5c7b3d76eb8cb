"""Aggregators: stacked client updates -> one server update (mean, weighted mean, ...); `chain` puts a client stage before one."""

from fedjax_opt.aggregators.base import Aggregator, mean, normalized_sum, resolve, weighted_mean, weighted_sum
from fedjax_opt.aggregators.chain import chain
from fedjax_opt.core.types import ClientStage
from fedjax_opt.core.types import StreamingSum
from fedjax_opt.core.types import Traits
from fedjax_opt.aggregators.robust import (CenteredClippingState, bulyan, centered_clipping, geometric_median, krum,
                                           marginal_median, mean_around_median, multi_krum, trimmed_mean)
from fedjax_opt.aggregators.sign import majority_vote
from fedjax_opt.aggregators import composition

__all__ = ["Aggregator", "ClientStage", "StreamingSum", "Traits", "chain", "mean", "normalized_sum", "resolve", "weighted_mean", "weighted_sum",
           "CenteredClippingState", "bulyan", "centered_clipping", "geometric_median", "krum", "marginal_median",
           "mean_around_median", "multi_krum", "trimmed_mean", "majority_vote", "composition"]
