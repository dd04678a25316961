"""Site-local checkpoints of FSDP2 trainers, written with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory: DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files holding the
model and inner-optimiser state (sharded, keyed by parameter name), plus our JSON manifest with
the caller's ``extra`` values and a size and BLAKE3 digest for every file (SHA-256 in
checkpoints written before it, still read). A checkpoint may leave the
model out (``with_model=False``: the trainer's checkpoint of a task's end, whose model the next
theta replaces); it then loads only into an optimiser. DCP reshards on load, so a
checkpoint written by N trainer processes loads into any M, and also into a plain process with
no process group: build the model and optimiser unwrapped and call :func:`load_site_checkpoint`
without ``init_process_group``; DCP then reads every shard in that one process.

Atomicity: all ranks write into ``.<name>.partial`` next to the target; once every rank is done,
rank 0 writes the manifest, fsyncs, and renames the directory into place, then fsyncs the parent.
A complete checkpoint is therefore a non-hidden directory with a manifest. Saving over an
existing checkpoint moves the old one to ``.<name>.old`` only after the new one is complete (a
crash between the two renames leaves both in hidden directories); naming every checkpoint
uniquely with :func:`site_checkpoint_path` avoids that window entirely.

All ranks of the site must call save and load together and see the same filesystem. ``extra``
values must be the same on every rank: rank 0's are written.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.utils._pytree import tree_map_only

from site_client.checkpoint.collectives import (
    SiteCheckpointError,
    all_ok,
    describe,
    device,
    rank,
    run_on_rank0,
    single_process_ok,
    world,
)
from site_client.checkpoint.dcp_reader import SafeFileSystemReader
from site_client.checkpoint.spare import OverwritingFileSystem, keep_spare, take_spare

MANIFEST = "isthmus_site_checkpoint.json"
_FORMAT = "isthmus-site-checkpoint/1"
# The manifest's digest of each file: it is checked by the site that wrote it, against damage
# on its own disk, so BLAKE3 (a third of SHA-256's CPU per byte here); a checkpoint in object
# storage carries SHA-256, which stores check on upload (``site_client.checkpoint.s3``).
FILE_DIGEST = "blake3"
_READ_BLOCK = 8 << 20
Extra = dict[str, torch.Tensor | int | float]


@dataclass(frozen=True)
class SiteCheckpointConfig:
    """Attributes
    ----------
    verify
        Check every file's size and SHA-256 against the manifest before loading (the ranks
        share the hashing); DCP itself detects no corruption.
    fsync
        fsync files and directories so a completed checkpoint survives a power loss.
    """

    verify: bool = True
    fsync: bool = True


def site_checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``directory/step-<step>``, zero-padded so names sort in step order."""
    return Path(directory) / f"step-{step:010d}"


def save_site_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: Extra | None = None,
    *,
    config: SiteCheckpointConfig | None = None,
) -> Path:
    """Write model, optimiser and ``extra`` to ``path`` atomically; collective over the site.

    Raises
    ------
    TypeError
        An ``extra`` value is not a tensor, int or float (nothing is written).
    SiteCheckpointError
        Writing failed on some rank; any previous checkpoint at ``path`` is untouched.
    """
    staged = stage_state(model, optimizer, copy=False)
    try:
        return write_staged(path, staged, extra, config=config)
    finally:
        staged.release(optimizer)


@dataclass
class Staged:
    """A rank's model and optimiser state, ready for DCP; ``fresh``: the optimiser had no state
    and DCP's zero-lr step made some, which must not be left behind."""

    state: dict
    fresh: bool

    def release(self, optimizer: torch.optim.Optimizer | None) -> None:
        if self.fresh and optimizer is not None:
            optimizer.state.clear()


def stage_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, copy: bool, with_model: bool = True
) -> Staged:
    """The state to save; with ``copy`` a snapshot (training may go on while it is written);
    without ``with_model``, the optimiser's state alone."""
    state, fresh = _state_dict(model, optimizer)
    if not with_model:
        if optimizer is None:
            raise ValueError("a checkpoint without the model needs an optimiser")
        del state["model"]
    if copy:
        state = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)
    return Staged(state, fresh)


