"""One piece of a parallel fetch: a ranged Fetch stream, checked chunk by chunk, resumable.

A piece is the payload bytes ``[offset, end)`` (``wire.transfer.Piece``), fetched as
``FetchRequest(offset, length)`` pinned to the version the first stream's header named. Every
stream's header must equal that first header (version, delta base, theta hash, manifest with
the payload's SHA-256): a coordinator that answers two streams of one fetch with two
different payloads is refused, not stitched together. Chunks must arrive in order inside the
piece; each lands at its offset in the sink. A broken stream (through the client's retry and
backoff, ``CoordinatorClient.call``) resumes at the first byte the piece still lacks.

The checks are the pure ``header_problem`` and ``chunk_problem``; ``PieceQueue`` is the one
queue every stream of a fetch takes its next piece from.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

import grpc

from site_client.errors import CoordinatorError
from wire.bulk import parse_chunk
from wire.chunking import MAX_CHUNK_BYTES, ChunkError
from wire.proto import isthmus_pb2 as pb
from wire.transfer import Piece


class Stopped(Exception):
    """Another stream of the fetch failed: this one stops between two chunks."""


def header_problem(first: pb.FetchHeader, other: pb.FetchHeader) -> str | None:
    """How a stream's header differs from the first stream's, or None if it does not."""
    if other.version != first.version:
        return f"version {other.version}, the first stream's {first.version}"
    if other.HasField("from_version") != first.HasField("from_version") or (
        other.from_version != first.from_version
    ):
        base = "theta whole" if not other.HasField("from_version") else other.from_version
        was = "theta whole" if not first.HasField("from_version") else first.from_version
        return f"delta base {base}, the first stream's {was}"
    if other.theta_hash != first.theta_hash:
        return (
            f"theta hash {other.theta_hash.hex()[:12]}, the first stream's "
            f"{first.theta_hash.hex()[:12]}"
        )
    if other.manifest != first.manifest:
        return (
            f"another manifest (payload SHA-256 {other.manifest.sha256.hex()[:12]}, "
            f"{other.manifest.total_bytes} bytes; the first stream's "
            f"{first.manifest.sha256.hex()[:12]}, {first.manifest.total_bytes} bytes)"
        )
    return None


def chunk_problem(piece: Piece, expected: int, offset: int, size: int) -> str | None:
    """Why a chunk of ``size`` bytes at ``offset`` does not belong where the piece stands
    (``expected``: its next byte), or None when it does."""
    if size == 0:
        return f"empty chunk at offset {offset}"
    if size > MAX_CHUNK_BYTES:
        return f"chunk of {size} bytes exceeds the {MAX_CHUNK_BYTES}-byte limit"
    if offset != expected:
        return (
            f"out-of-order chunk: offset {offset}, next expected offset {expected} in the "
            f"piece [{piece.offset}, {piece.end})"
        )
    if offset + size > piece.end:
        return (
            f"chunk at offset {offset} of {size} bytes runs past the piece "
            f"[{piece.offset}, {piece.end})"
        )
    return None


class PieceQueue:
    """The pieces not yet taken (of a fetch, or of a push with where each starts), in payload
    order; ``stop`` empties it for every stream."""

    def __init__(self, pieces: Iterable) -> None:
        self._pieces = deque(pieces)
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def take(self):
        with self._lock:
            if self.stopped.is_set() or not self._pieces:
                return None
            return self._pieces.popleft()

    def put_back(self, piece) -> None:
        """A piece taken but not fetched: the next ``take`` hands it out again."""
        with self._lock:
            self._pieces.appendleft(piece)

    def stop(self) -> None:
        self.stopped.set()


def fetch_request(
    lease: pb.Lease, first: pb.FetchHeader, offset: int, length: int
) -> pb.FetchRequest:
    """The ranged request for ``length`` bytes from ``offset`` of the first header's payload."""
    req = pb.FetchRequest(lease=lease, version=first.version, offset=offset, length=length)
    if first.HasField("from_version"):
        req.from_version = first.from_version
    return req


