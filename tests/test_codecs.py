"""Codecs (wire/codecs): error bounds, hostile input, error feedback, state, rule selection."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from wire.codecs import (
    CODEC_NAMES,
    CODECS,
    Bf16Codec,
    CodecConfigError,
    CodecError,
    CodecRule,
    CodecState,
    CompressionConfig,
    Fp16Codec,
    Int4Codec,
    Int8Codec,
    NoneCodec,
    TensorState,
    TopKCodec,
    choose_codec,
    decode,
    decode_into,
    make_codec,
    meta_info,
    verify,
)
from wire.codecs import topk as topk_mod
from wire.codecs.base import HEADER
from wire.codecs.varint import varint_decode, varint_encode

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CODEC_SET = [
    NoneCodec(),
    Bf16Codec(),
    Fp16Codec(),
    Int8Codec(),
    Int8Codec(block=8, scale_dtype="fp32", error_feedback=True),
    Int4Codec(),
    Int4Codec(block=16, scale_dtype="fp32"),
    TopKCodec(),
    TopKCodec(fraction=0.1, values="fp32", indices="int32"),
]
IDS = [f"{c.name}-{i}" for i, c in enumerate(CODEC_SET)]


def _rand(*shape: int, scale: float = 1e-3, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _roundtrip(codec, x, state=None):
    enc = codec.encode(x, state, name="w")
    acc = torch.zeros(x.shape, dtype=torch.float32)
    decode_into(acc, enc.data, enc.meta, codec=enc.codec, name="w")
    return enc, acc


def _reference_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    a = v.abs().double().numpy()
    order = np.lexsort((np.arange(a.size), -a))[:k]  # largest first, ties: lower index
    order = order[a[order] > 0]
    return torch.from_numpy(np.sort(order))


def assert_within_bound(codec, x: torch.Tensor, enc, dec: torch.Tensor) -> None:
    """The element-wise error bound stated in each codec's docstring."""
    xf = x.reshape(-1).double()
    d = dec.reshape(-1).double()
    err = (xf - d).abs()
    if codec.name == "none":
        assert torch.equal(dec.reshape(-1), x.reshape(-1).float())
    elif codec.name in ("bf16", "fp16"):
        wire = torch.bfloat16 if codec.name == "bf16" else torch.float16
        assert torch.equal(dec.reshape(-1), x.reshape(-1).to(wire).float())
        rel, floor = (2**-8, 2**-134) if codec.name == "bf16" else (2**-11, 2**-25)
        assert bool((err <= rel * xf.abs() + floor).all())
    elif codec.name in ("int8", "int4"):
        info = meta_info(enc.meta)
        block, code, unit = info["params"]
        qmax = 127 if codec.name == "int8" else 7
        nb = -(-xf.numel() // block)
        sdtype = torch.float16 if code == 1 else torch.float32
        stored = enc.data[: nb * sdtype.itemsize].clone().view(sdtype).double()
        s = stored * unit if code == 1 else stored
        per_elem = s.repeat_interleave(block)[: xf.numel()]
        assert bool((err <= 0.5002 * per_elem).all())
        padded = torch.zeros(nb * block, dtype=torch.float64)
        padded[: xf.numel()] = xf.abs()
        amax = padded.view(nb, block).amax(1)
        slack = unit * 2**-23 if code == 1 else 0.0
        assert bool((s <= amax / qmax * (1 + 2**-9) + slack).all())
    else:
        k = codec.k_for(xf.numel())
        idx = _reference_topk(x.reshape(-1).float(), k)
        sent = torch.zeros(xf.numel(), dtype=torch.bool)
        sent[idx] = True
        assert bool((d[~sent] == 0).all())
        if idx.numel():
            assert bool((xf[~sent].abs() <= xf[sent].abs().min()).all())
            g = xf[sent].abs().max()
            if codec.values == "fp32":
                assert torch.equal(d[sent], xf[sent].float().double())
            else:
                bound = 2**-11 * (1 + 2**-10) * xf[sent].abs() + 2**-25 * g
                assert bool((err[sent] <= bound).all())


# ---- round trips within the stated bounds ---------------------------------------------------


AWKWARD = {
    "random": lambda: _rand(3001),
    "matrix": lambda: _rand(37, 41, scale=1.0, seed=3),
    "zeros": lambda: torch.zeros(1000),
    "small": lambda: _rand(513, scale=1e-30, seed=1),
    "tiny_and_large_blocks": lambda: torch.cat([_rand(64, scale=1e-12), _rand(64, scale=10.0)]),
    "empty": lambda: torch.empty(0),
    "empty_2d": lambda: torch.empty(3, 0),
    "scalar": lambda: torch.tensor(-0.375),
    "odd": lambda: _rand(7, seed=2),
    "one": lambda: torch.tensor([2.5e-3]),
    "ties": lambda: torch.tensor([1.0, -1.0, 0.5, 1.0, -0.5, 0.0] * 50),
    "bf16": lambda: _rand(1001, seed=4).to(torch.bfloat16),
    "fp16": lambda: _rand(257, seed=5).to(torch.float16),
}


@pytest.mark.parametrize("kind", list(AWKWARD))
@pytest.mark.parametrize("codec", CODEC_SET, ids=IDS)
def test_round_trip_within_bound(codec, kind):
    x = AWKWARD[kind]()
    enc, dec = _roundtrip(codec, x, TensorState())
    assert_within_bound(codec, x, enc, dec)
    verify(enc.data, enc.meta, x.numel(), codec=codec.name)
    again = decode(enc.data, enc.meta, x.shape, name="w")
    assert again.dtype == x.dtype and again.shape == x.shape
    assert torch.equal(again.float(), dec.to(x.dtype).float())


@pytest.mark.parametrize("codec", [c for c in CODEC_SET if c.name != "fp16"], ids=str)
def test_large_values_fp32_capable(codec):
    x = _rand(700, scale=1e30, seed=6)
    enc, dec = _roundtrip(codec, x)
    assert_within_bound(codec, x, enc, dec)


def test_decode_into_alpha_and_bitwise_reproducible():
    x = _rand(5000)
    base = _rand(5000, scale=1.0, seed=9)
    for codec in CODEC_SET:
        enc = codec.encode(x)
        dec = decode(enc.data, bytes(enc.meta), x.shape)
        acc = base.clone()
        decode_into(acc, bytes(enc.buffer()), enc.meta)
        # theta + dec, element by element, as any peer computes it: identical bits.
        assert torch.equal(acc, base + dec), codec
        acc = base.clone()
        decode_into(acc, enc.data, enc.meta, alpha=0.25)
        torch.testing.assert_close(acc, base + 0.25 * dec, rtol=1e-6, atol=1e-9)


def test_compression_sizes():
    x = _rand(1 << 16)
    sizes = {c.name: c.encode(x).data.numel() for c in CODEC_SET[:4]}
    assert sizes == {"none": 4 << 16, "bf16": 2 << 16, "fp16": 2 << 16, "int8": 65536 + 512}
    assert Int4Codec().encode(x).data.numel() == (1 << 15) + 2048
    enc = TopKCodec(fraction=0.01).encode(x)
    assert meta_info(enc.meta)["params"][0] == 656
    assert enc.data.numel() < 656 * 3.5


def test_encoding_is_deterministic():
    x = _rand(300_000, seed=11)
    for codec in CODEC_SET:
        a, b = codec.encode(x), codec.encode(x)
        assert torch.equal(a.data, b.data) and a.meta == b.meta


# ---- top-k selection --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: _rand(200_000, seed=12),  # sampled threshold path
        lambda: torch.randint(-3, 4, (150_000,)).float(),  # massive ties: exact path
        lambda: torch.cat([torch.zeros(199_000), _rand(1000)]),  # mostly zeros
        lambda: torch.cat([torch.zeros(100), _rand(5)]),  # fewer non-zeros than k
        lambda: _rand(2000, seed=13),
    ],
)
def test_select_topk_matches_reference(make):
    v = make()
    for k in (1, 7, v.numel() // 100, v.numel() // 10):
        assert torch.equal(topk_mod.select_topk(v, k), _reference_topk(v, k)), k


def test_select_topk_recovers_from_a_bad_sample(monkeypatch):
    monkeypatch.setattr(topk_mod, "DIRECT_MAX", 100)
    # Periodic structure the sample cannot see well; any path must give the same answer.
    v = torch.zeros(90_000)
    v[::9000] = torch.arange(1, 11).float()
    v += _rand(90_000, scale=1e-6, seed=14)
    for k in (5, 10, 900):
        assert torch.equal(topk_mod.select_topk(v, k), _reference_topk(v, k))


@pytest.mark.parametrize("n, ties", [(200_000, False), (150_000, True), (5000, False)])
def test_select_topk_adds_pending_on_the_way(n, ties):
    r = torch.randint(-2, 3, (n,)).float() if ties else _rand(n, seed=15)
    x = torch.randint(-2, 3, (n,)).float() if ties else _rand(n, seed=16)
    v = r.clone()
    idx = topk_mod.select_topk(v, n // 100, x)
    assert torch.equal(v, r + x)
    assert torch.equal(idx, _reference_topk(r + x, n // 100))


@SETTINGS
@given(st.lists(st.integers(0, (1 << 35) - 1), max_size=60))
def test_varint_round_trip(gaps):
    g = torch.tensor(gaps, dtype=torch.int64)
    b = varint_encode(g)
    idx = varint_decode(b, len(gaps), 1 << 62, "w")
    assert torch.equal(idx, torch.cumsum(g + 1, 0) - 1)


# ---- refused input ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", CODEC_SET, ids=IDS)
def test_non_finite_input_refused_state_unchanged(codec, bad):
    state = TensorState()
    codec.encode(_rand(999), state, name="layer.w")
    before = None if state.residual is None else state.residual.clone()
    x = _rand(999, seed=1)
    x[500] = bad
    with pytest.raises(CodecError, match=r"tensor 'layer\.w'.*(NaN|infinite)"):
        codec.encode(x, state, name="layer.w")
    if before is not None:
        assert torch.equal(state.residual, before)


@pytest.mark.parametrize(
    "codec, value",
    [
        (Fp16Codec(), 65520.0),
        (Bf16Codec(), 3.3962e38),
        (Int8Codec(), 2e38),
        (Int4Codec(), 2e38),
        (TopKCodec(), 2e38),
    ],
)
def test_overflow_refused_not_inf(codec, value):
    x = _rand(100)
    x[3] = -value
    with pytest.raises(CodecError, match="overflow"):
        codec.encode(x, TensorState(), name="big")
    x[3] = 65504.0 if codec.name == "fp16" else 1e37  # just inside: fine
    _, dec = _roundtrip(codec, x)
    assert bool(torch.isfinite(dec).all())


def test_residual_overflow_refused_before_mutation():
    for codec in (Int4Codec(), TopKCodec()):
        state = TensorState()
        state.load_state_dict({"residual": torch.full((64,), -2e37)})
        before = state.residual.clone()
        with pytest.raises(CodecError, match="residual"):
            codec.encode(torch.full((64,), -1.6e38), state, name="w")
        assert torch.equal(state.residual, before)


def test_non_float_and_shape_change_refused():
    with pytest.raises(CodecError, match="floating"):
        Int8Codec().encode(torch.arange(10))
    enc = NoneCodec().encode(torch.arange(10))  # raw bytes of any wire dtype
    assert torch.equal(decode(enc.data, enc.meta, (10,)), torch.arange(10))
    state = TensorState()
    Int4Codec().encode(_rand(64), state)
    with pytest.raises(CodecError, match="shape"):
        Int4Codec().encode(_rand(65), state, name="w")


# ---- corrupt, truncated and forged data ------------------------------------------------------


def _samples():
    x = _rand(2049, seed=21)
    return [(c, c.encode(x), x) for c in CODEC_SET]


SAMPLES = _samples()
SAMPLE_IDS = [f"{c.name}-{i}" for i, (c, _, _) in enumerate(SAMPLES)]


def _decode_fails(enc_data, meta, x, codec_name=None, match=None):
    acc = _rand(*x.shape, scale=1.0, seed=5)
    before = acc.clone()
    with pytest.raises(CodecError, match=match) as info:
        decode_into(acc, enc_data, meta, codec=codec_name, name="w")
    assert torch.equal(acc, before), "a failed decode changed the accumulator"
    assert "tensor 'w'" in str(info.value)
    with pytest.raises(CodecError):
        decode(enc_data, meta, x.shape, codec=codec_name, name="w")
    with pytest.raises(CodecError):
        verify(enc_data, meta, x.numel(), codec=codec_name, name="w")


@pytest.mark.parametrize("i", range(len(SAMPLES)), ids=SAMPLE_IDS)
@SETTINGS
@given(data=st.data())
def test_flipped_byte_in_data_or_meta_fails(i, data):
    _, enc, x = SAMPLES[i]
    in_meta = data.draw(st.booleans())
    blob = bytearray(enc.meta if in_meta else bytes(enc.buffer()))
    pos = data.draw(st.integers(0, len(blob) - 1))
    blob[pos] ^= data.draw(st.integers(1, 255))
    if in_meta:
        _decode_fails(enc.data, bytes(blob), x, enc.codec)
    else:
        _decode_fails(blob, enc.meta, x, enc.codec, match="CRC32|range|not finite")


@pytest.mark.parametrize("i", range(len(SAMPLES)), ids=SAMPLE_IDS)
@SETTINGS
@given(data=st.data())
def test_truncated_or_extended_data_or_meta_fails(i, data):
    _, enc, x = SAMPLES[i]
    raw = bytes(enc.buffer())
    which = data.draw(st.sampled_from(["data", "meta", "data+", "meta+"]))
    if which == "data":
        _decode_fails(raw[: data.draw(st.integers(0, len(raw) - 1))], enc.meta, x)
    elif which == "meta":
        _decode_fails(raw, enc.meta[: data.draw(st.integers(0, len(enc.meta) - 1))], x)
    elif which == "data+":
        _decode_fails(raw + data.draw(st.binary(min_size=1, max_size=9)), enc.meta, x)
    else:
        _decode_fails(raw, enc.meta + data.draw(st.binary(min_size=1, max_size=9)), x)


def test_mismatches_fail():
    (_, e8, x), (_, e4, _) = SAMPLES[3], SAMPLES[5]
    _decode_fails(e8.data, e8.meta, x, codec_name="int4", match="manifest says codec 'int4'")
    _decode_fails(e4.data, e8.meta, x, match="bytes")  # meta of another tensor
    y = Int8Codec().encode(_rand(2049, seed=99))
    _decode_fails(y.data, e8.meta, x, match="CRC32")  # same length, other tensor's bytes
    with pytest.raises(CodecError, match="elements"):
        decode_into(torch.zeros(2048), e8.data, e8.meta)
    with pytest.raises(CodecError, match="elements"):
        decode(e8.data, e8.meta, (2, 1024))
    with pytest.raises(CodecError, match="accumulator"):
        decode_into(torch.zeros(2049, dtype=torch.int64), e8.data, e8.meta)
    with pytest.raises(CodecError, match="magic"):
        _forge(e8.meta, bytes(e8.buffer()), magic=b"XX")


def _forge(meta: bytes, data: bytes, params: tuple | None = None, magic: bytes | None = None):
    """A meta with valid CRCs around ``data`` and ``params``: a peer that means harm."""
    m, ver, cid, dcode, numel, _, _ = HEADER.unpack_from(meta)
    cls = next(c for c in CODECS.values() if c.codec_id == cid)
    p = meta[HEADER.size : -4] if params is None else cls.params.pack(*params)
    head = HEADER.pack(magic or m, ver, cid, dcode, numel, len(data), zlib.crc32(data)) + p
    forged = head + struct.pack("<I", zlib.crc32(head))
    with pytest.raises(CodecError):
        verify(data, forged, numel)
    acc = torch.zeros(numel)
    decode_into(acc, data, forged, name="w")
    return acc


def test_forged_payloads_with_valid_crcs_are_refused():
    x = _rand(4000, seed=31)
    # none / fp16: NaN bits in the data.
    raw = bytearray(NoneCodec().encode(x).buffer())
    raw[0:4] = struct.pack("<f", float("nan"))
    with pytest.raises(CodecError, match="NaN"):
        _forge(NoneCodec().encode(x).meta, bytes(raw))
    e16 = Fp16Codec().encode(x)
    raw = bytearray(e16.buffer())
    raw[2:4] = b"\x00\x7c"  # fp16 +Inf
    with pytest.raises(CodecError, match="NaN or Inf"):
        _forge(e16.meta, bytes(raw))
    # int8: a negative scale, then a NaN scale, then an absurd block size.
    e8 = Int8Codec(scale_dtype="fp32").encode(x)
    raw = bytearray(e8.buffer())
    raw[0:4] = struct.pack("<f", -1.0)
    with pytest.raises(CodecError, match="scales"):
        _forge(e8.meta, bytes(raw))
    raw[0:4] = struct.pack("<f", float("nan"))
    with pytest.raises(CodecError, match="scales"):
        _forge(e8.meta, bytes(raw))
    with pytest.raises(CodecError, match="block size"):
        _forge(e8.meta, bytes(e8.buffer()), params=(3, 2, 0.0))
    with pytest.raises(CodecError, match="must be"):
        _forge(e8.meta, bytes(e8.buffer()), params=(512, 2, 0.0))
    # top-k, int32 indices: unsorted, duplicated, out of range; k larger than numel.
    codec = TopKCodec(fraction=0.01, values="fp32", indices="int32")
    ek = codec.encode(x)
    k = meta_info(ek.meta)["params"][0]
    vals = bytes(ek.buffer())[: 4 * k]
    idx = np.frombuffer(bytes(ek.buffer())[4 * k :], dtype=np.int32).copy()
    for bad in (idx[::-1], np.r_[idx[:-1], idx[-2]], np.r_[idx[:-1], 4000], np.r_[-1, idx[1:]]):
        with pytest.raises(CodecError, match="indices"):
            _forge(ek.meta, vals + bad.astype(np.int32).tobytes())
    with pytest.raises(CodecError, match="top-k parameters"):
        _forge(ek.meta, bytes(ek.buffer()), params=(4001, 1, 2, 0.0))
    # top-k, varint: an index past the end, a number that never ends, fp16 values above 1.
    ev = TopKCodec(fraction=0.01).encode(x)
    raw = bytearray(ev.buffer())
    voff = 2 * k + (-2 * k % 4)
    bad = raw[:voff] + varint_encode(torch.tensor([0] * (k - 1) + [4000])).numpy().tobytes()
    with pytest.raises(CodecError, match="out of range"):
        _forge(ev.meta, bytes(bad))
    raw[-1] |= 0x80
    with pytest.raises(CodecError, match="exactly"):
        _forge(ev.meta, bytes(raw))
    raw = bytearray(ev.buffer())
    raw[0:2] = struct.pack("<e", 1.5)
    with pytest.raises(CodecError, match="out of range"):
        _forge(ev.meta, bytes(raw))


# ---- error feedback ----------------------------------------------------------------------------

EF_CODECS = [
    Int4Codec(),
    Int8Codec(block=32, error_feedback=True),
    TopKCodec(fraction=0.05),
    TopKCodec(fraction=0.05, values="fp32", indices="int32"),
]


def _ef_run(codec, state, rounds=200, n=4096):
    g = torch.Generator().manual_seed(7)
    drift = torch.randn(n, generator=g) * 1e-3  # pseudo-gradients share a direction
    sum_true = torch.zeros(n, dtype=torch.float64)
    sum_dec = torch.zeros(n, dtype=torch.float64)
    worst_r = worst_gap = 0.0
    x_norm = 0.0
    for _ in range(rounds):
        x = drift + torch.randn(n, generator=g) * 2e-3
        x_norm = max(x_norm, float(x.norm()))
        enc = codec.encode(x, state)
        sum_true += x.double()
        sum_dec += decode(enc.data, enc.meta, (n,)).double()
        if state is not None:
            gap = sum_true - sum_dec
            # What has not been delivered yet is exactly the residual (up to fp32 rounding).
            worst_gap = max(worst_gap, float((gap - state.residual.double()).norm()))
            worst_r = max(worst_r, float(state.residual.norm()))
    rel = float((sum_true - sum_dec).norm() / sum_true.norm())
    return rel, worst_gap / x_norm, worst_r / x_norm


@pytest.mark.parametrize("codec", EF_CODECS, ids=lambda c: f"{c.name}")
def test_error_feedback_converges_with_bounded_residual(codec):
    rel, gap, residual = _ef_run(codec, TensorState())
    assert gap < 1e-5
    assert residual < (0.2 if codec.name.startswith("int") else 5.0)
    assert rel < (0.003 if codec.name.startswith("int") else 0.06)
    rel_without, _, _ = _ef_run(codec, None)
    assert rel_without > 5 * rel


def test_codec_state_save_load_continues_identically(tmp_path):
    codecs = {"a.w": Int4Codec(), "b.w": TopKCodec(fraction=0.02), "c.norm": NoneCodec()}
    shapes = {"a.w": (30, 100), "b.w": (5000,), "c.norm": (16,)}

    def run(state, rounds):
        out = []
        for t in rounds:
            for i, (name, codec) in enumerate(codecs.items()):
                enc = state.encode(name, _rand(*shapes[name], seed=100 * t + i), codec)
                out.append((bytes(enc.buffer()), enc.meta))
        return out

    state = CodecState()
    run(state, range(20))
    assert sorted(state.state_dict()) == ["a.w#residual", "b.w#residual"]
    save_file(state.state_dict(), tmp_path / "codec.safetensors")
    first = run(state, range(20, 40))
    restored = CodecState()
    restored.load_state_dict(load_file(tmp_path / "codec.safetensors"))
    assert run(restored, range(20, 40)) == first
    for key, t in state.state_dict().items():
        assert torch.equal(restored.state_dict()[key], t)


@pytest.mark.parametrize(
    "sd, match",
    [
        ({"w#residual": torch.tensor([float("nan")])}, "NaN"),
        ({"w#residual": torch.zeros(3, dtype=torch.float64)}, "float32"),
        ({"w#momentum": torch.zeros(3)}, "unknown codec state key"),
        ({"residual": torch.zeros(3)}, "not '<tensor name>#<key>'"),
    ],
)
def test_codec_state_load_refuses_bad_entries_atomically(sd, match):
    state = CodecState()
    state.encode("keep", _rand(64), Int4Codec())
    before = {k: v.clone() for k, v in state.state_dict().items()}
    with pytest.raises(CodecError, match=match):
        state.load_state_dict(sd)
    assert state.state_dict().keys() == before.keys()
    assert torch.equal(state.state_dict()["keep#residual"], before["keep#residual"])


# ---- codec choice ----------------------------------------------------------------------------

TOML = """
[compression]
default = "int8"

[[compression.rules]]
match = "*.norm*"
codec = "none"

[[compression.rules]]
match = "*.bias"
codec = "none"

[[compression.rules]]
match = "*"
min_numel = 1_000_000
codec = "topk"
fraction = 0.01

[[compression.rules]]
match = "embed.*"
max_numel = 999_999
codec = "int4"
block = 128
scale_dtype = "fp32"
"""


def test_choose_codec_by_rules():
    import tomllib

    cfg = CompressionConfig.from_dict(tomllib.loads(TOML)["compression"])
    assert choose_codec("layers.0.norm1.weight", torch.zeros(4096), cfg) == NoneCodec()
    assert choose_codec("layers.0.attn.bias", (4096,), cfg) == NoneCodec()
    assert choose_codec("layers.0.mlp.w", (2048, 2048), cfg) == TopKCodec(fraction=0.01)
    assert choose_codec("embed.weight", (1000, 64), cfg) == Int4Codec(block=128, scale_dtype="fp32")
    assert choose_codec("layers.0.mlp.w", (100, 100), cfg) == Int8Codec()
    assert choose_codec("step", torch.zeros(3, dtype=torch.int64), cfg) == NoneCodec()
    rules = [CodecRule(Fp16Codec(), match="x", min_numel=5, max_numel=10)]
    assert choose_codec("x", (10,), rules) == Fp16Codec()
    assert choose_codec("x", (11,), rules) == NoneCodec()
    assert choose_codec("X", (10,), rules) == NoneCodec()  # case-sensitive
    assert CompressionConfig.from_dict({}) == CompressionConfig()
    assert set(CODEC_NAMES) == {"none", "bf16", "fp16", "int8", "int4", "topk"}


@pytest.mark.parametrize(
    "data, match",
    [
        ({"defualt": "int8"}, r"compression\.defualt: unknown key"),
        ({"default": "zstd"}, r"compression\.default\.codec: unknown codec 'zstd'"),
        ({"default": {"codec": "int8", "scale_dtype": "fp8"}}, r"default\.scale_dtype: must be"),
        ({"rules": {"codec": "none"}}, r"compression\.rules: expected an array"),
        ({"rules": [{"match": "*"}]}, r"rules\[0\]\.codec: missing"),
        ({"rules": [{"codec": "topk", "fraction": 2.0}]}, r"rules\[0\]\.fraction: must be"),
        ({"rules": [{"codec": "topk", "fractoin": 0.1}]}, r"rules\[0\]\.fractoin: unknown key"),
        ({"rules": [{"codec": "none", "block": 8}]}, r"rules\[0\]\.block: unknown key"),
        ({"rules": [{"codec": "int8", "block": True}]}, r"rules\[0\]\.block: expected int"),
        ({"rules": [{"codec": "int8", "block": 100}]}, r"rules\[0\]\.block: must be a power"),
        ({"rules": [{"codec": "int4", "error_feedback": 1}]}, r"error_feedback: expected bool"),
        ({"rules": [{"codec": "none", "min_numel": -1}]}, r"rules\[0\]\.min_numel: expected"),
        (
            {"rules": [{"codec": "none"}, {"codec": "none", "min_numel": 9, "max_numel": 5}]},
            r"rules\[1\]\.max_numel: must be >= min_numel",
        ),
        ({"rules": [{"codec": "none", "match": ""}]}, r"rules\[0\]\.match: expected"),
    ],
)
def test_compression_config_errors_name_the_key(data, match):
    with pytest.raises(CodecConfigError, match=match):
        CompressionConfig.from_dict(data)


def test_make_codec():
    assert make_codec("topk", fraction=0.1) == TopKCodec(fraction=0.1)
    with pytest.raises(ValueError, match="blk: unknown parameter for codec 'int8'"):
        make_codec("int8", blk=3)
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        make_codec("lz4")
