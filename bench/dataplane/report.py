"""The figures of ``python -m bench.dataplane``: the table, the picture, the last line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.dataplane.floor import GB, PassFloor, TlsFloor
from bench.dataplane.run import JobRun


@dataclass(frozen=True)
class Figures:
    """CPU seconds per GB moved, measured and floor, of each side."""

    coord: float
    coord_floor: float
    agent: float
    agent_floor: float
    coord_push_floor: float
    coord_fetch_floor: float
    agent_push_floor: float
    agent_fetch_floor: float

    @classmethod
    def of(cls, job: JobRun, tls: TlsFloor, passes: PassFloor) -> Figures:
        up, down = job.push.bytes / GB, job.fetch.bytes / GB
        moved = up + down
        coord_push = tls.server_recv + passes.memcpy + passes.digest + passes.add
        agent_push = tls.client_send + passes.digest
        agent_fetch = tls.client_recv + passes.memcpy + passes.digest
        coord_cpu = job.push.coordinator + job.close.coordinator + job.fetch.coordinator
        return cls(
            coord=coord_cpu / moved,
            coord_floor=(up * coord_push + down * tls.server_send) / moved,
            agent=(job.push.agents + job.fetch.agents) / moved,
            agent_floor=(up * agent_push + down * agent_fetch) / moved,
            coord_push_floor=coord_push,
            coord_fetch_floor=tls.server_send,
            agent_push_floor=agent_push,
            agent_fetch_floor=agent_fetch,
        )

    def last_line(self) -> str:
        return (
            f"coord_cpu_s_per_gb={self.coord:.3f} coord_floor_cpu_s_per_gb={self.coord_floor:.3f}"
            f" agent_cpu_s_per_gb={self.agent:.3f}"
            f" agent_floor_cpu_s_per_gb={self.agent_floor:.3f}"
            f" coord_vs_floor={self.coord / self.coord_floor:.2f}"
            f" agent_vs_floor={self.agent / self.agent_floor:.2f}"
        )


def _per_gb(seconds: float, nbytes: int) -> str:
    return f"{seconds / (nbytes / GB):.3f}" if nbytes else "-"


def _cores(phase) -> str:
    """The coordinator's CPU over the phase's wall time: how many cores it kept busy."""
    return f"{phase.coordinator / phase.seconds:.2f}" if phase.seconds else "-"


def print_table(job: JobRun, f: Figures, args) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"CPU s per GB moved: {args.size} model ({job.model_bytes / 1e6:.0f} MB fp32), "
        f"{args.sites} sites, {args.codec}, {job.rounds} measured rounds"
    )
    t = Table(title=title)
    columns = ("phase", "GB", "coordinator s/GB", "floor", "cores", "agents s/GB", "floor")
    for col in columns:
        t.add_column(col, justify="left" if col == "phase" else "right")
    t.add_row(
        "push (receive, check, spool, fold)",
        f"{job.push.bytes / GB:.2f}",
        _per_gb(job.push.coordinator, job.push.bytes),
        f"{f.coord_push_floor:.3f}",
        _cores(job.push),
        _per_gb(job.push.agents, job.push.bytes),
        f"{f.agent_push_floor:.3f}",
    )
    t.add_row(
        "close (fold rest, step, publish), per GB pushed",
        "",
        _per_gb(job.close.coordinator, job.push.bytes),
        "0",
        _cores(job.close),
        "",
        "",
    )
    t.add_row(
        "fetch (serve theta)",
        f"{job.fetch.bytes / GB:.2f}",
        _per_gb(job.fetch.coordinator, job.fetch.bytes),
        f"{f.coord_fetch_floor:.3f}",
        _cores(job.fetch),
        _per_gb(job.fetch.agents, job.fetch.bytes),
        f"{f.agent_fetch_floor:.3f}",
    )
    t.add_row(
        "all",
        "",
        f"{f.coord:.3f}",
        f"{f.coord_floor:.3f}",
        "",
        f"{f.agent:.3f}",
        f"{f.agent_floor:.3f}",
    )
    t.add_row(
        "checkpoint (background), per GB pushed",
        "",
        _per_gb(job.checkpoint_s, job.push.bytes),
        "",
        "",
        "",
        "",
    )
    Console(width=120).print(t)
    by = Table(title="the coordinator's CPU by thread, s per GB of the phase's bytes")
    by.add_column("threads")
    for name in ("push", "close", "fetch"):
        by.add_column(name, justify="right")
    groups = sorted(
        set(job.push.coordinator_groups)
        | set(job.close.coordinator_groups)
        | set(job.fetch.coordinator_groups)
    )
    for g in groups:
        by.add_row(
            g,
            _per_gb(job.push.coordinator_groups.get(g, 0.0), job.push.bytes),
            _per_gb(job.close.coordinator_groups.get(g, 0.0), job.push.bytes),
            _per_gb(job.fetch.coordinator_groups.get(g, 0.0), job.fetch.bytes),
        )
    Console(width=120).print(by)


def plot(job: JobRun, f: Figures, path: Path) -> None:
    """Bars: each side's CPU per GB, measured beside its floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    up, down = job.push.bytes / GB, job.fetch.bytes / GB
    moved = up + down
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = ["coordinator", "coordinator floor", "agent", "agent floor"]
    parts = {
        "push": [
            job.push.coordinator / moved,
            up * f.coord_push_floor / moved,
            job.push.agents / moved,
            up * f.agent_push_floor / moved,
        ],
        "close": [job.close.coordinator / moved, 0.0, 0.0, 0.0],
        "fetch": [
            job.fetch.coordinator / moved,
            down * f.coord_fetch_floor / moved,
            job.fetch.agents / moved,
            down * f.agent_fetch_floor / moved,
        ],
    }
    bottom = [0.0] * 4
    for name, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("CPU seconds per GB moved")
    ax.set_title("Data plane CPU per byte, beside its floor (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
