"""Adaptive compression: each transfer's codec chosen from the link's measured throughput.

With ``[compression] mode = "adaptive"`` the job names a ladder of codecs, least lossy first::

    [compression]
    mode = "adaptive"
    ladder = ["none", "bf16", "int8", "int4", { codec = "topk", fraction = 0.01 }]
    deadline_fraction = 0.8

and each transfer takes the first rung whose predicted time fits its deadline. The push up
and the fetch down must both fit in the compute they overlap (the ``delay_steps`` tau of a
streaming round, the whole round's steps when blocking), so each direction's deadline is half
of ``deadline_fraction`` of that time (``deadline_s``). The prediction is the payload's size
under that rung (``Codec.max_encoded_bytes`` per tensor, the job's ``rules`` still applying to
the tensors they match) through the link's fitted latency and rate (``wire.codecs.link_rate``);
for the downlink, the slowest of the sites' links. A ladder none of whose rungs fits takes its
last rung and says so. Everything here is pure: the callers measure, remember and log.

Error feedback across a change of rung is ``CodecState``'s: a tensor sent by a codec without
error feedback carries the residual an earlier rung left (``CodecState.encode``,
``CodecState.carry``), so nothing an earlier rung withheld is lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from wire.codecs.base import MAX_META_BYTES, Codec
from wire.codecs.link_rate import LinkRate
from wire.codecs.rules import CompressionConfig, choose_codec


@dataclass(frozen=True)
class CodecChoice:
    """Which rung a transfer takes, and why."""

    rung: int
    codec: str  # the rung's codec, as a label (``int8``, ``topk(0.01)``)
    nbytes: int  # the payload's predicted size under it
    predicted_s: float | None  # nbytes through the fitted link (None: nothing measured)
    deadline_s: float | None  # the time the transfer has (None: no compute measured yet)
    fits: bool
    reason: str

    def as_record(self) -> dict:
        """The choice as JSON-ready fields, for timing records and events."""
        return {
            "codec": self.codec,
            "rung": self.rung,
            "predicted_bytes": self.nbytes,
            "predicted_s": None if self.predicted_s is None else round(self.predicted_s, 4),
            "deadline_s": None if self.deadline_s is None else round(self.deadline_s, 4),
            "fits": self.fits,
        }


def codec_label(codec: Codec) -> str:
    """``int8``, or ``topk(0.01)`` for a codec whose fraction sets its size."""
    fraction = getattr(codec, "fraction", None)
    return codec.name if fraction is None else f"{codec.name}({fraction:g})"


def at_rung(config: CompressionConfig, rung: int) -> CompressionConfig:
    """``config`` with its ladder's rung ``rung`` as the default (the rules kept), fixed."""
    return replace(config, default=config.ladder[rung], mode="fixed", ladder=())


Shapes = Sequence[tuple[str, Sequence[int]]]  # (name, shape) of each tensor or piece sent


def payload_bytes(config: CompressionConfig, shapes: Shapes) -> int:
    """The most bytes a payload of float32 tensors ``shapes`` takes under ``config``: the
    codecs' data and meta (exact for codecs of a fixed size). A name may come more than once
    (pieces of one tensor held by several ranks)."""
    total = 0
    for name, shape in shapes:
        codec = choose_codec(name, shape, config)
        total += codec.max_encoded_bytes(shape, torch.float32) + MAX_META_BYTES
    return total


def overlap_of(job: Mapping[str, Any]) -> float:
    """The share of a task's compute a transfer overlaps, from a parsed job config: under
    ``[streaming]`` with ``delay_steps`` tau > 0, tau of the task's H/P steps; else the whole
    task (blocking: the next round waits for the transfer)."""
    streaming = job.get("streaming")
    if not isinstance(streaming, Mapping) or not streaming.get("delay_steps"):
        return 1.0
    rounds = job.get("rounds")
    inner = rounds.get("inner_steps", 0) if isinstance(rounds, Mapping) else 0
    steps = int(inner) // max(1, int(streaming.get("fragments", 1)))
    return min(1.0, int(streaming["delay_steps"]) / steps) if steps > 0 else 1.0


def deadline_s(compute_s: float | None, overlap: float, fraction: float) -> float | None:
    """The time one direction's transfer has: half (the other direction needs the rest) of
    ``fraction`` of the compute it overlaps, which is ``overlap`` (tau / (H/P) under
    streaming, 1 when blocking) of a task's measured ``compute_s``."""
    if compute_s is None or compute_s <= 0:
        return None
    return fraction * overlap * compute_s / 2


def choose_rung(
    config: CompressionConfig,
    shapes: Shapes,
    rate: LinkRate | Sequence[LinkRate],
    deadline: float | None,
) -> CodecChoice:
    """The least lossy rung of ``config.ladder`` whose predicted transfer fits ``deadline``.

    Parameters
    ----------
    config
        An adaptive ``[compression]`` table (``mode = "adaptive"``, a ladder).
    shapes
        The tensors (or pieces) the transfer carries, as (name, shape).
    rate
        The direction's fitted link, or several (the downlink's sites): a transfer takes
        as long as on the slowest of them (the unmeasured ones left out).
    deadline
        Seconds the transfer has (``deadline_s``); None while no compute was measured.

    Returns
    -------
    CodecChoice
        With nothing measured yet (no rate or no deadline) the first rung; else the first
        that fits, or the last with ``fits`` False when none does.
    """
    if not config.ladder:
        raise ValueError("choose_rung needs a compression config with a ladder")
    sizes = [payload_bytes(at_rung(config, i), shapes) for i in range(len(config.ladder))]
    labels = [codec_label(c) for c in config.ladder]
    links = [rate] if isinstance(rate, LinkRate) else list(rate)
    links = [x for x in links if x.seconds_per_byte is not None]
    if not links or deadline is None:
        missing = "no transfer" if not links else "no compute time"
        return CodecChoice(
            0, labels[0], sizes[0], None, deadline, True,
            f"{missing} measured yet: the ladder's first rung, {labels[0]}",
        )  # fmt: skip
    slowest = max(links, key=lambda x: x.predict(sizes[0]))
    for i, nbytes in enumerate(sizes):
        predicted = max(x.predict(nbytes) for x in links)
        if predicted <= deadline:
            fits = _transfer(nbytes, predicted, slowest)
            why = f"{labels[i]}: {fits}, within the {deadline:.2f} s deadline"
            return CodecChoice(i, labels[i], nbytes, predicted, deadline, True, why)
    last = len(sizes) - 1
    predicted = max(x.predict(sizes[last]) for x in links)
    why = (
        f"no rung fits: even the last, {labels[last]}, needs "
        f"{_transfer(sizes[last], predicted, slowest)}, against a {deadline:.2f} s deadline; "
        "using it"
    )
    return CodecChoice(last, labels[last], sizes[last], predicted, deadline, False, why)


def _transfer(nbytes: int, seconds: float, link: LinkRate) -> str:
    """``0.44 MB in 0.26 s (0.20 s latency + 6.25 MB/s)``."""
    return (
        f"{nbytes / 1e6:.2f} MB in {seconds:.2f} s ({link.latency_s:.2f} s latency + "
        f"{link.bytes_per_s / 1e6:.2f} MB/s)"
    )
