"""Spooled files are reused, never trusted: a round's files go to the free pool once its
checkpoint is durable, the next uploads write over them, and their stale bytes never count as
received, across a restart either."""

from __future__ import annotations

import os

import torch
from core_helpers import Clock, delta_like, new_core, push

from coordinator.intake.spool import UpdateSpool
from coordinator.intake.upload_bytes import UploadBytes
from coordinator.records import UpdateKey
from wire.digest import payload_digest
from wire.tensors import pack

SITES = ("site-a", "site-b")


def _commit(spool: UpdateSpool, r: int, site: str, data: bytes) -> os.stat_result:
    manifest, payload = pack({"w": torch.frombuffer(bytearray(data), dtype=torch.float32)})
    part = spool.part_path(r, site, "u")
    spool.round_dir(r).mkdir(parents=True, exist_ok=True)
    received = UploadBytes(part, manifest.total_bytes, manifest.digest, reuse=spool.take_free)
    received.add(None, 0, bytes(payload))
    received.finish()
    received.close()
    return spool.commit(r, site, "u", manifest, 1.0, key=UpdateKey(site)).path.stat()


def test_dropped_rounds_fill_the_free_pool_and_new_uploads_write_over_it(tmp_path):
    spool = UpdateSpool(tmp_path / "spool")
    big = [_commit(spool, 0, s, os.urandom(64 << 10)) for s in SITES]
    spool.drop_rounds_before(1)
    assert not spool.round_dir(0).exists()
    spare = {p.stat().st_ino for p in spool.free_dir.iterdir()}
    assert spare == {st.st_ino for st in big}
    # A smaller update written over a bigger spare file: exactly its own bytes are kept.
    data = os.urandom(16 << 10)
    st = _commit(spool, 1, "site-a", data)
    assert st.st_ino in spare
    update = spool.completed(1)[0]
    assert update.path.stat().st_size == update.manifest.total_bytes
    assert payload_digest(update.path.read_bytes()) == update.manifest.digest
    assert len(list(spool.free_dir.iterdir())) == 1


def test_the_pool_holds_the_newest_round_and_a_full_disk_empties_it(tmp_path):
    spool = UpdateSpool(tmp_path / "spool")
    for s in SITES:
        _commit(spool, 0, s, os.urandom(4096))
    spool.drop_rounds_before(1)
    _commit(spool, 1, "site-a", os.urandom(4096))
    spool.drop_rounds_before(2)
    assert len(list(spool.free_dir.iterdir())) == 1  # round 1 had one update
    spool.release_free()
    assert not spool.free_dir.exists()
    assert spool.take_free(tmp_path / "x") is False


def test_a_reused_files_stale_bytes_never_count_as_received(tmp_path):
    spool = UpdateSpool(tmp_path / "spool")
    _commit(spool, 0, "site-a", os.urandom(1 << 20))
    spool.drop_rounds_before(1)
    manifest, payload = pack({"w": torch.ones(4096)})
    part = spool.part_path(1, "site-a", "v")
    spool.round_dir(1).mkdir(parents=True)
    first = UploadBytes(part, manifest.total_bytes, manifest.digest, reuse=spool.take_free)
    assert part.stat().st_size > manifest.total_bytes  # the spare file's stale bytes
    assert first.received == 0 and first.spans() == []
    first.close()
    # A restart finds the file and its (empty) range log: nothing was received.
    again = UploadBytes(part, manifest.total_bytes, manifest.digest, reuse=spool.take_free)
    assert again.received == 0 and again.spans() == []
    again.add(None, 0, bytes(payload))
    again.finish()
    assert part.read_bytes() == bytes(payload)


def test_a_coordinators_next_round_writes_over_the_last_ones_files(tmp_path):
    """Hard links to the spare files witness it: a file deleted and created anew (which may
    even get the old inode number) would not be one of them."""
    clock = Clock()
    core = new_core(tmp_path, clock, strategy={"name": "diloco"})
    tokens = {s: core.join(s)[0].token for s in SITES}
    clock.now += 1.0
    core.tick()
    for i, (site, token) in enumerate(tokens.items()):
        assert push(core, site, token, 0, delta_like(core, 0.5 + i))
    assert core.tick()
    core.writer.wait()  # round 1's checkpoint is durable: round 0's files are spare
    witnesses = []
    for i, spare in enumerate(sorted(core.spool.free_dir.iterdir())):
        witnesses.append(tmp_path / f"witness-{i}")
        os.link(spare, witnesses[-1])
    assert len(witnesses) == len(SITES)
    clock.now += 1.0
    core.tick()
    for i, (site, token) in enumerate(tokens.items()):
        assert push(core, site, token, 1, delta_like(core, 1.5 + i))
    updates = core.spool.completed(1)
    assert len(updates) == len(SITES)
    for u in updates:
        assert any(os.path.samefile(u.path, w) for w in witnesses), u.path
