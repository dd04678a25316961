"""A restarted coordinator checks every spooled update against its record before counting it
again: a damaged one is set aside and asked for again, never counted, never a reason to stop
(in-process cores with fake clocks, real spool files)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from core_helpers import Clock, delta_like, heartbeat_all, new_core, push

from coordinator.events.log import read_events
from coordinator.persist import local_store as store_mod
from coordinator.records import Refused

SITES = ("site-a", "site-b")
DELTAS = {"site-a": 1.0, "site-b": 2.0, "site-c": 4.0}


def spooled(tmp_path, round_number: int, label: str):
    return tmp_path / "state" / "spool" / f"round-{round_number:08d}" / f"{label}.update"


def flip_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def start(tmp_path, clock, sites=SITES, **sections):
    core = new_core(tmp_path, clock, **sections)
    tokens = {s: core.join(s)[0].token for s in sites}
    clock.now += 1.0
    core.tick()
    assert core.round.opened_at is not None
    return core, tokens


def crash_free_theta(tmp_path, sites=SITES, **sections):
    """theta_1 of the same round without a crash."""
    core, tokens = start(tmp_path / "crash-free", Clock(), sites, **sections)
    for s in sites:
        push(core, s, tokens[s], 0, delta_like(core, DELTAS[s]))
    assert core.tick()
    core.close()
    return {n: t.clone() for n, t in core.theta.items()}


def assert_same_theta(got, want) -> None:
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want), "theta differs from the crash-free run"


def restart_with_site_a_damaged(tmp_path, damage, caplog):
    clock = Clock()
    core, tokens = start(tmp_path, clock)
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, DELTAS["site-a"]))
    core.events.close()  # the process dies: nothing else is written
    damage(spooled(tmp_path, 0, "site-a"))
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        again = new_core(tmp_path, Clock(10.0))
    return again


@pytest.mark.parametrize("damage", [flip_bytes, truncate], ids=["flipped", "truncated"])
def test_a_damaged_spooled_update_is_set_aside_asked_for_again_and_the_round_completes(
    tmp_path, caplog, damage
):
    again = restart_with_site_a_damaged(tmp_path, damage, caplog)
    assert again.round.number == 0 and again.round.opened_at is not None
    assert again.round.received == {} and again.state.accepted == {}  # not counted
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "site-a" in errors[0] and "round 0" in errors[0]
    size = spooled(tmp_path, 0, "site-a").with_name("damaged") / "site-a.0.update"
    assert f"found {size.stat().st_size} bytes" in errors[0] and "expected" in errors[0]
    assert not spooled(tmp_path, 0, "site-a").exists() and size.exists()  # kept as evidence
    events = [e for e in read_events(again.events.path) if e["kind"] == "update_damaged"]
    assert [(e["round"], e["key"]) for e in events] == [(0, "site-a")]

    tokens = {s: again.join(s)[0].token for s in SITES}
    assert again.round_info("site-a")["update_wanted"]
    assert not again.round_info("site-b")["update_wanted"]
    push(again, "site-a", tokens["site-a"], 0, delta_like(again, DELTAS["site-a"]))
    assert not again.round_info("site-a")["update_wanted"]
    push(again, "site-b", tokens["site-b"], 0, delta_like(again, DELTAS["site-b"]))
    assert again.tick() and again.round.number == 1
    assert_same_theta(again.theta, crash_free_theta(tmp_path))


def test_the_request_to_send_again_survives_a_further_restart(tmp_path, caplog):
    again = restart_with_site_a_damaged(tmp_path, truncate, caplog)
    again.events.close()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        third = new_core(tmp_path, Clock(20.0))
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]  # nothing new
    third.join("site-a")
    assert third.round_info("site-a")["update_wanted"] and third.round.received == {}


def test_an_unreadable_record_is_set_aside_too(tmp_path, caplog):
    def garble(path):
        path.with_suffix(".json").write_text("{not json")

    again = restart_with_site_a_damaged(tmp_path, garble, caplog)
    assert again.round.received == {}
    assert "unreadable record" in caplog.text
    again.join("site-a")
    assert again.round_info("site-a")["update_wanted"]


# ---- the close record names a damaged update --------------------------------------------------


def _killed(self, ckpt):  # the process dies before the checkpoint is written
    raise OSError("killed")


def decided_then_killed(tmp_path, monkeypatch, sites, **sections):
    """Round 0 closes (theta_1 served), site-b's round-1 update counts; the process dies
    before theta_1's checkpoint."""
    clock = Clock()
    core, tokens = start(tmp_path, clock, sites, **sections)
    monkeypatch.setattr(store_mod.CheckpointStore, "save", _killed)
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, DELTAS["site-a"]))
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, DELTAS["site-b"]))
    heartbeat_all(core, clock, tokens, core.cfg.rounds.deadline_s + 1.0)
    assert core.round.number == 1 and core.round.opened_at is not None
    push(core, "site-b", tokens["site-b"], 1, delta_like(core, 8.0))
    served = core.published.theta_hash
    with pytest.raises(OSError):
        core.writer.wait()
    core.events.close()
    monkeypatch.undo()
    return served


