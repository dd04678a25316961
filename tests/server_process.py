"""Stopping a server process a test started, reading the end of its log, and the scratch
folder it writes its own files in: shared by the coordinator, etcd and SeaweedFS fixtures."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def stop_process(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not gone within ``grace_s``; nothing if it is
    not running."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def log_tail(path: Path, n: int) -> str:
    """The last ``n`` lines of the log at ``path`` (``(no log)`` if it cannot be read)."""
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return "(no log)"


def scratch_env(folder: Path) -> dict[str, str]:
    """This process's environment with ``folder/tmp`` (made here) as the child's temporary
    folder: what it writes there (a Go binary's ``os.TempDir()``, its sockets) stays with the
    test's files, never in the machine's /tmp."""
    scratch = Path(folder) / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(scratch), "TMP": str(scratch), "TEMP": str(scratch)}
