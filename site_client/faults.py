"""Fault injection for tests and drills, keyed by (site, round, step, rank).

``ISTHMUS_FAULTS`` holds ``;``-separated specs such as
``site=site-0,round=1,step=3,rank=1,action=kill``: when rank 1 of site-0 has finished inner
step 3 of round 1, it kills itself with SIGKILL (a real crash: no cleanup, no exit handlers).
A fault fires only in the launch attempt it names (``restart=N``, default 0), so the restarted
trainer gets past it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "ISTHMUS_FAULTS"
ACTIONS = ("kill",)


@dataclass(frozen=True)
class Fault:
    site: str
    round: int
    step: int
    rank: int = 0
    restart: int = 0
    action: str = "kill"


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        try:
            fields = dict(kv.split("=", 1) for kv in spec.split(","))
            fault = Fault(
                site=fields.pop("site"),
                round=int(fields.pop("round")),
                step=int(fields.pop("step")),
                rank=int(fields.pop("rank", 0)),
                restart=int(fields.pop("restart", 0)),
                action=fields.pop("action", "kill"),
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{ENV}: cannot read fault {spec!r}: {exc}") from exc
        if fields or fault.action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown keys {sorted(fields)} or action in {spec!r}")
        faults.append(fault)
    return faults


def fault_at(
    faults: list[Fault], site: str, round_number: int, step: int, rank: int, restart: int
) -> Fault | None:
    """The fault planned for this exact point, if any (pure)."""
    for f in faults:
        if (f.site, f.round, f.step, f.rank, f.restart) == (
            site,
            round_number,
            step,
            rank,
            restart,
        ):
            return f
    return None


def inject(fault: Fault | None) -> None:
    if fault is not None and fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
