"""Round decisions (coordinator/round/rules.py) and leases (coordinator/members/leases.py) on a fake
clock."""

from __future__ import annotations

import pytest

from coordinator.members.leases import LeaseError, LeaseTable
from coordinator.round.rules import (
    RoundOptions,
    RoundState,
    UpdateRefused,
    admit_latecomers,
    admit_update,
    decide_close,
    next_round,
    open_round,
    record_update,
    waiting_reason,
)

OPTS = RoundOptions(min_sites=2, max_sites=4, join_window_s=5.0, deadline_s=100.0)


def _open(sites: set[str], now: float = 0.0, number: int = 0) -> RoundState:
    state = open_round(now, RoundState(number=number), sites, RoundOptions(1, 99, 0.0, 100.0))
    assert state.opened_at == now and state.participants == sites
    return state


# ---- opening ------------------------------------------------------------------------------


def test_round_waits_for_min_sites_then_the_join_window():
    s = RoundState(number=0)
    s = open_round(0.0, s, {"a"}, OPTS)
    assert s.opened_at is None
    assert "1 of min_sites=2" in waiting_reason(0.0, s, {"a"}, OPTS)
    s = open_round(10.0, s, {"a", "b"}, OPTS)  # quorum at t=10; window until t=15
    assert s.opened_at is None
    assert "opening in 5.0s" in waiting_reason(10.0, s, {"a", "b"}, OPTS)
    s = open_round(14.9, s, {"a", "b", "c"}, OPTS)
    assert s.opened_at is None
    assert "opening in 0.1s" in waiting_reason(14.9, s, {"a", "b", "c"}, OPTS)
    s = open_round(15.0, s, {"a", "b", "c"}, OPTS)
    assert s.opened_at == 15.0
    assert s.participants == {"a", "b", "c"}


def test_join_window_at_clock_zero():
    s = open_round(0.0, RoundState(number=0), {"a", "b"}, OPTS)
    assert s.opened_at is None
    assert "opening in 3.0s" in waiting_reason(2.0, s, {"a", "b"}, OPTS)


def test_losing_quorum_restarts_the_join_window():
    s = open_round(0.0, RoundState(number=0), {"a", "b"}, OPTS)
    s = open_round(3.0, s, {"a"}, OPTS)
    s = open_round(4.0, s, {"a", "b"}, OPTS)
    s = open_round(8.0, s, {"a", "b"}, OPTS)  # 4 s after quorum came back: still waiting
    assert s.opened_at is None
    s = open_round(9.0, s, {"a", "b"}, OPTS)
    assert s.opened_at == 9.0


def test_round_opens_immediately_at_max_sites():
    s = open_round(1.0, RoundState(number=0), {"a", "b", "c", "d"}, OPTS)
    assert s.opened_at == 1.0 and len(s.participants) == 4


def test_participants_capped_at_max_sites():
    live = {f"s{i}" for i in range(6)}
    s = open_round(0.0, RoundState(number=0), live, OPTS)
    assert s.opened_at == 0.0
    assert len(s.participants) == OPTS.max_sites and s.participants <= live


def test_next_round_opens_immediately_when_quorum_holds():
    s = _open({"a", "b"}, now=0.0)
    s = record_update(record_update(s, "a", 1.0), "b", 1.0)
    nxt = next_round(s)
    assert nxt.number == 1 and nxt.opened_at is None and not nxt.received and not nxt.closed
    opened = open_round(50.0, nxt, {"a", "b"}, OPTS)
    assert opened.opened_at == 50.0 and opened.participants == {"a", "b"}


def test_next_round_below_quorum_waits_then_opens_without_window():
    nxt = next_round(_open({"a", "b"}))
    s = open_round(50.0, nxt, {"a"}, OPTS)
    assert s.opened_at is None
    assert "1 of min_sites=2" in waiting_reason(50.0, s, {"a"}, OPTS)
    s = open_round(60.0, s, {"a", "b"}, OPTS)
    assert s.opened_at == 60.0


def test_open_round_leaves_an_open_round_alone():
    s = _open({"a", "b"}, now=3.0)
    assert open_round(9.0, s, {"a", "b", "c"}, OPTS) is s


# ---- admitting updates --------------------------------------------------------------------


def _code(state: RoundState, site: str, round_number: int) -> str:
    with pytest.raises(UpdateRefused) as info:
        admit_update(state, site, round_number)
    return info.value.code


