"""End to end: a real ``coordinator serve`` keeping its checkpoints in a real SeaweedFS (S3),
killed with -9 mid-job and restarted from the object store's checkpoint alone; then the model
exported from the object store."""

from __future__ import annotations

import signal
import threading
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from coordinator.persist.open_store import open_store
from site_client.transfer.client import CoordinatorClient
from wire.digest import state_digest
from wire.objstore.config import StorageConfig

pytestmark = pytest.mark.e2e
ROUNDS = 4


def _push_rounds(address: str, site: str, rounds: int) -> None:
    """Join and push ``rounds`` rounds' updates, then go away without leaving."""
    client = CoordinatorClient(address, site, backoff=h.FAST_BACKOFF, rpc_timeout_s=5.0)
    try:
        client.join()
        last = -1
        for _ in range(rounds):
            info = client.wait_for_round(after=last, poll_s=0.05)
            g = client.fetch()
            client.push(info.round, {n: torch.full_like(g.theta[n], 0.01) for n in h.TRAINABLE})
            last = info.round
        client.wait_for_round(after=last, poll_s=0.05)
    finally:
        client.close()


def test_serve_checkpoints_to_s3_and_resumes_from_there(seaweed, monkeypatch, tmp_path: Path):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)  # the coordinator process inherits them
    url = f"s3://{seaweed.bucket}/{uuid.uuid4().hex}/job"
    store = open_store(tmp_path, StorageConfig(url))
    cfg = h.job_config(storage={"url": url})
    cfg["rounds"].update(total=ROUNDS, max_sites=1)
    coord = h.start_coordinator(tmp_path, cfg)
    try:
        _push_rounds(coord.address, "site-a", 2)
        h.wait_until(lambda: 2 in store.kept_rounds(), what="round 2's checkpoint in S3")
        before = h.status(coord.address)
        assert before.round.round == 2
        coord.kill(signal.SIGKILL)
        state = tmp_path / "state"
        assert not (state / "checkpoints").exists(), "checkpoints went to the local folder"
        assert (state / "events.jsonl").exists() and (state / "spool").is_dir()  # stay local
        coord.restart()
        after = h.status(coord.address)
        assert after.round.round == 2 and after.round.theta_hash == before.round.theta_hash
        final: list[bytes] = []
        site = threading.Thread(target=lambda: final.append(h.drive_site(coord.address, "site-a")))
        site.start()
        site.join(timeout=60)
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.stop()
    assert store.kept_rounds() == [2, 3, 4]
    last = store.load_round(ROUNDS)
    assert final == [state_digest(last.theta)]
    assert last.meta["job"] == "testjob"
    model = load_file(str(state / "final" / "model.safetensors"))  # written at the job's end
    assert state_digest(model) == state_digest(last.theta)
    out = tmp_path / "exported.safetensors"
    done = h.run_cli("export", "--state-dir", str(state), "--storage-url", url, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert state_digest(load_file(str(out))) == state_digest(last.theta)


def test_serve_without_credentials_says_which_and_touches_nothing(monkeypatch, tmp_path: Path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    cfg = h.job_config(storage={"url": "s3://bucket/job"})
    path = h.write_config(tmp_path, cfg)
    done = h.run_cli("serve", "--config", str(path), "--insecure", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "coordinator: error: storage.url = 's3://bucket/job': AWS_ACCESS_KEY_ID is not set "
        "(the other half of the key is)"
    )
    assert not (tmp_path / "state").exists()
