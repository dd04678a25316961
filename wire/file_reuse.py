"""Files written over in place rather than made anew, and the checks that make it safe.

Three parties keep a file that is no longer needed as a *spare* for the next file of its kind
(a site's checkpoint, the agent's theta, the coordinator's theta and strategy state): writing
over pages the page cache still holds costs a fraction of new ones (``docs/benchmarks/sync.md``).
A spare is taken only when it is a regular file of its own (never a link, whose target a write
would reach) that nothing still reads; whatever else is found in its place is removed.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

InUse = Callable[[int, int], bool]  # (device, inode) -> still read by someone


def overwritable(path: Path) -> bool:
    """Whether ``path`` is a regular file of its own to write over in place."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_any(path: Path) -> None:
    """Remove ``path`` whatever it is (a folder with what it holds, a link, a file)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def take_spare(spare: Path, dest: Path, in_use: InUse | None = None) -> bool:
    """Move ``spare`` to ``dest`` to be written over; False when there is none, when it is
    not a regular file or ``in_use`` says it is still read (then it is removed)."""
    try:
        st = os.lstat(spare)
    except OSError:  # none, or its folder is not one
        return False
    try:
        if not stat.S_ISREG(st.st_mode) or (in_use and in_use(st.st_dev, st.st_ino)):
            remove_any(spare)
            return False
        os.replace(spare, dest)
    except OSError:
        return False
    return True


def _maps_line(device: int, inode: int) -> str:
    """How ``/proc/<pid>/maps`` names a mapping of the file ``(device, inode)``."""
    return f"{os.major(device):02x}:{os.minor(device):02x} {inode} "


def mapped_anywhere(device: int, inode: int) -> bool:
    """Whether any process whose maps this one may read maps the file ``(device, inode)``.
    Those it may not read are other users' (a site's trainers run as its agent's user)."""
    want = _maps_line(device, inode)
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


def in_use_here(device: int, inode: int) -> bool:
    """Whether this process has the file ``(device, inode)`` open or mapped."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own among them)
            continue
        if (st.st_dev, st.st_ino) == (device, inode):
            return True
    with open("/proc/self/maps") as f:
        return _maps_line(device, inode) in f.read()


class SparePool:
    """Up to ``size`` spares of one kind in ``folder``, for files that outlive their use by
    different spans (an update is held mapped for a resend until the round after next): the
    next file takes the oldest spare nothing reads, and a spare still read waits its turn."""

    def __init__(self, folder: Path, size: int = 3) -> None:
        self.folder, self.size = Path(folder), size

    def _spares(self) -> list[Path]:
        try:
            if not stat.S_ISDIR(os.lstat(self.folder).st_mode):
                return []
            entries = list(os.scandir(self.folder))
        except OSError:
            return []
        found = []
        for e in entries:
            try:
                found.append((e.stat(follow_symlinks=False).st_mtime, e.path))
            except OSError:  # taken meanwhile
                continue
        return [Path(p) for _, p in sorted(found)]

    def keep(self, path: Path) -> None:
        """Keep ``path`` (no longer needed under its name) as a spare, or remove it when the
        pool is full or cannot be made."""
        try:
            if not stat.S_ISDIR(os.lstat(self.folder).st_mode):
                remove_any(self.folder)  # a link or a file in the pool's place is never used
                self.folder.mkdir()
        except FileNotFoundError:
            self.folder.mkdir(exist_ok=True)
        except OSError:
            Path(path).unlink(missing_ok=True)
            return
        if len(self._spares()) >= self.size or not overwritable(Path(path)):
            Path(path).unlink(missing_ok=True)
            return
        try:
            os.replace(path, self.folder / f"{uuid.uuid4().hex}.spare")
        except OSError:
            Path(path).unlink(missing_ok=True)

    def take(self, dest: Path, in_use: InUse) -> bool:
        """Move the oldest spare that ``in_use`` says nothing reads to ``dest``; False when
        there is none (what is not a regular file is removed on the way)."""
        for spare in self._spares():
            try:
                st = os.lstat(spare)
                if not stat.S_ISREG(st.st_mode):
                    remove_any(spare)
                    continue
                if in_use(st.st_dev, st.st_ino):
                    continue
                os.replace(spare, dest)
            except OSError:  # taken by another writer meanwhile
                continue
            return True
        return False
