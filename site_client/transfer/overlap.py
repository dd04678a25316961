"""A stream's next piece before its current one ends, and an idle stream's help at the end.

A piece is one call, and a stream that makes its next call only once the current piece is
whole leaves its connection idle between the two: a round trip for a fetch (the request's way
up, the first bytes' way down; at 80 ms and 8 pieces a stream, 0.64 s of a 3 s fetch), the
reply's way back for a push. So each stream's ``NextPiece`` makes the next piece's call while
the current one still runs, when ``plan.next_call_delay`` says: a fetch about ``LEAD_RTTS``
round trips before its last byte is due, reckoned from the rate its chunks came at; a push
once its last chunk is handed to the connection. At most two calls run on a stream at once.

Opened too early, a fetch finds the site's share of the coordinator's send slots still held
by the pieces being sent (``UNAVAILABLE`` at once); the piece then asks again as soon as it is
taken up, which costs the round trip this would have saved and no more. A fetch stream whose
current piece breaks withdraws the call made ahead first (``NextPiece.withdraw``), so its
retry never waits behind a slot its own stream holds.

K connections through one bottleneck do not share it evenly: one that lost packets while
every stream was opening its window keeps a small one for seconds, and at the end of a fetch
its last piece holds the whole fetch back while the others sit idle (measured: a 4 MiB piece
taking 3.6 s on one of 2 streams, the other done after 3.4 s). So a fetch stream that finds
the queue empty asks the ``Endgame`` for the work that would end last (``plan.choose``):

- a piece another stream asked for ahead but has not started on is withdrawn from it;
- the rest of a piece another stream is receiving is fetched here too, from the byte that
  stream reached, and whichever of the two ends first wins (``Race``): the other's call is
  cancelled. Both write the same bytes at the same offsets, and what landed is checked once
  every piece is in, as always.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from site_client.transfer.plan import LEAD_RTTS, Load, Pace, choose, next_call_delay
from wire.transfer import Piece


class NextPiece:
    """The next piece of one stream, taken from ``queue`` and opened (``open_call``) at the
    time ``plan.next_call_delay`` names, by a timer thread of its own (started the first time
    a call is due: a transfer of one piece never needs it); ``close`` at the end.

    Parameters
    ----------
    queue
        The transfer's ``plan.PieceQueue``.
    open_call
        ``open_call(piece)``: the piece's call, started (anything with ``cancel``).
    rtt_s
        The transfer's first round trip; a fetch's call is made ``lead_rtts`` of them ahead.
    lead_rtts
        None: the next call is made once the current piece has nothing left to move.
    """

    def __init__(
        self,
        queue,
        open_call: Callable[[Piece], object],
        rtt_s: float,
        clock: Callable[[], float] = time.monotonic,
        lead_rtts: float | None = LEAD_RTTS,
    ) -> None:
        self.queue, self.open_call, self.rtt_s, self.clock = queue, open_call, rtt_s, clock
        self.lead_s = None if lead_rtts is None else lead_rtts * rtt_s
        self.pace = Pace(clock)
        self.opened_ahead = 0  # pieces whose call was made before the one before them ended
        self.current = None  # the stream's ``engine.PieceRun`` now (the endgame reads it)
        self._cond = threading.Condition()
        self._due: float | None = None
        self._opened: tuple[Piece, object] | None = None
        self._closed = False
        self._timer: threading.Thread | None = None

    def progress(self, nbytes: int, remaining: int, fresh: bool = False) -> None:
        """``nbytes`` of the current piece moved (0: its header), ``remaining`` to come;
        ``fresh``: the header of a call made only now (the stream sat idle before it)."""
        if fresh:
            self.pace.restart()
        self.pace.mark(nbytes)  # the endgame weighs the rate even with nothing left to take
        if self.queue.empty():
            return
        delay = next_call_delay(remaining, self.pace.rate(), self.lead_s)
        with self._cond:
            if self._opened is None and delay is not None and not self._closed:
                self._due = self.clock() + delay
                if self._timer is None:
                    self._timer = threading.Thread(target=self._wait, name="next-piece")
                    self._timer.daemon = True
                    self._timer.start()
                self._cond.notify()

    def _wait(self) -> None:
        with self._cond:
            while not self._closed:
                if self._due is None:
                    self._cond.wait()
                elif (left := self._due - self.clock()) > 0:
                    self._cond.wait(left)
                else:
                    self._due = None
                    if self._opened is None and (piece := self.queue.take()) is not None:
                        self._opened = (piece, self.open_call(piece))  # only starts the call
                        self.opened_ahead += 1

    def take(self) -> tuple[Piece | None, object | None]:
        """The stream's next piece with its call if it was opened ahead (else None); no
        piece when the queue is empty."""
        with self._cond:
            self._due = None
            opened, self._opened = self._opened, None
        if opened is not None:
            return opened
        return self.queue.take(), None

    def ahead_bytes(self) -> int:
        """The size of the piece opened ahead and not taken yet (0: none)."""
        opened = self._opened
        return opened[0].length if opened is not None else 0

    def withdraw(self, requeue: bool = True) -> Piece | None:
        """Cancel the call opened ahead (the current piece broke, or another stream takes
        that piece over); its piece goes back to the queue, or (``requeue`` False) to the
        caller. None if there was none."""
        with self._cond:
            self._due = None
            opened, self._opened = self._opened, None
        if opened is None:
            return None
        opened[1].cancel()
        if requeue:
            self.queue.put_back(opened[0])
        return opened[0]

    def close(self) -> None:
        """The stream ends: stop the timer, cancel a call opened ahead and not taken."""
        with self._cond:
            self._closed, self._due = True, None
            opened, self._opened = self._opened, None
            self._cond.notify()
        if opened is not None:
            opened[1].cancel()


class Race:
    """Two streams moving the rest of one piece: the first to end it wins and cancels the
    other's call (``won`` is set first, so the loser knows why its call ended)."""

    def __init__(self) -> None:
        self.won = threading.Event()
        self._lock = threading.Lock()
        self._calls: dict[int, object] = {}

    def running(self, runner: object, call: object | None) -> None:
        """``runner``'s call now (None between two attempts); cancelled at once if the race
        was won already."""
        with self._lock:
            if call is None:
                self._calls.pop(id(runner), None)
                return
            self._calls[id(runner)] = call
            done = self.won.is_set()
        if done:
            call.cancel()

    def finish(self, runner: object) -> None:
        """``runner`` has every byte of the piece: cancel the other's call."""
        with self._lock:
            self.won.set()
            others = [c for key, c in self._calls.items() if key != id(runner)]
            self._calls.clear()
        for call in others:
            call.cancel()


