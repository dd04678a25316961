"""The coordinator's append-only event log, kept beside its checkpoints.

One record per line (``coordinator.events.format``: ``seq`` counting up by one from 1 across
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

The log does not grow for ever: after each checkpoint (``rotate``, on the checkpoint thread) a
live file past ``[events] rotate_bytes`` moves to a gzip segment beside it and starts again, and
only the newest ``keep_segments`` segments stay (``coordinator.events.segments``). Readers read
the segments, then the live file (``read_history``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.events.format import (
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
from coordinator.events.live import LiveFile
from coordinator.events.segments import (
    EventsConfig,
    History,
    Segment,
    boundary_gaps,
    last_closed_round,
    list_segments,
    read_events,
    read_history,
    remove_temporaries,
    segment_folder,
    segment_path,
    should_rotate,
    to_prune,
    write_segment,
)
from coordinator.persist.local_store import fsync_dir

__all__ = [
    "RESERVED",
    "EventLog",
    "EventLogError",
    "EventSink",
    "EventsConfig",
    "History",
    "read_events",
    "read_history",
]

log = logging.getLogger("isthmus.coordinator")


class EventLog:
    """Appends events to the log at ``path``, creating it (and its folder) if need be.

    Raises
    ------
    EventLogError
        A line before the last one is unreadable, or two segments overlap; nothing is changed.
    """

    def __init__(self, path: Path, config: EventsConfig | None = None) -> None:
        self._path = Path(path)
        self.config = config or EventsConfig()
        self._lock = threading.Lock()  # appends, and the swap of the live file
        self._rotating = threading.Lock()  # one rotation at a time
        self._can_rotate = True
        self._path.parent.mkdir(parents=True, exist_ok=True)
        segments = list_segments(self._path)
        self._live = LiveFile(self._path)
        try:
            scan = self._load(segments)
        except BaseException:
            self._live.close()
            raise
        self._closed_round = scan.last_closed_round
        self._look_back = scan.last_closed_round is None and bool(segments)
        self._live_first = scan.first_seq
        self._last_seq = scan.last_seq

    def _load(self, segments: list[Segment]) -> Scan:
        after = segments[-1].last if segments else 0
        with open(self._path, "rb") as f:
            try:
                scan = scan_lines(f, after=after)
            except Damaged as exc:
                raise exc.in_live_file(self._path) from None
        remove_temporaries(self._path)
        for where, gap in [*boundary_gaps(segments), *((self._path, g) for g in scan.gaps)]:
            if not gap.noted:
                log.error("%s", gap.report(where, f"before line {gap.line}"))
        if scan.unchecked:
            log.info("event log %s: %d record(s) without a checksum", self._path, scan.unchecked)
        if scan.torn is not None:
            log.warning("event log %s: dropping a torn last %s", self._path, scan.torn)
        if scan.archived_bytes:
            # The segment was renamed into place, the live file not yet replaced: finish.
            log.info("event log %s: finishing a rotation into %s", self._path, segments[-1].path)
            self._live.keep_only(scan.archived_bytes, scan.good_bytes)
        elif scan.torn is not None:
            self._live.truncate(scan.good_bytes)
        else:
            self._live.size = scan.good_bytes
        return scan

    @property
    def path(self) -> Path:
        return self._path

    @property
    def last_seq(self) -> int:
        """Seq of the newest event in the log (live file or segment); 0 when it is empty."""
        return self._last_seq

    @property
    def last_closed_round(self) -> int | None:
        """Round of the newest round_closed event, or None."""
        with self._lock:
            if self._look_back:  # none in the live file: read the segments, once
                self._look_back = False
                self._closed_round = last_closed_round(list_segments(self._path))
            return self._closed_round

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
            why = f"the log ended at event {ends}; {source} was written after event {lost[1]}"
            log.error("%s", Gap(*lost, line=0, noted=False).report(self._path, why))
            self._append_at(lost[1] + 1, LOST, {"first": lost[0], "last": lost[1], "reason": why})
            return lost

    def adopt(self, records: list[dict[str, Any]]) -> None:
        """Append records another coordinator logged, as they are (seq, wall and fields kept;
        ``coordinator.events.remote``), in one write.

        Raises
        ------
        EventLogError
            Their seqs do not continue this log one by one; nothing is written.
        """
        with self._lock:
            want = range(self._last_seq + 1, self._last_seq + 1 + len(records))
            if [r.get("seq") for r in records] != list(want):
                raise EventLogError(f"{self._path}: adopted records do not follow {self._last_seq}")
            if not records:
                return
            if self._live.closed:
                raise EventLogError(f"{self._path}: the event log is closed")
            self._live.append(b"".join(encode(r) for r in records))
            self._last_seq = records[-1]["seq"]
            if self._live_first is None:
                self._live_first = records[0]["seq"]
            closed = [r["round"] for r in records if r.get("kind") == "round_closed"]
            if closed and isinstance(closed[-1], int):
                self._closed_round, self._look_back = closed[-1], False

    def set_aside(self, tag: str) -> Path:
        """Move the live file and its segments aside (``NAME.TAG``) and start an empty log;
        returns where the live file went."""
        with self._lock:
            self._live.close()
            aside = self._path.with_name(f"{self._path.name}.{tag}")
            os.replace(self._path, aside)
            folder = segment_folder(self._path)
            if folder.is_dir():
                os.replace(folder, folder.with_name(f"{folder.name}.{tag}"))
            fsync_dir(self._path.parent)
        self.__init__(self._path, self.config)
        return aside

    def _append_at(self, seq: int, kind: str, fields: dict[str, Any]) -> int:
        if self._live.closed:
            raise EventLogError(f"{self._path}: the event log is closed")
        event = {"seq": seq, "wall": time.time(), "kind": kind, **fields}
        self._live.append(encode(event))
        self._last_seq = seq
        if self._live_first is None:
            self._live_first = seq
        if kind == "round_closed" and isinstance(fields.get("round"), int):
            self._closed_round, self._look_back = fields["round"], False
        return seq

    def rotate(self) -> Segment | None:
        """Move the live file's records to a new segment if it has reached ``rotate_bytes``,
        and drop the oldest segments beyond ``keep_segments``; returns the new segment.

        Appends go on meanwhile: the records up to now are copied without the lock, and only
        the swap of the live file (to the records appended since) holds it. A crash at any
        point leaves every record in the live file, in a segment, or in both, which the next
        start sorts out. The coordinator calls this on its checkpoint thread.

        Raises
        ------
        OSError
            Writing the segment or the new live file failed; the log goes on unrotated.
        """
        with self._rotating:
            with self._lock:
                if self._live.closed or not self._can_rotate:
                    return None
                if not should_rotate(self._live.size, self._live_first, self.config.rotate_bytes):
                    return None
                size, first, last = self._live.size, self._live_first, self._last_seq
            try:
                seg = write_segment(self._path, first, last, size)
            except BaseException:
                self._forget(segment_path(self._path, first, last))
                raise
            with self._lock:
                if self._live.closed:  # closed meanwhile: the next start finishes this
                    return seg
                try:
                    self._live_first = self._live.keep_only(size, self._live.size)
                except BaseException:  # the live file is unchanged
                    self._forget(seg.path)
                    raise
            for old in to_prune(list_segments(self._path), self.config.keep_segments):
                old.path.unlink(missing_ok=True)
                log.info("event log %s: dropped its oldest segment %s", self._path, old.path)
            fsync_dir(seg.path.parent)
            return seg

    def _forget(self, seg: Path) -> None:
        # The live file still holds the segment's records: drop the segment (if it was renamed
        # into place), or a later rotation would write one that overlaps it. If even that
        # fails, stop rotating; the next start finishes this rotation.
        try:
            if seg.exists():
                seg.unlink()
                fsync_dir(seg.parent)
        except OSError as exc:
            self._can_rotate = False
            log.error("event log %s: cannot undo segment %s (%s)", self._path, seg, exc)

    def close(self) -> None:
        """Close the file; closing twice is fine."""
        with self._lock:
            self._live.close()

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
        self._failing = False
        # Told of every event as it is posted (under the coordinator's lock: cheap only),
        # e.g. the Prometheus metrics.
        self.observers: list[Callable[[str, dict[str, Any]], None]] = []

    def post(self, kind: str, **fields: Any) -> None:
        self._pending.append((kind, fields))
        for observe in self.observers:
            observe(kind, fields)

    def flush(self) -> None:
        """Write what was posted. On a full disk the events stay queued, in order, for the
        next flush: they are the job's history, and the call or round that posted them must
        not fail for it (what recovery needs is in the spool and the checkpoints)."""
        with self._writing:
            while self._pending:
                kind, fields = self._pending[0]
                try:
                    self.log.append(kind, **fields)
                except OSError as exc:
                    if not self._failing:
                        log.error("event log: %s; %d event(s) wait", exc, len(self._pending))
                    self._failing = True
                    return
                self._pending.popleft()
                self._failing = False
