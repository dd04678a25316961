"""The data ledger (coordinator/data/ledger.py): every data unit is committed exactly once."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.data.ledger import DataLedger, LedgerError, unit_id, unit_index


def _round_trip(led: DataLedger) -> DataLedger:
    return DataLedger.from_dict(json.loads(json.dumps(led.to_dict())))


# ---- assignment ---------------------------------------------------------------------------


def test_fresh_units_go_to_sites_in_sorted_order():
    led = DataLedger()
    assert led.assign_round(0, ["c", "a", "b"]) == {"a": "u0", "b": "u1", "c": "u2"}
    assert led.holders(0, "u1") == ["b"]
    assert led.units_of(0, "c") == ["u2"]
    assert led.units_of(0, "zz") == []
    assert led.open_round_number() == 0


def test_assign_is_idempotent_for_the_open_round():
    led = DataLedger()
    first = led.assign_round(3, ["b", "a"])
    assert led.assign_round(3, ["a", "b"]) == first
    assert led.assign_round(3, ["b", "a"]) == first
    with pytest.raises(LedgerError, match=r"round 3 was assigned to sites \['a', 'b'\]"):
        led.assign_round(3, ["a", "b", "c"])
    assert led.invariant_violations() == []


def test_assign_refuses_a_second_open_round_an_old_round_and_duplicates():
    led = DataLedger()
    led.assign_round(1, ["a"])
    with pytest.raises(LedgerError, match="round 1 is still open"):
        led.assign_round(2, ["a"])
    led.commit(1, "u0", "a")
    led.close_round(1)
    with pytest.raises(LedgerError, match="round 1 is closed"):
        led.assign_round(1, ["a"])
    with pytest.raises(LedgerError, match="not after the last round 1"):
        led.assign_round(0, ["a"])
    with pytest.raises(LedgerError, match="duplicate sites"):
        led.assign_round(2, ["a", "a"])
    with pytest.raises(LedgerError, match="int >= 0"):
        led.assign_round(-1, ["a"])


def test_uncommitted_units_come_back_first_in_ascending_order():
    led = DataLedger()
    led.assign_round(0, ["a", "b", "c", "d"])
    led.commit(0, "u1", "b")
    led.commit(0, "u2", "c")
    assert led.uncommitted(0) == ["u0", "u3"]
    assert led.close_round(0) == ["u0", "u3"]
    assert led.pending() == ["u0", "u3"]
    # One site only: u3 waits another round, and fresh units start after u3.
    assert led.assign_round(1, ["z"]) == {"z": "u0"}
    led.commit(1, "u0", "z")
    led.close_round(1)
    assert led.assign_round(2, ["b", "a"]) == {"a": "u3", "b": "u4"}
    assert led.committed_by("u0") == (1, "z")
    assert led.committed_by("u3") is None
    assert led.invariant_violations() == []


def test_no_unit_is_dropped_when_a_site_dies_every_round():
    led = DataLedger()
    for r in range(5):
        given = led.assign_round(r, ["alive", "dies"])
        led.commit(r, given["alive"], "alive")
        led.close_round(r)
    led.assign_round(5, ["a", "b", "c", "d", "e", "f"])
    for unit in led.uncommitted(5):
        led.commit(5, unit, led.holders(5, unit)[0])
    led.close_round(5)
    assert led.pending() == []
    committed = sorted(unit_index(u) for u in map(unit_id, range(11)) if led.committed_by(u))
    assert committed == list(range(11))
    assert led.invariant_violations() == []


# ---- backups and commits ------------------------------------------------------------------


def test_first_commit_wins_and_the_other_holder_loses():
    led = DataLedger()
    led.assign_round(0, ["a", "b"])
    assert led.commit(0, "u1", "b")
    led.add_backup(0, "u0", "b")
    assert led.holders(0, "u0") == ["a", "b"]
    assert led.units_of(0, "b") == ["u0", "u1"]
    assert led.losers(0, "u0") == []  # nobody to cancel before a commit
    assert led.commit(0, "u0", "b") is True
    assert led.losers(0, "u0") == ["a"]
    assert led.commit(0, "u0", "a") is False  # the primary arrives late: a duplicate
    assert led.commit(0, "u0", "b") is False  # a retried push of the winner, too
    assert led.committed_by("u0") == (0, "b")
    assert led.uncommitted(0) == []
    assert led.close_round(0) == []
    assert led.invariant_violations() == []


def test_add_backup_refusals():
    led = DataLedger()
    led.assign_round(0, ["a", "b"])
    led.commit(0, "u1", "b")
    with pytest.raises(LedgerError, match=r"unit 'u1' is already committed in round 0 by site 'b'"):
        led.add_backup(0, "u1", "a")
    with pytest.raises(LedgerError, match="unit 'u7' is not assigned in round 0"):
        led.add_backup(0, "u7", "b")
    with pytest.raises(LedgerError, match="site 'a' already holds unit 'u0'"):
        led.add_backup(0, "u0", "a")
    with pytest.raises(LedgerError, match="malformed data unit id 'x0'"):
        led.add_backup(0, "x0", "b")
    with pytest.raises(LedgerError, match="round 1 is not assigned"):
        led.add_backup(1, "u0", "b")
    led.close_round(0)
    with pytest.raises(LedgerError, match="round 0 is closed"):
        led.add_backup(0, "u0", "b")


def test_commit_refusals():
    led = DataLedger()
    led.assign_round(0, ["a", "b"])
    with pytest.raises(LedgerError, match=r"site 'b' does not hold unit 'u0' in round 0"):
        led.commit(0, "u0", "b")
    with pytest.raises(LedgerError, match="unit 'u5' is not assigned in round 0"):
        led.commit(0, "u5", "a")
    with pytest.raises(LedgerError, match=r"round 2 is not assigned \(open round: 0\)"):
        led.commit(2, "u0", "a")
    led.close_round(0)
    with pytest.raises(LedgerError, match="round 0 is closed"):
        led.commit(0, "u0", "a")
    with pytest.raises(LedgerError, match="round 0 is closed"):
        led.close_round(0)
    with pytest.raises(LedgerError, match="round 9 was never assigned"):
        led.holders(9, "u0")
    assert led.committed_by("u0") is None
    assert led.invariant_violations() == []


def test_unit_ids():
    assert unit_id(12) == "u12"
    assert unit_index("u0") == 0 and unit_index("u42") == 42
    for bad in ["u", "u-1", "u01", "U1", "u1 ", 3]:
        with pytest.raises(LedgerError, match="malformed data unit id"):
            unit_index(bad)


# ---- persistence --------------------------------------------------------------------------


def _busy_ledger() -> DataLedger:
    led = DataLedger()
    led.assign_round(0, ["a", "b", "c"])
    led.commit(0, "u0", "a")
    led.add_backup(0, "u2", "a")
    led.commit(0, "u2", "a")
    led.close_round(0)
    led.assign_round(1, ["a", "c"])
    led.commit(1, "u1", "a")
    led.add_backup(1, "u3", "a")
    return led


def test_round_trip_keeps_state_and_behaviour():
    led = _busy_ledger()
    back = _round_trip(led)
    assert back.to_dict() == led.to_dict()
    assert back.open_round_number() == 1
    assert back.holders(1, "u3") == ["c", "a"]
    assert back.committed_by("u2") == (0, "a")
    assert back.assign_round(1, ["c", "a"]) == {"a": "u1", "c": "u3"}  # replay after restart
    for one in (led, back):
        one.close_round(1)
        assert one.assign_round(2, ["a", "b"]) == {"a": "u3", "b": "u4"}
    assert back.to_dict() == led.to_dict()
    assert _round_trip(DataLedger()).to_dict() == DataLedger().to_dict()


def _mutations():
    def edit(fn):
        d = _busy_ledger().to_dict()
        fn(d)
        return d

    r0 = lambda d: d["rounds"][0]  # noqa: E731
    r1 = lambda d: d["rounds"][1]  # noqa: E731
    return [
        ("not a mapping", ["rounds"], "expected a mapping"),
        ("format", edit(lambda d: d.update(format=2)), "format 2"),
        ("next_unit", edit(lambda d: d.update(next_unit=-1)), "next_unit -1"),
        ("next_unit type", edit(lambda d: d.update(next_unit="4")), "next_unit '4'"),
        ("pending type", edit(lambda d: d.update(pending="u1")), "pending is not a list"),
        ("pending id", edit(lambda d: d.update(pending=["u1x"])), "malformed data unit id"),
        ("rounds type", edit(lambda d: d.update(rounds={})), "rounds is not a list"),
        ("round entry", edit(lambda d: d["rounds"].append(7)), "is not a mapping"),
        ("round number", edit(lambda d: r0(d).update(round=-2)), "round number -2"),
        ("round twice", edit(lambda d: r1(d).update(round=0)), "round 0 appears twice"),
        ("closed", edit(lambda d: r0(d).update(closed="yes")), "closed 'yes'"),
        ("holders", edit(lambda d: r0(d).update(holders=[])), "holders is not a mapping"),
        ("committed", edit(lambda d: r0(d).update(committed=None)), "committed is not a mapping"),
        ("no holders", edit(lambda d: r1(d)["holders"].update(u3=[])), "distinct site names"),
        ("dup holders", edit(lambda d: r1(d)["holders"].update(u3=["c", "c"])), "distinct"),
        ("primary twice", edit(lambda d: r1(d)["holders"].update(u3=["a"])), "primary twice"),
        ("non-holder", edit(lambda d: r0(d)["committed"].update(u0="c")), "non-holder 'c'"),
        ("two open", edit(lambda d: r0(d).update(closed=False)), "both open"),
        (
            "open not last",
            edit(lambda d: (r0(d).update(closed=False), r1(d).update(closed=True))),
            "not the last",
        ),
        ("gap", edit(lambda d: r1(d)["holders"].pop("u3")), "gap: unit u3"),
        (
            "double commit",
            edit(lambda d: (r1(d)["holders"].update(u0=["b"]), r1(d)["committed"].update(u0="b"))),
            r"unit u0 committed in rounds \[0, 1\]",
        ),
        ("past next", edit(lambda d: d.update(next_unit=3)), "past the next fresh unit u3"),
        ("pending and flight", edit(lambda d: d.update(pending=["u3"])), "more than one"),
        ("pending dup", edit(lambda d: d.update(pending=["u0", "u0"])), "duplicates"),
    ]


@pytest.mark.parametrize("name,bad,match", _mutations(), ids=[m[0] for m in _mutations()])
def test_bad_saved_ledgers_are_refused(name, bad, match):
    with pytest.raises(LedgerError, match=match):
        DataLedger.from_dict(copy.deepcopy(bad))


# ---- property: random runs keep every guarantee -------------------------------------------

SITES = ["s0", "s1", "s2", "s3", "s4"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_runs_commit_every_unit_at_most_once(data):
    led = DataLedger()
    wins: dict[str, int] = {}  # unit -> round of its one successful commit
    rounds = data.draw(st.integers(1, 6), label="rounds")
    for r in range(rounds):
        sites = data.draw(st.lists(st.sampled_from(SITES), min_size=1, unique=True), label="sites")
        given = led.assign_round(r, sites)
        assert sorted(given) == sorted(sites)
        assert not any(u in wins for u in given.values()), "a committed unit was handed out"
        for _ in range(data.draw(st.integers(0, 12), label="ops")):
            unit = data.draw(st.sampled_from(sorted(given.values())), label="unit")
            site = data.draw(st.sampled_from(SITES), label="site")
            kind = data.draw(st.sampled_from(["backup", "commit", "holder-commit"]), label="op")
            if kind == "holder-commit":
                site = data.draw(st.sampled_from(led.holders(r, unit)), label="holder")
            before = led.committed_by(unit)
            try:
                if kind == "backup":
                    led.add_backup(r, unit, site)
                    assert before is None and led.holders(r, unit)[-1] == site
                elif led.commit(r, unit, site):
                    assert before is None and unit not in wins
                    wins[unit] = r
                    assert led.committed_by(unit) == (r, site)
                    assert site not in led.losers(r, unit)
                else:
                    assert before is not None
            except LedgerError:
                assert kind == "backup" or site not in led.holders(r, unit)
            assert led.invariant_violations() == []
        if data.draw(st.booleans(), label="restart"):
            led = _round_trip(led)
            assert led.assign_round(r, sites) == given
        back = led.close_round(r)
        assert back == [u for u in sorted(given.values(), key=unit_index) if u not in wins]
        assert led.invariant_violations() == []
    d = led.to_dict()
    handed = set().union(*(r["holders"] for r in d["rounds"]))
    assert handed == set(wins) | set(led.pending())
    assert set(wins).isdisjoint(led.pending())
