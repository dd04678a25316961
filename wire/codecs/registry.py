"""The codec registry, ``make_codec``, and the two decoders a receiver calls.

A receiver needs no codec parameters: ``decode_into(acc, data, meta)`` reads them from the meta,
checks everything (meta CRC, lengths, data CRC, value ranges) and only then adds into ``acc``, so
an error leaves ``acc`` as it was.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from wire.codecs.base import (
    FLOAT_DTYPES,
    Codec,
    CodecError,
    Header,
    as_bytes_tensor,
    as_memoryview,
    parse_meta,
    who,
)
from wire.codecs.cast import Bf16Codec, Fp16Codec, NoneCodec
from wire.codecs.quantize import Int4Codec, Int8Codec
from wire.codecs.topk import TopKCodec

CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoneCodec, Bf16Codec, Fp16Codec, Int8Codec, Int4Codec, TopKCodec)
}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
_BY_ID = {c.codec_id: c for c in CODECS.values()}

BytesLike = bytes | bytearray | memoryview | torch.Tensor


def make_codec(name: str, **params: Any) -> Codec:
    """A codec by name with its parameters, e.g. ``make_codec("topk", fraction=0.01)``.

    Raises
    ------
    ValueError
        An unknown codec, an unknown parameter or a bad value; the message starts with the
        parameter's name (``"fraction: must be ..."``).
    """
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"codec: unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
    allowed = codec_params(name)
    for key in params:
        if key not in allowed:
            takes = ", ".join(allowed) or "no parameters"
            raise ValueError(f"{key}: unknown parameter for codec {name!r} (it takes {takes})")
    return cls(**params)


def codec_params(name: str) -> tuple[str, ...]:
    """The parameter names codec ``name`` takes."""
    fields = getattr(CODECS[name], "__dataclass_fields__", {})
    return tuple(f for f in fields if fields[f].init)


def _checked_data(cls: type[Codec], h: Header, crc: int, data: BytesLike, name: str):
    u8 = as_bytes_tensor(data, name)
    if u8.numel() != h.data_nbytes:
        raise CodecError(
            f"{who(name)}: codec data is {u8.numel()} bytes, its meta says {h.data_nbytes} "
            "(truncated or mismatched)"
        )
    lo, hi = cls.data_range(h, name)
    if not lo <= h.data_nbytes <= hi:
        raise CodecError(
            f"{who(name)}: {cls.name} data for {h.numel} elements must be {_span(lo, hi)} "
            f"bytes, the meta says {h.data_nbytes}"
        )
    if zlib.crc32(as_memoryview(u8)) != crc:
        raise CodecError(f"{who(name)}: codec data fails its CRC32 check (corrupted)")
    return u8


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo} to {hi}"


def data_bounds(meta: bytes, name: str = "") -> tuple[int, int]:
    """``(fewest, most)`` data bytes the tensor ``meta`` describes may have: what its codec
    writes for its element count and parameters (equal but for top-k). For refusing an oversized
    entry before any of its bytes are received.

    Raises
    ------
    CodecError
        A meta that does not parse, or invalid parameters.
    """
    cls, h, _ = parse_meta(meta, _BY_ID, None, name)
    return cls.data_range(h, name)


def decode_into(
    acc: torch.Tensor,
    data: BytesLike,
    meta: bytes,
    alpha: float = 1.0,
    *,
    codec: str | None = None,
    name: str = "",
) -> None:
    """``acc += alpha * decoded`` in place, after validating everything.

    The data is fully checked before ``acc`` is touched, so on error ``acc`` is unchanged.

    Parameters
    ----------
    acc
        A contiguous floating CPU tensor with as many elements as were encoded (any shape).
    data, meta
        The encoded bytes (a writable buffer or uint8 tensor is read without a copy) and the
        ``codec_meta``.
    alpha
        Weight of this update (e.g. 1 / number of sites). With ``alpha == 1`` each element is one
        IEEE multiply (the dequantisation) then one IEEE add, so every machine gets the same bits.
    codec, name
        The manifest's codec name, checked against the meta; the tensor name for messages.

    Raises
    ------
    CodecError
        A bad accumulator, or meta/data that are truncated, corrupted (CRC32), inconsistent
        (lengths, block, k) or out of range (scales, indices, values).
    """
    if not isinstance(acc, torch.Tensor) or acc.dtype not in FLOAT_DTYPES:
        raise CodecError(f"{who(name)}: the accumulator must be a floating-point tensor")
    if acc.device.type != "cpu" or not acc.is_contiguous():
        raise CodecError(f"{who(name)}: the accumulator must be a contiguous CPU tensor")
    if not math.isfinite(alpha):
        raise CodecError(f"{who(name)}: alpha must be finite, got {alpha!r}")
    cls, h, crc = parse_meta(meta, _BY_ID, codec, name)
    if h.numel != acc.numel():
        raise CodecError(
            f"{who(name)}: codec meta says {h.numel} elements, the accumulator has {acc.numel()}"
        )
    u8 = _checked_data(cls, h, crc, data, name)
    cls._decode(acc.view(-1), u8, h, float(alpha), True, name)


def decode(
    data: BytesLike,
    meta: bytes,
    shape: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
    codec: str | None = None,
    name: str = "",
) -> torch.Tensor:
    """Decode into a new tensor.

    Parameters
    ----------
    data, meta
        As for ``decode_into``.
    shape
        The tensor's shape (from the manifest); it must hold as many elements as the meta says.
        Check it against your model first: it is allocated before the data is read.
    dtype
        Of the result; default: the dtype the tensor had when it was encoded.
    codec, name
        The manifest's codec name, checked against the meta; the tensor name for messages.

    Returns
    -------
    torch.Tensor
        The decoded values, always finite.

    Raises
    ------
    CodecError
        Anything invalid about ``data`` or ``meta``.
    """
    cls, h, crc = parse_meta(meta, _BY_ID, codec, name)
    numel = math.prod(int(d) for d in shape)
    if any(int(d) < 0 for d in shape) or numel != h.numel:
        raise CodecError(f"{who(name)}: codec meta says {h.numel} elements, shape {list(shape)}")
    u8 = _checked_data(cls, h, crc, data, name)
    dtype = h.dtype if dtype is None else dtype
    out = torch.empty(numel, dtype=dtype)
    cls._decode(out, u8, h, 1.0, False, name)
    return out.view(tuple(int(d) for d in shape))


def verify(
    data: BytesLike, meta: bytes, numel: int, *, codec: str | None = None, name: str = ""
) -> None:
    """Run every check ``decode_into`` runs, without decoding: for refusing a bad update when it
    arrives rather than when the round is summed.

    Raises
    ------
    CodecError
        As ``decode_into`` would.
    """
    cls, h, crc = parse_meta(meta, _BY_ID, codec, name)
    if h.numel != numel:
        raise CodecError(f"{who(name)}: codec meta says {h.numel} elements, expected {numel}")
    cls._decode(None, _checked_data(cls, h, crc, data, name), h, 1.0, False, name)


def meta_info(meta: bytes, name: str = "") -> dict[str, Any]:
    """What a meta says (codec, source dtype, numel, data bytes, parameters), once validated."""
    cls, h, _ = parse_meta(meta, _BY_ID, None, name)
    return {
        "codec": cls.name,
        "dtype": h.dtype,
        "numel": h.numel,
        "data_nbytes": h.data_nbytes,
        "params": h.params,
    }
