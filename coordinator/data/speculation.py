"""Which straggling data units get a backup copy, and on which idle site.

In shared-data mode one slow or dead site would hold up every round until its deadline. Instead
the coordinator runs a copy of the late unit on a site that has already delivered its own
(speculative execution); the ledger keeps whichever commit arrives first. A unit needs a backup
when

* every site holding it is suspected by the failure detector: it will most likely never arrive;
* or it straggles, once the round has run ``min_wait_s``: the round has run more than
  ``slow_factor`` times the median time this round's committed units took, or (when progress is
  reported) the furthest of its holders is below ``behind_fraction`` of the median inner step
  of the other sites still training.

A backup costs a whole unit of training on the idle site, so ``max_backups_per_unit`` caps the
copies, and the first of these rules is not held back by ``min_wait_s``: a dead site's unit is
worth re-running at once. Pure: a function of (now, state, options).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from wire.config_table import setting


@dataclass(frozen=True)
class SpeculationOptions:
    """The ``[speculation]`` table (shared-data mode only; see the module docstring)."""

    enabled: bool = setting(True, help="back up straggling data units on idle sites")
    slow_factor: float = setting(
        2.0,
        help="a unit straggles once the round has run this many times the median time this "
        "round's committed units took (>= 1)",
    )
    min_wait_s: float = setting(
        10.0,
        help="a straggling unit (not a suspected holder's) gets a backup only once the round "
        "has run this long (>= 0)",
    )
    behind_fraction: float = setting(
        0.5,
        help="a unit straggles when the furthest of its holders is below this fraction of the "
        "median inner step of the other sites still training (in [0, 1])",
    )
    max_backups_per_unit: int = setting(
        1,
        help="the most backup copies of one unit (>= 1; set ``enabled = false`` to turn "
        "speculation off)",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"speculation.enabled must be true or false, got {self.enabled!r}")
        _check_number("slow_factor", self.slow_factor, low=1.0)
        _check_number("min_wait_s", self.min_wait_s, low=0.0)
        _check_number("behind_fraction", self.behind_fraction, low=0.0, high=1.0)
        n = self.max_backups_per_unit
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"speculation.max_backups_per_unit must be an int >= 1, got {n!r} "
                "(set enabled = false to turn speculation off)"
            )


@dataclass(frozen=True)
class Backup:
    """Give ``site`` a copy of ``unit``; ``reason`` says why, for logs and status."""

    unit: str
    site: str
    reason: str


def plan_backups(
    now: float,
    opened_at: float,
    holders: dict[str, list[str]],
    commit_times: dict[str, float],
    progress: dict[str, int],
    suspected: set[str],
    idle: set[str],
    opts: SpeculationOptions,
) -> list[Backup]:
    """Backups to start now, most needed first.

    Parameters
    ----------
    now, opened_at
        The clock now and when the round opened.
    holders
        Each uncommitted unit of the round -> the sites holding it, primary first.
    commit_times
        Each unit committed this round -> seconds after ``opened_at`` it was committed.
    progress
        Site -> the last inner step it reported this round; sites without a report are absent.
    suspected
        Sites the failure detector suspects.
    idle
        Sites free to take a backup (delivered their own unit, live lease).
    opts
        The job's speculation options.

    Returns
    -------
    list[Backup]
        At most one per idle site, never onto a site that holds the unit already, and never
        past ``max_backups_per_unit`` copies. Units whose holders are all suspected come
        first, then the least advanced, ties by unit id.
    """
    if not opts.enabled:
        return []
    needy: list[tuple[tuple[int, int, int, str], str, str]] = []
    for unit, sites in holders.items():
        reason = _need(now, opened_at, unit, holders, commit_times, progress, suspected, opts)
        if reason is None:
            continue
        dead = all(s in suspected for s in sites)
        step = _furthest(sites, progress, suspected)
        # Unknown progress ranks as least advanced: nothing says the unit is getting anywhere.
        key = (0 if dead else 1, -1 if step is None else step, len(unit), unit)
        needy.append((key, unit, reason))
    needy.sort()
    return _deal(needy, holders, sorted(idle - suspected), opts.max_backups_per_unit)


def _deal(needy, holders: dict[str, list[str]], free: list[str], most: int) -> list[Backup]:
    """Idle sites to needy units in round-robin passes: every needy unit gets its first
    backup before any gets a second."""
    copies = {unit: max(len(holders[unit]) - 1, 0) for _, unit, _ in needy}
    plan: list[Backup] = []
    while free:
        given = len(plan)
        for _, unit, reason in needy:
            if copies[unit] >= most:
                continue
            site = next((s for s in free if s not in holders[unit]), None)
            if site is None:
                continue
            free.remove(site)
            copies[unit] += 1
            plan.append(Backup(unit, site, reason))
        if len(plan) == given:
            break
    return plan


def _need(
    now: float,
    opened_at: float,
    unit: str,
    holders: dict[str, list[str]],
    commit_times: dict[str, float],
    progress: dict[str, int],
    suspected: set[str],
    opts: SpeculationOptions,
) -> str | None:
    """Why ``unit`` needs a backup, or None when it does not."""
    sites = holders[unit]
    if not sites:
        return "no site holds it"
    if all(s in suspected for s in sites):
        return f"{', '.join(sites)} suspected (failure detector)"
    elapsed = now - opened_at
    if elapsed < opts.min_wait_s:
        return None
    if commit_times:
        median = statistics.median(commit_times.values())
        if elapsed > opts.slow_factor * median:
            if median <= 0:
                return f"running {elapsed:.1f}s; the committed units took no time"
            return f"running {elapsed / median:.1f}x the median commit time ({median:.1f}s)"
    step = _furthest(sites, progress, suspected)
    others = {
        s
        for u, held in holders.items()
        if u != unit
        for s in held
        if s not in sites and s not in suspected and s in progress
    }
    if step is not None and others:
        median_step = statistics.median(progress[s] for s in others)
        if step < opts.behind_fraction * median_step:
            return (
                f"at inner step {step}, under {opts.behind_fraction:g} x the median step "
                f"{median_step:g} of the other sites still training"
            )
    return None


def _furthest(sites: list[str], progress: dict[str, int], suspected: set[str]) -> int | None:
    """The furthest step a live holder reported; a suspected site's last report is stale."""
    steps = [progress[s] for s in sites if s in progress and s not in suspected]
    return max(steps) if steps else None


def _check_number(name: str, value: float, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"speculation.{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise ValueError(f"speculation.{name} must be {bounds}, got {value!r}")
