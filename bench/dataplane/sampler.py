"""CPU seconds of processes' threads, sampled from ``/proc``: what each thread (by its native
name) spent, and when, so a run's CPU can be split by phase afterwards.

The counters are the kernel's own (user + system ticks), so they do not depend on what else
the machine runs; sampling only decides which window a tick is put in.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


PROCESS = (0, "")  # the key of the whole process's CPU: its threads', live or gone


def _stat_cpu(path: str) -> tuple[str, float]:
    stat = Path(path).read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / TICK


def thread_times(pid: int) -> dict[tuple[int, str], float]:
    """``(tid, name) -> CPU seconds`` of each live thread of ``pid``, and under ``PROCESS``
    the whole process's (which keeps the CPU of threads that have exited: gRPC's own pools
    start and retire threads); empty once it is gone."""
    try:
        out = {PROCESS: _stat_cpu(f"/proc/{pid}/stat")[1]}
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            name, seconds = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        out[(int(tid), name)] = seconds
    return out


def group_of(name: str) -> str:
    """The part of the process a thread name belongs to (``fold_0`` -> ``fold``); a thread
    of no known part by its own name."""
    for prefix, group in GROUPS:
        if name.startswith(prefix):
            return group
    if "(_serv" in name:  # grpc's server thread, "Thread-N (_serve)": it polls and reads
        return "grpc poller"
    return {"python": "main thread"}.get(name, name)


GROUPS = (
    ("fold", "fold"),
    ("digest", "digests"),
    ("theta-blocks", "digests"),
    ("checkpoint", "checkpoint"),
    ("ckpt", "checkpoint"),
    ("ThreadPoolExec", "grpc handlers"),
    ("grpc-", "grpc handlers"),
    ("event_engine", "grpc core"),
    ("grpc_", "grpc core"),
    ("default-execut", "grpc core"),
    ("resolver", "grpc core"),
    ("timer_manager", "grpc core"),
    ("wan", "wan worker"),
)


class Sampler:
    """Samples ``pids`` every ``period_s`` on a thread of its own until ``stop``."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.pids: dict[str, int] = {}  # role -> pid
        self.series: dict[str, list[tuple[float, dict]]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def watch(self, role: str, pid: int) -> None:
        self.pids[role] = pid

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def _take(self) -> None:
        now = time.time()
        for role, pid in list(self.pids.items()):
            times = thread_times(pid)
            if times:
                self.series[role].append((now, times))

    def cpu(self, role: str, start: float, end: float, group: str | None = None) -> float:
        """CPU seconds ``role``'s threads (of ``group``, or all) spent in ``[start, end]``,
        from the samples nearest each end."""
        samples = self.series.get(role, [])
        if not samples:
            return 0.0
        walls = [w for w, _ in samples]
        a = samples[max(0, bisect.bisect_right(walls, start) - 1)][1]
        b = samples[min(len(samples) - 1, bisect.bisect_left(walls, end))][1]
        if group is None:
            return b.get(PROCESS, 0.0) - a.get(PROCESS, 0.0)
        total = 0.0
        for key, seconds in b.items():
            if key != PROCESS and group_of(key[1]) == group:
                total += seconds - a.get(key, 0.0)
        return total

    def by_group(self, role: str, start: float, end: float) -> dict[str, float]:
        """CPU seconds per thread group of ``role`` in ``[start, end]``; what threads that
        exited meanwhile spent is ``exited threads``."""
        samples = self.series.get(role, [])
        names = {group_of(k[1]) for _, times in samples for k in times if k != PROCESS}
        out = {g: self.cpu(role, start, end, g) for g in sorted(names)}
        gone = self.cpu(role, start, end) - sum(out.values())
        if gone > 0:
            out["exited threads"] = gone
        return out
