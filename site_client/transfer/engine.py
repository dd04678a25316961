"""The one transfer engine: a payload's pieces over up to K streams, down or up.

A transfer is a list of pieces (``plan.RoutedPiece``: byte ranges of one payload, each naming
the endpoint it travels to or from) and a ``Mover``, the direction's adapter that carries one
piece over one connection: a ranged Fetch call into the sink, or a push stream of the piece
and its reply (``site_client.transfer.movers``). ``Transfer.run`` puts the pieces in one queue
and starts a stream per piece, up to K; each stream, on connection ``i`` of its piece's
endpoint, takes the next piece until none is left, so a slow stream takes fewer pieces instead
of holding the whole transfer back. Around that, once for both directions:

- a stream makes its next piece's call before its current one ends (``overlap.NextPiece``,
  when the mover's ``Schedule`` says), and, where the schedule allows it, an idle stream
  takes over the work of one lagging behind once the queue is empty (``overlap.Endgame``);
- a piece that breaks goes on, through the client's retries and backoff
  (``CoordinatorClient.call``), from where it stands: the bytes a fetch wrote, or what the
  receiver of a push says it holds (``Mover.resume``);
- every byte moved is counted once (``Tally``): the client's counter and the progress.

Whole payload = one piece on one stream; K streams = ``wire.transfer.plan_pieces``; a node of a
multi-node site = its own ranges: configurations of this one engine, not parallel code.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol

from site_client.transfer.overlap import Endgame, NextPiece, Race
from site_client.transfer.plan import PieceQueue, RoutedPiece
from site_client.transfer.progress import TransferProgress
from wire.chunking import ChunkError

log = logging.getLogger("isthmus.site")


class Stopped(Exception):
    """Another stream of the transfer failed: this one stops between two chunks."""


class Reopen(Exception):
    """A call made ahead was refused before its first reply (the coordinator's slot was still
    held by the piece before it): make it again at once, without a backoff."""


@dataclass(frozen=True)
class Schedule:
    """How a direction's streams overlap their pieces.

    Attributes
    ----------
    lead_rtts
        How many round trips before the current piece's end the next call is made; None:
        once the current piece has nothing left to hand to the connection.
    endgame
        Whether an idle stream takes over the work of one lagging behind.
    withdraw_on_break
        Whether a stream whose piece broke cancels its next call made ahead.
    """

    lead_rtts: float | None
    endgame: bool
    withdraw_on_break: bool


class Mover(Protocol):
    """One direction of a transfer: how one piece travels over one connection."""

    describe: str  # the name the client's retries go under: "fetch", "push"
    schedule: Schedule

    def start(self, piece: RoutedPiece) -> int:
        """Where the piece's bytes start: its first byte the receiver does not hold."""

    def open(self, run: PieceRun, stub, ahead: bool):
        """The piece's call from ``run.received``, started (``ahead``: while another piece
        still runs on the stream); anything with ``cancel``."""

    def carry(self, run: PieceRun, call, fresh: bool) -> None:
        """Carry ``call`` to its end, through ``run.moved`` for every chunk; ``fresh``: the
        call was made only now. Raises on a broken call or a reply to refuse."""

    def resume(self, run: PieceRun) -> None:
        """After a break: set ``run.received`` to where the piece goes on."""


class Tally:
    """The bytes one transfer moved, counted once: into the client's counter of the direction
    (``bytes_received`` or ``bytes_sent``), the transfer's ``total`` and its progress."""

    def __init__(self, client, progress: TransferProgress, sent: bool) -> None:
        self.client, self.progress, self.sent = client, progress, sent
        self.total = 0
        self._lock = threading.Lock()

    def count(self, nbytes: int) -> None:
        with self._lock:
            if self.sent:
                self.client.bytes_sent += nbytes
            else:
                self.client.bytes_received += nbytes
            self.total += nbytes
        self.progress.advance(nbytes)


