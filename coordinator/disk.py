"""Writing on a disk that may fill up: an upload's ``.part`` file, refusals sites retry, and
retrying the coordinator's own records until space returns.

On a full disk a write can fail part-way, leaving bytes past the acknowledged offset. Appended
to, such a file held the failed chunk's head in front of its resent copy: a resumed upload then
completed "OK" with a spooled file longer than its manifest. Here every write goes to its own
offset, and a failed one cuts the file back to the acknowledged length (and fsyncs that), so
the file always holds exactly the bytes the SHA-256 state covers.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from coordinator.records import Refused

log = logging.getLogger("isthmus.coordinator")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
STORE_CAP_S = 5.0  # the longest wait between tries of an object store that does not answer


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
    from coordinator.store import StoreUnavailable  # torch: not for `coordinator --help`

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
    """The ``.part`` file of one upload, written from ``length`` on (a ``Reassembler`` sink)."""

    def __init__(self, path: Path, length: int) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.length = length
        os.ftruncate(self._fd, length)  # whatever lay past the acknowledged bytes goes

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], self.length + done)
        except OSError:
            self._cut_back()
            raise
        self.length += done
        return done

    def _cut_back(self) -> None:
        """Back to the acknowledged length, durably: a resume continues from exactly there."""
        try:
            os.ftruncate(self._fd, self.length)
            os.fsync(self._fd)
        except OSError:
            # Cannot even shrink it: make the file unusable rather than wrong (a resume
            # then starts the upload again from byte 0).
            self.length = -1
            raise

    @property
    def broken(self) -> bool:
        return self.length < 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
