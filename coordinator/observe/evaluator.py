"""The evaluation hook's own thread: off the round's critical path.

The close pipeline hands over each published theta (``submit``); it returns at once. The worker
loads theta into one ``nn.Module`` built at start by the job's model factory (torch's global
generator left as it was) and calls the hook. Theta's buffers are never written once published,
so a pending evaluation holds a reference, not a copy; at most ``MAX_PENDING`` wait, and past
that the oldest waiting one is skipped (reported), so a slow hook costs memory of a few models
at most and never slows the rounds. The hook sees its own module: whatever it does to it leaves
theta and the checkpoints alone.

A hook that raises, or returns something that is not metrics, stops evaluating and is
reported once (``on_failed``): the coordinator then stops the job with that message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from coordinator.model_source import ModelConfig, build_module
from coordinator.observe.evaluation import (
    Evaluation,
    EvaluationConfig,
    EvaluationError,
    checked_metrics,
    is_due,
    load_hook,
)

log = logging.getLogger("isthmus.coordinator")
MAX_PENDING = 2


@dataclass(frozen=True)
class Reports:
    """Where outcomes go (the core: log, status, event log, the job's fatal state)."""

    done: Callable[[Evaluation], None]
    failed: Callable[[int, str], None]
    skipped: Callable[[int, str], None]


class Evaluator:
    """Runs ``[evaluation] fn`` on the due versions of theta, one at a time, in order."""

    def __init__(
        self, cfg: EvaluationConfig, model: ModelConfig, total_rounds: int, reports: Reports
    ) -> None:
        self.cfg, self.total_rounds, self.reports = cfg, total_rounds, reports
        self.hook = load_hook(cfg.fn)
        with torch.random.fork_rng(devices=[]):  # the factory seeds the global generator
            self.model = build_module(model)
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, Mapping[str, torch.Tensor]]] = deque()
        self._busy = False
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="evaluation", daemon=True)
        self._thread.start()

    def submit(self, version: int, theta: Mapping[str, torch.Tensor]) -> bool:
        """Queue theta of ``version`` if it is due; returns whether it was queued."""
        if not is_due(version, self.cfg.every_rounds, self.total_rounds):
            return False
        with self._cond:
            if self._stopped:
                return False
            self._queue.append((version, theta))
            dropped = self._queue.popleft()[0] if len(self._queue) > MAX_PENDING else None
            self._cond.notify_all()
        if dropped is not None:
            self.reports.skipped(dropped, f"{MAX_PENDING} newer versions wait; the hook is slow")
        return True

    def idle(self) -> bool:
        """Nothing waiting and nothing running (or evaluation stopped)."""
        with self._cond:
            return self._stopped or (not self._queue and not self._busy)

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: self._stopped or (not self._queue and not self._busy), timeout
            )

    def close(self) -> None:
        """Stop: what waits is dropped; a hook already running finishes on its own."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._queue)
                if self._stopped:
                    return
                version, theta = self._queue.popleft()
                self._busy = True
            try:
                outcome = self._evaluate(version, theta)
            except EvaluationError as exc:
                with self._cond:
                    stopped = self._stopped
                if not stopped:  # reported while still busy: the job cannot end meanwhile
                    self.reports.failed(version, str(exc))
                with self._cond:
                    self._stopped, self._busy = True, False
                    self._queue.clear()
                    self._cond.notify_all()
                return
            del theta
            with self._cond:
                stopped = self._stopped
            if not stopped:  # after close the coordinator's log is gone: nothing to report to
                self.reports.done(outcome)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _evaluate(self, version: int, theta: Mapping[str, torch.Tensor]) -> Evaluation:
        started = time.monotonic()
        spec = self.cfg.fn
        try:
            self.model.load_state_dict(dict(theta), strict=True)
            result = self.hook(self.model, version)
        except Exception as exc:  # the user's own code
            raise EvaluationError(
                f"evaluation {spec!r} failed on theta_{version}: {type(exc).__name__}: {exc}"
            ) from exc
        metrics = checked_metrics(f"{spec!r} on theta_{version}", result)
        return Evaluation(version, metrics, round(time.monotonic() - started, 4))
