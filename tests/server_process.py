"""Stopping a server process a test started, and reading the end of its log: shared by the
coordinator, etcd and SeaweedFS fixtures."""

from __future__ import annotations

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