def test_a_close_record_naming_a_damaged_update_waits_for_it_and_closes_the_same(
    tmp_path, monkeypatch, caplog
):
    three = ("site-a", "site-b", "site-c")  # site-c never delivers: round 0 closes at its deadline
    served = decided_then_killed(tmp_path, monkeypatch, three)
    flip_bytes(spooled(tmp_path, 0, "site-a"))
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        again = new_core(tmp_path, Clock(500.0))
    assert again.round.number == 0 and again.published.version == 0  # not replayed
    assert "close record" in caplog.text and "site-a" in caplog.text
    tokens = {s: again.join(s)[0].token for s in three}
    assert [s for s in three if again.round_info(s)["update_wanted"]] == ["site-a"]
    # Only the recorded updates come back: site-c's (late in the run that closed the round)
    # is refused, so the round closes as it was decided.
    with pytest.raises(Refused) as err:
        push(again, "site-c", tokens["site-c"], 0, delta_like(again, DELTAS["site-c"]))
    assert err.value.code == "late"
    with pytest.raises(Refused):  # site-b's copy is counted already
        push(
            again, "site-b", tokens["site-b"], 0, delta_like(again, DELTAS["site-b"]), upload_id="x"
        )
    again.tick()
    assert again.round.number == 0  # still waiting for site-a
    assert "decided before a restart; waiting for site-a" in again.waiting_reason()
    push(again, "site-a", tokens["site-a"], 0, delta_like(again, DELTAS["site-a"]), upload_id="y")
    assert again.tick() and again.round.number == 1
    assert again.published.theta_hash == served  # bit for bit
    # So round 1 goes on from its spool: site-b's update, trained from that theta_1, counts.
    assert again.round.opened_at is not None and set(again.round.received) == {"site-b"}
    again.writer.wait()
    meta = json.loads((tmp_path / "state/checkpoints/round-00000001/meta.json").read_text())
    assert meta["closed_round"]["sites"] == ["site-a", "site-b"]
    closes = [e["round"] for e in read_events(again.events.path) if e["kind"] == "round_closed"]
    assert closes == [0]  # logged once


def test_without_the_resend_the_pinned_round_closes_at_its_deadline(tmp_path, monkeypatch, caplog):
    served = decided_then_killed(tmp_path, monkeypatch, SITES, rounds={"min_sites": 1})
    truncate(spooled(tmp_path, 0, "site-a"))
    clock = Clock(500.0)
    again = new_core(tmp_path, clock, rounds={"min_sites": 1})
    tokens = {s: again.join(s)[0].token for s in SITES}
    heartbeat_all(again, clock, tokens, again.cfg.rounds.deadline_s - 5.0)
    assert again.round.number == 0  # the deadline runs from the restart
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        heartbeat_all(again, clock, tokens, 10.0)
    assert again.round.number == 1 and again.published.theta_hash != served
    assert "may differ" in caplog.text
    # Round 1's spooled update was trained from the old theta_1: it goes.
    assert "dropping the updates spooled before the restart" in caplog.text
    assert not spooled(tmp_path, 1, "site-b").exists()
    heartbeat_all(again, clock, tokens, 2.0)
    assert again.round.number == 1 and again.round.received == {}


