"""The coordinator's state and the operations the RPCs perform on it.

Decisions (who is in a round, when it closes, whether an update counts, whether a lease is
valid) are made by the pure functions of ``rounds`` and ``leases``; this class holds the state
they decide on, does the file work (spool, checkpoints) and keeps the one lock. The gRPC
servicer is a thin translation layer over it.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from coordinator.config import JobConfig
from coordinator.leases import LeaseError, LeaseTable
from coordinator.model_source import initial_theta, trainable_names
from coordinator.rounds import (
    RoundOptions,
    RoundState,
    UpdateRefused,
    admit_latecomers,
    admit_update,
    decide_close,
    next_round,
    open_round,
    record_update,
    waiting_reason,
)
from coordinator.spool import SpooledUpdate, UpdateSpool, read_tensors, weighted_mean
from coordinator.store import Checkpoint, CheckpointStore, StoreError
from coordinator.uploads import (
    Upload,
    UploadBusy,
    UploadConflict,
    UploadTable,
    check_update_manifest,
)
from strategies import Aggregate, load_strategy
from wire.chunking import ChunkError
from wire.tensors import Manifest, PayloadError, pack, state_hash

log = logging.getLogger("isthmus.coordinator")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Refused(Exception):
    """A request refused without any change of state. ``code`` picks the gRPC status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class FatalError(RuntimeError):
    """The job cannot go on (e.g. the strategy failed); the last checkpoint is intact."""


def check_name(kind: str, value: str) -> None:
    if not NAME_RE.match(value):
        raise Refused(
            "invalid",
            f"{kind} {value[:70]!r} is invalid: use 1-63 letters, digits, '.', '_' or '-'",
        )


@dataclass
class SiteRecord:
    state: str = "active"
    last_heartbeat: float = 0.0
    last_update_at: float | None = None
    last_round_pushed: int | None = None
    progress: dict | None = None


@dataclass(frozen=True)
class Published:
    version: int
    theta_hash: bytes
    manifest: Manifest
    payload: memoryview


