"""A restarted coordinator keeps the open round's deadline (CoordinatorCore, fake clocks)."""

from __future__ import annotations

import time

from core_helpers import core_config

from coordinator.core import CoordinatorCore


def _config(tmp_path):
    return core_config(
        tmp_path,
        job={"name": "restart"},
        rounds={"total": 3, "min_sites": 1},
        timeouts={"lease_ttl_s": 10.0},
    )


def test_the_round_deadline_survives_a_restart(tmp_path, monkeypatch):
    wall = [1000.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    mono = [0.0]
    first = CoordinatorCore(_config(tmp_path), clock=lambda: mono[0])
    first.join("site-a")
    mono[0] = 2.0
    first.tick()
    assert first.round.opened_at == 2.0 and first.round.participants == {"site-a"}

    # 60 s later (wall clock) a new process, whose monotonic clock starts anywhere.
    wall[0] += 60.0
    mono2 = [5.0]
    second = CoordinatorCore(_config(tmp_path), clock=lambda: mono2[0])
    assert second.round.number == 0 and second.round.participants == {"site-a"}
    assert second.round.opened_at == 5.0 - 60.0  # opened 60 s ago, not at the restart
    deadline = second.round.opened_at + second.cfg.rounds.deadline_s
    assert deadline == 45.0  # 40 s of the round's 100 s left
