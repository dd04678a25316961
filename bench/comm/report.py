"""Table, plot and summary line of ``python -m bench.comm_efficiency``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.comm.runs import Result

GAP_LIMIT_PCT = 1.0
TARGET_RATIO = 1000


def fmt_bytes(n: float) -> str:
    """``1234567`` -> ``1.2 MB`` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def gap_pct(result: Result, baseline: Result) -> float:
    return 100 * (result.loss - baseline.loss) / baseline.loss


def best_within(results: list[Result], baseline: Result) -> tuple[float, float]:
    """``(best_bytes_ratio, loss_gap_pct)``: the largest ``baseline bytes / bytes`` among runs
    within ``GAP_LIMIT_PCT`` of the baseline's loss and that run's gap; ``(0, smallest gap)``
    when no run is within it."""
    within = [r for r in results if gap_pct(r, baseline) <= GAP_LIMIT_PCT]
    if not within:
        return 0.0, min(gap_pct(r, baseline) for r in results)
    best = max(within, key=lambda r: baseline.nbytes / r.nbytes)
    return baseline.nbytes / best.nbytes, gap_pct(best, baseline)


def table(ddp_runs: list[Result], results: list[Result], baseline: Result, steps: int) -> str:
    """One row per run: codec(s), synchronisations (steps or rounds), loss, gap to the baseline,
    bytes per direction (data parallel's all-reduce has no direction) and the byte ratio."""
    head = (
        f"{'run':<36}{'syncs':>7}{'val loss':>10}{'gap %':>8}{'uplink':>11}{'downlink':>11}"
        f"{'WAN bytes':>11}{'ddp/bytes':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in ddp_runs:
        mark = "  <- baseline" if r is baseline else ""
        lines.append(
            f"{r.job.label:<36}{steps:>7}{r.loss:>10.4f}{gap_pct(r, baseline):>8.2f}"
            f"{'':>11}{'':>11}{fmt_bytes(r.nbytes):>11}{baseline.nbytes / r.nbytes:>11.1f}{mark}"
        )
    for r in results:
        lines.append(
            f"{r.job.label:<36}{steps // r.job.h:>7}{r.loss:>10.4f}{gap_pct(r, baseline):>8.2f}"
            f"{fmt_bytes(r.up_bytes):>11}{fmt_bytes(r.down_bytes):>11}{fmt_bytes(r.nbytes):>11}"
            f"{baseline.nbytes / r.nbytes:>11.1f}"
        )
    return "\n".join(lines)


def plot(ddp_runs: list[Result], results: list[Result], baseline: Result, path: Path) -> None:
    """Final validation loss against WAN bytes (log x), one line per codec over H; points are
    labelled with H and the outer lr / momentum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in ddp_runs:
        if r is not baseline:
            ax.scatter(
                [r.nbytes],
                [r.loss],
                marker="x",
                color="grey",
                label=f"data parallel lr={r.job.lr:g}",
            )
    ax.scatter(
        [baseline.nbytes],
        [baseline.loss],
        marker="*",
        s=200,
        color="black",
        label=f"data parallel (fp32 ring all-reduce, lr={baseline.job.lr:g})",
        zorder=3,
    )
    ax.axhline(
        baseline.loss * (1 + GAP_LIMIT_PCT / 100),
        color="grey",
        ls=":",
        lw=1,
        label=f"data parallel + {GAP_LIMIT_PCT:g} %",
    )
    for i, codec in enumerate(dict.fromkeys(r.job.codec for r in results)):
        pts = sorted(
            (r.nbytes, r.loss, f"H={r.job.h} {r.job.outer_lr:g}/{r.job.outer_momentum:g}")
            for r in results
            if r.job.codec == codec
        )
        xs, ys, _ = zip(*pts, strict=True)
        links = "uplink/downlink" if "/" in codec else "both links"
        ax.plot(xs, ys, marker="o", label=f"DiLoCo {codec} ({links})")
        for x, y, text in pts:
            # The first codec's labels above its points, the others' below: codecs at the same
            # H sit close together and would print over each other.
            offset = (4, 5) if i == 0 else (4, -11)
            ax.annotate(text, (x, y), textcoords="offset points", xytext=offset, fontsize=7)
    ax.axvline(
        baseline.nbytes / TARGET_RATIO,
        color="tab:red",
        ls="--",
        lw=1,
        label=f"{TARGET_RATIO}x fewer bytes than data parallel",
    )
    ax.set_xscale("log")

    def ratio(x):  # its own inverse; matplotlib probes 0 and negative values on log axes
        x = np.asarray(x, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(x > 0, baseline.nbytes / np.where(x > 0, x, 1.0), np.inf)

    top = ax.secondary_xaxis("top", functions=(ratio, ratio))
    top.set_xlabel("data-parallel bytes / bytes")
    ax.set_xlabel("WAN bytes, all sites, both directions (log)")
    ax.set_ylabel("final validation loss (nats/byte)")
    ax.set_title(
        "Validation loss vs WAN bytes at a fixed token budget, 4 sites\n"
        "(DiLoCo points: H, outer lr/momentum)",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
