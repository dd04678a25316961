"""The tables and the last line of ``python -m bench.sync``."""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

COLUMNS = (
    "model",
    "codec",
    "params",
    "MB",
    "sync s",
    "allreduce s",
    "sync/allreduce",
    "mTLS floor s",
    "sync/floor",
    "coord RSS",
)


@dataclass(frozen=True)
class References:
    """What a sync of ``params`` float32 parameters is measured against, in the same run:
    ``allreduce`` a gloo all-reduce of the bytes between two processes; ``floor`` the bytes up
    and down over mutual-TLS gRPC and nothing else (``bench.sync_floor``)."""

    allreduce: Callable[[int], float]
    floor: Callable[[int], float]

    def cached(self) -> References:
        return References(functools.cache(self.allreduce), functools.cache(self.floor))


def _rss(result, baseline: int) -> float:
    return (result.peak_rss - baseline) / (result.params * 4)


def print_table(rows: list[tuple[str, ...]], columns: tuple[str, ...]) -> None:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    for r in [columns, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def report(results, tiny, baseline: int, references: References) -> None:
    refs = references.cached()  # one of each per model size
    fp32: dict[str, tuple[float, float, float]] = {}  # size: sync, all-reduce, floor
    params = {r.size: r.params for r in results}
    rows = []
    for r in results:
        ar, floor = refs.allreduce(r.params), refs.floor(r.params)
        sync = statistics.median(r.syncs) if r.syncs else float("nan")
        if r.codec == "fp32":
            fp32[r.size] = (sync, ar, floor)
        rows.append(
            (
                r.size,
                r.codec,
                f"{r.params / 1e6:.1f}M",
                f"{r.params * 4 / 1e6:.0f}",
                f"{sync:.3f}",
                f"{ar:.3f}",
                f"{sync / ar:.1f}",
                f"{floor:.3f}",
                f"{sync / floor:.1f}",
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
    busy = "  ".join(f"{r.size} {r.codec} {r.busy:.0%}" for r in results)
    print(f"the machine's CPU time busy during the syncs (all {os.cpu_count()} cores): {busy}")
    print(
        f"1 MiB model, default timeouts (5 s heartbeat): a round every {tiny.round_period_s:.3f}s"
    )
    worst = max(_rss(r, baseline) for r in results)
    by_size = sorted(fp32.items(), key=lambda kv: -params[kv[0]])  # the largest first
    figures = {f"sync_vs_allreduce_{k}": f"{s / ar:.2f}" for k, (s, ar, _) in by_size}
    figures |= {f"floor_vs_allreduce_{k}": f"{f / ar:.2f}" for k, (_, ar, f) in by_size}
    figures |= {f"sync_vs_floor_{k}": f"{s / f:.2f}" for k, (s, _, f) in by_size}
    figures |= {
        f"sync_machine_busy_{r.size}": f"{r.busy:.2f}" for r in results if r.codec == "fp32"
    }
    figures["round_1mib_s"] = f"{tiny.round_period_s:.3f}"
    figures["coord_rss_over_model"] = f"{worst:.2f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
