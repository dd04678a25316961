"""An object store that does not answer for a while (coordinator/persist/s3_store.py, disk.py): the
checkpoint is retried rather than the job stopped, nothing is reported written before it is
committed, and a commit whose reply was lost is recognised as this coordinator's own."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
import torch
from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

from coordinator.events.remote import RemoteEvents
from coordinator.persist import s3_layout as layout
from coordinator.persist.checkpointing import CheckpointWriter
from coordinator.persist.local_store import Checkpoint, StoreError, StoreUnavailable
from coordinator.persist.open_store import open_store
from wire.objstore.config import StorageConfig


def _store(aws):
    return open_store(Path("/nonexistent"), StorageConfig(f"s3://{aws.bucket}/{uuid.uuid4().hex}"))


def _ckpt(r: int) -> Checkpoint:
    theta = {"w": torch.full((5, 3), float(r))}
    return Checkpoint(r, theta, {"m": torch.zeros(3)}, {"closed_round": {"number": r - 1}}, {})


class Flaky:
    """The real client, with ``put_object`` replaced by ``put(real, **kw)``."""

    def __init__(self, real, put) -> None:
        self.real, self.put = real, put

    def __getattr__(self, name):
        return getattr(self.real, name)

    def put_object(self, **kw):
        return self.put(self.real.put_object, **kw)


def test_a_store_that_does_not_answer_commits_nothing(aws):
    store = _store(aws)
    store.save(_ckpt(1))

    def down(put, **kw):
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    real, store.client = store.client, Flaky(store.client, down)
    with pytest.raises(StoreUnavailable, match="did not answer"):
        store.save(_ckpt(2))
    store.client = real
    assert store.kept_rounds() == [1]


def test_a_commit_whose_reply_was_lost_is_kept_on_the_next_try(aws):
    store = _store(aws)

    def lost_reply(put, **kw):
        put(**kw)  # it lands ...
        if kw["Key"].endswith(layout.MANIFEST):  # ... and the manifest's reply never comes
            raise ConnectionClosedError(endpoint_url="http://127.0.0.1:1")

    real, store.client = store.client, Flaky(store.client, lost_reply)
    with pytest.raises(StoreUnavailable):
        store.save(_ckpt(1))
    store.client = real
    first = layout.parse_manifest(
        real.get_object(Bucket=store.bucket, Key=store.dir + layout.manifest_key(1))["Body"].read(),
        1,
    )
    again = store.save(_ckpt(1))  # the writer's next try: the round is its own commit
    assert again.attempt == first.attempt
    assert store.kept_rounds() == [1]
    assert torch.equal(store.load_latest().theta["w"], _ckpt(1).theta["w"])
    # Another writer's commit of the round is still refused.
    other = _store(aws)
    other.dir, other.prefix = store.dir, store.prefix
    with pytest.raises(StoreError, match="another writer"):
        other.save(_ckpt(1))


def test_an_event_segment_whose_reply_was_lost_is_this_writers(aws):
    store = _store(aws)
    remote = RemoteEvents(store.client, store.bucket, store.prefix)
    lines = [b'{"seq":1}\n', b'{"seq":2}\n']
    assert remote.put(1, lines)
    assert remote.put(1, lines)  # the same bytes: an earlier try of this writer landed
    assert not remote.put(1, [b'{"seq":1,"other":1}\n'])  # another writer's


class OutageStore:
    """A store whose first ``down`` saves find it unreachable."""

    def __init__(self, down: int) -> None:
        self.down, self.saved = down, []

    def save(self, ckpt):
        if self.down:
            self.down -= 1
            raise StoreUnavailable("s3://b/p: the store did not answer")
        self.saved.append(ckpt.round)
        return Path("/saved")


def test_the_checkpoint_writer_waits_for_the_store_and_reports_only_the_commit():
    store, written = OutageStore(down=2), []
    writer = CheckpointWriter(store, threading.Event())
    writer.submit(_ckpt(3), lambda seconds, folder: written.append((store.saved[:], folder)))
    writer.wait()  # no error: the write was tried until the store answered
    writer.close()
    assert written == [([3], Path("/saved"))]


def test_a_stopping_coordinator_gives_up_on_the_store():
    stopping = threading.Event()
    stopping.set()
    writer = CheckpointWriter(OutageStore(down=10), stopping)
    writer.submit(_ckpt(3), lambda *_: pytest.fail("reported written"))
    with pytest.raises(StoreUnavailable):
        writer.wait()
    writer.close()  # says so in the log, and stops
