"""Site health: what the probe measures, and when a site is drained for it.

Each site's trainers run a probe when they start (the site's join) and before every
``every_rounds``-th round: a timed matmul on their device, an all-reduce over the site's own
process group, and on GPUs the error counters the driver exposes
(``site_client.trainer.health_probe``).
The agent sends the newest result in its heartbeats; the coordinator shows it in status and
metrics and, with ``min_fraction > 0``, drains a site far below the others::

    [health]
    enabled = true           # false: no probes at all
    every_rounds = 10        # probe again before every 10th round (0: only when trainers start)
    min_fraction = 0.25      # drain a site below 0.25 x the median of the sites (0: never)
    drain_on_gpu_errors = true
    matmul_size = 0          # n of the n x n matmul timed (0: 4096 on a GPU, 256 on a CPU)
    allreduce_mib = 0        # MiB all-reduced over the site's ranks (0: 64 on a GPU, 1 on a CPU)

Defaults: probes on, at the trainers' start only, and no drain for throughput (``min_fraction =
0``): sites of one job often differ in hardware on purpose, and a probe on a shared host is
noisy, so the fraction that means "broken" is the operator's to choose.

The comparison needs at least ``MIN_PEERS`` sites reporting the same measure: with two, "far
below the others" has one other to go by, and one site reporting an inflated figure would
drain an honest one. A figure is the reporting site's word: one false report moves the median
by at most one place, so it can only get an honest site drained that is already below
``min_fraction`` of another honest site's figure (the next one up). A drain that would leave
fewer than ``rounds.min_sites`` sites in the job is held back (and said so). Everything here is
a pure function of the reports and the config: both sides read the table from the same job
config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wire.config_table import as_table, load_table, non_negative, rule, setting
from wire.proto import isthmus_pb2 as pb

MIN_PEERS = 3
MEASURES = (("matmul_gflops", "matmul", "GFLOP/s"), ("allreduce_gbps", "all-reduce", "GB/s"))


@dataclass(frozen=True)
class HealthConfig:
    """The ``[health]`` table (see the module docstring)."""

    enabled: bool = setting(True, help="site health probes (false: none at all)")
    every_rounds: int = setting(
        0,
        check=non_negative,
        help="probe again before every N-th round (0: only when the trainers start)",
    )
    min_fraction: float = setting(
        0.0,
        check=rule(lambda v: 0.0 <= v < 1.0, "must be in [0, 1) (0: never drain)"),
        help="drain a site whose matmul rate (or, among sites of several ranks, all-reduce "
        "bandwidth) is below this fraction of the median of the sites, once three or more "
        "report",
    )
    drain_on_gpu_errors: bool = setting(
        True, help="drain a site whose probe reports uncorrected GPU ECC errors"
    )
    matmul_size: int = setting(
        0,
        check=rule(lambda v: 0 <= v <= 16384, "must be in [0, 16384]"),
        help="n of the n x n matmul timed (0: 4096 on a GPU, 256 on a CPU)",
    )
    allreduce_mib: int = setting(
        0,
        check=rule(lambda v: 0 <= v <= 4096, "must be in [0, 4096]"),
        help="MiB all-reduced over the site's ranks (0: 64 on a GPU, 1 on a CPU)",
    )

    def due(self, round_number: int) -> bool:
        """Whether the trainers probe again before ``round_number`` (beyond their start)."""
        every = self.every_rounds
        return self.enabled and every > 0 and round_number > 0 and round_number % every == 0


def health_from_job(job_config: Mapping[str, Any]) -> HealthConfig:
    """The ``[health]`` table of a parsed job config (the defaults when it has none)."""
    return load_table(HealthConfig, as_table(job_config.get("health", {}), "health"), "health")


@dataclass(frozen=True)
class Probe:
    """One site's newest probe, as the coordinator keeps it."""

    round: int
    matmul_gflops: float
    allreduce_gbps: float
    world_size: int
    device: str
    gpu_errors: tuple[str, ...] = ()
    seq: int = 0

    @classmethod
    def of_report(cls, report: pb.HealthReport) -> Probe:
        """From a ``HealthReport`` message (checked by ``problem``, not here)."""
        return cls(
            round=report.round,
            matmul_gflops=report.matmul_gflops,
            allreduce_gbps=report.allreduce_gbps,
            world_size=report.world_size,
            device=report.device,
            gpu_errors=tuple(report.gpu_errors),
            seq=report.seq,
        )

    def to_report(self) -> pb.HealthReport:
        """As a ``HealthReport`` message (the inverse of ``of_report``)."""
        return pb.HealthReport(
            round=self.round,
            matmul_gflops=self.matmul_gflops,
            allreduce_gbps=self.allreduce_gbps,
            world_size=self.world_size,
            device=self.device,
            gpu_errors=list(self.gpu_errors),
            seq=self.seq,
        )

    def problem(self) -> str | None:
        """What makes this report unreadable, if anything (it is then refused whole)."""
        for name in ("matmul_gflops", "allreduce_gbps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value < 1e9):
                return f"health.{name} must be a finite number in [0, 1e9), got {value!r}"
        if len(self.device) > 128 or len(self.gpu_errors) > 16:
            return "health: device over 128 characters or more than 16 gpu_errors"
        if any(len(e) > 256 for e in self.gpu_errors):
            return "health.gpu_errors: an entry over 256 characters"
        # Shown in logs and on operators' terminals: no control characters (forged log
        # lines, escape sequences).
        if not all(text.isprintable() for text in (self.device, *self.gpu_errors)):
            return "health: device and gpu_errors must be printable text"
        return None


@dataclass(frozen=True)
class Verdict:
    """A site the rules say to drain, and why; ``held`` when ``min_sites`` keeps it in."""

    site: str
    reason: str
    held: bool = False


def health_verdicts(
    probes: Mapping[str, Probe],
    cfg: HealthConfig,
    in_job: set[str],
    min_sites: int,
) -> list[Verdict]:
    """The sites of ``in_job`` (live and not drained) to drain for their probes, by name.

    Parameters
    ----------
    probes
        Each site's newest probe (sites without one are not judged, and not peers).
    cfg
        ``[health]``.
    in_job
        The sites holding a lease and not drained: the candidates and the peers.
    min_sites
        ``rounds.min_sites``: drains past the point where fewer would remain are ``held``.
    """
    judged = {s: p for s, p in probes.items() if s in in_job}
    found: dict[str, str] = {}
    if cfg.drain_on_gpu_errors:
        for site, p in sorted(judged.items()):
            if p.gpu_errors:
                found[site] = f"GPU errors: {'; '.join(p.gpu_errors)}"
    if cfg.min_fraction > 0:
        for site, reason in _slow_sites(judged, cfg.min_fraction):
            found.setdefault(site, reason)
    verdicts, room = [], len(in_job) - min_sites
    for site in sorted(found):
        verdicts.append(Verdict(site, found[site], held=room <= 0))
        room -= 1
    return verdicts


def _slow_sites(probes: Mapping[str, Probe], fraction: float) -> list[tuple[str, str]]:
    slow = []
    for attr, label, unit in MEASURES:
        # An all-reduce over one rank measures nothing: such sites are no peers for it.
        values = {
            s: getattr(p, attr)
            for s, p in probes.items()
            if attr == "matmul_gflops" or p.world_size > 1
        }
        if len(values) < MIN_PEERS:
            continue
        median = _median(list(values.values()))
        for site, value in sorted(values.items()):
            if value < fraction * median:
                slow.append(
                    (
                        site,
                        f"{label} {value:.3g} {unit} is {value / median:.2f} of the median "
                        f"{median:.3g} {unit} of {len(values)} sites "
                        f"(health.min_fraction {fraction:g})",
                    )
                )
    return slow


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
