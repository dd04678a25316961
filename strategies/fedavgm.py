"""FedAvgM: federated averaging with server momentum.

Hsu, Qi and Brown (2019), "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification". With ``g`` the example-weighted mean pseudo-gradient::

    m   <- mu * m + g            (m = g in the first round)
    th  <- th - lr * m           (nesterov: th - lr * (g + mu * m))

The keys and their meaning are Flower's ``FedAvgM`` (``server_learning_rate``,
``server_momentum``), so ``fedavgm`` and ``flower:FedAvgM`` give the same model; the default
momentum here is 0.9, Flower's is 0 (which makes it plain FedAvg). Momentum is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.base import Aggregate, Strategy, Tensors
from strategies.momentum import OuterMomentum
from wire.config_table import setting


@dataclass(frozen=True)
class FedAvgMConfig:
    """Hyperparameters of FedAvgM."""

    server_learning_rate: float = setting(
        1.0, help="step size of the server update (1.0 with no momentum is FedAvg)"
    )
    server_momentum: float = setting(0.9, help="momentum ``mu``, in [0, 1)")
    nesterov: bool = setting(False, help="Nesterov momentum (not in Flower's FedAvgM)")

    def __post_init__(self) -> None:
        if not self.server_learning_rate > 0:
            raise ValueError(f"server_learning_rate must be > 0, got {self.server_learning_rate}")
        if not 0 <= self.server_momentum < 1:
            raise ValueError(f"server_momentum must be in [0, 1), got {self.server_momentum}")


class FedAvgM(Strategy):
    """Example-weighted averaging followed by server SGD with momentum."""

    Config = FedAvgMConfig
    separable = True  # elementwise, state per tensor

    def __init__(self, config: FedAvgMConfig | None = None) -> None:
        super().__init__(config or FedAvgMConfig())
        self.outer = OuterMomentum()

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        return self.outer.step(
            theta,
            aggregate.mean_delta,
            self.config.server_learning_rate,
            self.config.server_momentum,
            self.config.nesterov,
        )

    def outer_step_in_place(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        return self.outer.step_in_place(
            theta,
            aggregate.mean_delta,
            self.config.server_learning_rate,
            self.config.server_momentum,
            self.config.nesterov,
        )

    def state_dict(self) -> Tensors:
        return self.outer.state_dict()

    def load_state_dict(self, state: Tensors) -> None:
        self.outer.load_state_dict(state)
