"""DiLoCo with knobs that widen the coordinator's round close, so a test can kill it there.

A round close is milliseconds for a small model: too short to hit by polling. This plugin
(``faults.slow_strategy:SlowDiLoCo``, importable by the coordinator because the harness puts
``tests/`` on its ``PYTHONPATH``) computes exactly DiLoCo's outer step, so the model matches a
plain DiLoCo run bit for bit, but

* ``close_delay_s``: writes ``marker_dir/aggregating-r<N>`` when the outer step of round N
  starts, then sleeps (in round ``delay_round`` only, or in every round if it is -1), so
  "killed while it aggregates" is a window the harness can see;
* ``ballast_mib``: adds that many MiB of zeros to the strategy state, so the checkpoint write
  (hash, write, fsync) takes long enough to be killed in the middle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from strategies import Aggregate
from strategies.base import Tensors
from strategies.diloco import DiLoCo, DiLoCoConfig

BALLAST = "ballast"


@dataclass(frozen=True)
class SlowDiLoCoConfig(DiLoCoConfig):
    close_delay_s: float = 0.0
    delay_round: int = -1
    ballast_mib: int = 0
    marker_dir: str = ""


class SlowDiLoCo(DiLoCo):
    Config = SlowDiLoCoConfig

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        c = self.config
        if c.marker_dir:
            Path(c.marker_dir, f"aggregating-r{aggregate.round}").write_text(f"{time.time()}\n")
        if c.close_delay_s > 0 and c.delay_round in (-1, aggregate.round):
            time.sleep(c.close_delay_s)
        return super().outer_step(theta, aggregate)

    def state_dict(self) -> Tensors:
        state = dict(super().state_dict())
        if self.config.ballast_mib:
            state[BALLAST] = torch.zeros(self.config.ballast_mib << 18, dtype=torch.float32)
        return state

    def load_state_dict(self, state: Tensors) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != BALLAST})