def write_staged(
    path: str | os.PathLike,
    staged: Staged,
    extra: Extra | None = None,
    *,
    config: SiteCheckpointConfig | None = None,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write a staged state to ``path`` atomically; collective over ``group`` (default: the
    site's process group)."""
    cfg = config or SiteCheckpointConfig()
    path = Path(path).absolute()
    encoded = encode_extra(extra)
    tmp = path.parent / f".{path.name}.partial"
    mkdir = lambda: (shutil.rmtree(tmp, ignore_errors=True), tmp.mkdir(parents=True))  # noqa: E731
    run_on_rank0(mkdir, tmp, group)
    take_spare(path.parent, tmp, rank(group))
    try:
        with single_process_ok():
            writer = dcp.FileSystemWriter(tmp, sync_files=cfg.fsync)
            writer.fs = OverwritingFileSystem()  # over the spare file's cached pages
            on_group = {"process_group": group} if group is not None else {}
            dcp.save(staged.state, storage_writer=writer, **on_group)
    except (Exception, CheckpointException) as exc:
        raise SiteCheckpointError(f"cannot write site checkpoint {path}: {describe(exc)}") from exc
    # Every rank lists the directory, so all must see every rank's files (and DCP's metadata).
    all_ok(True, group)
    digests = _hash_files(tmp, sorted(_list_files(tmp)), cfg.fsync, group)
    unreadable = [name for name, d in digests.items() if d["size"] < 0]
    if unreadable:
        raise SiteCheckpointError(f"cannot write site checkpoint {path}: {unreadable[0]} vanished")
    manifest = manifest_doc(staged, encoded, digests, world(group))
    run_on_rank0(lambda: _publish(tmp, path, manifest, cfg.fsync), path, group)
    return path


def manifest_doc(staged: Staged, extra: dict, files: dict, world_size: int) -> dict[str, Any]:
    """The manifest of a checkpoint of ``staged`` (``extra`` encoded, ``files`` hashed)."""
    return {
        "format": _FORMAT,
        "world_size": world_size,
        "has_optimizer": "optim" in staged.state,
        "has_model": "model" in staged.state,
        "optimizer_initialised": not staged.fresh,
        "extra": extra,
        "files": files,
    }


def encode_extra(extra: Extra | None) -> dict[str, Any]:
    return {k: _encode(k, v) for k, v in (extra or {}).items()}


class AsyncCheckpointer:
    """Site checkpoints written in the background while training goes on.

    ``save`` snapshots the rank's state (a copy of its shard of the model and optimiser,
    unless told the state stays still until the write is done) and returns; a thread writes
    it with the usual atomic protocol, on a process group of its own so that its collectives
    never interleave with training's. At most one write is in flight: the next ``save`` waits
    for the previous one. ``on_done`` runs (in the writer thread) once
    the checkpoint is complete on disk.
    """

    def __init__(self, config: SiteCheckpointConfig | None = None, write=None) -> None:
        self.config = config
        # ``write(path, staged, extra, config=, group=)``: the local folder's by default.
        self.write = write or write_staged
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="site-checkpoint")
        self._last: Future | None = None

    def save(
        self, path, model, optimizer, extra=None, on_done=None, with_model=True, copy=True
    ) -> Future:
        """Write in the background; without ``copy`` the write reads the live tensors, and
        the caller must ``wait`` before anything changes them."""
        self.wait()
        staged = stage_state(model, optimizer, copy=copy, with_model=with_model)
        staged.release(optimizer)

        def write() -> Path:
            written = self.write(path, staged, extra, config=self.config, group=self.group)
            if on_done is not None:
                on_done(written)
            return written

        self._last = self._thread.submit(write)
        return self._last

    def wait(self) -> None:
        """Block until the last save is on disk; re-raise its error."""
        if self._last is not None:
            last, self._last = self._last, None
            last.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)


