"""A node of a multi-node site fetches only the bytes of theta its trainers hold
(``site_client.transfer.node``): against a real coordinator over mutual TLS, the boxes land
bit for bit as a whole fetch has them, in whole blocks each checked against its digest, and a box
that is not theta's is refused before anything is fetched."""

from __future__ import annotations

import pytest
import torch
from test_parallel_push import client, coord, pki

from site_client.errors import CoordinatorError
from site_client.transfer.node import Box, byte_span, fetch_boxes, ranges_for
from site_client.transfer.plan import split_ranges
from wire.safetensors_io import map_tensors
from wire.tensors import Manifest, PayloadError, TensorEntry
from wire.transfer import Piece

__all__ = ["coord", "pki"]  # the coordinator and PKI fixtures, shared with the K-stream push
MB = 1 << 20


def manifest(*shapes: tuple[int, ...]) -> Manifest:
    entries, at = [], 0
    for i, shape in enumerate(shapes):
        n = 4 * torch.Size(shape).numel()
        entries.append(TensorEntry(f"t{i}", "float32", shape, at, n))
        at += n
    return Manifest(tuple(entries), at, b"\0" * 32)


def test_a_shard_of_rows_is_exactly_its_bytes_and_a_box_of_columns_spans_its_rows():
    m = manifest((8, 4), (16,))
    assert byte_span(m, Box("t0", (2, 0), (3, 4))) == (32, 80)  # rows 2..4: 3 rows of 16 bytes
    assert byte_span(m, Box("t0", (0, 1), (2, 2))) == (4, 28)  # columns 1..2 of rows 0..1
    assert byte_span(m, Box("t1", (4,), (0,))) is None  # an empty shard needs nothing
    # Rounded out to whole blocks of 64 bytes and merged.
    got = ranges_for(m, [Box("t0", (2, 0), (1, 4)), Box("t1", (0,), (2,))], 64)
    assert [(p.offset, p.end) for p in got] == [(0, 64), (128, 192)]


def test_ranges_are_cut_at_whole_blocks_for_k_streams_and_kept_whole_for_one():
    ranges = [Piece(0, 64), Piece(128, 64 * 40)]
    assert split_ranges(ranges, 64, 1) == ranges
    pieces = split_ranges(ranges, 64, 2)  # 41 blocks, about 8 pieces per stream: 3 blocks each
    assert all(p.offset % 64 == 0 and 0 < p.length <= 3 * 64 for p in pieces)
    assert pieces[0] == Piece(0, 64) and pieces[1] == Piece(128, 3 * 64)
    assert sum(p.length for p in pieces) == sum(r.length for r in ranges)
    assert pieces[-1].end == ranges[-1].end


@pytest.mark.parametrize(
    "box,words",
    [
        (Box("nope", (0,), (1,)), "no tensor 'nope'"),
        (Box("t0", (0,), (1,)), "has 1 dims, the tensor 2"),
        (Box("t0", (7, 0), (2, 4)), "lies outside"),
        (Box("t0", (-1, 0), (1, 4)), "lies outside"),
    ],
)
def test_a_box_that_is_not_thetas_is_refused(box, words):
    with pytest.raises(PayloadError, match=words):
        ranges_for(manifest((8, 4)), [box], 64)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_node_fetches_only_its_trainers_rows_bit_for_bit(coord, pki, tmp_path, streams):
    c = client(coord.address, pki, streams)
    whole = c.fetch(dest=tmp_path / "whole.safetensors")
    w = whole.theta["lin.weight"]  # (1024, 2048) float32: 8 MiB
    mine = [Box("lin.weight", (512, 0), (512, 2048)), Box("lin.bias", (0,), (1024,))]
    got = fetch_boxes(c, whole.version, whole.theta_hash.hex(), mine, tmp_path / "part.safetensors")
    # Its rows, in whole blocks, not the other half (and over K streams, at most a block more
    # per stream: one that took over the end of another's piece).
    assert 4 * MB <= got <= 4 * MB + 2 * MB + (streams - 1) * MB
    part = map_tensors(tmp_path / "part.safetensors").tensors
    assert torch.equal(part["lin.weight"][512:], w[512:])
    assert torch.equal(part["lin.bias"], whole.theta["lin.bias"])
    # The first block (lin.bias, then lin.weight's first rows) was fetched for the bias; the
    # rows after it and before 512 were not, and no trainer of this host reads them.
    assert part["lin.weight"][:64].any() and not part["lin.weight"][128:511].any()
    everything = fetch_boxes(c, whole.version, whole.theta_hash.hex(), None, tmp_path / "all.st")
    size = len(map_tensors(tmp_path / "whole.safetensors").payload())
    # Every byte, and over K streams at most a block more per stream, as above (a stream that
    # took over the end of another's piece: seen once in a clean clone's run on 2 busy cores).
    assert size <= everything <= size + (streams - 1) * MB
    assert torch.equal(map_tensors(tmp_path / "all.st").tensors["lin.weight"], w)
    c.close()


def test_a_theta_other_than_node_0s_is_refused(coord, pki, tmp_path):
    c = client(coord.address, pki, 1)
    whole = c.fetch()
    with pytest.raises(CoordinatorError, match="not the one node 0 was given"):
        fetch_boxes(c, whole.version, "00" * 32, [], tmp_path / "x.safetensors")
    c.close()


def test_a_file_fetched_for_some_boxes_is_never_handed_out_for_others(coord, pki, tmp_path):
    """After a restart the rendezvous may place other ranks on this host: the agent fetches
    their boxes into a file of their own, and theta whole when asked for it."""
    from site_client.agent.node_agent import NodeAgent
    from site_client.agent.node_encoding import lease_json
    from site_client.agent.state import AgentConfig

    c = client(coord.address, pki, 1)
    whole = c.fetch()
    cfg = AgentConfig("site-a", tmp_path / "run", tmp_path / "shm", nodes=2, node=1)
    agent = NodeAgent(cfg, c, 1)
    ask = {
        "version": whole.version,
        "theta_hash": whole.theta_hash.hex(),
        "lease": lease_json(c.lease),
    }
    try:
        second = [["lin.weight", [512, 0], [512, 2048]]]
        first = [["lin.weight", [0, 0], [512, 2048]]]
        a = agent.fetch({**ask, "boxes": second})["theta_path"]
        assert agent.fetch({**ask, "boxes": second})["theta_path"] == a  # the same ask: kept
        b = agent.fetch({**ask, "boxes": first})["theta_path"]
        assert b != a
        got = map_tensors(b).tensors["lin.weight"]
        assert torch.equal(got[:512], whole.theta["lin.weight"][:512])
        w = agent.fetch({**ask, "boxes": None})["theta_path"]
        assert w not in (a, b)
        assert torch.equal(map_tensors(w).tensors["lin.weight"], whole.theta["lin.weight"])
    finally:
        agent.stop()
        c.close()
