"""Fold lanes (coordinator/round/fold_lanes.py): the running sum folded on several threads,
each over its own tensors, is bit for bit the sum one thread makes."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from coordinator.config import ConfigError, parse_config
from coordinator.intake.spool import UpdateSpool
from coordinator.records import UpdateKey
from coordinator.round import accumulate
from coordinator.round.accumulate import start_sum
from coordinator.round.fold_lanes import FoldLanes, default_lanes
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.tensors import pack, pack_encoded
from wire.theta import ThetaBuffer

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

SHAPES = {"emb": (300, 17), "w1": (64, 64), "w2": (64, 33), "b1": (64,), "b2": (33,), "s": ()}
SITES = ["site-a", "site-b", "site-c", "site-d"]


@pytest.fixture
def worker():
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fold")
    yield pool
    pool.shutdown()


def _theta() -> ThetaBuffer:
    g = torch.Generator().manual_seed(0)
    return ThetaBuffer.copy_of({n: torch.randn(s, generator=g) for n, s in SHAPES.items()})


def _updates(tmp_path, codec: str):
    """One spooled update per site, values of very different scales (so that the order of
    additions shows in the bits); ``codec`` other than none: int8-encoded."""
    spool, out = UpdateSpool(tmp_path / "spool"), []
    g = torch.Generator().manual_seed(1)
    cfg = CompressionConfig.from_dict({"default": codec})
    for i, site in enumerate(SITES):
        delta = {n: torch.randn(s, generator=g) * 10.0 ** (3 - 2 * i) for n, s in SHAPES.items()}
        if codec == "none":
            manifest, payload = pack(delta)
        else:
            manifest, payload = pack_encoded(delta, cfg, CodecState())
        with spool.open_part(0, site, f"u-{site}") as f:
            f.write(bytes(payload))
        out.append(spool.commit(0, site, f"u-{site}", manifest, 0.5 + i, key=UpdateKey(site)))
    return out


def _bits(folded) -> dict[str, torch.Tensor]:
    return {n: t.clone().view(torch.int32) for n, t in folded.mean.items()}


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_lanes_fold_the_same_bits_as_one_thread_whatever_the_arrival_order(tmp_path, worker, codec):
    ups = _updates(tmp_path, codec)
    keys = [u.key for u in ups]
    one = start_sum(_theta(), list(SHAPES), worker, SITES)
    for u in ups:
        one.offer(u.key.site, u.key, u, u.weight)
    want = _bits(one.finish(keys).result())
    lanes = FoldLanes(3)
    try:
        for order in list(itertools.permutations(range(4)))[::5]:
            running = start_sum(_theta(), list(SHAPES), worker, SITES, lanes=lanes)
            for i in order:
                running.offer(SITES[i], keys[i], ups[i], ups[i].weight)
            got = _bits(running.finish(keys).result())
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), (order, name)
    finally:
        lanes.shutdown()


def test_every_lane_folds_on_its_own_thread_and_only_its_tensors(tmp_path, worker, monkeypatch):
    ups = _updates(tmp_path, "none")
    seen: dict[str, set[str]] = {}
    real = accumulate.fold_into

    def spy(acc, update, alpha, names=None):
        seen.setdefault(threading.current_thread().name, set()).update(names or ())
        real(acc, update, alpha, names)

    monkeypatch.setattr(accumulate, "fold_into", spy)
    lanes = FoldLanes(2)
    try:
        running = start_sum(_theta(), list(SHAPES), worker, SITES, lanes=lanes)
        for u in ups:
            running.offer(u.key.site, u.key, u, u.weight)
        running.finish([u.key for u in ups]).result()
    finally:
        lanes.shutdown()
    assert len(seen) == 2 and all(t.startswith("fold-lane-") for t in seen)
    a, b = seen.values()
    assert a and b and not a & b and a | b == set(SHAPES)


def test_no_more_lanes_than_tensors_and_the_split_is_balanced():
    lanes = FoldLanes(4)
    try:
        assert len(lanes.split({"x": 8})) == 1
        split = lanes.split({"a": 400, "b": 300, "c": 200, "d": 100, "e": 100})
        assert [sorted(lane.names) for lane in split] == [["a"], ["b"], ["c"], ["d", "e"]]
    finally:
        lanes.shutdown()
    assert 1 <= default_lanes() <= 8


@pytest.mark.parametrize("value", [0, -1, 65, True, "4"])
def test_a_bad_number_of_fold_lanes_is_refused_by_name(tmp_path, value):
    data = h.job_config(server={"fold_lanes": value})
    with pytest.raises(ConfigError, match="server.fold_lanes"):
        parse_config(data, tmp_path)
    assert parse_config(h.job_config(server={"fold_lanes": 3}), tmp_path).server.fold_lanes == 3
