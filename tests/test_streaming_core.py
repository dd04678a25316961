"""Streaming outer steps in process (``CoordinatorCore``, fake clock): robust aggregation per
fragment, clipping by the fragment update's norm, and ``fragments = 1`` as plain DiLoCo."""

from __future__ import annotations

import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import core_helpers as ch
except ImportError:
    import core_helpers as ch

from coordinator.events.log import read_events
from coordinator.observe.metrics import SnapshotCollector
from coordinator.observe.status import format_status, status_reply
from coordinator.records import Refused
from strategies.robust import norm_of
from wire.digest import state_digest

BLOCKS = {"factory": "coord_harness:blocks_model", "kwargs": {"blocks": 4, "d": 4}}
SITES = ("site-a", "site-b", "site-c")


def _core(tmp_path, streaming=None, **sections):
    rounds = {"inner_steps": 2, "total": 2, **sections.pop("rounds", {})}
    sections = {"model": BLOCKS, "rounds": rounds, **sections}
    if streaming is not None:
        sections["streaming"] = streaming
    core = ch.new_core(tmp_path, ch.Clock(), **sections)
    tokens = {s: core.join(s)[0].token for s in SITES[: core.cfg.rounds.max_sites]}
    return core, tokens


def _delta(core, names, k: int, r: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * r + k)
    return {n: scale * torch.randn(core.theta[n].shape, generator=g) for n in names}


def _round(core, tokens, deltas) -> None:
    core.tick()
    r = core.round.number
    assert core.round.opened_at is not None
    for site, delta in deltas.items():
        assert ch.push(core, site, tokens[site], r, delta)
    core.tick()
    assert core.round.number == r + 1


def _fedavg_official(theta, step, names):
    """FedAvg's theta - step, then theta_r + the float32 delta the sites receive."""
    out = dict(theta)
    for n in names:
        new = theta[n] - step[n]
        out[n] = theta[n] + (new - theta[n])
    return out


def test_median_works_on_the_round_fragment(tmp_path):
    core, tokens = _core(
        tmp_path, {"fragments": 2}, aggregation={"method": "median"}, rounds={"max_sites": 3}
    )
    try:
        names = core.tensors.names(0)
        theta = {n: t.clone() for n, t in core.theta.items()}
        deltas = {s: _delta(core, names, k, 0) for k, s in enumerate(tokens)}
        _round(core, tokens, deltas)
        median = {
            n: torch.stack([d[n] for d in deltas.values()]).median(dim=0).values for n in names
        }
        want = _fedavg_official(theta, median, names)
        assert state_digest(want) == state_digest(core.theta)
    finally:
        core.close()


def test_clip_norm_clips_each_fragment_update_by_its_own_norm(tmp_path):
    core, tokens = _core(
        tmp_path, {"fragments": 2}, aggregation={"clip_norm": 0.5}, rounds={"max_sites": 2}
    )
    try:
        core.tick()
        names = core.tensors.names(0)
        theta = {n: t.clone() for n, t in core.theta.items()}
        deltas = {
            "site-a": _delta(core, names, 0, 0, 0.01),
            "site-b": _delta(core, names, 1, 0, 5.0),
        }
        norm, _ = norm_of(deltas["site-b"].items())  # over the fragment's tensors
        assert norm > 0.5 > norm_of(deltas["site-a"].items())[0]
        _round(core, tokens, deltas)
        scale = 0.5 / norm
        acc = {n: torch.zeros_like(theta[n]) for n in names}
        for n in names:
            acc[n].add_(deltas["site-a"][n]).add_(deltas["site-b"][n], alpha=scale).div_(2.0)
        want = _fedavg_official(theta, acc, names)
        assert state_digest(want) == state_digest(core.theta)
    finally:
        core.close()


@pytest.mark.parametrize("strategy", ["diloco", "fedadam"])
def test_one_fragment_is_plain_training_bit_for_bit(tmp_path, strategy):
    hashes = []
    for folder, streaming in (("plain", None), ("one", {"fragments": 1})):
        core, tokens = _core(tmp_path / folder, streaming, strategy={"name": strategy})
        try:
            for r in range(2):
                _round(
                    core,
                    tokens,
                    {s: _delta(core, core.trainable, k, r) for k, s in enumerate(tokens)},
                )
            hashes.append(state_digest(core.theta))
            assert core.downlink is None
        finally:
            core.close()
    assert hashes[0] == hashes[1]


