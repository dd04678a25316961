"""NaN/Inf caught as an update's chunks arrive, or at the end where it cannot be
(coordinator/intake/screening.py)."""

from __future__ import annotations

import torch

from coordinator.intake.screening import ArrivalScreen
from wire.tensors import pack


def chunks(payload: memoryview, size: int):
    for offset in range(0, len(payload), size):
        yield offset, payload[offset : offset + size]


def screened(tensors, size: int, resumed_at: int = 0) -> ArrivalScreen:
    manifest, payload = pack(tensors)
    s = ArrivalScreen(manifest, resumed_at)
    for offset, data in chunks(payload, size):
        if offset + len(data) > resumed_at:
            s.add(offset, data)
    return s


def test_a_nan_is_found_on_the_way_and_named():
    bad = torch.zeros(1000)
    bad[777] = float("nan")
    s = screened({"ok": torch.ones(100), "bad": bad}, 1024)
    assert s.bad == "bad" and s.unchecked() == set()


def test_inf_in_half_precision_is_found_too():
    t = torch.zeros(64, dtype=torch.float16)
    t[3] = float("inf")
    assert screened({"h": t}, 1 << 20).bad == "h"


def test_what_cannot_be_checked_on_the_way_is_left_for_the_end():
    # 1022-byte chunks split float32 elements; bfloat16 has no numpy dtype; a resumed upload
    # never saw its first bytes. None of them is passed as checked.
    s = screened({"a": torch.ones(1000)}, 1022)
    assert s.bad is None and s.unchecked() == {0}
    s = screened({"b": torch.ones(10, dtype=torch.bfloat16)}, 1 << 20)
    assert s.unchecked() == {0}
    s = screened({"a": torch.ones(1000), "c": torch.ones(1000)}, 1024, resumed_at=2048)
    assert s.unchecked() == {0}  # "a" started before the restart; "c" was seen whole
