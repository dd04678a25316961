"""The codec interface, the codec meta layout, and the checks every decoder runs first.

A codec turns one tensor into ``Encoded(codec, data, meta)``: ``data`` is the tensor's bytes in
the payload, ``meta`` goes into ``TensorEntry.codec_meta``. The meta is self-describing: it holds
every parameter a decoder needs (block size, scale dtype, k, ...), so the receiver needs only
``(acc, data, meta)``; the codec name in the manifest is cross-checked against it.

Meta layout (little-endian)::

    magic "IZ" | version u8 | codec id u8 | source dtype u8 | pad u8
    | numel u64 | data bytes u64 | CRC32 of data u32 | codec parameters | CRC32 of all before u32

Integrity, by layer:

- Transport: the push payload's digest (``wire.digest``) proves the whole payload arrived
  as the sender hashed it; mutual TLS proves who sent it.
- Codec: two CRC32s in the meta, one over the meta itself and one over the data, prove that this
  ``data`` and this ``meta`` belong together and are intact where they are *decoded*, which may be
  later and elsewhere: a spool file re-read at round close, an entry paired with the wrong byte
  range, a buffer that changed between encode and send. CRC32 catches every error burst of up to
  32 bits and other damage with probability 1 - 2^-32. It costs ~4 GB/s of encoded bytes.
- Structure: a CRC is no signature, and a site holding a valid lease can send well-formed bytes
  of its choosing. So every decoder also checks lengths against shape, block and k, the block
  scales and values for finiteness and range, and top-k indices for being strictly increasing
  and in range. A decode therefore either adds a finite tensor of the right shape or raises
  ``CodecError`` with the accumulator untouched; whether the values are *sensible* is left to
  the robust aggregation (``strategies/robust.py``).
"""

from __future__ import annotations

import math
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

MAGIC = b"IZ"
VERSION = 1
HEADER = struct.Struct("<2sBBBxQQI")
_CRC = struct.Struct("<I")
MAX_META_BYTES = 128
# Elements per step of a chunked loop: temporaries of 4 MiB stay in cache and are allocated
# once per call; a model-sized temporary would cost page faults (ENVIRONMENT.md).
CHUNK = 1 << 20

# Fixed on-wire codes (not derived from another table: the codes must never move).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FLT_MAX = float(torch.finfo(torch.float32).max)


class CodecError(ValueError):
    """Input a codec refuses, or codec data/meta that cannot be decoded; names the tensor."""


def who(name: str) -> str:
    return f"tensor {name!r}" if name else "tensor"


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor: ``codec`` and ``meta`` go into its ``TensorEntry``, ``data`` into the
    payload. ``data`` is a 1-D uint8 CPU tensor; for codec ``none`` it is a view of the input."""

    codec: str
    data: torch.Tensor
    meta: bytes

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for this tensor (data and meta)."""
        return self.data.numel() + len(self.meta)

    def buffer(self) -> memoryview:
        """``data`` as a flat byte view (no copy), e.g. for ``hashlib`` or a file write."""
        return as_memoryview(self.data)


@dataclass(frozen=True)
class Header:
    codec_id: int
    dtype: torch.dtype
    numel: int
    data_nbytes: int
    params: tuple


