"""The round driver: on each tick, what the clock and the state say should happen.

It expires leases, updates suspicion, opens the waiting round, admits latecomers past a deadline,
gives stragglers' data units backup copies, and decides whether the open round closes, all by
the pure rules of ``rounds`` (and the data mode's view of them). It runs under the core's lock
and does no I/O: the small round file to write, and the close to carry out, come back in the
``Tick`` for the core to do once the lock is released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from coordinator.intake.spool import SpooledUpdate
from coordinator.members.membership import Membership
from coordinator.records import FatalError, PinnedClose, UpdateKey
from coordinator.round.accumulate import StreamingMean, fold_order
from coordinator.round.rules import (
    GRACE_HISTORY,
    RoundState,
    admit_latecomers,
    arrival_spread,
    decide_close,
    grace_window,
    open_round,
)
from coordinator.state import CoordinatorState
from strategies import Strategy, StrategyError
from strategies.base import call_hook

log = logging.getLogger("isthmus.coordinator")


@dataclass(frozen=True)
class CloseOrder:
    """A round the driver decided to close: its updates in the order they are summed."""

    round: RoundState  # closed
    keys: tuple[UpdateKey, ...]
    updates: tuple[SpooledUpdate, ...]
    reason: str
    slots: tuple[str, ...] = ()
    running_sum: StreamingMean | None = None
    clipped: dict[str, float] = field(default_factory=dict)
    replay: bool = False
    after_pin: str = ""  # a pinned round's close: "kept" (as recorded) or "released"
    downlink_rung: int | None = None  # a replay's: the adaptive downlink's rung, as recorded


@dataclass(frozen=True)
class Tick:
    order: CloseOrder | None = None
    round_file: tuple[int, dict] | None = None  # (round, record) to write to the spool


class RoundDriver:
    def __init__(
        self,
        state: CoordinatorState,
        members: Membership,
        data,
        opts,
        strategy: Strategy,
        post: Callable,
        new_sum: Callable[[list[str]], StreamingMean | None],  # holding what is counted
    ) -> None:
        self.state, self.members, self.data, self.opts = state, members, data, opts
        self.strategy, self.post, self.new_sum = strategy, post, new_sum
        # The arrival spreads of the rounds every participant delivered to (``grace_window``).
        self.spreads: list[float] = []

    def grace(self) -> float | None:
        """How long a round with its quorum waits for the rest now (``rules.grace_window``)."""
        return grace_window(self.spreads, self.opts)

    def tick(self, now: float) -> Tick:
        """Advance membership and the round by one step of the rules."""
        s = self.state
        for site in self.members.expire(now):
            self.post("lease_expired", site=site)
            log.warning("lease of site %s expired", site)
        self._suspicion(now)
        live = self.members.candidates(now)
        round_file = None
        was_open = s.round.opened_at is not None
        s.round = open_round(now, s.round, live, self.opts)
        if not was_open and s.round.opened_at is not None:
            round_file = self._opened(now)
        before = s.round.participants
        if self.data.admits_latecomers:
            s.round = admit_latecomers(now, s.round, live, self.opts)
        if s.round.participants != before:
            added = sorted(s.round.participants - before)
            s.slots = [*s.slots, *added]
            if s.running_sum is not None:
                s.running_sum.expect(s.slots)
            round_file = (s.round.number, self.round_record(now))
            log.warning(
                "round %d is past its deadline below quorum; admitting %s",
                s.round.number,
                ", ".join(added),
            )
        return Tick(self._maybe_close(now), round_file)

    def _suspicion(self, now: float) -> None:
        change = self.members.update_suspicion(now)
        for site, phi in change.suspected:
            self.post("suspected", site=site, phi=round(phi, 2))
            log.warning("site %s suspected (phi %.1f): not waiting for it", site, phi)
        for site in change.recovered:
            log.info("site %s is heartbeating again", site)

    def _opened(self, now: float) -> tuple[int, dict]:
        s = self.state
        self.data.round_opened(s.round, self.post)
        s.slots = self.data.slots(s.round)
        s.running_sum = self.new_sum(s.slots)
        self.post("round_open", round=s.round.number, sites=sorted(s.round.participants))
        try:
            call_hook(self.strategy, "begin_round", s.round.number, s.theta.tensors)
        except StrategyError as exc:
            s.fatal = f"round {s.round.number} cannot start: {exc}"
            log.error("stopping: %s; the last checkpoint is unchanged", s.fatal)
            raise FatalError(s.fatal) from exc
        log.info("round %d open with %s", s.round.number, ", ".join(sorted(s.round.participants)))
        return s.round.number, self.round_record(now)

    def round_record(self, now: float) -> dict:
        """Who is in the open round, in fold order, and since when (wall clock: monotonic time
        does not survive a restart), so a restarted coordinator keeps the round's deadline."""
        s = self.state
        opened_wall = time.time() - (now - s.round.opened_at)
        return {
            "participants": sorted(s.round.participants),
            "slots": list(s.slots),
            "opened_wall": opened_wall,
        }

    def _maybe_close(self, now: float) -> CloseOrder | None:
        s = self.state
        if s.round.opened_at is None or s.committing:
            return None  # an update is being made durable: it will count, or be refused
        pin = s.pinned
        if pin is not None and not pin.released:
            step = pinned_step(now, s.round.opened_at + self.opts.deadline_s, pin, s.accepted)
            if step == "wait":
                return None  # no backup copies either: only the recorded keys are taken
            if step == "close":
                s.pinned = None
                log.info(
                    "round %d: its recorded updates are back; closing as decided", s.round.number
                )
                return self._order(list(pin.keys), pin.reason, "kept")
            s.pinned = replace(pin, released=True)
            log.error(
                "round %d: past its deadline without the lost update(s) %s; it closes by the "
                "ordinary rules, so theta_%d may differ from the one served before the restart",
                s.round.number,
                ", ".join(k.label for k in pin.keys if k not in s.accepted),
                s.round.number + 1,
            )
        responsive = self.members.responsive(now)
        if self.data.speculate(now, s.round, self.members, self.post):
            s.changed()
        view, alive = self.data.close_view(s.round, responsive)
        decision = decide_close(now, view, alive, self.opts, self.grace())
        if not decision.act:
            return None
        spread = arrival_spread(view)
        everyone = not (view.participants & alive) - view.received.keys()
        if spread is not None and everyone:  # a grace cut it short: its spread says too little
            self.spreads = [*self.spreads[-GRACE_HISTORY:], spread]
        released, s.pinned = s.pinned is not None, None
        return self._order(self.fold_order(), decision.reason, "released" if released else "")

    def _order(self, keys: list[UpdateKey], reason: str, after_pin: str = "") -> CloseOrder:
        s = self.state
        s.round = replace(s.round, closed=True)
        return CloseOrder(
            s.round,
            tuple(keys),
            tuple(s.accepted[k] for k in keys),
            reason,
            tuple(s.slots),
            s.running_sum,
            {k.label: n for k, n in s.norms.items() if k in s.accepted},
            after_pin=after_pin,
        )

    def fold_order(self) -> list[UpdateKey]:
        """The counted updates in the order they are summed (see
        ``coordinator.round.accumulate``)."""
        s = self.state
        slot_of = {k: self.data.slot_of(k) for k in s.accepted}
        filled = {slot: k for k, slot in slot_of.items() if slot is not None}
        return fold_order(s.slots, filled, [k for k, slot in slot_of.items() if slot is None])


def pinned_step(now: float, deadline: float, pin: PinnedClose, counted) -> str:
    """What a pinned round (``records.PinnedClose``) does now: ``"close"`` once every recorded
    update is counted again, ``"release"`` past its deadline without them (the ordinary rules
    take over), else ``"wait"``."""
    if all(k in counted for k in pin.keys):
        return "close"
    return "release" if now >= deadline else "wait"
