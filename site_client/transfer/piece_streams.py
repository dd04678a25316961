"""Pieces of one payload over up to K streams at once (``[transfer] streams``).

What a parallel fetch does once it holds the payload's first header, for any list of pieces:
the whole payload cut into pieces (``site_client.transfer.parallel_fetch``), or the ranges of theta
a host's trainers hold (``site_client.transfer.node_fetch``). The pieces wait in one queue; each
stream, on a connection of its own, takes the next one until none is left
(``site_client.transfer.fetch_pieces``),
asks for it about two round trips before its current piece ends
(``site_client.transfer.fetch_ahead``),
so its connection does not idle a round trip per piece, and once the queue is empty takes over
the work of a stream lagging behind (``site_client.transfer.fetch_endgame``). Each piece lands at
its offset in the sink; checking what landed is the caller's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from site_client.transfer.fetch_ahead import NextPiece
from site_client.transfer.fetch_endgame import Endgame
from site_client.transfer.fetch_pieces import PieceQueue, PieceStream, Stopped, fetch_request
from wire.proto import isthmus_pb2 as pb
from wire.transfer import Piece

log = logging.getLogger("isthmus.site")


class PieceStreams:
    """``pieces`` of the payload ``first`` heads, into ``sink``, over up to
    ``client.transfer.streams`` streams.

    Parameters
    ----------
    client
        The ``CoordinatorClient`` (lease, retries, its streams' stubs).
    first
        The payload's first header: every piece's header must equal it.
    rtt_s
        The first header's round trip: how far ahead a stream asks for its next piece.
    count
        Told of every payload byte received, from the streams' threads.
    """

    def __init__(
        self, client, first: pb.FetchHeader, rtt_s: float, count: Callable[[int], None]
    ) -> None:
        self.client, self.first, self.rtt_s, self.count = client, first, rtt_s, count
        self._lock = threading.Lock()
        self.opened_ahead = 0  # pieces whose call was made before the one before them ended

    def run(self, pieces: list[Piece], sink) -> None:
        """Every piece into ``sink``; raises the first stream's error, after all stopped."""
        c = self.client
        queue = PieceQueue(pieces)
        endgame = Endgame(self.rtt_s)
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=self._stream,
                args=(stub, queue, endgame, sink, errors),
                name=f"fetch-stream-{i}",
                daemon=True,
            )
            for i, stub in enumerate(c.stream_stubs(min(len(pieces), c.transfer.streams)))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log.debug(
            "fetch: %d of %d pieces over %d streams asked for ahead (round trip %.3f s)",
            self.opened_ahead, len(pieces), len(threads), self.rtt_s,
        )  # fmt: skip
        if errors:
            raise errors[0]

    def _stream(self, stub, queue: PieceQueue, endgame: Endgame, sink, errors) -> None:
        """One stream's loop: the next piece (its call made ahead where it could be) until
        none is left, then work taken over from a stream lagging behind while any is worth it."""
        c, first = self.client, self.first

        def open_call(piece: Piece):
            req = fetch_request(c.lease, first, piece.offset, piece.length)
            return stub.Fetch(req, timeout=c.transfer_timeout_s)

        ahead = NextPiece(queue, open_call, self.rtt_s)
        endgame.join(ahead)
        try:
            while (work := _next_work(ahead, endgame)) is not None:
                piece, call, race = work
                args = (c, stub, first, piece, sink, self.count, queue.stopped)
                ahead.current = PieceStream(*args, call=call, ahead=ahead, race=race)
                ahead.current.run()
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


def _next_work(ahead: NextPiece, endgame: Endgame):
    """``(piece, call made ahead or None, race or None)`` for a stream, or None: done."""
    piece, call = ahead.take()
    if piece is not None:
        return piece, call, None
    ahead.current = None  # idle: nothing of this stream's is left to take over
    taken = endgame.take_over(ahead)
    return None if taken is None else (taken[0], None, taken[1])
