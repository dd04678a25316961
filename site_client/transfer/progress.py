"""Progress of one long transfer (a push or a theta fetch): a bar on a terminal, log lines else.

A transfer reports into a ``TransferProgress``: ``start`` with its size (and the offset it
resumes from), ``advance`` per chunk, ``update`` when a resumed stream starts again at the
offset the other end acked, ``finish`` at the end. Nothing shows for a transfer under
``ProgressPolicy.min_bytes`` or until it has run ``min_s``: a round's small or quick transfers
stay out of the log. Past that, on a terminal (stderr) a rich bar shows the bytes, the rate and
the ETA; elsewhere a line like ``push round 3: 48.0 of 200.0 MB (24%), 12.3 MB/s, ETA 12 s``
goes to the ``isthmus.site`` log at most every ``every_s``. A transfer that was shown ends
with one line: ``push round 3: 200.0 MB in 16.2 s (12.3 MB/s)``.

The decisions (what shows, when, and its words) are pure functions of a ``Snapshot``; the
clock is injected, so they are tested without sleeping. rich is only touched by ``_Bar``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("isthmus.site")

# Held while a live display draws in this process (a transfer's bar, a benchmark's): rich
# allows one per console, and two on one terminal overwrite each other. Whoever cannot take it
# falls back to plain lines.
terminal = threading.Lock()


@dataclass(frozen=True)
class ProgressPolicy:
    every_s: float = 10.0  # plain mode: at most one line this often
    min_bytes: int = 8 << 20  # smaller transfers never show
    min_s: float = 2.0  # nor does any before it has run this long


@dataclass(frozen=True)
class Snapshot:
    """A transfer at one moment. ``moved`` counts every byte sent or received, resent ones
    too (it gives the rate); ``done`` is where the payload stands (it gives the ETA)."""

    label: str
    total: int
    done: int
    moved: int
    elapsed: float

    @property
    def rate(self) -> float:
        return self.moved / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        return (self.total - self.done) / self.rate if self.rate > 0 else None


def visible(s: Snapshot, policy: ProgressPolicy) -> bool:
    return s.total >= policy.min_bytes and s.elapsed >= policy.min_s


def line_due(s: Snapshot, last_line_at: float | None, policy: ProgressPolicy) -> bool:
    """Whether plain mode writes a line now (``last_line_at``: elapsed at the last one)."""
    if not visible(s, policy):
        return False
    return last_line_at is None or s.elapsed - last_line_at >= policy.every_s


def duration(seconds: float, *, precise: bool = False) -> str:
    """``12 s`` (``16.2 s`` if ``precise``), ``3 min 20 s``, ``1 h 05 min``."""
    text = f"{seconds:.1f}" if precise else f"{seconds:.0f}"
    if float(text) < 60:  # 59.7 s reads "1 min 0 s", not "60 s"
        return f"{text} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _amount(n: int, total: int) -> str:
    """``n`` bytes in the unit of ``total`` (MB, or GB from 10 GB), without the unit."""
    return f"{n / 1e9:.2f}" if total >= 10e9 else f"{n / 1e6:.1f}"


def _unit(total: int) -> str:
    return "GB" if total >= 10e9 else "MB"


def progress_line(s: Snapshot) -> str:
    done, total, unit = _amount(s.done, s.total), _amount(s.total, s.total), _unit(s.total)
    percent = 100 * s.done // s.total if s.total else 100
    eta = "unknown" if s.eta_s is None else duration(s.eta_s)
    rate = f"{s.rate / 1e6:.1f} MB/s"
    return f"{s.label}: {done} of {total} {unit} ({percent}%), {rate}, ETA {eta}"


def done_line(s: Snapshot) -> str:
    """The closing line. The rate is the wire's: bytes sent twice (a push resumed behind what
    it had sent) are named rather than hidden in it."""
    total, unit = _amount(s.total, s.total), _unit(s.total)
    rate = f"{s.rate / 1e6:.1f} MB/s"
    if s.moved > s.total:
        rate += f", {_amount(s.moved - s.total, s.total)} {unit} sent again"
    return f"{s.label}: {total} {unit} in {duration(s.elapsed, precise=True)} ({rate})"


class TransferProgress:
    """One transfer's progress; its methods are called from the thread doing the transfer.

    Parameters
    ----------
    tty
        Draw a bar (True) or write log lines (False); default: whether stderr is a terminal.
    console
        The rich console the bar draws on (default: stderr's).
    clock
        Seconds, monotonic; the bar's rate estimate uses it too.
    """

    def __init__(
        self,
        *,
        tty: bool | None = None,
        console=None,
        clock: Callable[[], float] = time.monotonic,
        policy: ProgressPolicy | None = None,
        logger: logging.Logger = log,
    ) -> None:
        isatty = getattr(sys.stderr, "isatty", None)  # None: no stderr at all (a daemon)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self.console, self.clock, self.logger = console, clock, logger
        self.policy = policy or ProgressPolicy()
        self.label, self.total, self.done, self.moved = "", 0, 0, 0
        self.started_at: float | None = None
        self.last_line_at: float | None = None
        self.bar: _Bar | None = None
        self._lock = threading.Lock()

    def snapshot(self) -> Snapshot:
        elapsed = self.clock() - self.started_at if self.started_at is not None else 0.0
        return Snapshot(self.label, self.total, self.done, self.moved, elapsed)

    def start(self, label: str, total_bytes: int, done: int = 0) -> None:
        """Begin at ``done``; called again (a new attempt, a payload that changed), the clock
        and the byte count go on."""
        with self._lock:
            if self.started_at is None:
                self.started_at = self.clock()
            self.label, self.total = label, total_bytes
        self.update(done)

    def update(self, done_bytes: int) -> None:
        """The payload stands at ``done_bytes`` (a resumed stream: the acked offset)."""
        with self._lock:
            if self.bar is not None:
                self.bar.set(self.label, self.total, done_bytes, jumped=done_bytes != self.done)
            self.done = done_bytes
        self._show()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self.moved += nbytes
        self._show()

    def finish(self, complete: bool = True) -> None:
        """End the bar; a transfer that was shown and completed gets its closing line."""
        with self._lock:
            if self.started_at is None:
                return
            s = self.snapshot()
            if self.bar is not None:
                self.bar.stop()
                self.bar = None
            self.started_at = None  # a second finish says nothing
        if complete and visible(s, self.policy):
            self.logger.info("%s", done_line(s))

    def _show(self) -> None:
        with self._lock:
            s = self.snapshot()
            if self.bar is not None:
                self.bar.update(s.done)
            elif self.tty and visible(s, self.policy) and terminal.acquire(blocking=False):
                self.bar = _Bar(self.console, self.clock, s)
            elif line_due(s, self.last_line_at, self.policy):
                self.tty = False  # another display has the terminal: lines for this one
                self.last_line_at = s.elapsed
                self.logger.info("%s", progress_line(s))


class _Bar:
    """A rich bar (bytes done of total, rate, ETA), with the process's log lines drawn above
    it rather than through it while it shows. Holds ``terminal`` until ``stop``."""

    def __init__(self, console, clock: Callable[[], float], s: Snapshot) -> None:
        try:
            self._start(console, clock, s)
        except BaseException:
            terminal.release()
            raise

    def _start(self, console, clock: Callable[[], float], s: Snapshot) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
        columns += (TransferSpeedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        self.progress = Progress(
            *columns, console=console or Console(stderr=True), get_time=clock, transient=True
        )
        self.task = self.progress.add_task(s.label, total=s.total, completed=s.done)
        original = sys.stderr
        self.progress.start()  # on a terminal: sys.stderr now writes above the bar
        handlers = {*logging.getLogger().handlers, *log.handlers}
        self.original, self.moved = original, []
        if sys.stderr is not original:  # the handlers writing to the terminal: above it too
            self.moved = [
                h for h in handlers if isinstance(h, logging.StreamHandler) and h.stream is original
            ]
            for h in self.moved:
                h.setStream(sys.stderr)

    def set(self, label: str, total: int, done: int, jumped: bool) -> None:
        """A new attempt; ``jumped``: it goes on from elsewhere than the bar stands (a push
        resumed at the acked offset), so the rate starts afresh rather than count the jump."""
        change = self.progress.reset if jumped else self.progress.update
        change(self.task, total=total, completed=done, description=label)

    def update(self, done: int) -> None:
        self.progress.update(self.task, completed=done)

    def stop(self) -> None:
        try:
            for h in self.moved:
                h.setStream(self.original)
            self.progress.stop()
        finally:
            terminal.release()
