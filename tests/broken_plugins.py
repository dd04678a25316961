"""Strategy plugins that fail on purpose, for tests/test_plugins.py.

The coordinator process imports this module by name (``broken_plugins:Broken``): PYTHONPATH
includes tests/. ``fail_in`` picks the hook that fails, ``fail_round`` the round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies import Strategy


@dataclass(frozen=True)
class BrokenConfig:
    fail_in: str = ""  # "", "begin_round", "update_weight", "outer_step", "load_state_dict"
    fail_round: int = 0
    mode: str = "raise"  # outer_step: "raise", "bad_shape", "not_dict", "nan"


class Broken(Strategy):
    """FedAvg with a step counter as its state, failing where it is told to."""

    Config = BrokenConfig

    def __init__(self, config: BrokenConfig) -> None:
        super().__init__(config)
        self.steps = torch.zeros((), dtype=torch.int64)
        self.round = -1

    def begin_round(self, round: int, theta) -> None:
        self.round = round
        if self.config.fail_in == "begin_round" and round == self.config.fail_round:
            raise RuntimeError("begin_round exploded")

    def update_weight(self, site: str, reported_weight: float) -> float:
        if self.config.fail_in == "update_weight" and self.round == self.config.fail_round:
            raise ZeroDivisionError("update_weight exploded")
        return reported_weight

    def outer_step(self, theta, aggregate):
        self.steps += 1  # changed before failing: the checkpoint must not see it
        out = dict(theta)
        for name, d in aggregate.mean_delta.items():
            out[name] = theta[name] - d
        if self.config.fail_in == "outer_step" and aggregate.round == self.config.fail_round:
            mode = self.config.mode
            if mode == "raise":
                raise RuntimeError("outer step exploded")
            if mode == "bad_shape":
                out["lin.weight"] = out["lin.weight"][:, :2]
            if mode == "not_dict":
                return list(out.values())
            if mode == "nan":
                out["lin.bias"] = out["lin.bias"] * float("nan")
        return out

    def state_dict(self):
        return {"steps": self.steps.clone()}

    def load_state_dict(self, state) -> None:
        if self.config.fail_in == "load_state_dict":
            raise KeyError("load_state_dict exploded")
        self.steps = state["steps"].clone()
