"""What every fault run must keep, checked on a ``RunRecord``.

* the job completes: every agent and the coordinator exit 0 and theta_{total} is checkpointed;
* no round is lost: each round 0..total-1 was closed by a checkpoint (``closed_round``);
* nothing is counted twice: no site twice in a round's ``closed_round.sites``, no round closed
  twice (a durable close that a restart redid would apply its updates again);
* every site holds the coordinator's final theta, and in a deterministic scenario that theta is
  the crash-free run's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from faults.record import RunRecord


@dataclass
class Verdict:
    """The invariants' answer for one run; ``problems`` empty means it survived."""

    survived: bool
    lost_rounds: list[int]
    double_counted: int
    recovery_s: float | None
    problems: list[str] = field(default_factory=list)


def double_counted(record: RunRecord) -> int:
    """Updates counted more than once, over all rounds.

    Per round, from each witness that keeps one (the checkpoints' ``closed_round.sites``, the
    event log's ``round_closed`` events): a site twice in one close, and every update of a
    second close of the same round (a durable close that a restart redid applies its updates
    again). The larger count of the two witnesses is taken (they see the same closes). Plus,
    in shared-data mode, every unit the data ledger saw committed in more than one round.
    """
    from_checkpoints = {
        r: [m["closed_round"].get("sites", []) for m in metas]
        for r, metas in record.checkpoints.items()
    }
    from_events: dict[int, list[list[str]]] = {}
    for e in record.events:
        if e.get("kind") == "round_closed":
            from_events.setdefault(int(e["round"]), []).append(list(e.get("updates", [])))
    n = 0
    for r in set(from_checkpoints) | set(from_events):
        n += max(_extra(from_checkpoints.get(r, [])), _extra(from_events.get(r, [])))
    return n + _ledger_double_commits(record.ledger)


def _extra(closes: list[list[str]]) -> int:
    dup = sum(c - 1 for sites in closes for c in Counter(sites).values())
    return dup + sum(len(sites) for sites in closes[1:])


def _ledger_double_commits(saved: dict | None) -> int:
    if not saved:
        return 0
    rounds_of: dict[str, int] = {}
    for entry in saved.get("rounds", []):
        for unit in entry.get("committed", {}):
            rounds_of[unit] = rounds_of.get(unit, 0) + 1
    return sum(n - 1 for n in rounds_of.values())


def recovery_seconds(record: RunRecord, closes: list[float]) -> float | None:
    if record.fault_at is None:
        return None
    later = sorted(t for t in closes if t > record.fault_at)
    return later[0] - record.fault_at if later else None


def judge(
    record: RunRecord,
    reference_hash: str | None = None,
    all_sites: list[str] | None = None,
) -> Verdict:
    """Check ``record``; ``reference_hash`` for deterministic scenarios, ``all_sites`` when
    every round must have counted every site."""
    problems = list(record.problems)
    bad = {s: c for s, c in record.site_codes.items() if c != 0}
    if bad:
        problems.append(f"site exit codes {bad}")
    if record.coordinator_code != 0:
        problems.append(f"coordinator exit code {record.coordinator_code}")
    lost = [r for r in range(record.total_rounds) if r not in record.checkpoints]
    if lost:
        problems.append(f"rounds never closed: {lost}")
    twice = double_counted(record)
    if twice:
        closes = {r: [m["closed_round"] for m in ms] for r, ms in record.checkpoints.items()}
        problems.append(f"{twice} update(s) counted twice: {closes}")
    if all_sites is not None:
        for r, metas in sorted(record.checkpoints.items()):
            got = sorted(metas[-1]["closed_round"].get("sites", []))
            if got != sorted(all_sites):
                problems.append(f"round {r} closed with {got}, expected {sorted(all_sites)}")
    if record.final_hash is None:
        problems.append(f"no checkpoint of theta_{record.total_rounds}")
    differ = {s: h for s, h in record.site_hashes.items() if h != record.final_hash}
    if differ:
        problems.append(f"sites whose final theta differs from {record.final_hash}: {differ}")
    if reference_hash is not None and record.final_hash != reference_hash:
        problems.append(
            f"final theta {record.final_hash} differs from the crash-free run's {reference_hash}"
        )
    closes = [m.get("written_at", 0.0) for metas in record.checkpoints.values() for m in metas]
    return Verdict(not problems, lost, twice, recovery_seconds(record, closes), problems)
