"""One event-log record on one line, its checksum, and the checks a run of lines must pass.

A record is one JSON object on one line::

    {"seq":7,"wall":1718000000.5,"kind":"round_closed","round":3,...,"crc":"9a0b1c2d"}

``seq`` counts up by one from 1 for the life of the job, across restarts and rotated segments.
``crc`` is the CRC-32 of the record's canonical JSON without ``crc`` (keys sorted, no spaces):
a line changed in place, or two half lines run together, no longer verifies. Lines written before
records carried ``crc`` have none; they are read unchecked (``Scan.unchecked`` counts them).

A jump in ``seq`` means records are missing. The coordinator reports it, and where it finds the
loss itself at start-up (the log ends before an event its checkpoint knows of) it writes one
``events_lost`` record right after the hole naming exactly that range, so the same hole is
reported once and no seq is ever used twice. Everything here is pure: lines in, findings out.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.persist.local_store import StoreError

RESERVED = ("seq", "wall", "kind", "crc")
LOST = "events_lost"
RECOVERY_GOES_ON = (
    "recovery goes on (the coordinator's state comes from its checkpoint and spool, not from "
    "this log), but the history of those events is lost"
)


class EventLogError(StoreError):
    """The event log cannot be used; the message names the file and line.

    A ``StoreError``: like a damaged checkpoint, it stops start-up with that one line.
    """


class Damaged(ValueError):
    """A line that is no record, followed by more lines: damage, not a torn last write."""

    def __init__(self, line: int, why: str) -> None:
        super().__init__(f"line {line}: {why}")
        self.line, self.why = line, why

    def in_live_file(self, path: object) -> EventLogError:
        return EventLogError(
            f"event log {path}: line {self.line}: {self.why}; a line before the last is "
            "damaged (a crash tears only the last one): move the file aside to start a new log"
        )


def _crc(record: dict[str, Any]) -> str:
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(canonical.encode()):08x}"


def encode(event: dict[str, Any]) -> bytes:
    """The line for ``event`` (``seq``, ``wall``, ``kind`` and its fields), with its ``crc``.

    Raises ``TypeError`` naming the field that is not JSON-serialisable.
    """
    try:
        text = json.dumps(event)
    except (TypeError, ValueError):
        raise _unserialisable(event) from None
    # The sum is of the record as it will be read back (tuples become lists, keys strings),
    # so that the reader computes the same one.
    crc = _crc(json.loads(text))
    return (json.dumps({**event, "crc": crc}, separators=(",", ":")) + "\n").encode()


def _unserialisable(fields: dict[str, Any]) -> TypeError:
    for name, value in fields.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            return TypeError(f"event field {name!r} is not JSON-serialisable: {exc}")
    return TypeError("event is not JSON-serialisable")


def parse(raw: bytes) -> tuple[dict[str, Any], bool]:
    """The record on one line (without ``crc``), and whether a checksum verified it.

    Raises
    ------
    ValueError
        The line is not a whole record; the message says why.
    """
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
    if seq < 1:
        raise ValueError(f"seq {seq} is not positive")
    if not isinstance(event.get("kind"), str):
        raise ValueError("no string kind")
    if "crc" not in event:
        return event, False
    crc = event.pop("crc")
    if crc != _crc(event):
        raise ValueError(
            f"checksum mismatch (the line says {crc!r}, its record sums to {_crc(event)})"
        )
    return event, True


@dataclass(frozen=True)
class Gap:
    """Events ``first``..``last`` are missing before ``line`` (1-based) of their file."""

    first: int
    last: int
    line: int
    noted: bool  # the record at ``line`` is the events_lost record that says so

    def describe(self) -> str:
        if self.first == self.last:
            return f"event {self.first} is missing"
        return f"events {self.first}-{self.last} are missing"

    def report(self, where: object, how: str) -> str:
        """The ERROR for this hole in the log file ``where``, found ``how``."""
        return f"event log {where}: {self.describe()} ({how}); {RECOVERY_GOES_ON}"


@dataclass
class Scan:
    """What a run of lines holds; ``after`` is the seq the first line should follow."""

    after: int = 0
    good_bytes: int = 0  # the whole records, up to the first bad line
    archived_bytes: int = 0  # leading records at or below ``after`` (a rotation cut short)
    first_seq: int | None = None  # of the first record after ``after``
    last_seq: int = 0
    unchecked: int = 0  # records without a crc (written before records carried one)
    events: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    torn: str | None = None  # why the last line was rejected, if it was
    last_closed_round: int | None = None


def scan_lines(lines: Iterable[bytes], *, after: int = 0, keep_since: int | None = None) -> Scan:
    """Check every line; keep the events after ``keep_since`` unless it is None.

    Raises
    ------
    Damaged
        A line before the last is not a record, or its seq does not go up.
    """
    scan = Scan(after=after, last_seq=after)
    prev: int | None = None  # seq of the previous record in these lines
    pending: tuple[int, str] | None = None  # a bad line, which is fatal unless it is the last
    lineno = 0
    for lineno, raw in enumerate(lines, start=1):
        if pending is not None:
            raise Damaged(*pending)
        try:
            event, checked = parse(raw)
            if prev is not None and event["seq"] <= prev:
                raise ValueError(f"seq {event['seq']} does not follow seq {prev}")
        except ValueError as exc:
            pending = (lineno, str(exc))
            continue
        seq = prev = event["seq"]
        scan.good_bytes += len(raw)
        scan.unchecked += not checked
        if seq <= after:
            scan.archived_bytes += len(raw)
            continue
        _count(scan, event, lineno)
        if keep_since is not None and seq > keep_since:
            scan.events.append(event)
    if pending is not None:
        scan.torn = f"line {pending[0]}: {pending[1]}"
    return scan


def _count(scan: Scan, event: dict[str, Any], lineno: int) -> None:
    seq = event["seq"]
    if seq > scan.last_seq + 1:
        first, last = scan.last_seq + 1, seq - 1
        noted = event["kind"] == LOST and (event.get("first"), event.get("last")) == (first, last)
        scan.gaps.append(Gap(first, last, lineno, noted))
    if scan.first_seq is None:
        scan.first_seq = seq
    scan.last_seq = seq
    if event["kind"] == "round_closed" and isinstance(event.get("round"), int):
        scan.last_closed_round = event["round"]


def lost_tail(log_last: int, known: Any) -> tuple[int, int] | None:
    """The events a checkpoint knows of (it was written after event ``known``) that a log
    ending at ``log_last`` lacks, or None. ``known`` comes from a file: anything but a positive
    integer (a checkpoint of an older version has none) knows of nothing."""
    if isinstance(known, bool) or not isinstance(known, int) or known <= log_last:
        return None
    return log_last + 1, known
