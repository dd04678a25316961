"""The gRPC face of a coordinator shard (service ``isthmus.v1.Shard``) and its server.

Sites push parts and fetch theta parts with a site certificate, as from the coordinator; only
the lead (a coordinator certificate) may close a round; status takes an operator's or the
lead's. Every refusal is a gRPC status whose message names the problem, as the coordinator's.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent import futures

import grpc

from coordinator.records import PushHeader, Refused
from coordinator.service import heap
from coordinator.service.auth import AuthError, Authorizer, RevocationList
from coordinator.service.servicer import (
    _refusals_to_status,
    piece_reply,
    received_ranges,
    refuse_unknown_fields,
)
from coordinator.shards.bulk import bulk_handler
from coordinator.shards.part_store import FoldedPart
from coordinator.shards.shard_core import ShardCore
from wire.chunking import DEFAULT_CHUNK_BYTES
from wire.identity import Bundle
from wire.net.grpc_options import server_options
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.transfer import Piece, range_problem

log = logging.getLogger("isthmus.shard")


def digests_pb(records) -> list[pb.TensorDigest]:
    return [
        pb.TensorDigest(name=t.name, dtype=t.dtype, shape=list(t.shape), digest=t.digest)
        for t in records
    ]


class RefusalCounts:
    """What the shard refused, by method and status (``refused`` is what the coordinator's
    refusal decorator reports to)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def refused(self, method: str, code: str) -> None:
        self.counts[(method, code)] += 1


class ShardServicer(pb_grpc.ShardServicer):
    leader = ""  # a shard is not elected: its refusals name no leader

    def __init__(self, core: ShardCore, authorizer: Authorizer) -> None:
        self.core, self.authorizer = core, authorizer
        self.metrics = RefusalCounts()
        self.chunk_bytes = DEFAULT_CHUNK_BYTES

    def _auth(self, context, roles: tuple[str, ...], claimed_site: str | None = None):
        """The caller's identity (None without TLS) when its certificate has one of ``roles``."""
        problem = None
        for role in roles:
            try:
                return self.authorizer.check(context.auth_context(), role, claimed_site)
            except AuthError as exc:
                problem = problem or exc
        raise Refused(problem.code, str(problem))

    @_refusals_to_status
    def Push(self, request_iterator, context) -> pb.PushReply:
        def chunks():
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "chunk":
                    raise Refused("invalid", "a push stream carries one header, then only chunks")
                refuse_unknown_fields(msg)
                yield msg.chunk.offset, msg.chunk.data

        return self.push(next(request_iterator, None), chunks(), context)

    @_refusals_to_status
    def Fetch(self, request: pb.FetchRequest, context):
        for part in self.fetch_parts(request, context):
            if isinstance(part, pb.FetchHeader):
                yield pb.FetchMessage(header=part)
            else:
                yield pb.FetchMessage(chunk=pb.Chunk(offset=part[0], data=part[1]))

    def push(self, first: pb.PushMessage | None, chunks, context) -> pb.PushReply:
        """A push stream: its header, then ``(offset, bytes)`` chunks (protobuf or raw)."""
        if first is None or first.WhichOneof("kind") != "header":
            raise Refused("invalid", "a push stream starts with a PushHeader")
        h = first.header
        if self._auth(context, ("site",), h.lease.site) is not None:  # None: --insecure
            self.core.check_pass(h.lease.site, h.round, h.shard_pass, "a part")
        refuse_unknown_fields(first)
        piece = Piece(h.piece.offset, h.piece.length) if h.HasField("piece") else None
        header = PushHeader(
            h.lease.site, h.lease.token, h.round, h.upload_id, h.manifest, h.weight,
            h.base_version, h.data_unit, piece, h.reserve,
        )  # fmt: skip
        upload = self.core.begin(header)
        try:
            for offset, data in chunks:
                if h.reserve:
                    raise Refused("invalid", "a reserve stream carries its header only")
                self.core.write(upload, offset, data, piece)
        finally:
            if not h.reserve:  # a reservation is registered as no stream
                self.core.uploads.release(upload, piece)
            heap.trim()  # the stream's read buffers are free now
        if piece is not None:
            return piece_reply(upload, piece)
        return self._finish(upload)

    def _finish(self, upload) -> pb.PushReply:
        receipt = self.core.finish(upload)
        if receipt is None:
            return pb.PushReply(
                acked_offset=upload.received,
                received=received_ranges(upload),
                message=f"{upload.received} of {upload.manifest.total_bytes} bytes received",
            )
        return pb.PushReply(
            complete=True, acked_offset=upload.received, message="held", receipt=receipt
        )

    def fetch_parts(self, request: pb.FetchRequest, context):
        """The header, then ``(offset, bytes)`` chunks of the part of theta served."""
        who = self._auth(context, ("site", "coordinator"), None)
        refuse_unknown_fields(request)
        core = self.core
        file, stored = core.file, core.stored  # one version for the whole stream
        if request.HasField("from_version"):
            raise Refused("invalid", "a shard serves whole parts of theta, not deltas")
        if request.HasField("version") and request.version != stored.version:
            raise Refused(
                "not_found",
                f"shard {core.spec.index} serves theta_{stored.version}, "
                f"not theta_{request.version}",
            )
        if who is not None and who.role == "site":  # the lead reads every version it asks for
            core.check_pass(who.name, stored.version, request.shard_pass, "a fetch")
        total = file.manifest.total_bytes
        start = request.offset
        stop = start + request.length if request.HasField("length") else total
        if problem := range_problem(start, stop - start, total):
            raise Refused("invalid", f"fetch: {problem}")
        # theta_hash stays empty: the lead's composed digest vouches for theta
        yield pb.FetchHeader(version=stored.version, manifest=file.manifest.to_proto())
        try:
            for offset in range(start, stop, self.chunk_bytes):
                yield offset, file.read(offset, min(self.chunk_bytes, stop - offset))
        finally:
            heap.trim()

    def _lead_only(self, context, what: str) -> None:
        """Refuse a caller that is not one of the coordinators that may lead."""
        who, leads = self._auth(context, ("coordinator",)), self.core.spec.leads
        if who is not None and leads and who.name not in leads:
            named = ", ".join(repr(n) for n in leads)
            raise Refused(
                "denied",
                f"only the lead ({named}) {what} on shard {self.core.spec.index}; this "
                f"certificate is {who.name!r}",
            )

    @_refusals_to_status
    def Close(self, request: pb.ShardCloseRequest, context) -> pb.ShardCloseReply:
        self._lead_only(context, "closes rounds")
        refuse_unknown_fields(request)
        parts = tuple(
            FoldedPart(p.site, p.upload_id, bytes(p.digest), p.weight, p.alpha)
            for p in request.parts
        )
        stored, replayed = self.core.close(request.round, parts, request.plan_digest, request.epoch)
        return pb.ShardCloseReply(
            version=stored.version, replayed=replayed, tensors=digests_pb(stored.tensors)
        )

    @_refusals_to_status
    def Align(self, request: pb.ShardAlignRequest, context) -> pb.ShardStatusReply:
        self._lead_only(context, "sets the theta served")
        refuse_unknown_fields(request)
        self.core.align(request.version, request.epoch, request.plan_digest)
        return self.status()

    @_refusals_to_status
    def Status(self, request: pb.ShardStatusRequest, context) -> pb.ShardStatusReply:
        self._auth(context, ("operator", "coordinator"))
        return self.status()

    def status(self) -> pb.ShardStatusReply:
        core, spec = self.core, self.core.spec
        return pb.ShardStatusReply(
            shard=spec.index,
            shards=spec.plan.shards,
            plan_digest=spec.plan.digest(),
            version=core.version,
            tensors=len(spec.names()),
            bytes=spec.plan.bytes_of(spec.index),
            parts_held=core.parts_held(),
            digests=digests_pb(core.stored.tensors),
        )


