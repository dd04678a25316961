"""A packet-level long fat network between two network namespaces, for benchmarks and tests.

``tc netem`` does not exist on these machines, so the delay comes from a userspace relay
(``bench.wan_relay``) in the root namespace: one TUN device in each of two namespaces made
here, every IP packet carried between them through one bottleneck FIFO per direction (rate,
queue in bytes, tail drop) and a one-way delay. Unlike a TCP proxy, the two ends hold one TCP
connection end to end, so slow start, losses and the congestion window are the kernel's own::

    with WanLink(delay_s=0.04, rate_mbit=200) as link:
        server = link.popen_in("b", ["python", "-m", "http.server", "--bind", link.addr_b])
        link.run_in("a", f"curl -s http://{link.addr_b}:8000/")
        result = link.call_in("a", "mymodule:function", arg1, arg2)  # JSON in, JSON out

Inside both namespaces TCP is set deliberately, not inherited from this machine (BBR and a 32
MiB receive buffer): ``congestion`` (cubic) on the route over the link, the kernel's stock
``tcp_rmem``/``tcp_wmem`` (6 MiB / 4 MiB maximum, so a single stream meets a realistic window
limit), and no cached metrics between connections, so each run starts from the same state.
The TUN devices default to ``mtu`` 1500, as on a real WAN path (slow start counts segments:
at 9000 bytes a window opens six times faster in bytes); the relay moves about 1.5 Gbit/s at
1500 and 5-7 Gbit/s at 9000 here, either well ahead of 200 Mbit/s. Namespaces, devices, the
relay and processes started in the namespaces are removed on exit, also after an exception or
Ctrl-C.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from bench import netns

REPO = Path(__file__).resolve().parent.parent
SUBNET, ADDR_A, ADDR_B = "10.99.0.0/24", "10.99.0.1", "10.99.0.2"
TCP_RMEM = "4096 131072 6291456"  # Linux's defaults (this machine's are 32 MiB / 4 MiB)
TCP_WMEM = "4096 16384 4194304"
_seq = itertools.count()


class WanLinkUnavailable(RuntimeError):
    """This machine cannot build the link; ``str`` says why, ``code`` in one word."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def check_available() -> str:
    """The ``ip`` binary to use; raises ``WanLinkUnavailable`` with the reason otherwise."""
    if os.geteuid() != 0:
        raise WanLinkUnavailable("not_root", "needs root: network namespaces and TUN devices")
    if not os.path.exists("/dev/net/tun"):
        raise WanLinkUnavailable("no_tun", "/dev/net/tun is missing")
    ip = netns.ip_binary()
    if ip is None:
        raise WanLinkUnavailable("no_ip", "the `ip` command (iproute2) is not installed")
    return ip


