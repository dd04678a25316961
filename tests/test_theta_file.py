"""theta_r lives in its file, not in the coordinator's memory
(``coordinator.persist.theta_file``)."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from core_helpers import Clock, delta_like, heartbeat_all, new_core, push

from coordinator.persist.theta_file import (
    ThetaFile,
    ThetaSource,
    block_size,
    clear_theta_files,
    link_theta_file,
    write_theta_file,
)
from coordinator.persist.theta_writer import ThetaFiles
from coordinator.records import FatalError
from coordinator.round.spare_buffer import holders
from strategies.diloco import DiLoCo
from strategies.fedavg import FedAvg
from wire.digest import payload_digest, state_digest
from wire.safetensors_io import file_state_digest, write_tensors
from wire.theta import ThetaBuffer


def _theta(seed: int = 0) -> ThetaBuffer:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "w": torch.randn(300, 70, generator=g),
        "b": torch.randn(70, generator=g),
        "steps": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
    }
    return ThetaBuffer.copy_of(tensors)


def _rss_file_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile"):
                return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_the_file_holds_thetas_bytes_and_reads_them_back(tmp_path):
    theta = _theta()
    f = write_theta_file(tmp_path, 3, theta.tensors)
    assert f.path.name == "theta-00000003.safetensors"
    assert f.read(0, theta.manifest.total_bytes) == bytes(theta.payload())
    assert f.read(100, 16) == bytes(theta.payload()[100:116])
    assert state_digest(f.theta.tensors) == state_digest(theta.tensors)
    assert file_state_digest(f.path) == state_digest(theta.tensors)


def test_released_pages_come_back_from_the_file_bit_for_bit(tmp_path):
    big = ThetaBuffer.copy_of({"w": torch.randn(4096, 1024), "b": torch.randn(7)})
    f = write_theta_file(tmp_path, 0, big.tensors)
    before = _rss_file_kib()
    assert float(f.theta.tensors["w"].sum()) == float(big.tensors["w"].sum())  # maps 16 MiB
    mapped = _rss_file_kib()
    f.release("w")
    released = _rss_file_kib()
    assert mapped - before > 12_000  # the pages were resident ...
    assert mapped - released > 12_000  # ... and are given back
    assert torch.equal(f.theta.tensors["w"], big.tensors["w"])  # read again from the file
    f.release()
    assert torch.equal(f.theta.tensors["b"], big.tensors["b"])


def test_a_file_laid_out_otherwise_is_refused(tmp_path):
    theta = _theta()
    write_tensors(tmp_path / "x.safetensors", {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="not laid out like theta"):
        ThetaFile(tmp_path / "x.safetensors", theta.manifest)


def test_a_source_moves_from_memory_to_the_file_in_the_middle_of_a_stream(tmp_path):
    theta = _theta()
    source = ThetaSource(theta.payload())
    assert source.in_memory and len(source) == theta.manifest.total_bytes
    stream = source.chunks(4096, start=0)
    got = bytearray(next(stream)[1])
    source.to_file(write_theta_file(tmp_path, 1, theta.tensors))
    assert not source.in_memory
    got += b"".join(bytes(c) for _, c in stream)
    assert bytes(got) == bytes(theta.payload())
    assert b"".join(bytes(c) for _, c in source.chunks(1000, start=5000)) == bytes(
        theta.payload()[5000:]
    )
    with pytest.raises(ValueError, match="resume offset"):
        next(source.chunks(1000, start=len(source) + 1))
    with pytest.raises(ValueError, match="not the payload"):
        source.to_file(write_theta_file(tmp_path, 2, {"w": torch.zeros(1)}))


def test_a_checkpoints_file_is_linked_not_copied(tmp_path):
    theta = _theta()
    saved = tmp_path / "ckpt" / "theta.safetensors"
    saved.parent.mkdir()
    write_tensors(saved, theta.tensors)
    f = link_theta_file(tmp_path / "theta", 4, saved)
    assert os.stat(f.path).st_ino == os.stat(saved).st_ino
    assert f.manifest.entries == theta.manifest.entries
    assert state_digest(f.theta.tensors) == state_digest(theta.tensors)


def test_old_files_go_and_open_ones_stay_readable(tmp_path):
    theta = _theta()
    old = write_theta_file(tmp_path, 1, theta.tensors)
    new = write_theta_file(tmp_path, 2, theta.tensors)
    (tmp_path / ".theta-00000003.safetensors.tmp-1-2").write_bytes(b"debris")
    clear_theta_files(tmp_path, keep=new.path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [new.path.name]
    assert old.read(0, old.manifest.total_bytes) == bytes(theta.payload())


def test_the_file_job_runs_on_the_worker_and_hands_over(tmp_path):
    worker = ThreadPoolExecutor(max_workers=1)
    files = ThetaFiles(tmp_path, worker, threading.Event())
    first = files.start(0, _theta(0).tensors)
    nxt = _theta(1)
    seen = []
    done = files.submit(1, nxt, lambda f: seen.append((f, threading.current_thread().name)))
    f = done.result(10)
    assert seen and seen[0][0] is f and seen[0][1] != threading.current_thread().name
    assert files.current is f and files.idle()
    assert not first.path.exists()  # the old one went once the new one served
    # theta_r's own tensors (nothing counted): its file is reused, nothing written, and the
    # served theta is still handed over to it (the round's evaluation hangs on that too).
    handed = []
    same = files.submit(2, f.theta, handed.append)
    assert same.result(5) is f and handed == [f]
    worker.shutdown()


def test_an_older_versions_stream_reads_its_own_file_after_newer_ones_took_over(tmp_path):
    worker = ThreadPoolExecutor(max_workers=1)
    files = ThetaFiles(tmp_path / "theta", worker, threading.Event())
    theta_1 = _theta(1)
    source = ThetaSource.of_file(files.start(1, theta_1.tensors))
    stream = source.chunks(1024)
    first = next(stream)[1]
    for version in (2, 3):  # the file of theta_1 is unlinked, newer ones opened
        files.submit(version, _theta(version), lambda f: None).result(10)
    gc.collect()
    others = []  # new descriptors, which would take a closed number
    for i in range(8):
        path = tmp_path / f"other-{i}"
        path.write_bytes(bytes([i]) * 4096)
        others.append(os.open(path, os.O_RDONLY))
    rest = b"".join(c for _, c in stream)
    assert first + rest == bytes(theta_1.payload())
    for fd in others:
        os.close(fd)
    worker.shutdown()


def test_a_suspended_stream_does_not_keep_thetas_buffer_once_the_file_serves(tmp_path):
    theta = _theta()
    buffer = weakref.ref(theta.buffer)
    source = ThetaSource(theta.payload())
    stream = source.chunks(4096)
    _, chunk = next(stream)
    assert isinstance(chunk, bytes)  # a copy, not a view into the buffer
    source.to_file(write_theta_file(tmp_path, 1, theta.tensors))
    want = bytes(theta.payload())
    del theta
    gc.collect()
    assert buffer() is None  # the generator, suspended mid-stream, holds no view of it
    rest = b"".join(c for _, c in stream)
    assert chunk + rest == want


# ---- the coordinator ----------------------------------------------------------------------


def _close_round(core, clock, tokens, r, value=0.1):
    for site, token in tokens.items():
        push(core, site, token, r, delta_like(core, value * (r + 1)))
    heartbeat_all(core, clock, tokens, 2.0)
    assert core.round.number == r + 1


def test_after_a_close_theta_is_served_from_its_file_and_the_buffer_is_gone(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock)
    try:
        tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
        heartbeat_all(core, clock, tokens, 1.0)
        for site, token in tokens.items():
            push(core, site, token, 0, delta_like(core, 0.1))
        core.lanes.settle()  # every fold done
        running = core.state.running_sum
        running._targets()
        buffer = weakref.ref(running._buffer.buffer)
        del running
        heartbeat_all(core, clock, tokens, 2.0)
        assert core.round.number == 1
        core.theta_files.wait()
        assert not core.published.payload.in_memory
        current = core.theta_files.current
        assert core.state.theta is current.theta
        assert current.path.name == "theta-00000001.safetensors"
        assert state_digest(core.theta) == core.published.theta_hash
        served = b"".join(bytes(c) for _, c in core.published.payload.chunks(1 << 16))
        assert served == current.read(0, len(served))
        gc.collect()
        # theta_1's buffer was the round's sum: only the spare keeps it, for the next sum.
        assert buffer() is not None and buffer() is core.spare.held
        assert holders(core.spare.held) == 1
        # The checkpoint of round 1 holds the very same file.
        core.writer.wait()
        ckpt = tmp_path / "state" / "checkpoints" / "round-00000001" / "theta.safetensors"
        assert os.stat(ckpt).st_ino == os.stat(current.path).st_ino
    finally:
        core.close()


class _HalfInPlace(FedAvg):
    """Steps vectors in place and asks for ``outer_step`` on matrices: not separable after all."""

    def outer_step_in_place(self, theta, aggregate):
        if any(t.dim() > 1 for t in aggregate.mean_delta.values()):
            return None
        return super().outer_step_in_place(theta, aggregate)


def test_a_separable_step_that_gives_up_half_way_stops_the_job(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock, strategy={"name": f"{__name__}:_HalfInPlace"})
    try:
        tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
        heartbeat_all(core, clock, tokens, 1.0)
        before = core.published.theta_hash
        for site, token in tokens.items():
            push(core, site, token, 0, delta_like(core, 0.1))
        with pytest.raises(FatalError, match="returned None for .* after stepping earlier"):
            heartbeat_all(core, clock, tokens, 2.0)
        assert core.published.theta_hash == before  # nothing published from a half step
    finally:
        core.close()


class _WholeDiLoCo(DiLoCo):
    separable = False  # one outer_step_in_place call over every tensor


@pytest.mark.parametrize("restart", [False, True])
def test_stepping_one_tensor_at_a_time_gives_the_same_bits(tmp_path, restart):
    hashes = []
    for name, strategy in (
        ("each", "strategies.diloco:DiLoCo"),
        ("whole", f"{__name__}:_WholeDiLoCo"),
    ):
        clock = Clock()
        folder = tmp_path / name
        core = new_core(folder, clock, strategy={"name": strategy})
        tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
        heartbeat_all(core, clock, tokens, 1.0)
        try:
            _close_round(core, clock, tokens, 0)
            if restart:  # the second step starts from theta_1 linked from the checkpoint
                core.close()
                core = new_core(folder, clock, strategy={"name": strategy})
                tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
                heartbeat_all(core, clock, tokens, 1.0)
            _close_round(core, clock, tokens, 1, value=-0.3)
            hashes.append(core.published.theta_hash)
            assert state_digest(core.theta) == core.published.theta_hash
        finally:
            core.close()
    assert hashes[0] == hashes[1]


def _block_digests_of(source) -> list[bytes]:
    size = block_size(source.size)
    return [payload_digest(data) for _, data in source.chunks(size)]


def test_once_ranges_were_asked_for_the_next_thetas_block_digests_are_taken_at_publication(
    tmp_path,
):
    clock = Clock()
    core = new_core(tmp_path, clock)
    try:
        tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
        heartbeat_all(core, clock, tokens, 1.0)
        _close_round(core, clock, tokens, 0)
        assert not core.published.payload.blocks_asked  # nobody fetched ranges: not taken
        core.published.payload.block_digests()  # a host fetching ranges asks for them
        _close_round(core, clock, tokens, 1)
        source = core.published.payload
        assert core.published.version == 2 and source.blocks_asked  # taken without an ask
        size, digests = source.block_digests()
        assert size == block_size(source.size) and digests == _block_digests_of(source)
    finally:
        core.close()
