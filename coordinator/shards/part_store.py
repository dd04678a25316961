"""A shard's durable state: one folder per theta version of its tensors.

``v00000007/`` holds ``theta.safetensors`` (the shard's tensors of theta_7),
``strategy.safetensors`` (the strategy's state for them) and ``close.json`` (the close that
made it: the round, the parts folded in order, and each tensor's digest). A folder is written
under a temporary name, fsynced and renamed, so a folder that exists is whole; a shard killed
with -9 starts again from the newest one, and a close the lead sends again is answered from
its record. The two newest versions are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from coordinator.persist.local_store import fsync_dir
from wire.digest import tensor_records
from wire.safetensors_io import write_tensors

THETA, STRATEGY, CLOSE = "theta.safetensors", "strategy.safetensors", "close.json"
KEEP = 2


class PartStoreError(ValueError):
    """A saved version that cannot be read; the message says which and what to do."""


@dataclass(frozen=True)
class FoldedPart:
    """One update's part as a close record names it (``ShardPart`` on the wire)."""

    site: str
    upload_id: str
    digest: bytes
    weight: float
    alpha: float

    def to_json(self) -> list:
        return [self.site, self.upload_id, self.digest.hex(), self.weight, self.alpha]

    @classmethod
    def from_json(cls, item: list) -> FoldedPart:
        site, upload_id, digest, weight, alpha = item
        return cls(site, upload_id, bytes.fromhex(digest), float(weight), float(alpha))


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's part of a state digest (``wire.digest.compose``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: bytes

    def as_tuple(self) -> tuple[str, str, tuple[int, ...], bytes]:
        return (self.name, self.dtype, self.shape, self.digest)


@dataclass(frozen=True)
class StoredPart:
    """A version on disk: where its files are, and the close that made it (``round`` None:
    theta_0)."""

    version: int
    folder: Path
    round: int | None
    parts: tuple[FoldedPart, ...]
    tensors: tuple[TensorRecord, ...]

    @property
    def theta_path(self) -> Path:
        return self.folder / THETA

    def strategy_state(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.folder / STRATEGY))


def records_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorRecord]:
    """Each tensor's record, in name order (its digest taken as ``wire.digest`` takes it)."""
    return [TensorRecord(*r) for r in tensor_records(tensors)]


class PartStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".v*"):  # a save cut short: never renamed, never read
            shutil.rmtree(stale, ignore_errors=True)

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version:08d}"

    def versions(self) -> list[int]:
        names = (p.name for p in self.folder.iterdir() if p.is_dir())
        return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())

    def load(self, version: int) -> StoredPart | None:
        """Version ``version`` as saved (None: not saved). Raises ``PartStoreError`` when its
        record does not read: the folder was whole when renamed, so its disk failed."""
        folder = self._path(version)
        try:
            record = json.loads((folder / CLOSE).read_text())
            return StoredPart(
                version,
                folder,
                record["round"],
                tuple(FoldedPart.from_json(p) for p in record["parts"]),
                tuple(
                    TensorRecord(n, d, tuple(s), bytes.fromhex(h))
                    for n, d, s, h in record["tensors"]
                ),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PartStoreError(
                f"{folder / CLOSE} is damaged ({type(exc).__name__}: {exc}): this shard's "
                f"theta_{version} cannot be read; restore {self.folder} from a copy (a shard "
                "keeps its parts on its own disk only)"
            ) from exc

    def drop_after(self, version: int) -> None:
        """Remove the versions after ``version`` (a shard going back to it): each folder is
        renamed out of sight first, so a crash leaves ``version`` the newest."""
        for newer in (v for v in self.versions() if v > version):
            gone = self.folder / f".{self._path(newer).name}.dropped-{os.getpid()}"
            os.rename(self._path(newer), gone)
            fsync_dir(self.folder)
            shutil.rmtree(gone, ignore_errors=True)

    def latest(self) -> StoredPart | None:
        versions = self.versions()
        return self.load(versions[-1]) if versions else None

    def save(
        self,
        version: int,
        theta: Mapping[str, torch.Tensor],
        strategy_state: Mapping[str, torch.Tensor],
        round_number: int | None,
        parts: tuple[FoldedPart, ...],
        tensors: tuple[TensorRecord, ...],
    ) -> StoredPart:
        """Write version ``version`` whole (see the module docstring); drop the older ones."""
        final = self._path(version)
        tmp = self.folder / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_tensors(tmp / THETA, theta)
        write_tensors(tmp / STRATEGY, dict(strategy_state))
        record = {
            "round": round_number,
            "parts": [p.to_json() for p in parts],
            "tensors": [[t.name, t.dtype, list(t.shape), t.digest.hex()] for t in tensors],
        }
        with open(tmp / CLOSE, "w") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # a version saved again after a crash: the same bytes
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.folder)
        for old in self.versions()[:-KEEP]:
            shutil.rmtree(self._path(old), ignore_errors=True)
        saved = self.load(version)
        assert saved is not None
        return saved