class CoordinatorCore:
    def __init__(self, cfg: JobConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.store = CheckpointStore(cfg.state_dir)
        self.spool = UpdateSpool(cfg.state_dir / "spool")
        self.epoch = self.store.next_epoch()
        self.strategy = load_strategy(cfg.strategy.name, cfg.strategy.params)
        self.opts = RoundOptions(
            cfg.rounds.min_sites,
            cfg.rounds.max_sites,
            cfg.rounds.join_window_s,
            cfg.rounds.deadline_s,
        )
        self.leases = LeaseTable(self.epoch, cfg.timeouts.lease_ttl_s)
        self.sites: dict[str, SiteRecord] = {}
        self.accepted: dict[str, SpooledUpdate] = {}
        self.uploads = UploadTable(self.spool)
        self.fatal: str | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_close_reason = ""
        self._restore()

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
            self.strategy.load_state_dict(ckpt.strategy_state)
            log.info("resumed job %r at round %d (epoch %d)", self.cfg.name, ckpt.round, self.epoch)
        self.theta = ckpt.theta
        self.trainable = trainable_names(self.theta)
        self.round = RoundState(number=ckpt.round)
        self._publish()
        saved = self.spool.read_round(ckpt.round)
        expected: list[str] = []
        if saved is not None and not self.finished:
            # The round in flight at a crash: same participants, updates already spooled count.
            expected = sorted(saved["participants"])
            self.round = replace(
                self.round, opened_at=self.clock(), participants=frozenset(expected)
            )
            for update in self.spool.completed(ckpt.round):
                self.accepted[update.site] = update
                self.round = record_update(self.round, update.site, update.weight)
            self.strategy.begin_round(self.round.number, self.theta)
            log.info("round %d replays with %d spooled update(s)", ckpt.round, len(self.accepted))
        else:
            # Between rounds, or after the last one (the sites still fetch the final theta):
            # the sites of the round closed last are expected back.
            expected = sorted(ckpt.meta.get("closed_round", {}).get("sites", []))
        self._await_rejoin(expected)
        self.spool.drop_rounds_before(ckpt.round)

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
        self.published = Published(self.round.number, state_hash(self.theta), manifest, payload)

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
            log.info("site %s joined (token %d)", site, lease.token)
            self.wake.notify_all()
            return lease, self.round_info(site)

    def heartbeat(self, site: str, token: int, progress: dict | None):
        with self.lock:
            now = self.clock()
            lease = self._lease(site, token, renew=True)
            record = self.sites.setdefault(site, SiteRecord())
            record.last_heartbeat, record.progress, record.state = now, progress, "active"
            return lease, self.round_info(site)

    def leave(self, site: str, token: int) -> None:
        with self.lock:
            self._lease(site, token)
            self.leases.release(site, token, self.clock())
            self.sites.setdefault(site, SiteRecord()).state = "left"
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
        return {
            "round": r.number,
            "version": self.published.version,
            "theta_hash": self.published.theta_hash,
            "inner_steps": self.cfg.rounds.inner_steps,
            "total_rounds": self.cfg.rounds.total,
            "finished": self.finished,
            "participant": site is not None and site in r.participants and not r.closed,
        }

    # ---- theta downlink -------------------------------------------------------------------

    def fetch(self, site: str, token: int, version: int | None, offset: int) -> Published:
        with self.lock:
            self._lease(site, token)
            pub = self.published
        if version is not None and version != pub.version:
            raise Refused(
                "not_found",
                f"version {version} is not served; the current version is {pub.version}",
            )
        if not 0 <= offset <= pub.manifest.total_bytes:
            raise Refused(
                "invalid", f"offset {offset} outside the {pub.manifest.total_bytes}-byte payload"
            )
        return pub

    # ---- updates --------------------------------------------------------------------------

    def begin_upload(self, site: str, token: int, header: dict) -> Upload:
        check_name("upload_id", header["upload_id"])
        weight = header["weight"]
        if not (math.isfinite(weight) and 0 < weight <= 1e15):
            raise Refused("invalid", f"weight must be a finite number > 0, got {weight}")
        with self.lock:
            self._lease(site, token)
            self._admit(site, header["round"])
            if header["base_version"] != self.published.version:
                raise Refused(
                    "invalid",
                    f"update was trained from version {header['base_version']}, "
                    f"round {header['round']} trains from version {self.published.version}",
                )
        try:
            manifest = Manifest.from_proto(header["manifest"], self.cfg.server.max_update_bytes)
            check_update_manifest(manifest, self.theta, self.trainable)
        except PayloadError as exc:
            raise Refused("invalid", f"bad update manifest: {exc}") from exc
        try:
            return self.uploads.begin(site, header["round"], header["upload_id"], manifest, weight)
        except UploadConflict as exc:
            raise Refused("invalid", str(exc)) from exc
        except UploadBusy as exc:
            raise Refused("busy", str(exc)) from exc

    def upload_chunk(self, upload: Upload, offset: int, data: bytes) -> None:
        try:
            upload.add(offset, data)
        except ChunkError as exc:
            raise Refused("invalid", f"upload {upload.upload_id}: {exc}") from exc
        with self.lock:
            self.bytes_in += len(data)

    def finish_upload(self, upload: Upload, token: int) -> bool:
        """Count a fully received upload; returns False if bytes are still missing."""
        if not upload.complete:
            return False
        try:
            upload.verify()
            for name, t in read_tensors(upload.path, upload.manifest):
                if not bool(torch.isfinite(t).all()):
                    raise ChunkError(f"tensor {name!r} contains NaN or Inf values")
        except ChunkError as exc:
            self.uploads.discard(upload)
            raise Refused("invalid", f"update from {upload.site} refused: {exc}") from exc
        with self.lock:
            try:
                self._lease(upload.site, token)
                self._admit(upload.site, upload.round)
            except Refused:
                self.uploads.discard(upload)
                raise
            weight = self.strategy.update_weight(upload.site, upload.weight)
            spooled = self.spool.commit(
                upload.round, upload.site, upload.upload_id, upload.manifest, weight
            )
            self.uploads.forget(upload)
            self.accepted[upload.site] = spooled
            self.round = record_update(self.round, upload.site, weight)
            record = self.sites.setdefault(upload.site, SiteRecord())
            record.last_update_at, record.last_round_pushed = self.clock(), upload.round
            log.info(
                "round %d: update from %s counted (weight %g)", upload.round, upload.site, weight
            )
            self.wake.notify_all()
        return True

    def count_sent(self, n: int) -> None:
        with self.lock:
            self.bytes_out += n

    def _admit(self, site: str, round_number: int) -> None:
        try:
            admit_update(self.round, site, round_number)
        except UpdateRefused as exc:
            raise Refused(exc.code, str(exc)) from exc

    # ---- the round clock ------------------------------------------------------------------

    def tick(self) -> bool:
        """Advance membership and the round; returns True if a round was closed."""
        with self.lock:
            if self.finished or self.fatal:
                return False
            now = self.clock()
            for site in self.leases.expire(now):
                self.sites.setdefault(site, SiteRecord()).state = "expired"
                log.warning("lease of site %s expired", site)
            live = self.leases.live(now)
            was_open = self.round.opened_at is not None
            self.round = open_round(now, self.round, live, self.opts)
            if not was_open and self.round.opened_at is not None:
                self.spool.write_round(
                    self.round.number, {"participants": sorted(self.round.participants)}
                )
                self.strategy.begin_round(self.round.number, self.theta)
                log.info(
                    "round %d open with %s",
                    self.round.number,
                    ", ".join(sorted(self.round.participants)),
                )
            before = self.round.participants
            self.round = admit_latecomers(now, self.round, live, self.opts)
            if self.round.participants != before:
                self.spool.write_round(
                    self.round.number, {"participants": sorted(self.round.participants)}
                )
                log.warning(
                    "round %d is past its deadline below quorum; admitting %s",
                    self.round.number,
                    ", ".join(sorted(self.round.participants - before)),
                )
            decision = decide_close(now, self.round, live, self.opts)
            if not decision.act:
                return False
            self.round = replace(self.round, closed=True)
            updates = [self.accepted[s] for s in sorted(self.accepted)]
            closing = self.round
        self._close(closing, updates, decision.reason)
        return True

    def _close(self, state: RoundState, updates: list[SpooledUpdate], reason: str) -> None:
        started = time.monotonic()
        like = {n: self.theta[n] for n in self.trainable}
        try:
            mean, total = weighted_mean(updates, like)
            agg = Aggregate(mean, total, {u.site: u.weight for u in updates}, state.number)
            new_theta = self.strategy.outer_step(self.theta, agg)
            _check_theta(self.theta, new_theta)
        except Exception as exc:
            with self.lock:
                self.fatal = f"outer step of round {state.number} failed: {exc}"
            log.exception("outer step failed; the last checkpoint is unchanged")
            raise FatalError(self.fatal) from exc
        ckpt = Checkpoint(
            state.number + 1,
            new_theta,
            self.strategy.state_dict(),
            {
                "job": self.cfg.name,
                "closed_round": {
                    "number": state.number,
                    "reason": reason,
                    "sites": sorted(agg.weights),
                },
            },
        )
        self.store.save(ckpt)
        with self.lock:
            self.theta = new_theta
            self.round = next_round(state)
            self.accepted = {}
            self.last_close_reason = reason
            self._publish()
            self.wake.notify_all()
        self.uploads.drop_rounds_before(state.number + 1)
        self.spool.drop_rounds_before(state.number + 1)
        log.info(
            "round %d closed (%s): %d update(s), outer step + checkpoint in %.2fs; theta_%d %s",
            state.number,
            reason,
            len(updates),
            time.monotonic() - started,
            state.number + 1,
            self.published.theta_hash.hex()[:12],
        )

    def waiting_reason(self) -> str:
        with self.lock:
            if self.fatal:
                return self.fatal
            if self.finished:
                return f"job finished after {self.cfg.rounds.total} rounds"
            return waiting_reason(
                self.clock(), self.round, self.leases.live(self.clock()), self.opts
            )


def _keep(record: SiteRecord | None, *names: str) -> dict:
    return {n: getattr(record, n) for n in names} if record else {}


def _check_theta(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    if new.keys() != old.keys():
        raise ValueError(f"outer_step changed the tensor names: {sorted(new.keys() ^ old.keys())}")
    for name, t in new.items():
        if t.shape != old[name].shape or t.dtype != old[name].dtype:
            raise ValueError(f"outer_step changed shape or dtype of {name!r}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"outer_step produced NaN or Inf in {name!r}")
