"""The engine's two directions: a ranged Fetch call into a sink, a push stream of a piece.

Each is a small ``engine.Mover``: where a piece starts, its call, carrying that call to its
end, and where a broken piece goes on. Both take their bytes as ``wire.bulk`` frames; a chunk
frame is built with one join of its offset and bytes (``chunk_frame``) and read without a copy
(``parse_chunk``), and a fetched chunk is written once, at its offset, into the sink (theta's
mapped file).

Down: every piece is ``FetchRequest(offset, length)`` pinned to the version the transfer's
first header named (``first_header``, the one routine that reads it), and every piece's header
must equal that first one (``header_problem``). A header for another version or delta base is
refused; one for the same version with another payload means the version was made again (a
restarted coordinator closed its round again): ``PayloadChanged``, and the fetch starts over.
Chunks must arrive in order inside the piece (``plan.chunk_problem``).

Up: a piece is a push stream of its header and chunks. A payload on one stream goes as the
whole payload (no ``PushHeader.piece``): its last chunk waits for ``hold``, its reply says
whether the update counted, and after a break a reservation says where it stands. K streams'
pieces each carry ``PushHeader.piece``; a broken one first asks (a header-only stream of its
piece) where the coordinator's copy of it ends. Every offset a reply names must lie inside the
piece (``plan.ack_problem``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc

from site_client.errors import CoordinatorError
from site_client.transfer.engine import PieceRun, Reopen, Schedule, Stopped
from site_client.transfer.plan import LEAD_RTTS, ack_problem, chunk_problem
from wire.bulk import chunk_frame, parse_chunk
from wire.chunking import ChunkError
from wire.proto import isthmus_pb2 as pb
from wire.transfer import ReceivedRanges

FETCH = Schedule(lead_rtts=LEAD_RTTS, endgame=True, withdraw_on_break=True)
# A push's next piece follows once its last chunk is handed over. The ranges one upload
# receives at once must be disjoint (the coordinator refuses a clash), so no stream races
# another's piece; and a broken piece leaves its stream's next push going, which holds no slot
# its retry needs (a site may have 2 K push streams open).
PUSH = Schedule(lead_rtts=None, endgame=False, withdraw_on_break=False)


class PayloadChanged(CoordinatorError):
    """A piece's header names the fetch's version with another payload."""


@dataclass(frozen=True)
class FirstHeader:
    """A fetch's first header, the call it came on (its frames after it) and its round trip."""

    header: pb.FetchHeader
    frames: FetchCall
    rtt_s: float


class FetchCall:
    """A started Fetch call's frames (``wire.bulk``), and its cancelling: a gRPC call's, or
    nothing for a stub that hands back a plain iterator. ``replay`` hands a frame read
    already (the first header) out again, so the call reads as new to its piece."""

    def __init__(self, frames) -> None:
        self.frames = frames
        self._replay: bytes | None = None

    def replay(self, frame: bytes) -> FetchCall:
        self._replay = frame
        return self

    def __iter__(self) -> FetchCall:
        return self

    def __next__(self) -> bytes:
        if self._replay is not None:
            frame, self._replay = self._replay, None
            return frame
        return next(self.frames)

    def cancel(self) -> None:
        if isinstance(self.frames, grpc.RpcContext):
            self.frames.cancel()


def first_header(client, request: pb.FetchRequest, drain: bool) -> FirstHeader:
    """The header of the payload ``request`` asks for, from its call's first frame. With
    ``drain`` the call's bytes (the one a probe asks for) are read and counted here; else
    the call goes on as the first piece's, from its header."""
    started = time.monotonic()
    frames = FetchCall(client.bulk.Fetch(request, timeout=client.transfer_timeout_s))
    first = next(frames, None)
    if first is None:
        raise ChunkError("a fetch stream ended before its header")
    rtt_s = time.monotonic() - started  # what each stream asks ahead by
    header = pb.FetchHeader.FromString(first)
    if drain:
        for frame in frames:
            client.bytes_received += len(parse_chunk(frame)[1])
    return FirstHeader(header, frames.replay(first), rtt_s)


def fetch_request(
    lease: pb.Lease, first: pb.FetchHeader, offset: int, length: int
) -> pb.FetchRequest:
    """The ranged request for ``length`` bytes from ``offset`` of the first header's payload."""
    req = pb.FetchRequest(lease=lease, version=first.version, offset=offset, length=length)
    if first.HasField("from_version"):
        req.from_version = first.from_version
    return req


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
            f"another manifest (payload digest {other.manifest.digest.hex()[:12]}, "
            f"{other.manifest.total_bytes} bytes; the first stream's "
            f"{first.manifest.digest.hex()[:12]}, {first.manifest.total_bytes} bytes)"
        )
    return None


