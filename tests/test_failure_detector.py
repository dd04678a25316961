"""The phi-accrual failure detector (coordinator/members/failure_detector.py) on a fake clock."""

from __future__ import annotations

import math
import random

import pytest

from coordinator.members.failure_detector import (
    MAX_PHI,
    DetectorOptions,
    PhiAccrualDetector,
    suspicion_after_s,
)

OPTS = DetectorOptions(threshold=8.0, window=20, min_std_s=0.1, first_interval_s=1.0)


def _beats(det: PhiAccrualDetector, site: str, times: list[float]) -> float:
    for t in times:
        det.heartbeat(site, t)
    return times[-1]


def _steady(det: PhiAccrualDetector, site: str, interval: float, n: int, t0: float = 0.0) -> float:
    return _beats(det, site, [t0 + i * interval for i in range(n)])


def _time_to_suspicion(det: PhiAccrualDetector, site: str, last: float) -> float:
    """Silence after ``last`` at which ``site`` becomes suspected, by bisection on ``phi``."""
    lo, hi = 0.0, 1.0
    while det.phi(site, last + hi) < det.opts.threshold:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if det.phi(site, last + mid) < det.opts.threshold else (lo, mid)
    return hi


def test_steady_heartbeats_phi_low_after_a_beat_and_rising_with_silence():
    det = PhiAccrualDetector(OPTS)
    last = _steady(det, "a", 1.0, 50)
    assert det.phi("a", last) < 0.1
    assert det.phi("a", last + 0.5) < 0.1
    silences = [0.1 * i for i in range(1, 40)]
    phis = [det.phi("a", last + s) for s in silences]
    assert all(b > a for a, b in zip(phis, phis[1:], strict=False) if a < MAX_PHI)
    assert phis[-1] >= OPTS.threshold
    assert det.suspected(last + 0.9) == set()


def test_suspected_at_about_suspicion_after_s():
    det = PhiAccrualDetector(OPTS)
    # More beats than the window, so the seeded prior is gone and the history is all 1 s.
    last = _steady(det, "a", 1.0, OPTS.window + 5)
    after = suspicion_after_s(1.0, OPTS)
    assert 1.0 < after < 3.0
    assert det.suspected(last + after * 0.999) == set()
    assert det.suspected(last + after * 1.001) == {"a"}
    assert det.phi("a", last + after) == pytest.approx(OPTS.threshold, rel=1e-6)


def test_suspicion_after_s_grows_with_interval_pause_and_threshold():
    base = suspicion_after_s(1.0, OPTS)
    assert suspicion_after_s(2.0, OPTS) == pytest.approx(base + 1.0)
    paused = DetectorOptions(threshold=8.0, min_std_s=0.1, acceptable_pause_s=3.0)
    assert suspicion_after_s(1.0, paused) == pytest.approx(base + 3.0)
    strict = DetectorOptions(threshold=2.0, min_std_s=0.1)
    assert suspicion_after_s(1.0, strict) < base
    wide = DetectorOptions(threshold=8.0, min_std_s=1.0)
    assert suspicion_after_s(1.0, wide) > base
    with pytest.raises(ValueError, match="interval_s"):
        suspicion_after_s(0.0, OPTS)


def test_jittery_history_takes_longer_to_suspect_than_a_regular_one():
    rng = random.Random(7)
    det = PhiAccrualDetector(OPTS)
    last_regular = _steady(det, "regular", 1.0, 40)
    t, times = 0.0, []
    for _ in range(40):
        times.append(t)
        t += rng.uniform(0.5, 1.5)  # same mean interval, std ~0.29 s
    last_jittery = _beats(det, "jittery", times)
    regular = _time_to_suspicion(det, "regular", last_regular)
    jittery = _time_to_suspicion(det, "jittery", last_jittery)
    assert regular == pytest.approx(suspicion_after_s(1.0, OPTS), rel=1e-6)
    assert jittery > regular + 0.5


