"""The job config (coordinator/config.py): valid files load, every mistake names its key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.config import ConfigError, load_config

VALID = """
[job]
name = "gpt-diloco"
state_dir = "state"

[model]
factory = "examples.gpt_diloco.model:build_model"
seed = 3
kwargs = { d_model = 128 }

[strategy]
name = "diloco"
lr = 0.7
momentum = 0.9

[rounds]
total = 10
inner_steps = 50
min_sites = 2
max_sites = 16
join_window_s = 5
deadline_s = 1800.0

[timeouts]
heartbeat_interval_s = 5.0
lease_ttl_s = 30.0

[server]
listen = "0.0.0.0:7070"
max_update_bytes = 1073741824
workers = 8
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def _edit(old: str, new: str, text: str = VALID) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def _error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    return str(info.value)


def test_valid_config_loads(tmp_path: Path):
    cfg = load_config(_write(tmp_path, VALID))
    assert cfg.name == "gpt-diloco"
    assert cfg.state_dir == tmp_path.resolve() / "state"
    assert cfg.model.factory == "examples.gpt_diloco.model:build_model"
    assert cfg.model.path is None and cfg.model.seed == 3 and cfg.model.kwargs == {"d_model": 128}
    assert cfg.strategy.name == "diloco"
    assert cfg.strategy.params == {"lr": 0.7, "momentum": 0.9}
    r = cfg.rounds
    assert (r.total, r.inner_steps, r.min_sites, r.max_sites) == (10, 50, 2, 16)
    assert r.join_window_s == 5.0 and isinstance(r.join_window_s, float)
    assert r.deadline_s == 1800.0
    assert cfg.timeouts.heartbeat_interval_s == 5.0 and cfg.timeouts.lease_ttl_s == 30.0
    assert cfg.server.listen == "0.0.0.0:7070"
    assert cfg.server.max_update_bytes == 1 << 30 and cfg.server.workers == 8
    assert cfg.source_toml == VALID.encode()


def test_minimal_config_gets_defaults(tmp_path: Path):
    text = '[job]\nname = "j"\n[model]\npath = "w/theta0.safetensors"\n[rounds]\ntotal = 2\n'
    text += "inner_steps = 1\n"
    cfg = load_config(_write(tmp_path, text))
    assert cfg.model.path == tmp_path.resolve() / "w" / "theta0.safetensors"
    assert cfg.model.factory is None
    assert cfg.strategy.name == "diloco" and cfg.strategy.params == {}
    assert cfg.rounds.min_sites == 1 and cfg.state_dir == tmp_path.resolve() / "state"
    assert cfg.timeouts.heartbeat_interval_s < cfg.timeouts.lease_ttl_s < cfg.rounds.deadline_s


