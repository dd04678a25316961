"""Failure handling decided inside the coordinator, driven in-process with a fake clock:
suspicion before lease expiry, late updates folded or dropped, the event log."""

from __future__ import annotations

import pytest
import torch
from core_helpers import Clock, delta_like, heartbeat_all, new_core, push

from coordinator.events.log import read_events
from coordinator.records import PushHeader, Refused
from wire.tensors import pack


def _open_round(core, clock, sites=("site-a", "site-b", "site-c")):
    tokens = {s: core.join(s)[0].token for s in sites}
    heartbeat_all(core, clock, tokens, 3.0)
    assert core.round.opened_at is not None and core.round.participants == set(sites)
    return tokens


def test_a_silent_site_is_suspected_and_not_waited_for_before_its_lease_expires(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = _open_round(core, clock)
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, 3.0))
    # site-c goes silent; the others keep heartbeating.
    quiet = {s: t for s, t in tokens.items() if s != "site-c"}
    suspicion = core.cfg.timeouts.suspicion_after_s()
    heartbeat_all(core, clock, quiet, suspicion - 2.0)
    assert core.round.number == 0, "closed before site-c was suspected"
    heartbeat_all(core, clock, quiet, 4.0)
    assert core.round.number == 1, core.waiting_reason()
    silent_for = clock.now - 3.0
    assert silent_for < core.cfg.timeouts.lease_ttl_s  # well before the lease ran out
    assert core.leases.get("site-c") is not None
    events = read_events(core.events.path)
    assert [e["site"] for e in events if e["kind"] == "suspected"] == ["site-c"]
    closed = [e for e in events if e["kind"] == "round_closed"]
    assert closed[0]["updates"] == ["site-a", "site-b"]


