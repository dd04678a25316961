"""Parallel fetch streams (``[transfer] streams = K``): a real coordinator over mutual TLS,
sites over K connections, a relay that cuts them mid-piece, an attacker with a valid
certificate asking for bad ranges, and a lying coordinator that answers two streams of one
fetch with two different headers."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from coord_harness import FAST_BACKOFF, CoordinatorProcess, job_config, wait_until, write_config

from bench.relay import Relay
from coordinator.service.call_gate import CallLimits
from site_client.transfer.client import CoordinatorClient, CoordinatorError
from site_client.transfer.overlap import Endgame
from site_client.transfer.progress import TransferProgress
from wire import bulk
from wire.digest import state_digest
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.tensors import pack
from wire.transfer import TransferConfig

pytestmark = pytest.mark.e2e

K = 4  # the coordinator's [transfer] streams
MB = 1 << 20
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = init_ca(root / "ca", "pfetch")
    issue(ca, "coordinator", "coordinator", root / "server", hosts=("127.0.0.1",))
    for name in ("site-a", "site-b"):
        issue(ca, "site", name, root / name)
    issue(ca, "operator", "ops", root / "ops")
    return root


@pytest.fixture(scope="module")
def coord(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pfetch-coord")
    cfg = job_config(
        name="pfetch",
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 2048, "d_out": 2048}},
        rounds={"total": 2, "min_sites": 1, "max_sites": 3, "join_window_s": 0.2},
        server={"concurrent_fetches": 16},
        transfer={"streams": K},
    )
    path = write_config(folder, cfg)
    path.write_text(path.read_text() + '\n[compression.downlink]\ndefault = "int8"\n')
    proc = CoordinatorProcess(
        path, folder / "state", folder / "coordinator.log", tls_dir=pki / "server"
    )
    proc.start()
    yield proc
    proc.stop()


def client(address: str, pki, site: str = "site-a") -> CoordinatorClient:
    """A site client with 1 MiB chunks: theta (16 MiB) is 16 of them."""
    tls = Bundle.load(pki / site)
    return CoordinatorClient(address, site, tls=tls, backoff=FAST_BACKOFF, chunk_bytes=MB)


@pytest.fixture(scope="module")
def site(coord, pki):
    """site-a, joined before round 0 opens: the round's one participant."""
    c = client(coord.address, pki)
    c.join()
    yield c
    c.leave("done")
    c.close()


def fetch_with(site: CoordinatorClient, streams: int, **kw):
    site.transfer = TransferConfig(streams=streams)
    before = site.bytes_received
    state = site.fetch(**kw)
    return state, site.bytes_received - before


def test_the_site_takes_k_from_the_job_config(site):
    c = CoordinatorClient(site.address, "x", tls=site.tls)
    assert site.transfer == TransferConfig(streams=K) and c.transfer.streams == 1
    c.close()


@pytest.mark.parametrize("streams", [2, K])
def test_k_streams_fetch_theta_bit_identical_to_one(site, tmp_path, streams):
    one, n1 = fetch_with(site, 1, dest=tmp_path / "one.safetensors")
    progress: list[TransferProgress] = []
    site.theta.new_progress = lambda: progress.append(TransferProgress(tty=False)) or progress[-1]
    try:
        many, nk = fetch_with(site, streams, dest=tmp_path / "many.safetensors")
        in_memory, _ = fetch_with(site, streams)
    finally:
        site.theta.new_progress = TransferProgress
    assert many.version == one.version and many.theta_hash == one.theta_hash
    assert (tmp_path / "many.safetensors").read_bytes() == (
        tmp_path / "one.safetensors"
    ).read_bytes()
    assert state_digest(in_memory.theta) == one.theta_hash
    for name, tensor in one.theta.items():
        assert torch.equal(in_memory.theta[name], tensor)
    total = one.file.manifest.total_bytes
    # Every byte once (and the first stream's first byte, which told the size), but for the
    # rest of a piece a stream took over from one lagging behind at the end (each at most
    # once: site_client.transfer.overlap), which a busy machine may make of any stream here.
    assert n1 == total and total + 1 <= nk <= total + 1 + streams * MB
    assert progress[0].snapshot().done >= total and progress[0].started_at is None


