"""Send slots: how many Fetch streams the coordinator sends theta on at once.

Each fetch stream holds a chunk or two on its way out (read from theta's file, framed, queued in
gRPC's transport), a few MiB per stream: with every site of a round fetching at once that is
memory that grows with the number of sites. ``server.concurrent_fetches`` streams are sent at
once; a fetch beyond them waits its turn, first come first served, before its header is sent,
and is answered UNAVAILABLE ("every send slot is busy") if none frees within ``FETCH_WAIT_S``
(sites retry with backoff). Waiting holds a server thread, which the server has for every
site's share of calls (``coordinator.service.server``). The coordinator's egress is shared by every
stream anyway, so a queue costs little time once the slots fill its link.

One site may hold at most its share of the slots (``share_of``: its ``[transfer] streams``,
and never more than half of them): a certificate holder reading one chunk every few minutes
on many streams must not keep every other site waiting. A stream beyond the share is refused at
once (sites retry with backoff).

The decisions are the pure ``may_send`` and ``share_of``; ``SendSlots`` keeps the queue under
its own condition variable (never the core's lock: a fetch waits here).
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


def share_of(capacity: int, streams: int) -> int:
    """The most slots one site may hold at once: its streams, at most half the slots (at
    least one). ``capacity`` 0: no limit, and a share of its streams."""
    if capacity <= 0:
        return streams
    return max(1, min(streams, capacity // 2))


class SlotsBusy(Exception):
    """No send slot freed within the wait."""


class SendSlots:
    def __init__(
        self, capacity: int, clock: Callable[[], float] = time.monotonic, streams: int = 1
    ) -> None:
        self.capacity, self.clock = capacity, clock
        self.share = share_of(capacity, streams)
        self.cond = threading.Condition()
        self.sending = 0
        self.by_site: dict[str, int] = {}  # streams being sent or waiting, per site
        self.queue: list[int] = []  # tickets of waiting fetches, in arrival order
        self.peak = 0  # the most streams sent at once
        self._tickets = itertools.count()

    @contextmanager
    def slot(self, site: str = "", wait_s: float = FETCH_WAIT_S) -> Iterator[None]:
        """Hold a slot for the body (a fetch's whole stream); ``SlotsBusy`` after ``wait_s``."""
        self.acquire(site, wait_s)
        try:
            yield
        finally:
            self.release(site)

    def release(self, site: str = "") -> None:
        with self.cond:
            self.sending -= 1
            self._leave(site)
            self.cond.notify_all()

    def _leave(self, site: str) -> None:
        left = self.by_site.get(site, 0) - 1
        if left > 0:
            self.by_site[site] = left
        else:
            self.by_site.pop(site, None)

    def acquire(self, site: str = "", wait_s: float = FETCH_WAIT_S) -> None:
        """Wait (up to ``wait_s``) for a slot, in arrival order; ``SlotsBusy`` if none frees,
        or at once if ``site`` holds its share already."""
        deadline = self.clock() + wait_s
        with self.cond:
            if self.by_site.get(site, 0) >= self.share:
                raise SlotsBusy(
                    f"{site} already has {self.share} fetch stream(s) being sent, its share of "
                    f"the {self.capacity or 'unlimited'} send slots"
                )
            ticket = next(self._tickets)
            self.queue.append(ticket)
            self.by_site[site] = self.by_site.get(site, 0) + 1
            try:
                while not may_send(self.capacity, self.sending, self.queue, ticket):
                    left = deadline - self.clock()
                    if left <= 0:
                        raise SlotsBusy(f"every send slot ({self.capacity}) is busy")
                    self.cond.wait(min(left, 1.0))
            except BaseException:
                self._leave(site)
                raise
            finally:
                self.queue.remove(ticket)
                self.cond.notify_all()  # the next in line may now be first
            self.sending += 1
            self.peak = max(self.peak, self.sending)

    def counts(self) -> tuple[int, int]:
        """(streams being sent, fetches waiting for a slot), for metrics."""
        with self.cond:
            return self.sending, len(self.queue)
