"""The run's report: counts, the kinds x outcomes table, findings grouped by signature, and
the printed summary whose last line is ``cases=N crashes=C state_changes=S``."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cases import Finding, _short, describe
from .constants import KINDS


@dataclass
class Report:
    seed: int
    cases: int = 0
    crashes: int = 0
    state_changes: int = 0
    elapsed_s: float = 0.0
    table: dict = field(default_factory=lambda: defaultdict(Counter))
    findings: list[Finding] = field(default_factory=list)
    log_tracebacks: list[str] = field(default_factory=list)
    status_bytes_max: int = 0
    stop_s: float = 0.0
    distinct: set = field(default_factory=set)
    skipped: Counter = field(default_factory=Counter)
    fuzzer_errors: list[str] = field(default_factory=list)
    flaky_restarts: int = 0
    workdir: Path | None = None
    honest_ms: list[float] = field(default_factory=list)  # heartbeats while calls were held

    def by_category(self, category: str) -> list[Finding]:
        return [f for f in self.findings if f.category == category]

    def table_lines(self) -> list[str]:
        codes = sorted({c for row in self.table.values() for c in row})
        kinds = [k for k in KINDS if k in self.table]
        kinds += sorted(k for k in self.table if k not in KINDS)
        width = max([len(k) for k in kinds] + [len("kind")])
        cols = [max(len(c), 5) for c in codes]
        heads = "  ".join(c.rjust(w) for c, w in zip(codes, cols, strict=True))
        lines = [f"{'kind'.ljust(width)}  {heads}  total"]
        for k in kinds:
            row = self.table[k]
            cells = "  ".join(str(row.get(c, 0)).rjust(w) for c, w in zip(codes, cols, strict=True))
            lines.append(f"{k.ljust(width)}  {cells}  {sum(row.values()):5d}")
        return lines

    def finding_lines(self, per_signature: int = 1) -> list[str]:
        groups: dict[tuple, list[Finding]] = defaultdict(list)
        for f in self.findings:
            groups[f.signature].append(f)
        lines = []
        for sig, items in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
            category, kind, ops, outcome = sig
            lines.append(
                f"[{category}] {len(items)} case(s): kind={kind} ops={list(ops)} outcome={outcome}"
            )
            for f in items[:per_signature]:
                lines.append(f"  case #{f.case_no}: {f.extra}".rstrip())
                if f.details:
                    lines.append(f"  details: {_short(f.details, 300)}")
                lines += ["  " + line for line in describe(f.case).splitlines()]
        return lines

    def summary(self) -> str:
        ranked = sorted(self.honest_ms)
        p99 = ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))] if ranked else 0.0
        return (
            f"cases={self.cases} crashes={self.crashes} state_changes={self.state_changes} "
            f"honest_heartbeat_p99_ms={p99:.1f}"
        )


def print_report(report: Report, out: Callable[[str], None] = print) -> None:
    out("")
    out(f"kinds x outcomes ({report.cases} cases, {report.elapsed_s:.1f}s, seed {report.seed}):")
    for line in report.table_lines():
        out("  " + line)
    if report.findings:
        out("")
        out("findings (one reproducer per signature; all in findings.jsonl):")
        for line in report.finding_lines():
            out("  " + line)
    for tb in report.log_tracebacks:
        out("coordinator log:")
        out("  " + tb.replace("\n", "\n  "))
    for err in report.fuzzer_errors[:3]:
        out("FUZZER ERROR (a bug of bench/fuzz.py, not of the server):")
        out("  " + err.replace("\n", "\n  "))
    counts = Counter(f.category for f in report.findings)
    out("")
    out(
        f"seed={report.seed} elapsed_s={report.elapsed_s:.1f} "
        f"cases_per_s={report.cases / max(report.elapsed_s, 1e-9):.0f} "
        f"log_tracebacks={len(report.log_tracebacks)} "
        f"echo_warnings={counts['echo']} spec_warnings={counts['spec']} "
        f"wrong_replies={counts['wrong_reply']} max_status_reply_bytes={report.status_bytes_max} "
        f"coordinator_stop_s={report.stop_s:.1f} distinct_cases={len(report.distinct)} "
        f"fuzzer_errors={len(report.fuzzer_errors)} hypothesis_restarts={report.flaky_restarts}"
        + "".join(f" skipped_{bug}={n}" for bug, n in sorted(report.skipped.items()))
    )
    if report.workdir is not None:
        out(f"workdir={report.workdir} (coordinator.log, findings.jsonl)")
    out(report.summary())
