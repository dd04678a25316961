"""Asking for a stream's next piece before its current one ends
(``site_client.transfer.parallel_fetch``).

A piece is one ranged Fetch call, and its bytes start to flow a round trip after the call is
made (the request's way up, the header's and the first chunk's way down). A stream that asks
for its next piece only once the current one is whole leaves its connection idle for that round
trip, once a piece: at 80 ms and 8 pieces a stream, 0.64 s of a 3 s fetch. So each stream
opens its next piece's call about one round trip before its current piece's last byte is due,
reckoned from the rate its chunks have been coming at (``lead_delay``): the request reaches the
coordinator while the last bytes of the current piece are on their way, and the next piece's
header and chunks follow them on the same connection.

Opened too early, the call finds the site's share of the send slots still held by the pieces
being sent (``coordinator.service.send_slots`` answers ``UNAVAILABLE`` at once); ``PieceStream``
then asks again as soon as it takes that piece up, which costs the round trip this would have
saved and no more. A stream whose current piece breaks withdraws the call opened ahead first
(``NextPiece.withdraw``), so that its retry never waits behind a slot its own stream holds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from wire.transfer import Piece

# How many round trips ahead of the current piece's end the next one is asked for. One is the
# least that leaves no gap, if the rate held and the round trip were the first header's; but
# under load the bottleneck queue adds up to another, and a rate still rising is reckoned too
# low. The coordinator is done with a piece well before its last bytes arrive (its socket's
# send buffer and the bytes in flight: 2-3 round trips measured at 200 Mbit/s, 80 ms), so
# asking two round trips ahead still finds its send slot free.
LEAD_RTTS = 2.0
# Chunk arrivals the rate is reckoned over: enough to smooth one slow chunk, few enough to
# follow a stream whose window is still opening.
PACE_SAMPLES = 4


def lead_delay(remaining: int, rate_bps: float | None, rtt_s: float) -> float | None:
    """Seconds from now until the next piece's call should be made: one round trip before the
    ``remaining`` bytes of the current piece are due at ``rate_bps`` bytes a second (0: now).
    None while the rate is not known yet."""
    if not rate_bps or rate_bps <= 0:
        return None
    return max(0.0, remaining / rate_bps - rtt_s)


class Pace:
    """The rate one stream's bytes have been arriving at, over its last few chunks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._marks: deque[tuple[float, int]] = deque(maxlen=PACE_SAMPLES + 1)
        self._total = 0

    def restart(self) -> None:
        """The stream sat idle (a piece that was not asked for ahead): forget the marks, so
        the idle time does not count as a slow rate."""
        self._marks.clear()

    def mark(self, nbytes: int) -> None:
        """``nbytes`` arrived now (0: a header, the start of the bytes that follow it)."""
        self._total += nbytes
        self._marks.append((self.clock(), self._total))

    def rate(self, until_now: bool = False) -> float | None:
        """Bytes a second over the marks kept; None before two marks a moment apart. With
        ``until_now``, a stream whose next chunk is late (twice the marks' mean gap since the
        last) is reckoned up to now, so one that stopped receiving is seen to slow."""
        if len(self._marks) < 2:
            return None
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        if until_now:
            gap = (t1 - t0) / (len(self._marks) - 1)
            if (now := self.clock()) > t1 + 2 * gap:
                t1 = now
        return (n1 - n0) / (t1 - t0) if t1 > t0 and n1 > n0 else None


class NextPiece:
    """The next piece of one stream, taken from ``queue`` and opened (``open_call``) at the
    time ``lead_delay`` names, by a timer thread of its own; ``close`` when the stream ends.

    Parameters
    ----------
    queue
        The fetch's ``PieceQueue``.
    open_call
        ``open_call(piece)``: the started Fetch call of ``piece`` (its frames; ``cancel``).
    rtt_s
        The fetch's first header's round trip; the call is made ``LEAD_RTTS`` of them ahead.
    """

    def __init__(
        self,
        queue,
        open_call: Callable[[Piece], object],
        rtt_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue, self.open_call, self.rtt_s, self.clock = queue, open_call, rtt_s, clock
        self.pace = Pace(clock)
        self.opened_ahead = 0  # pieces whose call was made before the one before them ended
        self.current = None  # the stream's ``PieceStream`` now (``fetch_endgame`` reads it)
        self._cond = threading.Condition()
        self._due: float | None = None
        self._opened: tuple[Piece, object] | None = None
        self._closed = False
        self._timer = threading.Thread(target=self._wait, name="fetch-ahead", daemon=True)
        self._timer.start()

    def progress(self, nbytes: int, remaining: int, fresh: bool = False) -> None:
        """``nbytes`` of the current piece arrived (0: its header), ``remaining`` to come;
        ``fresh``: the header of a call made only now (the stream sat idle before it)."""
        if fresh:
            self.pace.restart()
        self.pace.mark(nbytes)
        delay = lead_delay(remaining, self.pace.rate(), LEAD_RTTS * self.rtt_s)
        with self._cond:
            if self._opened is None and delay is not None:
                self._due = self.clock() + delay
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
