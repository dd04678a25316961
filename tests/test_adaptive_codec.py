"""Adaptive compression (wire/codecs/adaptive.py): the choice as a pure function of the
measured link, the payload and the deadline; its config and the refusals of a bad one; error
feedback carried across a change of rung; the site's and the coordinator's sides of it."""

from __future__ import annotations

import logging

import pytest
import torch

from coordinator.round.downlink import Downlink
from site_client.agent.compression import UplinkCodecs
from wire.codecs import CodecState
from wire.codecs.adaptive import (
    LinkRate,
    at_rung,
    choose_rung,
    codec_label,
    deadline_s,
    overlap_of,
    payload_bytes,
)
from wire.codecs.rules import CodecConfigError, CompressionConfig, compression_tables
from wire.downlink import apply_delta
from wire.tensors import pack_encoded, unpack

LADDER = ["none", "bf16", "int8", "int4", {"codec": "topk", "fraction": 0.01}]
SHAPES = [("w", (256, 256)), ("b.norm", (256,))]  # 65,792 floats: 263 KB raw


def adaptive(**extra) -> CompressionConfig:
    return CompressionConfig.from_dict({"mode": "adaptive", "ladder": LADDER, **extra})


# ---- the measured link --------------------------------------------------------------------


def test_a_link_is_measured_from_its_first_transfer_the_newest_weighing_most():
    rate = LinkRate().observe(1_000_000, 1.0)
    assert rate.bytes_per_s == pytest.approx(1e6) and rate.latency_s == 0.0
    slower = rate.observe(1_000_000, 1.8)  # one size: all of the time per byte, weighted 1:2
    assert slower.bytes_per_s == pytest.approx(1e6 / ((0.5 * 1 + 1.8) / 1.5))
    changed = slower.observe(1_000_000, 9.0)  # 5x what it predicted: another link now
    assert changed.samples == ((1_000_000, 9.0),) and changed.bytes_per_s == pytest.approx(1e6 / 9)
    back = changed.observe(1_000_000, 1.0)  # and 9x faster: the fast link again, at once
    assert back.samples == ((1_000_000, 1.0),)
    assert rate.observe(0, 1.0) == rate and rate.observe(10, 0.0) == rate
    assert LinkRate().predict(100) is None and LinkRate.of(0.0) == LinkRate()


def test_payloads_of_two_sizes_tell_latency_from_rate():
    """A fast link with a long round trip: a small payload's time is mostly latency, and the
    fit does not take it for a slow link (which would keep a link compressed for ever)."""
    link = LinkRate().observe(230_000, 0.5).observe(440_000, 0.52)  # int4, then int8
    assert link.latency_s == pytest.approx(0.478, abs=0.01)
    assert link.bytes_per_s == pytest.approx((440_000 - 230_000) / 0.02, rel=0.05)
    assert link.predict(1_750_000) < 0.8  # float32 now fits a 0.8 s deadline
    per_byte_only = LinkRate().observe(230_000, 0.5)
    assert per_byte_only.predict(1_750_000) > 3.0  # what one size alone would say
    many = link
    for _ in range(20):
        many = many.observe(440_000, 0.52)
    assert len(many.samples) == 8 and many.latency_s == 0.0  # one size again: per byte


def test_the_deadline_is_a_share_of_the_overlapped_compute():
    assert deadline_s(None, 1.0, 0.8) is None and deadline_s(0.0, 1.0, 0.8) is None
    assert deadline_s(10.0, 0.25, 0.8) == pytest.approx(1.0)  # half: the other direction
    job = {"rounds": {"inner_steps": 40}, "streaming": {"fragments": 2, "delay_steps": 5}}
    assert overlap_of(job) == pytest.approx(5 / 20)
    assert overlap_of({"rounds": {"inner_steps": 40}}) == 1.0
    assert overlap_of({"streaming": {"fragments": 2, "delay_steps": 0}}) == 1.0


# ---- the choice ---------------------------------------------------------------------------


