"""Exponential backoff with full jitter, a cap and an overall deadline.

"Full jitter" draws each wait uniformly from [0, min(cap, initial * multiplier**attempt)], which
spreads a crowd of retrying sites out instead of having them hammer a restarted coordinator in
lockstep. ``next_delay`` is pure; ``retry`` is the loop around it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """Retries went on past the policy's deadline; carries the last error."""


@dataclass(frozen=True)
class BackoffPolicy:
    initial_s: float = 0.5
    multiplier: float = 2.0
    cap_s: float = 30.0
    deadline_s: float = 300.0

    def __post_init__(self) -> None:
        if self.initial_s <= 0 or self.multiplier < 1 or self.cap_s < self.initial_s:
            raise ValueError(
                "backoff needs initial_s > 0, multiplier >= 1 and cap_s >= initial_s, got "
                f"{self.initial_s}, {self.multiplier}, {self.cap_s}"
            )
        if self.deadline_s <= 0:
            raise ValueError(f"backoff deadline_s must be > 0, got {self.deadline_s}")


def next_delay(policy: BackoffPolicy, attempt: int, rng: random.Random) -> float:
    """How long to wait before retry number ``attempt`` (0 = the first retry)."""
    ceiling = min(policy.cap_s, policy.initial_s * policy.multiplier ** min(attempt, 64))
    return rng.uniform(0.0, ceiling)


def retry(
    fn: Callable[[], T],
    policy: BackoffPolicy,
    retryable: Callable[[BaseException], bool],
    *,
    describe: str = "call",
    on_retry: Callable[[int, float, BaseException], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """Call ``fn`` until it succeeds, a non-retryable error rises, or the deadline passes."""
    rng = rng or random.Random()
    start = clock()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not retryable(exc):
                raise
            delay = next_delay(policy, attempt, rng)
            elapsed = clock() - start
            if elapsed + delay > policy.deadline_s:
                raise DeadlineExceeded(
                    f"{describe} still failing after {attempt + 1} attempts over "
                    f"{elapsed:.1f}s: {exc}"
                ) from exc
            if on_retry is not None:
                on_retry(attempt, delay, exc)
            sleep(delay)
            attempt += 1
