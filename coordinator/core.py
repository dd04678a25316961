"""The coordinator's front: the one lock, the parts, and the operations the RPCs perform.

Each part has one job: ``Membership`` (leases, suspicion), the data mode (``FederatedData`` or
``SharedData``: which updates a round admits, in which order they are summed), ``UpdateIntake``
(uploads to verified, durable spooled updates), ``RoundDriver`` (opening and closing rounds by
the pure rules of ``rounds``), ``ClosePipeline`` (outer step, publish, checkpoint) and
``recovery`` (start-up). This class owns the lock and the shared ``CoordinatorState``, and keeps
slow work out from under the lock: an update's fsync, an event's fsync, the close pipeline.
The gRPC servicer is a thin translation layer over it; ``coordinator status`` reads a snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from coordinator.config import JobConfig
from coordinator.events.log import EventLog, EventSink
from coordinator.ha.election import Term
from coordinator.intake.receive_slots import ReceiveSlots, upload_slots
from coordinator.intake.receiver import UpdateIntake
from coordinator.intake.spool import UpdateSpool
from coordinator.intake.uploads import Upload, UploadBusy, UploadTable
from coordinator.members.drain import DrainList, check_reason, drain_message
from coordinator.members.membership import Membership
from coordinator.members.site_control import SiteControl
from coordinator.observe.evaluation import Evaluation, describe, load_hook
from coordinator.observe.evaluator import Evaluator, Reports
from coordinator.observe.status import StatusSnapshot, snapshot_of
from coordinator.persist.checkpointing import CheckpointWriter
from coordinator.persist.disk import until_written
from coordinator.persist.local_store import StoreError
from coordinator.persist.open_store import open_store
from coordinator.persist.spare_files import THETA, spare_folder
from coordinator.persist.theta_writer import ThetaFiles
from coordinator.records import (
    FatalError,
    Published,
    PushHeader,
    Refused,
    UpdateKey,
    check_name,
)
from coordinator.round import recovery, round_tensors
from coordinator.round.accumulate import StreamingMean, start_sum
from coordinator.round.close import CloseParts, ClosePipeline
from coordinator.round.counting import UpdateCounter
from coordinator.round.downlink import Downlink
from coordinator.round.driver import RoundDriver
from coordinator.round.fold_lanes import FoldLanes, default_lanes
from coordinator.round.round_tensors import RoundTensors
from coordinator.round.spare_buffer import SpareBuffer
from coordinator.service import heap
from coordinator.service.send_slots import SendSlots
from coordinator.shards.lead import LeadShards
from strategies import RobustAggregator, load_strategy
from wire.codecs.adaptive import overlap_of
from wire.health import Probe
from wire.transfer import Piece, range_problem

log = logging.getLogger("isthmus.coordinator")
WAIT_ROUND_CAP_S = 60.0
INFO_FIELDS = ("round", "version", "finished", "participant", "data_unit", "update_wanted")
INFO_DEFAULTS = {"update_wanted": False}  # an older agent's RoundInfo does not carry it


class CoordinatorCore:
    def __init__(
        self,
        cfg: JobConfig,
        clock: Callable[[], float] = time.monotonic,
        term: Term | None = None,
        shards: LeadShards | None = None,
    ) -> None:
        """``term``: this coordinator was elected through etcd (``coordinator.ha.role``);
        ``shards``: the other shards of a job split over several (``[shards]``), whose lead
        this coordinator is."""
        self.cfg, self.clock, self.term, self.shards = cfg, clock, term, shards
        if cfg.evaluation is not None:  # a hook that cannot load is refused before any state
            load_hook(cfg.evaluation.fn)
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.send_slots = SendSlots(cfg.server.concurrent_fetches, streams=cfg.transfer.streams)
        self.strategy = load_strategy(cfg.strategy.name, cfg.strategy.params)
        round_tensors.check_start(cfg.streaming, self.strategy)  # before any state is touched
        self.aggregator = RobustAggregator.from_config(cfg.aggregation)
        self._open_state(term)
        downlink = round_tensors.downlink_config(cfg.downlink, cfg.streaming)
        overlap = overlap_of(tomllib.loads(cfg.source_toml.decode())) if cfg.source_toml else 1.0
        self.downlink = Downlink(downlink, overlap) if downlink is not None else None
        self.sink = EventSink(self.events)
        self.control = self._site_control()
        # Set when the coordinator stops: what waits for disk space (persist.disk) gives up.
        self.stopping = threading.Event()
        self.writer = CheckpointWriter(self.store, self.stopping)
        self._fold_parts()
        self._stopping, self.new_job = False, False  # new_job: recovery.load tells
        self.state, self.data, self.trainable = recovery.load(self)
        # With [streaming]: the fragment each round syncs (a plan that cannot be made stops
        # the start here with its ConfigError).
        self.tensors = RoundTensors.of(self.state.theta.tensors, self.trainable, cfg.streaming)
        self.slots = self._receive_slots()
        self.intake = UpdateIntake(
            self.spool,
            self.uploads,
            {n: t.to("meta") for n, t in self.state.theta.tensors.items()},  # shapes only
            self.tensors,
            cfg.server.max_update_bytes,
            measure_norms=self.aggregator.clip_norm > 0,
        )
        parts = (self.state, self.members, self.data)
        self.driver = RoundDriver(*parts, cfg.rounds, self.strategy, self.sink.post, self.new_sum)
        self.counter = UpdateCounter(
            *parts, self.strategy, self.aggregator, self.uploads, self.sink.post
        )
        self.evaluator = self._start_evaluator()
        self.pipeline = ClosePipeline(self._close_parts())
        recovery.resume(self)
        self.sink.flush()
        # Before any round: a job whose updates cannot be combined within memory stops here.
        like = {n: self.state.theta.tensors[n] for n in self.trainable}
        self.aggregator.check(self.strategy, cfg.rounds.max_sites, like)

    def _receive_slots(self) -> ReceiveSlots:
        """How many uploads are received at once (``coordinator.intake.receive_slots``)."""
        cfg = self.cfg
        slots = ReceiveSlots(
            upload_slots(
                cfg.server.concurrent_uploads,
                sum(self.state.theta.tensors[n].numel() * 4 for n in self.trainable),
                cfg.server.receive_window_bytes,
                cfg.transfer.streams,
            )
        )
        if cfg.server.concurrent_uploads is None:
            log.info("receiving at most %d uploads at once (sized from the model)", slots.capacity)
        return slots

    def _open_state(self, term: Term | None) -> None:
        """The checkpoint store, the spool, the event log and this start's epoch. Under an
        etcd-elected ``term`` (``coordinator.ha.role``) the spool of an earlier leadership goes,
        the store's commits are fenced, and the store refuses the start of a stale candidate."""
        cfg = self.cfg
        self.store = open_store(cfg.state_dir, cfg.storage)
        self.spool = UpdateSpool(cfg.state_dir / "spool")
        self.uploads = UploadTable(self.spool)
        # Before the start is counted: a damaged log refuses to start and changes nothing.
        self.events = EventLog(cfg.state_dir / "events.jsonl", cfg.events)
        if term is not None:
            # A new leadership: what this host spooled in an earlier one may not be what the
            # leaders since then served; every update of the round in flight is sent again.
            self.spool.drop_rounds_before(sys.maxsize)
            self.store.fence = term.fence
        epoch = self.store.next_epoch(term.revision if term is not None else 0)
        if term is not None:
            term.fence()  # still leading once counted: a stale candidate stops here
        self.members = Membership(epoch, cfg.timeouts, cfg.rounds.max_sites)
        if cfg.storage.remote and not self.store.read_only:
            # After this start is counted: a deposed leader's commits (and events) are fenced
            # from here on, so what is adopted now is all the log it will ever hold before ours.
            from coordinator.events.remote import remote_events_for

            self.store.ship_events = remote_events_for(self.store, self.events).ship

    def _fold_parts(self) -> None:
        """The fold worker (theta's files, the sum's allocation), the fold lanes, the sum's
        spare buffer."""
        self._folder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fold")
        lanes = self.cfg.server.fold_lanes
        self.lanes = FoldLanes(lanes if lanes is not None else default_lanes())
        self.spare = SpareBuffer()  # each round's sum, kept for the next (round.spare_buffer)
        folder = self.cfg.state_dir / "theta"
        spare = spare_folder(self.cfg.state_dir) / THETA  # a pruned checkpoint's, to write over
        self.theta_files = ThetaFiles(folder, self._folder, self.stopping, self.spare.keep, spare)

    def _site_control(self) -> SiteControl:
        """Drains and the health rules; in shared-data mode a drained site hands back its units."""
        cfg = self.cfg
        drains = DrainList(cfg.state_dir)  # before any state: a damaged list stops the start
        hand_back = cfg.data.mode == "shared"
        return SiteControl(
            drains, self.members, cfg.health, cfg.rounds.min_sites, self.sink.post, hand_back
        )

    def _close_parts(self) -> CloseParts:
        return CloseParts(
            self.cfg.name,
            self.state,
            self.lock,
            self.strategy,
            self.aggregator,
            self.downlink,
            self.members,
            self.data,
            self.spool,
            self.uploads,
            self.writer,
            self.sink,
            self.events,
            self.stopping,
            self.theta_files,
            self.evaluator,
            self.tensors,
            self.shards,
        )

    def _start_evaluator(self) -> Evaluator | None:
        """The ``[evaluation]`` hook's thread, given theta as it resumes (evaluated if due: an
        evaluation cut short by a restart is done again)."""
        cfg = self.cfg.evaluation
        if cfg is None:
            return None
        reports = Reports(self._evaluated, self._evaluation_failed, self._evaluation_skipped)
        evaluator = Evaluator(cfg, self.cfg.model, self.cfg.rounds.total, reports)
        evaluator.submit(self.state.published.version, self.state.theta.tensors)
        return evaluator

    def _evaluated(self, ev: Evaluation) -> None:
        log.info("evaluation of theta_%d: %s (%.2fs)", ev.version, describe(ev), ev.seconds)
        with self._locked() as s:
            s.evaluation = ev
            self.sink.post("evaluation", version=ev.version, metrics=ev.metrics, seconds=ev.seconds)

    def _evaluation_failed(self, version: int, message: str) -> None:
        log.error("%s", message)
        with self._locked() as s:
            self.sink.post("evaluation_failed", version=version, error=message)
            if s.fatal is None:
                s.fatal = f"{message}; the job stops (theta and its checkpoints are unchanged)"
            s.changed()

    def _evaluation_skipped(self, version: int, why: str) -> None:
        log.warning("evaluation of theta_%d skipped: %s", version, why)
        with self._locked():
            self.sink.post("evaluation_skipped", version=version, reason=why)

    def evaluations_done(self) -> bool:
        """No evaluation waiting or running (the job may end)."""
        if self.evaluator is None:
            return True
        return self.theta_files.idle() and self.evaluator.idle()  # the file job submits one

    @contextlib.contextmanager
    def _locked(self):
        """Hold the lock; write the events posted meanwhile once it is released."""
        try:
            with self.lock:
                yield self.state
        finally:
            self.sink.flush()

    def new_sum(self, slots: list[str]) -> StreamingMean | None:
        """The running sum of a round that opens (None when updates are combined at close),
        holding the updates counted already (late ones folded in before it opened, spooled
        ones after a restart)."""
        if not self.aggregator.streams(self.strategy):
            return None
        s = self.state
        names = self.tensors.names(s.round.number)
        running = start_sum(s.theta, names, self._folder, slots, self.spare, self.lanes)
        for key, update in s.accepted.items():
            alpha = update.weight * self.aggregator.clip_scale(s.norms.get(key))
            running.offer(self.data.slot_of(key), key, update, alpha)
        return running

    def wake_all(self) -> None:
        """Answer every waiting WaitRound now (the server is stopping)."""
        self.stopping.set()
        with self.lock:
            self._stopping = True
            self.wake.notify_all()

    def close(self) -> None:
        """Stop: wake every waiting call, finish the checkpoint being written."""
        self.wake_all()
        if self.evaluator is not None:
            self.evaluator.close()
        self.writer.close()
        self._folder.shutdown(wait=True)  # first: a close's finish there waits for the lanes
        self.lanes.shutdown()
        self.sink.flush()
        self._ship_events()
        self.events.close()
        if self.shards is not None:
            self.shards.close_channels()

    def _ship_events(self) -> None:
        ship = getattr(self.store, "ship_events_now", None)
        if ship is None:
            return
        try:
            ship()
        except Exception as exc:  # the history's upkeep; the state is in the checkpoints
            log.error("event log: its last records are not in the object store: %s", exc)

    # ---- views ----------------------------------------------------------------------------

    @property
    def round(self):
        return self.state.round

    @property
    def theta(self):
        return self.state.theta.tensors

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def published(self) -> Published:
        return self.state.published

    @property
    def leases(self):
        return self.members.leases

    @property
    def suspected(self):
        return self.members.suspected

    @property
    def ledger(self):
        return getattr(self.data, "ledger", None)

    def round_info(self, site: str | None = None) -> dict:
        """What ``site`` should do now (the fields of ``RoundInfo``)."""
        s = self.state
        participant, unit = self.data.task_for(s.round, site) if site is not None else (False, "")
        info = {
            "round": s.round.number,
            "version": s.published.version,
            "theta_hash": s.published.theta_hash,
            "inner_steps": self.cfg.rounds.inner_steps,
            "total_rounds": self.cfg.rounds.total,
            "finished": s.finished,
            "participant": participant,
            "fragment": self.tensors.fragment(s.round.number),
        }
        if self.data.kind == "shared":
            info["data_unit"] = unit
        if site is not None:
            key = UpdateKey(site, unit=unit)
            info["update_wanted"] = participant and s.wanted.asks_for(
                s.round.number, key, s.accepted, s.committing
            )
        info["site_index"], info["num_sites"] = site_position(site, s.round.participants)
        return info

    def snapshot(self) -> StatusSnapshot:
        with self.lock:
            return snapshot_of(self, self.clock())

    def waiting_reason(self) -> str:
        with self.lock:
            s = self.state
            if s.fatal:
                return s.fatal
            if s.finished:
                return f"job finished after {self.cfg.rounds.total} rounds"
            pin = s.pinned
            if pin is not None and not pin.released:
                lost = ", ".join(k.label for k in pin.keys if k not in s.accepted)
                return f"round {s.round.number} was decided before a restart; waiting for {lost}"
            now = self.clock()
            return self.data.waiting_reason(
                now, s.round, self.members.responsive(now), self.cfg.rounds, self.driver.grace()
            )

    # ---- membership -----------------------------------------------------------------------

    def join(self, site: str, num_examples: int = 0):
        check_name("site name", site)
        with self._locked() as s:
            self.control.drains.refuse_join(site)
            lease = self.members.join(site, self.clock())
            self.sink.post("join", site=site, token=lease.token)
            log.info("site %s joined (token %d)", site, lease.token)
            s.changed()
            return lease, self.round_info(site)

    def heartbeat(self, site: str, token: int, progress: dict | None, probe: Probe | None = None):
        """Renew ``site``'s lease; returns it, the round info and the units cancelled. A new
        health ``probe`` (at most one per site per round) goes through the health rules."""
        drained = False
        with self._locked() as s:
            now = self.clock()
            lease = self.members.heartbeat(site, token, progress, now)
            record = self.members.record(site)
            c = self.control
            new = probe is not None and probe != record.health  # sent with every heartbeat
            if new and c.take_probe(site, probe, s.round.number):
                record.health = probe
                drained = c.probed(site, probe, now)
            if drained:
                s.changed()
            reply = lease, self.round_info(site), self.data.take_cancels(site)
        if drained:
            try:
                c.save(self.lock)
            except OSError as exc:  # kept to write on the next drain call or probe
                log.error("the drain list could not be written: %s", exc)
        return reply

    def drain_reason(self, site: str) -> str:
        """Why ``site`` is drained ("" while it is not): ``Command.drain`` in replies."""
        with self.lock:
            return self.control.drain_reason(site)

    def set_drain(self, site: str, drain: bool, reason: str = "") -> tuple[bool, str, list[str]]:
        """An operator drains or undrains ``site``; returns (changed, what happened, the sites
        drained now) once the drain list is on disk."""
        check_name("site name", site)
        check_reason(reason)
        with self._locked() as s:
            c = self.control
            changed = c.drain(site, reason, "operator") if drain else c.undrain(site)
            known = site in self.members.sites
            s.changed()
            drained = c.drains.names()
        try:
            self.control.save(self.lock)  # also a write an earlier call could not finish
        except OSError as exc:
            raise Refused(
                "full",
                f"site {site} is {'drained' if drain else 'undrained'} now, but the list of "
                f"drained sites could not be written ({exc}): it would not survive a restart; "
                "retry once the state folder can be written",
            ) from exc
        hands_back = self.cfg.data.mode == "shared"
        return changed, drain_message(site, drain, changed, known, hands_back), drained

    def leave(self, site: str, token: int) -> None:
        with self._locked() as s:
            self.members.leave(site, token, self.clock())
            self.sink.post("leave", site=site)
            log.info("site %s left", site)
            s.changed()

    def wait_round(self, site: str, token: int, known: dict | None, timeout_s: float):
        """Answer once what ``site`` should do differs from ``known`` (a long-poll)."""
        deadline = time.monotonic() + min(max(timeout_s, 0.0), WAIT_ROUND_CAP_S)
        with self._locked() as s:
            self.members.check(site, token, self.clock())
            call = s.watchers[site] = s.watchers.get(site, 0) + 1
            s.changed()  # an older call of this site ends now
            while True:
                info = self.round_info(site)
                changed = known is None or any(
                    info.get(k, INFO_DEFAULTS.get(k, "")) != known.get(k, INFO_DEFAULTS.get(k))
                    for k in INFO_FIELDS
                )
                superseded = s.watchers.get(site) != call
                if changed or superseded or s.fatal or self._stopping:
                    break
                if self.data.has_cancels(site) or self.control.untold(site, token):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.wake.wait(left)
            self.control.tell(site, token)
            return info, self.data.take_cancels(site)

    # ---- theta downlink -------------------------------------------------------------------

    def fetch(
        self, site, token, version, offset, from_version=None, length=None
    ) -> tuple[Published, bool]:
        """What to stream: the published theta and whether to serve it as the delta from
        ``from_version`` (only when that is the version the delta starts from); the bytes
        ``[offset, offset + length)`` of it must exist (``length`` None: to the end)."""
        with self._locked() as s:
            self.members.check(site, token, self.clock())
            pub = s.published
        if version is not None and version != pub.version:
            raise Refused(
                "not_found",
                f"version {version} is not served; the current version is {pub.version}",
            )
        as_delta = from_version is not None and from_version == pub.delta_from
        total = pub.delta_manifest.total_bytes if as_delta else pub.manifest.total_bytes
        if problem := range_problem(offset, length, total):
            raise Refused("invalid", f"fetch: {problem}")
        return pub, as_delta

    def count_sent(self, n: int) -> None:
        with self.lock:
            self.state.bytes_out += n

    # ---- updates --------------------------------------------------------------------------

    def fence(self) -> None:
        """Refuse a state change once this coordinator is no longer the elected leader."""
        if self.term is not None:
            try:
                self.term.fence()
            except StoreError as exc:
                raise Refused("standby", str(exc)) from exc

    def _may_close(self, round_number: int) -> bool:
        """Whether this coordinator may close a round now: not once deposed (a theta it
        published could never be committed; the round loop steps down next)."""
        if self.term is None:
            return True
        try:
            self.term.fence()
        except StoreError as exc:
            log.warning("not closing round %d: %s", round_number, exc)
            return False
        return True

    def begin_upload(self, header: PushHeader) -> Upload:
        self.fence()
        check_name("upload_id", header.upload_id)
        if not (math.isfinite(header.weight) and 0 < header.weight <= 1e15):
            raise Refused("invalid", f"weight must be a finite number > 0, got {header.weight}")
        if self.shards is not None:  # the other parts are held by their shards, and receipted
            self.shards.check_push(header)
            self.shards.refuse_foreign([t.name for t in header.manifest.tensors])
        with self._locked():
            admission = self.counter.admit(header, self.clock())
        upload = self.intake.open(header, admission)
        upload.shard_digests = header.shard_digests
        return upload

    def upload_chunk(
        self, upload: Upload, offset: int, data: bytes, token: int = 0, piece: Piece | None = None
    ) -> None:
        """One chunk of a stream of ``upload`` carrying ``piece`` (None: the whole payload)."""
        self.intake.write(upload, offset, data, piece)
        with self.lock:
            self.state.bytes_in += len(data)
            self.members.data_arrived(upload.site, token, self.clock())

    def release_upload(self, upload: Upload, piece: Piece | None = None) -> None:
        """The stream of ``upload`` carrying ``piece`` ended."""
        self.uploads.release(upload, piece)

    def reserve_slot(self, upload: Upload) -> bool:
        """Wait for a receive slot for ``upload`` (``coordinator.intake.receive_slots``); True once
        it may send. Waiting uploads are granted in the round's fold order."""
        with self.lock:
            slots = self.state.slots
            slot = self.data.slot_of(upload.admission.key)
            order = slots.index(slot) if slot in slots else len(slots)
        return self.slots.reserve((upload.site, upload.upload_id), order)

    @contextlib.contextmanager
    def receiving(self, upload: Upload):
        """While the bytes of ``upload`` are received: it holds a slot (granted or not)."""
        key = (upload.site, upload.upload_id)
        self.slots.enter(key)
        try:
            yield
        finally:
            self.slots.leave(key)
            heap.trim()  # the stream's read buffers are free now

    def finish_upload(self, upload: Upload, token: int) -> bool:
        """Count a fully received upload; returns False if bytes are still missing. One
        request at a time finishes an upload (another is refused as busy, to retry)."""
        if not upload.complete:
            return False
        try:
            with self.uploads.finishing(upload):
                return self._finish(upload, token)
        except UploadBusy as exc:
            raise Refused("busy", str(exc)) from exc

    def _finish(self, upload: Upload, token: int) -> bool:
        self.fence()
        norm = self.intake.verify(upload)  # the slow checks, without the lock
        with self._locked():
            admission, weight = self.counter.reserve(upload, token, self.clock())
        try:
            spooled = self.intake.commit(upload, weight)  # the fsync, without the lock
        except BaseException:
            with self.lock:
                self.state.committing.discard(admission.key)
            raise
        with self._locked():
            try:
                self.counter.count(upload, spooled, admission, norm, self.clock())
            finally:  # committed: its bytes are the spool's now
                self.uploads.forget(upload)
        return True

    # ---- the round clock ------------------------------------------------------------------

    def tick(self) -> bool:
        """Advance membership and the round; returns True if a round was closed."""
        with self._locked() as s:
            if s.fatal:
                raise FatalError(s.fatal)
            if s.finished:
                return False
            step = self.driver.tick(self.clock())
        if step.round_file is not None:
            until_written(
                lambda: self.spool.write_round(*step.round_file),
                f"recording round {step.round_file[0]}",
                self.stopping,
            )
        if step.order is None or not self._may_close(step.order.round.number):
            return False
        self.pipeline.run(step.order)
        if step.order.after_pin:
            recovery.after_pinned_close(self, step.order.after_pin == "kept")
        self.sink.flush()
        return True


def site_position(site: str | None, participants) -> tuple[int, int]:
    """``site``'s index among ``participants`` sorted by name, and their number; index 0 for
    a site that is not one of them (it has no shard this round)."""
    ordered = sorted(participants)
    return (ordered.index(site) if site in ordered else 0), len(ordered)
