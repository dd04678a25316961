"""Calls held open without a request: the resource-exhaustion attack on a coordinator.

A certificate holder (revoked or not) opens calls and never sends their request message, or
opens push streams and never sends a chunk, each one trying to park a worker thread of the
coordinator for as long as it likes. ``HeldCalls`` opens them; ``probe_latencies`` is the
honest side, timing calls that must keep being answered meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc


class HeldCalls:
    """``n`` calls of ``method`` on ``channel`` whose request stream sends nothing until
    ``release``; each call's outcome (a status code name) is kept as it ends."""

    def __init__(self, channel: grpc.Channel, method: str, n: int, timeout_s: float = 120.0):
        self._release = threading.Event()
        call = channel.stream_unary(method, request_serializer=None, response_deserializer=None)
        self._lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.futures = [call.future(self._nothing(), timeout=timeout_s) for _ in range(n)]
        for f in self.futures:
            f.add_done_callback(self._done)

    def _nothing(self):
        self._release.wait()
        return
        yield  # a generator that yields nothing, ever, until released

    def _done(self, future) -> None:
        code = future.code()
        with self._lock:
            self.outcomes[code.name if code else "?"] += 1

    def ended(self) -> Counter:
        with self._lock:
            return Counter(self.outcomes)

    def open(self) -> int:
        return sum(not f.done() for f in self.futures)

    def release(self) -> None:
        self._release.set()
        for f in self.futures:
            f.cancel()


def probe_latencies(
    call: Callable[[], object],
    seconds: float,
    every_s: float = 0.1,
    until: Callable[[], bool] = lambda: False,
):
    """Call ``call`` every ``every_s`` for ``seconds`` or until ``until()``; returns
    (latencies in s, failures)."""
    latencies, failures = [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        t0 = time.monotonic()
        try:
            call()
            latencies.append(time.monotonic() - t0)
        except grpc.RpcError as exc:
            failures.append(f"{exc.code().name}: {exc.details()}")
        time.sleep(every_s)
    return latencies, failures


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]
