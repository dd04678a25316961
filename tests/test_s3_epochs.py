"""The starts record in object storage (coordinator/persist/s3_epochs.py): a stale candidate may not
count a start, epochs stay small whatever etcd's revision, and a deposed leader's manifest
that lands after a newer start took over is no commit. Pure rules, then a real SeaweedFS."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from coordinator.members.leases import EPOCH_SHIFT
from coordinator.persist import s3_epochs as epochs
from coordinator.persist import s3_layout as layout
from coordinator.persist.local_store import Checkpoint, StoreError
from coordinator.persist.open_store import open_store
from wire.objstore.config import StorageConfig
from wire.objstore.objects import put_if
from wire.proto import isthmus_pb2 as pb


def test_starts_count_up_by_one_and_a_stale_candidate_is_refused():
    first = epochs.count_start(epochs.EpochRecord(), revision=5_000_000_000)
    assert first.epoch == 1 and first.revision == 5_000_000_000
    # A token of that start still fits the wire (the revision never becomes the epoch).
    pb.Lease(token=(first.epoch << EPOCH_SHIFT) + 1)
    with pytest.raises(epochs.EpochError, match="deposed"):
        epochs.count_start(first, revision=4_999_999_999)  # elected before the one counted
    with pytest.raises(epochs.EpochError, match="deposed"):
        epochs.count_start(first, revision=5_000_000_000)
    later = epochs.count_start(first, revision=5_000_000_001)
    assert later.epoch == 2
    # A start without an election clears the revision fence (etcd rebuilt from nothing).
    plain = epochs.count_start(later)
    assert plain.revision == 0 and epochs.count_start(plain, revision=7).epoch == 4


def test_a_late_manifest_of_an_earlier_start_is_void_once_a_later_one_took_over():
    record = epochs.count_start(epochs.count_start(epochs.EpochRecord()))  # starts 1, 2
    assert epochs.void_by(record, 8, written_by=1) is None  # start 2 has not loaded yet
    record = epochs.took_over(record, 2, from_round=7)
    assert epochs.void_by(record, 8, written_by=1) == 2  # landed after the takeover
    assert epochs.void_by(record, 7, written_by=1) is None  # committed before it: stands
    assert epochs.void_by(record, 8, written_by=2) is None  # the new leader's own
    with pytest.raises(epochs.EpochError, match="counted after"):
        epochs.took_over(epochs.count_start(record), 2, from_round=7)


def test_records_round_trip_and_damage_is_named():
    record = epochs.took_over(epochs.count_start(epochs.EpochRecord(), 9), 1, -1)
    assert epochs.parse_record(record.to_bytes()) == record
    assert epochs.parse_record(b"41\n") == epochs.EpochRecord(41)  # an older version's
    assert epochs.parse_record(None) == epochs.EpochRecord()
    for bad in (b"{", b'{"epoch": -1, "revision": 0, "history": []}', b"x", b"[]"):
        with pytest.raises(epochs.EpochError, match="expected an epoch record"):
            epochs.parse_record(bad)


def _ckpt(r: int) -> Checkpoint:
    return Checkpoint(r, {"w": torch.full((5,), float(r))}, meta={"job": "j"})


@pytest.mark.e2e
def test_a_deposed_leaders_late_commit_is_ignored_and_replaced(seaweed, monkeypatch):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    url = f"s3://{seaweed.bucket}/{uuid.uuid4().hex}"

    def store():
        return open_store(Path("/nonexistent"), StorageConfig(url))

    old = store()
    old.next_epoch(100)
    assert old.load_latest() is None
    old.save(_ckpt(7))
    new = store()
    assert new.next_epoch(105) == 2
    assert new.load_latest().round == 7  # takes over from round 7
    # The old leader passed its fence check before the takeover, then stalled: its
    # manifest of round 8 lands now.
    late = old._upload(_ckpt(8))
    key = old.dir + layout.manifest_key(8)
    assert put_if(old.client, old.bucket, key, layout.manifest_json(late), None)
    assert store().load_latest(theta_only=True).round == 7  # no commit
    with pytest.raises(StoreError, match="a newer coordinator has taken the store over"):
        old.save(_ckpt(9))
    new.save(_ckpt(8))  # the new leader's round 8 replaces the void manifest
    assert new.kept_rounds() == [7, 8]
    third = store()
    third.next_epoch(110)
    got = third.load_latest()
    assert got.round == 8 and torch.equal(got.theta["w"], torch.full((5,), 8.0))
    # A candidate elected before the newest counted start may not count one.
    with pytest.raises(StoreError, match="deposed"):
        store().next_epoch(104)
