"""The coordinator's side of the compressed downlink.

After each outer step ``Downlink.step`` encodes theta_{r+1} - theta_r once and returns the
official theta_{r+1}: theta_r plus exactly what the sites will decode (``wire.downlink``). With
``[streaming]`` the delta holds only the round's fragment (codec "none" unless
``[compression.downlink]`` says otherwise); residuals are kept per tensor, so each fragment
carries its own error feedback from one of its syncs to the next. The
error-feedback residuals and the delta being served go into the round's checkpoint, so a
restarted coordinator serves the same bytes and continues with the same residuals: the
crash-free and the crashed run stay bit-identical.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence

import torch
from google.protobuf.message import DecodeError

from wire.codecs import CodecError, CodecState
from wire.codecs.adaptive import (
    CodecChoice,
    LinkRate,
    Shapes,
    at_rung,
    choose_rung,
    codec_label,
    deadline_s,
)
from wire.codecs.rules import CompressionConfig
from wire.downlink import apply_delta, encode_delta
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest, PayloadError

log = logging.getLogger("isthmus.coordinator")
RESIDUAL = "residual/"
PAYLOAD, MANIFEST, FROM = "delta/payload", "delta/manifest", "delta/from_version"


class Downlink:
    """Encodes each new theta as a delta; holds the last delta for ``Fetch(from_version)``.

    With ``mode = "adaptive"`` each delta's rung is chosen at the close (``choose``) from
    what the round's sites reported: their fetches' latency and rate (a delta takes as long as
    on the slowest), their trainers' task time (the median) times ``overlap``. The close
    record keeps the rung, so a replay after a crash encodes the same delta."""

    def __init__(self, config: CompressionConfig, overlap: float = 1.0) -> None:
        self.config, self.overlap = config, overlap
        self.codec_state = CodecState()
        self._last_rung: int | None = None  # the adaptive rung chosen last, for the log
        self.from_version: int | None = None
        self.manifest: Manifest | None = None
        self.payload: memoryview | bytes | None = None

    @property
    def adaptive(self) -> bool:
        return self.config.adaptive

    def choose(self, shapes: Shapes, reports: Sequence[Mapping]) -> CodecChoice | None:
        """The rung of the next delta (None: not adaptive). ``shapes``: the tensors it
        carries; ``reports``: the round's sites' last progress (``fetch_bytes_per_s``,
        ``task_compute_s``; 0 or absent: not measured)."""
        if not self.adaptive:
            return None
        links = [
            LinkRate.of(r.get("fetch_bytes_per_s", 0.0), r.get("fetch_latency_s", 0.0))
            for r in reports
        ]
        computes = [x for x in (r.get("task_compute_s", 0.0) for r in reports) if x > 0]
        compute = statistics.median(computes) if computes else None
        deadline = deadline_s(compute, self.overlap, self.config.deadline_fraction)
        return choose_rung(self.config, shapes, links, deadline)

    def choose_for(
        self,
        theta: Mapping[str, torch.Tensor],
        names: Sequence[str] | None,
        reports: Sequence[Mapping],
        round_number: int,
    ) -> CodecChoice | None:
        """``choose`` for the delta of ``names`` (None: every floating tensor of ``theta``);
        a change of rung is logged with its reason."""
        if not self.adaptive:
            return None
        names = names or [n for n, t in theta.items() if t.is_floating_point()]
        choice = self.choose([(n, tuple(theta[n].shape)) for n in names], reports)
        if choice.rung != self._last_rung:
            log.info("round %d: downlink codec %s (%s)", round_number, choice.codec, choice.reason)
            self._last_rung = choice.rung
        return choice

    def event_fields(self, rung: int | None) -> dict:
        """What a ``round_closed`` event says of an adaptive downlink's delta."""
        if not self.adaptive:
            return {}
        return {"downlink_codec": codec_label(self.config.ladder[self._rung_or_first(rung)])}

    def _rung_or_first(self, rung: int | None) -> int:
        """``rung``, or the first when it is unset or of another ladder (a changed job)."""
        return rung if rung is not None and 0 <= rung < len(self.config.ladder) else 0

    def step(
        self,
        old: dict[str, torch.Tensor],
        new: dict[str, torch.Tensor],
        old_version: int,
        names: Sequence[str] | None = None,
        rung: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Make ``new`` (the strategy's theta_{old_version + 1}) the official one, in place:
        theta_r plus exactly what the sites will decode. With ``names`` (``[streaming]``: the
        round's fragment, the only tensors the step changed) the delta carries only those;
        every other tensor of ``new`` is set to theta_r's. ``rung``: the adaptive ladder's
        rung the close chose (None: the ladder's first)."""
        config = self.config
        if self.adaptive:
            config = at_rung(config, self._rung_or_first(rung))
        manifest, payload = encode_delta(old, new, config, self.codec_state, names)
        self.manifest, self.payload, self.from_version = manifest, payload, old_version
        return apply_delta(old, manifest, self.payload, out=new)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {RESIDUAL + k: v for k, v in self.codec_state.state_dict().items()}
        if self.manifest is not None and self.payload is not None:
            out[PAYLOAD] = _as_u8(self.payload)
            blob = self.manifest.to_proto().SerializeToString()
            out[MANIFEST] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            out[FROM] = torch.tensor([self.from_version], dtype=torch.int64)
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor], theta_version: int) -> None:
        """Restore from a checkpoint of theta_``theta_version``; a delta that does not lead
        there is not served (sites fetch theta whole)."""
        residuals = {k[len(RESIDUAL) :]: v for k, v in sd.items() if k.startswith(RESIDUAL)}
        try:
            self.codec_state.load_state_dict(residuals)
        except CodecError as exc:
            raise ValueError(f"downlink residuals unusable: {exc}") from exc
        self.manifest = self.payload = self.from_version = None
        if PAYLOAD not in sd or MANIFEST not in sd or FROM not in sd:
            return
        from_version = int(sd[FROM][0])
        if from_version + 1 != theta_version:
            return
        try:
            blob = sd[MANIFEST].numpy().tobytes()
            manifest = Manifest.from_proto(pb.Manifest.FromString(blob))
        except (DecodeError, PayloadError, ValueError) as exc:
            log.warning("stored downlink delta unusable (%s); sites will fetch theta whole", exc)
            return
        self.manifest, self.payload = manifest, memoryview(sd[PAYLOAD].contiguous().numpy())
        self.from_version = from_version


def _as_u8(payload: memoryview | bytes) -> torch.Tensor:
    """The payload as a uint8 tensor, without a copy when its memory is writable."""
    if isinstance(payload, memoryview) and not payload.readonly:
        return torch.frombuffer(payload, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
