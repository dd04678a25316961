"""Files of a pruned checkpoint, written over by the coordinator's next ones.

Every round the coordinator writes theta_{r+1}'s file (which its checkpoint then links) and the
strategy's state (Nesterov momentum: as large as theta) into new files, while pruning frees a
checkpoint's worth. New files mean new page-cache pages; on a virtual machine that hands freed
memory back to its host, those cost several times the write itself (``bench.dataplane`` put the
coordinator's fold thread, which writes theta's file, at 1.2 CPU s per GB served). So pruning
keeps the newest pruned checkpoint's strategy file, and its theta file where nothing else links
it, in ``checkpoints/.spare``; the next write of either goes over the spare in place.

A spare is taken only when this process neither holds it open nor maps it (a stream still
serving an old theta, or state mapped at start), looked up by inode in ``/proc/self``; else it
is deleted and the write makes a new file, as before. Nothing is read from a spare: every byte
of the new file is written, and a checkpoint's files are checked against its record when read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from wire import file_reuse

SPARE = ".spare"  # under ``checkpoints/``: hidden, never taken for a checkpoint
STRATEGY = "strategy.safetensors"
THETA = "theta.safetensors"


def spare_folder(state_dir: Path) -> Path:
    return Path(state_dir) / "checkpoints" / SPARE


def prune_keeping_spares(doomed: list[Path], spare: Path, parking: Path) -> None:
    """Delete the checkpoint folders ``doomed`` (oldest first), keeping the newest one's
    strategy file, and its theta file when no other name links it, in ``spare``. Each is
    renamed to ``parking`` (a name the store clears at start) before anything is taken out."""
    for i, folder in enumerate(doomed):
        try:
            os.replace(folder, parking)
        except OSError:  # pruned as before, without a spare
            shutil.rmtree(folder, ignore_errors=True)
            continue
        if i == len(doomed) - 1:
            for name in (STRATEGY, THETA):
                _keep(parking / name, spare, name)
        shutil.rmtree(parking, ignore_errors=True)


def _keep(source: Path, spare: Path, name: str) -> None:
    """``source`` as the spare ``name`` if nothing else links it; nothing kept (and the
    checkpoint's pruning unharmed) where the spare folder cannot take it."""
    try:
        if os.lstat(source).st_nlink != 1:  # the theta folder or a newer checkpoint holds it
            return
        spare.mkdir(exist_ok=True)
        os.replace(source, spare / name)
    except OSError:
        return


def take_spare(spare: Path, dest: Path) -> bool:
    """Move ``spare`` to ``dest`` to be written over; False (and the spare removed) when there
    is none, it is no regular file, or this process still has it open or mapped."""
    return file_reuse.take_spare(spare, dest, file_reuse.in_use_here)
