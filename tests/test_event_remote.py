"""The event log in object storage (coordinator/events/remote.py) against a real SeaweedFS:
segments written once, a local log adopting the remote one (continuing it, or rebuilt where it
diverged), a second writer refused, damaged segments named, ``coordinator history
--storage-url`` reading it back."""

from __future__ import annotations

import gzip
import uuid

import pytest

from coordinator.cli import main as coordinator_main
from coordinator.events.format import EventLogError
from coordinator.events.log import EventLog
from coordinator.events.remote import (
    EventShipper,
    RemoteEvents,
    adopt_remote,
    read_remote,
    segment_key,
    segment_starts,
)


@pytest.fixture
def remote(aws):
    return RemoteEvents(aws.client(), aws.bucket, f"{uuid.uuid4().hex}/job/")


def _log(folder, remote, rounds):
    events = EventLog(folder / "events.jsonl")
    shipper = EventShipper(events, remote, adopt_remote(events, remote))
    for r in rounds:
        events.append("round_opened", round=r)
        events.append("round_closed", round=r)
        shipper.ship()
    return events, shipper


def test_segment_keys_sort_by_first_seq():
    assert segment_key(7) == "000000000007.jsonl.gz"
    keys = [segment_key(12), segment_key(3), "other", "000000000001.jsonl.gz.tmp"]
    assert segment_starts(keys) == [3, 12]


def test_a_second_coordinator_continues_the_log_without_gap_or_duplicate(remote, tmp_path):
    first, _ = _log(tmp_path / "a", remote, [0, 1])
    first.append("round_opened", round=2)  # never shipped: the leader died here
    # The standby (its own, empty state folder) takes over: the log goes on after event 4.
    second, shipper = _log(tmp_path / "b", remote, [2, 3])
    seqs = [e["seq"] for e in read_remote(remote).events]
    assert seqs == list(range(1, 9))
    assert [e["round"] for e in read_remote(remote).events if e["kind"] == "round_closed"] == [
        0,
        1,
        2,
        3,
    ]
    assert second.last_seq == 8 and read_remote(remote, since_seq=6).events[0]["seq"] == 7
    # The deposed leader cannot publish its tail: its segment's key is taken.
    stale = EventShipper(first, remote, 4)
    with pytest.raises(EventLogError, match="another coordinator continues"):
        stale.ship()
    assert [e["seq"] for e in read_remote(remote).events] == list(range(1, 9))
    # It comes back later: its local tail differs from the remote log, so it is moved aside.
    first.close()
    again = EventLog(tmp_path / "a" / "events.jsonl")
    assert adopt_remote(again, remote) == 8
    assert again.last_seq == 8
    assert list((tmp_path / "a").glob("events.jsonl.diverged-*"))
    assert [e["seq"] for e in read_remote(remote).events] == list(range(1, 9))


def test_a_restart_on_its_own_folder_ships_its_unshipped_tail(remote, tmp_path):
    events, _ = _log(tmp_path, remote, [0])
    events.append("round_opened", round=1)
    events.close()
    again = EventLog(tmp_path / "events.jsonl")
    shipper = EventShipper(again, remote, adopt_remote(again, remote))
    assert shipper.shipped == 2 and shipper.ship() == 1
    assert [e["seq"] for e in read_remote(remote).events] == [1, 2, 3]


def test_damaged_segments_are_refused_naming_them(remote, tmp_path):
    _log(tmp_path, remote, [0, 1])
    key = remote.folder + segment_key(3)
    body = gzip.decompress(remote.client.get_object(Bucket=remote.bucket, Key=key)["Body"].read())
    for bad, why in [
        (b"not gzip", "unreadable"),
        (gzip.compress(body.replace(b'"round":1', b'"round":9')), "line 1"),
    ]:
        remote.client.put_object(Bucket=remote.bucket, Key=key, Body=bad)
        with pytest.raises(EventLogError, match=why) as err:
            read_remote(remote)
        assert segment_key(3) in str(err.value)
    remote.client.put_object(Bucket=remote.bucket, Key=key, Body=gzip.compress(body))
    # A segment under another's name: its records are not the ones its key says.
    assert not remote.put(3, [b"x"])  # written once: the key is taken
    remote.client.put_object(
        Bucket=remote.bucket, Key=remote.folder + segment_key(9), Body=gzip.compress(body)
    )
    with pytest.raises(EventLogError, match=f"{segment_key(9)}: it does not begin with event 9"):
        read_remote(remote)


def test_a_missing_segment_is_reported_as_a_hole(remote, tmp_path):
    _log(tmp_path, remote, [0, 1, 2])
    remote.client.delete_object(Bucket=remote.bucket, Key=remote.folder + segment_key(3))
    history = read_remote(remote)
    assert [e["seq"] for e in history.events] == [1, 2, 5, 6]
    assert [(g.first, g.last) for _, g in history.gaps] == [(3, 4)]


def test_history_reads_the_remote_log(remote, tmp_path, capsys):
    _log(tmp_path, remote, [0, 1])
    url = f"s3://{remote.bucket}/{remote.prefix.rstrip('/')}"
    assert coordinator_main(["history", "--storage-url", url, "--json"]) == 0
    assert '"round": 1' in capsys.readouterr().out
    for bad, why in [
        ("http://x/y", "expected s3://BUCKET"),
        (f"s3://{remote.bucket}/no-such-job", "no event log under"),
    ]:
        assert coordinator_main(["history", "--storage-url", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