def test_status_shows_the_fragment(tmp_path):
    from coordinator.observe.status import format_status, status_reply

    core, tokens = _core(tmp_path, {"fragments": 2}, rounds={"max_sites": 2})
    try:
        names = core.tensors.names(0)
        _round(core, tokens, {s: _delta(core, names, k, 0) for k, s in enumerate(tokens)})
        reply = status_reply(core.snapshot())
        assert (reply.round.fragment, reply.fragments) == (1, 2)
        assert (reply.round.inner_steps, reply.round.total_rounds) == (1, 4)
        assert format_status(reply).startswith("job faults  round 1/4 (fragment 1 of 2)  theta")
    finally:
        core.close()
    plain, _ = _core(tmp_path / "plain")
    try:
        text = format_status(status_reply(plain.snapshot()))
        assert "fragment" not in text and plain.round_info()["fragment"] == 0
    finally:
        plain.close()


def test_status_and_metrics_show_how_long_each_site_waited_at_merges(tmp_path):
    """The agents add up their trainers' merge waits into the heartbeat's progress."""
    from coordinator.observe.metrics import SnapshotCollector
    from coordinator.observe.status import format_status, status_reply

    core, tokens = _core(tmp_path, {"fragments": 2}, rounds={"max_sites": 2})
    try:
        progress = {"round": 0, "inner_step": 1, "phase": "training", "merge_wait_s": 2.5}
        core.heartbeat("site-a", tokens["site-a"], progress)
        reply = status_reply(core.snapshot())
        waits = {s.site: s.progress.merge_wait_s for s in reply.sites}
        assert waits == {"site-a": 2.5, "site-b": 0.0}
        lines = format_status(reply).splitlines()
        header = next(x for x in lines if x.startswith("SITE"))
        assert header.endswith("MERGE WAIT  HEALTH")
        row = {x.split()[0]: x for x in lines if x.startswith("site-")}
        assert row["site-a"].split()[-2:] == ["2.5s", "-"]
        assert row["site-b"].split()[-2:] == ["-", "-"]
        families = {f.name: f for f in SnapshotCollector(core.snapshot).collect()}
        samples = {
            s.labels["site"]: s.value for s in families["isthmus_site_merge_wait_seconds"].samples
        }
        assert samples == {"site-a": 2.5, "site-b": 0.0}
    finally:
        core.close()


# ---- late updates fold into the next round of their fragment ------------------------------


def _late_job(tmp_path, clock, discount: float = 0.5, **rounds):
    core = ch.new_core(
        tmp_path,
        clock,
        model=BLOCKS,
        streaming={"fragments": 2},
        strategy={"name": "fedavg", "late_discount": discount},
        rounds={"inner_steps": 2, "total": 3, "min_sites": 1, "deadline_s": 30.0, **rounds},
    )
    tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
    ch.heartbeat_all(core, clock, tokens, 3.0)
    return core, tokens


def _alone(core, clock, tokens, delta) -> None:
    """site-a's update for the open round; the round closes at its deadline without site-b,
    and the next one opens."""
    r = core.round.number
    assert ch.push(core, "site-a", tokens["site-a"], r, delta)
    ch.heartbeat_all(core, clock, tokens, 31.0)
    assert core.round.number == r + 1
    ch.heartbeat_all(core, clock, tokens, 2.0)


def test_a_late_update_folds_into_the_next_round_of_its_fragment(tmp_path):
    clock = ch.Clock()
    core, tokens = _late_job(tmp_path, clock)
    frag0, frag1 = core.tensors.names(0), core.tensors.names(1)
    late = _delta(core, frag0, 9, 0)  # site-b's round-0 update, after round 0 closed
    _alone(core, clock, tokens, _delta(core, frag0, 1, 0))
    # Round 1 syncs the other fragment: the late update is told to wait for round 2.
    with pytest.raises(Refused) as err:
        ch.push(core, "site-b", tokens["site-b"], 0, late, base=0)
    assert (err.value.code, err.value.fold_round) == ("later", 2)
    assert "folds into round 2" in str(err.value)
    _alone(core, clock, tokens, _delta(core, frag1, 2, 1))
    before = {n: core.theta[n].clone() for n in frag0}
    own = _delta(core, frag0, 3, 2)
    assert ch.push(core, "site-a", tokens["site-a"], 2, own)
    assert ch.push(core, "site-b", tokens["site-b"], 0, late, base=0)  # folded, at 0.5
    with pytest.raises(Refused) as again:  # counted once
        ch.push(core, "site-b", tokens["site-b"], 0, late, base=0, upload_id="again")
    assert again.value.code == "duplicate"
    ch.heartbeat_all(core, clock, tokens, 31.0)
    assert core.round.number == 3
    for n in frag0:  # FedAvg of site-a's (weight 1) and the late site-b's (weight 0.5)
        torch.testing.assert_close(core.theta[n], before[n] - (own[n] + 0.5 * late[n]) / 1.5)
    events = read_events(core.events.path)
    folded = [e for e in events if e["kind"] == "update" and e["late_from"] is not None]
    assert [(e["site"], e["late_from"], e["round"]) for e in folded] == [("site-b", 0, 2)]


