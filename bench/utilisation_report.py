"""What ``python -m bench.utilisation`` computes from a run (see its docstring): a site's
compute utilisation from its trainer's ``"steps"`` records, the table, the plot and the last
line."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.sync_report import print_table

STEPS = "steps"  # the trainer's record of one task: see SiteUse.from_records


@dataclass(frozen=True)
class SiteUse:
    """One site's training phase, summed over its tasks (coordinator rounds).

    Attributes
    ----------
    tasks
        ``"steps"`` records read (one per task the trainer ran).
    compute_s
        Seconds inside the training script's step bodies, over all tasks.
    wall_s
        The training phase: end of the last step of any task minus start of the first step.
    gaps_s
        Seconds between one task's last step and the next task's first step, over all tasks
        (blocking DiLoCo waits here: push, the coordinator's close, fetch and load; the example
        trainer's validation of theta_r at the start of a round is here too).
    merge_wait_s
        Seconds blocked inside tasks waiting for a late fragment's result (streaming).
    """

    tasks: int
    compute_s: float
    wall_s: float
    gaps_s: float
    merge_wait_s: float

    @property
    def utilisation(self) -> float:
        """Time inside inner steps over the training phase's wall time."""
        return self.compute_s / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def blocked_per_round_s(self) -> float:
        """Mean seconds per task spent waiting: between one task and the next (over the
        tasks that have a next one), and for a fragment's merge."""
        return self.gaps_s / max(1, self.tasks - 1) + self.merge_wait_s / self.tasks

    @classmethod
    def from_records(cls, records: list[dict]) -> SiteUse:
        """From a trainer's timings: the ``"steps"`` records (fields ``round``, ``compute_s``,
        ``first_step_at``, ``last_step_at``, ``merge_wait_s``; wall-clock times); others are
        skipped. Utilisation = sum(compute_s) / (max(last_step_at) - min(first_step_at)).

        Raises
        ------
        ValueError
            No ``"steps"`` record: the trainer does not write them (or trained no step).
        """
        steps = sorted(
            (r for r in records if r.get("kind") == STEPS), key=lambda r: r["first_step_at"]
        )
        if not steps:
            raise ValueError(f'no "{STEPS}" records: the trainer does not record its inner steps')
        gaps = sum(
            max(0.0, b["first_step_at"] - a["last_step_at"])
            for a, b in zip(steps, steps[1:], strict=False)
        )
        return cls(
            tasks=len(steps),
            compute_s=sum(r["compute_s"] for r in steps),
            wall_s=max(r["last_step_at"] for r in steps) - min(r["first_step_at"] for r in steps),
            gaps_s=gaps,
            merge_wait_s=sum(r.get("merge_wait_s", 0.0) for r in steps),
        )


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def site_use(run_dir: Path) -> SiteUse:
    """The utilisation of the site whose agent ran in ``run_dir``."""
    path = Path(run_dir) / "trainer_timings.jsonl"
    try:
        return SiteUse.from_records(read_jsonl(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def final_val_loss(run_dir: Path) -> float:
    """The validation loss the site's trainer reported for the final theta (nan if none)."""
    finals = [m["val_loss"] for m in read_jsonl(Path(run_dir) / "metrics.jsonl") if m.get("final")]
    return finals[-1] if finals else float("nan")


@dataclass
class Result:
    """One run: its setting, each site's use, what crossed the WAN, how long it took."""

    mode: str  # "blocking" or "streaming"
    codec: str
    fragments: int
    delay_steps: int
    sites: list[SiteUse]
    bytes_up: int
    bytes_down: int
    val_loss: float = float("nan")
    seconds: float = 0.0  # the whole run: start-up and shut-down included
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.mode} {self.codec}"

    @property
    def key(self) -> str:
        return f"util_{self.mode}_{self.codec}"

    @property
    def utilisation(self) -> float:
        return statistics.mean(s.utilisation for s in self.sites)

    @property
    def wall_s(self) -> float:
        return max(s.wall_s for s in self.sites)

    @property
    def blocked_per_round_s(self) -> float:
        return statistics.mean(s.blocked_per_round_s for s in self.sites)


def table(results: list[Result]) -> None:
    n = max(len(r.sites) for r in results)
    columns = ("mode", "codec", "P", "tau", *(f"util s{i}" for i in range(n)), "util mean")
    columns += ("up MB", "down MB", "wall s", "blocked s/round", "val loss")
    rows = []
    for r in results:
        utils = [f"{s.utilisation:.3f}" for s in r.sites] + ["-"] * (n - len(r.sites))
        rows.append(
            (
                r.mode,
                r.codec,
                str(r.fragments),
                str(r.delay_steps),
                *utils,
                f"{r.utilisation:.3f}",
                f"{r.bytes_up / 1e6:.1f}",
                f"{r.bytes_down / 1e6:.1f}",
                f"{r.wall_s:.1f}",
                f"{r.blocked_per_round_s:.3f}",
                f"{r.val_loss:.4f}",
            )
        )
    print_table(rows, columns)


def figures(results: list[Result]) -> dict[str, str]:
    """The last line's ``key=value`` pairs: each run's mean utilisation, and streaming's over
    blocking's on fp32 (and on each other codec both modes ran)."""
    out = {r.key: f"{r.utilisation:.4f}" for r in results}
    by_key = {r.key: r.utilisation for r in results}
    for codec in dict.fromkeys(r.codec for r in results):
        blocking, streaming = (
            by_key.get(f"util_blocking_{codec}"),
            by_key.get(f"util_streaming_{codec}"),
        )
        if blocking and streaming and not math.isnan(blocking):
            suffix = "" if codec == "fp32" else f"_{codec}"
            out[f"streaming_over_blocking{suffix}"] = f"{streaming / blocking:.3f}"
    return out


def parse_figures(line: str) -> dict[str, float]:
    """The last line back into numbers (what the smoke test and scripts read)."""
    return {k: float(v) for k, v in (item.split("=", 1) for item in line.split())}


def plot(results: list[Result], path: Path, title: str) -> None:
    """Bars: each run's mean utilisation; dots: its sites."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(results) + 2), 4.5))
    xs = range(len(results))
    colours = ["tab:grey" if r.mode == "blocking" else "tab:blue" for r in results]
    ax.bar(xs, [r.utilisation for r in results], color=colours, alpha=0.8)
    for x, r in zip(xs, results, strict=True):
        ax.scatter([x] * len(r.sites), [s.utilisation for s in r.sites], color="black", s=12)
        ax.text(x, 0.03, f"{r.utilisation:.2f}", ha="center", color="white")
    labels = [f"{r.mode}\n{r.codec}" for r in results]
    labels = [
        f"{label}\nP={r.fragments} tau={r.delay_steps}" if r.mode == "streaming" else label
        for label, r in zip(labels, results, strict=True)
    ]
    ax.set_xticks(list(xs), labels)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("compute utilisation (inner steps / wall)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
