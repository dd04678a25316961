"""A parallel fetch's streams ask for their next piece ahead, and at the end take work over
from a stream lagging behind: the parts without a network (``site_client/transfer/plan.py``,
``site_client/transfer/overlap.py``), on an injected clock."""

from __future__ import annotations

import threading

import pytest

from site_client.transfer.overlap import Endgame, NextPiece, Race, load_of
from site_client.transfer.plan import LEAD_RTTS, MARGIN, Load, Pace, PieceQueue, choose, lead_delay
from wire.transfer import Piece

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Call:
    """A started Fetch call, as far as these parts touch one."""

    def __init__(self, piece: Piece) -> None:
        self.piece, self.cancelled = piece, False

    def cancel(self) -> None:
        self.cancelled = True


def test_the_next_call_is_due_a_lead_before_the_current_piece_ends():
    assert lead_delay(4 * MB, 2 * MB, 0.5) == pytest.approx(1.5)
    assert lead_delay(MB, 2 * MB, 0.5) == 0.0  # due within the lead: now
    assert lead_delay(MB, None, 0.5) is None  # no rate yet: not before the piece ends


def test_the_pace_is_the_rate_of_the_last_chunks_and_forgets_an_idle_stream():
    clock = Clock()
    pace = Pace(clock)
    pace.mark(0)
    assert pace.rate() is None
    for _ in range(3):
        clock.now += 0.5
        pace.mark(MB)
    assert pace.rate() == pytest.approx(2 * MB)
    clock.now += 0.9
    assert pace.rate(until_now=True) == pytest.approx(2 * MB)  # between two chunks
    clock.now += 1.6
    assert pace.rate() == pytest.approx(2 * MB)
    assert pace.rate(until_now=True) == pytest.approx(3 * MB / 4.0)  # one that stalled
    pace.restart()  # idle before a piece asked for only now
    assert pace.rate() is None


@pytest.fixture
def ahead():
    clock = Clock()
    queue = PieceQueue([Piece(0, MB), Piece(MB, MB), Piece(2 * MB, MB)])
    opened: list[Call] = []

    def open_call(piece: Piece) -> Call:
        opened.append(Call(piece))
        return opened[-1]

    stream = NextPiece(queue, open_call, rtt_s=0.1, clock=clock)
    yield stream, queue, opened, clock
    stream.close()


def _wait_for(predicate) -> None:
    # The timer thread acts at once on a call that is due; this only waits for it to run.
    done = threading.Event()
    for _ in range(500):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError("the timer thread did not act")


def test_a_stream_opens_its_next_piece_a_lead_ahead_and_takes_it_with_its_call(ahead):
    stream, queue, opened, clock = ahead
    piece, call = stream.take()
    assert piece == Piece(0, MB) and call is None  # the first is asked for by the stream
    stream.progress(0, MB, fresh=True)
    clock.now += 0.1
    stream.progress(MB // 2, MB // 2)  # 5 MB/s: the rest is due in 0.1 s, inside the lead
    _wait_for(lambda: opened)
    assert opened[0].piece == Piece(MB, MB) and stream.opened_ahead == 1
    assert stream.ahead_bytes() == MB
    assert stream.take() == (Piece(MB, MB), opened[0])
    assert stream.take() == (Piece(2 * MB, MB), None)  # nothing was due: from the queue
    assert stream.take() == (None, None)


def test_a_far_end_waits_and_a_broken_piece_gives_its_next_one_back(ahead):
    stream, queue, opened, clock = ahead
    stream.take()
    stream.progress(0, MB, fresh=True)
    clock.now += 1.0
    stream.progress(MB // 8, 7 * MB // 8)  # 7 s to go: not due for a while
    assert not opened and stream.ahead_bytes() == 0
    clock.now += 0.5
    stream.progress(13 * MB // 16, MB // 16)  # faster: the rest is due within the lead
    assert lead_delay(MB // 16, stream.pace.rate(), LEAD_RTTS * 0.1) == 0.0
    _wait_for(lambda: opened)
    assert stream.withdraw() == Piece(MB, MB)  # the current piece broke: the call goes
    assert opened[0].cancelled and queue.take() == Piece(MB, MB)  # and its piece is back


def test_closing_a_stream_cancels_the_call_it_opened_ahead(ahead):
    stream, _queue, opened, clock = ahead
    stream.take()
    stream.progress(0, MB, fresh=True)
    clock.now += 0.1
    stream.progress(MB, 0)
    _wait_for(lambda: opened)
    stream.close()
    assert opened[0].cancelled


def test_an_idle_stream_takes_over_the_work_that_would_end_last():
    fast = 8 * MB
    loads = [Load(MB, 0, 8 * MB), Load(4 * MB, 0, MB), Load(MB, 2 * MB, 2 * MB)]
    assert choose(loads, fast, rtt_s=0.1) == 1  # 4 s to go there, 0.6 s here
    assert choose([Load(2 * MB, 0, None)], fast, 0.1) == 0  # nothing in yet: stalled
    assert choose([Load(0, 0, MB)], fast, 0.1) is None  # nothing left to take
    # Not worth it unless this stream ends it within MARGIN of the time the other would.
    theirs = 2 * MB / (2 * MB)
    assert choose([Load(2 * MB, 0, 2 * MB)], 2 * MB / (MARGIN * theirs - 0.1) * 0.99, 0.1) is None
    assert choose(loads, None, 0.1) is None  # this stream's own rate is not known


class Runner:
    """A ``PieceStream`` as the endgame sees one."""

    def __init__(self, piece: Piece, received: int) -> None:
        self.piece, self.received = piece, received
        self.race, self.done, self.frames = None, False, Call(piece)


class Stream:
    """A ``NextPiece`` as the endgame sees one."""

    def __init__(self, rate: float | None, current=None, ahead: Piece | None = None) -> None:
        clock = Clock()
        self.pace, self.current, self.ahead = Pace(clock), current, ahead
        if rate:
            self.pace.mark(0)
            clock.now += 1.0
            self.pace.mark(int(rate))

    def ahead_bytes(self) -> int:
        return self.ahead.length if self.ahead else 0

    def withdraw(self, requeue: bool = True) -> Piece | None:
        taken, self.ahead = self.ahead, None
        return taken


def test_the_endgame_withdraws_a_piece_asked_for_ahead_or_races_the_rest_of_one():
    idle = Stream(16 * MB)
    slow_ahead = Stream(MB, Runner(Piece(0, MB), MB // 2), ahead=Piece(4 * MB, 2 * MB))
    endgame = Endgame(rtt_s=0.1)
    for s in (idle, slow_ahead):
        endgame.join(s)
    assert load_of(slow_ahead).ahead == 2 * MB
    assert endgame.take_over(idle) == (Piece(4 * MB, 2 * MB), None)  # not started on: taken
    piece, race = endgame.take_over(idle)  # then the rest of the piece it is receiving
    assert piece == Piece(MB // 2, MB // 2) and isinstance(race, Race)
    assert slow_ahead.current.race is race
    assert endgame.take_over(idle) is None  # raced once only


def test_the_first_to_end_a_raced_piece_cancels_the_other():
    race, first, second = Race(), object(), object()
    a, b = Call(Piece(0, MB)), Call(Piece(0, MB))
    race.running(first, a)
    race.running(second, b)
    race.finish(second)
    assert race.won.is_set() and a.cancelled and not b.cancelled
    late = Call(Piece(0, MB))
    race.running(first, late)  # a new attempt after the race was won: cancelled at once
    assert late.cancelled
