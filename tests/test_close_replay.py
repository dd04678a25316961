"""theta_{r+1} is served before its checkpoint is written; a restart in between recomputes the
very same theta_{r+1} from the checkpoint of round r, the close record and the spool."""

from __future__ import annotations

import json

import pytest
import torch
from core_helpers import Clock, delta_like, new_core, push

from coordinator.events.log import read_events
from coordinator.persist import local_store as store_mod

SITES = ("site-a", "site-b")


def run_round(core, clock, tokens, r):
    for i, (site, token) in enumerate(tokens.items()):
        push(core, site, token, r, delta_like(core, 0.5 + i))
    assert core.tick()


def start(tmp_path, clock, **sections):
    core = new_core(tmp_path, clock, **sections)
    tokens = {s: core.join(s)[0].token for s in SITES}
    clock.now += 1.0
    core.tick()
    return core, tokens


@pytest.mark.parametrize("strategy", [{"name": "diloco"}, {"name": "fedavg"}])
def test_a_crash_between_publishing_and_checkpointing_gives_the_same_theta(
    tmp_path, monkeypatch, strategy
):
    clock = Clock()
    core, tokens = start(tmp_path, clock, strategy=strategy)
    run_round(core, clock, tokens, 0)
    core.writer.wait()
    clock.now += 1.0
    core.tick()  # round 1 opens

    def crash(self, ckpt):  # the process dies before the checkpoint of round 2 is written
        core.stopping.set()  # (a failed write is otherwise retried until it succeeds)
        raise OSError("killed")

    monkeypatch.setattr(store_mod.CheckpointStore, "save", crash)
    run_round(core, clock, tokens, 1)
    published = core.published.theta_hash
    assert core.published.version == 2  # served already
    with pytest.raises(OSError):
        core.writer.wait()
    core.events.close()
    monkeypatch.undo()
    assert not (tmp_path / "state" / "checkpoints" / "round-00000002").exists()

    again = new_core(tmp_path, Clock(50.0), strategy=strategy)
    assert again.round.number == 2 and again.published.theta_hash == published
    again.writer.wait()
    meta = json.loads((tmp_path / "state/checkpoints/round-00000002/meta.json").read_text())
    assert meta["theta_digest"] == published.hex()
    closes = [e["round"] for e in read_events(again.events.path) if e["kind"] == "round_closed"]
    assert closes == [0, 1]  # the replayed close is logged once


def test_without_a_close_record_the_round_replays_open(tmp_path):
    clock = Clock()
    core, tokens = start(tmp_path, clock)
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    core.events.close()
    again = new_core(tmp_path, Clock(10.0))
    assert again.round.number == 0 and again.round.opened_at is not None
    assert set(again.round.received) == {"site-a"}
    tokens = {s: again.join(s)[0].token for s in SITES}
    push(again, "site-b", tokens["site-b"], 0, delta_like(again, 2.0))
    assert again.tick() and again.round.number == 1
    # The sum includes the update spooled before the restart.
    want = {n: t - 1.5 for n, t in core.theta.items() if t.is_floating_point()}
    got = again.theta
    assert all(torch.allclose(got[n], want[n]) for n in want)


def test_a_replayed_close_encodes_the_adaptive_downlink_at_the_recorded_rung(tmp_path, monkeypatch):
    """The rung came from what the sites reported before the crash; the restarted coordinator
    has heard nothing yet (it would choose the first rung), so only the close record can give
    the same delta, and so the same theta_{r+1}."""
    ladder = {"mode": "adaptive", "ladder": ["none", "int8", "int4"]}
    sections = {"compression": {"downlink": ladder}, "strategy": {"name": "diloco"}}
    clock = Clock()
    core, tokens = start(tmp_path, clock, **sections)
    slow = {"fetch_bytes_per_s": 10.0, "task_compute_s": 1.0}  # no rung fits: the last
    for site, token in tokens.items():
        core.heartbeat(site, token, slow)
    monkeypatch.setattr(
        store_mod.CheckpointStore, "save", lambda self, ckpt: (_ for _ in ()).throw(OSError())
    )
    core.stopping.set()  # the failed checkpoint write is not retried: the process "dies"
    run_round(core, clock, tokens, 0)
    published = core.published.theta_hash
    assert {e.codec for e in core.published.delta_manifest.entries} == {"int4"}
    close = json.loads((tmp_path / "state/spool/round-00000000/_close.json").read_text())
    assert close["downlink"]["codec"] == "int4" and close["downlink"]["fits"] is False
    # The failed write must be over before the real save is back (as in the test above):
    # written after it, the checkpoint would commit round 0 and drop its spool under the
    # replay, as a loaded machine showed once.
    with pytest.raises(OSError):
        core.writer.wait()
    core.events.close()
    monkeypatch.undo()

    again = new_core(tmp_path, Clock(50.0), **sections)
    assert again.round.number == 1 and again.published.theta_hash == published
    assert {e.codec for e in again.published.delta_manifest.entries} == {"int4"}
