"""The transfer engine's decisions, without a network: which piece next, where one resumes,
when a stream's next call is due, when an idle stream takes work over.

A transfer is a list of ``RoutedPiece``: byte ranges of one payload (``wire.transfer.Piece``),
each naming the ``Endpoint`` its bytes go to or come from. Whole payload = one piece; K streams
= ``wire.transfer.plan_pieces``; a node of a multi-node site = the ranges its trainers hold
(``split_ranges``); a sharded coordinator would give each shard's ranges its own endpoint.

Everything here is pure, or state with an injected clock (``Pace``); the engine
(``site_client.transfer.engine``) and its streams' overlap (``site_client.transfer.overlap``)
call it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from wire.chunking import MAX_CHUNK_BYTES
from wire.transfer import PIECES_PER_STREAM, Piece

# How many round trips ahead of the current piece's end a fetch asks for its next one. One is
# the least that leaves no gap, if the rate held and the round trip were the first header's;
# but under load the bottleneck queue adds up to another, and a rate still rising is reckoned
# too low. The coordinator is done with a piece well before its last bytes arrive (its send
# buffer and the bytes in flight: 2-3 round trips measured at 200 Mbit/s, 80 ms), so asking
# two round trips ahead still finds its send slot free.
LEAD_RTTS = 2.0
# Chunk arrivals a stream's rate is reckoned over: enough to smooth one slow chunk, few enough
# to follow a stream whose window is still opening.
PACE_SAMPLES = 4
# An idle stream takes work over only where it would end it in at most this share of the time
# the stream holding it would still take: rates move, and a race costs bytes sent twice.
MARGIN = 0.75


@dataclass(frozen=True, eq=False)
class Endpoint:
    """A server the pieces of a transfer go to: stream ``i`` uses connection ``stubs[i]``
    (each a ``wire.bulk.BulkStub`` or a stub that resolves one at each call)."""

    name: str
    stubs: tuple

    def stub(self, stream: int):
        return self.stubs[stream % len(self.stubs)]


@dataclass(frozen=True)
class RoutedPiece(Piece):
    """A piece of the payload and the endpoint it travels to or from."""

    endpoint: Endpoint


def routed(pieces: Iterable[Piece], endpoint: Endpoint) -> list[RoutedPiece]:
    """``pieces``, every one to ``endpoint``."""
    return [RoutedPiece(p.offset, p.length, endpoint) for p in pieces]


def split_ranges(ranges: list[Piece], block: int, streams: int) -> list[Piece]:
    """``ranges`` cut at whole blocks into pieces of about ``PIECES_PER_STREAM`` per stream,
    so that K streams share a few large ranges as they share a whole payload."""
    total = sum(r.length for r in ranges)
    if streams <= 1 or not total:
        return ranges
    most = max(block, -(-total // (PIECES_PER_STREAM * streams * block)) * block)
    return [
        Piece(start, min(most, r.end - start))
        for r in ranges
        for start in range(r.offset, r.end, most)
    ]


class PieceQueue:
    """The pieces not yet taken, in payload order; every stream of a transfer takes its next
    one here. ``stop`` empties it for every stream."""

    def __init__(self, pieces: Iterable) -> None:
        self._pieces = deque(pieces)
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def take(self):
        with self._lock:
            if self.stopped.is_set() or not self._pieces:
                return None
            return self._pieces.popleft()

    def empty(self) -> bool:
        with self._lock:
            return self.stopped.is_set() or not self._pieces

    def put_back(self, piece) -> None:
        """A piece taken but not moved: the next ``take`` hands it out again."""
        with self._lock:
            self._pieces.appendleft(piece)

    def stop(self) -> None:
        self.stopped.set()


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


def ack_problem(piece: Piece, acked: int) -> str | None:
    """Why a receiver's word that ``piece`` stands at ``acked`` cannot be believed (it lies
    outside the piece), or None: the piece resumes there."""
    if piece.offset <= acked <= piece.end:
        return None
    return f"offset {acked}, outside the piece [{piece.offset}, {piece.end})"


def lead_delay(remaining: int, rate_bps: float | None, rtt_s: float) -> float | None:
    """Seconds from now until the next piece's call should be made: ``rtt_s`` before the
    ``remaining`` bytes of the current piece are due at ``rate_bps`` bytes a second (0: now).
    None while the rate is not known yet."""
    if not rate_bps or rate_bps <= 0:
        return None
    return max(0.0, remaining / rate_bps - rtt_s)


def next_call_delay(remaining: int, rate_bps: float | None, lead_s: float | None) -> float | None:
    """When a stream's next call is due: ``lead_s`` ahead of the current piece's end (a fetch,
    whose request must travel up before bytes come down), or, with ``lead_s`` None, once the
    current piece has nothing left to move (a push: its last chunk handed to the connection).
    None: not yet known."""
    if lead_s is None:
        return 0.0 if remaining <= 0 else None
    return lead_delay(remaining, rate_bps, lead_s)


class Pace:
    """The rate one stream's bytes have been moving at, over its last few chunks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._marks: deque[tuple[float, int]] = deque(maxlen=PACE_SAMPLES + 1)
        self._total = 0

    def restart(self) -> None:
        """The stream sat idle (a piece whose call was not made ahead): forget the marks, so
        the idle time does not count as a slow rate."""
        self._marks.clear()

    def mark(self, nbytes: int) -> None:
        """``nbytes`` moved now (0: a header, the start of the bytes that follow it)."""
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


@dataclass(frozen=True)
class Load:
    """What one stream still has to move, as an idle stream weighs it.

    Attributes
    ----------
    remaining
        Bytes of the piece it is moving, not in yet (0: none, or one raced already).
    ahead
        Bytes of the piece whose call it made ahead and has not started on (0: none).
    rate
        Bytes a second it has been moving at lately, up to now (a stream that stalled is seen
        to slow); None when not known (nothing moved yet).
    """

    remaining: int
    ahead: int
    rate: float | None


def choose(loads: Sequence[Load], rate: float | None, rtt_s: float) -> int | None:
    """Which stream's work a stream moving ``rate`` bytes a second should take over: the one
    whose would end last, if this stream would end it within ``MARGIN`` of that time (a piece
    asked for ahead is taken whole; else the rest of the one being moved); None when none is
    worth it."""
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
