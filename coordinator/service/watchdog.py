"""Cancels calls that wait past their bound: one thread for every armed call.

A gRPC worker blocked on a request message cannot time itself out (grpc's sync server offers
no deadline for what the client sends), but another thread may cancel the call, which wakes the
blocked worker with an error and frees it. Arming and disarming cost a lock and a heap push,
cheap enough to do for every message of a stream.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("isthmus.coordinator")


class CallWatchdog:
    """Cancels each armed call whose deadline passes before it is disarmed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, tuple[object, str]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.cancelled = 0  # calls cancelled so far (shown in tests and benchmarks)
        self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
        self._thread.start()

    def arm(self, timeout_s: float, context, what: str) -> int:
        """Cancel ``context`` unless ``disarm`` is called within ``timeout_s``."""
        ticket = next(self._ids)
        with self._cond:
            self._armed[ticket] = (context, what)
            heapq.heappush(self._heap, (self.clock() + timeout_s, ticket))
            if self._heap[0][1] == ticket:
                self._cond.notify()
        return ticket

    def disarm(self, ticket: int) -> None:
        with self._cond:
            self._armed.pop(ticket, None)
            if len(self._heap) > 2 * len(self._armed) + 64:
                # A busy stream arms and disarms once per chunk: drop the spent entries
                # now rather than when their deadlines come round.
                self._heap = [e for e in self._heap if e[1] in self._armed]
                heapq.heapify(self._heap)

    def armed(self) -> int:
        with self._cond:
            return len(self._armed)

    def _due(self) -> list[tuple[object, str, float]]:
        """Pop what has expired; waits (under the condition) until something might have."""
        while not self._stopped:
            now = self.clock()
            due = []
            while self._heap and self._heap[0][0] <= now:
                deadline, ticket = heapq.heappop(self._heap)
                entry = self._armed.pop(ticket, None)
                if entry is not None:
                    due.append((*entry, deadline))
            if due:
                return due
            while self._heap and self._heap[0][1] not in self._armed:
                heapq.heappop(self._heap)  # disarmed long ago: drop without waiting for it
            self._cond.wait(timeout=(self._heap[0][0] - now) if self._heap else None)
        return []

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._due()
                if self._stopped:
                    return
            for context, what, _ in due:
                log.warning("%s: nothing arrived in time; call cancelled", what)
                self.cancelled += 1
                try:
                    context.cancel()
                except Exception:  # noqa: BLE001 - a call that already ended
                    log.debug("cancelling %s failed", what, exc_info=True)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=2.0)
