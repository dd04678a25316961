"""theta_r on disk: served, stepped and checkpointed from one file instead of process memory.

The coordinator's memory holds the running sum (which becomes theta_{r+1}) and the strategy's
state. theta_r itself, once published, lives in a file under ``state_dir/theta/``, a safetensors
file laid out as ``wire.theta.ThetaBuffer`` (byte for byte the checkpoint's
``theta.safetensors``, so the checkpoint links it rather than writing it again):

- Fetch streams read it with ``pread``: the bytes pass through the page cache, which the kernel
  may reclaim, never through the process's own pages (``ThetaSource``).
- Everything else (the outer step, a strategy's hooks, shapes) sees tensors that are views of a
  copy-on-write mapping of the file. ``release`` hands a tensor's pages back
  (``MADV_DONTNEED``): clean pages of a file mapping are read again from the file if needed, so
  the outer step keeps one tensor of theta_r resident at a time (a compressed downlink's encode
  reads theta_r whole, and gives the pages back after).

The file is a cache, not state: it is not fsynced on its own (the checkpoint that links it is),
and every start writes it afresh from the checkpoint it resumes from.
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from coordinator.persist.spare_files import take_spare
from wire.digest import payload_digest
from wire.safetensors_io import read_header, write_tensors
from wire.tensors import Manifest
from wire.theta import ThetaBuffer

PAGE = mmap.PAGESIZE


class ThetaFile:
    """One published theta in its file: ``theta`` (views of a private mapping) and ``read``."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        """Open ``path`` (written by ``write_theta_file``) laid out as ``manifest``."""
        self.path = Path(path)
        layout, self.data_start, _ = read_header(self.path)
        if layout.entries != manifest.entries:
            raise ValueError(f"{self.path}: not laid out like theta")
        self.manifest = manifest
        self._fd = os.open(self.path, os.O_RDONLY)
        # Closed when the last holder goes (a Fetch stream of an older version may still read
        # it after a newer file took over): an explicit close could hand the number to another
        # file while a stream still reads through it.
        weakref.finalize(self, os.close, self._fd)
        size = self.data_start + manifest.total_bytes
        self._map = mmap.mmap(self._fd, size, access=mmap.ACCESS_COPY) if size else None
        raw = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else None
        data = raw[self.data_start :] if raw is not None else torch.empty(0, dtype=torch.uint8)
        self.theta = ThetaBuffer.on(manifest, data)
        self._spans = {e.name: (e.offset, e.nbytes) for e in manifest.entries}

    def read(self, offset: int, size: int) -> bytes:
        """``size`` payload bytes from ``offset`` (fewer at the end), through the page cache."""
        return os.pread(self._fd, size, self.data_start + offset)

    def release(self, name: str | None = None) -> None:
        """Give back the resident pages of tensor ``name`` (None: of all of theta). theta is
        never written, so its pages are clean and come back from the file when read again."""
        if self._map is None:
            return
        offset, size = self._spans[name] if name is not None else (0, self.manifest.total_bytes)
        start = (self.data_start + offset) // PAGE * PAGE
        end = min(len(self._map), self.data_start + offset + size)
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def write_theta_file(
    folder: Path, version: int, tensors: Mapping[str, torch.Tensor], spare: Path | None = None
) -> ThetaFile:
    """Write ``tensors`` (theta's buffer, or a checkpoint's mapped tensors) to
    ``folder/theta-VERSION.safetensors`` and open it, over the file ``spare`` where there is
    one nothing here uses (``coordinator.persist.spare_files``). Written under a temporary
    name and renamed, so an open file is always whole."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"theta-{version:08d}.safetensors"
    tmp = folder / f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        reuse = spare is not None and take_spare(spare, tmp)
        manifest = write_tensors(tmp, tensors, fsync=False, reuse=reuse)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ThetaFile(path, manifest)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` with ``source``'s bytes: a hard link where the file system allows (``source``
    is never written again), else a copy made by the kernel."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def link_theta_file(folder: Path, version: int, saved: Path) -> ThetaFile:
    """A checkpoint's ``theta.safetensors`` (never written again) as the theta file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"theta-{version:08d}.safetensors"
    path.unlink(missing_ok=True)
    link_or_copy(saved, path)
    manifest, _, _ = read_header(path)
    return ThetaFile(path, manifest)


def clear_theta_files(folder: Path, keep: Path | None = None) -> None:
    """Remove every theta file in ``folder`` but ``keep`` (open ones stay readable until
    closed: Linux frees an unlinked file with its last descriptor)."""
    if not folder.is_dir():
        return
    for old in folder.iterdir():
        if old != keep and old.name.startswith(("theta-", ".theta-")):
            old.unlink(missing_ok=True)


MAX_BLOCKS = 4096


def block_size(total: int) -> int:
    """Blocks of whole MiB, at most ``MAX_BLOCKS`` of them for ``total`` bytes."""
    mib = 1 << 20
    return max(mib, -(-total // (MAX_BLOCKS * mib)) * mib)


class ThetaSource:
    """What a whole-theta Fetch streams: theta's buffer until its file is written, then the
    file. A stream asks for each chunk as it goes, so once ``to_file`` is called no stream
    keeps the buffer alive."""

    def __init__(self, payload: memoryview) -> None:
        self._memory: memoryview | None = payload
        self._file: ThetaFile | None = None
        self.size = len(payload)
        self._blocks: tuple[int, list[bytes]] | None = None
        self._blocks_lock = threading.Lock()
        self._blocks_asked = False

    def block_digests(self) -> tuple[int, list[bytes]]:
        """``(block_bytes, digests)``: the digest of each block of the payload, taken on the
        first ask (only hosts that fetch ranges ask) and kept."""
        self._blocks_asked = True
        with self._blocks_lock:
            if self._blocks is None:
                size = block_size(self.size)
                digests = [payload_digest(data) for _, data in self.chunks(size)]
                self._blocks = (size, digests)
            return self._blocks

    @property
    def blocks_asked(self) -> bool:
        """Whether this payload's block digests were asked for (or are being taken)."""
        return self._blocks_asked

    def take_block_digests_soon(self) -> threading.Thread:
        """Take the block digests now, in the background: the next theta of a job whose
        hosts fetch ranges, so that its first ranged fetch finds them ready, not a hash pass
        of the whole payload on a gRPC thread."""
        self._blocks_asked = True
        worker = threading.Thread(target=self.block_digests, name="theta-blocks", daemon=True)
        worker.start()
        return worker

    @classmethod
    def of_file(cls, file: ThetaFile) -> ThetaSource:
        source = cls(memoryview(b""))
        source.size = file.manifest.total_bytes
        source.to_file(file)
        return source

    def to_file(self, file: ThetaFile) -> None:
        if file.manifest.total_bytes != self.size:
            raise ValueError("the theta file is not the payload being served")
        self._file, self._memory = file, None

    @property
    def in_memory(self) -> bool:
        return self._memory is not None

    def __len__(self) -> int:
        return self.size

    def chunks(
        self, chunk_bytes: int, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, bytes]]:
        """``(offset, bytes)`` pieces of the bytes ``[start, stop)`` (``stop`` None: the end)."""
        stop = self.size if stop is None else stop
        if not 0 <= start <= stop <= self.size:
            raise ValueError(
                f"resume offset {start} or end {stop} outside the {self.size}-byte payload"
            )
        for offset in range(start, stop, chunk_bytes):
            yield offset, self._read(offset, min(chunk_bytes, stop - offset))

    def _read(self, offset: int, size: int) -> bytes:
        # A copy, never a view: a stream suspended between chunks (flow control, a slow site)
        # must not keep theta's buffer alive once the file serves.
        memory, file = self._memory, self._file
        if memory is not None:
            return bytes(memory[offset : offset + size])
        return file.read(offset, size)
