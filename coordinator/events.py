"""The coordinator's append-only event log, kept beside its checkpoints.

One JSON object per line, ``{"seq": n, "wall": <unix time>, "kind": ..., **fields}``, with ``seq``
counting up from 1 across restarts. ``append`` returns only once the line is fsynced, so an event
it has acknowledged survives a crash. A crash in the middle of ``append`` can leave only the last
line torn (cut short, or without its newline); opening the log again cuts that line away before
appending, and readers skip it. Anything unreadable before the last line is real damage, not a
torn write, and is an ``EventLogError`` naming the file and line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.store import StoreError, fsync_dir

log = logging.getLogger("isthmus.coordinator")

RESERVED = ("seq", "wall", "kind")


class EventLogError(StoreError):
    """The event log cannot be used; the message names the file and line.

    A ``StoreError``: like a damaged checkpoint, it stops start-up with that one line.
    """


@dataclass
class _Scan:
    good_bytes: int = 0
    last_seq: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    torn: str | None = None  # why the last line was rejected, if it was
    last_closed_round: int | None = None


def _parse(raw: bytes, prev_seq: int) -> dict[str, Any]:
    if not raw.endswith(b"\n"):
        raise ValueError("no newline at the end")
    try:
        event = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(event, dict):
        raise ValueError("not a JSON object")
    seq = event.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise ValueError(f"no integer seq (seq={seq!r})")
    if seq <= prev_seq:
        raise ValueError(f"seq {seq} does not follow seq {prev_seq}")
    if not isinstance(event.get("kind"), str):
        raise ValueError("no string kind")
    return event


def _scan(path: Path, *, keep_since: int | None) -> _Scan:
    """Check every line of ``path``; keep the events after ``keep_since`` unless it is None."""
    scan = _Scan()
    pending: tuple[int, str] | None = None  # a bad line, which is fatal unless it is the last
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if pending is not None:
                raise EventLogError(
                    f"event log {path}: line {pending[0]}: {pending[1]}; a line before the "
                    "last is damaged (a crash tears only the last one): move the file aside "
                    "to start a new log"
                )
            try:
                event = _parse(raw, scan.last_seq)
            except ValueError as exc:
                pending = (lineno, str(exc))
                continue
            scan.good_bytes += len(raw)
            scan.last_seq = event["seq"]
            if event["kind"] == "round_closed" and isinstance(event.get("round"), int):
                scan.last_closed_round = event["round"]
            if keep_since is not None and event["seq"] > keep_since:
                scan.events.append(event)
    if pending is not None:
        scan.torn = f"line {pending[0]}: {pending[1]}"
    return scan


def read_events(path: Path, *, since_seq: int = 0) -> list[dict[str, Any]]:
    """The events in the log at ``path`` whose seq is greater than ``since_seq``, in order.

    A torn last line (an append in progress, or cut short by a crash) is skipped.

    Raises
    ------
    FileNotFoundError
        There is no log at ``path``.
    EventLogError
        A line before the last one is unreadable.
    """
    return _scan(Path(path), keep_since=since_seq).events


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
        self.last_closed_round: int | None = None  # of the newest round_closed event
        self._lock = threading.Lock()
        self._path.parent.mkdir(parents=True, exist_ok=True)
        created = not self._path.exists()
        # Unbuffered, so a failed append leaves nothing behind in a buffer to be written later.
        self._file = open(self._path, "ab", buffering=0)  # noqa: SIM115 - open until close()
        try:
            if created:
                os.fsync(self._file.fileno())
                fsync_dir(self._path.parent)
            scan = _scan(self._path, keep_since=None)
            self.last_closed_round = scan.last_closed_round
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
        except BaseException:
            self._file.close()
            raise
        self._size = scan.good_bytes
        self._last_seq = scan.last_seq

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
            JSON-serialisable details; ``seq`` and ``wall`` are set here.

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
            if self._file.closed:
                raise EventLogError(f"{self._path}: the event log is closed")
            seq = self._last_seq + 1
            event = {"seq": seq, "wall": time.time(), "kind": kind, **fields}
            try:
                line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
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
