"""The event log in object storage, beside the checkpoints (``[storage] url = "s3://..."``).

The log lives in segments under ``PREFIX/events/``: ``<first seq, 12 digits>.jsonl.gz``, each
the records ``first``..``last`` in the local log's line format, gzip'd, written once with
``If-None-Match: *``. A segment is named by its first seq only, so two coordinators that both
believe they continue the log after event N race for one key and only one wins: the log can
never hold a seq twice. The local log (``coordinator.events.log``) stays the live tail; its records
after the last shipped one go up as one segment before every checkpoint commit (``ship``, on
the checkpoint thread, inside the commit's fencing) and when the coordinator stops.

A coordinator that starts on the store (a restart, or a standby taking over) first makes its
local log agree with the remote one (``adopt_remote``): it appends the remote records it lacks;
if its local log holds different records at the same seq (an earlier leadership's tail that
another leader continued differently), that local log is moved aside and rebuilt from the
remote one. It then continues numbering after the remote's last seq: no gap, no seq twice.

Reading (``read_remote``) checks what the local reader checks: every record's CRC, seqs going
up by one inside a segment starting at its key's seq, and holes between segments reported.
"""

from __future__ import annotations

import gzip
import io
import logging
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from coordinator.events.format import Damaged, EventLogError, Gap, encode, scan_lines
from coordinator.events.log import EventLog
from coordinator.events.segments import History, read_history
from wire.objstore.objects import get_with_etag, list_keys, put_if

log = logging.getLogger("isthmus.coordinator")
_KEY = re.compile(r"^(\d{12})\.jsonl\.gz$")


def segment_key(first: int) -> str:
    return f"{first:012d}.jsonl.gz"


def segment_starts(keys: list[str]) -> list[int]:
    """The first seqs the segment keys among ``keys`` name, in order (others are ignored)."""
    return sorted(int(m[1]) for k in keys if (m := _KEY.match(k)))


@dataclass(frozen=True)
class RemoteEvents:
    """The segments under ``s3://bucket/prefix/events/``."""

    client: Any = field(repr=False)
    bucket: str
    prefix: str  # ends in "/" (or is empty)

    @property
    def folder(self) -> str:
        return f"{self.prefix}events/"

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.folder}{key}"

    def starts(self) -> list[int]:
        return segment_starts(list_keys(self.client, self.bucket, self.folder))

    def put(self, first: int, lines: list[bytes]) -> bool:
        """Write the segment of ``lines`` (records ``first``...); False if one starting at
        ``first`` exists with other records (another coordinator wrote it). The same bytes
        there are this writer's own earlier try, whose reply was lost: True."""
        raw = io.BytesIO()
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.writelines(lines)
        key = self.folder + segment_key(first)
        if put_if(self.client, self.bucket, key, raw.getvalue(), None):
            return True
        found = get_with_etag(self.client, self.bucket, key)
        return found is not None and found[0] == raw.getvalue()

    def read(self, first: int, after: int) -> list[dict[str, Any]]:
        key = segment_key(first)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.folder + key)["Body"]
            data = gzip.decompress(body.read())
            scan = scan_lines(io.BytesIO(data), after=after, keep_since=0)
        except Damaged as exc:
            raise EventLogError(f"event log segment {self.url(key)}: {exc}") from None
        except (OSError, EOFError, zlib.error) as exc:
            raise EventLogError(f"event log segment {self.url(key)}: unreadable ({exc})") from None
        if scan.torn is not None or scan.archived_bytes or scan.first_seq != first:
            why = scan.torn or f"it does not begin with event {first}, as its name says"
            raise EventLogError(f"event log segment {self.url(key)}: {why}")
        return scan.events


def read_remote(remote: RemoteEvents, since_seq: int = 0) -> History:
    """Every event of the remote log after ``since_seq``, in order, and its holes.

    Raises
    ------
    EventLogError
        A segment is damaged, or holds other records than its name says.
    """
    starts = remote.starts()
    events: list[dict[str, Any]] = []
    gaps: list[tuple[Any, Gap]] = []
    last = starts[0] - 1 if starts else 0
    for i, first in enumerate(starts):
        following = starts[i + 1] if i + 1 < len(starts) else None
        if following is not None and following <= since_seq + 1:
            last = following - 1  # wholly before ``since_seq``: not read
            continue
        if first > last + 1:
            gaps.append((remote.url(segment_key(first)), Gap(last + 1, first - 1, 1, False)))
        seg = remote.read(first, after=first - 1)
        if following is not None and seg[-1]["seq"] >= following:
            raise EventLogError(
                f"event log segments {remote.url(segment_key(first))} and "
                f"{remote.url(segment_key(following))} overlap"
            )
        events += [e for e in seg if e["seq"] > since_seq]
        last = seg[-1]["seq"]
    return History(events, gaps)


class EventShipper:
    """Ships the local log's new records to the remote one (see the module docstring)."""

    def __init__(self, events: EventLog, remote: RemoteEvents, shipped: int) -> None:
        self.events, self.remote, self.shipped = events, remote, shipped
        self.stopped = False  # another coordinator continues the log: this one ships no more

    def ship(self) -> int:
        """Upload the records after the last shipped one; returns how many went.

        Raises
        ------
        EventLogError
            Another coordinator has written the segment this one would (it leads now).
        """
        if self.stopped:
            raise EventLogError(f"{self.remote.url()}: continued by another coordinator")
        new = read_history(self.events.path, since_seq=self.shipped).events
        lines = [encode(e) for e in new]
        if not lines:
            return 0
        first = new[0]["seq"]
        if not self.remote.put(first, lines):
            self.stopped = True
            raise EventLogError(
                f"{self.remote.url(segment_key(first))} already exists: another coordinator "
                "continues the event log; this one's events from there are not published"
            )
        self.shipped = new[-1]["seq"]
        return len(lines)


def adopt_remote(events: EventLog, remote: RemoteEvents) -> int:
    """Make the local log a continuation of the remote one; returns the last shipped seq."""
    history = read_remote(remote)
    theirs = history.events
    remote_last = theirs[-1]["seq"] if theirs else 0
    common = min(events.last_seq, remote_last)
    if common and not _agree(events, theirs, common):
        aside = events.set_aside(f"diverged-{int(time.time())}")
        log.warning(
            "event log %s holds other events than %s at event %d (an earlier leadership's): "
            "moved aside to %s, rebuilt from the object store",
            events.path,
            remote.url(),
            common,
            aside,
        )
    if events.last_seq < remote_last:
        events.adopt([e for e in theirs if e["seq"] > events.last_seq])
    return remote_last


def _agree(events: EventLog, theirs: list[dict[str, Any]], seq: int) -> bool:
    mine = read_history(events.path, since_seq=seq - 1).events[:1]
    other = [e for e in theirs if e["seq"] == seq][:1]
    return not mine or not other or mine == other


def remote_events_for(store, events: EventLog) -> EventShipper:
    """The shipper of ``events`` to ``store``'s bucket, the local log adopted first."""
    remote = RemoteEvents(store.client, store.bucket, store.prefix)
    return EventShipper(events, remote, adopt_remote(events, remote))
