"""Compressed updates end to end: sites push int8-encoded pseudo-gradients (biases raw, by
rule) to a real coordinator, which decodes them at round close. theta_{r+1} equals the
reference computed from exactly what was sent, every party holds the same theta, and a
corrupted encoded tensor is refused without touching the round."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from site_client.transfer.client import CoordinatorClient
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.digest import payload_digest
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest, pack_encoded, unpack

pytestmark = pytest.mark.e2e

RULES = {"default": "int8", "rules": [{"match": "*bias", "codec": "none"}]}
WEIGHTS = {"site-a": 1.0, "site-b": 3.0}
ROUNDS = 2


def _delta(theta: dict[str, torch.Tensor], k: int, r: int) -> dict[str, torch.Tensor]:
    return {
        n: 0.01
        * torch.sin(torch.arange(t.numel(), dtype=torch.float32) * (k + 1) + r).reshape(t.shape)
        for n, t in theta.items()
        if t.is_floating_point()
    }


@pytest.fixture
def coord(tmp_path):
    cfg = h.job_config(
        name="compressed",
        rounds={"total": ROUNDS, "min_sites": 2, "max_sites": 2, "join_window_s": 5.0},
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 64, "d_out": 32}},
    )
    path = h.write_config(tmp_path, cfg)
    path.write_text(
        path.read_text()
        + '\n[compression]\ndefault = "int8"\nrules = [{ match = "*bias", codec = "none" }]\n'
    )
    proc = h.CoordinatorProcess(path, tmp_path / "state", tmp_path / "coordinator.log")
    proc.start()
    yield proc
    proc.stop()


def test_int8_updates_round_trip_through_the_coordinator(coord):
    compression = CompressionConfig.from_dict(RULES)
    clients = {s: CoordinatorClient(coord.address, s, backoff=h.FAST_BACKOFF) for s in WEIGHTS}
    states = {s: CodecState() for s in WEIGHTS}
    for c in clients.values():
        c.join()
    for r in range(ROUNDS):
        for c in clients.values():
            c.wait_for_round(r - 1)
        theta = clients["site-a"].fetch().theta
        sent, threads = {}, []
        for k, (site, client) in enumerate(clients.items()):
            delta = _delta(theta, k, r)
            # What the client will send, encoded from an identical copy of its codec state.
            twin = CodecState()
            twin.load_state_dict(states[site].state_dict())
            manifest, payload = pack_encoded(delta, compression, twin)
            codecs = {e.name: e.codec for e in manifest.entries}
            assert codecs == {"lin.weight": "int8", "lin.bias": "none"}
            sent[site] = unpack(manifest, bytearray(payload))
            raw_bytes = sum(t.numel() * 4 for t in delta.values())
            assert len(payload) < raw_bytes / 3  # int8 weight: about 4x smaller
            push = dict(weight=WEIGHTS[site], compression=compression, codec_state=states[site])
            threads.append(threading.Thread(target=client.push, args=(r, delta), kwargs=push))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in clients.values():
            c.wait_for_round(r)
        new = {s: c.fetch() for s, c in clients.items()}
        status = h.status(coord.address)
        assert new["site-a"].theta_hash == new["site-b"].theta_hash == status.round.theta_hash
        total = sum(WEIGHTS.values())
        for name, t in new["site-a"].theta.items():
            if not t.is_floating_point():
                continue
            mean = sum(WEIGHTS[s] * sent[s][name] for s in WEIGHTS) / total
            torch.testing.assert_close(t, theta[name] - mean, rtol=0, atol=1e-6)
    for c in clients.values():
        c.close()


def test_a_corrupted_encoded_tensor_is_refused(coord):
    site = h.RawStub(coord.address)
    lease = site.stub.Join(pb.JoinRequest(site="site-a"), timeout=10).lease
    other = CoordinatorClient(coord.address, "site-b", backoff=h.FAST_BACKOFF)
    other.join()
    other.wait_for_round(-1)
    theta = other.fetch().theta
    manifest, payload = pack_encoded(
        _delta(theta, 0, 0), CompressionConfig.from_dict(RULES), CodecState()
    )
    weight = next(e for e in manifest.entries if e.name == "lin.weight")
    bad = bytearray(payload)
    bad[weight.offset + 3] ^= 0x40  # inside the int8 data: only the codec's CRC can tell
    forged = Manifest(manifest.entries, manifest.total_bytes, payload_digest(bad))
    header = pb.PushHeader(
        lease=lease, round=0, upload_id="bad1", manifest=forged.to_proto(), weight=1.0
    )
    before = h.status(coord.address)
    with pytest.raises(grpc.RpcError) as err:
        site.stub.Push(
            iter(
                [
                    pb.PushMessage(header=header),
                    pb.PushMessage(chunk=pb.Chunk(offset=0, data=bytes(bad))),
                ]
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lin.weight" in err.value.details() and "CRC" in err.value.details()
    after = h.status(coord.address)
    assert after.updates_received == before.updates_received
    assert after.round.theta_hash == before.round.theta_hash
    site.close()
    other.close()
