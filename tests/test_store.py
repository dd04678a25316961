"""Durable checkpoints (coordinator/persist/local_store.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.persist import local_store as store_mod
from coordinator.persist.local_store import Checkpoint, CheckpointStore, StoreError, write_atomic


def _theta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(17, 9, generator=g),
        "b": torch.randn(9, generator=g).to(torch.bfloat16),
        "count": torch.tensor(seed, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }


def _ckpt(round_number: int) -> Checkpoint:
    return Checkpoint(
        round_number,
        _theta(round_number),
        {"momentum.w": torch.full((17, 9), float(round_number))},
        {"job": "j", "closed_round": {"number": round_number - 1}},
    )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert torch.equal(a[k], b[k]), k


def test_new_folder_has_no_checkpoint(tmp_path: Path):
    assert CheckpointStore(tmp_path / "state").load_latest() is None


def test_save_load_round_trip(tmp_path: Path):
    s = CheckpointStore(tmp_path)
    original = _ckpt(4)
    s.save(original)
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded is not None and loaded.round == 4
    _same(loaded.theta, original.theta)
    _same(loaded.strategy_state, original.strategy_state)
    assert loaded.meta["job"] == "j" and loaded.meta["closed_round"] == {"number": 3}


def test_save_does_not_pickle(tmp_path: Path):
    path = CheckpointStore(tmp_path).save(_ckpt(1))
    assert sorted(p.name for p in path.iterdir()) == [
        "downlink.safetensors",
        "meta.json",
        "strategy.safetensors",
        "theta.safetensors",
    ]
    for f in path.glob("*.safetensors"):
        assert not f.read_bytes().startswith(b"\x80")  # pickle protocol marker


def test_latest_wins(tmp_path: Path):
    s = CheckpointStore(tmp_path)
    for r in range(3):
        s.save(_ckpt(r))
    loaded = s.load_latest()
    assert loaded.round == 2
    _same(loaded.theta, _theta(2))


def test_next_epoch_counts_starts(tmp_path: Path):
    assert CheckpointStore(tmp_path).next_epoch() == 1
    assert CheckpointStore(tmp_path).next_epoch() == 2
    s = CheckpointStore(tmp_path)
    assert s.next_epoch() == 3 and s.next_epoch() == 4


def test_damaged_epoch_file_is_an_error(tmp_path: Path):
    CheckpointStore(tmp_path).next_epoch()
    (tmp_path / "epoch").write_text("garbage")
    with pytest.raises(StoreError, match="epoch"):
        CheckpointStore(tmp_path).next_epoch()


def _two(tmp_path: Path) -> tuple[CheckpointStore, Path]:
    s = CheckpointStore(tmp_path)
    s.save(_ckpt(1))
    return s, s.save(_ckpt(2))


def test_truncated_theta_falls_back_to_previous(tmp_path: Path, caplog):
    s, newest = _two(tmp_path)
    f = newest / "theta.safetensors"
    f.write_bytes(f.read_bytes()[:-40])
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded.round == 1
    _same(loaded.theta, _theta(1))
    assert "round-00000002" in caplog.text


def test_flipped_byte_in_theta_falls_back(tmp_path: Path):
    s, newest = _two(tmp_path)
    f = newest / "theta.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40  # inside the tensor data, the header still parses
    f.write_bytes(bytes(data))
    assert CheckpointStore(tmp_path).load_latest().round == 1


def test_edited_meta_hash_falls_back(tmp_path: Path):
    s, newest = _two(tmp_path)
    meta_path = newest / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["theta_digest"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    assert CheckpointStore(tmp_path).load_latest().round == 1


def test_damaged_strategy_state_falls_back(tmp_path: Path):
    s, newest = _two(tmp_path)
    f = newest / "strategy.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded.round == 1
    _same(loaded.strategy_state, _ckpt(1).strategy_state)


@pytest.mark.parametrize("meta_text", ["", "{not json", "[1, 2]", '{"format": 99}'])
def test_broken_meta_falls_back(tmp_path: Path, meta_text: str):
    s, newest = _two(tmp_path)
    (newest / "meta.json").write_text(meta_text)
    assert CheckpointStore(tmp_path).load_latest().round == 1


def test_missing_file_falls_back(tmp_path: Path):
    s, newest = _two(tmp_path)
    (newest / "strategy.safetensors").unlink()
    assert CheckpointStore(tmp_path).load_latest().round == 1


def test_all_damaged_is_an_error_naming_them(tmp_path: Path):
    s, newest = _two(tmp_path)
    for d in (tmp_path / "checkpoints").glob("round-*"):
        (d / "theta.safetensors").write_bytes(b"junk")
    with pytest.raises(StoreError, match="no usable checkpoint") as info:
        CheckpointStore(tmp_path).load_latest()
    assert "round-00000001" in str(info.value) and "round-00000002" in str(info.value)


def test_latest_file_is_followed(tmp_path: Path):
    s, _ = _two(tmp_path)
    write_atomic(s.dir / "LATEST", b"round-00000001\n")
    assert CheckpointStore(tmp_path).load_latest().round == 1


def test_leftover_temporary_folders_are_ignored_and_cleaned(tmp_path: Path):
    s, _ = _two(tmp_path)
    # A save cut short by a crash: a complete-looking folder under its temporary name ...
    leftover = s.dir / ".tmp-round-00000003-12345"
    leftover.mkdir()
    (leftover / "meta.json").write_text("{}")
    # ... and write_atomic's temporary files.
    (s.dir / ".LATEST.tmp-999").write_text("round-00000003\n")
    (tmp_path / ".epoch.tmp-999").write_text("77\n")
    s2 = CheckpointStore(tmp_path)
    assert s2.load_latest().round == 2
    assert not leftover.exists()
    assert not (s.dir / ".LATEST.tmp-999").exists()
    assert not (tmp_path / ".epoch.tmp-999").exists()
    assert s2.next_epoch() == 1


def test_a_failed_rename_leaves_the_previous_checkpoint_and_no_debris(tmp_path: Path, monkeypatch):
    s, _ = _two(tmp_path)
    # The rename of the written folder fails (a crash leaves the folder: the test above).
    monkeypatch.setattr(store_mod.os, "replace", _fail_on_dir_rename(store_mod.os.replace))
    with pytest.raises(OSError, match="crash"):
        s.save(_ckpt(3))
    monkeypatch.undo()
    assert not any(p.name.startswith(".tmp-") for p in s.dir.iterdir())
    assert CheckpointStore(tmp_path).load_latest().round == 2


def _fail_on_dir_rename(real):
    def replace(src, dst):
        if Path(src).is_dir():
            raise OSError("simulated crash")
        return real(src, dst)

    return replace


def test_only_the_last_keep_checkpoints_are_kept(tmp_path: Path):
    s = CheckpointStore(tmp_path)
    for r in range(store_mod.KEEP + 4):
        s.save(_ckpt(r))
    names = sorted(p.name for p in s.dir.glob("round-*"))
    assert names == [f"round-{r:08d}" for r in range(4, store_mod.KEEP + 4)]
    assert (s.dir / "LATEST").read_text().strip() == names[-1]


def test_saving_the_same_round_again_replaces_it(tmp_path: Path):
    s = CheckpointStore(tmp_path)
    s.save(_ckpt(1))
    again = _ckpt(1)
    again.theta["w"] = again.theta["w"] + 1
    s.save(again)
    _same(s.load_latest().theta, again.theta)


def test_non_contiguous_tensors_are_saved(tmp_path: Path):
    s = CheckpointStore(tmp_path)
    base = torch.arange(12.0).reshape(3, 4)
    s.save(Checkpoint(0, {"t": base.t()}, {}, {}))
    _same(s.load_latest().theta, {"t": base.t().contiguous()})


def _as_legacy(path: Path, ckpt: Checkpoint) -> None:
    """Rewrite a checkpoint's meta.json as the SHA-256 state hashes of before (2026-12)."""
    from coordinator.persist.state_digests import sha256_state

    meta = json.loads((path / "meta.json").read_text())
    for name in ("theta", "strategy", "downlink"):
        del meta[f"{name}_digest"]
    meta["theta_sha256"] = sha256_state(ckpt.theta).hex()
    meta["strategy_sha256"] = sha256_state(ckpt.strategy_state).hex()
    meta["downlink_sha256"] = sha256_state(ckpt.downlink).hex()
    write_atomic(path / "meta.json", json.dumps(meta).encode())


def test_a_checkpoint_written_with_sha256_state_hashes_still_loads(tmp_path: Path):
    from wire.digest import state_digest

    original = _ckpt(2)
    _as_legacy(CheckpointStore(tmp_path).save(original), original)
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded is not None and loaded.round == 2
    _same(loaded.theta, original.theta)
    assert loaded.theta_hash == state_digest(original.theta)  # served by today's digest


def test_a_damaged_legacy_checkpoint_is_refused(tmp_path: Path):
    s = CheckpointStore(tmp_path)
    s.save(_ckpt(1))
    original = _ckpt(2)
    path = s.save(original)
    _as_legacy(path, original)
    meta = json.loads((path / "meta.json").read_text())
    meta["strategy_sha256"] = "0" * 64
    write_atomic(path / "meta.json", json.dumps(meta).encode())
    assert s.load_latest().round == 1  # falls back: round 2's strategy state does not check
    with pytest.raises(StoreError, match="strategy.safetensors does not match its digest"):
        s.load_round(2)
