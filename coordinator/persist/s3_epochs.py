"""The starts of a job's coordinators in object storage, and which commits they leave valid.

``PREFIX/epoch`` holds one small JSON record, replaced only by conditional writes::

    {"epoch": 7, "revision": 1234, "history": [[6, 3], [7, 5]]}

``epoch`` counts the starts (the high bits of every lease token; one more per start, so it
stays small whatever etcd's revision). ``revision`` is the newest election revision that
counted a start: a candidate elected at a lower one is stale (it lost its leadership before it
got here) and may not count, so a late candidate cannot fence out the leader it lost to.
``history`` lists the recent starts as ``[epoch, from_round]``: the round whose checkpoint
that start loaded (-1: none), or ``None`` until it has loaded.

A checkpoint manifest names the epoch that wrote it. A deposed leader's manifest write can
land after a newer start took over (the write was sent before its fence check failed, and
stalled); it is no commit: a manifest of round r by epoch e is void once a later start took
over from a round before r (``void_by``). Readers skip it, and the new leader writes its own
round r over it. A plain number in ``PREFIX/epoch`` is the record of an older version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

HISTORY = 64  # starts remembered: far more than the checkpoints kept


class EpochError(ValueError):
    """A record that is not one, or a start that may not be counted; the message says why."""


@dataclass(frozen=True)
class EpochRecord:
    epoch: int = 0
    revision: int = 0
    history: tuple[tuple[int, int | None], ...] = field(default_factory=tuple)

    def to_bytes(self) -> bytes:
        doc = {"epoch": self.epoch, "revision": self.revision, "history": self.history}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"


def parse_record(data: bytes | None) -> EpochRecord:
    """The record from ``PREFIX/epoch``'s bytes (None: no start yet); ``EpochError`` if
    damaged."""
    if data is None:
        return EpochRecord()
    text = data.decode(errors="replace").strip()
    if text.isdigit():  # an older version's plain counter
        return EpochRecord(int(text))
    try:
        doc = json.loads(text)
        epoch, revision = doc["epoch"], doc["revision"]
        history = tuple((int(e), None if r is None else int(r)) for e, r in doc["history"])
    except (ValueError, KeyError, TypeError) as exc:
        raise EpochError(f"expected an epoch record, found {text[:60]!r} ({exc})") from None
    if not all(isinstance(v, int) and v >= 0 for v in (epoch, revision)):
        raise EpochError(f"expected an epoch record, found {text[:60]!r}")
    return EpochRecord(epoch, revision, history)


def count_start(prev: EpochRecord, revision: int = 0) -> EpochRecord:
    """The record once one more start is counted (pure). ``revision``: the election's, for
    a coordinator elected through etcd (0: none); ``EpochError`` if a start elected at that
    revision or later was counted already."""
    if revision and prev.revision >= revision:
        raise EpochError(
            f"a coordinator elected at etcd revision {prev.revision} has taken over since this "
            f"one was elected (at revision {revision}): this one is deposed (if etcd was rebuilt "
            "from nothing, its revisions start again: start the job once without --ha)"
        )
    new = prev.epoch + 1
    history = (*prev.history, (new, None))[-HISTORY:]
    # A start without an election (no --ha) takes the store over whatever etcd says, and
    # clears the revision fence: the way back after etcd is rebuilt from nothing.
    return EpochRecord(new, revision, history)


def took_over(prev: EpochRecord, epoch: int, from_round: int) -> EpochRecord:
    """The record once start ``epoch`` loaded ``from_round`` (-1: nothing); ``EpochError``
    if another start was counted since."""
    if prev.epoch != epoch:
        raise EpochError(f"start {prev.epoch} was counted after this one ({epoch})")
    history = tuple((e, from_round if e == epoch else r) for e, r in prev.history)
    return EpochRecord(prev.epoch, prev.revision, history)


def void_by(record: EpochRecord, round_number: int, written_by: int) -> int | None:
    """The later start that voids round ``round_number``'s manifest written by start
    ``written_by`` (it took over from an earlier round), or None if the manifest stands."""
    for epoch, from_round in record.history:
        if epoch > written_by and from_round is not None and round_number > from_round:
            return epoch
    return None