class Codec(ABC):
    """A compression codec. Instances are immutable parameter sets (what ``choose_codec`` picks);
    decoding needs no instance, since every parameter travels in the meta."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    params: ClassVar[struct.Struct] = struct.Struct("<")
    # Whether the data's size follows from the element count and parameters alone (else it
    # also depends on the values: top-k sends fewer values for sparser input, varint gaps vary).
    exact_size: ClassVar[bool] = True
    error_feedback: bool = False

    def encode(self, x: torch.Tensor, state=None, *, name: str = "") -> Encoded:
        """Encode one tensor.

        Parameters
        ----------
        x
            The tensor (any shape; float32/bfloat16/float16/float64, any wire dtype for
            ``none``). A CUDA tensor is copied to the CPU first.
        state
            This tensor's ``TensorState``. Used only when ``error_feedback`` is on: the codec
            then compresses ``v = x + r`` and leaves ``r = v - decoded(v)`` in the state.
        name
            The tensor's name, for error messages.

        Returns
        -------
        Encoded
            ``codec`` and ``meta`` for the ``TensorEntry``, ``data`` for the payload.

        Raises
        ------
        CodecError
            NaN or Inf in ``x``, values the codec would overflow, a residual of another shape.
            The state is left unchanged.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who(name)}: expected a torch.Tensor, got {type(x).__name__}")
        xf = x.detach().to("cpu").reshape(-1)
        if xf.dtype not in DTYPE_CODES:
            raise CodecError(f"{who(name)}: dtype {xf.dtype} cannot be encoded")
        if xf.dtype not in FLOAT_DTYPES and self.name != "none":
            raise CodecError(f"{who(name)}: codec {self.name!r} needs a floating tensor")
        xf = xf.contiguous()
        if not self.error_feedback:
            state = None
        elif state is not None:
            state.prepare(x.shape, name)
        data, params = self._encode(xf, state, name)
        return Encoded(self.name, data, build_meta(self, xf, data, params))

    def max_encoded_bytes(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> int:
        """The most data bytes ``encode`` writes for a tensor of ``shape`` and ``dtype``.

        Exactly that many for a codec with ``exact_size``. The meta (at most ``MAX_META_BYTES``)
        is not counted: it travels apart, in the entry's ``codec_meta``.
        """
        n = math.prod(int(d) for d in shape)
        return self.data_bytes(n, dtype, self._size_params(n))[1]

    def _size_params(self, numel: int) -> tuple:
        """The meta parameters ``encode`` writes for ``numel`` elements, as far as they decide
        the data's size (those that depend on the values are left 0)."""
        return ()

    @classmethod
    @abstractmethod
    def data_bytes(cls, numel: int, dtype: torch.dtype, params: tuple) -> tuple[int, int]:
        """``(fewest, most)`` data bytes a valid encoding of ``numel`` elements of source
        ``dtype`` with the meta's (already checked) ``params`` has; equal for ``exact_size``."""

    @classmethod
    def data_range(cls, h: Header, name: str) -> tuple[int, int]:
        """Check a meta's parameters; ``data_bytes`` for its element count and dtype."""
        cls._check_params(h, name)
        return cls.data_bytes(h.numel, h.dtype, h.params)

    @abstractmethod
    def _encode(self, xf: torch.Tensor, state, name: str) -> tuple[torch.Tensor, tuple]:
        """Flat contiguous CPU input -> (uint8 data, parameter tuple for the meta)."""

    @classmethod
    @abstractmethod
    def _decode(
        cls, out: torch.Tensor, data: torch.Tensor, h: Header, alpha: float, add: bool, name: str
    ) -> None:
        """Write (``add=False``) or add ``alpha`` times the decoded values into flat ``out``.
        Must raise before touching ``out`` if anything is invalid; ``out=None``: only check."""

    @classmethod  # noqa: B027 (a no-op by default: most codecs take no parameters)
    def _check_params(cls, h: Header, name: str) -> None:
        """Raise ``CodecError`` unless the meta's parameters are valid."""


def build_meta(codec: Codec, xf: torch.Tensor, data: torch.Tensor, params: tuple) -> bytes:
    head = HEADER.pack(
        MAGIC,
        VERSION,
        codec.codec_id,
        DTYPE_CODES[xf.dtype],
        xf.numel(),
        data.numel(),
        zlib.crc32(as_memoryview(data)),
    ) + codec.params.pack(*params)
    return head + _CRC.pack(zlib.crc32(head))


def parse_meta(
    meta: bytes | bytearray | memoryview,
    registry: dict[int, type[Codec]],
    codec: str | None,
    name: str,
) -> tuple[type[Codec], Header, int]:
    """Check a meta on its own and return its codec class, header and data CRC."""
    meta = bytes(meta)
    n = len(meta)
    if not HEADER.size + _CRC.size <= n <= MAX_META_BYTES:
        raise CodecError(f"{who(name)}: codec meta of {n} bytes is truncated or oversized")
    if zlib.crc32(meta[:-4]) != _CRC.unpack_from(meta, n - 4)[0]:
        raise CodecError(f"{who(name)}: codec meta fails its CRC32 check (corrupted or truncated)")
    magic, version, cid, dcode, numel, nbytes, dcrc = HEADER.unpack_from(meta)
    if magic != MAGIC or version != VERSION:
        raise CodecError(f"{who(name)}: codec meta has magic {magic!r} version {version}")
    cls = registry.get(cid)
    if cls is None:
        raise CodecError(f"{who(name)}: codec meta names unknown codec id {cid}")
    if codec is not None and codec != cls.name:
        raise CodecError(f"{who(name)}: manifest says codec {codec!r}, its meta says {cls.name!r}")
    if n != HEADER.size + cls.params.size + _CRC.size:
        raise CodecError(f"{who(name)}: codec meta for {cls.name!r} has the wrong length {n}")
    dtype = CODE_DTYPES.get(dcode)
    if dtype is None or (dtype not in FLOAT_DTYPES and cls.name != "none"):
        raise CodecError(f"{who(name)}: codec meta has an invalid source dtype code {dcode}")
    params = cls.params.unpack_from(meta, HEADER.size)
    return cls, Header(cid, dtype, numel, nbytes, params), dcrc


def as_bytes_tensor(data, name: str) -> torch.Tensor:
    """A 1-D uint8 CPU tensor over ``data`` (copied only when ``data`` is read-only)."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.device.type != "cpu":
            raise CodecError(f"{who(name)}: codec data must be a uint8 CPU tensor")
        return data.reshape(-1).contiguous()
    view = memoryview(data).cast("B")
    if view.readonly:
        # torch.frombuffer warns on read-only memory; decoding only reads, but stay quiet.
        view = memoryview(bytearray(view))
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def as_memoryview(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")


def typed(u8: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at byte ``start`` of ``u8`` (copied if misaligned)."""
    size = dtype.itemsize
    part = u8[start : start + count * size]
    if part.storage_offset() % size or part.data_ptr() % size:
        part = part.clone()
    return part.view(dtype)


def finite_absmax(xf: torch.Tensor, name: str) -> float:
    """max |x|, refusing NaN and Inf with a message that counts them (one reduction pass)."""
    if xf.numel() == 0 or xf.dtype not in FLOAT_DTYPES:
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(xf))
    if math.isfinite(lo) and math.isfinite(hi):
        return max(-lo, hi)
    nans = int(torch.isnan(xf).sum())
    infs = int(torch.isinf(xf).sum())
    raise CodecError(
        f"{who(name)}: input has {nans} NaN and {infs} infinite values; refusing to encode"
    )


def refuse_overflow(xmax: float, bound: float, name: str) -> None:
    """Refuse ``|x| + max|r| >= FLT_MAX / 2``: then neither ``x + r`` nor any later residual
    can overflow float32. Checked before the residual is touched."""
    if xmax + bound >= FLT_MAX / 2:
        extra = f" plus the error-feedback residual's {bound:.6g}" if bound else ""
        raise CodecError(
            f"{who(name)}: max |x| = {xmax:.6g}{extra} would overflow float32 in this codec "
            f"(limit {FLT_MAX / 2:.4g}); use codec 'none' for this tensor"
        )


def chunks(n: int, per: int):
    """``(start, stop)`` element ranges of at most ``per`` (a multiple of the block size)."""
    for e0 in range(0, n, per):
        yield e0, min(n, e0 + per)
