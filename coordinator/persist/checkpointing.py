"""The coordinator's checkpoints, written in the background, one at a time and in order.

theta_{r+1} is published as soon as it is recoverable (the previous checkpoint plus the round's
fsynced spool and close record determine it), so its own checkpoint is off the round's critical
path: this thread writes it, then runs what must wait for it (the round's spool can go, the
event log's live file may move to a segment). The next outer step waits for the previous write
(``wait``): the built-in strategies update their state in place, and that state is what is
being written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from coordinator.persist.disk import until_written
from coordinator.persist.local_store import Checkpoint, CheckpointStore, StoreError

log = logging.getLogger("isthmus.coordinator")


class CheckpointWriter:
    def __init__(self, store: CheckpointStore, stopping: threading.Event) -> None:
        self.store = store
        self.stopping = stopping
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._last: Future | None = None

    def submit(
        self, ckpt: Checkpoint | Callable[[], Checkpoint], then: Callable[[float, Path], None]
    ) -> Future:
        """Write ``ckpt`` (or what it returns, called on this thread: it may wait for theta's
        file); once it is durable, run ``then(seconds, folder)`` (same thread)."""

        def write() -> None:
            nonlocal ckpt
            if callable(ckpt):
                ckpt = ckpt()
            started = time.monotonic()
            # A full disk stalls the job here (the next outer step waits for this write)
            # rather than stopping it: the previous checkpoint stays as it was.
            folder = until_written(
                lambda: self.store.save(ckpt),
                f"writing the checkpoint of round {ckpt.round}",
                self.stopping,
            )
            then(time.monotonic() - started, folder)

        self._last = self._thread.submit(write)
        self._last.add_done_callback(_report)
        return self._last

    def wait(self) -> None:
        """Return once every submitted checkpoint is written; re-raise a failed one."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        try:
            self.wait()
        except (OSError, StoreError) as exc:  # the spool and the close record still
            log.error("stopping without the last checkpoint: %s", exc)  # determine that round
        finally:
            self._thread.shutdown(wait=True)


def _report(done: Future) -> None:
    exc = done.exception()
    if exc is not None:
        log.error("writing a checkpoint failed: %s", exc)
