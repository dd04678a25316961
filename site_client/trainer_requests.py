"""What the trainers ask the site agent, over ``site_client.local_ipc`` (JSON lines).

Rank 0 of the site's trainers drives the rounds; every rank says ``hello``.

``hello``
    -> ``site``, ``run_dir``, ``shm_dir``, ``job_config`` (TOML text).
``wait_round`` (``timeout`` seconds, default the agent's poll)
    -> ``{"ready": false}``, or ``ready`` with the next task not yet done: ``round``,
    ``data_unit`` (``""`` in federated mode), ``version``, ``theta_path``, ``theta_hash``,
    ``inner_steps``, ``total_rounds``, ``finished`` (the job is over: ``theta_path`` is the
    final theta and there is no task).
``progress`` (``round``, ``data_unit``, ``step``, ``loss``)
    -> ``{"cancel": true}`` once that task's unit was committed by another site (stop, do
    not submit), else ``{}``.
``submit`` (``round``, ``data_unit``, ``path``, ``weight``)
    -> ``{"accepted": true}``, plus ``duplicate`` or ``cancelled`` when the update is not
    wanted (its file is deleted). A task never handed out is an error.
``metrics`` (any numbers)
    -> ``{}``; appended to ``run_dir/metrics.jsonl`` and logged.

A reply ``{"error": ...}`` means the request was refused (``IpcError`` in the trainer).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from site_client.local_ipc import Handler
from site_client.tasks import TaskBook, task_of
from wire.proto import isthmus_pb2 as pb

if TYPE_CHECKING:
    from site_client.agent import AgentConfig

log = logging.getLogger("isthmus.site")


class TrainerRequests:
    """The agent's answers to its trainers; mixed into ``SiteAgent``, whose state they read."""

    cfg: AgentConfig
    cond: threading.Condition
    info: pb.RoundInfo | None
    ready: dict | None
    book: TaskBook
    progress: pb.Progress
    error: str | None
    job_config: str
    _warned_steps = False

    def trainer_handlers(self) -> dict[str, Handler]:
        return {
            "hello": self._hello,
            "wait_round": self._wait_round,
            "progress": self._progress,
            "submit": self._submit,
            "metrics": self._metrics,
        }

    def _hello(self, req: dict) -> dict:
        return {
            "site": self.cfg.site,
            "run_dir": str(self.cfg.run_dir),
            "shm_dir": str(self.cfg.shm_dir),
            "job_config": self.job_config,
        }

    def _offer(self) -> dict | None:
        """The task for the trainers now, with its theta (called under ``cond``)."""
        r, info = self.ready, self.info
        if r is None:
            return None
        if r["finished"]:
            return {**r, "data_unit": ""}
        task = task_of(info)
        if task is None or info.version != r["version"] or self.book.done(task):
            return None
        steps = r["inner_steps"]
        if self.cfg.inner_steps and self.cfg.inner_steps != steps:
            if not task[1]:
                steps = self.cfg.inner_steps
            elif not self._warned_steps:
                # A unit is H steps of the shared stream wherever it runs, or copies differ.
                log.warning(
                    "[%s] --inner-steps %d ignored in shared-data mode: units are %d steps",
                    self.cfg.site,
                    self.cfg.inner_steps,
                    steps,
                )
                self._warned_steps = True
        return {**r, "round": task[0], "data_unit": task[1], "inner_steps": steps}

    def _wait_round(self, req: dict) -> dict:
        timeout = float(req.get("timeout", self.cfg.wait_poll_s))
        with self.cond:
            if not self.cond.wait_for(
                lambda: self.error or self._offer() is not None, timeout=timeout
            ):
                return {"ready": False}
            if self.error:
                raise RuntimeError(self.error)
            offer = self._offer()
            if not offer["finished"]:
                self.book.issue((offer["round"], offer["data_unit"]), offer["version"])
            return {"ready": True, **offer}

    def _progress(self, req: dict) -> dict:
        task = (int(req["round"]), str(req.get("data_unit", "")))
        with self.cond:
            self.progress.round = task[0]
            self.progress.inner_step = int(req["step"])
            self.progress.train_loss = float(req.get("loss", 0.0))
            self.progress.phase = "training"
            return {"cancel": True} if self.book.is_cancelled(task) else {}

    def _submit(self, req: dict) -> dict:
        task = (int(req["round"]), str(req.get("data_unit", "")))
        with self.cond:
            outcome = self.book.submit(task, req["path"], float(req.get("weight", 1.0)))
            if outcome != "accepted":
                Path(req["path"]).unlink(missing_ok=True)
                return {"accepted": True, outcome: True}
            self.cond.notify_all()
        return {"accepted": True}

    def _metrics(self, req: dict) -> dict:
        record = {k: v for k, v in req.items() if k != "op"}
        record["site"] = self.cfg.site
        with open(self.cfg.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        shown = "  ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in record.items()
            if k != "site"
        )
        log.info("[%s] %s", self.cfg.site, shown)
        return {}
