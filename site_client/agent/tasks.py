"""What the site agent has been asked to train, and what became of it.

A *task* is ``(round, data_unit)``. In federated mode the unit is ``""`` (the site trains on its
own data) and there is one task per round. In shared-data mode the coordinator names a unit
``"u<k>"`` of one shared data stream; after the site delivered it, the same round may come back
with another unit (a backup copy of a straggler's), trained from the same theta_r. A unit
committed first elsewhere is cancelled by a heartbeat command: the site stops training it and
drops its update if not yet delivered. A shared-data task also ends when a later round opens:
its round has closed, so its update can no longer count (an uncommitted unit is handed out
again in a later round, as a new task).

A delivered update is kept, as the very payload that was sent, until the round after next
opens: a restarted coordinator that finds its spooled copy damaged asks for it again
(``RoundInfo.update_wanted``), and only the same bytes give the same theta. Its round may even
have been closed and theta_{r+1} served already (see ``coordinator.round.recovery``), but round r+2
opens only once theta_{r+1}'s checkpoint is durable, so no update is wanted again after that.
The cost is one update's memory (encoded bytes, or the mapping of the trainers' files) held
into the next round.

:class:`TaskBook` is the bookkeeping only (no clock, no I/O, no locking): the agent holds one
under its condition variable and does the file and network work around it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from wire.data_units import UnitError, parse_unit, unit_id
from wire.file_reuse import SparePool
from wire.proto import isthmus_pb2 as pb


class Task(NamedTuple):
    """One round of training on one data unit (``""``: the site's own data)."""

    round: int
    unit: str


def unit_index(unit: str) -> int | None:
    """The stream index ``k`` of ``"u<k>"``, ``None`` for ``""`` (federated mode).

    Raises
    ------
    ValueError
        ``unit`` is neither ``""`` nor ``"u<k>"`` with ``k >= 0``.
    """
    if unit == "":
        return None
    try:
        return parse_unit(unit)
    except UnitError:
        raise ValueError(f"malformed data unit {unit!r}; expected 'u<k>' with k >= 0") from None


def unit_name(index: int | None) -> str:
    """Inverse of :func:`unit_index`; a negative index or ``None`` means no unit."""
    return "" if index is None or index < 0 else unit_id(index)


def task_of(info: pb.RoundInfo | None) -> Task | None:
    """The task ``info`` asks the site to train now, if any."""
    if info is None or info.finished or not info.participant:
        return None
    return Task(int(info.round), info.data_unit)


def describe(task: Task) -> str:
    round_number, unit = task
    return f"round {round_number}" + (f" unit {unit}" if unit else "")


UPDATE_SPARES = "update-spares"


def update_spares(folder: Path) -> SparePool:
    """The spares of update files in the trainers' scratch ``folder``: a new update file is
    the shared memory of an old one written over, not new pages (``wire.file_reuse``)."""
    return SparePool(Path(folder) / UPDATE_SPARES)


@dataclass
class Upload:
    """An update the trainers handed over: the files holding theta_r - theta_local (one per
    trainer rank) and its task.

    ``aborted`` is set (from another thread) when its unit is cancelled while it is pushed;
    the push reads it between chunks. ``durable`` is set once the trainers' checkpoint of the
    task's end is on disk: only then may the update count.
    """

    task: Task
    paths: list[str]
    weight: float
    version: int
    theta_hash: str = ""  # of theta_version, as trained from ("": not known)
    aborted: bool = False
    redo: bool = False  # withdrawn because the trainers restarted: they train the task again
    durable: threading.Event = field(default_factory=threading.Event)
    payload: object | None = None  # as built for its push (``site_client.agent.update_payload``)
    # A multi-node site: this host's part (``site_client.transfer.node.SitePart``) of the
    # payload every node pushes under ``upload_id``.
    part: object | None = None
    upload_id: str | None = None
    early: bool = False  # refused as early: pushed again once its round is open here
    # Late, and folded into this later round (the next of its fragment): pushed once it is open.
    fold_round: int | None = None
    resent: bool = False  # counted before, taken back because the coordinator asked again

    def discard_files(self) -> None:
        """The update's files are no longer needed: each is kept for a later update of the
        trainers to be written over (a held payload keeps its mapping; it is not taken while
        that lasts)."""
        for path in self.paths:
            update_spares(Path(path).parent).keep(Path(path))


@dataclass
class TaskBook:
    """Tasks handed to the trainers, updates waiting to be pushed, tasks finished for good.

    Attributes
    ----------
    issued
        Task -> the theta version it was handed out with and that theta's hash (a submit
        must name one of these tasks).
    pending
        Updates not yet pushed, oldest first; the one being pushed stays here until it ends.
    finished
        Tasks whose update was pushed, dropped by the coordinator or lost to another copy:
        never trained again.
    cancelled
        Unit -> the latest round the site knew of when the cancel came. The cancel covers that
        unit's tasks up to that round, not a later reassignment of the same name.
    open_round
        The latest round the coordinator said is open; shared-data tasks of earlier rounds
        are over.
    pushing
        Whether the first of ``pending`` is being pushed.
    durable
        Tasks whose end the trainers have checkpointed (their update may count).
    delivered
        Updates the coordinator counted, with their payload, kept in case it asks for one
        again; released when the round after next opens, or when another copy of the unit won.
    """

    issued: dict[Task, tuple[int, str]] = field(default_factory=dict)
    pending: dict[Task, Upload] = field(default_factory=dict)
    finished: set[Task] = field(default_factory=set)
    cancelled: dict[str, int] = field(default_factory=dict)
    open_round: int = -1
    pushing: bool = False
    durable: set[Task] = field(default_factory=set)
    delivered: dict[Task, Upload] = field(default_factory=dict)

    def is_cancelled(self, task: Task) -> bool:
        """Whether ``task`` is a shared-data task cancelled or left behind by its round."""
        round_number, unit = task
        return bool(unit) and (
            round_number <= self.cancelled.get(unit, -1) or round_number < self.open_round
        )

    def done(self, task: Task) -> bool:
        """Nothing more to train for ``task``: delivered, handed over, or cancelled."""
        return task in self.finished or task in self.pending or self.is_cancelled(task)

    def issue(self, task: Task, version: int, theta_hash: str = "") -> None:
        self.issued[Task(*task)] = (version, theta_hash)

    def checkpointed(self, task: Task) -> None:
        """The trainers' checkpoint of the end of ``task`` is on disk."""
        task = Task(*task)
        self.durable.add(task)
        if task in self.pending:
            self.pending[task].durable.set()

    def submit(self, task: Task, paths: list[str] | str, weight: float) -> str:
        """Queue the trainers' update for ``task``.

        Returns
        -------
        str
            ``"accepted"``, or why the file is not wanted: ``"duplicate"`` (already handed
            over, e.g. by a trainer that restarted after submitting) or ``"cancelled"``.

        Raises
        ------
        ValueError
            ``task`` was never handed to the trainers.
        """
        task = Task(*task)
        if task in self.finished or task in self.pending:
            return "duplicate"
        if self.is_cancelled(task):
            return "cancelled"
        if task not in self.issued:
            raise ValueError(f"{describe(task)} is not a task this site handed out")
        files = [paths] if isinstance(paths, str) else list(paths)
        upload = Upload(task, files, weight, *self.issued[task])
        if task in self.durable:
            upload.durable.set()
        self.pending[task] = upload
        return "accepted"

    def cancel(self, unit: str, known_round: int) -> tuple[list[Upload], Upload | None]:
        """Cancel ``unit`` in every round up to ``known_round`` (and every task already known).

        Returns
        -------
        dropped, aborted
            Updates of that unit taken off the queue (their files are the caller's to delete),
            and the one being pushed, if any, now marked ``aborted``: another copy won, so it
            cannot count.
        """
        rounds = [t.round for t in (*self.issued, *self.pending) if t.unit == unit]
        self.cancelled[unit] = max(known_round, *rounds, self.cancelled.get(unit, -1))
        for task in [t for t in self.delivered if t.unit == unit]:
            del self.delivered[task]  # another copy counts: ours is never wanted again
        return self._drop(abort=True)

    def advance(self, open_round: int) -> list[Upload]:
        """Round ``open_round`` is open; returns the queued updates of earlier rounds' shared
        tasks, taken off the queue. One being pushed goes on: it may be what closed its round.
        """
        if open_round <= self.open_round:
            return []
        self.open_round = open_round
        for task in [t for t in self.delivered if t.round < open_round - 1]:
            del self.delivered[task]
        return self._drop(abort=False)[0]

    def _drop(self, abort: bool) -> tuple[list[Upload], Upload | None]:
        for task in [t for t in self.issued if self.is_cancelled(t)]:
            del self.issued[task]
        dropped: list[Upload] = []
        aborted = None
        for i, (task, upload) in enumerate(list(self.pending.items())):
            if not self.is_cancelled(task):
                continue
            if i == 0 and self.pushing:
                if abort:
                    upload.aborted = True
                    aborted = upload
            else:
                dropped.append(self.pending.pop(task))
                self.finished.add(task)
        return dropped, aborted

    def trainers_restarted(self) -> list[Upload]:
        """The launcher restarted the trainers: updates whose task's end never reached disk
        are withdrawn, since the new trainers train those tasks again from their newest
        checkpoint (the same bytes: an update counts only with its checkpoint on disk, and
        one held for a checkpoint that was lost would wait for ever). Returns the ones taken
        off the queue (their files are the caller's to delete); one being pushed is marked
        ``aborted`` and ``redo``, and ``end_upload`` leaves its task to be trained again."""
        dropped = []
        for i, (task, upload) in enumerate(list(self.pending.items())):
            if upload.durable.is_set():
                continue
            if i == 0 and self.pushing:
                upload.aborted = upload.redo = True
            else:
                dropped.append(self.pending.pop(task))
        return dropped

    def start_upload(self, info: pb.RoundInfo | None = None) -> Upload | None:
        upload = self.next_upload(info)
        if upload is not None and next(iter(self.pending)) != upload.task:
            # The one pushed is the first of the queue while it is pushed (``_drop``).
            self.pending = {upload.task: upload, **self.pending}
        self.pushing = upload is not None
        return upload

    def end_upload(self, upload: Upload, counted: bool = False) -> None:
        """``upload`` was delivered, refused or given up: its task is finished. A counted one
        is kept (with its ``payload``) in ``delivered``; one withdrawn for the restarted
        trainers (``redo``) is not finished: they hand it over again."""
        self.pending.pop(upload.task, None)
        if upload.redo and not counted:
            self.pushing = False
            return
        self.finished.add(upload.task)
        self.issued.pop(upload.task, None)
        self.pushing = False
        # Sent again, it had counted before, whatever this push's outcome (the request may have
        # been stale, its round closed since): kept in case it is asked for once more.
        if (counted or upload.resent) and upload.payload is not None:
            self.delivered[upload.task] = upload

    def hold(self, upload: Upload) -> None:
        """The push of ``upload`` waits (the coordinator is at an earlier round, or has not
        opened this one yet)."""
        self.pushing = False
        upload.early = True

    def defer(self, upload: Upload, fold_round: int) -> None:
        """``upload`` is late and folds into round ``fold_round``: it waits for that round at
        the back of the queue, so that the updates after it go on time meanwhile."""
        self.pushing = False
        upload.fold_round = fold_round
        self.pending.pop(upload.task, None)
        self.pending[upload.task] = upload

    def next_upload(self, info: pb.RoundInfo | None = None) -> Upload | None:
        """The update to push next: the oldest, or with ``info`` the oldest not waiting for a
        later round to fold into."""
        for upload in self.pending.values():
            if info is None or upload.fold_round is None or folds_now(upload, info):
                return upload
        return None

    def wanted_again(self, info: pb.RoundInfo | None) -> Task | None:
        """The delivered task ``info`` asks for again, if this site still holds its update and
        it was trained from the theta the coordinator serves for its round. A coordinator that
        took over may have closed the round before it differently; the update is then not
        sent, and the round goes on without it by its rules (deadline, quorum)."""
        task = task_of(info)
        if task is None or not info.update_wanted or task in self.pending:
            return None
        held = self.delivered.get(task)
        if held is None:
            return None
        if held.theta_hash and info.theta_hash and held.theta_hash != info.theta_hash.hex():
            return None
        return task

    def take_back(self, task: Task) -> Upload | None:
        """Queue the delivered update of ``task`` again, first (it is what the coordinator
        waits for); returns it."""
        if self.pushing or task not in self.delivered:
            return None  # the one being pushed stays first
        upload = self.delivered.pop(task)
        upload.aborted, upload.resent = False, True
        self.finished.discard(task)
        self.pending = {task: upload, **self.pending}
        return upload


def folds_now(upload: Upload, info: pb.RoundInfo) -> bool:
    """Whether a late update waiting for its fold round may go: that round is open (or past:
    the coordinator then refuses it as late, and it is dropped), or the job is over."""
    return bool(info.finished) or info.round >= (upload.fold_round or 0)
