"""A site's side of coordinator shards on its own: an update cut by the shard map into parts
laid out and digested as ``wire.tensors.pack`` lays out and digests them, without copying."""

from __future__ import annotations

import pytest
import torch

from site_client.agent.update_payload import payload_of
from site_client.transfer.sharded import split_payload
from wire.codecs.quantize import Int8Codec
from wire.codecs.rules import CompressionConfig
from wire.codecs.state import CodecState
from wire.digest import payload_digest
from wire.tensors import PayloadError, pack, pack_encoded, unpack


def _update() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    shapes = {"a": (3, 5), "b": (7,), "c": (4, 4), "d": (1,), "e": (9, 3)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


OWNER = {"a": 1, "b": 0, "c": 1, "d": 2, "e": 0}


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_each_part_is_what_packing_its_tensors_alone_gives(codec):
    update = _update()
    if codec == "none":
        payload = payload_of(*pack(update))
    else:
        cfg = CompressionConfig(default=Int8Codec())
        payload = payload_of(*pack_encoded(update, cfg, CodecState()))
    parts = split_payload(payload, OWNER, 3)
    whole = bytes(payload.view(0, payload.total_bytes))
    for i, part in enumerate(parts):
        names = [e.name for e in part.manifest.entries]
        assert names == [n for n in update if OWNER[n] == i]
        raw = bytes(part.view(0, part.total_bytes))
        assert part.manifest.digest == payload_digest(raw)  # the bytes the shard will hash
        for e in part.manifest.entries:  # each tensor's bytes as the whole payload held them
            src = next(x for x in payload.manifest.entries if x.name == e.name)
            assert (
                raw[e.offset : e.offset + e.nbytes] == whole[src.offset : src.offset + src.nbytes]
            )
            assert e.offset % 64 == 0
    if codec == "none":
        back = {}
        for part in parts:
            back |= unpack(part.manifest, bytes(part.view(0, part.total_bytes)))
        assert all(torch.equal(back[n], update[n]) for n in update)


def test_a_tensor_without_a_shard_is_refused():
    payload = payload_of(*pack(_update()))
    with pytest.raises(PayloadError, match="'e' has no shard"):
        split_payload(payload, {n: 0 for n in "abcd"}, 2)
    with pytest.raises(PayloadError, match="has no shard"):
        split_payload(payload, {**OWNER, "d": 5}, 3)


def test_a_chunk_lands_in_the_tensors_it_overlaps_and_nowhere_else():
    from wire.chunking import tensor_pieces

    update = _update()
    manifest, payload = pack(update)
    entries = sorted(manifest.entries, key=lambda e: e.offset)
    rebuilt = {e.name: bytearray(e.nbytes) for e in entries}
    raw = bytes(payload)
    for start in range(0, len(raw), 37):  # chunks that cut tensors and padding anywhere
        for e, inside, piece in tensor_pieces(entries, start, raw[start : start + 37]):
            rebuilt[e.name][inside : inside + len(piece)] = piece
    for e in entries:
        assert bytes(rebuilt[e.name]) == raw[e.offset : e.offset + e.nbytes]


def test_a_layout_from_names_dtypes_and_shapes_is_the_one_of_the_tensors():
    from wire.safetensors_io import canonical_order, contiguous_manifest, layout_of
    from wire.tensors import dtype_name

    tensors = {
        "w": torch.zeros(3, 4),
        "steps": torch.zeros(5, dtype=torch.int64),
        "h": torch.zeros(2, dtype=torch.bfloat16),
        "a": torch.zeros(7),
    }
    specs = [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    assert layout_of(specs) == contiguous_manifest(tensors, canonical_order(tensors))


def _fetcher(passes: dict[int, bytes]):
    """The site's theta fetcher, holding the passes of the versions it fetched."""
    from site_client.transfer.theta import ThetaFetcher

    fetcher = ThetaFetcher(client=None)
    for version, mac in passes.items():
        fetcher.note_pass(version, mac)
    return fetcher


class _Coordinator:
    """The coordinator's side of a header-only fetch, for ``ShardRoutes.pass_for`` (a unit
    test: the site's request and what it keeps are what is checked)."""

    def __init__(self) -> None:
        self.asked: list = []

    def Fetch(self, request, timeout):  # noqa: N802 - the stub's method name
        from wire.bulk import chunk_frame
        from wire.proto import isthmus_pb2 as pb

        self.asked.append(request)
        header = pb.FetchHeader(version=request.version, shard_pass=b"P%d" % request.version)
        return iter([header.SerializeToString(), chunk_frame(0, b"x")])


def test_a_site_without_a_pass_asks_the_coordinator_for_it_once():
    from types import SimpleNamespace

    from site_client.transfer.sharded import ShardRoutes
    from wire.proto import isthmus_pb2 as pb

    coordinator = _Coordinator()
    client = SimpleNamespace(
        theta=_fetcher({4: b"known"}),
        lease=pb.Lease(site="site-a", token=7),
        bulk=coordinator,
        transfer_timeout_s=5.0,
        bytes_received=0,
        call=lambda describe, fn: fn(),
    )
    routes = ShardRoutes.__new__(ShardRoutes)  # its streams to shards are not needed here
    routes.client = client
    assert routes.pass_for(4) == b"known" and not coordinator.asked  # as it came with theta_4
    assert routes.pass_for(5) == b"P5"
    (asked,) = coordinator.asked
    assert asked.version == 5 and asked.length == 1 and asked.lease.token == 7
    assert routes.pass_for(5) == b"P5" and len(coordinator.asked) == 1  # kept
    assert client.bytes_received == 1


class _Shard:
    """A shard's Fetch as raw frames (header, then 1 KiB chunks) of the part it holds."""

    def __init__(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.manifest, self.payload = pack(tensors)
        self.version, self.asked = version, []

    def Fetch(self, request, timeout):  # noqa: N802 - the stub's method name
        from wire.bulk import chunk_frame
        from wire.proto import isthmus_pb2 as pb

        self.asked.append(request)
        header = pb.FetchHeader(version=self.version, manifest=self.manifest.to_proto())
        data = bytes(self.payload)
        chunks = [chunk_frame(o, data[o : o + 1024]) for o in range(0, len(data), 1024)]
        return _Call([header.SerializeToString(), *chunks])


class _Call:
    """A call's frames, cancellable as a gRPC call is."""

    def __init__(self, frames: list[bytes]) -> None:
        self._frames = iter(frames)

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        return next(self._frames)

    def cancel(self) -> None:
        self._frames = iter(())


@pytest.mark.parametrize("into_file", [False, True], ids=["memory", "file"])
def test_theta_is_assembled_from_the_parts_the_same_in_memory_and_in_a_file(tmp_path, into_file):
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from site_client.transfer.sharded import ShardRoutes
    from site_client.transfer.theta import GlobalState

    theta = _update()
    names = sorted(theta)
    own = {n: theta[n] for n in names[::2]}  # the coordinator's part
    shard = _Shard({n: theta[n] for n in names[1::2]}, version=3)
    routes = ShardRoutes.__new__(ShardRoutes)  # the streams of a site with one shard beside
    routes.client = SimpleNamespace(
        site="site-a",
        theta=_fetcher({3: b"pass-3"}),
        rpc_timeout_s=5.0,
        transfer_timeout_s=5.0,
        bytes_received=0,
        call=lambda describe, fn: fn(),
    )
    routes.k, routes._stubs = 2, {1: shard}
    routes._pool = ThreadPoolExecutor(max_workers=1)
    dest = tmp_path / "theta.safetensors" if into_file else None
    try:
        tensors, file = routes._assemble(GlobalState(3, own, b""), dest)
    finally:
        routes._pool.shutdown()
    assert (file is not None) == into_file
    assert sorted(tensors) == names
    assert all(torch.equal(tensors[n], theta[n]) for n in names)
    assert all(r.version == 3 and r.shard_pass == b"pass-3" for r in shard.asked)
    assert routes.client.bytes_received == shard.manifest.total_bytes
