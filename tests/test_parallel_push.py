"""Parallel push streams (``[transfer] streams = K``): a real coordinator over mutual TLS, a
site pushing its update in pieces over K connections (one receive slot for them all), a relay
that cuts them, a certificate holder sending bad pieces, and a coordinator killed with -9 in
the middle of an upload sent in pieces, which resumes every piece where it stood."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import torch
from coord_harness import (
    FAST_BACKOFF,
    TRAINABLE,
    CoordinatorProcess,
    job_config,
    scrape_metrics,
    wait_until,
    write_config,
)

from bench.relay import Relay
from site_client.agent.update_payload import payload_of
from site_client.transfer.client import CoordinatorClient
from wire import bulk
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.tensors import pack
from wire.transfer import Piece, ReceivedRanges, TransferConfig, plan_pieces

pytestmark = pytest.mark.e2e

K = 4
MB = 1 << 20
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = init_ca(root / "ca", "ppush")
    issue(ca, "coordinator", "coordinator", root / "server", hosts=("127.0.0.1",))
    issue(ca, "site", "site-a", root / "site-a")
    issue(ca, "operator", "ops", root / "ops")
    return root


@pytest.fixture(scope="module")
def coord(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppush-coord")
    cfg = job_config(
        name="ppush",
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 2048, "d_out": 1024}},
        rounds={"total": 4, "min_sites": 1, "max_sites": 2, "join_window_s": 0.2},
        server={"concurrent_uploads": 1},
        transfer={"streams": K},
    )
    proc = CoordinatorProcess(
        write_config(folder, cfg),
        folder / "state",
        folder / "coordinator.log",
        tls_dir=pki / "server",
        extra_args=("--metrics", "127.0.0.1:0"),
    )
    proc.start()
    yield proc
    proc.stop()


def client(address: str, pki, streams: int, chunk_bytes: int = MB) -> CoordinatorClient:
    tls = Bundle.load(pki / "site-a")
    c = CoordinatorClient(address, "site-a", tls=tls, backoff=FAST_BACKOFF, chunk_bytes=chunk_bytes)
    c.join()
    c.wait_for_round(-1, poll_s=0.05)  # round 0 opens once the join window has passed
    c.transfer = TransferConfig(streams=streams)
    return c


def status(coord, pki) -> pb.StatusReply:
    channel = open_channel(coord.address, Bundle.load(pki / "ops"), own_connection=True)
    try:
        return pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=10)
    finally:
        channel.close()


def standing(coord, pki) -> tuple[int, int]:
    """(open round, updates counted in it): what a refused push must leave as it was."""
    reply = status(coord, pki)
    return reply.round.round, reply.updates_received


SHAPES = {"lin.weight": (1024, 2048), "lin.bias": (1024,)}  # 8 MiB and 4 KiB: 9 chunks of 1 MiB


def update(seed: int):
    g = torch.Generator().manual_seed(seed)
    delta = {n: 1e-3 * torch.randn(SHAPES[n], generator=g) for n in TRAINABLE}
    return delta, payload_of(*pack(delta))


def payload_bytes(payload) -> bytes:
    return b"".join(bytes(d) for _, d in payload.chunks(0, 4 * MB))


def assert_stepped(before, after, delta) -> None:
    """FedAvg of one update of weight 1: theta_{r+1} = theta_r - delta, bit for bit, only if
    every byte of the update arrived as sent."""
    assert after.version == before.version + 1
    for name, tensor in before.theta.items():
        want = tensor - delta[name] if name in delta else tensor
        assert torch.equal(after.theta[name], want), name


def test_k_streams_push_an_update_that_lands_bit_identical(coord, pki):
    c = client(coord.address, pki, K)
    try:
        theta = c.fetch()
        delta, payload = update(0)
        assert payload.total_bytes > 8 * MB  # 9 chunks of 1 MiB: 9 pieces over 4 streams
        reply = c.push(0, payload, base_version=theta.version)
        assert reply.complete, reply
        c.wait_for_round(0, poll_s=0.05)
        assert_stepped(theta, c.fetch(), delta)
    finally:
        c.close()
    # The K streams shared the upload's one receive slot (server.concurrent_uploads = 1).
    metrics = scrape_metrics((coord.state_dir / "metrics_address").read_text().strip())
    assert metrics[("isthmus_uploads_receiving_peak", ())] == 1


def test_pieces_cut_off_by_the_link_resume_and_count_once(coord, pki):
    direct = client(coord.address, pki, K)
    theta = direct.fetch()
    with Relay(target=("127.0.0.1", coord.port), rate_bps=16e6) as relay:
        # 256 KiB chunks: pieces of two or three, so that the cut leaves pieces half sent.
        c = client(relay.address, pki, 2, chunk_bytes=256 << 10)
        try:
            delta, payload = update(1)
            cut: dict = {}
            watcher = threading.Thread(target=_cut_at, args=(c, relay, payload.total_bytes, cut))
            watcher.start()
            reply = c.push(1, payload, base_version=1)
            watcher.join(10)
        finally:
            c.close()
    assert reply.complete, reply
    assert cut["sent"] < payload.total_bytes and relay.counters().connections > cut["dialled"]
    direct.wait_for_round(1, poll_s=0.05)  # counted: the round closed on it
    assert_stepped(theta, direct.fetch(), delta)  # once, and whole
    direct.close()


def _cut_at(c: CoordinatorClient, relay: Relay, total: int, out: dict) -> None:
    wait_until(lambda: c.bytes_sent >= total // 3, timeout=30, what="a third of the update")
    out.update(sent=c.bytes_sent, dialled=relay.counters().connections)
    relay.cut(0.3)


# ---- a certificate holder's pieces, and a coordinator restart in the middle -----------------


class RawPusher:
    """site-a's pushes of one upload, message by message, on its own connection."""

    def __init__(self, coord, pki, round_number: int, payload, upload_id: str) -> None:
        self.channel = open_channel(coord.address, Bundle.load(pki / "site-a"), True)
        self.stub = bulk.BulkStub(self.channel)
        self.lease = (
            pb_grpc.CoordinatorStub(self.channel)
            .Join(pb.JoinRequest(site="site-a"), timeout=10)
            .lease
        )
        self.round, self.payload, self.upload_id = round_number, payload, upload_id
        self.data = payload_bytes(payload)

    def header(self, piece=None, reserve=False, manifest=None) -> bytes:
        h = pb.PushHeader(
            lease=self.lease,
            round=self.round,
            upload_id=self.upload_id,
            manifest=manifest or self.payload.manifest.to_proto(),
            weight=1.0,
            base_version=self.round,
            reserve=reserve,
        )
        if piece is not None:
            h.piece.offset, h.piece.length = piece
        return pb.PushMessage(header=h).SerializeToString()

    def push(self, piece=None, chunks=(), reserve=False, manifest=None) -> pb.PushReply:
        frames = [self.header(piece, reserve, manifest)]
        frames += [bulk.chunk_frame(o, self.data[o : o + n]) for o, n in chunks]
        return self.stub.Push(iter(frames), timeout=30)

    def close(self) -> None:
        self.channel.close()