def test_a_slowdown_seen_in_one_direction_slows_the_other_until_it_measures_itself():
    fast = LinkRate().observe(1_000_000, 0.2).observe(500_000, 0.12)  # 1 MB in 0.2 s
    assert fast.surprise(1_000_000, 0.25) is None  # within the model
    assert fast.surprise(1_000_000, 2.0) == pytest.approx(10.0)  # a 10x slower link
    assert fast.surprise(1_000_000, 0.05) == pytest.approx(0.25)  # faster: a change too
    assert LinkRate().surprise(1_000_000, 5.0) is None  # nothing to be surprised against
    slow = fast.slowed(10.0)
    assert slow.bytes_per_s == pytest.approx(fast.bytes_per_s / 10)
    assert slow.latency_s == fast.latency_s and slow.samples == ()
    # Its own next transfer alone refits it (no mixing with the fast link's history).
    assert slow.observe(150_000, 0.4).samples == ((150_000, 0.4),)
    for factor in (1.0, 0.25, float("nan"), float("inf")):  # only a slowdown crosses over
        assert fast.slowed(factor) == fast
    assert LinkRate().slowed(10.0) == LinkRate()


def test_a_site_pushes_at_a_lower_rung_after_its_fetch_found_the_link_slowed(caplog):
    codecs = UplinkCodecs(adaptive(), overlap=1.0, site="site-x")
    caplog.set_level(logging.INFO, logger="isthmus.site")
    codecs.measured("push", 1_000_000, 0.1)  # 10 MB/s: float32 fits
    codecs.measured("fetch", 1_000_000, 0.1)
    assert codecs.choose(SHAPES, compute_s=1.0)[1].rung == 0
    codecs.measured("fetch", 1_000_000, 5.0)  # the fetch took 50x its time
    assert codecs.down.bytes_per_s == pytest.approx(0.2e6)  # refitted to itself
    assert codecs.rate.bytes_per_s == pytest.approx(0.2e6)  # the uplink taken as slowed alike
    after = codecs.choose(SHAPES, compute_s=1.0)[1]
    assert after.rung > 0 and after.fits, after.reason
    assert any("taken as slowed" in r.message for r in caplog.records)
    codecs.measured("push", 1_000_000, 0.1)  # the uplink measures itself: fast again
    assert codecs.rate.bytes_per_s == pytest.approx(10e6)
    assert codecs.down.bytes_per_s == pytest.approx(0.2e6)  # a speed-up does not cross over
    codecs.measured("push", 1_000_000, 1.0)  # a slowed push slows the fetch model too
    assert codecs.down.bytes_per_s == pytest.approx(0.02e6)


def test_sizes_are_what_each_rung_sends_and_rules_still_apply():
    cfg = adaptive(rules=[{"match": "*.norm", "codec": "none"}])
    sizes = [payload_bytes(at_rung(cfg, i), SHAPES) for i in range(len(LADDER))]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) for n, s in SHAPES}
    for i in range(4):  # codecs of a fixed size: the prediction bounds what is sent
        manifest, _ = pack_encoded(tensors, at_rung(cfg, i), CodecState())
        sent = {e.name: (e.codec, e.nbytes) for e in manifest.entries}
        assert sent["b.norm"] == ("none", 1024)  # the rule wins at every rung
        assert manifest.total_bytes <= sizes[i] <= manifest.total_bytes + 2 * 128 + 64


def test_nothing_measured_takes_the_first_rung_and_says_why():
    choice = choose_rung(adaptive(), SHAPES, LinkRate(), 1.0)
    assert (choice.rung, choice.codec, choice.fits) == (0, "none", True)
    assert "no transfer measured yet" in choice.reason
    choice = choose_rung(adaptive(), SHAPES, LinkRate.of(1e6), None)
    assert choice.rung == 0 and "no compute time measured yet" in choice.reason


@pytest.mark.parametrize(
    "mb_per_s, rung, codec",
    [(100.0, 0, "none"), (0.2, 1, "bf16"), (0.1, 2, "int8"), (0.05, 3, "int4")],
)
def test_the_least_lossy_rung_that_fits_is_taken(mb_per_s, rung, codec):
    cfg = adaptive()
    choice = choose_rung(cfg, SHAPES, LinkRate.of(mb_per_s * 1e6), 1.0)
    assert (choice.rung, choice.codec, choice.fits) == (rung, codec, True)
    assert choice.predicted_s <= 1.0 and "within the 1.00 s deadline" in choice.reason
    if rung > 0:  # the rung before would not have fitted
        assert payload_bytes(at_rung(cfg, rung - 1), SHAPES) / (mb_per_s * 1e6) > 1.0


