"""Bulk transfers as raw frames: theta down and updates up without protobuf on the chunks.

protobuf copies a ``bytes`` field when a message is built, serialised, parsed and read; for
model-sized payloads that was most of a transfer (a 21 MB stream: 0.07 s as ``Chunk`` messages,
0.017 s as raw frames, measured side by side on loopback). So the two bulk methods of service
``isthmus.v1.Bulk`` carry protobuf only where it is small:

* ``Fetch``: the request is a serialised ``FetchRequest``; the reply stream's first frame is a
  serialised ``FetchHeader``, every later frame a chunk;
* ``Push``: the request stream's first frame is a serialised ``PushMessage`` holding the
  header, every later frame a chunk; the reply is a serialised ``PushReply``.

A chunk frame is the chunk's payload offset as 8 bytes little-endian, then its bytes. Everything
else (authentication, limits, resumption, the checks on every chunk) is as for the protobuf
methods ``Coordinator.Fetch`` and ``Coordinator.Push``, which stay available.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import grpc

from wire.chunking import ChunkError
from wire.proto import isthmus_pb2 as pb

SERVICE = "isthmus.v1.Bulk"
# A reservation (a header-only push with ``reserve``, ``coordinator.intake.receive_slots``) waits
# this long for a slot before it is answered without one; the site then asks again.
RESERVE_WAIT_S = 15.0
FETCH = f"/{SERVICE}/Fetch"
PUSH = f"/{SERVICE}/Push"
_OFFSET = struct.Struct("<Q")


def chunk_frame(offset: int, data: memoryview | bytes) -> bytes:
    """One chunk on the wire (one copy of its bytes, as ``bytes(data)`` would make)."""
    return b"".join((_OFFSET.pack(offset), data))


def parse_chunk(frame: bytes) -> tuple[int, memoryview]:
    """(offset, bytes) of a chunk frame, without copying the bytes."""
    if not isinstance(frame, bytes) or len(frame) <= _OFFSET.size:
        raise ChunkError(f"a chunk frame holds an 8-byte offset and data, got {len(frame)} bytes")
    (offset,) = _OFFSET.unpack_from(frame)
    return offset, memoryview(frame)[_OFFSET.size :]


class BulkStub:
    """The client side of the bulk methods on ``channel``."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._fetch = channel.unary_stream(
            FETCH, request_serializer=pb.FetchRequest.SerializeToString, response_deserializer=None
        )
        self._push = channel.stream_unary(
            PUSH, request_serializer=None, response_deserializer=pb.PushReply.FromString
        )

    def Fetch(self, request: pb.FetchRequest, timeout: float) -> Iterator[bytes]:  # noqa: N802
        return self._fetch(request, timeout=timeout)

    def Push(self, frames: Iterator[bytes], timeout: float) -> pb.PushReply:  # noqa: N802
        return self._push(frames, timeout=timeout)
