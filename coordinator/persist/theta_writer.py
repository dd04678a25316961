"""Which theta file is current, and writing the next one off the round's critical path.

theta_{r+1} is served from memory the moment it is published; this writes its file on the fold
worker (``coordinator.round.accumulate``), then hands the served theta over to the file, so that the
next round's sum is allocated only once theta_{r+1}'s buffer is gone.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from coordinator.persist.disk import until_written
from coordinator.persist.theta_file import (
    ThetaFile,
    clear_theta_files,
    link_theta_file,
    write_theta_file,
)
from wire.theta import ThetaBuffer

log = logging.getLogger("isthmus.coordinator")


class ThetaFiles:
    """The published theta's file: written on the fold worker once theta_{r+1} is served from
    memory, so that the next round's sum is allocated only after theta_{r+1}'s buffer is gone.

    Parameters
    ----------
    folder
        ``state_dir/theta``; emptied at start.
    worker
        The single thread that folds updates (``coordinator.round.accumulate``): a file job runs
        before any fold of the round that opens after it.
    stopping
        Gives up waiting for disk space (``coordinator.persist.disk.until_written``).
    spare
        A pruned checkpoint's theta file, written over by the next theta's file where nothing
        uses it (``coordinator.persist.spare_files``).
    """

    def __init__(
        self,
        folder: Path,
        worker: ThreadPoolExecutor,
        stopping: threading.Event,
        let_go: Callable[[torch.Tensor], None] | None = None,
        spare: Path | None = None,
    ):
        self.folder, self._worker, self._stopping = Path(folder), worker, stopping
        self._spare = spare
        # Given theta's buffer once its file serves it (``coordinator.round.spare_buffer``).
        self._let_go = let_go
        self.current: ThetaFile | None = None
        self._pending: Future | None = None

    def start(
        self, version: int, tensors: Mapping[str, torch.Tensor], saved: Path | None = None
    ) -> ThetaFile:
        """The file of the theta a start resumes from: ``saved`` (a checkpoint's theta file,
        linked) or ``tensors`` written now."""
        clear_theta_files(self.folder)
        write = functools.partial(write_theta_file, self.folder, version, tensors)
        if saved is not None:
            write = functools.partial(link_theta_file, self.folder, version, saved)
        self.current = until_written(
            write,
            f"writing theta_{version} to {self.folder}",
            self._stopping,
        )
        return self.current

    def submit(self, version: int, theta: ThetaBuffer, then: Callable[[ThetaFile], None]) -> Future:
        """Write ``theta`` (digested) on the worker, then call ``then(file)`` there; the
        future's result is the file. theta_r's own buffer (nothing counted) is its file."""
        current = self.current
        if current is not None and theta.buffer.data_ptr() == current.theta.buffer.data_ptr():

            def same() -> ThetaFile:  # theta_{r+1} is theta_r: its file serves it already
                then(current)
                return current

            self._pending = self._worker.submit(same)
            return self._pending

        held = [theta]  # the job lets go of theta's views before handing its buffer on

        def job() -> ThetaFile:
            served = held.pop()
            file = until_written(
                functools.partial(
                    write_theta_file, self.folder, version, served.tensors, self._spare
                ),
                f"writing theta_{version} to {self.folder}",
                self._stopping,
            )
            self.current = file  # the previous one closes with its last reader
            then(file)
            clear_theta_files(self.folder, keep=file.path)
            buffer = served.buffer
            del served
            if self._let_go is not None:
                self._let_go(buffer)
            return file

        del theta
        self._pending = self._worker.submit(job)
        self._pending.add_done_callback(_report)
        return self._pending

    def wait(self) -> None:
        """Return once the last submitted file is written (its failure is the checkpoint's
        to report: theta stays served from memory meanwhile)."""
        if self._pending is not None:
            self._pending.exception()

    def idle(self) -> bool:
        """No file being written (what waits for it, such as an evaluation, has been told)."""
        return self._pending is None or self._pending.done()

    def release(self) -> None:
        """Give back the resident pages of the current theta (after a step read it whole)."""
        if self.current is not None:
            self.current.release()


def _report(done: Future) -> None:
    exc = done.exception()
    if exc is not None:
        log.error("writing theta's file failed: %s; it is served from memory", exc)
