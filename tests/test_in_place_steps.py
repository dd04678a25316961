"""The built-in strategies' in-place outer steps give exactly ``outer_step``'s bits."""

from __future__ import annotations

import pytest
import torch

from strategies import Aggregate, DiLoCo, FedAvg, FedAvgM
from strategies.base import steps_in_place
from strategies.diloco import DiLoCoConfig
from strategies.momentum import CHUNK


def aggregate(g: dict[str, torch.Tensor]) -> Aggregate:
    return Aggregate({k: v.clone() for k, v in g.items()}, 1.0, {}, 0)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize(
    "make",
    [
        DiLoCo,
        FedAvg,
        FedAvgM,
        lambda: DiLoCo(DiLoCoConfig(momentum=0.0)),
        lambda: DiLoCo(DiLoCoConfig(nesterov=False)),
    ],
)
def test_in_place_matches_the_functional_step_over_rounds(make):
    g = torch.Generator().manual_seed(0)
    # A tensor over several chunks (and not a multiple of one), a small one, an integer buffer.
    theta = {
        "big": torch.randn(2 * CHUNK + 777, generator=g),
        "w": torch.randn(33, 7, generator=g),
        "count": torch.arange(3),
    }
    plain, fused = make(), make()
    a, b = dict(theta), {k: v.clone() for k, v in theta.items()}
    for _ in range(3):
        delta = {
            k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in theta.items() if k != "count"
        }
        a = plain.outer_step(a, aggregate(delta))
        b = fused.outer_step_in_place(b, aggregate(delta))
        for k in theta:
            assert torch.equal(bits(a[k]), bits(b[k])), k
    sa, sb = plain.state_dict(), fused.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_subclass_that_overrides_outer_step_alone_keeps_its_own_step():
    class Slowed(DiLoCo):
        def outer_step(self, theta, aggregate):
            return super().outer_step(theta, aggregate)

    assert steps_in_place(DiLoCo()) and not steps_in_place(Slowed())
