"""Round changes are pushed: ``WaitRound`` answers the moment a site's task changes
(coordinator core, fake clock, real threads)."""

from __future__ import annotations

import threading
import time

import pytest
from core_helpers import Clock, delta_like, new_core, push

from coordinator.records import Refused

FIELDS = ("round", "version", "finished", "participant", "data_unit")


def known(info: dict) -> dict:
    return {k: info.get(k, "") for k in FIELDS}


def in_thread(fn):
    out: dict = {}

    def run():
        started = time.monotonic()
        out["reply"] = fn()
        out["seconds"] = time.monotonic() - started

    t = threading.Thread(target=run)
    t.start()
    return t, out


def open_round(core, clock):
    tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
    clock.now += 1.0
    core.tick()
    assert core.round.opened_at is not None
    return tokens


def test_no_known_state_answers_at_once(tmp_path):
    core = new_core(tmp_path, Clock())
    lease, _ = core.join("site-a")
    info, cancels = core.wait_round("site-a", lease.token, None, 30.0)
    assert info["round"] == 0 and cancels == []


def test_a_closed_round_wakes_the_waiting_sites_at_once(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = open_round(core, clock)
    now = known(core.round_info("site-a"))
    t, out = in_thread(lambda: core.wait_round("site-a", tokens["site-a"], now, 30.0))
    time.sleep(0.2)
    assert t.is_alive(), "answered although nothing changed"
    for site, token in tokens.items():
        push(core, site, token, 0, delta_like(core, 1.0))
    assert core.tick()  # round 0 closes; round 1 opens on the next tick
    t.join(10)
    info, _ = out["reply"]
    assert info["round"] == 1 and info["version"] == 1 and out["seconds"] < 5


def test_a_newer_call_of_the_same_site_ends_the_older_one(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = open_round(core, clock)
    now = known(core.round_info("site-a"))
    t, out = in_thread(lambda: core.wait_round("site-a", tokens["site-a"], now, 30.0))
    time.sleep(0.2)
    t2, out2 = in_thread(lambda: core.wait_round("site-a", tokens["site-a"], now, 0.3))
    t.join(10)
    t2.join(10)
    assert out["seconds"] < 5 and out["reply"][0]["round"] == 0  # superseded, not timed out


def test_it_times_out_with_the_current_state(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = open_round(core, clock)
    now = known(core.round_info("site-a"))
    started = time.monotonic()
    info, _ = core.wait_round("site-a", tokens["site-a"], now, 0.3)
    assert 0.25 <= time.monotonic() - started < 5 and known(info) == now


def test_a_stale_token_is_refused(tmp_path):
    core = new_core(tmp_path, Clock())
    lease, _ = core.join("site-a")
    core.join("site-a")  # a newer lease fences the first out
    with pytest.raises(Refused) as err:
        core.wait_round("site-a", lease.token, None, 1.0)
    assert err.value.code == "lease"
