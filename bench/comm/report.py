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


def blocking_of(r: Result, results: list[Result]) -> Result | None:
    """The blocking DiLoCo run a streaming run compares against: same H and codec, the same
    outer lr / momentum when there is one, else the best of them."""
    same = [
        b
        for b in results
        if not b.job.streaming and (b.job.h, b.job.codec) == (r.job.h, r.job.codec)
    ]
    exact = [
        b
        for b in same
        if (b.job.outer_lr, b.job.outer_momentum) == (r.job.outer_lr, r.job.outer_momentum)
    ]
    return min(exact or same, key=lambda b: b.loss, default=None)


def _vs_blocking(r: Result, results: list[Result]) -> tuple[str, str]:
    """The ``vs blk %`` and ``peak/blk`` cells of a row (blank unless streaming with a blocking
    run to compare against)."""
    b = blocking_of(r, results) if r.job.streaming else None
    if b is None:
        return f"{'':>9}", f"{'':>9}"
    return f"{gap_pct(r, b):>9.2f}", f"{r.peak_bytes / b.peak_bytes:>9.2f}"


def table(ddp_runs: list[Result], results: list[Result], baseline: Result, steps: int) -> str:
    """One row per run: synchronisations (steps or rounds), streaming's P / tau / alpha, loss,
    gap to the baseline (and, streaming, to blocking DiLoCo at the same H and codec), bytes per
    direction (data parallel's all-reduce has no direction), the byte ratio and the largest
    single transfer (and, streaming, its ratio to blocking's)."""
    head = (
        f"{'run':<34}{'syncs':>7}{'P':>3}{'tau':>4}{'alpha':>6}{'val loss':>9}{'gap %':>7}"
        f"{'vs blk %':>9}{'uplink':>10}{'downlink':>10}{'WAN bytes':>10}{'ddp/bytes':>10}"
        f"{'peak':>10}{'peak/blk':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in ddp_runs:
        mark = "  <- baseline" if r is baseline else ""
        lines.append(
            f"{r.job.label:<34}{steps:>7}{'':>13}{r.loss:>9.4f}{gap_pct(r, baseline):>7.2f}"
            f"{'':>9}{'':>10}{'':>10}{fmt_bytes(r.nbytes):>10}{baseline.nbytes / r.nbytes:>10.1f}"
            f"{fmt_bytes(r.peak_bytes):>10}{'':>9}{mark}"
        )
    for r in results:
        j = r.job
        stream = f"{j.fragments:>3}{j.tau:>4}{j.alpha:>6g}" if j.streaming else f"{'':>13}"
        vs_gap, vs_peak = _vs_blocking(r, results)
        lines.append(
            f"{j.name:<34}{steps // j.h * j.syncs_per_h:>7}{stream}{r.loss:>9.4f}"
            f"{gap_pct(r, baseline):>7.2f}{vs_gap}"
            f"{fmt_bytes(r.up_bytes):>10}{fmt_bytes(r.down_bytes):>10}{fmt_bytes(r.nbytes):>10}"
            f"{baseline.nbytes / r.nbytes:>10.1f}{fmt_bytes(r.peak_bytes):>10}"
            f"{vs_peak}"
        )
    return "\n".join(line.rstrip() for line in lines)


def streaming_lines(results: list[Result]) -> list[str]:
    """One summary line per streaming run with a blocking run to compare against:
    ``streaming H=.. CODEC P=.. tau=.. alpha=.. loss=.. blocking_loss=.. gap_vs_blocking_pct=..
    peak_ratio=..``."""
    out = []
    for r in results:
        b = blocking_of(r, results) if r.job.streaming else None
        if b is not None:
            j = r.job
            out.append(
                f"streaming H={j.h} {j.codec} {j.outer_lr:g}/{j.outer_momentum:g} P={j.fragments} "
                f"tau={j.tau} alpha={j.alpha:g} loss={r.loss:.4f} blocking_loss={b.loss:.4f} "
                f"gap_vs_blocking_pct={gap_pct(r, b):.2f} "
                f"peak_ratio={r.peak_bytes / b.peak_bytes:.3f}"
            )
    return out


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
    for i, series in enumerate(dict.fromkeys(_series(r.job) for r in results)):
        pts = sorted((r.nbytes, r.loss, _point(r.job)) for r in results if _series(r.job) == series)
        xs, ys, _ = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="s" if "Streaming" in series else "o", label=series)
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


def _series(job) -> str:
    """A plot line: codec, and streaming's P."""
    links = "uplink/downlink" if "/" in job.codec else "both links"
    kind = f"Streaming DiLoCo P={job.fragments}" if job.streaming else "DiLoCo"
    return f"{kind} {job.codec} ({links})"


def _point(job) -> str:
    """A point's label: H, outer lr / momentum, and streaming's tau / alpha."""
    text = f"H={job.h} {job.outer_lr:g}/{job.outer_momentum:g}"
    return text + (f" tau={job.tau} a={job.alpha:g}" if job.streaming else "")
