"""What a site agent knows, shared by its threads under one condition variable.

The agent's parts (the trainer channel, the WAN worker, the heartbeat and round-watch loops in
``site_client.agent.site_agent``) read and change this state only while holding ``cond``, and notify
it when they change something another part may be waiting for. Taking in what the coordinator says
(a round, a cancelled data unit) happens here, so the rules for dropping work that is no longer
wanted live in one place.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from site_client.agent.metrics import ComputeClock, TransferStats
from site_client.agent.scratch import default_shm_dir
from site_client.agent.tasks import Task, TaskBook, Upload, describe, task_of, unit_index
from site_client.transfer.theta import GlobalState
from wire.proto import isthmus_pb2 as pb

log = logging.getLogger("isthmus.site")
# default_shm_dir lives in site_client.agent.scratch; importable from here as before.
__all__ = ["AgentConfig", "AgentState", "Offer", "default_shm_dir"]


@dataclass(frozen=True)
class AgentConfig:
    site: str
    run_dir: Path
    shm_dir: Path
    inner_steps: int | None = None  # None: the job's H
    wait_poll_s: float = 1.0
    checkpoint_url: str = ""  # "": the trainers' checkpoints go to checkpoint_dir
    checkpoint_dir: str = ""  # "": run_dir/checkpoints
    node: int = 0  # a multi-node site: this host's node rank (0 holds the lease)
    nodes: int = 1


@dataclass(frozen=True)
class Offer:
    """theta_version as published to the trainers: the file they map, its hash."""

    round: int
    version: int
    theta_path: str
    theta_hash: str
    finished: bool
    inner_steps: int
    total_rounds: int

    def as_reply(self) -> dict:
        return asdict(self)


class AgentState:
    def __init__(self, site: str) -> None:
        self.site = site
        self.cond = threading.Condition()
        self.info: pb.RoundInfo | None = None  # what the coordinator asks for now
        self.ready: Offer | None = None  # theta published to the trainers
        self.held: GlobalState | None = None  # theta as fetched: the base of the next delta
        self.book = TaskBook()
        self.compute = ComputeClock()  # the trainers' time in tasks (site_client.agent.metrics)
        self.transfers = TransferStats()
        self.progress = pb.Progress(phase="idle")
        self.error: str | None = None
        self.stopping = False
        # Why the coordinator drained this site ("" while it is not): the site finishes what
        # it owes, then its trainers and the agent leave (``owes_work``).
        self.drained = ""
        self.health: pb.HealthReport | None = None  # the trainers' newest probe

    def fail(self, message: str) -> None:
        log.error("[%s] %s", self.site, message)
        with self.cond:
            self.error = message
            self.cond.notify_all()

    def take_round(self, info: pb.RoundInfo) -> None:
        """Adopt ``info`` (called under ``cond``); a malformed data unit stops the site."""
        try:
            unit_index(info.data_unit)
        except ValueError as exc:
            self.error = f"the coordinator asked for round {info.round}: {exc}"
            log.error("[%s] %s", self.site, self.error)
        self.info = info
        book = self.book
        left = [t for t in book.issued if t.unit and t.round < info.round and not book.done(t)]
        what = self.let_go(left, book.advance(info.round), None)
        if what:
            log.info("[%s] round %d is open: %s", self.site, info.round, "; ".join(what))
        self.cond.notify_all()

    def cancel(self, unit: str) -> None:
        """Another copy of ``unit`` was committed first (called under ``cond``)."""
        training = [t for t in self.book.issued if t.unit == unit and not self.book.done(t)]
        known = self.info.round if self.info is not None else 0
        what = self.let_go(training, *self.book.cancel(unit, known))
        log.info(
            "[%s] unit %s was committed by another site first: %s",
            self.site,
            unit,
            "; ".join(what) or "nothing of it here",
        )
        self.cond.notify_all()

    def heard(self, info: pb.RoundInfo, commands) -> None:
        """Take in a reply from the coordinator: the task asked for now, the units cancelled,
        whether the site is drained (every reply says so while it is; once heard, it holds)."""
        with self.cond:
            self.take_round(info)
            drain = ""
            for command in commands:
                kind = command.WhichOneof("kind")
                if kind == "cancel_unit":
                    self.cancel(command.cancel_unit)
                elif kind == "drain":
                    drain = command.drain or "no reason given"
            self.take_drain(drain)

    def take_drain(self, reason: str) -> None:
        """Adopt the drain state (called under ``cond``). Drained in shared-data mode, the
        units still in training are handed back: the trainers stop them, another site trains
        them. Updates already handed over are pushed all the same."""
        if self.drained or not reason:
            # Latched: replies of the heartbeat and the round watch may arrive out of order,
            # and trainers told to leave are gone. An undrained site joins again when started.
            return
        self.drained = reason
        training = {t.unit for t in self.book.issued if t.unit and not self.book.done(t)}
        for unit in sorted(training):
            self.let_go(*self._hand_back(unit))
        log.warning(
            "[%s] drained by the coordinator (%s): %s",
            self.site,
            reason,
            f"handing back {', '.join(sorted(training))}, then leaving"
            if training
            else "finishing the current task and pushing what it owes, then leaving",
        )
        self.cond.notify_all()

    def _hand_back(self, unit: str) -> tuple[list[Task], list[Upload], Upload | None]:
        training = [t for t in self.book.issued if t.unit == unit and not self.book.done(t)]
        known = self.info.round if self.info is not None else 0
        return (training, *self.book.cancel(unit, known))

    def owes_work(self) -> bool:
        """Whether the trainers have a task to finish before a drained site leaves: the
        federated task asked for now, until it is handed over (called under ``cond``)."""
        task = task_of(self.info)
        return task is not None and not task.unit and not self.book.done(task)

    def let_go(self, training: list[Task], dropped: list[Upload], aborted: Upload | None):
        """Delete the files of updates no longer wanted; say what stopped, for the log."""
        for upload in dropped:
            upload.discard_files()
        what = [f"stopping the trainers on {describe(t)}" for t in training]
        what += [f"dropped the queued update of {describe(u.task)}" for u in dropped]
        if aborted is not None:
            what.append(f"withdrawing the push of {describe(aborted.task)}")
        return what
