"""What ``python -m bench.adaptive`` computes from its runs (see its docstring): the link's
phases in coordinator rounds, each site's compute utilisation per phase, the codecs each round
went with, the table, the plot and the last line. Everything here is pure: it reads records
and files that the runs left behind."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.sync_report import print_table
from bench.utilisation_report import STEPS, SiteUse, read_jsonl

LADDER = ("none", "int8", "int4")  # the adaptive run's ladder, least lossy first


@dataclass(frozen=True)
class Phase:
    """A stretch of the run with the link at one rate: ``rounds`` coordinator rounds at
    ``mbit`` Mbit/s per direction per site."""

    name: str
    mbit: float
    rounds: int


def phase_bounds(phases: Sequence[Phase]) -> list[tuple[int, int]]:
    """Each phase's coordinator rounds as ``[first, end)``, one after another from round 0:
    the rounds whose updates are pushed at the phase's rate (the link takes it once round
    ``first - 1`` has closed, so round ``first - 1``'s delta is fetched at it too)."""
    bounds, first = [], 0
    for phase in phases:
        bounds.append((first, first + phase.rounds))
        first += phase.rounds
    return bounds


def slowest_phase(phases: Sequence[Phase]) -> int:
    """The index of the phase with the lowest rate (the first such)."""
    return min(range(len(phases)), key=lambda i: phases[i].mbit)


def task_phases(phases: Sequence[Phase]) -> list[int]:
    """The phase each task (coordinator round) counts in, by round.

    Task ``k`` merges round ``k - 1``'s sync, so it waits for that round's push (sent at the
    rate of round ``k - 1``'s phase) and its delta's fetch (at round ``k``'s phase's rate): it
    counts in the slower of the two phases. The slow phase's tasks are so every task that
    waited for a transfer on the slow link, the first one after it included."""
    of_round = [i for i, phase in enumerate(phases) for _ in range(phase.rounds)]
    out = []
    for k, current in enumerate(of_round):
        before = of_round[max(0, k - 1)]
        out.append(before if phases[before].mbit < phases[current].mbit else current)
    return out


def phase_uses(records: list[dict], phases: Sequence[Phase]) -> list[SiteUse | None]:
    """One site's utilisation in each phase (``task_phases``), from its trainer's records
    (None: no task of that phase was recorded, e.g. a run that stopped early)."""
    phase_of = dict(enumerate(task_phases(phases)))
    chosen: list[list[dict]] = [[] for _ in phases]
    for r in records:
        if r.get("kind") == STEPS and r.get("round") in phase_of:
            chosen[phase_of[r["round"]]].append(r)
    return [SiteUse.from_records(tasks) if tasks else None for tasks in chosen]


def uplink_codecs(push_records: Iterable[dict], fixed: str) -> dict[int, str]:
    """The codec of each round's update from a site's ``timings.jsonl`` (its ``"push"``
    records; the last one of a round counts). A push without a ``codec`` field (a fixed job
    records none) went with ``fixed``."""
    return {
        int(r["round"]): r.get("codec", fixed)
        for r in push_records
        if r.get("kind") == "push" and "round" in r
    }


def downlink_codecs(events: Iterable[dict], fixed: str) -> dict[int, str]:
    """The codec of each round's delta, from the coordinator's ``round_closed`` events (an
    event without ``downlink_codec``, a fixed job's, went with ``fixed``)."""
    return {
        int(e["round"]): e.get("downlink_codec", fixed)
        for e in events
        if e.get("kind") == "round_closed" and isinstance(e.get("round"), int)
    }


def loss_vs_pct(loss: float, reference: float) -> float:
    """``100 * (loss - reference) / reference``: how much worse than the reference, in %."""
    return 100.0 * (loss - reference) / reference


def min_cu(uses: Iterable[SiteUse | None]) -> float:
    """The lowest utilisation of the sites (nan if a site has none)."""
    values = [u.utilisation if u is not None else math.nan for u in uses]
    return min(values) if values and not any(math.isnan(v) for v in values) else math.nan


@dataclass
class RunResult:
    """One run of the benchmark (``name``: fp32, int8, int4 or adaptive)."""

    name: str
    sites: list[SiteUse]  # the whole training phase, per site
    phases: list[list[SiteUse | None]]  # per site, then per phase
    bytes_up: int
    bytes_down: int
    val_loss: float
    uplink: dict[str, dict[int, str]] = field(default_factory=dict)  # site -> round -> codec
    downlink: dict[int, str] = field(default_factory=dict)  # round -> codec
    seconds: float = 0.0

    @property
    def cu(self) -> float:
        """The whole run's compute utilisation, the lowest of the sites'."""
        return min_cu(self.sites)

    def cu_phase(self, index: int) -> float:
        """Phase ``index``'s utilisation, the lowest of the sites'."""
        return min_cu(per_site[index] for per_site in self.phases)

    @property
    def wan_mb(self) -> float:
        return (self.bytes_up + self.bytes_down) / 1e6


def rung_runs(codecs: Sequence[str]) -> str:
    """A codec per round as runs: ``none x4, int8 x10, none x4``."""
    parts: list[list] = []
    for codec in codecs:
        if parts and parts[-1][0] == codec:
            parts[-1][1] += 1
        else:
            parts.append([codec, 1])
    return ", ".join(f"{codec} x{n}" for codec, n in parts)


