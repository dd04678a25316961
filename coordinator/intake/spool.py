"""Received updates on disk: durable before they count, read back to be summed.

Each upload streams into ``spool/round-NNNNNNNN/SITE+UPLOAD.part`` (which byte ranges of it
arrived: ``SITE+UPLOAD.ranges``, ``coordinator.persist.disk.RangeLog``); once its digest and
contents verify it is fsynced and renamed to ``LABEL.update`` beside a ``LABEL.json`` holding
its key, manifest and weight (the label is the update key's: ``site``, ``site@u3``,
``site@late2``). An update must count whole or not at all (a site can die half-way, a chunk can
fail its checksum at the end), so the accumulator (``coordinator.round.accumulate``) reads verified
spool files rather than chunks in flight. The page cache usually still holds them.

Beside the updates, two small records make the round replayable after a crash:

* ``_round.json``: the participants (in fold order) and the wall-clock time the round opened;
* ``_close.json``: written, fsynced, the moment the round is decided, before theta_{r+1} is
  computed: the keys that count, in the order they are summed, and why the round closed. With
  the previous checkpoint it determines theta_{r+1}, so the coordinator publishes theta_{r+1}
  without waiting for its own checkpoint; a restart recomputes it from here.

A restart checks each spooled update against the length and digest its ``LABEL.json`` records
before counting it again (``coordinator.intake.spool_check``); one that no longer matches is moved
aside into ``damaged/`` (kept as evidence, and as the record that its site is asked to send it
again) rather than deleted.

The fsyncs of an update happen outside the coordinator's lock (see ``coordinator.core``).

Files are reused rather than deleted: once a round's checkpoint is durable its spooled files
move into ``free/``, and the next uploads write over them (``take_free``). Writing into pages
the page cache already holds costs a fraction of filling new ones (measured here: 0.1 against
0.2-2.3 CPU s per GB, the high end where the host had taken freed memory back), and the
receive path is otherwise one copy and one digest per byte. A reused file's old bytes are
never trusted: an upload's range log says what arrived (``coordinator.intake.upload_bytes``).
The pool holds at most as many files as the round it was filled from had; a full disk empties
it (``release_free``).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from coordinator.persist.local_store import fsync_dir, write_atomic
from coordinator.records import UpdateKey
from strategies.base import SiteUpdate
from wire.payload_parts import PayloadPart
from wire.tensors import Manifest, TensorEntry, entries_from_json, entries_to_json, entry_tensor

# Site names start with a letter or digit, so no update's "LABEL.json" can be these files.
ROUND_FILE = "_round.json"
CLOSE_FILE = "_close.json"
DAMAGED_DIR = "damaged"
FREE_DIR = "free"  # not a round folder: its files are spare space, never read
_scratch = threading.local()
_free_lock = threading.Lock()


class SpoolError(Exception):
    """A spooled file that is not what its record says."""


@dataclass(frozen=True)
class SpooledUpdate:
    key: UpdateKey
    weight: float
    path: Path
    manifest: Manifest
    upload_id: str = ""
    # A sharded job's: the digest of the update's part on each shard (``coordinator.shards``).
    shard_digests: tuple[bytes, ...] = ()

    @property
    def site(self) -> str:
        return self.key.site

    def as_site_update(self) -> SiteUpdate:
        """The update as strategies see it: its tensors memory-mapped only when read."""
        reader = partial(read_tensors, self.path, self.manifest)
        return SiteUpdate(self.key.site, self.weight, reader, key=self.key.label)


def _entries_from_json(items: list[dict], total: int, sha: bytes, parts=()) -> Manifest:
    split = tuple(PayloadPart(int(o), int(n), bytes.fromhex(h)) for o, n, h in parts)
    return Manifest(entries_from_json(items), total, sha, split)


def read_entry(path: Path, e: TensorEntry, keep: bool = True) -> torch.Tensor:
    """One entry's bytes as a uint8 tensor. With ``keep`` they land in this thread's scratch
    buffer (reused: valid only until the thread's next ``read_entry``; for the one thread that
    folds); without, in a new tensor that goes when the caller drops it (for the many threads
    that verify uploads, which must not each keep a tensor's worth of memory)."""
    buf = getattr(_scratch, "buf", None) if keep else None
    if buf is None or buf.numel() < e.nbytes:
        buf = torch.empty(max(e.nbytes, 1), dtype=torch.uint8)
        if keep:
            _scratch.buf = buf
    out = buf[: e.nbytes]
    if e.nbytes:
        read_into(path, e.offset, out)
    return out


def mapped_entry(path: Path, e: TensorEntry) -> torch.Tensor:
    """One entry's bytes as a uint8 tensor over a private mapping of the file: its pages are
    the page cache's, so checking a spooled update takes no memory of its own (a copy would
    be new pages for every encoded tensor of every update)."""
    if not e.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=e.offset, shape=(e.nbytes,))
    return torch.from_numpy(data)


