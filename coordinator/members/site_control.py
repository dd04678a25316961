"""Taking sites out of the job and letting them back: operator drains and the health rules.

A part of ``CoordinatorCore``, over its ``Membership`` and the durable ``DrainList``. Every
method but ``save`` runs under the core's lock; ``save`` writes the drain list once the lock is
released (its fsync must not hold up every other site's call), before the caller answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from coordinator.members.drain import DrainList
from coordinator.members.membership import Membership
from coordinator.persist.local_store import write_atomic
from wire.health import HealthConfig, Probe, health_verdicts

log = logging.getLogger("isthmus.coordinator")


class SiteControl:
    def __init__(
        self,
        drains: DrainList,
        members: Membership,
        health: HealthConfig,
        min_sites: int,
        post: Callable,
        hand_back: bool,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.drains, self.members, self.health = drains, members, health
        self.min_sites, self.post, self.wall = min_sites, post, wall
        members.drained = frozenset(drains.marks)
        members.drained_hand_back = hand_back
        self.told: dict[str, int] = {}  # site -> the lease token a WaitRound told of its drain
        self.held: set[str] = set()  # sites whose drain min_sites holds back (logged once)
        self.probed_in: dict[str, int] = {}  # site -> the round of its last probe taken in
        self.dirty = False  # the list changed since it was last written
        self._file = threading.Lock()

    # ---- drains ---------------------------------------------------------------------------

    def drain(self, site: str, reason: str, by: str) -> bool:
        """Drain ``site``; False if it already was."""
        if not self.drains.mark(site, reason, by, self.wall()):
            return False
        self.dirty = True
        self.members.drained = frozenset(self.drains.marks)
        self.post("drained", site=site, reason=self.drains.marks[site].reason, by=by)
        log.warning("site %s drained by %s: %s", site, by, self.drains.marks[site].reason)
        return True

    def undrain(self, site: str) -> bool:
        """Admit ``site`` again; False if it was not drained."""
        if not self.drains.unmark(site):
            return False
        self.dirty = True
        self.members.drained = frozenset(self.drains.marks)
        self.told.pop(site, None)
        self.held.discard(site)
        self.post("undrained", site=site)
        log.info("site %s undrained: it may join again", site)
        return True

    def drain_reason(self, site: str) -> str:
        """What ``Command.drain`` tells ``site`` ("" while it is not drained)."""
        return self.drains.reason(site)

    def untold(self, site: str, token: int) -> bool:
        """Whether ``site`` is drained and no round watch under this lease heard it yet."""
        return site in self.drains and self.told.get(site) != token

    def tell(self, site: str, token: int) -> None:
        if site in self.drains:
            self.told[site] = token

    def save(self, lock) -> None:
        """Write the drain list as it is now if it changed since the last write (call without
        holding ``lock``). A write that fails leaves it to write on the next call: an operator's
        retry of the same drain writes it, although nothing changes in memory then."""
        with self._file:
            with lock:
                if not self.dirty:
                    return
                data, self.dirty = self.drains.serialized(), False
            try:
                write_atomic(self.drains.path, data)
            except BaseException:
                with lock:
                    self.dirty = True
                raise

    # ---- health ---------------------------------------------------------------------------

    def take_probe(self, site: str, probe: Probe, round_number: int) -> bool:
        """Whether a new probe of ``site`` is taken in: one per site per round (the trainers
        probe far less often; more would only grow the event log and re-run the rules)."""
        if self.probed_in.get(site) == round_number:
            return False
        self.probed_in[site] = round_number
        return True

    def probed(self, site: str, probe: Probe, now: float) -> bool:
        """``site`` sent a new probe: apply the health rules; True if a site was drained."""
        self.post(
            "health",
            site=site,
            round=probe.round,
            matmul_gflops=round(probe.matmul_gflops, 3),
            allreduce_gbps=round(probe.allreduce_gbps, 4),
            world_size=probe.world_size,
            device=probe.device,
            gpu_errors=list(probe.gpu_errors),
        )
        probes = {s: r.health for s, r in self.members.sites.items() if r.health is not None}
        in_job = self.members.live(now) - self.members.drained
        drained = False
        for verdict in health_verdicts(probes, self.health, in_job, self.min_sites):
            if not verdict.held:
                drained |= self.drain(verdict.site, verdict.reason, "health")
            elif verdict.site not in self.held:
                self.held.add(verdict.site)
                log.warning(
                    "site %s would be drained (%s) but the job would then have fewer than "
                    "rounds.min_sites = %d sites",
                    verdict.site,
                    verdict.reason,
                    self.min_sites,
                )
        return drained
