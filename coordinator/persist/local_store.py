"""Durable coordinator state: atomic checkpoints after every outer step.

A checkpoint is a folder ``checkpoints/round-NNNNNNNN`` holding ``theta.safetensors``,
``strategy.safetensors`` and ``meta.json``. It is written under a temporary name, every file
fsynced, the folder fsynced, renamed into place and the parent fsynced, and only then does
``LATEST`` (itself replaced atomically) point at it. A crash at any instant leaves either the old
or the new checkpoint whole. Loading verifies the state hash recorded in ``meta.json`` and falls
back to the previous checkpoint if the newest is damaged. Tensors are stored with safetensors:
loading never executes code.

The start epoch (``epoch``) counts coordinator starts on this state folder; lease tokens carry it
so that tokens granted before a crash are stale afterwards.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from coordinator.persist import state_digests
from coordinator.persist.spare_files import SPARE, STRATEGY, prune_keeping_spares, take_spare
from coordinator.persist.theta_file import link_or_copy
from wire.digest import state_digest
from wire.safetensors_io import map_tensors, write_tensors

log = logging.getLogger(__name__)
FORMAT = 1
KEEP = 3


class StoreError(RuntimeError):
    """The state folder cannot be used; the message says which file and why."""


class StoreUnavailable(StoreError):
    """The object store did not answer (a connection refused, reset or timed out, or it said
    it is overloaded): nothing was committed, and the same call may succeed later."""


@dataclass
class Checkpoint:
    round: int
    theta: dict[str, torch.Tensor]
    strategy_state: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    # The compressed downlink: its error-feedback residuals and the delta theta_{r-1} -> theta_r
    # as served (``coordinator.round.downlink``); empty without one.
    downlink: dict[str, torch.Tensor] = field(default_factory=dict)
    # theta's state digest when the caller already has it (the coordinator takes it once).
    theta_hash: bytes | None = None
    # theta already written as a safetensors file of these tensors
    # (``coordinator.persist.theta_file``):
    # the checkpoint links (or copies) it instead of writing theta again.
    theta_file: Path | None = None


_counter = itertools.count()
# One writer at a time per state folder within a process (the folder lock keeps other
# processes out): a checkpoint being written in the background and one written by a restart
# in the same process (tests do that) must not interleave.
_writing: dict[Path, threading.Lock] = {}
_writing_guard = threading.Lock()


def _writer_lock(folder: Path) -> threading.Lock:
    with _writing_guard:
        return _writing.setdefault(folder.resolve(), threading.Lock())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, whole."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: leave the old file, and no debris
        raise
    fsync_dir(path.parent)


def place_file(source: Path, target: Path) -> None:
    """``target`` with ``source``'s bytes (``link_or_copy``), durably."""
    link_or_copy(source, target)
    fsync_file(target)


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


