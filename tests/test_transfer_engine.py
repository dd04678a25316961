"""The one transfer engine (``site_client/transfer/engine.py``): its pure decisions, the sink
that hashes a payload once, and pieces routed to two endpoints, each over that endpoint's own
connections (what a sharded coordinator's K shards would be), over real gRPC on loopback."""

from __future__ import annotations

import grpc
import pytest
import torch
from coord_harness import FAST_BACKOFF
from test_parallel_fetch import ScriptedCoordinator, _probe
from test_parallel_push import ScriptedReceiver

from site_client.agent.update_payload import payload_of
from site_client.errors import CoordinatorError
from site_client.transfer.client import CoordinatorClient
from site_client.transfer.engine import Tally, Transfer
from site_client.transfer.movers import FetchMover, PushMover
from site_client.transfer.plan import Endpoint, RoutedPiece, ack_problem, next_call_delay, routed
from site_client.transfer.progress import TransferProgress
from site_client.transfer.push import UpdatePush
from site_client.transfer.theta import HashingSink
from wire.bulk import BulkStub
from wire.chunking import BufferSink
from wire.digest import payload_digest
from wire.net.channel import open_channel
from wire.tensors import pack
from wire.transfer import Piece, ReceivedRanges, plan_pieces

MB = 1 << 20


def test_a_push_stream_asks_for_its_next_piece_only_once_its_own_is_handed_over():
    assert next_call_delay(MB, 2 * MB, None) is None  # a push: not while bytes remain
    assert next_call_delay(0, None, None) == 0.0  # all handed: now, rate or not
    assert next_call_delay(4 * MB, 2 * MB, 0.5) == pytest.approx(1.5)  # a fetch: a lead ahead
    assert next_call_delay(MB, None, 0.5) is None


def test_a_receivers_offset_outside_the_piece_is_not_believed():
    piece = Piece(4 * MB, 2 * MB)
    assert ack_problem(piece, 4 * MB) is None and ack_problem(piece, 6 * MB) is None
    assert "outside the piece [4194304, 6291456)" in ack_problem(piece, 6 * MB + 1)
    assert "outside" in ack_problem(piece, 0)


def test_a_piece_keeps_its_endpoint_and_a_stream_its_connection_there():
    a, b = Endpoint("a", ("a0", "a1")), Endpoint("b", ("b0",))
    pieces = routed([Piece(0, MB)], a) + routed([Piece(MB, MB)], b)
    assert pieces == [RoutedPiece(0, MB, a), RoutedPiece(MB, MB, b)]
    assert [p.endpoint.stub(1) for p in pieces] == ["a1", "b0"]  # fewer connections: wraps


def _chunks(payload: bytes, pieces):
    return [(o, payload[o : o + MB]) for p in pieces for o in range(p.offset, p.end, MB)]


