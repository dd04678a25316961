"""The event log's live file: whole lines appended and fsynced, and replaced atomically.

``EventLog`` holds its lock around every call; this class only does the file work.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from coordinator.events.format import parse
from coordinator.persist.local_store import fsync_dir

log = logging.getLogger("isthmus.coordinator")


def _write_all(f, data: bytes) -> None:
    view = memoryview(data)
    while view:  # an unbuffered write may take only part of it
        view = view[f.write(view) :]


class LiveFile:
    """The file at ``path``, created (and its folder fsynced) if need be; ``size`` is the
    length of its whole records (set by the owner once it has checked them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        created = not path.exists()
        # Unbuffered, so a failed append leaves nothing behind in a buffer to be written later.
        self.file = open(path, "ab", buffering=0)  # noqa: SIM115 - open until close()
        self.size = 0
        if created:
            try:
                os.fsync(self.file.fileno())
                fsync_dir(path.parent)
            except BaseException:
                self.file.close()
                raise

    @property
    def closed(self) -> bool:
        return self.file.closed

    def append(self, line: bytes) -> None:
        """Write ``line`` and fsync; on failure, cut off whatever part of it was written."""
        try:
            _write_all(self.file, line)
            os.fsync(self.file.fileno())
        except BaseException:
            self._undo_partial_write()
            raise
        self.size += len(line)

    def _undo_partial_write(self) -> None:
        # A half-written line followed by later good ones would read as damage in the middle of
        # the log, so cut it off now; if even that fails, the next open drops it as a torn tail.
        try:
            os.ftruncate(self.file.fileno(), self.size)
            os.fsync(self.file.fileno())
        except OSError as exc:
            log.error("event log %s: cannot cut off a failed append: %s", self.path, exc)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.file.fileno(), size)
        os.fsync(self.file.fileno())
        self.size = size

    def keep_only(self, start: int, end: int) -> int | None:
        """Make bytes ``start``..``end`` (whole records) the whole file, atomically: a crash
        leaves the old file or the new one. Returns the seq of the first record kept."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        # Append mode, as the file it replaces: after a failed append is cut off, the next
        # write goes to the new end, not to where the cut-off one ended.
        new = open(tmp, "ab", buffering=0)  # noqa: SIM115 - becomes the live file
        try:
            with open(self.path, "rb") as src:
                src.seek(start)
                kept = src.read(end - start)
            _write_all(new, kept)
            os.fsync(new.fileno())
            os.replace(tmp, self.path)  # the open file goes with its new name
        except BaseException:
            new.close()
            tmp.unlink(missing_ok=True)
            raise
        old, self.file, self.size = self.file, new, len(kept)
        old.close()
        try:  # the rename is done: a crash now leaves the old file or the new, both readable
            fsync_dir(self.path.parent)
        except OSError as exc:
            log.warning("event log %s: cannot fsync its folder: %s", self.path, exc)
        return parse(kept[: kept.index(b"\n") + 1])[0]["seq"] if kept else None

    def close(self) -> None:
        self.file.close()
