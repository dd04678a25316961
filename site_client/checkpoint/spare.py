"""A pruned site checkpoint's data files, written over by the next checkpoint.

A site writes a checkpoint at the end of every task (the optimiser's state: twice the model)
and prunes the oldest. Written into new files, every byte goes into page-cache pages the
kernel has to find first; on the virtual machines of the benchmarks, which hand freed memory
back to their host, that cost 1.0-1.35 CPU s per 400 MB written and fsynced, against
0.06-0.09 s to write the same bytes over a file whose pages are still cached (see
``docs/benchmarks/sync.md``). On any host it saves allocating, and later reclaiming, a
checkpoint's worth of pages per task. So pruning keeps the newest pruned checkpoint's rank
files in ``SPARE``, and each rank's next write moves its own file from there into the
checkpoint being written and writes over it in place (:class:`OverwritingFileSystem`),
cutting it to what was written.

Nothing is read from a spare file: DCP writes every byte of the new one before the manifest
that makes it a checkpoint, and the manifest's digests are taken after. The cost is disk: two
checkpoints and one spare set, as much as there was while a third checkpoint was written.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from wire import file_reuse
from wire.file_reuse import overwritable, remove_any

SPARE = ".spare"  # hidden: never taken for a checkpoint (``local._complete``)
_DATA_SUFFIX = ".distcp"


def keep_spare(directory: Path, doomed: list[Path]) -> None:
    """Delete the checkpoints ``doomed`` (oldest first), keeping the newest one's data files
    as the spare set (replacing the one before)."""
    if not doomed:
        return
    for stale in directory.glob(".*.spare"):  # a pruning cut short
        shutil.rmtree(stale, ignore_errors=True)
    newest = doomed[-1]
    taken = directory / f".{newest.name}.spare"
    try:
        newest.rename(taken)  # out of the complete ones first: a crash leaves no half one
        for p in taken.iterdir():
            if not (p.name.endswith(_DATA_SUFFIX) and overwritable(p)):
                remove_any(p)
        remove_any(directory / SPARE)
        taken.rename(directory / SPARE)
    except OSError:  # no spare this time; the pruning itself goes on
        shutil.rmtree(taken, ignore_errors=True)
        shutil.rmtree(newest, ignore_errors=True)
    for p in doomed[:-1]:
        shutil.rmtree(p)


def take_spare(directory: Path, partial: Path, rank: int) -> None:
    """Move ``rank``'s spare data file, if there is one, into ``partial`` (the checkpoint
    being written) under the name DCP gives that rank's file."""
    name = f"__{rank}_0{_DATA_SUFFIX}"
    # None yet (or of another number of ranks): DCP makes a new file.
    file_reuse.take_spare(directory / SPARE / name, partial / name)


class OverwritingFileSystem(FileSystem):
    """DCP's local file system, except that a file already there is written over in place
    (keeping its cached pages) and cut to what was written when closed."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase]:
        if mode != "wb" or not overwritable(Path(path)):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _CutOnClose(io.FileIO(path, "r+")) as stream:
            yield stream


class _CutOnClose(io.BufferedRandom):
    """A file opened for update whose end is where writing stopped once it is closed."""

    def close(self) -> None:
        if not self.closed:
            end = self.tell()
            if os.fstat(self.fileno()).st_size > end:
                self.truncate(end)
                os.fsync(self.fileno())  # the new length is as durable as the bytes
        super().close()
