"""Receiving updates: uploads in, verified and durable spooled updates out.

Everything here runs without the coordinator's lock: the core admits a push (lease, round, data
unit) under the lock, then hands the upload to this part for the slow work, and counts the result
under the lock again. An update is checked before it can count: its manifest against the model
(names, shapes, dtypes; a tensor sent in pieces must tile it), every chunk in order, the
payload's digest (``wire.digest``), every raw value for NaN/Inf (a pass at memory speed), every
encoded tensor's codec data (CRC32, lengths, scales, indices) without decoding it. With
``aggregation.clip_norm`` it also measures the update's L2 norm. Only then is it fsynced and
renamed into the spool.
"""

from __future__ import annotations

import logging

import torch

from coordinator.intake.spool import (
    SpooledUpdate,
    SpoolError,
    UpdateSpool,
    mapped_entry,
    read_into,
    read_tensors,
)
from coordinator.intake.uploads import (
    Upload,
    UploadBusy,
    UploadConflict,
    UploadTable,
    check_update_manifest,
)
from coordinator.persist.disk import DISK_FULL, disk_refusal
from coordinator.records import Admission, PushHeader, Refused
from coordinator.round.round_tensors import RoundTensors
from strategies.base import all_finite
from strategies.robust import norm_of
from wire.chunking import ChunkError
from wire.codecs import CodecError, verify
from wire.tensors import DTYPES, Manifest, PayloadError
from wire.transfer import Piece, range_problem

log = logging.getLogger("isthmus.coordinator")


class UpdateIntake:
    def __init__(
        self,
        spool: UpdateSpool,
        uploads: UploadTable,
        theta: dict[str, torch.Tensor],
        tensors: RoundTensors,
        max_update_bytes: int,
        measure_norms: bool,
    ) -> None:
        self.spool, self.uploads = spool, uploads
        self.theta = theta  # only names, shapes and dtypes are read
        self.tensors = tensors  # which of them each round's updates carry
        self.max_update_bytes = max_update_bytes
        self.measure_norms = measure_norms

    def open(self, header: PushHeader, admission: Admission) -> Upload:
        """Start (or resume) receiving an admitted push. Its manifest must carry exactly the
        tensors of the round it is summed into (``admission.storage_round``)."""
        r = admission.storage_round
        try:
            manifest = Manifest.from_proto(header.manifest, self.max_update_bytes)
            check_update_manifest(
                manifest, self.theta, self.tensors.names(r), self.tensors.scope(r)
            )
        except PayloadError as exc:
            raise Refused("invalid", f"bad update manifest: {exc}") from exc
        piece = header.piece
        if piece is not None and (
            problem := range_problem(piece.offset, piece.length, manifest.total_bytes)
        ):
            raise Refused("invalid", f"upload {header.upload_id}: piece: {problem}")
        try:
            upload = self.uploads.begin(
                header.site,
                admission.storage_round,
                header.upload_id,
                manifest,
                header.weight,
                piece,
                stream=not header.reserve,
            )
        except UploadConflict as exc:
            raise Refused("invalid", str(exc)) from exc
        except UploadBusy as exc:
            raise Refused("busy", str(exc)) from exc
        except OSError as exc:
            raise self._disk_refusal(exc, f"opening upload {header.upload_id}") from exc
        upload.admission = admission
        return upload

    def _disk_refusal(self, exc: OSError, what: str) -> Refused:
        """The retryable refusal; a full disk first gets the spool's spare files back."""
        if exc.errno in DISK_FULL:
            self.spool.release_free()
        return disk_refusal(exc, what)

    def write(self, upload: Upload, offset: int, data: bytes, piece: Piece | None = None) -> None:
        """One chunk of a stream carrying ``piece`` (None: the whole payload)."""
        try:
            upload.add(offset, data, piece)
        except ChunkError as exc:
            raise Refused("invalid", f"upload {upload.upload_id}: {exc}") from exc
        except OSError as exc:
            log.error("upload %s from %s: %s", upload.upload_id, upload.site, exc)
            if upload.file.broken:  # could not cut it back: start this upload again
                self.uploads.discard(upload)
            raise self._disk_refusal(exc, f"receiving upload {upload.upload_id}") from exc

    def verify(self, upload: Upload) -> float | None:
        """Check a complete upload; its L2 norm when norms are measured. A refused upload's
        bytes are deleted."""
        try:
            upload.verify()
        except ChunkError as exc:
            self.uploads.discard(upload)
            raise Refused("corrupt", f"update from {upload.site} refused: {exc}") from exc
        try:
            screen(upload)
            if not self.measure_norms:
                return None
            norm, _ = norm_of(read_tensors(upload.path, upload.manifest))
            return norm
        except (ChunkError, PayloadError, CodecError) as exc:
            self.uploads.discard(upload)
            raise Refused("invalid", f"update from {upload.site} refused: {exc}") from exc

    def commit(self, upload: Upload, weight: float) -> SpooledUpdate:
        """Make a verified upload durable as its admitted key (an fsync: slow, lock-free). The
        caller forgets the upload once it is counted: till then a retried reservation finds it
        (busy, being finished), not a fresh empty one to send every byte into again."""
        a = upload.admission
        try:
            spooled = self.spool.commit(
                upload.round,
                upload.site,
                upload.upload_id,
                upload.manifest,
                weight,
                key=a.key,
                shard_digests=upload.shard_digests,
            )
        except SpoolError as exc:
            self.uploads.discard(upload)
            raise Refused("corrupt", f"update from {upload.site} refused: {exc}") from exc
        except OSError as exc:  # the upload stays complete: a retried header commits it
            log.error("committing upload %s from %s: %s", upload.upload_id, upload.site, exc)
            raise self._disk_refusal(exc, f"committing upload {upload.upload_id}") from exc
        return spooled


SCREEN_CHUNK = 4 << 20


def screen(upload: Upload) -> None:
    """Refuse NaN/Inf in raw tensors and codec data that would not decode. Raw tensors not
    checked as they arrived (``coordinator.intake.screening``) are read a few MiB at a time, so a
    verifying thread holds little memory."""
    if upload.screen.bad is not None:
        raise ChunkError(f"tensor {upload.screen.bad!r} contains NaN or Inf values")
    unchecked = upload.screen.unchecked()
    buf = torch.empty(SCREEN_CHUNK, dtype=torch.uint8)
    for i, e in enumerate(upload.manifest.entries):
        if e.codec == "none" and i not in unchecked:
            continue
        if e.codec != "none":
            raw = mapped_entry(upload.path, e)
            verify(raw, e.codec_meta, e.numel, codec=e.codec, name=e.label)
            del raw  # the mapping goes with it
            continue
        dtype = DTYPES[e.dtype]
        step = SCREEN_CHUNK // dtype.itemsize * dtype.itemsize
        for start in range(0, e.nbytes, step):
            part = buf[: min(step, e.nbytes - start)]
            read_into(upload.path, e.offset + start, part)
            if not all_finite(part.view(dtype)):
                raise ChunkError(f"tensor {e.label!r} contains NaN or Inf values")
