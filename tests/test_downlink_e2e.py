"""int8 up and int8 down through a real coordinator: every round both sites rebuild theta from
the compressed delta and all three parties hold the same hash, also across a kill -9 of the
coordinator; a site whose copy went wrong falls back to a whole fetch and names the tensor."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from site_client.transfer.client import CoordinatorClient, GlobalState
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.digest import state_digest

pytestmark = pytest.mark.e2e

ROUNDS = 4
SITES = ("site-a", "site-b")
INT8 = '{ match = "*bias", codec = "none" }'


@pytest.fixture
def coord(tmp_path):
    cfg = h.job_config(
        name="downlink",
        strategy={"name": "diloco", "lr": 0.7, "momentum": 0.9},
        rounds={"total": ROUNDS, "min_sites": 2, "max_sites": 2, "join_window_s": 5.0},
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 256, "d_out": 64}},
    )
    path = h.write_config(tmp_path, cfg)
    path.write_text(
        path.read_text()
        + f'\n[compression]\ndefault = "int8"\nrules = [{INT8}]\n'
        + f'[compression.downlink]\ndefault = "int8"\nrules = [{INT8}]\n'
    )
    proc = h.CoordinatorProcess(path, tmp_path / "state", tmp_path / "coordinator.log")
    proc.start()
    yield proc
    proc.stop()


def _delta(theta, k: int, r: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * r + k)
    return {n: 0.05 * torch.randn(t.shape, generator=g) for n, t in theta.items() if n != "seen"}


def _checkpoint_hash(state_dir, round_number: int) -> str:
    meta = state_dir / "checkpoints" / f"round-{round_number:08d}" / "meta.json"
    # Written in the background once theta is published: it may trail the fetch a little.
    h.wait_until(meta.exists, timeout=20, what=f"the checkpoint of round {round_number}")
    return json.loads(meta.read_text())["theta_digest"]


def test_int8_both_ways_keeps_every_party_bit_identical(coord, caplog):
    compression = CompressionConfig.from_dict({"default": "int8"})
    clients = {s: CoordinatorClient(coord.address, s, backoff=h.FAST_BACKOFF) for s in SITES}
    held: dict[str, GlobalState | None] = dict.fromkeys(SITES)
    states = {s: CodecState() for s in SITES}
    for c in clients.values():
        c.join()
    full_bytes = None
    for r in range(ROUNDS + 1):
        for c in clients.values():
            c.wait_for_round(r - 1)
        previous = held["site-a"]
        for s, c in clients.items():
            before = c.bytes_received
            held[s] = c.fetch(held=held[s])
            got = c.bytes_received - before
            if r == 0:
                full_bytes = got
            else:  # a delta: int8 matrix, raw bias, about a quarter of the whole state
                assert got < full_bytes / 3, (r, got, full_bytes)
        status = h.status(coord.address)
        assert held["site-a"].version == held["site-b"].version == r
        assert held["site-a"].theta_hash == held["site-b"].theta_hash == status.round.theta_hash
        assert state_digest(held["site-a"].theta) == status.round.theta_hash
        assert status.round.theta_hash.hex() == _checkpoint_hash(coord.state_dir, r)
        if r == ROUNDS:
            break
        threads = [
            threading.Thread(
                target=c.push,
                args=(r, _delta(held[s].theta, k, r)),
                kwargs={"compression": compression, "codec_state": states[s]},
            )
            for k, (s, c) in enumerate(clients.items())
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if r == 1:
            # A crash after round 1 closed: the restarted coordinator serves the same delta
            # and continues with the same downlink residuals (from its checkpoint).
            for c in clients.values():
                c.wait_for_round(r)
            coord.kill()
            coord.restart()
    assert all(c.delta_mismatches == 0 for c in clients.values())
    # A copy that went wrong at a site: the delta no longer leads to the coordinator's hash.
    c = clients["site-a"]
    broken = dict(previous.theta)
    broken["lin.weight"] = broken["lin.weight"].clone()
    broken["lin.weight"][0, 0] += 1.0
    with caplog.at_level(logging.ERROR, logger="isthmus.site"):
        whole = c.fetch(held=GlobalState(previous.version, broken, previous.theta_hash))
    assert whole.theta_hash == h.status(coord.address).round.theta_hash
    assert c.delta_mismatches == 1
    assert "lin.weight" in caplog.text and "lin.bias" not in caplog.text.split("differed:")[1]
    for c in clients.values():
        c.close()
