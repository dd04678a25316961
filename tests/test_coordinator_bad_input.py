"""Hostile and broken messages against a real coordinator process, through the raw stub.

Each must be refused with the right gRPC code and a message naming the problem, and change
nothing: theta's hash and the round's count of updates stay as they were, and when the round
then closes on the good updates its theta equals the reference computed without the bad ones.
"""

from __future__ import annotations

import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from wire.digest import payload_digest, state_digest
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest, pack, unpack

pytestmark = pytest.mark.e2e

CHUNK = 64  # small chunks, so that the tiny model's update is several of them
WEIGHTS = {"site-a": 1.0, "site-b": 3.0}
MAX_UPDATE_BYTES = 4096
INVALID = grpc.StatusCode.INVALID_ARGUMENT
ABORTED = grpc.StatusCode.ABORTED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class Site:
    """A site spoken for through the generated stub, with nothing checked on our side."""

    def __init__(self, address: str, name: str) -> None:
        self.raw = h.RawStub(address)
        self.stub = self.raw.stub
        self.name = name
        self.lease = self.join().lease

    def join(self) -> pb.JoinReply:
        reply = self.stub.Join(pb.JoinRequest(site=self.name), timeout=10)
        self.lease = reply.lease
        return reply

    def heartbeat(self) -> pb.HeartbeatReply:
        return self.stub.Heartbeat(pb.HeartbeatRequest(lease=self.lease), timeout=10)

    def fetch(self) -> tuple[int, dict[str, torch.Tensor]]:
        header, manifest = None, None
        payload = bytearray()
        for msg in self.stub.Fetch(pb.FetchRequest(lease=self.lease), timeout=10):
            if msg.HasField("header"):
                header = msg.header
                manifest = Manifest.from_proto(header.manifest)
            else:
                assert msg.chunk.offset == len(payload)  # in order, nothing missing
                payload += msg.chunk.data
        theta = unpack(manifest, payload)
        assert state_digest(theta) == header.theta_hash
        return header.version, theta

    def push(self, messages, timeout: float = 10) -> pb.PushReply:
        return self.stub.Push(iter(list(messages)), timeout=timeout)


def header(site: Site, r: int, manifest, **over) -> pb.PushMessage:
    fields = {
        "lease": site.lease,
        "round": r,
        "upload_id": uuid.uuid4().hex[:12],
        "manifest": manifest.to_proto() if isinstance(manifest, Manifest) else manifest,
        "weight": WEIGHTS.get(site.name, 1.0),
        "base_version": r,
    }
    fields.update(over)
    return pb.PushMessage(header=pb.PushHeader(**fields))


def chunks(payload, start: int = 0, stop: int | None = None, size: int = CHUNK):
    data = bytes(payload)
    stop = len(data) if stop is None else stop
    return [
        pb.PushMessage(chunk=pb.Chunk(offset=o, data=data[o : min(o + size, stop)]))
        for o in range(start, stop, size)
    ]


