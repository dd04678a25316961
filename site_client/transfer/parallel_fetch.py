"""Fetching one payload over K streams at once (``[transfer] streams = K``, ``wire.transfer``).

A part of ``ThetaFetcher``, for K > 1 (K = 1 keeps the single resumable stream):

1. The first stream asks for the payload's first byte: its header names the version (pinned
   from then on), the delta base, theta's hash and the manifest with the payload's size and
   SHA-256.
2. The payload is cut into pieces of whole chunks (``wire.transfer.plan_pieces``), in one
   queue; K threads, each on a connection of its own, take the next piece until none is left
   (``site_client.transfer.piece_streams``), so a slow stream takes fewer pieces instead of holding
   the whole fetch back. Each stream asks for its next piece about two round trips before its
   current one ends (``site_client.transfer.fetch_ahead``), so its connection does not sit idle for
   a round trip between pieces; once the queue is empty, an idle stream takes over the work of
   one lagging behind (``site_client.transfer.fetch_endgame``). Each piece lands at its offset in
   the sink (theta's mapped file, or memory for a delta).
3. Once every piece is in, the payload is read back and its SHA-256 checked against the
   manifest's: only then is it handed on, exactly as a single stream's would be.

When the version being fetched is no longer served (its round closed meanwhile) and the caller
asked for whatever is current, the fetch starts over on the current version, as the single
stream does; a version the caller asked for by number is refused with ``NOT_FOUND``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from site_client.errors import CoordinatorError
from site_client.transfer.piece_streams import PieceStreams
from site_client.transfer.progress import TransferProgress
from wire.bulk import parse_chunk
from wire.chunking import ChunkError
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest
from wire.transfer import plan_pieces

log = logging.getLogger("isthmus.site")
# How often one fetch starts over because the version it fetched was replaced meanwhile.
MAX_RESTARTS = 5


class ParallelFetch:
    """One payload over ``client.transfer.streams`` streams; ``run`` returns
    ``(manifest, sink, header)`` as the single-stream fetch does.

    Parameters
    ----------
    client
        The ``CoordinatorClient`` (lease, retries, byte counters, its streams' stubs).
    version, from_version
        The version asked for (None: the current one) and the one held, for a delta.
    progress
        Told of every byte received; finished when ``run`` returns.
    new_sink
        ``new_sink(manifest, is_delta)``: where the payload goes; it takes ``write_at`` and
        gives the payload back with ``payload_view``.
    """

    def __init__(
        self,
        client,
        version: int | None,
        from_version: int | None,
        progress: TransferProgress,
        new_sink: Callable[[Manifest, bool], object],
    ) -> None:
        self.client, self.version, self.from_version = client, version, from_version
        self.progress, self.new_sink = progress, new_sink
        self._count_lock = threading.Lock()
        self.rtt_s = 0.0  # the first header's round trip
        self.opened_ahead = 0  # pieces whose call was made before the one before them ended

    def run(self) -> tuple[Manifest, object, pb.FetchHeader]:
        complete = False
        try:
            for _ in range(MAX_RESTARTS):
                header = self._first_header()
                manifest = Manifest.from_proto(header.manifest)
                sink = self.new_sink(manifest, header.HasField("from_version"))
                self.progress.start(fetch_label(header), manifest.total_bytes, 0)
                try:
                    self._pieces(header, manifest, sink)
                except CoordinatorError as exc:
                    if exc.code != grpc.StatusCode.NOT_FOUND or self.version is not None:
                        raise
                    log.info("fetch: version %d is gone (%s); fetching anew", header.version, exc)
                    continue
                check_payload(manifest, sink.payload_view())
                complete = True
                return manifest, sink, header
            raise CoordinatorError(
                grpc.StatusCode.NOT_FOUND,
                f"fetch: the version served changed {MAX_RESTARTS} times during one fetch",
            )
        finally:
            self.progress.finish(complete)

    def _first_header(self) -> pb.FetchHeader:
        """The header of the payload wanted, from a fetch of its first byte (which its piece
        brings again)."""
        c = self.client

        def attempt() -> pb.FetchHeader:
            started = time.monotonic()
            req = pb.FetchRequest(lease=c.lease, offset=0, length=1)
            if self.version is not None:
                req.version = self.version
            if self.from_version is not None:
                req.from_version = self.from_version
            frames = c.bulk.Fetch(req, timeout=c.transfer_timeout_s)
            first = next(frames, None)
            if first is None:
                raise ChunkError("a fetch stream ended before its header")
            self.rtt_s = time.monotonic() - started  # what each stream asks ahead by
            for frame in frames:  # the one byte; the stream then ends
                with self._count_lock:
                    c.bytes_received += len(parse_chunk(frame)[1])
            return pb.FetchHeader.FromString(first)

        return c.call("fetch", attempt)

    def _pieces(self, first: pb.FetchHeader, manifest: Manifest, sink) -> None:
        """Every piece into ``sink``, over as many streams as there are pieces, up to K."""
        c = self.client
        pieces = plan_pieces(manifest.total_bytes, c.chunk_bytes, c.transfer.streams)
        streams = PieceStreams(c, first, self.rtt_s, self._count)
        try:
            streams.run(pieces, sink)
        finally:
            self.opened_ahead += streams.opened_ahead

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self.client.bytes_received += nbytes
        self.progress.advance(nbytes)


def check_payload(manifest: Manifest, payload: memoryview) -> None:
    """Raise unless ``payload``, read back whole, has the manifest's SHA-256."""
    if hashlib.sha256(payload).digest() != manifest.sha256:
        raise CoordinatorError(
            grpc.StatusCode.DATA_LOSS,
            "fetch: bad payload from coordinator: payload SHA-256 mismatch once every piece "
            "was in (the streams' bytes do not make up the payload the manifest describes)",
        )


def fetch_label(header: pb.FetchHeader) -> str:
    delta = f" (delta from v{header.from_version})" if header.HasField("from_version") else ""
    return f"fetch theta v{header.version}{delta}"
