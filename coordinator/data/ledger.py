"""Exactly-once bookkeeping of shared data units across rounds.

In shared-data mode (pretraining) one deterministic data stream is cut into units ``u0, u1, ...``
and each participant of a round trains on one of them. A unit may be held by several sites at
once (its primary and speculative backups), but it is committed once: the first accepted push
wins and later pushes of the same unit are refused as duplicates. A unit still uncommitted when
its round closes goes back to the front of the queue, so no unit is lost and none counts twice.

No clock, no I/O: the coordinator persists ``to_dict()`` with its checkpoint and replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wire.data_units import UnitError, parse_unit
from wire.data_units import unit_id as unit_id

FORMAT_VERSION = 1


class LedgerError(ValueError):
    """A request or a saved ledger the ledger refuses; the message names unit, round and site."""


def unit_index(unit: str) -> int:
    """The stream index ``k`` of unit id ``"u<k>"``; ``LedgerError`` for anything else."""
    try:
        return parse_unit(unit)
    except UnitError as exc:
        raise LedgerError(str(exc)) from None


@dataclass
class _Round:
    # unit -> sites holding it, primary first; units in ascending index.
    holders: dict[str, list[str]]
    committed: dict[str, str] = field(default_factory=dict)
    closed: bool = False


class DataLedger:
    """Which data unit is assigned to whom, and which are committed; exactly once."""

    def __init__(self) -> None:
        self._rounds: dict[int, _Round] = {}
        self._open: int | None = None
        self._pending: list[int] = []  # carried-over unit indices, ascending
        self._next = 0  # first index never handed out
        self._committed: dict[str, tuple[int, str]] = {}

    # ---- round lifecycle ------------------------------------------------------------------

    def assign_round(self, round_number: int, sites: list[str]) -> dict[str, str]:
        """Site -> unit for a newly opened round: sites in sorted order get carried-over units
        first (ascending index), then fresh ones. Calling again for the same open round with
        the same sites returns the same map, so a restarted coordinator can replay."""
        if not isinstance(round_number, int) or round_number < 0:
            raise LedgerError(f"round number must be an int >= 0, got {round_number!r}")
        ordered = sorted(sites)
        if len(set(ordered)) != len(ordered):
            raise LedgerError(f"round {round_number}: duplicate sites in {ordered}")
        rec = self._rounds.get(round_number)
        if rec is not None:
            if rec.closed:
                raise LedgerError(f"round {round_number} is closed; it cannot be assigned again")
            given = {sites_[0]: unit for unit, sites_ in rec.holders.items()}
            if sorted(given) != ordered:
                raise LedgerError(
                    f"round {round_number} was assigned to sites {sorted(given)}, not {ordered}"
                )
            return dict(sorted(given.items()))
        if self._open is not None:
            raise LedgerError(
                f"round {self._open} is still open; close it before assigning round {round_number}"
            )
        if self._rounds and round_number <= max(self._rounds):
            raise LedgerError(
                f"round {round_number} is not after the last round {max(self._rounds)}"
            )
        carried = self._pending[: len(ordered)]
        self._pending = self._pending[len(carried) :]
        fresh = range(self._next, self._next + len(ordered) - len(carried))
        self._next += len(fresh)
        units = [unit_id(k) for k in [*carried, *fresh]]
        self._rounds[round_number] = _Round({u: [s] for s, u in zip(ordered, units, strict=True)})
        self._open = round_number
        return dict(zip(ordered, units, strict=True))

    def add_backup(self, round_number: int, unit: str, site: str) -> None:
        """Give ``site`` a speculative copy of ``unit`` in the open round."""
        rec = self._open_round(round_number, f"back up unit {unit!r} on site {site!r}")
        sites = self._holders_in(rec, round_number, unit)
        if unit in rec.committed:
            raise LedgerError(
                f"unit {unit!r} is already committed in round {round_number} by site "
                f"{rec.committed[unit]!r}; no backup on site {site!r}"
            )
        if site in sites:
            raise LedgerError(f"site {site!r} already holds unit {unit!r} in round {round_number}")
        sites.append(site)

    def commit(self, round_number: int, unit: str, site: str) -> bool:
        """True when this is the unit's first commit (the update counts); False when the unit
        was already committed, by anyone (refuse the push as a duplicate)."""
        rec = self._open_round(round_number, f"commit unit {unit!r} from site {site!r}")
        if site not in self._holders_in(rec, round_number, unit):
            raise LedgerError(
                f"site {site!r} does not hold unit {unit!r} in round {round_number} "
                f"(holders: {rec.holders[unit]})"
            )
        if unit in rec.committed:
            return False
        rec.committed[unit] = site
        self._committed[unit] = (round_number, site)
        return True

    def close_round(self, round_number: int) -> list[str]:
        """Close the open round; its uncommitted units return to the front of the queue and
        are returned, ascending."""
        rec = self._open_round(round_number, "close it")
        back = [u for u in rec.holders if u not in rec.committed]
        rec.closed = True
        self._open = None
        self._pending = sorted(self._pending + [unit_index(u) for u in back])
        return back

    # ---- queries --------------------------------------------------------------------------

    def holders(self, round_number: int, unit: str) -> list[str]:
        """Sites holding ``unit`` in that round: primary first, then backups in order given."""
        return list(self._holders_in(self._round(round_number), round_number, unit))

    def units_in(self, round_number: int) -> list[str]:
        """Every unit assigned in the round, ascending."""
        return sorted(self._round(round_number).holders, key=unit_index)

    def units_of(self, round_number: int, site: str) -> list[str]:
        """Units ``site`` holds in that round, committed or not, ascending."""
        return [u for u, s in self._round(round_number).holders.items() if site in s]

    def committed_by(self, unit: str) -> tuple[int, str] | None:
        """(round, site) that committed ``unit``, or None while it is not committed."""
        unit_index(unit)
        return self._committed.get(unit)

    def uncommitted(self, round_number: int) -> list[str]:
        """Units of that round without a commit (for a closed round: the ones carried over)."""
        rec = self._round(round_number)
        return [u for u in rec.holders if u not in rec.committed]

    def losers(self, round_number: int, unit: str) -> list[str]:
        """Holders of a committed unit other than its committer, to be told to cancel; empty
        while the unit is uncommitted (nobody is to stop yet)."""
        rec = self._round(round_number)
        sites = self._holders_in(rec, round_number, unit)
        winner = rec.committed.get(unit)
        return [s for s in sites if s != winner] if winner is not None else []

    def pending(self) -> list[str]:
        """Carried-over units waiting for a later round, in the order they will be assigned."""
        return [unit_id(k) for k in self._pending]

    def open_round_number(self) -> int | None:
        """The round assigned and not yet closed, if any."""
        return self._open

    # ---- checks and persistence -----------------------------------------------------------

    def invariant_violations(self) -> list[str]:
        """Broken exactly-once guarantees, in words; empty when all is well."""
        out: list[str] = []
        commits: dict[str, list[int]] = {}
        for r, rec in sorted(self._rounds.items()):
            for unit, site in rec.committed.items():
                commits.setdefault(unit, []).append(r)
                if site not in rec.holders.get(unit, []):
                    out.append(f"unit {unit} committed in round {r} by non-holder {site}")
        out += [f"unit {u} committed in rounds {rs}" for u, rs in commits.items() if len(rs) > 1]
        for r, rec in sorted(self._rounds.items()):
            out += [
                f"unit {u} assigned in round {r} after its commit in round {commits[u][0]}"
                for u in rec.holders
                if commits.get(u, [r])[0] < r
            ]
        pending = set(self._pending)
        if len(pending) != len(self._pending):
            out.append(f"duplicates in the pending queue {self.pending()}")
        flight = set() if self._open is None else set(self.uncommitted(self._open))
        for k in range(self._next):
            u = unit_id(k)
            where = (u in commits) + (k in pending) + (u in flight)
            if where == 0:
                out.append(f"gap: unit {u} is neither committed, pending nor in flight")
            elif where > 1:
                out.append(f"unit {u} is more than one of committed, pending, in flight")
        seen = {unit_index(u) for rec in self._rounds.values() for u in rec.holders}
        out += [
            f"unit u{k} is at or past the next fresh unit u{self._next}"
            for k in sorted(seen | pending)
            if k >= self._next
        ]
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy of the whole ledger."""
        return {
            "format": FORMAT_VERSION,
            "next_unit": self._next,
            "pending": self.pending(),
            "rounds": [
                {
                    "round": r,
                    "closed": rec.closed,
                    "holders": {u: list(s) for u, s in rec.holders.items()},
                    "committed": dict(rec.committed),
                }
                for r, rec in sorted(self._rounds.items())
            ],
        }

    @classmethod
    def from_dict(cls, d: Any) -> DataLedger:
        """The ledger ``to_dict`` saved; ``LedgerError`` saying what is wrong otherwise."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise LedgerError(f"bad saved data ledger: {what}")

        need(isinstance(d, dict), f"expected a mapping, got {type(d).__name__}")
        need(d.get("format") == FORMAT_VERSION, f"format {d.get('format')!r} is not 1")
        nxt, pending, rounds = d.get("next_unit"), d.get("pending"), d.get("rounds")
        need(type(nxt) is int and nxt >= 0, f"next_unit {nxt!r} is not an int >= 0")
        need(isinstance(pending, list), "pending is not a list")
        need(isinstance(rounds, list), "rounds is not a list")
        led = cls()
        led._next = nxt
        led._pending = sorted(unit_index(u) for u in pending)
        for entry in rounds:
            need(isinstance(entry, dict), f"round entry {entry!r} is not a mapping")
            r, closed = entry.get("round"), entry.get("closed")
            holders, committed = entry.get("holders"), entry.get("committed")
            need(type(r) is int and r >= 0, f"round number {r!r} is not an int >= 0")
            need(r not in led._rounds, f"round {r} appears twice")
            need(isinstance(closed, bool), f"round {r}: closed {closed!r} is not a bool")
            need(isinstance(holders, dict), f"round {r}: holders is not a mapping")
            need(isinstance(committed, dict), f"round {r}: committed is not a mapping")
            for u, sites in holders.items():
                unit_index(u)
                need(
                    isinstance(sites, list)
                    and len(sites) == len(set(sites)) > 0
                    and all(isinstance(s, str) for s in sites),
                    f"round {r}: holders of {u} must be distinct site names, got {sites!r}",
                )
            primaries = [sites[0] for sites in holders.values()]
            need(len(set(primaries)) == len(primaries), f"round {r}: a site is primary twice")
            for u, site in committed.items():
                need(site in holders.get(u, []), f"round {r}: {u} committed by non-holder {site!r}")
            if not closed:
                need(led._open is None, f"rounds {led._open} and {r} are both open")
                led._open = r
            ordered = {u: list(holders[u]) for u in sorted(holders, key=unit_index)}
            led._rounds[r] = _Round(ordered, dict(committed), closed)
        need(led._open in (None, max(led._rounds, default=None)), "an open round is not the last")
        for r, rec in sorted(led._rounds.items()):
            led._committed.update({u: (r, s) for u, s in rec.committed.items()})
        problems = led.invariant_violations()
        need(not problems, "; ".join(problems))
        return led

    # ---- helpers --------------------------------------------------------------------------

    def _round(self, round_number: int) -> _Round:
        rec = self._rounds.get(round_number)
        if rec is None:
            raise LedgerError(f"round {round_number} was never assigned")
        return rec

    def _open_round(self, round_number: int, action: str) -> _Round:
        if round_number != self._open:
            state = "closed" if round_number in self._rounds else "not assigned"
            raise LedgerError(
                f"cannot {action}: round {round_number} is {state} (open round: {self._open})"
            )
        return self._rounds[round_number]

    @staticmethod
    def _holders_in(rec: _Round, round_number: int, unit: str) -> list[str]:
        unit_index(unit)
        sites = rec.holders.get(unit)
        if sites is None:
            raise LedgerError(f"unit {unit!r} is not assigned in round {round_number}")
        return sites
