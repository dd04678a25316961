"""The digests of a site checkpoint's manifest: BLAKE3 now, SHA-256 in checkpoints written
before it, which still load, and damage is found under either."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import pytest
import torch
from test_site_checkpoint import _snapshot, _trained_plain

from site_client.checkpoint.local import (
    MANIFEST,
    SiteCheckpointError,
    load_site_checkpoint,
    save_site_checkpoint,
)


def _as_older_build_wrote_it(path: Path) -> None:
    """Rewrite the manifest with SHA-256 digests, as checkpoints were written before BLAKE3."""
    doc = json.loads((path / MANIFEST).read_text())
    doc["files"] = {
        name: {
            "size": spec["size"],
            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
        }
        for name, spec in doc["files"].items()
    }
    (path / MANIFEST).write_text(json.dumps(doc))


def _flip_a_byte(path: Path) -> str:
    name = next(p.name for p in sorted(path.iterdir()) if p.name.endswith(".distcp"))
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))
    return name


def test_a_new_checkpoint_records_each_files_blake3(tmp_path: Path) -> None:
    path = save_site_checkpoint(tmp_path / "ckpt", *_trained_plain(seed=1))
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert files and all(set(spec) == {"size", "blake3"} for spec in files.values())
    for name, spec in files.items():
        data = (path / name).read_bytes()
        assert spec == {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}


@pytest.mark.parametrize("older", [False, True], ids=["blake3", "sha256"])
def test_either_digest_loads_and_finds_a_flipped_byte(tmp_path: Path, older: bool) -> None:
    model, opt = _trained_plain(seed=1)
    path = save_site_checkpoint(tmp_path / "ckpt", model, opt, extra={"round": 2})
    if older:
        _as_older_build_wrote_it(path)
    other, other_opt = _trained_plain(seed=2)
    assert load_site_checkpoint(path, other, other_opt) == {"round": 2}
    got, want = _snapshot(other, other_opt), _snapshot(model, opt)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    name = _flip_a_byte(path)
    third, third_opt = _trained_plain(seed=3)
    before = _snapshot(third, third_opt)
    with pytest.raises(SiteCheckpointError, match=f"corrupt: {name} does not match"):
        load_site_checkpoint(path, third, third_opt)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(third, third_opt), before, strict=True))
