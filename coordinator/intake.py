"""Receiving updates: checks before, during and after an upload, and counting it once.

A mixin of ``CoordinatorCore`` (it works on the core's lock, leases, round and spool). Whether
an update may count is decided by ``rounds.admit_update`` (federated mode; a late one is folded
into the open round when the strategy's ``staleness_weight`` says so) or by the data ledger
(shared-data mode: a unit counts once, whichever copy commits first). Each counted update is
spooled under a key: the site (federated), ``SITE@UNIT`` (shared) or ``SITE@lateR`` (an update
for round R folded into the round after it).
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from coordinator.leases import LeaseError
from coordinator.records import Refused, SiteRecord, check_name
from coordinator.rounds import UpdateRefused, admit_update, record_update
from coordinator.spool import read_tensors
from coordinator.uploads import (
    Upload,
    UploadBusy,
    UploadConflict,
    check_update_manifest,
)
from strategies import StrategyError
from strategies.base import checked_staleness_weight, checked_weight
from wire.chunking import ChunkError
from wire.tensors import Manifest, PayloadError

log = logging.getLogger("isthmus.coordinator")


class UpdateIntake:
    def begin_upload(self, site: str, token: int, header: dict) -> Upload:
        check_name("upload_id", header["upload_id"])
        weight = header["weight"]
        if not (math.isfinite(weight) and 0 < weight <= 1e15):
            raise Refused("invalid", f"weight must be a finite number > 0, got {weight}")
        unit = header.get("data_unit", "")
        with self.lock:
            self._lease(site, token)
            late_from = None
            if self.shared:
                self._admit_unit(site, header["round"], unit)
            else:
                late_from = self._admit_or_fold(site, header["round"])
            trained_from = self.published.version if late_from is None else late_from
            if header["base_version"] != trained_from:
                raise Refused(
                    "invalid",
                    f"update was trained from version {header['base_version']}, "
                    f"round {header['round']} trains from version {trained_from}",
                )
            # A folded update is stored with the round it now counts in.
            storage_round = self.round.number if late_from is not None else header["round"]
        try:
            manifest = Manifest.from_proto(header["manifest"], self.cfg.server.max_update_bytes)
            check_update_manifest(manifest, self.theta, self.trainable)
        except PayloadError as exc:
            raise Refused("invalid", f"bad update manifest: {exc}") from exc
        try:
            upload = self.uploads.begin(site, storage_round, header["upload_id"], manifest, weight)
        except UploadConflict as exc:
            raise Refused("invalid", str(exc)) from exc
        except UploadBusy as exc:
            raise Refused("busy", str(exc)) from exc
        upload.unit, upload.late_from = (unit if self.shared else ""), late_from
        return upload

    def upload_chunk(self, upload: Upload, offset: int, data: bytes, token: int = 0) -> None:
        try:
            upload.add(offset, data)
        except ChunkError as exc:
            raise Refused("invalid", f"upload {upload.upload_id}: {exc}") from exc
        with self.lock:
            self.bytes_in += len(data)
            # A site busy sending its update is alive even when its heartbeats queue behind
            # the upload on a slow link: its data renews the lease and holds off suspicion.
            now = self.clock()
            with contextlib.suppress(LeaseError):
                self.leases.renew(upload.site, token, now)
            self.sites.setdefault(upload.site, SiteRecord()).last_data_at = now

    def finish_upload(self, upload: Upload, token: int) -> bool:
        """Count a fully received upload; returns False if bytes are still missing."""
        if not upload.complete:
            return False
        try:
            upload.verify()
        except ChunkError as exc:
            self.uploads.discard(upload)
            raise Refused("corrupt", f"update from {upload.site} refused: {exc}") from exc
        try:
            # Encoded tensors are decoded (and so fully checked) here, one at a time.
            for name, t in read_tensors(upload.path, upload.manifest):
                if not bool(torch.isfinite(t).all()):
                    raise ChunkError(f"tensor {name!r} contains NaN or Inf values")
        except (ChunkError, PayloadError) as exc:
            self.uploads.discard(upload)
            raise Refused("invalid", f"update from {upload.site} refused: {exc}") from exc
        with self.lock:
            # A lease that lapsed while the bytes were on their way: the upload stays whole,
            # so the site re-joins and completes it with one header instead of resending it.
            self._lease(upload.site, token)
            try:
                key, unit = self._recheck(upload)
            except Refused:
                self.uploads.discard(upload)
                raise
            try:
                weight = checked_weight(self.strategy, upload.site, upload.weight)
                if upload.late_from is not None:
                    weight *= self._fold_weight(upload.site, upload.late_from)
            except StrategyError as exc:
                self.uploads.discard(upload)
                self.fatal = f"{exc}; the last checkpoint is unchanged"
                log.error("stopping: %s", self.fatal)
                self.wake.notify_all()
                # UNAVAILABLE: the site keeps its update and retries once the job restarts.
                raise Refused("busy", f"the coordinator is stopping: {self.fatal}") from exc
            spooled = self.spool.commit(
                upload.round, upload.site, upload.upload_id, upload.manifest, weight, key=key
            )
            self.uploads.forget(upload)
            now = self.clock()
            if upload.late_from is not None:
                self.late[key] = spooled
            else:
                if unit:
                    self._commit_unit(upload.site, unit, now)
                self.accepted[key] = spooled
                self.round = record_update(self.round, unit or upload.site, weight)
            record = self.sites.setdefault(upload.site, SiteRecord())
            record.last_update_at, record.last_round_pushed = now, upload.round
            self.events.append(
                "update",
                round=upload.round,
                site=upload.site,
                key=key,
                unit=unit,
                late_from=upload.late_from,
                weight=weight,
                sha256=upload.manifest.sha256.hex(),
            )
            log.info("round %d: update %s counted (weight %g)", upload.round, key, weight)
            self.wake.notify_all()
        return True

    def _recheck(self, upload) -> tuple[str, str]:
        """At the end of an upload: may it still count, and under which spool key."""
        if upload.unit:
            self._admit_unit(upload.site, upload.round, upload.unit)
            return f"{upload.site}@{upload.unit}", upload.unit
        if upload.late_from is not None:
            if self._admit_or_fold(upload.site, upload.late_from) is None:
                raise Refused("invalid", f"round {upload.late_from} is open again")
            return f"{upload.site}@late{upload.late_from}", ""
        self._admit(upload.site, upload.round)
        return upload.site, ""

    def count_sent(self, n: int) -> None:
        with self.lock:
            self.bytes_out += n

    def _admit_or_fold(self, site: str, round_number: int) -> int | None:
        """None if the update counts in its own round; its round number if it is late and
        folded into the open round; raises ``Refused`` otherwise."""
        try:
            admit_update(self.round, site, round_number)
            return None
        except UpdateRefused as exc:
            if exc.code != "late" or self._fold_weight(site, round_number) <= 0:
                raise Refused(exc.code, str(exc)) from exc
        if f"{site}@late{round_number}" in self.late:
            raise Refused(
                "duplicate", f"the late update of {site!r} for round {round_number} is counted"
            )
        return round_number

    def _fold_weight(self, site: str, round_number: int) -> float:
        """The strategy's discount for a late update (0: drop). Only an update for the round
        just closed, from one of its participants that it closed without, can be folded."""
        closed = self.last_closed
        if (
            closed is None
            or round_number != closed["number"]
            or self.round.number != round_number + 1
            or site not in closed["participants"]
            or site in closed["sites"]
        ):
            return 0.0
        return checked_staleness_weight(self.strategy, site, 1)

    def _admit(self, site: str, round_number: int) -> None:
        try:
            admit_update(self.round, site, round_number)
        except UpdateRefused as exc:
            raise Refused(exc.code, str(exc)) from exc
