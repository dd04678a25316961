"""The site's connection to the coordinator: join, heartbeat, fetch theta, push an update.

Every call retries transient failures (coordinator down or restarting, network cut) with
exponential backoff and full jitter up to the policy's deadline, re-joins when its lease was
fenced out (after a coordinator restart, or after it lapsed), and resumes transfers from the
last acknowledged byte instead of starting them again.

With several coordinators (``"A:7070,B:7070"``: standby coordinators, ``serve --ha``), a call
refused as ``UNAVAILABLE`` moves the client to the leader the refusal names
(``wire.net.leader``), or, when none is named (no answer, no leader elected yet), to the next
address in turn; the retry then goes there, after its backoff. The new leader fences the old
lease, so the site re-joins it as after a restart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import torch

from site_client.agent.update_payload import UpdatePayload, payload_of
from site_client.errors import CoordinatorError, PushAborted, TlsRefused
from site_client.transfer.endpoints import FollowingStub, StreamChannels, UploadConnection
from site_client.transfer.node import SitePart
from site_client.transfer.push import UpdatePush, lost_race, new_upload_id
from site_client.transfer.sharded import ShardRoutes
from site_client.transfer.theta import GlobalState, ThetaFetcher
from wire.backoff import BackoffPolicy, retry
from wire.bulk import BulkStub
from wire.chunking import DEFAULT_CHUNK_BYTES, ChunkError
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.identity import Bundle
from wire.net.channel import open_channel
from wire.net.leader import leader_named, next_address, parse_addresses
from wire.net.tls_probe import TlsProblem, diagnose, looks_like_tls
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.tensors import pack, pack_encoded
from wire.transfer import TransferConfig, transfer_from_toml

# Re-exported: callers import the whole client API from this module.
__all__ = ["CoordinatorClient", "CoordinatorError", "GlobalState", "PushAborted"]

log = logging.getLogger("isthmus.site")
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def _code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None


def encoded(
    delta: dict[str, torch.Tensor], compression: CompressionConfig | None, state: CodecState | None
) -> UpdatePayload:
    """Whole tensors laid out as a payload, each encoded by the codec ``compression`` picks."""
    if compression is None:
        return payload_of(*pack(delta))
    return payload_of(*pack_encoded(delta, compression, state or CodecState()))


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        site: str,
        *,
        backoff: BackoffPolicy | None = None,
        num_examples: int = 0,
        world_size: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        rpc_timeout_s: float = 30.0,
        transfer_timeout_s: float = 3600.0,
        on_retry: Callable[[str, int, float, BaseException], None] | None = None,
        tls: Bundle | None = None,
        joins: bool = True,
    ) -> None:
        """``address``: HOST:PORT, or several separated by commas (standby coordinators);
        ``tls`` is the site's bundle (mutual TLS); ``None`` means plaintext (insecure).
        ``joins=False``: a node of a multi-node site other than node 0, which never joins
        but works under the lease node 0 holds (set ``lease`` before each call)."""
        self.addresses, problem = parse_addresses(address)
        if problem:
            raise ValueError(f"coordinator address {address!r}: {problem}")
        self.site = site
        self.backoff = backoff or BackoffPolicy()
        self.num_examples = num_examples
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.rpc_timeout_s = rpc_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.on_retry = on_retry
        self.tls = tls
        self.joins = joins
        self._channels: dict[str, tuple[grpc.Channel, grpc.Channel]] = {}
        self._switching = threading.Lock()
        self.streams = StreamChannels(lambda a: open_channel(a, tls, own_connection=True))
        self._use(self.addresses[0])
        self.lease: pb.Lease | None = None
        # Set by ``leave``: a call still in flight then (a heartbeat) must not join again.
        self.left = False
        self.join_reply: pb.JoinReply | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        # [transfer] of the job config the coordinator hands over on join: how many streams
        # one large fetch takes. Each stream beyond the first has a connection of its own.
        self.transfer = TransferConfig()
        self._join_lock = threading.Lock()
        self.theta = ThetaFetcher(self)
        # A job split over coordinator shards (``JoinReply.shards``): the site's routes to them.
        self.shards: ShardRoutes | None = None

    def _use(self, address: str) -> None:
        """Send every call to ``address`` from now on. Its channels are opened once and kept
        (a call still in flight on another address's finishes there)."""
        if address not in self._channels:
            # Heartbeats on their own connection: behind a multi-megabyte push on a slow link
            # they would wait for the push and the lease would lapse while the site sends.
            self._channels[address] = (
                open_channel(address, self.tls),
                open_channel(address, self.tls, own_connection=True),
            )
        self.channel, self.control_channel = self._channels[address]
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.bulk = BulkStub(self.channel)  # theta and updates as raw frames (wire.bulk)
        self.control = pb_grpc.CoordinatorStub(self.control_channel)
        self.address = address

    def _follow(self, exc: grpc.RpcError, failed: str) -> None:
        """After an ``UNAVAILABLE`` from ``failed``: move to the leader it names, or, among
        several addresses, to the next one. Only once per address: of calls failing there
        together, the first moves the client and the others find it moved already."""
        named = leader_named(exc)
        if named == failed or (named is None and len(self.addresses) == 1):
            return  # one address, or the leader itself taking over: retry there
        with self._switching:
            if self.address != failed:
                return
            nxt = next_address(self.addresses, failed, named)
            if nxt != failed:
                log.info("coordinator %s: %s; trying %s", failed, exc.details(), nxt)
                self._use(nxt)

    def close(self) -> None:
        for channel, control in self._channels.values():
            channel.close()
            control.close()
        self.streams.close()

    def stream_stubs(self, streams: int) -> list[FollowingStub]:
        """Stubs of ``streams`` parallel streams (``site_client.transfer.endpoints``), each on
        a TCP connection of its own and to the address the client uses at each call."""
        return [FollowingStub(self, i) for i in range(streams)]

    def connect_streams(self, streams: int, timeout_s: float = 30.0) -> None:
        """Open the connections of ``streams`` parallel streams now, not at the first transfer
        that takes them (a benchmark's warm-up: the first transfer would pay the handshakes)."""
        channels = [self.channel, *self.streams.channels(self.address, streams - 1)]
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)

    @contextlib.contextmanager
    def upload_connection(self) -> Iterator[UploadConnection]:
        """A connection of its own for one upload's data streams, closed after it. gRPC keeps
        the buffers a connection received through for as long as the connection lives (at the
        coordinator, about 3 MB for one that carried an update through an 8 MiB window), so
        uploads on the long-lived channel would leave that much per site behind."""
        connection = UploadConnection(self, lambda a: open_channel(a, self.tls, True))
        try:
            yield connection
        finally:
            connection.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- retry plumbing -------------------------------------------------------------------

    @property
    def delta_mismatches(self) -> int:
        return self.theta.delta_mismatches

    def call(self, describe: str, fn: Callable[[], object]):
        """Run ``fn`` with backoff on transient errors; re-join when the lease was fenced."""

        tls_problem: list[TlsProblem] = []
        tried = [self.address]  # the address of the latest attempt

        def attempt():
            if self.left and describe not in ("join", "status"):
                raise CoordinatorError(None, f"{describe}: this site has left the job")
            if describe not in ("join", "status"):
                self._ensure_joined()
            used, tried[0] = self.lease, self.address
            try:
                return fn()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED and describe != "join":
                    log.warning("%s: %s; re-joining", describe, exc.details())
                    # Only the lease this call was fenced under: a call of another stream may
                    # have joined again meanwhile, and its lease is good.
                    with self._join_lock:
                        if self.lease is used:
                            self.lease = None
                if exc.code() == grpc.StatusCode.UNAVAILABLE and not tls_problem:
                    self._follow(exc, tried[0])
                raise

        def retryable(exc: BaseException) -> bool:
            return self._retryable(describe, exc, tls_problem, tried[0])

        def report(n: int, delay: float, exc: BaseException) -> None:
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            log.info("%s failed (%s); retry %d in %.1fs", describe, detail, n + 1, delay)
            if self.on_retry:
                self.on_retry(describe, n, delay, exc)

        try:
            return retry(
                attempt,
                self.backoff,
                retryable,
                describe=f"{describe} to {self.address}",
                on_retry=report,
            )
        except grpc.RpcError as exc:
            if tls_problem:
                raise TlsRefused(exc.code(), tls_problem[0].message) from exc
            raise CoordinatorError(exc.code(), f"{describe}: {exc.details()}") from exc

    def _retryable(
        self, describe: str, exc: BaseException, tls_problem: list[TlsProblem], address: str
    ) -> bool:
        # A chunk that fails its checks was damaged in flight or the stream broke: resend.
        # DATA_LOSS: the coordinator found the update damaged in flight and dropped it.
        # RESOURCE_EXHAUSTED: its disk is full or this site has too many calls open; both
        # pass (a full job refusing a join does not, and says so).
        code = _code(exc)
        if code == grpc.StatusCode.UNAVAILABLE and self._permanent_tls(exc, tls_problem, address):
            return False
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return describe != "join"
        return isinstance(exc, ChunkError) or code in TRANSIENT | {
            grpc.StatusCode.ABORTED,
            grpc.StatusCode.DATA_LOSS,
        }

    def _permanent_tls(self, exc: grpc.RpcError, found: list[TlsProblem], address: str) -> bool:
        """Whether an UNAVAILABLE is a TLS problem no retry fixes (appended to ``found``).

        Only failures that hint at TLS are probed, and, until the first join, closed sockets
        too: that is how gRPC reports a coordinator refusing this site's certificate."""
        details = exc.details() or ""
        closed = self.join_reply is None and "socket closed" in details.lower()
        if self.tls is None or not (looks_like_tls(details) or closed):
            return False
        problem = diagnose(address, self.tls)
        if problem is not None:
            found.append(problem)
        return problem is not None

    # ---- membership -----------------------------------------------------------------------

    def _ensure_joined(self) -> None:
        """Join if no lease is held; of several threads finding none, one joins."""
        with self._join_lock:
            if self.lease is None and not self.joins:
                raise CoordinatorError(None, "no lease: node 0 of the site has not passed one on")
            if self.lease is None:
                self._join_once()

    def _join_once(self) -> pb.JoinReply:
        reply = self.stub.Join(
            pb.JoinRequest(
                site=self.site,
                capabilities=pb.Capabilities(
                    codecs=["none"], world_size=self.world_size, num_examples=self.num_examples
                ),
            ),
            timeout=self.rpc_timeout_s,
        )
        self.lease, self.join_reply = reply.lease, reply
        self.transfer = transfer_from_toml(reply.job_config)
        self._route_shards(reply)
        log.info(
            "joined as %s (token %d) at round %d", self.site, reply.lease.token, reply.round.round
        )
        return reply

    def _route_shards(self, reply: pb.JoinReply) -> None:
        """Routes to the shards a join names (kept while the map stays the same)."""
        if len(reply.shards.addresses) < 2:
            self.shards = None
        elif self.shards is None or self.shards.addresses != list(reply.shards.addresses):
            own = lambda a: open_channel(a, self.tls, own_connection=True)  # noqa: E731
            self.shards = ShardRoutes(self, reply.shards, own)
        self.theta.sharded = self.shards is not None

    def join(self) -> pb.JoinReply:
        self.left = False
        return self.call("join", self._join_once)

    def heartbeat(
        self, progress: pb.Progress | None = None, health: pb.HealthReport | None = None
    ) -> pb.HeartbeatReply:
        return self.call(
            "heartbeat",
            lambda: self.control.Heartbeat(
                pb.HeartbeatRequest(lease=self.lease, progress=progress, health=health),
                timeout=self.rpc_timeout_s,
            ),
        )

    def leave(self, reason: str = "") -> None:
        self.left = True
        if self.lease is None:
            return
        try:
            self.stub.Leave(
                pb.LeaveRequest(lease=self.lease, reason=reason), timeout=self.rpc_timeout_s
            )
        except grpc.RpcError as exc:
            log.info("leave: %s (ignored)", exc.details())
        self.lease = None

    def status(self) -> pb.StatusReply:
        return self.call(
            "status", lambda: self.stub.Status(pb.StatusRequest(), timeout=self.rpc_timeout_s)
        )

    def wait_round(self, known: pb.RoundInfo | None, timeout_s: float) -> pb.WaitRoundReply:
        """Block (up to ``timeout_s``) until what this site should do differs from ``known``."""

        def ask() -> pb.WaitRoundReply:
            req = pb.WaitRoundRequest(lease=self.lease, timeout_s=timeout_s)
            if known is not None:
                req.known.CopyFrom(known)
            return self.control.WaitRound(req, timeout=timeout_s + self.rpc_timeout_s)

        return self.call("wait round", ask)

    # ---- theta and updates ----------------------------------------------------------------

    def fetch(
        self, version: int | None = None, held: GlobalState | None = None, dest: Path | None = None
    ) -> GlobalState:
        """theta (the current version, or ``version``), whole or as the delta from ``held``;
        into a safetensors file at ``dest`` if given (see ``site_client.transfer.theta``);
        from every shard of a sharded job (``site_client.transfer.sharded``)."""
        if self.shards is not None:
            return self.shards.fetch(version, dest)
        return self.theta.fetch(version, held, dest)

    def push(
        self,
        round_number: int,
        delta: dict[str, torch.Tensor] | UpdatePayload,
        *,
        weight: float = 1.0,
        base_version: int | None = None,
        upload_id: str | None = None,
        data_unit: str = "",
        compression: CompressionConfig | None = None,
        codec_state: CodecState | None = None,
        abort: Callable[[], bool] | None = None,
        hold: threading.Event | None = None,
        part: SitePart | None = None,
    ) -> pb.PushReply:
        """Send a pseudo-gradient for ``round_number``; resumes from the acknowledged offset.

        ``delta`` is a built payload (``site_client.agent.update_payload``) or a dict of whole
        tensors, encoded here by the codec ``compression`` picks for each (error feedback kept
        in ``codec_state``; encoded once: retries resend the same bytes). An update the
        coordinator already counted (e.g. sent again after a coordinator restart) is reported
        as delivered. See ``site_client.transfer.push`` for ``abort``, ``hold`` and ``part``
        (this host's bytes of a multi-node site's, a ``SitePart``).

        Raises
        ------
        PushAborted
            ``abort()`` became true: the stream ended early; what arrived stays uncounted.
        CoordinatorError
            Refused for good. With ``data_unit``, ``ALREADY_EXISTS`` means another copy of
            the unit won: this update did not count.
        """
        if not isinstance(delta, UpdatePayload):
            delta = encoded(delta, compression, codec_state)
        self.last_push_bytes = delta.total_bytes
        digests, receipts = [], []
        if self.shards is not None:  # the other shards' parts first: their receipts go along
            upload_id = upload_id or new_upload_id(round_number)
            delta, digests, receipts = self.shards.push(
                round_number, delta, upload_id, weight, part
            )
        push = UpdatePush(
            self,
            round_number,
            delta,
            weight=weight,
            base_version=round_number if base_version is None else base_version,
            data_unit=data_unit,
            upload_id=upload_id,
            abort=abort,
            hold=hold,
            part=part,
            shard_digests=digests,
            shard_receipts=receipts,
        )
        try:
            return push.run()
        finally:
            self.last_push_held_s = push.held_s

    def _lost_race(self, winner: str) -> bool:
        return lost_race(winner, self.site)

    def wait_for_round(
        self, after: int, progress: pb.Progress | None = None, poll_s: float = 0.2
    ) -> pb.RoundInfo:
        """Heartbeat until the coordinator opens a round later than ``after`` (or finishes);
        between heartbeats, a WaitRound call returns the moment the round changes."""
        while True:
            info = self.heartbeat(progress).round
            if info.finished or (info.round > after and info.participant):
                return info
            self.wait_round(info, timeout_s=poll_s)
