"""FedAvg: the example-weighted mean of the sites' models.

McMahan et al. (2017). With pseudo-gradients ``delta_i = theta_r - theta_i`` the weighted mean of
site models is ``theta_r - sum_i n_i delta_i / sum_i n_i``; ``server_lr`` scales that step
(1.0 is plain FedAvg).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies.base import Aggregate, Strategy, Tensors, apply_in_float32
from wire.config_table import setting


@dataclass(frozen=True)
class FedAvgConfig:
    server_lr: float = setting(1.0, help="scales the averaged step (1.0: plain FedAvg)")
    late_discount: float = setting(
        0.0,
        help="a late update is folded into the next round of its fragment (the next round "
        "without ``[streaming]``) at this weight, in [0, 1] (0: dropped)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.late_discount <= 1:
            raise ValueError(f"late_discount must be in [0, 1], got {self.late_discount}")
        if not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")


class FedAvg(Strategy):
    """Weighted federated averaging (weights = examples each site reported)."""

    Config = FedAvgConfig
    separable = True  # elementwise, state per tensor

    def __init__(self, config: FedAvgConfig | None = None) -> None:
        super().__init__(config or FedAvgConfig())

    def outer_step_in_place(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        """theta - lr * delta written over delta (same operations as ``outer_step``)."""
        lr = self.config.server_lr
        out = dict(theta)
        for name, delta in aggregate.mean_delta.items():
            if theta[name].dtype == torch.float32 and delta.dtype == torch.float32:
                out[name] = torch.sub(theta[name], delta.mul_(lr), out=delta)
            else:
                out[name] = apply_in_float32(theta[name], lr * delta)
        return out

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        lr = self.config.server_lr
        out = dict(theta)
        for name, delta in aggregate.mean_delta.items():
            out[name] = apply_in_float32(theta[name], lr * delta)
        return out
