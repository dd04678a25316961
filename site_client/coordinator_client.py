"""The site's connection to the coordinator: join, heartbeat, fetch theta, push an update.

Every call retries transient failures (coordinator down or restarting, network cut) with
exponential backoff and full jitter up to the policy's deadline, re-joins when its lease was
fenced out (after a coordinator restart, or after it lapsed), and resumes transfers from the
last acknowledged byte instead of starting them again.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterator

import grpc
import torch

from site_client.errors import CoordinatorError, PushAborted
from site_client.theta_fetch import GlobalState, ThetaDownlink
from wire.backoff import BackoffPolicy, retry
from wire.channel import open_channel
from wire.chunking import DEFAULT_CHUNK_BYTES, ChunkError, iter_chunks
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.identity import Bundle
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.tensors import pack, pack_encoded

# Re-exported: callers import the whole client API from this module.
__all__ = ["CoordinatorClient", "CoordinatorError", "GlobalState", "PushAborted"]

log = logging.getLogger("isthmus.site")
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def _code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None


class CoordinatorClient(ThetaDownlink):
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
    ) -> None:
        """``tls`` is the site's bundle (mutual TLS); ``None`` means plaintext (insecure)."""
        self.address = address
        self.site = site
        self.backoff = backoff or BackoffPolicy()
        self.num_examples = num_examples
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.rpc_timeout_s = rpc_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.on_retry = on_retry
        self.channel = open_channel(address, tls)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        # Heartbeats on their own connection: behind a multi-megabyte push on a slow link they
        # would wait for the push and the lease would lapse while the site is busy sending.
        self.control_channel = open_channel(address, tls, own_connection=True)
        self.control = pb_grpc.CoordinatorStub(self.control_channel)
        self.lease: pb.Lease | None = None
        self.join_reply: pb.JoinReply | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.delta_mismatches = 0

    def close(self) -> None:
        self.channel.close()
        self.control_channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- retry plumbing -------------------------------------------------------------------

    def _call(self, describe: str, fn: Callable[[], object]):
        """Run ``fn`` with backoff on transient errors; re-join when the lease was fenced."""

        def attempt():
            if self.lease is None and describe not in ("join", "status"):
                self._join_once()
            try:
                return fn()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED and describe != "join":
                    log.warning("%s: %s; re-joining", describe, exc.details())
                    self.lease = None
                raise

        def retryable(exc: BaseException) -> bool:
            # A chunk that fails its checks was damaged in flight or the stream broke: resend.
            # DATA_LOSS: the coordinator found the update damaged in flight and dropped it.
            return isinstance(exc, ChunkError) or _code(exc) in TRANSIENT | {
                grpc.StatusCode.ABORTED,
                grpc.StatusCode.DATA_LOSS,
            }

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
            raise CoordinatorError(exc.code(), f"{describe}: {exc.details()}") from exc

    # ---- membership -----------------------------------------------------------------------

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
        log.info(
            "joined as %s (token %d) at round %d", self.site, reply.lease.token, reply.round.round
        )
        return reply

    def join(self) -> pb.JoinReply:
        return self._call("join", self._join_once)

    def heartbeat(self, progress: pb.Progress | None = None) -> pb.HeartbeatReply:
        return self._call(
            "heartbeat",
            lambda: self.control.Heartbeat(
                pb.HeartbeatRequest(lease=self.lease, progress=progress),
                timeout=self.rpc_timeout_s,
            ),
        )

    def leave(self, reason: str = "") -> None:
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
        return self._call(
            "status", lambda: self.stub.Status(pb.StatusRequest(), timeout=self.rpc_timeout_s)
        )

    # ---- updates --------------------------------------------------------------------------

    def push(
        self,
        round_number: int,
        delta: dict[str, torch.Tensor],
        *,
        weight: float = 1.0,
        base_version: int | None = None,
        upload_id: str | None = None,
        data_unit: str = "",
        compression: CompressionConfig | None = None,
        codec_state: CodecState | None = None,
        abort: Callable[[], bool] | None = None,
    ) -> pb.PushReply:
        """Send a pseudo-gradient for ``round_number``; resumes from the acknowledged offset.

        With ``compression`` each tensor is encoded by the codec its rules pick, error
        feedback kept in ``codec_state`` (encoded once: retries resend the same bytes). An
        update the coordinator already counted (e.g. sent again after a coordinator restart)
        is reported as delivered.

        Raises
        ------
        PushAborted
            ``abort()`` became true (it is read between chunks): the stream was ended early,
            and what arrived stays uncounted.
        CoordinatorError
            Refused for good. With ``data_unit``, ``ALREADY_EXISTS`` whose message says
            "committed by" means another copy of the unit won: this update did not count.
        """
        if compression is None:
            manifest, payload = pack(delta)
        else:
            manifest, payload = pack_encoded(delta, compression, codec_state or CodecState())
        self.last_push_bytes = len(payload)
        upload_id = upload_id or f"r{round_number}-{uuid.uuid4().hex[:16]}"
        base = round_number if base_version is None else base_version
        progress = {"acked": 0, "tries": 0}

        def header() -> pb.PushMessage:
            return pb.PushMessage(
                header=pb.PushHeader(
                    lease=self.lease,
                    round=round_number,
                    upload_id=upload_id,
                    data_unit=data_unit,
                    manifest=manifest.to_proto(),
                    weight=weight,
                    base_version=base,
                )
            )

        def messages(start: int) -> Iterator[pb.PushMessage]:
            yield header()
            for offset, data in iter_chunks(payload, self.chunk_bytes, start=start):
                if abort is not None and abort():
                    return  # a short stream is left uncounted by the coordinator
                yield pb.PushMessage(chunk=pb.Chunk(offset=offset, data=bytes(data)))
                self.bytes_sent += len(data)

        def attempt() -> pb.PushReply:
            if abort is not None and abort():
                raise PushAborted(f"push of round {round_number} {data_unit}: withdrawn")
            if progress["tries"]:
                probe = self.stub.Push(iter([header()]), timeout=self.rpc_timeout_s)
                if probe.complete:  # every byte had arrived: the header alone completed it
                    return probe
                progress["acked"] = probe.acked_offset
            progress["tries"] += 1
            reply = self.stub.Push(messages(progress["acked"]), timeout=self.transfer_timeout_s)
            if not reply.complete:
                if abort is not None and abort():
                    raise PushAborted(f"push of round {round_number} {data_unit}: withdrawn")
                progress["acked"] = reply.acked_offset
                raise ChunkError(f"push incomplete: {reply.message}")
            return reply

        try:
            return self._call("push", attempt)
        except CoordinatorError as exc:
            if exc.code == grpc.StatusCode.ALREADY_EXISTS:
                if data_unit and self._lost_race(str(exc)):
                    raise  # another copy of the unit won the race: ours did not count
                return pb.PushReply(complete=True, message=f"already counted: {exc}")
            raise

    def _lost_race(self, message: str) -> bool:
        """Whether a refused unit was "committed by" another site. After a coordinator
        restart this site's own earlier commit is replayed, and a resent copy is refused
        naming this site: that one did count."""
        winner = re.search(r"committed by ([\w.-]+)", message)
        return winner is not None and winner.group(1) != self.site

    def wait_for_round(
        self,
        after: int,
        progress: pb.Progress | None = None,
        poll_s: float = 0.2,
        sleep: Callable[[float], None] | None = None,
    ) -> pb.RoundInfo:
        """Heartbeat until the coordinator opens a round later than ``after`` (or finishes)."""
        import time

        sleep = sleep or time.sleep
        while True:
            info = self.heartbeat(progress).round
            if info.finished or (info.round > after and info.participant):
                return info
            sleep(poll_s)
