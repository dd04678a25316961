"""Push mutation ops on the header (lease, round, versions, upload id, weight, manifest's
totals), and the helpers every op uses: each op alters ``msgs`` in place and returns a note."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from wire.proto import isthmus_pb2 as pb

from .cases import _short
from .constants import MAX_UPDATE_BYTES, SITE_A, SITE_B, SPEC_NAME, U64_MAX, _u64
from .strategies import DOUBLES, HUGE_TEXT, NAMES, ODD, TEXT, U64, _near

if TYPE_CHECKING:
    from .runner import Fuzzer


def _copy(m):
    out = type(m)()
    out.CopyFrom(m)
    return out


def _decode(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None


def _header(msgs: list) -> pb.PushHeader | None:
    for m in msgs:
        if m.WhichOneof("kind") == "header":
            return m.header
    return None


def _chunk_indices(msgs: list) -> list[int]:
    return [i for i, m in enumerate(msgs) if m.WhichOneof("kind") == "chunk"]


def _needs_header(fn):
    @functools.wraps(fn)
    def op(fz: Fuzzer, data, msgs):
        h = _header(msgs)
        return fn(fz, data, msgs, h) if h is not None else f"{fn.__name__}(no header left)"

    return op


def _needs_chunk(fn):
    @functools.wraps(fn)
    def op(fz: Fuzzer, data, msgs):
        idx = _chunk_indices(msgs)
        if not idx:
            return f"{fn.__name__}(no chunk left)"
        return fn(fz, data, msgs, idx)

    return op


def _needs_tensor(fn):
    @functools.wraps(fn)
    def op(fz: Fuzzer, data, msgs, h):
        if not h.manifest.tensors:
            return f"{fn.__name__}(no tensor left)"
        i = data.draw(st.integers(0, len(h.manifest.tensors) - 1))
        return fn(fz, data, h.manifest, i)

    return _needs_header(op)


@_needs_header
def lease_site(fz, data, msgs, h):
    h.lease.site = data.draw(
        NAMES | st.sampled_from([SITE_B, "", SITE_A.upper(), SITE_A + "\n", " " + SITE_A])
    )
    return f"lease_site({_short(h.lease.site)})"


@_needs_header
def lease_token(fz, data, msgs, h):
    t = h.lease.token
    choices = [t - 1, t + 1, t + 2**32, t - 2**32, 0, U64_MAX, fz.leases[SITE_B].token]
    h.lease.token = data.draw(st.sampled_from([_u64(c) for c in choices]) | U64)
    return f"lease_token({h.lease.token})"


@_needs_header
def lease_absent(fz, data, msgs, h):
    h.ClearField("lease")
    return "lease_absent"


@_needs_header
def lease_ignored_fields(fz, data, msgs, h):
    h.lease.ttl_s, h.lease.lease_id = data.draw(DOUBLES), data.draw(U64)
    return f"lease_ignored_fields(ttl_s={h.lease.ttl_s}, lease_id={h.lease.lease_id})"


@_needs_header
def lease_of_other_site(fz, data, msgs, h):
    names = [SITE_B, *sorted(fz.extras)]
    name = names[data.draw(st.integers(0, 7)) % len(names)]
    h.lease.CopyFrom(fz.leases[name] if name in fz.leases else fz.extras[name][0])
    return f"lease_of_other_site({name})"


@_needs_header
def round_number(fz, data, msgs, h):
    r = h.round
    choices = [r + 1, r - 1 if r else U64_MAX, r + 2**32, U64_MAX]
    h.round = data.draw(st.sampled_from([_u64(c) for c in choices]) | U64)
    if data.draw(st.booleans()):
        h.base_version = h.round
    return f"round({h.round}, base_version={h.base_version})"


@_needs_header
def base_version(fz, data, msgs, h):
    v = h.base_version
    choices = [v + 1, v - 1 if v else U64_MAX, U64_MAX]
    h.base_version = data.draw(st.sampled_from([_u64(c) for c in choices]) | U64)
    return f"base_version({h.base_version})"


@_needs_header
def upload_id(fz, data, msgs, h):
    base = h.upload_id
    uid = data.draw(
        st.builds(_near, st.just(base), st.sampled_from(ODD), st.integers(0, 2))
        | NAMES
        | st.sampled_from(["", "../../etc/passwd", "a" * 64, base + "+x", base + "/x"])
    )
    if SPEC_NAME.fullmatch(uid) and uid != base:
        uid = f"{uid[:50]}-{fz.report.cases + 1}"  # a valid id is kept unique to the case
    h.upload_id = uid
    return f"upload_id({_short(uid)})"


@_needs_header
def weight(fz, data, msgs, h):
    h.weight = data.draw(DOUBLES)
    return f"weight({h.weight!r})"


@_needs_header
def data_unit(fz, data, msgs, h):
    h.data_unit = data.draw(TEXT | HUGE_TEXT)
    return f"data_unit({_short(h.data_unit)})"


@_needs_header
def piece(fz, data, msgs, h):
    """The stream carries one piece of the payload (``[transfer] streams`` > 1): a valid
    range, an empty one, one past the end or one whose end overflows."""
    t = h.manifest.total_bytes
    offset = data.draw(st.sampled_from([0, 0, t // 2, t - 1, t, U64_MAX]) | st.integers(0, t) | U64)
    rest = t - offset if offset < t else 1
    length = data.draw(st.sampled_from([rest, rest, 1, 0, rest + 1, U64_MAX]) | U64)
    h.piece.offset, h.piece.length = _u64(offset), _u64(length)
    return f"piece({h.piece.offset}, {h.piece.length})"


@_needs_header
def manifest_absent(fz, data, msgs, h):
    h.ClearField("manifest")
    return "manifest_absent"


@_needs_header
def total_bytes(fz, data, msgs, h):
    t = h.manifest.total_bytes
    choices = [0, t - 1, t + 1, t + 64, MAX_UPDATE_BYTES, MAX_UPDATE_BYTES + 1, U64_MAX]
    h.manifest.total_bytes = data.draw(
        st.sampled_from([_u64(c) for c in choices]) | st.integers(0, 5000) | U64
    )
    return f"total_bytes({h.manifest.total_bytes})"


@_needs_header
def sha256(fz, data, msgs, h):
    sha = bytearray(h.manifest.digest)
    mode = data.draw(st.sampled_from(["truncate", "extend", "flip", "random", "empty"]))
    if mode == "truncate":
        sha = sha[: data.draw(st.integers(0, 31))]
    elif mode == "extend":
        sha += data.draw(st.binary(min_size=1, max_size=32))
    elif mode == "flip" and sha:
        i = data.draw(st.integers(0, len(sha) - 1))
        sha[i] ^= 1 << data.draw(st.integers(0, 7))
    elif mode == "random":
        sha = bytearray(data.draw(st.binary(min_size=32, max_size=32)))
    else:
        sha = bytearray()
    h.manifest.digest = bytes(sha)
    return f"sha256({mode}, {len(sha)} bytes)"
