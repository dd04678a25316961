"""Site checkpoints without the model (a task's end: the optimiser state alone), and the
resume rule's "the checkpoint before this one"."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from test_site_checkpoint import TINY, _snapshot, _trained_plain

from examples.gpt_diloco.model import lm_loss
from site_client.checkpoint.local import (
    MANIFEST,
    AsyncCheckpointer,
    SiteCheckpointError,
    load_site_checkpoint,
    save_site_checkpoint,
    site_checkpoint_path,
    stage_state,
    write_staged,
)
from site_client.checkpoint.place import CheckpointPlace, load_newest
from site_client.trainer.round import Round, RoundHooks, RoundSpec


def _save_without_model(path: Path, model, opt, extra=None) -> Path:
    return write_staged(path, stage_state(model, opt, copy=False, with_model=False), extra)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name != MANIFEST)


def _optimiser_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for slots in opt.state.values() for t in slots.values()]


def test_a_checkpoint_without_the_model_restores_the_optimiser_and_leaves_the_model(tmp_path):
    model, opt = _trained_plain(seed=1)
    full = save_site_checkpoint(tmp_path / "full", model, opt)
    lean = _save_without_model(tmp_path / "lean", model, opt, {"round": 3})
    assert json.loads((lean / MANIFEST).read_text())["has_model"] is False
    assert json.loads((full / MANIFEST).read_text())["has_model"] is True
    # AdamW keeps two moments per parameter: the model is a third of the full checkpoint
    # (a little less here, with DCP's metadata on top of a tiny model).
    assert _bytes(lean) < 0.75 * _bytes(full)

    other, other_opt = _trained_plain(seed=2)
    params = [p.detach().clone() for p in other.parameters()]
    assert load_site_checkpoint(lean, other, other_opt) == {"round": 3}
    got, want = _optimiser_state(other_opt), _optimiser_state(opt)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    kept = zip(params, other.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in kept)  # the model is the caller's to set


def test_a_model_only_load_of_it_is_refused_and_changes_nothing(tmp_path):
    lean = _save_without_model(tmp_path / "lean", *_trained_plain(seed=1))
    model, _ = _trained_plain(seed=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SiteCheckpointError, match="holds no model") as err:
        load_site_checkpoint(lean, model)
    assert str(lean) in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_without_an_optimiser_there_is_nothing_to_save():
    model, _ = _trained_plain()
    with pytest.raises(ValueError, match="needs an optimiser"):
        stage_state(model, None, copy=False, with_model=False)


@pytest.mark.parametrize(("value", "loads"), [(None, True), ("no", False), (1, False)])
def test_has_model_absent_means_a_full_checkpoint_and_not_a_bool_is_refused(tmp_path, value, loads):
    model, opt = _trained_plain(seed=1)
    path = save_site_checkpoint(tmp_path / "ckpt", model, opt)
    doc = json.loads((path / MANIFEST).read_text())
    if value is None:
        del doc["has_model"]  # as written before models could be left out
    else:
        doc["has_model"] = value
    (path / MANIFEST).write_text(json.dumps(doc))
    other, other_opt = _trained_plain(seed=2)
    before = _snapshot(other, other_opt)
    if loads:
        load_site_checkpoint(path, other, other_opt)
        pairs = zip(model.parameters(), other.parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        return
    with pytest.raises(SiteCheckpointError, match="'has_model' must be true or false"):
        load_site_checkpoint(path, other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(other, other_opt), strict=True))


def test_the_newest_before_a_checkpoint_is_the_one_written_before_it(tmp_path):
    place = CheckpointPlace(tmp_path)
    for seq, seed in ((7, 1), (9, 2), (12, 3)):
        model, opt = _trained_plain(seed=seed)
        save_site_checkpoint(place.target(seq), model, opt, {"seq": seq})
    other, other_opt = _trained_plain(seed=4)
    newest = site_checkpoint_path(tmp_path, 12)
    assert load_newest(place, other, other_opt) == (newest, {"seq": 12})
    assert load_newest(place, other, other_opt, before=newest)[1] == {"seq": 9}
    oldest = site_checkpoint_path(tmp_path, 7)
    assert load_newest(place, other, other_opt, before=oldest) is None
    with pytest.raises(SiteCheckpointError, match="no checkpoint before .*gone"):
        load_newest(place, other, other_opt, before=tmp_path / "gone")


def test_the_next_tasks_first_step_waits_for_a_task_end_written_without_a_copy(tmp_path):
    model, opt = _trained_plain(seed=1)
    want = _optimiser_state(opt)
    release, order = threading.Event(), []

    def slow_write(path, staged, extra, config=None, group=None):
        release.wait(30)
        order.append("written")
        return write_staged(path, staged, extra, config=config, group=group)

    checkpointer = AsyncCheckpointer(write=slow_write)
    end = checkpointer.save(
        tmp_path / "end", model, opt, {"round": 0}, with_model=False, copy=False
    )
    hooks = RoundHooks(
        cancel_requested=lambda rnd, step: False,
        after_step=lambda rnd, step: None,
        checkpoint=lambda rnd, step: None,
        settle=checkpointer.wait,
        checkpoint_every=0,
        report=lambda **metrics: None,
    )
    threading.Timer(0.2, release.set).start()
    x = torch.randint(0, 256, (2, TINY["seq_len"]), generator=torch.Generator().manual_seed(9))
    for step in Round(RoundSpec(1, 1, 2, 3, False), 0, hooks).steps():
        order.append(f"step {step}")
        lm_loss(model(x), x).backward()
        opt.step()  # changes the very tensors the write reads
        opt.zero_grad()
    checkpointer.close()
    assert order == ["written", "step 0", "step 1"]
    other, other_opt = _trained_plain(seed=2)
    load_site_checkpoint(end.result(), other, other_opt)
    got = _optimiser_state(other_opt)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # as before step 0
