"""Exponential backoff with full jitter (wire/backoff.py), on a fake clock."""

from __future__ import annotations

import random

import pytest

from wire.backoff import BackoffPolicy, DeadlineExceeded, next_delay, retry


class Transient(Exception):
    pass


class Fatal(Exception):
    pass


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, Transient)


def test_next_delay_within_full_jitter_bounds():
    policy = BackoffPolicy(initial_s=0.5, multiplier=2.0, cap_s=30.0, deadline_s=300.0)
    rng = random.Random(7)
    for attempt in range(0, 80):
        ceiling = min(30.0, 0.5 * 2.0**attempt)
        for _ in range(50):
            d = next_delay(policy, attempt, rng)
            assert 0.0 <= d <= ceiling, (attempt, d)


def test_next_delay_reaches_the_ceiling_range():
    policy = BackoffPolicy(initial_s=1.0, multiplier=3.0, cap_s=20.0)
    rng = random.Random(1)
    # Attempt 0: uniform on [0, 1]; attempt 10: uniform on [0, 20] (capped).
    first = [next_delay(policy, 0, rng) for _ in range(400)]
    late = [next_delay(policy, 10, rng) for _ in range(400)]
    assert max(first) <= 1.0 and max(first) > 0.9
    assert max(late) <= 20.0 and max(late) > 18.0
    assert min(late) < 2.0  # full jitter: small waits stay possible


def test_jitter_spreads_values():
    policy = BackoffPolicy(initial_s=1.0, multiplier=2.0, cap_s=8.0)
    rng = random.Random(3)
    values = [next_delay(policy, 3, rng) for _ in range(100)]
    assert len(set(values)) > 90
    mean = sum(values) / len(values)
    assert 2.5 < mean < 5.5  # uniform on [0, 8] has mean 4
    # Independent sites (independent generators) do not retry in lockstep.
    a = [next_delay(policy, n, random.Random(10)) for n in range(5)]
    b = [next_delay(policy, n, random.Random(11)) for n in range(5)]
    assert a != b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": 0.0},
        {"initial_s": -1.0},
        {"multiplier": 0.5},
        {"initial_s": 5.0, "cap_s": 1.0},
        {"deadline_s": 0.0},
    ],
)
def test_bad_policy_refused(kwargs):
    with pytest.raises(ValueError, match="backoff"):
        BackoffPolicy(**kwargs)


def test_retry_succeeds_after_transient_errors():
    fake = FakeClock()
    calls = []
    retries = []

    def fn():
        calls.append(fake.now)
        if len(calls) < 4:
            raise Transient(f"flaky {len(calls)}")
        return "ok"

    policy = BackoffPolicy(initial_s=1.0, multiplier=2.0, cap_s=10.0, deadline_s=100.0)
    result = retry(
        fn,
        policy,
        _is_transient,
        on_retry=lambda n, d, e: retries.append((n, d, str(e))),
        clock=fake.clock,
        sleep=fake.sleep,
        rng=random.Random(5),
    )
    assert result == "ok"
    assert len(calls) == 4
    assert [n for n, _, _ in retries] == [0, 1, 2]
    assert [e for _, _, e in retries] == ["flaky 1", "flaky 2", "flaky 3"]
    assert fake.sleeps == [d for _, d, _ in retries]
    for n, d in enumerate(fake.sleeps):
        assert 0 <= d <= min(10.0, 2.0**n)


def test_retry_stops_at_the_deadline_with_the_last_error():
    fake = FakeClock()
    attempts = []

    def fn():
        attempts.append(fake.now)
        raise Transient(f"down #{len(attempts)}")

    policy = BackoffPolicy(initial_s=1.0, multiplier=2.0, cap_s=8.0, deadline_s=60.0)
    start = fake.now
    with pytest.raises(DeadlineExceeded) as info:
        retry(
            fn,
            policy,
            _is_transient,
            describe="push",
            clock=fake.clock,
            sleep=fake.sleep,
            rng=random.Random(2),
        )
    err = info.value
    assert isinstance(err, TimeoutError)
    assert isinstance(err.__cause__, Transient)
    assert str(err.__cause__) == f"down #{len(attempts)}"  # the last error, not the first
    assert "push" in str(err) and f"down #{len(attempts)}" in str(err)
    assert f"{len(attempts)} attempts" in str(err)
    # It never slept past the deadline, and it did keep trying for a while.
    assert fake.now - start <= 60.0
    assert len(attempts) >= 5


def test_retry_counts_time_spent_inside_the_call():
    fake = FakeClock()

    def slow():
        fake.now += 25.0
        raise Transient("slow failure")

    policy = BackoffPolicy(initial_s=0.1, cap_s=0.2, deadline_s=60.0)
    with pytest.raises(DeadlineExceeded):
        retry(slow, policy, _is_transient, clock=fake.clock, sleep=fake.sleep, rng=random.Random())
    assert len(fake.sleeps) <= 2


def test_non_retryable_error_propagates_immediately():
    fake = FakeClock()
    calls = []

    def fn():
        calls.append(1)
        raise Fatal("permission denied")

    with pytest.raises(Fatal, match="permission denied"):
        retry(fn, BackoffPolicy(), _is_transient, clock=fake.clock, sleep=fake.sleep)
    assert calls == [1] and fake.sleeps == []


def test_non_retryable_after_transient_propagates():
    fake = FakeClock()
    errors = iter([Transient("a"), Transient("b"), Fatal("stop")])

    def fn():
        raise next(errors)

    with pytest.raises(Fatal, match="stop"):
        retry(fn, BackoffPolicy(), _is_transient, clock=fake.clock, sleep=fake.sleep)
    assert len(fake.sleeps) == 2


def test_keyboard_interrupt_is_never_retried():
    fake = FakeClock()
    calls = []

    def fn():
        calls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        retry(fn, BackoffPolicy(), lambda e: True, clock=fake.clock, sleep=fake.sleep)
    assert calls == [1]
