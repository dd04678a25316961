"""What ``python -m bench.hetero`` computes from its runs (see its docstring): each site's
compute utilisation, the tokens trained and counted, the global model's validation loss over
time and over counted tokens, the table, the plot and the last line. Everything here is pure:
it reads records that the runs left behind, and numbers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.sync_report import print_table
from bench.utilisation_report import STEPS, SiteUse


@dataclass(frozen=True)
class Point:
    """theta after ``version`` coordinator rounds: when it was checkpointed (seconds since
    the run's first inner step), the tokens counted into it, its validation loss."""

    version: int
    at_s: float
    tokens: float
    loss: float


@dataclass
class RunResult:
    """One run of the benchmark (``name``: blocking, streaming or async)."""

    name: str
    sites: dict[str, SiteUse]
    tokens_trained: float  # every inner step of every site, counted or not
    by_site: dict[str, tuple[float, float]] = field(default_factory=dict)  # trained, counted
    points: list[Point] = field(default_factory=list)  # by version
    killed: str = ""  # the site killed halfway and started again ("": none)
    notes: list[str] = field(default_factory=list)

    @property
    def cu_min(self) -> float:
        """The lowest utilisation of the sites (a killed site's downtime left out: of the
        others)."""
        values = [u.utilisation for s, u in self.sites.items() if s != self.killed]
        return min(values) if values else math.nan

    @property
    def span_s(self) -> float:
        """From the first inner step to the last theta checkpointed."""
        return self.points[-1].at_s if self.points else math.nan

    @property
    def tokens_counted(self) -> float:
        return self.points[-1].tokens if self.points else math.nan

    def at_time(self, seconds: float) -> Point | None:
        """The newest theta checkpointed by ``seconds`` into the run."""
        done = [p for p in self.points if p.at_s <= seconds + 1e-9]
        return done[-1] if done else None

    def at_tokens(self, tokens: float) -> Point | None:
        """The newest theta holding at most ``tokens`` counted tokens."""
        done = [p for p in self.points if p.tokens <= tokens + 1e-9]
        return done[-1] if done else None


def steps_records(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == STEPS]


def tokens_trained(records: Iterable[dict], tokens_per_step: float) -> float:
    """The tokens a site's trainer stepped over (every task, cancelled ones too), from its
    ``"steps"`` records' ``steps`` field."""
    return tokens_per_step * sum(int(r.get("steps", 0)) for r in steps_records(records))


def counted_by_version(events: Iterable[dict], tokens_per_task: float) -> dict[int, float]:
    """Tokens folded into theta of each version: every round before it, its counted updates'
    weights (1 for an update of a whole task, times a late update's discount; the strategy
    weighs updates alike) times a task's tokens, summed."""
    per_round: dict[int, float] = {}
    closed: list[int] = []
    for e in events:
        if e.get("kind") == "update" and isinstance(e.get("round"), int):
            per_round[e["round"]] = per_round.get(e["round"], 0.0) + float(e.get("weight", 0.0))
        elif e.get("kind") == "round_closed" and isinstance(e.get("round"), int):
            closed.append(e["round"])
    out, total = {0: 0.0}, 0.0
    for r in sorted(set(closed)):
        total += per_round.get(r, 0.0) * tokens_per_task
        out[r + 1] = total
    return out


def counted_by_site(events: Iterable[dict], tokens_per_task: float) -> dict[str, float]:
    """Tokens each site's counted updates (in closed rounds or not) carried into theta."""
    out: dict[str, float] = {}
    for e in events:
        if e.get("kind") == "update" and isinstance(e.get("site"), str):
            out[e["site"]] = out.get(e["site"], 0.0) + float(e.get("weight", 0.0)) * tokens_per_task
    return out


def site_lines(results: Sequence[RunResult]) -> list[str]:
    """Per run, each site's tokens counted into theta over those it trained."""
    lines = []
    for r in results:
        cells = [
            f"{site} {counted / 1e3:.0f}/{trained / 1e3:.0f}"
            for site, (trained, counted) in sorted(r.by_site.items())
        ]
        lines.append(f"{r.name:<10} " + ", ".join(cells))
    return lines


def points_of(
    checkpoints: dict[int, float], losses: dict[int, float], tokens: dict[int, float], t0: float
) -> list[Point]:
    """The run's thetas by version: ``checkpoints`` (version -> wall time written), their
    ``losses`` and counted ``tokens``; ``t0``: the wall time of the run's first inner step."""
    out = []
    for version in sorted(checkpoints):
        if version in losses and version in tokens:
            at = max(0.0, checkpoints[version] - t0)
            out.append(Point(version, at, tokens[version], losses[version]))
    return out


def pct(value: float, reference: float) -> float:
    """``100 * (value - reference) / reference``."""
    return 100.0 * (value - reference) / reference if reference else math.nan


@dataclass(frozen=True)
class Compared:
    """The runs at equal wall time (the shortest run's span) and equal counted tokens."""

    wall_s: float
    loss_at_wall: dict[str, float]
    tokens_at_wall: dict[str, float]
    tokens: float
    loss_at_tokens: dict[str, float]


def compare(results: Sequence[RunResult]) -> Compared:
    """At the shortest span and the fewest counted tokens of the runs without a kill."""
    plain = [r for r in results if not r.killed] or list(results)
    wall = min(r.span_s for r in plain)
    tokens = min(r.tokens_counted for r in plain)
    at_wall = {r.name: r.at_time(wall) for r in results}
    at_tokens = {r.name: r.at_tokens(tokens) for r in results}
    return Compared(
        wall_s=wall,
        loss_at_wall={n: p.loss if p else math.nan for n, p in at_wall.items()},
        tokens_at_wall={n: p.tokens if p else math.nan for n, p in at_wall.items()},
        tokens=tokens,
        loss_at_tokens={n: p.loss if p else math.nan for n, p in at_tokens.items()},
    )


def table(results: Sequence[RunResult], compared: Compared) -> None:
    names = sorted({s for r in results for s in r.sites})
    header = ["run", *[f"CU {s}" for s in names], "CU min", "wait s/task", "trained ktok"]
    header += ["counted ktok", "rounds", f"loss @{compared.wall_s:.0f}s", "ktok @ that"]
    header += [f"loss @{compared.tokens / 1e3:.0f} ktok"]
    rows = []
    for r in results:
        cus = [f"{r.sites[s].utilisation:.3f}" + ("*" if s == r.killed else "") for s in names]
        cells = [r.name, *cus, f"{r.cu_min:.3f}"]
        waits = [u.blocked_per_round_s for u in r.sites.values()]
        cells += [f"{max(waits):.2f}", f"{r.tokens_trained / 1e3:.0f}"]
        cells += [f"{r.tokens_counted / 1e3:.0f}", str(r.points[-1].version if r.points else 0)]
        cells += [f"{compared.loss_at_wall[r.name]:.4f}"]
        cells += [f"{compared.tokens_at_wall[r.name] / 1e3:.0f}"]
        cells += [f"{compared.loss_at_tokens[r.name]:.4f}"]
        rows.append(tuple(cells))
    print_table(rows, tuple(header))


def headline(results: Sequence[RunResult], compared: Compared) -> dict[str, float]:
    by = {r.name: r for r in results}
    out: dict[str, float] = {}
    for name in ("async", "streaming", "blocking"):
        if name in by:
            out[f"{name}_cu_min"] = by[name].cu_min
    for name in ("async-kill", "streaming-kill"):
        if name in by:
            out[f"{name.replace('-', '_')}_cu_min"] = by[name].cu_min
    if "async-kill" in by and "streaming-kill" in by:
        out["async_kill_loss_vs_streaming_kill_pct"] = pct(
            compared.loss_at_wall["async-kill"], compared.loss_at_wall["streaming-kill"]
        )
    if "async" in by and "streaming" in by:
        a, s = compared.loss_at_wall["async"], compared.loss_at_wall["streaming"]
        out["async_loss_vs_streaming_pct"] = pct(a, s)
        out["async_tokens_vs_streaming"] = (
            compared.tokens_at_wall["async"] / compared.tokens_at_wall["streaming"]
            if compared.tokens_at_wall["streaming"]
            else math.nan
        )
        at_tokens = compared.loss_at_tokens
        out["async_loss_vs_streaming_equal_tokens_pct"] = pct(
            at_tokens["async"], at_tokens["streaming"]
        )
    return out


def last_line(figures: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in figures.items())


def plot(results: Sequence[RunResult], png: Path, title: str) -> None:
    """Validation loss over wall time and over counted tokens, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        left.plot([p.at_s for p in r.points], [p.loss for p in r.points], marker=".", label=r.name)
        right.plot([p.tokens / 1e3 for p in r.points], [p.loss for p in r.points], marker=".")
    left.set(xlabel="seconds since the first inner step", ylabel="validation loss of theta")
    right.set(xlabel="tokens counted into theta (thousands)")
    left.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
