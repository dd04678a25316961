"""Update files written over in place (``wire.file_reuse.SparePool``,
``site_client.agent.tasks.update_spares``): the agent keeps the files of updates it no longer
needs, and the trainers' next hand-off writes over the oldest one nothing maps, byte for byte
what a new file holds; one still mapped (the agent's copy for a resend) waits its turn, and
nothing is ever written through a link."""

from __future__ import annotations

import mmap
import os
import time

import torch

from site_client.agent.tasks import UPDATE_SPARES, Task, Upload
from site_client.trainer.shards import Piece, write_update
from wire.file_reuse import SparePool, mapped_anywhere
from wire.safetensors_io import map_tensors, write_tensors


def _pieces(tensors: dict[str, torch.Tensor]) -> list[Piece]:
    return [Piece(n, t, (0,) * t.dim(), tuple(t.shape), True) for n, t in tensors.items()]


def _theta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.w": torch.randn(37, 5, generator=g), "b.w": torch.randn(11, generator=g)}


def _hand_off(folder, theta_path, seed: int, name: str):
    theta = map_tensors(theta_path)
    local = {n: t + seed for n, t in theta.tensors.items()}
    return write_update(_pieces(local), theta, folder / name), local


def test_an_update_discarded_by_the_agent_is_written_over_by_the_next_hand_off(tmp_path):
    theta_path = tmp_path / "theta.safetensors"
    write_tensors(theta_path, _theta(1))
    first, _ = _hand_off(tmp_path, theta_path, 1, "delta-r0.safetensors")
    with open(first, "r+b") as f:  # what a spare holds is never read: fill it with junk
        f.seek(200)
        f.write(b"\xff" * (os.path.getsize(first) - 200))
    inode = first.stat().st_ino
    Upload(Task(0, ""), [str(first)], 1.0, 0).discard_files()
    assert not first.exists() and len(list((tmp_path / UPDATE_SPARES).iterdir())) == 1

    second, local = _hand_off(tmp_path, theta_path, 2, "delta-r1.safetensors")
    assert second.stat().st_ino == inode  # the spare's pages, not new ones
    assert not list((tmp_path / UPDATE_SPARES).iterdir())
    (tmp_path / "new").mkdir()
    fresh, _ = _hand_off(tmp_path / "new", theta_path, 2, "x.safetensors")
    assert second.read_bytes() == fresh.read_bytes()  # every byte written, cut to length
    got = map_tensors(second).tensors
    assert torch.equal(got["a.w"], map_tensors(theta_path).tensors["a.w"] - local["a.w"])


def test_a_spare_still_mapped_waits_and_the_oldest_free_one_is_taken(tmp_path):
    pool = SparePool(tmp_path / "pool", size=3)
    files = []
    for i in range(4):
        f = tmp_path / f"u{i}"
        f.write_bytes(bytes([i]) * 4096)
        files.append(f.stat().st_ino)
        pool.keep(f)
        time.sleep(0.01)  # distinct times: the oldest is taken first
    assert len(list((tmp_path / "pool").iterdir())) == 3  # the fourth was removed: pool full
    oldest = min((tmp_path / "pool").iterdir(), key=lambda p: p.stat().st_mtime)
    with open(oldest, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        assert pool.take(tmp_path / "dest", mapped_anywhere)
        assert (tmp_path / "dest").stat().st_ino == files[1]  # the next oldest: u0 is mapped
        assert oldest.exists()  # still there, for a later take
    assert pool.take(tmp_path / "dest2", mapped_anywhere)
    assert (tmp_path / "dest2").stat().st_ino == files[0]  # unmapped now: its turn


def test_nothing_is_written_through_a_link_in_the_pool_or_in_its_place(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "precious"
    target.write_bytes(b"keep me")
    pool_dir = tmp_path / "pool"
    pool_dir.symlink_to(outside)  # the pool's folder is a link: removed, never entered
    pool = SparePool(pool_dir)
    f = tmp_path / "u0"
    f.write_bytes(b"x" * 64)
    pool.keep(f)
    assert pool_dir.is_dir() and not pool_dir.is_symlink()
    assert target.read_bytes() == b"keep me" and len(list(outside.iterdir())) == 1
    for p in list(pool_dir.iterdir()):
        p.unlink()
    (pool_dir / "a.spare").symlink_to(target)  # a link where a spare would be
    assert not pool.take(tmp_path / "dest", mapped_anywhere)
    assert not (pool_dir / "a.spare").exists() and target.read_bytes() == b"keep me"
    link = tmp_path / "linked"
    link.symlink_to(target)
    pool.keep(link)  # only a regular file becomes a spare
    assert not list(pool_dir.iterdir()) and target.read_bytes() == b"keep me"
