"""DiLoCo: outer SGD with Nesterov momentum on the averaged pseudo-gradient.

Douillard et al. (2023), Algorithm 1, with the paper's outer learning rate 0.7 and momentum 0.9.
The momentum follows torch.optim.SGD(nesterov=True)::

    m   <- mu * m + g
    th  <- th - lr * (g + mu * m)

with ``g`` the mean pseudo-gradient. Updates are averaged uniformly by default (every site ran the
same number of inner steps); ``weighted = true`` weighs them by the examples sites report.
Momentum is kept in float32 whatever the parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.base import Aggregate, Strategy, Tensors
from strategies.momentum import OuterMomentum
from wire.config_table import setting


@dataclass(frozen=True)
class DiLoCoConfig:
    lr: float = setting(0.7, help="the outer learning rate (> 0)")
    momentum: float = setting(0.9, help="the outer momentum mu")
    nesterov: bool = setting(True, help="Nesterov momentum, as ``torch.optim.SGD(nesterov=True)``")
    weighted: bool = setting(
        False,
        help="weigh updates by the examples the sites report (false: uniformly, every site ran "
        "the same inner steps)",
    )
    late_discount: float = setting(
        0.0,
        help="federated mode: a late update is folded into the next round of its fragment (the "
        "next round without ``[streaming]``) at this weight, in [0, 1] (0: dropped)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.late_discount <= 1:
            raise ValueError(f"late_discount must be in [0, 1], got {self.late_discount}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


class DiLoCo(Strategy):
    """Outer Nesterov SGD on pseudo-gradients (the DiLoCo outer optimiser)."""

    Config = DiLoCoConfig
    separable = True  # elementwise, state per tensor

    def __init__(self, config: DiLoCoConfig | None = None) -> None:
        super().__init__(config or DiLoCoConfig())
        self.outer = OuterMomentum()

    def update_weight(self, site: str, reported_weight: float) -> float:
        return reported_weight if self.config.weighted else 1.0

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        return self.outer.step(
            theta, aggregate.mean_delta, self.config.lr, self.config.momentum, self.config.nesterov
        )

    def outer_step_in_place(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        return self.outer.step_in_place(
            theta, aggregate.mean_delta, self.config.lr, self.config.momentum, self.config.nesterov
        )

    def state_dict(self) -> Tensors:
        return self.outer.state_dict()

    def load_state_dict(self, state: Tensors) -> None:
        self.outer.load_state_dict(state)
