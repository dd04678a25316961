"""The bytes of one upload: which ranges of its ``.part`` file are in, and their digest.

An upload arrives as one stream in payload order, or (``[transfer] streams`` K > 1) as pieces
on K streams at once, each piece in order inside its own byte range (``PushHeader.piece``).
Either way every chunk must start exactly where its stream's range is received up to (the
end of the received run from the range's start), lie inside the range, and touch no byte
already received; it is then written at its offset and its range recorded. Which ranges are in
is kept in memory (``ReceivedRanges``) and in the upload's range log beside the ``.part`` file
(``coordinator.persist.disk.RangeLog``), so a restarted coordinator resumes every piece where it
stopped. The digest (``wire.digest``) runs along as long as the bytes arrive in order from
the start (one stream: as before, nothing is read back); whatever arrived out of that order
is read back from the file once every byte is in, and the whole payload's digest is compared
with the manifest's.

The decisions are the pure ``wire.transfer.ReceivedRanges`` and ``chunk_refusal``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from coordinator.persist.disk import PartFile, RangeLog
from wire.chunking import MAX_CHUNK_BYTES, ChunkError
from wire.digest import Hasher
from wire.payload_parts import PayloadPart, file_digest
from wire.transfer import Piece, ReceivedRanges

READ_BACK = 4 << 20


def chunk_refusal(
    ranges: ReceivedRanges, piece: Piece | None, total: int, offset: int, size: int
) -> str | None:
    """Why a chunk of ``size`` bytes at ``offset`` of a stream carrying ``piece`` (None: the
    whole payload) cannot be taken, or None when it can."""
    end = total if piece is None else piece.end
    expected = ranges.resume_at(piece or Piece(0, total))
    if size == 0:
        return f"empty chunk at offset {offset}"
    if size > MAX_CHUNK_BYTES:
        return f"chunk of {size} bytes exceeds the {MAX_CHUNK_BYTES}-byte limit"
    if offset < expected:
        return (
            f"duplicated chunk: offset {offset} was already received "
            f"(next expected offset {expected})"
        )
    if offset > expected:
        return (
            f"out-of-order chunk: offset {offset}, next expected offset {expected} "
            f"(a chunk is missing or was reordered)"
        )
    if offset + size > end:
        where = (
            f"the declared {total}-byte payload"
            if piece is None
            else f"its piece [{piece.offset}, {piece.end})"
        )
        return f"chunk at offset {offset} of {size} bytes runs past {where}"
    later = ranges.next_start(offset)
    if later is not None and later < offset + size:
        return f"duplicated chunk: bytes from offset {later} were already received"
    return None


class UploadBytes:
    """The received bytes of one upload in ``path`` (and its range log), resumed from disk.

    Parameters
    ----------
    path
        The ``.part`` file; its range log is ``path`` with the suffix ``.ranges``.
    total_bytes, digest
        What the manifest declares for the whole payload.
    parts
        The manifest's parts (a multi-node site's update, ``wire.payload_parts``): each is
        checked against its own digest, read back from the file once every byte is in.
    """

    def __init__(
        self,
        path: Path,
        total_bytes: int,
        digest: bytes,
        parts: tuple[PayloadPart, ...] = (),
        reuse: Callable[[Path], bool] | None = None,
    ) -> None:
        self.total_bytes, self.expected_digest, self.parts = total_bytes, digest, parts
        self.log = RangeLog(path.with_suffix(".ranges"))
        new = not self.log.exists() and not path.exists()
        self.ranges = ReceivedRanges(self._restore(path))
        # The end of each range a record of this coordinator's holds -> (record, its start):
        # the next chunk of a stream grows its record instead of adding one.
        self._records: dict[int, tuple[int, int]] = {}
        spans = self.ranges.spans
        reused = new and reuse is not None and self._reuse(path, reuse)
        # Nothing past the last range received (a reused file's stale bytes are written over).
        self.file = PartFile(path, spans[-1][1] if spans else 0, keep_pages=reused)
        self._lock = threading.Lock()
        self._hasher = Hasher()
        self.hashed = 0  # the hash covers bytes [0, hashed)
        self._hash_from_file(self.ranges.run_end(0))

    def _restore(self, path: Path) -> list[tuple[int, int]]:
        """The ranges a coordinator before this one received (none for a new upload)."""
        total = self.total_bytes
        if self.log.exists():
            ranges = self.log.load()
            size = path.stat().st_size if path.exists() else 0
            if all(0 <= s < e <= min(total, size) for s, e in ranges):
                return ranges
            self.log.reset()  # not this payload's, or its file was cut: start it again
            path.unlink(missing_ok=True)
            return []
        size = path.stat().st_size if path.exists() else 0
        if size > total:  # written in order by an older coordinator, and not this payload
            path.unlink()
            size = 0
        if size:
            self.log.append(0, size)
        return [(0, size)] if size else []

    def _reuse(self, path: Path, reuse: Callable[[Path], bool]) -> bool:
        """A spare file as the new upload's ``.part``, its (empty) range log made first."""
        self.log.create()
        return reuse(path)

    def _hash_from_file(self, end: int) -> None:
        with open(self.file.path, "rb") as f:
            f.seek(self.hashed)
            while self.hashed < end:
                block = f.read(min(READ_BACK, end - self.hashed))
                if not block:
                    raise ChunkError(f"{self.file.path.name} ends at {self.hashed} of {end}")
                self._hasher.update(block)
                self.hashed += len(block)

    @property
    def received(self) -> int:
        """Bytes received in order from the start: where a stream of the whole payload goes on."""
        with self._lock:
            return self.ranges.run_end(0)

    def resume_at(self, piece: Piece | None) -> int:
        """Where a stream carrying ``piece`` (None: the whole payload) goes on."""
        with self._lock:
            return self.ranges.resume_at(piece or Piece(0, self.total_bytes))

    def spans(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self.ranges.spans)

    @property
    def complete(self) -> bool:
        with self._lock:
            return self.ranges.covers(self.total_bytes)

    def add(self, piece: Piece | None, offset: int, data) -> None:
        """Write one chunk of a stream carrying ``piece`` at its offset; ``ChunkError`` if it
        is not the chunk that stream must send next. Chunks of one upload are written one at
        a time (its streams share the file's length, which a failed write is cut back to)."""
        n = len(data)
        with self._lock:
            problem = chunk_refusal(self.ranges, piece, self.total_bytes, offset, n)
            if problem:
                raise ChunkError(problem)
            # Written first: the ranges (and the hash) then only cover bytes the file took.
            before = self.file.length
            self.file.write_at(offset, data)
            try:
                self._record(offset, n)
            except OSError:
                self.file.cut_back(before)  # the chunk is not recorded: it is sent again
                raise
            self.ranges.add(offset, offset + n)
            if offset == self.hashed:
                self._hasher.update(data)
                self.hashed += n

    def _record(self, offset: int, n: int) -> None:
        """Put the chunk's range in the log: its stream's record grown, or a new one."""
        if offset in self._records:
            record, start = self._records.pop(offset)
            self.log.extend(record, start, offset + n - start)
        else:
            record, start = self.log.append(offset, n), offset
        self._records[offset + n] = (record, start)

    def finish(self) -> None:
        """Raise unless every byte arrived and the payload's digest matches; what was not
        hashed on arrival is read back from the file."""
        with self._lock:
            covered, complete = self.ranges.covered(), self.ranges.covers(self.total_bytes)
        if not complete:
            raise ChunkError(f"truncated payload: {covered} of {self.total_bytes} bytes received")
        with self._lock:
            if self.parts:
                digest = file_digest(self.file.path, self.total_bytes, self.parts)
            else:
                self._hash_from_file(self.total_bytes)
                digest = self._hasher.copy().digest()
        if digest != self.expected_digest:
            raise ChunkError("payload digest mismatch: the data was corrupted in flight")
        self.file.fit(self.total_bytes)

    @property
    def broken(self) -> bool:
        return self.file.broken or self.log.broken

    @property
    def closed(self) -> bool:
        return self.file.closed

    def close(self) -> None:
        self.file.close()
        self.log.close()
