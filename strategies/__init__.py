"""Outer-loop strategies: what the coordinator does with the sites' pseudo-gradients."""

from strategies.base import Aggregate, SiteUpdate, Strategy, StrategyError
from strategies.diloco import DiLoCo
from strategies.fedavg import FedAvg
from strategies.fedavgm import FedAvgM
from strategies.fedopt import FedAdagrad, FedAdam, FedYogi
from strategies.loader import BUILTINS, load_strategy
from strategies.robust import AggregationError, RobustAggregator

__all__ = [
    "BUILTINS",
    "Aggregate",
    "AggregationError",
    "DiLoCo",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedYogi",
    "RobustAggregator",
    "SiteUpdate",
    "Strategy",
    "StrategyError",
    "load_strategy",
]
