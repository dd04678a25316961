"""Loaded by the benchmark's child processes only (its folder leads their PYTHONPATH): each
Python thread takes its name as its native one, so ``/proc/PID/task/TID/comm`` tells the
coordinator's fold worker from its checkpoint writer and its gRPC handlers. Python 3.11 does
not name native threads itself. Nothing else changes."""

import ctypes
import threading

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: names stay as they are
    _prctl = None
_PR_SET_NAME = 15
_inner = threading.Thread._bootstrap_inner


def _named(self):
    if _prctl is not None:
        _prctl(_PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
    _inner(self)


threading.Thread._bootstrap_inner = _named
