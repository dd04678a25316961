"""An update in parts, one per host of a multi-node site (``wire.payload_parts``): the
manifest's rules, the site's layout, and a real coordinator over mutual TLS counting an update
once every part is in and verified, never before, and never one whose part was damaged."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch
from test_parallel_push import (
    RawPusher,
    assert_stepped,
    client,
    coord,
    pki,
    standing,
    status,
)

from site_client.agent.node_parts import NodePart, site_layout
from site_client.agent.update_payload import payload_of
from wire.digest import payload_digest
from wire.payload_parts import PayloadPart, parts_digest
from wire.tensors import ALIGN, Manifest, PayloadError, TensorEntry, validate_manifest

__all__ = ["coord", "pki"]  # the coordinator and PKI fixtures, shared with the K-stream push


def sha(data: bytes) -> bytes:
    return payload_digest(data)


def raw_part(node: int, pieces) -> tuple[NodePart, bytes]:
    """Node ``node``'s part of raw float32 ``pieces`` (name, box offset, whole shape, tensor),
    laid out as an agent lays out its trainers' shards."""
    entries, data = [], bytearray()
    for name, offset, whole, t in pieces:
        data += bytes(-len(data) % ALIGN)
        b = t.contiguous().numpy().tobytes()
        entries.append(
            TensorEntry(
                name, "float32", tuple(t.shape), len(data), len(b), "none", b"", whole, offset
            )
        )
        data += b
    padded = bytes(data) + bytes(-len(data) % ALIGN)
    return NodePart(node, tuple(entries), len(data), sha(bytes(data)), sha(padded)), bytes(data)


def two_parts(seed: int):
    """lin.weight's first rows from node 0, its last rows and lin.bias from node 1."""
    g = torch.Generator().manual_seed(seed)
    delta = {
        "lin.weight": 1e-3 * torch.randn(1024, 2048, generator=g),
        "lin.bias": torch.randn(1024, generator=g),
    }
    w, whole = delta["lin.weight"], (1024, 2048)
    p0, b0 = raw_part(0, [("lin.weight", (0, 0), whole, w[:600])])
    p1, b1 = raw_part(
        1, [("lin.bias", (), (), delta["lin.bias"]), ("lin.weight", (600, 0), whole, w[600:])]
    )
    manifest, ranges = site_layout([p1, p0])  # any order: laid out by node
    data = b0 + bytes(ranges[1][0] - len(b0)) + b1
    return delta, manifest, ranges, data


@pytest.mark.parametrize("empty", [0, 1, 2])
def test_a_node_with_nothing_to_hand_over_has_no_part(empty):
    """A host whose trainers hold no writer's piece (replicas) adds nothing to the layout."""
    rows = torch.arange(10, dtype=torch.float32).reshape(10, 1)
    parts = [
        raw_part(k, [] if k == empty else [("lin.weight", (10 * k, 0), (30, 1), rows)])[0]
        for k in range(3)
    ]
    manifest, ranges = site_layout(parts)
    assert len(manifest.parts) == 2 and ranges[empty][1] == 0
    assert sum(n for _, n in ranges) == manifest.total_bytes


# ---- the manifest's rules -------------------------------------------------------------------


def test_site_layout_tiles_the_payload_with_each_part_hashed_on_its_own():
    _, manifest, ranges, data = two_parts(0)
    a, b = manifest.parts
    assert (
        ranges == [(0, a.length), (a.end, b.length)]
        and a.end % ALIGN == 0
        and b.end == manifest.total_bytes == len(data)
    )
    assert a.digest == sha(data[: a.end]) and b.digest == sha(data[a.end :])
    assert manifest.digest == parts_digest(manifest.parts)
    assert Manifest.from_proto(manifest.to_proto()) == manifest