def test_a_stream_cut_mid_piece_resumes_at_its_byte(coord, pki, site, tmp_path, monkeypatch):
    # No endgame here: a stream taking over the rest of a piece from one slowed by the cut
    # races it for a chunk by design (the K-stream test bounds that), which would hide
    # whether the cut piece resumed at its byte.
    monkeypatch.setattr(Endgame, "take_over", lambda self, idle: None)
    want, total = fetch_with(site, 1, dest=tmp_path / "theta.safetensors")
    with Relay(target=("127.0.0.1", coord.port), rate_bps=32e6) as relay:
        # 4 MiB pieces, which the coordinator sends as two 2 MiB chunks each.
        c = CoordinatorClient(
            relay.address, "site-b", tls=Bundle.load(pki / "site-b"), backoff=FAST_BACKOFF
        )
        c.chunk_bytes = PIECE = 4 * MB
        cut: dict = {}
        c.theta.new_progress = lambda: _CutMidPiece(c, relay, PIECE, cut)
        try:
            c.join()
            c.transfer = TransferConfig(streams=2)
            got = c.fetch()
        finally:
            c.leave("done")
            c.close()
    # Cut while one piece held one of its two chunks (the fetch's first byte aside).
    assert (cut["received"] - 1) % PIECE == PIECE // 2 and cut["received"] < total, cut
    assert relay.counters().connections > cut["connections"]  # the streams dialled again
    assert got.theta_hash == want.theta_hash and state_digest(got.theta) == want.theta_hash
    # That piece resumed at its next byte: nothing was received twice.
    assert c.bytes_received == total + 1


class _CutMidPiece(TransferProgress):
    """Cuts every connection (for 0.3 s) the moment one piece is half received: from the
    stream's own thread as it counts the chunk, so two streams in lockstep cannot hide it."""

    def __init__(self, c: CoordinatorClient, relay: Relay, piece: int, out: dict) -> None:
        super().__init__(tty=False)
        self.c, self.relay, self.piece, self.out = c, relay, piece, out

    def advance(self, nbytes: int) -> None:
        super().advance(nbytes)
        received = self.c.bytes_received
        if not self.out and received % self.piece == self.piece // 2 + 1:
            self.out.update(received=received, connections=self.relay.counters().connections)
            self.relay.cut(0.3)


# ---- what a certificate holder may ask for -------------------------------------------------


def operator_status(coord, pki) -> pb.StatusReply:
    channel = open_channel(coord.address, Bundle.load(pki / "ops"), own_connection=True)
    try:
        return pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=10)
    finally:
        channel.close()


def ranged(site: CoordinatorClient, offset: int, length: int | None, **kw) -> pb.FetchRequest:
    req = pb.FetchRequest(lease=site.lease, offset=offset, **kw)
    if length is not None:
        req.length = length
    return req


def test_bad_ranges_are_refused_and_change_nothing(coord, pki, site, tmp_path):
    theta, total = fetch_with(site, 1, dest=tmp_path / "theta.safetensors")
    stub = bulk.BulkStub(open_channel(coord.address, Bundle.load(pki / "site-a"), True))
    before = operator_status(coord, pki)
    cases = [
        (total, 1, "runs past the end"),
        (total - 1, 2, "runs past the end"),
        (0, total + 1, "runs past the end"),
        (0, 0, "length 0"),
        (total, 0, "length 0"),
        (1, 2**64 - 1, "runs past the end"),  # offset + length overflows 64 bits
        (2**64 - 1, 1, "outside the"),
        (total + 1, None, "outside the"),
    ]
    for offset, length, words in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Fetch(ranged(site, offset, length), timeout=10))
        assert err.value.code() == INVALID, (offset, length, err.value)
        assert words in err.value.details() and f"{total}-byte payload" in err.value.details()
    after = operator_status(coord, pki)
    assert (after.round.round, after.round.theta_hash) == (
        before.round.round,
        before.round.theta_hash,
    )
    assert after.wan_bytes_out == before.wan_bytes_out  # not a byte was sent for them
    # A good range is answered with exactly those bytes.
    frames = list(stub.Fetch(ranged(site, total - 5000, 4000), timeout=10))
    chunks = [bulk.parse_chunk(f) for f in frames[1:]]
    assert [o for o, _ in chunks] == [total - 5000]
    data = theta.file.payload()[total - 5000 : total - 1000]
    assert bytes(chunks[0][1]) == bytes(data)


