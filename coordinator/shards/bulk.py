"""A shard's ``isthmus.v1.Bulk`` methods: its parts up and down as raw frames (``wire.bulk``),
the framing the coordinator's own bulk methods use, so that no ``bytes`` field is copied
through protobuf on the way (the protobuf ``Shard.Push`` and ``Shard.Fetch`` stay)."""

from __future__ import annotations

import grpc

from coordinator.service.servicer import _refusals_to_status, bulk_push_frames
from wire.bulk import SERVICE, chunk_frame
from wire.proto import isthmus_pb2 as pb


class ShardBulk:
    """The raw-frame methods over a ``ShardServicer``'s push and fetch."""

    leader = ""

    def __init__(self, servicer) -> None:
        self.servicer = servicer
        self.metrics = servicer.metrics

    @_refusals_to_status
    def Push(self, frames, context) -> pb.PushReply:  # noqa: N802
        header, chunks = bulk_push_frames(frames)
        return self.servicer.push(header, chunks, context)

    @_refusals_to_status
    def Fetch(self, request: pb.FetchRequest, context):  # noqa: N802
        for part in self.servicer.fetch_parts(request, context):
            if isinstance(part, pb.FetchHeader):
                yield part.SerializeToString()
            else:
                yield chunk_frame(*part)


def bulk_handler(servicer) -> grpc.GenericRpcHandler:
    bulk = ShardBulk(servicer)
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Fetch": grpc.unary_stream_rpc_method_handler(
                bulk.Fetch, request_deserializer=pb.FetchRequest.FromString
            ),
            "Push": grpc.stream_unary_rpc_method_handler(
                bulk.Push, response_serializer=pb.PushReply.SerializeToString
            ),
        },
    )