@pytest.mark.parametrize(
    "spoil,words",
    [
        (lambda ps: (replace(ps[0], offset=8), ps[1]), "must start at byte 0"),
        (lambda ps: (ps[0], replace(ps[1], offset=ps[1].offset + 64)), "must start at byte"),
        (lambda ps: (ps[0], replace(ps[1], length=ps[1].length - 4)), "the parts end at byte"),
        (lambda ps: (ps[0], replace(ps[1], digest=b"x" * 31)), "not 32"),
        (lambda ps: (ps[0], PayloadPart(ps[1].offset, 0, b"0" * 32), ps[1]), "none empty"),
        (
            lambda ps: (
                replace(ps[0], length=ps[0].length - 64),
                replace(ps[1], offset=ps[1].offset - 64, length=ps[1].length + 64),
            ),
            "crosses the end of part 0",
        ),
        (lambda ps: tuple(PayloadPart(0, 0, b"0" * 32) for _ in range(4097)), "limit 4096"),
    ],
    ids=["offset", "gap", "short", "digest-size", "empty", "entry-crosses", "too-many"],
)
def test_parts_that_do_not_describe_the_payload_are_refused(spoil, words):
    _, manifest, _, _ = two_parts(0)
    parts = spoil(manifest.parts)
    bad = replace(manifest, parts=parts, digest=parts_digest(parts))
    with pytest.raises(PayloadError, match=words):
        Manifest.from_proto(bad.to_proto())


def test_a_digest_that_is_not_the_parts_digest_is_refused():
    _, manifest, _, _ = two_parts(0)
    with pytest.raises(PayloadError, match="digest of its parts' digests"):
        validate_manifest(replace(manifest, digest=sha(b"something else")))


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"node": "x"},
        {"node": 0, "entries": "no", "length": 1, "digest": "", "padded_digest": ""},
        [],
    ],
)
def test_a_malformed_part_description_is_refused_in_one_line(value):
    with pytest.raises(PayloadError, match="part description is malformed"):
        NodePart.from_json(value)


def test_a_layout_must_have_one_part_per_node():
    _, manifest, _, _ = two_parts(0)
    p0, _ = raw_part(0, [("lin.bias", (), (), torch.zeros(1024))])
    with pytest.raises(PayloadError, match="one per node"):
        site_layout([p0, p0])
    with pytest.raises(PayloadError, match="one per node"):
        site_layout([replace(p0, node=1)])


# ---- a real coordinator ---------------------------------------------------------------------


def push_parts(raw: RawPusher, manifest: Manifest, data: bytes) -> None:
    """Each part on a stream of its own, as each host sends its own."""
    for part in manifest.parts:
        chunks = [(o, min(1 << 20, part.end - o)) for o in range(part.offset, part.end, 1 << 20)]
        reply = raw.push((part.offset, part.length), chunks, manifest=manifest.to_proto())
        assert reply.acked_offset == part.end and not reply.complete


def test_an_update_in_two_parts_counts_once_every_part_is_in(coord, pki):
    c = client(coord.address, pki, 1)
    before = c.fetch()
    delta, manifest, _, data = two_parts(1)
    raw = RawPusher(coord, pki, before.version, payload_of(manifest, data), "two-parts")
    try:
        m = manifest.to_proto()
        assert raw.push(reserve=True, manifest=m).granted
        push_parts(raw, manifest, data)
        counted = status(coord, pki).updates_received
        # Every byte is in, but a reservation kept open (another host's) may not count it.
        kept = raw.stub.Push(iter([_keep_open(raw, m)]), timeout=30)
        assert not kept.complete and "kept open" in kept.message
        assert status(coord, pki).updates_received == counted
        assert raw.push(reserve=True, manifest=m).complete  # the completing host's
    finally:
        raw.close()
    c.wait_for_round(before.version, poll_s=0.05)
    assert_stepped(before, c.fetch(), delta)  # the parts assembled bit for bit
    c.close()


def test_an_update_whose_part_was_damaged_is_refused_and_not_counted(coord, pki):
    c = client(coord.address, pki, 1)
    round_number = c.fetch().version
    _, manifest, _, data = two_parts(2)
    damaged = bytearray(data)
    damaged[manifest.parts[1].offset + 100] ^= 1
    raw = RawPusher(coord, pki, round_number, payload_of(manifest, bytes(damaged)), "damaged")
    try:
        m = manifest.to_proto()
        assert raw.push(reserve=True, manifest=m).granted
        push_parts(raw, manifest, raw.data)
        before = standing(coord, pki)
        with pytest.raises(grpc.RpcError) as err:
            raw.push(reserve=True, manifest=m)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value
        assert standing(coord, pki) == before
    finally:
        raw.close()
        c.close()


def _keep_open(raw: RawPusher, manifest) -> bytes:
    from wire.proto import isthmus_pb2 as pb

    msg = pb.PushMessage.FromString(raw.header(reserve=True, manifest=manifest))
    msg.header.keep_open = True
    return msg.SerializeToString()
