"""The status page's pure parts (access, routes, documents) and its HTTP(S) server on a real
socket with fixed documents: who is let in, what each method and path is answered."""

from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path

import pytest

try:
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from coordinator.events.history import rounds_of
from coordinator.events.log import EventLog, EventsConfig
from coordinator.events.segments import read_events
from coordinator.observe.page_access import (
    PageAccess,
    PageAccessError,
    host_header_ok,
    page_access,
    server_context,
)
from coordinator.observe.page_history import LogFollower, history_doc
from coordinator.observe.status_page import PageSources, StatusPageServer, content_policy, respond
from coordinator.service.auth import Authorizer, RevocationList
from wire.identity import Bundle, init_ca, issue, revoke

SOURCES = PageSources(lambda: {"job_name": "j", "loss": float("nan")}, lambda: {"rounds": []})


@pytest.mark.parametrize(
    ("text", "tls", "insecure", "want"),
    [
        ("8080", False, False, PageAccess("127.0.0.1", 8080, "loopback")),
        ("localhost:0", False, False, PageAccess("localhost", 0, "loopback")),
        ("[::1]:9", True, True, PageAccess("::1", 9, "loopback")),
        ("0.0.0.0:8080", True, False, PageAccess("0.0.0.0", 8080, "tls")),
        ("10.0.0.5:8080", False, True, PageAccess("10.0.0.5", 8080, "insecure")),
        ("10.0.0.5:8080", True, True, PageAccess("10.0.0.5", 8080, "insecure")),
    ],
)
def test_page_access_by_address_and_flags(text, tls, insecure, want):
    assert page_access(text, tls=tls, insecure=insecure) == want


def test_a_page_off_loopback_without_tls_or_the_flag_is_refused_naming_both():
    with pytest.raises(PageAccessError) as err:
        page_access("0.0.0.0:8080", tls=False, insecure=False)
    message = str(err.value)
    assert "--tls-dir" in message and "--status-page-insecure" in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["", "page", "host:", ":70000"])
def test_a_bad_page_address_says_what_to_give(text):
    with pytest.raises(PageAccessError, match="--status-page .*give PORT"):
        page_access(text, tls=False, insecure=False)


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("127.0.0.1:8080", True),
        ("localhost:8080", True),
        ("LOCALHOST", True),
        ("[::1]:8080", True),
        ("127.0.0.2", True),
        ("evil.example:8080", False),  # a name rebound to 127.0.0.1
        ("", False),
        (None, False),
        ("[::1", False),
    ],
)
def test_a_loopback_page_answers_only_loopback_host_headers(header, ok):
    assert host_header_ok(PageAccess("127.0.0.1", 1, "loopback"), header) is ok
    assert host_header_ok(PageAccess("0.0.0.0", 1, "insecure"), header)


def test_routes():
    page = respond("GET", "/", SOURCES)
    assert page.status == 200 and b"<svg" in page.body and page.content_type.startswith("text/html")
    status = respond("GET", "/status.json?t=5", SOURCES)
    assert status.status == 200 and json.loads(status.body) == {"job_name": "j", "loss": None}
    assert json.loads(respond("HEAD", "/history.json", SOURCES).body) == {"rounds": []}
    assert respond("GET", "/nothing", SOURCES).status == 404
    assert respond("GET", "/../status.json", SOURCES).status == 404
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"):
        refused = respond(method, "/status.json", SOURCES)
        assert refused.status == 405 and ("Allow", "GET, HEAD") in refused.headers


def test_the_page_loads_nothing_from_elsewhere_and_its_policy_allows_only_itself():
    body = respond("GET", "/", SOURCES).body.decode()
    assert "http://" not in body.replace('"http://www.w3.org/2000/svg"', "")
    assert "https://" not in body and " src=" not in body and "<link" not in body
    policy = content_policy(body.encode())
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert policy.count("'sha256-") == 2  # the one script and the one style


def _round(log: EventLog, r: int, loss: float) -> None:
    log.append("round_open", round=r)
    log.append("update", round=r, site="a", bytes=100)
    log.append("round_closed", round=r, losses={"a": loss}, update_bytes=100, updates=["a"])


def test_the_follower_reads_what_history_reads_across_rotation(tmp_path):
    path = tmp_path / "events.jsonl"
    follower = LogFollower(path)
    assert follower.rounds() == []  # no log yet
    with EventLog(path, EventsConfig(rotate_bytes=600, keep_segments=10)) as log:
        for r in range(12):
            _round(log, r, 1.0 / (r + 1))
            if r % 3 == 2:
                log.rotate()
            if r % 2:
                assert follower.rounds() == rounds_of(read_events(path))
        with open(path, "ab") as f:
            f.write(b'{"seq": 999, "kind": "round_cl')  # an append in progress: not yet read
        assert follower.rounds() == rounds_of(read_events(path))
    assert len(follower.rounds()) == 12 and (tmp_path / "events").is_dir()


