"""Hypothesis strategies for hostile field values: integers at the edges of their types, odd
doubles, unicode, huge and almost-valid names, chunk sizes and unknown protobuf fields."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from .constants import U64_MAX

CHARS = st.characters(exclude_categories=("Cs",))  # protobuf strings are valid UTF-8
U64 = st.one_of(
    st.sampled_from([0, 1, 2, 63, 64, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX]),
    st.integers(0, U64_MAX),
)
U32 = st.one_of(st.sampled_from([0, 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
I64 = st.one_of(
    st.sampled_from([0, 1, -1, 8, 16, 128, 2**31, -(2**63), 2**63 - 1]),
    st.integers(-(2**63), 2**63 - 1),
)
DOUBLES = st.one_of(
    st.sampled_from(
        [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324, -5e-324, -1.0, 1.0]
        + [1e15, 1e15 * (1 + 2**-50), 1e300, 1.7976931348623157e308]
    ),
    st.floats(),
)
TEXT = st.text(CHARS, max_size=40)
HUGE_TEXT = st.builds(
    lambda piece, n: piece * n,
    st.text(CHARS, min_size=1, max_size=3),
    st.sampled_from([100, 2_000, 20_000, 100_000]),
)
VALID_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True)
ODD = [
    "\n", "\r", "\r\n", " ", "\t", "\x00", "/", "\\", "+", "..", "é", "\u200b", "\uff10",
    "\U0001f600", ":", "%", "*", "\x7f", "\u0130", "\u212a",
]  # fmt: skip


def _near(name: str, odd: str, where: int) -> str:
    """``name`` with one forbidden character (or several) at its start, end or middle."""
    if where == 0:
        return odd + name
    if where == 1:
        return name + odd
    mid = len(name) // 2
    return name[:mid] + odd + name[mid:]


NEAR_VALID = st.one_of(
    st.builds(_near, VALID_NAME, st.sampled_from(ODD), st.integers(0, 2)),
    st.sampled_from(["", "-a", ".a", "_a", "a" * 64, "..", ".", "a/../b", "A" * 63 + "\n"]),
)
NAMES = st.one_of(VALID_NAME, NEAR_VALID, NEAR_VALID, TEXT, HUGE_TEXT)
CHUNK_SIZES = st.sampled_from([64, 64, 64, 128, 128, 256, 600, 1000, 100, 17, 1])
VALUE_SCALES = st.sampled_from([0.0, 1e-3, 1.0, 100.0])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@st.composite
def unknown_fields(draw) -> bytes:
    """Well-formed protobuf fields with numbers the schema does not use (and some it does)."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        number = draw(st.one_of(st.integers(1, 20), st.integers(21, 2**29 - 1)))
        wire_type = draw(st.sampled_from([0, 1, 2, 5]))
        out += _varint(number << 3 | wire_type)
        if wire_type == 0:
            out += _varint(draw(st.integers(0, U64_MAX)))
        elif wire_type == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wire_type == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        else:
            payload = draw(st.binary(max_size=40))
            out += _varint(len(payload)) + payload
    return bytes(out)
