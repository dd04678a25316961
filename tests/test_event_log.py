"""The coordinator's append-only event log (coordinator/events/log.py) on real files."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time

import pytest
from core_helpers import Clock, delta_like, heartbeat_all, new_core, push

from coordinator.events.log import EventLog, EventLogError, read_events

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h


def test_round_trip_and_seq_continue_across_reopen(tmp_path):
    path = tmp_path / "state" / "deeper" / "events.jsonl"
    before = time.time()
    with EventLog(path) as events:
        assert path.exists() and events.path == path and events.last_seq == 0
        assert events.append("coordinator_started", epoch=3) == 1
        assert events.append("round_opened", round=0, sites=["a", "b"], note=None) == 2
        assert events.last_seq == 2
    with EventLog(path) as events:
        assert events.last_seq == 2
        assert events.append("round_closed", round=0, loss=2.5) == 3
    got = read_events(path)
    assert [e["seq"] for e in got] == [1, 2, 3]
    assert [e["kind"] for e in got] == ["coordinator_started", "round_opened", "round_closed"]
    assert got[1] == {
        "seq": 2,
        "wall": got[1]["wall"],
        "kind": "round_opened",
        "round": 0,
        "sites": ["a", "b"],
        "note": None,
    }
    assert before <= got[0]["wall"] <= got[2]["wall"] <= time.time()
    assert [e["seq"] for e in read_events(path, since_seq=2)] == [3]
    assert read_events(path, since_seq=3) == []
    # One object per line, nothing else in the file.
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["seq"] for x in lines[:-1]] == [1, 2, 3]


def test_empty_log_reads_as_no_events(tmp_path):
    path = tmp_path / "events.jsonl"
    EventLog(path).close()
    assert path.read_bytes() == b""
    assert read_events(path) == []
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "tail",
    [
        b'{"seq":3,"wall":1.0,"ki',  # cut mid-object
        b'{"seq":3,"wall":1.0,"kind":"x"}',  # whole object, newline never written
        b"\x00\x00\x00\x00",  # blocks allocated but never written
        b"garbage\n",  # a complete but unreadable last line
    ],
)
def test_torn_tail_is_dropped_on_reopen_and_appending_continues(tmp_path, caplog, tail):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        events.append("a")
        events.append("b")
    good = path.read_bytes()
    with path.open("ab") as f:
        f.write(tail)
    assert [e["kind"] for e in read_events(path)] == ["a", "b"]  # readers skip it too
    with caplog.at_level(logging.WARNING, logger="isthmus.coordinator"):
        events = EventLog(path)
    assert "torn" in caplog.text and "line 3" in caplog.text
    assert path.read_bytes() == good
    assert events.last_seq == 2
    assert events.append("c") == 3
    events.close()
    assert [(e["seq"], e["kind"]) for e in read_events(path)] == [(1, "a"), (2, "b"), (3, "c")]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (b"not json at all\n", "not JSON"),
        (b"\n", "not JSON"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"wall":1.0,"kind":"x"}\n', "no integer seq"),
        (b'{"seq":1,"wall":1.0,"kind":"x"}\n', "seq 1 does not follow seq 2"),
    ],
)
def test_damage_in_the_middle_names_file_and_line(tmp_path, bad, why):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        events.append("a")
        events.append("b")
    with path.open("ab") as f:
        f.write(bad)
        f.write(b'{"seq":9,"wall":1.0,"kind":"later"}\n')
    damaged = path.read_bytes()
    for attempt in (lambda: read_events(path), lambda: EventLog(path)):
        with pytest.raises(EventLogError) as err:
            attempt()
        assert str(path) in str(err.value)
        assert "line 3" in str(err.value) and why in str(err.value)
    assert path.read_bytes() == damaged  # nothing was cut away


def test_unserialisable_field_raises_and_writes_nothing(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        events.append("a")
        size = path.stat().st_size
        with pytest.raises(TypeError, match="'sites'"):
            events.append("bad", round=1, sites={"a", "b"})
        loop: list[object] = []
        loop.append(loop)
        with pytest.raises(TypeError, match="'loop'"):
            events.append("bad", loop=loop)
        assert path.stat().st_size == size and events.last_seq == 1
        assert events.append("b") == 2  # no seq was used up
    assert [e["seq"] for e in read_events(path)] == [1, 2]


def test_bad_kind_reserved_fields_and_closed_log_are_refused(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="kind"):
        events.append("")
    with pytest.raises(ValueError, match="'seq' is reserved"):
        events.append("x", seq=99)
    with pytest.raises(ValueError, match="'wall' is reserved"):
        events.append("x", wall=0.0)
    events.close()
    events.close()
    with pytest.raises(EventLogError, match="closed"):
        events.append("x")
    assert read_events(events.path) == []


def test_concurrent_appends_get_unique_increasing_seqs(tmp_path):
    path = tmp_path / "events.jsonl"
    events = EventLog(path)
    events.append("start")
    per_thread, threads = 50, 8
    got: dict[int, list[int]] = {}

    def worker(n: int) -> None:
        got[n] = [events.append("beat", thread=n, i=i) for i in range(per_thread)]

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    events.close()
    seqs = [s for n in range(threads) for s in got[n]]
    assert sorted(seqs) == list(range(2, 2 + per_thread * threads))
    assert all(got[n] == sorted(got[n]) for n in range(threads))
    on_disk = read_events(path)
    assert [e["seq"] for e in on_disk] == list(range(1, 2 + per_thread * threads))
    # Each thread's events are in the order it appended them, under the seq it was told.
    for n in range(threads):
        mine = [e for e in on_disk if e.get("thread") == n]
        assert [e["i"] for e in mine] == list(range(per_thread))
        assert [e["seq"] for e in mine] == got[n]


def test_failed_append_leaves_no_trace(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    events = EventLog(path)
    events.append("a")
    size = path.stat().st_size
    real_fsync = os.fsync
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:  # the append's own fsync; the clean-up's fsync works
            raise OSError(errno.EIO, "disk on fire")
        real_fsync(fd)

    monkeypatch.setattr("coordinator.events.live.os.fsync", failing_fsync)
    with pytest.raises(OSError, match="disk on fire"):
        events.append("lost", round=1)
    assert path.stat().st_size == size and events.last_seq == 1
    monkeypatch.setattr("coordinator.events.live.os.fsync", real_fsync)
    assert events.append("b") == 2
    events.close()
    assert [e["kind"] for e in read_events(path)] == ["a", "b"]


@pytest.mark.e2e
def test_serve_refuses_a_log_damaged_in_the_middle_in_one_line(tmp_path):
    """``coordinator serve`` on such a log: the CLI's one-line error, and nothing changed."""
    config = h.write_config(tmp_path, h.job_config())
    state = tmp_path / "state"
    state.mkdir()
    log_file = state / "events.jsonl"
    damaged = b'{"seq":1,"wall":1.0,"kind":"a"}\n{"seq":2,"wa\x00\n'
    damaged += b'{"seq":3,"wall":1.0,"kind":"b"}\n'
    log_file.write_bytes(damaged)
    result = h.run_cli("serve", "--config", str(config), "--insecure")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [x for x in result.stderr.splitlines() if not x.startswith("WARNING: --insecure")]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("coordinator: error: event log ") and str(log_file) in line, line
    assert "line 2: not JSON" in line and "move the file aside" in line, line
    assert log_file.read_bytes() == damaged
    assert not (state / "epoch").exists(), "a refused start is not counted"