def test_a_site_heartbeating_on_a_jittery_link_is_not_suspected(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    for i in range(40):  # intervals between 0.5 s and 3 s, never silent for long
        clock.now += 0.5 + 2.5 * (i % 2)
        for site, token in tokens.items():
            core.heartbeat(site, token, None)
        core.tick()
        assert core.suspected == set()


@pytest.mark.parametrize("discount", [0.5, 0.0])
def test_a_late_update_is_folded_with_a_discount_or_dropped(tmp_path, discount):
    clock = Clock()
    core = new_core(
        tmp_path,
        clock,
        strategy={"name": "fedavg", "late_discount": discount},
        rounds={"min_sites": 1, "deadline_s": 30.0},
    )
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    theta0 = {n: core.theta[n].clone() for n in core.trainable}
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    heartbeat_all(core, clock, tokens, 31.0)  # the deadline closes round 0 without site-b
    assert core.round.number == 1
    theta1 = {n: core.theta[n].clone() for n in core.trainable}
    for n in core.trainable:
        torch.testing.assert_close(theta1[n], theta0[n] - 1.0)
    heartbeat_all(core, clock, tokens, 2.0)  # round 1 opens
    late = delta_like(core, 8.0)
    if discount == 0.0:
        with pytest.raises(Refused) as err:
            push(core, "site-b", tokens["site-b"], 0, late, base=0)
        assert err.value.code == "late"
        return
    assert push(core, "site-b", tokens["site-b"], 0, late, base=0)
    with pytest.raises(Refused) as err:  # counted once
        push(core, "site-b", tokens["site-b"], 0, late, base=0, upload_id="again")
    assert err.value.code == "duplicate"
    push(core, "site-a", tokens["site-a"], 1, delta_like(core, 2.0))
    push(core, "site-b", tokens["site-b"], 1, delta_like(core, 4.0))
    heartbeat_all(core, clock, tokens, 1.0)
    assert core.round.number == 2
    # FedAvg over site-a (2, w 1), site-b (4, w 1) and the late site-b (8, w 0.5).
    want = (2.0 + 4.0 + 0.5 * 8.0) / 2.5
    for n in core.trainable:
        torch.testing.assert_close(core.theta[n], theta1[n] - want)
    events = read_events(core.events.path)
    folded = [e for e in events if e["kind"] == "update" and e["late_from"] is not None]
    assert [(e["site"], e["late_from"], e["weight"]) for e in folded] == [("site-b", 0, 0.5)]


def test_an_update_two_rounds_late_is_refused(tmp_path):
    clock = Clock()
    core = new_core(
        tmp_path,
        clock,
        strategy={"name": "fedavg", "late_discount": 0.5},
        rounds={"min_sites": 1, "deadline_s": 30.0},
    )
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    for r in range(2):
        push(core, "site-a", tokens["site-a"], r, delta_like(core, 1.0))
        heartbeat_all(core, clock, tokens, 31.0)
    assert core.round.number == 2
    with pytest.raises(Refused) as err:
        push(core, "site-b", tokens["site-b"], 0, delta_like(core, 1.0), base=0)
    assert err.value.code == "late"


def test_the_event_log_survives_a_restart_and_continues(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    last = core.events.last_seq
    core.events.close()
    again = new_core(tmp_path, Clock(100.0))
    events = read_events(again.events.path)
    assert [e["seq"] for e in events] == list(range(1, last + 2))
    assert events[-1]["kind"] == "start" and events[-1]["epoch"] == 2
    kinds = [e["kind"] for e in events]
    assert kinds[:1] == ["start"] and "round_open" in kinds and "update" in kinds


def test_sites_join_and_leave_at_round_boundaries_and_the_outer_state_carries_on(tmp_path):
    """Elastic membership: site-c joins while round 1 is open (it takes part from round 2,
    training from theta_2 like everyone else); site-a leaves after round 1. The outer
    optimiser's momentum never leaves the coordinator, so a newcomer needs only theta."""
    clock = Clock()
    lr, mu = 0.7, 0.9
    core = new_core(
        tmp_path,
        clock,
        strategy={"name": "diloco", "lr": lr, "momentum": mu},
        rounds={"min_sites": 2, "max_sites": 3},
    )
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    theta = {n: core.theta[n].clone() for n in core.trainable}
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}

    def expect(grads: list[float]) -> None:
        g = sum(grads) / len(grads)
        for n in theta:
            momentum[n] = mu * momentum[n] + g
            theta[n] = theta[n] - lr * (g + mu * momentum[n])
            torch.testing.assert_close(core.theta[n], theta[n])

    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, 3.0))
    heartbeat_all(core, clock, tokens, 2.0)
    expect([1.0, 3.0])
    assert core.round.number == 1 and core.round.opened_at is not None
    tokens["site-c"] = core.join("site-c")[0].token
    assert not core.round_info("site-c")["participant"]
    with pytest.raises(Refused) as err:
        push(core, "site-c", tokens["site-c"], 1, delta_like(core, 5.0))
    assert err.value.code == "not_participant"
    push(core, "site-a", tokens["site-a"], 1, delta_like(core, 2.0))
    push(core, "site-b", tokens["site-b"], 1, delta_like(core, 2.0))
    heartbeat_all(core, clock, tokens, 1.0)  # closes round 1
    expect([2.0, 2.0])
    core.leave("site-a", tokens.pop("site-a"))
    heartbeat_all(core, clock, tokens, 1.0)  # opens round 2
    assert core.round.number == 2 and core.round.participants == {"site-b", "site-c"}
    assert core.round_info("site-c")["participant"] and core.round_info("site-c")["version"] == 2
    push(core, "site-b", tokens["site-b"], 2, delta_like(core, 1.0))
    push(core, "site-c", tokens["site-c"], 2, delta_like(core, 5.0))
    heartbeat_all(core, clock, tokens, 2.0)
    expect([1.0, 5.0])  # momentum from rounds 0 and 1 still applies


def _received_upload(tmp_path):
    """A core in round 0 of two sites, holding site-a's whole upload, not yet finished:
    ``(core, tokens, header, upload)``."""
    clock = Clock()
    core = new_core(tmp_path, clock, rounds={"min_sites": 2})
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    manifest, payload = pack(delta_like(core, 1.0))
    header = PushHeader("site-a", tokens["site-a"], 0, "u1", manifest.to_proto(), 1.0, 0)
    upload = core.begin_upload(header)
    core.upload_chunk(upload, 0, bytes(payload))
    core.release_upload(upload)
    return core, tokens, header, upload


def test_an_upload_is_verified_and_counted_by_one_request_at_a_time(tmp_path):
    """A second finish of an upload being finished (a retried reservation, another host's
    reservation next to the end of a stream) waits its turn: it never verifies the same file
    again, nor discards it, and the upload counts once."""
    core, tokens, header, upload = _received_upload(tmp_path)
    with core.uploads.finishing(upload):  # the first request, verifying
        with pytest.raises(Refused) as err:
            core.finish_upload(upload, tokens["site-a"])
        assert err.value.code == "busy"
    assert core.snapshot().updates_received == 0
    assert core.finish_upload(upload, tokens["site-a"])  # its turn: counted once
    assert core.snapshot().updates_received == 1


