"""The running sum (coordinator/round/accumulate.py): updates folded as they arrive, in a fixed
order."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from coordinator.intake.spool import UpdateSpool
from coordinator.records import UpdateKey
from coordinator.round.accumulate import StreamingMean, fold_order, start_sum
from strategies.robust import weighted_mean_of
from wire.digest import payload_digest
from wire.tensors import Manifest, TensorEntry, pack
from wire.theta import ThetaBuffer

SHAPES = {"a": (37, 5), "b": (11,), "count": ()}


@pytest.fixture
def worker():
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


def theta() -> ThetaBuffer:
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(s, generator=g) for n, s in SHAPES.items() if n != "count"}
    return ThetaBuffer.copy_of({**t, "count": torch.tensor(3)})


def deltas(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{k: torch.randn(SHAPES[k], generator=g) * 10 ** (-i) for k in "ab"} for i in range(n)]


def spool(tmp_path, key: UpdateKey, delta, weight: float, manifest=None, payload=None):
    s = UpdateSpool(tmp_path / "spool")
    if manifest is None:
        manifest, payload = pack(delta)
    with s.open_part(0, key.site, f"u-{key.label}") as f:
        f.write(bytes(payload))
    return s.commit(0, key.site, f"u-{key.label}", manifest, weight, key=key)


def folded(result) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in result.mean.items()}


def test_the_sum_is_the_same_whatever_the_arrival_order(tmp_path, worker):
    sites = ["site-a", "site-b", "site-c"]
    weights = [1.0, 3.0, 0.25]
    ups = [
        spool(tmp_path, UpdateKey(s), d, w)
        for s, d, w in zip(sites, deltas(3), weights, strict=True)
    ]
    like = {n: theta().tensors[n] for n in "ab"}
    want, total = weighted_mean_of([u.as_site_update() for u in ups], like)
    keys = [u.key for u in ups]
    for order in itertools.permutations(range(3)):
        running = start_sum(theta(), ["a", "b"], worker, sites)
        for i in order:
            running.offer(sites[i], keys[i], ups[i], ups[i].weight)
        got = running.finish(keys).result()
        assert got.total_weight == total and got.order == tuple(keys)
        for name in want:  # bit for bit, not approximately
            assert torch.equal(got.mean[name].view(torch.int32), want[name].view(torch.int32))


def test_an_empty_slot_is_skipped_and_the_rest_folded_at_close(tmp_path, worker):
    ups = [spool(tmp_path, UpdateKey(s), d, 1.0) for s, d in zip("xz", deltas(2), strict=True)]
    running = start_sum(theta(), ["a", "b"], worker, ["x", "y", "z"])
    running.offer("z", ups[1].key, ups[1], 1.0)  # waits for x and y
    running.offer("x", ups[0].key, ups[0], 1.0)
    order = running.order()
    assert order == [ups[0].key, ups[1].key]  # y never came
    got = running.finish(order).result()
    want, _ = weighted_mean_of([u.as_site_update() for u in ups], dict(theta().tensors))
    assert all(torch.equal(got.mean[n], want[n]) for n in "ab")


def test_late_updates_fold_after_every_slot_by_label():
    own, late_b, late_a = UpdateKey("s2"), UpdateKey("b", late_from=3), UpdateKey("a", late_from=3)
    order = fold_order(["s1", "s2"], {"s2": own}, [late_b, late_a])
    assert order == [own, late_a, late_b]


def test_pieces_are_folded_into_their_boxes(tmp_path, worker):
    whole = deltas(1)[0]["a"]  # (37, 5), sent as rows [0, 19) and [19, 37)
    top, bottom = whole[:19].contiguous(), whole[19:].contiguous()
    raw = torch.cat([top.reshape(-1), bottom.reshape(-1)]).view(torch.uint8)
    payload = memoryview(raw.numpy()).cast("B")
    entries = (
        TensorEntry(
            "a", "float32", (19, 5), 0, top.numel() * 4, global_shape=(37, 5), box_offset=(0, 0)
        ),
        TensorEntry(
            "a",
            "float32",
            (18, 5),
            top.numel() * 4,
            bottom.numel() * 4,
            global_shape=(37, 5),
            box_offset=(19, 0),
        ),
    )
    manifest = Manifest(entries, len(payload), payload_digest(payload))
    up = spool(tmp_path, UpdateKey("s"), None, 2.0, manifest, payload)
    running = StreamingMean({"a": torch.zeros(37, 5)}, worker)
    running.expect(["s"])
    running.offer("s", up.key, up, 2.0)
    got = running.finish([up.key]).result()
    assert torch.equal(got.mean["a"], whole * 2.0 / 2.0)


def test_slots_of_an_open_round_only_grow_at_the_end(worker):
    running = StreamingMean({"a": torch.zeros(1)}, worker)
    running.expect(["b", "d"])
    running.expect(["b", "d", "a"])  # a latecomer: after the others, whatever its name
    with pytest.raises(ValueError, match="only be added at the end"):
        running.expect(["a", "b", "d"])


def test_a_close_that_disagrees_with_what_was_folded_fails(tmp_path, worker):
    ups = [spool(tmp_path, UpdateKey(s), d, 1.0) for s, d in zip("xy", deltas(2), strict=True)]
    running = start_sum(theta(), ["a", "b"], worker, ["x", "y"])
    running.offer("x", ups[0].key, ups[0], 1.0)
    running.offer("y", ups[1].key, ups[1], 1.0)
    running.order()
    with pytest.raises(RuntimeError, match="folded"):
        running.finish([ups[1].key, ups[0].key]).result()


@pytest.mark.parametrize("codec", ["int8", "int4", "topk", "bf16"])
def test_encoded_updates_fold_straight_into_the_sum_bit_for_bit(tmp_path, codec):
    """Decoding into the sum is the same multiply and add per element as decoding whole and
    adding (the rule every restart and every site relies on)."""
    from coordinator.round.accumulate import fold_into
    from wire.codecs import CodecState
    from wire.codecs.rules import CompressionConfig
    from wire.tensors import entry_tensor, pack_encoded

    g = torch.Generator().manual_seed(7)
    delta = {"a": torch.randn(300, 70, generator=g), "b": torch.randn(999, generator=g)}
    cfg = CompressionConfig.from_dict({"default": codec})
    manifest, payload = pack_encoded(delta, cfg, CodecState())
    update = spool(tmp_path, UpdateKey("s"), None, 1.0, manifest, payload)
    start = {k: torch.randn(v.shape, generator=g) for k, v in delta.items()}
    got = {k: v.clone() for k, v in start.items()}
    fold_into(got, update, 0.37)
    for e in manifest.entries:
        raw = torch.frombuffer(bytearray(payload[e.offset : e.end]), dtype=torch.uint8)
        want = start[e.name].clone().add_(entry_tensor(e, raw).to(torch.float32), alpha=0.37)
        assert torch.equal(got[e.name], want), e.name
