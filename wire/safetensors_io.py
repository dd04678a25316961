"""safetensors files written and read in place: no pickle, and no copy of the tensors.

``safetensors.torch.save_file`` turns every tensor into a ``bytes`` object before writing (one
extra model in memory), and ``load_file`` copies every tensor out of the file. For model-sized
files on the round's critical path (theta handed to the trainers, their update shards handed
back, coordinator checkpoints) this module writes each tensor's bytes straight from its memory
and maps files back as tensor views of the page cache.

The files are ordinary safetensors (``safetensors.torch.load_file`` reads them): an 8-byte
little-endian header length, a JSON header padded with spaces to a multiple of 8, then the tensors'
bytes back to back. Tensors are laid out in :func:`canonical_order` (larger elements first), so
every tensor starts aligned to its element size and can be viewed where it lies.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from wire.digest import Hasher, compose
from wire.file_reuse import overwritable
from wire.tensors import (
    DTYPES,
    Manifest,
    PayloadError,
    TensorEntry,
    dtype_name,
    validate_manifest,
)

ST_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_FROM_ST = {v: k for k, v in ST_NAMES.items()}
MAX_HEADER_BYTES = 100 << 20


def canonical_order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names by element size, largest first, then by name: every offset stays aligned."""
    return sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))


def contiguous_manifest(tensors: Mapping[str, torch.Tensor], order: Iterable[str]) -> Manifest:
    """The layout of ``tensors`` back to back in ``order`` (no digest)."""
    entries, offset = [], 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset += nbytes
    return Manifest(tuple(entries), offset)