def load_site_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    config: SiteCheckpointConfig | None = None,
) -> Extra:
    """Restore ``model`` (and ``optimizer``) from ``path`` and return the saved ``extra``. A
    checkpoint without the model restores the optimiser alone and leaves the model as it is.

    The checkpoint is read into copies of this rank's state first (so a load needs memory for
    a second copy of the rank's shard, on the state's device) and applied only once reading
    succeeded: a failed load leaves the model and optimiser as they were.

    Raises
    ------
    SiteCheckpointError
        ``path`` is missing, incomplete or corrupt (the message names it), or holds less than
        asked for (no optimiser state, or no model when ``optimizer`` is None).
    """
    cfg = config or SiteCheckpointConfig()
    path = Path(path).absolute()
    manifest, error = _read_manifest(path, want_optimizer=optimizer is not None)
    if not all_ok(not error):
        raise SiteCheckpointError(f"cannot load site checkpoint {path}: {error or 'see rank 0'}")
    if cfg.verify:
        files = manifest["files"]
        got = _hash_files(path, sorted(files), False, None, _manifest_algorithm(files))
        bad = [n for n in sorted(files) if got[n] != files[n]]
        if bad:
            raise SiteCheckpointError(f"site checkpoint {path} is corrupt: {bad[0]} does not match")
    return load_staged(path, model, optimizer, manifest, SafeFileSystemReader(path))


def load_staged(where, model, optimizer, manifest: dict[str, Any], reader) -> Extra:
    """Read a checkpoint through the DCP ``reader`` into copies of this rank's state, then
    apply them (only once reading succeeded) and return the manifest's ``extra``."""
    state, fresh = _state_dict(model, optimizer)
    if not manifest["has_model"]:
        del state["model"]
    staged = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)
    try:
        with single_process_ok():
            dcp.load(staged, storage_reader=reader)
    except (Exception, CheckpointException) as exc:
        if fresh:
            optimizer.state.clear()
        raise SiteCheckpointError(f"cannot load site checkpoint {where}: {describe(exc)}") from exc
    if optimizer is None:
        set_model_state_dict(model, staged["model"])
        return manifest["extra"]
    if manifest["has_model"]:
        set_state_dict(
            model, optimizer, model_state_dict=staged["model"], optim_state_dict=staged["optim"]
        )
    else:
        set_optimizer_state_dict(model, optimizer, staged["optim"])
    if not manifest["optimizer_initialised"]:
        optimizer.state.clear()
    return manifest["extra"]


def complete_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first (numbers in names numerically)."""
    return _complete(Path(directory))


def latest_site_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint in ``directory`` whose name sorts last (numbers numerically)."""
    done = _complete(Path(directory))
    return done[-1] if done else None


def prune_site_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints, the newest of those
    deleted kept as the spare files the next write goes over (``spare``); on one rank only."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    doomed = _complete(Path(directory))[:-keep_last]
    keep_spare(Path(directory), doomed)
    return doomed


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints in ``root``, oldest first; temporaries are hidden, so skipped."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()]
    return sorted(done, key=lambda p: natural_key(p.name))


def _read_manifest(path: Path, want_optimizer: bool) -> tuple[dict[str, Any], str]:
    """The manifest at ``path`` and an empty string, or ``{}`` and what is wrong with it."""
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        return {}, "no such checkpoint (missing, or never completed)"
    except OSError as exc:
        return {}, f"unreadable manifest: {exc}"
    return check_manifest(text, want_optimizer)


