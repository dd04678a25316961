"""Fault injection for tests and drills, keyed by (site, round, step, rank).

``ISTHMUS_FAULTS`` holds ``;``-separated specs such as
``site=site-0,round=1,step=3,rank=1,action=kill``: when rank 1 of site-0 has finished inner
step 3 of round 1, it kills itself with SIGKILL (a real crash: no cleanup, no exit handlers).
``action=stall,seconds=S`` sleeps S seconds there instead, once, which makes the site a
straggler (the other ranks wait for it at their next collective). ``action=slow_probe,
seconds=S`` (with ``step=0``) makes the health probe that runs before that round S seconds
slower inside its timed matmul: a site whose device looks throttled (``wire.health``). A
fault fires only in the launch attempt it names (``restart=N``, default 0), so the restarted
trainer gets past it.

Keys: ``site``, ``round``, ``step`` (required), ``rank``, ``restart`` (default 0), ``action``
(``kill``, the default, ``stall`` or ``slow_probe``) and ``seconds`` (required for ``stall``
and ``slow_probe``, refused otherwise). Any other key is refused.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

ENV = "ISTHMUS_FAULTS"
ACTIONS = ("kill", "stall", "slow_probe")
STEP_ACTIONS = ("kill", "stall")  # what fires after an inner step; slow_probe is the probe's
TIMED = ("stall", "slow_probe")  # the actions that take seconds=


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
        if fault.action in TIMED and (seconds is None or not 0 < seconds < math.inf):
            raise ValueError(f"{ENV}: action={fault.action} needs seconds=S with S > 0 in {spec!r}")
        if fault.action not in TIMED and seconds is not None:
            raise ValueError(f"{ENV}: seconds= is only for action=stall or slow_probe in {spec!r}")
        faults.append(fault)
    return faults


def fault_at(
    faults: list[Fault],
    site: str,
    round_number: int,
    step: int,
    rank: int,
    restart: int,
    actions: tuple[str, ...] = STEP_ACTIONS,
) -> Fault | None:
    """The fault of one of ``actions`` planned for this exact point, if any (pure)."""
    for f in faults:
        if f.action in actions and (f.site, f.round, f.step, f.rank, f.restart) == (
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
