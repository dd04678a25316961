"""How busy the whole machine was over given windows of wall time, from ``/proc/stat``.

``bench.sync`` runs a coordinator and two sites (trainers, agents, checkpoint writers) on
one machine; on a machine of few cores a sync can be bound by the CPU all of them need at
once rather than by any one party's work per byte. The share of the machine's CPU time busy
during each sync says which: near 1, the sync waits for cores (the parties' work, not the
transport, sets its length); well below 1, it waits on something else.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence

INTERVAL_S = 0.05


def _jiffies() -> tuple[int, int]:
    """The machine's busy and total CPU time so far (``/proc/stat``'s first line)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is counted in user already
    return total - idle, total


class MachineBusy:
    """Samples of (wall time, busy, total) every ``INTERVAL_S`` until ``stop``."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-busy", daemon=True)

    def start(self) -> MachineBusy:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), *_jiffies()))
            self._stop.wait(INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def busy(self, start: float, end: float) -> float | None:
        """The machine's busy share of CPU time between wall times ``start`` and ``end``
        (None: too few samples inside)."""
        return busy_between(self.samples, start, end)


def busy_between(samples: Sequence[tuple[float, int, int]], start: float, end: float):
    """Busy share of CPU time from the first sample at or after ``start`` to the last at or
    before ``end`` (None when they are the same sample or absent)."""
    walls = [s[0] for s in samples]
    i, j = bisect.bisect_left(walls, start), bisect.bisect_right(walls, end) - 1
    if i >= j:
        return None
    busy, total = samples[j][1] - samples[i][1], samples[j][2] - samples[i][2]
    return busy / total if total > 0 else None
