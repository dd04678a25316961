"""Encoded payloads: manifests whose entries carry a codec and its meta, checked before use,
and the site's codec rules and residuals as the agent keeps them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from site_client.agent.compression import compression_of, load_codec_state, save_codec_state
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.tensors import Manifest, PayloadError, pack, pack_encoded, unpack, validate_manifest

RULES = CompressionConfig.from_dict(
    {"default": "int4", "rules": [{"match": "*.b", "codec": "none"}]}
)


def _delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"l.w": torch.randn(40, 30, generator=g) * 1e-3, "l.b": torch.randn(30, generator=g)}


def test_pack_encoded_round_trips_within_the_codec_bound():
    delta = _delta()
    manifest, payload = pack_encoded(delta, RULES, CodecState())
    got = unpack(manifest, bytearray(payload))
    assert torch.equal(got["l.b"], delta["l.b"])  # raw by rule
    err = (got["l.w"] - delta["l.w"]).abs().max()
    assert 0 < err <= delta["l.w"].abs().max() / 7  # int4: half a step of absmax/7 per block
    raw_manifest, raw_payload = pack(delta)
    assert len(payload) < len(raw_payload) / 4


def _swap(manifest: Manifest, name: str, **changes) -> Manifest:
    entries = tuple(replace(e, **changes) if e.name == name else e for e in manifest.entries)
    return replace(manifest, entries=entries)


@pytest.mark.parametrize(
    ("name", "changes", "words"),
    [
        ("l.w", {"codec": "int8"}, "codec"),  # the meta says int4
        ("l.w", {"shape": (41, 30)}, "elements"),  # 1230 elements, the meta says 1200
        ("l.w", {"codec_meta": b"\x00" * 10}, "l.w"),
        ("l.w", {"codec_meta": b"x" * 4096}, "codec_meta"),
        ("l.b", {"codec_meta": b"\x01"}, "no codec_meta"),
    ],
)
def test_inconsistent_codec_entries_are_refused(name, changes, words):
    manifest, _ = pack_encoded(_delta(), RULES, CodecState())
    with pytest.raises(PayloadError, match=words):
        validate_manifest(_swap(manifest, name, **changes))


def test_the_agent_reads_the_rules_and_keeps_residuals(tmp_path):
    assert compression_of("") is None
    assert compression_of('[job]\nname = "x"\n') is None
    cfg = compression_of('[compression]\ndefault = "topk"\n')
    assert cfg is not None and cfg.default.name == "topk"
    state = CodecState()
    pack_encoded(_delta(1), cfg, state)  # top-k leaves a residual
    path = tmp_path / "codec_state.safetensors"
    save_codec_state(path, state)
    again = load_codec_state(path)
    a = pack_encoded(_delta(2), cfg, state)
    b = pack_encoded(_delta(2), cfg, again)
    assert bytes(a[1]) == bytes(b[1])  # the restored residuals encode the next round the same
    assert load_codec_state(tmp_path / "missing").state_dict() == {}
