"""What one certificate holder can take from a real TLS coordinator: calls held open without a
request, push streams held open, revoked and intermediate-signed certificates."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter

import grpc
import pytest
from coord_harness import CoordinatorProcess, job_config, run_cli, write_config
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bench.fuzzing.holding import HeldCalls, probe_latencies
from coordinator.service.call_gate import CallLimits, admit
from coordinator.service.watchdog import CallWatchdog
from wire.identity import Bundle, IdentityError, init_ca, issue, verify_leaf
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

LIMITS = CallLimits()
HEARTBEAT = "/isthmus.v1.Coordinator/Heartbeat"
JOIN = "/isthmus.v1.Coordinator/Join"
BULK_PUSH = "/isthmus.v1.Bulk/Push"
REQUEST_TIMEOUT_S = 2.0


def _name(cn: str, ou: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou),
        ]
    )


def _intermediate_leaf(ca_folder, out, site: str) -> Bundle:
    """A leaf for ``site`` signed by an intermediate CA that the job CA signed: the chain
    OpenSSL accepts although the job CA says pathlen 0."""
    ca_cert = x509.load_pem_x509_certificate((ca_folder / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_folder / "ca-key.pem").read_bytes(), None)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    mid_key, leaf_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )

    def cert(subject, issuer, key, signer, ca: bool):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        return b.sign(signer, hashes.SHA256())

    mid = cert(_name("intermediate", "ca"), ca_cert.subject, mid_key, ca_key, ca=True)
    leaf = cert(_name(site, "site"), mid.subject, leaf_key, mid_key, ca=False)
    pem = serialization.Encoding.PEM
    chain = leaf.public_bytes(pem) + mid.public_bytes(pem)
    key = leaf_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    out.mkdir(parents=True, exist_ok=True)
    return Bundle(chain, key, ca_cert.public_bytes(pem))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = init_ca(root / "ca", "limits-test")
    issue(ca, "coordinator", "coordinator", root / "server", hosts=("127.0.0.1", "localhost"))
    for name in ("site-a", "site-b", "site-evil", "site-gone"):
        issue(ca, "site", name, root / name)
    issue(ca, "operator", "ops", root / "ops")
    result = run_cli("certs", "revoke", "--site", "site-gone", "--ca", str(ca))
    assert result.returncode == 0, result.stderr
    return root


@pytest.fixture(scope="module")
def coord(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("limits-coord")
    cfg = job_config(
        name="limits-job",
        rounds={"min_sites": 2, "max_sites": 3},
        server={"request_timeout_s": REQUEST_TIMEOUT_S},
    )
    proc = CoordinatorProcess(
        write_config(folder, cfg),
        folder / "state",
        folder / "coordinator.log",
        tls_dir=pki / "server",
        crl=pki / "ca" / "crl.pem",
    )
    proc.start()
    yield proc
    proc.stop()


def channel(coord, pki, who: str) -> grpc.Channel:
    return open_channel(coord.address, Bundle.load(pki / who), own_connection=True)


def honest_heartbeat(coord, pki):
    """A heartbeat from site-b with no lease: the coordinator answers it (ABORTED, no lease)
    at once when it has a thread for it."""
    stub = pb_grpc.CoordinatorStub(channel(coord, pki, "site-b"))

    def call():
        try:
            stub.Heartbeat(pb.HeartbeatRequest(lease=pb.Lease(site="site-b", token=1)), timeout=5)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise

    return call


def test_admit_counts_per_caller_and_kind():
    from collections import Counter

    held = Counter({("site 'a'", "push"): LIMITS.push, ("site 'a'", "control"): 1})
    assert "push" in admit(held, "site 'a'", "push", LIMITS)
    assert admit(held, "site 'b'", "push", LIMITS) is None  # another site is not affected
    assert admit(held, "site 'a'", "control", LIMITS) is None


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def test_the_watchdog_cancels_only_what_overstays():
    dog = CallWatchdog()
    try:
        late, on_time = FakeCall(), FakeCall()
        dog.arm(0.2, late, "late")
        dog.disarm(dog.arm(0.2, on_time, "on time"))
        for _ in range(500):  # a busy stream: armed and disarmed once per chunk
            dog.disarm(dog.arm(30.0, FakeCall(), "chunk"))
        assert late.cancelled.wait(5)
        time.sleep(0.3)
        assert not on_time.cancelled.is_set()
        assert dog.cancelled == 1 and dog.armed() == 0
        assert len(dog._heap) < 200  # spent entries do not pile up
    finally:
        dog.stop()


def test_held_calls_do_not_starve_honest_heartbeats(coord, pki):
    evil = channel(coord, pki, "site-evil")
    held = [HeldCalls(evil, method, 20) for method in (HEARTBEAT, JOIN)]
    try:
        # Beyond its share (Join and Heartbeat count together), the attacker's calls are
        # refused at once, not parked.
        time.sleep(0.5)
        assert sum(c.ended()["RESOURCE_EXHAUSTED"] for c in held) == 40 - LIMITS.control
        latencies, failures = probe_latencies(honest_heartbeat(coord, pki), seconds=1.5)
        assert not failures, failures
        assert latencies
        # The calls it kept are cancelled once their request is overdue.
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 5
        while any(c.open() for c in held) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(c.open() for c in held)
        assert sum(c.ended()["CANCELLED"] for c in held) == LIMITS.control
    finally:
        for calls in held:
            calls.release()
    assert coord.proc.poll() is None


def test_a_revoked_certificate_is_refused_before_its_request(coord, pki):
    calls = HeldCalls(channel(coord, pki, "site-gone"), HEARTBEAT, 40)
    try:
        deadline = time.monotonic() + 5
        while calls.open() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls.ended() == {"UNAUTHENTICATED": 40}
    finally:
        calls.release()
    latencies, failures = probe_latencies(honest_heartbeat(coord, pki), seconds=0.5)
    assert not failures and latencies


def test_one_site_holding_push_streams_does_not_block_another(coord, pki):
    held = HeldCalls(channel(coord, pki, "site-evil"), BULK_PUSH, LIMITS.push + 3)
    try:
        time.sleep(0.5)
        assert held.ended() == {"RESOURCE_EXHAUSTED": 3}
        # site-b's push gets past the limits: refused for its lease, not for want of a slot.
        header = pb.PushMessage(
            header=pb.PushHeader(
                lease=pb.Lease(site="site-b", token=1), round=0, upload_id="u", weight=1.0
            )
        ).SerializeToString()
        push = channel(coord, pki, "site-b").stream_unary(
            BULK_PUSH, request_serializer=None, response_deserializer=pb.PushReply.FromString
        )
        with pytest.raises(grpc.RpcError) as err:
            push(iter([header]), timeout=5)
        assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
    finally:
        held.release()


def test_a_leaf_signed_by_an_intermediate_is_not_an_identity(coord, pki, tmp_path):
    bundle = _intermediate_leaf(pki / "ca", tmp_path / "mid", "site-a")
    stub = pb_grpc.CoordinatorStub(open_channel(coord.address, bundle, own_connection=True))
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(pb.JoinRequest(site="site-a"), timeout=5)
    # Refused at the handshake or by the coordinator; never let in as site-a.
    assert err.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE)
    if err.value.code() == grpc.StatusCode.UNAUTHENTICATED:
        assert "not issued by the job CA itself" in err.value.details()
    ops = pb_grpc.CoordinatorStub(channel(coord, pki, "ops"))
    assert "site-a" not in {s.site for s in ops.Status(pb.StatusRequest(), timeout=5).sites}


class Attack:
    """Keeps ``n`` held calls of each method open from ``channels`` until stopped: as soon as
    the coordinator cancels or refuses some, new ones take their place."""

    METHODS = (
        HEARTBEAT,
        JOIN,
        "/isthmus.v1.Coordinator/WaitRound",
        BULK_PUSH,
        "/isthmus.v1.Bulk/Fetch",
    )

    def __init__(self, channels: list[grpc.Channel], n: int = 10) -> None:
        self.channels, self.n = channels, n
        self.held: list[HeldCalls] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Attack:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for ch in self.channels:
                for method in self.METHODS:
                    self.held.append(HeldCalls(ch, method, self.n))
            self._stop.wait(1.0)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for calls in self.held:
            calls.release()

    def outcomes(self) -> Counter:
        total = Counter()
        for calls in self.held:
            total.update(calls.ended())
        return total


def test_a_job_completes_while_certificate_holders_hold_calls(pki, tmp_path, tmp_path_factory):
    import test_coordinator_e2e as e2e

    cfg = job_config(strategy=e2e.STRATEGIES["fedavg"], server={"request_timeout_s": 2.0})
    coord = CoordinatorProcess(
        write_config(tmp_path, cfg),
        tmp_path / "state",
        tmp_path / "coordinator.log",
        tls_dir=pki / "server",
        crl=pki / "ca" / "crl.pem",
    )
    coord.start()
    ops = Bundle.load(pki / "ops")
    tls = {site: (Bundle.load(pki / site), ops) for site in e2e.SITES}
    probe = pb_grpc.CoordinatorStub(open_channel(coord.address, ops, own_connection=True))
    probed: dict = {}

    def during(logs):
        probed["latencies"], probed["failures"] = probe_latencies(
            lambda: probe.Status(pb.StatusRequest(), timeout=5),
            seconds=60.0,
            until=lambda: all(log.final or log.error for log in logs),
        )

    attackers = [channel(coord, pki, "site-evil"), channel(coord, pki, "site-gone")]
    try:
        with Attack(attackers) as attack:
            logs = e2e.run_job(coord, during=during, tls=tls)
        hashes = e2e.check_job(logs, e2e.STRATEGIES["fedavg"])
        assert coord.wait(timeout=20) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert hashes == e2e.crash_free_hashes(tmp_path_factory, "fedavg")
    assert not probed["failures"], probed["failures"]
    assert probed["latencies"]
    seen = attack.outcomes()
    assert seen["UNAUTHENTICATED"] > 0 and seen["RESOURCE_EXHAUSTED"] > 0, seen
    for log in logs:  # no honest call was refused for the attacker's sake, or fenced
        assert not [x for x in log.retries if "RESOURCE_EXHAUSTED" in x or "ABORTED" in x]


def test_only_direct_client_leaves_of_the_job_ca_are_identities(pki, tmp_path):
    ca_cert = x509.load_pem_x509_certificate((pki / "ca" / "ca.pem").read_bytes())
    assert verify_leaf(Bundle.load(pki / "site-a").cert, ca_cert).name == "site-a"
    chained = _intermediate_leaf(pki / "ca", tmp_path / "mid", "site-a")
    with pytest.raises(IdentityError, match="not issued by the job CA itself"):
        verify_leaf(chained.cert, ca_cert)
    other = init_ca(tmp_path / "other", "other")
    issue(other, "site", "site-a", tmp_path / "other-a")
    with pytest.raises(IdentityError, match="not issued by the job CA itself"):
        verify_leaf(Bundle.load(tmp_path / "other-a").cert, ca_cert)
    # The job CA's own certificate is not a site, whatever its subject says.
    with pytest.raises(IdentityError, match="CA certificate"):
        verify_leaf((pki / "ca" / "ca.pem").read_bytes(), ca_cert)
