"""LEB128 varints, vectorised: the delta-coded top-k indices.

Each non-negative number is cut into 7-bit groups, least significant first; every byte but a
number's last has its top bit set. Numbers are limited to 5 bytes (35 bits): a top-k gap never
exceeds the element count, which the top-k codec keeps below 2^35.
"""

from __future__ import annotations

import torch

from wire.codecs.base import CodecError, who

_SHIFTS = torch.arange(0, 35, 7)


def varint_encode(gaps: torch.Tensor) -> torch.Tensor:
    """LEB128 bytes of non-negative int64 ``gaps`` (< 2^35): all five 7-bit groups of every
    gap at once, then the groups each number needs, in order."""
    if gaps.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    groups = torch.bitwise_right_shift(gaps[:, None], _SHIFTS).bitwise_and_(127)
    nbytes = torch.ones_like(gaps)
    for bits in (7, 14, 21, 28):
        nbytes += gaps >= (1 << bits)
    pos = torch.arange(5)
    groups |= (pos < (nbytes - 1)[:, None]).long() << 7  # continuation bit on all but the last
    return groups.to(torch.uint8)[pos < nbytes[:, None]]


def max_varint_bytes(k: int, numel: int) -> int:
    """The most bytes ``k`` strictly increasing indices below ``numel`` take as LEB128 gaps.

    The gaps are at least 0 and sum to at most ``numel - k``. A gap takes one more byte per
    7-bit threshold it reaches (2^7, 2^14, ...), and reaching each further threshold costs more
    of that sum than the one before, so buying the cheapest extra bytes first (every gap to
    2^7 that the sum allows, then to 2^14, ...) is the maximum, and it is reachable.
    """
    if k <= 0:
        return 0
    budget, total, count, reached = numel - k, k, k, 0
    for bits in (7, 14, 21, 28):
        step = (1 << bits) - reached
        count = min(count, budget // step)
        total, budget, reached = total + count, budget - count * step, 1 << bits
    return total


def varint_decode(b: torch.Tensor, k: int, numel: int, name: str) -> torch.Tensor:
    """Indices from LEB128 gaps; raises unless exactly k numbers, each <= 5 bytes, all < numel."""
    term = b < 128
    ends = term.nonzero().view(-1)
    if ends.numel() != k or (k and int(ends[-1]) != b.numel() - 1):
        raise CodecError(f"{who(name)}: top-k index stream does not hold exactly {k} numbers")
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    lens = ends - starts + 1
    if int(lens.max()) > 5:
        raise CodecError(f"{who(name)}: top-k index stream holds a number longer than 5 bytes")
    gid = torch.repeat_interleave(torch.arange(k), lens)
    shift = (torch.arange(b.numel()) - starts[gid]) * 7
    gaps = torch.zeros(k, dtype=torch.int64)
    gaps.scatter_add_(0, gid, torch.bitwise_left_shift(b.long() & 127, shift))
    idx = torch.cumsum(gaps + 1, 0) - 1
    if int(idx[-1]) >= numel:
        raise CodecError(f"{who(name)}: top-k index {int(idx[-1])} out of range for {numel}")
    return idx
