"""Outer-loop strategies: what the coordinator does with the sites' pseudo-gradients."""

from strategies.base import Aggregate, Strategy, StrategyError
from strategies.diloco import DiLoCo
from strategies.fedavg import FedAvg
from strategies.loader import load_strategy

__all__ = ["Aggregate", "DiLoCo", "FedAvg", "Strategy", "StrategyError", "load_strategy"]
