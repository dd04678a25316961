"""The FedOpt family: FedAdam, FedYogi and FedAdagrad on pseudo-gradients.

Reddi et al. (2021), "Adaptive Federated Optimization", Algorithm 2, written to match Flower's
``FedAdam`` / ``FedYogi`` / ``FedAdagrad`` (same keys, defaults and arithmetic) so that a job can
move between ``fedadam`` and ``flower:FedAdam`` and get the same model. With ``g`` the
example-weighted mean pseudo-gradient (``theta_r - mean theta_i``, i.e. minus Reddi's Delta)::

    m   <- beta_1 * m + (1 - beta_1) * g
    v   <- beta_2 * v + (1 - beta_2) * g^2                 (Adam)
    v   <- v - (1 - beta_2) * g^2 * sign(v - g^2)          (Yogi)
    v   <- v + g^2                                         (Adagrad)
    th  <- th - eta_t * m / (sqrt(v) + tau)

``m`` and ``v`` start at zero. FedAdam's ``eta_t = eta * sqrt(1 - beta_2^(t+1)) /
(1 - beta_1^(t+1))`` at its t-th step (t = 1, 2, ...): Flower's bias correction, which counts
from its 1-based server round plus one; ``bias_correction = false`` gives Reddi's plain
``eta``. Yogi and Adagrad use ``eta`` throughout. ``eta_l`` is the sites' learning rate: kept
for Flower compatibility and shown in the status line, it does not enter the server step (set
the inner learning rate in the training script). State is float32; the step counts are saved too:
each tensor's own (``t.NAME``: with ``[streaming]`` a tensor steps only in its fragment's rounds,
and its t counts those steps) and the number of outer steps (``steps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strategies.base import Aggregate, Strategy, Tensors, apply_in_float32
from wire.config_table import setting

_ETA = "the server learning rate"
_ETA_L = "the sites' learning rate: informational, it does not enter the server step"
_BETA_1 = "decay of the first moment, in [0, 1)"
_BETA_2 = "decay of the second moment, in [0, 1)"
_TAU = "added to ``sqrt(v)``, > 0: larger is less adaptive (Reddi et al. use 1e-3)"


def _check(cfg) -> None:
    if not cfg.eta > 0:
        raise ValueError(f"eta must be > 0, got {cfg.eta}")
    if not cfg.eta_l > 0:
        raise ValueError(f"eta_l must be > 0, got {cfg.eta_l}")
    if not cfg.tau > 0:
        raise ValueError(f"tau must be > 0 (it keeps sqrt(v) + tau from being 0), got {cfg.tau}")
    for key in ("beta_1", "beta_2"):
        value = getattr(cfg, key, 0.0)
        if not 0 <= value < 1:
            raise ValueError(f"{key} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class FedAdamConfig:
    """Hyperparameters of FedAdam; names and defaults are Flower's."""

    eta: float = setting(1e-1, help=_ETA)
    eta_l: float = setting(1e-1, help=_ETA_L)
    beta_1: float = setting(0.9, help=_BETA_1)
    beta_2: float = setting(0.99, help=_BETA_2)
    tau: float = setting(1e-9, help=_TAU)
    bias_correction: bool = setting(
        True, help="Flower's bias-corrected ``eta_t``; false gives Reddi et al.'s constant ``eta``"
    )

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class FedYogiConfig:
    """Hyperparameters of FedYogi (as FedAdam's, without bias correction; Flower's defaults)."""

    eta: float = setting(1e-2, help=_ETA)
    eta_l: float = setting(0.0316, help=_ETA_L)
    beta_1: float = setting(0.9, help=_BETA_1)
    beta_2: float = setting(0.99, help=_BETA_2)
    tau: float = setting(1e-3, help=_TAU)

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class FedAdagradConfig:
    """Hyperparameters of FedAdagrad (Flower's defaults)."""

    eta: float = setting(1e-1, help=_ETA)
    eta_l: float = setting(1e-1, help=_ETA_L)
    tau: float = setting(1e-9, help=_TAU)
    beta_1: float = setting(
        0.0, help="Reddi et al.'s optional momentum, in [0, 1); Flower fixes it at 0"
    )

    def __post_init__(self) -> None:
        _check(self)


