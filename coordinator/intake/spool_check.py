"""Spooled updates checked again before a restarted coordinator counts them.

An update is verified in full (its digest, every value) before it is spooled, but what lies on
disk can change after that: a bad block flips bits, a copy or a full disk cuts a file short, a
record no longer parses. Counting such a file would change theta silently (flipped bytes) or
fail every close for good (a short file: the job would stop at each restart until someone
deleted it). So at start-up each spooled update of the rounds being replayed is read once, in
4 MiB blocks, and its length and digest (``wire.digest``) compared with what its record
(``LABEL.json``, see ``UpdateSpool.commit``) says was counted. Several files are hashed at
once on a few threads (the hashing lets go of the GIL).

A damaged update is *moved aside* into ``spool/round-r/damaged/``, not deleted: the files stay
as evidence for whoever looks into the disk, and their names are the durable record that the
coordinator holds no good copy of that update, so its site is asked to send it again
(``RoundInfo.update_wanted``) even across further restarts. The folder goes with its round's
spool once the round's checkpoint is written.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from coordinator.intake.spool import SpooledUpdate, UpdateSpool
from coordinator.records import UpdateKey
from wire.digest import Hasher
from wire.payload_parts import file_digest as payload_file_digest

log = logging.getLogger("isthmus.coordinator")
HASH_BLOCK = 4 << 20
HASH_THREADS = 4


@dataclass(frozen=True)
class Damage:
    """A spooled update whose file is not the one that was counted.

    ``expected_*`` are what its record says (None when the record itself does not parse);
    ``found_*`` what is on disk (None when the file is missing).
    """

    round: int
    key: UpdateKey
    expected_bytes: int | None
    expected_digest: str | None
    found_bytes: int | None
    found_digest: str | None

    def describe(self) -> str:
        want = (
            "an unreadable record"
            if self.expected_bytes is None
            else f"expected {self.expected_bytes} bytes, digest {self.expected_digest}"
        )
        found = (
            "the file is missing"
            if self.found_bytes is None
            else f"found {self.found_bytes} bytes, digest {self.found_digest}"
        )
        where = f"unit {self.key.unit}" if self.key.unit else f"round {self.round}"
        return f"spooled update {self.key.label} (site {self.key.site}, {where}): {want}, {found}"


@dataclass(frozen=True)
class SpoolCheck:
    """A round's spool after the check: the updates that may count, the ones set aside now,
    and the keys of every update of the round ever set aside (this start or an earlier one)."""

    good: tuple[SpooledUpdate, ...]
    damaged: tuple[Damage, ...]
    set_aside: frozenset[UpdateKey]


def file_digest(path) -> tuple[int, str] | None:
    """(length, digest hex) of a file read in ``HASH_BLOCK`` pieces into one buffer; None if
    it is missing."""
    h, n, buf = Hasher(), 0, bytearray(HASH_BLOCK)
    try:
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(buf):
                h.update(memoryview(buf)[:got])
                n += got
    except FileNotFoundError:
        return None
    return n, h.digest().hex()


def spooled_digest(update: SpooledUpdate) -> tuple[int, str] | None:
    """(length, digest hex) of a spooled update's file as its manifest states the digest:
    of the whole, or of its parts' digests (``wire.payload_parts``)."""
    parts = update.manifest.parts
    if not parts:
        return file_digest(update.path)
    try:
        n = update.path.stat().st_size
    except FileNotFoundError:
        return None
    if n != update.manifest.total_bytes:
        return n, "-"  # its parts cannot be told apart: the length alone says it is damaged
    return n, payload_file_digest(update.path, n, parts).hex()


def damage_of(round_number: int, update: SpooledUpdate) -> Damage | None:
    """How ``update``'s file differs from its record, or None when it is intact."""
    want_n, want_sha = update.manifest.total_bytes, update.manifest.digest.hex()
    found = spooled_digest(update)
    if found == (want_n, want_sha):
        return None
    found_n, found_sha = found if found is not None else (None, None)
    return Damage(round_number, update.key, want_n, want_sha, found_n, found_sha)


def check_round(spool: UpdateSpool, round_number: int) -> SpoolCheck:
    """Check every spooled update of a round; set the damaged ones aside, each with an ERROR."""
    updates, unreadable = spool.listing(round_number)
    if len(updates) > 1:
        with ThreadPoolExecutor(min(HASH_THREADS, len(updates)), "spool-check") as pool:
            found = list(pool.map(lambda u: damage_of(round_number, u), updates))
    else:
        found = [damage_of(round_number, u) for u in updates]
    damaged = [d for d in found if d is not None]
    for label in unreadable:
        update = spool.round_dir(round_number) / f"{label}.update"
        digest = file_digest(update)
        n, sha = digest if digest is not None else (None, None)
        damaged.append(Damage(round_number, UpdateKey.from_label(label), None, None, n, sha))
    for d in damaged:
        moved = spool.set_aside(round_number, d.key.label)
        log.error(
            "round %d: %s; moved aside to %s and not counted: site %s is asked to send it again",
            round_number,
            d.describe(),
            moved.parent,
            d.key.site,
        )
    good = tuple(u for u, d in zip(updates, found, strict=True) if d is None)
    aside = frozenset(UpdateKey.from_label(lb) for lb in spool.set_aside_labels(round_number))
    return SpoolCheck(good, tuple(damaged), aside)


@dataclass(frozen=True)
class Wanted:
    """Updates of round ``round`` whose spooled copy was lost: their sites are asked again.

    ``every_through``: every update of the rounds from ``round`` to this one is wanted (a
    coordinator elected through etcd took over from another host, whose spool it does not
    have). That is the round of the checkpoint it took over from and the next: the old leader
    opens round r+1 as soon as theta_{r+1} is recoverable, before its checkpoint is
    committed, and sites may have delivered round r+1's updates there; round r+2 opens only
    once that checkpoint is."""

    round: int = -1
    keys: frozenset[UpdateKey] = frozenset()
    every_through: int = -1

    @classmethod
    def after_takeover(cls, round_number: int, keys: frozenset[UpdateKey]) -> Wanted:
        return cls(round_number, keys, every_through=round_number + 1)

    def asks_for(self, round_number: int, key: UpdateKey, counted, committing) -> bool:
        """Whether ``key`` is wanted again in ``round_number``: its copy was lost and no other
        is counted or being counted."""
        if key in counted or key in committing:
            return False
        if self.round <= round_number <= self.every_through:
            return True
        return round_number == self.round and key in self.keys
