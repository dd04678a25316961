"""Command-line conventions: ``--version``, a ``--help`` that loads neither torch nor grpc,
the agent's flags from ``ISTHMUS_*`` variables, ``--set`` overrides, ``--listen`` checked,
certificate names that stay in their folder."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from .test_coordinator_cli import one_line_error
except ImportError:
    import coord_harness as h
    from test_coordinator_cli import one_line_error

from coordinator.config import load_config
from coordinator.records import NAME_RE
from wire.config_table import ConfigError
from wire.identity import PARTY_NAME_RE

TRAIN = str(h.REPO / "examples" / "gpt_diloco" / "train.py")


@pytest.mark.parametrize(
    "module, prog", [("coordinator.cli", "coordinator"), ("site_client.cli", "siteclient")]
)
def test_version(module, prog):
    result = h.run_cli_module(module, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == prog and result.stdout.split()[1][0].isdigit()


@pytest.mark.parametrize(
    "module, argv",
    [
        ("coordinator.cli", ["--help"]),
        ("coordinator.cli", ["serve", "--help"]),
        ("coordinator.cli", ["export", "--help"]),
        ("site_client.cli", ["start", "--help"]),
    ],
)
def test_help_loads_neither_torch_nor_grpc(module, argv):
    code = (
        f"import sys, {module} as m\n"
        f"try:\n    m.main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('LOADED', [x for x in ('torch', 'grpc') if x in sys.modules])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=h.subprocess_env(), capture_output=True, text=True
    )
    assert "usage:" in result.stdout, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "LOADED []", result.stdout[-300:]


def test_agent_flags_from_the_environment(tmp_path):
    address = f"127.0.0.1:{h.free_port()}"
    env = {
        "ISTHMUS_RUN_DIR": str(tmp_path / "run"),
        "ISTHMUS_COORDINATOR": address,
        "ISTHMUS_SITE": "env-site",
        "ISTHMUS_INSECURE": "1",
        "ISTHMUS_CONNECT_TIMEOUT": "1",
    }
    result = h.run_cli_module("site_client.cli", "start", "--", TRAIN, env=env)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"siteclient: error: cannot join the job at {address}"), last


def test_a_flag_beats_its_variable():
    env = {"ISTHMUS_COORDINATOR": "127.0.0.1:1", "ISTHMUS_SITE": "a", "ISTHMUS_INSECURE": "1"}
    result = h.run_cli_module(
        "site_client.cli",
        "start",
        "--inner-steps",
        "0",
        "--",
        TRAIN,
        env={**env, "ISTHMUS_INNER_STEPS": "5"},
    )
    assert result.returncode == 2
    assert "--inner-steps must be > 0, got 0" in one_line_error(result)
    result = h.run_cli_module(
        "site_client.cli", "start", "--", TRAIN, env={**env, "ISTHMUS_INNER_STEPS": "0"}
    )
    assert result.returncode == 2
    assert "--inner-steps must be > 0, got 0" in one_line_error(result)


@pytest.mark.parametrize(
    "override, words",
    [
        ("rounds.totl=3", ["rounds.totl", "unknown key"]),
        # A `coordinator serve` each (3 s); the config's own tests check these rules in-process.
        pytest.param("rounds.total=zero", ["rounds.total", "'zero'"], marks=pytest.mark.slow),
        pytest.param("rounds.total=0", ["rounds.total", "> 0"], marks=pytest.mark.slow),
        ("total=3", ["--set total=3", "TABLE.KEY=VALUE"]),
        pytest.param("rounds.total.x=1", ["rounds.total is not a table"], marks=pytest.mark.slow),
    ],
    ids=["unknown", "wrong-type", "out-of-range", "no-table", "not-a-table"],
)
def test_set_is_checked_like_the_file(tmp_path, override, words):
    path = h.write_config(tmp_path, h.job_config())
    result = h.run_cli("serve", "--config", str(path), "--insecure", "--set", override)
    assert result.returncode == 2
    line = one_line_error(result)
    assert all(w in line for w in words), line
    assert not (tmp_path / "state").exists()


def test_set_changes_what_the_coordinator_and_the_sites_get(tmp_path):
    path = h.write_config(tmp_path, h.job_config())
    sets = [
        "rounds.total=7",
        "job.name=trial-2",
        "job.state_dir=elsewhere",
        'compression.default={ codec = "int8" }',
    ]
    cfg = load_config(path, sets)
    assert (cfg.rounds.total, cfg.name) == (7, "trial-2")
    assert cfg.state_dir == tmp_path / "elsewhere", "relative to the config file, like the file"
    handed = tomllib.loads(cfg.source_toml.decode())
    assert handed["rounds"]["total"] == 7 and handed["compression"]["default"]["codec"] == "int8"
    with pytest.raises(ConfigError, match="model.kwargs"):
        load_config(path, ["model.kwargs=3"])


def test_listen_is_checked(tmp_path):
    path = h.write_config(tmp_path, h.job_config())
    result = h.run_cli("serve", "--config", str(path), "--insecure", "--listen", "7073")
    assert result.returncode == 2
    line = one_line_error(result)
    assert line == "coordinator: error: --listen 7073: expected 'HOST:PORT' (e.g. '0.0.0.0:7070')"
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    "module, argv",
    [
        ("coordinator.cli", ["status", "--insecure", "--coordinator", "7073"]),
        ("site_client.cli", ["start", "--insecure", "--site", "a", "--coordinator", "7073"]),
    ],
)
def test_a_bare_port_is_refused(module, argv):
    result = h.run_cli_module(module, *argv, *(["--", TRAIN] if argv[0] == "start" else []))
    assert result.returncode == 2
    line = one_line_error(result)
    assert "--coordinator 7073: expected 'HOST:PORT'" in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ["issue", "--site", "../evil"],
        ["issue", "--site", "a/b"],
        ["operator", "--name", ".."],
        ["issue", "--site", "x\n"],
    ],
)
def test_certificate_names_stay_in_their_folder(tmp_path, argv):
    pki = tmp_path / "pki"
    assert h.run_cli("certs", "init", "--out", str(pki)).returncode == 0
    before = sorted(p for p in tmp_path.rglob("*"))
    result = h.run_cli("certs", *argv, "--ca", str(pki))
    assert result.returncode == 2
    assert "use 1-63 letters, digits" in one_line_error(result)
    assert sorted(p for p in tmp_path.rglob("*")) == before, "nothing written"


def test_party_names_are_the_coordinators_site_names():
    for name in ["site-0", "dc.east_1", "A", "x" * 63, "x" * 64, "..", ".a", "a/b", "", "a b"]:
        assert bool(PARTY_NAME_RE.fullmatch(name)) == bool(NAME_RE.fullmatch(name)), name