def test_a_ladder_that_cannot_meet_its_deadline_takes_its_last_rung_and_says_so():
    choice = choose_rung(adaptive(), SHAPES, LinkRate.of(1000.0), 0.5)
    assert (choice.rung, choice.codec, choice.fits) == (4, "topk(0.01)", False)
    assert choice.predicted_s > 0.5
    assert choice.reason.startswith("no rung fits: even the last, topk(0.01)")
    assert choice.as_record()["fits"] is False


def test_the_choice_is_a_pure_function():
    args = (adaptive(), SHAPES, LinkRate.of(0.1e6), 1.0)
    assert choose_rung(*args) == choose_rung(*args)
    assert codec_label(adaptive().ladder[4]) == "topk(0.01)"


# ---- config -------------------------------------------------------------------------------


def test_an_adaptive_table_parses_with_its_ladder_first_as_the_default():
    cfg = adaptive(deadline_fraction=0.5)
    assert cfg.mode == "adaptive" and cfg.deadline_fraction == 0.5
    assert [codec_label(c) for c in cfg.ladder] == ["none", "bf16", "int8", "int4", "topk(0.01)"]
    assert cfg.default == cfg.ladder[0]
    fixed = at_rung(cfg, 2)
    assert fixed.mode == "fixed" and fixed.ladder == () and fixed.default.name == "int8"
    up, down = compression_tables({"mode": "adaptive", "ladder": ["int8"], "downlink": {
        "mode": "adaptive", "ladder": ["bf16", "int4"]}})  # fmt: skip
    assert up.mode == down.mode == "adaptive" and down.ladder[1].name == "int4"


@pytest.mark.parametrize(
    "table, key",
    [
        ({"mode": "auto"}, "compression.mode"),
        ({"mode": "adaptive"}, "compression.ladder"),
        ({"mode": "adaptive", "ladder": []}, "compression.ladder"),
        ({"mode": "adaptive", "ladder": "int8"}, "compression.ladder"),
        ({"mode": "adaptive", "ladder": ["int8", "zip"]}, "compression.ladder[1].codec"),
        (
            {"mode": "adaptive", "ladder": [{"codec": "topk", "fraction": 2}]},
            "compression.ladder[0]",
        ),
        ({"mode": "adaptive", "ladder": ["int8"], "default": "int4"}, "compression.default"),
        ({"mode": "adaptive", "ladder": ["int8"], "deadline_fraction": 0}, "deadline_fraction"),
        ({"mode": "adaptive", "ladder": ["int8"], "deadline_fraction": 1.5}, "deadline_fraction"),
        ({"mode": "adaptive", "ladder": ["int8"], "deadline_fraction": True}, "deadline_fraction"),
        ({"ladder": ["int8"]}, "compression.ladder: only with mode = 'adaptive'"),
        ({"deadline_fraction": 0.5}, "compression.deadline_fraction: only with"),
    ],
)
def test_a_bad_adaptive_table_is_refused_naming_the_key(table, key):
    with pytest.raises(CodecConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        CompressionConfig.from_dict(table)


# ---- error feedback across a change of rung -----------------------------------------------


def _send(state: CodecState, x: torch.Tensor, codec_cfg: CompressionConfig) -> torch.Tensor:
    manifest, payload = pack_encoded({"w": x}, codec_cfg, state)
    return unpack(manifest, payload)["w"]


def test_what_an_error_feedback_rung_withheld_goes_with_the_next_raw_send():
    cfg = adaptive()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 64, generator=g) for _ in range(3)]
    state = CodecState()
    sent = _send(state, xs[0], at_rung(cfg, 3))  # int4, error feedback on
    assert state.owes("w")
    sent = sent + _send(state, xs[1], at_rung(cfg, 0))  # raw: carries the residual
    assert not state.owes("w")
    # Everything sent adds up to everything there was to send, to float32 rounding.
    assert torch.allclose(sent, xs[0] + xs[1], atol=1e-5)
    before = sent + _send(state, xs[2], at_rung(cfg, 0))
    assert torch.allclose(before, xs[0] + xs[1] + xs[2], atol=1e-5)


def test_a_lossy_rung_without_error_feedback_carries_the_residual_too():
    cfg = adaptive()
    g = torch.Generator().manual_seed(2)
    x0, x1 = torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g)
    state = CodecState()
    first = _send(state, x0, at_rung(cfg, 3))  # int4 with error feedback
    residual = state["w"].residual.clone()
    second = _send(state, x1, at_rung(cfg, 1))  # bf16: no error feedback of its own
    assert torch.allclose(second, (x1 + residual).to(torch.bfloat16).float())
    assert not state.owes("w") and torch.allclose(first + residual, x0, atol=1e-6)