def test_admit_update_codes():
    s = _open({"a", "b"}, number=5)
    admit_update(s, "a", 5)
    assert _code(s, "a", 4) == "late"
    assert _code(s, "a", 6) == "early"
    assert _code(s, "z", 5) == "not_participant"
    s = record_update(s, "a", 1.0)
    assert _code(s, "a", 5) == "duplicate"
    admit_update(s, "b", 5)


def test_admit_update_closed_and_waiting_rounds():
    s = _open({"a", "b"}, number=5)
    closed = RoundState(5, s.opened_at, s.quorum_since, s.participants, {}, closed=True)
    assert _code(closed, "a", 5) == "late"
    waiting = RoundState(number=5)
    assert _code(waiting, "a", 5) == "early"


def test_refusal_messages_say_what_happened():
    s = record_update(_open({"a", "b"}, number=2), "a", 1.0)
    for site, rnd, words in [
        ("a", 1, "round 1 is closed"),
        ("a", 3, "round 3 is not open"),
        ("q", 2, "'q' is not a participant"),
        ("a", 2, "already delivered"),
    ]:
        with pytest.raises(UpdateRefused, match=words):
            admit_update(s, site, rnd)


# ---- closing ------------------------------------------------------------------------------


def test_closes_when_all_live_participants_delivered():
    s = _open({"a", "b", "c"}, now=0.0)
    live = {"a", "b", "c"}
    s = record_update(record_update(s, "a", 1.0), "b", 1.0)
    d = decide_close(10.0, s, live, OPTS)
    assert not d.act and "waiting on 1 site(s): c" in d.reason
    s = record_update(s, "c", 1.0)
    d = decide_close(10.0, s, live, OPTS)
    assert d.act and "all 3" in d.reason


def test_closes_at_deadline_with_quorum():
    s = record_update(record_update(_open({"a", "b", "c"}, now=0.0), "a", 1.0), "c", 1.0)
    live = {"a", "b", "c"}
    assert not decide_close(99.9, s, live, OPTS).act
    d = decide_close(100.0, s, live, OPTS)
    assert d.act and "deadline" in d.reason and "2 updates" in d.reason


def test_waits_below_quorum_even_after_deadline():
    s = record_update(_open({"a", "b", "c"}, now=0.0), "a", 1.0)
    d = decide_close(500.0, s, {"a", "b", "c"}, OPTS)
    assert not d.act
    assert "only 1 of min_sites=2" in d.reason and "'b'" in d.reason and "'c'" in d.reason


def test_latecomers_join_a_stuck_round_only_after_its_deadline():
    # a and b opened the round; b died for good, d and e joined later.
    s = record_update(_open({"a", "b"}, now=0.0), "a", 1.0)
    live = {"a", "d", "e"}
    assert admit_latecomers(99.0, s, live, OPTS) is s  # before the deadline: nothing changes
    later = admit_latecomers(100.0, s, live, OPTS)
    assert later.participants == {"a", "b", "d", "e"}
    with pytest.raises(UpdateRefused):
        admit_update(s, "d", 0)
    admit_update(later, "d", 0)  # no longer refused
    later = record_update(later, "d", 1.0)
    assert decide_close(101.0, later, live, OPTS).act  # quorum of 2 reached past the deadline


def test_latecomers_respect_max_sites_and_quorum():
    opts = RoundOptions(min_sites=2, max_sites=3, join_window_s=0.0, deadline_s=10.0)
    s = record_update(_open({"a", "b"}, now=0.0), "a", 1.0)
    capped = admit_latecomers(10.0, s, {"a", "b", "x", "y"}, opts)
    assert capped.participants == {"a", "b", "x"}
    full = record_update(s, "b", 1.0)  # quorum already there: the round just closes
    assert admit_latecomers(10.0, full, {"a", "b", "x"}, opts) is full


def test_all_delivered_but_below_quorum_waits():
    s = record_update(_open({"a", "b"}, now=0.0), "a", 1.0)
    d = decide_close(5.0, s, {"a"}, OPTS)  # b's lease is gone
    assert not d.act and "1 of min_sites=2" in d.reason


def test_expired_participant_no_longer_blocks_closing():
    s = _open({"a", "b", "c"}, now=0.0)
    s = record_update(record_update(s, "a", 1.0), "b", 1.0)
    assert not decide_close(5.0, s, {"a", "b", "c"}, OPTS).act
    d = decide_close(5.0, s, {"a", "b"}, OPTS)  # c's lease expired
    assert d.act


def test_update_from_site_that_expired_after_delivering_still_counts():
    s = _open({"a", "b"}, now=0.0)
    s = record_update(record_update(s, "a", 1.0), "b", 1.0)
    assert decide_close(1.0, s, {"b"}, OPTS).act


