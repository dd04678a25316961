"""TLS problems no retry fixes are said at once, in one line that names the fix; refusals are
not "no answer". A real coordinator whose certificate holds only ``localhost``."""

from __future__ import annotations

import time

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from .test_coordinator_cli import one_line_error
except ImportError:
    import coord_harness as h
    from test_coordinator_cli import one_line_error

from site_client.errors import TlsRefused
from site_client.transfer.client import CoordinatorClient
from wire.identity import Bundle, init_ca, issue
from wire.net.tls_probe import host_matches, looks_like_tls

pytestmark = pytest.mark.e2e
TRAIN = str(h.REPO / "examples" / "gpt_diloco" / "train.py")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = init_ca(root / "ca", "diagnosis")
    issue(ca, "coordinator", "coordinator", root / "server", hosts=("localhost",))
    issue(ca, "site", "site-a", root / "site-a")
    issue(ca, "operator", "ops", root / "ops")
    rogue = init_ca(root / "rogue-ca", "someone else")
    issue(rogue, "operator", "ops", root / "rogue-ops")
    issue(rogue, "site", "site-a", root / "rogue-a")
    return root


@pytest.fixture(scope="module")
def coord(pki, tmp_path_factory):
    folder = tmp_path_factory.mktemp("coord")
    path = h.write_config(folder, h.job_config(name="diag"))
    proc = h.CoordinatorProcess(path, folder / "state", folder / "log", tls_dir=pki / "server")
    proc.start()
    yield proc
    proc.stop()


def by_ip(coord) -> str:
    return f"127.0.0.1:{coord.port}"  # the certificate holds only "localhost"


def test_status_names_the_host_the_certificate_and_the_fix(coord, pki):
    started = time.monotonic()
    result = h.run_cli("status", "--coordinator", by_ip(coord), "--tls-dir", str(pki / "ops"))
    assert time.monotonic() - started < 15
    assert result.returncode == 1
    line = one_line_error(result)
    assert line.startswith(f"coordinator: error: cannot talk to {by_ip(coord)}: TLS:"), line
    assert "not valid for '127.0.0.1', the host dialled (it holds: localhost)" in line, line
    assert "coordinator certs server --ca PKI --host localhost --host 127.0.0.1" in line, line


def test_siteclient_gives_up_at_once_on_a_hostname_mismatch(coord, pki, tmp_path):
    started = time.monotonic()
    result = h.run_cli_module(
        "site_client.cli",
        "start",
        "--coordinator",
        by_ip(coord),
        "--site",
        "site-a",
        "--tls-dir",
        str(pki / "site-a"),
        "--run-dir",
        str(tmp_path / "run"),
        "--",
        TRAIN,
    )
    assert time.monotonic() - started < 20, "retried a permanent TLS problem"
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"siteclient: error: cannot join the job at {by_ip(coord)}: TLS:")
    assert "it holds: localhost" in last and "--host 127.0.0.1" in last, last
    assert "join failed" not in result.stderr, "no retries"


def test_status_with_another_jobs_ca(coord, pki):
    address = f"localhost:{coord.port}"
    result = h.run_cli("status", "--coordinator", address, "--tls-dir", str(pki / "rogue-ops"))
    assert result.returncode == 1
    line = one_line_error(result)
    assert "does not verify against this bundle's ca.pem" in line, line


def test_a_certificate_the_coordinator_refuses(coord, pki):
    rogue = Bundle.load(pki / "rogue-a")
    trusting = Bundle(rogue.cert, rogue.key, (pki / "ca" / "ca.pem").read_bytes())
    client = CoordinatorClient(
        f"localhost:{coord.port}", "site-a", tls=trusting, backoff=h.FAST_BACKOFF
    )
    started = time.monotonic()
    with pytest.raises(TlsRefused, match="refused this bundle's certificate"):
        client.join()
    client.close()
    assert time.monotonic() - started < 10


def test_a_refusal_is_not_no_answer(coord, pki):
    address = f"localhost:{coord.port}"
    result = h.run_cli("status", "--coordinator", address, "--tls-dir", str(pki / "site-a"))
    assert result.returncode == 1
    line = one_line_error(result)
    assert line == (
        f"coordinator: error: {address} refused the call (PERMISSION_DENIED): a site "
        "certificate ('site-a') may not call this; it needs an operator certificate"
    ), line


def test_host_matching_rules():
    assert host_matches("127.0.0.1", ["localhost", "127.0.0.1"])
    assert not host_matches("127.0.0.1", ["localhost"])
    assert host_matches("::1", ["0:0:0:0:0:0:0:1"])
    assert host_matches("Coord.Example.org", ["coord.example.org"])
    assert host_matches("a.example.org", ["*.example.org"])
    assert not host_matches("a.b.example.org", ["*.example.org"])
    assert looks_like_tls("Custom verification check failed: Hostname Verification Check failed")
    assert not looks_like_tls("failed to connect to all addresses: Connection refused")
