"""``[streaming]`` in the job config and at the coordinator's start: the effective rounds, and
every refusal naming its key (before any state is written where it can be)."""

from __future__ import annotations

from pathlib import Path

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from . import core_helpers as ch
except ImportError:
    import coord_harness as h
    import core_helpers as ch

from coordinator.config import ConfigError, load_config, parse_config
from coordinator.core import CoordinatorCore

BLOCKS = {"factory": "coord_harness:blocks_model", "kwargs": {"blocks": 4, "d": 4}}


def _cfg(tmp_path, streaming=None, **sections):
    sections = {"rounds": {"total": 3, "inner_steps": 8}, "model": BLOCKS, **sections}
    data = h.job_config(**sections)
    if streaming is not None:
        data["streaming"] = streaming
    return parse_config(data, tmp_path)


def test_effective_rounds_are_fragment_rounds(tmp_path):
    cfg = _cfg(tmp_path, {"fragments": 4, "delay_steps": 1})
    assert (cfg.rounds.total, cfg.rounds.inner_steps) == (12, 2)
    assert cfg.outer_rounds.total == 3 and cfg.outer_inner_steps == 8
    assert cfg.streaming.fragments == 4 and cfg.streaming.delay_steps == 1
    assert cfg.rounds.min_sites == cfg.outer_rounds.min_sites


def test_without_the_table_nothing_changes(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.streaming is None and cfg.outer_rounds is None
    assert (cfg.rounds.total, cfg.rounds.inner_steps, cfg.outer_inner_steps) == (3, 8, 8)


def test_the_sites_are_handed_the_file_as_written(tmp_path):
    data = h.job_config(rounds={"total": 3, "inner_steps": 8}, model=BLOCKS)
    path = h.write_config(tmp_path, data)
    path.write_text(path.read_text() + "[streaming]\nfragments = 2\n")
    cfg = load_config(path)
    assert cfg.source_toml == path.read_bytes() and cfg.rounds.total == 6


@pytest.mark.parametrize(
    ("streaming", "sections", "message"),
    [
        ({"fragments": 3}, {}, r"^streaming.fragments: rounds.inner_steps \(8\) must be a mul"),
        ({"fragments": 4, "delay_steps": 2}, {}, r"^streaming.delay_steps: must be < "),
        ({"fragments": 2}, {"data": {"mode": "shared"}}, r"^streaming: needs data.mode = 'fed"),
        ({"fragmentz": 2}, {}, r"^streaming.fragmentz"),
    ],
)
def test_config_refusals_name_the_key(tmp_path, streaming, sections, message):
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(tmp_path, streaming, **sections)
    if "shared" in message:
        assert "delay_steps" in str(info.value) and "same update" in str(info.value)


def _start(tmp_path, streaming, strategy=None, **sections) -> str:
    if strategy is not None:
        sections["strategy"] = strategy
    cfg = _cfg(tmp_path, streaming, **sections)
    with pytest.raises(ConfigError) as info:
        CoordinatorCore(cfg, clock=ch.Clock())
    return str(info.value)


def test_a_strategy_taking_every_update_is_refused_with_fragments(tmp_path):
    message = _start(tmp_path, {"fragments": 2}, {"name": "strategy_helpers:TakesEveryUpdate"})
    assert message.startswith("streaming.fragments: strategy 'strategy_helpers:TakesEveryUpdate'")
    assert "needs_updates" in message


def test_one_fragment_keeps_late_updates_and_any_strategy(tmp_path):
    cfg = _cfg(tmp_path, {"fragments": 1}, strategy={"name": "diloco", "late_discount": 0.5})
    core = CoordinatorCore(cfg, clock=ch.Clock())
    try:
        assert core.tensors.fragments == 1 and core.downlink is None
        assert core.round_info()["fragment"] == 0
    finally:
        core.close()


def test_a_fragment_with_no_tensor_is_refused_at_start(tmp_path):
    # 11 trainable tensors in 4 blocks (plus embed and head): 16 fragments cannot all be filled.
    message = _start(tmp_path, {"fragments": 16}, rounds={"total": 1, "inner_steps": 16})
    assert message.startswith("streaming.fragments: 16 fragments, but fragment")


def test_coordinator_serve_stops_at_start_with_the_plan_error(tmp_path: Path):
    data = h.job_config(rounds={"total": 1, "inner_steps": 4}, model=BLOCKS)
    data["streaming"] = {"fragments": 4}
    data["model"] = {**BLOCKS, "kwargs": {"blocks": 0, "d": 4}}  # 5 tensors, no block
    data["streaming"] = {"fragments": 8}
    data["rounds"]["inner_steps"] = 8
    path = h.write_config(tmp_path, data)
    done = h.run_cli("serve", "--config", str(path), "--insecure", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "coordinator: error: streaming.fragments: 8 fragments, but fragment" in done.stderr
