"""The pieces of a coordinator shard on their own: receipts, the shard key, the part store and
what shards refuse in a job config."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from core_helpers import core_config

from coordinator.shards.config import unsupported
from coordinator.shards.lead import PLAN_FILE, load_or_make_plan
from coordinator.shards.part_store import FoldedPart, PartStore, PartStoreError, TensorRecord
from coordinator.shards.receipts import (
    KEY_BYTES,
    PartReceipt,
    ShardKeyError,
    create_key,
    load_key,
    sign,
    valid,
)
from strategies import load_strategy
from wire.config_table import ConfigError

RECEIPT = PartReceipt(1, 7, "site-a", "up-1", b"\x01" * 32, 2.0)


def test_a_receipt_checks_only_for_what_was_signed():
    key = os.urandom(KEY_BYTES)
    mac = sign(key, RECEIPT)
    assert valid(key, RECEIPT, mac)
    assert not valid(os.urandom(KEY_BYTES), RECEIPT, mac)
    for change in (
        {"shard": 0},
        {"round": 8},
        {"site": "site-b"},
        {"upload_id": "up-2"},
        {"digest": b"\x02" * 32},
        {"weight": 2.5},
    ):
        assert not valid(key, dataclasses.replace(RECEIPT, **change), mac), change
    # the fields are length-prefixed: moving a character from one to the next is another message
    shifted = dataclasses.replace(RECEIPT, site="site-au", upload_id="p-1")
    assert shifted.message() != RECEIPT.message()


def test_the_shard_key_is_made_once_private_and_refused_when_it_is_not(tmp_path):
    path = tmp_path / "state" / "shard.key"
    key = create_key(path)
    assert len(key) == KEY_BYTES and path.stat().st_mode & 0o777 == 0o600
    assert create_key(path) == key == load_key(path)  # kept, never replaced
    path.chmod(0o644)
    with pytest.raises(ShardKeyError, match="chmod 600"):
        load_key(path)
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(ShardKeyError, match="holds 5 bytes"):
        load_key(path)
    with pytest.raises(ShardKeyError, match="copy the lead's"):
        load_key(tmp_path / "missing.key")


def _save(store, version, value):
    theta = {"w": torch.full((3,), float(value))}
    parts = (FoldedPart("site-a", f"u{version}", b"\x03" * 32, 1.0, 1.0),)
    records = (TensorRecord("w", "float32", (3,), b"\x04" * 32),)
    return store.save(version, theta, {"m": torch.ones(2)}, version - 1, parts, records)


def test_the_part_store_keeps_the_two_newest_whole_versions(tmp_path):
    store = PartStore(tmp_path / "parts")
    for v in (1, 2, 3):
        _save(store, v, v)
    assert store.versions() == [2, 3]
    latest = store.latest()
    assert latest.version == 3 and latest.round == 2
    assert latest.parts == (FoldedPart("site-a", "u3", b"\x03" * 32, 1.0, 1.0),)
    assert torch.equal(latest.strategy_state()["m"], torch.ones(2))
    # a save cut short by a crash is a dot-folder: never read, removed at the next start
    (tmp_path / "parts" / ".v00000004.tmp-1").mkdir()
    again = PartStore(tmp_path / "parts")
    assert again.versions() == [2, 3] and not list((tmp_path / "parts").glob(".v*"))


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"aggregation": {"method": "median"}}, "robust rules"),
        ({"aggregation": {"clip_norm": 1.0}}, "clipping"),
        ({"aggregation": {"outlier_zscore": 3.0}}, "outlier_zscore"),
        ({"streaming": {"fragments": 2}, "rounds": {"inner_steps": 4}}, "[streaming]"),
        ({"compression": {"downlink": {"default": "int8"}}}, "[compression.downlink]"),
        ({"data": {"mode": "shared"}}, "shared"),
    ],
)
def test_what_shards_cannot_do_yet_is_refused_by_name(tmp_path, sections, words):
    cfg = core_config(tmp_path, strategy={"name": "diloco"}, **sections)
    problem = unsupported(cfg, load_strategy("diloco", {}))
    assert problem is not None and words in problem and "count = 1" in problem
    assert unsupported(core_config(tmp_path), load_strategy("diloco", {})) is None


def test_late_updates_are_refused_with_shards(tmp_path):
    cfg = core_config(tmp_path, strategy={"name": "diloco", "late_discount": 0.5})
    assert "late_discount" in unsupported(cfg, load_strategy("diloco", {"late_discount": 0.5}))


def test_a_strategy_that_takes_whole_updates_is_refused(tmp_path):
    cfg = core_config(tmp_path)
    strategy = load_strategy("fedavg", {})
    strategy.separable = False  # as a Flower strategy or a plugin without per-tensor steps
    assert "not separable per tensor" in unsupported(cfg, strategy)


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"count": 0}, "shards.count"),
        ({"count": 65}, "shards.count"),
        ({"count": 3, "addresses": ["127.0.0.1:7071"]}, "1 addresses for 3 shards"),
        ({"count": 2, "addresses": ["nohost"]}, "shards.addresses"),
        ({"count": 2, "addresses": "127.0.0.1:7071"}, "shards.addresses"),
        ({"count": 2, "replicas": 2}, "shards.replicas"),
    ],
)
def test_a_bad_shards_table_is_refused_naming_the_key(tmp_path, table, words):
    with pytest.raises(ConfigError) as info:
        core_config(tmp_path, shards=table)
    assert words in str(info.value)


def test_a_damaged_part_record_is_refused_by_name_and_left_as_it_is(tmp_path):
    store = PartStore(tmp_path / "parts")
    _save(store, 1, 1.0)
    record = tmp_path / "parts" / "v00000001" / "close.json"
    record.write_text("{not json")
    with pytest.raises(PartStoreError, match="close.json is damaged") as info:
        store.latest()
    assert "restore" in str(info.value)
    assert record.read_text() == "{not json"  # nothing changed


@pytest.mark.parametrize("body", ["{not json", '{"count": 2}', '{"count": 2, "owner": 3}'])
def test_a_damaged_plan_file_is_refused_by_name(tmp_path, body):
    path = tmp_path / PLAN_FILE
    path.write_text(body)
    with pytest.raises(ValueError, match="shards.json is damaged"):
        load_or_make_plan(tmp_path, 2, lambda: {"a": 4})
    assert path.read_text() == body


def test_the_plan_is_kept_and_another_count_refused(tmp_path):
    plan = load_or_make_plan(tmp_path, 2, lambda: {"a": 8, "b": 4, "c": 4})
    again = load_or_make_plan(tmp_path, 2, lambda: pytest.fail("the plan is read, not made"))
    assert again == plan
    with pytest.raises(ValueError, match="split over 2 shards, not 3"):
        load_or_make_plan(tmp_path, 3, lambda: {"a": 8})


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--index", "5", "--shards", "2"], "--index 5: must be in [0, 1]"),
        (["--index", "1", "--shards", "2", "--key", "/nonexistent/shard.key"], "copy the lead's"),
        (["--index", "1", "--shards", "2", "--listen", "nohost"], "--listen nohost"),
    ],
)
def test_a_shard_started_wrong_says_what_to_fix_and_touches_nothing(tmp_path, flags, words):
    from coord_harness import run_cli

    (tmp_path / "job.toml").write_text(
        '[job]\nname = "s"\nstate_dir = "state"\n[model]\nfactory = "torch.nn:Linear"\n'
        'kwargs = { in_features = 4, out_features = 2 }\n[strategy]\nname = "diloco"\n'
        "[rounds]\ntotal = 2\ninner_steps = 1\n"
    )
    listen = [] if "--listen" in flags else ["--listen", "127.0.0.1:0"]
    got = run_cli("shard", "--config", str(tmp_path / "job.toml"), *flags, *listen, "--insecure")
    assert got.returncode == 2, got.stderr
    assert words in got.stderr
    assert not (tmp_path / "state").exists()
