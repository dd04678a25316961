"""The coordinator's append-only event log, kept beside its checkpoints.

One record per line (``coordinator.event_format``: ``seq`` counting up by one from 1 across
restarts, a CRC-32 per record). ``append`` returns only once the line is fsynced, so an event it
has acknowledged survives a crash. A crash in the middle of ``append`` can leave only the last
line torn (cut short, or without its newline); opening the log again cuts that line away before
appending, and readers skip it. Anything unreadable before the last line is real damage, not a
torn write, and is an ``EventLogError`` naming the file and line: start-up stops there.

Missing records are reported as an ERROR naming the file and the seqs lost: a seq that jumps
(lines deleted), or a log that ends before an event the checkpoint knows of (``check_known``:
the file was cut, or restored from an older copy; a torn tail after ``kill -9`` loses at most
the one event not yet acknowledged, which no checkpoint can know of). Recovery goes on: the
coordinator's state is its checkpoint and spool, never this log, which is history.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from coordinator.event_format import (
    LOST,
    RESERVED,
    Damaged,
    EventLogError,
    Gap,
    Scan,
    encode,
    lost_tail,
    scan_lines,
)
from coordinator.store import fsync_dir

__all__ = ["RESERVED", "EventLog", "EventLogError", "EventSink", "read_events"]

log = logging.getLogger("isthmus.coordinator")
RECOVERY_GOES_ON = (
    "recovery goes on (the coordinator's state comes from its checkpoint and spool, not from "
    "this log), but the history of those events is lost"
)


def _scan(path: Path, *, keep_since: int | None) -> Scan:
    with open(path, "rb") as f:
        try:
            return scan_lines(f, keep_since=keep_since)
        except Damaged as exc:
            raise exc.in_live_file(path) from None


def read_events(path: Path, *, since_seq: int = 0) -> list[dict[str, Any]]:
    """The events in the log at ``path`` whose seq is greater than ``since_seq``, in order.

    A torn last line (an append in progress, or cut short by a crash) is skipped, and so is a
    hole in the seqs (the coordinator reports it when it starts).

    Raises
    ------
    FileNotFoundError
        There is no log at ``path``.
    EventLogError
        A line before the last one is unreadable.
    """
    return _scan(Path(path), keep_since=since_seq).events


def missing_message(where: Path, gap: Gap) -> str:
    return f"event log {where}: {gap.describe()} before line {gap.line}; {RECOVERY_GOES_ON}"


def _unserialisable(fields: dict[str, Any]) -> TypeError:
    for name, value in fields.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            return TypeError(f"event field {name!r} is not JSON-serialisable: {exc}")
    return TypeError("event is not JSON-serialisable")


class EventLog:
    """Appends events to the log at ``path``, creating it (and its folder) if need be.

    Raises
    ------
    EventLogError
        A line before the last one is unreadable; the file is left untouched.
    """

    def __init__(self, path: Path) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        self._path.parent.mkdir(parents=True, exist_ok=True)
        created = not self._path.exists()
        # Unbuffered, so a failed append leaves nothing behind in a buffer to be written later.
        self._file = open(self._path, "ab", buffering=0)  # noqa: SIM115 - open until close()
        try:
            if created:
                os.fsync(self._file.fileno())
                fsync_dir(self._path.parent)
            scan = self._load()
        except BaseException:
            self._file.close()
            raise
        self.last_closed_round = scan.last_closed_round  # of the newest round_closed event
        self._size = scan.good_bytes
        self._last_seq = scan.last_seq

    def _load(self) -> Scan:
        scan = _scan(self._path, keep_since=None)
        for gap in scan.gaps:
            if not gap.noted:
                log.error("%s", missing_message(self._path, gap))
        if scan.unchecked:
            log.info("event log %s: %d record(s) without a checksum", self._path, scan.unchecked)
        if scan.torn is not None:
            size = self._file.seek(0, os.SEEK_END)
            log.warning(
                "event log %s: dropping a torn last %s (%d bytes)",
                self._path,
                scan.torn,
                size - scan.good_bytes,
            )
            os.ftruncate(self._file.fileno(), scan.good_bytes)
            os.fsync(self._file.fileno())
        return scan

    @property
    def path(self) -> Path:
        return self._path

    @property
    def last_seq(self) -> int:
        """Seq of the newest event in the log; 0 when it is empty."""
        return self._last_seq

    def append(self, kind: str, **fields: Any) -> int:
        """Write one event durably and return its seq.

        Parameters
        ----------
        kind
            What happened, e.g. ``"round_closed"``.
        **fields
            JSON-serialisable details; ``seq``, ``wall`` and ``crc`` are set here.

        Raises
        ------
        TypeError
            A field is not JSON-serialisable; nothing is written.
        ValueError
            ``kind`` is empty or a field uses a reserved name.
        EventLogError
            The log is closed.
        """
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        for name in RESERVED:
            if name in fields:
                raise ValueError(f"event field {name!r} is reserved")
        with self._lock:
            return self._append_at(self._last_seq + 1, kind, fields)

    def check_known(self, known: Any, source: str) -> tuple[int, int] | None:
        """Compare the log with a checkpoint written after event ``known``.

        If the log ends before that event, its records were lost (not torn: a crash tears only
        an event not yet acknowledged, which no checkpoint knows of). Say so (an ERROR naming
        the file and the seqs), write an ``events_lost`` record after them so that no seq is
        used twice and the next start knows, and return the range lost.

        Parameters
        ----------
        known
            The checkpoint's ``events_seq`` (anything else, e.g. None from an older version's
            checkpoint, knows of nothing).
        source
            The checkpoint, in words (``"the checkpoint of round 12"``).
        """
        with self._lock:
            lost = lost_tail(self._last_seq, known)
            if lost is None:
                return None
            ends = self._last_seq
            gap = Gap(*lost, line=0, noted=False)
            log.error(
                "event log %s: %s: it ends at event %d, but %s was written after event %d; %s",
                self._path,
                gap.describe(),
                ends,
                source,
                lost[1],
                RECOVERY_GOES_ON,
            )
            why = f"the log ended at event {ends}; {source} was written after event {lost[1]}"
            self._append_at(lost[1] + 1, LOST, {"first": lost[0], "last": lost[1], "reason": why})
            return lost

    def _append_at(self, seq: int, kind: str, fields: dict[str, Any]) -> int:
        if self._file.closed:
            raise EventLogError(f"{self._path}: the event log is closed")
        event = {"seq": seq, "wall": time.time(), "kind": kind, **fields}
        try:
            line = encode(event)
        except (TypeError, ValueError):
            raise _unserialisable(fields) from None
        try:
            self._write(line)
        except BaseException:
            self._undo_partial_write()
            raise
        self._size += len(line)
        self._last_seq = seq
        if kind == "round_closed" and isinstance(fields.get("round"), int):
            self.last_closed_round = fields["round"]
        return seq

    def _write(self, line: bytes) -> None:
        view = memoryview(line)
        while view:  # an unbuffered write may take only part of the line
            view = view[self._file.write(view) :]
        os.fsync(self._file.fileno())

    def _undo_partial_write(self) -> None:
        # A half-written line followed by later good ones would read as damage in the middle of
        # the log, so cut it off now; if even that fails, the next open drops it as a torn tail.
        try:
            os.ftruncate(self._file.fileno(), self._size)
            os.fsync(self._file.fileno())
        except OSError as exc:
            log.error("event log %s: cannot cut off a failed append: %s", self._path, exc)

    def close(self) -> None:
        """Close the file; closing twice is fine."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventSink:
    """Events posted under the coordinator's lock and written after it is released.

    ``post`` only queues (it keeps the order in which the state changed); ``flush`` writes and
    fsyncs everything posted so far, in that order, and returns once it is durable. Every
    coordinator call flushes before it returns, so an event is durable by the time its call
    has answered, and no fsync ever happens while the lock is held.
    """

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self._pending: deque[tuple[str, dict[str, Any]]] = deque()
        self._writing = threading.Lock()

    def post(self, kind: str, **fields: Any) -> None:
        self._pending.append((kind, fields))

    def flush(self) -> None:
        with self._writing:
            while self._pending:
                kind, fields = self._pending.popleft()
                self.log.append(kind, **fields)
