"""Send slots: at most ``server.concurrent_fetches`` fetch streams sent at once."""

from __future__ import annotations

import threading
import time

import pytest
from coord_harness import FAST_BACKOFF, job_config, scrape_metrics, start_with_metrics, wait_until

from coordinator.service.send_slots import SendSlots, SlotsBusy, may_send, share_of
from site_client.transfer.client import CoordinatorClient
from wire.proto import isthmus_pb2 as pb


def test_a_fetch_may_start_when_a_slot_is_free_for_it_counting_those_ahead():
    assert may_send(2, 0, [7, 8], 7) and may_send(2, 0, [7, 8], 8)
    assert not may_send(2, 1, [7, 8], 8)  # one sending, one ahead of it
    assert may_send(2, 1, [7, 8], 7)
    assert not may_send(1, 1, [9], 9)
    assert may_send(0, 100, [1, 2, 3], 3)  # no limit


def test_waiting_fetches_go_first_come_first_served_and_give_up_in_time():
    slots, started = SendSlots(1), []

    def fetch(name: str, hold: threading.Event) -> None:
        with slots.slot(name, wait_s=10):
            started.append(name)
            hold.wait(10)

    holds = {n: threading.Event() for n in "abc"}
    threads = {n: threading.Thread(target=fetch, args=(n, holds[n])) for n in "abc"}
    for n in "abc":
        threads[n].start()
        time.sleep(0.05)  # arrival order a, b, c
    assert started == ["a"] and slots.counts() == (1, 2)
    with pytest.raises(SlotsBusy, match="every send slot"), slots.slot("d", wait_s=0.1):
        pass
    holds["a"].set()
    threads["a"].join(5)
    time.sleep(0.1)
    assert started == ["a", "b"]
    holds["b"].set()
    holds["c"].set()
    for t in threads.values():
        t.join(5)
    assert started == ["a", "b", "c"] and slots.counts() == (0, 0) and slots.peak == 1


@pytest.mark.e2e
@pytest.mark.parametrize("slots", [1, 0])
def test_a_fetch_waits_while_another_holds_the_only_slot(tmp_path, slots):
    cfg = job_config(
        name="send-slots",
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 1024, "d_out": 2048}},
        rounds={"total": 1, "min_sites": 2, "max_sites": 2, "join_window_s": 5.0},
        server={"listen": "127.0.0.1:0", "workers": 16, "concurrent_fetches": slots},
    )
    coord, address = start_with_metrics(tmp_path, cfg)
    slow = CoordinatorClient(coord.address, "site-a", backoff=FAST_BACKOFF)
    fast = CoordinatorClient(coord.address, "site-b", backoff=FAST_BACKOFF)
    try:
        slow.join()
        fast.join()
        # site-a opens a fetch of theta (8 MiB) and reads only its first message: the server
        # is held by flow control with the stream, and its slot, open.
        stuck = slow.bulk.Fetch(pb.FetchRequest(lease=slow.lease, offset=0), timeout=60)
        next(stuck)
        done = threading.Event()
        threading.Thread(target=lambda: (fast.fetch(), done.set()), daemon=True).start()
        time.sleep(1.5)
        m = scrape_metrics(address)
        assert m[("isthmus_send_slots", ())] == slots
        if slots == 1:
            assert not done.is_set(), "the second fetch was sent while the only slot was held"
            assert m[("isthmus_fetches_waiting", ())] == 1
        else:  # the control: without a limit it goes through at once
            assert done.is_set()
        stuck.cancel()
        assert done.wait(30), "the waiting fetch never got the slot back"
        assert scrape_metrics(address)[("isthmus_fetches_sending_peak", ())] == (
            1 if slots == 1 else 2
        )
    finally:
        slow.close()
        fast.close()
        coord.stop()


def test_one_site_holds_at_most_its_share_of_the_slots():
    assert share_of(8, 1) == 1 and share_of(8, 4) == 4
    assert share_of(8, 8) == 4  # never more than half
    assert share_of(1, 4) == 1  # at least one
    assert share_of(0, 4) == 4  # no limit: its streams
    slots = SendSlots(8, streams=8)
    for _ in range(4):
        slots.acquire("a", wait_s=0.1)
    with pytest.raises(SlotsBusy, match="a already has 4 fetch stream"):
        slots.acquire("a", wait_s=5.0)  # at once, not after the wait
    slots.acquire("b", wait_s=0.1)  # another site is not kept out
    assert slots.counts() == (5, 0)
    slots.release("a")
    slots.acquire("a", wait_s=0.1)
    # A stream still waiting for a slot counts towards its site's share.
    full = SendSlots(1, streams=2)
    full.acquire("c", wait_s=0.1)
    waiting = threading.Thread(target=lambda: full.acquire("d", wait_s=2.0))
    waiting.start()
    wait_until(lambda: full.counts() == (1, 1), what="d waiting")
    with pytest.raises(SlotsBusy, match="its share"):
        full.acquire("d", wait_s=0.1)
    full.release("c")
    waiting.join(5)
    assert full.counts() == (1, 0) and full.by_site == {"d": 1}
