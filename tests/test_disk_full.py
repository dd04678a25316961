"""A coordinator whose disk fills up: on a real small tmpfs (mounted here, so root only).

A write that fails part-way must leave the upload's file at the acknowledged length, the site
must be told to retry (RESOURCE_EXHAUSTED, "coordinator disk full"), and once space returns the
round completes with the same theta as on a roomy disk. A checkpoint or close record that
cannot be written leaves the previous checkpoint as it was and is written once space returns.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from core_helpers import Clock, new_core

from coordinator.records import PushHeader, Refused
from wire.digest import payload_digest
from wire.tensors import pack

SITES = ("site-a", "site-b")
MODEL = {"factory": "torch.nn:Linear", "kwargs": {"in_features": 8192, "out_features": 8}}
CHUNK = 64 << 10


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at tmp_path/disk, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Take all the space on ``disk`` but ``leave_bytes`` (rounded down to pages)."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        block = memoryview(b"\0" * (64 << 10))
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with open(ballast, "r+b") as f:
        f.truncate(max(0, ballast.stat().st_size - leave_bytes))
    return ballast


def deltas(core):
    g = torch.Generator().manual_seed(3)
    return {
        site: {n: torch.randn(core.theta[n].shape, generator=g) for n in core.trainable}
        for site in SITES
    }


def begin(core, site, token, manifest):
    header = PushHeader(
        site=site,
        token=token,
        round=0,
        upload_id=f"{site}-0",
        manifest=manifest.to_proto(),
        weight=1.0,
        base_version=0,
    )
    return core.begin_upload(header)


def send(core, upload, payload, start: int, stop: int, token: int) -> None:
    for offset in range(start, stop, CHUNK):
        core.upload_chunk(upload, offset, bytes(payload[offset : min(offset + CHUNK, stop)]), token)


def start(folder, clock):
    core = new_core(folder, clock, model=MODEL, rounds={"total": 2})
    tokens = {s: core.join(s)[0].token for s in SITES}
    core.tick()
    return core, tokens


def roomy_theta(tmp_path) -> bytes:
    """theta_1's hash on a disk with room: the same pushes, in one go."""
    core, tokens = start(tmp_path / "roomy", Clock())
    for site, delta in deltas(core).items():
        manifest, payload = pack(delta)
        upload = begin(core, site, tokens[site], manifest)
        send(core, upload, payload, 0, manifest.total_bytes, tokens[site])
        assert core.finish_upload(upload, tokens[site])
        core.release_upload(upload)
    core.tick()
    core.writer.wait()
    theta_hash = core.published.theta_hash
    core.close()
    return theta_hash


def test_a_write_that_fails_part_way_is_cut_back_and_resumes_whole(small_disk, tmp_path):
    clock = Clock()
    core, tokens = start(small_disk, clock)
    a, b = deltas(core).values()
    manifest, payload = pack(a)
    upload = begin(core, "site-a", tokens["site-a"], manifest)
    send(core, upload, payload, 0, CHUNK, tokens["site-a"])
    ballast = fill(small_disk, leave_bytes=16 << 10)  # the next chunk fits only in part
    with pytest.raises(Refused) as refused:
        send(core, upload, payload, CHUNK, 2 * CHUNK, tokens["site-a"])
    assert refused.value.code == "full" and "coordinator disk full" in str(refused.value)
    core.release_upload(upload)
    assert upload.path.stat().st_size == upload.received == CHUNK  # nothing past the ack

    ballast.unlink()  # space returns; the site resumes from the acknowledged offset
    upload = begin(core, "site-a", tokens["site-a"], manifest)
    assert upload.received == CHUNK
    send(core, upload, payload, CHUNK, manifest.total_bytes, tokens["site-a"])
    assert core.finish_upload(upload, tokens["site-a"])
    core.release_upload(upload)
    (spooled,) = core.spool.completed(0)
    data = spooled.path.read_bytes()
    assert len(data) == manifest.total_bytes
    assert payload_digest(data) == manifest.digest

    manifest_b, payload_b = pack(b)
    upload = begin(core, "site-b", tokens["site-b"], manifest_b)
    send(core, upload, payload_b, 0, manifest_b.total_bytes, tokens["site-b"])
    assert core.finish_upload(upload, tokens["site-b"])
    core.release_upload(upload)
    core.tick()
    core.writer.wait()
    assert core.published.theta_hash == roomy_theta(tmp_path)
    core.close()


