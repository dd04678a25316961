"""A grace window after quorum (coordinator/round/rules.py): a round that has ``min_sites``
updates waits at most the grace for the rest, fixed or following recent rounds' arrival
spread; then in a real core, the slow site's update arrives late and the others go on."""

from __future__ import annotations

import pytest
from core_helpers import Clock, delta_like, new_core, push

from coordinator.config import ConfigError, parse_config
from coordinator.records import Refused
from coordinator.round.rules import (
    RoundOptions,
    RoundState,
    arrival_spread,
    decide_close,
    grace_window,
    open_round,
    quorum_at,
    record_update,
)

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

SITES = {"a", "b", "c"}
OPTS = RoundOptions(min_sites=2, max_sites=4, join_window_s=0.0, deadline_s=100.0, grace_s=5.0)


def _round_with(arrivals: dict[str, float | None]) -> RoundState:
    state = open_round(0.0, RoundState(0), SITES, RoundOptions(1, 9, 0.0, 100.0))
    for site, at in arrivals.items():
        state = record_update(state, site, 1.0, at)
    return state


def test_quorum_then_the_grace_then_the_close_naming_who_was_not_waited_for():
    state = _round_with({"a": 10.0, "b": 12.0})
    assert quorum_at(state, 2) == 12.0 and quorum_at(state, 3) is None
    waiting = decide_close(14.0, state, SITES, OPTS, grace=5.0)
    assert not waiting.act and "closing in 3.0s" in waiting.reason and "c" in waiting.reason
    closing = decide_close(17.0, state, SITES, OPTS, grace=5.0)
    assert closing.act and "the 5.0s grace is over; not waiting for c" in closing.reason


def test_without_a_grace_the_round_waits_for_every_live_participant():
    state = _round_with({"a": 10.0, "b": 12.0})
    assert not decide_close(99.0, state, SITES, OPTS, grace=None).act
    assert decide_close(100.0, state, SITES, OPTS, grace=None).act  # the deadline, as before


def test_everyone_in_before_the_grace_is_over_closes_at_once():
    state = _round_with({"a": 10.0, "b": 12.0, "c": 13.0})
    decision = decide_close(13.0, state, SITES, OPTS, grace=5.0)
    assert decision.act and decision.reason == "all 3 live participants delivered"
    assert arrival_spread(state) == 3.0


def test_below_quorum_the_grace_does_not_start():
    state = _round_with({"a": 10.0})
    assert not decide_close(90.0, state, SITES, OPTS, grace=0.0).act


def test_an_update_replayed_after_a_restart_counts_from_the_round_opening():
    state = _round_with({"a": None, "b": 30.0})  # a: replayed, no arrival time
    assert quorum_at(state, 2) == 30.0 and quorum_at(state, 1) == 0.0
    assert arrival_spread(state) is None


def test_the_grace_follows_recent_spreads_never_above_its_ceiling():
    fixed = OPTS
    assert grace_window([1.0, 2.0], fixed) == 5.0
    adaptive = RoundOptions(2, 4, 0.0, 100.0, grace_s=5.0, grace_spread_factor=2.0)
    assert grace_window([], adaptive) == 5.0  # nothing seen yet: the ceiling
    assert grace_window([0.5, 1.0, 1.5], adaptive) == 2.0  # 2 x the median
    assert grace_window([9.0, 0.1, 0.2, 0.3, 0.4, 0.5], adaptive) == 0.6  # the last 5 only
    assert grace_window([4.0], adaptive) == 5.0
    assert grace_window([1.0], RoundOptions(2, 4, 0.0, 100.0)) is None


@pytest.mark.parametrize(
    "rounds, key",
    [({"grace_s": -1}, "rounds.grace_s"), ({"grace_spread_factor": -0.5}, "grace_spread_factor")],
)
def test_a_bad_grace_is_refused_by_name(tmp_path, rounds, key):
    with pytest.raises(ConfigError, match=key):
        parse_config(h.job_config(rounds=rounds), tmp_path)
    assert parse_config(h.job_config(), tmp_path).rounds.grace_s is None


def test_a_real_round_closes_after_the_grace_and_the_slow_site_is_late(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock, rounds={"min_sites": 2, "grace_s": 5.0})
    tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b", "site-c")}
    clock.now += 1.0
    core.tick()
    assert core.round.participants == frozenset(tokens)
    for site in ("site-a", "site-b"):
        push(core, site, tokens[site], 0, delta_like(core, 1.0))
    clock.now += 4.0
    for site, token in tokens.items():
        core.heartbeat(site, token, None)
    assert not core.tick() and "closing in 1.0s" in core.waiting_reason()
    clock.now += 1.5
    for site, token in tokens.items():
        core.heartbeat(site, token, None)
    assert core.tick() and core.round.number == 1
    assert "grace is over; not waiting for site-c" in core.state.last_close_reason
    with pytest.raises(Refused) as late:
        push(core, "site-c", tokens["site-c"], 0, delta_like(core, 9.0))
    assert late.value.code == "late"


def test_rounds_every_participant_delivered_to_set_the_adaptive_grace(tmp_path):
    clock = Clock()
    rounds = {"min_sites": 2, "grace_s": 5.0, "grace_spread_factor": 2.0}
    core = new_core(tmp_path, clock, rounds=rounds)
    tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
    clock.now += 1.0
    core.tick()
    assert core.driver.grace() == 5.0  # nothing seen yet: the ceiling
    push(core, "site-a", tokens["site-a"], 0, delta_like(core, 1.0))
    clock.now += 1.5
    push(core, "site-b", tokens["site-b"], 0, delta_like(core, 1.0))
    assert core.tick() and core.round.number == 1
    assert core.driver.spreads == [1.5] and core.driver.grace() == 3.0
