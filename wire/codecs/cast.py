"""Element-wise codecs: ``none`` (raw bytes) and the ``bf16`` / ``fp16`` casts.

Error bounds (round to nearest even), element-wise:

- ``none``: exact; the data is the tensor's own little-endian bytes in its own dtype (fp32 raw
  for fp32 pseudo-gradients), exactly the layout of an uncompressed ``TensorEntry``.
- ``bf16``: ``|x - x'| <= 2^-8 |x|`` for ``|x| >= 2^-126``, ``<= 2^-134`` below. Same exponent
  range as fp32, but ``|x| >= (2 - 2^-8) * 2^127`` (about 3.396e38) would round to Inf.
- ``fp16``: ``|x - x'| <= 2^-11 |x|`` for ``|x| >= 2^-14`` (6.1e-5), ``<= 2^-25`` (3e-8) below,
  so values under 3e-8 become 0. ``|x| >= 65520`` would round to Inf.

Input that would overflow is refused with ``CodecError`` rather than sent as Inf. Decoding
refuses data holding NaN or Inf (a peer can always compute a matching CRC), so a decoded tensor
is always finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from wire.codecs.base import FLOAT_DTYPES, Codec, CodecError, Header, finite_absmax, typed, who


def _refuse_non_finite(src: torch.Tensor, name: str) -> None:
    if src.numel() and src.dtype in FLOAT_DTYPES:
        lo, hi = (float(v) for v in torch.aminmax(src))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise CodecError(f"{who(name)}: codec data holds NaN or Inf values")


def _write(out: torch.Tensor, src: torch.Tensor, alpha: float, add: bool) -> None:
    if add:
        out.add_(src, alpha=alpha)
    else:
        out.copy_(src)


@dataclass(frozen=True)
class NoneCodec(Codec):
    """Raw bytes in the tensor's own dtype; any wire dtype (integers too). The encoded ``data``
    shares memory with a contiguous CPU input."""

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = 0

    def _encode(self, xf: torch.Tensor, state, name: str) -> tuple[torch.Tensor, tuple]:
        finite_absmax(xf, name)
        # No copy: the bytes are the input's own (the payload packer copies them anyway). If
        # the input changes before they are sent, the CRC in the meta makes decoding fail.
        return xf.view(torch.uint8) if xf.numel() else torch.empty(0, dtype=torch.uint8), ()

    @classmethod
    def data_bytes(cls, numel: int, dtype: torch.dtype, params: tuple) -> tuple[int, int]:
        return numel * dtype.itemsize, numel * dtype.itemsize

    @classmethod
    def _decode(cls, out, data, h: Header, alpha: float, add: bool, name: str) -> None:
        src = typed(data, 0, h.numel, h.dtype)
        _refuse_non_finite(src, name)
        if out is not None:
            _write(out, src, alpha, add)


@dataclass(frozen=True)
class _CastCodec(Codec):
    wire_dtype: ClassVar[torch.dtype]

    def _encode(self, xf: torch.Tensor, state, name: str) -> tuple[torch.Tensor, tuple]:
        m = finite_absmax(xf, name)
        # Cast the largest magnitude through the very conversion the data takes: exact test.
        if math.isinf(float(torch.tensor(m, dtype=xf.dtype).to(self.wire_dtype))):
            limit = torch.finfo(self.wire_dtype).max
            raise CodecError(
                f"{who(name)}: max |x| = {m:.6g} overflows {self.name} (largest finite "
                f"{limit:.6g}); use codec 'none' or 'int8' for this tensor"
            )
        data = torch.empty(xf.numel() * 2, dtype=torch.uint8)
        data.view(self.wire_dtype).copy_(xf)
        return data, ()

    @classmethod
    def data_bytes(cls, numel: int, dtype: torch.dtype, params: tuple) -> tuple[int, int]:
        return numel * 2, numel * 2

    @classmethod
    def _decode(cls, out, data, h: Header, alpha: float, add: bool, name: str) -> None:
        src = typed(data, 0, h.numel, cls.wire_dtype)
        _refuse_non_finite(src, name)
        if out is not None:
            _write(out, src, alpha, add)


@dataclass(frozen=True)
class Bf16Codec(_CastCodec):
    """bfloat16 cast: 2 bytes per element, relative error <= 2^-8."""

    name: ClassVar[str] = "bf16"
    codec_id: ClassVar[int] = 1
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16


@dataclass(frozen=True)
class Fp16Codec(_CastCodec):
    """float16 cast: 2 bytes per element, relative error <= 2^-11 in fp16's normal range."""

    name: ClassVar[str] = "fp16"
    codec_id: ClassVar[int] = 2
    wire_dtype: ClassVar[torch.dtype] = torch.float16
