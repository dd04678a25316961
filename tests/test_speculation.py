"""Backup planning for straggling data units (coordinator/data/speculation.py) on a fake clock."""

from __future__ import annotations

import pytest

from coordinator.data.speculation import Backup, SpeculationOptions, plan_backups

OPTS = SpeculationOptions()  # slow x2, min wait 10 s, behind 0.5, one backup per unit


def _plan(
    now: float = 0.0,
    holders: dict[str, list[str]] | None = None,
    commit_times: dict[str, float] | None = None,
    progress: dict[str, int] | None = None,
    suspected: set[str] | None = None,
    idle: set[str] | None = None,
    opts: SpeculationOptions = OPTS,
) -> list[Backup]:
    return plan_backups(
        now,
        100.0,
        {"u2": ["c"]} if holders is None else holders,
        commit_times or {},
        progress or {},
        suspected or set(),
        {"a", "b"} if idle is None else idle,
        opts,
    )


# ---- when a unit needs a backup -----------------------------------------------------------


def test_a_unit_whose_holders_are_all_suspected_is_backed_up_at_once():
    plan = _plan(now=101.0, suspected={"c"})
    assert plan == [Backup("u2", "a", "c suspected (failure detector)")]


def test_one_live_holder_is_enough_to_wait():
    holders = {"u2": ["c", "d"]}
    assert _plan(now=101.0, holders=holders, suspected={"c"}, opts=_opts(max_b=2)) == []
    plan = _plan(now=101.0, holders=holders, suspected={"c", "d"}, opts=_opts(max_b=2))
    assert [(b.site, b.reason) for b in plan] == [("a", "c, d suspected (failure detector)")]


def test_a_slow_unit_is_backed_up_past_slow_factor_times_the_median_commit():
    times = {"u0": 10.0, "u1": 12.0, "u3": 14.0}  # median 12 s: slow after 24 s
    assert _plan(now=124.0, commit_times=times) == []
    plan = _plan(now=124.5, commit_times=times)
    assert plan == [Backup("u2", "a", "running 2.0x the median commit time (12.0s)")]
    assert "3.1x" in _plan(now=137.5, commit_times=times)[0].reason


def test_min_wait_holds_back_straggler_rules():
    times = {"u0": 1.0}
    assert _plan(now=109.9, commit_times=times) == []
    assert len(_plan(now=110.0, commit_times=times)) == 1
    behind = {"c": 1, "d": 50}
    holders = {"u2": ["c"], "u3": ["d"]}
    assert _plan(now=109.0, holders=holders, progress=behind) == []
    assert [b.unit for b in _plan(now=111.0, holders=holders, progress=behind)] == ["u2"]


def test_instant_commits_do_not_divide_by_zero():
    plan = _plan(now=111.0, commit_times={"u0": 0.0})
    assert plan[0].reason == "running 11.0s; the committed units took no time"


def test_nothing_to_go_on_means_no_backup():
    assert _plan(now=1e6) == []  # no commits, no progress: nothing says it is late


def test_a_unit_behind_the_other_sites_still_training():
    holders = {"u2": ["c"], "u3": ["d"], "u4": ["e"]}
    progress = {"c": 10, "d": 50, "e": 60}  # median of the others 55: behind under 27.5
    plan = _plan(now=120.0, holders=holders, progress=progress)
    assert plan == [
        Backup(
            "u2",
            "a",
            "at inner step 10, under 0.5 x the median step 55 of the other sites still training",
        )
    ]
    assert _plan(now=120.0, holders=holders, progress={**progress, "c": 28}) == []


def test_suspected_peers_do_not_count_towards_the_median_step():
    holders = {"u2": ["c"], "u3": ["d"], "u4": ["e"]}
    progress = {"c": 10, "d": 12, "e": 500}
    # e far ahead makes both c and d look behind ...
    assert [b.unit for b in _plan(now=120.0, holders=holders, progress=progress)] == ["u2", "u3"]
    plan = _plan(now=120.0, holders=holders, progress=progress, suspected={"e"})
    # ... but a suspected site's step is stale: u4 is backed up, c (10) is not behind d (12).
    assert [b.unit for b in plan] == ["u4"]


# ---- who gets it --------------------------------------------------------------------------


