"""The tables and the last line of ``python -m bench.sync``."""

from __future__ import annotations

import statistics

COLUMNS = ("model", "codec", "params", "MB", "sync s", "allreduce s", "sync/allreduce", "coord RSS")


def _rss(result, baseline: int) -> float:
    return (result.peak_rss - baseline) / (result.params * 4)


def print_table(rows: list[tuple[str, ...]], columns: tuple[str, ...]) -> None:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    for r in [columns, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def report(results, tiny, baseline: int, allreduce) -> None:
    ratios: dict[str, float] = {}
    rows = []
    for r in results:
        ar = allreduce(r.params)
        sync = statistics.median(r.syncs) if r.syncs else float("nan")
        if r.codec == "fp32":
            ratios[r.size] = sync / ar
        rows.append(
            (
                r.size,
                r.codec,
                f"{r.params / 1e6:.1f}M",
                f"{r.params * 4 / 1e6:.0f}",
                f"{sync:.3f}",
                f"{ar:.3f}",
                f"{sync / ar:.1f}",
                f"{_rss(r, baseline):.2f}x",
            )
        )
    print_table(rows, COLUMNS)
    print()
    print("where the sync goes (median seconds per round; the push includes the wait for the")
    print("site checkpoint, shown on its own line):")
    names = sorted({k for r in results for k in r.phases})
    heads = ("phase", *(f"{r.size} {r.codec}" for r in results))
    body = [(n, *(f"{r.phases[n]:.3f}" if n in r.phases else "-" for r in results)) for n in names]
    print_table(body, heads)
    print()
    print(
        f"1 MiB model, default timeouts (5 s heartbeat): a round every {tiny.round_period_s:.3f}s"
    )
    worst = max(_rss(r, baseline) for r in results)
    figures = {
        f"sync_vs_allreduce_{k}": f"{v:.2f}" for k, v in sorted(ratios.items(), reverse=True)
    }
    figures["round_1mib_s"] = f"{tiny.round_period_s:.3f}"
    figures["coord_rss_over_model"] = f"{worst:.2f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
