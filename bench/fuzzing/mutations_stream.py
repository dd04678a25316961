"""Push mutation ops on the chunks (data, offsets, order, count) and on the stream's
structure (no header, two headers, chunks before it, empty messages), and ``OPS``: every op by
group, as the push generators draw them."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st

from wire.proto import isthmus_pb2 as pb

from .constants import U64_MAX, _u64
from .mutations_header import (
    _copy,
    _needs_chunk,
    _needs_header,
    base_version,
    data_unit,
    lease_absent,
    lease_ignored_fields,
    lease_of_other_site,
    lease_site,
    lease_token,
    manifest_absent,
    piece,
    round_number,
    sha256,
    total_bytes,
    upload_id,
    weight,
)
from .mutations_manifest import (
    relabel_dtype,
    tensor_drop,
    tensor_duplicate,
    tensor_extra,
    tensor_field,
    tensor_reorder,
    tensor_swap_names,
    tensors_clear,
    total_slack,
)
from .strategies import U64


@_needs_chunk
def flip_byte(fz, data, msgs, idx):
    idx = [i for i in idx if msgs[i].chunk.data]
    if not idx:
        return "flip_byte(no data left)"
    i = data.draw(st.sampled_from(idx))
    d = bytearray(msgs[i].chunk.data)
    pos = data.draw(st.integers(0, len(d) - 1))
    d[pos] ^= 1 << data.draw(st.integers(0, 7))
    msgs[i].chunk.data = bytes(d)
    return f"flip_byte(chunk at {msgs[i].chunk.offset}, +{pos})"


@_needs_chunk
def random_data(fz, data, msgs, idx):
    idx = [i for i in idx if msgs[i].chunk.data]
    if not idx:
        return "random_data(no data left)"
    i = data.draw(st.sampled_from(idx))
    n = len(msgs[i].chunk.data)
    msgs[i].chunk.data = data.draw(st.binary(min_size=n, max_size=n))
    return f"random_data(chunk at {msgs[i].chunk.offset})"


@_needs_chunk
def chunk_offset(fz, data, msgs, idx):
    i = data.draw(st.sampled_from(idx))
    c = msgs[i].chunk
    old = c.offset
    choices = [old + 1, old - 1, 0, old + len(c.data), 2**63, U64_MAX]
    c.offset = data.draw(st.sampled_from([_u64(c) for c in choices]) | st.integers(0, 1000) | U64)
    return f"chunk_offset({old}->{c.offset})"


@_needs_chunk
def drop_chunk(fz, data, msgs, idx):
    i = data.draw(st.sampled_from(idx))
    offset = msgs[i].chunk.offset
    del msgs[i]
    return f"drop_chunk(at {offset})"


@_needs_chunk
def duplicate_chunk(fz, data, msgs, idx):
    i = data.draw(st.sampled_from(idx))
    at = data.draw(st.integers(1, len(msgs)))
    msgs.insert(at, _copy(msgs[i]))
    return f"duplicate_chunk(at {msgs[at].chunk.offset} to position {at})"


@_needs_chunk
def swap_chunks(fz, data, msgs, idx):
    if len(idx) < 2:
        return "swap_chunks(fewer than 2)"
    i, j = data.draw(st.lists(st.sampled_from(idx), min_size=2, max_size=2, unique=True))
    msgs[i], msgs[j] = msgs[j], msgs[i]
    return f"swap_chunks({i}, {j})"


def empty_chunk(fz, data, msgs):
    at = data.draw(st.integers(1 if msgs else 0, max(len(msgs), 1)))
    offset = data.draw(st.sampled_from([0, 64]) | U64)
    msgs.insert(at, pb.PushMessage(chunk=pb.Chunk(offset=offset, data=b"")))
    return f"empty_chunk(offset {offset}, position {at})"


@_needs_chunk
def truncate_stream(fz, data, msgs, idx):
    keep = data.draw(st.integers(1, len(msgs) - 1)) if len(msgs) > 1 else 1
    del msgs[keep:]
    return f"truncate_stream(keep {keep} message(s))"


@_needs_chunk
def extend_last_chunk(fz, data, msgs, idx):
    c = msgs[idx[-1]].chunk
    c.data = c.data + data.draw(st.binary(min_size=1, max_size=64))
    return f"extend_last_chunk(to {len(c.data)} bytes)"


@_needs_chunk
def extra_chunk(fz, data, msgs, idx):
    last = msgs[idx[-1]].chunk
    offset = data.draw(st.sampled_from([_u64(last.offset + len(last.data))]) | U64)
    extra = data.draw(st.binary(min_size=1, max_size=64))
    msgs.append(pb.PushMessage(chunk=pb.Chunk(offset=offset, data=extra)))
    return f"extra_chunk(offset {offset}, {len(extra)} bytes)"


@_needs_chunk
def resplit(fz, data, msgs, idx):
    """Valid on its own: the same bytes in chunks of another size."""
    start = min(msgs[idx[0]].chunk.offset, U64_MAX - 4096)
    payload = b"".join(msgs[i].chunk.data for i in idx)
    size = data.draw(st.integers(1, 700))
    for i in reversed(idx):
        del msgs[i]
    msgs.extend(
        pb.PushMessage(chunk=pb.Chunk(offset=start + o, data=payload[o : o + size]))
        for o in range(0, len(payload), size)
    )
    return f"resplit({size})"


@_needs_header
def drop_header(fz, data, msgs, h):
    del msgs[next(i for i, m in enumerate(msgs) if m.WhichOneof("kind") == "header")]
    return "drop_header"


@_needs_header
def second_header(fz, data, msgs, h):
    other = pb.PushMessage()
    other.header.CopyFrom(h)
    if data.draw(st.booleans()):
        other.header.upload_id = h.upload_id + "b"
    at = data.draw(st.integers(1, len(msgs)))
    msgs.insert(at, other)
    return f"second_header(position {at})"


@_needs_header
def move_header(fz, data, msgs, h):
    i = next(i for i, m in enumerate(msgs) if m.WhichOneof("kind") == "header")
    m = msgs.pop(i)
    at = data.draw(st.integers(1, len(msgs))) if msgs else 0
    msgs.insert(at, m)
    return f"move_header(position {at})"


def empty_message(fz, data, msgs):
    at = data.draw(st.integers(0, len(msgs)))
    msgs.insert(at, pb.PushMessage())
    return f"empty_message(position {at})"


def only_header(fz, data, msgs):
    del msgs[1:]
    return "only_header"


def empty_stream(fz, data, msgs):
    msgs.clear()
    return "empty_stream"


def _by_name(*fns: Callable) -> dict[str, Callable]:
    return {fn.__name__: fn for fn in fns}


OPS: dict[str, dict[str, Callable]] = {
    "header": _by_name(
        lease_site,
        lease_token,
        lease_absent,
        lease_ignored_fields,
        lease_of_other_site,
        round_number,
        base_version,
        upload_id,
        weight,
        data_unit,
        piece,
        manifest_absent,
    ),
    "manifest": _by_name(
        total_bytes,
        sha256,
        tensor_field,
        tensor_drop,
        tensor_duplicate,
        tensor_extra,
        tensor_reorder,
        tensor_swap_names,
        tensors_clear,
        relabel_dtype,
        total_slack,
    ),
    "chunks": _by_name(
        flip_byte,
        random_data,
        chunk_offset,
        drop_chunk,
        duplicate_chunk,
        swap_chunks,
        empty_chunk,
        truncate_stream,
        extend_last_chunk,
        extra_chunk,
        resplit,
    ),
    "structure": _by_name(
        drop_header, second_header, move_header, empty_message, only_header, empty_stream
    ),
}
OPS["manifest"]["tensor_field2"] = tensor_field  # the richest op: drawn twice as often
