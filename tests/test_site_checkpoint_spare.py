"""Pruned site checkpoints' data files, written over in place by the next checkpoint
(``site_client.checkpoint.spare``): the result is the checkpoint a new file would hold."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_site_checkpoint import _snapshot, _trained_plain

from site_client.checkpoint.local import (
    MANIFEST,
    complete_checkpoints,
    load_site_checkpoint,
    prune_site_checkpoints,
    save_site_checkpoint,
    site_checkpoint_path,
    stage_state,
    write_staged,
)
from site_client.checkpoint.spare import SPARE

DATA = "__0_0.distcp"


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_pruning_keeps_the_newest_pruned_data_file_and_the_next_write_goes_over_it(tmp_path):
    model, opt = _trained_plain(seed=1)
    paths = [save_site_checkpoint(site_checkpoint_path(tmp_path, i), model, opt) for i in (1, 2, 3)]
    prune_site_checkpoints(tmp_path, keep_last=1)
    assert complete_checkpoints(tmp_path) == [paths[2]]
    assert sorted(p.name for p in (tmp_path / SPARE).iterdir()) == [DATA]  # no manifest
    spare_inode = (tmp_path / SPARE / DATA).stat().st_ino

    other, other_opt = _trained_plain(seed=2)
    fourth = save_site_checkpoint(site_checkpoint_path(tmp_path, 4), other, other_opt, {"n": 4})
    assert (fourth / DATA).stat().st_ino == spare_inode  # the same file, written over
    assert not (tmp_path / SPARE / DATA).exists()
    assert complete_checkpoints(tmp_path) == [paths[2], fourth]  # the spare is no checkpoint

    fresh, fresh_opt = _trained_plain(seed=3)
    assert load_site_checkpoint(fourth, fresh, fresh_opt) == {"n": 4}
    assert _equal(_snapshot(fresh, fresh_opt), _snapshot(other, other_opt))


def test_a_shorter_checkpoint_over_a_longer_spare_is_cut_to_its_own_length(tmp_path):
    model, opt = _trained_plain(seed=1)
    full = save_site_checkpoint(site_checkpoint_path(tmp_path, 1), model, opt)
    save_site_checkpoint(site_checkpoint_path(tmp_path, 2), model, opt)
    full_size = (full / DATA).stat().st_size
    prune_site_checkpoints(tmp_path, keep_last=1)  # the full one's file is the spare now

    lean_state = stage_state(model, opt, copy=False, with_model=False)
    lean = write_staged(site_checkpoint_path(tmp_path, 3), lean_state, {"n": 3})
    size = (lean / DATA).stat().st_size
    assert size < full_size
    assert json.loads((lean / MANIFEST).read_text())["files"][DATA]["size"] == size

    # Written into a folder of its own, the same state gives the same bytes: nothing of the
    # longer file is left at the end, and nothing before it differs.
    alone = write_staged(tmp_path / "elsewhere" / "c", lean_state, {"n": 3})
    assert (lean / DATA).read_bytes() == (alone / DATA).read_bytes()
    other, other_opt = _trained_plain(seed=2)
    assert load_site_checkpoint(lean, other, other_opt) == {"n": 3}
    moments = lambda o: [t for slots in o.state.values() for t in slots.values()]  # noqa: E731
    assert _equal(moments(other_opt), moments(opt))


@pytest.mark.parametrize("damage", ["spare gone", "spare of another rank"])
def test_without_a_spare_of_its_own_a_rank_writes_a_new_file(tmp_path, damage):
    model, opt = _trained_plain(seed=1)
    for i in (1, 2):
        save_site_checkpoint(site_checkpoint_path(tmp_path, i), model, opt)
    prune_site_checkpoints(tmp_path, keep_last=1)
    if damage == "spare gone":
        (tmp_path / SPARE / DATA).unlink()
    else:
        os.replace(tmp_path / SPARE / DATA, tmp_path / SPARE / "__1_0.distcp")
    path = save_site_checkpoint(site_checkpoint_path(tmp_path, 3), model, opt, {"n": 3})
    other, other_opt = _trained_plain(seed=2)
    assert load_site_checkpoint(path, other, other_opt) == {"n": 3}
    assert _equal(_snapshot(other, other_opt), _snapshot(model, opt))


def test_a_link_where_the_spare_would_be_is_removed_and_never_written_through(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me" * 100)
    ckpts = tmp_path / "ckpts"
    model, opt = _trained_plain(seed=1)
    for i in (1, 2):
        save_site_checkpoint(site_checkpoint_path(ckpts, i), model, opt)
    prune_site_checkpoints(ckpts, keep_last=1)
    (ckpts / SPARE / DATA).unlink()
    os.symlink(outside, ckpts / SPARE / DATA)
    path = save_site_checkpoint(site_checkpoint_path(ckpts, 3), model, opt, {"n": 3})
    assert outside.read_bytes() == b"keep me" * 100
    assert not (path / DATA).is_symlink() and not (ckpts / SPARE / DATA).exists()
    other, other_opt = _trained_plain(seed=2)
    assert load_site_checkpoint(path, other, other_opt) == {"n": 3}


@pytest.mark.parametrize("in_the_way", ["a file named .spare", "a pruning cut short"])
def test_pruning_goes_on_whatever_is_in_the_spares_way(tmp_path, in_the_way):
    ckpts = tmp_path / "ckpts"
    model, opt = _trained_plain(seed=1)
    first = save_site_checkpoint(site_checkpoint_path(ckpts, 1), model, opt)
    if in_the_way == "a file named .spare":
        (ckpts / SPARE).write_bytes(b"x")
    else:
        (ckpts / f".{first.name}.spare").mkdir()
        (ckpts / f".{first.name}.spare" / DATA).write_bytes(b"stale")
    second = save_site_checkpoint(site_checkpoint_path(ckpts, 2), model, opt)
    assert prune_site_checkpoints(ckpts, keep_last=1) == [first]
    assert complete_checkpoints(ckpts) == [second]
    assert (ckpts / SPARE / DATA).is_file() and not list(ckpts.glob(".*.spare"))