def _lines(path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_every_record_carries_a_checksum_that_catches_a_changed_line(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        for r in range(3):
            events.append("round_closed", round=r, sites=("a", "b"), by_key={7: "x"})
    lines = _lines(path)
    assert all(b'"crc":"' in line for line in lines)
    # Still one JSON line that parses: only the checksum tells the edit apart.
    lines[1] = lines[1].replace(b'"round":1', b'"round":5')
    path.write_bytes(b"".join(lines))
    with pytest.raises(EventLogError) as err:
        EventLog(path)
    assert str(path) in str(err.value) and "line 2: checksum mismatch" in str(err.value)
    # The same edit on the last line reads as a torn write: cut away, as after kill -9.
    lines = _lines(path)[:1] + [_lines(path)[2].replace(b'"round":2', b'"round":9')]
    path.write_bytes(b"".join(lines))
    with caplog.at_level(logging.WARNING, logger="isthmus.coordinator"):
        events = EventLog(path)
    assert "torn" in caplog.text and "checksum mismatch" in caplog.text
    assert events.last_seq == 1
    events.close()
    assert [e["round"] for e in read_events(path)] == [0]
    assert "crc" not in read_events(path)[0]  # readers get the record, not its checksum


def test_a_log_written_before_records_had_checksums_loads_and_continues(tmp_path):
    path = tmp_path / "events.jsonl"
    old = b'{"seq":1,"wall":1.0,"kind":"start","epoch":1}\n'
    old += b'{"seq":2,"wall":2.0,"kind":"round_closed","round":0,"updates":["a"]}\n'
    path.write_bytes(old)
    with EventLog(path) as events:
        assert events.last_seq == 2 and events.last_closed_round == 0
        assert events.append("start", epoch=2) == 3
    assert path.read_bytes().startswith(old)  # the old lines are left as they were
    got = read_events(path)
    assert [(e["seq"], e["kind"]) for e in got] == [(1, "start"), (2, "round_closed"), (3, "start")]


def test_deleted_lines_are_reported_by_seq_and_the_log_goes_on(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        for i in range(10):
            events.append("beat", i=i)
    lines = _lines(path)
    path.write_bytes(b"".join(lines[:3] + lines[6:]))  # events 4, 5 and 6 gone
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        events = EventLog(path)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert str(path) in errors[0] and "events 4-6 are missing (before line 4)" in errors[0]
    assert "recovery goes on" in errors[0]
    assert events.last_seq == 10 and events.append("beat", i=10) == 11
    events.close()
    assert [e["seq"] for e in read_events(path)] == [1, 2, 3, 7, 8, 9, 10, 11]


def test_a_cut_the_checkpoint_knows_of_is_reported_once_and_no_seq_is_reused(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as events:
        for i in range(20):
            events.append("beat", i=i)
    data = path.read_bytes()
    cut = sum(len(x) for x in _lines(path)[:11]) + 9  # in the middle of event 12's line
    path.write_bytes(data[:cut])
    with caplog.at_level(logging.WARNING, logger="isthmus.coordinator"):
        events = EventLog(path)
        assert "torn" in caplog.text and events.last_seq == 11  # alone, a normal torn tail
        assert events.check_known(None, "an old checkpoint") is None  # knows of nothing
        assert events.check_known(11, "the checkpoint of round 2") is None
        caplog.clear()
        assert events.check_known(20, "the checkpoint of round 3") == (12, 20)
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert str(path) in error and "events 12-20 are missing" in error, error
    assert "ended at event 11" in error and "checkpoint of round 3" in error, error
    assert "recovery goes on" in error, error
    assert events.last_seq == 21 and events.append("beat", i=99) == 22
    events.close()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        again = EventLog(path)
    assert caplog.records == []  # the hole is noted in the log: said once
    assert again.check_known(20, "the checkpoint of round 3") is None
    again.close()
    got = read_events(path)
    assert [e["seq"] for e in got] == [*range(1, 12), 21, 22]
    assert got[-2]["kind"] == "events_lost" and (got[-2]["first"], got[-2]["last"]) == (12, 20)


def test_a_coordinator_restarting_on_a_cut_log_says_what_was_lost_and_goes_on(tmp_path, caplog):
    """The checkpoint records the event seq it was written at; the restart compares."""
    clock = Clock()
    core = new_core(tmp_path, clock, rounds={"min_sites": 1})
    token = core.join("site-a")[0].token
    heartbeat_all(core, clock, {"site-a": token}, 1.0)
    push(core, "site-a", token, 0, delta_like(core, 1.0))
    heartbeat_all(core, clock, {"site-a": token}, 1.0)
    assert core.round.number == 1
    core.close()
    known = json.loads((core.store.dir / "round-00000001" / "meta.json").read_text())["events_seq"]
    path = core.events.path
    keep = [e for e in read_events(path) if e["seq"] < known - 2]
    cut = sum(len(x) for x in _lines(path)[: len(keep)])
    os.truncate(path, cut + 5)  # the file cut short in the middle of a line
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        again = new_core(tmp_path, Clock(100.0), rounds={"min_sites": 1})
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    lost = f"events {len(keep) + 1}-{known} are missing"
    assert str(path) in error and lost in error and "checkpoint of round 1" in error, error
    assert again.round.number == 1  # recovery went on from the checkpoint
    again.close()
    kinds = [(e["seq"], e["kind"]) for e in read_events(path)[len(keep) :]]
    assert kinds[:2] == [(known + 1, "events_lost"), (known + 2, "start")], kinds
