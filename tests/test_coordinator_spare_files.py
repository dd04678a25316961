"""A pruned checkpoint's strategy and theta files, written over by the coordinator's next ones
(``coordinator.persist.spare_files``): the files written are the ones new files would be, and a
spare this process still reads is never written over."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from test_store import _ckpt, _same

from coordinator.persist import local_store as store_mod
from coordinator.persist.local_store import Checkpoint, CheckpointStore
from coordinator.persist.spare_files import SPARE, STRATEGY, THETA, take_spare
from coordinator.persist.theta_file import write_theta_file
from wire.file_reuse import in_use_here
from wire.safetensors_io import map_tensors


def _saved(tmp_path: Path, rounds: int) -> CheckpointStore:
    store = CheckpointStore(tmp_path)
    for r in range(rounds):
        store.save(_ckpt(r))
    return store


def test_pruning_keeps_the_newest_pruned_strategy_and_theta_and_the_next_save_goes_over_them(
    tmp_path,
):
    store = _saved(tmp_path, store_mod.KEEP + 1)  # one pruned
    spare = store.dir / SPARE
    assert sorted(p.name for p in spare.iterdir()) == [STRATEGY, THETA]
    assert not list(store.dir.glob(".tmp-*"))  # nothing left of the pruned folder
    inode = (spare / STRATEGY).stat().st_ino

    path = store.save(_ckpt(store_mod.KEEP + 1))
    assert (path / STRATEGY).stat().st_ino == inode  # written over in place
    loaded = CheckpointStore(tmp_path).load_latest()
    want = _ckpt(store_mod.KEEP + 1)
    _same(loaded.strategy_state, want.strategy_state)
    _same(loaded.theta, want.theta)
    fresh = CheckpointStore(tmp_path / "other")
    fresh.save(want)
    fresh_file = fresh.dir / path.name / STRATEGY
    assert (path / STRATEGY).read_bytes() == fresh_file.read_bytes()  # byte for byte


def test_a_longer_spare_is_cut_to_the_new_files_length(tmp_path):
    store = CheckpointStore(tmp_path)
    big = {"momentum.w": torch.randn(4096)}
    for r in range(store_mod.KEEP + 1):
        store.save(Checkpoint(r, {"w": torch.randn(8)}, big, {"job": "j"}))
    small = Checkpoint(9, {"w": torch.randn(8)}, {"momentum.w": torch.randn(16)}, {"job": "j"})
    path = store.save(small)
    assert (path / STRATEGY).stat().st_size < 1024
    _same(CheckpointStore(tmp_path).load_latest().strategy_state, small.strategy_state)


def test_a_theta_file_another_name_links_is_no_spare(tmp_path):
    store = CheckpointStore(tmp_path)
    held = tmp_path / "held-theta.safetensors"
    for r in range(store_mod.KEEP + 1):
        store.save(_ckpt(r))
        if r == 0:
            os.link(store.dir / f"round-{r:08d}" / THETA, held)  # as the theta folder would
    assert not (store.dir / SPARE / THETA).exists()
    _same(map_tensors(held).tensors, _ckpt(0).theta)  # untouched


def test_a_spare_open_or_mapped_here_is_deleted_not_taken(tmp_path):
    spare, dest = tmp_path / "spare", tmp_path / "dest"
    spare.write_bytes(b"x" * 8192)
    st = spare.stat()
    assert not in_use_here(st.st_dev, st.st_ino)
    with open(spare, "rb") as f:
        assert in_use_here(st.st_dev, st.st_ino)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            f.close()
            assert in_use_here(st.st_dev, st.st_ino)  # the mapping alone
            assert take_spare(spare, dest) is False
            assert not spare.exists() and not dest.exists()
            assert m[:4] == b"xxxx"
    other = tmp_path / "other"
    other.write_bytes(b"y" * 8192)
    assert take_spare(other, dest) is True and dest.read_bytes() == b"y" * 8192


def test_theta_file_written_over_the_spare_holds_the_new_theta(tmp_path):
    spare = tmp_path / "spare.safetensors"
    first = write_theta_file(tmp_path / "theta", 1, _ckpt(1).theta)
    os.link(first.path, spare)
    inode = spare.stat().st_ino
    os.unlink(first.path)
    del first
    theta = _ckpt(2).theta
    second = write_theta_file(tmp_path / "theta", 2, theta, spare)
    assert second.path.stat().st_ino == inode and not spare.exists()
    _same(map_tensors(second.path).tensors, theta)


def test_what_is_not_a_spare_of_its_own_is_never_written_through(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me" * 100)
    store = _saved(tmp_path / "a", store_mod.KEEP + 1)
    spare = store.dir / SPARE
    (spare / STRATEGY).unlink()
    os.symlink(outside, spare / STRATEGY)  # a link where a spare would be
    (spare / THETA).unlink()
    (spare / THETA).mkdir()  # a folder where a spare would be
    path = store.save(_ckpt(store_mod.KEEP + 1))
    assert outside.read_bytes() == b"keep me" * 100
    assert not (path / STRATEGY).is_symlink()
    want = _ckpt(store_mod.KEEP + 1).strategy_state
    _same(CheckpointStore(tmp_path / "a").load_latest().strategy_state, want)
    assert take_spare(spare / THETA, tmp_path / "dest") is False and not (spare / THETA).exists()

    other = CheckpointStore(tmp_path / "b")
    other.dir.mkdir(parents=True, exist_ok=True)
    (other.dir / SPARE).write_bytes(b"not a folder")  # pruning cannot keep anything there
    for r in range(store_mod.KEEP + 2):
        other.save(_ckpt(r))
    assert (other.dir / SPARE).read_bytes() == b"not a folder"
    assert len(list(other.dir.glob("round-*"))) == store_mod.KEEP
    _same(CheckpointStore(tmp_path / "b").load_latest().theta, _ckpt(store_mod.KEEP + 1).theta)
