"""The coordinator's state: one typed record, guarded by the core's lock.

The parts (membership, the data mode, intake, the round driver, the close pipeline) each keep
their own bookkeeping; this is what they share about the job as a whole: the round, theta as
served, the updates counted so far, and the counters status shows.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from coordinator.intake.spool import SpooledUpdate
from coordinator.intake.spool_check import Wanted
from coordinator.observe.evaluation import Evaluation
from coordinator.records import ClosedRound, PinnedClose, Published, UpdateKey
from coordinator.round.accumulate import StreamingMean
from coordinator.round.rules import RoundState
from wire.theta import ThetaBuffer


@dataclass
class CoordinatorState:
    """Attributes
    ----------
    round
        The round now waiting, open or being closed (``rounds.RoundState``).
    theta, published
        theta_r in its buffer, and what Fetch serves (theta_r, and the delta to it).
    slots, running_sum
        The open round's fold order and its running sum (None when updates are combined at
        close: robust aggregation, strategies that take every update).
    accepted, norms
        Updates counted in the open round (late ones folded in included) and, with
        ``aggregation.clip_norm``, their L2 norms measured on arrival.
    committing
        Updates between their last check and their durable commit; the round does not close
        meanwhile.
    last_closed
        The round closed last (late updates are judged against it).
    wanted, pinned
        Set at start-up: updates of the open round whose spooled copy was damaged (their
        sites are asked to send them again), and the recorded close the round must repeat
        when its record named one of them (``coordinator.round.recovery``).
    evaluation
        The newest server-side evaluation of theta (``[evaluation]``), for status.
    """

    round: RoundState
    theta: ThetaBuffer
    published: Published
    wake: threading.Condition
    total_rounds: int
    slots: list[str] = field(default_factory=list)
    running_sum: StreamingMean | None = None
    accepted: dict[UpdateKey, SpooledUpdate] = field(default_factory=dict)
    norms: dict[UpdateKey, float] = field(default_factory=dict)
    committing: set[UpdateKey] = field(default_factory=set)
    last_closed: ClosedRound | None = None
    wanted: Wanted = field(default_factory=Wanted)
    pinned: PinnedClose | None = None
    last_close_reason: str = ""
    fatal: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    rejections: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    watchers: dict[str, int] = field(default_factory=dict)  # WaitRound call count per site
    evaluation: Evaluation | None = None

    @property
    def finished(self) -> bool:
        return self.round.number >= self.total_rounds

    def changed(self) -> None:
        """Wake whoever waits on the state (the round driver, WaitRound calls); under the lock."""
        self.wake.notify_all()
