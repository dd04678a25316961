"""wire.digest: one algorithm, a state digest composed per tensor, and bad input refused."""

from __future__ import annotations

import os

import pytest
import torch

from wire.digest import (
    Hasher,
    block_digests,
    compose,
    payload_digest,
    state_digest,
    tensor_digests,
)
from wire.tensors import dtype_name


def state():
    g = torch.Generator().manual_seed(3)
    return {
        "b.weight": torch.randn(64, 33, generator=g),
        "a.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "count": torch.tensor(5),
        "empty": torch.empty(0, 4),
    }


def test_blake3_known_answer():
    assert payload_digest(b"abc").hex() == (
        "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    )


def test_streamed_and_whole_and_threaded_digests_agree():
    data = os.urandom((8 << 20) + 12345)  # above the threaded size
    h = Hasher()
    for i in range(0, len(data), 1 << 20):
        h.update(memoryview(data)[i : i + (1 << 20)])
    copy = h.copy()
    assert h.digest() == payload_digest(data) == copy.digest()


def test_the_state_digest_depends_on_content_not_order_or_layout():
    s = state()
    assert state_digest(dict(reversed(s.items()))) == state_digest(s)
    t = dict(s, **{"b.weight": s["b.weight"].t().contiguous().t()})  # same values, not contiguous
    assert not t["b.weight"].is_contiguous() and state_digest(t) == state_digest(s)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["b.weight"].view(-1)[17].add_(1e-6),
        lambda s: s.__setitem__("count", torch.tensor(5, dtype=torch.int32)),
        lambda s: s.__setitem__("b.weight", s["b.weight"].reshape(33, 64)),
        lambda s: s.__setitem__("c.bias", s.pop("a.bias")),
        lambda s: s.pop("empty"),
    ],
)
def test_any_change_of_a_byte_dtype_shape_or_name_changes_it(change):
    s = state()
    before = state_digest(s)
    change(s)
    assert state_digest(s) != before


def test_a_state_digest_composes_from_any_split_of_its_tensors():
    """What a coordinator of several shards relies on: each digests its own tensors."""
    s = state()
    parts = [{k: s[k] for k in ("b.weight", "count")}, {k: s[k] for k in ("a.bias", "empty")}]
    records = []
    for part in parts:
        digests = tensor_digests(part)
        records += [(n, dtype_name(t.dtype), tuple(t.shape), digests[n]) for n, t in part.items()]
    assert compose(records) == state_digest(s)


def test_block_digests_cover_the_payload():
    data = os.urandom(10_000)
    blocks = block_digests(data, 4096)
    assert len(blocks) == 3 and blocks[2] == payload_digest(data[8192:])


def test_dtype_names_are_the_wires():
    from wire.digest import dtype_name
    from wire.tensors import DTYPES

    assert {dtype_name(d): d for d in DTYPES.values()} == DTYPES
