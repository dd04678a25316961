"""The client-side validity oracle, written from the protocol's rules rather than from the
server's code: whether a push stream would be a valid, complete update that must count (the
fuzzer then corrupts its last chunk, so that no push it sends may count)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from wire.digest import payload_digest
from wire.proto import isthmus_pb2 as pb

from .constants import (
    ALIGN,
    MAX_CHUNK_BYTES,
    MAX_UPDATE_BYTES,
    SPEC_NAME,
    TRAINABLE,
    UPDATE_ITEMSIZE,
)


@dataclass
class Resume:
    """An upload the case left partly received, which the case's main stream may continue."""

    site: str
    upload_id: str
    sha: bytes
    prefix: bytes
    total: int
    entries: list


def manifest_problem(m: pb.Manifest) -> str | None:
    """Why ``m`` is not a valid update manifest for the tiny model (None: it is valid)."""
    if m.total_bytes > MAX_UPDATE_BYTES:
        return "oversize"
    if len(m.digest) != 32:
        return "sha length"
    names = [t.name for t in m.tensors]
    if sorted(names) != sorted(TRAINABLE):
        return "tensor names"
    ranges = []
    for t in m.tensors:
        if t.dtype not in UPDATE_ITEMSIZE or t.codec != "none":
            return "dtype or codec"
        if list(t.shape) != TRAINABLE[t.name]:
            return "shape"
        if t.nbytes != math.prod(t.shape) * UPDATE_ITEMSIZE[t.dtype]:
            return "nbytes"
        if t.offset + t.nbytes > m.total_bytes:
            return "past the end"
        ranges.append((t.offset, t.offset + t.nbytes))
    # Laid end to end in offset order, each start at most aligned up to ALIGN, nothing after
    # the last: bytes no tensor needs are refused.
    end = 0
    for start, stop in sorted(ranges):
        if start < end:
            return "overlap"
        if start > -(-end // ALIGN) * ALIGN:
            return "gap"
        end = stop
    return "slack" if m.total_bytes != end else None


def all_finite(entries, data: bytes) -> bool:
    for t in entries:
        raw = data[t.offset : t.offset + t.nbytes]
        if t.dtype == "float32":
            a = np.frombuffer(raw, "<f4")
        elif t.dtype == "float16":
            a = np.frombuffer(raw, "<f2")
        else:  # bfloat16: the high half of a float32
            a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        if not np.isfinite(a).all():
            return False
    return True


def push_verdict(msgs: list, leases: set, r: int, resume: Resume | None = None) -> str:
    """What the protocol says a push stream is: ``count`` (a valid, complete update),
    ``partial`` (valid so far, bytes missing: acknowledged, nothing counted) or ``refuse``.
    ``None`` in ``msgs`` stands for a message that does not decode."""
    if not msgs or msgs[0] is None or msgs[0].WhichOneof("kind") != "header":
        return "refuse"
    h = msgs[0].header
    if (h.lease.site, h.lease.token) not in leases or h.round != r or h.base_version != r:
        return "refuse"
    if not SPEC_NAME.fullmatch(h.upload_id):
        return "refuse"
    if not (math.isfinite(h.weight) and 0 < h.weight <= 1e15):
        return "refuse"
    if manifest_problem(h.manifest):
        return "refuse"
    total, sha, entries = h.manifest.total_bytes, bytes(h.manifest.digest), h.manifest.tensors
    data = b""
    if resume and (resume.site, resume.upload_id) == (h.lease.site, h.upload_id):
        if sha != resume.sha:
            return "refuse"  # an upload id reused for another payload
        total, entries, data = resume.total, resume.entries, resume.prefix
    if h.HasField("piece"):
        return piece_verdict(h.piece, total, len(data), msgs[1:])
    for m in msgs[1:]:
        if m is None or m.WhichOneof("kind") != "chunk":
            return "refuse"
        c = m.chunk
        n = len(c.data)
        if n == 0 or n > MAX_CHUNK_BYTES or c.offset != len(data) or len(data) + n > total:
            return "refuse"
        data += c.data
    if len(data) < total:
        return "partial"
    if payload_digest(data) != sha or not all_finite(entries, data):
        return "refuse"
    return "count"


def piece_verdict(piece: pb.ByteRange, total: int, held: int, chunks: list) -> str:
    """A stream carrying one piece (``[transfer] streams`` > 1) never counts: ``partial`` if
    the piece lies inside the payload and its chunks come in order from where the piece is
    received up to (``held``: bytes received from the start), else ``refuse``."""
    start, end = piece.offset, piece.offset + piece.length
    if piece.length == 0 or end > total:
        return "refuse"
    at = min(held, end) if start <= held else start
    for m in chunks:
        if m is None or m.WhichOneof("kind") != "chunk":
            return "refuse"
        n = len(m.chunk.data)
        if n == 0 or n > MAX_CHUNK_BYTES or m.chunk.offset != at or at + n > end:
            return "refuse"
        at += n
    return "partial"


def corrupt_last_chunk(msgs: list) -> bool:
    """Flip one bit of the last chunk's data (the payload's SHA-256 then fails)."""
    for m in reversed(msgs):
        if m is not None and m.WhichOneof("kind") == "chunk" and m.chunk.data:
            data = bytearray(m.chunk.data)
            data[-1] ^= 0x01
            m.chunk.data = bytes(data)
            return True
    return False