def test_a_refused_encoding_leaves_the_residual_as_it_was():
    cfg = adaptive()
    state = CodecState()
    _send(state, torch.randn(16, 16), at_rung(cfg, 3))
    kept = state["w"].residual.clone()
    bad = torch.full((16, 16), float("nan"))
    with pytest.raises(ValueError):
        _send(state, bad, at_rung(cfg, 1))
    assert state.owes("w") and torch.equal(state["w"].residual, kept)


# ---- the site's and the coordinator's sides -----------------------------------------------


def test_the_site_logs_a_change_of_rung_and_a_ladder_that_cannot_keep_up_once(caplog):
    codecs = UplinkCodecs(adaptive(), overlap=1.0, site="site-x")
    caplog.set_level(logging.INFO, logger="isthmus.site")
    cfg, choice = codecs.choose(SHAPES, compute_s=2.0)  # nothing measured yet
    assert choice.rung == 0 and cfg.default.name == "none" and cfg.mode == "fixed"
    codecs.measured("push", 1000, 1.0)  # 1 KB/s
    for _ in range(3):
        cfg, choice = codecs.choose(SHAPES, compute_s=2.0)
    assert choice.rung == 4 and not choice.fits
    assert sum("uplink codec none -> topk(0.01)" in r.message for r in caplog.records) == 1
    assert sum("no rung fits" in r.message for r in caplog.records if r.levelname == "WARNING") == 1
    fixed = UplinkCodecs(CompressionConfig.from_dict({"default": "int8"}), 1.0, "s")
    assert fixed.choose(SHAPES, 2.0) == (fixed.compression, None) and not fixed.adaptive


def test_the_downlink_chooses_from_the_slowest_site_and_the_median_task():
    down = Downlink(adaptive(), overlap=0.5)
    reports = [
        {"fetch_bytes_per_s": 10e6, "task_compute_s": 4.0},
        {"fetch_bytes_per_s": 0.1e6, "task_compute_s": 2.0},  # slowest link
        {"fetch_bytes_per_s": 0.0, "task_compute_s": 6.0},  # not measured: left out
        {},
    ]
    choice = down.choose(SHAPES, reports)
    assert choice.deadline_s == pytest.approx(0.6 * 0.5 * 4.0 / 2)  # the median task: 4 s
    assert choice == choose_rung(adaptive(), SHAPES, [LinkRate.of(0.1e6)], 0.6)
    with_latency = down.choose(SHAPES, [{**reports[0], "fetch_latency_s": 0.7}, reports[1]])
    assert with_latency.predicted_s > choice.predicted_s  # the slow-to-start link decides
    assert Downlink(CompressionConfig()).choose(SHAPES, reports) is None


def test_every_rung_of_the_downlink_keeps_theta_bit_identical_on_the_sites():
    g = torch.Generator().manual_seed(3)
    old = {n: torch.randn(s, generator=g) for n, s in SHAPES}
    down = Downlink(adaptive())
    theta = {k: v.clone() for k, v in old.items()}
    for version, rung in enumerate([0, 3, 1, 4, 2, 99]):  # 99: a ladder since shortened
        new = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in theta.items()}
        official = down.step(theta, new, version, rung=rung)
        site = apply_delta(theta, down.manifest, down.payload)
        expected = at_rung(adaptive(), rung if rung < 5 else 0).default.name
        assert {e.codec for e in down.manifest.entries} == {expected}
        for name in official:
            assert torch.equal(site[name], official[name]), (rung, name)
        theta = {k: v.clone() for k, v in official.items()}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -5.0, 0.0])
def test_a_reported_figure_that_is_not_a_measurement_is_taken_as_none(value):
    """A site's heartbeat figures feed the downlink's choice: NaN, infinity and negatives
    count as not measured, so they can neither break the choice nor pass as a link."""
    from wire.codecs.link_rate import measured

    assert measured(value) == 0.0 and measured(2.5) == 2.5
    down = Downlink(adaptive())
    choice = down.choose(SHAPES, [{"fetch_bytes_per_s": measured(value), "task_compute_s": 1.0}])
    assert choice.rung == 0 and "no transfer measured yet" in choice.reason