def _refused(call, code, words: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code and words in err.value.details(), err.value


def test_bad_pieces_are_refused_and_change_nothing(coord, pki):
    c = client(coord.address, pki, 1)  # the round the module's other tests left open
    r = c.fetch().version
    c.close()
    _, payload = update(2)
    raw = RawPusher(coord, pki, r, payload, "bad-pieces")
    before = standing(coord, pki)
    total = payload.total_bytes
    try:
        assert raw.push(reserve=True).granted
        assert raw.push((0, 4 * MB), [(0, MB)]).acked_offset == MB
        _refused(lambda: raw.push((total - 10, 20)), INVALID, "runs past the end of the")
        _refused(lambda: raw.push((MB, 0)), INVALID, "length 0")
        _refused(lambda: raw.push((0, 4 * MB), reserve=True), INVALID, "reservation")
        _refused(lambda: raw.push((2 * MB, MB), [(2 * MB, 2 * MB)]), INVALID, "runs past its piece")
        _refused(lambda: raw.push((3 * MB, MB), [(3 * MB + 4, 8)]), INVALID, "out-of-order")
        _refused(lambda: raw.push((0, 4 * MB), [(0, MB)]), INVALID, "duplicated chunk")
        _refused(lambda: raw.push(None, [(0, MB)]), INVALID, "duplicated chunk")
        other = pack({"lin.weight": torch.zeros(2048, 2048)})[0].to_proto()  # not the model's
        _refused(lambda: raw.push((0, MB), manifest=other), INVALID, "bad update manifest")
        _, another = update(3)
        _refused(
            lambda: raw.push((0, MB), manifest=another.manifest.to_proto()),
            INVALID,
            "already used for another payload",
        )
        _overlapping_piece_is_busy(raw)
        # What stands after all that: the good chunks only (the first, the held stream's).
        reply = raw.push((0, 4 * MB))
        held = [(r.offset, r.length) for r in reply.received]
        assert reply.acked_offset == MB and held == [(0, MB), (4 * MB, MB)]
        assert standing(coord, pki) == before
    finally:
        raw.close()


def _overlapping_piece_is_busy(raw: RawPusher) -> None:
    """A piece overlapping one being received on another stream waits its turn (UNAVAILABLE)."""
    release = threading.Event()

    def held():
        yield raw.header((4 * MB, 3 * MB))
        yield bulk.chunk_frame(4 * MB, raw.data[4 * MB : 5 * MB])
        release.wait(10)

    call = raw.stub._push.future(held(), timeout=30)
    try:
        wait_until(lambda: _piece_at(raw, 5 * MB), timeout=10, what="the held piece's chunk")
        _refused(
            lambda: raw.push((6 * MB, 2 * MB)),
            grpc.StatusCode.UNAVAILABLE,
            "overlaps piece [4194304, 7340032)",
        )
    finally:
        release.set()
        call.cancel()


def _piece_at(raw: RawPusher, offset: int) -> bool:
    """Whether the coordinator holds bytes up to ``offset`` (asked on a piece of its own)."""
    reply = raw.push((7 * MB, MB))
    return any(r.offset + r.length == offset for r in reply.received)


def test_a_restarted_coordinator_resumes_every_piece_where_it_stood(coord, pki):
    c = client(coord.address, pki, 1)
    theta = c.fetch()
    c.close()
    r = theta.version
    delta, payload = update(4)
    total, half = payload.total_bytes, 4 * MB
    raw = RawPusher(coord, pki, r, payload, "across-a-restart")
    assert raw.push(reserve=True).granted
    assert raw.push((0, half), [(0, MB), (MB, MB)]).acked_offset == 2 * MB
    assert raw.push((half, total - half), [(half, MB)]).acked_offset == half + MB
    raw.close()
    coord.kill()
    coord.restart()
    raw = RawPusher(coord, pki, r, payload, "across-a-restart")
    try:
        reply = raw.push(reserve=True)
        assert [(x.offset, x.offset + x.length) for x in reply.received] == [
            (0, 2 * MB),
            (half, half + MB),
        ]
        assert raw.push((0, half)).acked_offset == 2 * MB  # where the piece stands
        rest = [(o, MB) for o in range(2 * MB, half, MB)]
        assert raw.push((0, half), rest).acked_offset == half
        rest = [(o, min(MB, total - o)) for o in range(half + MB, total, MB)]
        assert raw.push((half, total - half), rest).acked_offset == total
        assert raw.push(reserve=True).complete  # every byte in: verified, counted
    finally:
        raw.close()
    wait_until(lambda: status(coord, pki).round.round == r + 1, what="the round to close")
    c = client(coord.address, pki, K)
    assert_stepped(theta, c.fetch(), delta)
    c.close()


# ---- the site's side of a broken piece, against a scripted coordinator ----------------------


class ScriptedReceiver:
    """``Join`` and ``Bulk/Push`` over real gRPC on loopback: takes an upload in pieces, keeps
    what arrived, and breaks the stream of the piece at ``break_at`` once, after its first
    chunk; every stream's (piece, first chunk offset) is recorded."""

    def __init__(self, total: int, break_at: int) -> None:
        self.data, self.have = bytearray(total), ReceivedRanges()
        self.break_at, self.streams = break_at, []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        join = grpc.unary_unary_rpc_method_handler(
            self._join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString
        )
        push = grpc.stream_unary_rpc_method_handler(
            self._push, None, pb.PushReply.SerializeToString
        )
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler("isthmus.v1.Coordinator", {"Join": join}),
                grpc.method_handlers_generic_handler(bulk.SERVICE, {"Push": push}),
            )
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _join(self, request, context) -> pb.JoinReply:
        lease = pb.Lease(site=request.site, token=1)
        return pb.JoinReply(lease=lease, job_config=b"[transfer]\nstreams = 2\n")

    def _push(self, frames, context) -> pb.PushReply:
        h = pb.PushMessage.FromString(next(frames)).header
        if h.reserve:
            complete = self.have.covers(len(self.data))
            return pb.PushReply(complete=complete, granted=True)
        piece, first = Piece(h.piece.offset, h.piece.length), None
        for frame in frames:
            offset, data = bulk.parse_chunk(frame)
            assert offset == self.have.resume_at(piece), (offset, piece)
            first = offset if first is None else first
            self.data[offset : offset + len(data)] = data
            self.have.add(offset, offset + len(data))
            if piece.offset == self.break_at:
                self.break_at = None
                self.streams.append((piece.offset, first))
                context.abort(grpc.StatusCode.UNAVAILABLE, "the link broke")
        self.streams.append((piece.offset, first))
        return pb.PushReply(acked_offset=self.have.resume_at(piece))


