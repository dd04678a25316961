"""What a link direction costs a transfer: a fixed latency plus a time per byte, fitted to the
transfers seen (``wire.codecs.adaptive`` predicts each rung's transfer from it).

A transfer of ``x`` bytes takes ``latency_s + x * seconds_per_byte``: the latency is what
every transfer pays whatever its size (round trips to open a stream and hear the reply, a
congestion window that starts small again after an idle link), the time per byte is the
link's rate. Both are fitted by least squares to the last ``HISTORY`` transfers, the newest
weighing most (each one half of the one after it): a link's rate changes by the hour. A
transfer more than ``CHANGED`` times slower or faster than the model predicted means the link
changed: the history is dropped and the model starts again from that transfer, rather than
mixing two links' transfers in one fit.

Transfers of one size cannot tell latency from rate: then the whole time is taken per byte
(which overstates a larger payload's time, never understates a smaller one's). Once payloads
of different sizes were seen (a change of codec makes them) the two are told apart, which
is what lets a compressed link trust the less compressed rungs again when it is fast: a
small payload on a fast link with a long round trip takes about its latency, and that time
says nothing of the rate.

A link that slows is usually seen first in the other direction (a site fetches its delta on
the slowed link before it pushes its next update): ``surprise`` tells how far a transfer missed
its model, and ``slowed`` makes the other direction's model that much slower until a transfer
of its own measures it again. Only a slowdown crosses over: a rung too lossy for one transfer
costs a little loss, a rung too large for a slowed link costs a stalled round (a speed-up is
found by the direction's own transfers, as it is now).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HISTORY = 8  # transfers the fit looks at
CHANGED = 2.0  # a transfer this many times slower or faster than predicted: the link changed
SPREAD = 0.2  # sizes whose weighted spread is below this share of their mean are "one size"


@dataclass(frozen=True)
class LinkRate:
    """The fitted model of one link direction (``LinkRate()``: nothing measured)."""

    samples: tuple[tuple[int, float], ...] = ()  # (bytes, seconds), oldest first
    latency_s: float = 0.0
    seconds_per_byte: float | None = None

    @classmethod
    def of(cls, bytes_per_s: float, latency_s: float = 0.0) -> LinkRate:
        """A model reported by another party (0 or less: nothing measured)."""
        if bytes_per_s <= 0:
            return cls()
        return cls((), max(latency_s, 0.0), 1.0 / bytes_per_s)

    @property
    def bytes_per_s(self) -> float | None:
        """The link's rate: bytes per second past the latency (None: nothing measured)."""
        return None if self.seconds_per_byte is None else 1.0 / self.seconds_per_byte

    def observe(self, nbytes: int, seconds: float) -> LinkRate:
        """The model after one more transfer of ``nbytes`` in ``seconds`` (an empty or
        instantaneous transfer says nothing of the link and changes nothing)."""
        if nbytes <= 0 or seconds <= 0:
            return self
        if self.surprise(nbytes, seconds) is not None:
            return LinkRate((), 0.0, None).observe(nbytes, seconds)  # another link now
        samples = (*self.samples, (int(nbytes), float(seconds)))[-HISTORY:]
        latency, per_byte = fit(samples)
        return LinkRate(samples, latency, per_byte)

    def surprise(self, nbytes: int, seconds: float) -> float | None:
        """How many times slower than predicted a transfer of ``nbytes`` in ``seconds`` was
        (below 1: faster), if that is a change of link (``CHANGED`` or more either way); None
        when it fits the model or nothing was measured yet."""
        predicted = self.predict(nbytes) if nbytes > 0 and seconds > 0 else None
        if not predicted:
            return None
        ratio = seconds / predicted
        return ratio if not 1 / CHANGED < ratio < CHANGED else None

    def slowed(self, factor: float) -> LinkRate:
        """This direction's model after the other direction was ``factor`` times slower than
        its own model: the rate divided by ``factor``, and the history dropped so that this
        direction's next transfer alone refits it. A factor of 1 or less changes nothing."""
        if self.seconds_per_byte is None or not factor > 1 or not math.isfinite(factor):
            return self
        return LinkRate((), self.latency_s, self.seconds_per_byte * factor)

    def predict(self, nbytes: int) -> float | None:
        """Seconds a transfer of ``nbytes`` should take (None: nothing measured)."""
        if self.seconds_per_byte is None:
            return None
        return self.latency_s + nbytes * self.seconds_per_byte


def fit(samples: tuple[tuple[int, float], ...]) -> tuple[float, float]:
    """(latency, seconds per byte) of ``samples`` (at least one), newest weighing most."""
    weights = [0.5 ** (len(samples) - 1 - i) for i in range(len(samples))]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, samples, strict=True)) / total
    mean_t = sum(w * t for w, (_, t) in zip(weights, samples, strict=True)) / total
    var_x = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, samples, strict=True)) / total
    if var_x > (SPREAD * mean_x) ** 2:
        cov = sum(
            w * (x - mean_x) * (t - mean_t) for w, (x, t) in zip(weights, samples, strict=True)
        )
        per_byte = cov / total / var_x
        latency = mean_t - per_byte * mean_x
        if per_byte > 0 and latency >= 0:  # else noise: fall back to one size's rule
            return min(latency, min(t for _, t in samples)), per_byte
    return 0.0, mean_t / mean_x


def measured(value) -> float:
    """A figure another party reported as measured (a rate, a duration): a finite number
    above 0, else 0, which reads as "not measured" (NaN, infinity, negatives and values that
    are no number at all are never taken for a link or a task)."""
    try:
        figure = float(value)
    except (TypeError, ValueError):
        return 0.0
    return figure if math.isfinite(figure) and figure > 0 else 0.0