def test_first_heartbeat_uses_the_prior():
    det = PhiAccrualDetector(DetectorOptions(first_interval_s=10.0, min_std_s=0.1))
    det.heartbeat("a", 100.0)
    # Prior: mean 10 s, std 2.5 s; phi is log10(2) at exactly the mean.
    assert det.phi("a", 105.0) < 0.1
    assert det.phi("a", 110.0) == pytest.approx(math.log10(2), rel=1e-9)
    assert det.suspected(112.0) == set()
    assert det.suspected(140.0) == {"a"}


def test_unknown_and_forgotten_sites_are_never_suspected():
    det = PhiAccrualDetector(OPTS)
    assert det.phi("ghost", 1e6) == 0.0
    last = _steady(det, "a", 1.0, 10)
    _steady(det, "b", 1.0, 10)
    assert det.suspected(last + 1e4) == {"a", "b"}
    det.forget("a")
    det.forget("never-seen")
    assert det.phi("a", last + 1e4) == 0.0
    assert det.suspected(last + 1e4) == {"b"}
    assert det.sites() == ["b"]
    assert det.state_for_status(last + 1e4) == {"b": MAX_PHI}


def test_forgotten_site_starts_again_from_the_prior():
    det = PhiAccrualDetector(OPTS)
    _steady(det, "a", 10.0, 30)
    det.forget("a")
    det.heartbeat("a", 1000.0)
    # Back on the 1 s prior, so 5 s of silence is now suspicious where it was not before.
    assert det.suspected(1005.0) == {"a"}


def test_window_bounds_the_history():
    opts = DetectorOptions(window=10, min_std_s=1.0, first_interval_s=1.0)
    mixed = PhiAccrualDetector(opts)
    last = _steady(mixed, "a", 1.0, 200)
    last = _steady(mixed, "a", 10.0, 11, t0=last)  # the last 10 intervals are all 10 s
    fresh = PhiAccrualDetector(opts)
    fresh_last = _steady(fresh, "a", 10.0, 30)
    for silence in (5.0, 10.0, 11.0, 12.0):
        assert mixed.phi("a", last + silence) == pytest.approx(fresh.phi("a", fresh_last + silence))
    # Were the 1 s beats still remembered (mean ~1.4 s, std ~1.9 s), 12 s would be suspicious.
    assert mixed.suspected(last + 12.0) == set()


def test_status_lists_every_site_sorted_with_its_phi():
    det = PhiAccrualDetector(OPTS)
    for site in ("c", "a", "b"):
        _steady(det, site, 1.0, 5)
    det.heartbeat("b", 10.0)
    state = det.state_for_status(10.0)
    assert list(state) == ["a", "b", "c"]
    assert state["b"] < 0.1
    assert state["a"] == state["c"] >= OPTS.threshold


def test_phi_stays_finite_after_huge_silence_and_zero_intervals():
    det = PhiAccrualDetector(DetectorOptions(min_std_s=1e-9, first_interval_s=1e-6))
    for _ in range(300):
        det.heartbeat("burst", 0.0)  # every interval is zero
    for now in (0.0, 1e-12, 1.0, 1e9, 1e300, -1e300):
        phi = det.phi("burst", now)
        assert math.isfinite(phi) and 0.0 <= phi <= MAX_PHI
    assert det.phi("burst", 1e300) == MAX_PHI
    assert det.suspected(1e300) == {"burst"}


def test_out_of_order_heartbeat_is_ignored():
    det = PhiAccrualDetector(OPTS)
    last = _steady(det, "a", 1.0, 30)
    before = det.phi("a", last + 1.5)
    det.heartbeat("a", last - 0.5)
    assert det.phi("a", last + 1.5) == before


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("threshold", -1.0),
        ("threshold", 0.0),
        ("threshold", MAX_PHI),
        ("threshold", math.nan),
        ("window", 0),
        ("window", 2.5),
        ("window", True),
        ("min_std_s", 0.0),
        ("min_std_s", math.inf),
        ("acceptable_pause_s", -0.1),
        ("first_interval_s", 0.0),
        ("first_interval_s", "5"),
    ],
)
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: must be .* got {value!r}"):
        DetectorOptions(**{field: value})


def test_default_options_are_valid():
    opts = DetectorOptions()
    assert suspicion_after_s(5.0, opts) > 5.0
    assert DetectorOptions(acceptable_pause_s=0.0).acceptable_pause_s == 0.0
