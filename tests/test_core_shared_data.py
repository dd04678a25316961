"""Shared-data mode in the coordinator (in-process, fake clock): data units per round, a
backup copy of a straggler's unit, the first commit wins, the loser is cancelled, units left
uncommitted go to a later round, and a restart replays the round's commits."""

from __future__ import annotations

import json

import pytest
from core_helpers import Clock, delta_like, heartbeat_all, new_core, push

from coordinator.events.log import read_events
from coordinator.records import Refused

SITES = ("site-a", "site-b", "site-c")
SHARED = {"data": {"mode": "shared"}, "speculation": {"min_wait_s": 5.0, "slow_factor": 2.0}}


def _start(tmp_path, clock, **extra):
    core = new_core(tmp_path, clock, **{**SHARED, **extra})
    tokens = {s: core.join(s)[0].token for s in SITES}
    heartbeat_all(core, clock, tokens, 2.0)
    return core, tokens


def _progress(core, site, token, round_number, step):
    return core.heartbeat(site, token, {"round": round_number, "inner_step": step})


def _meta(core, round_number):
    core.writer.wait()  # checkpoints are written in the background
    path = core.cfg.state_dir / "checkpoints" / f"round-{round_number:08d}" / "meta.json"
    return json.loads(path.read_text())


def test_a_straggler_gets_a_backup_and_the_first_commit_wins(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock)
    units = {s: core.round_info(s)["data_unit"] for s in SITES}
    assert units == {"site-a": "u0", "site-b": "u1", "site-c": "u2"}
    clock.now += 2.0
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u0")
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, 2.0), unit="u1")
    assert core.round_info("site-a") | {"data_unit": ""} == core.round_info("site-a")
    assert not core.round_info("site-a")["participant"]
    # site-c heartbeats but trains slowly; after slow_factor x the median commit time a backup.
    for _ in range(6):
        clock.now += 1.0
        _progress(core, "site-c", tokens["site-c"], 0, 1)
        core.heartbeat("site-a", tokens["site-a"], None)
        core.heartbeat("site-b", tokens["site-b"], None)
        core.tick()
    backup_site = next(s for s in ("site-a", "site-b") if core.round_info(s)["data_unit"])
    assert core.round_info(backup_site) | {"participant": True} == core.round_info(backup_site)
    assert core.round_info(backup_site)["data_unit"] == "u2"
    push(core, backup_site, tokens[backup_site], 0, delta_like(core, 3.0), unit="u2")
    # The straggler hears about it on its next heartbeat and its copy no longer counts.
    _, info, cancels = core.heartbeat("site-c", tokens["site-c"], None)
    assert cancels == ["u2"] and not info["participant"]
    with pytest.raises(Refused) as err:
        push(core, "site-c", tokens["site-c"], 0, delta_like(core, 9.0), unit="u2")
    assert err.value.code == "duplicate" and f"committed by {backup_site}" in str(err.value)
    core.tick()
    assert core.round.number == 1
    meta = _meta(core, 1)
    assert meta["closed_round"]["sites"] == sorted(["site-a@u0", "site-b@u1", f"{backup_site}@u2"])
    assert core.ledger.invariant_violations() == []
    assert [e["unit"] for e in read_events(core.events.path) if e["kind"] == "backup"] == ["u2"]


def test_a_suspected_holder_is_backed_up_at_once(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock, speculation={"min_wait_s": 1000.0})
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u0")
    alive = {s: t for s, t in tokens.items() if s != "site-c"}
    heartbeat_all(core, clock, alive, core.cfg.timeouts.suspicion_after_s() + 1.0)
    assert "site-c" in core.suspected
    assert core.round_info("site-a")["data_unit"] == "u2"  # backed up despite min_wait_s


def test_a_unit_left_uncommitted_goes_to_the_next_round(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock, speculation={"enabled": False})
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u0")
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, 1.0), unit="u1")
    heartbeat_all(core, clock, tokens, core.cfg.rounds.deadline_s + 1.0)
    assert core.round.number == 1
    assert _meta(core, 1)["closed_round"]["carried_units"] == ["u2"]
    heartbeat_all(core, clock, tokens, 1.0)
    units = sorted(core.round_info(s)["data_unit"] for s in SITES)
    assert units == ["u2", "u3", "u4"]  # the carried unit first, then fresh ones
    assert core.ledger.invariant_violations() == []


def test_a_restart_mid_round_replays_the_commits(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock)
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u0")
    core.events.close()
    clock2 = Clock(500.0)
    again = new_core(tmp_path, clock2, **SHARED)
    assert again.ledger.committed_by("u0") == (0, "site-a")
    assert {s: again.round_info(s)["data_unit"] for s in SITES} == {
        "site-a": "",
        "site-b": "u1",
        "site-c": "u2",
    }
    tokens = {s: again.join(s)[0].token for s in SITES}
    with pytest.raises(Refused):  # u0 is in already: a re-sent copy is not counted twice
        push(again, "site-a", tokens["site-a"], 0, delta_like(again, 1.0), unit="u0")
    push(again, "site-b", tokens["site-b"], 0, delta_like(again, 1.0), unit="u1")
    push(again, "site-c", tokens["site-c"], 0, delta_like(again, 1.0), unit="u2")
    again.tick()
    assert again.round.number == 1
    assert again.ledger.invariant_violations() == []


def test_pushes_that_name_no_unit_or_someone_elses_are_refused(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock)
    with pytest.raises(Refused, match="names its data unit"):
        push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    with pytest.raises(Refused, match="holds no unit"):
        push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u1")
    with pytest.raises(Refused):
        push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="x\n")
    assert core.round.received == {}


def test_ticks_before_the_first_round_opens_are_harmless(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock, rounds={"join_window_s": 5.0}, **SHARED)
    tokens = {"site-a": core.join("site-a")[0].token}
    heartbeat_all(core, clock, tokens, 3.0)  # below quorum: waiting, no units yet
    assert core.round.opened_at is None and core.round_info("site-a")["data_unit"] == ""
    assert "waiting for sites" in core.waiting_reason()


def test_a_push_for_a_closed_round_is_late_not_invalid(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock, speculation={"enabled": False})
    for s, u in (("site-a", "u0"), ("site-b", "u1"), ("site-c", "u2")):
        push(core, s, tokens[s], 0, delta_like(core, 1.0), unit=u)
    core.tick()
    with pytest.raises(Refused) as err:
        push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u0", upload_id="x")
    assert err.value.code == "late"


def test_status_says_which_units_the_round_waits_for(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock, speculation={"enabled": False})
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u0")
    assert core.waiting_reason() == "waiting on 2 data unit(s): u1 at site-b, u2 at site-c"
