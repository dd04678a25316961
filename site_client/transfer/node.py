"""A node of a multi-node site as the transfer engine sees it: the ranges of theta its
trainers hold, fetched; its part of the site's update, pushed.

Down. Node 0 fetches theta whole and checks it against theta's hash. Another node's trainers need
only their own boxes of each tensor (``site_client.trainer.shards``), so its agent fetches only the
byte ranges that cover them:

1. A first ranged fetch of one byte asks for the header with the payload's block digests
   (``FetchRequest.block_digests``): the manifest, and the digest of every block of
   ``block_bytes``.
2. Each box becomes the span of the payload from its first element to its last (a shard of
   rows is exactly its bytes; a box of columns a little more), rounded out to whole blocks and
   merged (``ranges_for``).
3. The ranges, cut into pieces of whole blocks (``plan.split_ranges``), are this node's list
   of pieces for the transfer engine (``site_client.transfer.engine``), fetched over
   ``[transfer] streams`` as a whole payload's pieces are (each ranged fetch resumable, its
   header checked against the first, the next one asked for ahead of the current one's end)
   into theta's mapped file; every block fetched must hash to its digest. The bytes of blocks
   not fetched stay zero, and no trainer of this host reads them.

The version and theta hash must be the ones node 0 was given (the driver's task).

Up. Every node of the site pushes the bytes of its own part (``SitePart``, from
``wire.payload_parts``), under the site's one upload id and lease, as pieces over its own
connections (``site_client.transfer.push``): no host relays another's bytes. The coordinator
holds one upload for the site and counts it once, when every part is in and verified, through
the reservation of the node that completes the update (node 0, the one holding the site's
lease and hearing when its trainers' checkpoint is on disk). Every other reservation is sent
``keep_open``: it may not count the update, whatever arrived. A node that does not complete
is done once its part is in; the completing one waits for ``hold`` (its checkpoint), then asks
again until the coordinator, holding every part, has counted the update (``await_parts``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from site_client.errors import CoordinatorError, PartsStalled
from site_client.transfer.endpoints import coordinator_endpoint
from site_client.transfer.engine import Tally, Transfer
from site_client.transfer.movers import FetchMover, FirstHeader, first_header, held_ranges
from site_client.transfer.plan import routed, split_ranges
from site_client.transfer.progress import TransferProgress
from site_client.transfer.theta import MappedSink, fetch_label
from wire.chunking import ChunkError
from wire.digest import payload_digest, state_digest
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import create_mapped
from wire.tensors import DTYPES, Manifest, PayloadError
from wire.transfer import Piece, ReceivedRanges, plan_pieces

POLL_S = 0.05  # between the completing node's asks while other parts arrive
POLL_CAP_S = 1.0
# The other hosts' parts stopped arriving this long: the update is withdrawn (a host whose
# part was refused, or lost with its agent, does not send it again).
STALL_S = 300.0


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


def fetch_boxes(client, version: int, theta_hash: str, boxes: list[Box] | None, dest: Path) -> int:
    """Theta ``version``'s bytes that hold ``boxes`` (None: all of it) into a new safetensors
    file at ``dest``; returns how many payload bytes were fetched."""

    def ask() -> FirstHeader:
        req = pb.FetchRequest(lease=client.lease, version=version, offset=0, length=1)
        req.block_digests = True  # the coordinator may hash theta's blocks before it answers
        return first_header(client, req, drain=True)

    first = client.call("fetch", ask)
    header = first.header
    if header.version != version or header.theta_hash.hex() != theta_hash:
        raise CoordinatorError(None, f"fetch: theta_{version} is not the one node 0 was given")
    try:
        manifest = Manifest.from_proto(header.manifest)
        block, digests = int(header.block_bytes), list(header.block_digests)
        if block <= 0 or len(digests) != -(-manifest.total_bytes // block):
            raise PayloadError(f"{len(digests)} block digests of {block} bytes for the payload")
        whole = [Piece(0, manifest.total_bytes)] if manifest.total_bytes else []
        ranges = whole if boxes is None else ranges_for(manifest, boxes, block)
        pieces = split_ranges(ranges, block, client.transfer.streams)
        file = create_mapped(dest, manifest)
    except PayloadError as exc:
        raise CoordinatorError(None, f"fetch: bad payload from coordinator: {exc}") from exc
    sink = MappedSink(file)
    progress = TransferProgress()
    progress.start(f"{fetch_label(header)} (this node's part)", sum(p.length for p in pieces))
    tally = Tally(client, progress, sent=False)
    streams = client.transfer.streams
    mover = FetchMover(client, header, sink)
    try:
        endpoint = coordinator_endpoint(client, streams)
        Transfer(client, mover, tally, streams, first.rtt_s).run(routed(pieces, endpoint))
    finally:
        progress.finish(tally.total >= sum(p.length for p in pieces))
    _check_blocks(sink.view, pieces, block, digests, version)
    if boxes is None and state_digest(file.tensors).hex() != theta_hash:
        raise CoordinatorError(None, f"fetch: theta_{version} does not match its hash")
    return tally.total


def _check_blocks(view, pieces: list[Piece], block: int, digests: list[bytes], version: int):
    """Raise unless every block the pieces cover hashes to its digest."""
    total = len(view)
    for piece in pieces:
        for b in range(piece.offset // block, -(-piece.end // block)):
            data = view[b * block : min((b + 1) * block, total)]
            if payload_digest(data) != digests[b]:
                raise CoordinatorError(
                    None, f"fetch: block {b} of theta_{version} does not match its digest"
                )


@dataclass(frozen=True)
class SitePart:
    """This host's bytes ``[offset, offset + length)`` of the site's payload; ``completes``:
    this host's reservation counts the update once every part is in."""

    offset: int
    length: int
    completes: bool

    @property
    def end(self) -> int:
        return self.offset + self.length

    def pieces(self, chunk_bytes: int, streams: int) -> list[Piece]:
        """The part as pieces for ``streams`` streams, at its place in the payload."""
        planned = plan_pieces(self.length, chunk_bytes, streams)
        return [Piece(self.offset + p.offset, p.length) for p in planned]


def await_parts(push, part: SitePart) -> pb.PushReply:
    """Ask until ``push`` (a ``push.UpdatePush``, its ``hold`` set) counts: the other nodes'
    parts may still be arriving. Once they stop arriving for ``STALL_S``, the update is
    withdrawn (``PartsStalled``)."""
    delay = POLL_S
    covered, since = -1, time.monotonic()
    while True:
        asked = time.monotonic()
        reply = push.reserve()
        if reply.complete:
            return reply
        if time.monotonic() - asked > POLL_CAP_S:  # waited for a slot: so did the others
            since = time.monotonic()
        held = held_ranges(reply)
        if held.covered_in(part.offset, part.end) < part.length:
            raise ChunkError(f"this node's part is not all in: {reply.message}")
        if push.abort():
            raise push.withdrawn()
        if held.covered() != covered:
            covered, since = held.covered(), time.monotonic()
        elif time.monotonic() - since > STALL_S:
            raise PartsStalled(
                f"push of round {push.round}: the site's other hosts' parts stopped "
                f"arriving ({covered} of {push.payload.total_bytes} bytes in for "
                f"{STALL_S:g}s)"
            )
        time.sleep(delay)
        delay = min(delay * 2, POLL_CAP_S)
