"""Tensor manifests (wire/tensors.py) and chunked transfer (wire/chunking.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.chunking import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    iter_chunks,
)
from wire.digest import payload_digest, state_digest
from wire.tensors import (
    ALIGN,
    Manifest,
    PayloadError,
    pack,
    unpack,
    validate_manifest,
)


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "f32": torch.randn(3, 7, generator=g),
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(11, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (2, 3, 5), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(-2.5),
        "empty": torch.empty(0, 4),
        "odd_u8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "after_odd": torch.randn(3, generator=g, dtype=torch.float64),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        # Bitwise: compare the raw bytes, so that -0.0 / NaN payloads would also be caught.
        assert torch.equal(
            a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)
        )


# ---- pack / unpack ------------------------------------------------------------------------


def test_pack_unpack_round_trip_exact():
    tensors = _sample_tensors()
    manifest, payload = pack(tensors)
    assert manifest.total_bytes == len(payload)
    assert manifest.digest == payload_digest(bytes(payload))
    for e in manifest.entries:
        assert e.offset % ALIGN == 0
    _assert_same(tensors, unpack(manifest, bytes(payload)))
    _assert_same(tensors, unpack(manifest, payload))


def test_pack_layout_and_nbytes():
    tensors = {"a": torch.zeros(3, dtype=torch.float16), "b": torch.zeros((), dtype=torch.int64)}
    manifest, _ = pack(tensors)
    a, b = manifest.entries
    assert (a.name, a.dtype, a.shape, a.offset, a.nbytes) == ("a", "float16", (3,), 0, 6)
    assert (b.name, b.dtype, b.shape, b.offset, b.nbytes) == ("b", "int64", (), 64, 8)
    assert manifest.total_bytes == 72


def test_pack_non_contiguous_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "s": base[:, ::2]}
    manifest, payload = pack(tensors)
    out = unpack(manifest, bytes(payload))
    assert torch.equal(out["t"], base.t())
    assert torch.equal(out["s"], base[:, ::2])


def test_pack_empty_state_and_only_empty_tensors():
    manifest, payload = pack({})
    assert manifest.total_bytes == 0 and len(payload) == 0
    assert unpack(manifest, b"") == {}
    manifest, payload = pack({"e": torch.empty(0, 3, dtype=torch.bfloat16)})
    out = unpack(manifest, bytes(payload))
    assert out["e"].shape == (0, 3) and out["e"].dtype == torch.bfloat16


def test_unpack_rejects_wrong_payload_length():
    manifest, payload = pack({"a": torch.ones(4)})
    with pytest.raises(PayloadError, match="payload has 15 bytes"):
        unpack(manifest, bytes(payload)[:-1])


def test_unpack_does_not_write_through_to_readonly_payload():
    manifest, payload = pack({"a": torch.ones(4)})
    frozen = bytes(payload)
    out = unpack(manifest, frozen)
    out["a"].add_(1)
    assert frozen == bytes(payload)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8]


@st.composite
def _states(draw):
    n = draw(st.integers(0, 5))
    out = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(_DTYPES))
        seed = draw(st.integers(0, 2**31 - 1))
        g = torch.Generator().manual_seed(seed)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g).to(dtype)
        else:
            t = torch.randint(0, 100, shape, generator=g).to(dtype)
        out[f"t{i}.{draw(st.text('abcxyz._', max_size=6))}"] = t
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_states())
def test_pack_unpack_property(tensors):
    manifest, payload = pack(tensors)
    validate_manifest(manifest)
    again = Manifest.from_proto(manifest.to_proto())
    assert again == manifest
    _assert_same(tensors, unpack(again, bytes(payload)))


# ---- manifests ----------------------------------------------------------------------------


def test_manifest_proto_round_trip():
    manifest, _ = pack(_sample_tensors())
    msg = manifest.to_proto()
    wire_bytes = msg.SerializeToString()
    parsed = type(msg).FromString(wire_bytes)
    again = Manifest.from_proto(parsed)
    assert again == manifest
    assert again.by_name()["bf16"].dtype == "bfloat16"
    assert again.by_name()["scalar"].shape == ()


def test_from_proto_enforces_size_limit():
    manifest, _ = pack({"a": torch.ones(100)})
    with pytest.raises(PayloadError, match="exceeds the limit"):
        Manifest.from_proto(manifest.to_proto(), max_total_bytes=100)


def _good_manifest() -> Manifest:
    manifest, _ = pack({"a": torch.ones(2, 3), "b": torch.ones(5, dtype=torch.int64)})
    return manifest


def _with_entry(manifest: Manifest, i: int, **changes) -> Manifest:
    entries = list(manifest.entries)
    entries[i] = replace(entries[i], **changes)
    return replace(manifest, entries=tuple(entries))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: _with_entry(m, 0, dtype="complex64"), "unknown dtype 'complex64'"),
        (lambda m: _with_entry(m, 1, codec="zstd"), "unknown codec 'zstd'"),
        (lambda m: _with_entry(m, 1, offset=16), "'b' overlaps"),
        (lambda m: _with_entry(m, 1, offset=m.total_bytes), "past the payload"),
        (lambda m: replace(m, total_bytes=m.total_bytes - 1), "past the payload"),
        (lambda m: _with_entry(m, 0, nbytes=20), "do not hold shape"),
        (lambda m: _with_entry(m, 0, shape=(3, 3)), "do not hold shape"),
        (lambda m: _with_entry(m, 0, shape=(-2, -3)), "invalid shape"),
        (lambda m: _with_entry(m, 1, name="a"), "appears twice"),
        (lambda m: _with_entry(m, 0, name=""), "empty, too long or unprintable"),
        (lambda m: _with_entry(m, 0, name="a\nb"), "unprintable"),
        (lambda m: replace(m, digest=b"\0" * 31), "digest must be 32 bytes"),
        (lambda m: replace(m, digest=b"\0" * 33), "digest must be 32 bytes"),
        (lambda m: replace(m, total_bytes=-1), "negative"),
        (lambda m: replace(m, total_bytes=m.total_bytes + 1), "nothing may follow the last"),
        (lambda m: replace(m, entries=(), total_bytes=64), "end at byte 0 .no tensors"),
        (
            lambda m: replace(_with_entry(m, 1, offset=128), total_bytes=168),
            "'b' .codec 'none'. starts at byte 128, 104 bytes after .* by byte 64",
        ),
    ],
)
def test_validate_manifest_refuses(mutate, message):
    good = _good_manifest()
    validate_manifest(good)
    bad = mutate(good)
    with pytest.raises(PayloadError, match=message):
        validate_manifest(bad)
    if bad.total_bytes >= 0:  # (a negative size cannot even be encoded: uint64)
        # A peer's manifest goes through the same checks.
        with pytest.raises(PayloadError, match=message):
            Manifest.from_proto(bad.to_proto())


def test_validate_accepts_empty_tensor_sharing_an_offset_in_any_order():
    # pack puts a 0-byte tensor at the offset where the next tensor starts; a peer may list
    # the entries in another order.
    manifest, payload = pack({"e": torch.empty(0), "x": torch.ones(3)})
    assert manifest.entries[0].offset == manifest.entries[1].offset
    swapped = replace(manifest, entries=tuple(reversed(manifest.entries)))
    validate_manifest(swapped)
    out = unpack(swapped, bytes(payload))
    assert torch.equal(out["x"], torch.ones(3)) and out["e"].numel() == 0


def test_validate_accepts_back_to_back_and_aligned_layouts():
    # pack aligns each start to 64 bytes; safetensors files lay tensors end to end.
    aligned = _good_manifest()
    assert aligned.entries[1].offset == 64
    validate_manifest(aligned)
    packed = replace(_with_entry(aligned, 1, offset=24), total_bytes=64)
    validate_manifest(packed)


def test_unpack_validates_hostile_manifest_before_reading():
    manifest, payload = pack({"a": torch.ones(4)})
    hostile = _with_entry(manifest, 0, shape=(1000,), nbytes=4000)
    with pytest.raises(PayloadError):
        unpack(hostile, bytes(payload))


# ---- state_hash ---------------------------------------------------------------------------


def test_state_hash_equal_for_equal_states():
    a = _sample_tensors()
    b = {k: v.clone() for k, v in reversed(list(a.items()))}
    assert state_digest(a) == state_digest(b)
    assert len(state_digest(a)) == 32


def test_state_hash_changes_with_one_element_dtype_shape_or_name():
    base = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.zeros(4)}
    h = state_digest(base)
    one = {k: v.clone() for k, v in base.items()}
    one["w"][2, 3] = torch.nextafter(one["w"][2, 3], torch.tensor(1e9))
    assert state_digest(one) != h
    assert state_digest({**base, "b": torch.zeros(4, dtype=torch.float64)}) != h
    assert state_digest({**base, "b": torch.zeros(4, dtype=torch.int32)}) != h  # same bytes
    assert state_digest({**base, "w": base["w"].reshape(4, 3)}) != h
    assert state_digest({"w": base["w"], "c": base["b"]}) != h
    neg = {**base, "b": -base["b"]}  # -0.0 differs bitwise from 0.0
    assert state_digest(neg) != h


# ---- chunking -----------------------------------------------------------------------------

CHUNK = MIN_CHUNK_BYTES


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes(
        torch.randint(
            0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
        ).numpy()
    )


def test_iter_chunks_cover_payload_in_order():
    payload = _payload(3 * CHUNK + 12345)
    chunks = list(iter_chunks(payload, CHUNK))
    assert [o for o, _ in chunks] == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert all(len(d) == CHUNK for _, d in chunks[:-1]) and len(chunks[-1][1]) == 12345
    assert b"".join(bytes(d) for _, d in chunks) == payload
    assert list(iter_chunks(b"", CHUNK)) == []


def test_iter_chunks_refuses_bad_sizes_and_offsets():
    with pytest.raises(ValueError, match="chunk size"):
        list(iter_chunks(b"abc", MIN_CHUNK_BYTES - 1))
    with pytest.raises(ValueError, match="chunk size"):
        list(iter_chunks(b"abc", MAX_CHUNK_BYTES + 1))
    with pytest.raises(ValueError, match="resume offset"):
        list(iter_chunks(b"abc", CHUNK, start=4))
