"""An update's size is bounded by the model, not by ``server.max_update_bytes``: a push header
whose manifest claims more bytes than the model's tensors take under their codecs is refused
before a byte is stored, and honest pushes of every codec, whole or in pieces, still count.
Driven through the coordinator core in-process (``tests/core_helpers.py``)."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import replace

import pytest
import torch
from core_helpers import Clock, heartbeat_all, new_core, push_payload
from safetensors.torch import save_file

from coordinator.records import PushHeader, Refused
from site_client.agent.update_payload import build_payload
from site_client.trainer.shards import BOXES_KEY
from wire.codecs import CodecState
from wire.codecs.base import HEADER
from wire.codecs.rules import CompressionConfig
from wire.digest import payload_digest, state_digest
from wire.tensors import Manifest, pack, pack_encoded

MIB64 = 64 << 20
SITES = ("site-a", "site-b")


def _open_round(core, clock):
    tokens = {s: core.join(s)[0].token for s in SITES}
    heartbeat_all(core, clock, tokens, 3.0)
    assert core.round.opened_at is not None
    return tokens


def _delta(core, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(core.theta[n].shape, generator=g) * 1e-2 for n in core.trainable}


def _what_the_core_holds(core) -> tuple:
    files = sorted(str(p.relative_to(core.spool.root)) for p in core.spool.root.rglob("*"))
    return core.round, state_digest(core.theta), core.uploads.in_progress(), files


def _with_meta_nbytes(meta: bytes, nbytes: int) -> bytes:
    """The meta with another data length, its own CRC32 recomputed (a peer can always)."""
    fields = list(HEADER.unpack_from(meta))
    fields[5] = nbytes
    head = HEADER.pack(*fields) + meta[HEADER.size : -4]
    return head + struct.pack("<I", zlib.crc32(head))


def _trailing_slack(core):
    manifest, _ = pack(_delta(core, 1))
    last = max(manifest.entries, key=lambda e: e.end)
    return replace(manifest, total_bytes=MIB64), last.name, "none", MIB64, manifest.total_bytes


def _gap_before_a_tensor(core):
    manifest, _ = pack(_delta(core, 1))
    first, second = sorted(manifest.entries, key=lambda e: e.offset)
    moved = replace(second, offset=MIB64)
    bad = replace(manifest, entries=(first, moved), total_bytes=moved.end)
    return bad, second.name, "none", MIB64, second.offset


def _inflated_codec_entry(codec: str, extra: int):
    def case(core):
        rules = CompressionConfig.from_dict({"default": codec})
        manifest, _ = pack_encoded(_delta(core, 1), rules, CodecState())
        e = max(manifest.entries, key=lambda e: e.nbytes)  # the weight: encoded, not raw
        claimed = e.nbytes + extra
        fat = replace(e, nbytes=claimed, codec_meta=_with_meta_nbytes(e.codec_meta, claimed))
        entries = tuple(fat if x is e else x for x in manifest.entries)
        end = max(x.end for x in entries)
        return Manifest(entries, end, manifest.digest), e.name, codec, claimed, e.nbytes

    return case


HOSTILE = {
    "64 MiB after the last tensor": _trailing_slack,
    "64 MiB gap before a tensor": _gap_before_a_tensor,
    "int8 entry claiming 64 MiB": _inflated_codec_entry("int8", MIB64),
    "int4 entry one byte over": _inflated_codec_entry("int4", 1),
    "bf16 entry claiming 64 MiB": _inflated_codec_entry("bf16", MIB64),
    "topk entry one byte over": _inflated_codec_entry("topk", 1),
}


@pytest.mark.parametrize("make", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_manifest_claiming_more_than_the_model_needs_is_refused_before_a_byte_is_stored(
    tmp_path, make
):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = _open_round(core, clock)
    manifest, name, codec, claimed, honest = make(core)
    assert claimed > honest and claimed <= core.cfg.server.max_update_bytes
    before = _what_the_core_holds(core)
    header = PushHeader(
        site="site-a",
        token=tokens["site-a"],
        round=0,
        upload_id="fat-1",
        manifest=manifest.to_proto(),
        weight=1.0,
        base_version=0,
    )
    with pytest.raises(Refused) as err:
        core.begin_upload(header)
    message = str(err.value)
    assert err.value.code == "invalid"
    assert name in message and repr(codec) in message, message
    assert str(claimed) in message and str(honest) in message, message
    assert _what_the_core_holds(core) == before
    assert not list(core.spool.root.rglob("*.part"))
    # Nothing was held for the refused push: the site's honest update counts next.
    good, payload = pack(_delta(core, 2))
    assert push_payload(core, "site-a", tokens["site-a"], 0, good, payload)
    assert core.round.received.keys() == {"site-a"}


def _pieces_payload(core, tmp_path, delta, rules):
    """The site's own path: two trainer ranks' shard files (the weight split by rows, the bias
    on rank 0), laid out and encoded by ``build_payload``."""
    w = next(n for n in core.trainable if delta[n].dim() == 2)
    b = next(n for n in core.trainable if n != w)
    rows = delta[w].shape[0]
    cut = rows // 2 + 1
    paths = []
    for rank, (lo, hi) in enumerate([(0, cut), (cut, rows)]):
        tensors = {w: delta[w][lo:hi].contiguous()}
        boxes = {w: {"offset": [lo, 0], "shape": list(delta[w].shape)}}
        if rank == 0:
            tensors[b] = delta[b]
        path = tmp_path / f"rank{rank}.safetensors"
        save_file(tensors, str(path), metadata={BOXES_KEY: json.dumps(boxes)})
        paths.append(path)
    payload = build_payload(paths, rules, CodecState())
    data = b"".join(bytes(c) for _, c in payload.chunks(0, 1 << 20))
    assert payload_digest(data) == payload.manifest.digest
    return payload.manifest, data


CODEC_TABLES = [
    "none",
    "bf16",
    "fp16",
    "int8",
    {"codec": "int8", "block": 8, "scale_dtype": "fp32"},
    "int4",
    "topk",
    {"codec": "topk", "fraction": 1.0, "values": "fp32", "indices": "int32"},
    {"codec": "topk", "fraction": 0.5, "values": "fp32", "indices": "varint"},
]


@pytest.mark.parametrize("table", CODEC_TABLES, ids=lambda t: json.dumps(t))
def test_honest_pushes_of_every_codec_count_whole_and_in_pieces(tmp_path, table):
    clock = Clock()
    core = new_core(tmp_path, clock)
    tokens = _open_round(core, clock)
    rules = CompressionConfig.from_dict({"default": table})
    theta0 = state_digest(core.theta)
    whole, payload = pack_encoded(_delta(core, 3), rules, CodecState())
    assert push_payload(core, "site-a", tokens["site-a"], 0, whole, payload)
    pieces, data = _pieces_payload(core, tmp_path, _delta(core, 4), rules)
    assert len(pieces.entries) == 3
    assert push_payload(core, "site-b", tokens["site-b"], 0, pieces, data)
    assert core.round.received.keys() == set(SITES)
    heartbeat_all(core, clock, tokens, 2.0)
    assert core.round.number == 1 and state_digest(core.theta) != theta0
