"""Writing on a disk that may fill up: an upload's ``.part`` file, refusals sites retry, and
retrying the coordinator's own records until space returns.

On a full disk a write can fail part-way, leaving bytes past the acknowledged offset. Appended
to, such a file held the failed chunk's head in front of its resent copy: a resumed upload then
completed "OK" with a spooled file longer than its manifest. Here every write goes to its own
offset, and a failed one cuts the file back to its length before (and fsyncs that); which
ranges hold received bytes is the upload's range log (``RangeLog``), appended only once a
chunk's bytes are written, so the file never claims bytes that did not arrive.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from coordinator.records import Refused

log = logging.getLogger("isthmus.coordinator")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
STORE_CAP_S = 5.0  # the longest wait between tries of an object store that does not answer


def fsync_path_dir(path: Path) -> None:
    """fsync the folder holding ``path`` (its new entries are then durable)."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_refusal(exc: OSError, what: str) -> Refused:
    """The retryable refusal for a write the coordinator's disk did not take."""
    if exc.errno in DISK_FULL:
        return Refused("full", f"coordinator disk full while {what}; retry later")
    return Refused("busy", f"the coordinator could not write {what} ({exc.strerror}); retry later")


def until_written(
    write: Callable[[], object], what: str, stopping: threading.Event, cap_s: float = 30.0
):
    """Run ``write`` until it does not fail for want of space, or for an object store that
    does not answer (``StoreUnavailable``), waiting longer each time (up to ``cap_s``;
    ``STORE_CAP_S`` for the store, so a job goes on soon after it is back).

    For what the coordinator itself must make durable (a round's record, its close, a
    checkpoint): the job cannot go on without it, and stopping would lose nothing that a
    retry after the disk has space again does not keep. Each write leaves nothing half-done
    behind (temporary files, renamed into place; objects no manifest names), so a retry starts
    clean. Any other error (a folder removed, permissions, a deposed leader's commit) is
    raised at once: waiting would not mend it. Raises the last error once ``stopping`` is set.
    """
    from coordinator.persist.local_store import (
        StoreUnavailable,  # torch: not for `coordinator --help`
    )

    delay = 0.5
    while True:
        try:
            return write()
        except OSError as exc:
            if stopping.is_set() or exc.errno not in DISK_FULL:
                raise
            cap = cap_s
            log.error("%s failed (%s); retrying in %.1fs", what, exc, delay)
        except StoreUnavailable as exc:
            if stopping.is_set():
                raise
            cap = min(cap_s, STORE_CAP_S)
            delay = min(delay, cap)
            log.error("%s failed (%s); retrying in %.1fs", what, exc, delay)
        if stopping.wait(delay):
            return write()  # one last try, then its error stands
        delay = min(cap, delay * 2)


class PartFile:
    """The ``.part`` file of one upload: each chunk written at its offset (``write_at``)."""

    def __init__(self, path: Path, length: int, keep_pages: bool = False) -> None:
        """``keep_pages``: ``path`` is a reused file (``UpdateSpool.take_free``) whose bytes
        are written over, not cut away first (cutting would drop the pages it is reused
        for); its stale bytes past ``length`` are never read as received (the range log)."""
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.length = length  # the end of the last range received
        if not keep_pages:
            os.ftruncate(self._fd, length)  # whatever lay past the acknowledged bytes goes

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def write_at(self, offset: int, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError:
            self.cut_back(self.length)
            raise
        self.length = max(self.length, offset + done)
        return done

    def cut_back(self, length: int) -> None:
        """Back to ``length`` bytes, durably: what a failed write left past the bytes
        received goes, and a resume continues from exactly there."""
        try:
            os.ftruncate(self._fd, length)
            os.fsync(self._fd)
            self.length = length
        except OSError:
            # Cannot even shrink it: make the file unusable rather than wrong (a resume
            # then starts the upload again from byte 0).
            self.length = -1
            raise

    def fit(self, total: int) -> None:
        """Cut what a reused file holds past the payload's ``total`` bytes (all received)."""
        if os.fstat(self._fd).st_size > total:
            os.ftruncate(self._fd, total)

    @property
    def broken(self) -> bool:
        return self.length < 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RangeLog:
    """Which byte ranges of an upload's ``.part`` file were received, read back by a restarted
    coordinator: 16-byte records (offset, length), each written once a chunk's bytes are.
    A chunk that continues a range a record holds grows that record in place (``extend``), so
    a stream's chunks take one record, whatever their size: tiny chunks cannot make the log
    outgrow the payload. Not fsynced, like the ``.part`` file (the payload's digest, checked
    once every byte is in, is what vouches for the bytes); a failed append is cut back, so the
    log never holds a torn record."""

    RECORD = struct.Struct("<QQ")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self.length = 0
        self.broken = False

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> list[tuple[int, int]]:
        """Every recorded range ``(start, end)``; a torn last record is cut off."""
        raw = self.path.read_bytes()
        whole = len(raw) - len(raw) % self.RECORD.size
        if whole != len(raw):
            os.truncate(self.path, whole)
        return [(o, o + n) for o, n in self.RECORD.iter_unpack(raw[:whole])]

    def reset(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def create(self) -> None:
        """Make the (empty) log now, before its ``.part`` file exists: a reused file's stale
        bytes must never look like bytes an older coordinator received without a log."""
        self._open()
        fsync_path_dir(self.path)

    def _open(self) -> None:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            self.length = os.fstat(self._fd).st_size

    def append(self, offset: int, length: int) -> int:
        """Record the range; returns the record's number (for ``extend``)."""
        self._open()
        try:
            self._write(self.length, offset, length)
        except OSError:
            try:
                os.ftruncate(self._fd, self.length)
            except OSError:
                self.broken = True  # records past a torn one could not be read back
            raise
        self.length += self.RECORD.size
        return self.length // self.RECORD.size - 1

    def extend(self, record: int, offset: int, length: int) -> None:
        """Record ``record`` (of ``append``) now holds ``length`` bytes from ``offset`` (its
        own offset, a longer length: a torn write leaves it the old length or the new)."""
        self._write(record * self.RECORD.size, offset, length)

    def _write(self, at: int, offset: int, length: int) -> None:
        written = os.pwrite(self._fd, self.RECORD.pack(offset, length), at)
        if written != self.RECORD.size:
            raise OSError(errno.ENOSPC, "a short write to the range log")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
