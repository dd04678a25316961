"""The host's TCP settings read and turned into advice (``wire.net.host_tuning``)."""

from __future__ import annotations

import logging

import pytest

from wire.net.host_tuning import (
    TcpHost,
    log_tcp_advice,
    one_stream_mbit,
    over_loopback,
    read_tcp_host,
    tcp_advice,
)


def _proc(tmp_path, idle="1", wmem="4096\t16384\t4194304", cc="cubic"):
    for name, value in [
        ("tcp_slow_start_after_idle", idle),
        ("tcp_wmem", wmem),
        ("tcp_congestion_control", cc),
    ]:
        if value is not None:
            (tmp_path / name).write_text(value + "\n")
    return tmp_path


def test_settings_are_read_from_the_proc_folder(tmp_path):
    host = read_tcp_host(_proc(tmp_path, idle="0", wmem="4096 16384 8388608", cc="bbr"))
    assert host == TcpHost(slow_start_after_idle=0, send_buffer_max=8 << 20, congestion="bbr")


@pytest.mark.parametrize("idle,wmem", [("yes", "1 2"), ("", "a b c"), (None, None)])
def test_unreadable_or_malformed_settings_are_unknown_not_errors(tmp_path, idle, wmem):
    host = read_tcp_host(_proc(tmp_path, idle=idle, wmem=wmem, cc=None))
    assert host == TcpHost(None, None, None)
    assert tcp_advice(host, sends_on_kept_connections=True) == []


def test_this_hosts_settings_read_as_the_kernel_has_them():
    host = read_tcp_host()
    assert host.slow_start_after_idle in (0, 1)
    assert host.send_buffer_max > 0


def test_slow_start_after_idle_warns_only_a_sender_on_kept_connections():
    host = TcpHost(slow_start_after_idle=1, send_buffer_max=64 << 20, congestion="cubic")
    (advice,) = tcp_advice(host, sends_on_kept_connections=True)
    assert advice.warn and "tcp_slow_start_after_idle=0" in advice.text
    # Each upload on connections of its own starts slow anyway: nothing to say.
    assert tcp_advice(host, sends_on_kept_connections=False) == []
    tuned = TcpHost(slow_start_after_idle=0, send_buffer_max=64 << 20, congestion="cubic")
    assert tcp_advice(tuned, sends_on_kept_connections=True) == []


def test_a_small_send_buffer_is_said_with_the_ceiling_it_sets():
    host = TcpHost(slow_start_after_idle=0, send_buffer_max=4 << 20, congestion="cubic")
    assert one_stream_mbit(host) == pytest.approx(4 * 2**20 * 8 / 0.1 / 1e6)
    (advice,) = tcp_advice(host, sends_on_kept_connections=False)
    assert not advice.warn
    assert "4.0 MiB" in advice.text and "336 Mbit/s" in advice.text
    assert "[transfer] streams" in advice.text


@pytest.mark.parametrize(
    "address,loopback",
    [
        ("127.0.0.1:7000", True),
        ("localhost:7000", True),
        ("[::1]:7000", True),
        ("0.0.0.0:7000", False),
        ("10.0.0.2:7000", False),
        ("coordinator.example:443", False),
    ],
)
def test_loopback_addresses_are_recognised(address, loopback):
    assert over_loopback(address) is loopback


def test_nothing_is_logged_for_a_job_on_one_machine(caplog):
    with caplog.at_level(logging.INFO, logger="t"):
        log_tcp_advice(logging.getLogger("t"), "127.0.0.1:7000", True)
    assert caplog.records == []


def test_advice_is_logged_at_its_level(caplog, monkeypatch):
    import wire.net.host_tuning as host_tuning

    host = TcpHost(slow_start_after_idle=1, send_buffer_max=4 << 20, congestion="cubic")
    monkeypatch.setattr(host_tuning, "read_tcp_host", lambda: host)
    with caplog.at_level(logging.INFO, logger="t"):
        log_tcp_advice(logging.getLogger("t"), "10.0.0.2:7000", True)
    levels = [(r.levelno, "slow_start" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.WARNING, True), (logging.INFO, False)]
