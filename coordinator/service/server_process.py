"""The lock a coordinator's process holds on its state folder for as long as it serves."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from coordinator.persist.local_store import StoreError


def lock_state_dir(state_dir: Path):
    """Hold an exclusive lock on the state folder for as long as the returned file is open.

    Two coordinators on one state folder would write over each other's checkpoints and spool;
    the second one is refused here. The kernel drops the lock when the process dies, so a
    coordinator killed with -9 never leaves a stale lock behind.
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        f = open(state_dir / "lock", "a+")  # noqa: SIM115 - kept open while serving
    except OSError as exc:
        raise StoreError(f"cannot use state folder {state_dir}: {exc.strerror}") from exc
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise StoreError(
            f"state folder {state_dir} is in use by another coordinator ({holder}); "
            "stop that one first, or give this job another job.state_dir"
        ) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f
