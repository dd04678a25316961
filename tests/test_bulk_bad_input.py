"""The raw-frame bulk methods (wire/bulk.py) against a real coordinator: broken and hostile
frames are refused with a message that names the problem, and change nothing."""

from __future__ import annotations

import uuid

import grpc
import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from wire.bulk import BulkStub, chunk_frame, parse_chunk
from wire.digest import state_digest
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest, pack, unpack

pytestmark = pytest.mark.e2e
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def job(tmp_path):
    coord = h.start_coordinator(tmp_path, h.job_config(rounds={"min_sites": 1, "max_sites": 2}))
    raw = h.RawStub(coord.address)
    bulk = BulkStub(raw.channel)
    lease = raw.stub.Join(pb.JoinRequest(site="site-a"), timeout=10).lease
    h.wait_until(lambda: _open(coord.address), what="round 0 to open")
    yield coord, raw, bulk, lease
    raw.close()
    coord.stop()


def _open(address: str) -> bool:
    return h.status(address).updates_expected > 0


def update(tmp=1.0):
    delta = {n: torch.full(s, tmp) for n, s in (("lin.bias", (16,)), ("lin.weight", (16, 8)))}
    return pack(delta)


def header_frame(lease, manifest, **over) -> bytes:
    fields = {
        "lease": lease,
        "round": 0,
        "upload_id": uuid.uuid4().hex[:12],
        "manifest": manifest.to_proto(),
        "weight": 1.0,
        "base_version": 0,
        **over,
    }
    return pb.PushMessage(header=pb.PushHeader(**fields)).SerializeToString()


def refused(bulk, frames) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        bulk.Push(iter(frames), timeout=10)
    return err.value


def unchanged(coord) -> None:
    s = h.status(coord.address)
    assert s.updates_received == 0 and s.round.round == 0


@pytest.mark.parametrize(
    ("first", "why"),
    [
        (b"\xff\xfe not protobuf", "starts with a PushHeader"),
        (pb.PushMessage(chunk=pb.Chunk(offset=0, data=b"x")).SerializeToString(), "PushHeader"),
    ],
)
def test_a_push_that_does_not_start_with_a_header_is_refused(job, first, why):
    coord, _, bulk, _ = job
    err = refused(bulk, [first])
    assert err.code() == INVALID and why in err.details()
    unchanged(coord)


def test_broken_chunk_frames_are_refused(job):
    coord, _, bulk, lease = job
    manifest, payload = update()
    head = header_frame(lease, manifest)
    err = refused(bulk, [head, b"\x00\x01\x02"])
    assert err.code() == INVALID and "8-byte offset" in err.details()
    err = refused(bulk, [header_frame(lease, manifest), chunk_frame(64, bytes(payload)[64:])])
    assert err.code() == INVALID and "out-of-order" in err.details()
    err = refused(bulk, [header_frame(lease, manifest), chunk_frame(0, bytes(5 << 20))])
    assert err.code() in (INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED)
    unchanged(coord)


def test_a_corrupted_chunk_is_refused_as_data_loss_and_a_clean_one_counts(job):
    coord, _, bulk, lease = job
    manifest, payload = update()
    bad = bytearray(payload)
    bad[3] ^= 0x10
    err = refused(bulk, [header_frame(lease, manifest), chunk_frame(0, bytes(bad))])
    assert err.code() == grpc.StatusCode.DATA_LOSS and "digest mismatch" in err.details()
    unchanged(coord)
    reply = bulk.Push(iter([header_frame(lease, manifest), chunk_frame(0, bytes(payload))]), 10)
    assert reply.complete and reply.message == "counted"


def test_a_stale_lease_is_refused_before_any_byte(job):
    coord, raw, bulk, lease = job
    raw.stub.Join(pb.JoinRequest(site="site-a"), timeout=10)  # a newer lease fences this one
    manifest, payload = update()
    err = refused(bulk, [header_frame(lease, manifest), chunk_frame(0, bytes(payload))])
    assert err.code() == grpc.StatusCode.ABORTED and "stale lease token" in err.details()
    with pytest.raises(grpc.RpcError) as fetched:
        list(bulk.Fetch(pb.FetchRequest(lease=lease), timeout=10))
    assert fetched.value.code() == grpc.StatusCode.ABORTED


def test_bulk_fetch_gives_theta_with_its_hash(job):
    _, _, bulk, lease = job
    frames = bulk.Fetch(pb.FetchRequest(lease=lease), timeout=10)
    header = pb.FetchHeader.FromString(next(frames))
    manifest = Manifest.from_proto(header.manifest)
    payload = bytearray()
    for frame in frames:
        offset, data = parse_chunk(frame)
        assert offset == len(payload)  # in order, nothing missing
        payload += data
    # A whole theta carries no payload digest: its state digest vouches for it.
    assert not manifest.digest and len(payload) == manifest.total_bytes
    assert state_digest(unpack(manifest, payload)) == header.theta_hash
