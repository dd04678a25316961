"""``coordinator drain`` / ``undrain`` and health reports over real gRPC and mutual TLS: only
an unrevoked operator may drain; a drained site hears it in every reply and cannot join until
undrained; bad requests and bad health reports are refused and change nothing."""

from __future__ import annotations

import math

import grpc
import pytest
from coord_harness import CoordinatorProcess, job_config, run_cli, write_config

from coordinator.observe.status import format_status
from site_client.transfer.client import CoordinatorClient
from wire.backoff import BackoffPolicy
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

NO_RETRY = BackoffPolicy(initial_s=0.05, cap_s=0.1, deadline_s=0.5)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = init_ca(root / "ca", "drain-test")
    issue(ca, "coordinator", "coordinator", root / "server", hosts=("127.0.0.1", "localhost"))
    for site in ("site-a", "site-b"):
        issue(ca, "site", site, root / site)
    issue(ca, "operator", "ops", root / "ops")
    issue(ca, "operator", "gone", root / "gone")
    return root


@pytest.fixture(scope="module")
def coord(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("drain-coord")
    path = write_config(
        folder, job_config(name="drain-job", rounds={"min_sites": 3, "max_sites": 4})
    )
    proc = CoordinatorProcess(
        path,
        folder / "state",
        folder / "coordinator.log",
        tls_dir=pki / "server",
        crl=pki / "ca" / "crl.pem",
    )
    proc.start()
    yield proc
    proc.stop()


def _stub(coord, pki, who: str):
    return pb_grpc.CoordinatorStub(open_channel(coord.address, Bundle.load(pki / who)))


def _status(coord, pki) -> pb.StatusReply:
    return _stub(coord, pki, "ops").Status(pb.StatusRequest(), timeout=10)


def _cli(coord, pki, *args: str, who: str = "ops"):
    return run_cli(*args, "--coordinator", coord.address, "--tls-dir", str(pki / who))


def _site(coord, pki, name: str) -> CoordinatorClient:
    client = CoordinatorClient(coord.address, name, tls=Bundle.load(pki / name), backoff=NO_RETRY)
    client.join()
    return client


def test_only_an_operator_may_drain(coord, pki):
    _site(coord, pki, "site-a")
    for who in ("site-a", "site-b"):
        with pytest.raises(grpc.RpcError) as err:
            _stub(coord, pki, who).Drain(pb.DrainRequest(site="site-a"), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "operator" in err.value.details()
    result = _cli(coord, pki, "drain", "site-a", who="site-b")
    assert result.returncode == 1 and "PERMISSION_DENIED" in result.stderr
    assert not any(s.drained for s in _status(coord, pki).sites)
    assert not (coord.state_dir / "drained.json").exists()


def test_a_revoked_operator_is_refused(coord, pki):
    result = run_cli("certs", "revoke", "--operator", "gone", "--ca", str(pki / "ca"))
    assert result.returncode == 0, result.stderr
    result = _cli(coord, pki, "drain", "site-a", who="gone")
    assert result.returncode == 1 and "revoked" in result.stderr
    assert not any(s.drained for s in _status(coord, pki).sites)


def test_drain_then_undrain_a_site(coord, pki):
    b = _site(coord, pki, "site-b")
    result = _cli(coord, pki, "drain", "site-b", "--reason", "ECC errors on node 3")
    assert result.returncode == 0, result.stderr
    assert "site site-b drained" in result.stdout and "drained now: site-b" in result.stdout
    reply = b.heartbeat()
    assert [c.drain for c in reply.commands if c.WhichOneof("kind") == "drain"] == [
        "ECC errors on node 3 (operator)"
    ]
    watch = b.wait_round(None, 1.0)
    assert any(c.WhichOneof("kind") == "drain" for c in watch.commands)
    site = {s.site: s for s in _status(coord, pki).sites}["site-b"]
    assert site.drained == "ECC errors on node 3 (operator)"
    assert "active (drained)" in format_status(_status(coord, pki))
    b.leave("drained")
    with pytest.raises(grpc.RpcError) as err:
        _stub(coord, pki, "site-b").Join(pb.JoinRequest(site="site-b"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "coordinator undrain site-b" in err.value.details()
    result = _cli(coord, pki, "undrain", "site-b")
    assert result.returncode == 0 and "may join again" in result.stdout
    assert "drained now: none" in result.stdout
    again = _site(coord, pki, "site-b")
    assert not any(c.WhichOneof("kind") == "drain" for c in again.heartbeat().commands)
    again.leave("done")


def test_bad_drain_requests_change_nothing(coord, pki):
    result = _cli(coord, pki, "drain", "../../etc")
    assert result.returncode == 1 and "site name" in result.stderr
    stub = _stub(coord, pki, "ops")
    request = pb.DrainRequest(site="site-a")
    hostile = request.SerializeToString() + b"\xa0\x06\x01"  # field 100, varint 1
    with pytest.raises(grpc.RpcError) as err:
        stub.Drain(pb.DrainRequest.FromString(hostile), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not know" in err.value.details()
    result = run_cli("drain", "site-a", "--coordinator", "nowhere")
    assert result.returncode == 2 and "--coordinator nowhere" in result.stderr
    assert not any(s.drained for s in _status(coord, pki).sites)


def _report(**fields) -> pb.HealthReport:
    base = {"round": 0, "matmul_gflops": 50.0, "world_size": 2, "device": "cpu", "seq": 1}
    return pb.HealthReport(**{**base, **fields})


@pytest.mark.parametrize(
    "bad",
    [
        {"matmul_gflops": math.nan},
        {"allreduce_gbps": -1.0},
        {"matmul_gflops": math.inf},
        {"device": "x" * 500},
        {"gpu_errors": ["e"] * 40},
    ],
)
def test_a_bad_health_report_is_refused_and_stores_nothing(coord, pki, bad):
    a = _site(coord, pki, "site-a")
    request = pb.HeartbeatRequest(lease=a.lease, health=_report(**bad))
    with pytest.raises(grpc.RpcError) as err:
        _stub(coord, pki, "site-a").Heartbeat(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "health" in err.value.details()
    site = {s.site: s for s in _status(coord, pki).sites}["site-a"]
    assert not site.HasField("health")


def test_a_health_report_shows_in_status(coord, pki):
    a = _site(coord, pki, "site-a")
    a.heartbeat(None, _report(allreduce_gbps=1.5, seq=7))
    site = {s.site: s for s in _status(coord, pki).sites}["site-a"]
    assert site.health.matmul_gflops == 50.0 and site.health.seq == 7
    assert "50 GF/s 1.5 GB/s" in format_status(_status(coord, pki))
