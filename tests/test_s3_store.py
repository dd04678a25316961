"""Coordinator checkpoints in object storage (coordinator/persist/s3_store.py), against a real
SeaweedFS S3 server (the session's ``seaweed`` fixture), and the pure layout rules."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
import torch
from seaweed import AWS_VARS

from coordinator.config import parse_config
from coordinator.persist import s3_layout as layout
from coordinator.persist.local_store import Checkpoint, CheckpointStore, StoreError
from coordinator.persist.open_store import open_store
from coordinator.persist.s3_store import S3CheckpointStore
from wire.config_table import ConfigError
from wire.objstore.config import StorageConfig, check_storage, parse_url
from wire.objstore.objects import Blob


def _theta(seed: int, n: int = 17) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, 9, generator=g),
        "b": torch.randn(9, generator=g).to(torch.bfloat16),
        "count": torch.tensor(seed, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }


def _ckpt(r: int, n: int = 17) -> Checkpoint:
    return Checkpoint(
        r,
        _theta(r, n),
        {"momentum.w": torch.full((17, 9), float(r))},
        {"job": "j", "closed_round": {"number": r - 1}, "ledger": {"units": [1, 2, r]}},
        {"residual.w": torch.full((3,), -float(r), dtype=torch.float16)},
    )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _store(aws, prefix: str | None = None, mib: int = 64) -> S3CheckpointStore:
    url = f"s3://{aws.bucket}/{prefix or uuid.uuid4().hex}"
    return open_store(Path("/nonexistent"), StorageConfig(url, multipart_mib=mib))


# ---- pure rules ------------------------------------------------------------------------------


def test_parse_url():
    assert parse_url("s3://bucket") == ("bucket", "")
    assert parse_url("s3://my.bucket-1/a/b/") == ("my.bucket-1", "a/b")
    for bad in ("bucket/x", "s3://", "s3://B", "s3://ab", "s3://b-1/a//b", "s3://b-1/../x"):
        assert parse_url(bad) is None, bad


def test_prune_plan_keeps_the_newest_committed_and_deletes_manifests_first():
    keys = []
    for r in range(1, 7):
        keys += [layout.data_key(r, "a" * 32, n) for n in layout.OBJECTS]
        if r != 5:  # round 5 never committed: not counted among the kept
            keys.append(layout.manifest_key(r))
    keys.append(layout.data_key(1, "b" * 32, "theta.safetensors"))  # an abandoned attempt
    assert layout.committed_rounds(keys) == [1, 2, 3, 4, 6]
    manifests, data = layout.prune_plan(keys, keep=3, keep_round=6)
    assert manifests == [layout.manifest_key(1), layout.manifest_key(2)]
    assert {layout.round_of(k) for k in data} == {1, 2} and len(data) == 9
    assert layout.prune_plan(keys, keep=3, keep_round=2)[0] == [layout.manifest_key(1)]


def test_manifest_refuses_what_is_not_its_rounds():
    parts = {n: layout.Part(layout.data_key(3, "c" * 32, n), "0" * 64, 1) for n in layout.OBJECTS}
    data = layout.manifest_json(layout.Manifest(3, "c" * 32, parts))
    assert layout.parse_manifest(data, 3).objects == parts
    with pytest.raises(layout.ManifestError, match="names round 3, not 4"):
        layout.parse_manifest(data, 4)
    with pytest.raises(layout.ManifestError, match="is not at"):
        layout.parse_manifest(data.replace(b"round-00000003/c", b"round-00000002/c"), 3)


def test_blob_slices_across_segments():
    blob = Blob([b"abc", b"", memoryview(b"defg"), b"h"])
    assert blob.size == 8 and blob.read(0, 8) == b"abcdefgh"
    assert blob.read(2, 5) == b"cde" and blob.read(7, 8) == b"h"


# ---- the [storage] table and the start-up check ------------------------------------------


def _job(storage: dict) -> dict:
    return {
        "job": {"name": "j"},
        "model": {"path": "m.safetensors"},
        "rounds": {"total": 1, "inner_steps": 1},
        "storage": storage,
    }


def test_storage_table_errors_name_the_key(tmp_path: Path):
    assert parse_config(_job({}), tmp_path).storage == StorageConfig()
    cfg = parse_config(_job({"url": "s3://bucket/p"}), tmp_path).storage
    assert cfg.url == "s3://bucket/p" and cfg.remote
    with pytest.raises(ConfigError, match=r"^storage\.url: expected 's3://BUCKET\[/PREFIX\]'"):
        parse_config(_job({"url": "https://bucket/p"}), tmp_path)
    with pytest.raises(ConfigError, match=r"^storage\.multipart_mib: must be >= 5"):
        parse_config(_job({"url": "s3://bucket", "multipart_mib": 1}), tmp_path)
    with pytest.raises(ConfigError, match=r"^storage\.bucket: unknown key"):
        parse_config(_job({"bucket": "b"}), tmp_path)


def test_missing_credentials_or_endpoint_named(monkeypatch, tmp_path: Path):
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cfg = StorageConfig("s3://bucket/p")
    check_storage(StorageConfig())  # the local state folder needs nothing
    with pytest.raises(ConfigError, match="no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET"):
        check_storage(cfg)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY is not set") as e:
        check_storage(cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith("storage.url = 's3://bucket/p'")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with pytest.raises(ConfigError, match="no endpoint: set AWS_ENDPOINT_URL"):
        check_storage(cfg)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")  # AWS S3 itself
    check_storage(cfg)


# ---- against SeaweedFS ----------------------------------------------------------------------


def test_round_trip_bit_for_bit(aws, tmp_path: Path):
    store = _store(aws)
    assert store.load_latest() is None and store.kept_rounds() == []
    original = _ckpt(4)
    saved = store.save(original)
    loaded = _store(aws, store.prefix.rstrip("/")).load_latest()
    assert loaded.round == 4 and loaded.meta["ledger"] == {"units": [1, 2, 4]}
    _same(loaded.theta, original.theta)
    _same(loaded.strategy_state, original.strategy_state)
    _same(loaded.downlink, original.downlink)
    # The theta object is the local store's theta.safetensors, byte for byte.
    local = CheckpointStore(tmp_path).save(original)
    key = store.dir + saved.objects["theta.safetensors"].key
    remote = aws.client().get_object(Bucket=aws.bucket, Key=key)["Body"].read()
    assert remote == (local / "theta.safetensors").read_bytes()


def test_pruning_keeps_three(aws):
    store = _store(aws)
    for r in range(6):
        store.save(_ckpt(r))
    assert store.kept_rounds() == [3, 4, 5]
    keys = aws.client().list_objects_v2(Bucket=aws.bucket, Prefix=store.dir)["Contents"]
    assert {layout.round_of(k["Key"][len(store.dir) :]) for k in keys} == {3, 4, 5}
    assert store.load_round(3).round == 3
    with pytest.raises(StoreError, match=r"no checkpoint of round 1 .*\(kept: 3, 4, 5\)"):
        store.load_round(1)


def test_second_writer_of_a_round_is_refused(aws):
    first = _store(aws)
    second = _store(aws, first.prefix.rstrip("/"))
    first.save(_ckpt(2))
    with pytest.raises(StoreError, match="round 2 was already committed by another writer"):
        second.save(Checkpoint(2, _theta(99), {}, {"job": "other"}))
    loaded = first.load_latest()
    assert loaded.meta["job"] == "j"
    _same(loaded.theta, _theta(2))


def test_half_written_checkpoint_is_invisible(aws):
    store = _store(aws)
    store.save(_ckpt(4))
    store._upload(_ckpt(5))  # every data object of round 5, and no manifest: a writer died
    assert store.kept_rounds() == [4]
    assert store.load_latest().round == 4
    with pytest.raises(StoreError, match="no checkpoint of round 5"):
        store.load_round(5)


def test_damaged_object_falls_back_to_the_previous_checkpoint(aws):
    store = _store(aws)
    store.save(_ckpt(1))
    saved = store.save(_ckpt(2))
    key = store.dir + saved.objects["strategy.safetensors"].key
    client = aws.client()
    body = bytearray(client.get_object(Bucket=aws.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=aws.bucket, Key=key, Body=bytes(body))
    with pytest.raises(StoreError, match="does not match the SHA-256 in its manifest"):
        store.load_round(2)
    loaded = store.load_latest()
    assert loaded.round == 1
    _same(loaded.theta, _theta(1))
    store.save(_ckpt(2))  # the round found damaged is written again by the one who found it
    assert store.load_latest().round == 2


def test_epochs_are_never_duplicated(aws):
    prefix = uuid.uuid4().hex
    stores = [_store(aws, prefix) for _ in range(3)]
    got: list[int] = []

    def starts(store):
        for _ in range(8):
            got.append(store.next_epoch())

    threads = [threading.Thread(target=starts, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == list(range(1, 25))


def test_multipart_upload_round_trips_and_a_failed_one_leaves_no_parts(aws):
    store = _store(aws, mib=5)
    big = _ckpt(1, n=160_000)  # theta about 5.5 MiB: two parts
    saved = store.save(big)
    assert saved.objects["theta.safetensors"].bytes > 5 << 20
    client = aws.client()
    head = client.head_object(
        Bucket=aws.bucket, Key=store.dir + saved.objects["theta.safetensors"].key
    )
    assert head["ETag"].endswith('-2"')  # S3's mark of a two-part upload
    _same(store.load_latest().theta, big.theta)

    class Failing:  # the real client, whose second part fails on the way
        def __getattr__(self, name):
            return getattr(store_client, name)

        def upload_part(self, **kw):
            if kw["PartNumber"] == 2:
                raise ConnectionError("link down")
            return store_client.upload_part(**kw)

    store_client, store.client = store.client, Failing()
    with pytest.raises(ConnectionError):
        store.save(_ckpt(2, n=160_000))
    store.client = store_client
    uploads = client.list_multipart_uploads(Bucket=aws.bucket, Prefix=store.dir)
    assert not uploads.get("Uploads"), uploads
    assert store.kept_rounds() == [1]


def test_unreachable_bucket_is_a_store_error(aws):
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' not reachable"):
        open_store(Path("."), StorageConfig("s3://no-such-bucket/p"))


def test_a_split_jobs_lead_checkpoint_checks_against_the_composed_digest(aws):
    """The lead of a job split over coordinator shards keeps its own tensors and the other
    shards' records: theta's digest is composed from both, in the object store as in the
    folder; a record that does not match is found."""
    from coordinator.shards.lead import composed, records_to_json
    from coordinator.shards.part_store import records_of

    store = _store(aws)
    own, others = _theta(1), records_of({"z.other": torch.arange(6.0).reshape(2, 3)})
    meta = {"job": "j", "shard_tensors": records_to_json(others)}
    digest = composed(own, others)
    store.save(Checkpoint(1, own, {}, meta, {}, digest))
    loaded = store.load_latest()
    assert loaded.theta_hash == digest and loaded.meta["shard_tensors"] == meta["shard_tensors"]
    _same(loaded.theta, own)
    wrong = records_of({"z.other": torch.arange(6.0).reshape(2, 3) + 1})
    store.save(
        Checkpoint(2, own, {}, {**meta, "shard_tensors": records_to_json(wrong)}, {}, digest)
    )
    with pytest.raises(StoreError, match="theta.safetensors does not match its digest"):
        store.load_round(2)
