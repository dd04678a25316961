"""The running sum's memory is kept for the next round, and reused only when nothing else
still sees it; the rounds' results are the same bit for bit either way."""

from __future__ import annotations

import torch
from core_helpers import Clock, delta_like, new_core, push

from coordinator.round import spare_buffer
from coordinator.round.spare_buffer import SpareBuffer, holders

SITES = ("site-a", "site-b")


def test_the_spare_is_zeroed_in_place_for_the_next_sum():
    spare = SpareBuffer()
    b = torch.full((4096,), 7, dtype=torch.uint8)
    spare.keep(b)
    z = spare.zeros(4096)
    assert z.data_ptr() == b.data_ptr() and not z.any() and spare.reused == 1
    assert spare.zeros(4096).data_ptr() != b.data_ptr()  # taken: the pool is empty again


def test_a_view_still_held_keeps_the_spare_from_being_reused():
    spare = SpareBuffer()
    b = torch.full((4096,), 7, dtype=torch.uint8)
    view = b[16:32].view(torch.int32)
    assert holders(b) == 2
    spare.keep(b)
    z = spare.zeros(4096)
    assert z.data_ptr() != b.data_ptr() and spare.reused == 0
    assert torch.equal(view, torch.full((4,), 0x07070707, dtype=torch.int32))


def test_a_spare_of_another_size_or_kind_is_not_reused():
    spare = SpareBuffer()
    spare.keep(torch.ones(1024, dtype=torch.uint8))
    assert spare.zeros(2048).numel() == 2048 and spare.reused == 0
    spare.keep(torch.ones(256, dtype=torch.float32))  # not a byte buffer: never kept
    assert spare.zeros(1024).numel() == 1024 and spare.reused == 0


def _run(tmp_path, rounds: int = 3):
    clock = Clock()
    core = new_core(tmp_path, clock, strategy={"name": "diloco"})
    tokens = {s: core.join(s)[0].token for s in SITES}
    clock.now += 1.0
    core.tick()
    for r in range(rounds):
        for i, (site, token) in enumerate(tokens.items()):
            assert push(core, site, token, r, delta_like(core, 0.25 * (r + 1) + i))
        assert core.tick()
        core.writer.wait()
        clock.now += 1.0
        core.tick()
    return core


def test_rounds_reuse_the_sum_and_end_on_the_same_theta(tmp_path, monkeypatch):
    reused = _run(tmp_path / "reused")
    assert reused.spare.reused >= 1
    monkeypatch.setattr(spare_buffer, "holders", lambda buffer: 2)  # never free: new memory
    fresh = _run(tmp_path / "fresh")
    assert fresh.spare.reused == 0
    assert reused.published.theta_hash == fresh.published.theta_hash
