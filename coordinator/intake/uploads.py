"""Uploads in progress: chunks checked in order and written to the spool, resumable.

An upload is keyed by (site, upload_id). When its stream breaks, what arrived stays in the
spool's ``.part`` file and a new stream with the same upload id continues from the acknowledged
offset (after a coordinator restart too: the received ranges come back from the upload's
range log, the digest's state from the file). With ``[transfer] streams`` K > 1 an upload comes
as pieces on up to K streams at once: each carries one byte range of the payload
(``PushHeader.piece``), ranges being received at once must be disjoint (``stream_clash``), and
each resumes where its own range is received up to (``coordinator.intake.upload_bytes``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from coordinator.intake.screening import ArrivalScreen
from coordinator.intake.spool import UpdateSpool
from coordinator.intake.upload_bytes import UploadBytes
from wire.tensors import Manifest, PayloadError, TensorEntry
from wire.transfer import Piece

if TYPE_CHECKING:
    from coordinator.round.round_tensors import RoundFragment

UPDATE_DTYPES = ("float32", "bfloat16", "float16")


def check_update_manifest(
    manifest: Manifest,
    theta: dict[str, torch.Tensor],
    trainable: Sequence[str],
    fragment: RoundFragment | None = None,
) -> None:
    """An update must carry exactly the tensors ``trainable`` of theta (every trainable one;
    with ``[streaming]`` the round's ``fragment``), with their shapes: each one whole, or in
    pieces that tile it (see ``check_tiling``)."""
    expected = set(trainable)
    for name, entries in manifest.pieces().items():
        if name not in theta:
            raise PayloadError(f"unknown tensor name {name!r} (not in the model)")
        if name not in expected:
            if fragment is not None and theta[name].is_floating_point():
                raise PayloadError(fragment.outside(name))
            raise PayloadError(f"tensor {name!r} is not trainable and must not be sent")
        shape = tuple(theta[name].shape)
        for e in entries:
            if e.full_shape != shape:
                raise PayloadError(
                    f"tensor {name!r} has shape {list(e.full_shape)}, the model has {list(shape)}"
                )
            if e.dtype not in UPDATE_DTYPES:
                raise PayloadError(
                    f"tensor {name!r} has dtype {e.dtype}; updates use {UPDATE_DTYPES}"
                )
        if len(entries) > 1 or entries[0].is_piece:
            check_tiling(name, shape, entries)
    names = {e.name for e in manifest.entries}
    missing = [n for n in trainable if n not in names]
    if missing and fragment is not None:
        raise PayloadError(fragment.missing(missing))
    if missing:
        raise PayloadError(f"update is missing tensor(s) {missing[:5]}")


def check_tiling(name: str, shape: tuple[int, ...], pieces: list[TensorEntry]) -> None:
    """Pieces must cover the tensor exactly once, as a grid: along each dimension their
    extents partition it, and every combination of extents is one piece. DTensor layouts
    (FSDP2's row shards, tensor-parallel column shards, both on a 2-D mesh) are grids."""
    if any(not e.is_piece for e in pieces):
        raise PayloadError(f"tensor {name!r} is sent both whole and in pieces")
    cells = 1
    for dim, size in enumerate(shape):
        extents = sorted({(e.box_offset[dim], e.shape[dim]) for e in pieces})
        end = 0
        for start, length in extents:
            if start != end:
                raise PayloadError(
                    f"tensor {name!r}: its pieces leave a gap or overlap along dimension {dim} "
                    f"at index {min(start, end)}"
                )
            end = start + length
        if end != size:
            raise PayloadError(
                f"tensor {name!r}: its pieces cover {end} of {size} along dimension {dim}"
            )
        cells *= len(extents)
    if cells != len(pieces):
        raise PayloadError(f"tensor {name!r}: its {len(pieces)} pieces do not form a grid")


class UploadConflict(ValueError):
    """An upload id already used for a different payload or round: the request is wrong."""


class UploadBusy(ValueError):
    """The upload (or the piece of it asked for) is being received on another stream right
    now: retry shortly."""


class Upload:
    """One update being received, on one stream or on several carrying disjoint pieces
    (``PushHeader.piece``); its bytes and what of them arrived are ``UploadBytes``."""

    def __init__(
        self,
        spool: UpdateSpool,
        site: str,
        round_number: int,
        upload_id: str,
        manifest: Manifest,
        weight: float,
    ) -> None:
        self.site, self.round, self.upload_id = site, round_number, upload_id
        self.manifest, self.weight = manifest, weight
        self.path: Path = spool.part_path(round_number, site, upload_id)
        spool.round_dir(round_number).mkdir(parents=True, exist_ok=True)
        self.bytes = UploadBytes(
            self.path, manifest.total_bytes, manifest.digest, manifest.parts, spool.take_free
        )
        spans = self.bytes.spans()
        self.screen = ArrivalScreen(manifest, resumed_at=spans[-1][1] if spans else 0)
        # The ranges being received now, one per stream (None: a stream of the whole payload).
        self.streams: list[Piece | None] = []
        self.admission = None  # what it counts as once complete (``coordinator.records``)
        self.shard_digests: tuple[bytes, ...] = ()  # a sharded job's other parts' digests
        # Being verified and committed by one request: a second (a retried reservation, a
        # stream's end next to another host's reservation) must wait, never verify again.
        self.finishing = False

    @property
    def file(self) -> UploadBytes:
        """Its ``.part`` file's writer (``broken``: a failed write could not be undone)."""
        return self.bytes

    @property
    def busy(self) -> bool:
        return bool(self.streams) or self.finishing

    @property
    def received(self) -> int:
        """Bytes received in order from the start (all of them, for one stream)."""
        return self.bytes.received

    @property
    def complete(self) -> bool:
        return self.bytes.complete

    def spans(self) -> list[tuple[int, int]]:
        """The byte ranges received, ``(start, end)`` in order."""
        return self.bytes.spans()

    def acked(self, piece: Piece | None) -> int:
        """Where a stream carrying ``piece`` (None: the whole payload) resumes."""
        return self.bytes.resume_at(piece)

    def add(self, offset: int, data: bytes, piece: Piece | None = None) -> None:
        self.bytes.add(piece, offset, data)
        self.screen.add(offset, data)

    def verify(self) -> None:
        self.bytes.finish()

    def close(self) -> None:
        self.bytes.close()


def stream_clash(streams: list[Piece | None], piece: Piece | None, upload_id: str) -> str | None:
    """Why a new stream carrying ``piece`` (None: the whole payload) cannot be received next
    to ``streams``, or None when it can: pieces being received at once must be disjoint."""
    if not streams:
        return None
    if piece is None or None in streams:
        return f"upload {upload_id!r} is already being received on another stream; retry shortly"
    for other in streams:
        if piece.offset < other.end and other.offset < piece.end:
            return (
                f"piece [{piece.offset}, {piece.end}) of upload {upload_id!r} overlaps piece "
                f"[{other.offset}, {other.end}) being received on another stream; retry shortly"
            )
    return None


class UploadTable:
    def __init__(self, spool: UpdateSpool) -> None:
        self.spool = spool
        self._lock = threading.Lock()
        self._uploads: dict[tuple[str, str], Upload] = {}

    def begin(
        self,
        site: str,
        round_number: int,
        upload_id: str,
        manifest: Manifest,
        weight: float,
        piece: Piece | None = None,
        stream: bool = True,
    ) -> Upload:
        """The upload ``upload_id`` of ``site`` (resumed, or new), with a stream carrying
        ``piece`` (None: the whole payload) registered on it until ``release``. A reservation
        (``stream=False``) carries no bytes: it is registered as no stream, and may come while
        other streams of the upload are received (another host's, on a multi-node site)."""
        with self._lock:
            key = (site, upload_id)
            upload = self._uploads.get(key)
            if upload is not None and (
                upload.manifest.digest != manifest.digest or upload.round != round_number
            ):
                raise UploadConflict(
                    f"upload id {upload_id!r} was already used for another payload; "
                    "use a new upload id"
                )
            clash = stream_clash(upload.streams, piece, upload_id) if upload and stream else None
            if clash:
                raise UploadBusy(clash)
            if upload is None:
                for other in [u for k, u in self._uploads.items() if k[0] == site and not u.busy]:
                    self._drop(other)  # a restarted site abandons its older uploads
                upload = Upload(self.spool, site, round_number, upload_id, manifest, weight)
                self._uploads[key] = upload
            if stream:
                upload.streams.append(piece)
            return upload

    @contextlib.contextmanager
    def finishing(self, upload: Upload) -> Iterator[None]:
        """While ``upload`` is verified and committed; ``UploadBusy`` if it already is."""
        with self._lock:
            if upload.finishing:
                raise UploadBusy(
                    f"upload {upload.upload_id!r} is being verified and counted; ask again shortly"
                )
            upload.finishing = True
        try:
            yield
        finally:
            with self._lock:
                upload.finishing = False

    def release(self, upload: Upload, piece: Piece | None = None) -> None:
        with self._lock:
            if piece in upload.streams:
                upload.streams.remove(piece)

    def forget(self, upload: Upload) -> None:
        """The upload was committed: stop tracking it."""
        with self._lock:
            upload.close()
            self._uploads.pop((upload.site, upload.upload_id), None)

    def discard(self, upload: Upload) -> None:
        """The upload is refused for good: delete its bytes."""
        with self._lock:
            self._drop(upload)

    def _drop(self, upload: Upload) -> None:
        upload.close()
        self._uploads.pop((upload.site, upload.upload_id), None)
        self.spool.discard_part(upload.round, upload.site, upload.upload_id)

    def drop_rounds_before(self, round_number: int) -> None:
        """Abandon unfinished uploads of closed rounds (those not being received right now;
        a busy one is refused as late when it ends). Closing their files lets the disk space
        of the spool's deleted round folders go."""
        with self._lock:
            for upload in [u for u in self._uploads.values() if u.round < round_number]:
                if not upload.busy:
                    self._drop(upload)

    def busy_paths(self) -> set[Path]:
        """The ``.part`` files of the uploads being received or verified right now (a round's
        spool folder keeps them when the round is dropped: ``UpdateSpool.drop_rounds_before``)."""
        with self._lock:
            return {u.path for u in self._uploads.values() if u.busy}

    def in_progress(self) -> int:
        with self._lock:
            return len(self._uploads)
