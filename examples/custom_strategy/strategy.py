"""Heavy-ball outer SGD with a cosine-decayed learning rate: a strategy plugin in one file.

job.toml: ``name = "examples.custom_strategy.strategy:CosineMomentum"`` in ``[strategy]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strategies import Aggregate, Strategy
from strategies.base import Tensors, apply_in_float32


@dataclass(frozen=True)
class CosineMomentumConfig:
    lr: float = 1.0  # outer learning rate in the first round
    lr_min: float = 0.1  # ... decayed along a cosine to this in round total_rounds - 1
    momentum: float = 0.5
    total_rounds: int = 10

    def __post_init__(self) -> None:  # errors reach the operator naming the plugin
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0 < self.lr_min <= self.lr:
            raise ValueError(f"need 0 < lr_min <= lr, got {self.lr_min} and {self.lr}")


class CosineMomentum(Strategy):
    Config = CosineMomentumConfig

    def __init__(self, config: CosineMomentumConfig | None = None) -> None:
        super().__init__(config or CosineMomentumConfig())
        self.velocity: Tensors = {}
        self.lr = self.config.lr

    def begin_round(self, round: int, theta: Tensors) -> None:
        c = self.config
        progress = min(round / max(c.total_rounds - 1, 1), 1.0)
        self.lr = c.lr_min + 0.5 * (c.lr - c.lr_min) * (1 + math.cos(math.pi * progress))

    def update_weight(self, site: str, reported_weight: float) -> float:
        return math.sqrt(reported_weight)  # big sites count more, but less than linearly

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        out, velocity = dict(theta), {}
        for name, g in aggregate.mean_delta.items():  # g = weighted mean of theta_r - theta_i
            v = self.config.momentum * self.velocity.get(name, torch.zeros_like(g)) + g
            out[name], velocity[name] = apply_in_float32(theta[name], self.lr * v), v
        self.velocity = velocity  # only once every tensor succeeded
        return out

    def state_dict(self) -> Tensors:  # checkpointed with theta (safetensors, no pickle)
        return {f"velocity.{k}": v for k, v in self.velocity.items()}

    def load_state_dict(self, state: Tensors) -> None:
        self.velocity = {k.removeprefix("velocity."): v.float() for k, v in state.items()}
