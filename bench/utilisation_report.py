"""What ``python -m bench.utilisation`` computes from a run (see its docstring): a site's
compute utilisation from its trainer's ``"steps"`` records, the table, the plot and the last
line."""

from __future__ import annotations

import json
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
    link_mbit: float = 0.0
    val_loss: float = float("nan")
    seconds: float = 0.0  # the whole run: start-up and shut-down included
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.mode} {self.codec} {self.link_mbit:g} Mbit/s"

    @property
    def key(self) -> str:
        return f"util_{self.mode}_{self.codec}_{self.link_mbit:g}mbit"

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
    columns = ("mode", "codec", "Mbit/s", "P", "tau")
    columns += (*(f"util s{i}" for i in range(n)), "util mean")
    columns += ("up MB", "down MB", "wall s", "blocked s/round", "val loss")
    rows = []
    for r in results:
        utils = [f"{s.utilisation:.3f}" for s in r.sites] + ["-"] * (n - len(r.sites))
        rows.append(
            (
                r.mode,
                r.codec,
                f"{r.link_mbit:g}",
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
    """Each run's mean utilisation, by mode, codec and link rate (the line before last)."""
    return {r.key: f"{r.utilisation:.4f}" for r in results}


def headline(results: list[Result], link_mbit: float, rtt_ms: float, model_mb: float) -> dict:
    """The last line: fp32 blocking and streaming at the main link rate, and that link."""

    def at(mode: str) -> Result | None:
        return next(
            (r for r in results if (r.mode, r.codec, r.link_mbit) == (mode, "fp32", link_mbit)),
            None,
        )

    blocking, streaming = at("blocking"), at("streaming")
    nan = float("nan")
    out = {
        "blocking_cu": f"{blocking.utilisation if blocking else nan:.4f}",
        "streaming_cu": f"{streaming.utilisation if streaming else nan:.4f}",
        "link_mbit": f"{link_mbit:g}",
        "rtt_ms": f"{rtt_ms:g}",
        "model_mb": f"{model_mb:.2f}",
        "fragments": str(streaming.fragments if streaming else 0),
        "tau": str(streaming.delay_steps if streaming else 0),
    }
    if blocking and streaming:
        out["streaming_over_blocking"] = f"{streaming.utilisation / blocking.utilisation:.3f}"
    return out


def parse_figures(line: str) -> dict[str, float]:
    """The last line back into numbers (what the smoke test and scripts read)."""
    return {k: float(v) for k, v in (item.split("=", 1) for item in line.split())}


def plot(results: list[Result], path: Path, title: str, link_mbit: float) -> None:
    """Left: utilisation against link rate (fp32), both modes. Right: each codec at the main
    link rate. Dots: the sites."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    colours = {"blocking": "tab:grey", "streaming": "tab:blue"}
    for mode, colour in colours.items():
        runs = sorted(
            (r for r in results if r.mode == mode and r.codec == "fp32"), key=lambda r: r.link_mbit
        )
        if runs:
            xs = [r.link_mbit for r in runs]
            left.plot(xs, [r.utilisation for r in runs], "o-", color=colour, label=mode)
            for r in runs:
                left.scatter([r.link_mbit] * len(r.sites), [s.utilisation for s in r.sites],
                             color="black", s=10)  # fmt: skip
    left.set_xscale("log", base=2)
    rates = sorted({r.link_mbit for r in results if r.codec == "fp32"})
    left.set_xticks(rates, [f"{x:g}" for x in rates])
    left.minorticks_off()
    left.set_xlabel("link rate per direction per site (Mbit/s)")
    left.set_ylabel("compute utilisation (inner steps / wall)")
    left.set_ylim(0, 1.05)
    left.axhline(0.95, color="tab:blue", linestyle=":", linewidth=0.8)
    left.legend()
    left.set_title("float32 both ways", fontsize=9)
    main = [r for r in results if r.link_mbit == link_mbit]
    xs = range(len(main))
    right.bar(xs, [r.utilisation for r in main], color=[colours[r.mode] for r in main])
    for x, r in zip(xs, main, strict=True):
        right.text(x, 0.03, f"{r.utilisation:.2f}", ha="center", color="white")
    right.set_xticks(list(xs), [f"{r.mode}\n{r.codec}" for r in main])
    right.set_ylim(0, 1.05)
    right.set_title(f"codecs both ways at {link_mbit:g} Mbit/s", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