class FetchMover:
    """Pieces of the payload ``first`` heads, fetched into ``sink`` (``write_at``)."""

    describe, schedule = "fetch", FETCH

    def __init__(self, client, first: pb.FetchHeader, sink) -> None:
        self.client, self.first, self.sink = client, first, sink

    def start(self, piece) -> int:
        return piece.offset

    def open(self, run: PieceRun, stub, ahead: bool):
        c, end = self.client, run.piece.end
        req = fetch_request(c.lease, self.first, run.received, end - run.received)
        return FetchCall(stub.Fetch(req, timeout=c.transfer_timeout_s))

    def resume(self, run: PieceRun) -> None:
        """A fetch knows where its piece stands: the bytes it wrote."""

    def carry(self, run: PieceRun, call, fresh: bool) -> None:
        try:
            first_frame = next(call, None)
        except grpc.RpcError as exc:
            if not fresh and exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise Reopen() from exc  # made ahead of a free send slot: ask again now
            raise
        if first_frame is None:
            raise ChunkError("a fetch stream ended before its header")
        self._check(pb.FetchHeader.FromString(first_frame))
        piece = run.piece
        run.moved(0, piece.end - run.received, fresh)
        for frame in call:
            if run.halted():
                return
            offset, data = parse_chunk(frame)
            if problem := chunk_problem(piece, run.received, offset, len(data)):
                raise ChunkError(problem)
            self.sink.write_at(offset, data)
            run.received += len(data)
            run.moved(len(data), piece.end - run.received)

    def _check(self, header: pb.FetchHeader) -> None:
        if problem := header_problem(self.first, header):
            same_version = problem.startswith(("theta hash", "another manifest"))
            error = PayloadChanged if same_version else CoordinatorError
            raise error(
                None, f"fetch: the coordinator answered streams of one fetch differently: {problem}"
            )


def held_ranges(reply: pb.PushReply) -> ReceivedRanges:
    """What of the payload a push reply says the coordinator holds."""
    return ReceivedRanges([(r.offset, r.offset + r.length) for r in reply.received])


class PushCall:
    """One push stream on one connection: carried in the stream's own thread (``result``), or
    started ahead in a thread of its own (``start``) while the piece before it still waits for
    its reply. ``handed`` is set once every chunk is on the connection."""

    def __init__(self, stub, timeout_s: float) -> None:
        self.stub, self.timeout_s = stub, timeout_s
        self.frames = iter(())
        self.handed, self.cancelled = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._reply: pb.PushReply | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="push-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._reply = self.stub.Push(self.frames, timeout=self.timeout_s)
        except BaseException as exc:  # raised by ``result``, in the stream's thread
            self._error = exc
        finally:
            self.handed.set()

    def result(self) -> pb.PushReply:
        if self._thread is None:
            self._run()
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._reply

    def cancel(self) -> None:
        """End the stream at its next chunk (the coordinator keeps what arrived) and wait for
        its reply, so no stream of this upload is still open when the next one starts."""
        self.cancelled.set()
        if self._thread is not None:
            self._thread.join()


class PushMover:
    """Pieces of ``push``'s payload (a ``push.UpdatePush``), each from where the coordinator's
    copy of it ends (``held``, from the attempt's reservation); ``whole``: one stream of the
    whole payload."""

    describe, schedule = "push", PUSH

    def __init__(self, push, held: ReceivedRanges, whole: bool) -> None:
        self.push, self.client, self.held, self.whole = push, push.client, held, whole
        self.reply: pb.PushReply | None = None  # whole: the reply that counted the update

    def start(self, piece) -> int:
        return self.held.resume_at(piece)

    def open(self, run: PieceRun, stub, ahead: bool) -> PushCall:
        call = PushCall(stub, self.client.transfer_timeout_s)
        call.frames = self.push.frames(run.received) if self.whole else self._frames(run, call)
        if ahead:
            call.start()
        return call

    def carry(self, run: PieceRun, call: PushCall, fresh: bool) -> None:
        if not fresh and call.handed.is_set():
            run.moved(0, 0)  # all handed before the stream took it up: the next may go
        self._take(run, call.result())
        if run.received != run.piece.end:
            if self.push.abort():
                raise self.push.withdrawn()
            if run.transfer_stopped():
                raise Stopped()
            raise ChunkError(
                f"push of piece [{run.piece.offset}, {run.piece.end}) stands at "
                f"{run.received}: {self.reply.message if self.reply else ''}"
            )

    def resume(self, run: PieceRun) -> None:
        """Ask where the piece stands: the whole payload's reservation (which may find it
        counted already), or a header-only stream of the piece."""
        p, c = self.push, self.client
        if p.abort():
            raise p.withdrawn()
        if self.whole:
            self._take(run, p.reserve())
            return
        probe = run.stub.Push(iter([p.header(piece=run.piece)]), timeout=c.rpc_timeout_s)
        self._take(run, probe)

    def _take(self, run: PieceRun, reply: pb.PushReply) -> None:
        """Where the coordinator says the piece stands."""
        self.reply = reply
        if self.whole and reply.complete:
            run.received = run.piece.end
            return
        if problem := ack_problem(run.piece, reply.acked_offset):
            raise CoordinatorError(None, f"push: the coordinator answered a piece with {problem}")
        run.received = reply.acked_offset

    def _frames(self, run: PieceRun, call: PushCall):
        """The piece's header, then its chunks from where the coordinator's copy ends."""
        p, piece = self.push, run.piece
        yield p.header(piece=piece)
        for offset, data in p.payload.chunks(run.received, self.client.chunk_bytes, piece.end):
            if p.abort() or call.cancelled.is_set() or run.transfer_stopped():
                return  # a short stream: the coordinator keeps what arrived
            yield chunk_frame(offset, data)
            # gRPC asks for the next frame once this one's send completed: after the last,
            # the piece's bytes are all on the connection, and its next piece may follow.
            run.moved(len(data), piece.end - offset - len(data))
        call.handed.set()
