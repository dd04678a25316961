"""The compressed downlink: theta_{r+1} travels as an encoded delta from theta_r.

The coordinator encodes ``theta_{r+1} - theta_r`` once per round (``encode_delta``) and then
*defines* the official theta_{r+1} as ``apply_delta(theta_r, ...)`` on what it encoded, the very
function every site runs on the bytes it receives. So whatever the codec loses, every party holds
the same bits; the loss itself is carried to the next round by the codec's error feedback where
the codec has it (int4, top-k).

Rules of the payload:

* floating tensors travel as a float32 delta, encoded by the codec the rules pick; applying it
  is ``(theta_r.float() + decoded).to(dtype)``, element by element one IEEE add, so every
  machine gets the same bits;
* other tensors (integer buffers, flags) travel whole and replace the old value.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from wire.codecs import CodecError, CodecState, decode_into
from wire.codecs.rules import CompressionConfig
from wire.tensors import Manifest, PayloadError, dtype_name, pack_encoded, validate_payload

BytesLike = bytes | bytearray | memoryview


def encode_delta(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    config: CompressionConfig,
    state: CodecState,
) -> tuple[Manifest, memoryview]:
    """Encode ``new - old`` for the downlink.

    Parameters
    ----------
    old, new
        theta_r and the strategy's theta_{r+1}: the same names, shapes and dtypes.
    config
        Codec rules for the downlink (``[compression.downlink]``).
    state
        Error-feedback residuals of the downlink, updated in place.

    Returns
    -------
    Manifest, memoryview
        The payload to serve as ``Fetch(from_version=r)``; pass it to ``apply_delta`` to get
        the official theta_{r+1}.
    """
    if old.keys() != new.keys():
        raise ValueError(
            f"theta changed its tensors: {sorted(old.keys() ^ new.keys())} added or removed"
        )
    parts: dict[str, torch.Tensor] = {}
    for name in sorted(old):
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: theta changed shape or dtype ({a.shape} -> {b.shape})")
        if a.is_floating_point():
            parts[name] = b.detach().to(torch.float32) - a.detach().to(torch.float32)
        else:
            parts[name] = b.detach()
    return pack_encoded(parts, config, state)


def apply_delta(
    old: Mapping[str, torch.Tensor], manifest: Manifest, payload: BytesLike
) -> dict[str, torch.Tensor]:
    """theta_{r+1} from theta_r and a downlink payload; ``old`` is not modified.

    Raises
    ------
    PayloadError
        The payload does not fit ``old`` (names, shapes, dtypes) or does not decode; nothing
        is returned in that case, so the caller still holds a whole theta_r.
    """
    validate_payload(manifest, payload)
    entries = manifest.by_name()
    if entries.keys() != old.keys():
        missing, extra = sorted(old.keys() - entries.keys()), sorted(entries.keys() - old.keys())
        raise PayloadError(f"delta does not fit theta: missing {missing}, unexpected {extra}")
    buf = payload if isinstance(payload, bytearray) else bytearray(payload)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(old):
        e, held = entries[name], old[name]
        if tuple(e.shape) != tuple(held.shape):
            raise PayloadError(f"{name}: delta shape {list(e.shape)}, theta has {list(held.shape)}")
        want = "float32" if held.is_floating_point() else dtype_name(held.dtype)
        if e.dtype != want:
            raise PayloadError(f"{name}: delta dtype {e.dtype}, expected {want}")
        if not held.is_floating_point() and e.codec != "none":
            raise PayloadError(f"{name}: a {want} tensor must travel whole (codec none)")
        if held.numel() == 0:
            out[name] = held.detach().clone()
            continue
        raw = (
            torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
            if e.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        if not held.is_floating_point():
            out[name] = raw.view(held.dtype).reshape(held.shape).clone()
            continue
        acc = held.detach().to(torch.float32).contiguous().clone()
        if e.codec == "none":
            acc.view(-1).add_(raw.view(torch.float32))
        else:
            try:
                decode_into(acc, raw, e.codec_meta, codec=e.codec, name=name)
            except CodecError as exc:
                raise PayloadError(str(exc)) from exc
        out[name] = acc.to(held.dtype)
    return out


def differing(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors whose bytes differ between two states (for mismatch reports)."""
    names = sorted(a.keys() | b.keys())
    return [
        n
        for n in names
        if n not in a
        or n not in b
        or a[n].dtype != b[n].dtype
        or a[n].shape != b[n].shape
        or not torch.equal(_bytes(a[n]), _bytes(b[n]))
    ]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