def layout_of(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> Manifest:
    """The layout ``contiguous_manifest`` gives tensors in ``canonical_order``, from
    ``(name, dtype, shape)`` alone (tensors not held here: another host's)."""
    like = {n: torch.empty(shape, dtype=DTYPES[dtype], device="meta") for n, dtype, shape in specs}
    return contiguous_manifest(like, canonical_order(like))


def header_bytes(manifest: Manifest, metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors header (length prefix included) of a contiguous ``manifest``."""
    table: dict[str, object] = {}
    end = 0
    for e in sorted(manifest.entries, key=lambda e: e.offset):
        if e.offset != end or e.codec != "none":
            raise PayloadError(f"tensor {e.name!r}: safetensors holds raw tensors back to back")
        end = e.offset + e.nbytes
        table[e.name] = {
            "dtype": ST_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [e.offset, end],
        }
    if metadata:
        table["__metadata__"] = dict(metadata)
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def write_tensors(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    fsync: bool = True,
    reuse: bool = False,
) -> Manifest:
    """Write ``tensors`` as a safetensors file at ``path`` (in canonical order); returns the
    layout of the data section. With ``reuse``, a file already at ``path`` is written over in
    place and cut to the new length, its cached pages kept, rather than emptied first."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    manifest = contiguous_manifest(tensors, canonical_order(tensors))
    with open(path, "r+b" if reuse and overwritable(path) else "wb") as f:
        f.write(header_bytes(manifest, metadata))
        for e in manifest.entries:
            f.write(tensor_bytes(tensors[e.name]))
        f.truncate()
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return manifest


@dataclass
class MappedTensors:
    """A safetensors file mapped into memory: ``tensors`` are views of its pages."""

    path: Path
    manifest: Manifest
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, torch.Tensor]
    array: np.memmap | None

    def payload(self) -> memoryview:
        """The data section (every tensor's bytes, in layout order)."""
        if self.array is None:
            return memoryview(b"")
        return memoryview(self.array[self.data_start :]).cast("B")

    def flush(self) -> None:
        if self.array is not None:
            self.array.flush()


def read_header(path: Path) -> tuple[Manifest, int, dict[str, str]]:
    """Layout, data offset and metadata of a safetensors file; ``PayloadError`` if it is not
    one (checked like any manifest from a peer)."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        if len(head) < 8:
            raise PayloadError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= MAX_HEADER_BYTES or 8 + n > size:
            raise PayloadError(f"{path}: not a safetensors file (header length {n})")
        try:
            table = json.loads(f.read(n))
        except ValueError as exc:
            raise PayloadError(f"{path}: unreadable safetensors header: {exc}") from None
    if not isinstance(table, dict):
        raise PayloadError(f"{path}: the safetensors header is not an object")
    metadata = table.pop("__metadata__", None) or {}
    entries = []
    try:
        for name, spec in table.items():
            start, end = (int(x) for x in spec["data_offsets"])
            dtype = _FROM_ST[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            entries.append(TensorEntry(name, dtype, shape, start, end - start))
    except (KeyError, TypeError, ValueError) as exc:
        raise PayloadError(f"{path}: bad safetensors entry: {exc!r}") from None
    manifest = Manifest(tuple(sorted(entries, key=lambda e: e.offset)), size - 8 - n)
    validate_manifest(manifest)
    return manifest, 8 + n, {str(k): str(v) for k, v in dict(metadata).items()}


def file_state_digest(path: Path) -> bytes:
    """``wire.digest.state_digest`` of a safetensors file's tensors, read a block at a time
    into one buffer (nothing mapped, so a model-sized check adds no pages to the process)."""
    return compose(file_tensor_records(path))


def file_tensor_records(path: Path) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Each tensor's ``(name, dtype, shape, digest)`` in a safetensors file, read as
    ``file_state_digest`` reads them."""
    manifest, start, _ = read_header(path)
    buf = bytearray(4 << 20)
    records = []
    with open(path, "rb", buffering=0) as f:
        for e in manifest.entries:
            h = Hasher()
            f.seek(start + e.offset)
            left = e.nbytes
            while left:
                got = f.readinto(memoryview(buf)[: min(left, len(buf))])
                if not got:
                    raise PayloadError(f"{path}: {e.name} is cut short")
                h.update(memoryview(buf)[:got])
                left -= got
            records.append((e.name, e.dtype, tuple(e.shape), h.digest()))
    return records


def copy_data(source: Path, target, start: int, size: int) -> None:
    """Append ``size`` bytes of ``source`` from ``start`` to the open file ``target`` (copied
    by the kernel: nothing passes through the process)."""
    with open(source, "rb") as f:
        offset = start
        while offset < start + size:
            sent = os.sendfile(target.fileno(), f.fileno(), offset, start + size - offset)
            if sent == 0:
                raise PayloadError(f"{source}: shorter than its header says")
            offset += sent


def map_tensors(path: Path, writable: bool = False) -> MappedTensors:
    """Map a safetensors file; with ``writable`` the views write through to the file, else
    they are copy-on-write (reading shares the page cache; nothing reaches the file)."""
    path = Path(path)
    manifest, start, metadata = read_header(path)
    total = start + manifest.total_bytes
    array = np.memmap(path, dtype=np.uint8, mode="r+" if writable else "c") if total else None
    tensors = {}
    for e in manifest.entries:
        if e.nbytes == 0:
            tensors[e.name] = torch.empty(e.shape, dtype=DTYPES[e.dtype])
            continue
        raw = torch.from_numpy(array[start + e.offset : start + e.offset + e.nbytes])
        tensors[e.name] = raw.view(DTYPES[e.dtype]).reshape(e.shape)
    return MappedTensors(path, manifest, start, metadata, tensors, array)


def create_mapped(
    path: Path,
    manifest: Manifest,
    metadata: Mapping[str, str] | None = None,
    reuse: bool = False,
) -> MappedTensors:
    """A new file laid out as ``manifest`` (contiguous), mapped for writing its tensors. With
    ``reuse``, a file already at ``path`` is written over in place and resized rather than
    emptied: its pages are kept (what it held stays until the caller writes over it)."""
    path = Path(path)
    head = header_bytes(manifest, metadata)
    with open(path, "r+b" if reuse and overwritable(path) else "wb") as f:
        f.write(head)
        f.truncate(len(head) + manifest.total_bytes)
    return map_tensors(path, writable=True)
