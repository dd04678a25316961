"""Who is in the job: leases, heartbeat history and what each site last said.

Every change to a lease goes through this class, next to the lease rule (``leases``): granted on
join, provisionally re-granted to the sites of the round in flight after a restart, renewed by
heartbeats and by the chunks of an update (a site busy sending is alive, even when its heartbeats
queue behind the upload on a slow link), released on leave, expired when it runs out. Suspicion
(phi-accrual over heartbeat intervals) lets a round stop waiting for a site long before its lease
lapses.

No clock and no I/O: every method takes ``now`` and returns what changed; the core logs it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from coordinator.config import TimeoutsConfig
from coordinator.members.failure_detector import PhiAccrualDetector
from coordinator.members.leases import Lease, LeaseError, LeaseTable
from coordinator.records import Refused, SiteRecord


@dataclass(frozen=True)
class SuspicionChange:
    """Sites suspected since the last look (with their phi), and sites heard from again."""

    suspected: tuple[tuple[str, float], ...] = ()
    recovered: tuple[str, ...] = ()


class Membership:
    def __init__(self, epoch: int, timeouts: TimeoutsConfig, max_sites: int) -> None:
        self.epoch = epoch  # this start of the coordinator; lease tokens carry it
        self.leases = LeaseTable(epoch, timeouts.lease_ttl_s)
        self.detector = PhiAccrualDetector(timeouts.detector_options())
        self.quiet_for_s = timeouts.suspicion_after_s()
        self.max_sites = max_sites
        self.sites: dict[str, SiteRecord] = {}
        self.suspected: frozenset[str] = frozenset()
        # Drained sites (``coordinator.members.drain``): in no round that opens from now on. Where
        # they hand their work back (shared-data mode) they are not waited for in the open one
        # either; otherwise they finish it.
        self.drained: frozenset[str] = frozenset()
        self.drained_hand_back = False

    def record(self, site: str) -> SiteRecord:
        return self.sites.setdefault(site, SiteRecord())

    # ---- lease changes --------------------------------------------------------------------

    def join(self, site: str, now: float) -> Lease:
        """A new lease (fencing out any older one); refused when the job is full."""
        live = self.leases.live(now)
        if site not in live and len(live) >= self.max_sites:
            raise Refused("full", f"the job already has max_sites={self.max_sites} sites")
        lease = self.leases.grant(site, now)
        old = self.sites.get(site)
        self.sites[site] = SiteRecord(
            last_heartbeat=now,
            last_update_at=old.last_update_at if old else None,
            last_round_pushed=old.last_round_pushed if old else None,
            codec_bytes=old.codec_bytes if old else {},
            updates_counted=old.updates_counted if old else 0,
            late_updates=old.late_updates if old else 0,
            stale_versions=old.stale_versions if old else 0,
        )
        self.detector.forget(site)
        self.detector.heartbeat(site, now)
        return lease

    def provisional(self, sites: list[str], now: float) -> None:
        """After a restart no site holds a lease yet: hold one TTL-long lease, under a token
        nobody was given, for each site of the round in flight, so that the round neither
        closes nor opens without them while they back off and re-join."""
        for site in sites:
            self.leases.grant(site, now)
            self.sites[site] = SiteRecord(state="rejoining", last_heartbeat=now)

    def check(self, site: str, token: int, now: float) -> Lease:
        try:
            return self.leases.check(site, token, now)
        except LeaseError as exc:
            raise Refused("lease", str(exc)) from exc

    def heartbeat(self, site: str, token: int, progress: dict | None, now: float) -> Lease:
        try:
            lease = self.leases.renew(site, token, now)
        except LeaseError as exc:
            raise Refused("lease", str(exc)) from exc
        record = self.record(site)
        record.last_heartbeat, record.progress, record.state = now, progress, "active"
        self.detector.heartbeat(site, now)
        return lease

    def data_arrived(self, site: str, token: int, now: float) -> None:
        """A chunk of an update arrived: renew the lease if it is still the current one."""
        with contextlib.suppress(LeaseError):
            self.leases.renew(site, token, now)
        self.record(site).last_data_at = now

    def leave(self, site: str, token: int, now: float) -> None:
        self.check(site, token, now)
        self.leases.release(site, token, now)
        self.record(site).state = "left"
        self.detector.forget(site)

    def expire(self, now: float) -> list[str]:
        gone = self.leases.expire(now)
        for site in gone:
            self.record(site).state = "expired"
            self.detector.forget(site)
        return gone

    # ---- views ----------------------------------------------------------------------------

    def live(self, now: float) -> set[str]:
        return self.leases.live(now)

    def responsive(self, now: float) -> set[str]:
        """Live sites a round waits for: not suspected and, where drained sites hand their work
        back (shared-data mode), not drained."""
        gone = self.drained if self.drained_hand_back else frozenset()
        return self.leases.live(now) - self.suspected - gone

    def candidates(self, now: float) -> set[str]:
        """The sites a round that opens now may take: live and not drained."""
        return self.leases.live(now) - self.drained

    def update_suspicion(self, now: float) -> SuspicionChange:
        """Suspect live sites whose phi crossed the threshold and that sent no data lately."""
        live = self.leases.live(now)
        quiet = {
            s
            for s in self.detector.suspected(now) & live
            if (rec := self.sites.get(s)) is None
            or rec.last_data_at is None
            or now - rec.last_data_at > self.quiet_for_s
        }
        change = SuspicionChange(
            tuple((s, self.detector.phi(s, now)) for s in sorted(quiet - self.suspected)),
            tuple(s for s in sorted(self.suspected - quiet) if s in live),
        )
        self.suspected = frozenset(quiet)
        return change

    def note_update(
        self,
        site: str,
        round_number: int,
        now: float,
        codecs: dict[str, int] | None = None,
        staleness: int = 0,
    ) -> None:
        """A counted update of ``site``; ``codecs``: its payload's bytes per codec;
        ``staleness``: a late one's versions of its fragment behind (0: on time)."""
        record = self.record(site)
        record.last_update_at, record.last_round_pushed = now, round_number
        record.updates_counted += 1
        record.late_updates += int(staleness > 0)
        record.stale_versions += staleness
        for codec, nbytes in (codecs or {}).items():
            record.codec_bytes[codec] = record.codec_bytes.get(codec, 0) + nbytes
