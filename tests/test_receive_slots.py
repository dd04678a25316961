"""Receive slots: at most ``server.concurrent_uploads`` uploads are received at once, the
waiting ones granted in fold order, unused grants lapsing; and a real coordinator with one
slot takes three concurrent pushes one at a time, counting all three."""

from __future__ import annotations

import threading
import time

import pytest
from coord_harness import FAST_BACKOFF, job_config, scrape_metrics, start_with_metrics

from coordinator.intake.receive_slots import (
    AUTO_MIN,
    GRANT_TTL_S,
    ReceiveSlots,
    slots_to_grant,
    upload_slots,
)
from site_client.transfer.client import CoordinatorClient


def test_slots_go_to_the_first_in_fold_order_as_far_as_they_go():
    waiting = {"c": (2, 0.0), "a": (0, 5.0), "b": (1, 1.0), "late": (9, 0.0)}
    assert slots_to_grant(2, 0, {}, waiting, now=10.0) == ["a", "b"]
    assert slots_to_grant(2, 1, {}, waiting, now=10.0) == ["a"]
    # A live grant holds its slot; a lapsed one does not.
    assert slots_to_grant(2, 0, {"x": 11.0}, waiting, now=10.0) == ["a"]
    assert slots_to_grant(2, 0, {"x": 9.0}, waiting, now=10.0) == ["a", "b"]
    assert slots_to_grant(2, 3, {}, waiting, now=10.0) == []
    assert slots_to_grant(0, 50, {}, waiting, now=10.0) == ["a", "b", "c", "late"]  # no limit


def test_unset_slots_are_sized_from_the_model():
    mib = 1 << 20
    assert upload_slots(None, 64 * mib, 8 * mib) == 2  # a quarter of it holds two windows
    assert upload_slots(None, 160 * mib, 8 * mib) == 5
    assert upload_slots(None, 256 * mib, 8 * mib) == 8
    assert upload_slots(None, 50 << 30, 8 * mib) == 8  # never more than eight
    assert upload_slots(None, 1 * mib, 8 * mib) == 2  # never fewer than two
    assert upload_slots(None, 64 * mib, 2 * mib) == 8  # smaller windows: more of them
    assert upload_slots(None, 64 * mib, 0) == 2  # a gRPC-sized window is taken as 8 MiB
    assert upload_slots(3, 50 << 30, 8 * mib) == 3  # a setting wins
    assert upload_slots(0, 1 * mib, 8 * mib) == 0  # 0 stays "no limit"
    # An upload over K streams holds K windows: fewer of them fit.
    assert upload_slots(None, 256 * mib, 8 * mib, streams=4) == 2
    assert upload_slots(None, 1024 * mib, 8 * mib, streams=4) == 8


def test_a_waiting_upload_is_granted_when_a_stream_ends():
    slots = ReceiveSlots(1)
    assert slots.reserve("first", 0, wait_s=0.1)
    slots.enter("first")
    assert not slots.reserve("second", 1, wait_s=0.1), "the one slot is in use"
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.reserve("second", 1, wait_s=10)))
    waiter.start()
    time.sleep(0.2)
    assert got == [] and slots.counts() == (1, 1)
    slots.leave("first")
    waiter.join(5)
    assert got == [True] and slots.peak == 1
    # A stream that starts without a grant (a client that does not ask) is let in.
    slots.enter("unasked")
    slots.enter("second")
    assert slots.counts() == (2, 0) and slots.peak == 2


def test_fold_order_wins_and_an_unused_grant_lapses():
    now = [0.0]
    slots = ReceiveSlots(1, clock=lambda: now[0])
    slots.enter("busy")
    order = []

    def ask(key, position):
        if slots.reserve(key, position, wait_s=30.0):
            order.append(key)

    late = threading.Thread(target=ask, args=("site-c", 2))
    late.start()
    time.sleep(0.1)
    early = threading.Thread(target=ask, args=("site-a", 0))
    early.start()
    time.sleep(0.1)
    slots.leave("busy")
    early.join(5)
    assert order == ["site-a"], "the earlier fold position goes first, though it asked later"
    # site-a never opens its stream: past the grant's lifetime site-c gets the slot.
    now[0] += GRANT_TTL_S + 1
    late.join(5)
    assert order == ["site-a", "site-c"]


@pytest.mark.e2e
# 3.5 s each: one setting stays fast.
@pytest.mark.parametrize(
    "slots",
    [1, pytest.param(0, marks=pytest.mark.slow), pytest.param(None, marks=pytest.mark.slow)],
)
def test_one_slot_takes_concurrent_pushes_one_at_a_time(tmp_path, slots):
    server = {"listen": "127.0.0.1:0", "workers": 16}
    if slots is not None:
        server["concurrent_uploads"] = slots
    cfg = job_config(
        name="slots",
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 256, "d_out": 2048}},
        rounds={"total": 1, "min_sites": 3, "max_sites": 3, "join_window_s": 5.0},
        server=server,
    )
    coord, address = start_with_metrics(tmp_path, cfg)
    pushed, errors = threading.Barrier(4), []

    def site(name: str) -> None:
        client = CoordinatorClient(coord.address, name, backoff=FAST_BACKOFF, chunk_bytes=1 << 18)
        try:
            client.join()
            held = client.fetch()
            client.wait_for_round(-1)
            delta = {
                n: t.float().mul(0).add(1e-3)
                for n, t in held.theta.items()
                if t.is_floating_point()
            }
            # Each stream stays open half a second before its last chunk: without slots the
            # three would be received at once.
            hold = threading.Event()
            threading.Timer(0.5, hold.set).start()
            assert client.push(0, delta, hold=hold).complete
        except Exception as exc:
            errors.append(f"{name}: {exc}")
        finally:
            pushed.wait(60)
            client.wait_for_round(0)
            client.leave("done")
            client.close()

    threads = [threading.Thread(target=site, args=(f"site-{i}",)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        pushed.wait(120)
        m = scrape_metrics(address)
        for t in threads:
            t.join(60)
        assert errors == []
        peak = m[("isthmus_uploads_receiving_peak", ())]
        if slots is None:  # unset: a 2 MiB model gets the fewest slots, two
            assert m[("isthmus_receive_slots", ())] == AUTO_MIN == 2
            assert peak == 2
        else:
            assert m[("isthmus_receive_slots", ())] == slots
            # The control (no limit): the held streams overlap, so the limit kept it at 1.
            assert peak == 1 if slots == 1 else peak >= 2
        assert sum(v for (n, _), v in m.items() if n == "isthmus_updates_counted_total") == 3
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.stop()
