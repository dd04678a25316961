"""Pushing one update over K streams at once (``[transfer] streams = K``, ``wire.transfer``).

A part of ``UpdatePush`` for K > 1 (K = 1, or a payload too small to cut, keeps the single
resumable stream):

1. The reservation (a header-only stream asking for a receive slot, as for one stream) also
   says which byte ranges of the upload the coordinator holds already (after a break, or a
   coordinator restart: it keeps them in the upload's range log).
2. The pieces of the payload not wholly there go into one queue; K threads, each on a
   connection of its own for this upload (closed with it, as a single stream's is), send the
   next piece until none is left, each as a stream carrying
   that piece only (``PushHeader.piece``), from where the coordinator's copy of it ends. A
   stream's next piece starts as soon as gRPC has taken the last chunk of the one before
   (``PieceUpload.handed``), without waiting for that one's reply a round trip later: two
   pushes at most on a connection at once, of disjoint pieces. The K streams share the
   upload's one receive slot. A stream that broke first asks (a header-only stream of its
   piece) where its piece stands, and resumes there.
3. Once every piece is in and ``hold`` is set (the site's checkpoint of the task is on disk),
   a reservation again: the coordinator, holding every byte, reads the payload back, checks its
   SHA-256 and counts it exactly as it counts a single stream's upload. A payload still short
   of bytes is sent again where it lacks them.
"""

from __future__ import annotations

import threading

from site_client.errors import CoordinatorError
from site_client.transfer.fetch_pieces import PieceQueue, Stopped
from wire.bulk import chunk_frame
from wire.chunking import ChunkError
from wire.proto import isthmus_pb2 as pb
from wire.transfer import Piece, ReceivedRanges


def held_ranges(reply: pb.PushReply) -> ReceivedRanges:
    """What of the payload a reply says the coordinator holds."""
    return ReceivedRanges([(r.offset, r.offset + r.length) for r in reply.received])


class PiecedPush:
    """One attempt of an ``UpdatePush`` over ``client.transfer.streams`` streams."""

    def __init__(self, push) -> None:
        self.push, self.client = push, push.client
        self._count_lock = threading.Lock()

    def reserve(self) -> tuple[ReceivedRanges, list[tuple[Piece, int]]]:
        """Start an attempt: the receive slot, what the coordinator holds already, and the
        pieces of ``push.pieces()`` still to send, each from where its held bytes end."""
        p = self.push
        if p.abort():
            raise p.withdrawn()
        # Kept open: a resumed upload whose bytes are all in must still wait for ``hold``.
        held = held_ranges(p.reserve(keep_open=True))
        todo = [(piece, held.resume_at(piece)) for piece in p.pieces()]
        p.tries += 1
        return held, [(piece, start) for piece, start in todo if start < piece.end]

    def attempt(self) -> pb.PushReply:
        p = self.push
        held, todo = self.reserve()
        # Resumed: progress stands at what the coordinator holds; resent bytes count as moved.
        p.progress.start(f"push round {p.round}", p.payload.total_bytes, held.covered())
        self.send(todo)
        if not p.wait_for_hold():
            raise p.withdrawn()
        reply = p.reserve()  # with every byte in: verified and counted
        if not reply.complete:
            p.acked = reply.acked_offset
            raise ChunkError(f"push incomplete after every piece was sent: {reply.message}")
        return reply

    def send(self, todo: list[tuple[Piece, int]]) -> None:
        """Every piece of ``todo`` (from its start), over up to K streams, each on the
        upload's connection of its own for that stream (``UpdatePush.connections``)."""
        queue = PieceQueue(todo)
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=self._stream, args=(stub, queue, errors), name=f"push-stream-{i}"
            )
            for i, stub in enumerate(self.push.connections[: len(todo)])
        ]
        for t in threads:
            t.daemon = True
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _stream(self, stub, queue: PieceQueue, errors: list) -> None:
        """One stream's loop: each piece's push starts as soon as the piece before it has
        handed its last chunk to the connection, while that one's reply is on its way back
        (two pushes at most on the stream's connection at once, never overlapping pieces)."""
        current: PieceUpload | None = None
        try:
            while True:
                if current is not None:
                    current.handed.wait()
                item = queue.take()
                following = None
                if item is not None:
                    following = PieceUpload(self.push, stub, *item, self._count, queue.stopped)
                    following.start()
                if current is not None:
                    try:
                        current.join()
                    except BaseException:
                        queue.stop()
                        if following is not None:
                            following.join(quiet=True)  # stops between chunks: stopped is set
                        raise
                if following is None:
                    return
                current = following
        except Stopped:
            pass
        except BaseException as exc:  # handed to ``send``, which raises the first
            errors.append(exc)
            queue.stop()

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self.client.bytes_sent += nbytes
        self.push.progress.advance(nbytes)


class PieceUpload:
    """One piece of an upload on ``stub``, from ``start``, in a thread of its own (``start``,
    ``join``): done once the coordinator holds all of it. ``handed`` is set once every chunk
    of the piece has been handed to the connection, or the piece's push ended."""

    def __init__(self, push, stub, piece: Piece, start: int, on_bytes, stopped) -> None:
        self.push, self.client, self.stub = push, push.client, stub
        self.piece, self.sent = piece, start  # the coordinator holds the piece up to ``sent``
        self.on_bytes, self.stopped = on_bytes, stopped
        self.unsure = False  # a stream broke: ask where the piece stands before sending
        self.handed = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="push-piece", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, quiet: bool = False) -> None:
        """Wait for the piece; raise what ended it unless it is whole (or ``quiet``)."""
        self._thread.join()
        if self._error is not None and not quiet:
            raise self._error

    def _run(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # raised by ``join``, in the stream's thread
            self._error = exc
        finally:
            self.handed.set()

    def run(self) -> None:
        self.client.call("push", self._attempt)

    def _attempt(self) -> None:
        p, c = self.push, self.client
        if self.stopped.is_set():
            raise Stopped()
        if p.abort():
            raise p.withdrawn()
        if self.unsure:
            probe = self.stub.Push(iter([p.header(piece=self.piece)]), timeout=c.rpc_timeout_s)
            self._take(probe)
        self.unsure = True
        reply = self.stub.Push(self._frames(), timeout=c.transfer_timeout_s)
        self._take(reply)
        if self.sent != self.piece.end:
            if p.abort():
                raise p.withdrawn()
            if self.stopped.is_set():
                raise Stopped()
            raise ChunkError(f"piece {_span(self.piece)} stands at {self.sent}: {reply.message}")
        self.unsure = False

    def _take(self, reply: pb.PushReply) -> None:
        """Where the coordinator says the piece stands."""
        if not self.piece.offset <= reply.acked_offset <= self.piece.end:
            raise CoordinatorError(
                None,
                f"push: the coordinator answered piece {_span(self.piece)} with offset "
                f"{reply.acked_offset}, outside it",
            )
        self.sent = reply.acked_offset

    def _frames(self):
        """The piece's header, then its chunks from where the coordinator's copy ends."""
        p, c = self.push, self.client
        yield p.header(piece=self.piece)
        for offset, data in p.payload.chunks(self.sent, c.chunk_bytes, self.piece.end):
            if p.abort() or self.stopped.is_set():
                return  # a short stream: the coordinator keeps what arrived
            yield chunk_frame(offset, data)
            self.on_bytes(len(data))
        # gRPC asks for the next frame once the last one's send completed: the piece's bytes
        # are all on the connection, and the stream's next piece may follow them now.
        self.handed.set()


def _span(piece: Piece) -> str:
    return f"[{piece.offset}, {piece.end})"
