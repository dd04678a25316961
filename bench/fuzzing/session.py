"""The coordinator process under fuzzing and the fuzzer's hold on it: the process and its
channel (typed stubs and raw-byte calls), the two sites' leases, and the clean open round every
case starts from (``resync``), restored after a crash (``recover``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import coord_harness as harness
import grpc
import torch

from wire.net.grpc_options import channel_options
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.tensors import pack

from .cases import Case
from .constants import (
    CALL_TIMEOUT_S,
    KIND_LIST,
    MAX_UPDATE_BYTES,
    METHOD_PATH,
    REFRESH_S,
    SITE_A,
    SITE_B,
    TRAINABLE,
    TTL_S,
)
from .report import Report


def job_config() -> dict:
    return harness.job_config(
        name="fuzz",
        rounds={
            "total": 1_000_000,
            "inner_steps": 1,
            "min_sites": 1,
            "max_sites": 3,
            "join_window_s": 0.2,
            "deadline_s": 1e6,  # rounds close only on updates
        },
        timeouts={"heartbeat_interval_s": 1.0, "lease_ttl_s": TTL_S},
        server={"max_update_bytes": MAX_UPDATE_BYTES, "workers": 8},
    )


class Session:
    """One coordinator process, its channel and the fuzzer's two sites (``Fuzzer``'s state:
    its ``__init__`` is this one)."""

    def __init__(self, workdir: Path, seed: int, out: Callable[[str], None] = print) -> None:
        self.workdir = Path(workdir)
        self.out = out
        self.report = Report(seed=seed, workdir=self.workdir)
        self.leases: dict[str, pb.Lease] = {}
        self.refreshed: dict[str, float] = {}
        self.extras: dict[str, tuple[pb.Lease, float]] = {}
        self.baseline: tuple | None = None
        self.r = 0
        self.published: tuple[int, bytes, bytes] | None = None  # version, theta hash, payload
        self.coord: harness.CoordinatorProcess | None = None
        self.channel: grpc.Channel | None = None
        self.findings_file = None
        self.progress_every = 0
        self.started = time.monotonic()
        self.kind_list = KIND_LIST
        self.skip_known_bugs = False
        self.previous: Case | None = None

    # ---- process and channel ------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.findings_file = open(self.workdir / "findings.jsonl", "w")  # noqa: SIM115
        self.coord = harness.start_coordinator(self.workdir, job_config())
        self._connect()
        self.resync()

    def _connect(self) -> None:
        if self.channel is not None:
            self.channel.close()
        limits = ("grpc.max_send_message_length", "grpc.max_receive_message_length")
        options = [o for o in channel_options() if o[0] not in limits]
        options += [(name, -1) for name in limits]  # the fuzzer may send what no site would
        self.channel = grpc.insecure_channel(self.coord.address, options=options)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        if getattr(self, "attacker", None) is not None:
            self.attacker.close()
        # "held" cases: a connection of its own, as another certificate holder would have.
        self.attacker = grpc.insecure_channel(
            self.coord.address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        ch = self.channel
        self.raw_calls = {
            "Join": ch.unary_unary(
                METHOD_PATH + "Join", None, response_deserializer=pb.JoinReply.FromString
            ),
            "Heartbeat": ch.unary_unary(
                METHOD_PATH + "Heartbeat", None, response_deserializer=pb.HeartbeatReply.FromString
            ),
            "Leave": ch.unary_unary(
                METHOD_PATH + "Leave", None, response_deserializer=pb.LeaveReply.FromString
            ),
            "Status": ch.unary_unary(
                METHOD_PATH + "Status", None, response_deserializer=pb.StatusReply.FromString
            ),
            "Fetch": ch.unary_stream(
                METHOD_PATH + "Fetch", None, response_deserializer=pb.FetchMessage.FromString
            ),
            "Push": ch.stream_unary(
                METHOD_PATH + "Push", None, response_deserializer=pb.PushReply.FromString
            ),
        }

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.attacker.close()
        if self.coord is not None:
            t0 = time.monotonic()
            self.coord.stop()
            self.report.stop_s = time.monotonic() - t0
            rc = self.coord.proc.returncode if self.coord.proc else None
            if rc == -9:
                self.report.crashes += 1
                self.report.log_tracebacks.append(
                    "the coordinator did not exit within 10 s of SIGTERM and was killed (hang)"
                )
            elif rc not in (0, 143, None):  # 143: stopped by the SIGTERM sent here, cleanly
                self.report.crashes += 1
                self.report.log_tracebacks.append(f"coordinator exited with status {rc}")
        if self.findings_file is not None:
            self.findings_file.close()
        self.scan_log()

    def scan_log(self) -> None:
        """Count tracebacks in the coordinator's log, except grpc's own log of a request that
        does not decode (the raw-byte cases send those on purpose)."""
        try:
            lines = self.coord.log_path.read_text(errors="replace").splitlines()
        except (OSError, AttributeError):
            return
        for i, line in enumerate(lines):
            if not line.startswith("Traceback (most recent call last)"):
                continue
            before = lines[i - 1] if i else ""
            if "Exception deserializing message!" in before:
                continue
            block = lines[max(i - 1, 0) : i + 30]
            end = next((j for j in range(1, len(block)) if block[j][:1] not in (" ", "T")), 30)
            self.report.log_tracebacks.append("\n".join(block[: end + 1]))
            self.report.crashes += 1

    # ---- leases and the clean open round -------------------------------------------------------

    def _join(self, name: str) -> None:
        try:
            reply = self.stub.Join(pb.JoinRequest(site=name), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            self._leave_extras()  # the fuzz sites took the slot: make room
            reply = self.stub.Join(pb.JoinRequest(site=name), timeout=CALL_TIMEOUT_S)
        self.leases[name] = reply.lease
        self.refreshed[name] = time.monotonic()

    def _heartbeat(self, name: str) -> pb.HeartbeatReply | None:
        try:
            reply = self.stub.Heartbeat(
                pb.HeartbeatRequest(lease=self.leases[name]), timeout=CALL_TIMEOUT_S
            )
        except grpc.RpcError:
            self._join(name)
            reply = self.stub.Heartbeat(
                pb.HeartbeatRequest(lease=self.leases[name]), timeout=CALL_TIMEOUT_S
            )
        self.refreshed[name] = time.monotonic()
        return reply

    def _status(self) -> pb.StatusReply:
        reply = self.stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S)
        self.report.status_bytes_max = max(self.report.status_bytes_max, reply.ByteSize())
        return reply

    def ensure_leases(self, st_reply: pb.StatusReply) -> None:
        sites = {s.site: s for s in st_reply.sites}
        now = time.monotonic()
        for name in (SITE_A, SITE_B):
            s, lease = sites.get(name), self.leases.get(name)
            if lease is None or s is None or s.token != lease.token or s.lease_remaining_s < 3:
                self._join(name)
            elif now - self.refreshed.get(name, 0.0) > REFRESH_S:
                self._heartbeat(name)
        for name, (_, granted) in list(self.extras.items()):
            if now - granted > TTL_S + 3:  # certainly expired on the server by now
                del self.extras[name]

    def valid_leases(self) -> set[tuple[str, int]]:
        out = {(n, lease.token) for n, lease in self.leases.items()}
        return out | {(n, lease.token) for n, (lease, _) in self.extras.items()}

    def participant_leases(self) -> set[tuple[str, int]]:
        return {(n, lease.token) for n, lease in self.leases.items()}

    def _zero_push(self, name: str) -> None:
        d = {n: torch.zeros(shape) for n, shape in TRAINABLE.items()}
        manifest, payload = pack(d)
        header = pb.PushHeader(
            lease=self.leases[name],
            round=self.r,
            upload_id=f"resync-{time.monotonic_ns()}",
            manifest=manifest.to_proto(),
            weight=1.0,
            base_version=self.r,
        )
        msgs = [pb.PushMessage(header=header), pb.PushMessage(chunk=pb.Chunk(data=bytes(payload)))]
        # Refused when already delivered or not a participant: the caller looks again.
        with contextlib.suppress(grpc.RpcError):
            self.stub.Push(iter(msgs), timeout=CALL_TIMEOUT_S)

    def _leave_extras(self) -> None:
        for lease, _ in self.extras.values():
            with contextlib.suppress(grpc.RpcError):
                self.stub.Leave(pb.LeaveRequest(lease=lease), timeout=CALL_TIMEOUT_S)
        self.extras.clear()

    def resync(self) -> None:
        """Bring the job to an open round with both sites as participants and no update in."""
        self._leave_extras()
        deadline = time.monotonic() + 2 * TTL_S + 30
        while time.monotonic() < deadline:
            self.ensure_leases(self._status())
            part = {n: self._heartbeat(n).round for n in (SITE_A, SITE_B)}
            st_reply = self._status()
            self.r = st_reply.round.round
            if all(p.participant for p in part.values()) and st_reply.updates_received == 0:
                self.baseline = (st_reply.round.round, st_reply.round.theta_hash, 0)
                if self.published is None or self.published[0] != self.r:
                    self.published = self._fetch_theta()
                return
            pushed = False
            for name, info in part.items():
                if info.participant:
                    self._zero_push(name)
                    pushed = True
            time.sleep(0.05 if pushed else 0.1)
        raise RuntimeError("the fuzzer could not bring the job back to a clean open round")

    def _fetch_theta(self) -> tuple[int, bytes, bytes]:
        header, data = None, bytearray()
        request = pb.FetchRequest(lease=self.leases[SITE_A])
        for msg in self.stub.Fetch(request, timeout=CALL_TIMEOUT_S):
            if msg.HasField("header"):
                header = msg.header
            else:
                data += msg.chunk.data
        return header.version, bytes(header.theta_hash), bytes(data)

    def recover(self) -> None:
        """After the server died or stopped answering: restart it on its state and resync."""
        if self.coord.proc.poll() is None:
            try:
                self._status()
            except grpc.RpcError:
                self.coord.kill()
        if self.coord.proc.poll() is not None:
            self.coord.restart()
            self._connect()
            self.leases.clear()
        self.resync()
