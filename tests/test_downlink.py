"""The compressed downlink in-process: bit-identical application, error feedback, bad payloads,
and the coordinator's downlink state across a checkpoint."""

from __future__ import annotations

import pytest
import torch

from coordinator.round.downlink import Downlink
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.digest import state_digest
from wire.downlink import apply_delta, differing, encode_delta
from wire.tensors import Manifest, PayloadError


def _theta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "steps": torch.arange(3),
        "empty": torch.zeros(0),
    }


def _step(theta: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + r)
    return {
        k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype)
        if v.is_floating_point()
        else v + 1
        for k, v in theta.items()
    }


CODECS = {
    "none": {"default": "none"},
    "int8": {"default": "int8"},
    "int4": {"default": "int4"},
    "topk": {"default": {"codec": "topk", "fraction": 0.05}},
}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_party_rebuilds_the_same_bits(codec):
    old, new = _theta(), _step(_theta(), 0)
    manifest, payload = encode_delta(
        old, new, CompressionConfig.from_dict(CODECS[codec]), CodecState()
    )
    coordinator = apply_delta(old, manifest, payload)
    site = apply_delta({k: v.clone() for k, v in old.items()}, manifest, bytes(payload))
    assert state_digest(coordinator) == state_digest(site)
    assert torch.equal(coordinator["steps"], new["steps"])  # integer tensors travel whole
    assert coordinator["b"].dtype == torch.bfloat16
    if codec == "none":
        assert differing(coordinator, new) == []  # fp32 delta of fp32 values: exact here
    else:
        assert len(payload) < sum(t.numel() * 4 for t in new.values())


@pytest.mark.parametrize("codec", ["int4", "topk"])
def test_error_feedback_keeps_the_official_theta_near_the_strategys(codec):
    cfg = CompressionConfig.from_dict(CODECS[codec])
    state, official = CodecState(), _theta()
    target = {k: v.clone() for k, v in official.items()}
    for r in range(40):
        target_step = {k: _step(official, r)[k] - official[k] for k in ("w",)}
        new = {**official, "w": official["w"] + target_step["w"]}
        target["w"] = target["w"] + target_step["w"]
        manifest, payload = encode_delta(official, new, cfg, state)
        official = apply_delta(official, manifest, payload)
    # Sum of what was applied = sum of the steps minus the final residual (bounded).
    drift = (official["w"] - target["w"]).abs().max().item()
    residual = state["w"].residual.abs().max().item()
    assert drift == pytest.approx(residual, abs=1e-4)
    assert drift < 0.2


def test_a_bad_delta_is_refused_and_theta_is_left_alone():
    old, new = _theta(), _step(_theta(), 0)
    before = state_digest(old)
    manifest, payload = encode_delta(
        old, new, CompressionConfig.from_dict(CODECS["int8"]), CodecState()
    )
    w = manifest.by_name()["w"]
    bad = bytearray(payload)
    bad[w.offset + 5] ^= 0x10
    with pytest.raises(PayloadError, match="w"):
        apply_delta(old, manifest, bad)
    with pytest.raises(PayloadError, match="bytes"):
        apply_delta(old, manifest, bytes(payload)[:-1])
    with pytest.raises(PayloadError, match=r"unexpected tensor\(s\) \['w'\]"):
        apply_delta({k: v for k, v in old.items() if k != "w"}, manifest, payload)
    with pytest.raises(PayloadError, match="shape"):
        apply_delta({**old, "w": torch.zeros(33, 64)}, manifest, payload)
    with pytest.raises(PayloadError, match="dtype"):
        apply_delta({**old, "steps": torch.zeros(3, dtype=torch.int32)}, manifest, payload)
    assert state_digest(old) == before


def test_a_partial_delta_changes_only_its_tensors():
    """[streaming]: a delta of one fragment; the other tensors stay theta_r's, copied into a
    separate ``out`` (and left alone when ``out`` holds them), and the residuals of tensors
    outside the delta are kept for their own next sync."""
    old = _theta()
    new = {**old, "w": old["w"] + 0.25}
    state = CodecState()
    manifest, payload = encode_delta(
        old, new, CompressionConfig.from_dict(CODECS["int4"]), state, names=["w"]
    )
    assert [e.name for e in manifest.entries] == ["w"]
    assert state.state_dict().keys() == {k for k in state.state_dict() if k.startswith("w")}
    fresh = apply_delta(old, manifest, payload)
    assert fresh.keys() == old.keys()
    for name in ("b", "steps", "empty"):
        assert torch.equal(fresh[name], old[name])
        assert fresh[name].data_ptr() != old[name].data_ptr() or old[name].numel() == 0
    assert not torch.equal(fresh["w"], old["w"])
    out = {k: torch.full_like(v, 7) for k, v in old.items()}  # a file's stale bytes
    into = apply_delta(old, manifest, bytes(payload), out=out)
    assert state_digest(into) == state_digest(fresh)
    assert all(into[k] is out[k] for k in out)
    same = {k: v.clone() for k, v in old.items()}
    b_ptr = same["b"].data_ptr()
    apply_delta(same, manifest, payload, out=same)  # in place: the others are not touched
    assert state_digest(same) == state_digest(fresh) and same["b"].data_ptr() == b_ptr
    with pytest.raises(ValueError, match="does not have"):
        encode_delta(old, new, CompressionConfig(), CodecState(), names=["nope"])


