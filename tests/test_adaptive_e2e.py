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
    # 32 steps a round: a deadline of a few tenths of a second, which a loopback push of the
    # float32 model meets even on a loaded machine, and the slowed link misses at every rung.
    spec = AdaptiveSpec(rounds=6, inner_steps=32, checkpoint_every=100)
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
        assert pushes[0]["codec"] == "none", pushes  # nothing measured yet: the first rung
        last = pushes[-1]  # the link slowed: down the ladder (to int4 here, unless loaded)
        assert last["codec"] in LADDER[1:] and last["rung"] == LADDER.index(last["codec"])
        assert last["fits"] == (last["predicted_s"] <= last["deadline_s"]), pushes

    updates = [e for e in record.events if e["kind"] == "update"]
    first, last = updates[0], updates[-1]
    assert set(first["codecs"]) == {"none"}
    assert set(last["codecs"]) - {"none"}, last  # its tensors sent int8 or int4 now
    closes = [e for e in record.events if e["kind"] == "round_closed"]
    codecs = [e["downlink_codec"] for e in closes]
    assert codecs[-1] in LADDER[1:] and LADDER.index(codecs[-1]) >= LADDER.index(codecs[0]), codecs
