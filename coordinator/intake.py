"""Receiving updates: checks before, during and after an upload, and counting it once.

A mixin of ``CoordinatorCore`` (it works on the core's lock, leases, round and spool); the
decision whether an update may count is ``rounds.admit_update``.
"""

from __future__ import annotations

import logging
import math

import torch

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
from strategies.base import checked_weight
from wire.chunking import ChunkError
from wire.tensors import Manifest, PayloadError

log = logging.getLogger("isthmus.coordinator")


class UpdateIntake:
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
            # Encoded tensors are decoded (and so fully checked) here, one at a time.
            for name, t in read_tensors(upload.path, upload.manifest):
                if not bool(torch.isfinite(t).all()):
                    raise ChunkError(f"tensor {name!r} contains NaN or Inf values")
        except (ChunkError, PayloadError) as exc:
            self.uploads.discard(upload)
            raise Refused("invalid", f"update from {upload.site} refused: {exc}") from exc
        with self.lock:
            try:
                self._lease(upload.site, token)
                self._admit(upload.site, upload.round)
            except Refused:
                self.uploads.discard(upload)
                raise
            try:
                weight = checked_weight(self.strategy, upload.site, upload.weight)
            except StrategyError as exc:
                self.uploads.discard(upload)
                self.fatal = f"{exc}; the last checkpoint is unchanged"
                log.error("stopping: %s", self.fatal)
                self.wake.notify_all()
                # UNAVAILABLE: the site keeps its update and retries once the job restarts.
                raise Refused("busy", f"the coordinator is stopping: {self.fatal}") from exc
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
