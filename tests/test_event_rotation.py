"""The event log's rotation into gzip segments (coordinator/events/log.py, event_history.py) on
real files, crashes included, and the ``[events]`` config table."""

from __future__ import annotations

import gzip
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from core_helpers import Clock, core_config, delta_like, heartbeat_all, new_core, push

from coordinator.config import ConfigError
from coordinator.events.log import EventLog, EventLogError, EventsConfig, read_events
from coordinator.events.segments import list_segments, read_history, should_rotate

REPO = Path(__file__).resolve().parents[1]
SMALL = EventsConfig(rotate_bytes=1000, keep_segments=10)


def _fill(events: EventLog, n: int, **fields) -> list[int]:
    return [events.append("beat", i=i, **fields) for i in range(n)]


def _seqs(path: Path) -> list[int]:
    return [e["seq"] for e in read_events(path)]


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_should_rotate_only_a_live_file_that_reached_the_size():
    assert should_rotate(1000, 1, 1000) and should_rotate(5000, 7, 1000)
    assert not should_rotate(999, 1, 1000)
    assert not should_rotate(5000, None, 1000)  # nothing in it
    assert not should_rotate(5000, 1, 0)  # 0: never


def test_rotation_moves_the_records_to_a_segment_and_history_reads_on(tmp_path):
    path = tmp_path / "events.jsonl"
    events = EventLog(path, SMALL)
    _fill(events, 5)
    assert events.rotate() is None  # below rotate_bytes: nothing moves
    _fill(events, 20)
    before = path.read_bytes()
    seg = events.rotate()
    assert (seg.first, seg.last) == (1, 25)
    assert seg.path == tmp_path / "events" / "events-0000000001-0000000025.jsonl.gz"
    assert gzip.decompress(seg.path.read_bytes()) == before  # the records, byte for byte
    assert path.read_bytes() == b"" and events.last_seq == 25
    assert events.append("after") == 26
    events.close()
    assert _seqs(path) == list(range(1, 27))
    assert [e["seq"] for e in read_events(path, since_seq=24)] == [25, 26]
    with EventLog(path, SMALL) as again:  # the seq goes on from the segment
        assert again.last_seq == 26 and again.append("x") == 27


