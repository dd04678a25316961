"""Each upload's data stream goes over a connection of its own, closed once the stream ends:
the coordinator's gRPC keeps a connection's receive buffers for as long as it lives, so the
long-lived channel must not carry updates. Counted at a relay between a real site client and
a real coordinator."""

from __future__ import annotations

import contextlib

import pytest
from coord_harness import FAST_BACKOFF, job_config, start_coordinator, wait_until

from bench.relay import Relay
from site_client.transfer.client import CoordinatorClient


@pytest.mark.e2e
def test_each_upload_opens_and_closes_its_own_connection(tmp_path):
    cfg = job_config(
        name="own-connection",
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 64, "d_out": 64}},
        rounds={"total": 2, "min_sites": 1, "max_sites": 1},
    )
    coord = start_coordinator(tmp_path, cfg)
    port = int(coord.address.rsplit(":", 1)[1])
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(coord.stop)
        relay = cleanup.enter_context(Relay(target=("127.0.0.1", port)).start())
        client = CoordinatorClient(relay.address, "site-a", backoff=FAST_BACKOFF)
        try:
            client.join()
            held = client.fetch()
            client.wait_for_round(-1)
            standing = relay.counters().connections  # the bulk and the control channel
            assert standing == relay.open_connections == 2
            for r in range(2):
                client.wait_for_round(r - 1)
                delta = {
                    n: t.float() * 0 + 1e-3 for n, t in held.theta.items() if t.is_floating_point()
                }
                assert client.push(r, delta, base_version=r).complete
                assert relay.counters().connections == standing + r + 1
                # Closed once its stream ended: the standing connections are what stays.
                wait_until(lambda: relay.open_connections == standing, what="upload closed")
            client.wait_for_round(1)
            client.leave("done")
        finally:
            client.close()
        assert coord.wait(timeout=30) == 0, coord.log_tail()
