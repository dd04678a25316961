"""``coordinator history``: a job's rounds after the fact, from its event log alone.

Works on a running job (it only reads) and on one long finished: the event log's segments and
live file hold, per round, when it opened and closed, why, who took part, the update bytes,
the sites' losses, rejections and the close's phases. ``rounds_of`` turns those events into one
``RoundRecord`` per closed round (pure); the rest prints them as a table, JSON or CSV, and draws
PNG plots.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import fmean

PLOTS = ("loss_by_round.png", "loss_by_wan_bytes.png", "round_time.png")


@dataclass(frozen=True)
class RoundRecord:
    """One closed round, as its events tell it."""

    round: int
    reason: str
    opened_wall: float | None
    closed_wall: float
    participants: tuple[str, ...]
    updates: tuple[str, ...]
    update_bytes: int
    losses: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    evaluation: dict[str, float] = field(default_factory=dict)  # [evaluation] on its theta

    @property
    def seconds(self) -> float | None:
        return None if self.opened_wall is None else self.closed_wall - self.opened_wall

    @property
    def mean_loss(self) -> float | None:
        return fmean(self.losses.values()) if self.losses else None

    def as_json(self) -> dict:
        return {**asdict(self), "seconds": self.seconds, "mean_loss": self.mean_loss}


def rounds_of(events: Iterable[dict]) -> list[RoundRecord]:
    """The closed rounds, in order, from the event log's records (pure)."""
    fold = RoundsFold()
    for e in events:
        fold.add(e)
    return fold.rounds()


class RoundsFold:
    """``rounds_of`` one event at a time, for a reader that follows a live log (the status
    page): it holds a few numbers per round, not the events."""

    def __init__(self) -> None:
        self._opened: dict[int, float] = {}
        self._update_bytes: dict[int, int] = {}
        self._evaluated: dict[int, dict] = {}  # by theta version: round r's close makes r + 1
        self._closed: list[RoundRecord] = []

    def add(self, e: dict) -> None:
        kind, r = e.get("kind"), e.get("round")
        if kind == "round_open" and isinstance(r, int):
            self._opened.setdefault(r, e["wall"])
        elif kind == "update" and isinstance(r, int):
            self._update_bytes[r] = self._update_bytes.get(r, 0) + int(e.get("bytes", 0))
        elif kind == "round_closed" and isinstance(r, int):
            self._closed.append(_record(e, self._opened.get(r), self._update_bytes.get(r, 0)))
        elif kind == "evaluation" and isinstance(e.get("version"), int):
            self._evaluated[e["version"]] = dict(e.get("metrics") or {})

    def rounds(self) -> list[RoundRecord]:
        """The rounds closed so far, each with the evaluation of the theta it made."""
        ev = self._evaluated
        return [replace(r, evaluation=ev.get(r.round + 1, {})) for r in self._closed]


def _record(e: dict, opened_wall: float | None, counted_bytes: int) -> RoundRecord:
    return RoundRecord(
        round=e["round"],
        reason=str(e.get("reason", "")),
        opened_wall=opened_wall,
        closed_wall=e["wall"],
        participants=tuple(e.get("participants", ())),
        updates=tuple(e.get("updates", ())),
        # Older logs lack update_bytes on the close: the updates' own events then.
        update_bytes=int(e.get("update_bytes", counted_bytes)),
        losses={k: float(v) for k, v in (e.get("losses") or {}).items()},
        rejected=dict(e.get("rejected") or {}),
        phases={k.removesuffix("_s"): float(v) for k, v in (e.get("phases") or {}).items()},
    )


def table(rounds: list[RoundRecord]) -> str:
    header = ("ROUND", "SECONDS", "UPDATES", "MB UP", "MEAN LOSS", "REJECTED", "CLOSED BECAUSE")
    rows = [
        (
            str(r.round),
            f"{r.seconds:.2f}" if r.seconds is not None else "-",
            f"{len(r.updates)}/{len(r.participants)}",
            f"{r.update_bytes / 1e6:.2f}",
            f"{r.mean_loss:.4f}" if r.mean_loss is not None else "-",
            str(len(r.rejected)),
            r.reason,
        )
        for r in rounds
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]  # fmt: skip
    return "\n".join(lines if rows else [*lines, "(no round has closed)"])


def as_json(rounds: list[RoundRecord]) -> str:
    return json.dumps([r.as_json() for r in rounds], indent=1, sort_keys=True)


def as_csv(rounds: list[RoundRecord]) -> str:
    out = io.StringIO()
    fields = ["round", "seconds", "updates", "participants", "update_bytes", "mean_loss",
              "rejected", "reason"]  # fmt: skip
    w = csv.DictWriter(out, fields)
    w.writeheader()
    for r in rounds:
        w.writerow(
            {
                "round": r.round,
                "seconds": "" if r.seconds is None else f"{r.seconds:.4f}",
                "updates": len(r.updates),
                "participants": len(r.participants),
                "update_bytes": r.update_bytes,
                "mean_loss": "" if r.mean_loss is None else f"{r.mean_loss:.6f}",
                "rejected": len(r.rejected),
                "reason": r.reason,
            }
        )
    return out.getvalue()


def plot(rounds: list[RoundRecord], folder: Path) -> list[Path]:
    """Loss against round and against cumulative update bytes, and each round's time split
    into waiting for updates and the close's phases; returns the PNGs written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    with_loss = [r for r in rounds if r.mean_loss is not None]
    numbers, losses = [r.round for r in with_loss], [r.mean_loss for r in with_loss]
    sent, total = [], 0
    for r in rounds:
        total += r.update_bytes
        if r.mean_loss is not None:
            sent.append(total / 1e6)
    written = []
    for name, xs, xlabel in ((PLOTS[0], numbers, "round"), (PLOTS[1], sent, "update MB sent")):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, losses, marker="o")
        ax.set(xlabel=xlabel, ylabel="mean train loss of the round's sites")
        written.append(_save(fig, folder / name))
    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted({p for r in rounds for p in r.phases} | {"wait"})
    bottom = [0.0] * len(rounds)
    for phase in names:
        values = [_phase(r, phase) for r in rounds]
        ax.bar([r.round for r in rounds], values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="round", ylabel="seconds")
    ax.legend(fontsize="small")
    written.append(_save(fig, folder / PLOTS[2]))
    return written


def _phase(r: RoundRecord, phase: str) -> float:
    if phase != "wait":
        return r.phases.get(phase, 0.0)
    if r.seconds is None:
        return 0.0
    return max(0.0, r.seconds - sum(r.phases.values()))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
