"""Drain, undrain and the health rules in the coordinator (in-process, fake clock): a drained
site finishes its round and is in no later one, its joins are refused until undrained, the
list survives a restart, shared-data mode hands its unit to another site, and a probe far below
the others drains a site automatically (held back where min_sites would not be met)."""

from __future__ import annotations

import errno
import json
import time

import pytest
from core_helpers import Clock, delta_like, heartbeat_all, new_core, push

from coordinator.events.log import read_events
from coordinator.members import site_control
from coordinator.records import Refused
from wire.health import Probe

SITES = ("site-a", "site-b", "site-c")


def _start(tmp_path, clock, sites=SITES, **sections):
    sections.setdefault("rounds", {"min_sites": 1})
    core = new_core(tmp_path, clock, **sections)
    tokens = {s: core.join(s)[0].token for s in sites}
    heartbeat_all(core, clock, tokens, 2.0)
    return core, tokens


def _events(core, kind):
    core.events.close()
    return [e for e in read_events(core.cfg.state_dir / "events.jsonl") if e["kind"] == kind]


def test_a_drained_site_finishes_its_round_then_is_in_no_later_one(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock)
    assert core.round.participants == set(SITES)
    changed, message, drained = core.set_drain("site-c", True, "bad GPU")
    assert changed and drained == ["site-c"] and "finishes its current work" in message
    assert core.drain_reason("site-c") == "bad GPU (operator)"
    # Still a participant of the open round: the round waits for its update.
    assert core.round_info("site-c")["participant"]
    for site in ("site-a", "site-b"):
        push(core, site, tokens[site], 0, delta_like(core, 1.0))
    heartbeat_all(core, clock, tokens, 1.0)
    assert core.round.number == 0, "the round must wait for the drained site's update"
    push(core, "site-c", tokens["site-c"], 0, delta_like(core, 1.0))
    heartbeat_all(core, clock, tokens, 1.0)
    core.writer.wait()
    heartbeat_all(core, clock, tokens, 1.0)
    assert core.round.number == 1
    assert core.round.participants == {"site-a", "site-b"}
    assert not core.round_info("site-c")["participant"]
    core.leave("site-c", tokens["site-c"])
    with pytest.raises(Refused, match="drained: bad GPU.*coordinator undrain site-c"):
        core.join("site-c")
    assert [e["site"] for e in _events(core, "drained")] == ["site-c"]


def test_undrain_admits_the_site_again_and_twice_changes_nothing(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock)
    core.set_drain("site-b", True, "maintenance")
    assert core.set_drain("site-b", True, "again") == (
        False,
        "site site-b was already drained",
        ["site-b"],
    )
    assert core.drain_reason("site-b") == "maintenance (operator)"  # the first reason stays
    core.leave("site-b", tokens["site-b"])
    changed, message, drained = core.set_drain("site-b", False)
    assert changed and drained == [] and "may join again" in message
    assert core.set_drain("site-b", False)[:2] == (False, "site site-b was not drained")
    assert core.join("site-b")[0].token > tokens["site-b"]


def test_the_drain_list_survives_a_restart(tmp_path):
    clock = Clock()
    core, _ = _start(tmp_path, clock)
    core.set_drain("site-a", True, "flaky link")
    core.close()
    saved = json.loads((core.cfg.state_dir / "drained.json").read_text())
    assert saved["sites"]["site-a"]["reason"] == "flaky link"
    again = new_core(tmp_path, Clock(100.0), rounds={"min_sites": 1})
    with pytest.raises(Refused, match="site 'site-a' is drained"):
        again.join("site-a")
    assert again.join("site-b")[0].token > 0
    again.close()


def test_a_damaged_drain_list_stops_the_start_and_is_left_as_it_was(tmp_path):
    clock = Clock()
    core, _ = _start(tmp_path, clock)
    core.close()
    path = core.cfg.state_dir / "drained.json"
    path.write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable list of drained sites"):
        new_core(tmp_path, Clock(100.0), rounds={"min_sites": 1})
    assert path.read_text() == "{not json"


def test_drain_of_a_site_never_seen_says_so_and_bad_names_are_refused(tmp_path):
    clock = Clock()
    core, _ = _start(tmp_path, clock)
    changed, message, _ = core.set_drain("site-z", True, "")
    assert changed and "has not joined since this coordinator started" in message
    assert core.drain_reason("site-z") == "no reason given (operator)"
    with pytest.raises(Refused, match="site name"):
        core.set_drain("../etc", True, "x")
    assert core.set_drain("site-z", False)[0]


def test_wait_round_answers_at_once_when_its_site_is_drained(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock)
    info = core.round_info("site-a")
    # As the servicer reads a RoundInfo: every field set, "" where federated data has no unit.
    known = {k: info.get(k, "") for k in ("round", "version", "finished", "participant")}
    known |= {"data_unit": "", "update_wanted": False}
    started = time.monotonic()
    core.wait_round("site-a", tokens["site-a"], known, 0.2)
    assert time.monotonic() - started >= 0.2, "nothing changed: the watch waits"
    core.set_drain("site-a", True, "x")
    started = time.monotonic()
    info, cancels = core.wait_round("site-a", tokens["site-a"], known, 30.0)
    assert time.monotonic() - started < 10.0, "the watch must not sit out its 30 s"
    assert info["round"] == known["round"] and cancels == []
    # Told once under this lease: the next watch waits as usual (here for its 0.2 s).
    started = time.monotonic()
    core.wait_round("site-a", tokens["site-a"], known, 0.2)
    assert time.monotonic() - started >= 0.2


