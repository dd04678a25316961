"""The packet-level WAN of ``bench.wan_link``: the bottleneck model on its own, then real
namespaces (root and /dev/net/tun only): round trips of at least twice the delay, a rate cap
that holds, tail drops at a full queue, TCP set inside the namespaces, and nothing left behind
after an exception."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess

import pytest

from bench import streams
from bench.wan_link import TCP_RMEM, WanLink, WanLinkUnavailable, check_available
from bench.wan_relay import Bottleneck

# Slow suite: the benchmark's link, not the product. Late in a full default run (a process with
# many gRPC threads behind it) an `ip netns exec` forked from it once died of SIGABRT.
pytestmark = pytest.mark.slow


def _link(**kw) -> WanLink:
    try:
        check_available()
    except WanLinkUnavailable as exc:
        pytest.skip(f"no emulated WAN here: {exc}")
    return WanLink(**kw)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _transfer(link: WanLink, total: int, port: int) -> dict:
    sink = link.start_call("b", "bench.streams_tcp:sink", link.addr_b, port, 1, total)
    sent = link.call_in("a", "bench.streams_tcp:send", link.addr_b, port, 1, total, timeout=60)
    assert link.finish_call(sink, timeout=30)["bytes"] == total
    return sent


def test_bottleneck_paces_queues_and_tail_drops():
    link = Bottleneck(delay_s=0.01, rate_bps=8e6, queue_bytes=3000)  # 1 byte per microsecond
    dues = [link.admit(0.0, bytes(1000)) for _ in range(4)]
    assert dues[:3] == pytest.approx([0.011, 0.012, 0.013])
    assert dues[3] is None  # 3000 bytes queued: the fourth does not fit
    assert link.admit(0.0015, bytes(1000)) == pytest.approx(0.014)  # 1500 queued by then
    assert link.due(0.0115) == [bytes(1000)]
    assert len(link.due(0.02)) == 3
    assert link.stats()["dropped"] == 1 and link.stats()["peak_queue_bytes"] == 3000
    free = Bottleneck(delay_s=0.005, rate_bps=None, queue_bytes=0)
    assert free.admit(1.0, bytes(9000)) == pytest.approx(1.005)  # no cap: delay only


def test_round_trip_is_at_least_twice_the_delay():
    with _link(delay_s=0.03, rate_mbit=100) as link:
        for delay in (0.03, 0.05):
            link.configure(delay, 100)
            echo = link.start_call("b", "bench.streams_tcp:echo", link.addr_b, 5301)
            rtts = link.call_in("a", "bench.streams_tcp:ping", link.addr_b, 5301, 6)["rtts_s"]
            link.finish_call(echo, timeout=10)
            assert min(rtts) >= 2 * delay
            assert statistics.median(rtts) < 2 * delay + 0.04
        # TCP inside the namespaces is the link's, not this machine's.
        assert link.run_in("a", "sysctl -n net.ipv4.tcp_rmem").stdout.split() == TCP_RMEM.split()
        assert "congctl cubic" in link.run_in("b", "ip route show").stdout


def test_capped_link_holds_its_rate():
    cap = 20.0
    with _link(delay_s=0.01, rate_mbit=cap) as link:
        total = 4 << 20
        sent = _transfer(link, total, 5302)
        mbit = total * 8 / sent["elapsed_s"] / 1e6
        assert 0.3 * cap < mbit < 1.1 * cap
        assert sent["congestion"] == "cubic"
        assert link.stats()["a_to_b"]["bytes_out"] >= total


def test_full_queue_drops_and_tcp_recovers():
    # 20 KiB of queue on a 50 KB BDP: slow start overflows it; every byte still arrives.
    with _link(delay_s=0.01, rate_mbit=20, queue_bytes=20 << 10) as link:
        before = link.tcp_counters("a")["RetransSegs"]
        _transfer(link, 2 << 20, 5303)
        assert link.stats()["a_to_b"]["dropped"] > 0
        assert link.tcp_counters("a")["RetransSegs"] > before


def test_nothing_left_after_an_exception():
    link = _link(delay_s=0.01, rate_mbit=50)
    with pytest.raises(RuntimeError, match="inside"), link:
        names = dict(link.names)
        sleeper = link.popen_in("b", ["sleep", "60"])
        relay = link._relay
        assert all(n in _namespaces() for n in names.values())
        raise RuntimeError("inside")
    assert not any(n in _namespaces() for n in names.values())
    assert sleeper.poll() == -signal.SIGTERM
    assert relay.poll() is not None
    devices = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not any(d in devices for d in link.devices.values())


def test_bench_skips_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert streams.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "skipped=not_root" and "needs root" in out[0]