def test_no_idle_site_no_backup():
    assert _plan(now=101.0, suspected={"c"}, idle=set()) == []


def test_never_onto_a_site_that_holds_the_unit_or_is_suspected():
    holders = {"u2": ["c", "a"]}
    opts = _opts(max_b=3)
    plan = _plan(
        now=101.0, holders=holders, suspected={"c", "a", "b"}, idle={"a", "b", "d"}, opts=opts
    )
    assert [b.site for b in plan] == ["d"]
    assert _plan(now=101.0, holders=holders, suspected={"c", "a"}, idle={"a"}, opts=opts) == []


def test_max_backups_per_unit():
    holders = {"u2": ["c", "d"]}  # already has one backup
    dead = {"c", "d"}
    assert _plan(now=101.0, holders=holders, suspected=dead) == []
    plan = _plan(now=101.0, holders=holders, suspected=dead, opts=_opts(max_b=2))
    assert [b.site for b in plan] == ["a"]  # one more, not two


def test_every_needy_unit_gets_one_backup_before_any_gets_a_second():
    holders = {"u5": ["c"], "u6": ["d"]}
    plan = _plan(
        now=101.0, holders=holders, suspected={"c", "d"}, idle={"a", "b", "e"}, opts=_opts(max_b=2)
    )
    assert [(b.unit, b.site) for b in plan] == [("u5", "a"), ("u6", "b"), ("u5", "e")]


def test_each_idle_site_takes_one_backup_most_needed_first():
    holders = {"u10": ["c"], "u2": ["d"], "u3": ["e"], "u4": ["f"], "u7": ["g"]}
    progress = {"c": 5, "d": 5, "e": 1, "f": 40, "g": 0}
    times = {"u0": 10.0}
    plan = _plan(
        now=130.0,
        holders=holders,
        commit_times=times,
        progress=progress,
        suspected={"g"},
        idle={"b", "a", "h"},
    )
    # g is suspected: u7 first; then least progress (e at 1), then u2 before u10 (tie at 5).
    assert [(b.unit, b.site) for b in plan] == [("u7", "a"), ("u3", "b"), ("u2", "h")]
    assert plan[0].reason == "g suspected (failure detector)"
    assert plan[1].reason == "running 3.0x the median commit time (10.0s)"


def test_plans_are_deterministic():
    holders = {f"u{k}": [f"s{k}"] for k in range(6)}
    progress = {f"s{k}": k % 3 for k in range(6)}
    idle = {"i1", "i2", "i3"}
    args = dict(now=200.0, commit_times={"u9": 5.0}, progress=progress)
    one = _plan(holders=holders, idle=idle, **args)
    two = _plan(
        holders=dict(reversed(holders.items())), idle=set(sorted(idle, reverse=True)), **args
    )
    assert one == two
    assert [b.unit for b in one] == ["u0", "u3", "u1"]


def test_disabled_plans_nothing():
    assert _plan(now=1e6, suspected={"c"}, opts=SpeculationOptions(enabled=False)) == []


# ---- options ------------------------------------------------------------------------------


def _opts(max_b: int = 1) -> SpeculationOptions:
    return SpeculationOptions(max_backups_per_unit=max_b)


@pytest.mark.parametrize(
    "field,value",
    [
        ("enabled", 1),
        ("slow_factor", 0.5),
        ("slow_factor", float("nan")),
        ("slow_factor", "2"),
        ("min_wait_s", -1.0),
        ("min_wait_s", float("inf")),
        ("behind_fraction", 1.5),
        ("behind_fraction", -0.1),
        ("max_backups_per_unit", 0),
        ("max_backups_per_unit", 1.0),
        ("max_backups_per_unit", True),
    ],
)
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"speculation.{field} must be"):
        SpeculationOptions(**{field: value})


def test_good_options():
    opts = SpeculationOptions(
        slow_factor=1, min_wait_s=0, behind_fraction=0, max_backups_per_unit=3
    )
    assert opts.max_backups_per_unit == 3


def test_a_dead_unit_outranks_a_slow_one_with_no_progress_report():
    holders = {"u1": ["c"], "u9": ["d"]}
    plan = _plan(now=130.0, holders=holders, commit_times={"u0": 10.0}, suspected={"d"}, idle={"a"})
    assert [b.unit for b in plan] == ["u9"]
