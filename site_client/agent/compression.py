"""The site's side of update compression: the job's codec rules, the error-feedback
residuals, which outlive a restart of the agent (fsynced beside the site's checkpoints), and
under ``mode = "adaptive"`` the rung each update goes up with (``UplinkCodecs``)."""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path

from safetensors.torch import load_file, save_file

from wire.codecs import CodecState
from wire.codecs.adaptive import CodecChoice, LinkRate, Shapes, at_rung, choose_rung, deadline_s
from wire.codecs.rules import CompressionConfig, compression_tables

log = logging.getLogger("isthmus.site")

CODEC_STATE_FILE = "codec_state.safetensors"


def compression_of(job_toml: str) -> CompressionConfig | None:
    """The job's ``[compression]`` uplink rules (None: raw float32, the table is absent).
    The downlink sub-table is the coordinator's business: deltas describe themselves."""
    table = tomllib.loads(job_toml).get("compression") if job_toml else None
    return None if table is None else compression_tables(table)[0]


def load_codec_state(path: Path) -> CodecState:
    """Error-feedback residuals kept across agent restarts (empty if there are none yet)."""
    state = CodecState()
    if path.exists():
        state.load_state_dict(load_file(str(path)))
    return state


def save_codec_state(path: Path, state: CodecState) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in state.state_dict().items()}, str(tmp))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class UplinkCodecs:
    """The compression each update goes up with: the job's, or under ``mode = "adaptive"``
    the rung ``wire.codecs.adaptive.choose_rung`` picks from this site's measured push
    throughput and its trainers' last task time. A change of rung is logged with its reason,
    and a ladder that cannot meet its deadline is said once (until it can again). It keeps the
    site's models of both link directions (``rate``: its pushes; ``down``: its fetches, which
    the coordinator's adaptive downlink reads from the heartbeats)."""

    def __init__(self, compression: CompressionConfig | None, overlap: float, site: str) -> None:
        self.compression, self.overlap, self.site = compression, overlap, site
        self.rate = LinkRate()
        self.down = LinkRate()
        self.last: CodecChoice | None = None

    @property
    def adaptive(self) -> bool:
        return self.compression is not None and self.compression.adaptive

    def measured(self, direction: str, nbytes: int, seconds: float) -> None:
        """A ``"push"`` (its call alone: the encoding and the checkpoint's hold left out) or a
        ``"fetch"`` moved ``nbytes`` in ``seconds``: into that direction's model. One that took
        twice its predicted time or more (``LinkRate.surprise``) slows the other direction's
        model alike until a transfer of its own measures it (``LinkRate.slowed``)."""
        push = direction == "push"
        mine, other = (self.rate, self.down) if push else (self.down, self.rate)
        surprise = mine.surprise(nbytes, seconds)
        mine = mine.observe(nbytes, seconds)
        if surprise is not None and surprise > 1:
            other = other.slowed(surprise)
            if self.adaptive:
                log.info(
                    "[%s] a %s took %.1fx its predicted time: the other direction is taken as "
                    "slowed alike until it measures itself",
                    self.site,
                    direction,
                    surprise,
                )
        self.rate, self.down = (mine, other) if push else (other, mine)

    def choose(
        self, shapes: Shapes, compute_s: float | None
    ) -> tuple[CompressionConfig | None, CodecChoice | None]:
        """The config for an update of ``shapes`` and, when adaptive, the choice behind it."""
        if not self.adaptive:
            return self.compression, None
        cfg = self.compression
        deadline = deadline_s(compute_s, self.overlap, cfg.deadline_fraction)
        choice = choose_rung(cfg, shapes, self.rate, deadline)
        before, self.last = self.last, choice
        if before is None or before.rung != choice.rung:
            was = "" if before is None else f"{before.codec} -> "
            log.info("[%s] uplink codec %s%s (%s)", self.site, was, choice.codec, choice.reason)
        if not choice.fits and (before is None or before.fits):
            log.warning("[%s] uplink: %s", self.site, choice.reason)
        return at_rung(cfg, choice.rung), choice
