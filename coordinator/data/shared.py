"""Shared-data mode (pretraining): data units, backup copies, first commit wins.

One of the two data modes behind the coordinator's data-mode interface (the other is
``coordinator.data.federated``). The decisions are pure and live elsewhere: which unit goes where
and whether a commit counts in ``ledger.DataLedger``, when a straggler's unit gets a backup copy in
``speculation.plan_backups``, when the round closes in ``rounds.decide_close`` (asked about units
instead of sites). This module wires them to the round: it assigns units when a round opens,
plans backups on each tick, queues the ``cancel_unit`` commands for the losing copies, and hands
uncommitted units back to the ledger when the round closes. Updates are summed in unit order.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

from coordinator.data.ledger import DataLedger, LedgerError
from coordinator.data.speculation import SpeculationOptions, plan_backups
from coordinator.records import Admission, ClosedRound, Refused, UpdateKey
from coordinator.round.rules import (
    RoundOptions,
    RoundState,
    UpdateRefused,
    admit_round,
    decide_close,
    record_update,
    waiting_reason,
)

log = logging.getLogger("isthmus.coordinator")


class SharedData:
    kind = "shared"
    admits_latecomers = False  # idle sites get backup copies instead

    def __init__(self, ledger: DataLedger, options: SpeculationOptions) -> None:
        self.ledger = ledger
        self.options = options
        self.commit_times: dict[str, float] = {}  # unit -> seconds after the round opened
        self.cancels: dict[str, set[str]] = {}  # site -> units another copy of won

    @classmethod
    def from_meta(cls, meta: dict, options: SpeculationOptions) -> SharedData:
        ledger = DataLedger.from_dict(meta["ledger"]) if "ledger" in meta else DataLedger()
        return cls(ledger, options)

    # ---- the round ------------------------------------------------------------------------

    def round_opened(self, round: RoundState, post) -> None:
        """Units for the round that just opened (again after a restart: the same ones)."""
        assignment = self.ledger.assign_round(round.number, sorted(round.participants))
        self.commit_times = {}
        post("units_assigned", round=round.number, units=assignment)
        log.info(
            "round %d data units: %s",
            round.number,
            ", ".join(f"{s}={u}" for s, u in sorted(assignment.items())),
        )

    def slots(self, round: RoundState) -> list[str]:
        """Fold order: the round's units by index, whichever copy commits each."""
        return self.ledger.units_in(round.number)

    def slot_of(self, key: UpdateKey) -> str | None:
        return key.unit

    def task_for(self, round: RoundState, site: str) -> tuple[bool, str]:
        """The unit ``site`` should train now in the open round ("" when none)."""
        if round.opened_at is None or round.closed:
            return False, ""
        if self.ledger.open_round_number() != round.number:
            return False, ""
        for unit in self.ledger.units_of(round.number, site):
            if self.ledger.committed_by(unit) is None:
                return True, unit
        return False, ""

    def close_view(self, round: RoundState, live: set[str]) -> tuple[RoundState, set[str]]:
        """The open round seen as units, for ``decide_close``: a unit is a participant, it is
        received once committed, and live while a responsive site holds it."""
        if round.opened_at is None:
            return round, live
        units = self.ledger.units_in(round.number)
        received = {u: round.received.get(u, 1.0) for u in units if self.ledger.committed_by(u)}
        alive = {u for u in units if set(self.ledger.holders(round.number, u)) & live}
        return replace(round, participants=frozenset(units), received=received), alive

    def waiting_reason(
        self, now, round: RoundState, live: set[str], opts: RoundOptions, grace=None
    ):
        if round.opened_at is None:
            return waiting_reason(now, round, live, opts)
        view, alive = self.close_view(round, live)
        decision = decide_close(now, view, alive, opts, grace)
        missing = self.ledger.uncommitted(round.number)
        if decision.act or not missing or "deadline passed" in decision.reason:
            return decision.reason
        where = [f"{u} at {'/'.join(self.ledger.holders(round.number, u))}" for u in missing]
        return f"waiting on {len(missing)} data unit(s): {', '.join(where)}"

    def speculate(self, now: float, round: RoundState, members, post) -> bool:
        """Give straggling units backup copies on idle sites; True if any were given."""
        if round.opened_at is None or round.closed or not self.options.enabled:
            return False
        uncommitted = self.ledger.uncommitted(round.number)
        if not uncommitted:
            return False
        live, suspected = members.responsive(now), set(members.suspected)
        holders = {u: self.ledger.holders(round.number, u) for u in uncommitted}
        busy = {s for hs in holders.values() for s in hs}
        progress = {
            site: int(rec.progress.get("inner_step", 0))
            for site, rec in members.sites.items()
            if rec.progress and rec.progress.get("round") == round.number
        }
        gone = suspected | {s for hs in holders.values() for s in hs if s not in live}
        idle = live - busy - suspected
        times = dict(self.commit_times)
        backups = plan_backups(
            now, round.opened_at, holders, times, progress, gone, idle, self.options
        )
        for b in backups:
            self.ledger.add_backup(round.number, b.unit, b.site)
            post("backup", round=round.number, unit=b.unit, site=b.site, reason=b.reason)
            log.warning(
                "round %d: backup copy of %s to %s (%s)", round.number, b.unit, b.site, b.reason
            )
        return bool(backups)

    def take_cancels(self, site: str) -> list[str]:
        return sorted(self.cancels.pop(site, set()))

    def has_cancels(self, site: str) -> bool:
        return bool(self.cancels.get(site))

    def round_closed(self, closed: ClosedRound, post) -> list[str]:
        back = self.ledger.close_round(closed.number)
        if back:
            log.warning(
                "round %d closed without units %s: they go to a later round", closed.number, back
            )
        # Queued cancels stay: a losing copy hears on its next call even after the close.
        return back

    # ---- updates --------------------------------------------------------------------------

    def admit(
        self,
        round: RoundState,
        site: str,
        round_number: int,
        unit: str,
        counted: Collection[UpdateKey],
    ) -> Admission:
        """Refuse a push for a unit the site does not hold, or one committed already."""
        try:
            admit_round(round, round_number)
        except UpdateRefused as exc:
            raise Refused(exc.code, str(exc)) from exc
        if not unit:
            raise Refused(
                "invalid",
                f"shared-data mode: an update names its data unit; got none for round "
                f"{round_number}",
            )
        try:
            held = unit in self.ledger.units_of(round_number, site)
        except LedgerError as exc:
            raise Refused("invalid", str(exc)) from exc
        if not held:
            raise Refused(
                "invalid", f"site {site!r} holds no unit {unit[:20]!r} in round {round_number}"
            )
        done = self.ledger.committed_by(unit)
        if done is not None:
            raise Refused(
                "duplicate",
                f"unit {unit} was already committed by {done[1]} in round {done[0]}; "
                "this copy is not counted",
                committed_by=done[1],
            )
        return Admission(UpdateKey(site, unit=unit), round_number, round.number)

    def recheck(
        self, round: RoundState, admission: Admission, counted: Collection[UpdateKey]
    ) -> Admission:
        key = admission.key
        return self.admit(round, key.site, admission.storage_round, key.unit, counted)

    def record(self, round: RoundState, key: UpdateKey, weight: float, now: float, post):
        """Commit the unit (first copy wins) and tell the other copies to stop."""
        if not self.ledger.commit(round.number, key.unit, key.site):
            done = self.ledger.committed_by(key.unit)
            raise Refused(
                "duplicate", f"unit {key.unit} was already committed by {done[1]}", done[1]
            )
        self.commit_times[key.unit] = now - (round.opened_at or now)
        for loser in self.ledger.losers(round.number, key.unit):
            self.cancels.setdefault(loser, set()).add(key.unit)
            post("unit_cancelled", round=round.number, unit=key.unit, site=loser)
            log.info(
                "round %d: %s committed by %s; cancelling the copy at %s",
                round.number,
                key.unit,
                key.site,
                loser,
            )
        return record_update(round, key.unit, weight, now)

    def replay(self, round: RoundState, key: UpdateKey, weight: float) -> RoundState:
        """Commit a spooled unit of the round in flight again after a restart (same site)."""
        if key.site not in self.ledger.holders(round.number, key.unit):
            self.ledger.add_backup(round.number, key.unit, key.site)
        self.ledger.commit(round.number, key.unit, key.site)
        self.commit_times[key.unit] = 0.0
        return record_update(round, key.unit, weight)

    def readmit(self, round: RoundState, key: UpdateKey) -> None:
        """A spooled copy of ``key.unit`` was lost at a restart, so replay left the unit
        uncommitted: the site that sent it holds it again (it was a backup copy the
        checkpointed ledger does not know of) and may send it again; first commit wins."""
        try:
            if self.ledger.committed_by(key.unit) is not None:
                return
            if key.site not in self.ledger.holders(round.number, key.unit):
                self.ledger.add_backup(round.number, key.unit, key.site)
        except LedgerError as exc:  # not a unit of this round: nobody is asked for it
            log.warning(
                "round %d: lost update %s is not asked for again: %s", round.number, key.label, exc
            )

    # ---- persistence ----------------------------------------------------------------------

    def meta(self) -> dict:
        return {"ledger": self.ledger.to_dict()}

    def units_of(self, round: RoundState, site: str) -> list[str]:
        if self.ledger.open_round_number() != round.number:
            return []
        return self.ledger.units_of(round.number, site)
