"""Pushing one host's part of a multi-node site's update (``wire.payload_parts``).

Every node of the site pushes the bytes of its own part, under the site's one upload id and
lease, as pieces (``PushHeader.piece``) over its own connections: no host relays another's
bytes. The coordinator holds one upload for the site and counts it once, when every part is in
and verified, through the reservation of the node that *completes* the update (node 0, the
one holding the site's lease and hearing when its trainers' checkpoint is on disk). Every
other reservation is sent ``keep_open``: it may not count the update, whatever arrived.

1. A reservation (kept open) asks for the upload's receive slot and says what the coordinator
   holds already; the pieces of this host's part not wholly there are sent, as
   ``site_client.transfer.parallel_push`` sends an upload's pieces.
2. A node that does not complete is then done. The completing one waits for ``hold`` (its
   checkpoint), then asks again until the coordinator, holding every part, has counted the
   update: the other nodes' parts may still be on their way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from site_client.errors import PartsStalled
from site_client.transfer.parallel_push import PiecedPush, held_ranges
from wire.chunking import ChunkError
from wire.proto import isthmus_pb2 as pb
from wire.transfer import Piece, plan_pieces

POLL_S = 0.05  # between the completing node's asks while other parts arrive
POLL_CAP_S = 1.0
# The other hosts' parts stopped arriving this long: the update is withdrawn (a host whose
# part was refused, or lost with its agent, does not send it again).
STALL_S = 300.0


@dataclass(frozen=True)
class SitePart:
    """This host's bytes ``[offset, offset + length)`` of the site's payload; ``completes``:
    this host's reservation counts the update once every part is in."""

    offset: int
    length: int
    completes: bool

    @property
    def end(self) -> int:
        return self.offset + self.length

    def pieces(self, chunk_bytes: int, streams: int) -> list[Piece]:
        """The part as pieces for ``streams`` streams, at its place in the payload."""
        planned = plan_pieces(self.length, chunk_bytes, streams)
        return [Piece(self.offset + p.offset, p.length) for p in planned]


class PartsPush:
    """One attempt of an ``UpdatePush`` of this host's ``part``."""

    def __init__(self, push) -> None:
        self.push = push
        self.part: SitePart = push.part

    def attempt(self) -> pb.PushReply:
        p, pieced = self.push, PiecedPush(self.push)
        held, todo = pieced.reserve()
        mine = held.covered_in(self.part.offset, self.part.end)
        p.progress.start(f"push round {p.round} (this node's part)", self.part.length, mine)
        pieced.send(todo)
        if not self.part.completes:
            return pb.PushReply(acked_offset=self.part.end, message="this node's part is in")
        if not p.wait_for_hold():
            raise p.withdrawn()
        return self._complete()

    def _complete(self) -> pb.PushReply:
        """Ask until the update counts: the other nodes' parts may still be arriving. Once
        they stop arriving for ``STALL_S``, the update is withdrawn (``PushAborted``)."""
        p, delay = self.push, POLL_S
        covered, since = -1, time.monotonic()
        while True:
            asked = time.monotonic()
            reply = p.reserve()
            if reply.complete:
                return reply
            if time.monotonic() - asked > POLL_CAP_S:  # waited for a slot: so did the others
                since = time.monotonic()
            held = held_ranges(reply)
            if held.covered_in(self.part.offset, self.part.end) < self.part.length:
                raise ChunkError(f"this node's part is not all in: {reply.message}")
            if p.abort():
                raise p.withdrawn()
            if held.covered() != covered:
                covered, since = held.covered(), time.monotonic()
            elif time.monotonic() - since > STALL_S:
                raise PartsStalled(
                    f"push of round {p.round}: the site's other hosts' parts stopped arriving "
                    f"({covered} of {p.payload.total_bytes} bytes in for {STALL_S:g}s)"
                )
            time.sleep(delay)
            delay = min(delay * 2, POLL_CAP_S)
