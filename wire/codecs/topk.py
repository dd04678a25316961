"""Top-k sparsification with error feedback: send the k largest |x + r|, keep the rest in r.

Selection is exact and canonical: the ``k = ceil(fraction * numel)`` largest magnitudes, ties
broken by the lower index, zeros never sent (so at most k are sent, exactly k when the tensor has
that many non-zeros). It is computed without a full ``torch.topk``: a threshold taken from a
fixed-seed random sample of 65536 magnitudes picks a candidate set a little larger than k in one
chunked pass, then ``kthvalue`` on the candidates finds the exact cut. If the sample misjudges
(too few candidates) a lower threshold is tried; with massive ties (too many) an exact path over
the whole tensor is taken. Every path returns the same indices.

Error bound: an element not sent has ``|v_i| <= `` the smallest sent magnitude (it stays in the
residual). Values sent as ``fp32`` are exact; as ``fp16`` they are stored as ``v / g`` with ``g =
max |v|`` (fp32, in the meta), so ``|v - v'| <= 2^-11 |v| (1 + 2^-10)`` for ``|v| >= 2^-14 g`` and
``<= 2^-25 g`` below, whatever the tensor's magnitude. With error feedback ``|r_i| <= g``.

Data layout: the values (fp16 or fp32), zero padding to a multiple of 4 bytes, then the indices in
increasing order: ``int32``, or ``varint`` = LEB128 of the gaps (``idx[0]``, then ``idx[i] -
idx[i-1] - 1``), about 1.2 bytes per index at 1 % density. Decoding checks the count, that the
indices are strictly increasing and below numel, and that the values are finite. So k values
take ``ceil4(k * (2 or 4)) + 4 k`` bytes with int32 indices, and between ``ceil4(...) + k`` and
``ceil4(...) + max_varint_bytes(k, numel)`` with varint ones (``data_bytes``); k is at most
``ceil(fraction * numel)``, fewer when fewer elements are non-zero.
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
from wire.codecs.varint import max_varint_bytes, varint_decode, varint_encode
from wire.config_table import setting

VALUE_DTYPES = {"fp16": (1, torch.float16), "fp32": (2, torch.float32)}
_VALUE_BY_CODE = {code: dt for code, dt in VALUE_DTYPES.values()}
INDEX_CODES = {"int32": 1, "varint": 2}
SAMPLE = 1 << 16
DIRECT_MAX = 1 << 16  # up to this many elements the exact path is as fast
MAX_NUMEL = {1: (1 << 31) - 1, 2: 1 << 35}


def _collect(
    v: torch.Tensor, t: float, strict: bool, cap: int | None, pending: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Indices (ascending) with ``|v| > t`` (strict) or ``>= t``; None past ``cap`` of them.

    ``pending`` is first added into ``v`` chunk by chunk (all of it, even past ``cap``): the
    error-feedback ``v = r + x`` costs no pass of its own.
    """
    n = v.numel()
    tmp = torch.empty(min(n, CHUNK))
    mask = torch.empty(min(n, CHUNK), dtype=torch.bool)
    parts, total = [], 0
    compare = torch.gt if strict else torch.ge
    for e0, e1 in chunks(n, CHUNK):
        vc = v[e0:e1]
        if pending is not None:
            vc.add_(pending[e0:e1])
        if cap is not None and total > cap:
            continue
        a = torch.abs(vc, out=tmp[: e1 - e0])
        idx = compare(a, t, out=mask[: e1 - e0]).nonzero().view(-1)
        total += idx.numel()
        parts.append(idx.add_(e0))
    if cap is not None and total > cap:
        return None
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _first_equal(v: torch.Tensor, t: float, need: int) -> torch.Tensor:
    """The first ``need`` indices with ``|v| == t``, stopping as soon as they are found."""
    parts, got = [], 0
    for e0, e1 in chunks(v.numel(), CHUNK):
        idx = torch.eq(v[e0:e1].abs(), t).nonzero().view(-1)[: need - got]
        parts.append(idx.add_(e0))
        got += idx.numel()
        if got == need:
            break
    return torch.cat(parts)


