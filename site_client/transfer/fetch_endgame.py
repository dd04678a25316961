"""The end of a parallel fetch: an idle stream takes over the work of one lagging behind.

K connections through one bottleneck do not share it evenly: one that lost packets while
every stream was still opening its window keeps a small one for seconds (cubic grows slowly
from a loss), and at the end of a fetch its last piece holds the whole fetch back while the
other streams sit idle (measured: a 4 MiB piece taking 3.6 s on one of 2 streams, the other
done after 3.4 s). So a stream that finds the queue empty looks at what the others still
have to receive (``Load``) and takes over the work that would end last, if it would end it
sooner (``choose``):

- a piece another stream asked for ahead but has not started on is withdrawn from it
  (``NextPiece.withdraw``) and fetched here instead;
- the rest of a piece another stream is receiving is fetched here too, from the byte that
  stream had reached, and whichever of the two ends first wins (``Race``): the other's call
  is cancelled. Both write the same bytes of the same payload at the same offsets, and the
  payload's SHA-256 is checked once every piece is in, as always.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from wire.transfer import Piece

# Take work over only where this stream would end it in at most this share of the time the
# stream holding it would still take: rates move, and a race costs bytes sent twice.
MARGIN = 0.75


@dataclass(frozen=True)
class Load:
    """What one stream still has to receive, as an idle stream weighs it.

    Attributes
    ----------
    remaining
        Bytes of the piece it is receiving, not in yet (0: none, or one raced already).
    ahead
        Bytes of the piece it asked for ahead and has not started on (0: none).
    rate
        Bytes a second it has been receiving at lately, up to now (a stream that stalled is
        seen to slow); None when not known (nothing received yet).
    """

    remaining: int
    ahead: int
    rate: float | None


def choose(loads: list[Load], rate: float | None, rtt_s: float) -> int | None:
    """Which stream's work a stream receiving ``rate`` bytes a second should take over: the
    one whose would end last, if this stream would end it within ``MARGIN`` of that time
    (a piece asked for ahead is taken whole; else the rest of the one being received); None
    when none is worth it."""
    if not rate:
        return None
    best, gain = None, 0.0
    for i, load in enumerate(loads):
        part = load.ahead or load.remaining
        if part <= 0:
            continue
        theirs = (load.remaining + load.ahead) / load.rate if load.rate else float("inf")
        ours = rtt_s + part / rate
        if ours < MARGIN * theirs and theirs - ours > gain:
            best, gain = i, theirs - ours
    return best


class Race:
    """Two streams fetching the rest of one piece: the first to end it wins and cancels the
    other's call (``won`` is set first, so the loser knows why its call ended)."""

    def __init__(self) -> None:
        self.won = threading.Event()
        self._lock = threading.Lock()
        self._calls: dict[int, object] = {}

    def running(self, runner: object, call: object | None) -> None:
        """``runner``'s call now (None between two attempts); cancelled at once if the
        race was won already."""
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
    """The streams of one fetch (each one's ``NextPiece``, its ``current`` ``PieceStream``
    beside it), for an idle one to take work over."""

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
            rest = Piece(current.received, current.piece.end - current.received)
            return (rest, race) if rest.length > 0 else None


def load_of(stream) -> Load:
    """A stream's ``Load``, read from its ``NextPiece`` and current ``PieceStream``."""
    current = stream.current
    remaining = 0
    if current is not None and current.race is None and not current.done:
        remaining = current.piece.end - current.received
    return Load(remaining, stream.ahead_bytes(), stream.pace.rate(until_now=True))