def test_only_the_newest_segments_are_kept(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    with EventLog(path, EventsConfig(rotate_bytes=500, keep_segments=2)) as events:
        for _ in range(4):
            _fill(events, 10)
            assert events.rotate() is not None
        _fill(events, 2)
    kept = list_segments(path)
    assert [(s.first, s.last) for s in kept] == [(21, 30), (31, 40)]
    assert sorted(p.name for p in (tmp_path / "events").iterdir()) == [s.path.name for s in kept]
    history = read_history(path)
    assert [e["seq"] for e in history.events] == list(range(21, 43)) and history.gaps == []
    with caplog.at_level(logging.INFO, logger="isthmus.coordinator"):
        EventLog(path).close()
    assert _errors(caplog) == []  # dropping old history on purpose is no hole


def test_appends_go_on_while_rotating_and_every_record_is_kept_once(tmp_path):
    path = tmp_path / "events.jsonl"
    events = EventLog(path, EventsConfig(rotate_bytes=2000, keep_segments=1000))
    stop = threading.Event()
    appended: list[int] = []

    def writer() -> None:
        while not stop.is_set():
            appended.append(events.append("beat", pad="x" * 40))

    thread = threading.Thread(target=writer)
    thread.start()
    rotations = 0
    while rotations < 8:
        rotations += events.rotate() is not None
    stop.set()
    thread.join()
    events.close()
    assert _seqs(path) == appended == list(range(1, len(appended) + 1))
    segments = list_segments(path)
    assert len(segments) == 8
    assert all(b.first == a.last + 1 for a, b in zip(segments, segments[1:], strict=False))


def test_a_rotation_that_fails_changes_nothing_and_the_log_goes_on(tmp_path):
    path = tmp_path / "events.jsonl"
    events = EventLog(path, SMALL)
    _fill(events, 20)
    before = path.read_bytes()
    (tmp_path / "events").write_text("in the way")  # where the segment folder goes
    with pytest.raises(OSError):
        events.rotate()
    assert path.read_bytes() == before and events.append("on") == 21
    (tmp_path / "events").unlink()
    # Now the segment is written, but the new live file cannot be: the segment goes again.
    blocker = tmp_path / f".events.jsonl.tmp-{os.getpid()}"
    blocker.mkdir()
    with pytest.raises(OSError):
        events.rotate()
    assert list_segments(path) == [] and path.read_bytes().startswith(before)
    blocker.rmdir()
    assert (events.rotate().first, events.append("last")) == (1, 22)
    events.close()
    assert _seqs(path) == list(range(1, 23))


def test_the_newest_close_is_found_in_a_segment_when_the_live_file_has_none(tmp_path):
    """A restart that replays a close must know it was logged, even after a rotation."""
    path = tmp_path / "events.jsonl"
    with EventLog(path, SMALL) as events:
        events.append("round_closed", round=6)
        _fill(events, 20)
        events.rotate()
        _fill(events, 20)
        events.rotate()
        events.append("join", site="a")
    with EventLog(path, SMALL) as again:
        assert again.last_closed_round == 6
        again.append("round_closed", round=7)
        assert again.last_closed_round == 7


# A coordinator killed at each step of a rotation: just before or after each rename.
CRASH = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from coordinator.events.log import EventLog, EventsConfig

    renames, when = int(sys.argv[2]), sys.argv[3]
    events = EventLog(Path(sys.argv[1]), EventsConfig(rotate_bytes=1000))
    for i in range(30):
        events.append("beat", i=i)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == renames and when == "before":
            os._exit(9)
        real(src, dst)
        if len(calls) == renames and when == "after":
            os._exit(9)

    os.replace = replace
    events.rotate()
    os._exit(0)
    """
)


@pytest.mark.parametrize(
    ("renames", "when"),
    [(1, "before"), (1, "after"), (2, "before"), (2, "after")],
    ids=["segment-not-renamed", "segment-renamed", "live-not-replaced", "live-replaced"],
)
def test_a_crash_at_any_step_of_a_rotation_loses_nothing(tmp_path, caplog, renames, when):
    path = tmp_path / "state" / "events.jsonl"
    path.parent.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", CRASH, str(path), str(renames), when],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 9, proc.stderr
    renamed = renames == 2 or when == "after"  # the segment was renamed into place
    left = sorted(p.name for p in path.parent.rglob(".*"))  # what the crash left half done
    assert len(left) == (0 if when == "after" else 1), left
    with caplog.at_level(logging.INFO, logger="isthmus.coordinator"):
        events = EventLog(path)
    assert _errors(caplog) == []
    in_both = (renames, when) in [(1, "after"), (2, "before")]  # segment and live file
    assert ("finishing a rotation" in caplog.text) == in_both, caplog.text
    assert events.last_seq == 30 and events.append("after the crash") == 31
    events.close()
    assert _seqs(path) == list(range(1, 32))  # each record once, in order
    assert list(path.parent.rglob(".*")) == []
    segments = list_segments(path)
    if renamed:  # the segment holds the records, the live file only the new one
        assert [(s.first, s.last) for s in segments] == [(1, 30)]
        assert [e["seq"] for e in read_events(path, since_seq=30)] == [31]
        assert path.read_bytes().count(b"\n") == 1
    else:
        assert segments == []


def test_a_damaged_segment_is_named_by_readers_and_does_not_stop_start_up(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, SMALL) as events:
        _fill(events, 20)
        seg = events.rotate()
        events.append("live")
    data = bytearray(seg.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.path.write_bytes(bytes(data))
    with pytest.raises(EventLogError) as err:
        read_events(path)
    assert str(seg.path) in str(err.value)
    with EventLog(path, SMALL) as again:  # start-up reads segment names, not their history
        assert again.last_seq == 21 and again.append("on") == 22


def test_a_segment_gone_from_the_middle_is_reported(tmp_path, caplog):
    path = tmp_path / "events.jsonl"
    with EventLog(path, SMALL) as events:
        for _ in range(3):
            _fill(events, 20)
            events.rotate()
    middle = list_segments(path)[1]
    middle.path.unlink()
    with caplog.at_level(logging.ERROR, logger="isthmus.coordinator"):
        EventLog(path, SMALL).close()
    (error,) = _errors(caplog)
    assert "events 21-40 are missing" in error and "recovery goes on" in error, error
    history = read_history(path)
    assert [(g.first, g.last) for _, g in history.gaps] == [(21, 40)]
    assert [e["seq"] for e in history.events] == [*range(1, 21), *range(41, 61)]


def test_a_coordinator_rotates_its_log_after_checkpoints_and_restarts_on_it(tmp_path):
    clock = Clock()
    sections = {"rounds": {"min_sites": 1, "total": 6}, "events": {"rotate_bytes": 600}}
    core = new_core(tmp_path, clock, **sections)
    token = core.join("site-a")[0].token
    heartbeat_all(core, clock, {"site-a": token}, 1.0)
    for r in range(4):
        push(core, "site-a", token, r, delta_like(core, 1.0))
        heartbeat_all(core, clock, {"site-a": token}, 2.0)  # closes round r, opens r + 1
        core.writer.wait()  # the checkpoint, and the rotation after it
    assert core.round.number == 4
    core.close()
    path = core.events.path
    assert len(list_segments(path)) >= 2
    assert path.stat().st_size < 600 + 1000  # the live file restarted
    events = read_events(path)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert [e["round"] for e in events if e["kind"] == "round_closed"] == [0, 1, 2, 3]
    again = new_core(tmp_path, Clock(100.0), **sections)
    assert again.round.number == 4 and again.events.last_seq == len(events) + 1
    assert again.events.last_closed_round == 3
    again.close()


def test_the_events_table_has_defaults_and_checks(tmp_path):
    assert core_config(tmp_path).events == EventsConfig()
    cfg = core_config(tmp_path, events={"rotate_bytes": 0, "keep_segments": 3})
    assert cfg.events == EventsConfig(rotate_bytes=0, keep_segments=3)
    assert EventsConfig().rotate_bytes > 0  # rotation is on unless asked otherwise
    for table, words in [
        ({"keep_segments": 0}, "events.keep_segments: must be > 0"),
        ({"rotate_bytes": -1}, "events.rotate_bytes: must be a finite number >= 0"),
        ({"rotate_bytes": "1M"}, "events.rotate_bytes: expected an integer"),
        ({"rotate_byte": 10}, "events.rotate_byte: unknown key"),
    ]:
        with pytest.raises(ConfigError, match=words):
            core_config(tmp_path, events=table)
