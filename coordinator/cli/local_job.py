"""``coordinator local``: a whole job on this machine, the way it runs across datacenters.

It makes the job's PKI (the coordinator's certificate for ``127.0.0.1`` and ``localhost``, one
bundle per site, an operator's for the progress display), starts ``coordinator serve`` and N
``siteclient start`` agents over mutual TLS on loopback, each a process of its own as on real
sites, shows the rounds as they close, and ends with the summary (``local_report``). Ctrl-C
stops every process cleanly; the same command resumes the job from its state. Every process
starts with the folders that hold the job's own modules first on its PYTHONPATH
(``coordinator.import_path``), so the job runs from any working directory.

Layout of ``--run-dir`` (default ``runs/local``): ``pki/``, ``coordinator/`` (its state folder,
the final model in ``coordinator/final/``), ``site-<i>/`` (each agent's run folder), a log per
process and ``metrics.png``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

OPERATOR = "local-operator"


@dataclass(frozen=True)
class LocalPlan:
    """What to run: every process's command line, decided before anything starts."""

    run_dir: Path
    config: Path
    sites: tuple[str, ...]
    nproc_per_node: int
    script: tuple[str, ...]  # the training script and its arguments
    overrides: tuple[str, ...] = ()
    # Folders holding the job's own modules (``coordinator.import_path``), first on every
    # process's PYTHONPATH: the job imports the same code whatever the working directory.
    import_path: tuple[Path, ...] = ()

    @property
    def state_dir(self) -> Path:
        return self.run_dir / "coordinator"

    @property
    def pki(self) -> Path:
        return self.run_dir / "pki"

    def environ(self) -> dict[str, str]:
        """The environment of every process: this one's, with ``import_path`` first."""
        from coordinator.import_path import with_import_path

        return with_import_path(os.environ, self.import_path)

    def serve_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "coordinator.cli", "serve", "--config", str(self.config)]
        cmd += ["--listen", "127.0.0.1:0", "--state-dir", str(self.state_dir)]
        cmd += ["--tls-dir", str(self.pki / "coordinator"), "--crl", str(self.pki / "crl.pem")]
        return cmd + [f for kv in self.overrides for f in ("--set", kv)]

    def site_command(self, site: str, address: str) -> list[str]:
        return [
            sys.executable, "-m", "site_client.cli", "start", "--coordinator", address,
            "--site", site, "--run-dir", str(self.run_dir / site),
            "--tls-dir", str(self.pki / "sites" / site),
            "--nproc-per-node", str(self.nproc_per_node), "--", *self.script,
        ]  # fmt: skip


def site_names(n: int) -> tuple[str, ...]:
    return tuple(f"site-{i}" for i in range(n))


def make_pki(plan: LocalPlan) -> None:
    """The job's CA and every party's bundle, unless a previous run made them."""
    from wire.identity import init_ca, issue

    ca = plan.pki
    if not (ca / "ca.pem").exists():
        init_ca(ca, "isthmus-local")
    wanted = {
        ca / "coordinator": ("coordinator", "coordinator", ("127.0.0.1", "localhost")),
        ca / "operators" / OPERATOR: ("operator", OPERATOR, ()),
        **{ca / "sites" / s: ("site", s, ()) for s in plan.sites},
    }
    for folder, (role, name, hosts) in wanted.items():
        if not (folder / "cert.pem").exists():
            issue(ca, role, name, folder, hosts=hosts)


class Processes:
    """The job's processes, each in its own session: a Ctrl-C at the terminal reaches this
    process only, which then stops them in order (sites first, then the coordinator)."""

    def __init__(self, run_dir: Path, environ: dict[str, str] | None = None) -> None:
        self.run_dir, self.environ = run_dir, environ
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "a")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.environ, start_new_session=True
        )
        self.procs[name] = proc
        return proc

    def failed(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() not in (None, 0)]

    def running(self, names) -> bool:
        return any(self.procs[n].poll() is None for n in names if n in self.procs)

    def stop(self, names, grace_s: float = 30.0) -> None:
        """SIGTERM (a clean stop), then SIGKILL of the whole group after ``grace_s``."""
        live = [self.procs[n] for n in names if n in self.procs and self.procs[n].poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=10)

    def close(self) -> None:
        for log in self._logs:
            log.close()

    def tail(self, name: str, n: int = 15) -> str:
        try:
            return "\n".join((self.run_dir / f"{name}.log").read_text().splitlines()[-n:])
        except OSError:
            return ""


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)


def wait_listening(procs: Processes, state_dir: Path, timeout_s: float) -> str | None:
    """The coordinator's address once it listens; None if it exited first (its log says
    why, or that the job is already complete)."""
    address = state_dir / "address"
    coordinator = procs.procs["coordinator"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if address.exists() and (text := address.read_text().strip()):
            return text
        if coordinator.poll() is not None:
            return None
        time.sleep(0.05)
    raise TimeoutError(f"the coordinator did not listen within {timeout_s:.0f}s")