def test_decide_close_on_waiting_or_closed_round():
    assert not decide_close(0.0, RoundState(0), {"a", "b"}, OPTS).act
    s = record_update(record_update(_open({"a", "b"}), "a", 1.0), "b", 1.0)
    closed = RoundState(s.number, s.opened_at, s.quorum_since, s.participants, s.received, True)
    assert not decide_close(1.0, closed, {"a", "b"}, OPTS).act


def test_record_update_does_not_mutate_the_old_state():
    s = _open({"a", "b"})
    s2 = record_update(s, "a", 3.0)
    assert s.received == {} and s2.received == {"a": 3.0}


# ---- leases -------------------------------------------------------------------------------


def test_tokens_strictly_increase_across_grants():
    t = LeaseTable(epoch=1, ttl_s=10.0)
    tokens = [t.grant(site, float(i)).token for i, site in enumerate(["a", "b", "a", "c", "a"])]
    assert all(x < y for x, y in zip(tokens, tokens[1:], strict=False))


def test_tokens_of_a_later_epoch_exceed_every_earlier_token():
    old = LeaseTable(epoch=3, ttl_s=10.0)
    old_tokens = [old.grant(f"s{i % 7}", 0.0).token for i in range(1000)]
    new = LeaseTable(epoch=4, ttl_s=10.0)
    first_new = new.grant("s0", 0.0).token
    assert first_new > max(old_tokens)
    # The old table's token is stale in the new one.
    with pytest.raises(LeaseError, match="stale"):
        new.check("s0", old_tokens[-1], 1.0)


def test_stale_token_refused_after_regrant():
    t = LeaseTable(epoch=1, ttl_s=10.0)
    first = t.grant("a", 0.0)
    second = t.grant("a", 1.0)
    with pytest.raises(LeaseError, match="stale lease token"):
        t.check("a", first.token, 2.0)
    with pytest.raises(LeaseError, match="stale"):
        t.renew("a", first.token, 2.0)
    assert t.check("a", second.token, 2.0) == second


def test_unknown_site_refused():
    t = LeaseTable(epoch=1, ttl_s=10.0)
    with pytest.raises(LeaseError, match="holds no lease"):
        t.check("ghost", 1, 0.0)


def test_expiry_and_renewal():
    t = LeaseTable(epoch=1, ttl_s=10.0)
    a = t.grant("a", 0.0)
    b = t.grant("b", 0.0)
    assert a.remaining(4.0) == 6.0
    assert t.live(9.99) == {"a", "b"}
    renewed = t.renew("a", a.token, 8.0)
    assert renewed.token == a.token and renewed.expires_at == 18.0 and renewed.last_heartbeat == 8.0
    assert t.live(10.0) == {"a"}
    with pytest.raises(LeaseError, match="expired"):
        t.check("b", b.token, 10.0)
    with pytest.raises(LeaseError, match="expired"):
        t.renew("b", b.token, 10.5)
    assert t.expire(17.0) == ["b"]
    assert t.get("b") is None and t.get("a") is not None
    assert t.expire(18.0) == ["a"]
    assert t.all() == {}


def test_release():
    t = LeaseTable(epoch=2, ttl_s=10.0)
    a = t.grant("a", 0.0)
    with pytest.raises(LeaseError):
        t.release("a", a.token + 1, 1.0)
    assert t.get("a") == a
    t.release("a", a.token, 1.0)
    assert t.live(1.0) == set()
    with pytest.raises(LeaseError, match="holds no lease"):
        t.check("a", a.token, 1.0)


def test_bad_ttl():
    with pytest.raises(ValueError, match="ttl"):
        LeaseTable(epoch=1, ttl_s=0)


def test_leases_drive_rounds():
    """Leases and rounds together: a site that stops heartbeating stops blocking the round."""
    leases = LeaseTable(epoch=1, ttl_s=30.0)
    tok = {s: leases.grant(s, 0.0).token for s in ("a", "b", "c")}
    state = open_round(0.0, RoundState(0), leases.live(0.0), OPTS)
    assert state.opened_at is None
    state = open_round(5.0, state, leases.live(5.0), OPTS)
    assert state.participants == {"a", "b", "c"}
    for now in (20.0, 40.0):
        leases.renew("a", tok["a"], now)
        leases.renew("b", tok["b"], now)
    state = record_update(record_update(state, "a", 1.0), "b", 1.0)
    assert not decide_close(29.0, state, leases.live(29.0), OPTS).act
    leases.expire(45.0)
    assert decide_close(45.0, state, leases.live(45.0), OPTS).act
