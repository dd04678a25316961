"""Shared-data mode on the coordinator: data units, backup copies, first commit wins.

A mixin of ``CoordinatorCore`` (it works under the core's lock). The decisions are pure and
live elsewhere: which unit goes where and whether a commit counts in ``ledger.DataLedger``,
when a straggler's unit gets a backup copy in ``speculation.plan_backups``, when the round
closes in ``rounds.decide_close`` (here asked about units instead of sites). This module
wires them to the round: it assigns units when a round opens, plans backups on each tick,
queues the ``cancel_unit`` commands that heartbeat replies carry to the losing copies, and
hands uncommitted units back to the ledger when the round closes.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from coordinator.ledger import DataLedger, LedgerError
from coordinator.records import Refused
from coordinator.rounds import RoundState, UpdateRefused, admit_round, decide_close
from coordinator.speculation import plan_backups

log = logging.getLogger("isthmus.coordinator")


class SharedData:
    @property
    def shared(self) -> bool:
        return self.ledger is not None

    def _restore_ledger(self, meta: dict) -> None:
        self.ledger = DataLedger.from_dict(meta["ledger"]) if "ledger" in meta else DataLedger()
        self.commit_times: dict[str, float] = {}
        self.cancels: dict[str, set[str]] = {}

    def _assign_units(self) -> None:
        """Units for the round that just opened (again after a restart: the same ones)."""
        r = self.round
        assignment = self.ledger.assign_round(r.number, sorted(r.participants))
        self.commit_times = {}
        self.events.append("units_assigned", round=r.number, units=assignment)
        log.info(
            "round %d data units: %s",
            r.number,
            ", ".join(f"{s}={u}" for s, u in sorted(assignment.items())),
        )

    def unit_for(self, site: str) -> str:
        """The unit ``site`` should train now in the open round ("" when none)."""
        r = self.round
        if r.opened_at is None or r.closed or self.ledger.open_round_number() != r.number:
            return ""
        for unit in self.ledger.units_of(r.number, site):
            if self.ledger.committed_by(unit) is None:
                return unit
        return ""

    def take_cancels(self, site: str) -> list[str]:
        return sorted(self.cancels.pop(site, set()))

    def _admit_unit(self, site: str, round_number: int, unit: str) -> None:
        """Refuse a push for a unit the site does not hold, or one committed already."""
        try:
            admit_round(self.round, round_number)
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
            )

    def _commit_unit(self, site: str, unit: str, now: float) -> None:
        r = self.round
        if not self.ledger.commit(r.number, unit, site):
            done = self.ledger.committed_by(unit)
            raise Refused("duplicate", f"unit {unit} was already committed by {done[1]}")
        self.commit_times[unit] = now - (r.opened_at or now)
        for loser in self.ledger.losers(r.number, unit):
            self.cancels.setdefault(loser, set()).add(unit)
            self.events.append("unit_cancelled", round=r.number, unit=unit, site=loser)
            log.info(
                "round %d: %s committed by %s; cancelling the copy at %s",
                r.number,
                unit,
                site,
                loser,
            )

    def _speculate(self, now: float, live: set[str], suspected: set[str]) -> None:
        r = self.round
        if r.opened_at is None or r.closed or not self.cfg.speculation.enabled:
            return
        uncommitted = self.ledger.uncommitted(r.number)
        if not uncommitted:
            return
        holders = {u: self.ledger.holders(r.number, u) for u in uncommitted}
        busy = {s for hs in holders.values() for s in hs}
        progress = {
            site: int(rec.progress.get("inner_step", 0))
            for site, rec in self.sites.items()
            if rec.progress and rec.progress.get("round") == r.number
        }
        gone = suspected | {s for hs in holders.values() for s in hs if s not in live}
        backups = plan_backups(
            now,
            r.opened_at,
            holders,
            dict(self.commit_times),
            progress,
            gone,
            live - busy - suspected,
            self.cfg.speculation,
        )
        for b in backups:
            self.ledger.add_backup(r.number, b.unit, b.site)
            self.events.append("backup", round=r.number, unit=b.unit, site=b.site, reason=b.reason)
            log.warning(
                "round %d: backup copy of %s to %s (%s)", r.number, b.unit, b.site, b.reason
            )
            self.wake.notify_all()

    def _unit_view(self, live: set[str]) -> tuple[RoundState, set[str]]:
        """The open round seen as units, for ``decide_close``: a unit is a participant, it is
        received once committed, and live while a responsive site holds it."""
        r = self.round
        units = self.ledger.units_in(r.number)
        received = {u: r.received.get(u, 1.0) for u in units if self.ledger.committed_by(u)}
        alive = {u for u in units if set(self.ledger.holders(r.number, u)) & live}
        return replace(r, participants=frozenset(units), received=received), alive

    def _units_waiting_reason(self, now: float, live: set[str]) -> str:
        r = self.round
        view, alive = self._unit_view(live)
        decision = decide_close(now, view, alive, self.opts)
        missing = self.ledger.uncommitted(r.number)
        if decision.act or not missing or "deadline passed" in decision.reason:
            return decision.reason
        where = [f"{u} at {'/'.join(self.ledger.holders(r.number, u))}" for u in missing]
        return f"waiting on {len(missing)} data unit(s): {', '.join(where)}"

    def _close_units(self, number: int) -> list[str]:
        back = self.ledger.close_round(number)
        if back:
            log.warning("round %d closed without units %s: they go to a later round", number, back)
        # Queued cancels stay: a losing copy hears on its next heartbeat even after the close.
        return back
