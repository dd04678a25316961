"""The agent's spare theta file (``site_client.agent.theta_spare``): the theta before last is
written over in place by the next fetch, unless some process still maps it."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import torch

from site_client.agent.theta_spare import SPARE_NAME, ThetaSpare
from wire.file_reuse import mapped_anywhere
from wire.safetensors_io import contiguous_manifest, create_mapped, map_tensors, write_tensors


def _theta(seed: int, n: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(n, generator=g), "b.bias": torch.randn(n // 4, generator=g)}


def _manifest(tensors):
    return contiguous_manifest(tensors, sorted(tensors))


def test_a_file_written_over_in_place_keeps_its_inode_and_holds_only_the_new_tensors(tmp_path):
    path = tmp_path / "theta.safetensors"
    write_tensors(path, _theta(1, n=8192))  # a longer file than the next one
    inode = path.stat().st_ino
    new = _theta(2)
    out = create_mapped(path, _manifest(new), reuse=True)
    for name, t in new.items():
        out.tensors[name].copy_(t)
    out.flush()
    del out
    assert path.stat().st_ino == inode
    got = map_tensors(path).tensors
    assert got.keys() == new.keys() and all(torch.equal(got[k], new[k]) for k in new)
    plain = tmp_path / "plain.safetensors"
    write_tensors(plain, new)
    assert path.read_bytes() == plain.read_bytes()  # cut to its own length, nothing left over


def test_without_reuse_a_file_there_is_replaced_by_a_new_one(tmp_path):
    path = tmp_path / "theta.safetensors"
    write_tensors(path, _theta(1))
    before = path.read_bytes()
    out = create_mapped(path, _manifest(_theta(2)))
    del out
    data = path.read_bytes()
    assert len(data) == len(before) and data != before
    assert set(data[len(data) - 4096 :]) == {0}  # emptied: nothing of the old file is left


def test_the_superseded_theta_is_written_over_by_the_fetch_after_next(tmp_path):
    spare = ThetaSpare(tmp_path)
    assert spare.place(tmp_path / "theta-v1.safetensors") is False  # none yet
    old = tmp_path / "theta-v0.safetensors"
    write_tensors(old, _theta(0))
    inode = old.stat().st_ino
    spare.keep(old)
    assert not old.exists() and (tmp_path / SPARE_NAME).stat().st_ino == inode
    dest = tmp_path / "theta-v2.safetensors"
    assert spare.place(dest) is True
    assert dest.stat().st_ino == inode and not (tmp_path / SPARE_NAME).exists()


def test_a_spare_still_mapped_here_is_deleted_not_written_over(tmp_path):
    spare = ThetaSpare(tmp_path)
    old = tmp_path / "theta-v0.safetensors"
    write_tensors(old, _theta(0))
    spare.keep(old)
    reader = map_tensors(tmp_path / SPARE_NAME)  # a trainer still reading theta_0
    kept = reader.tensors["a.weight"].clone()
    dest = tmp_path / "theta-v2.safetensors"
    assert spare.place(dest) is False
    assert not dest.exists() and not (tmp_path / SPARE_NAME).exists()
    assert torch.equal(reader.tensors["a.weight"], kept)  # what it reads is unchanged


def test_a_mapping_in_another_process_is_seen(tmp_path):
    path = tmp_path / "theta.safetensors"
    write_tensors(path, _theta(0))
    st = path.stat()
    assert not mapped_anywhere(st.st_dev, st.st_ino)
    code = (
        "import mmap, sys\n"
        f"f = open({str(path)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "print('mapped', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "mapped"
        assert mapped_anywhere(st.st_dev, st.st_ino)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert not mapped_anywhere(st.st_dev, st.st_ino)


def test_another_file_mapped_is_not_taken_for_it(tmp_path):
    one, other = tmp_path / "one", tmp_path / "other"
    one.write_bytes(b"x" * 8192)
    other.write_bytes(b"y" * 8192)
    with open(other, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        st = one.stat()
        assert not mapped_anywhere(st.st_dev, st.st_ino)
        st = os.stat(other)
        assert mapped_anywhere(st.st_dev, st.st_ino)


def test_a_link_or_folder_where_the_spare_would_be_is_never_written_through(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me" * 100)
    shm = tmp_path / "shm"
    shm.mkdir()
    spare = ThetaSpare(shm)
    os.symlink(outside, shm / SPARE_NAME)
    assert spare.place(shm / "theta-v2.safetensors") is False
    assert not (shm / SPARE_NAME).exists() and outside.read_bytes() == b"keep me" * 100

    (shm / SPARE_NAME).mkdir()
    superseded = shm / "theta-v1.safetensors"
    write_tensors(superseded, _theta(1))
    spare.keep(superseded)  # the name is taken: the superseded file goes
    assert not superseded.exists() and (shm / SPARE_NAME).is_dir()
    assert spare.place(shm / "theta-v3.safetensors") is False