def good_delta(theta: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    k = 1.0 if name == "site-a" else 2.0
    return {
        "lin.bias": 0.01 * k * torch.cos(theta["lin.bias"]),
        "lin.weight": 0.02 * k * torch.sin(theta["lin.weight"] + k),
    }


def reference(theta: dict[str, torch.Tensor], deltas: dict[str, dict]) -> dict:
    """FedAvg in float64: theta - sum_i w_i delta_i / sum_i w_i."""
    total = sum(WEIGHTS[s] for s in deltas)
    out = dict(theta)
    for name in ("lin.bias", "lin.weight"):
        mean = sum(WEIGHTS[s] * d[name].double() for s, d in deltas.items()) / total
        out[name] = theta[name].double() - mean
    return out


# ---- the coordinator and its sites, shared by the module -------------------------------------


@dataclass
class Job:
    coord: h.CoordinatorProcess
    a: Site
    b: Site
    a_old_lease: pb.Lease

    def status(self) -> pb.StatusReply:
        return self.a.raw.status()

    def renew(self) -> None:
        for site in (self.a, self.b):
            site.heartbeat()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad-input")
    cfg = h.job_config(
        name="bad-input",
        rounds={
            "total": 50,
            "min_sites": 2,
            "max_sites": 3,
            "join_window_s": 0.3,
            "deadline_s": 120.0,
        },
        timeouts={"heartbeat_interval_s": 1.0, "lease_ttl_s": 30.0},
        server={"max_update_bytes": MAX_UPDATE_BYTES},
    )
    coord = h.start_coordinator(folder, cfg)
    sites = []
    try:
        a = Site(coord.address, "site-a")
        old = pb.Lease()
        old.CopyFrom(a.lease)
        a.join()  # a second join fences the first lease out
        b = Site(coord.address, "site-b")
        sites = [a, b]
        h.wait_until(lambda: a.heartbeat().round.participant, what="round 0 to open")
        yield Job(coord, a, b, old)
    finally:
        for site in sites:
            site.raw.close()
        coord.stop()
        print(coord.log_tail())


@pytest.fixture
def rnd(job):
    """The open round: its number and theta, with both leases freshly renewed."""
    job.renew()
    st = job.status()
    assert st.updates_received == 0, "a previous test left its round half done"
    version, theta = job.a.fetch()
    assert version == st.round.round
    return st.round.round, theta


def assert_refused(
    job: Job, send: Callable[[], object], code: grpc.StatusCode, *needles: str
) -> str:
    before = job.status()
    with pytest.raises(grpc.RpcError) as err:
        send()
    details = err.value.details()
    assert err.value.code() == code, f"{err.value.code()}: {details}"
    for needle in needles:
        assert needle in details, f"{needle!r} not in {details!r}"
    after = job.status()
    assert after.round.round == before.round.round
    assert after.round.theta_hash == before.round.theta_hash, "a refused push changed theta"
    assert after.updates_received == before.updates_received, "a refused push was counted"
    return details


# ---- the cases: (code, words the message must contain, messages to send) ---------------------


def _pack_payload(tensors):
    manifest, payload = pack(tensors)
    return manifest, bytes(payload)


def case_wrong_shape(site, r, theta):
    d = good_delta(theta, site.name)
    d["lin.weight"] = d["lin.weight"].t().contiguous()  # same bytes, shape (8, 16)
    m, p = _pack_payload(d)
    return INVALID, ("lin.weight", "shape [8, 16]", "[16, 8]"), [header(site, r, m), *chunks(p)]


def case_nan_values(site, r, theta):
    d = good_delta(theta, site.name)
    d["lin.bias"][3] = float("nan")
    m, p = _pack_payload(d)
    return INVALID, ("lin.bias", "NaN"), [header(site, r, m), *chunks(p)]


def case_inf_values(site, r, theta):
    d = good_delta(theta, site.name)
    d["lin.weight"][0, 0] = float("inf")
    m, p = _pack_payload(d)
    return INVALID, ("lin.weight", "Inf"), [header(site, r, m), *chunks(p)]


def case_unknown_tensor(site, r, theta):
    d = {**good_delta(theta, site.name), "lin.extra": torch.zeros(4)}
    m, p = _pack_payload(d)
    return INVALID, ("unknown tensor", "lin.extra"), [header(site, r, m), *chunks(p)]


def case_missing_tensor(site, r, theta):
    d = good_delta(theta, site.name)
    del d["lin.bias"]
    m, p = _pack_payload(d)
    return INVALID, ("missing", "lin.bias"), [header(site, r, m), *chunks(p)]


def case_non_trainable_tensor(site, r, theta):
    d = {**good_delta(theta, site.name), "seen": torch.zeros(3, dtype=torch.int64)}
    m, p = _pack_payload(d)
    return INVALID, ("seen", "not trainable"), [header(site, r, m), *chunks(p)]


def case_wrong_dtype(site, r, theta):
    d = {k: v.double() for k, v in good_delta(theta, site.name).items()}
    m, p = _pack_payload(d)
    return INVALID, ("float64",), [header(site, r, m), *chunks(p)]


def case_corrupted_chunk(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    bad = bytearray(p)
    bad[100] ^= 0x40
    return (
        grpc.StatusCode.DATA_LOSS,
        ("digest mismatch", "corrupted in flight"),
        [header(site, r, m), *chunks(bad)],
    )


def case_out_of_order_chunks(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    cs = chunks(p)
    cs[1], cs[2] = cs[2], cs[1]
    return INVALID, ("out-of-order", "offset 128", "expected offset 64"), [header(site, r, m), *cs]


def case_duplicated_chunk(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    cs = chunks(p)
    return INVALID, ("duplicated chunk", "offset 0"), [header(site, r, m), cs[0], *cs]


def case_chunk_past_end(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    cs = chunks(p + b"\0" * 16)
    return INVALID, ("runs past",), [header(site, r, m), *cs]


def case_no_header(site, r, theta):
    _, p = _pack_payload(good_delta(theta, site.name))
    return INVALID, ("PushHeader",), chunks(p)


def case_empty_stream(site, r, theta):
    return INVALID, ("PushHeader",), []


def case_second_header(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    cs = chunks(p)
    return INVALID, ("one header",), [header(site, r, m), cs[0], header(site, r, m), *cs[1:]]


def _weight_case(weight):
    def case(site, r, theta):
        m, p = _pack_payload(good_delta(theta, site.name))
        return INVALID, ("weight",), [header(site, r, m, weight=weight), *chunks(p)]

    return case


def case_stale_lease(site, r, theta, job):
    m, p = _pack_payload(good_delta(theta, site.name))
    msgs = [header(site, r, m, lease=job.a_old_lease), *chunks(p)]
    return ABORTED, ("stale lease token", str(job.a_old_lease.token)), msgs


def case_no_lease(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    lease = pb.Lease(site="site-zz", token=site.lease.token)
    return ABORTED, ("site-zz", "no lease"), [header(site, r, m, lease=lease), *chunks(p)]


def case_future_round(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    msgs = [header(site, r + 1, m, base_version=r + 1), *chunks(p)]
    return PRECONDITION, (f"round {r + 1} is not open",), msgs


def case_closed_round(site, r, theta):
    if r == 0:
        pytest.skip("needs a closed round before the open one")
    m, p = _pack_payload(good_delta(theta, site.name))
    msgs = [header(site, r - 1, m, base_version=r - 1), *chunks(p)]
    return PRECONDITION, (f"round {r - 1} is closed",), msgs


def case_wrong_base_version(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    return INVALID, ("version 7",), [header(site, r, m, base_version=7), *chunks(p)]


def case_oversize(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    big = m.to_proto()
    big.total_bytes = MAX_UPDATE_BYTES + 1
    return INVALID, ("exceeds the limit", str(MAX_UPDATE_BYTES)), [header(site, r, big)]


def case_slack_after_tensors(site, r, theta):
    # Under server.max_update_bytes, with a true digest of the padded payload: only the
    # model's size refuses it (the bytes after the last tensor are wanted by no one).
    m, p = _pack_payload(good_delta(theta, site.name))
    padded = p + bytes(MAX_UPDATE_BYTES - len(p))
    fat = m.to_proto()
    fat.total_bytes = len(padded)
    fat.digest = payload_digest(padded)
    needles = ("nothing may follow", str(MAX_UPDATE_BYTES), f"byte {len(p)}")
    return INVALID, needles, [header(site, r, fat), *chunks(padded, size=1024)]


def case_bad_manifest_sha(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    short = m.to_proto()
    short.digest = b"\1" * 5
    return INVALID, ("digest must be",), [header(site, r, short), *chunks(p)]


def case_unknown_codec(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    odd = m.to_proto()
    odd.tensors[0].codec = "zstd-9000"
    return INVALID, ("codec", "zstd-9000"), [header(site, r, odd), *chunks(p)]


def case_overlapping_tensors(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    odd = m.to_proto()
    odd.tensors[1].offset = odd.tensors[0].offset + 4
    return INVALID, ("overlaps",), [header(site, r, odd), *chunks(p)]


def case_bad_upload_id(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    return INVALID, ("upload_id",), [header(site, r, m, upload_id="../../etc"), *chunks(p)]


def _with_unknown_field(msg: pb.PushMessage) -> pb.PushMessage:
    # Field 15 of PushHeader does not exist in the protocol: as a newer or hostile peer sends it.
    raw = msg.SerializeToString()
    header = pb.PushHeader.FromString(msg.header.SerializeToString() + b"\x78\x01")
    assert raw != pb.PushMessage(header=header).SerializeToString()
    return pb.PushMessage(header=header)


def case_unknown_field(site, r, theta):
    m, p = _pack_payload(good_delta(theta, site.name))
    return (
        INVALID,
        ("fields this coordinator does not know",),
        [
            _with_unknown_field(header(site, r, m)),
            *chunks(p),
        ],
    )


CASES = {
    "unknown_field": case_unknown_field,
    "wrong_shape": case_wrong_shape,
    "nan_values": case_nan_values,
    "inf_values": case_inf_values,
    "unknown_tensor": case_unknown_tensor,
    "missing_tensor": case_missing_tensor,
    "non_trainable_tensor": case_non_trainable_tensor,
    "wrong_dtype": case_wrong_dtype,
    "corrupted_chunk": case_corrupted_chunk,
    "out_of_order_chunks": case_out_of_order_chunks,
    "duplicated_chunk": case_duplicated_chunk,
    "chunk_past_end": case_chunk_past_end,
    "no_header": case_no_header,
    "empty_stream": case_empty_stream,
    "second_header": case_second_header,
    "weight_zero": _weight_case(0.0),
    "weight_negative": _weight_case(-2.0),
    "weight_nan": _weight_case(math.nan),
    "weight_inf": _weight_case(math.inf),
    "stale_lease": case_stale_lease,
    "no_lease": case_no_lease,
    "future_round": case_future_round,
    "wrong_base_version": case_wrong_base_version,
    "oversize": case_oversize,
    "slack_after_tensors": case_slack_after_tensors,
    "bad_manifest_sha": case_bad_manifest_sha,
    "unknown_codec": case_unknown_codec,
    "overlapping_tensors": case_overlapping_tensors,
    "bad_upload_id": case_bad_upload_id,
}


def build(case, job: Job, r: int, theta):
    if case is case_stale_lease:
        return case(job.a, r, theta, job)
    return case(job.a, r, theta)


def test_a_message_over_the_grpc_limit_is_stopped_there(job, rnd):
    r, theta = rnd
    m, _ = _pack_payload(good_delta(theta, "site-a"))
    limit = 32 << 20
    # A sender whose own limit is higher, so that the coordinator's limit is what stops it.
    channel = grpc.insecure_channel(
        job.coord.address, options=[("grpc.max_send_message_length", 2 * limit)]
    )
    stub = h.pb_grpc.CoordinatorStub(channel)
    huge = pb.PushMessage(chunk=pb.Chunk(offset=0, data=b"\0" * (limit + 1024)))
    try:
        assert_refused(
            job,
            lambda: stub.Push(iter([header(job.a, r, m), huge]), timeout=30),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    finally:
        channel.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_push_is_refused_and_changes_nothing(job, rnd, name):
    r, theta = rnd
    code, needles, msgs = build(CASES[name], job, r, theta)
    assert_refused(job, lambda: job.a.push(msgs), code, *needles)


def test_round_closes_on_the_good_updates_only(job, rnd):
    """Every bad push first, then the good ones: theta_{r+1} is the reference without them.
    Also: a second good push from the same site is a duplicate, a push for the closed round
    is late."""
    r, theta = rnd
    for case in CASES.values():
        code, needles, msgs = build(case, job, r, theta)
        assert_refused(job, lambda msgs=msgs: job.a.push(msgs), code, *needles)
    deltas = {s.name: good_delta(theta, s.name) for s in (job.a, job.b)}
    m, p = _pack_payload(deltas["site-a"])
    reply = job.a.push([header(job.a, r, m), *chunks(p)])
    assert reply.complete and reply.acked_offset == len(p)
    assert_refused(
        job,
        lambda: job.a.push([header(job.a, r, m), *chunks(p)]),
        grpc.StatusCode.ALREADY_EXISTS,
        "already delivered",
    )
    mb, pb_ = _pack_payload(deltas["site-b"])
    assert job.b.push([header(job.b, r, mb), *chunks(pb_)]).complete
    h.wait_until(lambda: job.status().round.round == r + 1, what="the round to close")
    version, new_theta = job.a.fetch()
    assert version == r + 1
    want = reference(theta, deltas)
    for name in ("lin.bias", "lin.weight"):
        torch.testing.assert_close(new_theta[name].double(), want[name], rtol=1e-6, atol=1e-6)
    assert torch.equal(new_theta["seen"], theta["seen"])
    # The closed round refuses late updates, with theta left alone.
    job.renew()
    code, needles, msgs = case_closed_round(job.b, r + 1, new_theta)
    assert_refused(job, lambda: job.b.push(msgs), code, *needles)


def test_push_from_a_site_that_joined_after_the_round_opened(job, rnd):
    r, theta = rnd
    late = Site(job.coord.address, "site-c")
    try:
        assert not late.join().round.participant
        m, p = _pack_payload(good_delta(theta, "site-c"))
        assert_refused(
            job,
            lambda: late.push([header(late, r, m), *chunks(p)]),
            PRECONDITION,
            "site-c",
            "not a participant",
        )
        # The job is full now (max_sites=3): a fourth site is turned away.
        with pytest.raises(grpc.RpcError) as err:
            job.a.stub.Join(pb.JoinRequest(site="site-d"), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sites=3" in err.value.details()
    finally:
        late.stub.Leave(pb.LeaveRequest(lease=late.lease), timeout=10)
        late.raw.close()


@pytest.mark.parametrize(
    "request_kw, code, needle",
    [
        ({"version": 99}, grpc.StatusCode.NOT_FOUND, "version 99"),
        ({"offset": 1 << 40}, INVALID, "offset"),
    ],
)
def test_bad_fetch(job, rnd, request_kw, code, needle):
    with pytest.raises(grpc.RpcError) as err:
        list(job.a.stub.Fetch(pb.FetchRequest(lease=job.a.lease, **request_kw), timeout=10))
    assert err.value.code() == code and needle in err.value.details()


@pytest.mark.parametrize("name", ["", "a b", "x" * 80, "../etc"])
def test_join_with_a_bad_site_name(job, name):
    with pytest.raises(grpc.RpcError) as err:
        job.a.stub.Join(pb.JoinRequest(site=name), timeout=10)
    assert err.value.code() == INVALID and "site name" in err.value.details()


def test_resumable_push(job, rnd):
    """site-a: half the chunks, the stream dropped, a header-only probe, then the rest.
    site-b: half the chunks and a clean end of stream (complete=False), then the rest."""
    r, theta = rnd
    deltas = {s.name: good_delta(theta, s.name) for s in (job.a, job.b)}
    m, p = _pack_payload(deltas["site-a"])
    half = (len(p) // CHUNK // 2) * CHUNK
    upload_id = "resume-" + uuid.uuid4().hex[:8]
    hold = threading.Event()
    in_before = job.status().wan_bytes_in

    def first_half():
        yield header(job.a, r, m, upload_id=upload_id)
        yield from chunks(p, 0, half)
        hold.wait(30)  # the stream stays open until cancelled

    call = job.a.stub.Push.future(first_half(), timeout=30)
    try:
        h.wait_until(lambda: job.status().wan_bytes_in >= in_before + half, what="the first half")
    finally:
        call.cancel()
        hold.set()
    assert call.cancelled() or call.exception() is not None

    def probe():
        try:
            return job.a.push([header(job.a, r, m, upload_id=upload_id)])
        except grpc.RpcError as exc:  # the old stream may still hold the upload for a moment
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            time.sleep(0.05)
            return None

    reply = h.wait_until(probe, what="a probe answer")
    assert (reply.complete, reply.acked_offset) == (False, half), reply
    assert job.status().updates_received == 0
    reply = job.a.push([header(job.a, r, m, upload_id=upload_id), *chunks(p, half)])
    assert reply.complete and reply.acked_offset == len(p), reply
    assert job.status().updates_received == 1

    mb, pb_ = _pack_payload(deltas["site-b"])
    hb = header(job.b, r, mb, upload_id="resume-b")
    reply = job.b.push([hb, *chunks(pb_, 0, half)])
    assert (reply.complete, reply.acked_offset) == (False, half), reply
    assert job.status().updates_received == 1
    # Resending from a wrong offset is refused; the upload survives it.
    assert_refused(job, lambda: job.b.push([hb, *chunks(pb_, 0)]), INVALID, "duplicated chunk")
    reply = job.b.push([hb, *chunks(pb_, half)])
    assert reply.complete, reply

    h.wait_until(lambda: job.status().round.round == r + 1, what="the round to close")
    _, new_theta = job.a.fetch()
    want = reference(theta, deltas)
    for name in ("lin.bias", "lin.weight"):
        torch.testing.assert_close(new_theta[name].double(), want[name], rtol=1e-6, atol=1e-6)


def test_upload_id_reused_for_another_payload(job, rnd):
    """Not a transient error (UNAVAILABLE would make the site retry until its deadline)."""
    r, theta = rnd
    m, p = _pack_payload(good_delta(theta, "site-a"))
    hdr = header(job.a, r, m, upload_id="reused-id")
    reply = job.a.push([hdr, *chunks(p, 0, 2 * CHUNK)])
    assert (reply.complete, reply.acked_offset) == (False, 2 * CHUNK)
    other = good_delta(theta, "site-a")
    other["lin.bias"] = other["lin.bias"] * 2
    m2, p2 = _pack_payload(other)
    assert_refused(
        job,
        lambda: job.a.push([header(job.a, r, m2, upload_id="reused-id"), *chunks(p2)]),
        INVALID,
        "reused-id",
        "already used",
    )


def test_client_status_does_not_join(job):
    from site_client.transfer.client import CoordinatorClient

    with CoordinatorClient(job.coord.address, "watcher", backoff=h.FAST_BACKOFF) as client:
        reply = client.status()
        assert client.lease is None
    assert reply.job_name == "bad-input"
    assert "watcher" not in {s.site for s in job.status().sites}


def test_abandoned_uploads_of_closed_rounds_are_let_go(tmp_path):
    """In process: at round close the coordinator drops unfinished uploads of the closed
    round (their files stay open otherwise, holding the disk space of a deleted folder)."""
    from coordinator.intake.spool import UpdateSpool
    from coordinator.intake.uploads import UploadTable

    spool = UpdateSpool(tmp_path)
    table = UploadTable(spool)
    m, p = _pack_payload({"x": torch.ones(64)})
    idle = table.begin("site-a", 0, "u1", m, 1.0)
    idle.add(0, p[:CHUNK])
    table.release(idle)
    busy = table.begin("site-b", 0, "u2", m, 1.0)
    busy.add(0, p[:CHUNK])
    newer = table.begin("site-c", 1, "u3", m, 1.0)
    table.release(newer)
    table.drop_rounds_before(1)
    assert idle.file.closed and not spool.part_path(0, "site-a", "u1").exists()
    assert not busy.file.closed, "an upload being received is left to its stream"
    assert not newer.file.closed
    assert table.in_progress() == 2


def test_streaming_updates_must_carry_exactly_the_round_fragment(tmp_path):
    """In process, ``[streaming] fragments = 2``: a tensor of the other fragment, a missing
    tensor of the round's, or the whole model, are refused naming the fragment, and nothing
    stored changes; the good updates then change theta on the fragment only."""
    from core_helpers import Clock, new_core, push

    from coordinator.records import Refused

    core = new_core(
        tmp_path,
        Clock(),
        model={"factory": "coord_harness:blocks_model", "kwargs": {"blocks": 4, "d": 4}},
        rounds={"inner_steps": 2},
        streaming={"fragments": 2},
    )
    tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
    core.tick()
    assert core.round.opened_at is not None and core.round_info()["fragment"] == 0
    mine, other = core.tensors.names(0), core.tensors.names(1)
    before, held = state_digest(core.theta), {n: t.clone() for n, t in core.theta.items()}
    good = {n: torch.full_like(core.theta[n], 0.01) for n in mine}
    stray = other[0]
    bad = {
        f"tensor '{stray}' is in fragment 1; round 0 syncs fragment 0 of 2 ([streaming])": {
            **good,
            stray: torch.zeros_like(core.theta[stray]),
        },
        f"missing tensor(s) ['{mine[0]}'] of fragment 0 of 2, which round 0 syncs": {
            n: t for n, t in good.items() if n != mine[0]
        },
        "is in fragment 1; round 0 syncs fragment 0 of 2": {
            n: torch.zeros_like(core.theta[n]) for n in core.trainable
        },
    }
    for i, (message, delta) in enumerate(bad.items()):
        with pytest.raises(Refused, match=re.escape(message)) as info:
            push(core, "site-a", tokens["site-a"], 0, delta, upload_id=f"bad-{i}")
        assert info.value.code == "invalid"
    assert state_digest(core.theta) == before
    assert core.state.accepted == {} and core.round.received == {}
    assert core.spool.completed(0) == [] and core.uploads.in_progress() == 0
    for site, token in tokens.items():
        assert push(core, site, token, 0, good)
    core.tick()
    assert core.round.number == 1 and core.round_info()["fragment"] == 1
    changed = [n for n in sorted(core.theta) if not torch.equal(core.theta[n], held[n])]
    assert changed == sorted(mine)
    core.close()