def test_a_site_is_sent_k_streams_at_once_and_refused_more(coord, pki, site):
    # Each certificate may hold 2 K fetch calls (K streams and their retries), and be sent
    # at most K of them at once: its share of the send slots (coordinator.service.send_slots).
    limit = CallLimits.for_transfer(TransferConfig(streams=K)).fetch
    assert limit == 2 * K and CallLimits.for_transfer(TransferConfig()).fetch == 2
    stub = bulk.BulkStub(open_channel(coord.address, Bundle.load(pki / "site-a"), True))
    held = [stub.Fetch(ranged(site, 0, None), timeout=30) for _ in range(K)]
    try:
        for call in held:  # each stream is sent its header, then held by flow control
            pb.FetchHeader.FromString(next(call))
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Fetch(ranged(site, 0, 1), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"already has {K} fetch stream(s) being sent, its share" in err.value.details()
    finally:
        for call in held:
            call.cancel()

    def answered() -> bool:
        try:
            return len(list(stub.Fetch(ranged(site, 0, 1), timeout=10))) == 2
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
            return False

    wait_until(answered, timeout=10, what="the held streams to be let go")


def test_a_delta_comes_over_k_streams_too(coord, pki, site):
    held, whole = fetch_with(site, 1)
    assert held.version == 0
    step = {n: torch.full_like(held.theta[n], 1e-3) for n in ("lin.weight", "lin.bias")}
    assert site.push(0, step, base_version=0).complete
    site.wait_for_round(0, poll_s=0.05)
    one, n1 = fetch_with(site, 1, held=held)
    many, nk = fetch_with(site, 2, held=held)
    assert one.version == many.version == 1 and n1 < whole // 3  # int8: a delta came
    # The 1-byte probe, and at most one chunk again: on a loaded machine the idle stream may
    # take over the end of the other's piece (the endgame), as test_node_fetch allows too.
    assert nk - (n1 + 1) in (0, site.chunk_bytes), (nk, n1)
    assert many.theta_hash == one.theta_hash == state_digest(many.theta)
    for name, tensor in one.theta.items():
        assert torch.equal(many.theta[name], tensor)
    # Ranges are checked against the payload served, the delta, not theta.
    stub = bulk.BulkStub(open_channel(coord.address, Bundle.load(pki / "site-a"), True))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Fetch(ranged(site, 0, n1 + 1, from_version=0), timeout=10))
    assert err.value.code() == INVALID and f"the {n1}-byte payload" in err.value.details()


# ---- a coordinator that lies, or breaks a stream where told ---------------------------------


class ScriptedCoordinator:
    """Join and ``Bulk/Fetch`` over real gRPC on loopback, serving a 4 MiB payload in 256 KiB
    chunks under the header ``header_for(self, request)`` picks (None: NOT_FOUND); the
    stream of the piece starting at ``break_at`` breaks once after its first chunk."""

    SERVED_CHUNK = 256 << 10

    def __init__(
        self, header_for, break_at: int | None = None, stall_at: int | None = None
    ) -> None:
        self.theta = {"w": (torch.arange(4 * MB) % 251).to(torch.uint8)}
        self.manifest, payload = pack(self.theta)
        self.payload, self.theta_hash = bytes(payload), state_digest(self.theta)
        self.header_for, self.break_at = header_for, break_at
        self.stall_at, self.stalled = stall_at, threading.Event()  # until cancelled
        self.requests: list[pb.FetchRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        join = grpc.unary_unary_rpc_method_handler(
            self._join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString
        )
        fetch = grpc.unary_stream_rpc_method_handler(self._fetch, pb.FetchRequest.FromString)
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler("isthmus.v1.Coordinator", {"Join": join}),
                grpc.method_handlers_generic_handler(bulk.SERVICE, {"Fetch": fetch}),
            )
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def header(self, version: int = 5, manifest=None, **fields) -> pb.FetchHeader:
        h = pb.FetchHeader(version=version, **{"theta_hash": self.theta_hash, **fields})
        h.manifest.CopyFrom(manifest if manifest is not None else self.manifest.to_proto())
        return h

    def _join(self, request, context) -> pb.JoinReply:
        return pb.JoinReply(
            lease=pb.Lease(site=request.site, token=1),
            round=pb.RoundInfo(),
            job_config=b"[transfer]\nstreams = 2\n",
        )

    def _fetch(self, request, context):
        self.requests.append(request)
        header = self.header_for(self, request)
        if header is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"version {request.version} is not served")
        yield header.SerializeToString()
        if request.offset == self.stall_at and request.length > 1:
            self.stall_at = None  # the first stream of that piece only: it sends nothing more
            for _ in range(600):
                if not context.is_active():
                    self.stalled.set()  # the site cancelled it
                    return
                time.sleep(0.05)
            return
        end = request.offset + request.length if request.HasField("length") else len(self.payload)
        for offset in range(request.offset, end, self.SERVED_CHUNK):
            yield bulk.chunk_frame(
                offset, self.payload[offset : min(offset + self.SERVED_CHUNK, end)]
            )
            if offset == self.break_at:
                self.break_at = None
                context.abort(grpc.StatusCode.UNAVAILABLE, "the link broke")

    def site(self) -> CoordinatorClient:
        c = CoordinatorClient(self.address, "site-a", backoff=FAST_BACKOFF, chunk_bytes=MB)
        c.join()
        assert c.transfer.streams == 2
        return c

    def stop(self) -> None:
        self.server.stop(grace=None)


