"""Streaming outer steps through a real coordinator (``[streaming] fragments = 2``): each round
the sites push only the round's fragment, theta changes only there, the downlink delta carries
only that fragment (raw float32, no ``[compression.downlink]``) and every site rebuilds the
coordinator's theta from it (in memory and into a mapped file); the result equals an offline
per-fragment DiLoCo computation bit for bit, across a kill -9 between rounds (the restarted
coordinator serves the same fragment delta) and one with an update in the spool."""

from __future__ import annotations

import math

import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from site_client.transfer.client import CoordinatorClient, GlobalState
from strategies import Aggregate
from strategies.diloco import DiLoCo, DiLoCoConfig
from wire.digest import state_digest
from wire.downlink import differing
from wire.fragments import StreamingConfig, fragment_plan
from wire.tensors import ALIGN

pytestmark = pytest.mark.e2e

P, OUTER, SITES = 2, 2, ("site-a", "site-b")
MODEL = {"factory": "coord_harness:blocks_model", "seed": 3, "kwargs": {"blocks": 4, "d": 16}}


@pytest.fixture
def coord(tmp_path):
    cfg = h.job_config(
        name="streaming",
        strategy={"name": "diloco", "lr": 0.7, "momentum": 0.9},
        rounds={"total": OUTER, "inner_steps": 2, "min_sites": 2, "max_sites": 2},
        model=MODEL,
    )
    cfg["rounds"]["join_window_s"] = 5.0
    cfg["streaming"] = {"fragments": P, "delay_steps": 0}
    proc = h.start_coordinator(tmp_path, cfg)
    yield proc
    proc.stop()


def _delta(theta, names, k: int, r: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * r + k)
    return {n: 0.05 * torch.randn(theta[n].shape, generator=g) for n in names}


def _fragment_bytes(theta, names) -> int:
    sizes = [4 * math.prod(theta[n].shape) for n in sorted(names)]
    return sum(-(-n // ALIGN) * ALIGN for n in sizes[:-1]) + sizes[-1]


def _offline(theta0, plan, rounds: int) -> dict[str, torch.Tensor]:
    """What the coordinator must compute: per round, the mean of the fragment's updates
    (summed in site order), DiLoCo's step on those tensors only, and theta_{r+1} = theta_r +
    the float32 delta the sites receive."""
    strategy = DiLoCo(DiLoCoConfig(lr=0.7, momentum=0.9))
    theta = {n: t.clone() for n, t in theta0.items()}
    for r in range(rounds):
        names = plan.names(r)
        deltas = [_delta(theta, names, k, r) for k in range(len(SITES))]
        mean = {n: (deltas[0][n] + deltas[1][n]) / 2 for n in names}
        new = strategy.outer_step(theta, Aggregate(mean, 2.0, {}, r))
        theta = {**theta, **{n: theta[n] + (new[n] - theta[n]) for n in names}}
    return theta


def test_fragment_rounds_match_offline_per_fragment_diloco(coord, tmp_path):
    clients = {s: CoordinatorClient(coord.address, s, backoff=h.FAST_BACKOFF) for s in SITES}
    held: dict[str, GlobalState | None] = dict.fromkeys(SITES)
    for c in clients.values():
        c.join()
    theta0 = plan = None
    for r in range(OUTER * P + 1):
        infos = [c.wait_for_round(r - 1) for c in clients.values()]
        previous = held["site-a"]
        for s, c in clients.items():
            before = c.bytes_received
            dest = tmp_path / f"{s}-theta-{r}.safetensors" if s == "site-b" else None
            held[s] = c.fetch(held=held[s], dest=dest)
            got = c.bytes_received - before
            if r > 0:  # the previous round's fragment only, raw float32 (64-byte aligned)
                assert got == _fragment_bytes(held[s].theta, plan.names(r - 1)), (r, s)
        a = held["site-a"]
        if r == 0:
            theta0 = {n: t.clone() for n, t in a.theta.items()}
            shapes = {n: tuple(t.shape) for n, t in theta0.items() if t.is_floating_point()}
            plan = fragment_plan(shapes, StreamingConfig(fragments=P))
        else:  # theta_{r} differs from theta_{r-1} exactly on round r-1's fragment
            assert differing(previous.theta, a.theta) == sorted(plan.names(r - 1))
        status = h.status(coord.address)
        assert a.theta_hash == held["site-b"].theta_hash == status.round.theta_hash
        assert state_digest(held["site-b"].theta) == status.round.theta_hash
        if r == OUTER * P:
            assert status.round.finished
            break
        assert all(i.round == r and i.fragment == r % P for i in infos)
        assert (infos[0].inner_steps, infos[0].total_rounds) == (1, OUTER * P)
        assert status.fragments == P and status.round.fragment == r % P
        for k, (s, c) in enumerate(clients.items()):
            c.push(r, _delta(held[s].theta, plan.names(r), k, r), base_version=r)
            if r == 2 and k == 0:  # a crash with one update of the open round spooled
                coord.kill()
                coord.restart()
        if r == 1:  # a crash once round 1 closed: theta_2's delta is served after the restart
            for c in clients.values():
                c.wait_for_round(r)
            coord.kill()
            coord.restart()
    assert all(c.delta_mismatches == 0 for c in clients.values())
    expected = _offline(theta0, plan, OUTER * P)
    assert differing(expected, held["site-a"].theta) == []
    assert state_digest(expected) == held["site-a"].theta_hash
    for c in clients.values():
        c.close()
