"""The Prometheus endpoints, scraped during a real two-site job and checked against what the
job did."""

from __future__ import annotations

import pytest

try:
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

import test_coordinator_e2e as e2e

from wire.net.metrics_http import MetricsAddressError, parse_metrics_address

pytestmark = pytest.mark.e2e


def test_the_coordinator_metrics_match_what_the_job_did(tmp_path):
    cfg = h.job_config(strategy=e2e.STRATEGIES["fedavg"])
    folder = tmp_path / "job"
    folder.mkdir()
    coord, address = h.start_with_metrics(folder, cfg)
    hooks = e2e.Hooks()
    for site in e2e.SITES:
        hooks.pause(site, "before_push", 2)
    seen = {}

    def during(logs):
        for site in e2e.SITES:
            hooks.wait_arrived(site, "before_push", 2)
        seen["metrics"] = h.scrape_metrics(address)
        seen["status"] = h.status(coord.address)

    try:
        e2e.run_job(coord, hooks=hooks, during=during)
        assert coord.wait(timeout=20) == 0, coord.log_tail()
    finally:
        coord.kill()
    m, status = seen["metrics"], seen["status"]
    assert m[("isthmus_round", ())] == 2 == status.round.round
    assert m[("isthmus_theta_version", ())] == 2
    assert m[("isthmus_events_total", (("kind", "round_closed"),))] == 2
    assert m[("isthmus_round_seconds_count", ())] == 2
    sites = {dict(labels)["site"] for (name, labels) in m if name == "isthmus_site_live"}
    assert sites == set(e2e.SITES)
    for site in e2e.SITES:
        assert m[("isthmus_site_live", (("site", site),))] == 1
        assert m[("isthmus_updates_counted_total", (("site", site),))] == 2
        assert m[("isthmus_update_codec_ratio", (("site", site),))] == pytest.approx(1.0, 0.05)
    bytes_in = sum(m[("isthmus_site_bytes_in_total", (("site", s),))] for s in e2e.SITES)
    bytes_out = sum(m[("isthmus_site_bytes_out_total", (("site", s),))] for s in e2e.SITES)
    assert bytes_in == m[("isthmus_wan_bytes_in", ())] == status.wan_bytes_in
    assert bytes_out == m[("isthmus_wan_bytes_out", ())] == status.wan_bytes_out
    assert m[("isthmus_checkpoint_seconds_count", ())] >= 1  # round 2's may still be written
    assert m[("isthmus_checkpoint_bytes", ())] > 0
    phases = {
        dict(labels)["phase"] for (name, labels) in m if name == "isthmus_round_phase_seconds"
    }
    assert {"wait", "aggregate", "outer_step"} <= phases


@pytest.mark.parametrize(
    ("text", "want"),
    [("9100", ("127.0.0.1", 9100)), ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:80", ("::1", 80))],
)
def test_metrics_addresses(text, want):
    assert parse_metrics_address(text) == want


@pytest.mark.parametrize("text", ["", "host:", "host:port", ":99999", "9100:"])
def test_bad_metrics_addresses_say_what_to_give(text):
    with pytest.raises(MetricsAddressError, match="give PORT"):
        parse_metrics_address(text)


def test_serve_refuses_a_bad_metrics_address_in_one_line(tmp_path):
    cfg = h.job_config()
    path = h.write_config(tmp_path, cfg)
    done = h.run_cli("serve", "--config", str(path), "--insecure", "--metrics", "nine")
    assert done.returncode != 0
    assert "--metrics nine" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "state" / "metrics_address").exists()
