"""Pushing one update: a resumable client stream, withdrawn on request, committed on cue.

A part of ``CoordinatorClient``. The stream is the header, then the payload in chunks; after a
break a header-only probe asks how much arrived and the next stream resumes there. ``abort`` is
read between chunks (another copy of the data unit won: stop sending). ``hold`` keeps the last
chunk back until it is set (the site's checkpoint of the task is on disk): the coordinator
counts an update only when its last byte arrives, so everything but one chunk crosses the WAN
while the checkpoint is written.

A refusal because the unit was already committed carries the winner's name in trailing metadata
(``isthmus-committed-by``); if it is this site (its own earlier copy, replayed after a
coordinator restart) the update did count.

Every byte sent is reported to ``progress`` (``site_client.transfer.progress``): a bar on a
terminal, a log line now and then elsewhere, for a long push only.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc

from site_client.agent.update_payload import UpdatePayload
from site_client.errors import CoordinatorError, PushAborted
from site_client.transfer.node_push import PartsPush, SitePart
from site_client.transfer.parallel_push import PiecedPush
from site_client.transfer.progress import TransferProgress
from wire.bulk import RESERVE_WAIT_S, chunk_frame
from wire.chunking import ChunkError
from wire.proto import isthmus_pb2 as pb
from wire.transfer import Piece, plan_pieces

COMMITTED_BY = "isthmus-committed-by"


def committed_by(exc: BaseException) -> str:
    """The winning site named in a refusal's trailing metadata ("" if none)."""
    cause = exc.__cause__ if isinstance(exc, CoordinatorError) else exc
    meta = cause.trailing_metadata() if isinstance(cause, grpc.RpcError) else None
    return next((str(v) for k, v in meta or () if k == COMMITTED_BY), "")


