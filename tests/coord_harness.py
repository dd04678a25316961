"""Helpers for tests that drive a real coordinator process over real gRPC on 127.0.0.1.

``CoordinatorProcess`` starts ``python -m coordinator.cli serve`` (or the ``coordinator``
console
script) on a job config written by ``write_config``, waits for the ``state_dir/address`` file the
server writes once it listens, and stops or kills it. ``tiny_model`` is the model factory the
test configs name (``coord_harness:tiny_model``): the coordinator process finds it because
``PYTHONPATH`` includes this folder.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_process import log_tail, stop_process

from wire.backoff import BackoffPolicy
from wire.net.grpc_options import channel_options
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
FAST_BACKOFF = BackoffPolicy(initial_s=0.05, cap_s=0.5, deadline_s=20)


class TinyModel(torch.nn.Module):
    """A linear layer plus an integer buffer (in theta, but not trainable: never in updates)."""

    def __init__(self, d_in: int = 8, d_out: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d_in, d_out)
        self.register_buffer("seen", torch.arange(3, dtype=torch.int64))


def tiny_model(d_in: int = 8, d_out: int = 16) -> torch.nn.Module:
    return TinyModel(d_in, d_out)


TRAINABLE = ("lin.bias", "lin.weight")


class BlocksModel(torch.nn.Module):
    """``blocks`` linear layers (``blocks.B.weight``, ``blocks.B.bias``), an embedding and a
    head outside any block, and an integer buffer: what ``[streaming]`` splits in fragments."""

    def __init__(self, blocks: int = 4, d: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))
        self.head = torch.nn.Linear(d, 4)
        self.register_buffer("seen", torch.arange(3, dtype=torch.int64))


def blocks_model(blocks: int = 4, d: int = 8) -> torch.nn.Module:
    return BlocksModel(blocks, d)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def job_config(
    name: str = "testjob",
    strategy: dict | None = None,
    **sections: dict,
) -> dict[str, dict]:
    """A small, fast job config as nested dicts; ``sections`` update the defaults by table."""
    cfg: dict[str, dict] = {
        "job": {"name": name, "state_dir": "state"},
        "model": {"factory": "coord_harness:tiny_model", "seed": 0, "kwargs": {"d_in": 8}},
        "strategy": strategy or {"name": "fedavg"},
        "rounds": {
            "total": 3,
            "inner_steps": 1,
            "min_sites": 1,
            "max_sites": 2,
            "join_window_s": 0.5,
            "deadline_s": 30.0,
        },
        "timeouts": {"heartbeat_interval_s": 0.2, "lease_ttl_s": 6.0},
        "server": {"listen": "127.0.0.1:0", "workers": 8},
    }
    for table, values in sections.items():
        cfg.setdefault(table, {}).update(values)
    return cfg


def write_config(folder: Path, cfg: dict[str, dict], filename: str = "job.toml") -> Path:
    lines = []
    for table, values in cfg.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    path = Path(folder) / filename
    path.write_text("\n".join(lines))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(REPO), str(TESTS)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def coordinator_command() -> list[str]:
    """The ``coordinator`` console script beside this Python, else ``python -m``."""
    script = Path(sys.executable).parent / "coordinator"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "coordinator.cli"]


def run_cli(*args: str, timeout: float = 60.0, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return _run([*coordinator_command(), *args], timeout, cwd=cwd)


def run_cli_module(
    module: str,
    *args: str,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """``python -m module args`` (``site_client.cli``, ...) as ``run_cli`` runs ``coordinator``;
    ``env``: variables set on top of the test's environment."""
    return _run([sys.executable, "-m", module, *args], timeout, env, cwd)


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO):
    return subprocess.run(
        cmd,
        cwd=cwd,
        env={**subprocess_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class CoordinatorProcess:
    """One ``coordinator serve`` process on a job config; restartable on the same state."""

    def __init__(
        self,
        config_path: Path,
        state_dir: Path,
        log_path: Path,
        tls_dir: Path | None = None,
        crl: Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """Plaintext (``--insecure``) unless ``tls_dir`` names the coordinator's bundle;
        ``extra_args`` go to ``serve`` as they are."""
        self.tls_dir = tls_dir
        self.extra_args = tuple(extra_args)
        self.crl = crl
        self.config_path = Path(config_path)
        self.state_dir = Path(state_dir)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.starts = 0

    @property
    def port(self) -> int:
        assert self.address is not None
        return int(self.address.rpartition(":")[2])

    def start(self, listen: str | None = None, timeout: float = 30.0) -> str:
        """Start serving (on ``listen``, default the config's) and return HOST:PORT."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        address_file = self.state_dir / "address"
        address_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--config",
            str(self.config_path),
        ]
        cmd += ["--tls-dir", str(self.tls_dir)] if self.tls_dir else ["--insecure"]
        if self.crl:
            cmd += ["--crl", str(self.crl)]
        if listen:
            cmd += ["--listen", listen]
        cmd += self.extra_args
        self.starts += 1
        log = open(self.log_path, "a")  # noqa: SIM115 - handed to the child, closed below
        log.write(f"\n===== start {self.starts}: {' '.join(cmd)}\n")
        log.flush()
        try:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT
            )
        finally:
            log.close()
        try:
            return self._wait_listening(address_file, timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_listening(self, address_file: Path, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if address_file.exists():
                text = address_file.read_text().strip()
                if text:
                    self.address = text
                    if self.tls_dir is None:  # the address file is written once it serves
                        wait_serving(self.address)
                    return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"coordinator exited with {self.proc.returncode} before listening:\n"
                    + self.log_tail()
                )
            time.sleep(0.02)
        raise TimeoutError(f"coordinator did not write {address_file}:\n" + self.log_tail())

    def restart(self, timeout: float = 30.0) -> str:
        """Start again on the same state folder and the same port."""
        assert self.address is not None
        return self.start(listen=self.address, timeout=timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not go within a few seconds."""
        stop_process(self.proc, grace_s=10)

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)


def start_coordinator(folder: Path, cfg: dict[str, dict], **start_kw) -> CoordinatorProcess:
    """Write ``cfg`` into ``folder`` and start a coordinator on it (state in folder/state)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = write_config(folder, cfg)
    proc = CoordinatorProcess(path, folder / cfg["job"]["state_dir"], folder / "coordinator.log")
    proc.start(**start_kw)
    return proc


def wait_serving(address: str, timeout: float = 10.0) -> None:
    with grpc.insecure_channel(address, options=channel_options()) as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout)


class RawStub:
    """The generated stub on its own channel, for hand-crafted (hostile) messages."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def status(self) -> pb.StatusReply:
        return self.stub.Status(pb.StatusRequest(), timeout=10)

    def close(self) -> None:
        self.channel.close()


def status(address: str) -> pb.StatusReply:
    """One Status call on a fresh channel."""
    raw = RawStub(address)
    try:
        return raw.status()
    finally:
        raw.close()


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def start_with_metrics(folder: Path, cfg: dict[str, dict]) -> tuple[CoordinatorProcess, str]:
    """A plaintext coordinator on ``cfg`` in ``folder`` (state, log), serving metrics on a free
    port: the running process and its metrics address."""
    coord = CoordinatorProcess(
        write_config(folder, cfg),
        Path(folder) / "state",
        Path(folder) / "coordinator.log",
        extra_args=("--metrics", "127.0.0.1:0"),
    )
    coord.start()
    return coord, (Path(folder) / "state" / "metrics_address").read_text().strip()


def scrape_metrics(address: str) -> dict[tuple[str, tuple], float]:
    """Every Prometheus sample served at ``address``, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def drive_site(address: str, site: str, tls=None, step: float = 0.01, stop=None) -> bytes:
    """One site through a whole job, in this thread: each round fetch theta_r, push a small
    fixed pseudo-gradient (``step`` on every trainable tensor), then fetch the final theta
    and leave. Returns the final theta's hash. ``stop()`` true: leave before the job ends."""
    from site_client.transfer.client import CoordinatorClient

    client = CoordinatorClient(address, site, tls=tls, backoff=FAST_BACKOFF, rpc_timeout_s=5.0)
    try:
        client.join()
        last = -1
        while not (stop and stop()):
            info = client.wait_for_round(after=last, poll_s=0.05)
            if info.finished:
                break
            g = client.fetch()
            delta = {n: torch.full_like(g.theta[n], step) for n in TRAINABLE}
            client.push(info.round, delta, base_version=g.version)
            last = info.round
        final = client.fetch()
        client.leave("done")
        return final.theta_hash
    finally:
        client.close()
