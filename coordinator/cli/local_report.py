"""What ``coordinator local`` shows: a line per closed round, then the summary of the job.

Training scripts report numbers (``rnd.report(train_loss=...)``, ``session.report(...)``); the
agents append them to ``RUN/<site>/metrics.jsonl`` tagged with the site and round. Every
number a script reports becomes a column, averaged over the sites that reported it for that
round, so any script gets its own table, not only the example's losses.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SKIP = {"site", "round", "data_unit", "final"}


def read_metrics(run_dir: Path, sites: Iterable[str]) -> list[dict]:
    """Every record the sites' agents wrote, in site order then as written."""
    records = []
    for site in sites:
        path = Path(run_dir) / site / "metrics.jsonl"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:  # a line being written right now
                continue
    return records


def by_round(records: list[dict]) -> dict[int, dict[str, float]]:
    """round -> metric -> mean over the records of that round that carry it."""
    sums: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        if not isinstance(rec.get("round"), int):
            continue
        for key, value in rec.items():
            if key not in SKIP and isinstance(value, int | float) and not isinstance(value, bool):
                sums[rec["round"]][key].append(float(value))
    return {r: {k: sum(v) / len(v) for k, v in m.items()} for r, m in sorted(sums.items())}


def round_line(number: int, total: int, metrics: dict[str, float], wan_mb: float) -> str:
    """The line printed when round ``number`` closes."""
    shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
    return f"round {number}/{total} closed  {shown}  WAN so far {wan_mb:.1f} MB"


def summary_table(rounds: dict[int, dict[str, float]]) -> list[str]:
    """One row per round, one column per metric (mean over sites; ``-`` where none)."""
    keys = sorted({k for m in rounds.values() for k in m})
    if not keys:
        return ["(the training script reported no metrics)"]
    width = max(12, *(len(k) for k in keys))
    rows = ["round  " + "  ".join(f"{k:>{width}s}" for k in keys)]
    for r, metrics in rounds.items():
        cells = [f"{metrics[k]:.4f}" if k in metrics else "-" for k in keys]
        rows.append(f"{r:5d}  " + "  ".join(f"{c:>{width}s}" for c in cells))
    return rows


@dataclass(frozen=True)
class HashCheck:
    """Whether every site ended on the coordinator's final theta."""

    coordinator: str
    sites: dict[str, str]

    @property
    def matches(self) -> bool:
        return bool(self.sites) and all(h == self.coordinator for h in self.sites.values())

    def line(self) -> str:
        if not self.sites:
            return "theta hashes: no site reported a final theta"
        if self.matches:
            return f"theta hashes: every site matches the coordinator ({self.coordinator[:12]})"
        wrong = sorted(s for s, h in self.sites.items() if h != self.coordinator)
        return f"theta hashes: {', '.join(wrong)} DIFFER from the coordinator"


def hash_check(run_dir: Path, sites: Iterable[str], coordinator_hash: str) -> HashCheck:
    found = {}
    for site in sites:
        try:
            found[site] = json.loads((Path(run_dir) / site / "final.json").read_text())[
                "theta_hash"
            ]
        except (OSError, ValueError, KeyError):
            continue
    return HashCheck(coordinator_hash, found)


def environment() -> str:
    """What, besides the job, the numbers depend on, as seen from this machine."""
    import platform

    import torch

    return (
        f"reproducible with: torch {torch.__version__}, CPU kernels "
        f"{torch.backends.cpu.get_cpu_capability()}, Python {platform.python_version()} "
        "(and the same config, sites, trainers per site and data)"
    )


def plot(rounds: dict[int, dict[str, float]], out: Path, title: str) -> Path | None:
    """Each metric against the round, as a PNG; None without matplotlib or metrics."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = sorted({k for m in rounds.values() for k in m})
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        points = [(r, m[key]) for r, m in rounds.items() if key in m]
        ax.plot(*zip(*points, strict=True), "o-", label=f"{key} (mean over sites)")
    ax.set_xlabel("outer round")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
