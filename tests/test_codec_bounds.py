"""How many data bytes each codec writes: ``Codec.max_encoded_bytes`` against real encodes, and
``data_bounds`` (what a receiver holds a manifest entry to) against the same encodes."""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.codecs import (
    Bf16Codec,
    CodecState,
    Fp16Codec,
    Int4Codec,
    Int8Codec,
    NoneCodec,
    TopKCodec,
    data_bounds,
)
from wire.codecs.base import HEADER
from wire.codecs.varint import max_varint_bytes, varint_decode, varint_encode
from wire.tensors import Manifest, PayloadError, TensorEntry, validate_manifest

CODECS = [
    NoneCodec(),
    Bf16Codec(),
    Fp16Codec(),
    Int8Codec(),
    Int8Codec(block=8, scale_dtype="fp32"),
    Int8Codec(block=1 << 16),
    Int4Codec(),
    Int4Codec(block=16, scale_dtype="fp32"),
    TopKCodec(),
    TopKCodec(fraction=0.1, values="fp32", indices="int32"),
    TopKCodec(fraction=1.0, values="fp32", indices="varint"),
    TopKCodec(fraction=0.5, values="fp16", indices="int32"),
]
IDS = [f"{c.name}-{i}" for i, c in enumerate(CODECS)]
SHAPES = [(), (1,), (7,), (64,), (257,), (3, 0), (16, 8), (37, 41), (5, 3, 129)]
SOURCE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10 ** (seed % 7 - 3)).to(dtype)


@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=str)
@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_real_encodes_stay_within_the_bound_and_exact_codecs_meet_it(codec, dtype):
    for seed, shape in enumerate(SHAPES):
        x = _random(shape, dtype, seed)
        state = CodecState() if codec.error_feedback else None
        enc = state.encode("w", x, codec) if state else codec.encode(x, name="w")
        size, bound = enc.data.numel(), codec.max_encoded_bytes(shape, dtype)
        assert size <= bound, (shape, size, bound)
        if codec.exact_size:
            assert size == bound, (shape, size, bound)
        fewest, most = data_bounds(enc.meta)
        assert fewest <= size <= most, (shape, fewest, size, most)
        assert most <= bound  # the meta's own k can only be smaller than fraction * numel


@pytest.mark.parametrize("codec", [c for c in CODECS if c.name == "topk"], ids=str)
def test_topk_bound_holds_for_sparse_and_tied_input(codec):
    for n in (1, 100, 4096, 70_000):
        x = torch.zeros(n)
        x[:: max(1, n // 7)] = 1.0  # a few non-zeros, all tied; far apart (long varint gaps)
        enc = codec.encode(x, name="w")
        assert enc.data.numel() <= codec.max_encoded_bytes((n,))
        fewest, most = data_bounds(enc.meta)
        assert fewest <= enc.data.numel() <= most


def _varint_len(g: int) -> int:
    return 1 + sum(g >= 1 << b for b in (7, 14, 21, 28))


def _enumerated_max(k: int, n: int) -> int:
    """Every assignment of byte lengths to k gaps, the cheapest gaps that have them, summed."""
    least_gap = {1: 0, 2: 1 << 7, 3: 1 << 14, 4: 1 << 21, 5: 1 << 28}
    best = 0
    for lens in itertools.product(range(1, 6), repeat=k):
        if sum(least_gap[j] for j in lens) <= n - k:
            best = max(best, sum(lens))
    return best


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("n", [3, 130, 131, 257, 300, 16_390, 16_600, 40_000, (1 << 21) + 5])
def test_varint_bound_is_the_maximum_and_is_reached(k, n):
    bound = max_varint_bytes(k, n)
    assert bound == _enumerated_max(k, n)
    # Reached: the gaps the bound buys, as real indices, encode to exactly that many bytes.
    budget, gaps, prev = n - k, [0] * k, 0
    for least in (1 << 7, 1 << 14, 1 << 21, 1 << 28):
        for i in range(k):
            if gaps[i] == prev and least - prev <= budget:
                budget, gaps[i] = budget - (least - prev), least
        prev = least
    data = varint_encode(torch.tensor(gaps, dtype=torch.int64))
    assert data.numel() == sum(_varint_len(g) for g in gaps) == bound
    idx = varint_decode(data, k, n, "w")
    assert int(idx[-1]) < n


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300_000), st.data())
def test_varint_bound_holds_for_any_index_set(n, data):
    k = data.draw(st.integers(1, min(n, 40)))
    idx = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=k, max_size=k)))
    gaps = torch.tensor([idx[0]] + [b - a - 1 for a, b in zip(idx, idx[1:], strict=False)])
    assert varint_encode(gaps).numel() <= max_varint_bytes(k, n)


def test_bounds_follow_the_stated_formulas():
    """The sizes the codec docstrings state, for one odd element count."""
    n, shape = 1001, (7, 11, 13)
    assert NoneCodec().max_encoded_bytes(shape, torch.float64) == 8 * n
    assert Bf16Codec().max_encoded_bytes(shape) == 2 * n
    assert Int8Codec(block=64).max_encoded_bytes(shape) == math.ceil(n / 64) * 2 + n
    assert Int4Codec(block=16, scale_dtype="fp32").max_encoded_bytes(shape) == (
        math.ceil(n / 16) * 4 + math.ceil(n / 2)
    )
    k = math.ceil(0.01 * n)
    vbytes = -(-2 * k // 4) * 4
    assert TopKCodec().max_encoded_bytes(shape) == vbytes + max_varint_bytes(k, n)
    assert TopKCodec(values="fp32", indices="int32").max_encoded_bytes(shape) == 8 * k


def _entry_claiming(entry: TensorEntry, nbytes: int) -> Manifest:
    """A one-tensor manifest whose entry and meta both claim ``nbytes`` (meta CRC redone)."""
    fields = list(HEADER.unpack_from(entry.codec_meta))
    fields[5] = nbytes
    head = HEADER.pack(*fields) + entry.codec_meta[HEADER.size : -4]
    meta = head + struct.pack("<I", zlib.crc32(head))
    return Manifest((replace(entry, nbytes=nbytes, codec_meta=meta),), nbytes, b"\0" * 32)


@pytest.mark.parametrize("codec", [c for c in CODECS if c.name != "none"], ids=str)
def test_a_manifest_entry_is_held_to_its_codec_bounds(codec):
    shape = (300, 70)  # 21000 elements: top-k's varint indices have room to vary
    x = _random(shape, torch.float32, 5)
    enc = CodecState().encode("w", x, codec)
    entry = TensorEntry("w", "float32", shape, 0, enc.data.numel(), enc.codec, enc.meta)
    validate_manifest(Manifest((entry,), entry.nbytes, b"\0" * 32))
    fewest, most = data_bounds(enc.meta)
    for claimed in (most + 1, fewest - 1, 64 << 20):
        with pytest.raises(PayloadError) as err:
            validate_manifest(_entry_claiming(entry, claimed))
        message = str(err.value)
        assert f"'w' (codec {codec.name!r}): {claimed} bytes claimed" in message, message
        assert str(most) in message and str(fewest) in message, message
    validate_manifest(_entry_claiming(entry, most))  # the bound itself is a valid claim
