"""Mutual TLS against a real coordinator process: who is let in, and as whom."""

from __future__ import annotations

import datetime as dt
import stat

import grpc
import pytest
from coord_harness import CoordinatorProcess, job_config, run_cli, write_config

from site_client.transfer.client import CoordinatorClient
from wire.backoff import BackoffPolicy
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

NO_RETRY = BackoffPolicy(initial_s=0.05, cap_s=0.1, deadline_s=0.3)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = init_ca(root / "ca", "tls-test")
    issue(ca, "coordinator", "coordinator", root / "server", hosts=("127.0.0.1", "localhost"))
    for site in ("site-a", "site-b", "site-c"):
        issue(ca, "site", site, root / site)
    issue(ca, "operator", "ops", root / "ops")
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    issue(ca, "site", "site-old", root / "site-old", days=1, not_before=past)
    rogue = init_ca(root / "rogue-ca", "someone else")
    issue(rogue, "site", "site-a", root / "rogue-a")
    return root


@pytest.fixture(scope="module")
def coord(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls-coord")
    cfg = job_config(name="tls-job", rounds={"min_sites": 3, "max_sites": 4})
    path = write_config(folder, cfg)
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


def stub(address: str, bundle: Bundle | None):
    return pb_grpc.CoordinatorStub(open_channel(address, bundle))


def status(coord, pki) -> pb.StatusReply:
    return stub(coord.address, Bundle.load(pki / "ops")).Status(pb.StatusRequest(), timeout=10)


def test_key_files_are_private(pki):
    for bundle in ("server", "site-a", "ops"):
        assert stat.S_IMODE((pki / bundle / "key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((pki / "ca" / "ca-key.pem").stat().st_mode) == 0o600


def test_a_site_with_its_certificate_joins_and_fetches(coord, pki):
    client = CoordinatorClient(coord.address, "site-a", tls=Bundle.load(pki / "site-a"))
    reply = client.join()
    assert reply.lease.site == "site-a"
    state = client.fetch()
    assert state.theta_hash == status(coord, pki).round.theta_hash
    client.close()


@pytest.mark.parametrize(
    "who", ["plaintext", "no client certificate", "another CA", "expired certificate"]
)
def test_refused_at_the_handshake(coord, pki, who):
    before = {s.site for s in status(coord, pki).sites}
    if who == "plaintext":
        channel = grpc.insecure_channel(coord.address)
    elif who == "no client certificate":
        ca = (pki / "ca" / "ca.pem").read_bytes()
        channel = grpc.secure_channel(coord.address, grpc.ssl_channel_credentials(ca))
    else:
        bundle = Bundle.load(pki / ("rogue-a" if who == "another CA" else "site-old"))
        if who == "another CA":  # trusts our server, but presents a certificate from elsewhere
            bundle = Bundle(bundle.cert, bundle.key, (pki / "ca" / "ca.pem").read_bytes())
        channel = open_channel(coord.address, bundle)
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.CoordinatorStub(channel).Join(pb.JoinRequest(site="site-a"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert {s.site for s in status(coord, pki).sites} == before  # nothing joined


def test_a_site_cannot_act_as_another(coord, pki):
    a = stub(coord.address, Bundle.load(pki / "site-a"))
    with pytest.raises(grpc.RpcError) as err:
        a.Join(pb.JoinRequest(site="site-b"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'site-a'" in err.value.details() and "'site-b'" in err.value.details()
    # Nor push, heartbeat, fetch or leave under site-b's name, even holding site-b's lease.
    b_lease = CoordinatorClient(coord.address, "site-b", tls=Bundle.load(pki / "site-b")).join()
    lease = b_lease.lease
    header = pb.PushHeader(lease=lease, round=0, upload_id="x1", weight=1.0)
    calls = {
        "Heartbeat": lambda: a.Heartbeat(pb.HeartbeatRequest(lease=lease), timeout=5),
        "Fetch": lambda: list(a.Fetch(pb.FetchRequest(lease=lease), timeout=5)),
        "Push": lambda: a.Push(iter([pb.PushMessage(header=header)]), timeout=5),
        "Leave": lambda: a.Leave(pb.LeaveRequest(lease=lease), timeout=5),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert "claims site 'site-b'" in err.value.details(), name
    sites = {s.site: s for s in status(coord, pki).sites}
    assert sites["site-b"].state == "active" and sites["site-b"].token == lease.token


def test_operators_and_sites_have_different_rights(coord, pki):
    with pytest.raises(grpc.RpcError) as err:
        stub(coord.address, Bundle.load(pki / "site-a")).Status(pb.StatusRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "operator" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub(coord.address, Bundle.load(pki / "ops")).Join(pb.JoinRequest(site="ops"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    result = run_cli("status", "--coordinator", coord.address, "--tls-dir", str(pki / "ops"))
    assert result.returncode == 0, result.stderr
    assert "job tls-job" in result.stdout
    result = run_cli("status", "--coordinator", coord.address, "--tls-dir", str(pki / "site-a"))
    assert result.returncode == 1 and "PERMISSION_DENIED" in result.stderr


def test_revoked_while_running(coord, pki):
    client = CoordinatorClient(
        coord.address, "site-c", tls=Bundle.load(pki / "site-c"), backoff=NO_RETRY
    )
    client.join()
    client.heartbeat()
    result = run_cli("certs", "revoke", "--site", "site-c", "--ca", str(pki / "ca"))
    assert result.returncode == 0, result.stderr
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Heartbeat(pb.HeartbeatRequest(lease=client.lease), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in err.value.details()
    with pytest.raises(grpc.RpcError):
        client.stub.Join(pb.JoinRequest(site="site-c"), timeout=5)
    # Other sites are unaffected.
    CoordinatorClient(coord.address, "site-a", tls=Bundle.load(pki / "site-a")).heartbeat()
    assert coord.proc.poll() is None


def test_serve_requires_tls_or_an_explicit_insecure(tmp_path):
    path = write_config(tmp_path, job_config(name="x"))
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == 2
    assert "mutual TLS is required" in result.stderr and "--insecure" in result.stderr
    assert not (tmp_path / "state").exists()