def push_to(fake: ScriptedReceiver, payload, chunk: int) -> CoordinatorClient:
    """Push ``payload`` to ``fake`` in chunks of ``chunk`` bytes; it must arrive whole."""
    c = CoordinatorClient(fake.address, "site-a", backoff=FAST_BACKOFF, chunk_bytes=chunk)
    try:
        c.join()
        assert c.push(0, payload, base_version=0).complete
    finally:
        c.close()
        fake.server.stop(grace=None)
    assert bytes(fake.data) == payload_bytes(payload)
    return c


def test_a_broken_piece_asks_where_it_stands_and_resumes_there():
    chunk = 128 << 10
    payload = payload_of(*pack({"w": torch.arange(1 << 20, dtype=torch.float32)}))  # 4 MiB
    fake = ScriptedReceiver(payload.total_bytes, break_at=2 * MB)  # a piece of 2 chunks
    c = push_to(fake, payload, chunk)
    mine = [first for start, first in fake.streams if start == 2 * MB]
    # The stream broke after its first chunk; a header alone then asked where the piece
    # stood, and the next stream went on from its second chunk.
    assert mine == [2 * MB, None, 2 * MB + chunk], fake.streams
    # Sent once, give or take the chunk the break caught (counted once gRPC took it).
    assert abs(c.bytes_sent - payload.total_bytes) <= chunk


