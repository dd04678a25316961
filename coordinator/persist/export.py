"""The trained model as a file of its own: theta of a kept checkpoint, and nothing else.

A checkpoint folder holds theta next to the outer optimiser's and the downlink's state; what a
user takes away is theta alone, loadable with ``safetensors.torch.load_file`` into the model
the job's ``[model]`` table builds. ``export_model`` writes ``NAME.safetensors`` (theta by
state-dict name; the job, round, theta hash and ``[model]`` table in its metadata) and
``NAME.json`` beside it (the same facts, for people and for ``load_model``).

The coordinator writes the ``[model]`` table into its state folder when it starts
(``model.json``), so that ``coordinator export --state-dir DIR`` needs nothing else, and writes
the final model to ``DIR/final/model.safetensors`` once the last round's checkpoint is on disk.
With ``[storage] url = "s3://..."`` the checkpoints are in the object store: ``coordinator
export --state-dir DIR --storage-url s3://...`` reads them there (``store``), and the
``[model]`` table still from ``DIR/model.json`` (a missing one leaves the card's table empty).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordinator.model_source import ModelConfig
from coordinator.persist.local_store import CheckpointStore, StoreError, write_atomic
from coordinator.shards.final_model import PartMismatch, write_model
from coordinator.shards.lead import records_from_json
from wire.safetensors_io import copy_data, header_bytes, read_header, write_tensors

MODEL_CARD = "model.json"
FORMAT = "isthmus-model-2"
LEGACY_FORMAT = "isthmus-model-1"  # theta_sha256: a SHA-256 state hash


@dataclass(frozen=True)
class ModelCard:
    """What a model file is: its job and round, theta's hash and how to build the module."""

    job: str
    round: int
    theta_digest: str
    model: dict[str, Any]  # the [model] table: factory, kwargs, seed, path
    format: str = FORMAT


@dataclass(frozen=True)
class Exported:
    """Where ``export_model`` wrote the model, and what it is."""

    path: Path
    card_path: Path
    card: ModelCard


def final_model_path(state_dir: Path) -> Path:
    """Where the coordinator writes the job's final model."""
    return Path(state_dir) / "final" / "model.safetensors"


def model_table(cfg: ModelConfig) -> dict[str, Any]:
    """The ``[model]`` table as plain JSON values."""
    return {
        "factory": cfg.factory,
        "kwargs": dict(cfg.kwargs),
        "seed": cfg.seed,
        "path": None if cfg.path is None else str(cfg.path),
    }


def write_model_card(state_dir: Path, job: str, cfg: ModelConfig) -> None:
    """Record the job's ``[model]`` table in its state folder (read back by ``export``)."""
    text = json.dumps({"job": job, "model": model_table(cfg)}, indent=1, sort_keys=True)
    write_atomic(Path(state_dir) / MODEL_CARD, text.encode())


def card_path_of(out: Path) -> Path:
    """``NAME.json`` beside ``NAME.safetensors``."""
    return Path(out).with_suffix(".json")


def check_out(out: Path) -> str | None:
    """Why ``out`` cannot be the model file's name, or None."""
    if Path(out).suffix != ".safetensors":
        return f"--out {out}: the model file's name must end in .safetensors"
    if not Path(out).parent.is_dir():
        return f"--out {out}: no folder {Path(out).parent}"
    return None


def _write_split_model(tmp: Path, ckpt, others, stubs, metadata) -> None:
    """The lead's tensors and every other shard's into ``tmp``; the lead's come from its
    theta file, or (from the object store, in memory) through a file of their own first."""
    own = ckpt.theta_file
    if own is None:
        own = tmp.with_name(f"{tmp.name}.lead")
        write_tensors(own, ckpt.theta)
    try:
        write_model(tmp, own, others, stubs, ckpt.round, metadata)
    finally:
        if own != ckpt.theta_file:
            own.unlink(missing_ok=True)


