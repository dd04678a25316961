"""A superseded theta file, written over by the fetch after next.

The agent fetches every theta_{r+1} into a file in shared memory that the trainers map. A new
file each round means a new model's worth of shared-memory pages, which the kernel zeroes as
the fetch first touches them (and, on a virtual machine that hands freed memory back to its
host, first gets back from the host): a profile of an agent at 50 M parameters put 7.7% of its
CPU in zeroing the theta file's new pages alone. So the file theta_{r+1} supersedes is kept
here rather than deleted, and theta_{r+2} is fetched into it, in place.

Only when no process maps it: the trainers map theta_r until they load theta_{r+1}, and a
file written over under a mapping would change what they read. :func:`mapped_anywhere` looks
for the file's inode in every process's memory maps (``/proc/<pid>/maps``, a few milliseconds);
a spare still mapped is deleted instead and the fetch makes a new file, as before. Whatever
was in the spare is never read: the fetch writes every byte of the new theta and checks its
digest.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

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
        deleted) when there is none or some process still maps it."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or mapped_anywhere(st.st_dev, st.st_ino):
            with contextlib.suppress(OSError):  # a folder there stays: never written into
                self.path.unlink()
            return False
        os.replace(self.path, dest)
        return True


def mapped_anywhere(device: int, inode: int) -> bool:
    """Whether any process whose maps this one may read maps the file ``(device, inode)``.
    Those it may not read are other users': the trainers run as the agent's user."""
    want = f"{os.major(device):02x}:{os.minor(device):02x} {inode} "
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile, or another user's
        if want in maps:
            return True
    return False
