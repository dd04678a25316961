"""Drained sites: taken out of the job by an operator or by the health rules, until undrained.

A drained site is told so in every heartbeat and round-watch reply (``Command.drain``). It
finishes the task it is training (in shared-data mode it hands its unit back instead: another
site trains it), pushes what it owes, and leaves; it is in no later round and its joins are
refused until ``coordinator undrain``. The list is a small JSON file in the state folder,
replaced atomically and fsynced before the operator's call returns, so a drain survives a
restart of the coordinator (its sites re-join after one: a drained site must not).

No clock, no locking and no writing here: ``coordinator.members.site_control`` does those.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from coordinator.records import Refused

log = logging.getLogger("isthmus.coordinator")
FILE = "drained.json"
REASON_CHARS = 200


@dataclass(frozen=True)
class DrainMark:
    """Why a site is drained, who decided (``operator`` or ``health``), and when (wall)."""

    reason: str
    by: str
    at_wall: float

    def describe(self) -> str:
        return f"{self.reason} ({self.by})"


class DrainList:
    """The drained sites of one state folder."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / FILE
        self.marks: dict[str, DrainMark] = self._read()

    def _read(self) -> dict[str, DrainMark]:
        if not self.path.exists():
            return {}
        try:
            raw = json.loads(self.path.read_text())
            return {str(site): DrainMark(**mark) for site, mark in raw["sites"].items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Starting with an empty list would quietly re-admit every drained site.
            raise RuntimeError(
                f"{self.path}: unreadable list of drained sites ({exc}); fix or remove it "
                "(removing it admits every drained site again)"
            ) from exc

    def __contains__(self, site: str) -> bool:
        return site in self.marks

    def reason(self, site: str) -> str:
        mark = self.marks.get(site)
        return mark.describe() if mark is not None else ""

    def names(self) -> list[str]:
        return sorted(self.marks)

    def mark(self, site: str, reason: str, by: str, at_wall: float) -> bool:
        """Drain ``site``; False if it already was (its first reason stays)."""
        if site in self.marks:
            return False
        self.marks[site] = DrainMark(reason[:REASON_CHARS] or "no reason given", by, at_wall)
        return True

    def unmark(self, site: str) -> bool:
        """Admit ``site`` again; False if it was not drained."""
        return self.marks.pop(site, None) is not None

    def serialized(self) -> bytes:
        """The file's bytes for the list as it is now (written by ``SiteControl.save``)."""
        data = {"sites": {s: asdict(m) for s, m in sorted(self.marks.items())}}
        return json.dumps(data, indent=1).encode()

    def refuse_join(self, site: str) -> None:
        """A drained site may not join (``Refused`` with how to let it back in)."""
        if site in self.marks:
            raise Refused(
                "denied",
                f"site {site!r} is drained: {self.reason(site)}; an operator's "
                f"`coordinator undrain {site}` admits it again",
            )


def check_reason(reason: str) -> None:
    """A drain's reason is shown in logs, status and the event log: printable, and short."""
    if not reason.isprintable() or len(reason) > REASON_CHARS:
        raise Refused(
            "invalid",
            f"a drain reason is printable text of at most {REASON_CHARS} characters "
            f"(got {len(reason)} characters)",
        )


def drain_message(site: str, drain: bool, changed: bool, known: bool, hands_back: bool) -> str:
    """The one line ``coordinator drain`` / ``undrain`` prints."""
    if not drain:
        return (
            f"site {site} undrained: it may join again"
            if changed
            else (f"site {site} was not drained")
        )
    if not changed:
        return f"site {site} was already drained"
    if not known:
        return (
            f"site {site} drained; it has not joined since this coordinator started, so it "
            "will be refused when it does (check the name)"
        )
    if hands_back:
        return f"site {site} drained: it hands back its data units, pushes what it owes and leaves"
    return f"site {site} drained: it finishes its current work, pushes it and leaves"
