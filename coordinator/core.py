"""The coordinator's state and the operations the RPCs perform on it.

Decisions (who is in a round, when it closes, whether an update counts, whether a lease is
valid) are made by the pure functions of ``rounds`` and ``leases``; this class holds the state
they decide on, does the file work (spool, checkpoints) and keeps the one lock. The gRPC
servicer is a thin translation layer over it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from coordinator.config import JobConfig
from coordinator.downlink import Downlink
from coordinator.events import EventLog
from coordinator.failure_detector import PhiAccrualDetector
from coordinator.intake import UpdateIntake
from coordinator.leases import LeaseError, LeaseTable
from coordinator.model_source import initial_theta, trainable_names
from coordinator.records import (
    Published,
    Refused,
    SiteRecord,
    check_name,
)
from coordinator.round_clock import RoundClock
from coordinator.rounds import RoundState, record_update
from coordinator.shared_data import SharedData
from coordinator.spool import SpooledUpdate, UpdateSpool
from coordinator.store import Checkpoint, CheckpointStore, StoreError
from coordinator.uploads import UploadTable
from strategies import RobustAggregator, load_strategy
from strategies.base import call_hook
from wire.tensors import pack, state_hash

log = logging.getLogger("isthmus.coordinator")


class CoordinatorCore(UpdateIntake, RoundClock, SharedData):
    """The coordinator's state; uploads are handled by ``UpdateIntake``, rounds by
    ``RoundClock``, data units (shared-data mode) by ``SharedData``."""

    def __init__(self, cfg: JobConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.store = CheckpointStore(cfg.state_dir)
        self.spool = UpdateSpool(cfg.state_dir / "spool")
        self.epoch = self.store.next_epoch()
        self.strategy = load_strategy(cfg.strategy.name, cfg.strategy.params)
        self.aggregator = RobustAggregator.from_config(cfg.aggregation)
        self.rejections: deque[str] = deque(maxlen=20)  # shown by `coordinator status`
        self.opts = cfg.rounds
        self.leases = LeaseTable(self.epoch, cfg.timeouts.lease_ttl_s)
        self.sites: dict[str, SiteRecord] = {}
        self.accepted: dict[str, SpooledUpdate] = {}
        self.uploads = UploadTable(self.spool)
        self.fatal: str | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_close_reason = ""
        self.downlink = Downlink(cfg.downlink) if cfg.downlink is not None else None
        self.detector = PhiAccrualDetector(cfg.timeouts.detector_options())
        self.suspicion_s = cfg.timeouts.suspicion_after_s()
        self.suspected: set[str] = set()
        self.ledger = None
        self.late: dict[str, SpooledUpdate] = {}  # late updates folded into the open round
        self.last_closed: dict | None = None
        # Beside the checkpoints: what happened, in order (joins, updates, backups, closes).
        self.events = EventLog(cfg.state_dir / "events.jsonl")
        self._restore()
        # Before any round: a job whose updates cannot be combined within memory stops here.
        like = {n: self.theta[n] for n in self.trainable}
        self.aggregator.check(self.strategy, cfg.rounds.max_sites, like)

    # ---- start-up -------------------------------------------------------------------------

    def _restore(self) -> None:
        ckpt = self.store.load_latest()
        if ckpt is None:
            theta = initial_theta(self.cfg.model)
            ckpt = Checkpoint(0, theta, {}, {"job": self.cfg.name})
            self.store.save(ckpt)
            log.info("new job %r: theta_0 has %d tensors", self.cfg.name, len(theta))
        elif ckpt.meta.get("job") != self.cfg.name:
            raise StoreError(
                f"state folder {self.cfg.state_dir} belongs to job {ckpt.meta.get('job')!r}, "
                f"not {self.cfg.name!r}: use another job.state_dir"
            )
        else:
            call_hook(self.strategy, "load_state_dict", ckpt.strategy_state)
            closed = ckpt.meta.get("closed_round", {})
            if closed:
                self.last_closed = {
                    "number": closed["number"],
                    "participants": set(closed.get("participants", closed["sites"])),
                    "sites": {k.partition("@")[0] for k in closed["sites"]},
                }
            for site, reason in sorted(closed.get("rejected", {}).items()):
                self.rejections.append(f"round {closed['number']}: {site}: {reason}")
            log.info("resumed job %r at round %d (epoch %d)", self.cfg.name, ckpt.round, self.epoch)
        self.theta = ckpt.theta
        if self.downlink is not None:
            self.downlink.load_state_dict(ckpt.downlink, ckpt.round)
        self.trainable = trainable_names(self.theta)
        self.round = RoundState(number=ckpt.round)
        if self.cfg.data.mode == "shared":
            self._restore_ledger(ckpt.meta)
        self.events.append("start", epoch=self.epoch, round=ckpt.round)
        self._publish()
        saved = self.spool.read_round(ckpt.round)
        expected: list[str] = []
        if saved is not None and not self.finished:
            # The round in flight at a crash: same participants, updates already spooled count.
            expected = sorted(saved["participants"])
            # The deadline runs from when the round first opened, not from this restart, or
            # repeated crashes could hold a round open for ever.
            elapsed = max(0.0, time.time() - saved.get("opened_wall", time.time()))
            self.round = replace(
                self.round, opened_at=self.clock() - elapsed, participants=frozenset(expected)
            )
            if self.shared:
                self._assign_units()
            for update in self.spool.completed(ckpt.round):
                self._replay(update)
            call_hook(self.strategy, "begin_round", self.round.number, self.theta)
            log.info("round %d replays with %d spooled update(s)", ckpt.round, len(self.accepted))
        else:
            # Between rounds, or after the last one (the sites still fetch the final theta):
            # the sites of the round closed last are expected back.
            closed_keys = ckpt.meta.get("closed_round", {}).get("sites", [])
            expected = sorted({k.partition("@")[0] for k in closed_keys})
            for update in self.spool.completed(ckpt.round):
                if "@late" in update.site:  # folded before the round opened
                    self.late[update.site] = update
        self._await_rejoin(expected)
        self.spool.drop_rounds_before(ckpt.round)

    def _replay(self, update: SpooledUpdate) -> None:
        """Count a spooled update of the round in flight again after a restart."""
        site, _, tag = update.site.partition("@")
        if tag.startswith("late"):
            self.late[update.site] = update
            return
        if tag:  # shared-data mode: the unit is committed again, by the same site
            if site not in self.ledger.holders(self.round.number, tag):
                self.ledger.add_backup(self.round.number, tag, site)
            self.ledger.commit(self.round.number, tag, site)
            self.commit_times[tag] = 0.0
        self.accepted[update.site] = update
        self.round = record_update(self.round, tag or site, update.weight)

    def _await_rejoin(self, sites: list[str]) -> None:
        """After a restart no site holds a lease yet. Hold a provisional lease (one TTL long,
        under a token nobody was given) for each site of the round in flight, so that the
        round neither closes without them nor opens without them while they back off and
        re-join; a site that does not come back within the TTL expires as usual."""
        now = self.clock()
        for site in sites:
            self.leases.grant(site, now)
            self.sites[site] = SiteRecord(state="rejoining", last_heartbeat=now)
        if sites:
            log.info("expecting %s to re-join", ", ".join(sites))

    def _publish(self) -> None:
        manifest, payload = pack(self.theta)
        d = self.downlink
        delta = (d.from_version, d.manifest, d.payload) if d is not None else (None, None, None)
        self.published = Published(
            self.round.number, state_hash(self.theta), manifest, payload, *delta
        )

    @property
    def finished(self) -> bool:
        return self.round.number >= self.cfg.rounds.total

    # ---- membership -----------------------------------------------------------------------

    def join(self, site: str, num_examples: int = 0):
        check_name("site name", site)
        with self.lock:
            now = self.clock()
            live = self.leases.live(now)
            if site not in live and len(live) >= self.cfg.rounds.max_sites:
                raise Refused(
                    "full", f"the job already has max_sites={self.cfg.rounds.max_sites} sites"
                )
            lease = self.leases.grant(site, now)
            self.sites[site] = SiteRecord(
                last_heartbeat=now,
                **_keep(self.sites.get(site), "last_update_at", "last_round_pushed"),
            )
            self.detector.forget(site)
            self.detector.heartbeat(site, now)
            self.events.append("join", site=site, token=lease.token)
            log.info("site %s joined (token %d)", site, lease.token)
            self.wake.notify_all()
            return lease, self.round_info(site)

    def heartbeat(self, site: str, token: int, progress: dict | None):
        with self.lock:
            now = self.clock()
            lease = self._lease(site, token, renew=True)
            record = self.sites.setdefault(site, SiteRecord())
            record.last_heartbeat, record.progress, record.state = now, progress, "active"
            self.detector.heartbeat(site, now)
            cancels = self.take_cancels(site) if self.shared else []
            return lease, self.round_info(site), cancels

    def leave(self, site: str, token: int) -> None:
        with self.lock:
            self._lease(site, token)
            self.leases.release(site, token, self.clock())
            self.sites.setdefault(site, SiteRecord()).state = "left"
            self.detector.forget(site)
            self.events.append("leave", site=site)
            log.info("site %s left", site)
            self.wake.notify_all()

    def _lease(self, site: str, token: int, renew: bool = False):
        try:
            if renew:
                return self.leases.renew(site, token, self.clock())
            return self.leases.check(site, token, self.clock())
        except LeaseError as exc:
            raise Refused("lease", str(exc)) from exc

    def round_info(self, site: str | None = None) -> dict:
        r = self.round
        info = {
            "round": r.number,
            "version": self.published.version,
            "theta_hash": self.published.theta_hash,
            "inner_steps": self.cfg.rounds.inner_steps,
            "total_rounds": self.cfg.rounds.total,
            "finished": self.finished,
            "participant": site is not None and site in r.participants and not r.closed,
        }
        if self.shared:
            unit = self.unit_for(site) if site is not None else ""
            info["data_unit"], info["participant"] = unit, bool(unit)
        return info

    # ---- theta downlink -------------------------------------------------------------------

    def fetch(
        self,
        site: str,
        token: int,
        version: int | None,
        offset: int,
        from_version: int | None = None,
    ) -> tuple[Published, bool]:
        """What to stream: the published theta and whether to serve it as the delta from
        ``from_version`` (only when that is the version the delta starts from)."""
        with self.lock:
            self._lease(site, token)
            pub = self.published
        if version is not None and version != pub.version:
            raise Refused(
                "not_found",
                f"version {version} is not served; the current version is {pub.version}",
            )
        as_delta = from_version is not None and from_version == pub.delta_from
        total = pub.delta_manifest.total_bytes if as_delta else pub.manifest.total_bytes
        if not 0 <= offset <= total:
            raise Refused("invalid", f"offset {offset} outside the {total}-byte payload")
        return pub, as_delta


def _keep(record: SiteRecord | None, *names: str) -> dict:
    return {n: getattr(record, n) for n in names} if record else {}
