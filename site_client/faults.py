"""Fault injection for tests and drills, keyed by (site, round, step, rank).

``ISTHMUS_FAULTS`` holds ``;``-separated specs such as
``site=site-0,round=1,step=3,rank=1,action=kill``: when rank 1 of site-0 has finished inner
step 3 of round 1, it kills itself with SIGKILL (a real crash: no cleanup, no exit handlers).
``action=stall,seconds=S`` sleeps S seconds there instead, once, which makes the site a
straggler (the other ranks wait for it at their next collective). A fault fires only in the
launch attempt it names (``restart=N``, default 0), so the restarted trainer gets past it.

Keys: ``site``, ``round``, ``step`` (required), ``rank``, ``restart`` (default 0), ``action``
(``kill``, the default, or ``stall``) and ``seconds`` (required for ``stall``, refused
otherwise). Any other key is refused.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

ENV = "ISTHMUS_FAULTS"
ACTIONS = ("kill", "stall")


@dataclass(frozen=True)
class Fault:
    site: str
    round: int
    step: int
    rank: int = 0
    restart: int = 0
    action: str = "kill"
    seconds: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    """The faults ``text`` plans; ``ValueError`` naming the spec for anything malformed."""
    faults = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        try:
            fields = dict(kv.split("=", 1) for kv in spec.split(","))
            action = fields.pop("action", "kill")
            seconds = float(fields.pop("seconds")) if "seconds" in fields else None
            fault = Fault(
                site=fields.pop("site"),
                round=int(fields.pop("round")),
                step=int(fields.pop("step")),
                rank=int(fields.pop("rank", 0)),
                restart=int(fields.pop("restart", 0)),
                action=action,
                seconds=seconds or 0.0,
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{ENV}: cannot read fault {spec!r}: {exc}") from exc
        if fields or fault.action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown keys {sorted(fields)} or action in {spec!r}")
        if fault.action == "stall" and (seconds is None or not 0 < seconds < math.inf):
            raise ValueError(f"{ENV}: action=stall needs seconds=S with S > 0 in {spec!r}")
        if fault.action != "stall" and seconds is not None:
            raise ValueError(f"{ENV}: seconds= is only for action=stall in {spec!r}")
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


def inject(fault: Fault | None, fired: set[Fault] | None = None) -> None:
    """Carry out ``fault``, unless it is already in ``fired`` (then add it there)."""
    if fault is None or (fired is not None and fault in fired):
        return
    if fired is not None:
        fired.add(fault)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stall":
        time.sleep(fault.seconds)
