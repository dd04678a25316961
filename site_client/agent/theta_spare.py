"""A superseded theta file, written over by the fetch after next.

The agent fetches every theta_{r+1} into a file in shared memory that the trainers map. A new
file each round means a new model's worth of shared-memory pages, which the kernel zeroes as
the fetch first touches them (and, on a virtual machine that hands freed memory back to its
host, first gets back from the host): a profile of an agent at 50 M parameters put 7.7% of its
CPU in zeroing the theta file's new pages alone. So the file theta_{r+1} supersedes is kept
here rather than deleted, and theta_{r+2} is fetched into it, in place.

Only when no process maps it: the trainers map theta_r until they load theta_{r+1}, and a
file written over under a mapping would change what they read.
``wire.file_reuse.mapped_anywhere`` looks for the file's inode in every process's memory maps
(``/proc/<pid>/maps``, a few milliseconds); a spare still mapped is removed instead and the
fetch makes a new file, as before. Whatever was in the spare is never read: the fetch writes
every byte of the new theta and checks its digest.
"""

from __future__ import annotations

import os
from pathlib import Path

from wire.file_reuse import mapped_anywhere, take_spare

SPARE_NAME = "theta-spare.safetensors"


class ThetaSpare:
    """At most one superseded theta file of the agent's, in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / SPARE_NAME

    def keep(self, superseded: Path) -> None:
        """Keep ``superseded`` (a theta no longer offered) as the spare, replacing any other."""
        try:
            os.replace(superseded, self.path)
        except FileNotFoundError:
            pass
        except OSError:  # the spare's name is taken by something else: no spare
            superseded.unlink(missing_ok=True)

    def place(self, dest: Path) -> bool:
        """Move the spare to ``dest`` for the next fetch to write over; False (and the spare
        removed) when there is none or some process still maps it."""
        return take_spare(self.path, dest, mapped_anywhere)
