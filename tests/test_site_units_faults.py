"""``ISTHMUS_FAULTS``: a strict parser, and a stall that fires once where it is planned."""

from __future__ import annotations

import time

import pytest

from site_client.trainer.faults import Fault, fault_at, inject, parse_faults


def test_kill_and_stall_specs_parse_with_their_defaults() -> None:
    faults = parse_faults(
        " site=site-0,round=1,step=3,rank=1,action=kill ;"
        "site=site-2,round=0,step=5,action=stall,seconds=2.5;"
    )
    assert faults == [
        Fault("site-0", 1, 3, rank=1),
        Fault("site-2", 0, 5, rank=0, restart=0, action="stall", seconds=2.5),
    ]
    assert parse_faults("") == [] and parse_faults(" ; ") == []


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("site=a,round=0,step=1,action=stall", "needs seconds"),
        ("site=a,round=0,step=1,action=stall,seconds=0", "needs seconds"),
        ("site=a,round=0,step=1,action=stall,seconds=-1", "needs seconds"),
        ("site=a,round=0,step=1,action=stall,seconds=nan", "needs seconds"),
        ("site=a,round=0,step=1,action=stall,seconds=inf", "needs seconds"),
        ("site=a,round=0,step=1,action=stall,seconds=soon", "cannot read"),
        ("site=a,round=0,step=1,seconds=3", "only for action=stall"),
        ("site=a,round=0,step=1,action=kill,seconds=3", "only for action=stall"),
        ("site=a,round=0,step=1,action=stall,seconds=1,sleep=2", "unknown keys"),
        ("site=a,round=0,step=1,action=pause", "unknown keys"),
        ("site=a,round=0", "cannot read"),
        ("site=a,round=zero,step=1", "cannot read"),
        ("site=a,round=0,step=1,rank", "cannot read"),
    ],
)
def test_malformed_specs_are_refused_with_the_spec_named(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as err:
        parse_faults(f"site=ok,round=0,step=0;{spec}")
    assert spec in str(err.value)


def test_fault_at_matches_the_exact_point_only() -> None:
    faults = parse_faults("site=s,round=2,step=3,rank=1,restart=1,action=stall,seconds=1")
    assert fault_at(faults, "s", 2, 3, 1, 1) == faults[0]
    for other in [("t", 2, 3, 1, 1), ("s", 1, 3, 1, 1), ("s", 2, 4, 1, 1), ("s", 2, 3, 0, 1)]:
        assert fault_at(faults, *other) is None
    assert fault_at(faults, "s", 2, 3, 1, 0) is None  # another launch attempt


def test_a_stall_sleeps_its_seconds_once() -> None:
    stall = Fault("s", 0, 1, action="stall", seconds=0.3)
    fired: set[Fault] = set()
    started = time.monotonic()
    inject(stall, fired)
    assert time.monotonic() - started >= 0.3 and fired == {stall}
    started = time.monotonic()
    inject(stall, fired)  # the same point again (a backup task of the same round): no stall
    inject(None, fired)
    assert time.monotonic() - started < 0.1