def test_shared_data_a_drained_sites_unit_goes_to_another_site(tmp_path):
    clock = Clock()
    shared = {"data": {"mode": "shared"}, "speculation": {"min_wait_s": 0.0, "slow_factor": 1.0}}
    core, tokens = _start(tmp_path, clock, **shared)
    units = {s: core.round_info(s)["data_unit"] for s in SITES}
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit=units["site-a"])
    core.set_drain("site-c", True, "hand back")
    # site-c still heartbeats (it is winding down), yet its unit is not waited for: the idle
    # site-a is given a backup copy of it.
    heartbeat_all(core, clock, tokens, 1.0)
    assert core.round_info("site-a")["data_unit"] == units["site-c"]
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 3.0), unit=units["site-c"])
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, 2.0), unit=units["site-b"])
    heartbeat_all(core, clock, tokens, 1.0)
    assert core.round.number == 1 and "site-c" not in core.round.participants
    commits = [e for e in _events(core, "update") if e.get("unit") == units["site-c"]]
    assert [e["site"] for e in commits] == ["site-a"]


def _probe(gflops: float, seq: int = 1, errors=()) -> Probe:
    return Probe(0, gflops, 0.0, 1, "cpu", tuple(errors), seq)


def test_a_probe_far_below_the_others_drains_its_site(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock, health={"min_fraction": 0.5})
    for site, gflops in (("site-a", 100.0), ("site-b", 90.0)):
        core.heartbeat(site, tokens[site], None, _probe(gflops))
    assert core.drain_reason("site-c") == ""
    core.heartbeat("site-c", tokens["site-c"], None, _probe(9.0))
    reason = core.drain_reason("site-c")
    assert reason.startswith("matmul 9 GFLOP/s is 0.10 of the median 90") and "(health)" in reason
    assert [e["by"] for e in _events(core, "drained")] == ["health"]
    saved = json.loads((core.cfg.state_dir / "drained.json").read_text())
    assert saved["sites"]["site-c"]["by"] == "health"


def test_no_automatic_drain_below_min_sites_with_two_peers_or_when_off(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock, health={"min_fraction": 0.5}, rounds={"min_sites": 3})
    for site, gflops in (("site-a", 100.0), ("site-b", 90.0), ("site-c", 1.0)):
        core.heartbeat(site, tokens[site], None, _probe(gflops))
    assert core.drain_reason("site-c") == "", "draining would leave fewer than min_sites"
    core.close()
    clock = Clock()
    two, tokens = _start(
        tmp_path / "two", clock, ("site-a", "site-b"), health={"min_fraction": 0.5}
    )
    two.heartbeat("site-a", tokens["site-a"], None, _probe(100.0))
    two.heartbeat("site-b", tokens["site-b"], None, _probe(1.0))
    assert two.drain_reason("site-b") == "", "two sites are too few to call one far below"
    two.close()
    clock = Clock()
    off, tokens = _start(tmp_path / "off", clock)  # min_fraction defaults to 0: never
    errors = ["GPU 0: 3 uncorrected ECC errors"]
    for site, probe in (
        ("site-a", _probe(100.0)),
        ("site-b", _probe(90.0, errors=errors)),  # drained for its errors (on by default)
        ("site-c", _probe(1.0)),
    ):
        off.heartbeat(site, tokens[site], None, probe)
    assert off.drain_reason("site-c") == ""
    assert off.drain_reason("site-b").startswith("GPU errors: GPU 0: 3 uncorrected")


def test_a_drain_the_disk_refused_is_written_by_the_retry(tmp_path, monkeypatch):
    clock = Clock()
    core, _ = _start(tmp_path, clock)
    real = site_control.write_atomic
    calls = []

    def full_once(path, data):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(site_control, "write_atomic", full_once)
    with pytest.raises(Refused, match="could not be written.*would not survive a restart"):
        core.set_drain("site-b", True, "disk")
    assert not (core.cfg.state_dir / "drained.json").exists()
    changed, message, _ = core.set_drain("site-b", True, "disk")
    assert not changed and message == "site site-b was already drained"
    saved = json.loads((core.cfg.state_dir / "drained.json").read_text())
    assert list(saved["sites"]) == ["site-b"]


def test_after_a_restart_the_round_does_not_wait_for_a_drained_participant(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock)
    core.set_drain("site-c", True, "leaving")
    for site in ("site-a", "site-b"):
        push(core, site, tokens[site], 0, delta_like(core, 1.0))
    core.close()
    clock = Clock(100.0)
    again = new_core(tmp_path, clock, rounds={"min_sites": 1})
    assert again.round.number == 0 and "site-c" not in again.members.live(clock.now)
    tokens = {s: again.join(s)[0].token for s in ("site-a", "site-b")}
    heartbeat_all(again, clock, tokens, 2.0)
    assert again.round.number == 1, again.waiting_reason()
    with pytest.raises(Refused, match="drained"):
        again.join("site-c")
    again.close()


def test_one_probe_per_site_per_round_and_bad_reasons_refused(tmp_path):
    clock = Clock()
    core, tokens = _start(tmp_path, clock, health={"min_fraction": 0.5})
    core.heartbeat("site-a", tokens["site-a"], None, _probe(100.0, 1))
    core.heartbeat("site-a", tokens["site-a"], None, _probe(1.0, 2))  # same round: not taken
    assert core.members.sites["site-a"].health.seq == 1
    assert len(_events(core, "health")) == 1
    for reason in ("x\n2026 ERROR forged", "\x1b[31mred", "r" * 201):
        with pytest.raises(Refused, match="printable text of at most 200"):
            core.set_drain("site-b", True, reason)
    assert core.drain_reason("site-b") == ""
