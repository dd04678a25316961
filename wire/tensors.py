"""Tensor payloads: many named tensors as one raw byte buffer described by a manifest.

Nothing is pickled. A payload is the tensors' little-endian bytes laid end to end (each start
aligned to 64 bytes so that it can be viewed in place), and the manifest says, per tensor, its
name, dtype, shape, codec and byte range. Decoding checks every entry against the buffer before
it reads a byte, so a hostile manifest cannot make the reader run off the end or alias tensors.

A manifest also says how many bytes will follow it, so it is held to what its tensors need:
each entry exactly its codec's size for its shape (``wire.codecs.data_bounds``; top-k a
range), each start no later than the previous end aligned up to ``ALIGN``, nothing after the
last tensor. A receiver can then refuse an oversized update before it stores a byte of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from wire.codecs import (
    CODEC_NAMES,
    MAX_META_BYTES,
    CodecError,
    CodecState,
    data_bounds,
    decode,
    meta_info,
)
from wire.codecs.rules import CompressionConfig, choose_codec
from wire.digest import DIGEST_BYTES, payload_digest
from wire.payload_parts import MAX_PARTS, PartsError, PayloadPart, check_parts
from wire.proto import isthmus_pb2 as pb

ALIGN = 64

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CODECS = CODEC_NAMES
MAX_TENSOR_NAME = 512
MAX_TENSORS = 100_000


class PayloadError(ValueError):
    """A manifest or payload that cannot be decoded; the message says what is wrong."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a payload, or one piece of a tensor.

    A piece (``global_shape`` set) is the box of the tensor ``name`` of shape ``global_shape``
    that starts at ``box_offset`` (one index per dimension) and has shape ``shape``: a trainer
    rank's shard of a sharded parameter, for instance. Empty ``global_shape``: the whole tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    codec: str = "none"
    codec_meta: bytes = b""
    global_shape: tuple[int, ...] = ()
    box_offset: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def end(self) -> int:
        """Where this entry's bytes end in the payload."""
        return self.offset + self.nbytes

    @property
    def is_piece(self) -> bool:
        return bool(self.global_shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the whole tensor this entry is (a piece of)."""
        return self.global_shape or self.shape

    def box(self) -> tuple[slice, ...]:
        """Where this entry lies in the whole tensor, as index slices."""
        if not self.is_piece:
            return tuple(slice(0, d) for d in self.shape)
        return tuple(slice(o, o + d) for o, d in zip(self.box_offset, self.shape, strict=True))

    @property
    def label(self) -> str:
        """The entry's name, with its box for a piece (for messages and codec state keys)."""
        if not self.is_piece:
            return self.name
        return f"{self.name}[{','.join(map(str, self.box_offset))}]"


@dataclass(frozen=True)
class Manifest:
    entries: tuple[TensorEntry, ...]
    total_bytes: int
    # The payload's digest (``wire.digest``); empty in a whole theta's header, which theta's
    # state digest vouches for.
    digest: bytes = field(default=b"")
    parts: tuple[PayloadPart, ...] = ()  # several hosts' parts (``wire.payload_parts``)

    def fp32_bytes(self) -> int:
        """What the payload's tensors take as raw float32 (a codec's ratio is this over
        ``total_bytes``)."""
        return sum(4 * math.prod(e.shape) for e in self.entries)

    def bytes_by_codec(self) -> dict[str, int]:
        """The payload's bytes per codec (an adaptive job's update names its rung here)."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.codec] = out.get(e.codec, 0) + e.nbytes
        return out

    def to_proto(self) -> pb.Manifest:
        return pb.Manifest(
            tensors=[
                pb.TensorSpec(
                    name=e.name,
                    dtype=e.dtype,
                    shape=list(e.shape),
                    codec=e.codec,
                    offset=e.offset,
                    nbytes=e.nbytes,
                    codec_meta=e.codec_meta,
                    global_shape=list(e.global_shape),
                    box_offset=list(e.box_offset),
                )
                for e in self.entries
            ],
            total_bytes=self.total_bytes,
            digest=self.digest,
            parts=[
                pb.PayloadPart(offset=p.offset, length=p.length, digest=p.digest)
                for p in self.parts
            ],
        )

    @classmethod
    def from_proto(cls, msg: pb.Manifest, max_total_bytes: int | None = None) -> Manifest:
        """Build and validate a manifest received from a peer."""
        if len(msg.tensors) > MAX_TENSORS:
            raise PayloadError(f"manifest lists {len(msg.tensors)} tensors, limit {MAX_TENSORS}")
        entries = tuple(
            TensorEntry(
                name=t.name,
                dtype=t.dtype,
                shape=tuple(int(d) for d in t.shape),
                offset=int(t.offset),
                nbytes=int(t.nbytes),
                codec=t.codec,
                codec_meta=bytes(t.codec_meta),
                global_shape=tuple(int(d) for d in t.global_shape),
                box_offset=tuple(int(d) for d in t.box_offset),
            )
            for t in msg.tensors
        )
        if len(msg.parts) > MAX_PARTS:
            raise PayloadError(f"manifest lists {len(msg.parts)} parts, limit {MAX_PARTS}")
        parts = tuple(PayloadPart(int(p.offset), int(p.length), bytes(p.digest)) for p in msg.parts)
        manifest = cls(entries, int(msg.total_bytes), bytes(msg.digest), parts)
        validate_manifest(manifest, max_total_bytes)
        return manifest

    def by_name(self) -> dict[str, TensorEntry]:
        """Entries by tensor name (for payloads of whole tensors: one entry per name)."""
        return {e.name: e for e in self.entries}

    def pieces(self) -> dict[str, list[TensorEntry]]:
        """Entries grouped by tensor name, each group in box order."""
        out: dict[str, list[TensorEntry]] = {}
        for e in sorted(self.entries, key=lambda e: (e.name, e.box_offset)):
            out.setdefault(e.name, []).append(e)
        return out


def entries_to_json(entries: Iterable[TensorEntry]) -> list[dict]:
    """Entries as JSON values (a spool record, a multi-node site's part description)."""
    return [
        {
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "offset": e.offset,
            "nbytes": e.nbytes,
            "codec": e.codec,
            "codec_meta": e.codec_meta.hex(),
            "global_shape": list(e.global_shape),
            "box_offset": list(e.box_offset),
        }
        for e in entries
    ]


def entries_from_json(items: list[dict]) -> tuple[TensorEntry, ...]:
    """``entries_to_json`` read back; a malformed item raises ``KeyError``, ``TypeError`` or
    ``ValueError`` (what it holds is checked by ``validate_manifest``)."""
    return tuple(
        TensorEntry(
            str(i["name"]),
            str(i["dtype"]),
            tuple(int(d) for d in i["shape"]),
            int(i["offset"]),
            int(i["nbytes"]),
            str(i["codec"]),
            bytes.fromhex(i.get("codec_meta", "")),
            tuple(int(d) for d in i.get("global_shape", ())),
            tuple(int(d) for d in i.get("box_offset", ())),
        )
        for i in items
    )


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise PayloadError(f"dtype {dtype} cannot travel on the wire") from None


def validate_manifest(manifest: Manifest, max_total_bytes: int | None = None) -> None:
    """Check a manifest on its own: names, dtypes, shapes, codecs and non-overlapping ranges."""
    if len(manifest.digest) not in (0, DIGEST_BYTES):
        raise PayloadError(
            f"manifest digest must be {DIGEST_BYTES} bytes (or none), got {len(manifest.digest)}"
        )
    if manifest.total_bytes < 0:
        raise PayloadError("manifest total_bytes is negative")
    if max_total_bytes is not None and manifest.total_bytes > max_total_bytes:
        raise PayloadError(
            f"payload of {manifest.total_bytes} bytes exceeds the limit of {max_total_bytes}"
        )
    seen: set[tuple[str, tuple[int, ...]]] = set()
    end_of_previous = 0
    # Empty tensors first at a shared offset: a 0-byte tensor may sit where the next one starts.
    for e in sorted(manifest.entries, key=lambda e: (e.offset, e.nbytes)):
        if not e.name or len(e.name) > MAX_TENSOR_NAME or not e.name.isprintable():
            raise PayloadError(f"tensor name {e.name[:60]!r} is empty, too long or unprintable")
        _check_box(e)
        if (e.name, e.box_offset) in seen:
            raise PayloadError(f"tensor {e.label!r} appears twice in the manifest")
        seen.add((e.name, e.box_offset))
        if e.dtype not in DTYPES:
            raise PayloadError(f"tensor {e.name!r} has unknown dtype {e.dtype[:40]!r}")
        if e.codec not in CODECS:
            raise PayloadError(f"tensor {e.name!r} uses unknown codec {e.codec[:40]!r}")
        if any(d < 0 for d in e.shape) or len(e.shape) > 16:
            shown = list(e.shape[:8]) + (["..."] if len(e.shape) > 8 else [])
            raise PayloadError(f"tensor {e.name!r} has an invalid shape {shown}")
        itemsize = torch.empty((), dtype=DTYPES[e.dtype]).element_size()
        if e.codec != "none":
            _check_codec_meta(e)
        elif e.codec_meta:
            raise PayloadError(f"tensor {e.name!r}: raw bytes (codec 'none') carry no codec_meta")
        if e.codec == "none" and e.nbytes != e.numel * itemsize:
            raise PayloadError(
                f"tensor {e.name!r} (codec 'none'): {e.nbytes} bytes do not hold shape "
                f"{list(e.shape)} of {e.dtype} ({e.numel * itemsize} bytes)"
            )
        if e.offset < end_of_previous:
            raise PayloadError(f"tensor {e.name!r} overlaps the tensor before it")
        if e.offset + e.nbytes > manifest.total_bytes:
            raise PayloadError(
                f"tensor {e.name!r} ends at byte {e.offset + e.nbytes}, "
                f"past the payload's {manifest.total_bytes} bytes"
            )
        _check_gap(e, end_of_previous)
        end_of_previous = e.offset + e.nbytes
    _check_total(manifest, end_of_previous)
    if manifest.parts:
        spans = ((e.label, e.offset, e.end) for e in manifest.entries)
        try:
            check_parts(manifest.parts, manifest.total_bytes, manifest.digest, spans)
        except PartsError as exc:
            raise PayloadError(str(exc)) from None


def _check_gap(e: TensorEntry, end_of_previous: int) -> None:
    """Bytes between two tensors are alignment padding only (``pack`` aligns each start to
    ``ALIGN``, safetensors none): a gap beyond that is space no tensor needs."""
    latest = _aligned(end_of_previous)
    if e.offset > latest:
        raise PayloadError(
            f"tensor {e.label[:80]!r} (codec {e.codec!r}) starts at byte {e.offset}, "
            f"{e.offset - end_of_previous} bytes after the tensor before it ends; it must start "
            f"by byte {latest} (the next {ALIGN}-byte boundary)"
        )


def _check_total(manifest: Manifest, end: int) -> None:
    """``total_bytes`` is where the last tensor ends: bytes after it would be received and
    stored for nothing (``end``: where the last one ends, 0 for no tensors)."""
    if manifest.total_bytes == end:
        return
    last = max(manifest.entries, key=lambda e: (e.end, e.offset), default=None)
    what = "no tensors" if last is None else f"the last, {last.label[:80]!r} (codec {last.codec!r})"
    raise PayloadError(
        f"payload of {manifest.total_bytes} bytes claimed, but its tensors end at byte {end} "
        f"({what}); nothing may follow the last tensor"
    )


def _check_box(e: TensorEntry) -> None:
    """A piece's box must lie inside its whole tensor, one offset per dimension."""
    if not e.global_shape and not e.box_offset:
        return
    dims = len(e.shape)
    if len(e.global_shape) != dims or len(e.box_offset) != dims:
        raise PayloadError(
            f"tensor {e.name[:60]!r}: a piece needs one global size and one offset per "
            f"dimension of its shape {list(e.shape[:8])}"
        )
    for o, d, g in zip(e.box_offset, e.shape, e.global_shape, strict=True):
        if o < 0 or g < 0 or o + d > g:
            raise PayloadError(
                f"tensor {e.name[:60]!r}: piece at {list(e.box_offset[:8])} of shape "
                f"{list(e.shape[:8])} lies outside the tensor's shape {list(e.global_shape[:8])}"
            )


def _check_codec_meta(e: TensorEntry) -> None:
    if len(e.codec_meta) > MAX_META_BYTES:
        raise PayloadError(f"tensor {e.name!r}: codec_meta of {len(e.codec_meta)} bytes")
    try:
        info = meta_info(e.codec_meta)
        fewest, most = data_bounds(e.codec_meta)
    except CodecError as exc:
        raise PayloadError(f"tensor {e.name!r}: {exc}") from exc
    if info["data_nbytes"] != e.nbytes:
        raise PayloadError(
            f"tensor {e.name!r}: codec_meta says {info['data_nbytes']} bytes, the manifest "
            f"{e.nbytes}"
        )
    if info.get("numel") != e.numel or info.get("codec") != e.codec:
        raise PayloadError(
            f"tensor {e.name!r}: its codec_meta describes {info.get('numel')} elements of "
            f"codec {str(info.get('codec'))[:20]!r}, the manifest {e.numel} of {e.codec!r}"
        )
    if not fewest <= e.nbytes <= most:
        size = f"exactly {most}" if fewest == most else f"{fewest} to {most}"
        raise PayloadError(
            f"tensor {e.label[:80]!r} (codec {e.codec!r}): {e.nbytes} bytes claimed, but "
            f"{e.numel} elements of shape {list(e.shape[:8])} take {size} bytes in its encoding"
        )


def pack(tensors: Mapping[str, torch.Tensor]) -> tuple[Manifest, memoryview]:
    """Lay tensors out in one buffer; returns the manifest (with its digest) and the payload."""
    entries = []
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    total = entries[-1].offset + entries[-1].nbytes if entries else 0
    buf = torch.zeros(total, dtype=torch.uint8)
    for e, t in zip(entries, tensors.values(), strict=True):
        if e.nbytes:
            src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buf[e.offset : e.offset + e.nbytes].copy_(src)
    payload = memoryview(buf.numpy()).cast("B")
    return Manifest(tuple(entries), total, payload_digest(payload)), payload


def pack_encoded(
    tensors: Mapping[str, torch.Tensor], config: CompressionConfig, state: CodecState
) -> tuple[Manifest, memoryview]:
    """Like ``pack``, each tensor encoded by the codec ``config`` picks for it.

    Error-feedback codecs update their residual in ``state``; tensors whose codec is ``none``
    travel as raw bytes, exactly as ``pack`` lays them out. ``tensors`` may be any object with
    ``items()``, e.g. one that makes each tensor on demand: an encoded tensor is not kept once
    its bytes are.
    """
    parts: list[tuple[TensorEntry, torch.Tensor]] = []
    offset = 0
    for name, t in tensors.items():
        codec = choose_codec(name, t, config)
        if codec.name == "none":
            codec_name, meta = "none", b""
            t = state.carry(name, t)  # what an earlier rung's error feedback withheld
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        else:
            enc = state.encode(name, t, codec)
            codec_name, meta, data = enc.codec, enc.meta, enc.data
            if data.numel() and data.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                data = data.clone()  # kept until packed; the input's memory may be reused
        entry = TensorEntry(
            name, dtype_name(t.dtype), tuple(t.shape), offset, data.numel(), codec_name, meta
        )
        parts.append((entry, data))
        offset = _aligned(offset + data.numel())
        del t
    total = parts[-1][0].offset + parts[-1][0].nbytes if parts else 0
    buf = torch.zeros(total, dtype=torch.uint8)
    for e, data in parts:
        if e.nbytes:
            buf[e.offset : e.offset + e.nbytes].copy_(data)
    entries = tuple(e for e, _ in parts)
    payload = memoryview(buf.numpy()).cast("B")
    return Manifest(entries, total, payload_digest(payload)), payload


def validate_payload(manifest: Manifest, payload: bytes | bytearray | memoryview) -> None:
    """Raise ``PayloadError`` unless the manifest is valid and the payload has its length."""
    validate_manifest(manifest)
    if len(payload) != manifest.total_bytes:
        raise PayloadError(
            f"payload has {len(payload)} bytes, the manifest says {manifest.total_bytes}"
        )


def unpack(manifest: Manifest, payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors from a verified payload. The tensors share memory with a writable payload."""
    validate_payload(manifest, payload)
    if not isinstance(payload, bytearray | memoryview) or (
        isinstance(payload, memoryview) and payload.readonly
    ):
        payload = bytearray(payload)
    out: dict[str, torch.Tensor] = {}
    for e in manifest.entries:
        dtype = DTYPES[e.dtype]
        if e.nbytes == 0:
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        raw = torch.frombuffer(payload, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
        out[e.name] = entry_tensor(e, raw)
    return out


def entry_tensor(e: TensorEntry, raw: torch.Tensor) -> torch.Tensor:
    """The tensor an entry's bytes hold: a view for raw bytes, decoded (and checked) for a
    codec. Raises ``PayloadError`` for encoded bytes that do not decode."""
    if e.codec == "none":
        return raw.view(DTYPES[e.dtype]).reshape(e.shape)
    try:
        return decode(raw, e.codec_meta, e.shape, dtype=DTYPES[e.dtype], codec=e.codec, name=e.name)
    except CodecError as exc:
        raise PayloadError(str(exc)) from exc
