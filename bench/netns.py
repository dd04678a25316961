"""Network namespaces and the processes run in them, for ``bench.wan_link``.

Python 3.11 has no ``os.setns``, so everything runs through ``ip netns exec``, which enters
the namespace and execs the command (the pid we hold is the command's own). A Python function
runs in a namespace as ``python -m bench.netns call MODULE:FUNCTION JSON_ARGS``: its result
comes back as JSON on the last line of stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

RESULT = "NETNS-RESULT "
NAME = re.compile(r"^isth-[ab]-(\d+)-\d+$")  # isth-<side>-<creating pid>-<sequence>


def ip_binary() -> str | None:
    found = shutil.which("ip")
    return found or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)


def run(argv: list[str]) -> None:
    """Run a configuration command; raise with its stderr if it fails."""
    got = subprocess.run(argv, capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {got.stderr.strip()}")


def configure(ip: str, ns: str, dev: str, addr: str, subnet: str, mtu: int, cc: str) -> None:
    """Move TUN device ``dev`` into the (new, empty) namespace ``ns`` and bring it up."""
    n = ["-n", ns]
    run([ip, "link", "set", dev, "netns", ns])
    run([ip, *n, "link", "set", "lo", "up"])
    run([ip, *n, "link", "set", dev, "mtu", str(mtu), "txqueuelen", "1000"])
    run([ip, *n, "addr", "add", f"{addr}/{subnet.split('/')[1]}", "dev", dev])
    run([ip, *n, "link", "set", dev, "up"])
    # The congestion control rides on the route: a namespace may only choose its default from
    # tcp_allowed_congestion_control (global; "reno bbr" here), a route may name any.
    run([ip, *n, "route", "replace", subnet, "dev", dev, "src", addr, "congctl", cc])


def die_with_parent() -> None:
    # Runs in the child between fork and exec: a bench killed with -9 leaves no process behind.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; close its pipes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            with contextlib.suppress(OSError, ValueError):
                f.close()


def kill_left_in(ip: str, ns: str) -> None:
    """Kill what still runs in our namespace (children of children): all of it is ours."""
    got = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True)
    for pid in got.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has not been reaped yet


def sweep_stale(ip: str) -> None:
    """Delete our kind of namespace whose creating process is gone (a bench killed with -9)."""
    got = subprocess.run([ip, "netns", "list"], capture_output=True, text=True)
    for line in got.stdout.splitlines():
        m = NAME.match(line.split()[0]) if line.strip() else None
        if m and not _alive(int(m.group(1))):
            subprocess.run([ip, "netns", "del", line.split()[0]], capture_output=True)


def call_argv(target: str, args: tuple) -> list[str]:
    """The command that runs ``target`` (``module:function``) on JSON ``args``."""
    return [sys.executable, "-m", "bench.netns", "call", target, json.dumps(args)]


def call_result(proc: subprocess.Popen, timeout: float):
    """Wait for a ``call_argv`` process (stdout and stderr piped); its JSON result."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise
    lines = [x for x in out.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"call in a namespace failed ({proc.returncode}): {err[-3000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def _call(target: str, args_json: str) -> int:
    module, _, func = target.partition(":")
    result = getattr(importlib.import_module(module), func)(*json.loads(args_json))
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "call":
        sys.exit("usage: python -m bench.netns call MODULE:FUNCTION JSON_ARGS")
    sys.exit(_call(sys.argv[2], sys.argv[3]))