class FedOpt(Strategy):
    """Shared server-side adaptive optimiser; subclasses define the second moment."""

    Config = FedAdamConfig

    def __init__(self, config=None) -> None:
        super().__init__(config or self.Config())
        self.m: Tensors = {}
        self.v: Tensors = {}
        self.steps = 0  # outer steps taken
        self.counts: dict[str, int] = {}  # steps each tensor took (its bias-correction t)

    def second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def eta_t(self, t: int) -> float:
        return self.config.eta

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        """One step of the tensors in ``aggregate.mean_delta``; each tensor's ``eta_t`` counts
        its own steps (``[streaming]`` steps one fragment per round), which is the global
        count when every tensor steps every round."""
        cfg = self.config
        out = dict(theta)
        new_m: Tensors = {}
        new_v: Tensors = {}
        for name, g in aggregate.mean_delta.items():
            eta = self.eta_t(self.counts.get(name, 0) + 1)
            g = g.to(torch.float32)
            zero = torch.zeros_like(g)
            m = cfg.beta_1 * self.m.get(name, zero) + (1 - cfg.beta_1) * g
            v = self.second_moment(self.v.get(name, zero), g * g)
            new_m[name], new_v[name] = m, v
            out[name] = apply_in_float32(theta[name], eta * m / (v.sqrt() + cfg.tau))
        # Committed only once every tensor succeeded: a failed step leaves the state as it was.
        self.m.update(new_m)
        self.v.update(new_v)
        for name in new_m:
            self.counts[name] = self.counts.get(name, 0) + 1
        self.steps += 1
        return out

    def state_dict(self) -> Tensors:
        state = {f"m.{k}": v for k, v in self.m.items()}
        state.update({f"v.{k}": v for k, v in self.v.items()})
        state.update({f"t.{k}": torch.tensor(n, dtype=torch.int64) for k, n in self.counts.items()})
        state["steps"] = torch.tensor(self.steps, dtype=torch.int64)
        return state

    def load_state_dict(self, state: Tensors) -> None:
        """Restore ``state_dict``'s state. A checkpoint written before per-tensor counts has
        only ``steps``: every tensor with a moment took that many (they all stepped every
        round)."""
        self.m = {k[2:]: v.to(torch.float32) for k, v in state.items() if k.startswith("m.")}
        self.v = {k[2:]: v.to(torch.float32) for k, v in state.items() if k.startswith("v.")}
        self.steps = int(state["steps"]) if "steps" in state else 0
        counts = {k[2:]: int(v) for k, v in state.items() if k.startswith("t.")}
        self.counts = counts or dict.fromkeys(self.m, self.steps)


class FedAdam(FedOpt):
    """Adam on the server, with Flower's bias-corrected step size."""

    Config = FedAdamConfig

    def second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        return self.config.beta_2 * v + (1 - self.config.beta_2) * g2

    def eta_t(self, t: int) -> float:
        cfg = self.config
        if not cfg.bias_correction:
            return cfg.eta
        return cfg.eta * math.sqrt(1 - cfg.beta_2 ** (t + 1)) / (1 - cfg.beta_1 ** (t + 1))


class FedYogi(FedOpt):
    """Yogi on the server: v moves towards g^2 additively, by at most (1 - beta_2) g^2."""

    Config = FedYogiConfig

    def second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.config.beta_2) * g2 * torch.sign(v - g2)


class FedAdagrad(FedOpt):
    """Adagrad on the server: v accumulates every g^2."""

    Config = FedAdagradConfig

    def second_moment(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        return v + g2
