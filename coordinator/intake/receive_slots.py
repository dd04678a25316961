"""Receive slots: how many uploads the coordinator takes bytes from at once.

Each push stream may have a whole HTTP/2 window (``server.receive_window_bytes``) of bytes in
flight towards the coordinator, held in its memory whether or not it reads them: with every
site of a round pushing at once that is a window per site, memory that grows with the number of
sites. So a site first asks for a slot (a header-only push with ``reserve``), and opens its data
stream once granted; ``server.concurrent_uploads`` slots are handed out, to the waiting uploads
in the round's fold order (``coordinator.round.accumulate``), so the running sum can fold each
update as it arrives instead of holding it back for an earlier one. A grant not used within
``GRANT_TTL_S`` lapses (a site that died after asking). A stream that starts without a grant (a
resumed probe, a client that does not ask) is let in all the same: slots bound memory, they
never refuse bytes. The streams of one upload sent in pieces (``[transfer] streams``) share its
slot.

The decision is the pure ``slots_to_grant``; ``ReceiveSlots`` keeps the state under its own
condition variable (never the core's lock: a reservation waits).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping

from wire.bulk import RESERVE_WAIT_S

GRANT_TTL_S = 10.0
# Sized from the model (``server.concurrent_uploads`` unset): the uploads received at once
# hold about this fraction of one update's float32 bytes in windows, between these bounds.
AUTO_SHARE, AUTO_MIN, AUTO_MAX = 0.25, 2, 8
ASSUMED_WINDOW_BYTES = 8 << 20  # for a window gRPC sizes itself (``receive_window_bytes`` 0)


def upload_slots(
    configured: int | None, update_bytes: int, window_bytes: int, streams: int = 1
) -> int:
    """How many uploads to receive at once (pure): ``configured`` if set (0: no limit), else
    as many uploads as fit in ``AUTO_SHARE`` of an update, from ``AUTO_MIN`` to ``AUTO_MAX``,
    each holding a window on each of its ``streams`` (``[transfer] streams``).

    Memory is what a slot costs (a window of bytes in flight, and a chunk or two); ingress
    bandwidth is what it buys (a window per round trip). A small model gets few slots, so
    that its sites' windows do not outweigh it (two slots of 8 MiB still take 1.6 Gbit/s at
    an 80 ms RTT); from a 256 MiB model on, the full eight."""
    if configured is not None:
        return configured
    window = (window_bytes or ASSUMED_WINDOW_BYTES) * streams
    return max(AUTO_MIN, min(AUTO_MAX, int(update_bytes * AUTO_SHARE) // window))


def slots_to_grant(
    capacity: int,
    active: int,
    granted: Mapping[Hashable, float],
    waiting: Mapping[Hashable, tuple],
    now: float,
) -> list[Hashable]:
    """The waiting uploads to grant now: as many as the free slots, first in ``waiting``'s
    order (fold position, then time of asking). ``capacity`` 0: no limit."""
    ordered = sorted(waiting, key=lambda k: waiting[k])
    if capacity <= 0:
        return ordered
    live = sum(1 for expires in granted.values() if expires > now)
    return ordered[: max(capacity - active - live, 0)]


class ReceiveSlots:
    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.clock = capacity, clock
        self.cond = threading.Condition()
        self.active: dict[Hashable, int] = {}  # upload -> its data streams being received
        self.granted: dict[Hashable, float] = {}  # upload -> when its grant lapses
        self.waiting: dict[Hashable, tuple] = {}  # upload -> (fold position, asked at)
        self.peak = 0  # the most uploads received at once

    def reserve(self, key: Hashable, order: int, wait_s: float = RESERVE_WAIT_S) -> bool:
        """Wait (up to ``wait_s``) for a slot for ``key``; True once granted."""
        deadline = self.clock() + wait_s
        with self.cond:
            if key in self.active or self.granted.get(key, 0.0) > self.clock():
                return True
            self.waiting[key] = (order, self.clock())
            try:
                while True:
                    now = self.clock()
                    self._grant(now)
                    if key in self.granted:
                        return True
                    if now >= deadline:
                        return False
                    self.cond.wait(min(deadline - now, 1.0))  # grants also lapse
            finally:
                self.waiting.pop(key, None)

    def _grant(self, now: float) -> None:
        for k in [k for k, expires in self.granted.items() if expires <= now]:
            del self.granted[k]
        for k in slots_to_grant(self.capacity, self.in_use(), self.granted, self.waiting, now):
            self.granted[k] = now + GRANT_TTL_S
            self.waiting.pop(k, None)
        self.cond.notify_all()

    def in_use(self) -> int:
        """Slots in use: uploads being received now, on one stream or several (under
        ``cond``)."""
        return len(self.active)

    def enter(self, key: Hashable) -> None:
        """A data stream of ``key`` starts: its grant (if any) becomes a slot in use."""
        with self.cond:
            self.granted.pop(key, None)
            self.active[key] = self.active.get(key, 0) + 1
            self.peak = max(self.peak, self.in_use())

    def leave(self, key: Hashable) -> None:
        with self.cond:
            left = self.active.get(key, 0) - 1
            if left > 0:
                self.active[key] = left
            else:
                self.active.pop(key, None)
            self._grant(self.clock())

    def counts(self) -> tuple[int, int]:
        """(uploads being received, uploads waiting for a slot), for metrics."""
        with self.cond:
            return self.in_use(), len(self.waiting)