def test_history_doc_thins_long_jobs_and_counts_every_byte(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        for r in range(25):
            _round(log, r, 2.0)
    doc = history_doc(rounds_of(read_events(path)), limit=10)
    assert doc["closed_rounds"] == 25 and doc["every"] == 3
    assert [row["round"] for row in doc["rounds"]] == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    last = doc["rounds"][-1]
    assert last["total_update_bytes"] == 2500 and last["mean_loss"] == 2.0


# ---- the server on a real socket --------------------------------------------------------------


def _get(port: int, path: str = "/status.json", method: str = "GET", host=None, context=None):
    cls = http.client.HTTPSConnection if context else http.client.HTTPConnection
    kw = {"context": context} if context else {}
    conn = cls("127.0.0.1", port, timeout=10, **kw)
    try:
        conn.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def test_plain_loopback_server_answers_reads_only(tmp_path):
    server = StatusPageServer(PageAccess("127.0.0.1", 0, "loopback"), SOURCES)
    server.start()
    try:
        port = server.server_address[1]
        assert _get(port) == (200, b'{"job_name": "j", "loss": null}')
        assert _get(port, method="HEAD") == (200, b"")
        assert _get(port, "/x")[0] == 404
        assert _get(port, method="POST")[0] == 405
        assert _get(port, method="BREW")[0] == 405
        assert _get(port, host="evil.example:80")[0] == 403
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    ca = tmp_path_factory.mktemp("pki")
    init_ca(ca, "pagejob")
    issue(ca, "coordinator", "coordinator", ca / "coordinator", hosts=("127.0.0.1",))
    issue(ca, "operator", "alice", ca / "operators" / "alice")
    issue(ca, "operator", "bob", ca / "operators" / "bob")
    issue(ca, "site", "site-a", ca / "sites" / "site-a")
    revoke(ca, "operator", "bob")
    return ca


def _client(pki: Path, bundle: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if bundle:
        ctx.load_cert_chain(pki / bundle / "cert.pem", pki / bundle / "key.pem")
    return ctx


def test_tls_page_lets_in_only_unrevoked_operators_of_the_job_ca(pki, tmp_path):
    bundle = Bundle.load(pki / "coordinator")
    authorizer = Authorizer(RevocationList(pki / "crl.pem", bundle.ca))
    access = PageAccess("0.0.0.0", 0, "tls")
    server = StatusPageServer(access, SOURCES, server_context(bundle), authorizer)
    server.start()
    try:
        port = server.server_address[1]
        assert _get(port, context=_client(pki, "operators/alice"))[0] == 200
        status, body = _get(port, context=_client(pki, "sites/site-a"))
        assert status == 403 and b"needs an operator certificate" in body
        status, body = _get(port, context=_client(pki, "operators/bob"))
        assert status == 403 and b"revoked" in body
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _get(port, context=_client(pki, None))  # no client certificate: no handshake
        other = tmp_path / "other"
        init_ca(other, "other")
        issue(other, "operator", "alice", other / "alice")
        foreign = _client(pki, None)
        foreign.load_cert_chain(other / "alice" / "cert.pem", other / "alice" / "key.pem")
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _get(port, context=foreign)  # another CA's operator
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            _get(port)  # plain HTTP to the TLS port
    finally:
        server.shutdown()
        server.server_close()


def test_serve_refuses_a_page_off_loopback_in_one_line_before_touching_state(tmp_path):
    path = h.write_config(tmp_path, h.job_config())
    done = h.run_cli("serve", "--config", str(path), "--insecure", "--status-page", "0.0.0.0:0")
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "--tls-dir" in error[0] and "--status-page-insecure" in error[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "state").exists()
    done = h.run_cli("serve", "--config", str(path), "--insecure", "--status-page-insecure")
    assert done.returncode == 2 and "needs --status-page" in done.stderr


def test_serve_off_loopback_with_tls_asks_for_an_operator_of_the_job(pki, tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()
    coord = h.CoordinatorProcess(
        h.write_config(folder, h.job_config()),
        folder / "state",
        folder / "coordinator.log",
        tls_dir=pki / "coordinator",
        crl=pki / "crl.pem",
        extra_args=("--status-page", "0.0.0.0:0"),
    )
    coord.start()
    try:
        port = int((folder / "state" / "status_page_address").read_text().rpartition(":")[2])
        status, body = _get(port, context=_client(pki, "operators/alice"))
        assert status == 200 and json.loads(body)["job_name"] == "testjob"
        assert _get(port, context=_client(pki, "sites/site-a"))[0] == 403
        assert _get(port, context=_client(pki, "operators/bob"))[0] == 403  # the --crl
    finally:
        coord.kill()
