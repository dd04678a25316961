"""Site checkpoints in object storage (site_client/checkpoint/s3.py, dcp_s3.py), against a real
SeaweedFS S3 server (the session's ``seaweed`` fixture), and the pure layout rules."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch
import torch.distributed as dist
from torch import nn

from site_client.checkpoint import s3_layout as layout
from site_client.checkpoint.collectives import SiteCheckpointError
from site_client.checkpoint.local import AsyncCheckpointer, natural_key, stage_state
from site_client.checkpoint.place import CheckpointPlace, load_newest
from site_client.checkpoint.s3 import open_site_checkpoints


@pytest.fixture
def store(aws, tmp_path):
    url = f"s3://{aws.bucket}/sites-{uuid.uuid4().hex[:8]}"
    return open_site_checkpoints(url, "site-a", tmp_path / "staging")


def _trained(seed: int, steps: int = 2):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        x = torch.randn(5, 7, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        out |= {f"o.{pid}.{k}": torch.as_tensor(v).clone() for k, v in st.items()}
    return out


def _same(a, b) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _save(store, name, model, opt, extra):
    staged = stage_state(model, opt, copy=False)
    try:
        return store.write(name, staged, extra)
    finally:
        staged.release(opt)


# ---- pure rules ------------------------------------------------------------------------------


def test_layout_commits_by_manifest_and_prunes_manifests_first():
    a, b = "a" * 32, "b" * 32
    keys = [f"step-{n}/{a}/__0_0.distcp" for n in (2, 10, 11, 12)]
    keys += [layout.manifest_key(f"step-{n}") for n in (2, 10, 12)]  # 11: never committed
    keys += [f"step-1/{b}/.metadata"]  # an old upload cut short
    assert layout.committed(keys, natural_key) == ["step-2", "step-10", "step-12"]
    doomed, manifests, data = layout.prune_plan(keys, 2, natural_key)
    assert doomed == ["step-2"] and manifests == [layout.manifest_key("step-2")]
    assert sorted(data) == sorted([f"step-2/{a}/__0_0.distcp", f"step-1/{b}/.metadata"])
    # step-11 is newer than the oldest kept one: maybe a write in progress, left alone
    assert not any(k.startswith("step-11/") for k in manifests + data)
    assert layout.prune_plan([], 2, natural_key) == ([], [], [])
    with pytest.raises(ValueError):
        layout.prune_plan(keys, 0, natural_key)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "x" * 200])
def test_layout_refuses_names_that_are_no_single_segment(bad):
    with pytest.raises(ValueError):
        layout.check_name(bad)
    with pytest.raises(ValueError):
        layout.site_bucket("b", "p", bad)


@pytest.mark.parametrize("bad", ["../.metadata", "x.distcp", "__0_0.distcp/..", 7, "a/.metadata"])
def test_layout_refuses_files_no_checkpoint_holds(bad):
    with pytest.raises(ValueError):
        layout.check_file(bad)


# ---- against SeaweedFS -----------------------------------------------------------------------


def test_round_trip_is_bit_identical_and_the_manifest_is_written_last(store):
    model, opt = _trained(0)
    url = _save(store, "step-0000000002", model, opt, {"round": 3, "mark": torch.arange(4.0)})
    assert url == store.url("step-0000000002") and url.endswith("/site-a/step-0000000002")
    assert store.names() == ["step-0000000002"]
    other, other_opt = _trained(1, steps=1)
    extra = store.load("step-0000000002", other, other_opt)
    assert extra["round"] == 3 and torch.equal(extra["mark"], torch.arange(4.0))
    _same(_state(model, opt), _state(other, other_opt))
    # writing the same name again cannot replace the committed checkpoint
    with pytest.raises(SiteCheckpointError, match="already committed"):
        _save(store, "step-0000000002", other, other_opt, {"round": 9})
    assert store.load("step-0000000002", other, other_opt)["round"] == 3


def test_data_without_a_manifest_is_never_read(store, aws):
    model, opt = _trained(0)
    _save(store, "step-1", model, opt, {"round": 1})
    client, bucket = aws.client(), aws.bucket
    # An upload cut short: a later checkpoint's data, no manifest.
    half = f"{store.place.prefix}step-2/{'c' * 32}/__0_0.distcp"
    client.put_object(Bucket=bucket, Key=half, Body=b"half")
    assert store.names() == ["step-1"]
    place = CheckpointPlace(store.staging, store)
    other, other_opt = _trained(5, steps=1)
    assert load_newest(place, other, other_opt) == ("step-1", {"round": 1})
    with pytest.raises(SiteCheckpointError, match="never completed"):
        store.load("step-2", other, other_opt)


def test_damaged_object_is_refused_naming_it_and_the_previous_checkpoint_used(store, aws, caplog):
    first, first_opt = _trained(0)
    _save(store, "step-1", first, first_opt, {"round": 1})
    second, second_opt = _trained(2, steps=3)
    _save(store, "step-2", second, second_opt, {"round": 2})
    client, bucket = aws.client(), aws.bucket
    keys = [k for k in _keys(client, bucket, store.place.prefix + "step-2/") if "distcp" in k]
    body = bytearray(client.get_object(Bucket=bucket, Key=keys[0])["Body"].read())
    body[len(body) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=keys[0], Body=bytes(body))
    model, opt = _trained(7, steps=1)
    before = _state(model, opt)
    with pytest.raises(SiteCheckpointError, match=r"__0_0\.distcp does not match") as err:
        store.load("step-2", model, opt)
    assert store.url("step-2") in str(err.value)
    _same(before, _state(model, opt))  # a refused load changes nothing
    with caplog.at_level(logging.ERROR, logger="isthmus.trainer"):
        target, extra = load_newest(CheckpointPlace(store.staging, store), model, opt)
    assert (target, extra["round"]) == ("step-1", 1)
    _same(_state(first, first_opt), _state(model, opt))
    text = caplog.text
    assert "__0_0.distcp" in text and f"previous site checkpoint {store.url('step-1')}" in text


def test_tampered_manifest_is_refused(store, aws):
    model, opt = _trained(0)
    _save(store, "step-1", model, opt, {"round": 1})
    client, bucket = aws.client(), aws.bucket
    key = store.place.prefix + layout.manifest_key("step-1")
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    for bad, why in [
        (b"not json", "unreadable manifest"),
        (good.replace(b'"__0_0.distcp"', b'"../../x.distcp"'), "no DCP checkpoint holds"),
        (good.replace(b'"attempt": "', b'"attempt": "../'), "bad attempt"),
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=bad)
        with pytest.raises(SiteCheckpointError, match=why):
            store.load("step-1", model, opt)


def test_prune_keeps_the_newest_and_deletes_every_older_object(store, aws):
    model, opt = _trained(0)
    for n in (1, 2, 3):
        _save(store, f"step-{n}", model, opt, {"round": n})
    assert store.prune(2) == ["step-1"]
    assert store.names() == ["step-2", "step-3"]
    assert not _keys(aws.client(), aws.bucket, store.place.prefix + "step-1/")


def test_async_checkpointer_in_a_gloo_group_writes_to_the_store(store, tmp_path):
    init = f"file://{tmp_path / 'pg'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        model, opt = _trained(3)
        writer = AsyncCheckpointer(write=store.write)
        try:
            writer.save("step-5", model, opt, {"round": 5}).result(timeout=60)
        finally:
            writer.close()
        other, other_opt = _trained(4, steps=1)
        assert store.load("step-5", other, other_opt)["round"] == 5
        _same(_state(model, opt), _state(other, other_opt))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "url, why",
    [
        ("s3:/b/x", "expected s3://BUCKET"),
        ("http://bucket/x", "expected s3://BUCKET"),
        ("s3://B/x", "expected s3://BUCKET"),
        ("s3://bucket/a/../b", "expected s3://BUCKET"),
    ],
)
def test_bad_urls_are_refused_in_one_line(url, why, aws, tmp_path):
    with pytest.raises(SiteCheckpointError, match=why) as err:
        open_site_checkpoints(url, "site-a", tmp_path)
    assert "\n" not in str(err.value) and url in str(err.value)


def test_missing_settings_and_an_absent_bucket_are_named(aws, monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(SiteCheckpointError, match="AWS_SECRET_ACCESS_KEY is not set"):
        open_site_checkpoints(f"s3://{aws.bucket}/x", "site-a", tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws.env()["AWS_SECRET_ACCESS_KEY"])
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_REGION")
    with pytest.raises(SiteCheckpointError, match="no endpoint: set AWS_ENDPOINT_URL"):
        open_site_checkpoints(f"s3://{aws.bucket}/x", "site-a", tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint)
    with pytest.raises(SiteCheckpointError, match="bucket 'no-such-bucket' not reachable") as e:
        open_site_checkpoints("s3://no-such-bucket/x", "site-a", tmp_path)
    assert "\n" not in str(e.value)


def _keys(client, bucket, prefix):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]