class ShardServer:
    """A shard serving on ``listen`` (mutual TLS with ``bundle``; None: plaintext, tests)."""

    def __init__(
        self, core: ShardCore, listen: str, bundle: Bundle | None, crl=None, workers: int = 32
    ) -> None:
        self.core = core
        heap.return_freed_memory()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard"),
            options=server_options(0),
        )
        revocations = None
        try:
            if bundle is None:
                port = self.server.add_insecure_port(listen)
            else:
                revocations = RevocationList(crl, bundle.ca)
                creds = grpc.ssl_server_credentials(
                    [(bundle.key, bundle.cert)],
                    root_certificates=bundle.ca,
                    require_client_auth=True,
                )
                port = self.server.add_secure_port(listen, creds)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {listen} (address in use or not local?)")
        self.address = f"{listen.rpartition(':')[0]}:{port}"
        self.servicer = ShardServicer(core, Authorizer(revocations))
        pb_grpc.add_ShardServicer_to_server(self.servicer, self.server)
        self.server.add_generic_rpc_handlers((bulk_handler(self.servicer),))

    def start(self) -> None:
        self.server.start()
        spec = self.core.spec
        log.info(
            "shard %d of %d serving theta_%d on %s; rounds closed by %s",
            spec.index,
            spec.plan.shards,
            self.core.version,
            self.address,
            "the lead " + " or ".join(repr(n) for n in spec.leads)
            if spec.leads
            else "any coordinator certificate",
        )

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()
