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
from collections.abc import Sequence

import torch
from google.protobuf.message import DecodeError

from wire.codecs import CodecError, CodecState
from wire.codecs.rules import CompressionConfig
from wire.downlink import apply_delta, encode_delta
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest, PayloadError

log = logging.getLogger("isthmus.coordinator")
RESIDUAL = "residual/"
PAYLOAD, MANIFEST, FROM = "delta/payload", "delta/manifest", "delta/from_version"


class Downlink:
    """Encodes each new theta as a delta; holds the last delta for ``Fetch(from_version)``."""

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config
        self.codec_state = CodecState()
        self.from_version: int | None = None
        self.manifest: Manifest | None = None
        self.payload: memoryview | bytes | None = None

    def step(
        self,
        old: dict[str, torch.Tensor],
        new: dict[str, torch.Tensor],
        old_version: int,
        names: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Make ``new`` (the strategy's theta_{old_version + 1}) the official one, in place:
        theta_r plus exactly what the sites will decode. With ``names`` (``[streaming]``: the
        round's fragment, the only tensors the step changed) the delta carries only those;
        every other tensor of ``new`` is set to theta_r's."""
        manifest, payload = encode_delta(old, new, self.config, self.codec_state, names)
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
