"""Fetching only the bytes of theta a host's trainers hold: a node of a multi-node site.

Node 0 fetches theta whole and checks it against theta's hash. Another node's trainers need
only their own boxes of each tensor (``site_client.trainer.shards``), so its agent fetches only the
byte ranges that cover them:

1. A first ranged fetch of one byte asks for the header with the payload's block digests
   (``FetchRequest.block_digests``): the manifest, and the SHA-256 of every block of
   ``block_bytes``.
2. Each box becomes the span of the payload from its first element to its last (a shard of
   rows is exactly its bytes; a box of columns a little more), rounded out to whole blocks and
   merged (``ranges_for``).
3. The ranges, cut into pieces of whole blocks (``split_ranges``), are fetched over
   ``[transfer] streams`` as a whole payload's pieces are (``site_client.transfer.piece_streams``:
   each ranged fetch resumable, its header checked against the first, the next one asked for ahead
   of the current one's end) into theta's mapped file; every block fetched must hash to its
   digest. The bytes of blocks not fetched stay zero, and no trainer of this host
   reads them.

The version and theta hash must be the ones node 0 was given (the driver's task).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from site_client.errors import CoordinatorError
from site_client.transfer.piece_streams import PieceStreams
from site_client.transfer.theta_fetch import MappedSink
from wire.chunking import ChunkError
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import create_mapped
from wire.tensors import DTYPES, Manifest, PayloadError, state_hash
from wire.transfer import PIECES_PER_STREAM, Piece, ReceivedRanges


@dataclass(frozen=True, order=True)
class Box:
    """A trainer's box of tensor ``name``: ``shape`` from ``offset`` (one index per dim)."""

    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def from_json(cls, value) -> Box:
        name, offset, shape = value
        return cls(str(name), tuple(int(i) for i in offset), tuple(int(d) for d in shape))


def byte_span(manifest: Manifest, box: Box) -> tuple[int, int] | None:
    """The payload bytes from the box's first element to its last (None: an empty box)."""
    entry = manifest.by_name().get(box.name)
    if entry is None:
        raise PayloadError(f"theta has no tensor {box.name!r}")
    shape = entry.shape
    if len(box.offset) != len(shape) or len(box.shape) != len(shape):
        raise PayloadError(
            f"box of {box.name!r} has {len(box.shape)} dims, the tensor {len(shape)}"
        )
    if any(
        o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offset, box.shape, shape, strict=True)
    ):
        raise PayloadError(f"box {box.offset}+{box.shape} lies outside {box.name!r} {shape}")
    if not math.prod(box.shape):
        return None
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    first = sum(o * st for o, st in zip(box.offset, strides, strict=True))
    last = sum((o + s - 1) * st for o, s, st in zip(box.offset, box.shape, strides, strict=True))
    item = torch.empty((), dtype=DTYPES[entry.dtype]).element_size()
    return entry.offset + first * item, entry.offset + (last + 1) * item


def ranges_for(manifest: Manifest, boxes: Iterable[Box], block: int) -> list[Piece]:
    """The whole blocks of the payload that cover ``boxes``, merged into ranges."""
    covered = ReceivedRanges()
    total = manifest.total_bytes
    for box in boxes:
        span = byte_span(manifest, box)
        if span is not None:
            covered.add(span[0] // block * block, min(total, -(-span[1] // block) * block))
    return [Piece(start, end - start) for start, end in covered.spans]


def split_ranges(ranges: list[Piece], block: int, streams: int) -> list[Piece]:
    """``ranges`` cut at whole blocks into pieces of about ``PIECES_PER_STREAM`` per stream,
    so that K streams share a few large ranges as they share a whole payload."""
    total = sum(r.length for r in ranges)
    if streams <= 1 or not total:
        return ranges
    most = max(block, -(-total // (PIECES_PER_STREAM * streams * block)) * block)
    return [
        Piece(start, min(most, r.end - start))
        for r in ranges
        for start in range(r.offset, r.end, most)
    ]


def first_header(client, version: int) -> pb.FetchHeader:
    """The header of theta ``version`` with its block digests (one byte of payload asked for)."""

    def ask() -> pb.FetchHeader:
        req = pb.FetchRequest(lease=client.lease, version=version, offset=0, length=1)
        req.block_digests = True
        # The coordinator may wait for a send slot, and hash theta's blocks, before it answers.
        frames = client.bulk.Fetch(req, timeout=client.transfer_timeout_s)
        try:
            first = next(frames, None)
        finally:
            frames.cancel()
        if first is None:
            raise ChunkError("a fetch stream ended before its header")
        return pb.FetchHeader.FromString(first)

    return client.call("fetch", ask)


def fetch_boxes(client, version: int, theta_hash: str, boxes: list[Box] | None, dest: Path) -> int:
    """Theta ``version``'s bytes that hold ``boxes`` (None: all of it) into a new safetensors
    file at ``dest``; returns how many payload bytes were fetched."""
    started = time.monotonic()
    first = first_header(client, version)
    rtt_s = time.monotonic() - started  # what each stream asks ahead by
    if first.version != version or first.theta_hash.hex() != theta_hash:
        raise CoordinatorError(None, f"fetch: theta_{version} is not the one node 0 was given")
    try:
        manifest = Manifest.from_proto(first.manifest)
        block, digests = int(first.block_bytes), list(first.block_sha256)
        if block <= 0 or len(digests) != -(-manifest.total_bytes // block):
            raise PayloadError(f"{len(digests)} block digests of {block} bytes for the payload")
        whole = [Piece(0, manifest.total_bytes)] if manifest.total_bytes else []
        ranges = whole if boxes is None else ranges_for(manifest, boxes, block)
        pieces = split_ranges(ranges, block, client.transfer.streams)
        file = create_mapped(dest, manifest)
    except PayloadError as exc:
        raise CoordinatorError(None, f"fetch: bad payload from coordinator: {exc}") from exc
    sink = MappedSink(file)
    moved = _Moved(client)
    PieceStreams(client, first, rtt_s, moved.count).run(pieces, sink)
    view = sink.view
    for piece in pieces:
        for b in range(piece.offset // block, -(-piece.end // block)):
            data = view[b * block : min((b + 1) * block, manifest.total_bytes)]
            if hashlib.sha256(data).digest() != digests[b]:
                raise CoordinatorError(
                    None, f"fetch: block {b} of theta_{version} does not match its digest"
                )
    if boxes is None and state_hash(file.tensors).hex() != theta_hash:
        raise CoordinatorError(None, f"fetch: theta_{version} does not match its hash")
    return moved.total


class _Moved:
    """Payload bytes received, counted from every stream's thread."""

    def __init__(self, client) -> None:
        self.client, self.total = client, 0
        self._lock = threading.Lock()

    def count(self, n: int) -> None:
        with self._lock:
            self.client.bytes_received += n
            self.total += n