def codec_lines(result: RunResult) -> list[str]:
    """The run's codecs per round, each site's uplink and the downlink, as runs."""
    lines = []
    for site, by_round in sorted(result.uplink.items()):
        lines.append(f"uplink {site}: {rung_runs([by_round[r] for r in sorted(by_round)])}")
    ordered = [result.downlink[r] for r in sorted(result.downlink)]
    lines.append(f"downlink: {rung_runs(ordered)}")
    return lines


def table(results: list[RunResult], phases: Sequence[Phase]) -> None:
    columns = ("run", "CU", *(f"CU {p.name} {p.mbit:g}" for p in phases))
    columns += ("up MB", "down MB", "WAN MB", "val loss", "loss vs fp32 %", "run s")
    reference = next((r.val_loss for r in results if r.name == "fp32"), math.nan)
    rows = [
        (
            r.name,
            f"{r.cu:.3f}",
            *(f"{r.cu_phase(i):.3f}" for i in range(len(phases))),
            f"{r.bytes_up / 1e6:.1f}",
            f"{r.bytes_down / 1e6:.1f}",
            f"{r.wan_mb:.1f}",
            f"{r.val_loss:.4f}",
            f"{loss_vs_pct(r.val_loss, reference):+.2f}",
            f"{r.seconds:.0f}",
        )
        for r in results
    ]
    print_table(rows, columns)


def headline(results: list[RunResult], phases: Sequence[Phase]) -> dict[str, str]:
    """The last line: the adaptive run's utilisation (whole, slow phase) and loss against
    fixed fp32's, fixed int4's loss against fp32's, and fixed fp32's utilisation."""
    by_name = {r.name: r for r in results}
    slow = slowest_phase(phases)
    nan = math.nan

    def cu(name: str, phase: int | None = None) -> float:
        run = by_name.get(name)
        if run is None:
            return nan
        return run.cu if phase is None else run.cu_phase(phase)

    def loss_pct(name: str) -> float:
        run, fp32 = by_name.get(name), by_name.get("fp32")
        return loss_vs_pct(run.val_loss, fp32.val_loss) if run and fp32 else nan

    return {
        "adaptive_cu": f"{cu('adaptive'):.4f}",
        "adaptive_cu_slow": f"{cu('adaptive', slow):.4f}",
        "adaptive_loss_vs_fp32_pct": f"{loss_pct('adaptive'):.3f}",
        "fixed_int4_loss_vs_fp32_pct": f"{loss_pct('int4'):.3f}",
        "fixed_fp32_cu": f"{cu('fp32'):.4f}",
        "fixed_fp32_cu_slow": f"{cu('fp32', slow):.4f}",
    }


def last_line(figures: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in figures.items())


def rungs_by_round(by_round: dict[int, str], ladder: Sequence[str] = LADDER) -> tuple[list, list]:
    """Rounds and the ladder's index of each round's codec (for the plot)."""
    rounds = sorted(by_round)
    return rounds, [ladder.index(by_round[r]) if by_round[r] in ladder else -1 for r in rounds]


def plot(results: list[RunResult], phases: Sequence[Phase], path: Path, title: str) -> None:
    """Left: each run's utilisation per phase and over the whole run. Right: the adaptive
    run's rung per coordinator round, each site's uplink and the downlink, the slow phase
    shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    labels = ["whole run", *(f"{p.name} {p.mbit:g} Mbit/s" for p in phases)]
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        values = [r.cu if j == 0 else r.cu_phase(j - 1) for r in results]
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(results))]
        left.bar(xs, values, width, label=label)
    left.axhline(0.95, color="black", linestyle=":", linewidth=0.8)
    left.set_xticks(range(len(results)), [r.name for r in results])
    left.set_ylim(0, 1.25)
    left.set_ylabel("compute utilisation (lowest site)")
    left.legend(fontsize=8, loc="upper center", ncol=len(labels))
    left.set_title("CU per run and phase (dotted: 0.95)", fontsize=9)
    _plot_rungs(right, next((r for r in results if r.name == "adaptive"), None), phases)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_rungs(ax, adaptive: RunResult | None, phases: Sequence[Phase]) -> None:
    bounds = phase_bounds(phases)
    slow = slowest_phase(phases)
    ax.axvspan(bounds[slow][0] - 0.5, bounds[slow][1] - 0.5, color="tab:red", alpha=0.1,
               label=f"link {phases[slow].mbit:g} Mbit/s")  # fmt: skip
    if adaptive is not None:
        lines = [(f"uplink {s}", codecs) for s, codecs in sorted(adaptive.uplink.items())]
        for k, (label, by_round) in enumerate([*lines, ("downlink", adaptive.downlink)]):
            rounds, rungs = rungs_by_round(by_round)
            offset = (k - len(lines) / 2) * 0.04  # the lines side by side where they agree
            ax.step(rounds, [x + offset for x in rungs], where="mid", label=label,
                    linestyle="--" if label == "downlink" else "-")  # fmt: skip
    ax.set_yticks(range(len(LADDER)), LADDER)
    ax.set_ylim(-0.4, len(LADDER) - 0.6)
    ax.set_xlabel("coordinator round")
    ax.set_ylabel("codec (rung of the ladder)")
    ax.legend(fontsize=8)
    ax.set_title("the adaptive run's rung per round", fontsize=9)


def read_pushes(run_dir: Path) -> list[dict]:
    """A site agent's ``"push"`` timing records."""
    return [r for r in read_jsonl(Path(run_dir) / "timings.jsonl") if r.get("kind") == "push"]