def test_the_payload_is_hashed_once_as_it_lands_in_order_and_again_only_after_a_rewrite():
    payload = bytes(range(256)) * (4 * MB // 256)
    sha = payload_digest(payload)
    sink = HashingSink(BufferSink(len(payload)), sha)
    later, first = [Piece(2 * MB, 2 * MB)], [Piece(0, 2 * MB)]
    for offset, data in _chunks(payload, later) + _chunks(payload, first):  # out of order
        sink.write_at(offset, data)
    sink.check()  # the first half hashed as it landed, the rest read back from the sink
    raced = HashingSink(BufferSink(len(payload)), sha)
    for offset, data in _chunks(payload, first + later):
        raced.write_at(offset, data)
    raced.write_at(MB, b"\x00" * MB)  # a racing stream writes a hashed chunk again, other bytes
    with pytest.raises(CoordinatorError, match="digest mismatch"):
        raced.check()


def _stubs(address: str, n: int) -> tuple:
    return tuple(BulkStub(open_channel(address, None, own_connection=True)) for _ in range(n))


def test_pieces_fetched_from_two_endpoints_each_come_over_that_endpoints_connections():
    a, b = (ScriptedCoordinator(lambda s, r: s.header()) for _ in range(2))
    try:
        c = a.site()
        total, half = len(a.payload), len(a.payload) // 2
        low = Endpoint("shard-a", _stubs(a.address, 2))
        high = Endpoint("shard-b", _stubs(b.address, 2))
        upper = [Piece(half + p.offset, p.length) for p in plan_pieces(total - half, MB, 2)]
        pieces = routed(plan_pieces(half, MB, 2), low) + routed(upper, high)
        sink = BufferSink(total)
        tally = Tally(c, TransferProgress(tty=False), sent=False)
        Transfer(c, FetchMover(c, a.header(), sink), tally, streams=2).run(pieces)
        assert bytes(sink.buffer) == a.payload and tally.total >= total
        assert a.requests and all(r.offset + r.length <= half for r in a.requests)
        assert b.requests and all(r.offset >= half for r in b.requests)
        c.close()
    finally:
        a.stop()
        b.stop()


def test_pieces_pushed_to_two_endpoints_each_land_at_that_endpoint_only():
    payload = payload_of(*pack({"w": torch.arange(1 << 20, dtype=torch.float32)}))  # 4 MiB
    total, half = payload.total_bytes, payload.total_bytes // 2
    a, b = ScriptedReceiver(total, break_at=-1), ScriptedReceiver(total, break_at=-1)
    c = CoordinatorClient(a.address, "site-a", backoff=FAST_BACKOFF, chunk_bytes=256 << 10)
    try:
        c.join()
        push = UpdatePush(c, 0, payload, weight=1.0, base_version=0, data_unit="")
        low = Endpoint("shard-a", _stubs(a.address, 2))
        high = Endpoint("shard-b", _stubs(b.address, 2))
        pieces = routed([Piece(0, half)], low) + routed([Piece(half, total - half)], high)
        mover = PushMover(push, ReceivedRanges(), whole=False)
        Transfer(c, mover, push.tally, streams=2).run(pieces)
    finally:
        c.close()
        a.server.stop(grace=None)
        b.server.stop(grace=None)
    sent = bytes(payload.segments[0][1])
    assert a.have.spans == [(0, half)] and bytes(a.data[:half]) == sent[:half]
    assert b.have.spans == [(half, total)] and bytes(b.data[half:]) == sent[half:]
    assert c.bytes_sent == total


def test_a_refused_piece_stops_every_stream_and_the_error_comes_back():
    def lie(fake, request):
        # The second half's pieces come back as another version: refused, not stitched.
        version = 5 if request.offset < len(fake.payload) // 2 else 6
        return fake.header(version=version)

    fake = ScriptedCoordinator(lie)
    try:
        c = fake.site()
        total = len(fake.payload)
        endpoint = Endpoint("coordinator", _stubs(fake.address, 2))
        sink = BufferSink(total)
        tally = Tally(c, TransferProgress(tty=False), sent=False)
        mover = FetchMover(c, fake.header(), sink)
        with pytest.raises(CoordinatorError, match="version 6, the first stream's 5") as err:
            Transfer(c, mover, tally, 2).run(routed(plan_pieces(total, MB, 2), endpoint))
        assert err.value.code != grpc.StatusCode.NOT_FOUND  # refused, not "gone"
        c.close()
    finally:
        fake.stop()


def test_a_version_made_again_under_a_k_stream_fetch_starts_it_over():
    probes = []

    def header_for(fake, request):
        if _probe(request):
            probes.append(request)
            if len(probes) == 1:  # the version as it was before a restart made it again
                return fake.header(theta_hash=b"\x01" * 32)
        return fake.header()

    fake = ScriptedCoordinator(header_for)
    try:
        c = fake.site()
        got = c.fetch()
        assert len(probes) == 2 and got.theta_hash == fake.theta_hash
        assert torch.equal(got.theta["w"], fake.theta["w"])
        c.close()
    finally:
        fake.stop()
