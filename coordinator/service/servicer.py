"""The gRPC face of the coordinator: protobuf in, core call, protobuf out.

Every refusal becomes a gRPC status whose message names the problem; nothing here decides
anything.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from coordinator.core import CoordinatorCore
from coordinator.observe.metrics import CoordinatorMetrics
from coordinator.observe.status import status_reply
from coordinator.records import PushHeader, Refused, check_name
from coordinator.service import heap
from coordinator.service.auth import AuthError, Authorizer
from coordinator.service.send_slots import SlotsBusy
from wire.bulk import chunk_frame, parse_chunk
from wire.chunking import DEFAULT_CHUNK_BYTES, ChunkError, iter_chunks
from wire.codecs.link_rate import measured
from wire.health import Probe
from wire.net.leader import LEADER_KEY
from wire.net.refusals import COMMITTED_BY, FOLD_ROUND
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.transfer import Piece

log = logging.getLogger("isthmus.coordinator")

STATUS_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    # Damaged in flight (the payload's digest does not match): the site sends it again.
    "corrupt": grpc.StatusCode.DATA_LOSS,
    "lease": grpc.StatusCode.ABORTED,
    "late": grpc.StatusCode.FAILED_PRECONDITION,
    "early": grpc.StatusCode.FAILED_PRECONDITION,
    # A late update that folds into a later round (``FOLD_ROUND``): the site sends it then.
    "later": grpc.StatusCode.FAILED_PRECONDITION,
    "not_participant": grpc.StatusCode.FAILED_PRECONDITION,
    # A lead of an older epoch than one a coordinator shard follows (``shards.fence``).
    "stale": grpc.StatusCode.FAILED_PRECONDITION,
    "duplicate": grpc.StatusCode.ALREADY_EXISTS,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "busy": grpc.StatusCode.UNAVAILABLE,
    # No longer the elected leader (``coordinator.ha.role``): the site finds the one that is.
    "standby": grpc.StatusCode.UNAVAILABLE,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "denied": grpc.StatusCode.PERMISSION_DENIED,
}


def _refusals_to_status(method):
    """Turn ``Refused`` into a gRPC error with the refusal's code and message."""

    def abort(servicer, context, exc: Refused):
        log.info("%s refused: %s", method.__name__, exc)
        code = STATUS_CODES.get(exc.code, grpc.StatusCode.INVALID_ARGUMENT)
        servicer.metrics.refused(method.__name__, code.name)
        metadata = []
        if exc.committed_by:  # which site's copy of a data unit won: a field, not prose
            metadata.append((COMMITTED_BY, exc.committed_by))
        if exc.fold_round is not None:
            metadata.append((FOLD_ROUND, str(exc.fold_round)))
        if servicer.leader and exc.code != "standby":  # the leader's own: a client stays here
            metadata.append((LEADER_KEY, servicer.leader))
        if metadata:
            context.set_trailing_metadata(tuple(metadata))
        context.abort(code, str(exc))

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Refused as exc:
                abort(self, context, exc)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Refused as exc:
            abort(self, context, exc)

    return unary


def unknown_field_path(msg: Message, path: str = "") -> str | None:
    """Where ``msg`` carries fields this protocol version does not define, if anywhere.

    Refusing them keeps a newer or hostile peer from smuggling meaning past this server.
    """
    name = path or type(msg).__name__
    if len(UnknownFieldSet(msg)):
        return name
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        items = value if field.is_repeated else [value]
        for i, item in enumerate(items):
            found = unknown_field_path(
                item,
                f"{name}.{field.name}" + (f"[{i}]" if field.is_repeated else ""),
            )
            if found:
                return found
    return None


def refuse_unknown_fields(msg: Message) -> None:
    where = unknown_field_path(msg)
    if where:
        raise Refused("invalid", f"{where} has fields this coordinator does not know")


def probe_of(report: pb.HealthReport) -> Probe:
    """A heartbeat's health report as the coordinator keeps it; refused whole if unreadable."""
    probe = Probe.of_report(report)
    if problem := probe.problem():
        raise Refused("invalid", f"heartbeat: {problem}")
    return probe


