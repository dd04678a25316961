"""Pushing one update: its pieces through the transfer engine, withdrawn on request,
committed on cue.

A part of ``CoordinatorClient``. Each attempt starts with a reservation (a header-only stream
asking for a receive slot, ``coordinator.intake.receive_slots``), which also says what of the
payload the coordinator holds already (after a break, or a coordinator restart: it keeps the
upload's ranges). The pieces not wholly there then go through the engine
(``site_client.transfer.engine``, ``movers.PushMover``), each from where the coordinator's copy
of it ends, over one connection per stream for this upload (closed with it). Three
configurations of that one path:

- one stream (``[transfer] streams = 1``, or a payload too small to cut): the whole payload as
  one piece; its last chunk waits for ``hold`` and its reply counts the update;
- K streams: the payload's pieces (``wire.transfer.plan_pieces``), each as a stream carrying
  that piece only (``PushHeader.piece``); once every piece is in and ``hold`` is set, a
  reservation again: the coordinator, holding every byte, checks the payload's digest and
  counts it as it counts a single stream's;
- a host of a multi-node site (``node.SitePart``): its own part's pieces, under the site's one
  upload id; only the reservation of the node that completes the update (node 0) may count
  it, every other is sent ``keep_open``, and the completing node asks until every part is in
  (``node.await_parts``).

``abort`` is read between chunks (another copy of the data unit won: stop sending). ``hold``
keeps the update from counting until it is set (the site's checkpoint of the task is on disk):
everything but the count crosses the WAN while the checkpoint is written.

A refusal because the unit was already committed carries the winner's name in trailing metadata
(``isthmus-committed-by``); if it is this site (its own earlier copy, replayed after a
coordinator restart) the update did count.

Every byte sent is reported once, to the upload's ``engine.Tally``: the client's
``bytes_sent`` and ``progress`` (``site_client.transfer.progress``).
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
from site_client.transfer.endpoints import COORDINATOR
from site_client.transfer.engine import Tally, Transfer
from site_client.transfer.movers import PushMover, held_ranges
from site_client.transfer.node import SitePart, await_parts
from site_client.transfer.plan import Endpoint, routed
from site_client.transfer.progress import TransferProgress
from wire.bulk import RESERVE_WAIT_S, chunk_frame
from wire.chunking import ChunkError
from wire.net.refusals import COMMITTED_BY, FOLD_ROUND
from wire.proto import isthmus_pb2 as pb
from wire.transfer import Piece, ReceivedRanges, plan_pieces


def _trailing(exc: BaseException, key: str) -> str:
    cause = exc.__cause__ if isinstance(exc, CoordinatorError) else exc
    meta = cause.trailing_metadata() if isinstance(cause, grpc.RpcError) else None
    return next((str(v) for k, v in meta or () if k == key), "")


def committed_by(exc: BaseException) -> str:
    """The winning site named in a refusal's trailing metadata ("" if none)."""
    return _trailing(exc, COMMITTED_BY)


def fold_round(exc: BaseException) -> int | None:
    """The round a late update folds into, named by a refusal's trailing metadata (None if
    none, or not a round number)."""
    text = _trailing(exc, FOLD_ROUND)
    return int(text) if text.isdigit() else None


def new_upload_id(round_number: int) -> str:
    return f"r{round_number}-{uuid.uuid4().hex[:16]}"


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
        shard_digests: list[bytes] | None = None,
        shard_receipts: list[bytes] | None = None,
    ) -> None:
        self.client, self.round, self.payload = client, round_number, payload
        # A sharded job: the other parts' digests and their shards' receipts.
        self.shard_digests, self.shard_receipts = shard_digests or [], shard_receipts or []
        self.part = part  # a multi-node site: this host's bytes only
        self.weight, self.base, self.unit = weight, base_version, data_unit
        self.upload_id = upload_id or new_upload_id(round_number)
        self.abort = abort or (lambda: False)
        self.hold = hold
        self.tries = 0
        self.held_s = 0.0  # how long the count waited for ``hold``
        self.progress = progress or TransferProgress()
        self.tally = Tally(client, self.progress, sent=True)
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
            shard_digests=self.shard_digests,
            shard_receipts=self.shard_receipts,
        )
        if piece is not None:
            header.piece.offset, header.piece.length = piece.offset, piece.length
        return pb.PushMessage(header=header).SerializeToString()

    def frames(self, start: int) -> Iterator[bytes]:
        """The whole payload's stream: the header, then the chunks from ``start``; its last
        chunk waits for ``hold``."""
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
            self.tally.count(len(data))

    def wait_for_hold(self) -> bool:
        """Before the update may count: wait for ``hold``; False if withdrawn meanwhile."""
        started = time.monotonic()
        try:
            while self.hold is not None and not self.hold.wait(0.1):
                if self.abort():
                    return False
            return True
        finally:
            self.held_s += time.monotonic() - started

    def attempt(self) -> pb.PushReply:
        """A reservation, the pieces the coordinator lacks, then the count."""
        if self.abort():
            raise self.withdrawn()
        whole = self.part is None and len(self.connections) <= 1
        # K streams or a part: kept open, as a resumed upload whose bytes are all in must
        # still wait for ``hold``.
        reserved = self.reserve(keep_open=not whole)
        if whole and reserved.complete:  # every byte had arrived: the header alone counted it
            return reserved
        held = ReceivedRanges([(0, reserved.acked_offset)]) if whole else held_ranges(reserved)
        self.tries += 1
        if not whole:  # resumed: progress stands at what the coordinator holds
            self._start_progress(held)
        mover = PushMover(self, held, whole)
        endpoint = Endpoint(COORDINATOR, tuple(self.connections) or (self.client.bulk,))
        pieces = [p for p in routed(self.pieces(), endpoint) if held.resume_at(p) < p.end]
        Transfer(self.client, mover, self.tally, max(1, len(self.connections))).run(pieces)
        if whole:
            if mover.reply is None or not mover.reply.complete:
                raise ChunkError(f"push incomplete: {reserved.message}")
            return mover.reply
        return self._count()

    def _start_progress(self, held: ReceivedRanges) -> None:
        if self.part is None:
            total = self.payload.total_bytes
            self.progress.start(f"push round {self.round}", total, held.covered())
            return
        mine = held.covered_in(self.part.offset, self.part.end)
        self.progress.start(f"push round {self.round} (this node's part)", self.part.length, mine)

    def _count(self) -> pb.PushReply:
        """Every piece is in: once ``hold`` is set, ask the coordinator to count the update
        (a part that does not complete it is done here)."""
        if self.part is not None and not self.part.completes:
            return pb.PushReply(acked_offset=self.part.end, message="this node's part is in")
        if not self.wait_for_hold():
            raise self.withdrawn()
        if self.part is not None:
            return await_parts(self, self.part)
        reply = self.reserve()  # with every byte in: verified and counted
        if not reply.complete:
            raise ChunkError(f"push incomplete after every piece was sent: {reply.message}")
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