def check_manifest(text: str | bytes, want_optimizer: bool) -> tuple[dict[str, Any], str]:
    """A manifest's document and an empty string, or ``{}`` and what is wrong with it."""
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        return {}, f"unreadable manifest: {exc}"
    keys = {"format", "has_optimizer", "optimizer_initialised", "extra", "files"}
    if not isinstance(manifest, dict) or not keys <= manifest.keys():
        return {}, f"unreadable manifest: expected an object with keys {sorted(keys)}"
    if manifest["format"] != _FORMAT:
        return {}, f"unknown format {manifest['format']!r}"
    if want_optimizer and not manifest["has_optimizer"]:
        return {}, "it holds no optimiser state"
    manifest.setdefault("has_model", True)  # written before models could be left out
    if not isinstance(manifest["has_model"], bool):
        return {}, "unreadable manifest: 'has_model' must be true or false"
    if not want_optimizer and not manifest["has_model"]:
        return {}, "it holds no model (the optimiser state of a task's end only)"
    if not isinstance(manifest["files"], dict) or not isinstance(manifest["extra"], dict):
        return {}, "unreadable manifest: 'files' and 'extra' must be objects"
    try:
        manifest["extra"] = {k: _decode(v) for k, v in manifest["extra"].items()}
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        return {}, f"unreadable extra values in manifest: {exc!r}"
    return manifest, ""


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, bool]:
    """DCP-ready state and whether ``optimizer`` had no state before DCP gave it some."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}, False
    fresh = not optimizer.state
    # get_state_dict builds missing optimiser state with a zero-lr step, but skips that silently
    # when any parameter already has a gradient; hide the gradients meanwhile.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if fresh:
        for p in params:
            p.grad = None
    try:
        msd, osd = get_state_dict(model, optimizer)
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return {"model": msd, "optim": osd}, fresh


def _encode(key: str, value: Any) -> Any:
    if not isinstance(key, str):
        raise TypeError(f"extra keys must be str, got {key!r}")
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = str(t.dtype).removeprefix("torch.")
        return {"dtype": dtype, "shape": list(t.shape), "b64": base64.b64encode(raw).decode()}
    if isinstance(value, int | float):
        return value
    raise TypeError(f"extra[{key!r}] must be a tensor, int or float, got {type(value).__name__}")


def _decode(value: Any) -> torch.Tensor | int | float:
    if not isinstance(value, dict):
        return value
    dtype = getattr(torch, value["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {value['dtype']!r}")
    raw = bytearray(base64.b64decode(value["b64"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(value["shape"]).clone()


def _list_files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


def _hash_files(
    root: Path,
    names: list[str],
    fsync: bool,
    group: dist.ProcessGroup | None = None,
    algorithm: str = FILE_DIGEST,
) -> dict[str, dict[str, Any]]:
    """Size and digest (``algorithm``: ``"blake3"`` or ``"sha256"``) of ``names``; each rank
    hashes every world-th file and all share."""
    me, ranks = rank(group), world(group)
    table = torch.zeros(len(names), 33, dtype=torch.int64)  # 32 digest bytes, then the size
    for i in range(me, len(names), ranks):
        try:
            with open(root / names[i], "rb") as f:
                table[i, :32] = torch.tensor(list(_file_digest(f, algorithm)))
                table[i, 32] = os.fstat(f.fileno()).st_size
                if fsync:
                    os.fsync(f.fileno())
        except OSError:
            table[i] = 0
            table[i, 32] = -1
    if dist.is_initialized():
        table = table.to(device(group))
        dist.all_reduce(table, group=group)  # every other rank left this rank's rows at zero
        table = table.cpu()
    return {
        name: {"size": row[32], algorithm: bytes(row[:32]).hex() if row[32] >= 0 else "missing"}
        for name, row in zip(names, table.tolist(), strict=True)
    }


def _file_digest(f, algorithm: str) -> bytes:
    if algorithm == "sha256":  # checkpoints written before BLAKE3
        return hashlib.file_digest(f, "sha256").digest()
    hasher = blake3.blake3()
    while block := f.read(_READ_BLOCK):
        hasher.update(block)
    return hasher.digest()


def _manifest_algorithm(files: dict[str, Any]) -> str:
    """The digest a manifest's files carry: BLAKE3 now, SHA-256 in older checkpoints."""
    specs = [spec for spec in files.values() if isinstance(spec, dict)]
    return "sha256" if specs and all("sha256" in spec for spec in specs) else FILE_DIGEST


def _publish(tmp: Path, path: Path, manifest: dict, fsync: bool) -> None:
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    if fsync:
        _fsync_dir(tmp)
    aside = path.parent / f".{path.name}.old"
    if path.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
    os.rename(tmp, path)
    if fsync:
        _fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def natural_key(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(s)) if s.isdigit() else (1, s) for s in re.split(r"(\d+)", name) if s]