def test_absolute_state_dir_is_kept(tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    cfg = load_config(_write(tmp_path, _edit('state_dir = "state"', f'state_dir = "{elsewhere}"')))
    assert cfg.state_dir == elsewhere


@pytest.mark.parametrize(
    ("old", "new", "key", "words"),
    [
        ('name = "gpt-diloco"\n', "", "job.name", "missing"),
        ('name = "gpt-diloco"', 'name = "  "', "job.name", "must not be empty"),
        ("total = 10\n", "", "rounds.total", "missing"),
        ("inner_steps = 50", 'inner_steps = "ten"', "rounds.inner_steps", "expected an integer"),
        ("inner_steps = 50", "inner_steps = 0", "rounds.inner_steps", "must be > 0"),
        ("inner_steps = 50", "inner_steps = -5", "rounds.inner_steps", "must be > 0"),
        ("inner_steps = 50", "inner_steps = 5.0", "rounds.inner_steps", "expected an integer"),
        ("inner_steps = 50", "inner_steps = true", "rounds.inner_steps", "boolean"),
        ("join_window_s = 5", "join_windw_s = 5", "rounds.join_windw_s", "unknown key"),
        ("min_sites = 2", "min_sites = 20", "rounds.max_sites", "rounds.min_sites"),
        ("join_window_s = 5", "join_window_s = -1", "rounds.join_window_s", ">= 0"),
        ("seed = 3", "sed = 3", "model.sed", "unknown key"),
        ('state_dir = "state"', 'statedir = "state"', "job.statedir", "unknown key"),
        ("[server]", "[servers]", "servers", "unknown key"),
        ('listen = "0.0.0.0:7070"', 'listen = "0.0.0.0"', "server.listen", "HOST:PORT"),
        ('listen = "0.0.0.0:7070"', 'listen = ":7070"', "server.listen", "HOST:PORT"),
        ('listen = "0.0.0.0:7070"', 'listen = "host:70000"', "server.listen", "HOST:PORT"),
        ('listen = "0.0.0.0:7070"', 'listen = "host:http"', "server.listen", "HOST:PORT"),
        ('listen = "0.0.0.0:7070"', "listen = 7070", "server.listen", "expected a string"),
        ("workers = 8", "workers = 0", "server.workers", "must be > 0"),
        ("kwargs = { d_model = 128 }", "kwargs = 5", "model.kwargs", "expected dict"),
        ("seed = 3", 'seed = 3\npath = "theta.safetensors"', "model.factory", "model.path"),
        (
            'factory = "examples.gpt_diloco.model:build_model"\n',
            "",
            "model.factory",
            "exactly one",
        ),
        (
            'factory = "examples.gpt_diloco.model:build_model"',
            'factory = "examples.gpt_diloco.model"',
            "model.factory",
            "package.module:function",
        ),
        (
            'factory = "examples.gpt_diloco.model:build_model"',
            'factory = "examples.gpt_diloco.model:"',
            "model.factory",
            "package.module:function",
        ),
        (
            'factory = "examples.gpt_diloco.model:build_model"',
            'path = ""',
            "model.path",
            "must not be empty",
        ),
        ("lease_ttl_s = 30.0", "lease_ttl_s = 5.0", "timeouts.heartbeat_interval_s", "<"),
        ("lease_ttl_s = 30.0", "lease_ttl_s = 2000.0", "rounds.deadline_s", "<"),
        ("lease_ttl_s = 30.0", "lease_ttl_s = 0", "timeouts.lease_ttl_s", "must be > 0"),
        ("lease_ttl_s = 30.0", "lease_ttl_s = 30.0\nheartbeat_s = 1", "timeouts.heartbeat_s", ""),
        ('name = "diloco"', 'name = ""', "strategy.name", "must not be empty"),
        (
            "lease_ttl_s = 30.0",
            "lease_ttl_s = 30.0\nsuspicion_phi = 0",
            "suspicion_phi",
            "(0, 100)",
        ),
        ("lease_ttl_s = 30.0", "lease_ttl_s = 9.0", "timeouts.lease_ttl_s", "suspicion"),
        (
            "lease_ttl_s = 30.0",
            "lease_ttl_s = 30.0\nsuspicion_pause_s = 40.0",
            "timeouts.suspicion_phi",
            "suspicion after",
        ),
        ("[server]", '[data]\nmode = "gossip"\n[server]', "data.mode", "shared"),
        ("[server]", "[data]\nmodes = 1\n[server]", "data.modes", "unknown key"),
        ("[server]", "[speculation]\nenabled = false\n[server]", "speculation", "'shared'"),
        (
            "[server]",
            '[data]\nmode = "shared"\n[speculation]\nslow_factor = 0.5\n[server]',
            "speculation.slow_factor",
            ">= 1",
        ),
        (
            "[server]",
            '[data]\nmode = "shared"\n[speculation]\nslowfactor = 2\n[server]',
            "speculation.slowfactor",
            "unknown key",
        ),
        (
            "[server]",
            '[compression.downlink]\ndefault = "int9"\n[server]',
            "compression.downlink.default.codec",
            "unknown codec",
        ),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, old, new, key, words):
    message = _error(tmp_path, _edit(old, new))
    assert re.search(rf"(^|\W){re.escape(key)}(\W|$)", message), message
    assert words in message, message


def test_table_that_is_not_a_table(tmp_path: Path):
    text = 'job = "x"\n[model]\nfactory = "a:b"\n[rounds]\ntotal = 1\ninner_steps = 1\n'
    message = _error(tmp_path, text)
    assert "job" in message and "expected a table" in message


def test_timeout_hierarchy_message_lists_all_three(tmp_path: Path):
    message = _error(tmp_path, _edit("heartbeat_interval_s = 5.0", "heartbeat_interval_s = 31.0"))
    for key in (
        "timeouts.heartbeat_interval_s=31.0",
        "timeouts.lease_ttl_s=30.0",
        "rounds.deadline_s",
    ):
        assert key in message, message


def test_suspicion_sits_between_the_heartbeat_and_the_lease(tmp_path: Path):
    cfg = load_config(_write(tmp_path, VALID))
    t = cfg.timeouts
    assert t.heartbeat_interval_s < t.suspicion_after_s() < t.lease_ttl_s
    shared = load_config(_write(tmp_path, VALID + '[data]\nmode = "shared"\n'))
    assert shared.data.mode == "shared" and shared.speculation.enabled
    assert cfg.data.mode == "federated" and cfg.downlink is None


def test_invalid_toml_is_a_clear_error(tmp_path: Path):
    path = _write(tmp_path, VALID + "\n[rounds\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_non_utf8_file_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "job.toml"
    path.write_bytes(b'[job]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_missing_file_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read job config") as info:
        load_config(path)
    assert "nope.toml" in str(info.value) and "No such file" in str(info.value)
