"""Send slots: how many Fetch streams the coordinator sends theta on at once.

Each fetch stream holds a chunk or two on its way out (read from theta's file, framed, queued in
gRPC's transport), a few MiB per stream: with every site of a round fetching at once that is
memory that grows with the number of sites. ``server.concurrent_fetches`` streams are sent at
once; a fetch beyond them waits its turn, first come first served, before its header is sent,
and is answered UNAVAILABLE ("every send slot is busy") if none frees within ``FETCH_WAIT_S``
(sites retry with backoff). Waiting holds a server thread, which the server has for every
site's share of calls (``coordinator.server``). The coordinator's egress is shared by every
stream anyway, so a queue costs little time once the slots fill its link.

The decision is the pure ``may_send``; ``SendSlots`` keeps the queue under its own condition
variable (never the core's lock: a fetch waits here).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

FETCH_WAIT_S = 30.0


def may_send(capacity: int, sending: int, queue: Sequence[int], ticket: int) -> bool:
    """Whether the fetch holding ``ticket`` may start: a slot is free for it, counting the
    fetches queued before it. ``capacity`` 0: no limit."""
    if capacity <= 0:
        return True
    ahead = queue.index(ticket) if ticket in queue else 0
    return sending + ahead < capacity


class SlotsBusy(Exception):
    """No send slot freed within the wait."""


class SendSlots:
    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.clock = capacity, clock
        self.cond = threading.Condition()
        self.sending = 0
        self.queue: list[int] = []  # tickets of waiting fetches, in arrival order
        self.peak = 0  # the most streams sent at once
        self._tickets = itertools.count()

    @contextmanager
    def slot(self, wait_s: float = FETCH_WAIT_S) -> Iterator[None]:
        """Hold a slot for the body (a fetch's whole stream); ``SlotsBusy`` after ``wait_s``."""
        self.acquire(wait_s)
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        with self.cond:
            self.sending -= 1
            self.cond.notify_all()

    def acquire(self, wait_s: float = FETCH_WAIT_S) -> None:
        """Wait (up to ``wait_s``) for a slot, in arrival order; ``SlotsBusy`` if none frees."""
        deadline = self.clock() + wait_s
        with self.cond:
            ticket = next(self._tickets)
            self.queue.append(ticket)
            try:
                while not may_send(self.capacity, self.sending, self.queue, ticket):
                    left = deadline - self.clock()
                    if left <= 0:
                        raise SlotsBusy(f"every send slot ({self.capacity}) is busy")
                    self.cond.wait(min(left, 1.0))
            finally:
                self.queue.remove(ticket)
                self.cond.notify_all()  # the next in line may now be first
            self.sending += 1
            self.peak = max(self.peak, self.sending)

    def counts(self) -> tuple[int, int]:
        """(streams being sent, fetches waiting for a slot), for metrics."""
        with self.cond:
            return self.sending, len(self.queue)
