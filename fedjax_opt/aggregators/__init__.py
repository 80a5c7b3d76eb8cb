"""Aggregators: stacked client updates -> one server update (mean, weighted mean, ...)."""

from fedjax_opt.aggregators.base import Aggregator, mean, normalized_sum, resolve, weighted_mean, weighted_sum