def test_a_partial_delta_is_checked_before_anything_is_written():
    old = _theta()
    manifest, payload = encode_delta(old, old, CompressionConfig(), CodecState(), names=["w"])
    out = {k: v.clone() for k, v in old.items()}
    before = state_digest(out)
    with pytest.raises(PayloadError, match="shape"):
        apply_delta({**old, "w": torch.zeros(33, 64)}, manifest, payload, out=out)
    with pytest.raises(PayloadError, match="unexpected"):
        apply_delta({"b": old["b"]}, manifest, payload, out=out)
    assert state_digest(out) == before


def test_downlink_step_of_a_fragment_round_trips_a_checkpoint():
    cfg = CompressionConfig.from_dict(CODECS["int4"])
    a, theta = Downlink(cfg), _theta()
    new = {**theta, "w": theta["w"] + 0.1}
    official = a.step(theta, dict(new), old_version=2, names=["w"])
    assert [e.name for e in a.manifest.entries] == ["w"]
    assert torch.equal(official["b"], theta["b"])
    b = Downlink(cfg)
    b.load_state_dict(a.state_dict(), theta_version=3)
    assert b.payload == a.payload and b.from_version == 2
    nxt = {**official, "b": (official["b"].float() + 0.5).to(torch.bfloat16)}
    x = a.step(official, {k: v.clone() for k, v in nxt.items()}, 3, names=["b"])
    y = b.step(official, {k: v.clone() for k, v in nxt.items()}, 3, names=["b"])
    assert a.payload == b.payload and state_digest(x) == state_digest(y)
    # w's residual survives a round it does not sync: both hold the same one.
    ra, rb = a.codec_state.state_dict(), b.codec_state.state_dict()
    assert ra.keys() == rb.keys() and any(k.startswith("w") for k in ra)
    assert all(torch.equal(ra[k], rb[k]) for k in ra)


def test_theta_that_changes_its_tensors_cannot_be_encoded():
    old = _theta()
    with pytest.raises(ValueError, match="added or removed"):
        encode_delta(old, {**old, "new": torch.ones(1)}, CompressionConfig(), CodecState())


def test_downlink_state_survives_a_checkpoint():
    cfg = CompressionConfig.from_dict(CODECS["int4"])
    a, theta = Downlink(cfg), _theta()
    theta1 = a.step(theta, _step(theta, 0), old_version=4)
    b = Downlink(cfg)
    b.load_state_dict(a.state_dict(), theta_version=5)
    assert b.from_version == 4 and b.payload == a.payload
    assert Manifest.to_proto(b.manifest) == Manifest.to_proto(a.manifest)
    # Same residuals: the next round encodes the same bytes on both.
    assert a.step(theta1, _step(theta1, 1), 5).keys() == theta1.keys()
    b.step(theta1, _step(theta1, 1), 5)
    assert a.payload == b.payload
    # A checkpoint of another version does not serve a delta that leads elsewhere.
    c = Downlink(cfg)
    c.load_state_dict(a.state_dict(), theta_version=9)
    assert c.payload is None and c.from_version is None


def test_raw_and_encoded_deltas_of_one_payload_keep_their_own_bytes():
    """Encoded deltas share one scratch buffer; a raw delta packed beside them must not: its
    bytes are the payload's until packing, after the next tensors' deltas are made."""
    g = torch.Generator().manual_seed(3)
    old = {
        "a_raw": torch.randn(50, generator=g),
        "b_int8": torch.randn(300, generator=g),
        "c_raw": torch.randn(20, generator=g),
        "d_int8": torch.randn(400, generator=g),
    }
    new = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    cfg = CompressionConfig.from_dict(
        {"default": "none", "rules": [{"match": "*_int8", "codec": "int8"}]}
    )
    manifest, payload = encode_delta(old, new, cfg, CodecState())
    got = apply_delta(old, manifest, payload)
    for name in ("a_raw", "c_raw"):  # fp32 delta of fp32 values: exact here
        assert torch.equal(got[name], old[name] + (new[name] - old[name])), name
    for name in ("b_int8", "d_int8"):
        step = (new[name] - old[name]).abs().max() / 127
        assert (got[name] - new[name]).abs().max() <= step, name