class Endgame:
    """The streams of one transfer (each one's ``NextPiece``, its ``current`` run beside it),
    for an idle one to take work over."""

    def __init__(self, rtt_s: float) -> None:
        self.rtt_s = rtt_s
        self.streams: list = []
        self._lock = threading.Lock()

    def join(self, stream) -> None:
        with self._lock:
            self.streams.append(stream)

    def take_over(self, idle) -> tuple[Piece, Race | None] | None:
        """Work for ``idle`` (a ``NextPiece``): ``(piece, None)`` withdrawn from another
        stream, ``(rest, race)`` of a piece another is receiving, or None."""
        with self._lock:
            others = [s for s in self.streams if s is not idle]
            loads = [load_of(s) for s in others]
            i = choose(loads, idle.pace.rate(), self.rtt_s)
            if i is None:
                return None
            if loads[i].ahead and (piece := others[i].withdraw(requeue=False)) is not None:
                return piece, None
            current = others[i].current
            if current is None or current.race is not None or current.done:
                return None
            race = Race()
            current.race = race
            race.running(current, current.frames)
            left = current.piece.end - current.received
            rest = dataclasses.replace(current.piece, offset=current.received, length=left)
            return (rest, race) if rest.length > 0 else None


def load_of(stream) -> Load:
    """A stream's ``plan.Load``, read from its ``NextPiece`` and its current run."""
    current = stream.current
    remaining = 0
    if current is not None and current.race is None and not current.done:
        remaining = current.piece.end - current.received
    return Load(remaining, stream.ahead_bytes(), stream.pace.rate(until_now=True))