def bulk_push_frames(frames):
    """The header and the ``(offset, bytes)`` chunks of a raw-frame push (``wire.bulk``)."""
    first = next(frames, None)
    try:
        header = pb.PushMessage.FromString(first) if first is not None else None
    except DecodeError as exc:
        raise Refused("invalid", f"a push stream starts with a PushHeader ({exc})") from exc

    def chunks():
        for frame in frames:
            try:
                yield parse_chunk(frame)
            except ChunkError as exc:
                raise Refused("invalid", str(exc)) from exc

    return header, chunks()


def received_ranges(upload) -> list[pb.ByteRange]:
    return [pb.ByteRange(offset=s, length=e - s) for s, e in upload.spans()]


def piece_reply(upload, piece: Piece) -> pb.PushReply:
    """What a piece's stream is told once it ends: where the piece resumes, what is in. Such
    a stream never completes the upload; the reservation asked once every byte is in does."""
    acked = upload.acked(piece)
    return pb.PushReply(
        complete=False,
        acked_offset=acked,
        received=received_ranges(upload),
        message=f"piece [{piece.offset}, {piece.end}): {acked - piece.offset} of "
        f"{piece.length} bytes received",
    )


def lease_pb(lease, ttl_s: float) -> pb.Lease:
    return pb.Lease(site=lease.site, lease_id=lease.token, token=lease.token, ttl_s=ttl_s)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        core: CoordinatorCore,
        authorizer: Authorizer,
        metrics: CoordinatorMetrics,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        leader: str = "",
    ) -> None:
        """``leader``: this coordinator's advertised address when elected through etcd
        (``serve --ha``); its refusals name it, so a site does not take them for an outage."""
        self.leader = leader
        self.core = core
        self.authorizer = authorizer
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        self.ttl_s = core.cfg.timeouts.lease_ttl_s

    def _auth(self, context, role: str, claimed_site: str | None = None) -> None:
        """Nothing is looked at before the caller's certificate allows it; a claimed site
        name must be a valid one even without TLS (it ends up in messages and logs)."""
        try:
            self.authorizer.check(context.auth_context(), role, claimed_site)
        except AuthError as exc:
            raise Refused(exc.code, str(exc)) from exc
        if claimed_site is not None:
            check_name("site name", claimed_site)

    @_refusals_to_status
    def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        self._auth(context, "site", request.site)
        refuse_unknown_fields(request)
        lease, info = self.core.join(request.site, request.capabilities.num_examples)
        return pb.JoinReply(
            lease=lease_pb(lease, self.ttl_s),
            round=pb.RoundInfo(**info),
            job_name=self.core.cfg.name,
            job_config=self.core.cfg.source_toml,
            heartbeat_interval_s=self.core.cfg.timeouts.heartbeat_interval_s,
            shards=self.core.shards.shard_map() if self.core.shards is not None else None,
        )

    @_refusals_to_status
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        self._auth(context, "site", request.lease.site)
        refuse_unknown_fields(request)
        p = request.progress
        progress = {
            "round": p.round,
            "inner_step": p.inner_step,
            "train_loss": p.train_loss,
            "phase": p.phase[:32],  # shown in every Status reply: keep it small
            "merge_wait_s": p.merge_wait_s if math.isfinite(p.merge_wait_s) else 0.0,
            # What an adaptive downlink chooses from (``coordinator.round.downlink``).
            "fetch_bytes_per_s": measured(p.fetch_bytes_per_s),
            "fetch_latency_s": measured(p.fetch_latency_s),
            "task_compute_s": measured(p.task_compute_s),
            "steps_per_s": measured(p.steps_per_s),
            "compute_utilisation": min(measured(p.compute_utilisation), 1.0),
        }
        probe = probe_of(request.health) if request.HasField("health") else None
        site = request.lease.site
        lease, info, cancels = self.core.heartbeat(site, request.lease.token, progress, probe)
        return pb.HeartbeatReply(
            lease=lease_pb(lease, self.ttl_s),
            round=pb.RoundInfo(**info),
            commands=self._commands(site, cancels),
        )

    def _commands(self, site: str, cancels: list[str]) -> list[pb.Command]:
        commands = [pb.Command(cancel_unit=u) for u in cancels]
        if reason := self.core.drain_reason(site):
            commands.append(pb.Command(drain=reason))
        return commands

    @_refusals_to_status
    def WaitRound(self, request: pb.WaitRoundRequest, context) -> pb.WaitRoundReply:
        self._auth(context, "site", request.lease.site)
        refuse_unknown_fields(request)
        known = None
        if request.HasField("known"):
            k = request.known
            known = {
                "round": k.round,
                "version": k.version,
                "finished": k.finished,
                "participant": k.participant,
                "data_unit": k.data_unit,
                "update_wanted": k.update_wanted,
            }
        info, cancels = self.core.wait_round(
            request.lease.site, request.lease.token, known, request.timeout_s
        )
        return pb.WaitRoundReply(
            round=pb.RoundInfo(**info), commands=self._commands(request.lease.site, cancels)
        )

    @_refusals_to_status
    def Fetch(self, request: pb.FetchRequest, context):
        for part in self._fetch_parts(request, context):
            if isinstance(part, pb.FetchHeader):
                yield pb.FetchMessage(header=part)
            else:
                yield pb.FetchMessage(chunk=pb.Chunk(offset=part[0], data=bytes(part[1])))

    @_refusals_to_status
    def FetchBulk(self, request: pb.FetchRequest, context):
        """``isthmus.v1.Bulk/Fetch`` (``wire.bulk``): the same stream as raw frames."""
        for part in self._fetch_parts(request, context):
            if isinstance(part, pb.FetchHeader):
                yield part.SerializeToString()
            else:
                yield chunk_frame(*part)

    def _fetch_parts(self, request: pb.FetchRequest, context):
        """The header, then ``(offset, bytes)`` chunks from the requested offset (to the end,
        or of the requested ``length``), once a send slot is free
        (``coordinator.service.send_slots``)."""
        self._auth(context, "site", request.lease.site)
        refuse_unknown_fields(request)
        version = request.version if request.HasField("version") else None
        held = request.from_version if request.HasField("from_version") else None
        length = request.length if request.HasField("length") else None
        start = request.offset
        pub, as_delta = self.core.fetch(
            request.lease.site, request.lease.token, version, start, held, length
        )
        header = pb.FetchHeader(version=pub.version, theta_hash=pub.theta_hash)
        if self.core.shards is not None:  # a leased site: the shards' parts are its too
            header.shard_pass = self.core.shards.pass_for(request.lease.site, pub.version)
        stop = None if length is None else start + length  # in range: checked by the core
        if as_delta:
            header.from_version = pub.delta_from
            header.manifest.CopyFrom(pub.delta_manifest.to_proto())
            chunks = iter_chunks(pub.delta_payload, self.chunk_bytes, start, stop)
        else:
            header.manifest.CopyFrom(pub.manifest.to_proto())
            chunks = pub.payload.chunks(self.chunk_bytes, start, stop)
            if request.block_digests:
                header.block_bytes, digests = pub.payload.block_digests()
                header.block_digests.extend(digests)
        try:
            self.core.send_slots.acquire(request.lease.site)
        except SlotsBusy as exc:
            raise Refused("busy", f"{exc}; fetch again") from None
        try:
            yield header
            for offset, data in chunks:
                yield offset, data
                self.core.count_sent(len(data))
                self.metrics.sent(request.lease.site, len(data))
        finally:
            self.core.send_slots.release(request.lease.site)
            heap.trim()  # its chunks are free now

    @_refusals_to_status
    def Push(self, request_iterator, context) -> pb.PushReply:
        self._auth(context, "site")

        def chunks():
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "chunk":
                    raise Refused("invalid", "a push stream carries one header, then only chunks")
                refuse_unknown_fields(msg)
                data = msg.chunk.data  # each access of a bytes field copies it
                yield msg.chunk.offset, data

        return self._push(next(request_iterator, None), chunks(), context)

    @_refusals_to_status
    def PushBulk(self, frames, context) -> pb.PushReply:
        """``isthmus.v1.Bulk/Push`` (``wire.bulk``): a serialised header, then raw chunks."""
        self._auth(context, "site")
        header, chunks = bulk_push_frames(frames)
        return self._push(header, chunks, context)

    def _push(self, first: pb.PushMessage | None, chunks, context) -> pb.PushReply:
        if first is None or first.WhichOneof("kind") != "header":
            raise Refused("invalid", "a push stream starts with a PushHeader")
        self._auth(context, "site", first.header.lease.site)
        refuse_unknown_fields(first)
        h = first.header
        piece = Piece(h.piece.offset, h.piece.length) if h.HasField("piece") else None
        if piece is not None and h.reserve:
            raise Refused("invalid", "a reservation is for the whole upload: it carries no piece")
        upload = self.core.begin_upload(
            PushHeader(
                site=h.lease.site,
                token=h.lease.token,
                round=h.round,
                upload_id=h.upload_id,
                manifest=h.manifest,
                weight=h.weight,
                base_version=h.base_version,
                data_unit=h.data_unit,
                piece=piece,
                reserve=h.reserve,
                shard_digests=tuple(h.shard_digests),
                shard_receipts=tuple(h.shard_receipts),
            )
        )
        if h.reserve:  # registered as no stream of the upload: nothing to release
            return self._reserve(upload, h.lease.token, chunks, context, h.keep_open)
        try:
            with self.core.receiving(upload):
                for offset, data in chunks:
                    self.core.upload_chunk(upload, offset, data, h.lease.token, piece)
                    self.metrics.received(upload.site, len(data))
                if piece is not None:
                    return piece_reply(upload, piece)
                return self._finish(upload, h.lease.token, context)
        finally:
            self.core.release_upload(upload, piece)

    def _reserve(self, upload, token: int, chunks, context, keep_open: bool) -> pb.PushReply:
        """A header-only stream asking for a receive slot; one whose bytes all arrived
        already is counted as a plain probe would be, unless it asks to keep it open."""
        if next(iter(chunks), None) is not None:
            raise Refused("invalid", "a reserve stream carries its header only, no chunks")
        if upload.complete:
            if not keep_open:
                return self._finish(upload, token, context)
            return pb.PushReply(
                acked_offset=upload.received,
                message="every byte is in; kept open",
                received=received_ranges(upload),
            )
        granted = self.core.reserve_slot(upload)
        return pb.PushReply(
            acked_offset=upload.received,
            granted=granted,
            message="send now" if granted else "every receive slot is busy; ask again",
            received=received_ranges(upload),
        )

    def _finish(self, upload, token: int, context) -> pb.PushReply:
        if not context.is_active():
            # The stream ended in a message grpc could not decode, or was cancelled: grpc
            # reports that to the client itself; what arrived stays resumable, uncounted.
            return pb.PushReply(complete=False, acked_offset=upload.received)
        if not self.core.finish_upload(upload, token):
            return pb.PushReply(
                complete=False,
                acked_offset=upload.received,
                message=f"{upload.received} of {upload.manifest.total_bytes} bytes received",
            )
        return pb.PushReply(complete=True, acked_offset=upload.received, message="counted")

    @_refusals_to_status
    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveReply:
        self._auth(context, "site", request.lease.site)
        refuse_unknown_fields(request)
        self.core.leave(request.lease.site, request.lease.token)
        return pb.LeaveReply()

    @_refusals_to_status
    def Status(self, request: pb.StatusRequest, context) -> pb.StatusReply:
        self._auth(context, "operator")
        refuse_unknown_fields(request)
        reply = status_reply(self.core.snapshot())
        if self.core.shards is not None:  # asked outside the core's lock
            reply.shards.extend(self.core.shards.states())
        return reply

    @_refusals_to_status
    def Drain(self, request: pb.DrainRequest, context) -> pb.DrainReply:
        """``coordinator drain`` / ``undrain``: an operator's certificate only."""
        self._auth(context, "operator")
        refuse_unknown_fields(request)
        changed, message, drained = self.core.set_drain(
            request.site, not request.undrain, request.reason
        )
        return pb.DrainReply(changed=changed, message=message, drained=drained)