class HoldingReceiver(ScriptedReceiver):
    """Holds each piece's reply until the next piece's stream on the same connection has
    begun (or the payload is whole, or ``HOLD_S`` passed), and records whether it had: the
    site must not wait for a piece's reply before its stream goes on with the next one."""

    HOLD_S = 5.0

    def __init__(self, total: int) -> None:
        super().__init__(total, break_at=-1)
        self.cond = threading.Condition()
        self.begun: dict[str, int] = {}  # piece streams begun, per connection
        self.open_at_once = self.most_open = 0
        self.followed: list[bool] = []  # per piece reply: had the next stream begun?

    def _push(self, frames, context) -> pb.PushReply:
        peer = context.peer()
        with self.cond:
            mine = self.begun.get(peer, 0)
            self.begun[peer] = mine + 1
            self.open_at_once += 1
            self.most_open = max(self.most_open, self.open_at_once)
            self.cond.notify_all()
        try:
            reply = super()._push(frames, context)
            if not reply.granted and not reply.complete:  # a piece, not a reservation
                with self.cond:
                    self.cond.notify_all()  # the payload may be whole now

                    def followed() -> bool:
                        return self.begun[peer] > mine + 1

                    last = lambda: self.have.covers(len(self.data))  # noqa: E731
                    self.cond.wait_for(lambda: followed() or last(), self.HOLD_S)
                    self.followed.append(followed())
            return reply
        finally:
            with self.cond:
                self.open_at_once -= 1


def test_each_stream_sends_its_next_piece_while_the_last_ones_reply_is_on_its_way():
    chunk = 128 << 10
    payload = payload_of(*pack({"w": torch.arange(1 << 20, dtype=torch.float32)}))  # 4 MiB
    fake = HoldingReceiver(payload.total_bytes)
    push_to(fake, payload, chunk)
    pieces = len(plan_pieces(payload.total_bytes, chunk, 2))
    # Every piece but each stream's last was followed before its reply left; never more
    # than two pushes at once on a stream (the coordinator allows 2 K per site).
    assert len(fake.followed) == pieces and fake.followed.count(False) == 2, fake.followed
    assert fake.most_open <= 4


def test_kept_connections_carry_the_push_and_stay_open_for_the_next(coord, pki):
    c = client(coord.address, pki, K)
    c.transfer = TransferConfig(streams=K, keep_connections=True)
    opened: list = []
    c.upload_connection = lambda: opened.append(1)  # must not be asked for one
    try:
        theta = c.fetch()
        kept = c.streams.channels(c.address, K - 1)
        delta, payload = update(1)
        r = c.wait_for_round(-1, poll_s=0.05).round
        assert c.push(r, payload, base_version=theta.version).complete
        c.wait_for_round(r, poll_s=0.05)
        assert_stepped(theta, c.fetch(), delta)
        # The same extra connections as the fetch's, still open after the push.
        assert c.streams.channels(c.address, K - 1) == kept and len(kept) == K - 1
        assert not opened
    finally:
        c.close()