# ---- shared-data mode: a lost unit is committed exactly once ----------------------------------

SHARED = {"data": {"mode": "shared"}, "speculation": {"min_wait_s": 5.0, "slow_factor": 2.0}}
THREE = ("site-a", "site-b", "site-c")


def shared_restart(tmp_path, damage=flip_bytes):
    clock = Clock()
    core, tokens = start(tmp_path, clock, THREE, **SHARED)
    assert core.round_info("site-a")["data_unit"] == "u0"
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0), unit="u0")
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, 2.0), unit="u1")
    core.events.close()
    damage(spooled(tmp_path, 0, "site-a@u0"))
    clock = Clock(100.0)
    again = new_core(tmp_path, clock, **SHARED)
    return again, clock, {s: again.join(s)[0].token for s in THREE}


def closed_sites(core) -> list[str]:
    core.writer.wait()
    path = core.cfg.state_dir / "checkpoints" / "round-00000001" / "meta.json"
    return json.loads(path.read_text())["closed_round"]["sites"]


def test_a_lost_unit_is_uncommitted_resent_and_committed_once(tmp_path):
    again, clock, tokens = shared_restart(tmp_path)
    assert again.ledger.committed_by("u0") is None
    assert again.ledger.committed_by("u1") == (0, "site-b")
    info = again.round_info("site-a")
    assert info["participant"] and info["data_unit"] == "u0" and info["update_wanted"]
    push(again, "site-a", tokens["site-a"], 0, delta_like(again, 1.0), unit="u0")
    assert again.ledger.committed_by("u0") == (0, "site-a")
    with pytest.raises(Refused) as err:
        push(again, "site-a", tokens["site-a"], 0, delta_like(again, 1.0), unit="u0", upload_id="z")
    assert err.value.code == "duplicate"
    push(again, "site-c", tokens["site-c"], 0, delta_like(again, 4.0), unit="u2")
    again.tick()
    assert again.round.number == 1
    assert closed_sites(again) == ["site-a@u0", "site-b@u1", "site-c@u2"]
    assert again.ledger.invariant_violations() == []


def test_a_lost_unit_trained_again_elsewhere_counts_once(tmp_path):
    again, clock, tokens = shared_restart(tmp_path, truncate)
    push(again, "site-c", tokens["site-c"], 0, delta_like(again, 4.0), unit="u2")
    # site-a never sends u0 again: an idle site gets a backup copy of it.
    helper = None
    for _ in range(30):
        heartbeat_all(again, clock, {s: tokens[s] for s in ("site-b", "site-c")}, 1.0)
        helper = next((s for s in ("site-b", "site-c") if again.round_info(s)["data_unit"]), None)
        if helper:
            break
    assert helper is not None and again.round_info(helper)["data_unit"] == "u0"
    assert not again.round_info(helper)["update_wanted"]  # a new copy, not a re-send
    push(again, helper, tokens[helper], 0, delta_like(again, 3.0), unit="u0")
    with pytest.raises(Refused) as err:  # site-a's re-send comes too late: not counted twice
        push(again, "site-a", tokens["site-a"], 0, delta_like(again, 1.0), unit="u0")
    assert err.value.code == "duplicate" and err.value.committed_by == helper
    again.tick()
    assert again.round.number == 1
    assert closed_sites(again) == sorted([f"{helper}@u0", "site-b@u1", "site-c@u2"])
    assert again.ledger.invariant_violations() == []
