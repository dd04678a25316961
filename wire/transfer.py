"""Parallel transfer streams: the ``[transfer]`` table, byte ranges and how a payload is cut.

On a long fat link one TCP stream rarely fills the pipe (its window, or a congestion control
that backs off on every loss). With ``streams = K > 1`` a large payload crosses on K
connections at once::

    [transfer]
    streams = 4              # 1..8; 1 (the default): one stream per transfer, as always
    keep_connections = true  # updates go up on the site's kept connections (default false)

The payload is cut into pieces of whole chunks, about ``PIECES_PER_STREAM`` per stream, in one
queue that every stream takes its next piece from: a stream that runs slow (cubic's start
left some streams behind) simply takes fewer pieces, where fixed 1/K shares leave the whole
transfer waiting for the slowest. Down, a piece travels as a ranged fetch
(``FetchRequest.length``); up, as a push stream carrying that piece only
(``PushHeader.piece``). Either resumes at any byte inside the piece: ``ReceivedRanges`` is
what a receiver holds, and where a piece goes on.

Both sides read the table from the same job config: the coordinator allows each certificate
``2 K`` fetch and ``2 K`` push streams at once (``CallLimits.for_transfer``: K plus a retry of
each), the sites use K. Everything here is pure.
"""

from __future__ import annotations

import bisect
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wire.config_table import ConfigError, as_table, load_table, rule, setting

MAX_STREAMS = 8
PIECES_PER_STREAM = 8
# A payload of fewer chunks than this per stream goes on one stream: the extra connections'
# first round trip would cost more than they gain.
MIN_CHUNKS_PER_STREAM = 2


@dataclass(frozen=True)
class TransferConfig:
    """The ``[transfer]`` table (see the module docstring)."""

    streams: int = setting(
        1,
        check=rule(lambda v: 1 <= v <= MAX_STREAMS, f"must be in [1, {MAX_STREAMS}]"),
        help="K, the streams (each on a connection of its own) one large theta fetch or update "
        "push takes at once; each certificate may then hold 2 K fetch and 2 K push streams",
    )
    keep_connections: bool = setting(
        False,
        help="whether a site pushes its updates on the connections it keeps (those theta comes "
        "down on), so their TCP windows carry over from round to round: on a host where an "
        "idle connection keeps its window (``net.ipv4.tcp_slow_start_after_idle = 0``) an "
        "update then fills a long link from its first byte. Off, each upload has connections "
        "of its own, closed after it, and starts from TCP's initial window; the price of "
        "keeping them is memory at the coordinator, which holds about 3 MB for as long as a "
        "connection that carried an update lives (per site and stream: 48 MB for 16 sites of "
        "one stream)",
    )


def transfer_from_job(job_config: Mapping[str, Any]) -> TransferConfig:
    """The ``[transfer]`` table of a parsed job config (the defaults when it has none)."""
    table = as_table(job_config.get("transfer", {}), "transfer")
    return load_table(TransferConfig, table, "transfer")


def transfer_from_toml(source: bytes | str) -> TransferConfig:
    """The ``[transfer]`` table of a job config's TOML text, as the coordinator hands it to
    its sites on Join (empty: the defaults)."""
    text = source.decode("utf-8", "replace") if isinstance(source, bytes) else source
    try:
        job_config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the job config from the coordinator is not valid TOML: {exc}") from exc
    return transfer_from_job(job_config)


@dataclass(frozen=True)
class Piece:
    """The payload bytes ``[offset, offset + length)``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def plan_pieces(total: int, chunk_bytes: int, streams: int) -> list[Piece]:
    """``total`` bytes as pieces of whole ``chunk_bytes`` chunks (the last one shorter), about
    ``PIECES_PER_STREAM`` per stream, in payload order; one piece for a small payload."""
    if total <= 0:
        return []
    chunks = -(-total // chunk_bytes)
    if streams <= 1 or chunks < MIN_CHUNKS_PER_STREAM * streams:
        return [Piece(0, total)]
    count = min(chunks, PIECES_PER_STREAM * streams)
    base, extra = divmod(chunks, count)
    pieces, first_chunk = [], 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        start = first_chunk * chunk_bytes
        pieces.append(Piece(start, min((first_chunk + n) * chunk_bytes, total) - start))
        first_chunk += n
    return pieces


def range_problem(offset: int, length: int | None, total: int) -> str | None:
    """Why ``length`` bytes (None: to the end) from ``offset`` of a ``total``-byte payload
    cannot be asked for (a ranged fetch, a piece of an upload), or None when they can."""
    if not 0 <= offset <= total:
        return f"offset {offset} outside the {total}-byte payload"
    if length is None:
        return None
    if length <= 0:
        return f"a range holds at least one byte of the {total}-byte payload (length 0)"
    if offset + length > total:
        return (
            f"range [{offset}, {offset} + {length}) runs past the end of the {total}-byte payload"
        )
    return None


class ReceivedRanges:
    """Disjoint byte ranges ``[start, end)``, kept merged and sorted."""

    def __init__(self, ranges: list[tuple[int, int]] = ()) -> None:
        self.spans: list[tuple[int, int]] = []
        for start, end in ranges:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        spans = self.spans
        i = bisect.bisect_left(spans, (start, start))
        if i > 0 and spans[i - 1][1] >= start:  # touches the one before
            i -= 1
            start = spans[i][0]
        j = i
        while j < len(spans) and spans[j][0] <= end:
            end = max(end, spans[j][1])
            j += 1
        spans[i:j] = [(start, end)]

    def run_end(self, offset: int) -> int:
        """Where the run of received bytes that ``offset`` starts or lies in ends (``offset``
        itself if that byte is not in)."""
        i = bisect.bisect_right(self.spans, (offset, float("inf"))) - 1
        if i >= 0 and self.spans[i][0] <= offset < self.spans[i][1]:
            return self.spans[i][1]
        return offset

    def next_start(self, offset: int) -> int | None:
        """The start of the first received range at or after ``offset``, if any."""
        i = bisect.bisect_left(self.spans, (offset, offset))
        return self.spans[i][0] if i < len(self.spans) else None

    def covered(self) -> int:
        return sum(end - start for start, end in self.spans)

    def covers(self, total: int) -> bool:
        return total == 0 or self.spans == [(0, total)]

    def covered_in(self, start: int, end: int) -> int:
        """How many of the bytes ``[start, end)`` are in."""
        return sum(max(0, min(e, end) - max(s, start)) for s, e in self.spans)

    def resume_at(self, piece: Piece) -> int:
        """Where a stream carrying ``piece`` goes on: the end of the received run from its
        start, within it."""
        return min(self.run_end(piece.offset), piece.end)