def export_model(
    state_dir: Path, out: Path, round_number: int | None = None, store=None, shards=None
) -> Exported:
    """Write theta of the checkpoint of ``round_number`` (default: the newest) to ``out``;
    from ``store`` if given (an object store), else from the state folder's checkpoints. With
    ``shards`` (the lead's ``LeadShards``) the other shards' tensors of the theta they serve
    (the same version: the job's last) are fetched and written with the lead's.

    Raises
    ------
    StoreError
        No such state folder or kept round, a checkpoint that does not verify, or an ``out``
        that cannot be written.
    """
    problem = check_out(out)
    if problem:
        raise StoreError(problem)
    if store is None:
        store = CheckpointStore(state_dir, read_only=True)
    if round_number is not None:
        ckpt = store.load_round(round_number, theta_only=True)
    else:
        ckpt = store.load_latest(theta_only=True)
    if ckpt is None:
        raise StoreError(f"{getattr(store, 'url', state_dir)} holds no checkpoints yet")
    saved = _read_json(Path(state_dir) / MODEL_CARD)
    digest, others = ckpt.theta_hash, None
    if shards is not None:  # the other shards' tensors stream into the file (final_model)
        others = records_from_json(ckpt.meta["shard_tensors"])
    elif "shard_tensors" in ckpt.meta:
        raise StoreError(
            f"round {ckpt.round}'s checkpoint holds only the lead's tensors of a model split over "
            "coordinator shards ([shards]); the job's final model, final/model.safetensors in "
            "its state folder, holds them all"
        )
    card = ModelCard(
        job=str(ckpt.meta.get("job", saved.get("job", ""))),
        round=ckpt.round,
        theta_digest=digest.hex(),
        model=saved.get("model", {}),
    )
    out = Path(out)
    metadata = {f"isthmus.{k}": json.dumps(v) for k, v in asdict(card).items()}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if others is None:
            _write_model(tmp, ckpt, metadata)
        else:
            _write_split_model(tmp, ckpt, others, shards.stubs, metadata)
        os.replace(tmp, out)
        write_atomic(card_path_of(out), json.dumps(asdict(card), indent=1).encode())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write {out}: {exc.strerror}") from exc
    except PartMismatch as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"round {ckpt.round}'s model was not written: {exc}") from exc
    return Exported(out, card_path_of(out), card)


def _write_model(path: Path, ckpt, metadata: dict[str, str]) -> None:
    """The checkpoint's theta with the card in its header: the tensors' bytes copied from the
    checkpoint's file where there is one (a model-sized copy outside the process)."""
    if ckpt.theta_file is None:
        write_tensors(path, ckpt.theta, metadata)
        return
    manifest, start, _ = read_header(ckpt.theta_file)
    with open(path, "wb") as f:
        f.write(header_bytes(manifest, metadata))
        f.flush()
        copy_data(ckpt.theta_file, f, start, manifest.total_bytes)
        os.fsync(f.fileno())


def read_card(path: Path) -> ModelCard:
    """The card of a model file written by ``export_model`` (from ``NAME.json``)."""
    data = _read_json(card_path_of(path))
    if data.get("format") == LEGACY_FORMAT and "theta_sha256" in data:
        old = dict(data)
        data = {**old, "format": FORMAT, "theta_digest": old.pop("theta_sha256")}
        data.pop("theta_sha256")
    if data.get("format") != FORMAT:
        raise ValueError(f"{card_path_of(path)}: not an isthmus model card")
    return ModelCard(**data)


def load_model(path: Path):
    """Build the module the card's ``[model]`` table names and load the file's theta into it
    (strictly: every name, shape and dtype must match). The factory's module must be
    importable, as it was for ``coordinator serve``."""
    from safetensors.torch import load_file

    card = read_card(path)
    factory = card.model.get("factory")
    if not factory:
        raise ValueError(
            f"{path}: theta_0 came from a file, not a factory; build the model and "
            "load_state_dict(safetensors.torch.load_file(path)) yourself"
        )
    module_name, _, attr = factory.partition(":")
    model = getattr(importlib.import_module(module_name), attr)(**card.model.get("kwargs", {}))
    model.load_state_dict(load_file(str(path)), strict=True)
    return model


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
