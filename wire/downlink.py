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
* other tensors (integer buffers, flags) travel whole and replace the old value;
* a payload may carry only some tensors (``[streaming]``: one fragment per round): the others
  stay as they are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from wire.codecs import CodecError, CodecState, decode_into
from wire.codecs.rules import CompressionConfig, choose_codec
from wire.tensors import Manifest, PayloadError, dtype_name, pack_encoded, validate_payload

BytesLike = bytes | bytearray | memoryview


def encode_delta(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    config: CompressionConfig,
    state: CodecState,
    names: Collection[str] | None = None,
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
    names
        Encode only these tensors (``[streaming]``: the round's fragment); None: all of them.
        ``apply_delta`` leaves the others as they are.

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
    for name in old:
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: theta changed shape or dtype ({a.shape} -> {b.shape})")
    unknown = sorted(set(names) - old.keys()) if names is not None else []
    if unknown:
        raise ValueError(f"delta asked for tensors theta does not have: {unknown[:5]}")
    return pack_encoded(_Deltas(old, new, config, names), config, state)


class _Deltas:
    """``new - old`` tensor by tensor, in name order, made only when asked for: encoding the
    delta never holds more than one of them.

    A delta a codec encodes is written into one scratch buffer that every such tensor reuses
    (the codec's output is new memory; memory written for the first time costs several times
    what rewritten memory does). A delta that travels raw (codec ``none``) is its own payload
    bytes until they are packed, so it stays a tensor of its own."""

    def __init__(
        self,
        old: Mapping[str, torch.Tensor],
        new: Mapping[str, torch.Tensor],
        config: CompressionConfig,
        names: Collection[str] | None = None,
    ) -> None:
        self.old, self.new, self.config = old, new, config
        self.names = sorted(old) if names is None else sorted(names)
        self._scratch = torch.empty(0, dtype=torch.float32)

    def items(self):
        for name in self.names:
            a, b = self.old[name], self.new[name]
            if not a.is_floating_point():
                yield name, b.detach()
                continue
            a32, b32 = a.detach().to(torch.float32), b.detach().to(torch.float32)
            if choose_codec(name, a, self.config).name == "none":
                yield name, b32 - a32
                continue
            yield name, torch.sub(b32, a32, out=self._scratch_for(a))

    def _scratch_for(self, like: torch.Tensor) -> torch.Tensor:
        if self._scratch.numel() < like.numel():
            self._scratch = torch.empty(like.numel(), dtype=torch.float32)
        return self._scratch[: like.numel()].view(like.shape)


def apply_delta(
    old: Mapping[str, torch.Tensor],
    manifest: Manifest,
    payload: BytesLike,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """theta_{r+1} from theta_r and a downlink payload; ``old`` is not modified.

    The manifest may cover only some of theta's tensors (``[streaming]``: the fragment the
    round changed); every other tensor is theta_r's, copied into ``out`` (or a new tensor)
    unless ``out`` holds that very tensor. With ``out`` (tensors shaped like ``old``, e.g.
    views of the file or buffer theta_{r+1} goes to) the result is written there, else into
    new tensors. ``out`` may be the very tensors the delta was encoded from. Names, shapes and
    dtypes are checked before anything is written; a tensor whose codec data fails to decode
    leaves ``out`` partly written.

    Raises
    ------
    PayloadError
        The payload names a tensor theta does not have, does not fit ``old`` (shapes,
        dtypes) or does not decode; ``old`` is untouched, so the caller still holds a whole
        theta_r.
    """
    validate_payload(manifest, payload)
    entries = manifest.by_name()
    extra = sorted(entries.keys() - old.keys())
    if extra:
        raise PayloadError(f"delta does not fit theta: unexpected tensor(s) {extra[:5]}")
    for name in sorted(entries):
        _check_entry(name, entries[name], old[name])
    writable = isinstance(payload, bytearray) or (
        isinstance(payload, memoryview) and not payload.readonly
    )
    buf = payload if writable else bytearray(payload)
    result: dict[str, torch.Tensor] = {}
    for name in sorted(old):
        e, held = entries.get(name), old[name]
        target = out[name] if out is not None else torch.empty_like(held)
        if e is None:  # not in the delta: unchanged
            if target.data_ptr() != held.data_ptr():
                target.copy_(held)
            result[name] = target
            continue
        raw = (
            torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
            if e.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        _apply_one(name, e, held, raw, target)
        result[name] = target
    return result


def _check_entry(name: str, e, held: torch.Tensor) -> None:
    if tuple(e.shape) != tuple(held.shape) or e.is_piece:
        raise PayloadError(f"{name}: delta shape {list(e.shape)}, theta has {list(held.shape)}")
    want = "float32" if held.is_floating_point() else dtype_name(held.dtype)
    if e.dtype != want:
        raise PayloadError(f"{name}: delta dtype {e.dtype}, expected {want}")
    if not held.is_floating_point() and e.codec != "none":
        raise PayloadError(f"{name}: a {want} tensor must travel whole (codec none)")


def _apply_one(name: str, e, held: torch.Tensor, raw: torch.Tensor, target: torch.Tensor):
    """``target = held + delta`` (one IEEE add per element, in float32)."""
    if held.numel() == 0:
        return
    if not held.is_floating_point():
        target.copy_(raw.view(held.dtype).reshape(held.shape))
        return
    f32 = target.dtype == torch.float32 and target.is_contiguous()
    acc = target if f32 else torch.empty(held.shape, dtype=torch.float32)
    if acc.data_ptr() != held.data_ptr():
        acc.copy_(held)
    if e.codec == "none":
        acc.view(-1).add_(raw.view(torch.float32))
    else:
        try:
            decode_into(acc, raw, e.codec_meta, codec=e.codec, name=name)
        except CodecError as exc:
            raise PayloadError(str(exc)) from exc
    if not f32:
        target.copy_(acc)


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
