"""Parallel transfers, the parts without a network: the ``[transfer]`` table, pieces, ranges,
the checks a site makes on every stream of a parallel fetch, and the coordinator's bookkeeping
of an upload sent in pieces (``wire/transfer.py``, ``site_client/transfer/plan.py``,
``site_client/transfer/movers.py``, ``coordinator/intake/upload_bytes.py``)."""

from __future__ import annotations

import pytest
from test_config import VALID, _error, _write

from coordinator.config import load_config
from coordinator.intake.receive_slots import ReceiveSlots
from coordinator.intake.upload_bytes import UploadBytes, chunk_refusal
from coordinator.intake.uploads import stream_clash
from site_client.transfer.movers import header_problem
from site_client.transfer.plan import PieceQueue, chunk_problem
from wire.chunking import MAX_CHUNK_BYTES, ChunkError
from wire.config_table import ConfigError
from wire.digest import payload_digest
from wire.proto import isthmus_pb2 as pb
from wire.transfer import (
    MIN_CHUNKS_PER_STREAM,
    PIECES_PER_STREAM,
    Piece,
    ReceivedRanges,
    TransferConfig,
    plan_pieces,
    range_problem,
    transfer_from_job,
    transfer_from_toml,
)

MB = 1 << 20


@pytest.mark.parametrize("total", [8 * MB, 64 * MB, 64 * MB + 17, 1000 * MB + 3, 33 * MB - 1])
@pytest.mark.parametrize("streams", [2, 3, 4, 8])
def test_pieces_are_whole_chunks_covering_the_payload_once(total, streams):
    pieces = plan_pieces(total, 2 * MB, streams)
    assert pieces[0].offset == 0 and pieces[-1].end == total
    assert all(a.end == b.offset for a, b in zip(pieces, pieces[1:], strict=False))
    assert all(p.offset % (2 * MB) == 0 and p.length > 0 for p in pieces)
    chunks = -(-total // (2 * MB))
    parallel = chunks >= MIN_CHUNKS_PER_STREAM * streams
    assert len(pieces) == (min(chunks, PIECES_PER_STREAM * streams) if parallel else 1)
    sizes = {p.length for p in pieces[:-1]} or {total}
    assert max(sizes) - min(sizes) <= 2 * MB  # even, to a chunk


def test_a_small_payload_or_one_stream_is_one_piece_and_nothing_is_none():
    assert plan_pieces(5 * MB, 2 * MB, 2) == [Piece(0, 5 * MB)]  # 3 chunks
    assert plan_pieces(7 * MB, 2 * MB, 2)[-1] == Piece(6 * MB, MB)  # 4 chunks: 4 pieces
    assert plan_pieces(13 * MB, 2 * MB, 4) == [Piece(0, 13 * MB)]  # under 2 chunks a stream
    assert plan_pieces(64 * MB, 2 * MB, 1) == [Piece(0, 64 * MB)]
    assert plan_pieces(0, 2 * MB, 4) == []


@pytest.mark.parametrize(
    "offset, length, words",
    [
        (0, None, None),
        (100, None, None),  # the empty tail: allowed, as a resumed stream's end
        (0, 100, None),
        (99, 1, None),
        (101, None, "offset 101 outside the 100-byte payload"),
        (0, 0, "at least one byte of the 100-byte payload"),
        (50, 51, "range [50, 50 + 51) runs past the end of the 100-byte payload"),
        (100, 1, "runs past the end"),
        (1, 2**64 - 1, "runs past the end"),  # would wrap around in 64 bits
        (2**64 - 1, 1, "outside the"),
    ],
)
def test_range_rules(offset, length, words):
    problem = range_problem(offset, length, 100)
    assert problem is None if words is None else words in problem


def _header(**over) -> pb.FetchHeader:
    fields = {"version": 3, "theta_hash": b"\x07" * 32, **over}
    h = pb.FetchHeader(**fields)
    h.manifest.total_bytes, h.manifest.digest = 10 * MB, b"\x09" * 32
    return h


def test_a_header_must_equal_the_first_streams():
    first = _header()
    assert header_problem(first, _header()) is None
    assert "version 4" in header_problem(first, _header(version=4))
    assert "theta hash 080808" in header_problem(first, _header(theta_hash=b"\x08" * 32))
    assert "delta base 2" in header_problem(first, _header(from_version=2))
    assert "theta whole" in header_problem(_header(from_version=2), first)
    assert "delta base 1" in header_problem(_header(from_version=2), _header(from_version=1))
    other = _header()
    other.manifest.digest = b"\x0a" * 32
    assert "another manifest" in header_problem(first, other)
    other = _header()
    other.manifest.tensors.add(name="w", dtype="float32")
    assert "another manifest" in header_problem(first, other)


def test_chunks_must_come_in_order_inside_their_piece():
    piece = Piece(4 * MB, 4 * MB)
    assert chunk_problem(piece, 4 * MB, 4 * MB, 2 * MB) is None
    assert chunk_problem(piece, 6 * MB, 6 * MB, 2 * MB) is None
    assert "out-of-order" in chunk_problem(piece, 4 * MB, 6 * MB, 2 * MB)  # one missing
    assert "out-of-order" in chunk_problem(piece, 6 * MB, 4 * MB, 2 * MB)  # a duplicate
    assert "runs past the piece" in chunk_problem(piece, 6 * MB, 6 * MB, 2 * MB + 1)
    assert "empty chunk" in chunk_problem(piece, 4 * MB, 4 * MB, 0)
    assert "exceeds" in chunk_problem(Piece(0, 8 * MB), 0, 0, MAX_CHUNK_BYTES + 1)


def test_the_queue_hands_each_piece_once_in_order_until_stopped():
    queue = PieceQueue([Piece(0, 1), Piece(1, 1), Piece(2, 1)])
    assert queue.take() == Piece(0, 1) and queue.take() == Piece(1, 1)
    queue.stop()
    assert queue.take() is None and queue.stopped.is_set()


# ---- the [transfer] table ------------------------------------------------------------------


def test_transfer_defaults_to_one_stream_and_reads_k(tmp_path):
    assert load_config(_write(tmp_path, VALID)).transfer == TransferConfig(streams=1)
    cfg = load_config(_write(tmp_path, VALID + "\n[transfer]\nstreams = 8\n"))
    assert cfg.transfer.streams == 8
    assert transfer_from_toml(b"[transfer]\nstreams = 3\n") == TransferConfig(3)
    assert transfer_from_toml(b"") == TransferConfig()
    kept = transfer_from_toml(b"[transfer]\nkeep_connections = true\n")
    assert kept.keep_connections and not TransferConfig().keep_connections


@pytest.mark.parametrize(
    "table, words",
    [
        ("streams = 0", "transfer.streams: must be in [1, 8], got 0"),
        ("streams = 9", "transfer.streams: must be in [1, 8], got 9"),
        ("streams = -1", "must be in [1, 8]"),
        ("streams = 2.0", "transfer.streams: expected an integer"),
        ("streams = true", "transfer.streams: expected an integer, got a boolean"),
        ('streams = "4"', "transfer.streams: expected an integer"),
        ("stream = 4", "transfer.stream: unknown key"),
        ("keep_connections = 1", "transfer.keep_connections: expected"),
        ('keep_connections = "yes"', "transfer.keep_connections: expected"),
    ],
)
def test_bad_transfer_tables_are_refused_at_load(tmp_path, table, words):
    assert words in _error(tmp_path, VALID + f"\n[transfer]\n{table}\n")
    with pytest.raises(ConfigError, match="transfer"):
        transfer_from_toml(f"[transfer]\n{table}\n".encode())


def test_a_transfer_that_is_not_a_table_or_not_toml_is_refused(tmp_path):
    assert "transfer: expected a table" in _error(tmp_path, "transfer = 4\n" + VALID)
    with pytest.raises(ConfigError, match="transfer: expected a table"):
        transfer_from_job({"transfer": [4]})
    with pytest.raises(ConfigError, match="not valid TOML"):
        transfer_from_toml(b"[transfer\nstreams = 2")


# ---- the coordinator's side of an upload in pieces -----------------------------------------


def test_received_ranges_merge_and_say_where_a_piece_goes_on():
    r = ReceivedRanges([(10, 20), (0, 5), (5, 8), (30, 40)])
    assert r.spans == [(0, 8), (10, 20), (30, 40)] and r.covered() == 28
    r.add(8, 10)
    assert r.spans == [(0, 20), (30, 40)]
    assert r.run_end(0) == 20 and r.run_end(19) == 20 and r.run_end(20) == 20
    assert r.run_end(25) == 25 and r.next_start(20) == 30 and r.next_start(41) is None
    assert r.resume_at(Piece(30, 5)) == 35 and r.resume_at(Piece(20, 10)) == 20
    r.add(15, 35)
    assert r.spans == [(0, 40)] and r.covers(40) and not r.covers(41)
    assert ReceivedRanges().covers(0)


def test_streams_of_one_upload_carry_disjoint_pieces():
    a, b = Piece(0, 10), Piece(10, 10)
    assert stream_clash([], None, "u") is None and stream_clash([a], b, "u") is None
    assert "overlaps piece [0, 10)" in stream_clash([a], Piece(5, 10), "u")
    assert "another stream" in stream_clash([a], None, "u")  # the whole payload: alone
    assert "another stream" in stream_clash([None], a, "u")


@pytest.mark.parametrize(
    "piece, offset, size, words",
    [
        (None, 20, 4, None),  # the whole payload goes on at 20
        (None, 24, 4, "out-of-order chunk: offset 24, next expected offset 20"),
        (None, 16, 4, "duplicated chunk: offset 16"),
        (None, 20, 11, "duplicated chunk: bytes from offset 30"),
        (Piece(20, 5), 20, 5, None),
        (Piece(20, 5), 20, 6, "runs past its piece [20, 25)"),
        (Piece(40, 10), 40, 4, None),
        (Piece(40, 10), 44, 4, "out-of-order chunk"),
        (None, 20, 81, "runs past the declared 100-byte payload"),
        (Piece(0, 30), 20, 4, None),  # resumes where its received run ends
        (Piece(0, 100), 20, 0, "empty chunk"),
        (None, 20, MAX_CHUNK_BYTES + 1, "exceeds"),
    ],
)
def test_a_chunk_must_be_the_next_its_stream_owes(piece, offset, size, words):
    ranges = ReceivedRanges([(0, 20), (30, 40)])
    problem = chunk_refusal(ranges, piece, 100, offset, size)
    assert problem is None if words is None else words in problem, problem


def test_the_range_log_drops_a_torn_record_and_survives_a_restart(tmp_path):
    path = tmp_path / "s+u.part"
    b = UploadBytes(path, 30, payload_digest(bytes(range(30))))
    b.add(Piece(10, 10), 10, bytes(range(10, 20)))
    b.add(None, 0, bytes(range(5)))
    b.close()
    with open(path.with_suffix(".ranges"), "ab") as f:
        f.write(b"\x01\x02\x03")  # a record torn by the crash
    again = UploadBytes(path, 30, b.expected_digest)
    assert again.spans() == [(0, 5), (10, 20)] and again.received == 5
    assert again.resume_at(Piece(10, 10)) == 20 and again.resume_at(Piece(20, 10)) == 20
    with pytest.raises(ChunkError, match="truncated payload: 15 of 30"):
        again.finish()
    again.add(None, 5, bytes(range(5, 10)))
    again.add(Piece(20, 10), 20, bytes(range(20, 30)))
    assert again.complete and again.hashed == 10  # what came out of order is read back
    again.finish()
    assert path.read_bytes() == bytes(range(30))
    again.close()


def test_a_range_log_from_another_payload_starts_the_upload_again(tmp_path):
    path = tmp_path / "s+u.part"
    b = UploadBytes(path, 64, b"\x00" * 32)
    b.add(None, 0, bytes(64))
    b.close()
    again = UploadBytes(path, 32, b"\x00" * 32)  # the same id, a shorter manifest
    assert again.spans() == [] and again.received == 0 and path.stat().st_size == 0
    again.close()


def test_the_streams_of_one_upload_share_its_receive_slot():
    slots = ReceiveSlots(1)
    for _ in range(4):
        slots.enter(("site-a", "u1"))
    assert slots.counts() == (1, 0) and slots.peak == 1
    assert not slots.reserve(("site-b", "u2"), 0, wait_s=0.05)
    for _ in range(4):
        slots.leave(("site-a", "u1"))
    assert slots.reserve(("site-b", "u2"), 0, wait_s=0.05)


def test_a_range_log_claiming_more_than_its_file_holds_starts_again(tmp_path):
    path = tmp_path / "s+u.part"
    b = UploadBytes(path, 64, b"\x00" * 32)
    b.add(Piece(32, 32), 32, bytes(32))
    b.close()
    path.write_bytes(bytes(40))  # cut short behind the coordinator's back
    again = UploadBytes(path, 64, b"\x00" * 32)
    assert again.spans() == [] and again.resume_at(Piece(32, 32)) == 32
    again.close()


def test_a_streams_chunks_grow_one_record_of_the_range_log(tmp_path):
    path = tmp_path / "s+u.part"
    data = bytes(range(256)) * 4
    b = UploadBytes(path, len(data), payload_digest(data))
    for offset in range(0, 512, 8):  # one stream, tiny chunks
        b.add(None, offset, data[offset : offset + 8])
    for offset in range(768, 1024, 4):  # another, on a piece of its own
        b.add(Piece(768, 256), offset, data[offset : offset + 4])
    b.close()
    assert path.with_suffix(".ranges").stat().st_size == 2 * 16  # a record per stream
    again = UploadBytes(path, len(data), b.expected_digest)
    assert again.spans() == [(0, 512), (768, 1024)]
    again.add(Piece(512, 256), 512, data[512:768])
    again.finish()
    again.close()
