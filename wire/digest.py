"""The digests every party takes of what it sends, stores and serves: BLAKE3, one pass.

Three kinds, each written once here:

* **payload digest** (``payload_digest``, ``Hasher``): of a payload's bytes as they travel,
  an update's or a downlink delta's, taken as the bytes are laid out or arrive;
* **state digest** (``state_digest``): of a model state (theta, a strategy's state) as
  names, dtypes, shapes and bytes. It is composed from one digest per tensor
  (``tensor_digests``, ``compose``), in name order, so it does not depend on how the
  tensors are laid out or who holds which: the tensors of a state are hashed side by side
  on several cores, a party that holds some of them (a coordinator shard) digests its own,
  and a site checks a theta it received in pieces without reading it again in order;
* **block digests** (``block_digests``): of fixed-size blocks of a payload, for a host that
  fetches only some ranges.

BLAKE3 rather than SHA-256: these digests are compared across hosts (and recorded), so they
must be cryptographic, and BLAKE3 is one (measured here: 0.14 CPU s per GB against
SHA-256's 0.48 with the CPU's SHA extensions); it hashes a large buffer on several threads
when asked. TLS already authenticates the wire: the digests are for what is stored and
served, and for a party that did not receive the bytes from their author.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import blake3
import torch

ALGORITHM = "blake3"  # recorded beside a stored digest
DIGEST_BYTES = 32
# A buffer this large is hashed on several threads (BLAKE3 splits it into a tree itself).
PARALLEL_BYTES = 8 << 20
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


class Hasher:
    """An incremental payload digest (``update`` the bytes in order, then ``digest``)."""

    def __init__(self) -> None:
        self._h = blake3.blake3()

    def update(self, data) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()

    def copy(self) -> Hasher:
        other = Hasher.__new__(Hasher)
        other._h = self._h.copy()
        return other


def payload_digest(data) -> bytes:
    """The digest of ``data`` (bytes-like), on several threads when it is large."""
    threads = blake3.blake3.AUTO if len(memoryview(data)) >= PARALLEL_BYTES else 1
    return blake3.blake3(data, max_threads=threads).digest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="digest")
        return _pool


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    """The payload digest of each tensor's bytes, taken side by side (the hashing releases
    the GIL); a large tensor is itself hashed on several threads."""
    names = sorted(tensors)
    jobs = [_threads().submit(payload_digest, _bytes_of(tensors[n])) for n in names]
    return {n: job.result() for n, job in zip(names, jobs, strict=True)}


def record(name: str, dtype: str, shape: Iterable[int], digest: bytes) -> bytes:
    """One tensor's part of a state digest: its name, dtype, shape and bytes' digest."""
    dims = ",".join(str(int(d)) for d in shape)
    return b"".join((name.encode(), b"\0", dtype.encode(), b"\0", dims.encode(), b"\0", digest))


def compose(records: Iterable[tuple[str, str, tuple[int, ...], bytes]]) -> bytes:
    """A state digest from ``(name, dtype, shape, digest)`` of each tensor (any order: they
    are taken in name order)."""
    h = blake3.blake3()
    for name, dtype, shape, digest in sorted(records):
        h.update(record(name, dtype, shape, digest))
    return h.digest()


def tensor_records(
    tensors: Mapping[str, torch.Tensor],
) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """``(name, dtype, shape, digest)`` of each tensor, in name order: what ``compose`` takes."""
    digests = tensor_digests(tensors)
    return [
        (n, dtype_name(t.dtype), tuple(t.shape), digests[n]) for n, t in sorted(tensors.items())
    ]


def state_digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The state digest of ``tensors`` (see the module docstring)."""
    return compose(tensor_records(tensors))


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the wire names it (``torch.float32`` -> ``float32``, as ``wire.tensors``)."""
    return str(dtype).removeprefix("torch.")


def block_digests(data, block_bytes: int) -> list[bytes]:
    """The digest of each ``block_bytes`` block of ``data`` (the last one shorter)."""
    view = memoryview(data).cast("B")
    return [payload_digest(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]
