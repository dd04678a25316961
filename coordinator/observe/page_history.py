"""The status page's ``/history.json``: the rows of ``coordinator history``, followed live.

``LogFollower`` reads the event log as ``coordinator history`` does (kept segments, then the
live file) once, then only the bytes appended since its last read, folding each record into a
``RoundsFold``: a poll every second or two costs what was written in between, not the whole
log, and never touches the coordinator's lock. When rotation replaces the live file, the
records it moved are read back from the newest segments by seq. ``history_doc`` (pure) turns
the rounds into the document the page charts.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path

from coordinator.events.format import EventLogError, parse
from coordinator.events.history import RoundRecord, RoundsFold
from coordinator.events.segments import list_segments, read_segment

log = logging.getLogger("isthmus.coordinator")
MAX_POINTS = 500  # rows in one document: a long job is thinned evenly, the last row kept


class LogFollower:
    """The closed rounds of the event log whose live file is ``live``, read incrementally."""

    def __init__(self, live: Path) -> None:
        self.live = Path(live)
        self._lock = threading.Lock()
        self._fold = RoundsFold()
        self._last_seq = 0
        self._inode: int | None = None
        self._offset = 0
        self._problem = ""

    def rounds(self) -> list[RoundRecord]:
        """Read what was appended since the last call; the rounds closed so far."""
        with self._lock:
            try:
                self._catch_up()
            except (OSError, EventLogError) as exc:  # tried again at the next poll
                if str(exc) != self._problem:  # logged once, not at every poll
                    log.warning("status page: reading the event log: %s", exc)
                self._problem = str(exc)
            else:
                self._problem = ""
            return self._fold.rounds()

    def _catch_up(self) -> None:
        try:
            f = open(self.live, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._inode or st.st_size < self._offset:
                # A first read, or rotation moved the records to a segment: those since the
                # last seq read are there, then the new live file from its start.
                for seg in list_segments(self.live):
                    if seg.last > self._last_seq:
                        for event in read_segment(seg, seg.first - 1, self._last_seq).events:
                            self._take(event)
                self._inode, self._offset = st.st_ino, 0
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        end = data.rfind(b"\n") + 1  # a torn last line is read once it is whole
        for raw in data[:end].splitlines(keepends=True):
            try:
                event, _checked = parse(raw)
            except ValueError:
                continue  # the coordinator reports damaged lines when it starts
            self._take(event)
        self._offset += end

    def _take(self, event: dict) -> None:
        seq = event.get("seq")
        if isinstance(seq, int) and seq > self._last_seq:
            self._last_seq = seq
            self._fold.add(event)


def history_doc(rounds: list[RoundRecord], limit: int = MAX_POINTS) -> dict:
    """The page's history: one row per closed round (at most ``limit``, evenly thinned, the
    newest kept), with the cumulative update bytes counted over every round."""
    rows, total = [], 0
    for r in rounds:
        total += r.update_bytes
        rows.append(
            {
                "round": r.round,
                "closed_wall": r.closed_wall,
                "seconds": r.seconds,
                "mean_loss": r.mean_loss,
                "update_bytes": r.update_bytes,
                "total_update_bytes": total,
                "updates": len(r.updates),
                "participants": len(r.participants),
                "rejected": len(r.rejected),
                "phases": r.phases,
                "evaluation": r.evaluation,
                "reason": r.reason,
            }
        )
    every = max(1, math.ceil(len(rows) / limit))
    shown = rows[::every]
    if rows and shown[-1] is not rows[-1]:
        shown[-1] = rows[-1]
    return {"closed_rounds": len(rows), "every": every, "rounds": shown}
