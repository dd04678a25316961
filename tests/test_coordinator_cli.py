"""The ``coordinator`` command line: config errors, ``status``, and refusals to start."""

from __future__ import annotations

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from wire.proto import isthmus_pb2 as pb

pytestmark = pytest.mark.e2e


def one_line_error(result) -> str:
    assert result.returncode != 0, result
    lines = [
        line
        for line in result.stderr.strip().splitlines()
        if not line.startswith("WARNING: --insecure")  # asked for, so said once
    ]
    assert len(lines) == 1, f"expected a one-line error, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return lines[0]


def serve(tmp_path, cfg: dict, *extra: str):
    path = h.write_config(tmp_path, cfg)
    return h.run_cli("serve", "--config", str(path), "--insecure", *extra)


def _without(cfg: dict, table: str, key: str) -> dict:
    del cfg[table][key]
    return cfg


@pytest.mark.parametrize(
    "cfg, words",
    [
        (_without(h.job_config(), "rounds", "total"), ["rounds.total", "missing"]),
        (_without(h.job_config(), "job", "name"), ["job.name", "missing"]),
        (h.job_config(rounds={"min_sites": "two"}), ["rounds.min_sites", "integer", "'two'"]),
        # A `coordinator serve` each (2-3 s); the config's own tests check these in-process.
        pytest.param(
            h.job_config(timeouts={"lease_ttl_s": True}),
            ["timeouts.lease_ttl_s", "boolean"],
            marks=pytest.mark.slow,
        ),
        (h.job_config(rounds={"totl": 3}), ["rounds.totl", "unknown key"]),
        pytest.param(
            h.job_config(rounds={"total": 0}), ["rounds.total", "> 0"], marks=pytest.mark.slow
        ),
        (h.job_config(server={"listen": "nowhere"}), ["server.listen", "HOST:PORT"]),
    ],
    ids=["missing", "missing-name", "wrong-type", "bool", "unknown", "not-positive", "listen"],
)
def test_serve_refuses_a_bad_config(tmp_path, cfg, words):
    result = serve(tmp_path, cfg)
    assert result.returncode == 2
    line = one_line_error(result)
    assert line.startswith("coordinator: error:")
    for word in words:
        assert word in line, line
    assert not (tmp_path / "state").exists(), "a refused config must not create state"


def test_serve_refuses_a_bad_strategy_parameter(tmp_path):
    """Found only once the strategy is built (after the torch import): still one clean line."""
    result = serve(tmp_path, h.job_config(strategy={"name": "diloco", "lr": "fast"}))
    assert result.returncode == 2
    line = one_line_error(result)
    assert "strategy.lr" in line and "'fast'" in line, line


def test_serve_with_a_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    result = h.run_cli("serve", "--config", str(missing))
    assert result.returncode == 2
    line = one_line_error(result)
    assert str(missing) in line and "No such file" in line, line


def test_serve_with_a_config_that_is_not_toml(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[job\nname = 1\n")
    result = h.run_cli("serve", "--config", str(path))
    assert result.returncode == 2
    assert "not valid TOML" in one_line_error(result)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["serve", "--config", "x.toml", "--bogus"], ["unrecognized arguments: --bogus"]),
        (["frobnicate"], ["invalid choice", "frobnicate"]),
        (["serve"], ["--config"]),
        (["status"], ["--coordinator"]),
    ],
    ids=["unknown-flag", "unknown-command", "serve-without-config", "status-without-address"],
)
def test_bad_command_lines(argv, words):
    result = h.run_cli(*argv)
    assert result.returncode == 2
    for word in words:
        assert word in result.stderr, result.stderr


def test_status_of_an_unreachable_coordinator():
    address = f"127.0.0.1:{h.free_port()}"
    result = h.run_cli("status", "--coordinator", address, "--timeout", "3", "--insecure")
    assert result.returncode != 0
    line = one_line_error(result)
    assert address in line and "UNAVAILABLE" in line, line
    assert result.stdout == ""


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-running")
    cfg = h.job_config(
        name="cli-job",
        rounds={"total": 4, "min_sites": 2, "max_sites": 3, "join_window_s": 0.2},
        timeouts={"heartbeat_interval_s": 1.0, "lease_ttl_s": 20.0},
    )
    coord = h.start_coordinator(folder, cfg)
    raw = h.RawStub(coord.address)
    try:
        for site in ("alpha-dc", "beta-dc"):
            raw.stub.Join(pb.JoinRequest(site=site), timeout=10)
        h.wait_until(lambda: raw.status().updates_expected == 2, what="round 0 to open")
        yield coord
    finally:
        raw.close()
        coord.kill()


def test_status_prints_round_and_sites(running):
    result = h.run_cli("status", "--coordinator", running.address, "--insecure")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "job cli-job" in out and "round 0/4" in out, out
    assert "updates 0/2" in out and "strategy FedAvg" in out, out
    lines = out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("SITE"))) :]
    assert table[0].split()[:3] == ["SITE", "STATE", "TOKEN"]
    rows = {row.split()[0]: row.split() for row in table[1:]}
    assert set(rows) == {"alpha-dc", "beta-dc"}, out
    assert all(row[1] == "active" for row in rows.values()), out


def test_second_coordinator_on_the_same_state_is_refused(running):
    result = h.run_cli(
        "serve", "--config", str(running.config_path), "--listen", "127.0.0.1:0", "--insecure"
    )
    assert result.returncode == 2
    line = one_line_error(result)
    assert "in use by another coordinator" in line and str(running.state_dir) in line, line
    assert running.proc.poll() is None, "the running coordinator must be left alone"
    # ... and the running one still answers, on the round it was in.
    assert h.status(running.address).round.round == 0


def test_serve_on_a_port_in_use(running, tmp_path):
    result = h.run_cli(
        "serve",
        "--config",
        str(running.config_path),
        "--state-dir",
        str(tmp_path / "other-state"),
        "--listen",
        running.address,
        "--insecure",
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]  # grpc's own bind error log comes first
    assert line.startswith("coordinator: error: cannot listen"), result.stderr
    assert running.address in line, line
    assert not (tmp_path / "other-state" / "checkpoints").exists(), "no state before listening"
