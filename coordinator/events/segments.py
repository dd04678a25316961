"""The event log's rotated segments, and the whole history read back in order.

When the live file (``state_dir/events.jsonl``) grows past ``events.rotate_bytes``, its records
move to a gzip segment ``state_dir/events/events-<first>-<last>.jsonl.gz`` (seqs zero-padded, so
the names sort) and the live file starts again. A segment is written under a temporary name,
fsynced, renamed into place and its folder fsynced: the rename is the moment the records
belong to the segment. Until the live file is replaced they are in both; a start-up that finds
the live file beginning with records a segment holds drops them there (``Scan.archived_bytes``).

History is the kept segments in seq order, then the live file. The oldest segments go once
there are more than ``events.keep_segments``, so history starts at the oldest kept one.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.events.format import LOST, Damaged, EventLogError, Gap, Scan, parse, scan_lines
from coordinator.persist.local_store import fsync_dir
from wire.config_table import non_negative, positive, setting

log = logging.getLogger("isthmus.coordinator")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class EventsConfig:
    """The ``[events]`` table: when the live log moves to a segment, how many segments stay."""

    # About 8 KB of events per round with 32 sites: some 2,000 rounds per segment, which gzip
    # makes about a quarter of that on disk (hashes do not compress).
    rotate_bytes: int = setting(
        16 << 20,
        check=non_negative,
        help="after a checkpoint, an event log (``state_dir/events.jsonl``) of this size or "
        "more moves to a gzip segment ``state_dir/events/events-<first seq>-<last "
        "seq>.jsonl.gz`` and starts again. 0: never",
    )
    keep_segments: int = setting(
        16,
        check=positive,
        help="segments kept; beyond that the oldest go (history then starts at the oldest kept)",
    )


def should_rotate(size: int, first_seq: int | None, rotate_bytes: int) -> bool:
    """Whether a live file of ``size`` bytes, first record ``first_seq``, goes to a segment."""
    return rotate_bytes > 0 and first_seq is not None and size >= rotate_bytes


@dataclass(frozen=True)
class Segment:
    first: int
    last: int
    path: Path


@dataclass(frozen=True)
class History:
    """Events in seq order, and the holes in them, each with the file it was found in."""

    events: list[dict[str, Any]]
    gaps: list[tuple[Path, Gap]]


def segment_folder(live: Path) -> Path:
    return live.parent / live.stem


def segment_path(live: Path, first: int, last: int) -> Path:
    return segment_folder(live) / f"{live.stem}-{first:010d}-{last:010d}.jsonl.gz"


def _pattern(live: Path) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(live.stem)}-(\d+)-(\d+)\.jsonl\.gz\Z")


def list_segments(live: Path) -> list[Segment]:
    """The segments of the log whose live file is ``live``, in seq order.

    Raises
    ------
    EventLogError
        Two segments hold the same seq (they were not written by rotation).
    """
    folder, pattern = segment_folder(live), _pattern(live)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        m = pattern.match(path.name)
        if m and int(m[1]) <= int(m[2]):
            found.append(Segment(int(m[1]), int(m[2]), path))
    found.sort(key=lambda s: s.first)
    for a, b in zip(found, found[1:], strict=False):
        if b.first <= a.last:
            raise EventLogError(f"event log segments {a.path} and {b.path} overlap")
    return found


def remove_temporaries(live: Path) -> None:
    """Leftovers of a rotation cut short: a segment or live file never renamed into place."""
    for stale in [*segment_folder(live).glob(".*.tmp-*"), *live.parent.glob(f".{live.name}.tmp-*")]:
        stale.unlink(missing_ok=True)


def write_segment(live: Path, first: int, last: int, nbytes: int) -> Segment:
    """Copy the first ``nbytes`` of ``live`` (events ``first``..``last``) to a new segment."""
    final = segment_path(live, first, last)
    folder = final.parent
    if not folder.is_dir():
        folder.mkdir()
        fsync_dir(live.parent)
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(live, "rb") as src, open(tmp, "wb") as raw:
            # mtime 0: the same records give the same bytes.
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
                left = nbytes
                while left:
                    chunk = src.read(min(left, _CHUNK))
                    if not chunk:
                        raise EventLogError(f"event log {live}: shorter than {nbytes} bytes")
                    gz.write(chunk)
                    left -= len(chunk)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return Segment(first, last, final)


def to_prune(segments: list[Segment], keep: int) -> list[Segment]:
    """The oldest segments beyond the newest ``keep``."""
    return segments[: max(len(segments) - keep, 0)]


def read_segment(seg: Segment, after: int, keep_since: int | None = None) -> Scan:
    """Every record of ``seg``, which must hold exactly events ``seg.first``..``seg.last``.

    Raises
    ------
    EventLogError
        The segment is unreadable or holds other records than its name says.
    """
    try:
        with gzip.open(seg.path, "rb") as f:
            scan = scan_lines(f, after=after, keep_since=keep_since)
    except Damaged as exc:
        raise EventLogError(f"event log segment {seg.path}: {exc}") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise EventLogError(f"event log segment {seg.path}: unreadable ({exc})") from None
    if scan.torn is not None:  # written whole before it was renamed: no torn line here
        raise EventLogError(f"event log segment {seg.path}: {scan.torn}")
    held = (scan.first_seq, scan.last_seq)
    if scan.archived_bytes or held != (seg.first, seg.last):
        raise EventLogError(
            f"event log segment {seg.path}: holds events {held[0]}-{held[1]} "
            f"(after event {after}), not the ones its name says"
        )
    return scan


def first_record(seg: Segment) -> dict[str, Any] | None:
    """The first record of ``seg`` (only its first line is decompressed), or None."""
    try:
        with gzip.open(seg.path, "rb") as f:
            return parse(f.readline())[0]
    except (OSError, EOFError, zlib.error, ValueError):
        return None


def boundary_gaps(segments: list[Segment]) -> list[tuple[Path, Gap]]:
    """Holes between consecutive segments (one deleted, or a hole noted at the start of one)."""
    gaps = []
    for a, b in zip(segments, segments[1:], strict=False):
        if b.first > a.last + 1:
            first, last = a.last + 1, b.first - 1
            head = first_record(b) or {}
            said = (head.get("kind"), head.get("first"), head.get("last"))
            gaps.append((b.path, Gap(first, last, 1, noted=said == (LOST, first, last))))
    return gaps


def read_history(live: Path, since_seq: int = 0) -> History:
    """The events after ``since_seq`` in the kept segments and the live file ``live``.

    A torn last line of the live file (an append in progress, or cut short by a crash) is
    skipped; records of a rotation not yet finished are read once.

    Raises
    ------
    FileNotFoundError
        There is neither a live file nor a segment.
    EventLogError
        A segment is damaged, or a line before the last of the live file.
    """
    live = Path(live)
    segments = list_segments(live)
    # Events before the oldest kept segment went by keep_segments: not a hole.
    after = segments[0].first - 1 if segments else 0
    events: list[dict[str, Any]] = []
    gaps: list[tuple[Path, Gap]] = []
    for seg in segments:
        if seg.last > since_seq:
            scan = read_segment(seg, after, since_seq)
            events += scan.events
            gaps += [(seg.path, g) for g in scan.gaps]
        after = seg.last
    if segments and not live.exists():
        return History(events, gaps)
    with open(live, "rb") as f:
        try:
            scan = scan_lines(f, after=after, keep_since=since_seq)
        except Damaged as exc:
            raise exc.in_live_file(live) from None
    return History(events + scan.events, gaps + [(live, g) for g in scan.gaps])


def read_events(path: Path, *, since_seq: int = 0) -> list[dict[str, Any]]:
    """The events whose seq is greater than ``since_seq``, in order: those of the segments
    kept beside the live file ``path``, then those of the live file.

    A torn last line (an append in progress, or cut short by a crash) is skipped, and so is a
    hole in the seqs (the coordinator reports it when it starts; ``read_history`` lists them).

    Raises
    ------
    FileNotFoundError
        There is no log at ``path``.
    EventLogError
        A segment is damaged, or a line before the last of the live file.
    """
    return read_history(Path(path), since_seq).events


def last_closed_round(segments: list[Segment]) -> int | None:
    """Round of the newest round_closed event in ``segments``, or None; the newest segment
    is read first, and only as far back as needed."""
    for seg in reversed(segments):
        try:
            scan = read_segment(seg, seg.first - 1)
        except EventLogError as exc:
            log.warning("%s", exc)
            return None
        if scan.last_closed_round is not None:
            return scan.last_closed_round
    return None