def test_a_full_disk_at_the_close_keeps_the_last_checkpoint_and_the_round(small_disk, tmp_path):
    clock = Clock()
    core, tokens = start(small_disk, clock)
    for site, delta in deltas(core).items():
        manifest, payload = pack(delta)
        upload = begin(core, site, tokens[site], manifest)
        send(core, upload, payload, 0, manifest.total_bytes, tokens[site])
        assert core.finish_upload(upload, tokens[site])
        core.release_upload(upload)
    checkpoints = small_disk / "state" / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    latest = (checkpoints / "LATEST").read_text()
    ballast = fill(small_disk, leave_bytes=0)
    closing = threading.Thread(target=core.tick)  # waits for space to record the close
    closing.start()
    time.sleep(1.5)
    assert closing.is_alive()
    assert core.round.number == 0 and core.published.version == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == before  # no debris either
    assert (checkpoints / "LATEST").read_text() == latest

    ballast.unlink()
    closing.join(timeout=30)
    assert not closing.is_alive()
    core.writer.wait()
    assert core.published.version == 1
    assert (checkpoints / "LATEST").read_text().strip() == "round-00000001"
    assert core.published.theta_hash == roomy_theta(tmp_path)
    core.close()


def test_a_job_whose_disk_fills_mid_round_completes_once_space_returns(small_disk, tmp_path):
    import coord_harness as h
    import test_coordinator_e2e as e2e

    cfg = h.job_config(strategy=e2e.STRATEGIES["fedavg"], model={"kwargs": {"d_in": 4096}})
    roomy = h.start_coordinator(tmp_path / "roomy", cfg)
    try:
        want = e2e.check_job(e2e.run_job(roomy), e2e.STRATEGIES["fedavg"])
    finally:
        roomy.kill()

    coord = h.start_coordinator(small_disk, cfg)
    hooks = e2e.Hooks()
    for site in e2e.SITES:
        hooks.pause(site, "before_push", 1)
    seen = {}

    def during(logs):
        for site in e2e.SITES:
            hooks.wait_arrived(site, "before_push", 1)
        ballast = fill(small_disk, leave_bytes=16 << 10)  # an update fits only in part
        for site in e2e.SITES:
            hooks.release(site, "before_push", 1)
        h.wait_until(
            lambda: all(any("disk full" in r for r in log.retries) for log in logs),
            timeout=20,
            what="both sites told the disk is full",
        )
        parts = list((small_disk / "state" / "spool").rglob("*.part"))
        seen["part_sizes"] = [p.stat().st_size for p in parts]
        ballast.unlink()

    try:
        logs = e2e.run_job(coord, hooks=hooks, during=during)
        got = e2e.check_job(logs, e2e.STRATEGIES["fedavg"])
        assert coord.wait(timeout=20) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert got == want  # the crash-free run's theta, every round
    assert seen["part_sizes"] and set(seen["part_sizes"]) == {0}  # nothing past the ack
    for log in logs:
        assert all(reply.complete for reply in log.replies.values())


def test_events_wait_in_order_while_the_disk_is_full(small_disk):
    from coordinator.events.log import EventLog, EventSink, read_events

    events = EventLog(small_disk / "events.jsonl")
    sink = EventSink(events)
    sink.post("first", n=1)
    sink.flush()
    ballast = fill(small_disk, leave_bytes=0)
    for n in (2, 3):
        sink.post("waiting", n=n, pad="x" * 5000)  # past the file's last page
        sink.flush()  # does not raise: the caller's work is done and durable elsewhere
    assert [e["kind"] for e in read_events(events.path)] == ["first"]
    ballast.unlink()
    sink.post("after", n=4)
    sink.flush()
    events.close()
    assert [e.get("n") for e in read_events(small_disk / "events.jsonl")] == [1, 2, 3, 4]