class CheckpointStore:
    """Checkpoints and the start epoch under one state folder."""

    def __init__(self, state_dir: Path, read_only: bool = False) -> None:
        """``read_only``: only read checkpoints (``coordinator export``, maybe while a
        coordinator serves this folder): create nothing, and leave its writes in progress."""
        self.root = Path(state_dir)
        self.dir = self.root / "checkpoints"
        if read_only:
            if not self.dir.is_dir():
                raise StoreError(f"{self.root} holds no checkpoints (is it a job's state folder?)")
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create state folder {self.dir}: {exc.strerror}") from exc
        # Leftovers of writes cut short: checkpoint folders and write_atomic's temporary files.
        for stale in [*self.dir.glob(".tmp-*"), *self.dir.glob(".*.tmp-*")]:
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        for stale in self.root.glob(".epoch.tmp-*"):
            stale.unlink(missing_ok=True)

    def next_epoch(self, revision: int = 0) -> int:
        """Count this start and return its number (1 for the first start). ``revision`` is
        for a store shared by coordinators elected through etcd, which a local folder never
        is (``serve --ha`` needs object storage)."""
        path = self.root / "epoch"
        epoch = 0
        if path.exists():
            text = path.read_text().strip()
            if not text.isdigit():
                raise StoreError(f"{path} is damaged (expected a number, found {text[:40]!r})")
            epoch = int(text)
        epoch += 1
        write_atomic(path, f"{epoch}\n".encode())
        return epoch

    def save(self, ckpt: Checkpoint) -> Path:
        """Write ``ckpt`` atomically (slow for a large model: the coordinator calls it from
        its checkpoint thread). Tensors are written from their own memory, never copied."""
        with _writer_lock(self.dir):
            return self._save(ckpt)

    def _save(self, ckpt: Checkpoint) -> Path:
        name = f"round-{ckpt.round:08d}"
        final = self.dir / name
        tmp = self.dir / f".tmp-{name}-{os.getpid()}-{next(_counter)}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            return self._write(ckpt, tmp, final, name)
        except BaseException:
            # A write cut short (a full disk) leaves no half checkpoint taking space; the
            # previous one, and LATEST, are as they were.
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write(self, ckpt: Checkpoint, tmp: Path, final: Path, name: str) -> Path:
        theta = ckpt.theta if ckpt.theta_file is not None else _contiguous(ckpt.theta)
        strategy_state = _contiguous(ckpt.strategy_state)
        downlink = _contiguous(ckpt.downlink)
        theta_hash = ckpt.theta_hash or state_digest(theta)
        meta = {
            **ckpt.meta,
            "format": FORMAT,
            "round": ckpt.round,
            **state_digests.recorded(theta_hash, strategy_state, downlink),
            "written_at": time.time(),
        }
        if ckpt.theta_file is not None:
            place_file(ckpt.theta_file, tmp / "theta.safetensors")
        else:
            write_tensors(tmp / "theta.safetensors", theta)
        strategy_file = tmp / STRATEGY
        take_spare(self.dir / SPARE / STRATEGY, strategy_file)
        write_tensors(strategy_file, strategy_state, reuse=True)
        write_tensors(tmp / "downlink.safetensors", downlink)
        write_atomic(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.dir)
        write_atomic(self.dir / "LATEST", f"{name}\n".encode())
        self._prune(keep_name=name)
        return final

    def _prune(self, keep_name: str) -> None:
        done = sorted(p for p in self.dir.glob("round-*") if p.is_dir())
        doomed = [old for old in done[:-KEEP] if old.name != keep_name]
        parking = self.dir / f".tmp-pruned-{os.getpid()}-{next(_counter)}"
        prune_keeping_spares(doomed, self.dir / SPARE, parking)

    def load_latest(self, theta_only: bool = False) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None for a new state folder; with
        ``theta_only`` its strategy and downlink state are left unread (and empty)."""
        candidates = sorted((p for p in self.dir.glob("round-*") if p.is_dir()), reverse=True)
        latest = self.dir / "LATEST"
        if latest.exists():
            named = self.dir / latest.read_text().strip()
            if named in candidates:
                candidates.remove(named)
                candidates.insert(0, named)
        problems = []
        for path in candidates:
            try:
                return self._load(path, theta_only)
            except (StoreError, OSError, ValueError) as exc:
                problems.append(f"{path.name}: {exc}")
                log.error("checkpoint %s is unusable (%s); trying the one before", path, exc)
        if problems:
            raise StoreError(
                "no usable checkpoint in " + str(self.dir) + ": " + "; ".join(problems)
            )
        return None

    def kept_rounds(self) -> list[int]:
        """The rounds whose checkpoints are kept, oldest first."""
        names = (p.name for p in self.dir.glob("round-*") if p.is_dir())
        return sorted(int(n[len("round-") :]) for n in names if n[len("round-") :].isdigit())

    def load_round(self, round_number: int, theta_only: bool = False) -> Checkpoint:
        """The checkpoint of ``round_number``, verified; ``StoreError`` if it is not kept or
        does not verify."""
        path = self.dir / f"round-{round_number:08d}"
        if not path.is_dir():
            kept = ", ".join(map(str, self.kept_rounds())) or "none"
            raise StoreError(f"no checkpoint of round {round_number} in {self.dir} (kept: {kept})")
        try:
            return self._load(path, theta_only)
        except OSError as exc:
            raise StoreError(f"{path.name}: {exc}") from exc

    @staticmethod
    def _check(path: Path, meta: dict, theta, strategy_state, downlink, theta_only: bool) -> None:
        """Each tensor file against its digest in ``meta.json`` (theta's read from its file a
        block at a time; a legacy checkpoint's by its SHA-256 state hash)."""
        if state_digests.legacy(meta):
            problem = state_digests.mismatch("theta", theta, meta)
        elif state_digests.file_theta_digest(path / "theta.safetensors", meta).hex() != meta.get(
            "theta_digest"
        ):
            problem = "theta.safetensors does not match its digest in meta.json"
        else:
            problem = None
        if not theta_only:
            problem = (
                problem
                or state_digests.mismatch("strategy", strategy_state, meta)
                or state_digests.mismatch("downlink", downlink, meta)
            )
        if problem:
            raise StoreError(problem)

    def _load(self, path: Path, theta_only: bool = False) -> Checkpoint:
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise StoreError(f"meta.json unreadable: {exc}") from exc
        if not isinstance(meta, dict):
            raise StoreError("meta.json is not a JSON object")
        if meta.get("format") != FORMAT:
            raise StoreError(f"unsupported checkpoint format {meta.get('format')!r}")
        try:
            theta = map_tensors(path / "theta.safetensors").tensors
            strategy_state, downlink = {}, {}
            downlink_file = path / "downlink.safetensors"
            if not theta_only:
                strategy_state = load_file(str(path / "strategy.safetensors"))
                downlink = load_file(str(downlink_file)) if downlink_file.exists() else {}
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise StoreError(f"tensor file unreadable: {exc}") from exc
        self._check(path, meta, theta, strategy_state, downlink, theta_only)
        round_number = meta.get("round")
        if not isinstance(round_number, int) or path.name != f"round-{round_number:08d}":
            raise StoreError(f"meta.json names round {round_number!r}, the folder is {path.name}")
        theta_hash = state_digests.theta_digest(meta, theta)
        theta_file = path / "theta.safetensors"
        return Checkpoint(
            round_number, theta, strategy_state, meta, downlink, theta_hash, theta_file
        )