def test_a_late_update_past_its_fold_round_or_without_a_discount_is_dropped(tmp_path):
    clock = ch.Clock()
    core, tokens = _late_job(tmp_path / "past", clock)
    frag0, frag1 = core.tensors.names(0), core.tensors.names(1)
    for r, frag in enumerate((frag0, frag1, frag0)):
        _alone(core, clock, tokens, _delta(core, frag, 1, r))
    with pytest.raises(Refused) as err:  # round 2 synced fragment 0 without it
        ch.push(core, "site-b", tokens["site-b"], 0, _delta(core, frag0, 9, 0), base=0)
    assert err.value.code == "late" and err.value.fold_round is None
    clock = ch.Clock()
    core, tokens = _late_job(tmp_path / "none", clock, discount=0.0)
    _alone(core, clock, tokens, _delta(core, frag0, 1, 0))
    with pytest.raises(Refused) as err:
        ch.push(core, "site-b", tokens["site-b"], 0, _delta(core, frag0, 9, 0), base=0)
    assert err.value.code == "late"


def test_a_restart_keeps_what_a_late_update_may_still_fold_from(tmp_path):
    """The closed rounds a late update folds from are in the checkpoint: after a restart
    between round 0's close and round 2, site-b's round-0 update still folds into round 2."""
    clock = ch.Clock()
    core, tokens = _late_job(tmp_path, clock)
    frag0, frag1 = core.tensors.names(0), core.tensors.names(1)
    _alone(core, clock, tokens, _delta(core, frag0, 1, 0))
    _alone(core, clock, tokens, _delta(core, frag1, 2, 1))
    core.close()
    clock = ch.Clock(1000.0)
    again, tokens = _late_job(tmp_path, clock)
    assert again.round.number == 2
    assert ch.push(again, "site-b", tokens["site-b"], 0, _delta(core, frag0, 9, 0), base=0)


def test_with_max_staleness_a_later_update_folds_further_on_at_its_discount_per_version(tmp_path):
    clock = ch.Clock()
    core, tokens = _late_job(tmp_path, clock, max_staleness=2)
    frags = core.tensors.names(0), core.tensors.names(1)
    late = _delta(core, frags[0], 9, 0)
    for r in range(3):  # rounds 0-2 close without site-b; round 2 synced fragment 0 too
        _alone(core, clock, tokens, _delta(core, frags[r % 2], 1, r))
    with pytest.raises(Refused) as err:  # round 3 is open: the next chance is round 4
        ch.push(core, "site-b", tokens["site-b"], 0, late, base=0)
    assert (err.value.code, err.value.fold_round) == ("later", 4)
    _alone(core, clock, tokens, _delta(core, frags[1], 1, 3))
    before = {n: core.theta[n].clone() for n in frags[0]}
    own = _delta(core, frags[0], 3, 4)
    assert ch.push(core, "site-a", tokens["site-a"], 4, own)
    assert ch.push(core, "site-b", tokens["site-b"], 0, late, base=0)  # two versions behind
    ch.heartbeat_all(core, clock, tokens, 31.0)
    for n in frags[0]:  # FedAvg of site-a's (weight 1) and the late site-b's (0.5 ** 2)
        torch.testing.assert_close(core.theta[n], before[n] - (own[n] + 0.25 * late[n]) / 1.25)
    # Status and metrics say how stale the late one was.
    by_site = {x.site: x for x in status_reply(core.snapshot()).sites}
    assert (by_site["site-b"].late_updates, by_site["site-b"].stale_versions) == (1, 2)
    lines = format_status(status_reply(core.snapshot())).splitlines()
    row = next(x for x in lines if x.startswith("site-b"))
    assert "1 (1 late, 2.0 behind)" in row
    families = {f.name: f for f in SnapshotCollector(core.snapshot).collect()}
    stale = {x.labels["site"]: x.value for x in families["isthmus_site_stale_versions"].samples}
    assert stale == {"site-a": 0.0, "site-b": 2.0}