def _pick(v: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |v| among ``cand`` (which holds every index at or above the k-th)."""
    c = cand.numel()
    if c <= k:
        return cand
    a = v[cand].abs()
    kth = torch.kthvalue(a, c - k + 1).values
    gt = a > kth
    eq = a == kth
    need = k - int(gt.sum())
    return cand[gt | (eq & (torch.cumsum(eq, 0) <= need))]


def _exact(v: torch.Tensor, k: int) -> torch.Tensor:
    n = v.numel()
    a = v.abs()
    nonzero = int(torch.count_nonzero(a))
    if nonzero <= k:
        return a.nonzero().view(-1)
    kth = float(torch.kthvalue(a, n - k + 1).values)
    del a
    gt = _collect(v, kth, strict=True, cap=None)
    rest = _first_equal(v, kth, k - gt.numel())
    return torch.sort(torch.cat([gt, rest])).values


def select_topk(v: torch.Tensor, k: int, pending: torch.Tensor | None = None) -> torch.Tensor:
    """Ascending indices of the k largest non-zero ``|v|`` (ties: lower index first).

    Parameters
    ----------
    v
        Flat float32 tensor.
    k
        How many to select at most.
    pending
        If given, added into ``v`` first (in the first pass): the selection is on ``v + pending``
        and ``v`` holds that sum afterwards.

    Returns
    -------
    torch.Tensor
        int64 indices, strictly increasing; ``min(k, count_nonzero(v))`` of them.
    """
    n = v.numel()
    if n > DIRECT_MAX and 0 < k <= n // 8:
        gen = torch.Generator().manual_seed(0x15A7 + n)  # fixed: encoding is deterministic
        at = torch.randint(n, (SAMPLE,), generator=gen)
        sample = (v[at] if pending is None else v[at] + pending[at]).abs_()
        expect = SAMPLE * k / n
        for z in (4.0, 16.0):
            j = int(expect + z * math.sqrt(expect) + 2)  # rank from the top in the sample
            if j >= SAMPLE:
                break
            t = float(torch.kthvalue(sample, SAMPLE - j + 1).values)
            if t <= 0:
                break
            cand = _collect(v, t, strict=False, cap=max(4 * k, k + CHUNK), pending=pending)
            pending = None
            if cand is None:
                break
            if cand.numel() >= k:
                return _pick(v, cand, k)
    if pending is not None:
        v.add_(pending)
    if k <= 0 or n == 0:
        return torch.empty(0, dtype=torch.int64)
    return _exact(v, k)


@dataclass(frozen=True)
class TopKCodec(Codec):
    """Top-k with error feedback: ``fraction`` of the elements, values fp16/fp32, indices
    int32/varint."""

    fraction: float = setting(
        0.01, help="the share of elements sent, the largest in magnitude, in (0, 1]"
    )
    values: str = setting("fp16", help=f"the values' wire dtype, one of {list(VALUE_DTYPES)}")
    indices: str = setting(
        "varint",
        help=f"how the indices travel, one of {list(INDEX_CODES)} (``varint``: the gaps between "
        "them)",
    )
    error_feedback: bool = setting(
        True,
        help="keep the elements not sent on the site as a residual, added to the next round's "
        "update",
    )
    name: ClassVar[str] = "topk"
    codec_id: ClassVar[int] = 5
    params: ClassVar[struct.Struct] = struct.Struct("<QBBf")  # k, index code, value code, g
    exact_size: ClassVar[bool] = False

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ValueError(f"fraction: must be a number in (0, 1], got {f!r}")
        if self.values not in VALUE_DTYPES:
            raise ValueError(f"values: must be one of {list(VALUE_DTYPES)}, got {self.values!r}")
        if self.indices not in INDEX_CODES:
            raise ValueError(f"indices: must be one of {list(INDEX_CODES)}, got {self.indices!r}")

    def k_for(self, n: int) -> int:
        return 0 if n == 0 else min(n, max(1, math.ceil(round(self.fraction * n, 6))))

    def _encode(self, xf: torch.Tensor, state, name: str) -> tuple[torch.Tensor, tuple]:
        n = xf.numel()
        icode = INDEX_CODES[self.indices]
        if n > MAX_NUMEL[icode]:
            raise CodecError(f"{who(name)}: {n} elements are too many for {self.indices} indices")
        xmax = finite_absmax(xf, name)
        x32 = xf if xf.dtype == torch.float32 else xf.float()
        refuse_overflow(xmax, 0.0 if state is None else state.bound, name)
        v = x32 if state is None else state.flat()
        idx = select_topk(v, self.k_for(n), None if state is None else x32)
        vals = v[idx]
        top = float(vals.abs().max()) if idx.numel() else 0.0
        vcode, vdtype = VALUE_DTYPES[self.values]
        g = top if vdtype == torch.float16 else 0.0
        stored = (vals / g).half() if g > 0 else vals.to(vdtype)
        vbytes = stored.numel() * stored.element_size()
        if icode == 1:
            index_bytes = idx.to(torch.int32).view(torch.uint8)
        else:
            gaps = idx.clone()
            gaps[1:] -= idx[:-1] + 1
            index_bytes = varint_encode(gaps)
        pad = -vbytes % 4
        data = torch.empty(vbytes + pad + index_bytes.numel(), dtype=torch.uint8)
        data[:vbytes] = stored.view(torch.uint8)
        data[vbytes : vbytes + pad] = 0
        data[vbytes + pad :] = index_bytes
        if state is not None:
            sent = _decoded_values(stored, g) if g > 0 else stored
            v.index_put_((idx,), vals.sub_(sent))
            # Exact max |r| (one reduction pass), so that a restored state behaves the same.
            state.bound = finite_absmax(v, name)
        return data, (idx.numel(), icode, vcode, g)

    def _size_params(self, numel: int) -> tuple:
        return self.k_for(numel), INDEX_CODES[self.indices], VALUE_DTYPES[self.values][0], 0.0

    @classmethod
    def data_bytes(cls, numel: int, dtype: torch.dtype, params: tuple) -> tuple[int, int]:
        k, icode, vcode, _ = params
        vbytes = k * _VALUE_BY_CODE[vcode].itemsize
        offset = vbytes + (-vbytes % 4)
        if icode == 1:
            return offset + 4 * k, offset + 4 * k
        return offset + k, offset + max_varint_bytes(k, numel)

    @classmethod
    def _layout(cls, h: Header, name: str) -> tuple[int, torch.dtype, int]:
        k, icode, vcode, g = h.params
        vdtype = _VALUE_BY_CODE.get(vcode)
        if icode not in MAX_NUMEL or vdtype is None or k > h.numel or h.numel > MAX_NUMEL[icode]:
            raise CodecError(f"{who(name)}: codec meta has invalid top-k parameters")
        fp16 = vdtype == torch.float16
        if not math.isfinite(g) or g < 0 or (g > 0) != (fp16 and k > 0):
            raise CodecError(f"{who(name)}: codec meta has an invalid top-k value scale {g!r}")
        vbytes = k * vdtype.itemsize
        return k, vdtype, vbytes + (-vbytes % 4)

    @classmethod
    def _check_params(cls, h: Header, name: str) -> None:
        cls._layout(h, name)

    @classmethod
    def _decode(cls, out, data, h: Header, alpha: float, add: bool, name: str) -> None:
        k, vdtype, offset = cls._layout(h, name)
        stored = typed(data, 0, k, vdtype)
        if k:
            lo, hi = (float(t) for t in torch.aminmax(stored.float()))
            limit = 1.0 if vdtype == torch.float16 else FLT_MAX
            if not (-limit <= lo and hi <= limit):
                raise CodecError(f"{who(name)}: top-k values are out of range or not finite")
        if h.params[1] == 1:
            idx = typed(data, offset, k, torch.int32).long()
            if k and not (
                int(idx[0]) >= 0 and int(idx[-1]) < h.numel and bool((idx[1:] > idx[:-1]).all())
            ):
                raise CodecError(f"{who(name)}: top-k indices are not increasing and in range")
        else:
            idx = varint_decode(data[offset:], k, h.numel, name)
        if out is None:
            return
        vals = _decoded_values(stored, h.params[3]) if vdtype == torch.float16 else stored.float()
        vals = vals.to(out.dtype)
        if add:
            # The picked elements through the same add as a dense tensor's (``add_`` with
            # alpha), so adding the decoded values gives the bits decoding whole then adding
            # does; ``index_add_`` rounds alpha * value on its own first. The indices are
            # strictly increasing (checked above): no element is picked twice.
            picked = out.index_select(0, idx).add_(vals, alpha=alpha)
            out.index_copy_(0, idx, picked)
        else:
            out.zero_()
            out.index_put_((idx,), vals)


def _decoded_values(stored: torch.Tensor, g: float) -> torch.Tensor:
    """fp16 values to fp32; encoder and decoder share this exact op."""
    return stored.float().mul_(g)
