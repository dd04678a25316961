"""A real etcd for tests: Debian's ``etcd-server`` (3.4) binary, one member on loopback.

``etcd_binary()`` finds ``etcd`` on PATH (``make test`` installs the package when it is
absent); ``EtcdServer`` starts one member with its data under a test folder, client and peer
URLs on free loopback ports, waits until ``/health`` answers, and stops it with SIGTERM
(SIGKILL after a few seconds: its data is a test's, thrown away). Its log (``etcd.log``) and
any temporary file (``tmp/``, its TMPDIR) stay in that folder too.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from server_process import log_tail, scratch_env, stop_process


def etcd_binary() -> str | None:
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").is_file() else None)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdServer:
    """One etcd member serving clients on 127.0.0.1 with its data under ``folder``."""

    def __init__(self, folder: Path, binary: str) -> None:
        self.folder, self.binary = Path(folder), binary
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The ``--ha`` URL of this member."""
        return f"etcd://{self.endpoint}"

    def start(self, timeout: float = 30.0) -> str:
        self.port, peer = _free_ports(2)
        client, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        cmd = [self.binary, "--name", "test", "--data-dir", str(self.folder / "data")]
        cmd += ["--listen-client-urls", client, "--advertise-client-urls", client]
        cmd += ["--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url]
        cmd += ["--initial-cluster", f"test={peer_url}", "--log-level", "warn"]
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "etcd.log", "w")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=scratch_env(self.folder)
            )
        finally:
            log.close()
        try:
            self._wait(client, timeout)
        except BaseException:
            self.stop()
            raise
        return self.endpoint

    def _wait(self, client: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=2) as reply:
                    if json.loads(reply.read()).get("health") == "true":
                        return
            except (OSError, ValueError) as exc:  # not listening yet
                last = exc
            time.sleep(0.05)
        raise TimeoutError(f"etcd did not become healthy ({last}):\n{self.log_tail()}")

    def stop(self) -> None:
        stop_process(self.proc, grace_s=5)

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.folder / "etcd.log", n)
