"""Received updates on disk, read back one tensor at a time when the round is summed.

Each upload streams into ``spool/round-NNNNNNNN/SITE+UPLOAD.part``; when its SHA-256 and contents
verify it is fsynced and renamed to ``SITE.update`` beside a ``SITE.json`` that records its
manifest and weight. Memory stays at one chunk per upload, however many sites push at once.

Why spool instead of adding each chunk into the accumulator as it arrives: an update must count
whole or not at all (a site can die half-way, a chunk can fail its checksum at the end), and
floating-point addition is not associative, so a sum taken in arrival order would differ from
run to run. Summing verified updates in site-name order at round close makes theta_{r+1} a
function of the set of updates alone: the same after a coordinator crash and replay, bit for bit.
The sum (``strategies.robust.weighted_mean_of``) still streams: one tensor of one update is
read (memory-mapped) at a time, so memory is about one model for the accumulator whatever the
number of sites. Spooled updates also survive a
coordinator crash, so the round in flight resumes without sites sending them again. Robust
aggregation (median, trimmed mean, clipping) and strategies that take every update read the
same files, memory-mapped, through ``SpooledUpdate.as_site_update``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from coordinator.store import fsync_dir
from strategies.base import SiteUpdate
from wire.tensors import Manifest, TensorEntry, entry_tensor

# Site names start with a letter or digit, so no site's "SITE.json" can be this file.
ROUND_FILE = "_round.json"


@dataclass(frozen=True)
class SpooledUpdate:
    site: str
    weight: float
    path: Path
    manifest: Manifest

    def as_site_update(self) -> SiteUpdate:
        """The update as strategies see it: its tensors memory-mapped only when read."""
        return SiteUpdate(self.site, self.weight, partial(read_tensors, self.path, self.manifest))


def _entries_to_json(manifest: Manifest) -> list[dict]:
    return [
        {
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "offset": e.offset,
            "nbytes": e.nbytes,
            "codec": e.codec,
            "codec_meta": e.codec_meta.hex(),
        }
        for e in manifest.entries
    ]


def _entries_from_json(items: list[dict], total: int, sha: bytes) -> Manifest:
    entries = tuple(
        TensorEntry(
            i["name"],
            i["dtype"],
            tuple(i["shape"]),
            i["offset"],
            i["nbytes"],
            i["codec"],
            bytes.fromhex(i.get("codec_meta", "")),
        )
        for i in items
    )
    return Manifest(entries, total, sha)


def read_tensors(path: Path, manifest: Manifest):
    """Yield ``(name, tensor)`` for each tensor of a spooled payload, memory-mapped."""
    if manifest.total_bytes == 0:
        return
    data = np.memmap(path, dtype=np.uint8, mode="c", shape=(manifest.total_bytes,))
    for e in manifest.entries:
        raw = torch.from_numpy(data[e.offset : e.offset + e.nbytes])
        yield e.name, entry_tensor(e, raw)  # decoded one tensor at a time if encoded


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
        """Open (creating or continuing) the partial file of an upload, for appending."""
        d = self.round_dir(round_number)
        d.mkdir(parents=True, exist_ok=True)
        return open(self.part_path(round_number, site, upload_id), "ab")

    def discard_part(self, round_number: int, site: str, upload_id: str) -> None:
        self.part_path(round_number, site, upload_id).unlink(missing_ok=True)

    def commit(
        self,
        round_number: int,
        site: str,
        upload_id: str,
        manifest: Manifest,
        weight: float,
        key: str | None = None,
    ) -> SpooledUpdate:
        """Make a verified upload durable as the round's update ``key`` (default: the site;
        ``SITE@UNIT`` or ``SITE@lateR`` when a site has more than one update in a round)."""
        d = self.round_dir(round_number)
        part = self.part_path(round_number, site, upload_id)
        with open(part, "rb+") as f:
            os.fsync(f.fileno())
        site = key or site
        final = d / f"{site}.update"
        os.replace(part, final)
        meta = {
            "site": site,
            "weight": weight,
            "upload_id": upload_id,
            "total_bytes": manifest.total_bytes,
            "sha256": manifest.sha256.hex(),
            "tensors": _entries_to_json(manifest),
        }
        tmp = d / f".{site}.json.tmp"
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / f"{site}.json")
        fsync_dir(d)
        return SpooledUpdate(site, weight, final, manifest)

    def completed(self, round_number: int) -> list[SpooledUpdate]:
        """Updates of a round that were committed (e.g. before a crash)."""
        d = self.round_dir(round_number)
        out = []
        for meta_path in sorted(d.glob("*.json")) if d.exists() else []:
            if meta_path.name == ROUND_FILE:
                continue
            meta = json.loads(meta_path.read_text())
            path = d / f"{meta['site']}.update"
            if not path.exists():
                continue
            manifest = _entries_from_json(
                meta["tensors"], meta["total_bytes"], bytes.fromhex(meta["sha256"])
            )
            out.append(SpooledUpdate(meta["site"], float(meta["weight"]), path, manifest))
        return out

    def write_round(self, round_number: int, info: dict) -> None:
        d = self.round_dir(round_number)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{ROUND_FILE}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / ROUND_FILE)
        fsync_dir(d)

    def read_round(self, round_number: int) -> dict | None:
        path = self.round_dir(round_number) / ROUND_FILE
        return json.loads(path.read_text()) if path.exists() else None

    def drop_rounds_before(self, round_number: int) -> None:
        for d in self.root.glob("round-*"):
            if int(d.name.removeprefix("round-")) < round_number:
                shutil.rmtree(d, ignore_errors=True)
