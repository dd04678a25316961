"""The Strategy ABC: the few hooks an outer-loop algorithm implements.

The coordinator owns the data path (receiving, verifying and summing updates) and calls a
strategy at three moments: when a round opens, when an update is admitted (to weigh it), and
when the round closes (to turn the averaged pseudo-gradient into the next global state).
Pseudo-gradients follow DiLoCo's sign: ``delta = theta_r - theta_site``, so plain averaging is
``theta_r - mean(delta)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

Tensors = dict[str, torch.Tensor]


class StrategyError(RuntimeError):
    """A strategy refused its input or failed in one of its hooks."""


@dataclass(frozen=True)
class Aggregate:
    """The round's updates, already summed by the coordinator.

    Attributes
    ----------
    mean_delta
        ``sum_i w_i * delta_i / sum_i w_i`` in float32, for every floating-point tensor.
    total_weight
        ``sum_i w_i`` over the counted updates.
    weights
        The weight each counted update (keyed by site) received.
    round
        The round these updates belong to.
    """

    mean_delta: Tensors
    total_weight: float
    weights: dict[str, float]
    round: int


class Strategy(ABC):
    """An outer optimiser.

    Subclasses set ``Config`` to a dataclass of their hyperparameters; the job config's
    ``[strategy]`` table is checked against it and passed to ``__init__``.
    """

    Config: ClassVar[type]

    def __init__(self, config: Any) -> None:
        self.config = config

    def begin_round(self, round: int, theta: Tensors) -> None:  # noqa: B027 - optional hook
        """Called when round ``round`` opens with global parameters ``theta``."""

    def update_weight(self, site: str, reported_weight: float) -> float:
        """The weight an admitted update gets in the average (default: what the site reported)."""
        return reported_weight

    @abstractmethod
    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        """Return theta_{r+1}. Must not modify ``theta`` in place: the coordinator keeps
        theta_r until theta_{r+1} is durably checkpointed."""

    def state_dict(self) -> Tensors:
        """Outer-optimiser state to checkpoint (tensors only, saved without pickle)."""
        return {}

    def load_state_dict(self, state: Tensors) -> None:  # noqa: B027 - stateless default
        """Restore what ``state_dict`` returned."""

    def describe(self) -> str:
        return f"{type(self).__name__}({self.config})"


def apply_in_float32(theta: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """theta - step computed in float32 (float64 for float64 theta), returned in theta's dtype."""
    compute = torch.promote_types(theta.dtype, torch.float32)
    return (theta.to(compute) - step.to(compute)).to(theta.dtype)
