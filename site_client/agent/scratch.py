"""The agent's scratch folder in shared memory, and what a killed agent left there.

Each agent keeps theta (model-sized at real scale) and its trainers' shard files in
``<base>/isthmus-<site>-<pid>`` (``base``: /dev/shm, else /tmp). An agent that stops removes its
folder; one killed by SIGKILL or the OOM killer cannot, and on tmpfs that memory stays taken
until the machine reboots. So a starting agent removes the folders of its own site whose agent
is gone, and says what it freed.

A folder's agent is gone (``is_abandoned``) when no process has the pid in its name, or the
process that has it started at another time than the one recorded in the folder's owner file
(the pid was reused), and no process holds the owner file's lock. The lock is what still shows a
live agent in another pid namespace (a container sharing /dev/shm): a kernel lock goes with its
holder, whatever namespace either side runs in. Folders of other users and symbolic links are
never touched, and removal never follows a link out of the folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("isthmus.site")
OWNER_FILE = ".owner"  # "<pid> <start time>\n", locked by the agent while it runs
_PID = re.compile(r"[1-9][0-9]{0,9}")  # ASCII digits only: str.isdigit takes other scripts


def default_shm_dir(site: str, base: Path | None = None) -> Path:
    """This process's scratch folder for ``site``: in /dev/shm where there is one."""
    if base is None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return Path(base) / f"isthmus-{site}-{os.getpid()}"


def pid_of(name: str, site: str) -> int | None:
    """The pid in a scratch folder's name if it is one of ``site``'s (``isthmus-a-7`` is site
    ``a``'s, ``isthmus-a-b-7`` site ``a-b``'s only), else None."""
    prefix = f"isthmus-{site}-"
    rest = name[len(prefix) :] if name.startswith(prefix) else ""
    return int(rest) if _PID.fullmatch(rest) else None


@dataclass(frozen=True)
class Probe:
    """What was found out about the agent of one folder."""

    alive: bool  # a process has the folder's pid (ours, or another user's)
    start: int | None  # that process's start time now (None: no such process, or unknown)
    recorded: int | None  # the start time the owner file records (None: no readable record)
    held: bool  # the owner file is locked by a live process (or is not a plain file)


def is_abandoned(p: Probe) -> bool:
    """Whether a folder's agent is gone, so that the folder may be removed."""
    if p.held:
        return False
    if not p.alive:
        return True
    # The pid runs: the agent itself, unless it is a later process that was given the pid.
    return p.recorded is not None and p.start is not None and p.recorded != p.start


@dataclass(frozen=True)
class Reclaimed:
    path: Path
    pid: int
    nbytes: int  # space the folder's files took (allocated blocks)


# ---- probing a process and a folder (the edges) ---------------------------------------------


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, not ours to judge
    except OverflowError:
        return False  # beyond any pid the kernel hands out
    return True


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot (field 22 of
    /proc/<pid>/stat), which tells a process from a later one given the same pid."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the name in parentheses may hold spaces
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def probe(folder: Path, pid: int) -> Probe:
    alive = pid_alive(pid)
    start = process_start(pid) if alive else None
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return Probe(alive, start, None, False)  # killed before it wrote one: the pid decides
    except OSError:
        return Probe(alive, start, None, True)  # a link or worse: not ours, keep it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return Probe(alive, start, None, True)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return Probe(alive, start, None, True)
        return Probe(alive, start, _recorded_start(os.read(fd, 64), pid), False)
    finally:
        os.close(fd)  # also lets go of our shared lock


def _recorded_start(record: bytes, pid: int) -> int | None:
    parts = record.split()
    if len(parts) == 2 and parts[0] == str(pid).encode() and parts[1].isdigit():
        return int(parts[1])
    return None


def tree_bytes(folder: Path) -> int:
    """Space taken by the files under ``folder`` (links not followed)."""
    total = 0
    for root, dirs, files in os.walk(folder):
        for name in files + dirs:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


# ---- claiming one's own folder, reclaiming the dead's -----------------------------------------


def claim(folder: Path):
    """Create ``folder``, record this process as its owner and hold the owner file's lock;
    returns the open owner file, to keep open (the lock) while the folder is in use."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    owner = os.fdopen(fd, "r+b")
    for _ in range(50):  # a starting agent's probe holds it for a moment; never longer
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.02)
    else:
        log.warning("%s is locked by another process: two agents share it", folder)
    pid, start = os.getpid(), process_start(os.getpid())
    owner.truncate(0)
    owner.write(f"{pid} {'-' if start is None else start}\n".encode())
    owner.flush()
    return owner


def reclaim_abandoned(base: Path, site: str, keep: Path | None = None) -> list[Reclaimed]:
    """Remove from ``base`` the scratch folders of ``site`` whose agent is gone (not ``keep``,
    this agent's own); logs a warning for each, saying what it freed."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    out = []
    for entry in entries:
        pid = pid_of(entry.name, site)
        if pid is None or (keep is not None and Path(entry.path) == Path(keep)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue  # a symbolic link, or another user's: never ours to follow or remove
        folder = Path(entry.path)
        if not is_abandoned(probe(folder, pid)):
            continue
        nbytes = tree_bytes(folder)
        try:
            shutil.rmtree(folder)  # fd-based on Linux: never follows a link inside
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # another agent of the site was quicker: fine
                log.warning("[%s] could not remove %s, left by a dead agent: %s", site, folder, exc)
            continue
        log.warning(
            "[%s] removed %s, the scratch folder of agent pid %d, which is no longer running: "
            "%.1f MiB (%d bytes) freed",
            site,
            folder,
            pid,
            nbytes / (1 << 20),
            nbytes,
        )
        out.append(Reclaimed(folder, pid, nbytes))
    return out