OTHER_MANIFEST = pack({"w": torch.zeros(4 * MB, dtype=torch.uint8)})[0].to_proto()


def _probe(request: pb.FetchRequest) -> bool:
    return request.offset == 0 and request.length == 1


@pytest.mark.parametrize(
    "lie, words",
    [
        ({"theta_hash": b"\x01" * 32}, "theta hash 010101010101, the first stream's"),
        ({"version": 6}, "version 6, the first stream's 5"),
        ({"from_version": 4}, "delta base 4, the first stream's theta whole"),
        ({"manifest": OTHER_MANIFEST}, "another manifest (payload digest"),
    ],
)
def test_streams_answered_with_different_headers_are_refused(lie, words):
    fake = ScriptedCoordinator(lambda s, r: s.header() if _probe(r) else s.header(**lie))
    try:
        c = fake.site()
        with pytest.raises(CoordinatorError, match="answered streams of one fetch differently"):
            c.fetch()
        with pytest.raises(CoordinatorError) as err:
            c.fetch()
        assert words in str(err.value)
        c.close()
    finally:
        fake.stop()


def test_a_broken_piece_resumes_at_its_next_byte_and_a_replaced_version_starts_over():
    served = {"current": 5}

    def header_for(fake, request):
        if request.HasField("version") and request.version != served["current"]:
            return None  # its round closed: NOT_FOUND
        header = fake.header(version=served["current"])
        if _probe(request) and not request.HasField("version") and served["current"] == 5:
            served["current"] = 6  # the coordinator moves on as soon as v5's header left
        return header

    fake = ScriptedCoordinator(header_for, break_at=2 * MB)
    try:
        c = fake.site()
        got = c.fetch()
        assert got.version == 6 and torch.equal(got.theta["w"], fake.theta["w"])
        ranges = [(r.version, r.offset, r.length) for r in fake.requests if not _probe(r)]
        resumed = [r for r in ranges if r[0] == 6 and r[1] == 2 * MB + fake.SERVED_CHUNK]
        # Resumed at its next byte; the other stream, done with every other piece while this
        # one waited out its backoff, may have taken the same rest over
        # (site_client.transfer.overlap), or, when it did before the broken stream's bytes
        # were counted, the whole piece from where that stream stood (its start).
        rest = (6, 2 * MB + fake.SERVED_CHUNK, MB - fake.SERVED_CHUNK)
        taken_over = ranges.count((6, 2 * MB, MB)) == 2
        assert resumed in ([rest], [rest, rest]) or (resumed == [] and taken_over), repr(ranges)
        assert any(r[0] == 5 for r in ranges)  # pieces of v5 were refused, then v6 fetched
        with pytest.raises(CoordinatorError) as err:
            c.fetch(version=5)  # asked for by number: gone is gone
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        c.close()
    finally:
        fake.stop()


def test_a_stalled_piece_is_fetched_again_by_an_idle_stream_and_the_stall_cancelled():
    # One stream is sent its piece's header and nothing more (a connection that lost its
    # window): once the other stream has every other piece, it fetches that piece too, and
    # the stalled call is cancelled (site_client.transfer.overlap).
    fake = ScriptedCoordinator(lambda s, r: s.header(), stall_at=0)
    try:
        c = fake.site()
        got = c.fetch()
        assert torch.equal(got.theta["w"], fake.theta["w"])
        assert got.theta_hash == fake.theta_hash
        assert fake.stalled.wait(10)
        firsts = [r for r in fake.requests if r.offset == 0 and not _probe(r)]
        assert len(firsts) == 2 and firsts[0].length == firsts[1].length, fake.requests
        c.close()
    finally:
        fake.stop()