class Transfer:
    """Pieces over up to ``streams`` streams, each carried by ``mover``.

    Parameters
    ----------
    client
        The ``CoordinatorClient``: its retries (``call``) and transfer deadline.
    mover
        The direction's adapter.
    tally
        Told of every byte moved.
    streams
        K: the most streams at once.
    rtt_s
        The transfer's first round trip: how far ahead a fetch asks for its next piece.
    """

    def __init__(self, client, mover: Mover, tally: Tally, streams: int, rtt_s: float = 0.0):
        self.client, self.mover, self.tally = client, mover, tally
        self.streams, self.rtt_s = streams, rtt_s
        self.opened_ahead = 0  # pieces whose call was made before the one before them ended
        self.queue = PieceQueue(())
        self._lock = threading.Lock()

    def run(self, pieces: list[RoutedPiece], first_call=None) -> None:
        """Every piece moved; ``first_call``: the first piece's call, made already (a whole
        payload's, whose header named the payload). Raises the first stream's error once
        every stream stopped."""
        first = None
        if first_call is not None and pieces:
            first = PieceRun(self, 0, pieces[0])
            first.call, pieces = first_call, pieces[1:]
        queue = self.queue = PieceQueue(pieces)
        endgame = Endgame(self.rtt_s) if self.mover.schedule.endgame else None
        errors: list[BaseException] = []
        count = min(len(pieces) + (first is not None), self.streams)
        streams = [(i, queue, endgame, errors, first if i == 0 else None) for i in range(count)]
        if count == 1:  # one stream: this thread's own
            self._stream(*streams[0])
        threads = [
            threading.Thread(target=self._stream, args=args, name=f"{self.mover.describe}-{i}")
            for i, args in enumerate(streams if count > 1 else [])
        ]
        for t in threads:
            t.daemon = True
            t.start()
        for t in threads:
            t.join()
        log.debug(
            "%s: %d pieces over %d streams, %d asked for ahead (round trip %.3f s)",
            self.mover.describe, len(pieces) + (first is not None), count, self.opened_ahead,
            self.rtt_s,
        )  # fmt: skip
        if errors:
            raise errors[0]

    def _stream(self, index: int, queue: PieceQueue, endgame, errors: list, first) -> None:
        """Stream ``index``: the next piece (its call made ahead where it could be) until
        none is left, then work taken over from a stream lagging behind while any is worth
        it."""
        lead = self.mover.schedule.lead_rtts
        ahead = NextPiece(queue, lambda p: self._open_ahead(index, p), self.rtt_s, lead_rtts=lead)
        ahead.current = first
        if endgame is not None:
            endgame.join(ahead)
        try:
            work = (first.piece, first, None) if first is not None else _next(ahead, endgame)
            while work is not None:
                piece, run, race = work
                run = run or PieceRun(self, index, piece)
                run.ahead, run.race = ahead, race
                ahead.current = run
                run.run()
                work = _next(ahead, endgame)
        except Stopped:
            pass
        except BaseException as exc:  # handed to ``run``, which raises the first
            errors.append(exc)
            queue.stop()
        finally:
            ahead.current = None
            ahead.close()
            with self._lock:
                self.opened_ahead += ahead.opened_ahead

    def _open_ahead(self, index: int, piece: RoutedPiece) -> PieceRun:
        run = PieceRun(self, index, piece)
        run.call = self.mover.open(run, run.stub, ahead=True)
        return run


def _next(ahead: NextPiece, endgame: Endgame | None):
    """``(piece, run made ahead or None, race or None)`` for a stream, or None: done."""
    piece, run = ahead.take()
    if piece is not None:
        return piece, run, None
    ahead.current = None  # idle: nothing of this stream's is left to take over
    taken = endgame.take_over(ahead) if endgame is not None else None
    return None if taken is None else (taken[0], None, taken[1])


class PieceRun:
    """One piece on one stream: its calls, through the client's retries, until it is whole
    (or, in a race, until either stream ended it)."""

    def __init__(self, transfer: Transfer, stream: int, piece: RoutedPiece) -> None:
        self.transfer, self.mover, self.piece = transfer, transfer.mover, piece
        self.stub = piece.endpoint.stub(stream)
        self.received = self.mover.start(piece)  # the piece's first byte not yet moved
        self.call = None  # a call made ahead, not carried yet
        self.frames = None  # the call of the current attempt (the endgame cancels it)
        self.ahead: NextPiece | None = None  # the stream's, told of every chunk
        self.race: Race | None = None
        self.done = False  # every byte of the piece is in
        self.broke = False  # an attempt broke: the next asks where the piece stands

    def cancel(self) -> None:
        """Cancel the call made ahead (``NextPiece``: withdrawn, or the stream ended)."""
        if self.call is not None:
            self.call.cancel()

    def moved(self, nbytes: int, remaining: int, fresh: bool = False) -> None:
        """``nbytes`` moved (0: the call's first reply), ``remaining`` bytes of the piece to
        go; ``fresh``: a call made only now."""
        if nbytes:
            self.transfer.tally.count(nbytes)
        if self.ahead is not None:
            self.ahead.progress(nbytes, remaining, fresh)

    def halted(self) -> bool:
        """Between two chunks: raise ``Stopped`` when another stream failed; True when the
        other stream of a race won (this call ends)."""
        if self.transfer_stopped():
            raise Stopped()
        return self.race is not None and self.race.won.is_set()

    def transfer_stopped(self) -> bool:
        """Whether another stream of the transfer failed."""
        return self.transfer.queue.stopped.is_set()

    def run(self) -> None:
        self.transfer.client.call(self.mover.describe, self._attempt)

    def _attempt(self) -> None:
        if self.transfer_stopped():
            raise Stopped()
        if self._settled():  # the break came after the last byte, or the race was won
            return
        early, self.call = self.call, None
        if early is None and self.broke:
            self.mover.resume(self)
            if self._settled():
                return
        call = early if early is not None else self.mover.open(self, self.stub, ahead=False)
        self._running(call)
        try:
            self.mover.carry(self, call, fresh=early is None)
        except Reopen:
            self._running(None)
            return self._attempt()
        except BaseException:
            call.cancel()  # frees the coordinator's slot now, not at the deadline
            self._running(None)
            if self._settled():
                return  # the other stream of a race won, and cancelled this call
            self._broke()
            raise
        self._running(None)
        if not self._settled():
            self._broke()
            raise ChunkError(
                f"the {self.mover.describe} of piece [{self.piece.offset}, {self.piece.end}) "
                f"ended at {self.received}"
            )

    def _running(self, call) -> None:
        self.frames = call
        if self.race is not None:
            self.race.running(self, call)

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
        self.broke = True
        if self.ahead is not None and self.mover.schedule.withdraw_on_break:
            self.ahead.withdraw()
