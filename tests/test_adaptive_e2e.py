"""Adaptive compression end to end: a real coordinator and two ``siteclient start`` sites (one
FSDP2 trainer each, the example GPT) over mutual TLS, each site behind its own WAN relay. The
links start fast and are slowed mid-run: the sites' updates and the coordinator's deltas move
to a more compressed rung, as the events and the sites' timing records say, and every site
still ends on the coordinator's theta, bit for bit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from faults.cluster import Cluster, JobSpec

pytestmark = pytest.mark.e2e

LADDER = ["none", "int8", "int4"]
SLOW_BYTES_PER_S = 40_000  # the float32 model (about 230 KB) would take 6 s a transfer


@dataclass(frozen=True)
class AdaptiveSpec(JobSpec):
    """The fault suite's job, a wider model, both links adaptive."""

    def config(self, marker_dir: Path) -> dict:
        cfg = super().config(marker_dir)
        cfg["model"]["kwargs"].update(d_model=64, d_ff=64, n_heads=4)
        table = {"mode": "adaptive", "ladder": LADDER, "deadline_fraction": 0.8}
        cfg["compression"] = {**table, "downlink": dict(table)}
        return cfg


def _pushes(site_dir: Path) -> list[dict]:
    lines = (site_dir / "timings.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "push"]


def test_a_link_slowed_mid_run_moves_both_directions_down_the_ladder(tmp_path):
    spec = AdaptiveSpec(rounds=6, inner_steps=8, checkpoint_every=100)
    cluster = Cluster(tmp_path, spec).start()
    try:
        cluster.wait_closed(2)
        for relay in cluster.relays:
            relay.set_rate(SLOW_BYTES_PER_S)
        record = cluster.finish(timeout=240)
    finally:
        cluster.close()
    assert record.problems == [] and set(record.site_codes.values()) == {0}, cluster.tails()
    assert record.final_hash and set(record.site_hashes.values()) == {record.final_hash}

    for site in cluster.sites:
        pushes = _pushes(site.run_dir)
        assert [p["codec"] for p in pushes[:2]] == ["none", "none"], pushes
        assert pushes[-1]["codec"] != "none", pushes  # down the ladder once the link slowed
        assert pushes[-1]["rung"] > 0 and pushes[-1]["predicted_s"] is not None

    updates = [e for e in record.events if e["kind"] == "update"]
    first, last = updates[0], updates[-1]
    assert set(first["codecs"]) == {"none"}
    assert set(last["codecs"]) - {"none"}, last  # its tensors sent int8 or int4 now
    closes = [e for e in record.events if e["kind"] == "round_closed"]
    codecs = [e["downlink_codec"] for e in closes]
    assert codecs[0] == "none" and codecs[-1] in LADDER[1:], codecs