class PieceStream:
    """Fetches one piece into ``sink`` (``write_at``) over ``stub``; ``run`` returns once it
    is whole.

    Parameters
    ----------
    client
        The ``CoordinatorClient``: its lease, retry plumbing and transfer deadline.
    stub
        The ``wire.bulk.BulkStub`` of this stream's own connection.
    first
        The first stream's header, which every header of this piece must equal.
    on_bytes
        Called with the size of every chunk written (byte counters, progress).
    stopped
        Set when another stream failed: this one ends between chunks (``Stopped``).
    call
        The piece's Fetch call if it was made ahead (``site_client.transfer.fetch_ahead``).
    ahead
        The stream's ``NextPiece``: told of every chunk, so that it makes the next piece's
        call in time, and withdrawn when this piece breaks.
    race
        A ``fetch_endgame.Race`` when another stream fetches the rest of this piece too (set
        later by ``Endgame`` for the stream that had it first): the first to end it wins.
    """

    def __init__(
        self,
        client,
        stub,
        first: pb.FetchHeader,
        piece: Piece,
        sink,
        on_bytes: Callable[[int], None],
        stopped: threading.Event,
        call=None,
        ahead=None,
        race=None,
    ) -> None:
        self.client, self.stub, self.first, self.piece = client, stub, first, piece
        self.sink, self.on_bytes, self.stopped = sink, on_bytes, stopped
        self.call, self.ahead, self.race = call, ahead, race
        self.received = piece.offset  # the piece's first byte not yet written
        self._headed = False  # the header of the current attempt arrived
        self.frames = None  # the call of the current attempt (``fetch_endgame`` cancels it)
        self.done = False  # every byte of the piece is in

    def run(self) -> None:
        self.client.call("fetch", self._attempt)

    def _open(self):
        c, end = self.client, self.piece.end
        req = fetch_request(c.lease, self.first, self.received, end - self.received)
        return self.stub.Fetch(req, timeout=c.transfer_timeout_s)

    def _attempt(self) -> None:
        if self.stopped.is_set():
            raise Stopped()
        if self._settled():  # the break came after the last chunk, or the race was won
            return
        early, self.call = self.call, None
        frames = early if early is not None else self._open()
        self._running(frames)
        try:
            self._receive(frames, fresh=early is None)
        except BaseException as exc:
            frames.cancel()  # frees the coordinator's send slot now, not at the deadline
            self._running(None)
            if self._settled():
                return  # the other stream of a race won, and cancelled this call
            if early is not None and not self._headed and _busy(exc):
                # Made ahead of a free send slot (the pieces before it were still being
                # sent): now that they are whole, ask again at once.
                return self._attempt()
            self._broke()
            raise
        self._running(None)
        if not self._settled():
            self._broke()
            raise ChunkError(
                f"the stream of piece [{self.piece.offset}, {self.piece.end}) ended at "
                f"{self.received}"
            )

    def _running(self, frames) -> None:
        self.frames = frames
        if self.race is not None:
            self.race.running(self, frames)

    def _settled(self) -> bool:
        """Whether the piece is whole: here (then the race, if any, is won), or by the other
        stream of its race."""
        if self.received == self.piece.end:
            if not self.done:
                self.done = True
                if self.race is not None:
                    self.race.finish(self)
            return True
        return self.race is not None and self.race.won.is_set()

    def _broke(self) -> None:
        if self.ahead is not None:
            self.ahead.withdraw()

    def _receive(self, frames, fresh: bool) -> None:
        self._headed = False
        first_frame = next(frames, None)
        if first_frame is None:
            raise ChunkError("a fetch stream ended before its header")
        self._headed = True
        header = pb.FetchHeader.FromString(first_frame)
        if problem := header_problem(self.first, header):
            raise CoordinatorError(
                None, f"fetch: the coordinator answered streams of one fetch differently: {problem}"
            )
        if self.ahead is not None:
            self.ahead.progress(0, self.piece.end - self.received, fresh)
        for frame in frames:
            if self.stopped.is_set():
                raise Stopped()
            if self.race is not None and self.race.won.is_set():
                return
            offset, data = parse_chunk(frame)
            if problem := chunk_problem(self.piece, self.received, offset, len(data)):
                raise ChunkError(problem)
            self.sink.write_at(offset, data)
            self.received += len(data)
            if self.ahead is not None:
                self.ahead.progress(len(data), self.piece.end - self.received)
            self.on_bytes(len(data))


def _busy(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
