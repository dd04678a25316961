"""Push mutation ops on the manifest's tensor entries: a field altered, an entry dropped,
duplicated, added, reordered or renamed, every dtype relabelled, bytes claimed that no tensor
needs (after the last one or before one)."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from wire.digest import payload_digest
from wire.proto import isthmus_pb2 as pb

from .cases import _short
from .constants import MAX_UPDATE_BYTES, U64_MAX, UPDATE_ITEMSIZE, WIRE_DTYPES, _i64, _u64
from .mutations_header import _chunk_indices, _copy, _needs_header, _needs_tensor
from .strategies import I64, TEXT, U64


@_needs_tensor
def tensor_field(fz, data, m, i):
    t = m.tensors[i]
    what = data.draw(
        st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "codec", "codec_meta"])
    )
    if what == "name":
        t.name = data.draw(
            st.sampled_from(
                ["lin.bias", "lin.weight", "seen", "lin", "lin.bias ", "lin.bias\x00", "LIN.BIAS"]
                + ["lin.weight.x", "", "\u200blin.bias", "lin\nbias"]
            )
            | TEXT
        )
        value = _short(t.name)
    elif what == "dtype":
        t.dtype = data.draw(
            st.sampled_from(
                [*WIRE_DTYPES, "float", "torch.float32", "Float32", "float32 ", "complex64"]
                + ["float8_e4m3fn", "", "uint16", "float32\x00"]
            )
            | TEXT
        )
        value = _short(t.dtype)
    elif what == "shape":
        shape = list(t.shape)
        new = data.draw(
            st.sampled_from(
                [shape[::-1], [*shape, 1], [1, *shape], [math.prod(shape)], [], [-s for s in shape]]
                + [[0, *shape], [2**31, 2**31], [2**62, 4], [-1, -1]]
            )
            | st.lists(st.sampled_from([16, 8, 1, 0, -1, -16, 128, 2**31, 2**62]) | I64, max_size=6)
        )
        new = [_i64(d) for d in new]
        del t.shape[:]
        t.shape.extend(new)
        value = str(new)
    elif what in ("offset", "nbytes"):
        v = getattr(t, what)
        choices = [0, v + 1, v - 1, v + 4, v * 2, m.total_bytes, 2**63, U64_MAX]
        new = data.draw(st.sampled_from([_u64(c) for c in choices]) | st.integers(0, 5000) | U64)
        setattr(t, what, new)
        value = str(new)
    elif what == "codec":
        t.codec = data.draw(
            st.sampled_from(["", "None", "NONE", "none ", "zstd", "int8", "topk", "none\x00"])
            | TEXT
        )
        value = _short(t.codec)
    else:
        t.codec_meta = data.draw(st.binary(max_size=64))
        value = f"{len(t.codec_meta)} bytes"
    return f"tensor_field({t.name[:20]!r}.{what}={value})"


@_needs_tensor
def tensor_drop(fz, data, m, i):
    name = m.tensors[i].name
    del m.tensors[i]
    return f"tensor_drop({name})"


@_needs_tensor
def tensor_duplicate(fz, data, m, i):
    t = m.tensors.add()
    t.CopyFrom(m.tensors[i])
    if data.draw(st.booleans()):
        t.offset = m.total_bytes
        m.total_bytes = _u64(m.total_bytes + t.nbytes)
    return f"tensor_duplicate({t.name})"


@_needs_header
def tensor_extra(fz, data, msgs, h):
    m = h.manifest
    name = data.draw(st.sampled_from(["seen", "lin.extra", "lin.bias.grad", "seen "]) | TEXT)
    dtype = data.draw(st.sampled_from(["float32", "int64"]))
    n = 3 * (4 if dtype == "float32" else 8)
    offset = _u64((m.total_bytes + 63) // 64 * 64)
    m.tensors.add(name=name, dtype=dtype, shape=[3], codec="none", offset=offset, nbytes=n)
    if data.draw(st.booleans()):
        m.total_bytes = _u64(offset + n)
    return f"tensor_extra({_short(name)}, {dtype})"


@_needs_header
def tensor_reorder(fz, data, msgs, h):
    entries = [_copy(t) for t in h.manifest.tensors][::-1]
    del h.manifest.tensors[:]
    h.manifest.tensors.extend(entries)
    return "tensor_reorder"


@_needs_header
def tensor_swap_names(fz, data, msgs, h):
    ts = h.manifest.tensors
    if len(ts) < 2:
        return "tensor_swap_names(fewer than 2)"
    ts[0].name, ts[1].name = ts[1].name, ts[0].name
    return "tensor_swap_names"


@_needs_header
def tensors_clear(fz, data, msgs, h):
    del h.manifest.tensors[:]
    return "tensors_clear"


@_needs_header
def relabel_dtype(fz, data, msgs, h):
    """Every tensor labelled with another update dtype, nbytes made consistent: the bytes
    sent are the old dtype's (a manifest that lies about the payload)."""
    dtype = data.draw(st.sampled_from(sorted(UPDATE_ITEMSIZE)))
    for t in h.manifest.tensors:
        t.dtype = dtype
        t.nbytes = _u64(math.prod(t.shape) * UPDATE_ITEMSIZE[dtype])
    return f"relabel_dtype({dtype})"


@_needs_header
def total_slack(fz, data, msgs, h):
    """``extra`` zero bytes after the last tensor or before the last-placed one, under the
    size limit, sent in full with the SHA-256 recomputed: nothing but the rule that a payload
    holds its tensors and their alignment padding only refuses it."""
    m = h.manifest
    where = data.draw(st.sampled_from(["after", "before"]))
    room = max(1, MAX_UPDATE_BYTES - m.total_bytes)
    extra = data.draw(st.sampled_from([1, 63, 64, 65, room]) | st.integers(1, room))
    idx = _chunk_indices(msgs)
    payload = bytearray(b"".join(msgs[i].chunk.data for i in idx))
    if where == "before" and m.tensors:
        t = max(m.tensors, key=lambda t: t.offset)
        payload[t.offset : t.offset] = bytes(extra)
        t.offset = _u64(t.offset + extra)
    else:
        payload += bytes(extra)
    m.total_bytes = _u64(m.total_bytes + extra)
    m.digest = payload_digest(payload)
    size = max((len(msgs[i].chunk.data) for i in idx), default=0) or 512
    at = idx[0] if idx else len(msgs)
    for i in reversed(idx):
        del msgs[i]
    msgs[at:at] = [
        pb.PushMessage(chunk=pb.Chunk(offset=o, data=bytes(payload[o : o + size])))
        for o in range(0, len(payload), size)
    ]
    return f"total_slack({where}, +{extra})"
