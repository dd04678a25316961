"""The coordinator's Prometheus metrics (``coordinator serve --metrics HOST:PORT``).

Two sources. What happens between scrapes is counted as it happens: bytes per site, refusals
by method and status, updates counted with their codec ratio and arrival lag, and, from the
event stream (``EventSink`` observers), rounds closed with their duration and phases and the
checkpoints written. What is true now (round, sites, leases, phi, losses, units) is read off a
``StatusSnapshot`` at each scrape, the same data ``coordinator status`` shows, so the two never
disagree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from coordinator.observe.status import StatusSnapshot

log = logging.getLogger("isthmus.coordinator")
PREFIX = "isthmus_"
# Rounds take seconds on a LAN and up to hours on a slow WAN.
ROUND_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


class CoordinatorMetrics:
    """Counters fed by the servicer and the event stream; gauges read from ``snapshot``."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot], slots=None, send_slots=None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_in = Counter(
            PREFIX + "site_bytes_in", "Update bytes received from each site", ["site"], registry=r
        )
        self.bytes_out = Counter(
            PREFIX + "site_bytes_out", "theta bytes served to each site", ["site"], registry=r
        )
        self.refusals = Counter(
            PREFIX + "refusals",
            "Calls refused, by method and status",
            ["method", "code"],
            registry=r,
        )
        self.updates = Counter(PREFIX + "updates_counted", "Updates counted", ["site"], registry=r)
        self.codec_ratio = Gauge(
            PREFIX + "update_codec_ratio",
            "float32 bytes of the site's last counted update over the bytes it sent",
            ["site"],
            registry=r,
        )
        self.arrival_lag = Histogram(
            PREFIX + "update_arrival_lag_seconds",
            "From a round's opening to each update counted in it",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.rounds = Histogram(
            PREFIX + "round_seconds",
            "Rounds from opening to theta published",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.phases = Gauge(
            PREFIX + "round_phase_seconds",
            "The last closed round's phases: wait (for its updates), then those of its close",
            ["phase"],
            registry=r,
        )
        self.checkpoints = Histogram(
            PREFIX + "checkpoint_seconds",
            "Writing a checkpoint (in the background)",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.checkpoint_bytes = Gauge(
            PREFIX + "checkpoint_bytes", "Size of the last checkpoint written", registry=r
        )
        self._opened: float | None = None
        self.events = Counter(PREFIX + "events", "Events logged, by kind", ["kind"], registry=r)
        r.register(SnapshotCollector(snapshot))
        if slots is not None:  # coordinator.intake.receive_slots
            r.register(SlotsCollector(slots, RECEIVE_ROWS))
        if send_slots is not None:  # coordinator.service.send_slots
            r.register(SlotsCollector(send_slots, SEND_ROWS))

    # ---- fed as things happen -----------------------------------------------------------------

    def received(self, site: str, n: int) -> None:
        self.bytes_in.labels(site).inc(n)

    def sent(self, site: str, n: int) -> None:
        self.bytes_out.labels(site).inc(n)

    def refused(self, method: str, code: str) -> None:
        self.refusals.labels(method, code).inc()

    def event(self, kind: str, fields: dict) -> None:
        """An ``EventSink`` observer (called under the coordinator's lock: cheap only)."""
        self.events.labels(kind).inc()
        if kind == "round_open":
            self._opened = time.monotonic()
        elif kind == "round_closed":
            self._round_closed(fields.get("phases") or {})
        elif kind == "update":
            site = str(fields.get("site", ""))
            self.updates.labels(site).inc()
            if fields.get("bytes"):
                self.codec_ratio.labels(site).set(fields.get("fp32_bytes", 0) / fields["bytes"])
            if self._opened is not None:
                self.arrival_lag.observe(time.monotonic() - self._opened)
        elif kind == "checkpoint_written":
            self.checkpoints.observe(fields.get("seconds", 0.0))
            self.checkpoint_bytes.set(fields.get("bytes", 0))

    def _round_closed(self, phases: dict) -> None:
        closing = {k.removesuffix("_s"): v for k, v in phases.items() if isinstance(v, int | float)}
        if self._opened is not None:  # not for a round replayed after a restart
            total = time.monotonic() - self._opened
            self.rounds.observe(total)
            closing = {"wait": max(0.0, total - sum(closing.values())), **closing}
            self._opened = None
        for name, seconds in closing.items():
            self.phases.labels(name).set(seconds)


class SlotsCollector:
    """How many transfers of one kind run at once, and how many wait for a slot
    (``coordinator.intake.receive_slots``, ``coordinator.service.send_slots``): ``rows`` names and
    describes the four gauges, in the order (running, waiting, peak, capacity)."""

    def __init__(self, slots, rows: tuple[tuple[str, str], ...]) -> None:
        self.slots, self.rows = slots, rows

    def describe(self):
        return []

    def collect(self):
        running, waiting = self.slots.counts()
        values = (running, waiting, self.slots.peak, self.slots.capacity)
        for (name, doc), value in zip(self.rows, values, strict=True):
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))


RECEIVE_ROWS = (
    ("uploads_receiving", "Uploads being received now (on one stream or several)"),
    ("uploads_waiting", "Uploads waiting for a receive slot"),
    ("uploads_receiving_peak", "The most uploads received at once"),
    (
        "receive_slots",
        "Uploads received at once: server.concurrent_uploads or sized from the model (0: no limit)",
    ),
)
SEND_ROWS = (
    ("fetches_sending", "Fetch streams being sent now"),
    ("fetches_waiting", "Fetches waiting for a send slot"),
    ("fetches_sending_peak", "The most fetch streams sent at once"),
    ("send_slots", "server.concurrent_fetches (0: no limit)"),
)


class SnapshotCollector:
    """Gauges of the job as it is now, from one status snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot], slots=None, send_slots=None) -> None:
        self.snapshot = snapshot

    def describe(self):
        return []  # read at each scrape: nothing to register up front

    def collect(self):
        snap = self.snapshot()
        info = snap.round_info
        job = [
            ("round", "The round now open", info["round"]),
            ("theta_version", "The version of theta published", info["version"]),
            ("finished", "1 once the job has run all its rounds", int(info["finished"])),
            ("updates_received", "Updates counted in the open round", snap.updates_received),
            ("updates_expected", "Participants of the open round", snap.updates_expected),
            ("round_age_seconds", "How long the open round has been open", snap.round_age_s),
            ("wan_bytes_in", "Update bytes received in all", snap.wan_bytes_in),
            ("wan_bytes_out", "theta bytes served in all", snap.wan_bytes_out),
            (
                "units_committed",
                "Data units committed in the open round",
                len(snap.units_committed),
            ),
            ("units_pending", "Data units waiting for a later round", len(snap.units_pending)),
        ]
        for name, doc, value in job:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
        yield from _site_families(snap)
        codecs = CounterMetricFamily(
            PREFIX + "site_update_bytes_by_codec",
            "Bytes of a site's counted updates per codec (adaptive compression: per rung)",
            labels=["site", "codec"],
        )
        for site, codec, nbytes in snap.codec_bytes:
            codecs.add_metric([site, codec], float(nbytes))
        yield codecs
        if snap.evaluation is not None:  # [evaluation]: the newest result of the hook
            ev = snap.evaluation
            yield GaugeMetricFamily(
                PREFIX + "evaluation_version", "The theta version evaluated last", ev.version
            )
            family = GaugeMetricFamily(
                PREFIX + "evaluation", "The evaluation hook's metrics on it", labels=["name"]
            )
            for name, value in sorted(ev.metrics.items()):
                family.add_metric([name], float(value))
            yield family


def _site_families(snap: StatusSnapshot):
    per_site = {
        "site_live": ("1 while the site holds a lease", lambda s: float(s.state == "active")),
        "site_phi": ("The site's phi-accrual suspicion", lambda s: s.phi),
        "site_suspected": ("1 while the site is suspected", lambda s: float(s.suspected)),
        "site_lease_remaining_seconds": ("Until the lease lapses", lambda s: s.lease_remaining_s),
        "site_heartbeat_age_seconds": (
            "Since the last heartbeat",
            lambda s: s.last_heartbeat_age_s,
        ),
        "site_round": ("The round the site last reported", lambda s: float(s.progress.round)),
        "site_inner_step": ("The inner step it last reported", lambda s: s.progress.inner_step),
        "site_train_loss": ("Its last reported train loss", lambda s: s.progress.train_loss),
        "site_steps_per_second": (
            "Inner steps per second of its last task (0: none measured yet)",
            lambda s: s.progress.steps_per_s,
        ),
        "site_compute_utilisation": (
            "The share of time its trainers spent in tasks since their first (the rest: "
            "waiting on the WAN)",
            lambda s: s.progress.compute_utilisation,
        ),
        "site_late_updates": (
            "Of those, counted late (into a later round of their fragment)",
            lambda s: float(s.late_updates),
        ),
        "site_stale_versions": (
            "Of those, the versions of their fragment they were behind, summed (over "
            "site_late_updates: the mean staleness)",
            lambda s: float(s.stale_versions),
        ),
        "site_merge_wait_seconds": (
            "Seconds its trainers waited for late fragment results (streaming), in all",
            lambda s: s.progress.merge_wait_s,
        ),
        "site_drained": ("1 while the site is drained", lambda s: float(bool(s.drained))),
        "site_matmul_gflops": (
            "Its newest health probe: a timed matmul on its device (0: no probe yet)",
            lambda s: s.health.matmul_gflops,
        ),
        "site_allreduce_gbps": (
            "Its newest health probe: all-reduce bandwidth over its ranks (0: one rank)",
            lambda s: s.health.allreduce_gbps,
        ),
        "site_gpu_errors": (
            "GPU error counters its newest probe found",
            lambda s: float(len(s.health.gpu_errors)),
        ),
    }
    for name, (doc, value) in per_site.items():
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["site"])
        for site in snap.sites:
            family.add_metric([site.site], float(value(site)))
        yield family