def read_into(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the uint8 tensor ``out`` with the file's bytes from ``offset``."""
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        view = memoryview(out.numpy())
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{path}: ends at byte {offset + got}")
            got += n


def read_tensors(path: Path, manifest: Manifest):
    """Yield ``(name, tensor)`` for each tensor of a spooled payload, memory-mapped; a tensor
    sent in pieces is put together first (one tensor of memory)."""
    if manifest.total_bytes == 0:
        return
    data = np.memmap(path, dtype=np.uint8, mode="c", shape=(manifest.total_bytes,))
    groups: dict[str, list[TensorEntry]] = {}
    for e in manifest.entries:  # payload order; the pieces of a tensor together
        groups.setdefault(e.name, []).append(e)
    for name, entries in groups.items():
        views = [entry_tensor(e, torch.from_numpy(data[e.offset : e.end])) for e in entries]
        if len(entries) == 1 and not entries[0].is_piece:
            yield name, views[0]  # decoded one tensor at a time if encoded
            continue
        whole = torch.empty(entries[0].full_shape, dtype=views[0].dtype)
        for e, v in zip(entries, views, strict=True):
            whole[e.box()] = v
        yield name, whole


class UpdateSpool:
    """The spool folder of one coordinator."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def round_dir(self, round_number: int) -> Path:
        return self.root / f"round-{round_number:08d}"

    def part_path(self, round_number: int, site: str, upload_id: str) -> Path:
        # '+' cannot occur in site names or upload ids, so no two uploads share a file.
        return self.round_dir(round_number) / f"{site}+{upload_id}.part"

    def open_part(self, round_number: int, site: str, upload_id: str):
        """Open (creating or continuing) an upload's partial file for appending a whole
        payload at once; uploads received over the wire write through ``disk.PartFile``."""
        d = self.round_dir(round_number)
        d.mkdir(parents=True, exist_ok=True)
        return open(self.part_path(round_number, site, upload_id), "ab")

    def discard_part(self, round_number: int, site: str, upload_id: str) -> None:
        """Remove an upload's ``.part`` file and its range log (``disk.RangeLog``)."""
        part = self.part_path(round_number, site, upload_id)
        part.unlink(missing_ok=True)
        part.with_suffix(".ranges").unlink(missing_ok=True)

    def commit(
        self,
        round_number: int,
        site: str,
        upload_id: str,
        manifest: Manifest,
        weight: float,
        key: UpdateKey | None = None,
        shard_digests: tuple[bytes, ...] = (),
    ) -> SpooledUpdate:
        """Make a verified upload durable as the round's update ``key`` (default: the site's
        own). Slow for a large update (an fsync): never call it holding the coordinator's lock."""
        key = key or UpdateKey(site)
        d = self.round_dir(round_number)
        part = self.part_path(round_number, site, upload_id)
        with open(part, "rb+") as f:
            size = os.fstat(f.fileno()).st_size
            if size != manifest.total_bytes:  # the hash covered what arrived, not the file
                raise SpoolError(
                    f"{part.name} holds {size} bytes, its manifest {manifest.total_bytes}"
                )
            os.fsync(f.fileno())
        final = d / f"{key.label}.update"
        meta = {
            "key": key.to_json(),
            "weight": weight,
            "upload_id": upload_id,
            "total_bytes": manifest.total_bytes,
            "digest": manifest.digest.hex(),
            "tensors": entries_to_json(manifest.entries),
        }
        if manifest.parts:
            meta["parts"] = [[p.offset, p.length, p.digest.hex()] for p in manifest.parts]
        if shard_digests:
            meta["shard_digests"] = [d.hex() for d in shard_digests]
        # The record first: it is what needs disk space, and a failure then leaves the
        # .part file as it was, for the retry. A record without its .update is not counted.
        write_atomic(d / f"{key.label}.json", json.dumps(meta).encode())
        os.replace(part, final)
        part.with_suffix(".ranges").unlink(missing_ok=True)  # the bytes are all in
        fsync_dir(d)
        return SpooledUpdate(key, weight, final, manifest, upload_id, tuple(shard_digests))

    def completed(self, round_number: int) -> list[SpooledUpdate]:
        """Updates of a round that were committed (e.g. before a crash), as their records say:
        their files are not checked here (``coordinator.intake.spool_check`` does that)."""
        return [u for u in self.listing(round_number)[0] if u.path.exists()]

    def listing(self, round_number: int) -> tuple[list[SpooledUpdate], list[str]]:
        """Every committed update's record (its file may be missing), and the labels of
        records that do not parse."""
        d = self.round_dir(round_number)
        out, unreadable = [], []
        for meta_path in sorted(d.glob("*.json")) if d.exists() else []:
            if meta_path.name in (ROUND_FILE, CLOSE_FILE):
                continue
            try:
                meta = json.loads(meta_path.read_text())
                key = UpdateKey.from_json(meta["key"])
                manifest = _entries_from_json(
                    meta["tensors"],
                    meta["total_bytes"],
                    bytes.fromhex(meta["digest"]),
                    meta.get("parts", ()),
                )
                weight = float(meta["weight"])
                upload_id = str(meta.get("upload_id", ""))
                shards = tuple(bytes.fromhex(h) for h in meta.get("shard_digests", ()))
            except (ValueError, KeyError, TypeError, AttributeError):
                unreadable.append(meta_path.stem)
                continue
            path = d / f"{key.label}.update"
            out.append(SpooledUpdate(key, weight, path, manifest, upload_id, shards))
        return out, unreadable

    def set_aside(self, round_number: int, label: str) -> Path:
        """Move update ``label``'s files into the round's ``damaged/`` folder (as
        ``LABEL.N.json`` and ``LABEL.N.update``, N counting earlier copies set aside); returns
        where its record went. The record goes first: from then on the update is not counted."""
        d = self.round_dir(round_number)
        aside = d / DAMAGED_DIR
        aside.mkdir(parents=True, exist_ok=True)
        n = 0
        while (aside / f"{label}.{n}.json").exists() or (aside / f"{label}.{n}.update").exists():
            n += 1
        for suffix in ("json", "update"):
            src = d / f"{label}.{suffix}"
            if src.exists():
                os.replace(src, aside / f"{label}.{n}.{suffix}")
        fsync_dir(aside)
        fsync_dir(d)
        return aside / f"{label}.{n}.json"

    def set_aside_labels(self, round_number: int) -> list[str]:
        """Labels of the updates of a round ever set aside as damaged (sorted, no repeats)."""
        aside = self.round_dir(round_number) / DAMAGED_DIR
        names = aside.glob("*.json") if aside.is_dir() else []
        return sorted({p.name.removesuffix(".json").rpartition(".")[0] for p in names})

    def write_round(self, round_number: int, info: dict) -> None:
        self._write_record(round_number, ROUND_FILE, info)

    def read_round(self, round_number: int) -> dict | None:
        return self._read_record(round_number, ROUND_FILE)

    def write_close(self, round_number: int, record: dict) -> None:
        """The round's decision, durable before theta_{r+1} is computed or served."""
        self._write_record(round_number, CLOSE_FILE, record)

    def read_close(self, round_number: int) -> dict | None:
        return self._read_record(round_number, CLOSE_FILE)

    def _write_record(self, round_number: int, name: str, info: dict) -> None:
        d = self.round_dir(round_number)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / name, json.dumps(info).encode())

    def _read_record(self, round_number: int, name: str) -> dict | None:
        path = self.round_dir(round_number) / name
        return json.loads(path.read_text()) if path.exists() else None

    def drop_rounds_before(self, round_number: int, keep: Collection[Path] = ()) -> None:
        """Delete the folders of rounds before ``round_number``; their update files go to
        the free pool first, for the next uploads to write over. The ``.part`` files in
        ``keep`` (uploads still being received or verified, which are refused as late when
        they end) stay, with their ``.ranges`` and folder, until a later call."""
        kept = {Path(p) for p in keep}
        kept |= {p.with_suffix(".ranges") for p in kept}
        dropped = [
            d
            for d in self.root.glob("round-*")
            if int(d.name.removeprefix("round-")) < round_number
        ]
        spare = [f for d in dropped for f in (*d.glob("*.update"), *d.glob("*.part"))]
        spare = [f for f in spare if f not in kept]
        if spare:
            self._refill(spare)
        for d in dropped:
            if not any(p.parent == d for p in kept):
                shutil.rmtree(d, ignore_errors=True)
                continue
            for f in d.iterdir():
                if f.is_dir():
                    shutil.rmtree(f, ignore_errors=True)
                elif f not in kept:
                    f.unlink(missing_ok=True)

    @property
    def free_dir(self) -> Path:
        return self.root / FREE_DIR

    def _refill(self, spare: list[Path]) -> None:
        """Make ``spare`` the free pool: the files already there go (older, and as many as
        the newest round needs is enough)."""
        free = self.free_dir
        free.mkdir(exist_ok=True)
        for old in free.iterdir():
            old.unlink(missing_ok=True)
        for i, f in enumerate(spare):
            try:
                os.replace(f, free / f"{i:06d}.spare")
            except OSError:
                f.unlink(missing_ok=True)

    def take_free(self, target: Path) -> bool:
        """Move a file of the free pool to ``target`` (which must not exist); False when the
        pool is empty. Its bytes are stale: only its pages are wanted."""
        with _free_lock:
            try:
                names = sorted(os.listdir(self.free_dir))
            except FileNotFoundError:
                return False
            for name in names:
                try:
                    os.replace(self.free_dir / name, target)
                    return True
                except FileNotFoundError:
                    continue
        return False

    def release_free(self) -> None:
        """Give the free pool's disk space back (the disk is full)."""
        with _free_lock:
            shutil.rmtree(self.free_dir, ignore_errors=True)
