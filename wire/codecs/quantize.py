"""Blockwise absmax quantisation: ``int8`` (one byte per value) and ``int4`` (two per byte).

The flat tensor is cut into blocks of ``block`` elements (the last one zero-padded). Each block b
gets a scale ``s_b >= max|x_b| / qmax`` (qmax = 127 for int8, 7 for int4) and each value becomes
``q = round(x / s_b)`` clamped to ``[-qmax, qmax]``; decoding is ``x' = q * s_b`` in fp32.

Error bound, element-wise: ``|x - x'| <= 0.5002 * s_b``, where ``s_b`` is the decoded scale and
``s_b <= max|x_b| / qmax * (1 + 2^-10)`` (fp16 scales, blocks no more than 2^14 times quieter than
the tensor's absmax; quieter blocks round their scale up, keeping the bound in ``s_b``), or
``* (1 + 2^-22)`` with fp32 scales. So int8 is within ``max|x_b| / 254`` and int4 within
``max|x_b| / 14``, up to those factors.

Scales: ``scale_dtype = "fp32"`` stores ``s_b`` itself. ``"fp16"`` stores ``s_b / unit`` (at most
about 1, rounded *up* to fp16, so ``s_b`` never shrinks below ``max|x_b| / qmax``) with one fp32
``unit = (max|x| + max|r|) / qmax`` in the meta: half the scale bytes, and fp16's range never
matters, from 1e-30 to 1e30. Inputs with ``|x| + max|r| >= 1.7e38`` are refused.

Data layout: scales (``nblocks`` fp16/fp32), then int8 values, or for int4 the values plus 8
packed two per byte (element 2i in the low nibble, 2i+1 in the high one; a pad nibble is 8).
So n elements take exactly ``ceil(n / block) * (2 or 4) + n`` bytes (int8) or ``... +
ceil(n / 2)`` (int4): ``data_bytes``, which the receiver checks before it stores a byte.

Error feedback (default on for int4): the codec quantises ``v = x + r`` and leaves
``r = v - x'`` in the state, so ``|r| <= 0.5002 * s_b`` after every round.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import ClassVar

import torch

from wire.codecs.base import (
    CHUNK,
    FLT_MAX,
    Codec,
    CodecError,
    Header,
    chunks,
    finite_absmax,
    refuse_overflow,
    typed,
    who,
)
from wire.config_table import setting

SCALE_DTYPES = {"fp16": (1, torch.float16), "fp32": (2, torch.float32)}
_SCALE_BY_CODE = {code: dt for code, dt in SCALE_DTYPES.values()}
MIN_BLOCK, MAX_BLOCK = 8, 1 << 16


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


class _Buffers:
    """Per-call scratch, allocated once and reused by every chunk."""

    def __init__(self, per: int, block: int) -> None:
        nbc = per // block
        self.tmp = torch.empty(per)
        self.pad = torch.empty(per)
        self.i8 = torch.empty(per, dtype=torch.int8)
        self.w16 = torch.empty(per // 2 + 1, dtype=torch.int16)
        self.mx, self.mn, self.ratio, self.s = (torch.empty(nbc) for _ in range(4))


@dataclass(frozen=True)
class _BlockQuant(Codec):
    block: int = setting(
        256,
        help=f"elements per block, each with a scale of its own: a power of two in "
        f"{MIN_BLOCK}..{MAX_BLOCK}",
    )
    scale_dtype: str = setting(
        "fp16",
        help=f"how the scales travel, one of {list(SCALE_DTYPES)}: ``fp16`` relative to one "
        "fp32 unit in the meta (half the scale bytes), ``fp32`` as they are",
    )
    error_feedback: bool = setting(
        False,
        help="keep what the codec lost on the site as a residual, added to the next round's update",
    )
    qmax: ClassVar[int]
    params: ClassVar[struct.Struct] = struct.Struct("<IBf")  # block, scale dtype code, unit

    def __post_init__(self) -> None:
        b = self.block
        if not (isinstance(b, int) and MIN_BLOCK <= b <= MAX_BLOCK and b & (b - 1) == 0):
            raise ValueError(
                f"block: must be a power of two in {MIN_BLOCK}..{MAX_BLOCK}, got {b!r}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"scale_dtype: must be one of {list(SCALE_DTYPES)}, got {self.scale_dtype!r}"
            )

    @classmethod
    def _qbytes(cls, n: int) -> int:
        return n if cls.qmax == 127 else (n + 1) // 2

    def _encode(self, xf: torch.Tensor, state, name: str) -> tuple[torch.Tensor, tuple]:
        n, bsz, qmax = xf.numel(), self.block, self.qmax
        code, sdtype = SCALE_DTYPES[self.scale_dtype]
        xmax = finite_absmax(xf, name)
        x32 = xf if xf.dtype == torch.float32 else xf.float()
        r, bound = (None, 0.0) if state is None else (state.flat(), state.bound)
        refuse_overflow(xmax, bound, name)
        # Any unit >= max|x + r| / qmax works; the slack covers fp32 rounding of x + r.
        unit = _f32((xmax + bound) * (1 + 2**-20) / qmax) if code == 1 else 0.0
        nb = -(-n // bsz)
        sbytes = nb * sdtype.itemsize
        data = torch.empty(sbytes + self._qbytes(n), dtype=torch.uint8)
        stored, qdata = data[:sbytes].view(sdtype), data[sbytes:]
        per = bsz * max(1, CHUNK // bsz)
        buf = _Buffers(per, bsz)
        rmax = 0.0
        for e0, e1 in chunks(n, per):
            length, b0 = e1 - e0, e0 // bsz
            nbc = -(-length // bsz)
            v = x32[e0:e1] if r is None else r[e0:e1].add_(x32[e0:e1])
            if length == nbc * bsz:
                v2 = v.view(nbc, bsz)
            else:
                p = buf.pad[: nbc * bsz]
                p[:length].copy_(v)
                p[length:].zero_()
                v2 = p.view(nbc, bsz)
            s = self._scales(v2, stored[b0 : b0 + nbc], unit, buf, nbc)
            t = buf.tmp[: nbc * bsz].view(nbc, bsz)
            torch.div(v2, torch.where(s > 0, s, 1.0)[:, None], out=t)
            t.round_().clamp_(-qmax, qmax)
            self._store(t.view(-1), length, qdata, e0, buf)
            if r is not None:
                v.sub_(t.mul_(s[:, None]).view(-1)[:length])
                lo, hi = torch.aminmax(v)  # the chunk is still in cache
                rmax = max(rmax, -float(lo), float(hi))
        if state is not None:
            # Exact, not an upper bound: the next unit depends on it, and a restored state
            # (which measures max |r|) must encode the next round identically.
            state.bound = rmax
        return data, (bsz, code, unit)

    def _scales(self, v2, stored, unit: float, buf: _Buffers, nbc: int) -> torch.Tensor:
        """Fill ``stored`` with block scales; return the decoded fp32 scales."""
        mx, mn, ratio, s = buf.mx[:nbc], buf.mn[:nbc], buf.ratio[:nbc], buf.s[:nbc]
        torch.amax(v2, 1, out=mx)
        torch.amin(v2, 1, out=mn)
        torch.maximum(mx, mn.neg_(), out=mx)
        if stored.dtype == torch.float32:
            torch.div(mx, self.qmax, out=s)
            stored.copy_(s)
            return s
        torch.div(mx, self.qmax * unit if unit > 0 else 1.0, out=ratio)
        stored.copy_(ratio)
        s.copy_(stored)
        # Round the fp16 ratio up (next representable value) so the scale never shrinks.
        stored.view(torch.int16).add_(torch.lt(s, ratio).to(torch.int16))
        s.copy_(stored)
        return _decoded_scales(s, unit)

    def _store(self, q: torch.Tensor, length: int, qdata, e0: int, buf: _Buffers) -> None:
        if self.qmax == 127:
            qdata[e0 : e0 + length].view(torch.int8).copy_(q[:length])
            return
        npairs = (length + 1) // 2
        i8 = buf.i8[: 2 * npairs]
        i8.copy_(q[: 2 * npairs]).add_(8)
        # A little-endian int16 holds a pair as lo + 256 hi (both 1..15); its low byte after
        # w | w >> 4 is lo | hi << 4. Contiguous int16 ops beat strided byte ops by ~5x.
        w = i8.view(torch.int16)
        w2 = buf.w16[:npairs]
        torch.bitwise_right_shift(w, 4, out=w2).bitwise_or_(w)
        qdata[e0 // 2 : e0 // 2 + npairs].copy_(w2.bitwise_and_(255))

    def _size_params(self, numel: int) -> tuple:
        return self.block, SCALE_DTYPES[self.scale_dtype][0], 0.0

    @classmethod
    def data_bytes(cls, numel: int, dtype: torch.dtype, params: tuple) -> tuple[int, int]:
        bsz, code, _ = params
        n = -(-numel // bsz) * _SCALE_BY_CODE[code].itemsize + cls._qbytes(numel)
        return n, n

    @classmethod
    def _check_params(cls, h: Header, name: str) -> None:
        bsz, code, unit = h.params
        if not (MIN_BLOCK <= bsz <= MAX_BLOCK and bsz & (bsz - 1) == 0):
            raise CodecError(f"{who(name)}: codec meta has an invalid block size {bsz}")
        sdtype = _SCALE_BY_CODE.get(code)
        if sdtype is None:
            raise CodecError(f"{who(name)}: codec meta has an invalid scale dtype code {code}")
        if not (math.isfinite(unit) and unit >= 0) or (sdtype == torch.float32 and unit != 0):
            raise CodecError(f"{who(name)}: codec meta has an invalid scale unit {unit!r}")

    @classmethod
    def _decode(cls, out, data, h: Header, alpha: float, add: bool, name: str) -> None:
        bsz, code, unit = h.params
        n, sdtype = h.numel, _SCALE_BY_CODE[code]
        nb = -(-n // bsz)
        scales = typed(data, 0, nb, sdtype).float()
        if nb:
            lo, hi = (float(v) for v in torch.aminmax(scales))
            top = hi * (unit if sdtype == torch.float16 else 1.0) * cls.qmax
            # Finite and non-negative, and q * s cannot overflow fp32 (the encoder stays
            # below FLT_MAX / 2; the margin absorbs the rounding of q * s).
            if not (lo >= 0 and top <= FLT_MAX * 0.75):
                raise CodecError(f"{who(name)}: codec data holds invalid block scales")
        if out is None:
            return
        if sdtype == torch.float16:
            scales = _decoded_scales(scales, unit)
        qdata = data[nb * sdtype.itemsize :]
        per = bsz * max(1, CHUNK // bsz)
        tmp = torch.empty(min(per, nb * bsz))
        pairs = per // 2 + 1 if cls.qmax == 7 else 0
        w16, w16b = (torch.empty(pairs, dtype=torch.int16) for _ in range(2))
        for e0, e1 in chunks(n, per):
            length, b0 = e1 - e0, e0 // bsz
            nbc = -(-length // bsz)
            t = tmp[: nbc * bsz]
            if cls.qmax == 127:
                t[:length].copy_(qdata[e0:e1].view(torch.int8))
            else:
                # Byte b -> int16 (b | b << 4) & 0x0F0F: its two bytes are the nibbles in order.
                npairs = (length + 1) // 2
                w, w2 = w16[:npairs], w16b[:npairs]
                w.copy_(qdata[e0 // 2 : e0 // 2 + npairs])
                w.bitwise_or_(torch.bitwise_left_shift(w, 4, out=w2)).bitwise_and_(0x0F0F)
                t[: 2 * npairs].copy_(w.view(torch.int8)).sub_(8)
            t.view(nbc, bsz).mul_(scales[b0 : b0 + nbc, None])
            dst = out[e0:e1]
            if add:
                dst.add_(t[:length], alpha=alpha)
            else:
                dst.copy_(t[:length])


def _decoded_scales(s: torch.Tensor, unit: float) -> torch.Tensor:
    """fp16 ratios (already in fp32) to scales; encoder and decoder share this exact op."""
    return s.mul_(unit)


@dataclass(frozen=True)
class Int8Codec(_BlockQuant):
    """int8 blockwise absmax: about 4x smaller than fp32, error <= max|x_b| / 254 per block."""

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 3
    qmax: ClassVar[int] = 127


@dataclass(frozen=True)
class Int4Codec(_BlockQuant):
    """int4 blockwise absmax with error feedback: about 7.5x smaller than fp32."""

    block: int = 64
    error_feedback: bool = True
    name: ClassVar[str] = "int4"
    codec_id: ClassVar[int] = 4
    qmax: ClassVar[int] = 7