class WanLink:
    """Two namespaces ``a`` and ``b`` joined by an emulated WAN link; a context manager.

    Parameters
    ----------
    delay_s
        One-way delay, each direction (the RTT is twice this).
    rate_mbit
        Bottleneck rate each direction, Mbit/s; ``None`` for no cap (the relay's own speed).
    queue_bytes
        Bottleneck FIFO per direction; default one bandwidth-delay product.
    mtu
        MTU of the two TUN devices.
    congestion
        TCP congestion control for connections over the link (``ip route ... congctl``).
    realtime
        Run the relay at real-time priority where allowed (see ``wan_relay.raise_priority``).
    slow_start_after_idle
        ``net.ipv4.tcp_slow_start_after_idle`` in both namespaces: Linux's default (``True``)
        starts a connection's window over after it sat idle for a retransmission timeout, so a
        connection kept from round to round of a job ramps up afresh every round; ``False`` is
        the usual tuning of WAN hosts, where a kept connection keeps its window.
    """

    def __init__(
        self,
        delay_s: float = 0.04,
        rate_mbit: float | None = 200.0,
        queue_bytes: int | None = None,
        *,
        mtu: int = 1500,
        congestion: str = "cubic",
        tcp_rmem: str = TCP_RMEM,
        tcp_wmem: str = TCP_WMEM,
        realtime: bool = True,
        slow_start_after_idle: bool = True,
    ) -> None:
        self.mtu, self.congestion, self.realtime = mtu, congestion, realtime
        self.slow_start_after_idle = slow_start_after_idle
        self.relay_priority = "not started"
        self.tcp_rmem, self.tcp_wmem = tcp_rmem, tcp_wmem
        self.delay_s, self.rate_mbit = delay_s, rate_mbit
        self.queue_bytes = queue_bytes if queue_bytes is not None else self.bdp_bytes
        self.addr_a, self.addr_b = ADDR_A, ADDR_B
        seq, pid = next(_seq), os.getpid()
        self.names = {s: f"isth-{s}-{pid}-{seq}" for s in "ab"}
        self.devices = {s: f"it{pid}-{seq}{s}" for s in "ab"}
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._relay: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._old_sigterm = None

    @property
    def bdp_bytes(self) -> int:
        """Bytes in flight that fill the link for one round trip (at least 64 KiB)."""
        if not self.rate_mbit:
            return 1 << 26
        return max(1 << 16, int(self.rate_mbit * 1e6 / 8 * 2 * self.delay_s))

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> WanLink:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> WanLink:
        self.ip = check_available()
        self._trap_sigterm()
        try:
            netns.sweep_stale(self.ip)
            self._start_relay()
            for side, addr in (("a", self.addr_a), ("b", self.addr_b)):
                self._make_namespace(side, addr)
        except BaseException:
            self.close()
            raise
        return self

    def _trap_sigterm(self) -> None:
        # `kill` of the bench must unwind through close() like Ctrl-C does.
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)

    def _start_relay(self) -> None:
        rate = (self.rate_mbit or 0) * 1e6
        argv = [sys.executable, "-m", "bench.wan_relay", self.devices["a"], self.devices["b"]]
        argv += [repr(self.delay_s), repr(rate), str(self.queue_bytes), str(int(self.realtime))]
        self._relay = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.relay_priority = self._reply()["priority"]  # the devices exist once it says so

    def _make_namespace(self, side: str, addr: str) -> None:
        ns = self.names[side]
        netns.run([self.ip, "netns", "add", ns])
        self._made.append(ns)
        # Before the device arrives: IPv6 off so no router solicitations cross the link.
        sysctls = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        sysctls += [f"net.ipv4.tcp_rmem={self.tcp_rmem}", f"net.ipv4.tcp_wmem={self.tcp_wmem}"]
        sysctls += ["net.ipv4.tcp_no_metrics_save=1"]  # no ssthresh carried between runs
        sysctls += [f"net.ipv4.tcp_slow_start_after_idle={int(self.slow_start_after_idle)}"]
        netns.run([self.ip, "netns", "exec", ns, "sysctl", "-q", "-w", *sysctls])
        dev = self.devices[side]
        netns.configure(self.ip, ns, dev, addr, SUBNET, self.mtu, self.congestion)

    def close(self) -> None:
        """Stop everything started here; safe to call twice and after a failed start."""
        for proc in self._procs:
            netns.stop(proc)
        self._procs.clear()
        for ns in self._made:
            netns.kill_left_in(self.ip, ns)
        if self._relay is not None:
            with contextlib.suppress(OSError):
                self._relay.stdin.close()  # end of commands: the relay exits, devices vanish
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._relay.wait(2.0)
            netns.stop(self._relay)
            self._relay = None
        for ns in self._made:
            subprocess.run([self.ip, "netns", "del", ns], capture_output=True)
        self._made.clear()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # ---- the relay --------------------------------------------------------------------------

    def _reply(self) -> dict:
        line = self._relay.stdout.readline()
        if not line:
            raise RuntimeError(f"the WAN relay exited ({self._relay.wait()})")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"the WAN relay refused: {reply}")
        return reply

    def _command(self, **msg) -> dict:
        with self._lock:
            self._relay.stdin.write(json.dumps(msg) + "\n")
            self._relay.stdin.flush()
            return self._reply()

    def configure(
        self, delay_s: float, rate_mbit: float | None, queue_bytes: int | None = None
    ) -> None:
        """Change the link for packets that arrive from now on (both directions)."""
        self.delay_s, self.rate_mbit = delay_s, rate_mbit
        self.queue_bytes = queue_bytes if queue_bytes is not None else self.bdp_bytes
        rate = (rate_mbit or 0) * 1e6
        self._command(cmd="set", delay_s=delay_s, rate_bps=rate, queue_bytes=self.queue_bytes)

    def stats(self) -> dict:
        """Counters per direction (``a_to_b``, ``b_to_a``) since the link started."""
        return self._command(cmd="stats")

    def relay_cpu_s(self) -> float:
        """CPU seconds the relay process has used so far (user and system)."""
        fields = Path(f"/proc/{self._relay.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tcp_counters(self, side: str) -> dict[str, int]:
        """The namespace's TCP counters (``/proc/net/snmp``: ``OutSegs``, ``RetransSegs``...)."""
        rows = [x.split() for x in self.run_in(side, "cat /proc/net/snmp").stdout.splitlines()]
        names, values = [r for r in rows if r and r[0] == "Tcp:"][:2]
        return {n: int(v) for n, v in zip(names[1:], values[1:], strict=True)}

    # ---- running things in the namespaces -------------------------------------------------

    def argv_in(self, side: str, argv: list[str]) -> list[str]:
        return [self.ip, "netns", "exec", self.names[side], *argv]

    def popen_in(self, side: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in namespace ``side``; stopped by ``close`` if still running."""
        kw.setdefault("cwd", REPO)
        proc = subprocess.Popen(self.argv_in(side, argv), preexec_fn=netns.die_with_parent, **kw)
        self._procs.append(proc)
        return proc

    def run_in(self, side: str, cmd: str | list[str], *, timeout: float = 120, check=True):
        """Run ``cmd`` (a shell line or an argv) in ``side``; its ``CompletedProcess``."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else cmd
        return subprocess.run(
            self.argv_in(side, argv), cwd=REPO, capture_output=True, text=True,
            timeout=timeout, check=check, preexec_fn=netns.die_with_parent,
        )  # fmt: skip

    def start_call(self, side: str, target: str, *args) -> subprocess.Popen:
        """Start ``module:function(*args)`` in a Python process in ``side`` (JSON arguments)."""
        argv = netns.call_argv(target, args)
        return self.popen_in(side, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish_call(self, proc: subprocess.Popen, timeout: float = 600):
        """The JSON result of a ``start_call`` process, once it exits."""
        return netns.call_result(proc, timeout)

    def call_in(self, side: str, target: str, *args, timeout: float = 600):
        """``module:function(*args)`` run in namespace ``side``; its JSON-able result."""
        return self.finish_call(self.start_call(side, target, *args), timeout)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)