def test_an_upload_refused_while_another_copy_is_counted_is_kept_for_its_retry(
    tmp_path, monkeypatch
):
    """ "Busy" (another copy of the same update or data unit is being committed: a backup
    copy's race) is for a retry: the site's upload stays whole, so the retry is one header,
    not every byte again."""
    core, tokens, header, upload = _received_upload(tmp_path)
    monkeypatch.setattr(core.counter, "_colliding", lambda admission: True)
    with pytest.raises(Refused) as err:
        core.finish_upload(upload, tokens["site-a"])
    assert err.value.code == "busy"
    monkeypatch.undo()  # the other copy's commit failed: this one may count
    retry = core.begin_upload(header)
    assert retry.complete  # nothing to send again
    assert core.finish_upload(retry, tokens["site-a"])
    core.release_upload(retry)
    assert core.snapshot().updates_received == 1


def test_a_reservation_retried_between_commit_and_count_finds_the_upload_not_a_fresh_one(
    tmp_path, monkeypatch
):
    """The window after the spool's fsync and before the count: a retried reservation must
    meet the upload being finished (busy), never a new empty one to send every byte into."""
    core, tokens, header, upload = _received_upload(tmp_path)
    commit, seen = core.intake.commit, []

    def commit_then_retry(u, weight):
        spooled = commit(u, weight)
        again = core.begin_upload(header)  # the retry, in the window
        seen.append((again is u, again.complete))
        with pytest.raises(Refused) as err:
            core.finish_upload(again, tokens["site-a"])
        seen.append(err.value.code)
        core.release_upload(again)
        return spooled

    monkeypatch.setattr(core.intake, "commit", commit_then_retry)
    assert core.finish_upload(upload, tokens["site-a"])
    assert seen == [(True, True), "busy"]
    assert core.snapshot().updates_received == 1
    with pytest.raises(Refused):  # counted: a later retry is told so, nothing is opened
        core.begin_upload(header)


def test_nothing_counts_once_the_job_finished_not_even_a_late_update(tmp_path):
    """The last round's late update would fold into a round that never closes: refused, so
    its site is not told that it counted."""
    clock = Clock()
    core = new_core(
        tmp_path,
        clock,
        strategy={"name": "fedavg", "late_discount": 0.5},
        rounds={"min_sites": 1, "deadline_s": 30.0, "total": 1},
    )
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    heartbeat_all(core, clock, tokens, 31.0)  # the deadline closes the last round
    assert core.finished
    with pytest.raises(Refused) as err:
        push(core, "site-b", tokens["site-b"], 0, delta_like(core, 8.0), base=0)
    assert err.value.code == "late" and "the job finished" in str(err.value)
    events = read_events(core.events.path)
    assert not [e for e in events if e["kind"] == "update" and e["site"] == "site-b"]


def test_an_update_still_arriving_when_its_round_closes_is_refused_as_late_not_lost(tmp_path):
    """A round closed by its deadline (or a grace) while a site's update was still arriving:
    the round's spool folder is dropped once its checkpoint is written, but not the file of an
    upload being received, so its end is an orderly "late", not an error of the server."""
    clock = Clock()
    core = new_core(tmp_path, clock, rounds={"min_sites": 1, "deadline_s": 30.0})
    tokens = _open_round(core, clock, ("site-a", "site-b"))
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    manifest, payload = pack(delta_like(core, 2.0))
    header = PushHeader("site-b", tokens["site-b"], 0, "slow", manifest.to_proto(), 1.0, 0)
    upload = core.begin_upload(header)  # its stream stays open: the upload is busy
    core.upload_chunk(upload, 0, bytes(payload))
    heartbeat_all(core, clock, tokens, 31.0)  # the deadline closes round 0 without it
    core.writer.wait()  # round 0's checkpoint is written: its spool folder is dropped
    assert core.round.number == 1 and upload.path.exists()
    with pytest.raises(Refused) as err:
        core.finish_upload(upload, tokens["site-b"])
    assert err.value.code == "late"
    core.release_upload(upload)
    assert not upload.path.exists()  # refused for good: its bytes are gone
    heartbeat_all(core, clock, tokens, 2.0)
    push(core, "site-a", tokens["site-a"], 1, delta_like(core, 1.0))
    heartbeat_all(core, clock, tokens, 31.0)
    core.writer.wait()
    assert not (core.spool.round_dir(0)).exists()  # the next drop takes the folder
