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

import torch

from strategies.base import Aggregate, Strategy, Tensors, apply_in_float32


@dataclass(frozen=True)
class DiLoCoConfig:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    weighted: bool = False

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


class DiLoCo(Strategy):
    """Outer Nesterov SGD on pseudo-gradients (the DiLoCo outer optimiser)."""

    Config = DiLoCoConfig

    def __init__(self, config: DiLoCoConfig | None = None) -> None:
        super().__init__(config or DiLoCoConfig())
        self.momentum: Tensors = {}

    def update_weight(self, site: str, reported_weight: float) -> float:
        return reported_weight if self.config.weighted else 1.0

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        lr, mu = self.config.lr, self.config.momentum
        out = dict(theta)
        new_momentum: Tensors = {}
        for name, g in aggregate.mean_delta.items():
            if mu:
                buf = self.momentum.get(name)
                buf = g.clone() if buf is None else buf * mu + g
                new_momentum[name] = buf
                step = g + mu * buf if self.config.nesterov else buf
            else:
                step = g
            out[name] = apply_in_float32(theta[name], lr * step)
        # Committed only after every tensor succeeded, so a failure leaves the state as it was.
        self.momentum.update(new_momentum)
        return out

    def state_dict(self) -> Tensors:
        return {f"momentum.{k}": v for k, v in self.momentum.items()}

    def load_state_dict(self, state: Tensors) -> None:
        self.momentum = {
            k.removeprefix("momentum."): v.to(torch.float32)
            for k, v in state.items()
            if k.startswith("momentum.")
        }