class UpdatePush:
    """One update's upload; ``run`` returns the coordinator's reply."""

    def __init__(
        self,
        client,
        round_number: int,
        payload: UpdatePayload,
        *,
        weight: float,
        base_version: int,
        data_unit: str,
        upload_id: str | None = None,
        abort: Callable[[], bool] | None = None,
        hold: threading.Event | None = None,
        progress: TransferProgress | None = None,
        part: SitePart | None = None,
    ) -> None:
        self.client, self.round, self.payload = client, round_number, payload
        self.part = (
            part  # a multi-node site: this host's bytes only (``site_client.transfer.node_push``)
        )
        self.weight, self.base, self.unit = weight, base_version, data_unit
        self.upload_id = upload_id or f"r{round_number}-{uuid.uuid4().hex[:16]}"
        self.abort = abort or (lambda: False)
        self.hold = hold
        self.acked, self.tries = 0, 0
        self.held_s = 0.0  # how long the last chunk waited for ``hold``
        self.progress = progress or TransferProgress()
        self._bulk = None  # the upload's own connection, while ``run`` runs
        self.connections: list = []  # one per stream of the upload, while ``run`` runs

    def header(
        self, reserve: bool = False, piece: Piece | None = None, keep_open: bool = False
    ) -> bytes:
        """The stream's first frame; with ``piece``, for a stream carrying only that piece."""
        header = pb.PushHeader(
            lease=self.client.lease,
            round=self.round,
            upload_id=self.upload_id,
            data_unit=self.unit,
            manifest=self.payload.manifest.to_proto(),
            weight=self.weight,
            base_version=self.base,
            reserve=reserve,
            keep_open=keep_open,
        )
        if piece is not None:
            header.piece.offset, header.piece.length = piece.offset, piece.length
        return pb.PushMessage(header=header).SerializeToString()

    def frames(self, start: int) -> Iterator[bytes]:
        """The header, then the chunks from ``start`` (``wire.bulk`` frames)."""
        total = self.payload.total_bytes
        # A resumed stream starts at the acked offset: the bytes past it are sent again.
        self.progress.start(f"push round {self.round}", total, start)
        yield self.header()
        for offset, data in self.payload.chunks(start, self.client.chunk_bytes):
            if self.abort():
                return  # a short stream is left uncounted by the coordinator
            if offset + len(data) == total and not self.wait_for_hold():
                return
            yield chunk_frame(offset, data)
            self.client.bytes_sent += len(data)
            self.progress.advance(len(data))

    def wait_for_hold(self) -> bool:
        """Before the last chunk: wait for ``hold``; False if withdrawn meanwhile."""
        started = time.monotonic()
        try:
            while self.hold is not None and not self.hold.wait(0.1):
                if self.abort():
                    return False
            return True
        finally:
            self.held_s += time.monotonic() - started

    def attempt(self) -> pb.PushReply:
        c = self.client
        if self.part is not None:
            return PartsPush(self).attempt()
        if len(self.connections) > 1:
            return PiecedPush(self).attempt()
        if self.abort():
            raise self.withdrawn()
        granted = self.reserve()
        if granted.complete:  # every byte had arrived: the header alone completed it
            return granted
        self.acked = granted.acked_offset
        self.tries += 1
        reply = self._bulk.Push(self.frames(self.acked), timeout=c.transfer_timeout_s)
        if not reply.complete:
            if self.abort():
                raise self.withdrawn()
            self.acked = reply.acked_offset
            raise ChunkError(f"push incomplete: {reply.message}")
        return reply

    def pieces(self) -> list[Piece]:
        """The pieces of the payload for ``[transfer] streams`` (one for a small payload)."""
        c = self.client
        if self.part is not None:
            return self.part.pieces(c.chunk_bytes, c.transfer.streams)
        return plan_pieces(self.payload.total_bytes, c.chunk_bytes, c.transfer.streams)

    def streams(self) -> int:
        """How many streams the upload takes: ``[transfer] streams``, as far as it has pieces."""
        return min(self.client.transfer.streams, len(self.pieces()))

    def withdrawn(self) -> PushAborted:
        return PushAborted(f"push of round {self.round} {self.unit}: withdrawn")

    def reserve(self, keep_open: bool = False) -> pb.PushReply:
        """Ask for a receive slot (``coordinator.intake.receive_slots``) until granted; the reply
        also says how much of the payload the coordinator holds already. With ``keep_open``
        the upload is not counted even if every byte is in (the reply then says so)."""
        c = self.client
        while True:
            header = self.header(reserve=True, keep_open=keep_open)
            reply = c.bulk.Push(iter([header]), timeout=c.rpc_timeout_s + RESERVE_WAIT_S)
            if reply.complete or reply.granted or (keep_open and _all_in(reply, self)):
                return reply
            if self.abort():
                raise self.withdrawn()

    def run(self) -> pb.PushReply:
        complete = False
        try:
            # One connection per stream for the data streams of every attempt: a new one per
            # attempt would start connecting afresh each time, and on a slow link never get
            # there.
            with contextlib.ExitStack() as held:
                self.connections = self._connections(held)
                # None: this host of a multi-node site has nothing to send, only to ask.
                self._bulk = self.connections[0] if self.connections else self.client.bulk
                reply = self.client.call("push", self.attempt)
            complete = True
            return reply
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
            winner = committed_by(exc)
            if self.unit and lost_race(winner, self.client.site):
                raise  # another copy of the unit won the race: ours did not count
            return pb.PushReply(complete=True, message=f"already counted: {exc}")
        finally:
            self.progress.finish(complete)

    def _connections(self, held: contextlib.ExitStack) -> list:
        """One connection per stream: the site's kept ones (``[transfer] keep_connections``),
        or the upload's own, closed when ``held`` closes."""
        if self.client.transfer.keep_connections:
            return self.client.stream_stubs(self.streams())
        return [held.enter_context(self.client.upload_connection()) for _ in range(self.streams())]


def _all_in(reply: pb.PushReply, push: UpdatePush) -> bool:
    """Whether a reply says the coordinator holds every byte of the payload."""
    return sum(r.length for r in reply.received) >= push.payload.total_bytes


def lost_race(winner: str, site: str) -> bool:
    """Whether a refused unit was committed by another site. After a coordinator restart this
    site's own earlier commit is replayed, and a resent copy is refused naming this site:
    that one did count."""
    return bool(winner) and winner != site
